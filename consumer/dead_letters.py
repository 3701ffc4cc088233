"""Dead letters: what the consumer cannot use goes to the dead-letter topic, acknowledged or retried.

The record (docs/GUARANTEES.md, "Dead letters"):

* key: the original key, cut to 1 KiB (then `rlrec-original-key-length` / `-sha256` headers);
* value: the original value, cut to `max_value_bytes` (then `rlrec-original-length` / `-sha256`);
* headers: the original `rlrec-schema` header (the first one; it says how to decode the value),
  every other incoming `rlrec-*` header renamed `original-rlrec-*` and the rest as they were, all
  of them together cut to 1 KiB (then `rlrec-original-headers-length` / `-sha256`); then the
  dead letter's own `rlrec-dlq-reason`, `rlrec-dlq-detail`, `rlrec-source-topic`,
  `rlrec-source-partition`, `rlrec-source-offset` -- the only `rlrec-dlq-*`/`rlrec-source-*`
  headers of the record, whatever the producer sent.

So a record always fits the DLQ producer's `message.max.bytes` (1 MB by default) whatever the
incoming key and headers: a huge key or header costs nothing but its truncation.

`DeadLetterQueue` produces them with a delivery callback and keeps every record until the broker
acknowledged it; a failed delivery is produced again after a backoff, counted and logged, never
dropped. `min_unacked(partition)` is what the consumer's offset commit must not pass.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rlrec.producer.events import MAX_KEY_BYTES, SCHEMA_HEADER
from rlrec.store.retry import RetrySchedule

__all__ = ["DLQ_HEADERS", "MAX_KEY_BYTES", "DeadLetterQueue", "PendingLetter", "dead_letter_record"]

log = logging.getLogger("rlrec.consumer")

MAX_HEADER_BYTES = 1024
#: the headers every dead letter gets (in this order)
DLQ_HEADERS = (
    "rlrec-dlq-reason",
    "rlrec-dlq-detail",
    "rlrec-source-topic",
    "rlrec-source-partition",
    "rlrec-source-offset",
)
Headers = list[tuple[str, bytes]]


def _cut(data: bytes, limit: int, name: str) -> tuple[bytes, Headers]:
    if len(data) <= limit:
        return data, []
    return data[:limit], [
        (f"rlrec-original-{name}length", str(len(data)).encode()),
        (f"rlrec-original-{name}sha256", hashlib.sha256(data).hexdigest().encode()),
    ]


def _as_bytes(v: Any) -> bytes:
    if v is None:
        return b""
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    return str(v).encode("utf-8", "backslashreplace")


def _incoming(headers: Iterable[tuple[str, Any]] | None) -> Headers:
    """The incoming headers as they go into the copy: `rlrec-schema` kept (the first), other
    `rlrec-*` renamed `original-rlrec-*`; all of them together at most MAX_HEADER_BYTES."""
    out: Headers = []
    schema_seen = False
    raw = b""
    for k, v in headers or ():
        name = str(k)
        value = _as_bytes(v)
        raw += name.encode("utf-8", "backslashreplace") + b"\0" + value + b"\0"
        if name == SCHEMA_HEADER and not schema_seen:
            schema_seen = True
        elif name.startswith("rlrec-"):
            name = f"original-{name}"
        out.append((name, value))
    size = sum(len(k.encode("utf-8", "backslashreplace")) + len(v) for k, v in out)
    if size <= MAX_HEADER_BYTES:
        return out
    kept: Headers = []
    used = 0
    for k, v in out:
        n = len(k.encode("utf-8", "backslashreplace")) + len(v)
        if used + n > MAX_HEADER_BYTES:
            continue
        kept.append((k, v))
        used += n
    kept.append(("rlrec-original-headers-length", str(len(raw)).encode()))
    kept.append(("rlrec-original-headers-sha256", hashlib.sha256(raw).hexdigest().encode()))
    return kept


def dead_letter_record(
    *,
    topic: str,
    partition: int,
    offset: int,
    reason: str,
    detail: str,
    key: bytes | None,
    value: bytes | None,
    headers: Iterable[tuple[str, Any]] | None,
    max_value_bytes: int,
) -> tuple[bytes | None, bytes, Headers]:
    """(key, value, headers) of the dead letter of one message (see the module docstring)."""
    extra: Headers = []
    if key is not None:
        key, cut = _cut(_as_bytes(key), MAX_KEY_BYTES, "key-")
        extra += cut
    value, cut = _cut(_as_bytes(value), max_value_bytes, "")
    extra += cut
    own = [
        ("rlrec-dlq-reason", reason.encode()),
        ("rlrec-dlq-detail", detail.encode("utf-8", "backslashreplace")[:1000]),
        ("rlrec-source-topic", topic.encode()),
        ("rlrec-source-partition", str(partition).encode()),
        ("rlrec-source-offset", str(offset).encode()),
    ]
    return key, value, [*_incoming(headers), *extra, *own]


@dataclass
class PendingLetter:
    """A dead letter produced (or to be produced again) and not yet acknowledged by the broker."""

    seq: int
    partition: int  # source partition
    offset: int  # source offset: the partition's commit must not pass it until acknowledged
    reason: str
    key: bytes | None
    value: bytes
    headers: Headers
    topic: str | None = None  # where it goes (None: the dead-letter topic)
    to_partition: int | None = None  # ... and to which partition (None: by key)
    attempts: int = 0  # sends so far
    in_flight: bool = False
    retry: RetrySchedule = field(default_factory=RetrySchedule)  # failed deliveries: when to send again
    last_error: str | None = None
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = len(self.value) + len(self.key or b"") + sum(len(k) + len(v) for k, v in self.headers) + 200


class DeadLetterQueue:
    """Dead letters on their way to the broker.

    Guarantees: every letter given to `send` stays here until the broker acknowledged it (a
    delivery callback without error); a failed delivery is produced again after a backoff
    (`rlrec.store.retry.BACKGROUND`: 0.5 s doubling to 30 s, jittered), counted (`on_failure`) and logged -- never dropped; `min_unacked(p)` is the
    lowest source offset of partition p whose letter is not acknowledged, so the consumer never
    commits past a dead letter the DLQ does not hold. Call `poll()` from the consumer's loop.
    """

    def __init__(
        self,
        producer: Any,
        topic: str,
        *,
        on_failure: Callable[[PendingLetter, str], None] | None = None,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.on_failure = on_failure
        self.pending: dict[int, PendingLetter] = {}
        self.pending_bytes = 0
        self.delivered = 0
        self.failed = 0
        self._seq = 0

    # -- producing ----------------------------------------------------------------------------

    def send(
        self,
        partition: int,
        offset: int,
        reason: str,
        key: bytes | None,
        value: bytes,
        headers: Headers,
        *,
        topic: str | None = None,
        to_partition: int | None = None,
    ) -> None:
        """Produce a record that holds back partition `partition`'s commit at `offset` until the
        broker acknowledged it: a dead letter, or (with `topic`/`to_partition`) a consumer's
        decision written to the log."""
        self._seq += 1
        letter = PendingLetter(self._seq, partition, offset, reason, key, value, headers, topic, to_partition)
        self.pending[letter.seq] = letter
        self.pending_bytes += letter.nbytes
        self._produce(letter)

    def _produce(self, letter: PendingLetter) -> None:
        from confluent_kafka import KafkaException

        letter.attempts += 1
        letter.in_flight = True
        try:
            while True:
                try:
                    extra = {} if letter.to_partition is None else {"partition": letter.to_partition}
                    self.producer.produce(
                        letter.topic or self.topic,
                        letter.value,
                        letter.key,
                        headers=letter.headers,
                        on_delivery=lambda err, msg, seq=letter.seq: self._delivered(seq, err),
                        **extra,
                    )
                    break
                except BufferError:  # the local queue is full: serve callbacks, then try again
                    self.producer.poll(0.1)
        except KafkaException as e:  # refused locally (e.g. a fatal producer): retried later, like a failure
            self._delivered(letter.seq, e.args[0] if e.args else e)
        self.producer.poll(0)

    def _delivered(self, seq: int, err: Any) -> None:
        letter = self.pending.get(seq)
        if letter is None:
            return
        letter.in_flight = False
        if err is None:
            del self.pending[seq]
            self.pending_bytes -= letter.nbytes
            self.delivered += 1
            return
        self.failed += 1
        letter.last_error = str(err)
        wait = letter.retry.failed(time.monotonic())
        log.error(
            "dead letter for %d/%d (%s) not delivered (attempt %d): %s; retry in %.1fs",
            letter.partition,
            letter.offset,
            letter.reason,
            letter.attempts,
            err,
            wait,
        )
        if self.on_failure is not None:
            self.on_failure(letter, str(err))

    def poll(self, now: float | None = None) -> None:
        """Serve delivery callbacks and produce again what failed and is due."""
        self.producer.poll(0)
        now = time.monotonic() if now is None else now
        for letter in list(self.pending.values()):
            if not letter.in_flight and letter.retry.failures and letter.retry.due(now):
                self._produce(letter)

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` s for every pending letter to be acknowledged (failed ones are
        produced again meanwhile); True if none is left."""
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            self.producer.flush(max(0.0, min(1.0, deadline - time.monotonic())))
            self.poll()
            if self.pending and all(not p.in_flight for p in self.pending.values()):
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return not self.pending

    # -- what the offset commit needs ----------------------------------------------------------

    def min_unacked(self, partition: int) -> int | None:
        offs = [p.offset for p in self.pending.values() if p.partition == partition]
        return min(offs) if offs else None

    def oldest_failure(self) -> PendingLetter | None:
        """The pending letter failing for the longest time (None: no delivery is failing)."""
        failing = [p for p in self.pending.values() if p.retry.since is not None]
        return min(failing, key=lambda p: p.retry.since) if failing else None

    def close(self) -> None:
        if hasattr(self.producer, "close"):  # confluent-kafka >= 2.11: release the client now
            self.producer.close()
