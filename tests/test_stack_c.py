"""The recorder's C column stacking (producer/_stack.c) writes exactly the Python path's bytes.

`rlrec.producer._stack.stack` returns a column's bytes only when every value is exact for the
column's dtype and shape; otherwise None, and the recorder stacks the batch in Python. So:
(1) for any batch, the message is byte for byte the same with the extension and without it
(or both paths raise the same error); (2) hostile or merely odd values make it give up, never
crash, raise or write something else. No broker: the recorder's producer is a stand-in.
"""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces as gs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlrec.producer import recorder
from tests.test_avro_write import _events, _recorder

_stack = recorder._c_stack


def test_the_extension_is_built():
    # CI installs with a C compiler: the fast path is what users of a normal install run
    assert recorder.ACCELERATED, "rlrec.producer._stack was not built (pip install needs a C compiler)"


needs_c = pytest.mark.skipif(_stack is None, reason="C extension not built")

SPACES = {
    "box-f32": gs.Box(-np.inf, np.inf, (4,), np.float32),
    "box-u8": gs.Box(0, 255, (3, 2), np.uint8),
    "box-f64-scalar": gs.Box(-1.0, 1.0, (), np.float64),
    "box-i8-scalar": gs.Box(-100, 100, (), np.int8),
    "discrete": gs.Discrete(300),
    "multidiscrete": gs.MultiDiscrete([3, 4]),
}


def _value(space: gs.Space, data, key: str):
    """A value for `space` in a form drawn by hypothesis: exact, Python scalar/list, another
    dtype, a non-contiguous view, big-endian, a 0-d array, a numpy scalar, out of range."""
    a = np.asarray(space.sample(), dtype=space.dtype)
    form = data.draw(st.sampled_from(["exact"] * 6 + ["py", "cast", "view", "big", "0d", "np", "huge"]), label=key)
    if form == "py":
        return a.tolist()
    if form == "cast":
        return a.astype({"f": np.float64, "i": np.int32, "u": np.uint16}.get(a.dtype.kind, a.dtype))
    if form == "view" and a.ndim:
        return np.repeat(a, 2, axis=-1)[..., ::2]
    if form == "big":
        return a.astype(a.dtype.newbyteorder(">"))
    if form == "0d" and a.ndim == 0:
        return np.array(a)
    if form == "np" and a.ndim == 0:
        return a[()]
    if form == "huge" and a.ndim == 0 and a.dtype.kind in "iu":
        return int(np.iinfo(a.dtype).max) + 1  # cast (wraps or raises) by numpy, refused by C
    return a


def _extra(data, i: int, keys: list[str]):
    out = {}
    for k in keys:
        form = data.draw(
            st.sampled_from(["f32", "f32", "arr", "f64", "py", "0d", "i32", "i64", "u8", "pyint"]),
            label=f"extra {i} {k}",
        )
        out[k] = {
            "f32": np.float32(i / 3),
            "arr": np.arange(2, dtype=np.float32) + i,
            "f64": np.float64(i),
            "py": float(i),
            "0d": np.array(i, np.float32),
            "i32": np.int32(i),
            "i64": np.int64(i),
            "u8": np.uint8(i),
            "pyint": i,  # numpy infers int64 for a column with Python ints in it
        }[form]
    if data.draw(st.integers(0, 30), label=f"odd keys {i}") == 0:
        out["surprise"] = np.float32(1)  # a key the first step did not have: an error either way
    return out


def _encode_both(rec, ep) -> list:
    """The batch encoded with the C path and with the Python path: bytes, or the error."""
    out = []
    clock, recorder._time = recorder._time, lambda: 1.7e9  # the batch's timestamp: the same twice
    for c in (_stack, None):
        recorder._c_stack = c
        try:
            out.append(rec._encode_batch(ep, False, True))
        except (ValueError, TypeError) as e:
            out.append((type(e), str(e)))
        finally:
            recorder._c_stack = _stack
    recorder._time = clock
    return out


