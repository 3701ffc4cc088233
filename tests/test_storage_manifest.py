"""Storage layer, manifest log (claims / fencing / conflicts), gc, recover, inspect/verify, CLI.

Every storage test runs on a local directory AND on the local S3 (moto, in this
process).  Nothing of pyarrow or boto3 is mocked: storage faults come from a
real HTTP proxy in front of moto that answers 503 when told to.

moto's conditional PUT is check-then-act (``get_object`` then ``put_object`` in
two steps, server threads in between), unlike real S3 where it is atomic.  The
``_atomic_moto_puts`` fixture serialises moto's PutObject handler so that the
concurrency tests exercise our protocol, not moto's race.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from rlrec.store.maintenance import episode_summary, gc, inspect, verify
from rlrec.store.manifest import (
    ClaimEntry,
    ConflictError,
    FencedError,
    ManifestError,
    PartitionLog,
    ShardEntry,
    entry_path,
    manifest_totals,
    parse_entry,
    read_manifest,
)
from rlrec.store.storage import RetryPolicy, Storage, StorageError
from tests.faults import FaultProxy

FAST_RETRY = RetryPolicy(attempts=4, base_delay=0.005, max_delay=0.02)
TOPIC = "rl.transitions"


# --------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def _atomic_moto_puts() -> Iterator[None]:
    from moto.s3.responses import S3Response

    orig = S3Response.put_object
    lock = threading.Lock()

    def put_object(self):  # type: ignore[no-untyped-def]
        with lock:
            return orig(self)

    S3Response.put_object = put_object
    try:
        yield
    finally:
        S3Response.put_object = orig


@pytest.fixture
def s3_env(local_s3, monkeypatch):
    for k, v in local_s3.env().items():
        monkeypatch.setenv(k, v)
    return local_s3


def _bucket(local_s3) -> str:
    return local_s3.create_bucket(f"t-{uuid.uuid4().hex[:10]}")


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Storage:
    if request.param == "local":
        return Storage.from_uri(str(tmp_path / "out"), retry=FAST_RETRY)
    s3 = request.getfixturevalue("s3_env")
    return Storage.from_uri(f"s3://{_bucket(s3)}/out", retry=FAST_RETRY)


# ---------------------------------------------------------------------- helpers


def shard_bytes(ids: list[str], length: int = 5) -> bytes:
    """A real episode shard (it passes the schema gate): `length` steps of reward 0.5 per episode."""
    import numpy as np
    from gymnasium import spaces

    from rlrec.store.finished import FinishedEpisode
    from rlrec.store.shards import encode_shard

    episodes = [
        FinishedEpisode(
            episode_id=eid,
            policy_id="pol",
            policy_version=1,
            env_id="",
            observation_space=spaces.Box(-1, 1, (2,), np.float32),
            action_space=spaces.Discrete(2),
            observations=[np.zeros((length + 1, 2), np.float32)],
            actions=[np.zeros(length, np.int64)],
            rewards=np.full(length, 0.5),
            infos=[{} for _ in range(length + 1)],
            extra_model_outputs={},
            terminated=True,
            truncated=False,
            first_offset=0,
            last_offset=length,
            started_ms=0,
            ended_ms=0,
        )
        for eid in ids
    ]
    return encode_shard(episodes).data


def make_entry(
    ids: list[str],
    *,
    policy: str = "pol",
    partition: int = 0,
    first: int = 0,
    last: int = 9,
    data: bytes | None = None,
    length: int = 5,
) -> tuple[ShardEntry, bytes]:
    data = shard_bytes(ids, length) if data is None else data
    name = f"{TOPIC}+{partition:05d}+{first:020d}+{last:020d}+{uuid.uuid4().hex[:6]}.parquet"
    e = ShardEntry(
        path=f"{policy}/{name}",
        staging_path=f"{policy}/_staging/{name}",
        topic=TOPIC,
        partition=partition,
        policy_id=policy,
        first_offset=first,
        last_offset=last,
        episode_ids=ids,
        episodes=len(ids),
        steps=length * len(ids),
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        format="episodes",
        format_version=1,
        event_schema_versions={"EpisodeStart": 1, "StepBatch": 1},
        min_policy_version=1,
        max_policy_version=2,
    )
    return e, data


def commit(store: Storage, log: PartitionLog, ids: list[str], *, publish: bool = True, **kw) -> ShardEntry:
    """The caller's commit sequence: stage -> append entry -> publish."""
    e, data = make_entry(ids, partition=log.partition, **kw)
    store.write(e.staging_path, data)
    e = log.append_shard(e)
    if publish:
        assert log.publish(e) is True
    return e


# ---------------------------------------------------------------------- storage


def test_create_once(store: Storage) -> None:
    assert store.create_once("m/a.json", b"first") is True
    assert store.create_once("m/a.json", b"second") is False
    assert store.read("m/a.json") == b"first"
    # Racing creators: exactly one wins, its bytes stay.
    barrier = threading.Barrier(6)

    def racer(i: int) -> bool:
        barrier.wait()
        return store.create_once("m/race.json", f"writer {i}".encode())

    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(racer, range(6)))
    assert sum(results) == 1
    assert store.read("m/race.json") == f"writer {results.index(True)}".encode()
    # No temp files left behind.
    assert [f.name for f in store.list("m")] == ["a.json", "race.json"]


