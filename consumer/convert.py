"""Legacy RLlib recordings -> episode shards with our manifest (``rlrec convert``).

Two input formats, both read as rows (one row per step) and rebuilt into episodes:

``tabular``
    Parquet files with RLlib's offline column schema (``output_write_episodes=False``; also our
    own tabular shards): ``eps_id``, ``agent_id``, ``module_id``, ``obs``, ``actions``,
    ``rewards``, ``new_obs``, ``terminateds``, ``truncateds``, ``t``, ``infos`` and, as extra
    model outputs, every other per-row numeric column (``action_logp``, ``action_dist_inputs``,
    ...). A user mapping like RLlib's ``input_read_schema`` renames columns
    (``schema={"obs": "observation", ...}``: our key -> the file's column). Array columns may be
    plain numeric, (fixed-size) lists, Arrow or Ray tensors or structs (Dict/Tuple spaces).

``sample-batch``
    JSON lines of the old API stack's ``JsonWriter``: ``{"type": "SampleBatch", "obs": ...,
    "actions": ..., ...}`` or ``{"type": "MultiAgentBatch", "policy_batches": {pid: {...}}}``
    (the policy id becomes the shard's policy id). ``dones`` is read as ``terminateds`` (as
    RLlib's JsonReader does). Rows of one episode may be spread over many lines and files.

Pickle: RLlib compresses ``obs``/``new_obs`` by default (``output_compress_columns``) into
base64(LZ4(cloudpickle)) strings, and Ray Data stores columns it cannot convert as the extension
type ``ray.data.arrow_pickled_object``. Decoding either executes code from the data, so it is
refused (`UnsafeInputError`) unless ``allow_pickle=True`` (``--allow-pickle``): use it only for
data you trust. Numeric columns never need it. Every Parquet file passes the schema gate
(`rlrec.store.schema_gate.open_legacy_tabular`) before any column is read: without
``allow_pickle`` a pickled-object column of any name refuses the file, whatever the column types.

Episodes: rows are grouped by ``eps_id`` and ordered by ``t`` (input order when there is no
``t`` column). Rows repeated with the same ``t`` are dropped (RLlib's recorder with
``output_write_remaining_data=True`` writes every row twice); without ``t``, an episode whose
rows hold the same complete sequence k times keeps one copy. An episode ends at its row with
``terminateds`` or ``truncateds`` set (kept apart); rows after it, gaps in ``t`` or conflicting
repeated rows are errors. Episodes without an end are dropped (default), marked truncated, or
refused (``incomplete="drop"|"truncate"|"error"``). Observations are ``obs`` of every row plus
``new_obs`` of the last row (episodes where a row's ``obs`` differs from the previous row's
``new_obs`` are counted in `ConvertResult.discontinuous` and noted). The reset info is not in a tabular recording: ``infos[0] = {}``.
Multi-agent recordings (several ``agent_id`` values in one episode) are refused.

Spaces: given (JSON, see `rlrec.producer.spaces`), taken from the files' ``rlrec.*_space`` metadata
(our own tabular shards), or inferred from the data: floats -> ``Box(-inf, inf)``, integer
scalars -> ``Discrete(max + 1)``, integer arrays -> ``Box`` over the dtype's range, bools ->
``MultiBinary``, structs -> ``Dict``/``Tuple``.

Metadata: ``policy_id`` from the ``module_id`` column (or the MultiAgentBatch key), else
``default_policy``; ``policy_version`` from a ``policy_version`` or ``weights_seq_no`` column
(first row of the episode), else 0; ``started_ms = ended_ms = 0`` (unknown); the manifest's
offsets are the rows' positions in the input. Both can be overridden.

Output: committed exactly like the consumer does (`rlrec.store.commit.ShardCommitter`: stage,
manifest append, publish) under manifest topic ``topic`` (default ``converted``), partition 0,
so ``rlrec inspect --verify``, the trainer and stock RLlib (``input_read_episodes=True`` on
``{output}/{policy_id}``) read the result. Re-running into the same output is idempotent: episodes
whose ids are already committed under that topic are skipped (counted in
`ConvertResult.skipped_committed`); an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from rlrec.consumer.convert_options import SCHEMA_KEYS, ConvertOptions
from rlrec.producer.events import POLICY_ID_RE
from rlrec.producer.spaces import dumps_space, loads_space, space_leaves
from rlrec.store.commit import ShardCommitter
from rlrec.store.finished import FinishedEpisode
from rlrec.store.ownership import release_lease
from rlrec.store.schema_gate import PICKLED_OBJECT_EXTENSION, ShardSchemaError, open_legacy_tabular
from rlrec.store.storage import Storage

__all__ = [
    "INPUT_FORMATS",
    "SCHEMA_KEYS",
    "ConvertError",
    "ConvertOptions",
    "ConvertResult",
    "UnsafeInputError",
    "convert",
    "read_rows",
    "rows_to_episodes",
]

INPUT_FORMATS = ("tabular", "sample-batch")
_VERSION_COLUMNS = ("policy_version", "weights_seq_no")
#: bookkeeping columns of RLlib that are neither data nor extra model outputs
_IGNORED = frozenset(
    {"agent_index", "unroll_id", "type", "count", "seq_lens", "weights_seq_no", "policy_version", "env_id"}
)
_ARRAY_KEYS = ("obs", "new_obs", "actions")
DEFAULT_POLICY_ID = "default_policy"


class ConvertError(ValueError):
    """The input cannot be converted (missing columns, inconsistent rows, bad options)."""


class UnsafeInputError(ConvertError):
    """Decoding the input would unpickle (execute code from the data); pass allow_pickle."""


@dataclass
class ConvertResult:
    """What a conversion did."""

    files: int = 0
    rows: int = 0
    duplicate_rows: int = 0
    episodes: int = 0
    incomplete_dropped: int = 0
    incomplete_truncated: int = 0
    discontinuous: int = 0
    skipped_committed: int = 0
    written_episodes: int = 0
    steps: int = 0
    shards: int = 0
    bytes: int = 0
    observation_space: gym.Space | None = None
    action_space: gym.Space | None = None
    notes: list[str] = field(default_factory=list)
    entries: list = field(default_factory=list)


Progress = Callable[[str, int, int], None]  # (stage, done, total)


# ---------------------------------------------------------------------------------------------
# column values -> leaves.  A "tree" is either an ndarray (one leaf, rows first) or
# ("dict", [(name, tree), ...]) / ("tuple", [tree, ...]).


def _unpack_rllib(value: Any, what: str, allow_pickle: bool) -> np.ndarray:
    """RLlib's `compression.unpack`: base64 -> LZ4 frame -> pickle (only with allow_pickle)."""
    if not allow_pickle:
        raise UnsafeInputError(
            f"{what} holds strings: RLlib's compressed values (base64(LZ4(cloudpickle))), and decoding them "
            "executes code from the data. Re-run with --allow-pickle only if you trust this data, or "
            "re-record with output_compress_columns=[] (numeric columns)."
        )
    import lz4.frame

    try:
        raw = lz4.frame.decompress(base64.b64decode(value))
        return np.asarray(pickle.loads(raw))
    except Exception as e:
        raise ConvertError(f"{what}: cannot decode a compressed value: {type(e).__name__}: {e}") from None


