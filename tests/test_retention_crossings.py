"""Where compaction, retention, as-of reads and lineage meet (issue 42): one clock for points,
pins at the moment of commit. Real local storage, the real committer, compactor and `retain`."""

from __future__ import annotations

import dataclasses
import threading
import time
import types
from collections import Counter

import pytest

import rlrec.store.compaction as compaction
import rlrec.store.manifest as manifest
import rlrec.store.retention as retention
from rlrec.store import snapshot
from rlrec.store.commit import ShardCommitter
from rlrec.store.compaction import compact_partition
from rlrec.store.manifest import ReplaceEntry
from rlrec.store.retention import read_removals, retain
from rlrec.store.snapshot import CursorError, ExpiredPointError, open_snapshot
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes
from tests.test_trainer_faults import s3_behind_proxy  # noqa: F401  (a fixture)

#: S in these tests: an as_of time this far in the past is a fixed point
WINDOW_S = 0.05


@pytest.fixture(autouse=True)
def _short_window(monkeypatch):
    monkeypatch.setattr(snapshot, "APPEND_WINDOW_S", WINDOW_S)


def _commit(c: ShardCommitter, shards: int, seed0: int = 0, per: int = 2) -> list[str]:
    ids: list[str] = []
    for i in range(shards):
        res = c.commit(expert_cartpole_episodes(per, seed=seed0 + i, max_steps=20))
        ids += [fe.episode_id for fe in res.written]
    return ids


def _episodes(snap) -> Counter:
    """{episode id: times read} (each step of an episode read once: checked)."""
    t = snap.steps()
    steps = Counter(zip(t.column("episode_id").to_pylist(), t.column("t").to_pylist()))
    assert not steps or max(steps.values()) == 1, "a step was read twice"
    return Counter(eid for eid, step in steps if step == 0)


def _settled(t: float) -> None:
    """Wait until time `t` is an as_of time a reader may ask for (older than S)."""
    while time.time() <= t + WINDOW_S:
        time.sleep(0.01)


def _ahead(seconds: float):
    """A stand-in for `rlrec.store.manifest`'s time module whose clock runs `seconds` ahead
    (a compactor on a host with a clock ahead)."""
    return types.SimpleNamespace(time=lambda: time.time() + seconds, sleep=time.sleep, monotonic=time.monotonic)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _AheadReplace(ReplaceEntry):
    """A replace entry made on a host whose clock runs 10 minutes ahead."""

    time: float = dataclasses.field(default_factory=lambda: time.time() + 600.0)


def _exactly(snap, ids) -> None:
    got = _episodes(snap)
    assert set(got) == set(ids) and set(got.values()) <= {1}, (len(got), len(ids))


# -- one clock for points ------------------------------------------------------------------------


def test_an_as_of_time_between_a_compactor_clock_ahead_and_a_retain_reads_every_episode(tmp_path, monkeypatch):
    """A compactor whose clock runs 10 minutes ahead stamps its replace entry in the future; a
    `retain` then records the replaced shards. A time after the record but before the replace
    entry's time is a point below the replacement: the replaced shards are live there and the
    record (planned at positions above that point) does not count -- every episode is read, and
    the cursor handed out, with `changes` since it, loses none."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    ids = _commit(c, 3)
    ahead = _ahead(600.0)  # every clock the compactor's entries are stamped by
    monkeypatch.setattr(manifest, "time", ahead)
    monkeypatch.setattr(compaction, "time", ahead)
    monkeypatch.setattr(compaction, "ReplaceEntry", _AheadReplace)
    assert compact_partition(c.log, min_age_s=0).replaced == 3
    assert max(e.time for e in c.log.entries if isinstance(e, ReplaceEntry)) > time.time() + 500
    monkeypatch.undo()
    monkeypatch.setattr(snapshot, "APPEND_WINDOW_S", WINDOW_S)
    res = retain(c.storage, grace_s=3600)
    assert [f.reason for f in res.recorded] == ["replaced"] * 3
    t = time.time()
    _settled(t)
    snap = open_snapshot(root, as_of=t)
    _exactly(snap, ids)  # the replaced shards: live at this point, read within the grace
    _exactly(open_snapshot(root, as_of=snap.cursor), ids)  # the cursor it hands out holds them too
    more = _commit(c, 1, seed0=10)
    _exactly(open_snapshot(root).changes(since=snap.cursor), more)  # nothing lost between the two
    _exactly(open_snapshot(root), ids + more)


def test_an_as_of_time_during_a_retain_that_a_compaction_overtakes_reads_every_episode(tmp_path, monkeypatch):
    """No clock skew: `retain` starts, a compaction lands before it reads the logs, and it records
    the replaced shards. A time between retain's start and the replace entry reads every episode
    (the record counts only at points at or above the positions it planned at)."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    ids = _commit(c, 3)
    real = retention.read_logs
    marks: list[float] = []

    def compaction_lands_meanwhile(storage):
        marks.append(time.time())  # retain has started
        time.sleep(0.2)
        assert compact_partition(c.log, min_age_s=0).replaced == 3
        return real(storage)

    monkeypatch.setattr(retention, "read_logs", compaction_lands_meanwhile)
    assert len(retain(c.storage, grace_s=3600).recorded) == 3
    t = marks[0] + 0.1  # after retain started, before the replace entry
    _settled(time.time())
    snap = open_snapshot(root, as_of=t)
    _exactly(snap, ids)
    _exactly(open_snapshot(root, as_of=snap.cursor), ids)
    _exactly(open_snapshot(root).changes(since=snap.cursor), [])
    _exactly(open_snapshot(root), ids)


