"""Bounded manifest history: snapshot entries, the hint, claims that cost O(1) + the tail,
skip sets that keep only replayable ids, and readers (inspect, verify, gc, the trainer's
follower) that still see every shard.  Real storage (a local directory and the local S3
server behind tests/faults.py's proxy); storage calls are counted by a Storage subclass
that only counts, and HTTP requests at the proxy.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from pathlib import Path

import pytest

from rlrec.store.commit import ShardCommitter
from rlrec.store.maintenance import gc, inspect, verify
from rlrec.store.manifest import (
    HEAD_HINT,
    MANIFEST_DIR,
    SNAPSHOT_EVERY,
    ClaimEntry,
    FencedError,
    ManifestError,
    PartitionLog,
    ShardEntry,
    SnapshotEntry,
    entry_path,
    parse_entry,
    read_manifest,
    read_partition_logs,
)
from rlrec.store.storage import Storage
from rlrec.trainer.manifest_follower import ManifestFollower
from tests.faults import FaultProxy
from tests.test_storage_manifest import FAST_RETRY, TOPIC, _bucket, make_entry

#: the claim budget: storage calls, LIST pages included, beyond the entries since the last snapshot
CLAIM_BUDGET = 10


class CountingStorage(Storage):
    """A Storage that counts its calls by operation (and does nothing else differently)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.calls: Counter[str] = Counter()
        self.listed: list[str] = []

    @classmethod
    def like(cls, st: Storage) -> CountingStorage:
        return cls(st.filesystem, st.base, retry=st.retry, fsync=st.fsync, s3_client=st._s3_client)

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        self.calls["read"] += 1
        return super().read(path, limit=limit)

    def create_once(self, path: str, data: bytes) -> bool:
        self.calls["create_once"] += 1
        return super().create_once(path, data)

    def write(self, path: str, data: bytes) -> None:
        self.calls["write"] += 1
        return super().write(path, data)

    def list(self, prefix: str = "", recursive: bool = False):
        self.calls["list"] += 1
        self.listed.append(prefix)
        return super().list(prefix, recursive)

    def exists(self, path: str) -> bool:
        self.calls["exists"] += 1
        return super().exists(path)

    def info(self, path: str):
        self.calls["info"] += 1
        return super().info(path)

    def move(self, src: str, dst: str) -> None:
        self.calls["move"] += 1
        return super().move(src, dst)

    def delete(self, path: str, *, missing_ok: bool = True) -> bool:
        self.calls["delete"] += 1
        return super().delete(path, missing_ok=missing_ok)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Storage:
    if request.param == "local":
        return Storage.from_uri(str(tmp_path / "out"), retry=FAST_RETRY, fsync=False)
    s3 = request.getfixturevalue("local_s3")
    mp = request.getfixturevalue("monkeypatch")
    for k, v in s3.env().items():
        mp.setenv(k, v)
    return Storage.from_uri(f"s3://{_bucket(s3)}/out", retry=FAST_RETRY)


def append(log: PartitionLog, i: int, *, ids: int = 1, policy: str = "pol", prefix: str = "ep") -> ShardEntry:
    """Shard i (a few bytes standing in for Parquet): episodes f"{prefix}-{i}-{j}", offsets 10*i ..
    10*i+9; staged, appended and published as a writer does."""
    data = f"shard {i}".encode()
    e, _ = make_entry(
        [f"{prefix}-{i}-{j}" for j in range(ids)], partition=log.partition, first=10 * i, last=10 * i + 9, data=data
    )
    e = dataclasses.replace(e, format="episodes")  # what the trainer's follower selects
    e = e if policy == "pol" else _repolicy(e, policy)
    log.storage.write(e.staging_path, data)
    e = log.append_shard(e)
    log.publish(e)
    return e


def _repolicy(e: ShardEntry, policy: str) -> ShardEntry:
    name = e.path.rsplit("/", 1)[1]
    return dataclasses.replace(e, policy_id=policy, path=f"{policy}/{name}", staging_path=f"{policy}/_staging/{name}")


