"""How the partition assembler ends multi-agent episodes, so that a replay rebuilds exactly the
rows of the first assembly (docs/GUARANTEES.md, "Multi-agent episodes exactly once"), and how it
treats events of the wrong kind or a colliding id: decisions with a cut, limits never re-judging
an episode with committed rows, reused ids, cross-kind events, agent row ids, spaces counted.
Pure assembly logic (events encoded and decoded through the real codec): no broker."""

from __future__ import annotations

import gymnasium.spaces as gs
import numpy as np

from rlrec.consumer.assembly import AssemblyConfig, Decision, PartitionAssembler
from rlrec.consumer.multi_agent_assembly import start_nbytes
from rlrec.consumer.multi_agent_reference import agent_episode_id
from rlrec.consumer.service_bounds import MemoryBoundsMixin
from rlrec.producer.events import EpisodeAbort, EpisodeStart, RewardDelta, StepBatch
from rlrec.producer.multi_agent_events import (
    ACTION,
    OBSERVATION,
    REWARD,
    TERMINATED,
    TERMINATED_TRUE,
    TRUNCATED,
    AgentColumn,
    AgentSpec,
    MultiAgentEpisodeStart,
    MultiAgentStepBatch,
    decode_event,
    encode_event,
)
from rlrec.producer.spaces import SPACE_NODE_NBYTES, space_nbytes

OBS = gs.Box(-1.0, 1.0, (2,), np.float32)
ACT = gs.Discrete(2)


def _rt(ev):
    value, headers = encode_event(ev)
    return decode_event(value, headers, key=ev.episode_id.encode())


def _start(eid: str, obs_space: gs.Space = OBS) -> MultiAgentEpisodeStart:
    specs = {a: AgentSpec(a, f"m{i}", obs_space, ACT) for i, a in enumerate(("a0", "a1"))}
    # a large space: no reset observation (what is counted is the space itself)
    obs = {a: [np.zeros(obs_space.shape, obs_space.dtype)] for a in specs} if obs_space is OBS else {}
    return _rt(MultiAgentEpisodeStart(eid, "pol", 0, specs, obs, {}, "", 1000))


def _batch(eid: str, t0: int, n: int, last: bool = False) -> MultiAgentStepBatch:
    cols = []
    for a in ("a0", "a1"):
        pres = np.full(n, OBSERVATION | ACTION | REWARD | TERMINATED | TRUNCATED, np.uint8)
        if last:
            pres[-1] |= TERMINATED_TRUE
        obs = [np.full((n, 2), 0.1 * t0, np.float32)]
        cols.append(AgentColumn(a, pres, obs, [np.ones((n,), np.int64)], np.arange(t0, t0 + n, dtype=np.float64)))
    return _rt(MultiAgentStepBatch(eid, t0, np.zeros(n, np.uint8), cols, ended=last, timestamp_ms=2000 + t0))


def _single(eid: str) -> list:
    return [
        _rt(EpisodeStart(eid, "other", 0, [np.zeros(2, np.float32)], OBS, ACT, "", {}, 1000)),
        _rt(StepBatch(eid, 0, [np.ones(3, np.int64)], np.ones(3), [np.zeros((3, 2), np.float32)], True, False)),
    ]


class _Committed:
    """`CommittedEpisodes` answering from a dict: episode id -> its entry's last offset."""

    def __init__(self, offsets: dict[str, int]) -> None:
        self.offsets = offsets

    def committed_offset(self, episode_id: str) -> int | None:
        return self.offsets.get(episode_id)

    def committed_length(self, episode_id: str) -> int | None:
        return None


def _apply(a: PartitionAssembler, events, first: int = 0) -> list:
    letters = []
    for off, ev in enumerate(events, start=first):
        letters += a.apply(off, ev, now=0.0)
    return letters


def _agent_state(row) -> tuple:
    sa = row.agent_episode
    return (
        row.episode_id,
        row.policy_id,
        np.asarray(sa.get_observations()).tolist(),
        np.asarray(sa.get_actions()).tolist(),
        np.asarray(sa.get_rewards()).tolist(),
        sa.is_terminated,
        sa.is_truncated,
    )


def test_a_decision_with_a_cut_read_back_after_later_batches_truncates_there():
    a = PartitionAssembler("t", 0)
    eid = "ma-cut"
    assert _apply(a, [_start(eid), _batch(eid, 0, 2), _batch(eid, 2, 2), _batch(eid, 4, 2)]) == []
    letters = a.apply(4, Decision(eid, "capacity", "truncate", cut_t=2).abort(), now=0.0)
    assert [(d.reason, d.offset) for d in letters] == [("capacity", 2), ("capacity", 3)]
    assert a.open_nbytes == 0
    got = sorted(_agent_state(r) for r in a.ready(force=True))
    b = PartitionAssembler("t", 0)
    assert _apply(b, [_start(eid), _batch(eid, 0, 2), EpisodeAbort(eid, "stop", 3000)]) == []
    want = sorted(_agent_state(r) for r in b.ready(force=True))
    assert len(got) == 2 and got == want
    assert all(s[6] and not s[5] and len(s[4]) == 2 for s in got)  # truncated after 2 env steps


