"""`Snapshot.multi_agent_episodes` against incremental reads, shared episode ids, hostile and
oversized rows, and its memory bound (docs/GUARANTEES.md, "Multi-agent episodes are whole")."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("pettingzoo")
pytest.importorskip("mpe2")

from rlrec.consumer.multi_agent_reference import reference_episode
from rlrec.producer.multi_agent_recording import MultiAgentEnvStep, MultiAgentRecording, MultiAgentReset
from rlrec.store import multi_agent_read
from rlrec.store.multi_agent_episode import pack_record, unpack_record
from rlrec.store.multi_agent_shards import encode_multi_agent_shards, read_agent_rows
from rlrec.store.schema_gate import ShardSchemaError
from rlrec.store.shards import EncodedShard, encode_shard
from rlrec.store.snapshot import open_entries, open_snapshot
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes
from tests import multi_agent_cases as cases
from tests.test_multi_agent_shards import _commit, _log, carried_recording, shard_episode


def two_modules(episode_id: str, reward: float = 1.0, steps: int = 1) -> MultiAgentRecording:
    o = np.full(2, reward, np.float32)
    body = [MultiAgentEnvStep({"a": 0, "b": 0}, {"a": reward, "b": reward}, {"a": o, "b": o}, {})] * (steps - 1)
    last = MultiAgentEnvStep({"a": 0, "b": 0}, {"a": reward, "b": reward}, {"a": o, "b": o}, {"__all__": True})
    return MultiAgentRecording(
        episode_id, "pol", 0, {"a": "m1", "b": "m2"}, MultiAgentReset({"a": o, "b": o}), [*body, last]
    )


def _store(tmp_path):
    return Storage.from_uri(str(tmp_path / "out"), fsync=False)


def test_an_incremental_reader_gets_an_episode_whose_commits_straddle_its_cursor_once(tmp_path):
    rec = cases.join_leave()
    shards = encode_multi_agent_shards([shard_episode(rec)])
    st = _store(tmp_path)
    log = _log(st)
    _commit(log, "pol.m_a", shards["pol.m_a"], 0)
    _commit(log, "pol.m_b", shards["pol.m_b"], 1)
    snap1 = open_snapshot(st)
    first = snap1.multi_agent_episodes()
    assert (list(first), first.partial) == ([], 1)  # m_c is not committed at this point
    _commit(log, "pol.m_c", shards["pol.m_c"], 2)
    snap2 = open_snapshot(st)
    window = snap2.changes(since=snap1.cursor)
    assert [e.policy_id for e in window.entries] == ["pol.m_c"]
    got = window.multi_agent_episodes()
    (ep,) = list(got)
    assert (ep.id_, got.partial, got.refused) == ("join-0", 0, 0)
    cases.assert_same(cases.comparable_state(reference_episode(rec)), cases.comparable_state(ep))
    # consecutive windows return it once: not again from a window after it
    _commit(log, "pol.m_a", encode_multi_agent_shards([shard_episode(cases.join_leave("join-1"), 3)])["pol.m_a"], 3)
    later = open_snapshot(st).changes(since=snap2.cursor)
    assert [e.id_ for e in later.multi_agent_episodes()] == []
    # a range of entries (a version's lineage) holding only the last module's rows returns it too
    (ranged,) = list(open_entries(st, {("rl", 0): [(3, 4)]}).multi_agent_episodes())
    assert ranged.id_ == "join-0"
    assert [e.id_ for e in open_entries(st, {("rl", 0): [(1, 3)]}).multi_agent_episodes()] == []


def test_episodes_of_two_topics_sharing_an_id_are_never_spliced(tmp_path):
    a, b = (
        encode_multi_agent_shards([shard_episode(two_modules("ep-1", 1.0))]),
        encode_multi_agent_shards([shard_episode(two_modules("ep-1", -5.0))]),
    )
    assert a["pol.m1"].data != b["pol.m1"].data
    st = _store(tmp_path)
    rl, rl2 = _log(st, "rl"), _log(st, "rl2")
    _commit(rl, "pol.m1", a["pol.m1"], 0)  # topic rl: its first module only
    _commit(rl2, "pol.m1", b["pol.m1"], 0)
    _commit(rl2, "pol.m2", b["pol.m2"], 1)
    got = open_snapshot(st).multi_agent_episodes()
    (ep,) = list(got)
    assert {x: list(sa.rewards.data) for x, sa in ep.agent_episodes.items()} == {"a": [-5.0], "b": [-5.0]}
    assert (got.partial, got.refused) == (1, 0)
    _commit(rl, "pol.m2", a["pol.m2"], 1)
    rewards = sorted(ep.agent_episodes["a"].rewards.data[0] for ep in open_snapshot(st).multi_agent_episodes())
    assert rewards == [-5.0, 1.0]


def test_an_oversized_or_inconsistent_episode_is_refused_alone_and_counted(tmp_path, monkeypatch, caplog):
    from rlrec.store import multi_agent_episode

    big = shard_episode(carried_recording("big-1", steps=70, obs_bytes=1024))
    ok = shard_episode(two_modules("ok-1"))
    twin = shard_episode(two_modules("twin-1"))
    record, carried = unpack_record(twin.record)
    record["env_t"] += 1
    forged = encode_multi_agent_shards([type(twin)(**{**twin.__dict__, "record": pack_record(record, carried)})])
    st = _store(tmp_path)
    log = _log(st)
    shards = encode_multi_agent_shards([big, ok, shard_episode(two_modules("twin-1"))])
    _commit(log, "pol.m_a", shards["pol.m_a"], 0)  # big-1's only row (its b is carried)
    _commit(log, "pol.m1", shards["pol.m1"], 1)  # a of ok-1 and twin-1
    _commit(log, "pol.m2", forged["pol.m2"], 2)  # twin-1's b with another record
    _commit(log, "pol.m2", encode_multi_agent_shards([ok])["pol.m2"], 3)  # ok-1's b
    monkeypatch.setattr(multi_agent_episode, "MAX_RECORD_BYTES", len(big.record) - 1)  # a reader's limit
    got = open_snapshot(st).multi_agent_episodes()
    with caplog.at_level("WARNING", logger="rlrec.store"):
        assert [e.id_ for e in got] == ["ok-1"]
    assert got.refused == 2
    reasons = dict(got.refusals)
    assert "over MAX_RECORD_BYTES" in reasons["big-1"] and "different record" in reasons["twin-1"]
    assert sum("refused" in r.message for r in caplog.records) == 2


def test_an_agents_row_twice_refuses_its_episode(tmp_path):
    (enc,) = encode_multi_agent_shards([shard_episode(cases.simple_spread())]).values()
    t = pq.read_table(pa.BufferReader(enc.data))
    twice = pa.concat_tables([t, t.slice(0, 1)]).replace_schema_metadata(t.schema.metadata)
    buf = pa.BufferOutputStream()
    pq.write_table(twice, buf)
    data = buf.getvalue().to_pybytes()
    fake = EncodedShard(  # the manifest refuses an id twice: the entry lists it once
        data=data,
        episodes=3,
        steps=75,
        sha256=hashlib.sha256(data).hexdigest(),
        episode_ids=t.column("episode_id").to_pylist(),
        fmt="episodes",
        schema_version=2,
    )
    st = _store(tmp_path)
    _commit(_log(st), "pol.spread", fake, 0)
    got = open_snapshot(st).multi_agent_episodes()
    assert list(got) == [] and got.refused == 1
    assert "appears twice" in got.refusals[0][1]


def test_pending_rows_past_the_budget_are_read_again_not_held(tmp_path, monkeypatch):
    from rlrec.store.compaction import compact_partition

    st = _store(tmp_path)
    log = _log(st)
    recs = [two_modules(f"ep{i}", float(i), steps=10) for i in range(8)]
    seq = 0
    for r in recs:
        shards = encode_multi_agent_shards([shard_episode(r, seq)])
        for policy in ("pol.m1", "pol.m2"):
            _commit(log, policy, shards[policy], seq)
            seq += 1
    assert compact_partition(log, min_age_s=0, policy_id="pol.m1").written == 1  # m1 merged: read last
    snap = open_snapshot(st)
    assert [e.policy_id for e in snap.entries][-1] == "pol.m1"
    row = max(read_agent_rows(snap._gated(e))[0].item_bytes for e in snap.entries[:-1])
    budget = 2 * (row + 1024)
    monkeypatch.setattr(multi_agent_read, "MAX_PENDING_DECODED_BYTES", budget)
    reread = []
    original = multi_agent_read.MultiAgentEpisodes._reread
    monkeypatch.setattr(
        multi_agent_read.MultiAgentEpisodes,
        "_reread",
        lambda self, entry, idx: reread.append(len(idx)) or original(self, entry, idx),
    )
    got = snap.multi_agent_episodes()
    peak = 0
    episodes = []
    for ep in got:
        peak = max(peak, got._held)
        episodes.append(ep)
    assert sorted(e.id_ for e in episodes) == [f"ep{i}" for i in range(8)] and got.partial == 0
    assert peak <= budget and got._held == 0
    assert sum(reread) == 6  # 8 pending rows of m2, 2 held within the budget
    for ep in episodes:
        cases.assert_same(cases.comparable_state(reference_episode(recs[int(ep.id_[2:])])), cases.comparable_state(ep))


def test_a_folder_mixing_single_and_multi_agent_shards_is_refused(tmp_path):
    st = _store(tmp_path)
    log = _log(st)
    shards = encode_multi_agent_shards([shard_episode(two_modules("ep-1"))])
    _commit(log, "pol.m1", shards["pol.m1"], 0)
    _commit(log, "pol.m2", shards["pol.m2"], 1)
    assert [e.id_ for e in open_snapshot(st).multi_agent_episodes()] == ["ep-1"]
    single = encode_shard(expert_cartpole_episodes(1))
    _commit(log, "pol.m1", single, 2)  # a single-agent policy named like the module's folder
    with pytest.raises(ShardSchemaError, match=r"pol\.m1/ holds shards of format versions \[1, 2\]"):
        list(open_snapshot(st).multi_agent_episodes())


def test_module_ids_with_a_dot_are_refused_and_rows_must_be_in_their_folder(tmp_path):
    from rlrec.consumer.multi_agent_reference import MultiAgentDataError
    from rlrec.consumer.multi_agent_split import split_recording
    from rlrec.store.episodes import EpisodeDecodeError
    from rlrec.store.multi_agent_shards import module_policy_id

    o = np.zeros(2, np.float32)
    step = MultiAgentEnvStep({"a": 0}, {"a": 1.0}, {"a": o}, {"__all__": True})
    with pytest.raises(MultiAgentDataError) as e:  # policy "fleet" module "cars.v1" vs policy "fleet.cars" module "v1"
        split_recording(MultiAgentRecording("e", "fleet", 0, {"a": "cars.v1"}, MultiAgentReset({"a": o}), [step]))
    assert e.value.reason == "bad_module_id"
    with pytest.raises(ValueError, match=r"holds a '\.'"):
        module_policy_id("fleet", "cars.v1")
    assert module_policy_id("fleet.cars", "v1") == "fleet.cars.v1"
    shards = encode_multi_agent_shards([shard_episode(two_modules("ep-1"))])
    st = _store(tmp_path)
    log = _log(st)
    _commit(log, "pol.m2", shards["pol.m1"], 0)  # module m1's rows in m2's folder
    with pytest.raises(EpisodeDecodeError, match=r"policy id 'pol\.m1' is not its folder's"):
        list(open_snapshot(st).multi_agent_episodes())
