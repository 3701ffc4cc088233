"""Gymnasium spaces as plain JSON data, and the flattening of space values into leaf arrays.

Spaces travel inside events as JSON (never pickled) so that any consumer, in any language, can
rebuild them. The form, documented in docs/FORMAT.md:

    {"type": "Box", "shape": [4], "dtype": "float32", "low": [...], "high": [...]}
    {"type": "Discrete", "n": 2, "start": 0, "dtype": "int64"}
    {"type": "MultiDiscrete", "shape": [2], "nvec": [3, 4], "start": [0, 0], "dtype": "int64"}
    {"type": "MultiBinary", "shape": [5], "dtype": "int8"}
    {"type": "Dict", "spaces": [["key", {...}], ...]}        (order kept)
    {"type": "Tuple", "spaces": [{...}, ...]}

`low`, `high`, `nvec` and `start` are flat, row-major lists; infinities and NaN are the strings
"inf", "-inf" and "nan" so the JSON stays standard.

A value of a space flattens to its *leaves*: one numpy array per Box/Discrete/MultiDiscrete/
MultiBinary inside it, depth first, Dict children in the space's key order. Events carry leaves
stacked along a leading step axis.
"""

from __future__ import annotations

import json
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gymnasium import spaces as gs

from rlrec.producer.arrays import ALLOWED_DTYPES

__all__ = [
    "SPACE_NODE_NBYTES",
    "Leaf",
    "SpaceError",
    "dumps_space",
    "flatten_value",
    "loads_space",
    "per_space",
    "space_from_json",
    "space_json_nbytes",
    "space_leaves",
    "space_nbytes",
    "space_to_json",
    "unflatten_leaves",
]

MAX_SPACE_DEPTH = 16
MAX_SPACE_ELEMENTS = 1 << 24


class SpaceError(ValueError):
    """A space cannot be represented, or a JSON space description is invalid."""


