"""`rlrec retain` from the logs' heads (`rlrec.store.retention_heads`): the same records and the
same deletions as from the whole history -- across compaction of merged shards, pins by shard
entry, a second partition, an as-of reader, after kill -9 of the writer around its live-set
writes -- reading no history where the heads decide; and a forged live set never makes it record
or delete a live shard (the entries confirm every candidate, else the history decides)."""

from __future__ import annotations

import shutil
import time

import pytest

import rlrec.store.retention_heads as retention_heads
from rlrec.store import live_set_file
from rlrec.store.commit import ShardCommitter
from rlrec.store.compaction import compact_partition
from rlrec.store.live_set import live_set_path, read_live_set, write_live_set
from rlrec.store.maintenance import verify
from rlrec.store.manifest import PartitionLog, live_holders, live_shards
from rlrec.store.retention import read_logs, retain
from rlrec.store.snapshot import open_snapshot
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes


def _commit(c: ShardCommitter, n: int, seed: int) -> None:
    for i in range(n):
        c.commit(expert_cartpole_episodes(2, seed=seed + i, max_steps=20))


def _history_only(storage, records, **kw):
    return {}, read_logs(storage)


class _Loads:
    """Counts whole-history reads (`PartitionLog.load`)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = PartitionLog.load

        def load(plog, *a, **kw):
            self.n += 1
            return real(plog, *a, **kw)

        monkeypatch.setattr(PartitionLog, "load", load)


def _outcome(root: str, res) -> tuple:
    head = open_snapshot(root)
    return (
        [(f.key, f.reason, f.path) for f in res.recorded],
        sorted(res.deleted),
        sorted((s.topic, s.partition, s.seq, s.path) for s in head.entries),
    )


def _both(tmp_path, root: str, monkeypatch, name: str, **kw) -> tuple[tuple, int]:
    """retain on two copies of the store at `root`, from the heads and from the history alone:
    their outcomes must be equal. Returns it and the history reads of the heads' run; the store
    at `root` becomes the heads' copy."""
    a, b = str(tmp_path / f"{name}-heads"), str(tmp_path / f"{name}-history")
    shutil.copytree(root, a)
    shutil.copytree(root, b)
    loads = _Loads(monkeypatch)
    res = retain(Storage.from_uri(a), **kw)
    n = loads.n  # retain's own whole-history reads
    got = _outcome(a, res)
    with monkeypatch.context() as m:
        m.setattr(retention_heads, "heads_or_history", _history_only)
        want = _outcome(b, retain(Storage.from_uri(b), **kw))
    assert got == want
    shutil.rmtree(root)
    shutil.copytree(a, root)
    return got, n


def _store(tmp_path) -> tuple[str, ShardCommitter, ShardCommitter]:
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=2)
    c.log.live_set_every = 4
    d = ShardCommitter(root, "rl", 1, snapshot_every=2)
    d.log.live_set_every = 3
    return root, c, d


def test_retain_from_the_heads_is_retain_from_the_history(tmp_path, monkeypatch):
    root, c, d = _store(tmp_path)
    _commit(c, 9, 0)
    _commit(d, 6, 500)
    # a second writer's topic whose log has no live set (fewer entries than its cadence): its
    # history decides, in the same run as the heads of the others
    other = ShardCommitter(root, "other", 0)
    _commit(other, 4, 900)
    compact_partition(other.log, min_age_s=0, target_bytes=1 << 30)
    target = 3 * max(e.bytes for e in live_shards(c.log.load()).values())
    compact_partition(c.log, min_age_s=0, target_bytes=target)
    _commit(c, 5, 100)  # the writer's live set lists the replaced files
    early = open_snapshot(root)  # an as-of reader of the point before retain
    now = time.time() + 1000
    got, loads = _both(tmp_path, root, monkeypatch, "replaced", grace_s=3600, now=now)
    assert got[0] and {r for _, r, _ in got[0]} == {"replaced"} and got[1] == []
    assert {k[0] for k, _, _ in got[0]} == {"rl", "other"}
    assert loads == 1, "the heads decided: only the log without a live set was read whole"
    assert early.steps().num_rows == open_snapshot(root, as_of=early.cursor).steps().num_rows  # within grace
    compact_partition(c.log, min_age_s=0, target_bytes=4 * target)  # merged shards merged again
    _commit(c, 5, 200)
    _commit(d, 4, 600)
    c.log.live_set_every, d.log.live_set_every = 1, 1
    _commit(c, 1, 300)
    _commit(d, 1, 700)
    # pins by shard entry: one entry held by a merged shard, and a shard entry of partition 1
    holders = live_holders(c.log.load())
    merged = next(q for q, (_, held) in holders.items() if len(held) > 3)
    other = min(live_shards(d.log.load()))
    pinned = {("rl", 0): [(holders[merged][1][1], holders[merged][1][1] + 1)], ("rl", 1): [(other, other + 1)]}
    got, loads = _both(
        tmp_path, root, monkeypatch, "expire", grace_s=0, now=now + 10_000, older_than_s=5000, pinned_entries=pinned
    )
    reasons = {r for _, r, _ in got[0]}
    assert reasons == {"expired", "replaced"} and got[1]
    kept = {(t, p, q) for t, p, q, _ in got[2]}
    assert ("rl", 0, merged) in kept and len(kept) == 2, kept  # the pinned ones only
    assert loads == 1
    got, loads = _both(tmp_path, root, monkeypatch, "again", grace_s=0, now=now + 20_000, older_than_s=5000)
    assert got[0] and loads == 1  # the pins gone: the rest expires, from the heads
    assert verify(Storage.from_uri(root)) == []


