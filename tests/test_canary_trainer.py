"""``rlrec train --rollout canary``, the trainer's side, without Ray (the trainer's checkpoint and
publication code on a stand-in algorithm, as tests/test_policy_binding.py drives it): a gated
candidate goes to ``canary.json``, not ``latest.json``; its test reads committed shards; a
better canary is promoted, a worse one rolled back (``latest.json`` stays on the deployed
version); a trainer restarted from its checkpoint mid-canary (``--resume`` after a kill -9)
continues the same test; no new candidate is judged while a canary runs.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("torch")

from rlrec.store.commit import ShardCommitter
from rlrec.trainer.canary import in_canary
from rlrec.trainer.ope_jobs import REFUSALS, refusal_record
from rlrec.trainer.policy import load_policy
from rlrec.trainer.rollout import gate_declined
from rlrec.trainer.signing import generate_keys
from tests.test_canary_sequential import _episode
from tests.test_policy_binding import _trainer

CANARY_KW = {
    "promotion_gate": "env",
    "env": "CartPole-v1",
    "promotion_episodes": 1,
    "rollout": "canary",
    "canary_min_episodes": 20,
    "canary_max_episodes": 400,
    "canary_max_wait_s": 3600.0,
    "canary_look_interval_s": 0.0,
    "canary_return_min": -3.5,  # every return `_serve` serves lies in it (the test's stated range)
    "canary_return_max": 3.5,
    "canary_episode_max_s": 0.0,  # these tests' episodes end at once
    "canary_share": 0.5,  # what `_serve` serves
}


def _serve(committer, canary, versions: dict[int, float], n: int, seed: int, share: float = 0.5) -> None:
    """`n` episodes of the trainer's running `canary` (`CanaryRun`: its start and identity) as
    services that opt in with `share` log them: each episode's version by the
    canary hash (its assignment logged in the reset info), its return drawn uniformly within 0.5 of
    the version's mean (within the stated range of `CANARY_KW` for means in [-3, 3])."""
    rng = np.random.default_rng(seed)
    (canary_v, canary_mean), (base_v, base_mean) = sorted(versions.items(), reverse=True)
    eps = []
    for i in range(n):
        eid = f"s{seed}-e{i}"
        v, mean = (canary_v, canary_mean) if in_canary(eid, share) else (base_v, base_mean)
        ret = [float(rng.uniform(mean - 0.5, mean + 0.5))]
        eps.append(_episode(v, ret, int(canary.started * 1000) + 1, eid, canary_v, share, canary.sha256))
    committer.commit(eps)


def canary_setup(tmp_path) -> SimpleNamespace:
    """A signing key pair and a claimed shard committer for the trainer's input under `tmp_path`."""
    keys_dir = tmp_path / "keys"
    generate_keys(keys_dir)
    committer = ShardCommitter(str(tmp_path / "in"))
    committer.claim()
    return SimpleNamespace(keys_dir=keys_dir, committer=committer, pub=str(keys_dir / "policy-signing.pub"))


@pytest.fixture
def setup(tmp_path):
    return canary_setup(tmp_path)


def _resumed(tmp_path, setup, monkeypatch, **kw):
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=True, **CANARY_KW, **kw)
    t.metrics = SimpleNamespace(truncate_after=lambda _i: None)
    assert t._restore(t._resume_point())
    return t