@dataclass(frozen=True)
class Leaf:
    """One array-valued part of a space: its dtype and per-step shape; for Discrete,
    MultiDiscrete and MultiBinary also the inclusive integer range of its values (`low`, `high`,
    arrays that broadcast to the leaf's shape; None for Box, whose bounds rlrec does not enforce)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    low: np.ndarray | None = field(default=None, compare=False, repr=False)
    high: np.ndarray | None = field(default=None, compare=False, repr=False)


# ---------------------------------------------------------------------------------------------
# space -> JSON


def _num(x: float | int) -> float | int | str:
    if isinstance(x, (float, np.floating)):
        x = float(x)
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    return int(x)


def _flat(a: np.ndarray) -> list:
    return [_num(v) for v in np.asarray(a).reshape(-1).tolist()]


def _dtype_name(dtype: Any) -> str:
    dt = np.dtype(dtype)
    if dt.name not in ALLOWED_DTYPES:
        raise SpaceError(f"space dtype {dt} is not allowed; use one of {sorted(ALLOWED_DTYPES)}")
    return dt.name


def _bound(a: np.ndarray, compact: bool) -> list:
    """A Box bound as a flat list; with `compact`, one value when every element equals it."""
    a = np.asarray(a)
    if compact and a.size > 1:
        first = a.reshape(-1)[:1]
        same = np.isnan(a).all() if np.isnan(first).any() else (a == first).all()
        if same:
            return _flat(first)
    return _flat(a)


def space_to_json(space: gs.Space, compact: bool = False) -> dict:
    """Describe a gymnasium space as JSON-compatible data (see module docstring).

    With `compact`, a Box bound whose elements are all equal is written as one value (``[0]``
    for an image's low): the form multi-agent events use, read with ``broadcast=True``.
    """
    if isinstance(space, gs.Box):
        return {
            "type": "Box",
            "shape": list(space.shape),
            "dtype": _dtype_name(space.dtype),
            "low": _bound(space.low, compact),
            "high": _bound(space.high, compact),
        }
    if isinstance(space, gs.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start), "dtype": _dtype_name(space.dtype)}
    if isinstance(space, gs.MultiDiscrete):
        return {
            "type": "MultiDiscrete",
            "shape": list(space.shape),
            "nvec": _flat(space.nvec),
            "start": _flat(space.start),
            "dtype": _dtype_name(space.dtype),
        }
    if isinstance(space, gs.MultiBinary):
        return {"type": "MultiBinary", "shape": list(space.shape), "dtype": _dtype_name(space.dtype)}
    if isinstance(space, gs.Dict):
        return {"type": "Dict", "spaces": [[str(k), space_to_json(v, compact)] for k, v in space.spaces.items()]}
    if isinstance(space, gs.Tuple):
        return {"type": "Tuple", "spaces": [space_to_json(s, compact) for s in space.spaces]}
    raise SpaceError(
        f"space type {type(space).__name__} is not supported; use Box, Discrete, MultiDiscrete, "
        "MultiBinary, Dict or Tuple"
    )


def dumps_space(space: gs.Space, compact: bool = False) -> str:
    """The space JSON text of `space` (`compact`: see `space_to_json`)."""
    return json.dumps(space_to_json(space, compact), separators=(",", ":"), allow_nan=False)


class per_space:
    """`fn(space)` remembered per space *object*, for serialisations that cost milliseconds for
    large Boxes (an 84x84x4 space's bounds). Guarantees: a value is returned only for the very
    object it was computed from (spaces are not changed once events or episodes hold them; the
    decoder shares one object per distinct space); the memo holds no space alive (weak
    references: an entry goes with its space) and at most `max_bytes` of values (estimated;
    least recently added first out), so hostile streams of distinct huge spaces cannot grow it."""

    def __init__(self, fn: Callable[[gs.Space], Any], max_bytes: int = 8 * 2**20) -> None:
        self.fn = fn
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._memo: OrderedDict[int, tuple[weakref.ref, Any, int]] = OrderedDict()
        # the encoding thread fills it; a space's last reference may go on any thread (RLock: a
        # collection may run the weakref callback while this thread holds the lock)
        self._lock = threading.RLock()

    def __call__(self, space: gs.Space) -> Any:
        key = id(space)
        hit = self._memo.get(key)
        if hit is not None and hit[0]() is space:
            return hit[1]
        value = self.fn(space)
        size = _approx_nbytes(value)
        if size <= self.max_bytes:
            ref = weakref.ref(space, lambda _ref, key=key: self._forget(key))
            with self._lock:
                self._forget(key)
                self._memo[key] = (ref, value, size)
                self.nbytes += size
                while self.nbytes > self.max_bytes and self._memo:
                    self._forget(next(iter(self._memo)))
        return value

    def _forget(self, key: int) -> None:
        with self._lock:
            entry = self._memo.pop(key, None)
            if entry is not None:
                self.nbytes -= entry[2]


def _approx_nbytes(value: Any, depth: int = 0) -> int:
    """Rough memory of a serialised space (strings dominate: JSON or base64 bounds)."""
    if isinstance(value, (str, bytes)):
        return 64 + len(value)
    if isinstance(value, np.ndarray):
        return 128 + value.nbytes
    if isinstance(value, Leaf):
        return 128 + sum(_approx_nbytes(a, depth + 1) for a in (value.low, value.high) if a is not None)
    if depth < 64 and isinstance(value, dict):
        return 64 + sum(_approx_nbytes(k, depth + 1) + _approx_nbytes(v, depth + 1) for k, v in value.items())
    if depth < 64 and isinstance(value, (list, tuple)):
        return 64 + sum(_approx_nbytes(v, depth + 1) for v in value)
    return 64


# ---------------------------------------------------------------------------------------------
# JSON -> space (input is untrusted: validate everything, execute nothing)


def _unnum(v: Any, what: str) -> float:
    if isinstance(v, bool):
        raise SpaceError(f"{what}: boolean where a number is expected")
    if isinstance(v, (int, float)):
        return v
    if v in ("inf", "-inf", "nan"):
        return float(v)
    raise SpaceError(f"{what}: expected a number or 'inf'/'-inf'/'nan', got {v!r}")


def _shape(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v):
        raise SpaceError(f"{what}: shape must be a list of non-negative integers, got {v!r}")
    if len(v) > 32 or math.prod(v) > MAX_SPACE_ELEMENTS:
        raise SpaceError(f"{what}: shape {v} is too large")
    return tuple(v)


def _array(v: Any, shape: tuple[int, ...], dtype: Any, what: str, broadcast: bool = False) -> np.ndarray:
    dtype = np.dtype(dtype)  # callers pass dtypes and scalar types (np.int64) alike
    if broadcast and isinstance(v, list) and len(v) == 1 and math.prod(shape) != 1:
        return np.broadcast_to(_array(v, (), dtype, what), shape)
    if not isinstance(v, list) or len(v) != math.prod(shape):
        raise SpaceError(f"{what}: expected a flat list of {math.prod(shape)} values")
    vals = [_unnum(x, what) for x in v]
    try:
        if dtype.kind in "iub":  # exact integers: no trip through float64
            if not all(isinstance(x, int) for x in vals):
                raise SpaceError(f"{what}: integer bounds expected")
            return np.array(vals, dtype=dtype).reshape(shape)
        return np.asarray(vals, dtype=np.float64).astype(dtype).reshape(shape)
    except (ValueError, OverflowError) as e:
        raise SpaceError(f"{what}: {e}") from None


def _dtype(v: Any, what: str) -> np.dtype:
    if not isinstance(v, str) or v not in ALLOWED_DTYPES:
        raise SpaceError(f"{what}: dtype {v!r} is not allowed")
    return np.dtype(v)


#: what one built space node (a gymnasium space object and its attributes) holds beside its arrays
SPACE_NODE_NBYTES = 500


def space_json_nbytes(d: Any, _depth: int = 0) -> int:
    """Bytes the arrays of the space `d` (parsed JSON) cost once built, counted from the shapes
    alone, before anything is built: Box 2 bounds of its dtype plus 2 boolean masks, MultiDiscrete
    nvec and start as int64. A budget checked with this bounds what a compact text (one value
    per bound, see `space_to_json`) can make a reader allocate; each node adds
    `SPACE_NODE_NBYTES` (a built Discrete holds ~400-500 bytes, a Box ~900 with its arrays'
    headers). SpaceError on a malformed shape."""
    if _depth > MAX_SPACE_DEPTH:
        raise SpaceError("space nesting is too deep")
    if not isinstance(d, dict):
        raise SpaceError(f"a space must be an object with a 'type', got {type(d).__name__}")
    kind = d.get("type")
    if kind in ("Dict", "Tuple"):
        items = d.get("spaces")
        if not isinstance(items, list):
            raise SpaceError(f"{kind}: 'spaces' must be a list")
        children = [p[1] if kind == "Dict" and isinstance(p, list) and len(p) == 2 else p for p in items]
        return SPACE_NODE_NBYTES + sum(space_json_nbytes(c, _depth + 1) for c in children)
    if kind == "Box":
        n = math.prod(_shape(d.get("shape"), "Box"))
        return SPACE_NODE_NBYTES + n * (2 * _dtype(d.get("dtype"), "Box").itemsize + 2)
    if kind == "MultiDiscrete":
        return SPACE_NODE_NBYTES + 16 * math.prod(_shape(d.get("shape"), "MultiDiscrete"))
    return SPACE_NODE_NBYTES


def space_nbytes(space: Any) -> int:
    """What a built space's arrays cost, counted as `space_json_nbytes`
    counts its JSON (Box: two bounds of its dtype and two boolean masks; MultiDiscrete: nvec and
    start as int64; `SPACE_NODE_NBYTES` a node).

    Example:
        >>> import gymnasium as gym
        >>> import numpy as np
        >>> space_nbytes(gym.spaces.Box(-1, 1, (1000,), np.float64))
        18500
    """
    subs = getattr(space, "spaces", None)
    if subs is not None:
        return SPACE_NODE_NBYTES + sum(space_nbytes(c) for c in (subs.values() if isinstance(subs, dict) else subs))
    kind = type(space).__name__
    if kind == "Box":
        return SPACE_NODE_NBYTES + int(np.prod(space.shape)) * (2 * space.dtype.itemsize + 2)
    if kind == "MultiDiscrete":
        return SPACE_NODE_NBYTES + 16 * int(np.prod(space.shape))
    return SPACE_NODE_NBYTES


def space_from_json(d: Any, _depth: int = 0, broadcast: bool = False) -> gs.Space:
    """Rebuild a gymnasium space from its JSON description; raises `SpaceError` on bad input.

    With `broadcast`, a Box bound may be one value for the whole shape (the compact form of
    `space_to_json`); check `space_json_nbytes` against a budget first.
    """
    if _depth > MAX_SPACE_DEPTH:
        raise SpaceError("space nesting is too deep")
    if not isinstance(d, dict) or not isinstance(d.get("type"), str):
        raise SpaceError(f"a space must be an object with a 'type', got {type(d).__name__}")
    kind = d["type"]
    try:
        if kind == "Box":
            shape = _shape(d.get("shape"), "Box")
            dtype = _dtype(d.get("dtype"), "Box")
            low = _array(d.get("low"), shape, dtype, "Box.low", broadcast)
            high = _array(d.get("high"), shape, dtype, "Box.high", broadcast)
            return gs.Box(low=low, high=high, shape=shape, dtype=dtype)
        if kind == "Discrete":
            n, start = d.get("n"), d.get("start", 0)
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0 or not isinstance(start, int):
                raise SpaceError("Discrete: n must be a positive integer and start an integer")
            return gs.Discrete(n, start=start, dtype=_dtype(d.get("dtype", "int64"), "Discrete"))
        if kind == "MultiDiscrete":
            shape = _shape(d.get("shape"), "MultiDiscrete")
            dtype = _dtype(d.get("dtype", "int64"), "MultiDiscrete")
            nvec = _array(d.get("nvec"), shape, np.int64, "MultiDiscrete.nvec")
            start = _array(d.get("start", [0] * math.prod(shape)), shape, np.int64, "MultiDiscrete.start")
            return gs.MultiDiscrete(nvec, dtype=dtype, start=start)
        if kind == "MultiBinary":
            shape = _shape(d.get("shape"), "MultiBinary")
            return gs.MultiBinary(list(shape) if len(shape) != 1 else shape[0])
        if kind == "Dict":
            items = d.get("spaces")
            if not isinstance(items, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in items
            ):
                raise SpaceError("Dict: 'spaces' must be a list of [key, space] pairs")
            keys = [k for k, _ in items]
            if len(set(keys)) != len(keys):
                raise SpaceError("Dict: duplicate keys")
            children = {k: space_from_json(v, _depth + 1, broadcast) for k, v in items}
            space = gs.Dict(children)
            if list(space.spaces) != keys:  # gymnasium sorts plain dicts: keep the sender's order
                space.spaces = {k: children[k] for k in keys}
            return space
        if kind == "Tuple":
            items = d.get("spaces")
            if not isinstance(items, list):
                raise SpaceError("Tuple: 'spaces' must be a list")
            return gs.Tuple([space_from_json(v, _depth + 1, broadcast) for v in items])
    except SpaceError:
        raise
    except (ValueError, TypeError, AssertionError, OverflowError) as e:
        raise SpaceError(f"{kind}: {e}") from None
    raise SpaceError(f"unknown space type {kind!r}")


def loads_space(text: str | bytes) -> gs.Space:
    try:
        d = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: "[[[[..." bombs
        raise SpaceError(f"space is not valid JSON: {e}") from None
    return space_from_json(d)


# ---------------------------------------------------------------------------------------------
# values <-> leaves


def space_leaves(space: gs.Space) -> list[Leaf]:
    """The leaves of `space`, in flattening order."""
    if isinstance(space, gs.Dict):
        return [leaf for s in space.spaces.values() for leaf in space_leaves(s)]
    if isinstance(space, gs.Tuple):
        return [leaf for s in space.spaces for leaf in space_leaves(s)]
    if isinstance(space, gs.Discrete):
        low = np.asarray(int(space.start))
        return [Leaf(np.dtype(space.dtype), tuple(space.shape), low, low + int(space.n) - 1)]
    if isinstance(space, gs.MultiDiscrete):
        low = np.asarray(space.start, dtype=np.int64)
        return [Leaf(np.dtype(space.dtype), tuple(space.shape), low, low + np.asarray(space.nvec, np.int64) - 1)]
    if isinstance(space, gs.MultiBinary):  # 0/1 broadcast: no arrays of a shape a tiny text can name
        return [Leaf(np.dtype(space.dtype), tuple(space.shape), np.zeros((), np.int64), np.ones((), np.int64))]
    if isinstance(space, gs.Box):
        return [Leaf(np.dtype(space.dtype), tuple(space.shape))]
    raise SpaceError(f"space type {type(space).__name__} is not supported")


def flatten_value(space: gs.Space, value: Any, out: list | None = None) -> list:
    """Append the leaves of `value` (a value of `space`) to `out` and return it.

    Leaves are returned as given (scalars, lists or arrays); stacking casts them to the leaf dtype.
    """
    if out is None:
        out = []
    if isinstance(space, gs.Dict):
        if not isinstance(value, dict):
            raise TypeError(f"expected a dict for a Dict space, got {type(value).__name__}")
        for k, s in space.spaces.items():
            if k not in value:
                raise ValueError(f"missing key {k!r} for a Dict space")
            flatten_value(s, value[k], out)
        if len(value) != len(space.spaces):
            extra = set(value) - set(space.spaces)
            raise ValueError(f"unexpected keys {sorted(map(str, extra))} for a Dict space")
    elif isinstance(space, gs.Tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(space.spaces):
            raise TypeError(f"expected a tuple of {len(space.spaces)} for a Tuple space")
        for s, v in zip(space.spaces, value):
            flatten_value(s, v, out)
    else:
        out.append(value)
    return out


def unflatten_leaves(space: gs.Space, leaves: list, _pos: list | None = None) -> Any:
    """Inverse of `flatten_value`: rebuild a (possibly nested) value from its leaves."""
    pos = _pos if _pos is not None else [0]
    if isinstance(space, gs.Dict):
        return {k: unflatten_leaves(s, leaves, pos) for k, s in space.spaces.items()}
    if isinstance(space, gs.Tuple):
        return tuple(unflatten_leaves(s, leaves, pos) for s in space.spaces)
    v = leaves[pos[0]]
    pos[0] += 1
    return v
