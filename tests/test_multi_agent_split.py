"""The multi-agent builders: RLlib's replay (the reference) and the fast per-agent split give the
same `MultiAgentEpisode`, field by field, on real envs; RLlib's refusals are data errors."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pettingzoo")
pytest.importorskip("mpe2")

from rlrec.consumer.multi_agent_reference import MultiAgentDataError, agent_episode_id, reference_episode
from rlrec.consumer.multi_agent_split import is_direct, split_episode, split_recording
from rlrec.producer.multi_agent_recording import MultiAgentEnvStep, MultiAgentRecording, MultiAgentReset
from rlrec.store.episodes import pack_episode, unpack_episode
from rlrec.store.multi_agent_episode import assemble_episode, pack_record, unpack_record
from tests import multi_agent_cases as cases

DIRECT = {"simple_spread": True, "pistonball": True, "tictactoe": False, "join_leave": False}


def _rebuilt(split, episode_id):
    """The split stored and read back: rows and carried episodes packed, the record packed."""
    record, carried = unpack_record(pack_record(split.record, {a: pack_episode(e) for a, e in split.carried.items()}))
    agents = {a: unpack_episode(pack_episode(e)) for a, e in split.rows.items()}
    agents.update({a: unpack_episode(b) for a, b in carried.items()})
    return assemble_episode(agents, record, episode_id)


@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_fast_split_equals_reference_replay(case):
    rec = cases.CASES[case]()
    assert is_direct(rec) is DIRECT[case]
    reference = reference_episode(rec)
    split = split_recording(rec)
    assert split.direct is DIRECT[case]
    assert all(e.is_done and len(e) >= 1 for e in split.rows.values())
    fast = assemble_episode({**split.rows, **split.carried}, split.record, rec.episode_id)
    cases.assert_same(cases.comparable_state(reference), cases.comparable_state(fast))
    # and after the bytes: rows, record and carried episodes packed and read back safely
    cases.assert_same(cases.comparable_state(reference), cases.comparable_state(_rebuilt(split, rec.episode_id)))
    # the replay path split gives the same rows and record as the fast one
    replayed = split_episode(reference, rec)
    assert replayed.record == split.record or not DIRECT[case]
    assert sorted(replayed.rows) == sorted(split.rows)


def test_comparison_sees_a_changed_field():
    rec = cases.simple_spread()
    reference, fast = reference_episode(rec), reference_episode(rec)
    fast.agent_episodes["agent_1"].rewards.data[3] += 1e-9
    with pytest.raises(AssertionError, match=r"agent_1\.rewards\.data\[3\]"):
        cases.assert_same(cases.comparable_state(reference), cases.comparable_state(fast))


def test_join_leave_keeps_rllib_details():
    rec = cases.join_leave()
    split = split_recording(rec)
    r = split.record
    assert r["modules"] == {"a": "m_a", "b": "m_b", "c": "m_c", "d": "m_d"}  # d mapped, never observed
    assert r["agents"] == ["a", "b", "c"] and sorted(split.rows) == ["a", "b", "c"]
    assert r["env_t_to_agent_t"]["a"]["data"] == [0, 1, "S", 2, 3, 4]  # a's action hung at env step 2
    assert r["env_t_to_agent_t"]["c"]["data"] == ["S", "S", "S", 0, 1, 2]  # c joined at env step 3
    # b left at env step 4 without an observation: RLlib tags the step skipped, then adds it
    assert r["env_t_to_agent_t"]["b"]["data"] == ["S", 0, 1, 2, "S", 3, "S"]
    assert r["is_truncated"] is True and r["is_terminated"] is True  # all agents done: RLlib says terminated
    b = split.rows["b"]
    assert b.is_terminated and not b.is_truncated and b.rewards.data == [1.0, 1.0, -1.0]
    np.testing.assert_array_equal(b.observations.data[-1], b.observations.data[-2])  # RLlib repeats its last obs
    a = split.rows["a"]
    assert a.rewards.data == [1.0, 2.0, 1.0, 1.0]  # env steps 2+3 folded into one agent step
    assert split.env_flags["b"] == (True, False) and split.env_flags["a"] == (False, True)
    assert split.rows["c"].id_ == agent_episode_id("join-0", "c")
    assert split.rows["c"].custom_data == {"policy_id": "pol.m_c", "policy_version": 3, "env_id": "join_leave"}


def _rec(steps, agents=("a", "b", "c"), reset=("a", "b", "c"), aborted=False):
    o = np.zeros(2, np.float32)
    return MultiAgentRecording(
        "ep-x",
        "pol",
        0,
        dict.fromkeys(agents, "m"),
        MultiAgentReset(dict.fromkeys(reset, o)),
        [
            MultiAgentEnvStep(
                dict.fromkeys(acts, 0), dict.fromkeys(rew, 1.0), dict.fromkeys(obs, o), dict(term), dict(trunc)
            )
            for acts, rew, obs, term, trunc in steps
        ],
        aborted=aborted,
    )


def test_agents_that_cannot_be_rows_are_carried_in_the_record():
    rec = _rec(
        [
            ("ab", "ab", "ab", {}, {}),
            ("a", "a", "a", {"__all__": True}, {}),
        ]
    )
    split = split_recording(rec)
    assert sorted(split.rows) == ["a"] and sorted(split.carried) == ["b", "c"]
    assert len(split.carried["b"]) == 1 and not split.carried["b"].is_done and len(split.carried["c"]) == 0
    cases.assert_same(cases.comparable_state(reference_episode(rec)), cases.comparable_state(_rebuilt(split, "ep-x")))


def test_abort_ends_the_episode_truncated_and_drops_hanging_actions():
    rec = _rec([("ab", "ab", "a", {}, {})], aborted=True)  # b's action hangs
    ep = reference_episode(rec)
    assert ep.is_truncated and not ep.is_terminated and ep._hanging_actions_end == {}
    assert ep.agent_episodes["a"].is_truncated and ep.agent_episodes["b"].is_truncated
    split = split_recording(rec)
    assert sorted(split.rows) == ["a"] and sorted(split.carried) == ["b", "c"]


@pytest.mark.parametrize(
    "steps, kwargs, reason",
    [
        ([("ab", "ab", "ab", {}, {})], {}, "not_done"),
        ([("ab", "ab", "ab", {"a": True}, {}), ("ab", "ab", "ab", {"__all__": True}, {})], {}, "rllib_refused"),
        ([("ab", "ab", "a", {}, {"b": True, "__all__": True})], {}, "rllib_refused"),  # truncated, action hanging
        ([("abz", "ab", "ab", {"__all__": True}, {})], {}, "unknown_agent"),
        ([("abc", "abc", "abc", {"__all__": True}, {}), ("a", "a", "a", {"__all__": True}, {})], {}, "inconsistent"),
        ([("", "", "", {"__all__": True}, {})], {"reset": "ab"}, "no_agent_steps"),
    ],
)
def test_recordings_rllib_refuses_are_data_errors(steps, kwargs, reason):
    rec = _rec(steps, **kwargs)
    with pytest.raises(MultiAgentDataError) as e:
        split_recording(rec)
    assert e.value.reason == reason


@pytest.mark.parametrize(
    "module",
    [
        "rlrec.consumer.multi_agent_reference",
        "rlrec.consumer.multi_agent_split",
        "rlrec.store.multi_agent_episode",
        "rlrec.store.multi_agent_shards",
    ],
)
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.parametrize(
    "steps",
    [
        # a leaves first (terminated), b next (truncated), c ends the episode with __all__
        [
            ("abc", "abc", "abc", {"a": True}, {}),
            ("bc", "bc", "bc", {}, {"b": True}),
            ("c", "c", "c", {"__all__": True}, {}),
        ],
        # no __all__: the last agents' own flags end it (mixed: RLlib says terminated)
        [("abc", "abc", "abc", {}, {"b": True}), ("ac", "ac", "ac", {"a": True}, {"c": True})],
        # __all__ truncated while every agent runs
        [("abc", "abc", "abc", {}, {}), ("abc", "abc", "abc", {}, {"__all__": True})],
    ],
    ids=["leave-one-by-one", "own-flags-only", "all-truncated"],
)
def test_direct_recordings_with_early_exits_equal_the_replay(steps):
    rec = _rec(steps)
    assert is_direct(rec)
    split = split_recording(rec)
    assert split.direct and not split.carried
    cases.assert_same(cases.comparable_state(reference_episode(rec)), cases.comparable_state(_rebuilt(split, "ep-x")))


@pytest.mark.parametrize(
    "modules, reason",
    [
        ({"a": "m/x"}, "bad_module_id"),
        ({"a": "m" * 200}, "bad_module_id"),
        ({"a" * 129: "m"}, "bad_agent_id"),
        ({}, "no_agents"),
    ],
)
def test_ids_that_cannot_be_stored_are_data_errors(modules, reason):
    o = np.zeros(1)
    rec = MultiAgentRecording(
        "e",
        "pol",
        0,
        modules,
        MultiAgentReset(dict.fromkeys(modules, o)),
        [
            MultiAgentEnvStep(
                dict.fromkeys(modules, 0), dict.fromkeys(modules, 0.0), dict.fromkeys(modules, o), {"__all__": True}
            )
        ],
    )
    with pytest.raises(MultiAgentDataError) as e:
        split_recording(rec)
    assert e.value.reason == reason
