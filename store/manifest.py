"""The manifest: one append-only log per Kafka partition, the commit point of shards.

Layout (relative to the output root)::

    _manifest/{topic}/{partition:05d}/{seq:012d}.json

Each entry is a small immutable JSON document created with a create-once write
(:meth:`rlrec.store.storage.Storage.create_once`); ``seq`` runs 0, 1, 2, ... with no
gaps.  Two entry types:

* ``claim`` (:class:`ClaimEntry`) -- a consumer that gets the partition appends
  a claim with writer epoch ``E = max(epochs in the log) + 1``.
* ``shard`` (:class:`ShardEntry`) -- a shard of episodes is *committed* when
  its entry exists.  Its ``epoch`` is the epoch of the writer that appended it.

Rule: a writer appends entry ``k`` only after it has read every entry ``< k``.
If entry ``k`` already exists (the create-once write fails), the writer reads
the new entries: a claim with another epoch means a newer owner took the
partition and the writer is fenced (:class:`FencedError`); otherwise
:class:`ConflictError` carries the new entries so the caller can drop episode
ids that are already committed and retry.  A writer that lost its partition can
therefore commit nothing after the new owner's claim -- no clocks or leases
involved.  See docs/GUARANTEES.md.

Entries are plain JSON (never pickle): :func:`parse_entry` rejects unknown entry
types, unknown or missing fields and wrongly typed values with
:class:`ManifestError`.
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
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rlrec.store.storage import Storage

__all__ = [
    "MANIFEST_DIR",
    "ClaimEntry",
    "ConflictError",
    "Entry",
    "FencedError",
    "ManifestError",
    "PartitionLog",
    "ShardEntry",
    "default_writer_id",
    "entry_path",
    "manifest_totals",
    "parse_entry",
    "read_manifest",
    "read_partition_logs",
]

log = logging.getLogger("rlrec.manifest")

MANIFEST_DIR = "_manifest"
_SEQ_RE = re.compile(r"^(\d{12})\.json$")
_PART_RE = re.compile(r"^\d{5}$")
# Kafka topic names: [a-zA-Z0-9._-], at most 249 characters; "." and ".." are invalid.
_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_READ_WORKERS = 8


# --------------------------------------------------------------------- errors


class ManifestError(ValueError):
    """A manifest entry (or the log) is malformed: unknown type, bad fields, gaps."""


class FencedError(RuntimeError):
    """A newer writer claimed the partition: this writer must stop writing it."""

    def __init__(
        self, message: str, *, epoch: int | None, newer_epoch: int | None, newer_writer: str | None = None
    ) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.newer_epoch = newer_epoch
        self.newer_writer = newer_writer


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


# -------------------------------------------------------------------- entries


def _check_type(d: Mapping[str, Any], key: str, types: tuple[type, ...], *, nullable: bool = False) -> Any:
    v = d[key]
    if v is None and nullable:
        return v
    # bool is an int subclass: never accept it where a number is expected.
    if isinstance(v, bool) and bool not in types:
        raise ManifestError(f"field {key!r}: expected {'/'.join(t.__name__ for t in types)}, got bool")
    if not isinstance(v, types):
        raise ManifestError(f"field {key!r}: expected {'/'.join(t.__name__ for t in types)}, got {type(v).__name__}")
    return v


def _check_rel_path(key: str, p: str) -> None:
    if not p or p.startswith("/") or "\\" in p or any(c in ("", ".", "..") for c in p.split("/")):
        raise ManifestError(f"field {key!r}: not a clean relative path: {p!r}")


def _check_keys(d: Mapping[str, Any], required: set[str], optional: set[str], what: str) -> None:
    missing = required - d.keys()
    if missing:
        raise ManifestError(f"{what} entry: missing fields {sorted(missing)}")
    unknown = d.keys() - required - optional
    if unknown:
        raise ManifestError(f"{what} entry: unknown fields {sorted(unknown)}")


@dataclass(frozen=True, kw_only=True)
class ClaimEntry:
    """``{"type": "claim", "seq", "epoch", "writer", "time"}``."""

    epoch: int
    writer: str
    time: float = field(default_factory=time.time)
    seq: int | None = None

    type = "claim"
    _REQUIRED = frozenset({"type", "seq", "epoch", "writer", "time"})

    def to_dict(self) -> dict[str, Any]:
        return {"type": "claim", "seq": self.seq, "epoch": self.epoch, "writer": self.writer, "time": self.time}

    def to_json(self) -> str:
        d = self.to_dict()
        _validate_claim(d)
        return _dumps(d)

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, Any]) -> ClaimEntry:
        e = parse_entry(data)
        if not isinstance(e, ClaimEntry):
            raise ManifestError(f"expected a claim entry, got {e.type!r}")
        return e


@dataclass(frozen=True, kw_only=True)
class ShardEntry:
    """One committed shard of complete episodes from one partition and one policy.

    Build it without ``seq``/``epoch``/``writer``; :meth:`PartitionLog.append_shard`
    fills them in.  ``path``/``staging_path`` are relative to the output root and
    must be unique per append attempt (see docs/GUARANTEES.md).  ``first_offset``
    is the smallest start offset and ``last_offset`` the largest event offset of
    the shard's episodes.  ``episode_ids`` (a list is accepted, a tuple is kept)
    must have ``episodes`` unique ids.  ``event_schema_versions`` is a list of
    versions or a mapping ``{event type: version}``.  ``commit_time`` defaults
    to the time the entry object was made (Unix seconds).
    """

    path: str
    staging_path: str
    topic: str
    partition: int
    policy_id: str
    first_offset: int
    last_offset: int
    episode_ids: tuple[str, ...]
    episodes: int
    steps: int
    bytes: int
    sha256: str
    format: str
    format_version: int
    event_schema_versions: tuple[int | str, ...] | dict[str, int | str] = ()
    commit_time: float = field(default_factory=time.time)
    min_policy_version: int | str | None = None
    max_policy_version: int | str | None = None
    writer: str | None = None
    epoch: int = -1
    seq: int | None = None

    type = "shard"
    _REQUIRED = frozenset(
        {
            "type",
            "seq",
            "epoch",
            "path",
            "staging_path",
            "topic",
            "partition",
            "policy_id",
            "first_offset",
            "last_offset",
            "episode_ids",
            "episodes",
            "steps",
            "bytes",
            "sha256",
            "format",
            "format_version",
            "event_schema_versions",
            "commit_time",
            "min_policy_version",
            "max_policy_version",
        }
    )
    _OPTIONAL = frozenset({"writer"})

    def __post_init__(self) -> None:
        # Accept lists (e.g. from callers); store tuples so the entry stays immutable.
        if not isinstance(self.episode_ids, tuple):
            object.__setattr__(self, "episode_ids", tuple(self.episode_ids))
        v = self.event_schema_versions
        if isinstance(v, Mapping):
            object.__setattr__(self, "event_schema_versions", {str(k): v[k] for k in sorted(v)})
        elif not isinstance(v, tuple):
            object.__setattr__(self, "event_schema_versions", tuple(v))

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["type"] = "shard"
        d["episode_ids"] = list(self.episode_ids)
        v = self.event_schema_versions
        d["event_schema_versions"] = dict(v) if isinstance(v, Mapping) else list(v)
        if d["writer"] is None:
            del d["writer"]
        return d

    def to_json(self) -> str:
        d = self.to_dict()
        _validate_shard(d)
        return _dumps(d)

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, Any]) -> ShardEntry:
        e = parse_entry(data)
        if not isinstance(e, ShardEntry):
            raise ManifestError(f"expected a shard entry, got {e.type!r}")
        return e

    def with_commit(self, *, seq: int, epoch: int, writer: str | None) -> ShardEntry:
        return dataclasses.replace(self, seq=seq, epoch=epoch, writer=writer)


Entry = ClaimEntry | ShardEntry


def _dumps(d: Mapping[str, Any]) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _validate_common(d: Mapping[str, Any]) -> None:
    seq = _check_type(d, "seq", (int,))
    if seq < 0:
        raise ManifestError(f"field 'seq' must be >= 0, got {seq}")
    epoch = _check_type(d, "epoch", (int,))
    if epoch < 1:
        raise ManifestError(f"field 'epoch' must be >= 1, got {epoch}")


def _validate_claim(d: Mapping[str, Any]) -> None:
    _check_keys(d, set(ClaimEntry._REQUIRED), set(), "claim")
    _validate_common(d)
    if not _check_type(d, "writer", (str,)):
        raise ManifestError("field 'writer' must not be empty")
    _check_type(d, "time", (int, float))


def _validate_shard(d: Mapping[str, Any]) -> None:
    _check_keys(d, set(ShardEntry._REQUIRED), set(ShardEntry._OPTIONAL), "shard")
    _validate_common(d)
    for k in ("path", "staging_path"):
        _check_rel_path(k, _check_type(d, k, (str,)))
    if d["path"] == d["staging_path"]:
        raise ManifestError("fields 'path' and 'staging_path' must differ")
    if not _TOPIC_RE.match(_check_type(d, "topic", (str,))) or d["topic"] in (".", ".."):
        raise ManifestError(f"field 'topic': not a valid topic name: {d['topic']!r}")
    for k in ("partition", "first_offset", "last_offset", "episodes", "steps", "bytes", "format_version"):
        if _check_type(d, k, (int,)) < 0:
            raise ManifestError(f"field {k!r} must be >= 0, got {d[k]}")
    if d["first_offset"] > d["last_offset"]:
        raise ManifestError(f"first_offset {d['first_offset']} > last_offset {d['last_offset']}")
    if not _check_type(d, "policy_id", (str,)):
        raise ManifestError("field 'policy_id' must not be empty")
    ids = _check_type(d, "episode_ids", (list, tuple))
    if not all(isinstance(i, str) and i for i in ids):
        raise ManifestError("field 'episode_ids' must be a list of non-empty strings")
    if len(set(ids)) != len(ids):
        raise ManifestError("field 'episode_ids' has duplicates")
    if len(ids) != d["episodes"]:
        raise ManifestError(f"field 'episodes' ({d['episodes']}) != len(episode_ids) ({len(ids)})")
    if not _SHA_RE.match(_check_type(d, "sha256", (str,))):
        raise ManifestError("field 'sha256' must be 64 lowercase hex digits")
    if not _check_type(d, "format", (str,)):
        raise ManifestError("field 'format' must not be empty")
    vers = _check_type(d, "event_schema_versions", (list, tuple, dict))
    if isinstance(vers, dict):
        if not all(isinstance(k, str) for k in vers):
            raise ManifestError("field 'event_schema_versions': keys must be strings")
        vers = list(vers.values())
    if not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in vers):
        raise ManifestError(
            "field 'event_schema_versions' must be a list of int/str or an object {event type: int/str}"
        )
    _check_type(d, "commit_time", (int, float))
    for k in ("min_policy_version", "max_policy_version"):
        _check_type(d, k, (int, str), nullable=True)
    if "writer" in d:
        _check_type(d, "writer", (str,), nullable=True)


def parse_entry(data: str | bytes | Mapping[str, Any]) -> Entry:
    """Parse one manifest entry (JSON text/bytes or an already decoded dict)."""
    if isinstance(data, Mapping):
        d = dict(data)
    else:
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"manifest entry is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ManifestError(f"manifest entry must be a JSON object, got {type(d).__name__}")
    kind = d.get("type")
    if kind == "claim":
        _validate_claim(d)
        return ClaimEntry(seq=d["seq"], epoch=d["epoch"], writer=d["writer"], time=float(d["time"]))
    if kind == "shard":
        _validate_shard(d)
        kw = {k: d[k] for k in d if k != "type"}
        kw["commit_time"] = float(kw["commit_time"])
        return ShardEntry(**kw)
    raise ManifestError(f"unknown manifest entry type {kind!r}")


def entry_path(topic: str, partition: int, seq: int) -> str:
    """``_manifest/{topic}/{partition:05d}/{seq:012d}.json``."""
    return f"{MANIFEST_DIR}/{topic}/{int(partition):05d}/{int(seq):012d}.json"


def default_writer_id() -> str:
    """``host:pid:uuid`` -- unique per PartitionLog owner incarnation."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"


