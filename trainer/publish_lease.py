"""One publisher per publish root: the trainer holds an owner lease on it while it publishes.

The lease is the consumer's partition owner lease (`rlrec.store.ownership`), kept under the
publish root at ``_owners/publisher/00000.json``: ``{"writer", "epoch", "renewed", "ttl_s"}``,
renewed every ``ttl_s / 3`` by a daemon thread, released at a clean stop.

* Taking it (`PublishLease.acquire`): a lease that is missing or released is taken at once, and
  so is one naming a process of this host that no longer runs; any other is waited on while it
  may belong to a dead trainer (a kill -9 elsewhere leaves its lease to expire within ``ttl_s``), judged as `rlrec.store.ownership.judge_leases` judges owners
  (live by the clock, or changed while watched). One still live after that belongs to a
  running trainer: `PublishRootTaken` (``rlrec train`` exits 2 with one line).
* Keeping it (`PublishLease.check`): before every write to the root (a version, a pointer, a
  canary decision) the lease is read again; one that names another writer means this trainer
  was fenced: `PublishRootTaken`, and nothing is written. A renewal that finds another writer
  marks the lease lost the same way.

So two trainers on one root never both publish: the second waits out a dead first one, and
refuses a live one. The window between a check and the write after it is not closed (no
conditional write is needed for that on every store): it is one storage call long, and only
open when a second trainer takes the root from a first one the lease judged dead.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from rlrec.store.ownership import judge_leases, one_attempt, read_lease, release_lease, renew_lease
from rlrec.store.storage import Storage

__all__ = ["PUBLISHER", "PUBLISH_LEASE_S", "PublishLease", "PublishRootTaken"]

log = logging.getLogger("rlrec.trainer")

#: the lease's "topic" (``_owners/publisher/00000.json`` under the publish root)
PUBLISHER = "publisher"
#: how long a publisher's lease lasts unless renewed
PUBLISH_LEASE_S = 30.0


class PublishRootTaken(RuntimeError):
    """Another trainer publishes to this root (its lease is live), or took it from this one."""


def _dead_here(writer: str) -> bool:
    """Whether `writer` (``host:pid:random``) names a process of this host that no longer runs
    (a trainer killed here: its successor need not wait for the lease to expire)."""
    host, _, rest = writer.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, another user's
        return False
    return False


class PublishLease:
    """This trainer's lease on a publish root (module docstring).

    Args:
        storage: the publish root.
        ttl_s: how long the lease lasts unless renewed.
        writer: this trainer's name in the lease (default ``host:pid:random``).
        sleep: how to wait (tests).

    Example:
        >>> import tempfile
        >>> st = Storage.from_uri(tempfile.mkdtemp())
        >>> lease = PublishLease(st, ttl_s=30.0)
        >>> lease.acquire()
        >>> lease.check()
        >>> other = PublishLease(st, ttl_s=30.0, sleep=lambda s: None)
        >>> other.acquire(max_wait_s=0.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        rlrec.trainer.publish_lease.PublishRootTaken: another trainer publishes ...
        >>> lease.release()
    """

    def __init__(
        self,
        storage: Storage,
        *,
        ttl_s: float = PUBLISH_LEASE_S,
        writer: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.storage = storage
        self.ttl_s = float(ttl_s)
        self.writer = writer or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.epoch = 0
        self.lost: str | None = None
        self._sleep = sleep
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, max_wait_s: float | None = None) -> None:
        """Take the lease, waiting up to `max_wait_s` (default ``1.5 * ttl_s``) for a held one
        to prove dead; then renew it in the background.

        Raises:
            PublishRootTaken: a live trainer holds it.
        """
        wait = 1.5 * self.ttl_s if max_wait_s is None else float(max_wait_s)
        deadline = time.monotonic() + wait
        announced = False
        while True:
            held = read_lease(self.storage, PUBLISHER, 0)
            if held is None or held.released or held.writer == self.writer:
                break
            if _dead_here(held.writer):
                log.info("the publish lease of %s names a process gone from this host: taking it", held.describe())
                break
            live = judge_leases(
                self.storage, [(PUBLISHER, 0)], watch_s=min(self.ttl_s / 2, max(0.0, wait)), sleep=self._sleep
            )[(PUBLISHER, 0)]
            if live is None:
                log.info("the publish lease of %s expired: taking the publish root", held.describe())
                break
            if time.monotonic() >= deadline:
                raise PublishRootTaken(
                    f"another trainer publishes to {self.storage.uri()} ({live.describe()}): two trainers must not "
                    "publish to one root; stop it, or give this one another --checkpoint-dir or --publish-dir"
                )
            if not announced:
                log.warning(
                    "the publish root %s is leased by %s: waiting up to %.0fs for it to expire (a trainer killed "
                    "without a clean stop leaves its lease behind)",
                    self.storage.uri(),
                    live.describe(),
                    wait,
                )
                announced = True
            self._sleep(min(self.ttl_s / 3, max(0.05, deadline - time.monotonic())))
        self.epoch = (held.epoch + 1) if held is not None else 1
        renew_lease(self.storage, PUBLISHER, 0, writer=self.writer, epoch=self.epoch, ttl_s=self.ttl_s)
        self.lost = None
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._renew_loop, name="rlrec-publish-lease", daemon=True)
            self._thread.start()

    def _renew_loop(self) -> None:
        single = one_attempt(self.storage)
        while not self._stop.wait(self.ttl_s / 3):
            try:
                held = read_lease(single, PUBLISHER, 0)
                if held is not None and held.writer != self.writer and not held.released:
                    self.lost = f"the publish root was taken by {held.describe()}"
                    log.error("%s: this trainer publishes nothing more", self.lost)
                    return
                renew_lease(single, PUBLISHER, 0, writer=self.writer, epoch=self.epoch, ttl_s=self.ttl_s)
            except Exception as e:  # the next renewal tries again; the lease lasts ttl_s
                log.warning("renewing the publish lease failed: %s", e)

    def check(self) -> None:
        """Raise `PublishRootTaken` unless this trainer still holds the lease (read now)."""
        if self.lost is None:
            held = read_lease(self.storage, PUBLISHER, 0)
            if held is not None and held.writer != self.writer and not held.released:
                self.lost = f"the publish root was taken by {held.describe()}"
        if self.lost is not None:
            raise PublishRootTaken(f"{self.storage.uri()}: {self.lost}; not publishing")

    def release(self) -> None:
        """Stop renewing and let the root go (a clean stop): the next trainer takes it at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.lost is not None or not self.epoch:
            return
        try:
            release_lease(self.storage, PUBLISHER, 0, writer=self.writer, epoch=self.epoch, ttl_s=self.ttl_s)
        except Exception as e:
            log.warning("releasing the publish lease failed (%s): the next trainer waits for it to expire", e)