def test_basic_operations_and_uri(store: Storage) -> None:
    store.write("pol/_staging/s.parquet", b"abc")
    store.write("pol/_staging/s.parquet", b"abcd")  # replace
    assert store.read("pol/_staging/s.parquet") == b"abcd"
    assert store.exists("pol/_staging/s.parquet") and not store.exists("pol/s.parquet")
    store.move("pol/_staging/s.parquet", "pol/s.parquet")
    assert not store.exists("pol/_staging/s.parquet")
    files = [f for f in store.list("pol") if not f.is_dir]
    assert [(f.path, f.size) for f in files] == [("pol/s.parquet", 4)]
    assert files[0].mtime is not None and abs(files[0].mtime - time.time()) < 120
    assert [f.path for f in store.list("", recursive=True) if not f.is_dir] == ["pol/s.parquet"]
    assert store.list("does/not/exist") == []
    with pytest.raises(FileNotFoundError):
        store.read("nope")
    with pytest.raises(FileNotFoundError):
        store.move("nope", "nope2")
    # uri() is something pyarrow opens by itself.
    uri = store.uri("pol/s.parquet")
    fs, p = pafs.FileSystem.from_uri(uri) if "://" in uri else (pafs.LocalFileSystem(), uri)
    with fs.open_input_stream(p) as f:
        assert f.read() == b"abcd"
    assert store.delete("pol/s.parquet") is True
    assert store.delete("pol/s.parquet") is False
    with pytest.raises(ValueError):
        store.read("../escape")


def test_from_uri_variants(tmp_path: Path, local_s3, monkeypatch) -> None:
    a = Storage.from_uri(f"file://{tmp_path}/x")
    b = Storage.from_uri(str(tmp_path / "x"))
    assert a.kind == b.kind == "local" and a.base == b.base == str(tmp_path / "x")
    assert a.uri("p/q") == str(tmp_path / "x" / "p" / "q")
    # Explicit S3FileSystem + base, no AWS_* environment at all: the boto3 client for
    # conditional puts is configured from the filesystem.
    for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k, raising=False)
    bucket = _bucket(local_s3)
    s = Storage(local_s3.filesystem(), f"{bucket}/root")
    assert s.kind == "s3" and s.conditional_writes
    assert s.create_once("k", b"1") is True and s.create_once("k", b"2") is False
    assert s.uri("k") == f"s3://{bucket}/root/k"
    # SubTreeFileSystem is unwrapped.
    sub = Storage(pafs.SubTreeFileSystem(f"{bucket}/root", local_s3.filesystem()), "")
    assert sub.kind == "s3" and sub.read("k") == b"1"


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def _read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_upload_download_delete_tree(store: Storage, tmp_path: Path) -> None:
    first = {
        "rllib_checkpoint.json": b"{}",
        "learner_group/learner/state.pkl": os.urandom(300_000),
        "learner_group/metadata.json": b'{"a": 1}',
        "empty": b"",
    }
    second = {"rllib_checkpoint.json": b'{"v": 2}', "learner_group/learner/other.pkl": b"new"}
    store.write("ck/keep.json", b"sibling")
    assert store.upload_dir(_tree(tmp_path / "one", first), "ck/c1/algo") == 4
    files = {f.path: f.size for f in store.list("ck/c1", recursive=True) if not f.is_dir}
    assert files == {f"ck/c1/algo/{k}": len(v) for k, v in first.items()}
    assert store.read("ck/c1/algo/learner_group/learner/state.pkl") == first["learner_group/learner/state.pkl"]
    # Uploading again replaces the tree: nothing of the first upload is left.
    assert store.upload_dir(_tree(tmp_path / "two", second), "ck/c1/algo") == 2
    assert sorted(f.path for f in store.list("ck/c1", recursive=True) if not f.is_dir) == [
        "ck/c1/algo/learner_group/learner/other.pkl",
        "ck/c1/algo/rllib_checkpoint.json",
    ]
    # Download: the same bytes; other files already in the local directory stay.
    dst = _tree(tmp_path / "dst", {"unrelated.txt": b"mine", "rllib_checkpoint.json": b"old"})
    assert store.download_dir("ck/c1/algo", dst) == 2
    assert _read_tree(dst) == {**second, "unrelated.txt": b"mine"}
    assert store.download_dir("ck/c1/algo/learner_group", tmp_path / "new" / "lg") == 1
    assert _read_tree(tmp_path / "new" / "lg") == {"learner/other.pkl": b"new"}
    # Delete: every file and the directory itself (no directory markers left on S3).
    assert store.delete_tree("ck/c1") == 2
    assert not store.exists("ck/c1")
    assert [(f.path, f.is_dir) for f in store.list("ck", recursive=True)] == [("ck/keep.json", False)]
    assert store.delete_tree("ck/c1") == 0  # missing is fine
    assert store.read("ck/keep.json") == b"sibling"


