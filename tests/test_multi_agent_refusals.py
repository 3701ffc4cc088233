"""What the multi-agent path refuses, and that a refusal loses or half-records nothing:
hostile bytes (bounded before allocation, DecodeError only), inconsistent event sequences (the
fold's reason codes), refused recorder calls (nothing recorded), refused wrapper steps (the
episode is aborted, single-agent `RecordingWrapper` included)."""

from __future__ import annotations

import json
import random
import tracemalloc
from collections import defaultdict

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces as gs

from rlrec.consumer.multi_agent_fold import fold_multi_agent
from rlrec.producer import EpisodeRecorder, MultiAgentRecordingWrapper, RecordingWrapper
from rlrec.producer.events import DecodeError, EpisodeAbort, RewardDelta, decode, encode_record, schema_header
from rlrec.producer.multi_agent_events import (
    ACTION,
    ALL_TERMINATED,
    ALL_TERMINATED_TRUE,
    OBSERVATION,
    REWARD,
    AgentColumn,
    AgentSpec,
    MultiAgentEpisodeStart,
    MultiAgentStepBatch,
    decode_event,
    encode_event,
)
from rlrec.producer.spaces import SPACE_NODE_NBYTES
from tests.test_golden import GOLDEN
from tests.test_recorder import NOWHERE, QUIET, read_messages

BOX = gs.Box(-1.0, 1.0, (2,), np.float32)
ACT = gs.Discrete(3)
OAR = OBSERVATION | ACTION | REWARD


def _start(**kw) -> MultiAgentEpisodeStart:
    agents = {a: AgentSpec(a, "m", BOX, ACT) for a in ("a0", "a1")}
    return MultiAgentEpisodeStart("ep", "p", 1, agents, {"a0": [np.zeros(2, np.float32)]}, **kw)


def _col(agent: str, presence: list[int], k_obs: int, k_act: int, k_rew: int, **kw) -> AgentColumn:
    return AgentColumn(
        agent,
        np.array(presence, np.uint8),
        [np.zeros((k_obs, 2), np.float32)],
        [np.ones(k_act, np.int64)],
        np.full(k_rew, 0.5),
        **kw,
    )


def _batch(t0: int, cols: list[AgentColumn], n: int = 1, ended: bool = False) -> MultiAgentStepBatch:
    return MultiAgentStepBatch("ep", t0, np.zeros(n, np.uint8), cols, ended)


def _roundtrip(ev):
    return decode_event(*encode_event(ev))


# ------------------------------------------------------------------------------ hostile bytes


def _start_record(spaces: list[str], agents: int = 1) -> dict:
    return {
        "episode_id": "h",
        "policy_id": "p",
        "policy_version": 0,
        "env_id": "",
        "spaces": spaces,
        "agents": [
            {"agent_id": f"a{i}", "module_id": "m", "observation_space": 0, "action_space": 0} for i in range(agents)
        ],
        "reset": [],
        "timestamp_ms": 0,
    }


