"""Retention's columns of a live set (`rlrec.store.live_set.Retention`, docs/FORMAT.md "Retention
columns"): per live shard the newest first-commit time of its episodes and the shard entries it
holds, and the replaced files no folded removal record names -- written by the writer (column-wise
from its last live set, or from the history), equal to what the history says across commits,
compaction of merged shards, retention and a second partition; refused when hostile; a live set
without them (an earlier build's) is still read, and whoever needs them reads the history."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from rlrec.store import live_set_file
from rlrec.store.commit import ShardCommitter
from rlrec.store.compaction import compact_partition
from rlrec.store.live_set import (
    NeedsHistory,
    fold,
    head_shards,
    live_set_path,
    live_set_seqs,
    parse_live_set,
    read_live_set,
    write_live_set,
)
from rlrec.store.maintenance import verify
from rlrec.store.manifest import PartitionLog, ShardEntry, live_holders, live_shards, shard_files
from rlrec.store.retention import read_removals, resolve_removals, retain
from rlrec.store.snapshot import open_snapshot
from rlrec.trainer.synthetic import expert_cartpole_episodes


def _commit(c: ShardCommitter, n: int, seed: int) -> None:
    for i in range(n):
        c.commit(expert_cartpole_episodes(2, seed=seed + i, max_steps=20))


def _want(st, topic: str, partition: int, seq: int, removals: int) -> tuple[dict, dict, dict]:
    """(newest, holds, replaced) below `seq` as retention computes them from the history
    (`rlrec.store.retention.plan_removals`' rule), less the records numbered below `removals`."""
    entries = [e for e in PartitionLog(st, topic, partition).load() if e.seq < seq]
    records = [r for r in read_removals(st) if r.n < removals]
    removed = resolve_removals(records, {(topic, partition): entries})
    live = {q: s for q, s in live_shards(entries).items() if (topic, partition, q) not in removed}
    first: dict[str, float] = {}
    for e in entries:
        if isinstance(e, ShardEntry):
            for i in e.episode_ids:
                first.setdefault(i, e.commit_time)
    newest = {q: max((first[i] for i in s.episode_ids), default=s.commit_time) for q, s in live.items()}
    holds = {q: h for q, (_, h) in live_holders(entries).items() if q in live}
    replaced = {
        s.seq: s.path
        for s in shard_files(entries)
        if s.seq not in live_shards(entries) and (topic, partition, s.seq) not in removed
    }
    return newest, holds, replaced


def _got(ls) -> tuple[dict, dict, dict]:
    r = fold(ls.topic, ls.partition, ls.shards, [], []).retention()
    assert r is not None, "the live set has no retention columns"
    newest = {s.seq: r.newest_of(s.seq) for s in ls.shards}
    holds = {s.seq: r.holds_of(s.seq) for s in ls.shards}
    return newest, holds, {q: r.replaced_file(q)[0] for q in r.replaced}


def _assert_every_live_set_is_the_history(st, topic: str = "rl", partition: int = 0) -> int:
    seqs = live_set_seqs(st, topic, partition)
    assert seqs
    for seq in seqs:
        ls = parse_live_set(st.read(live_set_path(topic, partition, seq)), topic, partition, seq)
        assert _got(ls) == _want(st, topic, partition, seq, ls.removals), seq
    return len(seqs)


def _store(tmp_path, every: int = 4) -> ShardCommitter:
    c = ShardCommitter(str(tmp_path / "out"), "rl", 0, snapshot_every=2)
    c.log.live_set_every = every
    return c


def test_the_writers_retention_columns_are_the_historys_across_compaction_retention_and_partitions(tmp_path):
    c = _store(tmp_path)
    other = ShardCommitter(str(tmp_path / "out"), "rl", 1, snapshot_every=2)
    other.log.live_set_every = 3
    _commit(c, 9, 0)
    _commit(other, 7, 500)
    target = 3 * max(e.bytes for e in live_shards(c.log.load()).values())
    compact_partition(c.log, min_age_s=0, target_bytes=target)
    _commit(c, 5, 100)  # the writer's live sets carry the merged shards forward, column-wise
    _assert_every_live_set_is_the_history(c.storage)
    compact_partition(c.log, min_age_s=0, target_bytes=4 * target)  # merged shards merged again
    _commit(c, 5, 200)
    _, holds, replaced = _got(read_live_set(c.storage, "rl", 0))
    assert any(len(h) > 3 for h in holds.values()), holds  # a merged shard of merged shards
    assert replaced
    _assert_every_live_set_is_the_history(c.storage)
    retain(c.storage, grace_s=0)  # records every replaced file
    _commit(c, 5, 300)  # the next live set folds the records: no replaced file left
    ls = read_live_set(c.storage, "rl", 0)
    assert ls.removals > 0 and _got(ls)[2] == {}
    retain(c.storage, grace_s=3600, older_than_s=0)  # every live shard expires
    _commit(c, 5, 400)
    _commit(other, 4, 600)
    assert _assert_every_live_set_is_the_history(c.storage) >= 2
    assert _assert_every_live_set_is_the_history(other.storage, "rl", 1) >= 2
    assert verify(c.storage) == []


def test_a_writers_first_live_set_from_the_history_has_them_and_one_without_them_is_rebuilt(tmp_path):
    c = _store(tmp_path, every=100)
    _commit(c, 6, 0)
    compact_partition(c.log, min_age_s=0, target_bytes=1 << 30)
    _commit(c, 2, 50)
    ls = write_live_set(c.storage, "rl", 0, writer="test")  # from the history: no live set yet
    assert ls is not None and ls.tables is not None
    assert _got(ls) == _want(c.storage, "rl", 0, ls.seq, ls.removals)
    # a live set of an earlier build (no retention columns) at the head
    old = ls.shards.columns
    old.pop("newest_commit")
    c.storage.delete(live_set_path("rl", 0, ls.seq))
    head = {**ls.header(), "writer": "old"}
    head.pop("held"), head.pop("replaced")
    c.storage.write(live_set_path("rl", 0, ls.seq), live_set_file.encode_columns(head, old, len(ls.shards)))
    plain = read_live_set(c.storage, "rl", 0)
    assert plain is not None and plain.writer == "old" and plain.tables is None  # readers read it
    h = head_shards(c.storage, "rl", 0)
    assert h.live_set == ls.seq and h.shards.retention() is None  # retention must read the history
    assert open_snapshot(c.storage.uri("")).entries == open_snapshot(c.storage.uri(""), as_of=None).entries
    _commit(c, 2, 80)
    new = write_live_set(c.storage, "rl", 0, writer="test", prev=plain)  # never carries it forward
    assert new is not None and new.tables is not None
    assert _got(new) == _want(c.storage, "rl", 0, new.seq, new.removals)
    # the commit path never reads the history for it: a newest one without them stops it there
    _commit(c, 1, 90)
    c.storage.write(
        live_set_path("rl", 0, new.seq + 1),
        live_set_file.encode_columns(head | {"seq": new.seq + 1}, old, len(ls.shards)),
    )
    with pytest.raises(NeedsHistory):
        write_live_set(c.storage, "rl", 0, writer="test", history=False)


# -- hostile retention columns ---------------------------------------------------------------------


def _parts(ls) -> tuple[dict, dict]:
    header, columns = live_set_file._open_checked(ls.to_bytes(), ls.seq)
    return header, {k: v.to_pylist() for k, v in columns.items()}


_TYPES = {
    n: t
    for n, t, _ in (
        *live_set_file.COLUMNS,
        live_set_file.NEWEST_COLUMN,
        *live_set_file.HELD_COLUMNS,
        *live_set_file.REPLACED_COLUMNS,
    )
}


def _encode(header: dict, cols: dict) -> bytes:
    """A live set of `header` and the columns `cols` (name -> values), its held and replaced
    counts those of the columns (where it has them)."""
    arrays = {k: pa.array(v, _TYPES[k]) for k, v in cols.items()}
    counts = {k: len(cols[f"{k}_seq"]) for k in ("held", "replaced") if f"{k}_seq" in cols}
    return live_set_file.encode_columns({**header, **counts}, arrays, len(cols["seq"]))


@pytest.fixture
def merged_store(tmp_path):
    c = _store(tmp_path, every=100)
    _commit(c, 6, 0)
    compact_partition(c.log, min_age_s=0, target_bytes=1 << 30)
    _commit(c, 2, 50)
    ls = write_live_set(c.storage, "rl", 0, writer="test")
    h, cols = _parts(ls)
    assert cols["held_seq"] and cols["replaced_seq"]  # both tables hold rows
    return c, ls, h, cols


_PLAIN = [n for n, _, _ in live_set_file.COLUMNS]


def _one_replaced(cols: dict, seq: int, by: int) -> dict:
    """Replaced-table columns of one row: `seq` replaced by `by`, the first replaced row's file."""
    return {
        "replaced_seq": [seq],
        "replaced_by": [by],
        "replaced_policy_id": cols["replaced_policy_id"][:1],
        "replaced_name": cols["replaced_name"][:1],
    }


def _hostile(h: dict, cols: dict) -> dict[str, bytes]:
    def changed(**kw):
        return _encode(h, {**cols, **kw})

    held, by, rep, rby = cols["held_seq"], cols["held_by"], cols["replaced_seq"], cols["replaced_by"]
    live = cols["seq"]
    return {
        "newest_commit NaN": changed(newest_commit=[float("nan"), *cols["newest_commit"][1:]]),
        "newest_commit infinite": changed(newest_commit=[float("inf"), *cols["newest_commit"][1:]]),
        "held seqs not ascending": changed(held_seq=held[::-1], held_by=by[::-1]),
        "held seq a live row": changed(held_seq=[live[0], *held[1:]]),
        "held by no live row": changed(held_by=[by[0] + 1000, *by[1:]]),
        "held seq at or past its holder": changed(held_seq=[*held[:-1], by[-1]]),
        "held seq negative": changed(held_seq=[-1, *held[1:]]),
        "replaced seq a live row": changed(**_one_replaced(cols, live[0], h["seq"] - 1)),
        "replaced by an entry past its seq": changed(replaced_by=[h["seq"], *rby[1:]]),
        "replaced by an entry before it": changed(replaced_by=[rep[0], *rby[1:]]),
        "replaced seqs not ascending": changed(
            **{k: [v[0], *v] for k, v in _one_replaced(cols, rep[0], rby[0]).items()}
        ),
        "replaced name with a slash": changed(replaced_name=["../x.parquet", *cols["replaced_name"][1:]]),
        "replaced name hidden": changed(replaced_name=[".x", *cols["replaced_name"][1:]]),
        "replaced policy id not one": changed(replaced_policy_id=["a b", *cols["replaced_policy_id"][1:]]),
        "held without its column": _encode({**h}, {k: v for k, v in cols.items() if k != "held_by"}),
        "held rows over its seq": live_set_file.encode_columns(
            {**h, "held": h["seq"] + 1}, {k: pa.array(v, _TYPES[k]) for k, v in cols.items()}, len(live)
        ),
        "retention fields without their columns": live_set_file.encode_columns(
            {**h, "held": 0, "replaced": 0}, {k: pa.array(cols[k], _TYPES[k]) for k in _PLAIN}, len(live)
        ),
        "folds_deleted_only false": _encode({**h, "folds_deleted_only": False}, cols),
        "folds_deleted_only not a boolean": _encode({**h, "folds_deleted_only": "yes"}, cols),
        "an earlier build's folds_ended_grace (folding by a clock)": _encode(
            {**{k: v for k, v in h.items() if k != "folds_deleted_only"}, "folds_ended_grace": True}, cols
        ),
        "retention columns without their fields": live_set_file.encode_columns(
            {k: v for k, v in h.items() if k not in ("held", "replaced")},
            {k: pa.array(v, _TYPES[k]) for k, v in cols.items()},
            len(live),
        ),
    }


def test_hostile_retention_columns_are_refused_and_the_history_read(merged_store):
    c, ls, h, cols = merged_store
    want = [s.path for s in open_snapshot(c.storage.uri(""), as_of=None).entries]
    honest = _encode(h, cols)
    assert parse_live_set(honest, "rl", 0, ls.seq).tables is not None  # the forger's encoding is sound
    for what, data in _hostile(h, cols).items():
        with pytest.raises(live_set_file.ManifestError):
            parse_live_set(data, "rl", 0, ls.seq)
        c.storage.delete(live_set_path("rl", 0, ls.seq))
        c.storage.write(live_set_path("rl", 0, ls.seq), data)
        got = head_shards(c.storage, "rl", 0)
        assert got.live_set is None, what  # refused: the history is read
        assert [s.path for s in got.shards] == want, what
    assert json.dumps(h)  # the header stayed a plain document


def test_an_older_reader_refuses_a_live_set_with_retention_columns_and_reads_the_history(merged_store, monkeypatch):
    """A reader that knows no retention columns (format 4 before them: exactly its columns and
    header fields) refuses such a live set as malformed, and so reads the history: correct."""
    c, ls, _, _ = merged_store
    monkeypatch.setattr(live_set_file, "RETENTION_FIELDS", frozenset({"no such field"}))
    with pytest.raises(live_set_file.ManifestError, match="unknown fields"):
        parse_live_set(ls.to_bytes(), "rl", 0, ls.seq)
    got = head_shards(c.storage, "rl", 0)
    assert got.live_set is None and [s.seq for s in got.shards] == sorted(live_shards(c.log.load()))


def test_an_older_reader_refuses_a_live_set_folding_only_deleted_files_and_reads_the_history(merged_store, monkeypatch):
    """A reader from before ``folds_deleted_only`` (its header fields exactly its own) refuses a
    live set that has it, and so reads the history; one without it is read, and not carried
    forward by its writer (the next is built from the history, with the field)."""
    c, ls, h, cols = merged_store
    assert h["folds_deleted_only"] is True
    monkeypatch.setattr(live_set_file, "DELETED_ONLY_FIELD", "no such field")
    with pytest.raises(live_set_file.ManifestError, match="unknown fields"):
        parse_live_set(ls.to_bytes(), "rl", 0, ls.seq)
    monkeypatch.undo()
    without = _encode({k: v for k, v in h.items() if k != "folds_deleted_only"}, cols)
    assert parse_live_set(without, "rl", 0, ls.seq).folds_deleted_only is False
    c.storage.delete(live_set_path("rl", 0, ls.seq))
    c.storage.write(live_set_path("rl", 0, ls.seq), without)
    assert head_shards(c.storage, "rl", 0).live_set == ls.seq  # read by the head's readers
    _commit(c, 1, 80)
    nxt = write_live_set(c.storage, "rl", 0, writer="test")
    assert nxt is not None and nxt.folds_deleted_only and nxt.seq > ls.seq


def test_verify_reports_retention_columns_that_differ_from_the_history(merged_store):
    """A forged live set whose retention columns are well-formed but wrong (a merged shard said
    to expire sooner, to hold fewer entries, a replaced file hidden) is what verify reports."""
    c, ls, h, cols = merged_store
    assert verify(c.storage) == []
    merged = cols["held_by"][0]
    i = cols["seq"].index(merged)
    forged = {
        **cols,
        "newest_commit": [*cols["newest_commit"][:i], 0.0, *cols["newest_commit"][i + 1 :]],
        "held_seq": cols["held_seq"][1:],
        "held_by": cols["held_by"][1:],
        **{k: v[1:] for k, v in cols.items() if k.startswith("replaced_")},
    }
    c.storage.delete(live_set_path("rl", 0, ls.seq))
    c.storage.write(live_set_path("rl", 0, ls.seq), _encode(h, forged))
    problems = "\n".join(verify(c.storage))
    assert f"row seq {merged}'s newest_commit is 0.0" in problems
    assert f"row seq {merged} holds shard entries" in problems
    assert f"replaced files: seq {cols['replaced_seq'][0]} is not listed" in problems