def test_directory_tree_errors(store: Storage, tmp_path: Path) -> None:
    store.write("f.json", b"1")
    with pytest.raises(FileNotFoundError):
        store.download_dir("no/such/dir", tmp_path / "d")
    with pytest.raises(NotADirectoryError):
        store.download_dir("f.json", tmp_path / "d")
    with pytest.raises(NotADirectoryError):
        store.delete_tree("f.json")
    with pytest.raises(FileNotFoundError):
        store.upload_dir(tmp_path / "missing", "x")
    with pytest.raises(ValueError):  # never the whole output root
        store.delete_tree("")
    with pytest.raises(ValueError):
        store.upload_dir(_tree(tmp_path / "src", {"a": b"1"}), ".")
    with pytest.raises(ValueError):
        store.delete_tree("../escape")
    assert store.read("f.json") == b"1" and not store.exists("x")


# --------------------------------------------------------------- manifest JSON


def test_entry_json_roundtrip_and_validation() -> None:
    e, _ = make_entry(["a", "b"])
    e = e.with_commit(seq=3, epoch=2, writer="h:1:u")
    assert parse_entry(e.to_json()) == e
    assert ShardEntry.from_json(e.to_json().encode()) == e
    c = ClaimEntry(seq=0, epoch=1, writer="h:1:u")
    assert ClaimEntry.from_json(c.to_json()) == c
    good = json.loads(e.to_json())
    bad_cases = {
        "unknown type": {**good, "type": "checkpoint"},
        "unknown field": {**good, "extra": 1},
        "missing field": {k: v for k, v in good.items() if k != "sha256"},
        "bool as int": {**good, "partition": True},
        "bad sha": {**good, "sha256": "xyz"},
        "count mismatch": {**good, "episodes": 5},
        "duplicate ids": {**good, "episode_ids": ["a", "a"]},
        "path escape": {**good, "path": "../x.parquet"},
        "staging onto a log entry": {**good, "staging_path": "_manifest/rl/00000/000000000003.json"},
        "path onto a log entry": {**good, "path": "_manifest/rl/00000/000000000003.json"},
        "path of another policy": {**good, "path": "other/" + good["path"].rsplit("/", 1)[-1]},
        "staging of another name": {**good, "staging_path": good["staging_path"] + ".x"},
        "policy id a path": {**good, "policy_id": "_manifest/rl"},
        "offsets": {**good, "first_offset": 10, "last_offset": 9},
        "epoch 0": {**good, "epoch": 0},
    }
    for what, d in bad_cases.items():
        with pytest.raises(ManifestError):
            parse_entry(json.dumps(d))
            pytest.fail(what)
    for raw in (b"not json", b"[1, 2]", b"\xff\xfe"):
        with pytest.raises(ManifestError):
            parse_entry(raw)
    with pytest.raises(ManifestError):
        ShardEntry.from_json(c.to_json())
    with pytest.raises(ManifestError):  # an entry without seq/epoch cannot be written
        make_entry(["a"])[0].to_json()


# ------------------------------------------------------------------ the log


def test_claim_epochs_increase(store: Storage) -> None:
    logs = [PartitionLog(store, TOPIC, 3) for _ in range(3)]
    assert [lg.claim(f"w{i}") for i, lg in enumerate(logs)] == [1, 2, 3]
    fresh = PartitionLog(store, TOPIC, 3)
    entries = fresh.load()
    assert [(e.seq, e.epoch, e.writer) for e in entries] == [(0, 1, "w0"), (1, 2, "w1"), (2, 3, "w2")]
    assert fresh.max_epoch == 3 and fresh.next_seq == 3 and fresh.epoch is None
    assert store.exists(entry_path(TOPIC, 3, 2))
    assert fresh.claim("w3") == 4
    # Other partitions are separate logs.
    assert PartitionLog(store, TOPIC, 4).claim("x") == 1


def test_zombie_writer_is_fenced(store: Storage) -> None:
    a = PartitionLog(store, TOPIC, 0)
    assert a.claim("A") == 1
    commit(store, a, ["e1"])
    b = PartitionLog(store, TOPIC, 0)
    assert b.claim("B") == 2  # B gets the partition; A does not know yet
    assert b.committed_episode_ids() == {"e1"}
    e, data = make_entry(["e2"], first=10, last=19)
    store.write(e.staging_path, data)  # A staged a shard...
    with pytest.raises(FencedError) as exc:
        a.append_shard(e)  # ...but cannot commit it
    assert exc.value.epoch == 1 and exc.value.newer_epoch == 2 and exc.value.newer_writer == "B"
    with pytest.raises(FencedError):
        a.append_shard(e)  # stays fenced (from its cache, no storage round trip needed)
    e2 = commit(store, b, ["e2"], first=10, last=19)
    assert (e2.seq, e2.epoch, e2.writer) == (3, 2, "B")
    shards = PartitionLog(store, TOPIC, 0)
    shards.load()
    assert [s.episode_ids for s in shards.shard_entries()] == [("e1",), ("e2",)]
    assert max(s.last_offset for s in shards.shard_entries()) == 19