@needs_c
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_c_and_python_paths_write_the_same_bytes(data):
    obs_name = data.draw(st.sampled_from(sorted(SPACES)), label="obs space")
    act_name = data.draw(st.sampled_from(["discrete", "multidiscrete", "box-f32", "box-i8-scalar"]), label="act")
    obs_space, act_space = SPACES[obs_name], SPACES[act_name]
    obs_space.seed(data.draw(st.integers(0, 99), label="seed"))
    act_space.seed(1)
    rec, _ = _recorder(obs_space, act_space, max_batch_steps=1000, max_batch_delay_s=1000)
    try:
        n = data.draw(st.integers(1, 12), label="steps")
        keys = data.draw(st.sampled_from([[], ["logp"], ["logp", "dist"]]), label="extra keys")
        eid = rec.begin_episode(np.asarray(obs_space.sample(), dtype=obs_space.dtype))
        for i in range(n):
            info = {"i": i} if data.draw(st.integers(0, 4), label=f"info {i}") == 0 else None
            try:
                rec.log_step(
                    eid,
                    _value(act_space, data, f"act {i}"),
                    float(i),
                    _value(obs_space, data, f"obs {i}"),
                    info=info,
                    extra_model_outputs=_extra(data, i, keys) if keys else None,
                )
            except (ValueError, TypeError):
                continue  # refused when logged (first-step dtype checks): nothing buffered
        ep = rec._episodes.get(eid)
        if ep is None or not ep.steps:
            return
        if data.draw(st.booleans(), label="delayed reward"):
            rec.log_reward(eid, ep.t0, 0.5)
        with_c, without = _encode_both(rec, ep)
        assert with_c == without
    finally:
        rec._episodes.clear()
        rec._buffered = 0
        rec.close(0)


F32 = np.dtype(np.float32)


def _col(values):
    return [(v,) for v in values]


@needs_c
@pytest.mark.parametrize(
    "values, dtype, shape, want",
    [
        ([np.float32(1), np.float32(2)], F32, (), np.float32([1, 2]).tobytes()),
        ([np.arange(4, dtype=np.float32)] * 2, F32, (4,), np.tile(np.arange(4, dtype=np.float32), 2).tobytes()),
        ([np.array(3, np.float32)], F32, (), np.float32([3]).tobytes()),
        ([1, 2**63 - 1, -(2**63)], np.dtype(np.int64), (), np.int64([1, 2**63 - 1, -(2**63)]).tobytes()),
        ([0, 255], np.dtype(np.uint8), (), np.uint8([0, 255]).tobytes()),
        ([-128, 127], np.dtype(np.int8), (), np.int8([-128, 127]).tobytes()),
        ([2**64 - 1], np.dtype(np.uint64), (), np.uint64([2**64 - 1]).tobytes()),
        ([1.5, -0.0], np.dtype(np.float64), (), np.float64([1.5, -0.0]).tobytes()),
    ],
)
def test_stack_takes_exact_values(values, dtype, shape, want):
    assert _stack.stack(_col(values), 0, None, 0, dtype, shape, False) == want


class _Sub(np.ndarray):
    pass


