"""What ``rlrec train --multi-agent`` learns from the store: the modules, their spaces and the
agent -> module mapping of the multi-agent rows (docs/FORMAT.md, "Multi-agent rows"), and the
multi-agent RLlib config they give.

Each module's rows lie under ``{policy_id}.{module_id}/``; every row names its agent and module
and holds the agent's `SingleAgentEpisode` (which keeps ``agent_id``, ``module_id`` and
``multi_agent_episode_id``), so RLlib's multi-agent learner connector routes each one to its own
module (in ``--prelearner-mode buffer`` through per-module buffers that keep those ids:
`rlrec.trainer.multi_agent_buffer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AgentModules",
    "StoredModules",
    "agent_id_mismatch",
    "configure_modules",
    "modules_from_shards",
    "row_columns",
    "row_module_mismatch",
]

#: the row columns the PreLearner reads besides ``item`` when the learner gets the env's own flags
ENV_FLAG_COLUMNS = ["env_terminated", "env_truncated"]
#: the row columns each agent episode's module is checked against (`row_module_mismatch`)
ID_COLUMNS = ["module_id", "policy_id", "multi_agent_policy_id"]
#: not a shard column: the read task adds it, the folder (manifest policy id) the row was read from
FOLDER = "rlrec_folder"


def row_columns(spec: dict) -> list[str]:
    """The shard columns a multi-agent PreLearner reads, for the trainer's data spec (`FOLDER`
    is added by the read task).

    Args:
        spec: ``learner_config_dict["rlrec"]`` (`rlrec.trainer.data.configure_continuous`).

    Example:
        >>> row_columns({"multi_agent_flags": "env"})
        ['item', 'module_id', 'policy_id', 'multi_agent_policy_id', 'rlrec_folder', 'env_terminated', 'env_truncated']
    """
    flags = ENV_FLAG_COLUMNS if spec.get("multi_agent_flags") == "env" else []
    return ["item", *ID_COLUMNS, FOLDER, *flags]


def row_module_mismatch(
    episode_module: Any, module_id: Any, policy_id: Any, multi_agent_policy_id: Any, folder: Any, only_policy: Any
) -> str | None:
    """Why an agent row's module disagrees with its columns or its folder (None: it agrees): its
    episode's ``module_id``, the row's ``module_id`` column, its ``policy_id`` column =
    ``{multi_agent_policy_id}.{module_id}``, and the folder it was read from; with
    `only_policy` (``--policy-id``), ``multi_agent_policy_id`` must be it.

    Example:
        >>> row_module_mismatch("a", "a", "P.a", "P", "P.a", None) is None
        True
        >>> row_module_mismatch("b", "a", "P.a", "P", "P.a", None)
        "its episode's module 'b' is not its row's 'a'"
    """
    if episode_module != module_id:
        return f"its episode's module {episode_module!r:.40} is not its row's {module_id!r:.40}"
    if policy_id != f"{multi_agent_policy_id}.{module_id}":
        return f"its row's policy id {policy_id!r:.80} is not {multi_agent_policy_id!r:.40}.{module_id!r:.40}"
    if folder != policy_id:
        return f"it lies in folder {folder!r:.80}, not its own {policy_id!r:.80}"
    if only_policy is not None and multi_agent_policy_id != only_policy:
        return f"its multi-agent policy {multi_agent_policy_id!r:.40} is not --policy-id {only_policy!r:.40}"
    return None


def agent_id_mismatch(episode_id: Any, multi_agent_episode_id: Any, agent_id: Any) -> str | None:
    """Why an agent episode's ``id_`` is not the one the consumer writes for its agent of its
    multi-agent episode (`rlrec.store.multi_agent_shards.agent_episode_id`; None: it is): two
    agent episodes of one module then never share an id (the buffer mode's per-module buffers
    tell episodes apart by it).

    Example:
        >>> from rlrec.store.multi_agent_shards import agent_episode_id
        >>> agent_id_mismatch(agent_episode_id("ma", "a0"), "ma", "a0") is None
        True
        >>> agent_id_mismatch("X", "ma", "a0")
        "its episode id 'X' is not the one of agent 'a0' of multi-agent episode 'ma'"
    """
    from rlrec.store.multi_agent_shards import agent_episode_id

    ids_are_str = isinstance(multi_agent_episode_id, str) and isinstance(agent_id, str)
    if ids_are_str and episode_id == agent_episode_id(multi_agent_episode_id, agent_id):
        return None
    return (
        f"its episode id {episode_id!r:.80} is not the one of agent {agent_id!r:.40} "
        f"of multi-agent episode {multi_agent_episode_id!r:.80}"
    )


@dataclass(frozen=True)
class AgentModules:
    """The agent -> module mapping the stored rows recorded, as an RLlib ``policy_mapping_fn``.

    An agent the rows never named maps to None: RLlib then refuses it (it is not recorded, so
    nothing trains on it; every stored agent episode carries its module id anyway).

    Args:
        mapping: agent id -> module id.

    Example:
        >>> fn = AgentModules({"agent_0": "scripted", "agent_1": "random"})
        >>> fn("agent_1", None)
        'random'
    """

    mapping: dict[str, str] = field(default_factory=dict)

    def __call__(self, agent_id: Any, episode: Any = None, **kwargs: Any) -> str | None:
        return self.mapping.get(agent_id)


@dataclass
class StoredModules:
    """The modules of a multi-agent store, learned from its shards.

    Args:
        spaces: module id -> (observation_space, action_space).
        agents: agent id -> module id.

    Example:
        >>> import gymnasium as gym
        >>> m = StoredModules({"a": (gym.spaces.Box(-1, 1, (2,)), gym.spaces.Discrete(3))}, {"agent_0": "a"})
        >>> sorted(m.spaces), m.agents
        (['a'], {'agent_0': 'a'})
    """

    spaces: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    agents: dict[str, str] = field(default_factory=dict)
    #: the multi-agent policy ids of the rows read
    policies: set[str] = field(default_factory=set)

    def add_shard(self, rows: list) -> None:
        """Learn from one shard's `rlrec.store.multi_agent_shards.AgentRow`s: each module's spaces
        (its first episode's) and each agent's module (ValueError: an agent under two modules, or
        a module whose episodes' spaces differ)."""
        for r in rows:
            self.policies.add(r.multi_agent_policy_id)
            known = self.agents.setdefault(r.agent_id, r.module_id)
            if known != r.module_id:
                raise ValueError(
                    f"agent {r.agent_id!r:.40} is stored under modules {known!r:.40} and {r.module_id!r:.40} (a "
                    "per-episode agent -> module mapping, e.g. self-play, is not supported yet)"
                )
            spaces = (r.episode.observation_space, r.episode.action_space)
            if None in spaces:
                raise ValueError(f"module {r.module_id!r:.40}: agent episode {r.episode.id_} carries no spaces")
            have = self.spaces.setdefault(r.module_id, spaces)
            if have != spaces:
                raise ValueError(f"module {r.module_id!r:.40}: its episodes' spaces differ ({have} and {spaces})")


def modules_from_shards(storage: Any, entries: list, policy_id: str | None = None) -> StoredModules:
    """Read one shard of every module folder among `entries` (manifest `ShardEntry`s of
    multi-agent rows) and return what they say.

    Args:
        storage: the input `rlrec.store.storage.Storage`.
        entries: committed shard entries (each module's first one is read).
        policy_id: ``--policy-id`` (None: the rows must be of one multi-agent policy).

    Raises:
        ValueError: a shard is refused by the schema gate or its rows contradict each other; the
            rows are of several multi-agent policies and no `policy_id` chooses one.
        FileNotFoundError: a shard is gone (retention).

    Example:
        >>> import tempfile
        >>> from rlrec.store.storage import Storage
        >>> modules_from_shards(Storage.from_uri(tempfile.mkdtemp()), []).spaces
        {}
    """
    from rlrec.store.commit import read_committed_shard
    from rlrec.store.multi_agent_shards import read_agent_rows
    from rlrec.store.schema_gate import open_shard

    out = StoredModules()
    seen: set[str] = set()
    for e in entries:
        if e.policy_id in seen:
            continue
        seen.add(e.policy_id)
        shard = open_shard(read_committed_shard(storage, e.path, e.staging_path, e.bytes), fmt=e.format)
        out.add_shard(read_agent_rows(shard))
    if policy_id is None and len(out.policies) > 1:
        names = sorted(out.policies)
        raise ValueError(
            f"the store holds {len(names)} multi-agent policies ("
            + ", ".join(repr(n)[:42] for n in names[:5])
            + (", ..." if len(names) > 5 else "")
            + "): give --policy-id to train one"
        )
    return out


def configure_modules(config: Any, modules: StoredModules) -> Any:
    """Make `config` (an RLlib `AlgorithmConfig`) multi-agent: one policy per stored module with
    its own spaces, mapped from the stored agent ids. Returns the config (changed in place).

    Args:
        config: the algorithm's config.
        modules: what `modules_from_shards` found.

    Example:
        >>> import gymnasium as gym
        >>> from ray.rllib.algorithms.bc import BCConfig
        >>> m = StoredModules({"a": (gym.spaces.Box(-1, 1, (2,)), gym.spaces.Discrete(3))}, {"agent_0": "a"})
        >>> sorted(configure_modules(BCConfig(), m).policies)
        ['a']
    """
    import gymnasium as gym
    from ray.rllib.core.rl_module.multi_rl_module import MultiRLModuleSpec
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    # the env's spaces as a multi-agent env states them: per agent (RLlib's offline check wants them)
    agents = {a: modules.spaces[m] for a, m in sorted(modules.agents.items()) if m in modules.spaces}
    config.environment(
        observation_space=gym.spaces.Dict({a: s[0] for a, s in agents.items()}),
        action_space=gym.spaces.Dict({a: s[1] for a, s in agents.items()}),
    )
    config.multi_agent(policies=set(modules.spaces), policy_mapping_fn=AgentModules(dict(modules.agents)))
    config.rl_module(
        rl_module_spec=MultiRLModuleSpec(
            rl_module_specs={
                m: RLModuleSpec(observation_space=obs, action_space=act) for m, (obs, act) in modules.spaces.items()
            }
        )
    )
    return config