def build_history(
    store: Storage,
    partition: int,
    shards: int,
    *,
    every: int = SNAPSHOT_EVERY,
    rebalance_every: int = 0,
    prefix: str = "ep",
) -> PartitionLog:
    """A log of `shards` shard entries written the way consumers write it (snapshots every
    `every` entries, a new owner's claim every `rebalance_every` shards)."""
    log = PartitionLog(store, TOPIC, partition, snapshot_every=every)
    log.claim("w0")
    for i in range(shards):
        if rebalance_every and i and i % rebalance_every == 0:
            log = PartitionLog(store, TOPIC, partition, snapshot_every=every)
            log.claim(f"w{i}", replay_from=10 * i)
            log.recover()
        append(log, i, prefix=prefix)
    return log


def tail_length(store: Storage, partition: int) -> int:
    """Entries after the newest snapshot (read the whole log: the test's own bookkeeping)."""
    entries = PartitionLog(store, TOPIC, partition).load()
    last = max((e.seq for e in entries if isinstance(e, SnapshotEntry)), default=-1)
    return len(entries) - 1 - last


# ------------------------------------------------------------------- the claim cost


@pytest.mark.slow
def test_claim_costs_at_most_ten_calls_plus_the_tail_at_20k_entries(tmp_path: Path) -> None:
    """The claim neither lists the log nor reads all 20,000 entries."""
    store = Storage.from_uri(str(tmp_path / "out"), fsync=False)
    n = 20_000
    t0 = time.monotonic()
    build_history(store, 0, n, rebalance_every=1_000)
    build_s = time.monotonic() - t0
    tail = tail_length(store, 0)
    assert tail < SNAPSHOT_EVERY

    counting = CountingStorage.like(store)
    committer = ShardCommitter(counting, TOPIC, 0)
    replay_from = 10 * (n - 30)  # the committed Kafka offset: the last 30 shards can be replayed
    t0 = time.monotonic()
    committer.claim(replay_from=replay_from)
    claim_s = time.monotonic() - t0
    committed = committer.log.committed_last_offsets()
    calls = counting.total
    # reads of the tail + 1 probe past it + hint + snapshot + claim + staging listing + snapshot + hint
    assert calls <= CLAIM_BUDGET + tail, (calls, dict(counting.calls), tail)
    assert all(not p.startswith(MANIFEST_DIR) for p in counting.listed), counting.listed  # no LIST of the log
    # the skip set: every episode that can still be replayed, and no more than the recent window
    replayable = {f"ep-{i}-0" for i in range(n) if 10 * i + 9 >= replay_from}
    assert replayable <= committed.keys()
    assert len(committed) <= 2 * SNAPSHOT_EVERY + 30, len(committed)
    assert all(committed[f"ep-{i}-0"] == 10 * i + 9 for i in range(n - 30, n))
    # memory: the writer holds the entries since the newest snapshot, not the history
    assert len(committer.log.entries) <= SNAPSHOT_EVERY + 2
    # and it can commit right away (a claim's epoch fences every earlier owner)
    assert committer.log.epoch == 21
    print(f"built {n} entries in {build_s:.1f}s; claim: {calls} storage calls, {claim_s * 1000:.1f} ms")


@pytest.mark.slow
def test_claim_on_s3_sends_no_listing_and_a_bounded_number_of_requests(local_s3, monkeypatch) -> None:
    """Counted at the HTTP proxy: the claim does not list the log, whatever its length (no LIST
    page per 1,000 entries, no GET per entry)."""
    proxy = FaultProxy(local_s3.port)
    try:
        for k, v in local_s3.env().items():
            monkeypatch.setenv(k, v)
        bucket = _bucket(local_s3)
        direct = Storage(local_s3.filesystem(), f"{bucket}/out", retry=FAST_RETRY)  # moto, not the proxy
        build_history(direct, 3, 45, every=15, rebalance_every=20)
        tail = tail_length(direct, 3)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        store = Storage.from_uri(f"s3://{bucket}/out", retry=FAST_RETRY)
        proxy.record = True
        c = ShardCommitter(store, TOPIC, 3, snapshot_every=15)
        c.claim(replay_from=10 * 40)
        requests = list(proxy.log)
        committed = c.committed_episode_ids()
    finally:
        proxy.close()
    lists = [p for m, p in requests if m == "GET" and "list-type" in p]
    assert not any("_manifest" in p for p in lists), lists
    # S3 costs about two HTTP requests per storage call (pyarrow reads with HEAD + GET)
    assert len(requests) <= 2 * (CLAIM_BUDGET + tail), (len(requests), tail, requests)
    assert {f"ep-{i}-0" for i in range(40, 45)} <= committed


