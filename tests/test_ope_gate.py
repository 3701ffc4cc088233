"""`rlrec train --promotion-gate ope` without a simulator: on logged episodes of a short-horizon
task (a stochastic behaviour policy recording its propensities), the gate promotes a candidate
that is truly better than the deployed version and refuses one that is truly worse, the truth
being Monte-Carlo returns in the simulator (used only by the test). The trainer's gate runs
as in `ContinuousTrainer.checkpoint`; the RLlib export of the candidate is replaced by
hand-built linear policies (no Ray)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest

from rlrec.store.commit import ShardCommitter
from rlrec.trainer.config import OPESettings, TrainerConfig
from rlrec.trainer.export import PolicyArtifact
from rlrec.trainer.promotion import evaluate_exported
from rlrec.trainer.synthetic import CONTEXT_BANDIT_ID, linear_policy_artifact, logged_episodes

GAMMA = 0.9
E = np.eye(3, 4, dtype=np.float32)
POLICIES = {
    "good": 4.0 * E,  # greedy: the best action
    "partial": 4.0 * np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]], np.float32),  # ignores x[2]
    "bad": -4.0 * E,  # greedy: the worst action
}


def _artifact(name: str) -> tuple[PolicyArtifact, dict, bytes]:
    spec, model = linear_policy_artifact(POLICIES[name])
    art = PolicyArtifact(
        "safetensors",
        {"model.safetensors": model},
        {k: spec[k] for k in ("format", "model", "action_dist", "network")},
    )
    return art, spec, model


def _truth(name: str) -> float:
    _, spec, model = _artifact(name)
    return evaluate_exported(model, spec, CONTEXT_BANDIT_ID, 1000, seed=123, gamma=GAMMA)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny networks: more threads only contend on a shared machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def logged(tmp_path_factory, one_torch_thread):
    out = str(tmp_path_factory.mktemp("ope") / "out")
    spec, model = linear_policy_artifact(1.0 * E)  # the behaviour: a soft, mildly good policy
    committer = ShardCommitter(out)
    returns = []
    for k in range(3):
        eps, g = logged_episodes(CONTEXT_BANDIT_ID, spec, model, 400, seed=k, policy_version=0)
        committer.commit(eps)
        returns.append(g)
    return out, float(np.concatenate(returns).mean())


def _gate_runner(out: str, tmp_path, monkeypatch, estimator: str = "wdr", **ope):
    """A trainer whose ope gate runs as in `ContinuousTrainer.checkpoint` on the shards under
    `out`, and ``gate(name)``: the decision on candidate `name` (published when promoted)."""
    from rlrec.trainer import promotion
    from rlrec.trainer.service import ContinuousTrainer

    cfg = TrainerConfig(
        input=out,
        checkpoint_dir=str(tmp_path / "ck"),
        promotion_gate="ope",
        promotion_estimator=estimator,
        seed=0,
        ope=OPESettings(holdout_fraction=0.3, fqe_steps=600, ope_bootstrap=200, **ope),
    )
    trainer = ContinuousTrainer(cfg)
    env = gym.make(CONTEXT_BANDIT_ID)
    trainer.obs_space, trainer.act_space = env.observation_space, env.action_space
    # save_to_path: a stand-in algorithm's empty checkpoint (a promoted version is published at the commit)
    trainer.algo = SimpleNamespace(config=SimpleNamespace(gamma=GAMMA), save_to_path=lambda path: None)
    # shard "sN" stands for entry N of log rl/0, whose first entry is known (the lineage's cursor)
    trainer.algo.offline_data = SimpleNamespace(seqs=lambda k: (("rl", 0), (int(k[1:]),)))
    trainer._log_firsts[("rl", 0)] = "ClaimEntry:0:stub:0"
    candidate = {}
    monkeypatch.setattr(promotion, "export_candidate", lambda *a: candidate["artifact"])

    def gate(name: str) -> dict:
        candidate["artifact"] = _artifact(name)[0]
        trainer.last_promotion = None
        before = trainer.policy_version
        trainer.publish()  # starts the evaluation in the background
        assert trainer.policy_version == before and trainer.last_promotion is None
        d = trainer.collect_evaluation(None)
        assert d is trainer.last_promotion and d["candidate_version"] == before + 1
        trainer._commit()  # what train_once does in the iteration the decision arrives
        return d

    return trainer, gate


def test_ope_gate_promotes_better_and_refuses_worse(logged, tmp_path, monkeypatch):
    out, behaviour_value = logged
    truth = {name: _truth(name) for name in POLICIES}
    assert truth["good"] > truth["partial"] > behaviour_value + 0.3 and truth["bad"] < behaviour_value

    trainer, gate = _gate_runner(out, tmp_path, monkeypatch)

    first = gate("partial")  # against the logged behaviour (nothing deployed yet)
    assert first["promoted"] and first["deployed_is_behavior"] and trainer.policy_version == 1
    assert first["deployed_return"] == pytest.approx(first["data"]["behavior_mean_return"], abs=0.2)
    worse = gate("bad")
    assert not worse["promoted"] and worse["estimable"] and worse["ci_high"] < 0 and trainer.policy_version == 1
    better = gate("good")
    assert better["promoted"] and better["ci_low"] > 0 and trainer.policy_version == 2
    # the estimates are close to the truth (Monte Carlo), and the intervals hold it
    # (the bad candidate takes the action the behaviour takes least: few episodes carry its
    # weights, so its estimate is the loosest)
    for d, cand, dep, tol in ((worse, "bad", "partial", 0.6), (better, "good", "partial", 0.25)):
        assert d["candidate_return"] == pytest.approx(truth[cand], abs=tol)
        assert d["deployed_return"] == pytest.approx(truth[dep], abs=0.25)
        assert d["difference"] == pytest.approx(truth[cand] - truth[dep], abs=tol + 0.1)
        assert d["data"]["episodes"] > 250 and d["diagnostics"]["candidate"]["coverage"] == 1.0
        assert d["diagnostics"]["candidate"]["support"] == 0.0  # exact: the behaviour's logits are recorded
    # the decision is in the published (signed) policy.json
    spec = json.loads((tmp_path / "ck" / "policies" / "v000002" / "policy.json").read_text())
    assert spec["promotion"]["promoted"] and spec["promotion"]["estimator"] == "wdr" and spec["gamma"] == GAMMA
    assert spec["promotion"]["ci_low"] == better["ci_low"]
    # the decision names its own data: the held-out episodes of the shards at its cursor
    import rlrec
    from rlrec.trainer.lineage import HoldoutSplit

    held = rlrec.open(out, as_of=better["data"]["cursor"]).subset(keep_episode=HoldoutSplit(0.3, held_out=True))
    assert held.num_episodes == better["data"]["episodes"] > 250


def test_promotion_gate_option_values():
    import argparse

    from rlrec.commands.train import OPTIONS

    p = argparse.ArgumentParser()
    OPTIONS.add_arguments(p)
    for argv, env, want in (
        (["--promotion-gate"], {}, "env"),
        (["--promotion-gate", "ope"], {}, "ope"),
        ([], {"RLREC_PROMOTION_GATE": "1"}, "env"),
        ([], {"RLREC_PROMOTION_GATE": "ope"}, "ope"),
        ([], {}, None),
        ([], {"RLREC_PROMOTION_GATE": "off"}, "off"),
    ):
        opts = OPTIONS.resolve(p.parse_args(["--input", "x", "--checkpoint-dir", "y", *argv]), environ=env)
        assert opts["promotion_gate"] == want, argv
    with pytest.raises(ValueError, match="needs --env"):
        TrainerConfig(input="x", checkpoint_dir="y", promotion_gate="env")
    assert TrainerConfig(input="x", checkpoint_dir="y", promotion_gate=True, env="CartPole-v1").promotion_gate == "env"
    assert TrainerConfig(input="x", checkpoint_dir="y", promotion_gate="ope").gate
    # without --promotion-gate: env with --env, else ope with the canary; off keeps every checkpoint
    cfg = TrainerConfig(input="x", checkpoint_dir="y")
    assert (cfg.promotion_gate, cfg.rollout) == ("ope", "canary") and "default without --env" in cfg.gate_default
    cfg = TrainerConfig(input="x", checkpoint_dir="y", env="CartPole-v1")
    assert (cfg.promotion_gate, cfg.rollout) == ("env", "direct")
    assert (TrainerConfig(input="x", checkpoint_dir="y", promotion_gate="ope").rollout) == "direct"
    cfg = TrainerConfig(input="x", checkpoint_dir="y", promotion_gate="off")
    assert (cfg.promotion_gate, cfg.rollout, cfg.gate_default) == ("off", "direct", None)
    assert TrainerConfig(input="x", checkpoint_dir="y", publish=False).promotion_gate == "off"
    with pytest.raises(ValueError, match=r"no promotion gate can judge candidates without --env"):
        TrainerConfig(input="x", checkpoint_dir="y", ope=OPESettings(holdout_fraction=0.0))


def _without_phases(stderr: str) -> list[str]:
    """stderr's lines without the phase lines (``rlrec evaluate: loading ...``) said before an error."""
    lines = stderr.strip().splitlines()
    return [x for x in lines if not (x.startswith("rlrec evaluate: ") and not x.startswith("rlrec evaluate: error: "))]


