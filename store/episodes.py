"""`FinishedEpisode` -> RLlib `SingleAgentEpisode`, and the episode's byte form in shards.

Building
--------
`to_single_agent_episode` returns a real `ray.rllib.env.single_agent_episode.SingleAgentEpisode`
in *numpy form* (what `SingleAgentEpisode.to_numpy()` produces): every buffer except `infos`
holds one stacked array per leaf (a dict/tuple of stacked arrays for Dict/Tuple spaces).
Why numpy form:

* it is about half the size once packed (one msgpack-numpy record per leaf instead of one per
  step and leaf: ~2.3 KB vs ~3.5 KB for a CartPole episode) and packs ~1.5x faster;
* stock RLlib trains on it: the PreLearner (`input_read_episodes=True`) puts episodes into an
  `EpisodeReplayBuffer`, which samples numpy episodes as well as list ones (tested).

RLlib's own recorder (`OfflineSingleAgentEnvRunner`) writes *list-form* episodes instead
(it asserts `is_numpy is False` before packing); both forms decode with the same code.

The stacked leaves are unflattened (`rlrec.producer.spaces.unflatten_leaves`) into the struct that
`to_numpy()` would build from per-step structures: for a Dict space a dict (the space's key
order) of arrays shaped (T+1, *leaf_shape), for a Tuple space a tuple. The tests check that the
result equals, field by field, the episode RLlib builds itself with `add_env_reset` /
`add_env_step` on the same per-step structures followed by `to_numpy()`. The only fields that
differ are RLlib's wall-clock timers `_start_time`/`_last_step_time` (`time.perf_counter()` of
the building process, meaningless elsewhere): ours are None (`get_duration_s()` then gives 0).

A zero-length episode (T=0, e.g. aborted right after its start) is built like RLlib's
`to_numpy()` leaves it: observations stacked, actions/rewards empty lists, no extra model
outputs (RLlib's `get_state` cannot serialise empty extra-output buffers). RLlib cannot train on
such episodes; `rlrec.store.shards.encode_shard` refuses them.

Bytes
-----
`pack_episode` is exactly what `OfflineSingleAgentEnvRunner.sample` writes into the `item`
column: `msgpack.packb(episode.get_state(), default=msgpack_numpy.encode)`.

`unpack_episode` is the SAFE inverse for our own readers (inspect --verify, the trainer).
RLlib's reader (`msgpack.unpackb(item, object_hook=msgpack_numpy.decode)` and then
`SingleAgentEpisode.from_state`) executes code from the data in two places:

1. `msgpack_numpy.decode` unpickles arrays whose kind is ``b'O'`` (object dtype);
2. `from_state` rebuilds spaces with `ray.rllib.utils.serialization.gym_space_from_dict`, whose
   Box/MultiDiscrete bounds go through ``np.load(..., allow_pickle=True)``.

So whoever can write to the bucket can run code in a stock RLlib trainer. `unpack_episode`
decodes arrays only from an allow-list of plain dtypes (never object/void/structured), with the
byte length checked, parses the serialized spaces itself with ``np.load(allow_pickle=False)``
and allow-listed dtypes, and raises `UnsafeEpisodeError` for anything that would have been
unpickled and `EpisodeDecodeError` (a `ValueError`) for anything malformed. It never calls
`pickle` nor `gym_space_from_dict`. As a convenience it also restores tuples (msgpack turns them
into lists) where the episode's space is a Tuple, so `unpack_episode(pack_episode(ep))` equals
`ep` except for the documented space-serialisation losses of RLlib's `gym_space_to_dict`
(a Discrete's dtype and a MultiDiscrete's `start` are not serialised).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import msgpack
import msgpack_numpy
import numpy as np

from rlrec.producer.bounded import ByteBoundedLRU
from rlrec.producer.spaces import per_space, space_leaves, unflatten_leaves
from rlrec.store.finished import FinishedEpisode

__all__ = [
    "CheckedState",
    "EpisodeDecodeError",
    "UnsafeEpisodeError",
    "check_finished_episode",
    "checked_state",
    "episode_state",
    "finished_episode_state",
    "import_episode_classes",
    "pack_episode",
    "pack_finished_episodes",
    "to_single_agent_episode",
    "unpack_episode",
]

# dtype kinds an array in a packed episode may have: bool, ints, floats, complex, fixed-width
# bytes/str. Never 'O' (object: pickled), 'V' (void/structured: may embed objects), 'M'/'m'.
_SAFE_KINDS = frozenset("biufcSU")
_MAX_NDIM = 32
_MAX_SPACE_DEPTH = 16
#: what the spaces of one packed episode (its own, each buffer's, each extra model output's) may
#: decompress to in all: Box bounds and MultiDiscrete vectors are zlib-compressed npy, so a few
#: KB could otherwise make a reader hold gigabytes
MAX_SPACE_BYTES_PER_EPISODE = 64 * 1024 * 1024
#: decoded spaces kept for reuse across episodes, bounded by their arrays' bytes
SPACE_CACHE_BYTES = 64 * 1024 * 1024


class EpisodeDecodeError(ValueError):
    """A packed episode is malformed (not a `SingleAgentEpisode` state we can rebuild)."""


class UnsafeEpisodeError(EpisodeDecodeError):
    """A packed episode holds data whose decoding would execute code (pickled objects)."""


# ---------------------------------------------------------------------------------------------
# building


def import_episode_classes() -> None:
    """Import what building and packing episodes needs from RLlib (~2 s the first time), on the
    calling thread: a service calls it before it starts encoding on another thread."""
    _SingleAgentEpisode()
    from ray.rllib.utils.serialization import gym_space_to_dict  # noqa: F401


def _SingleAgentEpisode():
    # Imported lazily: `ray.rllib` takes ~2 s to import.
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    return SingleAgentEpisode


_space_leaves = per_space(lambda space: tuple(space_leaves(space)))


def check_finished_episode(fe: FinishedEpisode) -> None:
    """Raise ValueError unless the arrays of `fe` are consistent with its spaces and length."""
    T = fe.length
    rewards = np.asarray(fe.rewards)
    if rewards.ndim != 1:
        raise ValueError(f"episode {fe.episode_id}: rewards must be 1-D, got shape {rewards.shape}")
    for what, space, arrays, n in (
        ("observations", fe.observation_space, fe.observations, T + 1),
        ("actions", fe.action_space, fe.actions, T),
    ):
        leaves = _space_leaves(space)
        if len(arrays) != len(leaves):
            raise ValueError(f"episode {fe.episode_id}: {len(arrays)} {what} leaves, the space has {len(leaves)}")
        for i, (a, leaf) in enumerate(zip(arrays, leaves)):
            if not isinstance(a, np.ndarray) or a.dtype != leaf.dtype or a.shape != (n, *leaf.shape):
                got = f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
                raise ValueError(
                    f"episode {fe.episode_id}: {what}[{i}] is {got}, expected {leaf.dtype}{[n, *leaf.shape]}"
                )
    if len(fe.infos) != T + 1:
        raise ValueError(f"episode {fe.episode_id}: {len(fe.infos)} infos for T={T} (expected T+1)")
    for k, v in fe.extra_model_outputs.items():
        if np.ndim(v) == 0 or np.shape(v)[0] != T:
            raise ValueError(
                f"episode {fe.episode_id}: extra_model_outputs[{k!r}] has shape {np.shape(v)}, expected ({T}, ...)"
            )


def _struct(space: gym.Space, leaves: list[np.ndarray]) -> Any:
    """Stacked leaves -> the (possibly nested) struct of stacked arrays RLlib's numpy form holds."""
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        return unflatten_leaves(space, list(leaves))
    return leaves[0]


