"""Multi-agent rows: one row per agent episode in `episodes` shards of format version 2, one
shard per module under ``{policy_id}.{module_id}``, read back safely, and
`Snapshot.multi_agent_episodes` returning only episodes whose agent rows are all committed."""

from __future__ import annotations

import hashlib

import msgpack
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("pettingzoo")
pytest.importorskip("mpe2")

from rlrec.consumer.multi_agent_reference import reference_episode
from rlrec.consumer.multi_agent_split import split_recording
from rlrec.store import schema_gate
from rlrec.store.episodes import EpisodeDecodeError, UnsafeEpisodeError, pack_episode
from rlrec.store.manifest import PartitionLog, ShardEntry
from rlrec.store.multi_agent_episode import MultiAgentRecordError, assemble_episode, pack_record, unpack_record
from rlrec.store.multi_agent_shards import (
    MultiAgentShardEpisode,
    encode_multi_agent_shards,
    read_agent_rows,
)
from rlrec.store.schema_gate import ShardSchemaError, open_shard
from rlrec.store.snapshot import open_snapshot
from rlrec.store.storage import Storage
from tests import multi_agent_cases as cases


def shard_episode(rec, first_offset=0):
    split = split_recording(rec)
    return MultiAgentShardEpisode(
        episode_id=rec.episode_id,
        policy_id=rec.policy_id,
        policy_version=rec.policy_version,
        env_id=rec.env_id,
        rows=split.rows,
        record=pack_record(split.record, {a: pack_episode(e) for a, e in split.carried.items()}),
        env_flags=split.env_flags,
        first_offset=first_offset,
        last_offset=first_offset + len(rec.steps),
    )


@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_each_module_gets_a_shard_of_its_agent_rows(case):
    rec = cases.CASES[case]()
    shards = encode_multi_agent_shards([shard_episode(rec)])
    modules = {m for a, m in rec.agent_modules.items() if a in split_recording(rec).rows}
    assert sorted(shards) == sorted(f"pol.{m}" for m in modules)
    rows = {}
    for policy, enc in shards.items():
        shard = open_shard(enc.data, fmt="episodes")
        assert (shard.fmt, shard.version) == ("episodes", 2) and enc.schema_version == 2
        table = shard.read(["policy_id", "module_id", "episode_id", "length"])
        assert set(table.column("policy_id").to_pylist()) == {policy}
        assert table.column("episode_id").to_pylist() == enc.episode_ids
        for r in read_agent_rows(shard):
            assert f"pol.{r.module_id}" == policy and r.multi_agent_episode_id == rec.episode_id
            rows[r.agent_id] = r
    reference = reference_episode(rec)
    assert sorted(rows) == sorted(a for a, e in reference.agent_episodes.items() if e.is_done and len(e))
    for a, r in rows.items():
        ref = reference.agent_episodes[a]
        cases.assert_same(_without_timers(ref.get_state()), _without_timers(r.episode.get_state()))


def _without_timers(state):
    return {k: v for k, v in state.items() if k not in ("_start_time", "_last_step_time")}


def test_env_flags_are_the_envs_own():
    rec = cases.simple_spread()  # the env truncates every agent; RLlib marks them terminated too
    (enc,) = encode_multi_agent_shards([shard_episode(rec)]).values()
    t = pq.read_table(pa.BufferReader(enc.data), columns=["terminated", "truncated", "env_terminated", "env_truncated"])
    assert t.to_pydict() == {
        "terminated": [True] * 3,
        "truncated": [True] * 3,
        "env_terminated": [False] * 3,
        "env_truncated": [True] * 3,
    }


def test_readers_that_do_not_know_the_version_say_upgrade_rlrec(monkeypatch):
    (enc,) = encode_multi_agent_shards([shard_episode(cases.simple_spread())]).values()
    older = {k: v for k, v in schema_gate.SHARD_SCHEMAS.items() if k != ("episodes", 2)}
    monkeypatch.setattr(schema_gate, "SHARD_SCHEMAS", older)
    with pytest.raises(ShardSchemaError, match=r"version '2'.*upgrade rlrec"):
        open_shard(enc.data, fmt="episodes")