# ------------------------------------------------------------- PartitionLog


class PartitionLog:
    """The manifest log of one (topic, partition), cached in memory.

    Thread-safe (one lock per object).  Typical owner::

        log = PartitionLog(storage, topic, partition)
        epoch = log.claim()              # on partition assignment
        log.recover()                    # publish committed-but-unpublished shards
        skip = log.committed_episode_ids()
        ...
        storage.write(staging_path, parquet_bytes)   # 1. stage
        entry = log.append_shard(entry)               # 2. commit point
        log.publish(entry)                            # 3. staging -> published
        # 4. commit Kafka offsets (caller)

    ``append_shard`` raises :class:`FencedError` once another writer has claimed
    the partition, and :class:`ConflictError` in the (abnormal) case that
    entries of this writer's own epoch appeared that it had not read, or the
    shard repeats committed episode ids.
    """

    def __init__(self, storage: Storage, topic: str, partition: int) -> None:
        if not _TOPIC_RE.match(topic) or topic in (".", ".."):
            raise ValueError(f"not a valid Kafka topic name: {topic!r}")
        if not isinstance(partition, int) or isinstance(partition, bool) or not 0 <= partition <= 99999:
            raise ValueError(f"partition must be an int in [0, 99999], got {partition!r}")
        self.storage = storage
        self.topic = topic
        self.partition = partition
        self.prefix = f"{MANIFEST_DIR}/{topic}/{partition:05d}"
        self._lock = threading.RLock()
        self._entries: list[Entry] = []
        self._loaded = False
        self._epoch: int | None = None
        self._writer: str | None = None
        self._max_epoch = 0
        self._committed: set[str] = set()

    def __repr__(self) -> str:
        return f"PartitionLog({self.topic}/{self.partition}, next_seq={len(self._entries)}, epoch={self._epoch})"

    # ------------------------------------------------------------- reading
    def _path(self, seq: int) -> str:
        return f"{self.prefix}/{seq:012d}.json"

    def _read_entry(self, seq: int) -> Entry | None:
        try:
            data = self.storage.read(self._path(seq))
        except FileNotFoundError:
            return None
        try:
            e = parse_entry(data)
        except ManifestError as err:
            raise ManifestError(f"{self.storage.uri(self._path(seq))}: {err}") from None
        if e.seq != seq:
            raise ManifestError(f"{self.storage.uri(self._path(seq))}: entry says seq={e.seq}")
        if isinstance(e, ShardEntry) and (e.topic != self.topic or e.partition != self.partition):
            raise ManifestError(f"{self.storage.uri(self._path(seq))}: entry is for {e.topic}/{e.partition}")
        return e

    def _add(self, e: Entry) -> None:
        assert e.seq == len(self._entries), (e.seq, len(self._entries))
        self._entries.append(e)
        self._max_epoch = max(self._max_epoch, e.epoch)
        if isinstance(e, ShardEntry):
            self._committed.update(e.episode_ids)

    def load(self) -> list[Entry]:
        """(Re)read the whole log: list the directory, read every entry in seq order."""
        with self._lock:
            infos = self.storage.list(self.prefix)
            seqs = sorted(int(m.group(1)) for i in infos if not i.is_dir and (m := _SEQ_RE.match(i.name)))
            if seqs and seqs != list(range(len(seqs))):
                missing = sorted(set(range(seqs[-1] + 1)) - set(seqs))
                raise ManifestError(
                    f"manifest log {self.storage.uri(self.prefix)} has gaps: missing seq {missing[:10]}"
                )
            entries = _read_many(self._read_entry, seqs)
            self._entries, self._committed, self._max_epoch = [], set(), 0
            for seq, e in zip(seqs, entries):
                if e is None:
                    raise ManifestError(f"manifest entry {seq} disappeared while loading")
                self._add(e)
            self._loaded = True
            # Entries written between the listing and now.
            self._probe()
            return list(self._entries)

    def _probe(self) -> list[Entry]:
        new: list[Entry] = []
        while True:
            e = self._read_entry(len(self._entries))
            if e is None:
                return new
            self._add(e)
            new.append(e)

    def refresh(self) -> list[Entry]:
        """Read only entries appended since the last load/refresh; returns them."""
        with self._lock:
            if not self._loaded:
                before = len(self._entries)
                self.load()
                return self._entries[before:]
            return self._probe()

    # ----------------------------------------------------------- properties
    @property
    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries)

    @property
    def next_seq(self) -> int:
        return len(self._entries)

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
        return self._max_epoch

    def shard_entries(self) -> list[ShardEntry]:
        with self._lock:
            return [e for e in self._entries if isinstance(e, ShardEntry)]

    def committed_episode_ids(self) -> set[str]:
        with self._lock:
            return set(self._committed)

    # ------------------------------------------------------------- writing
    def claim(self, writer_id: str | None = None, *, max_attempts: int = 100) -> int:
        """Become the writer of this partition: append a claim with epoch max+1.

        Every earlier writer is fenced from here on.  Returns the new epoch.
        """
        writer = writer_id or default_writer_id()
        with self._lock:
            self.refresh()
            for _ in range(max_attempts):
                seq = self.next_seq
                entry = ClaimEntry(seq=seq, epoch=self._max_epoch + 1, writer=writer)
                if self.storage.create_once(self._path(seq), entry.to_json().encode()):
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
        delay = 0.01
        for _ in range(8):
            new = self._probe()
            if new or self.next_seq > seq:
                return new
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        return []

    def _newer_claim(self, entries: Iterable[Entry], *, unseen: bool = False) -> ClaimEntry | None:
        """A claim newer than ours among *entries*.  Among *unseen* entries (read
        after a failed append) any claim that is not ours counts."""
        assert self._epoch is not None
        for e in entries:
            if isinstance(e, ClaimEntry) and (e.epoch > self._epoch or (unseen and e.epoch != self._epoch)):
                return e
        return None

    def _fenced(self, claim: ClaimEntry) -> FencedError:
        return FencedError(
            f"{self.topic}/{self.partition}: writer epoch {self._epoch} ({self._writer}) is fenced by "
            f"epoch {claim.epoch} ({claim.writer}) claimed at seq {claim.seq}",
            epoch=self._epoch,
            newer_epoch=claim.epoch,
            newer_writer=claim.writer,
        )

    def append_shard(self, entry: ShardEntry) -> ShardEntry:
        """Commit *entry*: append it at the next seq with this writer's epoch.

        Returns the committed entry (with ``seq``, ``epoch`` and ``writer`` set).
        Raises :class:`FencedError` if another writer has claimed the partition,
        :class:`ConflictError` if unseen entries of this epoch appeared or the
        shard repeats committed episode ids (nothing is appended then), and
        :class:`rlrec.store.storage.StorageError` if storage keeps failing -- the
        entry may or may not exist then: the next ``append_shard`` or
        ``refresh`` finds out.
        """
        if not isinstance(entry, ShardEntry):
            raise TypeError("append_shard wants a ShardEntry")
        if entry.topic != self.topic or entry.partition != self.partition:
            raise ValueError(f"entry is for {entry.topic}/{entry.partition}, log is {self.topic}/{self.partition}")
        with self._lock:
            if self._epoch is None:
                raise RuntimeError(f"{self.topic}/{self.partition}: claim() the partition before appending")
            newer = self._newer_claim(self._entries)
            if newer is not None:
                raise self._fenced(newer)
            dup = self._committed.intersection(entry.episode_ids)
            if dup:
                holders = [e for e in self._entries if isinstance(e, ShardEntry) and dup.intersection(e.episode_ids)]
                raise ConflictError(
                    f"{self.topic}/{self.partition}: {len(dup)} episode id(s) already committed",
                    entries=holders,
                    duplicate_episode_ids=dup,
                )
            seq = self.next_seq
            e = entry.with_commit(seq=seq, epoch=self._epoch, writer=self._writer)
            if self.storage.create_once(self._path(seq), e.to_json().encode()):
                self._add(e)
                return e
            new = self._refresh_after_conflict(seq)
            if new and new[0] == e:  # our own earlier attempt (ambiguous failure)
                return new[0]
            newer = self._newer_claim(new, unseen=True)
            if newer is not None:
                raise self._fenced(newer)
            if not new:
                raise ConflictError(f"{self.topic}/{self.partition}: entry {seq} exists but cannot be read")
            dup = {i for n in new if isinstance(n, ShardEntry) for i in n.episode_ids}
            raise ConflictError(
                f"{self.topic}/{self.partition}: {len(new)} unseen entr{'y' if len(new) == 1 else 'ies'} "
                f"of epoch {self._epoch} at seq {seq}..{seq + len(new) - 1}",
                entries=new,
                duplicate_episode_ids=dup.intersection(entry.episode_ids),
            )

    # ----------------------------------------------------------- publishing
    def publish(self, entry: ShardEntry) -> bool:
        """Move a committed shard from staging to its published path (idempotent).

        Returns True if this call moved it, False if it was already published.
        Raises FileNotFoundError if neither file exists.
        """
        st = self.storage
        try:
            st.move(entry.staging_path, entry.path)
            return True
        except FileNotFoundError:
            if st.exists(entry.path):  # published meanwhile (e.g. by a recovering owner)
                return False
            raise FileNotFoundError(
                f"committed shard {entry.path} (seq {entry.seq}) has neither a published nor a staged file"
            ) from None

    def recover(self) -> int:
        """Roll forward: publish every committed shard whose published file is
        missing but whose staging file exists.  Returns how many were published.

        Committed shards with neither file are logged as errors (data loss, e.g.
        a manual delete or a gc grace period shorter than a commit took).
        """
        with self._lock:
            self.refresh()
            shards = self.shard_entries()
        if not shards:
            return 0
        dirs = {e.path.rsplit("/", 1)[0] if "/" in e.path else "" for e in shards}
        dirs |= {e.staging_path.rsplit("/", 1)[0] if "/" in e.staging_path else "" for e in shards}
        present: set[str] = set()
        for d in sorted(dirs):
            present.update(i.path for i in self.storage.list(d) if not i.is_dir)
        published = 0
        for e in shards:
            if e.path in present:
                continue
            if e.staging_path in present:
                if self.publish(e):
                    published += 1
                    log.info("%s/%d: rolled forward shard seq %d -> %s", self.topic, self.partition, e.seq, e.path)
            else:
                log.error(
                    "%s/%d: committed shard seq %d lost: neither %s nor %s exists",
                    self.topic,
                    self.partition,
                    e.seq,
                    e.path,
                    e.staging_path,
                )
        return published


