"""Canary decision records bound to the version they decide, and ended canaries kept ended
(review-40d): a record is a decision only for the policy.json (sha256, channel, run id) it
names; a reused number, another root's or channel's records, deleted records and copied-in
versions never make the trainer or services deploy, demote or re-serve a version."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("torch")

from rlrec.store.commit import ShardCommitter
from rlrec.trainer.policy import PolicyLoadError, load_policy
from rlrec.trainer.signing import load_private_key
from tests.test_canary_trainer import CANARY_KW, _resumed, _serve, canary_setup
from tests.test_policy_binding import _trainer, publish


@pytest.fixture
def setup(tmp_path):
    return canary_setup(tmp_path)


def _promoted_v1(tmp_path, setup, monkeypatch, **kw):
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **{**CANARY_KW, **kw})
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    return t, tmp_path / "ckpt" / "policies"


@pytest.mark.parametrize("restart", ["fresh", "resume"])
def test_a_reused_version_number_does_not_inherit_an_old_promotion(tmp_path, setup, monkeypatch, restart):
    """D2: the root wiped (reservations included), a fresh trainer reuses v1 for an untested
    candidate, and the old v1's genuine signed "promote" rollout.json is copied in: a fresh run
    signed "promote" for the new v1 and moved latest.json to it, a resume carried the copied
    "decision" out. The record names the old policy.json's sha256: it is no decision."""
    _t, root = _promoted_v1(tmp_path, setup, monkeypatch)
    saved = {n: (root / "v000001" / n).read_bytes() for n in ("rollout.json", "rollout.json.sig")}
    for p in root.iterdir():
        if p.name.startswith(("v0", "latest", "canary")):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    shutil.rmtree(root / "_owners" / "publisher" / "versions", ignore_errors=True)
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 7
    fresh.checkpoint()
    assert fresh.canary.version == 1
    for n, d in saved.items():
        (root / "v000001" / n).write_bytes(d)
    if restart == "fresh":
        again = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
        again.iteration = 11
        again.checkpoint()
    else:
        again = _resumed(tmp_path, setup, monkeypatch)
        assert again.look_canary() is None  # judged, not a copied decision carried out
    assert not (root / "latest.json").exists()
    assert not (root / "v000001" / "canary-ended.json").exists()
    assert load_policy(str(root), public_key=setup.pub, canary_fraction=0.3).policy_version == 0


def _staging(tmp_path, setup, monkeypatch, second):
    stg = tmp_path / "stg"
    stg.mkdir()
    c = ShardCommitter(str(stg / "in"))
    c.claim()
    s = _trainer(stg, setup.keys_dir, monkeypatch, resume=False, **{**CANARY_KW, "channel": "staging"})
    s.iteration = 3
    s.checkpoint()
    _serve(c, s.canary, {1: 2.0, 0: 0.0}, 300, seed=11)
    assert s.look_canary()["decision"] == "promote"
    s.iteration = 6
    s.checkpoint()
    _serve(c, s.canary, {2: second, 1: 0.0 if second > 0 else 2.0}, 300, seed=12)
    assert s.look_canary()["decision"] == ("promote" if second > 0 else "rollback")
    return stg / "ckpt" / "policies"


def _prod_v2_on_canary(tmp_path, setup, monkeypatch):
    t, root = _promoted_v1(tmp_path, setup, monkeypatch, channel="prod")
    t.iteration = 6
    t.checkpoint()
    assert (t.canary.version, t.canary.base_version) == (2, 1)
    return t, root


def test_another_roots_rollback_record_does_not_demote_a_promoted_version(tmp_path, setup, monkeypatch):
    """D7 E1: staging's signed v2 "rollback" canary-ended.json (same key, channel staging)
    copied over prod's promoted v2's, with prod's old latest.json(v1) replayed: every new prod
    replica deployed v1. The record names staging's policy.json: services still refuse the replay."""
    t, root = _prod_v2_on_canary(tmp_path, setup, monkeypatch)
    old = {n: (root / n).read_bytes() for n in ("latest.json", "latest.json.sig")}
    _serve(setup.committer, t.canary, {2: 2.0, 1: 0.0}, 300, seed=2)
    assert t.look_canary()["decision"] == "promote"
    stg = _staging(tmp_path, setup, monkeypatch, second=-2.0)
    for n, d in old.items():
        (root / n).write_bytes(d)
    for n in ("canary-ended.json", "canary-ended.json.sig"):
        shutil.copy(stg / "v000002" / n, root / "v000002" / n)
    with pytest.raises(PolicyLoadError, match="replayed old pointer"):
        load_policy(str(root), public_key=setup.pub, channel="prod")


