"""Can the trainer use this episode? Checked against the spaces the RLModule is built for.

A shard may hold episodes that decode fine but break training: an action outside the declared
action space (action 7 for ``Discrete(2)`` made RLlib's ``TorchCategorical.logp`` fail with
"index out of bounds" inside the Learner), NaN or infinite observations, actions or rewards, or
arrays whose shapes do not fit the spaces. `unusable_reason` names the first such problem (None:
usable); `SafeOfflinePreLearner` skips those episodes and counts them instead of crashing.
No Ray import here (episodes are duck-typed `SingleAgentEpisode`s).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["unusable_reason"]


def _leaves(space: gym.Space, value: Any, what: str) -> list[tuple[gym.Space, np.ndarray, str]]:
    if isinstance(space, gym.spaces.Dict):
        if not isinstance(value, dict) or set(value) != set(space.spaces):
            raise ValueError(f"{what}: keys do not match the Dict space")
        return [leaf for k, s in space.spaces.items() for leaf in _leaves(s, value[k], f"{what}.{k}")]
    if isinstance(space, gym.spaces.Tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(space.spaces):
            raise ValueError(f"{what}: does not match the Tuple space")
        return [leaf for i, s in enumerate(space.spaces) for leaf in _leaves(s, value[i], f"{what}[{i}]")]
    return [(space, np.asarray(value), what)]


def _check_leaf(space: gym.Space, a: np.ndarray, n: int, what: str) -> str | None:
    if a.dtype.kind not in "biuf":
        return f"{what} has dtype {a.dtype}"
    if a.shape != (n, *space.shape):
        return f"{what} has shape {list(a.shape)}, the space needs {[n, *space.shape]}"
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        return f"{what} holds NaN or infinite values"
    if isinstance(space, gym.spaces.Discrete):
        lo, hi = int(space.start), int(space.start + space.n - 1)
        if a.dtype.kind == "f" and not np.array_equal(a, np.round(a)):
            return f"{what} holds non-integer values for {space}"
        if n and (a.min() < lo or a.max() > hi):
            return f"{what} holds {a.max() if a.max() > hi else a.min()}, outside {space}"
    elif isinstance(space, gym.spaces.MultiDiscrete):
        if n and ((a < space.start).any() or (a >= space.start + space.nvec).any()):
            return f"{what} holds values outside {space}"
    elif isinstance(space, gym.spaces.MultiBinary) and n and not np.isin(a, (0, 1)).all():
        return f"{what} holds values other than 0/1"
    return None


def _check(space: gym.Space, data: Any, n: int, what: str) -> str | None:
    try:
        leaves = _leaves(space, data, what)
    except ValueError as e:
        return str(e)
    for s, a, w in leaves:
        reason = _check_leaf(s, a, n, w)
        if reason:
            return reason
    return None


def unusable_reason(ep: Any, observation_space: gym.Space | None, action_space: gym.Space | None) -> str | None:
    """Why the trainer cannot use `ep` (a `SingleAgentEpisode`), or None if it can.

    Checks, against the given spaces (those the RLModule was built for, not the episode's own):
    T >= 1 steps and done; observations (T+1 of them) and actions (T) of the space's structure,
    shapes and value ranges (Discrete/MultiDiscrete/MultiBinary bounds); no NaN or infinite
    values in observations, actions or rewards."""
    n = len(ep)
    if n < 1:
        return "the episode has no steps"
    if not ep.is_done:
        return "the episode is neither terminated nor truncated"
    rewards = np.asarray(ep.get_rewards(), dtype=np.float64)
    if rewards.shape != (n,) or not np.isfinite(rewards).all():
        return "rewards are not n finite numbers"
    if observation_space is not None:
        reason = _check(observation_space, _stacked(ep.get_observations(), observation_space), n + 1, "observations")
        if reason:
            return reason
    if action_space is not None:
        reason = _check(action_space, _stacked(ep.get_actions(), action_space), n, "actions")
        if reason:
            return reason
    return None


def _stacked(data: Any, space: gym.Space) -> Any:
    """List-form episodes hold one structure per step; numpy-form ones stacked arrays."""
    if isinstance(data, list):
        if isinstance(space, gym.spaces.Dict):
            return {k: _stacked([d[k] for d in data], s) for k, s in space.spaces.items()}
        if isinstance(space, gym.spaces.Tuple):
            return tuple(_stacked([d[i] for d in data], s) for i, s in enumerate(space.spaces))
        return np.asarray(data)
    return data