def test_conflict_with_own_epoch_and_duplicates(store: Storage) -> None:
    log = PartitionLog(store, TOPIC, 1)
    epoch = log.claim("W")
    commit(store, log, ["a"])
    # An earlier append of ours failed ambiguously (StorageError) but did land:
    landed, _ = make_entry(["b", "c"], partition=1)
    landed = landed.with_commit(seq=log.next_seq, epoch=epoch, writer="W")
    assert store.create_once(entry_path(TOPIC, 1, landed.seq), landed.to_json().encode())
    retry, _ = make_entry(["b", "c", "d"], partition=1)
    with pytest.raises(ConflictError) as exc:
        log.append_shard(retry)
    assert [x.seq for x in exc.value.entries] == [landed.seq]
    assert exc.value.duplicate_episode_ids == {"b", "c"}
    # The caller drops committed ids and retries: lands after the unseen entry.
    e = commit(store, log, ["d"])
    assert e.seq == landed.seq + 1
    # Repeating committed ids is refused up front, with the entries holding them.
    again, _ = make_entry(["a", "z"], partition=1)
    with pytest.raises(ConflictError) as exc:
        log.append_shard(again)
    assert exc.value.duplicate_episode_ids == {"a"} and exc.value.entries[0].episode_ids == ("a",)
    assert log.committed_episode_ids() == {"a", "b", "c", "d"}
    with pytest.raises(RuntimeError):  # must claim before appending
        PartitionLog(store, TOPIC, 1).append_shard(make_entry(["q"], partition=1)[0])


def test_concurrent_appends_one_writer(store: Storage) -> None:
    log = PartitionLog(store, TOPIC, 2)
    log.claim("W")

    def append(i: int) -> int:
        return log.append_shard(make_entry([f"ep-{i}"], partition=2)[0]).seq

    with ThreadPoolExecutor(4) as ex:
        seqs = list(ex.map(append, range(16)))
    assert sorted(seqs) == list(range(1, 17))
    check = PartitionLog(store, TOPIC, 2)
    check.load()
    assert sorted(e.episode_ids[0] for e in check.shard_entries()) == sorted(f"ep-{i}" for i in range(16))


def test_concurrent_writers_fence_each_other(store: Storage) -> None:
    """Writers in threads keep re-claiming (as if the group rebalanced constantly):
    every append that returned is in the log exactly once, nothing else is, and no
    shard is ever committed under an epoch older than the latest claim before it."""
    n_writers, per_writer = 4, 4
    barrier = threading.Barrier(n_writers)

    def writer(w: int) -> tuple[list[str], int]:
        log = PartitionLog(store, TOPIC, 7)
        barrier.wait()
        log.claim(f"w{w}")
        done, fenced = [], 0
        for j in range(per_writer):
            e = make_entry([f"w{w}-{j}"], partition=7)[0]
            while True:
                try:
                    done.append(log.append_shard(e).episode_ids[0])
                    break
                except FencedError:
                    fenced += 1
                    log.claim(f"w{w}")
        return done, fenced

    with ThreadPoolExecutor(n_writers) as ex:
        results = list(ex.map(writer, range(n_writers)))
    committed = [eid for done, _ in results for eid in done]
    assert len(committed) == n_writers * per_writer

    log = PartitionLog(store, TOPIC, 7)
    entries = log.load()  # raises on gaps
    ids = [e.episode_ids[0] for e in entries if isinstance(e, ShardEntry)]
    assert sorted(ids) == sorted(committed)  # none lost, none duplicated, none extra
    current = 0
    for e in entries:
        if isinstance(e, ClaimEntry):
            assert e.epoch > current
            current = e.epoch
        else:
            assert e.epoch == current
    problems = verify(store)  # no shard files were written: only "missing" may be reported
    assert len(problems) == len(committed) and all("published file missing" in p for p in problems)


# ------------------------------------------------------- crash points, gc, recover


def test_crash_before_entry_is_garbage_after_grace(store: Storage) -> None:
    log = PartitionLog(store, TOPIC, 0)
    log.claim("W")
    kept = commit(store, log, ["a"])
    unpublished = commit(store, log, ["b"], publish=False)  # crash after the entry: keep staging
    orphan, data = make_entry(["c"])
    store.write(orphan.staging_path, data)  # crash after staging, before the entry
    store.write(f"pol/{orphan.path.rsplit('/', 1)[1]}.x", b"not ours")  # not *.parquet: left alone
    store.write("notes/readme.txt", b"not a policy dir")
    # A published shard's staging copy (publish = copy + delete interrupted) is named by its entry.
    store.write(kept.staging_path, b"leftover")

    assert gc(store, older_than_s=3600) == []  # too young
    future = time.time() + 7200
    assert gc(store, older_than_s=3600, dry_run=True, now=future) == [orphan.staging_path]
    assert store.exists(orphan.staging_path)  # dry run deletes nothing
    assert gc(store, older_than_s=3600, now=future) == [orphan.staging_path]
    assert not store.exists(orphan.staging_path)
    # a file an entry names is never deleted, whatever its age (not even the staged copy of a
    # published shard): the writer's roll-forward removes such a copy
    assert gc(store, older_than_s=3600, now=future + 10 * 365 * 86400) == []
    assert store.exists(kept.path) and store.exists(kept.staging_path) and store.exists(unpublished.staging_path)
    assert store.exists("notes/readme.txt")
    assert len(PartitionLog(store, TOPIC, 0).load()) == 3  # manifest untouched


