"""`EpisodeRecorder.begin_episodes`/`log_steps`: the same messages (keys and values, byte for
byte) and `stats` as one `begin_episode`/`log_step` per row in row order; a refused batch
records nothing; overflow is decided for the whole batch; one lock acquisition per call.

No broker except where marked: the recorder's producer is replaced by one that keeps messages.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from confluent_kafka import KafkaError, KafkaException
from gymnasium import spaces as gs

from rlrec.producer import EpisodeRecorder, RecorderFullError
from rlrec.producer import recorder as recorder_module
from rlrec.producer.events import StepBatch, decode
from tests.helpers import KeepingProducer

NOWHERE = "127.0.0.1:1"
OBS = gs.Box(-np.inf, np.inf, (3,), np.float32)
ACT = gs.Discrete(3)
DICT_OBS = gs.Dict({"pos": gs.Box(-1, 1, (2,), np.float32), "k": gs.Discrete(4)})


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch):
    """Messages carry a timestamp: both sides see the same one."""
    monkeypatch.setattr(recorder_module, "_time", lambda: 1_700_000_000.0)


def _recorder(**kw) -> tuple[EpisodeRecorder, KeepingProducer]:
    kw.setdefault("observation_space", OBS)
    kw.setdefault("action_space", ACT)
    rec = EpisodeRecorder(NOWHERE, "t", kafka_config={"log_level": 0}, max_batch_delay_s=3600, **kw)
    real, fake = rec._producer, KeepingProducer()
    rec._producer = fake
    real.purge()
    return rec, fake


def _stats(rec: EpisodeRecorder) -> tuple:
    st = rec.stats
    return (st.produced, st.delivered, st.failed, st.dropped, st.buffered, st.episodes_begun, st.messages_produced)


def _obs_batch(space, rng, n):
    if isinstance(space, gs.Tuple):
        return (rng.integers(0, 3, n), rng.uniform(-1, 1, (n, 2, 2)))
    if isinstance(space, gs.Dict):
        return {"pos": rng.uniform(-1, 1, (n, 2)).astype(np.float32), "k": rng.integers(0, 4, n)}
    if isinstance(space, gs.Discrete):
        return rng.integers(0, space.n, n)
    if space.dtype == np.uint8:
        return rng.integers(0, 256, (n, *space.shape), dtype=np.uint8)
    return rng.standard_normal((n, *space.shape)).astype(space.dtype)


def _obs_row(batch, i):
    if isinstance(batch, tuple):
        return tuple(b[i] for b in batch)
    if isinstance(batch, dict):
        return {k: v[i] for k, v in batch.items()}
    return batch[i]


BOX_ACT = gs.Box(-1, 1, (2,), np.float32)
TUPLE_OBS = gs.Tuple((gs.Discrete(3), gs.Box(-1, 1, (2, 2), np.float64)))


def _actions(space, rng, n):
    if isinstance(space, gs.Box):
        return rng.uniform(-1, 1, (n, 2)).astype(np.float32)
    return rng.integers(0, 3, n)


class _RandomSource:
    """Stands in for os.urandom: one seeded byte stream per side, so that the ids a batched
    recorder draws for a batch (one call) equal those N `begin_episode` calls draw (N calls)."""

    def __init__(self, seed: int):
        self.streams = {side: np.random.default_rng(seed) for side in ("batched", "single")}
        self.side = "batched"

    def __call__(self, size: int) -> bytes:
        return self.streams[self.side].bytes(size)


def _drive(
    space,
    outputs: str,
    seed: int = 0,
    n: int = 6,
    steps: int = 40,
    batch_steps: int = 4,
    act_space=ACT,
    new_ids: _RandomSource | None = None,
    reward_dtype=np.float64,
):
    """The same random vector trajectory recorded batched and per row; returns both sides.
    `new_ids`: episodes begin without ids, infos or versions (the recorders draw new ids from
    this stand-in for os.urandom); else with given ids, some infos and some versions."""
    batched, fb = _recorder(observation_space=space, action_space=act_space, max_batch_steps=batch_steps)
    single, fs = _recorder(observation_space=space, action_space=act_space, max_batch_steps=batch_steps)
    rng = np.random.default_rng(seed)
    counter = iter(range(10**6))
    obs = _obs_batch(space, rng, n)
    if new_ids is not None:
        new_ids.side = "batched"
        ids = batched.begin_episodes(obs)
        new_ids.side = "single"
        assert [single.begin_episode(_obs_row(obs, i)) for i in range(n)] == ids
    else:
        ids = [f"ep-{next(counter)}" for _ in range(n)]
        infos = [{"i": i} if i % 2 else None for i in range(n)]
        assert batched.begin_episodes(obs, infos, episode_ids=ids, policy_versions=[None, 3] * (n // 2)) == ids
        for i in range(n):
            single.begin_episode(_obs_row(obs, i), infos[i], episode_id=ids[i], policy_version=[None, 3][i % 2])
    for _ in range(steps):
        actions = _actions(act_space, rng, n)
        rewards = rng.standard_normal(n).astype(reward_dtype)
        obs = _obs_batch(space, rng, n)
        term = rng.random(n) < 0.08
        trunc = ~term & (rng.random(n) < 0.05)
        rows = rng.random(n) < 0.8  # the others: reset rows of a NEXT_STEP step, left out
        step_infos = [{"r": float(rewards[i]), "a": np.arange(2)} if i % 3 == 0 else {} for i in range(n)]
        if outputs == "logp":
            extra = {"action_logp": np.log(rng.uniform(0.2, 1, n)).astype(np.float32)}
        elif outputs == "logp64":
            extra = {"action_logp": np.log(rng.uniform(0.2, 1, n))}
        elif outputs == "several":
            extra = {
                "action_logp": -rng.random(n),
                "action_dist_inputs": rng.standard_normal((n, 3)).astype(np.float32),
            }
        else:
            extra = None
        batched.log_steps(ids, actions, rewards, obs, term, trunc, step_infos, extra, rows=rows)
        for i in np.flatnonzero(rows):
            single.log_step(
                ids[i],
                actions[i],
                rewards[i],
                _obs_row(obs, i),
                term[i],
                trunc[i],
                step_infos[i],
                None if extra is None else {k: v[i] for k, v in extra.items()},
            )
        done = np.flatnonzero(rows & (term | trunc))
        if len(done):
            fresh = _obs_batch(space, rng, len(done))
            if new_ids is not None:
                new_ids.side = "batched"
                new = batched.begin_episodes(fresh)
                new_ids.side = "single"
                assert [single.begin_episode(_obs_row(fresh, j)) for j in range(len(done))] == new
            else:
                new = [f"ep-{next(counter)}" for _ in done]
                batched.begin_episodes(fresh, episode_ids=new)
                for j in range(len(done)):
                    single.begin_episode(_obs_row(fresh, j), episode_id=new[j])
            for j, i in enumerate(done):
                ids[i] = new[j]
    batched.flush(0)
    single.flush(0)
    return batched, fb, single, fs


@pytest.mark.parametrize(
    ("space", "act_space"),
    [(OBS, ACT), (DICT_OBS, ACT), (TUPLE_OBS, BOX_ACT)],
    ids=["box-discrete", "dict-discrete", "tuple-box"],
)
@pytest.mark.parametrize("outputs", ["logp", "logp64", "several", "none"])
def test_batched_calls_send_the_bytes_of_single_calls(space, act_space, outputs):
    batched, fb, single, fs = _drive(space, outputs, act_space=act_space)
    try:
        assert len(fb.messages) > 60
        assert fb.messages == fs.messages  # keys, values and headers, byte for byte, in order
        assert _stats(batched) == _stats(single)
        assert any(isinstance(decode(v, h), StepBatch) and decode(v, h).terminated for _, v, h in fb.messages)
    finally:
        batched.close(0)
        single.close(0)


@pytest.mark.parametrize(
    ("space", "act_space"),
    [(OBS, ACT), (gs.Box(0, 255, (2, 3), np.uint8), BOX_ACT), (gs.Discrete(5), ACT), (DICT_OBS, ACT)],
    ids=["box", "box-uint8", "discrete", "dict"],
)
@pytest.mark.parametrize("seed", range(8))
def test_new_episodes_send_the_bytes_of_single_calls(monkeypatch, space, act_space, seed):
    """Episodes begun without ids, infos or versions (a vector env's resets): the same ids,
    messages and stats as one `begin_episode` per row, batches of 1..n rows."""
    source = _RandomSource(seed)
    monkeypatch.setattr(os, "urandom", source)
    n = 1 + seed % 7
    rewards = [np.float64, np.float32, np.float16][seed % 3]  # float16: taken through a float64 copy
    batched, fb, single, fs = _drive(
        space, ["logp", "none"][seed % 2], seed=seed, n=n, steps=60, new_ids=source, reward_dtype=rewards
    )
    try:
        assert len(fb.messages) > 2 * n
        assert fb.messages == fs.messages  # keys, values and headers, byte for byte, in order
        assert _stats(batched) == _stats(single)
    finally:
        batched.close(0)
        single.close(0)


def test_an_episode_reused_after_the_batch_equals_single_calls():
    """A batched recorder's episodes continue with single calls (and back) without a seam."""
    rec, fake = _recorder()
    ref, fref = _recorder()
    try:
        obs = np.ones((2, 3), np.float32)
        ids = rec.begin_episodes(obs, episode_ids=["a", "b"])
        for i in range(2):
            ref.begin_episode(obs[i], episode_id=ids[i])
        rec.log_step("a", 1, 1.0, obs[0])
        ref.log_step("a", 1, 1.0, obs[0])
        rec.log_steps(ids, [2, 0], [0.5, 0.25], obs * 2, [True, False], [False, True])
        for i in range(2):
            ref.log_step(ids[i], [2, 0][i], [0.5, 0.25][i], obs[i] * 2, [True, False][i], [False, True][i])
        rec.flush(0)
        ref.flush(0)
        assert fake.messages == fref.messages
    finally:
        rec.close(0)
        ref.close(0)


def _bad_batches(ids):
    good = {
        "episode_ids": list(ids),
        "actions": np.array([0, 1, 2]),
        "rewards": np.array([1.0, 2.0, 3.0]),
        "observations": np.zeros((3, 3), np.float32),
        "terminated": np.array([False, True, False]),
        "truncated": np.zeros(3, bool),
        "extra_model_outputs": {"action_logp": np.array([-0.1, -0.2, -0.3], np.float32)},
    }
    yield "not open", {**good, "episode_ids": [ids[0], "nope", ids[2]]}, ValueError
    yield "twice", {**good, "episode_ids": [ids[0], ids[1], ids[0]]}, ValueError
    yield "nan reward", {**good, "rewards": np.array([1.0, 2.0, np.nan])}, ValueError
    yield (
        "bad logp",
        {**good, "extra_model_outputs": {"action_logp": np.array([-0.1, 0.5, -0.3], np.float32)}},
        ValueError,
    )
    yield "bad action", {**good, "actions": np.array([0.5, 1, 2])}, TypeError  # float does not cast to int64
    yield "wrong shape", {**good, "observations": np.zeros((3, 2), np.float32)}, ValueError
    yield "short rewards", {**good, "rewards": np.array([1.0, 2.0])}, ValueError
    yield "bad dtype output", {**good, "extra_model_outputs": {"x": np.array(["a", "b", "c"])}}, TypeError


@pytest.mark.parametrize("case", [c for c, *_ in _bad_batches(["x", "y", "z"])])
def test_a_refused_batch_records_nothing(case):
    rec, fake = _recorder()
    try:
        ids = rec.begin_episodes(np.zeros((3, 3), np.float32), episode_ids=["x", "y", "z"])
        rec.flush(0)
        before = (list(fake.messages), _stats(rec), [rec._episodes[e].t for e in ids])
        _, kwargs, exc = next((c, k, e) for c, k, e in _bad_batches(ids) if c == case)
        with pytest.raises(exc):
            rec.log_steps(**kwargs)
        assert (list(fake.messages), _stats(rec), [rec._episodes[e].t for e in ids]) == before
    finally:
        rec.close(0)


def test_begin_episodes_refuses_as_a_whole():
    rec, fake = _recorder()
    try:
        rec.begin_episode(np.zeros(3, np.float32), episode_id="open")
        rec.flush(0)
        before = (list(fake.messages), _stats(rec))
        obs = np.zeros((3, 3), np.float32)
        with pytest.raises(ValueError, match="already open"):
            rec.begin_episodes(obs, episode_ids=["a", "open", "b"])
        with pytest.raises(ValueError, match="twice"):
            rec.begin_episodes(obs, episode_ids=["a", "b", "a"])
        with pytest.raises(ValueError, match="policy_version"):
            rec.begin_episodes(obs, policy_versions=[1, -1, 1])
        with pytest.raises(ValueError, match="rows"):
            rec.begin_episodes(obs, infos=[{}, {}])
        assert (list(fake.messages), _stats(rec)) == before
        assert rec.open_episodes == 1
    finally:
        rec.close(0)


def test_overflow_is_decided_for_the_whole_batch():
    rec, fake = _recorder(max_buffered_steps=10, on_overflow="raise")
    try:
        # nothing is delivered: the stand-in delivers only when polled (flush)
        rec._stop.set()
        rec._poller.join(5)
        ids = rec.begin_episodes(np.zeros((4, 3), np.float32))
        obs = np.zeros((4, 3), np.float32)
        rec.log_steps(ids, [0] * 4, [0.0] * 4, obs, [False] * 4, [False] * 4)  # 8 buffered
        before = (len(fake.messages), rec.stats)
        with pytest.raises(RecorderFullError):  # 2 would fit, 4 don't: none is recorded
            rec.log_steps(ids, [0] * 4, [0.0] * 4, obs, [False] * 4, [False] * 4)
        assert (len(fake.messages), rec.stats) == before
        assert [rec._episodes[e].t for e in ids] == [1] * 4
        rec.on_overflow = "drop"
        rec.log_steps(ids, [0] * 4, [0.0] * 4, obs, [False] * 4, [True] * 4)
        st = rec.stats
        assert st.dropped == 4 + 4  # the batch, and the 4 buffered steps of the episodes it drops
        assert rec.open_episodes == 0
        rec.on_overflow = "raise"
        with pytest.raises(RecorderFullError):
            rec.begin_episodes(np.zeros((20, 3), np.float32))
        rec.flush(0)  # delivers: the buffer is empty, a batch bigger than it still goes in whole
        assert rec.stats.buffered == 0
        assert len(rec.begin_episodes(np.zeros((20, 3), np.float32))) == 20
    finally:
        rec.close(0)


class _CountingLock:
    """A re-entrant lock that counts acquisitions made by one thread."""

    def __init__(self, thread_id: int):
        self._lock = threading.RLock()
        self.thread_id = thread_id
        self.count = 0

    def __enter__(self):
        self._lock.__enter__()
        if threading.get_ident() == self.thread_id:
            self.count += 1
        return self

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)


