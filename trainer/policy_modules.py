"""Multi-module versions (``rlrec train --multi-agent``): one signed ``policy.json`` of format
``multi_module`` lists each module's network under ``modules`` (its own ``model`` file, network,
action distribution and spaces; the version's ``files`` pin every file) and the recorded
``agent_modules`` mapping. `load_policy(..., module_id=m)` serves module ``m`` as any single
policy; `load_policy(...)` serves all modules: its ``act`` takes per-agent observations.

Torch only, never Ray (as `rlrec.trainer.policy`).
"""

from __future__ import annotations

import re
from typing import Any

from rlrec.trainer.policy_files import MAX_BYTES, SPEC, PolicyLoadError

__all__ = ["MULTI_MODULE", "MultiModuleVersion", "load_modules", "module_file"]

#: ``policy.json``'s ``format`` of a version holding several modules
MULTI_MODULE = "multi_module"
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,100}")  # used with fullmatch: no trailing newline
#: the most modules a version may hold (each is a network loaded whole)
MAX_MODULES = 64
#: what a module's entry may set (the rest of its spec is the version's)
_MODULE_KEYS = {"format", "model", "network", "action_dist", "observation_space", "observation_shape", "action_space"}


def module_file(module_id: str) -> str:
    """The weights file of a module in a multi-module version.

    Args:
        module_id: the module's id (letters, digits, ``_`` and ``-``).

    Example:
        >>> module_file("scripted")
        'model.scripted.safetensors'
    """
    if not (isinstance(module_id, str) and _ID_RE.fullmatch(module_id)):
        raise ValueError(f"module id {module_id!r:.60} cannot name a file of a published version")
    return f"model.{module_id}.safetensors"


class MultiModuleVersion:
    """A loaded multi-module version: each module's loaded network and the agent -> module map.

    ``act(observations)`` takes ``{agent_id: observation}`` and returns ``({agent_id: action},
    {agent_id: extra_model_outputs})``, each agent acted for by its module.
    """

    def __init__(self, spec: dict, modules: dict[str, Any], agent_modules: dict[str, str], signed: bool, files: dict):
        self.spec = spec
        self.modules = modules
        self.agent_modules = agent_modules
        self.signed = signed
        self.files = files
        self.spec_sha256: str | None = None
        self.version = int(spec["policy_version"])
        self.obs_shape = None  # per module: self.modules[m].obs_shape

    def act(self, obs: Any, explore: bool, generator: Any) -> tuple[dict, dict]:
        if not isinstance(obs, dict):
            raise TypeError(
                f"policy v{self.version} holds modules {sorted(self.modules)}: act takes {{agent_id: observation}} "
                "(or load one module with load_policy(..., module_id=...))"
            )
        actions, extras = {}, {}
        for agent_id, o in obs.items():
            m = self.agent_modules.get(agent_id)
            if m not in self.modules:
                raise ValueError(f"agent {agent_id!r:.60} has no module in policy v{self.version}")
            actions[agent_id], extras[agent_id] = self.modules[m].act(o, explore, generator)
        return actions, extras

    def __getattr__(self, name: str) -> Any:  # the single-network methods (OPE, canary) are per module
        raise AttributeError(f"a multi-module policy has no {name}: load one module with module_id=")


def _modules_of(spec: dict, rel_dir: str) -> tuple[dict[str, dict], dict[str, str]]:
    modules, agents = spec.get("modules"), spec.get("agent_modules")
    if spec.get("format") != MULTI_MODULE or not isinstance(modules, dict) or not modules:
        raise PolicyLoadError(f"{rel_dir}/{SPEC} is not a multi-module version (it has no 'modules')")
    if not isinstance(agents, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in agents.items()):
        raise PolicyLoadError(f"{rel_dir}/{SPEC}: 'agent_modules' must map agent ids to module ids")
    if len(modules) > MAX_MODULES:
        raise PolicyLoadError(f"{rel_dir}/{SPEC} lists {len(modules)} modules, over the limit of {MAX_MODULES}")
    for m, entry in modules.items():
        if not (isinstance(m, str) and _ID_RE.fullmatch(m)) or not isinstance(entry, dict) or set(entry) - _MODULE_KEYS:
            raise PolicyLoadError(f"{rel_dir}/{SPEC}: module {m!r:.60} is not a module entry")
        if entry.get("format") != "safetensors":
            raise PolicyLoadError(f"{rel_dir}/{SPEC}: module {m!r:.60} is not a safetensors network")
        if entry.get("model") != module_file(m):  # each module its own file, named after it
            raise PolicyLoadError(f"{rel_dir}/{SPEC}: module {m!r:.60}'s model is not {module_file(m)}")
    unknown = sorted(set(agents.values()) - set(modules))
    if unknown:
        raise PolicyLoadError(
            f"{rel_dir}/{SPEC}: 'agent_modules' names module {unknown[0]!r:.60}, which it does not hold"
        )
    return modules, agents


class _Budget:
    """`files` whose reads together may return at most `limit` bytes (a whole multi-module
    version's networks are bounded as one network is: ``MAX_BYTES["model"]``)."""

    def __init__(self, files: Any, limit: int) -> None:
        self._files, self._left = files, limit

    def read(self, rel: str, max_bytes: int) -> bytes:
        if self._left <= 0:
            raise PolicyLoadError(f"{rel}: the version's networks hold more than {MAX_BYTES['model']} bytes: refused")
        data = self._files.read(rel, min(max_bytes, self._left))
        self._left -= len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._files, name)


def load_modules(files: Any, rel_dir: str, spec: dict, signed: bool, trust: Any, check: Any) -> Any:
    """Load a verified multi-module ``policy.json`` (`spec`): the module ``trust.module_id`` as
    a single network, or (None) every module as a `MultiModuleVersion`."""
    from rlrec.trainer.policy_verify import _load_verified

    modules, agents = _modules_of(spec, rel_dir)
    base = {k: v for k, v in spec.items() if k not in ("modules", "agent_modules", "format")}
    m = trust.module_id
    if m is not None:
        if m not in modules:
            raise PolicyLoadError(f"{rel_dir} holds modules {sorted(modules)}, not {m!r:.60}")
        return _load_verified(files, rel_dir, {**base, **modules[m], "module_id": m}, signed, trust, check)
    if check is not None:
        check(spec, rel_dir, signed)
    budget = _Budget(files, MAX_BYTES["model"])
    loaded = {
        mid: _load_verified(budget, rel_dir, {**base, **entry, "module_id": mid}, signed, trust, None)
        for mid, entry in sorted(modules.items())
    }
    return MultiModuleVersion(spec, loaded, dict(agents), signed, next(iter(loaded.values())).files)