def _numpy_form(fe: FinishedEpisode, shared_empty: bool = False) -> tuple[Any, list[dict], Any, Any, dict]:
    """(observations, infos, actions, rewards, extra model outputs) as the numpy-form episode
    holds them; for an episode without steps what to_numpy() leaves (empty lists, no extras).
    Infos are new dicts; with `shared_empty` (only to be packed, never changed) an episode
    without any info gets one empty dict T+1 times."""
    obs = _struct(fe.observation_space, fe.observations)
    if shared_empty and not any(fe.infos):
        infos = [{}] * len(fe.infos)
    else:
        infos = [dict(i) if i else {} for i in fe.infos]
    if fe.length == 0:
        return obs, infos, [], [], {}
    actions = _struct(fe.action_space, fe.actions)
    extra = {k: np.asarray(v) for k, v in fe.extra_model_outputs.items()}
    return obs, infos, actions, np.asarray(fe.rewards, dtype=np.float64), extra


def to_single_agent_episode(fe: FinishedEpisode) -> SingleAgentEpisode:  # noqa: F821
    """Build the numpy-form `SingleAgentEpisode` of a finished episode (see module docstring).

    `id_` = episode id, `t_started=0`, no lookback buffer, the spaces attached, flags kept
    distinct and `custom_data = {"policy_id", "policy_version", "env_id"}`. Arrays are not
    copied (the episode shares them with `fe`).
    """
    check_finished_episode(fe)
    SingleAgentEpisode = _SingleAgentEpisode()
    obs, infos, actions, rewards, extra = _numpy_form(fe)
    ep = SingleAgentEpisode(
        id_=fe.episode_id,
        observations=obs,
        observation_space=fe.observation_space,
        infos=infos,
        actions=actions,
        action_space=fe.action_space,
        rewards=rewards,
        terminated=bool(fe.terminated),
        truncated=bool(fe.truncated),
        extra_model_outputs=extra,
        t_started=0,
        len_lookback_buffer=0,
    )
    ep.custom_data.update({"policy_id": fe.policy_id, "policy_version": int(fe.policy_version), "env_id": fe.env_id})
    return ep