def test_crash_after_entry_is_rolled_forward(store: Storage) -> None:
    old = PartitionLog(store, TOPIC, 5)
    old.claim("old")
    done = commit(store, old, ["a", "b"], first=0, last=9)
    pending = commit(store, old, ["c"], first=10, last=12, publish=False)  # crash before publish
    policy_dir = store.uri("pol")

    def visible() -> set[str]:  # what a stock reader of the policy dir sees (skips _staging)
        if "://" in policy_dir:
            fs, p = pafs.FileSystem.from_uri(policy_dir)
            ds = pads.dataset(p, filesystem=fs, format="parquet")
        else:
            ds = pads.dataset(policy_dir, format="parquet")
        return set(ds.to_table(columns=["episode_id"]).column("episode_id").to_pylist())

    assert visible() == {"a", "b"}  # the unpublished shard is not visible yet
    new = PartitionLog(store, TOPIC, 5)
    new.claim("new")
    assert new.recover() == 1
    assert store.exists(pending.path) and not store.exists(pending.staging_path)
    assert visible() == {"a", "b", "c"}
    assert new.recover() == 0  # idempotent
    assert old.publish(pending) is False  # a zombie finishing its publish late is harmless
    assert store.exists(done.path)
    assert verify(store) == []


# ------------------------------------------------- roll-forward publication, the reader race


def _episodes(n: int, seed: int):
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    return expert_cartpole_episodes(n, seed=seed, max_steps=20, policy_id="pol")


def test_own_landed_entry_is_published_within_one_flush_cycle(faulty_store: Storage, fault_proxy: FaultProxy) -> None:
    """The staged-then-conflict sequence: the shard is published by this owner, not left in
    _staging until the next owner's claim. The append lands but every attempt is answered 503 (StorageError); the
    consumer gives the episodes back and flushes again; the conflict shows the landed entry."""
    from rlrec.store.commit import AmbiguousCommitError, ShardCommitter, read_committed_shard

    st = faulty_store
    c = ShardCommitter(st, TOPIC, 0, fmt="tabular")
    c.claim()
    eps = _episodes(2, seed=0)
    fault_proxy.swallow_matching(1, "/_manifest/", method="PUT")
    fault_proxy.fail_matching(FAST_RETRY.attempts - 1, "/_manifest/", method="PUT")
    with pytest.raises(AmbiguousCommitError) as raised:
        c.commit(eps)
    assert isinstance(raised.value.__cause__, StorageError)
    fault_proxy.clear_rules()
    [landed] = PartitionLog(st, TOPIC, 0).load()[1:]
    assert isinstance(landed, ShardEntry) and st.exists(landed.staging_path) and not st.exists(landed.path)

    assert [fe.episode_id for fe in c.uncertain] == [fe.episode_id for fe in eps]
    res = c.commit(eps)
    assert res.shards == 0 and res.duplicates_dropped == 2 and c.uncertain == []
    assert [c.committed_offset(fe.episode_id) for fe in eps] == [landed.last_offset] * 2
    assert st.exists(landed.path) and not st.exists(landed.staging_path)  # published in this cycle
    assert c.pending == []
    assert hashlib.sha256(read_committed_shard(st, landed.path, landed.staging_path)).hexdigest() == landed.sha256
    assert verify(st) == []


def test_retries_of_an_uncertain_append_keep_one_copy(faulty_store: Storage, fault_proxy: FaultProxy) -> None:
    """Every failed append of the same episodes targets the same entry: the retry re-uses the
    attempt's name and bytes (one copy in memory, one staged file), and the landed one is
    published when the conflict reveals it."""
    from rlrec.store.commit import AmbiguousCommitError, ShardCommitter

    st = faulty_store
    c = ShardCommitter(st, TOPIC, 2, fmt="tabular")
    c.claim()
    eps = _episodes(2, seed=4)
    fault_proxy.swallow_matching(1, "/_manifest/", method="PUT")  # the first attempt lands
    fault_proxy.fail_matching(FAST_RETRY.attempts - 1, "/_manifest/", method="PUT")
    for _ in range(3):
        with pytest.raises(AmbiguousCommitError):
            c.commit(eps)
        fault_proxy.clear_rules()
        fault_proxy.fail_matching(FAST_RETRY.attempts, "/_manifest/", method="PUT")
    assert len(c._ambiguous) == 1 and len(c.uncertain) == 2
    fault_proxy.clear_rules()
    res = c.commit(eps)
    assert res.shards == 0 and res.duplicates_dropped == 2 and c._ambiguous == {}
    [landed] = PartitionLog(st, TOPIC, 2).load()[1:]
    assert st.exists(landed.path) and st.list(f"{landed.policy_id}/_staging") == []
    assert verify(st) == []


