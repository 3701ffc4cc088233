"""Consumer benchmark: steps/s of `RecorderConsumer` vs a bare poll loop and vs RLlib's writer.

    python bench/consumer.py [--episodes N] [--quick] [--json PATH] [--rounds R] [--max-file-age-s S]

The same messages are published once (CartPole-size episodes of 50-200 steps, a Discrete action
and one extra model output, through `EpisodeRecorder`) to a 4-partition topic of an embedded
Tansu broker (`rlrec.local.LocalBroker`), then processed three ways, each in a fresh child
process (so its peak RSS is its own; `ray.rllib`, which the consumer imports to build episodes,
is imported before any clock starts):

  (a) floor: a bare confluent-kafka loop (`assign`, `consume(1000)`), `rlrec.producer.events.decode`,
      `rlrec.consumer.assembly.PartitionAssembler`, and per finished episode
      `to_single_agent_episode` + `pack_episode` (RLlib's msgpack bytes). Writes and commits
      nothing. Clock: first message -> last episode packed.
  (b) ours: the real `RecorderConsumer` (fresh group id, small max_file_age_s) writing committed
      shards to a local temp dir. Clock: first message -> the manifest holds every episode
      (the moment the last manifest append returns); the manifest is read back afterwards.
  (c) RLlib's own write path for the same episodes: `pack_episode` (the numpy-form bytes (a)
      and (b) write; RLlib's list-form packing is slower) + `ray.data.from_items(...)
      .write_parquet(dir)` as `OfflineSingleAgentEnvRunner` does, ray.init(num_cpus=2) and a
      warm-up write outside the clock. Kafka is not involved (its reads are not counted).

(a) and (b) alternate for --rounds rounds and each keeps its best (this machine is shared and
noisy); (c) repeats --rounds times in one Ray session and keeps its best.

Freshness (shard commit time - episode end time, from `ConsumerMetrics.freshness_samples`) of
the timed run (b) measures how long the pre-published backlog waited, not the pipeline; so a
separate *live* run publishes episodes at a steady pace while a consumer runs, and its samples
give `freshness_p50_s`/`freshness_p99_s`. Both are reported.

Targets: steps/s (b)/(a) >= 0.5, (b)/(c) >= 3. `--quick` is a smoke test (< 60 s) judging
nothing: its `pass` fields are null.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from rlrec.local import FAST_GROUP_KAFKA, ray_on_loopback  # noqa: E402

ray_on_loopback()  # single-machine Ray: listen on 127.0.0.1 only

TARGET_VS_FLOOR = 0.5
TARGET_VS_RLLIB = 3.0
PARTITIONS = 4
MIN_LEN, MAX_LEN = 50, 200


# ---------------------------------------------------------------------------------------------
# parent side: broker, publishing, child processes


def _spaces():
    import gymnasium as gym

    return gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), gym.spaces.Discrete(2)


def publish(bootstrap: str, topic: str, episodes: int, seed: int = 0, pace_eps_per_s: float | None = None) -> dict:
    """Publish `episodes` CartPole-size episodes; returns {episodes, steps, messages}."""
    from rlrec.producer import EpisodeRecorder

    obs_space, act_space = _spaces()
    rng = np.random.default_rng(seed)
    rec = EpisodeRecorder(
        bootstrap,
        topic=topic,
        policy_id="bench",
        observation_space=obs_space,
        action_space=act_space,
        env_id="CartPole-v1",
    )
    steps = 0
    t0 = time.time()
    try:
        for i in range(episodes):
            length = int(rng.integers(MIN_LEN, MAX_LEN + 1))
            obs = rng.standard_normal((length + 1, 4)).astype(np.float32)
            acts = rng.integers(0, 2, length)
            logp = (-rng.random(length)).astype(np.float32)
            eid = rec.begin_episode(obs[0])
            for t in range(length):
                rec.log_step(
                    eid,
                    int(acts[t]),
                    1.0,
                    obs[t + 1],
                    terminated=t == length - 1,
                    extra_model_outputs={"action_logp": logp[t]},
                )
            steps += length
            if pace_eps_per_s:
                delay = t0 + (i + 1) / pace_eps_per_s - time.time()
                if delay > 0:
                    time.sleep(delay)
        left = rec.flush(60)
        stats = rec.stats
    finally:
        rec.close()
    assert left == 0 and stats.failed == 0, f"publishing left {left} undelivered, stats {stats}"
    return {"episodes": episodes, "steps": steps, "messages": stats.messages_produced}


def _spawn(mode: str, spec: dict, stderr=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", mode, json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        cwd=ROOT,
    )


def _result(proc: subprocess.Popen, timeout: float) -> dict:
    """Wait for the child's `RESULT {...}` line."""
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        result = None
        for line in proc.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
        rc = proc.wait()
    finally:
        timer.cancel()
    if result is None or rc != 0:
        raise RuntimeError(f"benchmark worker failed (exit code {rc}, result {result})")
    return result


