"""`rlrec consume --processes N`: N consumer processes of one group under one supervisor
(`rlrec.supervisor`). Every child is a full `RecorderConsumer`; what is tested here is what the
supervisor adds: budgets split, children started together, a killed child restarted while its
partitions move, SIGTERM reaching every child, no child outliving a killed supervisor."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
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
from rlrec.supervisor import (
    RESTARTS,
    ConsumerProcesses,
    check_split,
    split_config,
)
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
    assert [p.max_open_bytes for p in parts] == [333] * 3  # together never more than the command's budget
    assert [p.max_buffered_bytes for p in parts] == [200] * 3
    assert [p.max_open_episodes for p in parts] == [1] * 3
    assert {p.max_episode_bytes for p in parts} == {77}  # one episode's budget is not split
    assert [p.metrics_port for p in parts] == [9108, 9109, 9110]
    assert not any(p.create_topics for p in parts)  # the supervisor creates them once
    assert split_config(ConsumerConfig(bootstrap_servers="b", output="o", metrics_port=0), 2, 1).metrics_port == 0
    assert split_config(ConsumerConfig(bootstrap_servers="b", output="o"), 2, 1).metrics_port is None
    with pytest.raises(ValueError, match="processes must be >= 1"):
        ConsumerProcesses(cfg, 0)


def test_a_share_below_one_episode_is_refused():
    cfg = ConsumerConfig(bootstrap_servers="b", output="o", max_open_bytes=256, max_episode_bytes=64)
    check_split(cfg, 4)  # 64 each: one episode fits
    with pytest.raises(ValueError, match="leaves 51 each, less than one episode's --max-episode-bytes 64"):
        ConsumerProcesses(cfg, 5)


def test_restarts_double_and_give_up_after_a_few_quick_crashes():
    assert [RESTARTS.delay(n) for n in (0, 1, 2, 3)] == [1.0, 2.0, 4.0, 8.0]
    assert RESTARTS.delay(30) == RESTARTS.max_delay
    assert (
        RESTARTS.attempts >= 2 and not RESTARTS.gives_up(RESTARTS.attempts - 1) and RESTARTS.gives_up(RESTARTS.attempts)
    )


@pytest.mark.parametrize(
    ("processes", "says"),
    [("0", "--processes must be at least 1"), ("20", "split between 20 processes leaves")],
)
def test_cli_refuses_bad_process_counts(processes, says):
    # 20 processes: 1 GiB of --max-open-bytes leaves each less than one 64 MiB episode
    cmd = [sys.executable, "-m", "rlrec", "consume", "--bootstrap-servers", "b:1", "--output", "/tmp/x"]
    r = subprocess.run(
        [*cmd, "--processes", processes],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and says in r.stderr, r.stderr[-2000:]


class _Lines:
    """Collects a process's stderr lines on a thread; `wait_for(text)` blocks until one has it."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait_for(self, text: str, timeout: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: any(text in x for x in self.lines), timeout):
                raise AssertionError(f"no line with {text!r} in {timeout}s: {''.join(self.lines)[-3000:]}")

    def text(self) -> str:
        self._thread.join(30)
        return "".join(self.lines)


