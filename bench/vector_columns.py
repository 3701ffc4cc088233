"""What a per-slot column buffer would save the batched calls: an upper bound, not the recorder.

    python bench/vector_columns.py [--rounds R] [--vector-steps V] [--json PATH]

`EpisodeRecorder.log_steps` splits each vector step into per-row Python objects and appends them
to each episode's buffer (`producer/batched.py`), so its cost still grows with rows. The
alternative is a buffer per vector-env slot: each column (observations, actions, rewards) one
preallocated numpy array per slot, a vector step written with one fancy-indexed assignment per
column, and a finished episode's StepBatch encoded from its slices. `SlotColumns` below is that
alternative for the common case only (a single-leaf observation of the space's dtype, Discrete
actions, no infos, model outputs or delayed rewards, no overflow, no thread but the caller's);
the recorder would also need every other way into an episode's buffered steps (`log_step`,
`log_reward`, `abort_episode`, the lingering poller, `flush`, `close`, overflow) to move a slot's
steps back into the episode first. It sends the same messages as N `begin_episode`/`log_step`
calls (`check_identical` compares them byte for byte, frozen clock, stand-in producer), so its
CPU is a floor for what a shipped column buffer could reach.

Each round records the same short and long traces (bench/producer.py's `VectorTrace`) three
ways, rotating which goes first, each in a fresh recorder against the same broker: ``columns``
(this prototype), ``batched`` (`begin_episodes` + `log_steps`) and ``single`` (one call per row).
Figures: CPU µs per sub-env transition until `flush()` returns (all threads), medians over the
rounds after one warm-up, ratios to ``single`` per round (median, min-max) and of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from functools import partial

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.producer import VectorTrace, _vector_recorder, run_vector_batched, run_vector_single
from rlrec.producer import recorder as _r
from rlrec.producer.avro_write import _SMALL, ARRAY_END, long_bytes, string_bytes
from rlrec.producer.rows import new_episode_ids


def _long(n: int) -> bytes:
    return _SMALL[n] if n < 4096 else long_bytes(n)


class SlotColumns:
    """Per-slot column buffers of one vector env's episodes, writing through a recorder's
    producer and counters (see the module docstring for what it leaves out)."""

    def __init__(self, rec, n: int, new_ids=new_episode_ids):
        self.rec, self.n, self.new_ids = rec, n, new_ids
        obs, act = rec._obs, rec._act
        self.limit = rec._batch_limit
        self.obs = np.empty((n, self.limit, *obs.shape), obs.dtype)
        self.act = np.empty((n, self.limit), act.dtype)
        self.rew = np.empty((n, self.limit), np.float64)
        self.pos = np.zeros(n, np.int64)  # buffered steps per slot
        self.t = np.zeros(n, np.int64)  # steps logged per slot
        self.all_rows = np.arange(n)
        self.ids: list = [None] * n
        self.avro: list = [None] * n
        self.slot_of: dict = {}  # open episode id -> slot
        pid_env, spaces = rec._start_avro
        size = int(np.prod(obs.shape)) * obs.dtype.itemsize
        self.start_head = (
            pid_env[0]
            + long_bytes(rec._policy_version)
            + pid_env[1]
            + obs._count
            + obs._one_heads[0]
            + long_bytes(size)
        )
        self.start_tail = ARRAY_END + string_bytes("") + spaces
        self.a_head, self.a_tail = act._count + act._heads[0][0], act._heads[0][1]
        self.o_head, self.o_tail = obs._count + obs._heads[0][0], obs._heads[0][1]

    def begin(self, slots: list, observations: np.ndarray) -> list:
        """One EpisodeStart per slot (the reset observation per row), as `begin_episode` sends it."""
        rec, k = self.rec, len(slots)
        ids = self.new_ids(k)
        head, tail = self.start_head, self.start_tail + _r._now_ms_bytes()
        data = observations.tobytes()
        size = len(data) // k
        _, headers = rec._wire["EpisodeStart"]
        produce, topic, delivered = rec._producer.produce, rec.topic, rec._on_delivery
        with rec._lock:
            rec._buffered += k
            rec._msgs[0] += k
            rec._episodes_begun += k
            for j, (s, eid) in enumerate(zip(slots, ids)):
                kb = eid.encode()
                avro = long_bytes(len(kb)) + kb
                value = b"".join((avro, head, data[j * size : (j + 1) * size], tail))
                produce(topic, value, kb, headers=headers, on_delivery=partial(delivered, eid, 1))
                self.ids[s], self.avro[s] = eid, avro
                self.slot_of[eid] = s
                self.t[s] = 0
        return ids

    def log(self, ids: list, actions, rewards, observations, terminated, truncated, rows=None) -> None:
        """One vector step: every selected row's step written into its slot's columns; the
        batches of the slots that ended or filled sent."""
        rec = self.rec
        sel = self.all_rows if rows is None else np.flatnonzero(rows)
        if not np.isfinite(rewards).all():
            raise ValueError("reward must be finite")
        with rec._lock:
            slot_of = self.slot_of
            for i in sel.tolist():  # each row's episode is open, in its own slot
                if slot_of.get(ids[i]) != i:
                    raise ValueError(f"episode {ids[i]!r} is not open in slot {i}")
            p = self.pos[sel]
            self.obs[sel, p] = observations[sel]
            self.act[sel, p] = actions[sel]
            self.rew[sel, p] = rewards[sel]
            self.pos[sel] = p + 1
            self.t[sel] += 1
            rec._buffered += len(sel)
            due = (
                (terminated | truncated | (self.pos >= self.limit))
                if rows is None
                else rows & (terminated | truncated | (self.pos >= self.limit))
            )
            if due.any():
                self._emit(np.flatnonzero(due).tolist(), terminated, truncated)

    def emit_open(self) -> None:
        """Send every open episode's buffered steps (what `flush` does for open episodes)."""
        with self.rec._lock:
            live = [s for s in range(self.n) if self.pos[s] and self.ids[s] in self.slot_of]
            self._emit(live, np.zeros(self.n, bool), np.zeros(self.n, bool))

    def _emit(self, slots: list, terminated, truncated) -> None:
        rec = self.rec
        ts = _r._now_ms_bytes()
        _, headers = rec._wire["StepBatch"]
        produce, topic, delivered = rec._producer.produce, rec.topic, rec._on_delivery
        ended = []
        for s in slots:
            k, t1 = int(self.pos[s]), int(self.t[s])
            adata, odata = self.act[s, :k].tobytes(), self.obs[s, :k].tobytes()
            te, tr = bool(terminated[s]), bool(truncated[s])
            nb = _long(k)
            value = b"".join(
                (
                    self.avro[s],
                    _long(t1 - k),
                    self.a_head,
                    nb,
                    self.a_tail,
                    _long(len(adata)),
                    adata,
                    ARRAY_END,
                    _r._REWARDS_HEAD,
                    nb,
                    ARRAY_END,
                    _long(8 * k),
                    self.rew[s, :k].tobytes(),
                    self.o_head,
                    nb,
                    self.o_tail,
                    _long(len(odata)),
                    odata,
                    ARRAY_END,
                    _r._FLAGS[te, tr],
                    _r._UNION_0,
                    ARRAY_END,
                    ts,
                )
            )
            eid = self.ids[s]
            rec._msgs[0] += 1
            produce(topic, value, eid.encode(), headers=headers, on_delivery=partial(delivered, eid, k))
            self.pos[s] = 0
            if te or tr:
                del self.slot_of[eid]
                ended.append((eid, t1))
        if ended:
            rec._finished.set_many(ended)


