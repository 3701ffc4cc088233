"""Multi-agent envs recorded through `MultiAgentRecordingWrapper` -> a real Tansu broker -> the
consumed messages decoded (`decode_event`) and folded (`fold_multi_agent`): the recording equals
the dicts the env produced, and replays through RLlib's real `MultiAgentEpisode`.

Envs: PettingZoo simple_spread (mpe2, Parallel, 3 agents), pistonball (Parallel, image
observations, n_pistons=3, max_cycles=5), tic-tac-toe (AEC, action masks; the truth is what
RLlib's own `PettingZooEnv` returns for the same actions) and an RLlib `MultiAgentEnv` whose
agents join late, leave early, act without an immediate observation and get a reward before
their first observation.
"""

from __future__ import annotations

import os
import random
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces as gs

from rlrec.consumer.multi_agent_fold import fold_multi_agent
from rlrec.producer import EpisodeRecorder, MultiAgentRecordingWrapper
from rlrec.producer.multi_agent_events import decode_event, encode_event
from rlrec.producer.multi_agent_recording import MultiAgentRecording
from tests.test_recorder import read_messages

#: CI (.ci/run) sets it: the `multiagent` extra is installed there, so a missing env package fails
REQUIRED = os.environ.get("RLREC_TEST_REQUIRE_EMULATORS") == "1" or bool(os.environ.get("CI"))


def _needs(module: str) -> None:
    """Skip without an optional env package - except in CI, where the `multiagent` extra is installed."""
    if REQUIRED:
        __import__(module)
    else:
        pytest.importorskip(module)


# ------------------------------------------------------------------------------------ helpers


def same(got: Any, want: Any, where: str = "") -> None:
    """Equal values: arrays by dtype-independent value and shape, dicts by keys, numbers by value."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, sorted(got), sorted(want))
        for k in want:
            same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (np.ndarray, np.generic)) or isinstance(got, (np.ndarray, np.generic)):
        g, w = np.asarray(got), np.asarray(want)
        assert g.shape == w.shape and np.array_equal(g, w), (where, g, w)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def assert_recording_equals(rec: MultiAgentRecording, reset: tuple, steps: list[tuple]) -> None:
    """`rec` holds exactly the reset dicts and the per-env-step dicts the env produced."""
    same(rec.reset.observations, reset[0], "reset.observations")
    same(rec.reset.infos, dict(reset[1]), "reset.infos")
    assert len(rec.steps) == len(steps)
    for t, (s, (actions, obs, rew, term, trunc, infos)) in enumerate(zip(rec.steps, steps)):
        same(s.actions, actions, f"steps[{t}].actions")
        same(s.observations, obs, f"steps[{t}].observations")
        same(s.rewards, {a: float(r) for a, r in rew.items()}, f"steps[{t}].rewards")
        same(s.terminateds, {a: bool(v) for a, v in term.items()}, f"steps[{t}].terminateds")
        same(s.truncateds, {a: bool(v) for a, v in trunc.items()}, f"steps[{t}].truncateds")
        same(s.infos, dict(infos), f"steps[{t}].infos")


def recordings(bootstrap: str, topic: str, n_messages: int) -> dict[str, MultiAgentRecording]:
    """Every multi-agent episode on `topic`, decoded and folded (all its events share a key).
    Each message is the reference encoding (`encode_event`) of what it decodes to, byte for byte:
    the recorder's own encoding writes exactly the wire format."""
    by_key: dict[bytes, list] = defaultdict(list)
    for m in read_messages(bootstrap, topic, n_messages, timeout=30):
        ev = decode_event(m.value(), m.headers(), key=m.key())
        assert encode_event(ev) == (m.value(), m.headers()), ev
        by_key[m.key()].append(ev)
    return {k.decode(): fold_multi_agent(evs) for k, evs in by_key.items()}


def replay_through_rllib(rec: MultiAgentRecording):
    """The recording fed to RLlib's real MultiAgentEpisode (it raises on what it refuses)."""
    from ray.rllib.env.multi_agent_episode import MultiAgentEpisode

    ep = MultiAgentEpisode(agent_module_ids=dict(rec.agent_modules))
    ep.add_env_reset(observations=rec.reset.observations, infos=rec.reset.infos)
    for s in rec.steps:
        ep.add_env_step(
            s.observations,
            s.actions,
            s.rewards,
            s.infos,
            terminateds=s.terminateds,
            truncateds=s.truncateds,
            extra_model_outputs=s.extra_model_outputs,
        )
    return ep