def test_an_as_of_time_reads_the_same_before_and_after_later_compaction_and_retention(tmp_path):
    """A point inside the grace is fixed: what an as_of time and its cursor read does not change
    when commits, a compaction and a retain (replaced and expired shards) land after it."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    first = _commit(c, 2)
    t = time.time()
    _settled(t)
    before = open_snapshot(root, as_of=t)
    _exactly(before, first)
    later = _commit(c, 2, seed0=10)
    assert compact_partition(c.log, min_age_s=0).replaced == 4
    assert len(retain(c.storage, grace_s=3600).recorded) == 4  # the replaced shards
    time.sleep(0.3)
    res = retain(c.storage, grace_s=3600, older_than_s=0.25)  # the merged shard: expired now
    assert [f.reason for f in res.recorded] == ["expired"]
    for point in (t, before.cursor):
        again = open_snapshot(root, as_of=point)
        assert again.cursor == before.cursor
        _exactly(again, first)
    assert open_snapshot(root).num_episodes == 0  # the newest point does not hold expired data
    with pytest.raises(ExpiredPointError):  # the later episodes expired unread: said, not skipped
        open_snapshot(root).changes(since=before.cursor)
    assert len(later) == 4


def test_a_point_past_the_grace_whose_files_a_pin_kept_reads_them(tmp_path):
    """Shards recorded as expired (grace 0.2 s) whose files a pin kept past the grace: a cursor
    taken before the record still reads them, as long as the files are there."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    ids = _commit(c, 2)
    before = open_snapshot(root).cursor
    time.sleep(0.3)
    paths = [e.path for e in open_snapshot(root).entries]
    assert len(retain(c.storage, older_than_s=0.1, grace_s=0.2).recorded) == 2
    time.sleep(0.3)
    assert retain(c.storage, grace_s=0.2, pinned=paths).deleted == []  # past the grace, kept by a pin
    _exactly(open_snapshot(root, as_of=before), ids)


def test_an_as_of_time_younger_than_the_append_window_is_refused(tmp_path, monkeypatch):
    root = str(tmp_path / "out")
    _commit(ShardCommitter(root, "rl", 0), 1)
    monkeypatch.setattr(snapshot, "APPEND_WINDOW_S", 300.0)
    with pytest.raises(CursorError, match="less than 300s ago") as e:
        open_snapshot(root, as_of=time.time() - 10)
    assert "\n" not in str(e.value)


