"""Reading one partition log of the manifest (`rlrec.store.manifest`): its entries, read from
storage and held in memory -- the part of `rlrec.store.manifest.PartitionLog` that reads (a
writer reads its log too: before its claim, and the entries that landed before its append).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlrec.store.manifest_entries import (
    MANIFEST_DIR,
    TOPIC_RE,
    ClaimEntry,
    Entry,
    ManifestError,
    ReplaceEntry,
    ShardEntry,
    SnapshotEntry,
    parse_entry,
)
from rlrec.store.storage import Storage

__all__ = ["HEAD_HINT", "MAX_ENTRY_BYTES", "MAX_HINT_BYTES", "LogReader"]

log = logging.getLogger("rlrec.manifest")

#: name of the hint file in each partition's log directory (dot-prefixed: not an entry)
HEAD_HINT = ".head.json"
#: the most bytes of one log entry, read or written (a snapshot of 100 entries of the largest
#: shards, 128 MiB of small episodes each, is ~150 MB; writers fold fewer or split shards to stay
#: under it); a larger object is refused as malformed before it is read whole (GUARANTEES.md §5)
MAX_ENTRY_BYTES = 512 * 1024 * 1024
#: the most bytes of the head hint read (it holds one number)
MAX_HINT_BYTES = 64 * 1024

_SEQ_RE = re.compile(r"^(\d{12})\.json$")
_READ_WORKERS = 8
_BACKWARD_BATCH = 16  # entries read at a time when searching a listed log backwards


class LogReader:
    """One partition log's entries, read from storage and held in memory (`PartitionLog`
    is the whole log, writer included: build that one).

    Thread-safe (one lock per object). A reader (`load`, `refresh`) holds every entry; a
    writer (`PartitionLog.claim`) keeps only the entries since the newest snapshot and the
    committed episode ids that can still be replayed.
    """

    def __init__(self, storage: Storage, topic: str, partition: int) -> None:
        if not TOPIC_RE.match(topic) or topic in (".", ".."):
            raise ValueError(f"not a valid Kafka topic name: {topic!r}")
        if not isinstance(partition, int) or isinstance(partition, bool) or not 0 <= partition <= 99999:
            raise ValueError(f"partition must be an int in [0, 99999], got {partition!r}")
        self.storage = storage
        self.topic = topic
        self.partition = partition
        self.prefix = f"{MANIFEST_DIR}/{topic}/{partition:05d}"
        self._lock = threading.RLock()
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
            >>> from rlrec.store.manifest import PartitionLog
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


def _read_many(fn: Any, items: Sequence[Any]) -> list[Any]:
    if len(items) <= 2:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(_READ_WORKERS, len(items))) as ex:
        return list(ex.map(fn, items))