def run_parallel(env: MultiAgentRecordingWrapper, seed: int, logp: bool = True) -> tuple[str, tuple, list]:
    """One episode of a Parallel (or RLlib) env with random actions: (id, reset dicts, step dicts)."""
    rng = np.random.default_rng(seed)
    obs, infos = env.reset(seed=seed)
    eid = env.episode_id
    reset = ({a: np.copy(o) for a, o in obs.items()}, dict(infos))
    steps = []
    while env.agents:
        actions = {}
        for a in env.agents:
            space = env.action_space(a)
            space.seed(int(rng.integers(1 << 30)))
            actions[a] = space.sample()
        if logp:
            env.set_model_outputs({a: {"action_logp": -1.5} for a in actions})
        o, r, te, tr, i = env.step(actions)
        steps.append((actions, {a: np.copy(x) for a, x in o.items()}, dict(r), dict(te), dict(tr), dict(i)))
        if all(te.get(a) or tr.get(a) for a in o):
            break
    return eid, reset, steps


# ------------------------------------------------------------------------------ PettingZoo Parallel


def test_simple_spread_recorded_through_the_broker_equals_the_env(broker, topic):
    _needs("mpe2")
    from mpe2 import simple_spread_v3

    rec = EpisodeRecorder(broker.bootstrap_servers, topic, policy_id="spread")
    env = MultiAgentRecordingWrapper(simple_spread_v3.parallel_env(N=3, max_cycles=7), rec)
    truth = {}
    for seed in range(3):
        eid, reset, steps = run_parallel(env, seed)
        truth[eid] = (reset, steps)
    env.close()
    rec.close()
    assert rec.stats.failed == 0 and rec.stats.produced == 3 * (1 + 7)
    got = recordings(broker.bootstrap_servers, topic, rec.stats.messages_produced)
    assert set(got) == set(truth)
    for eid, (reset, steps) in truth.items():
        r = got[eid]
        assert r.policy_id == "spread" and r.agent_modules == {f"agent_{i}": "default_policy" for i in range(3)}
        assert not r.aborted
        assert_recording_equals(r, reset, steps)
        assert all(s.extra_model_outputs[a]["action_logp"] == -1.5 for s in r.steps for a in s.actions)
        ep = replay_through_rllib(r)
        assert ep.is_done and ep.env_t == 7 and len(ep.agent_episodes) == 3


def test_pistonball_image_observations(broker, topic):
    _needs("pettingzoo.butterfly")
    from pettingzoo.butterfly import pistonball_v6

    rec = EpisodeRecorder(broker.bootstrap_servers, topic)
    env = MultiAgentRecordingWrapper(
        pistonball_v6.parallel_env(n_pistons=3, max_cycles=5),
        rec,
        agent_modules={f"piston_{i}": "piston" for i in range(3)},
    )
    eid, reset, steps = run_parallel(env, 4, logp=False)
    rec.close()
    assert rec.stats.failed == 0
    # 164,520-byte observations: one env step per message, under Kafka's 1 MB
    assert rec.stats.messages_produced == 1 + len(steps) == 6
    got = recordings(broker.bootstrap_servers, topic, rec.stats.messages_produced)
    r = got[eid]
    assert r.observation_spaces["piston_0"].shape == (457, 120, 3)
    assert r.agent_modules == {f"piston_{i}": "piston" for i in range(3)}
    assert_recording_equals(r, reset, steps)
    assert replay_through_rllib(r).is_done


# ------------------------------------------------------------------------------------ PettingZoo AEC


def test_tictactoe_aec_equals_what_rllibs_pettingzoo_env_returns(broker, topic):
    _needs("pettingzoo.classic")
    pytest.importorskip("ray.rllib")
    from pettingzoo.classic import tictactoe_v3
    from ray.rllib.env.wrappers.pettingzoo_env import PettingZooEnv

    rec = EpisodeRecorder(broker.bootstrap_servers, topic)
    env = MultiAgentRecordingWrapper(tictactoe_v3.env(), rec)
    truth = {}
    for seed in range(4):
        rng = random.Random(seed)
        oracle = PettingZooEnv(tictactoe_v3.env())
        o_obs, _ = oracle.reset(seed=seed)  # its infos: {} (AEC reset returns none)
        env.reset(seed=seed)
        eid = env.episode_id
        steps = []
        for agent in env.agent_iter():
            obs, _rew, term, trunc, _info = env.last()
            if term or trunc:
                env.step(None)
                continue
            action = rng.choice(np.flatnonzero(obs["action_mask"]).tolist())  # a legal move
            env.step(action)
            o, r, te, tr, i = oracle.step({agent: action})
            steps.append(({agent: action}, o, r, te, tr, i))
        truth[eid] = ((o_obs, {}), steps)
    rec.close()
    got = recordings(broker.bootstrap_servers, topic, rec.stats.messages_produced)
    assert set(got) == set(truth)
    for eid, (reset, steps) in truth.items():
        r = got[eid]
        # the reset info is the env's own info of the first agent (RLlib's wrapper passes {})
        assert_recording_equals(r, (reset[0], {"player_1": {}}), steps)
        assert steps[-1][3]["__all__"] is True  # the game ended: everyone gone
        ep = replay_through_rllib(r)
        assert ep.is_done and set(ep.agent_episodes) == {"player_1", "player_2"}
        # the hanging actions were folded into the next observed step: one action per move
        assert sum(len(sa) for sa in ep.agent_episodes.values()) == len(steps)


