"""rlrec's policy-side client and the event contract. Imports neither Ray nor torch.

    from producer import EpisodeRecorder, RecordingWrapper      # or: from rlrec import ...
"""

from producer.events import DecodeError, EpisodeAbort, EpisodeStart, RewardDelta, StepBatch, decode, encode
from producer.recorder import EpisodeRecorder, RecorderForkedError, RecorderFullError, RecorderStats
from producer.wrapper import RecordingWrapper

__all__ = [
    "EpisodeRecorder",
    "RecordingWrapper",
    "RecorderStats",
    "RecorderFullError",
    "RecorderForkedError",
    "DecodeError",
    "EpisodeStart",
    "StepBatch",
    "RewardDelta",
    "EpisodeAbort",
    "encode",
    "decode",
]
