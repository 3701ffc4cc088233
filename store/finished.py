"""The hand-off between episode assembly (events -> episode) and shard writing.

The assembly code (the Kafka loop) fills a `FinishedEpisode` from decoded events; the shard
writer (`rlrec.store.shards.encode_shard`) and `rlrec.store.episodes.to_single_agent_episode` read it.
Arrays hold *leaves* (see `rlrec.producer.spaces.space_leaves`): one numpy array per
Box/Discrete/MultiDiscrete/MultiBinary part of a space, depth first, stacked along a leading
step axis. Nothing here imports Ray.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import gymnasium as gym
import numpy as np

__all__ = ["ACTION_LOGP", "EMPTY_INFO", "FinishedEpisode", "steps_without_logp"]

#: the extra model output holding the behaviour's log-propensity of each action
ACTION_LOGP = "action_logp"

#: the info of a step that has none: one immutable object shared by every such step, so a
#: buffered episode holds no per-step Python object for it (millions of empty dicts made the
#: garbage collector's passes over buffered episodes a large share of the consumer's time)
EMPTY_INFO: Mapping = MappingProxyType({})

# Rough fixed cost of one episode's Python objects (dataclass, lists, dict, strings).
_OVERHEAD_BYTES = 512


@dataclass
class FinishedEpisode:
    """A complete episode assembled from events, ready to be written."""

    episode_id: str
    policy_id: str
    policy_version: int
    env_id: str
    observation_space: gym.Space
    action_space: gym.Space
    observations: list[np.ndarray]  # leaves (rlrec.producer.spaces.space_leaves order), each stacked (T+1, *leaf_shape)
    actions: list[np.ndarray]  # leaves, each (T, *leaf_shape)
    rewards: np.ndarray  # float64 (T,)
    infos: list[Mapping]  # T+1 (infos[0] is the reset info); EMPTY_INFO where a step has none
    extra_model_outputs: dict[str, np.ndarray]  # each (T, ...)
    terminated: bool
    truncated: bool
    first_offset: int  # Kafka offset of the start event
    last_offset: int  # largest Kafka offset of any event applied to it
    started_ms: int  # producer wall clock of the start event
    ended_ms: int  # producer wall clock of the terminal step / abort
    finished_at: float = 0.0  # consumer wall clock (time.time()) when it finished
    _nbytes: int | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def length(self) -> int:
        """T, the number of steps (actions/rewards); there are T+1 observations."""
        return int(np.shape(self.rewards)[0])

    @property
    def episode_return(self) -> float:
        """Undiscounted sum of the rewards (0.0 for an empty episode)."""
        return float(np.sum(self.rewards, dtype=np.float64))

    def nbytes(self) -> int:
        """Approximate memory held: array bytes plus a small per-episode/per-info overhead.

        Meant for memory accounting of buffered episodes, not exact: non-empty infos are
        counted by `sys.getsizeof` of their top level plus their array values. Computed once: a
        finished episode's arrays and infos keep their sizes (delayed rewards change values).
        """
        if self._nbytes is None:
            self._nbytes = self._count_nbytes()
        return self._nbytes

    def _count_nbytes(self) -> int:
        n = _OVERHEAD_BYTES + len(self.episode_id) + len(self.policy_id) + len(self.env_id)
        for a in self.observations:
            n += a.nbytes
        for a in self.actions:
            n += a.nbytes
        n += np.asarray(self.rewards).nbytes
        for v in self.extra_model_outputs.values():
            n += np.asarray(v).nbytes
        n += 8 * len(self.infos)  # list slots
        for info in self.infos if any(self.infos) else ():
            if info:
                n += sys.getsizeof(info)
                for v in info.values():
                    if isinstance(v, np.ndarray):
                        n += v.nbytes
        return n


def steps_without_logp(episodes: Iterable[FinishedEpisode]) -> dict[str, int]:
    """Per policy version (a string, in order of first appearance), the steps of `episodes`
    that carry no behaviour propensity (no `ACTION_LOGP` extra model output; an episode has it
    at every step or at none). Every version of `episodes` is a key, 0 where none is missing.

    Args:
        episodes: finished episodes.

    Example:
        >>> from types import SimpleNamespace as E
        >>> steps_without_logp([E(policy_version=3, length=5, extra_model_outputs={}),
        ...                     E(policy_version=4, length=2, extra_model_outputs={"action_logp": None})])
        {'3': 5, '4': 0}
    """
    out: dict[str, int] = {}
    for fe in episodes:
        key = str(fe.policy_version)
        out[key] = out.get(key, 0) + (0 if ACTION_LOGP in fe.extra_model_outputs else fe.length)
    return out
