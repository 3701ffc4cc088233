"""`rlrec export URI URI --to delta`: a read-only Delta Lake view of the store (rlrec.delta_view).

Every Delta version is read by polars (`read_delta(version=)`) and DuckDB (over
`DeltaTable(...).to_pyarrow_dataset()`) and compared with what `rlrec.open` reads at the cursor
the version's txns map to, through compaction and retention, on local disk and moto S3; engines'
VACUUM / OPTIMIZE / DELETE on the view leave every shard in place; kill -9 of `--follow`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter

import pytest

if os.environ.get("RLREC_TEST_REQUIRE_EMULATORS"):  # CI installs the delta extra: a missing one fails
    import deltalake
    import duckdb
    import polars as pl
else:
    deltalake = pytest.importorskip("deltalake")
    pl = pytest.importorskip("polars")
    duckdb = pytest.importorskip("duckdb")

from rlrec import delta_view
from rlrec.cli import main
from rlrec.delta_view import LOG_DIR, ViewError, export_views, storage_options, version_cursor
from rlrec.store.commit import ShardCommitter
from rlrec.store.compaction import compact_partition
from rlrec.store.retention import retain
from rlrec.store.snapshot import ExpiredPointError, open_snapshot
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes

POLICY = "expert"  # expert_cartpole_episodes' policy id


def _commit(c: ShardCommitter, shards: int, seed0: int) -> None:
    for i in range(shards):
        c.commit(expert_cartpole_episodes(2, seed=seed0 + i, max_steps=15))


def _rlrec_ids(uri: str, cursor: str, policy: str = POLICY, fmt: str = "episodes") -> Counter:
    """What `rlrec.open` reads at `cursor` of `policy`'s shards: {episode id: episodes} (episode
    shards: a row per episode) or {episode id: steps} (tabular shards: a row per step)."""
    t = open_snapshot(uri, as_of=cursor).steps()
    rows = zip(*(t.column(c).to_pylist() for c in ("episode_id", "policy_id", "t")))
    return Counter(e for e, p, step in rows if p == policy and (fmt == "tabular" or step == 0))


def _delta_ids(uri: str, version: int, fmt: str = "episodes") -> tuple[Counter, Counter]:
    """{episode id: rows} of Delta version `version`, as polars and as DuckDB read it."""
    col = "eps_id" if fmt == "tabular" else "episode_id"
    opts = storage_options(uri)
    frame = pl.read_delta(
        uri, version=version, storage_options=opts or None, columns=None if col == "episode_id" else [col]
    )
    by_polars = Counter(frame[col].to_list())
    dataset = deltalake.DeltaTable(uri, version=version, storage_options=opts).to_pyarrow_dataset()  # noqa: F841
    rows = duckdb.sql(f"select {col} from dataset").fetchall()
    return by_polars, Counter(r[0] for r in rows)


def _check_every_version(store_uri: str, policy: str = POLICY, fmt: str = "episodes") -> tuple[int, int]:
    """For every version of `policy`'s view: polars and DuckDB read exactly the rows rlrec.open
    reads at the mapped cursor, or all three refuse the point as expired. Returns (versions
    checked, versions expired)."""
    view = f"{store_uri.rstrip('/')}/{policy}"
    newest, _ = version_cursor(store_uri, policy)
    expired = 0
    for v in range(newest + 1):
        got_v, cursor = version_cursor(store_uri, policy, v)
        assert got_v == v
        try:
            want = _rlrec_ids(store_uri, cursor, policy, fmt)
        except ExpiredPointError:
            # rlrec refuses a point once any of its shards is deleted, whatever its policy; the view
            # refuses once one of *its* shards is: it reads the manifest's episodes of its policy there
            mine = _policy_shards_at(store_uri, cursor, policy)
            if all(Storage.from_uri(store_uri).exists(e.path) for e in mine):
                want = Counter(i for e in mine for i in e.episode_ids)
                assert fmt == "episodes" and _delta_ids(view, v, fmt) == (want, want), f"{policy} version {v}"
                continue
            expired += 1
            with pytest.raises(Exception, match=r"(?i)not found|no such file|does not exist|404"):
                _delta_ids(view, v, fmt)
            continue
        by_polars, by_duckdb = _delta_ids(view, v, fmt)
        assert by_polars == want, f"{policy} version {v} ({cursor}): polars reads other rows than rlrec.open"
        assert by_duckdb == want, f"{policy} version {v} ({cursor}): DuckDB reads other rows than rlrec.open"
    return newest + 1, expired


def _policy_shards_at(uri: str, cursor: str, policy: str) -> list:
    """`policy`'s live shards at `cursor` by the manifest's own rules (live_shards less the
    records in effect), without the check that their files are there."""
    from rlrec.store.manifest import PartitionLog, live_shards
    from rlrec.store.retention import read_removals, resolve_removals
    from rlrec.store.snapshot import Cursor, counted_records

    st = Storage.from_uri(uri)
    c = Cursor.parse(cursor)
    logs = {k: PartitionLog(st, *k).load() for k in c.positions}
    records = read_removals(st)
    removed = resolve_removals(records, logs)
    dropped = {
        f.key
        for r in counted_records(records, c.positions, c.removals)
        for f in r.files
        if f.key in removed and removed[f.key][1].path == f.path
    }
    return [
        e
        for k, es in logs.items()
        for e in live_shards(es, below=c.positions[k]).values()
        if e.policy_id == policy and (e.topic, e.partition, e.seq) not in dropped
    ]


def _wait_followed(uri: str) -> None:
    """Wait (60 s at most) until the view's newest version is at the store's cursor."""
    deadline = time.monotonic() + 60
    while version_cursor(uri, POLICY)[1] != open_snapshot(uri).cursor:
        assert time.monotonic() < deadline, "follow did not catch up"
        time.sleep(0.05)


def _history(uri: str, storage: Storage, *, exports: bool = True) -> None:
    """Two partitions' commits, exports in between (unless `exports` is False: a follower runs),
    a compaction, retention of the replaced shards, then of everything (deleted at once): the
    crossings a view must mirror."""

    def export_views(uri: str) -> None:
        if exports:
            globals()["export_views"](uri)
        else:  # the follower's view holds everything so far, however late a busy machine runs it
            _wait_followed(uri)

    c0, c1 = ShardCommitter(uri, "rl", 0), ShardCommitter(uri, "rl", 1)
    _commit(c0, 3, 0)
    export_views(uri)
    _commit(c1, 2, 10)
    _commit(c0, 1, 20)
    assert compact_partition(c0.log, min_age_s=0).replaced == 4
    export_views(uri)
    assert len(retain(storage, grace_s=3600).recorded) == 4  # the replaced shards (kept: grace)
    _commit(c1, 1, 30)
    export_views(uri)
    time.sleep(0.3)
    res = retain(storage, grace_s=0, older_than_s=0.2)  # everything expires, deleted at once
    assert res.recorded and res.deleted
    _commit(c0, 1, 40)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "local-live-sets", "s3", "azure"])
def test_every_version_reads_what_rlrec_open_reads_at_its_cursor(where, tmp_path, request, monkeypatch):
    if where.startswith("local"):
        uri = str(tmp_path / "out")
        if where == "local-live-sets":  # head readers read live sets (issue 47); the view, the logs
            import rlrec.store.commit
            import rlrec.store.live_set

            monkeypatch.setattr(rlrec.store.commit, "SNAPSHOT_EVERY", 2)
            monkeypatch.setattr(rlrec.store.live_set, "LIVE_SET_EVERY", 2)
    elif where == "s3":
        s3 = request.getfixturevalue("local_s3")
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        bucket = s3.create_bucket(f"t-{uuid.uuid4().hex[:10]}")
        uri = f"s3://{bucket}/out"
    else:  # Azurite
        az = request.getfixturevalue("local_azurite")
        for k, v in az.env().items():
            monkeypatch.setenv(k, v)
        uri = f"az://{az.create_container(f't{uuid.uuid4().hex[:10]}')}/out"
    storage = Storage.from_uri(uri)
    _history(uri, storage)
    first = export_views(uri)
    assert [r.policy_id for r in first] == [POLICY] and first[0].commits > 0
    assert export_views(uri)[0].commits == 0, "a rerun added commits"
    assert first[0].cursor == open_snapshot(uri).cursor  # the newest version is the newest point
    versions, expired = _check_every_version(uri)
    assert versions >= 10 and 0 < expired < versions
    if where == "local-live-sets":
        from rlrec.store.live_set import live_set_seqs
        from rlrec.store.maintenance import verify

        assert all(live_set_seqs(storage, "rl", p) for p in (0, 1)), "no live set was written"
        assert verify(storage) == []
    # the shards retention deleted: the versions holding them refuse, as rlrec.open does there
    view = f"{uri}/{POLICY}"
    assert pl.read_delta(view, storage_options=storage_options(view) or None).height == 2


def test_a_view_mirrors_each_entry_with_one_commit_and_the_txns_of_its_point(tmp_path):
    uri = str(tmp_path / "out")
    c = ShardCommitter(uri, "rl", 0)
    _commit(c, 3, 0)
    [res] = export_views(uri)
    assert (res.version, res.commits) == (2, 3)  # the first commit creates the table with the first shard
    assert compact_partition(c.log, min_age_s=0).replaced == 3
    [res] = export_views(uri)
    assert (res.version, res.commits) == (3, 1)
    actions = [json.loads(line) for line in open(tmp_path / "out" / POLICY / LOG_DIR / f"{3:020d}.json")]
    kinds = Counter(next(iter(a)) for a in actions)
    assert kinds == {"commitInfo": 1, "remove": 3, "add": 1, "txn": 1}
    assert all(a[k]["dataChange"] is False for a in actions for k in a if k in ("add", "remove"))
    [txn] = [a["txn"] for a in actions if "txn" in a]
    assert txn["appId"] == "rlrec:rl/0" and txn["version"] == c.log.next_seq  # seq + 1 of the replace entry
    assert version_cursor(uri, POLICY)[1] == open_snapshot(uri).cursor
    dt = deltalake.DeltaTable(str(tmp_path / "out" / POLICY))
    assert dt.protocol().writer_features == [delta_view.VIEW_FEATURE] and dt.protocol().min_reader_version == 1


def _store_files(root) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
        for d, _, fs in os.walk(root)
        if LOG_DIR not in d
        for f in fs
    }


def test_vacuum_optimize_and_delete_by_an_engine_touch_no_shard(tmp_path, monkeypatch):
    """delta-rs's vacuum (lite and full, retention 0), optimize and delete on the view are refused
    by its protocol; every file of the store stays. Without the view's writer feature the same
    vacuum deletes rlrec's replaced shards: the protection is what keeps them."""
    uri = str(tmp_path / "out")
    c = ShardCommitter(uri, "rl", 0)
    _commit(c, 3, 0)
    compact_partition(c.log, min_age_s=0)
    _commit(c, 1, 10)
    export_views(uri)
    before = _store_files(uri)
    dt = deltalake.DeltaTable(f"{uri}/{POLICY}")
    engines = {
        "vacuum": lambda: dt.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False),
        "vacuum full": lambda: dt.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False, full=True),
        "optimize": lambda: dt.optimize.compact(),
        "z-order": lambda: dt.optimize.z_order(["policy_version"]),
        "delete": lambda: dt.delete("policy_version >= 0"),
    }
    for name, run in engines.items():
        with pytest.raises(Exception, match=delta_view.VIEW_FEATURE):
            run()
        assert _store_files(uri) == before, f"{name} changed the store"
    assert export_views(uri)[0].commits == 0  # and the view is untouched: nothing to do, nothing refused

    # the control: the same view without the feature loses rlrec's replaced shards to a vacuum
    other = str(tmp_path / "plain")
    monkeypatch.setattr(delta_view, "PROTOCOL", {"minReaderVersion": 1, "minWriterVersion": 2})
    c2 = ShardCommitter(other, "rl", 0)
    _commit(c2, 3, 0)
    compact_partition(c2.log, min_age_s=0)
    export_views(other)
    deleted = deltalake.DeltaTable(f"{other}/{POLICY}").vacuum(
        retention_hours=0, enforce_retention_duration=False, dry_run=False
    )
    assert len(deleted) == 3