def test_an_as_of_time_stays_fixed_when_an_append_stamped_before_it_lands_after_it(tmp_path, monkeypatch):
    """A shard entry built (and stamped) before its append waits (a retry, a busy log) lands
    after a reader asked for a time between the two: its time is the moment it lands, so the
    point the reader got does not grow."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    first = _commit(c, 1)
    real = c.log.append_shard
    entered = threading.Event()
    go = threading.Event()

    def delayed(entry, **kw):  # the entry is stamped; the append waits
        entered.set()
        go.wait(10)
        return real(entry, **kw)

    monkeypatch.setattr(c.log, "append_shard", delayed)
    out: list[list[str]] = []
    writer = threading.Thread(target=lambda: out.append(_commit(c, 1, seed0=5)))
    writer.start()
    assert entered.wait(10)
    time.sleep(0.05)
    t = time.time()
    _settled(t)
    at_t = open_snapshot(root, as_of=t)
    _exactly(at_t, first)
    go.set()
    writer.join(10)
    assert out and open_snapshot(root).num_episodes == len(first) + len(out[0])
    _settled(time.time())
    again = open_snapshot(root, as_of=t)
    assert again.cursor == at_t.cursor
    _exactly(again, first)


# -- pins at the moment of commit -----------------------------------------------------------------


def _version_published_while_retain_runs(tmp_path, monkeypatch, grace: str):
    """v1 trained on shard A; a trainer publishes v2, trained on A and B, right after `rlrec
    retain --policies` read its pins (v1 only) and before it records: B (old enough to expire)
    must be kept all the same. Returns (root, policies, B's episode ids, retain's exit code)."""
    import rlrec.trainer.retention_pins as retention_pins
    from rlrec.cli import main
    from rlrec.trainer.signing import generate_keys
    from tests.test_lineage import _publish_version

    root, pol = str(tmp_path / "s"), str(tmp_path / "pol")
    priv, _ = generate_keys(tmp_path / "keys")
    c = ShardCommitter(root, "rl", 0)
    _commit(c, 1)
    _publish_version(pol, 1, root, str(priv), run_id="run-a")
    b = _commit(c, 1, seed0=1)
    time.sleep(0.4)
    real = retention_pins.lineage_pins
    calls: list[int] = []

    def publish_after_the_first_pins(*a, **kw):
        got = real(*a, **kw)
        if not calls:  # the trainer publishes v2 (trained on A and B) while retain runs
            _publish_version(pol, 2, root, str(priv), run_id="run-a")
        calls.append(1)
        return got

    monkeypatch.setattr(retention_pins, "lineage_pins", publish_after_the_first_pins)
    code = main(["retain", root, "--older-than", "0.3s", "--policies", pol, "--grace", grace])
    return root, pol, b, code


def test_a_version_published_while_retain_runs_keeps_its_data_with_grace_0(tmp_path, monkeypatch):
    import rlrec

    root, pol, b, code = _version_published_while_retain_runs(tmp_path, monkeypatch, "0")
    assert code == 0
    assert read_removals(Storage.from_uri(root)) == []  # the pins asked again before recording: nothing expires
    v2 = rlrec.open(root, policy_version=2, policies=pol, allow_unsigned=True)
    held = rlrec.open(root, policy_version=2, policies=pol, allow_unsigned=True, held_out=True)
    assert set(b) <= set(_episodes(v2)) | set(_episodes(held))  # either side of the split: ids are random


def test_a_version_published_before_a_retain_that_stalls_past_the_grace_keeps_its_data(tmp_path, monkeypatch):
    """v1 pins shard B; shard A is recorded as expired (grace 120 s); a retain --policies run
    asks for the pins, then v2, trained on A and B, is published (2 minutes of grace left: A is
    re-pinned), then the retain stalls 200 s before it deletes: the pins asked after it judged
    what is due keep A."""
    import rlrec
    import rlrec.trainer.lineage as lineage
    from rlrec.trainer.retention_pins import lineage_pins
    from rlrec.trainer.signing import generate_keys
    from tests.test_lineage import _publish_version

    clock = [time.time()]
    fake = types.SimpleNamespace(time=lambda: clock[0], monotonic=time.monotonic, sleep=time.sleep)
    monkeypatch.setattr(retention, "time", fake)
    monkeypatch.setattr(lineage, "time", fake)
    root, pol = str(tmp_path / "s"), str(tmp_path / "pol")
    priv, _ = generate_keys(tmp_path / "keys")
    c = ShardCommitter(root, "rl", 0)
    b_ids = _commit(c, 1)
    _publish_version(pol, 1, root, str(priv), run_id="run-a")  # trained on B
    a_ids = _commit(c, 1, seed0=1)
    read = open_snapshot(root).entries  # what v2's trainer reads: A and B

    def pins():
        p = lineage_pins(c.storage, pol, 3)
        return p.paths, p.entries

    clock[0] = time.time() + 5
    assert len(retain(c.storage, older_than_s=1, grace_s=120, pins=pins).recorded) == 1  # A
    real = retention.live_holds

    def publish_then_stall(*a, **kw):
        _publish_as_read_earlier(monkeypatch, pol, 2, root, str(priv), read)  # A re-pinned: 2 min of grace left
        clock[0] += 200
        return real(*a, **kw)

    monkeypatch.setattr(retention, "live_holds", publish_then_stall)
    assert retain(c.storage, grace_s=120, pins=pins).deleted == []
    v2 = rlrec.open(root, policy_version=2, policies=pol, allow_unsigned=True)
    held = rlrec.open(root, policy_version=2, policies=pol, allow_unsigned=True, held_out=True)
    assert set(_episodes(v2)) | set(_episodes(held)) == set(a_ids + b_ids)


def test_a_version_s_data_recorded_as_removed_reopens_within_the_grace(tmp_path):
    """Lineage reopening honours the grace: data a record names (expired) whose files are still
    there is read, as every point inside the grace reads it; once the files are gone it is
    expired."""
    import rlrec
    from rlrec.trainer.signing import generate_keys
    from tests.test_lineage import _publish_version

    root, pol = str(tmp_path / "s"), str(tmp_path / "pol")
    priv, _ = generate_keys(tmp_path / "keys")
    c = ShardCommitter(root, "rl", 0)
    ids = _commit(c, 2)
    _publish_version(pol, 1, root, str(priv), run_id="run-a")
    time.sleep(0.3)
    assert len(retain(c.storage, older_than_s=0.2, grace_s=3600).recorded) == 2  # no pins given: recorded
    v1 = rlrec.open(root, policy_version=1, policies=pol, allow_unsigned=True)
    held = rlrec.open(root, policy_version=1, policies=pol, allow_unsigned=True, held_out=True)
    assert set(_episodes(v1)) | set(_episodes(held)) == set(ids)
    retain(c.storage, grace_s=0, now=time.time() + 3601)  # the grace is over: deleted
    with pytest.raises(ExpiredPointError):
        rlrec.open(root, policy_version=1, policies=pol, allow_unsigned=True)


def _publish_as_read_earlier(monkeypatch, pol, version, root, priv, entries, **kw):
    """Publish `version` whose lineage names `entries` (what its trainer read earlier, before a
    retain run), as `rlrec train` publishes one."""
    import tests.test_lineage as tl

    monkeypatch.setattr(tl, "open_snapshot", lambda _root: types.SimpleNamespace(entries=entries))
    try:
        tl._publish_version(pol, version, root, priv, run_id="run-a", **kw)
    finally:
        monkeypatch.setattr(tl, "open_snapshot", open_snapshot)


def test_publishing_a_version_whose_data_retention_removed_is_refused_or_re_pinned(tmp_path, monkeypatch):
    """A trainer read shards A (then retain expired and deleted them: grace 0) and B (expired,
    within a long grace): the version trained on A is refused (never deployed: latest.json is
    not moved to it); the one trained on B only is published and pins B, so a retain after the
    grace keeps B's files and the version's data still reopens."""
    import rlrec
    from rlrec.trainer.lineage import LineageError
    from rlrec.trainer.policy import read_latest
    from rlrec.trainer.retention_pins import lineage_pins
    from rlrec.trainer.signing import generate_keys

    priv, _ = generate_keys(tmp_path / "keys")
    pol = str(tmp_path / "pol")
    a_root, b_root = str(tmp_path / "a"), str(tmp_path / "b")
    a, b = ShardCommitter(a_root, "rl", 0), ShardCommitter(b_root, "rl", 0)
    _commit(a, 1)
    b_ids = _commit(b, 2)
    a_read, b_read = open_snapshot(a_root).entries, open_snapshot(b_root).entries
    time.sleep(0.3)
    assert len(retain(a.storage, older_than_s=0.2, grace_s=0).deleted) == 1
    assert len(retain(b.storage, older_than_s=0.2, grace_s=3600).recorded) == 2
    with pytest.raises(LineageError, match="removed by retention before it was published"):
        _publish_as_read_earlier(monkeypatch, str(tmp_path / "pa"), 1, a_root, str(priv), a_read)
    assert not (tmp_path / "pa" / "latest.json").exists()
    assert not (tmp_path / "pa" / "v000001" / "policy.json").exists()  # refused: its directory pins nothing
    _publish_as_read_earlier(monkeypatch, pol, 1, b_root, str(priv), b_read)  # re-pinned
    assert read_latest(pol)["policy_version"] == 1

    def pins():
        p = lineage_pins(b.storage, pol, 3)
        return p.paths, p.entries

    assert retain(b.storage, grace_s=0, now=time.time() + 3601, pins=pins).deleted == []
    v1 = rlrec.open(b_root, policy_version=1, policies=pol, allow_unsigned=True)
    held = rlrec.open(b_root, policy_version=1, policies=pol, allow_unsigned=True, held_out=True)
    assert set(_episodes(v1)) | set(_episodes(held)) == set(b_ids)


def test_data_expired_before_the_version_before_never_blocks_later_versions(tmp_path, monkeypatch):
    """A trainer trained on shard A, published v1, then A expired and was deleted (grace 0, no
    pins): v2, trained on A and then on B, is published (A is older than v1: not its loss) and
    deployed; v3, whose data trained since v2 (C) is deleted, is refused and its directory
    removed -- it never pins data -- and v4 (trained since v3 on D only) is published again."""
    from rlrec.trainer.lineage import LineageError, ranges_doc
    from rlrec.trainer.policy import read_latest
    from rlrec.trainer.signing import generate_keys

    priv, _ = generate_keys(tmp_path / "keys")
    root, pol = str(tmp_path / "s"), str(tmp_path / "pol")
    c = ShardCommitter(root, "rl", 0)

    def ranges(entries):
        return ranges_doc({("rl", 0): [[e.seq, e.seq + 1] for e in entries]})

    _commit(c, 1)
    a_read = open_snapshot(root).entries
    _publish_as_read_earlier(monkeypatch, pol, 1, root, str(priv), a_read)
    time.sleep(0.3)
    assert len(retain(c.storage, older_than_s=0.2, grace_s=0).deleted) == 1  # A is gone
    _commit(c, 1, seed0=1)
    ab_read = open_snapshot(root).entries
    _publish_as_read_earlier(monkeypatch, pol, 2, root, str(priv), a_read + ab_read, trained_before=ranges(a_read))
    assert read_latest(pol)["policy_version"] == 2
    _commit(c, 1, seed0=2)
    abc_read = a_read + open_snapshot(root).entries
    time.sleep(0.3)
    assert len(retain(c.storage, older_than_s=0.2, grace_s=0).deleted) == 2  # B and C are gone
    with pytest.raises(LineageError, match="trained on since the version before"):
        _publish_as_read_earlier(
            monkeypatch, pol, 3, root, str(priv), abc_read, trained_before=ranges(a_read + ab_read)
        )
    assert read_latest(pol)["policy_version"] == 2
    assert not (tmp_path / "pol" / "v000003").exists() or not any((tmp_path / "pol" / "v000003").iterdir())
    _commit(c, 1, seed0=3)
    d_read = open_snapshot(root).entries
    _publish_as_read_earlier(monkeypatch, pol, 4, root, str(priv), abc_read + d_read, trained_before=ranges(abc_read))
    assert read_latest(pol)["policy_version"] == 4


# -- the follower keeps what it was given ---------------------------------------------------------


def _served_episodes(root: str, infos, monkeypatch) -> list[str]:
    """The id of every episode the trainer's read task serves for `infos` (the real read task
    and feed bookkeeping, in-process; one episode per chunk)."""
    import pyarrow as pa

    from rlrec.store.episodes import unpack_episode
    from rlrec.trainer import read_task
    from rlrec.trainer.envelopes import ENVELOPE
    from rlrec.trainer.feed import FeedPolicy, FeedState
    from tests.test_trainer_faults import FeedStandIn, _Call

    state = FeedState(FeedPolicy(chunk_rows=1, max_ahead_rows=10**6, fresh_fraction=1.0))
    state.add_shards(infos)
    feed = FeedStandIn(state)
    feed.processed = _Call(state.processed)
    monkeypatch.setattr(read_task.ray, "get", lambda x: x)
    blocks = read_task._serve(feed, Storage.from_uri(root), read_task._TableCache(1 << 24), ["item"], verify=True)
    rows = []
    for b in blocks:
        chunk = pa.ipc.open_stream(b.column(ENVELOPE)[0].as_py()).read_all()
        assert chunk.column_names == ["item", read_task.TAG]
        rows += [str(unpack_episode(item).id_) for item in chunk.column("item").to_pylist()]
    return rows


def test_version_filters_apply_per_episode_to_a_merged_shard(tmp_path, monkeypatch):
    """Episodes of policy versions 1 and 6, merged by compaction whose replaced files retention
    removed: a trainer started with --min-policy-version 5 gets the merged shard, and trains on
    its version-6 episodes only."""
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    old = [fe.episode_id for fe in c.commit(expert_cartpole_episodes(2, policy_version=1, max_steps=20)).written]
    new = [
        fe.episode_id for fe in c.commit(expert_cartpole_episodes(2, seed=1, policy_version=6, max_steps=20)).written
    ]
    assert compact_partition(c.log, min_age_s=0).replaced == 2
    assert len(retain(c.storage, grace_s=0).deleted) == 2
    follower = ManifestFollower(Storage.from_uri(root), min_policy_version=5)
    infos = follower.poll(force_discover=True)
    assert len(infos) == 1  # the merged shard, standing for both shard entries
    served = _served_episodes(root, infos, monkeypatch)
    assert sorted(served) == sorted(new) and not set(served) & set(old)


def test_a_trainer_behind_keeps_the_shards_it_was_handed_until_it_read_them(tmp_path, monkeypatch):
    """A trainer was handed three shards and has read none when compaction merges them and a
    `retain --grace 0` runs: its reader lease keeps their files (not recorded, not deleted), so
    it reads every episode from them; once it trained on them (its lease holds nothing), the
    next retain removes them. A lease not renewed for its ttl holds nothing."""
    from rlrec.store.reader_leases import live_holds, renew_reader_lease
    from rlrec.trainer.data import TrainerLease
    from rlrec.trainer.feed import FeedPolicy, FeedState
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    st = Storage.from_uri(root)
    c = ShardCommitter(root, "rl", 0)
    ids = _commit(c, 3)
    follower = ManifestFollower(st)
    infos = follower.poll(force_discover=True)
    state = FeedState(FeedPolicy())
    state.add_shards(infos)
    lease = TrainerLease(st, "rlrec-feed-test")
    assert lease.renew(time.monotonic(), [follower.entries[k] for k in state.unread_keys()])
    assert live_holds(st) == {("rl", 0): [(1, 4)]}
    assert compact_partition(c.log, min_age_s=0).replaced == 3
    time.sleep(0.3)
    res = retain(c.storage, grace_s=0, older_than_s=0.1)  # replaced, and the merged shard expired
    assert [f.reason for f in res.recorded] == ["expired"] and res.deleted == [res.recorded[0].path]
    assert sorted(_served_episodes(root, infos, monkeypatch)) == sorted(ids)  # read from the files it was handed
    for s in infos:
        state.ack({(s.idx << 24) | 1: 1})  # trained on
    assert state.unread_keys() == []
    assert lease.renew(time.monotonic(), [])
    assert len(retain(c.storage, grace_s=0).deleted) == 3  # now they go
    renew_reader_lease(st, "stalled", {("rl", 0): [(1, 4)]}, ttl_s=120.0, now=time.time() - 121)
    assert live_holds(st) == {}
    lease.drop()
    assert [i.name for i in st.list("_readers")] == ["stalled.json"]


def test_overlapping_reader_leases_keep_every_file_either_holds(tmp_path):
    """Two trainers' leases overlap (A holds entries 1-6, B holds 2): retention keeps every file
    A holds, not only those beyond the range B's lease starts (ranges merged before the check)."""
    from rlrec.store.reader_leases import renew_reader_lease

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    _commit(c, 6)
    renew_reader_lease(c.storage, "trainer-a", {("rl", 0): [(1, 7)]})
    renew_reader_lease(c.storage, "trainer-b", {("rl", 0): [(2, 3)]})
    time.sleep(0.3)
    res = retain(c.storage, grace_s=0, older_than_s=0.1)
    assert res.recorded == [] and res.deleted == []
    assert sum(1 for _ in _episodes(open_snapshot(root)).elements()) == 12


