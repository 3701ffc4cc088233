"""The event contract (rlrec.producer.events): encode/decode round trips and hostile input. No broker."""

from __future__ import annotations

import base64
import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
from gymnasium import spaces as gs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlrec.producer.arrays import ALLOWED_DTYPES, array_to_wire
from rlrec.producer.events import (
    DECODE_REASONS,
    POLICY_ID_RE,
    SCHEMA_HEADER,
    DecodeError,
    EpisodeAbort,
    EpisodeStart,
    RewardDelta,
    StepBatch,
    check_leaves,
    decode,
    dumps_info,
    encode,
    encode_record,
    load_schemas,
    loads_info,
    parse_space,
    schema_header,
)
from rlrec.producer.spaces import (
    dumps_space,
    flatten_value,
    loads_space,
    space_leaves,
    space_to_json,
    unflatten_leaves,
)

KINDS = ("EpisodeStart", "StepBatch", "RewardDelta", "EpisodeAbort")
DTYPES = sorted(ALLOWED_DTYPES)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------ helpers


def assert_array_equal(got: np.ndarray, want: np.ndarray) -> None:
    """Same dtype (by name: byte order aside), shape and bytes (NaN payloads included)."""
    want = np.asarray(want)
    assert isinstance(got, np.ndarray), type(got)
    assert got.dtype.name == want.dtype.name, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    le = want.dtype.newbyteorder("<")
    assert np.ascontiguousarray(got, dtype=le).tobytes() == np.ascontiguousarray(want, dtype=le).tobytes()


def assert_json_equal(got, want) -> None:
    """Deep equality of decoded infos: dicts in order, arrays by `assert_array_equal`."""
    if isinstance(want, np.ndarray):
        assert_array_equal(got, want)
    elif isinstance(want, np.generic):
        assert got == want.item() and type(got) is type(want.item())
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (got, want)
        for k in want:
            assert_json_equal(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(want), (got, want)
        for g, w in zip(got, want):
            assert_json_equal(g, w)
    elif isinstance(want, float):
        assert isinstance(got, float) and (got == want or (math.isnan(got) and math.isnan(want)))
    else:
        assert got == want and type(got) is type(want), (got, want)


def assert_space_equal(got: gs.Space, want: gs.Space) -> None:
    """Equal spaces, compared strictly: same JSON (exact bounds, dtypes, Dict key order)."""
    assert got == want
    assert dumps_space(got) == dumps_space(want)
    if isinstance(want, gs.Dict):
        assert list(got.spaces) == list(want.spaces)


def leaves_of(space: gs.Space, value) -> list[np.ndarray]:
    return [np.asarray(x, dtype=leaf.dtype) for x, leaf in zip(flatten_value(space, value), space_leaves(space))]


def stacked_leaves(space: gs.Space, values: list) -> list[np.ndarray]:
    per_step = [leaves_of(space, v) for v in values]
    return [np.stack([s[i] for s in per_step]) for i in range(len(space_leaves(space)))]


def roundtrip(ev):
    value, headers = encode(ev)
    assert headers == [(SCHEMA_HEADER, f"{ev.KIND}/1".encode())]
    out = decode(value, headers)
    assert type(out) is type(ev)
    return out


def reason_of(value, headers=None, **kw) -> str:
    with pytest.raises(DecodeError) as ei:
        decode(value, headers, **kw)
    assert ei.value.reason in DECODE_REASONS
    return ei.value.reason


# ---------------------------------------------------------------------------------- strategies

SHAPES = [(), (1,), (3,), (2, 3), (2, 1, 2)]
keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=6)


@st.composite
def box_spaces(draw) -> gs.Box:
    dt = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(st.sampled_from(SHAPES))
    size = math.prod(shape)
    if dt.kind == "f":
        bounds = draw(st.sampled_from(["scalar", "per-element", "infinite", "half-open"]))
        if bounds == "scalar":
            low, high = -2.5, 3.0
        elif bounds == "per-element":  # distinct bounds per element: checks row-major flattening
            low = (-1.0 - np.arange(size)).reshape(shape).astype(dt)
            high = (1.0 + 0.5 * np.arange(size)).reshape(shape).astype(dt)
        elif bounds == "infinite":
            low, high = -np.inf, np.inf
        else:
            low, high = np.full(shape, -1.0, dt), np.full(shape, np.inf, dt)
        return gs.Box(low, high, shape, dt)
    if dt.kind == "b":
        return gs.Box(0, 1, shape, dt)
    if dt.kind == "u":
        return gs.Box(0, draw(st.integers(1, 200)), shape, dt)
    low = (np.arange(size, dtype=np.int64) - draw(st.integers(0, 100))).reshape(shape)
    return gs.Box(low, low + draw(st.integers(1, 27)), shape, dt)


@st.composite
def discrete_spaces(draw) -> gs.Discrete:
    return gs.Discrete(
        draw(st.integers(1, 10)), start=draw(st.integers(-5, 5)), dtype=draw(st.sampled_from([np.int64, np.int32]))
    )


@st.composite
def multidiscrete_spaces(draw) -> gs.MultiDiscrete:
    shape = draw(st.sampled_from([(1,), (3,), (2, 2), (2, 3)]))
    nvec = np.array(draw(st.lists(st.integers(1, 6), min_size=math.prod(shape), max_size=math.prod(shape)))).reshape(
        shape
    )
    start = np.array(draw(st.lists(st.integers(-3, 3), min_size=math.prod(shape), max_size=math.prod(shape)))).reshape(
        shape
    )
    return gs.MultiDiscrete(nvec, dtype=draw(st.sampled_from([np.int64, np.int32])), start=start)


@st.composite
def multibinary_spaces(draw) -> gs.MultiBinary:
    return gs.MultiBinary(draw(st.sampled_from([1, 4, [2, 3], [1, 2, 2]])))


leaf_spaces = st.one_of(box_spaces(), discrete_spaces(), multidiscrete_spaces(), multibinary_spaces())


def _dicts(children):
    return st.lists(st.tuples(keys, children), min_size=1, max_size=3, unique_by=lambda kv: kv[0]).map(gs.Dict)


