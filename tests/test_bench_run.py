"""`python bench/run.py --quick`: every benchmark runs and the JSON has exactly the documented shape.

Quick mode judges nothing (timings on shared CI machines mean nothing), so this checks the
schema and the bookkeeping (ratios, one row per figure), never speed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.slow, pytest.mark.broker]

ROW_KEYS = {"figure", "ours", "baseline", "ratio", "target", "pass", "rounds"}
PREFIXES = {"producer": 2, "consumer": 4, "trainer": 3, "manifest": 3}  # consumer: 3 + the memory benchmark


@pytest.mark.timeout(900)  # five quick benchmarks, each in its own processes
def test_quick_run_writes_the_documented_json(tmp_path):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "run.py"), "--quick", "--json", str(out), "--markdown", str(md)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert list(doc) == ["rows"] and isinstance(doc["rows"], list)
    rows = doc["rows"]
    for r in rows:
        assert set(r) == ROW_KEYS, r
        assert isinstance(r["figure"], str) and r["figure"]
        assert isinstance(r["target"], str) and r["target"]
        assert type(r["ours"]) is float and math.isfinite(r["ours"]), r
        assert r["baseline"] is None or (type(r["baseline"]) is float and r["baseline"] > 0), r
        assert type(r["ratio"]) is float and math.isfinite(r["ratio"]), r
        if r["baseline"] is not None:
            assert r["ratio"] == pytest.approx(r["ours"] / r["baseline"])
        assert r["pass"] is None, "quick mode judges nothing"
        assert r["rounds"] is None or (isinstance(r["rounds"], dict) and r["rounds"]["ours"]), r
    figures = [r["figure"] for r in rows]
    assert len(set(figures)) == len(figures)
    for name, n in PREFIXES.items():  # every benchmark contributed its rows
        assert sum(f.startswith(name + ":") for f in figures) == n, figures
    # each benchmark compares against a baseline measured in the same run
    for name in PREFIXES:
        assert any(r["baseline"] is not None for r in rows if r["figure"].startswith(name + ":")), name
    table = md.read_text().splitlines()
    assert table[0] == "| figure | ours | baseline | ratio | target | pass |"
    assert len(table) == 2 + len(rows) and all(line.count("|") == 7 for line in table)


def test_bad_arguments_fail_clearly():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "run.py"), "--only", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "unknown benchmark" in proc.stderr
