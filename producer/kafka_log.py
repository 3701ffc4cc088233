"""librdkafka's own log lines and errors through Python `logging`, each distinct line at most once a minute.

Every Kafka client rlrec makes (the recorder in a user's service, the consumer, the admin
clients of the tools) is given :func:`kafka_logger` as its ``logger``: without one librdkafka
writes each connection retry to stderr itself, hundreds of lines a minute for a broker that
cannot be reached. :func:`repeat_limited` puts the same limit on a logger of ours (the
recorder's reports of librdkafka's ``error_cb``).

Standard library only.
"""

from __future__ import annotations

import logging
import re
import threading
import time

__all__ = ["KAFKA_LOGGER", "REPEAT_WINDOW_S", "RepeatFilter", "kafka_logger", "repeat_limited"]

#: the logger librdkafka's own log lines go to (``logger=`` of every client we make)
KAFKA_LOGGER = "rlrec.librdkafka"
#: a distinct line passes at most once in this many seconds
REPEAT_WINDOW_S = 60.0

#: librdkafka's own count of repeats, part of an otherwise identical line
_SUPPRESSED = re.compile(r", \d+ identical error\(s\) suppressed")


class RepeatFilter(logging.Filter):
    """Passes a line once per `window_s` seconds: lines that differ only in numbers (client
    ids, ports, counts, milliseconds) are the same line, and so are records logged with the same
    ``extra={"repeat_key": ...}`` (e.g. delivery failures of different episodes with one cause);
    the next one that passes says how many were dropped.

    Args:
        window_s: how long a passed line holds back its repeats.
        max_lines: distinct lines remembered (all are forgotten when more come).

    Example:
        >>> f = RepeatFilter()
        >>> [f.filter(logging.makeLogRecord({"msg": f"connect to :{p} failed"})) for p in (1, 2)]
        [True, False]
    """

    def __init__(self, window_s: float = REPEAT_WINDOW_S, max_lines: int = 1000) -> None:
        super().__init__()
        self.window_s = window_s
        self.max_lines = max_lines
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}  # line -> (when passed, dropped since)

    def filter(self, record: logging.LogRecord) -> bool:
        key = getattr(record, "repeat_key", None) or record.getMessage()
        key = re.sub(r"\d+", "#", _SUPPRESSED.sub("", key))
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self.window_s:
                self._seen[key] = (seen[0], seen[1] + 1)
                return False
            if len(self._seen) >= self.max_lines:
                self._seen.clear()
            self._seen[key] = (now, 0)
        if seen is not None and seen[1]:
            record.msg = f"{record.getMessage()} ({seen[1]} like it in the last {self.window_s:.0f} s not shown)"
            record.args = ()
        return True


def repeat_limited(logger: logging.Logger) -> logging.Logger:
    """`logger`, with each distinct line passed at most once a minute (:class:`RepeatFilter`).

    Example:
        >>> log = repeat_limited(logging.getLogger("rlrec.example"))
        >>> repeat_limited(log) is log
        True
    """
    if not any(isinstance(f, RepeatFilter) for f in logger.filters):
        logger.addFilter(RepeatFilter())
    return logger


def kafka_logger() -> logging.Logger:
    """The logger for librdkafka's own log lines (pass it as ``logger=`` to a confluent_kafka
    client): WARNING and above only, a repeated line at most once a minute.

    Example:
        >>> from confluent_kafka import Producer
        >>> p = Producer({"bootstrap.servers": "127.0.0.1:9092", "logger": kafka_logger()})
    """
    logger = logging.getLogger(KAFKA_LOGGER)
    if not any(isinstance(f, RepeatFilter) for f in logger.filters):
        repeat_limited(logger)
        logger.setLevel(logging.WARNING)
    return logger