# ---------------------------------------------------------------------------------------------
# packing


def pack_episode(ep) -> bytes:
    """The `item` bytes RLlib writes for an episode (`OfflineSingleAgentEnvRunner.sample`):
    byte for byte `msgpack.packb(ep.get_state(), default=msgpack_numpy.encode)`, computed
    faster (`episode_state`: each space is serialised once, not per episode and buffer)."""
    return msgpack.packb(episode_state(ep), default=msgpack_numpy.encode)


def pack_finished_episodes(episodes: Iterable[FinishedEpisode]) -> tuple[memoryview, list[int]]:
    """`pack_episode(to_single_agent_episode(fe))` of each checked episode, back to back in one
    buffer: (the buffer, each episode's end offset in it). The states are built straight from
    the `FinishedEpisode`s (`finished_episode_state`), and the buffer saves two copies per
    episode (msgpack's result bytes, then the copy into an Arrow column) -- for 84x84x4 frames,
    megabytes each."""
    packer = msgpack.Packer(default=msgpack_numpy.encode, autoreset=False)
    ends = []
    for fe in episodes:
        packer.pack(finished_episode_state(fe))
        with packer.getbuffer() as view:  # released at once: the packer cannot grow while exported
            ends.append(len(view))
    return packer.getbuffer(), ends


def finished_episode_state(fe: FinishedEpisode) -> dict:
    """`episode_state(to_single_agent_episode(fe))` for a checked episode, without building the
    `SingleAgentEpisode`: the same values, buffers and flags its constructor (ray 2.60) makes of
    what `to_single_agent_episode` passes it. The tests check the packed bytes are equal for
    every case."""
    obs, infos, actions, rewards, extra = _numpy_form(fe, shared_empty=True)  # packed, never changed

    def buffer(data: Any, space: gym.Space | None) -> dict:  # InfiniteLookbackBuffer(data, lookback=0, space)
        return {"data": data, "lookback": 0, "finalized": not isinstance(data, list), "space": _space_dict(space)}

    return {
        "id_": fe.episode_id,
        "agent_id": None,
        "module_id": None,
        "multi_agent_episode_id": None,
        "observations": buffer(obs, fe.observation_space),
        "actions": buffer(actions, fe.action_space),
        "rewards": buffer(rewards, _rewards_space()),
        "infos": buffer(infos, None),
        "extra_model_outputs": {k: buffer(v, None) for k, v in extra.items()} if extra else None,
        "is_terminated": bool(fe.terminated),
        "is_truncated": bool(fe.truncated),
        "t_started": 0,
        "t": len(rewards),
        "_observation_space": _space_dict(fe.observation_space),
        "_action_space": _space_dict(fe.action_space),
        "_start_time": None,
        "_last_step_time": None,
        "custom_data": {"policy_id": fe.policy_id, "policy_version": int(fe.policy_version), "env_id": fe.env_id},
    }


