"""kill -9 of the `rlrec consume` process at random moments while multi-agent episodes flow
(real broker, the real consumer process): after restarts every multi-agent episode is stored
exactly once (each agent row once, whole episodes equal to RLlib's replay), and a reader
opened between two commits never sees a partial episode. Agents of one episode map to two
modules, so an episode's rows are two shard commits: a kill may land between them, and one kill
(the committer's test fault hook) certainly does."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time

import pytest

import rlrec
from rlrec.store.manifest import read_manifest
from rlrec.store.storage import Storage
from tests.helpers import wait_for
from tests.multi_agent_cases import CASES, assert_same, comparable_state
from tests.multi_agent_consume import (
    agent_rows_committed,
    assert_store_equals_reference,
    expected_rows,
    recordable,
    send_all,
)
from tests.test_consumer_faults import _consume_cmd

pytestmark = [pytest.mark.broker, pytest.mark.system, pytest.mark.slow]


def _wave(i: int) -> list:
    recs = []
    for k in range(8):
        rec = CASES["simple_spread"](f"spread-{i}-{k}", seed=100 * i + k, max_cycles=3 + k % 4)
        rec.agent_modules = {"agent_0": "a", "agent_1": "b", "agent_2": "b"}
        recs.append(rec)
    ttt = CASES["tictactoe"](f"ttt-{i}", seed=i)
    ttt.agent_modules = {a: f"p{j}" for j, a in enumerate(ttt.agent_modules)}
    recs.append(ttt)
    recs.append(CASES["join_leave"](f"join-{i}", seed=i))
    return recs


def _no_partial_episode(output: str, by_id: dict) -> int:
    """Every episode a reader sees now is whole: equal to the reference of its recording."""
    n = 0
    for ep in rlrec.open(output).multi_agent_episodes():
        assert_same(comparable_state(ep), comparable_state(by_id[ep.id_][1]), ep.id_)
        n += 1
    return n


def test_kill9_keeps_every_multi_agent_episode_exactly_once(broker, topic, tmp_path, recorder_config):
    pytest.importorskip("mpe2")
    pytest.importorskip("pettingzoo.classic")
    from rlrec.consumer.multi_agent_reference import reference_episode

    output = str(tmp_path / "out")
    cfg = recorder_config(output)
    storage = Storage.from_uri(output)
    sent: list = []
    by_id: dict = {}
    kills_done = threading.Event()
    produced = threading.Event()

    def produce():
        for i in range(200):  # until the kills are done (at least 8 waves)
            if i >= 8 and kills_done.is_set():
                break
            recs = [recordable(r) for r in _wave(i)]
            for rec in recs:  # known before any of it can be stored
                by_id[rec.episode_id] = (rec, reference_episode(rec))
            sent.extend(recs)
            send_all(broker.bootstrap_servers, topic, recs, max_batch_steps=2)
            time.sleep(0.3)
        produced.set()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    rng = random.Random(11)
    kills, reads = 0, 0
    log = open(tmp_path / "consumer.log", "ab")
    proc = subprocess.Popen(_consume_cmd(cfg), stdout=log, stderr=log)
    try:
        while kills < 4:
            seen = agent_rows_committed(storage)
            wait_for(lambda seen=seen: agent_rows_committed(storage) > seen, 90, interval=0.1, what="a commit")
            time.sleep(rng.uniform(0.0, 1.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            kills += 1
            reads += _no_partial_episode(output, by_id)  # a reader between two commits
            proc = subprocess.Popen(_consume_cmd(cfg), stdout=log, stderr=log)
        # and one kill certainly between two modules' entries of one episode: the committer's
        # fault hook kills the process right after the first of them landed
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        marker = tmp_path / "split-episode"
        env = {**os.environ, "RLREC_TEST_KILL_BETWEEN_ENTRIES": str(marker)}
        proc = subprocess.Popen(_consume_cmd(cfg), stdout=log, stderr=log, env=env)
        assert proc.wait(120) == -signal.SIGKILL and marker.exists()
        split_id = marker.read_text()
        snapshot = rlrec.open(output).multi_agent_episodes()
        assert split_id not in {ep.id_ for ep in snapshot} and snapshot.partial >= 1  # a module's row only
        kills += 1
        proc = subprocess.Popen(_consume_cmd(cfg), stdout=log, stderr=log)
        kills_done.set()
        assert produced.wait(300)
        want = expected_rows(sent)
        wait_for(lambda: agent_rows_committed(storage) >= want, 120, interval=1, what="all agent rows committed")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert kills == 5 and reads > 0 and len(sent) >= 80
    assert split_id in {ep.id_ for ep in rlrec.open(output).multi_agent_episodes()}  # whole after the restart
    ids = [i for e in read_manifest(storage) if e.format_version == 2 for i in e.episode_ids]
    assert len(ids) == len(set(ids)) == expected_rows(sent)  # every agent row exactly once
    assert_store_equals_reference(output, sent)