def test_evaluate_command_json_contract(logged, tmp_path, capsys):
    from rlrec.cli import main
    from rlrec.store.storage import Storage
    from rlrec.trainer.export import publish_policy

    out, behaviour_value = logged
    pub = tmp_path / "policies"
    for version, name in ((1, "partial"), (2, "good")):
        art, _, _ = _artifact(name)
        publish_policy(
            Storage.from_uri(str(pub)),
            algo=None,
            version=version,
            algo_name="BC",
            observation_space=gym.spaces.Box(-1.0, 1.0, (4,), np.float32),
            action_space=gym.spaces.Discrete(3),
            iteration=version,
            timesteps_trained=0,
            shards=[],
            new_shards=[],
            parent_version=None,
            artifact=art,
            metadata={"gamma": GAMMA},
        )
    args = ["evaluate", "--input", out, "--policies", str(pub), "--allow-unsigned", "--holdout-fraction", "0.3"]
    assert main([*args, "--json", "--version", "1", "--estimators", "wis,wpdis", "--ope-bootstrap", "100"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"version", "gamma", "episodes", "steps", "behavior", "estimates", "diagnostics"}
    assert doc["version"] == 1 and doc["gamma"] == GAMMA and doc["behavior"]["versions"] == [0]
    assert doc["behavior"]["mean_return"] == pytest.approx(behaviour_value, abs=0.2)
    assert set(doc["diagnostics"]) >= {"coverage", "ess", "max_weight", "support"}
    assert list(doc["estimates"]) == ["wis", "wpdis"]
    for e in doc["estimates"].values():
        assert set(e) == {"value", "ci_low", "ci_high", "estimable", "reason", "gate"} and e["estimable"]
        assert e["gate"]["ok"] and e["gate"]["reason"] == ""  # 3 steps: the weights hold at every step
        assert e["value"] == pytest.approx(_truth("partial"), abs=0.25)
        assert e["ci_low"] <= e["value"] <= e["ci_high"]
    # mb: the ensemble's refits and the state-coverage verdict are reported
    mb = [*args, "--json", "--version", "1", "--estimators", "mb", "--mb-members", "2", "--mb-steps", "200"]
    assert main([*mb, "--ope-bootstrap", "50"]) == 0
    doc = json.loads(capsys.readouterr().out)
    e = doc["estimates"]["mb"]
    assert e["estimable"] and e["ci_low"] <= e["value"] <= e["ci_high"] and "offdata_share" in e["gate"]
    assert doc["diagnostics"]["mb"]["refits"] == 2 and doc["diagnostics"]["mb"]["starts"] == min(256, doc["episodes"])
    # latest, default estimators (wdr first), only behaviour version 7: none
    assert main([*args, "--behavior-version", "7"]) == 2
    err = _without_phases(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("rlrec evaluate: error: no held-out episodes")
    for bad in (["--estimators", "dr"], ["--version", "x"], ["--holdout-fraction", "1.5"]):
        assert main([*args, *bad]) == 2, bad
        err = _without_phases(capsys.readouterr().err)
        assert len(err) == 1 and err[0].startswith("rlrec evaluate: error: "), err


@pytest.mark.slow
def test_rlrec_train_promotion_gate_ope_closed_loop_without_a_simulator(tmp_path):
    """BC on the logged episodes, no --env: the greedy BC candidate picks the best action, truly
    better than the soft behaviour, and the ope gate publishes it; the decision is in metrics.jsonl
    and in the published policy.json."""
    import os
    import subprocess
    import sys

    out = str(tmp_path / "data")
    spec, model = linear_policy_artifact(1.0 * E)
    committer = ShardCommitter(out)
    for k in range(2):
        committer.commit(logged_episodes(CONTEXT_BANDIT_ID, spec, model, 300, seed=k, policy_version=0)[0])
    ck = tmp_path / "ck"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLREC_")}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    args = ["--input", out, "--checkpoint-dir", str(ck), "--algo", "BC", "--promotion-gate", "ope"]
    args += ["--holdout-fraction", "0.3", "--checkpoint-interval", "2", "--max-iterations", "2", "--num-cpus", "2"]
    args += ["--fqe-steps", "300", "--algo-config", "gamma=0.9"]
    r = subprocess.run(
        [sys.executable, "-m", "rlrec", "train", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in (ck / "metrics.jsonl").read_text().splitlines()]
    decision = next(x["promotion"] for x in lines if "promotion" in x)
    assert decision["gate"] == "ope" and decision["deployed_is_behavior"] and decision["promoted"], decision
    assert decision["candidate_return"] == pytest.approx(_truth("good"), abs=0.25)
    published = json.loads((ck / "policies" / "v000001" / "policy.json").read_text())
    assert published["promotion"] == decision and published["gamma"] == 0.9


def test_report_plots_ope_estimates_beside_the_truth():
    from rlrec.report import plot_eval
    from rlrec.report_data import ReportData

    data = ReportData()
    est = {"value": 1.2, "ci_low": 1.0, "ci_high": 1.4, "estimable": True, "reason": ""}
    data.trainer = [
        {"iteration": 2, "time": 100.0, "policy_version": 1},
        {
            "iteration": 4,
            "time": 110.0,
            "policy_version": 1,
            "promotion": {"gate": "ope", "promoted": True, "candidate_return": 1.2, "candidate_estimate": est},
        },
        {
            "iteration": 6,
            "time": 120.0,
            "policy_version": 2,
            "promotion": {"gate": "ope", "promoted": False, "candidate_return": None, "true_return": 0.4},
        },
    ]
    assert plot_eval(data) is not None  # no eval_return_mean: the OPE decisions alone make the plot


def test_greedy_behaviour_logs_propensity_one_and_is_not_estimable_by_importance_weights(tmp_path, capsys):
    """Policy.act(explore=False) logs action_logp 0.0 (a deterministic choice); `rlrec evaluate` on
    such data reports the importance-weighted estimators "not estimable", with a reason."""
    import torch

    from rlrec.cli import main
    from rlrec.store.storage import Storage
    from rlrec.trainer.export import publish_policy
    from rlrec.trainer.policy import version_from_artifact

    spec, model = linear_policy_artifact(1.0 * E)
    version = version_from_artifact(spec, model)
    obs = np.array([0.3, -0.2, 0.9, 0.0], np.float32)
    _, greedy = version.act(obs, False, torch.Generator().manual_seed(0))
    _, sampled = version.act(obs, True, torch.Generator().manual_seed(0))
    assert greedy["action_logp"] == 0.0 and sampled["action_logp"] < 0.0
    out = str(tmp_path / "data")
    ShardCommitter(out).commit(
        logged_episodes(CONTEXT_BANDIT_ID, spec, model, 300, seed=0, policy_version=0, explore=False)[0]
    )
    pub = tmp_path / "policies"
    publish_policy(
        Storage.from_uri(str(pub)),
        algo=None,
        version=1,
        algo_name="BC",
        observation_space=gym.spaces.Box(-1.0, 1.0, (4,), np.float32),
        action_space=gym.spaces.Discrete(3),
        iteration=1,
        timesteps_trained=0,
        shards=[],
        new_shards=[],
        parent_version=None,
        artifact=_artifact("partial")[0],
        metadata={"gamma": GAMMA},
    )
    args = ["evaluate", "--input", out, "--policies", str(pub), "--allow-unsigned", "--holdout-fraction", "0.5"]
    assert main([*args, "--json", "--estimators", "wis,wpdis,wdr", "--ope-bootstrap", "50", "--fqe-steps", "50"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["diagnostics"]["coverage"] == 1.0 and doc["diagnostics"]["behavior_deterministic_share"] == 1.0
    for name in ("wis", "wpdis", "wdr"):
        e = doc["estimates"][name]
        assert not e["estimable"] and e["value"] is None and e["reason"], (name, e)


def _stub_trainer(tmp_path, monkeypatch, **kw):
    from rlrec.trainer import promotion
    from rlrec.trainer.service import ContinuousTrainer

    cfg = TrainerConfig(
        input=str(tmp_path / "in"), checkpoint_dir=str(tmp_path / "ck"), promotion_gate="ope", seed=0, **kw
    )
    trainer = ContinuousTrainer(cfg)
    env = gym.make(CONTEXT_BANDIT_ID)
    trainer.obs_space, trainer.act_space = env.observation_space, env.action_space
    # save_to_path: a stand-in algorithm's empty checkpoint (a promoted version is published at the commit)
    trainer.algo = SimpleNamespace(config=SimpleNamespace(gamma=GAMMA), save_to_path=lambda path: None)
    # shard "sN" stands for entry N of log rl/0, whose first entry is known (the lineage's cursor)
    trainer.algo.offline_data = SimpleNamespace(seqs=lambda k: (("rl", 0), (int(k[1:]),)))
    trainer._log_firsts[("rl", 0)] = "ClaimEntry:0:stub:0"
    monkeypatch.setattr(promotion, "export_candidate", lambda *a: _artifact("good")[0])
    return trainer


def test_ope_gate_evaluates_off_the_training_thread_and_applies_the_decision_later(tmp_path, monkeypatch, caplog):
    """publish() only starts the evaluation; a checkpoint meanwhile starts none; the decision is
    applied (published with the lineage of the iteration the candidate was exported at) when it
    is collected, and written to that iteration's metrics line."""
    import logging
    import threading

    from rlrec.trainer import ope_jobs

    release = threading.Event()
    calls = []

    def slow(job, **kw):
        calls.append(job.version)
        assert release.wait(30)
        return {"gate": "ope", "candidate_version": job.version, "candidate_return": 1.0, "promoted": True}

    monkeypatch.setattr(ope_jobs, "evaluate_candidate", slow)
    trainer = _stub_trainer(tmp_path, monkeypatch)
    trainer.iteration, trainer.trained, trainer.since_publish = 3, {"s1", "s2"}, {"s2"}
    trainer._note_trained({"s1", "s2"})  # what train_once does with the shards it trained
    trainer.publish()
    trainer.iteration, trainer.trained, trainer.since_publish = 6, {"s1", "s2", "s3"}, {"s2", "s3"}
    trainer._note_trained({"s3"})
    with caplog.at_level(logging.INFO, logger="rlrec.trainer"):
        trainer.publish()  # the first evaluation still runs: this candidate is not evaluated
    assert "still running" in caplog.text and calls == [1]
    assert trainer.collect_evaluation(0.05) is None and trainer.policy_version == 0
    release.set()
    d = trainer.collect_evaluation(60)
    assert d["promoted"] and trainer.policy_version == 1 and trainer.last_promotion is d
    assert trainer.since_publish == {"s3"}  # trained on after the candidate was exported
    assert not (tmp_path / "ck" / "policies" / "v000001").exists()  # written once a checkpoint commits it
    trainer._commit()  # what train_once does in the iteration the decision arrives
    lineage = json.loads((tmp_path / "ck" / "policies" / "v000001" / "lineage.json").read_text())
    assert lineage["iteration"] == 3 and lineage["new_shards"] == ["s2"]
    assert lineage["cursor"].endswith("~rl:0=3")  # the point holding s1 and s2, not s3 (trained later)
    spec = json.loads((tmp_path / "ck" / "policies" / "v000001" / "policy.json").read_text())
    assert spec["promotion"] == d and spec["gamma"] == GAMMA
    assert trainer.collect_evaluation(0) is None  # applied once
    # a restart from a checkpoint saved before that publication continues after it
    assert trainer._next_version() == 2


def test_a_stop_waits_a_bounded_time_for_the_evaluation_then_drops_it(tmp_path, monkeypatch, caplog):
    import logging
    import threading

    from rlrec.trainer import ope_jobs
    from rlrec.trainer.metrics import TrainerMetrics

    release = threading.Event()

    def slow(job, **kw):
        release.wait(30)
        return {"gate": "ope", "candidate_version": job.version, "candidate_return": 1.0, "promoted": False}

    monkeypatch.setattr(ope_jobs, "evaluate_candidate", slow)
    trainer = _stub_trainer(tmp_path, monkeypatch, evaluation_wait_s=0.2)
    trainer.metrics = TrainerMetrics(trainer.out, None, False, "127.0.0.1")
    trainer.metrics.truncate_after(None)  # as setup() does: the file exists
    trainer.last_record = {"iteration": 5, "timesteps_trained": 50, "shards_total": 1, "shards_new": 1}
    trainer.publish()
    with caplog.at_level(logging.INFO, logger="rlrec.trainer"):
        trainer._finish_evaluation_at_stop()
    assert "dropped the off-policy evaluation of candidate v1" in caplog.text
    assert trainer._job is None and trainer.policy_version == 0
    release.set()
    # finished within the wait: applied and recorded in a late metrics line
    trainer.cfg.evaluation_wait_s = 60
    trainer.publish()
    trainer._finish_evaluation_at_stop()
    trainer.metrics.close()
    (line,) = [json.loads(x) for x in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()]
    assert line["late"] and line["iteration"] == 5 and line["promotion"]["candidate_version"] == 1


def test_ope_report_estimates_each_candidate_beside_the_truth_without_gating(logged, tmp_path, monkeypatch):
    from rlrec.trainer import promotion
    from rlrec.trainer.service import ContinuousTrainer

    out, _ = logged
    cfg = TrainerConfig(
        input=out,
        checkpoint_dir=str(tmp_path / "ck"),
        env=CONTEXT_BANDIT_ID,
        promotion_gate="off",
        ope_report=True,
        promotion_episodes=500,
        seed=0,
        ope=OPESettings(holdout_fraction=0.3, fqe_steps=600, ope_bootstrap=200),
    )
    trainer = ContinuousTrainer(cfg)
    env = gym.make(CONTEXT_BANDIT_ID)
    trainer.obs_space, trainer.act_space = env.observation_space, env.action_space
    trainer.algo = SimpleNamespace(config=SimpleNamespace(gamma=GAMMA))
    monkeypatch.setattr(promotion, "export_candidate", lambda *a: _artifact("good")[0])
    trainer.publish()
    assert trainer.policy_version == 1  # no gate: published at once, the estimate runs beside
    d = trainer.collect_evaluation(None)
    assert "gate" not in d and "promoted" not in d and d["candidate_version"] == 1 and d["estimator"] == "wdr"
    truth = _truth("good")
    assert d["estimable"] and d["candidate_return"] == pytest.approx(truth, abs=0.25)
    assert d["candidate_estimate"]["ci_low"] <= d["candidate_return"] <= d["candidate_estimate"]["ci_high"]
    assert d["true_return"] == pytest.approx(truth, abs=0.15) and d["data"]["episodes"] > 250
    assert trainer.policy_version == 1 and trainer.last_promotion is None
    trainer.publish(final=True)  # the stop's checkpoint: no estimate started (publishing needs a real algo here)
    assert trainer._job is None
    with pytest.raises(ValueError, match="--ope-report needs held-out episodes"):
        TrainerConfig(
            input=out, checkpoint_dir="c", promotion_gate="off", ope_report=True, ope=OPESettings(holdout_fraction=0.0)
        )


def test_evaluate_reproduces_a_gate_decision_exactly_from_its_cursor(logged, tmp_path, monkeypatch, capsys):
    """`rlrec evaluate --as-of CURSOR --compare-to N` asks the gate's question on the data of a
    decision: the same numbers, to the last bit, although more episodes landed since."""
    import shutil

    from rlrec.cli import main

    out = str(tmp_path / "store")
    shutil.copytree(logged[0], out)
    trainer, gate = _gate_runner(out, tmp_path, monkeypatch, "auto")  # the default
    assert gate("partial")["promoted"]  # v1, against the behaviour
    d = gate("good")
    assert d["promoted"] and trainer.policy_version == 2 and d["gate_verdict"]["ok"] and d["seed"] == 0
    # auto: wdr's verdict holds on 3 steps, so no fallback to mb
    assert d["estimator"] == "wdr" and d["estimator_setting"] == "auto" and "fallback_from" not in d
    # more data lands after the decision
    spec, model = linear_policy_artifact(1.0 * E)
    ShardCommitter(out).commit(logged_episodes(CONTEXT_BANDIT_ID, spec, model, 400, seed=9, policy_version=0)[0])
    args = [
        "evaluate", "--input", out, "--policies", str(tmp_path / "ck" / "policies"), "--allow-unsigned",
        "--holdout-fraction", "0.3", "--fqe-steps", "600", "--ope-bootstrap", "200", "--seed", "0",
        "--version", "2", "--compare-to", "1", "--estimators", "wdr", "--json",
    ]  # fmt: skip
    assert main([*args, "--as-of", d["data"]["cursor"]]) == 0
    doc = json.loads(capsys.readouterr().out)
    c = doc["comparison"]
    assert doc["data"]["cursor"] == d["data"]["cursor"] and doc["episodes"] == d["data"]["episodes"]
    for key in ("difference", "ci_low", "ci_high", "estimable"):
        assert c[key] == d[key], key
    assert c["gate"] == d["gate_verdict"] and c["paired"] == d["paired"] and d["paired"]["t_star"] is None
    assert c["candidate_estimate"] == d["candidate_estimate"] and c["deployed_estimate"] == d["deployed_estimate"]
    assert doc["estimates"]["wdr"] == d["candidate_estimate"]
    # the newest point holds the new episodes: other numbers
    assert main(args) == 0
    now = json.loads(capsys.readouterr().out)
    assert now["episodes"] > doc["episodes"] and now["comparison"]["difference"] != c["difference"]
    # the human-readable form says the same
    assert main([a for a in args if a != "--json"] + ["--as-of", d["data"]["cursor"]]) == 0
    text = capsys.readouterr().out
    assert f"v2 - 1 (wdr): {c['difference']:.4f}" in text and "gate verdict: ok" in text
    assert f"cursor: {d['data']['cursor']}" in text
    # a cursor that is no cursor is a user's mistake
    assert main([*args, "--as-of", "nonsense"]) == 2
    err = _without_phases(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("rlrec evaluate: error: --as-of")


def _foreign_episodes(n: int) -> list:
    """Episodes of the contextual task recorded under other spaces than the trainer's
    (Box(4,) observations, Discrete(3) actions): half declare Discrete(4) and take action 3 at
    their first step (with 4-wide logits), half declare Box(5,) and observe 5 values."""
    import dataclasses

    spec, model = linear_policy_artifact(1.0 * E)
    eps, _ = logged_episodes(CONTEXT_BANDIT_ID, spec, model, n, seed=77, policy_version=0)
    out = []
    for i, ep in enumerate(eps):
        if i % 2 == 0:
            actions = ep.actions[0].copy()
            actions[0] = 3
            inputs = ep.extra_model_outputs["action_dist_inputs"]
            wide = np.concatenate([inputs, np.zeros((len(inputs), 1), np.float32)], axis=1)
            out.append(
                dataclasses.replace(
                    ep,
                    episode_id=f"foreign-actions-{i}",
                    action_space=gym.spaces.Discrete(4),
                    actions=[actions],
                    extra_model_outputs={**ep.extra_model_outputs, "action_dist_inputs": wide},
                )
            )
        else:
            obs = ep.observations[0]
            out.append(
                dataclasses.replace(
                    ep,
                    episode_id=f"foreign-obs-{i}",
                    observation_space=gym.spaces.Box(-np.inf, np.inf, (5,), np.float32),
                    observations=[np.concatenate([obs, np.zeros((len(obs), 1), obs.dtype)], axis=1)],
                )
            )
    return out


def test_the_gate_and_evaluate_leave_out_the_same_episodes_recorded_under_other_spaces(
    logged, tmp_path, monkeypatch, capsys
):
    """The store holds held-out episodes recorded under other spaces than the policies' (another
    action space and an action outside the policies', another observation shape). The gate and
    `rlrec evaluate --as-of CURSOR --compare-to N` check every episode against the judged
    policy's spaces (its policy.json), so both leave the same episodes out, for the same stated
    reasons, and their numbers are equal."""
    import shutil

    from rlrec.cli import main
    from rlrec.trainer.holdout import is_held_out

    out = str(tmp_path / "store")
    shutil.copytree(logged[0], out)
    foreign = _foreign_episodes(80)
    ShardCommitter(out).commit(foreign)
    held = [e for e in foreign if is_held_out(e.episode_id, 0.3)]
    held_actions = sum(e.episode_id.startswith("foreign-actions-") for e in held)
    assert held_actions >= 3 and len(held) - held_actions >= 3
    _trainer, gate = _gate_runner(out, tmp_path, monkeypatch, "wdr")
    assert gate("partial")["promoted"]  # v1
    d = gate("good")
    assert d["promoted"] and d["candidate_version"] == 2
    reasons = d["data"]["unusable_reasons"]
    assert d["data"]["episodes_unusable"] == len(held) == sum(reasons.values())
    assert reasons == {
        "actions holds 3, outside Discrete(3)": held_actions,
        "observations has shape [4, 5], the space needs [4, 4]": len(held) - held_actions,
    }
    args = [
        "evaluate", "--input", out, "--policies", str(tmp_path / "ck" / "policies"), "--allow-unsigned",
        "--holdout-fraction", "0.3", "--fqe-steps", "600", "--ope-bootstrap", "200", "--seed", "0",
        "--version", "2", "--compare-to", "1", "--estimators", "wdr", "--as-of", d["data"]["cursor"],
    ]  # fmt: skip
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["data"]["cursor"] == d["data"]["cursor"] and doc["episodes"] == d["data"]["episodes"]
    assert doc["data"]["episodes_unusable"] == d["data"]["episodes_unusable"]
    assert doc["data"]["unusable_reasons"] == reasons
    c = doc["comparison"]
    for key in ("difference", "ci_low", "ci_high", "estimable"):
        assert c[key] == d[key], key
    assert c["candidate_estimate"] == d["candidate_estimate"] and c["deployed_estimate"] == d["deployed_estimate"]
    # the human-readable form states the reasons too
    assert main(args) == 0
    text = capsys.readouterr().out
    assert (
        f"{len(held):,} episode(s) left out as unusable: {held_actions:,} actions holds 3, outside Discrete(3)" in text
    )


def test_the_gate_decides_with_mb_and_states_its_refits(logged, tmp_path, monkeypatch):
    """--promotion-estimator mb through the trainer's gate: the decision names the ensemble's
    refits and their wall time, and a truly worse candidate is not published."""
    _trainer, gate = _gate_runner(logged[0], tmp_path, monkeypatch, "mb", mb_members=2, mb_steps=300)
    first = gate("partial")
    assert first["estimator"] == "mb" and first["deployed_is_behavior"]
    mb = first["diagnostics"]["candidate"]["mb"]
    assert mb["refits"] == 2 and mb["fit_seconds"] > 0 and mb["rollout_seconds"] > 0
    assert "offdata_share" in first["candidate_estimate"]["gate"] and first["gate_verdict"] is not None
    assert first["promoted"] or first["reason"]
    bad = gate("bad")
    # refused by the decision itself, not by a failed evaluation ("evaluation failed: ...")
    assert not bad["promoted"] and bad["estimator"] == "mb"
    assert bad["reason"].startswith(("lower bound ", "not usable for gating: ")), bad["reason"]
    assert bad["refusal"]["code"] in ("unproven", "worse", "unjudgeable"), bad["refusal"]
    assert bad["difference"] is not None and bad["difference"] < 0 and bad["ci_low"] < 0


def test_a_torn_read_gives_the_gate_and_evaluate_the_same_episodes(logged):
    """The gate's long-lived reader and `rlrec evaluate`'s fresh one read the same episodes at
    the same point after a read that failed its checksum: a shard that fails once is read again
    at once; one that fails through a whole refresh is skipped in that refresh only, not for good
    (it was remembered as bad, so the gate kept leaving it out while evaluate read it)."""
    from rlrec.store.snapshot import open_snapshot
    from rlrec.store.storage import Storage
    from rlrec.trainer.ope_data import HeldOutReader

    out = logged[0]
    cursor = open_snapshot(Storage.from_uri(out)).cursor
    victim = open_snapshot(Storage.from_uri(out)).entries[1].path
    torn = {"left": 0}

    def reader() -> HeldOutReader:
        storage = Storage.from_uri(out)
        read = storage.read

        def tearing(path, *a, **kw):
            data = read(path, *a, **kw)
            if path == victim and torn["left"] > 0:
                torn["left"] -= 1
                return data[: len(data) // 2]  # a torn read: the checksum fails
            return data

        storage.read = tearing
        return HeldOutReader(storage, 0.3)

    def ids(episodes) -> list[str]:
        return sorted(e.id for e in episodes)

    expected = ids(reader().refresh(as_of=cursor))
    assert len(expected) > 100
    torn["left"] = 1  # one torn read: read again at once, nothing left out
    gate = reader()
    assert ids(gate.refresh(as_of=cursor)) == expected and gate.stats.shards_skipped == []
    torn["left"] = 2  # torn twice in a row: skipped in this refresh, and said so
    gate = reader()
    first = gate.refresh(as_of=cursor)
    assert len(first) < len(expected) and [p for p, _ in gate.stats.shards_skipped] == [victim]
    # the next refresh reads it again, as a fresh reader (evaluate's) does at the same point
    assert ids(gate.refresh(as_of=cursor)) == expected == ids(reader().refresh(as_of=cursor))
    assert gate.stats.shards_skipped == [] and gate.cursor == cursor


@pytest.mark.timeout(900)  # two gate decisions and an evaluate, each fitting FQE
def test_evaluate_reproduces_a_refusal_from_the_refused_candidate_it_kept(logged, tmp_path, monkeypatch, capsys):
    """A refused candidate is kept under candidates/ of the publish root (never served, never a
    version, pinning nothing) and `rlrec evaluate --candidate DIR --version N --compare-to M
    --as-of CURSOR` gives the refusal's numbers exactly (evaluate loaded published versions only)."""
    import shutil

    from rlrec.cli import main
    from rlrec.commands.evaluate import published_versions
    from rlrec.trainer.policy import read_latest

    out = str(tmp_path / "store")
    shutil.copytree(logged[0], out)
    trainer, gate = _gate_runner(out, tmp_path, monkeypatch, "wdr")
    assert gate("partial")["promoted"]  # v1
    d = gate("bad")
    assert not d["promoted"] and d["refusal"]["code"] in ("worse", "unproven", "unjudgeable"), d
    assert d["estimable"] and d["difference"] < 0
    kept = d["refused_candidate"]
    assert kept["version"] == 2 and kept["dir"].startswith("candidates/")
    policies = str(tmp_path / "ck" / "policies")
    # not a version: the pointer, the numbering and retention's pins see v1 only
    assert published_versions(policies) == [1] and read_latest(policies)["policy_version"] == 1
    assert trainer._next_version() == 2
    args = [
        "evaluate", "--input", out, "--policies", policies, "--allow-unsigned",
        "--holdout-fraction", "0.3", "--fqe-steps", "600", "--ope-bootstrap", "200", "--seed", "0",
        "--compare-to", "1", "--estimators", d["estimator"], "--json", "--as-of", d["data"]["cursor"],
    ]  # fmt: skip
    # published versions only without --candidate: v2 does not exist
    assert main([*args, "--version", "2"]) == 2
    assert "no such version" in capsys.readouterr().err
    assert main([*args, "--candidate", kept["dir"], "--version", str(kept["version"])]) == 0
    c = json.loads(capsys.readouterr().out)["comparison"]
    for key in ("difference", "ci_low", "ci_high", "estimable"):
        assert c[key] == d[key], key
    assert c["gate"] == d["gate_verdict"] and c["candidate_estimate"] == d["candidate_estimate"]
    # a --candidate that is not a refused candidate's folder is a user's mistake, in one line
    assert main([*args, "--candidate", "../../etc", "--version", "2"]) == 2
    err = _without_phases(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("rlrec evaluate: error: --candidate"), err
