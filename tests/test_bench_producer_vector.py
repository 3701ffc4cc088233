"""bench/producer.py's vector rows through ``--vector-producer stand-in`` (no broker): both sides
record the whole trace, every delivery report served, and the rows say which producer ran."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_stand_in_vector_rows_record_both_sides(capsys):
    """... and carry no target or verdict: the table says which producer ran each row."""
    sys.path.insert(0, ROOT)
    from bench.producer import STAND_IN, VECTOR_TARGET, print_vector_table, run_vector

    out = run_vector(STAND_IN, rounds=1, warmup=0, vector_steps=60)
    assert set(out) == {"vector_short", "vector_long"}
    for row in out.values():
        assert row["producer"] == "stand-in"
        assert row["target_cpu_ratio"] is None and row["pass"] is None
        assert row["cpu_ratio_median_per_round"] == row["cpu_ratio_per_round"][0]
        assert row["transitions"] > 60 * 60  # 64 sub-envs, a few reset rows left out
        assert row["batched_us_per_step"] > 0 and row["single_us_per_step"] > 0
    kafka = {"vector_kafka": {**out["vector_short"], "producer": "kafka", "target_cpu_ratio": VECTOR_TARGET}}
    print_vector_table({**out, **kafka})
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    assert [rows[n][1] for n in ("vector_short", "vector_long", "vector_kafka")] == ["stand-in", "stand-in", "kafka"]
    assert [rows[n][5] for n in ("vector_short", "vector_long", "vector_kafka")] == ["-", "-", str(VECTOR_TARGET)]
    assert "informative only" in lines[4]


def test_the_stand_in_serves_every_delivery_report_without_a_broker():
    sys.path.insert(0, ROOT)
    import numpy as np

    from bench.producer import STAND_IN, _StandInProducer, _vector_recorder

    rec = _vector_recorder(STAND_IN, "t")
    try:
        assert isinstance(rec._producer, _StandInProducer)
        ids = rec.begin_episodes(np.zeros((4, 4), np.float32))
        done = np.array([True, False, True, False])
        rec.log_steps(ids, np.zeros(4, np.int64), np.ones(4), np.ones((4, 4), np.float32), done, ~done)
        assert rec.flush(10) == 0
        st = rec.stats
        assert st.buffered == 0 and st.failed == 0 and st.delivered == st.produced > 8
    finally:
        rec.close(0)
