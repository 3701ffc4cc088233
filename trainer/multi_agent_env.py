"""The env gate of ``rlrec train --multi-agent``: the multi-agent env ``--env`` names, its check
against the stored modules, and the candidate's return in it.

``--env`` with ``--multi-agent`` names one of (``--env-config``: the keyword arguments):

* ``pettingzoo:MODULE`` -- a PettingZoo Parallel env: ``MODULE.parallel_env(**env_config)``
  (e.g. ``pettingzoo:mpe2.simple_spread_v3``), wrapped by RLlib's ``ParallelPettingZooEnv``;
* ``pettingzoo-aec:MODULE`` -- a PettingZoo AEC env: ``MODULE.env(**env_config)``, wrapped by
  RLlib's ``PettingZooEnv``;
* ``MODULE:CLASS`` -- an RLlib ``MultiAgentEnv`` subclass, built as ``CLASS(env_config)``.

The candidate is played greedily, each agent by the module the stored agent -> module mapping
names, for N episodes on fixed seeds (as the single-agent gate plays its env). An episode's
return is the sum of every agent's rewards over the episode; a module's return is the sum of its
agents' rewards. The gate decides on the mean episode return (`rlrec.trainer.promotion.decide`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "EnvSpecError",
    "MultiAgentReturns",
    "candidate_policy",
    "check_env_modules",
    "evaluate_modules",
    "make_env",
    "parse_env",
]

#: the spec prefixes of PettingZoo envs: (the module's factory, RLlib's wrapper class)
PETTINGZOO = {
    "pettingzoo": ("parallel_env", "ParallelPettingZooEnv"),
    "pettingzoo-aec": ("env", "PettingZooEnv"),
}
#: steps after which an evaluation episode that neither terminates nor truncates is cut off
MAX_EPISODE_STEPS = 100_000


class EnvSpecError(ValueError):
    """A multi-agent ``--env`` that cannot be built or does not fit the stored modules (one line)."""


def parse_env(spec: str) -> tuple[str, str, str | None]:
    """Split a multi-agent ``--env`` into (kind, module, class): kind ``pettingzoo``,
    ``pettingzoo-aec`` or ``rllib`` (a ``MODULE:CLASS`` MultiAgentEnv).

    Args:
        spec: the ``--env`` value.

    Raises:
        EnvSpecError: the spec has none of the three forms.

    Example:
        >>> parse_env("pettingzoo:mpe2.simple_spread_v3")
        ('pettingzoo', 'mpe2.simple_spread_v3', None)
        >>> parse_env("my_envs.grid:GridWorld")
        ('rllib', 'my_envs.grid', 'GridWorld')
    """
    head, sep, tail = spec.partition(":")
    if not sep or not head or not tail:
        raise EnvSpecError(
            f"--env {spec!r:.80} with --multi-agent names pettingzoo:MODULE (a PettingZoo Parallel env), "
            "pettingzoo-aec:MODULE (an AEC env) or MODULE:CLASS (an RLlib MultiAgentEnv)"
        )
    if head in PETTINGZOO:
        return head, tail, None
    return "rllib", head, tail


def make_env(spec: str, env_config: dict | None = None) -> Any:
    """Build the multi-agent env `spec` names (`parse_env`) as an RLlib ``MultiAgentEnv``.

    Args:
        spec: the ``--env`` value.
        env_config: ``--env-config`` (keyword arguments of a PettingZoo factory; the config
            dict of a MultiAgentEnv class).

    Raises:
        EnvSpecError: the module, factory or class is not found, the class is no MultiAgentEnv,
            or building it fails (one line).

    Example:
        >>> env = make_env("pettingzoo:mpe2.simple_spread_v3", {"N": 2})
        >>> sorted(env.possible_agents)
        ['agent_0', 'agent_1']
    """
    from ray.rllib.env import multi_agent_env
    from ray.rllib.env.wrappers import pettingzoo_env

    kind, module_name, class_name = parse_env(spec)
    config = dict(env_config or {})
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvSpecError(f"--env {spec!r:.80}: cannot import {module_name!r:.60}: {e}") from None
    name = PETTINGZOO[kind][0] if kind in PETTINGZOO else class_name
    factory = getattr(module, name, None)
    if factory is None:
        raise EnvSpecError(f"--env {spec!r:.80}: module {module_name!r:.60} has no {name!r:.60}")
    if kind == "rllib" and not (isinstance(factory, type) and issubclass(factory, multi_agent_env.MultiAgentEnv)):
        raise EnvSpecError(f"--env {spec!r:.80}: {class_name} is not an RLlib MultiAgentEnv subclass")
    try:
        if kind == "rllib":
            return factory(config)
        return getattr(pettingzoo_env, PETTINGZOO[kind][1])(factory(**config))
    except Exception as e:  # the env's own refusal of its arguments, said in one line
        raise EnvSpecError(
            f"--env {spec!r:.80}: building it with --env-config {config} failed: {type(e).__name__}: {e}"
        ) from None


def _agents(env: Any) -> list:
    return sorted(env.possible_agents or env.agents or [], key=str)


def check_env_modules(env: Any, spec: str, agent_modules: dict[str, str], spaces: dict[str, tuple]) -> None:
    """Refuse an env with an agent the stored mapping does not know, or an agent whose spaces are
    not its module's stored spaces (checked before training starts).

    Args:
        env: the built env (`make_env`).
        spec: the ``--env`` value (for the message).
        agent_modules: the stored agent -> module mapping.
        spaces: module id -> (observation_space, action_space), as stored.

    Raises:
        EnvSpecError: one line naming the first agent that does not fit.

    Example:
        >>> env = make_env("pettingzoo:mpe2.simple_spread_v3", {"N": 3})
        >>> obs, act = env.get_observation_space("agent_0"), env.get_action_space("agent_0")
        >>> try:
        ...     check_env_modules(env, "spread", {"agent_0": "a", "agent_1": "a"}, {"a": (obs, act)})
        ... except EnvSpecError as e:
        ...     print(e)
        --env 'spread': agent 'agent_2' has no module in the stored agent -> module mapping (it maps agent_0, agent_1)
    """
    agents = _agents(env)
    if not agents:
        raise EnvSpecError(f"--env {spec!r:.80} names no agents (possible_agents is empty)")
    unknown = [a for a in agents if agent_modules.get(a) not in spaces]
    if unknown:
        known = ", ".join(sorted(agent_modules)[:8]) + (", ..." if len(agent_modules) > 8 else "")
        raise EnvSpecError(
            f"--env {spec!r:.80}: agent {unknown[0]!r:.40} has no module in the stored agent -> module mapping "
            f"(it maps {known})"
        )
    for a in agents:
        m = agent_modules[a]
        have = (env.get_observation_space(a), env.get_action_space(a))
        for what, got, stored in zip(("observation", "action"), have, spaces[m]):
            if got != stored:
                raise EnvSpecError(
                    f"--env {spec!r:.80}: agent {a!r:.40} has {what} space {got}, not the stored {stored} of "
                    f"its module {m!r:.40}"
                )


@dataclass
class MultiAgentReturns:
    """The returns of an evaluation: per episode the sum over agents (`episodes`) and per module
    the sum over its agents (`modules`: module id -> one return per episode)."""

    episodes: list[float] = field(default_factory=list)
    modules: dict[str, list[float]] = field(default_factory=dict)

    @property
    def mean(self) -> float:
        """The mean episode return (what the gate decides on)."""
        return float(np.mean(self.episodes))

    def module_means(self) -> dict[str, float]:
        """Each module's mean return."""
        return {m: float(np.mean(r)) for m, r in sorted(self.modules.items())}