def test_compact_space_bounds_are_counted_before_anything_is_built():
    big = '{"type":"Box","shape":[4096,4096],"dtype":"float64","low":[0],"high":[1]}'  # 2 x 128 MiB if built
    text = '{"type":"Dict","spaces":[' + ",".join(f'["k{i}",{big}]' for i in range(8)) + "]}"
    value = encode_record("MultiAgentEpisodeStart", _start_record([text]))
    assert len(value) < 1000
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError) as e:
            decode_event(value, schema_header("MultiAgentEpisodeStart"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.reason == "bad-space" and "would take over" in str(e.value)
    assert peak < 4 * 2**20, peak
    # one such Box on its own is within the budget and is built
    ok = '{"type":"Box","shape":[64,64],"dtype":"float32","low":[0],"high":[1]}'
    ev = decode_event(
        encode_record("MultiAgentEpisodeStart", _start_record([ok])), schema_header("MultiAgentEpisodeStart")
    )
    assert ev.agents["a0"].observation_space.low.shape == (64, 64)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda r: r.update(env_flags=bytes(5000)), "bad-shape"),  # over MAX_BATCH_ENV_STEPS
        (lambda r: r.update(env_flags=b""), "bad-shape"),
        (lambda r: r.update(env_flags=b"\x02"), "bad-value"),  # "true" without "given"
        (lambda r: r["agents"][0].update(presence=b"\x07\x07"), "bad-shape"),  # 2 bytes for n=1
        (lambda r: r["agents"][0].update(presence=b"\x20"), "bad-value"),  # terminated true, not given
        (lambda r: r["agents"][0].update(presence=b"\x03"), "bad-shape"),  # a reward, no reward bit
        (lambda r: r["agents"].append(dict(r["agents"][0])), "bad-value"),  # two columns, one agent
        (lambda r: r["agents"][0]["rewards"].update(data=np.array([np.nan]).tobytes()), "non-finite-reward"),
        (lambda r: r["agents"][0].update(infos=["[1]"]), "bad-shape"),
        (lambda r: r["agents"][0].update(extra_rows={"nope": b"\x01"}), "bad-shape"),  # a mask of no output
        (  # two values of an output for one action
            lambda r: r["agents"][0]["extra_model_outputs"].update(
                x={"dtype": "float64", "shape": [2], "data": bytes(16)}
            ),
            "bad-shape",
        ),
    ],
)
def test_hostile_batches_are_refused(change, reason):
    good = _batch(0, [_col("a0", [OAR], 1, 1, 1)])
    _, headers = encode_event(good)
    from rlrec.producer.multi_agent_events import _batch_record

    rec = _batch_record(good)
    change(rec)
    with pytest.raises(DecodeError) as e:
        decode_event(encode_record("MultiAgentStepBatch", rec), headers)
    assert e.value.reason == reason


def test_agents_cells_and_module_ids_are_bounded_and_checked():
    h = schema_header("MultiAgentEpisodeStart")
    space = '{"type":"Discrete","n":2,"start":0,"dtype":"int64"}'
    with pytest.raises(DecodeError, match="possible agents"):
        decode_event(encode_record("MultiAgentEpisodeStart", _start_record([space], agents=1025)), h)
    for module in ("", "../x", "a/b", "x" * 200):
        rec = _start_record([space])
        rec["agents"][0]["module_id"] = module
        with pytest.raises(DecodeError) as e:
            decode_event(encode_record("MultiAgentEpisodeStart", rec), h)
        assert e.value.reason == "bad-policy-id", module
    rec = _start_record([space])
    rec["agents"][0]["observation_space"] = 7
    with pytest.raises(DecodeError, match="index out of range"):
        decode_event(encode_record("MultiAgentEpisodeStart", rec), h)


@pytest.mark.parametrize("name", ["multi_agent_episode_start", "multi_agent_step_batch", "reward_delta_agent"])
def test_mutated_golden_vectors_raise_only_decode_error(name):
    import json

    doc = json.loads((GOLDEN / f"{name}.json").read_text())
    value = (GOLDEN / doc["value_file"]).read_bytes()
    headers = [(k, v.encode()) for k, v in doc["headers"]]
    rng = random.Random(name)
    kinds = defaultdict(int)
    for _ in range(1500):
        b = bytearray(value)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            i = rng.randrange(len(b))
            if op < 0.6:
                b[i] = rng.randrange(256)
            elif op < 0.8:
                del b[i:]
                if not b:
                    b = bytearray(b"\x00")
            else:
                b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        try:
            ev = decode_event(bytes(b), headers)
            kinds[type(ev).__name__] += 1
        except DecodeError as e:
            kinds[e.reason] += 1
    assert len(kinds) >= 3, kinds  # several outcomes: the mutations reach past the first check


# ----------------------------------------------------------------------------- the fold's checks


