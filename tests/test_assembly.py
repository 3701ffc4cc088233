"""Unit tests of per-partition assembly rules (no broker, no storage)."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces as gs

from rlrec.consumer.assembly import AssemblyConfig, PartitionAssembler
from rlrec.producer.events import EpisodeAbort, EpisodeStart, RewardDelta, StepBatch, decode, encode

OBS = gs.Box(-10, 10, (4,), np.float32)
ACT = gs.Discrete(2)


def start(eid="e1", obs0=None, version=1):
    obs0 = np.zeros(4, np.float32) if obs0 is None else obs0
    return EpisodeStart(eid, "pol", version, [obs0], OBS, ACT, "CartPole-v1", {"seed": 1}, 1000)


def steps(eid="e1", t0=0, n=3, terminated=False, truncated=False, extra=True, seed=0):
    rng = np.random.default_rng(seed + t0)
    return StepBatch(
        eid,
        t0,
        [np.arange(t0, t0 + n, dtype=np.int64) % 2],
        np.full(n, 1.0),
        [rng.standard_normal((n, 4)).astype(np.float32)],
        terminated,
        truncated,
        None,
        {"action_logp": np.full(n, -0.5, np.float32)} if extra else {},
        2000 + t0,
    )


def test_episode_assembles_in_order_and_hands_out_once():
    a = PartitionAssembler("t", 0)
    assert a.apply(10, start()) == []
    b1, b2 = steps(t0=0, n=3), steps(t0=3, n=2, terminated=True)
    assert a.apply(11, b1) == [] and a.apply(12, b2) == []
    assert not a.open and list(a.finished) == ["e1"]
    fe = a.ready(force=True)[0]
    assert fe.length == 5 and fe.terminated and not fe.truncated
    assert fe.observations[0].shape == (6, 4)
    np.testing.assert_array_equal(fe.observations[0][1:4], b1.observations[0])
    np.testing.assert_array_equal(fe.actions[0], [0, 1, 0, 1, 0])
    assert fe.extra_model_outputs["action_logp"].shape == (5,)
    assert len(fe.infos) == 6 and fe.infos[0] == {"seed": 1}
    assert (fe.first_offset, fe.last_offset) == (10, 12)
    assert a.safe_offset() == 10  # not committed yet
    a.hand_out([fe])
    assert a.ready(force=True) == []
    a.mark_committed([fe], 12)
    assert a.safe_offset() == 13


def test_safe_offset_waits_for_the_oldest_open_episode():
    a = PartitionAssembler("t", 0)
    a.apply(5, start("old"))
    a.apply(6, start("new"))
    a.apply(7, steps("new", 0, 2, terminated=True))
    fe = a.ready(force=True)[0]
    a.hand_out([fe])
    a.mark_committed([fe], 7)
    assert a.safe_offset() == 5  # "old" is still open: a crash must replay it
    dls = a.apply(8, EpisodeAbort("old"))
    # "old" had no steps: it is dead-lettered as empty, so it no longer holds the offset back
    assert [d.reason for d in dls] == ["empty-episode"] and "old" not in a.finished
    assert a.safe_offset() == 9


def test_abort_finishes_truncated():
    a = PartitionAssembler("t", 0)
    a.apply(0, start())
    a.apply(1, steps(t0=0, n=2))
    assert a.apply(2, EpisodeAbort("e1", "recorder-closed")) == []
    fe = a.finished["e1"]
    assert fe.truncated and not fe.terminated and fe.length == 2 and fe.last_offset == 2


def test_duplicates_gaps_backwards_unknown():
    a = PartitionAssembler("t", 0)
    a.apply(0, start())
    assert a.apply(1, start()) == [] and a.counters.duplicates == 1  # identical start: retry duplicate
    dl = a.apply(2, start(obs0=np.ones(4, np.float32)))
    assert [d.reason for d in dl] == ["duplicate-start"]
    a.apply(3, steps(t0=0, n=3))
    assert a.apply(4, steps(t0=0, n=3)) == [] and a.counters.duplicates == 2
    assert [d.reason for d in a.apply(5, steps(t0=1, n=3))] == ["backwards-t"]
    assert [d.reason for d in a.apply(6, steps(t0=5, n=1))] == ["gap"]
    assert [d.reason for d in a.apply(7, steps("nobody", 0, 1))] == ["unknown-episode"]
    assert [d.reason for d in a.apply(8, RewardDelta("nobody", 0, 1.0))] == ["unknown-episode"]
    assert [d.reason for d in a.apply(9, steps(t0=3, n=1, extra=False))] == ["extra-mismatch"]
    assert a.open["e1"].t == 3


def test_space_mismatch_is_dead_lettered():
    a = PartitionAssembler("t", 0)
    a.apply(0, start())
    bad = steps(t0=0, n=2)
    bad.observations = [np.zeros((2, 5), np.float32)]
    assert [d.reason for d in a.apply(1, bad)] == ["space-mismatch"]
    bad2 = steps(t0=0, n=2)
    bad2.actions = [np.zeros(2, np.float64)]
    assert [d.reason for d in a.apply(2, bad2)] == ["space-mismatch"]


def test_delayed_rewards_apply_until_hand_out_then_are_late():
    a = PartitionAssembler("t", 0, config=AssemblyConfig(reward_join_window_s=10))
    a.apply(0, start())
    a.apply(1, steps(t0=0, n=3))
    a.apply(2, RewardDelta("e1", 1, 2.5))  # open episode, applied step
    assert [d.reason for d in a.apply(3, RewardDelta("e1", 7, 1.0))] == ["bad-reward-t"]
    a.apply(4, steps(t0=3, n=1, terminated=True))
    a.apply(5, RewardDelta("e1", 3, 0.25), now=None)  # finished, within the join window
    fe = a.finished["e1"]
    assert fe.rewards.tolist() == [1.0, 3.5, 1.0, 1.25]
    assert a.ready(now=fe.finished_at + 1) == []  # still in the join window
    assert a.ready(now=fe.finished_at + 11) == [fe]
    a.hand_out([fe])
    assert [d.reason for d in a.apply(6, RewardDelta("e1", 0, 1.0))] == ["late-reward"]
    a.mark_committed([fe], 5)
    assert [d.reason for d in a.apply(7, RewardDelta("e1", 0, 1.0))] == ["late-reward"]
    assert fe.last_offset == 5


def test_replay_skips_committed_episodes_silently():
    # restart: the manifest says e1 is committed in a shard whose last offset is 12
    a = PartitionAssembler("t", 0, committed={"e1": 12})
    assert a.apply(10, start()) == []
    assert a.apply(11, steps(t0=0, n=3)) == []
    assert a.apply(12, steps(t0=3, n=1, terminated=True)) == []
    assert a.counters.replay_skipped == 3 and not a.open and not a.finished
    assert [d.reason for d in a.apply(20, RewardDelta("e1", 0, 1.0))] == ["late-reward"]
    assert a.apply(21, steps(t0=0, n=3)) == [] and a.counters.duplicates == 1


def test_timeouts_truncate_or_dead_letter():
    a = PartitionAssembler("t", 0, config=AssemblyConfig(episode_timeout_s=5))
    a.apply(0, start("a"), now=100.0)
    a.apply(1, steps("a", 0, 2), now=100.0)
    a.apply(2, start("b"), now=100.0)
    assert a.expire(now=104.0) == []
    dls = a.expire(now=106.0)
    assert a.finished["a"].truncated and not a.finished["a"].terminated
    assert [d.reason for d in dls] == ["empty-episode"]  # b had no steps
    a2 = PartitionAssembler("t", 0, config=AssemblyConfig(episode_timeout_s=5, on_timeout="dead-letter"))
    a2.apply(0, start("a"), now=100.0)
    a2.apply(1, steps("a", 0, 2), now=100.0)
    dls = a2.expire(now=106.0)
    assert [d.reason for d in dls] == ["timeout", "timeout"]
    # the dead letters are the episode's events, re-encoded: nothing vanishes
    evs = [decode(d.value, d.headers) for d in dls]
    assert [type(e).__name__ for e in evs] == ["EpisodeStart", "StepBatch"]
    assert a2.safe_offset() == 2


def test_eviction_dead_letters_whole_episode_and_later_events():
    a = PartitionAssembler("t", 0)
    a.apply(0, start("a"))
    a.apply(1, steps("a", 0, 2))
    dls = a.evict("a")
    assert {d.reason for d in dls} == {"capacity"} and len(dls) == 2
    assert [d.reason for d in a.apply(2, steps("a", 2, 1, terminated=True))] == ["capacity"]


def test_give_back_after_failed_write():
    a = PartitionAssembler("t", 0)
    a.apply(0, start())
    a.apply(1, steps(t0=0, n=1, terminated=True))
    fe = a.ready(force=True)[0]
    before = a.finished_bytes
    a.hand_out([fe])
    assert a.finished_bytes == before - fe.nbytes()
    a.give_back([fe])
    assert a.ready(force=True) == [fe] and a.finished_bytes == before
    assert a.safe_offset() == 0


@pytest.mark.parametrize("kind", ["terminated", "truncated"])
def test_flags_kept_distinct(kind):
    a = PartitionAssembler("t", 0)
    a.apply(0, start())
    a.apply(1, steps(t0=0, n=2, terminated=kind == "terminated", truncated=kind == "truncated"))
    fe = a.finished["e1"]
    assert (fe.terminated, fe.truncated) == (kind == "terminated", kind == "truncated")


def test_round_trip_through_the_wire():
    a = PartitionAssembler("t", 0)
    for off, ev in enumerate([start(), steps(t0=0, n=4, terminated=True)]):
        v, h = encode(ev)
        a.apply(off, decode(v, h))
    assert a.finished["e1"].length == 4