def test_a_view_another_writer_changed_is_refused_not_extended(tmp_path):
    uri = str(tmp_path / "out")
    c = ShardCommitter(uri, "rl", 0)
    _commit(c, 2, 0)
    [res] = export_views(uri)
    log_dir = tmp_path / "out" / POLICY / LOG_DIR
    name = next(iter(open_snapshot(uri).entries)).path.split("/", 1)[1]
    foreign = {"remove": {"path": name, "deletionTimestamp": 1, "dataChange": True}}
    (log_dir / f"{res.version + 1:020d}.json").write_text(json.dumps(foreign) + "\n")
    _commit(c, 1, 10)
    with pytest.raises(ViewError, match="no longer mirrors the store"):
        export_views(uri)
    # a Delta table of another protocol in a policy directory is not an rlrec view
    other = tmp_path / "other"
    ShardCommitter(str(other), "rl", 0).commit(expert_cartpole_episodes(1))
    import pyarrow as pa

    deltalake.write_deltalake(str(other / POLICY), pa.table({"x": [1]}))
    with pytest.raises(ViewError, match="not an rlrec view"):
        export_views(str(other))


def test_a_shard_not_published_yet_waits_and_is_mirrored_once_published(tmp_path):
    uri = str(tmp_path / "out")
    c = ShardCommitter(uri, "rl", 0)
    _commit(c, 2, 0)
    storage = Storage.from_uri(uri)
    last = open_snapshot(uri).entries[-1]
    storage.move(last.path, last.staging_path)  # committed, its publication not done yet
    [res] = export_views(uri)
    assert (res.commits, res.waiting) == (1, 1)
    storage.move(last.staging_path, last.path)
    [res] = export_views(uri)
    assert (res.commits, res.waiting) == (1, 0)
    assert res.cursor == open_snapshot(uri).cursor


