"""The manifest: one append-only log per Kafka partition, the commit point of shards.

Layout (relative to the output root)::

    _manifest/{topic}/{partition:05d}/{seq:012d}.json   the entries (create-once, never changed)
    _manifest/{topic}/{partition:05d}/.head.json        a hint: the seq of a recent snapshot

Each entry is a small immutable JSON document created with a create-once write
(:meth:`rlrec.store.storage.Storage.create_once`); ``seq`` runs 0, 1, 2, ... with no
gaps.  Four entry types (:mod:`rlrec.store.manifest_entries`):

* ``claim`` (:class:`ClaimEntry`) -- a consumer that gets the partition appends
  a claim with writer epoch ``E = max(epochs in the log) + 1``.
* ``shard`` (:class:`ShardEntry`) -- a shard of episodes is *committed* when
  its entry exists.  Its ``epoch`` is the epoch of the writer that appended it.
* ``snapshot`` (:class:`SnapshotEntry`) -- appended by a writer every
  :data:`SNAPSHOT_EVERY` entries: folds the log below it (the newest claim, the entries
  since the previous snapshot, the shards not known to be published).
* ``replace`` (:class:`ReplaceEntry`) -- appended by a writer that compacts
  (:mod:`rlrec.store.compaction`): one new shard replaces committed ones, no data change.
  The *live* shards of a log at a point are its shard entries and replace entries' shards
  not replaced at that point (:func:`live_shards`).

Rule: a writer appends entry ``k`` only after it has read every entry ``< k`` -- directly,
or through the newest snapshot below ``k``, which summarizes everything below it.
If entry ``k`` already exists (the create-once write fails), the writer reads
the new entries: a claim with another epoch (or a snapshot folding one) means a newer
owner took the partition and the writer is fenced (:class:`FencedError`); otherwise
:class:`ConflictError` carries the new entries so the caller can drop episode
ids that are already committed and retry.  A writer that lost its partition can
therefore commit nothing after the new owner's claim -- no clocks or leases
involved.  See docs/GUARANTEES.md.

Reading cost.  A writer's :meth:`PartitionLog.claim` reads the hint, the snapshot it
names and the entries after it (probing ``seq`` until one is missing): a constant number
of storage calls plus the entries since the last snapshot, whatever the history's
length.  The hint is only a hint: a missing or stale one costs a listing or a longer
tail, never correctness, because a snapshot is immutable and the tail is probed entry by
entry.  Whole-history readers (:meth:`PartitionLog.load`, :func:`read_partition_logs`)
follow the chain of snapshots back (one read per snapshot) instead of listing and reading
every entry.  Readers of the newest point (:func:`read_manifest`, ``rlrec.open``) read the log's
newest live set instead (``_live/``, :mod:`rlrec.store.live_set`, written by the writer every
``LIVE_SET_EVERY`` entries) and the entries after it (:meth:`PartitionLog.entries_from`).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlrec.store.localfs import EscapesRoot
from rlrec.store.manifest_entries import (
    MANIFEST_DIR,
    MANIFEST_FORMAT_VERSION,
    TOPIC_RE,
    ClaimEntry,
    Entry,
    LogEntry,
    ManifestError,
    ReplaceEntry,
    ShardEntry,
    SnapshotEntry,
    UnsupportedManifestError,
    entry_path,
    parse_entry,
)
from rlrec.store.retry import RetryPolicy
from rlrec.store.storage import Storage

__all__ = [
    "APPEND_WINDOW_S",
    "HEAD_HINT",
    "MANIFEST_DIR",
    "MANIFEST_FORMAT_VERSION",
    "SNAPSHOT_EVERY",
    "ClaimEntry",
    "ConflictError",
    "Entry",
    "EntryTooLargeError",
    "FencedError",
    "LogEntry",
    "ManifestError",
    "PartitionLog",
    "ReplaceEntry",
    "ShardEntry",
    "SnapshotEntry",
    "UnsupportedManifestError",
    "default_writer_id",
    "entry_path",
    "list_partition_logs",
    "live_holders",
    "live_shards",
    "manifest_totals",
    "merged_shards",
    "parse_entry",
    "read_first_commits",
    "read_manifest",
    "read_partition_logs",
    "shard_files",
]

log = logging.getLogger("rlrec.manifest")

#: a writer appends a snapshot once this many entries follow the newest one
SNAPSHOT_EVERY = 100
#: S, the longest an append takes from the moment its entry is stamped with its time (a shard
#: entry's ``commit_time``, a replace entry's ``time``: right before each create-once attempt) to
#: the moment the entry is readable: one `Storage.create_once` with its retries (5 attempts, each
#: at most 10 s to connect and 30 s to answer on S3, GCS and Azure, with at most 2 s between
#: them), rounded up. An ``as_of`` time is refused unless it is at least this far in the past
#: (`rlrec.store.snapshot`): no entry stamped at or before it can land after it is read.
APPEND_WINDOW_S = 300.0
#: at most this many entries are folded into one snapshot (older ones stay "unfolded")
MAX_SEGMENT = 1000
#: name of the hint file in each partition's log directory (dot-prefixed: not an entry)
HEAD_HINT = ".head.json"
#: the most bytes of one log entry, read or written (a snapshot of 100 entries of the largest
#: shards, 128 MiB of small episodes each, is ~150 MB; writers fold fewer or split shards to stay
#: under it); a larger object is refused as malformed before it is read whole (GUARANTEES.md §5)
MAX_ENTRY_BYTES = 512 * 1024 * 1024
#: the most bytes of the head hint read (it holds one number)
MAX_HINT_BYTES = 64 * 1024

_SEQ_RE = re.compile(r"^(\d{12})\.json$")
_PART_RE = re.compile(r"^\d{5}$")
#: the removal log's directory in the manifest (`rlrec.store.retention`): records, no partitions
REMOVED_LOG = "_removed"
_RECORD_RE = re.compile(r"^\d{8}\.json$")
_READ_WORKERS = 8
_BACKWARD_BATCH = 16  # entries read at a time when searching a listed log backwards


# --------------------------------------------------------------------- errors


class FencedError(RuntimeError):
    """A newer writer claimed the partition: this writer must stop writing it."""

    def __init__(
        self, message: str, *, epoch: int | None, newer_epoch: int | None, newer_writer: str | None = None
    ) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.newer_epoch = newer_epoch
        self.newer_writer = newer_writer


class EntryTooLargeError(ManifestError):
    """The entry was not appended: its readers would refuse it (over `MAX_ENTRY_BYTES`). Nothing
    was written; split what it holds (fewer episodes per shard) and append again."""


class ConflictError(RuntimeError):
    """The append did not happen because of entries this writer had not seen
    (or because the shard repeats committed episode ids).

    ``entries``: the entries this writer had not seen (all of its own epoch),
    or -- when the shard repeats committed episode ids -- the committed shard
    entries holding them; ``duplicate_episode_ids``: ids of the rejected shard
    that are committed.  Drop the episodes whose ids are in ``entries``, rewrite
    the shard and append again.
    """

    def __init__(
        self, message: str, *, entries: Sequence[Entry] = (), duplicate_episode_ids: Iterable[str] = ()
    ) -> None:
        super().__init__(message)
        self.entries = list(entries)
        self.duplicate_episode_ids = set(duplicate_episode_ids)


#: how long an entry that exists but cannot be read yet is waited for (its conditional write is
#: still in flight): about 2.5 s in all
_UNREADABLE_WAIT = RetryPolicy(attempts=8, base_delay=0.01, max_delay=0.5, jitter=0.5)


def default_writer_id() -> str:
    """``host:pid:uuid`` -- unique per PartitionLog owner incarnation."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


