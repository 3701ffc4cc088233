"""rlrec trainer: continuous offline training on committed shards, and published policies.

`from rlrec.trainer import load_policy` needs torch only (never Ray); the Ray side
(`rlrec.trainer.data`, `.service`, `.export`) is imported only when used.
"""

from __future__ import annotations

from rlrec._lazy import lazy_exports

_EXPORTS = {
    "load_policy": "rlrec.trainer.policy",
    "Policy": "rlrec.trainer.policy",
    "PolicyLoadError": "rlrec.trainer.policy",
    "TrainerConfig": "rlrec.trainer.config",
    "ContinuousTrainer": "rlrec.trainer.service",
    "ManifestOfflineData": "rlrec.trainer.data",
    "SafeOfflinePreLearner": "rlrec.trainer.data",
    "configure_continuous": "rlrec.trainer.data",
    "FeedPolicy": "rlrec.trainer.feed",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
