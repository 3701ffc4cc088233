"""The steps table (docs/FORMAT.md, "Steps table"): one row per step, built from one gated shard.

`gated_steps` turns a shard the schema gate opened (`rlrec.store.schema_gate.GatedShard`) into
the columns `STEP_COLUMNS`: an episode shard's ``item`` column through the column-wise decoder
(`rlrec.store.episode_arrays`, no `SingleAgentEpisode`), a tabular shard's columns directly.
`tabular_episodes` rebuilds `SingleAgentEpisode`s from a tabular shard for `Snapshot.episodes`;
`column_to_numpy` turns a step column into numpy for the torch and evaluator readers. Which
shards, in which order, read ahead how far: `rlrec.store.snapshot_reader`.

Example::

    >>> from rlrec.store.schema_gate import open_shard
    >>> from rlrec.store.shards import encode_shard
    >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
    >>> from types import SimpleNamespace
    >>> data = encode_shard(expert_cartpole_episodes(2, max_steps=5), "episodes").data
    >>> table = gated_steps(open_shard(data, fmt="episodes"), SimpleNamespace(policy_id="p", path="x"))
    >>> table.column_names == list(STEP_COLUMNS), table.num_rows
    (True, 10)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from rlrec.store.manifest import ShardEntry
from rlrec.store.schema_gate import TABULAR_FIXED_COLUMNS, ShardSchemaError

__all__ = [
    "STEP_COLUMNS",
    "STEP_SOURCES",
    "column_to_numpy",
    "empty_steps",
    "gated_steps",
    "naming_errors",
    "repeated_strings",
    "tabular_episodes",
]

#: the columns of `Snapshot.steps`, in order (observation/action types follow the spaces)
STEP_COLUMNS = (
    "episode_id",
    "t",
    "observation",
    "action",
    "reward",
    "terminated",
    "truncated",
    "action_logp",
    "policy_version",
    "next_observation",
    "policy_id",
)


@contextlib.contextmanager
def naming_errors(where: str) -> Iterator[None]:
    """Re-raise an episode that cannot be decoded (`EpisodeDecodeError`, `UnsafeEpisodeError`)
    with the shard's URI in front of the reason."""
    from rlrec.store.episodes import EpisodeDecodeError

    try:
        yield
    except EpisodeDecodeError as e:
        raise type(e)(f"{where}: {e}") from None
    except pa.ArrowInvalid as e:  # columns of an episode that do not fit together
        raise ValueError(f"{where}: {e}") from None


def _plain(arr: pa.Array) -> pa.Array:
    """`arr` with fixed-shape tensors turned into nested fixed-size lists (plain Arrow types)."""
    t = arr.type
    if isinstance(t, pa.FixedShapeTensorType):
        values = arr.storage.flatten()
        for d in reversed(t.shape):
            values = pa.FixedSizeListArray.from_arrays(values, d)
        return values
    if pa.types.is_struct(t):
        return pa.StructArray.from_arrays(
            [_plain(arr.field(i)) for i in range(t.num_fields)], names=[t.field(i).name for i in range(t.num_fields)]
        )
    return arr


def _column(table: pa.Table, name: str) -> pa.Array:
    return _plain(table.column(name).combine_chunks())


def column_to_numpy(col: pa.Array) -> Any:
    """A step column as numpy: nested fixed-size lists -> one array of shape ``(n, *shape)``;
    strings -> a list of str; structs -> a dict of those (float nulls become NaN)."""
    t = col.type
    if pa.types.is_struct(t):
        return {t.field(i).name: column_to_numpy(col.field(i)) for i in range(t.num_fields)}
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return col.to_pylist()
    shape = []
    values = col
    while pa.types.is_fixed_size_list(values.type):
        shape.append(values.type.list_size)
        values = values.flatten()
    return values.to_numpy(zero_copy_only=False).reshape(len(col), *shape)


def _arrow_leaves(col: pa.Array) -> list[np.ndarray]:
    """The leaf arrays of a step column (a struct's fields depth first: the spaces' leaf order)."""
    t = col.type
    if pa.types.is_struct(t):
        return [leaf for i in range(t.num_fields) for leaf in _arrow_leaves(col.field(i))]
    return [column_to_numpy(col)]


