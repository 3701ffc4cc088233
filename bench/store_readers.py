"""gc, the trainer's start-up discovery and `rlrec retain` on a store with a long manifest history:
through the logs' live sets (what they do now) against through the whole history (what they did
before).

    python bench/store_readers.py [--entries 20000] [--live 4000] [--tail 500] [--rounds 3] [--s3] [--raw-log]
                                  [--readers gc,discovery,retain,follower] [--json PATH]

The store is one rlrec's writers build (`build_writer`: one partition log, log snapshots every
100 entries, so the history is about one object per 100 entries; compaction's merged shards,
`retain` of the replaced files, a live set, then ``tail`` shard entries) or, with ``--raw-log``,
`bench/store_head.py`'s (``entries`` shard entries merged into ``live`` live shards, a live set,
then ``tail`` entries; no log snapshot below the live set, so the history is one object per
entry: the worst history, not what a writer leaves). Per round, alternating which goes first:

  gc        ``gc(storage, 0, dry_run=True)`` (every file old enough): lists the files, then reads the
            heads (live set, tail, removal log); every file is named there, so the history is not read;
  gc-history  the same call reading the history alone (main's gc);
  discovery ``ManifestFollower(storage).live_head()`` (``ContinuousTrainer._first_shards``);
  discovery-history ``ManifestFollower(storage).poll(force_discover=True)`` from the history (what it was: it
            finds every shard entry, those compaction merged away too, where discovery finds the
            live shards -- the same shards a trainer then reads first, ``found`` counts both);
  retain    ``retain(storage, grace_s=3600, older_than_s=RETAIN_AGE_S, dry_run=True)``: from the heads
            (`rlrec.store.retention_heads`: live sets with retention columns, confirmed candidates);
  retain-history  the same call deciding from the whole history (main's retain); both must find
            the same (files to record, files to delete);
  follower  a new trainer's first manifest poll, ``ManifestFollower(storage).poll(force_discover=True)``,
            from the heads (`rlrec.trainer.follower_heads`);
  follower-history  the same poll with ``from_heads = False`` (what it was); both must deliver the
            same shards, covers and episode filters.

Then gc and gc-history again, locally, in the states gc runs in (`add_garbage`, cumulative):
``compacted`` (10 live shards merged, no `retain` since: replaced files only the history names)
and ``orphan`` (plus a crashed writer's staging file): gc reads the history alone there.

Storage calls of one call each are counted (on S3, GCS or Azure each is a request; a listing of
more than 1,000 keys is one request per 1,000). ``--s3`` runs the same on moto's S3
(`bench/store.py`'s `BenchS3`) with the whole store uploaded.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from rlrec.store.storage import Storage  # noqa: E402


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", os.path.join(os.path.dirname(__file__), f"{name}.py")
    )
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


class CountingStorage(Storage):
    """A Storage that counts its calls that reach the store (reads, probes, listings)."""

    calls: int = 0

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        self.calls += 1
        return super().read(path, limit=limit)

    def exists(self, path: str) -> bool:
        self.calls += 1
        return super().exists(path)

    def info(self, path: str):
        self.calls += 1
        return super().info(path)

    def list(self, prefix: str = "", recursive: bool = False):
        self.calls += 1
        return super().list(prefix, recursive)


def build_writer(root: str, entries: int, live: int, tail: int) -> dict:
    """The store as rlrec's own writers make it: every entry through `PartitionLog` (a claim,
    shard entries each published with its file, a log snapshot every 100 entries, a live set
    every 1,000), every ``entries / live`` shards merged by a replace entry as compaction
    commits them, `retain` then recording and deleting the replaced files, a live set written
    after it (folding its records), then ``tail`` more shard entries. Returns its counts."""
    import logging

    from rlrec.store.live_set import write_live_set
    from rlrec.store.manifest import PartitionLog, ReplaceEntry
    from rlrec.store.retention import retain

    head = _load("store_head")
    logging.getLogger("rlrec").setLevel(logging.ERROR)  # "published from memory" per shard
    st = Storage.from_uri(root, fsync=False)
    group = max(1, (entries - tail) // live)
    t0 = time.perf_counter()
    plog = PartitionLog(st, head.TOPIC, 0, snapshot_every=100)
    plog.claim("bench")
    pending = []

    def commit(n: int, ids: list[str], tag: str = ""):
        data = f"shard {n}{tag}".encode()
        return head._shard(n, ids, data, tag), data

    def merge(run: list) -> tuple:
        e, data = commit(run[-1].seq, [i for p in run for i in p.episode_ids], "m")
        return _as_merged(e, run), data

    for n in range(entries):
        e, data = commit(n, [f"ep-{n}-{j}" for j in range(4)])
        e = plog.append_shard(e)
        plog.publish(e, data)
        if n >= entries - tail:
            continue
        pending.append(e)
        if len(pending) == group or n == entries - tail - 1:
            merged, data = merge(pending)
            r = plog.append_replace(ReplaceEntry(replaces=tuple(p.seq for p in pending), shard=merged), pending)
            plog.publish(r.shard, data)  # as compaction does: commit, then publish
            pending = []
        if n == entries - tail - 1:
            retain(st, grace_s=0)
            write_live_set(st, head.TOPIC, 0, writer="bench")
    seqs = sorted(
        int(n.split(".")[0]) for n in os.listdir(os.path.join(root, "_manifest", head.TOPIC, "00000", "_live"))
    )
    return {
        "entries": plog.next_seq,
        "shard_entries": entries,
        "live_set_seq": seqs[-1],
        "live_files": len(os.listdir(os.path.join(root, head.POLICY))),
        "build_s": time.perf_counter() - t0,
    }


def _as_merged(e: Any, run: list) -> Any:
    """`e` named and spanning offsets as compaction's merged shard of `run` is
    (`rlrec.store.compaction`: the run's offsets, a ``c{12 hex}`` suffix)."""
    import dataclasses
    import uuid

    first, last = min(p.first_offset for p in run), max(p.last_offset for p in run)
    name = f"{e.topic}+{e.partition:05d}+{first:020d}+{last:020d}+e1.c{uuid.uuid4().hex[:12]}.parquet"
    return dataclasses.replace(
        e,
        path=f"{e.policy_id}/{name}",
        staging_path=f"{e.policy_id}/_staging/{name}",
        first_offset=first,
        last_offset=last,
    )


#: retain's age in the bench: nothing expires (the calls and reads of a run that records nothing
#: but replaced files are what is measured; with an age every live shard's time is read either way)
RETAIN_AGE_S = 10 * 365 * 86400.0

GARBAGE = {"compacted": "compacted, not yet retained", "orphan": "and an orphan staging file"}


def add_garbage(root: str, state: str) -> None:
    """Put the store built here in a state gc runs in: ``compacted`` -- the newest 10 live shards
    merged by a replace entry, published, a live set written after it, and no `retain` since
    (the replaced files are named by the history only); ``orphan`` -- a crashed writer's file in
    ``_staging/``."""
    from rlrec.store.live_set import write_live_set
    from rlrec.store.manifest import PartitionLog, ReplaceEntry, ShardEntry, live_shards

    head = _load("store_head")
    st = Storage.from_uri(root, fsync=False)
    if state == "orphan":
        os.makedirs(os.path.join(root, head.POLICY, "_staging"), exist_ok=True)
        with open(os.path.join(root, head.POLICY, "_staging", f"{head.TOPIC}+00000+crashed.parquet"), "wb") as f:
            f.write(b"a crashed writer's staging file")
        return
    plog = PartitionLog(st, head.TOPIC, 0, snapshot_every=100)
    plog.claim("bench-compactor")
    plog.recover()
    live = [e for e in live_shards(plog.load()).values() if isinstance(e, ShardEntry) and "+e1.c" not in e.path]
    run = sorted(live, key=lambda e: e.seq)[-10:]
    data = b"merged by the bench"
    merged = _as_merged(head._shard(run[-1].seq, [i for p in run for i in p.episode_ids], data, "m"), run)
    r = plog.append_replace(ReplaceEntry(replaces=tuple(p.seq for p in run), shard=merged), run)
    plog.publish(r.shard, data)
    write_live_set(st, head.TOPIC, 0, writer="bench")


def _runs(storage: Storage) -> dict[str, Callable[[], int]]:
    """Each measured call; returns what it found (checked equal between a pair)."""
    from rlrec.store import maintenance, retention, retention_heads
    from rlrec.trainer.manifest_follower import ManifestFollower

    def gc_heads() -> int:
        return len(maintenance.gc(storage, 0, dry_run=True))

    def gc_history() -> int:
        real = maintenance._heads_cannot_name
        maintenance._heads_cannot_name = lambda files, old: True  # the history alone decides (main's gc)
        try:
            return len(maintenance.gc(storage, 0, dry_run=True))
        finally:
            maintenance._heads_cannot_name = real

    def discovery() -> int:
        return len(ManifestFollower(storage).live_head())

    def discovery_history() -> int:
        f = ManifestFollower(storage)
        f.from_heads = False  # the poll from the history
        return len(f.poll(force_discover=True))

    def follower(from_heads: bool = True) -> tuple[int, str]:
        f = ManifestFollower(storage)
        f.from_heads = from_heads
        got = f.poll(force_discover=True)
        keys = "\n".join(f"{s.key} {f.covers.get(s.key, (None, None))[1]} {s.episodes}" for s in got)
        return len(got), hashlib.sha256(keys.encode()).hexdigest()[:16]

    def retain_heads() -> tuple[int, int]:
        res = retention.retain(storage, grace_s=3600, older_than_s=RETAIN_AGE_S, dry_run=True)
        return len(res.recorded), len(res.deleted)

    def retain_history() -> tuple[int, int]:
        real = retention_heads.heads_or_history
        retention_heads.heads_or_history = lambda st, records, **kw: ({}, retention.read_logs(st))  # main's retain
        try:
            return retain_heads()
        finally:
            retention_heads.heads_or_history = real

    return {
        "gc": gc_heads,
        "gc-history": gc_history,
        "discovery": discovery,
        "discovery-history": discovery_history,
        "retain": retain_heads,
        "retain-history": retain_history,
        "follower": follower,
        "follower-history": lambda: follower(from_heads=False),
    }


def measure(storage: Storage, rounds: int, readers: tuple[str, ...] = ("gc", "discovery")) -> dict:
    pairs = [(a, f"{a}-history") for a in readers]
    runs = {k: fn for k, fn in _runs(storage).items() if k.split("-")[0] in readers}
    times: dict[str, list[float]] = {k: [] for k in runs}
    found = {k: fn() for k, fn in runs.items()}  # warm-up (imports, page cache)
    for k in ("gc", "retain", "follower"):
        assert found.get(k) == found.get(f"{k}-history"), found  # the same decision, the same deliveries
    # discovery finds the live shards; a history poll every shard entry, merged-away ones too
    for r in range(rounds):
        for a, b in pairs:
            for k in (a, b) if r % 2 == 0 else (b, a):
                t0 = time.perf_counter()
                runs[k]()
                times[k].append(time.perf_counter() - t0)
    calls = {}
    cls = storage.__class__
    try:
        storage.__class__ = CountingStorage  # the same client, counted
        for k, fn in runs.items():
            storage.calls = 0  # type: ignore[attr-defined]
            fn()
            calls[k] = storage.calls  # type: ignore[attr-defined]
    finally:
        storage.__class__ = cls
    out: dict[str, Any] = {"found": found, "storage_calls": calls, "seconds": {}}
    for k, v in times.items():
        out["seconds"][k] = {"median": statistics.median(v), "spread": [min(v), max(v)], "rounds": v}
    for a, b in pairs:
        ratios = [y / max(x, 1e-9) for x, y in zip(times[a], times[b])]
        out[f"{a}_speedup"] = {"median": statistics.median(ratios), "spread": [min(ratios), max(ratios)]}
    return out


def _line(where: str, doc: dict) -> str:
    s, c = doc["seconds"], doc["storage_calls"]
    parts = []
    for k in ("gc", "discovery", "retain", "follower"):
        if k in s:
            sp = doc[f"{k}_speedup"]
            parts.append(
                f"{k} {s[k]['median']:.3f}s ({c[k]} calls) vs history {s[f'{k}-history']['median']:.3f}s "
                f"({c[f'{k}-history']} calls), {sp['median']:.1f}x ({sp['spread'][0]:.1f}-{sp['spread'][1]:.1f}x)"
            )
    return f"{where}: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=20_000, help="shard entries of the log")
    ap.add_argument("--live", type=int, default=4_000, help="live shards before the tail")
    ap.add_argument("--tail", type=int, default=500, help="shard entries after the live set")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--s3", action="store_true", help="also on moto's S3 (the whole store uploaded)")
    ap.add_argument(
        "--raw-log",
        action="store_true",
        help="bench/store_head.py's store (no log snapshots: a history of one object per entry) instead of "
        "the one rlrec's writers build (build_writer)",
    )
    ap.add_argument("--readers", default="gc,discovery", help="of gc, discovery, retain, follower (comma-separated)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    readers = tuple(args.readers.split(","))
    head = _load("store_head")
    root = tempfile.mkdtemp(prefix="rlrec-bench-readers-")
    try:
        build = head.build if args.raw_log else build_writer
        built = build(root, args.entries, args.live, args.tail)
        print(f"built {built}", file=sys.stderr)
        doc: dict[str, Any] = {
            "args": vars(args),
            "built": built,
            "local": measure(Storage.from_uri(root), args.rounds, readers),
        }
        print(_line("local", doc["local"]))
        if args.s3:
            s3 = _load("store").BenchS3()
            try:
                t0 = time.perf_counter()
                st = s3.upload_store(root, "readers")
                doc["s3_upload_s"] = time.perf_counter() - t0
                doc["s3"] = measure(st, args.rounds, readers)
                print(_line("S3 (moto)", doc["s3"]))
            finally:
                s3.close()
        for state in ("compacted", "orphan"):  # the states gc and retain run in (cumulative), local
            add_garbage(root, state)
            doc[f"local_{state}"] = measure(
                Storage.from_uri(root), args.rounds, tuple(r for r in readers if r != "discovery")
            )
            print(_line(f"local, {GARBAGE[state]}", doc[f"local_{state}"]))
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
