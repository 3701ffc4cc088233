"""The hand-off of a multi-agent episode's agent rows from assembly to the shard committer.

A multi-agent episode that ended becomes one `FinishedAgentRow` per agent episode (each with the
deterministic id `rlrec.consumer.multi_agent_reference.agent_episode_id` gives it): the unit the
commit protocol (`rlrec.store.commit.ShardCommitter`) commits, dedups and resumes by, exactly as
a single-agent `FinishedEpisode`. Its ``policy_id`` is its module's (``{policy_id}.{module_id}``),
so the committer groups a module's rows into one version-2 shard (`encode_agent_rows`); every row
of an episode carries the episode's first and last Kafka offsets, so the partition's resume
offset stays before the episode's first event until all of its rows are committed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlrec.store.finished import ACTION_LOGP
from rlrec.store.multi_agent_shards import MultiAgentShardEpisode, encode_multi_agent_shards, module_policy_id
from rlrec.store.shards import EncodedShard

__all__ = ["FinishedAgentRow", "agent_rows_of", "encode_agent_rows"]

_OVERHEAD_BYTES = 512


@dataclass
class FinishedAgentRow:
    """One agent episode of a finished multi-agent episode, ready to be committed.

    Args:
        episode: the multi-agent episode it belongs to (its ``rows`` hold this agent's episode).
        agent_id: the agent.
        finished_at: consumer wall clock (time.time()) when the multi-agent episode ended.
    """

    episode: MultiAgentShardEpisode
    agent_id: str
    finished_at: float = 0.0
    _nbytes: int | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def agent_episode(self) -> Any:
        """The agent's `SingleAgentEpisode`."""
        return self.episode.rows[self.agent_id]

    @property
    def episode_id(self) -> str:
        """The agent episode's id (deterministic: the same on every assembly of the episode)."""
        return self.agent_episode.id_

    @property
    def multi_agent_episode_id(self) -> str:
        return self.episode.episode_id

    @property
    def policy_id(self) -> str:
        """Where the row is stored: ``{policy_id}.{module_id}``."""
        return module_policy_id(self.episode.policy_id, self.agent_episode.module_id)

    @property
    def policy_version(self) -> int:
        return self.episode.policy_version

    @property
    def env_id(self) -> str:
        return self.episode.env_id

    @property
    def first_offset(self) -> int:
        return self.episode.first_offset

    @property
    def last_offset(self) -> int:
        return self.episode.last_offset

    @property
    def started_ms(self) -> int:
        return self.episode.started_ms

    @property
    def ended_ms(self) -> int:
        return self.episode.ended_ms

    @property
    def length(self) -> int:
        """The agent's steps."""
        return len(self.agent_episode)

    @property
    def extra_model_outputs(self) -> dict:
        """The names of the agent's extra model outputs (values not needed by the committer)."""
        return dict.fromkeys(self.agent_episode.extra_model_outputs.keys())

    @property
    def has_logp(self) -> bool:
        return ACTION_LOGP in self.agent_episode.extra_model_outputs

    def nbytes(self) -> int:
        """Approximate memory of the agent episode's arrays (for the consumer's memory bounds)."""
        if self._nbytes is None:
            sa = self.agent_episode
            n = _OVERHEAD_BYTES + len(self.episode.record) // max(1, len(self.episode.rows))
            for buf in (sa.observations, sa.actions, sa.rewards):
                n += _buffer_nbytes(buf)
            for buf in sa.extra_model_outputs.values():
                n += _buffer_nbytes(buf)
            self._nbytes = n
        return self._nbytes


def _buffer_nbytes(buf: Any) -> int:
    data = getattr(buf, "data", buf)
    if isinstance(data, np.ndarray):
        return data.nbytes
    try:
        return sum(np.asarray(x).nbytes for x in data) + 8 * len(data)
    except Exception:  # nested (Dict/Tuple) values: a rough count
        return 64 * len(data)


def agent_rows_of(episode: MultiAgentShardEpisode, finished_at: float = 0.0) -> list[FinishedAgentRow]:
    """The agent rows of `episode`, in agent order.

    Args:
        episode: a multi-agent episode ready for shards.
        finished_at: when it ended (consumer wall clock).

    Example:
        >>> # see tests/test_multi_agent_consumer.py: rows of a folded, split recording
    """
    return [FinishedAgentRow(episode, a, finished_at) for a in episode.rows]


def encode_agent_rows(rows: list[FinishedAgentRow], compression: str = "zstd") -> EncodedShard:
    """One version-2 ``episodes`` shard of agent rows of one module policy id.

    Args:
        rows: agent rows, all with the same ``policy_id``.
        compression: any Parquet codec.

    Raises:
        ValueError: rows of more than one policy id, an agent episode not done or empty, an id twice.
    """
    parts = [dataclasses.replace(r.episode, rows={r.agent_id: r.agent_episode}) for r in rows]
    shards = encode_multi_agent_shards(parts, compression=compression)
    if len(shards) != 1:
        raise ValueError(f"agent rows of {len(shards)} policy ids in one shard")
    return next(iter(shards.values()))
