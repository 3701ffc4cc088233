"""Logging set-up for the services: plain text or structured JSON lines, always on stderr."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

from rlrec.options import option

__all__ = ["NATIVE_NOTICES", "JsonFormatter", "LogOptions", "drop_native_notices", "quiet_ray_logging", "setup_logging"]


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


class StderrHandler(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is when a record is emitted: a
    program that runs rlrec's commands in-process (a test capturing output, a notebook) may swap
    ``sys.stderr``, and a handler holding the old stream would write to a closed file.

    Example:
        >>> import io, logging
        >>> h = StderrHandler()
        >>> sys.stderr, saved = io.StringIO(), sys.stderr
        >>> h.emit(logging.makeLogRecord({"msg": "hello"}))
        >>> sys.stderr.getvalue(), setattr(sys, "stderr", saved)
        ('hello\\n', None)
    """

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ and setStream assign it: ignored
        pass


def cli_logging(level: int = logging.WARNING) -> None:
    """A short-lived command's logging: records at `level` and above to stderr as
    ``LEVEL name: message`` (a no-op when logging is already configured, as `logging.basicConfig`).
    """
    logging.basicConfig(level=level, handlers=[StderrHandler()], format="%(levelname)s %(name)s: %(message)s")


@dataclass
class LogOptions:
    """The logging options every long-running command has (``--log-format``, ``--log-level``)."""

    log_format: Literal["text", "json"] = option("text", help="text, or json: one JSON object per line")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = option("INFO", help="log level", normalize=str.upper)


def setup_logging(fmt: str = "text", level: str = "INFO", worker: int | None = None) -> None:
    """Log to stderr as text or JSON lines; `worker` (a child of `rlrec consume --processes N`)
    tags every line with the child's index."""
    handler = StderrHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(worker))
    else:
        tag = "" if worker is None else f"[worker {worker}] "
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


#: messages of Ray's and RLlib's loggers that are notices about their own APIs, defaults or
#: optional packages, not about this run: RLlib's and Ray Data's deprecation notices name their
#: internal calls or arguments rlrec passes for the user (nothing a user of rlrec can change; the
#: test suite's warning summary shows them to rlrec's developers), "new API stack" says what rlrec
#: chose, the token notice describes Ray's default, gputil is for Tune's GPU monitor (unused),
#: progress bars are off on purpose
_RAY_NOTICES = (
    "DeprecationWarning",
    "is deprecated",
    "Token authentication is enabled",
    "on the new API stack",
    "Install gputil",
    "Progress bars disabled",
)

#: Ray's loggers that install their own stderr handlers (``ray`` and ``ray.rllib`` at import,
#: ``ray.data`` from its logging config); the others propagate into these
_RAY_LOGGERS = ("ray", "ray.rllib", "ray.data")


class _RayNoise(logging.Filter):
    """Drops Ray's INFO lines and its notices (:data:`_RAY_NOTICES`) from a handler; keeps
    Ray's warnings and errors about this run and every line of ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "py.warnings":  # Python warnings, routed by logging.captureWarnings
            return "RayDeprecationWarning" not in record.getMessage()
        if not record.name.startswith("ray"):
            return True
        if record.levelno < logging.WARNING:
            return False
        return record.levelno >= logging.ERROR or not any(n in record.getMessage() for n in _RAY_NOTICES)


def quiet_ray_logging() -> None:
    """Route Ray's, RLlib's and Ray Data's log records, and Python warnings, into the log set
    up by :func:`setup_logging` (its format, text or JSON), keeping their INFO lines and
    notices (:data:`_RAY_NOTICES`) out: the trainer's log then carries rlrec's lines and Ray's
    real warnings and errors. Ray's own stderr handlers are removed (file handlers, such as Ray
    Data's ``ray-data.log`` in the session directory, stay); call it before ``ray.init`` (which,
    with ``configure_logging=False``, leaves the ``ray`` logger to its caller). It imports
    ``ray.rllib`` and ``ray.data`` (~2 s), whose imports install the handlers it replaces.

    Example:
        >>> setup_logging("text", "INFO")
        >>> quiet_ray_logging()
        >>> logging.getLogger("ray.rllib").warning("DeprecationWarning: `build` has been deprecated")  # dropped
    """
    # importing them installs Ray's stderr handlers, replaced below
    import ray.data
    import ray.rllib  # noqa: F401

    for name in _RAY_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        logger.propagate = True
    logging.captureWarnings(True)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _RayNoise) for f in handler.filters):
            handler.addFilter(_RayNoise())


#: lines Ray's C++ core writes straight to the driver's stderr (as well as to its log file in
#: Ray's session directory) that are notices, not failures of the run: at the creation of every
#: actor that may be restarted and has constructor arguments in the object store (Ray Data's
#: PreLearner actor) Ray writes an ERROR line (core_worker.cc) saying that such a restart could
#: fail (ray-project/ray#53727), although nothing failed
NATIVE_NOTICES = ("has constructor arguments in the object store and max_restarts > 0",)

#: the relay: copies its stdin to its stdout line by line, without the lines holding a notice
#: (argv); ignores SIGINT (a Ctrl-C meant for the service) and exits at end of input, i.e. when
#: every writer of the service's stderr has exited, so nothing written before a crash is lost
_RELAY = """
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
notices = [n.encode() for n in sys.argv[1:]]
for line in sys.stdin.buffer:
    if not any(n in line for n in notices):
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
"""


#: the relay processes started by :func:`drop_native_notices`
_relays: list = []


def drop_native_notices(notices: tuple[str, ...] = NATIVE_NOTICES) -> bool:
    """Keep Ray's C++ notices (:data:`NATIVE_NOTICES`) out of this process's stderr.

    Ray's C++ core writes its ERROR lines to file descriptor 2 directly, past Python's logging,
    and Ray has no setting that drops one of them without dropping all of them (and from its
    log file too). So stderr becomes a pipe into a small relay process that copies every other
    line, unchanged and in order, to the original stderr. The relay outlives a crash of this
    process (it stops at end of input), so a fatal line written just before one still arrives.
    Call once, in a service's main process (``rlrec train``). Returns False, and changes nothing,
    where the relay cannot start.

    Args:
        notices: substrings of the lines to drop.

    Example (a service's main, before ``ray.init``; tests/test_error_contract.py runs it)::

        setup_logging("text", "INFO")
        quiet_ray_logging()
        drop_native_notices()
        ray.init(address="local", log_to_driver=False, configure_logging=False)
    """
    import subprocess

    sys.stderr.flush()
    try:
        relay = subprocess.Popen(
            [sys.executable, "-c", _RELAY, *notices],
            stdin=subprocess.PIPE,
            stdout=2,  # the original stderr
            start_new_session=True,  # a Ctrl-C or group signal for the service does not stop it
        )
    except OSError as e:
        logging.getLogger("rlrec").debug("stderr relay not started: %s", e)
        return False
    os.dup2(relay.stdin.fileno(), 2)
    relay.stdin.close()  # fd 2 is now the pipe's only write end here
    _relays.append(relay)  # kept: it runs as long as this process (a dropped Popen warns)
    return True