def test_failed_publish_is_rolled_forward_by_the_next_cycle(faulty_store: Storage, fault_proxy: FaultProxy) -> None:
    """A failed publish is retried by this owner, not left for the next owner's claim. Publishing
    copies the staged object (S3 CopyObject: a PUT with x-amz-copy-source); the proxy fails those."""
    from rlrec.store.commit import ShardCommitter

    st = faulty_store
    c = ShardCommitter(st, TOPIC, 1, fmt="tabular")
    c.claim()
    fault_proxy.fail_matching(10_000, "/", method="PUT", header="x-amz-copy-source")
    [first] = c.commit(_episodes(1, seed=1)).entries
    assert not st.exists(first.path) and st.exists(first.staging_path)
    fault_proxy.clear_rules()
    [second] = c.commit(_episodes(1, seed=2)).entries  # the next flush publishes the first shard first
    assert st.exists(first.path) and not st.exists(first.staging_path) and st.exists(second.path)
    assert c.pending == []

    # the staged file is gone as well (deleted by hand, or by a gc grace period shorter than the
    # outage): the writer publishes the committed bytes it still holds
    fault_proxy.fail_matching(10_000, "/", method="PUT", header="x-amz-copy-source")
    [third] = c.commit(_episodes(1, seed=3)).entries
    assert c.pending == [third] and c.publish_pending() == 0  # backing off: costs no storage call
    fault_proxy.clear_rules()
    st.delete(third.staging_path)
    assert c.publish_pending(force=True) == 1 and c.pending == []
    assert hashlib.sha256(st.read(third.path)).hexdigest() == third.sha256
    assert verify(st) == []


def test_reader_rereads_the_published_path_after_a_staging_miss(store: Storage) -> None:
    """A publish between the reader's two reads (path: missing; then staging_path: moved away)
    must not report a committed shard missing (no FileNotFoundError)."""
    from rlrec.store.commit import read_committed_shard

    log = PartitionLog(store, TOPIC, 0)
    log.claim("W")
    e = commit(store, log, ["a"], publish=False)

    class PublishedBetweenReads(Storage):
        """Publishes the shard (as its writer does) just before the reader's read of the staged file."""

        moved = False

        def read(self, path: str, *, limit: int | None = None) -> bytes:
            if path == e.staging_path and not self.moved:
                self.moved = True
                log.publish(e)
            return super().read(path, limit=limit)

    racing = PublishedBetweenReads(store.filesystem, store.base, retry=FAST_RETRY)
    data = read_committed_shard(racing, e.path, e.staging_path)
    assert racing.moved and hashlib.sha256(data).hexdigest() == e.sha256
    store.delete(e.path)
    with pytest.raises(FileNotFoundError):  # really gone: still reported
        read_committed_shard(store, e.path, e.staging_path)


# ------------------------------------------------------------ inspect / verify


def test_inspect_and_verify(store: Storage) -> None:
    p0, p1 = PartitionLog(store, TOPIC, 0), PartitionLog(store, TOPIC, 1)
    p0.claim("W")
    p1.claim("W")
    good = commit(store, p0, ["a", "b"], first=0, last=9)
    lost = commit(store, p0, ["c"], first=10, last=19, policy="other")
    corrupt = commit(store, p0, ["d"], first=20, last=29)
    dup = commit(store, p1, ["b", "e"], first=0, last=5)  # "b" again, via another partition

    doc = inspect(store)
    assert doc["totals"] == manifest_totals(read_manifest(store))
    assert doc["totals"]["shards"] == 4 and doc["totals"]["episodes"] == 6 and doc["totals"]["steps"] == 30
    assert doc["totals"]["policies"]["other"]["episodes"] == 1
    assert [s["path"] for s in doc["shards"]] == [store.uri(e.path) for e in (good, lost, corrupt, dup)]
    assert set(doc["shards"][0]) >= {
        "path",
        "partition",
        "first_offset",
        "last_offset",
        "episodes",
        "steps",
        "bytes",
        "policy_id",
        "commit_time",
    }
    problems = verify(store)
    assert len(problems) == 1 and "duplicate episode id 'b'" in problems[0]
    summary = episode_summary(store)
    assert summary["length"] == {"count": 6, "mean": 5.0, "min": 5.0, "max": 5.0}

    store.delete(lost.path)
    data = store.read(corrupt.path)
    store.write(corrupt.path, data[:-1] + bytes([data[-1] ^ 1]))  # same size, different bytes
    problems = verify(store)
    assert len(problems) == 3, problems
    assert any("published file missing" in p and lost.path in p for p in problems)
    assert any("sha256" in p and corrupt.path in p for p in problems)
    assert any("duplicate episode id 'b'" in p for p in problems)

    def decode(data: bytes, entry: ShardEntry) -> tuple[int, int]:
        t = pq.read_table(pa.BufferReader(data))
        return t.num_rows, 4 * t.num_rows  # pretend one step per episode was lost

    problems = verify(store, decode_check=decode)
    assert sum("decoded" in p for p in problems) == 2  # good and dup (lost/corrupt fail earlier)


