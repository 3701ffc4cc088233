"""Owner leases: which writer runs a partition now, for tools that must not fence a live one.

Fencing needs no clock (`rlrec.store.manifest`): a newer claim always wins. But a tool that
claims a partition to write to it (``rlrec compact``) would fence a *live* consumer, which then
stops writing it until it claims again. So an owner says it is alive: while it holds a claim
it rewrites ``_owners/{topic}/{partition:05d}.json`` (beside the manifest, not in it: gc and
manifest readers never look there) every ``ttl_s / 3`` seconds with ``{"writer", "epoch",
"renewed", "ttl_s"}``, off its polling thread, one storage attempt per renewal.

An owner that stops cleanly (its last shard committed) marks its lease released
(`release_lease`): the partition is free at once.

Liveness (`judge_leases`) is judged two ways, and a lease is *live* if either says so:
by the clock (renewed less than ``ttl_s`` ago by the reader's clock; a renewal "in the future"
counts as live) and without one (read twice ``ttl_s`` apart: a lease that changed meanwhile was
renewed). So neither clock skew between hosts nor a few failed renewals make a live owner look
gone: that takes an owner silent for ``ttl_s`` by its own clock *and* for ``ttl_s`` more while
watched.

A lease is only a courtesy between writers: correctness (an episode committed once, a fenced
writer commits nothing) never depends on it. Its bytes are data: anything malformed is no lease.

Example::

    >>> import tempfile
    >>> from rlrec.store.storage import Storage
    >>> st = Storage.from_uri(tempfile.mkdtemp())
    >>> renew_lease(st, "rl", 0, writer="host:1:abc", epoch=3, ttl_s=60.0, now=1000.0)
    >>> lease = read_lease(st, "rl", 0)
    >>> lease.epoch, lease.live(now=1030.0), lease.live(now=1061.0)
    (3, True, False)
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rlrec.store.retry import RetryPolicy
from rlrec.store.storage import Storage

__all__ = [
    "DEFAULT_LEASE_S",
    "OWNERS_DIR",
    "Lease",
    "judge_leases",
    "lease_path",
    "one_attempt",
    "read_lease",
    "release_lease",
    "renew_lease",
]

log = logging.getLogger("rlrec.ownership")

#: the folder of the owner leases, under the output root
OWNERS_DIR = "_owners"
#: how long a lease lasts unless renewed (an owner renews it every third of that)
DEFAULT_LEASE_S = 60.0
#: the most bytes of a lease read (it holds four small fields); a larger one is malformed
MAX_LEASE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Lease:
    """A partition owner's statement that it is alive (module docstring)."""

    writer: str
    epoch: int
    renewed: float
    ttl_s: float
    #: the owner stopped cleanly and let the partition go (`release_lease`): never live
    released: bool = False

    def live(self, now: float | None = None) -> bool:
        """Whether the lease was renewed less than ``ttl_s`` ago (a renewal "in the future" by
        this clock counts as live: clock skew errs on the side of leaving the partition alone)
        and not released."""
        now = time.time() if now is None else now
        return not self.released and now - self.renewed < self.ttl_s

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        done = "released" if self.released else "renewed"
        return f"writer {self.writer}, epoch {self.epoch}, {done} {max(0.0, now - self.renewed):.0f}s ago"


def lease_path(topic: str, partition: int) -> str:
    """``_owners/{topic}/{partition:05d}.json``."""
    return f"{OWNERS_DIR}/{topic}/{int(partition):05d}.json"


def renew_lease(
    storage: Storage,
    topic: str,
    partition: int,
    *,
    writer: str,
    epoch: int,
    ttl_s: float = DEFAULT_LEASE_S,
    now: float | None = None,
) -> None:
    """Write (replace) the partition's lease for `writer` at `epoch`. Raises storage errors."""
    doc = {"writer": writer, "epoch": epoch, "renewed": time.time() if now is None else now, "ttl_s": ttl_s}
    storage.write(lease_path(topic, partition), json.dumps(doc, sort_keys=True).encode())


