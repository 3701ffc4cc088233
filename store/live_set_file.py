"""The file of a live set (`rlrec.store.live_set`): its rows as raw Arrow column buffers, read
as views of the file's bytes and checked column by column with ``pyarrow.compute`` and numpy, so
that reading 20,000 rows costs about what listing 20,000 files does -- and what a file makes a
reader allocate is what the file says it holds, checked against its seq before anything is
decoded (no dictionary, run-length or delta encoding can expand on reading).

Layout (manifest format 4, docs/FORMAT.md "Live sets")::

    b"RLRECLS1"                      magic (8 bytes)
    raw length                       uint64 little-endian: the payload's length
    the payload, one zstd frame      decompressed to exactly its raw length, else refused
    payload = the column buffers (8-byte aligned) + header (JSON) + header length (uint32 LE)
    header  = {"type": "live_set", "manifest_version": 4, "topic", "partition", "seq", "time",
               "writer", "first", "removals", "rows": n,
               "buffers": {column: [[offset, length] or null, ...]}}   (at most 64 KiB)

A live set whose writer folded only the removal records whose files (of its log) were gone has
``"folds_deleted_only": true`` in its header (docs/FORMAT.md, "Deleted-only folding").
With retention's columns (docs/FORMAT.md, "Retention columns"; all or none) the header also has
``"held"`` and ``"replaced"`` (row counts of two more tables, ``HELD_COLUMNS`` and
``REPLACED_COLUMNS``) and the rows ``NEWEST_COLUMN``; ``decode`` checks them as the rows
(`_check_retention`) and hands them to `LiveRows` (``tables``).

Columns (``COLUMNS``: name, Arrow type, nullable), each of ``n`` rows: an int64 or double column
is [validity, values], a string column [validity, int32 offsets, UTF-8 bytes] (Arrow's layout);
validity is null for a column with no nulls (always, for one that is not nullable).

A row is a shard entry of the log without ``episode_ids``: its ``path`` is
``{policy_id}/{name}`` and its ``staging_path`` ``{policy_id}/_staging/{name}`` (what
`rlrec.store.manifest_entries.check_shard_paths` requires of every shard entry), its topic and
partition the log's. Fields whose JSON type varies (a list or an object, an int or a string)
are JSON text, checked once per distinct value.

The bytes are hostile (docs/GUARANTEES.md §3, "Live sets"): `decode` refuses (ManifestError) a
file larger than `size_cap` of its seq or whose raw length is, a frame that does not decompress
to exactly its raw length, a header over 64 KiB or not of this format, more rows than its seq,
a buffer outside the payload or not of its column's exact length, offsets that are not
monotone and in bounds or strings that are not UTF-8 (``validate(full=True)``); then every value
is checked as `rlrec.store.manifest_entries` checks a shard entry's field (in bulk), and rows
must have ascending seqs below the file's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlrec.store.manifest_entries import ManifestError, ShardEntry, _check_version

__all__ = [
    "DELETED_ONLY_FIELD",
    "HELD_COLUMNS",
    "MAX_LIVE_SET_BYTES",
    "MAX_LIVE_SHARDS",
    "NEWEST_COLUMN",
    "REPLACED_COLUMNS",
    "RETENTION_FIELDS",
    "LiveRows",
    "ShardList",
    "decode",
    "encode",
    "encode_columns",
    "shard_columns",
    "size_cap",
]

#: the most bytes a live set may hold (file, and decoded columns), whatever its seq
MAX_LIVE_SET_BYTES = 512 * 1024 * 1024
#: the most rows of a live set
MAX_LIVE_SHARDS = 2_000_000
#: per row of its seq, what a live set may take (file and decoded bytes): rows cannot outnumber
#: the entries below its seq, so a forged one costs a reader what that log's honest one could
PER_ROW_BYTES = 4096
_BASE_BYTES = 64 * 1024
MAGIC = b"RLRECLS1"
_MAX_HEADER_BYTES = 64 * 1024
_HEADER = frozenset({"type", "manifest_version", "topic", "partition", "seq", "time", "writer", "first", "removals"})
_LAYOUT = frozenset({"rows", "buffers"})

_INT, _STR, _F64 = pa.int64(), pa.string(), pa.float64()
#: (name, type, nullable) of each column, in file order
COLUMNS: tuple[tuple[str, pa.DataType, bool], ...] = (
    ("seq", _INT, False),
    ("epoch", _INT, False),
    ("writer", _STR, True),
    ("policy_id", _STR, False),
    ("name", _STR, False),
    ("first_offset", _INT, False),
    ("last_offset", _INT, False),
    ("episodes", _INT, False),
    ("steps", _INT, False),
    ("bytes", _INT, False),
    ("sha256", _STR, False),
    ("format", _STR, False),
    ("format_version", _INT, False),
    ("event_schema_versions", _STR, False),
    ("commit_time", _F64, False),
    ("min_policy_version", _STR, True),
    ("max_policy_version", _STR, True),
    ("steps_without_logp", _STR, True),
    ("decoded_bytes", _INT, True),
    ("resume_offset", _INT, True),
)
#: retention's columns (docs/FORMAT.md, "Retention columns"): present all together or not at all.
#: A live row's newest first-commit time of its episodes (with the rows' columns)
NEWEST_COLUMN = ("newest_commit", _F64, False)
#: one row per shard entry a live merged shard holds: its seq, the merged shard's row seq
HELD_COLUMNS: tuple[tuple[str, pa.DataType, bool], ...] = (("held_seq", _INT, False), ("held_by", _INT, False))
#: one row per shard file replaced below the live set's seq and not named by a folded removal
#: record: the entry that committed it, the replace entry that replaced it, its file
REPLACED_COLUMNS: tuple[tuple[str, pa.DataType, bool], ...] = (
    ("replaced_seq", _INT, False),
    ("replaced_by", _INT, False),
    ("replaced_policy_id", _STR, False),
    ("replaced_name", _STR, False),
)
#: the header fields of retention's columns: the rows of the held and the replaced table
RETENTION_FIELDS = frozenset({"held", "replaced"})
#: the header field of a live set that folds only removal records whose files of its log were
#: gone when it was written (docs/FORMAT.md, "Deleted-only folding"): ``true``, or absent
DELETED_ONLY_FIELD = "folds_deleted_only"
_JSON_COLUMNS = ("event_schema_versions", "min_policy_version", "max_policy_version", "steps_without_logp")
#: the longest JSON text a value of each column may be: checked on the bytes before any is parsed
_JSON_VALUE_BYTES = {
    "event_schema_versions": 4 * 1024,
    "min_policy_version": 256,
    "max_policy_version": 256,
    "steps_without_logp": 64 * 1024,
}
#: the most JSON text, over a live set's distinct values, parsed per row (plus one value of each
#: column): honest rows share a few distinct values, so what parsing builds stays a small
#: multiple of the file's rows, never of its size cap
_JSON_BYTES_PER_ROW = 512


def size_cap(seq: int) -> int:
    """The most bytes (of the file, and of its decoded columns) a live set at `seq` may take."""
    return min(MAX_LIVE_SET_BYTES, _BASE_BYTES + max(0, int(seq)) * PER_ROW_BYTES)


def _dumps(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"), allow_nan=False)


def encode(header: Mapping[str, Any], shards: Iterable[ShardEntry]) -> bytes:
    """The bytes of a live set: `header` (its fields, module docstring) and its rows."""
    rows = list(shards)
    return encode_columns(header, shard_columns(rows), len(rows))


def shard_columns(rows: Sequence[ShardEntry], newest: Sequence[float] | None = None) -> dict[str, pa.Array]:
    """The live set columns (`COLUMNS`) of shard entries, a row each in their order; with
    `newest` (each row's newest first-commit time), `NEWEST_COLUMN` too."""

    def col(f):
        return [f(s) for s in rows]

    def versions(s: ShardEntry) -> str:
        v = s.event_schema_versions
        return _dumps(dict(v) if isinstance(v, Mapping) else list(v))

    data = {
        "seq": col(lambda s: s.seq),
        "epoch": col(lambda s: s.epoch),
        "writer": col(lambda s: s.writer),
        "policy_id": col(lambda s: s.policy_id),
        "name": col(lambda s: s.path.rsplit("/", 1)[-1]),
        "first_offset": col(lambda s: s.first_offset),
        "last_offset": col(lambda s: s.last_offset),
        "episodes": col(lambda s: s.episodes),
        "steps": col(lambda s: s.steps),
        "bytes": col(lambda s: s.bytes),
        "sha256": col(lambda s: s.sha256),
        "format": col(lambda s: s.format),
        "format_version": col(lambda s: s.format_version),
        "event_schema_versions": col(versions),
        "commit_time": col(lambda s: float(s.commit_time)),
        "min_policy_version": col(lambda s: None if s.min_policy_version is None else _dumps(s.min_policy_version)),
        "max_policy_version": col(lambda s: None if s.max_policy_version is None else _dumps(s.max_policy_version)),
        "steps_without_logp": col(
            lambda s: None if s.steps_without_logp is None else _dumps(dict(s.steps_without_logp))
        ),
        "decoded_bytes": col(lambda s: s.decoded_bytes),
        "resume_offset": col(lambda s: s.resume_offset),
    }
    out = {name: pa.array(data[name], t) for name, t, _ in COLUMNS}
    if newest is not None:
        out["newest_commit"] = pa.array([float(x) for x in newest], _F64)
    return out


def encode_columns(header: Mapping[str, Any], columns: Mapping[str, pa.Array], rows: int) -> bytes:
    """The bytes of a live set of `rows` rows whose columns are `columns` (name -> array, in any
    order; each written as its Arrow buffers, module docstring)."""
    pieces: list[Any] = []
    at, specs = 0, {}
    for name, arr in columns.items():
        if arr.offset:
            arr = pa.concat_arrays([arr])  # its buffers from its first row
        bufs, n = arr.buffers(), len(arr)
        sizes = [(n + 7) // 8]
        if pa.types.is_string(arr.type):
            offsets = np.frombuffer(bufs[1], dtype=np.int32)[: n + 1] if bufs[1] is not None else [0]
            sizes += [4 * (n + 1), int(offsets[-1])]
        elif pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type):
            sizes += [arr.type.bit_width // 8 * n]
        else:  # no type of the format: its buffers whole (a reader refuses them)
            sizes += [b.size if b is not None else 0 for b in bufs[1:]]
        specs[name] = []
        for i, (buf, size) in enumerate(zip(bufs, sizes)):
            if i == 0 and (buf is None or not arr.null_count):
                specs[name].append(None)  # no nulls: no validity
                continue
            pad = -at % 8
            pieces.append(b"\0" * pad)
            at += pad
            specs[name].append([at, size])
            pieces.append(memoryview(buf)[:size] if buf is not None else bytes(size))
            at += size
    head = _dumps({**header, "rows": rows, "buffers": specs}).encode()
    return pack(b"".join([*pieces, head, len(head).to_bytes(4, "little")]))


def pack(raw: bytes) -> bytes:
    """A live set file around its payload: the magic, the raw length, one zstd frame."""
    return MAGIC + len(raw).to_bytes(8, "little") + pa.Codec("zstd").compress(raw, asbytes=True)


def unpack(data: bytes, cap: int = MAX_LIVE_SET_BYTES) -> pa.Buffer:
    """A live set file's payload, decompressed into one buffer of its stated raw length
    (ManifestError: not a live set file, its raw length is over `cap`, or its frame does not
    decompress to exactly that length)."""
    if len(data) < 16 or data[:8] != MAGIC:
        raise ManifestError("not a live set file (no magic)")
    raw = int.from_bytes(data[8:16], "little")
    if raw > cap:
        raise ManifestError(f"live set of {raw} bytes raw (its seq allows {cap})")
    payload = pa.Codec("zstd").decompress(data[16:], decompressed_size=raw)
    if payload.size != raw:
        raise ManifestError("live set does not decompress to its raw length")
    return payload


def _open_checked(data: bytes, seq: int) -> tuple[dict[str, Any], dict[str, pa.Array]]:
    """A live set's bytes opened and checked for their layout: (its header's fields, module
    docstring; its columns, views of the payload, validated). ManifestError if the file is not
    one a reader may read at `seq` (sizes, header, row count, buffers, offsets, UTF-8)."""
    cap = size_cap(seq)
    if len(data) > cap:
        raise ManifestError(f"live set of more than {cap} bytes (its seq allows no more)")
    payload = unpack(data, cap)
    size = payload.size
    head_len = int.from_bytes(payload.slice(size - 4, 4).to_pybytes(), "little") if size >= 4 else -1
    if not 0 < head_len <= min(_MAX_HEADER_BYTES, size - 4):
        raise ManifestError("live set: no header, or one over 64 KiB")
    body = size - 4 - head_len  # the column buffers lie below the header
    doc = json.loads(payload.slice(body, head_len).to_pybytes())
    if not isinstance(doc, dict) or doc.get("type") != "live_set":
        raise ManifestError("not a live set")
    _check_version(doc)  # a newer format (which may have other columns): UnsupportedManifestError
    header = _HEADER | (RETENTION_FIELDS if RETENTION_FIELDS & doc.keys() else frozenset())
    if DELETED_ONLY_FIELD in doc:
        if doc[DELETED_ONLY_FIELD] is not True:
            raise ManifestError(f"live set: {DELETED_ONLY_FIELD} must be true where present")
        header |= {DELETED_ONLY_FIELD}
    missing, unknown = (header | _LAYOUT) - doc.keys(), doc.keys() - header - _LAYOUT
    if missing or unknown:
        raise ManifestError(f"live set: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
    rows, specs = doc.pop("rows"), doc.pop("buffers")
    groups = [(rows, "rows", COLUMNS)]
    if "held" in doc:  # retention's columns
        groups = [(rows, "rows", (*COLUMNS, NEWEST_COLUMN)), (doc["held"], "held", HELD_COLUMNS)]
        groups.append((doc["replaced"], "replaced", REPLACED_COLUMNS))
    for n, what, _ in groups:
        if type(n) is not int or not 0 <= n <= min(seq, MAX_LIVE_SHARDS):
            raise ManifestError(f"live set of {n!r} {what} at seq {seq} (at most one per entry below it)")
    if not isinstance(specs, dict) or set(specs) != {c for _, _, cols in groups for c, _, _ in cols}:
        raise ManifestError("live set: its columns are not those of the format")
    columns = {}
    for n, _, cols in groups:
        for name, t, nullable in cols:
            columns[name] = _column(payload, body, specs[name], name, t, nullable, n)
    return doc, columns


def _column(payload: pa.Buffer, body: int, spec: Any, name: str, t: pa.DataType, nullable: bool, rows: int) -> pa.Array:
    """Column `name` of `rows` rows from its buffers' `spec` (``[offset, length]`` each, within
    the first `body` bytes of `payload`), validated (ManifestError: not its type's exact layout)."""
    want = [(rows + 7) // 8, *((4 * (rows + 1), None) if t == _STR else (8 * rows,))]
    if not isinstance(spec, list) or len(spec) != len(want):
        raise ManifestError(f"live set: column {name!r} has not the buffers of its type")
    bufs = []
    for i, (b, size) in enumerate(zip(spec, want)):
        if b is None and i == 0:
            bufs.append(None)
            continue
        ok = isinstance(b, list) and len(b) == 2 and all(type(x) is int for x in b)
        if not ok or b[0] < 0 or b[1] < 0 or b[0] + b[1] > body or (size is not None and b[1] != size):
            raise ManifestError(f"live set: a buffer of column {name!r} is not in the file or not its size")
        if i == 0 and not nullable:
            raise ManifestError(f"live set: column {name!r} has nulls")
        bufs.append(payload.slice(b[0], b[1]))
    if t == _STR and bufs[2] is None:
        raise ManifestError(f"live set: column {name!r} has no data")
    arr = pa.Array.from_buffers(t, rows, bufs)
    arr.validate(full=True)  # offsets monotone and in bounds, UTF-8
    return arr


class ShardList(Sequence[ShardEntry]):
    """A read-only sequence of shard entries in (topic, partition, seq) order whose entries are
    built when first asked for (`LiveRows`, `rlrec.store.live_set.HeadShards`): opening a store
    at its head makes no Python object per live shard until a reader wants one. Equal to any
    sequence of the same entries (a list too)."""

    def _items(self) -> list[ShardEntry]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[ShardEntry]:
        return iter(self._items())

    def __getitem__(self, i):  # type: ignore[override]
        return self._items()[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and self._items() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Sequence[ShardEntry]) -> list[ShardEntry]:  # as a list's: `entries + more`
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return self._items() + list(other)
        return NotImplemented

    def __radd__(self, other: Sequence[ShardEntry]) -> list[ShardEntry]:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return list(other) + self._items()
        return NotImplemented

    def copy(self) -> list[ShardEntry]:
        """The entries as a new list (as `list.copy`)."""
        return list(self._items())

    def paths(self, prefix: str = "") -> list[str]:
        """`prefix` + each entry's ``path`` (a clean relative path: checked when its entry or row
        was read), in order; of a live set's rows straight from its columns, without building an
        entry per row."""
        return [prefix + e.path for e in self._items()]

    def __repr__(self) -> str:
        return repr(self._items())


class ChainedShards(ShardList):
    """Shard lists one after the other (each log's, in (topic, partition) order)."""

    def __init__(self, parts: Iterable[Sequence[ShardEntry]]) -> None:
        self._parts = list(parts)
        self._built: list[ShardEntry] | None = None

    def __len__(self) -> int:
        return sum(len(p) for p in self._parts)

    def _items(self) -> list[ShardEntry]:
        if self._built is None:
            self._built = [e for p in self._parts for e in p]
        return self._built

    def paths(self, prefix: str = "") -> list[str]:
        if self._built is not None:
            return super().paths(prefix)
        return [
            q
            for p in self._parts
            for q in (p.paths(prefix) if isinstance(p, ShardList) else [prefix + e.path for e in p])
        ]


class LiveRows(ShardList):
    """The rows of a decoded live set (`decode`): their ``seqs`` (ascending) at once, each
    `ShardEntry` (episode ids ``()``) built from the checked columns when first asked for."""

    def __init__(
        self,
        topic: str,
        partition: int,
        columns: Mapping[str, pa.Array],
        distinct: Mapping[str, Any] | None = None,
        tables: Mapping[str, pa.Array] | None = None,
    ):
        self.topic, self.partition = topic, partition
        self._columns = dict(columns)
        #: retention's held and replaced tables (`HELD_COLUMNS`, `REPLACED_COLUMNS`; the rows'
        #: ``newest_commit`` is among `columns`), None where the live set has no retention columns
        self.tables: dict[str, pa.Array] | None = dict(tables) if tables is not None else None
        # column -> (checked distinct values, per-row indices)
        self._distinct = dict(distinct) if distinct is not None else _distinct_values(self._columns)
        #: the rows' seqs, ascending
        self.seqs: list[int] = self._columns["seq"].to_numpy().tolist() if len(self._columns["seq"]) else []
        self._built: list[ShardEntry] | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def columns(self) -> dict[str, pa.Array]:
        """The rows' columns (`COLUMNS`, and `NEWEST_COLUMN` with retention's columns), as the
        file holds them."""
        return dict(self._columns)

    def __getitem__(self, i):  # type: ignore[override]
        if self._built is None and isinstance(i, int):
            return self._row(i)
        return self._items()[i]

    def paths(self, prefix: str = "") -> list[str]:
        if self._built is not None or not self.seqs:
            return super().paths(prefix)
        c = self._columns
        return pc.binary_join_element_wise(prefix, c["policy_id"], "/", c["name"], "").to_pylist()

    def _row(self, i: int) -> ShardEntry:
        """Row `i` alone (a fold looking up the few rows a later entry names)."""
        i = range(len(self.seqs))[i]
        c, distinct = self._columns, self._distinct
        values = {k: c[k][i].as_py() for k in c if k not in distinct and k != "newest_commit"}
        for k, (vals, idx) in distinct.items():
            j = idx[i].as_py()
            values[k] = None if j is None else vals[j]
        return self._make([values])[0]

    def _items(self) -> list[ShardEntry]:
        if self._built is None:
            c, n = self._columns, len(self.seqs)
            values: dict[str, list[Any]] = {}
            for k, arr in c.items():
                if k == "newest_commit":
                    continue
                if k in self._distinct:
                    vals, idx = self._distinct[k]
                    rows = idx.to_pylist() if idx.null_count else idx.to_numpy().tolist()
                    values[k] = [None if j is None else vals[j] for j in rows]
                elif arr.null_count or arr.type == pa.string():
                    values[k] = arr.to_pylist()
                else:
                    values[k] = arr.to_numpy().tolist()
            self._built = self._make([dict(zip(values, row)) for row in zip(*values.values())]) if n else []
        return self._built

    def _make(self, rows: list[dict[str, Any]]) -> list[ShardEntry]:
        new, topic, partition, out = object.__new__, self.topic, self.partition, []
        for r in rows:
            policy, name = r["policy_id"], r["name"]
            e = new(ShardEntry)
            e.__dict__.update(
                path=f"{policy}/{name}",
                staging_path=f"{policy}/_staging/{name}",
                topic=topic,
                partition=partition,
                policy_id=policy,
                first_offset=r["first_offset"],
                last_offset=r["last_offset"],
                episode_ids=(),
                episodes=r["episodes"],
                steps=r["steps"],
                bytes=r["bytes"],
                sha256=r["sha256"],
                format=r["format"],
                format_version=r["format_version"],
                event_schema_versions=_copy(r["event_schema_versions"]),
                commit_time=r["commit_time"],
                min_policy_version=r["min_policy_version"],
                max_policy_version=r["max_policy_version"],
                steps_without_logp=_copy(r["steps_without_logp"]),
                decoded_bytes=r["decoded_bytes"],
                resume_offset=r["resume_offset"],
                writer=r["writer"],
                epoch=r["epoch"],
                seq=r["seq"],
            )  # every value of the type `ShardEntry.__post_init__` makes (checked columns, parsed JSON)
            out.append(e)
        return out


def decode(data: bytes, topic: str, partition: int, seq: int) -> tuple[dict[str, Any], LiveRows]:
    """The header (its footer checked by `_open_checked`; the caller checks its fields) and the rows of a live
    set's bytes, as shard entries of log `topic`/`partition` without episode ids, in seq order.
    ManifestError: a value is not what a shard entry of that log below `seq` may hold. Every
    value is checked here; the entries are built when first asked for (`LiveRows`); retention's
    columns, where the file has them, are the rows' `LiveRows.retention`."""
    header, c = _open_checked(data, seq)
    for name, arr in c.items():
        if arr.null_count and not _NULLABLE[name]:
            raise ManifestError(f"live set: column {name!r} has nulls")
    if len(c["seq"]):
        _check_columns(c, seq)
    tables = None
    if "held" in header:
        _check_retention(c, seq)
        tables = {k: c.pop(k) for k, _, _ in (*HELD_COLUMNS, *REPLACED_COLUMNS)}
    return header, LiveRows(topic, partition, c, _distinct_values(c), tables)


_NULLABLE = {n: nullable for n, _, nullable in (*COLUMNS, NEWEST_COLUMN, *HELD_COLUMNS, *REPLACED_COLUMNS)}


def _member(x: np.ndarray, marked: np.ndarray) -> np.ndarray:
    """Per value of `x` (each checked to lie in ``[0, len(marked))``), whether it is marked."""
    return marked[x]


def _check_retention(c: Mapping[str, pa.Array], seq: int) -> None:
    """Retention's columns (docs/FORMAT.md, "Retention columns") as the history could make them:
    finite newest times; held and replaced seqs ascending, distinct, below `seq` and not live
    rows; each held by a live row after it, each replaced by an entry after it and below `seq`;
    replaced files named as a shard entry's."""
    if len(c["newest_commit"]) and not _all(pc.is_finite(c["newest_commit"])):
        raise ManifestError("live set: a row's newest_commit is not a finite number")
    live = np.zeros(seq, dtype=bool)  # one byte per entry below seq: what its size cap allows
    live[c["seq"].to_numpy()] = True  # the rows' seqs: checked ascending and below seq
    for what in ("held", "replaced"):
        q, by = c[f"{what}_seq"].to_numpy(), c[f"{what}_by"].to_numpy()
        if not len(q):
            continue
        if (np.diff(q) <= 0).any() or q[0] < 0 or q[-1] >= seq or (by <= q).any() or (by >= seq).any():
            raise ManifestError(
                f"live set: {what} seqs are not ascending, below {seq} and below what holds or replaced them"
            )
        if _member(q, live).any():
            raise ManifestError(f"live set: a {what} seq is a live row's")
        if what == "held" and not _member(by, live).all():
            raise ManifestError("live set: a held entry's holder is not a live row")
    if len(c["replaced_seq"]):
        _distinct(c["replaced_policy_id"], "replaced_policy_id", _check_policy)
        _check_names(c["replaced_name"])


def _distinct_values(c: Mapping[str, pa.Array]) -> dict[str, Any]:
    """The distinct values of the columns a `LiveRows` reads through them, each checked
    (`_distinct`): column -> (values, per-row indices); {} for no rows."""
    distinct: dict[str, Any] = {}
    if len(c["seq"]):
        budget = [_JSON_BYTES_PER_ROW * len(c["seq"]) + sum(_JSON_VALUE_BYTES.values())]
        for k in _JSON_COLUMNS:
            distinct[k] = _distinct(c[k], k, _JSON_CHECKS[k], parse=budget)
        distinct["policy_id"] = _distinct(c["policy_id"], "policy_id", _check_policy)
        distinct["writer"] = _distinct(c["writer"], "writer", _check_any)
        distinct["format"] = _distinct(c["format"], "format", _check_nonempty)
    return distinct


def _copy(v: Any) -> Any:
    return dict(v) if isinstance(v, dict) else v


def _all(mask: pa.Array) -> bool:
    return bool(pc.all(mask, skip_nulls=True).as_py() is not False)


def _check_columns(c: Mapping[str, pa.Array], seq: int) -> None:
    """The checks of `rlrec.store.manifest_entries._validate_shard_fields`, column-wise, plus the
    rows' seqs: ascending, each at least 0 and below `seq`."""
    seqs = c["seq"]
    if not (_all(pc.greater(seqs[1:], seqs[:-1])) and pc.min(seqs).as_py() >= 0 and pc.max(seqs).as_py() < seq):
        raise ManifestError(f"live set: row seqs are not ascending, at least 0 and below {seq}")
    if pc.min(c["epoch"]).as_py() < 1:
        raise ManifestError("live set: a row's epoch is below 1")
    for k in ("first_offset", "last_offset", "episodes", "steps", "bytes", "format_version"):
        if pc.min(c[k]).as_py() < 0:
            raise ManifestError(f"live set: a row's {k} is negative")
    for k in ("decoded_bytes", "resume_offset"):
        low = pc.min(c[k]).as_py()
        if low is not None and low < 0:
            raise ManifestError(f"live set: a row's {k} is negative")
    if not _all(pc.less_equal(c["first_offset"], c["last_offset"])):
        raise ManifestError("live set: a row's first_offset is above its last_offset")
    if not _all(pc.is_finite(c["commit_time"])):
        raise ManifestError("live set: a row's commit_time is not a finite number")
    offsets, data = _string_bytes(c["sha256"])
    hexdigit = ((data >= ord("0")) & (data <= ord("9"))) | ((data >= ord("a")) & (data <= ord("f")))
    if (np.diff(offsets) != 64).any() or not hexdigit.all():
        raise ManifestError("live set: a row's sha256 is not 64 lowercase hex digits")
    _check_names(c["name"])


def _check_names(names: pa.Array) -> None:
    """File names: one path component, not hidden or reserved ('.', '..', '_staging', ...)."""
    offsets, data = _string_bytes(names)
    if (np.diff(offsets) <= 0).any() or (data == ord("/")).any() or (data == ord("\\")).any():
        raise ManifestError("live set: a row's file name is empty or not one path component")
    if np.isin(data[offsets[:-1] - offsets[0]], [ord("."), ord("_")]).any():
        raise ManifestError("live set: a row's file name starts with '.' or '_'")
    if ((data < 0x20) | (data == 0x7F)).any():  # no file system takes a NUL; no newline in a file name
        raise ManifestError("live set: a row's file name holds a control character")


def _string_bytes(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(the offsets, the UTF-8 bytes) of a string array without nulls (validated by
    `_open_checked`), read from its buffers: a check of every byte in bulk."""
    _, off, buf = arr.buffers()
    offsets = np.frombuffer(off, dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(buf, dtype=np.uint8)[offsets[0] : offsets[-1]] if buf is not None else np.zeros(0, np.uint8)
    return offsets, data


def _distinct(
    col: pa.Array, what: str, check: Callable[[Any, str], Any], parse: list[int] | None = None
) -> tuple[list, Any]:
    """(the column's distinct values, each checked once by `check`; the per-row indices into
    them, null where the value is null). With `parse` (a one-item list: the JSON bytes left to
    parse, shared by the columns), each value is JSON text: its length is checked against
    `_JSON_VALUE_BYTES` and the budget on its bytes before any value is parsed, so what parsing
    builds is bounded by the rows, not by what the file's bytes decompress to."""
    enc = col.dictionary_encode()
    if parse is not None:
        lengths = pc.binary_length(enc.dictionary)
        longest = pc.max(lengths).as_py() or 0
        if longest > _JSON_VALUE_BYTES[what]:
            raise ManifestError(
                f"live set: a row's {what} is {longest} bytes of JSON (at most {_JSON_VALUE_BYTES[what]})"
            )
        parse[0] -= pc.sum(lengths).as_py() or 0
        if parse[0] < 0:
            raise ManifestError("live set: its rows hold more distinct JSON text than their number allows")
    values = [None if v is None else check(json.loads(v) if parse else v, what) for v in enc.dictionary.to_pylist()]
    return values, enc.indices


def _check_policy(v: str, what: str) -> str:
    from rlrec.producer.events import POLICY_ID_RE

    if not POLICY_ID_RE.match(v) or v.endswith("\n"):
        raise ManifestError(f"live set: a row's {what} is not a valid policy id: {v[:40]!r}")
    return v


def _check_any(v: str, what: str) -> str:
    return v


def _check_nonempty(v: str, what: str) -> str:
    if not v:
        raise ManifestError(f"live set: a row's {what} is empty")
    return v


def _is_int(v: Any) -> bool:
    return type(v) is int


def _versions(v: Any, _what: str = "") -> Any:
    if isinstance(v, dict):
        if not all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in v.values()):
            raise ManifestError("live set: a row's event_schema_versions holds a value that is not an int or string")
        return {str(k): v[k] for k in sorted(v)}
    if isinstance(v, list) and all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in v):
        return tuple(v)
    raise ManifestError("live set: a row's event_schema_versions is not a list of int/str or an object of them")


def _policy_version(v: Any, _what: str = "") -> Any:
    if not isinstance(v, (int, str)) or isinstance(v, bool):
        raise ManifestError("live set: a row's policy version is not an int or string")
    return v


def _steps_without_logp(v: Any, _what: str = "") -> Any:
    if not isinstance(v, dict) or not all(_is_int(x) and x >= 0 for x in v.values()):
        raise ManifestError("live set: a row's steps_without_logp is not an object of step counts >= 0")
    return v


_JSON_CHECKS = {
    "event_schema_versions": _versions,
    "min_policy_version": _policy_version,
    "max_policy_version": _policy_version,
    "steps_without_logp": _steps_without_logp,
}
