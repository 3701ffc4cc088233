"""Hostile input: whatever arrives on the topic, the consumer dead-letters it with the right reason,
keeps running, executes nothing, and still commits the good episodes around it.

* `test_hostile_topic_*`: a real broker and a real `RecorderConsumer`; random bytes, truncated and
  bit-flipped events, unknown schemas, arrays contradicting their space, object/void dtypes,
  oversize messages, NaN/inf rewards, events for unknown episodes, pickle and msgpack-numpy
  payloads, and every assembly-level violation, interleaved with good episodes. Every hostile
  message is matched, by source partition and offset, to exactly one dead letter with its reason.
  (Moved here from test_consumer_faults.py and extended.)
* `test_fuzz_*`: property-based fuzzing (hypothesis, derandomized, fixed example budgets) of
  `rlrec.producer.events.decode` (structure-aware records and byte mutations: an event or a
  `DecodeError`, nothing else) and of the trainer's safe episode decoding
  (`rlrec.store.episodes.unpack_episode`: an episode or an `EpisodeDecodeError`, and object arrays
  anywhere are refused without being unpickled).

Decode-level reasons for single fields are pinned in tests/test_events.py; the assembly rules in
tests/test_assembly.py; `capacity` in tests/test_memory_bound.py.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import time
import uuid
from datetime import timedelta

import msgpack
import msgpack_numpy as mnp
import numpy as np
import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlrec.consumer.assembly import CONSUMER_REASONS
from rlrec.producer import EpisodeRecorder
from rlrec.producer.arrays import ALLOWED_DTYPES, array_to_wire
from rlrec.producer.events import (
    DECODE_REASONS,
    SCHEMA_HEADER,
    DecodeError,
    EpisodeAbort,
    EpisodeStart,
    RewardDelta,
    StepBatch,
    decode,
    encode,
    encode_record,
    schema_header,
)
from rlrec.producer.spaces import dumps_space
from rlrec.store.episode_arrays import decode_episode
from rlrec.store.episodes import (
    EpisodeDecodeError,
    UnsafeEpisodeError,
    pack_episode,
    to_single_agent_episode,
    unpack_episode,
)
from rlrec.store.storage import Storage
from tests.helpers import ACT_SPACE, OBS_SPACE, assert_episode_matches, record_episodes, wait_for
from tests.test_consumer_e2e import committed_episodes, drain_dlq, read_all, run_consumer

KINDS = ("EpisodeStart", "StepBatch", "RewardDelta", "EpisodeAbort")
EVENTS = (EpisodeStart, StepBatch, RewardDelta, EpisodeAbort)


# ---------------------------------------------------------------------------------------------
# payloads that run code when unpickled


class _Boom:
    """Unpickling this creates `path` (the side effect that would prove execution)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def pickle_payloads(marker: str) -> dict[str, bytes]:
    """Payloads that execute `touch marker` when a careless reader decodes them."""
    obj_array = np.array([_Boom(marker)], dtype=object)
    return {
        "pickle": pickle.dumps(_Boom(marker)),
        # msgpack-numpy pickles object arrays (kind b'O'); `msgpack_numpy.decode` unpickles them
        "msgpack-numpy": msgpack.packb(obj_array, default=mnp.encode),
        "msgpack-numpy-in-state": msgpack.packb({"id_": "x", "observations": {"data": obj_array}}, default=mnp.encode),
    }


def test_pickle_payloads_are_live(tmp_path):
    """Control: the payloads really execute when decoded the unsafe way, so the marker checks below mean something."""
    for name, payload in pickle_payloads(str(tmp_path / "m")).items():
        marker = tmp_path / "m"
        if name == "pickle":
            pickle.loads(payload)
        else:
            msgpack.unpackb(payload, object_hook=mnp.decode)
        assert marker.exists(), name
        marker.unlink()


# ---------------------------------------------------------------------------------------------
# raw records (any field value, encoded as Avro without the producer's checks)


def _arr(a) -> dict:
    return array_to_wire(np.asarray(a))


def start_rec(eid: str, **over) -> dict:
    rec = {
        "episode_id": eid,
        "policy_id": "pol",
        "policy_version": 1,
        "env_id": "",
        "observation": [_arr(np.zeros(4, np.float32))],
        "info": "",
        "observation_space": dumps_space(OBS_SPACE),
        "action_space": dumps_space(ACT_SPACE),
        "timestamp_ms": 1,
    }
    rec.update(over)
    return rec


def steps_rec(eid: str, t0: int, n: int, *, terminated: bool = False, extra: bool = True, **over) -> dict:
    rec = {
        "episode_id": eid,
        "t0": t0,
        "actions": [_arr(np.arange(n, dtype=np.int64) % 2)],
        "rewards": _arr(np.ones(n)),
        "observations": [_arr(np.full((n, 4), t0, np.float32))],
        "terminated": terminated,
        "truncated": False,
        "infos": None,
        "extra_model_outputs": {"action_logp": _arr(np.full(n, -0.5, np.float32))} if extra else {},
        "timestamp_ms": 1,
    }
    rec.update(over)
    return rec