@needs_c
@pytest.mark.parametrize(
    "values, dtype, shape",
    [
        ([np.float32(1), np.float64(2)], F32, ()),  # another dtype: numpy casts, C does not
        ([np.arange(4, dtype=">f4")], F32, (4,)),  # big-endian
        ([np.arange(8, dtype=np.float32)[::2]], F32, (4,)),  # not contiguous
        ([np.arange(4, dtype=np.float32).reshape(2, 2)], F32, (4,)),  # another shape
        ([np.arange(4, dtype=np.float32).view(_Sub)], F32, (4,)),  # an ndarray subclass
        ([[1.0, 2.0, 3.0, 4.0]], F32, (4,)),  # a list
        ([1.0], F32, ()),  # a Python float for float32 (rounds: numpy decides)
        ([1], F32, ()),  # a Python int for a float dtype
        ([1.0], np.dtype(np.int64), ()),  # a float for an int dtype
        ([True], np.dtype(np.int64), ()),  # bool is not exactly an int
        ([128], np.dtype(np.int8), ()),
        ([-129], np.dtype(np.int8), ()),
        ([-1], np.dtype(np.uint8), ()),
        ([256], np.dtype(np.uint8), ()),
        ([2**63], np.dtype(np.int64), ()),
        ([2**64], np.dtype(np.uint64), ()),
        ([-1], np.dtype(np.uint64), ()),
        ([None], F32, ()),
        (["1"], F32, ()),
        ([np.float32(1)], F32, (1,)),  # a scalar where arrays of one element are expected
        ([], F32, ()),  # nothing to stack
    ],
)
def test_stack_gives_up_on_anything_else(values, dtype, shape):
    assert _stack.stack(_col(values), 0, None, 0, dtype, shape, False) is None


@needs_c
def test_stack_gives_up_on_odd_steps_and_dicts():
    ok = (np.float32(1),)
    assert _stack.stack([ok, [np.float32(1)]], 0, None, 0, F32, (), False) is None  # a list, not a tuple
    assert _stack.stack([ok, ()], 0, None, 0, F32, (), False) is None  # too short
    assert _stack.stack([ok], 1, None, 0, F32, (), False) is None  # index out of range
    assert _stack.stack([ok], -1, None, 0, F32, (), False) is None
    assert _stack.stack([ok], 0, None, 0, F32, (-1,), False) is None  # a negative dim
    assert _stack.stack([ok], 0, None, 0, F32, (2**62, 2**62), False) is None  # overflowing size

    def step(extra):
        return (None, extra)

    assert _stack.stack([step({"k": np.float32(1)})], 1, "k", 1, F32, (), True) == np.float32([1]).tobytes()
    assert _stack.stack([step({"k": np.float32(1), "x": 1})], 1, "k", 1, F32, (), True) is None  # extra key
    assert _stack.stack([step({"j": np.float32(1)})], 1, "k", 1, F32, (), True) is None  # missing key
    assert _stack.stack([step(None)], 1, "k", 1, F32, (), True) is None
    assert _stack.stack([step({1: np.float32(1)})], 1, 1, 1, F32, (), True) is None  # a key that is not a str

    from types import MappingProxyType

    assert _stack.stack([step(MappingProxyType({"k": np.float32(1)}))], 1, "k", 1, F32, (), True) is None
    with pytest.raises(TypeError):
        _stack.stack((ok,), 0, None, 0, F32, (), False)  # a programming error, not data: steps is a list


@needs_c
def test_a_key_whose_eq_mutates_the_batch_cannot_crash_it():
    steps: list = []

    class Evil:
        """Collides with 'k' and, when compared, empties the list being stacked."""

        def __hash__(self):
            return hash("k")

        def __eq__(self, other):
            steps.clear()
            return False

    steps.extend((None, {Evil(): 1.0}) for _ in range(50))
    assert _stack.stack(steps, 1, "k", 1, F32, (), True) is None
    assert steps == []


@needs_c
def test_any_set():
    assert _stack.any_set([(None, ""), (None, None), (None, {})], 1) is False
    assert _stack.any_set([(None, ""), (None, '{"a": 1}')], 1) is True
    assert _stack.any_set([(None, {"a": 1})], 1) is True
    assert _stack.any_set([(None, [1])], 1) is None  # not a str or dict: Python decides
    assert _stack.any_set([(None,)], 1) is None
    assert _stack.any_set([], 0) is False


