"""Where a short vector episode's recorder CPU goes, and the part batching cannot remove.

    python bench/vector_floor.py [--rounds R] [--vector-steps V] [--no-broker] [--json PATH]

Issue 43's contract asks `begin_episodes` + `log_steps` to cost at most 0.5x the CPU of N single
`begin_episode`/`log_step` calls per sub-env step on a native `CartPoleVectorEnv` (N=64,
NEXT_STEP). Short episodes (random actions, ~22 steps) miss it. This script says why, on the
short trace of `bench/producer.py` (`VectorTrace`), in two parts:

``parts`` (no broker): each side records the trace through a stand-in producer that keeps the
delivery reports until the end and then serves them on the caller's thread, so every figure is
the calling thread's CPU (`time.thread_time`), per episode: the episode starts
(`begin_episodes` / `begin_episode`), the steps (`log_steps` / `log_step`, less their batch
encoding), the batch encoding and hand-over (`_emit_rows` / `_emit`, timed around each call),
the harness (the same loop driving a recorder whose methods do nothing: masks and row splitting)
and the delivery reports. Timing the recorder's methods adds their wrapper's cost to the totals
(a few %); the unwrapped total is printed beside them.

``floor`` (a broker: `LocalBroker` unless ``--bootstrap-servers``): the messages the single
calls send are captured (stand-in producer), then handed to librdkafka again by a bare loop -
one ``produce()`` each with the recorder's producer settings, headers and a ``functools.partial``
delivery callback that updates counters under a lock, as the recorder's does - while a thread
polls (as the recorder's poller). Its CPU (all threads, until ``flush()`` returns) is what the
episode's two messages cost on either side whatever the recorder does in Python: byte-identical
batching sends the same messages. The same rounds record the short trace batched and single
(`bench/producer.py`'s own functions) and the long trace (its per-step cost, ~500 steps an
episode), alternating the order, so per short episode

    batched = messages + 22.5 x (long trace's batched µs/step) + batched per-episode work
    single  = messages + 22.5 x (long trace's single µs/step)  + single per-episode work

and the per-episode work of each side is what is left. Medians of the rounds after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from functools import partial

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.producer import (
    STAND_IN,
    VectorTrace,
    _StandInProducer,
    _vector_recorder,
    run_vector_batched,
    run_vector_single,
)


class _HeldReports(_StandInProducer):
    """Keeps every message (key, value, headers, records) and its delivery report; `serve` runs
    the reports on the caller's thread (the recorder's poller finds none)."""

    def __init__(self):
        super().__init__()
        self.messages: list[tuple] = []

    def produce(self, topic, value, key=None, headers=None, on_delivery=None):
        self.messages.append((key, value, headers, on_delivery.args[1]))
        self._pending.append(on_delivery)

    def poll(self, timeout=0):
        if timeout:
            time.sleep(min(timeout, 0.01))
        return 0

    def serve(self) -> None:
        pending, self._pending = self._pending, []
        for cb in pending:
            cb(None, None)

    def flush(self, timeout=-1):
        self.serve()
        return 0


def drive(rec, side: str, v: VectorTrace) -> None:
    """`bench/producer.py`'s two ways of recording the trace, on any object with the calls."""
    if side == "batched":
        begin, log = rec.begin_episodes, rec.log_steps
        ids = begin(v.first)
        for a, r, obs, term, trunc, resetting in v.steps:
            if resetting.any():
                log(ids, a, r, obs, term, trunc, rows=~resetting)
                idx = np.flatnonzero(resetting)
                for i, eid in zip(idx.tolist(), begin(obs[idx])):
                    ids[i] = eid
            else:
                log(ids, a, r, obs, term, trunc)
        return
    begin, log = rec.begin_episode, rec.log_step
    ids = [begin(o) for o in v.first]
    for a, r, obs, term, trunc, resetting in v.steps:
        rows = zip(a.tolist(), r.tolist(), obs, term.tolist(), trunc.tolist(), resetting.tolist())
        for i, (ai, ri, oi, te, tr, rs) in enumerate(rows):
            if rs:
                ids[i] = begin(oi)
            else:
                log(ids[i], ai, ri, oi, te, tr)


class _Nothing:
    """The calls, doing nothing: what the harness itself costs."""

    def begin_episodes(self, observations):
        return [None] * len(observations)

    def log_steps(self, *args, **kwargs):
        pass

    def begin_episode(self, observation):
        return None

    def log_step(self, *args):
        pass