# ------------------------------------------------------------- PartitionLog


class PartitionLog:
    """The manifest log of one (topic, partition), cached in memory.

    Thread-safe (one lock per object).  Typical owner::

        log = PartitionLog(storage, topic, partition)
        epoch = log.claim(replay_from=C)  # on assignment; C: the partition's committed Kafka offset
        log.recover()                     # publish committed-but-unpublished shards
        skip = log.committed_last_offsets()
        ...
        storage.write(staging_path, parquet_bytes)   # 1. stage
        entry = log.append_shard(entry)               # 2. commit point
        log.publish(entry)                            # 3. staging -> published
        # 4. commit Kafka offsets (caller), then log.forget_before(offset)

    Guarantees: ``append_shard`` raises :class:`FencedError` once another writer has claimed
    the partition, and :class:`ConflictError` if entries of this writer's own epoch appeared
    that it had not read, or the shard repeats a committed episode id it knows.  A writer
    (a log first loaded by :meth:`claim`) keeps in memory only the entries since the newest
    snapshot and the committed ids that can still be replayed (``replay_from``), so its
    memory and its claim cost do not grow with the log's history.  A reader (a log loaded
    by :meth:`load` / :meth:`refresh`) holds every entry.
    """

    def __init__(
        self,
        storage: Storage,
        topic: str,
        partition: int,
        *,
        snapshot_every: int = SNAPSHOT_EVERY,
        live_set_every: int | None = None,
    ) -> None:
        if not TOPIC_RE.match(topic) or topic in (".", ".."):
            raise ValueError(f"not a valid Kafka topic name: {topic!r}")
        if not isinstance(partition, int) or isinstance(partition, bool) or not 0 <= partition <= 99999:
            raise ValueError(f"partition must be an int in [0, 99999], got {partition!r}")
        self.storage = storage
        self.topic = topic
        self.partition = partition
        self.prefix = f"{MANIFEST_DIR}/{topic}/{partition:05d}"
        self.snapshot_every = snapshot_every
        #: a writer writes a live set (`rlrec.store.live_set`) once this many entries follow the
        #: newest one (None: `LIVE_SET_EVERY`; 0: never)
        self.live_set_every = live_set_every
        self._live_seq: int | None = None  # the seq of the newest live set (None: not looked yet)
        self._live_set: Any = None  # the newest live set this writer wrote (not read back)
        #: the thread building this log's first live set from its history (off the commit path)
        self._live_builder: threading.Thread | None = None
        self._lock = threading.RLock()
        self._epoch: int | None = None
        self._writer: str | None = None
        self._floor: int | None = None
        self._reset(keep_all=True)

    def _reset(self, *, keep_all: bool) -> None:
        self._entries: list[Entry] = []  # in seq order; all of them (reader) or since _base (writer)
        self._next = 0  # the next seq to append / probe
        self._loaded = False
        self._keep_all = keep_all
        self._last_claim: ClaimEntry | None = None  # the claim with the highest epoch seen
        self._max_last_offset = -1
        self._resume: int | None = None  # the largest resume_offset of the shard and claim entries read
        self._base: SnapshotEntry | None = None  # the newest snapshot seen
        self._window_from = 0  # ids of entries at/after this seq are kept whatever their offsets
        self._ids: dict[str, ShardEntry] = {}  # committed episode id -> its entry (the skip set)
        # committed shard entries not known to be published: seq -> (entry, a snapshot listed it)
        self._unknown: dict[int, tuple[ShardEntry, bool]] = {}
        self._no_snapshot_before = 0  # a snapshot over MAX_ENTRY_BYTES was given up: not before this seq

    def __repr__(self) -> str:
        return f"PartitionLog({self.topic}/{self.partition}, next_seq={self._next}, epoch={self._epoch})"

    # ------------------------------------------------------------- reading
    def _path(self, seq: int) -> str:
        return f"{self.prefix}/{seq:012d}.json"

    @property
    def hint_path(self) -> str:
        return f"{self.prefix}/{HEAD_HINT}"

    def read_entry(self, seq: int) -> Entry | None:
        """Entry *seq* as stored (None if it does not exist); nothing is cached."""
        return self._read_entry(seq)

    def _read_entry(self, seq: int) -> Entry | None:
        try:
            data = self.storage.read(self._path(seq), limit=MAX_ENTRY_BYTES)
        except FileNotFoundError:
            return None
        where = self.storage.uri(self._path(seq))
        if len(data) > MAX_ENTRY_BYTES:
            raise ManifestError(f"{where}: more than {MAX_ENTRY_BYTES} bytes (MAX_ENTRY_BYTES)")
        try:
            e = parse_entry(data)
        except ManifestError as err:
            raise type(err)(f"{where}: {err}") from None
        if e.seq != seq:
            raise ManifestError(f"{where}: entry says seq={e.seq}")
        shards = [e] if isinstance(e, ShardEntry) else [e.shard] if isinstance(e, ReplaceEntry) else []
        if isinstance(e, SnapshotEntry):
            shards = [*e.shards(), *(x.shard for x in e.entries if isinstance(x, ReplaceEntry)), *e.unpublished]
        for s in shards:
            if s.topic != self.topic or s.partition != self.partition:
                raise ManifestError(f"{where}: entry is for {s.topic}/{s.partition}")
        return e

    def _read_range(self, lo: int, hi: int, *, strict: bool = True) -> list[Entry]:
        """Entries ``lo .. hi-1``, read in parallel; a missing one is a gap (ManifestError, or
        with ``strict=False`` a warning and left out)."""
        seqs = list(range(lo, hi))
        out = []
        for seq, e in zip(seqs, _read_many(self._read_entry, seqs)):
            if e is None:
                if strict:
                    raise ManifestError(f"manifest log {self.storage.uri(self.prefix)} has a gap: seq {seq} missing")
                log.warning("manifest log %s has a gap: seq %d missing", self.storage.uri(self.prefix), seq)
                continue
            out.append(e)
        return out

    def _read_hint(self) -> int | None:
        try:
            raw = self.storage.read(self.hint_path, limit=MAX_HINT_BYTES)
            doc = json.loads(raw) if len(raw) <= MAX_HINT_BYTES else None
            seq = doc["snapshot"]
            if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0:
                return seq
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            pass
        log.warning("ignoring a malformed hint %s", self.storage.uri(self.hint_path))
        return None

    def _find_base(self, *, full: bool, strict: bool) -> tuple[SnapshotEntry | None, list[Entry], bool]:
        """(a recent snapshot, the entries read after it, whether the hint named it).

        Through the hint: (the snapshot it names, [], True) -- two reads.  Without a usable
        hint the log is listed; a reader then reads every entry (None, all), a writer reads
        backwards until it finds a snapshot (the newest snapshot, the entries after it).
        """
        hinted = self._read_hint()
        if hinted is not None:
            try:
                e = self._read_entry(hinted)
            except ManifestError as err:
                log.warning("ignoring the hint of %s: %s", self.storage.uri(self.prefix), err)
                e = None
            if isinstance(e, SnapshotEntry):
                return e, [], True
            log.warning("ignoring the hint of %s: seq %d is not a snapshot", self.storage.uri(self.prefix), hinted)
        infos = self.storage.list(self.prefix)
        seqs = sorted(int(m.group(1)) for i in infos if not i.is_dir and (m := _SEQ_RE.match(i.name)))
        if seqs and seqs != list(range(len(seqs))):
            missing = sorted(set(range(seqs[-1] + 1)) - set(seqs))
            msg = f"manifest log {self.storage.uri(self.prefix)} has gaps: missing seq {missing[:10]}"
            if strict:
                raise ManifestError(msg)
            log.warning(msg)
        if full:
            return None, self._read_listed(seqs, strict), False
        got: list[Entry] = []
        hi = len(seqs)
        while hi > 0:
            lo = max(0, hi - _BACKWARD_BATCH)
            got = self._read_listed(seqs[lo:hi], strict) + got
            hi = lo
            snaps = [i for i, e in enumerate(got) if isinstance(e, SnapshotEntry)]
            if snaps:
                return got[snaps[-1]], got[snaps[-1] + 1 :], False  # type: ignore[return-value]
        return None, got, False

    def _read_listed(self, seqs: list[int], strict: bool) -> list[Entry]:
        out = []
        for seq, e in zip(seqs, _read_many(self._read_entry, seqs)):
            if e is None:
                if strict:
                    raise ManifestError(f"manifest entry {seq} disappeared while loading")
                continue
            out.append(e)
        return out

    def _expand(self, snap: SnapshotEntry, strict: bool) -> list[Entry]:
        """Every entry below ``snap``: the snapshots of its chain, their segments and the
        unfolded ranges between them."""
        chunks: list[list[Entry]] = []
        x = snap
        while True:
            chunks.append(list(x.entries))
            lo = 0 if x.prev is None else x.prev + 1
            if lo < x.folded_from:
                chunks.append(self._read_range(lo, x.folded_from, strict=strict))
            if x.prev is None:
                break
            p = self._read_entry(x.prev)
            if not isinstance(p, SnapshotEntry):
                raise ManifestError(f"{self.storage.uri(self._path(x.seq))}: prev {x.prev} is not a snapshot")
            chunks.append([p])
            x = p
        return [e for chunk in reversed(chunks) for e in chunk]

    def entries_from(self, lo: int) -> list[Entry]:
        """Every entry from seq `lo` to the log's end, in order, without reading the history
        below `lo`: the snapshot the hint names (when at or above `lo`), the chain of snapshots
        back to `lo`, then the entries after it up to the first missing one (on a remote store
        probed 16 at a time in parallel; on a local one read in turn). Nothing is cached; a gap is a ManifestError.

        Args:
            lo: the first seq wanted (a live set's seq, `rlrec.store.live_set`).
        """
        hinted = self._read_hint()
        base: Entry | None = None
        if hinted is not None and hinted >= lo:
            with contextlib.suppress(ManifestError):
                base = self._read_entry(hinted)
        chunks: list[list[Entry]] = []
        x = base if isinstance(base, SnapshotEntry) else None
        nxt = lo if x is None else x.seq + 1
        while x is not None:
            chunks += [[x], list(x.entries)]
            if x.folded_from <= lo:
                break
            start = max(lo, 0 if x.prev is None else x.prev + 1)
            if start < x.folded_from:
                chunks.append(self._read_range(start, x.folded_from)[::-1])
            if x.prev is None or x.prev < lo:
                break
            p = self._read_entry(x.prev)
            if not isinstance(p, SnapshotEntry):
                raise ManifestError(f"{self.storage.uri(self._path(x.seq))}: prev {x.prev} is not a snapshot")
            x = p
        out = sorted((e for c in chunks for e in c if e.seq >= lo), key=lambda e: e.seq)  # type: ignore[arg-type,return-value]
        if self.storage.kind == "local":  # a read is a page-cache copy: threads only contend for the GIL
            while (e := self._read_entry(nxt)) is not None:
                out.append(e)
                nxt += 1
        else:
            with ThreadPoolExecutor(max_workers=_READ_WORKERS) as ex:  # one pool for every batch
                while True:  # probe the tail _BACKWARD_BATCH entries at a time, up to the first missing one
                    got = list(ex.map(self._read_entry, range(nxt, nxt + _BACKWARD_BATCH)))
                    ahead = next((i for i, e in enumerate(got) if e is None), len(got))
                    out += got[:ahead]
                    nxt += ahead
                    if ahead < len(got):
                        break
        if [e.seq for e in out] != list(range(lo, lo + len(out))):
            raise ManifestError(f"manifest log {self.storage.uri(self.prefix)} has a gap above seq {lo}")
        return out

    def _walk_replayable(self, replay_from: int | None) -> None:
        """Add the committed ids below the newest snapshot's segment that can still be
        replayed (entries with ``last_offset >= replay_from``; every id if None): follow the
        chain back while a snapshot says entries below its segment reach ``replay_from``."""
        x = self._base
        while x is not None and (replay_from is None or x.below_max_last_offset >= replay_from):
            lo = 0 if x.prev is None else x.prev + 1
            older: list[Entry] = self._read_range(lo, x.folded_from) if lo < x.folded_from else []
            p = None
            if x.prev is not None:
                p = self._read_entry(x.prev)
                if not isinstance(p, SnapshotEntry):
                    raise ManifestError(f"{self.storage.uri(self._path(x.seq))}: prev {x.prev} is not a snapshot")
                older += p.entries
            for e in older:
                if isinstance(e, ShardEntry) and (replay_from is None or e.last_offset >= replay_from):
                    for i in e.episode_ids:
                        self._ids.setdefault(i, e)
            x = p

    def _add(self, e: Entry, *, strict: bool = True) -> None:
        if e.seq != self._next and (strict or e.seq < self._next):
            raise AssertionError((e.seq, self._next))
        self._entries.append(e)
        self._next = e.seq + 1
        if isinstance(e, ClaimEntry):
            self._note_claim(e)
            self._note_resume(e.resume_offset)
        elif isinstance(e, ShardEntry):
            self._max_last_offset = max(self._max_last_offset, e.last_offset)
            self._note_resume(e.resume_offset)
            for i in e.episode_ids:
                self._ids[i] = e
            self._unknown[e.seq] = (e, False)
        elif isinstance(e, ReplaceEntry):
            # the skip set keeps each episode's first commit: its last_offset is how far a replay
            # can reach the episode (the merged shard's is the max over its parts)
            self._unknown[e.seq] = (e.shard, False)
        else:
            self._on_snapshot(e)

    def _note_claim(self, c: ClaimEntry) -> None:
        if self._last_claim is None or c.epoch > self._last_claim.epoch:
            self._last_claim = c

    def _note_resume(self, offset: int | None) -> None:
        if offset is not None and (self._resume is None or offset > self._resume):
            self._resume = offset

    def _on_snapshot(self, s: SnapshotEntry) -> None:
        self._note_claim(s.last_claim)
        self._max_last_offset = max(self._max_last_offset, s.max_last_offset)
        self._note_resume(s.resume_offset)
        for u in s.unpublished:
            self._unknown[u.seq] = (u, True)
        for e in s.shards():
            for i in e.episode_ids:
                self._ids.setdefault(i, e)
        self._base = s
        self._window_from = s.folded_from
        if not self._keep_all:  # a writer keeps only what follows the newest snapshot
            self._entries = [s]
        self._prune()

    def _prune(self) -> list[str]:
        """Forget committed ids that cannot be replayed any more: entries below the
        newest snapshot's segment whose last_offset is below the replay floor."""
        if self._floor is None:
            return []
        floor, window = self._floor, self._window_from
        gone = [i for i, e in self._ids.items() if e.seq < window and e.last_offset < floor]  # type: ignore[operator]
        for i in gone:
            del self._ids[i]
        return gone

    def load(self, *, strict: bool = True) -> list[Entry]:
        """(Re)read the whole log: every entry from seq 0 in order (snapshots included, folded
        entries taken from their snapshots).  ``strict=False`` tolerates gaps (a warning)."""
        with self._lock:
            self._reset(keep_all=True)
            base, after, _ = self._find_base(full=True, strict=strict)
            if base is not None:
                for e in self._expand(base, strict):
                    self._add(e, strict=strict)
                self._add(base, strict=strict)
            for e in after:
                self._add(e, strict=strict)
            self._probe()  # entries written since
            self._loaded = True
            return list(self._entries)

    def _load_head(self, replay_from: int | None, from_position: bool = False) -> int | None:
        """A writer's load: the newest snapshot, the entries after it, and the committed ids
        that can still be replayed from Kafka offset ``replay_from`` (all if None) -- or, with
        ``from_position``, from the log's :attr:`resume_offset` where it has one. Returns the
        offset the ids were chosen for."""
        self._reset(keep_all=False)
        base, after, hinted = self._find_base(full=False, strict=True)
        if base is not None:
            self._next = base.seq
            self._add(base)
        for e in after:
            self._add(e)
        self._loaded = True
        self._probe()
        if from_position and self._resume is not None:
            replay_from = self._resume
        self._walk_replayable(replay_from)
        if self._base is not None and (not hinted or self._base is not base):
            self._write_hint(self._base.seq)  # the hint was missing or stale: point it at the newest
        return replay_from

    def _probe(self) -> list[Entry]:
        new: list[Entry] = []
        while True:
            e = self._read_entry(self._next)
            if e is None:
                return new
            self._add(e)
            new.append(e)

    def follow_from(self, lo: int, entries: Sequence[Entry]) -> None:
        """Hold `entries` (every entry from seq `lo` to the log's end, in order, as `entries_from`
        read them) as a reader that has read the log up to their end: `refresh` reads only what
        follows, and the history below `lo` is never read (a reader starting from a live set).

        Example:
            >>> import tempfile
            >>> log = PartitionLog(Storage.from_uri(tempfile.mkdtemp()), "rl", 0)
            >>> log.follow_from(5, []); log.next_seq, log.refresh()
            (5, [])
        """
        with self._lock:
            self._reset(keep_all=True)
            self._next = lo
            for e in entries:
                self._add(e)
            self._loaded = True

    def refresh(self) -> list[Entry]:
        """Read only entries appended since the last load/refresh; returns them.  The first
        call on a fresh log loads the whole log (:meth:`load`) and returns every entry."""
        with self._lock:
            if not self._loaded:
                return self.load()
            return self._probe()

    # ----------------------------------------------------------- properties
    @property
    def entries(self) -> list[Entry]:
        """The entries in memory: all of them (a reader) or those since the newest snapshot (a writer)."""
        with self._lock:
            return list(self._entries)

    def entries_since(self, seq: int) -> list[Entry]:
        """The entries in memory with ``seq`` or above, in order."""
        with self._lock:
            i = bisect.bisect_left(self._entries, seq, key=lambda e: e.seq)  # type: ignore[arg-type]
            return self._entries[i:]

    @property
    def next_seq(self) -> int:
        return self._next

    @property
    def epoch(self) -> int | None:
        """This writer's epoch (after :meth:`claim`), else None."""
        return self._epoch

    @property
    def writer_id(self) -> str | None:
        return self._writer

    @property
    def max_epoch(self) -> int:
        """Highest epoch seen in the log (0 for an empty log)."""
        return self._last_claim.epoch if self._last_claim is not None else 0

    @property
    def snapshot(self) -> SnapshotEntry | None:
        """The newest snapshot read (None: the log has none yet)."""
        return self._base

    @property
    def resume_offset(self) -> int | None:
        """Where the partition resumes: the largest ``resume_offset`` of the shard entries read
        and of the claims that recorded where a new partition starts (directly or folded by a
        snapshot; a replace entry never moves it). None: no entry
        carries one (a new log, or one written without Kafka or by an rlrec before format 3)."""
        return self._resume

    @property
    def max_last_offset(self) -> int:
        """The largest ``last_offset`` of the shard entries read (-1: none)."""
        return self._max_last_offset

    def recent_claims(self) -> list[ClaimEntry]:
        """The claims this log holds in memory: those since the newest snapshot's segment and
        the snapshot's ``last_claim`` (a writer's view), or every claim (a reader's), by seq."""
        with self._lock:
            found: dict[int, ClaimEntry] = {}
            for e in self._entries:
                folded = [*e.entries, e.last_claim] if isinstance(e, SnapshotEntry) else [e]
                for c in folded:
                    if isinstance(c, ClaimEntry):
                        found[c.seq] = c  # type: ignore[index]
            return [found[s] for s in sorted(found)]

    def shard_entries(self) -> list[ShardEntry]:
        with self._lock:
            return [e for e in self._entries if isinstance(e, ShardEntry)]

    def committed_episode_ids(self) -> set[str]:
        """The committed episode ids this log knows (a writer: those that can still be replayed)."""
        with self._lock:
            return set(self._ids)

    def committed_offset(self, episode_id: str) -> int | None:
        """The ``last_offset`` of the committed entry holding *episode_id* (None: none known).
        Takes no lock: one dict lookup, atomic under the GIL, so a reader on another thread is
        never held up by an append's storage calls."""
        e = self._ids.get(episode_id)
        return None if e is None else e.last_offset

    def committed_last_offsets(self) -> dict[str, int]:
        """``{episode id: last_offset of its entry}`` for :meth:`committed_episode_ids`."""
        with self._lock:
            return {i: e.last_offset for i, e in self._ids.items()}

    def forget_before(self, offset: int) -> list[str]:
        """The partition's Kafka offset is committed at ``offset``: no owner will replay an event
        before it.  Forgets (and returns) the committed ids of entries with ``last_offset <
        offset``, except those of the newest snapshot's segment and after (a window that
        still recognizes late producer re-sends of recently committed episodes)."""
        with self._lock:
            self._floor = offset if self._floor is None else max(self._floor, offset)
            return self._prune()

    # ------------------------------------------------------------- writing
    def claim(
        self,
        writer_id: str | None = None,
        *,
        replay_from: int | None = None,
        from_position: bool = False,
        group: str | None = None,
        deployment: str | None = None,
        start_at: Callable[[], int] | None = None,
        max_attempts: int = 100,
    ) -> int:
        """Become the writer of this partition: append a claim with epoch max+1.

        Every earlier writer is fenced from here on.  Returns the new epoch.  ``replay_from``:
        the Kafka offset this writer replays from; the log then keeps only the committed ids
        that can still be replayed (entries with ``last_offset >= replay_from``, plus the
        newest snapshot's segment and after). None keeps every committed id (reads the whole
        chain). ``from_position``: replay from the log's own :attr:`resume_offset` where it has
        one (``replay_from`` otherwise). ``group`` and ``deployment`` are recorded in the claim
        (the writer's consumer group and deployment name). ``start_at``: asked, only when the
        log has neither a position nor a shard, for where the partition starts; recorded in the
        claim as its ``resume_offset`` (the log's position from then on).
        """
        writer = writer_id or default_writer_id()
        with self._lock:
            if not self._loaded:
                replay_from = self._load_head(replay_from, from_position)
            else:
                self._probe()
                if from_position and self._resume is not None:
                    replay_from = self._resume
            if replay_from is not None:
                self.forget_before(replay_from)
            for _ in range(max_attempts):
                seq = self._next
                start = None
                if start_at is not None and self._resume is None and self._max_last_offset < 0:
                    start = start_at()
                entry = ClaimEntry(
                    seq=seq,
                    epoch=self.max_epoch + 1,
                    writer=writer,
                    group=group,
                    deployment=deployment,
                    resume_offset=start,
                )
                if self.storage.create_once(self._path(seq), _entry_bytes(entry)):
                    self._add(entry)
                    self._epoch, self._writer = entry.epoch, writer
                    log.info(
                        "%s/%d: claimed epoch %d at seq %d (%s)", self.topic, self.partition, entry.epoch, seq, writer
                    )
                    return entry.epoch
                new = self._refresh_after_conflict(seq)
                if new and new[0] == entry:  # our own write, acknowledged late
                    self._epoch, self._writer = entry.epoch, writer
                    return entry.epoch
            raise ConflictError(f"{self.topic}/{self.partition}: could not claim after {max_attempts} attempts")

    def _refresh_after_conflict(self, seq: int) -> list[Entry]:
        """After create_once(seq) failed: read new entries; wait briefly if entry *seq*
        is not readable yet (S3 409 ConditionalRequestConflict: a concurrent
        conditional write still in flight)."""
        for attempt in range(_UNREADABLE_WAIT.attempts):
            new = self._probe()
            if new or self._next > seq:
                return new
            time.sleep(_UNREADABLE_WAIT.delay(attempt))
        return []

    def _fenced(self, claim: ClaimEntry) -> FencedError:
        return FencedError(
            f"{self.topic}/{self.partition}: writer epoch {self._epoch} ({self._writer}) is fenced by "
            f"epoch {claim.epoch} ({claim.writer}) claimed at seq {claim.seq}",
            epoch=self._epoch,
            newer_epoch=claim.epoch,
            newer_writer=claim.writer,
        )

    def _newer_claim(self, unseen: Sequence[Entry] = ()) -> ClaimEntry | None:
        """A claim newer than ours: the newest claim read (directly or folded in a snapshot) if
        its epoch is higher; among *unseen* entries (read after a failed append) any claim
        that is not ours."""
        assert self._epoch is not None
        for e in unseen:
            if isinstance(e, ClaimEntry) and e.epoch != self._epoch:
                return e
        c = self._last_claim
        return c if c is not None and c.epoch > self._epoch else None

    def append_shard(self, entry: ShardEntry, *, max_attempts: int = 100) -> ShardEntry:
        """Commit *entry*: append it at the next seq with this writer's epoch.

        Returns the committed entry (with ``seq``, ``epoch`` and ``writer`` set).
        Raises :class:`FencedError` if another writer has claimed the partition,
        :class:`ConflictError` if unseen entries of this epoch appeared or the
        shard repeats committed episode ids (nothing is appended then), and
        :class:`rlrec.store.storage.StorageError` if storage keeps failing -- the
        entry may or may not exist then: the next ``append_shard`` or
        ``refresh`` finds out.  May append a snapshot after the entry.
        """
        if not isinstance(entry, ShardEntry):
            raise TypeError("append_shard wants a ShardEntry")
        if entry.topic != self.topic or entry.partition != self.partition:
            raise ValueError(f"entry is for {entry.topic}/{entry.partition}, log is {self.topic}/{self.partition}")
        with self._lock:
            if self._epoch is None:
                raise RuntimeError(f"{self.topic}/{self.partition}: claim() the partition before appending")
            newer = self._newer_claim()
            if newer is not None:
                raise self._fenced(newer)
            dup = {i for i in entry.episode_ids if i in self._ids}
            if dup:
                holders = {self._ids[i].seq: self._ids[i] for i in dup}
                raise ConflictError(
                    f"{self.topic}/{self.partition}: {len(dup)} episode id(s) already committed",
                    entries=[holders[s] for s in sorted(holders)],
                    duplicate_episode_ids=dup,
                )
            for _ in range(max_attempts):
                seq = self._next
                e = entry.with_commit(seq=seq, epoch=self._epoch, writer=self._writer)
                e = dataclasses.replace(e, commit_time=time.time())  # stamped as it lands (APPEND_WINDOW_S)
                if self.storage.create_once(self._path(seq), _entry_bytes(e)):
                    self._add(e)
                    self._maybe_snapshot()
                    return e
                new = self._refresh_after_conflict(seq)
                if new and new[0] == e:  # our own earlier attempt (ambiguous failure)
                    self._maybe_snapshot()
                    return e
                newer = self._newer_claim(new)
                if newer is not None:
                    raise self._fenced(newer)
                if not new:
                    raise ConflictError(f"{self.topic}/{self.partition}: entry {seq} exists but cannot be read")
                if all(isinstance(n, (SnapshotEntry, ReplaceEntry)) for n in new):
                    continue  # folded or compacted meanwhile (no new episode): append after it
                dup_ids = {i for n in new if isinstance(n, ShardEntry) for i in n.episode_ids}
                raise ConflictError(
                    f"{self.topic}/{self.partition}: {len(new)} unseen entr{'y' if len(new) == 1 else 'ies'} "
                    f"of epoch {self._epoch} at seq {seq}..{seq + len(new) - 1}",
                    entries=new,
                    duplicate_episode_ids=dup_ids.intersection(entry.episode_ids),
                )
            raise ConflictError(f"{self.topic}/{self.partition}: could not append after {max_attempts} attempts")

    def append_replace(
        self, entry: ReplaceEntry, replaced: Sequence[ShardEntry], *, seen: int | None = None, max_attempts: int = 100
    ) -> ReplaceEntry:
        """Commit a compaction: append *entry* (its shard replaces the shards *replaced*, the
        live shards of the entries ``entry.replaces`` as the caller read them) with this writer's
        epoch.

        Checked here, under the log's lock, whatever the caller planned from: *replaced* are the
        shards the log holds at those seqs, the new shard holds
        exactly the episode ids of *replaced*, and no replace entry appended since the caller's
        read (entries from *seen*, the log's next seq when the caller read it, default
        ``min(entry.replaces)``) replaced any of them -- only this
        writer's epoch can append, so that is the only way they stop being live. Raises
        :class:`FencedError` (a newer claim), :class:`ConflictError` (the rule is broken or one
        of them was replaced meanwhile: nothing appended) and storage errors (the entry may or
        may not exist then: the next refresh finds out; the caller re-plans).
        """
        if not isinstance(entry, ReplaceEntry):
            raise TypeError("append_replace wants a ReplaceEntry")
        s = entry.shard
        if s.topic != self.topic or s.partition != self.partition:
            raise ValueError(f"entry is for {s.topic}/{s.partition}, log is {self.topic}/{self.partition}")
        if sorted(r.seq for r in replaced) != list(entry.replaces):  # type: ignore[type-var]
            raise ValueError("replaced must be the live shards of entry.replaces")
        old_ids = [i for r in replaced for i in r.episode_ids]
        if len(set(old_ids)) != len(old_ids) or set(old_ids) != set(s.episode_ids):
            raise ConflictError(
                f"{self.topic}/{self.partition}: a replacement must hold exactly the episodes it replaces"
            )
        with self._lock:
            if self._epoch is None:
                raise RuntimeError(f"{self.topic}/{self.partition}: claim() the partition before appending")
            for r, stored in zip(replaced, _read_many(self._read_entry, [r.seq for r in replaced])):
                shard = stored.shard if isinstance(stored, ReplaceEntry) else stored
                if shard != r:  # a log's entries are for ever: never append one its readers would refuse
                    raise ConflictError(f"{self.topic}/{self.partition}: seq {r.seq} is not the shard to replace")
            checked = min(entry.replaces) if seen is None else max(min(entry.replaces), seen)
            for _ in range(max_attempts):
                self._probe()
                newer = self._newer_claim()
                if newer is not None:
                    raise self._fenced(newer)
                for n in self._read_range(checked, self._next):
                    gone = set(entry.replaces).intersection(_replaced_by(n))
                    if gone:
                        raise ConflictError(
                            f"{self.topic}/{self.partition}: seq {sorted(gone)} replaced meanwhile by seq {n.seq}"
                        )
                checked = seq = self._next
                e = entry.with_commit(seq=seq, epoch=self._epoch, writer=self._writer)
                now = time.time()  # stamped as it lands (APPEND_WINDOW_S)
                e = dataclasses.replace(e, time=now, shard=dataclasses.replace(e.shard, commit_time=now))
                if self.storage.create_once(self._path(seq), _entry_bytes(e)):
                    self._add(e)
                    self._maybe_snapshot()
                    return e
                new = self._refresh_after_conflict(seq)
                if new and new[0] == e:  # our own earlier attempt (ambiguous failure)
                    self._maybe_snapshot()
                    return e
                checked = seq
            raise ConflictError(f"{self.topic}/{self.partition}: could not append after {max_attempts} attempts")

    # ------------------------------------------------------------ snapshots
    def _maybe_snapshot(self) -> SnapshotEntry | None:
        """Append a snapshot if at least ``snapshot_every`` entries follow the newest one.

        Best effort: a storage error or a lost race only postpones it to the next append."""
        if self._epoch is None or self._writer is None or self.snapshot_every <= 0:
            return None
        seq = self._next
        since = 0 if self._base is None else self._base.seq + 1
        if seq - since < self.snapshot_every or self._newer_claim() is not None or self._last_claim is None:
            return None
        folded_from = max(since, seq - MAX_SEGMENT)
        segment = [e for e in self._entries if folded_from <= e.seq < seq]
        if len(segment) != seq - folded_from or any(isinstance(e, SnapshotEntry) for e in segment):
            return None  # not all in memory (a gap tolerated by a reader): leave it to a writer
        if seq < self._no_snapshot_before:
            return None
        snap = self._snapshot_of(seq, since, folded_from, segment)
        data = snap.to_json().encode()
        if len(data) > MAX_ENTRY_BYTES:  # fold only the newest entries that fit: older ones stay unfolded
            sizes = [len(e.to_json()) + 2 for e in segment]  # each as the snapshot holds it, with ", "
            room = MAX_ENTRY_BYTES - (len(data) - sum(sizes))
            kept = 0
            for size in reversed(sizes):
                room -= size
                if room < 0:
                    break
                kept += 1
            if kept:
                segment = segment[len(segment) - kept :]
                folded_from = segment[0].seq
                snap = self._snapshot_of(seq, since, folded_from, segment)
                data = snap.to_json().encode()
            if not kept or len(data) > MAX_ENTRY_BYTES:
                self._no_snapshot_before = seq + self.snapshot_every  # not at every append
                log.warning(
                    "%s/%d: no snapshot at seq %d: over MAX_ENTRY_BYTES (%d); tried again in %d entries",
                    self.topic, self.partition, seq, MAX_ENTRY_BYTES, self.snapshot_every,
                )  # fmt: skip
                return None
        try:
            created = self.storage.create_once(self._path(seq), data)
        except Exception as err:  # maybe landed: the next probe finds out
            log.warning("%s/%d: snapshot at seq %d failed (%s); retried later", self.topic, self.partition, seq, err)
            return None
        if not created:
            try:
                self._probe()
            except Exception as err:
                log.warning("%s/%d: cannot read entry %d (%s)", self.topic, self.partition, seq, err)
            return None
        self._add(snap)
        self._write_hint(seq)
        log.info(
            "%s/%d: snapshot at seq %d folds entries %d..%d", self.topic, self.partition, seq, folded_from, seq - 1
        )
        self._maybe_live_set(seq + 1)
        return snap

    def _maybe_live_set(self, end: int) -> None:
        """Write a live set at `end` if at least ``live_set_every`` entries follow the newest one.
        Best effort, as snapshots: a failure only postpones it (readers read the history).

        Built from the last one this writer built and the entries after it, on the caller's
        (commit) path. Its first (after the claim), or one with no usable live set, is built from
        the history: there too for a log of at most ``2 * live_set_every`` entries, else by one
        background thread of this writer, so that no commit waits on a whole-history read."""
        from rlrec.store import live_set as ls  # live sets build on this module

        every = ls.LIVE_SET_EVERY if self.live_set_every is None else self.live_set_every
        if every <= 0:
            return
        if self._live_builder is not None and self._live_builder.is_alive():
            return  # the first live set is being built
        try:
            if self._live_seq is None:
                seqs = ls.live_set_seqs(self.storage, self.topic, self.partition)
                self._live_seq = max((q for q in seqs if q <= end), default=0)  # past the end: not ours
            if end - self._live_seq < every:
                return
            if self._live_set is None and end > 2 * every:  # its first: from the history, off the commit path
                raise ls.NeedsHistory("no live set built by this writer yet")
            written = ls.write_live_set(
                self.storage,
                self.topic,
                self.partition,
                writer=self._writer or "",
                prev=self._live_set,
                history=end <= 2 * every,
                from_history=self._live_set is None,
            )
            self._live_seq = written.seq if written is not None else end
            self._live_set = written or self._live_set
        except ls.NeedsHistory:
            self._live_builder = threading.Thread(
                target=self._build_first_live_set,
                args=(end,),
                name=f"rlrec-live-set-{self.topic}-{self.partition}",
                daemon=True,
            )
            self._live_builder.start()
        except Exception as err:
            log.warning("%s/%d: no live set at seq %d (%s); tried again later", self.topic, self.partition, end, err)

    def _build_first_live_set(self, end: int) -> None:
        """The background build of `_maybe_live_set`: the log's live set from its whole history."""
        from rlrec.store import live_set as ls

        try:
            written = ls.write_live_set(
                self.storage, self.topic, self.partition, writer=self._writer or "", from_history=True
            )
            self._live_seq = written.seq if written is not None else end
            self._live_set = written or self._live_set
        except Exception as err:
            log.warning("%s/%d: no live set at seq %d (%s); tried again later", self.topic, self.partition, end, err)

    def _snapshot_of(self, seq: int, since: int, folded_from: int, segment: list[Entry]) -> SnapshotEntry:
        """The snapshot at `seq` folding `segment` (entries ``folded_from .. seq-1``; those from
        `since` up to `folded_from` stay unfolded)."""
        below = -1 if self._base is None else self._base.max_last_offset
        for e in self._entries:
            if isinstance(e, ShardEntry) and since <= e.seq < folded_from:
                below = max(below, e.last_offset)
        return SnapshotEntry(
            seq=seq,
            epoch=self._epoch,  # type: ignore[arg-type]
            writer=self._writer,  # type: ignore[arg-type]
            prev=None if self._base is None else self._base.seq,
            folded_from=folded_from,
            entries=segment,  # type: ignore[arg-type]
            last_claim=self._last_claim,  # type: ignore[arg-type]
            max_last_offset=max([below, *(e.last_offset for e in segment if isinstance(e, ShardEntry))]),
            below_max_last_offset=below,
            unpublished=[e for s, (e, _) in sorted(self._unknown.items()) if s < seq],
            resume_offset=self._resume,  # every entry below seq is read (R1)
        )

    def _write_hint(self, seq: int) -> None:
        try:
            self.storage.write(self.hint_path, json.dumps({"snapshot": seq}).encode())
        except Exception as err:  # only a hint: the next snapshot writes it again
            log.warning("%s/%d: cannot write the log's hint (%s)", self.topic, self.partition, err)

    # ----------------------------------------------------------- publishing
    def publish(self, entry: ShardEntry, data: bytes | None = None) -> bool:
        """Move a committed shard from staging to its published path (idempotent).

        Returns True if this call published it, False if it was already published (or
        retention removed it).  If neither file exists and *data* (the shard's bytes, checked
        against the entry's sha256) is given, the published file is written from it -- unless
        a removal record names it (retention deleted it: never re-created, also when the
        record lands while it is written); otherwise FileNotFoundError.
        """
        st = self.storage
        try:
            st.move(entry.staging_path, entry.path)
            moved = True
        except FileNotFoundError:
            if st.exists(entry.path):  # published meanwhile (e.g. by a recovering owner)
                moved = False
            elif data is not None and _sha256(data) == entry.sha256 and not self._removed(entry):
                st.write(entry.path, data)
                if self._removed(entry):  # recorded meanwhile: retention's delete may have run already
                    st.delete(entry.path)
                    moved = False
                else:
                    moved = True
                    log.warning(
                        "%s/%d: staged file of seq %d was gone; published %s from memory",
                        self.topic,
                        self.partition,
                        entry.seq,
                        entry.path,
                    )
            elif data is not None and _sha256(data) == entry.sha256:  # removed by retention: not re-created
                log.info("%s/%d: shard seq %d was removed by retention: not republished", *self._where(entry))
                moved = False
            else:
                raise FileNotFoundError(
                    f"committed shard {entry.path} (seq {entry.seq}) has neither a published nor a staged file"
                ) from None
        with self._lock:
            self._unknown.pop(entry.seq, None)  # type: ignore[arg-type]
        return moved

    def _staging(self) -> tuple[list[tuple[ShardEntry, bool]], set[str]]:
        """(committed shards not known to be published, the files of their staging folders)."""
        with self._lock:
            self.refresh()
            cands = [self._unknown[s] for s in sorted(self._unknown)]
        present: set[str] = set()
        for d in sorted({_parent(e.staging_path) for e, _ in cands}):
            present.update(i.path for i in self.storage.list(d) if not i.is_dir)
        return cands, present

    def staged(self) -> list[ShardEntry]:
        """The committed shards not known to be published whose staging file exists: what
        `recover` would publish (a reader may ask; only the owner publishes). One listing per
        staging folder involved."""
        cands, present = self._staging()
        return [e for e, _ in cands if e.staging_path in present]

    def _where(self, e: ShardEntry) -> tuple[str, int, int | None]:
        return self.topic, self.partition, e.seq

    def _removed(self, e: ShardEntry, named: set | None = None) -> bool:
        """Whether retention removed shard `e` (a removal record names exactly its files): then
        its files are gone by design, not lost. Read only when a listed shard has no file;
        `named`: the files the records name (`_removed_files`), read once for many shards."""
        if named is None:
            named = self._removed_files()
        return (self.topic, self.partition, e.seq, e.path, e.staging_path) in named

    def _removed_files(self) -> set[tuple[str, int, int, str, str]]:
        """What the removal log's records name (a malformed record is logged and names nothing:
        its shards count as not removed, so one bad record never stops this partition)."""
        from rlrec.store.retention import read_removals  # retention builds on this module

        return {
            (f.topic, f.partition, f.seq, f.path, f.staging_path)
            for r in read_removals(self.storage, strict=False)
            for f in r.files
        }

    def recover(self) -> int:
        """Roll forward: publish every committed shard not known to be published whose staging
        file exists (the entries read since the newest snapshot and those a snapshot lists as
        unpublished).  Returns how many were published.  One listing per staging directory
        involved, whatever the history's length.

        A shard a snapshot listed as unpublished that has neither file is logged as an
        error (data loss, e.g. a manual delete) unless a removal record names it (retention
        deleted it); ``verify`` checks every shard.
        """
        cands, present = self._staging()
        published = 0
        named: set | None = None  # the files removal records name: read once, when first needed
        for e, listed in cands:
            if e.staging_path in present:
                try:
                    if self.publish(e):
                        published += 1
                        log.info("%s/%d: rolled forward shard seq %d -> %s", self.topic, self.partition, e.seq, e.path)
                    continue
                except EscapesRoot as err:  # a forged entry or a planted link: refused, left for verify
                    log.error(
                        "%s/%d: not publishing shard seq %d (%s -> %s): %s",
                        self.topic,
                        self.partition,
                        e.seq,
                        e.staging_path,
                        e.path,
                        err,
                    )
                    continue
                except FileNotFoundError:
                    pass
            elif (
                not listed
                or self.storage.exists(e.path)
                or self._removed(e, named := self._removed_files() if named is None else named)
            ):
                with self._lock:
                    self._unknown.pop(e.seq, None)  # type: ignore[arg-type]
                continue
            log.error(
                "%s/%d: committed shard seq %d lost: neither %s nor %s exists",
                self.topic,
                self.partition,
                e.seq,
                e.path,
                e.staging_path,
            )
            with self._lock:
                self._unknown.pop(e.seq, None)  # type: ignore[arg-type]
        with self._lock:
            self._maybe_snapshot()
        return published


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _entry_bytes(entry: Entry) -> bytes:
    """`entry` as stored; EntryTooLargeError if its readers would refuse it (over
    `MAX_ENTRY_BYTES`): a log's entries are for ever, so a writer never appends one its readers
    refuse."""
    data = entry.to_json().encode()
    if len(data) > MAX_ENTRY_BYTES:
        raise EntryTooLargeError(
            f"a {type(entry).__name__} of {len(data)} bytes is over MAX_ENTRY_BYTES ({MAX_ENTRY_BYTES}): "
            "roll smaller shards (rlrec consume --max-file-bytes / --max-episodes-per-file; rlrec compact "
            "--target-bytes)"
        )
    return data


