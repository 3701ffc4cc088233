"""``rlrec train --multi-agent --env``: the env gate plays a multi-module candidate in a
multi-agent env (PettingZoo simple_spread through RLlib's wrapper), each agent by its stored
module; the return is the sum over agents (and per module); the decision is the single-agent
gate's rule. A wrong spec, an agent the stored mapping does not know and spaces that are not
the modules' are refused in one line, before training."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

pytest.importorskip("mpe2")

from rlrec.trainer.config import TrainerConfig
from rlrec.trainer.multi_agent_env import (
    EnvSpecError,
    check_env_modules,
    evaluate_modules,
    make_env,
    parse_env,
)
from tests.helpers import read_metrics, wait_for
from tests.multi_agent_stores import MODULES, commit_spread, script
from tests.test_multi_agent_trainer import cfg

SPREAD = "pettingzoo:mpe2.simple_spread_v3"
SPREAD_2 = {"N": 2, "continuous_actions": False}  # the store's env (tests/multi_agent_stores.py)


def _stored_modules(tmp_path, episodes: int = 3):
    from rlrec.store.storage import Storage
    from rlrec.trainer.manifest_follower import ManifestFollower
    from rlrec.trainer.multi_agent import modules_from_shards

    out = str(tmp_path / "out")
    commit_spread(out, 1, episodes)
    st = Storage.from_uri(out)
    return out, modules_from_shards(st, ManifestFollower(st, multi_agent=True).live_head())


# ----------------------------------------------------------------------------------- the spec


def test_the_spec_forms():
    assert parse_env(SPREAD) == ("pettingzoo", "mpe2.simple_spread_v3", None)
    assert parse_env("pettingzoo-aec:mpe2.simple_spread_v3") == ("pettingzoo-aec", "mpe2.simple_spread_v3", None)
    assert parse_env("pkg.envs:Grid") == ("rllib", "pkg.envs", "Grid")
    par = make_env(SPREAD, SPREAD_2)
    aec = make_env("pettingzoo-aec:mpe2.simple_spread_v3", SPREAD_2)
    cls = make_env("ray.rllib.examples.envs.classes.multi_agent:MultiAgentCartPole", {"num_agents": 3})
    assert type(par).__name__ == "ParallelPettingZooEnv" and type(aec).__name__ == "PettingZooEnv"
    assert sorted(par.possible_agents) == sorted(aec.possible_agents) == ["agent_0", "agent_1"]
    assert sorted(cls.possible_agents) == [0, 1, 2]
    for e in (par, aec, cls):
        e.close()


@pytest.mark.parametrize(
    "spec,env_config,msg",
    [
        ("simple_spread_v3", {}, "names pettingzoo:MODULE .*, pettingzoo-aec:MODULE .* or MODULE:CLASS"),
        ("pettingzoo:mpe2.no_such_env", {}, "cannot import 'mpe2.no_such_env'"),
        ("mpe2:NoSuchClass", {}, "module 'mpe2' has no 'NoSuchClass'"),
        ("gymnasium.envs.classic_control:CartPoleEnv", {}, "CartPoleEnv is not an RLlib MultiAgentEnv subclass"),
        (SPREAD, {"agents": 2}, "building it with --env-config .*TypeError.*'agents'"),
    ],
)
def test_a_wrong_spec_is_refused_in_one_line(spec, env_config, msg):
    from rlrec.errors import UsageError

    with pytest.raises(EnvSpecError, match=msg) as e:
        make_env(spec, env_config)
    assert "\n" not in str(e.value)
    c = TrainerConfig(input="in", checkpoint_dir="ck", multi_agent=True, env=spec, env_config=env_config)
    with pytest.raises(UsageError, match=msg):  # before Ray starts
        c.check_inputs()


def test_the_options_around_a_multi_agent_env():
    c = TrainerConfig(input="in", checkpoint_dir="ck", multi_agent=True, env=SPREAD, env_config=SPREAD_2)
    assert c.promotion_gate == "env" and c.rollout == "direct"  # the default with --env, as single-agent
    assert TrainerConfig(input="in", checkpoint_dir="ck", multi_agent=True).promotion_gate == "off"
    with pytest.raises(ValueError, match="--env-config gives a multi-agent env its arguments: it needs") as e:
        TrainerConfig(input="in", checkpoint_dir="ck", env="CartPole-v1", env_config={"N": 2})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="--promotion-gate ope is single-agent only"):
        TrainerConfig(input="in", checkpoint_dir="ck", multi_agent=True, env=SPREAD, promotion_gate="ope")
    with pytest.raises(ValueError, match="--rollout canary and --ope-report are single-agent only"):
        TrainerConfig(input="in", checkpoint_dir="ck", multi_agent=True, env=SPREAD, rollout="canary")


# ----------------------------------------------------------------------------------- the store's modules


@pytest.mark.parametrize(
    "env_config,msg",
    [
        (
            {"N": 3, "continuous_actions": False},
            r"agent 'agent_2' has no module in the stored agent -> module mapping \(it maps 'agent_0', 'agent_1'\)",
        ),
        (
            {"N": 2, "continuous_actions": True},
            r"agent 'agent_0' has action space Box\(0.0, 1.0, \(5,\), float32\), not the stored Discrete\(5\) "
            r"of its module 'scripted'",
        ),
    ],
)
def test_an_env_the_stored_modules_do_not_cover_is_refused_in_one_line(tmp_path, monkeypatch, env_config, msg):
    out, mods = _stored_modules(tmp_path)
    env = make_env(SPREAD, env_config)
    with pytest.raises(EnvSpecError, match=msg) as e:
        check_env_modules(env, SPREAD, mods.agents, mods.spaces)
    assert "\n" not in str(e.value)
    check_env_modules(make_env(SPREAD, SPREAD_2), SPREAD, mods.agents, mods.spaces)  # the store's own env fits

    # the trainer refuses it before training: before Ray starts
    _refused_before_ray(tmp_path, monkeypatch, out, msg, env=SPREAD, env_config=env_config)


def _refused_before_ray(tmp_path, monkeypatch, out, msg, **kw):
    from rlrec.trainer.service import ContinuousTrainer, UnsupportedCombination

    started = []  # Ray is started or joined in _connect (and only there)
    monkeypatch.setattr(ContinuousTrainer, "_connect", lambda self: started.append(1))
    tr = ContinuousTrainer(cfg(out, str(tmp_path / "ck"), promotion_gate="env", **kw))
    with pytest.raises(UnsupportedCombination, match=msg):
        tr.run()
    assert tr.iteration == 0 and started == []


def test_promotion_return_names_a_stored_module(tmp_path, monkeypatch):
    out, _ = _stored_modules(tmp_path)
    msg = r"--promotion-return module:'nope': the stored modules are random, scripted"
    _refused_before_ray(
        tmp_path, monkeypatch, out, msg, env=SPREAD, env_config=SPREAD_2, promotion_return="module:nope"
    )


def test_an_rllib_multi_agent_env_with_other_agent_ids_is_refused(tmp_path):
    _, mods = _stored_modules(tmp_path)
    env = make_env("ray.rllib.examples.envs.classes.multi_agent:MultiAgentCartPole", {"num_agents": 2})
    with pytest.raises(EnvSpecError, match="agent 0 has no module in the stored agent -> module mapping"):
        check_env_modules(env, "x", mods.agents, mods.spaces)


@pytest.mark.slow
def test_the_cli_refuses_an_env_with_an_unmapped_agent_in_one_line(tmp_path):
    out, _ = _stored_modules(tmp_path)
    r = subprocess.run(
        [
            *(sys.executable, "-m", "rlrec", "train", "--input", out, "--checkpoint-dir", str(tmp_path / "ck")),
            *("--multi-agent", "--env", SPREAD, "--env-config", "N=3", "--env-config", "continuous_actions=false"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("rlrec train: error: --env 'pettingzoo:mpe2.simple_spread_v3': agent 'agent_2' "), (
        r.stderr[-2000:]
    )
    assert "Traceback" not in r.stderr


# ----------------------------------------------------------------------------------- the return


class _Scripted:
    """agent_0 follows the store's script, agent_1 always takes action 3 (modules as stored)."""

    def __init__(self):
        self.agent_modules = dict(MODULES)

    def act(self, obs, explore, generator):
        return {a: (script(o) if a == "agent_0" else 3) for a, o in obs.items()}, {}


