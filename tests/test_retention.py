"""Retention (store/retention.py, `rlrec retain`): replaced and expired shard files recorded in the
removal log and deleted after a grace period; as-of readers, the follower, compaction and gc
around it; hostile records; kill -9 of `rlrec retain`. Real local storage."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from rlrec.store import snapshot
from rlrec.store.commit import ShardCommitter
from rlrec.store.compaction import compact_partition
from rlrec.store.deletion import delete_files
from rlrec.store.maintenance import gc, verify
from rlrec.store.manifest import ManifestError, PartitionLog, ShardEntry, read_manifest
from rlrec.store.retention import (
    MAX_FILES_PER_RECORD,
    RemovalLogView,
    parse_record,
    read_removals,
    record_path,
    retain,
)
from rlrec.store.snapshot import CursorError, ExpiredPointError, cursor_at, open_snapshot
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes

ROOT = Path(__file__).resolve().parent.parent


def _commit(c: ShardCommitter, shards: int, seed0: int = 0, per: int = 2) -> list[str]:
    ids: list[str] = []
    for i in range(shards):
        res = c.commit(expert_cartpole_episodes(per, seed=seed0 + i, max_steps=20))
        ids += [fe.episode_id for fe in res.written]
    return ids


def _steps(snap) -> Counter:
    t = snap.steps()
    return Counter(zip(t.column("episode_id").to_pylist(), t.column("t").to_pylist()))


def _assert_exactly(snap, ids) -> None:
    """The snapshot reads every episode of `ids` and no other, each step once."""
    seen = _steps(snap)
    assert not seen or max(seen.values()) == 1
    assert {eid for eid, _ in seen} == set(ids)


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = b"" if os.path.islink(p) else open(p, "rb").read()
    return out


def _compacted_store(root: str, shards: int = 6):
    """`shards` small shards, compacted into one; (committer, ids, cursor before, cursor after)."""
    c = ShardCommitter(root, "rl", 0, snapshot_every=5)
    ids = _commit(c, shards)
    before = open_snapshot(root).cursor
    res = compact_partition(c.log, min_age_s=0)
    assert res.replaced == shards and res.written == 1
    return c, ids, before, open_snapshot(root).cursor


def _replaced(root: str) -> list[ShardEntry]:
    entries = PartitionLog(Storage.from_uri(root), "rl", 0).load()
    return [e for e in entries if isinstance(e, ShardEntry)]


# -- replaced files -------------------------------------------------------------------------------


def test_replaced_files_are_removed_after_grace_and_older_points_then_fail_clearly(tmp_path):
    root = str(tmp_path / "out")
    c, ids, before, after = _compacted_store(root)
    later_ids = _commit(c, 1, seed0=100)
    later = open_snapshot(root).cursor
    replaced = _replaced(root)[:6]

    res = retain(c.storage, grace_s=3600)  # recorded now, deleted after the grace
    assert sorted(f.seq for f in res.recorded) == sorted(e.seq for e in replaced)
    assert {f.reason for f in res.recorded} == {"replaced"} and res.deleted == []
    assert all(os.path.exists(os.path.join(root, e.path)) for e in replaced)
    _assert_exactly(open_snapshot(root, as_of=before), ids)  # within the grace: read as before

    assert retain(c.storage, grace_s=3600).recorded == []  # recorded once: a re-run adds nothing
    assert retain(c.storage, grace_s=0, now=time.time() + 3601).deleted  # the grace is over
    assert not any(os.path.exists(os.path.join(root, p)) for e in replaced for p in (e.path, e.staging_path))

    with pytest.raises(ExpiredPointError, match="retention removed 6 of its shard") as e:
        open_snapshot(root, as_of=before)
    assert "\n" not in str(e.value) and before[:20] in str(e.value) and isinstance(e.value, CursorError)
    for cur, want in ((after, ids), (later, ids + later_ids), (None, ids + later_ids)):
        _assert_exactly(open_snapshot(root, as_of=cur), want)
    assert sorted(i for e in read_manifest(c.storage) for i in e.episode_ids) == sorted(ids + later_ids)
    assert verify(c.storage) == []  # removed files are not "missing"


def test_changes_since_a_point_inside_a_removed_replacement_fail_clearly(tmp_path):
    """A replacement merging shards from both sides of `since` is read as its replaced shards
    after `since`: once retention deleted them, `changes` says the point is expired."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    first = _commit(c, 3)
    mid = open_snapshot(root).cursor
    second = _commit(c, 3, seed0=10)
    assert compact_partition(c.log, min_age_s=0).replaced == 6
    _assert_exactly(open_snapshot(root).changes(since=mid), second)
    retain(c.storage, grace_s=0)
    with pytest.raises(ExpiredPointError, match="since="):
        open_snapshot(root).changes(since=mid)
    _assert_exactly(open_snapshot(root), first + second)


