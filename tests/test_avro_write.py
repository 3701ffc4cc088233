"""The recorder's hand-written Avro (producer/avro_write.py) is byte for byte what fastavro writes,
and its fast stacking (one `bytes.join` of the logged arrays) equals numpy's stacking, for every
kind of value the slow path accepts (lists, Python and numpy scalars, other dtypes, views).

No broker: the recorder's producer is replaced by one that keeps the messages.
"""

from __future__ import annotations

import io
import time

import fastavro
import numpy as np
import pytest
from gymnasium import spaces as gs

from rlrec.producer import EpisodeRecorder
from rlrec.producer.avro_write import long_bytes, string_bytes
from rlrec.producer.events import EpisodeStart, StepBatch, _latest, decode
from rlrec.producer.spaces import space_leaves

NOWHERE = "127.0.0.1:1"


class _KeepingProducer:
    """Stands in for confluent_kafka.Producer: keeps (value, headers), delivers at poll/flush."""

    def __init__(self):
        self.messages: list[tuple[bytes, list]] = []
        self._pending: list = []

    def produce(self, topic, value, key=None, headers=None, on_delivery=None):
        self.messages.append((value, headers))
        self._pending.append(on_delivery)

    def poll(self, timeout=0):
        pending, self._pending = self._pending, []
        for cb in pending:
            cb(None, None)
        if not pending and timeout:
            time.sleep(min(timeout, 0.01))
        return len(pending)

    def flush(self, timeout=-1):
        self.poll(0)
        return 0

    def purge(self):
        pass

    def __len__(self):
        return len(self._pending)


def _recorder(obs_space, act_space, **kw) -> tuple[EpisodeRecorder, _KeepingProducer]:
    rec = EpisodeRecorder(
        NOWHERE,
        "t",
        observation_space=obs_space,
        action_space=act_space,
        kafka_config={"log_level": 0},
        **kw,
    )
    real, fake = rec._producer, _KeepingProducer()
    rec._producer = fake
    real.purge()
    return rec, fake


def _events(fake: _KeepingProducer) -> list:
    """Decode every kept message; also check it is exactly what fastavro writes for its record."""
    out = []
    for value, headers in fake.messages:
        kind = headers[0][1].decode().split("/")[0]
        schema = _latest()[kind][1]
        record = fastavro.schemaless_reader(io.BytesIO(value), schema, None)
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, schema, record)
        assert buf.getvalue() == value, kind
        out.append(decode(value, headers))
    return out


@pytest.mark.parametrize(
    "n",
    [0, 1, 63, 64, 65, 4095, 4096, 300_000, 2**31, 2**63 - 1, -1, -64, -65, -(2**63)],
)
def test_long_bytes_is_avro_long(n):
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, "long", n)
    assert long_bytes(n) == buf.getvalue()


@pytest.mark.parametrize("s", ["", "a", "é" * 70, "x" * 5000, "🙂"])
def test_string_bytes_is_avro_string(s):
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, "string", s)
    assert string_bytes(s) == buf.getvalue()


OBS_CASES = {
    "box-f32": gs.Box(-np.inf, np.inf, (3,), np.float32),
    "box-u8-2d": gs.Box(0, 255, (2, 3), np.uint8),
    "box-scalar": gs.Box(-1.0, 1.0, (), np.float64),
    "discrete": gs.Discrete(5),
    "multidiscrete": gs.MultiDiscrete([3, 4]),
    "multibinary": gs.MultiBinary(4),
    "dict": gs.Dict({"pos": gs.Box(-1, 1, (2,), np.float32), "k": gs.Discrete(3)}),
    "tuple": gs.Tuple((gs.Discrete(2), gs.Box(0, 1, (2, 2), np.float16))),
}


