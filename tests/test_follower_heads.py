"""The trainer's `ManifestFollower`: what its first poll delivers (a fresh trainer, and one
resumed from a checkpoint: a new follower whose trained shards the checkpoint names) and what it
reads to find it. The deliveries are pinned exactly -- every shard, its covers, its episode
filter, the order -- on a store with compactions, replaced files retained away, replaced files
not recorded yet, replaced files recorded inside their grace, expired shards inside their grace,
two partition logs and two policies, so that reading the first poll from the manifest's heads
(`rlrec.store.live_set`) cannot change them. Real local storage."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from rlrec.store.commit import ShardCommitter
from rlrec.store.compaction import compact_partition
from rlrec.store.live_set import write_live_set
from rlrec.store.manifest import PartitionLog, ReplaceEntry, ShardEntry
from rlrec.store.retention import read_removals, retain
from rlrec.store.storage import Storage
from rlrec.trainer.manifest_follower import ManifestFollower
from rlrec.trainer.synthetic import expert_cartpole_episodes

_ENTRY = re.compile(r"_manifest/rl/00000/(\d{12})\.json$")


def _commit(c: ShardCommitter, n: int, seed: int, policy: str = "expert") -> list[str]:
    """Commit `n` shards of 2 episodes of `policy`; their paths."""
    out = []
    for i in range(n):
        c.commit(expert_cartpole_episodes(2, seed=seed + i, max_steps=20, policy_id=policy))
        out.append(_shards(c.storage, c.topic, c.partition)[-1].path)
        time.sleep(0.002)  # distinct commit times: the deliveries' order is the commits'
    return out


def _entries(st: Storage, topic: str, partition: int) -> list:
    return PartitionLog(st, topic, partition).load()


def _shards(st: Storage, topic: str, partition: int) -> list[ShardEntry]:
    return [e for e in _entries(st, topic, partition) if isinstance(e, ShardEntry)]


def _merged(st: Storage, topic: str, partition: int) -> list[ReplaceEntry]:
    return [e for e in _entries(st, topic, partition) if isinstance(e, ReplaceEntry)]


def _compact(c: ShardCommitter, parts: int, policy: str = "expert") -> None:
    target = parts * max(e.bytes for e in _shards(c.storage, c.topic, c.partition))
    assert compact_partition(c.log, min_age_s=0, target_bytes=target, policy_id=policy).written >= 1


def _build(root: str, early: list[ManifestFollower]) -> dict[str, object]:
    """The store (module docstring); `early` followers poll once in the middle of it. Returns
    what the test names: paths of shards by label, merged shards and their held seqs."""
    a = ShardCommitter(root, "rl", 0, snapshot_every=3)
    a.log.live_set_every = 5
    b = ShardCommitter(a.storage, "rl", 1, snapshot_every=3)
    b.log.live_set_every = 5
    st = a.storage
    old = _commit(a, 3, 0, policy="old")  # expired later, inside their grace
    time.sleep(0.3)
    cutoff = time.time()
    ab = _commit(a, 6, 10)
    for f in early:
        assert len(f.poll(force_discover=True)) == 9
    _compact(a, 3)  # A (ab[:3]), B (ab[3:])
    r1 = _commit(b, 3, 40)
    retain(st, grace_s=0)  # ab's files recorded and deleted
    plain = _commit(a, 2, 20)
    _compact(b, 3)  # M1 (r1): its replaced files recorded by the next run, in their grace
    retain(st, grace_s=3600, older_than_s=time.time() - cutoff)  # old expired, in grace
    c_parts = _commit(a, 3, 30)
    _compact(a, 3)  # C (c_parts): replaced, not recorded
    write_live_set(st, "rl", 0, writer="test")
    write_live_set(st, "rl", 1, writer="test")
    tail = _commit(a, 1, 50) + _commit(b, 1, 60)  # after the live sets
    merged = {m.shard.path: m for m in _merged(st, "rl", 0) + _merged(st, "rl", 1)}
    by_parts = {tuple(sorted(ab[:3])): "A", tuple(sorted(ab[3:])): "B", tuple(sorted(c_parts)): "C"}
    seq_path = {(e.topic, e.partition, e.seq): e.path for p in (0, 1) for e in _shards(st, "rl", p)}
    names: dict[str, str] = {}
    for path, m in merged.items():
        parts = tuple(sorted(seq_path[(m.shard.topic, m.shard.partition, q)] for q in m.replaces))
        names[by_parts.get(parts, "M1")] = path
    return {"old": old, "ab": ab, "r1": r1, "plain": plain, "c": c_parts, "tail": tail, **names, "merged": merged}


def _seqs(st: Storage, paths: list[str]) -> tuple[int, ...]:
    at = {e.path: e.seq for p in (0, 1) for e in _shards(st, "rl", p)}
    return tuple(sorted(at[p] for p in paths))


def _got(f: ManifestFollower, infos) -> list[tuple]:
    """(path, idx order, covers' log and seqs or None, episode filter size or None, rows)."""
    out = []
    for s in infos:
        cover = f.covers.get(s.key)
        out.append(
            (s.key, None if cover is None else (cover[0], cover[1]), None if s.episodes is None else len(s.episodes))
        )
    return out


def _expected_fresh(st: Storage, n: dict, policy: str | None) -> list[tuple]:
    """A fresh follower's first poll on the built store, in delivery order (commit time)."""
    merged = n["merged"]

    def cover(label: str, log: int, parts: list[str]) -> tuple:
        return (n[label], (("rl", log), _seqs(st, parts)), None)

    rows = (
        [(p, None, None) for p in n["old"]]  # expired, recorded, files still there: from their own files
        + [cover("A", 0, n["ab"][:3]), cover("B", 0, n["ab"][3:])]  # originals gone: the merged shards
        + [(p, None, None) for p in n["plain"]]
        + [cover("M1", 1, n["r1"])]  # originals recorded (in grace): the merged shard
        + [(p, None, None) for p in n["c"]]  # replaced, not recorded: the originals
        + [(p, None, None) for p in n["tail"]]
    )
    time_of = {e.path: e.commit_time for p in (0, 1) for e in _shards(st, "rl", p)}
    time_of |= {m.shard.path: m.shard.commit_time for m in merged.values()}
    rows.sort(key=lambda r: time_of[r[0]])
    if policy == "old":
        return [r for r in rows if r[0] in n["old"]]
    if policy == "expert":
        return [r for r in rows if r[0] not in n["old"]]
    return rows


@pytest.mark.parametrize("policy", [None, "expert", "old"])
def test_a_fresh_followers_first_poll_delivers_each_episode_once_as_pinned(tmp_path, policy):
    root = str(tmp_path / "out")
    n = _build(root, [])
    st = Storage.from_uri(root)
    f = ManifestFollower(st, policy_id=policy)
    got = f.poll(force_discover=True)
    assert set(f._heads) == {("rl", 0), ("rl", 1)}  # both logs read from their heads
    assert _got(f, got) == _expected_fresh(st, n, policy)
    assert sorted(s.idx for s in got) == list(range(len(got)))
    assert f.poll(force_discover=True) == []
    assert f.removed_skipped == 0
    # each episode once: the shards delivered hold every episode of the policy, none twice
    ids = [i for s in got for i in _episode_ids(st, s.key)]
    assert (
        len(ids)
        == len(set(ids))
        == 2 * len(_expected_fresh(st, n, policy)) + sum(4 for r in _expected_fresh(st, n, policy) if r[1] is not None)
    )
    # a later commit is delivered by the next poll, and only it
    c = ShardCommitter(st, "rl", 0)
    new = _commit(c, 1, 70)
    later = f.poll(force_discover=True)
    assert [s.key for s in later] == ([] if policy == "old" else new)
    assert f.entries[new[0]].episode_ids if policy != "old" else True


def _episode_ids(st: Storage, path: str) -> list[str]:
    for p in (0, 1):
        for e in _entries(st, "rl", p):
            s = e.shard if isinstance(e, ReplaceEntry) else e
            if isinstance(s, ShardEntry) and s.path == path:
                return list(s.episode_ids)
    raise KeyError(path)


def test_a_resumed_trainers_first_poll_delivers_and_classifies_as_pinned(tmp_path):
    """A follower that polled in the middle (the trainer before its checkpoint) and a new one
    at the end (the trainer resumed): the new one delivers what a fresh one does, and what the
    resumed trainer takes as trained before (`ManifestOfflineData._trained_before` over the
    checkpoint's trained keys and ranges) is exactly the shards standing for what the early one
    delivered; the early one's next poll delivers each episode it did not yet, once."""
    from rlrec.trainer.data import ManifestOfflineData

    root = str(tmp_path / "out")
    early = ManifestFollower(Storage.from_uri(root))
    n = _build(root, [early])
    st = Storage.from_uri(root)
    trained_keys = set(early.entries)
    ranges: dict[tuple[str, int], list[list[int]]] = {}
    for k in trained_keys:
        e = early.entries[k]
        ranges.setdefault((e.topic, e.partition), []).append([e.seq, e.seq + 1])
    resumed = ManifestFollower(st)
    got = resumed.poll(force_discover=True)
    assert _got(resumed, got) == _expected_fresh(st, n, None)
    by_path = ManifestFollower(st)  # a checkpoint naming its trained shards by path only
    by_path.from_heads = False  # (as `ManifestOfflineData.start` sets it for one)
    assert _got(by_path, by_path.poll(force_discover=True)) == _expected_fresh(st, n, None)
    for f, kr in ((resumed, dict(ranges)), (by_path, {})):
        od = SimpleNamespace(follower=f, _trained_keys=trained_keys, _trained_ranges=kr)
        history = [s.key for s in got if ManifestOfflineData._trained_before(od, s.key)]
        # A and B stand for trained entries whose files are gone: history; the old shards were
        # trained as themselves
        assert history == [r[0] for r in _expected_fresh(st, n, None) if r[0] in {*n["old"], n["A"], n["B"]}]
    # the early follower goes on: A and B are not delivered again (it delivered their parts)
    rest = early.poll(force_discover=True)
    assert sorted(s.key for s in rest) == sorted(n["plain"] + [n["M1"]] + n["c"] + n["tail"])
    assert early.covers[n["M1"]][1] == _seqs(st, n["r1"])


@pytest.fixture
def storage_calls(monkeypatch) -> list[tuple[str, str]]:
    """Every storage call that reaches the store (read, exists, info, list) and its path."""
    calls: list[tuple[str, str]] = []
    for name in ("read", "exists", "info", "list"):
        real = getattr(Storage, name)

        def counted(self, path, *a, _real=real, _name=name, **kw):
            calls.append((_name, str(path)))
            return _real(self, path, *a, **kw)

        monkeypatch.setattr(Storage, name, counted)
    return calls


def test_a_followers_first_poll_reads_the_heads_not_the_history(tmp_path, storage_calls):
    """A log of ~250 entries with a live set near its end and removal records before it: the
    first poll reads the live set, the entries after it and the removal records it does not
    fold -- no older entry or snapshot, no removal record it folds -- and delivers what the
    history does."""
    from rlrec.store.live_set import read_live_set
    from rlrec.store.retention import record_path

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=10)
    c.log.live_set_every = 0
    st = c.storage
    for round_ in range(3):
        _commit(c, 60, 100 * round_)
        _compact(c, 4)
        retain(st, grace_s=0)  # the replaced files recorded and deleted: records the live set folds
    ls = write_live_set(st, "rl", 0, writer="test")
    assert ls is not None and ls.tables is not None
    tail = _commit(c, 3, 900)
    history = ManifestFollower(st)
    history.from_heads = False
    expected = [s.key for s in history.poll(force_discover=True)]
    assert len(expected) == 3 * 15 + 3
    folded = {record_path(r.n) for r in read_removals(st) if r.n < ls.removals}
    assert folded
    storage_calls.clear()
    f = ManifestFollower(st)
    got = f.poll(force_discover=True)
    assert [s.key for s in got] == expected and tail[-1] in f.entries
    entry_reads = [int(m.group(1)) for name, p in storage_calls if name == "read" and (m := _ENTRY.search(p))]
    # the entries from the live set on, and its checks: the log's entry 0 and the entry below its seq
    assert entry_reads and all(q >= ls.seq - 1 or q == 0 for q in entry_reads), entry_reads
    assert not folded & {p for name, p in storage_calls if name == "read"}  # (its newest probed: it exists)
    assert len(storage_calls) <= 30
    assert read_live_set(st, "rl", 0).seq == ls.seq


