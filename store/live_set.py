"""Live sets: what a partition log holds at a point, so that opening a store at its head costs its
live files, not its history.

A live set (``"type": "live_set"``, manifest format 4) is kept beside its partition log, never in
it::

    _manifest/{topic}/{partition:05d}/_live/{seq:012d}.live   the live set covering entries < seq

A live set is one file of raw Arrow columns, a row per live shard, read as views of its bytes
and checked column-wise (`rlrec.store.live_set_file`).
It is a pure summary of data that never changes: the log's entries ``0 .. seq-1`` and the removal
records (`rlrec.store.retention`) numbered below its ``removals`` -- which `write_live_set`
keeps below the first record naming a shard file of the log still in the store
(``folds_deleted_only``), so that a record whose files are there is always read after the live
set, whatever any clock says. It lists the live shards at
that point (`rlrec.store.log_shards.live_shards`) less those the folded records remove, one row
per shard with every field of its shard entry except ``episode_ids``, and the key of the log's
first entry (so cursors keep their store tag). It is written create-once, so whoever writes a
live set at ``seq`` writes one that is true; the partition's writer writes one every
`LIVE_SET_EVERY` entries (`PartitionLog`), anyone may with `write_live_set`.

Readers at the head (`head_shards`: `rlrec.open` / `open_snapshot` without ``as_of``,
`read_manifest` and so ``rlrec inspect``) read the newest live set, the entries from its seq on
(through the snapshot the log's hint names) and the removal records from its ``removals`` on,
and fold them (`fold`, the one place that does). A live set never hides an entry committed
after it (every entry from its seq is read) nor brings back a removed shard (every record from
its ``removals`` is applied). A live set that is missing, malformed, of a newer format, larger
than its seq allows (`rlrec.store.live_set_file.size_cap`), or inconsistent with the entries after it is ignored: the log is
read from its first entry as before (docs/GUARANTEES.md §3, "Live sets"); where it is malformed
or past the log's end, `read_live_set` tries the next older one first. Older points (``as_of``),
lineage, `Snapshot.changes`, the trainer's follower and writers' claims read the whole history
(gc, the trainer's start-up discovery and retention read the heads: `read_heads`; retention
through a live set's retention columns, `Retention`, its candidates confirmed from the entries:
`rlrec.store.retention_heads`).

Example:
    >>> import tempfile
    >>> from rlrec.store.commit import ShardCommitter
    >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
    >>> root = tempfile.mkdtemp()
    >>> c = ShardCommitter(root, "rl", 0)
    >>> for i in range(3):
    ...     _ = c.commit(expert_cartpole_episodes(2, seed=i))
    >>> ls = write_live_set(c.storage, "rl", 0)
    >>> ls.seq, len(ls.shards), ls.shards[0].episode_ids
    (4, 3, ())
    >>> head = head_shards(c.storage, "rl", 0)
    >>> head.live_set == ls.seq, [s.seq for s in head.shards]
    (True, [1, 2, 3])
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from rlrec.store.live_set_file import (
    DELETED_ONLY_FIELD,
    MAX_LIVE_SET_BYTES,
    MAX_LIVE_SHARDS,
    LiveRows,
    ShardList,
    decode,
    encode,
    encode_columns,
    shard_columns,
    size_cap,
)
from rlrec.store.live_set_retention import Retention, facts_of_rows, history_facts
from rlrec.store.localfs import EscapesRoot
from rlrec.store.log_shards import live_shards
from rlrec.store.manifest import (
    MANIFEST_DIR,
    Entry,
    ManifestError,
    PartitionLog,
    ReplaceEntry,
    ShardEntry,
    list_partition_logs,
)
from rlrec.store.manifest_entries import _check_type
from rlrec.store.retention import RemovalRecord, read_removals, record_path
from rlrec.store.storage import Storage, StorageError

__all__ = [
    "LIVE_DIR",
    "LIVE_SET_EVERY",
    "LIVE_SET_FORMAT_VERSION",
    "MAX_LIVE_SET_BYTES",
    "MAX_LIVE_SHARDS",
    "HeadRead",
    "HeadShards",
    "LiveSetEntry",
    "NeedsHistory",
    "Retention",
    "first_entry_key",
    "fold",
    "head_shards",
    "history_facts",
    "live_set_path",
    "live_set_seqs",
    "parse_live_set",
    "read_heads",
    "read_live_set",
    "read_live_sets",
    "write_live_set",
]

log = logging.getLogger("rlrec.live_set")

#: the live sets' directory in each partition's log directory (not an entry: no seq file name)
LIVE_DIR = "_live"
#: the manifest format of a live set
LIVE_SET_FORMAT_VERSION = 4
#: the partition's writer writes a live set once this many entries follow the newest one: with
#: its log snapshots (`rlrec.store.manifest.SNAPSHOT_EVERY`), so that a reader of the head reads
#: at most one snapshot's worth of entries after it
LIVE_SET_EVERY = 100
#: live sets kept per log (older ones are deleted by the writer of a new one)
KEEP_LIVE_SETS = 3
_NAME_RE = re.compile(r"^(\d{12})\.live$")
_JSON_NAME_RE = re.compile(r"^(\d{12})\.json$")


def live_set_path(topic: str, partition: int, seq: int) -> str:
    """``_manifest/{topic}/{partition:05d}/_live/{seq:012d}.live``."""
    return f"{MANIFEST_DIR}/{topic}/{int(partition):05d}/{LIVE_DIR}/{int(seq):012d}.live"


def first_entry_key(entry: Entry | None) -> str:
    """What identifies a log's first entry (a claim: its writer's unique id); a cursor's store
    tag hashes it (`rlrec.store.cursor.Cursor`)."""
    if entry is None:
        return "-"
    return f"{type(entry).__name__}:{entry.seq}:{getattr(entry, 'writer', '')}:{getattr(entry, 'time', '')}"


@dataclass(frozen=True, kw_only=True)
class LiveSetEntry:
    """The live shards of one partition log below ``seq``, less those removed by the removal
    records numbered below ``removals`` (module docstring).

    ``shards``: shard entries in seq order without their episode ids (``episode_ids`` is ``()``,
    ``episodes`` is the count), each with the seq of the entry that committed it (a merged
    shard: its replace entry's); read from a file (`parse_live_set`), a `LiveRows` whose
    entries are built when first used. ``first``: `first_entry_key` of the log's entry 0.
    """

    topic: str
    partition: int
    seq: int
    first: str
    removals: int
    shards: Sequence[ShardEntry]
    writer: str = ""
    time: float = field(default_factory=time.time)
    #: it folds only removal records whose shard files of its log were gone when it was written
    #: (`write_live_set`): a record whose files are there is read after it, never folded (what
    #: the trainer's follower needs to deliver them from their files, as the history does)
    folds_deleted_only: bool = False

    type = "live_set"

    @property
    def tables(self) -> dict[str, pa.Array] | None:
        """Its retention tables (held and replaced; `LiveRows.tables`), None if it has none."""
        return self.shards.tables if isinstance(self.shards, LiveRows) else None

    def header(self) -> dict[str, Any]:
        """Its fields but the rows, as the file's header holds them (`rlrec.store.live_set_file`)."""
        t = self.tables
        counts = {} if t is None else {"held": len(t["held_seq"]), "replaced": len(t["replaced_seq"])}
        counts |= {DELETED_ONLY_FIELD: True} if self.folds_deleted_only else {}
        return counts | {
            "type": "live_set",
            "manifest_version": LIVE_SET_FORMAT_VERSION,
            "topic": self.topic,
            "partition": self.partition,
            "seq": self.seq,
            "time": self.time,
            "writer": self.writer,
            "first": self.first,
            "removals": self.removals,
        }

    def to_bytes(self) -> bytes:
        """The live set's file (raw Arrow columns, `rlrec.store.live_set_file`)."""
        if isinstance(self.shards, LiveRows):
            columns = self.shards.columns | (self.tables or {})
            return encode_columns(self.header(), columns, len(self.shards))
        return encode(self.header(), self.shards)


def parse_live_set(data: bytes, topic: str, partition: int, seq: int) -> LiveSetEntry:
    """A live set read from `live_set_path(topic, partition, seq)`, checked strictly:
    ManifestError (UnsupportedManifestError for a newer format) if it is not one for that log and
    seq (`rlrec.store.live_set_file.decode`: size, footer, schema, every value), or a row is not
    a shard entry of it below `seq` (rows in seq order, each at most once). Whatever the bytes,
    nothing else is raised (a hostile live set is refused, never a crash)."""
    try:
        return _parse_live_set(data, topic, partition, seq)
    except ManifestError:
        raise
    except Exception as e:  # ArrowInvalid, RecursionError, OverflowError, ...: the bytes are hostile
        raise ManifestError(f"live set cannot be parsed: {type(e).__name__}: {str(e)[:200]}") from None


def _finite(v: Any, what: str) -> float:
    f = float(v)
    if not math.isfinite(f):
        raise ManifestError(f"live set: {what} is not a finite number")
    return f


def _parse_live_set(data: bytes, topic: str, partition: int, seq: int) -> LiveSetEntry:
    d, shards = decode(data, topic, partition, seq)
    if d["manifest_version"] != LIVE_SET_FORMAT_VERSION:
        raise ManifestError(f"live set: manifest_version must be {LIVE_SET_FORMAT_VERSION}")
    same = (d["topic"], d["partition"], d["seq"]) == (topic, partition, seq)
    if not same or type(d["seq"]) is not int or type(d["partition"]) is not int:
        raise ManifestError(f"live set is for {d['topic']!r}/{d['partition']!r} seq {d['seq']!r}")
    removals = _check_type(d, "removals", (int,))
    first, writer = _check_type(d, "first", (str,)), _check_type(d, "writer", (str,))
    _check_type(d, "time", (int, float))
    if removals < 0 or len(first) > 1024 or len(writer) > 1024:
        raise ManifestError("live set: removals < 0, or first/writer longer than 1024 characters")
    return LiveSetEntry(
        topic=topic,
        partition=partition,
        seq=seq,
        first=first,
        removals=removals,
        shards=shards,
        writer=writer,
        time=_finite(d["time"], "time"),
        folds_deleted_only=d.get(DELETED_ONLY_FIELD, False),
    )


def live_set_seqs(storage: Storage, topic: str, partition: int) -> list[int]:
    """The seqs of the log's live sets, ascending (one listing)."""
    d = live_set_path(topic, partition, 0).rsplit("/", 1)[0]
    return sorted(int(m.group(1)) for i in storage.list(d) if not i.is_dir and (m := _NAME_RE.match(i.name)))


def _superseded(storage: Storage, topic: str, partition: int, seq: int) -> list[str]:
    """What the writer of the live set at `seq` deletes (one listing): the log's live sets at or
    below it but the newest `KEEP_LIVE_SETS`, and its live sets of an earlier build (JSON files,
    ``{seq:012d}.json``, which readers never read) at or below it."""
    d = live_set_path(topic, partition, 0).rsplit("/", 1)[0]
    names = [i.name for i in storage.list(d) if not i.is_dir]
    live = sorted(q for n in names if (m := _NAME_RE.match(n)) and (q := int(m.group(1))) <= seq)
    old_json = [n for n in names if (m := _JSON_NAME_RE.match(n)) and int(m.group(1)) <= seq]
    return [live_set_path(topic, partition, q) for q in live[:-KEEP_LIVE_SETS]] + [f"{d}/{n}" for n in old_json]


def read_live_set(storage: Storage, topic: str, partition: int) -> LiveSetEntry | None:
    """The log's newest usable live set (one listing, one read, one probe of the entry below
    it), or None: it has none usable. One that cannot be used (malformed, too large, a newer
    format, its seq past the log's end: logged, never raised) is passed over for the next older
    one, up to `KEEP_LIVE_SETS` + 1 of them; then the caller reads the history instead."""
    seqs = live_set_seqs(storage, topic, partition)
    for seq in reversed(seqs[-(KEEP_LIVE_SETS + 1) :]):
        try:  # the log reaches its seq before it is read: what it may cost is bounded by the log's length
            if seq > 0 and storage.info(PartitionLog(storage, topic, partition)._path(seq - 1)) is None:
                raise ManifestError(f"live set {seq} is past the log's end (entry {seq - 1} does not exist)")
            data = storage.read(live_set_path(topic, partition, seq), limit=size_cap(seq))
            return parse_live_set(data, topic, partition, seq)
        except (ManifestError, FileNotFoundError, EscapesRoot) as e:  # EscapesRoot: a symlink
            log.warning("%s/%d: ignoring its live set %d (%s)", topic, partition, seq, e)
    return None


class Stale(ManifestError):
    """A live set does not fit the entries after it (a replace entry names a shard it does not
    list): the reader reads the log's history instead."""


class NeedsHistory(ManifestError):
    """`head_shards` / `write_live_set` with ``history=False``: the log has no usable live set,
    so its head can only be had from its whole history, which the caller did not allow."""


class HeadShards(ShardList):
    """The live shards of one log in seq order: a base (a live set's `LiveRows`, or the shards
    live in the history) less what `fold` dropped, plus what it added, each built only when a
    reader asks for it."""

    def __init__(
        self, base: Sequence[ShardEntry], seqs: list[int], facts: Callable[[], Retention] | None = None
    ) -> None:
        self._base, self._seqs = base, seqs
        self._dropped: set[int] = set()  # positions in base
        self._added: dict[int, ShardEntry] = {}
        self._built: list[ShardEntry] | None = None
        # retention's facts of the base (built when asked for; None: not known), and what fold
        # did since, replayed on them by `retention`
        self._facts = facts
        self._ops: list[tuple[Any, ...]] = []

    def __len__(self) -> int:
        return len(self._seqs) - len(self._dropped) + len(self._added)

    def _pos(self, seq: int) -> int | None:
        i = bisect.bisect_left(self._seqs, seq)
        return i if i < len(self._seqs) and self._seqs[i] == seq and i not in self._dropped else None

    def get(self, seq: int) -> ShardEntry | None:
        """The live shard committed at `seq`, or None."""
        if seq in self._added:
            return self._added[seq]
        i = self._pos(seq)
        return None if i is None else self._base[i]

    def _drop(self, seq: int) -> None:
        self._built = None
        if self._added.pop(seq, None) is None:
            i = self._pos(seq)
            if i is not None:
                self._dropped.add(i)

    def _add(self, e: ShardEntry) -> None:
        self._drop(e.seq)  # type: ignore[arg-type]
        self._added[e.seq] = e  # type: ignore[index]

    def _copy(self) -> HeadShards:
        out = HeadShards(self._base, self._seqs, self._facts)
        out._dropped, out._added, out._ops = set(self._dropped), dict(self._added), list(self._ops)
        return out

    def retention(self) -> Retention | None:
        """What retention needs of these shards besides their entries (`Retention`), None where
        the base does not say (a live set without retention's columns): then only the history
        does."""
        if self._facts is None:
            return None
        r = self._facts()
        for op in self._ops:
            if op[0] == "shard":
                r.add_shard(op[1])
            elif op[0] == "replace":
                r.replace(op[1], op[2])
            else:
                r.record(op[1], op[2])
        return r

    def rows(self, topic: str, partition: int) -> LiveRows:
        """These shards as the rows of a live set of log `topic`/`partition` (episode ids left
        out) with retention's columns where known (`retention`): over a live set's rows, its
        columns less the dropped rows plus the added shards' (no entry built for the rows
        kept), else built from the entries."""
        ret = self.retention()
        added = [self._added[q] for q in sorted(self._added)]
        kept = [i for i in range(len(self._seqs) - 1, -1, -1) if i not in self._dropped][:1]
        tables = ret.tables() if ret else None
        if (
            not isinstance(self._base, LiveRows)
            or (added and kept and self._seqs[kept[0]] > added[0].seq)  # type: ignore[operator]
            or (ret is not None) != (self._base.tables is not None)
        ):
            shards = list(self)
            newest = [ret.newest_of(s.seq) for s in shards] if ret else None  # type: ignore[arg-type]
            return LiveRows(topic, partition, shard_columns(shards, newest), tables=tables)
        base = self._base.columns
        if self._dropped:
            mask = np.ones(len(self._seqs), dtype=bool)
            mask[list(self._dropped)] = False
            base = {k: a.filter(pa.array(mask)) for k, a in base.items()}
        if added:
            new = shard_columns(added, [ret.newest_of(e.seq) for e in added] if ret else None)  # type: ignore[arg-type]
            base = {k: pa.concat_arrays([a, new[k]]) for k, a in base.items()}
        return LiveRows(topic, partition, base, tables=tables)

    def paths(self, prefix: str = "") -> list[str]:
        if self._built is not None or not isinstance(self._base, ShardList):
            return super().paths(prefix)
        base, seqs = self._base.paths(prefix), self._seqs
        if self._dropped:
            keep = [i for i in range(len(seqs)) if i not in self._dropped]
            base, seqs = [base[i] for i in keep], [seqs[i] for i in keep]
        added = sorted(self._added)
        paths = [prefix + self._added[q].path for q in added]
        if added and seqs and added[0] < seqs[-1]:  # interleaved: in seq order
            return [p for _, p in sorted(zip(seqs + added, base + paths))]
        return base + paths

    def _items(self) -> list[ShardEntry]:
        if self._built is None:
            base = list(self._base)
            kept = [e for i, e in enumerate(base) if i not in self._dropped] if self._dropped else base
            added = [self._added[q] for q in sorted(self._added)]
            out = kept + added
            if added and kept and added[0].seq < kept[-1].seq:  # type: ignore[operator]
                out.sort(key=lambda e: e.seq)  # type: ignore[arg-type,return-value]
            self._built = out
        return self._built


def fold(
    topic: str,
    partition: int,
    live: Mapping[int, ShardEntry] | Sequence[ShardEntry],
    tail: Iterable[Entry],
    records: Iterable[RemovalRecord],
    facts: Callable[[], Retention] | None = None,
) -> HeadShards:
    """The live shards after `tail` (entries in seq order after those `live` summarizes: a
    mapping seq -> shard, or shards in seq order such as a live set's rows) and `records`
    (removal records not folded into `live`), in seq order: the one place a live set and what
    follows it are combined. A shard a record names is dropped where the live shard at that seq
    is exactly that file (path and staging path), as `resolve_removals` resolves records. Only
    the rows a later entry or record names are looked at (`HeadShards`).

    `facts`: retention's facts of `live` (`Retention`, built when asked for; a live set's rows
    bring their own, `rlrec.store.live_set_retention.facts_of_rows`); without them `HeadShards.retention` is None.

    Raises `Stale` if a replace entry replaces a seq not in the live shards, or its shard holds
    another number of episodes than those it replaces (ids are compared where known).

    Example:
        >>> list(fold("rl", 0, {}, [], []))
        []
    """
    if isinstance(live, Mapping):
        seqs = sorted(live)
        out = HeadShards([live[q] for q in seqs], seqs, facts)
    elif isinstance(live, HeadShards):
        out = live._copy()
    elif isinstance(live, LiveRows):
        out = HeadShards(live, live.seqs, facts or facts_of_rows(live))
    else:
        base = list(live)
        out = HeadShards(base, [e.seq for e in base], facts)  # type: ignore[misc]
    for e in tail:
        if isinstance(e, ShardEntry):
            out._add(e)
            out._ops.append(("shard", e))
        elif isinstance(e, ReplaceEntry):
            old = [out.get(r) for r in e.replaces]
            if any(o is None for o in old):
                raise Stale(f"replace entry {e.seq} replaces seq {list(e.replaces)}, not all live in the live set")
            if sum(o.episodes for o in old) != e.shard.episodes:  # type: ignore[union-attr]
                raise Stale(f"replace entry {e.seq}: its shard's episodes differ from those it replaces")
            ids = [i for o in old for i in o.episode_ids]  # type: ignore[union-attr]
            if len(ids) == e.shard.episodes and set(ids) != set(e.shard.episode_ids):
                raise Stale(f"replace entry {e.seq}: its shard's episode ids are not those it replaces")
            for r in e.replaces:
                out._drop(r)
            out._add(e.shard)
            out._ops.append(("replace", e, old))
    for rec in records:
        for f in rec.files:
            if (f.topic, f.partition) != (topic, partition):
                continue
            s = out.get(f.seq)
            dropped = s is not None and (s.path, s.staging_path) == (f.path, f.staging_path)
            if dropped:
                out._drop(f.seq)
            out._ops.append(("record", f, dropped))
    return out


@dataclass(frozen=True)
class HeadRead:
    """One partition log at its head: ``shards`` (live, less removed, in seq order), ``first``
    (`first_entry_key` of its entry 0), ``end`` (its next seq), ``live_set`` (the seq of the live
    set read, None: the whole history was read), ``entries`` (the whole history when read) and
    ``tail`` (the entries from the live set's seq on, when a live set was read)."""

    shards: Sequence[ShardEntry]
    first: str
    end: int
    live_set: int | None = None
    entries: list[Entry] | None = None
    tail: list[Entry] | None = None


def head_shards(
    storage: Storage,
    topic: str,
    partition: int,
    records: Sequence[RemovalRecord] | None = None,
    live_set: LiveSetEntry | bool | None = True,
    *,
    apply_removals: bool = True,
    strict: bool = True,
    history: bool = True,
) -> HeadRead:
    """The live shards of one partition log at its head, less those retention removed: through
    its newest live set where it has a usable one, else from its history.

    Args:
        storage, topic, partition: the log.
        records: the removal records (at least those from the live set's ``removals`` on), read
            before this call; None: read here.
        live_set: the live set to use (as `read_live_set` returned it), True to read it here,
            False or None to read the history.
        apply_removals: False: apply no removal record after the live set (or none at all when
            the history is read); `write_live_set` applies them itself.
        strict: False: a gap in the history is logged, not raised (`PartitionLog.load`).
        history: False: raise `NeedsHistory` instead of reading the whole history (no usable
            live set).
    """
    if live_set is True:
        live_set = read_live_set(storage, topic, partition)
    if not apply_removals:
        records = []
    elif records is None:
        records = read_removals(storage, start=live_set.removals if live_set else 0)
    plog = PartitionLog(storage, topic, partition)
    if live_set:
        try:
            if live_set.seq > 0 and plog.read_entry(live_set.seq - 1) is None:
                raise Stale(f"entry {live_set.seq - 1} does not exist")
            if first_entry_key(plog.read_entry(0)) != live_set.first:
                raise Stale("its 'first' is not the key of the log's entry 0")
            n = live_set.removals - 1  # the newest record it folds must exist (or it skips later ones)
            if n >= 0 and not any(r.n >= n for r in records) and storage.info(record_path(n)) is None:
                raise Stale(f"it folds removal records below {live_set.removals}; record {n} does not exist")
            tail = plog.entries_from(live_set.seq)
            later = [r for r in records if r.n >= live_set.removals]
            live = fold(topic, partition, live_set.shards, tail, later)
            end = tail[-1].seq + 1 if tail else live_set.seq
            return HeadRead(live, live_set.first, end, live_set.seq, tail=tail)  # type: ignore[arg-type]
        except ManifestError as e:
            if not history:
                raise NeedsHistory(f"live set {live_set.seq} cannot be used ({e})") from None
            log.warning("%s/%d: ignoring live set %d (%s): reading its history", topic, partition, live_set.seq, e)
        if live_set.removals > 0 and apply_removals:
            records = read_removals(storage)  # the history needs every record
    if not history:
        raise NeedsHistory("no usable live set")
    entries = plog.load(strict=strict)
    shards = fold(topic, partition, live_shards(entries), [], records, lambda: history_facts(entries))  # type: ignore[arg-type]
    end = entries[-1].seq + 1 if entries else 0  # type: ignore[operator]
    return HeadRead(shards, first_entry_key(entries[0] if entries else None), end, None, entries)


def write_live_set(
    storage: Storage,
    topic: str,
    partition: int,
    *,
    writer: str = "",
    prev: LiveSetEntry | None = None,
    history: bool = True,
    from_history: bool = False,
) -> LiveSetEntry | None:
    """Write the live set of one partition log at its current end (create-once; None if the log
    is empty, nothing followed the newest live set, or one exists at that seq already), built
    from its newest live set and what follows it, or from its history; older live sets beyond
    the newest `KEEP_LIVE_SETS` are deleted.

    Args:
        storage, topic, partition: the log.
        writer: who writes it (recorded; the partition's writer id, or a tool's name).
        prev: the newest live set as this caller wrote or read it (not read again while it is
            still the newest).
        history: False: raise `NeedsHistory` rather than build it from the whole history (the
            log has no usable live set): the writer's commit path never reads the history.
        from_history: build it from the whole history, whatever live sets the log has (a
            writer's first after its claim: it carries forward only live sets it built).
    """
    if from_history:
        prev = None
    else:
        seqs = live_set_seqs(storage, topic, partition)
        if prev is None or not seqs or seqs[-1] != prev.seq:
            prev = read_live_set(storage, topic, partition)
        if prev is not None and (prev.tables is None or not prev.folds_deleted_only):
            # no retention columns, or records folded whose files may be there: not carried forward
            log.info(
                "%s/%d: live set %d has no retention columns or may fold records whose files are there: the next "
                "from the history",
                topic,
                partition,
                prev.seq,
            )
            prev = None
    head = head_shards(storage, topic, partition, None, prev, apply_removals=False, history=history)
    if head.end == 0 or (prev is not None and head.end == prev.seq):
        return None
    start = prev.removals if prev is not None and head.live_set is not None else 0
    records = read_removals(storage, start=start)
    removals = _fold_end(storage, topic, partition, records, head.end, start)
    now = time.time()
    live = fold(topic, partition, head.shards, [], [r for r in records if r.n < removals])
    ls = LiveSetEntry(
        topic=topic,
        partition=partition,
        seq=head.end,
        first=head.first,
        removals=removals,
        shards=live.rows(topic, partition),
        writer=writer,
        time=now,
        folds_deleted_only=True,
    )
    if not storage.create_once(live_set_path(topic, partition, ls.seq), ls.to_bytes()):
        return None
    for name in _superseded(storage, topic, partition, ls.seq):
        with contextlib.suppress(FileNotFoundError):
            storage.delete(name)
    log.info("%s/%d: live set at seq %d: %d live shard(s)", topic, partition, ls.seq, len(ls.shards))
    return ls


def _fold_end(
    storage: Storage, topic: str, partition: int, records: Sequence[RemovalRecord], end: int, start: int
) -> int:
    """The ``removals`` of the live set of log (topic, partition) at `end`: it folds the records
    (in number order, from `start`) below the first one that names an entry of the log at or
    after `end`, or a shard file of the log still in the store -- its published or its staging
    path (a reader of the history delivers a removed shard from its file while it is there;
    `rlrec retain` deletes both). No clock decides: a deleted file never comes back, so what it
    folds stays folded for every later reader. Costs one or two existence checks per file of
    the log the records name, stopping at the first file there; past `_CHECKS_BY_PATH` paths,
    one listing of each directory the rest lie in (a writer's first live set after a claim
    checks every record's). A storage error counts as there: not folded."""
    files: list[tuple[int, list[str]]] = []  # per record up to the first naming an entry >= end
    for r in records:
        mine = [f for f in r.files if (f.topic, f.partition) == (topic, partition)]
        if any(f.seq >= end for f in mine):
            return _first_there(storage, files, r.n, start)
        files.append((r.n, [p for f in mine for p in (f.path, f.staging_path)]))
    return _first_there(storage, files, max([start, *(r.n + 1 for r in records)]), start)


#: the most shard file paths `_fold_end` checks one by one before it lists their directories
_CHECKS_BY_PATH = 64


def _first_there(storage: Storage, files: list[tuple[int, list[str]]], beyond: int, start: int) -> int:
    """The number of the first record in `files` (number, its paths) with a path that exists,
    else `beyond` (at least `start`): the first `_CHECKS_BY_PATH` paths checked one by one, the
    rest, if it comes to them, by one listing of each directory they lie in."""
    from rlrec.store.retention_heads import existing

    checked, n = 0, start
    try:
        for i, (n, ps) in enumerate(files):
            if checked + len(ps) > _CHECKS_BY_PATH:  # many paths: list their directories once
                there = existing(storage, [p for _, rest in files[i:] for p in rest])
                return max(start, next((m for m, rest in files[i:] if any(p in there for p in rest)), beyond))
            checked += len(ps)
            if any(storage.exists(p) for p in ps):
                return max(start, n)
    except (OSError, StorageError):  # cannot tell: this record and the later ones are not folded
        return max(start, n)
    return max(start, beyond)


def read_heads(
    storage: Storage,
    *,
    strict: bool = True,
    sets: Mapping[tuple[str, int], LiveSetEntry | None] | None = None,
    removals: Sequence[RemovalRecord] | None = None,
) -> tuple[dict[tuple[str, int], HeadRead], int, list[RemovalRecord]]:
    """Every partition log at its head (`head_shards`), the number of removal records that
    exist (the newest record's number + 1: a head point's ``removals``) and the records read.
    Reads each log's newest live set, then the removal records from the smallest ``removals`` of
    them (all of them when a log has none), then each log's entries from its live set on (or its
    history). `sets`: every log's newest live set (`read_live_sets`), read before; `removals`:
    every removal record (`read_removals` from 0), read before `sets` -- then not read again."""
    if sets is None:
        sets = read_live_sets(storage)
    keys = list(sets)
    start = min((ls.removals if ls is not None else 0 for ls in sets.values()), default=0)
    if removals is not None:
        records = [r for r in removals if r.n >= start]
    else:
        records = read_removals(storage, start=start)  # before the entries: every record's positions are in them
    heads = dict(
        zip(keys, _in_parallel(lambda k: head_shards(storage, *k, records, sets[k] or False, strict=strict), keys))
    )
    count = max([start, *(r.n + 1 for r in records)])
    return heads, count, records


def read_live_sets(storage: Storage) -> dict[tuple[str, int], LiveSetEntry | None]:
    """Every partition log's newest usable live set (`read_live_set`; None: it has none)."""
    keys = list_partition_logs(storage)
    return dict(zip(keys, _in_parallel(lambda k: read_live_set(storage, *k), keys)))


def _in_parallel(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(8, len(items))) as ex:
        return list(ex.map(fn, items))