def _tuples(children):
    return st.lists(children, min_size=1, max_size=3).map(gs.Tuple)


spaces = st.recursive(leaf_spaces, lambda children: st.one_of(_dicts(children), _tuples(children)), max_leaves=6)


def nested_space() -> gs.Dict:
    """A Dict holding a Tuple holding a Dict (and every leaf type), keys deliberately unsorted."""
    inner = gs.Dict([("z", gs.Box(-1, 1, (2, 2), np.float32)), ("a", gs.MultiBinary([2, 2]))])
    return gs.Dict(
        [
            ("pos", gs.Box(-np.inf, np.inf, (3,), np.float64)),
            ("inv", gs.Tuple([gs.Discrete(4, start=1), inner, gs.MultiDiscrete([[2, 3], [4, 5]])])),
            ("flag", gs.Box(0, 1, (), bool)),
        ]
    )


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),  # what msgpack keeps (outside: bad-info)
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
info_keys = st.text(max_size=6).filter(lambda k: k != "$ndarray")


@st.composite
def info_arrays(draw) -> np.ndarray:
    dt = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(st.sampled_from([(), (0,), (3,), (2, 2), (0, 3)]))
    raw = draw(st.binary(min_size=dt.itemsize * math.prod(shape), max_size=dt.itemsize * math.prod(shape)))
    a = np.frombuffer(raw, dtype=dt).reshape(shape).copy()
    if dt.kind == "b":
        a = a.view(np.uint8) % 2 == 1  # valid booleans only
    if draw(st.booleans()) and dt.itemsize > 1:
        a = a.astype(dt.newbyteorder(">"))  # big-endian input: the wire makes it little-endian
    return a


json_values = st.recursive(
    json_scalars | info_arrays(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(info_keys, children, max_size=3),
    max_leaves=8,
)
infos = st.dictionaries(info_keys, json_values, max_size=4)
ids = st.text(min_size=1, max_size=40)
policy_ids = st.from_regex(POLICY_ID_RE, fullmatch=True)
env_ids = st.text(max_size=20).filter(str.isprintable)
finite = st.floats(allow_nan=False, allow_infinity=False)


# ---------------------------------------------------------------------------------- round trips


@SETTINGS
@given(space=spaces)
def test_space_json_round_trip(space):
    text = dumps_space(space)
    json.loads(text)  # standard JSON (no NaN/Infinity tokens)
    back = loads_space(text)
    assert_space_equal(back, space)
    assert [(x.dtype, x.shape) for x in space_leaves(back)] == [(x.dtype, x.shape) for x in space_leaves(space)]


def test_space_json_examples_and_key_order():
    s = nested_space()
    d = space_to_json(s)
    assert [k for k, _ in d["spaces"]] == ["pos", "inv", "flag"]
    assert d["spaces"][0][1]["low"] == ["-inf"] * 3
    back = loads_space(dumps_space(s))
    assert list(back.spaces) == ["pos", "inv", "flag"]
    assert list(back["inv"][1].spaces) == ["z", "a"]
    assert_space_equal(back, s)
    # bounds are flat and row-major
    b = gs.Box(np.array([[0, 1], [2, 3]], np.float32), np.array([[4, 5], [6, 7]], np.float32))
    assert space_to_json(b)["low"] == [0.0, 1.0, 2.0, 3.0] and space_to_json(b)["high"] == [4.0, 5.0, 6.0, 7.0]
    # extreme integer bounds survive exactly (no trip through float64)
    for dt in (np.int64, np.uint64):
        i = np.iinfo(dt)
        b = gs.Box(i.min, i.max, (2,), dt)
        assert np.array_equal(loads_space(dumps_space(b)).high, b.high)
    md = gs.MultiDiscrete([[2, 3], [4, 5]], start=[[0, 1], [-1, 0]])
    assert_space_equal(loads_space(dumps_space(md)), md)
    assert loads_space(dumps_space(gs.MultiBinary([2, 3]))).shape == (2, 3)
    assert loads_space(dumps_space(gs.Discrete(3, start=-1))).start == -1


@SETTINGS
@given(
    space=spaces,
    act_space=spaces,
    seed=st.integers(0, 2**31 - 1),
    info=infos,
    eid=ids,
    pid=policy_ids,
    version=st.integers(0, 2**62),
    env_id=env_ids,
    ts=st.integers(0, 2**62),
)
def test_episode_start_round_trip(space, act_space, seed, info, eid, pid, version, env_id, ts):
    space.seed(seed)
    obs = leaves_of(space, space.sample())
    ev = EpisodeStart(eid, pid, version, obs, space, act_space, env_id, info, ts)
    out = roundtrip(ev)
    assert (out.episode_id, out.policy_id, out.policy_version, out.env_id, out.timestamp_ms) == (
        eid,
        pid,
        version,
        env_id,
        ts,
    )
    assert len(out.observation) == len(obs)
    for g, w in zip(out.observation, obs):
        assert_array_equal(g, w)
    assert_space_equal(out.observation_space, space)
    assert_space_equal(out.action_space, act_space)
    assert_json_equal(out.info, info)
    check_leaves(out.observation, space_leaves(out.observation_space), None, "observation")
    value = unflatten_leaves(out.observation_space, out.observation)
    assert out.observation_space.contains(value)


@SETTINGS
@given(
    obs_space=spaces,
    act_space=spaces,
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 5),
    data=st.data(),
    t0=st.integers(0, 2**40),
    flags=st.sampled_from([(False, False), (True, False), (False, True)]),
)
def test_step_batch_round_trip(obs_space, act_space, seed, n, data, t0, flags):
    obs_space.seed(seed)
    act_space.seed(seed + 1)
    actions = stacked_leaves(act_space, [act_space.sample() for _ in range(n)])
    observations = stacked_leaves(obs_space, [obs_space.sample() for _ in range(n)])
    rewards = np.array(data.draw(st.lists(finite, min_size=n, max_size=n)), dtype=np.float64)
    step_infos = data.draw(st.none() | st.lists(infos, min_size=n, max_size=n))
    extra = data.draw(st.dictionaries(keys, st.sampled_from(DTYPES), max_size=3))
    extra = {k: np.arange(n * 2).reshape(n, 2).astype(dt) for k, dt in extra.items()}
    ev = StepBatch("ep-1", t0, actions, rewards, observations, *flags, step_infos, extra, 1234)
    out = roundtrip(ev)
    assert out.n == n and out.t0 == t0 and (out.terminated, out.truncated) == flags
    assert out.episode_id == "ep-1" and out.timestamp_ms == 1234
    assert_array_equal(out.rewards, rewards)
    for g, w in zip(out.actions, actions, strict=True):
        assert_array_equal(g, w)
    for g, w in zip(out.observations, observations, strict=True):
        assert_array_equal(g, w)
    assert list(out.extra_model_outputs) == list(extra)
    for k in extra:
        assert_array_equal(out.extra_model_outputs[k], extra[k])
    if step_infos is None or not any(step_infos):
        assert out.infos is None  # all-empty infos are not sent
    else:
        assert_json_equal(out.infos, step_infos)
    check_leaves(out.actions, space_leaves(act_space), n, "actions")
    check_leaves(out.observations, space_leaves(obs_space), n, "observations")