# ---------------------------------------------------------------------------- RLlib MultiAgentEnv

#: (actions, observations, rewards, terminateds, truncateds) per env step of RelayEnv
RELAY = [
    # a0 acts; a1 joins late; a2 gets a reward before its first observation
    ({"a0"}, {"a0", "a1"}, {"a0": 1.0, "a2": 0.25}, {}, {}),
    # a0 acts without an immediate observation (its action hangs)
    ({"a0", "a1"}, {"a1"}, {"a1": 0.5, "a0": 0.125}, {}, {}),
    # a0 observes again (the hanging action is folded in); a2 joins; a1's action hangs
    ({"a1"}, {"a0", "a2"}, {"a0": 0.5, "a1": -1.0}, {}, {}),
    # a0 leaves early
    ({"a0", "a2"}, {"a0", "a1", "a2"}, {"a0": 2.0, "a1": 0.0, "a2": 1.0}, {"a0": True}, {}),
    ({"a1", "a2"}, {"a1", "a2"}, {"a1": 1.0, "a2": 1.0}, {"__all__": True}, {"__all__": False}),
]


def _relay_env_class():
    from ray.rllib.env.multi_agent_env import MultiAgentEnv

    class RelayEnv(MultiAgentEnv):
        def __init__(self, config=None):
            super().__init__()
            self.possible_agents = ["a0", "a1", "a2"]
            self.agents = []
            box = gs.Box(-10.0, 10.0, (2,), np.float32)
            self.observation_spaces = dict.fromkeys(self.possible_agents, box)
            self.action_spaces = {a: gs.Discrete(4) for a in self.possible_agents}
            self.t = 0

        def _obs(self, agents):
            return {a: np.array([self.t, int(a[1])], dtype=np.float32) for a in sorted(agents)}

        def reset(self, *, seed=None, options=None):
            self.t = 0
            self.agents = ["a0"]
            return self._obs({"a0"}), {"a0": {"start": True}}

        def step(self, action_dict):
            acting, obs, rew, term, trunc = RELAY[self.t]
            assert set(action_dict) == acting, (self.t, action_dict)
            self.t += 1
            return self._obs(obs), dict(rew), dict(term), dict(trunc), {a: {"t": self.t} for a in obs}

    return RelayEnv


def test_rllib_env_agents_join_late_leave_early_and_act_without_observation(broker, topic):
    pytest.importorskip("ray.rllib")
    # 3 batches, by size only (a 0.2 s age could split them on a busy machine)
    rec = EpisodeRecorder(broker.bootstrap_servers, topic, max_batch_steps=2, max_batch_delay_s=3600)
    env = MultiAgentRecordingWrapper(_relay_env_class()(), rec, agent_modules={"a0": "m0", "a1": "m1", "a2": "m1"})
    obs, infos = env.reset()
    eid = env.episode_id
    reset = (dict(obs), dict(infos))
    steps = []
    for acting, *_ in RELAY:
        actions = dict.fromkeys(sorted(acting), 1)
        env.set_model_outputs({a: {"action_logp": np.float32(-0.25), "vf": np.float32(0.5)} for a in actions})
        o, r, te, tr, i = env.step(actions)
        steps.append((actions, o, r, te, tr, i))
    assert env.episode_id is None  # ended by "__all__"
    rec.log_multi_agent_reward(eid, 1, "a0", 0.5)  # a delayed reward, after the episode's end
    rec.close()
    assert rec.stats.messages_produced == 1 + 3 + 1
    r = recordings(broker.bootstrap_servers, topic, rec.stats.messages_produced)[eid]
    steps[1][2]["a0"] += 0.5  # the delta lands on a0's reward of env step 1
    assert_recording_equals(r, reset, steps)
    assert r.agent_modules == {"a0": "m0", "a1": "m1", "a2": "m1"}
    ep = replay_through_rllib(r)
    assert ep.is_done and ep.env_t == 5
    assert ep.agent_episodes["a0"].is_terminated
    # a2's reward before its first observation is recorded; RLlib's episode drops it at the end
    assert r.steps[0].rewards["a2"] == 0.25
    assert len(ep.agent_episodes["a2"]) == 2 and ep.agent_episodes["a2"].get_return() == 2.0
    # a0's hanging action of env step 1 was folded into its observation at env step 2
    assert list(ep.agent_episodes["a0"].get_actions()) == [1, 1, 1]


