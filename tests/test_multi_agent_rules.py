"""Differential test: `MultiAgentRules` accepts exactly the env steps RLlib's `MultiAgentEpisode`
(ray 2.60, the real one) accepts, on random sequences of valid and invalid steps.

A step RLlib refuses may leave its episode half-changed, so after each refusal the RLlib episode
is rebuilt from the accepted steps; the sequence goes on with the next random step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("ray.rllib")

from ray.rllib.env.multi_agent_episode import MultiAgentEpisode

from rlrec.producer.multi_agent_rules import MultiAgentRules

AGENTS = ["a0", "a1", "a2"]


def _random_step(rng: random.Random, with_extras: bool) -> dict:
    obs, act, rew, info, term, trunc, extra = {}, {}, {}, {}, {}, {}, {}
    for a in AGENTS:
        r = rng.random()
        if r < 0.45:  # the usual: observation, action, reward
            obs[a], act[a] = np.float32(rng.random()), rng.randrange(3)
            if rng.random() < 0.97:  # else refused: acted and observed without a reward
                rew[a] = 1.0
        elif r < 0.55:
            act[a] = rng.randrange(3)
            if rng.random() < 0.5:
                rew[a] = 0.5
        elif r < 0.65:
            obs[a] = np.float32(0.0)
            if rng.random() < 0.5:
                rew[a] = 0.25
        elif r < 0.72:
            rew[a] = -1.0
        elif r < 0.76:
            info[a] = {"x": 1}
        if a in act and with_extras and rng.random() < 0.95:
            extra[a] = {"action_logp": np.float32(-0.5)}
        if rng.random() < 0.06:
            term[a] = rng.random() < 0.8
        if rng.random() < 0.04:
            trunc[a] = rng.random() < 0.8
    if rng.random() < 0.03:
        term["__all__"] = rng.random() < 0.7
    if rng.random() < 0.03:
        trunc["__all__"] = rng.random() < 0.7
    return {
        "observations": obs,
        "actions": act,
        "rewards": rew,
        "infos": info,
        "terminateds": term,
        "truncateds": trunc,
        "extra_model_outputs": extra,
    }


def _rllib_episode(reset: dict, steps: list[dict]) -> MultiAgentEpisode:
    ep = MultiAgentEpisode(agent_module_ids=dict.fromkeys(AGENTS, "m"))
    ep.add_env_reset(observations=reset)
    for s in steps:
        ep.add_env_step(**s)
    return ep


def _rllib_accepts(ep: MultiAgentEpisode, step: dict) -> bool:
    try:
        ep.add_env_step(**step)
    except Exception:  # MultiAgentEnvError, AssertionError: refused
        return False
    return True


@pytest.mark.parametrize("seed", range(60))
def test_rules_accept_exactly_what_rllib_accepts(seed):
    rng = random.Random(seed)
    with_extras = seed % 3 != 0
    reset = {a: np.float32(0.0) for a in AGENTS if rng.random() < 0.7}
    rules = MultiAgentRules()
    rules.reset(reset)
    ep = _rllib_episode(reset, [])
    accepted: list[dict] = []
    refused = 0
    for i in range(40):
        step = _random_step(rng, with_extras)
        want = _rllib_accepts(ep, step)
        try:
            state = rules.check_step(**step)
            got = True
        except ValueError:
            got = False
        assert got == want, (seed, i, step, "rllib accepts" if want else "rllib refuses")
        if want:
            rules.accept(state)
            accepted.append(step)
            assert rules.done == ep.is_done, (seed, i)
            if ep.is_done:
                break
        else:
            refused += 1
            ep = _rllib_episode(reset, accepted)
    assert len(accepted) + refused > 0


def _full_step(rng: random.Random, with_extras: bool, agents: list) -> dict:
    """The usual env step: `agents` observe, act and get a reward; nobody is done."""
    flags = {a: False for a in agents if rng.random() < 0.5}
    if rng.random() < 0.3:
        flags["__all__"] = False
    return {
        "observations": {a: np.float32(rng.random()) for a in agents},
        "actions": {a: rng.randrange(3) for a in agents},
        "rewards": dict.fromkeys(agents, 1.0),
        "infos": {a: {} for a in agents if rng.random() < 0.3},
        "terminateds": flags,
        "truncateds": dict(flags) if rng.random() < 0.5 else {},
        "extra_model_outputs": {a: {"action_logp": np.float32(-0.5)} for a in agents} if with_extras else {},
    }


def test_steady_step_answers_as_the_full_rules_and_as_rllib():
    steady = sum(_steady_run(seed) for seed in range(40))
    assert steady > 200, f"only {steady} env steps took the steady path"


def _steady_run(seed: int) -> int:
    """Env steps of one random sequence that `steady_step` answered (each checked against the
    full rules and RLlib)."""
    rng = random.Random(seed)
    with_extras = seed % 3 != 0
    reset = {a: np.float32(0.0) for a in AGENTS if rng.random() < 0.8}
    rules = MultiAgentRules()
    rules.reset(reset)
    ep = _rllib_episode(reset, [])
    accepted: list[dict] = []
    steady = 0
    for i in range(60):
        agents = sorted(reset) if rng.random() < 0.5 else [a for a in AGENTS if rng.random() < 0.8]
        step = _full_step(rng, with_extras, agents) if rng.random() < 0.7 else _random_step(rng, with_extras)
        want = _rllib_accepts(ep, step)
        fast = rules.steady_step(**{k: v for k, v in step.items() if k != "infos"})
        try:
            full = rules.any_step(**step)
        except ValueError:
            full = None
        if fast is not None:
            steady += 1
            assert fast == full and fast[0] is rules.agents, (seed, i, step)
        assert (full is not None) == want, (seed, i, step)
        if want:
            rules.accept(full)
            accepted.append(step)
            if ep.is_done:
                break
        else:
            ep = _rllib_episode(reset, accepted)
    return steady
