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
agents' rewards. The gate decides on the mean of what ``--promotion-return`` names (`judged`: the
episode return, or one module's) by `rlrec.trainer.promotion.decide`.
"""

from __future__ import annotations

import importlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "EnvSpecError",
    "MultiAgentReturns",
    "agent_spaces",
    "candidate_policy",
    "check_env_modules",
    "evaluate_modules",
    "gate_verdict",
    "judged",
    "make_env",
    "parse_env",
]

log = logging.getLogger("rlrec.trainer")

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
    except Exception as e:  # ImportError, and what a malformed name or the module's own code raises
        raise EnvSpecError(f"--env {spec!r:.80}: cannot import {module_name!r:.60}: {_one_line(e)}") from None
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
            f"--env {spec!r:.80}: building it with --env-config {config} failed: {_one_line(e)}"
        ) from None


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def _raw(env: Any) -> Any:
    """The PettingZoo env inside RLlib's wrapper (None for an RLlib MultiAgentEnv)."""
    return getattr(env, "par_env", None) or (
        getattr(env, "env", None) if type(env).__name__ == "PettingZooEnv" else None
    )


def _agents(env: Any) -> list | None:
    """Every agent the env may have, late joiners included; None when the env cannot say.

    RLlib's PettingZoo wrappers list only the agents alive at reset: the raw env's
    ``possible_agents`` is asked first."""
    for source in (_raw(env), env):
        if source is None:
            continue
        try:
            agents = source.possible_agents
        except Exception:  # PettingZoo: an env need not define possible_agents
            continue
        if agents:
            return sorted(agents, key=str)
    return None


def _ids(ids: Any) -> str:
    """Agent ids for a one-line message: each repr()'d and cut, at most 8."""
    ids = sorted(ids, key=str)
    return ", ".join(f"{a!r:.40}" for a in ids[:8]) + (", ..." if len(ids) > 8 else "")


def agent_spaces(env: Any, agent: Any, spec: str = "") -> tuple:
    """The (observation_space, action_space) of `agent` in `env` (a PettingZoo env's own spaces).

    Args:
        env: the built env (`make_env`).
        agent: one agent id.
        spec: the ``--env`` value (for the message).

    Raises:
        EnvSpecError: the env cannot give them (one line).

    Example:
        >>> env = make_env("pettingzoo:mpe2.simple_spread_v3", {"N": 2})
        >>> agent_spaces(env, "agent_0")[1]
        Discrete(5)
    """
    raw = _raw(env)
    try:
        if raw is not None:
            return raw.observation_space(agent), raw.action_space(agent)
        return env.get_observation_space(agent), env.get_action_space(agent)
    except Exception as e:
        raise EnvSpecError(f"--env {spec!r:.80}: the spaces of agent {agent!r:.40}: {_one_line(e)}") from None


def _module_of(spec: str, agent: Any, agent_modules: dict[str, str], spaces: dict[str, tuple]) -> str:
    """The stored module of `agent`, or a one-line refusal."""
    m = agent_modules.get(agent) if isinstance(agent, str) else None
    if m not in spaces:
        why = "has no module in the stored agent -> module mapping"
        if not isinstance(agent, str) and str(agent) in agent_modules:
            why = (
                f"is of type {type(agent).__name__}, and recorded agent ids are strings: the stored mapping's "
                f"{str(agent)!r:.40} is another agent (the env must use the recorded ids)"
            )
        raise EnvSpecError(f"--env {spec!r:.80}: agent {agent!r:.40} {why} (it maps {_ids(agent_modules)})")
    return m


def check_agent(env: Any, spec: str, agent: Any, agent_modules: dict[str, str], spaces: dict[str, tuple]) -> None:
    """Refuse `agent` when the stored mapping does not know it or its spaces are not its module's.

    Args:
        env: the built env (`make_env`).
        spec: the ``--env`` value (for the message).
        agent: one agent id of the env.
        agent_modules: the stored agent -> module mapping (str agent ids, as recorded).
        spaces: module id -> (observation_space, action_space), as stored.

    Raises:
        EnvSpecError: one line.

    Example:
        >>> env = make_env("pettingzoo:mpe2.simple_spread_v3", {"N": 2})
        >>> check_agent(env, "spread", "agent_0", {"agent_0": "a"}, {"a": agent_spaces(env, "agent_0")})
    """
    m = _module_of(spec, agent, agent_modules, spaces)
    have = agent_spaces(env, agent, spec)
    for what, got, stored in zip(("observation", "action"), have, spaces[m]):
        if got != stored:
            raise EnvSpecError(
                f"--env {spec!r:.80}: agent {agent!r:.40} has {what} space {got!s:.200}, not the stored "
                f"{stored!s:.200} of its module {m!r:.40}"
            )


