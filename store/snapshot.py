"""Snapshots: the committed data of a store pinned to a point of its manifest (as-of reads).

A point of the manifest is a *cursor*: for every partition log, how many of its entries are
seen (entries ``0 .. n-1``; a log the cursor does not name is at 0). A log is append-only and an
entry is never changed, so a cursor fixes a set of committed shard entries for good, and every
reader opened at the same cursor, now or in a year, gets the same files and the same episodes.
`open_snapshot` pins one:

* ``as_of=None``: the newest point (every entry committed when it is called);
* ``as_of=<UNIX time>``: per partition log, the entries before the first one written after
  that time (a shard entry's ``commit_time``, a claim's, replace entry's or log snapshot's
  ``time``, stamped as the entry lands), and the removal records before the first one stamped
  after it; refused unless the time is at least ``APPEND_WINDOW_S`` (S) in the past, so it is
  a fixed point;
* ``as_of=<cursor>``: a point a snapshot gave earlier (`Snapshot.cursor`).

Guarantees (docs/GUARANTEES.md, "As-of reads"): a snapshot's file list is fixed when it is
opened; every episode of a committed shard entry at or before its point is read exactly once
(the snapshot holds the *live* shards at its point, `rlrec.store.log_shards.live_shards`: a
compacted shard is read from its replacement once the replace entry is at or before the point,
from its own file before); `Snapshot.changes` between two cursors of one store holds exactly
the episodes of the later one that the earlier one lacks (a replacement that merged shards from
both sides of the earlier cursor is read as the shards it replaced, whose files compaction
keeps).
Retention (`rlrec.store.retention`) removes files: a removal record counts at a point iff it
is numbered below the point's ``~rm=N`` (it existed when the point was taken) and its planning
positions are at or below the point's in every log (`counted_records`); a counted record's
shards are not part of the point (`rlrec.store.point_removals`). Any other point holding a removed shard reads it as before
while the record's grace lasts and is expired (`ExpiredPointError`) after; the newest point
never is expired.
Shards are read through the schema gate (`rlrec.store.schema_gate`) after their sha256 is
checked against the manifest: nothing is unpickled.

This module opens points; `rlrec.store.snapshot_reader.Snapshot` reads them, cursors and
their text are `rlrec.store.cursor`'s, what retention removed from a point
`rlrec.store.point_removals`'s.

`Snapshot.steps` is one row per step (docs/FORMAT.md, "Steps table"): ``episode_id``
(string), ``t`` (int64, 0-based), ``observation``, ``action``, ``reward`` (float64),
``terminated`` and ``truncated`` (bool, true only on an episode's last step), ``action_logp``
(float64, null where the policy logged no propensity), ``policy_version`` (int64),
``next_observation`` and ``policy_id`` (string). Observations and actions have plain Arrow
types: a Box of shape ``()`` its dtype, of shape ``(d1, ..., dk)`` nested
``fixed_size_list<dtype>`` lists (outermost ``d1``); Discrete an integer; MultiDiscrete and
MultiBinary fixed-size lists; Dict and Tuple a struct (Tuple fields named ``"0"``, ``"1"``, ...).

Example::

    >>> import tempfile
    >>> from rlrec.store.commit import ShardCommitter
    >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
    >>> root = tempfile.mkdtemp()
    >>> _ = ShardCommitter(root).commit(expert_cartpole_episodes(2))
    >>> snap = open_snapshot(root)
    >>> len(snap.files()), snap.steps().num_rows == snap.num_steps
    (1, True)
    >>> open_snapshot(root, as_of=snap.cursor).files() == snap.files()
    True
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

from rlrec.store.cursor import (
    Cursor,
    CursorError,
    ExpiredPointError,
    _as_cursor,
    _check_store,
    _expired,
    _first_entry_key,
    _iso,
    _short,
    _tag,
    cursor_at,
    cursor_covering,
)
from rlrec.store.live_set import read_heads
from rlrec.store.live_set_file import ChainedShards
from rlrec.store.log_shards import live_holders, live_shards
from rlrec.store.manifest import APPEND_WINDOW_S, MANIFEST_DIR, Entry, PartitionLog, ShardEntry, list_partition_logs
from rlrec.store.point_removals import Removed, _apply_removals, _dropped, counted_records
from rlrec.store.retention import RemovalRecord, merge_ranges, read_removals, resolve_removals
from rlrec.store.snapshot_reader import (
    READ_AHEAD_BYTES,
    READ_AHEAD_DECODED_BYTES,
    READ_AHEAD_SHARDS,
    READ_AHEAD_THREADS,
    Snapshot,
)
from rlrec.store.steps_table import STEP_COLUMNS, column_to_numpy, empty_steps, gated_steps, tabular_episodes
from rlrec.store.storage import Storage

__all__ = [
    "READ_AHEAD_BYTES",
    "READ_AHEAD_DECODED_BYTES",
    "READ_AHEAD_SHARDS",
    "READ_AHEAD_THREADS",
    "STEP_COLUMNS",
    "Cursor",
    "CursorError",
    "ExpiredPointError",
    "Snapshot",
    "column_to_numpy",
    "counted_records",
    "cursor_at",
    "cursor_covering",
    "empty_steps",
    "gated_steps",
    "merge_ranges",
    "open_entries",
    "open_snapshot",
    "tabular_episodes",
]

log = logging.getLogger("rlrec.snapshot")


def _read_logs(storage: Storage) -> dict[tuple[str, int], list[Entry]]:
    return {k: PartitionLog(storage, *k).load(strict=True) for k in list_partition_logs(storage)}


def _open_head(st: Storage) -> Snapshot:
    """The newest point, read through each log's live set where it has one
    (`rlrec.store.live_set.read_heads`); the whole history is read only if `Snapshot.changes` or
    `open_entries` needs it."""
    heads, removals, records = read_heads(st)
    firsts = {k: h.first for k, h in heads.items()}
    positions = {k: h.end for k, h in heads.items() if h.end > 0}
    point = Cursor(positions, _tag({k: firsts[k] for k in positions}), removals)
    entries = ChainedShards(h.shards for h in heads.values())  # sorted: keys in (topic, partition) order
    log.debug("snapshot %s: %d shard(s)", point, len(entries))
    if all(h.entries is not None for h in heads.values()):  # no live set: the history is read already
        logs = {k: h.entries for k, h in heads.items()}
        if removals and (not records or records[0].n > 0):  # read from a live set's `removals` on
            records = read_removals(st)
        return Snapshot(st, point, entries, firsts, logs=logs, removed=resolve_removals(records, logs))  # type: ignore[arg-type]

    def history() -> tuple[dict[tuple[str, int], list[Entry]], Removed]:
        records = [r for r in read_removals(st) if r.n < removals]
        logs = _read_logs(st)
        return logs, resolve_removals(records, logs)

    return Snapshot(st, point, entries, firsts, history=history)


def as_of_time(as_of: Any) -> Any:
    """`as_of` with a time given as a `datetime`, a `date` or an ISO 8601 string (``2026-11-27``,
    ``2026-11-27T04:00:00Z``; UTC when it names no zone) turned into a UNIX time; anything else
    unchanged (a cursor string stays one).

    Example:
        >>> as_of_time("2026-11-27T04:00:00Z"), as_of_time("1970-01-02"), as_of_time("r1~0123456789ab~rl:0=3")
        (1795752000.0, 86400.0, 'r1~0123456789ab~rl:0=3')
    """
    from datetime import date, datetime, timezone

    if isinstance(as_of, str) and re.match(r"\d{4}-\d{2}-\d{2}", as_of.strip()):
        try:
            as_of = datetime.fromisoformat(as_of.strip().replace("Z", "+00:00"))
        except ValueError:
            return as_of  # not a time: the cursor parser says what is wrong
    if isinstance(as_of, date) and not isinstance(as_of, datetime):
        as_of = datetime(as_of.year, as_of.month, as_of.day)
    if isinstance(as_of, datetime):
        return (as_of if as_of.tzinfo else as_of.replace(tzinfo=timezone.utc)).timestamp()
    return as_of


def _point_at_time(logs: Mapping[tuple[str, int], list[Entry]], ts: float, storage: Storage) -> dict:
    """The positions of time `ts`: per partition log, the entries before the first one written
    after it. Refused (CursorError) unless `ts` is at least `APPEND_WINDOW_S` in the past: an
    entry stamped at or before it may still be landing, so the point would not be fixed yet."""
    if isinstance(ts, bool) or not math.isfinite(ts):
        raise CursorError(f"as_of must be a UNIX time or a cursor, got {ts!r}")
    now = time.time()
    if ts > now:
        raise CursorError(
            f"as_of {_iso(ts)} is in the future (now {_iso(now)}): later commits could still land before it"
        )
    if ts > now - APPEND_WINDOW_S:
        raise CursorError(
            f"as_of {_iso(ts)} is less than {APPEND_WINDOW_S:.0f}s ago (now {_iso(now)}): an append stamped before it may "
            "still land; give an earlier time, or a cursor (rlrec.open(uri).cursor) for the newest point"
        )
    times = [e.commit_time for entries in logs.values() for e in entries if isinstance(e, ShardEntry)]
    if not times or ts < min(times):
        first = f"the first commit is at {_iso(min(times))}" if times else "it has no commits"
        raise CursorError(f"as_of {_iso(ts)} is before any commit of {storage.uri('')} ({first})")
    positions = {}
    for key, entries in logs.items():
        n = len(entries)
        for i, e in enumerate(entries):
            if _entry_time(e) > ts:
                n = i
                break
        positions[key] = entries[n - 1].seq + 1 if n else 0
    return positions


def _removals_at_time(records: Iterable[RemovalRecord], ts: float) -> int:
    """A time point's `Cursor.removals`: the records numbered before the first one stamped after
    `ts` (a record is stamped right before its create-once, and numbered in the order created)."""
    records = sorted(records, key=lambda r: r.n)
    later = [r.n for r in records if r.time > ts]
    return min(later) if later else (records[-1].n + 1 if records else 0)


def _entry_time(e: Entry) -> float:
    """When an entry was written (a shard entry: its ``commit_time``), by its writer's clock."""
    return e.commit_time if isinstance(e, ShardEntry) else e.time


