"""Export the trained RLModule as a self-contained TorchScript policy and publish it.

See `rlrec.trainer.policy` for the layout and the loader. This module runs in the trainer (Ray side).
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from typing import Any

import gymnasium as gym
import numpy as np

from rlrec.producer.spaces import space_to_json
from rlrec.store.storage import Storage
from rlrec.trainer.policy import LATEST, LINEAGE, MODEL, SPEC

__all__ = ["action_dist_name", "export_module", "publish_policy"]

_DISTS = {
    "TorchCategorical": "categorical",
    "TorchDiagGaussian": "diag_gaussian",
    "TorchSquashedGaussian": "squashed_gaussian",
}


def action_dist_name(module: Any) -> str:
    cls = module.get_inference_action_dist_cls()
    name = getattr(cls, "__name__", str(cls))
    for k, v in _DISTS.items():
        if k in name:
            return v
    raise ValueError(f"cannot export a policy with action distribution {name}")


def _module_from_algo(algo: Any) -> Any:
    """A fresh local copy of the default RLModule with the Learner's current weights."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    spec = algo.offline_data.module_spec if algo.offline_data is not None else None
    if spec is None:
        spec = algo.config.get_multi_rl_module_spec(
            spaces={DEFAULT_MODULE_ID: (algo.config.observation_space, algo.config.action_space)}
        )
    multi = spec.build()
    weights = algo.learner_group.get_weights()
    multi.set_state(weights)
    module = multi[DEFAULT_MODULE_ID]
    module.eval()
    return module


def export_module(module: Any, observation_space: gym.Space) -> bytes:
    """TorchScript (traced) of obs batch -> action distribution inputs, as bytes."""
    import torch
    from ray.rllib.core.columns import Columns

    class _Export(torch.nn.Module):
        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            return self.m._forward_inference({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]

    example = torch.as_tensor(np.stack([observation_space.sample() for _ in range(2)]).astype(np.float32))
    wrapper = _Export(module).eval()
    with torch.no_grad():
        traced = torch.jit.trace(wrapper, example, check_trace=False)
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    return buf.getvalue()


def publish_policy(
    storage: Storage,
    *,
    algo: Any,
    version: int,
    algo_name: str,
    observation_space: gym.Space,
    action_space: gym.Space,
    iteration: int,
    timesteps_trained: int,
    shards: list[str],
    new_shards: list[str],
    parent_version: int | None,
) -> dict:
    """Write ``v{version}/{model.pt,policy.json,lineage.json}`` then ``latest.json``."""
    if not isinstance(observation_space, gym.spaces.Box):
        raise ValueError(f"publishing needs a Box observation space, got {observation_space}")
    module = _module_from_algo(algo)
    dist = action_dist_name(module)
    model = export_module(module, observation_space)
    d = f"v{version:06d}"
    spec = {
        "policy_version": version,
        "algo": algo_name,
        "action_dist": dist,
        "observation_space": space_to_json(observation_space),
        "observation_shape": list(observation_space.shape),
        "action_space": space_to_json(action_space),
        "model": MODEL,
        "model_sha256": hashlib.sha256(model).hexdigest(),
        "format": "torchscript",
        "iteration": iteration,
        "timesteps_trained": timesteps_trained,
        "parent_version": parent_version,
        "shards_trained": len(shards),
        "time": time.time(),
    }
    lineage = {
        "policy_version": version,
        "parent_version": parent_version,
        "iteration": iteration,
        "shards": sorted(shards),
        "new_shards": sorted(new_shards),
    }
    spec_bytes = json.dumps(spec, indent=1, sort_keys=True).encode()
    storage.write(f"{d}/{MODEL}", model)
    storage.write(f"{d}/{LINEAGE}", json.dumps(lineage).encode())
    storage.write(f"{d}/{SPEC}", spec_bytes)
    latest = {
        "policy_version": version,
        "path": d,
        "sha256": hashlib.sha256(spec_bytes).hexdigest(),
        "time": spec["time"],
    }
    storage.write(LATEST, json.dumps(latest, sort_keys=True).encode())
    return spec