def test_forged_skewed_or_hostile_reader_leases_hold_nothing_and_never_crash_retain(tmp_path, caplog):
    """A lease renewed far in the future (forged, or a clock far ahead), one stating a ttl of
    1e300 renewed two hours ago, and one of JSON nested 100,000 deep hold nothing and retain
    runs (the files expire); a lease expired more than an hour ago is removed by retain."""
    import logging

    from rlrec.store.reader_leases import READERS_DIR, renew_reader_lease

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    _commit(c, 2)
    st = c.storage
    renew_reader_lease(st, "future", {("rl", 0): [(1, 3)]}, ttl_s=120.0, now=1e18)
    renew_reader_lease(st, "forever", {("rl", 0): [(1, 3)]}, ttl_s=1e300, now=time.time() - 7300)
    renew_reader_lease(st, "killed", {("rl", 0): [(1, 3)]}, ttl_s=120.0, now=time.time() - 7300)
    st.write(f"{READERS_DIR}/deep.json", b"[" * 100_000 + b"]" * 100_000)
    time.sleep(0.3)
    with caplog.at_level(logging.WARNING, logger="rlrec.retention"):
        res = retain(st, grace_s=0, older_than_s=0.1)
    assert len(res.deleted) == 2
    assert sum(1 for r in caplog.records if "malformed reader lease" in r.getMessage()) >= 2  # future, deep
    names = sorted(i.name for i in st.list(READERS_DIR))
    assert names == ["deep.json", "future.json"]  # expired > 1 h ago: removed; malformed ones are left


