"""`log_step`'s fast path in C (producer/_hotpath.c) has exactly the Python method's effect.

The C method takes a call only when `_log_step_py` would just append the step to its batch;
every other call goes to `_log_step_py` unchanged. So: (1) for any sequence of calls - odd
values, odd argument forms, full buffers, errors - a recorder driven through `log_step` ends
in the same state, sends the same messages and raises the same errors as one driven through
`_log_step_py`; (2) the common step in the middle of a batch never reaches Python; (3) threads
logging while batches are sent lose and repeat nothing; (4) it leaks no references. No broker:
the recorder's producer is a stand-in (tests/test_avro_write.py).
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections import OrderedDict

import numpy as np
import pytest
from gymnasium import spaces as gs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlrec.producer import recorder
from rlrec.producer.recorder import EpisodeRecorder, RecorderFullError
from tests.test_avro_write import _events, _KeepingProducer, _recorder

needs_c = pytest.mark.skipif(recorder._hotpath is None, reason="C extension not built")

OBS = gs.Box(-10, 10, (4,), np.float32)
ACTIONS = {"discrete": gs.Discrete(3), "box": gs.Box(-1, 1, (2,), np.float32)}
DICT_OBS = gs.Dict({"a": gs.Box(-1, 1, (2,), np.float32)})


class _Int(np.int64):  # a numpy scalar subclass: its `shape` is the class's business
    pass


class _Shaped(np.int64):  # ... which may claim any shape: Python's path prepares it
    shape = (2,)


class _Arr(np.ndarray):
    pass


class _Str(str):
    pass


def _stopped(rec: EpisodeRecorder) -> EpisodeRecorder:
    """No poller thread: deliveries and lingering batches happen only when the test says."""
    rec._stop.set()
    rec._poller.join()
    return rec


def _form(data, label: str, usual: list, odd: list):
    """A usual value most of the time (so that many calls qualify for the fast path), else an odd one."""
    if data.draw(st.integers(0, 15), label=f"{label} odd?") or not odd:
        return data.draw(st.sampled_from(usual), label=label)
    return data.draw(st.sampled_from(odd), label=label)


def _obs(data, i, space):
    if isinstance(space, gs.Dict):
        return {"a": np.full(2, i / 10, np.float32)}
    a = np.full(4, i / 10, np.float32)
    odd = {
        "f64": a.astype(np.float64),  # the right shape: no prepare; the stacking casts it
        "list": a.tolist(),
        "shape": np.zeros((2, 2), np.float32),
        "view": np.repeat(a, 2)[::2],  # the right shape, not contiguous
        "sub": a.view(_Arr),
        "0d": np.array(1.0, np.float32),
        "nan": np.full(4, np.nan, np.float32),
        "str": "obs",
    }
    return _pick(data, "obs", {"exact": a}, odd)


def _pick(data, label: str, usual: dict, odd: dict):
    return {**usual, **odd}[_form(data, label, sorted(usual), sorted(odd))]


def _action(data, act_name):
    if act_name == "box":
        usual = {"exact": np.zeros(2, np.float32)}
        odd = {
            "list": [0.0, 0.5],
            "shape": np.zeros(3, np.float32),
            "obs-shape": np.zeros(4, np.float32),
            "int": 1,
            "np": np.float32(1),
        }
    else:
        usual = {"exact": 1, "np": np.int64(2), "0d": np.array(1)}
        odd = {"bool": True, "float": 1.0, "sub": _Int(1), "big": 2**70, "out": 7, "none": None, "arr": np.zeros(1)}
    return _pick(data, "action", usual, odd)


ODD = object()  # an argument form the signature does not allow (left out of the call)


def _call(data, rec, eids, act_name, obs_space, i, with_extra):
    """Positional and keyword arguments for one log_step call, in a form drawn by hypothesis."""
    open_ids = sorted(rec._episodes)  # the same on both recorders (compared after every call)
    eid = _form(data, "eid", open_ids or ["nope"], [*eids, "nope", 7, _Str(eids[0]) if eids else "x"])
    reward = _form(data, "reward", [1.0, -0.5], [1, np.float32(0.5), np.float64(2.0), float("nan"), float("inf"), "r"])
    flags = [True, None, 0, 1, np.bool_(False), ODD]
    terminated = _form(data, "terminated", [False, ODD], flags)
    truncated = _form(data, "truncated", [False, ODD], flags)
    info = _form(data, "info", [ODD, None], [{}, {"k": i}, [], OrderedDict(), "x"])
    usual = [{"logp": np.float32(i)}] if with_extra else [ODD, None]
    extra = _form(data, "extra", usual, [ODD, None, {1: 2}, {"logp": "x"}, {"other": 1.0}, {"logp": np.float32(i)}])
    values = [eid, _action(data, act_name), reward, _obs(data, i, obs_space), terminated, truncated, info, extra]
    names = ["episode_id", "action", "reward", "observation", "terminated", "truncated", "info", "extra_model_outputs"]
    npos = data.draw(st.integers(0, 8), label="positional")
    args, kwargs = [], {}
    for j, (name, v) in enumerate(zip(names, values)):
        if v is ODD:
            continue
        if j < npos and len(args) == j:
            args.append(v)
        else:
            kwargs[name] = v
    odd = data.draw(st.sampled_from([None] * 40 + ["unknown", "twice", "many", "missing", "dynamic"]), label="odd")
    if odd == "unknown":
        kwargs["extra"] = 1
    elif odd == "twice" and args:
        kwargs[names[0]] = args[0]
    elif odd == "many":
        args = [*values[:8], 1]
        kwargs = {}
    elif odd == "missing":
        kwargs.pop("observation", None)
        args = args[:3]
    elif odd == "dynamic" and kwargs:  # a keyword name that is not the interned str
        k = next(iter(kwargs))
        kwargs["".join(list(k))] = kwargs.pop(k)
    return args, kwargs


def _norm(x):
    """A comparable form of a stored value (its type, dtype, shape and bytes)."""
    if isinstance(x, np.ndarray):
        return ("nd", type(x), x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, np.generic):
        return ("np", type(x), x.tobytes())
    if isinstance(x, dict):
        return ("dict", type(x), tuple((k, _norm(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_norm(v) for v in x))
    if isinstance(x, float) and x != x:
        return ("nan",)
    return (type(x), x)


def _state(rec: EpisodeRecorder, fake: _KeepingProducer) -> tuple:
    eps = {
        eid: (
            ep.t,
            ep.t0,
            ep.dropping,
            ep.extra_keys,
            dict(ep.reward_adds),
            ep.first_buffered,
            [_norm(s) for s in ep.steps],
        )
        for eid, ep in rec._episodes.items()
    }
    kinds = [h[0][1].split(b"/")[0] for _, h in fake.messages]
    batches = [v for v, h in fake.messages if h[0][1].startswith(b"StepBatch")]
    counters = (rec._buffered, rec._delivered, rec._failed, rec._dropped, rec._episodes_begun, list(rec._msgs))
    return counters, eps, dict(rec._finished), kinds, batches, rec._batch_limit


def _outcome(fn, *args, **kwargs):
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as e:  # the same error, or the same return, on both paths
        return (type(e), str(e))


@needs_c
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_log_step_in_c_has_the_python_methods_effect(data):
    act_name = data.draw(st.sampled_from(sorted(ACTIONS)), label="action space")
    obs_space = data.draw(st.sampled_from([OBS] * 9 + [DICT_OBS]), label="obs space")
    with_extra = data.draw(st.booleans(), label="extra model outputs")
    overflow = data.draw(st.sampled_from(["drop", "raise", "block"]), label="on_overflow")
    config = {
        "max_buffered_steps": 10_000 if overflow == "block" else data.draw(st.integers(1, 40), label="max buffered"),
        "on_overflow": overflow,
        "max_batch_steps": data.draw(st.integers(1, 30), label="max batch"),
        "max_batch_delay_s": 3600,
        "validate_spaces": data.draw(st.sampled_from([False] * 9 + [True]), label="validate"),
    }
    pair = [_recorder(obs_space, ACTIONS[act_name], **config) for _ in range(2)]
    for rec, _ in pair:
        _stopped(rec)
    (c_rec, c_fake), (py_rec, py_fake) = pair
    clocks = recorder._time, recorder._monotonic
    recorder._time = lambda: 1.7e9  # timestamps in messages: the same twice
    try:
        eids: list[str] = []
        for i in range(data.draw(st.integers(1, 60), label="calls")):
            recorder._monotonic = lambda i=i: float(i)  # when a batch started: the same twice
            op = data.draw(
                st.sampled_from(
                    ["step"] * 20 + ["begin"] * 2 + ["deliver"] * 2 + ["reward", "abort", "linger", "close", "fork"]
                )
            )
            if not c_rec._episodes and data.draw(st.integers(0, 7), label="begin one"):
                op = "begin"
            if op == "begin":
                eid = f"ep{len(eids)}"
                eids.append(eid)
                first = {"a": np.zeros(2, np.float32)} if obs_space is DICT_OBS else np.zeros(4, np.float32)
                got = [_outcome(r.begin_episode, first, episode_id=eid) for r, _ in pair]
            elif op == "step":
                args, kwargs = _call(data, c_rec, eids, act_name, obs_space, i, with_extra)
                got = [_outcome(c_rec.log_step, *args, **kwargs), _outcome(py_rec._log_step_py, *args, **kwargs)]
            elif op == "reward" and eids:
                t = data.draw(st.integers(0, 5), label="reward t")
                got = [_outcome(r.log_reward, eids[-1], t, 0.5) for r, _ in pair]
            elif op == "abort" and eids:
                got = [_outcome(r.abort_episode, eids[-1], "test") for r, _ in pair]
            elif op == "deliver":
                got = [f.poll(0) for _, f in pair]
            elif op == "linger":
                got = [_outcome(r._emit_lingering, float("inf")) for r, _ in pair]
            elif op == "close" and data.draw(st.integers(0, 3), label="really close") == 0:
                got = [_outcome(r.close, 0) for r, _ in pair]
            elif op == "fork" and data.draw(st.integers(0, 3), label="really fork") == 0:
                for r, _ in pair:  # what os.fork's hook does to every recorder (in the child)
                    r._forked = r._unusable = True
                got = [None, None]
            else:
                continue
            assert got[0] == got[1], (op, got)
            assert _state(c_rec, c_fake) == _state(py_rec, py_fake), op
    finally:
        recorder._time, recorder._monotonic = clocks
        for r, _ in pair:
            r._episodes.clear()
            r._buffered = 0
            r.close(0)


_USUAL = {"reward": 1.0, "observation": np.zeros(4, np.float32)}
_ODD_CALLS = [  # (action space, keyword, value): one odd argument in an otherwise usual call
    *[
        ("discrete", "action", v)
        for v in (True, 1.0, _Int(1), _Shaped(1), 2**70, 7, -1, None, np.zeros(1), np.float32(1), "1")
    ],
    *[("box", "action", v) for v in (1, np.float32(1), np.zeros(4, np.float32), np.zeros(3, np.float32), [0.0, 0.5])],
    *[("box", "action", np.zeros(2, t)) for t in (np.float64, np.int32)],
    *[("discrete", "reward", v) for v in (1, True, np.float32(0.5), np.float64(2.0), float("nan"), -float("inf"), "1")],
    *[("discrete", "observation", v) for v in (np.zeros((2, 2), np.float32), np.zeros(4).tolist(), np.zeros(4, ">f4"))],
    *[("discrete", "observation", v) for v in (np.zeros(8, np.float32)[::2], np.zeros(4, np.float32).view(_Arr))],
    *[("discrete", "terminated", v) for v in (True, 1, 0, np.bool_(False), np.bool_(True), "")],
    *[("discrete", "truncated", v) for v in (True, 1, 0, np.bool_(False), None)],
    *[("discrete", "info", v) for v in ({}, {"k": 1}, [], OrderedDict(), OrderedDict(k=1), "", "x")],
    *[("discrete", "extra_model_outputs", v) for v in ({}, {"other": 1.0}, {"logp": "x"}, {1: 2}, 3)],
    *[("discrete", "episode_id", v) for v in (_Str("e"), b"e", 7, "other")],
]


@needs_c
@pytest.mark.parametrize("act_name, name, value", _ODD_CALLS, ids=lambda x: repr(x)[:30])
def test_an_odd_argument_in_the_middle_of_a_batch_has_the_python_effect(act_name, name, value, monkeypatch):
    """One odd value after two usual steps, then a usual step: outcome and state as in Python."""
    monkeypatch.setattr(recorder, "_monotonic", lambda: 1.0)  # clocks: the same for both
    monkeypatch.setattr(recorder, "_time", lambda: 1.7e9)
    pair = [_recorder(OBS, ACTIONS[act_name], max_batch_delay_s=3600) for _ in range(2)]
    usual_action = np.zeros(2, np.float32) if act_name == "box" else 1
    try:
        for r, _ in pair:
            _stopped(r).begin_episode(np.zeros(4, np.float32), episode_id="e")
        calls = ["usual", "usual", "odd", "usual"]
        for call in calls:
            kwargs = {"episode_id": "e", **_USUAL, "action": usual_action, "extra_model_outputs": {"logp": 0.5}}
            if call == "odd":
                kwargs[name] = value
            (c_rec, c_fake), (py_rec, py_fake) = pair
            got = [_outcome(c_rec.log_step, **kwargs), _outcome(py_rec._log_step_py, **kwargs)]
            assert got[0] == got[1], call
            assert _state(c_rec, c_fake) == _state(py_rec, py_fake), call
    finally:
        for r, _ in pair:
            r.close(0)


@needs_c
def test_a_step_in_the_middle_of_a_batch_never_reaches_python(monkeypatch):
    calls = []
    real = EpisodeRecorder._log_step_py
    monkeypatch.setattr(EpisodeRecorder, "_log_step_py", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    rec, fake = _recorder(OBS, gs.Discrete(2), max_batch_steps=50, max_batch_delay_s=3600)
    _stopped(rec)
    try:
        logp = {"action_logp": np.float32(0.5)}
        for _ in range(3):
            eid = rec.begin_episode(np.zeros(4, np.float32))
            for t in range(120):  # batches of 50, 50, 20: the first and last step of each in Python
                rec.log_step(eid, t & 1, 1.0, np.full(4, t, np.float32), terminated=t == 119, extra_model_outputs=logp)
        assert len(calls) == 3 * 6, len(calls)
        fake.poll(0)
        batches = [e for e in _events(fake) if type(e).__name__ == "StepBatch"]
        assert [len(b.rewards) for b in batches] == [50, 50, 20] * 3
        obs = np.concatenate([b.observations[0] for b in batches[:3]])  # one leaf
        assert np.array_equal(obs[:, 0], np.arange(120, dtype=np.float32))
        assert rec.stats.buffered == 0 and rec.stats.delivered == 3 * 121
    finally:
        rec.close(0)


@needs_c
@pytest.mark.parametrize("form", ["np-int", "0d-array", "box-array"])
def test_numpy_actions_take_the_fast_path(monkeypatch, form):
    calls = []
    real = EpisodeRecorder._log_step_py
    monkeypatch.setattr(EpisodeRecorder, "_log_step_py", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    space = gs.Box(-1, 1, (2,), np.float32) if form == "box-array" else gs.Discrete(3)
    action = {"np-int": np.int64(2), "0d-array": np.array(2), "box-array": np.zeros(2, np.float32)}[form]
    rec, _ = _recorder(OBS, space, max_batch_delay_s=3600)
    _stopped(rec)
    try:
        eid = rec.begin_episode(np.zeros(4, np.float32))
        for _ in range(10):
            rec.log_step(eid, action, 0.0, np.zeros(4, np.float32))
        assert len(calls) == 1  # the first step only
    finally:
        rec.close(0)


@needs_c
def test_threads_logging_while_batches_are_sent_lose_and_repeat_nothing():
    rec, fake = _recorder(OBS, gs.Discrete(2), max_batch_steps=37, max_batch_delay_s=0.001, max_buffered_steps=500)
    threads, steps = 4, 3_000
    errors: list = []

    def log(k: int) -> None:
        try:
            eid = rec.begin_episode(np.zeros(4, np.float32), episode_id=f"w{k}")
            for t in range(steps):
                rec.log_step(eid, t & 1, float(t), np.full(4, t, np.float32), terminated=t == steps - 1)
        except Exception as e:  # reported below
            errors.append(e)

    workers = [threading.Thread(target=log, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    assert rec.flush(10) == 0
    seen: dict[str, list] = {}
    for e in _events(fake):
        if type(e).__name__ == "StepBatch":
            assert e.t0 == len(seen.setdefault(e.episode_id, [])), "a gap or a repeat"
            seen[e.episode_id] += list(e.rewards)
            assert np.array_equal(e.observations[0][:, 0], e.rewards.astype(np.float32))
    assert {k: v == [float(t) for t in range(steps)] for k, v in seen.items()} == {
        f"w{k}": True for k in range(threads)
    }
    assert rec.stats.delivered == threads * (steps + 1) and rec.stats.buffered == 0
    rec.close(0)


@needs_c
def test_the_fast_path_leaks_no_references():
    rec, fake = _recorder(OBS, gs.Discrete(2), max_batch_steps=64, max_batch_delay_s=3600)
    _stopped(rec)
    obs, reward, extra = np.zeros(4, np.float32), 1.5, {"action_logp": np.float32(0.5)}

    def episode(eid: str, steps: int) -> None:
        rec.begin_episode(obs, episode_id=eid)
        for t in range(steps):
            rec.log_step(eid, 1, reward, obs, terminated=t == steps - 1, extra_model_outputs=extra)
        fake.poll(0)
        fake.messages.clear()

    episode("warm", 3)
    eid = "e" * 40
    before = [sys.getrefcount(x) for x in (obs, reward, extra, eid)]
    episode(eid, 5_000)  # 5,000 steps, nearly all in C
    rec._finished.clear()
    gc.collect()
    assert [sys.getrefcount(x) for x in (obs, reward, extra, eid)] == before
    rec.close(0)


@needs_c
def test_a_full_buffer_and_a_closed_recorder_take_the_python_path():
    rec, _ = _recorder(OBS, gs.Discrete(2), max_buffered_steps=4, on_overflow="raise", max_batch_delay_s=3600)
    _stopped(rec)
    eid = rec.begin_episode(np.zeros(4, np.float32))
    for _ in range(3):
        rec.log_step(eid, 0, 1.0, np.zeros(4, np.float32))
    with pytest.raises(RecorderFullError):
        rec.log_step(eid, 0, 1.0, np.zeros(4, np.float32))
    assert rec._episodes[eid].t == 3
    rec.close(0)
    with pytest.raises(RuntimeError, match="closed"):
        rec.log_step(eid, 0, 1.0, np.zeros(4, np.float32))


def test_log_step_keeps_its_signature_and_doc():
    import inspect

    params = list(inspect.signature(EpisodeRecorder.log_step).parameters)
    assert params == [
        "self",
        "episode_id",
        "action",
        "reward",
        "observation",
        "terminated",
        "truncated",
        "info",
        "extra_model_outputs",
    ]
    assert "Record one step" in EpisodeRecorder.log_step.__doc__


class _GetItemRaises(dict):
    def __getitem__(self, key):
        raise KeyError("via __getitem__")


_CHANGES = {  # what another thread does while log_step waits for the recorder's lock
    "new lock": lambda rec: setattr(rec, "_lock", threading.Lock()),
    "episodes deleted": lambda rec: delattr(rec, "_episodes"),
    "episodes a dict subclass": lambda rec: setattr(rec, "_episodes", _GetItemRaises(rec._episodes)),
}


def _wait_then_change(rec: EpisodeRecorder, log_step, change) -> tuple:
    eid = rec.begin_episode(np.zeros(4, np.float32), episode_id="e")
    for _ in range(2):
        log_step(eid, 1, 1.0, np.zeros(4, np.float32))
    held = rec._lock
    held.acquire()  # as the poller does while it sends a batch
    out: list = []
    worker = threading.Thread(target=lambda: out.append(_outcome(log_step, eid, 1, 1.0, np.zeros(4, np.float32))))
    worker.start()
    time.sleep(0.2)  # the worker waits in acquire()
    change(rec)
    held.release()
    worker.join(5)
    assert not worker.is_alive()
    episodes = getattr(rec, "_episodes", None)
    ep = dict.get(episodes, eid) if isinstance(episodes, dict) else None
    return out, held.locked(), ep.t if ep is not None else None


@needs_c
@pytest.mark.parametrize("change", sorted(_CHANGES))
def test_what_changes_while_log_step_waits_for_the_lock_is_seen_as_python_sees_it(change):
    # the C path keeps the lock it acquired (released the same), reads `_episodes` only after
    # acquiring it and looks ids up in an exact dict only (it crashed or released the new lock)
    got = []
    for path in ("log_step", "_log_step_py"):
        rec, _ = _recorder(OBS, gs.Discrete(3), max_batch_delay_s=3600)
        _stopped(rec)
        lock = rec._lock
        got.append(_wait_then_change(rec, getattr(rec, path), _CHANGES[change]))
        rec._episodes, rec._lock = {}, lock  # as built, for close()
        rec.close(0)
    assert got[0] == got[1]
    assert got[0][1] is False  # the lock that was acquired was released


def test_episode_ids_are_kept_as_plain_str():
    # a str subclass's __hash__/__eq__ would run inside every lookup of the id (in C, under the lock)
    class Hostile(str):
        def __str__(self):
            return self

        def __eq__(self, other):
            raise AssertionError("ran")

        __hash__ = str.__hash__

    rec, _ = _recorder(OBS, gs.Discrete(3), max_batch_delay_s=3600)
    _stopped(rec)
    eid = rec.begin_episode(np.zeros(4, np.float32), episode_id=Hostile("h"))
    assert type(eid) is str and eid == "h" and all(type(k) is str for k in rec._episodes)
    for _ in range(3):
        rec.log_step("h", 1, 1.0, np.zeros(4, np.float32))
    assert rec._episodes["h"].t == 3
    rec.close(0)


def test_max_buffered_steps_takes_any_integer():
    rec, _ = _recorder(OBS, gs.Discrete(3), max_buffered_steps=10**20, max_batch_steps=10**20)
    assert rec.max_buffered_steps == sys.maxsize  # clamped: no buffer gets that big
    rec.max_buffered_steps = np.int64(500)
    assert rec.max_buffered_steps == 500
    rec.max_buffered_steps = 1e6
    assert rec.max_buffered_steps == 1_000_000
    with pytest.raises(ValueError, match=">= 1"):
        rec.max_buffered_steps = 0
    rec.close(0)


def test_a_subclass_may_not_hide_the_fields_the_c_path_uses():
    with pytest.raises(TypeError, match="_buffered"):

        class Counting(EpisodeRecorder):
            @property
            def _buffered(self):
                return 0

    class Wrapping(EpisodeRecorder):  # overriding methods is fine
        def log_step(self, *args, **kwargs):
            return super().log_step(*args, **kwargs)


def test_a_bad_call_names_log_step():
    rec, _ = _recorder(OBS, gs.Discrete(3))
    with pytest.raises(TypeError, match=r"EpisodeRecorder\.log_step\(\) missing 1 required positional"):
        rec.log_step("e", 1, 1.0)
    with pytest.raises(TypeError, match=r"EpisodeRecorder\.log_step\(\) got an unexpected keyword"):
        rec.log_step("e", 1, 1.0, np.zeros(4, np.float32), done=True)
    rec.close(0)
