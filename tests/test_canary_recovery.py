"""``rlrec train --rollout canary`` after failures and hostile writes to the publish root
(review 40c): signed records bound to their version, rollbacks that sign nothing new, and the
pointers the trainer owns rewritten from its own state. Helpers from tests/test_canary_trainer.py.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("torch")

from rlrec.trainer.canary import in_canary
from rlrec.trainer.policy import load_policy
from tests.test_canary_sequential import _episode
from tests.test_canary_trainer import CANARY_KW, _resumed, _rolled_back_onto, _serve, canary_setup
from tests.test_policy_binding import _trainer


@pytest.fixture
def setup(tmp_path):
    return canary_setup(tmp_path)


# ------------------------------------------------------------- records bound to their version (review 40c)


def _canary_v2(tmp_path, setup, monkeypatch):
    """A trainer whose v1 was promoted and whose v2 is on canary above it."""
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    t.iteration = 6
    t.checkpoint()
    assert (t.canary.version, t.canary.base_version) == (2, 1)
    return tmp_path / "ckpt" / "policies", t


def test_an_unsigned_end_record_ends_no_canary(tmp_path, setup, monkeypatch):
    """An empty, unsigned ``v2/canary-ended.json`` (a key-less writer, or a kill between the record
    and its signature) was trusted by its existence: services dropped the running canary and a
    resumed trainer took it as over and never signed its end, so every service restart during the
    next canary was refused as a replay. It is no record: the canary is served and the test goes on."""
    root, _t = _canary_v2(tmp_path, setup, monkeypatch)
    p = load_policy(str(root), public_key=setup.pub, canary_fraction=0.3)
    (root / "v000002" / "canary-ended.json").write_bytes(b"")
    p.poll()
    assert p.canary_version == 2
    resumed = _resumed(tmp_path, setup, monkeypatch)
    assert resumed.canary is not None and resumed.canary.version == 2
    assert load_policy(str(root), public_key=setup.pub, canary_fraction=0.3).canary_version == 2


def test_a_decision_record_copied_from_another_version_is_not_carried_out(tmp_path, setup, monkeypatch):
    """A key-less writer copies v1's genuine signed "promote" ``rollout.json`` into the running canary
    v2's directory (v2 is 3.0 worse so far). A resumed trainer carried it out "unchanged, never
    judged again" and promoted v2; the record names v1, so it is ignored and v2 is judged on its
    evidence: rolled back."""
    import shutil

    root, t = _canary_v2(tmp_path, setup, monkeypatch)
    _serve(setup.committer, t.canary, {2: -3.0, 1: 0.0}, 100, seed=2)
    t.iteration = 7
    t.checkpoint()
    for name in ("rollout.json", "rollout.json.sig"):
        shutil.copy(root / "v000001" / name, root / "v000002" / name)
    record = _resumed(tmp_path, setup, monkeypatch).look_canary()
    assert record["decision"] == "rollback" and record["canary_version"] == 2
    _rolled_back_onto(root, record, 1)
    assert load_policy(str(root), public_key=setup.pub).policy_version == 1


def test_an_input_the_evidence_cannot_read_never_keeps_a_canary_past_its_limits(tmp_path, setup, monkeypatch):
    """One history shard whose policy_version is null (the schema gate allows it) made every look
    raise, and the limits live in the look: the canary was served, untested, forever. The shard is
    skipped; and looks that keep failing roll the canary back after --canary-max-wait-s."""
    import pyarrow as pa

    import rlrec.store.shards as shards
    from rlrec.trainer.rollout import CanaryRun

    real = shards.episodes_table

    def null_version(episodes):
        t = real(episodes)
        i = t.schema.get_field_index("policy_version")
        column = pa.array([None] * t.num_rows, pa.int64())
        return t.set_column(i, t.schema.field(i), column).replace_schema_metadata(t.schema.metadata)

    kw = {k: v for k, v in CANARY_KW.items() if k != "canary_episode_max_s"}  # fixed from the history
    setup.committer.commit([_episode(0, [1.0], 1000 + i, f"h{i}") for i in range(40)])
    monkeypatch.setattr(shards, "episodes_table", null_version)
    setup.committer.commit([_episode(0, [1.0], 2000, "hx")])
    monkeypatch.setattr(shards, "episodes_table", real)
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **{**kw, "canary_max_wait_s": 60.0})
    t.iteration = 3
    t.checkpoint()
    record = t.look_canary(now=t.canary.started + 86400)
    assert record["decision"] == "rollback" and "no canary traffic" in record["reason"]

    t.iteration = 6
    t.checkpoint()
    started = t.canary.started

    def failing(self, *args, **kwargs):
        raise OSError("the store does not answer")

    monkeypatch.setattr(CanaryRun, "look", failing)
    assert t.look_canary(now=started + 10) is None and t.look_canary(now=started + 40) is None
    record = t.look_canary(now=started + 75)
    assert record["decision"] == "rollback" and "could not be read for 65s" in record["reason"]


# --------------------------------------------------- rollbacks sign nothing new (review 40c C10, C11)


def test_another_channels_latest_json_is_no_base_and_a_rollback_signs_nothing(tmp_path, setup, monkeypatch):
    """A staging run's genuine signed version and latest.json (same key) copied into prod's root:
    the trainer took the staging v7 as its canary's base, and the no-traffic rollback signed
    v7's weights again as a new version for channel prod, which every prod-pinned service loaded.
    Another channel's pointer is no base (the trainer's own v1 is), and a rollback signs nothing."""
    import shutil

    from rlrec.trainer.signing import load_private_key
    from tests.test_policy_binding import publish

    root = tmp_path / "ckpt" / "policies"
    kw = {**CANARY_KW, "channel": "prod", "canary_max_wait_s": 60.0}
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **kw)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"  # prod v1 deployed
    staging = tmp_path / "staging"
    publish(staging, 7, load_private_key(setup.keys_dir / "policy-signing.key"), channel="staging", seed=777)
    shutil.copytree(staging / "v000007", root / "v000007")
    for n in ("latest.json", "latest.json.sig"):
        shutil.copy(staging / n, root / n)
    t.iteration = 6
    t.checkpoint()
    assert (t.canary.version, t.canary.base_version) == (8, 1)
    record = t.look_canary(now=t.canary.started + 3600)
    _rolled_back_onto(root, record, 1)
    assert not [
        d for d in root.iterdir() if d.name.startswith("v0") and d.name not in ("v000001", "v000007", "v000008")
    ]


def test_replay_plus_delete_gets_no_old_version_signed_above_the_state_file(tmp_path, setup, monkeypatch):
    """After v2 was promoted, a key-less writer restores the genuine pair latest.json(v1) +
    canary.json(v2) and deletes v2's decision records: a fresh trainer based its canary on v1 and
    its no-traffic rollback signed v1's weights as v4, above every state file, so a service whose
    state file holds v2 restarted on v1's weights. The rollback signs nothing: that service still
    refuses the replayed v1 (the state file's defence), and no version above the canary exists."""
    from rlrec.trainer.policy import PolicyLoadError

    root = tmp_path / "ckpt" / "policies"
    kw = {**CANARY_KW, "canary_max_wait_s": 60.0}
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **kw)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    t.iteration = 6
    t.checkpoint()  # canary v2 above v1
    old = {n: (root / n).read_bytes() for n in ("latest.json", "latest.json.sig", "canary.json", "canary.json.sig")}
    _serve(setup.committer, t.canary, {2: 2.0, 1: 0.0}, 300, seed=2)
    assert t.look_canary()["decision"] == "promote"
    state = tmp_path / "svc-state.json"
    assert load_policy(str(root), public_key=setup.pub, state_file=str(state)).policy_version == 2
    for name, data in old.items():
        (root / name).write_bytes(data)
    for n in ("canary-ended.json", "canary-ended.json.sig", "rollout.json", "rollout.json.sig"):
        (root / "v000002" / n).unlink()
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **kw)
    fresh.iteration = 3
    fresh.checkpoint()
    # v2 may have been promoted (review-40d D1): nothing is signed for it, no canary goes on above v1
    assert not (root / "v000002" / "canary-ended.json").exists() and fresh._pending
    assert json.loads((root / "canary.json").read_bytes())["policy_version"] == 2
    assert not any(p.name > "v000002" for p in root.iterdir() if p.name.startswith("v"))
    with pytest.raises(PolicyLoadError, match="older than v000002"):
        load_policy(str(root), public_key=setup.pub, state_file=str(state))