def test_a_record_within_its_grace_keeps_older_points_readable_even_with_a_shorter_grace_now(tmp_path):
    root = str(tmp_path / "out")
    c, ids, before, _ = _compacted_store(root, 3)
    retain(c.storage, grace_s=3600)
    assert retain(c.storage, grace_s=0).deleted == []  # the record's own grace counts
    _assert_exactly(open_snapshot(root, as_of=before), ids)
    assert len(open_snapshot(root, as_of=before).files()) == 3


# -- expired files --------------------------------------------------------------------------------


def test_expired_shards_are_removed_newest_and_later_points_read_the_rest_older_points_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot, "APPEND_WINDOW_S", 0.05)  # S: as_of times this far back are fixed
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    _commit(c, 2)
    at_old = open_snapshot(root).cursor
    old_done = time.time()
    time.sleep(2.0)
    new_started = time.time()
    new = _commit(c, 2, seed0=10)
    at_both = open_snapshot(root).cursor
    before_retain = time.time()
    time.sleep(0.01)
    # the cut midway between the two commits, however long the second one took (a loaded machine)
    res = retain(c.storage, older_than_s=time.time() - (old_done + new_started) / 2, grace_s=0)
    assert [f.reason for f in res.recorded] == ["expired", "expired"]
    assert len(res.deleted) == 2  # two published files (their staging files are gone already)
    _assert_exactly(open_snapshot(root), new)
    after = open_snapshot(root).cursor  # taken after the removal: the expired shards are not part of it
    assert after.endswith("~rm=1") and after != at_both
    _assert_exactly(open_snapshot(root, as_of=after), new)
    for before in (at_old, at_both):  # at_both has the record's positions (a quiet partition): still before it
        with pytest.raises(ExpiredPointError, match="is expired: retention removed 2"):
            open_snapshot(root, as_of=before)
    time.sleep(0.1)
    with pytest.raises(ExpiredPointError):  # a time before the removal, on the same quiet log
        open_snapshot(root, as_of=before_retain)
    after_retain = time.time()
    time.sleep(0.1)
    _assert_exactly(open_snapshot(root, as_of=after_retain), new)  # a time after it
    newer = _commit(c, 1, seed0=20)
    _assert_exactly(open_snapshot(root), new + newer)
    _assert_exactly(open_snapshot(root).changes(since=at_both), newer)
    with pytest.raises(ExpiredPointError, match="since="):  # a reader at the start never read the old data
        open_snapshot(root).changes(since=cursor_at(root, {("rl", 0): 1}))  # the claim only
    assert verify(c.storage) == []


def test_a_merged_shard_expires_by_its_parts_first_commits_not_by_its_merge(tmp_path):
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    _commit(c, 3)
    time.sleep(1.2)
    assert compact_partition(c.log, min_age_s=0).written == 1  # merged just now, of old episodes
    res = retain(c.storage, older_than_s=0.8, grace_s=3600, dry_run=True)
    assert sorted(f.reason for f in res.recorded) == ["expired", "replaced", "replaced", "replaced"]

    # a merged shard holding one recent episode is not expired
    root2 = str(tmp_path / "out2")
    c2 = ShardCommitter(root2, "rl", 0)
    _commit(c2, 2)
    time.sleep(1.2)
    _commit(c2, 1, seed0=10)
    recent = time.time()
    assert compact_partition(c2.log, min_age_s=0).written == 1
    res2 = retain(c2.storage, older_than_s=0.8, grace_s=3600, dry_run=True, now=recent + 0.1)
    assert sorted(f.reason for f in res2.recorded) == ["replaced"] * 3


def test_pinned_paths_are_neither_expired_nor_deleted(tmp_path):
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    ids = _commit(c, 3)
    time.sleep(1.0)
    pinned = {open_snapshot(root).entries[1].path}
    res = retain(c.storage, older_than_s=0.5, grace_s=0, pinned=pinned)
    assert len(res.recorded) == 2 and pinned.isdisjoint(f.path for f in res.recorded)
    kept = list(open_snapshot(root).entries)
    assert [e.path for e in kept] == sorted(pinned)
    _assert_exactly(open_snapshot(root), [i for e in kept for i in e.episode_ids])
    assert set(ids) > set(kept[0].episode_ids)