@SETTINGS
@given(eid=ids, t=st.integers(0, 2**63 - 1), reward=finite, ts=st.integers(-(2**63), 2**63 - 1))
def test_reward_delta_round_trip(eid, t, reward, ts):
    out = roundtrip(RewardDelta(eid, t, reward, ts))
    assert (out.episode_id, out.t, out.timestamp_ms) == (eid, t, ts)
    assert out.reward == reward and math.copysign(1, out.reward) == math.copysign(1, reward)


@SETTINGS
@given(eid=ids, reason=st.text(max_size=50), ts=st.integers(0, 2**62))
def test_episode_abort_round_trip(eid, reason, ts):
    out = roundtrip(EpisodeAbort(eid, reason, ts))
    assert (out.episode_id, out.reason, out.timestamp_ms) == (eid, reason, ts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_box_of_every_dtype_round_trip(dtype):
    dt = np.dtype(dtype)
    for shape in [(), (1,), (3,), (2, 3), (2, 1, 2)]:
        if dt.kind == "f":
            space = gs.Box(-np.inf, np.inf, shape, dt)
        elif dt.kind == "b":
            space = gs.Box(0, 1, shape, dt)
        else:
            space = gs.Box(0, 100, shape, dt)
        assert_space_equal(loads_space(dumps_space(space)), space)
        space.seed(0)
        values = [space.sample() for _ in range(4)]
        start = roundtrip(EpisodeStart("e", "p", 0, leaves_of(space, values[0]), space, space))
        assert_array_equal(start.observation[0], np.asarray(values[0], dt))
        assert start.observation[0].shape == shape
        batch = roundtrip(
            StepBatch(
                "e",
                0,
                stacked_leaves(space, values[1:]),
                np.zeros(3),
                stacked_leaves(space, values[1:]),
                extra_model_outputs={"x": np.zeros((3, *shape), dt)},
            )
        )
        for arrays in (batch.actions, batch.observations, [batch.extra_model_outputs["x"]]):
            assert arrays[0].dtype.name == dtype and arrays[0].shape == (3, *shape)
        assert_array_equal(batch.observations[0], np.stack([np.asarray(v, dt) for v in values[1:]]))
        check_leaves(batch.actions, space_leaves(start.action_space), 3, "actions")


def test_nested_dict_in_tuple_in_dict_all_kinds():
    obs_space = nested_space()
    act_space = gs.Tuple([gs.Discrete(3), gs.Dict([("b", gs.MultiBinary(2)), ("a", gs.Box(-1, 1, (2,), np.float16))])])
    obs_space.seed(0)
    act_space.seed(1)
    first = obs_space.sample()
    start = roundtrip(
        EpisodeStart(
            "e",
            "p",
            2,
            leaves_of(obs_space, first),
            obs_space,
            act_space,
            "Nested-v0",
            {"deep": [{"x": np.arange(4, dtype=np.int16).reshape(2, 2)}, None]},
            5,
        )
    )
    assert_space_equal(start.observation_space, obs_space)
    # leaves: depth first, Dict children in key order (pos, inv: [Discrete, z, a, MultiDiscrete], flag)
    assert [x.shape for x in space_leaves(start.observation_space)] == [(3,), (), (2, 2), (2, 2), (2, 2), ()]
    rebuilt = unflatten_leaves(start.observation_space, start.observation)
    assert list(rebuilt) == ["pos", "inv", "flag"] and list(rebuilt["inv"][1]) == ["z", "a"]
    assert obs_space.contains(rebuilt)
    np.testing.assert_array_equal(rebuilt["inv"][1]["z"], first["inv"][1]["z"])
    obs = [obs_space.sample() for _ in range(3)]
    acts = [act_space.sample() for _ in range(3)]
    batch = roundtrip(
        StepBatch(
            "e",
            0,
            stacked_leaves(act_space, acts),
            np.array([1.0, 0.0, -1.0]),
            stacked_leaves(obs_space, obs),
            True,
            False,
            [{}, {"a": 1}, {}],
            {"logits": np.zeros((3, 3), np.float32)},
            6,
        )
    )
    check_leaves(batch.observations, space_leaves(start.observation_space), 3, "observations")
    check_leaves(batch.actions, space_leaves(start.action_space), 3, "actions")
    assert batch.infos == [{}, {"a": 1}, {}]
    assert roundtrip(RewardDelta("e", 2, 0.5, 7)).reward == 0.5
    assert roundtrip(EpisodeAbort("e", "why", 8)).reason == "why"


# ---------------------------------------------------------------------------------------- infos


@SETTINGS
@given(info=infos)
def test_info_round_trip(info):
    text = dumps_info(info)
    assert text == "" if not info else isinstance(json.loads(text), dict)
    assert_json_equal(loads_info(text), info)


def test_info_nested_values_and_arrays():
    info = {
        "a": {"b": [1, 2.5, None, True, "x", {"c": []}]},
        "arr": np.arange(6, dtype=np.float32).reshape(2, 3),
        "scalar": np.float32(0.25),
        "flag": np.bool_(True),
        "empty": np.zeros((0, 2), np.uint8),
    }
    back = loads_info(dumps_info(info))
    assert back["a"] == info["a"] and back["scalar"] == 0.25 and back["flag"] is True
    assert_array_equal(back["arr"], info["arr"])
    assert_array_equal(back["empty"], info["empty"])
    assert json.loads(dumps_info({"arr": np.array([1], np.int64)})) == {
        "arr": {"$ndarray": {"dtype": "int64", "shape": [1], "data": base64.b64encode(np.int64(1).tobytes()).decode()}}
    }
    assert dumps_info({}) == "" and dumps_info(None) == "" and loads_info("") == {}


@pytest.mark.parametrize(
    "bad",
    [
        {1, 2},
        object(),
        np.array([object()]),
        np.array(["str"]),
        np.array([1j]),
        b"bytes",
        {"nested": {"set": frozenset()}},
    ],
)
def test_info_unsupported_values_raise_type_error(bad):
    info = {"k": bad}
    with pytest.raises(TypeError):
        dumps_info(info)
    space = gs.Discrete(2)
    with pytest.raises(TypeError):
        encode(EpisodeStart("e", "p", 0, [np.array(0)], space, space, info=info))
    with pytest.raises(TypeError):
        encode(StepBatch("e", 0, [np.array([0])], np.array([0.0]), [np.array([0])], infos=[info]))


def test_info_not_a_dict_raises_type_error():
    with pytest.raises(TypeError):
        dumps_info([1, 2])


# ----------------------------------------------------------------------------- hostile input


def _arr(a) -> dict:
    return array_to_wire(np.asarray(a))


def _raw(kind: str, **over) -> tuple[bytes, list]:
    """A valid raw record of `kind` (Box(2,) float32 obs, Discrete(3) actions), with fields replaced."""
    box = gs.Box(-1, 1, (2,), np.float32)
    base = {
        "EpisodeStart": {
            "episode_id": "e1",
            "policy_id": "p",
            "policy_version": 1,
            "env_id": "",
            "observation": [_arr(np.zeros(2, np.float32))],
            "info": "",
            "observation_space": dumps_space(box),
            "action_space": dumps_space(gs.Discrete(3)),
            "timestamp_ms": 1,
        },
        "StepBatch": {
            "episode_id": "e1",
            "t0": 0,
            "actions": [_arr(np.array([0, 1], np.int64))],
            "rewards": _arr(np.array([1.0, 2.0])),
            "observations": [_arr(np.zeros((2, 2), np.float32))],
            "terminated": False,
            "truncated": False,
            "infos": None,
            "extra_model_outputs": {},
            "timestamp_ms": 1,
        },
        "RewardDelta": {"episode_id": "e1", "t": 0, "reward": 1.0, "timestamp_ms": 1},
        "EpisodeAbort": {"episode_id": "e1", "reason": "", "timestamp_ms": 1},
    }[kind]
    base.update(over)
    return encode_record(kind, base), schema_header(kind)


VALID = [_raw(k) for k in KINDS]


def test_raw_records_are_valid():
    for value, headers in VALID:
        decode(value, headers)


@pytest.mark.parametrize("headers", [None, [], [("other", b"StepBatch/1")], {}, {"x": b"y"}])
def test_no_header(headers):
    value, _ = VALID[1]
    assert reason_of(value, headers) == "bad-header"


@pytest.mark.parametrize(
    "hv",
    [
        b"",
        b"StepBatch",
        b"StepBatch/",
        b"StepBatch/x",
        b"/1",
        b"a/b/c",
        b"StepBatch/1/2",
        b"\xff\xfe/1",
        b"StepBatch/\xff",
        None,
        b"StepBatch/1.0",
    ],
)
def test_garbage_header(hv):
    value, _ = VALID[1]
    assert reason_of(value, [(SCHEMA_HEADER, hv)]) in ("bad-header", "unknown-schema")
    if hv in (b"", b"StepBatch", b"StepBatch/x", b"a/b/c", b"\xff\xfe/1", None, b"StepBatch/1.0"):
        assert reason_of(value, [(SCHEMA_HEADER, hv)]) == "bad-header"


def test_header_forms():
    value, headers = VALID[1]
    assert isinstance(decode(value, {SCHEMA_HEADER: b"StepBatch/1"}), StepBatch)  # a mapping works too
    assert isinstance(decode(value, [("a", b"b"), *headers]), StepBatch)  # other headers are ignored


class _CountedHeaders(list):
    """Headers that count how often they are read through."""

    scans = 0

    def __iter__(self):
        self.scans += 1
        return super().__iter__()


def test_decode_event_reads_the_header_once_and_decodes_as_decode_does():
    from rlrec.producer.multi_agent_events import decode_event

    for value, headers in VALID:
        counted = _CountedHeaders([("a", b"b"), *headers])
        got, want = decode_event(value, counted, key=b"e"), decode(value, headers)
        assert counted.scans == 1
        assert type(got) is type(want) and got.episode_id == want.episode_id
        assert got.timestamp_ms == want.timestamp_ms
    value = VALID[1][0]
    for headers, kw in (
        (None, {}),
        ([(SCHEMA_HEADER, None)], {}),
        ([(SCHEMA_HEADER, b"Foo/1")], {}),
        ([(SCHEMA_HEADER, b"StepBatch/7")], {}),
        (VALID[1][1], {"max_bytes": 3}),
        (VALID[1][1], {"key": b"k" * 1025}),
        ([(SCHEMA_HEADER, b"nonsense")], {"key": b"k" * 1025}),
    ):
        with pytest.raises(DecodeError) as ei:
            decode_event(value, headers, **kw)
        assert ei.value.reason == reason_of(value, headers, **kw), (headers, kw)


@pytest.mark.parametrize("hv", [b"Foo/1", b"stepbatch/1", b"Array/1", b"DecodeError/1"])
def test_unknown_kind(hv):
    assert reason_of(VALID[1][0], [(SCHEMA_HEADER, hv)]) == "unknown-schema"


@pytest.mark.parametrize(
    "hv", [b"StepBatch/0", b"StepBatch/2", b"StepBatch/99", b"StepBatch/-1", b"EpisodeStart/" + b"9" * 30]
)
def test_unknown_version(hv):
    assert reason_of(VALID[1][0], [(SCHEMA_HEADER, hv)]) == "unknown-schema"


def test_random_bytes():
    rng = np.random.default_rng(0)
    for i in range(300):
        value = rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8).tobytes()
        reason_of(value, schema_header(KINDS[i % 4]))
    assert reason_of(b"", schema_header("StepBatch")) == "malformed"
    assert reason_of(b"\x00" * 3, schema_header("EpisodeStart")) == "malformed"
    assert reason_of(None, schema_header("StepBatch")) == "malformed"  # a tombstone