def raw(kind: str, rec: dict) -> tuple[bytes, list]:
    return encode_record(kind, rec), schema_header(kind)


def _flip(value: bytes, pos: int, bit: int = 0) -> bytes:
    b = bytearray(value)
    b[pos] ^= 1 << bit
    return bytes(b)


def _reason(value, headers, max_bytes=None) -> str | None:
    try:
        decode(value, headers, max_bytes=max_bytes)
    except DecodeError as e:
        return e.reason
    return None


def _bit_flips_by_reason(value: bytes, headers) -> dict[str, bytes]:
    """For each decode reason some single-bit flip of `value` yields, the first such flip."""
    found: dict[str, bytes] = {}
    for pos in range(len(value)):
        for bit in range(8):
            flipped = _flip(value, pos, bit)
            r = _reason(flipped, headers)
            if r is not None and r not in found:
                found[r] = flipped
    return found


# ---------------------------------------------------------------------------------------------
# the end-to-end suite


class HostileTopic:
    """Publishes raw messages and remembers, per (partition, offset), the dead-letter reason each must get."""

    def __init__(self, bootstrap: str, topic: str):
        self.topic = topic
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all"})
        self.expected: dict[tuple[int, int], str] = {}
        self.offsets: dict[str, tuple[int, int]] = {}  # name -> (partition, offset)
        self.names: dict[tuple[int, int], str] = {}

    def send(self, name: str, key: bytes, value: bytes | None, headers, reason: str | None) -> None:
        """Publish one message; `reason` is the dead letter it must produce (None: a valid event)."""

        def delivered(err, msg):
            assert err is None, err
            where = (msg.partition(), msg.offset())
            self.offsets[name] = where
            self.names[where] = name
            if reason is not None:
                self.expected[where] = reason

        self.producer.produce(self.topic, value, key, headers=headers, on_delivery=delivered)

    def flush(self) -> None:
        assert self.producer.flush(30) == 0