@needs_c
def test_exact_batches_take_the_c_path(monkeypatch):
    """A CartPole-like batch of exact values (float32 observations, int actions, float32 and
    array extra outputs, an info, a delayed reward) is stacked by C alone, and decodes right."""

    def no_python(*a):
        raise AssertionError("the Python path ran")

    rec, fake = _recorder(SPACES["box-f32"], gs.Discrete(2), max_batch_steps=1000, max_batch_delay_s=1000)
    monkeypatch.setattr(recorder.EpisodeRecorder, "_columns_py", no_python)
    try:
        obs = np.arange(4 * 11, dtype=np.float32).reshape(11, 4)
        eid = rec.begin_episode(obs[0])
        for t in range(10):
            extra = {"logp": np.float32(-t), "dist": np.float32([t, -t])}
            info = {"t": t} if t == 4 else None
            rec.log_step(eid, t % 2, 1.0, obs[t + 1], terminated=t == 9, info=info, extra_model_outputs=extra)
            if t == 6:
                rec.log_reward(eid, 2, 0.5)
        rec.flush(1)
        batch = _events(fake)[1]
    finally:
        rec.close(0)
    np.testing.assert_array_equal(batch.observations[0], obs[1:])
    np.testing.assert_array_equal(batch.actions[0], [t % 2 for t in range(10)])
    np.testing.assert_array_equal(batch.rewards, [1.0, 1.0, 1.5] + [1.0] * 7)
    np.testing.assert_array_equal(batch.extra_model_outputs["logp"], -np.arange(10, dtype=np.float32))
    assert batch.extra_model_outputs["dist"].shape == (10, 2)
    assert batch.infos[4] == {"t": 4} and batch.infos[5] == {} and batch.terminated


@needs_c
def test_python_ints_join_only_the_column_dtype_numpy_would_infer():
    """Extra outputs have no space to cast to: numpy infers their dtype, and a Python int among
    numpy integers makes it int64. C takes a Python int there only for an int64 column."""

    def col(first):
        return [(None, {"k": first}), (None, {"k": 2})]

    for first in (np.int8(1), np.uint8(1), np.int32(1), np.uint64(1), np.array(1, np.int16)):
        assert _stack.stack(col(first), 1, "k", 1, first.dtype, (), True) is None, first.dtype
    assert _stack.stack(col(np.int64(1)), 1, "k", 1, np.dtype(np.int64), (), True) == np.int64([1, 2]).tobytes()
    # a column of a space (actions, observations) casts: there any int in range is exact
    assert _stack.stack(_col([np.int8(1), 2]), 0, None, 0, np.dtype(np.int8), (), False) == np.int8([1, 2]).tobytes()


@needs_c
@pytest.mark.parametrize("first", [np.int8(1), np.uint8(1), np.int32(1), np.uint64(1), np.int64(1), np.float32(1)])
def test_extra_outputs_mixing_numpy_and_python_ints_write_the_same_bytes(first):
    rec, _ = _recorder(SPACES["box-f32"], gs.Discrete(2), max_batch_steps=1000, max_batch_delay_s=1000)
    try:
        eid = rec.begin_episode(np.zeros(4, np.float32))
        for v in (first, 2, first):
            rec.log_step(eid, 0, 0.0, np.zeros(4, np.float32), extra_model_outputs={"k": v})
        with_c, without = _encode_both(rec, rec._episodes[eid])
        assert with_c == without
    finally:
        rec._episodes.clear()
        rec._buffered = 0
        rec.close(0)


@needs_c
def test_stack_takes_only_wire_dtypes_in_native_byte_order():
    objs = [(np.array([object(), object()], dtype=object),)]
    assert _stack.stack(objs, 0, None, 0, np.dtype(object), (2,), False) is None  # never copies pointers
    big = np.dtype(">f4")
    assert _stack.stack(_col([np.arange(2, dtype=big)]), 0, None, 0, big, (2,), False) is None
    assert _stack.stack(_col([np.complex64(1)]), 0, None, 0, np.dtype(np.complex64), (), False) is None
