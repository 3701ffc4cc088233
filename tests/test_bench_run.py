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
# rows per benchmark: producer 4 workloads x (CPU, p99, wire bytes) + 3 paced achieved rates + 2
# vector rows (batched vs single calls, short and long episodes);
# consumer 2 sizes x 3 sides (1 process fsync / no fsync, 2 processes) x 2 baselines x (steps/s,
# CPU µs/step) + RSS,
# + 1 from the memory benchmark;
# trainer (T2 x 2, T1 x 2) x 2 stock configurations + T3 x 2 + T3 p99 while compacting (T4 only in
# full runs); manifest 3; store: per synthetic store (episode and tabular shards; no demo store in
# quick runs) files and median size after compaction vs before, 3 readers x 3 paths (local files, S3
# files, rlrec.open), compaction steps/s; gate: the contextual task at epsilon 0.3 (quick) x (false
# promotions, clearly better published or refused to the canary, clearly better published)
PREFIXES = {"producer": 17, "consumer": 26, "trainer": 11, "manifest": 3, "store": 24, "gate": 3}
BENCHES = ["producer", "consumer", "memory", "trainer", "manifest", "store", "gate"]


@pytest.mark.system
@pytest.mark.timeout(600)  # six quick benchmarks, each in its own processes
def test_quick_run_writes_the_documented_json(tmp_path):
    out, md, png, readme = tmp_path / "bench.json", tmp_path / "bench.md", tmp_path / "bench.png", tmp_path / "R.md"
    sys.path.insert(0, ROOT)
    from bench.run import README_BEGIN, README_END

    readme.write_text(f"# title\n\n{README_BEGIN}\nold table\n{README_END}\n\n## next\n")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "run.py"),
            "--quick",
            "--json",
            str(out),
            "--markdown",
            str(md),
            "--png",
            str(png),
            "--readme",
            str(readme),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert list(doc) == ["rows", "run", "machine", "results"]
    # the run and the machine the numbers came from
    assert doc["run"]["quick"] is True and doc["run"]["duration_s"] > 0 and doc["run"]["started"]
    m = doc["machine"]
    assert type(m["cpus"]) is int and m["cpus"] >= 1 and m["python"]
    assert m["versions"]["ray"] and m["versions"]["pyarrow"] and m["versions"]["librdkafka"]
    assert sorted(doc["results"]) == sorted(BENCHES)  # every child's own JSON is kept
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
        rounds = r["rounds"]
        assert rounds is None or (isinstance(rounds, dict) and rounds["ours"]), r
        if rounds is not None and rounds.get("spread"):  # raw rounds: the median lies within them
            lo, hi = rounds["spread"]["ours"]
            assert lo <= r["ours"] <= hi and min(rounds["ours"]) == lo and max(rounds["ours"]) == hi, r
            if r["baseline"] is not None and rounds["baseline"]:
                blo, bhi = rounds["spread"]["baseline"]
                assert blo <= r["baseline"] <= bhi, r
    figures = [r["figure"] for r in rows]
    assert len(set(figures)) == len(figures)
    for name, n in PREFIXES.items():  # every benchmark contributed its rows
        assert sum(f.startswith(name + ":") for f in figures) == n, figures
    # each benchmark compares against a baseline measured in the same run
    for name in PREFIXES:
        assert any(r["baseline"] is not None for r in rows if r["figure"].startswith(name + ":")), name
    # the fair comparisons are there: paced producer workloads, the consumer's (c) pipeline with
    # both durabilities, the pinned stock trainer
    assert any("paced 20k/s" in f for f in figures) and any("84×84×4 paced 2k/s" in f for f in figures)
    for episodes in ("short episodes", "long episodes"):  # batched calls against N single calls
        (row,) = [
            r
            for r in rows
            if r["figure"].startswith("producer: CPU µs/sub-env step, vector") and episodes in r["figure"]
        ]
        assert row["target"] == "ratio ≤ 0.5" and row["baseline"] > 0, row
    assert any("(c) same + ray.data write_parquet" in f and "no fsync" in f for f in figures)
    assert any("(c) same + ray.data write_parquet" in f and "--processes 2" in f for f in figures)
    assert any(f.startswith("trainer: (T2)") and "input_read_batch_size=" in f for f in figures)
    # T1 and T2 against both stock configurations, each row naming its own; judged (in full
    # runs) against the materialized one only
    for fig in ("trainer: (T2) learner updates/s", "trainer: (T1) distinct"):
        for mode, target in (("stock materialized (", "ratio ≥"), ("stock streaming (", "reported")):
            (row,) = [r for r in rows if r["figure"].startswith(fig) and mode in r["figure"]]
            assert row["target"].startswith(target) or row["baseline"] is None, row
    c = doc["results"]["consumer"]["sizes"]["cartpole"]
    assert c["pipeline_blocks"][0] == c["shards"][0]  # (c) wrote as many blocks as rlrec wrote shards
    table = md.read_text().splitlines()
    assert table[0] == "| figure | ours | baseline | ratio | target | pass |"
    assert len(table) == 2 + len(rows) and all(line.count("|") == 7 for line in table)
    # README's block is regenerated from the JSON, the rest of the file is untouched
    text = readme.read_text()
    assert text.startswith("# title\n\n" + README_BEGIN) and text.endswith(README_END + "\n\n## next\n")
    assert "old table" not in text and "\n".join(table) in text and doc["run"]["started"] in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_fail_clearly():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "run.py"), "--only", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "unknown benchmark" in proc.stderr


