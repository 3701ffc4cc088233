"""How a partition's writer keeps the head cheap to open (`rlrec.store.live_set`): a live set with
each log snapshot, written column-wise from the one before it (no entry object per live shard),
and the entries after it read the same way on local and remote storage, with removals,
compaction and a torn entry."""

from __future__ import annotations

import hashlib
import uuid

import pyarrow.fs as pafs
import pytest

from rlrec.store import live_set_file
from rlrec.store.commit import ShardCommitter
from rlrec.store.compaction import compact_partition
from rlrec.store.live_set import (
    LIVE_SET_EVERY,
    head_shards,
    live_set_path,
    live_set_seqs,
    read_live_set,
    write_live_set,
)
from rlrec.store.manifest import SNAPSHOT_EVERY, ManifestError, PartitionLog, ShardEntry, read_manifest
from rlrec.store.retention import retain
from rlrec.store.snapshot import open_snapshot
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes


def _commit(c: ShardCommitter, n: int, seed: int) -> None:
    for i in range(n):
        c.commit(expert_cartpole_episodes(2, seed=seed + i, max_steps=20))


def _shard(i: int) -> tuple[ShardEntry, bytes]:
    data = f"shard {i}".encode()
    name = f"rl+00000+{10 * i:020d}+{10 * i + 9:020d}+e1.{i}.parquet"
    e = ShardEntry(
        path=f"pol/{name}",
        staging_path=f"pol/_staging/{name}",
        topic="rl",
        partition=0,
        policy_id="pol",
        first_offset=10 * i,
        last_offset=10 * i + 9,
        episode_ids=[f"ep-{i}-{j}" for j in range(2)],
        episodes=2,
        steps=20,
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        format="episodes",
        format_version=1,
        event_schema_versions={"EpisodeStart": 1, "StepBatch": 1},
        min_policy_version=1,
        max_policy_version=1,
    )
    return e, data


def _fields(shards) -> list[dict]:
    """Every field of each shard entry but its episode ids (which a live set does not hold)."""
    out = []
    for s in shards:
        d = s.to_dict()
        d.pop("episode_ids", None)
        out.append(d)
    return out


def test_the_writer_writes_a_live_set_with_each_log_snapshot(tmp_path):
    """At the defaults, a reader of the head never reads more than one snapshot's worth of
    entries after the newest live set (with a live set every 1,000 entries: up to 1,000)."""
    assert LIVE_SET_EVERY == SNAPSHOT_EVERY
    st = Storage.from_uri(str(tmp_path / "out"), fsync=False)
    plog = PartitionLog(st, "rl", 0)
    plog.claim("w")
    plog.recover()
    most = 0
    for i in range(3 * SNAPSHOT_EVERY + 50):
        e, data = _shard(i)
        plog.publish(plog.append_shard(e), data)
        seqs = live_set_seqs(st, "rl", 0)
        most = max(most, plog.next_seq - (seqs[-1] if seqs else 0))
    assert most <= SNAPSHOT_EVERY + 1, most  # the entries since the live set and the snapshot itself
    head = head_shards(st, "rl", 0)
    assert head.live_set is not None and head.end - head.live_set <= SNAPSHOT_EVERY + 1
    assert _fields(head.shards) == _fields(head_shards(st, "rl", 0, live_set=False).shards)


def test_a_live_set_is_written_from_the_last_one_without_building_its_entries(tmp_path):
    """The next live set takes the last one's columns less the rows dropped, plus the shards
    added (compaction's replace entries, retention's records, new commits): no `ShardEntry` is
    built for the rows kept, and it holds exactly what the history says."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    c.log.live_set_every = 0  # written here, by hand
    _commit(c, 9, 0)
    write_live_set(c.storage, "rl", 0, writer="test")
    compact_partition(c.log, min_age_s=0, target_bytes=3 * max(e.bytes for e in read_manifest(c.storage)))
    _commit(c, 2, 100)
    assert retain(c.storage, grace_s=0).recorded  # the compacted files: records after the live set
    _commit(c, 2, 200)
    prev = read_live_set(c.storage, "rl", 0)
    assert isinstance(prev.shards, live_set_file.LiveRows)
    ls = write_live_set(c.storage, "rl", 0, writer="test", prev=prev)
    assert ls is not None and ls.removals > prev.removals
    assert prev.shards._built is None, "the entries of the live set it was written from were built"
    history = head_shards(c.storage, "rl", 0, live_set=False)
    assert history.live_set is None and ls.seq == history.end
    assert _fields(ls.shards) == _fields(history.shards)
    again = read_live_set(c.storage, "rl", 0)
    assert again.seq == ls.seq and _fields(again.shards) == _fields(history.shards)
    assert [s.seq for s in open_snapshot(root).entries] == [s.seq for s in history.shards]


def _store(tmp_path) -> str:
    """A log with a live set, then compaction, a removal record and commits after it (single
    entries and a log snapshot)."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=4)
    c.log.live_set_every = 0
    _commit(c, 6, 0)
    write_live_set(c.storage, "rl", 0, writer="test")
    compact_partition(c.log, min_age_s=0, target_bytes=3 * max(e.bytes for e in read_manifest(c.storage)))
    assert retain(c.storage, grace_s=0).recorded
    _commit(c, 7, 100)
    return root


def _remote_copy(local_s3, root: str) -> Storage:
    bucket = local_s3.create_bucket(f"t-{uuid.uuid4().hex[:10]}")
    pafs.copy_files(root, f"{bucket}/out", destination_filesystem=local_s3.filesystem())
    return Storage(local_s3.filesystem(), f"{bucket}/out")


def test_the_entries_after_a_live_set_read_the_same_locally_and_on_s3(tmp_path, local_s3):
    """Locally the entries after the live set are read in turn, remotely 16 at a time in
    parallel: the same head (shards, end), and a torn entry refused by both."""
    root = _store(tmp_path)
    local, remote = Storage.from_uri(root), _remote_copy(local_s3, root)
    assert remote.kind != "local"
    heads = [head_shards(st, "rl", 0) for st in (local, remote)]
    assert all(h.live_set is not None and h.end - h.live_set > 4 for h in heads), heads
    assert heads[0].end == heads[1].end
    assert _fields(heads[0].shards) == _fields(heads[1].shards)
    assert _fields(heads[0].shards) == _fields(head_shards(local, "rl", 0, live_set=False).shards)
    # a torn entry after the live set: neither reader skips it or reads past it
    torn = PartitionLog(local, "rl", 0)._path(heads[0].end - 1)
    data = local.read(torn)
    for st in (local, remote):
        st.write(torn, data[: len(data) // 2])
        with pytest.raises(ManifestError):
            head_shards(st, "rl", 0, history=False)
        with pytest.raises(ManifestError):
            open_snapshot(st)
    assert local.exists(live_set_path("rl", 0, heads[0].live_set))
