"""`RecordingWrapper`: records every reset/step of a gymnasium environment through an `EpisodeRecorder`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym

from rlrec.producer.recorder import EpisodeRecorder

__all__ = ["RecordingWrapper"]


class RecordingWrapper(gym.Wrapper):
    """Wraps an env so that each `reset()` begins an episode and each `step()` logs a step.

    Extra model outputs for the *next* step are attached with `set_model_outputs(...)` (e.g.
    `env.set_model_outputs({"action_logp": logp})` right before `env.step(action)`). A `reset()`
    while an episode is still open aborts it (it is recorded as truncated). `close()` aborts the
    open episode and closes the env; the recorder stays open (it belongs to the caller).
    """

    def __init__(self, env: gym.Env, recorder: EpisodeRecorder):
        super().__init__(env)
        self.recorder = recorder
        self.episode_id: str | None = None
        self._pending_outputs: Mapping[str, Any] | None = None

    def set_model_outputs(self, outputs: Mapping[str, Any] | None) -> None:
        """Extra model outputs (`action_logp`, `action_dist_inputs`, ...) recorded with the next step."""
        self._pending_outputs = outputs

    def reset(self, **kwargs: Any):
        obs, info = self.env.reset(**kwargs)
        if self.episode_id is not None:
            self.recorder.abort_episode(self.episode_id, reason="reset")
        self.episode_id = self.recorder.begin_episode(obs, info=info)
        return obs, info

    def step(self, action: Any):
        if self.episode_id is None:
            raise RuntimeError("call reset() before step()")
        obs, reward, terminated, truncated, info = self.env.step(action)
        outputs, self._pending_outputs = self._pending_outputs, None
        self.recorder.log_step(
            self.episode_id,
            action,
            reward,
            obs,
            terminated=terminated,
            truncated=truncated,
            info=info,
            extra_model_outputs=outputs,
        )
        if terminated or truncated:
            self.episode_id = None
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        if self.episode_id is not None:
            self.recorder.abort_episode(self.episode_id, reason="env-closed")
            self.episode_id = None
        super().close()
