"""Optional Confluent schema-registry framing, against a minimal registry speaking its REST API."""

from __future__ import annotations

import http.server
import json
import threading
import time
import uuid

import numpy as np
import pytest
from confluent_kafka import Consumer

from rlrec.producer import EpisodeRecorder
from rlrec.producer.events import DecodeError, StepBatch, decode, encode
from rlrec.producer.registry import RegistryUnavailable, SchemaRegistry, frame, unframe
from tests.helpers import ACT_SPACE, OBS_SPACE, record_episodes


class _Registry:
    """The two endpoints rlrec uses: POST /subjects/{s}/versions, GET /schemas/ids/{id}."""

    def __init__(self):
        self.schemas: dict[int, str] = {}
        self.foreign: dict[int, dict] = {}  # ids of schemas that are not rlrec's (e.g. PROTOBUF)
        self.fail_gets_until = 0.0  # GET answers 503 until then (time.monotonic())
        self.gets = 0
        reg = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                text = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["schema"]
                for i, s in reg.schemas.items():
                    if s == text:
                        return self._send(200, {"id": i})
                i = len(reg.schemas) + 1
                reg.schemas[i] = text
                self._send(200, {"id": i})

            def do_GET(self):
                reg.gets += 1
                if time.monotonic() < reg.fail_gets_until:
                    return self._send(503, {"error_code": 50302, "message": "overloaded"})
                i = int(self.path.rsplit("/", 1)[-1])
                if i in reg.foreign:
                    return self._send(200, reg.foreign[i])
                if i not in reg.schemas:
                    return self._send(404, {"error_code": 40403, "message": "Schema not found"})
                self._send(200, {"schema": reg.schemas[i]})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def registry():
    r = _Registry()
    yield r
    r.close()


def test_frame_round_trip_and_bad_frames():
    assert unframe(frame(7, b"body")) == (7, b"body")
    for bad in (b"", b"\x00\x00", b"\x01\x00\x00\x00\x07body"):
        with pytest.raises(DecodeError) as e:
            unframe(bad)
        assert e.value.reason == "bad-header"


def test_framed_values_decode_through_the_registry(registry):
    reg = SchemaRegistry(registry.url)
    ev = StepBatch("e", 0, [np.zeros(2, np.int64)], np.ones(2), [np.zeros((2, 4), np.float32)])
    body, _headers = encode(ev)
    value = frame(reg.schema_id("StepBatch", 1), body)
    got = decode(value, None, registry=SchemaRegistry(registry.url))  # a fresh client: looks the id up
    assert got.episode_id == "e" and got.n == 2
    with pytest.raises(DecodeError) as e:
        decode(frame(999, body), None, registry=reg)
    assert e.value.reason == "unknown-schema"
    with pytest.raises(DecodeError):  # a registry reader still needs a frame or a header
        decode(body, None, registry=reg)
    from rlrec.producer.multi_agent_events import decode_event

    assert decode_event(value, None, registry=reg).n == 2  # the multi-agent entry point unframes once too
    for d in (decode, decode_event):  # a header without a value is a bad header, not a framed value
        with pytest.raises(DecodeError) as e:
            d(value, [("rlrec-schema", None)], registry=reg)
        assert e.value.reason == "bad-header"


def test_unreachable_registry_is_not_the_messages_fault():
    reg = SchemaRegistry("http://127.0.0.1:1", timeout=1)
    with pytest.raises(RegistryUnavailable):
        reg.kind_of(5)