def check_env_modules(env: Any, spec: str, agent_modules: dict[str, str], spaces: dict[str, tuple]) -> bool:
    """Refuse an env with an agent the stored mapping does not know, or an agent whose spaces are
    not its module's stored spaces (checked before training starts): every agent the env may have
    (a PettingZoo env's own ``possible_agents``, late joiners included).

    Returns:
        True when every agent was checked; False when the env does not say its possible agents
        (each is then checked when it first appears in an evaluation episode).

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
        --env 'spread': agent 'agent_2' has no module in the stored agent -> module mapping (it maps 'agent_0', 'agent_1')
    """
    agents = _agents(env)
    if agents is None:  # checked as each agent first appears in the gate's episodes (`evaluate_modules`)
        return False
    for a in agents:  # every unmapped agent is named before any space is compared
        _module_of(spec, a, agent_modules, spaces)
    for a in agents:
        check_agent(env, spec, a, agent_modules, spaces)
    return True


@dataclass
class MultiAgentReturns:
    """The returns of an evaluation: per episode the sum over agents (`episodes`), per module the
    sum over its agents (`modules`: module id -> one return per episode), per agent (`agents`),
    and how many episodes were cut at `MAX_EPISODE_STEPS` (`capped`)."""

    episodes: list[float] = field(default_factory=list)
    modules: dict[str, list[float]] = field(default_factory=dict)
    agents: dict[Any, list[float]] = field(default_factory=dict)
    capped: int = 0

    @property
    def mean(self) -> float:
        """The mean episode return (the sum over agents)."""
        return float(np.mean(self.episodes))

    def module_means(self) -> dict[str, float]:
        """Each module's mean return."""
        return {m: float(np.mean(r)) for m, r in sorted(self.modules.items())}

    def zero_sum(self) -> bool:
        """True when the episode return is 0 in every episode while some agent's is not: the sum
        cannot tell a winner from a loser (a zero-sum game)."""
        return all(abs(r) < 1e-9 for r in self.episodes) and any(
            abs(r) >= 1e-9 for rs in self.agents.values() for r in rs
        )


def judged(returns: MultiAgentReturns, what: str) -> float:
    """The return the gate decides on: ``sum`` the mean episode return, ``module:ID`` that
    module's mean return (``--promotion-return``).

    Args:
        returns: an evaluation's returns (`evaluate_modules`).
        what: ``sum`` or ``module:ID``.

    Example:
        >>> judged(MultiAgentReturns([1.0, 3.0], {"p1": [2.0, 5.0], "p2": [-1.0, -2.0]}), "module:p1")
        3.5
    """
    if what == "sum":
        return returns.mean
    return float(np.mean(returns.modules[what.partition(":")[2]]))


def gate_verdict(
    returns: MultiAgentReturns,
    what: str,
    version: int,
    deployed_version: int | None,
    deployed_return: float | None,
    seconds: float = 0.0,
) -> dict:
    """The env gate's decision on a candidate's `returns` (logged): the single-agent gate's rule
    (`rlrec.trainer.promotion.decide`) on what `what` (``--promotion-return``) names, with the
    per-module returns, every episode's return and the count of capped episodes. Judged by the
    sum, a candidate whose summed return is 0 in every episode while its agents' are not (a
    zero-sum env) is refused: the sum cannot judge it.

    Args:
        returns: the candidate's evaluation (`evaluate_modules`).
        what: ``sum`` or ``module:ID``.
        version: the candidate's version.
        deployed_version: the deployed version (None: the baseline).
        deployed_return: its return (None: nothing to beat).
        seconds: how long the evaluation took (for the log line).

    Returns:
        The ``promotion`` record: `rlrec.trainer.promotion.Promotion`'s fields, ``module_returns``,
        ``episode_returns``, ``capped_episodes``, ``promotion_return`` (and ``refused`` when refused).

    Example:
        >>> r = MultiAgentReturns([0.0, 0.0], {"p1": [1.0, 1.0], "p2": [-1.0, -1.0]}, {"x": [1.0, 1.0]})
        >>> gate_verdict(r, "module:p1", 2, 1, 0.5)["promoted"]
        True
        >>> gate_verdict(r, "sum", 2, 1, 0.5)["refused"]
        'zero-sum'
    """
    from rlrec.trainer.promotion import decide

    modules = returns.module_means()
    record = {
        "module_returns": modules,
        "episode_returns": [round(r, 6) for r in returns.episodes],
        "capped_episodes": returns.capped,
        "promotion_return": what,
    }
    if returns.capped:
        log.warning(
            "promotion gate: %d of candidate v%d's %d episodes were cut at %d steps (the env did not end them)",
            returns.capped,
            version,
            len(returns.episodes),
            MAX_EPISODE_STEPS,
        )
    if what == "sum" and returns.zero_sum():
        log.error(
            "promotion gate refused candidate v%d: its summed return is 0 in every episode while its agents' are "
            "not (a zero-sum env): the sum cannot judge it; give --promotion-return module:ID",
            version,
        )
        d = decide(version, 0.0, deployed_version, deployed_return).to_dict()
        return {**d, "promoted": False, "refused": "zero-sum", **record}
    ret = judged(returns, what)
    d = decide(version, ret, deployed_version, deployed_return)
    log.info(
        "promotion gate: candidate v%d return %.1f (%s; %s) vs deployed %s return %s: %s (%.2fs)",
        version,
        ret,
        what,
        ", ".join(f"{m} {r:.1f}" for m, r in modules.items()),
        f"v{deployed_version}" if deployed_version else "(baseline)",
        "-" if d.deployed_return is None else f"{d.deployed_return:.1f}",
        "promoted" if d.promoted else "kept the deployed version",
        seconds,
    )
    return {**d.to_dict(), **record}


