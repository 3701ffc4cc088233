"""`RecordingVectorWrapper`: every sub-env of a vector env, in every autoreset mode, Sync and
Async, records the episodes a `RecordingWrapper` records of that sub-env alone (same seeds, a
policy of the observation), field by field, infos included; a wrapper forced to the wrong
mode's logic records other episodes; a native vector env records no reset as a transition;
closing right after an autoreset leaves no dead letter. Plus the two single-env fixes.

Episodes are compared as the consumer assembles them (consumer/assembly.py), from the messages
the recorder produced (kept by a stand-in producer, tests/helpers.py).
"""

from __future__ import annotations

import pickle

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from rlrec.producer import RecorderForkedError, RecordingVectorWrapper, RecordingWrapper
from tests.helpers import assemble, episode_fields, keeping_recorder

LIMITS = (9, 16, 30)  # different time limits: truncations and terminations both occur
SEEDS = [11, 12, 13]
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
CARTPOLE = gym.make("CartPole-v1")
OBS_SPACE, ACT_SPACE = CARTPOLE.observation_space, CARTPOLE.action_space


class StepInfo(gym.Wrapper):
    """Adds infos of several types, on reset and on every step."""

    def reset(self, **kw):
        obs, info = self.env.reset(**kw)
        self.k = 0
        return obs, {**info, "reset": True, "x0": float(obs[0])}

    def step(self, action):
        obs, r, term, trunc, info = self.env.step(action)
        self.k += 1
        return obs, r, term, trunc, {**info, "k": self.k, "pos": float(obs[0]), "arr": np.array([self.k, 2 * self.k])}


def make(limit: int):
    return lambda: StepInfo(gym.make("CartPole-v1", max_episode_steps=limit))


def policy(obs: np.ndarray) -> int:
    """A deterministic function of the observation that looks random (short episodes)."""
    return int(abs(float(obs.sum())) * 1e5) % 2


def logp(obs: np.ndarray) -> np.float32:
    return np.float32(-0.05 - abs(float(obs[1])) % 0.6)


def run_vector(kind: str, mode: AutoresetMode, steps: int = 90, forced: AutoresetMode | None = None):
    """Drive a vector env of the LIMITS sub-envs; returns ({sub-env: [episode fields]}, dead letters)."""
    cls = SyncVectorEnv if kind == "sync" else AsyncVectorEnv
    envs = cls([make(lim) for lim in LIMITS], autoreset_mode=mode)
    rec, fake = keeping_recorder(OBS_SPACE, ACT_SPACE)
    w = RecordingVectorWrapper(envs, rec, autoreset_mode=forced)
    owner: dict[str, int] = {}

    def note():
        owner.update({e: i for i, e in enumerate(w.episode_ids) if e is not None})

    obs, _ = w.reset(seed=list(SEEDS))
    note()
    for _ in range(steps):
        w.set_model_outputs({"action_logp": np.array([logp(o) for o in obs])})
        obs, _r, term, trunc, _info = w.step(np.array([policy(o) for o in obs]))
        note()
        if mode is AutoresetMode.DISABLED and (term | trunc).any():
            obs, _ = w.reset(options={"reset_mask": term | trunc})
            note()
    w.close()
    rec.flush(0)
    finished, letters = assemble(list(fake.messages))
    rec.close(0)
    by_env: dict[int, list] = {i: [] for i in range(len(LIMITS))}
    for eid, fe in finished.items():  # finish order is step order within one sub-env
        by_env[owner[eid]].append(episode_fields(fe))
    return by_env, letters


