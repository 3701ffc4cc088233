"""`rlrec consume --processes N`: N consumer processes of one group under one supervisor
(`rlrec.supervisor`). Every child is a full `RecorderConsumer`; what is tested here is what the
supervisor adds: budgets split, children started together, a killed child restarted while its
partitions move, SIGTERM reaching every child, no child outliving a killed supervisor."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from rlrec.consumer.service import ConsumerConfig
from rlrec.local import FAST_GROUP_KAFKA
from rlrec.producer import EpisodeRecorder
from rlrec.store.maintenance import verify
from rlrec.store.manifest import read_manifest
from rlrec.store.storage import Storage
from rlrec.supervisor import ConsumerProcesses, split_config
from tests.helpers import ACT_SPACE, OBS_SPACE, record_episodes, wait_for
from tests.test_consumer_e2e import committed_episodes, drain_dlq, read_all


def test_split_config_shares_the_budgets_and_offsets_the_metrics_port():
    cfg = ConsumerConfig(
        bootstrap_servers="b:9092",
        output="/tmp/x",
        max_open_bytes=1000,
        max_buffered_bytes=601,
        max_open_episodes=5,
        max_episode_bytes=77,
        metrics_port=9108,
    )
    parts = [split_config(cfg, 3, i) for i in range(3)]
    assert [p.max_open_bytes for p in parts] == [333] * 3  # never more than the command's budget in all
    assert [p.max_buffered_bytes for p in parts] == [200] * 3
    assert [p.max_open_episodes for p in parts] == [2] * 3  # at least one each, rounded up
    assert {p.max_episode_bytes for p in parts} == {77}  # one episode's budget is not split
    assert [p.metrics_port for p in parts] == [9108, 9109, 9110]
    assert not any(p.create_topics for p in parts)  # the supervisor creates them once
    assert split_config(ConsumerConfig(bootstrap_servers="b", output="o", metrics_port=0), 2, 1).metrics_port == 0
    assert split_config(ConsumerConfig(bootstrap_servers="b", output="o"), 2, 1).metrics_port is None
    with pytest.raises(ValueError, match="processes must be >= 1"):
        ConsumerProcesses(cfg, 0)


def test_cli_refuses_zero_processes():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlrec",
            "consume",
            "--bootstrap-servers",
            "b:1",
            "--output",
            "/tmp/x",
            "--processes",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--processes must be at least 1" in r.stderr


def _start(broker, topic: str, output: str, group: str) -> subprocess.Popen:
    args = ["consume", "--bootstrap-servers", broker.bootstrap_servers, "--topic", topic, "--group-id", group]
    args += ["--output", output, "--no-create-topics", "--max-file-age-s", "0.3", "--commit-interval-s", "0.3"]
    args += ["--processes", "2"]
    args += [x for k, v in FAST_GROUP_KAFKA.items() for x in ("--kafka-config", f"{k}={v}")]
    return subprocess.Popen(
        [sys.executable, "-m", "rlrec", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def _children(proc: subprocess.Popen) -> list[psutil.Process]:
    """The supervisor's consumer children (multiprocessing's resource tracker is not one)."""
    kids = psutil.Process(proc.pid).children()
    return [k for k in kids if "resource_tracker" not in " ".join(k.cmdline())]


def _recorder(broker, topic: str) -> EpisodeRecorder:
    return EpisodeRecorder(
        broker.bootstrap_servers, topic=topic, policy_id="p", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=90)[1]
    except subprocess.TimeoutExpired:  # never leave it running
        for k in psutil.Process(proc.pid).children(recursive=True):
            k.kill()
        proc.kill()
        return proc.communicate()[1]


@pytest.mark.slow
@pytest.mark.broker
def test_two_processes_share_the_partitions_survive_a_killed_child_and_stop_on_sigterm(broker, topic, tmp_path):
    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    rec = _recorder(broker, topic)
    truth = record_episodes(rec, 40, seed=1)
    assert rec.flush(10) == 0
    proc = _start(broker, topic, output, f"g-{uuid.uuid4().hex[:6]}")
    try:
        wait_for(lambda: committed_episodes(storage) >= 40, 120, what="the first 40 episodes")
        first = _children(proc)
        assert len(first) == 2
        # both children wrote: the partitions were shared from the first assignment on
        writers = {e.writer.split(":")[-2] for e in read_manifest(storage)}  # host:pid:nonce
        assert writers == {str(k.pid) for k in first}, (writers, [k.pid for k in first])

        victim, survivor = first
        victim.kill()  # kill -9 of one child: its partitions move, it is started again
        victim.wait(10)
        truth.update(record_episodes(rec, 40, seed=2))  # traffic during the takeover
        assert rec.flush(10) == 0
        wait_for(
            lambda: len(_children(proc)) == 2 and victim.pid not in {k.pid for k in _children(proc)},
            60,
            what="the killed child restarted",
        )
        truth.update(record_episodes(rec, 20, seed=3))
        assert rec.flush(10) == 0
        wait_for(lambda: committed_episodes(storage) >= len(truth), 120, what="every episode committed")
        assert survivor.is_running()
        time.sleep(1.0)  # a late duplicate would show up here
        kids = _children(proc)
    finally:
        err = _stop(proc)
        rec.close()
    assert proc.returncode == 0, err[-3000:]
    assert "worker 0 started" in err and "died (signal 9)" in err
    for k in kids:  # SIGTERM reached every child, and each stopped gracefully
        assert not k.is_running()
    assert err.count("shutting down: flushing finished episodes") >= 2
    got = read_all(storage)  # raises on an episode committed twice
    assert set(got) == set(truth) and len(got) == committed_episodes(storage)
    assert verify(storage) == []
    assert drain_dlq(broker.bootstrap_servers, topic) == []


@pytest.mark.slow
@pytest.mark.broker
def test_children_stop_when_the_supervisor_is_killed(broker, topic, tmp_path):
    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    rec = _recorder(broker, topic)
    record_episodes(rec, 10, seed=4)
    assert rec.flush(10) == 0
    rec.close()
    proc = _start(broker, topic, output, f"g-{uuid.uuid4().hex[:6]}")
    kids = []
    try:
        wait_for(lambda: committed_episodes(storage) >= 10, 120, what="the episodes committed")
        kids = _children(proc)
        assert len(kids) == 2
        proc.kill()  # kill -9 of the supervisor
        proc.wait(10)
        _gone, alive = psutil.wait_procs(kids, timeout=60)
        assert not alive, f"children outlived their supervisor: {[k.pid for k in alive]}"
    finally:
        for k in kids:
            if k.is_running():
                k.kill()
        _stop(proc)
    assert committed_episodes(storage) == 10
    assert len(read_all(storage)) == 10