def test_one_lock_acquisition_per_call():
    rec, _ = _recorder(max_batch_steps=2)
    try:
        lock = rec._lock = _CountingLock(threading.get_ident())
        n = 16
        ids = rec.begin_episodes(np.zeros((n, 3), np.float32))
        assert lock.count == 1
        for k in range(5):  # batches are emitted on the way (max_batch_steps=2), episodes end
            done = np.arange(n) % 5 == k
            rec.log_steps(
                ids,
                np.zeros(n, np.int64),
                np.ones(n),
                np.ones((n, 3), np.float32),
                done,
                np.zeros(n, bool),
                extra_model_outputs={"action_logp": np.full(n, -0.5)},
                rows=np.arange(n) % 5 >= k,
            )
        assert lock.count == 1 + 5
    finally:
        rec.close(0)


@pytest.mark.broker
def test_batched_messages_through_a_real_broker(broker, topic):
    """Through the broker, the batched recorder's messages are the single calls' bytes."""
    from tests.test_recorder import read_messages

    batched, _fb, single, fs = _drive(OBS, "several", seed=3, steps=25)
    want_messages = list(fs.messages)  # before close() aborts the open episodes
    batched.close(0)
    single.close(0)
    live = EpisodeRecorder(
        broker.bootstrap_servers,
        topic,
        observation_space=OBS,
        action_space=ACT,
        max_batch_steps=4,
        max_batch_delay_s=3600,
    )
    try:
        # the batched calls of `_drive` again, against the broker: same seed, same calls
        rng = np.random.default_rng(3)
        n = 6
        counter = iter(range(10**6))
        ids = [f"ep-{next(counter)}" for _ in range(n)]
        obs = _obs_batch(OBS, rng, n)
        live.begin_episodes(obs, [{"i": i} if i % 2 else None for i in range(n)], ids, [None, 3] * 3)
        for _ in range(25):
            actions = rng.integers(0, 3, n)
            rewards = rng.standard_normal(n)
            obs = _obs_batch(OBS, rng, n)
            term = rng.random(n) < 0.08
            trunc = ~term & (rng.random(n) < 0.05)
            rows = rng.random(n) < 0.8
            step_infos = [{"r": float(rewards[i]), "a": np.arange(2)} if i % 3 == 0 else {} for i in range(n)]
            extra = {
                "action_logp": -rng.random(n),
                "action_dist_inputs": rng.standard_normal((n, 3)).astype(np.float32),
            }
            live.log_steps(ids, actions, rewards, obs, term, trunc, step_infos, extra, rows=rows)
            done = np.flatnonzero(rows & (term | trunc))
            if len(done):
                new = [f"ep-{next(counter)}" for _ in done]
                live.begin_episodes(_obs_batch(OBS, rng, len(done)), episode_ids=new)
                for j, i in enumerate(done):
                    ids[i] = new[j]
        assert live.flush(10) == 0
        st = live.stats
        assert st.failed == 0 and st.messages_delivered == len(want_messages)
        got = read_messages(broker.bootstrap_servers, topic, st.messages_delivered)
    finally:
        live.close(3)
    by_key: dict = {}
    for m in got:
        by_key.setdefault(m.key(), []).append(m.value())
    want: dict = {}
    for k, v, _ in want_messages:
        want.setdefault(k, []).append(v)
    assert by_key == want


