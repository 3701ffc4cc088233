"""Compaction (store/compaction.py): small committed shards merged into large ones, committed as
replace entries of the manifest; as-of readers, the follower, gc and `rlrec compact` around it.
Real local storage; the compactor is killed with SIGKILL in a subprocess."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlrec.store.commit import ShardCommitter
from rlrec.store.compaction import compact_partition, plan_runs
from rlrec.store.maintenance import gc, verify
from rlrec.store.manifest import (
    ClaimEntry,
    ConflictError,
    ManifestError,
    PartitionLog,
    ReplaceEntry,
    UnsupportedManifestError,
    live_shards,
    parse_entry,
    read_first_commits,
    read_manifest,
)
from rlrec.store.ownership import read_lease
from rlrec.store.snapshot import open_snapshot
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes

ROOT = Path(__file__).resolve().parent.parent


def _commit_small(root: str, shards: int, *, topic: str = "rl", partition: int = 0, fmt: str = "episodes", per=2):
    """`shards` commits of `per` short episodes each; returns (committer, committed ids)."""
    c = ShardCommitter(root, topic, partition, fmt=fmt, snapshot_every=7)
    ids: list[str] = []
    for i in range(shards):
        res = c.commit(expert_cartpole_episodes(per, seed=i, max_steps=30))
        ids += [fe.episode_id for fe in res.written]
    return c, ids


def _step_ids(snap) -> Counter:
    """(episode id, t) -> how often the snapshot's files hold it."""
    t = snap.steps()
    return Counter(zip(t.column("episode_id").to_pylist(), t.column("t").to_pylist()))


def _assert_exactly_once(snap, ids: list[str]) -> None:
    """Every episode of `ids` and no other, each step once, read from the snapshot's files."""
    seen = _step_ids(snap)
    assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1][:3]
    assert {eid for eid, _ in seen} == set(ids)
    assert sorted(i for e in snap.entries for i in e.episode_ids) == sorted(ids)


# -- the merged shard ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["episodes", "tabular"])
def test_merged_shard_holds_the_same_episodes_for_rlrec_readers(tmp_path, fmt):
    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 6, fmt=fmt)
    before = open_snapshot(root)
    steps_before = before.steps().sort_by([("episode_id", "ascending"), ("t", "ascending")])

    res = compact_partition(c.log, min_age_s=0)
    assert (res.replaced, res.written) == (6, 1) and not res.skipped

    after = open_snapshot(root)
    assert len(after.files()) == 1 and after.num_episodes == len(ids)
    _assert_exactly_once(after, ids)
    assert after.steps().sort_by([("episode_id", "ascending"), ("t", "ascending")]).equals(steps_before)
    assert sorted(ep.id_ for ep in after.episodes()) == sorted(ids)
    # the merged file is a shard of the same format: same columns, schema metadata kept
    merged = pq.ParquetFile(after.files()[0])
    old = pq.ParquetFile(before.files()[0])
    assert merged.schema_arrow.equals(old.schema_arrow, check_metadata=False)
    assert merged.schema_arrow.metadata[b"rlrec.format"] == fmt.encode()
    assert b"rlrec.observation_space" in merged.schema_arrow.metadata
    # the replaced files stay (retention removes them), and verify is content
    assert all(os.path.exists(p) for p in before.files())
    assert verify(c.storage) == []
    assert [e.path for e in read_manifest(c.storage)] == [res.entries[0].shard.path]


def test_merged_shard_is_written_in_full_row_groups(tmp_path, monkeypatch):
    from rlrec.store import compaction

    monkeypatch.setattr(compaction, "_ROW_GROUP", {"episodes": 4, "tabular": 4})
    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 5, per=3)
    compact_partition(c.log, min_age_s=0)
    (path,) = open_snapshot(root).files()
    md = pq.ParquetFile(path).metadata
    assert [md.row_group(i).num_rows for i in range(md.num_row_groups)] == [4, 4, 4, 3]
    assert pq.read_table(path, columns=["episode_id"]).column(0).to_pylist() == ids  # in commit order


def test_stock_rllib_decodes_the_merged_episode_shard(tmp_path):
    """What RLlib's OfflinePreLearner does with input_read_episodes=True: msgpack + msgpack_numpy
    decode of the `item` column and SingleAgentEpisode.from_state."""
    import msgpack
    import msgpack_numpy
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 4)
    compact_partition(c.log, min_age_s=0)
    (path,) = open_snapshot(root).files()
    items = pq.read_table(path, columns=["item"]).column("item").to_pylist()
    eps = [SingleAgentEpisode.from_state(msgpack.unpackb(b, object_hook=msgpack_numpy.decode)) for b in items]
    assert sorted(ep.id_ for ep in eps) == sorted(ids)
    assert all(ep.is_done and len(ep) > 0 for ep in eps)


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_stock_bc_trains_on_the_merged_shard(tmp_path):
    import ray

    from tests.test_shards import _bc_config, _train_two_iterations

    root = str(tmp_path / "out")
    c, _ = _commit_small(root, 6, per=4)
    compact_partition(c.log, min_age_s=0)
    (path,) = open_snapshot(root).files()
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        _train_two_iterations(_bc_config(path, input_read_episodes=True))
    finally:
        if started:
            ray.shutdown()


# -- planning, idempotence, the rule of replacement --------------------------------------------


