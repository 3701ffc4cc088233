"""Packed episodes -> numpy arrays, without RLlib: the decoder of the column-wise readers.

`Snapshot.steps` and everything built on it (``to_pandas``, ``to_polars``, ``to_duckdb``,
``to_torch``, ``rlrec export --to parquet``) and the evaluator's held-out reader read the
``item`` column of an episode shard into arrays here instead of building RLlib
`SingleAgentEpisode`s. Decoding is `rlrec.store.episodes.checked_state`, the same safe decoder
`unpack_episode` uses: the same refusals of pickled payloads (object arrays anywhere, object space
bounds) and the same budget for what spaces may allocate. What `SingleAgentEpisode.from_state`
then checks is checked here too (one observation and info more than rewards and actions, every
extra model output as long as the rewards, ``t - t_started`` steps). An item both decoders accept
gives the same arrays. This decoder also reads items `unpack_episode` refuses or cannot rebuild
(RLlib list-form Dict/Tuple and zero-step episodes; a map as the infos buffer's data), refuses
buffer data nested deeper than `MAX_DATA_DEPTH`, and turns any failure to decode one episode into
an `EpisodeDecodeError`.

`EpisodeArrays` answers the few questions the readers ask of an episode (``len``,
``get_observations``, ``get_actions``, ``get_rewards``, ``get_extra_model_outputs``,
``is_terminated``, ``is_truncated``, ``is_done``, ``custom_data``, the spaces) like the numpy-form
`SingleAgentEpisode` does. Both numpy-form (ours) and list-form (RLlib's recorder) states decode
to stacked arrays.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import pyarrow as pa

from rlrec.store.episodes import EpisodeDecodeError, checked_state

__all__ = ["EpisodeArrays", "decode_episode", "decode_items", "item_views"]

#: dtype kinds an observation or action leaf may have (numbers and booleans)
_NUMERIC_KINDS = frozenset("biuf")
#: how deep a buffer's data may nest maps and tuples (a Dict/Tuple space's structure; gymnasium
#: spaces of real environments nest a few levels): deeper data is refused, not recursed into
MAX_DATA_DEPTH = 32


@dataclass(frozen=True, eq=False)
class EpisodeArrays:
    """One decoded episode as stacked numpy arrays (what a numpy-form `SingleAgentEpisode`
    holds after its lookback), asked like one.

    Args:
        id_: the episode id.
        observations: T+1 observations: an array ``(T+1, *shape)``, or for a Dict/Tuple space a
            dict/tuple of such arrays.
        actions: T actions, likewise.
        rewards: the T rewards.
        extra_model_outputs: each output's T values as stored (arrays, or lists in list form).
        is_terminated: whether the episode terminated.
        is_truncated: whether it was truncated.
        observation_space: its observation space (None: not stored).
        action_space: its action space.
        custom_data: ``policy_id``, ``policy_version``, ``env_id`` for episodes rlrec wrote.

    Example:
        >>> from rlrec.store.episodes import pack_episode, to_single_agent_episode  # doctest: +SKIP
        >>> ep = decode_episode(item_bytes)  # doctest: +SKIP
        >>> len(ep), ep.get_observations().shape  # doctest: +SKIP
        (200, (201, 4))
    """

    id_: str
    observations: Any
    actions: Any
    rewards: np.ndarray
    extra_model_outputs: dict[str, Any]
    is_terminated: bool
    is_truncated: bool
    observation_space: gym.Space | None = None
    action_space: gym.Space | None = None
    custom_data: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rewards)

    @property
    def is_done(self) -> bool:
        return self.is_terminated or self.is_truncated

    def get_observations(self) -> Any:
        return self.observations

    def get_actions(self) -> Any:
        return self.actions

    def get_rewards(self) -> np.ndarray:
        return self.rewards

    def get_extra_model_outputs(self, key: str) -> Any:
        return self.extra_model_outputs[key]


def _too_deep(depth: int) -> None:
    if depth > MAX_DATA_DEPTH:
        raise EpisodeDecodeError(f"a buffer's data nests deeper than {MAX_DATA_DEPTH} levels (MAX_DATA_DEPTH)")


def _after_lookback(buffer: dict, depth: int = 0) -> Any:
    """A buffer state's data after its lookback (per leaf for a struct of arrays)."""
    _too_deep(depth)
    data, lb = buffer["data"], buffer["lookback"]
    if not lb:
        return data
    if isinstance(data, dict):
        return {k: _after_lookback({"data": v, "lookback": lb}, depth + 1) for k, v in data.items()}
    if isinstance(data, tuple):
        return tuple(_after_lookback({"data": v, "lookback": lb}, depth + 1) for v in data)
    try:
        return data[lb:]
    except TypeError:
        raise EpisodeDecodeError(f"a buffer's data of type {type(data).__name__} cannot be sliced") from None