def _hostile_messages(marker: str) -> list[tuple[str, bytes, bytes | None, list | None, str | None]]:
    """(name, key, value, headers, expected reason) in publish order. Episodes: h-open (open all along,
    finished in phase 2), h-fin (finished early), h-empty (aborted before a step)."""
    step_h = schema_header("StepBatch")
    v_steps, _ = raw("StepBatch", steps_rec("h-open", 2, 2))
    v_start, h_start = raw("EpisodeStart", start_rec("h-open"))
    rng = np.random.default_rng(6)
    rand = rng.bytes(64)
    obj = {"dtype": "object", "shape": [2, 4], "data": pickle.dumps(_Boom(marker))[:32].ljust(32, b"\0")}
    msgs = [
        ("h-open start", b"h-open", v_start, h_start, None),
        ("h-open steps 0-1", b"h-open", *raw("StepBatch", steps_rec("h-open", 0, 2)), None),
        ("h-fin start", b"h-fin", *raw("EpisodeStart", start_rec("h-fin")), None),
        ("h-fin steps 0", b"h-fin", *raw("StepBatch", steps_rec("h-fin", 0, 1, terminated=True)), None),
        ("h-empty start", b"h-empty", *raw("EpisodeStart", start_rec("h-empty")), None),
        (
            "h-empty abort",
            b"h-empty",
            *raw("EpisodeAbort", {"episode_id": "h-empty", "reason": "", "timestamp_ms": 1}),
            None,
        ),
        # random bytes, garbage headers
        ("random, no header", b"r1", rng.bytes(64), None, "bad-header"),
        ("random, step header", b"r2", rand, step_h, _reason(rand, step_h)),
        ("garbage header", b"r3", v_steps, [(SCHEMA_HEADER, b"\xff\xfe")], "bad-header"),
        ("empty value", b"r4", b"", step_h, "malformed"),
        ("tombstone", b"r5", None, step_h, "malformed"),
        # truncated / bit-flipped valid events
        ("truncated steps", b"h-open", v_steps[: len(v_steps) // 2], step_h, "malformed"),
        ("truncated start", b"h-open", v_start[:-1], h_start, "malformed"),
        ("trailing bytes", b"h-open", v_steps + b"\0", step_h, "malformed"),
        ("flip: dtype name", b"h-open", _flip(v_steps, v_steps.index(b"float32")), step_h, "bad-dtype"),
        ("flip: episode id", b"h-open", _flip(v_steps, v_steps.index(b"h-open") + 5), step_h, "unknown-episode"),
        # unknown schemas
        ("schema v99", b"h-open", v_steps, [(SCHEMA_HEADER, b"StepBatch/99")], "unknown-schema"),
        ("schema v0", b"h-open", v_steps, [(SCHEMA_HEADER, b"StepBatch/0")], "unknown-schema"),
        ("unknown kind", b"h-open", v_steps, [(SCHEMA_HEADER, b"Episode/1")], "unknown-schema"),
        # arrays contradicting the declared space
        (
            "obs float64",
            b"h-open",
            *raw("StepBatch", steps_rec("h-open", 2, 2, observations=[_arr(np.zeros((2, 4)))])),
            "space-mismatch",
        ),
        (
            "obs shape (2,7)",
            b"h-open",
            *raw("StepBatch", steps_rec("h-open", 2, 2, observations=[_arr(np.zeros((2, 7), np.float32))])),
            "space-mismatch",
        ),
        (
            "action float32",
            b"h-open",
            *raw("StepBatch", steps_rec("h-open", 2, 2, actions=[_arr(np.zeros(2, np.float32))])),
            "space-mismatch",
        ),
        (
            "two obs leaves",
            b"h-open",
            *raw("StepBatch", steps_rec("h-open", 2, 2, observations=[_arr(np.zeros((2, 4), np.float32))] * 2)),
            "space-mismatch",
        ),
        (
            "start obs (3,)",
            b"h-x1",
            *raw("EpisodeStart", start_rec("h-x1", observation=[_arr(np.zeros(3, np.float32))])),
            "space-mismatch",
        ),
        (
            "bytes != shape",
            b"h-open",
            *raw(
                "StepBatch",
                steps_rec("h-open", 2, 2, observations=[{"dtype": "float32", "shape": [2, 5], "data": b"\0" * 32}]),
            ),
            "bad-shape",
        ),
        (
            "huge claimed shape",
            b"h-open",
            *raw(
                "StepBatch",
                steps_rec("h-open", 2, 2, observations=[{"dtype": "float32", "shape": [2, 2**40], "data": b"\0" * 32}]),
            ),
            "bad-shape",
        ),
        (
            "empty rewards",
            b"h-open",
            *raw("StepBatch", steps_rec("h-open", 2, 2, rewards=_arr(np.zeros(0)))),
            "bad-shape",
        ),
        # disallowed dtypes
        ("object obs", b"h-open", *raw("StepBatch", steps_rec("h-open", 2, 2, observations=[obj])), "bad-dtype"),
        (
            "void obs",
            b"h-open",
            *raw(
                "StepBatch",
                steps_rec("h-open", 2, 2, observations=[{"dtype": "V16", "shape": [2], "data": b"\0" * 32}]),
            ),
            "bad-dtype",
        ),
        (
            "object extra",
            b"h-open",
            *raw("StepBatch", steps_rec("h-open", 2, 2, extra_model_outputs={"action_logp": obj})),
            "bad-dtype",
        ),
        (
            "object array in info",
            b"h-open",
            *raw(
                "StepBatch",
                steps_rec(
                    "h-open",
                    2,
                    2,
                    infos=[
                        "",
                        json.dumps({"x": {"$ndarray": {"dtype": "object", "shape": [1], "data": "AAAAAAAAAAA="}}}),
                    ],
                ),
            ),
            "bad-dtype",
        ),
        # other decode reasons
        ("info not JSON", b"h-open", *raw("StepBatch", steps_rec("h-open", 2, 2, infos=["{", ""])), "bad-json"),
        ("space not JSON", b"h-x2", *raw("EpisodeStart", start_rec("h-x2", observation_space="{")), "bad-space"),
        ("negative t0", b"h-open", *raw("StepBatch", steps_rec("h-open", -1, 2)), "bad-value"),
        ("empty episode id", b"h-open", *raw("StepBatch", steps_rec("", 2, 2)), "bad-value"),
        ("oversize", b"h-open", b"\0" * 250_000, step_h, "oversize"),
        # non-finite rewards
        (
            "NaN reward",
            b"h-open",
            *raw("StepBatch", steps_rec("h-open", 2, 2, rewards=_arr([np.nan, 1.0]))),
            "non-finite-reward",
        ),
        (
            "inf reward",
            b"h-open",
            *raw("StepBatch", steps_rec("h-open", 2, 2, rewards=_arr([1.0, np.inf]))),
            "non-finite-reward",
        ),
        (
            "-inf reward",
            b"h-open",
            *raw("StepBatch", steps_rec("h-open", 2, 2, rewards=_arr([-np.inf, 1.0]))),
            "non-finite-reward",
        ),
        (
            "NaN delayed reward",
            b"h-open",
            *raw("RewardDelta", {"episode_id": "h-open", "t": 0, "reward": math.nan, "timestamp_ms": 1}),
            "non-finite-reward",
        ),
        (
            "inf delayed reward",
            b"h-open",
            *raw("RewardDelta", {"episode_id": "h-open", "t": 0, "reward": math.inf, "timestamp_ms": 1}),
            "non-finite-reward",
        ),
        # events for unknown episodes
        ("steps, unknown episode", b"nobody", *raw("StepBatch", steps_rec("nobody", 0, 1)), "unknown-episode"),
        (
            "reward, unknown episode",
            b"nobody",
            *raw("RewardDelta", {"episode_id": "nobody", "t": 0, "reward": 1.0, "timestamp_ms": 1}),
            "unknown-episode",
        ),
        (
            "abort, unknown episode",
            b"nobody",
            *raw("EpisodeAbort", {"episode_id": "nobody", "reason": "", "timestamp_ms": 1}),
            "unknown-episode",
        ),
        # assembly rules
        ("different start", b"h-open", *raw("EpisodeStart", start_rec("h-open", policy_version=7)), "duplicate-start"),
        ("gap", b"h-open", *raw("StepBatch", steps_rec("h-open", 5, 1)), "gap"),
        ("overlap, different", b"h-open", *raw("StepBatch", steps_rec("h-open", 1, 2)), "backwards-t"),
        ("extra keys differ", b"h-open", *raw("StepBatch", steps_rec("h-open", 2, 1, extra=False)), "extra-mismatch"),
        (
            "reward past the end",
            b"h-open",
            *raw("RewardDelta", {"episode_id": "h-open", "t": 50, "reward": 1.0, "timestamp_ms": 1}),
            "bad-reward-t",
        ),
        ("step after the end", b"h-fin", *raw("StepBatch", steps_rec("h-fin", 1, 1)), "step-after-end"),
    ]
    # payloads crafted to unpickle, with and without a plausible header
    for name, payload in pickle_payloads(marker).items():
        msgs.append((f"{name}, step header", b"h-open", payload, step_h, _reason(payload, step_h)))
        msgs.append((f"{name}, start header", b"h-open", payload, h_start, _reason(payload, h_start)))
        msgs.append((f"{name}, no header", b"h-open", payload, None, "bad-header"))
    # bit flips found by search: one per reason a single flip of a valid batch produces
    for reason, flipped in sorted(_bit_flips_by_reason(v_steps, step_h).items()):
        msgs.append((f"bit flip -> {reason}", b"h-open", flipped, step_h, reason))
    assert all(m[4] is not None for m in msgs[6:]), "a hostile message decodes"
    return msgs


@pytest.mark.broker
def test_hostile_topic_dead_letters_everything_and_good_episodes_land(broker, topic, tmp_path, recorder_config):
    marker = f"/tmp/rlrec-pwned-{uuid.uuid4().hex}"
    output = str(tmp_path / "out")
    # the join window keeps finished episodes unwritten for 2 s, so "step after the end" meets a
    # finished (not yet committed) episode whatever the timing
    cfg = recorder_config(output, max_message_bytes=200_000, dlq_max_message_bytes=100_000, reward_join_window_s=2.0)
    storage = Storage.from_uri(output)
    rec = EpisodeRecorder(
        broker.bootstrap_servers, topic=topic, policy_id="pol", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )
    hostile = HostileTopic(broker.bootstrap_servers, topic)
    msgs = _hostile_messages(marker)
    half = len(msgs) // 2
    truth = record_episodes(rec, 8, seed=31, delayed_every=3)  # good episodes before, between and after
    rec.flush(10)
    for m in msgs[:half]:
        hostile.send(*m)
    hostile.flush()
    truth.update(record_episodes(rec, 8, seed=32, abort_every=4))
    rec.flush(10)
    for m in msgs[half:]:
        hostile.send(*m)
    hostile.flush()
    truth.update(record_episodes(rec, 8, seed=33))
    rec.flush(10)

    c, t = run_consumer(cfg, storage)
    try:
        wait_for(lambda: committed_episodes(storage) >= len(truth) + 1, 60, what="good episodes and h-fin committed")
        # phase 2: a delayed reward for a committed episode is late; h-open, hit by all of the
        # above, still finishes and lands
        late = next(iter(truth))
        hostile.send(
            "late reward",
            late.encode(),
            *raw("RewardDelta", {"episode_id": late, "t": 0, "reward": 1.0, "timestamp_ms": 1}),
            "late-reward",
        )
        hostile.send("h-open steps 2-3", b"h-open", *raw("StepBatch", steps_rec("h-open", 2, 2, terminated=True)), None)
        hostile.flush()
        truth.update(record_episodes(rec, 4, seed=34))
        rec.flush(10)
        wait_for(lambda: committed_episodes(storage) >= len(truth) + 2, 60, what="h-open and the last episodes")
        n_expected = len(hostile.expected) + 1  # + h-empty's start, dead-lettered as empty-episode
        wait_for(
            lambda: (
                sum(s.value for m in c.metrics.dead_letters.collect() for s in m.samples if s.name.endswith("_total"))
                >= n_expected
            ),
            30,
            what="all dead letters",
        )
        assert t.is_alive() and not c._stop.is_set(), "the consumer exited"
    finally:
        c.stop()
        t.join(30)
        rec.close()
    assert not t.is_alive()

    dlq = drain_dlq(broker.bootstrap_servers, topic, 3)
    expected = dict(hostile.expected)
    expected[hostile.offsets["h-empty start"]] = "empty-episode"
    got: dict[tuple[int, int], str] = {}
    for m in dlq:
        h = dict(m.headers())
        assert h["rlrec-source-topic"].decode() == topic
        where = (int(h["rlrec-source-partition"]), int(h["rlrec-source-offset"]))
        assert where not in got, f"two dead letters for {hostile.names.get(where)}"
        got[where] = h["rlrec-dlq-reason"].decode()
        if got[where] == "oversize":
            assert int(h["rlrec-original-length"]) == 250_000 and len(m.value()) == 100_000
            assert len(h["rlrec-original-sha256"]) == 64
    wrong = {hostile.names.get(w, w): (got.get(w), r) for w, r in expected.items() if got.get(w) != r}
    assert not wrong, f"(got, expected) dead-letter reasons: {wrong}"
    assert set(got) == set(expected), (
        f"unexpected dead letters: {[hostile.names.get(w, w) for w in set(got) - set(expected)]}"
    )
    # every reason is exercised, except those with suites of their own: timeouts and capacity,
    # and the poison pills of tests/test_poison_pills.py (which runs these messages too)
    elsewhere = {"timeout", "capacity", "unwritable", "internal", "episode-too-large", "bad-policy-id", "bad-env-id"}
    elsewhere.add("partition-change")
    elsewhere |= {"bad-info", "key-too-large", "extra-output-mismatch", "out-of-space", "non-finite-value"}
    elsewhere |= {"unknown-agent", "out-of-order"}  # multi-agent folding: tests/test_multi_agent_fold.py
    elsewhere |= {"kind-mismatch", "id-collision"}  # tests/test_multi_agent_replay_rules.py
    assert set(expected.values()) == (set(DECODE_REASONS) | set(CONSUMER_REASONS)) - elsewhere

    assert not os.path.exists(marker), "a pickle payload was executed"
    got_eps = read_all(storage)  # asserts that no episode is in two shards
    assert set(got_eps) == set(truth) | {"h-open", "h-fin"}
    for eid, ep in truth.items():  # the late reward was dead-lettered, not applied
        assert_episode_matches(got_eps[eid][0], ep)
    h_open = got_eps["h-open"][0]
    assert len(h_open) == 4 and np.asarray(h_open.get_rewards()).tolist() == [1.0] * 4


# ---------------------------------------------------------------------------------------------
# property-based fuzzing (no broker)

FUZZ = settings(
    max_examples=500,
    derandomize=True,
    database=None,
    deadline=timedelta(seconds=10),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_bad_dtypes = ["object", "O", "|O", "V8", "void", "<U4", "S3", "complex64", "float128", "datetime64[s]", "", ">f4"]
_dtypes = st.sampled_from(sorted(ALLOWED_DTYPES)) | st.sampled_from(_bad_dtypes) | st.text(max_size=8)
_longs = st.integers(0, 9) | st.integers(-(2**63), 2**63 - 1)  # plausible values first
_dims = st.integers(-2, 6) | _longs
wire_arrays = st.fixed_dictionaries(
    {"dtype": _dtypes, "shape": st.lists(_dims, max_size=5), "data": st.binary(max_size=64)}
)
# well-formed arrays too, so the checks after the array layer are reached
good_arrays = st.builds(
    lambda n, w, dt: _arr(np.zeros((n, w), dtype=dt)),
    st.integers(0, 3),
    st.integers(1, 4),
    st.sampled_from(["float32", "float64", "int64", "uint8", "bool"]),
)
arrays = wire_arrays | good_arrays
json_values = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)
_ndarray_specs = st.fixed_dictionaries(
    {"dtype": _dtypes, "shape": json_values | st.lists(_dims, max_size=3), "data": st.text(max_size=16) | json_values}
)
json_texts = (
    st.just("")
    | st.text(max_size=40)
    | json_values.map(json.dumps)
    | st.dictionaries(
        st.text(max_size=5), st.builds(lambda s: {"$ndarray": s}, _ndarray_specs) | json_values, max_size=3
    ).map(json.dumps)
)
_valid_spaces = [dumps_space(s) for s in (OBS_SPACE, ACT_SPACE)]
space_texts = (
    st.sampled_from(_valid_spaces)
    | json_texts
    | json_values.map(lambda v: json.dumps({"type": "Box", "shape": v, "dtype": "float32", "low": v, "high": v}))
    | st.builds(
        lambda kind, d: json.dumps({"type": kind, **d}),
        st.sampled_from(["Box", "Discrete", "MultiDiscrete", "MultiBinary", "Dict", "Tuple", "Graph"]),
        st.dictionaries(
            st.sampled_from(["shape", "dtype", "low", "high", "n", "start", "nvec", "spaces"]), json_values
        ),
    )
)
ids = st.sampled_from(["e", "ep-1"]) | st.text(max_size=300)

records = st.one_of(
    st.tuples(
        st.just("EpisodeStart"),
        st.fixed_dictionaries(
            {
                "episode_id": ids,
                "policy_id": ids,
                "policy_version": _longs,
                "env_id": st.text(max_size=10),
                "observation": st.just([_arr(np.zeros(4, np.float32))]) | st.lists(arrays, max_size=3),
                "info": json_texts,
                "observation_space": space_texts,
                "action_space": space_texts,
                "timestamp_ms": _longs,
            }
        ),
    ),
    st.tuples(
        st.just("StepBatch"),
        st.fixed_dictionaries(
            {
                "episode_id": ids,
                "t0": _longs,
                "actions": st.lists(arrays, max_size=3),
                "rewards": arrays
                | st.lists(st.floats(), min_size=1, max_size=4).map(lambda r: _arr(np.asarray(r, np.float64))),
                "observations": st.lists(arrays, max_size=3),
                "terminated": st.booleans(),
                "truncated": st.booleans(),
                "infos": st.none() | st.lists(json_texts, max_size=4),
                "extra_model_outputs": st.dictionaries(st.text(max_size=5), arrays, max_size=2),
                "timestamp_ms": _longs,
            }
        ),
    ),
    st.tuples(
        st.just("RewardDelta"),
        st.fixed_dictionaries({"episode_id": ids, "t": _longs, "reward": st.floats(), "timestamp_ms": _longs}),
    ),
    st.tuples(
        st.just("EpisodeAbort"),
        st.fixed_dictionaries({"episode_id": ids, "reason": st.text(max_size=20), "timestamp_ms": _longs}),
    ),
)


def _decodes_or_decode_error(value, headers, max_bytes=None):
    try:
        ev = decode(value, headers, max_bytes=max_bytes)
    except DecodeError as e:
        assert e.reason in DECODE_REASONS
        return None
    assert isinstance(ev, EVENTS)
    return ev


@settings(FUZZ, max_examples=1500)
@given(kind_rec=records, header_kind=st.sampled_from(KINDS) | st.none())
def test_fuzz_decode_structured_records(kind_rec, header_kind):
    """Any Avro-valid record (any field values), read as its own kind or as another: an event or a DecodeError."""
    kind, rec = kind_rec
    value = encode_record(kind, rec)
    ev = _decodes_or_decode_error(value, schema_header(header_kind or kind))
    if ev is not None and header_kind in (None, kind) and kind == "StepBatch":
        assert np.isfinite(ev.rewards).all() and ev.n >= 1
        assert all(a.dtype.name in ALLOWED_DTYPES for a in [*ev.actions, *ev.observations])


def _seed_messages() -> list[tuple[bytes, list]]:
    from gymnasium import spaces as gs

    nested = gs.Dict({"a": gs.Box(-1, 1, (2, 3), np.float32), "b": gs.Tuple([gs.Discrete(3), gs.MultiBinary(2)])})
    nested.seed(0)
    from rlrec.producer.spaces import flatten_value

    leaves = [np.asarray(x) for x in flatten_value(nested, nested.sample())]
    return [
        encode(EpisodeStart("e", "p", 1, leaves, nested, gs.MultiDiscrete([2, 3]), "env", {"a": np.arange(3)}, 1)),
        encode(
            StepBatch(
                "e",
                3,
                [np.array([1, 0])],
                np.array([0.5, 1.0]),
                [np.ones((2, 4), np.float32)],
                infos=[{"x": [1]}, {}],
                extra_model_outputs={"logp": np.zeros(2, np.float32)},
            )
        ),
        encode(RewardDelta("e", 2, 0.25, 7)),
        encode(EpisodeAbort("e", "why", 7)),
    ]


SEEDS = _seed_messages()
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
        st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 16)),
        st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("duplicate"), st.integers(0, 10**6), st.integers(1, 32)),
        st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    ),
    min_size=1,
    max_size=6,
)