def test_rerun_is_idempotent_and_respects_target_and_age(tmp_path):
    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 9)
    live = live_shards(PartitionLog(c.storage, "rl", 0).load())
    sizes = [e.bytes for e in live.values()]
    assert plan_runs(live, min_age_s=3600) == []  # all too young
    target = sum(sizes[:3])  # about three shards per run
    runs = plan_runs(live, min_age_s=0, target_bytes=target)
    assert len(runs) >= 2 and all(sum(e.bytes for e in r) <= target for r in runs)

    first = compact_partition(c.log, min_age_s=0, target_bytes=target)
    assert first.written == len(runs)
    n_entries = PartitionLog(c.storage, "rl", 0).load()
    again = compact_partition(c.log, min_age_s=0, target_bytes=target)
    assert (again.replaced, again.written) == (0, 0)
    assert PartitionLog(c.storage, "rl", 0).load() == n_entries  # nothing appended
    _assert_exactly_once(open_snapshot(root), ids)
    # commits go on after compaction, through the same log
    more = c.commit(expert_cartpole_episodes(2, seed=99, max_steps=30))
    _assert_exactly_once(open_snapshot(root), ids + [fe.episode_id for fe in more.written])


def test_a_replacement_must_hold_exactly_the_replaced_episodes(tmp_path):
    root = str(tmp_path / "out")
    c, _ = _commit_small(root, 3)
    live = live_shards(PartitionLog(c.storage, "rl", 0).load())
    a, b, _third = list(live.values())
    import dataclasses

    short = dataclasses.replace(a, episode_ids=a.episode_ids[:1], episodes=1)
    with pytest.raises(ConflictError, match="exactly the episodes"):
        c.log.append_replace(ReplaceEntry(replaces=(a.seq, b.seq), shard=short), [a, b])
    # the caller's idea of a replaced shard must be what the log holds at that seq
    other = dataclasses.replace(a, sha256="0" * 64)
    with pytest.raises(ConflictError, match="not the shard to replace"):
        c.log.append_replace(ReplaceEntry(replaces=(a.seq,), shard=dataclasses.replace(a, path="p/x.parquet")), [other])
    # a forged replace entry on storage (an id that is not in the replaced shards) is refused by
    # every reader of the log's episodes, and verify names it
    seq = c.log.next_seq
    forged = ReplaceEntry(
        replaces=(a.seq,), shard=dataclasses.replace(a, episode_ids=(*a.episode_ids[:-1], "intruder"))
    ).with_commit(seq=seq, epoch=c.log.epoch, writer=c.log.writer_id)
    assert c.storage.create_once(f"_manifest/rl/00000/{seq:012d}.json", forged.to_json().encode())
    with pytest.raises(ManifestError, match="not exactly those"):
        live_shards(PartitionLog(c.storage, "rl", 0).load())
    assert any("not exactly those" in p for p in verify(c.storage))


# -- kill -9 -------------------------------------------------------------------------------------

_COMPACTOR = textwrap.dedent(
    """
    import os, signal, sys
    from rlrec.store import manifest
    from rlrec.store.compaction import compact_unowned
    from rlrec.store.storage import Storage

    root, crash_at, target = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def crash(real):
        def wrapper(*a, **kw):
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9 at this exact point
        return wrapper

    if crash_at == "before-append":  # the merged file is staged, its replace entry not appended
        manifest.PartitionLog.append_replace = crash(manifest.PartitionLog.append_replace)
    elif crash_at == "before-publish":  # appended (committed), still staged
        real = manifest.PartitionLog.publish
        def publish(self, entry, data=None):
            if "+e" in entry.path and ".c" in entry.path.rsplit("+", 1)[-1]:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, entry, data)
        manifest.PartitionLog.publish = publish
    print("start", flush=True)
    compact_unowned(Storage.from_uri(root), min_age_s=0, target_bytes=target, force=True)
    print("done", flush=True)
    """
)


