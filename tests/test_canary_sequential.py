"""The canary's sequential test, pure logic first (numpy only), then its evidence from committed shards:

* simulations that look after *every* episode (continuous peeking): a canary exactly as good as
  the deployed version is rolled back, and one a hair worse is promoted, in at most alpha of the
  runs -- while a fixed-sample interval peeked the same way errs far more often (the check can fail);
* a clearly worse canary is rolled back, and a clearly better one promoted, within the exposure;
* the rules' edges: the minimum episodes, the maximum exposure, the wall-clock limit ("no canary traffic");
* the evidence: only the two versions' episodes that began after the canary started, discounted;
  the run's state round-trips through a checkpoint record and continues the same test.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from rlrec.trainer.sequential import NO_TRAFFIC, ArmStats, CanaryRule, confidence_radius, judge

RULE = CanaryRule(alpha=0.05, margin=0.0, min_episodes=30, max_exposure=2000, max_wait_s=3600.0)


def _running(x: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and sample standard deviation of x[:n] for each n (rows: runs)."""
    s1 = np.cumsum(x, axis=-1)[..., n - 1]
    s2 = np.cumsum(x * x, axis=-1)[..., n - 1]
    mean = s1 / n
    var = np.maximum(s2 - n * mean * mean, 0.0) / np.maximum(n - 1, 1)
    return mean, np.sqrt(var)


def _peek_every_episode(diff: float, *, runs: int, n_max: int, share: float, rng, naive: bool = False):
    """Share of runs in which some look promoted, and in which some look rolled back on the bound.

    The canary serves `share` of the episodes; the deployed arm has (1 - share) / share as many.
    Returns are skewed (exponential, sd 1) so the test does not rely on normal data."""
    ratio = round((1 - share) / share)
    n = np.arange(1, n_max + 1)
    c = rng.exponential(1.0, (runs, n_max)) + diff
    d = rng.exponential(1.0, (runs, n_max * ratio))
    mc, sc = _running(c, n)
    md, sd = _running(d, n * ratio)
    if naive:  # a 95% interval for a fixed sample size, looked at after every episode
        half = 1.96 * np.sqrt(sc**2 / n + sd**2 / (n * ratio))
    else:
        half = confidence_radius(n, sc, RULE.alpha / 2) + confidence_radius(n * ratio, sd, RULE.alpha / 2)
    low, high = mc - md - half, mc - md + half
    look = n >= RULE.min_episodes
    promoted = ((low >= -RULE.margin) & look).any(axis=1)
    rolled_back = ((high < 0) & look).any(axis=1)
    first_promote = np.where(promoted, np.argmax((low >= -RULE.margin) & look, axis=1) + 1, n_max + 1)
    first_rollback = np.where(rolled_back, np.argmax((high < 0) & look, axis=1) + 1, n_max + 1)
    return promoted.mean(), rolled_back.mean(), first_promote, first_rollback


def test_wrong_decisions_stay_below_alpha_under_continuous_peeking():
    rng = np.random.default_rng(40)
    # exactly as good as deployed: a rollback on the bound is a wrong decision
    _, wrong_rollback, _, _ = _peek_every_episode(0.0, runs=400, n_max=2000, share=0.2, rng=rng)
    # a hair worse than deployed (margin 0): a promotion is a wrong decision
    wrong_promote, _, _, _ = _peek_every_episode(-1e-6, runs=400, n_max=2000, share=0.2, rng=rng)
    assert wrong_rollback <= RULE.alpha and wrong_promote <= RULE.alpha
    # the same looks with a fixed-sample interval: the error is far above alpha (what the CS prevents)
    naive_promote, naive_rollback, _, _ = _peek_every_episode(
        -1e-6, runs=400, n_max=2000, share=0.2, rng=rng, naive=True
    )
    assert naive_promote > 2 * RULE.alpha and naive_rollback > 2 * RULE.alpha


def test_a_clearly_worse_canary_is_rolled_back_and_a_better_one_promoted_within_the_exposure():
    rng = np.random.default_rng(7)
    promoted, rolled_back, _, first_rollback = _peek_every_episode(-0.5, runs=200, n_max=2000, share=0.2, rng=rng)
    assert promoted == 0.0 and rolled_back == 1.0
    assert np.median(first_rollback) < 300  # canary episodes served before the rollback
    promoted, rolled_back, first_promote, _ = _peek_every_episode(0.5, runs=200, n_max=2000, share=0.2, rng=rng)
    assert promoted == 1.0 and rolled_back == 0.0
    assert np.median(first_promote) < 300


