"""Which partitions the consumer owns and reads: the rebalance callbacks (claim on assign, flush and
commit on revoke, nothing on loss), claims retried from the loop, and pausing and resuming a
partition for named reasons (a part of `rlrec.consumer.service.RecorderConsumer`).
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import Consumer, KafkaException, TopicPartition

from rlrec.consumer.writer import Compaction, PartitionWriter
from rlrec.store.retry import RetryPolicy

log = logging.getLogger("rlrec.consumer")

#: a claim on assignment, tried in place before the partition is paused and claimed from the loop
CLAIM_RETRY = RetryPolicy(attempts=3, base_delay=0.2, max_delay=1.0)


class PartitionsMixin:
    """Partition ownership and reading (mixed into `RecorderConsumer`)."""

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Claim each partition and read it from where the store says (explicit offsets)."""
        for tp in partitions:
            self._claim(tp.partition)
            start = self._start_offset(tp.partition)
            if start is not None:
                tp.offset = start
        (consumer.incremental_assign if self._incremental else consumer.assign)(partitions)
        for tp in partitions:
            self._sync_pause(tp.partition, self.writers[tp.partition])
        self.metrics.assigned.set(len(self.writers))

    def _claim(self, p: int) -> None:
        w = PartitionWriter(
            self.storage,
            self.config.topic,
            p,
            fmt=self.config.format,
            compression=self.config.compression,
            assembly=self.assembly,
            rotation=self.rotation,
            encoder=self.encoder,
            lease_executor=self.leases,
            watermark_every_s=self.config.commit_interval_s,
            counters=self.metrics.assembly,
            compaction=Compaction(self.config.compact_after_s, self.config.max_file_bytes)
            if self.config.compact_after_s > 0
            else None,
        )
        self.writers[p] = w
        for attempt in range(CLAIM_RETRY.attempts):
            try:
                self._claim_writer(w)
                return
            except Exception as e:  # storage unavailable: retried from the loop, partition paused
                log.warning("partition %d: claim failed (%s), attempt %d", p, e, attempt + 1)
                time.sleep(CLAIM_RETRY.delay(attempt))
        log.error("partition %d: could not claim; paused until a claim succeeds", p)
        w.unclaimed(5.0)

    def _claim_writer(self, w: PartitionWriter) -> None:
        """Claim w's partition from the store's position, naming this group and deployment."""
        w.claim(from_store=True, group=self.group_id, deployment=self.deployment, start_at=self._start_at(w.partition))

    def _sync_pause(self, p: int, w: PartitionWriter) -> None:
        """The writer's state decides whether its partition is read."""
        if w.paused:
            self._pause(p, "writer")
        else:
            self._resume(p, "writer")

    def _reclaim(self, p: int, w: PartitionWriter) -> None:
        try:
            self._claim_writer(w)
        except Exception as e:
            log.warning("partition %d: claim failed again (%s)", p, e)
            w.unclaimed(10.0, w.state)
            return
        start = self._start_offset(p)
        if start is None:  # unclaimed again (logged): the next claim tries again
            self._sync_pause(p, w)
            return
        if self._seek(p, start):
            log.info("partition %d: claimed again; replaying from offset %s", p, start)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        now = time.time()
        for tp in partitions:
            if tp.partition in self.writers:
                try:
                    self._flush_partition(tp.partition, force=True, now=now)
                except Exception:
                    log.exception("partition %d: flush on revoke failed; the next owner replays it", tp.partition)
        try:
            if self.dlq is not None:
                self.dlq.flush(10)
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
        self._resume(p, *self._pause_reasons.get(p, ()))
        self._pause_reasons.pop(p, None)
        self._registry_retry.pop(p, None)

    def _pause(self, p: int, reason: str = "requested") -> None:
        """Stop reading partition p for `reason`; it is read again once every reason is resumed."""
        reasons = self._pause_reasons.setdefault(p, set())
        if reasons or self.consumer is None:
            reasons.add(reason)
            return
        try:
            self.consumer.pause([TopicPartition(self.config.topic, p)])
            reasons.add(reason)
        except KafkaException as e:
            log.warning("pause of partition %d failed: %s", p, e)

    def _resume(self, p: int, *reasons: str) -> None:
        current = self._pause_reasons.get(p)
        if not current or not current.intersection(reasons):
            return
        current.difference_update(reasons)
        if not current and self.consumer is not None:
            try:
                self.consumer.resume([TopicPartition(self.config.topic, p)])
            except KafkaException as e:
                log.warning("resume of partition %d failed: %s", p, e)
