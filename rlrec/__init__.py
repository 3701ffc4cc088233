"""rlrec: record RL experience from deployed policies through Kafka into RLlib episode shards.

The public API is re-exported lazily, so `from rlrec import EpisodeRecorder` in a policy
service imports only the producer (no Ray, no torch). Subpackages: `rlrec.producer` (the event
contract and the policy-side client), `rlrec.store` (storage, manifest, shard formats),
`rlrec.consumer` (episode assembly and shard writing), `rlrec.trainer` (continuous training and
published policies); see docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from rlrec._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "EpisodeRecorder": "rlrec.producer.recorder",
    "RecordingWrapper": "rlrec.producer.wrapper",
    "MultiAgentRecordingWrapper": "rlrec.producer.multi_agent_wrapper",
    "RecordingVectorWrapper": "rlrec.producer.vector",
    "RecorderStats": "rlrec.producer.recorder",
    "RecorderFullError": "rlrec.producer.recorder",
    "RecorderClosed": "rlrec.producer.recorder",
    "RecorderForkedError": "rlrec.producer.recorder",
    "DecodeError": "rlrec.producer.events",
    "encode": "rlrec.producer.events",
    "decode": "rlrec.producer.events",
    "load_policy": "rlrec.trainer.policy",
    "open": "rlrec.reading",
}

# `rlrec.open` (as-of reads of a store) is left out of `*`: it would shadow the builtin `open`
__all__ = sorted(set(_EXPORTS) - {"open"})
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