def test_capacity_never_truncates_a_multi_agent_episode_it_dead_letters_it():
    a = PartitionAssembler("t", 0)
    eid = "ma-cap"
    _apply(a, [_start(eid), _batch(eid, 0, 2), _batch(eid, 2, 2)])
    decision, letters = a.evict_now(eid, "capacity", "truncate", now=0.0)
    assert (decision.action, decision.cut_t) == ("dead-letter", None)
    assert [(d.reason, d.offset) for d in letters] == [("capacity", 0), ("capacity", 1), ("capacity", 2)]
    assert a.ready(force=True) == [] and a.open == {}
    # its later batches: dead letters too, never rows
    assert [d.reason for d in a.apply(3, _batch(eid, 4, 1, last=True), now=0.0)] == ["capacity"]
    assert a.ready(force=True) == []


def test_episode_too_large_dead_letters_a_multi_agent_episode_even_with_truncate():
    a = PartitionAssembler("t", 0, config=AssemblyConfig(max_episode_bytes=6000, on_episode_too_large="truncate"))
    eid = "ma-big"
    letters = _apply(a, [_start(eid), _batch(eid, 0, 2), _batch(eid, 2, 200, last=True)])
    assert [(d.reason, d.offset) for d in letters] == [("episode-too-large", o) for o in (0, 1, 2)]
    assert a.ready(force=True) == []


def test_a_replay_with_committed_rows_is_not_rejudged_by_limits():
    eid = "ma-owed"
    log = [_start(eid), _batch(eid, 0, 40), _batch(eid, 40, 40, last=True)]
    first = PartitionAssembler("t", 0)
    _apply(first, log)
    rows = {r.policy_id: r for r in first.ready(force=True)}
    committed = _Committed({rows["pol.m0"].episode_id: rows["pol.m0"].last_offset})
    # a restart with a lower --max-episode-bytes: the rest of the episode is still owed
    b = PartitionAssembler("t", 0, committed=committed, config=AssemblyConfig(max_episode_bytes=6000))
    assert _apply(b, log) == []
    replayed = b.ready(force=True)
    assert [r.policy_id for r in replayed] == ["pol.m1"]
    assert _agent_state(replayed[0]) == _agent_state(rows["pol.m1"])
    assert b.counters.duplicates == 1
    # without a committed row the same limit refuses it
    c = PartitionAssembler("t", 0, config=AssemblyConfig(max_episode_bytes=6000))
    assert {d.reason for d in _apply(c, log)} == {"episode-too-large"}


class _Writer:
    def __init__(self, assembler: PartitionAssembler) -> None:
        self.assembler = assembler


class _Bounds(MemoryBoundsMixin):
    """The consumer's capacity eviction over real assemblers (decisions and letters collected)."""

    def __init__(self, assemblers: dict, max_open_episodes: int) -> None:
        self.writers = {p: _Writer(a) for p, a in assemblers.items()}
        self.config = type("Cfg", (), {"max_open_episodes": max_open_episodes, "max_open_bytes": 1 << 40})()
        self.config.on_capacity = "dead-letter"
        self.decided, self.letters = [], []

    def _decide(self, p, d, first_offset) -> None:
        self.decided.append(d.episode_id)

    def _dead_letter(self, msg, dl, partition) -> None:
        self.letters.append(dl)


def test_capacity_eviction_spares_an_episode_whose_rows_are_owed():
    eid = "ma-owed-cap"
    log = [_start(eid), _batch(eid, 0, 2), _batch(eid, 2, 2, last=True)]
    first = PartitionAssembler("t", 0)
    _apply(first, log)
    m0 = next(r for r in first.ready(force=True) if r.policy_id == "pol.m0")
    a = PartitionAssembler("t", 0, committed=_Committed({m0.episode_id: m0.last_offset}))
    _apply(a, log[:2])
    assert a.open[eid].owed
    other = PartitionAssembler("t", 1)
    _apply(other, [_start("ma-new")])
    other.open["ma-new"].last_event_at = 10.0  # the owed episode is the longest idle
    bounds = _Bounds({0: a, 1: other}, max_open_episodes=1)
    bounds._enforce_capacity()
    assert bounds.decided == ["ma-new"] and eid in a.open
    assert a.apply(2, log[2], now=0.0) == []
    assert [r.policy_id for r in a.ready(force=True)] == ["pol.m1"]


