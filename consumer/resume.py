"""Where a partition resumes: the store decides, not the consumer group.

A consumer resumes each partition it is assigned from the **store's position**, the largest
``resume_offset`` of the partition's shard entries (`PartitionLog.resume_offset`: the offset
its writer would have committed to Kafka once that shard was committed). The group's offsets
are still committed, for lag tools, but never read: a group whose offsets ran ahead of this
store (another output consumed with the same group id, a restored or re-created store, a
reset group) would otherwise leave a silent gap in it (docs/GUARANTEES.md §8, "Replay").

Where the store has no position for a partition:

* the log holds shards written before manifest format 3 (no positions yet): read from the
  topic's earliest offset, skipping every committed episode (the claim loads all their ids);
* the log holds no shard (a new store, or a partition it never had): ``--start-from``
  (``earliest``, the default, or ``latest``).

A position below the topic's earliest retained offset is a gap: the consumer refuses it with
one line (`GapError`) unless ``--accept-gap`` says to read on from the earliest offset.
"""

from __future__ import annotations

import hashlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, KafkaException, TopicPartition

from rlrec.errors import RuntimeFailure
from rlrec.store.manifest import ClaimEntry
from rlrec.store.storage import Storage

__all__ = [
    "GapError",
    "ResumeFromStore",
    "Start",
    "default_deployment",
    "default_group_id",
    "foreign_writers",
    "gap",
    "start_of",
]

log = logging.getLogger("rlrec.consumer")

#: how long a partition whose start cannot be told waits for its next claim
START_RETRY_S = 10.0


class GapError(RuntimeFailure):
    """The store resumes a partition at an offset the topic no longer holds (exit code 1)."""


@dataclass(frozen=True)
class Start:
    """Where a claimed partition is read from: `offset` (a Kafka offset, or the logical
    ``OFFSET_BEGINNING`` / ``OFFSET_END``) and why (for the log line)."""

    offset: int
    why: str

    @property
    def position(self) -> int | None:
        """The store's position this start is (None: a logical offset)."""
        return self.offset if self.offset >= 0 else None


def default_group_id(storage: Storage) -> str:
    """The consumer group of an output when ``--group-id`` is not given: derived from what
    names the store (`Storage.location`: kind, bucket and prefix; ``/d``, ``./d`` and
    ``file:///d`` give the same group, so do ``az://`` and ``abfs://``, whatever the query
    parameters), so two outputs never share a group by default.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> default_group_id(Storage.from_uri(d)) == default_group_id(Storage.from_uri("file://" + d))
        True
        >>> default_group_id(Storage.from_uri(d)).startswith("rlrec-")
        True
    """
    return f"rlrec-{hashlib.sha256(storage.location().encode()).hexdigest()[:16]}"


def default_deployment() -> str:
    """The deployment name a writer records in its claims without ``--deployment``: the host."""
    name = "".join(c for c in socket.gethostname() if c.isprintable())[:255]
    return name or "unknown-host"


def start_of(position: int | None, has_shards: bool, start_from: str) -> Start:
    """Where a partition is read from after its claim.

    Args:
        position: the store's position for the partition (`PartitionLog.resume_offset`).
        has_shards: whether its log holds any shard entry (`PartitionLog.max_last_offset >= 0`).
        start_from: ``earliest`` or ``latest`` (``--start-from``), for a partition the store has
            never written.

    Example:
        >>> start_of(120, True, "latest").offset, start_of(None, False, "earliest").offset == OFFSET_BEGINNING
        (120, True)
    """
    if position is not None:
        if not has_shards:
            return Start(position, "where --start-from put it when the store first claimed the partition")
        return Start(position, "the store's position")
    if has_shards:
        return Start(
            OFFSET_BEGINNING,
            "the earliest offset: the store's shards carry no position (written before manifest format 3); "
            "committed episodes are skipped",
        )
    if start_from == "latest":
        return Start(OFFSET_END, "the latest offset: the store has nothing from this partition (--start-from latest)")
    return Start(
        OFFSET_BEGINNING, "the earliest offset: the store has nothing from this partition (--start-from earliest)"
    )