#: columns of a tabular shard that are not extra model outputs
_TABULAR_NOT_EXTRA = frozenset({*TABULAR_FIXED_COLUMNS, "obs", "actions", "new_obs"})


def tabular_episodes(shard: Any, entry: ShardEntry) -> list[Any]:
    """The episodes of a gated tabular shard as `SingleAgentEpisode`s (rows grouped by
    ``eps_id``, each episode's rows contiguous and ordered by ``t``; ValueError otherwise)."""
    from rlrec.producer.events import loads_info
    from rlrec.producer.spaces import loads_space
    from rlrec.store.episodes import to_single_agent_episode
    from rlrec.store.finished import EMPTY_INFO, FinishedEpisode

    meta = shard.metadata()
    if "rlrec.observation_space" not in meta or "rlrec.action_space" not in meta:
        raise ValueError(f"{entry.path}: a tabular shard without its spaces in the schema metadata")
    obs_space, act_space = loads_space(meta["rlrec.observation_space"]), loads_space(meta["rlrec.action_space"])
    table = shard.read()
    ids = table.column("eps_id").to_pylist()
    ts = column_to_numpy(_column(table, "t"))
    cols = {name: _arrow_leaves(_column(table, name)) for name in ("obs", "actions", "new_obs")}
    rewards = column_to_numpy(_column(table, "rewards")).astype(np.float64)
    term, trunc = column_to_numpy(_column(table, "terminateds")), column_to_numpy(_column(table, "truncateds"))
    versions = column_to_numpy(_column(table, "policy_version")) if "policy_version" in table.column_names else None
    infos = table.column("infos").to_pylist() if "infos" in table.column_names else None
    extra_names = [k for k in table.column_names if k not in _TABULAR_NOT_EXTRA]
    extras = {k: column_to_numpy(_column(table, k)) for k in extra_names}
    missing = {k: table.column(k).is_null().to_numpy(zero_copy_only=False) for k in extra_names}  # null: not logged
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
    if len(set(ids)) != len(starts):
        raise ValueError(f"{entry.path}: an episode's rows are not contiguous")
    out = []
    for a, b in zip(starts, [*starts[1:], len(ids)]):
        if not np.array_equal(ts[a:b], np.arange(b - a)):
            raise ValueError(f"{entry.path}: episode {ids[a]}: t is not 0, 1, 2, ...")
        fe = FinishedEpisode(
            episode_id=ids[a],
            policy_id=entry.policy_id,
            policy_version=int(versions[a]) if versions is not None else 0,
            env_id="",
            observation_space=obs_space,
            action_space=act_space,
            observations=[np.concatenate([o[a:b], n[b - 1 : b]]) for o, n in zip(cols["obs"], cols["new_obs"])],
            actions=[x[a:b] for x in cols["actions"]],
            rewards=rewards[a:b],
            infos=[
                EMPTY_INFO,
                *(loads_info(i) if i else EMPTY_INFO for i in (infos[a:b] if infos else [None] * (b - a))),
            ],
            extra_model_outputs={k: v[a:b] for k, v in extras.items() if not missing[k][a:b].all()},
            terminated=bool(term[b - 1]),
            truncated=bool(trunc[b - 1]),
            first_offset=0,
            last_offset=0,
            started_ms=0,
            ended_ms=0,
        )
        out.append(to_single_agent_episode(fe))
    return out


