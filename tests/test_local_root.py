"""A local output root cannot be steered outside itself: whoever can write the root (a shared or
NFS shard directory) plants symlinks; no write, move, read or delete may follow one."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest

from rlrec.store.commit import ShardCommitter
from rlrec.store.localfs import EscapesRoot
from rlrec.store.maintenance import gc
from rlrec.store.manifest import PartitionLog
from rlrec.store.storage import RetryPolicy, Storage
from tests.test_storage_manifest import TOPIC, make_entry


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A directory outside the root with a file the attacker wants replaced or deleted."""
    d = tmp_path / "victim"
    d.mkdir()
    (d / "authorized_keys").write_bytes(b"ssh-ed25519 operator")
    return d


@pytest.fixture
def out(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


def _storage(out: Path) -> Storage:
    return Storage.from_uri(str(out), retry=RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.002))


def test_roll_forward_of_a_forged_entry_does_not_write_through_a_planted_link(out, victim, caplog):
    st = _storage(out)
    entry, _ = make_entry(["e1"])
    # a valid shard path ({policy}/{name}, staged in {policy}/_staging/) whose policy directory
    # is a link planted to a directory outside the root, where the attacker staged the file
    forged = dataclasses.replace(
        entry,
        policy_id="evil2",
        path="evil2/authorized_keys",
        staging_path="evil2/_staging/authorized_keys",
        sha256="0" * 64,
    )
    (victim / "_staging").mkdir()
    (victim / "_staging" / "authorized_keys").write_bytes(b"attacker's key")
    os.symlink(victim, out / "evil2")
    writer = PartitionLog(st, TOPIC, 0)
    writer.claim("attacker")
    writer.append_shard(forged)
    with caplog.at_level(logging.ERROR, logger="rlrec"):
        ShardCommitter(st, TOPIC, 0).claim()  # an ordinary new owner rolls committed shards forward
    assert (victim / "authorized_keys").read_bytes() == b"ssh-ed25519 operator"
    assert (victim / "_staging" / "authorized_keys").exists()  # left where it was
    assert "not publishing shard seq" in caplog.text and "symlink" in caplog.text


def test_gc_never_deletes_through_a_planted_link(out, victim):
    st = _storage(out)
    entry, data = make_entry(["e1"])
    st.write(entry.staging_path, data)  # a real policy dir with an orphan staged file
    (out / "evil").mkdir()
    os.symlink(victim, out / "evil" / "_staging")
    deleted = gc(st, older_than_s=0, now=2e9)
    assert (victim / "authorized_keys").read_bytes() == b"ssh-ed25519 operator"
    assert deleted == [entry.staging_path]  # the real garbage still goes


@pytest.mark.parametrize("link_at", ["dir", "file"])
def test_every_operation_refuses_a_link_below_the_root(out, victim, link_at):
    st = _storage(out)
    if link_at == "dir":
        os.symlink(victim, out / "pol")
        path = "pol/authorized_keys"
    else:
        (out / "pol").mkdir()
        os.symlink(victim / "authorized_keys", out / "pol" / "authorized_keys")
        path = "pol/authorized_keys"
    st.write("pol2/x", b"x")
    refused = [lambda: st.read(path), lambda: st.check_inside(path)]
    if link_at == "dir":
        refused += [
            lambda: st.write(path, b"evil"),
            lambda: st.create_once(path, b"evil"),
            lambda: st.move("pol2/x", path),
            lambda: st.delete(path),
        ]
    else:
        refused += [lambda: st.move(path, "pol2/y")]
    for op in refused:
        with pytest.raises(EscapesRoot):
            op()
    assert (victim / "authorized_keys").read_bytes() == b"ssh-ed25519 operator"
    if link_at == "file":  # a link as the last component is replaced or deleted itself, never its target
        st.write(path, b"mine")
        assert st.read(path) == b"mine" and not (out / "pol" / "authorized_keys").is_symlink()
        os.unlink(out / "pol" / "authorized_keys")
        os.symlink(victim / "authorized_keys", out / "pol" / "authorized_keys")
        assert st.delete(path) and not (out / "pol" / "authorized_keys").exists()
    assert st.create_once("pol3/y", b"y")  # paths without links work as ever
    assert (victim / "authorized_keys").read_bytes() == b"ssh-ed25519 operator"


def test_delete_tree_removes_links_not_their_targets(out, victim):
    st = _storage(out)
    st.write("ckpt/a/b", b"1")
    os.symlink(victim, out / "ckpt" / "a" / "outside")
    assert st.delete_tree("ckpt") == 2  # b and the link
    assert not (out / "ckpt").exists()
    assert (victim / "authorized_keys").read_bytes() == b"ssh-ed25519 operator"
    os.symlink(victim, out / "linked")
    with pytest.raises(EscapesRoot):
        st.delete_tree("linked")
    assert (victim / "authorized_keys").exists()


def test_a_missing_root_is_made_by_the_first_write_and_never_by_a_read(tmp_path):
    from rlrec.store.localfs import LocalRoot

    root = tmp_path / "a" / "b"
    store = LocalRoot(str(root))
    with pytest.raises(FileNotFoundError):
        store.read("x/y.bin")
    assert not root.exists()  # a read does not make it
    assert store.create_once("x/y.bin", b"1") and store.read("x/y.bin") == b"1"
    store.write("z", b"2")  # the root exists now: opened, not made again
    assert sorted(os.listdir(root)) == ["x", "z"]
