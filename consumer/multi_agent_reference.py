"""The reference builder: a `MultiAgentRecording` -> RLlib's own `MultiAgentEpisode`, by replay.

`reference_episode` replays the recorded per-env-step dicts through
`MultiAgentEpisode.add_env_reset` / `add_env_step` (ray 2.60), so RLlib itself decides every
per-agent detail: the env-step -> agent-step map with its skip tags, actions and rewards "hanging"
until an agent's next observation, rewards before an agent's first observation
(`_hanging_rewards_begin`), the episode's flags (all agents done -> terminated). It is exact and
slow (~20 µs per agent step): the oracle of the fast split (`rlrec.consumer.multi_agent_split`)
and its fallback for turn-based (AEC) and hanging cases.

What RLlib does at random is made deterministic: each agent's `SingleAgentEpisode.id_` is
`agent_episode_id(multi-agent id, agent id)`; the wall-clock timers (`_start_time`,
`_last_step_time`) are cleared (None), as in single-agent shards.

A recording RLlib refuses (an agent acting after it was done, one truncated with an action
hanging, an episode that never ends, an agent the recording does not map to a module) raises
`MultiAgentDataError` with a `reason` code: a data error, one dead letter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlrec.producer.events import POLICY_ID_RE
from rlrec.producer.multi_agent_recording import MultiAgentRecording
from rlrec.store.multi_agent_shards import agent_episode_id

__all__ = [
    "MAX_AGENT_ID_CHARS",
    "MultiAgentDataError",
    "agent_custom_data",
    "agent_episode_id",
    "check_recording",
    "finish",
    "reference_episode",
]

#: the longest agent id accepted (agent ids are stored in every row of their agent)
MAX_AGENT_ID_CHARS = 128


class MultiAgentDataError(ValueError):
    """A multi-agent recording RLlib's `MultiAgentEpisode` cannot hold; `reason` is a short code.

    Args:
        reason: one of ``no_agents``, ``bad_agent_id``, ``bad_module_id`` (``{policy_id}.{module_id}``
            cannot name a directory, or the module id holds a ``.``), ``unknown_agent``, ``not_done``, ``rllib_refused`` (RLlib's
            `MultiAgentEnvError` or assertion), ``inconsistent`` (a step after the end),
            ``no_agent_steps`` (no agent finished a step: nothing to store as a row),
            ``record_too_large`` (the record with its carried agents is over
            `rlrec.store.multi_agent_episode.MAX_RECORD_BYTES`).
        detail: what was wrong, for the dead letter.

    Example:
        >>> e = MultiAgentDataError("not_done", "episode ep-1 never ended")
        >>> e.reason, str(e)
        ('not_done', 'not_done: episode ep-1 never ended')
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}"[:1000])
        self.reason = reason


def _agent_ids_of(rec: MultiAgentRecording) -> set[str]:
    seen = set(rec.reset.observations) | set(rec.reset.infos)
    for s in rec.steps:
        for d in (s.actions, s.rewards, s.observations, s.terminateds, s.truncateds, s.infos, s.extra_model_outputs):
            seen.update(d)
    seen.discard("__all__")
    return seen


def check_recording(rec: MultiAgentRecording) -> None:
    """Raise `MultiAgentDataError` unless every agent id in `rec` is a string the recording maps
    to a module (what both builders assume before they start).

    Args:
        rec: the recording.

    Example:
        >>> import numpy as np
        >>> from rlrec.producer.multi_agent_recording import MultiAgentRecording, MultiAgentReset
        >>> rec = MultiAgentRecording("ep", "p", 0, {"a0": "m"}, MultiAgentReset({"a1": np.zeros(1)}))
        >>> try:
        ...     check_recording(rec)
        ... except MultiAgentDataError as e:
        ...     print(e.reason)
        unknown_agent
    """
    if not rec.agent_modules:
        raise MultiAgentDataError("no_agents", f"episode {rec.episode_id}: no agents")
    for aid, mid in rec.agent_modules.items():
        if not isinstance(aid, str) or not 0 < len(aid) <= MAX_AGENT_ID_CHARS or aid == "__all__":
            raise MultiAgentDataError("bad_agent_id", f"episode {rec.episode_id}: agent id {aid!r:.80}")
        # a module's rows are stored under the policy id {policy_id}.{module_id}: a directory name
        # (no '.' in a module id: else policy "a.b" module "c" and policy "a" module "b.c" share a folder)
        if not isinstance(mid, str) or not mid or "." in mid or not POLICY_ID_RE.match(f"{rec.policy_id}.{mid}"):
            raise MultiAgentDataError(
                "bad_module_id",
                f"episode {rec.episode_id}: {rec.policy_id!r:.60}.{mid!r:.60} is no policy id ({POLICY_ID_RE.pattern}) or the module id holds a '.'",
            )
    unknown = _agent_ids_of(rec) - set(rec.agent_modules)
    if unknown:
        raise MultiAgentDataError(
            "unknown_agent", f"episode {rec.episode_id}: agents {sorted(map(str, unknown))[:5]} have no module"
        )


def _MultiAgentEpisode():
    from ray.rllib.env.multi_agent_episode import MultiAgentEpisode

    return MultiAgentEpisode


