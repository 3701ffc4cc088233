"""Multi-agent episodes through the consumer: recorder calls -> a real Tansu broker -> the real
consumer service (`RecorderConsumer`, as `rlrec consume` runs it) -> version-2 agent rows ->
`rlrec.open(out).multi_agent_episodes()`, equal field by field to RLlib's replay of the same
recordings (simple_spread, pistonball, tic-tac-toe, join/leave), alone and mixed with
single-agent traffic on one topic; poison multi-agent messages become dead letters only."""

from __future__ import annotations

import pytest

from rlrec.consumer.assembly import PartitionAssembler
from rlrec.producer import EpisodeRecorder
from rlrec.producer.events import RewardDelta
from rlrec.producer.multi_agent_events import decode_event
from rlrec.store.storage import Storage
from tests.helpers import ACT_SPACE, OBS_SPACE, record_episodes, wait_for
from tests.multi_agent_cases import CASES, assert_same
from tests.multi_agent_consume import agent_rows_committed, assert_store_equals_reference, expected_rows, send_all
from tests.test_consumer_e2e import committed_episodes, drain_dlq, read_all, run_consumer
from tests.test_recorder import read_messages

pytestmark = pytest.mark.broker


def _cases() -> list:
    pytest.importorskip("mpe2")
    pytest.importorskip("pettingzoo.butterfly")
    return [
        CASES["simple_spread"]("spread-1", seed=1, max_cycles=6),
        CASES["simple_spread"]("spread-2", seed=2, max_cycles=4),
        CASES["pistonball"]("piston-1"),
        CASES["tictactoe"]("ttt-1", seed=1),
        CASES["tictactoe"]("ttt-2", seed=5),
        CASES["join_leave"]("join-1"),
    ]


def _consume_until(cfg, storage, rows: int, single: int = 0):
    c, t = run_consumer(cfg, storage)
    try:
        wait_for(lambda: agent_rows_committed(storage) >= rows, 60, what=f"{rows} agent rows committed")
        if single:
            wait_for(lambda: committed_episodes(storage) - agent_rows_committed(storage) >= single, 30)
    finally:
        c.stop()
        t.join(30)
    assert not t.is_alive()


def test_recorded_cases_consumed_equal_rllibs_replay(broker, topic, tmp_path, recorder_config):
    recs = _cases()
    send_all(broker.bootstrap_servers, topic, recs, max_batch_steps=4)
    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    _consume_until(recorder_config(output), storage, expected_rows(recs))
    assert agent_rows_committed(storage) == expected_rows(recs)
    assert_store_equals_reference(output, recs)
    assert drain_dlq(broker.bootstrap_servers, topic) == []


def test_mixed_single_and_multi_agent_traffic_on_one_topic(broker, topic, tmp_path, recorder_config):
    recs = _cases()[:4]
    sa = EpisodeRecorder(
        broker.bootstrap_servers, topic, policy_id="single", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )
    truth = {}
    for i in range(len(recs)):
        truth.update(record_episodes(sa, 3, seed=10 + i))
        send_all(broker.bootstrap_servers, topic, recs[i : i + 1])
    assert sa.flush(10) == 0
    sa.close()
    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    _consume_until(recorder_config(output), storage, expected_rows(recs), single=len(truth))
    assert_store_equals_reference(output, recs)
    single = {eid: ep for eid, (ep, e) in read_all(storage).items() if e.format_version == 1}
    assert sorted(single) == sorted(truth)
    assert drain_dlq(broker.bootstrap_servers, topic) == []


def _events(broker, topic, recs) -> list:
    """The recordings' messages decoded, in partition order per episode key."""
    n = send_all(broker.bootstrap_servers, topic, recs, max_batch_steps=3)  # several batches an episode
    return [
        (m, decode_event(m.value(), m.headers(), key=m.key()))
        for m in read_messages(broker.bootstrap_servers, topic, n)
    ]


def test_a_replay_after_a_commit_of_some_modules_writes_only_the_rest(broker, topic):
    """A crash between two modules' shard commits: the replay re-assembles the episode and hands
    out only the agent rows not committed; events of a wholly committed episode whose start is
    not replayed are skipped."""
    recs = [CASES["tictactoe"]("ttt-r", seed=3)]  # two modules? one module per agent below
    recs[0].agent_modules = {a: f"m{i}" for i, a in enumerate(recs[0].agent_modules)}
    events = _events(broker, topic, recs)
    a = PartitionAssembler(topic, 0)
    for m, ev in events:
        assert a.apply(m.offset(), ev, now=0.0) == []
    rows = a.ready(force=True)
    assert len(rows) == 2 and {r.policy_id for r in rows} == {"pol.m0", "pol.m1"}

    class OneCommitted:  # the first module's entry landed, the second's did not
        def committed_offset(self, eid):
            return events[-1][0].offset() if eid == rows[0].episode_id else None

        def committed_length(self, eid):
            return None

    b = PartitionAssembler(topic, 0, committed=OneCommitted())
    for m, ev in events:
        assert b.apply(m.offset(), ev, now=0.0) == []
    again = b.ready(force=True)
    assert [r.episode_id for r in again] == [rows[1].episode_id]
    assert b.safe_offset() == events[0][0].offset()  # the resume point stays at the episode's start
    assert b.counters.duplicates == 1

    class AllCommitted(OneCommitted):
        def committed_offset(self, eid):
            return events[-1][0].offset()

    c = PartitionAssembler(topic, 0, committed=AllCommitted())
    for m, ev in events[1:]:  # resumed after the start: the episode is committed whole
        assert c.apply(m.offset(), ev, now=0.0) == []
    assert c.ready(force=True) == [] and c.counters.replay_skipped == len(events) - 1