def _rewards_space() -> gym.Space:
    from ray.rllib.env.single_agent_episode import _REWARDS_BOX_SPACE

    return _REWARDS_BOX_SPACE


def episode_state(ep) -> dict:
    """`SingleAgentEpisode.get_state()` (ray 2.60, which rlrec pins), with each space's
    `gym_space_to_dict` computed once per space object instead of five times per episode (the
    observation and action spaces twice, the rewards' Box once). The tests check, for every
    kind of space, that packing it gives the bytes of packing `get_state()`."""

    def buffer(b) -> dict:
        return {"data": b.data, "lookback": b.lookback, "finalized": b.finalized, "space": _space_dict(b.space)}

    extra = ep.extra_model_outputs
    return {
        "id_": ep.id_,
        "agent_id": ep.agent_id,
        "module_id": ep.module_id,
        "multi_agent_episode_id": ep.multi_agent_episode_id,
        "observations": buffer(ep.observations),
        "actions": buffer(ep.actions),
        "rewards": buffer(ep.rewards),
        "infos": buffer(ep.infos),
        "extra_model_outputs": {k: buffer(v) if v else v for k, v in extra.items()} if len(extra) > 0 else None,
        "is_terminated": ep.is_terminated,
        "is_truncated": ep.is_truncated,
        "t_started": ep.t_started,
        "t": ep.t,
        "_observation_space": _space_dict(ep._observation_space),
        "_action_space": _space_dict(ep._action_space),
        "_start_time": ep._start_time,
        "_last_step_time": ep._last_step_time,
        "custom_data": ep.custom_data,
    }


def _gym_space_to_dict(space: gym.Space) -> dict:
    from ray.rllib.utils.serialization import gym_space_to_dict

    return gym_space_to_dict(space)


_rllib_space_dict = per_space(_gym_space_to_dict)


def _space_dict(space: gym.Space | None) -> dict | None:
    """RLlib's `gym_space_to_dict(space)`, computed once per space object (`per_space`)."""
    return _rllib_space_dict(space) if space else None  # get_state's own test: falsy -> None


# ---------------------------------------------------------------------------------------------
# safe unpacking


def _safe_dtype(descr: Any, what: str) -> np.dtype:
    if isinstance(descr, bytes):
        descr = descr.decode("ascii", "replace")
    if not isinstance(descr, str):
        # a list descr is a structured dtype: may embed objects, never produced for our data
        raise UnsafeEpisodeError(f"{what}: structured dtype descriptions are refused")
    try:
        dt = np.dtype(descr)
    except (TypeError, ValueError) as e:
        raise EpisodeDecodeError(f"{what}: bad dtype {descr!r}: {e}") from None
    if dt.hasobject or dt.kind == "O":
        raise UnsafeEpisodeError(f"{what}: object dtype {descr!r} (would be unpickled)")
    if dt.kind not in _SAFE_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise EpisodeDecodeError(f"{what}: dtype {descr!r} is not allowed")
    return dt


def _safe_ndarray_hook(obj: dict) -> Any:
    """msgpack object_hook equivalent to `msgpack_numpy.decode`, minus its pickle paths."""
    if b"nd" in obj:
        nd = obj[b"nd"]
        kind = obj.get(b"kind", b"")
        if kind == b"O":
            raise UnsafeEpisodeError("payload holds an object-dtype (pickled) array; refused")
        if kind not in (b"", None):
            raise UnsafeEpisodeError(f"payload holds an array of kind {kind!r}; refused")
        dt = _safe_dtype(obj.get(b"type"), "array")
        data = obj.get(b"data")
        if not isinstance(data, (bytes, bytearray)):
            raise EpisodeDecodeError("array without bytes data")
        if nd is True:
            shape = obj.get(b"shape")
            if (
                not isinstance(shape, (list, tuple))
                or len(shape) > _MAX_NDIM
                or not all(type(d) is int and d >= 0 for d in shape)
            ):
                raise EpisodeDecodeError(f"array with invalid shape {shape!r:.80}")
            if math.prod(shape) * dt.itemsize != len(data):
                raise EpisodeDecodeError(f"array of {dt}{list(shape)} with {len(data)} bytes")
            return np.frombuffer(data, dtype=dt).reshape(shape)
        if nd is False:
            if len(data) != dt.itemsize:
                raise EpisodeDecodeError(f"scalar of {dt} with {len(data)} bytes")
            return np.frombuffer(data, dtype=dt)[0]
        raise EpisodeDecodeError(f"bad 'nd' flag {nd!r}")
    if b"complex" in obj:
        data = obj.get(b"data")
        try:
            return complex(data.decode() if isinstance(data, bytes) else str(data))
        except (ValueError, UnicodeDecodeError) as e:
            raise EpisodeDecodeError(f"bad complex number: {e}") from None
    return obj


