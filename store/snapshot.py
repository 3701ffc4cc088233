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
(the snapshot holds the *live* shards at its point, `rlrec.store.manifest.live_shards`: a
compacted shard is read from its replacement once the replace entry is at or before the point,
from its own file before); `Snapshot.changes` between two cursors of one store holds exactly
the episodes of the later one that the earlier one lacks (a replacement that merged shards from
both sides of the earlier cursor is read as the shards it replaced, whose files compaction
keeps).
Retention (`rlrec.store.retention`) removes files: a removal record counts at a point iff it
is numbered below the point's ``~rm=N`` (it existed when the point was taken) and its planning
positions are at or below the point's in every log (`counted_records`); a counted record's
shards are not part of the point. Any other point holding a removed shard reads it as before
while the record's grace lasts and is expired (`ExpiredPointError`) after; the newest point
never is expired.
Shards are read through the schema gate (`rlrec.store.schema_gate`) after their sha256 is
checked against the manifest: nothing is unpickled.

Cursor text: ``r1~TAG~TOPIC:PARTITION=N,PARTITION=N+TOPIC:...[~rm=R]``; ``TAG`` (12 hex
digits) is a hash of the first entry of each log the cursor names, so a cursor of another store
is refused; ``R`` (omitted when 0): the removal records written before the point was taken.

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
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rlrec.store.at_exit import close_at_exit, read_ahead_pool
from rlrec.store.commit import read_gated_shard
from rlrec.store.live_set import first_entry_key, read_heads
from rlrec.store.live_set_file import ChainedShards, ShardList
from rlrec.store.manifest import (
    APPEND_WINDOW_S,
    MANIFEST_DIR,
    Entry,
    PartitionLog,
    ReplaceEntry,
    ShardEntry,
    list_partition_logs,
    live_holders,
    live_shards,
)
from rlrec.store.retention import RemovalRecord, RemovedFile, merge_ranges, read_removals, resolve_removals
from rlrec.store.schema_gate import MULTI_AGENT_SHARD_FORMAT_VERSION
from rlrec.store.steps_table import (
    STEP_COLUMNS,
    STEP_SOURCES,
    column_to_numpy,
    empty_steps,
    gated_steps,
    naming_errors,
    tabular_episodes,
)
from rlrec.store.storage import Storage

