"""Retention: removing replaced and expired shard files, recorded in a store-wide removal log.

Only a partition's owner appends to its manifest log, so retention never does. It keeps its own
log beside the partition logs, which any process may append to::

    _manifest/_removed/{n:08d}.json   removal records n = 0, 1, 2, ... (create-once, never changed)

A record (`RemovalRecord`) says when it was created (``time``), how long the files stay
after that (``grace_s``), the point of the manifest it decided at (``positions``: per partition
log, the entries it had read; a point counts the record only at or above those positions,
`rlrec.store.snapshot.counted_records`) and the shard files it removes (`RemovedFile`: the manifest paths,
the (topic, partition, seq) of the entry that committed each, and why: ``replaced`` -- not a
live shard at that point, compaction merged it -- or ``expired`` -- a live shard whose every
episode was first committed longer ago than the retention age). A record names at most
`MAX_FILES_PER_RECORD` files (a big removal is several records; the shards of one multi-agent
episode are named by one record, `rlrec.store.retention_episodes.episode_groups`).

`retain` runs the three steps of ``rlrec retain`` (docs/GUARANTEES.md, "Retention"):

1. read the removal log, then every partition log: at its head where its live set has
   retention columns (`rlrec.store.retention_heads`: candidates confirmed from the entries),
   else its history (`plan_removals` decides from those);
2. append the new removals as records (`append_removals`; a process that loses the create-once
   race for record ``n`` reads it, drops the files it already names and tries ``n + 1``);
3. delete the files of every record older than its grace (`delete_due`, through
   `rlrec.store.deletion.delete_files`, the deletion path gc uses): the published and the
   staging path of each, missing files skipped, so a re-run after a kill finishes the job.

A record is data, hence hostile: parsed strictly (`parse_record`), its paths must be those a
shard entry may name (``{policy_id}/{name}``, ``{policy_id}/_staging/{name}``), and a file is
acted on -- deleted, or left out of a reader's point -- only where the manifest entry it names
(topic, partition, seq) holds exactly that shard file (`resolve_removals`).

Readers (`rlrec.store.snapshot.open_snapshot`) read the removal log before the partition logs.

Example:
    >>> import tempfile
    >>> from rlrec.store.commit import ShardCommitter
    >>> from rlrec.store.compaction import compact_partition
    >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
    >>> root = tempfile.mkdtemp()
    >>> c = ShardCommitter(root, "rl", 0)
    >>> for i in range(2):
    ...     _ = c.commit(expert_cartpole_episodes(2, seed=i))
    >>> _ = compact_partition(c.log, min_age_s=0)
    >>> res = retain(c.storage, grace_s=0)   # record the 2 replaced files, then delete them
    >>> [f.reason for f in res.recorded], len(res.deleted)
    (['replaced', 'replaced'], 2)
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import re
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlrec.store.deletion import delete_files
from rlrec.store.manifest import (
    MANIFEST_DIR,
    REMOVED_LOG,
    Entry,
    ManifestError,
    PartitionLog,
    ReplaceEntry,
    ShardEntry,
    list_partition_logs,
    live_holders,
    live_shards,
    shard_files,
)
from rlrec.store.manifest_entries import TOPIC_RE, check_shard_paths
from rlrec.store.reader_leases import live_holds
from rlrec.store.retention_episodes import IdsOf, episode_groups, multi_agent_ids, whole_episodes
from rlrec.store.storage import Storage

__all__ = [
    "DEFAULT_GRACE_S",
    "MAX_FILES_PER_RECORD",
    "REMOVED_DIR",
    "PinSource",
    "PinnedEntries",
    "RemovalLogView",
    "RemovalRecord",
    "RemovedFile",
    "RetainResult",
    "append_removals",
    "delete_due",
    "fitting",
    "parse_record",
    "pinned_live_shards",
    "plan_removals",
    "read_removals",
    "record_path",
    "removed_keys",
    "resolve_removals",
    "retain",
]

log = logging.getLogger("rlrec.retention")

#: the removal log's directory (beside the partition logs; its files are no partition directory)
REMOVED_DIR = f"{MANIFEST_DIR}/{REMOVED_LOG}"
#: files named by one record at most (a bigger removal is split across records)
MAX_FILES_PER_RECORD = 1000
#: a record's size at most when read (a larger one is refused: ManifestError)
MAX_RECORD_BYTES = 1024 * 1024
#: how long removed files stay by default after their record (readers of older points read them)
DEFAULT_GRACE_S = 3600.0
REASONS = ("replaced", "expired")
_RECORD_RE = re.compile(r"^(\d{8})\.json$")
_KEY_RE = re.compile(r"^([A-Za-z0-9._-]{1,249})/(\d{1,5})$")


def record_path(n: int) -> str:
    """The path of removal record `n` (relative to the output root)."""
    return f"{REMOVED_DIR}/{n:08d}.json"


@dataclass(frozen=True)
class RemovedFile:
    """One shard removed by retention: its files and the manifest entry that committed it.

    Attributes:
        topic, partition, seq: the entry (a shard entry, or a replace entry for a merged shard).
        path, staging_path: the shard's published and staging paths (both are deleted).
        reason: ``replaced`` or ``expired``.
    """

    topic: str
    partition: int
    seq: int
    path: str
    staging_path: str
    reason: str

    @property
    def key(self) -> tuple[str, int, int]:
        """(topic, partition, seq) of the entry that committed the shard."""
        return (self.topic, self.partition, self.seq)

    def to_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "seq": self.seq,
            "path": self.path,
            "staging_path": self.staging_path,
            "reason": self.reason,
        }

    @classmethod
    def of(cls, shard: ShardEntry, reason: str) -> RemovedFile:
        return cls(shard.topic, shard.partition, int(shard.seq), shard.path, shard.staging_path, reason)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RemovalRecord:
    """One record of the removal log (module docstring; docs/FORMAT.md, "Removal log").

    Attributes:
        n: its number (its file is `record_path(n)`).
        time: when the record was created (UNIX seconds, stamped right before its create-once
            by the retaining host's clock; the start of its grace).
        grace_s: the files stay at least this long after `time`.
        positions: the point retention decided at: entries read per (topic, partition).
        files: the shards removed.
    """

    n: int
    time: float
    grace_s: float
    positions: Mapping[tuple[str, int], int]
    files: tuple[RemovedFile, ...] = field(default_factory=tuple)

    @property
    def deletable_at(self) -> float:
        """When its files may be deleted (and points before it stop reading them)."""
        return self.time + self.grace_s

    def to_json(self) -> str:
        doc = {
            "type": "removal",
            "version": 1,
            "n": self.n,
            "time": self.time,
            "grace_s": self.grace_s,
            "positions": {f"{t}/{p}": k for (t, p), k in sorted(self.positions.items())},
            "files": [f.to_dict() for f in self.files],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))


# ------------------------------------------------------------------------------ parsing


def _int(v: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise ManifestError(f"{what}: expected an integer >= {lo}, got {str(v)[:40]!r}")
    return v


def _num(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ManifestError(f"{what}: expected a finite number >= 0, got {str(v)[:40]!r}")
    return float(v)


def _keys(d: Any, keys: set[str], what: str) -> None:
    if not isinstance(d, dict):
        raise ManifestError(f"{what}: expected an object")
    if set(d) != keys:
        raise ManifestError(f"{what}: fields {sorted(d)[:10]} are not {sorted(keys)}")


def _parse_file(d: Any, i: int) -> RemovedFile:
    what = f"files[{i}]"
    _keys(d, {"topic", "partition", "seq", "path", "staging_path", "reason"}, what)
    topic = d["topic"]
    if not isinstance(topic, str) or not TOPIC_RE.match(topic) or topic in (".", ".."):
        raise ManifestError(f"{what}: not a topic name: {str(topic)[:40]!r}")
    if d["reason"] not in REASONS:
        raise ManifestError(f"{what}: reason must be one of {list(REASONS)}")
    path, staging = d["path"], d["staging_path"]
    if not isinstance(path, str) or not isinstance(staging, str):
        raise ManifestError(f"{what}: path and staging_path must be strings")
    try:  # the paths a shard entry may name, nothing else (never _manifest/, never outside the root)
        check_shard_paths({"policy_id": path.split("/", 1)[0], "path": path, "staging_path": staging})
    except ManifestError as e:
        raise ManifestError(f"{what}: {e}") from None
    return RemovedFile(
        topic,
        _int(d["partition"], f"{what}.partition", 0, 99999),
        _int(d["seq"], f"{what}.seq"),
        path,
        staging,
        d["reason"],
    )


def parse_record(data: bytes, n: int) -> RemovalRecord:
    """Removal record `n` from its stored bytes, strictly (ManifestError on anything else: a
    wrong type, a missing or unknown field, a path no shard entry may name, another ``n``)."""
    if len(data) > MAX_RECORD_BYTES:
        raise ManifestError(f"removal record {n}: more than {MAX_RECORD_BYTES} bytes (MAX_RECORD_BYTES)")
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"removal record {n}: not JSON ({e})") from None
    _keys(d, {"type", "version", "n", "time", "grace_s", "positions", "files"}, f"removal record {n}")
    if d["type"] != "removal" or d["version"] != 1:
        raise ManifestError(f"removal record {n}: not a version 1 removal record (upgrade rlrec?)")
    if _int(d["n"], "n") != n:
        raise ManifestError(f"removal record {n}: says n={d['n']}")
    positions: dict[tuple[str, int], int] = {}
    if not isinstance(d["positions"], dict):
        raise ManifestError(f"removal record {n}: positions must be an object")
    for k, v in d["positions"].items():
        m = _KEY_RE.match(k)
        if not m or m.group(1) in (".", ".."):
            raise ManifestError(f"removal record {n}: positions: not TOPIC/PARTITION: {k[:40]!r}")
        positions[(m.group(1), int(m.group(2)))] = _int(v, f"removal record {n}: positions[{k[:40]!r}]")
    files = d["files"]
    if not isinstance(files, list) or len(files) > MAX_FILES_PER_RECORD:
        raise ManifestError(f"removal record {n}: files must be a list of at most {MAX_FILES_PER_RECORD}")
    try:
        parsed = tuple(_parse_file(f, i) for i, f in enumerate(files))
    except ManifestError as e:
        raise ManifestError(f"removal record {n}: {e}") from None
    for f in parsed:
        if (f.topic, f.partition) not in positions or f.seq >= positions[(f.topic, f.partition)]:
            raise ManifestError(f"removal record {n}: {f.path} is not below the record's positions")
    return RemovalRecord(n, _num(d["time"], "time"), _num(d["grace_s"], "grace_s"), positions, parsed)


def read_removals(storage: Storage, start: int = 0, *, strict: bool = True) -> list[RemovalRecord]:
    """The removal log's records numbered `start` and above, in order: one listing, one read
    per record (ManifestError: a malformed record; with `strict` False it is logged as an error
    and left out)."""
    nums = sorted(
        int(m.group(1))
        for i in storage.list(REMOVED_DIR)
        if not i.is_dir and (m := _RECORD_RE.match(i.name)) and int(m.group(1)) >= start
    )
    out = []
    for n in nums:
        try:
            data = storage.read(record_path(n), limit=MAX_RECORD_BYTES)
        except FileNotFoundError:
            continue
        try:
            out.append(parse_record(data, n))
        except ManifestError as e:
            if strict:
                raise
            log.error("ignoring a malformed removal record %s: %s", storage.uri(record_path(n)), e)
    return out


class RemovalLogView:
    """A reader of the removal log kept between calls: `refresh` reads only the records appended
    since (one read per new record and one probe for the next number). Records past a gap (a
    pruned or lost record) are found by listing the log, as `read_removals` reads them: on the
    first call, and then at most every `list_interval_s` when the probe misses (a poll of an idle
    store costs one probe, not a listing).

    What it says is resolved the way readers resolve records (`resolve_removals`): `seqs` counts a
    record's file only where the entry it names commits exactly that file (path and staging path).

    Example:
        >>> import tempfile
        >>> from rlrec.store.storage import Storage
        >>> view = RemovalLogView(Storage.from_uri(tempfile.mkdtemp()))
        >>> view.refresh(), view.seqs("rl", 0, [])
        ([], set())
    """

    def __init__(self, storage: Storage, list_interval_s: float = 60.0, start: int = 0) -> None:
        self.storage = storage
        self.list_interval_s = list_interval_s
        self._listed_at: float | None = None  # monotonic time of the last listing
        self.records: list[RemovalRecord] = []
        self._next = start  # the next record number to probe (`start`: the records below are not read)
        # per log: seqs resolved against its entries, and those named but not resolved yet
        self._resolved: dict[tuple[str, int], set[int]] = {}
        self._pending: dict[tuple[str, int], dict[int, list[tuple[RemovalRecord, RemovedFile]]]] = {}

    def refresh(self) -> list[RemovalRecord]:
        """The records appended since the last call, in order (ManifestError: a malformed one)."""
        new: list[RemovalRecord] = []
        listed = False
        while True:
            try:
                data = self.storage.read(record_path(self._next), limit=MAX_RECORD_BYTES)
                self._add(parse_record(data, self._next), new)
                continue
            except FileNotFoundError:
                now = time.monotonic()
                if listed or (self._listed_at is not None and now - self._listed_at < self.list_interval_s):
                    return new
            listed = True  # one listing per call: the records past a gap, as read_removals reads them
            self._listed_at = now
            later = read_removals(self.storage, start=self._next + 1)
            if not later:
                return new
            for rec in later:
                self._add(rec, new)

    def _add(self, rec: RemovalRecord, new: list[RemovalRecord]) -> None:
        self.records.append(rec)
        new.append(rec)
        self._next = rec.n + 1
        for f in rec.files:
            self._pending.setdefault((f.topic, f.partition), {}).setdefault(f.seq, []).append((rec, f))

    def forget_below(self, topic: str, partition: int, seq: int) -> None:
        """Stop resolving the records' files that name entries of log (topic, partition) below
        `seq` (a reader that started from the log's head there: it has seen them)."""
        pending = self._pending.get((topic, partition))
        for q in [q for q in pending or () if q < seq]:
            del pending[q]  # type: ignore[index]

    def seqs(self, topic: str, partition: int, entries: Sequence[Entry]) -> set[int]:
        """The seqs of the entries of log (topic, partition) whose shard files the records read so
        far remove: where the entry at the seq a record names commits exactly the file it names.

        Args:
            topic, partition: the log.
            entries: its entries in memory, in seq order (a reader's `PartitionLog.entries`); a
                record naming a seq past them is resolved by a later call.
        """
        key = (topic, partition)
        done = self._resolved.setdefault(key, set())
        pending = self._pending.get(key)
        if pending:
            for seq in [s for s in pending if s not in done]:
                i = bisect.bisect_left(entries, seq, key=lambda e: e.seq)  # type: ignore[arg-type,return-value]
                if i == len(entries) or entries[i].seq != seq:
                    continue  # not read yet (or held by a writer's log only since its snapshot)
                s = _shard_of(entries[i])
                for rec, f in pending.pop(seq):
                    if s is not None and (s.path, s.staging_path) == (f.path, f.staging_path):
                        done.add(seq)
                    else:
                        _warn_unmatched(rec, f)
        return set(done)


def _shard_of(e: Entry | None) -> ShardEntry | None:
    """The shard file entry `e` commits (a shard entry's, a replace entry's merged shard), if any."""
    if isinstance(e, ShardEntry):
        return e
    if isinstance(e, ReplaceEntry):
        return e.shard
    return None


def _warn_unmatched(rec: RemovalRecord, f: RemovedFile) -> None:
    log.warning(
        "removal record %d names %s as %s/%d seq %d, which commits no such file: ignored",
        rec.n,
        f.path,
        f.topic,
        f.partition,
        f.seq,
    )


def resolve_removals(
    records: Iterable[RemovalRecord], logs: Mapping[tuple[str, int], Sequence[Entry]]
) -> dict[tuple[str, int, int], tuple[RemovalRecord, RemovedFile]]:
    """``{(topic, partition, seq): (the first record naming it, its file)}`` for the removed files
    whose manifest entry (in `logs`, every entry of each log) commits exactly that file; a file
    of a record that names no such entry is logged and left out (never deleted, never hidden)."""
    by_seq: dict[tuple[str, int], dict[int, Entry]] = {}
    out: dict[tuple[str, int, int], tuple[RemovalRecord, RemovedFile]] = {}
    for rec in records:
        for f in rec.files:
            if f.key in out:
                continue
            k = (f.topic, f.partition)
            if k not in by_seq:
                by_seq[k] = {e.seq: e for e in logs.get(k, ())}  # type: ignore[misc]
            s = _shard_of(by_seq[k].get(f.seq))
            if s is None or (s.path, s.staging_path) != (f.path, f.staging_path):
                _warn_unmatched(rec, f)
                continue
            out[f.key] = (rec, f)
    return out


def removed_keys(storage: Storage, logs: Mapping[tuple[str, int], Sequence[Entry]]) -> set[tuple[str, int, int]]:
    """(topic, partition, seq) of every shard retention removed or is removing (`logs`: every
    entry of each partition log, read after the removal log)."""
    return set(resolve_removals(read_removals(storage), logs))


# ------------------------------------------------------------------------------ planning


#: shard entries pinned by identity: per partition log, sorted disjoint half-open seq ranges
PinnedEntries = Mapping[tuple[str, int], Sequence[tuple[int, int]]]


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Half-open ``(start, end)`` ranges as sorted, disjoint, non-empty ranges covering the same seqs.

    Example:
        >>> merge_ranges([(5, 9), (1, 3), (2, 4), (4, 4), (9, 10)])
        [(1, 4), (5, 10)]
    """
    out: list[tuple[int, int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges):
        if a >= b:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _in_ranges(seq: int, ranges: Sequence[tuple[int, int]]) -> bool:
    """`seq` in one of `ranges` (sorted and disjoint: `merge_ranges`)."""
    i = bisect.bisect_right(ranges, (seq, math.inf)) - 1
    return i >= 0 and ranges[i][0] <= seq < ranges[i][1]


def pinned_live_shards(
    logs: Mapping[tuple[str, int], Sequence[Entry]], pinned_entries: PinnedEntries
) -> dict[tuple[str, int, int], ShardEntry]:
    """The live shards (at the newest point of `logs`) that hold episodes of pinned shard
    entries: ``{(topic, partition, seq of the live shard): shard}`` -- an entry's own shard while
    it is live, else the merged shard that holds it now (`rlrec.store.manifest.live_holders`),
    whichever compaction merged in since the pins were taken.

    Example:
        >>> pinned_live_shards({}, {("rl", 0): [(2, 5)]})
        {}
    """
    out: dict[tuple[str, int, int], ShardEntry] = {}
    for (topic, part), ranges in pinned_entries.items():
        entries = logs.get((topic, part))
        if not entries or not ranges:
            continue
        ranges = merge_ranges(ranges)
        for seq, (shard, held) in live_holders(entries).items():  # live seq -> its shard, the entries it holds
            if any(_in_ranges(h, ranges) for h in (seq, *held)):
                out[(topic, part, seq)] = shard
    return out


def plan_removals(
    logs: Mapping[tuple[str, int], Sequence[Entry]],
    already: Collection[tuple[str, int, int]],
    *,
    older_than_s: float | None,
    now: float,
    pinned: Collection[str] = (),
    pinned_entries: PinnedEntries | None = None,
    ids_of: IdsOf | None = None,
) -> list[RemovedFile]:
    """What to remove now, from `logs` (every entry of each partition log, at the newest point):

    * every shard file not live at that point (compaction replaced it): ``replaced``;
    * with `older_than_s`, every live shard all of whose episodes were first committed more than
      `older_than_s` before `now` (a merged shard: by the shard entries that first committed its
      episodes): ``expired``.

    Left out: shards in `already` (removed by an earlier record), shards whose manifest path is
    in `pinned`, and live shards holding episodes of the shard entries `pinned_entries` names
    (`pinned_live_shards`, from these same `logs`: a pin by identity follows the episodes into
    whatever shard compaction merged them into). A multi-agent episode's shards expire together
    or not at all (`rlrec.store.retention_episodes.whole_episodes`; `ids_of` reads a shard's
    multi-agent episode ids, `multi_agent_ids`; None: unknown, every overlapping shard shares).

    Example:
        >>> plan_removals({}, set(), older_than_s=None, now=0.0)
        []
    """
    out: list[RemovedFile] = []
    pins = set(pinned)
    held = pinned_live_shards(logs, pinned_entries or {})
    for (topic, part), entries in sorted(logs.items()):
        live = live_shards(entries)
        first: dict[str, float] = {}
        for e in entries:
            if isinstance(e, ShardEntry):
                for i in e.episode_ids:
                    first.setdefault(i, e.commit_time)
        for s in shard_files(entries):
            key = (topic, part, s.seq)
            if key in already or s.path in pins or key in held:
                continue
            if s.seq not in live:
                out.append(RemovedFile.of(s, "replaced"))
            elif older_than_s is not None:
                newest = max((first.get(i, s.commit_time) for i in s.episode_ids), default=s.commit_time)
                if now - newest > older_than_s:
                    out.append(RemovedFile.of(s, "expired"))
    return whole_episodes(out, logs, already, ids_of or (lambda s: None))


# ------------------------------------------------------------------------------ writing


def _next_number(storage: Storage) -> int:
    nums = [int(m.group(1)) for i in storage.list(REMOVED_DIR) if (m := _RECORD_RE.match(i.name))]
    return max(nums, default=-1) + 1


def _size(f: RemovedFile) -> int:
    return len(json.dumps(f.to_dict())) + 1


def _chunk(
    files: list[RemovedFile], together: Mapping[tuple[str, int, int], Any] | None = None
) -> tuple[list[RemovedFile], list[RemovedFile]]:
    """(the files of the next record, the rest): at most `MAX_FILES_PER_RECORD`, and at most
    half of `MAX_RECORD_BYTES` of file descriptions (long policy ids and topics fit too), cut
    only between files of different groups (`together`: a file's key -> its group; adjacent in
    `files`). ValueError where the first group alone is over that (`fitting` leaves such out)."""
    together = together or {}
    size, i, cut = 0, 0, 0
    while i < min(len(files), MAX_FILES_PER_RECORD):
        size += _size(files[i])
        if i and size > MAX_RECORD_BYTES // 2:
            break
        i += 1
        if i == len(files) or together.get(files[i - 1].key, files[i - 1]) is not together.get(files[i].key, files[i]):
            cut = i
    if not cut and files:
        raise ValueError(
            f"a group of files that must be recorded together is over one record's limit ({files[0].path})"
        )
    return files[:cut], files[cut:]


def fitting(groups: Sequence[Sequence[RemovedFile]]) -> list[list[RemovedFile]]:
    """`groups` (`rlrec.store.retention_episodes.episode_groups`) less those one removal record
    cannot hold (over `MAX_FILES_PER_RECORD` files or half of `MAX_RECORD_BYTES`): kept, not
    removed this run (keep more, never less), with one warning.

    Args:
        groups: the files to record, grouped: each group to be named by one record.

    Example:
        >>> f = RemovedFile("rl", 0, 1, "p/a.parquet", "p/_staging/a.parquet", "expired")
        >>> fitting([[f]]) == [[f]], fitting([[f] * (MAX_FILES_PER_RECORD + 1)])
        (True, [])
    """
    out, over = [], []
    for g in groups:
        if len(g) > MAX_FILES_PER_RECORD or (len(g) > 1 and sum(map(_size, g)) > MAX_RECORD_BYTES // 2):
            over.append(g)
        else:
            out.append(list(g))
    if over:
        log.warning(
            "retain: %d group(s) of shards sharing multi-agent episodes (%d files, e.g. %s) are over one removal "
            "record's limit: kept",
            len(over),
            sum(map(len, over)),
            over[0][0].path,
        )
    return out


def append_removals(
    storage: Storage,
    positions: Mapping[tuple[str, int], int],
    files: Sequence[RemovedFile],
    *,
    grace_s: float,
    now: float | None = None,
    max_attempts: int = 100,
    groups: Sequence[Sequence[RemovedFile]] = (),
) -> list[RemovalRecord]:
    """Append `files` to the removal log as records of at most `MAX_FILES_PER_RECORD` files
    and half of `MAX_RECORD_BYTES` each (create-once at the next free number; a lost race reads
    the winner's record, drops the files it names and tries the next number). The files of each
    of `groups` (`fitting` ones: shards sharing multi-agent episodes) are named by one record.
    Returns the records written. `now`: every record's time (default: each record is stamped
    right before its create-once, so an ``as_of`` time counts it only once it may exist:
    `rlrec.store.snapshot`)."""
    together: dict[tuple[str, int, int], Any] = {}
    for g in groups:
        for f in g:
            together[f.key] = g
    units: dict[Any, list[RemovedFile]] = {}  # each group's files next to each other, at its first file
    for i, f in enumerate(files):
        units.setdefault(id(together[f.key]) if f.key in together else ("alone", i), []).append(f)
    pending = [f for fs in units.values() for f in fs]
    written: list[RemovalRecord] = []
    n = _next_number(storage)
    attempts = 0
    while pending:
        chunk, rest = _chunk(pending, together)
        stamp = time.time() if now is None else now  # right before its create-once (as_of times count it then)
        rec = RemovalRecord(n, stamp, grace_s, dict(positions), tuple(chunk))
        if storage.create_once(record_path(n), rec.to_json().encode()):
            written.append(rec)
            log.info("retain: removal record %d names %d file(s)", n, len(chunk))
            pending, n = rest, n + 1
            continue
        attempts += 1
        if attempts >= max_attempts:
            raise ManifestError(f"could not append a removal record after {max_attempts} attempts")
        theirs = {f.key for r in read_removals(storage, start=n) for f in r.files}
        pending = [f for f in pending if f.key not in theirs]
        n += 1
    return written


def delete_due(
    storage: Storage,
    resolved: Mapping[tuple[str, int, int], tuple[RemovalRecord, RemovedFile]],
    *,
    grace_s: float,
    now: float | None = None,
    dry_run: bool = False,
    keep: Collection[str] = (),
) -> list[str]:
    """Delete the published and staging files of the removed shards (`resolve_removals`) whose
    record is older than the larger of its own grace and `grace_s`, except shards whose manifest
    path is in `keep` (pinned now). Idempotent: missing files are skipped. Returns the paths
    deleted (with `dry_run`: those that would be)."""
    now = time.time() if now is None else now
    keep = set(keep)
    paths = [
        p
        for rec, f in resolved.values()
        if now >= rec.time + max(rec.grace_s, grace_s) and f.path not in keep
        for p in (f.path, f.staging_path)
    ]
    return delete_files(storage, paths, dry_run=dry_run, who="retain")


@dataclass
class RetainResult:
    """What `retain` did: the files it recorded (or with ``dry_run`` would record), the
    records written, and the paths deleted (would delete)."""

    recorded: list[RemovedFile] = field(default_factory=list)
    records: list[RemovalRecord] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)


def read_logs(storage: Storage) -> dict[tuple[str, int], list[Entry]]:
    """Every entry of every partition log (strict: a gap or a malformed entry is ManifestError)."""
    return {k: PartitionLog(storage, *k).load(strict=True) for k in list_partition_logs(storage)}


#: what `retain` asks for the pins, right before it appends its records and again right before
#: it deletes: (manifest paths kept as such, shard entries kept by identity)
PinSource = Callable[[], tuple[Collection[str], "PinnedEntries | None"]]


def _unpinned(
    files: Sequence[RemovedFile],
    logs: Mapping[tuple[str, int], Sequence[Entry]],
    pinned: Collection[str],
    pinned_entries: PinnedEntries | None,
) -> list[RemovedFile]:
    """`files` less those the pins keep (a path pinned, or a live shard holding a pinned entry's
    episodes in `logs`)."""
    paths = set(pinned)
    held = pinned_live_shards(logs, pinned_entries or {})
    return [f for f in files if f.path not in paths and f.key not in held]


def _kept(
    logs: Mapping[tuple[str, int], Sequence[Entry]], pinned: Collection[str], pinned_entries: PinnedEntries | None
) -> set[str]:
    return set(pinned) | {s.path for s in pinned_live_shards(logs, pinned_entries or {}).values()}


def _held(files: Iterable[RemovedFile], holds: PinnedEntries) -> set[tuple[str, int, int]]:
    """The keys of `files` whose own entry a live reader holds (`rlrec.store.reader_leases`:
    handed to a trainer, not read yet): their files are read by their path, so they stay."""
    merged = {k: merge_ranges(rs) for k, rs in holds.items()}  # leases may overlap
    out = set()
    for f in files:
        rs = merged.get((f.topic, f.partition))
        if rs and _in_ranges(f.seq, rs):
            out.add(f.key)
    return out


def retain(
    storage: Storage,
    *,
    older_than_s: float | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    pinned: Collection[str] = (),
    pinned_entries: PinnedEntries | None = None,
    pins: PinSource | None = None,
    dry_run: bool = False,
    now: float | None = None,
) -> RetainResult:
    """Record what to remove (`plan_removals`) and delete what is due (`delete_due`); module
    docstring. `older_than_s` None expires nothing (only replaced files are removed); `pinned`:
    manifest paths never removed; `pinned_entries`: shard entries (per log, seq ranges: a
    lineage's ``trained``) whose episodes are never removed, resolved to the shards holding them
    in the logs this call reads (so a compaction since the pins were taken cannot unpin them).
    `pins`: where the pins come from now (`rlrec.trainer.retention_pins.lineage_pins`), asked
    again right before the records are appended and right before the deletes (a version
    published while this call runs keeps its data; what it returns adds to `pinned` and
    `pinned_entries`). With `dry_run` nothing is written or deleted: the result says what would
    be. The files of entries a live trainer holds (its reader lease, `rlrec.store.reader_leases`:
    handed to it, not read yet) are neither recorded nor deleted; the leases are read right
    before the records are appended and right before the deletes. `now` (tests): the time of
    every step, records included; by default each record is stamped right before it is created
    and the deletes are judged before the pins are asked for the last time: a version published
    before that last read keeps its files however long this call stalled, and one published
    after it finds its data due (`rlrec.trainer.lineage.removed_data` refuses it) unless its
    host's clock is more than `rlrec.trainer.lineage.REPIN_MARGIN_S` behind this one."""
    from rlrec.store.retention_heads import due_from_heads, heads_or_history, pinned_by

    given = now
    now = time.time() if now is None else now
    records = read_removals(storage)  # before the logs: every record's positions are in them
    heads, logs = heads_or_history(
        storage, records, older_than_s=older_than_s, now=now, pinned=pinned, pinned_entries=pinned_entries
    )
    resolved = resolve_removals(_naming(records, logs), logs)
    res = RetainResult()
    ids_of = multi_agent_ids(storage)
    res.recorded = plan_removals(
        logs,
        set(resolved),
        older_than_s=older_than_s,
        now=now,
        pinned=pinned,
        pinned_entries=pinned_entries,
        ids_of=ids_of,
    )
    holds_of = {c.key: held for h in heads.values() for c, held in h.candidates}
    res.recorded = sorted([*res.recorded, *(c for h in heads.values() for c, _ in h.candidates)], key=_order)
    positions = {k: (es[-1].seq + 1 if es else 0) for k, es in logs.items()} | {k: h.end for k, h in heads.items()}
    if res.recorded and pins is not None:  # a version published since the plan keeps its data
        paths, entries = pins()
        ranges = {k: merge_ranges(r) for k, r in (entries or {}).items()}
        res.recorded = [
            f
            for f in _unpinned(res.recorded, logs, paths, entries)
            if f.key not in holds_of
            or f.reason != "expired"
            or not pinned_by(holds_of[f.key], f.seq, ranges.get((f.topic, f.partition), []))
        ]
    if res.recorded:  # what live trainers were handed and have not read yet (asked right before recording)
        held = _held(res.recorded, live_holds(storage))
        res.recorded = [f for f in res.recorded if f.key not in held]
    groups = fitting(episode_groups(res.recorded, logs, set(resolved), ids_of))  # what the pins and leases keep
    res.recorded = sorted((f for g in groups for f in g), key=_order)
    would: list[RemovalRecord] = []
    if res.recorded and not dry_run:
        res.records = append_removals(storage, positions, res.recorded, grace_s=grace_s, now=given, groups=groups)
    elif dry_run and grace_s <= 0:  # what a real run would delete at once
        would = [RemovalRecord(-1, now, grace_s, positions, tuple(res.recorded))]
    every = [*records, *res.records, *would]
    resolved = resolve_removals(_naming(every, logs), logs)
    at = time.time() if given is None else given  # what is due is judged first: the pins read after it count
    keep = _kept(logs, pinned, pinned_entries)
    holds = live_holds(storage, remove_stale=not dry_run)
    held = _held((f for _, f in resolved.values()), holds)  # and what live trainers still read
    keep |= {f.path for _, f in resolved.values() if f.key in held}
    now_paths, now_entries = pins() if pins is not None else ((), None)  # asked again last, right before deleting
    keep |= _kept(logs, now_paths, now_entries)
    res.deleted = delete_due(storage, resolved, grace_s=grace_s, now=at, dry_run=dry_run, keep=keep)
    if heads:  # the logs whose heads decide: the due files that still exist, resolved and unpinned
        entry_pins = {k: [*(pinned_entries or {}).get(k, ()), *(now_entries or {}).get(k, ())] for k in heads}
        named = [f for r in every for f in r.files if (f.topic, f.partition) in heads]
        leased_keys = _held(named, holds)
        leased = {f.path for f in named if f.key in leased_keys}
        paths, undecided = due_from_heads(
            heads,
            every,
            lambda r: at >= r.time + max(r.grace_s, grace_s),
            set(pinned) | set(now_paths) | leased,
            entry_pins,
        )
        if undecided:  # their history decides, as above
            more = {k: PartitionLog(storage, *k).load(strict=True) for k in sorted(undecided)}
            r2 = resolve_removals(_naming(every, more), more)
            keep2 = _kept(more, pinned, pinned_entries) | _kept(more, now_paths, now_entries) | leased
            res.deleted += delete_due(storage, r2, grace_s=grace_s, now=at, dry_run=dry_run, keep=keep2)
        res.deleted = sorted(res.deleted + delete_files(storage, paths, dry_run=dry_run, who="retain"))
    return res


def _order(f: RemovedFile) -> tuple[str, int, int]:
    return f.key


def _naming(records: Iterable[RemovalRecord], logs: Mapping[tuple[str, int], Any]) -> list[RemovalRecord]:
    """`records` with only their files that name a log of `logs` (the others are decided from
    their log's head, `rlrec.store.retention_heads`)."""
    out = []
    for r in records:
        files = tuple(f for f in r.files if (f.topic, f.partition) in logs)
        out.append(r if len(files) == len(r.files) else RemovalRecord(r.n, r.time, r.grace_s, r.positions, files))
    return out
