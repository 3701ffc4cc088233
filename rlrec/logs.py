"""Logging set-up for the services: plain text or structured JSON lines, always on stderr."""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Literal

from rlrec.options import option

__all__ = ["JsonFormatter", "LogOptions", "setup_logging"]


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (+ worker, exc)."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.worker is not None:
            out["worker"] = self.worker
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


@dataclass
class LogOptions:
    """The logging options every long-running command has (``--log-format``, ``--log-level``)."""

    log_format: Literal["text", "json"] = option("text", help="text, or json: one JSON object per line")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = option("INFO", help="log level", normalize=str.upper)


def setup_logging(fmt: str = "text", level: str = "INFO", worker: int | None = None) -> None:
    """Log to stderr as text or JSON lines; `worker` (a child of `rlrec consume --processes N`)
    tags every line with the child's index."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(worker))
    else:
        tag = "" if worker is None else f"[worker {worker}] "
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