def test_a_better_canary_is_promoted_and_a_worse_one_rolled_back(tmp_path, setup, monkeypatch):
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    # the first version goes on canary above what services ran before (version 0)
    assert t.canary is not None and (t.canary.version, t.canary.base_version) == (1, 0)
    assert (root / "canary.json").exists() and not (root / "latest.json").exists()
    assert t.look_canary() is None  # no evidence yet
    t.iteration = 6
    t.checkpoint()  # no new candidate while the canary runs
    assert t.policy_version == 1 and not (root / "v000002").exists()

    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    record = t.look_canary()
    assert record["decision"] == "promote" and record["deployed_version"] == 1
    assert record["episodes_canary"] >= 20 and record["low"] >= 0
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 1
    assert not (root / "canary.json").exists()
    assert json.loads((root / "v000001" / "rollout.json").read_bytes())["decision"] == "promote"
    assert t.canary is None

    # the next candidate: on canary above v1; services restarting meanwhile load v1 and the canary
    t.iteration = 9
    t.checkpoint()
    assert (t.canary.version, t.canary.base_version) == (2, 1)
    state = tmp_path / "svc.json"
    p = load_policy(str(root), public_key=setup.pub, state_file=state, canary_fraction=0.3)
    assert (p.policy_version, p.canary_version) == (1, 2)
    _serve(setup.committer, t.canary, {2: -2.0, 1: 0.0}, 300, seed=2)
    record = t.look_canary()
    assert record["decision"] == "rollback" and "the canary is worse" in record["reason"]
    # latest.json stays on v1: nothing is republished, the signed rollback record excuses v2
    assert record["deployed_version"] == 1 and t.policy_version == 1 and not (root / "v000003").exists()
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 1
    ended = json.loads((root / "v000002" / "canary-ended.json").read_bytes())
    assert (ended["decision"], ended["deployed_version"]) == ("rollback", 1)
    p.poll()
    assert (p.policy_version, p.canary_version) == (1, None)
    assert json.loads(state.read_bytes())["policy_version"] == 1
    for fraction in (0.0, 0.3):  # a (re)starting service, with the state file too, loads v1: no replay
        again = load_policy(str(root), public_key=setup.pub, state_file=state, canary_fraction=fraction)
        assert (again.policy_version, again.canary_version) == (1, None)
    # the trainer publishes above the rollback, on canary above v1
    t.iteration = 12
    t.checkpoint()
    assert (t.canary.version, t.canary.base_version) == (3, 1)


def test_a_restarted_trainer_continues_the_same_canary_test(tmp_path, setup, monkeypatch):
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    started = t.canary.started
    _serve(setup.committer, t.canary, {1: 0.0, 0: 0.0}, 40, seed=3)
    assert t.look_canary() is None
    t.iteration = 4
    t.checkpoint()  # the look is in the checkpoint; then the process is killed (no clean stop)

    r = _resumed(tmp_path, setup, monkeypatch)
    assert r.canary is not None and r.canary.started == started and r.canary.version == 1
    assert r.canary.history == t.canary.history  # the same test, its looks so far
    _serve(setup.committer, r.canary, {1: 3.0, 0: 0.0}, 300, seed=4)
    record = r.look_canary()
    assert record["decision"] == "promote" and record["started"] == started
    assert record["episodes_canary"] + record["episodes_deployed"] == 340  # the evidence from before the kill counts

    # killed after carrying the decision out but before the checkpoint recorded it: the resume sees it is over
    again = _resumed(tmp_path, setup, monkeypatch)
    assert again.canary is None and again.policy_version == 1
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 1


def test_no_canary_traffic_rolls_back_loudly(tmp_path, setup, monkeypatch, caplog):
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **{**CANARY_KW, "canary_max_wait_s": 60.0})
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 0.0, 0: 0.0}, 5, seed=5)
    record = t.look_canary(now=t.canary.started + 61)
    assert record["decision"] == "rollback"
    assert "no canary traffic: services must opt in with canary_fraction" in caplog.text
    assert [r.levelname for r in caplog.records if "no canary traffic" in r.getMessage()] == ["ERROR"]
    assert not (root / "canary.json").exists() and not (root / "latest.json").exists()  # nothing was deployed


