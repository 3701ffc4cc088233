"""Unit tests of per-partition assembly rules (no broker, no storage)."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces as gs

from rlrec.consumer.assembly import AssemblyConfig, PartitionAssembler
from rlrec.producer.events import EpisodeAbort, EpisodeStart, RewardDelta, StepBatch, decode, encode
from rlrec.store.finished import FinishedEpisode

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


class Committed:
    """The committer's answers, kept in memory: episode id -> last offset of its entry, and steps."""

    def __init__(self, offsets: dict[str, int] | None = None) -> None:
        self.offsets = dict(offsets or {})
        self.lengths: dict[str, int] = {}

    def committed_offset(self, episode_id: str) -> int | None:
        return self.offsets.get(episode_id)

    def committed_length(self, episode_id: str) -> int | None:
        return self.lengths.get(episode_id)


def commit(a: PartitionAssembler, episodes: list[FinishedEpisode], last_offset: int) -> None:
    """What a writer does once its committer committed `episodes` in an entry ending at `last_offset`."""
    if not isinstance(a.committed, Committed):
        a.committed = Committed()
    for fe in episodes:
        a.committed.offsets[fe.episode_id] = last_offset
        a.committed.lengths[fe.episode_id] = fe.length
    a.mark_committed(episodes)


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
    commit(a, [fe], 12)
    assert a.safe_offset() == 13


def test_safe_offset_waits_for_the_oldest_open_episode():
    a = PartitionAssembler("t", 0)
    a.apply(5, start("old"))
    a.apply(6, start("new"))
    a.apply(7, steps("new", 0, 2, terminated=True))
    fe = a.ready(force=True)[0]
    a.hand_out([fe])
    commit(a, [fe], 7)
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
    commit(a, [fe], 5)
    assert [d.reason for d in a.apply(7, RewardDelta("e1", 0, 1.0))] == ["late-reward"]
    assert fe.last_offset == 5


def test_replay_skips_committed_episodes_silently():
    # restart: the manifest says e1 is committed in a shard whose last offset is 12
    a = PartitionAssembler("t", 0, committed=Committed({"e1": 12}))
    assert a.apply(10, start()) == []
    assert a.apply(11, steps(t0=0, n=3)) == []
    assert a.apply(12, steps(t0=3, n=1, terminated=True)) == []
    assert a.counters.replay_skipped == 3 and not a.open and not a.finished
    assert [d.reason for d in a.apply(20, RewardDelta("e1", 0, 1.0))] == ["late-reward"]
    # a step after the committed end in the log is dead-lettered, never silently a duplicate
    assert [d.reason for d in a.apply(21, steps(t0=0, n=3))] == ["step-after-end"]
    assert [d.reason for d in a.apply(22, start())] == ["duplicate-start"]


def _decided(a: PartitionAssembler, decisions, offset: int, now: float):
    """Read the decisions back from the log (as the consumer does) at consecutive offsets."""
    letters = []
    for i, d in enumerate(decisions):
        letters += a.apply(offset + i, decode(*encode(d.abort())), now=now)
    return letters


def test_timeouts_are_decided_in_live_time_and_applied_when_read_back():
    a = PartitionAssembler("t", 0, config=AssemblyConfig(episode_timeout_s=5))
    a.apply(0, start("a"), now=100.0)
    a.apply(1, steps("a", 0, 2), now=100.0)
    a.apply(2, start("b"), now=100.0)
    assert a.decide_timeouts(now=200.0) == []  # not live (paused, backlog, outage): no timeouts at all
    a.live_since = 150.0  # live again since 150: the idle time counts from there
    assert a.decide_timeouts(now=154.0) == []
    decisions = a.decide_timeouts(now=156.0)
    assert [(d.episode_id, d.reason, d.action) for d in decisions] == [
        ("a", "timeout", "truncate"),
        ("b", "timeout", "truncate"),
    ]
    assert a.decide_timeouts(now=157.0) == []  # once: the decision is on its way
    assert "a" in a.open  # nothing happens until the decisions are read back from the log
    a.apply(3, steps("a", 2, 1), now=158.0)  # a step before the decision in the log voids it
    dls = _decided(a, decisions, 4, now=159.0)
    assert "a" in a.open and a.open["a"].t == 3 and a.counters.decisions_superseded == 1
    assert [d.reason for d in dls] == ["empty-episode"]  # b had no steps: it was idle, it ends
    [again] = a.decide_timeouts(now=170.0)  # idle once more: decided anew, at its new length
    assert again.cut_t == 3
    assert _decided(a, [again], 6, now=171.0) == []
    fe = a.finished["a"]
    assert fe.truncated and not fe.terminated and fe.length == 3 and fe.last_offset == 6
    assert [d.reason for d in a.apply(7, steps("a", 3, 1))] == ["timeout"]  # ended by a timeout
    assert _decided(a, [again], 8, now=172.0) == [] and a.counters.decisions_superseded == 2


