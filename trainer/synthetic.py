"""Scripted-expert episodes and committed shards, for tests, the benchmark and demos.

`expert_cartpole_episodes` plays CartPole-v1 with the scripted controller
``action = int(obs[2] + 0.5 * obs[3] > 0)`` (balances to the 500-step limit);
`pendulum_episodes` plays Pendulum-v1 with a simple energy/PD controller (continuous
actions, for CQL/IQL). Commit them with `rlrec.store.commit.ShardCommitter`, exactly the way the consumer does (stage, manifest append, publish), so a trainer
reading the manifest cannot tell the difference::

    c = ShardCommitter(uri); c.claim(); c.commit(expert_cartpole_episodes(10)).entries

No Ray here (only gymnasium, numpy and the store).
"""

from __future__ import annotations

import itertools
import uuid

import gymnasium as gym
import numpy as np

from rlrec.store.finished import FinishedEpisode

__all__ = ["cartpole_expert_action", "expert_cartpole_episodes", "pendulum_episodes"]

_offsets = itertools.count(1)


def cartpole_expert_action(obs: np.ndarray) -> int:
    return int(obs[2] + 0.5 * obs[3] > 0)


def _episode(
    env_id,
    obs_space,
    act_space,
    observations,
    actions,
    rewards,
    terminated,
    truncated,
    *,
    policy_id,
    policy_version,
    extra=None,
) -> FinishedEpisode:
    T = len(rewards)
    first = next(_offsets)
    for _ in range(T):
        next(_offsets)
    return FinishedEpisode(
        episode_id=uuid.uuid4().hex,
        policy_id=policy_id,
        policy_version=policy_version,
        env_id=env_id,
        observation_space=obs_space,
        action_space=act_space,
        observations=[np.asarray(observations, dtype=obs_space.dtype)],
        actions=[np.asarray(actions, dtype=act_space.dtype).reshape((T, *act_space.shape))],
        rewards=np.asarray(rewards, dtype=np.float64),
        infos=[{} for _ in range(T + 1)],
        extra_model_outputs=dict(extra or {}),
        terminated=bool(terminated),
        truncated=bool(truncated),
        first_offset=first,
        last_offset=first + T,
        started_ms=0,
        ended_ms=0,
    )


def expert_cartpole_episodes(
    n: int,
    *,
    seed: int = 0,
    policy_id: str = "expert",
    policy_version: int = 1,
    epsilon: float = 0.0,
    max_steps: int = 500,
    with_logp: bool = True,
) -> list[FinishedEpisode]:
    """`n` CartPole-v1 episodes of the scripted expert (with probability `epsilon` a random action)."""
    env = gym.make("CartPole-v1", max_episode_steps=max_steps)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        obs, _ = env.reset(seed=seed * 100_003 + i)
        observations, actions, rewards = [obs], [], []
        term = trunc = False
        while not (term or trunc):
            a = cartpole_expert_action(obs)
            if epsilon and rng.random() < epsilon:
                a = int(rng.integers(0, 2))
            obs, r, term, trunc, _ = env.step(a)
            observations.append(obs)
            actions.append(a)
            rewards.append(r)
        extra = {"action_logp": np.full(len(actions), np.log(1 - epsilon / 2 + 1e-9), np.float32)} if with_logp else {}
        out.append(
            _episode(
                "CartPole-v1",
                env.observation_space,
                env.action_space,
                observations,
                actions,
                rewards,
                term,
                trunc,
                policy_id=policy_id,
                policy_version=policy_version,
                extra=extra,
            )
        )
    env.close()
    return out


def pendulum_episodes(
    n: int,
    *,
    seed: int = 0,
    policy_id: str = "pendulum",
    policy_version: int = 1,
    noise: float = 0.3,
    max_steps: int = 200,
) -> list[FinishedEpisode]:
    """`n` Pendulum-v1 episodes of an energy-pumping + PD controller with Gaussian action noise."""
    env = gym.make("Pendulum-v1", max_episode_steps=max_steps)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        obs, _ = env.reset(seed=seed * 100_003 + i)
        observations, actions, rewards = [obs], [], []
        term = trunc = False
        while not (term or trunc):
            cos, sin, thdot = (float(x) for x in obs)
            th = np.arctan2(sin, cos)
            if cos > 0.8:  # near upright: PD
                u = -10.0 * th - 1.0 * thdot
            else:  # pump energy
                energy = 0.5 * thdot**2 + 10.0 * (cos - 1.0)
                u = 2.0 * np.sign(thdot * energy if energy < 0 else -thdot) if thdot != 0 else 2.0
            u = float(np.clip(u + noise * rng.standard_normal(), -2.0, 2.0))
            obs, r, term, trunc, _ = env.step(np.array([u], np.float32))
            observations.append(obs)
            actions.append([u])
            rewards.append(r)
        out.append(
            _episode(
                "Pendulum-v1",
                env.observation_space,
                env.action_space,
                observations,
                actions,
                rewards,
                term,
                trunc,
                policy_id=policy_id,
                policy_version=policy_version,
            )
        )
    env.close()
    return out
