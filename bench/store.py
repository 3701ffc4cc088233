"""Store read benchmark: reading every step of a store of many small shards (issue 31).

    python bench/store.py [--steps 1000000] [--steps-per-shard 1800] [--partitions 4] [--rounds 5]
                          [--store DIR] [--demo-store URI] [--quick] [--json PATH]

Stores measured:

  synthetic  --steps CartPole steps (expert episodes of 200 steps, epsilon 0.1) written with the
             project's own shard writer (`ShardCommitter.commit`, episode shards, zstd, fsync),
             --steps-per-shard each, round-robin over --partitions partition logs: many small
             shards like the demo's (its median shard is 34 KiB). Built in a temporary folder, or
             in --store DIR (kept, and reused by a later run with the same parameters).
  demo       the shards of a `rlrec demo` run (--demo-store URI; default ./demo-data/shards when
             it exists; left out in --quick unless given).

Per store: the number of files and their median size (from the manifest), and, in alternated
rounds (the order rotates every round, one warm-up round first, not counted), the seconds to read
every step:

  pyarrow    ``rlrec.open(store).to_pyarrow_dataset().to_table()``
  polars     ``rlrec.open(store).to_polars()``
  duckdb     ``rlrec.open(store).to_duckdb()`` aggregated over every row (count, sum of reward)
  plain      the baseline: ``pyarrow.dataset.dataset(files).to_table()`` over the same files
             (``snapshot.files()``, listed before the clock starts): the shards' own columns as
             stored, no manifest read, no sha256 check, no step decoding -- what a plain
             directory reader pays for the same bytes.

Every rlrec reader's time includes opening the snapshot (reading the manifest), checking each
shard's sha256 and turning its episodes into one row per step. Reported: median and spread
(min..max) per reader, and the per-round values (``reads.rounds``).

After compaction (issue 31; compaction lands separately): `compact_store` is the one place to
wire rlrec's compactor. When it returns stats, every store is measured again after it, and
bench/run.py adds the "after compaction" rows (files, median size, read seconds vs before;
target: reads at least 5x faster on the small-shard store).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

#: the rlrec readers, in their first round's order (the baseline "plain" is timed beside them)
READERS = ("pyarrow", "polars", "duckdb")
SIDES = ("plain", *READERS)
#: the target of the "after compaction" rows: reads at least this many times faster
TARGET_SPEEDUP = 5.0
EPISODE_STEPS = 200


# ------------------------------------------------------------------------------ the stores


def build_synthetic(root: str, steps: int, steps_per_shard: int, partitions: int) -> dict:
    """Write `steps` CartPole steps as shards of `steps_per_shard` steps (whole episodes of
    `EPISODE_STEPS`), round-robin over `partitions` logs, with `ShardCommitter`; returns what
    was built. A folder that already holds the same build (its ``bench-store.json``) is reused."""
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    params = {"steps": steps, "steps_per_shard": steps_per_shard, "partitions": partitions}
    marker = os.path.join(root, "bench-store.json")
    if os.path.exists(marker):
        with open(marker) as f:
            done = json.load(f)
        if done.get("params") == params:
            return {**done, "reused": True}
        raise SystemExit(f"--store {root} holds another build ({done.get('params')}); give an empty folder")
    if os.path.exists(root) and os.listdir(root):
        raise SystemExit(f"--store {root} is not empty and holds no bench-store.json; give an empty folder")
    committers = [ShardCommitter(root, "rl", p) for p in range(partitions)]
    per_shard = max(1, steps_per_shard // EPISODE_STEPS)
    t0 = time.perf_counter()
    written = shards = 0
    while written < steps:
        episodes = expert_cartpole_episodes(per_shard, seed=shards, max_steps=EPISODE_STEPS, epsilon=0.1)
        committers[shards % partitions].commit(episodes)
        written += sum(len(e.rewards) for e in episodes)
        shards += 1
    done = {"params": params, "shards": shards, "steps": written, "build_s": time.perf_counter() - t0}
    with open(marker, "w") as f:
        json.dump(done, f)
    return {**done, "reused": False}


def compact_store(root: str) -> dict | None:
    """AFTER COMPACTION: compact the store at `root` in place with rlrec's compactor and return
    its stats (at least ``{"seconds": float}``); None while compaction is not wired here.

    The lead wires issue 31's compactor here (e.g. ``rlrec.store.compaction.compact(root,
    target_bytes=...)``); `measure` then reads every store again after it."""
    return None


# ------------------------------------------------------------------------------ measuring


def files_and_sizes(uri: str) -> dict:
    """Files (committed shard entries, from the manifest) and their sizes."""
    import rlrec

    snap = rlrec.open(uri)
    sizes = sorted(e.bytes for e in snap.entries)
    return {
        "files": len(sizes),
        "median_bytes": statistics.median(sizes) if sizes else 0,
        "total_bytes": sum(sizes),
        "steps": snap.num_steps,
        "episodes": snap.num_episodes,
    }


def read_once(side: str, uri: str, files: list[str]) -> tuple[float, int]:
    """Seconds to read every step of `uri` with `side`, and the rows it read."""
    import pyarrow.dataset as ds

    import rlrec

    t0 = time.perf_counter()
    if side == "plain":
        rows = ds.dataset(files, format="parquet").to_table().num_rows
    elif side == "pyarrow":
        rows = rlrec.open(uri).to_pyarrow_dataset().to_table().num_rows
    elif side == "polars":
        rows = rlrec.open(uri).to_polars().height
    elif side == "duckdb":
        rows = int(rlrec.open(uri).to_duckdb().aggregate("count(*) AS n, sum(reward) AS r").fetchall()[0][0])
    else:
        raise ValueError(side)
    return time.perf_counter() - t0, rows


def measure_reads(uri: str, rounds: int) -> dict:
    """Alternated rounds of every side (one warm-up round first): medians, spreads, raw rounds."""
    import rlrec

    files = rlrec.open(uri).files()
    rounds_: dict[str, list[dict]] = {s: [] for s in SIDES}
    for r in range(rounds + 1):
        order = SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]
        for side in order:
            seconds, rows = read_once(side, uri, files)
            if r > 0:
                rounds_[side].append({"seconds": seconds, "rows": rows})
    out: dict[str, Any] = {"rounds": rounds_}
    for side, values in rounds_.items():
        secs = [v["seconds"] for v in values]
        out[side] = {"seconds": statistics.median(secs), "spread": [min(secs), max(secs)], "rows": values[0]["rows"]}
    return out


def measure(uri: str, rounds: int) -> dict:
    """Files and reads of one store, before and (when `compact_store` is wired) after compaction."""
    before = {**files_and_sizes(uri), "reads": measure_reads(uri, rounds)}
    result: dict[str, Any] = {"before": before, "after": None}
    if "://" in uri:
        return result  # compaction is measured on local copies only
    work = tempfile.mkdtemp(prefix="rlrec-bench-compact-")
    try:
        copy = os.path.join(work, "store")
        shutil.copytree(uri, copy)
        stats = compact_store(copy)
        if stats is not None:
            result["after"] = {**files_and_sizes(copy), "reads": measure_reads(copy, rounds), "compaction": stats}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000, help="steps of the synthetic store")
    ap.add_argument("--steps-per-shard", type=int, default=1_800, help="steps per shard (~34 KiB at 1,800)")
    ap.add_argument("--partitions", type=int, default=4, help="partition logs of the synthetic store")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per reader (after one warm-up round)")
    ap.add_argument("--store", default=None, help="build (or reuse) the synthetic store here (default: a temp dir)")
    ap.add_argument("--demo-store", default=None, help="a demo run's shards (default ./demo-data/shards if present)")
    ap.add_argument("--quick", action="store_true", help="20k steps, 2 rounds, no demo store unless given")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = min(args.steps, 20_000), min(args.rounds, 2)
    demo = args.demo_store
    if demo is None and not args.quick and os.path.isdir(os.path.join("demo-data", "shards", "_manifest")):
        demo = os.path.join("demo-data", "shards")

    tmp = None if args.store else tempfile.mkdtemp(prefix="rlrec-bench-store-")
    root = args.store or os.path.join(tmp, "store")
    try:
        built = build_synthetic(root, args.steps, args.steps_per_shard, args.partitions)
        print(
            f"synthetic store: {built['shards']} shards, {built['steps']:,} steps"
            + (" (reused)" if built["reused"] else f", built in {built['build_s']:.1f}s"),
            file=sys.stderr,
        )
        stores = {"synthetic": {"uri": root, "built": built, **measure(root, args.rounds)}}
        if demo:
            stores["demo"] = {"uri": demo, **measure(demo, args.rounds)}
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    doc = {
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "readers": list(READERS),
        "target_speedup_after_compaction": TARGET_SPEEDUP,
        "stores": stores,
    }
    for name, s in stores.items():
        b = s["before"]
        line = ", ".join(f"{side} {b['reads'][side]['seconds']:.2f}s" for side in SIDES)
        print(f"{name}: {b['files']} files, median {b['median_bytes'] / 1024:.1f} KiB; read all steps: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
