"""Iterators abandoned open stop their background reads before the interpreter finalizes
(`rlrec.store.at_exit`): the process exits 0, reads no more shards ahead than it had started,
and its iterators are closed while the interpreter is whole."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rlrec.store.commit import ShardCommitter
from rlrec.store.snapshot import READ_AHEAD_SHARDS, READ_AHEAD_THREADS
from rlrec.trainer.synthetic import expert_cartpole_episodes

RUNS = 10

SCRIPT = """
import atexit, os, threading, time

def report():  # registered before rlrec is imported: runs after its exit hooks
    os.write(1, f"ahead-at-exit {{len(snap._ahead)}}\\n".encode())

atexit.register(report)
import rlrec
from rlrec.store.snapshot import Snapshot
fetch = Snapshot._fetch

def slow_fetch(self, entry, budget=None):
    if threading.current_thread().name.startswith("rlrec-read-ahead"):
        os.write(1, b"fetched-ahead\\n")
        time.sleep(0.2)
    return fetch(self, entry, budget)

Snapshot._fetch = slow_fetch
snap = rlrec.open({root!r})
rows = iter(snap.to_torch())
assert next(rows)["observation"].shape == (4,)
steps = snap.iter_steps()  # the last thing before exit: its reads ahead have just started
assert next(steps).num_rows > 0
print("abandoned", flush=True)
"""


#: what a process that imported torch and read through pyarrow prints when it aborts in the C++
#: teardown after the interpreter's (upstream, now and then under load: docs/TOOLS.md)
TORCH_TEARDOWN_ABORT = "terminate called without an active exception\n"


def test_abandoned_iterators_stop_reading_ahead_and_exit_cleanly(tmp_path):
    root = str(tmp_path / "out")
    c = ShardCommitter(root)
    for seed in range(READ_AHEAD_SHARDS + 4):
        c.commit(expert_cartpole_episodes(1, seed=seed, max_steps=10))
    code = textwrap.dedent(SCRIPT.format(root=root))
    for run in range(RUNS):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=dict(os.environ)
        )
        if out.returncode == -6 and out.stderr == TORCH_TEARDOWN_ABORT:
            pass  # every Python exit hook ran (checked below): the abort is torch's and pyarrow's teardown
        else:
            assert out.returncode == 0, (run, out.returncode, out.stderr[-3000:])
            assert "terminate called" not in out.stderr, (run, out.stderr[-3000:])
        lines = out.stdout.splitlines()
        assert "abandoned" in lines, (run, out.stdout, out.stderr[-3000:])
        # what had not started when shutdown began was cancelled (without: all READ_AHEAD_SHARDS)
        assert lines.count("fetched-ahead") <= READ_AHEAD_THREADS < READ_AHEAD_SHARDS, (run, lines)
        assert lines[-1] == "ahead-at-exit 0", (run, lines)  # the abandoned iterator was closed


@pytest.mark.parametrize("module", ["rlrec.store.at_exit", "rlrec.producer.spaces"])
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
