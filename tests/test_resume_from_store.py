"""The store decides where a partition resumes (docs/GUARANTEES.md §8, "Replay"), against a real
broker: a group whose offsets ran ahead of a store (another output, a restored copy) leaves no
gap in it; a new store starts where --start-from says; a gap the topic cannot fill is refused in
one line; a writer of another group is named at claim time."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import uuid

import pytest

from rlrec.consumer.resume import GapError
from rlrec.consumer.service import RecorderConsumer
from rlrec.local import FAST_GROUP_KAFKA
from rlrec.store.maintenance import verify
from rlrec.store.manifest import ClaimEntry, read_manifest, read_partition_logs
from rlrec.store.storage import Storage
from tests.helpers import record_episodes, wait_for
from tests.test_consumer_e2e import _recorders, committed_episodes, read_all, run_consumer

pytestmark = pytest.mark.broker


def consume_until(cfg, output: str, want: set[str]) -> RecorderConsumer:
    """Run a consumer of `output` until it holds every episode of `want`, then stop it cleanly."""
    storage = Storage.from_uri(output)
    c, t = run_consumer(cfg, storage)
    try:
        wait_for(lambda: want <= set(read_all(storage)), 60, what=f"{len(want)} episodes in {output}")
    finally:
        c.stop()
        t.join(30)
    assert not t.is_alive()
    return c


def recorder(broker, topic):
    ra, rb = _recorders(broker.bootstrap_servers, topic)
    rb.close()
    return ra


def test_another_output_with_the_same_group_leaves_no_gap(broker, topic, tmp_path, recorder_config):
    """A with group G, then B with G, then A again: A holds every episode exactly once (with the
    group's offsets deciding, A missed every episode B took)."""
    ra = recorder(broker, topic)
    group = f"g-{uuid.uuid4().hex[:6]}"
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    try:
        wave1 = record_episodes(ra, 12, seed=11)
        ra.flush(10)
        consume_until(recorder_config(a, group_id=group), a, set(wave1))
        wave2 = record_episodes(ra, 12, seed=12)
        ra.flush(10)
        consume_until(recorder_config(b, group_id=group), b, set(wave2))
        wave3 = record_episodes(ra, 12, seed=13)
        ra.flush(10)
        everything = set(wave1) | set(wave2) | set(wave3)
        consume_until(recorder_config(a, group_id=group), a, everything)
    finally:
        ra.close()
    got = read_all(Storage.from_uri(a))  # asserts no episode twice
    assert set(got) == everything
    assert set(read_all(Storage.from_uri(b))) == set(wave1) | set(wave2)  # a new store starts at the earliest
    assert verify(Storage.from_uri(a)) == []


def test_a_store_restored_from_an_older_copy_catches_up(broker, topic, tmp_path, recorder_config):
    ra = recorder(broker, topic)
    out, copy = str(tmp_path / "out"), str(tmp_path / "copy")
    cfg = recorder_config(out)
    try:
        wave1 = record_episodes(ra, 10, seed=21)
        ra.flush(10)
        consume_until(cfg, out, set(wave1))
        shutil.copytree(out, copy)  # the backup
        wave2 = record_episodes(ra, 10, seed=22)
        ra.flush(10)
        consume_until(cfg, out, set(wave1) | set(wave2))
        shutil.rmtree(out)
        shutil.copytree(copy, out)  # restored: the group's offsets are past wave 2
        consume_until(cfg, out, set(wave1) | set(wave2))
    finally:
        ra.close()
    assert set(read_all(Storage.from_uri(out))) == set(wave1) | set(wave2)


def test_a_position_the_topic_no_longer_holds_is_refused_in_one_line(
    broker, topic, tmp_path, recorder_config, monkeypatch, caplog
):
    """Tansu keeps every offset, so retention is played by the earliest offset the consumer is told."""
    ra = recorder(broker, topic)
    out = str(tmp_path / "out")
    cfg = recorder_config(out)
    try:
        wave1 = record_episodes(ra, 8, seed=31)
        ra.flush(10)
        consume_until(cfg, out, set(wave1))
    finally:
        ra.close()
    positions: dict[int, int] = {}
    for e in read_manifest(Storage.from_uri(out)):
        positions[e.partition] = max(positions.get(e.partition, 0), e.resume_offset)
    monkeypatch.setattr(RecorderConsumer, "_low_watermark", lambda self, p: positions.get(p, 0) + 5)
    c = RecorderConsumer(cfg, Storage.from_uri(out))
    with pytest.raises(GapError) as info:
        c.run(max_seconds=40, install_signals=False)
    line = str(info.value)
    assert "\n" not in line and "5 offsets are gone" in line and "--accept-gap" in line
    assert committed_episodes(Storage.from_uri(out)) == len(wave1)

    cfg.accept_gap = True  # the operator accepts the gap: read on from the earliest offset
    caplog.set_level(logging.INFO, logger="rlrec.consumer")
    c2 = RecorderConsumer(cfg, Storage.from_uri(out))
    reading_from: dict[int, int] = {}
    real_claim = c2._start_offset

    def start_offset(p):  # where each claimed partition is read from, as assigned
        reading_from[p] = real_claim(p)
        return reading_from[p]

    monkeypatch.setattr(c2, "_start_offset", start_offset)
    t2 = threading.Thread(target=c2.run, kwargs={"install_signals": False}, daemon=True)
    t2.start()
    try:
        wait_for(lambda: len(c2.writers) == 4 and all(w.assembler for w in c2.writers.values()), 40, what="claims")
    finally:
        c2.stop()
        t2.join(30)
    assert c2._refused is None
    assert reading_from == {p: positions.get(p, 0) + 5 for p in range(4)}  # past the gap: skipped
    skipped = [
        r.getMessage() for r in caplog.records if "--accept-gap" in r.getMessage() and "skipped" in r.getMessage()
    ]
    assert sorted(skipped) == sorted(
        f"partition {p}: --accept-gap: 5 offsets ({positions.get(p, 0)}..{positions.get(p, 0) + 4}) skipped"
        for p in range(4)
    )


def test_a_new_store_starts_where_start_from_says(broker, topic, tmp_path, recorder_config):
    ra = recorder(broker, topic)
    early, late = str(tmp_path / "early"), str(tmp_path / "late")
    try:
        before = record_episodes(ra, 10, seed=41)
        ra.flush(10)
        c, t = run_consumer(recorder_config(late, start_from="latest"), Storage.from_uri(late))
        try:
            wait_for(lambda: len(c.writers) == 4 and all(w.assembler for w in c.writers.values()), 40, what="claims")
            after = record_episodes(ra, 10, seed=42)
            ra.flush(10)
            wait_for(lambda: set(after) <= set(read_all(Storage.from_uri(late))), 60, what="the new episodes")
        finally:
            c.stop()
            t.join(30)
        consume_until(recorder_config(early), early, set(before) | set(after))  # earliest: the default
    finally:
        ra.close()
    # "latest" comes from the broker's ListOffsets, which Tansu answers wrongly (too early), so
    # only part of what came before may be read; never all of it
    assert not set(before) <= set(read_all(Storage.from_uri(late)))


def test_a_writer_of_another_group_is_named_at_claim(broker, topic, tmp_path, recorder_config, caplog):
    ra = recorder(broker, topic)
    out = str(tmp_path / "out")
    try:
        wave1 = record_episodes(ra, 8, seed=51)
        ra.flush(10)
        consume_until(recorder_config(out, group_id="first-group", deployment="blue"), out, set(wave1))
        caplog.set_level(logging.WARNING, logger="rlrec.consumer")
        kafka = {**FAST_GROUP_KAFKA, "auto.offset.reset": "latest"}  # overridden: the store decides, said once
        c, t = run_consumer(recorder_config(out, group_id="second-group", kafka_config=kafka), Storage.from_uri(out))
        try:
            wait_for(lambda: len(c.writers) == 4 and all(w.assembler for w in c.writers.values()), 40, what="claims")
        finally:
            c.stop()
            t.join(30)
    finally:
        ra.close()
    named = [r.getMessage() for r in caplog.records if "another consumer group" in r.getMessage()]
    assert named and all("group 'first-group' (deployment 'blue'" in m and "--group-id" in m for m in named)
    assert c.group_id == "second-group"
    overridden = [r.getMessage() for r in caplog.records if "auto.offset.reset=latest is overridden" in r.getMessage()]
    assert len(overridden) == 1


def test_two_groups_writing_one_store_keep_exactly_once(broker, topic, tmp_path, recorder_config, monkeypatch):
    """Two groups on one output fence each other at every claim; each re-claim reads from the
    store's position (not its group's offsets), and no episode is written twice or missed."""
    from rlrec.consumer import writer

    monkeypatch.setattr(writer, "FENCED_RETRY_S", 1.0)  # re-claim soon after a fence
    ra = recorder(broker, topic)
    out = str(tmp_path / "out")
    storage = Storage.from_uri(out)
    truth: dict = {}
    x, tx = run_consumer(recorder_config(out, group_id="group-x"), storage)
    y, ty = run_consumer(recorder_config(out, group_id="group-y"), Storage.from_uri(out))
    try:
        for wave in range(4):
            truth.update(record_episodes(ra, 8, seed=60 + wave))
            ra.flush(10)
            time.sleep(1.0)
        wait_for(lambda: set(truth) <= set(read_all(storage)), 120, what="every episode in the store")
        time.sleep(1.0)  # a late duplicate would show up here
    finally:
        for c, t in ((x, tx), (y, ty)):
            c.stop()
            t.join(30)
        ra.close()
    assert set(read_all(storage)) == set(truth)  # read_all refuses an episode twice
    claims = [e for log in read_partition_logs(storage).values() for e in log if isinstance(e, ClaimEntry)]
    assert {c.group for c in claims} == {"group-x", "group-y"}
    assert x.metrics.fenced._value.get() + y.metrics.fenced._value.get() > 0
    assert verify(storage) == []


def test_a_forged_position_no_kafka_offset_can_be_never_crashes_the_consumer(
    broker, topic, tmp_path, recorder_config, caplog
):
    """A shard entry whose resume_offset is past int64 (2**80): refused when the log is read (the
    claim fails, is retried, the partition waits), in one clear line -- never an OverflowError
    out of the rebalance callback that ends the consumer, restarted for ever."""
    ra = recorder(broker, topic)
    out = str(tmp_path / "out")
    storage = Storage.from_uri(out)
    try:
        wave1 = record_episodes(ra, 8, seed=71)
        ra.flush(10)
        consume_until(recorder_config(out), out, set(wave1))
    finally:
        ra.close()
    newest = max(read_manifest(storage), key=lambda e: e.seq)
    path = f"_manifest/{topic}/{newest.partition:05d}/{newest.seq:012d}.json"
    doc = json.loads(storage.read(path))
    doc["resume_offset"] = 2**80
    storage.write(path, json.dumps(doc).encode())
    caplog.set_level(logging.INFO, logger="rlrec")
    c, t = run_consumer(recorder_config(out), Storage.from_uri(out))
    try:
        wait_for(lambda: sum(1 for w in c.writers.values() if w.assembler) == 3, 40, what="the other claims")
        time.sleep(2.0)
        assert t.is_alive()  # the consumer goes on with the partitions it can read
        assert c.writers[newest.partition].assembler is None  # the forged one waits, unclaimed
    finally:
        c.stop()
        t.join(30)
    lines = [r.getMessage() for r in caplog.records if f"partition {newest.partition}:" in r.getMessage()]
    assert any("resume_offset" in m and "2**63-1" in m for m in lines), lines


def test_a_partition_missing_from_a_store_that_holds_shards_gets_the_gap_check(
    broker, topic, tmp_path, recorder_config, monkeypatch
):
    """A store restored without one partition's log, whose start retention removed: refused in
    one line (it read from the earliest offset silently); a store that never held a shard starts
    at the earliest retained offset, as --start-from earliest says."""
    ra = recorder(broker, topic)
    out, fresh = str(tmp_path / "out"), str(tmp_path / "fresh")
    try:
        wave1 = record_episodes(ra, 8, seed=81)
        ra.flush(10)
        consume_until(recorder_config(out), out, set(wave1))
    finally:
        ra.close()
    storage = Storage.from_uri(out)
    lost = max(read_manifest(storage), key=lambda e: e.seq).partition
    storage.delete_tree(f"_manifest/{topic}/{lost:05d}")  # restored without it
    monkeypatch.setattr(RecorderConsumer, "_low_watermark", lambda self, p: 3 if p == lost else 0)
    c = RecorderConsumer(recorder_config(out), storage)
    with pytest.raises(GapError) as info:
        c.run(max_seconds=40, install_signals=False)
    assert f"{topic}/{lost}: the store resumes at offset 0 but the topic keeps offsets from 3 on: 3 offsets" in str(
        info.value
    )
    c2, t2 = run_consumer(recorder_config(fresh), Storage.from_uri(fresh))  # holds nothing: no gap
    try:
        wait_for(lambda: len(c2.writers) == 4 and all(w.assembler for w in c2.writers.values()), 40, what="claims")
        assert c2.writers[lost].replay_from == 3  # recorded in its claim
    finally:
        c2.stop()
        t2.join(30)
    assert c2._refused is None


def test_a_log_without_positions_gets_the_gap_check(broker, topic, tmp_path, recorder_config, monkeypatch):
    """Shards written before manifest format 3 carry no position: if retention removed offsets
    past the newest shard's last one, that is refused in one line, not read on silently."""
    ra = recorder(broker, topic)
    out = str(tmp_path / "out")
    try:
        wave1 = record_episodes(ra, 8, seed=91)
        ra.flush(10)
        consume_until(recorder_config(out), out, set(wave1))
    finally:
        ra.close()
    storage = Storage.from_uri(out)
    newest: dict[int, int] = {}
    for f in storage.list("_manifest", recursive=True):  # rewritten as an rlrec before format 3 wrote them
        if not f.path.endswith(".json") or f.is_dir:
            continue
        doc = json.loads(storage.read(f.path))
        if doc.get("type") not in ("shard", "claim"):
            continue
        for k in ("resume_offset", "group", "deployment", "manifest_version"):
            doc.pop(k, None)
        storage.write(f.path, json.dumps(doc).encode())
        if doc["type"] == "shard":
            newest[doc["partition"]] = max(newest.get(doc["partition"], -1), doc["last_offset"])
    p = max(newest)
    monkeypatch.setattr(RecorderConsumer, "_low_watermark", lambda self, q: newest[p] + 3 if q == p else 0)
    c = RecorderConsumer(recorder_config(out), storage)
    with pytest.raises(GapError) as info:
        c.run(max_seconds=40, install_signals=False)
    assert f"resumes at offset {newest[p] + 1} but the topic keeps offsets from {newest[p] + 3} on" in str(info.value)


class _Seeks:
    """Stands in for the Kafka consumer where only seeks matter (the decision logic alone)."""

    def __init__(self):
        self.seeks: list[tuple[int, int]] = []

    def seek(self, tp):
        self.seeks.append((tp.partition, tp.offset))

    def pause(self, tps):
        pass

    def resume(self, tps):
        pass


def test_an_offset_the_broker_says_is_out_of_range(tmp_path, monkeypatch):
    """auto.offset.reset=error: a fetch out of range is a gap below the earliest retained offset
    (refused, or skipped with --accept-gap) or a position past the end (the topic re-created)."""
    from rlrec.consumer.config import ConsumerConfig
    from rlrec.consumer.writer import PartitionWriter

    def consumer(accept_gap: bool, earliest: int) -> RecorderConsumer:
        c = RecorderConsumer(
            ConsumerConfig(bootstrap_servers="b:1", output=str(tmp_path), topic="rl", accept_gap=accept_gap),
            Storage.from_uri(str(tmp_path)),
        )
        c.consumer = _Seeks()
        w = PartitionWriter(c.storage, "rl", 0)
        w.claim(from_store=True)
        w.assembler.next_offset = 40  # where it was reading
        c.writers[0] = w
        monkeypatch.setattr(c, "_low_watermark", lambda p: earliest)
        return c

    c = consumer(False, 50)
    c._out_of_range(0)
    assert "rl/0: the store resumes at offset 40 but the topic keeps offsets from 50 on: 10 offsets" in str(c._refused)
    c = consumer(True, 50)
    c._out_of_range(0)
    assert c._refused is None and c.consumer.seeks == [(0, 50)]
    c = consumer(False, 0)
    c._out_of_range(0)
    assert "past the topic's end: was the topic re-created?" in str(c._refused)