def test_dry_run_changes_nothing(tmp_path):
    root = str(tmp_path / "out")
    _compacted_store(root, 3)
    time.sleep(0.6)
    before = _files(root)
    p = _cli("retain", root, "--older-than", "0.3s", "--grace", "0", "--no-lineage-pins", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert _files(root) == before
    assert p.stdout.count("would record replaced") == 3 and p.stdout.count("would record expired") == 1
    assert p.stdout.count("would delete") == 4  # the three replaced and the expired merged file
    assert "would record 4 shard(s)" in p.stderr


# -- readers and writers around retention ---------------------------------------------------------


def test_a_follower_started_after_retention_takes_the_merged_shard_once_in_place_of_the_removed(tmp_path, caplog):
    """A trainer started on a compacted store whose replaced files retention removed still gets
    every episode as new once: in the merged shard, standing for the entries it holds; expired
    shards are skipped (said once); a follower that delivered the originals before gets nothing
    again."""
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=5)
    ids = _commit(c, 4)
    early = ManifestFollower(Storage.from_uri(root))
    assert len(early.poll(force_discover=True)) == 4  # this follower delivered the originals
    assert compact_partition(c.log, min_age_s=0).written == 1
    fresh = _commit(c, 1, seed0=50)
    retain(c.storage, grace_s=0)
    assert not any(os.path.exists(os.path.join(root, e.path)) for e in _replaced(root)[:4])
    f = ManifestFollower(Storage.from_uri(root))
    with caplog.at_level(logging.WARNING, logger="rlrec.trainer"):
        got = f.poll(force_discover=True)
        assert f.poll(force_discover=True) == []
    delivered = [i for s in got for i in f.entries[s.path].episode_ids]
    assert sorted(delivered) == sorted(ids + fresh) and len(got) == 2
    merged = next(s.path for s in got if s.path in f.covers)
    key, seqs, paths = f.covers[merged]
    assert key == ("rl", 0) and len(seqs) == 4 and set(paths) == {e.path for e in _replaced(root)[:4]}
    assert f.removed_skipped == 0 and all(os.path.exists(os.path.join(root, s.path)) for s in got)
    assert early.poll(force_discover=True) and early.poll() == []  # only the fresh shard, once
    assert not early.covers


def test_a_follower_skips_expired_shards_and_says_so_once(tmp_path, caplog):
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    _commit(c, 3)
    time.sleep(0.05)
    fresh = _commit(c, 1, seed0=50)
    newest = max(e.commit_time for e in _replaced(root))
    retain(c.storage, grace_s=0, older_than_s=time.time() - newest + 0.01)
    f = ManifestFollower(Storage.from_uri(root))
    with caplog.at_level(logging.WARNING, logger="rlrec.trainer"):
        got = f.poll(force_discover=True)
    assert sorted(i for s in got for i in f.entries[s.path].episode_ids) == sorted(fresh)
    assert f.removed_skipped == 3
    assert len([r for r in caplog.records if "retention removed" in r.getMessage()]) == 1


def test_a_merged_shard_delivered_in_place_of_trained_shards_is_history():
    """A resumed trainer whose trained shards were merged and removed: the merged shard is
    history (none of its episodes trained as new twice), also when only part of it was trained."""
    from types import SimpleNamespace

    from rlrec.trainer.data import ManifestOfflineData

    covers = {"p/m.parquet": (("rl", 0), (1, 2), ("p/a.parquet", "p/b.parquet"))}
    od = SimpleNamespace(follower=SimpleNamespace(covers=covers), _trained_keys={"p/a.parquet"}, _trained_ranges={})
    assert ManifestOfflineData._trained_before(od, "p/m.parquet")
    od._trained_keys = {"p/a.parquet", "p/b.parquet"}
    assert ManifestOfflineData._trained_before(od, "p/m.parquet")
    od._trained_keys = {"p/other.parquet"}
    od._trained_ranges = {}
    assert not ManifestOfflineData._trained_before(od, "p/m.parquet")
    assert not ManifestOfflineData._trained_before(od, "p/x.parquet")
    # an earlier merged shard holding entry 1 was trained (its path is not among the entries'):
    # the checkpoint's ranges say so
    od._trained_keys, od._trained_ranges = {"p/m1.parquet"}, {("rl", 0): [(1, 2)]}
    assert ManifestOfflineData._trained_before(od, "p/m.parquet")
    od._trained_ranges = {("rl", 1): [(1, 3)]}  # another log's seqs
    assert not ManifestOfflineData._trained_before(od, "p/m.parquet")


def test_compaction_never_merges_removed_shards_and_survives_a_part_deleted_under_it(tmp_path):
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    _commit(c, 4)
    time.sleep(0.6)
    retain(c.storage, older_than_s=0.3, grace_s=3600)  # files still there: only the records say so
    assert compact_partition(c.log, min_age_s=0).replaced == 0

    class Blind(RemovalLogView):  # a compactor that has not seen the record yet
        def refresh(self):
            return []

    retain(c.storage, grace_s=0, now=time.time() + 3601)  # the files go
    res = compact_partition(c.log, min_age_s=0, removals=Blind(c.storage))  # plans them, finds them gone
    assert res.replaced == 0 and res.written == 0 and len(res.skipped) == 1, res


