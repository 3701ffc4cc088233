"""Reader leases: the shard files a live reader (a trainer) was handed and has not read yet.

A trainer's follower hands it the shards of new shard entries (`rlrec.trainer.manifest_follower`);
it reads each file by the path its entry names, maybe long after -- a trainer behind by a backlog.
Compaction may merge those shards meanwhile and retention remove their files. So a trainer says
what it still holds: while it runs it rewrites ``_readers/{reader}.json`` (beside the manifest,
not in it) every ``ttl_s / 3`` seconds with ``{"reader", "renewed", "ttl_s", "holds"}``, ``holds``
being per partition log the manifest seqs of the entries whose files it was handed and has not
read to the end (``[[topic, partition, [[start, end], ...]], ...]``). `rlrec retain` neither records
nor deletes those entries' files while the lease is live (`live_holds`: renewed less than ``ttl_s``
ago by the reader's clock), reading the leases when it plans, right before it appends its records
and right before it deletes (`rlrec.store.retention.retain`). A reader stopped or stalled longer
than ``ttl_s`` holds nothing: its lease is a promise to read soon, not a pin.

Its bytes are data: anything malformed is no lease (logged), so a malformed lease keeps nothing.
A lease lasts at most `MAX_READER_LEASE_TTL_S` whatever ``ttl_s`` it states, and one renewed more
than `MAX_CLOCK_SKEW_S` in the future (by the clock of the reader of the leases) is malformed, so
no lease -- forged, or written by a host whose clock is far ahead -- holds files for ever. Each
live lease that holds entries is logged with its age. `rlrec retain` removes the leases expired
for more than `STALE_READER_LEASE_S` (those of trainers killed long ago).

Example::

    >>> import tempfile
    >>> from rlrec.store.storage import Storage
    >>> st = Storage.from_uri(tempfile.mkdtemp())
    >>> renew_reader_lease(st, "trainer-1", {("rl", 0): [(3, 5)]}, ttl_s=120.0, now=1000.0)
    >>> live_holds(st, now=1100.0), live_holds(st, now=1121.0)
    ({('rl', 0): [(3, 5)]}, {})
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Iterable, Mapping

from rlrec.store.storage import Storage

__all__ = [
    "DEFAULT_READER_LEASE_S",
    "MAX_CLOCK_SKEW_S",
    "MAX_READER_LEASE_TTL_S",
    "READERS_DIR",
    "STALE_READER_LEASE_S",
    "drop_reader_lease",
    "holds_of",
    "live_holds",
    "reader_lease_path",
    "renew_reader_lease",
]

log = logging.getLogger("rlrec.retention")

#: the folder of the reader leases, under the output root
READERS_DIR = "_readers"
#: how long a reader lease lasts unless renewed (a reader renews it every third of that)
DEFAULT_READER_LEASE_S = 120.0
#: the most bytes of a lease read; a larger one is malformed
MAX_READER_LEASE_BYTES = 8 * 1024 * 1024
#: the longest a lease lasts unless renewed, whatever ``ttl_s`` it states
MAX_READER_LEASE_TTL_S = 3600.0
#: a lease renewed further in the future than this (the lease reader's clock) is malformed
MAX_CLOCK_SKEW_S = 300.0
#: a lease expired this long ago is removed by `live_holds(..., remove_stale=True)` (rlrec retain)
STALE_READER_LEASE_S = 3600.0
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_LEASE_RE = re.compile(r"^([A-Za-z0-9._-]{1,200})\.json$")


def reader_lease_path(reader: str) -> str:
    """``_readers/{reader}.json`` (`reader`: letters, digits, ``.``, ``_``, ``-``)."""
    if not _NAME_RE.match(reader) or reader in (".", ".."):
        raise ValueError(f"a reader name is 1-200 of [A-Za-z0-9._-], got {reader[:40]!r}")
    return f"{READERS_DIR}/{reader}.json"


def holds_of(seqs: Iterable[tuple[str, int, int]]) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """``(topic, partition, seq)`` of entries as per-log sorted, disjoint ``[start, end)`` ranges.

    Example:
        >>> holds_of([("rl", 0, 4), ("rl", 0, 3), ("rl", 1, 9), ("rl", 0, 7)])
        {('rl', 0): [(3, 5), (7, 8)], ('rl', 1): [(9, 10)]}
    """
    per: dict[tuple[str, int], list[int]] = {}
    for t, p, q in seqs:
        per.setdefault((t, p), []).append(int(q))
    out: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for key, qs in sorted(per.items()):
        rs: list[tuple[int, int]] = []
        for q in sorted(set(qs)):
            if rs and rs[-1][1] == q:
                rs[-1] = (rs[-1][0], q + 1)
            else:
                rs.append((q, q + 1))
        out[key] = rs
    return out


def renew_reader_lease(
    storage: Storage,
    reader: str,
    holds: Mapping[tuple[str, int], Iterable[tuple[int, int]]],
    *,
    ttl_s: float = DEFAULT_READER_LEASE_S,
    now: float | None = None,
) -> None:
    """Write (replace) `reader`'s lease holding the entries `holds` (per log, seq ranges).
    Raises storage errors."""
    doc = {
        "reader": reader,
        "renewed": time.time() if now is None else now,
        "ttl_s": ttl_s,
        "holds": [[t, p, [[int(a), int(b)] for a, b in rs]] for (t, p), rs in sorted(holds.items())],
    }
    storage.write(reader_lease_path(reader), json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def drop_reader_lease(storage: Storage, reader: str) -> None:
    """Remove `reader`'s lease (it stops): it holds nothing from now on."""
    storage.delete(reader_lease_path(reader))