#: the recorder's methods timed per side: label -> method (`log_step` is not timed: a timer
#: around each of its calls would cost a share of it; its part is what the total leaves)
_TIMED = {
    "batched": {"start": "begin_episodes", "steps": "log_steps", "encode_send": "_emit_rows"},
    "single": {"start": "begin_episode", "encode_send": "_emit"},
}


def _recorded(side: str, v: VectorTrace, timed: bool) -> tuple[int, int, dict, list]:
    """(caller CPU ns recording the trace, ns serving its delivery reports, ns per timed method,
    the messages) of one fresh recorder with held reports."""
    from rlrec.producer.batched import BatchedCalls
    from rlrec.producer.recorder import EpisodeRecorder

    rec = _vector_recorder(STAND_IN, "t")
    rec.max_batch_delay_s = 1e9  # no lingering batch: the poller does nothing
    rec._producer = held = _HeldReports()
    acc: dict[str, int] = {}
    saved = []
    if timed:
        clock = time.thread_time_ns
        for label, name in _TIMED[side].items():
            cls = BatchedCalls if name in ("begin_episodes", "log_steps", "_emit_rows") else EpisodeRecorder
            fn = getattr(cls, name)

            def timed_fn(*a, _fn=fn, _label=label, **k):
                t = clock()
                try:
                    return _fn(*a, **k)
                finally:
                    acc[_label] = acc.get(_label, 0) + clock() - t

            saved.append((cls, name, fn))
            setattr(cls, name, timed_fn)
    try:
        t = time.thread_time_ns()
        drive(rec, side, v)
        total = time.thread_time_ns() - t
        t = time.thread_time_ns()
        held.serve()
        reports = time.thread_time_ns() - t
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
    rec.close()
    return total, reports, acc, held.messages


def parts(v: VectorTrace, rounds: int) -> dict:
    """Per episode µs of each side's parts (see the module docstring), medians of `rounds`."""
    eps = v.episodes
    out = {}
    for side in ("batched", "single"):
        plain, timed, harness = [], [], []
        for r in range(rounds + 1):
            p = _recorded(side, v, False)
            w = _recorded(side, v, True)
            t = time.thread_time_ns()
            drive(_Nothing(), side, v)
            h = time.thread_time_ns() - t
            if r:  # the first is a warm-up
                plain.append(p)
                timed.append(w)
                harness.append(h)

        def med(xs):
            return statistics.median(xs) / eps / 1000

        row = {
            "total_unwrapped": med([p[0] + p[1] for p in plain]),
            "total_timed": med([w[0] + w[1] for w in timed]),
            "harness": med(harness),
            "delivery_reports": med([w[1] for w in timed]),
        }
        for label in _TIMED[side]:
            row[label] = med([w[2].get(label, 0) for w in timed])
        if side == "batched":  # the steps' own part: log_steps less its encoding and hand-over
            row["steps"] -= row["encode_send"]
        else:  # log_step's, less its encoding and hand-over: what the timed total leaves
            row["steps"] = med([w[0] for w in timed]) - row["start"] - row["encode_send"] - row["harness"]
        out[side] = row
    out["messages_per_episode"] = len(_recorded("single", v, False)[3]) / eps
    return out


def _replay(bootstrap: str, messages: list, callbacks: bool) -> float:
    """CPU seconds (all threads) of a bare producer handing `messages` over, polled by a thread."""
    from confluent_kafka import Producer

    conf = {
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "compression.type": "lz4",
        "linger.ms": 20,
        "queue.buffering.max.messages": 1_000_000,
    }
    p = Producer(conf)
    topic = f"bench-vector-floor-{uuid.uuid4().hex[:8]}"
    p.produce(topic, b"warm-up", b"k")
    p.flush(30)
    stop = threading.Event()

    def poller():
        while not stop.is_set():
            p.poll(0.05)

    th = threading.Thread(target=poller, daemon=True)
    th.start()
    lock, counts = threading.RLock(), [0, 0, 0]

    def on_delivery(key, records, err, msg):  # what the recorder's does with its counters
        with lock:
            counts[0] -= records
            if err is None:
                counts[1] += records
            else:
                counts[2] += records

    produce = p.produce
    c = time.process_time()
    if callbacks:
        for key, value, headers, records in messages:
            produce(topic, value, key, headers=headers, on_delivery=partial(on_delivery, key.decode(), records))
    else:
        for key, value, headers, _ in messages:
            produce(topic, value, key, headers=headers)
    left = p.flush(60)
    cpu = time.process_time() - c
    stop.set()
    th.join()
    assert left == 0 and counts[2] == 0, (left, counts)
    return cpu