def test_validate_spaces_checks_every_row_before_recording():
    rec, fake = _recorder(validate_spaces=True)
    try:
        ids = rec.begin_episodes(np.zeros((3, 3), np.float32), episode_ids=["a", "b", "c"])
        rec.flush(0)
        before = (list(fake.messages), _stats(rec))
        with pytest.raises(ValueError, match="not in Discrete"):  # 5 is an int64 but not in Discrete(3)
            rec.log_steps(ids, np.array([0, 1, 5]), np.zeros(3), np.zeros((3, 3), np.float32), [False] * 3, [False] * 3)
        assert (list(fake.messages), _stats(rec)) == before
        assert [rec._episodes[e].t for e in ids] == [0, 0, 0]
    finally:
        rec.close(0)


_STEP_HEADERS = recorder_module.schema_header("StepBatch")


class _RefusingProducer(KeepingProducer):
    """Refuses messages as librdkafka may: every 5th call finds its queue full (BufferError: the
    recorder polls and tries again), and one StepBatch is refused for good (KafkaException)."""

    def __init__(self, refuse_call: int):
        super().__init__()
        self.calls = 0
        self.refuse_call = refuse_call
        self.refused = None  # the message refused (every time it is offered)

    def produce(self, topic, value, key=None, headers=None, on_delivery=None):
        self.calls += 1
        if self.calls % 5 == 0:
            raise BufferError("Local: Queue full")
        if self.refused is None and self.calls >= self.refuse_call and headers == _STEP_HEADERS:
            self.refused = value
        if value == self.refused:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        super().produce(topic, value, key, headers, on_delivery)


