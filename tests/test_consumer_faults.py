"""The consumer under failure: kill -9, rebalances, storage errors, memory caps, and a zombie
writer (hostile input: tests/test_hostile.py). Real broker, real storage; nothing mocked."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rlrec.consumer.assembly import PartitionAssembler
from rlrec.consumer.service import ConsumerConfig
from rlrec.consumer.writer import PartitionWriter, WriterState
from rlrec.local import FAST_GROUP_KAFKA
from rlrec.producer import EpisodeRecorder
from rlrec.store.manifest import read_manifest
from rlrec.store.storage import RetryPolicy, Storage, StorageError
from tests.faults import FaultProxy
from tests.helpers import ACT_SPACE, OBS_SPACE, record_episodes, wait_for
from tests.stores import SERVER_FIXTURES, ObjectStore
from tests.test_consumer_e2e import committed_episodes, drain_dlq, read_all, run_consumer

pytestmark = pytest.mark.broker


def _consume_cmd(cfg: ConsumerConfig) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "rlrec",
        "consume",
        "--bootstrap-servers",
        cfg.bootstrap_servers,
        "--topic",
        cfg.topic,
        "--group-id",
        cfg.group_id,
        "--output",
        cfg.output,
        "--max-file-age-s",
        "0.3",
        "--commit-interval-s",
        "0.3",
        "--no-create-topics",
        "--max-episodes-per-file",
        "50",
        # a delayed reward comes as its own event right after the episode's last step; without a
        # join window a flush between the two commits the episode first and dead-letters the
        # reward (late-reward), which this test, about kills, does not want to depend on
        "--reward-join-window-s",
        "1.0",
    ]
    for k, v in FAST_GROUP_KAFKA.items():
        cmd += ["--kafka-config", f"{k}={v}"]
    return cmd


def _output(where: str, tmp_path, monkeypatch, request) -> str:
    """A fresh output root: a local directory, or a bucket of one of the object-store emulators
    (this process's environment, and so the consumer processes', points at it)."""
    if where == "local":
        return str(tmp_path / "out")
    return ObjectStore(where, request.getfixturevalue(SERVER_FIXTURES[where])).output(monkeypatch, "exp")


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "gcs", "azure"])
def test_kill9_at_random_moments_loses_and_duplicates_nothing(
    where, broker, topic, tmp_path, monkeypatch, request, recorder_config
):
    output = _output(where, tmp_path, monkeypatch, request)
    cfg = recorder_config(output)
    storage = Storage.from_uri(output)
    rec = EpisodeRecorder(
        broker.bootstrap_servers, topic=topic, policy_id="pol", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )
    truth: dict = {}
    done = threading.Event()
    kills_done = threading.Event()

    def produce():
        for wave in range(60):  # until the kills are done (at least 10 waves)
            if wave >= 10 and kills_done.is_set():
                break
            truth.update(
                record_episodes(rec, 100, seed=100 + wave, min_len=2, max_len=12, abort_every=9, delayed_every=11)
            )
            time.sleep(0.5)
        rec.flush(30)
        done.set()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    rng = random.Random(7)
    kills = 0
    log = open(tmp_path / "consumer.log", "ab")
    proc = subprocess.Popen(_consume_cmd(cfg), stdout=log, stderr=log)
    try:
        while kills < 5:
            # each kill lands on a consumer that has committed something, at a random moment after
            seen = committed_episodes(storage)
            wait_for(
                lambda seen=seen: committed_episodes(storage) > seen, 60, interval=0.1, what="a commit before the kill"
            )
            time.sleep(rng.uniform(0.0, 1.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            kills += 1
            proc = subprocess.Popen(_consume_cmd(cfg), stdout=log, stderr=log)
        kills_done.set()
        done.wait(120)
        wait_for(lambda: committed_episodes(storage) >= len(truth), 90, interval=1, what="all episodes committed")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        rec.close()
    got = read_all(storage)  # asserts that no episode is in two shards
    assert set(got) == set(truth)
    assert len(truth) >= 1000 and kills == 5
    for eid, (ep, _entry) in got.items():
        assert np.allclose(np.asarray(ep.get_rewards()), truth[eid].rewards, rtol=0, atol=1e-12), eid


def test_rebalance_between_two_consumers(broker, topic, tmp_path, recorder_config):
    output = str(tmp_path / "out")
    cfg = recorder_config(output)
    storage = Storage.from_uri(output)
    rec = EpisodeRecorder(
        broker.bootstrap_servers, topic=topic, policy_id="pol", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )
    open_ids = [rec.begin_episode(OBS_SPACE.sample()) for _ in range(8)]  # span the rebalances
    truth = record_episodes(rec, 40, seed=11)
    rec.flush(10)
    a, ta = run_consumer(cfg, storage)
    wait_for(lambda: committed_episodes(storage) >= 40, 40, what="consumer A committed")
    b, tb = run_consumer(cfg, storage)  # joins: partitions move from A to B
    wait_for(lambda: len(b.writers) > 0 and len(a.writers) < 4, 30, what="rebalance to A+B")
    truth.update(record_episodes(rec, 40, seed=12))
    rec.flush(10)
    wait_for(lambda: committed_episodes(storage) >= 80, 40, what="A+B committed")
    a.stop()  # leaves: B takes everything
    ta.join(30)
    for eid in open_ids:
        rec.log_step(eid, 1, 1.0, OBS_SPACE.sample(), truncated=True)
    truth.update(record_episodes(rec, 40, seed=13))
    rec.flush(10)
    try:
        wait_for(lambda: committed_episodes(storage) >= 128, 60, what="B alone committed")
    finally:
        b.stop()
        tb.join(30)
        rec.close()
    got = read_all(storage)
    assert set(got) == set(truth) | set(open_ids)


def _behind_a_fault_proxy(object_store: ObjectStore, monkeypatch) -> tuple[FaultProxy, str, Storage]:
    """A fresh bucket of the object store reached through a FaultProxy (the process's cloud
    settings point at the proxy): the proxy, the output URI, and a Storage of it that retries
    briefly."""
    proxy = FaultProxy(object_store.port)
    output = object_store.output(monkeypatch, "exp", proxy_port=proxy.port)
    return proxy, output, Storage.from_uri(output, retry=RetryPolicy(attempts=2, base_delay=0.05, max_delay=0.1))


def test_a_consumer_started_during_a_storage_outage_waits_for_the_store(
    broker, topic, object_store, monkeypatch, recorder_config
):
    """The start-up probe of create-once writes meets an unreachable store: infrastructure, so
    the consumer probes again with backoff (never a crash), and runs once the store answers."""
    proxy, output, storage = _behind_a_fault_proxy(object_store, monkeypatch)
    rec = EpisodeRecorder(
        broker.bootstrap_servers, topic=topic, policy_id="pol", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )
    proxy.fail_for(4.0)
    c, t = run_consumer(recorder_config(output), storage)
    try:
        truth = record_episodes(rec, 10, seed=23)
        rec.flush(10)
        time.sleep(1.0)
        assert t.is_alive()  # still waiting for the store, not dead
        wait_for(lambda: _committed_or_zero(storage) >= 10, 60, what="episodes committed once the store answers")
    finally:
        c.stop()
        t.join(30)
        rec.close()
    try:  # the storage reaches the store through the proxy: read before closing it
        assert set(read_all(storage)) == set(truth)
    finally:
        proxy.close()


def test_storage_outage_pauses_and_recovers(broker, topic, object_store, monkeypatch, recorder_config):
    proxy, output, storage = _behind_a_fault_proxy(object_store, monkeypatch)
    cfg = recorder_config(output)
    rec = EpisodeRecorder(
        broker.bootstrap_servers, topic=topic, policy_id="pol", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )
    c, t = run_consumer(cfg, storage)
    try:
        truth = record_episodes(rec, 20, seed=21)
        rec.flush(10)
        wait_for(lambda: committed_episodes(storage) >= 20, 40, what="first batch")
        # storage down: flushes fail, partitions pause, nothing is committed. pyarrow's Azure
        # client retries each request itself for ~6 s (not configurable in pyarrow 26): outlast it
        proxy.fail_for(14.0 if object_store.kind == "azure" else 6.0)
        truth.update(record_episodes(rec, 30, seed=22))
        rec.flush(10)
        wait_for(lambda: c.metrics.flush_failures._value.get() > 0, 30, what="a failed flush")
        wait_for(lambda: _committed_or_zero(storage) >= 50, 60, what="recovery after the outage")
    finally:
        c.stop()
        t.join(30)
        rec.close()
    try:  # the storage reaches the store through the proxy (head reads open new connections)
        got = read_all(storage)
    finally:
        proxy.close()
    assert set(got) == set(truth)


def _committed_or_zero(storage: Storage) -> int:
    try:
        return committed_episodes(storage)
    except StorageError:  # the test's own reads fail during the outage too
        return 0


def test_open_episode_cap_evicts_to_dead_letters(broker, topic, tmp_path, recorder_config):
    output = str(tmp_path / "out")
    cfg = recorder_config(output, max_open_episodes=5)
    storage = Storage.from_uri(output)
    rec = EpisodeRecorder(
        broker.bootstrap_servers, topic=topic, policy_id="pol", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )
    idle = [rec.begin_episode(OBS_SPACE.sample()) for _ in range(20)]
    for eid in idle:
        rec.log_step(eid, 0, 1.0, OBS_SPACE.sample())
    rec.flush(10)
    c, t = run_consumer(cfg, storage)
    try:
        wait_for(lambda: c.metrics.dead_letters.labels("capacity")._value.get() >= 30, 30, what="evictions")
        truth = record_episodes(rec, 10, seed=41)  # finished episodes still commit
        rec.flush(10)
        wait_for(lambda: committed_episodes(storage) >= 10, 40, what="episodes under the cap")
    finally:
        c.stop()
        t.join(30)
        rec.close()
    dlq = drain_dlq(broker.bootstrap_servers, topic, 2)
    evicted = {m.key().decode() for m in dlq if dict(m.headers())["rlrec-dlq-reason"] == b"capacity"}
    assert len(evicted) >= 15  # everything over the cap went to the DLQ, start and steps re-encoded
    assert set(truth) <= set(read_all(storage))


@pytest.mark.parametrize("where", ["local", *sorted(SERVER_FIXTURES)])
def test_zombie_writer_is_fenced(where, tmp_path, monkeypatch, request):
    """Two writers believe they own partition 0: the older one can't commit after the newer claimed."""
    storage = Storage.from_uri(_output(where, tmp_path, monkeypatch, request))
    from tests.test_assembly import start, steps

    zombie = PartitionWriter(storage, "t", 0)
    zombie.claim()
    for off, ev in enumerate([start("a"), steps("a", 0, 2, terminated=True)]):
        zombie.assembler.apply(off, ev)
    owner = PartitionWriter(storage, "t", 0)
    owner.claim()  # the partition moved: new epoch
    for off, ev in enumerate([start("a"), steps("a", 0, 2, terminated=True)]):
        owner.assembler.apply(off, ev)
    t = zombie.tick(time.time(), force=True)
    assert t.fenced and not t.flushed and zombie.state is WriterState.FENCED and zombie.assembler is None
    t = owner.tick(time.time(), force=True)
    assert [f.result.episodes for f in t.flushed] == [1] and owner.state is WriterState.ACTIVE
    entries = read_manifest(storage)
    assert [e.episode_ids for e in entries] == [("a",)] and entries[0].epoch == owner.epoch
    assert isinstance(owner.assembler, PartitionAssembler)