# -- smaller crossings ------------------------------------------------------------------------------


def test_a_claim_after_compaction_and_retention_reports_no_lost_shard(tmp_path, caplog):
    """Log snapshots list shards committed but not yet published; once compaction replaced them
    and retention deleted their files, the next owner's claim says nothing is lost."""
    import logging

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=5)
    ids = _commit(c, 4)  # the claim and 4 shards: a snapshot after the 4th lists it as not published yet
    assert compact_partition(c.log, min_age_s=0).replaced == 4
    assert len(retain(c.storage, grace_s=0).deleted) == 4
    with caplog.at_level(logging.INFO, logger="rlrec.manifest"):
        ShardCommitter(root, "rl", 0, snapshot_every=5).claim()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    _exactly(open_snapshot(root), ids)


def test_one_malformed_removal_record_never_stops_a_partition_from_claiming(tmp_path, caplog):
    """As above, with a malformed removal record after retain's: the next owner claims the
    partition and ingests (the bad record is logged as an error, the good one still counts:
    nothing is reported lost)."""
    import logging

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=5)
    ids = _commit(c, 4)
    assert compact_partition(c.log, min_age_s=0).replaced == 4
    assert len(retain(c.storage, grace_s=0).deleted) == 4
    c.storage.write(retention.record_path(max(r.n for r in read_removals(c.storage)) + 1), b"{not json")
    with caplog.at_level(logging.INFO, logger="rlrec"):
        again = ShardCommitter(root, "rl", 0, snapshot_every=5)
        again.claim()
        more = [fe.episode_id for fe in again.commit(expert_cartpole_episodes(2, seed=9, max_steps=20)).written]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "malformed removal record" in errors[0], errors
    assert len(ids) == 8 and len(more) == 2


