"""`Snapshot.multi_agent_episodes`: RLlib `MultiAgentEpisode`s rebuilt from a snapshot's
multi-agent rows, each returned by the read that holds its last-committed agent row.

A multi-agent episode's rows lie in one shard per module (`rlrec.store.multi_agent_shards`),
committed one after another in one partition log (all events of an episode share its Kafka key).
Each row carries the episode's record, which lists its agents (``agents``) and holds the ones that
are not rows (``carried``). An episode is returned once a row of every other listed agent is
committed at the snapshot's point, by the snapshot that holds the row committed last: rows of it
committed before the snapshot's entries (an incremental read, `Snapshot.changes` or
`open_entries`) are found through the manifest's episode ids (an agent row's id is
`agent_episode_id`) and read from the shards holding them (docs/GUARANTEES.md, "Multi-agent
episodes are whole").

Bounds: rows waiting for the rest of their episode are held decoded up to
`MAX_PENDING_DECODED_BYTES`; past it only their place (shard and row) is kept and they are read
again when the episode completes. An episode whose record or rows disagree is refused on its own
(counted in `MultiAgentEpisodes.refused`, logged); episodes still partial at the end are counted
(`MultiAgentEpisodes.partial`, logged).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from rlrec.store.episodes import EpisodeDecodeError, unpack_episode
from rlrec.store.log_shards import live_holders
from rlrec.store.manifest import ShardEntry
from rlrec.store.multi_agent_episode import MultiAgentRecordError, assemble_episode, unpack_record
from rlrec.store.multi_agent_shards import AgentRow, agent_episode_id, read_agent_ids, read_agent_rows
from rlrec.store.schema_gate import MULTI_AGENT_SHARD_FORMAT_VERSION, ShardSchemaError
from rlrec.store.steps_table import naming_errors

__all__ = ["MAX_PENDING_DECODED_BYTES", "MultiAgentEpisodes", "multi_agent_episodes"]

log = logging.getLogger("rlrec.store")

#: what the rows waiting for the rest of their episode may hold decoded (their packed sizes);
#: past it a row is kept as its place and read again when its episode completes
MAX_PENDING_DECODED_BYTES = 256 * 1024 * 1024
_KEPT_REFUSALS = 100


class _Pending:
    """The rows of one multi-agent episode seen so far and what completes it: each row decoded
    (within the budget) or its place, the record's digest (all rows must carry the same)."""

    __slots__ = ("digest", "held_bytes", "places", "rows", "wanted")

    def __init__(self, row: AgentRow) -> None:
        record, carried = unpack_record(row.record)
        self.wanted = set(record["agents"]) - set(carried)
        self.digest = hashlib.sha256(row.record).digest()
        self.rows: dict[str, AgentRow | None] = {}
        self.places: dict[str, tuple[ShardEntry, int]] = {}
        self.held_bytes = 0

    def add(self, row: AgentRow, entry: ShardEntry | None, hold: bool, digest: bytes) -> bool:
        """Take `row` (held decoded if `hold`); True once every agent row is here."""
        ma = row.multi_agent_episode_id
        if digest != self.digest:
            raise MultiAgentRecordError(
                f"multi-agent episode {ma}: agent {row.agent_id!r:.40}'s row carries a different record"
            )
        if row.agent_id not in self.wanted:
            raise MultiAgentRecordError(f"multi-agent episode {ma}: agent {row.agent_id!r:.40} is not one of its rows")
        if row.agent_id in self.rows:
            raise MultiAgentRecordError(f"multi-agent episode {ma}: agent {row.agent_id!r:.40}'s row appears twice")
        hold = hold or len(self.rows) + 1 == len(self.wanted)  # the row completing it is in hand
        self.rows[row.agent_id] = row if hold else None
        if entry is not None:
            self.places[row.agent_id] = (entry, row.index)
        if hold:
            self.held_bytes += _size(row)
        return self.complete

    @property
    def complete(self) -> bool:
        return len(self.rows) == len(self.wanted)


def _size(row: AgentRow) -> int:
    return row.item_bytes + 1024


