"""`RecordingVectorWrapper`: records every sub-env of a gymnasium vector env as canonical episodes,
one batched recorder call per vector step, in each of gymnasium's autoreset modes.

What a sub-env's stream means depends on the vector env's `autoreset_mode`:

  NEXT_STEP  the call after a sub-env's last step resets it: it returns the reset observation
             and info, reward 0, flags False, and ignores the action. That row is no transition:
             it begins the sub-env's next episode; its action and model outputs are dropped.
  SAME_STEP  the last step's call already resets the sub-env: its observation is the next
             episode's reset observation, the true last observation and info are in
             ``info["final_obs"]``/``info["final_info"]``: those are recorded as the last step.
  DISABLED   the caller resets finished sub-envs with ``reset(options={"reset_mask": m})``;
             only the masked rows begin episodes (the mask is read before the vector env sees
             it: `SyncVectorEnv.reset` pops it from the caller's dict).

An episode is begun (its EpisodeStart sent) at its first step, so an episode that never steps -
reset and then closed, or reset again - records nothing, and the consumer has nothing to
dead-letter. A full `reset()` aborts every open episode (reason ``reset``), `close()` too (reason
``close``); the consumer stores them truncated. A vector step the recorder refuses (a value it
cannot record; nothing of the step is recorded) aborts the episodes of the rows logged in it
(reason ``refused-step``), records nothing more of them, and raises; their sub-envs' next
episodes are recorded again.

Infos are taken from gymnasium's batched info dict (``info[k][i]`` where ``info["_" + k][i]``):
as faithful as gymnasium's batching, which gives a key the dtype of the first sub-env that set
it. For exact infos, wrap each sub-env in a `RecordingWrapper` instead (see docs/FORMAT.md).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv, VectorWrapper

from rlrec.producer.recorder import EpisodeRecorder, RecorderClosed
from rlrec.producer.rows import new_episode_ids

__all__ = ["RecordingVectorWrapper"]

_NEXT, _SAME, _DISABLED = AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED
_FINAL = ("final_obs", "final_info")


def _mode(value: Any) -> AutoresetMode:
    if isinstance(value, AutoresetMode):
        return value
    for m in AutoresetMode:
        if value in (m.value, m.name):
            return m
    raise ValueError(f"autoreset_mode must be one of {[m.name for m in AutoresetMode]}, got {value!r}")


def info_rows(info: Mapping, n: int) -> list[dict]:
    """Gymnasium's batched info dict as one dict per sub-env (``info[k][i]`` where the mask
    ``info["_" + k][i]`` is set; nested dicts likewise). Keys starting with ``_`` are kept
    unless they are the mask of another key (gymnasium's `DictInfoToList` drops them all);
    ``final_obs`` and ``final_info`` are left out (SAME_STEP's last step, see the module)."""
    rows: list[dict] = [{} for _ in range(n)]
    for k, v in info.items():
        if k in _FINAL or (k[:1] == "_" and k[1:] in info):
            continue
        mask = info.get("_" + k)
        where = range(n) if mask is None else np.flatnonzero(mask).tolist()
        if isinstance(v, Mapping):
            sub = info_rows(v, n)
            for i in where:
                rows[i][k] = sub[i]
        else:
            for i in where:
                rows[i][k] = v[i]
    return rows


def _copy_batch(batch: Any) -> Any:
    if isinstance(batch, np.ndarray):
        return batch.copy()
    if isinstance(batch, Mapping):
        return {k: _copy_batch(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_copy_batch(v) for v in batch)
    return copy.deepcopy(batch)


def _take(batch: Any, idx: list[int]) -> Any:
    """Rows `idx` of a batch (gymnasium's batching), as a new batch."""
    if isinstance(batch, np.ndarray):
        return batch[idx]
    if isinstance(batch, Mapping):
        return {k: _take(v, idx) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_take(v, idx) for v in batch)
    return [batch[i] for i in idx]


def _set_row(batch: Any, i: int, value: Any) -> None:
    if isinstance(batch, Mapping):
        for k, v in batch.items():
            _set_row(v, i, value[k])
    elif isinstance(batch, tuple):
        for v, x in zip(batch, value):
            _set_row(v, i, x)
    else:
        batch[i] = value


class RecordingVectorWrapper(VectorWrapper):
    """Records each sub-env of a `gymnasium.vector.VectorEnv` (Sync, Async, or a native vector
    env with no sub-envs) through an `EpisodeRecorder`: one `begin_episodes` and one `log_steps`
    call per vector step at most, episodes equal field by field to those a `RecordingWrapper`
    records of each sub-env alone (infos as faithful as gymnasium's batching, see the module).

    Extra model outputs for the next step are given batched with `set_model_outputs` (row i
    with ``actions[i]``); a `reset()` forgets them. `close()` aborts the open episodes and closes
    the vector env; the recorder stays open (it belongs to the caller).

    Args:
        env: the vector env. Its ``metadata["autoreset_mode"]`` says how it resets finished
            sub-envs; one that declares none needs `autoreset_mode`.
        recorder: records the episodes; its spaces are the vector env's single spaces.
        policy_version: the version recorded with the episodes it begins (None: the
            recorder's at that time); may be changed later through the attribute.
        autoreset_mode: overrides the env's declared mode (an `AutoresetMode` or its name).

    Raises:
        ValueError: the env declares no autoreset mode and none is given.

    Example:
        >>> import gymnasium as gym
        >>> from rlrec import EpisodeRecorder, LocalBroker, RecordingVectorWrapper
        >>> envs = gym.make_vec("CartPole-v1", num_envs=4)
        >>> with LocalBroker() as broker, EpisodeRecorder(
        ...     broker.bootstrap_servers,
        ...     observation_space=envs.single_observation_space,
        ...     action_space=envs.single_action_space,
        ... ) as rec:
        ...     envs = RecordingVectorWrapper(envs, rec)
        ...     obs, info = envs.reset(seed=0)
        ...     for _ in range(100):
        ...         obs, reward, terminated, truncated, info = envs.step(envs.action_space.sample())
        ...     envs.close()
    """

    def __init__(
        self,
        env: VectorEnv,
        recorder: EpisodeRecorder,
        *,
        policy_version: int | None = None,
        autoreset_mode: AutoresetMode | str | None = None,
    ):
        super().__init__(env)
        declared = env.metadata.get("autoreset_mode") if isinstance(env.metadata, Mapping) else None
        if autoreset_mode is None and declared is None:
            raise ValueError(
                f"RecordingVectorWrapper: {env} declares no metadata['autoreset_mode']; pass "
                "autoreset_mode=AutoresetMode.NEXT_STEP, SAME_STEP or DISABLED (how it resets finished sub-envs)"
            )
        self.autoreset_mode = _mode(declared if autoreset_mode is None else autoreset_mode)
        self.recorder = recorder
        self.policy_version = policy_version
        n = self.num_envs
        #: each sub-env's current episode id (begun at its first step), None before a reset
        self.episode_ids: list[str | None] = [None] * n
        self._begun = [False] * n
        self._unbegun = 0  # episodes with an id that are not begun yet
        self._starts: list[tuple | None] = [None] * n  # unbegun: (observation batch, row, info)
        self._resetting = np.zeros(n, bool)  # NEXT_STEP: the next step call resets these rows
        self._refused = np.zeros(n, bool)  # rows whose current episode a refused step aborted
        self._pending_outputs: Mapping[str, Any] | None = None
        self._reset_called = False

    def set_model_outputs(self, outputs: Mapping[str, Any] | None) -> None:
        """Extra model outputs of the next step: key -> values batched on axis 0, row i with
        ``actions[i]`` (``action_logp``, ``action_dist_inputs``, ...). Rows that turn out to be
        a NEXT_STEP reset are dropped with their actions."""
        self._pending_outputs = outputs

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        mask = None
        if options is not None and options.get("reset_mask") is not None:
            mask = np.array(options["reset_mask"], dtype=bool)  # read first: SyncVectorEnv.reset pops it
        obs, info = self.env.reset(seed=seed, options=options)
        self._pending_outputs = None
        rows = range(self.num_envs) if mask is None else np.flatnonzero(mask).tolist()
        for i in rows:
            if self._begun[i]:
                self.recorder.abort_episode(self.episode_ids[i], reason="reset")
        self._new_episodes(rows, obs, info_rows(info, self.num_envs) if info else None)
        self._resetting[rows] = False
        self._reset_called = True
        return obs, info

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        outputs, self._pending_outputs = self._pending_outputs, None
        ids = self.episode_ids
        if not self._reset_called:
            raise RuntimeError("call reset() before step()")
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        n = self.num_envs
        term, trunc = np.asarray(terminated, bool), np.asarray(truncated, bool)
        done = term | trunc
        mode = self.autoreset_mode
        real = None  # rows that are transitions (None: all)
        if mode is _NEXT:
            resetting = self._resetting
            if resetting.any():
                real = ~resetting
        elif mode is _DISABLED and None in ids:  # finished rows not reset yet: nothing to record
            real = np.array([e is not None for e in ids])
        refused = self._refused
        logged = real
        if refused.any():  # rows whose episode was aborted: nothing more of it is recorded
            logged = ~refused if real is None else real & ~refused
        if self._unbegun:
            self._begin(
                [i for i in range(n) if not self._begun[i] and ids[i] is not None and (logged is None or logged[i])]
            )
        rows_info = info_rows(info, n) if info else None
        log_obs, log_infos = obs, rows_info
        if mode is _SAME and done.any() and "final_obs" in info:
            ended = np.flatnonzero(done).tolist()
            log_obs = _copy_batch(obs)
            final_obs = info["final_obs"]
            for i in ended:
                _set_row(log_obs, i, final_obs[i])
            final = info_rows(info["final_info"], n) if info.get("final_info") else None
            log_infos = list(rows_info) if rows_info is not None else [None] * n
            for i in ended:
                log_infos[i] = final[i] if final is not None else None
        error = None
        if logged is None or logged.any():
            try:
                self.recorder.log_steps(ids, actions, rewards, log_obs, term, trunc, log_infos, outputs, rows=logged)
            except (ValueError, TypeError, BufferError) as e:  # refused: nothing of this step was recorded
                error = e
                self._refuse(range(n) if logged is None else np.flatnonzero(logged).tolist())
        # what the step ended and began
        ended_now = done if real is None else done & real
        for i in np.flatnonzero(ended_now).tolist():
            ids[i], self._begun[i] = None, False
            refused[i] = False
        if mode is _NEXT:
            if real is not None:  # the reset rows begin the sub-envs' next episodes
                self._new_episodes(np.flatnonzero(~real).tolist(), obs, rows_info)
            self._resetting = ended_now
        elif mode is _SAME and ended_now.any():
            self._new_episodes(np.flatnonzero(ended_now).tolist(), obs, rows_info)
        if error is not None:
            raise error
        return obs, rewards, terminated, truncated, info

    def _refuse(self, rows: Any) -> None:
        """The recorder refused a step of `rows`: abort their episodes; record no more of them."""
        for i in rows:
            if self._begun[i]:
                try:
                    self.recorder.abort_episode(self.episode_ids[i], reason="refused-step")
                except (ValueError, RecorderClosed):  # the recorder ended or aborted it already
                    pass
                self._begun[i] = False
            self._refused[i] = True

    def close(self, **kwargs: Any) -> Any:
        """Abort the open episodes (reason ``close``; stored truncated) and close the vector env."""
        if "episode_ids" not in vars(self):  # __init__ refused the env: nothing was recorded
            return self.env.close(**kwargs)
        try:
            for i, eid in enumerate(self.episode_ids):
                if eid is not None and self._begun[i]:
                    self.recorder.abort_episode(eid, reason="close")
        except RecorderClosed:  # the recorder's close() aborted them already
            pass
        self.episode_ids = [None] * self.num_envs
        self._begun = [False] * self.num_envs
        self._refused[:] = False
        self._starts = [None] * self.num_envs
        self._unbegun = 0
        self._reset_called = False
        return self.env.close(**kwargs)

    # -- internals -----------------------------------------------------------------------------

    def _new_episodes(self, rows: list[int] | range, obs: Any, infos: list[dict] | None) -> None:
        """Rows `rows` of `obs` (and `infos`) begin new episodes, sent at their first step."""
        if not len(rows):
            return
        src = _copy_batch(obs)  # the vector env may reuse its buffer
        for i, eid in zip(rows, new_episode_ids(len(rows))):
            if not self._begun[i] and self.episode_ids[i] is not None and not self._refused[i]:
                self._unbegun -= 1
            self.episode_ids[i] = eid
            self._begun[i] = False
            self._refused[i] = False
            self._starts[i] = (src, i, infos[i] if infos is not None else None)
            self._unbegun += 1

    def _begin(self, rows: list[int]) -> None:
        """Send the EpisodeStart of unbegun rows `rows`: one `begin_episodes` per reset batch."""
        groups: dict[int, list[int]] = {}
        for i in rows:
            groups.setdefault(id(self._starts[i][0]), []).append(i)
        version = self.policy_version
        for idx in groups.values():
            src = self._starts[idx[0]][0]
            self.recorder.begin_episodes(
                _take(src, [self._starts[i][1] for i in idx]),
                infos=[self._starts[i][2] for i in idx],
                episode_ids=[self.episode_ids[i] for i in idx],
                policy_versions=None if version is None else [version] * len(idx),
            )
            for i in idx:
                self._begun[i] = True
                self._starts[i] = None
            self._unbegun -= len(idx)
