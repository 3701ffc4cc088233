"""`unusable_reason`: which decoded episodes the trainer skips (checked against the module's spaces).
The trainer end to end (skipped and counted, training goes on): tests/test_trainer_hostile.py."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("ray.rllib")

from rlrec.store.episodes import pack_episode, to_single_agent_episode, unpack_episode
from rlrec.trainer.episode_check import unusable_reason
from rlrec.trainer.synthetic import expert_cartpole_episodes, pendulum_episodes

CARTPOLE = (gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), gym.spaces.Discrete(2))


def _decoded(fe):
    return unpack_episode(pack_episode(to_single_agent_episode(fe)))


def test_good_episodes_are_usable():
    (fe,) = expert_cartpole_episodes(1, max_steps=30)
    assert unusable_reason(_decoded(fe), *CARTPOLE) is None
    (pe,) = pendulum_episodes(1, max_steps=30)
    env = gym.make("Pendulum-v1")
    assert unusable_reason(_decoded(pe), env.observation_space, env.action_space) is None


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda fe: fe.actions[0].__setitem__(3, 7), "actions holds 7, outside Discrete(2)"),
        (lambda fe: fe.actions[0].__setitem__(0, -1), "outside Discrete(2)"),
        (lambda fe: fe.observations[0].__setitem__((2, 1), np.nan), "observations holds NaN"),
        (lambda fe: fe.observations[0].__setitem__((2, 1), np.inf), "observations holds NaN or infinite"),
        (lambda fe: fe.rewards.__setitem__(1, np.nan), "rewards"),
    ],
)
def test_unusable_episodes_name_the_problem(damage, reason):
    (fe,) = expert_cartpole_episodes(1, max_steps=30)
    damage(fe)
    assert reason in (unusable_reason(_decoded(fe), *CARTPOLE) or "")


def test_shapes_must_fit_the_module_spaces():
    (fe,) = expert_cartpole_episodes(1, max_steps=30)
    ep = _decoded(fe)
    other = gym.spaces.Box(-1, 1, (5,), np.float32)
    assert "shape" in unusable_reason(ep, other, CARTPOLE[1])
    assert "shape" in unusable_reason(ep, gym.spaces.Box(-1, 1, (1, 4), np.float32), CARTPOLE[1])
