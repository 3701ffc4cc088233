"""EpisodeRecorder and RecordingWrapper: producer -> broker -> decode equals what was logged.

Tests marked `broker` use the session broker (tests/conftest.py); the others need no broker
(an unreachable bootstrap address, librdkafka's logging silenced).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import psutil
import pytest
from gymnasium import spaces as gs

from rlrec.consumer.topics import create_topics
from rlrec.local import LocalBroker
from rlrec.producer import (
    EpisodeRecorder,
    RecorderForkedError,
    RecorderFullError,
    RecordingWrapper,
)
from rlrec.producer.events import (
    SCHEMA_HEADER,
    EpisodeAbort,
    EpisodeStart,
    RewardDelta,
    StepBatch,
    check_leaves,
    decode,
)
from rlrec.producer.spaces import flatten_value, space_leaves, unflatten_leaves
from tests.helpers import frozen_recorder_clock, wait_for

NOWHERE = "127.0.0.1:1"  # nothing listens there: records stay buffered until they time out
QUIET = {"log_level": 0}  # librdkafka would log every refused connection to stderr
OBS = gs.Box(-np.inf, np.inf, (3,), np.float32)
ACT = gs.Discrete(3)


# ------------------------------------------------------------------------------------ helpers


@pytest.fixture
def recorders():
    """Factory for recorders that are closed (briefly) at the end of the test."""
    made: list[EpisodeRecorder] = []

    def make(bootstrap: str, topic: str = "rlrec.test", **kw) -> EpisodeRecorder:
        kw.setdefault("observation_space", OBS)
        kw.setdefault("action_space", ACT)
        if bootstrap == NOWHERE:  # records stay buffered (until message.timeout.ms, 300 s by default)
            kw["kafka_config"] = {**QUIET, **kw.get("kafka_config", {})}
        rec = EpisodeRecorder(bootstrap, topic, **kw)
        made.append((rec, bootstrap))
        return rec

    yield make
    for rec, bootstrap in made:
        rec.close(timeout=0 if bootstrap == NOWHERE else 3)
    made.clear()  # drop the Kafka clients now: Tansu drains open connections for 5 s when stopped
    gc.collect()


def read_messages(bootstrap: str, topic: str, n: int, timeout: float = 15.0, settle: float = 0.2) -> list:
    """Read `n` messages of `topic` from the beginning (then `settle` s more, to catch extras).

    Partitions are assigned directly (no group join), so this starts at once; within a
    partition the messages come in offset order.
    """
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"read-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 50,
        }
    )
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        got: list = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(got) >= n:
                deadline = min(deadline, time.monotonic() + settle)
            m = c.poll(0.05)
            if m is None:
                continue
            assert not m.error(), m.error()
            got.append(m)
        return got
    finally:
        c.close()


@dataclass
class Seen:
    """The decoded events of one episode, in order."""

    events: list = field(default_factory=list)
    partitions: set = field(default_factory=set)

    @property
    def kinds(self) -> list[str]:
        return [e.KIND for e in self.events]

    @property
    def start(self) -> EpisodeStart:
        assert isinstance(self.events[0], EpisodeStart), self.kinds
        return self.events[0]

    @property
    def batches(self) -> list[StepBatch]:
        return [e for e in self.events if isinstance(e, StepBatch)]

    @property
    def deltas(self) -> list[RewardDelta]:
        return [e for e in self.events if isinstance(e, RewardDelta)]

    @property
    def abort(self) -> EpisodeAbort | None:
        aborts = [e for e in self.events if isinstance(e, EpisodeAbort)]
        assert len(aborts) <= 1
        return aborts[0] if aborts else None

    @property
    def length(self) -> int:
        return sum(b.n for b in self.batches)

    def column(self, attr: str, i: int = 0) -> np.ndarray:
        return np.concatenate([getattr(b, attr)[i] for b in self.batches])

    def rewards(self) -> np.ndarray:
        return np.concatenate([b.rewards for b in self.batches]) if self.batches else np.zeros(0)

    def extra(self, key: str) -> np.ndarray:
        return np.concatenate([b.extra_model_outputs[key] for b in self.batches])

    def infos(self) -> list[dict]:
        return [i for b in self.batches for i in (b.infos if b.infos is not None else [{}] * b.n)]

    def check_batches(self) -> None:
        """t0s are consecutive from 0 and only the last batch may end the episode."""
        t = 0
        for j, b in enumerate(self.batches):
            assert b.t0 == t, [(x.t0, x.n) for x in self.batches]
            t += b.n
            if j < len(self.batches) - 1:
                assert not (b.terminated or b.truncated)
        for b in self.batches:
            check_leaves(b.observations, space_leaves(self.start.observation_space), b.n, "observations")
            check_leaves(b.actions, space_leaves(self.start.action_space), b.n, "actions")


def decode_all(msgs: list) -> dict[str, Seen]:
    out: dict[str, Seen] = defaultdict(Seen)
    for m in msgs:
        ev = decode(m.value(), m.headers())
        assert m.key() == ev.episode_id.encode()
        assert dict(m.headers())[SCHEMA_HEADER] == f"{ev.KIND}/1".encode()
        out[ev.episode_id].events.append(ev)
        out[ev.episode_id].partitions.add(m.partition())
    for s in out.values():
        assert len(s.partitions) == 1  # one key, one partition: the episode's events stay in order
    return dict(out)


def consume(rec: EpisodeRecorder, broker, topic: str) -> dict[str, Seen]:
    assert rec.flush(10) == 0
    st = rec.stats
    assert st.buffered == 0 and st.failed == 0
    msgs = read_messages(broker.bootstrap_servers, topic, st.messages_delivered)
    assert len(msgs) == st.messages_delivered
    return decode_all(msgs)


def assert_info_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, w in want.items():
        if isinstance(w, np.ndarray):
            assert got[k].dtype == w.dtype and np.array_equal(got[k], w)
        elif isinstance(w, dict):
            assert_info_equal(got[k], w)
        else:
            assert got[k] == w


# ---------------------------------------------------------------------- round trips (broker)


@pytest.mark.broker
def test_interleaved_episodes_in_threads_round_trip(broker, topic, recorders):
    rec = recorders(
        broker.bootstrap_servers,
        topic,
        policy_id="p-threads",
        policy_version=7,
        env_id="Synthetic-v0",
        max_batch_steps=8,
        max_batch_delay_s=60.0,
    )  # batches go out at 8 steps or at the end
    n_threads, per_thread = 4, 3
    logged: dict[str, dict] = {}
    records = [0] * n_threads
    errors: list = []

    def worker(w: int) -> None:
        try:
            rng = np.random.default_rng(w)
            eps = []
            for j in range(per_thread):
                obs0 = rng.standard_normal(3).astype(np.float32)
                info0 = {"worker": w, "nested": {"j": j, "ids": [1, 2]}, "arr": np.arange(3, dtype=np.int32) + w}
                eid = rec.begin_episode(obs0, info=info0, episode_id=f"w{w}-e{j}")
                e = {
                    "id": eid,
                    "how": ("terminated", "truncated", "aborted")[(w + j) % 3],
                    "obs0": obs0,
                    "info0": info0,
                    "length": int(rng.integers(12, 30)),
                    "steps": [],
                    "delays": [],
                    "done": False,
                }
                eps.append(e)
                logged[eid] = e
                records[w] += 1
            while not all(e["done"] for e in eps):  # one step of each open episode in turn
                for e in eps:
                    if e["done"]:
                        continue
                    t = len(e["steps"])
                    last = t == e["length"] - 1
                    if last and e["how"] == "aborted":
                        rec.abort_episode(e["id"], reason="test-abort")
                        records[w] += 1
                        e["done"] = True
                        continue
                    a = int(rng.integers(0, 3))
                    r = float(rng.standard_normal())
                    o = rng.standard_normal(3).astype(np.float32)
                    info = {"t": t, "v": np.full(2, t, np.float64)} if t % 4 == 0 else {}
                    extra = {
                        "action_logp": np.float32(-t / 10),
                        "action_dist_inputs": rng.standard_normal(3).astype(np.float32),
                    }
                    rec.log_step(
                        e["id"],
                        a,
                        r,
                        o,
                        terminated=last and e["how"] == "terminated",
                        truncated=last and e["how"] == "truncated",
                        info=info,
                        extra_model_outputs=extra,
                    )
                    records[w] += 1
                    e["steps"].append((a, r, o, info, extra))
                    e["done"] = last
                    if t == 9:  # steps 0..7 went out as one batch; 8 and 9 are still buffered
                        rec.log_reward(e["id"], 2, 0.5)  # already sent: a RewardDelta message (a record)
                        rec.log_reward(e["id"], 8, 0.25)  # still buffered: summed into the batch (no record)
                        e["delays"] += [(2, 0.5, "sent"), (8, 0.25, "buffered")]
                        records[w] += 1
            for e in eps:  # after the end: a RewardDelta
                rec.log_reward(e["id"], 0, 2.0)
                e["delays"].append((0, 2.0, "sent"))
                records[w] += 1
        except BaseException as ex:  # pragma: no cover - reported below
            errors.append(ex)
            raise

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors, errors
    seen = consume(rec, broker, topic)
    st = rec.stats
    assert st.delivered == st.produced == sum(records) and st.dropped == 0
    assert st.episodes_begun == n_threads * per_thread
    assert set(seen) == set(logged)

    for eid, e in logged.items():
        s = seen[eid]
        start = s.start
        assert (start.policy_id, start.policy_version, start.env_id) == ("p-threads", 7, "Synthetic-v0")
        assert start.observation_space == OBS and start.action_space == ACT
        np.testing.assert_array_equal(start.observation[0], e["obs0"])
        assert_info_equal(start.info, e["info0"])
        s.check_batches()
        assert all(b.n <= 8 for b in s.batches)
        steps = e["steps"]
        assert s.length == len(steps)
        np.testing.assert_array_equal(s.column("actions"), [a for a, *_ in steps])
        assert s.column("actions").dtype == np.int64
        np.testing.assert_array_equal(s.column("observations"), np.stack([o for _, _, o, *_ in steps]))
        np.testing.assert_array_equal(s.extra("action_logp"), [x["action_logp"] for *_, x in steps])
        np.testing.assert_array_equal(
            s.extra("action_dist_inputs"), np.stack([x["action_dist_inputs"] for *_, x in steps])
        )
        for got, (*_, info, _) in zip(s.infos(), steps):
            assert_info_equal(got, info)
        # rewards: the batch carries the logged reward plus delays that arrived while it was buffered
        want = np.array([r for _, r, *_ in steps])
        for t, d, when in e["delays"]:
            if when == "buffered":
                want[t] += d
        np.testing.assert_array_equal(s.rewards(), want)
        assert sorted((d.t, d.reward) for d in s.deltas) == sorted(
            (t, d) for t, d, when in e["delays"] if when == "sent"
        )
        for d in s.deltas:  # a RewardDelta follows the batch holding its step
            first_after = next(i for i, ev in enumerate(s.events) if isinstance(ev, StepBatch) and ev.t0 + ev.n > d.t)
            assert s.events.index(d) > first_after
        total = s.rewards().sum() + sum(d.reward for d in s.deltas)
        assert total == pytest.approx(sum(r for _, r, *_ in steps) + sum(d for _, d, _ in e["delays"]))
        last = s.batches[-1]
        assert (last.terminated, last.truncated) == (e["how"] == "terminated", e["how"] == "truncated")
        if e["how"] == "aborted":
            assert s.abort is not None and s.abort.reason == "test-abort"
            assert s.kinds.index("EpisodeAbort") > s.kinds.index("StepBatch")
        else:
            assert s.abort is None


def nested_obs_space() -> gs.Dict:
    return gs.Dict(
        [
            ("pos", gs.Box(-1, 1, (2, 2), np.float32)),
            (
                "inv",
                gs.Tuple(
                    [gs.Discrete(4, start=1), gs.Dict([("z", gs.MultiBinary(3)), ("a", gs.Box(0, 9, (), np.int16))])]
                ),
            ),
            ("mask", gs.MultiBinary([2, 2])),
        ]
    )


@pytest.mark.broker
@pytest.mark.filterwarnings("ignore:.*Casting input x to numpy array")  # gymnasium: 0-d Box samples are scalars
def test_dict_observation_space_round_trip(broker, topic, recorders):
    obs_space = nested_obs_space()
    act_space = gs.Tuple([gs.Discrete(3), gs.MultiDiscrete([[2, 3], [4, 5]])])
    obs_space.seed(1)
    act_space.seed(2)
    rec = recorders(
        broker.bootstrap_servers,
        topic,
        observation_space=obs_space,
        action_space=act_space,
        validate_spaces=True,
        max_batch_steps=2,
    )
    obs0 = obs_space.sample()
    eid = rec.begin_episode(obs0, info={"map": np.eye(2, dtype=np.uint8)})
    steps = []
    for t in range(5):
        a, o = act_space.sample(), obs_space.sample()
        rec.log_step(
            eid,
            a,
            float(t),
            o,
            terminated=t == 4,
            info={"t": t},
            extra_model_outputs={"action_logp": np.float64(-t), "logits": np.full((2, 3), t, np.float32)},
        )
        steps.append((a, o))
    s = consume(rec, broker, topic)[eid]
    start = s.start
    assert list(start.observation_space.spaces) == ["pos", "inv", "mask"]
    assert start.observation_space == obs_space and start.action_space == act_space
    first = unflatten_leaves(start.observation_space, start.observation)
    assert obs_space.contains(first)
    for got, want in zip(start.observation, flatten_value(obs_space, obs0)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(start.info["map"], np.eye(2, dtype=np.uint8))
    s.check_batches()
    assert [(b.t0, b.n) for b in s.batches] == [(0, 2), (2, 2), (4, 1)] and s.batches[-1].terminated
    for b in s.batches:
        check_leaves(b.observations, space_leaves(start.observation_space), b.n, "observations")
        check_leaves(b.actions, space_leaves(start.action_space), b.n, "actions")
        for i in range(b.n):
            a, o = steps[b.t0 + i]
            got_o = unflatten_leaves(obs_space, [np.asarray(x[i]) for x in b.observations])
            got_a = unflatten_leaves(act_space, [np.asarray(x[i]) for x in b.actions])
            assert obs_space.contains(got_o) and act_space.contains(got_a)
            for g, w in zip(flatten_value(obs_space, got_o), flatten_value(obs_space, o)):
                np.testing.assert_array_equal(g, w)
            for g, w in zip(flatten_value(act_space, got_a), flatten_value(act_space, a)):
                np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(s.extra("logits"), [np.full((2, 3), t, np.float32) for t in range(5)])
    assert s.extra("action_logp").dtype == np.float64
    assert s.infos() == [{"t": t} for t in range(5)]


@pytest.mark.broker
def test_recording_wrapper_cartpole(broker, topic, recorders):
    env = gym.make("CartPole-v1")
    rec = recorders(
        broker.bootstrap_servers,
        topic,
        policy_id="cartpole",
        observation_space=env.observation_space,
        action_space=env.action_space,
        env_id="CartPole-v1",
    )
    wrapped = RecordingWrapper(env, rec)
    env.action_space.seed(0)
    rng = np.random.default_rng(0)
    runs: dict[str, dict] = {}
    # plan: (controller, steps before leaving early, how it leaves)
    plan = [("random", None, None), ("scripted", None, None), ("random", 5, "reset"), ("random", 3, "close")]
    for k, (controller, cut, how) in enumerate(plan):
        obs, _info = wrapped.reset(seed=100 + k)
        run = runs[wrapped.episode_id] = {"obs0": obs.copy(), "steps": [], "how": how}
        while True:
            if cut is not None and len(run["steps"]) == cut:
                if how == "close":
                    wrapped.close()
                break  # "reset": the next reset() aborts it
            action = int(obs[2] + 0.5 * obs[3] > 0) if controller == "scripted" else int(env.action_space.sample())
            p = float(rng.uniform(0.5, 1.0))
            outputs = {"action_logp": np.float32(np.log(p)), "action_dist_inputs": np.array([p, 1 - p], np.float32)}
            wrapped.set_model_outputs(outputs)
            obs, reward, terminated, truncated, _info = wrapped.step(action)
            run["steps"].append((action, reward, obs.copy(), terminated, truncated, outputs))
            if terminated or truncated:
                assert wrapped.episode_id is None
                break
    with pytest.raises(RuntimeError):
        wrapped.step(0)  # closed: no open episode
    seen = consume(rec, broker, topic)
    assert set(seen) == set(runs)
    for eid, run in runs.items():
        s = seen[eid]
        np.testing.assert_array_equal(s.start.observation[0], run["obs0"])
        assert s.start.env_id == "CartPole-v1" and s.start.policy_id == "cartpole"
        s.check_batches()
        steps = run["steps"]
        assert s.length == len(steps)
        np.testing.assert_array_equal(s.column("actions"), [a for a, *_ in steps])
        np.testing.assert_array_equal(s.rewards(), [r for _, r, *_ in steps])
        np.testing.assert_array_equal(s.column("observations"), np.stack([o for _, _, o, *_ in steps]))
        np.testing.assert_array_equal(s.extra("action_logp"), [x["action_logp"] for *_, x in steps])
        np.testing.assert_array_equal(
            s.extra("action_dist_inputs"), np.stack([x["action_dist_inputs"] for *_, x in steps])
        )
        last = s.batches[-1]
        if run["how"] is None:
            assert (last.terminated, last.truncated) == steps[-1][3:5] and s.abort is None
        else:
            assert not (last.terminated or last.truncated)
            assert s.abort.reason == {"reset": "reset", "close": "env-closed"}[run["how"]]
            assert s.kinds[-1] == "EpisodeAbort"
    scripted = seen[list(runs)[1]]
    assert scripted.length == 500 and scripted.batches[-1].truncated  # the controller balances to the time limit


@pytest.mark.broker
def test_small_max_batch_steps_splits_episode(broker, topic, recorders):
    rec = recorders(broker.bootstrap_servers, topic, max_batch_steps=3, max_batch_delay_s=60.0)
    eid = rec.begin_episode(np.zeros(3, np.float32))
    for t in range(10):
        rec.log_step(eid, t % 3, float(t), np.full(3, t, np.float32), terminated=t == 9)
    s = consume(rec, broker, topic)[eid]
    assert s.kinds == ["EpisodeStart"] + ["StepBatch"] * 4
    assert [(b.t0, b.n) for b in s.batches] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert [b.terminated for b in s.batches] == [False, False, False, True]
    np.testing.assert_array_equal(s.rewards(), np.arange(10.0))
    np.testing.assert_array_equal(s.column("observations")[:, 0], np.arange(10.0))


@pytest.mark.broker
def test_max_batch_delay_sends_partial_batch(broker, topic, recorders, monkeypatch):
    clock = frozen_recorder_clock(monkeypatch)
    rec = recorders(broker.bootstrap_servers, topic, max_batch_steps=100, max_batch_delay_s=0.2)
    eid = rec.begin_episode(np.zeros(3, np.float32))
    for _t in range(3):
        rec.log_step(eid, 1, 1.0, np.ones(3, np.float32))
    assert rec.stats.messages_produced == 1  # the steps wait while the clock stands
    clock.run()  # no flush(), no close(): only their age sends them
    msgs = read_messages(broker.bootstrap_servers, topic, 2, timeout=60, settle=0.0)
    assert time.monotonic() - clock.frozen_at >= 0.2
    s = decode_all(msgs)[eid]
    assert s.kinds == ["EpisodeStart", "StepBatch"]
    assert (s.batches[0].t0, s.batches[0].n, s.batches[0].terminated) == (0, 3, False)
    # read back, but its delivery report reaches the recorder on the poller's next poll
    wait_for(lambda: rec.stats.buffered == 0, 60, what="the batch's delivery report")
    assert rec.open_episodes == 1 and rec.stats.delivered == 4


# ------------------------------------------------------------------------------ overflow


def test_overflow_raise(recorders):
    rec = recorders(
        NOWHERE,
        max_buffered_steps=3,
        on_overflow="raise",
        max_batch_delay_s=60.0,
        kafka_config={"message.timeout.ms": 1500},
    )
    eid = rec.begin_episode(np.zeros(3, np.float32))
    rec.log_step(eid, 0, 1.0, np.zeros(3, np.float32))
    rec.log_step(eid, 0, 1.0, np.zeros(3, np.float32))
    before = rec.stats
    assert before.buffered == 3
    with pytest.raises(RecorderFullError):
        rec.log_step(eid, 0, 1.0, np.zeros(3, np.float32))
    with pytest.raises(RecorderFullError):
        rec.begin_episode(np.zeros(3, np.float32), episode_id="never")
    assert rec.open_episodes == 1  # the refused episode was not left half-open
    assert rec.stats == before  # nothing counted for refused records
    assert issubclass(RecorderFullError, BufferError)
    assert rec.close(timeout=5) == 0  # the abort always gets room; everything times out after 1.5 s
    st = rec.stats
    assert (st.delivered, st.failed, st.buffered, st.dropped) == (0, 4, 0, 0)


@pytest.mark.broker
def test_overflow_drop(broker, topic, recorders):
    # linger.ms 10 s: nothing is delivered before flush(), so the buffer fills deterministically
    rec = recorders(
        broker.bootstrap_servers,
        topic,
        max_buffered_steps=6,
        on_overflow="drop",
        max_batch_steps=2,
        max_batch_delay_s=60.0,
        kafka_config={"linger.ms": 10_000},
    )
    z = np.zeros(3, np.float32)
    a = rec.begin_episode(z, episode_id="A")  # 1
    rec.log_step(a, 0, 1.0, z)
    rec.log_step(a, 0, 1.0, z)  # 3: batch [0, 1] handed to librdkafka
    rec.log_step(a, 0, 1.0, z)  # 4: step 2 buffered
    b = rec.begin_episode(z, episode_id="B")  # 5
    rec.log_step(b, 1, 2.0, z)  # 6: full
    assert rec.stats.buffered == 6 and rec.stats.dropped == 0
    rec.log_step(a, 0, 1.0, z)  # dropped; A's unsent step 2 too; A's sent part is closed by an abort
    assert rec.stats.dropped == 2
    rec.log_step(a, 0, 1.0, z)  # A is dropping: dropped
    rec.log_step(a, 0, 1.0, z, terminated=True)  # dropped, and A ends
    assert rec.stats.dropped == 4
    with pytest.raises(ValueError):
        rec.log_step(a, 0, 1.0, z)  # A is over
    c = rec.begin_episode(z, episode_id="C")  # dropped: nothing of C is sent
    rec.log_step(c, 0, 1.0, z)
    rec.abort_episode(c)
    st = rec.stats
    assert (st.dropped, st.buffered, st.produced, st.delivered) == (6, 6, 6, 0)
    assert rec.flush(10) == 0
    rec.log_step(b, 1, 3.0, z, terminated=True)
    seen = consume(rec, broker, topic)
    st = rec.stats
    assert (st.delivered, st.failed, st.buffered, st.dropped) == (7, 0, 0, 6)
    assert set(seen) == {"A", "B"}
    assert seen["A"].kinds == ["EpisodeStart", "StepBatch", "EpisodeAbort"]
    assert seen["A"].abort.reason == "dropped" and (seen["A"].batches[0].t0, seen["A"].batches[0].n) == (0, 2)
    assert [(x.t0, x.n) for x in seen["B"].batches] == [(0, 1), (1, 1)] and seen["B"].batches[-1].terminated
    np.testing.assert_array_equal(seen["B"].rewards(), [2.0, 3.0])


@pytest.mark.broker
def test_overflow_block_waits_for_space(broker, topic, recorders):
    # linger.ms 10 s: deliveries happen only when the main thread flushes
    rec = recorders(
        broker.bootstrap_servers,
        topic,
        max_buffered_steps=4,
        on_overflow="block",
        max_batch_steps=2,
        max_batch_delay_s=60.0,
        kafka_config={"linger.ms": 10_000},
    )
    n = 40
    progress = [0]

    def run() -> None:
        eid = rec.begin_episode(np.zeros(3, np.float32), episode_id="blocked")
        for t in range(n):
            rec.log_step(eid, t % 3, float(t), np.full(3, t, np.float32), terminated=t == n - 1)
            progress[0] = t + 1

    th = threading.Thread(target=run)
    th.start()
    deadline = time.monotonic() + 10
    while rec.stats.buffered < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    stuck_at = progress[0]
    time.sleep(0.3)
    assert th.is_alive() and progress[0] == stuck_at < n  # waiting for room
    assert rec.stats.buffered == 4
    deadline = time.monotonic() + 30
    while th.is_alive() and time.monotonic() < deadline:
        rec.flush(1)  # frees room: the logger proceeds
    th.join(1)
    assert not th.is_alive()
    s = consume(rec, broker, topic)["blocked"]
    s.check_batches()
    assert s.length == n and s.batches[-1].terminated
    np.testing.assert_array_equal(s.rewards(), np.arange(float(n)))
    st = rec.stats
    assert (st.delivered, st.dropped, st.failed) == (n + 1, 0, 0)


@pytest.mark.broker
def test_overflow_block_many_threads_all_delivered(broker, topic, recorders):
    rec = recorders(broker.bootstrap_servers, topic, max_buffered_steps=8, on_overflow="block", max_batch_steps=4)
    n = 150

    def run(w: int) -> None:
        eid = rec.begin_episode(np.zeros(3, np.float32), episode_id=f"b{w}")
        for t in range(n):
            rec.log_step(eid, w, float(t), np.full(3, w, np.float32), truncated=t == n - 1)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    seen = consume(rec, broker, topic)
    assert sorted(seen) == ["b0", "b1", "b2"]
    for w in range(3):
        s = seen[f"b{w}"]
        s.check_batches()
        assert s.length == n and s.batches[-1].truncated
        np.testing.assert_array_equal(s.rewards(), np.arange(float(n)))
        assert (s.column("actions") == w).all()
    assert rec.stats.delivered == 3 * (n + 1) and rec.stats.dropped == 0


# ------------------------------------------------------------------------ flush and close


@pytest.mark.broker
def test_flush_and_close(broker, topic):
    threads_before = psutil.Process().num_threads()
    rec = EpisodeRecorder(
        broker.bootstrap_servers, topic, observation_space=OBS, action_space=ACT, max_batch_delay_s=60.0
    )
    e1 = rec.begin_episode(np.zeros(3, np.float32))
    for _t in range(3):
        rec.log_step(e1, 1, 1.0, np.zeros(3, np.float32))
    e2 = rec.begin_episode(np.zeros(3, np.float32))
    assert rec.flush() == 0
    assert rec.stats.buffered == 0 and rec.stats.delivered == 5 and rec.open_episodes == 2
    assert psutil.Process().num_threads() > threads_before  # librdkafka's and the poller
    assert rec.close() == 0
    assert rec.open_episodes == 0
    # close() releases the Kafka client at once (threads, connections), not at garbage collection
    wait_for(lambda: psutil.Process().num_threads() <= threads_before, 10, what="the client's threads to end")
    assert rec.close() == 0 and rec.flush() == 0  # idempotent
    for call in (
        lambda: rec.begin_episode(np.zeros(3, np.float32)),
        lambda: rec.log_step(e1, 1, 1.0, np.zeros(3, np.float32)),
        lambda: rec.log_reward(e1, 0, 1.0),
        lambda: rec.abort_episode(e1),
    ):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    st = rec.stats
    assert (st.delivered, st.failed, st.buffered) == (7, 0, 0)
    seen = decode_all(read_messages(broker.bootstrap_servers, topic, st.messages_delivered))
    assert (
        seen[e1].kinds == ["EpisodeStart", "StepBatch", "EpisodeAbort"] and seen[e1].abort.reason == "recorder-closed"
    )
    assert seen[e2].kinds == ["EpisodeStart", "EpisodeAbort"] and seen[e2].abort.reason == "recorder-closed"
    with EpisodeRecorder(broker.bootstrap_servers, topic, observation_space=OBS, action_space=ACT) as r2:
        e3 = r2.begin_episode(np.zeros(3, np.float32))
    assert r2.open_episodes == 0 and r2.stats.delivered == 2
    with pytest.raises(RuntimeError):
        r2.log_step(e3, 0, 0.0, np.zeros(3, np.float32))


@pytest.mark.broker
def test_delivery_failure_accounting():
    errors: list = []
    with LocalBroker() as b:
        create_topics(b.bootstrap_servers, {"acct": 1})
        rec = EpisodeRecorder(
            b.bootstrap_servers,
            "acct",
            observation_space=OBS,
            action_space=ACT,
            max_batch_delay_s=60.0,
            kafka_config={"message.timeout.ms": 2000, "log_level": 0},
            on_delivery_error=lambda err, key, n: errors.append((err, key, n)),
        )
        try:
            e1 = rec.begin_episode(np.zeros(3, np.float32))
            assert rec.flush(10) == 0 and rec.stats.delivered == 1
            b.kill()
            for _t in range(5):
                rec.log_step(e1, 0, 1.0, np.zeros(3, np.float32))
            rec.abort_episode(e1, "gone")  # a batch of 5 steps + an abort
            e2 = rec.begin_episode(np.zeros(3, np.float32))
            rec.log_step(e2, 2, 1.0, np.zeros(3, np.float32), terminated=True)
            rec.log_reward(e2, 0, 0.5)  # e2 is over: a RewardDelta
            st = rec.stats
            assert (st.delivered, st.buffered, st.failed) == (1, 9, 0)
            assert st.produced == st.delivered + st.failed + st.buffered == 10
            t0 = time.monotonic()
            assert rec.flush(15) == 0  # all messages end (as failures) after message.timeout.ms
            assert time.monotonic() - t0 < 10
            st = rec.stats
            assert (st.delivered, st.failed, st.buffered, st.dropped) == (1, 9, 0, 0)
            assert st.produced == st.delivered + st.failed + st.buffered == 10
            assert st.messages_failed == 5 and st.messages_delivered == 1
            assert sum(n for _, _, n in errors) == 9 and len(errors) == 5
            assert {key for _, key, _ in errors} == {e1, e2}
            from confluent_kafka import KafkaError

            assert all(err.code() == KafkaError._MSG_TIMED_OUT for err, _, _ in errors)
        finally:
            rec.close(timeout=3)


def test_fatal_producer_error_replaces_the_producer_and_counts_the_lost_records():
    """A fatal librdkafka error (a restarted broker that forgot the idempotent producer's state)
    leaves a Producer unusable: the recorder swaps in a new one, the old one's messages count as
    failed (and reach on_delivery_error), and recording goes on."""
    from confluent_kafka import KafkaError

    errors: list = []
    with LocalBroker() as b:
        create_topics(b.bootstrap_servers, {"fatal": 1})
        rec = EpisodeRecorder(
            b.bootstrap_servers,
            "fatal",
            observation_space=OBS,
            action_space=ACT,
            max_batch_delay_s=60.0,
            kafka_config={"log_level": 0},
            on_delivery_error=lambda err, key, n: errors.append((err, key, n)),
        )
        try:
            e1 = rec.begin_episode(np.zeros(3, np.float32))
            assert rec.flush(10) == 0 and rec.stats.delivered == 1
            b.kill()
            for _ in range(5):
                rec.log_step(e1, 0, 1.0, np.zeros(3, np.float32))
            rec.abort_episode(e1, "gone")  # a 5-step batch + an abort, queued in the producer
            old = rec._producer
            rec._on_kafka_error(KafkaError(KafkaError._FATAL, "injected", fatal=True))
            assert wait_for(lambda: rec.producer_restarts == 1 and rec.stats.buffered == 0, timeout=20)
            assert rec._producer is not old
            st = rec.stats
            assert (st.delivered, st.failed, st.buffered) == (1, 6, 0)
            assert st.produced == st.delivered + st.failed + st.buffered
            assert sum(n for _, _, n in errors) == 6 and {k for _, k, _ in errors} == {e1}
            b.start()  # memory:// storage: the topic is gone with the old broker process
            create_topics(b.bootstrap_servers, {"fatal": 1})
            e2 = rec.begin_episode(np.zeros(3, np.float32))
            rec.log_step(e2, 1, 1.0, np.zeros(3, np.float32), terminated=True)
            assert rec.flush(30) == 0
            st = rec.stats
            assert (st.delivered, st.failed, st.buffered) == (3, 6, 0)
        finally:
            rec.close(timeout=3)


# ---------------------------------------------------------------------------- validation


def test_validation_errors(recorders):
    rec = recorders(NOWHERE, max_batch_delay_s=60.0)
    z = np.zeros(3, np.float32)
    eid = rec.begin_episode(z)
    for bad in (float("nan"), float("inf"), -float("inf"), np.float32("nan")):
        with pytest.raises(ValueError):
            rec.log_step(eid, 0, bad, z)
    for bad in ("abc", None, [1.0, 2.0], {"r": 1}):
        with pytest.raises(TypeError):
            rec.log_step(eid, 0, bad, z)
    for bad_obs in (np.zeros(4, np.float32), np.zeros((1, 3), np.float32), [0.0, 0.0], np.float32(0)):
        with pytest.raises(ValueError):
            rec.log_step(eid, 0, 1.0, bad_obs)
    with pytest.raises(ValueError):
        rec.log_step(eid, np.array([0, 1]), 1.0, z)  # action shape
    with pytest.raises(ValueError):
        rec.begin_episode(np.zeros(2, np.float32))
    with pytest.raises(ValueError):
        rec.log_step("no-such-episode", 0, 1.0, z)
    with pytest.raises(TypeError):
        rec.log_step(eid, 0, 1.0, z, info={"s": {1, 2}})
    with pytest.raises(ValueError):
        rec.begin_episode(z, episode_id=eid)  # already open
    # the first step's dtypes are checked before the step is counted (no leaked buffer room)
    before = rec.stats
    with pytest.raises(TypeError):
        rec.log_step(eid, 1.5, 1.0, z)  # a float action for a Discrete space
    with pytest.raises(TypeError):
        rec.log_step(eid, 0, 1.0, z, extra_model_outputs={"s": np.array(["str"])})
    assert rec.stats == before
    rec.log_step(eid, 0, 1.0, z)
    rec.log_step(eid, 1, 1.0, z, terminated=True)
    assert rec.stats.buffered == before.buffered + 2
    with pytest.raises(ValueError):
        rec.log_step(eid, 0, 1.0, z)  # ended
    with pytest.raises(ValueError):
        rec.log_reward(eid, 2, 1.0)  # the episode has 2 steps
    with pytest.raises(ValueError):
        rec.log_reward(eid, -1, 1.0)
    with pytest.raises(ValueError):
        rec.log_reward(eid, 0, float("nan"))
    with pytest.raises(ValueError):
        rec.abort_episode(eid)  # not open
    e2 = rec.begin_episode(z)
    rec.abort_episode(e2)
    with pytest.raises(ValueError):
        rec.log_step(e2, 0, 1.0, z)  # aborted
    # policy_version only grows
    rec.policy_version = 5
    rec.policy_version = 5
    for bad in (4, -1, True, 2.5, "6"):
        with pytest.raises(ValueError):
            rec.policy_version = bad
    assert rec.policy_version == 5
    with pytest.raises(ValueError):
        recorders(NOWHERE, policy_version=-1)
    with pytest.raises(TypeError):
        EpisodeRecorder(NOWHERE, "t", observation_space=OBS)  # spaces are required
    with pytest.raises(ValueError):
        recorders(NOWHERE, on_overflow="ignore")
    with pytest.raises(ValueError):
        recorders(NOWHERE, policy_id="")


@pytest.mark.parametrize(
    "bad",
    [
        0.5,
        float("nan"),
        float("inf"),
        -float("inf"),
        np.float32(0.01),
        np.float64("nan"),
        np.array([-0.1, -0.2]),
        np.array([[0.2]]),
        np.array(0.3),
        "x",
        None,
        np.array([True]),
        [-0.1, -0.2],
    ],
)
def test_action_logp_that_is_no_log_propensity_is_refused_before_buffering(recorders, bad):
    rec = recorders(NOWHERE, max_batch_delay_s=60.0)
    z = np.zeros(3, np.float32)
    eid = rec.begin_episode(z)
    before = rec.stats
    with pytest.raises(ValueError, match=r"action_logp.*log-propensity"):
        rec.log_step(eid, 0, 1.0, z, extra_model_outputs={"action_logp": bad})
    assert rec.stats == before
    rec.log_step(eid, 0, 1.0, z, extra_model_outputs={"action_logp": -0.5})  # the episode goes on
    assert rec.stats.buffered == before.buffered + 1


@pytest.mark.parametrize(
    "good", [0.0, -0.7, 5e-7, -1e9, np.float32(-0.1), np.float64(0.0), np.array(-0.2), np.array([-0.3], np.float32), -2]
)
def test_action_logp_accepts_log_propensities(recorders, good):
    rec = recorders(NOWHERE, max_batch_delay_s=60.0)
    z = np.zeros(3, np.float32)
    eid = rec.begin_episode(z)
    rec.log_step(eid, 0, 1.0, z, extra_model_outputs={"action_logp": good, "action_dist_inputs": np.zeros(2)})
    assert rec.stats.buffered == 2


@pytest.mark.parametrize("policy_id", ["../x", "/x", ".", "a//b", "x\0y", "p" * 201, "_manifest", ".h"])
def test_policy_ids_the_consumer_would_dead_letter_are_refused_at_once(recorders, policy_id):
    with pytest.raises(ValueError, match="policy_id"):
        recorders(NOWHERE, policy_id=policy_id)


@pytest.mark.parametrize("env_id", ["a\nb", "x" * 257, "\x1b[31m"])
def test_env_ids_the_consumer_would_dead_letter_are_refused_at_once(recorders, env_id):
    with pytest.raises(ValueError, match="env_id"):
        recorders(NOWHERE, env_id=env_id)
    assert recorders(NOWHERE, env_id="ALE/Pong-v5").env_id == "ALE/Pong-v5"


def test_validate_spaces(recorders):
    rec = recorders(NOWHERE, observation_space=gs.Box(-1, 1, (3,), np.float32), validate_spaces=True)
    z = np.zeros(3, np.float32)
    with pytest.raises(ValueError):
        rec.begin_episode(np.full(3, 2.0, np.float32))  # out of bounds
    eid = rec.begin_episode(z)
    with pytest.raises(ValueError):
        rec.log_step(eid, 3, 1.0, z)  # not in Discrete(3)
    with pytest.raises(ValueError):
        rec.log_step(eid, -1, 1.0, z)
    with pytest.raises(ValueError):
        rec.log_step(eid, 0, 1.0, np.full(3, 5.0, np.float32))
    rec.log_step(eid, 2, 1.0, z)
    plain = recorders(NOWHERE, observation_space=gs.Box(-1, 1, (3,), np.float32))
    e = plain.begin_episode(z)
    plain.log_step(e, 7, 1.0, z)  # without validate_spaces only shapes and dtypes are checked


def test_refused_batch_is_counted_failed_and_close_still_works(recorders):
    """A batch larger than librdkafka's message.max.bytes: failed, episode aborted, recorder usable."""
    big = gs.Box(0, 255, (3000,), np.uint8)
    rec = recorders(
        NOWHERE,
        observation_space=big,
        max_batch_steps=16,
        max_batch_delay_s=60.0,
        kafka_config={"message.max.bytes": 36_000, "message.timeout.ms": 1000},
    )
    obs = np.zeros(3000, np.uint8)
    eid = rec.begin_episode(obs)
    with pytest.raises(ValueError, match="could not be sent"):
        for _ in range(16):
            rec.log_step(eid, 0, 1.0, obs)
    st = rec.stats
    assert (st.failed, st.buffered, rec.open_episodes) == (16, 2, 0)  # EpisodeStart + the abort wait
    assert st.produced == st.delivered + st.failed + st.buffered
    e2 = rec.begin_episode(obs)
    rec.log_step(e2, 0, 1.0, obs, terminated=True)
    assert rec.close(timeout=5) == 0
    st = rec.stats
    assert (st.buffered, st.failed) == (0, 20)


def test_close_timeout_purges_undelivered_messages():
    """close() with messages still undelivered: they count as failed, and the recorder can be freed."""
    import weakref

    from confluent_kafka import KafkaError

    errors: list = []
    rec = EpisodeRecorder(
        NOWHERE,
        "t",
        observation_space=OBS,
        action_space=ACT,
        kafka_config=QUIET,
        on_delivery_error=lambda err, key, n: errors.append((err.code(), key, n)),
    )
    eid = rec.begin_episode(np.zeros(3, np.float32))
    rec.log_step(eid, 0, 1.0, np.zeros(3, np.float32))
    assert rec.close(timeout=0.2) == 3  # EpisodeStart, the batch, the "recorder-closed" abort
    st = rec.stats
    assert (st.delivered, st.failed, st.buffered, st.produced) == (0, 3, 0, 3)
    assert sorted(errors) == [(KafkaError._PURGE_QUEUE, eid, 1)] * 3
    ref = weakref.ref(rec)
    del rec
    gc.collect()
    assert ref() is None  # librdkafka no longer holds its delivery callbacks


def test_fork_child_gets_recorder_forked_error(recorders):
    rec = recorders(NOWHERE)
    z = np.zeros(3, np.float32)
    eid = rec.begin_episode(z)
    rec.log_step(eid, 0, 1.0, z)
    pid = os.fork()
    if pid == 0:  # child: report through the exit code, never return into pytest
        code = 0
        try:
            calls = [
                lambda: rec.begin_episode(z),
                lambda: rec.log_step(eid, 0, 1.0, z),
                lambda: rec.log_reward(eid, 0, 1.0),
                lambda: rec.abort_episode(eid),
                lambda: rec.flush(),
            ]
            for i, call in enumerate(calls):
                try:
                    call()
                    code |= 1 << i
                except RecorderForkedError:
                    pass
                except BaseException:
                    code |= 1 << i
            if rec.close() != 0:
                code |= 64
        except BaseException:
            code |= 128
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:  # pragma: no cover
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.02)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child exit status {status}"
    rec.log_step(eid, 1, 1.0, z)  # the parent's recorder still works
    assert rec.stats.buffered == 3