def test_another_roots_promote_decision_is_not_carried_out(tmp_path, setup, monkeypatch):
    """D7 E2: staging's signed v2 "promote" rollout.json copied into prod's running canary v2
    (3.0 worse, too few episodes yet): the --resume'd prod trainer carried the "decision" out."""
    t, root = _prod_v2_on_canary(tmp_path, setup, monkeypatch)
    _serve(setup.committer, t.canary, {2: -1.0, 1: 2.0}, 40, seed=2)
    stg = _staging(tmp_path, setup, monkeypatch, second=2.0)
    for n in ("rollout.json", "rollout.json.sig"):
        shutil.copy(stg / "v000002" / n, root / "v000002" / n)
    r = _resumed(tmp_path, setup, monkeypatch, channel="prod")
    record = r.look_canary()
    assert record is None or record["decision"] == "rollback"
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 1


@pytest.mark.parametrize("with_canary_pointer", [False, True])
def test_a_promoted_canary_whose_records_were_deleted_is_not_signed_abandoned(
    tmp_path, setup, monkeypatch, with_canary_pointer
):
    """D1: v2 promoted; latest.json(v1) (and canary.json(v2)) replayed and v2's two decision
    records deleted. A fresh run signed v2 "abandoned" and based its canary on v1, after which
    every replica without a state file deployed v1. Nothing proves v2 was never promoted: the
    fresh run signs nothing, puts no canary on, and services keep refusing the replay."""
    kw = {**CANARY_KW, "canary_max_wait_s": 60.0}
    t, root = _promoted_v1(tmp_path, setup, monkeypatch, **kw)
    t.iteration = 6
    t.checkpoint()
    old = {n: (root / n).read_bytes() for n in ("latest.json", "latest.json.sig", "canary.json", "canary.json.sig")}
    _serve(setup.committer, t.canary, {2: 2.0, 1: 0.0}, 300, seed=2)
    assert t.look_canary()["decision"] == "promote"
    for n in ("latest.json", "latest.json.sig") + (("canary.json", "canary.json.sig") if with_canary_pointer else ()):
        (root / n).write_bytes(old[n])
    for n in ("canary-ended.json", "canary-ended.json.sig", "rollout.json", "rollout.json.sig"):
        (root / "v000002" / n).unlink()
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **kw)
    fresh.iteration = 9
    fresh.checkpoint()
    assert not (root / "v000002" / "canary-ended.json").exists()
    assert fresh._pending and not (root / "v000003").exists()
    if not with_canary_pointer:  # (with the pair replayed, only the state file defends: docs/DEPLOY.md)
        with pytest.raises(PolicyLoadError, match="replayed old pointer"):
            load_policy(str(root), public_key=setup.pub)


def test_copied_in_versions_of_another_channel_do_not_hide_the_deployed_one(tmp_path, setup, monkeypatch):
    """D9: signed_above looked at the 64 highest version directories whatever their channel: 65
    staging versions (same key) copied into prod's root, with prod's latest.json(v1) replayed,
    made a fresh prod trainer base its canary on v1 while v2 was deployed."""
    t, root = _prod_v2_on_canary(tmp_path, setup, monkeypatch)
    old = {n: (root / n).read_bytes() for n in ("latest.json", "latest.json.sig")}
    _serve(setup.committer, t.canary, {2: 2.0, 1: 0.0}, 300, seed=2)
    assert t.look_canary()["decision"] == "promote"
    key = load_private_key(setup.keys_dir / "policy-signing.key")
    stg = tmp_path / "stg"
    for v in range(10, 75):
        publish(stg, v, key, channel="staging", seed=v)
        shutil.copytree(stg / f"v{v:06d}", root / f"v{v:06d}")
    for n, d in old.items():
        (root / n).write_bytes(d)
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW, channel="prod")
    fresh.iteration = 9
    fresh.checkpoint()
    assert fresh.canary.base_version == 2
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 2


