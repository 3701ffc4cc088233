"""`fold_multi_agent` refuses, with a `DecodeError` reason code, every sequence RLlib's real
`MultiAgentEpisode` (ray 2.60) would refuse to replay, and what it returns replays through it."""

from __future__ import annotations

import random

import numpy as np
import pytest
from gymnasium import spaces as gs

pytest.importorskip("ray.rllib")

from ray.rllib.env.multi_agent_episode import MultiAgentEpisode

from rlrec.consumer.multi_agent_fold import fold_multi_agent
from rlrec.producer.events import DecodeError, RewardDelta
from rlrec.producer.multi_agent_events import (
    ACTION,
    ALL_TERMINATED,
    ALL_TERMINATED_TRUE,
    ALL_TRUNCATED,
    ALL_TRUNCATED_TRUE,
    INFO,
    OBSERVATION,
    REWARD,
    TERMINATED,
    TERMINATED_TRUE,
    TRUNCATED,
    TRUNCATED_TRUE,
    AgentColumn,
    AgentSpec,
    MultiAgentEpisodeStart,
    MultiAgentStepBatch,
)
from rlrec.producer.multi_agent_rules import MultiAgentRules
from tests.test_multi_agent_rules import AGENTS, _random_step

OBS = gs.Box(0.0, 1.0, (), np.float32)
ACT = gs.Discrete(3)


def _start(reset: dict) -> MultiAgentEpisodeStart:
    agents = {a: AgentSpec(a, "m", OBS, ACT) for a in AGENTS}
    return MultiAgentEpisodeStart("ep", "p", 1, agents, {a: [np.asarray(v, np.float32)] for a, v in reset.items()})


def _batch(t0: int, steps: list[dict], ended: bool) -> MultiAgentStepBatch:
    """The MultiAgentStepBatch of env steps given as the dicts of `add_env_step`."""
    flags = []
    for s in steps:
        f = 0
        for d, bit, true in ((s["terminateds"], ALL_TERMINATED, ALL_TERMINATED_TRUE),
                             (s["truncateds"], ALL_TRUNCATED, ALL_TRUNCATED_TRUE)):  # fmt: skip
            if "__all__" in d:
                f |= bit | (true if d["__all__"] else 0)
        flags.append(f)
    cols = []
    for a in AGENTS:
        presence, obs, act, rew, infos, logp = [], [], [], [], [], []
        for s in steps:
            p = 0
            if a in s["observations"]:
                p |= OBSERVATION
                obs.append(s["observations"][a])
            if a in s["actions"]:
                p |= ACTION
                act.append(s["actions"][a])
                logp.append(s["extra_model_outputs"].get(a, {}).get("action_logp"))
            if a in s["rewards"]:
                p |= REWARD
                rew.append(s["rewards"][a])
            if a in s["infos"]:
                p |= INFO
                infos.append(s["infos"][a])
            if a in s["terminateds"]:
                p |= TERMINATED | (TERMINATED_TRUE if s["terminateds"][a] else 0)
            if a in s["truncateds"]:
                p |= TRUNCATED | (TRUNCATED_TRUE if s["truncateds"][a] else 0)
            presence.append(p)
        if not any(presence):
            continue
        extra, rows = {}, {}
        if any(v is not None for v in logp):
            extra["action_logp"] = np.array([v for v in logp if v is not None], np.float32)
            if None in logp:
                rows["action_logp"] = np.array([v is not None for v in logp], np.uint8)
        cols.append(
            AgentColumn(
                a,
                np.array(presence, np.uint8),
                [np.array(obs, np.float32)],
                [np.array(act, np.int64)],
                np.array(rew, np.float64),
                infos,
                extra,
                rows,
            )
        )
    return MultiAgentStepBatch("ep", t0, np.array(flags, np.uint8), cols, ended)