def test_the_options(tmp_path):
    from rlrec.trainer.config import TrainerConfig

    base = {"input": str(tmp_path), "checkpoint_dir": str(tmp_path)}
    with pytest.raises(ValueError, match=r"--rollout canary .* not with --promotion-gate off"):
        TrainerConfig(**base, rollout="canary", promotion_gate="off")
    with pytest.raises(ValueError, match=r"--canary-unjudged needs --rollout canary"):
        TrainerConfig(**base, promotion_gate="off", canary_unjudged=True)
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\)"):
        TrainerConfig(**base, rollout="canary", promotion_gate="ope", canary_alpha=1.5)
    cfg = TrainerConfig(**base, rollout="canary", promotion_gate="ope", canary_unjudged=True)
    assert cfg.canary_rule().alpha == 0.05
    assert dataclasses.is_dataclass(cfg)


def test_a_decision_the_publish_store_failed_to_carry_out_is_carried_out_later(tmp_path, setup, monkeypatch):
    from rlrec.trainer import canary_publish

    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=6)
    real = canary_publish.end_canary

    def down(*a, **kw):
        raise OSError("the publish store does not answer")

    monkeypatch.setattr(canary_publish, "end_canary", down)
    assert t.look_canary() is None and t.canary is not None
    assert (root / "canary.json").exists() and not (root / "latest.json").exists()
    taken = t._canary_decision
    assert taken["decision"] == "promote"
    monkeypatch.setattr(canary_publish, "end_canary", real)
    record = t.look_canary()
    assert record["decided"] == taken["decided"] and record["deployed_version"] == 1 and t.canary is None
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 1


def test_the_report_plots_both_arms_and_the_bound(tmp_path, setup, monkeypatch):
    import base64
    import re

    from rlrec.report import render_html
    from rlrec.report_data import ReportData

    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    started = t.canary.started
    lines = []
    for k in range(12):
        _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 20, seed=10 + k)
        record = t.look_canary(now=started + 10 * (k + 1))
        if record is not None:
            lines.append({"time": started + 10 * (k + 1), "canary": record})
            break
        lines.append({"time": started + 10 * (k + 1), "canary_version": 1, "canary_look": t.canary.history[-1]})
    assert lines[-1]["canary"]["decision"] == "promote" and len(lines) >= 2
    data = ReportData()
    data.trainer = lines
    html = render_html(data)
    (img,) = re.findall(r'<img id="plot-canary"[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert base64.b64decode(img).startswith(b"\x89PNG")
    assert 'id="plot-canary"' not in render_html(ReportData())  # no canary: no plot


# ---------------------------------------------------------------- what the publish root cannot steer


def _two_promotions(tmp_path, setup, monkeypatch, **kw):
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **{**CANARY_KW, **kw})
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    t.iteration = 6
    t.checkpoint()
    _serve(setup.committer, t.canary, {2: 2.0, 1: 0.0}, 300, seed=2)
    assert t.look_canary()["decision"] == "promote"
    return t


def _rolled_back_onto(root, record: dict, base: int) -> None:
    """A rollback leaves `base` deployed and signs nothing new: no version above the canary's."""
    assert record["decision"] == "rollback" and record["deployed_version"] == base
    canary = record["canary_version"]
    assert not [d for d in root.iterdir() if d.name.startswith("v0") and int(d.name[1:]) > canary]


@pytest.mark.parametrize("attack", ["unsigned", "replayed"])
def test_a_forged_or_replayed_latest_json_is_no_canary_base(tmp_path, setup, monkeypatch, attack):
    """Who can write the root without the key writes latest.json naming an old v1 (unsigned, or
    v1's genuine signed pointer replayed): the next canary's base stays v2, which the trainer
    deployed, and its rollback leaves v2 deployed: v1's weights are never signed as a new version."""
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **{**CANARY_KW, "canary_max_wait_s": 60.0})
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    old = {n: (root / n).read_bytes() for n in ("latest.json", "latest.json.sig")}
    t.iteration = 6
    t.checkpoint()
    _serve(setup.committer, t.canary, {2: 2.0, 1: 0.0}, 300, seed=2)
    assert t.look_canary()["decision"] == "promote"
    if attack == "unsigned":
        doc = json.loads((root / "latest.json").read_bytes())
        doc.update({"policy_version": 1, "path": "v000001"})
        doc.pop("sha256", None)
        (root / "latest.json").write_bytes(json.dumps(doc).encode())
        (root / "latest.json.sig").unlink()
    else:
        for name, data in old.items():
            (root / name).write_bytes(data)
    t.iteration = 9
    t.checkpoint()
    assert (t.canary.version, t.canary.base_version) == (3, 2)
    record = t.look_canary(now=t.canary.started + 61)  # no traffic: rolled back
    _rolled_back_onto(root, record, 2)