def _leaf(values: Any, leaf: gym.Space | None, what: str) -> np.ndarray:
    """One stacked leaf: an array of numbers (a list of per-step values stacked)."""
    if isinstance(values, np.ndarray):
        a = values
    elif isinstance(values, list):
        if not values and leaf is not None:
            try:
                return np.zeros((0, *leaf.shape), dtype=leaf.dtype)
            except (ValueError, TypeError, MemoryError) as e:  # a declared shape numpy cannot hold
                raise EpisodeDecodeError(f"{what}: no steps of shape {leaf.shape}: {e}"[:300]) from None
        try:
            a = np.asarray(values)
        except (ValueError, TypeError) as e:
            raise EpisodeDecodeError(f"{what}: the steps' values do not stack: {e}"[:300]) from None
    else:
        raise EpisodeDecodeError(f"{what}: expected an array or a list of steps, got {type(values).__name__}")
    if a.dtype.kind not in _NUMERIC_KINDS or a.ndim < 1:
        raise EpisodeDecodeError(f"{what}: expected numbers stacked by step, got {a.dtype}{list(a.shape)}")
    return a


def _stacked(space: gym.Space | None, data: Any, what: str) -> Any:
    """Buffer data (after the lookback) as the struct of stacked arrays numpy form holds: a
    numpy-form struct as it is, a list form's per-step structs stacked leaf by leaf."""
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        keys = list(space.spaces) if isinstance(space, gym.spaces.Dict) else list(range(len(space.spaces)))
        subs = [space.spaces[k] for k in keys]
        if isinstance(data, list):  # list form: one struct per step
            try:
                parts = [[step[k] for step in data] for k in keys]
            except (KeyError, IndexError, TypeError):
                raise EpisodeDecodeError(f"{what}: a step does not fit the {type(space).__name__} space") from None
        elif isinstance(space, gym.spaces.Dict) and isinstance(data, dict) and set(data) == set(keys):
            parts = [data[k] for k in keys]
        elif isinstance(space, gym.spaces.Tuple) and isinstance(data, tuple) and len(data) == len(keys):
            parts = list(data)
        else:
            raise EpisodeDecodeError(f"{what}: the data does not fit the {type(space).__name__} space")
        values = [_stacked(s, p, f"{what}[{k!r}]") for k, s, p in zip(keys, subs, parts)]
        return dict(zip(keys, values)) if isinstance(space, gym.spaces.Dict) else tuple(values)
    return _leaf(data, space, what)


def _length(struct: Any, depth: int = 0) -> int:
    """Steps of a struct of stacked arrays (its leaves must agree)."""
    _too_deep(depth)
    if isinstance(struct, dict):
        lengths = {_length(v, depth + 1) for v in struct.values()}
    elif isinstance(struct, tuple):
        lengths = {_length(v, depth + 1) for v in struct}
    else:
        return len(struct)
    if len(lengths) != 1:
        raise EpisodeDecodeError("inconsistent buffer lengths")
    return lengths.pop()


def _raw_length(data: Any) -> int:
    if isinstance(data, (dict, tuple)):
        return _length(data)
    try:
        return len(data)
    except TypeError:
        raise EpisodeDecodeError(f"a buffer's data of type {type(data).__name__} has no length") from None


