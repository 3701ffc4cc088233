"""``--prelearner-mode buffer`` for multi-agent rows: one RLlib episode buffer per module, whose
sampled episodes get back the agent and module ids RLlib's sampling drops.

RLlib's `EpisodeReplayBuffer` samples by ``SingleAgentEpisode.slice``, which keeps an episode's
``id_`` but not its ``agent_id``, ``module_id`` or ``multi_agent_episode_id``; without them the
multi-agent learner connector cannot route a row to its module (``AgentToModuleMapping``).
RLlib's `MultiAgentEpisodeReplayBuffer` keeps them but takes whole `MultiAgentEpisode`s, and a
multi-agent episode's agents lie in different module folders, so different shards and chunks:
no chunk holds a whole one. So each module gets its own buffer of its agent episodes, each
sample is drawn per module (every module present in every batch, as RLlib's multi-agent buffer
samples ``independent``-ly), and the ids are restored by episode id.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ModuleEpisodeBuffers"]


class ModuleEpisodeBuffers:
    """Per-module episode buffers for agent episodes (`SingleAgentEpisode`s that carry
    ``agent_id``, ``module_id`` and ``multi_agent_episode_id``).

    Args:
        make_buffer: builds one module's buffer (an RLlib `EpisodeReplayBuffer` or subclass).

    Example:
        >>> from ray.rllib.env.single_agent_episode import SingleAgentEpisode
        >>> from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
        >>> ep = SingleAgentEpisode(id_="e0", agent_id="agent_0", module_id="m", multi_agent_episode_id="ma0",
        ...     observations=[0, 1, 2], actions=[0, 1], rewards=[0.0, 1.0], terminated=True, len_lookback_buffer=0)
        >>> bufs = ModuleEpisodeBuffers(lambda: EpisodeReplayBuffer(capacity=100))
        >>> bufs.add([ep])
        >>> s = bufs.sample(num_items=4, n_step=1, sample_episodes=True)
        >>> sorted({(e.agent_id, e.module_id, e.multi_agent_episode_id) for e in s})
        [('agent_0', 'm', 'ma0')]
    """

    def __init__(self, make_buffer: Callable[[], Any]) -> None:
        self._make = make_buffer
        self._buffers: dict[str, Any] = {}
        #: module -> episode id -> (agent id, multi-agent episode id) of the episodes its buffer holds
        self._ids: dict[str, dict[str, tuple[Any, Any]]] = {}

    def get_num_timesteps(self) -> int:
        """The timesteps all modules' buffers hold."""
        return sum(b.get_num_timesteps() for b in self._buffers.values())

    def add(self, episodes: list) -> None:
        """Add agent episodes, each to its module's buffer; one its buffer already holds (by id),
        or a repeat in `episodes`, is not added again (RLlib's PreLearner does the same). The ids
        kept are those of the episodes the buffer holds after the add, even if the add raised."""
        by_module: dict[str, dict[str, Any]] = {}
        for ep in episodes:
            buf = self._buffers.get(ep.module_id)
            if buf is not None and ep.id_ in buf.episode_id_to_index:
                continue
            by_module.setdefault(ep.module_id, {}).setdefault(ep.id_, ep)
        for module, new in by_module.items():
            buf = self._buffers.get(module)
            if buf is None:
                buf = self._buffers[module] = self._make()
            try:
                buf.add(list(new.values()))
            finally:  # evicted ones go; added ones (all, or those a raising add got in) come
                held = buf.episode_id_to_index
                ids = {k: v for k, v in self._ids.get(module, {}).items() if k in held}
                ids.update({k: (ep.agent_id, ep.multi_agent_episode_id) for k, ep in new.items() if k in held})
                self._ids[module] = ids

    def sample(self, **kwargs: Any) -> list:
        """Sample every module's buffer with `kwargs` (`EpisodeReplayBuffer.sample`'s); the
        sampled episodes carry their source episode's agent, module and multi-agent episode ids."""
        out = []
        for module, buf in self._buffers.items():
            if buf.get_num_timesteps() == 0:
                continue
            ids = self._ids[module]
            for ep in buf.sample(**kwargs):
                ep.agent_id, ep.multi_agent_episode_id = ids[ep.id_]
                ep.module_id = module
                out.append(ep)
        return out