class _Budget:
    """Bytes a decode may still allocate; exceeding it is an `EpisodeDecodeError`."""

    def __init__(self, limit: int) -> None:
        self.limit = self.left = limit

    def take(self, n: int, what: str) -> None:
        if n > self.left:
            raise EpisodeDecodeError(
                f"{what}: the episode's spaces need more than their budget of {self.limit} bytes "
                "(MAX_SPACE_BYTES_PER_EPISODE); refused"
            )
        self.left -= n


def _npy(b64: Any, what: str, budget: _Budget) -> np.ndarray:
    """RLlib's `_serialize_ndarray` form (base64(zlib(npy))), decoded without pickle, within `budget`."""
    if not isinstance(b64, (str, bytes)):
        raise EpisodeDecodeError(f"{what}: expected a base64 string")
    try:
        raw = base64.b64decode(b64, validate=True)
        d = zlib.decompressobj()
        npy = d.decompress(raw, budget.left + 1)  # never more than the budget allows
        budget.take(len(npy), what)
    except (binascii.Error, zlib.error, ValueError) as e:
        if isinstance(e, EpisodeDecodeError):
            raise
        raise EpisodeDecodeError(f"{what}: {e}") from None
    try:
        a = np.load(io.BytesIO(npy), allow_pickle=False)
    except ValueError as e:
        if "allow_pickle" in str(e) or "Object arrays" in str(e):
            raise UnsafeEpisodeError(f"{what}: pickled object array in a space; refused") from None
        raise EpisodeDecodeError(f"{what}: {e}") from None
    except Exception as e:
        raise EpisodeDecodeError(f"{what}: {type(e).__name__}: {e}") from None
    if not isinstance(a, np.ndarray):
        raise EpisodeDecodeError(f"{what}: not a single array")
    _safe_dtype(a.dtype.str, what)
    return a


def _int(v: Any, what: str) -> int:
    if type(v) is not int:
        raise EpisodeDecodeError(f"{what}: expected an integer, got {type(v).__name__}")
    return v


def _space_from_rllib_dict(d: Any, budget: _Budget, depth: int = 0) -> gym.Space:
    """`gym_space_from_dict` for the space kinds we write, without `np.load(allow_pickle=True)`,
    allocating at most `budget`."""
    if depth > _MAX_SPACE_DEPTH:
        raise EpisodeDecodeError("space nesting is too deep")
    if not isinstance(d, dict) or not isinstance(d.get("space"), str):
        raise EpisodeDecodeError(f"a space must be a map with a 'space' name, got {type(d).__name__}")
    kind = d["space"]
    try:
        if kind == "box":
            low, high = _npy(d.get("low"), "Box.low", budget), _npy(d.get("high"), "Box.high", budget)
            shape = d.get("shape")
            if not isinstance(shape, (list, tuple)) or not all(type(x) is int and x >= 0 for x in shape):
                raise EpisodeDecodeError(f"Box: bad shape {shape!r:.80}")
            return gym.spaces.Box(low=low, high=high, shape=tuple(shape), dtype=_safe_dtype(d.get("dtype"), "Box"))
        if kind == "discrete":
            return gym.spaces.Discrete(_int(d.get("n"), "Discrete.n"), start=_int(d.get("start", 0), "Discrete.start"))
        if kind == "multi-binary":
            n = d.get("n")
            if isinstance(n, (list, tuple)):
                n = [_int(x, "MultiBinary.n") for x in n]
            else:
                n = _int(n, "MultiBinary.n")
            return gym.spaces.MultiBinary(n)
        if kind == "multi-discrete":
            nvec = _npy(d.get("nvec"), "MultiDiscrete.nvec", budget)
            return gym.spaces.MultiDiscrete(nvec, dtype=_safe_dtype(d.get("dtype"), "MultiDiscrete"))
        if kind == "tuple":
            items = d.get("spaces")
            if not isinstance(items, list):
                raise EpisodeDecodeError("Tuple: 'spaces' must be a list")
            return gym.spaces.Tuple([_space_from_rllib_dict(s, budget, depth + 1) for s in items])
        if kind == "dict":
            items = d.get("spaces")
            if not isinstance(items, dict) or not all(isinstance(k, str) for k in items):
                raise EpisodeDecodeError("Dict: 'spaces' must be a map with string keys")
            return gym.spaces.Dict(
                OrderedDict((k, _space_from_rllib_dict(s, budget, depth + 1)) for k, s in items.items())
            )
    except EpisodeDecodeError:
        raise
    except (ValueError, TypeError, AssertionError, OverflowError) as e:
        raise EpisodeDecodeError(f"{kind} space: {e}") from None
    raise EpisodeDecodeError(f"space kind {kind!r} is not supported by the safe reader")


