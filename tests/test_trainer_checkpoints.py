"""`CheckpointStore` on local storage and on S3, GCS and Azure (moto, fake-gcs-server, Azurite): the layout, the commit point, re-saves, pruning
and restore. The algorithm is a stand-in with RLlib's two methods the store calls; the real RLlib
round trip runs in tests/test_trainer_service.py (resume)."""

from __future__ import annotations

import json
import os

import pytest

from rlrec.store.storage import Storage
from rlrec.trainer.checkpoints import CKPT_LATEST, CheckpointStore, checkpoint_path
from tests.stores import SERVER_FIXTURES, ObjectStore


class FakeLearnerGroup:
    def __init__(self) -> None:
        self.restored: dict[str, bytes] = {}

    def restore_from_path(self, path: str) -> None:
        for root, _dirs, files in os.walk(path):
            for f in files:
                full = os.path.join(root, f)
                with open(full, "rb") as fh:
                    self.restored[os.path.relpath(full, path)] = fh.read()


class FakeAlgo:
    """Writes `files` (relative path -> bytes) as its checkpoint, like `Algorithm.save_to_path`."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.learner_group = FakeLearnerGroup()

    def save_to_path(self, path: str) -> None:
        for rel, data in self.files.items():
            full = os.path.join(path, *rel.split("/"))
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(data)


@pytest.fixture(params=["local", *sorted(SERVER_FIXTURES)])
def storage(request, tmp_path) -> Storage:
    if request.param == "local":
        return Storage.from_uri(str(tmp_path / "ckpt"))
    store = ObjectStore(request.param, request.getfixturevalue(SERVER_FIXTURES[request.param]))
    return Storage.from_uri(store.output(request.getfixturevalue("monkeypatch"), "ckpt"))


def _files(storage: Storage, prefix: str) -> set[str]:
    return {f.path[len(prefix) + 1 :] for f in storage.list(prefix, recursive=True) if not f.is_dir}


def test_save_commits_last_and_restore_reads_the_learner_group(storage):
    store = CheckpointStore(storage)
    assert store.latest() is None
    algo = FakeAlgo({"learner_group/state.pkl": b"weights-1", "learner_group/sub/opt.pkl": b"opt", "meta.json": b"{}"})
    path = store.save(12, algo, {"iteration": 12, "trained_shards": ["a"]}, policy_version=3)
    assert path == checkpoint_path(12) == "checkpoints/ckpt-00000012"
    assert store.latest() == {"iteration": 12, "path": path, "policy_version": 3}
    assert json.loads(storage.read(CKPT_LATEST))["path"] == path
    assert store.read_state(path) == {"iteration": 12, "trained_shards": ["a"]}
    assert _files(storage, f"{path}/algo") == {"learner_group/state.pkl", "learner_group/sub/opt.pkl", "meta.json"}

    target = FakeAlgo({})
    store.restore_learner_group(target, path)
    assert target.learner_group.restored == {"state.pkl": b"weights-1", os.path.join("sub", "opt.pkl"): b"opt"}


def test_saving_the_same_iteration_again_replaces_its_files(storage):
    store = CheckpointStore(storage)
    store.save(5, FakeAlgo({"learner_group/old.pkl": b"old", "learner_group/keep.pkl": b"1"}), {}, policy_version=1)
    path = store.save(5, FakeAlgo({"learner_group/keep.pkl": b"2"}), {"v": 2}, policy_version=2)
    assert _files(storage, f"{path}/algo") == {"learner_group/keep.pkl"}
    assert storage.read(f"{path}/algo/learner_group/keep.pkl") == b"2"
    assert store.latest()["policy_version"] == 2


def test_prune_keeps_the_newest_and_never_the_current_one(storage):
    store = CheckpointStore(storage)
    paths = [store.save(i, FakeAlgo({"learner_group/w": bytes([i])}), {}, policy_version=i) for i in range(1, 6)]
    store.prune(2, current=paths[0])  # the oldest is the current one: it stays
    left = sorted(i.path for i in storage.list("checkpoints") if i.is_dir)
    assert left == [paths[0], paths[3], paths[4]]
    store.prune(0, current=paths[4])  # keep is at least 1
    assert sorted(i.path for i in storage.list("checkpoints") if i.is_dir) == [paths[4]]
    assert store.latest()["path"] == paths[4]


def test_signed_index_guards_resume(storage, tmp_path):
    """With a signing key every checkpoint gets index.json + index.json.sig, and restoring refuses
    files that do not match the signed index before RLlib (pickle) would read them."""
    from rlrec.trainer.checkpoints import CheckpointVerificationError
    from rlrec.trainer.signing import generate_keys, load_private_key

    key = load_private_key(generate_keys(tmp_path / "keys")[0])
    files = {"learner_group/state.pkl": b"weights", "learner_group/sub/opt.pkl": b"optimizer", "algo.json": b"{}"}
    store = CheckpointStore(storage, signing_key=key)
    path = store.save(3, FakeAlgo(files), {"iteration": 3}, policy_version=1)
    index = json.loads(storage.read(f"{path}/index.json"))
    assert set(index["files"]) == {f"algo/{k}" for k in files} | {"trainer.json"}
    assert store.read_state(path) == {"iteration": 3}
    algo = FakeAlgo({})
    store.restore_learner_group(algo, path)
    assert algo.learner_group.restored == {"state.pkl": b"weights", os.path.join("sub", "opt.pkl"): b"optimizer"}

    storage.write(f"{path}/algo/learner_group/state.pkl", b"evil pickle")  # tampered
    with pytest.raises(CheckpointVerificationError, match="do not match its signed index"):
        store.restore_learner_group(FakeAlgo({}), path)
    storage.write(f"{path}/algo/learner_group/state.pkl", b"weights")
    storage.write(f"{path}/algo/learner_group/extra.pkl", b"added")  # an added file
    with pytest.raises(CheckpointVerificationError, match=r"extra\.pkl"):
        store.restore_learner_group(FakeAlgo({}), path)
    storage.delete(f"{path}/algo/learner_group/extra.pkl")
    storage.write(f"{path}/trainer.json", b'{"iteration": 99}')
    with pytest.raises(CheckpointVerificationError, match=r"trainer\.json"):
        store.read_state(path)
    other = load_private_key(generate_keys(tmp_path / "other")[0])
    with pytest.raises(CheckpointVerificationError, match="does not verify"):
        CheckpointStore(storage, signing_key=other).read_state(path)
    storage.delete(f"{path}/index.json.sig")
    with pytest.raises(CheckpointVerificationError, match="no signed index"):
        store.restore_learner_group(FakeAlgo({}), path)
    # without a key nothing is verified (the checkpoint dir must be trusted)
    CheckpointStore(storage).restore_learner_group(FakeAlgo({}), path)