# ---------------------------------------------- the trainer's pointers rewritten from its state (review 40c C6, C4a)


def test_a_torn_canary_pointer_is_repaired_at_the_next_refresh(tmp_path, setup, monkeypatch):
    """One failed canary.json.sig write during the periodic re-sign tore the pointer for good (every
    later refresh read it with the key and failed): running services dropped the canary and every
    (re)start was refused as a replay. The refresh rewrites it from the trainer's own state."""
    root, t = _canary_v2(tmp_path, setup, monkeypatch)
    running = load_policy(str(root), public_key=setup.pub, canary_fraction=0.3)
    assert running.canary_version == 2
    real, fails = t.publish_storage.write, {"n": 1}

    def write(path, data):
        if path == "canary.json.sig" and fails["n"]:
            fails["n"] -= 1
            raise OSError("503 Slow Down (after the storage retries)")
        return real(path, data)

    monkeypatch.setattr(t.publish_storage, "write", write)
    t.iteration = 7
    t.checkpoint()  # its refresh tears canary.json once
    assert fails["n"] == 0
    t.iteration = 8
    t.checkpoint()  # the store is healthy again
    running.poll()
    assert running.canary_version == 2
    for fraction in (0.0, 0.3):
        p = load_policy(str(root), public_key=setup.pub, canary_fraction=fraction)
        assert (p.policy_version, p.canary_version) == (1, 2 if fraction else None)


