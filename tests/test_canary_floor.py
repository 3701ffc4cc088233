"""The canary floor (review-40e): rolled-back canaries do not fill the window of version
directories services and the trainer read above latest.json, the first canary's rollback is
floored too, a canary whose publication is pending is never judged, and the deployed version's
pointer stays fresh whichever run of this key published it."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("torch")

from rlrec.trainer.policy import PolicyLoadError, load_policy
from tests.test_canary_trainer import CANARY_KW, _serve, canary_setup
from tests.test_policy_binding import _trainer


@pytest.fixture
def setup(tmp_path):
    return canary_setup(tmp_path)


@pytest.mark.slow
def test_more_rollbacks_in_a_row_than_the_window_leave_services_and_the_trainer_working(tmp_path, setup, monkeypatch):
    """E4: each rollback leaves its canary's directory above latest.json, and services (and the
    trainer's signed_above) refused more than MAX_NEWER_VERSIONS (100) of them: after 101
    rollbacks every service (re)start failed and the next candidate stayed pending for good.
    Directories at or below the signed pointer's canary floor ended unpromoted: not counted."""
    from rlrec.trainer.policy_files import MAX_NEWER_VERSIONS

    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    state = tmp_path / "svc-state.json"
    load_policy(str(root), public_key=setup.pub, state_file=str(state))
    now, rollbacks = time.time(), 0
    while rollbacks <= MAX_NEWER_VERSIONS:
        t.iteration += 3
        t.checkpoint()
        assert t.canary is not None, f"no canary after {rollbacks} rollbacks"
        now += CANARY_KW["canary_max_wait_s"] + 200
        assert t.look_canary(now=now)["decision"] == "rollback"
        rollbacks += 1
    assert len([p for p in root.iterdir() if p.name.startswith("v0")]) == MAX_NEWER_VERSIONS + 2
    for state_file in (str(state), None):  # a service restart
        svc = load_policy(str(root), public_key=setup.pub, state_file=state_file, canary_fraction=0.5)
        assert (svc.policy_version, svc.canary_version) == (1, None)
    t.iteration += 3
    t.checkpoint()  # the next candidate goes on canary, not pending
    assert t.canary is not None and t.canary.version == MAX_NEWER_VERSIONS + 3 and not t._pending
    svc = load_policy(str(root), public_key=setup.pub, state_file=str(state), canary_fraction=0.5)
    assert svc.canary_version == MAX_NEWER_VERSIONS + 3
    latest = json.loads((root / "latest.json").read_bytes())
    assert (latest["policy_version"], latest["canary_floor"]) == (1, MAX_NEWER_VERSIONS + 2)


def test_a_fresh_run_keeps_an_earlier_runs_deployed_version_fresh(tmp_path, setup, monkeypatch):
    """E6: with --rollout canary latest.json names an earlier run's version until one of this
    run's canaries is promoted; refresh_latest re-signed only this run's versions, so services
    with max_pointer_age_s refused every (re)start while a fresh run was alive and checkpointing."""
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    before = json.loads((root / "latest.json").read_bytes())
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    assert fresh.run_id != t.run_id
    time.sleep(1.1)
    for fresh.iteration in (6, 9):
        fresh.checkpoint()
    assert fresh.canary is not None and fresh.canary.version == 2
    after = json.loads((root / "latest.json").read_bytes())
    assert after["policy_version"] == 1 and after["run_id"] == t.run_id
    assert after["time"] > before["time"] + 1
    svc = load_policy(str(root), public_key=setup.pub, max_pointer_age_s=1.0)
    assert svc.policy_version == 1


