"""Manifest entries: the immutable JSON documents of a partition's manifest log.

Four entry types, each a frozen dataclass with ``to_json`` and strict parsing
(:func:`parse_entry` rejects unknown entry types, unknown or missing fields and
wrongly typed values with :class:`ManifestError`; never pickle):

* ``claim`` (:class:`ClaimEntry`) -- a writer takes the partition with epoch ``E``.
* ``shard`` (:class:`ShardEntry`) -- a shard of episodes is committed when its entry exists.
* ``snapshot`` (:class:`SnapshotEntry`) -- folds the log below it (the claim with the
  highest epoch, the entries since the previous snapshot, the committed shards not known
  to be published), so that a writer or reader starts from the newest snapshot instead of
  entry 0.  See docs/GUARANTEES.md, section 3.
* ``replace`` (:class:`ReplaceEntry`) -- compaction: one new shard file holds exactly the
  episodes of the shards it replaces, no data change.

Manifest format version (:data:`MANIFEST_FORMAT_VERSION`): an entry that needs a reader of
version 2 or later (a replace entry, a snapshot folding one) says so in its
``manifest_version`` field; an entry without it is version 1.  Version 3 adds the resume
position (a shard entry's ``resume_offset``, a claim's where ``--start-from latest`` put it,
folded by snapshots) and the writer's names in claims (``group``, ``deployment``): an entry
carrying any of them says ``"manifest_version": 3``. Version 4 adds the live set
(`rlrec.store.live_set`, ``"type": "live_set"``), kept beside a log, never in it.
A reader refuses an entry of a newer version, or of a type it does not know, with
:class:`UnsupportedManifestError`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MANIFEST_DIR",
    "MANIFEST_FORMAT_VERSION",
    "RESUME_FORMAT_VERSION",
    "ClaimEntry",
    "Entry",
    "LogEntry",
    "ManifestError",
    "ReplaceEntry",
    "ShardEntry",
    "SnapshotEntry",
    "UnsupportedManifestError",
    "check_shard_paths",
    "entry_path",
    "is_writer_name",
    "parse_entry",
]

MANIFEST_DIR = "_manifest"
# Kafka topic names: [a-zA-Z0-9._-], at most 249 characters; "." and ".." are invalid.
TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


#: the newest manifest format this code reads and writes (1: claim, shard, snapshot; 2: + replace;
#: 3: + a shard's resume position, a claim's group and deployment; 4: + live sets,
#: `rlrec.store.live_set`)
MANIFEST_FORMAT_VERSION = 4
#: the format version of entries that carry a resume position or a writer's names
RESUME_FORMAT_VERSION = 3
#: the largest Kafka offset (int64): an entry's offsets above it are refused, so a forged one
#: never reaches the Kafka client (which cannot hold it)
MAX_KAFKA_OFFSET = 2**63 - 1


class ManifestError(ValueError):
    """A manifest entry (or the log) is malformed: unknown type, bad fields, gaps."""


class UnsupportedManifestError(ManifestError):
    """The manifest holds an entry this rlrec cannot read (a newer manifest format version or an
    unknown entry type): upgrade rlrec.  Not a passing condition: a reader must stop, never skip."""

    #: a usage error for the command line (rlrec.errors): the installed rlrec is too old
    exit_code = 2


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
    """``{"type": "claim", "seq", "epoch", "writer", "time"[, "group", "deployment", "resume_offset"]}``.

    ``group`` and ``deployment`` (format 3, optional): the Kafka consumer group and the
    deployment name (``rlrec consume --deployment``, default the host) of the claiming writer,
    so that a claim can name another group writing the same partition log.
    ``resume_offset`` (format 3, optional): where a partition the log holds nothing of starts
    (``rlrec consume --start-from latest``, resolved to an offset when claimed), so that a
    restart or rebalance before its first shard starts there too, not at a later end.
    """

    epoch: int
    writer: str
    time: float = field(default_factory=time.time)
    group: str | None = None
    deployment: str | None = None
    resume_offset: int | None = None
    seq: int | None = None

    type = "claim"
    _REQUIRED = frozenset({"type", "seq", "epoch", "writer", "time"})
    _OPTIONAL = frozenset({"group", "deployment", "resume_offset", "manifest_version"})

    @property
    def manifest_version(self) -> int:
        """The manifest format a reader needs for this entry."""
        new = (self.group, self.deployment, self.resume_offset)
        return RESUME_FORMAT_VERSION if any(v is not None for v in new) else 1

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "type": "claim",
            "seq": self.seq,
            "epoch": self.epoch,
            "writer": self.writer,
            "time": self.time,
        }
        for k in ("group", "deployment", "resume_offset"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.manifest_version > 1:
            d["manifest_version"] = self.manifest_version
        return d

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
    to the time the entry object was made (Unix seconds).  ``steps_without_logp``
    (optional) maps each policy version of the shard (as a string) to the steps of its
    episodes that carry no ``action_logp`` extra model output (no behaviour
    propensity); None (the field absent): unknown, as in entries written before it.
    ``decoded_bytes`` (optional): what the file's columns decode to, as its Parquet footer
    states (the schema gate's measure); None (absent): unknown. Compaction records it for the
    shards it writes and plans by it (`rlrec.store.compaction`).
    ``resume_offset`` (optional, format 3): the Kafka offset its writer would commit for the
    partition once this entry exists -- never past the first event of an episode not committed
    by this or an earlier entry, nor past a dead letter the broker had not acknowledged. The
    largest one in a log is where the partition resumes (docs/GUARANTEES.md §8, "Replay");
    None (absent): the entry says nothing (a writer without Kafka, an older rlrec, a merged
    shard of a replace entry).
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
    steps_without_logp: dict[str, int] | None = None
    decoded_bytes: int | None = None
    resume_offset: int | None = None
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
    _OPTIONAL = frozenset({"writer", "steps_without_logp", "decoded_bytes", "resume_offset", "manifest_version"})

    @property
    def multi_agent(self) -> bool:
        """Whether this shard holds multi-agent rows (`episodes` format version 2, one row per
        agent episode: docs/FORMAT.md, "Multi-agent rows")."""
        from rlrec.store.schema_gate import MULTI_AGENT_SHARD_FORMAT_VERSION

        return self.format == "episodes" and self.format_version == MULTI_AGENT_SHARD_FORMAT_VERSION

    @property
    def manifest_version(self) -> int:
        """The manifest format a reader needs for this entry."""
        return RESUME_FORMAT_VERSION if self.resume_offset is not None else 1

    def __post_init__(self) -> None:
        if self.steps_without_logp is not None:
            object.__setattr__(self, "steps_without_logp", {str(k): v for k, v in self.steps_without_logp.items()})
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
        if d["decoded_bytes"] is None:
            del d["decoded_bytes"]
        if d["resume_offset"] is None:
            del d["resume_offset"]
        else:
            d["manifest_version"] = self.manifest_version
        if d["steps_without_logp"] is None:
            del d["steps_without_logp"]
        else:
            d["steps_without_logp"] = dict(self.steps_without_logp)
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


@dataclass(frozen=True, kw_only=True)
class ReplaceEntry:
    """Compaction: ``shard`` (one new file) replaces the shards of the entries ``replaces``
    (seqs of shard or replace entries of the same log), with no data change.

    ``{"type": "replace", "manifest_version": 2, "seq", "epoch", "writer", "time", "replaces":
    [seq, ...], "shard": {a shard entry with this entry's seq, epoch and writer}}``.  Rule (the
    log's per-episode id check, :func:`rlrec.store.log_shards.live_shards`): every replaced entry
    is live (not replaced before), and the new shard's episode ids are exactly the union of the
    replaced shards' ids -- the one case where a committed id is named again.  Build it without
    ``seq``/``epoch``/``writer``; :meth:`PartitionLog.append_replace` fills them in.
    """

    replaces: tuple[int, ...]
    shard: ShardEntry
    time: float = field(default_factory=time.time)
    writer: str | None = None
    epoch: int = -1
    seq: int | None = None

    type = "replace"
    _REQUIRED = frozenset({"type", "manifest_version", "seq", "epoch", "writer", "time", "replaces", "shard"})

    def __post_init__(self) -> None:
        if not isinstance(self.replaces, tuple):
            object.__setattr__(self, "replaces", tuple(self.replaces))

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "replace",
            "manifest_version": 2,
            "seq": self.seq,
            "epoch": self.epoch,
            "writer": self.writer,
            "time": self.time,
            "replaces": list(self.replaces),
            "shard": self.shard.to_dict(),
        }

    def to_json(self) -> str:
        d = self.to_dict()
        _validate_replace(d)
        return _dumps(d)

    def with_commit(self, *, seq: int, epoch: int, writer: str | None) -> ReplaceEntry:
        return dataclasses.replace(
            self, seq=seq, epoch=epoch, writer=writer, shard=self.shard.with_commit(seq=seq, epoch=epoch, writer=writer)
        )


@dataclass(frozen=True, kw_only=True)
class SnapshotEntry:
    """Folds the log below it, so that nobody has to read the log from entry 0.

    A snapshot at ``seq`` is a pure summary of the entries ``< seq`` (its writer has read
    them all, rule R1) plus what its writer knew about publication:

    * ``entries``: every claim and shard entry ``folded_from .. seq-1``, unchanged (the
      *segment*); ``prev`` is the seq of the previous snapshot (None: none).  Entries
      between ``prev`` (or 0) and ``folded_from`` are *unfolded*: readers read them
      one by one (a log written before snapshots existed, a segment past ``MAX_SEGMENT``,
      or entries a snapshot under ``MAX_ENTRY_BYTES`` could not hold);
    * ``last_claim``: the claim with the highest epoch below ``seq`` (fencing);
    * ``max_last_offset`` / ``below_max_last_offset``: the largest ``last_offset`` of
      the shard entries below ``seq`` / below ``folded_from`` (-1: none), so that a claim
      replaying from Kafka offset ``C`` knows where to stop looking for committed ids;
    * ``unpublished``: committed shard entries below ``seq`` not known to be published;
    * ``resume_offset`` (format 3, optional): the largest ``resume_offset`` of the shard and
      claim entries below ``seq`` (None: none carries one), where the partition resumes.

    The folded entries stay on storage, unchanged: a snapshot adds a shortcut, it
    never replaces the record (``verify`` compares the two).
    """

    epoch: int
    writer: str
    prev: int | None
    folded_from: int
    entries: tuple[ClaimEntry | ShardEntry | ReplaceEntry, ...]
    last_claim: ClaimEntry
    max_last_offset: int
    below_max_last_offset: int
    unpublished: tuple[ShardEntry, ...] = ()
    resume_offset: int | None = None
    time: float = field(default_factory=time.time)
    seq: int | None = None

    type = "snapshot"
    _REQUIRED = frozenset(
        {
            "type",
            "seq",
            "epoch",
            "writer",
            "time",
            "prev",
            "folded_from",
            "entries",
            "last_claim",
            "max_last_offset",
            "below_max_last_offset",
            "unpublished",
        }
    )

    def __post_init__(self) -> None:
        for k in ("entries", "unpublished"):
            if not isinstance(getattr(self, k), tuple):
                object.__setattr__(self, k, tuple(getattr(self, k)))

    def to_dict(self) -> dict[str, Any]:
        d = {
            "type": "snapshot",
            "seq": self.seq,
            "epoch": self.epoch,
            "writer": self.writer,
            "time": self.time,
            "prev": self.prev,
            "folded_from": self.folded_from,
            "entries": [e.to_dict() for e in self.entries],
            "last_claim": self.last_claim.to_dict(),
            "max_last_offset": self.max_last_offset,
            "below_max_last_offset": self.below_max_last_offset,
            "unpublished": [e.to_dict() for e in self.unpublished],
        }
        if self.resume_offset is not None:
            d["resume_offset"] = self.resume_offset
        if self.manifest_version > 1:  # older readers must refuse it, not misread the segment
            d["manifest_version"] = self.manifest_version
        return d

    @property
    def manifest_version(self) -> int:
        """The manifest format a reader needs for this entry: the newest of what it holds."""
        held = [*self.entries, self.last_claim, *self.unpublished]
        own = RESUME_FORMAT_VERSION if self.resume_offset is not None else 1
        return max([own, *(2 if isinstance(e, ReplaceEntry) else e.manifest_version for e in held)])

    def to_json(self) -> str:
        d = self.to_dict()
        _validate_snapshot(d)
        return _dumps(d)

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, Any]) -> SnapshotEntry:
        e = parse_entry(data)
        if not isinstance(e, SnapshotEntry):
            raise ManifestError(f"expected a snapshot entry, got {e.type!r}")
        return e

    def shards(self) -> list[ShardEntry]:
        """The shard entries of the segment."""
        return [e for e in self.entries if isinstance(e, ShardEntry)]


#: what a snapshot folds: claims, shard and replace entries
LogEntry = ClaimEntry | ShardEntry | ReplaceEntry
Entry = ClaimEntry | ShardEntry | SnapshotEntry | ReplaceEntry


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
    _check_keys(d, set(ClaimEntry._REQUIRED), set(ClaimEntry._OPTIONAL), "claim")
    _validate_common(d)
    if not _check_type(d, "writer", (str,)):
        raise ManifestError("field 'writer' must not be empty")
    _check_type(d, "time", (int, float))
    names = [k for k in ("group", "deployment") if k in d]
    for k in names:
        if not is_writer_name(_check_type(d, k, (str,))):
            raise ManifestError(f"field {k!r} must be 1-255 printable characters")
    if "resume_offset" in d:
        _check_offset(d, "resume_offset")
    _check_declared(d, RESUME_FORMAT_VERSION if names or "resume_offset" in d else 1, "claim")


def _check_offset(d: Mapping[str, Any], key: str, lo: int = 0) -> int:
    """A Kafka offset field: an int from `lo` to `MAX_KAFKA_OFFSET`."""
    v = _check_type(d, key, (int,))
    if not lo <= v <= MAX_KAFKA_OFFSET:
        raise ManifestError(f"field {key!r} must be a Kafka offset ({lo} to 2**63-1), got {str(v)[:40]}")
    return v


def is_writer_name(v: str) -> bool:
    """Whether `v` can name a writer's group or deployment in a claim: 1-255 printable
    characters (no tab, no newline).

    Example:
        >>> is_writer_name("rlrec-consumer"), is_writer_name("a\tb"), is_writer_name("x" * 256)
        (True, False, False)
    """
    return 0 < len(v) <= 255 and v.isprintable()


def _check_declared(d: Mapping[str, Any], needed: int, what: str) -> None:
    """An entry declares (``manifest_version``) at least the format its fields need, so that an
    older reader refuses it as too new instead of misreading it; never more than that."""
    if d.get("manifest_version", 1) != needed:
        raise ManifestError(
            f"{what} entry: its fields need manifest_version {needed}, it says {d.get('manifest_version', 1)}"
        )


def check_shard_paths(d: Mapping[str, Any]) -> None:
    """A shard's files are ``{policy_id}/{name}`` and ``{policy_id}/_staging/{name}``, the
    policy id one safe path component: an entry can name no other file (a log entry, another
    policy's shard) for `PartitionLog.recover` or gc to move or keep."""
    from rlrec.producer.events import POLICY_ID_RE

    policy, path = d["policy_id"], d["path"]
    name = path.rsplit("/", 1)[-1]
    if not POLICY_ID_RE.match(policy):
        raise ManifestError(f"field 'policy_id': not a valid policy id: {policy[:40]!r}")
    if name.startswith(("_", ".")) or path != f"{policy}/{name}" or d["staging_path"] != f"{policy}/_staging/{name}":
        raise ManifestError(
            "fields 'path' and 'staging_path' must be '{policy_id}/{name}' and '{policy_id}/_staging/{name}'"
        )


def _validate_shard(d: Mapping[str, Any], *, ids: bool = True) -> None:
    """Check a shard document; ``ids=False``: one without ``episode_ids`` (a live set's row)."""
    if not ids:
        _check_keys(d, set(ShardEntry._REQUIRED) - {"episode_ids"}, set(ShardEntry._OPTIONAL), "live shard")
        _validate_shard_fields(d)
        return
    _check_keys(d, set(ShardEntry._REQUIRED), set(ShardEntry._OPTIONAL), "shard")
    _validate_shard_fields(d)
    ids_ = _check_type(d, "episode_ids", (list, tuple))
    if not all(isinstance(i, str) and i for i in ids_):
        raise ManifestError("field 'episode_ids' must be a list of non-empty strings")
    if len(set(ids_)) != len(ids_):
        raise ManifestError("field 'episode_ids' has duplicates")
    if len(ids_) != d["episodes"]:
        raise ManifestError(f"field 'episodes' ({d['episodes']}) != len(episode_ids) ({len(ids_)})")


def _validate_shard_fields(d: Mapping[str, Any]) -> None:
    _validate_common(d)
    for k in ("path", "staging_path"):
        _check_rel_path(k, _check_type(d, k, (str,)))
    if d["path"] == d["staging_path"]:
        raise ManifestError("fields 'path' and 'staging_path' must differ")
    if not TOPIC_RE.match(_check_type(d, "topic", (str,))) or d["topic"] in (".", ".."):
        raise ManifestError(f"field 'topic': not a valid topic name: {d['topic']!r}")
    for k in ("partition", "first_offset", "last_offset", "episodes", "steps", "bytes", "format_version"):
        if _check_type(d, k, (int,)) < 0:
            raise ManifestError(f"field {k!r} must be >= 0, got {d[k]}")
    for k in ("first_offset", "last_offset"):
        _check_offset(d, k)
    if d["first_offset"] > d["last_offset"]:
        raise ManifestError(f"first_offset {d['first_offset']} > last_offset {d['last_offset']}")
    if not _check_type(d, "policy_id", (str,)):
        raise ManifestError("field 'policy_id' must not be empty")
    check_shard_paths(d)
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
    if "steps_without_logp" in d:
        counts = _check_type(d, "steps_without_logp", (dict,), nullable=True) or {}
        if not all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in counts.items()):
            raise ManifestError("field 'steps_without_logp' must map policy versions (strings) to step counts >= 0")
    if "decoded_bytes" in d and (_check_type(d, "decoded_bytes", (int,), nullable=True) or 0) < 0:
        raise ManifestError(f"field 'decoded_bytes' must be >= 0, got {d['decoded_bytes']}")
    if "resume_offset" in d:
        _check_offset(d, "resume_offset")
    _check_declared(d, RESUME_FORMAT_VERSION if "resume_offset" in d else 1, "shard")


def _validate_replace(d: Mapping[str, Any]) -> ShardEntry:
    """Check a replace document; returns its parsed shard."""
    _check_keys(d, set(ReplaceEntry._REQUIRED), set(), "replace")
    _validate_common(d)
    seq = d["seq"]
    if not _check_type(d, "writer", (str,)):
        raise ManifestError("field 'writer' must not be empty")
    _check_type(d, "time", (int, float))
    replaces = _check_type(d, "replaces", (list, tuple))
    if not replaces or not all(type(r) is int and 0 <= r < seq for r in replaces):
        raise ManifestError(f"replace {seq}: 'replaces' must be a non-empty list of seqs below it")
    if list(replaces) != sorted(set(replaces)):
        raise ManifestError(f"replace {seq}: 'replaces' must be distinct and ascending")
    shard = d["shard"]
    if not isinstance(shard, Mapping) or shard.get("type") != "shard":
        raise ManifestError(f"replace {seq}: 'shard' must be a shard entry")
    parsed = parse_entry(shard)
    if (parsed.seq, parsed.epoch, parsed.writer) != (seq, d["epoch"], d["writer"]):
        raise ManifestError(f"replace {seq}: its shard must carry the entry's seq, epoch and writer")
    if parsed.resume_offset is not None:
        raise ManifestError(f"replace {seq}: a merged shard never moves the resume position (no resume_offset)")
    return parsed  # type: ignore[return-value]


def _validate_snapshot(
    d: Mapping[str, Any],
) -> tuple[list[ClaimEntry | ShardEntry | ReplaceEntry], ClaimEntry, list[ShardEntry]]:
    """Check a snapshot document; returns its parsed (entries, last_claim, unpublished)."""
    _check_keys(d, set(SnapshotEntry._REQUIRED), {"manifest_version", "resume_offset"}, "snapshot")
    _validate_common(d)
    seq = d["seq"]
    if not _check_type(d, "writer", (str,)):
        raise ManifestError("field 'writer' must not be empty")
    _check_type(d, "time", (int, float))
    prev = _check_type(d, "prev", (int,), nullable=True)
    folded_from = _check_type(d, "folded_from", (int,))
    if not 0 <= folded_from <= seq or (prev is not None and not 0 <= prev < folded_from):
        raise ManifestError(f"snapshot {seq}: need 0 <= prev < folded_from <= seq, got {prev}, {folded_from}")
    entries = _check_type(d, "entries", (list, tuple))
    if len(entries) != seq - folded_from:
        raise ManifestError(f"snapshot {seq}: folds {len(entries)} entries, expected {seq - folded_from}")
    parsed = [_parse_folded(x, f"snapshot {seq} entry") for x in entries]
    if [e.seq for e in parsed] != list(range(folded_from, seq)):
        raise ManifestError(f"snapshot {seq}: folded entries are not seq {folded_from}..{seq - 1}")
    last_claim = _parse_folded(d["last_claim"], f"snapshot {seq} last_claim")
    if not isinstance(last_claim, ClaimEntry) or last_claim.seq >= seq:
        raise ManifestError(f"snapshot {seq}: last_claim must be a claim below it")
    if d["epoch"] > last_claim.epoch or any(e.epoch > last_claim.epoch for e in parsed):
        raise ManifestError(f"snapshot {seq}: an epoch above last_claim's {last_claim.epoch}")
    top = _check_offset(d, "max_last_offset", lo=-1)
    below = _check_offset(d, "below_max_last_offset", lo=-1)
    if below < -1 or top != max([below, *(e.last_offset for e in parsed if isinstance(e, ShardEntry))]):
        raise ManifestError(f"snapshot {seq}: max_last_offset {top} does not match its entries")
    unpublished = [_parse_folded(x, f"snapshot {seq} unpublished") for x in _check_type(d, "unpublished", (list,))]
    useqs = [e.seq for e in unpublished]
    if not all(isinstance(e, ShardEntry) for e in unpublished) or len(set(useqs)) != len(useqs):
        raise ManifestError(f"snapshot {seq}: unpublished must be distinct shard entries")
    if any(s >= seq for s in useqs):
        raise ManifestError(f"snapshot {seq}: unpublished entries must be below it")
    folded = [
        e.resume_offset
        for e in [*parsed, last_claim]
        if isinstance(e, (ShardEntry, ClaimEntry)) and e.resume_offset is not None
    ]
    if "resume_offset" in d:
        if _check_offset(d, "resume_offset") < max([0, *folded]):
            raise ManifestError(f"snapshot {seq}: resume_offset below a folded entry's")
    elif folded:
        raise ManifestError(f"snapshot {seq}: folds entries with a resume_offset but has none")
    held = [*parsed, last_claim, *unpublished]
    needed = max(
        [RESUME_FORMAT_VERSION if "resume_offset" in d else 1]
        + [2 if isinstance(e, ReplaceEntry) else e.manifest_version for e in held]  # type: ignore[union-attr]
    )
    _check_declared(d, needed, "snapshot")
    return parsed, last_claim, unpublished  # type: ignore[return-value]


def _parse_folded(x: Any, what: str) -> ClaimEntry | ShardEntry | ReplaceEntry:
    if not isinstance(x, Mapping):
        raise ManifestError(f"{what}: expected an object")
    if x.get("type") not in ("claim", "shard", "replace"):
        _check_version(x)
        raise ManifestError(f"{what}: a snapshot folds claim, shard and replace entries only, got {x.get('type')!r}")
    return parse_entry(x)  # type: ignore[return-value]


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
    _check_version(d)
    kind = d.get("type")
    if kind == "claim":
        _validate_claim(d)
        return ClaimEntry(
            seq=d["seq"],
            epoch=d["epoch"],
            writer=d["writer"],
            time=float(d["time"]),
            group=d.get("group"),
            deployment=d.get("deployment"),
            resume_offset=d.get("resume_offset"),
        )
    if kind == "shard":
        _validate_shard(d)
        kw = {k: d[k] for k in d if k not in ("type", "manifest_version")}
        kw["commit_time"] = float(kw["commit_time"])
        return ShardEntry(**kw)
    if kind == "snapshot":
        entries, last_claim, unpublished = _validate_snapshot(d)
        return SnapshotEntry(
            seq=d["seq"],
            epoch=d["epoch"],
            writer=d["writer"],
            time=float(d["time"]),
            prev=d["prev"],
            folded_from=d["folded_from"],
            entries=tuple(entries),
            last_claim=last_claim,
            max_last_offset=d["max_last_offset"],
            below_max_last_offset=d["below_max_last_offset"],
            unpublished=tuple(unpublished),
            resume_offset=d.get("resume_offset"),
        )
    if kind == "replace":
        shard = _validate_replace(d)
        return ReplaceEntry(
            seq=d["seq"],
            epoch=d["epoch"],
            writer=d["writer"],
            time=float(d["time"]),
            replaces=tuple(d["replaces"]),
            shard=shard,
        )
    if not isinstance(kind, str) or not kind:
        raise ManifestError(f"manifest entry type must be a non-empty string, got {_short(kind)!r}")
    raise UnsupportedManifestError(
        f"unknown manifest entry type {_short(kind)!r}: written by a newer rlrec? (this one reads manifest "
        f"format version {MANIFEST_FORMAT_VERSION}); upgrade rlrec"
    )


def _check_version(d: Mapping[str, Any]) -> None:
    v = d.get("manifest_version", 1)
    if type(v) is not int or v < 1:
        raise ManifestError(f"field 'manifest_version' must be an int >= 1, got {_short(v)!r}")
    if v > MANIFEST_FORMAT_VERSION:
        raise UnsupportedManifestError(
            f"manifest entry of format version {v}: this rlrec reads manifest format version "
            f"{MANIFEST_FORMAT_VERSION} and older; upgrade rlrec to read this store"
        )


def _short(x: Any, n: int = 40) -> str:
    s = str(x)
    return s if len(s) <= n else s[: n - 3] + "..."


def entry_path(topic: str, partition: int, seq: int) -> str:
    """``_manifest/{topic}/{partition:05d}/{seq:012d}.json``."""
    return f"{MANIFEST_DIR}/{topic}/{int(partition):05d}/{int(seq):012d}.json"