def test_fold_refuses_inconsistent_sequences():
    start = _start()
    b0 = _batch(0, [_col("a0", [OAR], 1, 1, 1)])
    end = MultiAgentStepBatch(
        "ep", 1, np.array([ALL_TERMINATED | ALL_TERMINATED_TRUE], np.uint8), [_col("a0", [OAR], 1, 1, 1)], True
    )
    cases = {
        "out-of-order": [
            [b0],
            [start, _batch(1, [_col("a0", [OAR], 1, 1, 1)])],
            [start, b0, end, _batch(2, [_col("a0", [OAR], 1, 1, 1)])],
            [start, EpisodeAbort("ep"), b0],
            [start, _batch(0, [_col("a0", [OAR], 1, 1, 1)]).__class__("other", 0, np.zeros(1, np.uint8), [], False)],
        ],
        "unknown-agent": [
            [start, _batch(0, [_col("zz", [OAR], 1, 1, 1)])],
            [start, b0, RewardDelta("ep", 0, 1.0, 0, "zz")],
        ],
        "bad-value": [[start, b0, RewardDelta("ep", 5, 1.0, 0, "a0")], [start, b0, RewardDelta("ep", 0, 1.0, 0, "a1")]],
    }
    for reason, seqs in cases.items():
        for seq in seqs:
            with pytest.raises(DecodeError) as e:
                fold_multi_agent([_roundtrip(ev) for ev in seq])
            assert e.value.reason == reason, (reason, seq)
    bad_leaf = AgentColumn(
        "a0", np.array([OAR], np.uint8), [np.zeros((1, 3), np.float32)], [np.ones(1, np.int64)], np.ones(1)
    )
    with pytest.raises(DecodeError) as e:
        fold_multi_agent([start, _roundtrip(_batch(0, [bad_leaf]))])
    assert e.value.reason == "space-mismatch"
    out_of_range = AgentColumn(
        "a0", np.array([OAR], np.uint8), [np.zeros((1, 2), np.float32)], [np.full(1, 7)], np.ones(1)
    )
    with pytest.raises(DecodeError) as e:
        fold_multi_agent([start, _roundtrip(_batch(0, [out_of_range]))])
    assert e.value.reason == "out-of-space"
    assert fold_multi_agent([start, _roundtrip(_batch(0, [out_of_range]))], validate_values=False).steps[0].actions == {
        "a0": 7
    }
    f32 = _col("a0", [OAR], 1, 1, 1, extra_model_outputs={"action_logp": np.zeros(1, np.float32)})
    f64 = _col("a0", [OAR], 1, 1, 1, extra_model_outputs={"action_logp": np.zeros(1, np.float64)})
    with pytest.raises(DecodeError) as e:
        fold_multi_agent([start, _roundtrip(_batch(0, [f32])), _roundtrip(_batch(1, [f64]))])
    assert e.value.reason == "extra-output-mismatch"


def test_fold_of_a_consistent_sequence():
    rec = fold_multi_agent(
        [
            _start(infos={"a1": {"x": 1}}),
            _roundtrip(
                _batch(0, [_col("a0", [OAR, ACTION], 1, 2, 1), _col("a1", [REWARD, OBSERVATION], 1, 0, 1)], n=2)
            ),
            RewardDelta("ep", 0, 0.25, 0, "a1"),
            EpisodeAbort("ep", "x"),
        ]
    )
    assert rec.aborted and len(rec.steps) == 2 and rec.reset.infos == {"a1": {"x": 1}}
    assert rec.steps[0].rewards == {"a0": 0.5, "a1": 0.75} and rec.steps[1].rewards == {}
    assert set(rec.steps[1].actions) == {"a0"} and set(rec.steps[1].observations) == {"a1"}


# ------------------------------------------------------------------------- refused recorder calls