def _rewrite(data: bytes, **columns) -> bytes:
    t = pq.read_table(pa.BufferReader(data))
    for name, value in columns.items():
        i = t.schema.get_field_index(name)
        t = t.set_column(i, name, pa.array([value] * t.num_rows, type=t.schema.field(name).type))
    buf = pa.BufferOutputStream()
    pq.write_table(t, buf)
    return buf.getvalue().to_pybytes()


def test_hostile_rows_are_refused():
    (enc,) = encode_multi_agent_shards([shard_episode(cases.simple_spread())]).values()
    record = pq.read_table(pa.BufferReader(enc.data), columns=["multi_agent_record"]).column(0)[0].as_py()
    outer = msgpack.unpackb(record)
    # a pickled (object-dtype) array in a hanging action: refused, never unpickled
    outer["record"]["hanging_actions_end"] = {
        "agent_0": {b"nd": True, b"type": b"|O", b"kind": b"O", b"shape": [1], b"data": b"x"}
    }
    with pytest.raises(UnsafeEpisodeError):
        unpack_record(msgpack.packb(outer))
    for bad, why in [
        ({"env_t": -1}, "env_t"),
        ({"agents": ["a", "a"]}, "distinct"),
        ({"env_t_to_agent_t": {"agent_0": {"data": list(range(10_000)), "lookback": 0}}}, "one entry per env step"),
        ({"hanging_rewards_begin": {"a": "1"}}, "floats"),
        ({"v": 2}, "upgrade rlrec"),
    ]:
        o = msgpack.unpackb(record)
        o["record"].update(bad)
        with pytest.raises(MultiAgentRecordError, match=why):
            unpack_record(msgpack.packb(o))
    o = msgpack.unpackb(record)
    o["record"]["env_t_to_agent_t"]["agent_0"]["data"][-1] = 99  # past the agent's 25 steps
    rows = {r.agent_id: r.episode for r in read_agent_rows(open_shard(enc.data, fmt="episodes"))}
    bad_record, _ = unpack_record(msgpack.packb(o))
    with pytest.raises(MultiAgentRecordError, match="points past its 25 steps"):
        assemble_episode(rows, bad_record, "spread-0")
    with pytest.raises(MultiAgentRecordError, match="not msgpack"):
        unpack_record(record[:-3])
    # a row whose ids disagree with its packed episode
    shard = open_shard(_rewrite(enc.data, agent_id="agent_9"), fmt="episodes")
    with pytest.raises(EpisodeDecodeError, match="differs from its row"):
        read_agent_rows(shard)
    # an extra column is refused by the gate before anything is read
    t = pq.read_table(pa.BufferReader(enc.data))
    t = t.append_column("extra", pa.array([1] * t.num_rows))
    buf = pa.BufferOutputStream()
    pq.write_table(t, buf)
    with pytest.raises(ShardSchemaError, match="'extra' is not allowed"):
        open_shard(buf.getvalue().to_pybytes(), fmt="episodes")


def test_forged_records_whose_maps_disagree_with_the_rows_are_refused():
    rec = cases.simple_spread()
    (enc,) = encode_multi_agent_shards([shard_episode(rec)]).values()
    rows = {r.agent_id: r.episode for r in read_agent_rows(open_shard(enc.data, fmt="episodes"))}
    raw = next(iter(read_agent_rows(open_shard(enc.data, fmt="episodes")))).record
    assert assemble_episode(rows, unpack_record(raw)[0], "spread-0").get_actions(5, env_steps=True) == (
        reference_episode(rec).get_actions(5, env_steps=True)
    )

    def forged(change):
        o = msgpack.unpackb(raw)
        change(o["record"])
        return msgpack.packb(o)

    for change, why in [
        (lambda r: r["env_t_to_agent_t"]["agent_0"]["data"].reverse(), "agent steps must increase"),
        (lambda r: r["env_t_to_agent_t"]["agent_0"].update(lookback=10**15), "lookback must be 0"),
        (lambda r: r.update(env_t=10**12), "one entry per env step"),
        (lambda r: r.update(env_t=23), "one entry per env step"),
        (lambda r: r["env_t_to_agent_t"].update(ghost={"data": [0] * 26, "lookback": 0}), "not one of its agents"),
        (lambda r: r["modules"].pop("agent_1"), "has no module"),
        (lambda r: r.update(env_t_started=30), "before env_t_started"),
    ]:
        with pytest.raises(MultiAgentRecordError, match=why):
            unpack_record(forged(change))
    # a map that passes alone but skips one of the agent's steps: refused against its row
    shifted = unpack_record(forged(lambda r: r["env_t_to_agent_t"]["agent_0"]["data"].__setitem__(3, "S")))[0]
    with pytest.raises(MultiAgentRecordError, match=r"does not cover its steps 0\.\.25 once each"):
        assemble_episode(rows, shifted, "spread-0")


