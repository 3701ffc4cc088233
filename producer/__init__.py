"""rlrec's policy-side client and the event contract. Imports neither Ray nor torch.

from rlrec.producer import EpisodeRecorder, RecordingWrapper      # or: from rlrec import ...
from rlrec.producer import RecordingVectorWrapper                 # a gymnasium vector env
"""

from rlrec.producer.events import DecodeError, EpisodeAbort, EpisodeStart, RewardDelta, StepBatch, decode, encode
from rlrec.producer.recorder import (
    EpisodeRecorder,
    RecorderClosed,
    RecorderForkedError,
    RecorderFullError,
    RecorderReentryError,
    RecorderStats,
)
from rlrec.producer.vector import RecordingVectorWrapper
from rlrec.producer.wrapper import RecordingWrapper

__all__ = [
    "DecodeError",
    "EpisodeAbort",
    "EpisodeRecorder",
    "EpisodeStart",
    "RecorderClosed",
    "RecorderForkedError",
    "RecorderFullError",
    "RecorderReentryError",
    "RecorderStats",
    "RecordingVectorWrapper",
    "RecordingWrapper",
    "RewardDelta",
    "StepBatch",
    "decode",
    "encode",
]
