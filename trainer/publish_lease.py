"""One publisher per publish root: the trainer holds an owner lease on it while it publishes.

The lease is the consumer's partition owner lease (`rlrec.store.ownership`), kept under the
publish root at ``_owners/publisher/00000.json``: ``{"writer", "epoch", "renewed", "ttl_s"}``,
renewed every ``ttl_s / 3`` by a daemon thread, released at a clean stop.

* Taking it (`PublishLease.acquire`): a lease that is missing or released is taken at once, and
  so is one naming a process of this host's boot and PID namespace that no longer runs (a
  container sharing the hostname has another namespace: never taken at once); any other is waited on while it
  may belong to a dead trainer (a kill -9 elsewhere leaves its lease to expire within ``ttl_s``), judged as `rlrec.store.ownership.judge_leases` judges owners
  (live by the clock, or changed while watched). One still live after that belongs to a
  running trainer: `PublishRootTaken` (``rlrec train`` exits 2 with one line).
* Keeping it: taking the root also *claims* the next position of the root's fencing log
  (``_owners/publisher/fence/{n:012d}.json``, created with `Storage.create_once`, the
  conditional create the consumer's manifest fences with, docs/GUARANTEES.md §6). Every write
  the trainer then makes to the root -- a version's files, a pointer, a canary decision, a
  delete -- goes through `FencedStorage`, which first creates the log's next position
  (`PublishLease.fence`). A trainer whose next position another trainer's claim took was
  fenced: `PublishRootTaken`, and that write and every later one are not made. A renewal or
  a `check` that finds another writer in the lease marks it lost the same way.

So two trainers on one root never both publish: the second waits out a dead first one and
refuses a live one, and a first one that another took the root from (judged dead while it was
only slow) is stopped at its next write, whatever it was doing. The one write it had already
started when the claim landed may still complete (no store can cancel a request in flight);
every write after it is refused. Entries are small; a trainer deletes its own previous write
entry as it moves on (claims are kept: a fenced trainer's next position is always a claim).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from rlrec.store.ownership import OWNERS_DIR, judge_leases, one_attempt, read_lease, release_lease, renew_lease
from rlrec.store.storage import Storage

__all__ = ["FENCE_DIR", "PUBLISHER", "PUBLISH_LEASE_S", "FencedStorage", "PublishLease", "PublishRootTaken"]

log = logging.getLogger("rlrec.trainer")

#: the lease's "topic" (``_owners/publisher/00000.json`` under the publish root)
PUBLISHER = "publisher"
#: how long a publisher's lease lasts unless renewed
PUBLISH_LEASE_S = 30.0
#: the publish root's fencing log (one create-once entry per claim and per write)
FENCE_DIR = f"{OWNERS_DIR}/{PUBLISHER}/fence"


class PublishRootTaken(RuntimeError):
    """Another trainer publishes to this root (its lease is live), or took it from this one."""


def _process_namespace() -> str:
    """This machine's boot and PID namespace, as a short id ("" when unknown): two containers
    that share a hostname do not share it, so a pid is only compared within one namespace."""
    import hashlib

    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return hashlib.sha256(f"{boot}:{ns}".encode()).hexdigest()[:12]


def _dead_here(writer: str) -> bool:
    """Whether `writer` (``host:pid:random:namespace``) names a process of this host's boot and
    PID namespace that no longer runs (a trainer killed here: its successor need not wait for
    the lease to expire). A writer of another namespace -- a container sharing the hostname --
    or one without a namespace is never taken for dead: its lease is waited out."""
    parts = writer.split(":")
    if len(parts) != 4 or not parts[3] or parts[3] != _process_namespace():
        return False
    host, pid_text = parts[0], parts[1]
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
        writer: this trainer's name in the lease (default ``host:pid:random:namespace``).
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
        self.writer = writer or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}:{_process_namespace()}"
        self.epoch = 0
        self.lost: str | None = None
        self._claimed: int | None = None  # this trainer's claim in the fencing log
        self._position: int | None = None  # its last entry there
        self._fence_lock = threading.Lock()
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
        self._claim()
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

    def _entry(self, n: int, what: str) -> bytes:
        doc = {"writer": self.writer, "epoch": self.epoch, "position": n, "what": what[:200], "time": time.time()}
        return json.dumps(doc, sort_keys=True).encode()

    def _own_entry(self, path: str, n: int) -> bool:
        """Whether the existing fencing entry `path` is this trainer's own at position `n` (an
        earlier `fence` whose create-once was applied but reported failed, then retried by the
        caller with another entry): it holds the position, not another trainer."""
        try:
            doc = json.loads(self.storage.read(path, limit=4096))
        except (OSError, ValueError):
            return False
        return isinstance(doc, dict) and (doc.get("writer"), doc.get("epoch"), doc.get("position")) == (
            self.writer,
            self.epoch,
            n,
        )

    def _claim(self) -> None:
        """Claim the fencing log's next position (a trainer at an older one is fenced)."""
        names = [f.path.rsplit("/", 1)[-1] for f in self.storage.list(FENCE_DIR)]
        taken = [int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()]
        n = max(taken, default=0) + 1
        if not self.storage.create_once(f"{FENCE_DIR}/{n:012d}.json", self._entry(n, "claim")):
            self.lost = f"another trainer claimed the publish root at the same time (fencing entry {n})"
            raise PublishRootTaken(f"{self.storage.uri()}: {self.lost}")
        with self._fence_lock:
            self._claimed = self._position = n

    def fence(self, what: str) -> None:
        """Before a write to the root: create this trainer's next fencing entry. Raises
        `PublishRootTaken` (and marks the lease lost) when another trainer's claim took it.

        Args:
            what: the write about to be made (kept in the entry, for the curious).
        """
        with self._fence_lock:
            if self.lost is not None:
                raise PublishRootTaken(f"{self.storage.uri()}: {self.lost}; not publishing")
            if self._position is None:
                raise PublishRootTaken(f"{self.storage.uri()}: the publish lease is not held; not publishing")
            n = self._position + 1
            path = f"{FENCE_DIR}/{n:012d}.json"
            if not self.storage.create_once(path, self._entry(n, what)) and not self._own_entry(path, n):
                self.lost = f"the publish root was taken by another trainer (fencing entry {n} is not this one's)"
                log.error("%s: this trainer publishes nothing more", self.lost)
                raise PublishRootTaken(f"{self.storage.uri()}: {self.lost}; not publishing")
            previous, self._position = self._position, n
        if previous != self._claimed:  # this trainer's own write entry: no other trainer's next position
            try:
                self.storage.delete(f"{FENCE_DIR}/{previous:012d}.json")
            except Exception as e:
                log.debug("removing fencing entry %d failed: %s", previous, e)

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


