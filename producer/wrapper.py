"""`RecordingWrapper`: records every reset/step of a gymnasium environment through an `EpisodeRecorder`."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Mapping
from typing import Any

import gymnasium as gym

from rlrec.producer.recorder import EpisodeRecorder, RecorderClosed

__all__ = ["RecordingWrapper"]


class RecordingWrapper(gym.Wrapper):
    """Wraps an env so that each `reset()` begins an episode and each `step()` logs a step.

    Extra model outputs for the *next* step are attached with `set_model_outputs(...)` (e.g.
    `env.set_model_outputs({"action_logp": logp})` right before `env.step(action)`); a `reset()`
    forgets them. An episode gets its id (`episode_id`) at `reset()` and is begun (its
    EpisodeStart sent) at its first step: an episode that never steps - reset, then reset again
    or closed, as a vector env's autoreset leaves one at shutdown - records nothing. A `reset()`
    while an episode is still open aborts it (it is recorded as truncated). `close()` aborts the
    open episode and closes the env; the recorder stays open (it belongs to the caller).

    When the recorder refuses a step (an invalid value - e.g. a reward that is not finite - or a
    full buffer with ``on_overflow="raise"``), the wrapper aborts the episode, so what was
    recorded ends there as truncated instead of going on with a step missing, re-raises the
    error, and records nothing more of that episode (its further steps pass through unrecorded).

    Under `gymnasium.vector.AsyncVectorEnv` each worker process needs its own recorder (create
    it in the env function): a recorder created before the worker was forked raises
    `RecorderForkedError` there.
    """

    def __init__(self, env: gym.Env, recorder: EpisodeRecorder):
        super().__init__(env)
        self.recorder = recorder
        self.episode_id: str | None = None
        self._start: tuple[Any, Any] | None = None  # (observation, info) of an episode not begun yet
        self._pending_outputs: Mapping[str, Any] | None = None
        self._refused = False  # the recorder refused a step of the open episode: it is not recorded

    def set_model_outputs(self, outputs: Mapping[str, Any] | None) -> None:
        """Extra model outputs (`action_logp`, `action_dist_inputs`, ...) recorded with the next step."""
        self._pending_outputs = outputs

    def reset(self, **kwargs: Any):
        obs, info = self.env.reset(**kwargs)
        self._pending_outputs = None
        if self.episode_id is not None and self._start is None and not self._refused:
            self.recorder.abort_episode(self.episode_id, reason="reset")
        self._refused = False
        self.episode_id = uuid.uuid4().hex
        self._start = (copy.deepcopy(obs), copy.deepcopy(info))  # the env may reuse its arrays
        return obs, info

    def step(self, action: Any):
        if self.episode_id is None:
            raise RuntimeError("call reset() before step()")
        obs, reward, terminated, truncated, info = self.env.step(action)
        outputs, self._pending_outputs = self._pending_outputs, None
        if not self._refused:
            try:
                if self._start is not None:
                    start_obs, start_info = self._start
                    self.recorder.begin_episode(start_obs, info=start_info, episode_id=self.episode_id)
                    self._start = None
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
            except (ValueError, TypeError, BufferError):  # refused: nothing of this step was recorded
                self._refuse()
                if terminated or truncated:
                    self.episode_id = None
                raise
        if terminated or truncated:
            self.episode_id = None
        return obs, reward, terminated, truncated, info

    def _refuse(self) -> None:
        """The recorder refused a step: abort the episode if it was begun; record no more of it."""
        if self._start is None:
            try:
                self.recorder.abort_episode(self.episode_id, reason="refused-step")
            except (ValueError, RecorderClosed):  # the recorder ended or aborted it already
                pass
        self._start = None
        self._refused = True

    def close(self) -> None:
        if self.episode_id is not None and self._start is None and not self._refused:
            self.recorder.abort_episode(self.episode_id, reason="env-closed")
        self.episode_id, self._start = None, None
        super().close()