def _wait_ready(proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    for line in proc.stdout:
        if line.startswith("READY"):
            return
        if time.time() > deadline:
            break
    proc.kill()
    raise RuntimeError("consumer worker did not get its partitions")


def run(episodes: int, rounds: int, max_file_age_s: float, live_episodes: int, live_rate: float, quick: bool) -> dict:
    from rlrec.consumer.topics import create_topics, dlq_topic_name
    from rlrec.local import LocalBroker

    tmp = tempfile.mkdtemp(prefix="rlrec-bench-consumer-")
    broker = LocalBroker("memory").start()
    try:
        bootstrap = broker.bootstrap_servers
        topic = f"bench-consumer-{uuid.uuid4().hex[:8]}"
        live_topic = topic + "-live"
        create_topics(
            bootstrap,
            {
                topic: PARTITIONS,
                dlq_topic_name(topic): PARTITIONS,
                live_topic: PARTITIONS,
                dlq_topic_name(live_topic): PARTITIONS,
            },
        )
        t = time.time()
        pub = publish(bootstrap, topic, episodes)
        print(
            f"published {pub['episodes']:,} episodes, {pub['steps']:,} steps in {pub['messages']:,} messages "
            f"({time.time() - t:.1f}s)",
            file=sys.stderr,
        )
        base = {
            "bootstrap": bootstrap,
            "topic": topic,
            "partitions": PARTITIONS,
            "episodes": pub["episodes"],
            "steps": pub["steps"],
            "max_file_age_s": max_file_age_s,
        }

        floors, ours = [], []
        for r in range(rounds):  # alternate; keep each side's best
            floors.append(_result(_spawn("floor", base), 600))
            out = os.path.join(tmp, f"out-{r}")
            ours.append(
                _result(_spawn("consumer", {**base, "output": out, "group": f"bench-{uuid.uuid4().hex[:8]}"}), 600)
            )
            shutil.rmtree(out, ignore_errors=True)
            print(
                f"round {r + 1}/{rounds}: floor {floors[-1]['steps_per_s']:,.0f} steps/s, "
                f"consumer {ours[-1]['steps_per_s']:,.0f} steps/s",
                file=sys.stderr,
            )
        # Ray Data logs every execution to stderr: keep it in a file, shown if the worker fails
        with open(os.path.join(tmp, "rllib.log"), "w+") as log:
            try:
                rllib = _result(
                    _spawn("rllib", {**base, "output": os.path.join(tmp, "rllib"), "repeats": rounds}, stderr=log), 900
                )
            except RuntimeError:
                log.seek(0)
                sys.stderr.write(log.read()[-5000:])
                raise
        print(f"rllib: {rllib['steps_per_s']:,.0f} steps/s", file=sys.stderr)

        # live run: a consumer keeps up with a steady producer; freshness is the pipeline's own
        proc = _spawn(
            "consumer",
            {
                **base,
                "topic": live_topic,
                "episodes": live_episodes,
                "steps": None,
                "output": os.path.join(tmp, "live"),
                "group": f"bench-{uuid.uuid4().hex[:8]}",
            },
        )
        try:
            _wait_ready(proc, 60)
            publish(bootstrap, live_topic, live_episodes, seed=1, pace_eps_per_s=live_rate)
            live = _result(proc, 120)
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        broker.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    a = max(floors, key=lambda x: x["steps_per_s"])
    b = max(ours, key=lambda x: x["steps_per_s"])
    vs_floor = b["steps_per_s"] / a["steps_per_s"]
    vs_rllib = b["steps_per_s"] / rllib["steps_per_s"]
    return {
        "episodes": pub["episodes"],
        "steps": pub["steps"],
        "messages": pub["messages"],
        "rounds": rounds,
        "max_file_age_s": max_file_age_s,
        "floor_steps_per_s": a["steps_per_s"],
        "consumer_steps_per_s": b["steps_per_s"],
        "rllib_steps_per_s": rllib["steps_per_s"],
        "rllib_write_only_steps_per_s": rllib["write_only_steps_per_s"],
        "floor_cpu_us_per_step": a["cpu_us_per_step"],
        "consumer_cpu_us_per_step": b["cpu_us_per_step"],
        "ratio_consumer_vs_floor": vs_floor,
        "ratio_consumer_vs_rllib": vs_rllib,
        "consumer_shards": b["shards"],
        "freshness_p50_s": live["freshness_p50_s"],
        "freshness_p99_s": live["freshness_p99_s"],
        "freshness_live_episodes": live["episodes"],
        "freshness_live_rate_eps_per_s": live_rate,
        "backlog_freshness_p50_s": b["freshness_p50_s"],
        "backlog_freshness_p99_s": b["freshness_p99_s"],
        "consumer_peak_rss_mb": b["peak_rss_mb"],
        "consumer_rss_after_imports_mb": b["rss_after_imports_mb"],
        "floor_peak_rss_mb": a["peak_rss_mb"],
        "runs": {"floor": floors, "consumer": ours, "rllib": rllib, "live": live},
        "quick": quick,
        "pass": {
            "consumer_vs_floor": None if quick else vs_floor >= TARGET_VS_FLOOR,
            "consumer_vs_rllib": None if quick else vs_rllib >= TARGET_VS_RLLIB,
        },
    }


# ---------------------------------------------------------------------------------------------
# child side


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _pct(samples: list[float], q: float) -> float | None:
    return float(np.percentile(samples, q)) if samples else None


def _import_episode_code() -> None:
    """ray.rllib (imported by the first episode build) costs ~2 s: pay it before any clock."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: F401

    import rlrec.consumer.service
    import rlrec.store.shards  # noqa: F401


def _read_floor(spec: dict, on_episode) -> tuple[float, float, int, int]:
    """The floor loop: decode, assemble, build + pack each finished episode via `on_episode`.
    Returns (wall seconds, CPU seconds, episodes, steps) from the first message on."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from rlrec.consumer.assembly import PartitionAssembler
    from rlrec.producer.events import decode

    c = Consumer(
        {
            "bootstrap.servers": spec["bootstrap"],
            "group.id": f"floor-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "fetch.message.max.bytes": 8 * 1024 * 1024,
        }
    )
    topic = spec["topic"]
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(spec["partitions"])])
    assemblers = {p: PartitionAssembler(topic, p) for p in range(spec["partitions"])}
    t0 = cpu0 = None
    episodes = steps = 0
    deadline = time.time() + 300
    try:
        while episodes < spec["episodes"]:
            if time.time() > deadline:
                raise TimeoutError(f"floor saw {episodes} of {spec['episodes']} episodes")
            for m in c.consume(num_messages=1000, timeout=0.2):
                if m.error() is not None:
                    continue
                if t0 is None:
                    t0, cpu0 = time.perf_counter(), time.process_time()
                a = assemblers[m.partition()]
                a.apply(m.offset(), decode(m.value(), m.headers(), max_bytes=8 * 1024 * 1024))
                if a.finished:
                    for fe in a.finished.values():
                        on_episode(fe)
                        episodes += 1
                        steps += fe.length
                    a.finished.clear()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        c.close()
    return wall, cpu, episodes, steps


