"""When the canary trainer cannot know which version is deployed, it signs nothing and holds
(review-40h): a deleted ``latest.json`` over a canary nothing proves was never promoted, more
version directories than the repair reads; a signed pointer naming a version that is not
deployed here (copied from another root) is never kept; new versions are numbered above every
canary floor the trainer knows and never into an existing directory."""

from __future__ import annotations

import json
import logging
import shutil
import time

import pytest

pytest.importorskip("torch")

from rlrec.store.commit import ShardCommitter
from rlrec.store.storage import Storage
from rlrec.trainer.canary_publish import repoint_latest
from rlrec.trainer.policy import PolicyLoadError, load_policy
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


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("pointer", ["deleted", "torn"])
def test_a_fresh_run_signs_no_pointer_below_a_canary_nothing_proves_was_never_promoted(
    tmp_path, setup, monkeypatch, caplog, pointer
):
    """H5: v1 -> canary v2 -> promoted. A key-less writer restores the old canary.json(v2),
    deletes v2's decision records and deletes (or tears) latest.json. A fresh run re-signed
    latest.json at v1 with a fresh time (a new replica served v1 though v2 was promoted), and
    only then refused its own canary as UndecidedCanary."""
    root = tmp_path / "ckpt" / "policies"
    t = _promoted_first(tmp_path, setup, monkeypatch)
    t.iteration = 6
    t.checkpoint()  # canary v2 above v1
    old = {n: (root / n).read_bytes() for n in ("canary.json", "canary.json.sig")}
    _serve(setup.committer, t.canary, {2: 2.0, 1: 0.0}, 300, seed=2)
    assert t.look_canary()["decision"] == "promote"
    for n, data in old.items():
        (root / n).write_bytes(data)
    for n in ("canary-ended.json", "canary-ended.json.sig", "rollout.json", "rollout.json.sig"):
        (root / "v000002" / n).unlink()
    if pointer == "deleted":
        (root / "latest.json").unlink()
        (root / "latest.json.sig").unlink()
    else:
        (root / "latest.json.sig").write_bytes(b"torn")
    before = (root / "latest.json").read_bytes() if pointer == "torn" else None
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    for fresh.iteration in (9, 12):
        fresh.checkpoint()
    if pointer == "deleted":
        assert not (root / "latest.json").exists()
    else:
        assert (root / "latest.json").read_bytes() == before
    assert fresh.canary is None and not fresh._pending
    assert fresh.last_promotion is not None and fresh.last_promotion["promoted"] is False  # not deployed
    assert not (root / "v000003").exists()
    assert json.loads((root / "canary.json").read_bytes())["policy_version"] == 2  # untouched
    held = [m for m in _errors(caplog) if "not re-pointing latest.json at v1" in m]
    assert held and "canary v2 above v1" in held[-1] and "holds no signed decision" in held[-1]
    with pytest.raises(PolicyLoadError):  # nothing signed: no service starts on v1
        load_policy(str(root), public_key=setup.pub, channel=fresh.cfg.publish_channel)


def test_a_resumed_trainer_still_repairs_its_deployed_pointer(tmp_path, setup, monkeypatch):
    """H5's hold is for a fresh run only: a trainer that deployed v1 itself re-signs it."""
    root = tmp_path / "ckpt" / "policies"
    t = _promoted_first(tmp_path, setup, monkeypatch)
    t.iteration = 6
    t.checkpoint()  # canary v2 above v1, stopped here
    (root / "latest.json.sig").write_bytes(b"torn")
    r = _resumed(tmp_path, setup, monkeypatch)
    assert r.canary is not None and r.canary.version == 2
    r.iteration = 9
    r.checkpoint()
    assert load_policy(str(root), public_key=setup.pub).policy_version == 1


@pytest.mark.slow
@pytest.mark.parametrize("pointer", ["deleted", "torn"])
def test_over_the_repair_cap_the_canary_is_held_not_based_on_v0(tmp_path, setup, monkeypatch, caplog, pointer):
    """H2: over MAX_REPAIR_SCAN directories the repair's TooManyVersions was taken as "base v0":
    a fresh run signed canary.json v3 (into the junk v000003/) based on v0 while v2 was deployed,
    and a new replica served it against nothing."""
    from rlrec.trainer.canary_publish import MAX_REPAIR_SCAN

    root = tmp_path / "ckpt" / "policies"
    old = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False)  # ungated: v1, v2 deployed
    for old.iteration in (3, 6):
        old.checkpoint()
    for n in range(3, MAX_REPAIR_SCAN + 4):
        (root / f"v{n:06d}").mkdir()
    if pointer == "deleted":
        (root / "latest.json").unlink()
        (root / "latest.json.sig").unlink()
    else:
        (root / "latest.json.sig").write_bytes(b"torn")
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 400
    fresh.checkpoint()
    assert fresh.canary is None and not fresh._pending
    assert not (root / "canary.json").exists()
    assert not any((root / "v000003").iterdir())
    held = [m for m in _errors(caplog) if "not publishing policy" in m]
    assert held and f"over the limit of {MAX_REPAIR_SCAN}: the deployed version cannot be found" in held[-1]
    assert "remove the version directories" in held[-1]
    if pointer == "deleted":
        assert not (root / "latest.json").exists()