def test_an_unreadable_latest_json_after_a_first_rollback_keeps_base_zero(tmp_path, setup, monkeypatch):
    """After a first canary (base 0) was rolled back, latest.json cannot be read while the next
    candidate is prepared: its base is what this trainer deployed (nothing), not the rolled-back v1."""
    from rlrec.trainer import canary_publish

    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **{**CANARY_KW, "canary_max_wait_s": 60.0})
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: -3.0, 0: 0.0}, 300, seed=1)
    rec = t.look_canary()
    assert rec["decision"] == "rollback" and rec["deployed_version"] == 0

    def unreadable(*a, **k):
        raise OSError("503 Slow Down")

    monkeypatch.setattr(canary_publish, "read_pointer", unreadable)
    t.iteration = 6
    t.checkpoint()
    monkeypatch.undo()
    assert (t.canary.version, t.canary.base_version) == (2, 0)
    assert t.look_canary(now=t.canary.started + 61) is None  # pending (not written): never judged
    t._write_publications()  # the next iteration writes it
    rec = t.look_canary(now=t.canary.started + 61)
    assert rec["decision"] == "rollback" and rec["deployed_version"] == 0
    assert not (tmp_path / "ckpt" / "policies" / "latest.json").exists()


def test_a_kill_between_the_steps_of_a_promotion_carries_the_same_decision_out_at_resume(tmp_path, setup, monkeypatch):
    """Killed after latest.json moved to the promoted v2 but before canary.json was removed: the
    resumed trainer carries out the recorded promotion, never judges the (now 100 %) traffic again."""
    from rlrec.trainer import canary_publish

    root = tmp_path / "ckpt" / "policies"
    kw = {**CANARY_KW, "canary_max_episodes": 400}
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **kw)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    t.iteration = 6
    t.checkpoint()
    started = t.canary.started
    _serve(setup.committer, t.canary, {2: 2.0, 1: 0.0}, 300, seed=2)

    class Killed(BaseException):
        pass

    def killed(*a, **k):
        raise Killed()

    monkeypatch.setattr(canary_publish, "_remove_canary", killed)
    with pytest.raises(Killed):
        t.look_canary()
    monkeypatch.undo()
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 2
    r = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=True, **kw)
    r.metrics = SimpleNamespace(truncate_after=lambda _i: None, write=lambda _r: None)
    assert r._restore(r._resume_point())
    rng = np.random.default_rng(5)  # v2 now serves every episode, as good as v1 in truth
    setup.committer.commit(
        [_episode(2, [float(rng.normal(0.0, 1.0))], int(started * 1000) + 5000 + i, f"all-{i}") for i in range(600)]
    )
    record = r.look_canary()
    assert record["decision"] == "promote" and record["deployed_version"] == 2 and r.canary is None
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 2
    assert json.loads((root / "v000002" / "rollout.json").read_bytes())["decision"] == "promote"
    assert not (root / "canary.json").exists() and not (root / "v000003").exists()


