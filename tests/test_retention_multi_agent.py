"""Retention x multi-agent episodes: a multi-agent episode's rows live in one shard per module
(`{policy_id}.{module_id}/`), each committed by its own shard entry, and compaction merges each
module's folder on its own. Whatever `--older-than` cut or compaction comes first, every reader
-- the newest point (`multi_agent_episodes()`, `steps()`), an as-of reader, the trainer's
follower -- must see each multi-agent episode whole or not at all (docs/GUARANTEES.md,
"Retention"). History path and heads path (live sets with retention columns). Real local
storage, real simple_spread episodes (tests/multi_agent_stores.py)."""

from __future__ import annotations

import shutil
from collections import defaultdict

import pyarrow.parquet as pq
import pytest

import rlrec
from rlrec.store.compaction import compact_partition
from rlrec.store.live_set import write_live_set
from rlrec.store.manifest import PartitionLog, ShardEntry
from rlrec.store.multi_agent_shards import agent_episode_id
from rlrec.store.reader_leases import renew_reader_lease
from rlrec.store.retention import read_removals, retain
from rlrec.store.retention_heads import heads_or_history
from rlrec.store.snapshot import ExpiredPointError
from rlrec.store.storage import Storage
from rlrec.trainer.manifest_follower import ManifestFollower
from tests.multi_agent_stores import MODULES, commit_spread

COMMITS, PER_COMMIT = 3, 2
MA_IDS = [f"ma-{i}" for i in range(COMMITS * PER_COMMIT)]
#: an agent row's episode id -> (its multi-agent episode id, its agent id)
ROW_OF = {agent_episode_id(m, a): (m, a) for m in MA_IDS for a in MODULES}


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> str:
    """3 commits x 2 simple_spread episodes, one shard per module per commit (random first)."""
    root = str(tmp_path_factory.mktemp("ma-template") / "out")
    commit_spread(root, COMMITS, PER_COMMIT)
    return root


@pytest.fixture
def root(template, tmp_path) -> str:
    out = str(tmp_path / "out")
    shutil.copytree(template, out)
    return out


def _shards(root: str) -> list[ShardEntry]:
    return [e for e in PartitionLog(Storage.from_uri(root), "rl", 0).load() if isinstance(e, ShardEntry)]


def _between(a: ShardEntry, b: ShardEntry) -> float:
    """A first-commit time strictly between two entries' (stamped as each lands, in order)."""
    assert a.commit_time < b.commit_time
    return (a.commit_time + b.commit_time) / 2


def _rows(snap) -> dict[str, set[str]]:
    """Multi-agent episode id -> the agents whose rows `snap.steps()` holds."""
    out: dict[str, set[str]] = defaultdict(set)
    for eid in set(snap.steps().column("episode_id").to_pylist()):
        ma, agent = ROW_OF[eid]
        out[ma].add(agent)
    return dict(out)


def _whole_or_gone(snap) -> set[str]:
    """Assert the invariant on one point: every multi-agent episode with a row in it has every
    agent's row there and is returned by `multi_agent_episodes()` (nothing partial); returns the
    episodes it holds."""
    eps = snap.multi_agent_episodes()
    got = sorted(ep.id_ for ep in eps)
    rows = _rows(snap)
    orphans = {m: agents for m, agents in rows.items() if agents != set(MODULES)}
    assert orphans == {}, f"episodes with only some agents' rows: {orphans}"
    assert eps.partial == 0
    assert got == sorted(rows)
    return set(got)


def _delivered_whole(root: str) -> set[str]:
    """What a fresh trainer's follower (`rlrec train --multi-agent`) delivers: every multi-agent
    episode it hands over has every agent's row among the delivered shards; returns them."""
    follower = ManifestFollower(Storage.from_uri(root), multi_agent=True)
    agents: dict[str, set[str]] = defaultdict(set)
    for info in follower.poll(force_discover=True):
        t = pq.read_table(f"{root}/{info.path}", columns=["multi_agent_episode_id", "agent_id"])
        for m, a in zip(t.column("multi_agent_episode_id").to_pylist(), t.column("agent_id").to_pylist()):
            agents[m].add(a)
    orphans = {m: a for m, a in agents.items() if a != set(MODULES)}
    assert orphans == {}, f"the trainer would train on orphan rows of {sorted(orphans)}"
    return set(agents)