def test_a_reused_multi_agent_id_is_a_duplicate_start():
    committed = _Committed({agent_episode_id("ma-r", x): 3 for x in ("a0", "a1")})
    a = PartitionAssembler("t", 0, committed=committed)
    letters = _apply(a, [_start("ma-r"), _batch("ma-r", 0, 1), _batch("ma-r", 1, 2, last=True)], first=100)
    assert [(d.reason, d.offset) for d in letters] == [("duplicate-start", o) for o in (100, 101, 102)]
    assert a.ready(force=True) == [] and a.counters.duplicates == 0


def test_a_multi_agent_start_replayed_before_its_committed_rows_is_not_a_reuse():
    committed = _Committed({agent_episode_id("ma-p", x): 2 for x in ("a0", "a1")})
    a = PartitionAssembler("t", 0, committed=committed)
    letters = _apply(a, [_start("ma-p"), _batch("ma-p", 0, 1), _batch("ma-p", 1, 2, last=True)])
    assert letters == [] and a.ready(force=True) == [] and a.counters.duplicates == 2


def test_cross_kind_events_cost_one_dead_letter_and_never_the_episode():
    # a multi-agent batch and a RewardDelta/2 for an open single-agent episode
    a = PartitionAssembler("t", 0)
    sa = _single("ep-A")
    assert a.apply(0, sa[0], now=0.0) == []
    assert [d.reason for d in a.apply(1, _batch("ep-A", 0, 1), now=0.0)] == ["kind-mismatch"]
    assert [d.reason for d in a.apply(2, RewardDelta("ep-A", 0, 1.0, agent_id="a0"), now=0.0)] == ["kind-mismatch"]
    assert a.apply(3, sa[1], now=0.0) == []
    assert [fe.episode_id for fe in a.ready(force=True)] == ["ep-A"]
    # a RewardDelta/1 and a single-agent StepBatch for an open multi-agent episode
    b = PartitionAssembler("t", 0)
    _apply(b, [_start("ma-C"), _batch("ma-C", 0, 1)])
    assert [d.reason for d in b.apply(2, RewardDelta("ma-C", 0, 5.0), now=0.0)] == ["kind-mismatch"]
    step = StepBatch("ma-C", 1, [np.ones(1, np.int64)], np.ones(1), [np.zeros((1, 2), np.float32)], False, False)
    assert [d.reason for d in b.apply(3, _rt(step), now=0.0)] == ["kind-mismatch"]
    assert b.apply(4, _batch("ma-C", 1, 1, last=True), now=0.0) == []
    rows = b.ready(force=True)
    assert len(rows) == 2 and all(np.asarray(r.agent_episode.get_rewards()).tolist() == [0.0, 1.0] for r in rows)


def test_an_agent_row_id_taken_by_a_single_agent_episode_is_a_collision_either_way():
    x = agent_episode_id("ma-v", "a1")
    a = PartitionAssembler("t", 0)
    letters = _apply(a, [*_single(x), _start("ma-v"), _batch("ma-v", 0, 2, last=True)])
    assert [(d.reason, d.offset) for d in letters] == [("id-collision", 2), ("id-collision", 3)]
    assert [type(fe).__name__ for fe in a.ready(force=True)] == ["FinishedEpisode"]
    assert a.finished_bytes == sum(fe.nbytes() for fe in a.finished.values())
    # the other order: the single-agent episode's messages are dead letters, the rows stay
    b = PartitionAssembler("t", 0)
    letters = _apply(b, [_start("ma-v"), _batch("ma-v", 0, 2, last=True), *_single(x)])
    assert [(d.reason, d.offset) for d in letters] == [("id-collision", 2), ("kind-mismatch", 3)]
    assert sorted(r.policy_id for r in b.ready(force=True)) == ["pol.m0", "pol.m1"]
    # across passes: the single-agent episode is committed before the multi-agent one starts
    # (at the start, a committed row before it reads as a reused id)
    c = PartitionAssembler("t", 0, committed=_Committed({x: 1}))
    letters = _apply(c, [_start("ma-v"), _batch("ma-v", 0, 2, last=True)], first=5)
    assert [(d.reason, d.offset) for d in letters] == [("duplicate-start", 5), ("duplicate-start", 6)]
    assert c.ready(force=True) == [] and c.counters.duplicates == 0
    # ... or while it is open: found when its rows are built
    d = PartitionAssembler("t", 0, committed=_Committed({}))
    _apply(d, [_start("ma-v"), _batch("ma-v", 0, 1)], first=5)
    d.committed.offsets[x] = 3
    letters = d.apply(7, _batch("ma-v", 1, 1, last=True), now=0.0)
    assert [(dl.reason, dl.offset) for dl in letters] == [("id-collision", o) for o in (5, 6, 7)]
    assert d.ready(force=True) == []


