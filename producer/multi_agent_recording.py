"""One multi-agent episode as plain data: the per-env-step dicts a multi-agent env returned.

This is the form both ends of the multi-agent path agree on: the recorder's calls take these
dicts, the consumer folds a multi-agent episode's events back into them, and the episode
builders (the fast per-agent split and the replay through RLlib's ``MultiAgentEpisode``) read
them. Every dict is keyed by agent id, as RLlib's ``MultiAgentEnv`` and PettingZoo's Parallel API
return them; ``terminateds``/``truncateds`` may also hold the env's ``"__all__"`` flag.

Example:
    >>> import numpy as np
    >>> from rlrec.producer.multi_agent_recording import (
    ...     MultiAgentEnvStep, MultiAgentRecording, MultiAgentReset)
    >>> rec = MultiAgentRecording(
    ...     episode_id="ep-1", policy_id="default", policy_version=0,
    ...     agent_modules={"a0": "m0", "a1": "m1"},
    ...     reset=MultiAgentReset(observations={"a0": np.zeros(2), "a1": np.ones(2)}),
    ...     steps=[MultiAgentEnvStep(
    ...         actions={"a0": 1, "a1": 0}, rewards={"a0": 1.0, "a1": 0.0},
    ...         observations={"a0": np.zeros(2), "a1": np.ones(2)},
    ...         terminateds={"__all__": True}, truncateds={"__all__": False})])
    >>> len(rec.steps), rec.steps[0].terminateds["__all__"]
    (1, True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class MultiAgentReset:
    """What the env's ``reset()`` returned: per-agent observations and infos.

    Args:
        observations: agent id -> observation, for the agents present at reset.
        infos: agent id -> info dict (agents without an info may be missing).
    """

    observations: dict[str, Any]
    infos: dict[str, dict] = field(default_factory=dict)


@dataclass
class MultiAgentEnvStep:
    """One env step: the actions sent and what ``step()`` returned, all keyed by agent id.

    An agent missing from a dict had no such value at this env step (an agent that acts without
    an immediate observation, a reward before an agent's first observation, and so on).

    Args:
        actions: agent id -> action, for the agents that acted.
        rewards: agent id -> reward received at this env step (delayed rewards folded in).
        observations: agent id -> observation returned by this step.
        terminateds: agent id -> bool, plus the env's ``"__all__"`` when it gave one.
        truncateds: agent id -> bool, plus the env's ``"__all__"`` when it gave one.
        infos: agent id -> info dict.
        extra_model_outputs: agent id -> {name: value}, e.g. ``action_logp``, per acting agent.
    """

    actions: dict[str, Any]
    rewards: dict[str, float]
    observations: dict[str, Any]
    terminateds: dict[str, bool] = field(default_factory=dict)
    truncateds: dict[str, bool] = field(default_factory=dict)
    infos: dict[str, dict] = field(default_factory=dict)
    extra_model_outputs: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class MultiAgentRecording:
    """A whole multi-agent episode as recorded: its identity, its agents, its reset and steps.

    Args:
        episode_id: the multi-agent episode's id (the Kafka key of all its events).
        policy_id: the policy id it was recorded under; each module's rows go under
            ``{policy_id}.{module_id}``.
        policy_version: the policy version that acted.
        agent_modules: every possible agent id -> the module id that acts for it.
        reset: what ``reset()`` returned.
        steps: every env step, in order.
        observation_spaces: agent id -> gymnasium space (None: not recorded).
        action_spaces: agent id -> gymnasium space (None: not recorded).
        env_id: the env's id, as in single-agent episodes.
        aborted: True when the episode ended by an abort (stored truncated, hanging actions dropped).
    """

    episode_id: str
    policy_id: str
    policy_version: int
    agent_modules: dict[str, str]
    reset: MultiAgentReset
    steps: list[MultiAgentEnvStep] = field(default_factory=list)
    observation_spaces: dict[str, Any] | None = None
    action_spaces: dict[str, Any] | None = None
    env_id: str = ""
    aborted: bool = False
