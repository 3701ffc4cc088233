"""The store's resume position (manifest format 3): what shard entries record, how the log folds
and reads it, how strictly it is parsed, and the consumer's defaults derived from the output."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from rlrec.consumer.assembly import PartitionAssembler
from rlrec.consumer.resume import default_group_id, foreign_writers, start_of
from rlrec.consumer.writer import PartitionWriter, Rotation
from rlrec.producer.events import EpisodeStart
from rlrec.store import manifest_entries
from rlrec.store.commit import ShardCommitter
from rlrec.store.compaction import compact_partition
from rlrec.store.maintenance import verify
from rlrec.store.manifest import (
    ClaimEntry,
    ManifestError,
    PartitionLog,
    ReplaceEntry,
    ShardEntry,
    SnapshotEntry,
    UnsupportedManifestError,
    parse_entry,
    read_partition_logs,
)
from rlrec.store.storage import Storage
from tests.test_assembly import ACT, OBS, start, steps

LATER = time.time() + 3600  # past any reward join window


def start_of_policy(eid: str, policy: str) -> EpisodeStart:
    return EpisodeStart(eid, policy, 1, [np.zeros(4, np.float32)], OBS, ACT, "CartPole-v1", {"seed": 1}, 1000)


def finished(events: list[tuple[int, object]]):
    """The finished episodes of `events` (offset, event), assembled as the consumer does."""
    a = PartitionAssembler("rl", 0)
    for off, ev in events:
        assert a.apply(off, ev) == []
    return list(a.finished.values())


def shard_doc(resume: int | None = 7, **extra) -> dict:
    e = ShardEntry(
        path="pol/a.parquet",
        staging_path="pol/_staging/a.parquet",
        topic="rl",
        partition=0,
        policy_id="pol",
        first_offset=0,
        last_offset=3,
        episode_ids=["e1"],
        episodes=1,
        steps=3,
        bytes=10,
        sha256="0" * 64,
        format="episodes",
        format_version=1,
        resume_offset=resume,
    ).with_commit(seq=1, epoch=1, writer="w")
    return {**json.loads(e.to_json()), **extra}


def test_a_shard_entry_with_a_position_is_format_3_and_parsed_strictly(monkeypatch):
    doc = shard_doc(7)
    assert doc["manifest_version"] == 3 and doc["resume_offset"] == 7
    assert parse_entry(doc).resume_offset == 7
    plain = shard_doc(None)
    assert "manifest_version" not in plain and parse_entry(plain).resume_offset is None  # format 1, as before
    for bad in ({"resume_offset": -1}, {"resume_offset": "7"}, {"resume_offset": True}, {"manifest_version": 2}):
        with pytest.raises(ManifestError):
            parse_entry({**doc, **bad})
    with pytest.raises(ManifestError, match="manifest_version"):  # a position an older reader would miss
        parse_entry({k: v for k, v in doc.items() if k != "manifest_version"})
    monkeypatch.setattr(manifest_entries, "MANIFEST_FORMAT_VERSION", 2)  # a reader of format 2 refuses, clearly
    with pytest.raises(UnsupportedManifestError, match="upgrade rlrec"):
        parse_entry(doc)
    assert parse_entry(plain).resume_offset is None


def test_a_claim_names_group_and_deployment_in_format_3():
    c = ClaimEntry(seq=0, epoch=1, writer="h:1:u", group="g", deployment="blue")
    d = json.loads(c.to_json())
    assert d["manifest_version"] == 3 and parse_entry(d) == c
    plain = json.loads(ClaimEntry(seq=0, epoch=1, writer="h:1:u").to_json())
    assert "manifest_version" not in plain and "group" not in plain
    for bad in ({"group": ""}, {"group": 3}, {"deployment": "a\nb"}, {"manifest_version": 1}):
        with pytest.raises(ManifestError):
            parse_entry({**d, **bad})


def test_a_merged_shard_never_carries_a_position():
    shard = parse_entry(shard_doc(None))
    r = ReplaceEntry(replaces=(1,), shard=shard).with_commit(seq=2, epoch=1, writer="w")
    doc = json.loads(r.to_json())
    doc["shard"] = {**doc["shard"], "resume_offset": 5, "manifest_version": 3}
    with pytest.raises(ManifestError, match="never moves the resume position"):
        parse_entry(doc)


def test_each_entry_records_the_offset_the_consumer_would_commit(tmp_path):
    """Held at an open episode's start; past everything once nothing is open."""
    storage = Storage.from_uri(str(tmp_path))
    w = PartitionWriter(storage, "rl", 0)
    w.claim(from_store=True)
    assert w.replay_from is None
    a = w.assembler
    a.apply(0, start("a"))
    a.apply(1, start("b"))  # stays open across the first shard
    a.apply(2, steps("a", 0, 2, terminated=True))
    w.tick(LATER, force=True)
    a.apply(3, steps("b", 0, 2, terminated=True))
    a.apply(4, start("c"))
    a.apply(5, steps("c", 0, 2, terminated=True))
    w.tick(LATER, force=True)
    entries = [e for e in PartitionLog(storage, "rl", 0).load() if isinstance(e, ShardEntry)]
    assert [(e.episode_ids, e.resume_offset) for e in entries] == [(("a",), 1), (("b", "c"), 6)]
    # the next owner resumes there, and so does a re-claim
    w2 = PartitionWriter(storage, "rl", 0)
    w2.claim(from_store=True)
    assert w2.replay_from == 6 == w2.committer.resume_offset


