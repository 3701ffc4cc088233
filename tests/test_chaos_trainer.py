"""The trainer's chaos run (tests/chaos_trainer.py), short form: a live consumer commits shards while
the trainer rides out an S3 outage, a killed Ray worker and two kill -9s (each followed by
--resume) and stops on SIGTERM; every committed shard must be new in exactly one published
version, and versions must only grow. Runs `python -m tests.chaos_trainer` as a subprocess,
exactly as documented in docs/TRAINER.md §8."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.system, pytest.mark.broker, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def test_trainer_chaos_run_trains_every_shard_once_with_outage_worker_kill_and_two_kill9s(tmp_path):
    if os.environ.get("RLREC_TEST_BROKER", "tansu").strip().lower() not in ("", "tansu"):
        pytest.skip("the trainer's chaos run starts its own Tansu broker")
    cmd = [sys.executable, "-m", "tests.chaos_trainer", "--seed", "3", "--kills", "2", "--outage-s", "8"]
    proc = subprocess.run(
        [*cmd, "--workdir", str(tmp_path / "chaos")], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    lines = proc.stdout.strip().splitlines()
    tail = "\n".join(lines[-40:]) + "\n" + proc.stderr[-3000:]
    assert lines and re.fullmatch(
        r"shards=(\d+) trained_once=\1 missing=0 twice=0 versions_monotonic=yes", lines[-1]
    ), tail
    assert int(lines[-1].split()[0].split("=")[1]) > 0, tail
    assert proc.returncode == 0, tail
    out = proc.stdout
    assert "driver WARNING after" in out, tail  # within 30 s of the outage's start
    assert "shards committed during the outage trained" in out and "no restart" in out, tail
    assert "kill -9 Ray worker" in out, tail
    assert out.count("kill -9 #") >= 4 and "trainer #3 started" in out, tail  # two kills, each resumed
    assert "SIGTERM: trainer exited with 143" in out, tail