def _arrow_tree(col: pa.Array, what: str, allow_pickle: bool) -> Any:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    t = col.type
    if isinstance(t, pa.BaseExtensionType):
        if t.extension_name == PICKLED_OBJECT_EXTENSION:  # the gate let it through: allow_pickle is on
            if not allow_pickle:
                raise UnsafeInputError(f"{what} holds pickled Python objects; pass --allow-pickle only if you trust it")
            return _json_tree(col.to_pylist(), what, allow_pickle)
        if isinstance(t, pa.FixedShapeTensorType):
            if col.null_count:
                raise ConvertError(f"{what} has {col.null_count} null value(s)")
            return pa.FixedShapeTensorArray.from_storage(t, col.storage).to_numpy_ndarray()
        shape = getattr(t, "shape", None)  # Ray's tensor extensions: a list column of flattened tensors
        inner = _arrow_tree(col.storage, what, allow_pickle)
        if (
            isinstance(shape, tuple)
            and isinstance(inner, np.ndarray)
            and all(isinstance(d, int) for d in shape)
            and inner.size == len(inner) * int(np.prod(shape))
        ):
            return inner.reshape((len(inner), *shape))
        return inner
    if col.null_count:
        raise ConvertError(f"{what} has {col.null_count} null value(s)")
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        children = [_arrow_tree(col.field(i), f"{what}.{n}", allow_pickle) for i, n in enumerate(names)]
        if names == [str(i) for i in range(len(names))]:
            return ("tuple", children)
        return ("dict", list(zip(names, children)))
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        vals = col.to_pylist()
        if not vals:
            return np.zeros((0,))
        return np.stack([_unpack_rllib(v, what, allow_pickle) for v in vals])
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        n = len(col)
        if pa.types.is_fixed_size_list(t):
            width = t.list_size
        else:
            lengths = np.asarray(col.value_lengths().to_numpy(zero_copy_only=False))
            width = int(lengths[0]) if n else 0
            if n and not (lengths == width).all():
                raise ConvertError(f"{what}: rows hold lists of different lengths (ragged arrays are not supported)")
        inner = _arrow_tree(col.flatten(), what, allow_pickle)
        if not isinstance(inner, np.ndarray):
            raise ConvertError(f"{what}: lists of structs are not supported")
        return inner.reshape((n, width, *inner.shape[1:]))
    if pa.types.is_null(t):
        raise ConvertError(f"{what} is all null")
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise ConvertError(f"{what} has unsupported type {t}")
    return np.asarray(col.to_numpy(zero_copy_only=False))


