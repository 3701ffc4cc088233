"""The multi-agent event kinds: `MultiAgentEpisodeStart/1` and `MultiAgentStepBatch/1`, their
encoding and their safe decoding (docs/FORMAT.md, "Multi-agent episodes").

All events of a multi-agent episode, `RewardDelta/2` (with `agent_id`) and `EpisodeAbort`
included, are keyed by the multi-agent episode's id, so one assembler sees them in env-step
order. A step batch is column-wise: one column per agent with a presence byte per env step that
says which of observation, action, reward, info, terminated and truncated the env step's dicts
held for that agent; the values present are stacked over the env steps that hold them.

`decode_event` decodes every rlrec kind (single-agent kinds through `rlrec.producer.events`)
and raises only `DecodeError`. What a message can make it allocate is bounded before anything
is built: spaces by `space_json_nbytes` against `MAX_START_SPACE_BYTES`, agents by
`MAX_AGENTS`, env steps and agent cells of a batch by `MAX_BATCH_ENV_STEPS` and
`MAX_BATCH_CELLS`; arrays are views of the message's bytes. Parsed spaces are kept by their
JSON text in one cache per process (`MAX_CACHED_SPACE_BYTES`, least recently used out), so
episodes with the same spaces share one parsed copy and a start whose spaces are cached builds
nothing.

Example:
    >>> import numpy as np
    >>> from gymnasium import spaces
    >>> from rlrec.producer.multi_agent_events import (
    ...     AgentSpec, MultiAgentEpisodeStart, decode_event, encode_event)
    >>> box = spaces.Box(-1.0, 1.0, (2,), np.float32)
    >>> start = MultiAgentEpisodeStart(
    ...     "ep-1", "default", 1, {"a0": AgentSpec("a0", "m0", box, spaces.Discrete(3))},
    ...     observations={"a0": [np.zeros(2, np.float32)]})
    >>> value, headers = encode_event(start)
    >>> decode_event(value, headers).agents["a0"].module_id
    'm0'
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gymnasium import spaces as gs

from rlrec.producer.arrays import array_to_wire
from rlrec.producer.events import (
    DecodeError,
    _arrays,
    _id,
    _read_body,
    _SpaceCache,
    _wire_leaves,
    check_env_id,
    check_leaves,
    check_policy_id,
    decode_body,
    dumps_info,
    encode,
    encode_record,
    loads_info,
    read_header,
    schema_header,
)
from rlrec.producer.spaces import Leaf, SpaceError, dumps_space, space_from_json, space_json_nbytes, space_leaves

__all__ = [
    "ACTION",
    "ALL_TERMINATED",
    "ALL_TERMINATED_TRUE",
    "ALL_TRUNCATED",
    "ALL_TRUNCATED_TRUE",
    "INFO",
    "MAX_AGENTS",
    "MAX_BATCH_CELLS",
    "MAX_BATCH_ENV_STEPS",
    "MAX_START_SPACE_BYTES",
    "MULTI_AGENT_KINDS",
    "OBSERVATION",
    "REWARD",
    "TERMINATED",
    "TERMINATED_TRUE",
    "TRUNCATED",
    "TRUNCATED_TRUE",
    "AgentColumn",
    "AgentSpec",
    "MultiAgentEpisodeStart",
    "MultiAgentStepBatch",
    "check_module_id",
    "decode_event",
    "encode_event",
]

MULTI_AGENT_KINDS = ("MultiAgentEpisodeStart", "MultiAgentStepBatch")

# presence bits of a column, one byte per env step
OBSERVATION, ACTION, REWARD, INFO = 1, 2, 4, 8
TERMINATED, TERMINATED_TRUE, TRUNCATED, TRUNCATED_TRUE = 16, 32, 64, 128
# env flag bits, one byte per env step: the env's "__all__" entries
ALL_TERMINATED, ALL_TERMINATED_TRUE, ALL_TRUNCATED, ALL_TRUNCATED_TRUE = 1, 2, 4, 8

#: what the spaces of one MultiAgentEpisodeStart may cost once built (space_json_nbytes)
MAX_START_SPACE_BYTES = 64 * 2**20
#: possible agents of one episode
MAX_AGENTS = 1024
#: env steps of one MultiAgentStepBatch
MAX_BATCH_ENV_STEPS = 4096
#: env steps x agent columns of one MultiAgentStepBatch
MAX_BATCH_CELLS = 1 << 18

_SPACE_TABLE_MAX = 2 * MAX_AGENTS
#: what the parsed spaces kept for later starts may cost in all (space_json_nbytes each)
MAX_CACHED_SPACE_BYTES = 128 * 2**20
_parsed_spaces = _SpaceCache(MAX_CACHED_SPACE_BYTES)
_PRESENCE_VALUES = np.zeros(256, dtype=bool)  # valid presence bytes: a "true" bit needs its "given" bit
for _b in range(256):
    _PRESENCE_VALUES[_b] = not (
        (_b & TERMINATED_TRUE and not _b & TERMINATED) or (_b & TRUNCATED_TRUE and not _b & TRUNCATED)
    )
_FLAG_VALUES = np.array(
    [b < 16 and not ((b & 2 and not b & 1) or (b & 8 and not b & 4)) for b in range(256)], dtype=bool
)


def check_module_id(policy_id: str, module_id: Any) -> str:
    """`module_id` if ``{policy_id}.{module_id}`` names a policy directory (the store files each
    module's rows there), else DecodeError `bad-policy-id`."""
    if not isinstance(module_id, str) or not module_id:
        raise DecodeError("bad-policy-id", f"module_id {str(module_id)[:60]!r} must be a non-empty string")
    check_policy_id(f"{policy_id}.{module_id}")
    return module_id


@dataclass
class AgentSpec:
    """A possible agent of a multi-agent episode: who acts for it and its spaces.

    Args:
        agent_id: the agent's id (1..256 characters).
        module_id: the RLlib module that acts for it; ``{policy_id}.{module_id}`` must name a
            policy directory.
        observation_space: its gymnasium observation space.
        action_space: its gymnasium action space.
    """

    agent_id: str
    module_id: str
    observation_space: gs.Space
    action_space: gs.Space
    observation_leaves: tuple[Leaf, ...] | None = field(default=None, repr=False, compare=False)
    action_leaves: tuple[Leaf, ...] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.observation_leaves is None:
            self.observation_leaves = tuple(space_leaves(self.observation_space))
        if self.action_leaves is None:
            self.action_leaves = tuple(space_leaves(self.action_space))


@dataclass
class MultiAgentEpisodeStart:
    """A multi-agent episode begins: its possible agents and what ``reset()`` returned.

    Args:
        episode_id: the multi-agent episode's id (the Kafka key of all its events).
        policy_id: the policy id; each module's rows go under ``{policy_id}.{module_id}``.
        policy_version: the version of the policy that acts.
        agents: agent id -> `AgentSpec`, every possible agent in the env's order.
        observations: agent id -> leaves of its reset observation (agents reset returned one for).
        infos: agent id -> its reset info (agents reset returned one for).
        env_id: names the environment.
        timestamp_ms: wall clock, ms since the Unix epoch.
    """

    episode_id: str
    policy_id: str
    policy_version: int
    agents: dict[str, AgentSpec]
    observations: dict[str, list[np.ndarray]] = field(default_factory=dict)
    infos: dict[str, dict] = field(default_factory=dict)
    env_id: str = ""
    timestamp_ms: int = 0
    KIND = "MultiAgentEpisodeStart"


@dataclass
class AgentColumn:
    """One agent's values in a `MultiAgentStepBatch`.

    Args:
        agent_id: the agent.
        presence: uint8, one byte per env step of the batch (bits: module constants).
        observations: observation leaves of the env steps with `OBSERVATION`, stacked.
        actions: action leaves of the env steps with `ACTION`, stacked.
        rewards: float64 rewards of the env steps with `REWARD`.
        infos: infos of the env steps with `INFO`.
        extra_model_outputs: name -> its values on the env steps with `ACTION` that have it, stacked.
        extra_rows: name -> uint8, one per env step with `ACTION`, 1 where that action has the
            name; a name not here is on every action.
    """

    agent_id: str
    presence: np.ndarray
    observations: list[np.ndarray]
    actions: list[np.ndarray]
    rewards: np.ndarray
    infos: list[dict] = field(default_factory=list)
    extra_model_outputs: dict[str, np.ndarray] = field(default_factory=dict)
    extra_rows: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class MultiAgentStepBatch:
    """Env steps t0 .. t0+n-1 of one multi-agent episode, column-wise per agent.

    Args:
        episode_id: the multi-agent episode's id.
        t0: 0-based index of the first env step.
        env_flags: uint8, one byte per env step: the env's ``"__all__"`` flags (`ALL_*` bits).
        agents: one `AgentColumn` per agent with any value in these env steps.
        ended: the last env step ended the episode.
        timestamp_ms: wall clock of the last env step.
    """

    episode_id: str
    t0: int
    env_flags: np.ndarray
    agents: list[AgentColumn]
    ended: bool = False
    timestamp_ms: int = 0
    KIND = "MultiAgentStepBatch"

    @property
    def n(self) -> int:
        return int(self.env_flags.shape[0])


# ---------------------------------------------------------------------------------------------
# encoding


def _start_record(ev: MultiAgentEpisodeStart) -> dict:
    texts: dict[str, int] = {}

    def index(space: gs.Space) -> int:
        return texts.setdefault(dumps_space(space, compact=True), len(texts))

    agents = [
        {
            "agent_id": a.agent_id,
            "module_id": a.module_id,
            "observation_space": index(a.observation_space),
            "action_space": index(a.action_space),
        }
        for a in ev.agents.values()
    ]
    reset = []
    for aid in [a for a in ev.agents if a in ev.observations or a in ev.infos]:
        obs = ev.observations.get(aid)
        info = ev.infos.get(aid)
        reset.append(
            {
                "agent_id": aid,
                "observation": None if obs is None else _wire_leaves(obs),
                "info": None if info is None else dumps_info(info),
            }
        )
    return {
        "episode_id": ev.episode_id,
        "policy_id": ev.policy_id,
        "policy_version": int(ev.policy_version),
        "env_id": ev.env_id,
        "spaces": list(texts),
        "agents": agents,
        "reset": reset,
        "timestamp_ms": int(ev.timestamp_ms),
    }


def _batch_record(ev: MultiAgentStepBatch) -> dict:
    return {
        "episode_id": ev.episode_id,
        "t0": int(ev.t0),
        "env_flags": np.asarray(ev.env_flags, np.uint8).tobytes(),
        "agents": [
            {
                "agent_id": c.agent_id,
                "presence": np.asarray(c.presence, np.uint8).tobytes(),
                "observations": _wire_leaves(c.observations),
                "actions": _wire_leaves(c.actions),
                "rewards": array_to_wire(np.asarray(c.rewards, np.float64)),
                "infos": [dumps_info(i) for i in c.infos],
                "extra_model_outputs": {k: array_to_wire(np.asarray(v)) for k, v in c.extra_model_outputs.items()},
                "extra_rows": {k: np.asarray(v, np.uint8).tobytes() for k, v in c.extra_rows.items()},
            }
            for c in ev.agents
        ],
        "ended": bool(ev.ended),
        "timestamp_ms": int(ev.timestamp_ms),
    }


def encode_event(ev: Any) -> tuple[bytes, list[tuple[str, bytes]]]:
    """(value, headers) of any rlrec event; the key is ``ev.episode_id.encode()``.

    Args:
        ev: a `MultiAgentEpisodeStart`, `MultiAgentStepBatch` or a single-agent event.
    """
    if isinstance(ev, MultiAgentEpisodeStart):
        return encode_record(ev.KIND, _start_record(ev)), schema_header(ev.KIND)
    if isinstance(ev, MultiAgentStepBatch):
        return encode_record(ev.KIND, _batch_record(ev)), schema_header(ev.KIND)
    return encode(ev)


# ---------------------------------------------------------------------------------------------
# decoding (untrusted input)


def _parse_spaces(texts: list[str]) -> list[tuple[gs.Space, tuple[Leaf, ...]]]:
    """Every space of a start, its cost counted against MAX_START_SPACE_BYTES before any is built."""
    if len(texts) > _SPACE_TABLE_MAX:
        raise DecodeError("bad-space", f"{len(texts)} spaces > {_SPACE_TABLE_MAX}")
    out = _parsed_spaces.cached(texts)
    parsed, total = {}, 0  # index of a space not cached -> (its JSON, its cost)
    for i, text in enumerate(texts):
        if out[i] is not None:
            continue
        try:
            d = json.loads(text)
            cost = space_json_nbytes(d)
        except (ValueError, RecursionError) as e:
            raise DecodeError("bad-space", f"spaces[{i}]: {e}"[:300]) from None
        total += cost
        if total > MAX_START_SPACE_BYTES:
            raise DecodeError("bad-space", f"the spaces would take over {MAX_START_SPACE_BYTES} bytes")
        parsed[i] = (d, cost)
    for i, (d, cost) in parsed.items():
        try:
            space = space_from_json(d, broadcast=True)
            out[i] = (space, tuple(space_leaves(space)))
        except SpaceError as e:
            raise DecodeError("bad-space", f"spaces[{i}]: {e}"[:300]) from None
        except RecursionError:
            raise DecodeError("bad-space", f"spaces[{i}]: nested too deeply") from None
        _parsed_spaces.keep(texts[i], out[i], cost + len(texts[i]))
    return out


def _decode_start(rec: dict, eid: str, ts: int) -> MultiAgentEpisodeStart:
    if rec["policy_version"] < 0:
        raise DecodeError("bad-value", f"negative policy_version {rec['policy_version']}")
    policy_id = check_policy_id(rec["policy_id"])
    check_env_id(rec["env_id"])
    if not rec["agents"] or len(rec["agents"]) > MAX_AGENTS:
        raise DecodeError("bad-value", f"{len(rec['agents'])} agents: 1..{MAX_AGENTS} possible agents")
    spaces = _parse_spaces(rec["spaces"])
    agents: dict[str, AgentSpec] = {}
    for a in rec["agents"]:
        aid = _id(a["agent_id"], "agent_id")
        if aid in agents:
            raise DecodeError("bad-value", f"agent {aid[:60]!r} listed twice")
        check_module_id(policy_id, a["module_id"])
        io_, ia = a["observation_space"], a["action_space"]
        if not (0 <= io_ < len(spaces) and 0 <= ia < len(spaces)):
            raise DecodeError("bad-space", f"agent {aid[:60]!r}: space index out of range")
        (obs_space, obs_leaves), (act_space, act_leaves) = spaces[io_], spaces[ia]
        agents[aid] = AgentSpec(aid, a["module_id"], obs_space, act_space, obs_leaves, act_leaves)
    observations: dict[str, list[np.ndarray]] = {}
    infos: dict[str, dict] = {}
    seen: set[str] = set()
    for r in rec["reset"]:
        aid = r["agent_id"]
        if aid not in agents:
            raise DecodeError("unknown-agent", f"reset value for agent {aid[:60]!r}, not a possible agent")
        if aid in seen:
            raise DecodeError("bad-value", f"reset values for agent {aid[:60]!r} listed twice")
        seen.add(aid)
        if r["observation"] is not None:
            obs = _arrays(r["observation"], f"reset observation of {aid[:60]!r}")
            check_leaves(obs, agents[aid].observation_leaves, None, f"reset observation of {aid[:60]!r}")
            observations[aid] = obs
        if r["info"] is not None:
            infos[aid] = loads_info(r["info"])
    return MultiAgentEpisodeStart(eid, policy_id, rec["policy_version"], agents, observations, infos, rec["env_id"], ts)


def _stacked(arrs: list[np.ndarray], k: int, what: str) -> None:
    for a in arrs:
        if a.ndim == 0 or a.shape[0] != k:
            raise DecodeError("bad-shape", f"{what}: leading dim {a.shape[:1]} != {k}")


def _decode_batch(rec: dict, eid: str, ts: int) -> MultiAgentStepBatch:
    if rec["t0"] < 0:
        raise DecodeError("bad-value", f"negative t0 {rec['t0']}")
    flags = np.frombuffer(rec["env_flags"], dtype=np.uint8)
    n = flags.shape[0]
    if not 1 <= n <= MAX_BATCH_ENV_STEPS:
        raise DecodeError("bad-shape", f"{n} env steps: 1..{MAX_BATCH_ENV_STEPS} per batch")
    if n * max(1, len(rec["agents"])) > MAX_BATCH_CELLS:
        raise DecodeError("bad-shape", f"{n} env steps x {len(rec['agents'])} agents > {MAX_BATCH_CELLS} cells")
    if not _FLAG_VALUES[flags].all():
        raise DecodeError("bad-value", "an env flag byte with unknown bits or a true bit without its given bit")
    columns: list[AgentColumn] = []
    seen: set[str] = set()
    for c in rec["agents"]:
        aid = _id(c["agent_id"], "agent_id")
        if aid in seen:
            raise DecodeError("bad-value", f"agent {aid[:60]!r} has two columns")
        seen.add(aid)
        what = f"agent {aid[:60]!r}"
        presence = np.frombuffer(c["presence"], dtype=np.uint8)
        if presence.shape[0] != n:
            raise DecodeError("bad-shape", f"{what}: {presence.shape[0]} presence bytes for {n} env steps")
        if not _PRESENCE_VALUES[presence].all():
            raise DecodeError("bad-value", f"{what}: a presence byte with a true bit without its given bit")
        k_obs, k_act, k_rew, k_info = (int(np.count_nonzero(presence & b)) for b in (OBSERVATION, ACTION, REWARD, INFO))
        observations = _arrays(c["observations"], f"{what} observations")
        _stacked(observations, k_obs, f"{what} observations")
        actions = _arrays(c["actions"], f"{what} actions")
        _stacked(actions, k_act, f"{what} actions")
        rewards = _arrays([c["rewards"]], f"{what} rewards")[0]
        if rewards.dtype != np.float64 or rewards.shape != (k_rew,):
            raise DecodeError(
                "bad-shape", f"{what} rewards: want float64[{k_rew}], got {rewards.dtype}{list(rewards.shape)}"
            )
        if not np.isfinite(rewards).all():
            raise DecodeError("non-finite-reward", f"{what}: {rewards[~np.isfinite(rewards)][:3]}")
        if len(c["infos"]) != k_info:
            raise DecodeError("bad-shape", f"{what}: {len(c['infos'])} infos for {k_info} env steps with one")
        infos = [loads_info(s) for s in c["infos"]]
        rows = {}
        for name, mask in c["extra_rows"].items():
            m = np.frombuffer(mask, dtype=np.uint8)
            if name not in c["extra_model_outputs"] or m.shape[0] != k_act or (m > 1).any():
                raise DecodeError(
                    "bad-shape", f"{what} extra_rows[{name[:60]!r}]: not {k_act} bytes of 0/1 for an output"
                )
            rows[name] = m
        extra = {}
        for name, r in c["extra_model_outputs"].items():
            extra[name] = _arrays([r], f"{what} extra_model_outputs[{name[:60]!r}]")[0]
            k = k_act if name not in rows else int(np.count_nonzero(rows[name]))
            _stacked([extra[name]], k, f"{what} extra_model_outputs[{name[:60]!r}]")
        columns.append(AgentColumn(aid, presence, observations, actions, rewards, infos, extra, rows))
    return MultiAgentStepBatch(eid, rec["t0"], flags, columns, rec["ended"], ts)


def decode_event(
    value: bytes, headers: Any = None, *, max_bytes: int | None = None, registry: Any = None, key: bytes | None = None
) -> Any:
    """Decode one Kafka message of any rlrec kind, or raise `DecodeError` (and nothing else).

    Multi-agent kinds are decoded here; the single-agent ones by `rlrec.producer.events.decode_body`
    (a `RewardDelta` of version 2 carries `agent_id`). Whether a batch matches its episode's
    agents and spaces needs the episode: see `rlrec.consumer.multi_agent_fold`.

    Args:
        value: the message value.
        headers: the message headers (the ``rlrec-schema`` header names the kind).
        max_bytes: refuse larger values (`oversize`).
        registry: a `rlrec.producer.registry.SchemaRegistry` for Confluent-framed values.
        key: the message key, refused over `MAX_KEY_BYTES`.
    """
    kind, version, body = read_header(value, headers, max_bytes=max_bytes, registry=registry, key=key)
    if kind not in MULTI_AGENT_KINDS:
        return decode_body(kind, version, body)
    rec = _read_body(kind, version, bytes(body))
    eid = _id(rec["episode_id"], "episode_id")
    try:
        if kind == "MultiAgentEpisodeStart":
            return _decode_start(rec, eid, rec["timestamp_ms"])
        return _decode_batch(rec, eid, rec["timestamp_ms"])
    except DecodeError:
        raise
    except (ValueError, TypeError, OverflowError, MemoryError, RecursionError) as e:  # defensive: DecodeError only
        raise DecodeError("malformed", f"{kind}/{version}: {type(e).__name__}: {e}"[:300]) from None