def claimed_ids(c: ShardCommitter, replay_from: int | None = None) -> set[str]:
    """Claim with `c` and return the committed episode ids it then knows."""
    c.claim(replay_from=replay_from)
    return c.committed_episode_ids()


def test_replay_from_keeps_only_replayable_ids_and_forget_before_prunes(store: Storage) -> None:
    build_history(store, 1, 45, every=10)
    # without replay_from: every committed id
    assert claimed_ids(ShardCommitter(store, TOPIC, 1, snapshot_every=10)) == {f"ep-{i}-0" for i in range(45)}
    c = ShardCommitter(store, TOPIC, 1, snapshot_every=10)
    got = claimed_ids(c, replay_from=10 * 5)  # committed offset inside shard 5
    snap = c.log.snapshot
    assert snap is not None
    window = {f"ep-{i}-0" for i in range(45) if i >= snap.folded_from - 2}  # segment + tail (2 claims before)
    assert {f"ep-{i}-0" for i in range(5, 45)} <= set(got)
    assert set(got) == {f"ep-{i}-0" for i in range(5, 45)} | (window & set(got))
    assert "ep-0-0" not in got and "ep-4-0" not in got
    # offsets committed further: ids below the floor and outside the recent window are forgotten
    c.offsets_committed(10 * 40)
    forgotten = got - c.committed_episode_ids()
    assert "ep-5-0" in forgotten and "ep-44-0" not in forgotten
    assert c.log.committed_episode_ids().isdisjoint(forgotten)
    # the store still refuses an id it has forgotten only through the consumer's skip set, and the
    # recent ones through its own check
    with pytest.raises(Exception, match="already committed"):
        append(c.log, 44)


def test_a_claim_folded_into_a_snapshot_still_fences(store: Storage) -> None:
    zombie = PartitionLog(store, TOPIC, 2, snapshot_every=5)
    zombie.claim("zombie")
    owner = PartitionLog(store, TOPIC, 2, snapshot_every=5)
    owner.claim("owner")
    for i in range(12):
        append(owner, i)  # snapshots fold the owner's claim
    fresh = PartitionLog(store, TOPIC, 2)
    fresh.claim("third")
    assert fresh.max_epoch == 3 and all(not isinstance(e, ClaimEntry) or e.epoch == 3 for e in fresh.entries)
    zombie.refresh()  # reads everything since: the claims directly, the snapshots rebase it
    with pytest.raises(FencedError) as exc:
        append(zombie, 99)
    assert exc.value.newer_epoch == 3


# ------------------------------------------------------------------- readers


def test_readers_see_every_shard_through_snapshots(store: Storage) -> None:
    log = build_history(store, 0, 37, every=5, rebalance_every=10)
    append(build_history(store, 1, 3, every=5, prefix="q"), 3, policy="other", prefix="q")
    originals = {
        (topic, p): [
            parse_entry(store.read(entry_path(topic, p, s)))
            for s in range(PartitionLog(store, topic, p).load()[-1].seq + 1)
        ]
        for topic, p in [(TOPIC, 0), (TOPIC, 1)]
    }
    logs = read_partition_logs(store)
    assert logs == originals  # the folded entries, read through snapshots, equal the stored ones
    assert sum(isinstance(e, SnapshotEntry) for e in logs[(TOPIC, 0)]) >= 5
    shards = read_manifest(store)
    assert len(shards) == 41 and len({e.path for e in shards}) == 41
    assert inspect(store)["totals"]["shards"] == 41
    follower = ManifestFollower(store)
    assert len(follower.poll(force_discover=True)) == 41
    append(log, 37)
    assert [s.path for s in follower.poll()] == [read_manifest(store)[-1].path]
    assert verify(store) == []