class _Served:
    """A loaded `rlrec.trainer.policy.Policy` played as the gate plays a candidate."""

    def __init__(self, policy):
        self.policy, self.agent_modules = policy, dict(policy.spec["agent_modules"])

    def act(self, obs, explore, generator):
        return self.policy.act(obs)


def test_the_return_is_the_sum_over_agents_and_each_modules_the_sum_over_its_agents():
    from mpe2 import simple_spread_v3

    env = make_env(SPREAD, SPREAD_2)
    got = evaluate_modules(_Scripted(), env, 3, seed=7)
    for k in range(3):  # the same episodes, stepped by hand in the raw PettingZoo env
        raw = simple_spread_v3.parallel_env(**SPREAD_2)
        obs, _ = raw.reset(seed=7 + k)
        sums = {"agent_0": 0.0, "agent_1": 0.0}
        while obs:
            obs, rewards, *_ = raw.step({a: (script(o) if a == "agent_0" else 3) for a, o in obs.items()})
            for a, r in rewards.items():
                sums[a] += r
        assert got.modules["scripted"][k] == pytest.approx(sums["agent_0"])
        assert got.modules["random"][k] == pytest.approx(sums["agent_1"])
        assert got.episodes[k] == pytest.approx(sums["agent_0"] + sums["agent_1"])
    assert got.mean == pytest.approx(np.mean(got.episodes)) and got.mean < 0  # simple_spread: distances cost
    assert len(set(got.episodes)) == 3  # three seeds, three starts


