"""Trainer benchmark: rlrec's `ManifestOfflineData` vs RLlib's stock `OfflineData` in two configurations.

    python bench/trainer.py [--rounds R] [--seconds S] [--stock-batch 2 8] [--switch-interval X] [--t4] --json PATH

Same data: scripted-expert CartPole shards committed once (`--shards` x `--episodes-per-shard`),
read by every side. Same work: BC, same `train_batch_size_per_learner`, learner count,
`dataset_num_iters_per_learner` and `min_time_s_per_iteration`. The stock sides read the shard
files with `BCConfig().offline_data(input_read_episodes=True, input_read_batch_size=B,
map_batches_kwargs={"concurrency": 1}, dataset_num_iters_per_learner=<same>)` for each B in
`--stock-batch` (the better B is reported per figure), in two configurations (`STOCK_MODES`):

  materialized  `materialize_data=False, materialize_mapped_data=True`: RLlib's advice for data
                that fits in memory when the Learner connector pipeline is stateless and needs no
                RLModule, which is BC's (rllib-working-with-offline-data.rst and
                `AlgorithmConfig.offline_data`: materialize the *mapped* data, and then not the
                raw data too, "to avoid materialization of two datasets"); it is also
                `BCConfig`'s default. The first `sample()` runs every episode through the
                PreLearner once and keeps the resulting batches in the object store; later
                epochs iterate them again. This is the static baseline: T1, T2 and T4 are
                judged against it.
  streaming     `materialize_data=False, materialize_mapped_data=False`: the configuration for
                data that does not fit in memory or keeps arriving (each epoch re-reads and
                re-maps every file). Reported separately for T1, T2 and T4 (not judged).

`map_batches_kwargs={"concurrency": 1}` for both: RLlib's default PreLearner concurrency
(`max(2, num_learners)`) takes both CPUs of this 2-CPU machine and leaves none to the read
task: stock BC hangs with it here.
Same process conditions: every side and round runs in a fresh process (its own `ray.init`),
sides alternate (order reversed every other round), warm-up iterations are excluded on every
side, and interpreter settings (`sys.setswitchinterval`) are set by this harness for every
side alike (`--switch-interval`) or for none; product code does not change them.

Figures:
  T1  distinct (episode, t) rows that entered at least one learner batch, per second, over the
      same static shards, for every side with one hook (`LearnerRowIds`: RLlib's
      `TorchLearner._update` patched in the child process records a 64-bit hash of every
      minibatch row's observation; CartPole states are continuous, so distinct rows have
      distinct observations). Rows first seen during the warm-up are not counted again; the
      better batch size of each stock configuration is reported. `distinct_rows_seen` says how much of the data a
      side saw (near all of it would cap the figure). Start-up (build -> end of the warm-up
      iterations) is reported for every side. Target >= 1.0x the materialized side (whose
      distinct rows are bounded by the batches it materialized once).
  T2  learner updates/s (training_step calls x num_iters) and RLlib's
      `num_env_steps_trained_lifetime` delta per second, same batch size. Target >= 0.9x the
      materialized side.
  T3  freshness, rlrec only, judged against a bound (no stock side is measured; the only stock
      configuration that can see new shards at all is the streaming one: given a directory, it
      lists it again at each epoch and re-reads every old file with the new ones; a
      materialized dataset is frozen at its first `sample()` and never sees a shard committed
      after it): rlrec while shards are committed at 50 % of its pipeline's rate (rows streamed/s
      in the static runs, which is at least its T1: the stricter load) (`--stream-shards` shards,
      default 100), `--stream-rounds` rounds (default 3, each in a fresh process, medians and raw
      rounds reported): commit -> first trained p50/p99; a shard not trained by the end is a
      miss, counted, with (end - commit) as its latency. Target p99 <= 2 s + one iteration.
      The paced commits start after the warm-up iterations (on 3 pre-committed shards), as the
      static runs exclude their warm-up: T3 is freshness under sustained load, start-up is T1's
      start-up row. (Until 2026-11-24 the commits started before the first iteration, which
      builds the pipeline; the first ~30 shards then waited for the pipeline's start and the
      backlog it left, which was most of the reported p99.) Phases per shard: manifest -> feed,
      feed -> read (delivered to the read task), read -> its first chunk out of the PreLearner,
      -> first gradient step.
      T3 is measured twice per round, alternated (the order flips every round), each in a fresh
      process: as above, and with the committing writer compacting its own partition between
      its commits the way `rlrec consume --compact-after S` does (`--compact-after-t3 S`,
      default 0.5 -- more often than a consumer's 5 s minimum, so that compaction overlaps the
      short run: every S seconds one merged shard of shards at least S old,
      `compact_partition(max_runs=1)`), reported as p99 with compaction vs without (target:
      unchanged within noise). The trainer follows shard entries only: replacements add no
      new shard to train.
  T4  (`--t4`; full runs of bench/run.py only) wall time from the start of the build to a greedy
      CartPole return >= `--t4-return` (450; mean of `--t4-episodes` episodes on fixed seeds,
      evaluated after every iteration with the Learner's RLModule, evaluation time not counted),
      over the same static shards, ours vs every stock side (the better batch size of each
      configuration is reported), alternated rounds in fresh processes, capped at
      `--t4-seconds`. Target <= 1.0x the materialized side.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import subprocess
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


def lifetime_trained(result) -> int:
    return int(result.get("learners", {}).get("__all_modules__", {}).get("num_env_steps_trained_lifetime", 0) or 0)


class LearnerRowIds:
    """T1's counter, the same hook for both sides: every minibatch a Learner trains on (RLlib's
    `TorchLearner._update`, patched in this process; the Learner is local, num_learners=0) has
    the identity of each of its rows recorded as a 64-bit hash of the row's observation bytes.
    CartPole states are continuous, so distinct (episode id, t) rows have distinct observations
    (a collision is ~n^2/2^64). Rows that entered at least one learner batch = distinct hashes."""

    def __init__(self) -> None:
        self.keys: list = []

    def install(self) -> None:
        from ray.rllib.core.learner.torch.torch_learner import TorchLearner

        orig = TorchLearner._update
        rec = self

        def _update(learner, batch, **kwargs):
            rec.record(batch)
            return orig(learner, batch, **kwargs)

        TorchLearner._update = _update

    def record(self, batch) -> None:
        import numpy as np

        for module_batch in batch.values():
            obs = module_batch["obs"]
            a = np.ascontiguousarray(obs.detach().cpu().numpy()).reshape(len(obs), -1)
            b = a.view(np.uint8)
            pad = (-b.shape[1]) % 8
            if pad:
                b = np.concatenate([b, np.zeros((len(b), pad), np.uint8)], axis=1)
            words = np.ascontiguousarray(b).view(np.uint64)
            h = np.zeros(len(words), np.uint64)
            for j in range(words.shape[1]):
                h = (h ^ words[:, j]) * np.uint64(0x9E3779B97F4A7C15)
            self.keys.append(h)

    def distinct(self) -> int:
        import numpy as np

        return len(np.unique(np.concatenate(self.keys))) if self.keys else 0


#: the stock `OfflineData` configurations, by name (see the module docstring for why these)
STOCK_MODES = {
    "materialized": {"materialize_data": False, "materialize_mapped_data": True},
    "streaming": {"materialize_data": False, "materialize_mapped_data": False},
}


def stock_sides(batch_sizes: list[int]) -> list[str]:
    """Side names of the stock configurations, e.g. ["materialized2", "streaming2", ...]."""
    return [f"{mode}{b}" for mode in STOCK_MODES for b in batch_sizes]


def parse_stock_side(side: str) -> tuple[str, int]:
    """("materialized", 8) for "materialized8"."""
    for mode in STOCK_MODES:
        if side.startswith(mode) and side[len(mode) :].isdigit():
            return mode, int(side[len(mode) :])
    raise ValueError(f"unknown side {side!r}")


def build_side(args, out: str, side: str):
    """Build the BC algorithm for one side: "ours" (ManifestOfflineData) or a stock side
    ("materializedB", "streamingB": `STOCK_MODES`, input_read_batch_size B)."""
    from rlrec.trainer.data import configure_continuous

    config = base_config(args)
    if side == "ours":
        config.offline_data(dataset_num_iters_per_learner=args.num_iters)
        configure_continuous(config, out)
    else:
        mode, B = parse_stock_side(side)
        files = sorted(glob.glob(os.path.join(out, "expert", "*.parquet")))
        config.offline_data(
            input_=files,
            input_read_episodes=True,
            input_read_batch_size=B,
            input_read_method_kwargs={"columns": ["item"]},
            **STOCK_MODES[mode],
            map_batches_kwargs={"concurrency": args.prelearner_concurrency},
            dataset_num_iters_per_learner=args.num_iters,
        )
    algo = config.build_algo()
    if side == "ours":
        algo.offline_data.start()
    return algo


def stop_side(algo, side: str) -> None:
    if side == "ours":
        algo.offline_data.stop()
    else:
        algo.offline_data.batch_iterators = None
    algo.stop()


def run_static_side(args, out: str, side: str) -> dict:
    """T2 (and T1 for ours) for one side in this fresh process: warm-up iterations excluded, then
    `args.seconds` of train() calls."""
    ids = LearnerRowIds()
    ids.install()
    t0 = time.time()
    algo = build_side(args, out, side)
    build_s = time.time() - t0
    t0 = time.time()
    for _ in range(max(1, args.warmup_iterations)):
        r = algo.train()
        if side == "ours":
            od = algo.offline_data
            od.pop_stats(od.iteration_marks(algo.learner_group))
    first_s = time.time() - t0
    distinct0 = ids.distinct()  # rows seen in the warm-up are not counted as new later
    life0 = lifetime_trained(r)
    calls = steps = streamed = 0
    secs = 0.0
    deadline = time.time() + args.seconds
    while time.time() < deadline:
        t0 = time.time()
        r = algo.train()
        secs += time.time() - t0
        calls += int(r.get("num_training_step_calls_per_iteration", 1) or 1)
        steps += steps_trained(r)
        if side == "ours":
            od = algo.offline_data
            streamed += od.pop_stats(od.iteration_marks(algo.learner_group)).rows_streamed
    life = lifetime_trained(r) - life0
    distinct = ids.distinct()
    stop_side(algo, side)
    updates = calls * args.num_iters * max(1, args.num_learners)
    return {
        "side": side,
        "updates_per_s": updates / secs,
        "env_steps_trained_lifetime_per_s": life / secs,
        "env_steps_trained_per_s": steps / secs,
        "distinct_rows_per_s": (distinct - distinct0) / secs,
        "distinct_rows_seen": distinct,  # of the shards' rows: near all of them means T1 is capped by the data
        "rows_streamed_per_s": streamed / secs if side == "ours" else None,
        "seconds": round(secs, 2),
        "build_s": round(build_s, 2),
        "warmup_s": round(first_s, 2),
    }


def greedy_return(module, episodes: int, seed0: int = 1000) -> float:
    """Mean return of `episodes` greedy CartPole-v1 episodes (fixed seeds: the same starts for
    every side and round) played by the Learner's RLModule (argmax of its action logits)."""
    import gymnasium as gym
    import numpy as np
    import torch

    env = gym.make("CartPole-v1")
    total = 0.0
    with torch.no_grad():
        for i in range(episodes):
            obs, _ = env.reset(seed=seed0 + i)
            done = False
            while not done:
                out = module.forward_inference({"obs": torch.as_tensor(np.asarray(obs, np.float32)[None])})
                action = int(torch.argmax(out["action_dist_inputs"][0]))
                obs, reward, terminated, truncated, _ = env.step(action)
                total += float(reward)
                done = terminated or truncated
    env.close()
    return total / episodes


