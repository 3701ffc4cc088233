"""`MultiAgentRecordingWrapper`: records every reset/step of a multi-agent env through an
`EpisodeRecorder` - a PettingZoo Parallel env, a PettingZoo AEC env, or an RLlib `MultiAgentEnv`.

Neither PettingZoo nor Ray is imported: the env's kind is told by what it has (RLlib's
`MultiAgentEnv` by its class, AEC by `agent_selection`, Parallel by `possible_agents`).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Mapping
from typing import Any

from rlrec.producer.recorder import EpisodeRecorder, RecorderClosed

__all__ = ["MultiAgentRecordingWrapper"]

_REFUSED = (ValueError, TypeError, BufferError)  # what a recorder call raises when it records nothing


def _env_kind(env: Any) -> str:
    for cls in type(env).__mro__:
        if cls.__name__ == "MultiAgentEnv" and cls.__module__.startswith("ray.rllib"):
            return "rllib"
    if hasattr(type(env), "agent_iter") and hasattr(type(env), "last"):
        return "aec"
    if hasattr(env, "possible_agents"):
        return "parallel"
    raise TypeError(
        f"{type(env).__name__} is not a PettingZoo Parallel or AEC env or an RLlib MultiAgentEnv "
        "(it has no possible_agents)"
    )


class MultiAgentRecordingWrapper:
    """Wraps a multi-agent env so that each `reset()` begins a multi-agent episode and each env
    step is logged with `EpisodeRecorder.log_multi_agent_step`, keyed by agent id.

    The wrapper has the wrapped env's own API: Parallel and RLlib envs ``reset()`` and
    ``step(actions)`` with per-agent dicts; AEC envs ``reset()``, ``last()``, ``step(action)``
    (dead agents stepped with ``None``). An AEC env is recorded as RLlib's ``PettingZooEnv``
    presents it: one env step per action of a live agent, with the observation, cumulative
    reward, flags and info of the agents selected after it up to the next live one, and
    ``"__all__"`` true once every agent is gone. Anything else is passed through to the env.

    An episode is begun at its first step (a reset that is never stepped records nothing); a
    `reset()` while an episode is open aborts it (recorded as truncated), and so does `close()`.
    When the recorder refuses a step (an invalid value, a step RLlib's episode would refuse, a
    full buffer with ``on_overflow="raise"``), the wrapper aborts the episode - what was recorded
    ends there, truncated - re-raises the error, and records nothing more until the next reset.

    Args:
        env: the multi-agent env.
        recorder: the `EpisodeRecorder` (it stays open: it belongs to the caller).
        agent_modules: agent id -> module id (default: RLlib's ``"default_policy"`` for all).

    Example:
        >>> from mpe2 import simple_spread_v3  # doctest: +SKIP
        >>> env = MultiAgentRecordingWrapper(simple_spread_v3.parallel_env(), rec)  # doctest: +SKIP
        >>> obs, infos = env.reset(seed=0)  # doctest: +SKIP
        >>> obs, rew, term, trunc, infos = env.step({a: 0 for a in env.agents})  # doctest: +SKIP
    """

    def __init__(self, env: Any, recorder: EpisodeRecorder, agent_modules: Mapping[str, str] | None = None):
        self.env = env
        self.recorder = recorder
        self.kind = _env_kind(env)
        self.agent_modules = None if agent_modules is None else dict(agent_modules)
        self.episode_id: str | None = None  # the open (or not yet begun) episode
        self._start: tuple[dict, dict] | None = None  # reset dicts of an episode not begun yet
        self._recording = False  # the episode is recorded (not refused, not ended)
        self._outputs: Mapping[str, Mapping] | None = None
        self._aec_step: dict | None = None  # an AEC env step being collected

    def __getattr__(self, name: str) -> Any:
        if name == "env":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.env, name)

    # -- spaces ----------------------------------------------------------------------------------

    def _spaces(self) -> tuple[dict, dict]:
        env = self.env
        agents = list(env.possible_agents)
        if self.kind == "rllib":
            return (
                {a: env.get_observation_space(a) for a in agents},
                {a: env.get_action_space(a) for a in agents},
            )
        return {a: env.observation_space(a) for a in agents}, {a: env.action_space(a) for a in agents}

    def set_model_outputs(self, outputs: Mapping[str, Mapping[str, Any]] | None) -> None:
        """Extra model outputs of the next env step, per acting agent: ``{agent: {"action_logp": ...}}``."""
        self._outputs = outputs

    # -- episodes --------------------------------------------------------------------------------

    def reset(self, *args: Any, **kwargs: Any) -> Any:
        """Reset the env; an open episode is aborted, a new one begins at the first step."""
        out = self.env.reset(*args, **kwargs)
        self._abort("reset")
        self._outputs = None
        self._aec_step = None
        if self.kind == "aec":
            sel = self.env.agent_selection
            obs, infos = {sel: self.env.observe(sel)}, {sel: self.env.infos.get(sel, {})}
        else:
            obs, infos = out
        self.episode_id = uuid.uuid4().hex
        self._start = (copy.deepcopy(dict(obs)), copy.deepcopy(dict(infos)))
        self._recording = True
        return out

    def step(self, action: Any) -> Any:
        """Step the env and record the env step (see the class docstring)."""
        if self.kind == "aec":
            return self._aec(action)
        out = self.env.step(action)
        obs, rewards, terminateds, truncateds, infos = out
        self._log(action, obs, rewards, terminateds, truncateds, infos)
        return out

    def close(self) -> None:
        """Abort the open episode and close the env (the recorder stays open)."""
        self._abort("env-closed")
        self.env.close()

    # -- internals -------------------------------------------------------------------------------

    def _log(
        self, actions: Mapping, obs: Mapping, rewards: Mapping, terms: Mapping, truncs: Mapping, infos: Mapping
    ) -> None:
        outputs, self._outputs = self._outputs, None
        if not self._recording or self.episode_id is None:
            return
        rec = self.recorder
        try:
            if self._start is not None:
                start_obs, start_infos = self._start
                obs_spaces, act_spaces = self._spaces()
                rec.begin_multi_agent_episode(
                    start_obs,
                    start_infos,
                    episode_id=self.episode_id,
                    observation_spaces=obs_spaces,
                    action_spaces=act_spaces,
                    agent_modules=self.agent_modules,
                )
                self._start = None
            ended = rec.log_multi_agent_step(
                self.episode_id, obs, actions, rewards, terms, truncs, infos, extra_model_outputs=outputs
            )
        except _REFUSED:
            self._abort("refused-step")
            raise
        if ended:
            self._recording = False
            self.episode_id = None

    def _abort(self, reason: str) -> None:
        """Abort the open episode (if it was begun and not ended); record nothing more of it."""
        if self.episode_id is not None and self._start is None and self._recording:
            try:
                self.recorder.abort_episode(self.episode_id, reason=reason)
            except (ValueError, RecorderClosed):  # ended or aborted by the recorder already
                pass
        self._recording = False
        self.episode_id, self._start = None, None

    def _aec(self, action: Any) -> None:
        env = self.env
        agent = env.agent_selection
        dead = env.terminations.get(agent, False) or env.truncations.get(agent, False)
        env.step(action)
        if not dead:  # a live agent acted: a new env step begins
            self._aec_step = {"actions": {agent: action}, "obs": {}, "rew": {}, "term": {}, "trunc": {}, "info": {}}
        s = self._aec_step
        if s is None:
            return None
        if env.agents:
            sel = env.agent_selection
            if sel in s["obs"]:  # already collected (a dead agent stepped with None is selected again)
                return None
            obs, rew, term, trunc, info = env.last()
            s["obs"][sel], s["info"][sel] = copy.deepcopy(obs), copy.deepcopy(info)  # the env may reuse them
            s["rew"][sel], s["term"][sel], s["trunc"][sel] = rew, term, trunc
            if term or trunc:
                return None  # the env step goes on: the caller steps this dead agent with None
        gone = not env.agents
        s["term"]["__all__"], s["trunc"]["__all__"] = (
            gone and all(s["term"].values()),
            gone and all(s["trunc"].values()),
        )
        self._aec_step = None
        self._log(s["actions"], s["obs"], s["rew"], s["term"], s["trunc"], s["info"])
        return None