class _GlobalSeeds:
    """Seed Python's `random`, NumPy's global generator and torch's with one seed (as RLlib's
    ``update_global_seed_if_necessary`` seeds an EnvRunner), restoring their states on exit."""

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self) -> None:
        import torch

        self.saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
        random.seed(self.seed)
        np.random.seed(self.seed % 2**32)
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: Any) -> None:
        import torch

        random.setstate(self.saved[0])
        np.random.set_state(self.saved[1])
        torch.set_rng_state(self.saved[2])


def evaluate_modules(
    policy: Any,
    env: Any,
    episodes: int,
    seed: int = 0,
    explore: bool = False,
    check: Callable[[Any], None] | None = None,
    progress: Callable[[], None] | None = None,
) -> MultiAgentReturns:
    """Play `policy` (a `rlrec.trainer.policy_modules.MultiModuleVersion`: each agent acted for
    by its module) in the multi-agent `env` for `episodes` episodes on seeds ``seed + k``, as
    RLlib steps a MultiAgentEnv: Python's, NumPy's and torch's global generators are seeded with
    ``seed + k`` for the episode (restored after); only agents not yet terminated or truncated
    act; a tick on which no live agent observes steps the env with no actions; an episode ends at
    ``__all__``, when every agent seen is done, or after `MAX_EPISODE_STEPS` steps (counted in
    ``capped``).

    Args:
        policy: the candidate (its ``act`` takes ``{agent_id: observation}``).
        env: an RLlib MultiAgentEnv (`make_env`); not closed here.
        episodes: how many (at least 1).
        seed: the first episode's seed (the action sampler's too, with `explore`).
        explore: sample actions instead of the greedy ones.
        check: called with each agent id when it first appears (`check_agent`); it raises to
            refuse the evaluation.
        progress: called after each episode.

    Raises:
        EnvSpecError: an agent is rewarded or observes that has no module (or `check` refused it).

    Example:
        >>> returns = evaluate_modules(candidate, make_env("pettingzoo:mpe2.simple_spread_v3", {"N": 2}), 3)  # doctest: +SKIP
        >>> len(returns.episodes), sorted(returns.modules)  # doctest: +SKIP
        (3, ['random', 'scripted'])
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    modules = sorted(set(policy.agent_modules.values()))
    out = MultiAgentReturns(modules={m: [] for m in modules})
    checked: set = set()

    def seen(agents: Any) -> None:
        for a in agents:
            if a in checked:
                continue
            if check is not None:
                check(a)
            if policy.agent_modules.get(a) is None:
                raise EnvSpecError(f"agent {a!r:.40} appeared but has no module in the stored mapping")
            checked.add(a)

    for k in range(max(1, int(episodes))):
        per_module = dict.fromkeys(modules, 0.0)
        per_agent: dict = {}
        with _GlobalSeeds(seed + k):
            obs, _ = env.reset(seed=seed + k)
            present: set = set(obs)  # every agent seen this episode
            done: set = set()  # agents that terminated or truncated: their last observation is not acted on
            over = False
            for _step in range(MAX_EPISODE_STEPS):
                seen(obs)
                live = {a: o for a, o in obs.items() if a not in done}
                if not live and present <= done:
                    over = True
                    break
                actions = policy.act(live, explore, generator)[0] if live else {}
                obs, rewards, terminateds, truncateds, _ = env.step(actions)
                seen(rewards)
                present |= set(obs) | set(rewards)
                for a, r in rewards.items():
                    per_module[policy.agent_modules[a]] += float(r)
                    per_agent[a] = per_agent.get(a, 0.0) + float(r)
                if terminateds.get("__all__") or truncateds.get("__all__"):
                    over = True
                    break
                done |= {a for a, t in terminateds.items() if t} | {a for a, t in truncateds.items() if t}
        out.capped += not over
        out.episodes.append(float(sum(per_module.values())))
        for m, r in per_module.items():
            out.modules[m].append(r)
        for a in set(out.agents) | set(per_agent):
            out.agents.setdefault(a, [0.0] * k).append(per_agent.get(a, 0.0))
        if progress is not None:
            progress()
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