def _seen(f: ManifestFollower, infos) -> list[tuple]:
    return [(s.key, f.covers.get(s.key, (None, None))[:2], s.episodes, s.rows) for s in infos]


def test_followers_from_the_heads_and_from_the_history_go_on_alike(tmp_path):
    """Followers started from the heads (one with entries after the live set, one at its very
    end) and from the history poll alike as the store goes on: new shards, then a compaction
    merging delivered and new shards whose replaced files are removed before the next poll
    (the merged shard stands for the new entries only, read for their episodes)."""
    root = str(tmp_path / "out")
    _build(root, [])
    st = Storage.from_uri(root)
    pairs = []
    for at_end in (False, True):
        if at_end:
            for p in (0, 1):
                write_live_set(st, "rl", p, writer="test")
        heads, history = ManifestFollower(st), ManifestFollower(st)
        history.from_heads = False
        assert _seen(heads, heads.poll(force_discover=True)) == _seen(history, history.poll(force_discover=True))
        assert set(heads._heads) == {("rl", 0), ("rl", 1)} and not history._heads
        pairs.append((heads, history))
    c = ShardCommitter(st, "rl", 0)
    new = _commit(c, 2, 80)
    for heads, history in pairs:
        got = heads.poll(force_discover=True)
        assert [s.key for s in got] == new and _seen(heads, got) == _seen(history, history.poll(force_discover=True))
    more = _commit(c, 3, 90)
    assert compact_partition(c.log, min_age_s=0, target_bytes=1 << 30, policy_id="expert").written == 1
    retain(st, grace_s=0)
    for heads, history in pairs:
        got = heads.poll(force_discover=True)
        assert _seen(heads, got) == _seen(history, history.poll(force_discover=True))
        assert len(got) == 1 and got[0].episodes == frozenset(i for p in more for i in _episode_ids(st, p))
        assert heads.poll() == [] and history.poll() == []


