"""The partition watermark (`rlrec.store.watermark`) and the canary's cohort cut on it: what the
consumer's assembler says is still open, what the writer keeps beside the log, how the trainer's
cohort end follows the least partition, and a worse canary whose failures hang to an hour that
the default flags never promote."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest

from rlrec.consumer.assembly import AssemblyConfig, PartitionAssembler
from rlrec.consumer.writer import PartitionWriter
from rlrec.store.commit import ShardCommitter
from rlrec.store.manifest import PartitionLog, list_partition_logs, read_manifest
from rlrec.store.storage import Storage
from rlrec.store.watermark import read_watermark, watermark_path, write_watermark
from rlrec.trainer.canary import in_canary
from rlrec.trainer.canary_evidence import WATERMARK_SLACK_S, CanaryEvidence
from rlrec.trainer.rollout import CanaryRun
from rlrec.trainer.sequential import CanaryRule
from tests.test_assembly import ACT, OBS, steps
from tests.test_canary_sequential import _arm_id, _episode

LATER = time.time() + 3600  # past any reward join window


def _start(eid: str, ts_ms: int):
    from rlrec.producer.events import EpisodeStart

    return EpisodeStart(eid, "pol", 1, [np.zeros(4, np.float32)], OBS, ACT, "CartPole-v1", {"seed": 1}, ts_ms)


# -- the consumer's side ---------------------------------------------------------------------


def test_the_watermark_is_the_earliest_start_not_committed_or_when_last_caught_up():
    a = PartitionAssembler("rl", 0, config=AssemblyConfig(episode_timeout_s=60.0, on_timeout="dead-letter"))
    assert a.open_since_ms(now=100.0) is None  # nothing read yet: it says nothing
    a.apply(0, _start("slow", 5_000))
    a.apply(1, _start("fast", 7_000))
    assert a.open_since_ms(now=100.0) == 5_000
    a.apply(2, steps("fast", 0, 2, terminated=True))
    a.apply(3, steps("slow", 0, 1))
    assert a.open_since_ms(now=100.0) == 5_000  # finished, not committed: still held
    a.apply(4, steps("slow", 1, 1, terminated=True))
    ready = a.ready(force=True)
    a.hand_out(ready)
    assert a.open_since_ms(now=100.0) == 5_000  # handed out, not confirmed committed: still held
    a.mark_committed(ready)
    assert a.open_since_ms(now=100.0) is None  # nothing open, not read live: unknown
    a.caught_up_at = 90.0
    assert a.open_since_ms(now=100.0) == 90_000
    a.apply(5, _start("future", 10**13), now=100.0)  # a producer clock far ahead: at most now
    assert a.open_since_ms(now=100.0) == 100_000
    # an episode ended by episode_timeout_s (dead-lettered) is no longer open
    a.live_since = 0.0
    for i, d in enumerate(a.decide_timeouts(now=1_000.0)):
        a.apply(6 + i, d.abort(), now=1_000.0)  # the decision read back from the log, as the consumer does
    assert "future" not in a.open and a.open_since_ms(now=1_000.0) == 90_000


def test_the_writer_keeps_the_watermark_beside_the_log_and_never_past_an_episode_not_committed(tmp_path):
    storage = Storage.from_uri(str(tmp_path))
    w = PartitionWriter(storage, "rl", 0, watermark_every_s=0.0)
    w.claim(from_store=True)
    a = w.assembler
    a.caught_up_at = LATER - 10
    a.apply(0, _start("slow", 5_000))
    a.apply(1, _start("a", 6_000))
    a.apply(2, steps("a", 0, 2, terminated=True))
    w.tick(LATER, force=True)
    w.upkeep(LATER)
    assert read_watermark(storage, "rl", 0).open_since_ms == 5_000  # "a" is committed, "slow" is open
    assert [e.episode_ids for e in read_manifest(storage)] == [("a",)]
    a.apply(3, steps("slow", 0, 2, terminated=True))
    w.upkeep(LATER + 1)
    assert read_watermark(storage, "rl", 0).open_since_ms == 5_000  # finished, not written yet
    w.tick(LATER + 2, force=True)
    w.upkeep(LATER + 2)
    assert read_watermark(storage, "rl", 0).open_since_ms == int((LATER - 10) * 1000)  # nothing open: when caught up
    doc = json.loads(storage.read(watermark_path("rl", 0)))
    assert (doc["epoch"], doc["writer"], doc.get("partitions")) == (w.epoch, w.committer.log.writer_id, None)


def test_manifest_readers_ignore_the_watermark(tmp_path):
    """It is no entry: the log, its listing and verify read past it (no manifest format needed)."""
    from rlrec.store.maintenance import gc, verify

    c = ShardCommitter(str(tmp_path), "rl", 0)
    c.commit([_episode(1, [1.0], 1_000, "e1")])
    write_watermark(c.storage, "rl", 0, 123, epoch=1, writer="w")
    assert [e.seq for e in PartitionLog(c.storage, "rl", 0).load()] == [0, 1]
    assert list_partition_logs(c.storage) == [("rl", 0)]
    assert verify(c.storage) == []
    assert [e.episode_ids for e in read_manifest(c.storage)] == [("e1",)]
    assert gc(c.storage, 0.0, dry_run=True) == [] and c.storage.exists(watermark_path("rl", 0))


@pytest.mark.parametrize(
    "doc",
    [
        b"{",
        b'{"type": "watermark", "open_since_ms": -1}',
        b'{"open_since_ms": 5}',
        b'{"type": "watermark", "open_since_ms": 5, "partitions": 10000000}',
        b"[" * 4000,
        b"x" * 5000,
    ],
)
def test_a_malformed_watermark_reads_as_none(tmp_path, doc):
    storage = Storage.from_uri(str(tmp_path))
    storage.write(watermark_path("rl", 3), doc)
    assert read_watermark(storage, "rl", 3) is None


# -- the trainer's side ----------------------------------------------------------------------


def test_the_cohort_end_is_the_least_partition_watermark_and_a_log_without_one_is_guessed(tmp_path):
    uri = str(tmp_path)
    for p in (0, 1, 2):
        ShardCommitter(uri, "rl", p).commit([_episode(1, [1.0], 1_000, f"e{p}")])
    ev = CanaryEvidence(uri, version=2, base_version=1, started=0.0, gamma=1.0)
    storage = ev.storage
    now = 10_000.0
    write_watermark(storage, "rl", 0, 9_900_000, epoch=1, writer="w")
    write_watermark(storage, "rl", 1, 9_800_000, epoch=1, writer="w")
    ev.refresh(now=now, episode_max_s=900.0)
    assert ev.cohort_end == (now - 900.0) * 1000  # partition 2 has none: the guess, the least here
    write_watermark(storage, "rl", 2, 9_500_000, epoch=1, writer="w")
    ev.refresh(now=now, episode_max_s=900.0)
    assert ev.cohort_end == 9_500_000 - WATERMARK_SLACK_S * 1000  # every partition's: the least
    assert ev.watermarked == 3
    # a consumer says the topic has 4 partitions: the one without a log yet counts as the guess
    write_watermark(storage, "rl", 2, 9_500_000, epoch=1, writer="w", partitions=4)
    ev.refresh(now=now, episode_max_s=900.0)
    assert ev.cohort_end == (now - 900.0) * 1000 and set(ev.marks) == {("rl", p) for p in range(4)}


def _slow_failures(seed: int):
    """Review 40b's scenario: two episodes begin every second; the canary's end after 60 s with 1.9
    (80 %) or hang to the 1-hour limit with -3 (20 %): truly 0.08 worse than deployed's 60-s
    episodes at 1.0. (end time, start time, episode), by end."""
    rng = np.random.default_rng(seed)
    t0 = 1_000_000.0
    out = []
    for i in range(6000):
        eid = f"e{i}"
        start = t0 + i / 2
        if in_canary(eid, 0.2):
            ret, length = (-3.0, 3600.0) if rng.random() < 0.2 else (1.9, 60.0)
        else:
            ret, length = float(np.clip(rng.normal(1.0, 0.3), 0.0, 2.0)), 60.0
        ep = _episode(2 if in_canary(eid, 0.2) else 1, [ret], int(start * 1000), eid, 2, share=0.2)
        out.append((start + length, start, dataclasses.replace(ep, ended_ms=int((start + length) * 1000))))
    out.sort(key=lambda x: x[0])
    return t0, out


def _run(tmp_path, seed: int, watermark: bool, rule: CanaryRule | None = None):
    """Commit what ended every 120 s as a consumer does -- with `watermark`, writing the
    partition's watermark after each commit: the earliest start of an episode not ended yet --
    and look; the first decision (kind, seconds after the start, reason) or None, and how many
    episodes came after a cohort taken as complete should have held them."""
    t0, episodes = _slow_failures(seed)
    uri = str(tmp_path / f"store-{seed}-{watermark}")
    c = ShardCommitter(uri, "rl", 0)
    c.claim()
    rule = rule or CanaryRule(min_episodes=30, max_exposure=5000, return_min=-3.0, return_max=2.0)  # defaults
    run = CanaryRun(version=2, base_version=1, started=t0, gamma=0.9, rule=rule)
    k = 0
    for now in np.arange(t0 + 120, t0 + 7000, 120.0):
        batch = []
        while k < len(episodes) and episodes[k][0] <= now:
            batch.append(episodes[k][2])
            k += 1
        if batch:
            c.commit(batch)
        if watermark:
            still_open = [s for _end, s, _ep in episodes[k:] if s <= now]
            write_watermark(c.storage, "rl", 0, int(min([now, *still_open]) * 1000), epoch=c.epoch, writer="w")
        v = run.look(uri, now=float(now))
        if v.decision != "continue":
            return (v.decision, float(now - t0), v.reason), run.evidence_counts()["late"]
    return None, run.evidence_counts()["late"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [5, 6, 7])
def test_slow_failures_never_promote_at_the_default_flags(tmp_path, seed):
    """Review 40b (NEW-P1-D): with the default rule the guess of the longest episode (900 s) is
    shorter than the failures' 1 h and the worse canary was promoted on its fast episodes (all 3
    seeds, still so without a watermark). With the consumer's watermark the cohort waits for the
    slow episodes: never promoted."""
    decision, late = _run(tmp_path, seed, watermark=True)
    assert (decision is None or decision[0] == "rollback") and late == 0, (decision, late)
    guessed, _late = _run(tmp_path, seed, watermark=False)  # decided before the first slow failure ended
    assert guessed is not None and guessed[0] == "promote" and guessed[1] < 3600, guessed


def test_a_cohort_end_that_does_not_advance_rolls_the_canary_back(tmp_path):
    """A partition whose watermark stays (an episode that never ends, a consumer that stopped
    writing) blocks every promotion; after --canary-max-wait-s the canary is rolled back."""
    uri = str(tmp_path)
    c = ShardCommitter(uri, "rl", 0)
    t0 = 1_000_000.0
    write_watermark(c.storage, "rl", 0, int((t0 + 10) * 1000), epoch=1, writer="w")
    rule = CanaryRule(min_episodes=2, return_min=0.0, return_max=1.0, max_wait_s=600.0, episode_max_s=60.0, share=0.5)
    run = CanaryRun(version=2, base_version=1, started=t0, gamma=1.0, rule=rule)
    decisions = []
    for i, now in enumerate(np.arange(t0 + 60, t0 + 1500, 60.0)):
        ids = [(v, _arm_id(f"x{i}-{v}-{j}", v == 2)) for v in (1, 2) for j in range(3)]
        c.commit([_episode(v, [0.5], int((now - 30) * 1000), eid, 2, share=0.5) for v, eid in ids])
        v = run.look(uri, now=float(now))
        decisions.append((float(now - t0), v.decision, v.reason))
        if v.decision != "continue":
            break
    when, decision, reason = decisions[-1]
    assert decision == "rollback" and "the complete cohort" in reason and 600 <= when <= 720, decisions[-3:]
    assert run.to_state()["cohort_moved"] == t0 + 60  # kept in the checkpoint
    assert "the lowest watermark is topic 'rl' partition 0's" in reason  # where the operator looks


def test_a_watermark_in_the_future_keeps_the_slack_and_partition_counts_cost_one_pass(tmp_path):
    """Review-40d D4: a watermark ahead of the trainer's clock (a consumer's clock, a hostile
    file) was clamped to now, so the cut lost its slack; 64 logs each stating 100,000 partitions
    cost ~1 s of CPU per look (one pass per log)."""
    uri = str(tmp_path)
    ShardCommitter(uri, "rl", 0).commit([_episode(1, [1.0], 1_000, "e0")])
    ev = CanaryEvidence(uri, version=2, base_version=1, started=0.0, gamma=1.0)
    now = 10_000.0
    write_watermark(ev.storage, "rl", 0, int((now + 600) * 1000), epoch=1, writer="w")
    ev.refresh(now=now, episode_max_s=900.0)
    assert ev.cohort_end == (now - WATERMARK_SLACK_S) * 1000
    for p in range(1, 65):
        ShardCommitter(uri, "rl", p).commit([_episode(1, [1.0], 1_000, f"e{p}")])
        write_watermark(ev.storage, "rl", p, int(now * 1000), epoch=1, writer="w", partitions=100_000)
    t0 = time.process_time()
    marks = ev.watermarks()
    assert len(marks) == 100_000 and time.process_time() - t0 < 0.5


def test_every_ended_episode_can_roll_back_before_the_cohort_is_complete(tmp_path):
    """A canary clearly worse on the episodes that ended is rolled back at once, though the cohort
    (here nothing: the watermark is at the start) cannot promote yet: a wrong early rollback is
    the safe error."""
    uri = str(tmp_path)
    c = ShardCommitter(uri, "rl", 0)
    t0 = 1_000_000.0
    write_watermark(c.storage, "rl", 0, int(t0 * 1000), epoch=1, writer="w")
    rule = CanaryRule(min_episodes=30, return_min=0.0, return_max=1.0, episode_max_s=60.0, share=0.5)
    eps = []
    for i in range(400):
        v = 2 if in_canary(f"r{i}", 0.5) else 1
        eps.append(_episode(v, [0.0 if v == 2 else 1.0], int((t0 + 1 + i) * 1000), f"r{i}", 2, share=0.5))
    c.commit(eps)
    run = CanaryRun(version=2, base_version=1, started=t0, gamma=1.0, rule=rule)
    v = run.look(uri, now=t0 + 500)
    assert v.decision == "rollback" and "every ended episode" in v.reason
    assert v.canary.n > 30


# -- a consumer killed with a slow episode open, and a second group ------------------------------


def _consume(broker, topic: str, output: str, group: str):
    import subprocess
    import sys

    from rlrec.local import FAST_GROUP_KAFKA

    args = ["consume", "--bootstrap-servers", broker.bootstrap_servers, "--topic", topic, "--group-id", group]
    args += ["--output", output, "--no-create-topics", "--max-file-age-s", "0.3", "--commit-interval-s", "0.3"]
    args += [x for k, v in FAST_GROUP_KAFKA.items() for x in ("--kafka-config", f"{k}={v}")]
    return subprocess.Popen(
        [sys.executable, "-m", "rlrec", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


@pytest.mark.system
@pytest.mark.slow
@pytest.mark.broker
def test_a_killed_consumer_and_a_second_group_never_move_the_watermark_past_an_open_slow_episode(
    broker, tmp_path, request
):
    """A slow episode stays open while fast ones end around it, on one partition. The watermark
    the consumer keeps stays at or below the slow episode's start until its shard entry lands --
    across a kill -9 and restart of the consumer, and while a second consumer group writes the
    same store (each claim takes the partition from the other; each resumes from the store's
    position, so each reads the slow episode's start) -- and moves past it once it is committed, and
    on after a restart with nothing new to read."""
    import threading
    import uuid

    from rlrec.consumer.topics import create_topics, dlq_topic_name
    from rlrec.producer import EpisodeRecorder
    from tests.helpers import ACT_SPACE, OBS_SPACE, record_episodes, wait_for

    topic = f"wm-{uuid.uuid4().hex[:8]}"
    create_topics(broker.bootstrap_servers, {topic: 1, dlq_topic_name(topic): 1})
    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    rec = EpisodeRecorder(
        broker.bootstrap_servers, topic=topic, policy_id="p", observation_space=OBS_SPACE, action_space=ACT_SPACE
    )
    seen: list[tuple[float, int, dict]] = []  # (read at, watermark, its document)
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                doc = json.loads(storage.read(watermark_path(topic, 0)))
                seen.append((time.time(), doc["open_since_ms"], doc))
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.05)

    def committed() -> set[str]:
        try:
            return {
                i for e in PartitionLog(storage, topic, 0).load() if hasattr(e, "episode_ids") for i in e.episode_ids
            }
        except FileNotFoundError:
            return set()

    procs = []
    watcher = threading.Thread(target=watch, daemon=True)
    try:
        procs.append(_consume(broker, topic, output, "g1"))
        obs = np.zeros(4, np.float32)
        slow = rec.begin_episode(obs)
        rec.log_step(slow, 0, 1.0, obs)
        slow_by_ms = int(time.time() * 1000)  # its start is at or before this
        fast = set(record_episodes(rec, 10, seed=1, max_len=5))
        assert rec.flush(10) == 0
        watcher.start()
        wait_for(lambda: fast <= committed(), 90, what="the first fast episodes committed")
        wait_for(lambda: seen and seen[-1][1] <= slow_by_ms, 30, what="a watermark")
        procs[0].kill()  # kill -9 with the slow episode open
        procs[0].wait()
        restarted = time.time()
        procs.append(_consume(broker, topic, output, "g1"))
        fast |= set(record_episodes(rec, 10, seed=2, max_len=5))
        assert rec.flush(10) == 0
        wait_for(lambda: fast <= committed(), 90, what="the fast episodes after the restart committed")
        wait_for(
            lambda: any(d["time"] > restarted for _t, _w, d in seen), 30, what="the restarted consumer's watermark"
        )
        second = time.time()
        procs.append(_consume(broker, topic, output, "g2"))  # another group, the same store
        fast |= set(record_episodes(rec, 10, seed=3, max_len=5))
        assert rec.flush(10) == 0
        wait_for(lambda: fast <= committed(), 120, what="the fast episodes with two groups committed")
        wait_for(lambda: any(d["time"] > second + 2 for _t, _w, d in seen), 30, what="a watermark with two groups")
        assert slow not in committed()
        rec.log_step(slow, 0, 1.0, obs, terminated=True)
        assert rec.flush(10) == 0
        wait_for(lambda: slow in committed(), 120, what="the slow episode committed")
        wait_for(lambda: seen[-1][1] > slow_by_ms, 30, what="the watermark past the slow episode")
        for p in procs:  # a restart with nothing new to read still moves it (an idle partition)
            p.kill()
            p.wait()
        idle = time.time()
        procs.append(_consume(broker, topic, output, "g1"))
        wait_for(lambda: seen[-1][1] >= idle * 1000, 60, what="an idle partition's watermark after a restart")
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    (landed,) = [e for e in PartitionLog(storage, topic, 0).load() if slow in getattr(e, "episode_ids", ())]
    early = [(t, w) for t, w, _d in seen if t < landed.commit_time]
    assert early and all(w <= slow_by_ms for _t, w in early), [x for x in early if x[1] > slow_by_ms][:3]
    epochs = {d["epoch"] for _t, w, d in seen if w <= slow_by_ms}
    assert len(epochs) >= 3  # the first consumer's, the restarted one's, the other group's (at least)


def test_an_episode_read_after_its_cohort_was_taken_as_complete_is_counted_late(tmp_path):
    """A partition without a watermark is guessed complete after episode_max_s; an episode that
    started before such a cohort end and lands after it is counted (`late`) and logged."""
    uri = str(tmp_path)
    c = ShardCommitter(uri, "rl", 0)
    t0 = 1_000_000.0
    ev = CanaryEvidence(uri, version=2, base_version=1, started=t0, gamma=1.0, share=0.5)
    c.commit([_episode(2, [1.0], int((t0 + 1) * 1000), _arm_id("a", True), 2, share=0.5)])
    ev.refresh(now=t0 + 1000, episode_max_s=60.0)
    assert ev.late == 0
    c.commit([_episode(1, [1.0], int((t0 + 5) * 1000), _arm_id("b", False), 2, share=0.5)])  # began before t0 + 940
    ev.refresh(now=t0 + 1010, episode_max_s=60.0)
    assert ev.late == 1


class _SlowFirstFetch:
    """A consumer whose messages (the partition's end included) reach the loop only `hold_s`
    after the first one came: a first fetch that answers late, which every claim has."""

    def __init__(self, consumer, hold_s: float):
        self._consumer, self._hold_s = consumer, hold_s
        self._held: list = []
        self._release_at: float | None = None

    def __getattr__(self, name):
        return getattr(self._consumer, name)

    def consume(self, num_messages: int = 1, timeout: float = -1):
        msgs = self._consumer.consume(num_messages=num_messages, timeout=timeout)
        if msgs and self._release_at is None:
            self._release_at = time.time() + self._hold_s
        if self._release_at is not None and time.time() < self._release_at:
            self._held += msgs
            return []
        out, self._held = self._held + msgs, []
        return out


@pytest.mark.broker
@pytest.mark.slow
def test_a_claimed_partition_has_no_watermark_until_a_fetch_answered_for_it(broker, recorder_config, tmp_path):
    """The loop runs (polls, ticks, writes watermarks) while the partition's first fetch has not
    answered: no watermark may say "caught up" then, over an episode still unread. Once the
    backlog is read the watermark is the open episode's start, and an idle partition's end
    (read, nothing after it) moves it on."""
    import threading
    import uuid

    from rlrec.consumer.service import RecorderConsumer
    from rlrec.consumer.topics import create_topics, dlq_topic_name
    from rlrec.producer import EpisodeRecorder
    from tests.helpers import ACT_SPACE, OBS_SPACE, wait_for

    topic = f"wf-{uuid.uuid4().hex[:8]}"
    create_topics(broker.bootstrap_servers, {topic: 1, dlq_topic_name(topic): 1})
    rec = EpisodeRecorder(broker.bootstrap_servers, topic=topic, observation_space=OBS_SPACE, action_space=ACT_SPACE)
    obs = np.zeros(4, np.float32)
    slow = rec.begin_episode(obs)
    rec.log_step(slow, 0, 1.0, obs)
    slow_by_ms = int(time.time() * 1000)
    assert rec.flush(10) == 0
    cfg = recorder_config(tmp_path / "out", topic=topic)
    storage = Storage.from_uri(cfg.output)

    class SlowFetch(RecorderConsumer):
        def _make_clients(self):
            consumer, producer = super()._make_clients()
            return _SlowFirstFetch(consumer, hold_s=4.0), producer

    c = SlowFetch(cfg, storage)
    seen: list[tuple[float, int]] = []
    # stopped by the test (finally), not by a run time a busy machine's slow start could use up
    t = threading.Thread(target=c.run, kwargs={"max_seconds": 600, "install_signals": False}, daemon=True)
    t.start()
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (seen and seen[-1][1] <= slow_by_ms and time.time() > seen[0][0] + 5):
            w = read_watermark(storage, topic, 0)
            if w is not None:
                seen.append((time.time(), w.open_since_ms))
            time.sleep(0.05)
        assert seen, "no watermark written"
        assert all(w <= slow_by_ms for _t, w in seen), [x for x in seen if x[1] > slow_by_ms][:3]
        rec.log_step(slow, 0, 1.0, obs, terminated=True)
        assert rec.flush(10) == 0
        wait_for(
            lambda: read_watermark(storage, topic, 0).open_since_ms > slow_by_ms, 120, what="the watermark moves on"
        )
    finally:
        c.stop()
        t.join(30)
        rec.close()