def test_an_undecided_canary_whose_traffic_stops_is_rolled_back_and_the_loop_goes_on(tmp_path, setup, monkeypatch):
    """Both arms have enough episodes, the bound straddles 0, then the canary gets no more
    episodes (services set canary_fraction back to 0): it is rolled back after --canary-max-wait-s
    without a new canary episode, loudly, and the next candidate is judged."""
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    started = t.canary.started
    _serve(setup.committer, t.canary, {1: 0.0, 0: 0.0}, 150, seed=3)
    assert t.look_canary(now=started + 10) is None  # undecided
    assert t.canary.history[-1]["n_canary"] >= 20 and t.canary.history[-1]["n_deployed"] >= 20
    assert t.look_canary(now=started + 1800) is None
    record = t.look_canary(now=started + 3700)
    assert record["decision"] == "rollback" and "no new canary episode in 3690s" in record["reason"]
    assert t.canary is None and not (root / "canary.json").exists()
    t.iteration = 6
    t.checkpoint()
    assert t.canary is not None and t.canary.version == 2  # the loop publishes again


def test_a_canary_is_never_undecided_past_its_longest_duration():
    from rlrec.trainer.sequential import ArmStats, CanaryRule, judge

    rule = CanaryRule(min_episodes=2, max_exposure=10_000, max_duration_s=86400.0, return_min=-9.0, return_max=9.0)
    same = ArmStats.of([0.0, 1.0] * 20)
    assert judge(same, same, rule, 86399.0, idle_s=0.0).decision == "continue"
    v = judge(same, same, rule, 86400.0, idle_s=0.0)
    assert v.decision == "rollback" and "longest canary duration" in v.reason


def test_a_canary_publication_refused_for_lost_lineage_is_no_canary(tmp_path, setup, monkeypatch):
    """write_publication refuses the canary version (its data was removed by retention): its
    canary.json goes too, the trainer runs no phantom canary, and the next candidate is judged
    under a new number (the refused one stays reserved)."""
    from rlrec.trainer import export
    from rlrec.trainer.lineage import LineageError

    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **{**CANARY_KW, "canary_max_wait_s": 60.0})
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    real = export._check_data_kept

    def refused(storage, pub):
        export._remove_refused(storage, pub)
        raise LineageError(f"policy version {pub.version}: data removed by retention")

    monkeypatch.setattr(export, "_check_data_kept", refused)
    t.iteration = 6
    t.checkpoint()
    monkeypatch.setattr(export, "_check_data_kept", real)
    assert not t._pending and t.canary is None and not (root / "canary.json").exists()
    t.iteration = 9
    t.checkpoint()
    assert (t.canary.version, t.canary.base_version) == (3, 1)
    assert json.loads((root / "canary.json").read_bytes())["policy_version"] == 3


def test_a_canary_pending_through_an_outage_starts_when_its_pointer_lands(tmp_path, setup, monkeypatch):
    """A publish-store outage longer than --canary-max-wait-s keeps the canary's publication
    pending; its clock starts when canary.json lands, so the first look does not roll it back
    as 'no canary traffic' for time it was not served."""
    import time as time_module

    from rlrec.trainer import canary_publish

    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **{**CANARY_KW, "canary_max_wait_s": 600.0})
    real = canary_publish.write_canary

    def down(*a, **kw):
        raise OSError("publish store unreachable")

    monkeypatch.setattr(canary_publish, "write_canary", down)
    t.iteration = 3
    t.checkpoint()
    assert t._pending and not (root / "canary.json").exists()
    prepared = t.canary.started
    monkeypatch.setattr(canary_publish, "write_canary", real)
    back = prepared + 660.0  # the store is back 11 minutes later
    with monkeypatch.context() as m:
        m.setattr(time_module, "time", lambda: back)
        t._write_publications()
    assert json.loads((root / "canary.json").read_bytes())["started"] == pytest.approx(back)
    assert t.canary.started == pytest.approx(back)
    assert t.look_canary(now=back + 60) is None  # served 60 s: no verdict yet