def test_gc_and_retention_share_one_deletion_path_that_refuses_links_and_manifest_paths(tmp_path):
    root = tmp_path / "out"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.parquet").write_bytes(b"keep")
    st = Storage.from_uri(str(root))
    st.write("expert/a.parquet", b"x")
    st.write("_manifest/rl/00000/000000000000.json", b"{}")
    os.symlink(outside, root / "evil")
    os.symlink(outside / "x.parquet", root / "expert" / "link.parquet")
    got = delete_files(
        st,
        [
            "expert/a.parquet",
            "evil/x.parquet",
            "expert/link.parquet",
            "_manifest/rl/00000/000000000000.json",
            "../outside/x.parquet",
            "expert/_staging/../../outside/x.parquet",
        ],
    )
    assert got == ["expert/a.parquet"]
    assert (outside / "x.parquet").read_bytes() == b"keep" and (root / "_manifest/rl/00000/000000000000.json").exists()
    assert (root / "expert" / "link.parquet").is_symlink()
    import rlrec.store.deletion as deletion
    import rlrec.store.maintenance as maintenance
    import rlrec.store.retention as retention

    assert maintenance.delete_files is retention.delete_files is deletion.delete_files


def test_an_expired_shard_still_staged_is_deleted_from_staging(tmp_path):
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    _commit(c, 1)
    e = open_snapshot(root).entries[0]
    os.rename(os.path.join(root, e.path), os.path.join(root, e.staging_path))  # committed, not published
    time.sleep(0.3)
    res = retain(c.storage, older_than_s=0.1, grace_s=0)
    assert res.deleted == [e.staging_path] and not os.path.exists(os.path.join(root, e.staging_path))
    assert open_snapshot(root).entries == []


# -- hostile records ------------------------------------------------------------------------------


def _record(n: int, files: list[dict], positions=None) -> bytes:
    return json.dumps(
        {
            "type": "removal",
            "version": 1,
            "n": n,
            "time": 0.0,
            "grace_s": 0.0,
            "positions": positions if positions is not None else {"rl/0": 1000},
            "files": files,
        }
    ).encode()


def _file(path: str, staging: str | None = None, seq: int = 1) -> dict:
    name = path.rsplit("/", 1)[-1]
    return {
        "topic": "rl",
        "partition": 0,
        "seq": seq,
        "path": path,
        "staging_path": staging if staging is not None else f"{path.split('/')[0]}/_staging/{name}",
        "reason": "expired",
    }


@pytest.mark.parametrize(
    "files",
    [
        [_file("../outside/x.parquet")],
        [_file("_manifest/rl/00000/000000000000.json", "_manifest/_staging/x")],
        [_file("_manifest/x.json", "_manifest/_staging/x.json")],
        [_file("/etc/passwd", "/etc/_staging/passwd")],
        [_file("expert/a.parquet", "other/_staging/a.parquet")],
        [_file("expert/sub/a.parquet", "expert/_staging/sub/a.parquet")],
        [{**_file("expert/a.parquet"), "extra": 1}],
        [{**_file("expert/a.parquet"), "seq": True}],
        [{**_file("expert/a.parquet"), "reason": "because"}],
        [_file("expert/a.parquet", seq=5000)],  # not below the record's positions
    ],
)
def test_a_hostile_record_is_refused_strictly(files):
    with pytest.raises(ManifestError):
        parse_record(_record(0, files), 0)


def test_hostile_records_delete_nothing_outside_and_nothing_the_manifest_does_not_name(tmp_path):
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    _commit(c, 2)
    live = open_snapshot(root).entries
    st = c.storage
    outside = tmp_path / "outside.parquet"
    outside.write_bytes(b"keep")
    # a well-formed record naming a live shard under another entry's seq, and a made-up file
    st.create_once(
        record_path(0),
        _record(0, [_file(live[0].path, seq=int(live[1].seq)), _file("expert/made-up.parquet", seq=0)]),
    )
    st.write("expert/made-up.parquet", b"x")
    res = retain(st, grace_s=0)
    assert res.deleted == [] and all(os.path.exists(os.path.join(root, e.path)) for e in live)
    assert os.path.exists(os.path.join(root, "expert/made-up.parquet"))
    _assert_exactly(open_snapshot(root), [i for e in live for i in e.episode_ids])  # nothing hidden
    # a record with a traversal path: every reader and retain refuse the log, nothing deleted
    st.create_once(record_path(1), _record(1, [_file("../outside.parquet", "../_staging/outside.parquet")]))
    with pytest.raises(ManifestError, match="removal record 1"):
        retain(st, grace_s=0)
    with pytest.raises(ManifestError):
        open_snapshot(root)
    p = _cli("retain", root, "--grace", "0")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and p.stderr.startswith("rlrec retain: error:")
    assert outside.read_bytes() == b"keep"