def _run_compactor(root: str, crash_at: str, target: int, kill_after: float | None = None, during=None) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen(
        [sys.executable, "-c", _COMPACTOR, root, crash_at, str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert p.stdout.readline().strip() == "start"
        if kill_after is not None:
            time.sleep(kill_after)
            if during is not None:
                during()  # while the compactor runs (unless it is done already)
            p.send_signal(signal.SIGKILL)
        return p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_kill_9_of_the_compactor_at_any_point_then_rerun(tmp_path):
    """Every as-of reader -- at cursors taken before, during and after compaction and after each
    kill -- reads each episode exactly once; a re-run finishes the job; gc collects only the
    orphans the kills left."""
    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 24)
    st = c.storage
    target = 3 * max(e.bytes for e in read_manifest(st))
    cursors = [open_snapshot(root).cursor]
    rng = random.Random(31)
    codes = []
    for crash_at in ["before-append", "before-publish"]:
        codes.append(_run_compactor(root, crash_at, target))
        cursors.append(open_snapshot(root).cursor)
    for _ in range(6):
        take = lambda: cursors.append(open_snapshot(root).cursor)  # noqa: E731
        codes.append(_run_compactor(root, "none", target, kill_after=rng.uniform(0.0, 0.4), during=take))
        take()
    assert codes[:2] == [-signal.SIGKILL] * 2  # the planted crash points were reached
    for cur in cursors:
        _assert_exactly_once(open_snapshot(root, as_of=cur), ids)
    assert _run_compactor(root, "none", target) == 0
    final = open_snapshot(root)
    _assert_exactly_once(final, ids)
    assert len(final.files()) <= len(ids) // 2 // 2  # merged: fewer than half the shards left
    assert all(os.path.exists(f) for f in final.files())  # every listed file published
    assert verify(st) == [], verify(st)
    # the kills left orphan staging files (at least the "before-append" one): gc collects them,
    # keeps every file an entry names -- the replaced ones too -- and every cursor still reads
    orphans = gc(st, 0, dry_run=True)
    assert orphans and all("/_staging/" in p for p in orphans)
    gc(st, 0)
    for cur in [*cursors, final.cursor]:
        _assert_exactly_once(open_snapshot(root, as_of=cur), ids)


def test_changes_across_a_replacement_read_each_new_episode_once(tmp_path):
    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 4)
    early = open_snapshot(root)
    more = [
        fe.episode_id
        for i in range(4)
        for fe in c.commit(expert_cartpole_episodes(2, seed=50 + i, max_steps=30)).written
    ]
    compact_partition(c.log, min_age_s=0)  # merges shards from both sides of `early`
    now = open_snapshot(root)
    assert len(now.files()) == 1
    _assert_exactly_once(now.changes(early.cursor), more)
    _assert_exactly_once(open_snapshot(root, as_of=early.cursor), ids)
    assert now.changes(now.cursor).entries == []
    # a replacement of that replacement and newer shards: still each new episode once, and the
    # newest shards alone since `now`
    newer = [
        fe.episode_id
        for i in range(3)
        for fe in c.commit(expert_cartpole_episodes(2, seed=70 + i, max_steps=30)).written
    ]
    assert compact_partition(c.log, min_age_s=0).written == 1
    latest = open_snapshot(root)
    assert len(latest.files()) == 1
    _assert_exactly_once(latest.changes(early.cursor), more + newer)
    _assert_exactly_once(latest.changes(now.cursor), newer)
    _assert_exactly_once(latest.changes(open_snapshot(root, as_of=early.cursor).cursor), more + newer)
    assert len(latest.changes(latest.cursor).entries) == 0


# -- readers that must not misread a replace entry ----------------------------------------------


def test_an_older_reader_refuses_a_log_with_a_replace_entry(tmp_path, monkeypatch):
    from rlrec.store import manifest_entries
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    c, _ = _commit_small(root, 3)
    compact_partition(c.log, min_age_s=0)
    raw = [json.loads(p.read_bytes()) for p in sorted((tmp_path / "out/_manifest/rl/00000").glob("*.json"))]
    replace = next(d for d in raw if d["type"] == "replace")
    assert replace["manifest_version"] == 2
    monkeypatch.setattr(manifest_entries, "MANIFEST_FORMAT_VERSION", 1)  # a reader of format 1
    with pytest.raises(UnsupportedManifestError, match=r"format version 2.*upgrade rlrec"):
        parse_entry(replace)
    with pytest.raises(UnsupportedManifestError, match="upgrade rlrec"):
        open_snapshot(root)
    with pytest.raises(UnsupportedManifestError, match=r"rl/00000.*upgrade rlrec"):
        ManifestFollower(c.storage).poll(force_discover=True)


def test_the_follower_stops_on_an_unknown_entry_type_instead_of_skipping_the_log(tmp_path):
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    c, _ = _commit_small(root, 2)
    follower = ManifestFollower(c.storage)
    assert len(follower.poll(force_discover=True)) == 2
    seq = c.log.next_seq
    c.storage.create_once(f"_manifest/rl/00000/{seq:012d}.json", json.dumps({"type": "retain", "seq": seq}).encode())
    with pytest.raises(UnsupportedManifestError, match="unknown manifest entry type 'retain'"):
        follower.poll()


def test_an_unreadable_log_loses_no_other_partitions_new_shards(tmp_path):
    """A poll stopped by one log's newer entry delivers nothing; once that log reads again, the
    other partitions' shards committed meanwhile are delivered (not skipped for good)."""
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    c0, _ = _commit_small(root, 1, partition=0)
    c1, _ = _commit_small(root, 1, partition=1)
    follower = ManifestFollower(c0.storage)
    assert len(follower.poll(force_discover=True)) == 2
    new0 = c0.commit(expert_cartpole_episodes(2, seed=40, max_steps=30))
    bad = f"_manifest/rl/00001/{c1.log.next_seq:012d}.json"
    c1.storage.create_once(bad, json.dumps({"type": "retain", "seq": c1.log.next_seq}).encode())
    with pytest.raises(UnsupportedManifestError):
        follower.poll()
    c1.storage.delete(bad)  # the log reads again (here: the entry removed)
    got = [i for s in follower.poll() for i in follower.entries[s.key].episode_ids]
    assert sorted(got) == sorted(fe.episode_id for fe in new0.written)