@pytest.mark.parametrize("i", range(len(KINDS)))
def test_truncated_body(i):
    value, headers = VALID[i]
    for cut in range(len(value)):
        assert reason_of(value[:cut], headers) == "malformed", cut


@pytest.mark.parametrize("i", range(len(KINDS)))
def test_trailing_bytes(i):
    value, headers = VALID[i]
    for tail in (b"\x00", b"\x02ab", b"garbage" * 10):
        assert reason_of(value + tail, headers) == "malformed"


def test_bit_flipped_bodies_raise_only_decode_error():
    """Every single-bit flip of every valid message: an event or a DecodeError, nothing else."""
    nested = nested_space()
    nested.seed(3)
    extra = [
        encode(
            EpisodeStart(
                "e", "p", 1, leaves_of(nested, nested.sample()), nested, gs.Discrete(2), "x", {"a": np.arange(3)}, 1
            )
        ),
        encode(
            StepBatch(
                "e",
                0,
                [np.array([1, 0])],
                np.array([0.5, 1.0]),
                [np.ones((2, 2), np.float32)],
                infos=[{"x": [1]}, {}],
                extra_model_outputs={"logp": np.zeros(2, np.float32)},
            )
        ),
    ]
    reasons = set()
    for value, headers in VALID + extra:
        for pos in range(len(value)):
            for bit in range(8):
                b = bytearray(value)
                b[pos] ^= 1 << bit
                try:
                    decode(bytes(b), headers)
                except DecodeError as e:
                    reasons.add(e.reason)
    assert "malformed" in reasons and reasons <= set(DECODE_REASONS)


