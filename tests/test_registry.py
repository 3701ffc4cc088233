"""Optional Confluent schema-registry framing, against a minimal registry speaking its REST API."""

from __future__ import annotations

import http.server
import json
import threading
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
                i = int(self.path.rsplit("/", 1)[-1])
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
    import time

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
