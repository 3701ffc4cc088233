"""Logging set-up for the services: plain text or structured JSON lines, always on stderr."""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Literal

from rlrec.options import option

__all__ = ["JsonFormatter", "LogOptions", "quiet_ray_logging", "setup_logging"]


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


#: messages of Ray's and RLlib's loggers that are notices about their own APIs or defaults, not
#: about this run: RLlib's deprecation notices name its internal calls (nothing a user of rlrec
#: can change), "new API stack" says what rlrec chose, the token notice describes Ray's default
_RAY_NOTICES = ("DeprecationWarning", "Token authentication is enabled", "on the new API stack")


class _RayNoise(logging.Filter):
    """Drops Ray's INFO lines and its notices (:data:`_RAY_NOTICES`) from a handler; keeps
    Ray's warnings and errors about this run and every line of ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("ray"):
            return True
        if record.levelno < logging.WARNING:
            return False
        return record.levelno >= logging.ERROR or not any(n in record.getMessage() for n in _RAY_NOTICES)


def quiet_ray_logging() -> None:
    """Keep Ray's and RLlib's notices out of the log set up by :func:`setup_logging` (the
    trainer's log then carries rlrec's lines and Ray's real warnings and errors).

    Example:
        >>> setup_logging("text", "INFO")
        >>> quiet_ray_logging()
        >>> logging.getLogger("ray.rllib").warning("DeprecationWarning: `build` has been deprecated")  # dropped
    """
    import ray  # noqa: F401  (importing Ray sets up its own handlers, which get the filter too)

    for name in ("", "ray", "ray.rllib", "ray.data", "ray.tune", "ray.train"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _RayNoise) for f in handler.filters):
                handler.addFilter(_RayNoise())