def _mutate(value: bytes, ops) -> bytes:
    b = bytearray(value)
    for op in ops:
        pos = op[1] % (len(b) + 1)
        if op[0] == "flip" and b:
            b[pos % len(b)] ^= 1 << op[2]
        elif op[0] == "delete":
            del b[pos : pos + op[2]]
        elif op[0] == "insert":
            b[pos:pos] = op[2]
        elif op[0] == "duplicate":
            b[pos:pos] = b[pos : pos + op[2]]
        elif op[0] == "truncate":
            del b[pos:]
    return bytes(b)


@settings(FUZZ, max_examples=1000)
@given(
    seed=st.sampled_from(range(len(SEEDS))),
    ops=_ops,
    other_header=st.none() | st.sampled_from(KINDS),
    max_bytes=st.none() | st.integers(0, 400),
)
def test_fuzz_decode_mutated_events(seed, ops, other_header, max_bytes):
    """Byte mutations of valid events (flips, deletions, insertions, duplications, truncation)."""
    value, headers = SEEDS[seed]
    _decodes_or_decode_error(_mutate(value, ops), schema_header(other_header) if other_header else headers, max_bytes)


@FUZZ
@given(
    value=st.binary(max_size=300),
    header=st.binary(max_size=24) | st.sampled_from([f"{k}/{v}".encode() for k in KINDS for v in (0, 1, 2)]),
)
def test_fuzz_decode_arbitrary_bytes(value, header):
    _decodes_or_decode_error(value, [(SCHEMA_HEADER, header)])