def test_the_follower_never_delivers_replaced_episodes_again(tmp_path):
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 5)
    follower = ManifestFollower(c.storage)
    first = follower.poll(force_discover=True)
    delivered = [i for s in first for i in follower.entries[s.key].episode_ids]
    compact_partition(c.log, min_age_s=0)
    assert follower.poll(force_discover=True) == []  # a replace entry is no new data
    more = c.commit(expert_cartpole_episodes(2, seed=77, max_steps=30))
    new = follower.poll(force_discover=True)
    delivered += [i for s in new for i in follower.entries[s.key].episode_ids]
    want = ids + [fe.episode_id for fe in more.written]
    assert sorted(delivered) == sorted(want)
    # a follower started after compaction delivers every episode once too
    fresh = ManifestFollower(c.storage)
    got = [i for s in fresh.poll(force_discover=True) for i in fresh.entries[s.key].episode_ids]
    assert sorted(got) == sorted(want)


# -- ownership: rlrec compact never fences a live consumer --------------------------------------


def test_rlrec_compact_refuses_a_partition_a_live_consumer_owns(tmp_path, capsys):
    from rlrec.cli import main
    from rlrec.consumer.writer import PartitionWriter

    root = str(tmp_path / "out")
    st = Storage.from_uri(root)
    _c0, ids0 = _commit_small(root, 4, partition=0)
    _c1, ids1 = _commit_small(root, 4, partition=1)
    owner = PartitionWriter(st, "rl", 0)  # a consumer's writer of partition 0, alive
    owner.claim()
    owner.upkeep(time.time())  # writes its owner lease
    assert read_lease(st, "rl", 0).live()
    log0 = PartitionLog(st, "rl", 0).load()

    code = main(["compact", root, "--min-age", "0", "--force"])  # --force: partition 1 was written just now
    out, err = capsys.readouterr()
    assert code == 1
    errors = [ln for ln in err.splitlines() if ln.startswith("rlrec compact: error: ")]
    assert len(errors) == 1 and "Traceback" not in err
    assert "rl/00000 is owned by a live consumer" in errors[0] and "--compact-after" in errors[0]
    assert "rl/00001: replaced 4 shard(s)" in out
    assert PartitionLog(st, "rl", 0).load() == log0  # not even a claim: the owner is not fenced
    late = owner.committer.commit(expert_cartpole_episodes(1, seed=5, max_steps=30))  # still the owner
    snap = open_snapshot(root)
    assert len([f for f in snap.files() if "+00001+" in f]) == 1
    assert len(snap.entries) == 4 + 1 + 1
    _assert_exactly_once(snap, ids0 + ids1 + [fe.episode_id for fe in late.written])


