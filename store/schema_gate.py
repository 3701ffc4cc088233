"""The schema gate: every reader of shards and of legacy RLlib data checks a Parquet file's
Arrow schema here, against an exact allow-list, before it reads any column.

Why: Ray registers the Arrow extension type ``ray.data.arrow_pickled_object``; in a process that
imported ``ray.data`` or ``ray.rllib``, reading a column of that type (``to_pylist``, ``as_py``,
``to_numpy``, Ray Data's numpy conversion) unpickles its values, i.e. runs code from the file.
A Parquet file is untrusted input, so the invariant is (docs/GUARANTEES.md, "Stored data is
data"): **no rlrec reader touches a value of a column whose name and Arrow type the gate has not
allowed for the file's format and format version.** Any extension type outside
`ALLOWED_EXTENSIONS` is refused, at any depth of nesting, also when its type is not registered in
this process (then pyarrow shows the storage type with the ``ARROW:extension:name`` field
metadata, which the gate reads).

Entry points (the only ways rlrec opens a Parquet file for reading):

* `open_shard(source, fmt=...)` -> `GatedShard`: a committed shard (`episodes` or `tabular`,
  format version `SHARD_FORMAT_VERSION`); `GatedShard.read(columns)` reads columns only after
  the check. Used by the trainer's read task and manifest follower, ``inspect --verify``,
  ``report``, the demo's data summary, `rlrec.store.shards.read_episodes` / `read_tabular` /
  `shard_metadata` and `rlrec.store.maintenance.episode_summary`.
* `open_legacy_tabular(source, allow_pickle=...)`: a legacy RLlib tabular recording
  (``rlrec convert --from tabular``): any column names, types built from numeric, bool,
  string/binary and null primitives, lists, structs, maps and the tensor extensions; the
  pickled-object type only with ``allow_pickle=True``.

Reading the schema itself runs the registered extension types' ``__arrow_ext_deserialize__``,
which for Ray 2.60's types parses JSON only -- unless ``RAY_DATA_AUTOLOAD_CLOUDPICKLE_TENSOR_METADATA=1``
is set, which makes Ray unpickle tensor-type metadata from the file: the gate refuses to open
anything while that variable is set.

docs/FORMAT.md's schema table is generated from this module (`allow_list_markdown`;
tests/test_schema_gate.py keeps it current).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = [
    "ALLOWED_EXTENSIONS",
    "EPISODE_COLUMNS",
    "MULTI_AGENT_COLUMNS",
    "MULTI_AGENT_SHARD_FORMAT_VERSION",
    "PICKLED_OBJECT_EXTENSION",
    "RESERVED_TABULAR_NAMES",
    "SHARD_FORMATS",
    "SHARD_FORMAT_VERSION",
    "TABULAR_FIXED_COLUMNS",
    "GatedShard",
    "ShardSchemaError",
    "allow_list_markdown",
    "check_legacy_tabular_schema",
    "check_shard_schema",
    "open_legacy_tabular",
    "open_shard",
]

SHARD_FORMAT_VERSION = 1
#: the `episodes` format version of multi-agent rows (docs/FORMAT.md, "Multi-agent rows")
MULTI_AGENT_SHARD_FORMAT_VERSION = 2
SHARD_FORMATS = ("episodes", "tabular")
PICKLED_OBJECT_EXTENSION = "ray.data.arrow_pickled_object"
FIXED_SHAPE_TENSOR = "arrow.fixed_shape_tensor"
#: extension types a reader may see; values are numeric tensors, nothing is unpickled
ALLOWED_EXTENSIONS = {
    "episodes": frozenset(),
    "tabular": frozenset({FIXED_SHAPE_TENSOR}),
    "legacy-tabular": frozenset({FIXED_SHAPE_TENSOR, "ray.data.arrow_tensor", "ray.data.arrow_tensor_v2"}),
}
_UNSAFE_ENV = "RAY_DATA_AUTOLOAD_CLOUDPICKLE_TENSOR_METADATA"
_EXT_NAME_KEY = b"ARROW:extension:name"
_MAX_DEPTH = 32

#: the columns of an `episodes` shard: the packed episode, then metadata columns
EPISODE_COLUMNS: dict[str, pa.DataType] = {
    "episode_id": pa.string(),
    "policy_id": pa.string(),
    "policy_version": pa.int64(),
    "env_id": pa.string(),
    "length": pa.int64(),
    "episode_return": pa.float64(),
    "terminated": pa.bool_(),
    "truncated": pa.bool_(),
    "first_offset": pa.int64(),
    "last_offset": pa.int64(),
    "started_ms": pa.int64(),
    "ended_ms": pa.int64(),
}
#: the columns an `episodes` shard of multi-agent rows (version 2) adds, all required
MULTI_AGENT_COLUMNS: dict[str, pa.DataType] = {
    "multi_agent_episode_id": pa.string(),
    "multi_agent_policy_id": pa.string(),
    "agent_id": pa.string(),
    "module_id": pa.string(),
    "env_terminated": pa.bool_(),
    "env_truncated": pa.bool_(),
    "multi_agent_record": pa.binary(),
}
#: the fixed (non-array) columns of a `tabular` shard, RLlib's names
TABULAR_FIXED_COLUMNS: dict[str, pa.DataType] = {
    "eps_id": pa.string(),
    "agent_id": pa.null(),
    "module_id": pa.null(),
    "rewards": pa.float64(),
    "terminateds": pa.bool_(),
    "truncateds": pa.bool_(),
    "t": pa.int64(),
    "infos": pa.string(),
    "policy_version": pa.int64(),
}
TABULAR_ARRAY_COLUMNS = ("obs", "actions", "new_obs")
TABULAR_REQUIRED = ("eps_id", "obs", "actions", "rewards", "new_obs", "terminateds", "truncateds")
#: names an extra-model-output column of a tabular shard may not have (RLlib's and ours)
RESERVED_TABULAR_NAMES = frozenset(
    {*TABULAR_FIXED_COLUMNS, *TABULAR_ARRAY_COLUMNS, "dones", "agent_index", "unroll_id", "type"}
) | frozenset({"rlrec_tag", "rlrec_envelope", "rlrec_rows"})

_NUMERIC = (
    pa.bool_(),
    pa.int8(),
    pa.int16(),
    pa.int32(),
    pa.int64(),
    pa.uint8(),
    pa.uint16(),
    pa.uint32(),
    pa.uint64(),
    pa.float16(),
    pa.float32(),
    pa.float64(),
)


class ShardSchemaError(ValueError):
    """A file's schema is not allowed for its format: nothing of it was read (see `reason`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------------------------- type rules