def test_a_checkpoint_with_ranges_and_shards_placed_by_path_only_reads_the_history(tmp_path):
    """A checkpoint holds ranges for one log and a trained shard of another known by path only
    (``trained_unplaced``); that shard was compacted into M and its file retained away. From
    the heads M's covers would not name the path, and M would be trained as new a second time:
    the first poll reads the history, and M is taken as trained before."""
    from rlrec.trainer.data import ManifestOfflineData, first_poll_from_heads

    root = str(tmp_path / "out")
    a = ShardCommitter(root, "rl", 0, snapshot_every=3)
    a.log.live_set_every = 10**9
    b = ShardCommitter(a.storage, "rl", 1, snapshot_every=3)
    b.log.live_set_every = 10**9
    st = a.storage
    parts = _commit(a, 3, 0)
    other = _commit(b, 2, 50)
    _compact(a, 3)
    retain(st, grace_s=0)
    write_live_set(st, "rl", 0, writer="test")
    write_live_set(st, "rl", 1, writer="test")
    merged = _merged(st, "rl", 0)[0].shard.path
    trained_keys = {parts[0], *other}
    trained_ranges = {("rl", 1): [(0, 10)]}
    assert first_poll_from_heads(trained_keys, trained_ranges, {parts[0]}) is False
    assert first_poll_from_heads(trained_keys, trained_ranges, None) is False
    assert first_poll_from_heads(trained_keys, trained_ranges, set()) is True
    f = ManifestFollower(st)
    f.from_heads = first_poll_from_heads(trained_keys, trained_ranges, {parts[0]})
    got = f.poll(force_discover=True)
    assert not f._heads
    assert sorted(s.key for s in got) == sorted([*other, merged])
    assert f.covers[merged][2] == tuple(parts)
    od = SimpleNamespace(follower=f, _trained_keys=trained_keys, _trained_ranges=trained_ranges)
    assert ManifestOfflineData._trained_before(od, merged) is True