__all__ = [
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

#: `Snapshot.iter_steps` fetches up to this many shards ahead, in this many threads, holding at
#: most this many bytes of files ahead (one shard more when a single one is larger)
READ_AHEAD_SHARDS = 16
READ_AHEAD_THREADS = 4
READ_AHEAD_BYTES = 256 * 1024 * 1024
#: ... and reading the columns of shards ahead only while what they decode to (their footers'
#: `GatedShard.decoded_bytes`) adds up to at most this; a shard over it is read when its turn comes
READ_AHEAD_DECODED_BYTES = 256 * 1024 * 1024
_CURSOR_VERSION = "r1"
_CURSOR_RE = re.compile(r"^r1~([0-9a-f]{12})~(.*)$")
_GROUP_RE = re.compile(r"^([a-zA-Z0-9._-]+):(\d+=\d+(?:,\d+=\d+)*)$")


class CursorError(ValueError):
    """A point of the manifest that this store does not have: a malformed cursor, a cursor of
    another store, a position past a log's end, a time in the future or before any commit.
    Its message is one line."""

    #: a usage error for the command line (rlrec.errors)
    exit_code = 2


class ExpiredPointError(CursorError):
    """A point of the manifest whose data retention removed (`rlrec.store.retention`): some of
    its shards' files are deleted. The newest point, and every point taken after the removal,
    read what is left. Its message is one line: which point, removed when."""


Removed = Mapping[tuple[str, int, int], tuple[RemovalRecord, RemovedFile]]


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _expired(what: str, recs: Iterable[RemovalRecord], count: int) -> ExpiredPointError:
    rec = min(recs, key=lambda r: r.n)
    return ExpiredPointError(
        f"{what} is expired: retention removed {count} of its shard(s) at {_iso(rec.time)} (removal record "
        f"{rec.n}, files deleted after {_iso(rec.deletable_at)}); open the newest point or a later one"
    )


def _deleted(storage: Storage, e: ShardEntry) -> bool:
    """Whether removed shard `e` cannot be read any more: its files are gone (deleted after the
    grace, or earlier by a deleting host whose clock runs ahead of this one's). Past the grace
    with its files kept (a lineage pin or a reader lease kept them) it is still read."""
    return not (storage.exists(e.path) or storage.exists(e.staging_path))


def counted_records(
    records: Iterable[RemovalRecord], positions: Mapping[tuple[str, int], int], removals: int
) -> list[RemovalRecord]:
    """The removal records in effect at a point: numbered below its `Cursor.removals` (they
    existed when the point was taken) *and* planned at or below its positions in every log
    (`RemovalRecord.positions` <= the point's, a log the point does not name being at 0) -- so
    retention only drops a shard from a point whose logs had already reached what retention
    decided from (a replacement it saw is below the point, so the replaced shard is not live
    there; an expired shard was live and old at the record's positions)."""
    return [r for r in records if r.n < removals and all(n <= positions.get(k, 0) for k, n in r.positions.items())]


def _dropped(counted: Iterable[RemovalRecord], removed: Removed) -> set[tuple[str, int, int]]:
    """The (topic, partition, seq) of the removed shards (`resolve_removals`) that one of the
    `counted` records names: not part of the point."""
    out: set[tuple[str, int, int]] = set()
    for rec in counted:
        for f in rec.files:
            hit = removed.get(f.key)
            if hit is not None and (hit[1].path, hit[1].staging_path) == (f.path, f.staging_path):
                out.add(f.key)
    return out


def _apply_removals(
    storage: Storage,
    entries: list[ShardEntry],
    dropped: set[tuple[str, int, int]],
    removed: Removed,
    *,
    what: str,
) -> list[ShardEntry]:
    """`entries` (the live shards of a point) less the shards removed by a record in effect at
    the point (`dropped`: `counted_records`); ExpiredPointError if others are removed and their
    files are gone (`_deleted`), while they are there (within the grace, or kept past it by a
    pin or a reader lease) they are read as usual."""
    kept: list[ShardEntry] = []
    gone: list[RemovalRecord] = []
    for e in entries:
        key = (e.topic, e.partition, e.seq)
        if key in dropped:
            continue  # a record in effect at this point removed it: not part of it
        hit = removed.get(key)  # type: ignore[arg-type]
        if hit is None:
            kept.append(e)
        elif _deleted(storage, e):
            gone.append(hit[0])
        else:
            kept.append(e)  # within the grace: read as before
    if gone:
        raise _expired(what, gone, len(gone))
    return kept


# --------------------------------------------------------------------------------- cursor


@dataclass(frozen=True)
class Cursor:
    """A point of a store's manifest: ``{(topic, partition): entries seen}`` and the store's tag.

    Args:
        positions: entries seen per partition log (a log not named: none of it).
        tag: 12 hex digits naming the store (a hash of each named log's first entry).
        removals: the removal records that existed when the point was taken (numbered below
            it); of those, the ones planned at or below its positions in every log are in
            effect (`counted_records`): their shards are not part of it. The others' shards
            are (read within their grace, then expired).

    Example:
        >>> c = Cursor({("rl", 0): 12, ("rl", 1): 3}, "0123456789ab")
        >>> str(c)
        'r1~0123456789ab~rl:0=12,1=3'
        >>> Cursor.parse(str(c)) == c
        True
        >>> str(Cursor({("rl", 0): 12}, "0123456789ab", removals=2))
        'r1~0123456789ab~rl:0=12~rm=2'
    """

    positions: Mapping[tuple[str, int], int]
    tag: str
    removals: int = 0

    def __str__(self) -> str:
        groups: dict[str, list[str]] = {}
        for (topic, part), n in sorted(self.positions.items()):
            groups.setdefault(topic, []).append(f"{part}={n}")
        body = "+".join(f"{t}:{','.join(ps)}" for t, ps in groups.items())
        rm = f"~rm={self.removals}" if self.removals else ""
        return f"{_CURSOR_VERSION}~{self.tag}~{body}{rm}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cursor) and (dict(self.positions), self.tag, self.removals) == (
            dict(other.positions),
            other.tag,
            other.removals,
        )

    def __hash__(self) -> int:
        return hash(str(self))

    @classmethod
    def parse(cls, text: str) -> Cursor:
        """A cursor from its text (`str(cursor)`); `CursorError` if it is not one."""
        if not isinstance(text, str):
            raise CursorError(f"a cursor is a string like 'r1~TAG~rl:0=12', got {type(text).__name__}")
        m = _CURSOR_RE.match(text.strip())
        if not m:
            raise CursorError(f"not an rlrec cursor: {_short(text)!r} (expected 'r1~TAG~TOPIC:PARTITION=N,...')")
        positions: dict[tuple[str, int], int] = {}
        body, removals = m.group(2), 0
        if "~" in body:
            body, _, rm = body.partition("~")
            if not re.fullmatch(r"rm=\d{1,9}", rm):
                raise CursorError(f"not an rlrec cursor: {_short(text)!r} (bad part {_short(rm)!r})")
            removals = int(rm[3:])
        for group in body.split("+") if body else []:
            g = _GROUP_RE.match(group)
            if not g:
                raise CursorError(f"not an rlrec cursor: {_short(text)!r} (bad part {_short(group)!r})")
            for item in g.group(2).split(","):
                part, n = (int(x) for x in item.split("="))
                if (g.group(1), part) in positions:
                    raise CursorError(f"not an rlrec cursor: {_short(text)!r} ({g.group(1)}/{part} named twice)")
                positions[(g.group(1), part)] = n
        return cls(positions, m.group(1), removals)