def worker_floor(spec: dict) -> dict:
    from rlrec.store.episodes import pack_episode, to_single_agent_episode

    _import_episode_code()
    rss0 = _rss_mb()
    nbytes = [0]

    def on_episode(fe):
        nbytes[0] += len(pack_episode(to_single_agent_episode(fe)))

    wall, cpu, episodes, steps = _read_floor(spec, on_episode)
    assert steps == spec["steps"], (steps, spec["steps"])
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "steps_per_s": steps / wall,
        "cpu_us_per_step": cpu / steps * 1e6,
        "episodes": episodes,
        "steps": steps,
        "packed_bytes": nbytes[0],
        "rss_after_imports_mb": rss0,
        "peak_rss_mb": _peak_rss_mb(),
    }


def worker_consumer(spec: dict) -> dict:
    from rlrec.consumer.service import ConsumerConfig, RecorderConsumer
    from rlrec.store.manifest import read_manifest
    from rlrec.store.storage import Storage

    _import_episode_code()
    rss0 = _rss_mb()
    cfg = ConsumerConfig(
        bootstrap_servers=spec["bootstrap"],
        output=spec["output"],
        topic=spec["topic"],
        group_id=spec["group"],
        max_file_age_s=spec["max_file_age_s"],
        commit_interval_s=1.0,
        create_topics=False,
        kafka_config=dict(FAST_GROUP_KAFKA),
    )
    storage = Storage.from_uri(spec["output"])
    c = RecorderConsumer(cfg, storage)
    expected = spec["episodes"]
    clock: dict[str, float] = {}

    on_assign, on_message, on_commit = c._on_assign, c._on_message, c.metrics.on_commit

    def assigned(consumer, partitions):
        on_assign(consumer, partitions)
        if partitions and "ready" not in clock:
            clock["ready"] = time.time()
            print("READY", flush=True)

    def message(m):
        if "t0" not in clock:
            clock["t0"], clock["cpu0"] = time.perf_counter(), time.process_time()
        return on_message(m)

    def committed(result, seconds, eps):
        on_commit(result, seconds, eps)
        if "t1" not in clock and c.metrics.episodes_committed._value.get() >= expected:
            clock["t1"], clock["cpu1"] = time.perf_counter(), time.process_time()
            c.stop()

    c._on_assign, c._on_message, c.metrics.on_commit = assigned, message, committed
    timer = threading.Timer(300, c.stop)
    timer.start()
    try:
        c.run(install_signals=False)
    finally:
        timer.cancel()
    if "t1" not in clock:
        raise TimeoutError(f"consumer committed {c.metrics.episodes_committed._value.get()} of {expected} episodes")
    entries = read_manifest(storage)
    got = sum(e.episodes for e in entries)
    ids = [i for e in entries for i in e.episode_ids]
    assert got == expected == len(set(ids)), (got, expected, len(set(ids)))
    steps = sum(e.steps for e in entries)
    if spec.get("steps") is not None:
        assert steps == spec["steps"], (steps, spec["steps"])
    wall, cpu = clock["t1"] - clock["t0"], clock["cpu1"] - clock["cpu0"]
    fresh = c.metrics.freshness_samples
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "steps_per_s": steps / wall,
        "cpu_us_per_step": cpu / steps * 1e6,
        "episodes": got,
        "steps": steps,
        "shards": len(entries),
        "freshness_p50_s": _pct(fresh, 50),
        "freshness_p99_s": _pct(fresh, 99),
        "rss_after_imports_mb": rss0,
        "peak_rss_mb": _peak_rss_mb(),
    }