def test_export_as_of_mirrors_up_to_that_point_and_a_later_run_continues(tmp_path):
    uri = str(tmp_path / "out")
    c = ShardCommitter(uri, "rl", 0)
    _commit(c, 2, 0)
    point = open_snapshot(uri).cursor
    _commit(c, 2, 10)
    [res] = export_views(uri, as_of=point)
    assert res.cursor == point and res.commits == 2
    [res] = export_views(uri)
    assert res.commits == 2 and res.cursor == open_snapshot(uri).cursor
    assert _check_every_version(uri) == (4, 0)


def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
    uri = str(tmp_path / "out")
    ShardCommitter(uri, "rl", 0).commit(expert_cartpole_episodes(1))
    cases = [
        (["export", uri, uri, "--to", "delta", "--follow", "--as-of", "r1~0123456789ab~rl:0=1"], "not both"),
        (["export", uri, str(tmp_path / "elsewhere"), "--to", "delta"], "a Delta view lives in the store"),
        (["export", uri, str(tmp_path / "x"), "--to", "parquet", "--follow"], "--follow needs --to delta"),
        (["export", uri, uri, "--to", "delta", "--follow", "--interval", "nan"], "--interval must be a finite"),
        (["export", uri, uri, "--to", "delta", "--follow", "--interval", "inf"], "--interval must be a finite"),
        (["export", uri, uri, "--to", "delta", "--follow", "--interval", "0"], "--interval must be a finite"),
    ]
    for argv, msg in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("rlrec export: error: ") and msg in err[0], err
    monkeypatch.setitem(sys.modules, "deltalake", None)  # the extra not installed
    assert main(["export", uri, uri, "--to", "delta"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'rlrec[delta]'" in err[0], err
    assert not (tmp_path / "out" / POLICY / LOG_DIR).exists()


def test_cli_exports_and_inspect_shows_the_version_mapping(tmp_path, capsys):
    uri = str(tmp_path / "out")
    _commit(ShardCommitter(uri, "rl", 0), 2, 0)
    assert main(["export", uri, uri, "--to", "delta"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"{uri}/{POLICY}\t1\t{open_snapshot(uri).cursor}"]
    assert main(["inspect", uri, "--delta"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [f"{POLICY}\t1\t{open_snapshot(uri).cursor}"]
    assert main(["inspect", uri, "--delta", "--delta-version", "0"]) == 0
    [line] = capsys.readouterr().out.strip().splitlines()
    assert line.split("\t")[:2] == [POLICY, "0"] and line.endswith("rl:0=2")
    # the store's own maintenance leaves the view alone, and accepts it
    assert main(["inspect", uri, "--verify"]) == 0
    assert main(["gc", uri, "--older-than", "0s"]) == 0
    capsys.readouterr()
    assert main(["export", uri, uri, "--to", "delta"]) == 0
    assert capsys.readouterr().err.strip().endswith("0 Delta commit(s) to 1 view(s)")


# -- kill -9 of --follow -------------------------------------------------------------------------


def _added_and_removed(log_dir) -> tuple[list[str], Counter]:
    """Every add path in version order, and how often each path was removed."""
    adds, removes = [], Counter()
    names = sorted(n for n in os.listdir(log_dir) if n.endswith(".json"))
    assert names == [f"{v:020d}.json" for v in range(len(names))], "a gap in the Delta log"
    for n in names:
        for line in open(os.path.join(log_dir, n)):
            a = json.loads(line)
            if "add" in a:
                adds.append(a["add"]["path"])
            if "remove" in a:
                removes[a["remove"]["path"]] += 1
    return adds, removes


@pytest.mark.slow
def test_kill_9_of_follow_at_random_moments_then_a_rerun_completes_with_no_missing_or_doubled_commit(tmp_path):
    uri = str(tmp_path / "out")
    c0, c1 = ShardCommitter(uri, "rl", 0), ShardCommitter(uri, "rl", 1)
    _commit(c0, 1, 0)
    done = threading.Event()

    def writer() -> None:
        for i in range(40):  # ~10 s: several --follow processes see commits land, and are killed
            _commit(c0 if i % 2 else c1, 1, 100 + i)
            if i in (12, 30):
                compact_partition(c0.log, min_age_s=0)
            time.sleep(0.2)
        done.set()

    threading.Thread(target=writer, daemon=True).start()
    rng = random.Random(48)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "rlrec", "export", uri, uri, "--to", "delta", "--follow", "--interval", "0.02"]
    log_dir = tmp_path / "out" / POLICY / LOG_DIR

    def written() -> int:
        return len([n for n in os.listdir(log_dir) if n.endswith(".json")]) if log_dir.exists() else 0

    kills, versions = 0, []
    while not done.is_set() or kills < 4:
        before = written()
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # the interpreter's start-up takes 1 s on an idle machine and far longer on a loaded one: the
        # kill lands at a random moment after this process wrote its first commit, mid-export
        deadline = time.monotonic() + 30
        while not done.is_set() and written() == before and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.4))
        p.send_signal(signal.SIGKILL)
        p.wait()
        kills += 1
        versions.append(written())
    assert sum(b > a for a, b in zip([0, *versions], versions)) >= 3, f"--follow wrote little between kills: {versions}"
    assert export_views(uri)[0].cursor == open_snapshot(uri).cursor  # the rerun completes it
    assert export_views(uri)[0].commits == 0
    adds, removes = _added_and_removed(tmp_path / "out" / POLICY / LOG_DIR)
    assert len(adds) == len(set(adds)), "a shard added twice"
    from rlrec.store.manifest import read_partition_logs, shard_files

    committed = {e.path.split("/", 1)[1] for es in read_partition_logs(c0.storage).values() for e in shard_files(es)}
    assert set(adds) == committed, "a committed shard is missing from the view"
    assert max(removes.values(), default=1) == 1
    _check_every_version(uri)


def test_checkpoints_keep_the_mapping_when_delta_log_cleanup_drops_the_commits(tmp_path, monkeypatch):
    """A checkpoint every CHECKPOINT_EVERY versions (delta-rs's writer); once log cleanup deleted the
    commits below it, the version -> cursor mapping still comes from the txns, a rerun adds nothing,
    and the newest version reads what rlrec.open reads."""
    monkeypatch.setattr(delta_view, "CHECKPOINT_EVERY", 4)
    uri = str(tmp_path / "out")
    _commit(ShardCommitter(uri, "rl", 0), 10, 0)
    [res] = export_views(uri)
    log_dir = tmp_path / "out" / POLICY / LOG_DIR
    assert res.version == 9
    assert sorted(n for n in os.listdir(log_dir) if "checkpoint.parquet" in n) == [
        f"{4:020d}.checkpoint.parquet",
        f"{8:020d}.checkpoint.parquet",
    ]
    for v in range(8):
        (log_dir / f"{v:020d}.json").unlink()  # what Delta log cleanup does below a checkpoint
    assert version_cursor(uri, POLICY) == (9, open_snapshot(uri).cursor)
    assert version_cursor(uri, POLICY, 8)[1].endswith("rl:0=10")  # a claim, then 9 shard entries
    assert export_views(uri)[0].commits == 0
    assert _delta_ids(f"{uri}/{POLICY}", 9)[0] == _rlrec_ids(uri, open_snapshot(uri).cursor)


def test_a_second_exporter_at_the_same_time_is_refused_and_the_view_stays_whole(tmp_path):
    uri = str(tmp_path / "out")
    _commit(ShardCommitter(uri, "rl", 0), 3, 0)
    ran = []

    def another_export_runs_first() -> bool:  # asked before the first commit
        if not ran:
            ran.append(export_views(uri)[0].commits)
        return False

    with pytest.raises(ViewError, match="another export writes to it"):
        export_views(uri, stop=another_export_runs_first)
    assert ran == [3]
    adds, removes = _added_and_removed(tmp_path / "out" / POLICY / LOG_DIR)
    assert len(adds) == len(set(adds)) == 3 and not removes
    assert export_views(uri)[0].commits == 0


def test_follow_stops_cleanly_on_sigterm(tmp_path):
    uri = str(tmp_path / "out")
    _commit(ShardCommitter(uri, "rl", 0), 2, 0)
    cmd = [sys.executable, "-m", "rlrec", "export", uri, uri, "--to", "delta", "--follow", "--interval", "0.1"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()  # the first poll's commits
    assert line.split("\t")[:2] == [f"{uri}/{POLICY}", "1"], line
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 143  # 128 + SIGTERM, after a clean stop
    assert export_views(uri)[0].commits == 0


def test_a_view_first_exported_after_retention_deleted_its_first_shards(tmp_path):
    """The policy's first shards expired and were deleted before the first export: the versions
    holding them refuse in both readers, the retention commit drops them, the rest reads equal."""
    uri = str(tmp_path / "out")
    c = ShardCommitter(uri, "rl", 0)
    _commit(c, 2, 0)
    time.sleep(0.3)
    assert len(retain(c.storage, grace_s=0, older_than_s=0.2).deleted) == 2
    _commit(c, 1, 10)
    [res] = export_views(uri)
    assert res.commits == 4 and res.cursor == open_snapshot(uri).cursor
    assert _check_every_version(uri) == (4, 2)


def _commit_as(c: ShardCommitter, policy: str, seed: int) -> None:
    c.commit(expert_cartpole_episodes(2, seed=seed, max_steps=15, policy_id=policy))


def test_two_policies_each_view_maps_to_points_that_read_its_rows(tmp_path):
    """Entries of the other policy and retention of its shards move the point of this policy's
    view through its next commit's txns: every version of both views reads what rlrec.open reads
    at its cursor (a point where the other policy's deleted shards make rlrec.open refuse would
    show here)."""
    uri = str(tmp_path / "out")
    c0, c1 = ShardCommitter(uri, "rl", 0), ShardCommitter(uri, "rl", 1)
    for i, (c, p) in enumerate([(c0, "expert"), (c0, "novice"), (c0, "expert"), (c1, "novice"), (c1, "novice")]):
        _commit_as(c, p, i)
    export_views(uri)
    assert compact_partition(c0.log, min_age_s=0).replaced >= 2
    assert retain(c0.storage, grace_s=3600).recorded
    _commit_as(c1, "novice", 10)
    export_views(uri, policy_id="expert")  # one view moves ahead of the other
    time.sleep(0.3)
    assert retain(c0.storage, grace_s=0, older_than_s=0.2).deleted
    _commit_as(c0, "expert", 20)
    _commit_as(c1, "novice", 21)
    results = {r.policy_id: r for r in export_views(uri)}
    assert sorted(results) == ["expert", "novice"]
    newest = open_snapshot(uri).cursor  # each view's newest version reads the newest point's rows
    assert all(_rlrec_ids(uri, r.cursor, p) == _rlrec_ids(uri, newest, p) for p, r in results.items())
    for policy in results:
        versions, expired = _check_every_version(uri, policy)
        assert versions >= 3 and expired >= 1, (policy, versions, expired)


def test_a_view_of_tabular_shards_reads_a_row_per_step(tmp_path):
    uri = str(tmp_path / "out")
    c = ShardCommitter(uri, "rl", 0, fmt="tabular")
    _commit(c, 3, 0)
    compact_partition(c.log, min_age_s=0)
    _commit(c, 1, 10)
    [res] = export_views(uri)
    assert res.commits == 5
    assert _check_every_version(uri, fmt="tabular") == (5, 0)


def test_follow_mirrors_compaction_and_retention_from_what_it_read_before(tmp_path):
    """`follow_views` keeps the manifest and the views it read (only what was appended since is
    read each poll): the versions it writes while commits, a compaction and retention land read
    what rlrec.open reads at their cursors."""
    from rlrec.delta_view import follow_views

    uri = str(tmp_path / "out")
    stop = threading.Event()
    polls = []
    follower = threading.Thread(
        target=follow_views, args=(uri,), kwargs={"interval_s": 0.05, "stop": stop.is_set, "on_poll": polls.append}
    )
    c2 = ShardCommitter(uri, "rl", 2)
    _commit(c2, 1, 90)  # a store to follow
    follower.start()
    try:
        _history(uri, c2.storage, exports=False)  # commits, compaction, retention: replaced, then everything
        _commit(c2, 1, 50)
        _wait_followed(uri)
    finally:
        stop.set()
        follower.join()
    assert len(polls) >= 4  # each of the four waits above needed a poll of its own
    assert export_views(uri)[0].commits == 0
    versions, expired = _check_every_version(uri)
    assert versions >= 10 and expired > 0


def test_docstring_examples():
    import doctest

    result = doctest.testmod(delta_view, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_a_log_folder_without_a_commit_is_no_table_and_the_next_export_creates_it(tmp_path, capsys):
    """A kill -9 inside the first commit's create-once leaves `_delta_log/` with only a temp file:
    the next export creates version 0 there instead of refusing the view."""
    uri = str(tmp_path / "out")
    _commit(ShardCommitter(uri, "rl", 0), 2, 0)
    log_dir = tmp_path / "out" / POLICY / LOG_DIR
    log_dir.mkdir()
    (log_dir / f".{0:020d}.json.tmp-abc").write_bytes(b'{"commitInfo":')
    assert main(["inspect", uri, "--delta"]) == 1  # no view yet
    assert "no Delta view" in capsys.readouterr().err
    assert main(["export", uri, uri, "--to", "delta"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [f"{uri}/{POLICY}\t1\t{open_snapshot(uri).cursor}"]
    assert _check_every_version(uri) == (2, 0)


@pytest.mark.parametrize(
    "app, value", [("rlrec:rl/0", -2), ("rlrec:rl/0", 10**15), ("rlrec:_removed", -1), ("rlrec:_removed", 10**12)]
)
def test_a_txn_out_of_range_is_refused_not_printed_as_a_cursor(tmp_path, capsys, app, value):
    """A crafted commit whose txn names no point of the store (a position below 0 or past its
    log's entries, a removal count past the removal log's records): export and inspect refuse
    the view in one line instead of printing a cursor made of it."""
    uri = str(tmp_path / "out")
    _commit(ShardCommitter(uri, "rl", 0), 3, 0)
    export_views(uri)
    (tmp_path / "out" / POLICY / LOG_DIR / f"{3:020d}.json").write_text(
        json.dumps({"txn": {"appId": app, "version": value}}) + "\n"
    )
    for argv in (["inspect", uri, "--delta"], ["export", uri, uri, "--to", "delta"]):
        assert main(argv) != 0, argv
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and "out of range" in err, (argv, out, err)
    with pytest.raises(ViewError, match="out of range"):
        version_cursor(uri, POLICY)


def _image_episodes(dtype, n: int = 2, steps: int = 5) -> list:
    """Episodes of a `Box(0, 255, (4,), dtype)` observation space (the image case) of policy "img"."""
    import gymnasium as gym
    import numpy as np

    from rlrec.trainer.synthetic import _episode

    space = gym.spaces.Box(0, 255, (4,), dtype)
    values = [200, 255, 3, 128]
    return [
        _episode(
            "Img-v0",
            space,
            gym.spaces.Discrete(2),
            [np.array(values, dtype) for _ in range(steps + 1)],
            [1] * steps,
            [1.0] * steps,
            True,
            False,
            policy_id="img",
            policy_version=1,
        )
        for _ in range(n)
    ]


def test_unsigned_int_columns_are_widened_so_every_reader_reads_their_values(tmp_path):
    """Delta has no unsigned integers: a uint8 image observation is declared int16 (values above
    127 read as they are by polars and DuckDB, not refused or wrapped)."""
    import numpy as np

    uri = str(tmp_path / "out")
    ShardCommitter(uri, "rl", 0, fmt="tabular").commit(_image_episodes(np.uint8))
    [res] = export_views(uri)
    assert res.commits == 1
    obs = open_snapshot(uri).steps().column("observation").to_pylist()
    assert obs and all(list(o) == [200, 255, 3, 128] for o in obs)
    view = f"{uri}/img"
    dataset = deltalake.DeltaTable(view).to_pyarrow_dataset()  # noqa: F841
    assert [list(r[0]) for r in duckdb.sql("select obs from dataset").fetchall()] == obs
    assert [list(o) for o in pl.read_delta(view, use_pyarrow=True)["obs"].to_list()] == obs
    assert _check_every_version(uri, "img", fmt="tabular") == (1, 0)


def test_a_column_type_delta_cannot_hold_is_refused_in_one_line(tmp_path, capsys):
    import numpy as np

    uri = str(tmp_path / "out")
    ShardCommitter(uri, "rl", 0, fmt="tabular").commit(_image_episodes(np.float16))
    assert main(["export", uri, uri, "--to", "delta"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "column obs has type halffloat, which a Delta table cannot hold" in err[0], err
    assert not list((tmp_path / "out" / "img").glob(f"{LOG_DIR}/*.json"))


def test_follow_exports_again_a_view_deleted_while_it_runs(tmp_path):
    """Deleting a view (`_delta_log/`) is safe while `--follow` runs: the follower sees that its
    newest commit is gone and exports the view again from version 0, instead of appending
    headless commits (no protocol, no metadata) to the deleted log."""
    import shutil

    from rlrec.delta_view import follow_views

    uri = str(tmp_path / "out")
    c = ShardCommitter(uri, "rl", 0)
    _commit(c, 2, 0)
    stop = threading.Event()
    follower = threading.Thread(target=follow_views, args=(uri,), kwargs={"interval_s": 0.05, "stop": stop.is_set})
    follower.start()
    log_dir = tmp_path / "out" / POLICY / LOG_DIR
    try:

        def caught_up() -> bool:
            try:
                return version_cursor(uri, POLICY)[1] == open_snapshot(uri).cursor
            except ViewError:
                return False

        deadline = time.monotonic() + 60
        while not caught_up():
            assert time.monotonic() < deadline, "follow did not catch up"
            time.sleep(0.05)
        os.rename(log_dir, tmp_path / "deleted")  # deleted at once (rm -r while a poll lists it is another race)
        shutil.rmtree(tmp_path / "deleted")
        _commit(c, 1, 10)
        deadline = time.monotonic() + 60
        while not caught_up():
            assert time.monotonic() < deadline, "follow did not export the deleted view again"
            time.sleep(0.05)
    finally:
        stop.set()
        follower.join()
    assert f"{0:020d}.json" in os.listdir(log_dir)
    assert export_views(uri)[0].commits == 0
    assert _check_every_version(uri) == (3, 0)


def test_s3_settings_given_as_uri_parameters_reach_delta_rs(local_s3, monkeypatch, capsys):
    """A store opened as ``s3://b/p?endpoint_override=HOST:PORT&scheme=http`` with no endpoint in
    the environment: delta-rs reads the view with the Storage's own settings (the second export
    and inspect read what the first wrote), and the view's URI carries no query string."""
    for k, v in local_s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    bucket = local_s3.create_bucket(f"t-{uuid.uuid4().hex[:10]}")
    uri = f"s3://{bucket}/out?endpoint_override={local_s3.endpoint}&scheme=http"
    c = ShardCommitter(uri, "rl", 0)
    _commit(c, 2, 0)
    assert main(["export", uri, uri, "--to", "delta"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [
        f"s3://{bucket}/out/{POLICY}\t1\t{open_snapshot(uri).cursor}"
    ]
    _commit(c, 1, 10)
    assert main(["export", uri, uri, "--to", "delta"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["inspect", uri, "--delta"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip().splitlines() == [f"{POLICY}\t2\t{open_snapshot(uri).cursor}"]
    opts = storage_options(f"s3://{bucket}/out/{POLICY}", Storage.from_uri(uri))
    assert opts["AWS_ENDPOINT_URL"] == local_s3.endpoint_url and opts["AWS_ALLOW_HTTP"] == "true"
    assert pl.read_delta(f"s3://{bucket}/out/{POLICY}", storage_options=opts).height == 6
    # a storage delta-rs cannot reach is a storage error, not "a Delta log rlrec cannot read"
    monkeypatch.setattr(
        delta_view, "storage_options", lambda u, s=None: {**opts, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    )
    assert main(["export", uri, uri, "--to", "delta"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "from its storage" in err[0] and "cannot read" in err[0], err
