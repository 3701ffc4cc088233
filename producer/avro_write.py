"""A hand-written Avro binary writer for the producer's hot kinds (`StepBatch`, `EpisodeStart`).

The bytes are exactly those `fastavro.schemaless_writer` writes for the same record with the
schemas in `producer/schemas/` (tests/test_avro_write.py checks it against fastavro): zig-zag
varint longs, length-prefixed UTF-8 strings and bytes, arrays and maps as one block with a
positive count followed by the 0 terminator (a lone 0 when empty), a union as its branch index,
booleans as one byte. What it saves over fastavro is per-batch work, not bytes: the constant
parts (the episode id, dtype names, trailing shapes, space JSON) are encoded once and reused, and
the message is assembled with one `bytes.join` (the stacked arrays are copied once, into it).

Only the recorder uses it; `events.encode` (tools, tests, golden files) keeps using fastavro.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ARRAY_END", "array_parts", "bool_byte", "long_bytes", "shape_bytes", "string_bytes"]

ARRAY_END = b"\x00"  # the 0 count that ends an array or map (and an empty one on its own)
_BOOL = (b"\x00", b"\x01")


def _varint(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


#: the longs 0..4095, precomputed: batch sizes, shapes and the lengths of small arrays
_SMALL = [_varint(n) for n in range(4096)]


def long_bytes(n: int) -> bytes:
    """An Avro `long`: zig-zag, then a little-endian base-128 varint (n must fit a signed 64-bit)."""
    if 0 <= n < 4096:
        return _SMALL[n]
    return _varint(n)


def string_bytes(s: str) -> bytes:
    """An Avro `string`: its UTF-8 byte length as a long, then the bytes."""
    b = s.encode("utf-8")
    return long_bytes(len(b)) + b


def bool_byte(v: bool) -> bytes:
    return _BOOL[1 if v else 0]


def shape_bytes(dims: Iterable[int]) -> bytes:
    """The `shape` field of an `Array` record (an Avro array of longs)."""
    dims = list(dims)
    if not dims:
        return ARRAY_END
    return long_bytes(len(dims)) + b"".join(long_bytes(int(d)) for d in dims) + ARRAY_END


def array_parts(parts: list, dtype_name: str, shape: Iterable[int], data: bytes) -> None:
    """Append the parts of one `rlrec.Array` record (dtype, shape, data) to `parts`."""
    parts.append(string_bytes(dtype_name))
    parts.append(shape_bytes(shape))
    parts.append(long_bytes(len(data)))
    parts.append(data)