def test_a_canary_whose_publication_is_pending_is_never_judged(tmp_path, setup, monkeypatch):
    """E3: v2 was promoted; the old latest.json (v1) and canary.json (v2) are replayed and v2's
    records deleted. A fresh run signs nothing for v2 and keeps its own candidate v3 pending
    (UndecidedCanary) -- but it judged v3 anyway: one max wait later a "no canary traffic"
    rollback wrote records into v3/ (no policy.json there) and signed a fresh latest.json (v1),
    which defeated max_pointer_age_s, the defence against that replay. While its publication is
    pending nothing is judged and no pointer is signed."""
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    t.iteration = 6
    t.checkpoint()
    old = {n: (root / n).read_bytes() for n in ("latest.json", "latest.json.sig", "canary.json", "canary.json.sig")}
    _serve(setup.committer, t.canary, {2: 2.0, 1: 0.0}, 300, seed=2)
    assert t.look_canary()["decision"] == "promote"
    for n, d in old.items():
        (root / n).write_bytes(d)
    for n in ("canary-ended.json", "canary-ended.json.sig", "rollout.json", "rollout.json.sig"):
        (root / "v000002" / n).unlink()
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    for fresh.iteration in (9, 12):
        fresh.checkpoint()
    assert fresh.canary is not None and fresh.canary.version == 3 and len(fresh._pending) == 1
    assert fresh.look_canary(now=time.time() + CANARY_KW["canary_max_wait_s"] + 120) is None
    fresh.iteration = 15
    fresh.checkpoint()
    assert not (root / "v000003").exists() or not any((root / "v000003").glob("rollout.json*"))
    assert (root / "latest.json").read_bytes() == old["latest.json"]  # not re-signed: its age still tells
    time.sleep(2.1)
    with pytest.raises(PolicyLoadError, match="max_pointer_age_s"):
        load_policy(str(root), public_key=setup.pub, max_pointer_age_s=2)


def _an_hour_later(monkeypatch, seconds: float) -> None:
    """Services' clock `seconds` ahead (the trainer's stays): what a replica sees that long after."""
    import types

    import rlrec.trainer.policy as policy_module

    real = time.time
    clock = types.SimpleNamespace(time=lambda: real() + seconds, monotonic=time.monotonic, sleep=time.sleep)
    monkeypatch.setattr(policy_module, "time", clock)


def test_services_refuse_a_replayed_canary_json_past_the_default_canary_age(tmp_path, setup, monkeypatch):
    """E1: v2 rolled back; the latest.json signed before the rollback (no floor) and v2's
    canary.json replayed, its end record deleted: a new replica (no state file, nothing seen)
    served v2 to its canary share, for as long as the replay lasted. By default services refuse
    a canary.json signed more than MAX_CANARY_AGE_S ago (the trainer re-signs its running
    canary's well inside that)."""
    from rlrec.trainer.canary import MAX_CANARY_AGE_S

    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    t.iteration = 6
    t.checkpoint()
    old = {n: (root / n).read_bytes() for n in ("latest.json", "latest.json.sig", "canary.json", "canary.json.sig")}
    _serve(setup.committer, t.canary, {2: -2.0, 1: 2.0}, 300, seed=2)
    assert t.look_canary()["decision"] == "rollback"
    for n, d in old.items():
        (root / n).write_bytes(d)
    for n in ("canary-ended.json", "canary-ended.json.sig"):
        (root / "v000002" / n).unlink()
    _an_hour_later(monkeypatch, MAX_CANARY_AGE_S + 60)
    svc = load_policy(str(root), public_key=setup.pub, canary_fraction=0.5)
    assert svc.canary_version is None and {svc.for_episode(f"e{i}").policy_version for i in range(200)} == {1}
    assert "max_canary_age_s" in svc._last_canary_refusal
    unlimited = load_policy(str(root), public_key=setup.pub, canary_fraction=0.5, max_canary_age_s=None)
    assert unlimited.canary_version == 2  # what the default stops


def test_the_trainer_re_signs_its_running_canary_while_it_looks(tmp_path, setup, monkeypatch):
    """A trainer that trains rarely checkpoints rarely: its looks re-sign canary.json when it was
    signed CANARY_RESIGN_S ago, so services' default canary age never drops a judged canary."""
    from rlrec.trainer.canary import CANARY_RESIGN_S

    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    assert t.look_canary() is None  # the first look signs it
    signed = json.loads((root / "canary.json").read_bytes())["time"]
    time.sleep(0.05)
    assert t.look_canary() is None
    assert json.loads((root / "canary.json").read_bytes())["time"] == signed  # not due
    t._canary_signed_at -= CANARY_RESIGN_S
    assert t.look_canary() is None
    assert json.loads((root / "canary.json").read_bytes())["time"] > signed
    assert load_policy(str(root), public_key=setup.pub, canary_fraction=0.5).canary_version == 1


