"""The one retry schedule: exponential backoff with jitter.

Every retry in rlrec uses it: storage calls retried in place (`rlrec.store.storage.Storage`),
and the retries scheduled in the background -- a failed flush, a failed publish, an undelivered
dead letter, an unreachable schema registry, a consumer process that crashed. A blocking retry
asks `RetryPolicy.delay` how long to sleep; a scheduled one keeps a `RetrySchedule` (failures
so far, since when, when next) and asks it whether the next attempt is due.

Standard library only: the supervisor and the consumer import it at start-up.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["BACKGROUND", "RetryPolicy", "RetrySchedule"]


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter: after failed attempt ``i`` (0-based) wait
    ``d * (1 - jitter * U)``, ``d = min(max_delay, base_delay * 2**i)``, ``U`` uniform in [0, 1).

    ``jitter=1`` is full jitter (AWS's advice for many clients retrying one store), ``0.5``
    keeps every wait between half and all of ``d``, ``0`` none (a schedule a person reads).

    Args:
        attempts: attempts in all, for a retry in place; None retries for ever (a schedule).
        base_delay: the first wait before jitter, in seconds.
        max_delay: the longest wait before jitter, in seconds.
        jitter: the random fraction of each wait, in [0, 1].

    Example::

        >>> p = RetryPolicy(attempts=3, base_delay=0.5, max_delay=30.0, jitter=0)
        >>> [p.delay(i) for i in range(8)]
        [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
        >>> p.gives_up(3)
        True
    """

    attempts: int | None = 5
    base_delay: float = 0.05
    max_delay: float = 2.0
    jitter: float = 1.0

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be >= 1 (or None: for ever)")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("RetryPolicy delays must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("RetryPolicy.jitter must be in [0, 1]")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0-based)."""
        d = min(self.max_delay, self.base_delay * 2.0 ** min(max(attempt, 0), 60))
        return d * (1.0 - self.jitter * random.random()) if self.jitter else d

    def gives_up(self, failures: int) -> bool:
        """Whether ``failures`` failed attempts exhaust the policy (never when ``attempts`` is None)."""
        return self.attempts is not None and failures >= self.attempts


#: background retries (flush, publish, dead letters, schema registry): 0.5 s doubling to 30 s,
#: each wait between half and all of that, for ever
BACKGROUND = RetryPolicy(attempts=None, base_delay=0.5, max_delay=30.0, jitter=0.5)


@dataclass
class RetrySchedule:
    """One thing retried in the background: its failures so far, since when, when next.

    Args:
        policy: the schedule of waits (`BACKGROUND` unless said otherwise).

    Example::

        >>> s = RetrySchedule(RetryPolicy(attempts=None, base_delay=1.0, max_delay=4.0, jitter=0))
        >>> s.failed(now=100.0), s.failed(now=101.0), s.due(102.0), s.due(103.0)
        (1.0, 2.0, False, True)
        >>> s.failures, s.since
        (2, 100.0)
        >>> s.succeeded(); s.failures, s.since, s.due(0.0)
        (0, None, True)
    """

    policy: RetryPolicy = BACKGROUND
    failures: int = 0
    since: float | None = None  # the first failure of the current run
    next_at: float = 0.0

    def failed(self, now: float) -> float:
        """An attempt failed at ``now``: schedule the next one; returns the wait."""
        wait = self.policy.delay(self.failures)
        self.failures += 1
        self.since = now if self.since is None else self.since
        self.next_at = now + wait
        return wait

    def succeeded(self) -> None:
        """An attempt worked: the next failure starts from the first wait again."""
        self.failures, self.since, self.next_at = 0, None, 0.0

    def due(self, now: float) -> bool:
        return now >= self.next_at