def test_the_store_holds_each_episode_in_two_module_shards(root):
    es = _shards(root)
    assert [e.policy_id for e in es] == ["spread.random", "spread.scripted"] * COMMITS
    assert all(e.format_version == 2 for e in es)
    snap = rlrec.open(root)
    assert _whole_or_gone(snap) == set(MA_IDS)
    assert _delivered_whole(root) == set(MA_IDS)


def test_a_cut_between_commits_removes_the_older_episodes_whole(root):
    """The control: a cut after both module entries of the first commit expires both."""
    es = _shards(root)
    before = rlrec.open(root).cursor
    cut = _between(es[1], es[2])
    st = Storage.from_uri(root)
    res = retain(st, older_than_s=1000, grace_s=3600, now=cut + 1000)
    assert sorted(f.path for f in res.recorded) == sorted(e.path for e in es[:2])
    assert {f.reason for f in res.recorded} == {"expired"} and res.deleted == []
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS[PER_COMMIT:])
    assert _whole_or_gone(rlrec.open(root, as_of=before)) == set(MA_IDS)  # within the grace
    assert _delivered_whole(root) == set(MA_IDS)  # a new trainer still gets them (their files are there)
    res = retain(st, grace_s=0, now=cut + 1000 + 3601)  # past the grace: deleted
    assert sorted(res.deleted) == sorted(e.path for e in es[:2])
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS[PER_COMMIT:])
    assert _delivered_whole(root) == set(MA_IDS[PER_COMMIT:])
    with pytest.raises(ExpiredPointError):
        rlrec.open(root, as_of=before).steps()


def test_a_cut_between_the_module_entries_of_one_commit_keeps_the_episodes_whole(root):
    es = _shards(root)
    before = rlrec.open(root).cursor
    cut = _between(es[0], es[1])  # random's shard of commit 1 is older, scripted's younger
    st = Storage.from_uri(root)
    retain(st, older_than_s=1000, grace_s=3600, now=cut + 1000)
    assert _whole_or_gone(rlrec.open(root, as_of=before)) == set(MA_IDS)  # within the grace
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS)  # keep more, never less
    assert _delivered_whole(root) == set(MA_IDS)
    retain(st, older_than_s=1000 + 3601, grace_s=0, now=cut + 1000 + 3601)  # the same cut, past the grace
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS)
    try:
        assert _whole_or_gone(rlrec.open(root, as_of=before)) == set(MA_IDS)
    except ExpiredPointError:
        pass  # an expired point fails whole, never reads a part


def test_one_module_compacted_then_a_cut_between_commits_keeps_the_episodes_whole(root):
    """Compaction merges the random module's first two shards (its newest first commit: commit
    2); the scripted module's stay apart. A cut between commit 1 and commit 2 expires the
    scripted shard of commit 1 but not the merged random shard holding the same episodes."""
    es = _shards(root)
    st = Storage.from_uri(root)
    log = PartitionLog(st, "rl", 0)
    log.claim("compactor")
    log.recover()
    res = compact_partition(log, min_age_s=0, policy_id="spread.random", target_bytes=es[0].bytes + es[2].bytes)
    assert res.written == 1 and res.replaced == 2
    cut = _between(es[1], es[2])
    res = retain(st, older_than_s=1000, grace_s=0, now=cut + 1000)
    assert sorted(f.path for f in res.recorded) == sorted([es[0].path, es[2].path])  # the replaced ones
    assert {f.reason for f in res.recorded} == {"replaced"}
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS)
    assert _delivered_whole(root) == set(MA_IDS)
    # once commit 2 is old too, the merged shard and both scripted shards go, together
    cut = _between(es[3], es[4])
    res = retain(st, older_than_s=1000, grace_s=0, now=cut + 1000)
    assert {f.path.split("/")[0] for f in res.recorded} == {"spread.random", "spread.scripted"}
    assert {f.reason for f in res.recorded} == {"expired"} and len(res.recorded) == 3
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS[2 * PER_COMMIT :])
    assert _delivered_whole(root) == set(MA_IDS[2 * PER_COMMIT :])