def test_a_refused_multi_agent_call_records_nothing():
    rec = EpisodeRecorder(NOWHERE, "t", kafka_config=QUIET)
    try:
        spaces = {"observation_spaces": {"a": BOX, "b": BOX}, "action_spaces": {"a": ACT, "b": ACT}}
        zero = np.zeros(2, np.float32)
        for bad in (
            {"observation_spaces": {"a": BOX}, "action_spaces": {"b": ACT}},
            {**spaces, "agent_modules": {"a": "../m", "b": "m"}},
            {**spaces, "agent_modules": {"a": "m"}},
        ):
            with pytest.raises(ValueError):
                rec.begin_multi_agent_episode({"a": zero}, **bad)
        with pytest.raises(ValueError, match="not a possible agent"):
            rec.begin_multi_agent_episode({"zz": zero}, **spaces)
        assert rec.stats.produced == 0
        eid = rec.begin_multi_agent_episode({"a": zero, "b": zero}, **spaces)
        before = rec.stats.produced
        refused = [
            ({"a": zero}, {"a": 1}, {}, {}, {}),  # acted and observed without a reward (RLlib refuses)
            ({"a": zero}, {"a": 1}, {"a": float("nan")}, {}, {}),
            ({"a": zero}, {"a": 9}, {"a": 1.0}, {"x": True}, {}),  # not a possible agent
            ({"a": np.zeros(3, np.float32)}, {"a": 1}, {"a": 1.0}, {}, {}),
            ({"a": zero}, {"a": 1}, {"a": 1.0}, {"a": "yes"}, {}),
            ({"a": None}, {"a": 1}, {"a": 1.0}, {}, {}),
        ]
        for args in refused:
            with pytest.raises((ValueError, TypeError)):
                rec.log_multi_agent_step(eid, *args)
        with pytest.raises(TypeError, match="dict of outputs"):
            rec.log_multi_agent_step(eid, {"a": zero}, {"a": 1}, {"a": 1.0}, {}, {}, extra_model_outputs={"a": -1.0})
        with pytest.raises(ValueError, match="did not act"):
            rec.log_multi_agent_step(eid, {"a": zero}, {}, {}, {}, {}, extra_model_outputs={"a": {"action_logp": -1.0}})
        assert rec.stats.produced == before
        assert rec.log_multi_agent_step(eid, {"a": zero}, {"a": 1}, {"a": 1.0}, {}, {}) is False
        assert rec.stats.produced == before + 1
        with pytest.raises(ValueError, match="multi-agent episode"):
            rec.log_step(eid, 0, 1.0, 0)
        with pytest.raises(ValueError, match="extra"):  # a's first action had none
            rec.log_multi_agent_step(
                eid, {"a": zero}, {"a": 1}, {"a": 1.0}, {}, {}, extra_model_outputs={"a": {"action_logp": -1.0}}
            )
        assert rec.stats.produced == before + 1
    finally:
        rec.close(timeout=0)


def test_recorder_without_spaces_records_only_multi_agent_episodes():
    rec = EpisodeRecorder(NOWHERE, "t", kafka_config=QUIET)
    try:
        with pytest.raises(TypeError, match="multi-agent episodes only"):
            rec.begin_episode(np.zeros(2, np.float32))
        with pytest.raises(TypeError, match="multi-agent episodes only"):
            rec.begin_episodes(np.zeros((2, 2), np.float32))
    finally:
        rec.close(timeout=0)
    with pytest.raises(TypeError):
        EpisodeRecorder(NOWHERE, "t", observation_space=BOX)


# --------------------------------------------------------------------------- refused wrapper steps


class _NanAtStep(gym.Env):
    """Rewards 1.0, NaN at step 2 of its first episode; episodes end at step 5."""

    observation_space = gs.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gs.Discrete(2)

    episodes = 0

    def reset(self, *, seed=None, options=None):
        self.t = 0
        self.episodes += 1
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        nan = self.t == 2 and self.episodes == 1
        return np.zeros(2, np.float32), float("nan") if nan else 1.0, self.t == 5, False, {}


def _events(broker, topic, n):
    by_key = defaultdict(list)
    for m in read_messages(broker.bootstrap_servers, topic, n):
        by_key[m.key().decode()].append(m)
    return by_key


def test_single_agent_wrapper_aborts_the_episode_when_a_step_is_refused(broker, topic):
    rec = EpisodeRecorder(  # batches end only with their episode (no 0.2 s age splits one on a busy machine)
        broker.bootstrap_servers,
        topic,
        observation_space=_NanAtStep.observation_space,
        action_space=gs.Discrete(2),
        max_batch_delay_s=3600,
    )
    env = RecordingWrapper(_NanAtStep(), rec)
    env.reset()
    first = env.episode_id
    env.step(0)
    with pytest.raises(ValueError, match="finite"):
        env.step(0)
    for _ in range(3):  # the rest of that episode passes through unrecorded
        env.step(0)
    env.reset()
    second = env.episode_id
    for _ in range(5):
        env.step(0)
    rec.close()
    got = _events(broker, topic, rec.stats.messages_produced)
    kinds = [decode(m.value(), m.headers()) for m in got[first]]
    assert [type(k).__name__ for k in kinds] == ["EpisodeStart", "StepBatch", "EpisodeAbort"]
    assert kinds[1].n == 1 and kinds[2].reason == "refused-step"
    assert [type(decode(m.value(), m.headers())).__name__ for m in got[second]] == ["EpisodeStart", "StepBatch"]