@pytest.mark.parametrize(
    "dtype", ["object", "void", "<U4", "O", "V8", "complex128", "float128", "datetime64", ">f4", "f4", ""]
)
def test_bad_dtype(dtype):
    a = {"dtype": dtype, "shape": [2], "data": b"\x00" * 8}
    assert reason_of(*_raw("StepBatch", actions=[a])) == "bad-dtype"
    assert reason_of(*_raw("StepBatch", observations=[a, a])) == "bad-dtype"
    assert reason_of(*_raw("StepBatch", extra_model_outputs={"x": a})) == "bad-dtype"
    assert reason_of(*_raw("EpisodeStart", observation=[a])) == "bad-dtype"
    info = json.dumps({"a": {"$ndarray": {"dtype": dtype, "shape": [2], "data": base64.b64encode(b"\0" * 8).decode()}}})
    assert reason_of(*_raw("StepBatch", infos=[info, ""])) == "bad-dtype"


@pytest.mark.parametrize(
    "shape,nbytes",
    [
        ([2], 7),
        ([2], 9),
        ([2, 2], 8),
        ([], 0),
        ([0], 4),
        ([3], 0),
        ([-1], 4),
        ([2, -2], 16),
        ([-1, -1], 4),
        ([0, 2**62, 2**62], 0),
        ([2**40, 2**40], 0),
        ([1] * 40, 4),
    ],
)
def test_bad_shape(shape, nbytes):
    a = {"dtype": "float32", "shape": shape, "data": b"\x00" * nbytes}
    assert reason_of(*_raw("StepBatch", observations=[a])) == "bad-shape"
    assert reason_of(*_raw("EpisodeStart", observation=[a])) == "bad-shape"
    info = json.dumps(
        {"a": {"$ndarray": {"dtype": "float32", "shape": shape, "data": base64.b64encode(b"\0" * nbytes).decode()}}}
    )
    assert reason_of(*_raw("EpisodeStart", info=info)) == "bad-shape"


def test_inconsistent_leading_dims():
    assert reason_of(*_raw("StepBatch", actions=[_arr(np.array([0, 1, 2]))])) == "bad-shape"
    assert reason_of(*_raw("StepBatch", actions=[_arr(np.array(0))])) == "bad-shape"  # 0-d: no step axis
    assert reason_of(*_raw("StepBatch", observations=[_arr(np.zeros((1, 2), np.float32))])) == "bad-shape"
    assert reason_of(*_raw("StepBatch", extra_model_outputs={"logp": _arr(np.zeros(3))})) == "bad-shape"
    assert reason_of(*_raw("StepBatch", infos=["", "", ""])) == "bad-shape"
    assert reason_of(*_raw("StepBatch", infos=[""])) == "bad-shape"
    # rewards define n: float64, 1-D, n >= 1
    assert reason_of(*_raw("StepBatch", rewards=_arr(np.array([1.0, 2.0], np.float32)))) == "bad-shape"
    assert reason_of(*_raw("StepBatch", rewards=_arr(np.zeros((2, 1))))) == "bad-shape"
    assert reason_of(*_raw("StepBatch", rewards=_arr(np.zeros(0)), actions=[], observations=[])) == "bad-shape"
    assert reason_of(*_raw("StepBatch", rewards=_arr(np.float64(1.0)))) == "bad-shape"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward(bad):
    assert reason_of(*_raw("StepBatch", rewards=_arr(np.array([1.0, bad])))) == "non-finite-reward"
    assert reason_of(*_raw("RewardDelta", reward=bad)) == "non-finite-reward"
    # through the public encoder too (encode does not check; decode does)
    value, headers = encode(StepBatch("e", 0, [np.array([0])], np.array([bad]), [np.array([0.0])]))
    assert reason_of(value, headers) == "non-finite-reward"