@pytest.mark.parametrize("hold", ["pinned_entries", "pins", "reader_lease"])
def test_a_module_shard_kept_by_a_pin_or_a_lease_keeps_its_episodes_other_shards(root, hold):
    """A cut after commit 1 expires both its shards, but the scripted one is kept by a lineage
    pin (given, or asked again right before recording) or a trainer's reader lease: the random
    shard holding the same episodes stays with it."""
    es = _shards(root)
    st = Storage.from_uri(root)
    held = {("rl", 0): [(es[1].seq, es[1].seq + 1)]}
    kw: dict = {}
    if hold == "pinned_entries":
        kw["pinned_entries"] = held
    elif hold == "pins":
        kw["pins"] = lambda: ((), held)
    else:
        renew_reader_lease(st, "trainer-feed", held, ttl_s=3600)
    res = retain(st, older_than_s=1000, grace_s=0, now=_between(es[1], es[2]) + 1000, **kw)
    assert res.recorded == [] and res.deleted == []
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS)
    assert _delivered_whole(root) == set(MA_IDS)


@pytest.fixture
def overlapping(tmp_path) -> str:
    """3 commits x 1 episode whose shards' offset ranges all overlap (as long interleaved
    episodes make them): only their files tell which shards share an episode."""
    out = str(tmp_path / "overlapping")
    commit_spread(out, 3, 1, first_offset=0)
    return out


def test_overlapping_shards_that_share_no_episode_expire_on_their_own(overlapping):
    es = _shards(overlapping)
    assert all(e.first_offset == 0 for e in es)
    res = retain(Storage.from_uri(overlapping), older_than_s=1000, grace_s=0, now=_between(es[1], es[2]) + 1000)
    assert sorted(f.path for f in res.recorded) == sorted(e.path for e in es[:2])
    assert _whole_or_gone(rlrec.open(overlapping)) == {"ma-1", "ma-2"}


def test_a_shard_whose_episodes_cannot_be_read_keeps_every_shard_it_overlaps(overlapping, caplog):
    es = _shards(overlapping)
    path = f"{overlapping}/{es[3].path}"  # commit 2's scripted shard: not its checksum's bytes any more
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 16)
    with caplog.at_level("WARNING", logger="rlrec.retention"):
        res = retain(Storage.from_uri(overlapping), older_than_s=1000, grace_s=0, now=_between(es[1], es[2]) + 1000)
    assert res.recorded == []  # keep more, never less
    assert "cannot read its multi-agent episode ids" in caplog.text


def test_from_the_heads_a_cut_between_module_entries_keeps_the_episodes_whole(root):
    es = _shards(root)
    st = Storage.from_uri(root)
    assert write_live_set(st, "rl", 0, writer="test") is not None
    cut = _between(es[0], es[1])
    now = cut + 1000
    heads, logs = heads_or_history(st, read_removals(st), older_than_s=1000, now=now)
    assert ("rl", 0) in logs and ("rl", 0) not in heads  # a multi-agent shard expiring: its history decides
    retain(st, older_than_s=1000, grace_s=0, now=now)
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS)
    assert _delivered_whole(root) == set(MA_IDS)


def test_from_the_heads_a_cut_between_commits_removes_the_older_episodes_whole(root):
    es = _shards(root)
    st = Storage.from_uri(root)
    assert write_live_set(st, "rl", 0, writer="test") is not None
    now = _between(es[1], es[2]) + 1000
    heads, logs = heads_or_history(st, read_removals(st), older_than_s=1000, now=now)
    assert ("rl", 0) in logs and ("rl", 0) not in heads  # a multi-agent shard expiring: its history decides
    assert heads_or_history(st, read_removals(st), older_than_s=1000, now=es[0].commit_time + 999)[0]  # none: heads
    res = retain(st, older_than_s=1000, grace_s=0, now=now)
    assert sorted(f.path for f in res.recorded) == sorted(e.path for e in es[:2])
    assert sorted(res.deleted) == sorted(e.path for e in es[:2])
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS[PER_COMMIT:])
    assert _delivered_whole(root) == set(MA_IDS[PER_COMMIT:])