def test_refused_produce_calls_equal_single_calls():
    """A full librdkafka queue (retried) and a refused batch (episode aborted, ValueError after
    the other rows) leave the same messages and stats as one call per row."""
    sides = []
    for _ in range(2):
        rec, _ = _recorder(max_batch_steps=3)
        rec._producer = fake = _RefusingProducer(refuse_call=60)
        sides.append((rec, fake))
    (batched, fb), (single, fs) = sides
    rng = np.random.default_rng(1)
    n, counter = 8, iter(range(10**6))
    ids = [f"ep-{next(counter)}" for _ in range(n)]
    obs = rng.standard_normal((n, 3)).astype(np.float32)
    batched.begin_episodes(obs, episode_ids=ids)
    for i in range(n):
        single.begin_episode(obs[i], episode_id=ids[i])
    errors = [0, 0]
    try:
        for _ in range(30):
            actions, rewards = rng.integers(0, 3, n), rng.standard_normal(n)
            obs = rng.standard_normal((n, 3)).astype(np.float32)
            term, trunc = rng.random(n) < 0.15, np.zeros(n, bool)
            rows = rng.random(n) < 0.9
            try:
                batched.log_steps(ids, actions, rewards, obs, term, trunc, rows=rows)
            except ValueError:
                errors[0] += 1
            for i in np.flatnonzero(rows):
                try:
                    single.log_step(ids[i], actions[i], rewards[i], obs[i], term[i], trunc[i])
                except ValueError:
                    errors[1] += 1
            ended = np.flatnonzero(rows & term)
            ended = [i for i in ended if ids[i] not in batched._episodes] + [
                i for i in np.flatnonzero(rows) if ids[i] not in batched._episodes and i not in ended
            ]
            if ended:
                new = [f"ep-{next(counter)}" for _ in ended]
                fresh = rng.standard_normal((len(ended), 3)).astype(np.float32)
                batched.begin_episodes(fresh, episode_ids=new)
                for j, i in enumerate(ended):
                    single.begin_episode(fresh[j], episode_id=new[j])
                    ids[i] = new[j]
        batched.flush(0)
        single.flush(0)
        assert fb.refused is not None and fb.refused == fs.refused and errors == [1, 1]
        assert fb.messages == fs.messages
        assert _stats(batched) == _stats(single)
        assert batched.stats.failed == single.stats.failed > 0
    finally:
        batched.close(0)
        single.close(0)


