"""bench/vector_columns.py's prototype is only a floor for the batched calls if it does their
work: it must send the messages N single calls send, byte for byte (no broker: a stand-in
producer keeps them)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_column_prototype_sends_the_bytes_of_single_calls():
    sys.path.insert(0, ROOT)
    from bench.vector_columns import check_identical

    assert check_identical(vector_steps=120) > 300  # messages compared, per Kafka key and in order
