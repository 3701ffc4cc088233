"""`EpisodeRecorder`'s multi-agent calls through a real Tansu broker: delayed rewards (folded into
a buffered env step or sent as `RewardDelta/2`), batching by size and by age, `close()` and
`on_overflow` with multi-agent episodes, Confluent framing."""

from __future__ import annotations

import json
import time
from collections import defaultdict

import numpy as np
import pytest
from gymnasium import spaces as gs

from rlrec.consumer.multi_agent_fold import fold_multi_agent
from rlrec.producer import EpisodeRecorder, RecorderFullError
from rlrec.producer.multi_agent_events import decode_event
from rlrec.producer.registry import SchemaRegistry
from tests.helpers import frozen_recorder_clock
from tests.test_recorder import NOWHERE, QUIET, read_messages
from tests.test_registry import registry  # noqa: F401 (the fixture)

BOX = gs.Box(-1.0, 1.0, (2,), np.float32)
SPACES = {"observation_spaces": {"a": BOX, "b": BOX}, "action_spaces": {"a": gs.Discrete(3), "b": gs.Discrete(3)}}
Z = np.zeros(2, np.float32)


def _both(t: int, done: bool = False) -> tuple:
    obs = {"a": np.full(2, t / 100, np.float32), "b": Z}
    return obs, {"a": t % 3, "b": 1}, {"a": 1.0, "b": 0.5}, {"__all__": done}, {"__all__": False}


def _episodes(broker, topic, rec, **decode_kw) -> dict:
    by_key = defaultdict(list)
    for m in read_messages(broker.bootstrap_servers, topic, rec.stats.messages_produced):
        by_key[m.key().decode()].append(decode_event(m.value(), m.headers(), **decode_kw))
    return by_key


def test_delayed_rewards_fold_into_buffered_steps_or_travel_as_reward_delta_2(broker, topic):
    # batches by size only (a 0.2 s age would send env steps 4-5 early on a busy machine, and the
    # reward for env step 5 would travel as a RewardDelta instead of folding in)
    rec = EpisodeRecorder(broker.bootstrap_servers, topic, max_batch_steps=4, max_batch_delay_s=3600)
    eid = rec.begin_multi_agent_episode({"a": Z, "b": Z}, **SPACES)
    for t in range(6):
        rec.log_multi_agent_step(eid, *_both(t))
    rec.log_multi_agent_reward(eid, 5, "b", 0.25)  # buffered: folded into env step 5, no message
    rec.log_multi_agent_reward(eid, 1, "a", -2.0)  # sent already: a RewardDelta/2
    with pytest.raises(ValueError, match="no env step t=6"):
        rec.log_multi_agent_reward(eid, 6, "a", 1.0)
    with pytest.raises(ValueError, match="not a possible agent"):
        rec.log_multi_agent_reward(eid, 1, "zz", 1.0)
    with pytest.raises(ValueError, match="log_multi_agent_reward"):
        rec.log_reward(eid, 1, 1.0)
    assert rec.log_multi_agent_step(eid, *_both(6, done=True)) is True
    rec.close()
    assert rec.stats.produced == 1 + 7 + 1 and rec.stats.delivered == rec.stats.produced
    evs = _episodes(broker, topic, rec)[eid]
    kinds = [type(e).__name__ for e in evs]
    assert kinds == ["MultiAgentEpisodeStart", "MultiAgentStepBatch", "RewardDelta", "MultiAgentStepBatch"]
    assert evs[2].agent_id == "a" and evs[1].n == 4 and evs[3].n == 3 and evs[3].ended
    r = fold_multi_agent(evs)
    assert [s.rewards for s in r.steps] == [{"a": 1.0, "b": 0.5}] + [{"a": -1.0, "b": 0.5}] + [
        {"a": 1.0, "b": 0.5}
    ] * 3 + [{"a": 1.0, "b": 0.75}, {"a": 1.0, "b": 0.5}]
    assert [int(s.actions["a"]) for s in r.steps] == [t % 3 for t in range(7)]
    np.testing.assert_array_equal(r.steps[3].observations["a"], np.full(2, 0.03, np.float32))


