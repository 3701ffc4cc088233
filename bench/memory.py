"""Memory benchmark: the consumer's peak RSS under a hostile mix, against its configured budgets.

    python bench/memory.py [--quick] [--json PATH] [--rounds R]

A one-partition topic of an embedded Tansu broker gets, pre-published and interleaved:

  * huge infos: step batches whose info is ~1.4 MB of JSON small integers (~7 MB once parsed:
    Python objects cost ~5x their JSON);
  * huge spaces: episode starts with a different Box space each, of 100,000 elements (~1.2 MB
    of JSON; 0.8 MB of bounds once parsed), too large to be cached;
  * endless episodes: episodes that keep stepping (0.5 MB batches) and never end;
  * ordinary CartPole-size episodes (they must still land).

A fresh child process runs the real `RecorderConsumer` with budgets max_open_bytes = 128 MiB,
max_episode_bytes = 32 MiB, max_buffered_bytes = 64 MiB and samples its own RSS every 20 ms,
from the moment it is assigned the partition (its idle RSS: imports, Kafka clients, Ray's
episode classes, all imported and warmed up first) until it has read everything. Reported: peak
RSS above idle, against the sum of the budgets that bound what the consumer holds -- open
episodes, finished-but-unwritten episodes (waiting or being encoded), the parsed-space cache
(64 MiB) and the shard encoder's per-space serialisations (2 x 8 MiB), unacknowledged dead
letters (64 MiB, and librdkafka's copy of them: 64 MiB), librdkafka's prefetch queue (64 MiB)
and the batch of messages in hand (as much again) -- plus one message in flight as decoded
(max_message_bytes x 8). Every term is a setting, none grows with the input: the full mix
publishes 2.5x the quick one. Rounds run in fresh processes; the median and spread are reported,
with every round's figures in the JSON.

Target: peak RSS above idle <= that sum (ratio <= 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

MiB = 2**20
BUDGETS = {
    "max_open_bytes": 128 * MiB,
    "max_episode_bytes": 32 * MiB,
    "max_buffered_bytes": 64 * MiB,
    "max_message_bytes": 4 * MiB,
}
SPACE_CACHE = 64 * MiB  # rlrec.producer.events._SpaceCache
SPACE_MEMOS = 2 * 8 * MiB  # the shard encoder's per-space serialisations (two `per_space` memos)
DLQ_PENDING = 2 * 64 * MiB  # MAX_PENDING_DEAD_LETTER_BYTES, and librdkafka's copy (queue.buffering.max.kbytes)
PREFETCH = 64 * MiB  # librdkafka's queued.max.messages.kbytes (the consumer sets it)
BATCH = 64 * MiB  # the messages of one consume() call in hand (at most what was prefetched)
IN_FLIGHT = 8 * BUDGETS["max_message_bytes"]  # one message as decoded (JSON infos expand)
BOUND = (
    BUDGETS["max_open_bytes"]
    + BUDGETS["max_buffered_bytes"]
    + SPACE_CACHE
    + SPACE_MEMOS
    + DLQ_PENDING
    + PREFETCH
    + BATCH
    + IN_FLIGHT
)
TARGET_RATIO = 1.0


def _arr(a: np.ndarray) -> dict:
    from rlrec.producer.arrays import array_to_wire

    return array_to_wire(np.ascontiguousarray(a))


def _start(eid: str, space_json: str | None = None, obs_dim: int = 4) -> tuple[bytes, list]:
    from gymnasium import spaces as gs

    from rlrec.producer.events import encode_record, schema_header
    from rlrec.producer.spaces import dumps_space

    rec = {
        "episode_id": eid,
        "policy_id": "pol",
        "policy_version": 1,
        "env_id": "bench",
        "observation": [_arr(np.zeros(obs_dim, np.float32))],
        "info": "",
        "observation_space": space_json or dumps_space(gs.Box(-10, 10, (obs_dim,), np.float32)),
        "action_space": dumps_space(gs.Discrete(2)),
        "timestamp_ms": int(time.time() * 1000),
    }
    return encode_record("EpisodeStart", rec), schema_header("EpisodeStart")


def _steps(eid: str, t0: int, n: int, *, obs_dim: int = 4, info: str | None = None, last: bool = False):
    from rlrec.producer.events import encode_record, schema_header

    rec = {
        "episode_id": eid,
        "t0": t0,
        "actions": [_arr(np.zeros(n, np.int64))],
        "rewards": _arr(np.ones(n)),
        "observations": [_arr(np.zeros((n, obs_dim), np.float32))],
        "terminated": last,
        "truncated": False,
        "infos": None if info is None else [info] + [""] * (n - 1),
        "extra_model_outputs": {},
        "timestamp_ms": int(time.time() * 1000),
    }
    return encode_record("StepBatch", rec), schema_header("StepBatch")


def hostile_mix(scale: float) -> list[tuple[bytes, bytes, list]]:
    """(key, value, headers) in publish order; `scale` shrinks it for --quick."""
    from gymnasium import spaces as gs

    from rlrec.producer.spaces import dumps_space

    rng = np.random.default_rng(0)
    msgs = []
    big_info = json.dumps({"x": list(range(200_000))})
    n_info, n_space, n_endless, n_good = (max(1, int(k * scale)) for k in (60, 60, 40, 200))
    endless_t = {}
    for i in range(max(n_info, n_space, n_endless, n_good)):
        if i < n_good:
            eid = f"good-{i}"
            msgs += [(eid.encode(), *_start(eid)), (eid.encode(), *_steps(eid, 0, 50, last=True))]
        if i < n_info:
            eid = f"info-{i}"
            msgs += [(eid.encode(), *_start(eid)), (eid.encode(), *_steps(eid, 0, 1, info=big_info))]
        if i < n_space:
            eid = f"space-{i}"
            low = -rng.integers(1, 100, 100_000).astype(np.float32)
            space = dumps_space(gs.Box(low, -low, dtype=np.float32))
            msgs.append((eid.encode(), *_start(eid, space, obs_dim=100_000)))
        if i < n_endless:
            endless_t[f"endless-{i}"] = 0
            msgs.append((f"endless-{i}".encode(), *_start(f"endless-{i}", obs_dim=256)))
        for eid, t in list(endless_t.items()):  # every endless episode steps again
            msgs.append((eid.encode(), *_steps(eid, t, 500, obs_dim=256)))
            endless_t[eid] = t + 500
    return msgs


# ---------------------------------------------------------------------------------------------
# the measured child


def _worker(spec: dict) -> dict:
    import psutil

    # what the consumer imports when it first builds an episode, before the idle figure is taken
    from gymnasium import spaces as gs

    import rlrec.store.shards  # noqa: F401 - pyarrow, msgpack
    from rlrec.consumer.service import ConsumerConfig, RecorderConsumer
    from rlrec.local import FAST_GROUP_KAFKA
    from rlrec.store.episodes import to_single_agent_episode
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    to_single_agent_episode(expert_cartpole_episodes(1, max_steps=10)[0])
    gs.Box(-1, 1, (2,))
    proc = psutil.Process()
    cfg = ConsumerConfig(
        bootstrap_servers=spec["bootstrap"],
        output=spec["output"],
        topic=spec["topic"],
        group_id=f"mem-{uuid.uuid4().hex[:8]}",
        max_file_age_s=0.5,
        commit_interval_s=1.0,
        create_topics=False,
        kafka_config=dict(FAST_GROUP_KAFKA),
        **BUDGETS,
    )
    c = RecorderConsumer(cfg)
    state = {"idle": None, "peak": 0, "last_bytes": 0.0, "last_change": time.time(), "open_peak": 0}
    orig_assign = c._on_assign

    def assigned(consumer, partitions):
        orig_assign(consumer, partitions)
        if partitions and state["idle"] is None:
            state["idle"] = proc.memory_info().rss

    c._on_assign = assigned

    def sample():
        while not c._stop.is_set():
            rss = proc.memory_info().rss
            state["peak"] = max(state["peak"], rss)
            state["open_peak"] = max(state["open_peak"], c.metrics.open_bytes._value.get())
            got = c.metrics.bytes_in._value.get()
            if got != state["last_bytes"]:
                state["last_bytes"], state["last_change"] = got, time.time()
            elif got >= spec["value_bytes"] and time.time() - state["last_change"] > 2.0:
                c.stop()  # everything read, and the consumer had 2 s to act on it
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    timer = threading.Timer(600, c.stop)
    timer.start()
    try:
        c.run(install_signals=False)
    finally:
        timer.cancel()
    dead = {
        s.labels["reason"]: s.value
        for m in c.metrics.dead_letters.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }
    return {
        "idle_rss_mb": state["idle"] / MiB,
        "peak_rss_mb": state["peak"] / MiB,
        "peak_above_idle_mb": (state["peak"] - state["idle"]) / MiB,
        "open_bytes_peak_mb": state["open_peak"] / MiB,
        "bytes_in_mb": state["last_bytes"] / MiB,
        "episodes_committed": c.metrics.episodes_committed._value.get(),
        "dead_letters": dead,
    }


def run(rounds: int, scale: float) -> dict:
    from confluent_kafka import Producer

    from rlrec.consumer.topics import create_topics, dlq_topic_name
    from rlrec.local import LocalBroker

    msgs = hostile_mix(scale)
    raw_mb = sum(len(k) + len(v) for k, v, _ in msgs) / MiB
    results = []
    with tempfile.TemporaryDirectory(prefix="rlrec-bench-mem-") as tmp:
        for r in range(rounds):
            broker = LocalBroker().start()  # a fresh one per round: memory:// keeps every topic in RAM
            try:
                topic = f"mem-{uuid.uuid4().hex[:8]}"
                create_topics(broker.bootstrap_servers, {topic: 1, dlq_topic_name(topic): 1})
                p = Producer(
                    {
                        "bootstrap.servers": broker.bootstrap_servers,
                        "message.max.bytes": 8 * MiB,
                        "linger.ms": 5,
                        "acks": "all",
                    }
                )
                for key, value, headers in msgs:
                    while True:
                        try:
                            p.produce(topic, value, key, headers=headers)
                            break
                        except BufferError:
                            p.poll(0.1)
                assert p.flush(60) == 0
                spec = {
                    "bootstrap": broker.bootstrap_servers,
                    "topic": topic,
                    "output": os.path.join(tmp, f"out{r}"),
                    "value_bytes": sum(len(v) for _k, v, _h in msgs),
                }
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", json.dumps(spec)],
                    capture_output=True,
                    text=True,
                    timeout=900,
                    cwd=ROOT,
                )
                if out.returncode != 0:
                    raise RuntimeError(f"worker failed:\n{out.stderr[-4000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                print(
                    f"round {r + 1}: peak {res['peak_rss_mb']:.0f} MB (idle {res['idle_rss_mb']:.0f}), "
                    f"open peak {res['open_bytes_peak_mb']:.0f} MB, dead letters {res['dead_letters']}",
                    flush=True,
                )
                results.append(res)
            finally:
                broker.stop()
    above = [x["peak_above_idle_mb"] for x in results]
    return {
        "rounds": results,
        "messages": len(msgs),
        "published_mb": raw_mb,
        "budgets_mb": {k: v / MiB for k, v in BUDGETS.items()},
        "bound_mb": BOUND / MiB,
        "peak_above_idle_mb_median": statistics.median(above),
        "peak_above_idle_mb_spread": [min(above), max(above)],
        "ratio_to_bound": statistics.median(above) / (BOUND / MiB),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a small mix, one round (smoke test)")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(_worker(json.loads(a.worker))))
        return 0
    res = run(1 if a.quick else a.rounds, 0.2 if a.quick else 0.5)
    print(
        f"published {res['published_mb']:.0f} MB in {res['messages']} messages; peak RSS above idle: median "
        f"{res['peak_above_idle_mb_median']:.0f} MB (spread {res['peak_above_idle_mb_spread'][0]:.0f}-"
        f"{res['peak_above_idle_mb_spread'][1]:.0f}) vs the budgets' bound {res['bound_mb']:.0f} MB"
    )
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