def test_a_late_timeout_never_cuts_an_episode_that_stepped_again():
    """An outage the consumer took for idleness: the producer's steps reach the log before the
    consumer's timeout. Every pass (live or replay) reads the steps first and voids the timeout."""
    log = [start("a"), steps("a", 0, 2)]
    a = PartitionAssembler("t", 0, config=AssemblyConfig(episode_timeout_s=5))
    for i, ev in enumerate(log):
        a.apply(i, ev, now=100.0)
    a.live_since = 100.0
    [d] = a.decide_timeouts(now=106.0)
    log += [steps("a", 2, 2, terminated=True), decode(*encode(d.abort()))]
    for now in (106.0, 1e9):  # live, then a replay much later
        r = PartitionAssembler("t", 0, config=AssemblyConfig(episode_timeout_s=5))
        assert [dl for i, ev in enumerate(log) for dl in r.apply(i, ev, now=now)] == []
        fe = r.finished["a"]
        assert fe.terminated and not fe.truncated and fe.length == 4


def test_an_episode_waits_for_the_acknowledgement_of_its_own_dead_letters():
    """A replay skips a committed episode's events up to its shard's last offset, dead-lettered
    ones too: an episode is written only once the dead letters of its events are acknowledged
    (else the next owner would skip a dead letter that never reached the broker)."""
    a = PartitionAssembler("t", 0)
    a.apply(0, start("a"))
    a.apply(1, steps("a", 0, 2))
    assert _reasons(a.apply(2, steps("a", 5, 1))) == [("gap", 2)]
    a.apply(3, start("b"))
    a.apply(4, steps("b", 0, 1, terminated=True))
    a.apply(5, steps("a", 2, 1, terminated=True))
    ready = lambda first_unacked: sorted(fe.episode_id for fe in a.ready(force=True, first_unacked=first_unacked))  # noqa: E731
    assert ready(None) == ["a", "b"]  # every dead letter acknowledged
    assert ready(2) == ["b"]  # a's gap letter unacknowledged: a waits, b (no letters) does not
    assert ready(1) == ["b"]  # an earlier letter (any episode's) unacknowledged: a waits too
    assert ready(3) == ["a", "b"]  # a's letters acknowledged
    a.hand_out(a.ready(force=True))
    commit(a, list(a.in_flight.values()), 5)
    assert a.letters_upto == {}  # forgotten once committed: memory does not grow


def test_a_step_batch_reaching_past_a_finished_end_is_dead_lettered():
    a = PartitionAssembler("t", 0)
    a.apply(0, start("a"))
    a.apply(1, steps("a", 0, 3, terminated=True))
    assert a.apply(2, steps("a", 0, 3)) == [] and a.counters.duplicates == 1  # a re-send: held already
    assert _reasons(a.apply(3, steps("a", 2, 2))) == [("step-after-end", 3)]  # steps 3.. are new


def test_decision_cuts_must_be_short_ascii_numbers():
    from rlrec.consumer.assembly import parse_decision

    assert parse_decision("rlrec:capacity:truncate@12") == ("capacity", "truncate", 12)
    for cut in ("\u00b2", "1" * 5000, "-1", "1e3", ""):
        bad = f"rlrec:capacity:truncate@{cut}"
        assert parse_decision(bad) is None or cut == "", cut