def _ext_name(t: pa.DataType, field: pa.Field | None) -> str | None:
    """The extension name of `t`: registered (an ExtensionType) or not (field metadata)."""
    if isinstance(t, pa.BaseExtensionType):
        return t.extension_name
    meta = field.metadata if field is not None else None
    if meta and _EXT_NAME_KEY in meta:
        return meta[_EXT_NAME_KEY].decode("utf-8", "replace")
    return None


def _describe(t: pa.DataType, name: str | None) -> str:
    return f"extension type {name!r}" if name else f"type {t}"


def _pickle_hint(name: str | None) -> str:
    if name == PICKLED_OBJECT_EXTENSION:
        return " (its values are pickled Python objects: reading them executes code from the file)"
    return ""


def _numeric_array(
    t: pa.DataType, field: pa.Field | None, allowed_ext: frozenset, structs: bool, depth: int = 0
) -> str | None:
    """None if `t` is a numeric array type of a shard; else why not."""
    if depth > _MAX_DEPTH:
        return "nested too deeply"
    ext = _ext_name(t, field)
    if ext is not None:
        if ext not in allowed_ext:
            return f"{_describe(t, ext)} is not allowed{_pickle_hint(ext)}"
        storage = t.storage_type if isinstance(t, pa.BaseExtensionType) else t
        value = storage.value_type if hasattr(storage, "value_type") else None
        if value is None or value not in _NUMERIC:
            return f"{_describe(t, ext)} must hold numbers"
        return None
    if t in _NUMERIC:
        return None
    if pa.types.is_fixed_size_list(t):
        return _numeric_array(t.value_type, t.value_field, allowed_ext, False, depth + 1)
    if structs and pa.types.is_struct(t) and t.num_fields > 0:
        for i in range(t.num_fields):
            why = _numeric_array(t.field(i).type, t.field(i), allowed_ext, True, depth + 1)
            if why:
                return f"field {t.field(i).name!r}: {why}"
        return None
    return f"type {t} is not a numeric array type"