def test_multi_agent_wrapper_aborts_the_episode_when_a_step_is_refused(broker, topic):
    class TwoAgents:
        possible_agents = ("a", "b")

        def observation_space(self, a):
            return BOX

        def action_space(self, a):
            return ACT

        def reset(self, seed=None, options=None):
            self.agents, self.t = ["a", "b"], 0
            return {a: np.zeros(2, np.float32) for a in self.agents}, {}

        def step(self, actions):
            self.t += 1
            obs = {a: np.zeros(2, np.float32) for a in self.agents}
            rew = {"a": 1.0} if self.t == 2 else {"a": 1.0, "b": 1.0}  # b gets no reward at step 2
            return obs, rew, {}, {}, {}

        def close(self):
            pass

    rec = EpisodeRecorder(broker.bootstrap_servers, topic)
    env = MultiAgentRecordingWrapper(TwoAgents(), rec)
    env.reset()
    eid = env.episode_id
    env.step({"a": 0, "b": 0})
    with pytest.raises(ValueError, match="no reward"):
        env.step({"a": 0, "b": 0})
    env.step({"a": 0, "b": 0})  # passes through unrecorded
    env.close()
    rec.close()
    evs = [decode_event(m.value(), m.headers()) for m in _events(broker, topic, rec.stats.messages_produced)[eid]]
    assert [type(e).__name__ for e in evs] == ["MultiAgentEpisodeStart", "MultiAgentStepBatch", "EpisodeAbort"]
    assert evs[2].reason == "refused-step"
    r = fold_multi_agent(evs)
    assert r.aborted and len(r.steps) == 1


def test_rllib_common_infos_are_accepted_and_not_recorded_as_rllib_does(broker, topic):
    from ray.rllib.env.multi_agent_env import MultiAgentEnv

    class Common(MultiAgentEnv):
        def __init__(self):
            super().__init__()
            self.possible_agents = self.agents = ["a"]
            self.observation_spaces, self.action_spaces = {"a": BOX}, {"a": ACT}

        def reset(self, *, seed=None, options=None):
            self.t = 0
            return {"a": np.zeros(2, np.float32)}, {"a": {"r": 0}, "__common__": {"x": 0}}

        def step(self, actions):
            self.t += 1
            obs = {"a": np.zeros(2, np.float32)}
            return obs, {"a": 1.0}, {"__all__": self.t >= 3}, {"__all__": False}, {"a": {}, "__common__": {"t": self.t}}

    rec = EpisodeRecorder(broker.bootstrap_servers, topic)
    env = MultiAgentRecordingWrapper(Common(), rec)
    env.reset()
    eid = env.episode_id
    for _ in range(3):
        env.step({"a": 1})
    rec.close()
    evs = [decode_event(m.value(), m.headers()) for m in _events(broker, topic, rec.stats.messages_produced)[eid]]
    assert [type(e).__name__ for e in evs] == ["MultiAgentEpisodeStart", "MultiAgentStepBatch"]
    r = fold_multi_agent(evs)
    assert len(r.steps) == 3 and not r.aborted and r.steps[-1].terminateds == {"__all__": True}
    assert r.reset.infos == {"a": {"r": 0}} and all(s.infos == {"a": {}} for s in r.steps)