def test_big_env_steps_are_batched_under_max_batch_bytes_and_old_ones_sent_by_age(broker, topic, monkeypatch):
    img = gs.Box(0, 255, (64, 64, 3), np.uint8)  # 12 KiB a value, two agents
    spaces = {"observation_spaces": {"a": img, "b": img}, "action_spaces": {"a": gs.Discrete(2), "b": gs.Discrete(2)}}
    frame = np.zeros((64, 64, 3), np.uint8)
    clock = frozen_recorder_clock(monkeypatch)  # while the steps are logged only their size batches them
    rec = EpisodeRecorder(broker.bootstrap_servers, topic, max_batch_bytes=64 * 1024, max_batch_delay_s=0.2)
    eid = rec.begin_multi_agent_episode({"a": frame, "b": frame}, **spaces)
    for t in range(5):
        rec.log_multi_agent_step(eid, {"a": frame + t, "b": frame}, {"a": 0, "b": 1}, {"a": 1.0, "b": 1.0}, {}, {})
    assert rec.stats.messages_produced == 1 + 2  # 2 env steps (~49 KiB) a batch; the fifth waits
    clock.run()  # time runs again: only its age can send the fifth (no flush, no close)
    deadline = time.monotonic() + 60
    while rec.stats.messages_produced < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rec.stats.messages_produced == 4  # sent by the poller once 0.2 s old
    assert time.monotonic() - clock.frozen_at >= 0.2
    rec.abort_episode(eid)
    rec.close()
    r = fold_multi_agent(_episodes(broker, topic, rec)[eid])
    assert r.aborted and len(r.steps) == 5
    assert [int(s.observations["a"][0, 0, 0]) for s in r.steps] == [0, 1, 2, 3, 4]


def test_close_aborts_open_multi_agent_episodes_and_accounts_for_every_record(broker, topic):
    rec = EpisodeRecorder(broker.bootstrap_servers, topic)
    ids = [rec.begin_multi_agent_episode({"a": Z}, **SPACES) for _ in range(3)]
    for eid in ids:
        rec.log_multi_agent_step(eid, *_both(0))
    assert rec.open_episodes == 3
    rec.close()
    s = rec.stats
    assert s.buffered == 0 and s.produced == s.delivered == 6 + 3  # begins, env steps, aborts
    got = _episodes(broker, topic, rec)
    for eid in ids:
        assert [type(e).__name__ for e in got[eid]] == ["MultiAgentEpisodeStart", "MultiAgentStepBatch", "EpisodeAbort"]
        assert got[eid][-1].reason == "recorder-closed" and fold_multi_agent(got[eid]).aborted


def test_overflow_raise_records_nothing_and_drop_aborts_the_episode():
    rec = EpisodeRecorder(NOWHERE, "t", max_buffered_steps=3, on_overflow="raise", kafka_config=QUIET)
    try:
        eid = rec.begin_multi_agent_episode({"a": Z, "b": Z}, **SPACES)
        rec.log_multi_agent_step(eid, *_both(0))
        rec.log_multi_agent_step(eid, *_both(1))
        with pytest.raises(RecorderFullError):
            rec.log_multi_agent_step(eid, *_both(2))
        assert rec.stats.produced == 3
        rec.on_overflow = "drop"
        assert rec.log_multi_agent_step(eid, *_both(2)) is False  # dropped: the episode is aborted
        assert rec.stats.dropped == 1 + 2  # this env step and the two buffered ones
        assert rec.log_multi_agent_step(eid, *_both(3, done=True)) is True  # ends it (dropped too)
        assert rec.open_episodes == 0 and rec.stats.dropped == 4
    finally:
        rec.close(timeout=0)


