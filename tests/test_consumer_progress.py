"""A running consumer says what it does, and a clean stop frees its partitions.

* its first shard commit at INFO, each later one at DEBUG, and every --summary-interval-s a
  summary at INFO (episodes, steps, shards, lag per partition);
* after a clean stop its owner leases are released: ``rlrec compact`` right after it takes the
  partitions instead of waiting for the leases to expire; the same for ``rlrec convert``'s output.
"""

from __future__ import annotations

import logging
import threading

import pytest

from rlrec.cli import main
from rlrec.consumer.service import RecorderConsumer
from rlrec.producer import EpisodeRecorder
from rlrec.store.compaction import compact_unowned
from rlrec.store.ownership import read_lease
from rlrec.store.storage import Storage
from tests.helpers import ACT_SPACE, OBS_SPACE, record_episodes


@pytest.mark.broker
@pytest.mark.slow
def test_progress_lines_and_released_leases_after_a_clean_stop(broker, topic, recorder_config, tmp_path, caplog):
    rec = EpisodeRecorder(broker.bootstrap_servers, topic, observation_space=OBS_SPACE, action_space=ACT_SPACE)
    try:
        record_episodes(rec, 30, seed=1)
        assert rec.flush(10) == 0
    finally:
        rec.close()
    cfg = recorder_config(tmp_path / "out", summary_interval_s=1.0)
    storage = Storage.from_uri(cfg.output)
    c = RecorderConsumer(cfg, storage)
    with caplog.at_level(logging.DEBUG, logger="rlrec.consumer"):
        t = threading.Thread(target=c.run, kwargs={"max_seconds": 8, "install_signals": False}, daemon=True)
        t.start()
        t.join(60)
    assert not t.is_alive()
    info = [r.getMessage() for r in caplog.records if r.name == "rlrec.consumer" and r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.name == "rlrec.consumer" and r.levelno == logging.DEBUG]
    firsts = [m for m in info if m.startswith("first commit: partition ")]
    assert len(firsts) == 1 and "episodes" in firsts[0] and "steps" in firsts[0], info
    assert not any(": committed " in m and not m.startswith("first commit") for m in info), info
    assert any(": committed " in m for m in debug), debug
    summaries = [m for m in info if m.startswith(("since the last summary", "nothing new since the last summary"))]
    assert summaries, info
    assert "in total 30 episodes" in summaries[-1] and "lag per partition" in summaries[-1]
    # the clean stop released every partition it held: compact takes them at once
    leases = [read_lease(storage, cfg.topic, p) for p in range(4)]
    assert [x.released for x in leases if x is not None] and all(x.released for x in leases if x is not None)
    results, refused = compact_unowned(storage, min_age_s=0, watch_s=0.1)
    assert refused == [], refused
    assert sorted(r.partition for r in results) == [0, 1, 2, 3]


def test_convert_output_is_compactable_at_once(tmp_path, capsys):
    from tests.test_convert import _episodes, _write_tabular

    _write_tabular(_episodes(), tmp_path / "in")
    out = tmp_path / "out"
    args = ["convert", "--from", "tabular", str(tmp_path / "in"), "--output", str(out), "--policy-id", "expert"]
    assert main([*args, "--episodes-per-shard", "2"]) == 0
    capsys.readouterr()
    results, refused = compact_unowned(Storage.from_uri(str(out)), min_age_s=0, watch_s=0.1)
    assert refused == [], refused
    assert results[0].replaced == 3


def test_no_commit_yet_says_when_the_first_shard_is_due():
    from rlrec.consumer.metrics import ConsumerMetrics
    from rlrec.consumer.summary import ProgressLog

    p = ProgressLog(ConsumerMetrics(), interval_s=30, max_file_age_s=60)
    line = p.summary(now=p.started + 30)
    assert line.startswith("nothing committed yet in 30 s") and "--max-file-age-s (60 s)" in line


def test_compact_says_what_it_waits_for_and_speaks_human_units(tmp_path, capsys):
    import re

    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0)
    for k in range(3):
        c.commit(expert_cartpole_episodes(2, seed=k, max_steps=30))
    assert main(["compact", root, "--min-age", "0", "--force"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("rlrec compact: 1 partition log(s) under ") and "checking their owner leases" in err, err
    assert re.fullmatch(r"rl/00000: replaced 3 shard\(s\) \(\d+\.\d KiB\) with 1 \(\d+\.\d KiB\)\n", out), out
