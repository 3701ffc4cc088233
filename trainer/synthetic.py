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

import hashlib
import itertools
import uuid

import gymnasium as gym
import numpy as np

from rlrec.store.finished import FinishedEpisode

__all__ = [
    "CONTEXT_BANDIT_ID",
    "ContextBanditEnv",
    "cartpole_expert_action",
    "expert_cartpole_episodes",
    "linear_policy_artifact",
    "logged_episodes",
    "pendulum_episodes",
]

#: gymnasium id of `ContextBanditEnv` (registered when this module is imported)
CONTEXT_BANDIT_ID = "rlrec/ContextBandit-v0"

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
    episode_id=None,
) -> FinishedEpisode:
    T = len(rewards)
    first = next(_offsets)
    for _ in range(T):
        next(_offsets)
    return FinishedEpisode(
        episode_id=episode_id or uuid.uuid4().hex,
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


class ContextBanditEnv(gym.Env):
    """A short-horizon, contextual-bandit-like task for off-policy evaluation.

    Each of `horizon` steps shows a context ``x ~ U(-1, 1)^dim``; action ``a`` (of `n_actions`)
    earns ``x[a] + noise * N(0, 1)`` (so the best action is the largest coordinate); the next
    context is drawn afresh. Registered as ``rlrec/ContextBandit-v0``.

    Args:
        dim: context size (>= n_actions).
        n_actions: actions.
        horizon: steps per episode (the episode terminates after them).
        noise: reward noise.

    Example:
        >>> env = ContextBanditEnv()
        >>> obs, _ = env.reset(seed=0)
        >>> obs.shape, int(env.action_space.n)
        ((4,), 3)
    """

    def __init__(self, dim: int = 4, n_actions: int = 3, horizon: int = 3, noise: float = 0.1) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (dim,), np.float32)
        self.action_space = gym.spaces.Discrete(n_actions)
        self.horizon, self.noise = int(horizon), float(noise)
        self._t = 0
        self._x = np.zeros(dim, np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._t = 0
        self._x = self.np_random.uniform(-1, 1, self.observation_space.shape).astype(np.float32)
        return self._x.copy(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        r = float(self._x[int(action)]) + self.noise * float(self.np_random.standard_normal())
        self._t += 1
        self._x = self.np_random.uniform(-1, 1, self.observation_space.shape).astype(np.float32)
        return self._x.copy(), r, self._t >= self.horizon, False, {}


if CONTEXT_BANDIT_ID not in gym.registry:
    gym.register(CONTEXT_BANDIT_ID, entry_point=ContextBanditEnv)


def linear_policy_artifact(weights: np.ndarray, bias: np.ndarray | None = None) -> tuple[dict, bytes]:
    """A published-format categorical policy with logits ``weights @ obs + bias`` (no Ray).

    Returns ``(spec, model)``: the policy.json fields and the safetensors bytes, as
    `rlrec.trainer.policy.version_from_artifact` and `rlrec.trainer.export.publish_policy` take them.

    Args:
        weights: ``(n_actions, obs_dim)``.
        bias: ``(n_actions,)`` (default zeros).

    Example:
        >>> spec, model = linear_policy_artifact(np.eye(3, 4))
        >>> spec["action_dist"]
        {'type': 'categorical', 'n': 3}
    """
    import torch
    from safetensors.torch import save

    w = np.asarray(weights, dtype=np.float32)
    n, d = w.shape
    b = np.zeros(n, np.float32) if bias is None else np.asarray(bias, dtype=np.float32)
    tensors = {"layers.0.weight": torch.as_tensor(w), "layers.0.bias": torch.as_tensor(b)}
    spec = {
        "format": "safetensors",
        "model": "model.safetensors",
        "action_dist": {"type": "categorical", "n": int(n)},
        "network": {
            "input_dim": int(d),
            "layers": [{"type": "linear", "in": int(d), "out": int(n), "bias": True}],
            "log_std_clip": None,
        },
        "action_space": {"type": "Discrete", "n": int(n)},
        "observation_shape": [int(d)],
    }
    return spec, save(tensors, metadata={"format": "rlrec-policy"})


def _episode_id(*parts: object) -> str:
    """A uuid-like hex id derived from `parts` (reproducible data, reproducible splits)."""
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:32]


def logged_episodes(
    env_id: str,
    spec: dict,
    model: bytes,
    n: int,
    *,
    seed: int = 0,
    policy_id: str = "behaviour",
    policy_version: int = 1,
    explore: bool = True,
    gamma: float = 1.0,
) -> tuple[list[FinishedEpisode], np.ndarray]:
    """`n` episodes of `env_id` played by a published-format policy, logging what a service
    logs (``action_logp``, ``action_dist_inputs`` from `Policy.act`). With `explore` the logged
    ``action_logp`` is the propensity of the sampled action. Episode ids are derived from (env,
    policy id and version, seed, index), so the same data is held out the same way every run.

    Returns the episodes and their discounted returns at `gamma`.

    Example:
        >>> spec, model = linear_policy_artifact(np.eye(3, 4))
        >>> eps, returns = logged_episodes(CONTEXT_BANDIT_ID, spec, model, 2)
        >>> len(eps), eps[0].length
        (2, 3)
    """
    import torch

    from rlrec.trainer.policy import version_from_artifact

    policy = version_from_artifact(spec, model)
    gen = torch.Generator().manual_seed(seed)
    env = gym.make(env_id)
    out, returns = [], []
    for i in range(n):
        obs, _ = env.reset(seed=seed * 1_000_003 + i)
        observations, actions, rewards, logps, inputs = [obs], [], [], [], []
        term = trunc = False
        while not (term or trunc):
            a, extra = policy.act(obs, explore, gen)
            obs, r, term, trunc, _ = env.step(a)
            observations.append(obs)
            actions.append(a)
            rewards.append(r)
            logps.append(extra["action_logp"])
            inputs.append(extra["action_dist_inputs"])
        returns.append(float(np.sum(np.asarray(rewards) * gamma ** np.arange(len(rewards)))))
        extra = {"action_logp": np.asarray(logps, np.float32), "action_dist_inputs": np.asarray(inputs, np.float32)}
        out.append(
            _episode(
                env_id,
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
                episode_id=_episode_id(env_id, policy_id, policy_version, seed, i),
            )
        )
    env.close()
    return out, np.asarray(returns)