def test_spaces_are_parsed_once_per_text_and_shared_by_later_starts():
    n = (64 * 2**20 - SPACE_NODE_NBYTES) // 4  # uint8: 2 bounds + 2 masks per element, just under the per-start cap
    text = json.dumps({"type": "Box", "shape": [n], "dtype": "uint8", "low": [0], "high": [1]})
    value = encode_record("MultiAgentEpisodeStart", _start_record([text]))
    assert len(value) < 1000
    header = schema_header("MultiAgentEpisodeStart")
    first = decode_event(value, header)
    tracemalloc.start()
    try:
        again = [decode_event(value, header) for _ in range(4)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak  # 64 MiB each if it were built again
    spaces = {id(ev.agents["a0"].observation_space) for ev in [first, *again]}
    assert len(spaces) == 1 and first.agents["a0"].observation_space.shape == (n,)


# ------------------------------------------- values every begin and step call refuses alike

UNBOUNDED = gs.Box(-np.inf, np.inf, (2,), np.float32)  # contains ±inf


def _both_kinds(**kw) -> EpisodeRecorder:
    return EpisodeRecorder(NOWHERE, "t", observation_space=UNBOUNDED, action_space=ACT, kafka_config=QUIET, **kw)


def test_a_policy_version_beyond_an_avro_long_is_refused_by_every_begin():
    rec = _both_kinds()
    ma = {"observation_spaces": {"a": BOX}, "action_spaces": {"a": ACT}}
    zero = np.zeros(2, np.float32)
    try:
        for v in (2**63, 2**64 + 5, 2**70):  # wrapped, the varint would read as -1, 4, 64
            with pytest.raises(ValueError, match=r"below 2\*\*63"):
                rec.begin_episode(zero, policy_version=v)
            with pytest.raises(ValueError, match=r"below 2\*\*63"):
                rec.begin_episodes(zero[None], policy_versions=[v])
            with pytest.raises(ValueError, match=r"below 2\*\*63"):
                rec.begin_multi_agent_episode({"a": zero}, policy_version=v, **ma)
            with pytest.raises(ValueError, match=r"below 2\*\*63"):
                rec.policy_version = v
            with pytest.raises(ValueError, match=r"below 2\*\*63"):
                EpisodeRecorder(NOWHERE, "t", policy_version=v, kafka_config=QUIET)
        assert rec.stats.produced == 0 and rec.policy_version == 1
        rec.begin_episode(zero, policy_version=2**63 - 1)
        eid = rec.begin_multi_agent_episode({"a": zero}, policy_version=np.uint64(2**63 - 1), **ma)
        assert rec.stats.produced == 2 and rec.open_episodes == 2
        assert "a" in rec._episodes[eid].agent_set
    finally:
        rec.close(timeout=0)


def test_a_reward_beyond_the_float_range_is_a_value_error_in_every_call():
    rec = _both_kinds()
    zero = np.zeros(2, np.float32)
    try:
        eid = rec.begin_episode(zero)
        rec.log_step(eid, 1, 1.0, zero)
        mid = rec.begin_multi_agent_episode({"a": zero}, observation_spaces={"a": BOX}, action_spaces={"a": ACT})
        rec.log_multi_agent_step(mid, {"a": zero}, {"a": 1}, {"a": 1.0}, {}, {})
        before = rec.stats.produced
        for huge in (10**400, -(10**400)):
            with pytest.raises(ValueError, match="finite"):
                rec.log_step(eid, 1, huge, zero)
            with pytest.raises(ValueError, match="finite"):
                rec.log_steps([eid], [1], [huge], zero[None], [False], [False])
            with pytest.raises(ValueError, match="finite"):
                rec.log_reward(eid, 0, huge)
            with pytest.raises(ValueError, match=r"rewards\['a'\] must be finite"):
                rec.log_multi_agent_step(mid, {"a": zero}, {"a": 1}, {"a": huge}, {}, {})
            with pytest.raises(ValueError, match="finite"):
                rec.log_multi_agent_reward(mid, 0, "a", huge)
        with pytest.raises(TypeError, match="must be a number"):
            rec.log_multi_agent_step(mid, {"a": zero}, {"a": 1}, {"a": "x"}, {}, {})
        assert rec.stats.produced == before
        rec.log_step(eid, 1, 10**300, zero)  # an int a float holds is a reward
        assert rec.stats.produced == before + 1
    finally:
        rec.close(timeout=0)


def test_validate_spaces_refuses_the_nan_and_inf_a_strict_consumer_dead_letters():
    rec = _both_kinds(validate_spaces=True)
    ma = {"observation_spaces": {"a": UNBOUNDED}, "action_spaces": {"a": UNBOUNDED}}
    zero = np.zeros(2, np.float32)
    try:
        assert UNBOUNDED.contains(np.array([np.inf, 0], np.float32))  # what `contains` alone lets through
        for bad in (np.array([np.inf, 0], np.float32), np.array([0, np.nan], np.float32)):
            with pytest.raises(ValueError, match=r"NaN or ±inf|is not in"):  # NaN: `contains` says no
                rec.begin_episode(bad)
            with pytest.raises(ValueError, match=r"NaN or ±inf|is not in"):
                rec.begin_episodes(bad[None])
            with pytest.raises(ValueError, match=r"NaN or ±inf|is not in"):
                rec.begin_multi_agent_episode({"a": bad}, **ma)
        eid = rec.begin_episode(zero)
        mid = rec.begin_multi_agent_episode({"a": zero}, **ma)
        before = rec.stats.produced
        inf = np.array([-np.inf, 1], np.float32)
        with pytest.raises(ValueError, match="NaN or ±inf"):
            rec.log_step(eid, 1, 1.0, inf)
        with pytest.raises(ValueError, match="NaN or ±inf"):
            rec.log_steps([eid], [1], [1.0], inf[None], [False], [False])
        with pytest.raises(ValueError, match="observation of 'a' holds NaN or ±inf"):
            rec.log_multi_agent_step(mid, {"a": inf}, {"a": zero}, {"a": 1.0}, {}, {})
        with pytest.raises(ValueError, match="action of 'a' holds NaN or ±inf"):
            rec.log_multi_agent_step(mid, {"a": zero}, {"a": inf}, {"a": 1.0}, {}, {})
        assert rec.stats.produced == before
        rec.log_multi_agent_step(mid, {"a": zero}, {"a": np.full(2, 1e38, np.float32)}, {"a": 1.0}, {}, {})
        assert rec.stats.produced == before + 1
    finally:
        rec.close(timeout=0)


def test_a_reset_observation_is_judged_as_an_env_steps_by_the_consumer():
    inf = np.array([np.inf, 0], np.float32)
    agents = {"a": AgentSpec("a", "m", UNBOUNDED, ACT)}
    start = MultiAgentEpisodeStart("ep", "p", 1, agents, {"a": [inf]})
    col = AgentColumn("a", np.array([OAR], np.uint8), [inf[None]], [np.ones(1, np.int64)], np.full(1, 0.5))
    batch = MultiAgentStepBatch("ep", 0, np.zeros(1, np.uint8), [col], False)
    events = [_roundtrip(start), _roundtrip(batch)]  # decoding judges neither value
    with pytest.raises(DecodeError) as e:  # --validate-spaces strict: the episode as a whole
        fold_multi_agent(events[:1])
    assert e.value.reason == "non-finite-value" and "reset observation of 'a'" in e.value.detail
    with pytest.raises(DecodeError) as e:
        fold_multi_agent(
            [_roundtrip(MultiAgentEpisodeStart("ep", "p", 1, agents, {"a": [np.zeros(2, np.float32)]})), *events[1:]]
        )
    assert e.value.reason == "non-finite-value" and "observations" in e.value.detail
    rec = fold_multi_agent(events, validate_values=False)  # shape / off: kept as recorded
    np.testing.assert_array_equal(rec.reset.observations["a"], inf)
    np.testing.assert_array_equal(rec.steps[0].observations["a"], inf)


def test_single_and_multi_agent_steps_keep_and_refuse_the_same_propensities():
    rec = _both_kinds()
    zero = np.zeros(2, np.float32)
    try:
        eid = rec.begin_episode(zero)
        mid = rec.begin_multi_agent_episode({"a": zero}, observation_spaces={"a": BOX}, action_spaces={"a": ACT})
        for lp in (1e-5, np.inf, np.nan, np.float32(0.5), -np.inf, np.float16(np.nan)):
            before = rec.stats.produced
            with pytest.raises(ValueError, match="action_logp"):
                rec.log_step(eid, 1, 1.0, zero, extra_model_outputs={"action_logp": lp})
            with pytest.raises(ValueError, match="action_logp"):
                rec.log_multi_agent_step(
                    mid, {"a": zero}, {"a": 1}, {"a": 1.0}, {}, {}, extra_model_outputs={"a": {"action_logp": lp}}
                )
            assert rec.stats.produced == before
        for lp in (0.0, -1.0, 1e-7, np.float16(-0.5), np.float64(-2.0)):
            rec.log_step(eid, 1, 1.0, zero, extra_model_outputs={"action_logp": lp})
            rec.log_multi_agent_step(
                mid, {"a": zero}, {"a": 1}, {"a": 1.0}, {}, {}, extra_model_outputs={"a": {"action_logp": lp}}
            )
        assert rec._episodes[mid].steps[-1][1]["a"][5] == np.float64(-2.0)
    finally:
        rec.close(timeout=0)
