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

`PartitionLog` reads its log through :mod:`rlrec.store.log_reader` and publishes shards through
:mod:`rlrec.store.log_publish`; which shards a log's entries hold (the live ones, the rule of
replacement): :mod:`rlrec.store.log_shards`.

Example:
    >>> import tempfile
    >>> log = PartitionLog(Storage.from_uri(tempfile.mkdtemp()), "rl", 0)
    >>> log.claim("w0"), log.next_seq, read_manifest(log.storage)
    (1, 1, [])
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rlrec.store.log_publish import LogPublishing
from rlrec.store.log_reader import HEAD_HINT, MAX_ENTRY_BYTES, _read_many
from rlrec.store.log_shards import _replaced_by, live_holders, live_shards, merged_shards, shard_files
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
_PART_RE = re.compile(r"^\d{5}$")
#: the removal log's directory in the manifest (`rlrec.store.retention`): records, no partitions
REMOVED_LOG = "_removed"
_RECORD_RE = re.compile(r"^\d{8}\.json$")


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


# ------------------------------------------------------------- PartitionLog


class PartitionLog(LogPublishing):
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
        super().__init__(storage, topic, partition)
        self.snapshot_every = snapshot_every
        #: a writer writes a live set (`rlrec.store.live_set`) once this many entries follow the
        #: newest one (None: `LIVE_SET_EVERY`; 0: never)
        self.live_set_every = live_set_every
        self._live_seq: int | None = None  # the seq of the newest live set (None: not looked yet)
        self._live_set: Any = None  # the newest live set this writer wrote (not read back)
        #: the thread building this log's first live set from its history (off the commit path)
        self._live_builder: threading.Thread | None = None
        self._epoch: int | None = None
        self._writer: str | None = None

    def __repr__(self) -> str:
        return f"PartitionLog({self.topic}/{self.partition}, next_seq={self._next}, epoch={self._epoch})"

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

    @property
    def epoch(self) -> int | None:
        """This writer's epoch (after :meth:`claim`), else None."""
        return self._epoch

    @property
    def writer_id(self) -> str | None:
        return self._writer

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