def test_a_fenced_owner_that_wakes_never_re_creates_a_file_retention_removed(tmp_path, monkeypatch):
    """Owner A committed a shard but could not publish it (kept in memory); B claims the
    partition, publishes it, compacts it away and retention deletes it; A wakes and rolls its
    publish forward: the removed file is not re-created."""
    import os

    root = str(tmp_path / "out")
    a = ShardCommitter(root, "rl", 0)
    a.claim()
    real_move = a.storage.move
    monkeypatch.setattr(a.storage, "move", lambda *x, **k: (_ for _ in ()).throw(OSError("store down")))
    _commit(a, 1)
    (entry,) = a.pending  # committed, not published: held in memory
    monkeypatch.setattr(a.storage, "move", real_move)
    b = ShardCommitter(root, "rl", 0)
    b.claim()  # fences A, publishes the staged shard
    _commit(b, 1, seed0=1)
    assert compact_partition(b.log, min_age_s=0).replaced == 2
    assert entry.path in retain(b.storage, grace_s=0).deleted
    a.publish_pending(force=True)
    assert not os.path.exists(os.path.join(root, entry.path))
    assert not a.pending


def test_metrics_lines_are_bounded_during_a_long_outage_of_their_store(s3_behind_proxy, monkeypatch):  # noqa: F811
    """While the checkpoint store does not answer, at most MAX_UNWRITTEN_LINES metrics lines
    wait in memory: the oldest unwritten ones are dropped (counted; never a line already
    written), and the newest are written once it answers."""
    import json

    from rlrec.trainer.metrics import METRICS_FILE, TrainerMetrics

    direct, through, proxy = s3_behind_proxy
    monkeypatch.setattr(TrainerMetrics, "MAX_UNWRITTEN_LINES", 5)
    base = {"policy_version": 0, "timesteps_trained": 1, "shards_total": 1, "shards_new": 1}
    m = TrainerMetrics(through, None, False)
    m.write({**base, "iteration": 1})
    proxy.fail_for(600)
    for i in range(2, 22):  # 20 lines the store does not take
        m.write({**base, "iteration": i})
        assert len(m._lines) <= 1 + 5
    proxy.fail_for(0)
    m.write({**base, "iteration": 22})
    got = [json.loads(x)["iteration"] for x in direct.read(METRICS_FILE).decode().splitlines()]
    assert got == [1, *range(18, 23)] and m.lines_dropped == 16  # the newest 5 unwritten ones kept