def test_the_rules_edges():
    rule = CanaryRule(min_episodes=30, max_exposure=100, max_wait_s=60.0)
    worse, better = ArmStats.of([0.0, 0.1] * 10), ArmStats.of([5.0, 5.1] * 10)
    # clear evidence but below the minimum episodes: no decision
    assert judge(worse, better, rule, 1.0).decision == "continue"
    big_worse, big_better = ArmStats.of([0.0, 0.1] * 20), ArmStats.of([5.0, 5.1] * 20)
    v = judge(big_worse, big_better, rule, 1.0)
    assert v.decision == "rollback" and "is below 0: the canary is worse" in v.reason and v.high < 0
    v = judge(big_better, big_worse, rule, 1.0)
    assert v.decision == "promote" and v.low > 0
    # noise only: undecided until the maximum exposure
    rng = np.random.default_rng(0)
    same = ArmStats.of(list(rng.normal(0, 1, 99)))
    assert judge(same, ArmStats.of(list(rng.normal(0, 1, 400))), rule, 10.0).decision == "continue"
    same.add(0.0)
    v = judge(same, ArmStats.of(list(rng.normal(0, 1, 400))), rule, 10.0)
    assert v.decision == "rollback" and "maximum exposure of 100 canary episodes" in v.reason
    # no traffic: rolled back after the wall-clock limit, with the message services' owners look for
    v = judge(ArmStats.of([1.0] * 3), ArmStats.of([1.0] * 500), rule, 61.0)
    assert v.decision == "rollback" and v.reason.startswith(NO_TRAFFIC)
    assert judge(ArmStats.of([1.0] * 3), ArmStats.of([1.0] * 500), rule, 59.0).decision == "continue"
    with pytest.raises(ValueError, match=r"maximum exposure \(10\) must be at least its minimum"):
        CanaryRule(min_episodes=30, max_exposure=10)
    assert math.isinf(confidence_radius(1, 1.0, 0.05))


# ------------------------------------------------------------------------ evidence from shards


def _episode(version: int, rewards: list[float], started_ms: int, eid: str):
    import gymnasium as gym

    from rlrec.trainer.synthetic import _episode as make

    obs_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    T = len(rewards)
    ep = make(
        "Toy-v0",
        obs_space,
        gym.spaces.Discrete(2),
        np.zeros((T + 1, 2), np.float32),
        np.zeros(T, np.int64),
        rewards,
        True,
        False,
        policy_id="toy",
        policy_version=version,
        episode_id=eid,
    )
    return dataclasses.replace(ep, started_ms=started_ms, ended_ms=started_ms + 10)


def test_the_evidence_is_the_two_versions_episodes_since_the_start_and_the_test_resumes(tmp_path):
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.rollout import CanaryRun

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    t0 = 1_000_000.0
    before = [_episode(4, [9.0, 9.0], int(t0 * 1000) - 5, "old-deployed")]  # began before the canary
    arms = [
        _episode(4, [1.0, 1.0], int(t0 * 1000) + 1, "d1"),
        _episode(4, [1.0, 0.0], int(t0 * 1000) + 2, "d2"),
        _episode(5, [2.0, 2.0], int(t0 * 1000) + 3, "c1"),
        _episode(3, [7.0], int(t0 * 1000) + 4, "other-version"),
    ]
    committer.commit(before + arms)
    run = CanaryRun(version=5, base_version=4, started=t0, gamma=0.5, rule=CanaryRule(min_episodes=3, max_wait_s=60.0))
    v = run.look(uri, now=t0 + 1)
    assert (v.canary.n, v.deployed.n) == (1, 2)
    assert v.canary.mean == pytest.approx(3.0)  # 2 + 0.5 * 2
    assert v.deployed.mean == pytest.approx((1.5 + 1.0) / 2)
    assert v.decision == "continue"

    # a checkpoint's record, restored by --resume: the same test, the same evidence, one more shard
    resumed = CanaryRun.from_state(run.to_state())
    assert (resumed.started, resumed.rule, resumed.history) == (run.started, run.rule, run.history)
    committer.commit([_episode(5, [2.0, 2.0], int(t0 * 1000) + 10, "c2")])
    v2 = resumed.look(uri, now=t0 + 2)
    assert (v2.canary.n, v2.deployed.n) == (2, 2)
    assert len(resumed.history) == 2
    # past the wall clock with too few episodes: rolled back, loudly
    v3 = resumed.look(uri, now=t0 + 61)
    assert v3.decision == "rollback" and v3.reason.startswith(NO_TRAFFIC)
    record = resumed.decision_record(v3, now=t0 + 61)
    assert (record["canary_version"], record["episodes_canary"], record["decision"]) == (5, 2, "rollback")