class FencedStorage:
    """The publish root as the holder of `lease` writes it: each write, create, delete, move,
    copy or upload first passes `PublishLease.fence`; reads go straight to `storage`.

    Args:
        storage: the publish root.
        lease: this trainer's acquired lease on it.

    Example:
        >>> import tempfile
        >>> st = Storage.from_uri(tempfile.mkdtemp())
        >>> lease = PublishLease(st, ttl_s=30.0)
        >>> lease.acquire()
        >>> FencedStorage(st, lease).write("x.json", b"{}")
        >>> lease.release()
    """

    def __init__(self, storage: Storage, lease: PublishLease) -> None:
        self.storage = storage
        self.lease = lease

    def __getattr__(self, name: str) -> Any:
        return getattr(self.storage, name)

    def __repr__(self) -> str:
        return f"FencedStorage({self.storage!r})"

    def write(self, path: str, data: bytes) -> None:
        self.lease.fence(f"write {path}")
        self.storage.write(path, data)

    def create_once(self, path: str, data: bytes) -> bool:
        self.lease.fence(f"create {path}")
        return self.storage.create_once(path, data)

    def delete(self, path: str, **kw: Any) -> bool:
        self.lease.fence(f"delete {path}")
        return self.storage.delete(path, **kw)

    def move(self, src: str, dst: str) -> None:
        self.lease.fence(f"move {src} {dst}")
        self.storage.move(src, dst)

    def copy(self, src: str, dst: str) -> None:
        self.lease.fence(f"copy {src} {dst}")
        self.storage.copy(src, dst)

    def upload_dir(self, local_dir: Any, prefix: str) -> int:
        self.lease.fence(f"upload {prefix}")
        return self.storage.upload_dir(local_dir, prefix)

    def delete_tree(self, prefix: str) -> int:
        self.lease.fence(f"delete {prefix}")
        return self.storage.delete_tree(prefix)