def test_consumer_shards_of_interleaved_episodes_expire_whole_and_on_their_own(tmp_path):
    """The consumer's own assembly and commit (`PartitionAssembler`, `ShardCommitter`): episode A
    starts, B starts, A ends (committed: one shard per module), B ends (committed). Every shard
    holding a row of an episode covers that episode's offsets, so shards sharing an episode
    overlap (what `whole_episodes` compares); A's and B's shards overlap too, yet share none."""
    from rlrec.consumer.assembly import PartitionAssembler
    from rlrec.store.commit import ShardCommitter
    from tests.test_multi_agent_replay_rules import _apply, _batch, _start

    root = str(tmp_path / "out")
    a = PartitionAssembler("rl", 0)
    c = ShardCommitter(root, topic="rl", partition=0)
    c.claim()
    _apply(a, [_start("A"), _start("B"), _batch("A", 0, 2, last=True)])
    c.commit([r for r in a.ready(force=True) if r.multi_agent_episode_id == "A"], resume_offset=lambda eps: 0)
    _apply(a, [_batch("B", 0, 3, last=True)], first=3)
    c.commit([r for r in a.ready(force=True) if r.multi_agent_episode_id == "B"], resume_offset=lambda eps: 0)
    es = _shards(root)
    assert [(e.policy_id, e.first_offset, e.last_offset) for e in es] == [
        ("pol.m0", 0, 2),
        ("pol.m1", 0, 2),
        ("pol.m0", 1, 3),
        ("pol.m1", 1, 3),
    ]
    st = Storage.from_uri(root)

    def episodes() -> set[str]:
        eps = rlrec.open(root).multi_agent_episodes()
        got = {ep.id_ for ep in eps}
        assert eps.partial == 0
        return got

    assert episodes() == {"A", "B"}
    res = retain(st, older_than_s=1000, grace_s=0, now=_between(es[0], es[1]) + 1000)
    assert res.recorded == [] and episodes() == {"A", "B"}  # A's m0 shard waits for its m1 shard
    res = retain(st, older_than_s=1000, grace_s=0, now=_between(es[1], es[2]) + 1000)
    assert sorted(f.path for f in res.recorded) == sorted(e.path for e in es[:2])  # B's overlap keeps nothing
    assert episodes() == {"B"}
    assert rlrec.open(root).steps().num_rows == 2 * 3  # B's two agents' rows only


def test_a_removal_over_several_records_names_each_episodes_shards_in_one_record(root, monkeypatch):
    """Records hold 3 files here (1,000 in use): a cut after every commit expires 6 shards, 2 per
    commit sharing its episodes. A reader between two records, and the store after a run that
    fails before its second record, see every episode whole; a later run with a pin on one
    module's shard of commit 2 keeps commit 2's other shard with it."""
    import rlrec.store.retention as retention
    from rlrec.store.storage import StorageError

    monkeypatch.setattr(retention, "MAX_FILES_PER_RECORD", 3)
    es = _shards(root)
    st = Storage.from_uri(root)
    real, between = Storage.create_once, []

    def create_once(self, path, data, *a, **k):
        if "/_removed/" in path and read_removals(st):  # the second record: a reader looks first, then it fails
            between.append((_whole_or_gone(rlrec.open(root)), rlrec.open(root).cursor))
            raise StorageError("the store refused the second record")
        return real(self, path, data, *a, **k)

    monkeypatch.setattr(Storage, "create_once", create_once)
    now = es[-1].commit_time + 2000
    with pytest.raises(StorageError):
        retain(st, older_than_s=1000, grace_s=3600, now=now)
    monkeypatch.setattr(Storage, "create_once", real)
    assert [sorted(f.seq for f in r.files) for r in read_removals(st)] == [[es[0].seq, es[1].seq]]
    assert between[0][0] == set(MA_IDS[PER_COMMIT:])
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS[PER_COMMIT:])
    pin = {("rl", 0): [(es[3].seq, es[3].seq + 1)]}  # commit 2's scripted shard, pinned before the rerun
    res = retain(st, older_than_s=1000, grace_s=3600, now=now + 3601, pinned_entries=pin)
    assert sorted(f.seq for f in res.recorded) == [es[4].seq, es[5].seq]
    assert sorted(res.deleted) == sorted(p for e in es[:2] for p in (e.path, e.staging_path) if p in res.deleted)
    assert {e.path for e in es[:2]} <= set(res.deleted)
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS[PER_COMMIT : 2 * PER_COMMIT])
    assert _whole_or_gone(rlrec.open(root, as_of=between[0][1])) == set(MA_IDS[PER_COMMIT:])
    assert _delivered_whole(root) == set(MA_IDS[PER_COMMIT:])


def test_shards_sharing_episodes_that_one_record_cannot_hold_are_kept(root, monkeypatch, caplog):
    import rlrec.store.retention as retention

    monkeypatch.setattr(retention, "MAX_FILES_PER_RECORD", 1)
    es = _shards(root)
    with caplog.at_level("WARNING", logger="rlrec.retention"):
        res = retain(Storage.from_uri(root), older_than_s=1000, grace_s=0, now=es[-1].commit_time + 2000)
    assert res.recorded == [] and res.records == [] and res.deleted == []
    assert "3 group(s) of shards sharing multi-agent episodes (6 files" in caplog.text
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS)