def _replay(rec) -> MultiAgentEpisode:
    ep = MultiAgentEpisode(agent_module_ids=rec.agent_modules)
    ep.add_env_reset(observations=rec.reset.observations, infos=rec.reset.infos)
    for s in rec.steps:
        ep.add_env_step(
            observations=s.observations,
            actions=s.actions,
            rewards=s.rewards,
            infos=s.infos,
            terminateds=s.terminateds,
            truncateds=s.truncateds,
            extra_model_outputs=s.extra_model_outputs,
        )
    return ep


def _no_reward_step(a: str) -> dict:
    return {
        "observations": {a: np.float32(0.5)},
        "actions": {a: 1},
        "rewards": {},
        "infos": {},
        "terminateds": {},
        "truncateds": {},
        "extra_model_outputs": {},
    }


def _step(a: str, obs: bool = True, act: bool = True, rew: bool = True, **flags) -> dict:
    return {
        "observations": {a: np.float32(0.5)} if obs else {},
        "actions": {a: 1} if act else {},
        "rewards": {a: 1.0} if rew else {},
        "infos": {},
        "terminateds": flags.get("term", {}),
        "truncateds": flags.get("trunc", {}),
        "extra_model_outputs": {},
    }


RESET = {"a0": np.float32(0.0)}


@pytest.mark.parametrize(
    "batches, match",
    [
        ([([_step("a0", rew=False)], False)], "no reward"),  # acted and observed without a reward
        ([([_step("a0", obs=False), _step("a0", obs=False)], False)], "acted twice"),
        ([([_step("a0")], True)], "ended=True but"),  # ended on a step RLlib finds not done
        ([([_step("a0", trunc={"__all__": True})], False)], "ended=False but"),
        ([([_step("a0", term={"__all__": True})], False), ([_step("a0")], False)], "after its last|ended=False"),
        ([([_step("a0", term={"a0": True}), _step("a0")], True)], "."),  # data after the agent (all) is done
    ],
)
def test_the_fold_refuses_what_rllib_would_refuse(batches, match):
    events, t0 = [_start(RESET)], 0
    for steps, ended in batches:
        events.append(_batch(t0, steps, ended))
        t0 += len(steps)
    with pytest.raises(DecodeError, match=match) as e:
        fold_multi_agent(events)
    assert e.value.reason in ("bad-value", "out-of-order")


def test_a_delayed_reward_that_makes_a_reward_infinite_is_refused():
    events = [_start(RESET), _batch(0, [_step("a0")], False)]
    events[1].agents[0].rewards[:] = 1e308
    events.append(RewardDelta("ep", 0, 1e308, 0, "a0"))
    with pytest.raises(DecodeError) as e:
        fold_multi_agent(events)
    assert e.value.reason == "non-finite-reward"


@pytest.mark.parametrize("seed", range(40))
def test_what_the_fold_returns_replays_through_rllib(seed):
    rng = random.Random(seed)
    reset = {a: np.float32(0.0) for a in AGENTS if rng.random() < 0.7}
    rules = MultiAgentRules()
    rules.reset(reset)
    valid: list[dict] = []
    raw: list[dict] = []
    for _ in range(40):
        step = _random_step(rng, seed % 2 == 0)
        raw.append(step)
        try:
            state = rules.check_step(**step)
        except ValueError:
            continue
        rules.accept(state)
        valid.append(step)
        if rules.done:
            break
    # the steps RLlib accepts, batched at random, fold and replay to the same done-ness
    events, t0 = [_start(reset)], 0
    while t0 < len(valid):
        n = rng.randint(1, 5)
        chunk = valid[t0 : t0 + n]
        events.append(_batch(t0, chunk, rules.done and t0 + n >= len(valid)))
        t0 += len(chunk)
    rec = fold_multi_agent(events)
    assert len(rec.steps) == len(valid)
    assert _replay(rec).is_done == rules.done
    # the raw sequence (some steps RLlib refuses), with an `ended` at random: refused or replayable
    for ended in (False, True):
        try:
            rec = fold_multi_agent([_start(reset), _batch(0, raw, ended)])
        except DecodeError as e:
            assert e.reason in ("bad-value", "out-of-order", "extra-output-mismatch")
            continue
        assert _replay(rec).is_done == ended