# -- the trainer's safe episode decoding -------------------------------------------------------


def _packed_seeds() -> list[bytes]:
    from tests.test_episodes import cartpole_case, dict_case

    return [
        pack_episode(to_single_agent_episode(case()[0]))
        for case in (lambda: cartpole_case(True), lambda: dict_case(False, T=3))
    ]


PACKED = _packed_seeds()


@FUZZ
@given(seed=st.sampled_from(range(len(PACKED))), ops=_ops)
def test_fuzz_unpack_episode_mutated(seed, ops):
    """Mutated shard items: an episode or an EpisodeDecodeError, never another exception, from
    both safe decoders; what `unpack_episode` refuses, the steps readers' decoder refuses too,
    for what this mutator makes (the arrays decoder also reads a few items `unpack_episode`
    cannot rebuild: list-form structs, an infos map; docs/READING.md "How steps are read")."""
    data = _mutate(PACKED[seed], ops)
    from rlrec.store.episodes import _safe_ndarray_hook, unpack_state

    outcomes = []
    for unpack in (lambda: msgpack.unpackb(data, object_hook=_safe_ndarray_hook), lambda: unpack_state(data)):
        try:
            unpack()
            outcomes.append(None)
        except Exception as e:  # the same kind of refusal from both
            outcomes.append(type(e) if isinstance(e, EpisodeDecodeError) else Exception)
    assert outcomes[0] == outcomes[1], outcomes
    try:
        unpack_episode(data)
        refused = False
    except EpisodeDecodeError:
        refused = True
    try:
        decode_episode(data)
    except EpisodeDecodeError:
        pass
    else:
        assert not refused, "the arrays decoder accepted an item unpack_episode refuses"


