"""bench/vector_floor.py's per-episode parts (no broker): both sides record the whole trace with
their delivery reports held and served on the caller's thread, the timers leave the recorder's
methods as they were, and what the floor replays is every message the single calls sent."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_parts_of_both_sides_cover_the_trace():
    sys.path.insert(0, ROOT)
    from bench.producer import VectorTrace
    from bench.vector_floor import _recorded, parts
    from rlrec.producer.batched import BatchedCalls
    from rlrec.producer.recorder import EpisodeRecorder

    methods = [BatchedCalls.begin_episodes, BatchedCalls.log_steps, BatchedCalls._emit_rows, EpisodeRecorder._emit]
    v = VectorTrace(False, 60)
    out = parts(v, rounds=1)
    assert [
        BatchedCalls.begin_episodes,
        BatchedCalls.log_steps,
        BatchedCalls._emit_rows,
        EpisodeRecorder._emit,
    ] == methods
    for side in ("batched", "single"):
        row = out[side]
        for key in ("start", "steps", "encode_send", "harness", "delivery_reports", "total_timed", "total_unwrapped"):
            assert row[key] > 0, (side, key, row)
    # every episode's start and batch, plus the open ones' last batches and aborts at close
    assert 2 <= out["messages_per_episode"] < 2.5
    single = _recorded("single", v, False)[3]
    batched = _recorded("batched", v, True)[3]
    assert len(single) == len(batched)  # the same messages (byte identity: tests/test_recorder_batched.py)
    assert all(records >= 1 for _, _, _, records in single)
