"""Consumer scale-out: steps/s of 1 vs 2 `rlrec consume`-style processes in one consumer group.

    python bench/consumer_scaleout.py [--episodes N] [--rounds R] [--quick] [--json PATH]

One 4-partition topic on an embedded Tansu broker is filled once (CartPole-size episodes of
50-200 steps through `EpisodeRecorder`, `bench.consumer.publish`). Each run starts N child
processes (each a real `RecorderConsumer`, the class behind `rlrec consume`) with a fresh group id
and a fresh output directory, and they drain the whole topic together. Clock: the first message
any process sees -> the last manifest commit (`commit_time` of the newest manifest entry), so
interpreter start-up and imports are outside it; group joins and rebalances are inside (they
are part of scaling out). After each run the manifest must hold every episode exactly once.

Runs alternate N=1 and N=2 (the order flips every round) for --rounds rounds; the JSON keeps
every run, and the medians and spreads (min, max) per N.

Read the result for what it is: on a machine with 2 shared cores the broker, 1-2 consumer
processes and this parent compete for the same CPUs, so N=2 shows *contention*, not scaling.
The per-process rate of N=1 (steps/s of one process that has the topic to itself) is the input
to the sizing model in docs/DEPLOY.md ("Sizing consumers").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from bench.consumer import worker_result  # noqa: E402
from rlrec.local import FAST_GROUP_KAFKA  # noqa: E402

PARTITIONS = 4


# ---------------------------------------------------------------------------------------------
# parent


def _spawn(spec: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )


def drain(bootstrap: str, topic: str, processes: int, expected: dict, workdir: str, timeout: float = 300) -> dict:
    """`processes` consumers in one fresh group drain `topic`; returns the run's figures."""
    import signal

    from rlrec.store.manifest import read_manifest
    from rlrec.store.storage import Storage

    group = f"scaleout-{uuid.uuid4().hex[:8]}"
    output = os.path.join(workdir, group)
    spec = {"bootstrap": bootstrap, "topic": topic, "group": group, "output": output}
    procs = [_spawn(spec) for _ in range(processes)]
    storage = Storage.from_uri(output)
    deadline = time.time() + timeout
    try:
        while True:  # the parent polls the manifest (cheaply: 4 Hz) until every episode is in
            entries = read_manifest(storage) if os.path.exists(output) else []
            if sum(e.episodes for e in entries) >= expected["episodes"]:
                break
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{processes} consumer(s) did not commit every episode in time")
            time.sleep(0.25)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # rlrec consume's graceful stop
    results = [worker_result(p, 60) for p in procs]
    entries = read_manifest(storage)
    ids = [i for e in entries for i in e.episode_ids]
    steps = sum(e.steps for e in entries)
    assert len(ids) == len(set(ids)) == expected["episodes"], (len(ids), len(set(ids)), expected)
    assert steps == expected["steps"], (steps, expected["steps"])
    t0 = min(r["first_message_time"] for r in results if r["first_message_time"] is not None)
    t1 = max(e.commit_time for e in entries)
    wall = t1 - t0
    return {
        "processes": processes,
        "steps_per_s": steps / wall,
        "wall_s": wall,
        "steps": steps,
        "shards": len(entries),
        "cpu_s": [r["cpu_s"] for r in results],  # per process, from run() to exit (imports excluded)
        "steps_by_process": [r["steps_committed"] for r in results],
        "partitions_by_process": [r["partitions_seen"] for r in results],
        "rebalances_by_process": [r["assignments"] for r in results],
    }


def run(episodes: int = 1500, rounds: int = 3, quick: bool = False) -> dict:
    """Publish once, then alternate 1- and 2-process runs; returns medians, spreads and every run."""
    from bench.consumer import publish
    from rlrec.consumer.topics import create_topics, dlq_topic_name
    from rlrec.local import LocalBroker

    if quick:
        episodes, rounds = min(episodes, 200), 1
    runs: list[dict] = []
    with LocalBroker("memory") as broker, tempfile.TemporaryDirectory(prefix="rlrec-scaleout-") as tmp:
        topic = f"scaleout-{uuid.uuid4().hex[:6]}"
        create_topics(broker.bootstrap_servers, {topic: PARTITIONS, dlq_topic_name(topic): PARTITIONS})
        expected = publish(broker.bootstrap_servers, topic, episodes)
        for rnd in range(rounds):
            for n in (1, 2) if rnd % 2 == 0 else (2, 1):
                r = drain(broker.bootstrap_servers, topic, n, expected, tmp)
                r["round"] = rnd
                runs.append(r)
                print(f"round {rnd} processes={n}: {r['steps_per_s']:,.0f} steps/s ({r['wall_s']:.2f}s)", flush=True)

    def per(n: int) -> list[float]:
        return [r["steps_per_s"] for r in runs if r["processes"] == n]

    one, two = per(1), per(2)
    return {
        "episodes": expected["episodes"],
        "steps": expected["steps"],
        "messages": expected["messages"],
        "partitions": PARTITIONS,
        "rounds": rounds,
        "cpu_count": os.cpu_count(),
        "one_process_steps_per_s": statistics.median(one),
        "two_processes_steps_per_s": statistics.median(two),
        "spread": {"one": [min(one), max(one)], "two": [min(two), max(two)]},
        "ratio_two_vs_one": statistics.median(two) / statistics.median(one),
        "runs": runs,
        "note": "2 shared cores: the broker, the consumers and the parent compete for CPU, so the "
        "2-process figure shows contention, not scaling",
    }


# ---------------------------------------------------------------------------------------------
# worker: one consumer process of the group


def worker(spec: dict) -> dict:
    from rlrec.consumer.service import ConsumerConfig, RecorderConsumer

    cfg = ConsumerConfig(
        bootstrap_servers=spec["bootstrap"],
        output=spec["output"],
        topic=spec["topic"],
        group_id=spec["group"],
        max_file_age_s=0.25,
        commit_interval_s=0.5,
        create_topics=False,
        kafka_config=dict(FAST_GROUP_KAFKA),
    )
    c = RecorderConsumer(cfg)
    seen: dict = {"first": None, "partitions": set(), "assignments": 0}
    on_assign, on_message = c._on_assign, c._on_message

    def assigned(consumer, partitions):
        seen["assignments"] += 1
        seen["partitions"] |= {p.partition for p in partitions}
        return on_assign(consumer, partitions)

    def message(m):
        if seen["first"] is None:
            seen["first"] = time.time()
        return on_message(m)

    c._on_assign, c._on_message = assigned, message
    cpu0 = time.process_time()
    c.run(install_signals=True)  # SIGTERM from the parent: flush, commit, exit
    return {
        "first_message_time": seen["first"],
        "cpu_s": time.process_time() - cpu0,
        "steps_committed": int(c.metrics.steps_committed._value.get()),
        "partitions_seen": sorted(seen["partitions"]),
        "assignments": seen["assignments"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of 1 and 2 processes")
    ap.add_argument("--quick", action="store_true", help="200 episodes, one round: a smoke test")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    r = run(args.episodes, args.rounds, args.quick)
    print(
        f"1 process: {r['one_process_steps_per_s']:,.0f} steps/s {r['spread']['one']}; "
        f"2 processes: {r['two_processes_steps_per_s']:,.0f} steps/s {r['spread']['two']}; "
        f"ratio {r['ratio_two_vs_one']:.2f} on {r['cpu_count']} cores ({r['note']})"
    )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(r, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