def test_a_forged_live_set_cannot_make_retain_drop_a_live_shard(tmp_path, monkeypatch):
    """A well-formed live set that says every live shard expired long ago: retain confirms each
    candidate from the entries (their merge trees), finds none expired, and records nothing live."""
    root, c, _ = _store(tmp_path)
    _commit(c, 6, 0)
    compact_partition(c.log, min_age_s=0, target_bytes=1 << 30)
    _commit(c, 3, 50)
    ls = write_live_set(c.storage, "rl", 0, writer="test")
    header, cols = live_set_file._open_checked(ls.to_bytes(), ls.seq)
    live = cols["seq"].to_pylist()
    forged = dict(cols)
    forged["newest_commit"] = live_set_file.pa.array([0.0] * len(live), live_set_file.pa.float64())
    c.storage.delete(live_set_path("rl", 0, ls.seq))
    c.storage.write(live_set_path("rl", 0, ls.seq), live_set_file.encode_columns(header, forged, len(live)))
    assert read_live_set(c.storage, "rl", 0).shards.columns["newest_commit"][1].as_py() == 0.0
    before = sorted(s.path for s in open_snapshot(root).entries)
    got, _ = _both(tmp_path, root, monkeypatch, "forged", grace_s=0, older_than_s=3600)
    assert [p for _, _, p in got[0] if p in before] == []  # no live shard recorded
    assert sorted(s[3] for s in got[2]) == before


@pytest.mark.parametrize("what", ["replaced listed", "holds hidden"])
def test_forged_retention_rows_are_confirmed_against_the_entries(tmp_path, monkeypatch, what):
    root, c, _ = _store(tmp_path)
    _commit(c, 6, 0)
    compact_partition(c.log, min_age_s=0, target_bytes=1 << 30)
    _commit(c, 3, 50)
    ls = write_live_set(c.storage, "rl", 0, writer="test")
    header, cols = live_set_file._open_checked(ls.to_bytes(), ls.seq)
    pa = live_set_file.pa
    forged = dict(cols)
    live = cols["seq"].to_pylist()
    merged = cols["held_by"][0].as_py()
    if what == "replaced listed":  # the newest plain live shard said replaced by the last entry
        q = sorted(s for s in live if s != merged)[-2]
        by = ls.seq - 1
        assert by > q
        forged["replaced_seq"] = pa.array([*cols["replaced_seq"].to_pylist(), q], pa.int64())
        forged["replaced_by"] = pa.array([*cols["replaced_by"].to_pylist(), by], pa.int64())
        forged["replaced_policy_id"] = pa.array([*cols["replaced_policy_id"].to_pylist(), "expert"], pa.string())
        name = next(s.path for s in ls.shards if s.seq == q).split("/")[1]
        forged["replaced_name"] = pa.array([*cols["replaced_name"].to_pylist(), name], pa.string())
        # a replaced seq may not be a live row: hide it from the rows too
        keep = [j for j, s in enumerate(live) if s != q]
        forged = {
            k: (v.take(pa.array(keep)) if k in dict.fromkeys(live_set_file._NULLABLE) and len(v) == len(live) else v)
            for k, v in forged.items()
        }
        rows = len(keep)
        kw = {"grace_s": 0}
    else:  # the merged shard said to hold none of the pinned entry's seqs, and to be old
        held = cols["held_seq"].to_pylist()
        forged["held_seq"], forged["held_by"] = pa.array(held[1:], pa.int64()), cols["held_by"][1:]
        newest = cols["newest_commit"].to_pylist()
        newest[live.index(merged)] = 0.0
        forged["newest_commit"] = pa.array(newest, pa.float64())
        rows = len(live)
        kw = {"grace_s": 0, "older_than_s": 3600, "pinned_entries": {("rl", 0): [(held[0], held[0] + 1)]}}
    header = {**header, "held": len(forged["held_seq"]), "replaced": len(forged["replaced_seq"])}
    c.storage.delete(live_set_path("rl", 0, ls.seq))
    c.storage.write(live_set_path("rl", 0, ls.seq), live_set_file.encode_columns(header, forged, rows))
    assert read_live_set(c.storage, "rl", 0).seq == ls.seq  # readers take it
    before = sorted(s.path for s in open_snapshot(root, as_of=open_snapshot(root).cursor).entries)
    got, _ = _both(tmp_path, root, monkeypatch, "forged", **kw)
    assert [p for _, _, p in got[0] if p in before] == []  # nothing live recorded
    assert not set(got[1]) & set(before)  # nor deleted


