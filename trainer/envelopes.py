"""Envelopes: whole chunks carried as one-row blocks through the never-ending pipeline.

A read task that never ends cannot use Ray Data's normal block shaping: its output buffer
emits a block only when it exceeds `target_max_block_size` (128 MiB) or when the task ends.
So the pipeline's dataset gets `target_max_block_size = 1` and every block is ONE row holding
a whole chunk ("envelope"): emitted as soon as it is yielded, never sliced (a block is only
ever split between rows). The read task's envelope is the chunk as Arrow IPC; the PreLearner's
envelope is its output batch packed column by column (`pack_columns`, raw numeric bytes, no
pickle). `StreamIterator` (Learner side) unpacks and re-batches to exactly the minibatch size.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

ENVELOPE = "rlrec_envelope"


def table_to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def ipc_to_numpy_batch(data: bytes) -> dict[str, np.ndarray]:
    from ray.data.block import BlockAccessor

    table = pa.ipc.open_stream(pa.BufferReader(data)).read_all()
    # the same Arrow -> numpy conversion Ray Data applies before calling a map_batches UDF
    return BlockAccessor.for_block(table).to_batch_format("numpy")


def pack_columns(batch: dict[str, np.ndarray]) -> bytes:
    """A flat dict of numeric numpy arrays -> bytes (msgpack of dtype, shape, raw bytes)."""
    import msgpack

    out = {}
    for k, v in batch.items():
        a = np.asarray(v)
        if a.dtype.hasobject:
            raise TypeError(f"PreLearner output column {k!r} has dtype object; only numeric columns can be streamed")
        a = np.ascontiguousarray(a)
        out[k] = [a.dtype.str, list(a.shape), a.tobytes()]
    return msgpack.packb(out, use_bin_type=True)


def unpack_columns(data: bytes) -> dict[str, np.ndarray]:
    import msgpack

    d = msgpack.unpackb(data, raw=False)
    out = {}
    for k, (dt, shape, raw) in d.items():
        dtype = np.dtype(dt)
        if dtype.hasobject:
            raise TypeError("object arrays are not accepted")
        out[k] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return out


def row_count(batch: dict[str, np.ndarray]) -> int:
    """Rows of a PreLearner batch: per module (flat keys ``{module_id}/{column}``) its first
    column's length, summed (multi-agent batches hold modules of different lengths)."""
    first: dict[str, int] = {}
    for k, v in batch.items():
        first.setdefault(k.partition("/")[0] if "/" in k else "", len(v))
    return sum(first.values())