def repeated_strings(values: list[str], counts: np.ndarray) -> pa.Array | pa.ChunkedArray:
    """A string column holding ``values[i]`` ``counts[i]`` times over, in order, built from its
    buffers (no Python object per row; a chunked column past the 2 GiB a string array holds).

    Args:
        values: the strings.
        counts: how often each one repeats (non-negative integers, as many as `values`).

    Example::

        >>> repeated_strings(["a", "bc"], np.array([2, 1])).to_pylist()
        ['a', 'a', 'bc']
    """
    encoded = [v.encode() for v in values]
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    sizes = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    total = int(sizes @ counts)
    if total > _MAX_STRING_BYTES:  # past a string array's int32 offsets: pyarrow chunks the column
        return pa.array(np.repeat(np.array(values, dtype=object), counts), pa.string())
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.repeat(sizes, counts), out=offsets[1:])
    if total <= _JOINED_BYTES:
        data: Any = b"".join(e * c for e, c in zip(encoded, counts.tolist()))
    else:  # each value written once into the one buffer (no copy of every repetition first)
        data = np.empty(total, dtype=np.uint8)
        pos = 0
        for e, c in zip(encoded, counts.tolist()):
            if e and c:
                data[pos : pos + c * len(e)].reshape(c, len(e))[:] = np.frombuffer(e, dtype=np.uint8)
                pos += c * len(e)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


#: the bytes a string array's (int32) offsets can address
_MAX_STRING_BYTES = np.iinfo(np.int32).max
#: `repeated_strings` joins repetitions up to this many bytes (fast for a shard's few ids) and
#: writes each value once into a preallocated buffer above it (peak memory: the column once)
_JOINED_BYTES = 64 * 1024 * 1024


def _logp(values: pa.Array | None, n: int) -> pa.Array:
    if values is None:
        return pa.nulls(n, pa.float64())
    if pa.types.is_fixed_size_list(values.type) or pa.types.is_list(values.type):
        values = values.flatten()  # a (T, 1) output
    return values.cast(pa.float64())


_STRUCT_TYPES: dict[type, bool] = {}


def _is_struct(space: Any) -> bool:
    """Whether `space` is a Dict or Tuple space (answered once per type)."""
    known = _STRUCT_TYPES.get(type(space))
    if known is None:
        import gymnasium as gym

        known = _STRUCT_TYPES[type(space)] = issubclass(type(space), (gym.spaces.Dict, gym.spaces.Tuple))
    return known


def _leaves(space: Any, data: Any) -> list[np.ndarray]:
    """The leaf arrays of batched `data` (a value of `space` with a leading time axis)."""
    if not _is_struct(space):
        return [np.asarray(data)]
    import gymnasium as gym

    if isinstance(space, gym.spaces.Dict):
        return [leaf for k, s in space.spaces.items() for leaf in _leaves(s, data[k])]
    return [leaf for i, s in enumerate(space.spaces) for leaf in _leaves(s, data[i])]


def _last_steps(n: int, ends: np.ndarray, flags: np.ndarray) -> pa.Array:
    """n booleans, true at ``ends[i] - 1`` where ``flags[i]`` (a flag of an episode's last step)."""
    out = np.zeros(n, dtype=bool)
    out[ends[flags] - 1] = True
    return pa.array(out)


def _episode_columns(episodes: list[Any]) -> dict[str, pa.Array]:
    """The step columns (but ``policy_version`` and ``policy_id``) of decoded episodes
    (`rlrec.store.episode_arrays.EpisodeArrays` or `SingleAgentEpisode`s), built column by
    column: per episode only its arrays are gathered."""
    from rlrec.store.shards import _column as space_column

    ep0 = episodes[0]
    count = len(episodes)
    obs = [_leaves(ep.observation_space, ep.get_observations()) for ep in episodes]
    acts = [_leaves(ep.action_space, ep.get_actions()) for ep in episodes]
    lengths = np.fromiter(map(len, episodes), dtype=np.int64, count=count)
    ends = np.cumsum(lengths)
    n = int(ends[-1]) if count else 0
    logged = [ep for ep in episodes if "action_logp" in ep.extra_model_outputs]
    if len(logged) == count:  # every episode logged its propensities
        logps = [np.asarray(ep.get_extra_model_outputs("action_logp"), dtype=np.float64) for ep in episodes]
        action_logp = pa.array(np.concatenate([p.reshape(k) for p, k in zip(logps, lengths.tolist())]))
    else:
        logp = np.zeros(n, dtype=np.float64)
        missing = np.ones(n, dtype=bool)  # null: no propensity logged
        for ep, end, length in zip(episodes, ends.tolist(), lengths.tolist()):
            if "action_logp" in ep.extra_model_outputs:
                values = np.asarray(ep.get_extra_model_outputs("action_logp"), dtype=np.float64)
                logp[end - length : end] = values.reshape(length)
                missing[end - length : end] = False
        action_logp = pa.array(logp, mask=missing)
    nonempty = lengths > 0
    terminated = np.fromiter((ep.is_terminated for ep in episodes), dtype=bool, count=count) & nonempty
    truncated = np.fromiter((ep.is_truncated for ep in episodes), dtype=bool, count=count) & nonempty
    return {
        "episode_id": repeated_strings([ep.id_ for ep in episodes], lengths),
        "t": pa.array(np.arange(n, dtype=np.int64) - np.repeat(ends - lengths, lengths)),
        "observation": space_column(ep0.observation_space, [[x[:-1] for x in o] for o in obs], "nested"),
        "action": space_column(ep0.action_space, acts, "nested"),
        "reward": pa.array(np.concatenate([np.asarray(ep.get_rewards(), dtype=np.float64) for ep in episodes])),
        "terminated": _last_steps(n, ends, terminated),
        "truncated": _last_steps(n, ends, truncated),
        "action_logp": action_logp,
        "next_observation": space_column(ep0.observation_space, [[x[1:] for x in o] for o in obs], "nested"),
    }