def test_an_unreadable_canary_pointer_at_resume_keeps_the_running_test(tmp_path, setup, monkeypatch):
    """A transient error reading canary.json at --resume is not "the canary is over": the test
    continues (services keep serving the canary meanwhile, so something must judge it)."""
    from rlrec.trainer import canary_publish

    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    t.iteration = 4
    t.checkpoint()  # kill -9 after this
    real = canary_publish.read_pointer

    def flaky(storage, name="latest.json", signing_key=None):
        if name == "canary.json":
            raise OSError("503 Slow Down")
        return real(storage, name, signing_key)

    monkeypatch.setattr(canary_publish, "read_pointer", flaky)
    r = _resumed(tmp_path, setup, monkeypatch)
    monkeypatch.setattr(canary_publish, "read_pointer", real)
    assert r.canary is not None and r.canary.version == 1
    _serve(setup.committer, r.canary, {1: 2.0, 0: 0.0}, 300, seed=8)
    assert r.look_canary()["decision"] == "promote"


def test_a_fresh_run_takes_no_replayed_signed_latest_json_as_its_base(tmp_path, setup, monkeypatch):
    """A trainer started without --resume knows no deployed version of its own: a genuine old
    latest.json(v1) replayed after v2 was promoted is still no base (v2, signed and no canary,
    exists above it), so a rollback cannot make v1 the deployed version."""
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **{**CANARY_KW, "canary_max_wait_s": 60.0})
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    old = {n: (root / n).read_bytes() for n in ("latest.json", "latest.json.sig")}
    t.iteration = 6
    t.checkpoint()
    _serve(setup.committer, t.canary, {2: 2.0, 1: 0.0}, 300, seed=2)
    assert t.look_canary()["decision"] == "promote"
    for name, data in old.items():
        (root / name).write_bytes(data)
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **{**CANARY_KW, "canary_max_wait_s": 60.0})
    fresh.iteration = 3
    fresh.checkpoint()
    assert (fresh.canary.version, fresh.canary.base_version) == (3, 2)
    _rolled_back_onto(root, fresh.look_canary(now=fresh.canary.started + 61), 2)


@pytest.mark.parametrize("code", sorted(REFUSALS))
def test_canary_unjudged_follows_the_gates_refusal_code(code):
    """`--canary-unjudged` takes exactly the refusals the offline data did not judge (a code with
    ``judged`` false), never a judged-worse candidate nor a failed evaluation -- whatever the
    decision's other fields say (here a verdict that holds, which alone would read as judged)."""
    decision = {"promoted": False, "estimable": True, "gate_verdict": {"ok": True}, "refusal": refusal_record(code)}
    assert gate_declined(decision) is (not REFUSALS[code] and code != "failed")


def test_a_replayed_pointer_pair_is_no_canary_base_for_a_fresh_run(tmp_path, setup, monkeypatch):
    """After v2 was promoted, who can write the root without the key restores the genuine old pair
    latest.json(v1) + canary.json(v2, base 1): v2's signed canary-ended.json says it was promoted,
    so a fresh trainer's canary is based on v2 and its rollback leaves v2 deployed, never v1."""
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
    for name, data in old.items():
        (root / name).write_bytes(data)
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **kw)
    fresh.iteration = 3
    fresh.checkpoint()
    assert fresh.canary.base_version == 2
    _rolled_back_onto(root, fresh.look_canary(now=fresh.canary.started + 61), 2)


def test_an_unreadable_canary_json_never_makes_an_undecided_canary_a_base(tmp_path, setup, monkeypatch):
    """A fresh run finds canary v2 above v1, never decided; reading canary.json fails once while it
    prepares its candidate. v2 was never deployed: the base stays v1 (services run it), never the
    untested v2 for every episode; the new canary waits on v2 (UndecidedCanary), unjudged."""
    from rlrec.trainer import canary_publish
    from rlrec.trainer.policy import CANARY

    root = tmp_path / "ckpt" / "policies"
    kw = {**CANARY_KW, "canary_max_wait_s": 60.0}
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **kw)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    t.iteration = 6
    t.checkpoint()  # canary v2 above v1; the trainer dies, a fresh run starts
    real = canary_publish.read_pointer

    def flaky(storage, name=canary_publish.LATEST, signing_key=None):
        if name == CANARY:
            raise OSError("503 Slow Down")
        return real(storage, name, signing_key)

    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **kw)
    monkeypatch.setattr(canary_publish, "read_pointer", flaky)
    fresh.iteration = 3
    fresh.checkpoint()
    monkeypatch.setattr(canary_publish, "read_pointer", real)
    assert fresh.canary.base_version == 1
    fresh._write_publications()  # the next iteration: v2 is undecided, so v3 waits (UndecidedCanary)
    assert [p.version for p in fresh._pending] == [3]
    assert fresh.look_canary(now=fresh.canary.started + 61) is None  # a pending canary is never judged
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 1
    assert not (root / "v000003").exists()