def test_episode_start_observation_contradicts_space():
    cases = [
        [_arr(np.zeros(2, np.float64))],  # dtype
        [_arr(np.zeros(3, np.float32))],  # shape
        [_arr(np.zeros((1, 2), np.float32))],  # stacked where a single value is expected
        [],  # leaf count
        [_arr(np.zeros(2, np.float32))] * 2,
    ]
    for obs in cases:
        assert reason_of(*_raw("EpisodeStart", observation=obs)) == "space-mismatch"
    dict_space = gs.Dict([("b", gs.Discrete(2)), ("a", gs.Box(0, 1, (2,), np.float32))])
    # leaves in the wrong order (a's leaf first) contradict the declared key order
    wrong = [_arr(np.zeros(2, np.float32)), _arr(np.int64(0))]
    assert (
        reason_of(*_raw("EpisodeStart", observation_space=dumps_space(dict_space), observation=wrong))
        == "space-mismatch"
    )
    right = [_arr(np.int64(0)), _arr(np.zeros(2, np.float32))]
    assert isinstance(
        decode(*_raw("EpisodeStart", observation_space=dumps_space(dict_space), observation=right)), EpisodeStart
    )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[]",
        "null",
        "1",
        '{"type": "Weird"}',
        '{"n": 3}',
        '{"type": "Discrete", "n": 0}',
        '{"type": "Discrete", "n": true}',
        '{"type": "Discrete", "n": 3, "dtype": "object"}',
        '{"type": "Box", "shape": [2], "dtype": "object", "low": [0, 0], "high": [1, 1]}',
        '{"type": "Box", "shape": [2], "dtype": "float32", "low": [0], "high": [1, 1]}',
        '{"type": "Box", "shape": [-2], "dtype": "float32", "low": [], "high": []}',
        '{"type": "Box", "shape": [2], "dtype": "float32", "low": ["x", 0], "high": [1, 1]}',
        '{"type": "Box", "shape": [1], "dtype": "int8", "low": [0], "high": [1000]}',
        '{"type": "Box", "shape": [1], "dtype": "int8", "low": [0.5], "high": [1]}',
        '{"type": "Box", "shape": [100000, 100000], "dtype": "uint8", "low": [], "high": []}',
        '{"type": "MultiDiscrete", "shape": [2], "nvec": [2], "dtype": "int64"}',
        '{"type": "MultiBinary", "shape": "3"}',
        '{"type": "Dict", "spaces": {"a": {"type": "Discrete", "n": 2}}}',
        '{"type": "Dict", "spaces": [["a", {"type": "Discrete", "n": 2}], ["a", {"type": "Discrete", "n": 2}]]}',
        '{"type": "Tuple", "spaces": "x"}',
        '{"type": "Graph"}',
        '{"type": "Tuple", "spaces": [' * 40 + '{"type": "Discrete", "n": 2}' + "]}" * 40,
        "[" * 100_000,
    ],
)
def test_invalid_space_json(text):
    assert reason_of(*_raw("EpisodeStart", observation_space=text)) == "bad-space"
    assert reason_of(*_raw("EpisodeStart", action_space=text)) == "bad-space"
    with pytest.raises(DecodeError) as ei:
        parse_space(text)
    assert ei.value.reason == "bad-space"


def test_check_leaves_mismatch():
    leaves = space_leaves(gs.Dict([("x", gs.Box(0, 1, (2,), np.float32)), ("k", gs.Discrete(3))]))
    ok = [np.zeros((4, 2), np.float32), np.zeros(4, np.int64)]
    check_leaves(ok, leaves, 4, "observations")
    check_leaves([a[0] for a in ok], leaves, None, "observation")
    for bad, n in [
        (ok, 3),
        (ok[:1], 4),
        (ok + ok[:1], 4),
        ([ok[0].astype(np.float64), ok[1]], 4),
        ([ok[0], ok[1].astype(np.int32)], 4),
        ([ok[0][:, :1], ok[1]], 4),
        (ok, None),
        ([ok[1], ok[0]], 4),
    ]:
        with pytest.raises(DecodeError) as ei:
            check_leaves(bad, leaves, n, "observations")
        assert ei.value.reason == "space-mismatch"


def test_oversize():
    value, headers = VALID[0]
    assert isinstance(decode(value, headers, max_bytes=len(value)), EpisodeStart)
    assert reason_of(value, headers, max_bytes=len(value) - 1) == "oversize"
    assert reason_of(b"x" * 100, None, max_bytes=10) == "oversize"  # checked before anything else


def test_bad_values():
    assert reason_of(*_raw("StepBatch", episode_id="")) == "bad-value"
    assert reason_of(*_raw("EpisodeAbort", episode_id="x" * 257)) == "bad-value"
    assert isinstance(decode(*_raw("EpisodeAbort", episode_id="x" * 256)), EpisodeAbort)
    assert reason_of(*_raw("StepBatch", t0=-1)) == "bad-value"
    assert reason_of(*_raw("RewardDelta", t=-5)) == "bad-value"
    assert reason_of(*_raw("EpisodeStart", policy_version=-1)) == "bad-value"
    # policy ids become path components; env ids are printable text (see also test_ids_are_validated)
    assert reason_of(*_raw("EpisodeStart", policy_id="")) == "bad-policy-id"


@pytest.mark.parametrize(
    "policy_id",
    ["../x", "/x", ".", "..", "a//b", "a/b", "x\0y", "a" * 201, "_manifest", ".hidden", "-x", "a b", "é", "pol\n"],
)
def test_policy_ids_that_cannot_name_a_directory_are_refused(policy_id):
    """Today's main accepted all of these; the flush then failed on every retry (or wrote outside
    the policy's directory) and the partition stalled."""
    assert reason_of(*_raw("EpisodeStart", policy_id=policy_id)) == "bad-policy-id"


