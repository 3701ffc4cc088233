"""Exactly-once at the edges (real broker, local S3 behind a fault proxy):

* an append that lands although storage said it failed, followed by a delayed reward: the
  reward must not be applied in memory to an episode whose append may have landed, then passed
  by the offset when the retry finds the entry -- it would be in no shard and not in the DLQ;
* a storage outage twice as long as `episode_timeout_s` while an episode keeps stepping: the
  episode must not expire on the wall clock while its partition is paused (it would be written
  truncated and its later steps dropped as "duplicates").
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from rlrec.consumer.service import ConsumerConfig
from rlrec.consumer.topics import create_topics, dlq_topic_name
from rlrec.consumer.writer import WriterState
from rlrec.local import FAST_GROUP_KAFKA
from rlrec.producer import EpisodeRecorder
from rlrec.store.storage import RetryPolicy, Storage
from tests.faults import FaultProxy
from tests.helpers import ACT_SPACE, OBS_SPACE, wait_for
from tests.test_consumer_e2e import drain_dlq, read_all, run_consumer

pytestmark = [pytest.mark.broker, pytest.mark.slow]


@pytest.fixture
def proxied(object_store, monkeypatch):
    """(consumer storage through a fault proxy, direct storage for the test, proxy, a function
    that makes the next manifest append ambiguous) on each object store."""
    proxy = FaultProxy(object_store.port)
    uri = object_store.output(monkeypatch)
    direct = Storage.from_uri(uri)
    for k, v in object_store.env(proxy.port).items():
        monkeypatch.setenv(k, v)
    through = Storage.from_uri(uri, retry=RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05))
    yield through, direct, proxy, lambda: _make_the_next_append_ambiguous(proxy, object_store.kind)
    proxy.close()


def _make_the_next_append_ambiguous(proxy: FaultProxy, kind: str) -> None:
    """The next append of a manifest entry lands, but the client is told it failed; every later
    request for the manifest fails (until ``proxy.clear_rules()``). S3 and Azure name the entry in
    the path of its PUT; GCS creates it with a multipart POST that names it in the body (the only
    multipart upload rlrec sends) and names manifest objects encoded in paths and queries."""
    if kind == "gcs":
        proxy.swallow_matching(1, "uploadType=multipart", method="POST")
        proxy.fail_matching(1_000, "uploadType=multipart")
        proxy.fail_matching(1_000, "%2F_manifest%2F")
    else:
        proxy.swallow_matching(1, "/_manifest/", method="PUT")
        proxy.fail_matching(1_000, "/_manifest/")


def _setup(broker, storage, **kw):
    topic = f"edge-{uuid.uuid4().hex[:8]}"
    create_topics(broker.bootstrap_servers, {topic: 1, dlq_topic_name(topic): 1})
    cfg = ConsumerConfig(
        bootstrap_servers=broker.bootstrap_servers,
        output="s3://unused/out",
        topic=topic,
        group_id=f"g-{uuid.uuid4().hex[:6]}",
        max_file_age_s=0.2,
        commit_interval_s=0.2,
        kafka_config=FAST_GROUP_KAFKA,
        create_topics=False,
        **kw,
    )
    c, t = run_consumer(cfg, storage)
    wait_for(lambda: c.writers and all(w.state is WriterState.ACTIVE for w in c.writers.values()), 30, what="a claim")
    rec = EpisodeRecorder(
        broker.bootstrap_servers, topic=topic, policy_id="pol", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )
    return topic, c, t, rec


def _obs(i: float) -> np.ndarray:
    return np.full(4, i, np.float32)


def test_a_reward_after_an_ambiguous_append_is_a_late_reward_never_lost(broker, proxied):
    through, direct, proxy, make_ambiguous = proxied
    topic, c, t, rec = _setup(broker, through)
    try:
        # the next append of a manifest entry lands, but the consumer is told it failed (and its
        # retries fail): the outcome is unknown to it
        make_ambiguous()
        eid = rec.begin_episode(_obs(0))
        rec.log_step(eid, 1, 1.0, _obs(1))
        rec.log_step(eid, 0, 1.0, _obs(2), terminated=True)
        assert rec.flush(10) == 0
        w = next(iter(c.writers.values()))
        wait_for(lambda: w.uncertain, 30, interval=0.05, what="an append with an unknown outcome")
        rec.log_reward(eid, 0, 0.5)  # published while the outcome is unknown
        assert rec.flush(10) == 0
        time.sleep(1.0)
        proxy.clear_rules()  # the retry finds the landed entry: committed as it was, without the reward
        wait_for(lambda: eid in read_all(direct) and not w.uncertain, 90, what="the episode committed")
        late = c.metrics.dead_letters.labels("late-reward")
        wait_for(lambda: late._value.get() >= 1, 30, what="the reward dead-lettered late")
        wait_for(lambda: not c.dlq.pending, 30, what="dead letters acknowledged")
    finally:
        c.stop()
        t.join(30)
        rec.close()
    ep, _entry = read_all(direct)[eid]  # once (read_all checks), without the reward
    assert np.asarray(ep.get_rewards()).tolist() == [1.0, 1.0]
    reasons = [dict(m.headers())["rlrec-dlq-reason"] for m in drain_dlq(broker.bootstrap_servers, topic)]
    assert reasons == [b"late-reward"]


def test_a_storage_outage_longer_than_the_episode_timeout_truncates_nothing(broker, proxied, object_store):
    through, direct, proxy, _ = proxied
    # at least twice the episode timeout, and longer than the consumer's 3 attempts of a request:
    # pyarrow's GCS client retries each request itself for 1 s (its shortest limit), its Azure
    # client for ~6 s (not configurable in pyarrow 26)
    outage = {"s3": 4.0, "gcs": 8.0, "azure": 20.0}[object_store.kind]
    _topic, c, t, rec = _setup(broker, through, episode_timeout_s=2.0)
    try:
        long_eid = rec.begin_episode(_obs(0))
        short = rec.begin_episode(_obs(0))
        rec.log_step(short, 0, 1.0, _obs(1), terminated=True)  # its flush meets the outage
        proxy.fail_for(outage)
        steps = 0
        t_end = time.time() + outage + 4.0
        while time.time() < t_end:
            rec.log_step(long_eid, 1, 1.0, _obs(steps))
            steps += 1
            rec.flush(5)
            time.sleep(0.5)
        rec.log_step(long_eid, 0, 1.0, _obs(steps), terminated=True)
        steps += 1
        assert rec.flush(10) == 0
        wait_for(lambda: {long_eid, short} <= set(read_all(direct)), 60, what="both episodes committed")
        assert c.metrics.flush_failures._value.get() >= 1  # the outage was met
        assert c.metrics.decisions.labels("timeout")._value.get() == 0
    finally:
        c.stop()
        t.join(30)
        rec.close()
    ep, _ = read_all(direct)[long_eid]
    assert len(ep) == steps and ep.is_terminated and not ep.is_truncated


def test_an_uncertain_append_keeps_its_episodes_closed_to_rewards(proxied):
    """The writer alone (no broker): a reward read while an append's outcome is unknown is a
    late reward, and the retry commits the episode as it was: a reward applied in memory would
    be in no shard (the retry finds the landed entry without it) and not in the DLQ."""
    from rlrec.consumer.writer import PartitionWriter
    from rlrec.producer.events import RewardDelta
    from tests.test_assembly import start, steps

    through, direct, proxy, make_ambiguous = proxied
    w = PartitionWriter(through, "edges", 0)
    w.claim()
    w.assembler.apply(0, start("a"))
    w.assembler.apply(1, steps("a", 0, 2, terminated=True))
    make_ambiguous()
    t = w.tick(time.time(), force=True)
    assert t.failed and w.state is WriterState.BACKING_OFF and [fe.episode_id for fe in w.uncertain] == ["a"]
    letters = w.assembler.apply(2, RewardDelta("a", 0, 0.5))
    assert [dl.reason for dl in letters] == ["late-reward"]
    proxy.clear_rules()
    w.next_attempt = 0.0
    t = w.tick(time.time())
    assert w.state is WriterState.ACTIVE and not w.uncertain and w.committer.committed_offset("a") is not None
    ep, _ = read_all(direct)["a"]
    assert np.asarray(ep.get_rewards()).tolist() == [1.0, 1.0]
    assert w.assembler.safe_offset() == 3


def test_encoding_on_another_thread_keeps_episodes_in_flight_until_committed(tmp_path):
    """With an encoder (the service's thread), a tick hands the episodes out and encodes them
    there; until a later tick commits them they are in flight: a reward for them is a late
    reward, the safe offset holds at their start and the memory budget still counts them. A
    drop while encoding writes nothing; `force` waits for the encoding and writes the rest too."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from rlrec.consumer.writer import PartitionWriter
    from rlrec.producer.events import RewardDelta
    from rlrec.store.manifest import read_manifest
    from tests.test_assembly import start, steps

    storage = Storage.from_uri(str(tmp_path / "out"))
    later = time.time() + 3600  # past the reward join window
    gate = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(gate.wait)  # the encoder is busy until the gate opens
        w = PartitionWriter(storage, "async", 0, encoder=pool)
        w.claim()
        a = w.assembler
        a.apply(0, start("a"))
        a.apply(1, steps("a", 0, 2, terminated=True))
        waiting = w.buffered_bytes
        assert waiting > 0
        t = w.tick(later, force=False)
        assert not t.flushed and "a" in a.in_flight and not read_manifest(storage)
        assert w.buffered_bytes == waiting and not w.due(later)  # still counted; not due until encoded
        assert [dl.reason for dl in a.apply(2, RewardDelta("a", 0, 0.5))] == ["late-reward"]
        assert a.safe_offset() == 0
        a.apply(3, start("b"))
        a.apply(4, steps("b", 0, 1, terminated=True))
        gate.set()
        pool.submit(lambda: None).result(timeout=30)  # one thread, in order: the encoding is done
        assert w.due(later)
        t = w.tick(later)  # commits "a" only: "b" was not handed out
        assert [fe.episode_id for f in t.flushed for fe in f.episodes] == ["a"]
        assert a.committed.committed_offset("a") is not None and "b" in a.finished
        t = w.tick(later, force=True)  # nothing encoding: "b" written at once
        assert [fe.episode_id for f in t.flushed for fe in f.episodes] == ["b"]
        assert sorted(i for e in read_manifest(storage) for i in e.episode_ids) == ["a", "b"]
        assert a.safe_offset() == 5 and w.buffered_bytes == 0

        # dropped while encoding: nothing of it is written
        gate.clear()
        pool.submit(gate.wait)
        a.apply(5, start("c"))
        a.apply(6, steps("c", 0, 1, terminated=True))
        w.tick(later, force=False)
        w.drop()
        gate.set()
        pool.submit(lambda: None).result(timeout=60)
        assert w.tick(later, force=True).flushed == [] and w.buffered_bytes == 0
        assert sorted(i for e in read_manifest(storage) for i in e.episode_ids) == ["a", "b"]

        # force collects an encoding under way and writes what became ready meanwhile
        w2 = PartitionWriter(Storage.from_uri(str(tmp_path / "out2")), "async", 1, encoder=pool)
        w2.claim()
        a2 = w2.assembler
        a2.apply(0, start("d"))
        a2.apply(1, steps("d", 0, 1, terminated=True))
        w2.tick(later, force=False)
        a2.apply(2, start("e"))
        a2.apply(3, steps("e", 0, 1, terminated=True))
        t = w2.tick(later, force=True)
        assert [fe.episode_id for f in t.flushed for fe in f.episodes] == ["d", "e"]
        assert a2.safe_offset() == 4 and not a2.in_flight

        # in the background one shard at a time: the rest waits, not handed out
        from rlrec.consumer.writer import Rotation

        w3 = PartitionWriter(Storage.from_uri(str(tmp_path / "out3")), "async", 2, encoder=pool, rotation=Rotation(1))
        w3.claim()
        a3 = w3.assembler
        for i, eid in enumerate(("f", "g")):
            a3.apply(2 * i, start(eid))
            a3.apply(2 * i + 1, steps(eid, 0, 1, terminated=True))
        w3.tick(later)
        assert list(a3.in_flight) == ["f"] and list(a3.finished) == ["g"]
        assert pool.submit(lambda: None).result(timeout=60) is None and w3.due(later)
        assert [fe.episode_id for f in w3.tick(later).flushed for fe in f.episodes] == ["f"]
        w3.tick(later)
        assert pool.submit(lambda: None).result(timeout=60) is None and w3.due(later)
        assert [fe.episode_id for f in w3.tick(later).flushed for fe in f.episodes] == ["g"]
    finally:
        gate.set()
        pool.shutdown(wait=True)


def test_background_write_leaves_the_committer_alone_and_its_outcome_to_the_loop(tmp_path, monkeypatch):
    """Steps 1-4 run on the encoding thread and the loop's thread applies the outcome: while a
    write is under way `publish_pending` and `offsets_committed` leave the committer alone (the
    latter is applied once the write is); a storage failure there backs the writer off with the
    episodes given back (a delayed reward applies to them again), a fence there fences it and
    commits nothing; dropping the writer waits for a write that has started."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from rlrec.consumer.writer import PartitionWriter
    from rlrec.producer.events import RewardDelta
    from rlrec.store.manifest import read_manifest
    from rlrec.store.storage import StorageError
    from tests.test_assembly import start, steps

    storage = Storage.from_uri(str(tmp_path / "out"))
    later = time.time() + 3600  # past the reward join window
    gate = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1)

    def drain() -> None:  # one thread, in order: what was submitted before is done
        pool.submit(lambda: None).result(timeout=30)

    def committed_ids() -> list[str]:
        return sorted(i for e in read_manifest(storage) for i in e.episode_ids)

    try:
        w = PartitionWriter(storage, "bg", 0, encoder=pool)
        w.claim()
        a = w.assembler
        a.apply(0, start("a"))
        a.apply(1, steps("a", 0, 2, terminated=True))
        pool.submit(gate.wait)  # the encoding thread is busy until the gate opens
        w.tick(later)
        assert w.encoding and "a" in a.in_flight
        touched: list[str] = []
        monkeypatch.setattr(w.committer, "publish_pending", lambda **k: touched.append("publish") or 0)
        real_forget = w.committer.offsets_committed
        monkeypatch.setattr(w.committer, "offsets_committed", lambda o: touched.append(f"forget {o}") or real_forget(o))
        assert w.publish_pending() == 0
        w.offsets_committed(2)
        assert touched == []  # nothing while the write waits
        gate.set()
        drain()
        t = w.tick(later)
        assert [fe.episode_id for f in t.flushed for fe in f.episodes] == ["a"] and a.committed.committed_offset(
            "a"
        ) is not None
        assert touched[-1] == "forget 2" and not w.encoding  # applied with the outcome
        monkeypatch.undo()

        # a storage failure on the encoding thread: backing off, the episode given back
        real_write = storage.write

        def failing_write(path, data):
            raise StorageError(f"write {path}: injected")

        monkeypatch.setattr(storage, "write", failing_write)
        a.apply(2, start("b"))
        a.apply(3, steps("b", 0, 2, terminated=True))
        w.tick(later)
        drain()
        t = w.tick(later)
        assert t.failed and "injected" in t.failed and w.state is WriterState.BACKING_OFF
        assert "b" in a.finished and "b" not in a.in_flight and committed_ids() == ["a"]
        assert a.apply(4, RewardDelta("b", 1, 0.5)) == []  # given back: rewards apply again
        monkeypatch.setattr(storage, "write", real_write)
        w.next_attempt = 0.0
        w.tick(later)
        drain()
        t = w.tick(later)
        assert [fe.episode_id for f in t.flushed for fe in f.episodes] == ["b"] and w.state is WriterState.ACTIVE
        ep, _ = read_all(storage)["b"]
        assert np.asarray(ep.get_rewards()).tolist() == [1.0, 1.5]

        # fenced on the encoding thread: a newer writer claimed the partition
        newer = PartitionWriter(storage, "bg", 0)
        newer.claim()
        a.apply(5, start("c"))
        a.apply(6, steps("c", 0, 1, terminated=True))
        w.tick(later)
        drain()
        t = w.tick(later)
        assert t.fenced and w.state is WriterState.FENCED and w.assembler is None
        assert committed_ids() == ["a", "b"]

        # a drop waits for a write that has started (nothing else may use the committer)
        w2 = PartitionWriter(Storage.from_uri(str(tmp_path / "out2")), "bg", 1, encoder=pool)
        w2.claim()
        started = threading.Event()
        real_commit = w2.committer.commit

        def slow_commit(*args, **kwargs):
            started.set()
            time.sleep(0.3)
            return real_commit(*args, **kwargs)

        monkeypatch.setattr(w2.committer, "commit", slow_commit)
        w2.assembler.apply(0, start("d"))
        w2.assembler.apply(1, steps("d", 0, 1, terminated=True))
        w2.tick(later)
        assert started.wait(10)
        w2.drop()  # returns once the write has ended: its entry is there already
        assert [i for e in read_manifest(Storage.from_uri(str(tmp_path / "out2"))) for i in e.episode_ids] == ["d"]
    finally:
        gate.set()
        pool.shutdown(wait=True)
