"""The artifact of a multi-module version (``rlrec train --multi-agent``): every module's
network in one publication (`rlrec.trainer.policy_modules` loads it)."""

from __future__ import annotations

from typing import Any

from rlrec.producer.spaces import space_to_json
from rlrec.trainer.export import SAFETENSORS_MODEL, PolicyArtifact, build_artifact
from rlrec.trainer.policy_modules import MULTI_MODULE, module_file

__all__ = ["build_modules_artifact"]


def _modules_from_algo(algo: Any) -> dict[str, Any]:
    """Fresh local copies of every RLModule with the Learner's current weights."""
    multi = algo.config.get_multi_rl_module_spec().build()
    multi.set_state(algo.learner_group.get_weights())
    out = {}
    for m, module in multi.items():
        module.eval()
        out[m] = module
    return out


def build_modules_artifact(algo: Any, modules: Any) -> PolicyArtifact:
    """One `PolicyArtifact` holding each stored module's network (safetensors + spec) and the
    agent -> module mapping; ``spec["format"]`` is ``multi_module``.

    Args:
        algo: the trainer's RLlib algorithm (multi-agent).
        modules: `rlrec.trainer.multi_agent.StoredModules` (each module's spaces, the agents).

    Raises:
        ValueError: a module is not a network the spec describes (no TorchScript fallback here),
            or its id cannot name a file.

    Example:
        >>> art = build_modules_artifact(trainer.algo, trainer.modules)  # doctest: +SKIP
        >>> art.spec["format"], sorted(art.spec["modules"])  # doctest: +SKIP
        ('multi_module', ['random', 'scripted'])
    """
    learned = _modules_from_algo(algo)
    files: dict[str, bytes] = {}
    entries: dict[str, dict] = {}
    for m, (obs, act) in sorted(modules.spaces.items()):
        art = build_artifact(learned[m], obs, act)
        if art.fmt != "safetensors":
            raise ValueError(
                f"module {m}: {art.fallback_reason}; a multi-module version holds safetensors networks only"
            )
        name = module_file(m)
        files[name] = art.files[SAFETENSORS_MODEL]
        entries[m] = {
            **art.spec,
            "model": name,
            "observation_space": space_to_json(obs),
            "observation_shape": list(obs.shape),
            "action_space": space_to_json(act),
        }
    spec = {"format": MULTI_MODULE, "modules": entries, "agent_modules": dict(sorted(modules.agents.items()))}
    return PolicyArtifact(MULTI_MODULE, files, spec)