def test_an_unacknowledged_dead_letter_holds_the_position(tmp_path):
    storage = Storage.from_uri(str(tmp_path))
    w = PartitionWriter(storage, "rl", 0)
    w.claim(from_store=True)
    a = w.assembler
    a.apply(0, start("a"))
    a.apply(1, steps("a", 0, 2, terminated=True))
    a.next_offset = 3  # offset 2 was dead-lettered, not acknowledged yet
    w.tick(LATER, force=True, first_unacked=2)
    (e,) = [e for e in PartitionLog(storage, "rl", 0).load() if isinstance(e, ShardEntry)]
    assert e.resume_offset == 2


def test_a_shard_is_held_at_the_episodes_of_its_write_not_yet_committed(tmp_path):
    """One write, two policies: the first shard's entry must not pass the second's episodes."""
    storage = Storage.from_uri(str(tmp_path))
    w = PartitionWriter(storage, "rl", 0)
    w.claim(from_store=True)
    for off, ev in [
        (0, start_of_policy("x", "p1")),
        (1, start_of_policy("y", "p2")),
        (2, steps("x", 0, 2, terminated=True)),
        (3, steps("y", 0, 2, terminated=True)),
    ]:
        w.assembler.apply(off, ev)
    w.tick(LATER, force=True)
    entries = [e for e in PartitionLog(storage, "rl", 0).load() if isinstance(e, ShardEntry)]
    assert [(e.policy_id, e.resume_offset) for e in entries] == [("p1", 1), ("p2", 4)]


def test_snapshots_fold_the_position_and_compaction_never_moves_it(tmp_path):
    storage = Storage.from_uri(str(tmp_path))
    c = ShardCommitter(storage, "rl", 0, snapshot_every=3)
    c.claim()
    offset = 0
    for i in range(7):
        eps = finished([(offset, start(f"e{i}")), (offset + 1, steps(f"e{i}", 0, 2, terminated=True))])
        offset += 2
        c.commit(eps, resume_offset=lambda _eps, at=offset: at)
    snaps = [e for e in PartitionLog(storage, "rl", 0).load() if isinstance(e, SnapshotEntry)]
    assert snaps and all(s.resume_offset is not None for s in snaps)
    assert json.loads(storage.read(f"_manifest/rl/00000/{snaps[-1].seq:012d}.json"))["manifest_version"] == 3
    fresh = PartitionLog(storage, "rl", 0)
    fresh.claim("next", from_position=True)  # the newest snapshot and the tail: no full read
    assert fresh.resume_offset == 14
    res = compact_partition(fresh, target_bytes=1 << 30, min_age_s=0)  # by the newest owner
    assert res.written
    replaced = [e for e in PartitionLog(storage, "rl", 0).load() if isinstance(e, ReplaceEntry)]
    assert replaced and all(r.shard.resume_offset is None for r in replaced)
    after = PartitionLog(storage, "rl", 0)
    after.claim("after", from_position=True)
    assert after.resume_offset == 14
    assert read_partition_logs(storage)  # every reader still reads the log


def test_where_a_partition_starts():
    assert start_of(120, True, "latest").offset == 120
    assert start_of(None, True, "latest").offset == -2  # shards without positions: from the beginning
    assert start_of(None, False, "earliest").offset == -2
    assert start_of(None, False, "latest").offset == -1


