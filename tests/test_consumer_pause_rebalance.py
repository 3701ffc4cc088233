"""A partition paused when it is revoked must be read again when the group assigns it back to
the same consumer.

librdkafka keeps a partition's pause flag across revoke and re-assignment to the same consumer.
The consumer pauses a partition whose flush failed; if a rebalance revokes it and gives it
back, the consumer must resume it (it forgot the pause, librdkafka did not), or the partition is
never read again and every episode on it stays uncommitted until the process restarts.
"""

from __future__ import annotations

import threading

import pytest

from rlrec.consumer.service import RecorderConsumer
from rlrec.producer import EpisodeRecorder
from rlrec.store.storage import Storage
from tests.helpers import ACT_SPACE, OBS_SPACE, record_episodes, wait_for
from tests.test_consumer_e2e import committed_episodes, read_all, run_consumer

pytestmark = pytest.mark.broker


class _PausingConsumer(RecorderConsumer):
    """Pauses every partition it holds when asked - on its own thread, as a failing flush does
    (librdkafka's pause() called from another thread blocks while consume() runs)."""

    pause_all = False

    def _maintain(self, now: float) -> None:
        if self.pause_all:
            self.pause_all = False
            for p in list(self.writers):
                self._pause(p)
        super()._maintain(now)


def test_partition_paused_at_revoke_is_read_after_reassignment(broker, topic, tmp_path, recorder_config):
    output = str(tmp_path / "out")
    cfg = recorder_config(output)
    storage = Storage.from_uri(output)
    rec = EpisodeRecorder(
        broker.bootstrap_servers, topic=topic, policy_id="pol", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )
    a = _PausingConsumer(cfg, storage)
    ta = threading.Thread(target=a.run, kwargs={"install_signals": False}, daemon=True)
    ta.start()
    b = tb = None
    try:
        truth = record_episodes(rec, 20, seed=61)
        rec.flush(10)
        wait_for(lambda: committed_episodes(storage) >= 20 and len(a.writers) == 4, 60, what="A owns everything")
        a.pause_all = True  # what a failing flush does to its partition
        wait_for(lambda: a._paused == {0, 1, 2, 3}, 60, what="A paused its partitions")
        # a member joins and leaves: every partition of A is revoked, and assigned back to A
        b, tb = run_consumer(cfg, storage)
        wait_for(lambda: len(b.writers) > 0, 60, what="B got partitions")
        b.stop()
        tb.join(30)
        wait_for(lambda: len(a.writers) == 4, 60, what="A owns everything again")
        truth.update(record_episodes(rec, 40, seed=62))  # on every partition
        rec.flush(10)
        wait_for(lambda: committed_episodes(storage) >= 60, 60, what="episodes on re-assigned partitions committed")
    finally:
        a.stop()
        ta.join(30)
        if b is not None:
            b.stop()
            tb.join(30)
        rec.close()
    assert set(read_all(storage)) == set(truth)
