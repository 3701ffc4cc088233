"""Compaction: merge a partition's small committed shards into large ones, no data change.

A writer that owns a partition (it holds the newest claim of its manifest log) compacts it in
four steps, each safe to interrupt at any point (kill -9 included):

1. plan: read the whole log, take its *live* shards (`rlrec.store.log_shards.live_shards`) and pick
   runs of small ones (`plan_runs`: same policy, format and event schema versions, each older than
   ``min_age_s``, a run's total at most ``target_bytes`` on disk and `decode_budget` decoded,
   at least two shards);
2. stage: read the run's shards (sha256 checked against the manifest, schemas through the schema
   gate; the parts whose decoded sizes fit `decode_budget`), concatenate their rows -- whole
   episodes, never split -- into one Parquet file of the same shard format, check it (the schema
   gate; the parts' rows and exactly their entries' episode ids, read from the file), and write
   it create-once at ``{policy}/_staging/{name}`` (a fresh name per attempt). A shard that stops
   its run is left out of the next plans of the same caller (``avoid``). Interrupted here: an
   orphan staging file, which ``rlrec gc`` collects;
3. commit: append a replace entry (`PartitionLog.append_replace`: the same create-once append
   and fencing as a shard entry) naming the run's seqs and the new shard. This is the commit
   point; the log refuses a replacement that does not hold exactly the replaced episodes. Just
   before it, the removal log is read again: a run a part of which retention removed while it
   merged is dropped (its staged file is an orphan for gc);
4. publish: move the staged file to ``{policy}/{name}`` (if interrupted or failed: rolled
   forward by the owner's next claim or compaction run, `PartitionLog.recover`). The replaced files stay: retention removes
   them later, so a cursor taken before the replacement still reads them.

A re-run plans from the log again: shards already replaced are not live any more, so a re-run
after a completed run does nothing, and after an interrupted one redoes only what did not commit.

Example::

    >>> import tempfile
    >>> from rlrec.store.commit import ShardCommitter
    >>> from rlrec.store.snapshot import open_snapshot
    >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
    >>> root = tempfile.mkdtemp()
    >>> c = ShardCommitter(root, "rl", 0)
    >>> for _ in range(3):
    ...     _ = c.commit(expert_cartpole_episodes(2))
    >>> res = compact_partition(c.log, min_age_s=0)
    >>> res.replaced, res.written, len(open_snapshot(root).files()), open_snapshot(root).num_episodes
    (3, 1, 1, 6)
    >>> compact_partition(c.log, min_age_s=0).replaced  # nothing left to do
    0
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from rlrec.store import schema_gate
from rlrec.store.commit import read_committed_shard
from rlrec.store.log_shards import live_shards
from rlrec.store.manifest import (
    ConflictError,
    Entry,
    EntryTooLargeError,
    FencedError,
    PartitionLog,
    ReplaceEntry,
    ShardEntry,
    default_writer_id,
    list_partition_logs,
)
from rlrec.store.ownership import DEFAULT_LEASE_S, judge_leases, lease_path, read_lease, renew_lease
from rlrec.store.retention import RemovalLogView
from rlrec.store.schema_gate import ShardSchemaError, open_shard
from rlrec.store.storage import Storage

__all__ = [
    "DEFAULT_MIN_AGE_S",
    "DEFAULT_TARGET_BYTES",
    "CompactionResult",
    "committed_sizes",
    "compact_partition",
    "compact_unowned",
    "merge_shards",
    "plan_runs",
]

log = logging.getLogger("rlrec.compaction")

#: the size a merged shard grows to at most (the consumer's default --max-file-bytes)
DEFAULT_TARGET_BYTES = 128 * 1024 * 1024
#: shards younger than this are left alone (the trainer has likely not read them yet)
DEFAULT_MIN_AGE_S = 600.0
#: a merged shard's decoded size (its footer's, what the schema gate limits) at most, as a fraction
#: of the gate's limit (`schema_gate.MAX_SHARD_DECODED_BYTES`): re-encoding rows can change it
_DECODE_SHARE = 0.5
#: rows per row group of a merged shard (episodes: one per row; tabular: one step per row)
_ROW_GROUP = {"episodes": 128, "tabular": 65536}
#: the writer prefix of the owner lease ``rlrec compact`` holds while compacting
_COMPACTOR = "rlrec-compact:"
#: decoded bytes of rows held back for a full row group at most (written as a smaller one then)
_PENDING_BYTES = 64 * 1024 * 1024
#: columns written without dictionary and statistics (as the consumer's shard writer does)
_PLAIN_COLUMNS = frozenset({"item"})


@dataclass
class CompactionResult:
    """What one `compact_partition` call did."""

    topic: str
    partition: int
    replaced: int = 0  # shards replaced
    written: int = 0  # merged shards committed
    bytes_before: int = 0
    bytes_after: int = 0
    skipped: list[str] = field(default_factory=list)  # runs left alone, with the reason
    remaining: int = 0  # runs planned but left for the next call (max_runs)
    entries: list[ReplaceEntry] = field(default_factory=list)


def _group_key(e: ShardEntry) -> str:
    v = e.event_schema_versions
    return json.dumps([e.policy_id, e.format, e.format_version, v if isinstance(v, dict) else list(v)], sort_keys=True)


def plan_runs(
    live: dict[int, ShardEntry],
    *,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    policy_id: str | None = None,
    now: float | None = None,
    sizes: Mapping[int, int] | None = None,
    avoid: Collection[int] = (),
) -> list[list[ShardEntry]]:
    """Runs of live shards worth merging (at least two shards each), each in seq order.

    A run's decoded size is also bounded (`decode_budget`: what the schema gate lets readers
    decode, with a margin), counting a shard as its recorded ``decoded_bytes`` or, unknown, its
    file's bytes; `compact_partition` checks the real sizes in the files' footers.

    A shard's size here is its *committed size* (`committed_sizes`): for a merged shard the sum
    of the shards it replaced as first committed, not its own bytes. Merged files often come out
    smaller than their parts; counting them that way would merge them again on every run, so a
    re-run after a complete one finds nothing to do.

    Args:
        live: ``{seq: shard}`` of one partition log (`live_shards`).
        target_bytes: a run's total size at most (a shard this size or larger is left alone).
        min_age_s: only shards committed at least this long ago.
        policy_id: only this policy's shards (None: all).
        now: the time to measure ages from (default: now).
        sizes: ``{seq: committed size}`` (default: each shard's bytes).
        avoid: seqs left out (shards found unmergeable before: `compact_partition`'s ``avoid``).

    Example:
        >>> plan_runs({})
        []
    """
    now = time.time() if now is None else now
    size = {seq: (sizes or {}).get(seq, e.bytes) for seq, e in live.items()}
    budget = decode_budget()
    # decoded size: as recorded (merged shards), else the file's bytes (a lower bound)
    dec = {seq: e.decoded_bytes if e.decoded_bytes is not None else e.bytes for seq, e in live.items()}
    groups: dict[str, list[ShardEntry]] = {}
    for seq in sorted(live):
        e = live[seq]
        if (policy_id is not None and e.policy_id != policy_id) or seq in avoid:
            continue
        if size[seq] >= target_bytes or dec[seq] >= budget or now - e.commit_time < min_age_s:
            continue
        groups.setdefault(_group_key(e), []).append(e)
    runs: list[list[ShardEntry]] = []
    for members in groups.values():
        cur: list[ShardEntry] = []
        total = decoded = 0
        for e in members:
            if cur and (total + size[e.seq] > target_bytes or decoded + dec[e.seq] > budget):  # type: ignore[index]
                runs.append(cur)
                cur, total, decoded = [], 0, 0
            cur.append(e)
            total += size[e.seq]  # type: ignore[index]
            decoded += dec[e.seq]  # type: ignore[index]
        runs.append(cur)
    return [r for r in runs if len(r) >= 2]


def decode_budget() -> int:
    """A merged shard's decoded size at most: half the schema gate's limit
    (`schema_gate.MAX_SHARD_DECODED_BYTES`), so that every reader can open it."""
    return int(schema_gate.MAX_SHARD_DECODED_BYTES * _DECODE_SHARE)


def committed_sizes(entries: list[Entry]) -> dict[int, int]:
    """``{seq: committed size}`` of a log's shard-carrying entries: a shard entry's bytes; a
    replace entry's, the sum of the committed sizes it replaced."""
    out: dict[int, int] = {}
    for e in entries:
        if isinstance(e, ShardEntry):
            out[e.seq] = e.bytes  # type: ignore[index]
        elif isinstance(e, ReplaceEntry):
            out[e.seq] = sum(out.get(r, 0) for r in e.replaces)  # type: ignore[index]
    return out


def merge_shards(parts: list[bytes], fmt: str, compression: str = "zstd") -> bytes:
    """One Parquet shard holding the rows of `parts` (shard files of format `fmt`), in order.

    Every part passes the schema gate first; their Arrow schemas must be equal (ValueError
    otherwise: shards of different spaces do not share a file). The ``rlrec.*`` schema metadata
    is kept; a space key only where every part has the same value (as the shard writer does for
    episodes of different spaces). Rows are copied a row group at a time and written in row
    groups of the shard writer's size (128 episodes, or 65,536 steps; smaller when the rows held
    back for one reach 64 MiB decoded), so memory holds the parts' bytes, the result's and at
    most about one row group decoded."""
    shards = [open_shard(data, fmt=fmt) for data in parts]
    first = shards[0].schema
    for sh in shards[1:]:
        if not sh.schema.equals(first, check_metadata=False):
            raise ValueError("the shards' columns differ (different spaces or extra model outputs)")
    metas = [sh.schema.metadata or {} for sh in shards]
    keep = {k: v for k, v in metas[0].items() if k.startswith(b"rlrec.") and all(m.get(k) == v for m in metas)}
    schema = first.with_metadata(keep)
    options = {}
    if _PLAIN_COLUMNS.intersection(schema.names):
        usual = [name for name in schema.names if name not in _PLAIN_COLUMNS]
        options = {"use_dictionary": usual, "write_statistics": usual}
    rows = _ROW_GROUP.get(fmt, 65536)
    buf = pa.BufferOutputStream()
    with pq.ParquetWriter(buf, schema, compression=compression, **options) as writer:
        pending: list[pa.Table] = []
        n = held = 0
        for sh in shards:
            for group in sh.row_groups():
                pending.append(group.replace_schema_metadata(keep))
                n += group.num_rows
                held += group.nbytes
                if n >= rows or held >= _PENDING_BYTES:  # whole row groups now, the rest with the next rows
                    table = pa.concat_tables(pending)
                    full = n - n % rows if held < _PENDING_BYTES else n
                    writer.write_table(table.slice(0, full), row_group_size=rows)
                    rest = table.slice(full)
                    pending, n, held = ([rest] if rest.num_rows else []), rest.num_rows, rest.nbytes
        if pending:
            writer.write_table(pa.concat_tables(pending), row_group_size=rows)
    return buf.getvalue().to_pybytes()


def _versions(values: list) -> tuple:
    ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return (min(ints), max(ints)) if ints and len(ints) == len(values) else (None, None)


def _merged_entry(run: list[ShardEntry], data: bytes, path: str, staging: str, decoded: int) -> ShardEntry:
    lo, _ = _versions([e.min_policy_version for e in run])
    _, hi = _versions([e.max_policy_version for e in run])
    logp: dict[str, int] | None = {}
    for e in run:
        if e.steps_without_logp is None or logp is None:
            logp = None
            continue
        for k, n in e.steps_without_logp.items():
            logp[k] = logp.get(k, 0) + n
    return ShardEntry(
        path=path,
        staging_path=staging,
        topic=run[0].topic,
        partition=run[0].partition,
        policy_id=run[0].policy_id,
        first_offset=min(e.first_offset for e in run),
        last_offset=max(e.last_offset for e in run),
        episode_ids=[i for e in run for i in e.episode_ids],
        episodes=sum(e.episodes for e in run),
        steps=sum(e.steps for e in run),
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        format=run[0].format,
        format_version=run[0].format_version,
        event_schema_versions=run[0].event_schema_versions,
        commit_time=time.time(),
        min_policy_version=lo,
        max_policy_version=hi,
        steps_without_logp=logp,
        decoded_bytes=decoded,
    )


def _plan(
    entries: list[Entry], target_bytes: int, min_age_s: float, policy_id: str | None, avoid: Collection[int] = ()
) -> list[list[ShardEntry]]:
    """The runs to merge in a log whose entries are `entries` (all of them, in seq order)."""
    return plan_runs(
        live_shards(entries),
        target_bytes=target_bytes,
        min_age_s=min_age_s,
        policy_id=policy_id,
        sizes=committed_sizes(entries),
        avoid=avoid,
    )


def _read_part(plog: PartitionLog, e: ShardEntry) -> bytes:
    data = read_committed_shard(plog.storage, e.path, e.staging_path, e.bytes)
    if hashlib.sha256(data).hexdigest() != e.sha256:
        raise ShardSchemaError(f"{plog.storage.uri(e.path)}: sha256 differs from the manifest's: refused")
    return data


def _merge_run(
    plog: PartitionLog, run: list[ShardEntry], compression: str, avoid: set[int]
) -> tuple[list[ShardEntry], bytes, int] | str:
    """Merge what can be merged of a planned run: (the shards merged, the merged file, its
    decoded size), or why nothing (the reason; the seqs that stop it are added to `avoid`, so
    the next plan moves on).

    Of the run, the shards with the first one's columns, in seq order, as long as their decoded
    sizes (the footers') fit `decode_budget`. The merged file passes the schema gate and holds
    the parts' rows and exactly their episode ids, or it is not staged."""
    parts = []
    for e in run:
        try:
            data = _read_part(plog, e)
            parts.append((e, data, open_shard(data, fmt=e.format)))
        except (ShardSchemaError, FileNotFoundError) as err:
            avoid.add(e.seq)  # type: ignore[arg-type]
            return f"seq {e.seq}: {err}"
    first = parts[0][2].schema
    same = [p for p in parts if p[2].schema.equals(first, check_metadata=False)]
    if len(same) < 2:  # no other shard with its columns (different spaces, extra model outputs)
        avoid.add(run[0].seq)  # type: ignore[arg-type]
        return f"seq {run[0].seq}: no other shard of the run has its columns"
    budget, fit, total = decode_budget(), [], 0
    for p in same:
        if total + p[2].decoded_bytes <= budget:
            fit.append(p)
            total += p[2].decoded_bytes
    if len(fit) < 2:  # the largest stops every pair: leave it alone from now on
        big = max(same, key=lambda p: p[2].decoded_bytes)[0]
        avoid.add(big.seq)  # type: ignore[arg-type]
        return (
            f"seq {big.seq}: decodes to too much to merge with its neighbours (a merged shard {budget} bytes at most)"
        )
    shards = [p[0] for p in fit]
    seqs = [e.seq for e in shards]
    try:
        data = merge_shards([p[1] for p in fit], shards[0].format, compression)
        out = open_shard(data, fmt=shards[0].format)  # the schema gate, as every reader will open it
        _check_merged(out, fit)
    except (ShardSchemaError, ValueError) as err:
        avoid.update(seqs)  # type: ignore[arg-type]
        return f"seq {seqs}: merged file refused: {err}"
    return shards, data, out.decoded_bytes


def _check_merged(out, parts) -> None:
    """The merged file holds the parts' rows and exactly the episode ids their entries name
    (ValueError otherwise): the replace entry's ids are checked against the file, not only
    against the entries it was built from."""
    rows = sum(p[2].num_rows for p in parts)
    if out.num_rows != rows:
        raise ValueError(f"{out.num_rows} rows, the parts hold {rows}")
    ids = [i for p in parts for i in p[0].episode_ids]
    col = "episode_id" if "episode_id" in out.names else "eps_id"
    found = out.read([col]).column(col).to_pylist()
    same = sorted(found) == sorted(ids) if out.fmt == "episodes" else set(found) == set(ids)
    if not same:
        raise ValueError("its episode ids differ from the replaced shards' entries")


def _removed_meanwhile(
    removals: RemovalLogView, plog: PartitionLog, entries: list[Entry], seqs: list[int]
) -> list[int]:
    """The seqs of `seqs` that the removal log names now (read again just before the commit):
    a merge of a part retention removed while it ran must not commit (its replace entry would
    serve the part's episodes again at the newest point)."""
    removals.refresh()
    removed = removals.seqs(plog.topic, plog.partition, entries)
    return [s for s in seqs if s in removed]


def compact_partition(
    plog: PartitionLog,
    *,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    policy_id: str | None = None,
    compression: str = "zstd",
    max_runs: int | None = None,
    view: PartitionLog | None = None,
    avoid: set[int] | None = None,
    claim: Callable[[], None] | None = None,
    removals: RemovalLogView | None = None,
) -> CompactionResult:
    """Compact one partition whose log `plog` this process has claimed (module docstring).

    Args:
        plog: the partition's log, claimed by this writer (`PartitionLog.claim`).
        target_bytes: a merged shard's size at most, counted as the sum of its parts as first
            committed (`plan_runs`).
        min_age_s: only shards committed at least this many seconds ago.
        policy_id: only this policy's shards (None: all).
        compression: the merged shards' Parquet codec.
        max_runs: merge at most this many runs now (None: all); the rest waits for the next call.
        view: a reader's `PartitionLog` of the same partition kept between calls (refreshed: only
            new entries are read); None reads the whole log.
        avoid: seqs of shards found unmergeable (kept between calls with `view`: a run that
            cannot merge is not re-read on every call); this call adds to it.
        claim: for a `plog` not claimed yet: claims it, called once, when the first merged
            shard is ready to commit (a call that merges nothing appends nothing, not even a
            claim); it may raise to stop the call. Then nothing staged is rolled forward first.
        removals: a reader of the removal log kept between calls (`RemovalLogView`; None: the
            whole log is read): shards retention removes are never merged. It is read again
            right before each replace entry is appended: a run a part of which retention
            removed meanwhile is not committed (skipped; its staged file is left for gc).

    Returns:
        A `CompactionResult`. A run whose shards cannot be merged (a schema the gate refuses,
        differing columns, a replaced shard meanwhile) is left alone and named in ``skipped``.

    Raises:
        FencedError: a newer writer claimed the partition (nothing more is appended).
        StorageError / OSError: storage failed; a re-run picks up where this one stopped.
    """
    if plog.epoch is None and claim is None:
        raise RuntimeError(f"{plog.topic}/{plog.partition}: claim() the partition before compacting it")
    st = plog.storage
    res = CompactionResult(plog.topic, plog.partition)
    if plog.epoch is not None:
        plog.recover()  # publish committed shards still staged (a merged one whose publish failed)
    if view is None:
        view = PartitionLog(st, plog.topic, plog.partition, snapshot_every=0)
    view.refresh()
    entries = view.entries
    seen = view.next_seq
    avoid = set() if avoid is None else avoid
    removals = RemovalLogView(st) if removals is None else removals
    removals.refresh()  # retention's removed shards: never merged (their files go after a grace)
    avoid.update(removals.seqs(plog.topic, plog.partition, entries))
    runs = _plan(entries, target_bytes, min_age_s, policy_id, avoid)
    if max_runs is not None:
        runs, res.remaining = runs[:max_runs], max(0, len(runs) - max_runs)
    for planned in runs:
        merged = _merge_run(plog, planned, compression, avoid)
        if isinstance(merged, str):
            res.skipped.append(merged)
            log.warning("%s/%d: not compacting: %s", plog.topic, plog.partition, merged)
            continue
        run, data, decoded = merged
        seqs = [e.seq for e in run]
        if plog.epoch is None:  # the first merged shard to commit: only now take the partition
            claim()  # type: ignore[misc]
        name = (
            f"{plog.topic}+{plog.partition:05d}+{min(e.first_offset for e in run):020d}+"
            f"{max(e.last_offset for e in run):020d}+e{plog.epoch}.c{uuid.uuid4().hex[:12]}.parquet"
        )
        policy = run[0].policy_id
        path, staging = f"{policy}/{name}", f"{policy}/_staging/{name}"
        if not st.create_once(staging, data):  # a fresh name: taken only by a planted file
            res.skipped.append(f"seq {seqs}: {staging} exists")
            continue
        entry = ReplaceEntry(replaces=tuple(seqs), shard=_merged_entry(run, data, path, staging, decoded))  # type: ignore[arg-type]
        gone = _removed_meanwhile(removals, plog, entries, seqs)  # type: ignore[arg-type]
        if gone:  # retention removed a part while it merged: committing would serve it again
            avoid.update(gone)
            res.skipped.append(f"seq {seqs}: retention removed seq {gone} meanwhile (staged file left for gc)")
            log.warning("%s/%d: not compacting: %s", plog.topic, plog.partition, res.skipped[-1])
            continue
        try:
            committed = plog.append_replace(entry, run, seen=seen)
        except (ConflictError, EntryTooLargeError) as err:  # too large: nothing written (its staged file: gc)
            res.skipped.append(f"seq {seqs}: {err}")
            log.warning("%s/%d: not compacting seq %s: %s", plog.topic, plog.partition, seqs, err)
            continue
        # append_replace checked the entries up to its own; only this writer appended there, and
        # the runs are disjoint: the next run's check starts after it (no range read again)
        seen = max(seen, committed.seq + 1)  # type: ignore[operator]
        try:
            plog.publish(committed.shard, data)
        except Exception as err:  # committed all the same: readers read it from staging meanwhile
            log.warning(
                "%s/%d: publish of %s failed (%s); retried by the next run", plog.topic, plog.partition, path, err
            )
        res.replaced += len(run)
        res.written += 1
        res.bytes_before += sum(e.bytes for e in run)
        res.bytes_after += len(data)
        res.entries.append(committed)
        log.info(
            "%s/%d: replaced %d shard(s) (seq %s, %d bytes) with %s (%d bytes) at seq %d",
            plog.topic,
            plog.partition,
            len(run),
            seqs,
            sum(e.bytes for e in run),
            path,
            len(data),
            committed.seq,
        )
    return res


class _TakenByConsumer(Exception):
    """A consumer's lease appeared while ``rlrec compact`` claimed the partition."""


def _entry_time(e: Entry) -> float:
    return e.commit_time if isinstance(e, ShardEntry) else e.time  # type: ignore[union-attr]


def _released_by_last_writer(storage: Storage, topic: str, part: int, last: object) -> bool:
    """Whether the writer of the log's newest entry released the partition since (a clean stop)."""
    lease = read_lease(storage, topic, part)
    return (
        lease is not None
        and lease.released
        and lease.writer == getattr(last, "writer", None)
        and lease.epoch >= (getattr(last, "epoch", None) or 0)
    )


def compact_unowned(
    storage: Storage,
    *,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    policy_id: str | None = None,
    compression: str = "zstd",
    lease_s: float = DEFAULT_LEASE_S,
    force: bool = False,
    watch_s: float | None = None,
) -> tuple[list[CompactionResult], list[str]]:
    """Compact every partition of a store that no live writer owns (``rlrec compact``).

    Per partition log, left alone and reported (never claimed: that would fence a writer):

    * a live owner lease (`rlrec.store.ownership.judge_leases`: live by the clock, or renewed
      while watched for `watch_s`) -- a consumer runs it. The lease of another compactor (one
      killed, or running) does not count: two compactors fence each other, which costs
      nothing but the run that loses;
    * no live lease but a newest entry younger than `lease_s` written by a consumer (unless
      `force`) -- a consumer of an older rlrec, which keeps no lease, may run it.

    Otherwise, when the plan finds runs to merge or a committed shard waits in staging, it
    compacts (`compact_partition`). Once it has something to commit (a merged shard ready, or a
    staged shard to roll forward first) -- not before, so a run where nothing merges appends
    nothing -- it announces itself with a lease, claims the partition (fencing any dead owner)
    and checks that no other writer took the lease meanwhile (else it appends nothing more and
    reports the partition). It drops its lease when done.

    Args:
        storage: the store.
        target_bytes, min_age_s, policy_id, compression: as for `compact_partition`.
        lease_s: how long this process's own lease lasts (it holds it while compacting), and
            how recent a consumer's entry must be to refuse a partition without a lease.
        force: compact partitions without a live lease even when a consumer wrote to them
            within `lease_s` (every consumer stopped, or none is older than leases).
        watch_s: how long leases that look expired by the clock are watched for a renewal
            (None: their ``ttl_s``; `judge_leases`).

    Returns:
        (the results of the partitions compacted or found with nothing to do, one line per
        partition left alone because a live writer owns or may own it).
    """
    results: list[CompactionResult] = []
    refused: list[str] = []
    keys = list_partition_logs(storage)
    removals = RemovalLogView(storage)
    removals.refresh()
    owners = judge_leases(storage, keys, watch_s=watch_s, ignore=lambda x: x.writer.startswith(_COMPACTOR))
    for topic, part in keys:
        where = f"{topic}/{part:05d}"
        lease = owners[(topic, part)]
        if lease is not None:
            refused.append(f"{where} is owned by a live consumer ({lease.describe()})")
            continue
        view = PartitionLog(storage, topic, part, snapshot_every=0)
        entries = view.load()
        last = entries[-1] if entries else None
        age = time.time() - _entry_time(last) if last is not None else math.inf
        if (
            not force
            and age < lease_s
            and not (getattr(last, "writer", None) or "").startswith(_COMPACTOR)
            and not _released_by_last_writer(storage, topic, part, last)
        ):
            refused.append(
                f"{where} has no owner lease but a consumer wrote to it {max(0.0, age):.0f}s ago "
                "(a consumer of an rlrec without leases? stop it, or pass --force)"
            )
            continue
        runs = _plan(entries, target_bytes, min_age_s, policy_id, removals.seqs(topic, part, entries))
        if not runs and not view.staged():
            results.append(CompactionResult(topic, part))
            continue
        me = f"{_COMPACTOR}{default_writer_id()}"
        plog = PartitionLog(storage, topic, part)
        # a compactor replays nothing: its claim needs no committed ids (no walk of the history)
        replay_from = max((e.last_offset for e in live_shards(entries).values()), default=-1) + 1

        def take(topic=topic, part=part, plog=plog, me=me, replay_from=replay_from, epoch=view.max_epoch + 1) -> None:
            renew_lease(storage, topic, part, writer=me, epoch=epoch, ttl_s=lease_s)
            plog.claim(me, replay_from=replay_from)
            now = read_lease(storage, topic, part)
            if now is not None and now.writer != me and now.live() and not now.writer.startswith(_COMPACTOR):
                raise _TakenByConsumer(now.describe())

        try:
            if view.staged():  # a committed shard to publish first: that needs the claim now
                take()
            results.append(
                compact_partition(
                    plog,
                    target_bytes=target_bytes,
                    min_age_s=min_age_s,
                    policy_id=policy_id,
                    compression=compression,
                    view=view,
                    claim=take,
                    removals=removals,
                )
            )
        except _TakenByConsumer as e:
            refused.append(f"{where} was claimed by a consumer while compaction started ({e})")
        except FencedError as e:
            refused.append(f"{where} was claimed by another writer while compacting ({e.newer_writer})")
        finally:
            mine = read_lease(storage, topic, part)
            if mine is not None and mine.writer == me:
                storage.delete(lease_path(topic, part))
    return results, refused