#: the columns of a shard its steps are made of, per format (None: all)
STEP_SOURCES: dict[str, list[str] | None] = {"episodes": ["item", "policy_version"], "tabular": None}


def gated_steps(shard: Any, entry: ShardEntry, read: pa.Table | None = None) -> pa.Table:
    """The steps (columns `STEP_COLUMNS`) of one gated shard (`rlrec.store.schema_gate.GatedShard`)
    whose manifest entry is `entry`; `read`: its columns `STEP_SOURCES` names, if already read
    (with ``shard.read``)."""
    if shard.fmt == "episodes":
        from rlrec.store.episode_arrays import decode_items

        table = read if read is not None else shard.read(STEP_SOURCES["episodes"])
        episodes = decode_items(table.column("item"))
        if not episodes:
            return empty_steps()
        cols = _episode_columns(episodes)
        versions = np.asarray(table.column("policy_version").to_numpy(), dtype=np.int64)
        cols["policy_version"] = pa.array(np.repeat(versions, [len(ep) for ep in episodes]))
    else:
        table = read if read is not None else shard.read()
        n = table.num_rows
        cols = {
            "episode_id": _column(table, "eps_id"),
            "t": _column(table, "t") if "t" in table.column_names else None,
            "observation": _column(table, "obs"),
            "action": _column(table, "actions"),
            "reward": _column(table, "rewards").cast(pa.float64()),
            "terminated": _column(table, "terminateds"),
            "truncated": _column(table, "truncateds"),
            "action_logp": _logp(_column(table, "action_logp") if "action_logp" in table.column_names else None, n),
            "policy_version": _column(table, "policy_version")
            if "policy_version" in table.column_names
            else pa.nulls(n, pa.int64()),
            "next_observation": _column(table, "new_obs"),
        }
        if cols["t"] is None:
            raise ShardSchemaError(f"{entry.path}: a tabular shard without a t column")
    n = len(cols["episode_id"])
    cols["policy_id"] = repeated_strings([entry.policy_id], np.array([n]))
    return pa.table({k: cols[k] for k in STEP_COLUMNS})


def empty_steps() -> pa.Table:
    """The steps of no shard (observation and action of type null)."""
    return pa.table(
        {
            "episode_id": pa.array([], pa.string()),
            "t": pa.array([], pa.int64()),
            "observation": pa.array([], pa.null()),
            "action": pa.array([], pa.null()),
            "reward": pa.array([], pa.float64()),
            "terminated": pa.array([], pa.bool_()),
            "truncated": pa.array([], pa.bool_()),
            "action_logp": pa.array([], pa.float64()),
            "policy_version": pa.array([], pa.int64()),
            "next_observation": pa.array([], pa.null()),
            "policy_id": pa.array([], pa.string()),
        }
    )