def test_poison_multi_agent_messages_are_dead_letters_only(broker, topic, tmp_path, recorder_config):
    """An undecodable multi-agent message, a step batch of an episode never started, a delayed
    reward after its episode ended: one dead letter each with its reason; the good episodes are
    stored whole and the consumer keeps going."""
    from confluent_kafka import Producer

    from rlrec.producer.multi_agent_events import encode_event

    recs = _cases()[:2]
    good = _events(broker, topic, recs)
    batch = next(ev for _, ev in good if type(ev).__name__ == "MultiAgentStepBatch")
    p = Producer({"bootstrap.servers": broker.bootstrap_servers})
    bad_batch = batch.__class__(**{**batch.__dict__, "episode_id": "ghost"})
    value, headers = encode_event(bad_batch)
    p.produce(topic, value, key=b"ghost", headers=headers)
    p.produce(topic, b"\x00garbage", key=b"x", headers=[("rlrec-schema", b"MultiAgentStepBatch/1")])
    value, headers = encode_event(RewardDelta(recs[0].episode_id, 999, 1.0, 0, agent_id="agent_0"))
    p.produce(topic, value, key=recs[0].episode_id.encode(), headers=headers)
    p.flush(10)
    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    _consume_until(recorder_config(output), storage, expected_rows(recs))
    assert_store_equals_reference(output, recs)
    reasons = sorted(dict(m.headers())["rlrec-dlq-reason"].decode() for m in drain_dlq(broker.bootstrap_servers, topic))
    assert len(reasons) == 3, reasons
    assert reasons == ["late-reward", "malformed", "unknown-episode"], reasons


def _agent_states(episodes: dict) -> dict:
    out = {}
    for a, sa in episodes.items():
        state = dict(sa.get_state())
        state.pop("_start_time")
        state.pop("_last_step_time")
        out[a] = state
    return out


def test_an_idle_multi_agent_episode_times_out_as_an_abort(broker, topic):
    """episode_timeout_s: the consumer's decision (an EpisodeAbort read back) ends an open
    multi-agent episode truncated where it stands; its rows equal RLlib's replay of the steps
    so far ended by an abort; the episode's start holds the safe offset until then."""
    import dataclasses

    from rlrec.consumer.assembly import AssemblyConfig
    from rlrec.consumer.multi_agent_reference import reference_episode

    rec = CASES["simple_spread"]("spread-t", seed=4, max_cycles=8)
    events = _events(broker, topic, [rec])
    a = PartitionAssembler(topic, 0, config=AssemblyConfig(episode_timeout_s=5.0))
    cut = [(m, ev) for m, ev in events if not getattr(ev, "ended", False)]  # the last batch never came
    assert len(cut) < len(events)
    for m, ev in cut:
        assert a.apply(m.offset(), ev, now=0.0) == []
    steps = a.open[rec.episode_id].t
    assert 0 < steps < len(rec.steps) and a.safe_offset() == events[0][0].offset()
    a.live_since = 0.0
    (decision,) = a.decide_timeouts(now=10.0)
    assert a.apply(cut[-1][0].offset() + 1, decision.abort(), now=10.0) == []
    rows = {r.agent_id: r.agent_episode for r in a.ready(force=True)}
    want = reference_episode(dataclasses.replace(rec, steps=rec.steps[:steps], aborted=True))
    assert_same(_agent_states(rows), _agent_states(dict(want.agent_episodes)))


def test_multi_agent_episode_over_max_episode_bytes_is_dead_lettered_whole(broker, topic):
    from rlrec.consumer.assembly import AssemblyConfig

    rec = CASES["pistonball"]("piston-big")
    events = _events(broker, topic, [rec])
    a = PartitionAssembler(topic, 0, config=AssemblyConfig(max_episode_bytes=300_000))
    letters = []
    for m, ev in events:
        letters += a.apply(m.offset(), ev, now=0.0)
    assert a.open == {} and a.ready(force=True) == []
    assert {dl.reason for dl in letters} == {"episode-too-large"}
    # every event received is in the DLQ once (the episode's so far re-encoded, then the rest)
    assert sorted(dl.offset for dl in letters) == [m.offset() for m, _ in events]
    assert all(decode_event(dl.value, dl.headers) is not None for dl in letters if dl.value is not None)


