"""Opening the head of a store with a long manifest history: `rlrec.open(uri)` through live sets
against listing the store's live files (the ``head`` row of ``bench/store.py``).

    python bench/store_head.py [--entries 100000] [--live 20000] [--tail 500] [--rounds 5] [--s3] [--json PATH]
    python bench/store_head.py --store DIR --reuse --extend 50 ...   (more commits by a new writer, then measure)

One partition log is built on a local directory: ``entries`` shard entries, every ``entries /
live`` of them merged by a replace entry as compaction does (so ``live`` live shards, one file
each; the merged-away shards have no files, which opening the head never reads), a live set
written (`rlrec.store.live_set.write_live_set`), then ``tail`` more shard entries after it,
committed through `PartitionLog` as the partition's writer commits them (a claim, then a log
snapshot and a live set every 100 entries: what follows the newest live set is what a writer
leaves, 0 to ~100 entries, reported as ``entries_after_live_set``; ``--extend`` moves it). Per
round, the order reversed every other round:

  head      ``open_snapshot(root).files()`` (what ``rlrec.open(root)`` does, then the live
            files' paths: what a listing yields): the newest live set, the entries after it, the
            removal log -- timed in this process, imports done (``head_open_only``: the open
            alone, for scale);
  listing   ``os.listdir`` of the policy directory holding the live files (the best a plain
            reader can do to learn them: names only);
  listing_pyarrow  pyarrow's ``LocalFileSystem.get_file_info`` of that directory (names and
            sizes: what a pyarrow reader of the files lists);
  history   ``open_snapshot(root, as_of=cursor)``: the same point through the whole history (as
            before live sets; one round per round, for scale).

Storage calls of one head open are counted (a `Storage` subclass that counts reads, existence
probes, listings and ``info`` calls): on S3, GCS or Azure each is one request (no listing here
reaches 1,000 keys, a listing's page), except that pyarrow may follow a missing key's ``info``
on S3 with a listing (two requests).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from rlrec.store.storage import Storage  # noqa: E402

TOPIC = "rl"
POLICY = "pol"
#: contract: opening the head costs at most this many times listing the live files
AT_MOST = 2.0


class CountingStorage(Storage):
    """A Storage that counts its calls."""

    calls: int = 0

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        self.calls += 1
        return super().read(path, limit=limit)

    def exists(self, path: str) -> bool:
        self.calls += 1
        return super().exists(path)

    def list(self, prefix: str = "", recursive: bool = False):
        self.calls += 1
        return super().list(prefix, recursive)

    def info(self, path: str):
        self.calls += 1
        return super().info(path)


def _shard(i: int, ids: list[str], data: bytes, tag: str = ""):
    from rlrec.store.manifest import ShardEntry

    first = int(ids[0].split("-")[1])
    name = f"{TOPIC}+00000+{10 * i:020d}+{10 * i + 9:020d}+e1.{i}{tag}.parquet"
    return ShardEntry(
        path=f"{POLICY}/{name}",
        staging_path=f"{POLICY}/_staging/{name}",
        topic=TOPIC,
        partition=0,
        policy_id=POLICY,
        first_offset=10 * first,
        last_offset=10 * i + 9,
        episode_ids=ids,
        episodes=len(ids),
        steps=100 * len(ids),
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        format="episodes",
        format_version=1,
        event_schema_versions={"EpisodeStart": 1, "StepBatch": 1},
        min_policy_version=1,
        max_policy_version=1,
    )


def build(root: str, entries: int, live: int, tail: int) -> dict:
    """The store (module docstring); returns its counts. Entries are written as files directly
    (not through `PartitionLog`, whose checks and snapshots would take an hour at this size on a
    loaded machine): a claim, then shard and replace entries, no log snapshots."""
    from rlrec.store.live_set import write_live_set
    from rlrec.store.manifest import ClaimEntry, ReplaceEntry, entry_path
    from rlrec.store.manifest_entries import _dumps

    st = Storage.from_uri(root, fsync=False)
    os.makedirs(os.path.join(root, POLICY), exist_ok=True)
    group = max(1, (entries - tail) // live)
    t0 = time.perf_counter()
    seq = 0

    def put(e) -> None:
        nonlocal seq
        with open(os.path.join(root, entry_path(TOPIC, 0, seq)), "w") as f:
            f.write(_dumps(e.to_dict()))
        seq += 1

    os.makedirs(os.path.dirname(os.path.join(root, entry_path(TOPIC, 0, 0))), exist_ok=True)
    put(ClaimEntry(epoch=1, writer="bench", seq=0))
    pending = []

    def shard(n: int, live_file: bool, tag: str = "", ids=None):
        ids = ids or [f"ep-{n}-{j}" for j in range(4)]
        data = f"shard {n}{tag}".encode()
        e = _shard(n, ids, data, tag).with_commit(seq=seq, epoch=1, writer="bench")
        if live_file:
            with open(os.path.join(root, e.path), "wb") as f:
                f.write(data)
        return e

    for n in range(entries - tail):
        e = shard(n, False)
        put(e)
        pending.append(e)
        if len(pending) == group or n == entries - tail - 1:
            merged = shard(n, True, "m", [i for p in pending for i in p.episode_ids])
            r = ReplaceEntry(replaces=tuple(p.seq for p in pending), shard=merged)
            put(r.with_commit(seq=seq, epoch=1, writer="bench"))
            pending = []
    written = time.perf_counter()
    ls = write_live_set(st, TOPIC, 0, writer="bench")
    live_set_s = time.perf_counter() - written
    # the tail as the partition's writer commits it: a claim, then shard entries with a log
    # snapshot every 100 (what a reader of the head reads after the live set)
    commits = extend(root, entries - tail, tail, "bench-tail")
    return {
        "shard_entries": entries,
        "first_live_set_seq": ls.seq if ls else None,
        "first_live_set_bytes": len(ls.to_bytes()) if ls else None,
        "first_live_set_write_s": live_set_s,
        "tail_commits": commits,
        "build_s": time.perf_counter() - t0,
    }


def extend(root: str, first: int, count: int, writer: str) -> dict:
    """Commit `count` shard entries (numbered from `first`) as the partition's writer commits
    them: a claim, then each shard committed and published, with a log snapshot every 100
    entries and a live set every `LIVE_SET_EVERY` (so the entries a reader of the head reads
    after the newest live set are what a writer leaves). Returns the commits' seconds: median,
    max, and those of the commits that wrote a live set (on the commit path)."""
    from rlrec.store.manifest import PartitionLog

    st = Storage.from_uri(root, fsync=False)
    plog = PartitionLog(st, TOPIC, 0, snapshot_every=100)
    plog.claim(writer)
    plog.recover()  # as a writer does after its claim (the shards read are published: no snapshot lists them)
    times, with_live_set = [], []
    for n in range(first, first + count):
        data = f"shard {n}".encode()
        e = _shard(n, [f"ep-{n}-{j}" for j in range(4)], data)
        written = plog._live_set
        t0 = time.perf_counter()
        plog.publish(plog.append_shard(e), data)  # as the consumer's committer: commit, then publish
        times.append(time.perf_counter() - t0)
        if plog._live_set is not written:
            with_live_set.append(times[-1])
    if plog._live_builder is not None:  # its first live set, from the history: not measured with it running
        plog._live_builder.join()
    return {
        "commits": count,
        "median_s": statistics.median(times) if times else None,
        "max_s": max(times) if times else None,
        "with_live_set_s": with_live_set,
    }


def measure(root: str, rounds: int, history: bool = True) -> dict:
    import pyarrow.fs as pafs

    from rlrec.store.live_set import head_shards
    from rlrec.store.snapshot import open_snapshot

    times: dict[str, list[float]] = {
        "head": [],
        "head_open_only": [],
        "listing": [],
        "listing_pyarrow": [],
        "history": [],
    }
    head = open_snapshot(root)  # warm-up (imports, page cache)
    cursor = head.cursor
    shards = len(head.entries)
    read = head_shards(Storage.from_uri(root), TOPIC, 0)
    local = pafs.LocalFileSystem()

    def run_head() -> None:
        t0 = time.perf_counter()
        snap = open_snapshot(root)
        t1 = time.perf_counter()
        files = snap.files()
        t2 = time.perf_counter()
        times["head"].append(t2 - t0)
        times["head_open_only"].append(t1 - t0)
        assert len(files) == shards and snap.cursor == cursor

    def run_listing() -> None:
        t0 = time.perf_counter()
        names = [n for n in os.listdir(os.path.join(root, POLICY)) if n.endswith(".parquet")]
        times["listing"].append(time.perf_counter() - t0)
        assert len(names) == shards

    def run_listing_pyarrow() -> None:
        t0 = time.perf_counter()
        infos = local.get_file_info(pafs.FileSelector(os.path.join(root, POLICY)))
        files = [i for i in infos if i.path.endswith(".parquet")]
        times["listing_pyarrow"].append(time.perf_counter() - t0)
        assert len(files) == shards

    for r in range(rounds):
        order = (run_head, run_listing, run_listing_pyarrow)
        for fn in order if r % 2 == 0 else order[::-1]:
            fn()
        if not history:
            continue
        t0 = time.perf_counter()
        full = open_snapshot(root, as_of=cursor)
        times["history"].append(time.perf_counter() - t0)
        assert len(full.entries) == shards
    counting = CountingStorage.from_uri(root)
    open_snapshot(counting)
    ratios = [h / max(x, 1e-9) for h, x in zip(times["head"], times["listing"])]
    ratios_pa = [h / max(x, 1e-9) for h, x in zip(times["head"], times["listing_pyarrow"])]
    return {
        "live_shards": shards,
        "entries": read.end,
        "live_set_seq": read.live_set,
        "entries_after_live_set": read.end - (read.live_set or 0),
        "seconds": {
            k: {"median": statistics.median(v), "spread": [min(v), max(v)], "rounds": v} for k, v in times.items() if v
        },
        "head_over_listing": {
            "median": statistics.median(ratios),
            "spread": [min(ratios), max(ratios)],
            "at_most": AT_MOST,
            "met": statistics.median(ratios) <= AT_MOST,
        },
        "head_over_listing_pyarrow": {
            "median": statistics.median(ratios_pa),
            "spread": [min(ratios_pa), max(ratios_pa)],
            "at_most": AT_MOST,
            "met": statistics.median(ratios_pa) <= AT_MOST,
        },
        "head_storage_calls": counting.calls,
    }


def measure_s3(root: str, live_set_seq: int, rounds: int) -> dict:
    """The head open on moto's S3 (`bench/store.py`'s `BenchS3`) with only what it reads uploaded:
    the live set, entry 0 and the entries from the one below the live set on (no shard file: a
    head open reads none). The history is not there (a gap below): a head open that fell back to
    it would fail, so one that succeeds read the live set. Listing the live files is not measured here (25,000 PUTs to moto take minutes)."""
    import importlib.util
    import shutil

    from rlrec.store.manifest import HEAD_HINT, entry_path
    from rlrec.store.snapshot import open_snapshot

    spec = importlib.util.spec_from_file_location("bench_store", os.path.join(os.path.dirname(__file__), "store.py"))
    bench_store = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench_store)  # type: ignore[union-attr]
    BenchS3 = bench_store.BenchS3

    sub = tempfile.mkdtemp(prefix="rlrec-bench-head-s3-")
    s3 = BenchS3()
    try:
        live = os.path.join("_manifest", TOPIC, "00000", "_live")
        shutil.copytree(os.path.join(root, live), os.path.join(sub, live))
        first = entry_path(TOPIC, 0, 0)  # a reader checks the live set's "first" against it
        os.makedirs(os.path.dirname(os.path.join(sub, first)), exist_ok=True)
        shutil.copy(os.path.join(root, first), os.path.join(sub, first))
        hint = os.path.join("_manifest", TOPIC, "00000", HEAD_HINT)  # names the newest log snapshot
        if os.path.exists(os.path.join(root, hint)):
            shutil.copy(os.path.join(root, hint), os.path.join(sub, hint))
        seq = live_set_seq - 1
        while os.path.exists(os.path.join(root, entry_path(TOPIC, 0, seq))):
            os.makedirs(os.path.dirname(os.path.join(sub, entry_path(TOPIC, 0, seq))), exist_ok=True)
            shutil.copy(os.path.join(root, entry_path(TOPIC, 0, seq)), os.path.join(sub, entry_path(TOPIC, 0, seq)))
            seq += 1
        st = s3.upload_store(sub, "head")
        times = []
        shards = len(open_snapshot(st).entries)  # warm-up
        for _ in range(rounds):
            t0 = time.perf_counter()
            assert len(open_snapshot(st).entries) == shards
            times.append(time.perf_counter() - t0)
        st.__class__ = CountingStorage  # the same client, counted
        open_snapshot(st)
        return {
            "seconds": {"median": statistics.median(times), "spread": [min(times), max(times)], "rounds": times},
            "requests": st.calls,
            "uploaded_entries": seq - live_set_seq + 1,
        }
    finally:
        s3.close()
        shutil.rmtree(sub, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=100_000, help="shard entries of the log")
    ap.add_argument("--live", type=int, default=20_000, help="live shards before the tail")
    ap.add_argument("--tail", type=int, default=500, help="shard entries after the live set")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--store", default=None, help="build here (default: a temp dir, removed after)")
    ap.add_argument("--s3", action="store_true", help="also open the head on moto's S3 (measure_s3)")
    ap.add_argument("--reuse", action="store_true", help="--store already holds the built store: measure only")
    ap.add_argument("--no-history", action="store_true", help="skip the history rounds (a minute each)")
    ap.add_argument("--extend", type=int, default=0, help="with --reuse: commit this many more shard entries first")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    root = args.store or tempfile.mkdtemp(prefix="rlrec-bench-head-")
    from rlrec.store.live_set import live_set_seqs

    if args.reuse:
        built: dict = {"reused": True}
        if args.extend:
            first = sum(1 for n in os.listdir(os.path.join(root, POLICY)) if n.endswith(".parquet")) * 10**6
            built["extended"] = extend(root, first, args.extend, f"bench-extend-{first}")
    else:
        built = build(root, args.entries, args.live, args.tail)
    print(f"built {built}", file=sys.stderr)
    doc = {"args": vars(args), "built": built, **measure(root, args.rounds, not args.no_history)}
    if args.s3:
        doc["s3"] = measure_s3(root, live_set_seqs(Storage.from_uri(root), TOPIC, 0)[-1], args.rounds)
        print(f"S3 (moto): head open {doc['s3']['seconds']['median']:.2f}s, {doc['s3']['requests']} requests")
    s, r = doc["seconds"], doc["head_over_listing"]
    rp = doc["head_over_listing_pyarrow"]
    print(
        f"head of {doc['entries']:,} entries ({doc['entries_after_live_set']} after the live set), "
        f"{doc['live_shards']:,} live shards: open {s['head']['median']:.3f}s "
        f"({doc['head_storage_calls']} storage calls), listing {s['listing']['median']:.3f}s "
        f"(pyarrow.fs {s['listing_pyarrow']['median']:.3f}s: head/that {rp['median']:.2f}x), "
        f"history {s['history']['median'] if 'history' in s else float('nan'):.2f}s; head/listing {r['median']:.2f}x "
        f"[{r['spread'][0]:.2f}-{r['spread'][1]:.2f}] (contract <= {AT_MOST:g}x: {'met' if r['met'] else 'MISSED'})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if not args.store:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