def _nd_paths(obj, path=()):
    """Paths to every msgpack-numpy array map (and every map/list slot) in an unpacked state."""
    if isinstance(obj, dict):
        if b"nd" in obj:
            yield path
            return
        yield path
        for k, v in obj.items():
            yield from _nd_paths(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _nd_paths(v, (*path, i))


def _replace(obj, path, value):
    if not path:
        return value
    obj[path[0]] = value if len(path) == 1 else _replace(obj[path[0]], path[1:], value)
    return obj


@settings(FUZZ, max_examples=150)
@given(
    seed=st.sampled_from(range(len(PACKED))),
    where=st.integers(0, 10**6),
    form=st.sampled_from(["object", "object-scalar", "structured"]),
)
def test_fuzz_unpack_episode_refuses_object_arrays_anywhere(seed, where, form, tmp_path_factory):
    """An object array planted anywhere in a packed episode is refused and never unpickled."""
    marker = tmp_path_factory.mktemp("m") / "pwned"
    state = msgpack.unpackb(PACKED[seed], strict_map_key=False)
    paths = list(_nd_paths(state))
    path = paths[where % len(paths)]
    payload = pickle.dumps(_Boom(str(marker)))
    evil = {
        "object": {b"nd": True, b"type": "|O", b"kind": b"O", b"shape": [1], b"data": payload},
        "object-scalar": {b"nd": False, b"type": "|O", b"kind": b"O", b"data": payload},
        "structured": {b"nd": True, b"type": [["a", "|O"]], b"kind": b"V", b"shape": [1], b"data": payload},
    }[form]
    if path and isinstance(_get(state, path), dict) and b"nd" not in _get(state, path):
        evil_state = _replace(state, (*path, "evil"), evil)  # a new key in a map
    else:
        evil_state = _replace(state, path, evil)
    data = msgpack.packb(evil_state)
    for decoder in (unpack_episode, decode_episode):
        with pytest.raises(UnsafeEpisodeError):
            decoder(data)
    assert not marker.exists()


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def test_trainer_column_stream_refuses_object_arrays(tmp_path):
    """The Learner-side column decoder of the trainer (`rlrec.trainer.envelopes.unpack_columns`) refuses object dtypes."""
    from rlrec.trainer.envelopes import pack_columns, unpack_columns

    marker = tmp_path / "pwned"
    ok = pack_columns({"obs": np.ones((2, 3), np.float32)})
    assert unpack_columns(ok)["obs"].shape == (2, 3)
    payload = pickle.dumps(np.array([_Boom(str(marker))], dtype=object))
    for dt in ("|O", [["a", "|O"]]):
        with pytest.raises(TypeError):
            unpack_columns(msgpack.packb({"obs": [dt, [1], payload]}, use_bin_type=True))
    with pytest.raises(TypeError):
        pack_columns({"obs": np.array([object()], dtype=object)})
    assert not marker.exists()


# -- the consumer's message handler ------------------------------------------------------------


class _Msg:
    """What confluent-kafka's Message offers the handler (the handler is tested here without a broker)."""

    def __init__(self, offset: int, key: bytes | None, value: bytes | None, headers):
        self._offset, self._key, self._value, self._headers = offset, key, value, headers

    def error(self):
        return None

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def key(self):
        return self._key

    def value(self):
        return self._value

    def headers(self):
        return self._headers


class _AckingProducer:
    """Acknowledges every dead letter on the next poll (the DLQ's broker side, for a unit test)."""

    def __init__(self):
        self.records, self._callbacks = [], []

    def produce(self, topic, value, key, headers, on_delivery):
        self.records.append((key, value, headers))
        self._callbacks.append(on_delivery)

    def poll(self, timeout=0):
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(None, None)
        return len(callbacks)

    def flush(self, timeout=0):
        self.poll()
        return 0


def _good_episode(eid: str, n_batches: int) -> list[tuple[bytes, bytes, list]]:
    out = [(eid.encode(), *raw("EpisodeStart", start_rec(eid)))]
    for i in range(n_batches):
        last = i == n_batches - 1
        out.append((eid.encode(), *raw("StepBatch", steps_rec(eid, 2 * i, 2, terminated=last))))
    out.append((eid.encode(), *raw("RewardDelta", {"episode_id": eid, "t": 0, "reward": 0.5, "timestamp_ms": 1})))
    return out


_stream_ops = st.lists(
    st.tuples(st.integers(0, 10**6), _ops, st.sampled_from(["mutate", "reheader", "rekey", "drop", "dup"])),
    max_size=6,
)


@settings(FUZZ, max_examples=60)
@given(ops=_stream_ops, seed_kind=st.sampled_from(range(len(SEEDS))), fmt=st.sampled_from(["episodes", "tabular"]))
def test_fuzz_message_handler_never_raises(ops, seed_kind, fmt, tmp_path_factory):
    """Random mutations of valid event streams through `RecorderConsumer._on_message` and a flush:
    nothing raises out of the handler; every message is applied or dead-lettered; a good episode
    sent after the mutated ones still lands."""
    from rlrec.consumer.dead_letters import DeadLetterQueue
    from rlrec.consumer.service import ConsumerConfig, RecorderConsumer
    from rlrec.consumer.writer import PartitionWriter

    out = str(tmp_path_factory.mktemp("handler"))
    c = RecorderConsumer(ConsumerConfig(bootstrap_servers="unused:1", output=out, topic="t", format=fmt))
    producer = _AckingProducer()
    c.dlq = DeadLetterQueue(producer, "t.dlq")
    w = c.writers[0] = PartitionWriter(c.storage, "t", 0, fmt=fmt, assembly=c.assembly)
    w.claim()
    stream = [*_good_episode("a", 2), (b"x", *SEEDS[seed_kind]), *_good_episode("b", 1)]
    for pos, byte_ops, how in ops:
        i = pos % len(stream)
        key, value, headers = stream[i]
        if how == "mutate":
            stream[i] = (key, _mutate(value, byte_ops), headers)
        elif how == "reheader":
            stream[i] = (key, value, schema_header(KINDS[pos % 4]))
        elif how == "rekey":
            stream[i] = (_mutate(key, byte_ops), value, headers)
        elif how == "drop":
            del stream[i]
        else:
            stream.insert(i, stream[i])
        if not stream:
            stream = [(b"x", b"", [])]
    stream += _good_episode("good", 2)
    for offset, (key, value, headers) in enumerate(stream):
        assert c._on_message(_Msg(offset, key, value, headers)) is True
    c._flush_partition(0, force=True, now=time.time() + 3600)
    c.dlq.poll()
    assert not c.dlq.pending
    a = w.assembler
    assert a.committed.committed_offset("good") is not None  # the good episode after the mess landed
    assert a.safe_offset() is not None


@pytest.mark.parametrize("where", ["observations", "infos", "extra_model_outputs"])
def test_buffer_data_nested_deep_is_refused_by_both_decoders(where):
    """A map nested 505 deep (within msgpack.packb's own limit) as one buffer's data: one
    undecodable episode for both decoders, never a RecursionError (the mutator above does not
    build deep maps)."""
    from tests.test_steps_decoder import _deep_items

    item = _deep_items()[where]
    for decoder in (unpack_episode, decode_episode):
        with pytest.raises(EpisodeDecodeError):
            decoder(item)


def test_a_small_start_of_multibinary_spaces_cannot_make_a_reader_allocate_much():
    """A MultiBinary's JSON names only its shape (up to 2^24 elements) and a reader's leaves held
    0/1 bound arrays of that shape (16 bytes an element): a 257-byte EpisodeStart of a Dict of two
    such spaces cost a consumer 512 MiB. The bounds broadcast now; the 0/1 range still holds."""
    import tracemalloc

    from rlrec.producer import events as events_module
    from rlrec.producer.events import check_values, parse_space

    mb = {"type": "MultiBinary", "shape": [4096, 4096], "dtype": "int8"}
    value = encode_record(
        "EpisodeStart",
        start_rec("e1", observation_space=json.dumps({"type": "Dict", "spaces": [["a", mb], ["b", mb]]})),
    )
    cache, events_module._SPACES = events_module._SPACES, events_module._SpaceCache()  # a fresh consumer
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError) as e:
            decode(value, schema_header("EpisodeStart"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        events_module._SPACES = cache
    assert e.value.reason == "space-mismatch" and peak < 2**22, (e.value.reason, peak)  # the obs does not fit
    leaves = parse_space(json.dumps({"type": "MultiBinary", "shape": [2, 3], "dtype": "int8"}))[1]
    check_values([np.ones((2, 3), np.int8)], leaves, "obs")
    with pytest.raises(DecodeError, match="out-of-space"):
        check_values([np.full((2, 3), 2, np.int8)], leaves, "obs")