def test_records_naming_entries_below_a_head_read_later_are_not_kept_pending(tmp_path):
    """Removal records retention writes after the first poll from the heads, naming entries
    below the live set, are forgotten by the poll that reads them (as the first poll does), not
    held to be resolved on every later poll; followers from the heads and from the history
    deliver alike."""
    root = str(tmp_path / "out")
    a = ShardCommitter(root, "rl", 0, snapshot_every=3)
    a.log.live_set_every = 10**9
    st = a.storage
    _commit(a, 6, 0)
    write_live_set(st, "rl", 0, writer="test")
    heads, history = ManifestFollower(st), ManifestFollower(st)
    history.from_heads = False
    assert _seen(heads, heads.poll(force_discover=True)) == _seen(history, history.poll(force_discover=True))
    assert set(heads._heads) == {("rl", 0)}
    new = _commit(a, 1, 100)
    _compact(a, 6)  # merges the entries below the live set
    retain(st, grace_s=0)  # records naming them, read by the next polls
    assert any(f.seq < heads._heads[("rl", 0)].end for r in read_removals(st) for f in r.files)
    for _ in range(3):
        for f in (heads, history):
            f._removals._listed_at = None  # list the removal log now
        got = heads.poll(force_discover=True)
        assert _seen(heads, got) == _seen(history, history.poll(force_discover=True))
        assert heads._removals._pending.get(("rl", 0), {}) == {}
    assert new[0] in heads.entries


