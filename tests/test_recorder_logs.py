"""What the recorder writes to its host service's log when Kafka cannot be reached.

The recorder runs inside our users' services: a broker that is down for a while must cost the
service's log a few lines a minute, not one per connection retry. librdkafka's own lines go
through Python's `logging` (logger ``rlrec.librdkafka``) and, like the recorder's reports of
librdkafka's error callback, pass each distinct line at most once a minute.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

#: the service: records a few steps for `seconds` against a closed port, then closes
_SERVICE = """
import logging, sys, time
import numpy as np
from gymnasium import spaces as gs
from rlrec import EpisodeRecorder

if sys.argv[3] == "configured":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
rec = EpisodeRecorder(
    sys.argv[1], observation_space=gs.Box(-1, 1, (2,), np.float32), action_space=gs.Discrete(2),
    max_batch_delay_s=0.05,
)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    eid = rec.begin_episode(np.zeros(2, np.float32))
    rec.log_step(eid, 0, 1.0, np.zeros(2, np.float32), terminated=True)
    time.sleep(0.5)
rec.close(timeout=1)
print("closed", file=sys.stderr)
"""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("logging_setup", ["configured", "unconfigured"])
def test_unreachable_broker_costs_a_few_lines(logging_setup):
    seconds = 12
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SERVICE), f"127.0.0.1:{_closed_port()}", str(seconds), logging_setup],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    lines = proc.stderr.splitlines()
    assert proc.returncode == 0 and lines[-1] == "closed", proc.stderr
    raw = [line for line in lines if line.startswith("%")]  # librdkafka writing to stderr itself
    assert not raw, proc.stderr
    # per distinct line once a minute: a connect failure and the error callback's report of it,
    # the "all brokers down" report, the closing summary of undelivered messages
    assert len(lines) <= 10, f"{len(lines)} lines in {seconds} s:\n{proc.stderr}"
    assert any("Connection refused" in line or "brokers are down" in line for line in lines), proc.stderr
