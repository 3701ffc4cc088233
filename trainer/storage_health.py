"""The input store's health as the trainer's driver sees it: failed reads, a WARNING, recovery.

The reads that fail are the driver's own (manifest polls) and the read tasks' (shard reads,
counted by the feed actor and handed back to the feed). Both end here, on the driver, so an
outage is logged where the operator looks, counted (``storage_errors`` in each metrics line,
``rlrec_trainer_storage_errors_total``) and its end is logged too. A store that refuses
(permission, credentials) is counted the same way but logged as an ERROR of its own and is not
an outage: waiting does not end it. No Ray here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["StorageHealth"]

log = logging.getLogger("rlrec.trainer")


class StorageHealth:
    """Failed reads of one store, reported on the driver.

    While reads fail, a WARNING naming the store and the last error is logged at the first
    failure and then every `warn_every_s`; an INFO line when a read succeeds again. Thread-safe
    (the manifest poll thread reports, the training loop takes the per-iteration count).

    Args:
        store: the store's URI, as the log lines name it.
        warn_every_s: seconds between repeated warnings while the store keeps failing.
        on_errors: called with the number of new failed reads (e.g. a Prometheus counter's ``inc``).
        clock: a monotonic clock (tests pass a fake one).

    Example:
        >>> h = StorageHealth("s3://bucket/run", clock=lambda: 100.0)
        >>> h.failed("manifest poll", "StorageError: connection refused")
        >>> h.reader_errors(3, "StorageError: HTTP status 503")
        >>> h.failing, h.total, h.pop_iteration(), h.pop_iteration()
        (True, 4, 4, 0)
        >>> h.answered(); h.failing
        False
    """

    def __init__(
        self,
        store: str,
        *,
        warn_every_s: float = 10.0,
        on_errors: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.warn_every_s = warn_every_s
        self.on_errors = on_errors
        self.clock = clock
        self.total = 0  # failed reads since the start of this process
        self.failing_since: float | None = None
        self.last_error: str | None = None
        self._iteration = 0
        self._reader_seen = 0
        self.refusals = 0  # reads the store refused (permission, credentials) since the start
        self.last_refusal: str | None = None
        self._reader_refused = 0
        self._last_refusal_log = float("-inf")
        self._last_warn = float("-inf")
        self._lock = threading.Lock()

    @property
    def failing(self) -> bool:
        return self.failing_since is not None

    def _count(self, n: int, what: str, error: str | None) -> None:
        if n <= 0:
            return
        now = self.clock()
        with self._lock:
            self.total += n
            self._iteration += n
            self.last_error = error or self.last_error
            if self.failing_since is None:
                self.failing_since = now
            warn = now - self._last_warn >= self.warn_every_s
            if warn:
                self._last_warn = now
            since = now - self.failing_since
        if warn:
            log.warning(
                "storage %s does not answer (%s: %s); %d failed read(s) in %.0fs, retrying; "
                "training goes on with the data it holds",
                self.store,
                what,
                self.last_error,
                self.total,
                since,
            )
        if self.on_errors is not None:
            self.on_errors(n)

    def refused(self, what: str, error: str, n: int = 1) -> None:
        """The store refused `n` reads (`what`: e.g. ``"manifest poll"``) with `error`:
        permission or credentials. Counted and logged as an ERROR (every `warn_every_s`) that
        says so, but not an outage: `failing` is False after it (the stall watchdog is not excused;
        waiting does not end a refusal, someone must change the store's configuration). A
        refusal is an answer: an outage reported before it is over."""
        if n <= 0:
            return
        now = self.clock()
        with self._lock:
            self.failing_since = None
            self.total += n
            self._iteration += n
            self.refusals += n
            self.last_refusal = error
            log_it = now - self._last_refusal_log >= self.warn_every_s
            if log_it:
                self._last_refusal_log = now
        if log_it:
            log.error(
                "storage %s refuses (%s: %s); %d refused read(s) so far, retrying: check the trainer's "
                "credentials and the store's permissions",
                self.store,
                what,
                error,
                self.refusals,
            )
        if self.on_errors is not None:
            self.on_errors(n)

    def reader_refusals(self, cumulative: int, last_refusal: str | None) -> None:
        """The read tasks' refused reads so far (the feed's cumulative count) and the last refusal."""
        with self._lock:
            new, self._reader_refused = cumulative - self._reader_refused, max(cumulative, self._reader_refused)
        self.refused("shard read", last_refusal or "", new)

    def failed(self, what: str, error: str) -> None:
        """One read of the driver's (`what`: e.g. ``"manifest poll"``) failed with `error`."""
        self._count(1, what, error)

    def reader_errors(self, cumulative: int, last_error: str | None) -> None:
        """The read tasks' failed reads so far (the feed's cumulative count) and the last error."""
        with self._lock:
            new, self._reader_seen = cumulative - self._reader_seen, max(cumulative, self._reader_seen)
        self._count(new, "shard read", last_error)

    def answered(self) -> None:
        """A read of the driver's succeeded and the read tasks reported no new failure."""
        with self._lock:
            since, self.failing_since = self.failing_since, None
            if since is not None:
                self._last_warn = float("-inf")
        if since is not None:
            log.info("storage %s answers again (after %.1fs)", self.store, self.clock() - since)

    def pop_iteration(self) -> int:
        """Failed reads since the last call (one training iteration's ``storage_errors``)."""
        with self._lock:
            n, self._iteration = self._iteration, 0
        return n