def test_rlrec_compact_takes_over_a_partition_whose_owner_is_gone(tmp_path, capsys):
    from rlrec.cli import main
    from rlrec.store.ownership import renew_lease

    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 3)
    renew_lease(c.storage, "rl", 0, writer="dead-consumer", epoch=c.epoch, ttl_s=1.0, now=time.time() - 120)
    assert main(["compact", root, "--min-age", "0s", "--target-bytes", "64MiB", "--force"]) == 0
    assert "rl/00000: replaced 3 shard(s)" in capsys.readouterr().out
    assert read_lease(c.storage, "rl", 0) is None  # its own lease dropped when done
    _assert_exactly_once(open_snapshot(root), ids)
    with pytest.raises(Exception, match="fenced"):  # the dead owner, had it come back, is fenced
        c.commit(expert_cartpole_episodes(1, seed=8, max_steps=30))


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--target-bytes", "lots"], "not a size"),
        (["--min-age", "soon"], "not a duration"),
    ],
)
def test_rlrec_compact_bad_options_are_one_line(tmp_path, capsys, argv, text):
    from rlrec.cli import main

    root = str(tmp_path / "out")
    _commit_small(root, 1)
    assert main(["compact", root, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlrec compact: error: ") and text in err and len(err.strip().splitlines()) == 1


# -- a consumer compacting its own partitions while it commits ----------------------------------


@pytest.mark.broker
def test_a_consumer_compacts_its_own_partitions_while_it_commits(broker, topic, tmp_path, recorder_config, capsys):
    """rlrec consume --compact-after: replace entries appear while waves of episodes keep being
    committed; every point read during the run holds each episode once; the trainer's follower,
    polling all along, takes each episode as new exactly once; `rlrec compact` meanwhile refuses
    every partition (the consumer's leases are live) and appends nothing."""
    from rlrec.cli import main
    from rlrec.producer import EpisodeRecorder
    from rlrec.trainer.manifest_follower import ManifestFollower
    from tests.helpers import ACT_SPACE, OBS_SPACE, record_episodes, wait_for
    from tests.test_consumer_e2e import committed_episodes, run_consumer

    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    rec = EpisodeRecorder(
        broker.bootstrap_servers,
        policy_id="pol-a",
        topic=topic,
        observation_space=OBS_SPACE,
        action_space=ACT_SPACE,
        env_id="synthetic",
    )
    cfg = recorder_config(output, max_file_age_s=0.2, commit_interval_s=0.3, compact_after_s=1.0)
    c, t = run_consumer(cfg, storage)
    truth: set[str] = set()
    points: list[tuple[str, set[str]]] = []
    follower = ManifestFollower(storage)
    taken: list[str] = []  # episode ids the follower delivered as new

    def follow() -> None:
        taken.extend(i for s in follower.poll(force_discover=True) for i in follower.entries[s.key].episode_ids)

    def replaces() -> int:
        logs = [
            PartitionLog(storage, topic, p).load() for p in range(4) if storage.exists(f"_manifest/{topic}/{p:05d}")
        ]
        return sum(isinstance(e, ReplaceEntry) for entries in logs for e in entries)

    try:
        for wave in range(40):
            truth |= set(record_episodes(rec, 6, seed=100 + wave, max_len=10))
            assert rec.flush(10) == 0
            n = len(truth)
            wait_for(lambda n=n: committed_episodes(storage) >= n, 40, what=f"wave {wave} committed")
            points.append((open_snapshot(output).cursor, set(truth)))
            follow()
            if wave >= 4 and replaces() >= 2:
                break
            time.sleep(0.4)
        assert replaces() >= 2, "the consumer did not compact"
        before = {p: PartitionLog(storage, topic, p).load() for p in range(4)}
        assert main(["compact", output, "--min-age", "0"]) == 1
        err = capsys.readouterr().err
        assert "is owned by a live consumer" in err and "Traceback" not in err
        after = {p: PartitionLog(storage, topic, p).load()[: len(before[p])] for p in range(4)}
        assert after == before  # the consumer may have appended since; nothing of rlrec compact's
        for p in range(4):  # entries after it: the consumer's own (no claim of another writer)
            new = PartitionLog(storage, topic, p).load()[len(before[p]) :]
            assert not [e for e in new if isinstance(e, ClaimEntry)]
        truth |= set(record_episodes(rec, 6, seed=999, max_len=10))
        rec.flush(10)
        wait_for(lambda: committed_episodes(storage) >= len(truth), 40, what="last wave committed")
        points.append((open_snapshot(output).cursor, set(truth)))
    finally:
        c.stop()
        t.join(30)
        rec.close()
    assert not t.is_alive()
    follow()
    assert sorted(taken) == sorted(truth)  # each episode taken as new once, replace entries or not
    for cursor, ids in points:
        _assert_exactly_once(open_snapshot(output, as_of=cursor), sorted(ids))
    assert verify(storage) == []


@pytest.mark.parametrize(
    "module",
    [
        "rlrec.store.compaction",
        "rlrec.store.ownership",
        "rlrec.store.manifest",
        "rlrec.store.log_reader",
        "rlrec.store.log_shards",
        "rlrec.commands.compact",
    ],
)
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_log_snapshots_fold_replace_entries(tmp_path):
    """A log snapshot folding a replace entry says manifest format 2; a new owner starting from it
    (the hint), a reader of the whole chain and verify all agree with the entries."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    ids = [
        fe.episode_id for i in range(4) for fe in c.commit(expert_cartpole_episodes(2, seed=i, max_steps=30)).written
    ]
    first = compact_partition(c.log, min_age_s=0, target_bytes=10**9)
    ids += [
        fe.episode_id
        for i in range(4)
        for fe in c.commit(expert_cartpole_episodes(2, seed=9 + i, max_steps=30)).written
    ]
    second = compact_partition(c.log, min_age_s=0, target_bytes=10**9)  # merges the merged shard again
    assert first.written == second.written == 1 and second.entries[0].replaces[0] == first.entries[0].seq
    docs = [json.loads(p.read_bytes()) for p in (tmp_path / "out/_manifest/rl/00000").glob("0*.json")]
    folding = [d for d in docs if d["type"] == "snapshot" and any(e["type"] == "replace" for e in d["entries"])]
    assert folding and all(d["manifest_version"] == 2 for d in folding)
    assert all("manifest_version" not in d for d in docs if d["type"] == "snapshot" and d not in folding)
    new_owner = ShardCommitter(root, "rl", 0)
    new_owner.claim(replay_from=0)
    more = new_owner.commit(expert_cartpole_episodes(1, seed=50, max_steps=30))
    assert more.duplicates_dropped == 0
    # a replayed episode that a merged shard holds is still known as committed
    import dataclasses

    again = dataclasses.replace(expert_cartpole_episodes(1, seed=51, max_steps=30)[0], episode_id=ids[0])
    assert new_owner.commit([again]).duplicates_dropped == 1
    _assert_exactly_once(open_snapshot(root), ids + [fe.episode_id for fe in more.written])
    assert verify(c.storage) == []


def test_a_replacement_keeps_each_episodes_replay_horizon(tmp_path):
    """committed_offset (the consumer's replay skip) is the last offset of the shard that first
    committed the episode, before and after compaction, for the compacting writer and for a new
    owner: a merged shard's last offset (the max over its parts) would skip a late event of an
    earlier episode (a dead letter whose source offset is still to be replayed)."""
    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 4)
    truth = {i: e.last_offset for e in c.log.shard_entries() for i in e.episode_ids}
    assert len(set(truth.values())) > 1
    assert compact_partition(c.log, min_age_s=0).written == 1
    assert {i: c.log.committed_offset(i) for i in ids} == truth
    for replay_from in (None, 0, min(truth.values()) + 1):
        fresh = PartitionLog(Storage.from_uri(root), "rl", 0)
        fresh.claim("next-owner", replay_from=replay_from)
        known = {i: o for i in ids if (o := fresh.committed_offset(i)) is not None}
        assert known == {i: truth[i] for i in known}  # each at its own shard's last offset
        assert {i for i, o in truth.items() if replay_from is None or o >= replay_from} <= set(known)


# -- owner leases: renewed off the polling thread, liveness without trusting clocks ---------------


def test_lease_renewals_run_off_the_polling_thread_one_attempt_each(tmp_path, monkeypatch):
    """In a storage brown-out a renewal hangs and fails: the consumer's loop (upkeep) never
    waits for it, no second renewal piles up behind it, and it is tried once (not retried)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from rlrec.consumer.writer import PartitionWriter
    from rlrec.store.localfs import LocalRoot

    st = Storage.from_uri(str(tmp_path / "out"))
    gate = threading.Event()
    calls: list[str] = []
    real = LocalRoot.write

    def brown_out(self, path, data):
        if not path.startswith("_owners/"):
            return real(self, path, data)
        calls.append(threading.current_thread().name)
        if threading.current_thread() is not threading.main_thread():
            gate.wait(30)
        raise OSError("storage brown-out")  # transient: Storage retries it in place by default

    monkeypatch.setattr(LocalRoot, "write", brown_out)
    with ThreadPoolExecutor(1, thread_name_prefix="lease") as leases:
        w = PartitionWriter(st, "rl", 0, lease_executor=leases)
        w.claim()
        now = time.time()
        w.upkeep(now)  # returns while the renewal hangs
        w.upkeep(now + 3600)  # due again: none queued behind the hanging one
        hung = list(calls)
        gate.set()
    assert calls == hung and len(calls) == 1 and calls[0].startswith("lease"), calls
    monkeypatch.setattr(LocalRoot, "write", real)
    with ThreadPoolExecutor(1) as leases:  # storage back: the next due renewal writes the lease
        w.lease_executor = leases
        w.upkeep(now + 7200)
    assert read_lease(st, "rl", 0).epoch == w.epoch


def test_rlrec_compact_leaves_a_lease_alone_that_is_renewed_while_watched(tmp_path):
    """A live owner whose clock is two minutes behind (its lease looks expired by this clock)
    renews while watched: rlrec compact refuses the partition and appends nothing."""
    import threading

    from rlrec.store.compaction import compact_unowned
    from rlrec.store.ownership import renew_lease

    root = str(tmp_path / "out")
    c, _ = _commit_small(root, 3)
    stop = threading.Event()

    def owner_behind():
        while not stop.is_set():
            renew_lease(c.storage, "rl", 0, writer="skewed", epoch=c.epoch, ttl_s=0.6, now=time.time() - 120)
            stop.wait(0.2)

    t = threading.Thread(target=owner_behind)
    t.start()
    try:
        while read_lease(c.storage, "rl", 0) is None:
            time.sleep(0.01)
        before = PartitionLog(c.storage, "rl", 0).load()
        results, refused = compact_unowned(c.storage, min_age_s=0, force=True)
    finally:
        stop.set()
        t.join()
    assert results == [] and len(refused) == 1 and "rl/00000 is owned by a live consumer" in refused[0]
    assert PartitionLog(c.storage, "rl", 0).load() == before


def test_rlrec_compact_refuses_a_partition_without_lease_written_to_recently(tmp_path):
    """No owner lease but a consumer entry within the lease time: maybe an older rlrec's
    consumer (no leases) -- refused unless forced."""
    from rlrec.store.compaction import compact_unowned

    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 3)
    before = PartitionLog(c.storage, "rl", 0).load()
    results, refused = compact_unowned(c.storage, min_age_s=0)
    assert results == [] and len(refused) == 1 and "no owner lease" in refused[0] and "--force" in refused[0]
    assert PartitionLog(c.storage, "rl", 0).load() == before
    results, refused = compact_unowned(c.storage, min_age_s=0, force=True)
    assert refused == [] and results[0].replaced == 3
    _assert_exactly_once(open_snapshot(root), ids)


def test_a_merged_shard_left_staged_by_a_kill_is_published_by_the_next_run(tmp_path):
    """Killed after the replace entry, before the publish: the next run has nothing to plan but
    still publishes the staged file, so every path files() lists exists."""
    root = str(tmp_path / "out")
    _c, ids = _commit_small(root, 3)
    assert _run_compactor(root, "before-publish", 1 << 30) == -signal.SIGKILL
    assert any(not os.path.exists(f) for f in open_snapshot(root).files())  # committed, still staged
    assert _run_compactor(root, "none", 1 << 30) == 0
    final = open_snapshot(root)
    assert len(final.files()) == 1 and all(os.path.exists(f) for f in final.files())
    _assert_exactly_once(final, ids)


# -- what a merged shard may be -----------------------------------------------------------------


def _decoded(root: str, e) -> int:
    """What a shard's columns decode to, as its footer states (the schema gate's measure)."""
    meta = pq.ParquetFile(os.path.join(root, e.path)).metadata
    return sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))