def _read_many(fn: Any, items: Sequence[Any]) -> list[Any]:
    if len(items) <= 2:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(_READ_WORKERS, len(items))) as ex:
        return list(ex.map(fn, items))


def _replaced_by(e: Entry) -> tuple[int, ...]:
    """The seqs an entry replaces (a snapshot: those its folded replace entries replace)."""
    if isinstance(e, ReplaceEntry):
        return e.replaces
    if isinstance(e, SnapshotEntry):
        return tuple(r for x in e.entries if isinstance(x, ReplaceEntry) for r in x.replaces)
    return ()


def live_shards(entries: Iterable[Entry], *, below: int | None = None) -> dict[int, ShardEntry]:
    """The live shards of one partition log: ``{seq of the entry that committed it: shard}``.

    Args:
        entries: the log's entries in seq order (`PartitionLog.load`).
        below: only entries with ``seq < below`` count (a point of the log; None: all).

    A shard entry adds its shard; a replace entry removes the shards of ``replaces`` and adds
    its own. The rule of replacement is enforced here (every reader of the log's episodes goes
    through this function): each replaced seq must be live, and the new shard's episode ids
    exactly the union of theirs, else ManifestError -- so an episode is in exactly one live
    shard at every point of a log where it is committed.

    Example:
        >>> live_shards([])
        {}
    """
    live: dict[int, ShardEntry] = {}
    for e in entries:
        if below is not None and e.seq >= below:  # type: ignore[operator]
            break
        if isinstance(e, ShardEntry):
            live[e.seq] = e  # type: ignore[index]
        elif isinstance(e, ReplaceEntry):
            missing = [r for r in e.replaces if r not in live]
            if missing:
                raise ManifestError(f"replace entry {e.seq} replaces seq {missing}, which are not live shards")
            old = [i for r in e.replaces for i in live[r].episode_ids]
            if len(set(old)) != len(old) or set(old) != set(e.shard.episode_ids):
                raise ManifestError(
                    f"replace entry {e.seq}: its shard's episode ids are not exactly those of seq {list(e.replaces)}"
                )
            for r in e.replaces:
                del live[r]
            live[e.seq] = e.shard  # type: ignore[index]
    return live


