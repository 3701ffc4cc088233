"""Dead letters: the record's layout (headers renamed and capped, keys cut) and acknowledged
delivery -- the consumer never commits past a dead letter the broker has not acknowledged."""

from __future__ import annotations

import hashlib
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from rlrec.consumer.dead_letters import DLQ_HEADERS, DeadLetterQueue, dead_letter_record
from rlrec.consumer.topics import create_topics, dlq_topic_name
from rlrec.producer import EpisodeRecorder
from rlrec.producer.events import RewardDelta, encode, schema_header
from rlrec.store.manifest import read_manifest
from rlrec.store.storage import Storage
from tests.helpers import ACT_SPACE, OBS_SPACE, record_episodes, wait_for
from tests.test_assembly import start, steps
from tests.test_consumer_e2e import committed_episodes, drain_dlq, read_all, run_consumer

REFUSED_TOPIC = "bad topic!"  # Tansu refuses it at delivery: "Broker: Invalid topic"


def _record(**kw):
    base = {
        "topic": "t",
        "partition": 3,
        "offset": 42,
        "reason": "malformed",
        "detail": "x",
        "key": b"k",
        "value": b"v",
        "headers": None,
        "max_value_bytes": 100,
    }
    return dead_letter_record(**{**base, **kw})


def test_record_keeps_the_schema_header_and_renames_other_rlrec_headers():
    incoming = [
        ("rlrec-dlq-reason", b"all-good"),
        ("rlrec-schema", b"StepBatch/1"),
        ("rlrec-source-offset", b"0"),
        ("rlrec-schema", b"Other/9"),
        ("trace-id", b"abc"),
    ]
    _key, _value, headers = _record(headers=incoming)
    names = [k for k, _ in headers]
    assert names[:5] == [
        "original-rlrec-dlq-reason",
        "rlrec-schema",
        "original-rlrec-source-offset",
        "original-rlrec-schema",
        "trace-id",
    ]
    assert names[5:] == list(DLQ_HEADERS)  # the only rlrec-dlq-*/rlrec-source-* headers
    h = dict(headers)
    assert h["rlrec-dlq-reason"] == b"malformed" and h["rlrec-source-offset"] == b"42"
    assert h["rlrec-schema"] == b"StepBatch/1"


def test_record_cuts_keys_values_and_headers():
    key = b"k" * 5000
    headers_in = [("x-big", b"h" * 3000), ("x-small", b"s")]
    k, v, headers = _record(key=key, value=b"v" * 500, headers=headers_in)
    h = dict(headers)
    assert k == key[:1024] and int(h["rlrec-original-key-length"]) == 5000
    assert h["rlrec-original-key-sha256"] == hashlib.sha256(key).hexdigest().encode()
    assert v == b"v" * 100 and int(h["rlrec-original-length"]) == 500
    assert "x-big" not in h and h["x-small"] == b"s"  # what fits of the incoming headers stays
    assert int(h["rlrec-original-headers-length"]) > 3000
    assert sum(len(k) + len(v) for k, v in headers) < 2500


def test_small_records_are_untouched():
    k, v, headers = _record(headers=[("rlrec-schema", b"StepBatch/1")])
    assert (k, v) == (b"k", b"v")
    assert not any(n.startswith("rlrec-original-") for n, _ in headers)


@pytest.mark.broker
def test_failed_deliveries_are_kept_retried_and_hold_the_offset(broker):
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers, "acks": "all", "linger.ms": 5})
    failures = []
    dlq = DeadLetterQueue(producer, REFUSED_TOPIC, on_failure=lambda letter, err: failures.append(err))
    dlq.send(0, 7, "malformed", b"k", b"v", [])
    dlq.send(0, 9, "malformed", b"k", b"v", [])
    dlq.send(1, 3, "malformed", b"k", b"v", [])
    assert not dlq.flush(3)  # librdkafka's flush() returns 0 after such a failure; this does not
    assert failures and "topic" in failures[0].lower()
    assert (dlq.min_unacked(0), dlq.min_unacked(1), dlq.min_unacked(2)) == (7, 3, None)
    assert len(dlq.pending) == 3 and dlq.oldest_failure() is not None
    attempts = sum(p.attempts for p in dlq.pending.values())
    due = min(p.retry.next_at for p in dlq.pending.values())  # the backoff's schedule
    assert due > time.monotonic() - 1.0
    time.sleep(max(0.0, due - time.monotonic()) + 0.1)
    dlq.poll()  # due again: produced again
    dlq.flush(2)
    assert sum(p.attempts for p in dlq.pending.values()) > attempts
    dlq.close()

    ok = DeadLetterQueue(Producer({"bootstrap.servers": broker.bootstrap_servers}), f"dlq-{uuid.uuid4().hex[:8]}")
    ok.send(0, 7, "malformed", b"k", b"v", [])
    assert ok.flush(20) and ok.min_unacked(0) is None and ok.delivered == 1
    ok.close()