@pytest.mark.parametrize("policy_id", ["pol", "cartpole-expert", "A.b_c-9", "a" * 200, "0"])
def test_good_policy_ids_pass(policy_id):
    assert decode(*_raw("EpisodeStart", policy_id=policy_id)).policy_id == policy_id


@pytest.mark.parametrize(
    ("env_id", "reason"),
    [
        ("ALE/Pong-v5", None),
        ("CartPole-v1", None),
        ("", None),
        ("x" * 256, None),
        ("x" * 257, "bad-env-id"),
        ("a\nb", "bad-env-id"),
        ("a\x00b", "bad-env-id"),
        ("a\x1bb", "bad-env-id"),
        ("\ud800", "bad-env-id"),
    ],
)
def test_env_ids(env_id, reason):
    if "\ud800" in env_id:  # Avro cannot even carry a lone surrogate (not UTF-8): malformed or bad-env-id
        with pytest.raises((DecodeError, UnicodeEncodeError)):
            decode(*_raw("EpisodeStart", env_id=env_id))
        return
    assert reason_or_none(*_raw("EpisodeStart", env_id=env_id)) == reason


@pytest.mark.parametrize(
    ("info", "reason"),
    [
        ('{"x": 18446744073709551615}', None),  # uint64 max
        ('{"x": -9223372036854775808}', None),  # int64 min
        ('{"x": 18446744073709551616}', "bad-info"),  # 2**64: msgpack cannot pack it
        ('{"x": -9223372036854775809}', "bad-info"),
        ('{"x": [1, {"y": 99999999999999999999999}]}', "bad-info"),
        ('{"x": "\\ud800"}', "bad-info"),  # a lone surrogate (JSON escape)
        ('{"\\udfff": 1}', "bad-info"),  # ... also in a key
        ('{"x": "\\ud83d\\ude00"}', None),  # a surrogate *pair* is a real character
    ],
)
def test_info_values_the_shard_formats_cannot_hold(info, reason):
    """Today's main stored these; the episodes-format flush then raised on every retry."""
    assert reason_or_none(*_raw("StepBatch", infos=[info, ""])) == reason  # n=2 steps


def test_keys_over_1_kib_are_refused():
    value, headers = _raw("RewardDelta")
    assert isinstance(decode(value, headers, key=b"k" * 1024), RewardDelta)
    assert reason_of(value, headers, key=b"k" * 1025) == "key-too-large"


def reason_or_none(value, headers=None, **kw) -> str | None:
    try:
        decode(value, headers, **kw)
    except DecodeError as e:
        return e.reason
    return None


@pytest.mark.parametrize(
    "info",
    [
        "[1, 2]",
        "1",
        "not json",
        '"s"',
        "{",
        '{"a": {"$ndarray": 1}}',
        '{"a": {"$ndarray": {"dtype": "int8", "shape": [1], "data": "!!"}}}',
        '{"a": {"$ndarray": {"dtype": "int8", "shape": null, "data": "AA=="}}}',
        '{"a": {"$ndarray": {"dtype": "int8", "shape": ["x"], "data": "AA=="}}}',
        '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}",
        '{"a": 1' + "0" * 5000 + "}",
    ],
)
def test_bad_info_json(info):
    assert reason_of(*_raw("EpisodeStart", info=info)) == "bad-json"
    assert reason_of(*_raw("StepBatch", infos=[info, ""])) == "bad-json"


# ------------------------------------------------------------------------- no code execution