def _holdings(entries: Iterable[Entry], below: int | None = None) -> Iterator[tuple[Entry, tuple[int, ...]]]:
    """Each shard and replace entry of one log (in seq order, below `below`) with the seqs of
    the shard entries whose episodes its shard holds: itself, or what a replacement (of
    replacements) merged."""
    held: dict[int, tuple[int, ...]] = {}
    for e in entries:
        if below is not None and e.seq >= below:  # type: ignore[operator]
            break
        if isinstance(e, ShardEntry):
            h: tuple[int, ...] = (e.seq,)  # type: ignore[assignment]
        elif isinstance(e, ReplaceEntry):
            h = tuple(sorted(s for r in e.replaces for s in held.pop(r, ())))
        else:
            continue
        held[e.seq] = h  # type: ignore[index]
        yield e, h


def live_holders(
    entries: Iterable[Entry], *, below: int | None = None
) -> dict[int, tuple[ShardEntry, tuple[int, ...]]]:
    """The live shards of one partition log (as `live_shards`, which checks the rule of
    replacement) with the shard entries whose episodes each holds: ``{seq of the live shard:
    (shard, seqs of the shard entries that first committed its episodes)}`` -- the shard entry
    itself, or every shard entry a replacement (of replacements) merged into it.

    Args:
        entries: the log's entries in seq order (`PartitionLog.load`).
        below: only entries with ``seq < below`` count (None: all).

    Example:
        >>> live_holders([])
        {}
    """
    entries = list(entries)
    live = live_shards(entries, below=below)
    held = {e.seq: h for e, h in _holdings(entries, below)}
    return {seq: (shard, held[seq]) for seq, shard in live.items()}