class _LeftAndBalance:
    """An RLlib MultiAgentCartPole played by two modules: agent 0 always pushes left (it falls
    within ~10 steps), agent 1 balances (500 steps)."""

    def __init__(self):
        self.agent_modules = {0: "left", 1: "balance"}

    @staticmethod
    def action(module, o):
        return 0 if module == "left" else int(o[2] + o[3] > 0)

    def act(self, obs, explore, generator):
        return {a: self.action(self.agent_modules[a], o) for a, o in obs.items()}, {}


def test_each_agent_acts_by_its_module_until_it_is_done():
    import warnings

    import gymnasium as gym

    env = make_env("ray.rllib.examples.envs.classes.multi_agent:MultiAgentCartPole", {"num_agents": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # gymnasium warns when a done env is stepped again
        got = evaluate_modules(_LeftAndBalance(), env, 3, seed=1)
    for k in range(3):  # each sub-env is CartPole-v1 reset on the episode's seed: stepped by hand
        for module in ("left", "balance"):
            raw = gym.make("CartPole-v1")
            o, _ = raw.reset(seed=1 + k)
            total, over = 0.0, False
            while not over:
                o, r, term, trunc, _ = raw.step(_LeftAndBalance.action(module, o))
                total, over = total + r, term or trunc
            assert got.modules[module][k] == total
        assert got.episodes[k] == got.modules["left"][k] + got.modules["balance"][k]
    assert max(got.modules["left"]) < 20 and got.modules["balance"] == [500.0] * 3


# ----------------------------------------------------------------------------------- the gate in a trainer


def _train(tmp_path, first_seed=0, env_config=SPREAD_2, **kw):
    from rlrec.trainer.service import ContinuousTrainer

    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    commit_spread(out, 2, 10, first_seed=first_seed)
    tr = ContinuousTrainer(
        cfg(out, ck, env=SPREAD, env_config=env_config, promotion_gate="env", num_cpus=2, seed=3, **kw)
    )
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("rc", tr.run()), daemon=True)
    t.start()
    n = kw["max_iterations"]
    wait_for(lambda: (lambda ls: bool(ls) and ls[-1]["iteration"] >= n)(read_metrics(ck)), 600, what=f"{n} iterations")
    t.join(180)
    assert not t.is_alive() and box.get("rc") == 0, box
    return ck, [r["promotion"] for r in read_metrics(ck) if "promotion" in r]


@pytest.mark.slow
def test_the_env_gate_plays_every_module_and_decides_by_the_single_agent_rule(tmp_path):
    from rlrec.trainer.policy import load_policy
    from rlrec.trainer.signing import generate_keys

    priv, pub = generate_keys(tmp_path / "keys")
    kw = {"checkpoint_interval": 2, "promotion_episodes": 4, "signing_key": str(priv)}
    ck, decisions = _train(tmp_path, max_iterations=6, **kw)
    assert len(decisions) == 3
    deployed = None
    for d in decisions:
        assert sorted(d["module_returns"]) == ["random", "scripted"] and len(d["episode_returns"]) == 4
        assert d["candidate_return"] == pytest.approx(np.mean(d["episode_returns"]))
        assert d["candidate_return"] == pytest.approx(sum(d["module_returns"].values()))
        assert d["deployed_return"] == deployed  # the last promoted candidate's (none before the first)
        assert d["promoted"] == (deployed is None or d["candidate_return"] >= deployed)
        if d["promoted"]:
            deployed = d["candidate_return"]
    assert decisions[0]["promoted"]
    lines = read_metrics(ck)
    gated = [r for r in lines if "promotion" in r]
    assert all(r["eval_return_mean"] == r["promotion"]["candidate_return"] for r in gated)

    # the published version is the candidate the gate played: the same returns, replayed from the store
    promoted = [d for d in decisions if d["promoted"]]
    whole = load_policy(ck, public_key=pub)  # as a service serves it (greedy)
    assert whole.signed
    assert whole.policy_version == promoted[-1]["candidate_version"]
    assert whole.spec["promotion"]["module_returns"] == promoted[-1]["module_returns"]
    assert whole.spec["agent_modules"] == MODULES
    served = _Served(whole)
    again = evaluate_modules(served, make_env(SPREAD, SPREAD_2), 4, seed=3)
    assert again.episodes == pytest.approx(promoted[-1]["episode_returns"], abs=1e-5)
    assert again.module_means() == pytest.approx(promoted[-1]["module_returns"])

    # --resume (with new shards) judges the next candidate against the deployed return it restored
    _, resumed = _train(tmp_path, first_seed=100, max_iterations=8, resume=True, **kw)
    assert len(resumed) == 4 and resumed[:3] == decisions
    last = resumed[-1]
    assert last["deployed_return"] == promoted[-1]["candidate_return"]
    assert last["deployed_version"] == promoted[-1]["candidate_version"]
    assert last["promoted"] == (last["candidate_return"] >= last["deployed_return"])

    # --resume in another env config: the stored deployed return was measured elsewhere, not compared
    longer = {**SPREAD_2, "max_cycles": 50}
    _, again = _train(tmp_path, first_seed=200, env_config=longer, max_iterations=10, resume=True, **kw)
    assert len(again) == 5 and again[:4] == resumed
    assert again[-1]["deployed_return"] is None and again[-1]["promoted"] is True


@pytest.mark.slow
def test_a_candidate_below_the_baseline_is_refused_and_not_published(tmp_path):
    import os

    # simple_spread's reward is minus the distances to the landmarks: no policy reaches 0
    ck, decisions = _train(tmp_path, max_iterations=2, checkpoint_interval=2, promotion_baseline=0.0)
    assert len(decisions) == 1
    d = decisions[0]
    assert d["promoted"] is False and d["deployed_return"] == 0.0 and d["candidate_return"] < 0.0
    assert sorted(d["module_returns"]) == ["random", "scripted"] and len(d["episode_returns"]) == 10
    assert not os.path.exists(os.path.join(ck, "policies", "latest.json"))