def test_a_merged_shard_part_of_which_was_delivered_is_read_for_the_rest_of_its_episodes(tmp_path, monkeypatch):
    """The follower delivered shard A; B landed after its poll; compaction merged A and B and
    retention removed B (A's file is kept: the trainer holds it). The next poll delivers the
    merged shard for B's episodes only: every episode read once."""
    from rlrec.trainer.data import TrainerLease
    from rlrec.trainer.feed import FeedPolicy, FeedState
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    st = Storage.from_uri(root)
    c = ShardCommitter(root, "rl", 0)
    a = _commit(c, 1)
    follower = ManifestFollower(st)
    state = FeedState(FeedPolicy())
    first = follower.poll(force_discover=True)
    state.add_shards(first)
    assert TrainerLease(st, "rlrec-feed-t").renew(time.monotonic(), [follower.entries[k] for k in state.unread_keys()])
    b = _commit(c, 1, seed0=1)
    assert compact_partition(c.log, min_age_s=0).replaced == 2
    res = retain(c.storage, grace_s=0)
    assert [f.seq for f in res.recorded] == [2]  # B only: A is held
    second = follower.poll()
    assert len(second) == 1 and second[0].episodes == frozenset(b) and follower.removed_skipped == 0
    assert sorted(_served_episodes(root, first + second, monkeypatch)) == sorted(a + b)