def run_single(i: int, lengths: list[int]) -> list:
    """Sub-env i alone in a `RecordingWrapper`, same seed and policy, as many episodes as
    `lengths`, the last cut at its length (closed, as the vector run ended)."""
    rec, fake = keeping_recorder(OBS_SPACE, ACT_SPACE)
    env = RecordingWrapper(make(LIMITS[i])(), rec)
    obs, _ = env.reset(seed=SEEDS[i])
    for j, length in enumerate(lengths):
        for t in range(length):
            env.set_model_outputs({"action_logp": logp(obs)})
            obs, _r, term, trunc, _info = env.step(policy(obs))
            if term or trunc:
                assert t == length - 1, (i, j, t, length)
                obs, _ = env.reset()
    env.close()
    rec.flush(0)
    finished, letters = assemble(list(fake.messages))
    rec.close(0)
    assert letters == []
    return [episode_fields(fe) for fe in finished.values()]


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_each_sub_env_records_what_a_single_env_records(kind, mode):
    by_env, letters = run_vector(kind, mode)
    assert letters == []  # closed right after some autoresets: nothing to dead-letter
    ends = {"terminated": 0, "truncated": 0}
    for i, episodes in by_env.items():
        assert len(episodes) >= 3, (i, len(episodes))
        lengths = [len(e["rewards"]) // 8 for e in episodes]
        assert run_single(i, lengths) == episodes, f"sub-env {i}"
        for e in episodes[:-1]:
            ends["terminated" if e["terminated"] else "truncated"] += 1
        assert episodes[0]["infos"][0].startswith('{"reset":true,"x0":')  # infos are recorded
        assert episodes[0]["infos"][1].startswith('{"k":1,"pos":')
    assert ends["terminated"] and ends["truncated"], ends


@pytest.mark.parametrize(
    ("mode", "forced"),
    [
        (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP),
        (AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP),
        (AutoresetMode.SAME_STEP, AutoresetMode.DISABLED),
    ],
    ids=["next-as-same", "same-as-next", "same-as-disabled"],
)
def test_the_wrong_modes_logic_records_other_episodes(mode, forced):
    """The comparison above can fail: the same drive with the wrong mode's logic differs."""
    by_env, _ = run_vector("sync", mode, forced=forced)
    differ = 0
    for i, episodes in by_env.items():
        lengths = [len(e["rewards"]) // 8 for e in episodes]
        try:
            differ += run_single(i, lengths) != episodes
        except AssertionError:  # the single env ended an episode where the recording did not
            differ += 1
    assert differ


def test_a_vector_env_that_declares_no_mode_is_refused():
    envs = SyncVectorEnv([make(9)])
    envs.metadata = {k: v for k, v in envs.metadata.items() if k != "autoreset_mode"}
    rec, _ = keeping_recorder(OBS_SPACE, ACT_SPACE)
    try:
        with pytest.raises(ValueError, match="declares no metadata\\['autoreset_mode'\\]; pass autoreset_mode="):
            RecordingVectorWrapper(envs, rec)
        refused = RecordingVectorWrapper.__new__(RecordingVectorWrapper)
        gym.vector.VectorWrapper.__init__(refused, envs)
        refused.close()  # what gymnasium's __del__ calls on a wrapper whose __init__ raised
        w = RecordingVectorWrapper(envs, rec, autoreset_mode="NEXT_STEP")
        assert w.autoreset_mode is AutoresetMode.NEXT_STEP
    finally:
        envs.close()
        rec.close(0)


def test_native_vector_env_records_no_reset_as_a_transition():
    envs = gym.make_vec("CartPole-v1", num_envs=8, vectorization_mode="vector_entry_point")
    assert type(envs.unwrapped).__name__ == "CartPoleVectorEnv"
    rec, fake = keeping_recorder(envs.single_observation_space, envs.single_action_space)
    w = RecordingVectorWrapper(envs, rec)
    w.reset(seed=5)
    rng = np.random.default_rng(0)
    real = 0
    resetting = np.zeros(8, bool)
    for _ in range(200):
        _obs, rewards, term, trunc, _ = w.step(rng.integers(0, 2, 8))
        assert (rewards[resetting] == 0).all()  # the env's reset rows: reward 0, no transition
        real += int((~resetting).sum())
        resetting = term | trunc
    w.close()
    rec.flush(0)
    finished, letters = assemble(list(fake.messages))
    rec.close(0)
    assert letters == []
    assert sum(fe.length for fe in finished.values()) == real
    assert len(finished) > 60
    for fe in finished.values():
        assert (fe.rewards == 1.0).all()  # CartPole pays 1 per real step: no reward-0 reset row
        assert (np.abs(fe.observations[0][0]) <= 0.05).all()  # begins at a reset observation


def test_outputs_go_with_their_rows_and_reset_rows_drop_theirs():
    envs = SyncVectorEnv([make(lim) for lim in LIMITS])  # NEXT_STEP
    rec, fake = keeping_recorder(OBS_SPACE, ACT_SPACE)
    w = RecordingVectorWrapper(envs, rec, policy_version=7)
    w.reset(seed=SEEDS)
    sent: dict = {}
    for k in range(40):
        lp = -np.arange(1, 4) / 100 - k
        w.set_model_outputs({"action_logp": lp, "action_dist_inputs": np.stack([lp, lp * 2], 1)})
        ids = list(w.episode_ids)
        _obs, *_ = w.step(np.zeros(3, np.int64))
        for i, e in enumerate(ids):
            if e is not None:
                sent.setdefault(e, []).append(lp[i])
    w.close()
    rec.flush(0)
    finished, letters = assemble(list(fake.messages))
    rec.close(0)
    assert letters == [] and finished
    for eid, fe in finished.items():
        np.testing.assert_array_equal(fe.extra_model_outputs["action_logp"], sent[eid][: fe.length])
        np.testing.assert_array_equal(
            fe.extra_model_outputs["action_dist_inputs"][:, 1], 2 * np.array(sent[eid][: fe.length])
        )
        assert fe.policy_version == 7


def test_a_full_reset_aborts_open_episodes_and_close_too():
    envs = SyncVectorEnv([make(lim) for lim in LIMITS])
    rec, fake = keeping_recorder(OBS_SPACE, ACT_SPACE)
    w = RecordingVectorWrapper(envs, rec)
    w.reset(seed=1)
    w.step(np.zeros(3, np.int64))
    w.reset()
    w.step(np.zeros(3, np.int64))
    w.close()
    rec.flush(0)
    from rlrec.producer.events import EpisodeAbort, decode

    reasons = [decode(v, h).reason for _, v, h in fake.messages if isinstance(decode(v, h), EpisodeAbort)]
    assert reasons == ["reset"] * 3 + ["close"] * 3
    finished, letters = assemble(list(fake.messages))
    rec.close(0)
    assert letters == [] and len(finished) == 6 and all(fe.truncated and fe.length == 1 for fe in finished.values())


def test_a_masked_reset_aborts_only_the_masked_sub_envs_episodes():
    envs = SyncVectorEnv([make(30)] * 3, autoreset_mode=AutoresetMode.DISABLED)
    rec, fake = keeping_recorder(OBS_SPACE, ACT_SPACE)
    w = RecordingVectorWrapper(envs, rec)
    w.reset(seed=0)
    w.step(np.zeros(3, np.int64))
    first = list(w.episode_ids)
    options = {"reset_mask": np.array([True, False, False])}
    w.reset(options=options)
    assert "reset_mask" not in options  # SyncVectorEnv popped it: the wrapper read it before
    assert w.episode_ids[0] != first[0] and w.episode_ids[1:] == first[1:]
    w.step(np.zeros(3, np.int64))
    w.close()
    rec.flush(0)
    from rlrec.producer.events import EpisodeAbort, decode

    aborts = [decode(v, h) for _, v, h in fake.messages if isinstance(decode(v, h), EpisodeAbort)]
    assert [(a.episode_id == first[0], a.reason) for a in aborts] == [(True, "reset")] + [(False, "close")] * 3
    finished, letters = assemble(list(fake.messages))
    rec.close(0)
    assert letters == []
    assert sorted(fe.length for fe in finished.values()) == [1, 1, 2, 2]


# ------------------------------------------------------- single-env fixes (RecordingWrapper)


def test_inner_tap_closed_right_after_an_autoreset_leaves_no_dead_letter():
    """SAME_STEP resets a sub-env in the call that ends it: its next episode has no step yet
    when the vector env is closed."""
    rec, fake = keeping_recorder(OBS_SPACE, ACT_SPACE)
    envs = SyncVectorEnv(
        [lambda lim=lim: RecordingWrapper(gym.make("CartPole-v1", max_episode_steps=lim), rec) for lim in (3, 5)],
        autoreset_mode=AutoresetMode.SAME_STEP,
    )
    envs.reset(seed=0)
    for _ in range(3):  # sub-env 0 ends at its third step and is reset at once
        envs.step(np.zeros(2, np.int64))
    envs.close()
    rec.flush(0)
    finished, letters = assemble(list(fake.messages))
    rec.close(0)
    assert letters == []
    assert sorted(fe.length for fe in finished.values()) == [3, 3]


def test_reset_forgets_model_outputs_set_for_a_step_that_never_came():
    rec, fake = keeping_recorder(OBS_SPACE, ACT_SPACE)
    env = RecordingWrapper(gym.make("CartPole-v1"), rec)
    env.reset(seed=0)
    env.set_model_outputs({"action_logp": -0.5})  # the caller's loop then resets instead of stepping
    env.reset(seed=1)
    env.step(0)
    env.step(1)
    env.close()
    rec.flush(0)
    finished, letters = assemble(list(fake.messages))
    rec.close(0)
    assert letters == []  # the first episode never stepped: nothing recorded, nothing dead-lettered
    (fe,) = finished.values()
    assert fe.length == 2 and fe.extra_model_outputs == {}


def test_a_recorder_from_the_parent_raises_in_an_async_worker():
    """The inner tap under AsyncVectorEnv needs a recorder per worker: one captured from the
    parent raises RecorderForkedError (fork) or refuses to be pickled (spawn, forkserver)."""
    rec, _ = keeping_recorder(OBS_SPACE, ACT_SPACE)
    try:
        envs = AsyncVectorEnv([lambda: RecordingWrapper(gym.make("CartPole-v1"), rec)] * 2, context="fork")
        try:
            envs.reset(seed=0)
            with pytest.raises(RecorderForkedError):
                envs.step(np.zeros(2, np.int64))
        finally:
            envs.close(terminate=True)
        with pytest.raises(TypeError, match="create it in the process that records"):
            pickle.dumps(rec)
    finally:
        rec.close(0)


@pytest.mark.slow
def test_rllib_env_runner_episodes_equal_ours():
    """RLlib's SingleAgentEnvRunner (NEXT_STEP, DictInfoToList, seeded) steps its vector env
    through our wrapper: each episode it returns equals the one we recorded, field by field."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    config = PPOConfig().environment("CartPole-v1").env_runners(num_envs_per_env_runner=3).debugging(seed=3)
    runner = SingleAgentEnvRunner(config=config)
    inner = runner.env.env  # DictInfoToList(SyncVectorEnv)
    assert inner.metadata["autoreset_mode"] is AutoresetMode.NEXT_STEP
    rec, fake = keeping_recorder(inner.single_observation_space, inner.single_action_space)
    runner.env.env = RecordingVectorWrapper(inner, rec)
    try:
        theirs = runner.sample(num_episodes=8, random_actions=True)
    finally:
        runner.stop()
    rec.flush(0)
    finished, letters = assemble(list(fake.messages))
    rec.close(0)
    assert letters == []
    ours = {fe.observations[0].tobytes(): fe for fe in finished.values()}
    assert len(theirs) == 8 and len(ours) >= 8
    for ep in theirs:
        fe = ours[np.asarray(ep.get_observations(), np.float32).tobytes()]  # KeyError: not recorded
        assert fe.length == len(ep) and ep.t_started == 0
        np.testing.assert_array_equal(fe.actions[0], np.asarray(ep.get_actions()))
        np.testing.assert_array_equal(fe.rewards, np.asarray(ep.get_rewards(), np.float64))
        assert [dict(i) for i in fe.infos] == [dict(i) for i in ep.get_infos()]
        assert (fe.terminated, fe.truncated) == (bool(ep.is_terminated), bool(ep.is_truncated))
        assert fe.observation_space == ep.observation_space and fe.action_space == ep.action_space


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_step_aborts_its_rows_episodes_and_records_no_more_of_them(mode):
    from rlrec.producer.events import EpisodeAbort, decode

    envs = SyncVectorEnv([make(lim) for lim in LIMITS], autoreset_mode=mode)
    rec, fake = keeping_recorder(OBS_SPACE, ACT_SPACE)
    w = RecordingVectorWrapper(envs, rec)
    w.reset(seed=SEEDS)
    first = list(w.episode_ids)
    for _ in range(3):
        w.step(np.zeros(3, np.int64))
    before = rec.stats.produced
    w.set_model_outputs({"action_logp": np.array([-0.1, float("nan"), -0.1])})  # row 1 is refused
    with pytest.raises(ValueError):
        w.step(np.zeros(3, np.int64))
    assert rec.stats.produced == before + 3  # the three aborts, no step
    for _ in range(40):  # the aborted episodes go on unrecorded; the next ones are recorded
        _obs, _r, term, trunc, _info = w.step(np.zeros(3, np.int64))
        if mode is AutoresetMode.DISABLED and (term | trunc).any():
            w.reset(options={"reset_mask": term | trunc})
    w.close()
    rec.flush(0)
    aborts = [decode(v, h) for _, v, h in fake.messages if isinstance(decode(v, h), EpisodeAbort)]
    assert [a.episode_id for a in aborts[:3]] == first and {a.reason for a in aborts[:3]} == {"refused-step"}
    finished, letters = assemble(list(fake.messages))
    rec.close(0)
    assert letters == []
    assert all(finished[e].truncated and finished[e].length == 3 for e in first)
    later = [fe for e, fe in finished.items() if e not in first]
    assert later and any(not fe.truncated or fe.length > 3 for fe in later)
