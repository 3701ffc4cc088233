"""Compaction benchmark: small shards before and after `rlrec compact`, and reading them.

    python bench/compaction.py [--steps 1000000] [--steps-per-shard 500] [--rounds 3] [--quick] [--json PATH]

Builds a synthetic store on a local directory: one partition, `--steps / --steps-per-shard`
committed tabular shards of the scripted CartPole expert's episodes (one row per step, the
layout a quiet consumer leaves with `--max-file-age-s`: many small files). Then:

  before     files, median file size; seconds to read every step of the manifest's file list
             (`rlrec inspect --paths`) with pyarrow (`pq.read_table` per file, concatenated),
             polars (`pl.read_parquet(list)`) and DuckDB (`read_parquet([...])` count and sum);
  compact    `compact_partition(min_age_s=0, target_bytes=128 MiB)`: seconds, steps/s;
  after      the same rows on the compacted store's file list.

Each read is repeated --rounds times alternating before/after (the order flips every round);
medians and min..max are reported. Prints one JSON document (also written to --json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)


def build_store(root: str, steps: int, steps_per_shard: int) -> tuple[Any, int]:
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    c = ShardCommitter(root, "rl", 0, fmt="tabular")
    made = 0
    seed = 0
    while made < steps:
        eps = []
        n = 0
        while n < steps_per_shard:
            ep = expert_cartpole_episodes(1, seed=seed, max_steps=min(500, steps_per_shard))[0]
            seed += 1
            eps.append(ep)
            n += ep.length
        made += c.commit(eps).steps
    return c, made


def read_times(paths: list[str]) -> dict[str, float]:
    import duckdb
    import polars as pl
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {}
    t0 = time.perf_counter()
    table = pa.concat_tables([pq.read_table(p) for p in paths])
    out["pyarrow"] = time.perf_counter() - t0
    rows = table.num_rows
    t0 = time.perf_counter()
    df = pl.read_parquet(paths)
    out["polars"] = time.perf_counter() - t0
    assert df.height == rows
    t0 = time.perf_counter()
    con = duckdb.connect()
    n, _ = con.execute("select count(*), sum(rewards) from read_parquet(?)", [paths]).fetchone()
    out["duckdb"] = time.perf_counter() - t0
    assert n == rows
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--steps-per-shard", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="100k steps, 2 rounds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 100_000, 2

    from rlrec.store.compaction import compact_partition
    from rlrec.store.snapshot import open_snapshot

    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        c, steps = build_store(root, args.steps, args.steps_per_shard)
        build_s = time.perf_counter() - t0
        before = open_snapshot(root)
        t0 = time.perf_counter()
        res = compact_partition(c.log, min_age_s=0)
        compact_s = time.perf_counter() - t0
        after = open_snapshot(root)
        sides = {"before": before.files(), "after": after.files()}
        times: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
        for r in range(args.rounds):
            for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                for k, v in read_times(sides[side]).items():
                    times[side].setdefault(k, []).append(v)

        def sizes(paths: list[str]) -> dict[str, float]:
            b = [os.path.getsize(p) for p in paths]
            return {"files": len(b), "median_bytes": statistics.median(b), "total_bytes": sum(b)}

        doc = {
            "steps": steps,
            "build_s": build_s,
            "compaction": {
                "seconds": compact_s,
                "steps_per_s": steps / compact_s if compact_s else None,
                "replaced": res.replaced,
                "written": res.written,
            },
            **{
                side: {
                    **sizes(sides[side]),
                    "read_s": {
                        k: {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v}
                        for k, v in times[side].items()
                    },
                }
                for side in sides
            },
        }
        doc["speedup"] = {
            k: doc["before"]["read_s"][k]["median"] / doc["after"]["read_s"][k]["median"]
            for k in doc["before"]["read_s"]
        }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return doc


if __name__ == "__main__":
    main()
