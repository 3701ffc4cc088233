"""The consumer service: Kafka transitions -> exactly-once episode shards.

One process consumes the transitions topic in a consumer group; partitions are the unit of
parallelism. The loop:

    poll a batch of messages
      -> decode -> the partition's assembler (in offset order); what cannot be used is a dead letter
    maintenance, every iteration:
      1. time out idle open episodes; evict the longest-idle ones over max_open_episodes or
         max_open_bytes
      2. flush partitions whose ready episodes hit a rolling limit (count, bytes, age) or when
         finished-but-unwritten bytes exceed the budget; a failing flush pauses its partition
         and is retried with backoff
      3. commit offsets: for each partition, the one its writer hands out
         (`PartitionWriter.offset_to_commit`: step 5 of the commit protocol)

Data errors and infrastructure errors are handled apart (docs/GUARANTEES.md, "Poison messages"):

* data -- anything raised because of what a message or an episode holds, while decoding,
  applying, building or encoding it: caught at the narrowest scope, the message (or, once an
  episode is known to be bad, every event of that episode) is dead-lettered with a reason and the
  consumer goes on. `internal` (with the exception class in the detail) is the last resort.
* infrastructure -- storage errors, an unreachable or failing schema registry, a dead-letter
  topic that does not acknowledge: never dead-lettered; the partition is paused (storage,
  registry) or its offset held back (DLQ), retried with backoff, counted, logged, and shown by
  /healthz once it lasts.

Rebalances: on revoke, ready episodes are flushed and offsets committed before the partition
goes; on assign, the partition's manifest log is claimed (new writer epoch: any zombie is fenced)
and the partition is read from the store's position (`rlrec.consumer.resume`), never from the
group's committed offset.
SIGTERM/SIGINT: flush every finished episode, wait for dead-letter acknowledgements, commit,
leave the group.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from rlrec.consumer.assembly import AssemblyConfig, DeadLetter
from rlrec.consumer.config import ConsumerConfig
from rlrec.consumer.dead_letters import DeadLetterQueue
from rlrec.consumer.metrics import ConsumerMetrics
from rlrec.consumer.resume import GapError, ResumeFromStore, default_deployment, default_group_id
from rlrec.consumer.service_bounds import MAX_PENDING_DEAD_LETTER_BYTES, MemoryBoundsMixin
from rlrec.consumer.service_letters import DeadLettersMixin
from rlrec.consumer.service_partitions import CLAIM_RETRY, PartitionsMixin
from rlrec.consumer.summary import ProgressLog
from rlrec.consumer.topics import check_reachable, client_settings, create_topics, describe_kafka_error, kafka_logger
from rlrec.consumer.writer import PartitionWriter, Rotation
from rlrec.errors import UsageError
from rlrec.producer.events import DecodeError
from rlrec.producer.multi_agent_events import decode_event
from rlrec.producer.registry import RegistryUnavailable
from rlrec.store.episodes import import_episode_classes
from rlrec.store.retry import RetrySchedule
from rlrec.store.storage import Storage, StorageError, require_conditional_writes

__all__ = ["CLAIM_RETRY", "FAST_FAILOVER_KAFKA", "MAX_PENDING_DEAD_LETTER_BYTES", "ConsumerConfig", "RecorderConsumer"]

log = logging.getLogger("rlrec.consumer")

#: consumer settings for fast failover, the documented defaults (override with kafka_config).
FAST_FAILOVER_KAFKA = {
    "session.timeout.ms": 6000,  # a dead consumer's partitions move after ~6 s
    "heartbeat.interval.ms": 1500,  # must stay well below the session timeout
    "topic.metadata.refresh.interval.ms": 5000,  # see new partitions/topics quickly
    "max.poll.interval.ms": 300000,
}

#: /healthz turns 503 once a failure (storage, registry, DLQ deliveries) lasts this long
UNHEALTHY_AFTER_S = 60.0
#: messages asked of one consume() call
POLL_BATCH = 1000
#: how long one consume() call waits for messages; while a shard is being encoded the loop polls
#: more often, so the shard is committed (and the next one started) soon after it is encoded
POLL_TIMEOUT_S = 0.2
#: the longest the start waits for the broker (shorter with run(max_seconds=...))
STARTUP_TIMEOUT_S = 30.0
POLL_TIMEOUT_ENCODING_S = 0.05
#: a partition is read live when its newest message read is at most this old (or none came):
#: only then does idle time count toward episode timeouts (a backlog or an outage never ends an
#: episode early)
LIVE_LAG_S = 10.0
#: how often the topic's partition count is checked
PARTITION_CHECK_S = 30.0
#: a transport error from the broker makes every partition "not live" for this long
BROKER_TROUBLE_S = 10.0


def startup_timeout(max_seconds: float | None) -> float:
    """How long the start waits for the broker: :data:`STARTUP_TIMEOUT_S`, or less when the run
    itself is shorter (`max_seconds`), at least 1 s.

    Example:
        >>> startup_timeout(None), startup_timeout(3), startup_timeout(0.1)
        (30.0, 3, 1.0)
    """
    return STARTUP_TIMEOUT_S if max_seconds is None else max(1.0, min(STARTUP_TIMEOUT_S, max_seconds))


class RecorderConsumer(PartitionsMixin, DeadLettersMixin, MemoryBoundsMixin, ResumeFromStore):
    """Consumes rlrec events and commits every finished episode to exactly one shard.

    Guarantees (docs/GUARANTEES.md): the committed Kafka offset of a partition never passes the
    first event of an episode that is not in a committed shard, nor a dead letter the broker has
    not acknowledged, so a crash at any point loses nothing; replay skips episodes the manifest
    already holds, so nothing is committed twice; a writer whose partition moved is fenced by
    the new owner's epoch claim. No message can stop the process, a partition or the group: what
    cannot be used goes to the dead-letter topic with a reason, and the consumer keeps running.
    """

    #: /healthz turns 503 once a failure lasts this long
    unhealthy_after_s = UNHEALTHY_AFTER_S

    def __init__(self, config: ConsumerConfig, storage: Storage | None = None):
        self.config = config
        self.storage = storage or Storage.from_uri(config.output)
        self.assembly = AssemblyConfig(
            reward_join_window_s=config.reward_join_window_s,
            episode_timeout_s=config.episode_timeout_s,
            on_timeout=config.on_timeout,
            validate_spaces=config.validate_spaces,
            max_episode_bytes=config.max_episode_bytes,
            on_episode_too_large=config.on_episode_too_large,
        )
        self.rotation = Rotation(config.max_episodes_per_file, config.max_file_bytes, config.max_file_age_s)
        #: the consumer group, by default one per output (`rlrec.consumer.resume.default_group_id`)
        self.group_id = config.group_id or default_group_id(self.storage)
        self.deployment = config.deployment or default_deployment()
        self._refused: GapError | None = None  # a gap refused: run() raises it once shut down
        self._incremental = False  # a cooperative assignment strategy (--kafka-config): incremental_assign
        self.writers: dict[int, PartitionWriter] = {}
        # shard encoding (Parquet, zstd, hashing; mostly without the GIL) runs on one thread of
        # its own while the loop polls and assembles, so the second core works (PartitionWriter);
        # started by run(), shut down when it ends (None: writers encode on the loop's thread)
        self.encoder: ThreadPoolExecutor | None = None
        self.leases: ThreadPoolExecutor | None = None  # owner lease renewals, off the polling thread
        self.metrics = ConsumerMetrics()
        self.progress = ProgressLog(self.metrics, config.summary_interval_s, config.max_file_age_s)
        self._stop = threading.Event()
        self._pause_reasons: dict[int, set[str]] = {}  # partition -> why it is paused (empty: reading)
        self._registry_retry: dict[int, RetrySchedule] = {}  # partition -> its reads waiting for the registry
        self._last_commit = 0.0
        self._last_lag = 0.0
        self._newest_ms: dict[int, int] = {}  # partition -> newest message timestamp of the last poll
        self._broker_trouble_at = -1e18
        self._partition_count: int | None = None
        self._poll_at = 0.0  # when the loop's last poll began
        self._last_partition_check = 0.0
        self._split_suspected_until = 0.0
        self.consumer: Consumer | None = None
        self.dlq: DeadLetterQueue | None = None
        self.last_loop_at = time.time()
        self.metrics_port: int | None = None  # the port /metrics is served on, once run() started it
        self.registry = None
        if config.schema_registry_url:
            from rlrec.producer.registry import SchemaRegistry

            self.registry = SchemaRegistry(config.schema_registry_url)

    @property
    def _paused(self) -> set[int]:
        return {p for p, why in self._pause_reasons.items() if why}

    # -- lifecycle ----------------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self, max_seconds: float | None = None, install_signals: bool = True) -> None:
        cfg = self.config
        if install_signals and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        # before anything else: no fencing or deduplication without create-once writes
        if not self._probe_store(None if max_seconds is None else time.monotonic() + max_seconds):
            return
        # the clients first: librdkafka checks every --kafka-config property when a client is
        # made (a misspelt one is a usage error), and connects only once a request needs it
        self.consumer, producer = self._make_clients()
        try:
            self._start(max_seconds)
        except BaseException:
            self.consumer.close()
            self.consumer = None
            raise
        self.dlq = DeadLetterQueue(
            producer, cfg.dlq, on_failure=lambda letter, err: self.metrics.dead_letter_failures.inc()
        )
        # RLlib's episode classes are imported here, once, before two threads could race to
        # import them (an import error in the encoding thread would look like bad data)
        import_episode_classes()
        self.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlrec-encode")
        self.leases = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlrec-lease")
        self.consumer.subscribe(
            [cfg.topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )
        deadline = None if max_seconds is None else time.time() + max_seconds
        try:
            while not self._stop.is_set() and (deadline is None or time.time() < deadline):
                encoding = any(w.encoding for w in self.writers.values())
                timeout = POLL_TIMEOUT_ENCODING_S if encoding else POLL_TIMEOUT_S
                self._poll_at = time.time()
                msgs = self.consumer.consume(num_messages=POLL_BATCH, timeout=timeout)
                self._newest_ms = {}
                held: set[int] = set()  # partitions told to re-read from a message (registry down)
                for m in msgs:
                    if m.error() is None:
                        self._newest_ms[m.partition()] = m.timestamp()[1]
                    if m.partition() not in held and not self._on_message(m):
                        held.add(m.partition())
                self._maintain(time.time())
                self.last_loop_at = time.time()
        finally:
            self._shutdown()
        if self._refused is not None:
            raise self._refused

    def _start(self, max_seconds: float | None) -> None:
        """Topics (created, or checked with --no-create-topics) and the metrics server."""
        cfg = self.config
        # a broker that cannot be reached ends the command within its time (one line, exit 1)
        startup_s = startup_timeout(max_seconds)
        if cfg.create_topics:
            seen = create_topics(
                cfg.bootstrap_servers,
                {cfg.topic: cfg.partitions, cfg.dlq: cfg.partitions},
                timeout=startup_s,
                client_config=client_settings(cfg.kafka_config),
            )
            log.info("topics ready: %s", ", ".join(f"{t} ({n} partitions)" for t, n in seen.items()))
        else:
            md = check_reachable(cfg.bootstrap_servers, startup_s, client_settings(cfg.kafka_config))
            if cfg.topic not in md.topics:
                log.warning(
                    "topic %s does not exist (--no-create-topics): nothing to consume until it is created "
                    "(rlrec topics create --topic %s --partitions N)",
                    cfg.topic,
                    cfg.topic,
                )
        if cfg.metrics_port is not None:
            port = self.metrics.serve(cfg.metrics_port, healthy=self.health, host=cfg.metrics_host)
            self.metrics_port = port
            log.info("metrics on http://127.0.0.1:%d/metrics (and /healthz)", port)

    def _make_clients(self) -> tuple[Consumer, Producer]:
        """The group consumer and the dead-letter producer; UsageError (exit 2) naming the
        property when librdkafka refuses a setting."""
        cfg = self.config
        conf = {
            "bootstrap.servers": cfg.bootstrap_servers,
            "group.id": self.group_id,
            "enable.auto.commit": False,
            "partition.assignment.strategy": "range",
            "fetch.message.max.bytes": cfg.max_message_bytes,
            "queued.max.messages.kbytes": 65536,  # the prefetch queue: part of the memory bound
            **FAST_FAILOVER_KAFKA,
            **cfg.kafka_config,
            # a position the topic does not hold is an error (`_out_of_range`), never a silent jump
            "auto.offset.reset": "error",
            # a partition read to its end says so: until a fetch answered it has no watermark
            "enable.partition.eof": True,
            "logger": kafka_logger(),
        }
        if "auto.offset.reset" in cfg.kafka_config:
            log.warning(
                "--kafka-config auto.offset.reset=%s is overridden: the output store says where each partition "
                "is read from (--start-from for partitions it holds nothing of)",
                cfg.kafka_config["auto.offset.reset"],
            )
        log.info("consumer group %s, deployment %s, output %s", self.group_id, self.deployment, self.storage.uri())
        self._incremental = "cooperative" in str(conf["partition.assignment.strategy"])
        try:
            consumer = Consumer(conf)
        except (KafkaException, ValueError, TypeError) as e:
            raise UsageError(f"--kafka-config: {describe_kafka_error(e)} (see librdkafka's CONFIGURATION.md)") from e
        try:
            producer = Producer(
                {
                    "bootstrap.servers": cfg.bootstrap_servers,
                    "enable.idempotence": True,
                    "acks": "all",
                    "linger.ms": 5,
                    "queue.buffering.max.kbytes": 65536,  # librdkafka's copy of pending dead letters: bounded
                    **client_settings(cfg.kafka_config),
                    "logger": kafka_logger(),
                }
            )
        except (KafkaException, ValueError, TypeError) as e:
            consumer.close()
            raise UsageError(f"--kafka-config: {describe_kafka_error(e)} (see librdkafka's CONFIGURATION.md)") from e
        return consumer, producer

    def _shutdown(self) -> None:
        log.info("shutting down: flushing finished episodes, delivering dead letters, committing offsets")
        try:
            for p in list(self.writers):
                self._flush_partition(p, force=True, now=time.time())
        except Exception:
            log.exception("final flush failed; uncommitted episodes will be replayed")
        if self.dlq is not None and not self.dlq.flush(10):
            # their source offsets are not committed past (see _commit): they come again
            log.error("%d dead letters unacknowledged at shutdown; they will be produced again", len(self.dlq.pending))
        try:
            self._commit(force=True)
        except Exception:
            log.exception("final commit failed; uncommitted episodes will be replayed")
        else:
            for w in self.writers.values():  # every finished episode is committed: free the partitions
                w.release_lease()
        try:
            self.consumer.close()  # leaves the group
        except Exception:
            log.exception("consumer close failed")
        if self.dlq is not None:
            self.dlq.close()
        if self.encoder is not None:  # what is left belonged to dropped partitions
            self.encoder.shutdown(wait=True, cancel_futures=True)
            self.encoder = None
        if self.leases is not None:
            self.leases.shutdown(wait=False, cancel_futures=True)
            self.leases = None
        self.metrics.stop()
        log.info("%s", self.summary())

    def summary(self) -> str:
        """What this consumer committed since it started, in one line, e.g. ``committed 120
        episodes (4,310 steps) in 3 shards (1.2 MiB); 2 dead letters``."""

        def total(counter: Any) -> int:
            return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")))

        m = self.metrics
        size = total(m.bytes_committed)
        return (
            f"committed {total(m.episodes_committed):,} episodes ({total(m.steps_committed):,} steps) in "
            f"{total(m.shards_committed):,} shards ({size / 2**20:.1f} MiB); {total(m.dead_letters):,} dead letters"
        )

    def _probe_store(self, deadline: float | None) -> bool:
        """Check that the output store enforces create-once writes (`ConditionalWritesError`, a
        configuration error, if it does not). A store that cannot be reached is infrastructure:
        probed again with the background backoff until it answers; False if stopped (or past
        `deadline`) meanwhile."""
        retry = RetrySchedule()
        while True:
            try:
                require_conditional_writes(self.storage, allow_unfenced=self.config.allow_unfenced_storage)
                return True
            except StorageError as e:
                wait = retry.failed(time.monotonic())
                log.warning("output store unreachable at start (%s); probing again in %.1fs", e, wait)
            if (deadline is not None and time.monotonic() + wait >= deadline) or self._stop.wait(wait):
                return False

    def health(self) -> tuple[bool, str]:
        """(ok, reason): not ok once the loop stalls or a failure lasts `unhealthy_after_s`."""
        now = time.time()
        problems = []
        if now - self.last_loop_at >= self.unhealthy_after_s:
            problems.append(f"the consumer loop has not run for {now - self.last_loop_at:.0f}s")
        for p, w in self.writers.items():
            if w.failing_since is not None and now - w.failing_since >= self.unhealthy_after_s:
                problems.append(f"partition {p}: flush failing for {now - w.failing_since:.0f}s (storage)")
        mono = time.monotonic()
        for p, retry in self._registry_retry.items():
            if mono - retry.since >= self.unhealthy_after_s:
                problems.append(f"partition {p}: schema registry unavailable for {mono - retry.since:.0f}s")
        failing = self.dlq.oldest_failure() if self.dlq is not None else None
        if failing is not None and mono - failing.retry.since >= self.unhealthy_after_s:
            problems.append(
                f"dead letters not acknowledged for {mono - failing.retry.since:.0f}s "
                f"({len(self.dlq.pending)} pending; {failing.last_error})"
            )
        return (not problems, "; ".join(problems) or "ok")

    # -- messages -----------------------------------------------------------------------------

    def _on_message(self, m: Any) -> bool:
        """Handle one message. False: the partition was told to read again from this message
        (an infrastructure failure); skip its other messages of this batch."""
        err = m.error()
        if err is not None:
            if err.code() == KafkaError._AUTO_OFFSET_RESET:
                self._out_of_range(m.partition())
            elif err.code() == KafkaError._PARTITION_EOF:
                self._reached_end(m.partition(), m.offset())
            else:
                log.warning("consumer error: %s", err)
                if err.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN):
                    self._broker_trouble_at = time.monotonic()  # not live: no timeouts meanwhile
            return True
        p = m.partition()
        w = self.writers.get(p)
        if w is None or w.assembler is None or "registry" in self._pause_reasons.get(p, ()):
            return True  # not ours (any more), not claimed, or waiting for the registry: read again later
        a = w.assembler
        a.fetched = True
        offset = m.offset()
        value = m.value()
        self.metrics.bytes_in.inc(len(value) if value else 0)
        try:
            event = decode_event(
                value, m.headers(), max_bytes=self.config.max_message_bytes, registry=self.registry, key=m.key()
            )
        except DecodeError as e:  # data
            self._dead_letter(m, DeadLetter(e.reason, e.detail, offset))
            a.next_offset = offset + 1
            return True
        except RegistryUnavailable as e:  # infrastructure: this message again, later
            self._retry_registry(p, offset, e)
            return False
        except Exception as e:  # data that broke the decoder itself: last resort
            self._dead_letter(m, DeadLetter("internal", f"decode: {type(e).__name__}: {e}"[:1000], offset))
            a.next_offset = offset + 1
            return True
        self._registry_ok(p)
        try:
            letters = a.apply(offset, event)
        except Exception as e:  # data that broke assembly: the message and its episode
            detail = f"apply: {type(e).__name__}: {e}"[:1000]
            log.exception("partition %d offset %d: %s", p, offset, detail)
            letters = [*a.poison(event.episode_id, offset, "internal", detail), DeadLetter("internal", detail, offset)]
            a.next_offset = offset + 1
        for dl in letters:
            self._dead_letter(m if dl.value is None else None, dl, partition=p)
        return True

    # -- infrastructure: the schema registry ---------------------------------------------------

    def _retry_registry(self, p: int, offset: int, err: Exception) -> None:
        """The registry could not say what a message is: pause the partition, read it again from
        this message after a backoff (`rlrec.store.retry.BACKGROUND`). Never a dead letter."""
        backoff = self._registry_retry.setdefault(p, RetrySchedule()).failed(time.monotonic())
        self.metrics.registry_failures.inc()
        log.warning(
            "partition %d: schema registry unavailable (%s); retrying offset %d in %.1fs", p, err, offset, backoff
        )
        self._pause(p, "registry")
        self._seek(p, offset)

    def _registry_ok(self, p: int) -> None:
        if self._registry_retry.pop(p, None) is not None:
            log.info("partition %d: schema registry answers again", p)

    # -- maintenance --------------------------------------------------------------------------

    def _maintain(self, now: float) -> None:
        """The loop's tick (after poll and apply, before commit): registry retries, claims,
        decisions (timeouts, capacity), writers' ticks, budgets, dead letters, offsets."""
        cfg = self.config
        mono = time.monotonic()
        for p, retry in list(self._registry_retry.items()):
            if retry.due(mono) and "registry" in self._pause_reasons.get(p, ()):
                self._resume(p, "registry")  # read the message again (it stays in _registry_retry until it decodes)
        self._check_partition_count(now)
        broker_ok = mono - self._broker_trouble_at >= BROKER_TROUBLE_S
        for p, w in list(self.writers.items()):
            if w.claim_due(now):
                self._reclaim(p, w)
            a = w.assembler
            if a is None:
                continue
            w.topic_partitions = self._partition_count  # written with the partition's watermark
            newest = self._newest_ms.get(p)
            recent = newest is None or newest / 1000.0 >= now - LIVE_LAG_S
            # read live: a fetch answered since the claim (a message, or the partition's end)
            live = a.fetched and recent and broker_ok and not self._pause_reasons.get(p)
            a.live_since = (a.live_since or now) if live else None
            a.caught_up_at = self._poll_at if live else None  # the partition's watermark with nothing open
            w.publish_pending()  # roll forward committed shards whose publish failed
            w.upkeep(now)  # the owner lease; compaction when due (--compact-after)
            a.split_suspected = now < self._split_suspected_until
            for d in a.decide_timeouts(now):
                self._decide(p, d, a.open[d.episode_id].first_offset)
        self._enforce_capacity()
        total_ready_bytes = sum(w.buffered_bytes for w in self.writers.values())
        over_budget = total_ready_bytes > cfg.max_buffered_bytes
        for p, w in list(self.writers.items()):
            # a tick that commits an encoded shard leaves the encoder idle: the second one
            # starts the next shard at once if it is due
            for _ in range(2):
                if not w.due(now, over_budget, self._first_unacked(p)):
                    break
                self._flush_partition(p, force=False, now=now)
        self._hold_back_over_budget()
        if self.dlq is not None:
            self.dlq.poll()
            self._hold_back_dead_letters()
        self._update_gauges()
        if now - self._last_commit >= cfg.commit_interval_s:
            self._commit()
        if now - self._last_lag >= 10.0:
            self._last_lag = now
            self._report_lag()
        self.progress.tick()

    def _reached_end(self, p: int, offset: int) -> None:
        """A fetch answered that partition `p` ends at `offset` (librdkafka's partition EOF, at
        the position read to). At or after where its claim started reading, the claim has read
        all there was when the fetch answered; with no event read, there was nothing to replay.
        An end before that start is an answer about another claim's reading: ignored."""
        w = self.writers.get(p)
        if w is None or w.assembler is None:
            return
        a = w.assembler
        start = a.next_offset if a.next_offset is not None else w.replay_from
        if start is not None and offset < start:
            return
        a.fetched = True
        if a.next_offset is None:
            a.nothing_to_replay = True

    def _check_partition_count(self, now: float) -> None:
        """Adding partitions re-maps episode keys: parts of open episodes land on other partitions.
        Logged loudly; for two episode timeouts afterwards, unknown-episode dead letters and
        timeouts say `partition-change` (runbook: docs/DEPLOY.md)."""
        if self.consumer is None or now - self._last_partition_check < PARTITION_CHECK_S:
            return
        self._last_partition_check = now
        try:
            md = self.consumer.list_topics(self.config.topic, timeout=5)
            n = len(md.topics[self.config.topic].partitions)
        except (KafkaException, KeyError) as e:
            log.debug("partition count not available: %s", e)
            return
        if self._partition_count is not None and n != self._partition_count:
            log.error(
                "the topic %s changed from %d to %d partitions: episodes open across the change are split "
                "between partitions; their parts are dead-lettered (partition-change). Drain producers before "
                "adding partitions (docs/DEPLOY.md)",
                self.config.topic,
                self._partition_count,
                n,
            )
            self.metrics.partition_count_changes.inc()
            self._split_suspected_until = now + 2 * self.config.episode_timeout_s
        self._partition_count = n

    def _flush_partition(self, p: int, force: bool, now: float) -> None:
        """One writer tick: commit what is ready, then act on the outcome (metrics, dead letters
        for unwritable episodes, the partition paused or resumed as the writer's state says)."""
        w = self.writers.get(p)
        if w is None or w.assembler is None:
            return
        t = w.tick(now, force=force, first_unacked=self._first_unacked(p))
        if t.fenced:
            self.metrics.fenced.inc()
        if t.failed is not None:
            self.metrics.flush_failures.inc()
        for fe, detail in t.unwritable:  # data: these episodes, not the others of the shard
            log.error("partition %d: episode %s cannot be written (%s); dead-lettered", p, fe.episode_id, detail)
            self._dead_letter_finished(p, fe, "unwritable", detail)
            w.dead_lettered([fe.episode_id])  # the DLQ holds the position there until acknowledged
        for f in t.flushed:
            self.metrics.on_commit(f.result, f.seconds, f.episodes)
            self.progress.committed(p, f.result, f.seconds)
        self._sync_pause(p, w)

    def _commit(self, force: bool = False, only: list[int] | None = None) -> None:
        """Commit the offset each partition's writer hands out (step 5: `PartitionWriter.offset_to_commit`)."""
        offsets = []
        for p, w in self.writers.items():
            off = w.offset_to_commit(self._first_unacked(p)) if only is None or p in only else None
            if off is not None:
                offsets.append(TopicPartition(self.config.topic, p, off))
        self._last_commit = time.time()
        if not offsets:
            return
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as e:
            log.warning("offset commit failed: %s", e)
            return
        for tp in offsets:
            w = self.writers.get(tp.partition)
            if w is not None:
                w.offsets_committed(tp.offset)

    def _report_lag(self) -> None:
        """Lag = high watermark - position, where the broker reports watermarks (Tansu's are
        wrong: the figure is informational and nothing depends on it). The watermarks are the
        ones the last fetch responses carried (`cached=True`): asking the broker would block
        the loop (Tansu took 0.4 s per partition)."""
        try:
            tps = self.consumer.position([TopicPartition(self.config.topic, p) for p in self.writers])
            for tp in tps:
                if tp.offset < 0:
                    continue
                _low, high = self.consumer.get_watermark_offsets(tp, cached=True)
                if high >= tp.offset:
                    self.metrics.lag.labels(str(tp.partition)).set(high - tp.offset)
        except KafkaException as e:
            log.debug("lag not available: %s", e)

    def _update_gauges(self) -> None:
        assemblers = [w.assembler for w in self.writers.values() if w.assembler]
        self.metrics.open_episodes.set(sum(len(a.open) for a in assemblers))
        self.metrics.open_bytes.set(sum(a.open_nbytes for a in assemblers))
        self.metrics.buffered_bytes.set(sum(w.buffered_bytes for w in self.writers.values()))
        self.metrics.paused_partitions.set(len(self._paused))
        if self.dlq is not None:
            self.metrics.dead_letters_pending.set(len(self.dlq.pending))