def test_retention_through_a_symlinked_policy_directory_deletes_nothing_outside(tmp_path):
    root = tmp_path / "out"
    c, _, _, _ = _compacted_store(str(root), 3)
    replaced = _replaced(str(root))[:3]
    outside = tmp_path / "outside"
    os.rename(root / "expert", outside)  # the policy directory is now a link out of the root
    os.symlink(outside, root / "expert")
    before = _files(str(outside))
    res = retain(c.storage, grace_s=0)
    assert len(res.recorded) == 3 and res.deleted == []
    assert _files(str(outside)) == before and all((outside / e.path.split("/", 1)[1]).exists() for e in replaced)


def test_a_lost_create_once_race_retries_on_the_next_number_without_naming_a_file_twice(tmp_path):
    root = str(tmp_path / "out")
    c, _, _, _ = _compacted_store(root, 3)
    st = c.storage
    real = Storage.create_once
    raced = []

    def racing(self, path, data):  # another retain wins record 0 first, naming one of our files
        if path == record_path(0) and not raced:
            raced.append(1)
            from rlrec.store.retention import RemovedFile

            mine = RemovedFile.of(_replaced(root)[0], "replaced")
            real(self, path, _record(0, [mine.to_dict()], {"rl/0": 10}))
        return real(self, path, data)

    Storage.create_once = racing
    try:
        res = retain(st, grace_s=3600)
    finally:
        Storage.create_once = real
    assert [r.n for r in res.records] == [1] and len(res.records[0].files) == 2
    recs = read_removals(st)
    named = [f.key for r in recs for f in r.files]
    assert len(named) == len(set(named)) == 3


def test_a_big_removal_is_split_across_records(tmp_path, monkeypatch):
    import rlrec.store.retention as retention

    monkeypatch.setattr(retention, "MAX_FILES_PER_RECORD", 2)
    root = str(tmp_path / "out")
    c, _, _, _ = _compacted_store(root, 5)
    res = retain(c.storage, grace_s=3600)
    assert [len(r.files) for r in res.records] == [2, 2, 1] and [r.n for r in res.records] == [0, 1, 2]
    assert MAX_FILES_PER_RECORD == 1000


def test_records_of_long_paths_stay_readable():
    from rlrec.store.retention import MAX_RECORD_BYTES, RemovalRecord, RemovedFile, _chunk

    name = "t" * 249 + "+00000+" + "0" * 20 + "+" + "0" * 20 + "+e1.c0123456789ab.parquet"
    files = [
        RemovedFile("t" * 249, 0, i, f"{'p' * 200}/{name}", f"{'p' * 200}/_staging/{name}", "expired")
        for i in range(1000)
    ]
    chunk, rest = _chunk(files)
    assert 0 < len(chunk) < 1000 and chunk + rest == files
    data = RemovalRecord(0, 1.0, 0.0, {("t" * 249, 0): 1000}, tuple(chunk)).to_json().encode()
    assert len(data) <= MAX_RECORD_BYTES and len(parse_record(data, 0).files) == len(chunk)


# -- kill -9 ---------------------------------------------------------------------------------------

_RETAIN = textwrap.dedent(
    """
    import os, signal, sys
    import rlrec.store.retention as retention
    from rlrec.store.storage import Storage
    root, kill_at = sys.argv[1], int(sys.argv[2])
    retention.MAX_FILES_PER_RECORD = 2
    calls = [0]
    for name in ("create_once", "delete"):
        real = getattr(Storage, name)
        def wrapper(self, *a, _real=real, **k):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9 before this write
            out = _real(self, *a, **k)
            if calls[0] == -kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9 after it
            return out
        setattr(Storage, name, wrapper)
    sys.argv = ["rlrec", "retain", root, "--older-than", "1h", "--grace", "0", "--no-lineage-pins"]
    from rlrec.cli import main
    sys.exit(main())
    """
)