class _Touch:
    """Unpickling this calls Path.touch(marker): proof that a decoder executed data."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _payloads(marker: Path) -> list[bytes]:
    pk = [pickle.dumps(_Touch(marker), protocol=p) for p in (0, 2, pickle.HIGHEST_PROTOCOL)]
    out = list(pk)
    try:
        import msgpack
    except ImportError:  # pragma: no cover - msgpack is a consumer dependency
        return out
    # msgpack-numpy's object-array form: decoding it with msgpack_numpy.decode unpickles `data`
    out.append(msgpack.packb({b"nd": True, b"type": b"|O", b"kind": b"O", b"shape": [1], b"data": pk[-1]}))
    out.append(
        msgpack.packb({"observations": {b"nd": True, b"type": b"|O", b"kind": b"O", b"shape": [1], b"data": pk[-1]}})
    )
    out.append(msgpack.packb(msgpack.ExtType(42, pk[-1])))
    return out


def test_crafted_pickle_and_msgpack_payloads_are_not_executed(tmp_path):
    control = tmp_path / "control"
    pickle.loads(_payloads(control)[0])  # the payloads are live: loading one the usual way runs it
    assert control.exists()
    marker = tmp_path / "pwned"
    pk = pickle.dumps(_Touch(marker))
    b64 = base64.b64encode(pk).decode()
    smuggled = [
        # as a whole message, under every kind and a few bogus headers
        *[(p, schema_header(k)) for p in _payloads(marker) for k in KINDS],
        *[(p, [(SCHEMA_HEADER, hv)]) for p in _payloads(marker) for hv in (b"pickle/1", b"msgpack/1", b"")],
        *[(p, None) for p in _payloads(marker)],
        # inside valid Avro: as an object array, in an info, as a space
        _raw("StepBatch", actions=[{"dtype": "object", "shape": [2], "data": pk}]),
        _raw("StepBatch", actions=[{"dtype": "O", "shape": [2], "data": pk}]),
        _raw("EpisodeStart", observation=[{"dtype": "void", "shape": [1], "data": pk}]),
        _raw("StepBatch", extra_model_outputs={"x": {"dtype": "object", "shape": [2], "data": pk}}),
        _raw("EpisodeStart", info=json.dumps({"x": {"$ndarray": {"dtype": "object", "shape": [1], "data": b64}}})),
        _raw("EpisodeStart", observation_space=json.dumps({"type": "Pickle", "data": b64})),
        _raw("EpisodeStart", observation_space=pk.decode("latin-1")),
    ]
    for value, headers in smuggled:
        try:
            decode(value, headers)
        except DecodeError:
            pass
        else:  # pragma: no cover
            pytest.fail(f"decoded a smuggled payload: {value[:40]!r}")
    # jsonpickle-style markup in an info is just data: a plain dict comes back
    tagged = {"x": {"py/reduce": b64, "__class__": "pathlib.Path"}}
    assert decode(*_raw("EpisodeStart", info=json.dumps(tagged))).info == tagged
    assert not marker.exists()


def test_decode_module_imports_nothing_unsafe():
    import rlrec.producer.arrays
    import rlrec.producer.events
    import rlrec.producer.spaces

    for mod in (rlrec.producer.events, rlrec.producer.arrays, rlrec.producer.spaces):
        src = Path(mod.__file__).read_text()
        for name in ("import pickle", "import msgpack", "cloudpickle", "eval(", "exec(", "allow_pickle=True"):
            assert name not in src, (mod.__name__, name)


# --------------------------------------------------------------------------------------- fuzz

_VALID_BODIES = [v for v, _ in VALID]
_HEADER_VALUES = [f"{k}/{v}".encode() for k in KINDS for v in (0, 1, 2)] + [b"", b"/", b"x/1", b"\xff"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.one_of(
        st.binary(max_size=400),
        st.tuples(st.sampled_from(_VALID_BODIES), st.integers(0, 400), st.binary(min_size=1, max_size=8)).map(
            lambda t: t[0][: t[1]] + t[2] + t[0][t[1] + len(t[2]) :]
        ),  # overwrite a few bytes of a valid body
    ),
    headers=st.one_of(
        st.none(),
        st.lists(
            st.tuples(
                st.sampled_from([SCHEMA_HEADER, "other", "RLREC-SCHEMA"]),
                st.one_of(st.none(), st.binary(max_size=20), st.sampled_from(_HEADER_VALUES)),
            ),
            max_size=3,
        ),
        st.dictionaries(st.sampled_from([SCHEMA_HEADER, "x"]), st.sampled_from(_HEADER_VALUES)),
    ),
    max_bytes=st.none() | st.integers(0, 500),
)
def test_fuzz_decode_returns_event_or_decode_error(body, headers, max_bytes):
    try:
        ev = decode(body, headers, max_bytes=max_bytes)
    except DecodeError as e:
        assert e.reason in DECODE_REASONS
    else:
        assert isinstance(ev, (EpisodeStart, StepBatch, RewardDelta, EpisodeAbort))


def test_decode_reasons_documented():
    assert set(DECODE_REASONS) == {
        "oversize",
        "bad-header",
        "unknown-schema",
        "malformed",
        "bad-dtype",
        "bad-shape",
        "bad-json",
        "bad-space",
        "space-mismatch",
        "bad-value",
        "non-finite-reward",
        "bad-policy-id",
        "bad-env-id",
        "bad-info",
        "key-too-large",
        "extra-output-mismatch",
        "out-of-space",
        "non-finite-value",
        "unknown-agent",
        "out-of-order",
    }
    fmt = (Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md").read_text()
    assert [r for r in DECODE_REASONS if f"| `{r}` |" not in fmt] == []  # each has its row in FORMAT.md
    with pytest.raises(AssertionError):
        DecodeError("not-a-reason", "x")
    assert issubclass(DecodeError, ValueError)
    multi = {("MultiAgentEpisodeStart", 1), ("MultiAgentStepBatch", 1), ("RewardDelta", 2)}
    assert set(load_schemas()) == {(k, 1) for k in KINDS} | multi


def test_per_space_remembers_per_object_holds_no_space_and_is_byte_bounded():
    """The memo behind shard encoding (`per_space`): the same object gives the remembered value,
    an equal but distinct one is computed again, a collected space leaves the memo, and distinct
    huge spaces (a hostile stream) never hold more than `max_bytes` of values."""
    import gc

    from rlrec.producer.spaces import dumps_space, per_space

    calls = []

    def fn(space):
        calls.append(type(space).__name__)  # not the space: the memo must be its only referrer
        return dumps_space(space)

    memo = per_space(fn, max_bytes=2_000_000)
    box = gs.Box(0, 1, (4,), np.float32)
    assert memo(box) == memo(box) == dumps_space(box) and len(calls) == 1
    twin = gs.Box(0, 1, (4,), np.float32)
    assert memo(twin) == dumps_space(box) and len(calls) == 2
    del twin
    gc.collect()
    assert len(memo._memo) == 1  # the collected twin's entry went with it
    held = []
    for i in range(20):  # ~0.6 MB of JSON each
        held.append(gs.Box(-float(i), 1.0, (40_000,), np.float32))
        memo(held[-1])
        assert memo.nbytes <= 2_000_000
    assert 1 <= len(memo._memo) <= 4
    assert memo(held[-1]) == dumps_space(held[-1]) and len(calls) == 22  # the newest is remembered
    assert memo(box) == dumps_space(box) and len(calls) == 23  # the oldest was dropped for room
    del held
    gc.collect()
    assert len(memo._memo) == 1 and memo.nbytes < 1000


def test_multi_agent_starts_share_parsed_spaces_through_the_bounded_space_cache():
    from rlrec.producer import multi_agent_events as mae
    from rlrec.producer.events import _SpaceCache

    box = gs.Box(-1.0, 1.0, (3,), np.float32)
    start = mae.MultiAgentEpisodeStart(
        "ep-x",
        "default",
        1,
        {"a0": mae.AgentSpec("a0", "m0", box, gs.Discrete(4))},
        observations={"a0": [np.zeros(3, np.float32)]},
    )
    value, headers = mae.encode_event(start)
    one, two = mae.decode_event(value, headers), mae.decode_event(value, headers)
    assert one.agents["a0"].observation_space is two.agents["a0"].observation_space == box
    assert isinstance(mae._parsed_spaces, _SpaceCache)
    texts = [mae.dumps_space(box, compact=True), "not cached"]
    assert mae._parsed_spaces.cached(texts)[0][0] is one.agents["a0"].observation_space
    assert mae._parsed_spaces.cached(texts)[1] is None