def test_a_merged_shard_stays_within_the_schema_gates_decode_limit(tmp_path, monkeypatch):
    """Files compress: a run small on disk can decode to more than the gate lets a reader open.
    Merged shards stay within half the limit (planned by their footers' sizes, the result gated
    before it is staged), so every reader still reads every episode."""
    from rlrec.store import schema_gate

    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 6)
    shards = list(live_shards(PartitionLog(c.storage, "rl", 0).load()).values())
    limit = 5 * max(_decoded(root, e) for e in shards)  # two shards per merged one at most
    monkeypatch.setattr(schema_gate, "MAX_SHARD_DECODED_BYTES", limit)
    compact_partition(c.log, min_age_s=0, target_bytes=1 << 30)
    compact_partition(c.log, min_age_s=0, target_bytes=1 << 30)
    snap = open_snapshot(root)
    assert len(snap.entries) < len(shards)  # merged all the same
    for e in snap.entries:
        assert _decoded(root, e) <= limit // 2 and (e.decoded_bytes in (None, _decoded(root, e)))
    _assert_exactly_once(snap, ids)


def test_a_run_that_cannot_merge_is_not_planned_again(tmp_path):
    """A shard that cannot be merged (here: its file differs from its entry's sha256) stops its
    run once; then it is left out of the plan and the others merge, instead of the same run
    being re-read and skipped on every check."""
    root = str(tmp_path / "out")
    c, _ = _commit_small(root, 4)
    live = live_shards(PartitionLog(c.storage, "rl", 0).load())
    bad = live[sorted(live)[0]]
    Path(root, bad.path).write_bytes(Path(root, live[sorted(live)[1]].path).read_bytes())
    avoid: set[int] = set()
    results = [compact_partition(c.log, min_age_s=0, max_runs=1, avoid=avoid) for _ in range(3)]
    assert [(len(r.skipped), r.written, r.replaced) for r in results] == [(1, 0, 0), (0, 1, 3), (0, 0, 0)]
    assert avoid == {bad.seq}
    after = live_shards(PartitionLog(c.storage, "rl", 0).load())
    assert len(after) == 2 and bad.seq in after