_OUTPUT_ORDER_SCRIPT = r"""
import json
import numpy as np
from gymnasium import spaces as gs
from rlrec.producer import recorder
from tests.helpers import assemble, keeping_recorder
recorder._time = lambda: 1_700_000_000.0
stamp = recorder._now_ms_bytes()
recorder._now_ms_bytes = lambda: stamp
out = {"vf_preds": np.array([1.0, 2.0], np.float32), "action_logp": np.array([-0.5, -0.25]), "zeta": np.array([3, 4])}
hexes = []
for batched in (True, False):
    rec, fake = keeping_recorder(gs.Box(-1, 1, (2,), np.float32), gs.Discrete(2))
    obs, ids = np.zeros((2, 2), np.float32), ["a", "b"]
    if batched:
        rec.begin_episodes(obs, episode_ids=ids)
        rec.log_steps(ids, np.array([0, 1]), np.ones(2), obs, np.ones(2, bool), np.zeros(2, bool), extra_model_outputs=out)
    else:
        for i, eid in enumerate(ids):
            rec.begin_episode(obs[i], episode_id=eid)
        for i, eid in enumerate(ids):
            rec.log_step(eid, i, 1.0, obs[i], True, False, None, {k: v[i] for k, v in out.items()})
    rec.close(0)
    hexes.append([(v.hex(), [(k, h.decode()) for k, h in headers]) for _, v, headers in fake.messages])
finished, _ = assemble(fake.messages)
print(json.dumps(hexes + [[list(fe.extra_model_outputs) for fe in finished.values()]]))
"""