@pytest.mark.parametrize("skew_s, grace_s, by_listing", [(120.0, 60.0, False), (0.0, 0.2, False), (0.0, 0.2, True)])
def test_a_live_set_folds_a_record_only_once_its_files_are_gone_whatever_the_clocks(
    tmp_path, monkeypatch, skew_s, grace_s, by_listing
):
    """Expired shards recorded by retention, their files still there: inside the record's grace
    by retention's clock but past it by the live set writer's (ahead by `skew_s`), or past the
    grace with no retention run since. The live set does not fold the record, and a fresh
    follower's first poll from the heads delivers the shards from their files, as the history
    does; once retention deleted them, the next live set folds it, and neither delivers them.
    `by_listing`: the writer lists the files' directories rather than checking each file."""
    from rlrec.store import live_set

    if by_listing:
        monkeypatch.setattr(live_set, "_CHECKS_BY_PATH", 0)
    root = str(tmp_path / "out")
    a = ShardCommitter(root, "rl", 0, snapshot_every=3)
    a.log.live_set_every = 10**9
    st = a.storage
    old = _commit(a, 3, 0, policy="old")
    time.sleep(0.3)
    cut = time.time()
    new = _commit(a, 3, 10)
    retain(st, grace_s=grace_s, older_than_s=time.time() - cut)
    assert [len(r.files) for r in read_removals(st)] == [3] and all(st.exists(p) for p in old)
    time.sleep(2 * grace_s if grace_s < 1 else 0)  # a short grace has ended; no retain since
    real = time.time
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: real() + skew_s)  # the writer's clock
        ls = write_live_set(st, "rl", 0, writer="test")
    assert ls is not None and ls.folds_deleted_only and ls.removals == 0
    heads, history = ManifestFollower(st), ManifestFollower(st)
    history.from_heads = False
    got = heads.poll(force_discover=True)
    assert set(heads._heads) == {("rl", 0)}
    assert _seen(heads, got) == _seen(history, history.poll(force_discover=True))
    assert sorted(s.key for s in got) == sorted(old + new)
    if grace_s >= 1:
        return
    assert sorted(retain(st, grace_s=0).deleted) == sorted(old)  # the grace ended: deleted
    more = _commit(a, 1, 20)
    ls2 = write_live_set(st, "rl", 0, writer="test")
    assert ls2 is not None and ls2.removals == 1
    heads, history = ManifestFollower(st), ManifestFollower(st)
    history.from_heads = False
    got = heads.poll(force_discover=True)
    assert set(heads._heads) == {("rl", 0)}
    assert sorted(s.key for s in got) == sorted(new + more) == sorted(s.key for s in history.poll(force_discover=True))


def test_stand_ins_serve_the_first_poll_and_later_polls_alike():
    """One rule for both callers: a live merged shard stands for the entries it holds that were
    not delivered, unless delivered itself or removed; else an entry's own file while it is
    there; else it is lost (with the holder found, if any)."""
    from rlrec.trainer.follower_heads import stand_ins

    holds = {9: (1, 2, 3), 8: (4,)}
    live = {9: "m9", 8: "m8"}.get
    gone = [(1, "e1"), (2, "e2"), (4, "e4"), (5, "e5"), (6, None)]
    first = stand_ins(gone, holds, live, removed={8}, selected=lambda e: True, file_there=lambda e: e != "e5")
    assert first.merged == ["m9", "e4"] and first.covered == {1, 2, 3, 4}
    assert first.covers == [("m9", 9, (1, 2, 3))] and first.lost == [(5, "e5", None), (6, None, None)]
    later = stand_ins(
        gone,
        holds,
        live,
        removed=set(),
        selected=lambda e: e != "m8",
        file_there=lambda e: True,
        delivered={1},
        fresh=lambda m: m != "m9",
    )
    # m9 was delivered before: e2 comes from its own file, e1 (delivered) is lost with its holder
    assert later.merged == ["e2", "e5"] and later.covered == {2, 5}
    assert later.lost == [(1, "e1", "m9"), (6, None, None)] and later.covers == []