def test_a_merged_file_that_lost_rows_is_never_committed(tmp_path, monkeypatch):
    """The replace entry's episode ids are checked against the merged file itself: a merge that
    dropped a part is refused before it is staged, and nothing is appended."""
    from rlrec.store import compaction

    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 3)
    real = compaction.merge_shards
    monkeypatch.setattr(compaction, "merge_shards", lambda parts, fmt, comp="zstd": real(parts[:-1], fmt, comp))
    before = PartitionLog(c.storage, "rl", 0).load()
    res = compact_partition(c.log, min_age_s=0)
    assert res.written == 0 and res.skipped and "rows" in res.skipped[0]
    assert PartitionLog(c.storage, "rl", 0).load() == before
    assert not list(Path(root).glob("*/_staging/*"))  # nothing staged
    _assert_exactly_once(open_snapshot(root), ids)


def test_each_replacement_checks_only_the_entries_since_the_previous_one(tmp_path, monkeypatch):
    """append_replace re-reads the log from where the caller last read it: after each
    replacement that point moves on, so many merges in one call read each new entry once."""
    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 12)
    target = 2 * max(e.bytes for e in read_manifest(c.storage))
    view = PartitionLog(c.storage, "rl", 0)
    view.load()
    read = []
    real = PartitionLog._read_range

    def counting(self, lo, hi, *a, **kw):
        read.append(max(0, hi - lo))
        return real(self, lo, hi, *a, **kw)

    monkeypatch.setattr(PartitionLog, "_read_range", counting)
    res = compact_partition(c.log, min_age_s=0, target_bytes=target, view=view)
    assert res.written >= 5 and sum(read) <= 2 * res.written, read
    _assert_exactly_once(open_snapshot(root), ids)


def test_rlrec_compact_appends_nothing_after_a_consumer_claims_in_the_race(tmp_path):
    """A consumer that claims the partition right after rlrec compact's claim (its lease then
    live) fences the compactor: the partition is reported and nothing follows the consumer's
    claim."""
    from rlrec.consumer.writer import PartitionWriter
    from rlrec.store.compaction import compact_unowned

    root = str(tmp_path / "out")
    c, ids = _commit_small(root, 3)
    st = c.storage
    consumer = PartitionWriter(st, "rl", 0)
    real = PartitionLog.claim

    def claim_then_consumer(self, writer_id=None, **kw):
        epoch = real(self, writer_id, **kw)
        if writer_id and writer_id.startswith("rlrec-compact:"):
            consumer.claim()
            consumer.upkeep(time.time())  # its lease
        return epoch

    PartitionLog.claim = claim_then_consumer
    try:
        results, refused = compact_unowned(st, min_age_s=0, force=True)
    finally:
        PartitionLog.claim = real
    assert results == [] and len(refused) == 1 and "claimed by a consumer while compaction started" in refused[0]
    entries = PartitionLog(st, "rl", 0).load()
    assert isinstance(entries[-1], ClaimEntry) and entries[-1].epoch == consumer.epoch
    late = consumer.committer.commit(expert_cartpole_episodes(1, seed=9, max_steps=30))  # it goes on writing
    _assert_exactly_once(open_snapshot(root), ids + [fe.episode_id for fe in late.written])


_CONSUMER_COMPACTING = textwrap.dedent(
    """
    import os, signal, sys, time
    from rlrec.consumer.writer import Compaction, PartitionWriter
    from rlrec.store import manifest
    from rlrec.store.storage import Storage
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    root = sys.argv[1]
    real = manifest.PartitionLog.publish
    def publish(self, entry, data=None):
        if ".c" in entry.path.rsplit("+", 1)[-1]:  # the merged shard: committed, still staged
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, entry, data)
    manifest.PartitionLog.publish = publish
    w = PartitionWriter(Storage.from_uri(root), "rl", 0, compaction=Compaction(after_s=0.001))
    w.claim()
    for i in range(4):
        w.committer.commit(expert_cartpole_episodes(2, seed=i, max_steps=30))
    time.sleep(0.01)
    w.upkeep(time.time())  # compacts on this thread (no encoder): killed in its publish
    print("not killed", flush=True)
    """
)


