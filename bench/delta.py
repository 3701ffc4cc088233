"""Delta view benchmark: what `rlrec export URI URI --to delta` costs per manifest entry, and how
far `--follow` lags behind the store.

    python bench/delta.py [--shards 556] [--episodes 8] [--steps 225] [--rounds 3] [--quick] [--json PATH]

The store: `--shards` episode shards over 4 partition logs of synthetic CartPole episodes
(`--episodes` per shard, at most `--steps` steps each; the defaults are the 1M-step, 556-shard
store's shape: ~1,800 steps a shard), on local disk. Two sides, alternating for `--rounds`
rounds (the order flips every round), each building one Delta view of the whole history from
nothing:

  ours       `rlrec.delta_view.export_views`: one create-once commit per entry (add, the
             partition's txn), the footer read through the schema gate, a checkpoint every 100;
  baseline   delta-rs's own writer on the same files: a table rooted in a copy of the policy
             directory (hard links), one `create_write_transaction` per shard with its add action
             and the partition's app transaction, checkpoints by its post-commit hook -- the
             measured "Delta commit cost per entry" of issue 48.

Reported per side: seconds per entry, median and spread. Then the `--follow` lag: `follow_views`
(1 s poll, the CLI's default) runs in a thread while a writer commits one shard a second for
`--follow-seconds`; per commit, the seconds from its return until the view's newest version
holds it (polled every 20 ms; the poll shares the process). Prints JSON (`--json PATH` writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from rlrec.delta_view import LOG_DIR, export_views  # noqa: E402
from rlrec.store.commit import ShardCommitter  # noqa: E402
from rlrec.store.snapshot import open_snapshot  # noqa: E402
from rlrec.trainer.synthetic import expert_cartpole_episodes  # noqa: E402

POLICY = "expert"
PARTITIONS = 4


def build_store(root: str, shards: int, episodes: int, steps: int) -> list:
    committers = [ShardCommitter(root, "rl", p) for p in range(PARTITIONS)]
    for i in range(shards):
        committers[i % PARTITIONS].commit(expert_cartpole_episodes(episodes, seed=i, max_steps=steps))
    return open_snapshot(root).entries


def ours(root: str) -> float:
    shutil.rmtree(os.path.join(root, POLICY, LOG_DIR), ignore_errors=True)
    t0 = time.perf_counter()
    [res] = export_views(root)
    took = time.perf_counter() - t0
    assert res.commits > 0
    return took / res.commits


def baseline(root: str, entries: list, workdir: str) -> float:
    """delta-rs's writer, one commit per shard entry, on hard links of the same files."""
    import pyarrow.parquet as pq
    from deltalake import DeltaTable, Schema
    from deltalake.transaction import AddAction, CommitProperties, Transaction

    table = os.path.join(workdir, "baseline")
    shutil.rmtree(table, ignore_errors=True)
    os.makedirs(table)
    for e in entries:
        os.link(os.path.join(root, e.path), os.path.join(table, os.path.basename(e.path)))
    schema = Schema.from_arrow(pq.read_schema(os.path.join(root, entries[0].path)).remove_metadata())
    t0 = time.perf_counter()
    dt = DeltaTable.create(table, schema)
    for e in entries:
        rows = pq.ParquetFile(os.path.join(root, e.path)).metadata.num_rows  # as ours reads each footer
        add = AddAction(
            os.path.basename(e.path), e.bytes, {}, int(e.commit_time * 1000), True, json.dumps({"numRecords": rows})
        )
        txn = Transaction(f"rlrec:{e.topic}/{e.partition}", int(e.seq) + 1)
        dt.create_write_transaction([add], "append", schema, commit_properties=CommitProperties(app_transactions=[txn]))
        dt.update_incremental()  # the next commit's read version (else delta-rs sees its own txn as a conflict)
    return (time.perf_counter() - t0) / len(entries)


def follow_lag(root: str, seconds: int) -> list[float]:
    from rlrec.delta_view import follow_views, version_cursor
    from rlrec.store.snapshot import Cursor

    stop = threading.Event()
    thread = threading.Thread(target=follow_views, args=(root,), kwargs={"interval_s": 1.0, "stop": stop.is_set})
    thread.start()
    c = ShardCommitter(root, "rl", 0)
    lags = []
    try:
        for i in range(seconds):
            time.sleep(1.0)
            c.commit(expert_cartpole_episodes(4, seed=100_000 + i, max_steps=100))
            done = time.perf_counter()
            want = c.log.next_seq
            while Cursor.parse(version_cursor(root, POLICY)[1]).positions.get(("rl", 0), 0) < want:
                if time.perf_counter() - done > 30:
                    raise RuntimeError("the view did not follow within 30 s")
                time.sleep(0.02)
            lags.append(time.perf_counter() - done)
    finally:
        stop.set()
        thread.join()
    return lags


def _summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=556)
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--steps", type=int, default=225)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--follow-seconds", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 40 small shards, 1 round, 3 s of follow")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.quick:
        args.shards, args.episodes, args.steps, args.rounds, args.follow_seconds = 40, 2, 50, 1, 3
    work = tempfile.mkdtemp(prefix="rlrec-bench-delta-")
    try:
        root = os.path.join(work, "store")
        t0 = time.perf_counter()
        entries = build_store(root, args.shards, args.episodes, args.steps)
        built = time.perf_counter() - t0
        raw: dict[str, list[float]] = {"ours": [], "baseline": []}
        for r in range(args.rounds):
            for side in ("ours", "baseline") if r % 2 == 0 else ("baseline", "ours"):
                raw[side].append(ours(root) if side == "ours" else baseline(root, entries, work))
        lags = follow_lag(root, args.follow_seconds)
        doc = {
            "shards": args.shards,
            "steps": sum(e.steps for e in entries),
            "build_s": built,
            "entry_s": {side: _summary(xs) for side, xs in raw.items()},
            "raw": raw,
            "follow_lag_s": _summary(lags),
            "follow_raw": lags,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