# -------------------------------------------------- random step sequences: recorded == built directly

#: get_state() keys that are timers or random ids, not data
_VOLATILE = {"_start_time", "_last_step_time", "id_", "multi_agent_episode_id"}


def _state_equal(got: Any, want: Any, where: str = "") -> None:
    """`get_state()` values equal: dicts without the volatile keys, lists item by item,
    lookback buffers by their state, numbers and arrays by value."""
    if hasattr(want, "get_state") and not isinstance(want, dict):
        got, want = got.get_state(), want.get_state()
    if isinstance(want, dict):
        keys = set(want) - _VOLATILE
        assert set(got) - _VOLATILE == keys, (where, sorted(set(got) ^ set(want)))
        for k in keys:
            _state_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), (where, len(got), len(want))
        for i, (g, w) in enumerate(zip(got, want)):
            _state_equal(g, w, f"{where}[{i}]")
    elif isinstance(want, (np.ndarray, np.generic, int, float)) and not isinstance(want, bool):
        assert np.array_equal(np.asarray(got), np.asarray(want)), (where, got, want)
    else:
        assert got == want, (where, got, want)


def test_random_step_sequences_recorded_replay_to_the_episode_rllib_builds_directly(broker, topic):
    """Random valid and invalid env steps go to the recorder and to a real MultiAgentEpisode: the
    same ones are refused; the recorded episodes, read back, folded and replayed, equal (get_state,
    timers and ids aside) the episodes RLlib built from the same steps directly."""
    pytest.importorskip("ray.rllib")
    from ray.rllib.env.multi_agent_episode import MultiAgentEpisode

    from tests.test_multi_agent_rules import AGENTS, _full_step, _random_step, _rllib_accepts, _rllib_episode

    box = gs.Box(-1.0, 1.0, (), np.float32)
    spaces = {"observation_spaces": dict.fromkeys(AGENTS, box), "action_spaces": {a: gs.Discrete(3) for a in AGENTS}}
    rec = EpisodeRecorder(broker.bootstrap_servers, topic, max_batch_steps=7)
    direct = {}
    refused = 0
    for seed in range(25):
        rng = random.Random(1000 + seed)
        reset = {a: np.float32(0.0) for a in AGENTS if rng.random() < 0.7}
        eid = rec.begin_multi_agent_episode(reset, **spaces, agent_modules=dict.fromkeys(AGENTS, "m"))
        ep = _rllib_episode(reset, [])
        accepted = []
        ended = False
        for _ in range(40):
            if seed % 3 == 2 and rng.random() < 0.7:  # mostly the usual env step (the recorder's fast path)
                step = _full_step(rng, seed % 2 == 0, sorted(reset) if rng.random() < 0.8 else AGENTS)
            else:
                step = _random_step(rng, with_extras=seed % 2 == 0)
            want = _rllib_accepts(ep, step)
            try:
                ended = rec.log_multi_agent_step(
                    eid,
                    step["observations"],
                    step["actions"],
                    step["rewards"],
                    step["terminateds"],
                    step["truncateds"],
                    step["infos"],
                    step["extra_model_outputs"],
                )
                got = True
            except ValueError:
                got = False
            assert got == want, (seed, step)
            if want:
                accepted.append(step)
                assert ended == ep.is_done
                if ended:
                    break
            else:
                refused += 1
                ep = _rllib_episode(reset, accepted)
        if not ended:
            rec.abort_episode(eid)
        direct[eid] = (ep, ended, len(accepted))
    rec.close()
    assert refused > 25 and sum(e[1] for e in direct.values()) >= 3  # both kinds of outcome seen
    got = recordings(broker.bootstrap_servers, topic, rec.stats.messages_produced)
    assert set(got) == set(direct)
    for eid, (ep, ended, n) in direct.items():
        r = got[eid]
        assert len(r.steps) == n and r.aborted == (not ended)
        replayed = MultiAgentEpisode(agent_module_ids=dict(r.agent_modules))
        replayed.add_env_reset(observations=r.reset.observations, infos=r.reset.infos)
        for s in r.steps:
            replayed.add_env_step(
                s.observations,
                s.actions,
                s.rewards,
                s.infos,
                terminateds=s.terminateds,
                truncateds=s.truncateds,
                extra_model_outputs=s.extra_model_outputs,
            )
        _state_equal(replayed.get_state(), ep.get_state(), eid)