def worker_rllib(spec: dict) -> dict:
    import ray

    from rlrec.store.episodes import pack_episode, to_single_agent_episode

    _import_episode_code()
    built = []
    _read_floor(spec, lambda fe: built.append((to_single_agent_episode(fe), fe.length)))
    steps = sum(n for _, n in built)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        warm = os.path.join(spec["output"], "warm-up")  # worker start-up and first-use costs
        ray.data.from_items([{"item": pack_episode(ep)} for ep, _ in built[:10]]).write_parquet(warm)
        best = best_write = None
        for i in range(spec["repeats"]):
            path = os.path.join(spec["output"], f"run-{i}")
            t0 = time.perf_counter()
            packed = [{"item": pack_episode(ep)} for ep, _ in built]  # RLlib packs, then writes
            t1 = time.perf_counter()
            ray.data.from_items(packed).write_parquet(path)
            t2 = time.perf_counter()
            rows = ray.data.read_parquet(path).count()
            assert rows == len(built), (rows, len(built))
            best = t2 - t0 if best is None else min(best, t2 - t0)
            best_write = t2 - t1 if best_write is None else min(best_write, t2 - t1)
    finally:
        ray.shutdown()
    return {
        "wall_s": best,
        "write_only_s": best_write,
        "steps_per_s": steps / best,
        "write_only_steps_per_s": steps / best_write,
        "episodes": len(built),
        "steps": steps,
    }