def _json_tree(v: Any, what: str, allow_pickle: bool) -> Any:
    if isinstance(v, str):
        return _unpack_rllib(v, what, allow_pickle)
    if isinstance(v, dict):
        return ("dict", [(k, _json_tree(x, f"{what}.{k}", allow_pickle)) for k, x in v.items()])
    try:
        a = np.asarray(v)
    except ValueError as e:
        raise ConvertError(f"{what}: not a rectangular numeric array: {e}") from None
    if a.dtype.kind not in "biuf":
        raise ConvertError(f"{what}: expected numbers, got {a.dtype} values")
    return a


def _tree_leaves(tree: Any) -> list[np.ndarray]:
    if isinstance(tree, np.ndarray):
        return [tree]
    kind, children = tree
    if kind == "dict":
        return [leaf for _, c in children for leaf in _tree_leaves(c)]
    return [leaf for c in children for leaf in _tree_leaves(c)]


def _tree_concat(trees: list[Any], what: str) -> Any:
    first = trees[0]
    if isinstance(first, np.ndarray):
        if not all(isinstance(t, np.ndarray) and t.shape[1:] == first.shape[1:] for t in trees):
            raise ConvertError(f"{what}: inputs disagree on the shape/structure")
        return np.concatenate(trees, axis=0)
    kind, children = first
    if not all(isinstance(t, tuple) and t[0] == kind and len(t[1]) == len(children) for t in trees):
        raise ConvertError(f"{what}: inputs disagree on the structure")
    if kind == "dict":
        return (
            "dict",
            [(name, _tree_concat([t[1][i][1] for t in trees], what)) for i, (name, _) in enumerate(children)],
        )
    return ("tuple", [_tree_concat([t[1][i] for t in trees], what) for i in range(len(children))])


def _infer_space(tree: Any, what: str) -> gym.Space:
    if not isinstance(tree, np.ndarray):
        kind, children = tree
        if kind == "dict":
            return gym.spaces.Dict({name: _infer_space(c, f"{what}.{name}") for name, c in children})
        return gym.spaces.Tuple([_infer_space(c, what) for c in children])
    a, shape = tree, tree.shape[1:]
    if a.dtype.kind == "f":
        return gym.spaces.Box(-np.inf, np.inf, shape=shape, dtype=a.dtype)
    if a.dtype.kind == "b":
        return gym.spaces.MultiBinary(list(shape)) if shape else gym.spaces.Discrete(2)
    if a.dtype.kind in "iu":
        if not shape:
            lo = int(a.min()) if len(a) else 0
            if lo < 0:
                raise ConvertError(f"{what}: negative integers; give the space explicitly")
            return gym.spaces.Discrete(int(a.max()) + 1 if len(a) else 1)
        info = np.iinfo(a.dtype)
        return gym.spaces.Box(info.min, info.max, shape=shape, dtype=a.dtype)
    raise ConvertError(f"{what}: cannot infer a space for dtype {a.dtype}")


def _fit_leaves(tree: Any, space: gym.Space, what: str) -> list[np.ndarray]:
    """The leaves of `tree` cast to the leaf dtypes of `space` (shapes must match)."""
    leaves = _tree_leaves(tree)
    spec = space_leaves(space)
    if len(leaves) != len(spec):
        raise ConvertError(f"{what}: {len(leaves)} array(s) in the data, the space {space} has {len(spec)}")
    out = []
    for i, (a, leaf) in enumerate(zip(leaves, spec)):
        if a.shape[1:] != leaf.shape:
            if a.size == len(a) * int(np.prod(leaf.shape)) and len(leaf.shape) > 0:
                a = a.reshape((len(a), *leaf.shape))  # flattened tensors (e.g. Ray's extension storage)
            else:
                raise ConvertError(
                    f"{what}[{i}]: rows have shape {list(a.shape[1:])}, the space wants {list(leaf.shape)}"
                )
        if a.dtype != leaf.dtype:
            if a.dtype.kind == "f" and leaf.dtype.kind in "iub" and not np.array_equal(a, np.round(a)):
                raise ConvertError(f"{what}[{i}]: non-integer values for an integer space")
            a = a.astype(leaf.dtype)
        out.append(np.ascontiguousarray(a))
    return out


# ---------------------------------------------------------------------------------------------
# reading rows


@dataclass
class _Block:
    """Rows of one input chunk (a Parquet file or one JSON line / policy batch)."""

    n: int
    arrays: dict[str, Any]  # obs/new_obs/actions -> tree
    columns: dict[str, np.ndarray]  # eps_id, rewards, flags, t, agent/module ids, versions
    infos: list[dict] | None
    extras: dict[str, np.ndarray]
    policy_id: str | None = None  # a MultiAgentBatch's key
    spaces: dict[str, gym.Space] = field(default_factory=dict)  # from rlrec.* file metadata
    notes: list[str] = field(default_factory=list)


