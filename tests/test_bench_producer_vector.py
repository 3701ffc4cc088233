"""bench/producer.py's vector rows through ``--vector-producer stand-in`` (no broker): both sides
record the whole trace, every delivery report served, and the rows say which producer ran."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_stand_in_vector_rows_record_both_sides():
    sys.path.insert(0, ROOT)
    from bench.producer import STAND_IN, run_vector

    out = run_vector(STAND_IN, rounds=1, warmup=0, vector_steps=60)
    assert set(out) == {"vector_short", "vector_long"}
    for row in out.values():
        assert row["producer"] == "stand-in"
        assert row["transitions"] > 60 * 60  # 64 sub-envs, a few reset rows left out
        assert row["batched_us_per_step"] > 0 and row["single_us_per_step"] > 0


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