def test_timeout_dead_letter_decision():
    a = PartitionAssembler("t", 0, config=AssemblyConfig(episode_timeout_s=5, on_timeout="dead-letter"))
    a.apply(0, start("a"), now=100.0)
    a.apply(1, steps("a", 0, 2), now=100.0)
    a.live_since = 100.0
    dls = _decided(a, a.decide_timeouts(now=106.0), 2, now=106.0)
    assert [(d.reason, d.offset) for d in dls] == [("timeout", 0), ("timeout", 1), ("timeout", 2)]
    # the dead letters are the episode's events, re-encoded (and the decision itself): nothing vanishes
    evs = [decode(d.value, d.headers) for d in dls[:2]]
    assert [type(e).__name__ for e in evs] == ["EpisodeStart", "StepBatch"]
    assert a.safe_offset() == 3


def test_a_decision_replays_the_same_way():
    """The same log (events and decision) builds the same episode whatever the clock says."""
    from rlrec.consumer.assembly import Decision

    log = [
        start("a"),
        steps("a", 0, 2),
        decode(*encode(Decision("a", "capacity", "truncate").abort())),
        steps("a", 2, 1),
    ]
    results = []
    for now in (100.0, 1e9):
        a = PartitionAssembler("t", 0, config=AssemblyConfig(episode_timeout_s=5))
        letters = [dl.reason for i, ev in enumerate(log) for dl in a.apply(i, ev, now=now)]
        results.append((a.finished["a"].length, a.finished["a"].truncated, letters))
    assert results[0] == results[1] == (2, True, ["capacity"])


def test_forged_or_unknown_decisions_are_ordinary_aborts():
    a = PartitionAssembler("t", 0)
    a.apply(0, start("a"))
    a.apply(1, steps("a", 0, 2))
    a.apply(2, EpisodeAbort("a", "rlrec:not-a-reason:truncate"))  # not a decision: the producer's abort
    assert a.finished["a"].truncated and a.counters.decisions == 0


def test_capacity_eviction_frees_memory_at_once_and_replays_the_same_way():
    from rlrec.consumer.assembly import parse_decision

    a = PartitionAssembler("t", 0)
    a.apply(0, start("a"))
    a.apply(1, steps("a", 0, 2))
    d, letters = a.evict_now("a", "capacity", "truncate")
    assert letters == [] and a.finished["a"].length == 2 and a.open_nbytes == 0
    assert parse_decision(d.abort().reason) == ("capacity", "truncate", 2)
    assert _reasons(a.apply(2, steps("a", 2, 1))) == [("capacity", 2)]  # after the cut
    assert _decided(a, [d], 3, now=0.0) == []  # read back: already applied
    # a replay (a fresh consumer) reads the same log: the step after the cut is in memory when
    # the decision arrives, and is cut away the same way
    r = PartitionAssembler("t", 0)
    for i, ev in enumerate([start("a"), steps("a", 0, 2), steps("a", 2, 1)]):
        assert r.apply(i, ev) == []
    assert _reasons(_decided(r, [d], 3, now=0.0)) == [("capacity", 2)]
    fe, again = a.finished["a"], r.finished["a"]
    assert again.length == fe.length == 2 and again.truncated
    np.testing.assert_array_equal(again.observations[0], fe.observations[0])


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


# ---------------------------------------------------------------------------------------------
# data that spoils a message or an episode (consumer hardening)


def _reasons(letters) -> list[tuple[str, int]]:
    return [(dl.reason, dl.offset) for dl in letters]


def _with(b: StepBatch, **kw) -> StepBatch:
    for k, v in kw.items():
        setattr(b, k, v)
    return b


