"""Splitting batched step values (axis 0 = one row per episode) into the per-row copies the
recorder keeps: what `EpisodeRecorder.begin_episodes` and `log_steps` do before taking the lock.

Every function here returns, for the selected rows, exactly what `begin_episode`/`log_step`
would keep of row ``batch[i]`` given alone, so a batched call buffers the same steps and sends
the same bytes as the single calls. The common case (a single-leaf space and an array of exactly
its dtype and per-row shape) is copied with one `tobytes()` of the whole batch and sliced.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from itertools import compress
from typing import Any

import numpy as np
from gymnasium import spaces as gs

__all__ = [
    "batch_len",
    "checked_id",
    "flags",
    "new_episode_ids",
    "new_episode_keys",
    "row_slices",
    "row_values",
    "rows_of",
    "select",
    "selected_rows",
]


_BOOL = np.dtype(bool)


def selected_rows(rows: Any, n: int) -> np.ndarray | None:
    """The boolean mask `rows`, checked, as an array of `n` bools (None: every row). Columns
    that are arrays take their rows with it (``col[mask]``); lists take them with `select` and
    ``mask.tolist()``."""
    if rows is None:
        return None
    mask = rows if type(rows) is np.ndarray else np.asarray(rows)
    if (mask.dtype is not _BOOL and mask.dtype != np.bool_) or mask.shape != (n,):
        raise ValueError(f"rows must be a boolean mask of shape ({n},), got dtype {mask.dtype} shape {mask.shape}")
    return mask


def select(values: Sequence, rows: list[bool] | None) -> list:
    """`values` at the rows that the mask `rows` of `selected_rows` selects, as a list (all of
    them when `rows` is None)."""
    if rows is None:
        return values if type(values) is list else list(values)
    return list(compress(values, rows))


def _check_len(batch: Any, n: int, what: str) -> None:
    try:
        got = len(batch)
    except TypeError:
        raise TypeError(f"{what} must be batched on axis 0 (one row per episode), got {type(batch).__name__}") from None
    if got != n:
        raise ValueError(f"{what} has {got} rows, episode_ids has {n}")


def rows_of(space: gs.Space, batch: Any, n: int, what: str) -> list:
    """The `n` rows of a batched value of `space` (gymnasium's batching: a dict of batched
    values for Dict, a tuple of them for Tuple, an array or sequence otherwise), each a value
    of `space` as `begin_episode`/`log_step` take it."""
    if isinstance(space, gs.Dict) and isinstance(batch, Mapping):
        keys = list(space.spaces)
        missing = [k for k in keys if k not in batch]
        if missing:
            raise ValueError(f"{what} lacks the Dict space's keys {missing}")
        cols = [rows_of(space.spaces[k], batch[k], n, f"{what}[{k!r}]") for k in keys]
        return [dict(zip(keys, row)) for row in zip(*cols)]
    if isinstance(space, gs.Tuple) and isinstance(batch, tuple) and len(batch) == len(space.spaces):
        cols = [rows_of(s, b, n, f"{what}[{j}]") for j, (s, b) in enumerate(zip(space.spaces, batch))]
        return [tuple(row) for row in zip(*cols)]
    _check_len(batch, n, what)
    return list(batch)


#: row size -> the slices of the most rows asked for so far (fewer rows: a prefix of them)
_slices: dict[int, tuple[slice, ...]] = {}


def row_slices(n: int, k: int) -> tuple[slice, ...]:
    """The slices of `n` rows of `k` items each, of one sequence holding them back to back
    (remembered per row size: a vector env's batches have one row size and at most N rows)."""
    s = _slices.get(k)
    if s is None or len(s) < n:
        if len(_slices) >= 64:  # a bound on what is remembered: many row sizes forget them all
            _slices.clear()
        s = _slices[k] = tuple(slice(j, j + k) for j in range(0, n * k, k))
    return s if len(s) == n else s[:n]


def row_values(packer: Any, space: gs.Space, batch: Any, n: int, mask: np.ndarray | None, what: str) -> list:
    """What the recorder keeps (`_Packer.copy`) of each row of `batch` that `mask` (of
    `selected_rows`) selects."""
    if (
        packer.dtype is not None
        and type(batch) is np.ndarray
        and batch.dtype is packer.dtype
        and batch.shape[1:] == packer.shape
        and len(batch) == n
    ):
        if mask is not None:
            batch = batch[mask]  # a C-ordered copy of the selected rows, in row order
            n = len(batch)
        if packer.int_code and not packer.shape:  # Python ints, in range: kept as they are
            return batch.tolist()
        data = batch.tobytes()  # one copy of the whole batch (C order), sliced per row
        k = len(data) // n if n else 0
        if not k:
            return [b""] * n
        # (a comprehension: `map(data.__getitem__, ...)` is ~3x slower)
        return [data[s] for s in row_slices(n, k)]
    rows = rows_of(space, batch, n, what)
    copy = packer.copy
    return [copy(r) for r in select(rows, None if mask is None else mask.tolist())]


def flags(values: Any, n: int, mask: np.ndarray | None, what: str) -> list[bool]:
    """The rows of a batch of flags that `mask` (of `selected_rows`) selects, as Python bools."""
    if type(values) is np.ndarray:
        if values.shape != (n,):
            raise ValueError(f"{what} has shape {values.shape}, expected ({n},)")
        values = values.astype(bool, copy=False)
        return (values if mask is None else values[mask]).tolist()
    _check_len(values, n, what)
    return [bool(x) for x in select(values, None if mask is None else mask.tolist())]


#: uuid4's fixed bits, set by translating bytes 6 (version 4) and 8 (variant 10) of each id
_VERSION_4 = bytes((x & 0x0F) | 0x40 for x in range(256))
_VARIANT = bytes((x & 0x3F) | 0x80 for x in range(256))


def _new_hex(n: int) -> str:
    """The hex of `n` random uuid4s, back to back (one call to the system's random source for
    all of them, the version and variant bits set by two translations)."""
    b = bytearray(os.urandom(16 * n))
    b[6::16] = b[6::16].translate(_VERSION_4)
    b[8::16] = b[8::16].translate(_VARIANT)
    return b.hex()


def new_episode_ids(n: int) -> list[str]:
    """`n` new episode ids: random uuid4 hex strings, as `begin_episode` makes one."""
    h = _new_hex(n)
    return [h[s] for s in row_slices(n, 32)]


def new_episode_keys(n: int) -> tuple[list[str], list[bytes]]:
    """`n` new episode ids (as `new_episode_ids`) and their UTF-8 bytes (the Kafka keys)."""
    h = _new_hex(n)
    hb = h.encode()
    slices = row_slices(n, 32)
    return [h[s] for s in slices], [hb[s] for s in slices]


def checked_id(eid: Any) -> Any:
    """An episode id as `begin_episode` takes it (None passes, for a new one)."""
    if eid is None:
        return None
    eid = str(eid)
    if type(eid) is not str:  # a str subclass's __str__ may return itself: keys are plain str
        eid = str.__str__(eid)
    if not eid or len(eid) > 256:
        raise ValueError("episode_id must be 1..256 characters")
    return eid


def batch_len(batch: Any) -> int:
    """Rows of a batched value: its length, or its first leaf's for a dict/tuple of batches."""
    while isinstance(batch, (Mapping, tuple)) and len(batch):
        batch = next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0]
    return len(batch)