def _value(space: gs.Space, rng: np.random.Generator, form: int):
    """A value of `space` in one of several forms: 0 exact ndarray, 1 list / Python scalar,
    2 another dtype of the same kind (cast on stacking), 3 a non-contiguous view, 4 numpy scalar when scalar."""
    if isinstance(space, gs.Dict):
        return {k: _value(s, rng, form) for k, s in space.spaces.items()}
    if isinstance(space, gs.Tuple):
        return tuple(_value(s, rng, form) for s in space.spaces)
    a = np.asarray(space.sample(), dtype=space.dtype)
    kind = a.dtype.kind
    if form == 1 and kind != "u":  # Python ints stack as int64, which uint8 refuses
        return a.tolist()
    if form == 2:  # a dtype of the same kind, cast when stacked
        return a.astype({"f": np.float64, "i": np.int32, "u": np.uint16}.get(kind, a.dtype))
    if form == 3 and a.ndim:
        wide = np.repeat(a, 2, axis=-1)  # every other element: a view with a stride
        return wide[..., ::2]
    if form == 4 and a.ndim == 0:
        return a[()]
    return a


def _leaf_arrays(space: gs.Space, values: list) -> list[np.ndarray]:
    """What numpy's stacking (the old, always-correct path) makes of `values`: one array per leaf."""
    from rlrec.producer.spaces import flatten_value

    leaves = space_leaves(space)
    flat = [flatten_value(space, v) for v in values]
    return [np.asarray([f[i] for f in flat]).astype(leaf.dtype) for i, leaf in enumerate(leaves)]


@pytest.mark.parametrize("obs_name", sorted(OBS_CASES))
@pytest.mark.parametrize("act_name", ["discrete", "box-f32", "dict"])
@pytest.mark.parametrize("forms", [(0,), (1,), (2,), (3,), (4,), (0, 1, 2, 3, 4)])
def test_batches_equal_numpy_stacking_and_fastavro_bytes(obs_name, act_name, forms):
    obs_space, act_space = OBS_CASES[obs_name], OBS_CASES[act_name]
    rng = np.random.default_rng(len(obs_name) * 7 + len(act_name) + sum(forms))
    obs_space.seed(1)
    act_space.seed(2)
    rec, fake = _recorder(obs_space, act_space, max_batch_steps=7)
    try:
        n = 17
        obs = [_value(obs_space, rng, forms[i % len(forms)]) for i in range(n + 1)]
        acts = [_value(act_space, rng, forms[(i + 1) % len(forms)]) for i in range(n)]
        rewards = [float(x) for x in rng.standard_normal(n)]
        infos = [{"i": i} if i % 5 == 3 else None for i in range(n)]
        extras = [
            {
                "logp": np.float32(-0.5 * i),
                "dist": np.arange(2, dtype=np.float32) + i,
                "vf": float(i),  # a Python float: numpy stacks it as float64
            }
            for i in range(n)
        ]
        eid = rec.begin_episode(obs[0], info={"seed": 1}, episode_id="ép-1")
        for i in range(n):
            rec.log_step(
                eid,
                acts[i],
                rewards[i],
                obs[i + 1],
                terminated=i == n - 1,
                info=infos[i],
                extra_model_outputs=extras[i],
            )
            if i == 4:
                rec.log_reward(eid, 3, 0.25)  # still buffered: added in the batch
        rec.flush(1)
        events = _events(fake)
    finally:
        rec.close(0)
    start, batches = events[0], events[1:]
    assert isinstance(start, EpisodeStart) and start.episode_id == "ép-1" and start.info == {"seed": 1}
    for got, want in zip(start.observation, _leaf_arrays(obs_space, [obs[0]])):
        np.testing.assert_array_equal(got, want[0])
        assert got.dtype == want.dtype
    assert all(isinstance(b, StepBatch) for b in batches)
    assert [b.t0 for b in batches] == [0, 7, 14]
    assert batches[-1].terminated and not any(b.terminated for b in batches[:-1])

    def cat(field, i):
        return np.concatenate([getattr(b, field)[i] for b in batches])

    for i, want in enumerate(_leaf_arrays(obs_space, obs[1:])):
        got = cat("observations", i)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    for i, want in enumerate(_leaf_arrays(act_space, acts)):
        got = cat("actions", i)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    expected_rewards = np.asarray(rewards)
    expected_rewards[3] += 0.25
    np.testing.assert_array_equal(np.concatenate([b.rewards for b in batches]), expected_rewards)
    assert [x for b in batches for x in (b.infos or [{}] * len(b.rewards))] == [i or {} for i in infos]
    for key, dtype in (("logp", np.float32), ("dist", np.float32), ("vf", np.float64)):
        got = np.concatenate([b.extra_model_outputs[key] for b in batches])
        want = np.asarray([e[key] for e in extras])
        assert got.dtype == dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_mixed_extra_dtypes_promote_as_numpy_does():
    rec, fake = _recorder(OBS_CASES["box-f32"], gs.Discrete(2))
    try:
        eid = rec.begin_episode(np.zeros(3, np.float32))
        for i, v in enumerate([np.float32(1), np.float64(2), np.array(3, np.float32), np.float32(4)]):
            rec.log_step(eid, 0, 0.0, np.zeros(3, np.float32), terminated=i == 3, extra_model_outputs={"x": v})
        rec.flush(1)
        batch = _events(fake)[1]
    finally:
        rec.close(0)
    assert batch.extra_model_outputs["x"].dtype == np.float64
    np.testing.assert_array_equal(batch.extra_model_outputs["x"], [1, 2, 3, 4])