def _files(uri: str, suffixes: tuple[str, ...]) -> tuple[pafs.FileSystem, list[str]]:
    if "://" in uri:
        fs, base = pafs.FileSystem.from_uri(uri)
    else:
        import os

        fs, base = pafs.LocalFileSystem(), os.path.abspath(uri)
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.NotFound:
        raise ConvertError(f"input {uri} does not exist")
    if info.type == pafs.FileType.File:
        return fs, [base]
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    paths = sorted(
        i.path
        for i in infos
        if i.type == pafs.FileType.File
        and i.path.endswith(suffixes)
        and not any(p.startswith(("_", ".")) for p in i.path[len(base) :].split("/") if p)
    )
    if not paths:
        raise ConvertError(f"no {'/'.join(suffixes)} files under {uri}")
    return fs, paths


def _rename(cols: dict[str, Any], schema: dict[str, str]) -> dict[str, Any]:
    out = dict(cols)
    for key, col in schema.items():
        if col in cols:
            out.pop(col, None)
            out[key] = cols[col]
    return out


def _block(
    cols: dict[str, Any],
    n: int,
    what: str,
    opts: ConvertOptions,
    tree_of: Callable,
    infos: list | None,
    policy_id: str | None = None,
) -> _Block:
    cols = _rename(cols, opts.schema)
    if "terminateds" not in cols and "dones" in cols:
        cols["terminateds"] = cols.pop("dones")
    missing = [k for k in ("eps_id", "obs", "actions", "rewards", "new_obs") if k not in cols]
    if "terminateds" not in cols and "truncateds" not in cols:
        missing.append("terminateds/truncateds")
    if missing:
        raise ConvertError(f"{what}: missing column(s) {missing} (map yours with --schema KEY=COLUMN)")
    arrays = {k: tree_of(cols[k], f"{what}: column {k!r}") for k in _ARRAY_KEYS}
    columns: dict[str, np.ndarray] = {}
    for k in ("eps_id", "agent_id", "module_id"):
        if k in cols:
            columns[k] = np.asarray(cols[k], dtype=object)
    for k in ("rewards", "terminateds", "truncateds", "t", *_VERSION_COLUMNS):
        if k in cols:
            a = tree_of(cols[k], f"{what}: column {k!r}")
            if not isinstance(a, np.ndarray) or a.ndim != 1:
                raise ConvertError(f"{what}: column {k!r} must hold one number per row")
            columns[k] = a
    for k, v in list(arrays.items()) + list(columns.items()):
        got = len(_tree_leaves(v)[0]) if not isinstance(v, np.ndarray) else len(v)
        if got != n:
            raise ConvertError(f"{what}: column {k!r} has {got} rows, expected {n}")
    extras: dict[str, np.ndarray] = {}
    known = set(SCHEMA_KEYS) | _IGNORED | set(opts.schema.values())
    notes: list[str] = []
    for k, v in cols.items():
        if k in known:
            continue
        typ = v.type if isinstance(v, (pa.Array, pa.ChunkedArray)) else None
        if isinstance(v, str) or (
            typ is not None
            and (
                pa.types.is_string(typ)
                or pa.types.is_binary(typ)
                or pa.types.is_large_string(typ)
                or pa.types.is_large_binary(typ)
            )
        ):
            notes.append(f"column {k!r} holds strings, not numbers; not kept")
            continue
        try:
            a = tree_of(v, f"{what}: column {k!r}")
        except UnsafeInputError:
            raise
        except ConvertError as e:
            notes.append(f"column {k!r} is not kept as an extra model output ({e})")
            continue
        if isinstance(a, np.ndarray) and len(a) == n and a.dtype.kind in "biuf":
            extras[k] = a
        else:
            notes.append(f"column {k!r} is not one numeric value or array per row; not kept")
    return _Block(n=n, arrays=arrays, columns=columns, infos=infos, extras=extras, policy_id=policy_id, notes=notes)


def _parquet_blocks(fs: pafs.FileSystem, path: str, opts: ConvertOptions) -> Iterator[_Block]:
    with fs.open_input_file(path) as f:
        try:  # the schema gate, before any column is read
            table = open_legacy_tabular(f, allow_pickle=opts.allow_pickle).read()
        except ShardSchemaError as e:
            raise (UnsafeInputError if PICKLED_OBJECT_EXTENSION in e.reason else ConvertError)(
                f"{path}: cannot read: {e.reason}"
            ) from None
    what = path.rsplit("/", 1)[-1]
    cols: dict[str, Any] = {name: table.column(name) for name in table.column_names}
    for k in ("eps_id", "agent_id", "module_id"):
        key = opts.schema.get(k, k)
        if key in cols:
            cols[key] = [None if v is None else str(v) for v in cols[key].to_pylist()]
    infos = None
    key = opts.schema.get("infos", "infos")
    if key in cols:
        infos = [_info(v, what) for v in cols.pop(key).to_pylist()]
    tree_of = lambda v, w: _arrow_tree(v, w, opts.allow_pickle)  # noqa: E731
    b = _block(cols, table.num_rows, what, opts, tree_of, infos)
    meta = table.schema.metadata or {}
    for key, name in ((b"rlrec.observation_space", "obs"), (b"rlrec.action_space", "actions")):
        if key in meta:
            b.spaces[name] = loads_space(meta[key])
    yield b