def test_merge_keeps_earlier_benchmarks_and_says_where_each_came_from():
    """`--merge`: this run's results replace the benchmarks it ran, the rest stay, every row is
    made again from the merged results, and the README block names each benchmark's run."""
    sys.path.insert(0, ROOT)
    from bench.run import merge, readme_block

    meas = os.path.join(ROOT, "docs", "measurements")
    with open(os.path.join(meas, "bench-full-2026-11-24-2105.json")) as f:
        old = json.load(f)
    with open(os.path.join(meas, "bench-consumer-2026-11-25.json")) as f:
        new = json.load(f)
    doc = merge(old, new, quick=False)
    assert list(doc["results"]) == ["producer", "consumer", "memory", "trainer"]
    assert doc["results"]["consumer"] == new["results"]["consumer"]
    assert doc["results"]["producer"] == old["results"]["producer"]
    by_figure = {r["figure"]: r for r in doc["rows"]}
    for r in old["rows"]:  # rows of the benchmarks not run again are the same rows
        if r["figure"].startswith("producer:"):
            assert by_figure[r["figure"]] == r
    # the old trainer run measured the streaming stock configuration only: its rows keep their
    # numbers and now name that baseline, reported (the judged baseline is the materialized one)
    old_trainer = [r for r in old["rows"] if r["figure"].startswith("trainer:")]
    new_trainer = [r for r in doc["rows"] if r["figure"].startswith("trainer:")]
    assert [(r["ours"], r["baseline"]) for r in new_trainer] == [(r["ours"], r["baseline"]) for r in old_trainer]
    for r in new_trainer:
        if r["baseline"] is not None:
            assert "vs stock streaming (materialize_data=materialize_mapped_data=False" in r["figure"], r
            assert r["target"] == "reported" and r["pass"] is None, r
    assert [r for r in doc["rows"] if r["figure"].startswith("consumer: steps/s")] == [
        r for r in new["rows"] if r["figure"].startswith("consumer: steps/s")
    ]
    src = doc["run"]["sources"]
    assert src["consumer"]["started"] == new["run"]["started"] and src["producer"]["started"] == old["run"]["started"]
    block = readme_block(doc)
    assert f"consumer from the run started {new['run']['started']} UTC" in block
    assert f"producer, memory, trainer from the run started {old['run']['started']} UTC" in block
    again = merge(doc, new, quick=False)  # merging onto a merged JSON keeps its sources
    assert again["run"]["sources"] == doc["run"]["sources"]


@pytest.mark.system
@pytest.mark.timeout(300)
def test_quick_multi_agent_rows(tmp_path):
    """`--only multi_agent_producer,multi_agent_consumer,multi_agent_split`: the multi-agent rows,
    each with its raw rounds; the producer's CPU row is the one with a target."""
    pytest.importorskip("mpe2")
    out = tmp_path / "ma.json"
    names = ["multi_agent_producer", "multi_agent_consumer", "multi_agent_split"]
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "run.py"),
            "--quick",
            "--only",
            ",".join(names),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert list(doc["results"]) == names
    rows = doc["rows"]
    assert [r["figure"].split(",")[0] for r in rows] == [
        "producer: CPU µs/env step",
        "producer: log_multi_agent_step p99 µs",
        *["consumer: CPU µs/agent step"] * 4,
    ]
    assert [r["target"] for r in rows] == ["ratio ≤ 1.5"] + ["reported"] * 5
    for r in rows:
        assert set(r) == ROW_KEYS and r["pass"] is None and r["ours"] > 0, r
        assert r["rounds"]["ours"] and min(r["rounds"]["ours"]) <= r["ours"] <= max(r["rounds"]["ours"]), r
        if r["baseline"] is not None:
            assert math.isclose(r["ratio"], r["ours"] / r["baseline"]), r
    producer = doc["results"]["multi_agent_producer"]["rounds"]
    assert rows[0]["rounds"]["baseline"] == [x["three_single"]["cpu_us_per_env_step"] for x in producer]