def carried_recording(episode_id: str = "big-1", steps: int = 70, obs_bytes: int = 1024):
    """Agent b acts `steps` times and is absent from the last (``__all__``) step: RLlib leaves it
    not done, so its whole episode is carried in the record (FORMAT.md, "Multi-agent rows")."""
    import numpy as np

    from rlrec.producer.multi_agent_recording import MultiAgentEnvStep, MultiAgentRecording, MultiAgentReset

    big = np.arange(obs_bytes, dtype=np.uint8)
    small = np.zeros(2, np.float32)
    body = [MultiAgentEnvStep({"a": 0, "b": 0}, {"a": 1.0, "b": 1.0}, {"a": small, "b": big}, {})] * steps
    last = MultiAgentEnvStep({"a": 0}, {"a": 1.0}, {"a": small}, {"__all__": True})
    modules = {"a": "m_a", "b": "m_b"}
    return MultiAgentRecording(episode_id, "pol", 0, modules, MultiAgentReset({"a": small, "b": big}), [*body, last])


def test_the_writer_refuses_a_record_over_max_record_bytes_as_a_data_error(monkeypatch):
    from rlrec.consumer.multi_agent_reference import MultiAgentDataError
    from rlrec.consumer.multi_agent_split import pack_split
    from rlrec.store import multi_agent_episode, multi_agent_shards
    from rlrec.store.multi_agent_episode import RecordTooLargeError

    rec = carried_recording()
    split = split_recording(rec)
    assert (sorted(split.rows), {a: len(e) for a, e in split.carried.items()}) == (["a"], {"b": 70})
    size = len(pack_split(split))
    assert size > 70 * 1024  # the carried agent's observations are in the record
    monkeypatch.setattr(multi_agent_episode, "MAX_RECORD_BYTES", size - 1)
    with pytest.raises(MultiAgentDataError) as e:
        pack_split(split)
    assert e.value.reason == "record_too_large"
    ma = shard_episode(carried_recording("small-1", steps=1, obs_bytes=4))
    big = MultiAgentShardEpisode(**{**ma.__dict__, "episode_id": "big-1", "record": b"x" * size})
    monkeypatch.setattr(multi_agent_shards, "MAX_RECORD_BYTES", size - 1)
    with pytest.raises(RecordTooLargeError, match="over MAX_RECORD_BYTES") as e2:
        encode_multi_agent_shards([ma, big])
    assert e2.value.reason == "record_too_large"
    assert encode_multi_agent_shards([ma])["pol.m_a"].episodes == 1


def _commit(log: PartitionLog, policy: str, enc, first: int, *, format_version: int | None = None) -> None:
    name = f"{log.topic}+{log.partition:05d}+{first:020d}+{first:020d}+e1.{first}.parquet"
    entry = ShardEntry(
        path=f"{policy}/{name}",
        staging_path=f"{policy}/_staging/{name}",
        topic=log.topic,
        partition=log.partition,
        policy_id=policy,
        first_offset=first,
        last_offset=first,
        episode_ids=list(enc.episode_ids),
        episodes=enc.episodes,
        steps=enc.steps,
        bytes=len(enc.data),
        sha256=hashlib.sha256(enc.data).hexdigest(),
        format="episodes",
        format_version=enc.schema_version if format_version is None else format_version,
    )
    log.storage.write(entry.staging_path, enc.data)
    log.publish(log.append_shard(entry), enc.data)


def _log(st: Storage, topic: str = "rl", partition: int = 0) -> PartitionLog:
    log = PartitionLog(st, topic, partition)
    log.claim("w")
    log.recover()
    return log


