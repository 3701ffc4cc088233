"""The trainer's stall watchdog: fresh data waiting and nothing trained for too long ends the process.

A lost Ray worker is normally replaced by Ray (a read task is retried, a PreLearner actor
restarted; the feed hands their chunks out again). What cannot be replaced in place -- the feed
actor, a Learner actor, a pipeline that does not come back -- would leave the trainer waiting
(in ``algo.train()``) or training on its Learner buffer only, with fresh shards never trained:
the policy goes stale without a word. The watchdog bounds that: when fresh shards wait and no
chunk of fresh data was trained on for `timeout_s` while the input store answers, it logs one
line and ends the process with `EXIT_STALLED`; ``rlrec train --resume`` (a supervisor) continues from the
last checkpoint. No Ray here.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["EXIT_STALLED", "StallWatchdog"]

log = logging.getLogger("rlrec.trainer")

#: exit code of a trainer the watchdog ended (EX_SOFTWARE)
EXIT_STALLED = 70


class StallWatchdog:
    """Ends the process when fresh data waits and none is trained for `timeout_s` seconds.

    The training loop reports each completed iteration (:meth:`iteration`: how many chunks of
    fresh data were first trained on in it, how many fresh shards still wait) and calls
    :meth:`progress` while nothing is owed (no fresh shard waits). The first iteration only arms
    the watchdog: it includes the start of Ray Data's pipeline and of the Learners, which are
    not timed. :meth:`excuse` marks time in which waiting has a known cause already reported
    (the input store does not answer, a checkpoint waits for its store). A daemon thread checks
    every second.

    Args:
        timeout_s: seconds without progress before the process ends.
        excuse: returns True while waiting is explained (e.g. ``StorageHealth.failing``).
        clock: a monotonic clock.
        exit: what ends the process (``os._exit``; tests pass their own).

    Example:
        >>> now = [0.0]
        >>> w = StallWatchdog(60, clock=lambda: now[0], exit=lambda code: print("exit", code))
        >>> w.iteration(fresh_chunks=0, backlog=3)  # the first iteration arms it
        >>> now[0] = 59; w.check()
        False
        >>> now[0] = 61; w.check()
        exit 70
        True
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        excuse: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.timeout_s = float(timeout_s)
        self.excuse = excuse
        self.clock = clock
        self.exit = exit
        self.armed = False
        self.backlog: int | None = None  # fresh shards waiting after the last iteration
        self._last = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def progress(self) -> None:
        """Nothing is owed now (no fresh shard waits)."""
        self._last = self.clock()

    def iteration(self, *, fresh_chunks: int, backlog: int | None, shards_new: int = 0) -> None:
        """A training iteration completed: `fresh_chunks` chunks of fresh data were first
        trained on in it (`shards_new` shards became trained), `backlog` fresh shards wait
        after it (None: unknown). Progress when fresh data was trained or none waits; the
        first iteration arms the watchdog."""
        self.backlog = backlog
        if not self.armed or fresh_chunks > 0 or shards_new > 0 or backlog == 0:
            self._last = self.clock()
        self.armed = True

    def check(self) -> bool:
        """End the process if stalled; True if it was (only when `exit` returns, as in tests)."""
        now = self.clock()
        if not self.armed:
            return False
        if self.excuse():
            self._last = now
            return False
        if now - self._last <= self.timeout_s:
            return False
        waited = "fresh shards" if self.backlog is None else f"{self.backlog} fresh shard(s)"
        msg = (
            f"rlrec train: error: no fresh data trained for {now - self._last:.0f}s (--stall-timeout-s "
            f"{self.timeout_s:.0f}s) while {waited} waited and the input store answered; the data path "
            "(a read task, the feed, a PreLearner or a Learner) does not deliver; exiting so that "
            "`rlrec train --resume` continues from the last checkpoint"
        )
        log.error(msg)
        print(msg, file=sys.stderr, flush=True)
        self.exit(EXIT_STALLED)
        return True

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(1.0):
                if self.check():
                    return

        self._thread = threading.Thread(target=loop, name="rlrec-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
