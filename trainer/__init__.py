"""rlrec trainer: continuous offline training on committed shards, and published policies.

`from trainer import load_policy` needs torch only (never Ray); the Ray side (`trainer.data`,
`trainer.service`, `trainer.export`) is imported only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_policy": "trainer.policy",
    "Policy": "trainer.policy",
    "PolicyLoadError": "trainer.policy",
    "TrainerConfig": "trainer.service",
    "ContinuousTrainer": "trainer.service",
    "ManifestOfflineData": "trainer.data",
    "SafeOfflinePreLearner": "trainer.data",
    "configure_continuous": "trainer.data",
    "FeedPolicy": "trainer.feed",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
