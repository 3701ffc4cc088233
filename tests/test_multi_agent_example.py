"""docs/TRAINER.md's multi-agent example runs as written: its bash block (the one after the
``multi-agent-example`` marker) records simple_spread through `MultiAgentRecordingWrapper` into
an embedded broker, consumes, trains both modules with ``rlrec train --multi-agent`` and loads the
published version per module and whole without Ray (examples/multi_agent_spread.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
    assert "python examples/multi_agent_spread.py record" in code
    assert "rlrec train --input data --checkpoint-dir run --multi-agent --algo BC" in code
    assert "python examples/multi_agent_spread.py act" in code


@pytest.mark.slow
@pytest.mark.system
def test_the_documented_multi_agent_loop_runs_end_to_end(tmp_path):
    code = example_block(DOC.read_text())
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the block runs from the repository root
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "recorded 80 episodes" in out and ", 0 undelivered" in out, out[-4000:]
    # 80 multi-agent episodes of 2 agents: 160 agent rows, none dead-lettered
    assert re.search(r"committed 160 episodes \(4,000 steps\) in \d+ shards .*; 0 dead letters", out), out[-4000:]
    assert sorted(p.name for p in (tmp_path / "data").iterdir() if not p.name.startswith("_")) == [
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
