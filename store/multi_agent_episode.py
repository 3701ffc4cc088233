"""The multi-agent record: its bytes, their safe decoding, and RLlib's `MultiAgentEpisode`
rebuilt from it and its agents' `SingleAgentEpisode`s.

A multi-agent episode is stored as one row per agent episode (docs/FORMAT.md, "Multi-agent
rows"); every row of the episode carries the same record in column ``multi_agent_record``: the
fields of `MultiAgentEpisode.get_state()` that its agents' episodes do not hold (env_t_started,
env_t, agent_t_started, env_t_to_agent_t, the agent -> module map, the hanging caches, the
flags, custom_data) plus, packed, the agent episodes that cannot be training rows (``carried``:
not done, or without a step). `pack_record` writes it, `unpack_record` reads it back without
pickle (arrays only of allow-listed dtypes, `rlrec.store.episodes`' decoder) and checks every
field's type (`MultiAgentRecordError` otherwise), and `assemble_episode` rebuilds the episode.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import msgpack_numpy

from rlrec.store.episodes import EpisodeDecodeError, UnsafeEpisodeError, _safe_ndarray_hook

__all__ = [
    "AGENT_MAPS",
    "MAX_RECORD_BYTES",
    "RECORD_VERSION",
    "MultiAgentRecordError",
    "RecordTooLargeError",
    "assemble_episode",
    "pack_record",
    "unpack_record",
]

RECORD_VERSION = 1
#: what one record may be (carried agent episodes included); a larger value is refused unread
MAX_RECORD_BYTES = 64 * 1024 * 1024
_MAX_AGENTS = 100_000
SKIP = "S"

#: the multi-agent record's maps keyed by agent id
AGENT_MAPS = (
    "agent_t_started",
    "env_t_to_agent_t",
    "modules",
    "hanging_actions_end",
    "hanging_extra_model_outputs_end",
    "hanging_rewards_end",
    "hanging_rewards_begin",
)
_DICT_FIELDS = (*AGENT_MAPS, "custom_data")


class MultiAgentRecordError(EpisodeDecodeError):
    """A stored multi-agent record is malformed (or would need pickle to decode)."""


class RecordTooLargeError(MultiAgentRecordError):
    """A record over `MAX_RECORD_BYTES` (its carried agent episodes included): readers refuse it,
    so the writer does not store it; ``reason`` is ``record_too_large`` (a data error)."""

    reason = "record_too_large"


def pack_record(record: Mapping[str, Any], carried: Mapping[str, bytes] | None = None) -> bytes:
    """The ``multi_agent_record`` bytes: msgpack of ``{"record": record, "carried": {agent id:
    packed SingleAgentEpisode}}`` (arrays in msgpack-numpy form).

    Args:
        record: the multi-agent fields (`rlrec.consumer.multi_agent_split.MultiAgentSplit.record`).
        carried: agent id -> `rlrec.store.episodes.pack_episode` bytes of an agent episode that
            is not a row.

    Raises:
        RecordTooLargeError: the bytes would be over `MAX_RECORD_BYTES`.

    Example:
        >>> rec = {"v": 1, "env_t_started": 0, "env_t": 1, "agent_t_started": {"a": 0},
        ...        "env_t_to_agent_t": {"a": {"data": [0, 1], "lookback": 0}}, "modules": {"a": "m"},
        ...        "hanging_actions_end": {}, "hanging_extra_model_outputs_end": {},
        ...        "hanging_rewards_end": {}, "hanging_rewards_begin": {}, "is_terminated": True,
        ...        "is_truncated": False, "agents": ["a"], "custom_data": {}}
        >>> unpack_record(pack_record(rec))[0] == rec
        True
    """
    data = msgpack.packb({"record": dict(record), "carried": dict(carried or {})}, default=msgpack_numpy.encode)
    if len(data) > MAX_RECORD_BYTES:
        raise RecordTooLargeError(
            f"multi-agent record: {len(data)} bytes (carried agents {sorted(carried or {})[:5]}), "
            f"over MAX_RECORD_BYTES ({MAX_RECORD_BYTES})"
        )
    return data


def _fail(what: str) -> MultiAgentRecordError:
    return MultiAgentRecordError(f"multi-agent record: {what}")


def _str_keyed(d: Any, what: str) -> dict:
    if not isinstance(d, dict) or len(d) > _MAX_AGENTS or not all(isinstance(k, str) for k in d):
        raise _fail(f"{what} must be a map with string keys")
    return d


def _check(record: Any) -> dict:
    if not isinstance(record, dict):
        raise _fail("not a map")
    if record.get("v") != RECORD_VERSION:
        raise _fail(f"version {record.get('v')!r:.20} is not {RECORD_VERSION} (upgrade rlrec)")
    for k in ("env_t_started", "env_t"):
        if type(record.get(k)) is not int or record[k] < 0:
            raise _fail(f"{k} must be a non-negative integer")
    for k in ("is_terminated", "is_truncated"):
        if not isinstance(record.get(k), bool):
            raise _fail(f"{k} must be a boolean")
    for k in _DICT_FIELDS:
        _str_keyed(record.get(k), k)
    agents = record.get("agents")
    if not isinstance(agents, list) or not all(isinstance(a, str) for a in agents) or len(set(agents)) != len(agents):
        raise _fail("agents must be a list of distinct strings")
    if not all(type(t) is int and t >= 0 for t in record["agent_t_started"].values()):
        raise _fail("agent_t_started values must be non-negative integers")
    if not all(isinstance(m, str) for m in record["modules"].values()):
        raise _fail("modules must map agent ids to module ids")
    for k in ("hanging_rewards_end", "hanging_rewards_begin"):
        if not all(type(r) is float for r in record[k].values()):
            raise _fail(f"{k} values must be floats")
    if not all(isinstance(v, dict) for v in record["hanging_extra_model_outputs_end"].values()):
        raise _fail("hanging_extra_model_outputs_end values must be maps")
    n = record["env_t"] - record["env_t_started"]
    if n < 0:
        raise _fail("env_t is before env_t_started")
    agents_set = set(agents)
    if not agents_set <= set(record["modules"]):
        raise _fail("an agent has no module")
    if not set(record["env_t_to_agent_t"]) <= agents_set or not set(record["agent_t_started"]) <= agents_set:
        raise _fail("env_t_to_agent_t or agent_t_started names an agent that is not one of its agents")
    longest = 0
    for a, m in record["env_t_to_agent_t"].items():
        if not isinstance(m, dict) or set(m) != {"data", "lookback"}:
            raise _fail(f"env_t_to_agent_t[{a!r:.40}] must be a map of data and lookback")
        data, lookback = m["data"], m["lookback"]
        # one entry per env step (RLlib may tag a step skipped and then add it: done, no observation)
        if lookback != 0 or type(lookback) is not int or not isinstance(data, list) or len(data) not in (n + 1, n + 2):
            raise _fail(f"env_t_to_agent_t[{a!r:.40}]: lookback must be 0 and data one entry per env step")
        steps = [t for t in data if t != SKIP]
        if not all(type(t) is int and t >= 0 for t in steps) or len(steps) + data.count(SKIP) != len(data):
            raise _fail(f"env_t_to_agent_t[{a!r:.40}]: values must be agent steps or {SKIP!r}")
        if any(b <= a_ for a_, b in itertools.pairwise(steps)):
            raise _fail(f"env_t_to_agent_t[{a!r:.40}]: agent steps must increase")
        longest = max(longest, len(data))
    if record["env_t_to_agent_t"] and longest < n + 1:
        raise _fail("env_t is past the env steps its map records")
    return record


def unpack_record(data: bytes | bytearray | memoryview) -> tuple[dict, dict[str, bytes]]:
    """(record, carried) of ``multi_agent_record`` bytes, decoded without pickle and checked.

    Args:
        data: the column's value.

    Raises:
        MultiAgentRecordError: malformed or too large.
        rlrec.store.episodes.UnsafeEpisodeError: it holds what would be unpickled.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _fail(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_RECORD_BYTES:
        raise _fail(f"{len(data)} bytes, over MAX_RECORD_BYTES ({MAX_RECORD_BYTES})")
    try:
        outer = msgpack.unpackb(data, object_hook=_safe_ndarray_hook)  # limits: the input's length
    except UnsafeEpisodeError:
        raise
    except EpisodeDecodeError as e:
        raise MultiAgentRecordError(f"multi-agent record: {e}") from None
    except Exception as e:
        raise _fail(f"not msgpack: {type(e).__name__}: {e}"[:300]) from None
    if not isinstance(outer, dict) or set(outer) != {"record", "carried"}:
        raise _fail("expected a map of record and carried")
    carried = _str_keyed(outer["carried"], "carried")
    if not all(isinstance(v, bytes) for v in carried.values()):
        raise _fail("carried agent episodes must be bytes")
    return _check(outer["record"]), carried


def assemble_episode(
    agent_episodes: Mapping[str, Any], record: Mapping[str, Any], episode_id: str, mapping_fn: Callable | None = None
) -> Any:
    """RLlib's `MultiAgentEpisode` of a checked record and its agents' episodes, as
    `MultiAgentEpisode.from_state` would set it (ray 2.60).

    Args:
        agent_episodes: agent id -> its `SingleAgentEpisode` (rows and carried), every agent of
            ``record["agents"]``.
        record: a record `unpack_record` returned.
        episode_id: the multi-agent episode's id.
        mapping_fn: the episode's `agent_to_module_mapping_fn`; None: the record's modules.

    Raises:
        MultiAgentRecordError: an agent of the record is missing, or one is not the record's.
    """
    from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
    from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer

    agents = record["agents"]
    if set(agents) != set(agent_episodes):
        raise _fail(f"episode {episode_id}: agents {sorted(agent_episodes)[:5]} are not the record's {agents[:5]}")
    for a in agents:
        sa = agent_episodes[a]
        if sa.agent_id != a or sa.multi_agent_episode_id != episode_id or sa.module_id != record["modules"].get(a):
            raise _fail(f"episode {episode_id}: agent {a!r:.40}'s episode does not belong to it")
        steps = [t for t in record["env_t_to_agent_t"].get(a, {"data": []})["data"] if t != SKIP]
        first = record["agent_t_started"].get(a, 0)
        last = len(sa) + first
        if any(t > last for t in steps):
            raise _fail(f"episode {episode_id}: agent {a!r:.40}'s env-step map points past its {last} steps")
        if steps and (steps[0] != first or steps[-1] != last or len(steps) != len(sa) + 1):
            raise _fail(
                f"episode {episode_id}: agent {a!r:.40}'s env-step map does not cover its steps {first}..{last} once each"
            )
    modules = dict(record["modules"])
    if mapping_fn is None:
        mapping_fn = lambda agent_id, episode=None: modules[agent_id]  # noqa: E731
    ep = MultiAgentEpisode(id_=episode_id, agent_to_module_mapping_fn=mapping_fn)
    ep._agent_to_module_mapping = modules
    ep.observation_space = {
        a: agent_episodes[a].observation_space for a in agents if agent_episodes[a].observation_space is not None
    }
    ep.action_space = {a: agent_episodes[a].action_space for a in agents if agent_episodes[a].action_space is not None}
    ep.env_t_started = record["env_t_started"]
    ep.env_t = record["env_t"]
    ep.agent_t_started = defaultdict(int, record["agent_t_started"])
    mapping = defaultdict(InfiniteLookbackBuffer)
    for a, m in record["env_t_to_agent_t"].items():
        mapping[a] = InfiniteLookbackBuffer(data=list(m["data"]), lookback=m["lookback"])
    ep.env_t_to_agent_t = mapping
    ep._hanging_actions_end = dict(record["hanging_actions_end"])
    ep._hanging_extra_model_outputs_end = defaultdict(dict, record["hanging_extra_model_outputs_end"])
    ep._hanging_rewards_end = defaultdict(float, record["hanging_rewards_end"])
    ep._hanging_rewards_begin = defaultdict(float, record["hanging_rewards_begin"])
    ep.is_terminated = record["is_terminated"]
    ep.is_truncated = record["is_truncated"]
    ep.agent_episodes = {a: agent_episodes[a] for a in agents}
    ep._start_time = ep._last_step_time = None
    ep._custom_data = dict(record["custom_data"])
    try:
        ep.validate()
    except AssertionError as e:
        raise _fail(f"episode {episode_id}: an agent episode is inconsistent: {e}"[:300]) from None
    return ep