def test_the_default_group_is_derived_from_the_normalized_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "d"
    groups = {default_group_id(Storage.from_uri(u)) for u in (str(d), "./d", f"file://{d}", f"{d}/")}
    assert len(groups) == 1
    assert default_group_id(Storage.from_uri(str(tmp_path / "other"))) not in groups
    assert os.path.basename(groups.pop()).startswith("rlrec-")


def test_a_foreign_group_is_named():
    claims = [
        ClaimEntry(seq=0, epoch=1, writer="a:1:x", group="mine", deployment="h1"),
        ClaimEntry(seq=5, epoch=2, writer="b:2:y", group="theirs", deployment="h2"),
        ClaimEntry(seq=9, epoch=3, writer="old:3:z"),  # an older rlrec names no group
    ]
    line = foreign_writers(claims, "mine")
    assert "group 'theirs' (deployment 'h2', writer b:2:y, epoch 2 at seq 5)" in line and "--group-id" in line
    assert foreign_writers(claims[:1] + claims[2:], "mine") is None


def unwritable_steps(eid: str):
    """Steps the tabular format cannot encode: an extra model output named `obs` (RLlib
    reserves the column)."""
    s = steps(eid, 0, 2, terminated=True)
    return dataclasses.replace(s, extra_model_outputs={**s.extra_model_outputs, "obs": np.zeros(2, np.float32)})


def positions(storage: Storage) -> list[tuple[tuple[str, ...], int | None]]:
    return [
        (e.episode_ids, e.resume_offset) for e in PartitionLog(storage, "rl", 0).load() if isinstance(e, ShardEntry)
    ]


@pytest.mark.parametrize("background", [False, True])
def test_an_unwritable_episode_holds_the_position_until_its_dead_letter_is_sent(tmp_path, background):
    """One episode per shard, `a` (offsets 0-1) cannot be encoded, `b` (2-3) can: no entry may
    resume past `a` before a's dead letter exists (a kill -9 then would lose `a`: in neither a
    shard nor the DLQ). With an encoding thread, the forced tick (revoke, shutdown) applies the
    write that found `a` unwritable, then writes `b` before the caller sends a's dead letter."""
    storage = Storage.from_uri(str(tmp_path))
    encoder = ThreadPoolExecutor(1) if background else None
    try:
        w = PartitionWriter(storage, "rl", 0, fmt="tabular", rotation=Rotation(max_episodes=1), encoder=encoder)
        w.claim(from_store=True)
        a = w.assembler
        a.apply(0, start("a"))
        a.apply(1, unwritable_steps("a"))
        if background:  # `a` alone goes to the encoding thread; `b` comes while it is written
            assert w.tick(LATER).unwritable == []
            w._encoding[1].result()
        a.apply(2, start("b"))
        a.apply(3, steps("b", 0, 2, terminated=True))
        t = w.tick(LATER, force=True)
        assert [fe.episode_id for fe, _ in t.unwritable] == ["a"]
        assert positions(storage) == [(("b",), 0)]  # held at a's first offset: its dead letter is not sent yet
        assert w.offset_to_commit(None) == 0
        # the caller sent a's dead letter (at its first offset): the DLQ holds the position until acknowledged
        w.dead_lettered(["a"])
        assert w.offset_to_commit(0) == 0
        a.apply(4, start("c"))
        a.apply(5, steps("c", 0, 2, terminated=True))
        w.tick(LATER, force=True, first_unacked=0)
        assert positions(storage)[-1] == (("c",), 0)
        a.apply(6, start("d"))
        a.apply(7, steps("d", 0, 2, terminated=True))
        w.tick(LATER, force=True)  # acknowledged: nothing holds it
        assert positions(storage)[-1] == (("d",), 8)
        assert w.offset_to_commit(None) == 8
    finally:
        if encoder is not None:
            encoder.shutdown()


def test_offsets_past_int64_are_refused_when_parsed():
    """A Kafka offset is an int64: a forged larger one never reaches the Kafka client."""
    assert parse_entry(shard_doc(2**63 - 1)).resume_offset == 2**63 - 1
    for bad in ({"resume_offset": 2**63}, {"resume_offset": 2**80}, {"last_offset": 2**63}):
        with pytest.raises(ManifestError, match="2\\*\\*63-1"):
            parse_entry({**shard_doc(7), **bad})


