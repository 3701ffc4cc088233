"""How a service command (``consume``, ``train``) ends after SIGINT or SIGTERM: its clean stop
first, then exit code 128 + the signal's number (130, 143), as a shell reports a process killed
by it and as ``rlrec demo`` does, so a script tells an interrupted run from a finished one.

Standard library only (see :mod:`rlrec.cli`).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

__all__ = ["StopSignals", "exit_code_after"]

_NAMES = ("SIGINT", "SIGTERM")


def exit_code_after(rc: int, signum: int | str | None) -> int:
    """`rc`, or 128 + the signal's number when the run ended cleanly (`rc` 0) on SIGINT or SIGTERM.

    Args:
        rc: the exit code of the run.
        signum: the signal that stopped it (its number or name), None if none did.

    Example:
        >>> exit_code_after(0, "SIGINT"), exit_code_after(0, signal.SIGTERM), exit_code_after(0, "max iterations")
        (130, 143, 0)
    """
    if isinstance(signum, str):
        signum = signal.Signals[signum] if signum in _NAMES else None
    if rc == 0 and signum in (signal.SIGINT, signal.SIGTERM):
        return 128 + int(signum)
    return rc


class StopSignals:
    """SIGINT and SIGTERM call `stop` (the service's clean stop) and are remembered.

    Args:
        stop: what a signal does (e.g. ``RecorderConsumer.stop``).

    Example:
        >>> calls = []
        >>> signals = StopSignals(lambda: calls.append("stop")).install()
        >>> signals.signum is None, signals.exit_code(0)
        (True, 0)
        >>> signals.restore()
    """

    def __init__(self, stop: Callable[[], Any]) -> None:
        self._stop = stop
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        self._stop()

    def install(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def exit_code(self, rc: int) -> int:
        """`rc` after the run, or 130 / 143 if a signal stopped it (:func:`exit_code_after`)."""
        return exit_code_after(rc, self.signum)