def gap(topic: str, partition: int, position: int, earliest: int) -> str:
    """The one line that refuses a gap: the store resumes at `position`, the topic's earliest
    retained offset is `earliest` (> `position`).

    Example:
        >>> gap("rl", 3, 100, 250)  # doctest: +ELLIPSIS
        'rl/3: the store resumes at offset 100 but the topic keeps offsets from 250 on: 150 offsets ...'
    """
    return (
        f"{topic}/{partition}: the store resumes at offset {position} but the topic keeps offsets from {earliest} on: "
        f"{earliest - position} offsets are gone and their episodes would be missing from this store; "
        "restore the store that holds them, or start with --accept-gap to read on from the earliest offset"
    )


def foreign_writers(claims: list[ClaimEntry], group: str) -> str | None:
    """A warning naming the other consumer groups whose writers claimed this partition's log
    recently (`PartitionLog.recent_claims`), or None. Two groups writing one store keep
    exactly-once (each claim fences the other), but each takes the partition from the other.

    Example:
        >>> c = ClaimEntry(seq=4, epoch=2, writer="h:1:u", group="g2", deployment="blue")
        >>> foreign_writers([c], "g1")  # doctest: +ELLIPSIS
        "another consumer group writes this partition: group 'g2' (deployment 'blue', writer h:1:u, epoch 2 at seq 4); ..."
    """
    newest: dict[str, ClaimEntry] = {}
    for c in claims:
        if c.group is not None and c.group != group:
            newest[c.group] = c
    if not newest:
        return None
    named = "; ".join(
        f"group {g!r} (deployment {c.deployment!r}, writer {c.writer}, epoch {c.epoch} at seq {c.seq})"
        for g, c in sorted(newest.items())
    )
    return (
        f"another consumer group writes this partition: {named}; each claim takes the partition from the other. "
        "Run one --group-id per --output (the default group is derived from the output)"
    )