def test_a_floor_noted_without_a_version_keeps_the_state_files_run_and_channel(tmp_path, setup):
    """E7: a canary floor noted while no version was loaded rewrote the state file with
    run_id and channel null (what it recorded was lost)."""
    from rlrec.trainer.policy_state import _remember
    from rlrec.trainer.policy_verify import Pins
    from rlrec.trainer.signing import load_private_key
    from tests.test_policy_binding import publish

    root, state = tmp_path / "root", tmp_path / "svc-state.json"
    publish(root, 1, load_private_key(setup.keys_dir / "policy-signing.key"))
    load_policy(str(root), public_key=setup.pub, state_file=str(state))
    before = json.loads(state.read_bytes())
    assert before["run_id"] and before["channel"]
    _remember(None, Pins.of(state_file=str(state)), canary_floor=3)
    after = json.loads(state.read_bytes())
    assert after["canary_floor"] == 3
    assert (after["run_id"], after["channel"], after["policy_version"]) == (
        before["run_id"],
        before["channel"],
        before["policy_version"],
    )


@pytest.mark.parametrize("torn", ["latest.json", "latest.json.sig"])
def test_a_fresh_run_finishing_a_rollback_killed_in_its_re_sign_keeps_the_floor(tmp_path, setup, monkeypatch, torn):
    """E5: killed while the rollback re-signed latest.json (the base) with the floor, after its
    signed rollout.json: a fresh run repaired the torn pointer without a floor and `_settle`
    finished the rollback without raising it."""

    class Killed(BaseException):
        pass

    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    t.iteration = 6
    t.checkpoint()
    _serve(setup.committer, t.canary, {2: -2.0, 1: 2.0}, 300, seed=2)
    real = t.publish_storage.write

    def write(path, data):
        if path == torn:
            raise Killed("kill -9")
        return real(path, data)

    monkeypatch.setattr(t.publish_storage, "write", write)
    with pytest.raises(Killed):
        t.look_canary()
    monkeypatch.undo()
    assert json.loads((root / "v000002" / "rollout.json").read_bytes())["decision"] == "rollback"
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 9
    fresh.checkpoint()
    assert json.loads((root / "v000002" / "canary-ended.json").read_bytes())["decision"] == "rollback"
    latest = json.loads((root / "latest.json").read_bytes())
    assert (latest["policy_version"], latest.get("canary_floor")) == (1, 2)


def test_a_trainer_without_a_signing_key_keeps_its_canary_pointer_fresh(tmp_path, setup, monkeypatch):
    """F4: services refuse a canary.json older than max_canary_age_s by default, but without a
    signing key the trainer never rewrote it: in an unsigned setup every canary stopped being
    served an hour in, though the trainer was alive and judging it. canary.json is rewritten
    unsigned, at looks and at checkpoints, as the signed one is re-signed."""
    from rlrec.trainer.canary import CANARY_RESIGN_S

    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.signing_key = None  # a trainer run without --signing-key
    t.iteration = 3
    t.checkpoint()
    assert t.canary is not None and not (root / "canary.json.sig").exists()

    def signed_at() -> float:
        return json.loads((root / "canary.json").read_bytes())["time"]

    first = signed_at()
    time.sleep(0.05)
    t._canary_signed_at -= CANARY_RESIGN_S
    assert t.look_canary() is None  # continue: the look rewrites it
    at_look = signed_at()
    assert at_look > first
    time.sleep(0.05)
    t.iteration = 4
    t.checkpoint()  # nothing new to publish while the canary runs: the pointer refresh rewrites it
    assert signed_at() > at_look and t.canary is not None
    assert not (root / "canary.json.sig").exists() and not (root / "latest.json").exists()
    svc = load_policy(str(root), allow_unsigned=True, canary_fraction=0.5, max_canary_age_s=CANARY_RESIGN_S)
    assert svc.canary_version == t.canary.version


def test_a_rollback_that_cannot_be_carried_out_lets_the_canary_pointer_age_out(tmp_path, setup, monkeypatch):
    """F3: a canary whose rollback was decided but could not be carried out (its rollout.json
    cannot be written) was re-signed at every checkpoint: services kept serving the canary judged
    worse for as long as the trainer lived, and no max_canary_age_s stopped it. A decided canary
    is not re-signed; the rollback is carried out once the store takes it."""
    import shutil

    from rlrec.trainer.canary import MAX_CANARY_AGE_S

    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    t.iteration = 6
    t.checkpoint()  # canary v2 above v1
    (root / "v000002" / "rollout.json").mkdir()  # the decision record cannot be written
    _serve(setup.committer, t.canary, {2: -2.0, 1: 2.0}, 300, seed=2)
    assert t.look_canary() is None and t._canary_decision["decision"] == "rollback"  # decided, not carried out
    pointer = (root / "canary.json").read_bytes()
    time.sleep(0.05)
    t._canary_signed_at = 0.0
    assert t.look_canary(now=time.time() + 60) is None  # tried again, fails again
    t.iteration = 9
    t.checkpoint()
    assert (root / "canary.json").read_bytes() == pointer and t.canary.version == 2  # not re-signed
    _an_hour_later(monkeypatch, MAX_CANARY_AGE_S + 60)
    svc = load_policy(str(root), public_key=setup.pub, canary_fraction=0.5)
    assert svc.canary_version is None and {svc.for_episode(f"e{i}").policy_version for i in range(200)} == {1}
    shutil.rmtree(root / "v000002" / "rollout.json")
    assert t.look_canary(now=time.time() + 120)["decision"] == "rollback" and t.canary is None


