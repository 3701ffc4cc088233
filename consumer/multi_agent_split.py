"""The fast path: a `MultiAgentRecording` -> one `SingleAgentEpisode` per agent plus the
multi-agent record, the plain data that rebuilds RLlib's `MultiAgentEpisode` around them.

`split_recording` builds each agent's episode (list form, what RLlib's `MultiAgentEpisode`
holds for that agent after `add_env_reset` / `add_env_step`) directly, with one
`SingleAgentEpisode` constructor call per agent, when the recording is *direct*: the agents
present at reset are the only ones, and at every env step every agent still running acts,
observes and is rewarded, and nothing else (no agent appears late, acts without an observation
or is rewarded before its first one). Everything else -- turn-based (AEC) envs, hanging actions,
late joins, aborts, anything RLlib might refuse -- is replayed through RLlib by
`rlrec.consumer.multi_agent_reference.reference_episode` and split from its result. Either way
the result is the same (tests/test_multi_agent_split.py compares both on every env case).

The record (`MultiAgentSplit.record`, docs/FORMAT.md "Multi-agent rows") holds the fields of
`MultiAgentEpisode.get_state()` that are not in the agents' episodes: env_t_started, env_t,
agent_t_started, env_t_to_agent_t (per agent: env step -> agent step or "S"), the agent ->
module map, the hanging caches and the flags; and, for the agents whose episode cannot be a
training row (not done, or no step: stock RLlib refuses such episodes), their packed episodes
(``carried``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlrec.consumer.multi_agent_reference import (
    MultiAgentDataError,
    agent_custom_data,
    agent_episode_id,
    check_recording,
    reference_episode,
)
from rlrec.producer.multi_agent_recording import MultiAgentRecording
from rlrec.store.episodes import pack_episode
from rlrec.store.multi_agent_episode import RECORD_VERSION, SKIP, RecordTooLargeError, pack_record

__all__ = [
    "RECORD_VERSION",
    "MultiAgentSplit",
    "is_direct",
    "pack_split",
    "split_episode",
    "split_recording",
]

_ALL = "__all__"


@dataclass
class MultiAgentSplit:
    """One multi-agent episode split for storage.

    Args:
        rows: agent id -> its `SingleAgentEpisode`, done and with at least one step (a row).
        carried: agent id -> its `SingleAgentEpisode` that cannot be a row (not done or empty),
            kept in the record.
        record: the multi-agent fields (plain data; hanging actions may hold arrays).
        env_flags: agent id -> (terminated, truncated) as the env itself last flagged the agent.
        direct: True if built by the fast path.
    """

    rows: dict[str, Any]
    carried: dict[str, Any]
    record: dict
    env_flags: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    direct: bool = False


def is_direct(rec: MultiAgentRecording) -> bool:
    """True if the fast path may build `rec` (see module docstring).

    Args:
        rec: the recording.

    Example:
        >>> import numpy as np
        >>> from rlrec.producer.multi_agent_recording import (
        ...     MultiAgentEnvStep, MultiAgentRecording, MultiAgentReset)
        >>> o = np.zeros(1)
        >>> rec = MultiAgentRecording("e", "p", 0, {"a": "m"}, MultiAgentReset({"a": o}),
        ...     [MultiAgentEnvStep({"a": 0}, {"a": 1.0}, {"a": o}, {"__all__": True})])
        >>> is_direct(rec)
        True
        >>> rec.steps[0].observations = {}
        >>> is_direct(rec)
        False
    """
    alive = set(rec.reset.observations)
    if not alive or rec.aborted or not rec.steps or not set(rec.reset.infos) <= alive:
        return False
    extra_keys: dict[str, frozenset] = {}
    for i, s in enumerate(rec.steps):
        if not alive:
            return False  # a step after every agent was done
        if set(s.actions) != alive or set(s.observations) != alive or set(s.rewards) != alive:
            return False
        if not (set(s.infos) <= alive and set(s.extra_model_outputs) <= alive):
            return False
        if not (set(s.terminateds) - {_ALL} <= alive and set(s.truncateds) - {_ALL} <= alive):
            return False
        for aid in alive:
            keys = frozenset(s.extra_model_outputs.get(aid) or ())
            if extra_keys.setdefault(aid, keys) != keys:
                return False
        ended = s.terminateds.get(_ALL, False) or s.truncateds.get(_ALL, False)
        alive = {a for a in alive if not (s.terminateds.get(a) or s.truncateds.get(a))}
        if ended and i != len(rec.steps) - 1:
            return False
    return not alive or bool(ended)


def _SingleAgentEpisode():
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    return SingleAgentEpisode


def _direct(rec: MultiAgentRecording) -> tuple[dict[str, Any], dict]:
    """(agent episodes, record) of a direct recording, built without replay."""
    SingleAgentEpisode = _SingleAgentEpisode()
    agents = list(rec.reset.observations)
    obs = {a: [rec.reset.observations[a]] for a in agents}
    infos = {a: [rec.reset.infos.get(a) or {}] for a in agents}
    acts: dict[str, list] = {a: [] for a in agents}
    rews: dict[str, list] = {a: [] for a in agents}
    extra: dict[str, dict[str, list]] = {a: {} for a in agents}
    flags: dict[str, tuple[bool, bool]] = {}
    alive = set(agents)
    ep_term = ep_trunc = False
    for s in rec.steps:
        ep_term = s.terminateds.get(_ALL, False)
        ep_trunc = s.truncateds.get(_ALL, False)
        done_now = {a for a in alive if s.terminateds.get(a) or s.truncateds.get(a)}
        if not (alive - done_now):  # every agent done: RLlib declares the episode terminated
            ep_term = True
        for a in alive:
            obs[a].append(s.observations[a])
            acts[a].append(s.actions[a])
            rews[a].append(s.rewards[a] or 0.0)
            infos[a].append(s.infos.get(a) or {})
            for k, v in (s.extra_model_outputs.get(a) or {}).items():
                extra[a].setdefault(k, []).append(v)
            if a in done_now or ep_term or ep_trunc:
                flags[a] = (bool(s.terminateds.get(a, False) or ep_term), bool(s.truncateds.get(a, False) or ep_trunc))
        alive -= done_now
        if ep_term or ep_trunc:
            alive = set()
    obs_spaces = rec.observation_spaces or {}
    act_spaces = rec.action_spaces or {}
    episodes = {}
    for a in agents:
        term, trunc = flags.get(a, (False, False))
        episodes[a] = SingleAgentEpisode(
            id_=agent_episode_id(rec.episode_id, a),
            agent_id=a,
            module_id=rec.agent_modules[a],
            multi_agent_episode_id=rec.episode_id,
            observations=obs[a],
            observation_space=obs_spaces.get(a),
            infos=infos[a],
            actions=acts[a],
            action_space=act_spaces.get(a),
            rewards=rews[a],
            terminated=term,
            truncated=trunc,
            extra_model_outputs=extra[a] or None,
            t_started=0,
            len_lookback_buffer=0,
        )
    env_t = len(rec.steps)
    record = {
        "v": RECORD_VERSION,
        "env_t_started": 0,
        "env_t": env_t,
        "agent_t_started": dict.fromkeys(agents, 0),
        "env_t_to_agent_t": {
            a: {"data": [*range(len(acts[a]) + 1), *([SKIP] * (env_t - len(acts[a])))], "lookback": 0} for a in agents
        },
        "modules": {a: rec.agent_modules[a] for a in agents},
        "hanging_actions_end": {},
        "hanging_extra_model_outputs_end": {},
        "hanging_rewards_end": {},
        "hanging_rewards_begin": {},
        "is_terminated": bool(ep_term),
        "is_truncated": bool(ep_trunc),
        "agents": agents,
    }
    return episodes, record


def _record_of(ep: Any) -> dict:
    """The multi-agent fields of a replayed `MultiAgentEpisode`, as plain data."""

    def mapping(buf: Any) -> dict:
        return {"data": list(buf.data), "lookback": int(buf.lookback)}

    return {
        "v": RECORD_VERSION,
        "env_t_started": int(ep.env_t_started),
        "env_t": int(ep.env_t),
        "agent_t_started": {a: int(t) for a, t in ep.agent_t_started.items()},
        "env_t_to_agent_t": {a: mapping(b) for a, b in ep.env_t_to_agent_t.items()},
        "modules": dict(ep._agent_to_module_mapping),
        "hanging_actions_end": dict(ep._hanging_actions_end),
        "hanging_extra_model_outputs_end": {a: dict(v) for a, v in ep._hanging_extra_model_outputs_end.items()},
        "hanging_rewards_end": {a: float(r) for a, r in ep._hanging_rewards_end.items()},
        "hanging_rewards_begin": {a: float(r) for a, r in ep._hanging_rewards_begin.items()},
        "is_terminated": bool(ep.is_terminated),
        "is_truncated": bool(ep.is_truncated),
        "agents": list(ep.agent_episodes),
        "custom_data": dict(ep.custom_data),
    }


def _env_flags(rec: MultiAgentRecording, agents: list[str]) -> dict[str, tuple[bool, bool]]:
    """agent -> (terminated, truncated) as the env last gave them for the agent."""
    flags = dict.fromkeys(agents, (False, False))
    for s in rec.steps:
        for a in agents:
            if a in s.terminateds or a in s.truncateds:
                flags[a] = (bool(s.terminateds.get(a, False)), bool(s.truncateds.get(a, False)))
    return flags


def _partition(episodes: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    rows = {a: e for a, e in episodes.items() if e.is_done and len(e) >= 1}
    return rows, {a: e for a, e in episodes.items() if a not in rows}


def split_episode(ep: Any, rec: MultiAgentRecording) -> MultiAgentSplit:
    """Split a `MultiAgentEpisode` built from `rec` (e.g. by `reference_episode`).

    Args:
        ep: the episode, finished by `rlrec.consumer.multi_agent_reference.finish`.
        rec: the recording it was built from (for the env's own per-agent flags).
    """
    rows, carried = _partition(dict(ep.agent_episodes))
    if not rows:
        raise MultiAgentDataError("no_agent_steps", f"episode {rec.episode_id}: no agent finished a step")
    return MultiAgentSplit(rows, carried, _record_of(ep), _env_flags(rec, list(ep.agent_episodes)))


def split_recording(rec: MultiAgentRecording, mapping_fn: Callable | None = None) -> MultiAgentSplit:
    """Split `rec` into per-agent episodes and the multi-agent record: directly when
    `is_direct(rec)`, else by replaying it through RLlib (`reference_episode`).

    Args:
        rec: the recording.
        mapping_fn: passed to `reference_episode` on the replay path (not stored).

    Raises:
        MultiAgentDataError: a recording RLlib refuses, or one in which no agent finished a step.

    Example:
        >>> import numpy as np
        >>> from rlrec.producer.multi_agent_recording import (
        ...     MultiAgentEnvStep, MultiAgentRecording, MultiAgentReset)
        >>> o = np.zeros(1, np.float32)
        >>> rec = MultiAgentRecording("e", "p", 0, {"a": "m", "b": "m"},
        ...     MultiAgentReset({"a": o, "b": o}),
        ...     [MultiAgentEnvStep({"a": 0, "b": 1}, {"a": 1.0, "b": 0.0}, {"a": o, "b": o},
        ...                        {"__all__": True})])
        >>> s = split_recording(rec)
        >>> s.direct, sorted(s.rows), s.record["env_t_to_agent_t"]["a"]["data"]
        (True, ['a', 'b'], [0, 1])
    """
    if not is_direct(rec):
        return split_episode(reference_episode(rec, mapping_fn), rec)
    check_recording(rec)
    episodes, record = _direct(rec)
    for sa in episodes.values():
        sa._custom_data = agent_custom_data(rec, sa.module_id)
    record["custom_data"] = {
        "policy_id": rec.policy_id,
        "policy_version": int(rec.policy_version),
        "env_id": rec.env_id,
    }
    rows, carried = _partition(episodes)
    return MultiAgentSplit(rows, carried, record, _env_flags(rec, list(episodes)), direct=True)


def pack_split(split: MultiAgentSplit) -> bytes:
    """The ``multi_agent_record`` bytes of `split`: its record with its carried agent episodes.

    Args:
        split: what `split_recording` returned.

    Raises:
        MultiAgentDataError: ``record_too_large``: over
            `rlrec.store.multi_agent_episode.MAX_RECORD_BYTES` (readers would refuse it).

    Example:
        >>> import numpy as np
        >>> from rlrec.producer.multi_agent_recording import (
        ...     MultiAgentEnvStep, MultiAgentRecording, MultiAgentReset)
        >>> o = np.zeros(1, np.float32)
        >>> rec = MultiAgentRecording("e", "p", 0, {"a": "m"}, MultiAgentReset({"a": o}),
        ...     [MultiAgentEnvStep({"a": 0}, {"a": 1.0}, {"a": o}, {"__all__": True})])
        >>> len(pack_split(split_recording(rec))) > 0
        True
    """
    try:
        return pack_record(split.record, {a: pack_episode(e) for a, e in split.carried.items()})
    except RecordTooLargeError as e:
        raise MultiAgentDataError("record_too_large", str(e)) from None