def test_a_refused_latest_json_does_not_keep_a_rolled_back_canary_served(tmp_path, setup, monkeypatch):
    """A replayed older latest.json (v1) makes every poll refuse it; the canary pointer is polled
    all the same, so a canary the trainer rolled back meanwhile is no longer served."""
    from rlrec.trainer.policy import PolicyLoadError, load_policy

    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    l1 = {n: (root / n).read_bytes() for n in ("latest.json", "latest.json.sig")}
    t.iteration = 6
    t.checkpoint()
    _serve(setup.committer, t.canary, {2: 2.0, 1: 0.0}, 300, seed=2)
    assert t.look_canary()["decision"] == "promote"
    t.iteration = 9
    t.checkpoint()  # canary v3 above v2
    p = load_policy(str(root), public_key=setup.pub, canary_fraction=0.3)
    assert (p.policy_version, p.canary_version) == (2, 3)
    _serve(setup.committer, t.canary, {3: -3.0, 2: 0.0}, 300, seed=3)
    assert t.look_canary()["decision"] == "rollback"
    for name, data in l1.items():
        (root / name).write_bytes(data)
    with pytest.raises(PolicyLoadError):
        p.poll()
    eid = next(f"e{i}" for i in range(100) if in_canary(f"e{i}", 0.3))
    assert p.canary_version is None and p.for_episode(eid).policy_version == 2


def test_an_unsigned_reservation_far_above_the_signed_versions_is_ignored(tmp_path, setup, monkeypatch):
    """The reservation log is not signed: one file `000000999999` left by who can write the root
    without the key pushed numbering past 999999, so every publication failed (and, while a
    rollback republished, the worse canary stayed served). A reservation far above the highest signed version is ignored."""
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    t.iteration = 6
    t.checkpoint()  # canary v2 above v1
    (root / "_owners" / "publisher" / "versions" / "000000999999").write_bytes(b"")
    _serve(setup.committer, t.canary, {2: -3.0, 1: 0.0}, 300, seed=2)
    record = t.look_canary()
    assert record["decision"] == "rollback" and record["deployed_version"] == 1
    assert not (root / "canary.json").exists()
    t.iteration = 9
    t.checkpoint()  # the next publication is numbered above the signed versions, not the reservation
    assert (t.canary.version, t.canary.base_version) == (3, 1)