def default_mapping_fn(rec: MultiAgentRecording) -> Callable[[str, Any], str]:
    """The agent -> module function of a recording: its own `agent_modules`."""
    modules = dict(rec.agent_modules)
    return lambda agent_id, episode=None: modules[agent_id]


def _abort(ep: Any) -> None:
    """An aborted, unfinished episode ends truncated: every unfinished agent truncated, hanging
    values dropped (docs/FORMAT.md, EpisodeAbort)."""
    ep.is_truncated = True
    for sa in ep.agent_episodes.values():
        if not sa.is_done:
            sa.is_truncated = True
    for cache in (
        ep._hanging_actions_end,
        ep._hanging_extra_model_outputs_end,
        ep._hanging_rewards_end,
        ep._hanging_rewards_begin,
    ):
        cache.clear()


def reference_episode(rec: MultiAgentRecording, mapping_fn: Callable | None = None) -> Any:
    """Replay `rec` through RLlib's `MultiAgentEpisode` (list form, as RLlib samples it).

    Args:
        rec: the recording (a done episode, or `aborted`).
        mapping_fn: the episode's `agent_to_module_mapping_fn` (RLlib's signature
            ``fn(agent_id, episode)``); None: the recording's `agent_modules`. Either way the
            modules the episode records (`_agent_to_module_mapping`) are the recording's.

    Raises:
        MultiAgentDataError: the recording is one RLlib refuses, or it never ends.

    Example:
        >>> import numpy as np
        >>> from rlrec.producer.multi_agent_recording import (
        ...     MultiAgentEnvStep, MultiAgentRecording, MultiAgentReset)
        >>> rec = MultiAgentRecording("ep-1", "p", 0, {"a0": "m0"},
        ...     MultiAgentReset({"a0": np.zeros(2, np.float32)}),
        ...     [MultiAgentEnvStep({"a0": 1}, {"a0": 1.0}, {"a0": np.ones(2, np.float32)},
        ...                        {"__all__": True}, {"__all__": False})])
        >>> ep = reference_episode(rec)
        >>> ep.is_terminated, len(ep.agent_episodes["a0"]), ep.agent_episodes["a0"].module_id
        (True, 1, 'm0')
    """
    from ray.rllib.utils.error import MultiAgentEnvError

    check_recording(rec)
    ep = _MultiAgentEpisode()(
        id_=rec.episode_id,
        observation_space=dict(rec.observation_spaces or {}),
        action_space=dict(rec.action_spaces or {}),
        agent_to_module_mapping_fn=default_mapping_fn(rec),
    )
    try:
        ep.add_env_reset(observations=dict(rec.reset.observations), infos=dict(rec.reset.infos))
        for i, s in enumerate(rec.steps):
            if ep.is_done:
                raise MultiAgentDataError("inconsistent", f"episode {rec.episode_id}: step {i} after its end")
            ep.add_env_step(
                dict(s.observations),
                dict(s.actions),
                dict(s.rewards),
                dict(s.infos),
                terminateds=dict(s.terminateds),
                truncateds=dict(s.truncateds),
                extra_model_outputs={k: dict(v) for k, v in s.extra_model_outputs.items()},
            )
    except MultiAgentDataError:
        raise
    except (MultiAgentEnvError, AssertionError, KeyError, TypeError, ValueError) as e:
        raise MultiAgentDataError("rllib_refused", f"episode {rec.episode_id}: {type(e).__name__}: {e}"[:500]) from None
    if not ep.is_done:
        if not rec.aborted:
            raise MultiAgentDataError("not_done", f"episode {rec.episode_id}: neither terminated nor truncated")
        _abort(ep)
    finish(ep, rec, mapping_fn)
    return ep


def finish(ep: Any, rec: MultiAgentRecording, mapping_fn: Callable | None) -> None:
    """What both builders do last: deterministic agent episode ids, no timers, the recording's
    identity in `custom_data` (each agent's under its module's policy id
    ``{policy_id}.{module_id}``, as single-agent rows carry theirs), the caller's mapping function."""
    for aid, sa in ep.agent_episodes.items():
        sa.id_ = agent_episode_id(rec.episode_id, aid)
        sa._start_time = sa._last_step_time = None
        sa._custom_data = agent_custom_data(rec, sa.module_id)
    ep._start_time = ep._last_step_time = None
    ep._custom_data = {"policy_id": rec.policy_id, "policy_version": int(rec.policy_version), "env_id": rec.env_id}
    # the spaces of the agents in the episode (its rows carry them), not of every possible agent
    ep.observation_space = {a: ep.observation_space[a] for a in ep.agent_episodes if a in ep.observation_space}
    ep.action_space = {a: ep.action_space[a] for a in ep.agent_episodes if a in ep.action_space}
    if mapping_fn is not None:
        ep.agent_to_module_mapping_fn = mapping_fn


def agent_custom_data(rec: MultiAgentRecording, module_id: str) -> dict:
    """An agent episode's `custom_data`: its module's policy id ``{policy_id}.{module_id}``,
    the policy version and the env id, as single-agent rows carry theirs."""
    return {
        "policy_id": f"{rec.policy_id}.{module_id}",
        "policy_version": int(rec.policy_version),
        "env_id": rec.env_id,
    }
