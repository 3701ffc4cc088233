"""The consumer service: Kafka transitions -> exactly-once episode shards.

One process consumes the transitions topic in a consumer group; partitions are the unit of
parallelism. The loop:

    poll a batch of messages
      -> decode (bad bytes: dead letter) -> the partition's assembler (in offset order)
    maintenance, every iteration:
      1. time out idle open episodes; evict the longest-idle ones over max_open_episodes
      2. flush partitions whose ready episodes hit a rolling limit (count, bytes, age) or when
         finished-but-unwritten bytes exceed the budget; a failing flush pauses its partition
         and is retried with backoff
      3. commit offsets: for each partition, assembler.safe_offset() - after the dead-letter
         producer has delivered everything it was given

Rebalances: on revoke, ready episodes are flushed and offsets committed before the partition
goes; on assign, the partition's manifest log is claimed (new writer epoch: any zombie is fenced).
SIGTERM/SIGINT: flush every finished episode, commit, leave the group.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from rlrec.consumer.assembly import AssemblyConfig, DeadLetter
from rlrec.consumer.metrics import ConsumerMetrics
from rlrec.consumer.topics import client_settings, create_topics, dlq_topic_name
from rlrec.consumer.writer import PartitionWriter
from rlrec.producer.events import DecodeError, decode
from rlrec.store.manifest import FencedError
from rlrec.store.storage import Storage, require_conditional_writes

__all__ = ["FAST_FAILOVER_KAFKA", "ConsumerConfig", "RecorderConsumer"]

log = logging.getLogger("rlrec.consumer")

#: consumer settings for fast failover, the documented defaults (override with kafka_config).
FAST_FAILOVER_KAFKA = {
    "session.timeout.ms": 6000,  # a dead consumer's partitions move after ~6 s
    "heartbeat.interval.ms": 1500,  # must stay well below the session timeout
    "topic.metadata.refresh.interval.ms": 5000,  # see new partitions/topics quickly
    "max.poll.interval.ms": 300000,
}


@dataclass
class ConsumerConfig:
    """Options of `rlrec consume` (names match the CLI flags)."""

    bootstrap_servers: str
    output: str
    topic: str = "rlrec.transitions"
    group_id: str = "rlrec-consumer"
    format: str = "episodes"
    compression: str = "zstd"
    max_episodes_per_file: int = 1000
    max_file_bytes: int = 128 * 1024 * 1024
    max_file_age_s: float = 60.0
    reward_join_window_s: float = 0.0
    episode_timeout_s: float = 600.0
    on_timeout: str = "truncate"
    max_open_episodes: int = 100_000
    on_capacity: str = "dead-letter"  # or "truncate"
    max_buffered_bytes: int = 512 * 1024 * 1024
    dlq_topic: str | None = None
    partitions: int = 8
    create_topics: bool = True
    max_message_bytes: int = 8 * 1024 * 1024
    dlq_max_message_bytes: int = 900_000
    commit_interval_s: float = 5.0
    schema_registry_url: str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    allow_unfenced_storage: bool = False  # run on a store that ignores create-once writes (no fencing)
    kafka_config: dict[str, Any] = field(default_factory=dict)

    @property
    def dlq(self) -> str:
        return self.dlq_topic or dlq_topic_name(self.topic)


class RecorderConsumer:
    """Consumes rlrec events and commits every finished episode to exactly one shard.

    Guarantees (docs/GUARANTEES.md): the committed Kafka offset of a partition never passes the
    first event of an episode that is not in a committed shard, so a crash at any point loses
    nothing; replay skips episodes the manifest already holds, so nothing is committed twice;
    a writer whose partition moved is fenced by the new owner's epoch claim. Events that can't
    be used go to the dead-letter topic with a reason; the consumer keeps running.
    """

    def __init__(self, config: ConsumerConfig, storage: Storage | None = None):
        self.config = config
        self.storage = storage or Storage.from_uri(config.output)
        self.assembly = AssemblyConfig(config.reward_join_window_s, config.episode_timeout_s, config.on_timeout)
        self.writers: dict[int, PartitionWriter] = {}
        self.metrics = ConsumerMetrics()
        self._stop = threading.Event()
        self._paused: set[int] = set()
        self._budget_paused: set[int] = set()  # paused only because max_buffered_bytes is exceeded
        self._committed: dict[int, int] = {}
        self._last_commit = 0.0
        self._last_lag = 0.0
        self.consumer: Consumer | None = None
        self.dlq: Producer | None = None
        self.last_loop_at = time.time()
        self.metrics_port: int | None = None  # the port /metrics is served on, once run() started it
        self.registry = None
        if config.schema_registry_url:
            from rlrec.producer.registry import SchemaRegistry

            self.registry = SchemaRegistry(config.schema_registry_url)

    # -- lifecycle ----------------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self, max_seconds: float | None = None, install_signals: bool = True) -> None:
        cfg = self.config
        # before anything else: no fencing or deduplication without create-once writes
        require_conditional_writes(self.storage, allow_unfenced=cfg.allow_unfenced_storage)
        if install_signals and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        if cfg.create_topics:
            seen = create_topics(
                cfg.bootstrap_servers,
                {cfg.topic: cfg.partitions, cfg.dlq: cfg.partitions},
                client_config=client_settings(cfg.kafka_config),
            )
            log.info("topics ready: %s", ", ".join(f"{t} ({n} partitions)" for t, n in seen.items()))
        if cfg.metrics_port is not None:
            port = self.metrics.serve(
                cfg.metrics_port, healthy=lambda: time.time() - self.last_loop_at < 60, host=cfg.metrics_host
            )
            self.metrics_port = port
            log.info("metrics on http://127.0.0.1:%d/metrics (and /healthz)", port)
        conf = {
            "bootstrap.servers": cfg.bootstrap_servers,
            "group.id": cfg.group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "range",
            "fetch.message.max.bytes": cfg.max_message_bytes,
            **FAST_FAILOVER_KAFKA,
            **cfg.kafka_config,
        }
        self.consumer = Consumer(conf)
        self.dlq = Producer(
            {
                "bootstrap.servers": cfg.bootstrap_servers,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                **client_settings(cfg.kafka_config),
            }
        )
        self.consumer.subscribe(
            [cfg.topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )
        deadline = None if max_seconds is None else time.time() + max_seconds
        try:
            while not self._stop.is_set() and (deadline is None or time.time() < deadline):
                msgs = self.consumer.consume(num_messages=1000, timeout=0.2)
                for m in msgs:
                    self._on_message(m)
                self._maintain(time.time())
                self.last_loop_at = time.time()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        log.info("shutting down: flushing finished episodes and committing offsets")
        try:
            for p in list(self.writers):
                self._flush_partition(p, force=True, now=time.time())
            self._commit(force=True)
        except Exception:
            log.exception("final flush/commit failed; uncommitted episodes will be replayed")
        try:
            self.consumer.close()  # leaves the group
        except Exception:
            log.exception("consumer close failed")
        if self.dlq is not None:
            left = self.dlq.flush(10)
            if left:  # their source offsets were not committed past (see _commit): they come again
                log.error("%d dead letters undelivered at shutdown", left)
            elif hasattr(self.dlq, "close"):  # confluent-kafka >= 2.11: release the client now
                self.dlq.close()
        self.metrics.stop()

    # -- rebalance callbacks ------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        replay_from = self._committed_offsets([tp.partition for tp in partitions])
        for tp in partitions:
            self._claim(tp.partition, replay_from.get(tp.partition))
        self.metrics.assigned.set(len(self.writers))

    def _committed_offsets(self, partitions: list[int]) -> dict[int, int]:
        """The group's committed offsets (0 where none: replay from the start); {} if the broker
        does not answer (the claim then loads every committed episode id)."""
        try:
            tps = self.consumer.committed([TopicPartition(self.config.topic, p) for p in partitions], timeout=10)
        except KafkaException as e:
            log.warning("committed offsets not available (%s); claims load every committed episode id", e)
            return {}
        return {tp.partition: max(tp.offset, 0) for tp in tps if tp.error is None}

    def _claim(self, p: int, replay_from: int | None = None) -> None:
        w = PartitionWriter(
            self.storage,
            self.config.topic,
            p,
            fmt=self.config.format,
            compression=self.config.compression,
            assembly=self.assembly,
        )
        self.writers[p] = w
        for attempt in range(3):
            try:
                w.claim(replay_from)
                return
            except Exception as e:  # storage unavailable: retried from the loop, partition paused
                log.warning("partition %d: claim failed (%s), attempt %d", p, e, attempt + 1)
                time.sleep(0.2 * 2**attempt)
        log.error("partition %d: could not claim; paused until a claim succeeds", p)
        self._unclaimed(p, w)

    def _unclaimed(self, p: int, w: PartitionWriter, retry_in: float = 5.0) -> None:
        """The partition is assigned to us but we hold no claim: read nothing until we claim again,
        then start over from the committed offset."""
        w.assembler = None
        w.next_attempt = time.time() + retry_in
        self._pause(p)

    def _reclaim(self, p: int, w: PartitionWriter) -> None:
        tp = TopicPartition(self.config.topic, p)
        try:
            committed = self.consumer.committed([tp], timeout=10)[0].offset
            w.claim(max(committed, 0))
        except Exception as e:
            log.warning("partition %d: claim failed again (%s)", p, e)
            w.next_attempt = time.time() + 10.0
            return
        tp.offset = committed if committed >= 0 else -2  # OFFSET_BEGINNING
        self._resume(p)
        self.consumer.seek(tp)
        self._committed.pop(p, None)
        log.info("partition %d: claimed again; replaying from offset %s", p, committed)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        now = time.time()
        for tp in partitions:
            if tp.partition in self.writers:
                try:
                    self._flush_partition(tp.partition, force=True, now=now)
                except Exception:
                    log.exception("partition %d: flush on revoke failed; the next owner replays it", tp.partition)
        try:
            self._commit(force=True, only=[tp.partition for tp in partitions])
        except Exception:
            log.exception("commit on revoke failed")
        for tp in partitions:
            self._drop(tp.partition)
        self.metrics.assigned.set(len(self.writers))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:  # someone else may own them already: write nothing, commit nothing
            self._drop(tp.partition)

    def _drop(self, p: int) -> None:
        w = self.writers.pop(p, None)
        if w is not None:
            w.drop()
        # librdkafka keeps a partition's pause across revoke and re-assignment to this consumer:
        # undo it while the partition is still assigned, or once given back it is never read again
        self._resume(p)
        self._committed.pop(p, None)

    # -- messages -----------------------------------------------------------------------------

    def _on_message(self, m: Any) -> None:
        err = m.error()
        if err is not None:
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer error: %s", err)
            return
        p = m.partition()
        w = self.writers.get(p)
        if w is None or w.assembler is None:
            return  # not ours (any more) or not claimed: the owner reads it
        value = m.value()
        self.metrics.bytes_in.inc(len(value) if value else 0)
        try:
            event = decode(value, m.headers(), max_bytes=self.config.max_message_bytes, registry=self.registry)
        except DecodeError as e:
            self._dead_letter(m, DeadLetter(e.reason, e.detail, m.offset()))
            w.assembler.next_offset = m.offset() + 1
            return
        letters = w.assembler.apply(m.offset(), event)
        for dl in letters:
            self._dead_letter(m if dl.value is None else None, dl, partition=p)

    def _dead_letter(self, m: Any | None, dl: DeadLetter, partition: int | None = None) -> None:
        """Send to the DLQ: the original message (m) or a re-encoded event (dl.value)."""
        cfg = self.config
        if m is not None:
            key, value, headers = m.key(), m.value() or b"", list(m.headers() or [])
            partition = m.partition()
        else:
            key, value, headers = dl.key, dl.value, list(dl.headers or [])
        headers += [
            ("rlrec-dlq-reason", dl.reason.encode()),
            ("rlrec-dlq-detail", dl.detail[:1000].encode()),
            ("rlrec-source-topic", cfg.topic.encode()),
            ("rlrec-source-partition", str(partition).encode()),
            ("rlrec-source-offset", str(dl.offset).encode()),
        ]
        if len(value) > cfg.dlq_max_message_bytes:
            headers += [
                ("rlrec-original-length", str(len(value)).encode()),
                ("rlrec-original-sha256", hashlib.sha256(value).hexdigest().encode()),
            ]
            value = value[: cfg.dlq_max_message_bytes]
        while True:
            try:
                self.dlq.produce(cfg.dlq, value, key, headers=headers)
                break
            except BufferError:
                self.dlq.poll(0.1)
        self.dlq.poll(0)
        self.metrics.dead_letters.labels(dl.reason).inc()
        log.debug("dead letter %s at %d/%s: %s", dl.reason, partition, dl.offset, dl.detail)

    # -- maintenance --------------------------------------------------------------------------

    def _maintain(self, now: float) -> None:
        cfg = self.config
        for p, w in list(self.writers.items()):
            if w.assembler is None:
                if now >= w.next_attempt:
                    self._reclaim(p, w)
                continue
            w.publish_pending()  # roll forward committed shards whose publish failed
            for dl in w.assembler.expire(now):
                self._dead_letter(None, dl, partition=p)
        self._enforce_capacity()
        total_ready_bytes = sum(w.assembler.finished_bytes for w in self.writers.values() if w.assembler)
        over_budget = total_ready_bytes > cfg.max_buffered_bytes
        for p, w in list(self.writers.items()):
            a = w.assembler
            if a is None or now < w.next_attempt:
                continue
            ready = a.ready(now)
            if not ready:
                continue
            oldest = min(fe.finished_at for fe in ready)
            if (
                len(ready) >= cfg.max_episodes_per_file
                or a.finished_bytes >= cfg.max_file_bytes
                or now - oldest >= cfg.max_file_age_s
                or over_budget
                or w.failing_since is not None
            ):
                self._flush_partition(p, force=False, now=now)
        self._hold_back_over_budget()
        self._update_gauges()
        if now - self._last_commit >= cfg.commit_interval_s:
            self._commit()
        if now - self._last_lag >= 10.0:
            self._last_lag = now
            self._report_lag()

    def _hold_back_over_budget(self) -> None:
        """Still over max_buffered_bytes after flushing (the storage is failing): read no partition
        until the finished episodes are written; partitions without a failing flush would otherwise
        keep filling memory. Resumes them once under the budget."""
        total = sum(w.assembler.finished_bytes for w in self.writers.values() if w.assembler)
        if total > self.config.max_buffered_bytes:
            for p in self.writers:
                if p not in self._paused:
                    self._pause(p)
                    self._budget_paused.add(p)
        elif self._budget_paused:
            for p in self._budget_paused:
                w = self.writers.get(p)
                if w is not None and w.assembler is not None and w.failing_since is None:
                    self._resume(p)
            self._budget_paused.clear()

    def _enforce_capacity(self) -> None:
        cfg = self.config
        total = sum(len(w.assembler.open) for w in self.writers.values() if w.assembler)
        if total <= cfg.max_open_episodes:
            return
        # the longest-idle open episodes over all partitions, chosen in one pass (one scan per
        # eviction would be quadratic: a burst of 100k new episodes against a 20k cap)
        victims = heapq.nsmallest(
            total - cfg.max_open_episodes,
            (
                (ep.last_event_at, p, eid)
                for p, w in self.writers.items()
                if w.assembler
                for eid, ep in w.assembler.open.items()
            ),
        )
        for _, p, eid in victims:
            for dl in self.writers[p].assembler.evict(eid, truncate=cfg.on_capacity == "truncate"):
                self._dead_letter(None, dl, partition=p)

    def _flush_partition(self, p: int, force: bool, now: float) -> None:
        w = self.writers.get(p)
        if w is None or w.assembler is None:
            return
        a = w.assembler
        ready = a.ready(now, force=force)
        if not ready:
            return
        # respect the rolling limits: several shards if needed
        chunks, cur, cur_bytes = [], [], 0
        for fe in ready:
            if cur and (len(cur) >= self.config.max_episodes_per_file or cur_bytes >= self.config.max_file_bytes):
                chunks.append(cur)
                cur, cur_bytes = [], 0
            cur.append(fe)
            cur_bytes += fe.nbytes()
        chunks.append(cur)
        for chunk in chunks:
            a.hand_out(chunk)
            t0 = time.time()
            try:
                res = w.flush(chunk)
            except FencedError:
                # another consumer claimed the partition: it is moving (or moved) away from us
                log.error("partition %d: fenced by a newer writer; dropping its state", p)
                self.metrics.fenced.inc()
                # claim again only if the group still gives it to us well after a rebalance had
                # time to happen (sooner would fence the rightful owner back and forth)
                self._unclaimed(p, w, retry_in=60.0)
                return
            except Exception as e:
                a.give_back(chunk)
                w.attempts += 1
                backoff = min(30.0, 0.5 * 2 ** min(w.attempts, 6)) * (0.5 + random.random())
                w.next_attempt = time.time() + backoff
                if w.failing_since is None:
                    w.failing_since = time.time()
                log.error("partition %d: flush failed (%s: %s); retry in %.1fs", p, type(e).__name__, e, backoff)
                self.metrics.flush_failures.inc()
                self._pause(p)
                return
            w.attempts = 0
            w.failing_since = None
            self._resume(p)
            self.metrics.on_commit(res, time.time() - t0, chunk)

    def _pause(self, p: int) -> None:
        if p not in self._paused and self.consumer is not None:
            try:
                self.consumer.pause([TopicPartition(self.config.topic, p)])
                self._paused.add(p)
            except KafkaException as e:
                log.warning("pause of partition %d failed: %s", p, e)

    def _resume(self, p: int) -> None:
        if p in self._paused and self.consumer is not None:
            try:
                self.consumer.resume([TopicPartition(self.config.topic, p)])
            except KafkaException as e:
                log.warning("resume of partition %d failed: %s", p, e)
            self._paused.discard(p)

    def _commit(self, force: bool = False, only: list[int] | None = None) -> None:
        """Commit each partition's safe offset, once the DLQ holds everything sent to it."""
        offsets = []
        for p, w in self.writers.items():
            if only is not None and p not in only:
                continue
            if w.assembler is None:
                continue
            off = w.assembler.safe_offset()
            if off is not None and off > self._committed.get(p, -1):
                offsets.append(TopicPartition(self.config.topic, p, off))
        self._last_commit = time.time()
        if not offsets:
            return
        left = self.dlq.flush(30)
        if left:
            log.error("dead-letter producer has %d undelivered messages; not committing offsets", left)
            return
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as e:
            log.warning("offset commit failed: %s", e)
            return
        for tp in offsets:
            self._committed[tp.partition] = tp.offset
            w = self.writers.get(tp.partition)
            if w is not None:
                w.offsets_committed(tp.offset)  # forget committed ids no owner can replay

    def _report_lag(self) -> None:
        """Lag = high watermark - position, where the broker reports watermarks (Tansu's are
        wrong: the figure is informational and nothing depends on it)."""
        try:
            tps = self.consumer.position([TopicPartition(self.config.topic, p) for p in self.writers])
            for tp in tps:
                if tp.offset < 0:
                    continue
                _low, high = self.consumer.get_watermark_offsets(tp, timeout=1.0, cached=False)
                if high >= tp.offset:
                    self.metrics.lag.labels(str(tp.partition)).set(high - tp.offset)
        except KafkaException as e:
            log.debug("lag not available: %s", e)

    def _update_gauges(self) -> None:
        self.metrics.open_episodes.set(sum(len(w.assembler.open) for w in self.writers.values() if w.assembler))
        self.metrics.buffered_bytes.set(sum(w.assembler.finished_bytes for w in self.writers.values() if w.assembler))
        self.metrics.paused_partitions.set(len(self._paused))
