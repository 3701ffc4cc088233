"""A partition's watermark: the time before which every episode its writer read is committed.

The writer of a partition (`rlrec.consumer.writer.PartitionWriter`) keeps, beside the
partition's log, the value of `rlrec.consumer.assembly.PartitionAssembler.open_since_ms` -- the
earliest start of an episode it has read and not committed, or, with none, when it last found
the partition caught up::

    _manifest/{topic}/{partition:05d}/.watermark.json
    {"type": "watermark", "open_since_ms": 1764300000000, "epoch": 3, "writer": "...", "time": ...}

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
the reader's clock by the reader (docs/GUARANTEES.md, "Watermark").

Example:
    >>> import tempfile
    >>> from rlrec.store.storage import Storage
    >>> s = Storage.from_uri(tempfile.mkdtemp())
    >>> read_watermark(s, "rl", 0) is None
    True
    >>> write_watermark(s, "rl", 0, 1_764_300_000_000, epoch=1, writer="w")
    >>> read_watermark(s, "rl", 0)
    1764300000000
"""

from __future__ import annotations

import json
import logging
import time

from rlrec.store.manifest import MANIFEST_DIR
from rlrec.store.storage import Storage

__all__ = ["WATERMARK_FILE", "read_watermark", "watermark_path", "write_watermark"]

#: the watermark's name in a partition's log directory (dot-prefixed: not an entry)
WATERMARK_FILE = ".watermark.json"
#: the most bytes of a watermark read (it holds one number and a writer's name)
MAX_WATERMARK_BYTES = 4096
#: the largest value taken (Unix ms in the year 2255): above it, malformed
_MAX_MS = 2**53

log = logging.getLogger("rlrec.store")


def watermark_path(topic: str, partition: int) -> str:
    """``_manifest/{topic}/{partition:05d}/.watermark.json``."""
    return f"{MANIFEST_DIR}/{topic}/{int(partition):05d}/{WATERMARK_FILE}"


def write_watermark(
    storage: Storage, topic: str, partition: int, open_since_ms: int, *, epoch: int | None, writer: str | None
) -> None:
    """Overwrite the partition's watermark with `open_since_ms` (Unix ms), naming the writer and
    epoch that decided it. Storage errors are raised (the caller writes it again later)."""
    doc = {
        "type": "watermark",
        "open_since_ms": int(open_since_ms),
        "epoch": epoch,
        "writer": writer,
        "time": time.time(),
    }
    storage.write(watermark_path(topic, partition), json.dumps(doc, sort_keys=True).encode())


def read_watermark(storage: Storage, topic: str, partition: int) -> int | None:
    """The partition's watermark (Unix ms), or None: none written, unreadable, malformed (logged)."""
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
        if doc.get("type") != "watermark" or type(v) is not int or not 0 <= v < _MAX_MS:
            raise ValueError("not a watermark")
        return v
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as e:
        log.warning("ignoring a malformed watermark %s (%s)", storage.uri(path), e)
        return None