def test_output_columns_keep_the_callers_key_order_in_every_process():
    """A StepBatch's extra_model_outputs columns are in the order of the episode's first step's
    keys, whatever the process's hash seed: one recording, one byte stream (batched or not), and
    the consumer's finished episodes keep that order (their shards' bytes follow it)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    streams = set()
    for seed in ("0", "1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        run = subprocess.run(
            [sys.executable, "-c", _OUTPUT_ORDER_SCRIPT], cwd=root, env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-2000:]
        batched, single, assembled = json.loads(run.stdout)
        assert batched == single
        assert assembled == [["vf_preds", "action_logp", "zeta"]] * 2  # the consumer's episodes too
        streams.add(json.dumps(batched))
    assert len(streams) == 1
    events = [decode(bytes.fromhex(v), [(k, h.encode()) for k, h in headers]) for v, headers in batched]
    batches = [e for e in events if type(e) is StepBatch]
    assert [list(b.extra_model_outputs) for b in batches] == [["vf_preds", "action_logp", "zeta"]] * 2


def _small_limit_recorder(**kw) -> EpisodeRecorder:
    """A recorder with librdkafka's own producer (no broker) and a 4000-byte message limit."""
    kw.setdefault("observation_space", OBS)
    kw.setdefault("action_space", ACT)
    return EpisodeRecorder(
        NOWHERE, "t", kafka_config={"log_level": 0, "message.max.bytes": 4000}, max_batch_delay_s=3600, **kw
    )


