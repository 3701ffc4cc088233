"""Numeric arrays on the wire: (dtype from an allow-list, shape, little-endian bytes).

Decoding only ever calls `numpy.frombuffer` with an allowed numeric dtype: no object arrays,
no pickle, nothing from the data is executed.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ALLOWED_DTYPES", "MAX_ARRAY_BYTES", "ArrayError", "array_from_wire", "array_to_wire"]

#: dtype names accepted anywhere in an event (observations, actions, extra outputs, infos).
ALLOWED_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"]
)
_LE = {name: np.dtype(name).newbyteorder("<") for name in ALLOWED_DTYPES}
#: no single array may claim more than this many bytes (a message is far smaller anyway).
MAX_ARRAY_BYTES = 1 << 30
MAX_NDIM = 32


class ArrayError(ValueError):
    """An array is not representable (producer side) or its wire form is invalid (consumer side)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


_names: dict[np.dtype, str] = {}


def array_to_wire(a: np.ndarray) -> dict:
    """The wire record of a numeric array (dtype must be allowed; bytes are little-endian)."""
    name = _names.get(a.dtype)
    if name is None:  # numpy computes dtype.name in Python (~2 µs): remember it
        name = a.dtype.name
        if len(_names) < 1024:
            _names[a.dtype] = name
    if name not in ALLOWED_DTYPES:
        raise ArrayError("bad-dtype", f"dtype {a.dtype} is not allowed; use one of {sorted(ALLOWED_DTYPES)}")
    if a.dtype.byteorder == ">":
        a = a.astype(_LE[name])
    return {"dtype": name, "shape": list(a.shape), "data": a.tobytes()}


def array_from_wire(rec: dict) -> np.ndarray:
    """Rebuild an array from its wire record, validating dtype, shape and byte length."""
    name = rec["dtype"]
    dt = _LE.get(name)
    if dt is None:
        raise ArrayError("bad-dtype", f"dtype {name!r} is not allowed")
    shape = rec["shape"]
    if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
        raise ArrayError("bad-shape", f"invalid shape {shape}")
    n = math.prod(shape)
    data = rec["data"]
    if n * dt.itemsize > MAX_ARRAY_BYTES or n * dt.itemsize != len(data):
        raise ArrayError("bad-shape", f"shape {shape} of {name} needs {n * dt.itemsize} bytes, got {len(data)}")
    try:
        return np.frombuffer(data, dtype=dt).reshape(shape)
    except ValueError as e:  # e.g. [0, 2**62, 2**62]: zero bytes, but numpy refuses the dims
        raise ArrayError("bad-shape", f"invalid shape {shape}: {e}") from None