@pytest.mark.parametrize("damage", ["torn", "junk"])
def test_a_fresh_run_over_an_unusable_latest_json_bases_on_the_deployed_version_and_repairs_it(
    tmp_path, setup, monkeypatch, damage
):
    """latest.json torn (a kill between it and its .sig) or junk (a key-less writer): a fresh run
    took base 0 and never repaired it, so every service restart failed and every later canary got
    no traffic, indefinitely. Its base is the highest deployed version its key signed for its
    channel (v1), and latest.json is re-pointed at it."""
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    if damage == "torn":
        (root / "latest.json.sig").unlink()
    else:
        (root / "latest.json").write_bytes(b"{junk")
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 3
    fresh.checkpoint()
    assert (fresh.canary.version, fresh.canary.base_version) == (2, 1)
    for fraction in (0.0, 0.3):
        p = load_policy(str(root), public_key=setup.pub, canary_fraction=fraction)
        assert (p.policy_version, p.canary_version) == (1, 2 if fraction else None)
    (root / "latest.json").write_bytes(b"{junk")  # again, while the canary runs: the next refresh repairs it
    fresh.iteration = 4
    fresh.checkpoint()
    assert load_policy(str(root), public_key=setup.pub).policy_version == 1


def test_a_fresh_run_carries_out_a_promotion_decided_before_the_kill(tmp_path, setup, monkeypatch):
    """The trainer signed its decision to promote canary v2 (rollout.json), then was killed before
    latest.json moved. A fresh run ended v2 as "abandoned" (and, killed between latest.json and its
    .sig, took base 0): the decided promotion was thrown away. The fresh run carries it out: v2 is
    its base, latest.json names it, and v2's end record says promote."""

    class Killed(BaseException):
        pass

    root, t = _canary_v2(tmp_path, setup, monkeypatch)
    _serve(setup.committer, t.canary, {2: 2.0, 1: 0.0}, 300, seed=2)
    real = t.publish_storage.write

    def write(path, data):
        if path == "latest.json":
            raise Killed("kill -9")
        return real(path, data)

    monkeypatch.setattr(t.publish_storage, "write", write)
    with pytest.raises(Killed):
        t.look_canary()
    assert json.loads((root / "v000002" / "rollout.json").read_bytes())["decision"] == "promote"
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 3
    fresh.checkpoint()
    assert (fresh.canary.version, fresh.canary.base_version) == (3, 2)
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 2
    assert json.loads((root / "v000002" / "canary-ended.json").read_bytes())["decision"] == "promote"
    for fraction in (0.0, 0.3):
        p = load_policy(str(root), public_key=setup.pub, canary_fraction=fraction)
        assert (p.policy_version, p.canary_version) == (2, 3 if fraction else None)


