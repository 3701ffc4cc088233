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

The ``rlrec`` program ends this way when torch was imported (:func:`rlrec.cli.run`), through
:func:`exit_uncaught` when an exception escapes it; a script that embeds rlrec can end with
``exit_process(0)`` the same way.

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
import signal
import sys
import threading
import traceback
import types
import typing

__all__ = ["exit_process", "exit_uncaught", "system_exit_code"]

#: the exit code of a process whose stdout or stderr could not be flushed at exit, as the interpreter's
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
        code: the exit code; the process ends with ``code & 0xFF``, as the OS reports any int
            given to ``sys.exit`` (120 instead if stdout or stderr could not be flushed).

    Raises:
        RuntimeError: called from a thread other than the main one (the exit work joins every
            non-daemon thread, the calling one included).

    Example:
        >>> import subprocess, sys
        >>> script = "from rlrec.process_exit import exit_process; print('x' * 100_000, end=''); exit_process(0)"
        >>> p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        >>> p.returncode, len(p.stdout)
        (0, 100000)
    """
    _require_main_thread()
    os._exit(_exit_work(code) & 0xFF)


def exit_uncaught(e: BaseException) -> typing.NoReturn:
    """End the process as the interpreter ends one that `e` escaped from, without its native
    teardown: a SystemExit's code; a KeyboardInterrupt's traceback, then death by SIGINT; any
    other exception's traceback (``sys.excepthook``), then exit code 1. Call it from the main
    thread, in the ``except`` block that caught `e` at the top of the program.

    Args:
        e: the exception that would otherwise end the program.

    Raises:
        RuntimeError: called from a thread other than the main one.

    Example:
        >>> import subprocess, sys
        >>> script = "from rlrec.process_exit import exit_uncaught\\ntry:\\n    1 / 0\\n" \\
        ...     "except BaseException as e:\\n    exit_uncaught(e)"
        >>> p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        >>> p.returncode, p.stderr.splitlines()[-1]
        (1, 'ZeroDivisionError: division by zero')
    """
    _require_main_thread()
    if isinstance(e, SystemExit):
        exit_process(system_exit_code(e))
    e.__traceback__ = _from_the_top(e.__traceback__)  # the hook prints the exception's own
    sys.excepthook(type(e), e, e.__traceback__)
    if not isinstance(e, KeyboardInterrupt):
        exit_process(1)
    _exit_work(0)
    if os.name == "posix":  # as the interpreter: the parent (a shell) sees the user's Ctrl-C
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(128 + signal.SIGINT)


def _require_main_thread() -> None:
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("exit_process: call it from the main thread")


def _from_the_top(tb: types.TracebackType | None) -> types.TracebackType | None:
    """`tb` (of an exception caught in some frame) with that frame's callers in front, as the
    traceback of an exception that reached the top of the program through them reads."""
    frame = tb.tb_frame.f_back if tb is not None else None
    while frame is not None:
        tb = types.TracebackType(tb, frame, frame.f_lasti, frame.f_lineno)
        frame = frame.f_back
    return tb


def _exit_work(code: int) -> int:
    """Run threading's exit hooks and joins, then the atexit handlers, then flush: `code`, or
    FLUSH_FAILED if stdout or stderr could not be flushed."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None:  # an interpreter without it: its own exit, teardown included
        sys.exit(code)
    try:
        shutdown()  # threading's exit hooks, then every non-daemon thread joined
    except BaseException as e:  # the interpreter reports it and goes on with the exit
        _report_unraisable(threading, e, e.__traceback__.tb_next if e.__traceback__ else None)
    atexit._run_exitfuncs()
    return _flushed(code)


def _flushed(code: int) -> int:
    """`code` once stdout, stderr and C's stdio are flushed; FLUSH_FAILED if the flush of stdout or
    stderr failed (a closed pipe), as the interpreter reports it. Closed streams are skipped; the
    original streams are flushed too when sys.stdout or sys.stderr was replaced."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or getattr(stream, "closed", False):
            continue
        try:
            stream.flush()
        except Exception as e:
            code = FLUSH_FAILED
            if name == "stdout":
                _report_unraisable(stream, e, None)
    for stream in (sys.__stdout__, sys.__stderr__):
        if stream is None or stream in (sys.stdout, sys.stderr) or getattr(stream, "closed", False):
            continue
        try:
            stream.flush()
        except Exception:  # as at an ordinary exit: the code is that of sys.stdout and sys.stderr
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:  # no C library to ask (e.g. Windows): Python's own streams are flushed
        pass
    return code


def _report_unraisable(obj: object, e: BaseException, tb: types.TracebackType | None) -> None:
    """Say on stderr that `e`, raised in `obj`, was ignored, in the words of the interpreter's
    default ``sys.unraisablehook``."""
    kind = type(e)
    module = kind.__module__
    name = kind.__qualname__ if module in ("builtins", "__main__") else f"{module}.{kind.__qualname__}"
    lines = [f"Exception ignored in: {obj!r}\n"]
    if tb is not None:
        lines += ["Traceback (most recent call last):\n", *traceback.format_tb(tb)]
    lines.append(f"{name}: {e}\n")
    try:
        sys.stderr.write("".join(lines))
        sys.stderr.flush()
    except Exception:
        pass
