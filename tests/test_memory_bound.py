"""The consumer's memory stays bounded under load it cannot hold: 100k concurrently open episodes
against a 20k cap, and a storage outage while finished episodes keep arriving.

Both tests run `rlrec consume` as a subprocess (its RSS is its own, read with psutil) against the
real broker, and watch it through its /metrics endpoint. Events are produced raw (the Avro
records of `rlrec.producer.events`, one confluent-kafka `produce` each): 100k recorders would take
minutes.

RSS budget: growth over the consumer's RSS once warm (ray.rllib imported, a shard committed)
of at most RSS_GROWTH_BUDGET_MB. Measured on CartPole-size events: an open episode (start + one
step) holds ~3.5 KB, so the 20k under the cap cost ~70 MB plus the evicted-id memory and
librdkafka queues, while 100k without the cap would cost ~350 MB on top - over the budget.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from collections import Counter

import psutil
import pytest
from confluent_kafka import Consumer, Producer

from rlrec.local import FAST_GROUP_KAFKA, free_port
from rlrec.producer.events import encode_record, schema_header
from rlrec.store.manifest import read_manifest
from rlrec.store.storage import Storage
from tests.faults import FaultProxy
from tests.helpers import wait_for
from tests.test_consumer_e2e import read_all
from tests.test_consumer_faults import _consume_cmd
from tests.test_hostile import start_rec, steps_rec

pytestmark = [pytest.mark.broker, pytest.mark.slow]

RSS_GROWTH_BUDGET_MB = 300
OPEN = 100_000
CAP = 20_000
START_H, STEP_H = schema_header("EpisodeStart"), schema_header("StepBatch")


# ---------------------------------------------------------------------------------------------
# helpers


class RawEvents:
    """Encodes CartPole-size events for many episodes fast: one template record per kind, the
    episode id swapped in (`encode_record`, no recorder)."""

    def __init__(self, steps: int = 1):
        self.start = start_rec("x")
        self.first = steps_rec("x", 0, steps)
        self.last = steps_rec("x", steps, 1, terminated=True)
        self.whole = steps_rec("x", 0, steps, terminated=True)

    def encode(self, template: dict, eid: str) -> bytes:
        return encode_record("StepBatch" if "t0" in template else "EpisodeStart", {**template, "episode_id": eid})


def _producer(bootstrap: str) -> Producer:
    return Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 20,
            "batch.num.messages": 10_000,
            "queue.buffering.max.messages": 500_000,
            "compression.type": "lz4",
        }
    )


def _produce(p: Producer, topic: str, key: str, value: bytes, headers) -> None:
    while True:
        try:
            p.produce(topic, value, key.encode(), headers=headers)
            return
        except BufferError:
            p.poll(0.05)


class ConsumerProcess:
    """`rlrec consume` in a subprocess, with its /metrics and a sampler of its RSS."""

    def __init__(self, cmd: list[str], log_path, env: dict | None = None):
        self.port = free_port()
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [*cmd, "--metrics-port", str(self.port)],
            stdout=self.log,
            stderr=self.log,
            env={**os.environ, **(env or {})},
        )
        self.ps = psutil.Process(self.proc.pid)
        self.peak_rss = 0
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def metrics(self) -> dict[str, float]:
        """{'name{labels}': value} from /metrics ({} while the server is not up)."""
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metric(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def rss_mb(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.peak_rss = max(self.peak_rss, self.ps.memory_info().rss)
            except psutil.Error:
                return
            m = self.metrics()
            if m:
                self.samples.append(m)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self._stop.set()
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._sampler.join(10)
        self.log.close()


def _warm_up(c: ConsumerProcess, bootstrap: str, topic: str, ev: RawEvents, n: int = 20) -> float:
    """Commit `n` episodes (so ray.rllib is imported and a shard written); returns the RSS (MB) then."""
    p = _producer(bootstrap)
    for i in range(n):
        eid = f"warm-{i}"
        _produce(p, topic, eid, ev.encode(ev.start, eid), START_H)
        _produce(p, topic, eid, ev.encode(ev.whole, eid), STEP_H)
    assert p.flush(30) == 0
    wait_for(lambda: c.metric("rlrec_episodes_committed_total") >= n, 90, what="warm-up episodes committed")
    time.sleep(1.0)
    return c.rss_mb()


def _read_dlq(bootstrap: str, topic: str, expected: int, timeout: float = 90) -> tuple[dict[str, Counter], Counter]:
    """{episode id: Counter of event kinds} and Counter of reasons over the whole DLQ (until
    `expected` messages were read, or `timeout`)."""
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"dlq-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            **FAST_GROUP_KAFKA,
        }
    )
    c.subscribe([f"{topic}.dlq"])
    by_key: dict[str, Counter] = {}
    reasons: Counter = Counter()
    n = 0
    deadline = time.time() + timeout
    try:
        while n < expected and time.time() < deadline:
            for m in c.consume(num_messages=10_000, timeout=1.0):
                if m.error():
                    continue
                h = dict(m.headers())
                reasons[h["rlrec-dlq-reason"].decode()] += 1
                by_key.setdefault(m.key().decode(), Counter())[h["rlrec-schema"].decode().split("/")[0]] += 1
                n += 1
        # anything beyond the expected count would be a bug too: read a little longer
        end = time.time() + 3
        while time.time() < end:
            for m in c.consume(num_messages=10_000, timeout=0.5):
                if not m.error():
                    reasons[dict(m.headers())["rlrec-dlq-reason"].decode()] += 1
    finally:
        c.close()
    return by_key, reasons


def _committed_ids(storage: Storage) -> list[str]:
    return [i for e in read_manifest(storage) for i in e.episode_ids]


# ---------------------------------------------------------------------------------------------


@pytest.mark.system  # a consumer process through 100k open episodes: minutes on 2 cores
def test_100k_open_episodes_against_a_20k_cap(broker, topic, tmp_path, recorder_config):
    output = str(tmp_path / "out")
    cfg = recorder_config(output, max_open_episodes=CAP)
    cmd = [*_consume_cmd(cfg), "--max-open-episodes", str(CAP), "--max-episodes-per-file", "5000"]
    ev = RawEvents()
    c = ConsumerProcess(cmd, tmp_path / "consumer.log")
    try:
        rss0 = _warm_up(c, broker.bootstrap_servers, topic, ev)
        ids = [f"open-{i:06d}" for i in range(OPEN)]
        p = _producer(broker.bootstrap_servers)
        t0 = time.time()
        for eid in ids:  # each episode: a start and its first step, then nothing for a while
            _produce(p, topic, eid, ev.encode(ev.start, eid), START_H)
            _produce(p, topic, eid, ev.encode(ev.first, eid), STEP_H)
        assert p.flush(60) == 0
        produce_s = time.time() - t0
        evicted = OPEN - CAP
        # an eviction frees memory at once (start and first step dead-lettered) and is written
        # to the log as a decision (an EpisodeAbort), so a replay ends the episode the same way
        wait_for(
            lambda: c.metric('rlrec_dead_letters_total{reason="capacity"}') >= 2 * evicted,
            180,
            interval=1,
            what="evictions of everything over the cap",
        )
        assert c.metric("rlrec_open_episodes") == CAP
        assert c.metric('rlrec_decisions_total{reason="capacity"}') == evicted
        for eid in ids:  # every episode finishes: the 20k still open commit, the rest are dead letters
            _produce(p, topic, eid, ev.encode(ev.last, eid), STEP_H)
        assert p.flush(60) == 0
        wait_for(
            lambda: c.metric("rlrec_episodes_committed_total") >= 20 + CAP,
            180,
            interval=1,
            what="the episodes under the cap committed",
        )
        wait_for(
            lambda: c.metric('rlrec_dead_letters_total{reason="capacity"}') >= 3 * evicted,
            60,
            interval=1,
            what="the evicted episodes' last steps dead-lettered",
        )
        assert c.metric("rlrec_open_episodes") == 0
        assert c.alive(), "the consumer exited"
        peak_mb = c.peak_rss / 2**20
    finally:
        c.stop()
    print(
        f"\nproduced {2 * OPEN:,} events in {produce_s:.1f}s; consumer RSS warm {rss0:.0f} MB, "
        f"peak {peak_mb:.0f} MB (growth {peak_mb - rss0:.0f} MB, budget {RSS_GROWTH_BUDGET_MB} MB)"
    )
    assert peak_mb - rss0 <= RSS_GROWTH_BUDGET_MB

    # nothing vanished: every episode is either committed or (all of its events) dead-lettered
    committed = [i for i in _committed_ids(Storage.from_uri(output)) if i.startswith("open-")]
    assert len(committed) == len(set(committed)) == CAP
    by_key, reasons = _read_dlq(broker.bootstrap_servers, topic, 3 * evicted)
    assert reasons == {"capacity": 3 * evicted}, reasons
    assert set(by_key).isdisjoint(committed) and set(by_key) | set(committed) == set(ids)
    assert all(k == {"EpisodeStart": 1, "StepBatch": 2} for k in by_key.values())


def test_buffered_bytes_budget_holds_while_storage_fails(
    broker, topic, local_s3, monkeypatch, tmp_path, recorder_config
):
    budget = 1_000_000
    episodes, steps = 4000, 20
    bucket = local_s3.create_bucket(f"mem-{uuid.uuid4().hex[:8]}")
    proxy = FaultProxy(local_s3.port)
    for k, v in local_s3.env().items():  # the test reads S3 directly; the consumer through the proxy
        monkeypatch.setenv(k, v)
    output = f"s3://{bucket}/exp"
    cfg = recorder_config(output)
    cmd = [*_consume_cmd(cfg), "--max-buffered-bytes", str(budget), "--max-episodes-per-file", "1000"]
    ev = RawEvents(steps)
    c = ConsumerProcess(cmd, tmp_path / "consumer.log", env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"})
    try:
        rss0 = _warm_up(c, broker.bootstrap_servers, topic, ev)
        proxy.fail_for(6.0)  # every S3 request fails: flushes fail, partitions pause
        p = _producer(broker.bootstrap_servers)
        for i in range(episodes):
            eid = f"ep-{i:05d}"
            _produce(p, topic, eid, ev.encode(ev.start, eid), START_H)
            _produce(p, topic, eid, ev.encode(ev.whole, eid), STEP_H)
        assert p.flush(60) == 0
        wait_for(lambda: c.metric("rlrec_flush_failures_total") > 0, 30, what="a failed flush")
        wait_for(
            lambda: c.metric("rlrec_episodes_committed_total") >= 20 + episodes,
            120,
            interval=1,
            what="everything committed after the outage",
        )
        wait_for(lambda: c.metric("rlrec_paused_partitions") == 0, 30, what="partitions resumed")
        assert c.alive(), "the consumer exited"
        peak_mb = c.peak_rss / 2**20
    finally:
        c.stop()
        proxy.close()
    samples = c.samples
    max_buffered = max(s.get("rlrec_buffered_bytes", 0) for s in samples)
    max_paused = max(s.get("rlrec_paused_partitions", 0) for s in samples)
    # one consume call (<= 1000 messages: 500 episodes here) is applied before the budget is
    # checked again, so the bound is the budget plus one such batch
    episode_bytes = 512 + 8 + 16 * (steps + 1) + 8 * steps * 2 + 4 * steps + 8 * (steps + 1)
    print(
        f"\nbuffered bytes max {max_buffered:,.0f} (budget {budget:,}, {episodes * episode_bytes:,} produced); "
        f"paused partitions max {max_paused:.0f}; RSS warm {rss0:.0f} MB, peak {peak_mb:.0f} MB"
    )
    timeline = [
        (
            s.get("rlrec_buffered_bytes"),
            s.get("rlrec_paused_partitions"),
            s.get("rlrec_flush_failures_total"),
            s.get("rlrec_episodes_committed_total"),
        )
        for s in samples
    ]
    assert max_paused > 0, "no partition was paused while the storage failed"
    assert 0 < max_buffered <= budget + 500 * episode_bytes, f"(buffered, paused, failures, committed): {timeline}"
    assert max_buffered < episodes * episode_bytes / 2  # the budget bound, not the data volume
    assert peak_mb - rss0 <= RSS_GROWTH_BUDGET_MB
    got = read_all(Storage.from_uri(output))  # no episode in two shards
    assert {i for i in got if i.startswith("ep-")} == {f"ep-{i:05d}" for i in range(episodes)}