def test_out_of_space_action_dead_letters_the_whole_episode_with_source_offsets():
    """Action 7 for Discrete(2) is never stored: RLlib's logp would fail on it in the trainer."""
    a = PartitionAssembler("t", 0)
    a.apply(10, start())
    a.apply(11, steps(n=2))
    a.apply(12, RewardDelta("e1", 0, 0.5))
    bad = _with(steps(t0=2, n=1), actions=[np.array([7])])
    letters = a.apply(13, bad)
    # the start, the batch and the reward re-encoded (each at its own offset), then the bad message
    assert _reasons(letters) == [("out-of-space", 10), ("out-of-space", 11), ("out-of-space", 12), ("out-of-space", 13)]
    assert [type(decode(dl.value, dl.headers)).__name__ for dl in letters[:3]] == [
        "EpisodeStart",
        "StepBatch",
        "RewardDelta",
    ]
    assert letters[3].value is None  # the caller attaches the original message
    assert not a.open and a.open_nbytes == 0
    assert _reasons(a.apply(14, steps(t0=3, n=1, terminated=True))) == [("out-of-space", 14)]  # and its rest
    assert a.safe_offset() == 15


@pytest.mark.parametrize("mode", ["strict", "shape", "off"])
def test_validate_spaces_modes(mode):
    a = PartitionAssembler("t", 0, config=AssemblyConfig(validate_spaces=mode))
    a.apply(0, start())
    a.apply(1, steps(n=2))
    nan = _with(steps(t0=2, n=1), observations=[np.full((1, 4), np.nan, np.float32)])
    letters = a.apply(2, nan)
    assert (letters[-1].reason if letters else None) == ("non-finite-value" if mode == "strict" else None)
    b = PartitionAssembler("t", 0, config=AssemblyConfig(validate_spaces=mode))
    b.apply(0, start())
    wrong_dtype = _with(steps(n=1), observations=[np.zeros((1, 4), np.float64)])
    letters = b.apply(1, wrong_dtype)
    # off: no declared space, but a batch must still stack with the start's observation
    assert _reasons(letters) == [("space-mismatch", 1)]
    c = PartitionAssembler("t", 0, config=AssemblyConfig(validate_spaces=mode))
    c.apply(0, start())
    c.apply(1, steps(n=1))
    c.apply(2, _with(steps(t0=1, n=1, terminated=True), actions=[np.array([5])]))
    assert ("e1" in c.finished) == (mode != "strict")  # ranges are checked in strict mode only


@pytest.mark.parametrize(
    ("first", "bad"),
    [
        (np.zeros((2, 2), np.float32), np.zeros((1, 3), np.float32)),  # would crash np.concatenate
        (np.zeros(2, np.float32), np.zeros(1, np.int64)),  # ... or silently promote to float64
    ],
)
def test_extra_output_trailing_shape_or_dtype_change_is_one_dead_letter(first, bad):
    a = PartitionAssembler("t", 0)
    a.apply(0, start())
    a.apply(1, _with(steps(n=2), extra_model_outputs={"action_logp": first}))
    letters = a.apply(2, _with(steps(t0=2, n=1), extra_model_outputs={"action_logp": bad}))
    assert _reasons(letters) == [("extra-output-mismatch", 2)]
    a.apply(3, _with(steps(t0=2, n=1, terminated=True), extra_model_outputs={"action_logp": first[:1]}))
    fe = a.finished["e1"]
    assert fe.length == 3 and fe.extra_model_outputs["action_logp"].dtype == np.float32


def test_episode_too_large_dead_letters_or_truncates():
    batch = steps(n=100)
    per_batch = batch.rewards.nbytes + batch.actions[0].nbytes + batch.observations[0].nbytes + 400 + 200
    limit = 3 * per_batch + 2000 + 1200  # the start: its observation, info and spaces
    a = PartitionAssembler("t", 0, config=AssemblyConfig(max_episode_bytes=limit))
    a.apply(0, start())
    for i in range(3):
        assert a.apply(1 + i, steps(t0=100 * i, n=100)) == []
    letters = a.apply(4, steps(t0=300, n=100))
    assert [r for r, _ in _reasons(letters)] == ["episode-too-large"] * 5 and "e1" not in a.open
    t = PartitionAssembler("t", 0, config=AssemblyConfig(max_episode_bytes=limit, on_episode_too_large="truncate"))
    t.apply(0, start())
    for i in range(3):
        t.apply(1 + i, steps(t0=100 * i, n=100))
    assert _reasons(t.apply(4, steps(t0=300, n=100))) == [("episode-too-large", 4)]
    fe = t.finished["e1"]
    assert fe.length == 300 and fe.truncated and not fe.terminated
    assert _reasons(t.apply(5, steps(t0=400, n=1))) == [("episode-too-large", 5)]