def _parse(raw: bytes, now: float) -> tuple[float, float, dict[tuple[str, int], list[tuple[int, int]]]]:
    """``(renewed, ttl_s capped at MAX_READER_LEASE_TTL_S, holds)`` of a lease's bytes; raises
    (any exception) when they are malformed."""
    if len(raw) > MAX_READER_LEASE_BYTES:
        raise ValueError("too large")
    d = json.loads(raw)
    renewed, ttl, holds = d["renewed"], d["ttl_s"], d["holds"]
    if not all(type(x) in (int, float) and math.isfinite(x) for x in (renewed, ttl)) or ttl <= 0:
        raise ValueError("renewed / ttl_s")
    if renewed > now + MAX_CLOCK_SKEW_S:
        raise ValueError(f"renewed {renewed - now:.0f} s in the future")
    ttl = min(ttl, MAX_READER_LEASE_TTL_S)
    out: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for topic, part, rs in holds:
        if not isinstance(topic, str) or type(part) is not int or part < 0:
            raise ValueError("holds")
        for a, b in rs:
            if type(a) is not int or type(b) is not int or not 0 <= a < b:
                raise ValueError("holds")
            out.setdefault((topic, part), []).append((a, b))
    return float(renewed), float(ttl), out


def live_holds(
    storage: Storage, now: float | None = None, *, remove_stale: bool = False
) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """What the live reader leases hold together: per log, seq ranges, sorted (they may overlap:
    merge them before a bisect). A lease renewed less than its ``ttl_s`` (at most
    `MAX_READER_LEASE_TTL_S`) ago by this clock, or up to `MAX_CLOCK_SKEW_S` "in the future", is
    live; each live one holding entries is logged with its age. With `remove_stale`, leases
    expired more than `STALE_READER_LEASE_S` ago are removed. Raises storage errors."""
    now = time.time() if now is None else now
    out: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for item in storage.list(READERS_DIR):
        if item.is_dir or not _LEASE_RE.match(item.name):
            continue
        path = f"{READERS_DIR}/{item.name}"
        try:
            raw = storage.read(path, limit=MAX_READER_LEASE_BYTES)
        except FileNotFoundError:
            continue
        try:
            renewed, ttl, holds = _parse(raw, now)
        except Exception as e:  # hostile bytes (deep nesting included) are no lease, never a crash
            log.warning("ignoring a malformed reader lease %s (%s)", storage.uri(path), type(e).__name__)
            continue
        age = now - renewed
        if age < ttl:
            n = sum(b - a for rs in holds.values() for a, b in rs)
            if n:
                log.info(
                    "reader lease %s (renewed %.0f s ago, lasts %.0f s) holds %d shard entries",
                    storage.uri(path),
                    age,
                    ttl,
                    n,
                )
            for key, rs in holds.items():
                out.setdefault(key, []).extend(rs)
        elif remove_stale and age > ttl + STALE_READER_LEASE_S:
            log.info("removing reader lease %s, expired %.0f s ago", storage.uri(path), age - ttl)
            storage.delete(path)
    return {k: sorted(rs) for k, rs in sorted(out.items())}
