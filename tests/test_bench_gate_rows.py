"""bench/run.py's rows of the gate's decision benchmark (bench/ope_decisions.py), from a result
document: one row per task, epsilon and figure, judged against the issue's targets in full runs."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _table(fp: int, better: int, canary: int, datasets: int = 4) -> dict:
    return {
        "auto": {
            "false_promotions": fp,
            "datasets_with_a_clearly_better_published": better,
            "datasets_refused_to_the_canary": canary,
            "datasets": datasets,
        },
        "always publish": {"false_promotions": 28},
    }


def test_gate_rows_judge_false_promotions_and_decided_datasets():
    sys.path.insert(0, ROOT)
    from bench.run import BENCHES, ROWS, gate_rows

    assert "gate" in BENCHES and ROWS["gate"] is gate_rows
    doc = {
        "tasks": {
            "cartpole": {"gamma": 0.99, "by_epsilon": {"0.3": _table(0, 3, 1), "0.05": _table(1, 0, 4)}},
            "contextual": {"gamma": 0.9, "by_epsilon": {"0.3": _table(0, 2, 1)}},
        }
    }
    rows = gate_rows(doc, quick=False)
    assert len(rows) == 3 * 3 and len({r.figure for r in rows}) == len(rows)
    assert all(r.figure.startswith("gate: ") for r in rows)
    fp = [r for r in rows if "truly worse" in r.figure]
    # false promotions: judged against 0, beside always publishing's count
    assert [(r.ours, r.baseline, r.pass_) for r in fp] == [(0.0, 28.0, True), (1.0, 28.0, False), (0.0, 28.0, True)]
    decided = [r for r in rows if "or refused to the canary" in r.figure]
    # every dataset decided (published, or refused to the canary) passes; 3 of 4 does not
    assert [(r.ours, r.ratio, r.pass_) for r in decided] == [(4.0, 1.0, True), (4.0, 1.0, True), (3.0, 0.75, False)]
    reported = [r for r in rows if r.target == "reported"]
    assert [r.ours for r in reported] == [3.0, 0.0, 2.0] and all(r.pass_ is None for r in reported)
    # every figure names its task and epsilon
    assert [r.figure.split(" (gamma")[0].rsplit(", ", 1)[-1] for r in fp] == ["cartpole", "cartpole", "contextual"]
    assert all("logging epsilon " in r.figure for r in rows)
    # quick runs judge nothing
    assert all(r.pass_ is None for r in gate_rows(doc, quick=True))


def test_combine_adds_datasets_of_several_runs_and_refuses_a_mix(tmp_path):
    """bench/ope_decisions.py --combine: datasets of several runs (whole-run and per-dataset
    JSON) in one summary per task and epsilon, each dataset once, the runs' settings equal."""
    import json

    import pytest

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from ope_decisions import combine, dataset_ids, per_dataset

    m = os.path.join(ROOT, "docs", "measurements")
    each = os.path.join(m, "ope-decisions-2026-11-29")
    whole = os.path.join(m, "ope-decisions-2026-11-28-tuned-mb-contextual.json")  # datasets 1, 2
    new = [os.path.join(each, f"contextual-eps0.3-d{d}.json") for d in (2, 3)]
    doc = combine([whole, *new])
    task = doc["tasks"]["contextual"]
    assert [r["dataset"] for r in task["raw"]["0.3"]] == [0, 1, 2, 3] and len(task["raw"]["0.05"]) == 2
    assert task["by_epsilon"]["0.3"]["auto"]["datasets"] == 4
    assert task["by_epsilon"]["0.3"]["always publish"]["false_promotions"] == 16
    assert "| contextual | 0.3 | 4 (3030) | 1,200 |" in per_dataset(doc)
    with pytest.raises(ValueError, match="is also in"):
        combine([whole, new[0], new[0]])
    other = json.load(open(new[0]))
    other["settings"]["fqe_steps"] += 1
    path = tmp_path / "other.json"
    path.write_text(json.dumps(dict(other, dataset=7)))
    with pytest.raises(ValueError, match="other settings"):
        combine([whole, str(path)])
    assert dataset_ids("0.3=2,3;0.05=1", [0.3, 0.05], 4) == {0.3: [2, 3], 0.05: [1]}
    with pytest.raises(ValueError):
        dataset_ids("0.3=2", [0.3, 0.05], 4)