@pytest.mark.slow
def test_more_first_canary_rollbacks_than_the_window_leave_the_trainer_publishing(tmp_path, setup, monkeypatch):
    """F2: with nothing deployed (no latest.json, so no signed floor) the publication's scan for
    orphaned canaries counted every rolled-back first canary: after 101 of them (services that
    never opted in: each ends "no canary traffic") every candidate stayed pending for good. The
    scan skips what the trainer's own (checkpointed) floor says ended, in this run and after
    --resume; a fresh run takes the floor the newest signed rollback record proves."""
    from tests.test_canary_trainer import _resumed

    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    now = time.time()
    for k in range(101):
        t.iteration = 3 * (k + 1)
        t.checkpoint()
        assert t.canary is not None and not t._pending
        now += CANARY_KW["canary_max_wait_s"] + 200
        assert t.look_canary(now=now)["decision"] == "rollback"
    assert t._canary_floor == 101 and not (root / "latest.json").exists()
    t.iteration = 400
    t.checkpoint()
    assert t.canary.version == 102 and not t._pending
    assert json.loads((root / "canary.json").read_bytes())["policy_version"] == 102
    now += CANARY_KW["canary_max_wait_s"] + 200
    assert t.look_canary(now=now)["decision"] == "rollback"
    t.iteration = 403
    t.checkpoint()  # the floor checkpointed with v103's publication
    resumed = _resumed(tmp_path, setup, monkeypatch)
    assert resumed._canary_floor == 102 and resumed.canary.version == 103
    resumed.iteration = 406
    resumed.checkpoint()  # v103 written (again) by the resumed run
    assert not resumed._pending
    now += CANARY_KW["canary_max_wait_s"] + 200
    assert resumed.look_canary(now=now)["decision"] == "rollback"
    resumed.iteration = 409
    resumed.checkpoint()
    assert resumed.canary.version == 104 and not resumed._pending
    assert json.loads((root / "canary.json").read_bytes())["policy_version"] == 104
    now += CANARY_KW["canary_max_wait_s"] + 200
    assert resumed.look_canary(now=now)["decision"] == "rollback"
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)  # no checkpoint, no floor
    fresh.iteration = 500
    fresh.checkpoint()  # the newest signed rollback record (v104's) proves the floor
    assert fresh._canary_floor == 104 and fresh.canary.version == 105 and fresh.canary.base_version == 0
    assert not fresh._pending and json.loads((root / "canary.json").read_bytes())["policy_version"] == 105


@pytest.mark.slow
def test_a_torn_latest_json_over_more_rollbacks_than_the_window_is_repaired(tmp_path, setup, monkeypatch):
    """F6: a fresh run that found latest.json torn (a kill -9 between it and its .sig) repaired
    it by reading every version directory above v0: with more than 100 (rolled-back canaries)
    that failed, the fresh run based its canary on v0 and never repaired the pointer, so every
    service (re)start was refused. The repair reads above the floor the newest signed rollback
    record proves."""
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    now = time.time()
    for k in range(101):
        t.iteration = 3 * (k + 2)
        t.checkpoint()
        now += CANARY_KW["canary_max_wait_s"] + 200
        assert t.look_canary(now=now)["decision"] == "rollback"
    assert load_policy(str(root), public_key=setup.pub).policy_version == 1
    (root / "latest.json.sig").write_bytes(b"torn")  # killed between latest.json and its .sig
    with pytest.raises(PolicyLoadError):
        load_policy(str(root), public_key=setup.pub)
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 400
    fresh.checkpoint()
    assert fresh.canary.version == 103 and fresh.canary.base_version == 1 and not fresh._pending
    latest = json.loads((root / "latest.json").read_bytes())
    assert latest["policy_version"] == 1 and latest["canary_floor"] == 102
    svc = load_policy(str(root), public_key=setup.pub, canary_fraction=0.5)
    assert svc.policy_version == 1 and svc.canary_version == 103
