"""A partition's watermark: the time before which every episode its writer read is committed.

The writer of a partition (`rlrec.consumer.writer.PartitionWriter`) keeps, beside the
partition's log, the value of `rlrec.consumer.assembly.PartitionAssembler.open_since_ms` -- the
earliest start of an episode it has read and not committed, or, with none, when it last found
the partition caught up::

    _manifest/{topic}/{partition:05d}/.watermark.json
    {"type": "watermark", "open_since_ms": 1764300000000, "partitions": 12, "epoch": 3, "writer": "...",
     "time": ...}

It is written after each write's outcome is applied (so it never passes an episode whose entry
has not landed) and while the partition is idle, at most every ``commit_interval_s``
(``rlrec consume``), overwritten each time. Every value written stays true once written --
every episode of the partition that started before it is committed -- up to the producer's
delivery delay (`rlrec.trainer.canary_evidence.WATERMARK_SLACK_S`): any writer, of any consumer
group, resumes from the store's position (`ShardEntry.resume_offset`), so it reads every episode
not committed before it counts it. A reader reads the watermark *before* the entries it
judges by it.

It is a hint beside the log, never in it (like the log's ``.head.json``): manifest readers of
every format list only ``{seq:012d}.json`` entries and skip dot-files, gc and retention never
touch ``_manifest/``, so no manifest format carries it and older rlrec versions ignore it. A
missing, malformed or oversized one reads as None (unknown); a value in the future is clamped to
the reader's clock by the reader (docs/GUARANTEES.md, "Watermark"). ``partitions`` (optional):
the topic's partition count as the writer's consumer last saw it, so that a reader also counts
the partitions that have no log yet.

Example:
    >>> import tempfile
    >>> from rlrec.store.storage import Storage
    >>> s = Storage.from_uri(tempfile.mkdtemp())
    >>> read_watermark(s, "rl", 0) is None
    True
    >>> write_watermark(s, "rl", 0, 1_764_300_000_000, epoch=1, writer="w", partitions=4)
    >>> read_watermark(s, "rl", 0)
    Watermark(open_since_ms=1764300000000, partitions=4)
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from rlrec.store.manifest import MANIFEST_DIR
from rlrec.store.storage import Storage

__all__ = ["WATERMARK_FILE", "Watermark", "read_watermark", "watermark_path", "write_watermark"]

#: the watermark's name in a partition's log directory (dot-prefixed: not an entry)
WATERMARK_FILE = ".watermark.json"
#: the most bytes of a watermark read (it holds one number and a writer's name)
MAX_WATERMARK_BYTES = 4096
#: the largest value taken (Unix ms in the year 2255): above it, malformed
_MAX_MS = 2**53
#: the most partitions a watermark may say its topic has (Kafka's practical limit is far below)
MAX_PARTITIONS = 100_000


@dataclass(frozen=True)
class Watermark:
    """A partition's watermark as read: the value (Unix ms) and the topic's partition count its
    writer last saw (None: not said)."""

    open_since_ms: int
    partitions: int | None = None


log = logging.getLogger("rlrec.store")


def watermark_path(topic: str, partition: int) -> str:
    """``_manifest/{topic}/{partition:05d}/.watermark.json``."""
    return f"{MANIFEST_DIR}/{topic}/{int(partition):05d}/{WATERMARK_FILE}"


def write_watermark(
    storage: Storage,
    topic: str,
    partition: int,
    open_since_ms: int,
    *,
    epoch: int | None,
    writer: str | None,
    partitions: int | None = None,
) -> None:
    """Overwrite the partition's watermark with `open_since_ms` (Unix ms), naming the writer and
    epoch that decided it and the topic's `partitions` (None: unknown). Storage errors are raised
    (the caller writes it again later)."""
    doc = {
        "type": "watermark",
        "open_since_ms": int(open_since_ms),
        "epoch": epoch,
        "writer": writer,
        "time": time.time(),
    }
    if partitions is not None:
        doc["partitions"] = int(partitions)
    storage.write(watermark_path(topic, partition), json.dumps(doc, sort_keys=True).encode())


def read_watermark(storage: Storage, topic: str, partition: int) -> Watermark | None:
    """The partition's watermark, or None: none written, malformed (logged). Storage errors
    other than a missing file are raised."""
    path = watermark_path(topic, partition)
    try:
        raw = storage.read(path, limit=MAX_WATERMARK_BYTES)
    except FileNotFoundError:
        return None
    try:
        if len(raw) > MAX_WATERMARK_BYTES:
            raise ValueError("too large")
        doc = json.loads(raw)
        v = doc["open_since_ms"]
        n = doc.get("partitions")
        if doc.get("type") != "watermark" or type(v) is not int or not 0 <= v < _MAX_MS:
            raise ValueError("not a watermark")
        if n is not None and (type(n) is not int or not 0 < n <= MAX_PARTITIONS):
            raise ValueError("not a partition count")
        return Watermark(v, n)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as e:
        log.warning("ignoring a malformed watermark %s (%s)", storage.uri(path), e)
        return None
