"""Child processes of the demo: each in a session of its own, logging to a file, stopped politely.

A child never sees the terminal's Ctrl-C (it is in its own session); the demo decides when and
in which order children stop: SIGTERM to the child, wait, and only after a timeout SIGKILL to its
whole process group (which also takes down helpers it started, e.g. Ray's processes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["Child", "stop_all"]


class Child:
    """One child process. stderr goes to `log_path`; stdout lines that are JSON objects are
    status reports (the latest is kept in `status`), other stdout lines go to the log too."""

    def __init__(self, name: str, argv: list[str], log_path: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.status: dict[str, Any] = {}
        self.killed = False
        self._log = None
        self._reader: threading.Thread | None = None

    def start(self) -> Child:
        self._log = open(self.log_path, "ab", buffering=0)
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=self.env,
            start_new_session=True,
            close_fds=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"rlrec-demo-{self.name}", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.strip()
            if line.startswith(b"{"):
                try:
                    self.status = json.loads(line)
                    continue
                except ValueError:
                    pass
            if self._log is not None and line:
                try:
                    self._log.write(raw)
                except (OSError, ValueError):
                    pass

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def terminate(self) -> None:
        if self.alive():
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # start_new_session: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass
        self.killed = True

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the child to exit; True if it did."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=max(0.0, timeout))
            return True
        except subprocess.TimeoutExpired:
            return False

    def close(self) -> None:
        if self._reader is not None:
            self._reader.join(5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 16384))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def stop_all(
    children: list[Child], timeout: float, say=lambda msg: None, hurry: threading.Event | None = None
) -> list[str]:
    """SIGTERM every child, wait up to `timeout` s for all (less once `hurry` is set), SIGKILL
    (process group) the rest. Also reaps lingering members of each child's process group.
    Returns the names of the children killed."""
    for c in children:
        c.terminate()
    deadline = time.monotonic() + timeout
    while any(c.alive() for c in children) and time.monotonic() < deadline:
        if hurry is not None and hurry.is_set():
            break
        time.sleep(0.1)
    killed = []
    for c in children:
        if not c.wait(deadline - time.monotonic() if hurry is None or not hurry.is_set() else 0):
            say(f"{c.name} did not stop in time: killing it")
            c.kill_group()
            c.wait(10)
            killed.append(c.name)
    for c in children:
        _reap_group(c)
        c.close()
    return killed


def _reap_group(c: Child) -> None:
    """Left-over processes in a stopped child's group (helpers it started and did not stop)."""
    if c.proc is None:
        return
    try:
        os.killpg(c.proc.pid, 0)
    except (ProcessLookupError, PermissionError):
        return
    # something of the group is still alive: give it a moment, then kill it
    for _ in range(20):
        time.sleep(0.25)
        try:
            os.killpg(c.proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
    print(f"rlrec demo: killing left-over processes of {c.name}", file=sys.stderr)
    c.kill_group()