@pytest.mark.broker
def test_recorder_with_registry_end_to_end(broker, topic, registry):
    rec = EpisodeRecorder(
        broker.bootstrap_servers,
        topic=topic,
        policy_id="p",
        observation_space=OBS_SPACE,
        action_space=ACT_SPACE,
        schema_registry_url=registry.url,
    )
    truth = record_episodes(rec, 3, seed=5)
    assert rec.flush(10) == 0
    rec.close()
    assert {json.loads(s)["name"] for s in registry.schemas.values()} == {
        "EpisodeStart",
        "StepBatch",
        "RewardDelta",
        "EpisodeAbort",
    }
    c = Consumer(
        {
            "bootstrap.servers": broker.bootstrap_servers,
            "group.id": uuid.uuid4().hex,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 2000,
            "heartbeat.interval.ms": 500,
        }
    )
    c.subscribe([topic])
    reg = SchemaRegistry(registry.url)
    steps, starts = 0, 0
    deadline = time.time() + 20
    while time.time() < deadline and steps < sum(len(t.actions) for t in truth.values()):
        m = c.poll(0.5)
        if m is None or m.error():
            continue
        assert not m.headers()  # framed, no rlrec-schema header
        ev = decode(m.value(), m.headers(), registry=reg)
        starts += ev.KIND == "EpisodeStart"
        steps += ev.n if ev.KIND == "StepBatch" else 0
    c.close()
    assert starts == 3 and steps == sum(len(t.actions) for t in truth.values())


def test_foreign_schemas_are_unknown_and_remembered(registry):
    """A schema id whose schema is not Avro JSON is unknown (decode() raises no JSONDecodeError),
    and an unknown id is remembered, not looked up again for every message (a blocking HTTP call
    each)."""
    registry.foreign[70] = {"schemaType": "PROTOBUF", "schema": 'syntax = "proto3"; message M {}'}
    registry.foreign[71] = {"schema": "not json at all"}
    registry.foreign[72] = {"schema": json.dumps({"type": "record", "name": "Other", "fields": []})}
    reg = SchemaRegistry(registry.url)
    body, _ = encode(StepBatch("e", 0, [np.zeros(1, np.int64)], np.ones(1), [np.zeros((1, 4), np.float32)]))
    for schema_id in (70, 71, 72, 999):
        for _ in range(3):
            with pytest.raises(DecodeError) as e:
                decode(frame(schema_id, body), None, registry=reg)
            assert e.value.reason == "unknown-schema"
    assert registry.gets == 4  # one lookup per id: the answer is cached for a minute


def test_registry_failures_are_not_the_messages_fault(registry):
    registry.fail_gets_until = time.monotonic() + 60
    reg = SchemaRegistry(registry.url)
    with pytest.raises(RegistryUnavailable):
        reg.kind_of(1)
    with pytest.raises(RegistryUnavailable):  # not cached: asked again
        reg.kind_of(1)
    assert registry.gets == 2


@pytest.mark.broker
def test_consumer_pauses_while_the_registry_fails_and_loses_nothing(broker, topic, registry, tmp_path, recorder_config):
    """Registry 5xx: no RegistryUnavailable out of run(); the partition is paused and the message
    read again with backoff; no good data is dead-lettered."""
    from rlrec.store.storage import Storage
    from tests.helpers import wait_for
    from tests.test_consumer_e2e import committed_episodes, read_all, run_consumer

    rec = EpisodeRecorder(
        broker.bootstrap_servers,
        topic=topic,
        policy_id="p",
        observation_space=OBS_SPACE,
        action_space=ACT_SPACE,
        schema_registry_url=registry.url,
    )
    truth = record_episodes(rec, 12, seed=8)
    assert rec.flush(10) == 0
    # the registry fails until the consumer has been seen paused, however long its start takes
    registry.fail_gets_until = float("inf")
    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    cfg = recorder_config(output, schema_registry_url=registry.url)
    c, t = run_consumer(cfg, storage)
    try:
        wait_for(lambda: c.metrics.registry_failures._value.get() >= 1, 30, what="a registry failure")
        wait_for(lambda: c._paused, 30, interval=0.05, what="a partition paused while the registry fails")
        assert committed_episodes(storage) == 0
        registry.fail_gets_until = 0.0  # the registry recovers
        wait_for(lambda: committed_episodes(storage) >= len(truth), 60, what="every episode committed")
        assert t.is_alive()
        dead = sum(s.value for m in c.metrics.dead_letters.collect() for s in m.samples if s.name.endswith("_total"))
        assert dead == 0
    finally:
        c.stop()
        t.join(30)
        rec.close()
    assert set(read_all(storage)) == set(truth)