def test_a_new_version_is_never_written_into_an_existing_directory(tmp_path, setup, monkeypatch):
    """H2: numbering counted only signed directories, so a canary was written into a junk one."""
    root = tmp_path / "ckpt" / "policies"
    old = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False)
    for old.iteration in (3, 6):
        old.checkpoint()
    (root / "v000003").mkdir()
    (root / "v000004").mkdir()
    (root / "v000004" / "junk").write_bytes(b"x")
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 9
    fresh.checkpoint()
    assert fresh.canary is not None and (fresh.canary.version, fresh.canary.base_version) == (5, 2)
    assert not any((root / "v000003").iterdir())
    assert [p.name for p in (root / "v000004").iterdir()] == ["junk"]


def _staging_pointer(tmp_path, setup, monkeypatch, version: int):
    """The signed latest.json (and .sig) of a staging root of the same key and channel that
    published `version` ungated."""
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    ShardCommitter(str(b_dir / "in")).claim()
    b = _trainer(b_dir, setup.keys_dir, monkeypatch, resume=False)
    b.policy_version = version - 1
    b.iteration = 3
    b.checkpoint()
    return b_dir / "ckpt" / "policies"


def test_a_rollback_does_not_keep_a_pointer_copied_from_another_root(tmp_path, setup, monkeypatch, caplog):
    """H1: a rollback kept a signed latest.json naming v900 (copied from staging; absent here)
    because it was above the canary: it signed canary-ended.json with deployed_version 900, the
    trainer's next canary was based on v900, and every service restart was refused."""
    prod = tmp_path / "ckpt" / "policies"
    t = _promoted_first(tmp_path, setup, monkeypatch)
    t.iteration = 6
    t.checkpoint()  # canary v2 above v1
    staging = _staging_pointer(tmp_path, setup, monkeypatch, 900)
    for n in ("latest.json", "latest.json.sig"):
        shutil.copy(staging / n, prod / n)
    rec = t.look_canary(now=time.time() + CANARY_KW["canary_max_wait_s"] + 200)  # no canary traffic
    assert rec["decision"] == "rollback"
    assert json.loads((prod / "latest.json").read_bytes())["policy_version"] == 1
    assert json.loads((prod / "v000002" / "canary-ended.json").read_bytes())["deployed_version"] == 1
    assert t._deployed == 1
    assert load_policy(str(prod), public_key=setup.pub, channel=t.cfg.publish_channel).policy_version == 1
    t.iteration = 9
    t.checkpoint()
    assert t.canary is not None and t.canary.base_version == 1


def test_a_promotion_does_not_keep_a_pointer_copied_from_another_root(tmp_path, setup, monkeypatch):
    """H1: the promote branch kept max(named, canary) for the same copied pointer."""
    prod = tmp_path / "ckpt" / "policies"
    t = _promoted_first(tmp_path, setup, monkeypatch)
    t.iteration = 6
    t.checkpoint()
    staging = _staging_pointer(tmp_path, setup, monkeypatch, 900)
    for n in ("latest.json", "latest.json.sig"):
        shutil.copy(staging / n, prod / n)
    _serve(setup.committer, t.canary, {2: 3.0, 1: 0.0}, 300, seed=2)
    assert t.look_canary()["decision"] == "promote"
    assert json.loads((prod / "latest.json").read_bytes())["policy_version"] == 2
    assert json.loads((prod / "v000002" / "canary-ended.json").read_bytes())["deployed_version"] == 2
    assert t._deployed == 2
    assert load_policy(str(prod), public_key=setup.pub, channel=t.cfg.publish_channel).policy_version == 2


def test_a_fresh_run_does_not_base_its_canary_on_a_pointer_copied_from_another_root(
    tmp_path, setup, monkeypatch, caplog
):
    """H1: `_latest_version` took the copied pointer's v900 as the base of a fresh run's canary."""
    prod = tmp_path / "ckpt" / "policies"
    _promoted_first(tmp_path, setup, monkeypatch)
    staging = _staging_pointer(tmp_path, setup, monkeypatch, 900)
    for n in ("latest.json", "latest.json.sig"):
        shutil.copy(staging / n, prod / n)
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 9
    fresh.checkpoint()
    assert fresh.canary is not None and fresh.canary.base_version == 1
    assert json.loads((prod / "latest.json").read_bytes())["policy_version"] == 1
    assert any("names v900, which is no version deployed" in m for m in _errors(caplog))
    assert load_policy(str(prod), public_key=setup.pub, channel=fresh.cfg.publish_channel).policy_version == 1


def test_a_fresh_run_numbers_its_canary_above_the_signed_canary_floor(tmp_path, setup, monkeypatch):
    """H3: a floor signed into latest.json (a rolled-back canary v500 whose directory is gone)
    was ignored by numbering: the fresh run's canary v3 was at or below it, refused by every
    service, and rolled back for "no canary traffic" -- about 500 times."""
    prod = tmp_path / "ckpt" / "policies"
    t = _promoted_first(tmp_path, setup, monkeypatch)
    key = load_private_key(setup.keys_dir / "policy-signing.key")
    assert repoint_latest(Storage.from_uri(str(prod)), 1, key, t.cfg.publish_channel, canary_floor=500)
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 9
    fresh.checkpoint()
    assert fresh.canary is not None and (fresh.canary.version, fresh.canary.base_version) == (501, 1)
    svc = load_policy(str(prod), public_key=setup.pub, channel=fresh.cfg.publish_channel, canary_fraction=0.5)
    assert {svc.for_episode(f"e{i}")[1] for i in range(200)} == {1, 501}