def test_a_canary_return_below_the_range_outside_the_band_rolls_it_back(tmp_path, setup, monkeypatch):
    """The "canary return below the range: roll back at once" rule saw only the test's band: with
    services at canary_fraction 0.5 and the band at 0.05, a catastrophic return in the 90 % of
    served canary episodes outside the band was ignored. It rolls the canary back too."""
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **{**CANARY_KW, "canary_share": 0.05})
    t.iteration = 3
    t.checkpoint()
    run, eps = t.canary, []
    for i in range(300):
        eid = f"x{i}"
        canary = in_canary(eid, 0.5)
        ret = -5.0 if canary and not in_canary(eid, 0.05) else 0.0  # below -3.5 only outside the band
        eps.append(_episode(1 if canary else 0, [ret], int(run.started * 1000) + 1, eid, 1, 0.5, run.sha256))
    setup.committer.commit(eps)
    record = t.look_canary()
    assert record["decision"] == "rollback" and "outside the test's band" in record["reason"]
    assert not (root / "canary.json").exists()


def test_a_resumed_canary_whose_pointer_was_removed_continues_and_its_pointer_is_rewritten(
    tmp_path, setup, monkeypatch, caplog
):
    """canary.json removed by who can write the root, then a resume: the running canary was dropped
    at INFO "it was decided" though nothing decided it, and v2 stayed signed above latest.json with
    no end record (every later restart refused as a replay). Its signed files are here: the same
    test continues and the next checkpoint rewrites the pointer. A canary whose files are not under
    this root (resumed onto another --publish-dir) is dropped with a WARNING."""
    import logging
    import shutil

    root, t = _canary_v2(tmp_path, setup, monkeypatch)
    t.iteration = 7
    t.checkpoint()
    for n in ("canary.json", "canary.json.sig"):
        (root / n).unlink()
    r = _resumed(tmp_path, setup, monkeypatch)
    assert r.canary is not None and r.canary.version == 2
    r.iteration = 8
    r.checkpoint()
    assert json.loads((root / "canary.json").read_bytes())["policy_version"] == 2
    assert load_policy(str(root), public_key=setup.pub, canary_fraction=0.3).canary_version == 2
    # the same checkpoint resumed onto a root without v2: dropped, loudly
    for n in ("canary.json", "canary.json.sig"):
        (root / n).unlink()
    shutil.rmtree(root / "v000002")
    caplog.set_level(logging.INFO, logger="rlrec.trainer")
    dropped = _resumed(tmp_path, setup, monkeypatch)
    assert dropped.canary is None
    warned = [x for x in caplog.records if "dropped unjudged" in x.getMessage()]
    assert warned and warned[0].levelno == logging.WARNING
    assert not [x for x in caplog.records if "was decided before" in x.getMessage()]


def test_a_fresh_run_over_an_undecided_canary_whose_pointer_was_removed(tmp_path, setup, monkeypatch):
    """Canary v2 above v1, its trainer killed, then canary.json removed by who can write the root.
    A fresh run took v2 -- never tested -- for a deployed version (no pointer named it, no record
    ended it): its base, and once pointers are repaired from the trainer's state, latest.json.
    A version signed as a canary is deployed only once a decision promoted it: the base stays v1.
    Nothing proves v2 was never promoted (its records may have been deleted, review-40d D1): the
    fresh run signs nothing and puts no canary on until an operator deletes v2's directory."""
    root, _t = _canary_v2(tmp_path, setup, monkeypatch)
    assert json.loads((root / "v000002" / "policy.json").read_bytes())["rollout"] == "canary"
    for n in ("canary.json", "canary.json.sig"):
        (root / n).unlink()
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 3
    fresh.checkpoint()
    assert (fresh.canary.version, fresh.canary.base_version) == (3, 1)
    assert fresh._pending and not (root / "canary.json").exists()
    assert not (root / "v000002" / "canary-ended.json").exists()
    shutil.rmtree(root / "v000002")  # the operator: v2 was never promoted (docs/TRAINER.md)
    fresh.iteration = 4
    fresh.checkpoint()  # the pending canary goes on
    assert not fresh._pending
    fresh.iteration = 5
    fresh.checkpoint()  # the pointers' refresh
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 1
    for fraction in (0.0, 0.3):
        p = load_policy(str(root), public_key=setup.pub, canary_fraction=fraction)
        assert (p.policy_version, p.canary_version) == (1, 3 if fraction else None)