def test_a_forged_live_set_cannot_record_again_what_a_removal_record_names(tmp_path, monkeypatch):
    """A live set listing as replaced the files an earlier record (a day's grace) already names:
    retain from the heads records nothing again and deletes nothing a minute later, as retain
    from the history does (it re-recorded them with grace 0 and deleted them at once)."""
    root, c, _ = _store(tmp_path)
    _commit(c, 6, 0)
    compact_partition(c.log, min_age_s=0, target_bytes=1 << 30)
    _commit(c, 3, 50)
    ls1 = write_live_set(c.storage, "rl", 0, writer="test")
    _, cols1 = live_set_file._open_checked(ls1.to_bytes(), ls1.seq)
    assert len(cols1["replaced_seq"]) == 6
    t0 = time.time()
    first = retain(c.storage, grace_s=86400, now=t0)  # the 6 replaced files, a day's grace
    assert len(first.recorded) == 6 and first.deleted == []
    _commit(c, 1, 90)
    ls2 = write_live_set(c.storage, "rl", 0, writer="test") or read_live_set(c.storage, "rl", 0)
    header, cols = live_set_file._open_checked(ls2.to_bytes(), ls2.seq)
    assert ls2.removals == 0 and len(cols["replaced_seq"]) == 6  # the record, in its grace, is not folded
    forged = dict(cols)
    for k in ("replaced_seq", "replaced_by", "replaced_policy_id", "replaced_name"):
        forged[k] = cols1[k]  # the rows from before the record
    header = {**header, "removals": 1, "replaced": len(cols1["replaced_seq"])}  # forged: it folds the record
    c.storage.delete(live_set_path("rl", 0, ls2.seq))
    c.storage.write(live_set_path("rl", 0, ls2.seq), live_set_file.encode_columns(header, forged, len(cols["seq"])))
    assert read_live_set(c.storage, "rl", 0).seq == ls2.seq  # readers take it
    got, _ = _both(tmp_path, root, monkeypatch, "rerecord", grace_s=0, now=t0 + 60)
    assert got[0] == [] and got[1] == []


def test_a_second_record_naming_a_file_does_not_shorten_the_first_ones_grace(tmp_path, monkeypatch):
    """Two records name the same files (two retains racing): the first one's grace (a day) rules
    from the heads as from the history, not the second's (0)."""
    from rlrec.store.retention import append_removals

    root, c, _ = _store(tmp_path)
    _commit(c, 6, 0)
    compact_partition(c.log, min_age_s=0, target_bytes=1 << 30)
    _commit(c, 3, 50)
    t0 = time.time()
    first = retain(c.storage, grace_s=86400, now=t0)
    assert len(first.recorded) == 6
    append_removals(c.storage, {("rl", 0): c.log.next_seq, ("rl", 1): 0}, first.recorded, grace_s=0, now=t0 + 1)
    _commit(c, 1, 90)
    write_live_set(c.storage, "rl", 0, writer="test")
    got, _ = _both(tmp_path, root, monkeypatch, "twice", grace_s=0, now=t0 + 60)
    assert got[1] == []  # nothing deleted a minute into the first record's day


@pytest.mark.slow
def test_retain_from_the_heads_after_kill_9_of_the_writer_around_its_live_set_writes(tmp_path, monkeypatch):
    """The writer killed before, during (a torn temp file) and after its live set's create-once,
    a compaction and a retain between the runs: retain from the heads records and deletes what
    retain from the history does, every time."""
    from tests.test_live_set import _run_writer

    root = str(tmp_path / "out")
    codes, reasons = [], []
    for n, crash_at in enumerate(["before", "torn", "after", "none"]):
        code, _ = _run_writer(root, crash_at, 1000 * n)
        codes.append(code)
        c = ShardCommitter(root, "rl", 0, snapshot_every=2)
        c.log.live_set_every = 4
        if n % 2:
            _commit(c, 1, 4000 + n * 100)  # claims the log
            compact_partition(c.log, min_age_s=0, target_bytes=1 << 30)
            _commit(c, 4, 5000 + n * 100)  # a live set after the compaction, column-wise
        got, _ = _both(tmp_path, root, monkeypatch, f"kill{n}", grace_s=0, now=time.time() + 60 * n, older_than_s=90)
        reasons += [r for _, r, _ in got[0]]
        assert verify(Storage.from_uri(root)) == []
    assert codes[:3] == [-9, -9, -9] and codes[3] == 0
    assert {"replaced", "expired"} <= set(reasons)