def test_a_rolled_back_canary_is_not_served_again_after_a_replay(tmp_path, setup, monkeypatch):
    """D3: canary v2 rolled back; its genuine old canary.json replayed and its canary-ended.json
    deleted: running and restarted services (a state file's too: v2 was not below its newest
    canary) served v2 again. The rollback re-signed latest.json with canary_floor 2; services
    refuse a canary at or below the floor, and the state file keeps it (replayed latest.json too)."""
    t, root = _promoted_v1(tmp_path, setup, monkeypatch)
    before = {n: (root / n).read_bytes() for n in ("latest.json", "latest.json.sig")}
    t.iteration = 6
    t.checkpoint()
    old = {n: (root / n).read_bytes() for n in ("canary.json", "canary.json.sig")}
    state = tmp_path / "svc-state.json"
    svc = load_policy(str(root), public_key=setup.pub, state_file=str(state), canary_fraction=0.5)
    assert svc.canary_version == 2
    _serve(setup.committer, t.canary, {2: -2.0, 1: 2.0}, 300, seed=2)
    assert t.look_canary()["decision"] == "rollback"
    latest = json.loads((root / "latest.json").read_bytes())
    assert (latest["policy_version"], latest["canary_floor"]) == (1, 2)
    svc.poll()
    assert json.loads(state.read_bytes())["canary_floor"] == 2
    for n, d in old.items():
        (root / n).write_bytes(d)
    for n in ("canary-ended.json", "canary-ended.json.sig"):
        (root / "v000002" / n).unlink()
    svc.poll()
    assert {svc.for_episode(f"e{i}").policy_version for i in range(200)} == {1}
    for state_file in (str(state), None):
        again = load_policy(str(root), public_key=setup.pub, state_file=state_file, canary_fraction=0.5)
        assert {again.for_episode(f"x{i}").policy_version for i in range(200)} == {1}
    for n, d in before.items():  # the older latest.json (no floor) replayed too: the state file keeps it
        (root / n).write_bytes(d)
    again = load_policy(str(root), public_key=setup.pub, state_file=str(state), canary_fraction=0.5)
    assert {again.for_episode(f"y{i}").policy_version for i in range(200)} == {1}
    for t.iteration in (9, 12):
        t.checkpoint()  # the next canary goes on, then the trainer's refresh re-signs the floor
    assert t.canary.version == 3
    latest = json.loads((root / "latest.json").read_bytes())
    assert (latest["policy_version"], latest["canary_floor"]) == (1, 2)


def test_the_state_file_refuses_a_reused_version_number(tmp_path, setup):
    """The state file compared version numbers only: v1 published again with other weights (a
    wiped root) loaded on a service that had run the first v1. It records each loaded
    version's policy.json sha256 and refuses the same number with other bytes."""
    key = load_private_key(setup.keys_dir / "policy-signing.key")
    root, state = tmp_path / "root", str(tmp_path / "svc" / "policy-state.json")
    publish(root, 1, key, seed=1)
    assert load_policy(str(root), public_key=setup.pub, state_file=state).policy_version == 1
    assert json.loads((tmp_path / "svc" / "policy-state.json").read_bytes())["sha256"]
    shutil.rmtree(root)
    publish(root, 1, key, seed=2)
    with pytest.raises(PolicyLoadError, match="reused version number"):
        load_policy(str(root), public_key=setup.pub, state_file=state)
    assert load_policy(str(root), public_key=setup.pub).policy_version == 1  # without the state file: loads


def test_a_rolled_back_first_canary_is_not_served_again_by_a_state_file_service(tmp_path, setup, monkeypatch):
    """D3 with nothing deployed (base 0): no latest.json carries a floor. A service that saw the
    canary end (its signed, bound rollback record) keeps its version as the floor, in memory and
    in the state file, so the replayed canary.json (its end record deleted) is refused."""
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    old = {n: (root / n).read_bytes() for n in ("canary.json", "canary.json.sig")}
    state = tmp_path / "svc-state.json"
    svc = load_policy(str(root), public_key=setup.pub, state_file=str(state), canary_fraction=0.5)
    assert svc.canary_version == 1
    _serve(setup.committer, t.canary, {1: -2.0, 0: 2.0}, 300, seed=3)
    assert t.look_canary()["decision"] == "rollback"
    svc.poll()
    assert svc.canary_version is None and json.loads(state.read_bytes())["canary_floor"] == 1
    for n, d in old.items():
        (root / n).write_bytes(d)
    for n in ("canary-ended.json", "canary-ended.json.sig"):
        (root / "v000001" / n).unlink()
    svc.poll()
    assert svc.canary_version is None
    with pytest.raises(PolicyLoadError, match="no usable"):
        load_policy(str(root), public_key=setup.pub, state_file=str(state), canary_fraction=0.5)