def _short(text: Any, n: int = 60) -> str:
    s = str(text)
    return s if len(s) <= n else s[: n - 3] + "..."


_first_entry_key = first_entry_key


def _tag(firsts: Mapping[tuple[str, int], str]) -> str:
    h = hashlib.sha256()
    for (topic, part), key in sorted(firsts.items()):
        h.update(f"{topic}/{part}={key}\n".encode())
    return h.hexdigest()[:12]


# ------------------------------------------------------------------------------- snapshot


@dataclass(frozen=True)
class _BothKept:
    """Keeps an episode that both filters keep (picklable, for DataLoader workers)."""

    outer: Callable[[str], bool]
    inner: Callable[[str], bool]

    def __call__(self, episode_id: str) -> bool:
        return self.outer(episode_id) and self.inner(episode_id)


def _wants_groups(keep: Callable) -> bool:
    if isinstance(keep, _BothKept):
        return _wants_groups(keep.outer) or _wants_groups(keep.inner)
    return bool(getattr(keep, "by_multi_agent_episode", False))


def _kept(keep: Callable, episode_id: str, groups: Mapping[str, str] | None) -> bool:
    """Whether `keep` keeps the episode: a filter that splits by multi-agent episode is also
    given the row's multi-agent episode id (None for a single-agent episode)."""
    if isinstance(keep, _BothKept):
        return _kept(keep.outer, episode_id, groups) and _kept(keep.inner, episode_id, groups)
    if getattr(keep, "by_multi_agent_episode", False):
        return keep(episode_id, (groups or {}).get(episode_id))
    return keep(episode_id)