@pytest.mark.slow
def test_kill_9_of_rlrec_retain_at_random_points_then_a_rerun_converges(tmp_path):
    root = str(tmp_path / "out")
    c, ids, before, after = _compacted_store(root, 5)
    more = _commit(c, 2, seed0=40)
    replaced = _replaced(root)[:5]
    # 5 replaced files: 3 records (2 files each at most), then 5 deletes (their staging files are gone)
    points = random.Random(7).sample([*range(1, 9), *range(-8, 0)], 5)
    codes = []
    for k in points:
        p = subprocess.run([sys.executable, "-c", _RETAIN, root, str(k)], capture_output=True, text=True, timeout=120)
        codes.append(p.returncode)
        assert p.returncode in (0, -signal.SIGKILL), p.stderr[-2000:]
        _assert_exactly(open_snapshot(root), ids + more)  # the newest point never fails, whatever a kill left
        _assert_exactly(open_snapshot(root, as_of=after), ids)
    assert -signal.SIGKILL in codes, points
    p = subprocess.run([sys.executable, "-c", _RETAIN, root, "0"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    named = [f.key for r in read_removals(c.storage) for f in r.files]
    assert sorted(named) == sorted(("rl", 0, e.seq) for e in replaced)  # each once, whatever the kills
    assert not any(os.path.exists(os.path.join(root, p)) for e in replaced for p in (e.path, e.staging_path))
    _assert_exactly(open_snapshot(root), ids + more)
    with pytest.raises(ExpiredPointError):
        open_snapshot(root, as_of=before)
    assert gc(c.storage, 0) == []  # nothing left behind for gc
    assert verify(c.storage) == []


# -- the command line ------------------------------------------------------------------------------


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlrec", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--older-than", "30d"], "give --policies URI"),
        (["--older-than", "soon"], "not a duration"),
        (["--older-than", "0"], "--older-than must be more than 0"),
        (["--policies", "/nope", "--no-lineage-pins"], "contradict"),
        (["--keep-versions", "-1"], "--keep-versions must be 0 or more"),
        (["--keep-versions", "2", "--no-lineage-pins"], "--keep-versions needs --policies"),
        (["--keep-versions", "2"], "--keep-versions needs --policies"),
        (["--policies", "{tmp}/nothing-published", "--older-than", "1d"], "nothing is published under"),
        (["--no-lineage-pins", "RLREC_OLDER_THAN=1s"], "RLREC_OLDER_THAN is not read here"),  # gc's grace
    ],
)
def test_cli_mistakes_are_one_line_with_exit_2(tmp_path, args, msg):
    root = str(tmp_path / "out")
    _commit(ShardCommitter(root, "rl", 0), 1)
    env = dict(a.split("=", 1) for a in args if a.startswith("RLREC_"))
    args = [a.replace("{tmp}", str(tmp_path)) for a in args if not a.startswith("RLREC_")]
    p = _cli("retain", root, *args, env=env)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("rlrec retain: error:") and msg in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(root, "_manifest", "_removed"))


def test_cli_removes_replaced_files_without_policies(tmp_path):
    root = str(tmp_path / "out")
    _compacted_store(root, 3)
    p = _cli("retain", root, "--grace", "0")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert sum(x.startswith("record replaced ") for x in lines) == 3
    assert sum(x.startswith("delete ") for x in lines) == 3
    assert "record 3 shard(s) as removed (0 expired, 3 replaced) and delete 3 file(s)" in p.stderr
    assert read_removals(Storage.from_uri(root))[0].files[0].reason == "replaced"


# -- lineage pins ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_lineage_pins_keep_the_deployed_version_and_its_rollback_candidates(tmp_path):
    """v1 trained on A1, v2 on A2, v3 (deployed) on A2 and A3: with --keep-versions 1 only A1,
    pinned by v1 alone, expires; with 2 nothing does. v3's data still reopens, v1's is expired."""
    import rlrec
    from rlrec.trainer.retention_pins import pinned_files
    from rlrec.trainer.signing import generate_keys
    from tests.test_lineage import _publish_version

    root = str(tmp_path / "s")
    pol = str(tmp_path / "pol")
    priv, _ = generate_keys(tmp_path / "keys")
    c = ShardCommitter(root, "rl", 0)
    a1 = _commit(c, 1)
    _publish_version(pol, 1, root, str(priv), run_id="run-a")
    a1_path = open_snapshot(root).entries[0].path
    a2 = _commit(c, 1, seed0=1)
    _publish_version(pol, 2, root, str(priv), run_id="run-a", skip=a1_path)
    a3 = _commit(c, 1, seed0=2)
    _publish_version(pol, 3, root, str(priv), run_id="run-a", skip=a1_path)
    pins2, versions2 = pinned_files(Storage.from_uri(root), pol, 2)
    assert versions2.versions == (1, 2, 3) and versions2.deployed == 3 and a1_path in pins2
    pins1, versions1 = pinned_files(Storage.from_uri(root), pol, 1)
    assert versions1.versions == (2, 3) and a1_path not in pins1 and len(pins1) == 2
    time.sleep(1.2)
    st = Storage.from_uri(root)
    p = _cli("retain", root, "--older-than", "1s", "--policies", pol, "--keep-versions", "1", "--grace", "0")
    assert p.returncode == 0, p.stderr
    assert "keeping the data of policy versions 2, 3 (deployed: 3): 2 shard(s)" in p.stderr
    assert [x.split()[1:3] for x in p.stdout.splitlines() if x.startswith("record")] == [["expired", st.uri(a1_path)]]
    fresh = _commit(c, 1, seed0=3)
    t = time.time()
    assert retain(st, older_than_s=0.5, pinned=pins2, dry_run=True, now=t + 0.1).recorded == []  # fresh: too young
    assert not os.path.exists(os.path.join(root, a1_path))
    v3 = rlrec.open(root, policy_version=3, policies=pol, allow_unsigned=True)
    held3 = rlrec.open(root, policy_version=3, policies=pol, allow_unsigned=True, held_out=True)
    assert {i for i, _ in _steps(v3) + _steps(held3)} == set(a2 + a3)  # either side of the split: ids are random
    assert a1_path not in {e.path for e in v3.entries}
    with pytest.raises(ExpiredPointError):
        rlrec.open(root, policy_version=1, policies=pol, allow_unsigned=True)
    assert set(fresh) <= {i for e in open_snapshot(root).entries for i in e.episode_ids}
    assert not set(a1) & {i for e in open_snapshot(root).entries for i in e.episode_ids}