# ------------------------------------------------------------------ faults


@pytest.fixture(scope="module")
def fault_proxy(local_s3) -> Iterator[FaultProxy]:
    p = FaultProxy(local_s3.port)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def faulty_store(local_s3, fault_proxy, monkeypatch) -> Storage:
    for k, v in local_s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{fault_proxy.port}")
    fault_proxy.fail_next(0)
    fault_proxy.swallow_next(0)
    return Storage.from_uri(f"s3://{_bucket(local_s3)}/out", retry=FAST_RETRY)


def test_transient_errors_are_retried(faulty_store: Storage, fault_proxy: FaultProxy) -> None:
    st = faulty_store
    ops = {
        "write": lambda: st.write("pol/_staging/x.parquet", b"x" * 1000),
        "create_once": lambda: st.create_once("m/0.json", b"{}"),
        "read": lambda: st.read("pol/_staging/x.parquet"),
        "exists": lambda: st.exists("pol/_staging/x.parquet"),
        "list": lambda: st.list("pol/_staging"),
        "move": lambda: st.move("pol/_staging/x.parquet", "pol/x.parquet"),
        "delete": lambda: st.delete("pol/x.parquet"),
    }
    for name, op in ops.items():
        fault_proxy.fail_next(FAST_RETRY.attempts - 1)  # fails all but the last attempt
        before = fault_proxy.requests
        result = op()
        assert fault_proxy.requests - before >= FAST_RETRY.attempts, name
        if name == "create_once":
            assert result is True
        if name == "read":
            assert result == b"x" * 1000
    # The manifest protocol works through a flaky store as well.
    log = PartitionLog(st, TOPIC, 0)
    fault_proxy.fail_next(2)
    assert log.claim("W") == 1
    fault_proxy.fail_next(3)
    assert log.append_shard(make_entry(["a"])[0]).seq == 1


def test_exhausted_retries_raise_storage_error(faulty_store: Storage, fault_proxy: FaultProxy) -> None:
    st = faulty_store
    st.write("f", b"1")
    for name, op in {
        "write": lambda: st.write("g", b"2"),
        "create_once": lambda: st.create_once("h", b"3"),
        "read": lambda: st.read("f"),
        "list": lambda: st.list(""),
    }.items():
        fault_proxy.fail_next(10_000)
        before = fault_proxy.requests
        t0 = time.monotonic()
        with pytest.raises(StorageError) as exc:
            op()
        assert exc.value.attempts == FAST_RETRY.attempts, name
        assert fault_proxy.requests - before == FAST_RETRY.attempts, name  # bounded: no hidden retries
        assert time.monotonic() - t0 < 5, name
    fault_proxy.fail_next(0)
    assert not st.exists("h") and st.read("f") == b"1"


def test_ambiguous_conditional_put_is_resolved(faulty_store: Storage, fault_proxy: FaultProxy) -> None:
    st = faulty_store
    fault_proxy.swallow_next(1)  # the PUT lands, the client sees 503, retries, gets 412
    assert st.create_once("m/amb.json", b"mine") is True
    fault_proxy.swallow_next(1)
    assert st.create_once("m/amb.json", b"other") is False  # exists with other bytes
    # Same through the log: the appended entry is reported as committed exactly once.
    log = PartitionLog(st, TOPIC, 0)
    log.claim("W")
    fault_proxy.swallow_next(1)
    e = log.append_shard(make_entry(["x"])[0])
    fresh = PartitionLog(st, TOPIC, 0)
    fresh.load()
    assert [s.episode_ids for s in fresh.shard_entries()] == [("x",)] and e.seq == 1


