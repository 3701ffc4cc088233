"""Which env steps RLlib's `MultiAgentEpisode` accepts, decided without Ray.

`MultiAgentRules` follows the state `MultiAgentEpisode.add_env_reset`/`add_env_step` (ray 2.60)
keep about each agent - whether it has a `SingleAgentEpisode`, is done, has an action hanging
(it acted and got no observation yet), which extra model outputs its episode holds - and says
whether one more env step would be refused, without changing anything: `check_step` returns the
state after the step, `accept` makes it current. The recorder refuses what RLlib would refuse,
before it records anything, so every recorded episode replays through RLlib
(tests/test_multi_agent_rules.py feeds random step sequences to both and compares).

Values are only looked at for presence: an agent is "in" a dict when it is a key of it.

Example:
    >>> rules = MultiAgentRules()
    >>> rules.reset({"a": 0, "b": 0})
    >>> state = rules.check_step({"a": 1}, {"a": 0, "b": 1}, {"a": 1.0}, {}, {}, {}, {})
    >>> rules.accept(state); rules.hanging
    frozenset({'b'})
    >>> rules.check_step({}, {"b": 0}, {}, {}, {}, {}, {})
    Traceback (most recent call last):
    ...
    ValueError: agent 'b' acted twice without an observation in between (RLlib asserts this)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["AgentState", "MultiAgentRules"]

_ALL = "__all__"
_NO_KEYS: frozenset = frozenset()
_ALL_ONLY = frozenset({_ALL})


@dataclass(frozen=True)
class AgentState:
    """What RLlib's episode knows about one agent.

    Args:
        has_episode: it has a `SingleAgentEpisode` (it got an observation, at reset or later).
        in_map: it has an entry in ``env_t_to_agent_t``.
        done: its `SingleAgentEpisode` is terminated or truncated.
        hanging: it acted and got no observation since.
        hanging_keys: the extra output names of the hanging action.
        episode_keys: the extra output names its episode holds (None: no step added yet).
    """

    has_episode: bool = False
    in_map: bool = False
    done: bool = False
    hanging: bool = False
    hanging_keys: frozenset = frozenset()
    episode_keys: frozenset | None = None


class MultiAgentRules:
    """The acceptance rules of one multi-agent episode (see the module docstring)."""

    def __init__(self) -> None:
        self.agents: dict[str, AgentState] = {}
        self.env_t = 0
        self.done = False
        self.is_terminated = False
        self.is_truncated = False

    @property
    def hanging(self) -> frozenset:
        """Agents with an action hanging."""
        return frozenset(a for a, s in self.agents.items() if s.hanging)

    def reset(self, observations: Mapping[str, Any]) -> None:
        """`add_env_reset`: every agent with an observation gets its episode."""
        for a in observations:
            self.agents[a] = AgentState(has_episode=True, in_map=True)

    def check_step(
        self,
        observations: Mapping[str, Any],
        actions: Mapping[str, Any],
        rewards: Mapping[str, Any],
        infos: Mapping[str, Any],
        terminateds: Mapping[str, Any],
        truncateds: Mapping[str, Any],
        extra_model_outputs: Mapping[str, Mapping],
    ) -> tuple[dict[str, AgentState], bool, bool]:
        """The state after `add_env_step` with these dicts: (agents, is_terminated, is_truncated).

        Raises:
            ValueError: RLlib would refuse the step (a `MultiAgentEnvError` or a failed assertion).
        """
        steady = self.steady_step(observations, actions, rewards, terminateds, truncateds, extra_model_outputs)
        if steady is not None:
            return steady
        return self.any_step(observations, actions, rewards, infos, terminateds, truncateds, extra_model_outputs)

    def steady_step(
        self,
        observations: Mapping[str, Any],
        actions: Mapping[str, Any],
        rewards: Mapping[str, Any],
        terminateds: Mapping[str, Any],
        truncateds: Mapping[str, Any],
        extra_model_outputs: Mapping[str, Mapping],
    ) -> tuple[dict[str, AgentState], bool, bool] | None:
        """`any_step`'s answer for the usual env step, which changes no agent's state, else None:
        the same agents observe, act and get a reward; each has its episode, acted since its last
        observation (none hanging), is not done, and gives the extra output names its episode
        holds; no agent and not ``"__all__"`` is terminated or truncated (infos play no part:
        RLlib only refuses them for agents that are done)."""
        if self.done or not observations:
            return None
        keys = observations.keys()
        if keys != actions.keys() or keys != rewards.keys() or any(terminateds.values()) or any(truncateds.values()):
            return None
        for d in (terminateds, truncateds):  # every agent they name (but "__all__") has data
            if not d.keys() <= keys and d.keys() - keys != _ALL_ONLY:
                return None
        agents = self.agents
        for a in keys:
            s = agents.get(a)
            if s is None or not s.has_episode or not s.in_map or s.done or s.hanging or s.episode_keys is None:
                return None
            e = extra_model_outputs.get(a)
            if (e and type(e) is not dict) or (e.keys() if e else _NO_KEYS) != s.episode_keys:
                return None
        return agents, False, False

    def any_step(
        self,
        observations: Mapping[str, Any],
        actions: Mapping[str, Any],
        rewards: Mapping[str, Any],
        infos: Mapping[str, Any],
        terminateds: Mapping[str, Any],
        truncateds: Mapping[str, Any],
        extra_model_outputs: Mapping[str, Mapping],
    ) -> tuple[dict[str, AgentState], bool, bool]:
        """`check_step` for any env step (`RLlib`'s rules in full)."""
        if self.done:
            raise ValueError("the episode is done: RLlib accepts no further env step")
        is_term = bool(terminateds.get(_ALL, False))
        is_trunc = bool(truncateds.get(_ALL, False))
        known = {a for a, s in self.agents.items() if s.has_episode}
        done_now = {a for a in known if self.agents[a].done}
        done_now |= {a for a, v in terminateds.items() if v} | {a for a, v in truncateds.items() if v}
        if all(a in done_now for a in known):
            is_term = True
        with_data = set(observations) | set(actions) | set(rewards) | set(terminateds) | set(truncateds)
        if terminateds.get(_ALL) or truncateds.get(_ALL):
            with_data |= known
        with_data.discard(_ALL)
        out = dict(self.agents)
        for a in with_data:
            s = out.get(a, AgentState())
            fresh = not s.has_episode  # RLlib builds a throwaway SingleAgentEpisode for it
            obs, act = a in observations, a in actions
            term = bool(terminateds.get(a, False)) or is_term
            trunc = bool(truncateds.get(a, False)) or is_trunc
            e = extra_model_outputs.get(a)
            keys = frozenset(e) if e else _NO_KEYS
            if s.has_episode and s.done and (obs or act or a in rewards or a in infos or a in extra_model_outputs):
                raise ValueError(f"agent {a!r} is done but got data in a later env step (MultiAgentEnvError)")
            added: frozenset | None = None  # extra output names of a step added to its episode
            if obs and act:
                if a not in rewards:
                    raise ValueError(f"agent {a!r} acted and got an observation but no reward (MultiAgentEnvError)")
                added = keys
            elif obs:
                if s.hanging:
                    added = s.hanging_keys
                    s = replace(s, hanging=False, hanging_keys=frozenset())
                elif term or trunc:
                    out[a] = replace(s, hanging=False, hanging_keys=frozenset())
                    continue
                else:
                    if s.in_map:
                        raise ValueError(
                            f"agent {a!r} got an observation without acting and without an action hanging "
                            "(RLlib asserts this)"
                        )
                    out[a] = replace(s, has_episode=True, in_map=True)
                    continue
            elif act:
                if trunc:
                    raise ValueError(f"agent {a!r} acted and was truncated without an observation (MultiAgentEnvError)")
                if term:
                    if s.has_episode:  # its last observation closes the step
                        added = keys
                        obs = True
                else:
                    if s.hanging:
                        raise ValueError(
                            f"agent {a!r} acted twice without an observation in between (RLlib asserts this)"
                        )
                    s = replace(s, hanging=True, hanging_keys=keys)
            else:
                if term or trunc:
                    if not s.hanging:
                        out[a] = replace(s, hanging=False, hanging_keys=frozenset())
                        continue
                    if trunc:
                        raise ValueError(
                            f"agent {a!r} acted and was truncated without an observation (MultiAgentEnvError)"
                        )
                    if s.has_episode:
                        added = s.hanging_keys
                        obs = True
            if obs:
                if not fresh:
                    if s.episode_keys is not None and added != s.episode_keys:
                        raise ValueError(
                            f"agent {a!r}: extra model outputs {sorted(added or ())} after {sorted(s.episode_keys)} "
                            "(RLlib's episode validation fails)"
                        )
                    if s.episode_keys != added or s.done != (term or trunc):
                        s = replace(s, episode_keys=added, done=term or trunc)
                if not s.in_map:
                    s = replace(s, in_map=True)
            if (term or trunc) and s.hanging:
                s = replace(s, hanging=False, hanging_keys=frozenset())
            if s is not self.agents.get(a):
                out[a] = s
        return out, is_term, is_trunc

    def accept(self, state: tuple[dict[str, AgentState], bool, bool]) -> None:
        """Make a state `check_step` returned current (the env step is recorded)."""
        self.agents, self.is_terminated, self.is_truncated = state
        self.env_t += 1
        self.done = self.is_terminated or self.is_truncated
