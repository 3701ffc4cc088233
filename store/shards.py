"""Shard encoding and safe reading: finished episodes -> one complete Parquet file (bytes) that
stock RLlib reads, and back.

Two formats, chosen per shard (`encode_shard(..., fmt=...)`): ``episodes`` (RLlib's
``input_read_episodes=True``: one row per episode, the packed `SingleAgentEpisode` in column
``item`` plus metadata columns) and ``tabular`` (RLlib's ``input_read_episodes=False``: one row
per step with RLlib's column names, numeric Arrow arrays, never pickled). The specification --
columns, Arrow types, schema metadata, what stock RLlib needs to read each format -- is
docs/FORMAT.md, "Shard formats"; `EPISODE_COLUMNS`, `TABULAR_BASE_COLUMNS` and
`SHARD_FORMAT_VERSION` here are its code.

Episodes must be done (terminated or truncated), non-empty (T >= 1) and have distinct ids
within a shard: RLlib's PreLearner rejects batches containing undone episodes (ValueError) and
silently drops duplicate ids; an empty episode has no step to train on. `encode_shard` raises
ValueError otherwise. Our readers (`read_episodes`, `read_tabular`) never unpickle.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq

from rlrec.producer.events import dumps_info
from rlrec.producer.spaces import dumps_space, per_space
from rlrec.store.episodes import check_finished_episode, pack_finished_episodes, unpack_episode
from rlrec.store.finished import FinishedEpisode
from rlrec.store.schema_gate import (
    EPISODE_COLUMNS,
    RESERVED_TABULAR_NAMES,
    SHARD_FORMAT_VERSION,
    SHARD_FORMATS,
    open_shard,
)

__all__ = [
    "EPISODE_COLUMNS",
    "FORMATS",
    "SHARD_FORMAT_VERSION",
    "TABULAR_BASE_COLUMNS",
    "EncodedShard",
    "encode_shard",
    "episodes_table",
    "read_episodes",
    "read_tabular",
    "shard_metadata",
    "tabular_table",
]

FORMATS = SHARD_FORMATS

#: fixed columns of a tabular shard (RLlib's names); extra model outputs and `infos` come too.
TABULAR_BASE_COLUMNS = (
    "eps_id",
    "agent_id",
    "module_id",
    "obs",
    "actions",
    "rewards",
    "new_obs",
    "terminateds",
    "truncateds",
    "t",
    "policy_version",
)
_RESERVED = RESERVED_TABULAR_NAMES

META_FORMAT = b"rlrec.format"
META_VERSION = b"rlrec.schema_version"
META_OBS_SPACE = b"rlrec.observation_space"
META_ACT_SPACE = b"rlrec.action_space"


@dataclass
class EncodedShard:
    """One encoded shard: a complete Parquet file and what it holds."""

    data: bytes
    episodes: int
    steps: int
    sha256: str
    episode_ids: list[str] = field(default_factory=list)
    fmt: str = "episodes"
    schema_version: int = SHARD_FORMAT_VERSION

    @property
    def nbytes(self) -> int:
        return len(self.data)


# ---------------------------------------------------------------------------------------------
# helpers


def _check_episodes(episodes: list[FinishedEpisode]) -> None:
    if not episodes:
        raise ValueError("a shard needs at least one episode")
    seen: set[str] = set()
    for fe in episodes:
        if fe.episode_id in seen:
            raise ValueError(f"episode {fe.episode_id} appears twice in one shard (RLlib would drop one silently)")
        seen.add(fe.episode_id)
        if not (fe.terminated or fe.truncated):
            raise ValueError(f"episode {fe.episode_id} is neither terminated nor truncated (RLlib rejects it)")
        if fe.length < 1:
            raise ValueError(f"episode {fe.episode_id} has no steps (RLlib cannot sample from it)")
        check_finished_episode(fe)


_space_json = per_space(dumps_space)  # ~30 ms for an 84x84x4 Box's bounds: once per space


def _common_space_json(spaces: list[gym.Space]) -> bytes | None:
    texts = {_space_json(s) for s in {id(s): s for s in spaces}.values()}
    return texts.pop().encode() if len(texts) == 1 else None


def _metadata(fmt: str, episodes: list[FinishedEpisode]) -> dict[bytes, bytes]:
    meta = {META_FORMAT: fmt.encode(), META_VERSION: str(SHARD_FORMAT_VERSION).encode()}
    for key, spaces in (
        (META_OBS_SPACE, [e.observation_space for e in episodes]),
        (META_ACT_SPACE, [e.action_space for e in episodes]),
    ):
        text = _common_space_json(spaces)
        if text is not None:
            meta[key] = text
    return meta


def _leaf_to_arrow(a: np.ndarray, multidim: str) -> pa.Array:
    """(N, *shape) numeric array -> Arrow column (plain, fixed-size list(s) or tensor)."""
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    shape = a.shape[1:]
    if not shape:
        return pa.array(a)
    if 0 in shape:
        raise ValueError(f"a tabular shard cannot hold arrays with a zero-size dimension {shape}; use fmt='episodes'")
    if len(shape) >= 2 and multidim == "tensor":
        return pa.FixedShapeTensorArray.from_numpy_ndarray(a)
    arr: pa.Array = pa.array(a.reshape(-1))
    for d in reversed(shape):
        arr = pa.FixedSizeListArray.from_arrays(arr, d)
    return arr


def _space_to_arrow(space: gym.Space, leaves: list[np.ndarray], multidim: str, pos: list[int]) -> pa.Array:
    if isinstance(space, gym.spaces.Dict):
        names = list(space.spaces)
        children = [_space_to_arrow(s, leaves, multidim, pos) for s in space.spaces.values()]
        return pa.StructArray.from_arrays(children, names=names)
    if isinstance(space, gym.spaces.Tuple):
        children = [_space_to_arrow(s, leaves, multidim, pos) for s in space.spaces]
        return pa.StructArray.from_arrays(children, names=[str(i) for i in range(len(children))])
    a = leaves[pos[0]]
    pos[0] += 1
    return _leaf_to_arrow(a, multidim)


def _column(space: gym.Space, per_episode: list[list[np.ndarray]], multidim: str) -> pa.Array:
    n_leaves = len(per_episode[0])
    stacked = [np.concatenate([ep[i] for ep in per_episode], axis=0) for i in range(n_leaves)]
    return _space_to_arrow(space, stacked, multidim, [0])


#: columns of unique, large values (a packed episode each): written without a dictionary (which
#: pyarrow would build by hashing every value, then abandon) and without min/max statistics
_PLAIN_COLUMNS = frozenset({"item"})


def _write(table: pa.Table, compression: str, row_group_size: int | None) -> bytes:
    buf = pa.BufferOutputStream()  # Arrow's own memory: no Python call (nor the GIL) per page
    options = {}
    if _PLAIN_COLUMNS.intersection(table.column_names):  # the names are leaf paths: top-level columns only
        usual = [name for name in table.column_names if name not in _PLAIN_COLUMNS]
        options = {"use_dictionary": usual, "write_statistics": usual}
    pq.write_table(table, buf, compression=compression, row_group_size=row_group_size, **options)
    return buf.getvalue().to_pybytes()


# ---------------------------------------------------------------------------------------------
# tables


def _item_column(episodes: list[FinishedEpisode]) -> pa.Array:
    """The packed episodes (`pack_episode` bytes) as a binary column, built on msgpack's buffer
    without copying it (copied into chunks if over binary's 2 GiB of offsets)."""
    data, ends = pack_finished_episodes(episodes)  # checked by `_check_episodes`
    if ends[-1] > np.iinfo(np.int32).max:
        return pa.array([bytes(data[a:b]) for a, b in zip([0, *ends[:-1]], ends)], type=pa.binary())
    offsets = np.array([0, *ends], dtype=np.int32)
    return pa.Array.from_buffers(pa.binary(), len(ends), [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def episodes_table(episodes: list[FinishedEpisode]) -> pa.Table:
    """The Arrow table of an episode shard (`item` + metadata columns)."""
    cols: dict[str, pa.Array] = {"item": _item_column(episodes)}
    values: dict[str, list[Any]] = {
        "episode_id": [e.episode_id for e in episodes],
        "policy_id": [e.policy_id for e in episodes],
        "policy_version": [int(e.policy_version) for e in episodes],
        "env_id": [e.env_id for e in episodes],
        "length": [e.length for e in episodes],
        "episode_return": [e.episode_return for e in episodes],
        "terminated": [bool(e.terminated) for e in episodes],
        "truncated": [bool(e.truncated) for e in episodes],
        "first_offset": [int(e.first_offset) for e in episodes],
        "last_offset": [int(e.last_offset) for e in episodes],
        "started_ms": [int(e.started_ms) for e in episodes],
        "ended_ms": [int(e.ended_ms) for e in episodes],
    }
    for name, typ in EPISODE_COLUMNS.items():
        cols[name] = pa.array(values[name], type=typ)
    return pa.table(cols).replace_schema_metadata(_metadata("episodes", episodes))


def tabular_table(episodes: list[FinishedEpisode], multidim: str = "nested") -> pa.Table:
    """The Arrow table of a tabular shard (one row per step; see module docstring)."""
    if multidim not in ("nested", "tensor"):
        raise ValueError(f"multidim must be 'nested' or 'tensor', got {multidim!r}")
    first = episodes[0]
    for fe in episodes[1:]:
        for what, a, b in (
            ("observation", fe.observation_space, first.observation_space),
            ("action", fe.action_space, first.action_space),
        ):
            if a is not b and _arrow_type(a, multidim) != _arrow_type(b, multidim):
                raise ValueError(
                    f"episode {fe.episode_id}: {what} space {a} does not fit the shard's column type "
                    f"(from {b}); write episodes with different space structures to different shards"
                )
    lengths = np.array([fe.length for fe in episodes], dtype=np.int64)
    n = int(lengths.sum())
    ids = np.array([fe.episode_id for fe in episodes], dtype=object)

    cols: dict[str, pa.Array] = {}
    cols["eps_id"] = pa.array(np.repeat(ids, lengths), type=pa.string())
    cols["agent_id"] = pa.nulls(n)
    cols["module_id"] = pa.nulls(n)
    cols["obs"] = _column(first.observation_space, [[o[:-1] for o in fe.observations] for fe in episodes], multidim)
    cols["actions"] = _column(first.action_space, [fe.actions for fe in episodes], multidim)
    cols["rewards"] = pa.array(np.concatenate([np.asarray(fe.rewards, dtype=np.float64) for fe in episodes]))
    cols["new_obs"] = _column(first.observation_space, [[o[1:] for o in fe.observations] for fe in episodes], multidim)
    last = np.zeros(n, dtype=bool)
    last[np.cumsum(lengths) - 1] = True
    term = np.repeat(np.array([bool(fe.terminated) for fe in episodes]), lengths) & last
    trunc = np.repeat(np.array([bool(fe.truncated) for fe in episodes]), lengths) & last
    cols["terminateds"] = pa.array(term)
    cols["truncateds"] = pa.array(trunc)
    cols["t"] = pa.array(np.concatenate([np.arange(L, dtype=np.int64) for L in lengths]))

    if any(info for fe in episodes for info in fe.infos[1:]):
        cols["infos"] = pa.array(
            [dumps_info(info) or None for fe in episodes for info in fe.infos[1:]], type=pa.string()
        )

    keys: list[str] = []
    for fe in episodes:
        keys.extend(k for k in fe.extra_model_outputs if k not in keys)
    for k in keys:
        if k in _RESERVED or k.startswith("rlrec_"):
            raise ValueError(f"extra model output {k!r} collides with a column name RLlib or rlrec reserves")
        ref = next(np.asarray(fe.extra_model_outputs[k]) for fe in episodes if k in fe.extra_model_outputs)
        chunks = []
        typ = None
        for fe in episodes:
            v = fe.extra_model_outputs.get(k)
            if v is None:
                chunks.append(None)
                continue
            v = np.asarray(v)
            if v.dtype != ref.dtype or v.shape[1:] != ref.shape[1:]:
                raise ValueError(
                    f"extra model output {k!r}: episode {fe.episode_id} has {v.dtype}{list(v.shape[1:])}, "
                    f"others {ref.dtype}{list(ref.shape[1:])}"
                )
            chunks.append(v)
        present = [c for c in chunks if c is not None]
        if len(present) == len(chunks):
            cols[k] = _leaf_to_arrow(np.concatenate(present, axis=0), multidim)
        else:  # some episodes lack this output: nulls for their rows
            parts = []
            for fe, c in zip(episodes, chunks):
                if c is not None:
                    arr = _leaf_to_arrow(c, multidim)
                    typ = arr.type
                    parts.append(arr)
                else:
                    parts.append(fe.length)
            cols[k] = pa.concat_arrays([p if isinstance(p, pa.Array) else pa.nulls(p, typ) for p in parts])

    cols["policy_version"] = pa.array(
        np.repeat(np.array([int(fe.policy_version) for fe in episodes], dtype=np.int64), lengths)
    )
    return pa.table(cols).replace_schema_metadata(_metadata("tabular", episodes))


def _arrow_type(space: gym.Space, multidim: str) -> pa.DataType:
    from rlrec.producer.spaces import space_leaves

    leaves = [np.zeros((1, *leaf.shape), dtype=leaf.dtype) for leaf in space_leaves(space)]
    return _space_to_arrow(space, leaves, multidim, [0]).type


# ---------------------------------------------------------------------------------------------
# encoding


def encode_shard(
    episodes: list[FinishedEpisode],
    fmt: str = "episodes",
    compression: str = "zstd",
    *,
    episodes_per_row_group: int = 128,
    rows_per_row_group: int = 65536,
    multidim: str = "nested",
) -> EncodedShard:
    """Encode finished episodes into one complete Parquet file (see module docstring).

    `fmt`: "episodes" (one packed `SingleAgentEpisode` per row, RLlib's episode format) or
    "tabular" (one row per step, RLlib's column format). `compression`: any Parquet codec
    pyarrow knows ("zstd", "snappy", "gzip", "lz4", "none"). Raises ValueError for episodes RLlib
    cannot use (not done, empty, duplicate ids, arrays inconsistent with the spaces).
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    episodes = list(episodes)
    _check_episodes(episodes)
    if fmt == "episodes":
        data = _write(episodes_table(episodes), compression, max(1, episodes_per_row_group))
    else:
        data = _write(tabular_table(episodes, multidim), compression, max(1, rows_per_row_group))
    return EncodedShard(
        data=data,
        episodes=len(episodes),
        steps=sum(fe.length for fe in episodes),
        sha256=hashlib.sha256(data).hexdigest(),
        episode_ids=[fe.episode_id for fe in episodes],
        fmt=fmt,
        schema_version=SHARD_FORMAT_VERSION,
    )


# ---------------------------------------------------------------------------------------------
# reading


def shard_metadata(path_or_bytes: Any, filesystem: pa.fs.FileSystem | None = None) -> dict[str, str]:
    """The ``rlrec.*`` schema metadata of a shard (format, schema version, spaces), once its
    schema passed the gate (`rlrec.store.schema_gate`; `ShardSchemaError` otherwise)."""
    return open_shard(path_or_bytes, filesystem=filesystem).metadata()


def read_episodes(path_or_bytes: Any, filesystem: pa.fs.FileSystem | None = None) -> list:
    """All episodes of an episode shard (a file path/URI or the file's bytes), decoded SAFELY.

    The schema passes the gate first (`ShardSchemaError`); then only the `item` column is read and
    each value goes through `rlrec.store.episodes.unpack_episode`, which refuses pickled payloads
    (`UnsafeEpisodeError`).
    """
    table = open_shard(path_or_bytes, fmt="episodes", filesystem=filesystem).read(["item"])
    out = []
    for chunk in table.column("item").chunks:
        for v in chunk:
            out.append(unpack_episode(v.as_py()))
    return out


def read_tabular(
    path_or_bytes: Any, filesystem: pa.fs.FileSystem | None = None, columns: list[str] | None = None
) -> pa.Table:
    """A tabular shard (file path/URI or bytes) as a pyarrow Table (optionally some columns), once
    its schema passed the gate (`ShardSchemaError` otherwise)."""
    return open_shard(path_or_bytes, fmt="tabular", filesystem=filesystem).read(columns)