class Snapshot:
    """Committed shard entries of a store pinned to a cursor (see module docstring).

    Build with `open_snapshot` (or `rlrec.open`). Attributes: ``storage``, ``cursor`` (the
    point's text, for `open_snapshot(as_of=...)` and `changes`), ``entries`` (the shard entries,
    ordered by topic, partition and seq), ``selection`` (None: the whole point; the digest of a
    part of it, from `subset` or `open_entries`: the cursor and the selection together name its
    data). Readers: `files`, `episodes`, `steps`,
    `iter_steps`, `to_pyarrow_dataset`, `to_pandas`, `to_polars`, `to_duckdb`,
    `to_ray_dataset`, `to_torch`; `changes` for incremental readers.
    """

    def __init__(
        self,
        storage: Storage,
        point: Cursor,
        entries: list[ShardEntry],
        firsts: dict,
        keep_episode: Callable[[str], bool] | None = None,
        selection: str | None = None,
        logs: Mapping[tuple[str, int], list[Entry]] | None = None,
        *,
        drop: Mapping[str, frozenset] | None = None,
        ranges: Mapping[tuple[str, int], list[tuple[int, int]]] | None = None,
        removed: Removed | None = None,
        history: Callable[[], tuple[Mapping[tuple[str, int], list[Entry]], Removed]] | None = None,
    ) -> None:
        self.storage = storage
        self._point = point
        self._firsts = firsts  # (topic, partition) -> key of its first entry (store identity)
        # the logs read when it was opened (for `changes` across replacements) and what retention
        # removed (`changes` must not read it); `history`: reads both when first needed (a head
        # point opened through live sets, `rlrec.store.live_set`)
        self._logs_read = logs
        self._removed_read = removed
        self._history = history
        #: in (topic, partition, seq) order; a head point's entries are built when first used
        self.entries: Sequence[ShardEntry] = (
            entries if isinstance(entries, ShardList) else sorted(entries, key=lambda e: (e.topic, e.partition, e.seq))
        )
        #: None: every episode of the entries; else the episode ids it keeps (`subset`)
        self.keep_episode = keep_episode
        #: None: every entry at the cursor; else the digest naming the part `subset` kept
        self.selection = selection
        self._counts: dict[str, tuple[int, int]] = {}  # shard path -> (episodes, steps) kept
        # shard path -> ids of episodes of that shard it leaves out (`open_entries`: a merged
        # shard's episodes of entries not asked for)
        self._drop: dict[str, frozenset] = (
            {e.path: drop[e.path] for e in self.entries if drop.get(e.path)} if drop else {}
        )
        self._ranges = ranges  # `open_entries`: the seq ranges whose episodes it holds (for `changes`)
        #: shard path -> its `_fetch` under way (`iter_steps` reads ahead)
        self._ahead: dict[str, Future] = {}

    @property
    def filtered(self) -> bool:
        """Whether it leaves out episodes of its shards (a `subset` by episode, `open_entries`):
        then its counts come from reading the shards."""
        return self.keep_episode is not None or bool(self._drop)

    def _keeps(
        self, entry: ShardEntry, ids: Iterable[str], groups: Mapping[str, str] | None = None, shard: Any = None
    ) -> list[str]:
        """Which of `ids` (episode ids of `entry`'s shard) it holds. A filter with a true
        ``by_multi_agent_episode`` attribute (the held-out split) gets an agent row's multi-agent
        episode id as its second argument (`groups`: agent episode id -> it; None: read from the
        shard when it is a multi-agent one: from `shard`, the entry's gated shard, where the
        caller has it, else read again)."""
        drop, keep = self._drop.get(entry.path, frozenset()), self.keep_episode
        if keep is not None and _wants_groups(keep) and groups is None:
            groups = self._multi_agent_ids(entry, shard)
        return [i for i in ids if i not in drop and (keep is None or _kept(keep, i, groups))]

    def _multi_agent_ids(self, entry: ShardEntry, shard: Any = None) -> dict[str, str]:
        """Agent episode id -> multi-agent episode id of `entry`'s rows ({}: not a multi-agent
        shard), from `shard` (its gated shard; None: read it)."""
        if entry.format != "episodes" or entry.format_version != MULTI_AGENT_SHARD_FORMAT_VERSION:
            return {}
        from rlrec.store.multi_agent_shards import read_agent_ids

        return {eid: ma_id for eid, ma_id, _ in read_agent_ids(shard if shard is not None else self._gated(entry))}

    def __repr__(self) -> str:
        if self.selection is None:
            return (
                f"Snapshot({self.storage.uri('')}, {self.cursor}, shards={len(self.entries)}, steps={self.num_steps})"
            )
        return (  # a subset's counts read its shards: not in a repr
            f"Snapshot({self.storage.uri('')}, {self.cursor}, selection={self.selection}, shards={len(self.entries)})"
        )

    def subset(
        self,
        paths: Iterable[str] | None = None,
        keep_episode: Callable[[str], bool] | None = None,
        *,
        label: str | None = None,
    ) -> Snapshot:
        """The part of this snapshot in the shards named by `paths` (manifest paths; None: all)
        and, of those, the episodes whose id `keep_episode` keeps (None: all).

        The subset has the same `cursor` (the manifest point) and a `selection`: a digest of
        the kept paths and of the episode filter (its `label`, default its ``repr``), so that
        the cursor and the selection together name the data (a `to_torch` state of the subset
        loads into the same subset only). A filter whose ``repr`` differs between processes (a
        lambda) gives a selection of this process only: give it a `label` to reuse one.

        Every reader of the subset (`episodes`, `steps`, `to_*`, `changes`) applies both;
        `files` lists whole shards, so a plain reader of those files applies the episode
        filter itself. A path that is not a shard of this snapshot is a `CursorError`.

        Args:
            paths: the shards to keep, by their manifest path (`ShardEntry.path`).
            keep_episode: a function of the episode id; True keeps the episode.
            label: what names `keep_episode` in the selection (default ``repr(keep_episode)``).

        Example:
            >>> import tempfile
            >>> from rlrec.store.commit import ShardCommitter
            >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
            >>> root = tempfile.mkdtemp()
            >>> _ = ShardCommitter(root).commit(expert_cartpole_episodes(4))
            >>> snap = open_snapshot(root)
            >>> first = snap.steps().column("episode_id")[0].as_py()
            >>> sub = snap.subset(keep_episode=lambda eid: eid != first, label=f"not {first}")
            >>> sub.num_episodes, sub.cursor == snap.cursor, snap.selection is None, len(sub.selection)
            (3, True, True, 16)
        """
        if paths is None and keep_episode is None:
            return Snapshot(
                self.storage,
                self._point,
                self.entries,
                self._firsts,
                self.keep_episode,
                self.selection,
                drop=self._drop,
                ranges=self._ranges,
                **self._kept(),
            )
        entries = self.entries
        if paths is not None:
            wanted = set(paths)
            entries = [e for e in entries if e.path in wanted]
            missing = wanted - {e.path for e in entries}
            if missing:
                raise CursorError(
                    f"{len(missing)} shard(s) are not in the snapshot at {self.cursor}, e.g. {_short(min(missing))!r}"
                )
        keep = keep_episode
        if self.keep_episode is not None and keep_episode is not None:
            keep = _BothKept(self.keep_episode, keep_episode)
        elif keep is None:
            keep = self.keep_episode
        named = {
            "within": self.selection,
            "paths": sorted(e.path for e in entries) if paths is not None else None,
            "episodes": (label if label is not None else repr(keep_episode)) if keep_episode is not None else None,
        }
        digest = hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()[:16]
        ranges = self._ranges if paths is None else None  # a subset by path is no longer those ranges
        return Snapshot(
            self.storage,
            self._point,
            entries,
            self._firsts,
            keep,
            digest,
            drop=self._drop,
            ranges=ranges,
            **self._kept(),
        )

    @property
    def _logs(self) -> Mapping[tuple[str, int], list[Entry]] | None:
        if self._history is not None:
            self._logs_read, self._removed_read = self._history()
            self._history = None
        return self._logs_read

    @property
    def _removed(self) -> Removed:
        self._logs  # noqa: B018 -- reads the history if it was not read yet
        return self._removed_read or {}

    def _kept(self) -> dict[str, Any]:
        """What a snapshot made from this one shares with it (the history, read or not)."""
        return {"logs": self._logs_read, "removed": self._removed_read, "history": self._history}

    @property
    def cursor(self) -> str:
        """This snapshot's point of the manifest, as text."""
        return str(self._point)

    @property
    def num_episodes(self) -> int:
        """Episodes of the snapshot (with an episode filter: counted by reading the shards once)."""
        return sum(self.shard_counts(e)[0] for e in self.entries)

    @property
    def num_steps(self) -> int:
        """Steps of the snapshot (with an episode filter: counted by reading the shards once)."""
        return sum(self.shard_counts(e)[1] for e in self.entries)

    def shard_counts(self, entry: ShardEntry) -> tuple[int, int]:
        """(episodes, steps) of one of the snapshot's shards that the snapshot holds."""
        if not self.filtered:
            return entry.episodes, entry.steps
        if entry.path not in self._counts:
            ids = self.shard_steps(entry).column("episode_id")
            self._counts[entry.path] = (len(set(ids.to_pylist())), len(ids))
        return self._counts[entry.path]

    def files(self) -> list[str]:
        """The URIs (local: absolute paths) of the snapshot's shards at their published paths,
        one per live shard (a compacted shard: its replacement), each episode in exactly one: the
        list to give a plain directory reader instead of a policy directory, which holds replaced
        files too. A shard committed moments ago may still be staged; the readers of this class
        read it from staging then, a plain directory reader waits for it."""
        if isinstance(self.entries, ShardList):
            if self.storage.kind == "local" and os.sep == "/":  # checked clean paths joined to the root
                return self.entries.paths(os.path.join(self.storage.base, ""))
            return self.storage.uris(self.entries.paths())
        return self.storage.uris([e.path for e in self.entries])

    def changes(self, since: str | Cursor) -> Snapshot:
        """The episodes of this snapshot that the point `since` (a cursor of an earlier snapshot
        of this store) does not hold, as a snapshot with this one's cursor: its live shards
        committed after `since`, and of a replacement that merged shards from both sides of
        `since` the replaced shards committed after it (their files stay until retention).

        Of a snapshot from `open_entries` (a version's data): the episodes of its entries
        committed at or after `since`, read as `open_entries` reads them, with its own selection.

        Raises `CursorError` if `since` is not a point of this store at or before this one, and
        `ExpiredPointError` if retention removed data committed after `since` that it lacks (an
        incremental reader that far behind must start again from a newer point)."""
        since_c = _as_cursor(since)
        _check_store(since_c, self._firsts, self.storage)
        for key, n in since_c.positions.items():
            if n > self._point.positions.get(key, 0):
                raise CursorError(
                    f"since is after this snapshot: {key[0]}/{key[1]} at {n} > {self._point.positions.get(key, 0)} "
                    "(open the newer snapshot first)"
                )
        if self._ranges is not None:
            clipped = {
                key: [(max(a, since_c.positions.get(key, 0)), b) for a, b in rs] for key, rs in self._ranges.items()
            }
            part = open_entries(self.storage, clipped)
            named = {"within": self.selection, "since": str(since_c)}
            digest = hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()[:16]
            return Snapshot(
                self.storage,
                self._point,
                part.entries,
                self._firsts,
                self.keep_episode,
                digest,
                part._logs,
                drop=part._drop,
                ranges=part._ranges,
                removed=part._removed,
            )
        new: list[ShardEntry] = []
        by_seq: dict[tuple[str, int], dict[int, Entry]] = {}
        for e in self.entries:
            key = (e.topic, e.partition)
            start = since_c.positions.get(key, 0)
            if e.seq < start:  # type: ignore[operator]
                continue  # committed below `since` (and so were the shards it replaced)
            if self._logs is None:
                new.append(e)
                continue
            if key not in by_seq:
                by_seq[key] = {x.seq: x for x in self._logs.get(key, [])}  # type: ignore[misc]
            new += _new_part(by_seq[key], e.seq, start)  # type: ignore[arg-type]
        gone = [
            hit[0]
            for x in new
            if (hit := self._removed.get((x.topic, x.partition, x.seq))) is not None  # type: ignore[arg-type]
            and _deleted(self.storage, x)
        ]
        held = {(e.topic, e.partition, e.seq) for e in self.entries}
        gone += [  # expired shards committed after `since` that this point no longer holds: never read
            rec
            for (t, p, seq), (rec, f) in self._removed.items()
            if f.reason == "expired"
            and since_c.positions.get((t, p), 0) <= seq < self._point.positions.get((t, p), 0)
            and (t, p, seq) not in held
        ]
        if gone:  # shards `since` did not hold, whose files retention removed
            raise _expired(f"the point since={_short(str(since_c))}", gone, len(gone))
        return Snapshot(
            self.storage,
            self._point,
            new,
            self._firsts,
            self.keep_episode,
            self.selection,
            self._logs,
            drop=self._drop,
            removed=self._removed,
        )

    # ---------------------------------------------------------------- reading shards
    def _gated(self, entry: ShardEntry):
        """A committed shard's `GatedShard` once its bytes match the manifest's sha256 and its
        format version the entry's (`rlrec.store.commit.read_gated_shard`)."""
        return read_gated_shard(self.storage, entry)

    def episodes(self) -> Iterator[Any]:
        """Every episode of the snapshot as an RLlib `SingleAgentEpisode`, shard by shard
        (`shard_episodes`). Imports RLlib (~2 s the first time)."""
        for entry in self.entries:
            yield from self.shard_episodes(entry)

    def multi_agent_episodes(self, mapping_fn: Callable | None = None) -> Iterator[Any]:
        """Every multi-agent episode of the snapshot whose agent rows are all in it, as an RLlib
        `MultiAgentEpisode` (`rlrec.store.multi_agent_read`). Imports RLlib.

        Args:
            mapping_fn: the episodes' `agent_to_module_mapping_fn`; None: their recorded modules.

        Example:
            >>> import rlrec  # doctest: +SKIP
            >>> for ep in rlrec.open("file:///data/rl").multi_agent_episodes():  # doctest: +SKIP
            ...     print(ep.id_, sorted(ep.agent_episodes), ep.env_t)
        """
        from rlrec.store.multi_agent_read import multi_agent_episodes

        return multi_agent_episodes(self, mapping_fn)

    def shard_episodes(self, entry: ShardEntry) -> list[Any]:
        """The episodes of one of the snapshot's shards as `SingleAgentEpisode`s: decoded safely
        from an episode shard (`rlrec.store.episodes.unpack_episode`), rebuilt from the rows of a
        tabular shard (`tabular_episodes`; the reset step's info is not stored there: empty)."""
        from rlrec.store.episodes import unpack_episode

        shard = self._gated(entry)
        with naming_errors(self.storage.uri(entry.path)):
            if shard.fmt == "tabular":
                episodes = tabular_episodes(shard, entry)
            else:
                items = shard.read(["item"]).column("item")
                episodes = [unpack_episode(v.as_py()) for chunk in items.chunks for v in chunk]
        if self.filtered:
            groups = (
                {str(ep.id_): ep.multi_agent_episode_id for ep in episodes}
                if shard.version == MULTI_AGENT_SHARD_FORMAT_VERSION
                else {}
            )
            kept = set(self._keeps(entry, [str(ep.id_) for ep in episodes], groups))
            episodes = [ep for ep in episodes if str(ep.id_) in kept]
        return episodes

    def _fetch(self, entry: ShardEntry, budget: _DecodedBudget | None = None) -> tuple[Any, pa.Table | None]:
        """A committed shard, gated (`_gated`), and the columns its steps are made of; when read
        ahead (`budget`), the columns only if what the shard decodes to fits the budget (None:
        read them when the shard's turn comes)."""
        shard = self._gated(entry)
        if budget is not None and not budget.take(entry.path, shard.decoded_bytes):
            return shard, None
        return shard, shard.read(STEP_SOURCES.get(shard.fmt))

    def shard_steps(self, entry: ShardEntry) -> pa.Table:
        """The steps of one of the snapshot's shards (the columns of `steps`)."""
        ahead = self._ahead.pop(entry.path, None)
        try:
            shard, read = ahead.result() if ahead is not None else self._fetch(entry)
        except CancelledError:  # interpreter shutdown cancelled the read ahead (rlrec.store.at_exit)
            shard, read = self._fetch(entry)
        if read is None:
            read = shard.read(STEP_SOURCES.get(shard.fmt))
        with naming_errors(self.storage.uri(entry.path)):
            table = gated_steps(shard, entry, read)
        if not self.filtered or not table.num_rows:
            return table
        ids = table.column("episode_id")
        kept = self._keeps(entry, set(ids.to_pylist()), shard=shard)
        return table.filter(pc.is_in(ids, value_set=pa.array(kept, pa.string())))

    def iter_steps(self) -> Iterator[pa.Table]:
        """The steps of the snapshot, one table per shard (the columns of `steps`), in order.

        The next shards are fetched (read, sha256 checked, gated, their columns read: work that
        does not hold the GIL) by `READ_AHEAD_THREADS` threads while this one decodes, at most
        `READ_AHEAD_SHARDS` shards and `READ_AHEAD_BYTES` of files ahead; the columns of shards
        ahead are read only while they decode to at most `READ_AHEAD_DECODED_BYTES` together.
        Close the iterator to stop them early; one left open stops them when the interpreter
        exits (`rlrec.store.at_exit`)."""
        return close_at_exit(self._iter_steps())

    def _iter_steps(self) -> Iterator[pa.Table]:
        entries = list(self.entries)
        submitted: list[str] = []
        budget = _DecodedBudget(READ_AHEAD_DECODED_BYTES)
        pool = read_ahead_pool(READ_AHEAD_THREADS, "rlrec-read-ahead")
        try:
            nxt = 1  # the next entry to fetch ahead
            for i, entry in enumerate(entries):
                nxt = max(nxt, i + 1)
                ahead = sum(e.bytes for e in entries[i + 1 : nxt])
                while (
                    nxt < len(entries)
                    and nxt - i <= READ_AHEAD_SHARDS
                    and (nxt == i + 1 or ahead + entries[nxt].bytes <= READ_AHEAD_BYTES)
                ):
                    try:
                        future = pool.submit(self._fetch, entries[nxt], budget)
                    except RuntimeError:  # the pool was shut down at interpreter exit: read inline
                        nxt = len(entries)
                        break
                    self._ahead[entries[nxt].path] = future
                    submitted.append(entries[nxt].path)
                    ahead += entries[nxt].bytes
                    nxt += 1
                table = self.shard_steps(entry)
                budget.give_back(entry.path)
                yield table
        finally:
            for path in submitted:
                future = self._ahead.pop(path, None)
                if future is not None:
                    future.cancel()
            pool.shutdown(wait=True)

    def steps(self) -> pa.Table:
        """One row per step of every episode (columns: module docstring, docs/FORMAT.md "Steps table").

        Raises `ShardSchemaError` (a ValueError) naming a shard the schema gate refuses, and
        ValueError when shards hold different observation or action types."""
        tables = list(self.iter_steps())
        if not tables:
            return empty_steps()
        try:
            return pa.concat_tables(tables)
        except pa.ArrowInvalid as e:
            raise ValueError(
                f"the snapshot's shards hold steps of different types (several environments?): {e}"
            ) from None

    def to_pyarrow_dataset(self):
        """The steps as a `pyarrow.dataset.Dataset` (in memory)."""
        import pyarrow.dataset as ds

        return ds.dataset(self.steps())

    def to_pandas(self, *, arrow_backed: bool = False, **to_pandas_options: Any):
        """The steps as a pandas DataFrame.

        By default observations and actions are numpy arrays per cell (one Python object per
        step and column). With ``arrow_backed=True`` every column keeps its Arrow data
        (``pandas.ArrowDtype``: ``list<float>[pyarrow]`` etc.): no object per cell, several
        times faster for array columns and zero-copy where Arrow allows; ``df.observation.list``
        and ``pyarrow.Table.from_pandas`` work on them, and ``df.reward.to_numpy()`` still gives
        numbers. Other keyword arguments go to `pyarrow.Table.to_pandas` (e.g.
        ``types_mapper``).

        Args:
            arrow_backed: keep Arrow types (pandas >= 2.0).
            **to_pandas_options: passed on to `pyarrow.Table.to_pandas`.

        Example::

            >>> import tempfile
            >>> from rlrec.store.commit import ShardCommitter
            >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
            >>> root = tempfile.mkdtemp()
            >>> _ = ShardCommitter(root).commit(expert_cartpole_episodes(1, max_steps=5))
            >>> str(open_snapshot(root).to_pandas(arrow_backed=True).dtypes["observation"])
            'fixed_size_list<item: float>[4][pyarrow]'
        """
        if arrow_backed:
            import pandas as pd

            to_pandas_options.setdefault("types_mapper", pd.ArrowDtype)
        return self.steps().to_pandas(**to_pandas_options)

    def to_polars(self):
        """The steps as a polars DataFrame (fixed-size lists become polars ``Array`` columns)."""
        import polars as pl

        return pl.from_arrow(self.steps())

    def to_duckdb(self, connection: Any = None):
        """The steps as a DuckDB relation on `connection` (default: a new in-memory database).
        Needs the ``duckdb`` package (``pip install 'rlrec[analysis]'``)."""
        import duckdb

        con = connection if connection is not None else duckdb.connect()
        return con.from_arrow(self.steps())

    def to_ray_dataset(self):
        """The steps as a Ray Dataset (one block per shard); starts Ray if it is not running."""
        import ray.data

        tables = list(self.iter_steps())
        return ray.data.from_arrow(tables if tables else [empty_steps()])

    def to_torch(self, *, columns: tuple[str, ...] | None = None):
        """A resumable torch `IterableDataset` of the steps (`rlrec.store.snapshot_torch.StepsDataset`)."""
        from rlrec.store.snapshot_torch import StepsDataset

        return StepsDataset(self, columns=columns)