def decode_episode(data: bytes | bytearray | memoryview) -> EpisodeArrays:
    """Safely decode one packed episode (an ``item`` value) into `EpisodeArrays`, without RLlib.

    Refuses like `rlrec.store.episodes.unpack_episode`: `UnsafeEpisodeError` for payloads whose
    decoding would unpickle, `EpisodeDecodeError` (a ValueError) for malformed ones, and for
    observations or actions that are not numbers stacked by step and buffer data nested deeper
    than `MAX_DATA_DEPTH`. Every failure to decode the one episode is an `EpisodeDecodeError`
    (one unusable episode), never another exception. It accepts a few items `unpack_episode`
    refuses or cannot rebuild (RLlib list-form struct episodes, a map as the infos buffer's data).

    Args:
        data: the packed episode.

    Example:
        >>> from rlrec.store.episodes import pack_episode, to_single_agent_episode  # doctest: +SKIP
        >>> from rlrec.trainer.synthetic import expert_cartpole_episodes  # doctest: +SKIP
        >>> fe = expert_cartpole_episodes(1)[0]  # doctest: +SKIP
        >>> len(decode_episode(pack_episode(to_single_agent_episode(fe)))) == fe.length  # doctest: +SKIP
        True
    """
    try:
        return _decode(data)
    except EpisodeDecodeError:
        raise
    except Exception as e:  # RecursionError, MemoryError, a malformed state's KeyError/TypeError
        raise EpisodeDecodeError(f"cannot decode the episode: {type(e).__name__}: {e}"[:300]) from None


def _decode(data: bytes | bytearray | memoryview) -> EpisodeArrays:
    checked = checked_state(data)
    state = checked.state
    obs_space, act_space = checked.observation_space, checked.action_space
    observations = _stacked(obs_space, _after_lookback(state["observations"]), "observations")
    actions = _stacked(act_space, _after_lookback(state["actions"]), "actions")
    raw_rewards = _after_lookback(state["rewards"])
    try:
        rewards = np.asarray(raw_rewards)
    except (ValueError, TypeError) as e:
        raise EpisodeDecodeError(f"rewards: {e}"[:300]) from None
    if rewards.dtype.kind not in _NUMERIC_KINDS or rewards.ndim != 1:
        raise EpisodeDecodeError(f"rewards: expected one number per step, got {rewards.dtype}{list(rewards.shape)}")
    extras = {k: _after_lookback(b) for k, b in (state["extra_model_outputs"] or {}).items()}
    n_obs, n = _length(observations), len(rewards)
    n_infos = _raw_length(state["infos"]["data"]) - state["infos"]["lookback"]
    if not (
        n_obs == max(n_infos, 0)
        and (n_obs == 0 or n_obs == n + 1 == _length(actions) + 1)
        and all(_raw_length(v) == n for v in extras.values())
        and state["t"] - state["t_started"] == n
    ):
        raise EpisodeDecodeError("inconsistent buffer lengths")
    return EpisodeArrays(
        id_=state["id_"],
        observations=observations,
        actions=actions,
        rewards=rewards,
        extra_model_outputs=extras,
        is_terminated=state["is_terminated"],
        is_truncated=state["is_truncated"],
        observation_space=obs_space,
        action_space=act_space,
        custom_data=state.get("custom_data", {}),
    )


def item_views(column: pa.Array) -> Iterator[memoryview | None]:
    """The values of a binary column as views of its data buffer (no copy per value).
    A null value comes as None (`decode_episode` refuses it: it is not an episode).

    Args:
        column: a binary (or large binary) Arrow array.
    """
    if column.null_count:
        yield from (v.as_py() for v in column)
        return
    offsets_type = np.int64 if pa.types.is_large_binary(column.type) else np.int32
    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=offsets_type)[column.offset : column.offset + len(column) + 1]
    data = memoryview(data_buf) if data_buf is not None else memoryview(b"")
    bounds = offsets.tolist()
    for a, b in itertools.pairwise(bounds):
        yield data[a:b]


def decode_items(items: pa.Array | pa.ChunkedArray) -> list[EpisodeArrays]:
    """`decode_episode` of every value of an episode shard's ``item`` column, in order.

    Args:
        items: the column (binary), as the schema gate let it be read.
    """
    chunks = items.chunks if isinstance(items, pa.ChunkedArray) else [items]
    if not all(pa.types.is_binary(c.type) or pa.types.is_large_binary(c.type) for c in chunks):
        raise EpisodeDecodeError(f"the item column is not binary: {items.type}")
    return [decode_episode(v) for chunk in chunks for v in item_views(chunk)]