def run_t4_side(args, out: str, side: str) -> dict:
    """T4 for one side in this fresh process: wall time from the start of the build until the
    greedy return (after an iteration) reaches `--t4-return`; the evaluation's own time is not
    counted (the same evaluation runs on both sides). A side that does not reach it within
    `--t4-seconds` of training is reported with that cap and `reached: false`."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    t0 = time.time()
    algo = build_side(args, out, side)
    clock = time.time() - t0
    evals, reached, iters = [], False, 0
    while clock < args.t4_seconds:
        t = time.time()
        algo.train()
        iters += 1
        if side == "ours":
            od = algo.offline_data
            od.pop_stats(od.iteration_marks(algo.learner_group))
        clock += time.time() - t
        ret = greedy_return(algo.learner_group._learner.module[DEFAULT_MODULE_ID], args.t4_episodes)
        evals.append([round(clock, 2), ret])
        if ret >= args.t4_return:
            reached = True
            break
    stop_side(algo, side)
    return {"side": side, "t4_s": round(clock, 2), "reached": reached, "iterations": iters, "evals": evals}


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

    # episodes are generated before the clock: committing, not generating, is the paced work
    pending = [
        expert_cartpole_episodes(args.episodes_per_shard, seed=10_000 + i, epsilon=0.05)
        for i in range(args.stream_shards)
    ]
    done = threading.Event()
    rows = [0]
    compactions: list[dict] = []

    def compact_when_due(due: float) -> float:
        """What a consumer's writer with --compact-after does between its shard writes
        (`PartitionWriter.upkeep`): one merged shard of shards at least `compact_after` old."""
        from rlrec.store.compaction import compact_partition

        if not args.compact_after or time.time() < due:
            return due
        t0 = time.time()
        res = compact_partition(committer.log, min_age_s=args.compact_after, max_runs=1)
        compactions.append({"seconds": time.time() - t0, "replaced": res.replaced, "written": res.written})
        return time.time() + args.compact_after

    def produce():
        t0 = time.time()
        due = t0 + (args.compact_after or 0.0)
        for i, eps in enumerate(pending):
            if stop.wait(max(0.0, t0 + (i + 1) * args.interval - time.time())):
                break
            for e in committer.commit(eps).entries:
                commits[e.path] = e.commit_time
                rows[0] += e.steps
            due = compact_when_due(due)
        done.set()

    # warm-up (pipeline start: the PreLearner actor, the module, the first batches) on the
    # pre-committed shards, excluded as in the static runs: T3 is freshness under sustained
    # load; start-up is reported by T1's start-up row
    t0 = time.time()
    for _ in range(max(1, args.warmup_iterations)):
        algo.train()
        od.pop_stats(od.iteration_marks(algo.learner_group))
    warmup_s = time.time() - t0
    iters = []
    first_train: dict[str, float] = {}
    th = threading.Thread(target=produce, daemon=True)
    th.start()
    t_start = time.time()
    t_end = None  # the last commit + a grace of 2 s plus one (median) iteration
    while t_end is None or time.time() < t_end:
        if time.time() - t_start > args.stream_seconds:
            break  # safety cap
        if t_end is None and done.is_set():
            t_end = time.time() + 2.0 + (statistics.median(x["seconds"] for x in iters) if iters else 1.0)
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
    # commit -> first gradient step; a shard not trained by the end is a miss: counted, and its
    # latency is taken as (end - commit), a lower bound, so misses raise the percentiles
    t_stop = time.time()
    lat = [first_train[k] - ct for k, ct in commits.items() if k in first_train]
    untrained = [k for k in commits if k not in first_train]
    lat_all = lat + [t_stop - commits[k] for k in untrained]
    steady = iters
    tl = ray_get_timeline(od)
    phases = {"manifest_to_feed": [], "feed_to_read": [], "read_to_gradient": []}
    phases.update(read_to_prelearned=[], prelearned_to_gradient=[])
    for k, ct in commits.items():
        info = tl.get(k)
        if info and "added" in info and "delivered" in info and "trained" in info:
            phases["manifest_to_feed"].append(info["added"] - ct)
            phases["feed_to_read"].append(info["delivered"] - info["added"])
            phases["read_to_gradient"].append(info["trained"] - info["delivered"])
            if "processed" in info:
                phases["read_to_prelearned"].append(info["processed"] - info["delivered"])
                phases["prelearned_to_gradient"].append(info["trained"] - info["processed"])
    od.stop()
    algo.stop()
    total = len(read_manifest(Storage.from_uri(out)))
    return {
        "interval_s": args.interval,
        "compact_after_s": args.compact_after,
        "compactions": len(compactions),
        "shards_replaced": sum(c["replaced"] for c in compactions),
        "compaction_s": sum(c["seconds"] for c in compactions),
        "iterations": len(iters),
        "shards_committed_during_run": len(commits),
        "shards_not_yet_trained_at_end": len(untrained),
        "shards_total": total,
        "timesteps_per_s": sum(x["rows"] for x in steady) / sum(x["seconds"] for x in steady) if steady else None,
        "streamed_rows_per_s": sum(x["streamed"] for x in steady) / sum(x["seconds"] for x in steady)
        if steady
        else None,
        "commit_rate_rows_per_s": rows[0] / (len(commits) * args.interval) if commits else None,
        "misses": len(untrained),
        "commit_to_first_gradient_s_p50": _pct(lat_all, 0.5),
        "commit_to_first_gradient_s_p99": _pct(lat_all, 0.99),
        "commit_to_first_gradient_s_max": max(lat_all) if lat_all else None,
        "iteration_s_median": statistics.median(x["seconds"] for x in iters) if iters else None,
        "warmup_s": round(warmup_s, 2),
        "latencies_s": lat_all,
        "phases_s_p50_p95": {k: [_pct(v, 0.5), _pct(v, 0.95)] for k, v in phases.items()},
    }


def _child(args, extra: list[str], out_json: str, timeout: float) -> dict:
    keep = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in CHILD_ARGS and v is not None]
    cmd = [sys.executable, os.path.abspath(__file__), *keep, *extra, "--json", out_json]
    for attempt in range(2):  # one retry: on this shared machine a Ray worker is occasionally lost
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=timeout)
        if proc.returncode == 0:
            break
        print(
            f"trainer benchmark child {extra} failed (attempt {attempt + 1}):\n{proc.stderr[-2000:]}", file=sys.stderr
        )
    if proc.returncode != 0:
        raise RuntimeError(f"trainer benchmark child {extra} failed:\n{proc.stderr[-4000:]}")
    with open(out_json) as f:
        return json.load(f)


CHILD_ARGS = (
    "batch_size",
    "num_iters",
    "num_learners",
    "seconds",
    "warmup_iterations",
    "num_cpus",
    "prelearner_concurrency",
    "switch_interval",
    "episodes_per_shard",
    "stream_seconds",
    "stream_shards",
    "fresh_fraction",
    "t4_return",
    "t4_episodes",
    "t4_seconds",
)


def _median_spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "spread": [min(xs), max(xs)], "rounds": xs}


def parent(args) -> dict:
    import ray

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    results: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "ray": ray.__version__}}
    results["args"] = vars(args)
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
        sides = ("ours", *stock_sides(args.stock_batch))
        raw: dict[str, list[dict]] = {s: [] for s in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                res = _child(args, ["--side", side, "--data", static_out], os.path.join(tmp, "side.json"), 600)
                raw[side].append(res)
                log(
                    f"trainer round {r + 1}/{args.rounds} {side}: {res['updates_per_s']:.1f} updates/s, "
                    f"{res['env_steps_trained_lifetime_per_s']:,.0f} env steps trained/s"
                )
        static = {
            side: {
                k: _median_spread([x[k] for x in runs])
                for k in ("updates_per_s", "env_steps_trained_lifetime_per_s", "warmup_s", "distinct_rows_per_s")
            }
            for side, runs in raw.items()
        }
        static["ours"]["rows_streamed_per_s"] = _median_spread([x["rows_streamed_per_s"] for x in raw["ours"]])
        # per stock configuration, its better batch size for T2 and for T1
        static["baselines"] = {
            mode: {
                "best": max(of_mode, key=lambda s: static[s]["updates_per_s"]["median"]),
                "best_t1": max(of_mode, key=lambda s: static[s]["distinct_rows_per_s"]["median"]),
            }
            for mode in STOCK_MODES
            for of_mode in [[s for s in sides[1:] if parse_stock_side(s)[0] == mode]]
        }
        static["raw"] = raw
        results["static"] = static
        # T3 at 50 % of ours' rows streamed/s (the pipeline's rate; at least its T1, so this load
        # is the stricter choice), with --stream-shards shards
        t1 = max(static["ours"]["rows_streamed_per_s"]["median"], static["ours"]["distinct_rows_per_s"]["median"])
        rows_per_shard = results["data"]["steps"] / max(1, results["data"]["shards"])
        interval = max(0.05, rows_per_shard / (0.5 * t1)) if t1 else args.interval
        if args.t4:
            # T4 over the same static shards: alternated rounds, each side in a fresh process
            t4_sides = sides  # ours and every stock side (the better batch size of each configuration)
            t4_raw: dict[str, list[dict]] = {s: [] for s in t4_sides}
            for r in range(args.rounds):
                for side in t4_sides if r % 2 == 0 else tuple(reversed(t4_sides)):
                    res = _child(args, ["--t4-side", side, "--data", static_out], os.path.join(tmp, "t4.json"), 600)
                    t4_raw[side].append(res)
                    log(f"T4 round {r + 1}/{args.rounds} {side}: {res['t4_s']:.1f}s, reached {res['reached']}")
            results["t4"] = {
                "return": args.t4_return,
                "episodes": args.t4_episodes,
                "cap_s": args.t4_seconds,
                "baselines": {
                    mode: min(
                        (s for s in t4_sides[1:] if parse_stock_side(s)[0] == mode),
                        key=lambda s: statistics.median(x["t4_s"] for x in t4_raw[s]),
                    )
                    for mode in STOCK_MODES
                },
                **{s: _median_spread([x["t4_s"] for x in runs]) for s, runs in t4_raw.items()},
                "misses": {s: sum(1 for x in runs if not x["reached"]) for s, runs in t4_raw.items()},
                "raw": t4_raw,
            }
        # T3 without and with the writer compacting its partition (--compact-after), the two
        # sides alternated (the order flips every round), each round a fresh process and output
        sides_t3 = {"streaming": 0.0}
        if args.compact_after_t3 > 0:
            sides_t3["streaming_compacting"] = args.compact_after_t3
        rounds_t3: dict[str, list[dict]] = {k: [] for k in sides_t3}
        for r in range(max(1, args.stream_rounds)):
            for name in sides_t3 if r % 2 == 0 else tuple(reversed(sides_t3)):
                stream_out = os.path.join(tmp, f"stream{r}-{name}")
                make_shards(stream_out, 3, args.episodes_per_shard, seed0=5000)
                res = _child(
                    args,
                    [
                        "--streaming",
                        "--data",
                        stream_out,
                        f"--interval={interval}",
                        f"--compact-after={sides_t3[name]}",
                    ],
                    os.path.join(tmp, "stream.json"),
                    900,
                )
                rounds_t3[name].append(res)
                log(
                    f"{name} round {r + 1}/{args.stream_rounds}: {res['shards_committed_during_run']} shards every "
                    f"{interval:.2f}s, {res['compactions']} compactions, p50 "
                    f"{res['commit_to_first_gradient_s_p50']:.2f}s, p99 {res['commit_to_first_gradient_s_p99']:.2f}s, "
                    f"misses {res['misses']}"
                )
        for name, rounds in rounds_t3.items():
            # the round with the median p99 (its latencies are plotted), the figures as medians over rounds
            rep = sorted(rounds, key=lambda x: x["commit_to_first_gradient_s_p99"])[(len(rounds) - 1) // 2]
            streaming = dict(rep)
            for k in ("commit_to_first_gradient_s_p50", "commit_to_first_gradient_s_p99", "iteration_s_median"):
                streaming[k] = statistics.median(x[k] for x in rounds)
                streaming[k + "_rounds"] = [x[k] for x in rounds]
            streaming["misses"] = sum(x["misses"] for x in rounds)
            streaming["rounds"] = rounds
            results[name] = streaming
    return results


def child(args) -> dict:
    import ray
    import ray.data

    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)  # the harness sets it, for every side alike
    ray.init(
        address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False
    )
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    try:
        if args.streaming:
            return run_streaming(args, args.data)
        if args.t4_side:
            return run_t4_side(args, args.data, args.t4_side)
        return run_static_side(args, args.data, args.side)
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    # 80: at 40 (98,755 rows) the trainer saw every row within T1's window (its T1 was capped by the data)
    ap.add_argument("--shards", type=int, default=80, help="static shards [80]")
    ap.add_argument("--episodes-per-shard", type=int, default=5, help="episodes per shard [5, ~480 steps each]")
    ap.add_argument("--batch-size", type=int, default=512, help="train_batch_size_per_learner [512]")
    ap.add_argument("--num-iters", type=int, default=10, help="dataset_num_iters_per_learner [10]")
    ap.add_argument("--num-learners", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per side and round [10]")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds, each side in a fresh process [3]")
    ap.add_argument("--stock-batch", type=int, nargs="+", default=[2, 8], help="input_read_batch_size B [2 8]")
    ap.add_argument("--prelearner-concurrency", type=int, default=1, help="map_batches concurrency (stock) [1]")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval, every side [unset]")
    ap.add_argument("--stream-shards", type=int, default=100, help="shards committed in the T3 run [100]")
    ap.add_argument("--stream-seconds", type=float, default=300.0, help="T3 safety cap [300]")
    ap.add_argument("--stream-rounds", type=int, default=3, help="T3 rounds, each in a fresh process [3]")
    ap.add_argument("--interval", type=float, default=2.0, help=argparse.SUPPRESS)
    ap.add_argument(
        "--compact-after-t3",
        type=float,
        default=0.5,
        help="T3 is also measured while the writer compacts its partition every this many seconds "
        "(0: not measured) [0.5]",
    )
    ap.add_argument("--compact-after", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--warmup-iterations", type=int, default=2)
    ap.add_argument("--num-cpus", type=int, default=None, help="ray.init(num_cpus) [all]")
    ap.add_argument("--fresh-fraction", type=float, default=None, help="FeedPolicy.fresh_fraction [library default]")
    ap.add_argument("--t4", action="store_true", help="also measure T4 (time to a greedy return), ours vs stock")
    ap.add_argument("--t4-return", type=float, default=450.0, help="T4's greedy return [450]")
    ap.add_argument("--t4-episodes", type=int, default=5, help="greedy episodes per evaluation [5]")
    ap.add_argument("--t4-seconds", type=float, default=120.0, help="T4 cap: build + training seconds [120]")
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--t4-side", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--streaming", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING)
    results = child(args) if (args.side or args.streaming or args.t4_side) else parent(args)
    text = json.dumps(results, indent=2, default=float)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