def open_snapshot(storage: Storage | str, as_of: float | int | str | Cursor | None = None) -> Snapshot:
    """The committed data of a store pinned to a point of its manifest (module docstring).

    Args:
        storage: the store (a `Storage` or its URI: a path, ``s3://bucket/prefix``, ...).
        as_of: None (the newest point), a time at least `APPEND_WINDOW_S` ago (a UNIX time, a
            `datetime`, a `date` or an ISO 8601 string such as ``"2026-11-27T04:00:00Z"``; the
            entries committed at or before it, per partition log up to the first later one) or a
            cursor (`Snapshot.cursor`). The newest point is read through each log's newest
            live set where it has one (`rlrec.store.live_set`): the same shards, whose entries
            then carry no ``episode_ids`` (``episodes`` counts them); any other point reads the
            whole history.

    Raises:
        FileNotFoundError: the store holds no manifest (nothing was ever committed there).
        CursorError: a malformed cursor, a cursor of another store, a position past a log's
            end, a time less than `APPEND_WINDOW_S` ago or before the store's first commit
            (one-line messages).
        ExpiredPointError: a point before a removal by retention whose files are deleted (a
            `CursorError`; the newest point never is one).
        ManifestError: the manifest cannot be read (a gap, a malformed entry).

    Example::

        >>> import tempfile
        >>> from rlrec.store.commit import ShardCommitter
        >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
        >>> root = tempfile.mkdtemp()
        >>> _ = ShardCommitter(root, "rl", 0).commit(expert_cartpole_episodes(1))
        >>> try:
        ...     open_snapshot(root, as_of="r1~0123456789ab~rl:1=3")
        ... except CursorError as e:
        ...     print(e)  # doctest: +ELLIPSIS
        the cursor names partition log rl/1, which ... does not have (a cursor of another store?)
    """
    st = Storage.from_uri(storage) if isinstance(storage, str) else storage
    if not st.exists(MANIFEST_DIR):
        raise FileNotFoundError(f"no rlrec manifest at {st.uri('')} (give the --output of rlrec consume)")
    as_of = as_of_time(as_of)
    if as_of is None:
        return _open_head(st)
    records = read_removals(st)  # before the logs: every record's positions are in them
    logs = _read_logs(st)
    removed = resolve_removals(records, logs)
    firsts = {k: _first_entry_key(entries[0] if entries else None) for k, entries in logs.items()}
    ends = {k: (entries[-1].seq + 1 if entries else 0) for k, entries in logs.items()}
    removals = max((r.n for r in records), default=-1) + 1  # the newest point has every record
    if as_of is None:
        positions = ends
    elif isinstance(as_of, (str, Cursor)):
        c = _as_cursor(as_of)
        if c.removals > removals:
            raise CursorError(
                f"unknown point: the cursor has {c.removals} removal record(s), the store {removals} (another store?)"
            )
        removals = c.removals
        _check_store(c, firsts, st)
        for key, n in c.positions.items():
            if n > ends[key]:
                raise CursorError(
                    f"unknown point: the cursor is at entry {n} of {key[0]}/{key[1]}, whose log ends at {ends[key]}"
                )
        positions = dict(c.positions)
    elif isinstance(as_of, (int, float)) and not isinstance(as_of, bool):
        positions = _point_at_time(logs, float(as_of), st)
        removals = _removals_at_time(records, float(as_of))
    else:
        raise CursorError(f"as_of must be None, a UNIX time or a cursor string, got {type(as_of).__name__}")
    positions = {k: n for k, n in positions.items() if n > 0}
    point = Cursor(positions, _tag({k: firsts[k] for k in positions}), removals)
    entries = [e for key, es in logs.items() for e in live_shards(es, below=positions.get(key, 0)).values()]
    dropped = _dropped(counted_records(records, positions, removals), removed)
    entries = _apply_removals(st, entries, dropped, removed, what=f"the point {_short(point, 120)}")
    log.debug("snapshot %s: %d shard(s)", point, len(entries))
    return Snapshot(st, point, entries, firsts, logs=logs, removed=removed)