def test_info_memory_counts_toward_the_episode_budget():
    """An info's memory counts, not its wire size: a 6 MB info message can hold ~138 MiB of Python
    objects."""
    big = {"x": list(range(100_000))}  # ~0.7 MB of JSON, several MB of Python objects
    a = PartitionAssembler("t", 0, config=AssemblyConfig(max_episode_bytes=2 * 1024 * 1024))
    a.apply(0, start())
    letters = a.apply(1, _with(steps(n=1), infos=[big]))
    assert [r for r, _ in _reasons(letters)] == ["episode-too-large", "episode-too-large"]
    b = PartitionAssembler("t", 0)
    b.apply(0, start())
    b.apply(1, _with(steps(n=1), infos=[big]))
    assert b.open_nbytes > 3_000_000  # counted, not the ~1 KB of old


def test_a_bug_while_building_dead_letters_the_episode_as_internal(monkeypatch):
    import rlrec.consumer.assembly as assembly

    def broken(*args, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(assembly, "_build", broken)
    a = PartitionAssembler("t", 0)
    a.apply(0, start())
    letters = a.apply(1, steps(n=2, terminated=True))
    assert _reasons(letters) == [("internal", 0), ("internal", 1)] and "boom" in letters[0].detail
    assert not a.open and not a.finished and a.safe_offset() == 2


def test_finished_events_re_encode_an_episode():
    from rlrec.consumer.assembly import finished_events

    a = PartitionAssembler("t", 0)
    a.apply(0, start())
    a.apply(1, steps(n=3))
    a.apply(2, steps(t0=3, n=2, truncated=True))
    fe = a.finished["e1"]
    ev_start, ev_steps = (decode(*encode(ev)) for ev in finished_events(fe))
    b = PartitionAssembler("t", 1)
    b.apply(0, ev_start)
    b.apply(1, ev_steps)
    again = b.finished["e1"]
    for x, y in zip(fe.observations + fe.actions, again.observations + again.actions):
        np.testing.assert_array_equal(x, y)
    assert again.truncated and again.length == 5 and again.infos == fe.infos


def test_after_a_partition_count_change_orphans_and_split_parts_say_so():
    a = PartitionAssembler("t", 0, config=AssemblyConfig(episode_timeout_s=5))
    a.split_suspected = True
    a.apply(0, start("first-part"), now=100.0)
    a.apply(1, steps("first-part", 0, 2), now=100.0)
    # the rest of an episode whose start went to another partition before the change
    assert _reasons(a.apply(2, steps("second-part", 3, 1), now=100.0)) == [("partition-change", 2)]
    a.live_since = 100.0
    decisions = a.decide_timeouts(now=106.0)
    assert [(d.reason, d.action) for d in decisions] == [("partition-change", "dead-letter")]
    assert [r for r, _ in _reasons(_decided(a, decisions, 3, now=106.0))] == ["partition-change"] * 3


def test_assemblers_of_a_consumer_count_into_one_exported_counter():
    from prometheus_client import generate_latest

    from rlrec.consumer.metrics import ConsumerMetrics

    metrics = ConsumerMetrics()
    a = PartitionAssembler("t", 0, counters=metrics.assembly)
    b = PartitionAssembler("t", 1, counters=metrics.assembly)
    a.apply(0, start("a"))
    b.apply(0, start("b"))
    b.apply(1, start("b"))  # the same start again: a duplicate
    text = generate_latest(metrics.registry).decode()
    assert 'rlrec_assembly_total{what="events"} 3.0' in text
    assert 'rlrec_assembly_total{what="duplicates"} 1.0' in text
