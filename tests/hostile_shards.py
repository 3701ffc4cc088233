"""Hostile Parquet files for the schema-gate tests: columns of Ray's pickled-object extension type
whose values run ``touch MARKER`` when unpickled, committed with a re-hashed manifest entry (what
anyone who can write the bucket can do)."""

from __future__ import annotations

import hashlib
import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

from rlrec.store.manifest import entry_path
from rlrec.store.shards import encode_shard
from rlrec.store.storage import Storage


class Boom:
    """Unpickling this creates `path` (the side effect that would prove execution)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def pickled_column(marker: str, n: int) -> pa.Array:
    """A column of `n` Ray pickled-object values that each run `touch marker` when read."""
    from ray.data._internal.object_extensions.arrow import ArrowPythonObjectArray

    return ArrowPythonObjectArray.from_objects([Boom(marker) for _ in range(n)])


def with_pickled(table: pa.Table, column: str, marker: str) -> pa.Table:
    """`table` with `column` replaced by (or, if absent, appended as) a pickled-object column."""
    col = pickled_column(marker, table.num_rows)
    meta = table.schema.metadata
    if column in table.column_names:
        table = table.set_column(table.column_names.index(column), column, col)
    else:
        table = table.append_column(column, col)
    return table.replace_schema_metadata(meta)


def to_parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def hostile_shard(episodes, fmt: str, column: str, marker: str) -> bytes:
    """A shard of `fmt` holding `episodes` whose `column` holds pickled payloads."""
    table = pq.read_table(io.BytesIO(encode_shard(episodes, fmt=fmt).data))  # no ray.data import needed
    return to_parquet(with_pickled(table, column, marker))


def replace_committed(storage: Storage, entry, data: bytes) -> None:
    """Overwrite a committed shard with `data` and re-hash its manifest entry (size and sha256)."""
    storage.write(entry.path, data)
    p = entry_path(entry.topic, entry.partition, entry.seq)
    d = json.loads(storage.read(p))
    d["sha256"] = hashlib.sha256(data).hexdigest()
    d["bytes"] = len(data)
    storage.delete(p)
    storage.write(p, json.dumps(d).encode())
