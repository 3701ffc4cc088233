"""The multi-agent env gate at its edges: late-joining agents, envs that do not say their agents,
zero-sum games (the sum cannot judge; ``--promotion-return module:ID`` can), episodes on the
global generators, ticks on which no agent acts, capped episodes, bad specs and agent ids in one
line, and a deployed return measured on another env dropped on ``--resume``."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest

pytest.importorskip("pettingzoo")

from rlrec.trainer import multi_agent_env
from rlrec.trainer.config import TrainerConfig
from rlrec.trainer.multi_agent_env import (
    EnvSpecError,
    check_agent,
    check_env_modules,
    evaluate_modules,
    gate_verdict,
    make_env,
)
from tests.multi_agent_envs import ACT, OBS

LATE = "pettingzoo:tests.multi_agent_envs"
TICTACTOE = "ray.rllib.examples.envs.classes.multi_agent.tic_tac_toe:TicTacToe"
WIN = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 3, 6], [1, 4, 7], [2, 5, 8], [0, 4, 8], [2, 4, 6]]


class _Zeros:
    """Every agent takes action 0; `modules`: agent -> module."""

    def __init__(self, modules):
        self.agent_modules = dict(modules)

    def act(self, obs, explore, generator):
        return dict.fromkeys(obs, 0), {}


def _first_free(o):
    return int(np.flatnonzero(o == 0)[0])


def _smart(o):  # win if it can, else block, else the centre, else the first free cell
    for who in (1, -1):
        for line in WIN:
            v = [o[i] for i in line]
            if v.count(who) == 2 and v.count(0) == 1:
                return line[v.index(0)]
    return 4 if o[4] == 0 else _first_free(o)


class _TicTacToe:
    """player1 by module p1 (`_smart` or `_first_free`), player2 by module p2 (`_first_free`)."""

    def __init__(self, p1):
        self.p1, self.agent_modules = p1, {"player1": "p1", "player2": "p2"}

    def act(self, obs, explore, generator):
        return {a: (self.p1(o) if a == "player1" else _first_free(o)) for a, o in obs.items()}, {}


# ----------------------------------------------------------------------------------- agents


def test_a_late_joining_agent_is_checked_before_training():
    env = make_env(LATE)
    assert env.possible_agents == ["a0"]  # RLlib's wrapper lists the agents alive at reset only
    with pytest.raises(EnvSpecError, match="agent 'a1' has no module in the stored agent -> module mapping"):
        check_env_modules(env, LATE, {"a0": "m"}, {"m": (OBS, ACT)})
    wide = make_env(LATE, {"late_obs": 4})
    with pytest.raises(EnvSpecError, match=r"agent 'a1' has observation space Box\(-1.0, 1.0, \(4,\), float32\)"):
        check_env_modules(wide, LATE, {"a0": "m", "a1": "m"}, {"m": (OBS, ACT)})
    assert check_env_modules(env, LATE, {"a0": "m", "a1": "n"}, {"m": (OBS, ACT), "n": (OBS, ACT)}) is True
    got = evaluate_modules(_Zeros({"a0": "m", "a1": "n"}), env, 2)
    assert got.modules == {"m": [5.0, 5.0], "n": [4.0, 4.0]} and got.episodes == [9.0, 9.0]


def test_agents_of_an_env_that_does_not_say_them_are_checked_as_they_appear():
    mapping, spaces = {"a0": "m", "a1": "m"}, {"m": (OBS, ACT)}
    spec = "tests.multi_agent_envs:Unlisted"
    env = make_env(spec, {"obs": 4})
    assert check_env_modules(env, spec, mapping, spaces) is False  # nothing to check up front
    with pytest.raises(EnvSpecError, match=r"agent 'a1' has observation space Box\(-1.0, 1.0, \(4,\), float32\)"):
        evaluate_modules(_Zeros(mapping), env, 1, check=lambda a: check_agent(env, spec, a, mapping, spaces))
    fits = make_env(spec)
    got = evaluate_modules(_Zeros(mapping), fits, 1, check=lambda a: check_agent(fits, spec, a, mapping, spaces))
    assert got.episodes == [7.0]  # a0 on 4 ticks, a1 on 3


# ----------------------------------------------------------------------------------- what is judged


def test_a_zero_sum_env_is_refused_by_the_sum_and_judged_by_a_module(caplog):
    env = make_env(TICTACTOE)
    smart = evaluate_modules(_TicTacToe(_smart), env, 10)
    naive = evaluate_modules(_TicTacToe(_first_free), env, 10)
    assert smart.episodes == naive.episodes == [0.0] * 10  # a win is +1 and -1: the sum is always 0
    assert smart.module_means()["p1"] == 1.0 > naive.module_means()["p1"]
    with caplog.at_level(logging.INFO, logger="rlrec.trainer"):
        d = gate_verdict(naive, "sum", 2, 1, 0.0)
    assert d["promoted"] is False and d["refused"] == "zero-sum"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "the sum cannot judge it; give --promotion-return module:ID" in line and "\n" not in line
    by_p1 = gate_verdict(naive, "module:p1", 2, 1, smart.module_means()["p1"])
    assert by_p1["promoted"] is False and by_p1["candidate_return"] == naive.module_means()["p1"]
    assert by_p1["promotion_return"] == "module:p1" and "refused" not in by_p1
    assert gate_verdict(smart, "module:p1", 3, 1, naive.module_means()["p1"])["promoted"] is True
    # a general-sum env's summed return still decides
    assert gate_verdict(
        evaluate_modules(_Zeros({"a0": "m"}), make_env("tests.multi_agent_envs:Gap"), 1), "sum", 2, 1, 9.0
    )["promoted"]


def test_promotion_return_is_sum_or_a_stored_module():
    kw = {"input": "in", "checkpoint_dir": "ck"}
    assert TrainerConfig(**kw).promotion_return == "sum"
    for bad in ("module:", "mean", "modules:p1"):
        with pytest.raises(ValueError, match=r"--promotion-return .* is sum or module:ID"):
            TrainerConfig(**kw, multi_agent=True, promotion_return=bad)
    with pytest.raises(ValueError, match=r"--promotion-return module:ID judges one module .*: it needs --multi-agent"):
        TrainerConfig(**kw, promotion_return="module:p1")


# ----------------------------------------------------------------------------------- the episodes


def test_one_candidate_on_one_seed_gets_one_result_and_the_global_generators_are_restored():
    env = make_env(TICTACTOE)  # picks its first player with Python's global random
    random.seed(123)
    np.random.seed(123)
    before = random.random(), np.random.random()
    random.seed(123)
    np.random.seed(123)
    runs = [evaluate_modules(_TicTacToe(_first_free), env, 10, seed=0) for _ in range(3)]
    assert (random.random(), np.random.random()) == before  # the caller's generators are untouched
    assert runs[0].modules == runs[1].modules == runs[2].modules
    assert evaluate_modules(_TicTacToe(_first_free), env, 10, seed=1).modules != runs[0].modules


def test_a_tick_on_which_no_agent_observes_steps_the_env_on():
    got = evaluate_modules(_Zeros({"a0": "m"}), make_env("tests.multi_agent_envs:Gap"), 2)
    assert got.episodes == [10.0, 10.0] and got.capped == 0


def test_a_capped_episode_is_counted_and_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(multi_agent_env, "MAX_EPISODE_STEPS", 50)
    ticks = []
    got = evaluate_modules(
        _Zeros({"a0": "m", "a1": "m"}), make_env("tests.multi_agent_envs:Endless"), 3, progress=lambda: ticks.append(1)
    )
    assert got.capped == 3 and got.episodes == [100.0] * 3 and len(ticks) == 3
    with caplog.at_level(logging.WARNING, logger="rlrec.trainer"):
        d = gate_verdict(got, "sum", 2, None, None)
    assert d["capped_episodes"] == 3 and d["promoted"] is True
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == "promotion gate: 3 of candidate v2's 3 episodes were cut at 50 steps (the env did not end them)"
    assert (
        gate_verdict(
            evaluate_modules(_Zeros({"a0": "m"}), make_env("tests.multi_agent_envs:Gap"), 1), "sum", 2, None, None
        )["capped_episodes"]
        == 0
    )


# ----------------------------------------------------------------------------------- one line


def test_bad_specs_and_spaces_are_refused_in_one_line():
    from rlrec.errors import UsageError

    with pytest.raises(EnvSpecError, match=r"cannot import '.relative': TypeError: .*relative import") as e:
        make_env("pettingzoo:.relative")
    assert "\n" not in str(e.value)
    c = TrainerConfig(input="in", checkpoint_dir="ck", multi_agent=True, env="pettingzoo:.relative")
    with pytest.raises(UsageError, match="cannot import"):
        c.check_inputs()
    spec = "tests.multi_agent_envs:PartialSpaces"
    with pytest.raises(EnvSpecError, match=r"--env '.*PartialSpaces': the spaces of agent 'a1': KeyError: 'a1'"):
        check_env_modules(make_env(spec), spec, {"a0": "m", "a1": "m"}, {"m": (OBS, ACT)})


def test_agent_ids_in_the_refusal_are_quoted_cut_and_compared_as_recorded():
    cartpole = "ray.rllib.examples.envs.classes.multi_agent:MultiAgentCartPole"
    env = make_env(cartpole, {"num_agents": 2})
    spaces = {"m": (env.get_observation_space(0), env.get_action_space(0))}
    with pytest.raises(EnvSpecError) as e:  # int ids; a store holds the recorder's str ids
        check_env_modules(env, cartpole, {"0": "m", "1": "m"}, spaces)
    assert "agent 0 is of type int, and recorded agent ids are strings: the stored mapping's '0' is another" in str(
        e.value
    )
    forged = "x\nrlrec train: error: forged line " + "A" * 500
    with pytest.raises(EnvSpecError) as e:
        check_env_modules(make_env(LATE), LATE, {forged: "m"}, {"m": (OBS, ACT)})
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 300 and "(it maps 'x\\nrlrec train: error: forged line" in msg


def test_env_config_needs_env_and_the_start_up_line_says_what_is_published():
    kw = {"input": "in", "checkpoint_dir": "ck", "multi_agent": True}
    with pytest.raises(ValueError, match="--env-config gives --env its arguments: it needs --env"):
        TrainerConfig(**kw, env_config={"N": 2})
    published = TrainerConfig(**kw)
    assert published.promotion_gate == "off" and published.publish
    assert (
        published.gate_default
        == "--promotion-gate off: every checkpoint's policy is published (--multi-agent without --env)"
    )
    quiet = TrainerConfig(**kw, publish=False)
    assert quiet.gate_default == "--promotion-gate off: nothing is published (--no-publish)"


# ----------------------------------------------------------------------------------- --resume


class _Resumed:
    """What `CheckpointMixin` reads to restore a deployed return: a trainer's config and state."""

    def __init__(self, **kw):
        from rlrec.trainer.service_checkpoint import CheckpointMixin

        self.cfg = TrainerConfig(input="in", checkpoint_dir="ck", **kw)
        self.deployed_return = self.cfg.promotion_baseline
        self._gate_measure = CheckpointMixin._gate_measure.__get__(self)
        self.restore = CheckpointMixin._restore_deployed_return.__get__(self)


