"""The promotion gate: publish a candidate policy only if it is not worse than the deployed one.

`evaluate_exported` plays the *exported* candidate -- the artifact a deployed service would load
(safetensors + network spec, rebuilt in plain torch exactly as `load_policy` rebuilds it; or the
TorchScript fallback), acting greedily -- for N episodes of the gymnasium env on fixed seeds, so
the candidate and the deployed version are measured on the same starts and exactly what would be
deployed is measured (RLlib's own evaluation metrics are smoothed over past evaluation rounds).
`decide` compares it with the deployed version's return. Torch + gymnasium only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["Promotion", "decide", "evaluate_exported", "export_candidate"]


@dataclass
class Promotion:
    """One gate decision, as recorded in metrics.jsonl under ``"promotion"``."""

    candidate_version: int
    candidate_return: float
    deployed_version: int | None
    deployed_return: float | None
    promoted: bool

    def to_dict(self) -> dict:
        return asdict(self)


def decide(
    candidate_version: int, candidate_return: float, deployed_version: int | None, deployed_return: float | None
) -> Promotion:
    """Promote unless the candidate's return is lower than the deployed one (None: nothing to beat)."""
    ok = deployed_return is None or candidate_return >= deployed_return
    return Promotion(
        candidate_version,
        float(candidate_return),
        deployed_version,
        None if deployed_return is None else float(deployed_return),
        ok,
    )


def export_candidate(algo: Any, observation_space: Any, action_space: Any) -> Any:
    """The `PolicyArtifact` the trainer would publish now (Learner weights)."""
    from rlrec.trainer.export import _module_from_algo, build_artifact

    return build_artifact(_module_from_algo(algo), observation_space, action_space)


def evaluate_exported(
    model: bytes,
    spec: dict,
    env_id: str,
    episodes: int,
    seed: int = 0,
    gamma: float = 1.0,
    explore: bool = False,
) -> float:
    """Mean return of `episodes` greedy episodes of the exported `model` (its weights file's bytes)
    described by `spec` (``format``, ``action_dist``, ``action_space``, ``observation_shape`` and,
    for safetensors, ``network``: the fields of policy.json). `gamma` < 1: the mean discounted
    return (what off-policy estimates estimate); `explore`: sample actions instead."""
    import gymnasium as gym
    import torch

    from rlrec.trainer.policy import version_from_artifact

    policy = version_from_artifact(spec, model)
    generator = torch.Generator().manual_seed(seed)
    env = gym.make(env_id)
    returns = []
    try:
        for k in range(max(1, int(episodes))):
            obs, _ = env.reset(seed=seed + k)
            total, done, discount = 0.0, False, 1.0
            while not done:
                action, _ = policy.act(obs, explore, generator)
                obs, reward, terminated, truncated, _ = env.step(action)
                total += discount * float(reward)
                discount *= gamma
                done = terminated or truncated
            returns.append(total)
    finally:
        env.close()
    return float(np.mean(returns))