def merged_shards(entries: Iterable[Entry]) -> dict[str, tuple[int, ...]]:
    """Every merged shard the replace entries of one partition log committed (live or replaced
    since): ``{its path: seqs of the shard entries whose episodes it holds}``.

    Args:
        entries: the log's entries in seq order (`PartitionLog.load`).

    Example:
        >>> merged_shards([])
        {}
    """
    return {e.shard.path: h for e, h in _holdings(entries) if isinstance(e, ReplaceEntry)}


def shard_files(entries: Iterable[Entry]) -> list[ShardEntry]:
    """Every shard any entry of a log ever committed: live, replaced, and the shards of replace
    entries (what gc keeps; retention decides when replaced ones go)."""
    return [e if isinstance(e, ShardEntry) else e.shard for e in entries if isinstance(e, (ShardEntry, ReplaceEntry))]


# -------------------------------------------------------------- whole manifest


def list_partition_logs(storage: Storage) -> list[tuple[str, int]]:
    """``[(topic, partition)]`` of every partition log (two directory levels listed, no entries)."""
    out = []
    for t in storage.list(MANIFEST_DIR):
        if not t.is_dir:
            continue
        if not TOPIC_RE.match(t.name) or t.name in (".", ".."):
            log.warning("ignoring unexpected directory in the manifest: %s", t.path)
            continue
        for p in storage.list(t.path):
            if p.is_dir and _PART_RE.match(p.name):
                out.append((t.name, int(p.name)))
            elif not p.name.startswith(".") and not (t.name == REMOVED_LOG and _RECORD_RE.match(p.name)):
                log.warning("ignoring unexpected file in the manifest: %s", p.path)
    return sorted(out)


