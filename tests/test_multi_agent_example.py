"""docs/TRAINER.md's multi-agent example runs as written: its bash block (the one after the
``multi-agent-example`` marker) records simple_spread through `MultiAgentRecordingWrapper` into
an embedded broker, consumes, trains both modules with ``rlrec train --multi-agent`` and loads the
published version per module and whole without Ray (examples/multi_agent_spread.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mpe2")

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "TRAINER.md"
MARKER = "<!-- multi-agent-example: tests/test_multi_agent_example.py runs the next block -->"


def example_block(text: str) -> str:
    """The fenced bash block just after `MARKER` in `text` (ValueError: no marker, or no bash
    block right after it).

    Example:
        >>> example_block(MARKER + "\\n```bash\\necho hi\\n```\\n")
        'echo hi\\n'
    """
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == MARKER]
    if len(starts) != 1:
        raise ValueError(f"{len(starts)} example markers in the page (expected 1)")
    i = starts[0] + 1
    if i >= len(lines) or lines[i].strip() != "```bash":
        raise ValueError("the example marker is not followed by a ```bash block")
    end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
    return "".join(lines[i + 1 : end])


def test_the_example_block_is_found_in_the_page():
    code = example_block(DOC.read_text())
    assert 'python "$EX/multi_agent_spread.py" record' in code
    # every step is bounded: the broker wait, record's delivery, train's first shard and whole run
    assert "timeout 900 rlrec train --input data --checkpoint-dir run --multi-agent --algo BC" in code
    assert "--first-shard-timeout-s 60" in code and "--max-seconds 15" in code
    assert 'python "$EX/multi_agent_spread.py" act' in code


def run_block(code: str, cwd: Path, env: dict, timeout: float) -> tuple[int, str]:
    """Run `code` under ``bash -e`` in its own process group; on `timeout` the whole group (a
    broker and its Tansu included) is killed and the test fails. Returns (exit code, output)."""
    p = subprocess.Popen(
        ["bash", "-e", "-c", code],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, _ = p.communicate(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        pytest.fail(f"the block ran past {timeout} s and was killed (its process group with it)")
    return p.returncode, out


def _env(tmp_path: Path, path_first: Path | None = None) -> dict:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if path_first is not None:
        path = f"{path_first}{os.pathsep}{path}"
    (tmp_path / "tmp").mkdir(exist_ok=True)
    # the block's mktemp -d lands under tmp_path; Ray's sockets stay under a short path (107 bytes at most)
    env = {**os.environ, "PATH": path, "TMPDIR": str(tmp_path / "tmp")}
    env.setdefault("RAY_TMPDIR", os.environ.get("TMPDIR", "/tmp"))
    return env


def test_the_block_exits_when_the_broker_does_not_start_instead_of_waiting(tmp_path):
    code = example_block(DOC.read_text())
    head = code[: code.index("\n", code.index("KAFKA=$(")) + 1]
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "rlrec").write_text("#!/bin/sh\necho 'rlrec broker: error: Tansu exited with code 1' >&2\nexit 1\n")
    (stub / "rlrec").chmod(0o755)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    t0 = time.monotonic()
    rc, out = run_block(head + '\n[ -n "$KAFKA" ] && echo GOT-A-BROKER\n', tmp_path, _env(tmp_path, stub), 60)
    assert rc == 1 and "rlrec broker exited" in out and "GOT-A-BROKER" not in out, out
    assert time.monotonic() - t0 < 30


def test_record_exits_nonzero_when_messages_stay_undelivered(capsys):
    from examples.multi_agent_spread import main

    with pytest.raises(SystemExit) as e:
        main(["record", "--bootstrap-servers", "127.0.0.1:1", "--episodes", "1", "--flush-timeout-s", "1"])
    msg = str(e.value.code)
    assert msg.startswith("multi_agent_spread.py record: error: recorded 1 episodes, ")
    assert re.search(r", [1-9]\d* undelivered", msg), msg


@pytest.mark.slow
@pytest.mark.system
def test_the_documented_multi_agent_loop_runs_end_to_end(tmp_path):
    code = example_block(DOC.read_text())
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the block starts from the repository root
    rc, out = run_block(code, tmp_path, _env(tmp_path), timeout=540)
    assert rc == 0, out[-4000:]
    assert "recorded 80 episodes" in out and ", 0 undelivered" in out, out[-4000:]
    # 80 multi-agent episodes of 2 agents: 160 agent rows, none dead-lettered
    assert re.search(r"committed 160 episodes \(4,000 steps\) in \d+ shards .*; 0 dead letters", out), out[-4000:]
    # the block's own directory (mktemp -d); nothing in the directory it started from
    [work] = [d for d in (tmp_path / "tmp").iterdir() if (d / "broker.txt").exists()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["examples", "tmp"]
    assert sorted(p.name for p in (work / "data").iterdir() if not p.name.startswith("_")) == [
        "spread.random",
        "spread.scripted",
    ]
    assert "policy_version=1 signed=True ray_imported=False" in out, out[-4000:]
    m = re.search(r"scripted_agreement=([\d.]+) random_top_probability=([\d.]+) steps=(\d+)", out)
    assert m, out[-4000:]
    agreement, top, steps = float(m[1]), float(m[2]), int(m[3])
    assert steps == 20 * 25
    assert agreement >= 0.9, out[-4000:]
    assert top < 0.4, out[-4000:]  # the random module stays near uniform (0.2)