def test_a_recorded_shard_whose_file_is_still_there_is_delivered(tmp_path, monkeypatch):
    """The follower delivered shard A; B landed; compaction merged A and B into M and one
    retain (grace 1 h) recorded A and B (replaced) and M (expired), all between two polls. M
    stands for nothing any more, but B's own file stays for the grace: the next poll delivers B
    from it, skipping nothing."""
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    st = Storage.from_uri(root)
    c = ShardCommitter(root, "rl", 0)
    a = _commit(c, 1)
    follower = ManifestFollower(st)
    first = follower.poll(force_discover=True)
    b = _commit(c, 1, seed0=1)
    assert compact_partition(c.log, min_age_s=0).replaced == 2
    time.sleep(0.3)
    res = retain(c.storage, grace_s=3600, older_than_s=0.1)
    assert sorted(f.reason for f in res.recorded) == ["expired", "replaced", "replaced"] and res.deleted == []
    second = follower.poll()
    assert len(second) == 1 and second[0].episodes is None and follower.removed_skipped == 0
    assert sorted(_served_episodes(root, first + second, monkeypatch)) == sorted(a + b)


@pytest.mark.slow
def test_a_running_trainer_holds_its_untrained_shards_in_a_reader_lease(ray_cluster, tmp_path):
    """The real trainer (Ray): while it runs, its lease names the shards it was handed and has
    not trained on (none once all are trained); it is gone after the trainer stopped."""
    from rlrec.store.reader_leases import READERS_DIR, live_holds
    from rlrec.trainer.service import ContinuousTrainer
    from tests.test_trainer_service import cfg, run_in_thread, wait_for

    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    c = ShardCommitter(out)
    for i in range(3):
        c.commit(expert_cartpole_episodes(3, seed=i, max_steps=200))
    st = Storage.from_uri(out)
    trainer = ContinuousTrainer(cfg(out, ck, checkpoint_interval=100, min_time_s_per_iteration=1.0))
    t, box = run_in_thread(trainer)
    try:
        wait_for(lambda: st.list(READERS_DIR), 120, "the trainer's reader lease")
        holds = live_holds(st)
        assert set(holds) <= {("rl", 0)} and all(1 <= a < b <= 4 for a, b in holds.get(("rl", 0), []))
        wait_for(lambda: live_holds(st) == {}, 120, "a lease holding nothing once every shard is trained")
    finally:
        trainer.stop("test")
        t.join(120)
    assert not t.is_alive() and "error" not in box, box
    assert st.list(READERS_DIR) == []


def test_a_shard_trained_on_in_part_stays_in_the_lease_until_it_is_read_to_the_end(tmp_path):
    """A shard is trained on from its first chunk's gradient step, but the trainer still reads
    its other chunks: the lease holds it until the last one is processed (found by the crossings
    phase: retention took a shard after its first chunk, and the rest was lost)."""
    from rlrec.trainer.feed import FeedPolicy, FeedState
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    _commit(ShardCommitter(root, "rl", 0), 1, per=4)
    state = FeedState(FeedPolicy(chunk_rows=1, max_ahead_rows=10**6, fresh_fraction=1.0))
    state.add_shards(ManifestFollower(Storage.from_uri(root)).poll(force_discover=True))
    (key,) = state.unread_keys()
    w = state.next_work()
    state.processed([w.tag], 1)
    state.ack({w.tag: 1})
    assert state.trained and state.unread_keys() == [key]  # trained on, three chunks to read
    while state.has_fresh():
        w = state.next_work()
        state.processed([w.tag], 1)
    assert state.unread_keys() == []
