"""rlrec's policy-side client and the event contract. Imports neither Ray nor torch.

from rlrec.producer import EpisodeRecorder, RecordingWrapper      # or: from rlrec import ...
from rlrec.producer import RecordingVectorWrapper                 # a gymnasium vector env
from rlrec.producer import MultiAgentRecordingWrapper             # PettingZoo, RLlib MultiAgentEnv
"""

from rlrec.producer.events import DecodeError, EpisodeAbort, EpisodeStart, RewardDelta, StepBatch, decode, encode
from rlrec.producer.multi_agent_wrapper import MultiAgentRecordingWrapper
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
    "MultiAgentRecordingWrapper",
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