class MultiAgentEpisodes(Iterator[Any]):
    """The multi-agent episodes of a snapshot, as an iterator, with what it refused and left.

    Attributes:
        refused: episodes refused as data errors (a record over `MAX_RECORD_BYTES` or malformed,
            rows whose records differ, an agent's row twice, a row that is not the record's, a
            record that disagrees with its rows): each logged, the read goes on.
        refusals: (episode id, reason) of the first 100 refused.
        partial: episodes with rows in the snapshot that it does not return: a row of another
            agent is not committed at its point (a later read returns it) or committed after the
            snapshot's last row of it (the read holding that row returns it), or retention
            removed it. Counted and logged once the iteration ends.

    Example:
        >>> import rlrec  # doctest: +SKIP
        >>> eps = rlrec.open("file:///data/rl").multi_agent_episodes()  # doctest: +SKIP
        >>> ids = [ep.id_ for ep in eps]; eps.refused, eps.partial  # doctest: +SKIP
        (0, 0)
    """

    def __init__(self, snapshot: Any, mapping_fn: Callable | None = None) -> None:
        self._snapshot = snapshot
        self._mapping_fn = mapping_fn
        self.refused = 0
        self.refusals: list[tuple[str, str]] = []
        self.partial = 0
        self._held = 0
        self._shards: dict[str, Any] = {}  # the last shard read again (one): path -> GatedShard
        self._it = self._run()

    def __next__(self) -> Any:
        return next(self._it)

    # ------------------------------------------------------------------ the pass over the entries
    def _entries(self) -> list[ShardEntry]:
        """The snapshot's entries that may hold multi-agent rows: those of folders named like a
        module's (``{policy_id}.{module_id}``); a folder mixing format versions 1 and 2 is refused."""
        entries = [e for e in self._snapshot.entries if e.format == "episodes" and "." in e.policy_id]
        versions: dict[str, set[int]] = {}
        for e in entries:
            versions.setdefault(e.policy_id, set()).add(e.format_version)
        for policy, vs in sorted(versions.items()):
            if MULTI_AGENT_SHARD_FORMAT_VERSION in vs and len(vs) > 1:
                raise ShardSchemaError(
                    f"{self._snapshot.storage.uri(policy)}/ holds shards of format versions {sorted(vs)}: a folder "
                    "of multi-agent rows must hold no single-agent shards (a policy named like a module's folder?)"
                )
        return entries

    def _refuse(self, ma_id: str, e: Exception) -> None:
        self.refused += 1
        if len(self.refusals) < _KEPT_REFUSALS:
            self.refusals.append((ma_id, str(e)))
        log.warning("multi-agent episode %.80s refused: %.300s", ma_id, e)

    def _run(self) -> Iterator[Any]:
        snap = self._snapshot
        pending: dict[tuple[str, int, str], _Pending] = {}
        refused: set[tuple[str, int, str]] = set()
        finished: set[tuple[str, int, str]] = set()  # returned (a row of it again is refused)
        for entry in self._entries():
            shard = snap._gated(entry)
            if shard.version != MULTI_AGENT_SHARD_FORMAT_VERSION:
                continue  # a single-agent policy whose name holds a '.'
            with naming_errors(snap.storage.uri(entry.path)):
                rows = read_agent_rows(shard)
            if snap.filtered:
                kept = set(
                    snap._keeps(
                        entry, [r.episode_id for r in rows], {r.episode_id: r.multi_agent_episode_id for r in rows}
                    )
                )
                rows = [r for r in rows if r.episode_id in kept]
            digests: dict[int, bytes] = {}
            counts = Counter((r.multi_agent_episode_id, r.agent_id) for r in rows)
            for (ma_id, agent), n in counts.items():
                key = (entry.topic, entry.partition, ma_id)
                if n > 1 and key not in refused:
                    refused.add(key)
                    p = pending.pop(key, None)
                    self._held -= p.held_bytes if p is not None else 0
                    self._refuse(
                        ma_id,
                        MultiAgentRecordError(f"multi-agent episode {ma_id}: agent {agent!r:.40}'s row appears twice"),
                    )
            for row in rows:
                if row.policy_id != entry.policy_id:
                    raise EpisodeDecodeError(
                        f"{snap.storage.uri(entry.path)}: row {row.index}'s policy id {row.policy_id!r:.80} "
                        "is not its folder's"
                    )
                key = (entry.topic, entry.partition, row.multi_agent_episode_id)
                if key in refused:
                    continue
                if key in finished:  # returned already: its agent's row again
                    refused.add(key)
                    self._refuse(
                        key[2], MultiAgentRecordError(f"multi-agent episode {key[2]}: a row after it was whole")
                    )
                    continue
                digest = digests.get(id(row.record))
                if digest is None:
                    digest = digests[id(row.record)] = hashlib.sha256(row.record).digest()
                try:
                    p = pending.get(key)
                    if p is None:
                        p = pending[key] = _Pending(row)
                    hold = self._held + _size(row) <= MAX_PENDING_DECODED_BYTES
                    before = p.held_bytes
                    done = p.add(row, entry, hold, digest)
                    self._held += p.held_bytes - before
                    if not done:
                        continue
                    del pending[key]
                    finished.add(key)
                    self._held -= p.held_bytes
                    ep = self._assemble(key, p)
                except MultiAgentRecordError as e:
                    refused.add(key)
                    p = pending.pop(key, None)
                    self._held -= p.held_bytes if p is not None else 0
                    self._refuse(key[2], e)
                    continue
                yield ep
        yield from self._from_earlier(pending, refused)

    # ---------------------------------------------------------------------- completing episodes
    def _reread(self, entry: ShardEntry, indexes: list[int]) -> list[AgentRow]:
        shard = self._shard(entry)
        with naming_errors(self._snapshot.storage.uri(entry.path)):
            return read_agent_rows(shard, indexes)

    def _assemble(self, key: tuple[str, int, str], p: _Pending) -> Any:
        rows = {a: r for a, r in p.rows.items() if r is not None}
        by_entry: dict[str, tuple[ShardEntry, dict[int, str]]] = {}
        for a, r in p.rows.items():
            if r is None:
                entry, index = p.places[a]
                by_entry.setdefault(entry.path, (entry, {}))[1][index] = a
        for entry, want in by_entry.values():
            for row in self._reread(entry, list(want)):
                if want.get(row.index) != row.agent_id or hashlib.sha256(row.record).digest() != p.digest:
                    raise MultiAgentRecordError(f"multi-agent episode {key[2]}: a row read again differs")
                rows[row.agent_id] = row
        record, carried = unpack_record(next(iter(rows.values())).record)
        agents = {a: r.episode for a, r in rows.items()}
        agents.update({a: unpack_episode(b) for a, b in carried.items()})
        return assemble_episode(agents, record, key[2], self._mapping_fn)

    def _from_earlier(self, pending: dict[tuple[str, int, str], _Pending], refused: set) -> Iterator[Any]:
        """Complete the partial episodes whose other rows were committed before the snapshot's
        entries, in the same partition log, before the row of them it holds last; count the rest."""
        snap = self._snapshot
        logs = snap._logs or {}
        left: list[str] = []
        by_log: dict[tuple[str, int], list[tuple[str, int, str]]] = {}
        for key in pending:
            by_log.setdefault(key[:2], []).append(key)
        for log_key, keys in sorted(by_log.items()):
            below = snap._point.positions.get(log_key, 0)
            entries = [e for e in logs.get(log_key, []) if e.seq < below]
            first_seq: dict[str, int] = {}  # agent episode id -> seq of the shard entry that committed it
            for e in entries:
                if isinstance(e, ShardEntry):
                    for i in e.episode_ids:
                        first_seq.setdefault(i, e.seq)
            holder_of = {h: shard for shard, held in live_holders(entries).values() for h in held}
            for key in keys:
                p = pending[key]
                seqs = {a: first_seq.get(agent_episode_id(key[2], a)) for a in p.wanted}
                have = [seqs[a] for a in p.rows]
                missing = {a: seqs[a] for a in p.wanted if a not in p.rows}
                if None in have or None in missing.values() or max(missing.values()) > max(have):  # type: ignore[type-var,operator]
                    left.append(key[2])
                    continue
                holders = {a: holder_of.get(s) for a, s in missing.items()}  # type: ignore[arg-type]
                if any(h is None or self._removed(h) for h in holders.values()):
                    left.append(key[2])
                    continue
                try:
                    for a, holder in holders.items():
                        ids = read_agent_ids(self._shard(holder))
                        index = next(i for i, row_ids in enumerate(ids) if row_ids[0] == agent_episode_id(key[2], a))
                        p.rows[a] = None
                        p.places[a] = (holder, index)
                    ep = self._assemble(key, p)
                except StopIteration:
                    left.append(key[2])
                    continue
                except MultiAgentRecordError as e:
                    refused.add(key)
                    self._refuse(key[2], e)
                    continue
                yield ep
        self.partial = len(left)
        if left:
            log.warning(
                "%d multi-agent episode(s) with rows in this snapshot are not whole in it (not returned), e.g. %s",
                len(left),
                ", ".join(i[:60] for i in left[:3]),
            )

    def _shard(self, entry: ShardEntry) -> Any:
        shard = self._shards.get(entry.path)
        if shard is None:
            self._shards = {entry.path: (shard := self._snapshot._gated(entry))}
        return shard

    def _removed(self, entry: ShardEntry) -> bool:
        from rlrec.store.point_removals import _deleted

        snap = self._snapshot
        return (entry.topic, entry.partition, entry.seq) in snap._removed and _deleted(snap.storage, entry)


def multi_agent_episodes(snapshot: Any, mapping_fn: Callable | None = None) -> MultiAgentEpisodes:
    """Every whole multi-agent episode of `snapshot` whose last-committed row it holds, in the
    order its last row is read (those completed from rows committed before its entries last).

    Args:
        snapshot: a `rlrec.store.snapshot_reader.Snapshot`.
        mapping_fn: each episode's `agent_to_module_mapping_fn` (RLlib's ``fn(agent_id,
            episode)``); None: the modules the episode recorded.

    Returns:
        an iterator (`MultiAgentEpisodes`) whose ``refused`` and ``partial`` count the episodes
        it refused and left.

    Raises:
        rlrec.store.episodes.EpisodeDecodeError: a row is malformed (its shard named).
        rlrec.store.schema_gate.ShardSchemaError: a shard is refused by the schema gate, its
            entry's format version is not the file's, or a folder mixes versions 1 and 2.
    """
    return MultiAgentEpisodes(snapshot, mapping_fn)