def test_whole_history_readers_do_not_list_or_read_every_entry(tmp_path: Path) -> None:
    store = Storage.from_uri(str(tmp_path / "out"), fsync=False)
    build_history(store, 0, 600, every=100)
    counting = CountingStorage.like(store)
    entries = PartitionLog(counting, TOPIC, 0).load()
    assert sum(isinstance(e, ShardEntry) for e in entries) == 600
    assert counting.calls["list"] == 0
    assert counting.calls["read"] <= 600 // 100 + 2 + 100  # hint, one per snapshot, the tail (+ probe)


def test_verify_detects_a_snapshot_that_disagrees_with_the_log(tmp_path: Path) -> None:
    store = Storage.from_uri(str(tmp_path / "out"), fsync=False)
    build_history(store, 0, 12, every=5)
    assert verify(store) == []
    folded = parse_entry(store.read(entry_path(TOPIC, 0, 3)))
    assert isinstance(folded, ShardEntry)
    store.write(entry_path(TOPIC, 0, 3), dataclasses.replace(folded, steps=folded.steps + 1).to_json().encode())
    snap = next(e for e in PartitionLog(store, TOPIC, 0).load() if isinstance(e, SnapshotEntry))
    assert snap.folded_from <= 3 < snap.seq
    assert verify(store) == [f"{TOPIC}/00000 snapshot seq {snap.seq}: folded entry 3 differs from the entry on storage"]


# ------------------------------------------------------------------- the hint


def test_a_missing_stale_or_broken_hint_costs_time_not_correctness(store: Storage) -> None:
    build_history(store, 4, 30, every=5)
    hint = f"{MANIFEST_DIR}/{TOPIC}/00004/{HEAD_HINT}"
    expected = {f"ep-{i}-0" for i in range(30)}
    newest = json.loads(store.read(hint))["snapshot"]
    for content in (None, b"{not json", json.dumps({"snapshot": 1}).encode(), json.dumps({"snapshot": 6}).encode()):
        if content is None:
            store.delete(hint)
        else:
            store.write(hint, content)
        c = ShardCommitter(store, TOPIC, 4, snapshot_every=5)
        assert claimed_ids(c) == expected, content
        assert c.log.snapshot is not None and c.log.snapshot.seq >= newest  # found the newest anyway
        assert json.loads(store.read(hint))["snapshot"] >= newest  # and pointed the hint at it
        newest = json.loads(store.read(hint))["snapshot"]
    assert sum(isinstance(e, ShardEntry) for e in PartitionLog(store, TOPIC, 4).load()) == 30


def test_a_long_log_written_before_snapshots_is_folded_by_its_next_claim(tmp_path: Path) -> None:
    store = Storage.from_uri(str(tmp_path / "out"), fsync=False)
    old = PartitionLog(store, TOPIC, 0, snapshot_every=0)  # as written by code without snapshots
    old.claim("old")
    for i in range(250):
        append(old, i)
    c = ShardCommitter(store, TOPIC, 0, snapshot_every=100)
    assert len(claimed_ids(c, replay_from=0)) == 250
    snap = c.log.snapshot
    assert snap is not None and snap.seq == 252 and snap.prev is None
    counting = CountingStorage.like(store)
    ShardCommitter(counting, TOPIC, 0).claim(replay_from=10 * 249)
    assert counting.total <= CLAIM_BUDGET and not any(p.startswith(MANIFEST_DIR) for p in counting.listed)
    assert len(read_manifest(store)) == 250


# ------------------------------------------------------------------- gc and roll forward


def test_gc_keeps_every_file_a_folded_entry_names(tmp_path: Path) -> None:
    store = Storage.from_uri(str(tmp_path / "out"), fsync=False)
    build_history(store, 0, 8, every=3)
    entries = read_manifest(store)
    assert len(entries) == 8 and any(isinstance(e, SnapshotEntry) for e in PartitionLog(store, TOPIC, 0).load())
    store.write(entries[0].staging_path, store.read(entries[0].path))  # a staged copy left by an interrupted move
    orphan = "pol/_staging/orphan.parquet"
    store.write(orphan, b"never committed")
    assert gc(store, older_than_s=0, now=time.time() + 10 * 365 * 86400) == [orphan]
    assert all(store.exists(e.path) for e in entries) and store.exists(entries[0].staging_path)