def test_from_the_heads_a_live_set_saying_single_agent_cannot_expire_one_module_shard(root, monkeypatch):
    """A live set is data: one whose format_version column says 1 for the multi-agent shards
    (their entries say 2) must not let the head expire commit 1's random shard alone."""
    import pyarrow as pa

    import rlrec.store.live_set as live_set

    es = _shards(root)
    st = Storage.from_uri(root)
    real = live_set.shard_columns

    def forged(rows, newest=None):
        out = real(rows, newest)
        out["format_version"] = pa.array([1] * len(rows), out["format_version"].type)
        return out

    monkeypatch.setattr(live_set, "shard_columns", forged)
    assert write_live_set(st, "rl", 0, writer="hostile") is not None
    monkeypatch.setattr(live_set, "shard_columns", real)
    now = _between(es[0], es[1]) + 1000  # commit 1's random shard is old, its scripted shard is not
    heads, logs = heads_or_history(st, read_removals(st), older_than_s=1000, now=now)
    assert ("rl", 0) in logs and ("rl", 0) not in heads
    res = retain(st, older_than_s=1000, grace_s=0, now=now)
    assert res.recorded == [] and res.deleted == []
    for p in st.list("_manifest/rl/00000/_live"):  # readers refuse the forged live set: the history then
        st.delete(p.path)
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS)


@pytest.mark.parametrize("error", ["StorageError", "StorageAccessError"])
def test_a_storage_error_reading_a_shard_fails_the_run_in_one_line_and_records_nothing(
    root, monkeypatch, capsys, error
):
    """Only data errors make a shard's ids unknown (kept with what it overlaps); a storage error
    reading one (after the storage's retries, or a refused permission) fails `rlrec retain`."""
    from rlrec.cli import main
    from rlrec.store import storage as storage_mod

    real = Storage.read

    def read(self, path, *a, **k):
        if path.endswith(".parquet"):
            raise getattr(storage_mod, error)(f"{path}: refused by the store")
        return real(self, path, *a, **k)

    monkeypatch.setattr(Storage, "read", read)
    st = Storage.from_uri(root)
    with pytest.raises(getattr(storage_mod, error)):
        retain(st, older_than_s=1e-3, grace_s=0)
    code = main(["retain", root, "--older-than", "0.001s", "--grace", "0", "--no-lineage-pins"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"rlrec retain: error: {error}:"), err
    monkeypatch.setattr(Storage, "read", real)
    assert read_removals(st) == []
    assert _whole_or_gone(rlrec.open(root)) == set(MA_IDS)


def test_a_chain_of_shared_episodes_is_decided_reading_each_shard_once():
    """Merged shards of two modules compacted at different boundaries share episodes pairwise
    along the history; a pin on the oldest keeps them all, each shard's ids read once."""
    from rlrec.store.retention import RemovedFile
    from rlrec.store.retention_episodes import episode_groups

    def entry(seq, lo, hi):
        mod = "random" if seq % 2 else "scripted"
        return ShardEntry(
            path=f"spread.{mod}/s{seq}.parquet", staging_path=f"spread.{mod}/_staging/s{seq}.parquet", topic="rl",
            partition=0, policy_id=f"spread.{mod}", first_offset=lo, last_offset=hi, episode_ids=[f"x{seq}"],
            episodes=1, steps=1, bytes=1, sha256="", format="episodes", format_version=2, seq=seq, commit_time=0.0,
        )  # fmt: skip

    n = 60
    es = [entry(i, i, i + 1) for i in range(n)]
    reads: list[int] = []

    def ids_of(s):
        reads.append(s.seq)
        return frozenset({f"ma-{s.seq}", f"ma-{s.seq + 1}"})

    files = [RemovedFile.of(e, "expired") for e in es[1:]]
    assert episode_groups(files, {("rl", 0): es}, set(), ids_of) == []  # es[0] stays: the chain keeps all
    assert sorted(reads) == list(range(n))
    reads.clear()
    groups = episode_groups(files, {("rl", 0): es}, {("rl", 0, 0)}, ids_of)  # es[0] removed before: all go
    assert groups == [files] and sorted(reads) == list(range(1, n))