def test_unreachable_storage_raises_storage_error(tmp_path: Path, monkeypatch) -> None:
    from rlrec.local import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nobody listens
    for k, v in {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(k, v)
    st = Storage.from_uri("s3://nobody-home/x", retry=RetryPolicy(attempts=2, base_delay=0.001, max_delay=0.002))
    with pytest.raises(StorageError):
        st.create_once("a", b"1")
    with pytest.raises(StorageError):
        st.read("a")


# ----------------------------------------------------------------------- CLI


def _run_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlrec", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_cli_inspect_json_and_verify(store: Storage, local_s3) -> None:
    log = PartitionLog(store, TOPIC, 0)
    log.claim("W")
    e = commit(store, log, ["a", "b"])
    uri = store.uri("")
    env = local_s3.env() if store.kind == "s3" else {}

    r = _run_cli(["inspect", uri, "--json"], env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # stdout is exactly one JSON document
    assert doc["totals"]["episodes"] == 2 and doc["shards"][0]["path"] == store.uri(e.path)
    assert doc["episode_summary"]["episode_return"]["mean"] == 2.5

    store.delete(e.path)
    r = _run_cli(["inspect", uri, "--json", "--verify"], env)
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert len(doc["problems"]) == 1 and "missing" in doc["problems"][0]


def test_cli_gc_refuses_a_root_without_a_manifest(tmp_path: Path, capsys) -> None:
    """A mistaken URI (no _manifest/ there) is an error, and gc deletes nothing under it: a
    policy-like folder with an old `_staging/` file stays."""
    from rlrec.cli import main

    store = Storage.from_uri(str(tmp_path / "not-an-output"))
    store.write("pol/_staging/x.parquet", b"data")
    old = time.time() - 7200
    os.utime(store.full_path("pol/_staging/x.parquet"), (old, old))
    assert main(["gc", store.uri(""), "--older-than", "1h"]) == 1
    err = capsys.readouterr().err
    assert "rlrec gc: error: no rlrec manifest at" in err and "holds no _manifest folder" in err
    assert store.exists("pol/_staging/x.parquet")
    assert main(["gc", str(tmp_path / "missing"), "--older-than", "1h"]) == 1
    assert "it does not exist" in capsys.readouterr().err


def test_cli_gc_dry_run_and_human_inspect(tmp_path: Path, capsys) -> None:
    from rlrec.cli import main
    from rlrec.commands.gc import parse_duration

    assert [parse_duration(s) for s in ("90", "90s", "15m", "1.5h", "2d")] == [90, 90, 900, 5400, 172800]
    store = Storage.from_uri(str(tmp_path / "out"))
    log = PartitionLog(store, TOPIC, 0)
    log.claim("W")
    commit(store, log, ["a"])
    orphan, data = make_entry(["z"])
    store.write(orphan.staging_path, data)
    old = time.time() - 7200
    os.utime(store.full_path(orphan.staging_path), (old, old))

    assert main(["gc", store.uri(""), "--older-than", "3h", "--dry-run"]) == 0
    assert capsys.readouterr().out == ""
    assert main(["gc", store.uri(""), "--older-than", "1h", "--dry-run"]) == 0
    assert capsys.readouterr().out.split() == [store.uri(orphan.staging_path)]
    assert store.exists(orphan.staging_path)
    assert main(["gc", store.uri(""), "--older-than", "1h"]) == 0
    assert capsys.readouterr().out.split() == [store.uri(orphan.staging_path)]
    assert not store.exists(orphan.staging_path)

    assert main(["inspect", store.uri(""), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "totals" in out and "no problems" in out and "episode_return" in out


def test_manifest_objects_over_their_budget_are_refused_without_being_read_whole(store, monkeypatch):
    """A log entry, a removal record, the head hint and an owner lease padded past their byte
    budgets (valid JSON otherwise): each reader asks storage for at most budget + 1 bytes and
    refuses the object as malformed, whatever its size on storage."""
    from rlrec.store import log_reader, ownership, retention

    store.write("big.bin", b"x" * 10_000)
    assert len(store.read("big.bin", limit=100)) == 101 and len(store.read("big.bin")) == 10_000
    assert store.read("big.bin", limit=20_000) == b"x" * 10_000

    budget = 1_000
    for module, name in ((log_reader, "MAX_ENTRY_BYTES"), (log_reader, "MAX_HINT_BYTES"),
                         (retention, "MAX_RECORD_BYTES"), (ownership, "MAX_LEASE_BYTES")):  # fmt: skip
        monkeypatch.setattr(module, name, budget)
    got: list[int] = []
    real_read = Storage.read

    def counting_read(self, path, *, limit=None):  # the bytes each reader takes from storage
        data = real_read(self, path, limit=limit)
        got.append(len(data))
        return data

    monkeypatch.setattr(Storage, "read", counting_read)
    pad = " " * 50_000
    claim = ClaimEntry(seq=0, epoch=1, writer="w", time=1.0)
    store.write(entry_path(TOPIC, 0, 0), (claim.to_json() + pad).encode())
    with pytest.raises(ManifestError, match="MAX_ENTRY_BYTES"):
        PartitionLog(store, TOPIC, 0).read_entry(0)
    store.write(entry_path(TOPIC, 1, 0), claim.to_json().encode())  # the same entry within budget reads
    assert PartitionLog(store, TOPIC, 1).read_entry(0) == claim

    log = PartitionLog(store, TOPIC, 2)
    store.write(log.hint_path, (json.dumps({"snapshot": 0}) + pad).encode())
    assert log._read_hint() is None  # ignored as malformed: the log is listed instead

    record = {"type": "removal", "version": 1, "n": 0, "time": 1.0, "grace_s": 0, "positions": {}, "files": []}
    store.write(retention.record_path(0), (json.dumps(record) + pad).encode())
    with pytest.raises(ManifestError, match="more than 1000"):
        retention.read_removals(store)
    with pytest.raises(ManifestError, match="more than 1000"):
        retention.RemovalLogView(store).refresh()

    ownership.renew_lease(store, TOPIC, 3, writer="w", epoch=1)
    assert ownership.read_lease(store, TOPIC, 3) is not None
    store.write(ownership.lease_path(TOPIC, 3), store.read(ownership.lease_path(TOPIC, 3)) + pad.encode())
    assert ownership.read_lease(store, TOPIC, 3) is None  # malformed: no lease
    assert max(got) <= 20_000 and sorted(got)[-2] <= budget + 1, got  # only the test's own reads above that