@pytest.mark.broker
@pytest.mark.slow
def test_consumer_offset_waits_for_an_unacknowledged_dead_letter(broker, tmp_path, recorder_config):
    """With a dead-letter topic the broker refuses, the committed offset stays at the poison
    message (which is in no shard and not in the DLQ) while good episodes keep landing; /healthz says why; a restart with a working DLQ delivers it;
    nothing is lost or duplicated."""
    topic = f"dlqfail-{uuid.uuid4().hex[:8]}"
    create_topics(broker.bootstrap_servers, {topic: 1, dlq_topic_name(topic): 1})
    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    group = f"g-{uuid.uuid4().hex[:6]}"
    rec = EpisodeRecorder(
        broker.bootstrap_servers, topic=topic, policy_id="pol", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )
    truth = record_episodes(rec, 3, seed=1)
    assert rec.flush(10) == 0
    raw = Producer({"bootstrap.servers": broker.bootstrap_servers})
    where = {}
    raw.produce(
        topic,
        b"\0poison",
        b"poison",
        headers=schema_header("StepBatch"),
        on_delivery=lambda err, msg: where.update(offset=msg.offset()),
    )
    # episode "x" makes a dead letter of its own (a reward for a step it never had) and ends:
    # it must wait for that letter's acknowledgement (a replay would skip, not re-send, it)
    for ev in (
        start("x"),
        steps("x", 0, 2),
        RewardDelta("x", 99, 1.0),
        steps("x", 2, 1, terminated=True),
    ):
        value, headers = encode(ev)
        raw.produce(topic, value, b"x", headers=headers)
    assert raw.flush(10) == 0
    truth.update(record_episodes(rec, 3, seed=2))
    assert rec.flush(10) == 0

    def cfg(dlq_topic):
        return recorder_config(output, topic=topic, group_id=group, dlq_topic=dlq_topic)

    def committed() -> int:
        c = Consumer({"bootstrap.servers": broker.bootstrap_servers, "group.id": group})
        try:
            return c.committed([TopicPartition(topic, 0)], timeout=10)[0].offset
        finally:
            c.close()

    def store_position() -> int | None:  # where the store resumes partition 0 (GUARANTEES §8, "Replay")
        return max((e.resume_offset for e in read_manifest(storage) if e.partition == 0), default=None)

    c, t = run_consumer(cfg(REFUSED_TOPIC), storage)
    c.unhealthy_after_s = 1.0
    try:
        wait_for(lambda: committed_episodes(storage) >= 6, 60, what="good episodes on both sides of the poison")
        wait_for(lambda: not c.health()[0], 20, what="/healthz to report the failing DLQ")
        assert "dead letters not acknowledged" in c.health()[1]
        time.sleep(1.0)
        assert committed() == where["offset"]  # held at the unacknowledged dead letter
        assert c.dlq.min_unacked(0) == where["offset"] and c.metrics.dead_letter_failures._value.get() >= 1
        assert "x" not in read_all(storage) and "x" in c.writers[0].assembler.finished  # waits
    finally:
        c.stop()
        t.join(30)
    assert committed() == where["offset"]  # also after a clean shutdown
    assert store_position() == where["offset"]  # the store's position, which decides, is held there too

    c, t = run_consumer(cfg(None), storage)  # a working DLQ: the replay delivers the dead letter
    try:
        wait_for(lambda: committed() > where["offset"], 60, what="the offset to pass the delivered dead letter")
        wait_for(lambda: store_position() > where["offset"], 30, what="the store's position to pass it")
    finally:
        c.stop()
        t.join(30)
        rec.close()
    letters = drain_dlq(broker.bootstrap_servers, topic, 4)
    assert [(dict(m.headers())["rlrec-source-offset"], m.key()) for m in letters] == [
        (str(where["offset"]).encode(), b"poison"),
        (str(where["offset"] + 3).encode(), b"x"),  # x's bad reward, re-sent by the replay
    ]
    assert dict(letters[1].headers())["rlrec-dlq-reason"] == b"bad-reward-t"
    # every good episode once (read_all checks duplicates), and x with its steps
    assert set(read_all(storage)) == set(truth) | {"x"} and len(read_all(storage)["x"][0]) == 3
