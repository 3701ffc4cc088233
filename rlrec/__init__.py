"""rlrec: record RL experience from deployed policies through Kafka into RLlib episode shards.

The public API is re-exported lazily, so `from rlrec import EpisodeRecorder` in a policy
service imports only the producer (no Ray, no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "EpisodeRecorder": "producer.recorder",
    "RecordingWrapper": "producer.wrapper",
    "RecorderStats": "producer.recorder",
    "RecorderFullError": "producer.recorder",
    "RecorderForkedError": "producer.recorder",
    "DecodeError": "producer.events",
    "encode": "producer.events",
    "decode": "producer.events",
    "LocalBroker": "rlrec.local",
    "LocalS3": "rlrec.local",
    "load_policy": "trainer.policy",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlrec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