@pytest.mark.parametrize("multi_agent", [True, False])
def test_a_deployed_return_measured_on_another_env_is_not_compared_on_resume(caplog, multi_agent):
    if multi_agent:
        first = {"multi_agent": True, "env": LATE, "env_config": {"steps": 5}, "seed": 3}
        changes = {"env_config": {"steps": 50}, "promotion_return": "module:m", "promotion_episodes": 4}
    else:
        first = {"env": "CartPole-v1", "seed": 3}
        changes = {"env": "Acrobot-v1", "seed": 4}
    state = {"deployed_return": 9.0, "deployed_measure": _Resumed(**first)._gate_measure()}
    same = _Resumed(**first)
    same.restore(dict(state))
    assert same.deployed_return == 9.0
    for key, value in changes.items():
        other = _Resumed(**{**first, key: value})
        with caplog.at_level(logging.WARNING, logger="rlrec.trainer"):
            caplog.clear()
            other.restore(dict(state))
        assert other.deployed_return is None
        (line,) = [r.getMessage() for r in caplog.records]
        assert f"measured on other {key} than this run's gate: it is not compared" in line
    baseline = _Resumed(**{**first, "seed": 11, "promotion_baseline": -5.0})
    baseline.restore(dict(state))
    assert baseline.deployed_return == -5.0
    old = _Resumed(**{**first, "seed": 11})  # a checkpoint written before the measure was recorded
    old.restore({"deployed_return": 9.0})
    assert old.deployed_return == 9.0