def test_verify_finds_a_snapshot_whose_position_is_not_the_logs(tmp_path):
    """A snapshot moving the position ahead would make every consumer skip offsets, silently."""
    storage = Storage.from_uri(str(tmp_path))
    c = ShardCommitter(storage, "rl", 0, snapshot_every=3)
    c.claim()
    for i in range(4):
        eps = finished([(2 * i, start(f"e{i}")), (2 * i + 1, steps(f"e{i}", 0, 2, terminated=True))])
        c.commit(eps, resume_offset=lambda _eps, at=2 * i + 2: at)
    assert verify(storage) == []
    snap = next(e for e in PartitionLog(storage, "rl", 0).load() if isinstance(e, SnapshotEntry))
    path = f"_manifest/rl/00000/{snap.seq:012d}.json"
    doc = json.loads(storage.read(path))
    doc["resume_offset"] += 1000  # above every folded entry's: the parser cannot tell
    storage.write(path, json.dumps(doc).encode())
    problems = verify(storage)
    assert any(
        f"snapshot seq {snap.seq}: resume_offset {snap.resume_offset + 1000} != {snap.resume_offset}" in p
        for p in problems
    ), problems


def test_start_from_latest_is_recorded_at_the_claim(tmp_path):
    """--start-from latest is resolved when a new store claims the partition and recorded in the
    claim: an owner claiming again before the first shard (a restart, a rebalance) starts at
    the same offset, not at the partition's new end (the events in between would be a gap)."""
    storage = Storage.from_uri(str(tmp_path))
    ends = iter([100, 250])  # the partition's end at each claim
    w = PartitionWriter(storage, "rl", 0)
    w.claim(from_store=True, start_at=lambda: next(ends))
    assert w.replay_from == 100
    claim = [e for e in PartitionLog(storage, "rl", 0).load() if isinstance(e, ClaimEntry)][-1]
    assert claim.resume_offset == 100 and json.loads(claim.to_json())["manifest_version"] == 3
    w2 = PartitionWriter(storage, "rl", 0)  # the next owner, before any shard
    w2.claim(from_store=True, start_at=lambda: next(ends))
    assert w2.replay_from == 100 and start_of(w2.replay_from, False, "latest").offset == 100
    assert next(ends) == 250  # never asked again: the store has a position
    w2.assembler.apply(100, start("a"))
    w2.assembler.apply(101, steps("a", 0, 2, terminated=True))
    w2.tick(LATER, force=True)
    assert positions(storage) == [(("a",), 102)]
    assert verify(storage) == []


def test_a_claims_position_is_parsed_strictly_and_folded():
    d = json.loads(ClaimEntry(seq=0, epoch=1, writer="h:1:u", resume_offset=5).to_json())
    assert d["manifest_version"] == 3 and parse_entry(d).resume_offset == 5
    for bad in ({"resume_offset": -1}, {"resume_offset": 2**63}, {"manifest_version": 1}):
        with pytest.raises(ManifestError):
            parse_entry({**d, **bad})


def test_the_default_group_ignores_query_parameters_and_the_uri_form(local_s3, monkeypatch):
    """The same bucket and prefix is one output whatever the URI's query parameters (in any
    order) or trailing slash; another prefix is another output."""
    for k, v in local_s3.env().items():
        monkeypatch.setenv(k, v)
    bucket = local_s3.create_bucket(f"g-{os.urandom(4).hex()}")
    endpoint = local_s3.env()["AWS_ENDPOINT_URL"].split("://", 1)[1]
    uris = [
        f"s3://{bucket}/out",
        f"s3://{bucket}/out/",
        f"s3://{bucket}/out?region=us-east-1",
        f"s3://{bucket}/out?endpoint_override={endpoint}&scheme=http",
        f"s3://{bucket}/out?scheme=http&endpoint_override={endpoint}",
    ]
    assert len({default_group_id(Storage.from_uri(u)) for u in uris}) == 1
    assert default_group_id(Storage.from_uri(f"s3://{bucket}/other")) != default_group_id(Storage.from_uri(uris[0]))


def test_az_and_abfs_name_one_output_one_group(local_azurite, monkeypatch):
    for k, v in local_azurite.env().items():
        monkeypatch.setenv(k, v)
    container = local_azurite.create_container(f"g-{os.urandom(4).hex()}")
    account = Storage.from_uri(f"az://{container}/out")._azure.settings.account_name
    same = [f"az://{container}/out", f"abfs://{container}@{account}.dfs.core.windows.net/out/"]
    assert len({default_group_id(Storage.from_uri(u)) for u in same}) == 1