def _legacy_type(t: pa.DataType, field: pa.Field | None, allow_pickle: bool, depth: int = 0) -> str | None:
    """None if `t` may be read from a legacy RLlib tabular file; else why not."""
    if depth > _MAX_DEPTH:
        return "nested too deeply"
    ext = _ext_name(t, field)
    if ext is not None:
        if ext == PICKLED_OBJECT_EXTENSION and allow_pickle:
            return None
        if ext not in ALLOWED_EXTENSIONS["legacy-tabular"]:
            hint = "; pass --allow-pickle only if you trust this data" if ext == PICKLED_OBJECT_EXTENSION else ""
            return f"{_describe(t, ext)} is not allowed{_pickle_hint(ext)}{hint}"
        storage = t.storage_type if isinstance(t, pa.BaseExtensionType) else t
        return _legacy_type(storage, None, False, depth + 1)
    if (
        t in _NUMERIC
        or pa.types.is_null(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    ):
        return None
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _legacy_type(t.value_type, t.value_field, allow_pickle, depth + 1)
    if pa.types.is_struct(t):
        for i in range(t.num_fields):
            why = _legacy_type(t.field(i).type, t.field(i), allow_pickle, depth + 1)
            if why:
                return f"field {t.field(i).name!r}: {why}"
        return None
    if pa.types.is_map(t):
        return _legacy_type(t.key_type, t.key_field, allow_pickle, depth + 1) or _legacy_type(
            t.item_type, t.item_field, allow_pickle, depth + 1
        )
    if pa.types.is_dictionary(t):
        return _legacy_type(t.value_type, None, allow_pickle, depth + 1)
    return f"type {t} is not allowed"


# ---------------------------------------------------------------------------------- the formats


@dataclass(frozen=True)
class _ColumnRule:
    """One row of the allow-list: a column (or a family of columns) and what it may be."""

    columns: str
    types: str
    required: bool
    check: Callable[[str, pa.Field], str | None]


def _exact(expected: pa.DataType) -> Callable[[str, pa.Field], str | None]:
    def check(_name: str, field: pa.Field) -> str | None:
        ext = _ext_name(field.type, field)
        if ext is not None:
            return f"{_describe(field.type, ext)} is not allowed{_pickle_hint(ext)}"
        return None if field.type == expected else f"type {field.type}, expected {expected}"

    return check


def _array(structs: bool) -> Callable[[str, pa.Field], str | None]:
    def check(_name: str, field: pa.Field) -> str | None:
        return _numeric_array(field.type, field, ALLOWED_EXTENSIONS["tabular"], structs)

    return check


_ARRAY_TYPES = "a numeric type (bool, int8..int64, uint8..uint64, float16/32/64), `fixed_size_list` of one (nested), or `arrow.fixed_shape_tensor` of one"

SHARD_SCHEMAS: dict[tuple[str, int], list[_ColumnRule]] = {
    ("episodes", 1): [
        _ColumnRule("`item`", "binary", True, _exact(pa.binary())),
        *(_ColumnRule(f"`{n}`", str(t), False, _exact(t)) for n, t in EPISODE_COLUMNS.items()),
    ],
    ("episodes", MULTI_AGENT_SHARD_FORMAT_VERSION): [
        _ColumnRule("`item`", "binary", True, _exact(pa.binary())),
        *(_ColumnRule(f"`{n}`", str(t), False, _exact(t)) for n, t in EPISODE_COLUMNS.items()),
        *(_ColumnRule(f"`{n}`", str(t), True, _exact(t)) for n, t in MULTI_AGENT_COLUMNS.items()),
    ],
    ("tabular", 1): [
        *(_ColumnRule(f"`{n}`", str(t), n in TABULAR_REQUIRED, _exact(t)) for n, t in TABULAR_FIXED_COLUMNS.items()),
        *(
            _ColumnRule(f"`{n}`", f"{_ARRAY_TYPES}; a `struct` of these for Dict/Tuple spaces", True, _array(True))
            for n in TABULAR_ARRAY_COLUMNS
        ),
    ],
}
_TABULAR_EXTRA = _ColumnRule(
    "any other name (an extra model output; not reserved, see below)", _ARRAY_TYPES, False, _array(False)
)


def _format_of(schema: pa.Schema, expected: str | None) -> tuple[str, int]:
    meta = schema.metadata or {}
    fmt = meta.get(b"rlrec.format", b"").decode("utf-8", "replace")
    version = meta.get(b"rlrec.schema_version", b"").decode("utf-8", "replace")
    if not fmt:
        raise ShardSchemaError("not an rlrec shard: no rlrec.format schema metadata")
    if expected is not None and fmt != expected:
        raise ShardSchemaError(f"the file is an {fmt!r} shard, its manifest entry says {expected!r}")
    if not version.isdigit() or (fmt, int(version)) not in SHARD_SCHEMAS:
        known = ", ".join(f"{f} v{v}" for f, v in SHARD_SCHEMAS)
        newer = version.isdigit() and any(f == fmt and int(version) > v for f, v in SHARD_SCHEMAS)
        hint = ": upgrade rlrec to read it" if newer else ""
        raise ShardSchemaError(f"unknown shard format {fmt!r} version {version!r} (this reader knows {known}){hint}")
    return fmt, int(version)


def _refuse_unsafe_environment() -> None:
    if os.environ.get(_UNSAFE_ENV, "0") == "1":
        raise ShardSchemaError(
            f"{_UNSAFE_ENV}=1 is set: Ray would unpickle extension-type metadata from the file while its "
            "schema is read; unset it to read untrusted Parquet files"
        )


def check_shard_schema(schema: pa.Schema, fmt: str | None = None) -> tuple[str, int]:
    """(format, format version) of a shard whose schema passes the allow-list; else `ShardSchemaError`."""
    found, version = _format_of(schema, fmt)
    rules = SHARD_SCHEMAS[(found, version)]
    by_name = {r.columns.strip("`"): r for r in rules if r.columns.startswith("`")}
    names = schema.names
    if len(set(names)) != len(names):
        raise ShardSchemaError("duplicate column names")
    for field in schema:
        rule = by_name.get(field.name)
        if rule is None:
            if found != "tabular" or field.name in RESERVED_TABULAR_NAMES or field.name.startswith("rlrec_"):
                raise ShardSchemaError(f"column {field.name!r} is not allowed in a {found} v{version} shard")
            rule = _TABULAR_EXTRA
        why = rule.check(field.name, field)
        if why:
            raise ShardSchemaError(f"column {field.name!r}: {why}")
    missing = [r.columns for r in rules if r.required and r.columns.strip("`") not in names]
    if missing:
        raise ShardSchemaError(f"a {found} v{version} shard needs column(s) {', '.join(missing)}")
    return found, version


def check_legacy_tabular_schema(schema: pa.Schema, allow_pickle: bool = False) -> None:
    """Raise `ShardSchemaError` unless every column of a legacy tabular file may be read."""
    for field in schema:
        why = _legacy_type(field.type, field, allow_pickle)
        if why:
            raise ShardSchemaError(f"column {field.name!r}: {why}")


# ---------------------------------------------------------------------------------- opening


def _parquet(source: Any, filesystem: Any = None, **options: Any) -> pq.ParquetFile:
    _refuse_unsafe_environment()
    if isinstance(source, (bytes, bytearray, memoryview, pa.Buffer)):
        source = pa.BufferReader(source if isinstance(source, pa.Buffer) else pa.py_buffer(bytes(source)))
    elif filesystem is not None:
        source = filesystem.open_input_file(source)
    try:
        return pq.ParquetFile(source, **options)
    except (pa.ArrowInvalid, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ShardSchemaError(f"not a readable Parquet file: {e}") from None


def _variable_length(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_string(t) or pa.types.is_large_binary(t) or pa.types.is_large_string(t)


def _dictionary_columns(pf: pq.ParquetFile) -> dict[str, tuple[int, int]]:
    """Top-level binary and string columns with a dictionary page in some row group -> (what
    their footer says they decode to, a value counted once; the most they can decode to dense:
    each row group's rows times its chunk's size)."""
    meta, schema = pf.metadata, pf.schema_arrow
    names = {f.name for f in schema if _variable_length(f.type)}
    out: dict[str, tuple[int, int]] = {}
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        for j in range(rg.num_columns):
            col = rg.column(j)
            if col.path_in_schema in names and col.has_dictionary_page:
                size, most = out.get(col.path_in_schema, (0, 0))
                out[col.path_in_schema] = (
                    size + col.total_uncompressed_size,
                    most + rg.num_rows * col.total_uncompressed_size,
                )
    return out


class GatedShard:
    """A Parquet file whose schema passed the gate; the only handle rlrec reads shard columns from.

    Guarantees: `read` returns only allowed columns (that the schema check covered) of a file
    whose every column passed the allow-list of `fmt` / `version`."""

    def __init__(self, pf: pq.ParquetFile, fmt: str, version: int, reopen: Callable[..., Any] | None = None) -> None:
        self._pf = pf
        self._reopen = reopen  # opens the same file again with ParquetFile options (read_dictionary)
        self.fmt = fmt
        self.version = version
        self.schema = pf.schema_arrow
        self.num_rows = pf.metadata.num_rows
        #: what its columns decode to, as its footer states (`MAX_SHARD_DECODED_BYTES` limits it)
        self.decoded_bytes = _decoded_bytes(pf.metadata)
        self._dictionary = _dictionary_columns(pf)  # name -> footer bytes, until its dense size is known
        self._dense: dict[str, int] = {}  # name -> what the dictionary column decodes to, dense

    def _dictionary_read(self, names: list[str], columns: list[str] | None = None) -> pa.Table:
        pf = self._reopen(read_dictionary=names)  # type: ignore[misc]
        try:
            return pf.read(columns=names if columns is None else columns)
        except (pa.ArrowInvalid, OSError) as e:
            raise ShardSchemaError(f"not a readable Parquet file: {e}") from None

    def _check_dense(self, names: Iterable[str]) -> None:
        """Refuse, before they are decoded dense, dictionary-encoded binary or string columns whose
        rows repeat their values past `MAX_SHARD_DECODED_BYTES` (the footer counts a dictionary
        value once): each column's size dense is summed from its indices and value lengths."""
        todo = [n for n in names if n in self._dictionary and n not in self._dense]
        if not todo or self._reopen is None:
            return
        if self.decoded_bytes + sum(self._dictionary[n][1] for n in self._dictionary) <= MAX_SHARD_DECODED_BYTES:
            return  # even every row holding the largest value fits: nothing to read
        table = self._dictionary_read(todo)
        for name in todo:
            dense = 0
            for chunk in table.column(name).chunks:
                if isinstance(chunk, pa.DictionaryArray):
                    lengths = pc.binary_length(chunk.dictionary)
                    dense += pc.sum(pc.take(lengths, chunk.indices)).as_py() or 0
                else:
                    dense += chunk.nbytes
            self._dense[name] = dense
        total = self.decoded_bytes + sum(max(0, d - self._dictionary[n][0]) for n, d in self._dense.items())
        if total > MAX_SHARD_DECODED_BYTES:
            raise ShardSchemaError(
                f"the shard decodes to {total} bytes once its dictionary columns are expanded, over the limit "
                f"of {MAX_SHARD_DECODED_BYTES} (MAX_SHARD_DECODED_BYTES): refused before reading them"
            )

    @property
    def names(self) -> list[str]:
        return list(self.schema.names)

    def metadata(self) -> dict[str, str]:
        """The ``rlrec.*`` schema metadata (format, schema version, spaces)."""
        meta = self.schema.metadata or {}
        return {k.decode(): v.decode() for k, v in meta.items() if k.startswith(b"rlrec.")}

    def read(self, columns: list[str] | None = None, *, dictionary: Iterable[str] = ()) -> pa.Table:
        """The named columns that exist (all with None) as a table; those named in `dictionary`
        as Arrow dictionary arrays (a value repeated in many rows held once).

        Raises:
            ShardSchemaError: unreadable, or its dense columns would decode past
                `MAX_SHARD_DECODED_BYTES` (checked before they are read).
        """
        cols = list(self.schema.names) if columns is None else [c for c in columns if c in self.schema.names]
        as_dict = [c for c in cols if c in set(dictionary)]
        self._check_dense([c for c in cols if c not in as_dict])
        if as_dict and self._reopen is not None:
            return self._dictionary_read(as_dict, cols)
        try:
            return self._pf.read(columns=None if columns is None else cols)
        except (pa.ArrowInvalid, OSError) as e:
            raise ShardSchemaError(f"not a readable Parquet file: {e}") from None

    def row_groups(self) -> Iterator[pa.Table]:
        """Every column, one row group at a time, in order (for copying a shard in bounded memory)."""
        self._check_dense(self.schema.names)
        for i in range(self._pf.num_row_groups):
            try:
                yield self._pf.read_row_group(i)
            except (pa.ArrowInvalid, OSError) as e:
                raise ShardSchemaError(f"not a readable Parquet file: {e}") from None


#: what one shard's columns may decompress to, as its footer states (checked before any column is
#: read): the consumer rolls shards at --max-file-bytes (128 MiB by default), so a larger claim is
#: not a shard rlrec wrote. A footer that understates its pages fails their decompression instead.
MAX_SHARD_DECODED_BYTES = 1024 * 1024 * 1024


def _decoded_bytes(meta: pq.FileMetaData) -> int:
    return sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))


def open_shard(source: Any, *, fmt: str | None = None, filesystem: Any = None) -> GatedShard:
    """Open a shard (path, or its bytes) and check its schema and its decoded size; `fmt` = what
    the manifest says."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = pa.py_buffer(bytes(source) if not isinstance(source, bytes) else source)
    pf = _parquet(source, filesystem)
    found, version = check_shard_schema(pf.schema_arrow, fmt)
    meta = pf.metadata
    decoded = _decoded_bytes(meta)
    if decoded > MAX_SHARD_DECODED_BYTES:
        raise ShardSchemaError(
            f"the shard decodes to {decoded} bytes, over the limit of {MAX_SHARD_DECODED_BYTES} "
            "(MAX_SHARD_DECODED_BYTES): refused before reading"
        )
    return GatedShard(pf, found, version, lambda **options: _parquet(source, filesystem, **options))


def open_legacy_tabular(source: Any, *, allow_pickle: bool = False, filesystem: Any = None) -> pq.ParquetFile:
    """Open a legacy RLlib tabular Parquet file (``rlrec convert``) and check its schema."""
    pf = _parquet(source, filesystem)
    check_legacy_tabular_schema(pf.schema_arrow, allow_pickle)
    return pf


# ---------------------------------------------------------------------------------- the doc table


def allow_list_markdown() -> str:
    """The allow-list as the Markdown table in docs/FORMAT.md ("Schema gate")."""
    lines = ["| format | version | column | Arrow type | required |", "|---|---|---|---|---|"]
    for (fmt, version), rules in SHARD_SCHEMAS.items():
        extra = [_TABULAR_EXTRA] if fmt == "tabular" else []
        for r in [*rules, *extra]:
            lines.append(f"| `{fmt}` | {version} | {r.columns} | {r.types} | {'yes' if r.required else 'no'} |")
    lines += [
        "",
        "Extension types allowed per reader: "
        + "; ".join(f"`{k}`: {', '.join(f'`{e}`' for e in sorted(v)) or 'none'}" for k, v in ALLOWED_EXTENSIONS.items())
        + f". `{PICKLED_OBJECT_EXTENSION}` only in `legacy-tabular` input with `--allow-pickle`.",
        "",
        "`legacy-tabular` (RLlib recordings read by `rlrec convert --from tabular`): any column names; "
        "types built from numeric, bool, string, binary and null primitives (large variants too), "
        "`list`/`large_list`/`fixed_size_list`, `struct`, `map`, `dictionary` and the extension types above.",
        "",
        "Reserved names (no extra-model-output column of a tabular shard may have them, nor any name "
        "starting with `rlrec_`): " + ", ".join(f"`{n}`" for n in sorted(RESERVED_TABULAR_NAMES)) + ".",
    ]
    return "\n".join(lines) + "\n"


_BEGIN, _END = "<!-- schema-gate:begin -->\n", "<!-- schema-gate:end -->"


def update_doc(path: str, check: bool = False) -> bool:
    """Rewrite the generated table between the schema-gate markers of `path`; True if it changed
    (with `check`, nothing is written)."""
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    if _BEGIN not in doc or _END not in doc:
        raise ValueError(f"{path} has no {_BEGIN.strip()} ... {_END} block")
    head, rest = doc.split(_BEGIN, 1)
    _old, tail = rest.split(_END, 1)
    new = head + _BEGIN + allow_list_markdown() + _END + tail
    if new != doc and not check:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != doc


if __name__ == "__main__":  # python -m rlrec.store.schema_gate --update docs/FORMAT.md [--check]
    import argparse
    import sys

    ap = argparse.ArgumentParser(description="refresh the schema-gate table in docs/FORMAT.md")
    ap.add_argument("--update", required=True, metavar="FILE")
    ap.add_argument("--check", action="store_true", help="exit 1 if the table is stale; write nothing")
    a = ap.parse_args()
    changed = update_doc(a.update, check=a.check)
    sys.exit(1 if (changed and a.check) else 0)