def test_multi_agent_events_framed_for_a_schema_registry(broker, topic, registry):  # noqa: F811
    rec = EpisodeRecorder(broker.bootstrap_servers, topic, schema_registry_url=registry.url)
    eid = rec.begin_multi_agent_episode({"a": Z, "b": Z}, **SPACES)
    rec.log_multi_agent_step(eid, *_both(0))
    rec.log_multi_agent_reward(eid, 0, "b", 1.0)
    rec.flush(10)
    rec.log_multi_agent_reward(eid, 0, "a", 1.0)
    rec.log_multi_agent_step(eid, *_both(1, done=True))
    rec.close()
    names = {(json.loads(s)["name"], json.loads(s)["rlrec.version"]) for s in registry.schemas.values()}
    assert {("MultiAgentEpisodeStart", 1), ("MultiAgentStepBatch", 1), ("RewardDelta", 2)} <= names
    evs = _episodes(broker, topic, rec, registry=SchemaRegistry(registry.url))[eid]
    r = fold_multi_agent(evs)
    assert r.steps[0].rewards == {"a": 2.0, "b": 1.5} and len(r.steps) == 2


def test_batches_follow_the_message_size_as_agents_join_late(broker, topic):
    img = gs.Box(0, 255, (64, 64, 3), np.uint8)  # 12 KiB a value
    agents = [f"p{i}" for i in range(6)]
    spaces = {"observation_spaces": dict.fromkeys(agents, img), "action_spaces": dict.fromkeys(agents, gs.Discrete(2))}
    frame = np.zeros((64, 64, 3), np.uint8)
    limit = 100_000
    rec = EpisodeRecorder(broker.bootstrap_servers, topic, kafka_config={"message.max.bytes": limit})
    eid = rec.begin_multi_agent_episode({"p0": frame}, **spaces)
    rec.log_multi_agent_step(eid, {}, {"p0": 0}, {}, {}, {})  # a small first env step: p0's action hangs
    for t in range(1, 12):  # then every agent observes (~74 KiB an env step)
        acts = dict.fromkeys(agents, 1) if t > 1 else {"p0": 1}
        rec.log_multi_agent_step(eid, dict.fromkeys(agents, frame + t), acts, dict.fromkeys(acts, 1.0), {}, {})
    assert rec.log_multi_agent_step(eid, {}, {}, {}, {"__all__": True}, {}) is True
    rec.close()
    assert rec.stats.failed == 0 and rec.stats.delivered == rec.stats.produced == 1 + 13
    msgs = read_messages(broker.bootstrap_servers, topic, rec.stats.messages_produced)
    assert max(len(m.value()) for m in msgs) < limit
    r = fold_multi_agent([decode_event(m.value(), m.headers()) for m in msgs])
    assert len(r.steps) == 13 and not r.aborted
    assert [int(r.steps[t].observations["p5"][0, 0, 0]) for t in range(1, 12)] == list(range(1, 12))


def test_each_episode_records_its_own_spaces_and_modules_when_the_agents_stay(broker, topic):
    """Episodes of the same agent ids with other space objects (even equal ones) or other modules
    record their own spaces and modules, also when they alternate (the recorder keeps the last
    episode's encoded spaces)."""
    wide = gs.Box(-2.0, 2.0, (2,), np.float32)
    rec = EpisodeRecorder(broker.bootstrap_servers, topic, policy_id="p")
    kinds = [
        (SPACES["observation_spaces"], None),
        ({"a": wide, "b": BOX}, None),
        ({"a": gs.Box(-1.0, 1.0, (2,), np.float32), "b": BOX}, {"a": "m1", "b": "m2"}),
        (SPACES["observation_spaces"], {"a": "m1", "b": "m2"}),
        (SPACES["observation_spaces"], None),
        ({"a": wide, "b": BOX}, None),
    ]
    eids = [
        rec.begin_multi_agent_episode(
            {"a": Z, "b": Z}, observation_spaces=obs, action_spaces=SPACES["action_spaces"], agent_modules=mods
        )
        for obs, mods in kinds
    ]
    rec.close()
    got = _episodes(broker, topic, rec)
    for eid, (obs, mods) in zip(eids, kinds):
        start = got[eid][0]  # then the abort close() sends
        assert {a: s.observation_space for a, s in start.agents.items()} == obs
        assert {a: s.module_id for a, s in start.agents.items()} == (mods or dict.fromkeys("ab", "default_policy"))
    assert got[eids[1]][0].agents["a"].observation_space.high.tolist() == [2.0, 2.0]
    assert got[eids[0]][0].agents["a"].observation_space.high.tolist() == [1.0, 1.0]
