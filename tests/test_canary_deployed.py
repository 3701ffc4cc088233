"""Which version is deployed, as the canary trainer finds it (review-40g): an operator's
republished version is deployed, not a canary, and a rollback ending a canary that was running
meanwhile leaves it deployed; a torn ``latest.json`` over more version directories than the
window is repaired to the version really deployed, whatever rollback records lie above it."""

from __future__ import annotations

import json
import shutil
import time

import pytest

pytest.importorskip("torch")

from rlrec.store.commit import ShardCommitter
from rlrec.store.storage import Storage
from rlrec.trainer.export import republish_policy
from rlrec.trainer.policy import load_policy
from rlrec.trainer.signing import load_private_key
from tests.test_canary_trainer import CANARY_KW, _resumed, _serve, canary_setup
from tests.test_policy_binding import _trainer


@pytest.fixture
def setup(tmp_path):
    return canary_setup(tmp_path)


def _promoted_first(tmp_path, setup, monkeypatch):
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    return t


@pytest.mark.parametrize("decision", ["rollback", "promote"])
def test_a_republished_version_is_deployed_and_a_canary_ending_during_it_keeps_it(
    tmp_path, setup, monkeypatch, decision
):
    """G3: republish_policy copied a canary's spec whole ("rollout": "canary"), so the trainer
    took the operator's republished version for a canary never promoted; and a rollback of the
    canary running meanwhile re-pointed latest.json at the canary's old base, below the
    republished version (services' restarts refused it as a replay; the next publication
    told the operator to delete the version they deployed). A promotion leaves it too."""
    root = tmp_path / "ckpt" / "policies"
    t = _promoted_first(tmp_path, setup, monkeypatch)
    t.iteration = 6
    t.checkpoint()  # canary v2 above v1; the trainer is stopped here
    key = load_private_key(setup.keys_dir / "policy-signing.key")
    spec = republish_policy(Storage.from_uri(str(root)), version=1, signing_key=key)
    assert spec["policy_version"] == 3 and "rollout" not in spec
    r = _resumed(tmp_path, setup, monkeypatch)
    assert r.canary is not None and r.canary.version == 2
    _serve(setup.committer, r.canary, {2: -2.0 if decision == "rollback" else 3.0, 1: 0.0}, 300, seed=2)
    assert r.look_canary()["decision"] == decision
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 3
    ended = json.loads((root / "v000002" / "canary-ended.json").read_bytes())
    assert ended["deployed_version"] == 3
    assert load_policy(str(root), public_key=setup.pub).policy_version == 3  # a service restart
    for r.iteration in (9, 12):
        r.checkpoint()
    assert not r._pending and r.canary is not None and (r.canary.version, r.canary.base_version) == (4, 3)


def test_a_torn_latest_json_over_the_window_after_a_republish_is_repaired_to_it(tmp_path, setup, monkeypatch):
    """G3b: the fresh run's repair skipped the republished version as a canary never promoted."""
    root = tmp_path / "ckpt" / "policies"
    _promoted_first(tmp_path, setup, monkeypatch)
    key = load_private_key(setup.keys_dir / "policy-signing.key")
    republish_policy(Storage.from_uri(str(root)), version=1, signing_key=key)  # v2
    (root / "latest.json.sig").write_bytes(b"torn")
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 6
    fresh.checkpoint()
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 2
    assert fresh.canary is not None and fresh.canary.base_version == 2
    assert load_policy(str(root), public_key=setup.pub).policy_version == 2


@pytest.mark.slow
def test_a_torn_latest_json_over_more_ungated_versions_than_the_window_is_repaired(tmp_path, setup, monkeypatch):
    """G2: a root with more versions than the window and no rollback record (every checkpoint
    published, --promotion-gate off, before the canary): a fresh run over a torn latest.json
    based its canary on v0 and left the pointer torn, refusing every service restart."""
    from rlrec.trainer.policy_files import MAX_NEWER_VERSIONS

    root = tmp_path / "ckpt" / "policies"
    old = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False)  # --promotion-gate off
    for k in range(MAX_NEWER_VERSIONS + 1):
        old.iteration = 3 * (k + 1)
        old.checkpoint()
    top = MAX_NEWER_VERSIONS + 1
    (root / "latest.json.sig").write_bytes(b"torn")
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 400
    fresh.checkpoint()
    assert fresh.canary is not None and (fresh.canary.version, fresh.canary.base_version) == (top + 1, top)
    assert not fresh._pending
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == top
    svc = load_policy(str(root), public_key=setup.pub, channel=fresh.cfg.publish_channel)
    assert svc.policy_version == top


@pytest.mark.slow
def test_a_rollback_record_copied_from_another_root_does_not_hide_the_deployed_version(tmp_path, setup, monkeypatch):
    """G1: the repair over more directories than the window trusted the newest signed rollback
    record to say which version was deployed. One copied (its whole directory) from another
    root of the same key and channel, with the root padded past the window and latest.json
    deleted, made a fresh run re-sign latest.json at that record's old base, under a floor
    hiding the version really deployed."""
    from rlrec.trainer.policy_files import MAX_NEWER_VERSIONS

    prod = tmp_path / "ckpt" / "policies"
    a = _promoted_first(tmp_path, setup, monkeypatch)
    a.iteration = 6
    a.checkpoint()
    _serve(setup.committer, a.canary, {2: 3.0, 1: 0.0}, 300, seed=2)
    assert a.look_canary()["decision"] == "promote"  # v2 deployed
    b_dir = tmp_path / "b"  # a staging root of the same key and channel: v1 promoted, v2, v3 rolled back
    b_dir.mkdir()
    bc = ShardCommitter(str(b_dir / "in"))
    bc.claim()
    b = _trainer(b_dir, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    b.iteration = 3
    b.checkpoint()
    _serve(bc, b.canary, {1: 2.0, 0: 0.0}, 300, seed=3)
    assert b.look_canary()["decision"] == "promote"
    now = time.time()
    for b.iteration in (6, 9):
        b.checkpoint()
        now += CANARY_KW["canary_max_wait_s"] + 200
        assert b.look_canary(now=now)["decision"] == "rollback"
    shutil.copytree(b_dir / "ckpt" / "policies" / "v000003", prod / "v000003")
    for n in range(4, MAX_NEWER_VERSIONS + 3):
        (prod / f"v{n:06d}").mkdir()
        (prod / f"v{n:06d}" / "x").write_bytes(b"junk")
    (prod / "latest.json").unlink()
    (prod / "latest.json.sig").unlink()
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 30
    fresh.checkpoint()
    assert json.loads((prod / "latest.json").read_bytes())["policy_version"] == 2
    assert fresh.canary is not None and fresh.canary.base_version == 2
    svc = load_policy(str(prod), public_key=setup.pub, channel=a.cfg.publish_channel)
    assert {svc.for_episode(f"e{i}")[1] for i in range(50)} == {2}