def test_ragged_extras_still_abort_the_episode():
    rec, fake = _recorder(OBS_CASES["box-f32"], gs.Discrete(2))
    try:
        eid = rec.begin_episode(np.zeros(3, np.float32))
        rec.log_step(eid, 0, 0.0, np.zeros(3, np.float32), extra_model_outputs={"d": np.zeros(2, np.float32)})
        with pytest.raises(ValueError, match="could not be encoded and the episode was aborted"):
            rec.log_step(
                eid,
                0,
                0.0,
                np.zeros(3, np.float32),
                terminated=True,
                extra_model_outputs={"d": np.zeros((1, 2), np.float32)},
            )
        rec.flush(1)
        kinds = [type(e).__name__ for e in _events(fake)]
    finally:
        rec.close(0)
    assert kinds == ["EpisodeStart", "EpisodeAbort"]


def test_big_endian_and_object_values_take_numpy_path():
    rec, fake = _recorder(OBS_CASES["box-f32"], gs.Discrete(3))
    try:
        eid = rec.begin_episode(np.zeros(3, np.float32))
        rec.log_step(eid, np.int64(2), 0.0, np.arange(3, dtype=">f4"))
        rec.log_step(eid, 1, 0.0, np.arange(3, dtype=np.float32) + 1, truncated=True)
        rec.flush(1)
        batch = _events(fake)[1]
    finally:
        rec.close(0)
    np.testing.assert_array_equal(batch.observations[0], [[0, 1, 2], [1, 2, 3]])
    np.testing.assert_array_equal(batch.actions[0], [2, 1])
    assert batch.truncated and not batch.terminated


@pytest.mark.parametrize("later", [3, None, [1.0], {"other": 1.0}])
def test_later_extra_outputs_that_are_not_the_first_steps_mapping_abort_the_episode_cleanly(later):
    # a broken caller: the first step sets the keys, a later one passes something else. The
    # batch cannot be encoded: a ValueError names the step, the episode is aborted, and the
    # recorder goes on (no AttributeError out of the emit, nor out of close())
    rec, fake = _recorder(gs.Box(-1, 1, (2,), np.float32), gs.Discrete(2), max_batch_delay_s=3600)
    eid = rec.begin_episode(np.zeros(2, np.float32))
    rec.log_step(eid, 0, 1.0, np.zeros(2, np.float32), extra_model_outputs={"logp": 0.5})
    rec.log_step(eid, 0, 1.0, np.zeros(2, np.float32), extra_model_outputs=later)
    with pytest.raises(ValueError, match="step 1: extra_model_outputs"):
        rec.log_step(eid, 0, 1.0, np.zeros(2, np.float32), terminated=True, extra_model_outputs={"logp": 0.5})
    assert rec.open_episodes == 0
    other = rec.begin_episode(np.zeros(2, np.float32))
    rec.log_step(other, 1, 1.0, np.zeros(2, np.float32), terminated=True)
    assert rec.close(1) == 0
    stats = rec.stats
    assert (stats.failed, stats.buffered) == (3, 0), stats
    kinds = [type(e).__name__ for e in _events(fake)]
    assert kinds == ["EpisodeStart", "EpisodeAbort", "EpisodeStart", "StepBatch"], kinds