def test_retain_options_default_to_the_library_defaults():
    """rlrec/commands/ imports only the standard library at module level, so the command repeats
    the library's defaults: they must agree."""
    from rlrec.commands.retain import RetainOptions
    from rlrec.store.retention import DEFAULT_GRACE_S

    assert RetainOptions(uri="x").grace == DEFAULT_GRACE_S
    assert RetainOptions(uri="x").keep_versions is None  # DEFAULT_KEEP_VERSIONS with --policies


# -- races: pins, compaction, records ------------------------------------------------------------


def _sleep_past(t: float) -> None:
    while time.time() <= t:
        time.sleep(0.01)


def test_a_pin_by_entry_follows_its_episodes_into_a_merged_shard(tmp_path):
    """Pins taken while a pinned shard P is live; compaction then merges P with old shards into
    M before retain reads the logs: M holds the pinned entry, so it is neither expired nor
    deleted (a pin by path would name P, which is no longer live, and M would expire)."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    ids = _commit(c, 3)
    p = open_snapshot(root).entries[2]
    by_path, by_entry = {p.path}, {("rl", 0): [(p.seq, p.seq + 1)]}
    _sleep_past(max(e.commit_time for e in _replaced(root)) + 0.3)
    assert compact_partition(c.log, min_age_s=0).written == 1  # after the pins were taken
    merged = open_snapshot(root).entries[0]
    stale = retain(c.storage, older_than_s=0.2, grace_s=0, pinned=by_path, dry_run=True).recorded
    assert ("expired", merged.path) in {(f.reason, f.path) for f in stale}  # what a path pin lets happen
    res = retain(c.storage, older_than_s=0.2, grace_s=0, pinned_entries=by_entry)
    assert sorted(f.reason for f in res.recorded) == ["replaced"] * 3
    assert os.path.exists(os.path.join(root, merged.path))
    _assert_exactly(open_snapshot(root), ids)
    # unpinned, it expires
    assert [f.path for f in retain(c.storage, older_than_s=0.2, grace_s=0).recorded] == [merged.path]


@pytest.mark.slow
def test_lineage_pins_taken_before_a_compaction_still_keep_the_version_s_data(tmp_path, monkeypatch):
    """`rlrec retain --policies` computes the pins, then a compaction merges the deployed
    version's only shard with an old unpinned one before retain reads the logs: the merged shard
    holds the pinned entry, so it is kept and the version's data (both sides of its held-out
    split, whichever side each episode's random id falls on) still reopens, step for step."""
    import rlrec
    import rlrec.trainer.retention_pins as retention_pins
    from rlrec.cli import main
    from rlrec.trainer.signing import generate_keys
    from tests.test_lineage import _publish_version

    root = str(tmp_path / "s")
    pol = str(tmp_path / "pol")
    priv, _ = generate_keys(tmp_path / "keys")
    c = ShardCommitter(root, "rl", 0)
    old = _commit(c, 1)
    old_path = open_snapshot(root).entries[0].path
    pinned = _commit(c, 1, seed0=1)
    _publish_version(pol, 1, root, str(priv), run_id="run-a", skip=old_path)  # trained on the 2nd shard only

    def version_steps() -> list[Counter]:  # the trained side, then the held-out side
        sides = (False, True)
        return [
            _steps(rlrec.open(root, policy_version=1, policies=pol, allow_unsigned=True, held_out=h)) for h in sides
        ]

    before = version_steps()
    assert {i for i, _ in before[0] + before[1]} == set(pinned)  # the pinned shard's episodes, all read
    _sleep_past(max(e.commit_time for e in _replaced(root)) + 0.3)
    real = retention_pins.lineage_pins

    calls = []

    def pins_then_compact(*a, **kw):  # a compaction between the pins and retain's reading of the logs
        got = real(*a, **kw)
        if not calls:  # the first pins only (retain asks again before its records and its deletes)
            assert compact_partition(c.log, min_age_s=0).written == 1
        calls.append(1)
        return got

    monkeypatch.setattr(retention_pins, "lineage_pins", pins_then_compact)
    assert main(["retain", root, "--older-than", "0.2s", "--policies", pol, "--grace", "0"]) == 0
    live = open_snapshot(root).entries
    assert len(live) == 1 and os.path.exists(os.path.join(root, live[0].path))  # the merged shard stays
    assert set(live[0].episode_ids) == set(old + pinned)
    assert version_steps() == before  # every step of the version's data, on the same side of the split


