"""`Snapshot`: the committed shards of a store at one point of its manifest, and their readers.

`rlrec.store.snapshot` opens one (`open_snapshot`, `open_entries`; its docstring says which
shards a point holds and the columns of `Snapshot.steps`). This module reads them: each shard's
bytes checked against the manifest's sha256 and read through the schema gate
(`rlrec.store.schema_gate`: nothing is unpickled), shards ahead fetched in background threads
(`Snapshot.iter_steps`), episode filters (`Snapshot.subset`) and the changes since an earlier
point (`Snapshot.changes`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rlrec.store.at_exit import close_at_exit, read_ahead_pool
from rlrec.store.commit import read_gated_shard
from rlrec.store.cursor import Cursor, CursorError, _as_cursor, _check_store, _expired, _short
from rlrec.store.live_set_file import ShardList
from rlrec.store.manifest import Entry, ReplaceEntry, ShardEntry
from rlrec.store.point_removals import Removed, _deleted
from rlrec.store.schema_gate import MULTI_AGENT_SHARD_FORMAT_VERSION
from rlrec.store.steps_table import STEP_SOURCES, empty_steps, gated_steps, naming_errors, tabular_episodes
from rlrec.store.storage import Storage

__all__ = [
    "READ_AHEAD_BYTES",
    "READ_AHEAD_DECODED_BYTES",
    "READ_AHEAD_SHARDS",
    "READ_AHEAD_THREADS",
    "Snapshot",
]

#: `Snapshot.iter_steps` fetches up to this many shards ahead, in this many threads, holding at
#: most this many bytes of files ahead (one shard more when a single one is larger)
READ_AHEAD_SHARDS = 16
READ_AHEAD_THREADS = 4
READ_AHEAD_BYTES = 256 * 1024 * 1024
#: ... and reading the columns of shards ahead only while what they decode to (their footers'
#: `GatedShard.decoded_bytes`) adds up to at most this; a shard over it is read when its turn comes
READ_AHEAD_DECODED_BYTES = 256 * 1024 * 1024


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
    """Committed shard entries of a store pinned to a cursor (see `rlrec.store.snapshot`).

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
        if not entry.multi_agent:
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
            >>> from rlrec.store.snapshot import open_snapshot
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
            from rlrec.store.snapshot import open_entries  # opening builds on this module

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
        """One row per step of every episode (columns: `rlrec.store.snapshot`, docs/FORMAT.md "Steps table").

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
            >>> from rlrec.store.snapshot import open_snapshot
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