WORKERS = {"floor": worker_floor, "consumer": worker_consumer, "rllib": worker_rllib}


# ---------------------------------------------------------------------------------------------


def _fmt(v, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(r: dict) -> None:
    judged = not r["quick"]

    def verdict(key):
        return {True: "PASS", False: "FAIL", None: "(not judged)"}[r["pass"][key]]

    print(
        f"\n{r['episodes']:,} episodes, {r['steps']:,} steps, {r['messages']:,} messages, "
        f"{PARTITIONS} partitions; best of {r['rounds']} round(s); max_file_age_s={r['max_file_age_s']}"
    )
    print(f"{'side':<44}{'steps/s':>12}{'CPU µs/step':>13}{'peak RSS MB':>13}")
    print(
        f"{'(a) floor: poll + decode + assemble + pack':<44}{_fmt(r['floor_steps_per_s']):>12}"
        f"{r['floor_cpu_us_per_step']:>13.2f}{r['floor_peak_rss_mb']:>13.0f}"
    )
    print(
        f"{'(b) RecorderConsumer -> committed shards':<44}{_fmt(r['consumer_steps_per_s']):>12}"
        f"{r['consumer_cpu_us_per_step']:>13.2f}{r['consumer_peak_rss_mb']:>13.0f}"
    )
    print(f"{'(c) RLlib: pack + from_items.write_parquet':<44}{_fmt(r['rllib_steps_per_s']):>12}")
    print(f"{'    (c) write_parquet only':<44}{_fmt(r['rllib_write_only_steps_per_s']):>12}")
    print(
        f"{'ratio b/a':<44}{r['ratio_consumer_vs_floor']:>12.2f}   target >= {TARGET_VS_FLOOR}  "
        f"{verdict('consumer_vs_floor')}"
    )
    print(
        f"{'ratio b/c':<44}{r['ratio_consumer_vs_rllib']:>12.2f}   target >= {TARGET_VS_RLLIB}  "
        f"{verdict('consumer_vs_rllib')}"
    )
    print(
        f"freshness (live, {r['freshness_live_episodes']} episodes at {r['freshness_live_rate_eps_per_s']:g}/s): "
        f"p50 {_fmt(r['freshness_p50_s'], '.3f')} s, p99 {_fmt(r['freshness_p99_s'], '.3f')} s"
    )
    print(
        f"freshness of the timed backlog run (b): p50 {_fmt(r['backlog_freshness_p50_s'], '.3f')} s, "
        f"p99 {_fmt(r['backlog_freshness_p99_s'], '.3f')} s (time the pre-published episodes waited)"
    )
    print(
        f"consumer RSS: {r['consumer_rss_after_imports_mb']:.0f} MB after imports (ray.rllib, torch), "
        f"peak {r['consumer_peak_rss_mb']:.0f} MB; shards written: {r['consumer_shards']}"
    )
    if not judged:
        print("quick mode: smoke test, nothing judged")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each side counts")
    ap.add_argument("--max-file-age-s", type=float, default=0.25)
    ap.add_argument("--live-episodes", type=int, default=300)
    ap.add_argument("--live-rate", type=float, default=50.0, help="episodes/s published during the live run")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--quick", action="store_true", help="small run (< 60 s), smoke test only")
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        mode, spec = args.worker
        result = WORKERS[mode](json.loads(spec))
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.quick:
        r = run(min(args.episodes, 300), 1, args.max_file_age_s, 60, 30.0, quick=True)
    else:
        r = run(args.episodes, args.rounds, args.max_file_age_s, args.live_episodes, args.live_rate, quick=False)
    print_table(r)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