class _DecodedBudget:
    """What the shards read ahead by `Snapshot.iter_steps` decode to, bounded (thread-safe)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, path: str, n: int) -> bool:
        """Reserve `n` bytes for the shard at `path`; False when they do not fit."""
        with self._lock:
            if sum(self._held.values()) + n > self.cap:
                return False
            self._held[path] = n
            return True

    def give_back(self, path: str) -> None:
        with self._lock:
            self._held.pop(path, None)


def _new_part(by_seq: Mapping[int, Entry], seq: int, start: int) -> list[ShardEntry]:
    """The shards holding the episodes of the live shard committed by entry `seq` that were
    committed at or after entry `start` of its log: that shard if all of them were, else (a
    replacement of shards from both sides of `start`, maybe a replacement of replacements) the
    replaced shards committed at or after `start`, recursively."""
    e = by_seq[seq]
    if isinstance(e, ShardEntry):
        return [e] if seq >= start else []
    assert isinstance(e, ReplaceEntry)
    parts = [s for r in e.replaces for s in _new_part(by_seq, r, start)]
    if sum(p.episodes for p in parts) == e.shard.episodes:  # every episode in it is new
        return [e.shard]
    return parts


# --------------------------------------------------------------------------------- opening


def _as_cursor(value: str | Cursor) -> Cursor:
    return value if isinstance(value, Cursor) else Cursor.parse(value)


def _check_store(c: Cursor, firsts: Mapping[tuple[str, int], str], storage: Storage) -> None:
    missing = sorted(k for k in c.positions if k not in firsts)
    if missing:
        t, p = missing[0]
        raise CursorError(
            f"the cursor names partition log {t}/{p}, which {storage.uri('')} does not have (a cursor of another store?)"
        )
    if _tag({k: firsts[k] for k in c.positions}) != c.tag:
        raise CursorError(f"the cursor is from another store (its logs do not begin like those of {storage.uri('')})")


def _read_logs(storage: Storage) -> dict[tuple[str, int], list[Entry]]:
    return {k: PartitionLog(storage, *k).load(strict=True) for k in list_partition_logs(storage)}


def _iso(ts: float) -> str:
    """A UNIX time as ISO 8601 UTC with milliseconds, and the UNIX time itself.

    Example:
        >>> _iso(0.0)
        '1970-01-01T00:00:00.000Z (UNIX 0.000)'
    """
    from datetime import datetime, timezone

    text = datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return f"{text} (UNIX {ts:.3f})"


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


def cursor_covering(
    storage: Storage | str, entries: Iterable[ShardEntry], firsts: dict[tuple[str, int], str] | None = None
) -> Cursor:
    """The smallest point of the manifest that holds every one of `entries` (shard entries of
    the store): per partition log, the entries up to the last of them. `open_snapshot` at it,
    then `Snapshot.subset` with their paths, gives exactly those entries back.

    Args:
        storage: the store (a `Storage` or its URI).
        entries: shard entries of its manifest (e.g. the ones a trainer has trained on).
        firsts: a cache of the logs' first-entry keys, filled here (the first entry of a log
            never changes): reuse it across calls to read each log's first entry once.

    Example:
        >>> import tempfile
        >>> from rlrec.store.commit import ShardCommitter
        >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
        >>> root = tempfile.mkdtemp()
        >>> c = ShardCommitter(root)
        >>> _ = c.commit(expert_cartpole_episodes(1)); _ = c.commit(expert_cartpole_episodes(1, seed=1))
        >>> snap = open_snapshot(root)
        >>> point = cursor_covering(root, snap.entries[:1])
        >>> [e.path for e in open_snapshot(root, as_of=point).entries] == [snap.entries[0].path]
        True
    """
    positions: dict[tuple[str, int], int] = {}
    for e in entries:
        key = (e.topic, e.partition)
        positions[key] = max(positions.get(key, 0), int(e.seq) + 1)  # type: ignore[arg-type]
    return cursor_at(storage, positions, firsts)


def cursor_at(
    storage: Storage | str, positions: Mapping[tuple[str, int], int], firsts: dict[tuple[str, int], str] | None = None
) -> Cursor:
    """The point of the manifest at `positions` (per partition log ``(topic, partition)``: the
    number of its entries the point holds), tagged with the logs' first entries as
    `open_snapshot` tags its cursors. `cursor_covering` computes the positions from entries; a
    reader that kept them (the trainer, in its checkpoint) needs no entry but each log's first.

    Args:
        storage: the store (a `Storage` or its URI).
        positions: (topic, partition) -> entries held (> 0).
        firsts: a cache of the logs' first-entry keys, filled here.

    Raises:
        CursorError: a log of `positions` has no entries in `storage`.

    Example:
        >>> import tempfile
        >>> from rlrec.store.commit import ShardCommitter
        >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
        >>> root = tempfile.mkdtemp()
        >>> _ = ShardCommitter(root).commit(expert_cartpole_episodes(1))
        >>> str(cursor_at(root, {("rl", 0): 2})) == open_snapshot(root).cursor  # a claim, then the shard
        True
    """
    st = Storage.from_uri(storage) if isinstance(storage, str) else storage
    cache = firsts if firsts is not None else {}
    for key in positions:
        if key not in cache:
            plog = PartitionLog(st, *key)
            first = plog.read_entry(0)
            if first is None:  # folded into a snapshot entry: the whole log says what it was
                entries0 = plog.load(strict=True)
                first = entries0[0] if entries0 else None
            if first is None:
                raise CursorError(f"{key[0]}/{key[1]} has no manifest entries under {st.uri('')}")
            cache[key] = _first_entry_key(first)
    return Cursor(positions, _tag({k: cache[k] for k in positions}))
