"""Adding partitions to a live topic re-maps episode keys: open episodes split across partitions.

The consumer notices the new partition count, logs it loudly, and dead-letters the split parts
(`partition-change`) instead of committing half episodes or counting them as unknown. Needs a
broker with CreatePartitions: Apache Kafka (`RLREC_TEST_BROKER=testcontainers`). Tansu 0.6, our
embedded broker, answers CreatePartitions with UNSUPPORTED_FEATURE (measured), so the test skips
there; the assembly rules are unit-tested in tests/test_assembly.py.
"""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka.admin import AdminClient, NewPartitions

import rlrec.consumer.service as service
from rlrec.consumer.topics import create_topics, dlq_topic_name
from rlrec.producer import EpisodeRecorder
from rlrec.store.storage import Storage
from tests.helpers import ACT_SPACE, OBS_SPACE, record_episodes, wait_for
from tests.test_consumer_e2e import drain_dlq, read_all, run_consumer

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_split_episodes_are_dead_lettered_after_partitions_are_added(broker, tmp_path, monkeypatch, recorder_config):
    if broker.kind == "tansu":
        pytest.skip(
            "Tansu 0.6 has no CreatePartitions (KIP-195: UNSUPPORTED_FEATURE); run with RLREC_TEST_BROKER=testcontainers"
        )
    monkeypatch.setattr(service, "PARTITION_CHECK_S", 1.0)
    topic = f"grow-{uuid.uuid4().hex[:8]}"
    create_topics(broker.bootstrap_servers, {topic: 2, dlq_topic_name(topic): 2})
    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    cfg = recorder_config(output, topic=topic, episode_timeout_s=3.0)
    rec = EpisodeRecorder(
        broker.bootstrap_servers,
        topic=topic,
        policy_id="pol",
        observation_space=OBS_SPACE,
        action_space=ACT_SPACE,
        max_batch_steps=1,
    )
    c, t = run_consumer(cfg, storage)
    try:
        eids = [rec.begin_episode(OBS_SPACE.sample()) for _ in range(40)]
        for eid in eids:
            rec.log_step(eid, 0, 1.0, OBS_SPACE.sample())
        assert rec.flush(10) == 0
        wait_for(lambda: c._partition_count == 2, 30, what="the partition count seen")
        AdminClient({"bootstrap.servers": broker.bootstrap_servers}).create_partitions([NewPartitions(topic, 8)])[
            topic
        ].result(30)
        wait_for(lambda: c.metrics.partition_count_changes._value.get() >= 1, 60, what="the change noticed")
        for eid in eids:  # the rest of each episode: most keys now hash to other partitions
            rec.log_step(eid, 1, 1.0, OBS_SPACE.sample(), terminated=True)
        truth = record_episodes(rec, 10, seed=3)  # whole episodes after the change land as usual
        assert rec.flush(10) == 0
        wait_for(lambda: set(truth) <= set(read_all(storage)), 60, what="episodes after the change")
        wait_for(
            lambda: (
                sum(
                    s.value
                    for m in c.metrics.dead_letters.collect()
                    for s in m.samples
                    if s.name.endswith("_total") and s.labels.get("reason") == "partition-change"
                )
                > 0
            ),
            60,
            what="split parts dead-lettered",
        )
    finally:
        c.stop()
        t.join(30)
        rec.close()
    committed = read_all(storage)  # no episode twice
    split = [e for e in eids if e not in committed]
    reasons = {dict(m.headers())["rlrec-dlq-reason"].decode() for m in drain_dlq(broker.bootstrap_servers, topic)}
    assert split and "partition-change" in reasons
