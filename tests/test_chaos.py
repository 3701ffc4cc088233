"""The bounded chaos run (tests/chaos): 300 episodes, 3 kill -9s, an extra consumer, a storage
outage twice as long as the consumers' episode timeout, a consumer whose dead-letter topic the
broker refuses, a consumer of another output with the same group id, delayed rewards and a
broker restart; nothing may be lost or duplicated, and no
dead letter may be left unacknowledged.

Runs `python -m tests.chaos` as a subprocess, exactly as documented; the full version and its
last result are in docs/GUARANTEES.md ("Chaos run"). The run gets a time limit below the test's
own, so it ends with its report rather than being killed; if it is killed anyway, its whole
process group goes with it (no consumer outlives the test).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

#: seconds the test waits for the run; the run itself is limited to RUN_LIMIT_S
TEST_TIMEOUT_S = 900
RUN_LIMIT_S = 780
# pytest's own timeout (300 s by default) above both, so the run's report is what fails a slow run
pytestmark = [pytest.mark.system, pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S + 60)]

REPO = Path(__file__).resolve().parents[1]


def test_bounded_chaos_run_loses_and_duplicates_nothing(tmp_path):
    if os.environ.get("RLREC_TEST_BROKER", "tansu").strip().lower() not in ("", "tansu"):
        pytest.skip("the chaos run restarts its own Tansu broker (s3:// storage)")
    cmd = [
        sys.executable,
        "-m",
        "tests.chaos",
        "--episodes",
        "300",
        "--kills",
        "3",
        "--joins",
        "1",
        "--storage-faults",
        "1",
        "--seed",
        "7",
        "--time-limit",
        str(RUN_LIMIT_S),
        "--workdir",
        str(tmp_path / "chaos"),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the controller and everything it started
        stdout, stderr = proc.communicate()
        pytest.fail(f"the chaos run outlived its own {RUN_LIMIT_S} s limit:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of the run still there
        except ProcessLookupError:
            pass
    lines = stdout.strip().splitlines()
    tail = "\n".join(lines[-40:]) + "\n" + stderr[-3000:]
    assert lines and lines[-1] == "lost=0 duplicated=0 dead_letters_unacked=0", tail
    assert proc.returncode == 0, tail
    assert "broker restarted" in stdout and stdout.count("kill -9 consumer") == 3, tail
    assert "joins with a dead-letter topic the broker refuses" in stdout, tail
    assert "of another output joins the group" in stdout, tail  # the store decides where partitions resume