def record_columns(rec, v: VectorTrace, new_ids=new_episode_ids) -> None:
    """The trace through `SlotColumns` (NEXT_STEP: reset rows masked out, then begun)."""
    cols = SlotColumns(rec, v.n, new_ids)
    ids = cols.begin(list(range(v.n)), v.first)
    for a, r, obs, term, trunc, resetting in v.steps:
        if resetting.any():
            cols.log(ids, a, r, obs, term, trunc, rows=~resetting)
            idx = np.flatnonzero(resetting)
            for i, eid in zip(idx.tolist(), cols.begin(idx.tolist(), obs[idx])):
                ids[i] = eid
        else:
            cols.log(ids, a, r, obs, term, trunc)
    cols.emit_open()


def run_columns(bootstrap: str, topic: str, v: VectorTrace) -> float:
    """CPU µs per sub-env transition of `record_columns` (as bench/producer.py's sides)."""
    rec = _vector_recorder(bootstrap, topic)
    c = time.process_time()
    record_columns(rec, v)
    left = rec.flush(120)
    cpu = time.process_time() - c
    stats = rec.stats
    rec.close()
    assert left == 0 and stats.failed == 0, stats
    return cpu / v.transitions * 1e6


def check_identical(vector_steps: int = 300) -> int:
    """The prototype's messages equal N single calls' (per Kafka key, in order; frozen clock, the
    same episode ids, a stand-in producer); returns the number of messages compared."""
    import itertools

    import gymnasium as gym

    from tests.helpers import keeping_recorder

    v = VectorTrace(False, vector_steps)
    spaces = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), gym.spaces.Discrete(2)
    got = []
    clock = _r._time
    try:
        _r._time = lambda: 1.7e9
        for side in ("columns", "single"):
            seq = itertools.count()
            rec, prod = keeping_recorder(*spaces, max_buffered_steps=10**6)
            if side == "columns":
                record_columns(rec, v, lambda n, seq=seq: [f"{next(seq):032x}" for _ in range(n)])
            else:
                ids = [rec.begin_episode(o, episode_id=f"{next(seq):032x}") for o in v.first]
                for a, r, obs, term, trunc, resetting in v.steps:
                    rows = zip(a.tolist(), r.tolist(), obs, term.tolist(), trunc.tolist(), resetting.tolist())
                    for i, (ai, ri, oi, te, tr, rs) in enumerate(rows):
                        if rs:
                            ids[i] = rec.begin_episode(oi, episode_id=f"{next(seq):032x}")
                        else:
                            rec.log_step(ids[i], ai, ri, oi, te, tr)
                rec.flush(10)
            per_key: dict = {}
            for key, value, _ in prod.messages:
                per_key.setdefault(key, []).append(value)
            got.append(per_key)
            rec.close()
    finally:
        _r._time = clock
    if got[0] != got[1]:
        raise AssertionError("the prototype's messages differ from N single calls'")
    return sum(map(len, got[1].values()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6, help="measured rounds after one warm-up [6]")
    ap.add_argument("--vector-steps", type=int, default=1500, help="vector steps (x64 sub-env steps) per trace [1500]")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    compared = check_identical()
    print(f"byte-identical to N single calls: {compared} messages compared", file=sys.stderr)
    from rlrec.local import LocalBroker

    sides = [("columns", run_columns), ("batched", run_vector_batched), ("single", run_vector_single)]
    out: dict = {"identical_messages_compared": compared}
    with LocalBroker() as broker:
        for long in (False, True):
            v = VectorTrace(long, args.vector_steps)
            raw: dict = {s: [] for s, _ in sides}
            for r in range(1 + args.rounds):
                order = sides[r % 3 :] + sides[: r % 3]
                got = {s: fn(broker.bootstrap_servers, f"bench-cols-{uuid.uuid4().hex[:8]}-{s}", v) for s, fn in order}
                print(
                    f"{'warm-up' if not r else f'round {r}'} {v.name}: "
                    + ", ".join(f"{s} {x:.2f}" for s, x in got.items()),
                    file=sys.stderr,
                    flush=True,
                )
                if r:
                    for s, x in got.items():
                        raw[s].append(x)
            med = {s: statistics.median(xs) for s, xs in raw.items()}
            per_round = {s: [x / y for x, y in zip(raw[s], raw["single"])] for s in ("columns", "batched")}
            out[v.name] = {
                "transitions": v.transitions,
                "episodes": v.episodes,
                "us_per_step": med,
                "ratio_of_medians": {s: med[s] / med["single"] for s in per_round},
                "ratio_per_round": per_round,
                "raw": raw,
            }
            for s, rs in per_round.items():
                print(
                    f"{v.name:<13} {s:<8} {med[s]:.2f} µs vs single {med['single']:.2f}: ratio of medians "
                    f"{med[s] / med['single']:.2f}, per round median {statistics.median(rs):.2f} "
                    f"({min(rs):.2f}-{max(rs):.2f})"
                )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