_spaces = ByteBoundedLRU(SPACE_CACHE_BYTES)
_spaces_lock = threading.Lock()


def _space(d: Any, budget: _Budget) -> gym.Space | None:
    """The space `d` describes: from the cache (bounded by bytes), or decoded within `budget`."""
    if d is None:
        return None
    try:
        key = msgpack.packb(d)
    except (TypeError, ValueError) as e:
        raise EpisodeDecodeError(f"space description is not plain data: {e}") from None
    with _spaces_lock:
        space = _spaces.get(key)
    if space is None:
        before = budget.left
        space = _space_from_rllib_dict(d, budget)
        with _spaces_lock:
            _spaces.put(key, space, len(key) + before - budget.left)
    return space


def _tuplify(space: gym.Space | None, data: Any) -> Any:
    """msgpack turns tuples into lists; give Tuple-space data back its tuples."""
    if isinstance(space, gym.spaces.Tuple) and isinstance(data, list):
        return tuple(_tuplify(s, x) for s, x in zip(space.spaces, data))
    if isinstance(space, gym.spaces.Dict) and isinstance(data, dict):
        return {k: _tuplify(space.spaces.get(k), v) for k, v in data.items()}
    return data


_BUFFER_KEYS = ("data", "lookback", "finalized", "space")
_BUFFER_KEY_SET = frozenset(_BUFFER_KEYS)
_STATE_KEYS = (
    "id_",
    "agent_id",
    "module_id",
    "multi_agent_episode_id",
    "observations",
    "actions",
    "rewards",
    "infos",
    "extra_model_outputs",
    "is_terminated",
    "is_truncated",
    "t_started",
    "t",
    "_observation_space",
    "_action_space",
    "_start_time",
    "_last_step_time",
)
_STATE_KEY_SET = frozenset(_STATE_KEYS)


def _buffer_state(b: Any, what: str, budget: _Budget) -> tuple[dict, gym.Space | None]:
    if not isinstance(b, dict) or not b.keys() >= _BUFFER_KEY_SET:
        raise EpisodeDecodeError(f"{what}: not a lookback-buffer state")
    if type(b["lookback"]) is not int or b["lookback"] < 0 or not isinstance(b["finalized"], bool):
        raise EpisodeDecodeError(f"{what}: bad lookback/finalized")
    space = _space(b["space"], budget)
    b = dict(b, space=None)
    if not isinstance(space, (gym.spaces.Tuple, gym.spaces.Dict)):
        pass  # nothing to give back
    elif not b["finalized"] and isinstance(b["data"], list):  # list form: one value per step
        b["data"] = [_tuplify(space, x) for x in b["data"]]
    else:
        b["data"] = _tuplify(space, b["data"])
    return b, space