def _info(v: Any, what: str) -> dict:
    if v is None or v == "":
        return {}
    if isinstance(v, dict):
        return v
    if isinstance(v, list):  # a Parquet map column
        return dict(v)
    if isinstance(v, (str, bytes)):
        from rlrec.producer.events import loads_info

        try:
            return loads_info(v.decode() if isinstance(v, bytes) else v)
        except Exception as e:
            raise ConvertError(f"{what}: an infos value is not a JSON object: {e}") from None
    raise ConvertError(f"{what}: an infos value is a {type(v).__name__}, expected a dict")


def _json_blocks(fs: pafs.FileSystem, path: str, opts: ConvertOptions) -> Iterator[_Block]:
    name = path.rsplit("/", 1)[-1]
    with fs.open_input_stream(path) as f:
        text = f.read().decode("utf-8", errors="strict")
    tree_of = lambda v, w: _json_tree(v, w, opts.allow_pickle)  # noqa: E731
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        what = f"{name}:{lineno}"
        try:
            d = json.loads(line)
        except ValueError as e:
            raise ConvertError(f"{what}: not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConvertError(f"{what}: expected a JSON object (a SampleBatch), got {type(d).__name__}")
        kind = d.get("type", "SampleBatch")
        if kind == "MultiAgentBatch":
            batches = d.get("policy_batches")
            if not isinstance(batches, dict):
                raise ConvertError(f"{what}: MultiAgentBatch without policy_batches")
            items = [(pid, b) for pid, b in batches.items()]
        elif kind == "SampleBatch":
            items = [(None, d)]
        else:
            raise ConvertError(f"{what}: unknown batch type {kind!r}")
        for pid, b in items:
            if not isinstance(b, dict):
                raise ConvertError(f"{what}: a batch must be a JSON object")
            cols = {k: v for k, v in b.items() if k != "type"}
            ekey = opts.schema.get("eps_id", "eps_id")
            if ekey not in cols:
                raise ConvertError(f"{what}: missing column 'eps_id' (map yours with --schema KEY=COLUMN)")
            eps = cols[ekey]
            if isinstance(eps, str):
                eps = _unpack_rllib(eps, f"{what}: column 'eps_id'", opts.allow_pickle).tolist()
            if not isinstance(eps, list):
                raise ConvertError(f"{what}: column 'eps_id' must be a list")
            cols[ekey] = [str(e) for e in eps]
            infos = None
            ikey = opts.schema.get("infos", "infos")
            if ikey in cols:
                raw = cols.pop(ikey)
                if not isinstance(raw, list):
                    raise ConvertError(f"{what}: column 'infos' must be a list of objects")
                infos = [_info(v, what) for v in raw]
            yield _block(cols, len(eps), what, opts, tree_of, infos, policy_id=pid)


def read_rows(input_uri: str, opts: ConvertOptions, progress: Progress | None = None) -> tuple[list[_Block], int]:
    """Read every input file into row blocks. Returns (blocks, number of files)."""
    if opts.input_format == "tabular":
        fs, paths = _files(input_uri, (".parquet",))
        try:  # registers Ray's tensor extension types, so their shapes are read (ray.rllib loads it anyway)
            import ray.data.extensions  # noqa: F401
        except ImportError:
            pass
        reader = _parquet_blocks
    elif opts.input_format == "sample-batch":
        fs, paths = _files(input_uri, (".json", ".jsonl"))
        reader = _json_blocks
    else:
        raise ConvertError(f"input format must be one of {INPUT_FORMATS}, got {opts.input_format!r}")
    blocks: list[_Block] = []
    for i, p in enumerate(paths):
        try:
            blocks.extend(reader(fs, p, opts))
        except (pa.ArrowInvalid, OSError) as e:
            raise ConvertError(f"{p}: cannot read: {e}") from None
        if progress:
            progress("read", i + 1, len(paths))
    if not blocks:
        raise ConvertError(f"no rows in {input_uri}")
    return blocks, len(paths)


# ---------------------------------------------------------------------------------------------
# rows -> episodes


def _space_for(key: str, given: gym.Space | None, blocks: list[_Block], tree: Any) -> gym.Space:
    if given is not None:
        return given
    from_meta = {dumps_space(b.spaces[key]) for b in blocks if key in b.spaces}
    if len(from_meta) == 1 and all(key in b.spaces for b in blocks):
        return blocks[0].spaces[key]
    return _infer_space(tree, f"column {key!r}")


def _same_rows(arrays: list[np.ndarray], a: np.ndarray, b: np.ndarray) -> bool:
    return all(np.array_equal(x[a], x[b]) for x in arrays)


@dataclass
class _Rows:
    """Every input row: the blocks' columns concatenated in input order (row i is at input offset i)."""

    observation_space: gym.Space
    action_space: gym.Space
    obs: list[np.ndarray]  # leaves, cast to the observation space
    new_obs: list[np.ndarray]
    actions: list[np.ndarray]  # leaves, cast to the action space
    eps: np.ndarray  # episode ids (object)
    rewards: np.ndarray  # float64
    term: np.ndarray  # bool
    trunc: np.ndarray  # bool
    t: np.ndarray | None
    agent: np.ndarray | None
    module: np.ndarray | None
    versions: np.ndarray | None  # policy_version, else weights_seq_no
    block_pid: np.ndarray  # a MultiAgentBatch's key per row, else None
    infos: list[dict] | None
    extras: dict[str, np.ndarray]
    done: np.ndarray = field(init=False)  # term | trunc
    compare: list[np.ndarray] = field(init=False)  # what two copies of a row must agree on

    def __post_init__(self) -> None:
        self.done = self.term | self.trunc
        self.compare = [*self.obs, *self.actions, self.rewards]


def _check_incomplete_option(incomplete: str) -> None:
    if incomplete not in ("drop", "truncate", "error"):
        raise ConvertError(f"incomplete must be drop, truncate or error, got {incomplete!r}")


def _merge_notes(blocks: list[_Block], notes: list[str]) -> None:
    """Append the blocks' notes to `notes`, each note once."""
    for b in blocks:
        for x in b.notes:
            if x not in notes:
                notes.append(x)


def _choose_spaces(blocks: list[_Block], opts: ConvertOptions, trees: dict[str, Any]) -> tuple[gym.Space, gym.Space]:
    """(observation space, action space): given, from the files' metadata, or inferred from the data."""
    obs_space = _space_for("obs", opts.observation_space, blocks, _tree_concat([trees["obs"], trees["new_obs"]], "obs"))
    act_space = _space_for("actions", opts.action_space, blocks, trees["actions"])
    return obs_space, act_space


def _concat_column(blocks: list[_Block], k: str, default: Any = None) -> np.ndarray | None:
    """Column `k` of every block; None if no block has it. Blocks without it get `default` (None: an error)."""
    parts = [b.columns.get(k) for b in blocks]
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        if default is None:
            raise ConvertError(f"column {k!r} is in some input files only")
        parts = [p if p is not None else np.full(b.n, default) for p, b in zip(parts, blocks)]
    return np.concatenate(parts)


def _flag_column(blocks: list[_Block], k: str) -> np.ndarray:
    """A bool column (terminateds/truncateds); False where absent."""
    a = _concat_column(blocks, k, False)
    return np.zeros(sum(b.n for b in blocks), bool) if a is None else a.astype(bool)


def _version_column(blocks: list[_Block]) -> np.ndarray | None:
    """The first of the policy version columns that the input has."""
    return next((v for v in (_concat_column(blocks, k) for k in _VERSION_COLUMNS) if v is not None), None)


def _concat_infos(blocks: list[_Block]) -> list[dict] | None:
    """Every row's info ({} in blocks without infos); None if no block has infos."""
    if not any(b.infos is not None for b in blocks):
        return None
    return [i for b in blocks for i in (b.infos if b.infos is not None else [{}] * b.n)]


def _concat_extras(blocks: list[_Block], notes: list[str]) -> dict[str, np.ndarray]:
    """Extra model outputs in every block with one shape/dtype; the others are dropped (noted)."""
    keys: list[str] = []
    for b in blocks:
        keys.extend(k for k in b.extras if k not in keys)
    extras: dict[str, np.ndarray] = {}
    for k in keys:
        parts = [b.extras.get(k) for b in blocks]
        shapes = {(p.shape[1:], p.dtype) for p in parts if p is not None}
        if any(p is None for p in parts) or len(shapes) != 1:
            notes.append(f"extra column {k!r} is not in every input file with one shape/dtype; dropped")
            continue
        extras[k] = np.concatenate(parts)
    return extras


def _gather_rows(blocks: list[_Block], opts: ConvertOptions, result: ConvertResult) -> _Rows:
    """Concatenate the blocks; choose the spaces (set on `result`) and cast obs/new_obs/actions to them."""
    trees = {k: _tree_concat([b.arrays[k] for b in blocks], f"column {k!r}") for k in _ARRAY_KEYS}
    obs_space, act_space = _choose_spaces(blocks, opts, trees)
    result.observation_space, result.action_space = obs_space, act_space
    return _Rows(  # arguments are evaluated in this order (it decides which error comes first)
        observation_space=obs_space,
        action_space=act_space,
        obs=_fit_leaves(trees["obs"], obs_space, "obs"),
        new_obs=_fit_leaves(trees["new_obs"], obs_space, "new_obs"),
        actions=_fit_leaves(trees["actions"], act_space, "actions"),
        eps=_concat_column(blocks, "eps_id"),
        rewards=_concat_column(blocks, "rewards").astype(np.float64),
        term=_flag_column(blocks, "terminateds"),
        trunc=_flag_column(blocks, "truncateds"),
        t=_concat_column(blocks, "t"),
        agent=_concat_column(blocks, "agent_id"),
        module=_concat_column(blocks, "module_id"),
        versions=_version_column(blocks),
        block_pid=np.concatenate([np.full(b.n, b.policy_id, dtype=object) for b in blocks]),
        infos=_concat_infos(blocks),
        extras=_concat_extras(blocks, result.notes),
    )


def _group_by_episode(eps: np.ndarray) -> dict[str, np.ndarray]:
    """Row indices of each episode id, in input order; episodes in order of their first row."""
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(eps):
        if e is None:
            raise ConvertError(f"row {i}: eps_id is null")
        groups.setdefault(e, []).append(i)
    return {e: np.asarray(rows, dtype=np.int64) for e, rows in groups.items()}


def _drop_repeated_t(
    eid: str, idx: np.ndarray, ts: np.ndarray, compare: list[np.ndarray], result: ConvertResult
) -> np.ndarray:
    """Rows `idx` sorted by t (`ts`): a row with the t of the row before must equal it and is dropped (counted)."""
    dup = np.concatenate([[False], ts[1:] == ts[:-1]])
    if not dup.any():
        return idx
    for j in np.flatnonzero(dup):
        first = idx[np.searchsorted(ts, ts[j])]
        if not _same_rows(compare, np.array([first]), np.array([idx[j]])):
            raise ConvertError(f"episode {eid}: two different rows for t={ts[j]}")
    result.duplicate_rows += int(dup.sum())
    return idx[~dup]


def _check_no_gaps(eid: str, ts: np.ndarray) -> None:
    if len(ts) > 1 and not (np.diff(ts) == 1).all():
        gap = int(ts[np.flatnonzero(np.diff(ts) != 1)[0]])
        raise ConvertError(f"episode {eid}: steps are missing after t={gap}")


def _order_by_t(
    eid: str, idx: np.ndarray, t: np.ndarray, compare: list[np.ndarray], result: ConvertResult
) -> np.ndarray:
    """Sort by t (stable), drop rows repeated with the same t, refuse gaps in t."""
    idx = idx[np.argsort(t[idx], kind="stable")]
    idx = _drop_repeated_t(eid, idx, t[idx], compare, result)
    _check_no_gaps(eid, t[idx])
    return idx


def _drop_repeated_copies(
    idx: np.ndarray, done: np.ndarray, compare: list[np.ndarray], result: ConvertResult
) -> np.ndarray:
    """Without t: rows holding the same complete sequence k times (each copy ends at a done row) keep one copy."""
    ends = np.flatnonzero(done[idx])
    if (
        len(ends) > 1
        and ends[-1] == len(idx) - 1
        and len(idx) % len(ends) == 0
        and (ends + 1 == np.arange(1, len(ends) + 1) * (len(idx) // len(ends))).all()
    ):
        L = len(idx) // len(ends)
        copies = [idx[c * L : (c + 1) * L] for c in range(len(ends))]
        if all(_same_rows(compare, copies[0], c) for c in copies[1:]):
            result.duplicate_rows += len(idx) - L
            return copies[0]
    return idx


def _episode_rows(eid: str, idx: np.ndarray, rows: _Rows, result: ConvertResult) -> np.ndarray:
    """The episode's rows in order, each once: ordered by t if there is a t column, else in input order."""
    if rows.t is not None:
        return _order_by_t(eid, idx, rows.t, rows.compare, result)
    return _drop_repeated_copies(idx, rows.done, rows.compare, result)


def _check_ends_last(eid: str, idx: np.ndarray, done: np.ndarray) -> None:
    if done[idx][:-1].any():
        raise ConvertError(f"episode {eid}: rows after its terminal row (episode ids reused?)")


def _check_single_agent(eid: str, idx: np.ndarray, agent: np.ndarray | None) -> None:
    if agent is not None and len({a for a in agent[idx] if a is not None}) > 1:
        raise ConvertError(f"episode {eid}: several agent_id values; multi-agent recordings are not supported")


def _end_flags(
    eid: str, idx: np.ndarray, rows: _Rows, incomplete: str, result: ConvertResult
) -> tuple[bool, bool] | None:
    """(terminated, truncated) of the last row; without an end: refused, dropped (None) or truncated (counted)."""
    terminated, truncated = bool(rows.term[idx[-1]]), bool(rows.trunc[idx[-1]])
    if terminated or truncated:
        return terminated, truncated
    if incomplete == "error":
        raise ConvertError(f"episode {eid} has no terminal row (use incomplete=drop or truncate)")
    if incomplete == "drop":
        result.incomplete_dropped += 1
        return None
    result.incomplete_truncated += 1
    return False, True


def _is_discontinuous(idx: np.ndarray, rows: _Rows) -> bool:
    """Some row's obs differs from the previous row's new_obs (rows missing or out of order)."""
    return len(idx) > 1 and not all(np.array_equal(o[idx[1:]], no[idx[:-1]]) for o, no in zip(rows.obs, rows.new_obs))


def _policy_id(idx: np.ndarray, rows: _Rows, opts: ConvertOptions) -> str:
    """The option, else the first row's module_id, else its MultiAgentBatch key, else the default; must name a dir."""
    pid = opts.policy_id
    if pid is None:
        first = idx[0]
        pid = next(
            (
                str(x)
                for x in (rows.module[first] if rows.module is not None else None, rows.block_pid[first])
                if x is not None
            ),
            DEFAULT_POLICY_ID,
        )
    if not POLICY_ID_RE.match(pid):  # the consumer's rule for policy ids (docs/FORMAT.md)
        raise ConvertError(f"policy id {pid!r} cannot name a directory; pass --policy-id")
    return pid


def _policy_version(idx: np.ndarray, rows: _Rows, opts: ConvertOptions) -> int:
    """The option, else the first row's policy_version/weights_seq_no, else 0."""
    if opts.policy_version is not None:
        return int(opts.policy_version)
    if rows.versions is not None:
        return int(rows.versions[idx[0]])
    return 0


def _build_episode(
    eid: str, idx: np.ndarray, rows: _Rows, opts: ConvertOptions, terminated: bool, truncated: bool
) -> FinishedEpisode:
    """Observations are every row's obs plus the last row's new_obs; infos[0] = {}; offsets are input positions."""
    pid = _policy_id(idx, rows, opts)
    version = _policy_version(idx, rows, opts)
    last = idx[-1:]
    infos = [rows.infos[i] for i in idx] if rows.infos is not None else [{} for _ in range(len(idx))]
    return FinishedEpisode(
        episode_id=str(eid),
        policy_id=pid,
        policy_version=version,
        env_id=opts.env_id,
        observation_space=rows.observation_space,
        action_space=rows.action_space,
        observations=[np.concatenate([o[idx], no[last]]) for o, no in zip(rows.obs, rows.new_obs)],
        actions=[a[idx] for a in rows.actions],
        rewards=rows.rewards[idx],
        infos=[{}, *infos],
        extra_model_outputs={k: v[idx] for k, v in rows.extras.items()},
        terminated=terminated,
        truncated=truncated,
        first_offset=int(idx.min()),
        last_offset=int(idx.max()),
        started_ms=0,
        ended_ms=0,
    )


def _note_discontinuous(result: ConvertResult) -> None:
    if result.discontinuous:
        result.notes.append(
            f"{result.discontinuous} episode(s) have obs of a row != new_obs of the row before "
            "(rows missing or out of order?); their observations are the rows' obs plus the last "
            "new_obs"
        )


def rows_to_episodes(blocks: list[_Block], opts: ConvertOptions, result: ConvertResult) -> list[FinishedEpisode]:
    """Group the rows by episode id, order, deduplicate and build `FinishedEpisode`s."""
    _check_incomplete_option(opts.incomplete)
    result.rows = sum(b.n for b in blocks)
    _merge_notes(blocks, result.notes)
    rows = _gather_rows(blocks, opts, result)
    out: list[FinishedEpisode] = []
    for eid, idx in _group_by_episode(rows.eps).items():
        idx = _episode_rows(eid, idx, rows, result)
        _check_ends_last(eid, idx, rows.done)
        _check_single_agent(eid, idx, rows.agent)
        flags = _end_flags(eid, idx, rows, opts.incomplete, result)
        if flags is None:
            continue  # incomplete, dropped
        if _is_discontinuous(idx, rows):
            result.discontinuous += 1  # the observations are still every row's obs
        out.append(_build_episode(eid, idx, rows, opts, *flags))
    result.episodes = len(out)
    _note_discontinuous(result)
    return out


# ---------------------------------------------------------------------------------------------
# the whole conversion


def convert(
    input_uri: str, output: str | Storage, opts: ConvertOptions, progress: Progress | None = None
) -> ConvertResult:
    """Convert the recordings at `input_uri` into committed episode shards under `output`."""
    result = ConvertResult()
    blocks, result.files = read_rows(input_uri, opts, progress)
    episodes = rows_to_episodes(blocks, opts, result)
    del blocks
    storage = output if isinstance(output, Storage) else Storage.from_uri(output)
    committer = ShardCommitter(storage, opts.topic, 0, fmt="episodes", compression=opts.compression)
    committer.claim()
    todo = [fe for fe in episodes if committer.committed_offset(fe.episode_id) is None]
    result.skipped_committed = len(episodes) - len(todo)
    done = 0
    for start in range(0, len(todo), opts.episodes_per_shard):
        chunk = todo[start : start + opts.episodes_per_shard]
        res = committer.commit(chunk)
        result.shards += res.shards
        result.written_episodes += res.episodes
        result.steps += res.steps
        result.bytes += res.bytes
        result.entries.extend(res.entries)
        done += len(chunk)
        if progress:
            progress("write", done, len(todo))
    # done writing: the partition is free at once for `rlrec compact` (and a consumer)
    release_lease(storage, opts.topic, 0, writer=committer.log.writer_id or "", epoch=committer.epoch)
    return result