def _read_many(fn: Any, items: Sequence[Any]) -> list[Any]:
    if len(items) <= 2:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(_READ_WORKERS, len(items))) as ex:
        return list(ex.map(fn, items))


# -------------------------------------------------------------- whole manifest


def read_partition_logs(storage: Storage) -> dict[tuple[str, int], list[Entry]]:
    """Every entry of every partition log: ``{(topic, partition): [entries in seq order]}``.

    One recursive listing plus one read per entry (in parallel).
    """
    keys: list[tuple[str, int, int, str]] = []
    for info in storage.list(MANIFEST_DIR, recursive=True):
        if info.is_dir:
            continue
        parts = info.path.split("/")
        if len(parts) != 4 or not _PART_RE.match(parts[2]) or not (m := _SEQ_RE.match(parts[3])):
            if not parts[-1].startswith("."):
                log.warning("ignoring unexpected file in the manifest: %s", info.path)
            continue
        keys.append((parts[1], int(parts[2]), int(m.group(1)), info.path))

    def read(k: tuple[str, int, int, str]) -> Entry:
        topic, partition, seq, path = k
        try:
            e = parse_entry(storage.read(path))
        except ManifestError as err:
            raise ManifestError(f"{storage.uri(path)}: {err}") from None
        if e.seq != seq or (isinstance(e, ShardEntry) and (e.topic, e.partition) != (topic, partition)):
            raise ManifestError(f"{storage.uri(path)}: entry does not match its path")
        return e

    out: dict[tuple[str, int], list[Entry]] = {}
    for k, e in zip(keys, _read_many(read, keys)):
        out.setdefault((k[0], k[1]), []).append(e)
    for (topic, partition), entries in out.items():
        entries.sort(key=lambda e: e.seq)
        if [e.seq for e in entries] != list(range(len(entries))):
            log.warning("manifest log %s/%05d has gaps", topic, partition)
    return out


def read_manifest(storage: Storage) -> list[ShardEntry]:
    """All committed shard entries of all topics/partitions, sorted by commit_time."""
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