def test_snapshot_entries_are_validated() -> None:
    claim = ClaimEntry(seq=0, epoch=1, writer="w")
    e = make_entry(["a"])[0].with_commit(seq=1, epoch=1, writer="w")
    good = SnapshotEntry(
        seq=2,
        epoch=1,
        writer="w",
        prev=None,
        folded_from=0,
        entries=[claim, e],
        last_claim=claim,
        max_last_offset=e.last_offset,
        below_max_last_offset=-1,
        unpublished=[e],
    )
    assert parse_entry(good.to_json()) == good
    d = json.loads(good.to_json())
    bad = {
        "wrong count": {**d, "folded_from": 1},
        "folded snapshot": {**d, "entries": [d["entries"][0], {**d, "seq": 1}]},
        "offsets": {**d, "max_last_offset": 3},
        "claim above": {**d, "last_claim": {**d["last_claim"], "seq": 5}},
        "epoch above": {**d, "epoch": 2},
        "unpublished above": {**d, "unpublished": [{**d["entries"][1], "seq": 4}]},
        "prev": {**d, "prev": 0},
    }
    for what, doc in bad.items():
        with pytest.raises(ManifestError):
            parse_entry(json.dumps(doc))
            pytest.fail(what)


def test_a_writer_never_appends_an_entry_its_readers_refuse(tmp_path: Path, monkeypatch) -> None:
    """Entries over MAX_ENTRY_BYTES: a shard entry is refused before it is written (the log goes
    on), and a snapshot folds only the newest entries that fit, so that every reader of the log
    -- a new claim, read_manifest, the follower -- still reads all of it."""
    import rlrec.store.log_reader as log_reader
    import rlrec.store.manifest as manifest

    store = Storage.from_uri(str(tmp_path / "out"), fsync=False)
    log = PartitionLog(store, TOPIC, 0, snapshot_every=10)
    log.claim("w0")
    one = len(append(log, 0, ids=3).to_json())
    for module in (manifest, log_reader):  # its writers and its readers
        monkeypatch.setattr(module, "MAX_ENTRY_BYTES", one * 6)  # a snapshot of 10 such entries would not fit
    with pytest.raises(ManifestError, match="over MAX_ENTRY_BYTES"):
        append(log, 1, ids=1000)
    assert log.read_entry(2) is None  # nothing written at its seq
    shards = [append(log, i, ids=3) for i in range(2, 25)]
    snaps = [e for e in PartitionLog(store, TOPIC, 0).load() if isinstance(e, SnapshotEntry)]
    assert snaps and all(len(s.to_json()) <= one * 6 for s in snaps)
    assert all(s.folded_from > (0 if s.prev is None else s.prev + 1) for s in snaps)  # older ones unfolded
    listed = {e.path for e in read_manifest(store)}
    assert {e.path for e in shards} < listed and len(listed) == 24
    again = PartitionLog(store, TOPIC, 0)
    again.claim("w1")
    assert max(again.committed_last_offsets().values()) == shards[-1].last_offset
    assert len(again.committed_last_offsets()) == 24 * 3


def test_a_committer_splits_a_shard_whose_entry_would_be_too_large(tmp_path: Path, monkeypatch) -> None:
    """The consumer's commit of a shard whose entry would be over MAX_ENTRY_BYTES: nothing is
    appended for it, the episodes go in smaller shards, every one committed once."""
    import rlrec.store.log_reader as log_reader
    import rlrec.store.manifest as manifest
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    store = Storage.from_uri(str(tmp_path / "out"), fsync=False)
    c = ShardCommitter(store, TOPIC, 0)
    one = c.commit(expert_cartpole_episodes(2, seed=0, max_steps=5)).entries[0]
    for module in (manifest, log_reader):  # its writers and its readers
        monkeypatch.setattr(module, "MAX_ENTRY_BYTES", len(one.to_json()) + 400)  # room for ~2 more ids
    res = c.commit(expert_cartpole_episodes(16, seed=1, max_steps=5))
    assert res.episodes == 16 and res.shards > 1 and not res.unwritable
    entries = read_manifest(store)
    assert sum(e.episodes for e in entries) == 18 and len({i for e in entries for i in e.episode_ids}) == 18
    assert all(len(e.to_json()) <= manifest.MAX_ENTRY_BYTES for e in PartitionLog(store, TOPIC, 0).load())