def test_a_refused_multi_agent_episode_is_dead_lettered_with_the_folds_reason(broker, topic):
    """A data error found when the episode ends (here the fold's: a delayed reward for an agent
    that got no reward at that env step) dead-letters each of the episode's events with the
    reason code; a delayed reward for an agent that is not possible is one dead letter alone;
    the partition goes on (its safe offset passes the episode)."""
    rec = CASES["tictactoe"]("ttt-bad", seed=1)
    events = _events(broker, topic, [rec])
    a = PartitionAssembler(topic, 0)
    end = events[-1][0].offset()
    letters = []
    for m, ev in events[:-1]:
        letters += a.apply(m.offset(), ev, now=0.0)
    assert letters == []
    stray = a.apply(end, RewardDelta(rec.episode_id, 0, 1.0, 0, agent_id="nobody"), now=0.0)
    assert [dl.reason for dl in stray] == ["unknown-agent"]
    assert "player_1" not in rec.steps[0].rewards
    assert a.apply(end + 1, RewardDelta(rec.episode_id, 0, 1.0, 0, agent_id="player_1"), now=0.0) == []
    letters = a.apply(end + 2, events[-1][1], now=0.0)  # the last batch, after the two rewards
    assert {dl.reason for dl in letters} == {"bad-value"}
    assert sorted(dl.offset for dl in letters) == [*(m.offset() for m, _ in events[:-1]), end + 1, end + 2]
    assert a.ready(force=True) == [] and a.safe_offset() == end + 3


_RECORD_DIGEST = """
import dataclasses, hashlib
from rlrec.consumer.multi_agent_assembly import canonical_record
from rlrec.consumer.multi_agent_split import pack_split, split_recording

from tests.multi_agent_cases import CASES
from tests.multi_agent_consume import recordable
for name in ("join_leave", "tictactoe", "simple_spread"):
    rec = recordable(CASES[name](name, seed=6))
    s = split_recording(rec)
    data = pack_split(dataclasses.replace(s, record=canonical_record(s.record)))
    print(name, hashlib.sha256(data).hexdigest())
"""


def test_the_record_bytes_are_the_same_in_every_process():
    """Every assembly of an episode writes the same record into its rows, whatever the process's
    string hashing (RLlib fills its module map in hash order): a replay after a crash between two
    modules' commits must agree with the rows committed before it."""
    import os
    import subprocess
    import sys

    pytest.importorskip("mpe2")
    outs = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(
            subprocess.run(
                [sys.executable, "-c", _RECORD_DIGEST],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                cwd=os.path.dirname(os.path.dirname(__file__)),
            ).stdout
        )
    assert len(outs) == 1 and outs.pop().count("\n") == 3


def test_multi_agent_recording_wrapper_through_the_consumer(broker, topic, tmp_path, recorder_config):
    """PettingZoo simple_spread wrapped by `MultiAgentRecordingWrapper` -> broker -> consumer ->
    `multi_agent_episodes()`: equal to RLlib's replay of the dicts the env itself returned."""
    pytest.importorskip("mpe2")
    from mpe2 import simple_spread_v3

    from rlrec.producer import MultiAgentRecordingWrapper
    from rlrec.producer.multi_agent_recording import MultiAgentEnvStep, MultiAgentRecording, MultiAgentReset
    from tests.test_multi_agent_recording import run_parallel

    recorder = EpisodeRecorder(broker.bootstrap_servers, topic, policy_id="pol", max_batch_steps=3)
    raw = simple_spread_v3.parallel_env(N=3, max_cycles=5)
    env = MultiAgentRecordingWrapper(raw, recorder)
    recs = []
    for seed in range(3):
        eid, (obs, infos), steps = run_parallel(env, seed)
        rec = MultiAgentRecording(
            eid,
            "pol",
            recorder.policy_version,
            dict.fromkeys(raw.possible_agents, "default_policy"),
            MultiAgentReset(obs, {a: i for a, i in infos.items() if a in obs}),
            observation_spaces={a: raw.observation_space(a) for a in raw.possible_agents},
            action_spaces={a: raw.action_space(a) for a in raw.possible_agents},
        )
        for actions, o, r, te, tr, i in steps:
            rec.steps.append(
                MultiAgentEnvStep(
                    actions,
                    {a: float(x) for a, x in r.items()},
                    o,
                    te,
                    tr,
                    {a: x for a, x in i.items() if a in o},
                    {a: {"action_logp": -1.5} for a in actions},
                )
            )
        recs.append(rec)
    env.close()
    recorder.close()
    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    _consume_until(recorder_config(output), storage, expected_rows(recs))
    assert_store_equals_reference(output, recs)