def test_a_start_too_large_for_the_producer_refuses_the_whole_batch():
    """One row whose EpisodeStart librdkafka would refuse (a big reset info, or observations
    too big for any message): nothing of the batch is sent or opened."""
    rec = _small_limit_recorder()
    try:
        before = _stats(rec)
        infos = [None, {"note": "small"}, {"note": "x" * 6000}]
        with pytest.raises(ValueError, match=r"message\.max\.bytes"):
            rec.begin_episodes(np.zeros((3, 3), np.float32), infos)
        with pytest.raises(ValueError, match=r"message\.max\.bytes"):
            rec.begin_episodes(
                np.zeros((3, 3), np.float32), infos, episode_ids=["a", "b", "c"], policy_versions=[1, 2, 3]
            )
        assert (_stats(rec), rec.open_episodes) == (before, 0)
    finally:
        rec.close(0)
    big = _small_limit_recorder(observation_space=gs.Box(-1, 1, (1200,), np.float32))
    try:
        with pytest.raises(ValueError, match=r"message\.max\.bytes"):
            big.begin_episodes(np.zeros((4, 1200), np.float32))  # the plain path: 4800-byte rows
        with pytest.raises(ValueError, match=r"message\.max\.bytes"):
            big.begin_episode(np.zeros(1200, np.float32))
        assert (big.stats.produced, big.stats.failed, big.open_episodes) == (0, 0, 0)
    finally:
        big.close(0)


def test_every_start_the_recorder_lets_through_librdkafka_takes():
    """Around the limit, a start is refused by the recorder's own check or taken by librdkafka,
    never refused by librdkafka after the call began sending."""
    rec = _small_limit_recorder()
    try:
        taken = refused = 0
        for size in range(3200, 3900):
            try:
                rec.begin_episodes(np.zeros((2, 3), np.float32), [None, {"n": "x" * size}])
                taken += 1
            except ValueError as e:
                assert "refused by the producer" not in str(e)
                refused += 1
            assert rec.stats.failed == 0 and rec.open_episodes == 2 * taken
        assert taken and refused
    finally:
        rec.close(0)
