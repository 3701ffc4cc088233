"""docs/measurements/vector-batched-2026-11-29.md: the bold headline of each librdkafka row is
the median of the per-round batched/single ratios in the committed JSON (the paired measure of
alternated rounds), not the pooled median-over-median."""

from __future__ import annotations

import json
import os
import re
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASUREMENTS = os.path.join(ROOT, "docs", "measurements")


def _median_round_ratio(runs: list, trace: str) -> float:
    return statistics.median(x for r in runs for x in r["vector"][trace]["cpu_ratio_per_round"])


def test_the_bold_ratios_are_medians_of_per_round_ratios():
    with open(os.path.join(MEASUREMENTS, "bench-producer-vector-2026-11-29.json")) as f:
        runs = json.load(f)["runs"]
    with open(os.path.join(MEASUREMENTS, "vector-batched-2026-11-29.md")) as f:
        lines = f.read().splitlines()
    table = [line for line in lines if " | main | " in line or " | branch | " in line]
    kafka = table[:2]  # librdkafka's main and branch rows come first
    assert len(kafka) == 2 and kafka[0].startswith("| librdkafka")
    for side, line in zip(("main", "branch"), kafka):
        mine = [r for r in runs if r["producer"] == "kafka" and r["side"] == side]
        bold = [float(x) for x in re.findall(r"\*\*(\d\.\d\d)\*\*", line)]
        want = [round(_median_round_ratio(mine, t), 2) for t in ("vector_short", "vector_long")]
        assert bold == want, (side, line)
