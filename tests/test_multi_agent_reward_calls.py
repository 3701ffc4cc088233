"""Recorder calls that mix episode kinds, and delayed multi-agent rewards: each call checks, when
it is made, everything the fold will check, and a refused call records nothing."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces as gs

from rlrec.producer import EpisodeRecorder
from tests.test_recorder import NOWHERE, QUIET

BOX = gs.Box(-1.0, 1.0, (2,), np.float32)
ACT = gs.Discrete(3)
Z = np.zeros(2, np.float32)
SPACES = {"observation_spaces": {"a": BOX, "b": BOX}, "action_spaces": {"a": ACT, "b": ACT}}


def _recorder(**kw) -> EpisodeRecorder:
    return EpisodeRecorder(NOWHERE, "t", observation_space=BOX, action_space=ACT, kafka_config=QUIET, **kw)


@pytest.mark.parametrize("mixed", [False, True])
def test_log_steps_with_a_multi_agent_id_records_nothing(mixed):
    rec = _recorder()
    try:
        sa = rec.begin_episode(Z)
        ma = rec.begin_multi_agent_episode({"a": Z, "b": Z}, **SPACES)
        rec.log_multi_agent_step(ma, {"a": Z}, {"a": 1}, {"a": 1.0}, {}, {})
        before = rec.stats.produced
        ids = [sa, ma] if mixed else [ma]
        n = len(ids)
        for extra in (None, {"action_logp": np.full(n, -1.0)}):
            with pytest.raises(ValueError, match="is a multi-agent episode"):
                rec.log_steps(ids, [1] * n, [1.0] * n, [Z] * n, [False] * n, [False] * n, extra_model_outputs=extra)
        assert rec.stats.produced == before
        assert len(rec._episodes[ma].steps) == 1 and len(rec._episodes[sa].steps) == 0
        assert rec.log_multi_agent_step(ma, {"a": Z}, {"a": 1}, {"a": 1.0}, {"__all__": True}, {}) is True
        rec.log_steps([sa], [1], [1.0], [Z], [False], [False])  # single-agent rows still work
        assert rec.stats.produced == before + 2
    finally:
        rec.close(timeout=0)


def test_delayed_rewards_are_refused_where_the_fold_would_refuse_them():
    rec = _recorder(max_batch_steps=1)  # every env step is sent at once
    try:
        ma = rec.begin_multi_agent_episode({"a": Z, "b": Z}, **SPACES)
        rec.log_multi_agent_step(ma, {"a": Z}, {"a": 1, "b": 1}, {"a": 1.0}, {}, {})  # b's action hangs
        before = rec.stats.produced
        with pytest.raises(ValueError, match="got no reward at env step 0"):
            rec.log_multi_agent_reward(ma, 0, "b", 1.0)  # a sent env step
        rec.log_multi_agent_reward(ma, 0, "a", 1.0)
        assert rec.stats.produced == before + 1  # a RewardDelta/2
        rec.log_multi_agent_step(ma, {"a": Z, "b": Z}, {"a": 1}, {"a": 1.0, "b": 0.5}, {"__all__": True}, {})
        before = rec.stats.produced
        for t, agent, match in ((0, "b", "no reward"), (1, "zz", "not a possible agent"), (2, "a", "2 env steps")):
            with pytest.raises(ValueError, match=match):
                rec.log_multi_agent_reward(ma, t, agent, 1.0)  # a finished episode
        with pytest.raises(ValueError, match="use log_multi_agent_reward"):
            rec.log_reward(ma, 0, 1.0)
        sa = rec.begin_episode(Z)
        rec.log_step(sa, 1, 1.0, Z, terminated=True)
        before = rec.stats.produced
        with pytest.raises(ValueError, match="use log_reward"):
            rec.log_multi_agent_reward(sa, 0, "a", 1.0)
        assert rec.stats.produced == before
    finally:
        rec.close(timeout=0)


def test_a_delayed_reward_that_makes_a_buffered_reward_infinite_is_refused():
    rec = _recorder()
    try:
        ma = rec.begin_multi_agent_episode({"a": Z, "b": Z}, **SPACES)
        rec.log_multi_agent_step(ma, {"a": Z}, {"a": 1}, {"a": 1e308}, {}, {})
        with pytest.raises(ValueError, match="not finite"):
            rec.log_multi_agent_reward(ma, 0, "a", 1e308)
        assert rec._episodes[ma].steps[0][1]["a"][3] == 1e308
    finally:
        rec.close(timeout=0)


def test_a_dropped_multi_agent_episode_remembers_its_full_length():
    rec = _recorder(on_overflow="drop", max_buffered_steps=4, max_batch_steps=100)
    try:
        ma = rec.begin_multi_agent_episode({"a": Z}, **{k: {"a": v["a"]} for k, v in SPACES.items()})
        for t in range(7):
            rec.log_multi_agent_step(ma, {"a": Z}, {"a": 1}, {"a": 1.0}, {"__all__": t == 6}, {})
        assert ma not in rec._episodes
        rec.log_multi_agent_reward(ma, 6, "a", 1.0)  # the last env step exists
        with pytest.raises(ValueError, match="7 env steps"):
            rec.log_multi_agent_reward(ma, 7, "a", 1.0)
    finally:
        rec.close(timeout=0)