class EmptyInfos:
    """The ``data`` of an infos buffer whose every info is an empty map, not built: its length.
    `unpack_episode` gives the episode a new empty dict per step (`materialized`)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def materialized(self) -> list[dict]:
        return [{} for _ in range(self.n)]


def _empty_maps(region: bytes) -> int | None:
    """n if `region` is a msgpack array of n empty maps, else None."""
    head = region[0] if region else 0
    if 0x90 <= head <= 0x9F:
        n, start = head & 0x0F, 1
    elif head == 0xDC:
        n, start = int.from_bytes(region[1:3], "big"), 3
    elif head == 0xDD:
        n, start = int.from_bytes(region[1:5], "big"), 5
    else:
        return None
    if len(region) != start + n or region.count(b"\x80", start) != n:
        return None
    return n


def _check_key(key: Any) -> None:
    """What msgpack's strict_map_key refuses, when it refuses it: right after the pair's value."""
    if type(key) not in (str, bytes):
        raise ValueError(f"{type(key).__name__} is not allowed for map key when strict_map_key=True")


def _unpacker(data: Any) -> msgpack.Unpacker:
    unpacker = msgpack.Unpacker(object_hook=_safe_ndarray_hook, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    return unpacker


def _map_header(unpacker: msgpack.Unpacker) -> int | None:
    """The size of the map that comes next; None if it is not a map."""
    try:
        return unpacker.read_map_header()
    except EpisodeDecodeError:
        raise
    except Exception:
        return None


def _skipped(unpacker: msgpack.Unpacker, data: Any) -> bytes:
    """The bytes of the value that comes next, skipped (nothing of it built)."""
    start = unpacker.tell()
    unpacker.skip()
    return bytes(data[start : unpacker.tell()])


def _infos_buffer(region: bytes) -> Any:
    """An infos buffer's state, decoded as `unpackb` would, its ``data`` counted (`EmptyInfos`)
    when every info is an empty map."""
    unpacker = _unpacker(region)
    n = _map_header(unpacker)
    if n is None:
        return msgpack.unpackb(region, object_hook=_safe_ndarray_hook)
    buffer = {}
    for _ in range(n):
        key = unpacker.unpack()
        if key == "data":
            values = _skipped(unpacker, region)
            count = _empty_maps(values)
            value = EmptyInfos(count) if count is not None else msgpack.unpackb(values, object_hook=_safe_ndarray_hook)
        else:
            value = unpacker.unpack()
        if type(key) is not str:
            _check_key(key)
        buffer[key] = value
    return _safe_ndarray_hook(buffer)


def unpack_state(data: bytes | bytearray | memoryview) -> Any:
    """`msgpack.unpackb(data, object_hook=_safe_ndarray_hook)` with the same result and the same
    refusals, except that an infos buffer whose every info is an empty map (the common case:
    one per step) is counted (`EmptyInfos`), not built. The object hook runs on every other map
    in `unpackb`'s order; whatever is malformed is decoded by `unpackb` itself.

    Args:
        data: a packed episode.
    """
    try:
        unpacker = _unpacker(data)
        n = _map_header(unpacker)
        if n is None:
            raise ValueError("not a map")
        state = {}
        for _ in range(n):
            key = unpacker.unpack()
            value = _infos_buffer(_skipped(unpacker, data)) if key == "infos" else unpacker.unpack()
            if type(key) is not str:
                _check_key(key)
            state[key] = value
        state = _safe_ndarray_hook(state)
        if unpacker.tell() != len(data):
            raise ValueError("extra data after the packed episode")
        return state
    except EpisodeDecodeError:  # a hook's refusal, met in unpackb's order
        raise
    except Exception:  # malformed: exactly what unpackb makes of it
        return msgpack.unpackb(data, object_hook=_safe_ndarray_hook)


@dataclass
class CheckedState:
    """A packed episode's state, decoded safely and checked (`checked_state`): every space it
    holds decoded within the episode's budget and replaced by None in `state`."""

    state: dict
    observation_space: gym.Space | None
    action_space: gym.Space | None
    #: the spaces of the buffers ("observations", "actions", "rewards", "infos")
    buffer_spaces: dict[str, gym.Space | None]
    #: the spaces of the extra model outputs' buffers
    extra_spaces: dict[str, gym.Space | None]


