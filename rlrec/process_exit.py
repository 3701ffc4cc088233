"""End a process the way the interpreter would, without the native teardown that follows.

A process that imported torch and read Parquet through pyarrow may abort after its work is done,
in the C++ teardown that follows the interpreter's ("terminate called without an active
exception", exit code 134; upstream, docs/TOOLS.md). :func:`exit_process` does the exit work
that matters to a Python program -- the threading exit hooks (concurrent.futures',
:mod:`rlrec.store.at_exit`'s), the join of non-daemon threads, the :mod:`atexit` handlers (Ray's
shutdown, ``logging.shutdown``, ``weakref.finalize``), the flush of stdout, stderr and C's stdio
-- in the interpreter's order, then ends the process with ``os._exit``: the module teardown and
the native static destructors after it are skipped. Files must be closed by then (a ``with``
block); objects' ``__del__`` do not run at exit.

The ``rlrec`` program ends this way when torch was imported (:func:`rlrec.cli.run`); a script
that embeds rlrec can end with ``exit_process(0)`` the same way.

Example:
    >>> import subprocess, sys
    >>> script = "import atexit; from rlrec.process_exit import exit_process; " \\
    ...     "atexit.register(print, 'atexit ran'); print('done'); exit_process(3)"
    >>> p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    >>> p.returncode, p.stdout
    (3, 'done\\natexit ran\\n')
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import typing

__all__ = ["exit_process", "system_exit_code"]

#: the exit code of a process whose stdout could not be flushed at exit, as the interpreter's
FLUSH_FAILED = 120


def system_exit_code(e: SystemExit) -> int:
    """The exit code the interpreter gives a process that ends with `e` (None: 0, an int: itself,
    anything else: printed to stderr, 1).

    Args:
        e: the SystemExit (``sys.exit(code)``, argparse's exits).

    Example:
        >>> system_exit_code(SystemExit(None)), system_exit_code(SystemExit(2))
        (0, 2)
    """
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def exit_process(code: int) -> typing.NoReturn:
    """Run the interpreter's exit work, then end the process with `code`, skipping the native
    teardown (see the module's docstring). Call it from the main thread, as the last thing.

    Args:
        code: the exit code (0-255).

    Example:
        >>> import subprocess, sys
        >>> script = "from rlrec.process_exit import exit_process; print('x' * 100_000, end=''); exit_process(0)"
        >>> p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        >>> p.returncode, len(p.stdout)
        (0, 100000)
    """
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None:  # an interpreter without it: its own exit, teardown included
        sys.exit(code)
    shutdown()  # threading's exit hooks, then every non-daemon thread joined
    atexit._run_exitfuncs()
    os._exit(_flushed(code))


def _flushed(code: int) -> int:
    """`code` once stdout, stderr and C's stdio are flushed; FLUSH_FAILED if stdout's flush
    failed (a closed pipe), as the interpreter reports it."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            continue
        try:
            stream.flush()
        except Exception as e:
            if name == "stdout":
                code = FLUSH_FAILED
                _ignored(stream, e)
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:  # no C library to ask (e.g. Windows): Python's own streams are flushed
        pass
    return code


def _ignored(stream: typing.TextIO, e: Exception) -> None:
    """Say on stderr, as the interpreter does, that flushing `stream` failed."""
    try:
        sys.stderr.write(f"Exception ignored in: {stream!r}\n{type(e).__name__}: {e}\n")
        sys.stderr.flush()
    except Exception:
        pass
