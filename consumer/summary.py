"""What a running consumer says in its log between its start and its stop.

* its first shard commit, at INFO (the data path works end to end);
* every shard commit, at DEBUG (``partition 3: committed 1 shard (120 episodes, 4,310 steps, 1.2 MiB) in 0.08 s``);
* every ``--summary-interval-s`` seconds, at INFO, what was committed since the last summary
  and since the start, and the lag per partition; with nothing committed yet, how long the
  first shard may take (``--max-file-age-s``).

It reads the consumer's metrics (`rlrec.consumer.metrics.ConsumerMetrics`): it keeps no count of
its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["ProgressLog", "human_bytes"]

log = logging.getLogger("rlrec.consumer")


def human_bytes(n: float) -> str:
    """Bytes in binary units, one decimal.

    Example:
        >>> human_bytes(512), human_bytes(3 * 2**20), human_bytes(5.5 * 2**30)
        ('512 B', '3.0 MiB', '5.5 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _total(counter: Any) -> float:
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def _lag(gauge: Any) -> dict[int, int]:
    return {
        int(s.labels["partition"]): int(s.value) for m in gauge.collect() for s in m.samples if "partition" in s.labels
    }


class ProgressLog:
    """The consumer's progress lines (module docstring).

    Args:
        metrics: the consumer's `ConsumerMetrics`.
        interval_s: seconds between summaries (0: none).
        max_file_age_s: the consumer's --max-file-age-s (for the line before the first shard).

    Example:
        >>> from rlrec.consumer.metrics import ConsumerMetrics
        >>> progress = ProgressLog(ConsumerMetrics(), interval_s=60, max_file_age_s=60)
        >>> progress.summary(now=progress.started + 61)
        'nothing committed yet in 61 s: the first shard of a partition is committed after --max-file-age-s (60 s) or a full shard'
    """

    def __init__(self, metrics: Any, interval_s: float = 60.0, max_file_age_s: float = 60.0) -> None:
        self.metrics = metrics
        self.interval_s = float(interval_s)
        self.max_file_age_s = float(max_file_age_s)
        self.started = time.monotonic()
        self._next = self.started + self.interval_s
        self._first_done = False
        self._last = (0.0, 0.0, 0.0, 0.0)  # episodes, steps, shards, bytes at the last summary

    def committed(self, partition: int, result: Any, seconds: float) -> None:
        """One commit of `partition` (a `CommitResult`), which took `seconds`."""
        if not result.shards:
            return
        level = logging.DEBUG if self._first_done else logging.INFO
        if log.isEnabledFor(level):
            first = "" if self._first_done else "first commit: "
            log.log(
                level,
                "%spartition %d: committed %d shard(s) (%s episodes, %s steps, %s) in %.2f s",
                first,
                partition,
                result.shards,
                f"{result.episodes:,}",
                f"{result.steps:,}",
                human_bytes(result.bytes),
                seconds,
            )
        self._first_done = True

    def tick(self, now: float | None = None) -> None:
        """Log a summary if one is due (call it from the consumer's loop)."""
        now = time.monotonic() if now is None else now
        if self.interval_s <= 0 or now < self._next:
            return
        self._next = now + self.interval_s
        log.info("%s", self.summary(now))

    def summary(self, now: float | None = None) -> str:
        """The summary line: committed since the last one and in total, lag per partition."""
        now = time.monotonic() if now is None else now
        m = self.metrics
        totals = (
            _total(m.episodes_committed),
            _total(m.steps_committed),
            _total(m.shards_committed),
            _total(m.bytes_committed),
        )
        took = now - self.started
        if not totals[2]:
            return (
                f"nothing committed yet in {took:.0f} s: the first shard of a partition is committed after "
                f"--max-file-age-s ({self.max_file_age_s:g} s) or a full shard"
            )
        new = [t - last for t, last in zip(totals, self._last)]
        self._last = totals
        lag = _lag(m.lag)
        lag_text = ", ".join(f"{p}: {n:,}" for p, n in sorted(lag.items())) if lag else "not reported yet"
        since = (
            f"since the last summary {new[0]:,.0f} episodes ({new[1]:,.0f} steps) in {new[2]:,.0f} shards "
            f"({human_bytes(new[3])})"
            if new[2]
            else "nothing new since the last summary"
        )
        return (
            f"{since}; in total {totals[0]:,.0f} episodes ({totals[1]:,.0f} steps) in "
            f"{totals[2]:,.0f} shards ({human_bytes(totals[3])}); lag per partition {lag_text}"
        )