def test_an_entry_whose_version_is_not_its_files_is_refused(tmp_path):
    shards = encode_multi_agent_shards([shard_episode(cases.join_leave())])
    st = Storage.from_uri(str(tmp_path / "out"), fsync=False)
    log = _log(st)
    for i, (policy, enc) in enumerate(sorted(shards.items())):
        _commit(log, policy, enc, i, format_version=1)
    snap = open_snapshot(st)
    assert [e.format_version for e in snap.entries] == [1, 1, 1]
    for read in (lambda: list(snap.episodes()), lambda: list(snap.multi_agent_episodes())):
        with pytest.raises(ShardSchemaError, match="the file is episodes version 2, its manifest entry says version 1"):
            read()


def test_a_reader_between_two_modules_commits_sees_no_partial_episode(tmp_path):
    recs = [cases.pistonball(), cases.tictactoe(), cases.join_leave()]
    shards = encode_multi_agent_shards([shard_episode(r, i) for i, r in enumerate(recs)])
    st = Storage.from_uri(str(tmp_path / "out"), fsync=False)
    log = PartitionLog(st, "rl", 0)
    log.claim("w")
    log.recover()
    seen_complete = []
    for i, (policy, enc) in enumerate(sorted(shards.items())):
        _commit(log, policy, enc, i)
        snap = open_snapshot(st)
        seen_complete.append(sorted(ep.id_ for ep in snap.multi_agent_episodes()))
        # every module's folder written so far is readable as plain single-agent episodes
        assert len(list(snap.episodes())) == sum(e.episodes for _, e in sorted(shards.items())[: i + 1])
    # pistonball: left + pistons; tic-tac-toe: first + second; join_leave: m_a, m_b, m_c
    order = [p for p, _ in sorted(shards.items())]
    assert order == ["pol.first", "pol.left", "pol.m_a", "pol.m_b", "pol.m_c", "pol.pistons", "pol.second"]
    assert seen_complete == [[], [], [], [], ["join-0"], ["join-0", "piston-0"], ["join-0", "piston-0", "ttt-0"]]
    by_id = {ep.id_: ep for ep in open_snapshot(st).multi_agent_episodes(mapping_fn=lambda aid, ep: "x")}
    for rec in recs:
        got = by_id[rec.episode_id]
        assert got.agent_to_module_mapping_fn("a", got) == "x"
        cases.assert_same(cases.comparable_state(reference_episode(rec)), cases.comparable_state(got))


def test_rows_whose_records_differ_are_refused(tmp_path):
    rec = cases.join_leave()
    shards = encode_multi_agent_shards([shard_episode(rec)])
    other = shard_episode(rec)
    record, carried = unpack_record(other.record)
    record["env_t"] += 1
    other.record = pack_record(record, carried)
    forged = encode_multi_agent_shards([other])["pol.m_c"]
    st = Storage.from_uri(str(tmp_path / "out"), fsync=False)
    log = PartitionLog(st, "rl", 0)
    log.claim("w")
    log.recover()
    _commit(log, "pol.m_a", shards["pol.m_a"], 0)
    _commit(log, "pol.m_b", shards["pol.m_b"], 1)
    _commit(log, "pol.m_c", forged, 2)
    got = open_snapshot(st).multi_agent_episodes()
    assert list(got) == [] and got.refused == 1 and "different record" in got.refusals[0][1]
    # the store itself stays readable as single-agent rows
    assert len(list(open_snapshot(st).episodes())) == 3


def test_compaction_merges_a_modules_shards_and_episodes_still_rebuild(tmp_path):
    from rlrec.store.compaction import compact_partition

    recs = [cases.simple_spread(f"s{i}", seed=i) for i in range(3)]
    st = Storage.from_uri(str(tmp_path / "out"), fsync=False)
    log = PartitionLog(st, "rl", 0)
    log.claim("w")
    log.recover()
    for i, r in enumerate(recs):
        (enc,) = encode_multi_agent_shards([shard_episode(r, i)]).values()
        _commit(log, "pol.spread", enc, i)
    result = compact_partition(log, min_age_s=0)
    assert (result.replaced, result.written) == (3, 1)
    snap = open_snapshot(st)
    assert [(e.format, e.format_version, e.episodes) for e in snap.entries] == [("episodes", 2, 9)]
    got = {e.id_: e for e in snap.multi_agent_episodes()}
    assert sorted(got) == ["s0", "s1", "s2"]
    for r in recs:
        cases.assert_same(cases.comparable_state(reference_episode(r)), cases.comparable_state(got[r.episode_id]))