def checked_state(data: bytes | bytearray | memoryview) -> CheckedState:
    """Safely decode one packed episode (an `item` value) into its checked state, without RLlib:
    what `unpack_episode` builds its `SingleAgentEpisode` from and
    `rlrec.store.episode_arrays.decode_episode` its arrays.

    Raises `UnsafeEpisodeError` for payloads whose decoding would unpickle (object arrays
    anywhere, object space bounds) and `EpisodeDecodeError` (a ValueError) for malformed ones.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise EpisodeDecodeError(f"expected bytes, got {type(data).__name__}")
    try:
        state = unpack_state(data)
    except EpisodeDecodeError:
        raise
    except Exception as e:
        raise EpisodeDecodeError(f"not a msgpack episode: {type(e).__name__}: {e}"[:300]) from None
    if not isinstance(state, dict) or not state.keys() >= _STATE_KEY_SET:
        missing = [k for k in _STATE_KEYS if not isinstance(state, dict) or k not in state]
        raise EpisodeDecodeError(f"not a SingleAgentEpisode state (missing {missing[:5]})")
    if not isinstance(state["id_"], str):
        raise EpisodeDecodeError("episode id_ must be a string")

    state = dict(state)
    budget = _Budget(MAX_SPACE_BYTES_PER_EPISODE)
    obs_space = _space(state["_observation_space"], budget)
    act_space = _space(state["_action_space"], budget)
    state["_observation_space"] = state["_action_space"] = None
    spaces: dict[str, gym.Space | None] = {}
    for k in ("observations", "actions", "rewards", "infos"):
        state[k], spaces[k] = _buffer_state(state[k], k, budget)
    extra_spaces = {}
    emo = state["extra_model_outputs"]
    if emo is not None:
        if not isinstance(emo, dict) or not all(isinstance(k, str) for k in emo):
            raise EpisodeDecodeError("extra_model_outputs must be a map with string keys")
        emo = dict(emo)
        for k, b in emo.items():
            emo[k], extra_spaces[k] = _buffer_state(b, f"extra_model_outputs[{k!r}]", budget)
        state["extra_model_outputs"] = emo
    if not isinstance(state.get("custom_data", {}), dict):
        raise EpisodeDecodeError("custom_data must be a map")
    for k in ("t", "t_started"):
        if type(state[k]) is not int or state[k] < 0:
            raise EpisodeDecodeError(f"{k} must be a non-negative integer")
    for k in ("is_terminated", "is_truncated"):
        if not isinstance(state[k], bool):
            raise EpisodeDecodeError(f"{k} must be a boolean")
    return CheckedState(state, obs_space, act_space, spaces, extra_spaces)


def unpack_episode(data: bytes):
    """Safely decode one packed episode (an `item` value) into a `SingleAgentEpisode`.

    Raises `UnsafeEpisodeError` for payloads whose decoding would unpickle (object arrays, object
    space bounds) and `EpisodeDecodeError` (a ValueError) for malformed ones. See module docstring.
    """
    checked = checked_state(data)
    infos = checked.state["infos"]
    if isinstance(infos["data"], EmptyInfos):
        infos["data"] = infos["data"].materialized()
    SingleAgentEpisode = _SingleAgentEpisode()
    try:
        ep = SingleAgentEpisode.from_state(checked.state)  # every space is None here: nothing to np.load
        ep._observation_space = checked.observation_space
        ep._action_space = checked.action_space
        for k, s in checked.buffer_spaces.items():
            getattr(ep, k).space = s
        for k, s in checked.extra_spaces.items():
            ep.extra_model_outputs[k].space = s
        n_obs = len(ep.observations)
        if not (
            n_obs == len(ep.infos)
            and (n_obs == 0 or n_obs == len(ep.rewards) + 1 == len(ep.actions) + 1)
            and all(len(v) == len(ep.rewards) for v in ep.extra_model_outputs.values())
            and len(ep) == len(ep.rewards)
        ):
            raise EpisodeDecodeError("inconsistent buffer lengths")
    except EpisodeDecodeError:
        raise
    except Exception as e:
        raise EpisodeDecodeError(f"cannot rebuild the episode: {type(e).__name__}: {e}"[:300]) from None
    return ep