def open_entries(
    storage: Storage | str | Snapshot,
    ranges: Mapping[tuple[str, int], Iterable[tuple[int, int]]],
    *,
    within: str | Cursor | None = None,
) -> Snapshot:
    """The episodes first committed by the shard entries in `ranges`, read from the shards
    that hold them now: an entry's own shard while it is live, else the live merged shard a
    compaction replaced it by, with the episodes of the other shards merged into it left out.

    Each episode of those entries is read exactly once, and the same ones after any later
    compaction (which never drops an episode), so the result names the same data for as long as
    its shards are kept -- unlike a point of the manifest taken before a compaction, whose
    replaced files retention may remove. Its `Snapshot.cursor` is the smallest point at which
    the holding shards are live (the point covering the entries themselves until a compaction
    touches them); its `Snapshot.selection` names the ranges, so it does not change when the
    holding shards do. Episodes are told apart per shard (by the ids the manifest records for
    each entry), so an id reused in another log or entry is read exactly as often as the
    entries asked for hold it.

    Args:
        storage: the store (a `Storage` or its URI), or a snapshot of its newest point
            (`open_snapshot(storage)`) to read the manifest once for many calls.
        ranges: per partition log ``(topic, partition)``, half-open ``(start, end)`` ranges of
            manifest seqs of its log.
        within: a cursor the entries must be below (checked to be a point of this store).

    Raises:
        CursorError: `within` is not a point of this store (another store's, past a log's
            end), a range reaches past it or past its log's end, or an entry of a range is not
            a shard entry (a claim, a log snapshot, a replacement: a range of a version's
            lineage holds shard entries only).
        ExpiredPointError: retention deleted a shard holding them (`rlrec.store.retention`);
            a shard retention recorded as removed is read while its files are there (within
            the record's grace, or kept past it by a lineage pin).

    Example:
        >>> import tempfile
        >>> from rlrec.store.commit import ShardCommitter
        >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
        >>> root = tempfile.mkdtemp()
        >>> c = ShardCommitter(root)
        >>> _ = c.commit(expert_cartpole_episodes(1)); _ = c.commit(expert_cartpole_episodes(2, seed=1))
        >>> open_entries(root, {("rl", 0): [(2, 3)]}).num_episodes  # seq 0 is the writer's claim
        2
    """
    newest = storage if isinstance(storage, Snapshot) else open_snapshot(storage)
    logs = newest._logs or {}
    wanted = {key: merge_ranges(rs) for key, rs in ranges.items()}
    wanted = {key: rs for key, rs in wanted.items() if rs}
    c = _as_cursor(within) if within is not None else None
    ends = {key: (es[-1].seq + 1 if es else 0) for key, es in logs.items()}
    if c is not None:
        _check_store(c, newest._firsts, newest.storage)
        for (t, p), n in c.positions.items():
            if n > ends.get((t, p), 0):
                raise CursorError(
                    f"unknown point: the cursor is at entry {n} of {t}/{p}, whose log ends at {ends.get((t, p), 0)}"
                )
    for (t, p), rs in wanted.items():
        end = rs[-1][1]
        limit = c.positions.get((t, p), 0) if c is not None else ends.get((t, p), 0)
        if end > limit:
            where = f"the cursor {c}" if c is not None else f"the end of its log ({limit} entries)"
            raise CursorError(f"{t}/{p} entries up to {end - 1} are asked for, past {where}")
    holding: list[ShardEntry] = []
    drop: dict[str, frozenset] = {}
    for key, rs in sorted(wanted.items()):
        entries = logs.get(key, [])
        by_seq = {e.seq: e for e in entries}
        starts = [a for a, _ in rs]

        def asked(seq: int, rs=rs, starts=starts) -> bool:
            i = bisect.bisect_right(starts, seq) - 1
            return i >= 0 and seq < rs[i][1]

        shard_seqs = sorted(q for q, e in by_seq.items() if isinstance(e, ShardEntry))
        for a, b in rs:  # bounded by the log's length (checked above)
            if bisect.bisect_left(shard_seqs, b) - bisect.bisect_left(shard_seqs, a) != b - a:
                odd = next(q for q in range(a, b) if not isinstance(by_seq.get(q), ShardEntry))
                raise CursorError(f"{key[0]}/{key[1]} entry {odd} is no shard entry: it commits no episodes")
        for shard, held in live_holders(entries).values():
            if not any(asked(h) for h in held):
                continue
            holding.append(shard)
            others = frozenset(i for h in held if not asked(h) for i in by_seq[h].episode_ids)
            if others:  # a merged shard's episodes of entries not asked for
                drop[shard.path] = others
    gone = [
        hit[0]
        for e in holding
        if (hit := newest._removed.get((e.topic, e.partition, e.seq))) is not None  # type: ignore[arg-type]
        and not (newest.storage.exists(e.path) or newest.storage.exists(e.staging_path))
    ]
    if gone:  # retention deleted the shards holding them (within its grace, or pinned, they are read)
        raise _expired("the data of these entries", gone, len(gone))
    point = cursor_covering(newest.storage, holding, dict(newest._firsts)) if holding else Cursor({}, _tag({}))
    named = {"entries": [[t, p, [list(r) for r in rs]] for (t, p), rs in sorted(wanted.items())]}
    digest = hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()[:16]
    return Snapshot(
        newest.storage,
        point,
        holding,
        newest._firsts,
        None,
        digest,
        logs,
        drop=drop,
        ranges=wanted,
        removed=newest._removed,
    )