def evaluate_modules(policy: Any, env: Any, episodes: int, seed: int = 0, explore: bool = False) -> MultiAgentReturns:
    """Play `policy` (a `rlrec.trainer.policy_modules.MultiModuleVersion`: each agent acted for
    by its module) in the multi-agent `env` for `episodes` episodes on seeds ``seed + k``, as
    RLlib steps a MultiAgentEnv: only agents not yet terminated or truncated act; an episode
    ends at ``__all__`` (or after `MAX_EPISODE_STEPS` steps).

    Args:
        policy: the candidate (its ``act`` takes ``{agent_id: observation}``).
        env: an RLlib MultiAgentEnv (`make_env`); not closed here.
        episodes: how many (at least 1).
        seed: the first episode's seed (the action sampler's too, with `explore`).
        explore: sample actions instead of the greedy ones.

    Example:
        >>> returns = evaluate_modules(candidate, make_env("pettingzoo:mpe2.simple_spread_v3", {"N": 2}), 3)  # doctest: +SKIP
        >>> len(returns.episodes), sorted(returns.modules)  # doctest: +SKIP
        (3, ['random', 'scripted'])
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    modules = sorted(set(policy.agent_modules.values()))
    out = MultiAgentReturns(modules={m: [] for m in modules})
    for k in range(max(1, int(episodes))):
        obs, _ = env.reset(seed=seed + k)
        per_module = dict.fromkeys(modules, 0.0)
        done: set = set()  # agents that terminated or truncated: their last observation is not acted on
        for _step in range(MAX_EPISODE_STEPS):
            live = {a: o for a, o in obs.items() if a not in done}
            if not live:
                break
            actions, _ = policy.act(live, explore, generator)
            obs, rewards, terminateds, truncateds, _ = env.step(actions)
            for a, r in rewards.items():
                m = policy.agent_modules.get(a)
                if m is None:  # an agent the env did not list in possible_agents
                    raise EnvSpecError(f"agent {a!r:.40} was rewarded but has no module in the stored mapping")
                per_module[m] += float(r)
            if terminateds.get("__all__") or truncateds.get("__all__"):
                break
            done |= {a for a, t in terminateds.items() if t} | {a for a, t in truncateds.items() if t}
        out.episodes.append(float(sum(per_module.values())))
        for m, r in per_module.items():
            out.modules[m].append(r)
    return out


def candidate_policy(artifact: Any, version: int) -> Any:
    """The multi-module candidate `artifact` (`rlrec.trainer.multi_agent_export.build_modules_artifact`)
    loaded as a deployed service would load it, without signature or file checks (this process
    built it): a `rlrec.trainer.policy_modules.MultiModuleVersion`.

    Args:
        artifact: the `rlrec.trainer.export.PolicyArtifact` of format ``multi_module``.
        version: the version number it would be published as.

    Example:
        >>> from rlrec.trainer.multi_agent_export import build_modules_artifact
        >>> policy = candidate_policy(build_modules_artifact(trainer.algo, trainer.modules), 3)  # doctest: +SKIP
        >>> sorted(policy.modules), policy.agent_modules  # doctest: +SKIP
        (['random', 'scripted'], {'agent_0': 'scripted', 'agent_1': 'random'})
    """
    from rlrec.trainer.policy_modules import MultiModuleVersion
    from rlrec.trainer.policy_verify import version_from_artifact

    spec = {**artifact.spec, "policy_version": version}
    base = {k: v for k, v in spec.items() if k not in ("modules", "agent_modules", "format")}
    loaded = {
        m: version_from_artifact({**base, **entry, "module_id": m}, artifact.files[entry["model"]])
        for m, entry in sorted(spec["modules"].items())
    }
    return MultiModuleVersion(spec, loaded, dict(spec["agent_modules"]), False, {})