def release_lease(
    storage: Storage, topic: str, partition: int, *, writer: str, epoch: int, ttl_s: float = DEFAULT_LEASE_S
) -> None:
    """Say that `writer` (at `epoch`) stopped cleanly and let the partition go: tools such as
    ``rlrec compact`` take it at once instead of waiting for the lease to expire (nothing it
    wrote is left uncommitted). Raises storage errors.

    Example:
        >>> import tempfile
        >>> from rlrec.store.storage import Storage
        >>> st = Storage.from_uri(tempfile.mkdtemp())
        >>> release_lease(st, "rl", 0, writer="host:1:abc", epoch=3)
        >>> lease = read_lease(st, "rl", 0)
        >>> lease.released, lease.live()
        (True, False)
    """
    doc = {"writer": writer, "epoch": epoch, "renewed": time.time(), "ttl_s": ttl_s, "released": True}
    storage.write(lease_path(topic, partition), json.dumps(doc, sort_keys=True).encode())


def read_lease(storage: Storage, topic: str, partition: int) -> Lease | None:
    """The partition's lease, or None (none, or malformed: logged). Raises storage errors."""
    path = lease_path(topic, partition)
    try:
        raw = storage.read(path, limit=MAX_LEASE_BYTES)
    except FileNotFoundError:
        return None
    try:
        if len(raw) > MAX_LEASE_BYTES:
            raise ValueError("too large")
        d = json.loads(raw)
        writer, epoch, renewed, ttl = d["writer"], d["epoch"], d["renewed"], d["ttl_s"]
        released = d.get("released", False)
        ok = (
            isinstance(writer, str)
            and type(epoch) is int
            and all(type(x) in (int, float) and math.isfinite(x) for x in (renewed, ttl))
            and ttl > 0
            and type(released) is bool
        )
        if ok:
            return Lease(writer, epoch, float(renewed), float(ttl), released)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        pass
    log.warning("ignoring a malformed owner lease %s", storage.uri(path))
    return None


def one_attempt(storage: Storage) -> Storage:
    """A view of `storage` that tries each call once (a renewal that fails waits for the next
    one instead of retrying in place)."""
    single = copy.copy(storage)
    single.retry = RetryPolicy(attempts=1)
    return single


def judge_leases(
    storage: Storage,
    keys: Iterable[tuple[str, int]],
    *,
    watch_s: float | None = None,
    ignore: Callable[[Lease], bool] = lambda lease: False,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[tuple[str, int], Lease | None]:
    """Which of the partitions `keys` a live owner holds (module docstring): ``{key: its live
    lease, or None when no live owner}``.

    A lease live by the clock is live at once. The others are read again after one wait of
    `watch_s` (default: the longest ``ttl_s`` among them; no wait when there are none): a lease
    that changed meanwhile is live. Leases for which `ignore` is true count as no owner.
    Raises storage errors.

    Example:
        >>> import tempfile
        >>> from rlrec.store.storage import Storage
        >>> st = Storage.from_uri(tempfile.mkdtemp())
        >>> renew_lease(st, "rl", 0, writer="w", epoch=1, ttl_s=60.0)
        >>> renew_lease(st, "rl", 1, writer="w", epoch=1, ttl_s=60.0, now=0.0)
        >>> {k: v is not None for k, v in judge_leases(st, [("rl", 0), ("rl", 1)], watch_s=0.01).items()}
        {('rl', 0): True, ('rl', 1): False}
    """
    out: dict[tuple[str, int], Lease | None] = {}
    watched: dict[tuple[str, int], Lease] = {}
    for key in keys:
        lease = read_lease(storage, *key)
        if lease is None or lease.released or ignore(lease):
            out[key] = None
        elif lease.live():
            out[key] = lease
        else:
            watched[key] = lease
            out[key] = None
    if watched:
        sleep(max(x.ttl_s for x in watched.values()) if watch_s is None else watch_s)
        for key, before in watched.items():
            now = read_lease(storage, *key)
            if now is not None and now != before and not ignore(now):
                out[key] = now
    return out