def test_letters_upto_of_a_committed_multi_agent_episode_is_freed():
    a = PartitionAssembler("t", 0)
    off = 0
    for i in range(50):
        eid = f"ma-{i}"
        for ev in [_start(eid), _batch(eid, 0, 1), _batch(eid, 5, 1), _batch(eid, 1, 1, last=True)]:
            a.apply(off, ev, now=0.0)
            off += 1
        rows = a.ready(force=True)
        assert len(rows) == 2
        a.hand_out(rows[:1])
        a.mark_committed(rows[:1])
        assert eid in a.letters_upto  # its second row still waits for the same dead letters
        a.hand_out(rows[1:])
        a.mark_committed(rows[1:])
    assert a.letters_upto == {}


def test_a_start_is_counted_with_its_spaces_built():
    big = gs.Box(-1.0, 1.0, (400_000,), np.float64)
    assert space_nbytes(big) == SPACE_NODE_NBYTES + 400_000 * 18
    start = _start("ma-space", obs_space=big)
    assert start_nbytes(start) >= 400_000 * 18  # one shared space object, counted once
    assert start_nbytes(start) < 2 * 400_000 * 18
    a = PartitionAssembler("t", 0, config=AssemblyConfig(max_episode_bytes=1_000_000))
    assert [d.reason for d in a.apply(0, start, now=0.0)] == ["episode-too-large"]
    assert a.open == {} and a.open_nbytes == 0
    # a single-agent start's spaces are counted by the same estimator
    sa = EpisodeStart("sa-space", "default", 1, [np.zeros(400_000)], big, gs.Discrete(2))
    b = PartitionAssembler("t", 0, config=AssemblyConfig(max_episode_bytes=1_000_000))
    assert [d.reason for d in b.apply(0, sa, now=0.0)] == ["episode-too-large"]
    b = PartitionAssembler("t", 0, config=AssemblyConfig(max_episode_bytes=20_000_000))
    assert b.apply(0, sa, now=0.0) == []
    assert b.open_nbytes == 1000 + 400_000 * 8 + space_nbytes(big) + space_nbytes(gs.Discrete(2))


def test_an_unwritable_agent_row_makes_its_episode_unwritable_whole(tmp_path):
    from rlrec.consumer.service_letters import agent_row_records
    from rlrec.store.commit import ShardCommitter
    from rlrec.store.episodes import unpack_episode

    a = PartitionAssembler("t", 0)
    _apply(a, [_start("ma-u"), _batch("ma-u", 0, 2, last=True), _start("ma-ok"), _batch("ma-ok", 0, 1, last=True)])
    rows = a.ready(force=True)
    bad = next(r for r in rows if r.multi_agent_episode_id == "ma-u" and r.policy_id == "pol.m1")
    bad.agent_episode.is_terminated = False  # a row the shard format refuses (not done)
    c = ShardCommitter(str(tmp_path), topic="t", partition=0)
    c.claim()
    result = c.commit(rows, resume_offset=lambda eps: 0)
    assert sorted((fe.multi_agent_episode_id, fe.policy_id) for fe, _ in result.unwritable) == [
        ("ma-u", "pol.m0"),
        ("ma-u", "pol.m1"),
    ]
    for r in rows:
        assert (c.committed_offset(r.episode_id) is None) == (r.multi_agent_episode_id == "ma-u")
    records = [rec for fe, _ in result.unwritable for rec in agent_row_records(fe)]
    schemas = sorted(dict(h)["rlrec-schema"] for _, h in records)
    assert schemas == [b"AgentEpisodeItem/1", b"AgentEpisodeItem/1", b"MultiAgentRecord/1"]
    items = [unpack_episode(v) for v, h in records if dict(h)["rlrec-schema"] == b"AgentEpisodeItem/1"]
    assert sorted(len(e) for e in items) == [2, 2]


def test_a_start_of_many_small_spaces_is_counted_at_least_near_what_it_holds():
    """Built space nodes hold hundreds of bytes each: a start of thousands of small spaces is
    counted within 2x of what building them allocates (charged 64 bytes a node, it was ~10x
    under and passed the byte budgets)."""
    import json
    import tracemalloc

    from rlrec.producer.spaces import space_from_json, space_json_nbytes, space_to_json

    for make in (gs.Discrete, lambda i: gs.Box(-1.0, 1.0, (1,), np.float32), lambda i: gs.MultiBinary(2)):
        text = json.dumps(space_to_json(gs.Dict({f"k{i}": make(2) for i in range(2000)})))
        tracemalloc.start()
        built = space_from_json(json.loads(text))
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert space_nbytes(built) == space_json_nbytes(json.loads(text))
        assert space_nbytes(built) * 2 >= held, (space_nbytes(built), held)
