"""What a live set costs the writer's commit path: the commit that writes one (every
`LIVE_SET_EVERY` = 100 commits, column-wise from the writer's last live set: docs/GUARANTEES.md §3
"Live sets") against a plain commit, on a log with many live shards.

    python bench/live_set_commit.py [--entries 25000] [--live 5000] [--rounds 7] [--json PATH]

The log is `bench/store_head.py`'s (``entries`` shard entries merged into ``live`` live shards,
one file each, a live set); then a new writer claims it (its first live set is built from the
history in its background thread, waited for) and commits ``rounds`` x 100 shard entries as
`PartitionLog.append_shard` + ``publish`` (what a consumer's commit does in the manifest; the
Parquet write is not timed). Each round is 100 commits, one of which writes a live set (and the
log snapshot it goes with: every 100 entries too); reported per round: that commit's time, the
median of the round's other commits, and their difference -- median and spread over the rounds.
Rounds are the same work in turn (each adds 100 live shards), so no alternation is needed
between two sides; the machine's load is printed with every number.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", os.path.join(os.path.dirname(__file__), f"{name}.py")
    )
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def measure(root: str, rounds: int) -> dict:
    import logging

    from rlrec.store.live_set import LIVE_SET_EVERY, live_set_seqs
    from rlrec.store.manifest import PartitionLog
    from rlrec.store.storage import Storage

    head = _load("store_head")
    logging.getLogger("rlrec").setLevel(logging.ERROR)
    st = Storage.from_uri(root, fsync=False)
    plog = PartitionLog(st, head.TOPIC, 0, snapshot_every=100)
    plog.claim("bench-writer")
    plog.recover()
    n = plog.next_seq + 10_000_000  # file names above the built ones
    t0 = time.perf_counter()

    def commit() -> float:
        nonlocal n
        n += 1
        data = f"bench commit {n}".encode()
        e = head._shard(n, [f"ep-{n}-{j}" for j in range(4)], data)
        t = time.perf_counter()
        e = plog.append_shard(e)
        dt = time.perf_counter() - t
        plog.publish(e, data)
        return dt

    while plog._live_set is None:  # the first live set after the claim: from the history, in the background
        commit()
        if plog._live_builder is not None:
            plog._live_builder.join()
    first_s = time.perf_counter() - t0
    out: dict[str, Any] = {"first_live_set_s": first_s, "rounds": []}
    for _ in range(rounds):
        before = len(live_set_seqs(st, head.TOPIC, 0))
        times, at = [], None
        for i in range(LIVE_SET_EVERY):
            seq0 = plog._live_set.seq
            times.append(commit())
            if plog._live_set.seq != seq0:  # this commit wrote a live set
                at = i
        if at is None:
            raise RuntimeError("no live set written in 100 commits")
        others = [t for i, t in enumerate(times) if i != at]
        out["rounds"].append(
            {
                "live_set_commit_s": times[at],
                "plain_commit_median_s": statistics.median(others),
                "live_sets_before": before,
                "load": os.getloadavg()[0],
            }
        )
    ls = [r["live_set_commit_s"] for r in out["rounds"]]
    plain = [r["plain_commit_median_s"] for r in out["rounds"]]
    extra = [a - b for a, b in zip(ls, plain)]
    out["summary"] = {
        "live_set_commit_ms": {"median": 1e3 * statistics.median(ls), "spread": [1e3 * min(ls), 1e3 * max(ls)]},
        "plain_commit_ms": {"median": 1e3 * statistics.median(plain), "spread": [1e3 * min(plain), 1e3 * max(plain)]},
        "extra_ms": {"median": 1e3 * statistics.median(extra), "spread": [1e3 * min(extra), 1e3 * max(extra)]},
        "amortized_ms_per_commit": 1e3 * statistics.median(extra) / LIVE_SET_EVERY,
        "live_shards": len(plog._live_set.shards),
        "load": [min(r["load"] for r in out["rounds"]), max(r["load"] for r in out["rounds"])],
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=25_000)
    ap.add_argument("--live", type=int, default=5_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--store", default=None, help="build here (kept) instead of a temporary directory")
    ap.add_argument("--reuse", action="store_true", help="measure on a copy of --store, built before")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    head = _load("store_head")
    root = args.store or tempfile.mkdtemp(prefix="rlrec-bench-live-commit-")
    t0 = time.perf_counter()
    if args.reuse:  # a copy of the store built before (each run starts from the same log)
        import shutil

        built = {"reused": args.store}
        root = tempfile.mkdtemp(prefix="rlrec-bench-live-commit-")
        shutil.rmtree(root)
        shutil.copytree(args.store, root)
    else:
        built = head.build(root, args.entries, args.live, 0)
    print(f"built {built} in {time.perf_counter() - t0:.0f}s, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    doc = {"args": vars(args), "built": built, **measure(root, args.rounds)}
    s = doc["summary"]
    print(
        f"{s['live_shards']} live shards: a live-set commit {s['live_set_commit_ms']['median']:.1f} ms "
        f"({s['live_set_commit_ms']['spread'][0]:.1f}-{s['live_set_commit_ms']['spread'][1]:.1f}) vs a plain commit "
        f"{s['plain_commit_ms']['median']:.2f} ms ({s['plain_commit_ms']['spread'][0]:.2f}-"
        f"{s['plain_commit_ms']['spread'][1]:.2f}); +{s['extra_ms']['median']:.1f} ms every 100 commits "
        f"({s['amortized_ms_per_commit']:.2f} ms a commit); first live set after the claim {doc['first_live_set_s']:.1f} s; "
        f"load {s['load'][0]:.1f}-{s['load'][1]:.1f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if not args.store or args.reuse:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