def floor(bootstrap: str, short: VectorTrace, long: VectorTrace, rounds: int) -> dict:
    """Per short episode µs: its messages through librdkafka, both sides, and the long trace's
    per-step costs, alternated rounds (see the module docstring)."""
    messages = _recorded("single", short, False)[3]
    eps = short.episodes
    sides = {
        "messages": lambda: _replay(bootstrap, messages, True) / eps * 1e6,
        "messages_no_reports": lambda: _replay(bootstrap, messages, False) / eps * 1e6,
        "batched": lambda: run_vector_batched(bootstrap, _topic("b"), short) * short.transitions / eps,
        "single": lambda: run_vector_single(bootstrap, _topic("s"), short) * short.transitions / eps,
        "long_batched_per_step": lambda: run_vector_batched(bootstrap, _topic("lb"), long),
        "long_single_per_step": lambda: run_vector_single(bootstrap, _topic("ls"), long),
    }
    raw: dict[str, list] = {k: [] for k in sides}
    for r in range(rounds + 1):
        order = list(sides) if r % 2 else list(reversed(sides))
        got = {k: sides[k]() for k in order}
        if r:
            for k, x in got.items():
                raw[k].append(x)
    steps = short.transitions / eps
    med = {k: statistics.median(xs) for k, xs in raw.items()}
    per_round = {
        side: [
            t - m - steps * p for t, m, p in zip(raw[side], raw["messages"], raw[f"long_{side}_per_step"], strict=True)
        ]
        for side in ("batched", "single")
    }
    return {
        "steps_per_episode": steps,
        "medians": med,
        "raw": raw,
        "ratio_per_round": [b / s for b, s in zip(raw["batched"], raw["single"], strict=True)],
        "messages_share_of_single_per_round": [m / s for m, s in zip(raw["messages"], raw["single"], strict=True)],
        "per_episode_work": {k: statistics.median(xs) for k, xs in per_round.items()},
        "per_episode_work_per_round": per_round,
    }


def _topic(side: str) -> str:
    return f"bench-vector-floor-{side}-{uuid.uuid4().hex[:8]}"


def print_report(res: dict) -> None:
    p = res["parts"]
    print(f"per short episode ({p['messages_per_episode']:.2f} messages), µs, caller's thread, stand-in producer")
    print(f"{'part':<34}{'batched':>9}{'single':>9}")
    for key, label in (
        ("start", "episode start"),
        ("steps", "steps (less encoding)"),
        ("encode_send", "batch encoding + hand-over"),
        ("harness", "harness (rows, masks)"),
        ("delivery_reports", "delivery reports"),
        ("total_timed", "total (methods timed)"),
        ("total_unwrapped", "total (nothing timed)"),
    ):
        print(f"{label:<34}{p['batched'][key]:>9.1f}{p['single'][key]:>9.1f}")
    f = res.get("floor")
    if f:
        m = f["medians"]
        print(f"librdkafka, per short episode ({f['steps_per_episode']:.1f} steps), µs, all threads")
        print(
            f"  its messages: produce()+delivery {m['messages']:.1f} (produce() alone {m['messages_no_reports']:.1f})"
        )
        print(f"  batched {m['batched']:.1f}, single {m['single']:.1f}; round ratios {_fmt(f['ratio_per_round'])}")
        print(f"  messages' share of single: {_fmt(f['messages_share_of_single_per_round'])}")
        print(
            f"  long trace µs/step: batched {m['long_batched_per_step']:.2f}, single {m['long_single_per_step']:.2f};"
            f" per-episode work left: batched {f['per_episode_work']['batched']:.1f},"
            f" single {f['per_episode_work']['single']:.1f}"
        )


def _fmt(xs: list) -> str:
    return f"median {statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vector-steps", type=int, default=1500)
    ap.add_argument("--bootstrap-servers", default=None)
    ap.add_argument("--no-broker", action="store_true", help="only the parts (no librdkafka floor)")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    short = VectorTrace(False, args.vector_steps)
    res: dict = {"load": os.getloadavg(), "parts": parts(short, args.rounds)}
    if not args.no_broker:
        long = VectorTrace(True, args.vector_steps)
        broker = None
        bootstrap = args.bootstrap_servers
        if bootstrap is None:
            from rlrec.local import LocalBroker

            broker = LocalBroker().start()
            bootstrap = broker.bootstrap_servers
        try:
            res["floor"] = floor(bootstrap, short, long, args.rounds)
        finally:
            if broker is not None:
                broker.stop()
    res["load_after"] = os.getloadavg()
    print_report(res)
    print(f"load average before {res['load'][0]:.1f}, after {res['load_after'][0]:.1f}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