def read_partition_logs(storage: Storage) -> dict[tuple[str, int], list[Entry]]:
    """Every entry of every partition log: ``{(topic, partition): [entries in seq order]}``.

    Per log: the hint, the chain of snapshots (one read each) and the entries not folded
    in one (read in parallel).  Gaps are logged, not raised (``verify`` reports them).
    """
    return {k: PartitionLog(storage, *k).load(strict=False) for k in list_partition_logs(storage)}


def read_manifest(storage: Storage) -> list[ShardEntry]:
    """The live shards (:func:`live_shards`: compacted ones replaced by their replacement) of all
    topics/partitions at the newest point, less those retention removed
    (`rlrec.store.retention`), sorted by commit_time: each committed episode in exactly one of them.
    Read through each log's live set where it has one (`rlrec.store.live_set.read_heads`): its
    shards then carry no ``episode_ids`` (``episodes`` counts them)."""
    from rlrec.store.live_set import read_heads

    heads, _, _ = read_heads(storage, strict=False)
    shards = [s for h in heads.values() for s in h.shards]
    shards.sort(key=lambda e: (e.commit_time, e.topic, e.partition, e.seq))
    return shards


def read_first_commits(storage: Storage) -> list[ShardEntry]:
    """Every shard entry of all topics/partitions -- each episode in the shard that first committed
    it, with that commit's time, whether compaction replaced it since or not (replacements are not
    listed) -- sorted by commit_time. For history (freshness, what the trainer took as new); the
    files of replaced shards exist until retention removes them."""
    shards = [e for entries in read_partition_logs(storage).values() for e in entries if isinstance(e, ShardEntry)]
    shards.sort(key=lambda e: (e.commit_time, e.topic, e.partition, e.seq))
    return shards


def manifest_totals(entries: Iterable[ShardEntry]) -> dict[str, Any]:
    """``{"shards", "episodes", "steps", "bytes", "policies": {policy_id: {same keys}}}``."""

    def zero() -> dict[str, int]:
        return {"shards": 0, "episodes": 0, "steps": 0, "bytes": 0}

    total: dict[str, Any] = zero()
    policies: dict[str, dict[str, int]] = {}
    for e in entries:
        for t in (total, policies.setdefault(e.policy_id, zero())):
            t["shards"] += 1
            t["episodes"] += e.episodes
            t["steps"] += e.steps
            t["bytes"] += e.bytes
    total["policies"] = dict(sorted(policies.items()))
    return total
