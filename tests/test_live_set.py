"""Live sets (`rlrec.store.live_set`): a reader at the head reads a log's live set and what follows
it, and sees exactly what the whole history says -- across commits, compaction, retention and gc,
after a kill -9 of the writer around the live set's write, and whatever bytes the live set holds.
Real local storage; the writer is killed with SIGKILL in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

from rlrec.store import live_set_file, manifest_entries
from rlrec.store.commit import ShardCommitter
from rlrec.store.compaction import compact_partition
from rlrec.store.live_set import (
    head_shards,
    live_set_path,
    live_set_seqs,
    parse_live_set,
    read_heads,
    read_live_set,
    write_live_set,
)
from rlrec.store.maintenance import gc, verify
from rlrec.store.manifest import PartitionLog, UnsupportedManifestError, live_shards, read_manifest
from rlrec.store.retention import read_removals, resolve_removals, retain
from rlrec.store.snapshot import ExpiredPointError, open_snapshot
from rlrec.trainer.synthetic import expert_cartpole_episodes

ROOT = Path(__file__).resolve().parent.parent


def _commit(c: ShardCommitter, n: int, seed: int) -> list[str]:
    ids = []
    for i in range(n):
        ids += [fe.episode_id for fe in c.commit(expert_cartpole_episodes(2, seed=seed + i, max_steps=20)).written]
    return ids


def _commit_settled(c: ShardCommitter, n: int, seed: int) -> list[str]:
    """`_commit`, one shard at a time, each followed by the end of the writer's background build
    of its first live set if one started: what a writer wrote no longer depends on when that
    thread got the CPU (a busy machine runs it commits later)."""
    ids = []
    for i in range(n):
        ids += _commit(c, 1, seed + i)
        if c.log._live_builder is not None:
            c.log._live_builder.join(60)
            assert not c.log._live_builder.is_alive()
    return ids


def _history_head(st) -> list[tuple]:
    """The live shards at the head as the whole history says (records, then every entry)."""
    from rlrec.store.manifest import list_partition_logs

    records = read_removals(st)
    logs = {k: PartitionLog(st, *k).load() for k in list_partition_logs(st)}
    removed = resolve_removals(records, logs)
    return sorted(_key(s) for k, es in logs.items() for s in live_shards(es).values() if (*k, s.seq) not in removed)


def _key(s) -> tuple:
    return (s.topic, s.partition, s.seq, s.path, s.staging_path, s.sha256, s.episodes, s.steps, s.bytes, s.commit_time)


def _assert_head_is_history(root: str, *, through_live_set: bool) -> None:
    """`rlrec.open` at the head, `read_manifest` and the full-history reader at the same cursor
    name the same shards and read the same rows."""
    head = open_snapshot(root)
    st = head.storage
    heads, _, _ = read_heads(st)
    assert all((h.live_set is not None) == through_live_set for h in heads.values()), heads
    want = _history_head(st)
    assert sorted(_key(s) for s in head.entries) == want
    assert sorted(_key(s) for s in read_manifest(st)) == want
    full = open_snapshot(root, as_of=head.cursor)  # a cursor: the whole history is read
    assert full.cursor == head.cursor
    assert sorted(_key(s) for s in full.entries) == want
    assert head.steps().equals(full.steps())


def test_head_through_live_sets_is_the_history_across_commits_compaction_retention_and_gc(tmp_path):
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    c.log.live_set_every = 5  # the writer writes one every 5 entries (at a snapshot)
    _commit(c, 12, 0)
    assert live_set_seqs(c.storage, "rl", 0), "the writer wrote no live set"
    _assert_head_is_history(root, through_live_set=True)
    early = open_snapshot(root)
    compact_partition(c.log, min_age_s=0, target_bytes=3 * max(e.bytes for e in read_manifest(c.storage)))
    _assert_head_is_history(root, through_live_set=True)  # the replace entries follow the live set
    write_live_set(c.storage, "rl", 0, writer="test")
    _assert_head_is_history(root, through_live_set=True)
    res = retain(c.storage, grace_s=0)  # removes the replaced files: records after the live set
    assert res.recorded
    _assert_head_is_history(root, through_live_set=True)
    _commit(c, 2, 100)
    res = retain(c.storage, grace_s=0, older_than_s=0)  # every live shard expires, the live set's too
    assert res.recorded
    _assert_head_is_history(root, through_live_set=True)
    assert open_snapshot(root).entries == []  # no removed shard comes back
    write_live_set(c.storage, "rl", 0, writer="test")  # folds the records
    assert read_live_set(c.storage, "rl", 0).removals > 0
    _commit(c, 3, 200)  # never hidden by the live set before them
    _assert_head_is_history(root, through_live_set=True)
    assert len(open_snapshot(root).entries) == 3
    gc(c.storage, 0)
    _assert_head_is_history(root, through_live_set=True)
    assert verify(c.storage) == []
    # a point before the live sets reads as it did, through the whole history
    with pytest.raises(ExpiredPointError):
        open_snapshot(root, as_of=early.cursor).steps()


def test_a_head_snapshots_entries_behave_as_the_list_they_were(tmp_path):
    """Read through a live set, `Snapshot.entries` builds its entries lazily but still works as
    the list it was: concatenated either way, copied, sliced, compared (a list of entries read
    earlier + the head's entries raised TypeError)."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    _commit(c, 4, 0)
    write_live_set(c.storage, "rl", 0)
    _commit(c, 1, 10)
    head = open_snapshot(root).entries
    plain = list(head)
    assert type(head) is not list and len(plain) == 5
    assert head + head == plain + plain and plain[:1] + head == plain[:1] + plain
    assert head.copy() == plain and head[1:3] == plain[1:3] and head == plain


def test_an_older_cursor_reads_the_same_after_live_sets(tmp_path):
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    _commit(c, 4, 0)
    before = open_snapshot(root)
    rows = before.steps()
    _commit(c, 4, 10)
    write_live_set(c.storage, "rl", 0)
    _commit(c, 1, 20)
    again = open_snapshot(root, as_of=before.cursor)
    assert again.entries == before.entries  # with their episode ids: read from the history
    assert again.steps().equals(rows)
    head = open_snapshot(root)
    assert head.changes(before.cursor).num_episodes == 10  # `changes` reads the history it needs


def test_two_partitions_one_without_a_live_set(tmp_path):
    root = str(tmp_path / "out")
    a = ShardCommitter(root, "rl", 0, snapshot_every=3)
    b = ShardCommitter(root, "rl", 1, snapshot_every=3)
    _commit(a, 3, 0)
    _commit(b, 3, 10)
    write_live_set(a.storage, "rl", 0)
    _commit(a, 1, 20)
    heads, _, _ = read_heads(a.storage)
    assert heads[("rl", 0)].live_set is not None and heads[("rl", 1)].live_set is None
    head = open_snapshot(root)
    assert sorted(_key(s) for s in head.entries) == _history_head(a.storage)
    assert head.cursor == open_snapshot(root, as_of=head.cursor).cursor


# -- hostile and stale live sets ------------------------------------------------------------------


def _store_with_live_set(tmp_path):
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    _commit(c, 4, 0)
    ls = write_live_set(c.storage, "rl", 0)
    _commit(c, 1, 10)
    return root, c, ls


def _doc(ls) -> dict:
    """A live set as its header's fields and its rows (``"shards"``: column -> value), to forge
    (without retention's columns: `tests/test_live_set_retention.py` forges those)."""
    header, columns = live_set_file._open_checked(ls.to_bytes(), ls.seq)
    header = {k: v for k, v in header.items() if k not in live_set_file.RETENTION_FIELDS}
    return {**header, "shards": pa.table({k: columns[k] for k in _TYPES}).to_pylist()}


_TYPES = {n: t for n, t, _ in live_set_file.COLUMNS}


def _encode(doc: dict, types: dict | None = None, rows: int | None = None) -> bytes:
    """A live set file of `doc` (as `_doc` gives), its columns of `types` (name -> Arrow type;
    None drops a column), its header's row count `rows` (default: the rows')."""
    types = {**_TYPES, **(types or {})}
    head = {k: v for k, v in doc.items() if k != "shards"}
    cols = {n: pa.array([r.get(n) for r in doc["shards"]], t) for n, t in types.items() if t is not None}
    return live_set_file.encode_columns(head, cols, len(doc["shards"]) if rows is None else rows)


def _raw_header(header: bytes) -> bytes:
    """A live set file holding only `header` (bytes) as its header."""
    return live_set_file.pack(header + len(header).to_bytes(4, "little"))


def _patched(data: bytes, change) -> bytes:
    """A live set file of `data` after `change(header, body)` (its header as a dict and its
    column buffers as a bytearray, changed in place)."""
    payload = bytearray(live_set_file.unpack(data))
    n = int.from_bytes(payload[-4:], "little")
    head, body = json.loads(bytes(payload[-4 - n : -4])), payload[: -4 - n]
    change(head, body)
    h = json.dumps(head).encode()
    return live_set_file.pack(bytes(body) + h + len(h).to_bytes(4, "little"))


def _bytes(doc_or_bytes) -> bytes:
    return doc_or_bytes if isinstance(doc_or_bytes, bytes) else _encode(doc_or_bytes)


def _plant(c, doc_or_bytes, seq: int | None = None) -> None:
    """Plant a newer live set than the real one (seq defaults to one above the newest)."""
    seq = (max(live_set_seqs(c.storage, "rl", 0)) + 1) if seq is None else seq
    c.storage.write(live_set_path("rl", 0, seq), _bytes(doc_or_bytes))


def _not_utf8(doc: dict, column: str) -> bytes:
    """A live set of `doc` whose first row's `column` is bytes that are not UTF-8."""
    head = {k: v for k, v in doc.items() if k != "shards"}
    cols = {n: pa.array([r.get(n) for r in doc["shards"]], t) for n, t in _TYPES.items()}
    values = [v.encode() for v in cols[column].to_pylist()]
    values[0] = b"\xff" + values[0]
    cols[column] = pa.array(values, pa.binary()).view(pa.string())
    return live_set_file.encode_columns(head, cols, len(doc["shards"]))


def _set_buffer(column: str, i: int, value) -> callable:
    def change(head, body):
        head["buffers"][column][i] = value

    return change


def _swap_offsets(head, body) -> None:
    """The name column's offsets 1 and 2 swapped (not monotone)."""
    off = head["buffers"]["name"][1][0]
    a, b = body[off + 4 : off + 8], body[off + 8 : off + 12]
    body[off + 4 : off + 8], body[off + 8 : off + 12] = b, a


def _last_offset_past_data(head, body) -> None:
    off, size = head["buffers"]["name"][1]
    body[off + size - 4 : off + size] = (2**30).to_bytes(4, "little")


def _hostile_docs(ls, seq: int) -> dict[str, object]:
    """Live sets to plant at `seq`, each wrong in one way."""
    d = {**_doc(ls), "seq": seq}
    head = {k: v for k, v in d.items() if k != "shards"}
    rows = d["shards"]
    row = rows[0]
    honest = _encode(d)
    raw = int.from_bytes(honest[8:16], "little")
    rows_at = {k: (lambda v, k=k: {**d, "shards": [{**row, k: v}, *rows[1:]]}) for k in row}
    return {
        "torn": honest[:-40],
        "truncated to its first half": honest[: len(honest) // 2],
        "not a live set file": b"\x00\xff" * 10,
        "empty": b"",
        "a Parquet file": b"PAR1" + b"\x00" * 40 + b"PAR1",
        "raw length over what its seq allows": honest[:8] + (2**40).to_bytes(8, "little") + honest[16:],
        "raw length below its frame's": honest[:8] + (raw - 1).to_bytes(8, "little") + honest[16:],
        "raw length above its frame's": honest[:8] + (raw + 1).to_bytes(8, "little") + honest[16:],
        "a frame of 64 MiB of zeros": honest[:16] + pa.Codec("zstd").compress(bytes(64 << 20), asbytes=True),
        "header not JSON": _raw_header(b"\x00{"),
        "header a list": _raw_header(b"[1, 2]"),
        "header JSON nested too deep": _raw_header(b"[" * 60_000),
        "header over 64 KiB": _raw_header(json.dumps({**head, "writer": "w" * 70_000}).encode()),
        "column buffers cut off": _patched(honest, lambda h, b: b.clear()),
        "newer format": {**d, "manifest_version": 5},
        "another log": {**d, "partition": 1},
        "seq not the file's": {**d, "seq": ls.seq},
        "bool seq": {**d, "seq": True},
        "bool partition": {**d, "partition": False},
        "unknown field": {**d, "extra": 1},
        "missing field": {k: v for k, v in d.items() if k != "first"},
        "negative removals": {**d, "removals": -1},
        "huge first": {**d, "first": "x" * 5000},
        "time too large for a float": {**d, "time": 10**400},
        "infinite time": _patched(honest, lambda h, b: h.update(time=float("inf"))),
        "more rows than entries below its seq": {**d, "shards": [{**row, "seq": i % seq} for i in range(seq + 1)]},
        "row at or above its seq": rows_at["seq"](seq),
        "negative row seq": rows_at["seq"](-1),
        "rows out of order": {**d, "shards": rows[::-1]},
        "row twice": {**d, "shards": [row, row]},
        "row name outside its policy": rows_at["name"]("../../etc/passwd"),
        "row name a path": rows_at["name"]("a/b.parquet"),
        "row name hidden": rows_at["name"](".b.parquet"),
        "row name reserved": rows_at["name"]("_staging"),
        "row name empty": rows_at["name"](""),
        "row name with a NUL": rows_at["name"]("a\x00b.parquet"),
        "row name with a newline": rows_at["name"]("a\nb.parquet"),
        "row policy not a policy id": rows_at["policy_id"](".."),
        "row sha256 not hex": rows_at["sha256"]("g" * 64),
        "row format empty": rows_at["format"](""),
        "row epoch 0": rows_at["epoch"](0),
        "row negative bytes": rows_at["bytes"](-1),
        "row negative steps": rows_at["steps"](-5),
        "row negative decoded_bytes": rows_at["decoded_bytes"](-1),
        "row negative resume_offset": rows_at["resume_offset"](-1),
        "row first_offset above last_offset": rows_at["first_offset"](row["last_offset"] + 1),
        "row NaN commit_time": rows_at["commit_time"](float("nan")),
        "row infinite commit_time": rows_at["commit_time"](float("inf")),
        "row event_schema_versions not JSON": rows_at["event_schema_versions"]("{"),
        "row event_schema_versions of bools": rows_at["event_schema_versions"]("[true]"),
        "row event_schema_versions nested too deep": rows_at["event_schema_versions"]("[" * 100_000),
        "row policy version a float": rows_at["min_policy_version"]("1.5"),
        "row steps_without_logp negative": rows_at["steps_without_logp"]('{"1": -1}'),
        # JSON text over its column's cap or, over the rows' distinct values, over what their
        # number allows: refused before it is parsed (review-47h P2-2: parsed, a few-KB file
        # made readers build GBs of Python objects)
        "row event_schema_versions over 4 KiB": rows_at["event_schema_versions"]("[" + "1," * 2100 + "1]"),
        "row policy version over 256 bytes": rows_at["max_policy_version"]('"' + "v" * 300 + '"'),
        "row steps_without_logp over 64 KiB": rows_at["steps_without_logp"](
            json.dumps({str(i): 1 for i in range(7000)})
        ),
        "rows' distinct steps_without_logp over their JSON budget": {
            **d,
            "shards": [
                {**r, "steps_without_logp": json.dumps({str(i * 10_000 + j): 1 for j in range(3000)})}
                for i, r in enumerate(rows)
            ],
        },
        "row sha256 null (a validity buffer on a column without nulls)": rows_at["sha256"](None),
        "row epoch null": rows_at["epoch"](None),
        "int32 column": _encode(d, {"episodes": pa.int32()}),
        "bool column": _encode({**d, "shards": [{**r, "episodes": True} for r in rows]}, {"episodes": pa.bool_()}),
        "dictionary column": _encode(d, {"policy_id": pa.dictionary(pa.int32(), pa.string())}),
        "large_string column": _encode(d, {"name": pa.large_string()}),
        "an extra column (episode ids)": _encode(
            {**d, "shards": [{**r, "episode_ids": "x"} for r in rows]}, {"episode_ids": pa.string()}
        ),
        "a column missing": _encode(d, {"writer": None}),
        "header rows above the columns' rows": _encode(d, rows=len(rows) + 1),
        "header rows below the columns' rows": _encode(d, rows=len(rows) - 1),
        "header rows not an int": _patched(honest, lambda h, b: h.update(rows=float(len(rows)))),
        "a buffer past the column buffers": _patched(honest, _set_buffer("seq", 1, [len(honest) * 100, 8 * len(rows)])),
        "a buffer of another size": _patched(honest, _set_buffer("seq", 1, [0, 8 * len(rows) - 8])),
        "a buffer at a negative offset": _patched(honest, _set_buffer("seq", 1, [-8, 8 * len(rows)])),
        "a buffer that is not a pair": _patched(honest, _set_buffer("seq", 1, [0])),
        "string data missing": _patched(honest, _set_buffer("name", 2, None)),
        "string offsets not monotone": _patched(honest, _swap_offsets),
        "string offsets past the data": _patched(honest, _last_offset_past_data),
        "row name not UTF-8": _not_utf8(d, "name"),
        "row writer not UTF-8": _not_utf8(d, "writer"),
        "row policy not UTF-8": _not_utf8(d, "policy_id"),
        "decodes to more than its seq allows": rows_at["name"]("a" * 300_000),
        "larger than its seq allows": rows_at["name"](os.urandom(150_000).hex()),
    }


def test_a_hostile_live_set_is_refused_and_the_history_read(tmp_path):
    """Each hostile newest live set is refused (the next older, honest one is used); the head is
    the history's."""
    root, c, ls = _store_with_live_set(tmp_path)
    want = _history_head(c.storage)
    seq = ls.seq + 1
    path = live_set_path("rl", 0, seq)
    for name, doc in _hostile_docs(ls, seq).items():
        data = _bytes(doc)
        with pytest.raises(manifest_entries.ManifestError):
            parse_live_set(data, "rl", 0, seq)
            pytest.fail(name)
        c.storage.write(path, data)
        assert read_live_set(c.storage, "rl", 0) == ls, name  # refused: the next older one is used
        head = open_snapshot(root)
        assert sorted(_key(s) for s in head.entries) == want, name
        assert head.steps().num_rows == open_snapshot(root, as_of=head.cursor).steps().num_rows, name
        c.storage.delete(path)
    assert read_live_set(c.storage, "rl", 0) == ls  # the real one is used again


def test_a_live_set_past_the_log_end_or_stale_is_ignored(tmp_path):
    root, c, ls = _store_with_live_set(tmp_path)
    want = _history_head(c.storage)
    d = _doc(ls)
    _plant(c, {**d, "seq": 10_000}, seq=10_000)  # names entries that do not exist
    assert sorted(_key(s) for s in open_snapshot(root).entries) == want
    assert open_snapshot(root).cursor == open_snapshot(root, as_of=open_snapshot(root).cursor).cursor
    c.storage.delete(live_set_path("rl", 0, 10_000))
    _plant(c, {**d, "seq": ls.seq + 1, "first": "ClaimEntry:0:forged:1.0"}, seq=ls.seq + 1)  # another store's tag
    assert head_shards(c.storage, "rl", 0).live_set is None
    assert open_snapshot(root).cursor == open_snapshot(root, as_of=open_snapshot(root).cursor).cursor
    c.storage.delete(live_set_path("rl", 0, ls.seq + 1))
    # a live set that lost a shard a later replace entry replaces: stale, the history is read
    _plant(c, {**d, "seq": ls.seq, "shards": d["shards"][1:]}, seq=ls.seq)
    compact_partition(c.log, min_age_s=0, target_bytes=10 * max(e.bytes for e in read_manifest(c.storage)))
    head = head_shards(c.storage, "rl", 0)
    assert head.live_set is None  # fell back
    assert sorted(_key(s) for s in open_snapshot(root).entries) == _history_head(c.storage)


def _replant(c, seq: int, doc: dict) -> None:
    """Replace the live set at `seq` by `doc` (a forged one: parses, names real shards)."""
    c.storage.delete(live_set_path("rl", 0, seq))
    c.storage.create_once(live_set_path("rl", 0, seq), _encode(doc))


def test_verify_rebuilds_every_live_set_from_the_history(tmp_path):
    """A forged live set that parses and names real shards -- one hiding a shard, one listing the
    shards a compaction replaced (every episode twice), one with a row's count changed, one
    folding removal records that do not exist -- is reported by verify; readers refuse the one
    past the removal log's end."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    c.log.live_set_every = 5
    _commit(c, 12, 0)
    st = c.storage
    pre = read_live_set(st, "rl", 0)  # before the compaction: lists the shards it replaces
    compact_partition(c.log, min_age_s=0, target_bytes=3 * max(e.bytes for e in read_manifest(st)))
    write_live_set(st, "rl", 0, writer="test")
    retain(st, grace_s=0)
    _commit(c, 1, 50)
    write_live_set(st, "rl", 0, writer="test")
    _commit(c, 2, 60)
    assert verify(st) == []  # honest live sets (with replace entries and removal records folded)
    ls = read_live_set(st, "rl", 0)
    assert ls.removals > 0 and len(ls.shards) >= 2
    d = _doc(ls)
    want = _history_head(st)

    _replant(c, ls.seq, {**d, "shards": d["shards"][1:]})
    problems = verify(st)
    assert any(f"live set {ls.seq}: hides live shard seq {ls.shards[0].seq}" in p for p in problems), problems

    replaced = [r for r in _doc(pre)["shards"] if r["seq"] not in {s.seq for s in ls.shards}]
    assert replaced
    rows = sorted(d["shards"] + replaced, key=lambda r: r["seq"])
    _replant(c, ls.seq, {**d, "shards": rows})
    problems = verify(st)
    assert sum(f"live set {ls.seq}: lists seq" in p for p in problems) == len(replaced), problems

    _replant(
        c, ls.seq, {**d, "shards": [{**d["shards"][0], "episodes": d["shards"][0]["episodes"] + 1}, *d["shards"][1:]]}
    )
    assert any(f"live set {ls.seq}: row seq {ls.shards[0].seq} differs" in p for p in verify(st))

    _replant(c, ls.seq, {**d, "removals": 10**6})  # would skip every later removal record
    assert any(f"live set {ls.seq}: folds 1000000 removal records" in p for p in verify(st))
    assert head_shards(st, "rl", 0).live_set is None  # readers refuse it: the history is read
    assert sorted(_key(s) for s in open_snapshot(root).entries) == want

    _replant(c, ls.seq, d)
    assert verify(st) == [] and head_shards(st, "rl", 0).live_set == ls.seq


def test_verify_reports_a_live_set_folding_a_record_that_names_shards_past_its_seq(tmp_path):
    """A live set whose ``removals`` folds a record removing shards committed at or after its
    seq would make readers skip that record, so the removed shards stay at the head: the rows
    below its seq are the history's, and verify still reports it (review-47h P1-2)."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    _commit(c, 6, 0)
    ls = write_live_set(c.storage, "rl", 0, writer="test")
    _commit(c, 4, 20)
    retain(c.storage, grace_s=3600, older_than_s=0)  # record 0: every shard, those after the live set too
    assert [r.n for r in read_removals(c.storage)] == [0]
    assert verify(c.storage) == []
    d = _doc(ls)
    _replant(c, ls.seq, {**d, "removals": 1, "shards": []})  # what the history says below its seq
    problems = verify(c.storage)
    assert any(f"live set {ls.seq}: folds removal record 0, which names entries at or past" in p for p in problems)


def test_inspect_verify_reports_a_forged_live_set_and_totals_from_the_history(tmp_path, capsys):
    from rlrec.cli import main

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    _commit(c, 6, 0)
    ls = write_live_set(c.storage, "rl", 0, writer="test")
    d = _doc(ls)
    _replant(c, ls.seq, {**d, "shards": d["shards"][1:]})  # the head now shows 5 shards, 10 episodes
    capsys.readouterr()
    assert main(["inspect", root, "--verify", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert any("hides live shard" in p for p in doc["problems"]), doc["problems"]
    assert doc["verified"]["shards"] == 6 and doc["verified"]["episodes"] == 12, doc["verified"]
    _replant(c, ls.seq, d)
    assert main(["inspect", root, "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verified"]["episodes"] == 12


def test_a_live_set_is_bounded_in_what_it_makes_a_reader_read(tmp_path, monkeypatch):
    """A reader reads at most what the live set's seq allows (rows <= seq, bytes <= a cap that
    grows with seq, review-47b finding 6), and reads no live set named past the log's end."""
    root, c, ls = _store_with_live_set(tmp_path)
    want = _history_head(c.storage)
    size = len(c.storage.read(live_set_path("rl", 0, ls.seq)))
    reads = []
    real = type(c.storage).read

    def read(self, path, *a, limit=None, **kw):
        if "/_live/" in path:
            reads.append((path.rsplit("/", 1)[-1], limit))
        return real(self, path, *a, limit=limit, **kw)

    monkeypatch.setattr(type(c.storage), "read", read)
    name = live_set_path("rl", 0, ls.seq).rsplit("/", 1)[-1]
    assert read_live_set(c.storage, "rl", 0) == ls
    assert reads == [(name, live_set_file.size_cap(ls.seq))] and size <= live_set_file.size_cap(ls.seq)
    assert live_set_file.size_cap(ls.seq) < 200_000  # a short log's live set: never 512 MiB
    _plant(c, {**_doc(ls), "seq": 10**9}, seq=10**9)  # named past the log's end: never read
    reads.clear()
    assert read_live_set(c.storage, "rl", 0) == ls and reads == [(name, live_set_file.size_cap(ls.seq))]
    c.storage.delete(live_set_path("rl", 0, 10**9))
    monkeypatch.setattr(live_set_file, "MAX_LIVE_SET_BYTES", size - 1)
    reads.clear()
    assert read_live_set(c.storage, "rl", 0) is None
    assert reads == [(name, size - 1)]  # never asked for more than the limit
    assert sorted(_key(s) for s in open_snapshot(root).entries) == want
    monkeypatch.setattr(live_set_file, "MAX_LIVE_SET_BYTES", 512 * 1024 * 1024)
    monkeypatch.setattr(live_set_file, "MAX_LIVE_SHARDS", len(ls.shards) - 1)
    assert read_live_set(c.storage, "rl", 0) is None


_BOMB_READER = textwrap.dedent(
    """
    import resource, sys
    from rlrec.store.live_set import parse_live_set
    from rlrec.store.manifest import ManifestError

    seq, honest, bomb = int(sys.argv[1]), open(sys.argv[2], "rb").read(), open(sys.argv[3], "rb").read()
    parse_live_set(honest, "rl", 0, seq)  # imports and pools warmed up
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        parse_live_set(bomb, "rl", 0, seq)
        print("accepted")
    except ManifestError:
        print("refused", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """
)


@pytest.mark.parametrize("route", ["frame of zeros", "raw length claimed huge", "one huge string"])
def test_a_live_set_bomb_makes_a_reader_allocate_no_more_than_its_seq_allows(tmp_path, route):
    """A small live set file that would expand to 128 MiB or more (one zstd frame of zeros behind
    an honest raw length, a raw length claimed past the cap, a row of a 128 MiB string) is
    refused by a fresh reader process whose peak memory grows by less than 32 MiB (review-47h
    P1-1: what the bytes say they hold is checked against the seq before anything is decoded)."""
    ls = _store_with_live_set(tmp_path)[2]
    seq = ls.seq + 1
    d = {**_doc(ls), "seq": seq}
    honest = _encode(d)
    zeros = pa.Codec("zstd").compress(bytes(128 << 20), asbytes=True)
    bomb = {
        "frame of zeros": honest[:16] + zeros,
        "raw length claimed huge": honest[:8] + (128 << 20).to_bytes(8, "little") + zeros,
        "one huge string": _encode({**d, "shards": [{**d["shards"][0], "name": "a" * (128 << 20)}]}),
    }[route]
    assert len(bomb) < 200_000  # a small file
    (tmp_path / "honest").write_bytes(honest)
    (tmp_path / "bomb").write_bytes(bomb)
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [sys.executable, "-c", _BOMB_READER, str(seq), str(tmp_path / "honest"), str(tmp_path / "bomb")]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300).stdout.split()
    assert out[0] == "refused" and int(out[1]) < 32, out  # MiB more than before the parse


def test_a_symlinked_live_set_is_refused(tmp_path):
    """A live set (or the `_live` directory) that is a symlink is never followed: refused, the
    next older live set or the history read, no reader fails."""
    root, c, ls = _store_with_live_set(tmp_path)
    want = _history_head(c.storage)
    live_dir = os.path.dirname(os.path.join(root, live_set_path("rl", 0, ls.seq)))
    outside = tmp_path / "outside.live"
    outside.write_bytes(_encode({**_doc(ls), "seq": ls.seq + 1, "shards": []}))  # would hide every shard
    os.symlink(outside, os.path.join(live_dir, live_set_path("rl", 0, ls.seq + 1).rsplit("/", 1)[-1]))
    assert read_live_set(c.storage, "rl", 0) == ls
    assert sorted(_key(s) for s in open_snapshot(root).entries) == want
    assert any(f"live set {ls.seq + 1}: is a symlink" in p for p in verify(c.storage))
    os.remove(os.path.join(live_dir, live_set_path("rl", 0, ls.seq + 1).rsplit("/", 1)[-1]))
    os.rename(live_dir, str(tmp_path / "live-elsewhere"))
    os.symlink(str(tmp_path / "live-elsewhere"), live_dir)
    assert read_live_set(c.storage, "rl", 0) is None
    assert sorted(_key(s) for s in open_snapshot(root).entries) == want
    assert sorted(_key(s) for s in read_manifest(c.storage)) == want
    assert any("symlink" in p for p in verify(c.storage))  # reported, never a crash (review-47h P2-1)


def test_a_json_live_set_of_an_earlier_build_is_ignored_and_removed(tmp_path):
    """Live sets were JSON files (``.json``) before they were Parquet: a reader never reads one
    (it reads the newest Parquet live set, else the history); the next writer of a live set
    deletes them."""
    root, c, ls = _store_with_live_set(tmp_path)
    want = _history_head(c.storage)
    old = live_set_path("rl", 0, ls.seq + 1)[: -len(".live")] + ".json"
    c.storage.write(old, b'{"type": "live_set", "shards": []}')  # would hide every shard if read
    assert read_live_set(c.storage, "rl", 0) == ls and live_set_seqs(c.storage, "rl", 0) == [ls.seq]
    assert sorted(_key(s) for s in open_snapshot(root).entries) == want
    _commit(c, 1, 40)
    assert write_live_set(c.storage, "rl", 0) is not None
    assert not c.storage.exists(old)


def test_an_older_reader_refuses_a_live_set_as_too_new(tmp_path, monkeypatch):
    """A reader of format 3 never reads `_live/` (it reads the history); handed a live set, it
    refuses it as too new, or as no manifest entry, instead of misreading it."""
    ls = _store_with_live_set(tmp_path)[2]
    monkeypatch.setattr(manifest_entries, "MANIFEST_FORMAT_VERSION", 3)
    with pytest.raises(UnsupportedManifestError, match="format version 4"):
        parse_live_set(ls.to_bytes(), "rl", 0, ls.seq)
    with pytest.raises(manifest_entries.ManifestError):
        manifest_entries.parse_entry(ls.to_bytes())


# -- kill -9 of the writer around the live set's write -----------------------------------------------

_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from rlrec.store import live_set
    from rlrec.store.commit import ShardCommitter
    from rlrec.store.storage import Storage
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    root, crash_at, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    real = Storage.create_once

    def create_once(self, path, data):
        if "/_live/" in path and crash_at == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        if "/_live/" in path and crash_at == "torn":
            self.write(path + ".tmp-torn", data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        done = real(self, path, data)
        if "/_live/" in path and crash_at == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    Storage.create_once = create_once
    c = ShardCommitter(root, "rl", 0, snapshot_every=2)
    c.log.live_set_every = 4
    for i in range(12):
        res = c.commit(expert_cartpole_episodes(2, seed=seed + i, max_steps=20))
        print(" ".join(fe.episode_id for fe in res.written), flush=True)
    if c.log._live_builder is not None:  # a first live set built in the background reaches its write
        c.log._live_builder.join()
    print("done", flush=True)
    """
)


def _run_writer(root: str, crash_at: str, seed: int) -> tuple[int, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(
        [sys.executable, "-c", _WRITER, root, crash_at, str(seed)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    lines = p.stdout.split("\n")
    return p.returncode, [i for line in lines if line and line != "done" for i in line.split()]


@pytest.mark.slow
def test_kill_9_of_the_writer_around_the_live_set_write(tmp_path):
    root = str(tmp_path / "out")
    acked: list[str] = []
    codes = []
    for n, crash_at in enumerate(["before", "torn", "after", "none"]):
        code, ids = _run_writer(root, crash_at, 1000 * n)
        codes.append(code)
        acked += ids
        head = open_snapshot(root)
        assert sorted(_key(s) for s in head.entries) == _history_head(head.storage), crash_at
        rows = head.steps()
        got = set(rows.column("episode_id").to_pylist())
        assert set(acked) <= got  # every acknowledged commit is read (a killed one may be too)
        assert len(rows) == len(set(zip(rows.column("episode_id").to_pylist(), rows.column("t").to_pylist())))
        assert head.steps().equals(open_snapshot(root, as_of=head.cursor).steps())
    assert codes == [-signal.SIGKILL] * 3 + [0]  # each planted kill was reached
    assert live_set_seqs(open_snapshot(root).storage, "rl", 0)  # the runs after the kills wrote live sets
    assert verify(open_snapshot(root).storage) == []


def test_the_evaluator_reads_only_shards_holding_held_out_episodes_through_live_sets(tmp_path, monkeypatch):
    """The evaluator's reader opens the head through live sets (rows without episode ids) and
    still skips every shard holding no held-out episode; same episodes as at the cursor read
    through the history (review-47b finding 4)."""
    from rlrec.store import commit as commit_mod
    from rlrec.trainer.holdout import is_held_out
    from rlrec.trainer.ope_data import HeldOutReader

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    c.log.live_set_every = 5
    _commit(c, 16, 0)
    heads, _, _ = read_heads(c.storage)
    assert all(h.live_set is not None for h in heads.values())
    fraction = 0.2
    hist = open_snapshot(root, as_of=open_snapshot(root).cursor).entries  # with ids
    holding = {e.path for e in hist if any(is_held_out(str(i), fraction) for i in e.episode_ids)}
    assert 0 < len(holding) < len(hist), "the test needs shards with and without held-out episodes"
    real, reads = commit_mod.read_committed_shard, []

    def counting(storage, path, *a, **kw):
        reads.append(path)
        return real(storage, path, *a, **kw)

    monkeypatch.setattr(commit_mod, "read_committed_shard", counting)
    reader = HeldOutReader(root, fraction)
    eps = reader.refresh()
    assert set(reads) == holding and len(reads) == len(holding)
    again = HeldOutReader(root, fraction)
    reads.clear()
    assert sorted(e.id for e in again.refresh(as_of=reader.cursor)) == sorted(e.id for e in eps)
    assert again.stats.episodes_seen == reader.stats.episodes_seen
    assert again.stats.episodes_held_out == reader.stats.episodes_held_out == len(eps) > 0


def test_a_commit_on_a_long_log_without_a_live_set_never_reads_its_history(tmp_path):
    """An upgraded store (a long log written before live sets): the writer's commit path reads
    none of its history; the first live set is built off it (a background thread of the writer),
    and from then on incrementally in the commit path (review-47b finding 3)."""
    import threading

    from rlrec.store.manifest import MANIFEST_DIR

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    c.log.live_set_every = 0  # written before live sets
    _commit(c, 30, 0)
    assert live_set_seqs(c.storage, "rl", 0) == []
    c.log.live_set_every = 5  # the upgraded writer: 31 entries > 2 x 5
    st, real, reads = c.storage, c.storage.read, []
    end = len(PartitionLog(st, "rl", 0).load())
    commit_thread = threading.get_ident()

    def counting(path, *a, **kw):
        if threading.get_ident() == commit_thread and path.startswith(f"{MANIFEST_DIR}/rl/00000/"):
            reads.append(path)
        return real(path, *a, **kw)

    st.read = counting  # type: ignore[method-assign]
    try:
        _commit(c, 3, 100)  # past a snapshot, so past the live-set check
        assert len(reads) <= 2, f"the commit path read {len(reads)} of {end} entries: {reads}"
        builder = c.log._live_builder
        assert builder is not None, "the first live set was not handed off"
        builder.join(60)
        assert not builder.is_alive()
    finally:
        del st.read
    assert live_set_seqs(st, "rl", 0), "no first live set was built"
    _commit(c, 6, 200)
    assert max(live_set_seqs(st, "rl", 0)) > min(live_set_seqs(st, "rl", 0))  # then incremental
    _assert_head_is_history(root, through_live_set=True)


def test_a_live_set_past_the_logs_end_is_passed_over_and_does_not_stop_the_writer(tmp_path):
    """A live set named with a seq past the log's end (forged, parseable) is ignored by readers,
    who fall back to the next older one, and neither stops the writer writing new ones nor evicts
    the honest ones (review-47b finding 5)."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    c.log.live_set_every = 5
    _commit(c, 8, 0)
    st = c.storage
    honest = live_set_seqs(st, "rl", 0)
    assert honest
    doc = _doc(read_live_set(st, "rl", 0))
    doc["seq"] = big = 999_999_999_999
    st.create_once(live_set_path("rl", 0, big), _encode(doc))
    assert read_live_set(st, "rl", 0).seq == honest[-1]  # the next older one
    _assert_head_is_history(root, through_live_set=True)
    w = ShardCommitter(root, "rl", 0, snapshot_every=3)  # a fresh writer (looks for live sets)
    w.log.live_set_every = 5
    _commit_settled(w, 12, 100)  # its first live set is built in the background
    seqs = live_set_seqs(st, "rl", 0)
    assert big in seqs and max(q for q in seqs if q != big) > honest[-1], seqs  # new ones written
    assert len([q for q in seqs if q != big]) == 3, seqs  # the newest 3 honest ones kept
    assert read_live_set(st, "rl", 0).seq == max(q for q in seqs if q != big)
    _assert_head_is_history(root, through_live_set=True)


def test_a_live_set_past_the_logs_end_with_any_file_below_it_is_refused(tmp_path):
    """The entry below a live set's seq is read and checked, not only found: an empty file
    planted there beside a live set past the log's end does not make the head end past the log
    (which would hide the writer's next commits from every head reader; review-47o H3)."""
    root, c, ls = _store_with_live_set(tmp_path)
    st = c.storage
    end = c.log.next_seq
    forged = end + 50
    _plant(c, {**_doc(ls), "seq": forged}, seq=forged)
    assert st.create_once(c.log._path(forged - 1), b"")
    head = open_snapshot(root)
    assert head.cursor.endswith(f"~rl:0={end}"), head.cursor
    assert sorted(_key(s) for s in head.entries) == _history_head(st)
    w = ShardCommitter(root, "rl", 0, snapshot_every=3)
    _commit(w, 2, 100)
    after = open_snapshot(root)
    assert sorted(_key(s) for s in after.entries) == _history_head(st)
    assert after.cursor.endswith(f"~rl:0={w.log.next_seq}") and w.log.next_seq < forged, after.cursor


def test_a_head_snapshots_files_come_from_the_live_sets_path_column(tmp_path, monkeypatch):
    """`files()` of a head opened through live sets names the same files as the history at the
    same cursor, across compaction (dropped and added rows) and shards after the live set, and
    builds no shard entry for the live set's rows (review-47o H1: the head open is timed
    producing what a listing produces)."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    c.log.live_set_every = 4
    _commit(c, 9, 0)
    compact_partition(c.log, min_age_s=0, target_bytes=3 * max(e.bytes for e in read_manifest(c.storage)))
    _commit(c, 2, 50)
    c2 = ShardCommitter(root, "rl", 1, snapshot_every=3)  # a second log with no live set
    _commit(c2, 2, 70)
    head = open_snapshot(root)
    assert read_heads(c.storage)[0][("rl", 0)].live_set is not None
    full = open_snapshot(root, as_of=head.cursor)
    built = []
    real = live_set_file.LiveRows._make
    monkeypatch.setattr(live_set_file.LiveRows, "_make", lambda self, rows: built.append(len(rows)) or real(self, rows))
    files = head.files()
    assert built == []
    assert files == full.files() and len(files) == len(full.entries) > 4
    assert all(os.path.isfile(f) for f in files)
    assert files == [head.storage.uri(e.path) for e in head.entries]  # and after the entries are built


def test_a_writer_builds_its_first_live_set_from_the_history_not_a_forged_one(tmp_path):
    """A forged live set that parses and hides a shard is not carried forward by a writer that
    claims the log after it: its first live set is built from the history (in its background
    thread), so the head is the history again from that live set on (review-47o H2)."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    c.log.live_set_every = 3
    _commit(c, 10, 0)
    st = c.storage
    newest = read_live_set(st, "rl", 0)
    d = _doc(newest)
    _replant(c, newest.seq, {**d, "shards": d["shards"][1:]})
    assert len(read_live_set(st, "rl", 0).shards) == len(newest.shards) - 1  # trusted by readers
    w = ShardCommitter(root, "rl", 0, snapshot_every=3)  # a restart: a new writer claims the log
    w.log.live_set_every = 3
    for i in range(6):
        _commit(w, 1, 100 + i)
        if w.log._live_builder is not None:
            w.log._live_builder.join()
    seqs = live_set_seqs(st, "rl", 0)
    assert seqs[-1] > newest.seq
    _assert_head_is_history(root, through_live_set=True)
    assert read_heads(st)[0][("rl", 0)].live_set == seqs[-1]