@pytest.mark.parametrize(
    "values",
    [
        [-0.5, -0.25, 0.0],  # Python floats
        [np.float32(-0.5), np.float32(-0.25), np.float32(0)],  # one numpy type
        [np.float16(-0.5), np.float16(-1), np.float16(0)],
        [np.float32(-0.5), -0.25, np.float64(-1)],  # mixed: numpy's promotion
        [np.float32(-0.5), np.array(-0.25, np.float32), -1.0],  # a shape () array among scalars
        [{"action_logp": -0.5, "vf": 1.0}, -0.25, {"action_logp": -1.0, "vf": 2.0}],  # keys differ
    ],
)
def test_propensity_only_steps_stack_as_numpy_does(values):
    # log_step keeps an action_logp that comes alone as its scalar; the batch must still carry
    # what numpy stacks of the per-step values, or refuse keys that differ between steps
    rec, fake = _recorder(OBS_CASES["box-f32"], gs.Discrete(2), max_batch_delay_s=3600)
    try:
        eid = rec.begin_episode(np.zeros(3, np.float32))
        outputs = [v if isinstance(v, dict) else {"action_logp": v} for v in values]
        differ = any(o.keys() != outputs[0].keys() for o in outputs)
        for i, o in enumerate(outputs):
            last = i == len(outputs) - 1
            if last and differ:
                with pytest.raises(ValueError, match="step 1: extra_model_outputs keys"):
                    rec.log_step(eid, 0, 0.0, np.zeros(3, np.float32), terminated=True, extra_model_outputs=o)
            else:
                rec.log_step(eid, 0, 0.0, np.zeros(3, np.float32), terminated=last, extra_model_outputs=o)
        rec.flush(1)
        events = _events(fake)
    finally:
        rec.close(0)
    if differ:
        assert [type(e).__name__ for e in events] == ["EpisodeStart", "EpisodeAbort"]
        return
    want = np.asarray([o["action_logp"] for o in outputs])
    got = events[1].extra_model_outputs["action_logp"]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_propensity_on_a_later_step_only_aborts_the_episode():
    # the first step set no outputs; a later propensity of 0.0 (falsy) is still an output given late
    rec, fake = _recorder(OBS_CASES["box-f32"], gs.Discrete(2), max_batch_delay_s=3600)
    try:
        eid = rec.begin_episode(np.zeros(3, np.float32))
        rec.log_step(eid, 0, 0.0, np.zeros(3, np.float32))
        with pytest.raises(ValueError, match="given on a later step"):
            rec.log_step(
                eid, 0, 0.0, np.zeros(3, np.float32), terminated=True, extra_model_outputs={"action_logp": 0.0}
            )
        rec.flush(1)
        kinds = [type(e).__name__ for e in _events(fake)]
    finally:
        rec.close(0)
    assert kinds == ["EpisodeStart", "EpisodeAbort"]


@pytest.mark.parametrize(
    "space",
    [
        gs.Box(-1.0, 1.0, (3,), np.float32),
        gs.Discrete(4),
        gs.Dict({"a": gs.Box(0, 255, (2, 2), np.uint8), "b": gs.MultiDiscrete([3, 4])}),
    ],
)
def test_an_empty_column_is_what_fastavro_writes_for_leaves_stacked_zero_deep(space):
    from rlrec.producer.events import _wire_leaves
    from rlrec.producer.recorder import _Packer

    parts: list = []
    _Packer(space, "observation").write_empty(parts)
    leaves = [np.zeros((0, *leaf.shape), leaf.dtype) for leaf in space_leaves(space)]
    # the schema's first array-of-leaves field defines rlrec.Array inline
    arrays = next(f["type"] for f in _latest()["StepBatch"][1]["fields"] if f["name"] == "actions")
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, arrays, _wire_leaves(leaves))
    assert b"".join(parts) == buf.getvalue()