def _start(broker, topic: str, output: str, group: str, *extra: str) -> tuple[subprocess.Popen, _Lines]:
    args = ["consume", "--bootstrap-servers", broker.bootstrap_servers, "--topic", topic, "--group-id", group]
    args += ["--output", output, "--no-create-topics", "--max-file-age-s", "0.3", "--commit-interval-s", "0.3"]
    args += ["--processes", "2", *extra]
    args += [x for k, v in FAST_GROUP_KAFKA.items() for x in ("--kafka-config", f"{k}={v}")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlrec", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    return proc, _Lines(proc.stderr)  # read as it comes: a full pipe would block the children


def _children(proc: subprocess.Popen) -> list[psutil.Process]:
    """The supervisor's consumer children (multiprocessing's resource tracker is not one)."""
    kids = psutil.Process(proc.pid).children()
    return [k for k in kids if "resource_tracker" not in " ".join(k.cmdline())]


def _recorder(broker, topic: str) -> EpisodeRecorder:
    return EpisodeRecorder(
        broker.bootstrap_servers, topic=topic, policy_id="p", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )


def _recorded(broker, topic: str, tmp_path, n: int, seed: int) -> tuple[str, Storage, EpisodeRecorder, dict]:
    """An output dir, its storage, a recorder, and the truth of `n` episodes it has delivered."""
    output = str(tmp_path / "out")
    rec = _recorder(broker, topic)
    truth = record_episodes(rec, n, seed=seed)
    assert rec.flush(10) == 0
    return output, Storage.from_uri(output), rec, truth


def _kill_all(proc: subprocess.Popen, kids: list[psutil.Process]) -> None:
    """Leave nothing running: kill -9 the children a test knew of and the supervisor."""
    for k in kids:
        if k.is_running():
            k.kill()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _stop(proc: subprocess.Popen, lines: _Lines) -> str:
    """SIGTERM the supervisor and wait (kill everything if it does not end); its stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:  # never leave it running
        _kill_all(proc, psutil.Process(proc.pid).children(recursive=True))
    return lines.text()


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.broker
def test_two_processes_share_the_partitions_survive_a_killed_child_and_stop_on_sigterm(broker, topic, tmp_path):
    output, storage, rec, truth = _recorded(broker, topic, tmp_path, 40, seed=1)
    proc, lines = _start(broker, topic, output, f"g-{uuid.uuid4().hex[:6]}")
    try:
        wait_for(lambda: committed_episodes(storage) >= 40, 120, what="the first 40 episodes")
        first = _children(proc)
        assert len(first) == 2
        # both children wrote, and no partition changed hands: the group assigned once (the
        # start gate), not once to the first child and again when the second joined
        by_partition: dict[int, set[str]] = {}
        for e in read_manifest(storage):
            by_partition.setdefault(e.partition, set()).add(e.writer.split(":")[-2])  # host:pid:nonce
        assert all(len(w) == 1 for w in by_partition.values()), by_partition
        assert set().union(*by_partition.values()) == {str(k.pid) for k in first}, by_partition

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
        err = _stop(proc, lines)
        rec.close()
    assert proc.returncode == 143, err[-3000:]  # 128 + SIGTERM, after the clean stop
    assert "worker 0 started" in err and "died (signal 9)" in err
    for k in kids:  # SIGTERM reached every child, and each stopped gracefully
        assert not k.is_running()
    assert err.count("shutting down: flushing finished episodes") >= 2
    got = read_all(storage)  # raises on an episode committed twice
    assert set(got) == set(truth) and len(got) == committed_episodes(storage)
    assert verify(storage) == []
    assert drain_dlq(broker.bootstrap_servers, topic) == []


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.broker
def test_children_stop_when_the_supervisor_is_killed(broker, topic, tmp_path):
    output, storage, rec, _truth = _recorded(broker, topic, tmp_path, 10, seed=4)
    rec.close()
    proc, lines = _start(broker, topic, output, f"g-{uuid.uuid4().hex[:6]}")
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
        _kill_all(proc, kids)
    err = lines.text()  # the children wrote to it until they ended
    assert err.count("is gone; stopping") == 2, err[-3000:]
    assert err.count("shutting down: flushing finished episodes") == 2  # each stopped gracefully
    assert committed_episodes(storage) == 10
    assert len(read_all(storage)) == 10


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.broker
def test_sigterm_while_the_children_start_stops_them_all(broker, topic, tmp_path):
    proc, lines = _start(broker, topic, str(tmp_path / "out"), f"g-{uuid.uuid4().hex[:6]}")
    kids = []
    try:
        lines.wait_for("worker 1 started", 60)
        kids = _children(proc)
        proc.send_signal(signal.SIGTERM)  # the children are still importing or at the start gate
        assert proc.wait(90) == 143  # 128 + SIGTERM, after the clean stop
        _gone, alive = psutil.wait_procs(kids, timeout=30)
        assert not alive
    finally:
        _kill_all(proc, kids)
    err = lines.text()
    assert "worker 0 exited" in err and "worker 1 exited" in err, err[-3000:]


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.broker
def test_a_child_that_keeps_crashing_stops_the_supervisor_with_exit_1(broker, topic, tmp_path):
    # child i serves metrics on --metrics-port + i: with both ports taken every child fails at
    # start (what the supervisor cannot check for its children before they run)
    taken = _two_taken_ports()
    proc, lines = _start(
        broker,
        topic,
        str(tmp_path / "out"),
        f"g-{uuid.uuid4().hex[:6]}",
        "--metrics-port",
        str(taken[0].getsockname()[1]),
    )
    try:
        proc.wait(300)
    finally:
        if proc.poll() is None:
            _kill_all(proc, psutil.Process(proc.pid).children(recursive=True))
        for sock in taken:
            sock.close()
    err = lines.text()
    assert proc.returncode == 1, err[-3000:]
    assert "restart in 1 s" in err and "restart in 2 s" in err  # the backoff doubled
    assert f"{RESTARTS.attempts} times in a row soon after starting; stopping all" in err


def _two_taken_ports() -> list:
    """Listening sockets on two consecutive free ports of 127.0.0.1 (closed by the caller)."""
    import socket

    for _ in range(50):
        first = socket.socket()
        first.bind(("127.0.0.1", 0))
        second = socket.socket()
        try:
            second.bind(("127.0.0.1", first.getsockname()[1] + 1))
        except OSError:
            first.close()
            second.close()
            continue
        first.listen()
        second.listen()
        return [first, second]
    raise RuntimeError("no two consecutive free ports")


class _FakeProcess:
    def __init__(self):
        self.exitcode = None


def _gated_supervisor(n: int) -> tuple[ConsumerProcesses, list]:
    """A supervisor with `n` started children at the start gate (fake processes, real pipes):
    returns it and the children's ends of the gate."""
    import multiprocessing

    from rlrec.supervisor import _Child

    sup = ConsumerProcesses(ConsumerConfig(bootstrap_servers="b", output="o"), n)
    ends = []
    for i in range(n):
        ours, theirs = multiprocessing.Pipe()
        sup._children[i] = _Child(i, _FakeProcess(), time.time(), 0, ours)
        ends.append(theirs)
    return sup, ends


def test_the_start_gate_opens_when_every_child_is_ready():
    sup, ends = _gated_supervisor(3)
    ends[0].send("ready")
    ends[2].send("ready")
    sup._open_gate()
    assert not any(e.poll(0.05) for e in ends), "a child subscribed before its siblings had imported"
    ends[1].send("ready")
    sup._open_gate()
    assert all(e.poll(1) and e.recv() == "go" for e in ends)
    assert all(c.gate is None for c in sup._children.values())


def test_the_start_gate_opens_when_a_child_ends_before_it_is_ready():
    sup, ends = _gated_supervisor(2)
    ends[0].send("ready")
    sup._open_gate()
    assert not ends[0].poll(0.05)
    sup._children[1].process.exitcode = -9  # killed while importing: nobody waits for it
    ends[1].close()
    sup._open_gate()
    assert ends[0].poll(1) and ends[0].recv() == "go"


def test_the_start_gate_opens_when_the_supervisor_stops():
    sup, ends = _gated_supervisor(2)
    sup._stopping = True  # the children then run with their stop flag set: they end at once
    sup._open_gate()
    assert all(e.poll(1) and e.recv() == "go" for e in ends)


def test_a_child_refusing_a_gap_stops_all_without_restarts(caplog):
    """A gap refused by one child would be refused by every sibling the partition moves to:
    the supervisor stops all at once (exit 1, one line) instead of restarting it until it
    gives up as crashing."""
    from rlrec.supervisor import EXIT_GAP, _Child

    class Ended(_FakeProcess):
        def close(self):
            pass

    sibling = subprocess.Popen(["sleep", "60"])
    try:
        sup = ConsumerProcesses(ConsumerConfig(bootstrap_servers="b", output="o"), 2)
        refusing, running = Ended(), Ended()
        refusing.exitcode = EXIT_GAP
        running.pid = sibling.pid
        sup._children = {0: _Child(0, refusing, time.time(), 0, None), 1: _Child(1, running, time.time(), 0, None)}
        caplog.set_level(logging.ERROR, logger="rlrec.supervisor")
        sup._reap(time.time())
        assert sibling.wait(10) == -signal.SIGTERM  # the sibling is told to stop
        assert sup.rc == 1 and sup._stopping and not sup._restart_at
        assert [r.getMessage() for r in caplog.records] == ["worker 0 refused a gap in the store (above); stopping all"]
    finally:
        sibling.kill()
        sibling.wait()