def test_a_merge_of_a_part_retention_expires_meanwhile_is_not_committed(tmp_path, monkeypatch):
    """retain records part A of a running merge of A+B as expired between the merge and the
    replace entry: the merge is dropped (its staged file left for gc), so the newest point never
    serves A's expired episodes again through the merged shard."""
    import rlrec.store.compaction as compaction

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    _commit(c, 1)
    _sleep_past(_replaced(root)[0].commit_time + 0.05)
    fresh = _commit(c, 1, seed0=1)
    a, b = _replaced(root)
    real = compaction._merge_run

    def merge_then_retain(*args, **kw):  # retain runs while the merge is staged, before the append
        got = real(*args, **kw)
        res = retain(c.storage, older_than_s=(b.commit_time - a.commit_time) / 2, grace_s=3600, now=b.commit_time)
        assert [(f.reason, f.seq) for f in res.recorded] == [("expired", a.seq)]
        return got

    monkeypatch.setattr(compaction, "_merge_run", merge_then_retain)
    res = compact_partition(c.log, min_age_s=0)
    assert res.written == 0 and "retention removed" in res.skipped[0], res
    assert not [e for e in PartitionLog(c.storage, "rl", 0).load() if type(e).__name__ == "ReplaceEntry"]
    assert os.listdir(os.path.join(root, a.policy_id, "_staging"))  # the orphan, for gc
    _assert_exactly(open_snapshot(root), fresh)
    monkeypatch.setattr(compaction, "_merge_run", real)
    assert compact_partition(c.log, min_age_s=0).written == 0  # A stays out of later plans


def test_the_removal_log_view_reads_records_past_a_gap_as_read_removals_does(tmp_path, monkeypatch):
    """A pruned record 0 (or one in the middle) does not hide the later records from the view
    (the follower's and compaction's reader): one listing at most per refresh finds them."""
    import rlrec.store.retention as retention
    from rlrec.trainer.manifest_follower import ManifestFollower

    monkeypatch.setattr(retention, "MAX_FILES_PER_RECORD", 1)
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    _commit(c, 4)
    time.sleep(0.3)
    st = c.storage
    assert len(retain(st, older_than_s=0.1, grace_s=3600).records) == 4
    os.remove(os.path.join(root, record_path(0)))
    os.remove(os.path.join(root, record_path(2)))
    entries = PartitionLog(st, "rl", 0).load()
    listings = []
    real_list = Storage.list
    monkeypatch.setattr(Storage, "list", lambda self, p, *a, **k: listings.append(p) or real_list(self, p, *a, **k))
    view = RemovalLogView(st)
    assert [r.n for r in view.refresh()] == [r.n for r in read_removals(st)] == [1, 3]
    assert listings == [retention.REMOVED_DIR] * 2  # one listing per refresh (the view's), plus read_removals'
    named = {f.seq for r in read_removals(st) for f in r.files}
    assert view.seqs("rl", 0, entries) == named and len(named) == 2
    listings.clear()
    assert view.refresh() == [] and listings == []  # an idle poll: one probe, no listing
    view.list_interval_s = 0.0  # ... until the listing interval has passed
    assert view.refresh() == [] and len(listings) == 1
    for r in read_removals(st):  # deleted (a recorded shard whose file is still there is delivered)
        for rf in r.files:
            st.delete(rf.path)
    f = ManifestFollower(st)
    got = f.poll(force_discover=True)
    assert f.removed_skipped == 2 and len(got) == 2  # the two shards records 0 and 2 named are not removed


def test_a_record_naming_a_seq_whose_entry_commits_another_file_removes_nothing_for_the_view(tmp_path):
    """The view resolves a record against the log as readers do (`resolve_removals`): a forged or
    stale record -- the right seq, another file -- makes neither the follower skip the shard nor
    compaction leave it out."""
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    ids = _commit(c, 3)
    live = open_snapshot(root).entries
    st = c.storage
    forged = _file(live[0].path, seq=int(live[1].seq))  # seq of shard 1, file of shard 0
    made_up = _file("expert/made-up.parquet", seq=int(live[2].seq))  # a file no entry commits
    st.create_once(record_path(0), _record(0, [forged, made_up], {"rl/0": 10}))
    view = RemovalLogView(st)
    view.refresh()
    assert view.seqs("rl", 0, PartitionLog(st, "rl", 0).load()) == set()
    f = ManifestFollower(st)
    got = f.poll(force_discover=True)
    assert f.removed_skipped == 0 and sorted(i for s in got for i in f.entries[s.path].episode_ids) == sorted(ids)
    assert compact_partition(c.log, min_age_s=0).replaced == 3
    # a record naming the entry's own files does count
    st.create_once(record_path(1), _record(1, [_file(live[1].path, live[1].staging_path, seq=int(live[1].seq))]))
    view.refresh()
    assert view.seqs("rl", 0, PartitionLog(st, "rl", 0).load()) == {live[1].seq}