def test_a_fresh_run_over_a_running_canary_ends_it_and_services_still_restart(tmp_path, setup, monkeypatch):
    """The trainer is killed while canary v2 runs above v1 and a fresh run (no --resume) puts its
    own candidate on canary: v2, never decided, was left signed above latest.json's v1 and every
    service (re)start refused latest.json as a replay. Nothing proves v2 was never promoted (its
    records may have been deleted, review-40d D1): the fresh run signs nothing and waits, services
    keep restarting on v1 with canary v2; once the operator deletes v2's directory the fresh run's
    canary goes on, services restart on v1, and a later fresh run's base is not v2."""
    from rlrec.trainer.canary_publish import signed_above
    from rlrec.trainer.policy import load_policy
    from rlrec.trainer.signing import load_private_key

    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    t.iteration = 6
    t.checkpoint()  # canary v2 above v1; then the trainer is killed and a fresh run starts
    fresh = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    fresh.iteration = 3
    fresh.checkpoint()
    assert (fresh.canary.version, fresh.canary.base_version) == (3, 1)
    assert fresh._pending and not (root / "v000002" / "canary-ended.json").exists()
    for frac in (0.0, 0.3):
        p = load_policy(str(root), public_key=setup.pub, canary_fraction=frac)
        assert p.policy_version == 1 and p.canary_version == (2 if frac else None)
    shutil.rmtree(root / "v000002")  # the operator: v2 was never promoted (docs/TRAINER.md)
    fresh.iteration = 4
    fresh.checkpoint()
    assert not fresh._pending
    for frac in (0.0, 0.3):
        p = load_policy(str(root), public_key=setup.pub, canary_fraction=frac)
        assert p.policy_version == 1 and p.canary_version == (3 if frac else None)
    key = load_private_key(str(setup.keys_dir / "policy-signing.key"))
    assert signed_above(fresh.publish_storage, key, 1, fresh.cfg.publish_channel) == 1


def test_the_trainer_re_signs_its_running_canary_pointer(tmp_path, setup, monkeypatch):
    """The pointer refresh re-signs canary.json with a fresh time while its canary runs (a first
    canary included, with nothing deployed yet), so services checking pointer ages keep serving it."""
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    before = json.loads((root / "canary.json").read_bytes())
    time.sleep(0.01)
    t._refresh_pointer()
    after = json.loads((root / "canary.json").read_bytes())
    assert after["time"] > before["time"] and after["started"] == before["started"]
    assert {k: v for k, v in after.items() if k != "time"} == {k: v for k, v in before.items() if k != "time"}


def test_a_rollback_needs_nothing_of_the_base_and_signs_nothing_new(tmp_path, setup, monkeypatch):
    """A rollback republished the base's weights as a new version: one whose weights failed their
    sha256 kept every look retrying. It now only stops the canary (signed canary-ended.json,
    canary.json removed) and leaves latest.json on the base; a kill -9 after the decision was
    taken is carried out by the resumed trainer the same way."""
    root = tmp_path / "ckpt" / "policies"
    t = _trainer(tmp_path, setup.keys_dir, monkeypatch, resume=False, **CANARY_KW)
    t.iteration = 3
    t.checkpoint()
    _serve(setup.committer, t.canary, {1: 2.0, 0: 0.0}, 300, seed=1)
    assert t.look_canary()["decision"] == "promote"
    t.iteration = 6
    t.checkpoint()  # canary v2 above v1
    p = load_policy(str(root), public_key=setup.pub, canary_fraction=0.5)
    eid = next(f"e{i}" for i in range(100) if in_canary(f"e{i}", 0.5))
    assert p.for_episode(eid).policy_version == 2
    weights = {f: f.read_bytes() for f in (root / "v000001").iterdir() if f.suffix not in (".json", ".sig")}
    for f, data in weights.items():
        f.write_bytes(data + b"x")  # the base's weights no longer match its policy.json
    _serve(setup.committer, t.canary, {2: -3.0, 1: 0.0}, 300, seed=2)
    t._canary_decision = t.canary.decision_record(t.canary.look(t.input, t.cfg.policy_id), time.time())
    t.iteration = 7
    t.checkpoint()  # the decision is in the checkpoint; killed before it was carried out
    r = _resumed(tmp_path, setup, monkeypatch)
    assert r.canary is not None and r._canary_decision["decision"] == "rollback"
    r.metrics = SimpleNamespace(truncate_after=lambda _i: None, write=lambda _r: None)
    _rolled_back_onto(root, r.look_canary(), 1)
    assert r.canary is None and not (root / "canary.json").exists()
    assert json.loads((root / "latest.json").read_bytes())["policy_version"] == 1
    p.poll()
    assert p.for_episode(eid).policy_version == 1  # the worse canary is no longer served