def test_import_does_not_pull_ray_or_torch():
    code = (
        "import sys\n"
        "import rlrec.producer\n"
        "from rlrec import EpisodeRecorder, RecordingWrapper\n"
        "import rlrec.cli; rlrec.cli.build_parser()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"


def test_close_without_a_timeout_returns_by_the_default_and_counts_what_it_dropped(monkeypatch):
    """A service shutting down with no broker is not held up: close() waits `CLOSE_TIMEOUT_S`
    (30 s; shortened here) and says how many messages were not delivered."""
    import threading

    import rlrec.producer.recorder as recorder_module

    assert recorder_module.CLOSE_TIMEOUT_S <= 30
    monkeypatch.setattr(recorder_module, "CLOSE_TIMEOUT_S", 0.3)
    rec = EpisodeRecorder(NOWHERE, "t", observation_space=OBS, action_space=ACT, kafka_config=QUIET)
    eid = rec.begin_episode(np.zeros(3, np.float32))
    rec.log_step(eid, 0, 1.0, np.zeros(3, np.float32), terminated=True)
    returned: list[int] = []
    closer = threading.Thread(target=lambda: returned.append(rec.close()), daemon=True)
    closer.start()
    closer.join(timeout=20)  # librdkafka alone would keep retrying for message.timeout.ms (300 s)
    assert not closer.is_alive(), "close() without a timeout did not return"
    assert returned == [2]  # EpisodeStart and the step batch
    assert (rec.stats.failed, rec.stats.buffered, rec.stats.delivered) == (2, 0, 0)
