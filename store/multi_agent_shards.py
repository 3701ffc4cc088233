"""Multi-agent rows: one row per agent episode in the `episodes` shard shape, format version 2.

A multi-agent episode's agents become rows of the `episodes` shape (docs/FORMAT.md, "Multi-agent
rows"): ``item`` is the agent's packed `SingleAgentEpisode` (what RLlib's `MultiAgentEpisode`
holds for it), the metadata columns are the agent episode's (``episode_id`` its deterministic
id, ``policy_id`` its module's policy id ``{policy_id}.{module_id}``), and seven columns follow:
``multi_agent_episode_id``, ``multi_agent_policy_id``, ``agent_id``, ``module_id``,
``env_terminated`` / ``env_truncated``
(the env's own last flags for the agent; RLlib's are in ``item``) and ``multi_agent_record``
(`rlrec.store.multi_agent_episode.pack_record`, the same bytes in every row of the episode).

Each module's rows go to their own shard under ``{policy_id}.{module_id}/``, so gc, compaction,
``inspect`` and ``--policy-id`` see a module as a policy, and stock RLlib trains one module from
one folder (it reads ``item`` only). The files carry ``rlrec.schema_version`` 2, which readers
before it refuse ("upgrade rlrec"); `read_agent_rows` reads them back safely.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from rlrec.store.episodes import pack_episode, unpack_episode
from rlrec.store.multi_agent_episode import MAX_RECORD_BYTES, RecordTooLargeError
from rlrec.store.schema_gate import (
    EPISODE_COLUMNS,
    MULTI_AGENT_COLUMNS,
    MULTI_AGENT_SHARD_FORMAT_VERSION,
    GatedShard,
    ShardSchemaError,
)
from rlrec.store.shards import META_FORMAT, META_VERSION, EncodedShard, _write

__all__ = [
    "AgentRow",
    "MultiAgentShardEpisode",
    "agent_episode_id",
    "encode_multi_agent_shards",
    "module_policy_id",
    "read_agent_rows",
]


def agent_episode_id(multi_agent_episode_id: str, agent_id: str) -> str:
    """The deterministic `SingleAgentEpisode.id_` of one agent of a multi-agent episode: 64 hex
    characters of sha256 over both ids (RLlib draws a random one; a row needs a stable id).

    Args:
        multi_agent_episode_id: the multi-agent episode's id.
        agent_id: the agent's id.

    Example:
        >>> agent_episode_id("ep-1", "a0") == agent_episode_id("ep-1", "a0") != agent_episode_id("ep-1", "a1")
        True
        >>> len(agent_episode_id("ep-1", "a0"))
        64
    """
    h = hashlib.sha256()
    for part in (multi_agent_episode_id, agent_id):
        raw = part.encode("utf-8")
        h.update(len(raw).to_bytes(8, "big"))
        h.update(raw)
    return h.hexdigest()


def module_policy_id(policy_id: str, module_id: str) -> str:
    """The policy id a module's rows are stored under.

    Args:
        policy_id: the multi-agent episode's policy id.
        module_id: the module's id.

    Raises:
        ValueError: the module id holds a ``.`` (policy ``a.b`` module ``c`` and policy ``a``
            module ``b.c`` would share a folder).

    Example:
        >>> module_policy_id("traffic", "cars")
        'traffic.cars'
    """
    if "." in module_id:
        raise ValueError(f"module id {module_id!r:.60} holds a '.': its rows' folder would be ambiguous")
    return f"{policy_id}.{module_id}"


@dataclass
class MultiAgentShardEpisode:
    """One multi-agent episode ready for shards.

    Args:
        episode_id: the multi-agent episode's id.
        policy_id: its policy id (each module's rows go under ``{policy_id}.{module_id}``).
        policy_version: the policy version that acted.
        env_id: the env's id.
        rows: agent id -> its `SingleAgentEpisode` (done, at least one step).
        record: `rlrec.store.multi_agent_episode.pack_record` bytes.
        env_flags: agent id -> (terminated, truncated) as the env last flagged the agent.
        first_offset: the Kafka offset of its first event (-1: none).
        last_offset: the Kafka offset of its last event (-1: none).
        started_ms: when it began.
        ended_ms: when it ended.
    """

    episode_id: str
    policy_id: str
    policy_version: int
    env_id: str
    rows: dict[str, Any]
    record: bytes
    env_flags: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    first_offset: int = -1
    last_offset: int = -1
    started_ms: int = 0
    ended_ms: int = 0


def _row(ma: MultiAgentShardEpisode, agent_id: str, sa: Any) -> dict:
    if not (sa.is_done and len(sa) >= 1):
        raise ValueError(f"episode {ma.episode_id}: agent {agent_id!r:.40} is not done or has no step: not a row")
    term, trunc = ma.env_flags.get(agent_id, (False, False))
    return {
        "item": pack_episode(sa),
        "episode_id": sa.id_,
        "policy_id": module_policy_id(ma.policy_id, sa.module_id),
        "policy_version": int(ma.policy_version),
        "env_id": ma.env_id,
        "length": len(sa),
        "episode_return": float(np.sum(np.asarray(sa.rewards.data, dtype=np.float64))),
        "terminated": bool(sa.is_terminated),
        "truncated": bool(sa.is_truncated),
        "first_offset": int(ma.first_offset),
        "last_offset": int(ma.last_offset),
        "started_ms": int(ma.started_ms),
        "ended_ms": int(ma.ended_ms),
        "multi_agent_episode_id": ma.episode_id,
        "multi_agent_policy_id": ma.policy_id,
        "agent_id": agent_id,
        "module_id": sa.module_id,
        "env_terminated": bool(term),
        "env_truncated": bool(trunc),
        "multi_agent_record": ma.record,
    }


_TYPES = {"item": pa.binary(), **EPISODE_COLUMNS, **MULTI_AGENT_COLUMNS}


def encode_multi_agent_shards(
    episodes: Iterable[MultiAgentShardEpisode], compression: str = "zstd", rows_per_row_group: int = 128
) -> dict[str, EncodedShard]:
    """One shard per module policy id holding its agents' rows: ``{policy_id}.{module_id}`` ->
    `EncodedShard` (format ``episodes``, version 2).

    Args:
        episodes: the multi-agent episodes; their agent episode ids must be distinct.
        compression: any Parquet codec.
        rows_per_row_group: rows per Parquet row group.

    Raises:
        ValueError: an agent episode is not done or empty, or an id appears twice.
        rlrec.store.multi_agent_episode.RecordTooLargeError: an episode's record is over
            `MAX_RECORD_BYTES` (readers refuse it): a data error.

    Example:
        >>> # see tests/test_multi_agent_shards.py: built from `split_recording` of a real env
    """
    by_policy: dict[str, list[dict]] = defaultdict(list)
    seen: set[str] = set()
    for ma in episodes:
        if len(ma.record) > MAX_RECORD_BYTES:
            raise RecordTooLargeError(
                f"episode {ma.episode_id}: multi-agent record of {len(ma.record)} bytes, over MAX_RECORD_BYTES "
                f"({MAX_RECORD_BYTES})"
            )
        for agent_id, sa in ma.rows.items():
            row = _row(ma, agent_id, sa)
            if row["episode_id"] in seen:
                raise ValueError(f"agent episode {row['episode_id']} appears twice")
            seen.add(row["episode_id"])
            by_policy[row["policy_id"]].append(row)
    out = {}
    for policy, rows in by_policy.items():
        table = pa.table({k: pa.array([r[k] for r in rows], type=t) for k, t in _TYPES.items()})
        table = table.replace_schema_metadata(
            {META_FORMAT: b"episodes", META_VERSION: str(MULTI_AGENT_SHARD_FORMAT_VERSION).encode()}
        )
        data = _write(table, compression, rows_per_row_group)
        out[policy] = EncodedShard(
            data=data,
            episodes=len(rows),
            steps=sum(r["length"] for r in rows),
            sha256=hashlib.sha256(data).hexdigest(),
            episode_ids=[r["episode_id"] for r in rows],
            fmt="episodes",
            schema_version=MULTI_AGENT_SHARD_FORMAT_VERSION,
        )
    return out


@dataclass
class AgentRow:
    """One agent episode read back from a multi-agent shard (``index``: its row in the shard,
    ``item_bytes``: its packed size)."""

    multi_agent_episode_id: str
    agent_id: str
    module_id: str
    episode: Any
    record: bytes
    env_terminated: bool
    env_truncated: bool
    episode_id: str = ""
    policy_id: str = ""
    multi_agent_policy_id: str = ""
    index: int = -1
    item_bytes: int = 0


_READ = [
    "item",
    "episode_id",
    "policy_id",
    "multi_agent_episode_id",
    "multi_agent_policy_id",
    "agent_id",
    "module_id",
    "env_terminated",
    "env_truncated",
    "multi_agent_record",
]
_IDS = ["episode_id", "multi_agent_episode_id", "agent_id"]


def _records(column: pa.ChunkedArray) -> list[bytes | None]:
    """The record of every row, each distinct value one `bytes` (read as a dictionary array: a
    record repeated in an episode's rows is decoded once)."""
    out: list[bytes | None] = []
    for chunk in column.chunks:
        if isinstance(chunk, pa.DictionaryArray):
            values = chunk.dictionary.to_pylist()
            out += [None if i is None else values[i] for i in chunk.indices.to_pylist()]
        else:
            out += chunk.to_pylist()
    return out


def read_agent_ids(shard: GatedShard) -> list[tuple[str, str, str]]:
    """(episode_id, multi_agent_episode_id, agent_id) of every row of a gated multi-agent shard,
    reading only those columns.

    Args:
        shard: an ``episodes`` shard of version 2 that passed the schema gate.
    """
    if shard.fmt != "episodes" or shard.version != MULTI_AGENT_SHARD_FORMAT_VERSION:
        raise ShardSchemaError(f"not a multi-agent shard ({shard.fmt} v{shard.version})")
    table = shard.read(_IDS)
    return list(zip(*(table.column(n).to_pylist() for n in _IDS), strict=True))


def read_agent_rows(shard: GatedShard, rows: Iterable[int] | None = None) -> list[AgentRow]:
    """The agent rows of a gated multi-agent shard, each ``item`` decoded safely
    (`rlrec.store.episodes.unpack_episode`) and checked against its row's ids: the agent,
    module and multi-agent ids, ``episode_id`` = `agent_episode_id` of them, and ``policy_id`` =
    `module_policy_id` of ``multi_agent_policy_id`` and ``module_id``.

    Args:
        shard: an ``episodes`` shard of version 2 that passed the schema gate.
        rows: the row indexes to decode (None: all).

    Raises:
        ShardSchemaError: the shard is not a multi-agent shard.
        rlrec.store.episodes.EpisodeDecodeError: a row is malformed.
    """
    if shard.fmt != "episodes" or shard.version != MULTI_AGENT_SHARD_FORMAT_VERSION:
        raise ShardSchemaError(f"not a multi-agent shard ({shard.fmt} v{shard.version})")
    from rlrec.store.episodes import EpisodeDecodeError

    table = shard.read(_READ, dictionary=["multi_agent_record"])
    wanted = range(table.num_rows) if rows is None else sorted(set(rows))
    records = _records(table.column("multi_agent_record"))
    cols = {name: table.column(name) for name in _READ if name not in ("item", "multi_agent_record")}
    items = table.column("item")
    out = []
    for i in wanted:
        values = {name: col[i].as_py() for name, col in cols.items()}
        item = items[i].as_py()
        if item is None or records[i] is None or any(v is None for v in values.values()):
            raise EpisodeDecodeError(f"row {i}: a multi-agent column is null")
        ma_id, agent, module = values["multi_agent_episode_id"], values["agent_id"], values["module_id"]
        ep = unpack_episode(item)
        if (ep.agent_id, ep.module_id, ep.multi_agent_episode_id) != (agent, module, ma_id):
            raise EpisodeDecodeError(f"row {i}: its episode's agent, module or multi-agent id differs from its row's")
        if not values["episode_id"] == ep.id_ == agent_episode_id(ma_id, agent):
            raise EpisodeDecodeError(f"row {i}: its episode id is not the agent episode id of its ids")
        if "." in module or values["policy_id"] != f"{values['multi_agent_policy_id']}.{module}":
            raise EpisodeDecodeError(f"row {i}: its policy id is not {{multi_agent_policy_id}}.{{module_id}}")
        out.append(
            AgentRow(
                ma_id,
                agent,
                module,
                ep,
                records[i],
                values["env_terminated"],
                values["env_truncated"],
                values["episode_id"],
                values["policy_id"],
                values["multi_agent_policy_id"],
                i,
                len(item),
            )
        )
    return out