class ResumeFromStore:
    """The consumer's side of resuming from the store (mixed into `RecorderConsumer`, whose
    state it uses: ``config``, ``consumer``, ``writers``, ``group_id``, ``_refused``, ``_pause``,
    ``_sync_pause``, ``stop``): where a claimed partition is read from, and what a position the
    topic does not hold does."""

    config: Any
    consumer: Any
    storage: Storage
    writers: dict[int, Any]
    group_id: str
    _refused: GapError | None

    def _start_offset(self, p: int) -> int | None:
        """Where partition p is read from after its claim (None: not claimed, or it cannot be
        said: then the writer is unclaimed and its partition paused until a later claim): the
        store's position, else `--start-from` (`rlrec.consumer.resume.start_of`); a position
        the topic no longer holds is refused (or, with --accept-gap, skipped). Never raises:
        it runs in the rebalance callback."""
        w = self.writers.get(p)
        if w is None or w.assembler is None:
            return None
        try:
            offset = self._where_to_start(p, w)
            TopicPartition(self.config.topic, p, offset)  # what the Kafka client cannot hold is refused here
        except Exception as e:  # a broker or storage failure, or a position no Kafka offset can be
            log.error(
                "partition %d: cannot tell where to read it (%s: %s); claiming again in %.0f s",
                p,
                type(e).__name__,
                str(e)[:200],
                START_RETRY_S,
            )
            w.unclaimed(START_RETRY_S)
            return None
        return offset

    def _where_to_start(self, p: int, w: Any) -> int:
        lg = w.committer.log
        has_shards = lg.max_last_offset >= 0
        start = start_of(w.replay_from, has_shards, self.config.start_from)
        warning = foreign_writers(lg.recent_claims(), self.group_id)
        if warning:
            log.warning("partition %d: %s", p, warning)
        offset = start.offset
        # the first offset the store needs; a log written before format 3: past its newest shard
        needed = start.position if start.position is not None or not has_shards else lg.max_last_offset + 1
        if needed is not None:
            earliest = self._low_watermark(p)
            if earliest is not None and earliest > needed:
                offset = self._gap(p, needed, earliest)
            elif earliest is not None and offset == OFFSET_BEGINNING:
                offset = earliest
        if offset >= 0:  # read from here: until a message comes, the offset to commit (for lag tools)
            w.assembler.next_offset = offset
            log.info("partition %d: reading from offset %d (%s)", p, offset, start.why)
        else:
            where = "earliest" if offset == OFFSET_BEGINNING else "latest"
            log.info("partition %d: reading from the %s offset (%s)", p, where, start.why)
        return offset

    def _start_at(self, p: int) -> Callable[[], int]:
        """What a claim asks, only when the store holds nothing of partition p (no shard, no
        position), for where it starts; recorded in the claim as the partition's position, so
        that a restart or rebalance before its first shard starts there too (with ``latest``,
        not at a later end; with ``earliest``, a trimmed topic is then seen as a gap):

        * ``--start-from latest``: the partition's end now;
        * ``--start-from earliest``: the topic's earliest retained offset -- or 0 where the
          store already holds shards (a restored store missing this partition, a partition
          whose first claim came late): the store should hold the partition from its start,
          so offsets retention removed are a gap, refused in one line (or --accept-gap)."""

        def start() -> int:
            latest = self.config.start_from == "latest"
            at = self._watermarks(p)[1] if latest else self._low_watermark(p)
            if at is None or at < 0:  # raised: the claim fails and is tried again
                raise RuntimeFailure(f"partition {p}: the broker does not say where the partition starts or ends")
            if not latest and at > 0 and self._store_holds_shards():
                return 0
            return at

        return start

    def _store_holds_shards(self) -> bool:
        """Whether any shard was ever written to this store (a policy directory exists)."""
        return any(f.is_dir and not f.name.startswith("_") for f in self.storage.list(""))

    def _watermarks(self, p: int) -> tuple[int, int]:
        """The broker's (earliest retained, end) offsets of partition p; raises KafkaException."""
        return self.consumer.get_watermark_offsets(TopicPartition(self.config.topic, p), timeout=5, cached=False)

    def _low_watermark(self, p: int) -> int | None:
        """The topic's earliest retained offset of partition p (None: the broker does not say)."""
        try:
            return self._watermarks(p)[0]
        except KafkaException as e:
            log.warning("partition %d: the earliest retained offset is not available (%s)", p, e)
            return None

    def _gap(self, p: int, position: int, earliest: int) -> int:
        """The store resumes p at `position`, the topic starts at `earliest`: refused (the
        consumer stops, `run` raises GapError) unless --accept-gap; returns where to read."""
        if not self.config.accept_gap:
            self._refuse(p, gap(self.config.topic, p, position, earliest))
            return position
        log.warning(
            "partition %d: --accept-gap: %d offsets (%d..%d) skipped", p, earliest - position, position, earliest - 1
        )
        return earliest

    def _refuse(self, p: int, line: str) -> None:
        """Stop: partition p cannot be read without a gap in the store (`run` raises GapError)."""
        if self._refused is None:
            self._refused = GapError(line)
            log.error("%s", line)
        self._pause(p, "gap")
        self.stop()

    def _out_of_range(self, p: int) -> None:
        """The broker says the offset being read is not in the topic (auto.offset.reset=error):
        retention passed it, or the topic is behind the store (re-created)."""
        w = self.writers.get(p)
        if w is None or w.assembler is None:
            return  # not claimed: its claim seeks
        at = w.assembler.next_offset if w.assembler.next_offset is not None else w.replay_from
        earliest = self._low_watermark(p)
        if at is not None and earliest is not None and earliest > at:
            offset = self._gap(p, at, earliest)
            if offset != at:
                self._seek(p, offset)
        elif at is not None and earliest is not None:
            self._refuse(
                p,
                f"{self.config.topic}/{p}: the store resumes at offset {at}, past the topic's end: was the topic "
                "re-created? Use a new --output for a new topic",
            )
        else:
            log.error("partition %d: the offset read is out of the topic's range; claiming again", p)
            w.unclaimed(5.0)
            self._sync_pause(p, w)

    def _seek(self, p: int, offset: int) -> bool:
        """Seek partition p to `offset`; if that fails (reading on would skip or repeat events)
        the writer is unclaimed, and its claim seeks to the store's position. False then."""
        w = self.writers.get(p)
        try:
            self.consumer.seek(TopicPartition(self.config.topic, p, offset))
        except KafkaException as e:
            log.warning("partition %d: seek to %d failed (%s); replaying from the store's position", p, offset, e)
            if w is not None:
                w.unclaimed(1.0)
                self._sync_pause(p, w)
            return False
        if w is not None:
            self._sync_pause(p, w)
        return True
