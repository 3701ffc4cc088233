"""The schema gate (rlrec.store.schema_gate): one allow-list, checked before any column is read,
by every reader of shards and legacy data.

Hostile files carry Ray's ``ray.data.arrow_pickled_object`` extension type, whose values run
``touch MARKER`` when read in a process that imported ``ray.data`` (``test_pickled_payloads_are_live``
proves it: the control executes). Each test then checks that the marker does NOT exist after
`rlrec inspect --verify`, `rlrec report`, `rlrec convert` and the shard readers met such a file
(the trainer: tests/test_trainer_hostile.py).  Converting such a column (``as_py()`` of `item`,
``to_pylist()`` of the metadata columns or of ``eps_id``) runs the payload, so the gate must
refuse the file before any of them is read.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("ray.data")
import ray.data  # noqa: F401  (registers Ray's extension types in this process, like the readers do)

from rlrec.store.commit import ShardCommitter
from rlrec.store.schema_gate import (
    PICKLED_OBJECT_EXTENSION,
    ShardSchemaError,
    allow_list_markdown,
    check_legacy_tabular_schema,
    check_shard_schema,
    open_shard,
)
from rlrec.store.shards import encode_shard, read_episodes, read_tabular, shard_metadata
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes
from tests.hostile_shards import hostile_shard, pickled_column, replace_committed, to_parquet

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = [("episodes", "item"), ("episodes", "episode_return"), ("tabular", "obs"), ("tabular", "eps_id")]


def test_pickled_payloads_are_live(tmp_path):
    """Control: reading the column the careless way runs the payload."""
    marker = tmp_path / "pwned"
    col = pickled_column(str(marker), 1)
    col.to_pylist()
    assert marker.exists()


@pytest.mark.parametrize("fmt,column", HOSTILE)
def test_shard_readers_refuse_pickled_columns_before_reading(tmp_path, fmt, column):
    marker = tmp_path / "pwned"
    data = hostile_shard(expert_cartpole_episodes(2, max_steps=20), fmt, column, str(marker))
    with pytest.raises(ShardSchemaError, match=f"column '{column}'.*{PICKLED_OBJECT_EXTENSION}.*executes code"):
        open_shard(data, fmt=fmt)
    with pytest.raises(ShardSchemaError):
        shard_metadata(data)
    with pytest.raises(ShardSchemaError):
        (read_episodes if fmt == "episodes" else read_tabular)(data)
    assert not marker.exists()


def test_good_shards_pass_and_read(tmp_path):
    eps = expert_cartpole_episodes(2, max_steps=20)
    for fmt in ("episodes", "tabular"):
        for multidim in ("nested", "tensor"):
            data = encode_shard(eps, fmt=fmt, multidim=multidim).data
            shard = open_shard(data, fmt=fmt)
            assert (shard.fmt, shard.version, shard.num_rows) == (
                fmt,
                1,
                2 if fmt == "episodes" else sum(len(e.rewards) for e in eps),
            )
    assert len(read_episodes(encode_shard(eps).data)) == 2


def test_a_shard_whose_columns_decode_past_the_limit_is_refused_before_reading(monkeypatch):
    from rlrec.store import schema_gate

    data = encode_shard(expert_cartpole_episodes(2, max_steps=20)).data
    decoded = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0).total_byte_size
    monkeypatch.setattr(schema_gate, "MAX_SHARD_DECODED_BYTES", decoded - 1)
    with pytest.raises(ShardSchemaError, match="refused before reading"):
        open_shard(data, fmt="episodes")
    monkeypatch.setattr(schema_gate, "MAX_SHARD_DECODED_BYTES", decoded)
    assert open_shard(data, fmt="episodes").num_rows == 2


def _dictionary_bomb(rows: int, value_mib: int) -> bytes:
    """A single-agent shard whose `item` is one big value repeated in every row, dictionary
    encoded: a few KB on disk, a footer counting the value once, `rows` x `value_mib` MiB dense."""
    t = pq.read_table(io.BytesIO(encode_shard(expert_cartpole_episodes(1, max_steps=5)).data))
    t = pa.concat_tables([t] * rows)
    t = t.set_column(t.schema.get_field_index("item"), "item", pa.array([b"\0" * (value_mib << 20)] * rows))
    buf = io.BytesIO()
    pq.write_table(t, buf, compression="zstd", dictionary_pagesize_limit=1 << 30, data_page_size=1 << 30)
    return buf.getvalue()


def test_a_dictionary_column_that_expands_past_the_limit_is_refused_before_it_is_decoded():
    import resource

    from rlrec.store import schema_gate

    data = _dictionary_bomb(600, 2)  # 1.2 GiB dense, over MAX_SHARD_DECODED_BYTES (1 GiB)
    shard = open_shard(data, fmt="episodes")
    assert len(data) < 100_000 and shard.decoded_bytes < 10 << 20  # the footer alone lets it through
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for read in (lambda: shard.read(["item"]), lambda: list(shard.row_groups()), lambda: read_episodes(data)):
        with pytest.raises(ShardSchemaError, match=r"dictionary columns are expanded.*MAX_SHARD_DECODED_BYTES"):
            read()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: never decoded dense
    assert schema_gate.MAX_SHARD_DECODED_BYTES == 1 << 30
    # below the limit the same values read (dense), and as a dictionary array when asked
    small = open_shard(_dictionary_bomb(3, 1), fmt="episodes")
    assert small.read(["item"]).column("item").to_pylist() == [b"\0" * (1 << 20)] * 3
    col = small.read(["item"], dictionary=["item"]).column("item")
    assert pa.types.is_dictionary(col.type) and len(col.chunk(0).dictionary) == 1


def test_shards_rlrec_writes_store_item_plain_so_the_gate_reads_nothing_extra():
    for fmt in ("episodes", "tabular"):
        data = encode_shard(expert_cartpole_episodes(3, max_steps=20), fmt=fmt).data
        shard = open_shard(data, fmt=fmt)
        assert "item" not in shard._dictionary
        assert shard.read().num_rows == (3 if fmt == "episodes" else 60)


def _table(fmt: str) -> pa.Table:
    data = encode_shard(expert_cartpole_episodes(1, max_steps=10), fmt=fmt).data
    return pq.read_table(io.BytesIO(data))


def test_the_allow_list_is_exact():
    t = _table("episodes")
    check_shard_schema(t.schema, "episodes")
    with pytest.raises(ShardSchemaError, match="manifest entry says 'tabular'"):
        check_shard_schema(t.schema, "tabular")
    with pytest.raises(ShardSchemaError, match="column 'extra' is not allowed"):
        check_shard_schema(t.append_column("extra", pa.array([1])).schema)
    with pytest.raises(ShardSchemaError, match="type large_binary, expected binary"):
        check_shard_schema(t.set_column(0, "item", t.column("item").cast(pa.large_binary())).schema)
    with pytest.raises(ShardSchemaError, match="needs column"):
        check_shard_schema(t.drop_columns(["item"]).schema)
    with pytest.raises(ShardSchemaError, match=r"unknown shard format.*upgrade rlrec"):
        check_shard_schema(t.schema.with_metadata({b"rlrec.format": b"episodes", b"rlrec.schema_version": b"3"}))
    with pytest.raises(ShardSchemaError, match=r"v2 shard needs column.*multi_agent_record"):  # multi-agent rows
        check_shard_schema(t.schema.with_metadata({b"rlrec.format": b"episodes", b"rlrec.schema_version": b"2"}))
    with pytest.raises(ShardSchemaError, match=r"no rlrec\.format"):
        check_shard_schema(t.schema.with_metadata({}))
    tab = _table("tabular")
    check_shard_schema(tab.schema, "tabular")
    check_shard_schema(tab.append_column("vf_preds", pa.array([0.5] * tab.num_rows, pa.float32())).schema)
    for bad_name in ("dones", "rlrec_tag", "rlrec_anything"):
        with pytest.raises(ShardSchemaError, match="not allowed"):
            check_shard_schema(tab.append_column(bad_name, pa.array([0.5] * tab.num_rows)).schema)
    with pytest.raises(ShardSchemaError, match="not a numeric array type"):
        check_shard_schema(tab.append_column("note", pa.array(["x"] * tab.num_rows)).schema)


def test_unregistered_extension_types_are_refused_too():
    """A type this process does not know shows up as its storage type plus field metadata."""

    class Evil(pa.ExtensionType):
        def __init__(self):
            super().__init__(pa.float32(), "evil.type")

        def __arrow_ext_serialize__(self):
            return b""

        @classmethod
        def __arrow_ext_deserialize__(cls, storage_type, serialized):
            return cls()

    tab = _table("tabular")
    col = pa.ExtensionArray.from_storage(Evil(), pa.array([0.0] * tab.num_rows, pa.float32()))
    meta = tab.schema.metadata
    data = to_parquet(tab.append_column("x", col).replace_schema_metadata(meta))
    schema = pq.read_schema(io.BytesIO(data))
    assert schema.field("x").type == pa.float32()  # not registered here: storage type + metadata
    with pytest.raises(ShardSchemaError, match=r"extension type .evil\.type. is not allowed"):
        check_shard_schema(schema)
    with pytest.raises(ShardSchemaError, match=r"evil\.type"):
        check_legacy_tabular_schema(schema)


def test_unsafe_ray_setting_is_refused(monkeypatch):
    monkeypatch.setenv("RAY_DATA_AUTOLOAD_CLOUDPICKLE_TENSOR_METADATA", "1")
    with pytest.raises(ShardSchemaError, match="unset it"):
        open_shard(encode_shard(expert_cartpole_episodes(1, max_steps=5)).data)


def test_legacy_tabular_allows_pickle_only_on_request(tmp_path):
    tab = _table("tabular")
    check_legacy_tabular_schema(tab.schema)
    hostile = tab.set_column(0, "eps_id", pickled_column(str(tmp_path / "m"), tab.num_rows)).schema
    with pytest.raises(ShardSchemaError, match="--allow-pickle"):
        check_legacy_tabular_schema(hostile)
    check_legacy_tabular_schema(hostile, allow_pickle=True)
    assert not (tmp_path / "m").exists()


# ------------------------------------------------------------------- the commands, end to end


@pytest.fixture
def hostile_output(tmp_path):
    """An output root: 3 good committed shards, then one of each hostile kind with a re-hashed entry."""
    out = tmp_path / "out"
    marker = tmp_path / "pwned"
    storage = Storage.from_uri(str(out))
    for fmt in ("episodes", "tabular"):
        c = ShardCommitter(storage, topic=f"good-{fmt}", fmt=fmt)
        c.commit(expert_cartpole_episodes(2, seed=1, max_steps=30))
    entries = []
    for i, (fmt, column) in enumerate(HOSTILE):
        c = ShardCommitter(storage, topic=f"evil{i}", fmt=fmt)
        eps = expert_cartpole_episodes(2, seed=10 + i, max_steps=30)
        (entry,) = c.commit(eps).entries
        replace_committed(storage, entry, hostile_shard(eps, fmt, column, str(marker)))
        entries.append(entry)
    return out, marker, entries


def test_inspect_verify_reports_refused_shards_and_runs_nothing(hostile_output):
    out, marker, entries = hostile_output
    r = subprocess.run(
        [sys.executable, "-m", "rlrec", "inspect", str(out), "--verify", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    problems = json.loads(r.stdout)["problems"]
    assert len(problems) == len(HOSTILE), problems
    for e in entries:
        assert any(e.path in p and "ShardSchemaError" in p and PICKLED_OBJECT_EXTENSION in p for p in problems)
    assert not marker.exists(), "a pickled payload was executed"


def test_report_skips_refused_shards_and_runs_nothing(hostile_output, tmp_path):
    from rlrec.report import write_report

    out, marker, _ = hostile_output
    html = write_report(None, tmp_path / "r.html", input_uri=str(out)).read_text()
    assert "refused by the schema gate" in html
    assert not marker.exists(), "a pickled payload was executed"


def test_docs_format_md_schema_table_is_current():
    doc = (ROOT / "docs" / "FORMAT.md").read_text()
    begin, end = "<!-- schema-gate:begin -->\n", "<!-- schema-gate:end -->"
    assert begin in doc and end in doc, "docs/FORMAT.md lacks the generated schema-gate table"
    current = doc.split(begin, 1)[1].split(end, 1)[0]
    if current != allow_list_markdown():
        pytest.fail(
            "docs/FORMAT.md's schema table is stale: refresh it with "
            "`python -m rlrec.store.schema_gate --update docs/FORMAT.md` and commit it"
        )


@pytest.mark.parametrize("column", ["eps_id", "obs", "infos"])
def test_convert_without_allow_pickle_never_unpickles(tmp_path, column):
    """A legacy RLlib tabular recording with a pickled-object column (any name): refused before a
    value is read (``to_pylist()`` of such a column runs the payload)."""
    from rlrec.consumer.convert import ConvertOptions, UnsafeInputError, convert

    marker = tmp_path / "pwned"
    inp = tmp_path / "in"
    inp.mkdir()
    tab = _table("tabular").replace_schema_metadata(None)  # a legacy file: no rlrec metadata
    if column == "infos":
        tab = tab.append_column("infos", pickled_column(str(marker), tab.num_rows))
    else:
        tab = tab.set_column(tab.column_names.index(column), column, pickled_column(str(marker), tab.num_rows))
    (inp / "part-0.parquet").write_bytes(to_parquet(tab))
    with pytest.raises(UnsafeInputError, match=r"ray\.data\.arrow_pickled_object.*--allow-pickle"):
        convert(str(inp), str(tmp_path / "out"), ConvertOptions(input_format="tabular"))
    assert not marker.exists(), "a pickled payload was executed"


def test_convert_with_allow_pickle_reads_pickled_columns(tmp_path):
    """With --allow-pickle (trusted data) a Ray pickled-object column is read: infos as dicts."""
    from ray.data._internal.object_extensions.arrow import ArrowPythonObjectArray

    from rlrec.consumer.convert import ConvertOptions, convert

    inp = tmp_path / "in"
    inp.mkdir()
    tab = _table("tabular").replace_schema_metadata(None)
    infos = ArrowPythonObjectArray.from_objects([{"step": i} for i in range(tab.num_rows)])
    (inp / "part-0.parquet").write_bytes(to_parquet(tab.append_column("infos", infos)))
    res = convert(str(inp), str(tmp_path / "out"), ConvertOptions(input_format="tabular", allow_pickle=True))
    assert res.written_episodes == 1
    (ep,) = read_episodes(Storage.from_uri(str(tmp_path / "out")).read(res.entries[0].path))
    assert ep.infos[1] == {"step": 0}
