"""The store over time, whole system: producer, consumers, `rlrec train` and a killed `rlrec compact`.

Real parts on 127.0.0.1: the session's Kafka-protocol broker (Tansu), a local store, `rlrec train`
(BC, its own Ray) and `rlrec compact` in processes of their own, two consumers in this process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from typing import Any

import pytest

import rlrec
from rlrec.consumer.topics import create_topics, dlq_topic_name
from rlrec.producer import EpisodeRecorder
from rlrec.store.maintenance import verify
from rlrec.store.manifest import PartitionLog, ReplaceEntry, live_shards, read_first_commits
from rlrec.store.ownership import read_lease
from rlrec.store.storage import Storage
from rlrec.trainer.manifest_follower import ManifestFollower
from tests.helpers import ACT_SPACE, OBS_SPACE, read_metrics, record_episodes
from tests.helpers import wait_for as _wait_for
from tests.test_consumer_e2e import committed_episodes, run_consumer

pytestmark = [pytest.mark.system, pytest.mark.broker, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _all_held_out(e) -> bool:
    """Every episode of shard entry `e` is held out for evaluation (rlrec train's default split)."""
    from rlrec.trainer.holdout import is_held_out

    return bool(e.episode_ids) and all(is_held_out(i, 0.1) for i in e.episode_ids)


def wait_for(pred, timeout: float, what: str, trainer: subprocess.Popen | None = None):
    """tests.helpers.wait_for, failing at once if the trainer process died meanwhile."""

    def check():
        if trainer is not None and trainer.poll() is not None:
            raise AssertionError(f"rlrec train exited ({trainer.returncode}) while waiting for {what}")
        return pred()

    return _wait_for(check, timeout, interval=0.1, what=what)


def _train(out: str, ck: str, log) -> subprocess.Popen:
    """`rlrec train`: BC, short iterations, checkpointed only on SIGTERM."""
    cmd = [
        sys.executable,
        "-m",
        "rlrec",
        "train",
        "--input",
        out,
        "--checkpoint-dir",
        ck,
        "--algo",
        "BC",
        "--promotion-gate",
        "off",
        "--num-cpus",
        "2",
        "--checkpoint-interval",
        "100000",
        "--min-time-s-per-iteration",
        "1",
        "--algo-config",
        "train_batch_size_per_learner=128",
        "--offline-config",
        "dataset_num_iters_per_learner=2",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _compact(out: str, target: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlrec", "compact", out, "--min-age", "0", "--force", "--target-bytes", str(target)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _steps_per_episode(snap) -> Counter:
    """episode id -> steps read from the snapshot's files; fails if any (episode, t) is read twice."""
    t = snap.steps()
    seen = Counter(zip(t.column("episode_id").to_pylist(), t.column("t").to_pylist()))
    twice = [k for k, n in seen.items() if n > 1]
    assert not twice, f"steps read twice at {snap.cursor}: {twice[:3]}"
    return Counter(eid for eid, _ in seen)


def test_every_episode_read_once_at_every_point_and_trained_new_once_while_a_compactor_is_killed(
    broker, topic, tmp_path, recorder_config
):
    """Producer waves -> consumer A (topic A, 1 partition; then stopped) and consumer B (topic B,
    4 partitions, compacting its own with --compact-after) -> one local store, followed all along by
    `rlrec train`. Once A's owner lease has expired, `rlrec compact` merges A's small shards
    (refusing B's partitions: live leases); it is killed -9 at a random moment after it took the
    partition, run again and killed again (if still running), then run to the end.

    Checked: (1) `rlrec.open(store, as_of=cursor)` at every point taken -- before compaction (while
    A's lease expires), while the compactor runs, after each kill, after the last run and at the
    end -- reads exactly the episodes published before it, each once, with each episode's step count
    as published; (2) the trainer's manifest follower (`ManifestFollower`, what `rlrec train`
    takes new shards from), polling at every point, delivers every published episode as new
    exactly once, in the shard entry that committed it (never a merged shard); `rlrec train`
    itself counts as new (metrics.jsonl ``new_shards``) every shard entry with an episode to train
    on exactly once (and no shard twice), never a merged file, and its SIGTERM checkpoint lists
    the same shards as trained. A shard whose every episode is held out for evaluation (one
    one-episode shard in ten) has nothing to train on; the trainer counts it as trained when the
    PreLearner reports its chunk empty, which on this loaded machine it occasionally has not done
    within the test's wait (1 of 135 shards in one run): such shards are not required.

    Waiting out consumer A's lease (60 s by the clock, then 60 s while `rlrec compact` watches it)
    is most of this test's three minutes or so: a stopped consumer's lease stays until it
    expires."""
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    storage = Storage.from_uri(out)
    topic_a = f"a-{uuid.uuid4().hex[:8]}"
    create_topics(broker.bootstrap_servers, {topic_a: 1, dlq_topic_name(topic_a): 1})
    kw: dict[str, Any] = {"observation_space": OBS_SPACE, "action_space": ACT_SPACE, "env_id": "synthetic"}
    rec_a = EpisodeRecorder(broker.bootstrap_servers, policy_id="pol", topic=topic_a, **kw)
    rec_b = EpisodeRecorder(broker.bootstrap_servers, policy_id="pol", topic=topic, **kw)
    cons_a = run_consumer(recorder_config(out, topic=topic_a, max_file_age_s=0.2, commit_interval_s=0.2), storage)
    cons_b = run_consumer(recorder_config(out, max_file_age_s=0.3, commit_interval_s=0.3, compact_after_s=2.0), storage)
    rng = random.Random(31)
    truth: dict[str, int] = {}  # episode id -> steps, as published
    points: list[tuple[str, dict[str, int], str]] = []  # (cursor, what was published before it, when)
    trainer_log = open(tmp_path / "trainer.log", "wb")
    trainer: subprocess.Popen | None = None
    compactor: subprocess.Popen | None = None
    seed = iter(range(10_000))
    t0 = time.monotonic()
    follower = ManifestFollower(storage)
    taken: list[str] = []  # episode ids the follower delivered as new

    def follow() -> None:
        taken.extend(i for s in follower.poll(force_discover=True) for i in follower.entries[s.key].episode_ids)

    def stage(what: str) -> None:  # the timeline, shown with a failure's captured output
        print(f"{time.monotonic() - t0:6.1f}s  {what}", flush=True)

    def wave(rec, n: int) -> None:
        eps = record_episodes(rec, n, seed=next(seed), max_len=12)
        assert rec.flush(10) == 0
        truth.update({eid: len(ep.actions) for eid, ep in eps.items()})
        want = len(truth)
        wait_for(lambda: committed_episodes(storage) >= want, 60, f"{want} episodes committed", trainer)

    def point(when: str) -> None:
        points.append((rlrec.open(out).cursor, dict(truth), when))
        follow()

    def a_shards() -> dict:
        return live_shards(PartitionLog(storage, topic_a, 0).load())

    try:
        for i in range(16):  # A: many small shards (one wave, about one shard)
            wave(rec_a, 2)
            if i % 4 == 0:
                wave(rec_b, 4)
            point("before compaction")
            if trainer is None:
                trainer = _train(out, ck, trainer_log)
        n_small = len(a_shards())
        assert n_small >= 10, n_small
        target = 2 * max(e.bytes for e in a_shards().values())  # about two shards per merged one
        stage(f"A committed {n_small} shards; stopping consumer A")
        # a consumer that dies keeps its lease until it expires (a clean stop releases it): stop A
        # as if it died, so the first compaction must watch the lease run out
        from unittest import mock

        from rlrec.consumer.writer import PartitionWriter

        with mock.patch.object(PartitionWriter, "release_lease", lambda self: None):
            cons_a[0].stop()
            cons_a[1].join(30)
        assert not cons_a[1].is_alive()
        # A is stopped; its lease stays live for its term (by the clock): compact when it looks expired
        waves = 0
        while (lease := read_lease(storage, topic_a, 0)) is not None and lease.live():
            wave(rec_b, 3)
            waves += 1
            if waves % 4 == 0:
                point("before compaction")
            time.sleep(1.0)

        def compactor_took_a(before: str | None) -> str | None:
            """The writer of a compactor's lease of A newer than `before` (None: none yet)."""
            lease = read_lease(storage, topic_a, 0)
            if lease is not None and lease.writer.startswith("rlrec-compact:") and lease.writer != before:
                return lease.writer
            return None

        kills, took = 0, None
        for run in range(3):
            stage(f"rlrec compact run {run + 1}" + (" (A's lease has expired)" if run == 0 else ""))
            compactor, started, now = _compact(out, target), time.monotonic(), None
            # the first run watches A's expired consumer lease for a lease time (60 s) before it
            # takes A: commits go on meanwhile
            while run == 0 and compactor.poll() is None and time.monotonic() - started < 40:
                assert compactor_took_a(took) is None, "rlrec compact took A without watching its lease"
                wave(rec_b, 2)
                waves += 1
                if waves % 4 == 0:
                    point("before compaction")
                time.sleep(1.0)
            # it takes A (its own lease) once it has a merged shard to commit
            while compactor.poll() is None and not (now := compactor_took_a(took)):
                time.sleep(0.005)
            if run < 2 and compactor.poll() is None:  # kill -9 at a random moment of its work
                took = now
                point("during compaction")
                time.sleep(rng.uniform(0.0, 0.1))
                if compactor.poll() is None:
                    compactor.send_signal(signal.SIGKILL)
                    kills += 1
                    stage("killed rlrec compact (-9)")
            stdout, stderr = compactor.communicate(timeout=120)
            if compactor.returncode == -signal.SIGKILL:
                point("after a kill")
                continue
            # B's partitions are refused (live leases), A's compacted: exit 1, one error line
            assert compactor.returncode == 1, stdout + stderr
            assert f"{topic}/0000" in stderr and "owned by a live consumer" in stderr, stderr
            assert f"{topic_a}/00000: replaced" in stdout and topic_a not in stderr, stdout + stderr
            assert "Traceback" not in stderr, stderr
            break
        assert kills >= 1, "the compactor finished before it could be killed"
        point("after compaction")
        merged = a_shards()
        assert len(merged) <= (n_small + 1) // 2, (len(merged), n_small)
        assert all(storage.exists(e.path) for e in merged.values())  # the last run published every one
        for _ in range(2):  # commits go on after compaction
            wave(rec_b, 3)
            point("after compaction")
        stage("compaction done; waiting for the trainer")
        # the trainer takes every shard entry as new (A's replaced since), runs on for a while
        # after the last one, then checkpoints on SIGTERM
        all_firsts = {e.path for e in read_first_commits(storage) if not _all_held_out(e)}
        a_firsts = {e.path for e in read_first_commits(storage) if e.topic == topic_a}
        done_at = time.time()

        def trainer_caught_up() -> bool:
            lines = read_metrics(ck)
            new = set().union(*(set(r["new_shards"]) for r in lines))
            return bool(lines) and new >= all_firsts and lines[-1]["time"] > done_at + 10

        wait_for(trainer_caught_up, 120, "every shard entry trained, and ten seconds more", trainer)
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(120) == 143  # 128 + SIGTERM, after the clean stop
        stage("trainer stopped")
    finally:
        for proc in (trainer, compactor):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL) if proc is trainer else proc.kill()
                proc.wait()
        trainer_log.close()
        for c, t in (cons_a, cons_b):
            c.stop()
            t.join(30)
        rec_a.close()
        rec_b.close()
    log_tail = (tmp_path / "trainer.log").read_text(errors="replace")[-3000:]

    follow()
    # compaction happened: rlrec compact on A, consumer B on its own partitions
    replaces: Counter = Counter()
    for t, p in [(topic_a, 0), *((topic, i) for i in range(4))]:
        if storage.exists(f"_manifest/{t}/{p:05d}"):
            replaces[t] += sum(isinstance(e, ReplaceEntry) for e in PartitionLog(storage, t, p).load())
    assert replaces[topic_a] >= 2 and replaces[topic] >= 1, replaces

    stage(f"checking {len(points)} points")
    # (1) every as-of point reads exactly what was published before it, each episode once
    whens = Counter(when for _, _, when in points)
    assert {"before compaction", "during compaction", "after a kill", "after compaction"} <= set(whens), whens
    for cursor, published, when in points:
        got = _steps_per_episode(rlrec.open(out, as_of=cursor))
        assert dict(got) == published, (when, set(got) ^ set(published))

    # (2) each published episode committed once, and taken as new once, from its shard entry
    entries = read_first_commits(storage)
    firsts = {e.path for e in entries}
    assert Counter(i for e in entries for i in e.episode_ids) == Counter(list(truth))
    assert Counter(taken) == Counter(list(truth)), sorted((Counter(taken) - Counter(list(truth))).items())[:3]
    assert set(follower.entries) <= firsts  # shard entries only: no merged shard delivered
    # rlrec train: every shard entry once (no merged file among them)
    lines = read_metrics(ck)
    counted = Counter(k for r in lines for k in r["new_shards"])
    assert all(r["shards_new"] == len(r["new_shards"]) for r in lines)
    assert max(counted.values()) == 1, [k for k, n in counted.items() if n > 1][:3]
    trainable = {e.path for e in entries if not _all_held_out(e)}
    assert trainable <= set(counted) <= firsts, (sorted(trainable - set(counted))[:3], log_tail)
    assert a_firsts <= set(counted) and len(a_firsts) >= 10
    latest = json.loads((tmp_path / "ck" / "checkpoints" / "latest.json").read_text())
    state = json.loads((tmp_path / "ck" / latest["path"] / "trainer.json").read_text())
    assert set(state["trained_shards"]) == set(counted)
    stage(f"rlrec train counted {len(counted)} of {len(firsts)} shard entries as new")
    assert verify(storage) == []
    stage("checked")