def test_a_consumer_killed_in_its_own_compaction_restarts_cleanly(tmp_path):
    """kill -9 of a consumer's writer between its replace entry and the publish: the next owner's
    claim publishes the merged shard, every episode is read once, each keeps its replay horizon,
    and the new owner's compaction goes on from there."""
    from rlrec.consumer.writer import Compaction, PartitionWriter

    root = str(tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(
        [sys.executable, "-c", _CONSUMER_COMPACTING, root], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr[-2000:]
    st = Storage.from_uri(root)
    entries = PartitionLog(st, "rl", 0).load()
    assert isinstance(entries[-1], ReplaceEntry)  # committed before the kill
    firsts = {i: e.last_offset for e in read_first_commits(st) for i in e.episode_ids}  # as first committed
    w = PartitionWriter(st, "rl", 0, compaction=Compaction(after_s=0.001))
    w.claim(replay_from=0)
    snap = open_snapshot(root)
    assert all(os.path.exists(f) for f in snap.files())  # rolled forward by the claim
    _assert_exactly_once(snap, list(firsts))
    assert {i: w.committer.log.committed_offset(i) for i in firsts} == firsts
    late = w.committer.commit(expert_cartpole_episodes(2, seed=30, max_steps=30))
    time.sleep(0.01)
    w.upkeep(time.time())  # compacts the merged shard with the new one
    final = open_snapshot(root)
    assert len(final.files()) == 1 and all(os.path.exists(f) for f in final.files())
    _assert_exactly_once(final, [*firsts, *(fe.episode_id for fe in late.written)])


def test_rlrec_compact_appends_no_claim_when_nothing_merges(tmp_path):
    """A partition whose only run cannot merge (a shard refused) is reported as skipped, and its
    log is left as it was: no claim either, so cron runs do not grow it (and fence no one)."""
    from rlrec.store.compaction import compact_unowned

    root = str(tmp_path / "out")
    c, _ = _commit_small(root, 2)
    live = live_shards(PartitionLog(c.storage, "rl", 0).load())
    a, b = (live[s] for s in sorted(live))
    Path(root, a.path).write_bytes(Path(root, b.path).read_bytes())  # differs from its sha256
    before = PartitionLog(c.storage, "rl", 0).load()
    results, refused = compact_unowned(c.storage, min_age_s=0, force=True)
    assert refused == [] and results[0].written == 0 and len(results[0].skipped) == 1
    assert PartitionLog(c.storage, "rl", 0).load() == before
    assert read_lease(c.storage, "rl", 0) is None


@pytest.mark.slow
def test_a_killed_compactor_beside_a_live_consumer(tmp_path):
    """rlrec compact killed -9 at random points while a consumer's writer commits to its own
    partition (lease renewed) and the other partition has no owner: at every cursor taken
    meanwhile each episode is read once; the live owner is never fenced (no claim but its own)
    and commits throughout; a re-run finishes the unowned partition."""
    import threading

    from rlrec.consumer.writer import PartitionWriter

    root = str(tmp_path / "out")
    _c1, ids1 = _commit_small(root, 12, partition=1)
    st = Storage.from_uri(root)
    target = 3 * max(e.bytes for e in read_manifest(st))
    owner = PartitionWriter(st, "rl", 0)
    owner.claim()
    owner.upkeep(time.time())
    ids0: list[str] = []
    stop = threading.Event()

    def consume():
        i = 0
        while not stop.is_set():
            owner.upkeep(time.time())
            res = owner.committer.commit(expert_cartpole_episodes(1, seed=100 + i, max_steps=20))
            ids0.extend(fe.episode_id for fe in res.written)
            i += 1
            stop.wait(0.05)

    t = threading.Thread(target=consume)
    t.start()
    rng = random.Random(17)
    cursors = []
    take = lambda: cursors.append(open_snapshot(root).cursor)  # noqa: E731
    try:
        for _ in range(4):
            _run_compactor(root, "none", target, kill_after=rng.uniform(0.0, 0.4), during=take)
            take()
        assert _run_compactor(root, "none", target) == 0
    finally:
        stop.set()
        t.join()
    for cur in cursors:
        snap = open_snapshot(root, as_of=cur)
        seen = _step_ids(snap)
        assert max(seen.values()) == 1
        assert {eid for eid, _ in seen} == {i for e in snap.entries for i in e.episode_ids}
    head = open_snapshot(root)  # through a live set once the log passes 100 entries: no episode ids
    final = open_snapshot(root, as_of=head.cursor)  # the same point with them
    _assert_exactly_once(final, ids0 + ids1)
    assert all(os.path.exists(f) for f in final.files())
    claims0 = [e for e in PartitionLog(st, "rl", 0).load() if isinstance(e, ClaimEntry)]
    assert [c.epoch for c in claims0] == [owner.epoch]  # never fenced
    assert len([f for f in final.files() if "+00001+" in f]) <= 12 // 2
