"""`Snapshot.multi_agent_episodes`: RLlib `MultiAgentEpisode`s rebuilt from a snapshot's
multi-agent rows, each only once every one of its agent rows is committed in the snapshot.

A multi-agent episode's rows lie in one shard per module (`rlrec.store.multi_agent_shards`),
committed one after another, so a snapshot taken between two of those commits holds some of its
rows. Each row carries the episode's record, which lists its agents (``agents``) and holds the
ones that are not rows (``carried``): an episode is complete when a row of every other listed
agent is in the snapshot, and only complete episodes are returned (docs/GUARANTEES.md,
"Multi-agent episodes are whole").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from rlrec.store.episodes import unpack_episode
from rlrec.store.multi_agent_episode import MultiAgentRecordError, assemble_episode, unpack_record
from rlrec.store.multi_agent_shards import AgentRow, read_agent_rows
from rlrec.store.schema_gate import MULTI_AGENT_SHARD_FORMAT_VERSION
from rlrec.store.steps_table import naming_errors

__all__ = ["multi_agent_episodes"]


class _Pending:
    """The rows of one multi-agent episode seen so far, and what completes it."""

    __slots__ = ("carried", "record", "record_bytes", "rows", "wanted")

    def __init__(self, row: AgentRow) -> None:
        self.record_bytes = row.record
        self.record, self.carried = unpack_record(row.record)
        self.wanted = set(self.record["agents"]) - set(self.carried)
        self.rows: dict[str, Any] = {}

    def add(self, row: AgentRow) -> bool:
        """Take `row`; True once every agent row is here."""
        if row.record != self.record_bytes:
            raise MultiAgentRecordError(
                f"multi-agent episode {row.multi_agent_episode_id}: agent {row.agent_id!r:.40}'s row "
                "carries a different record"
            )
        if row.agent_id not in self.wanted:
            raise MultiAgentRecordError(
                f"multi-agent episode {row.multi_agent_episode_id}: agent {row.agent_id!r:.40} is not one of its rows"
            )
        self.rows.setdefault(row.agent_id, row.episode)
        return len(self.rows) == len(self.wanted)


def multi_agent_episodes(snapshot: Any, mapping_fn: Callable | None = None) -> Iterator[Any]:
    """Every complete multi-agent episode of `snapshot`, in the order its last row is read.

    Args:
        snapshot: a `rlrec.store.snapshot.Snapshot`.
        mapping_fn: each episode's `agent_to_module_mapping_fn` (RLlib's ``fn(agent_id,
            episode)``); None: the modules the episode recorded.

    Raises:
        rlrec.store.episodes.EpisodeDecodeError: a row or record is malformed (its shard named).
        rlrec.store.schema_gate.ShardSchemaError: a shard is refused by the schema gate.
    """
    pending: dict[str, _Pending] = {}
    for entry in snapshot.entries:
        if entry.format != "episodes" or entry.format_version != MULTI_AGENT_SHARD_FORMAT_VERSION:
            continue
        where = snapshot.storage.uri(entry.path)
        shard = snapshot._gated(entry)
        with naming_errors(where):
            rows = read_agent_rows(shard)
            if snapshot.filtered:
                kept = set(snapshot._keeps(entry, [r.episode.id_ for r in rows]))
                rows = [r for r in rows if r.episode.id_ in kept]
            for row in rows:
                ma_id = row.multi_agent_episode_id
                p = pending.get(ma_id)
                if p is None:
                    p = pending[ma_id] = _Pending(row)
                if p.add(row):
                    del pending[ma_id]
                    agents = dict(p.rows)
                    agents.update({a: unpack_episode(b) for a, b in p.carried.items()})
                    yield assemble_episode(agents, p.record, ma_id, mapping_fn)
