"""Benchmark of the trainer's data path (issue 4, section 6).

Same run, same Ray instance, same static shards (scripted-expert CartPole episodes):

1. static: timesteps/s trained through RLlib's stock `OfflineData` (BC defaults:
   ``materialize_mapped_data=True``, ``map_batches_kwargs={"concurrency": 1}`` for 2 CPUs) vs the
   trainer's `ManifestOfflineData`, same algorithm (BC), batch size, learner updates per
   training step and ``min_time_s_per_iteration``. Ratio = ours / stock (target >= 1.0).
2. streaming: the trainer with a new shard committed every ``--interval`` seconds: the share of
   iteration time the Learner waits for data in steady state (target < 10 %) and the time from
   a shard's commit to the first gradient step that uses it, p50/p95 (target p95 < 5 s).

    python bench/trainer.py --json bench-trainer.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlrec.local import ray_on_loopback

ray_on_loopback()  # single-machine Ray: listen on 127.0.0.1 only


def _pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def make_shards(out: str, n: int, episodes: int, seed0: int = 0) -> list:
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    c = ShardCommitter(out)
    entries = []
    for i in range(n):
        entries += c.commit(expert_cartpole_episodes(episodes, seed=seed0 + i, epsilon=0.05)).entries
    return entries


def base_config(args):
    import gymnasium as gym
    from ray.rllib.algorithms.bc import BCConfig

    env = gym.make("CartPole-v1")
    return (
        BCConfig()
        .environment(observation_space=env.observation_space, action_space=env.action_space)
        .training(train_batch_size_per_learner=args.batch_size, lr=1e-3)
        .reporting(min_time_s_per_iteration=1.0)
        .learners(num_learners=args.num_learners)
    )


def steps_trained(result) -> int:
    return int(result.get("learners", {}).get("__all_modules__", {}).get("num_env_steps_trained", 0) or 0)


def run_static(args, out: str) -> dict:
    from rlrec.trainer.data import configure_continuous

    files = sorted(glob.glob(os.path.join(out, "expert", "*.parquet")))
    res = {}
    for name in ("stock", "ours"):
        config = base_config(args)
        if name == "stock":
            config.offline_data(
                input_=files,
                input_read_episodes=True,
                input_read_method_kwargs={"columns": ["item"]},
                map_batches_kwargs={"concurrency": 1},
                dataset_num_iters_per_learner=args.num_iters,
            )
        else:
            config.offline_data(dataset_num_iters_per_learner=args.num_iters)
            configure_continuous(config, out)
        t0 = time.time()
        algo = config.build_algo()
        if name == "ours":
            algo.offline_data.start()
        build_s = time.time() - t0
        t0 = time.time()
        first = algo.train()
        first_s = time.time() - t0
        steps, secs, waits, streamed = 0, 0.0, [], 0
        deadline = time.time() + args.seconds
        while time.time() < deadline:
            t0 = time.time()
            r = algo.train()
            dt = time.time() - t0
            if name == "ours":
                od = algo.offline_data
                st = od.pop_stats(od.iteration_marks(algo.learner_group))
                steps += st.rows_trained
                streamed += st.rows_streamed
                waits.append(st.wait_s / dt)
            else:
                steps += steps_trained(r)
            secs += dt
        res[name] = {
            "timesteps_per_s": steps / secs,
            "timesteps": steps,
            "seconds": round(secs, 2),
            "build_s": round(build_s, 2),
            "first_iteration_s": round(first_s, 2),
            "first_iteration_timesteps": steps_trained(first),
        }
        if waits:
            res[name]["learner_wait_share_mean"] = statistics.mean(waits)
            res[name]["streamed_rows_per_s"] = streamed / secs
        if name == "ours":
            algo.offline_data.stop()
        else:
            algo.offline_data.batch_iterators = None
        algo.stop()
    res["ratio"] = res["ours"]["timesteps_per_s"] / res["stock"]["timesteps_per_s"]
    return res


def ray_get_timeline(od) -> dict:
    """{shard key: first times (added to the feed, first read, first trained)}."""
    import ray

    tl = ray.get(
        od.feed.__ray_call__.remote(
            lambda self: {self.state.shards[i].key: dict(v) for i, v in self.state.timeline.items()}
        )
    )
    return tl


def run_streaming(args, out: str) -> dict:
    from rlrec.store.commit import ShardCommitter
    from rlrec.store.manifest import read_manifest
    from rlrec.store.storage import Storage
    from rlrec.trainer.data import configure_continuous
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    config = base_config(args)
    config.offline_data(dataset_num_iters_per_learner=args.num_iters)
    configure_continuous(
        config, out, feed_policy={"fresh_fraction": args.fresh_fraction} if args.fresh_fraction else None
    )
    algo = config.build_algo()
    od = algo.offline_data
    od.start()
    stop = threading.Event()
    commits: dict[str, float] = {}
    committer = ShardCommitter(out, partition=1)

    def produce():
        i = 0
        while not stop.wait(args.interval):
            for e in committer.commit(
                expert_cartpole_episodes(args.episodes_per_shard, seed=10_000 + i, epsilon=0.05)
            ).entries:
                commits[e.path] = e.commit_time
            i += 1

    iters = []
    first_train: dict[str, float] = {}
    th = threading.Thread(target=produce, daemon=True)
    th.start()
    t_end = time.time() + args.stream_seconds
    while time.time() < t_end:
        t0 = time.time()
        algo.train()
        dt = time.time() - t0
        st = od.pop_stats(od.iteration_marks(algo.learner_group))
        first_train.update(st.newly_trained)
        iters.append(
            {
                "seconds": dt,
                "wait_share": st.wait_s / dt,
                "rows": st.rows_trained,
                "streamed": st.rows_streamed,
                "new": len(st.newly_trained),
            }
        )
    stop.set()
    th.join()
    # shards committed during the run whose first gradient step we saw
    lat = [first_train[k] - ct for k, ct in commits.items() if k in first_train]
    untrained = [k for k in commits if k not in first_train]
    steady = iters[args.warmup_iterations :]
    tl = ray_get_timeline(od)
    phases = {"manifest_to_feed": [], "feed_to_read": [], "read_to_gradient": []}
    for k, ct in commits.items():
        info = tl.get(k)
        if info and "added" in info and "delivered" in info and "trained" in info:
            phases["manifest_to_feed"].append(info["added"] - ct)
            phases["feed_to_read"].append(info["delivered"] - info["added"])
            phases["read_to_gradient"].append(info["trained"] - info["delivered"])
    od.stop()
    algo.stop()
    total = len(read_manifest(Storage.from_uri(out)))
    return {
        "interval_s": args.interval,
        "iterations": len(iters),
        "shards_committed_during_run": len(commits),
        "shards_not_yet_trained_at_end": len(untrained),
        "shards_total": total,
        "learner_wait_share_mean": statistics.mean(x["wait_share"] for x in steady) if steady else None,
        "learner_wait_share_p95": _pct([x["wait_share"] for x in steady], 0.95),
        "timesteps_per_s": sum(x["rows"] for x in steady) / sum(x["seconds"] for x in steady) if steady else None,
        "streamed_rows_per_s": sum(x["streamed"] for x in steady) / sum(x["seconds"] for x in steady)
        if steady
        else None,
        "commit_to_first_gradient_s_p50": _pct(lat, 0.5),
        "commit_to_first_gradient_s_p95": _pct(lat, 0.95),
        "commit_to_first_gradient_s_max": max(lat) if lat else None,
        "phases_s_p50_p95": {k: [_pct(v, 0.5), _pct(v, 0.95)] for k, v in phases.items()},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--shards", type=int, default=40, help="static shards [40]")
    ap.add_argument("--episodes-per-shard", type=int, default=5, help="episodes per shard [5, ~480 steps each]")
    ap.add_argument("--batch-size", type=int, default=512, help="train_batch_size_per_learner [512]")
    ap.add_argument("--num-iters", type=int, default=10, help="dataset_num_iters_per_learner [10]")
    ap.add_argument("--num-learners", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=15.0, help="measured seconds per static variant [15]")
    ap.add_argument("--stream-seconds", type=float, default=30.0, help="streaming run length [30]")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between committed shards [2]")
    ap.add_argument("--warmup-iterations", type=int, default=3)
    ap.add_argument("--num-cpus", type=int, default=None, help="ray.init(num_cpus) [all]")
    ap.add_argument("--fresh-fraction", type=float, default=None, help="FeedPolicy.fresh_fraction [library default]")
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--skip-streaming", action="store_true")
    args = ap.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING)
    import ray
    import ray.data

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    results: dict = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "ray": ray.__version__},
        "args": vars(args),
    }
    try:
        with tempfile.TemporaryDirectory(prefix="rlrec-bench-") as tmp:
            static_out = os.path.join(tmp, "static")
            t0 = time.time()
            entries = make_shards(static_out, args.shards, args.episodes_per_shard)
            results["data"] = {
                "shards": len(entries),
                "episodes": sum(e.episodes for e in entries),
                "steps": sum(e.steps for e in entries),
                "bytes": sum(e.bytes for e in entries),
                "generate_s": round(time.time() - t0, 2),
            }
            if not args.skip_static:
                results["static"] = run_static(args, static_out)
                print(
                    f"static: stock {results['static']['stock']['timesteps_per_s']:.0f} ts/s, ours "
                    f"{results['static']['ours']['timesteps_per_s']:.0f} ts/s, ratio {results['static']['ratio']:.2f}",
                    flush=True,
                )
            if not args.skip_streaming:
                stream_out = os.path.join(tmp, "stream")
                make_shards(stream_out, 3, args.episodes_per_shard, seed0=5000)
                s = results["streaming"] = run_streaming(args, stream_out)
                print(
                    f"streaming: wait share {s['learner_wait_share_mean']:.1%} (p95 {s['learner_wait_share_p95']:.1%}), "
                    f"commit->gradient p50 {s['commit_to_first_gradient_s_p50']:.2f}s p95 "
                    f"{s['commit_to_first_gradient_s_p95']:.2f}s",
                    flush=True,
                )
    finally:
        ray.shutdown()
    stream = results.get("streaming", {})
    wait, p95 = stream.get("learner_wait_share_mean"), stream.get("commit_to_first_gradient_s_p95")
    results["targets"] = {
        "ratio>=1.0": results.get("static", {}).get("ratio", 0) >= 1.0,
        "wait_share<0.10": wait is not None and wait < 0.10,
        "p95_latency<5s": p95 is not None and p95 < 5.0,
    }
    text = json.dumps(results, indent=2, default=float)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