class _Gate:
    """What `GateMixin._promote_multi_agent_env` reads: a config, the stored modules, the deployed
    state and the progress beat."""

    def __init__(self, modules, **kw):
        from types import SimpleNamespace

        from rlrec.trainer.service_gate import GateMixin

        self.cfg = TrainerConfig(input="in", checkpoint_dir="ck", multi_agent=True, promotion_episodes=2, **kw)
        self.modules = SimpleNamespace(agents=dict(modules), spaces={"m": (OBS, ACT)})
        self.policy_version, self.deployed_return, self.last_promotion, self.beats = 1, 5.0, None, 0
        self.promote = GateMixin._promote_multi_agent_env.__get__(self)

    def _progress(self):
        self.beats += 1


def test_the_gate_refuses_a_candidate_when_an_unlisted_agent_does_not_fit_in_one_line(monkeypatch, caplog):
    modules = {"a0": "m", "a1": "m"}
    monkeypatch.setattr(multi_agent_env, "candidate_policy", lambda artifact, version: _Zeros(modules))
    gate = _Gate(modules, env="tests.multi_agent_envs:Unlisted", env_config={"obs": 4})
    with caplog.at_level(logging.INFO, logger="rlrec.trainer"):
        assert gate.promote(2, None) is False
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("promotion gate refused candidate v2: the env does not fit the stored modules: ")
    assert "agent 'a1' has observation space Box(-1.0, 1.0, (4,), float32)" in line and gate.last_promotion is None
    fits = _Gate(modules, env="tests.multi_agent_envs:Unlisted")
    assert fits.promote(2, None) is True and fits.beats == 2  # 7 >= 5, one beat per episode
    assert fits.last_promotion["episode_returns"] == [7.0, 7.0] and fits.last_promotion["deployed_return"] == 5.0
