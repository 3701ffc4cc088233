"""The canary's sequential test, pure logic first (numpy only), then its evidence from committed shards:

* simulations that look after *every* episode (continuous peeking): each arm's interval ever
  misses its true mean, and a canary exactly as good as the deployed version is decided at all,
  in at most alpha of the runs -- while a fixed-sample interval peeked the same way errs far
  more often (the check can fail);
* a clearly worse canary is rolled back, and a clearly better one promoted, within the exposure;
  CartPole-like discounted returns in [0, 100] (99.2 against 92.2) are decided within 300 canary
  episodes (the range-width bound before it needed ~2,000, half the runs undecided);
* the rules' edges: the minimum episodes, the maximum exposure, the wall-clock limit ("no canary traffic");
* the evidence: only the two versions' episodes that began after the canary started, discounted,
  in the order they started; the run's state round-trips through a checkpoint record and
  continues the same test.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from rlrec.trainer.canary import assignment_info, canary_score, in_canary
from rlrec.trainer.sequential import (
    NO_TRAFFIC,
    ArmStats,
    CanaryRule,
    arm_interval,
    arm_interval_path,
    ever_misses,
    judge,
)

RULE = CanaryRule(alpha=0.05, margin=0.0, min_episodes=30, max_exposure=2000, max_wait_s=3600.0)
#: deployed episodes per canary episode in the test's bands at share 0.2 (scores >= 0.5 against < 0.2)
RATIO = 2.5


def _draw(canary, deployed, *, lo: float, hi: float, runs: int, n_max: int, rng):
    """`runs` x `n_max` canary returns and RATIO as many deployed ones, clipped into [lo, hi] as
    the trainer clips them."""
    c = np.clip(canary(rng, (runs, n_max)), lo, hi)
    d = np.clip(deployed(rng, (runs, math.ceil(n_max * RATIO))), lo, hi)
    return c, d


def _misses(canary, deployed, mean_c: float, mean_d: float, *, lo, hi, runs, n_max, rng) -> float:
    """Share of runs in which either arm's interval (alpha / 2 each) excludes its true mean
    after some episode: exactly, at every episode (a wrong decision needs such a miss)."""
    c, d = _draw(canary, deployed, lo=lo, hi=hi, runs=runs, n_max=n_max, rng=rng)
    a = RULE.alpha / 2
    return float((ever_misses(c, mean_c, lo, hi, a) | ever_misses(d, mean_d, lo, hi, a)).mean())


def _decide_every_episode(canary, deployed, *, lo: float, hi: float, runs: int, n_max: int, rng, naive=False):
    """Share of runs in which some look promoted, and in which some look rolled back on the bound
    (a look after every canary episode, from `min_episodes` on), and the first such look (in
    canary episodes; n_max + 1: none). The bound is `arm_interval_path` (on a grid, rounded
    outward); `naive`: a fixed-sample 95 % interval with the sample sd, looked at the same way."""
    c, d = _draw(canary, deployed, lo=lo, hi=hi, runs=runs, n_max=n_max, rng=rng)
    n = np.arange(1, n_max + 1)
    at = np.ceil(n * RATIO).astype(int) - 1  # the deployed episodes when the canary has n
    if naive:
        nd = np.arange(1, d.shape[1] + 1)
        mc, md = np.cumsum(c, axis=1) / n, (np.cumsum(d, axis=1) / nd)[:, at]
        sc = np.maximum(np.cumsum(c * c, axis=1) / n - mc**2, 0.0)
        sd = np.maximum((np.cumsum(d * d, axis=1) / nd)[:, at] - md**2, 0.0)
        half = 1.96 * np.sqrt(sc / n + sd / (at + 1))
        low, high = mc - md - half, mc - md + half
    else:
        low_c, high_c = arm_interval_path(c, lo, hi, RULE.alpha / 2, grid=100)
        low_d, high_d = arm_interval_path(d, lo, hi, RULE.alpha / 2, grid=100)
        low, high = low_c - high_d[:, at], high_c - low_d[:, at]
    look = n >= RULE.min_episodes
    promote, rollback = (low >= -RULE.margin) & look, (high < 0) & look
    first_promote = np.where(promote.any(axis=1), np.argmax(promote, axis=1) + 1, n_max + 1)
    first_rollback = np.where(rollback.any(axis=1), np.argmax(rollback, axis=1) + 1, n_max + 1)
    # the first decision counts (a run stops there)
    promoted = first_promote < np.minimum(first_rollback, n_max + 1)
    rolled_back = first_rollback < np.minimum(first_promote, n_max + 1)
    return promoted.mean(), rolled_back.mean(), first_promote, first_rollback


def _exponential(shift=0.0):
    return lambda rng, shape: rng.exponential(1.0, shape) + shift


def _normal(mean: float, sd: float):
    return lambda rng, shape: rng.normal(mean, sd, shape)


def _clipped_normal_mean(mean: float, sd: float, lo: float, hi: float) -> float:
    """E[clip(N(mean, sd), lo, hi)]."""
    cdf = lambda z: 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))  # noqa: E731
    pdf = lambda z: math.exp(-z * z / 2.0) / math.sqrt(2.0 * math.pi)  # noqa: E731
    a, b = (lo - mean) / sd, (hi - mean) / sd
    return lo * cdf(a) + hi * (1.0 - cdf(b)) + mean * (cdf(b) - cdf(a)) + sd * (pdf(a) - pdf(b))


CAP = 99.34  # a capped episode's discounted return (CartPole's 500 steps at gamma 0.99)


def _capped(fail: float):
    """Every episode reaches the cap, except `fail` of them that fail early (return 10)."""
    return lambda rng, shape: np.where(rng.random(shape) < fail, 10.0, CAP)


def _sparse(p: float = 0.05):
    """A sparse reward: 20 with probability `p`, else 0."""
    return lambda rng, shape: np.where(rng.random(shape) < p, 20.0, 0.0)


def _cartpole(mean: float):
    """CartPole-like discounted returns (gamma 0.99, cap 500 steps: 99.34): an episode fails at a
    uniform step in [10, 500) with the probability that makes the mean `mean`, else is capped."""
    steps = np.arange(10, 500)
    cap, failed = 100.0 * (1.0 - 0.99**500), float(np.mean(100.0 * (1.0 - 0.99**steps)))
    p = (cap - mean) / (cap - failed)

    def draw(rng, shape):
        fail_at = rng.integers(10, 500, shape)
        return np.where(rng.random(shape) < p, 100.0 * (1.0 - 0.99**fail_at), cap)

    return draw


def test_wrong_decisions_stay_below_alpha_under_continuous_peeking():
    rng = np.random.default_rng(40)
    # skewed returns, arms exactly as good: an interval that ever misses a true mean is what a wrong decision needs
    mean = 1.0 - math.exp(-8.0)  # E[min(Exp(1), 8)]
    assert _misses(_exponential(), _exponential(), mean, mean, lo=0.0, hi=8.0, runs=400, n_max=2000, rng=rng) <= (
        RULE.alpha
    )
    # normal returns: the misses, and the decisions themselves on the bound looked at after every episode
    mean = _clipped_normal_mean(50.0, 15.0, 0.0, 100.0)
    assert _misses(_normal(50, 15), _normal(50, 15), mean, mean, lo=0.0, hi=100.0, runs=400, n_max=2000, rng=rng) <= (
        RULE.alpha
    )
    promoted, rolled_back, _, _ = _decide_every_episode(
        _normal(50, 15), _normal(50, 15), lo=0.0, hi=100.0, runs=50, n_max=300, rng=rng
    )
    assert promoted + rolled_back <= RULE.alpha
    # the same looks with a fixed-sample interval: the error is far above alpha (what the CS prevents)
    naive_promote, naive_rollback, _, _ = _decide_every_episode(
        _exponential(), _exponential(), lo=0.0, hi=8.0, runs=400, n_max=2000, rng=rng, naive=True
    )
    assert naive_promote > 2 * RULE.alpha and naive_rollback > 2 * RULE.alpha


def test_a_worse_canary_whose_returns_so_far_are_all_equal_is_not_promoted():
    """Capped episodes: the deployed version always reaches the cap, the canary fails early in 2 %
    of episodes (truly 1.79 worse). Its first 30 episodes are all capped in 55 % of runs: a bound
    built on the sample variance has width 0 there and promotes; a valid one must not."""
    judged = judge(
        ArmStats.of([CAP] * 30),
        ArmStats.of([CAP] * 120),
        dataclasses.replace(RULE, return_min=0.0, return_max=100.0),
        1.0,
    )
    assert judged.decision == "continue" and judged.low < 0 < judged.high
    rng = np.random.default_rng(41)
    mean_c, mean_d = 0.02 * 10.0 + 0.98 * CAP, CAP
    misses = _misses(_capped(0.02), _capped(0.0), mean_c, mean_d, lo=0.0, hi=100.0, runs=1000, n_max=2000, rng=rng)
    assert misses <= RULE.alpha


def test_sparse_returns_of_equal_arms_are_not_decided_more_often_than_alpha():
    rng = np.random.default_rng(42)
    for _ in range(2):
        misses = _misses(_sparse(), _sparse(), 1.0, 1.0, lo=0.0, hi=20.0, runs=400, n_max=2000, rng=rng)
        assert misses <= RULE.alpha


def test_a_clearly_worse_canary_is_rolled_back_and_a_better_one_promoted_within_the_exposure():
    """Success rates (returns 0 or 1: the largest variance a range allows), 0.3 or 0.7 against 0.5."""
    rng = np.random.default_rng(7)
    bern = lambda p: lambda rng, shape: (rng.random(shape) < p).astype(np.float64)  # noqa: E731
    promoted, rolled_back, _, first_rollback = _decide_every_episode(
        bern(0.3), bern(0.5), lo=0.0, hi=1.0, runs=30, n_max=800, rng=rng
    )
    assert promoted == 0.0 and rolled_back == 1.0
    assert np.median(first_rollback) < 300  # canary episodes served before the rollback
    promoted, rolled_back, first_promote, _ = _decide_every_episode(
        bern(0.7), bern(0.5), lo=0.0, hi=1.0, runs=30, n_max=800, rng=rng
    )
    assert promoted == 1.0 and rolled_back == 0.0
    assert np.median(first_promote) < 300


def test_a_small_lift_with_a_realistic_spread_is_decided_within_300_canary_episodes():
    """The demo's case: CartPole-like discounted returns in [0, 100], canary 99.2 against the
    deployed 92.2 (sd 2.6 and 16.7). The bound follows the arms' spread: every run promotes
    the better canary, and rolls back the worse one, within 300 canary episodes. The range-width
    bound before it needed a median of ~1,980 (half of the runs undecided at 2,000)."""
    rng = np.random.default_rng(8)
    promoted, _, first_promote, _ = _decide_every_episode(
        _cartpole(99.2), _cartpole(92.2), lo=0.0, hi=100.0, runs=40, n_max=300, rng=rng
    )
    assert promoted == 1.0 and first_promote.max() <= 300
    _, rolled_back, _, first_rollback = _decide_every_episode(
        _cartpole(92.2), _cartpole(99.2), lo=0.0, hi=100.0, runs=40, n_max=300, rng=rng
    )
    assert rolled_back == 1.0 and first_rollback.max() <= 300
    # judge's own (exact) interval decides the same at 300 canary and 750 deployed episodes
    rule = dataclasses.replace(RULE, return_min=0.0, return_max=100.0)
    better, deployed = _cartpole(99.2)(rng, 300), _cartpole(92.2)(rng, 750)
    assert judge(ArmStats.of(list(better)), ArmStats.of(list(deployed)), rule, 1.0).decision == "promote"
    worse, deployed = _cartpole(92.2)(rng, 300), _cartpole(99.2)(rng, 750)
    assert judge(ArmStats.of(list(worse)), ArmStats.of(list(deployed)), rule, 1.0).decision == "rollback"


def test_the_interval_is_a_running_intersection_in_the_order_given():
    """Each arm's interval after n episodes is within the one after fewer (the running intersection
    over prefixes), `arm_interval`'s exact ends lie within the grid path's (rounded outward), and
    the interval depends on the order of the returns (so the evidence fixes one: their start)."""
    rng = np.random.default_rng(9)
    x = np.clip(rng.normal(60.0, 20.0, 500), 0.0, 100.0)
    low, high = arm_interval_path(x, 0.0, 100.0, 0.025)
    assert (np.diff(low) >= 0).all() and (np.diff(high) <= 0).all()
    for n in (30, 100, 500):
        exact = arm_interval(x[:n], 0.0, 100.0, 0.025)
        assert (
            low[n - 1] <= exact[0] <= exact[1] <= high[n - 1] and exact[1] - exact[0] < high[n - 1] - low[n - 1] + 1e-9
        )
    assert arm_interval(np.sort(x), 0.0, 100.0, 0.025) != arm_interval(x, 0.0, 100.0, 0.025)
    assert arm_interval([], 0.0, 100.0, 0.025) == (0.0, 100.0)


def test_the_rules_edges():
    rule = CanaryRule(min_episodes=30, max_exposure=100, max_wait_s=60.0, return_min=-1.0, return_max=6.0)
    worse, better = ArmStats.of([0.0, 0.1] * 10), ArmStats.of([5.0, 5.1] * 10)
    # clear evidence but below the minimum episodes: no decision
    assert judge(worse, better, rule, 1.0).decision == "continue"
    big_worse, big_better = ArmStats.of([0.0, 0.1] * 20), ArmStats.of([5.0, 5.1] * 20)
    v = judge(big_worse, big_better, rule, 1.0)
    assert v.decision == "rollback" and "is below 0: the canary is worse" in v.reason and v.high < 0
    v = judge(big_better, big_worse, rule, 1.0)
    assert v.decision == "promote" and v.low > 0
    # a canary proven worse by less than the margin is promoted (the margin is what is accepted)
    within = dataclasses.replace(rule, margin=1.0, max_exposure=10_000)
    slightly_worse, base = ArmStats.of([2.0] * 4000), ArmStats.of([2.5] * 4000)
    v = judge(slightly_worse, base, within, 1.0)
    assert v.high < 0 and v.low >= -1.0 and v.decision == "promote"
    # without a return range there is no bound: never promoted, rolled back at the exposure
    unranged = dataclasses.replace(rule, return_min=None, return_max=None)
    many_better, many_worse = ArmStats.of([5.0, 5.1] * 50), ArmStats.of([0.0, 0.1] * 200)
    v = judge(many_better, many_worse, unranged, 1.0)
    assert v.decision == "rollback" and v.low is None and "maximum exposure" in v.reason
    # returns outside the range are clipped and counted
    clipped = ArmStats()
    for x in (-5.0, 0.0, 9.0):
        clipped.add(x, rule.return_min, rule.return_max)
    assert (clipped.n, clipped.clipped, clipped.mean) == (3, 2, pytest.approx(5.0 / 3))
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
    with pytest.raises(ValueError, match=r"needs both its minimum and its maximum"):
        CanaryRule(return_min=0.0)


# ------------------------------------------------------------------------ evidence from shards


def _arm_id(prefix: str, canary: bool, share: float = 0.5) -> str:
    """An episode id the canary hash puts in the canary arm (or not) at `share`."""
    return next(f"{prefix}-{i}" for i in range(10_000) if in_canary(f"{prefix}-{i}", share) == canary)


def _episode(
    version: int, rewards: list[float], started_ms: int, eid: str, assigned_to=None, share: float = 0.5, sha256=None
):
    """A finished toy episode; `assigned_to`: the canary version whose assignment (by the hash
    of `eid` at `share`; with the canary's `sha256`) it logs in its reset info, as a service that
    opted in does."""
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
    if assigned_to is not None:
        info = assignment_info(assigned_to, share, in_canary(eid, share), sha256)
        ep = dataclasses.replace(ep, infos=[info, *ep.infos[1:]])
    return dataclasses.replace(ep, started_ms=started_ms, ended_ms=started_ms + 10)


def test_the_evidence_is_the_two_versions_episodes_since_the_start_and_the_test_resumes(tmp_path):
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.rollout import CanaryRun

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    t0 = 1_000_000.0
    before = [_episode(4, [9.0, 9.0], int(t0 * 1000) - 5, _arm_id("old", False), 5)]  # began before the canary
    arms = [
        _episode(4, [1.0, 1.0], int(t0 * 1000) + 1, _arm_id("d1", False), 5),
        _episode(4, [1.0, 0.0], int(t0 * 1000) + 2, _arm_id("d2", False), 5),
        _episode(5, [2.0, 2.0], int(t0 * 1000) + 3, _arm_id("c1", True), 5),
        _episode(3, [7.0], int(t0 * 1000) + 4, _arm_id("other", True), 5),  # another version
        _episode(4, [8.0], int(t0 * 1000) + 5, "opted-out"),  # a service that did not opt in: no assignment
        _episode(4, [8.0], int(t0 * 1000) + 6, _arm_id("d3", False), 4),  # another canary's assignment
        _episode(4, [8.0], int(t0 * 1000) + 7, _arm_id("d4", True), 5),  # the hash puts it in the canary arm
    ]
    committer.commit(before + arms)
    rule = CanaryRule(min_episodes=3, max_wait_s=60.0, episode_max_s=0.0, share=0.5)
    run = CanaryRun(version=5, base_version=4, started=t0, gamma=0.5, rule=rule)
    v = run.look(uri, now=t0 + 1)
    assert (v.canary.n, v.deployed.n) == (1, 2)
    assert v.canary.mean == pytest.approx(3.0)  # 2 + 0.5 * 2
    assert v.deployed.mean == pytest.approx((1.5 + 1.0) / 2)
    assert v.decision == "continue"

    # a checkpoint's record, restored by --resume: the same test, the same evidence, one more shard
    resumed = CanaryRun.from_state(run.to_state())
    assert (resumed.started, resumed.rule, resumed.history) == (run.started, run.rule, run.history)
    committer.commit([_episode(5, [2.0, 2.0], int(t0 * 1000) + 10, _arm_id("c2", True), 5)])
    v2 = resumed.look(uri, now=t0 + 2)
    assert (v2.canary.n, v2.deployed.n) == (2, 2)
    assert len(resumed.history) == 2
    # past the wall clock with too few episodes: rolled back, loudly
    v3 = resumed.look(uri, now=t0 + 61)
    assert v3.decision == "rollback" and v3.reason.startswith(NO_TRAFFIC)
    assert "3 episodes of v5/v4 logged no assignment of this canary" in v3.reason  # what to fix, said
    record = resumed.decision_record(v3, now=t0 + 61)
    assert (record["canary_version"], record["episodes_canary"], record["decision"]) == (5, 2, "rollback")
    assert record["unassigned"] == 3


def test_a_test_without_a_stated_range_fixes_one_from_the_episodes_before_its_start(tmp_path):
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.rollout import CanaryRun

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    t0 = 4_000_000_000.0  # shards committed now are before it
    committer.commit([_episode(4, [float(i % 5)], 1000 + i, f"h{i}") for i in range(40)])
    run = CanaryRun(version=5, base_version=4, started=t0, gamma=0.5, rule=CanaryRule(min_episodes=3))
    run.look(uri, now=t0 + 1)
    assert (run.rule.return_min, run.rule.return_max) == (-1.0, 5.0)  # [0, 4] widened by a quarter each side
    assert CanaryRun.from_state(run.to_state()).rule == run.rule  # fixed for the rest of the test
    few = ShardCommitter(str(tmp_path / "few"))
    few.claim()
    few.commit([_episode(4, [1.0], 1000 + i, f"f{i}") for i in range(5)])
    bare = CanaryRun(version=5, base_version=4, started=t0, gamma=0.5, rule=CanaryRule(min_episodes=3))
    bare.look(str(tmp_path / "few"), now=t0 + 1)
    assert not bare.rule.has_range  # too little history: no bound (rolled back by its limits only)


def test_only_the_randomized_split_of_services_that_opted_in_is_evidence(tmp_path):
    """Service A opts in at 0.2; service B does not and has harder traffic (returns 1.0 lower
    under either version); the canary is 0.3 worse on every episode. Counting every base-version
    episode as the control compares populations and promotes the worse canary; counting only the
    episodes that log the canary's assignment compares versions and rolls it back."""
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.canary_evidence import CanaryEvidence

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    t0 = 1_000_000.0
    rng = np.random.default_rng(3)
    eps = []
    for i in range(6000):
        eid = f"a{i}"
        canary = in_canary(eid, 0.2)
        ret = float(rng.uniform(0.5, 1.5)) - (0.3 if canary else 0.0)
        eps.append(_episode(2 if canary else 1, [ret], int(t0 * 1000) + i, eid, 2, share=0.2))
        ret_b = float(rng.uniform(0.5, 1.5)) - 1.0
        eps.append(_episode(1, [ret_b], int(t0 * 1000) + i, f"b{i}"))  # B: no assignment logged
    committer.commit(eps)
    ev = CanaryEvidence(uri, version=2, base_version=1, started=t0, gamma=0.9, share=0.2)
    canary, deployed = ev.refresh(-1.0, 2.0)
    # A's canary episodes all count (score < 0.2), its deployed ones from score 0.5 (the test's band)
    scores = [canary_score(f"a{i}") for i in range(6000)]
    assert canary.n == sum(x < 0.2 for x in scores) and deployed.n == sum(x >= 0.5 for x in scores)
    assert ev.unassigned == 6000 and ev.outside_share == sum(0.2 <= x < 0.5 for x in scores)
    assert ev.misconfigured == 0  # a service at the test's share: outside the band by design, no warning
    rule = CanaryRule(return_min=-1.0, return_max=2.0, max_exposure=4000)
    v = judge(canary, deployed, rule, 10.0)
    assert v.decision == "rollback" and v.high < 0


@pytest.mark.parametrize("episode_max_s", [3700.0, 0.0])
def test_slow_failures_are_in_the_evidence_before_a_decision(tmp_path, episode_max_s):
    """Episodes reach the store when they end, and in RL slow episodes are often the failures:
    the canary's episodes end after 60 s with return 1.9 (80 %) or hang to the 1-hour limit
    with -3 (20 %: truly 0.08 worse than deployed's 60-s episodes at 1.0). Looking at whatever
    has been committed promotes it before the first slow failure ends; counting only complete
    cohorts (episodes that started at least episode_max_s ago) never does."""
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.rollout import CanaryRun

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    t0 = 1_000_000.0
    rng = np.random.default_rng(5)
    episodes = []  # (end time, episode)
    for i in range(6000):
        eid = f"e{i}"
        start = t0 + i / 2  # two episodes begin every second
        if in_canary(eid, 0.2):
            ret, length = (-3.0, 3600.0) if rng.random() < 0.2 else (1.9, 60.0)
        else:
            ret, length = float(np.clip(rng.normal(1.0, 0.3), 0.0, 2.0)), 60.0
        ep = _episode(2 if in_canary(eid, 0.2) else 1, [ret], int(start * 1000), eid, 2, share=0.2)
        episodes.append((start + length, dataclasses.replace(ep, ended_ms=int((start + length) * 1000))))
    episodes.sort(key=lambda x: x[0])
    rule = CanaryRule(min_episodes=30, max_exposure=5000, return_min=-3.0, return_max=2.0, episode_max_s=episode_max_s)
    run = CanaryRun(version=2, base_version=1, started=t0, gamma=0.9, rule=rule)
    decision, k = None, 0
    for now in np.arange(t0 + 120, t0 + 7000, 120.0):
        batch = []
        while k < len(episodes) and episodes[k][0] <= now:
            batch.append(episodes[k][1])
            k += 1
        if batch:
            committer.commit(batch)
        v = run.look(uri, now=float(now))
        if v.decision != "continue":
            decision = (v.decision, float(now - t0))
            break
    if episode_max_s:
        assert decision is None or decision[0] == "rollback"
    else:  # what looking at whatever has ended does: the worse canary is promoted before its slow failures end
        assert decision is not None and decision[0] == "promote" and decision[1] < 3600


def test_a_consumer_clock_behind_the_trainers_loses_no_evidence(tmp_path):
    """A shard's commit time is the consumer's clock: one a minute behind the trainer's stamps a
    shard of episodes that began after the canary's start as committed before it. It is read."""
    import time

    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.canary_evidence import CanaryEvidence

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    started = time.time() + 60.0  # the trainer's clock is a minute ahead of the consumer's
    committer.commit([_episode(5, [1.0], int(started * 1000) + 1, _arm_id("c", True), 5)])
    canary, _deployed = CanaryEvidence(uri, version=5, base_version=4, started=started, gamma=0.9, share=0.5).refresh()
    assert canary.n == 1


def test_the_evidence_only_grows_when_shards_are_compacted_or_removed(tmp_path, monkeypatch):
    """A shard merged into another (its episodes committed again) adds nothing; a shard that
    retention or compaction removes keeps what it gave: the looked-at samples stay nested."""
    from types import SimpleNamespace

    from rlrec.store import snapshot
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.canary_evidence import CanaryEvidence

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    t0 = 1_000_000.0
    eps = [_episode(5, [1.0], int(t0 * 1000) + i, _arm_id(f"c{i}", True), 5) for i in range(3)]
    eps += [_episode(4, [0.0], int(t0 * 1000) + i, _arm_id(f"d{i}", False), 5) for i in range(4)]
    committer.commit(eps)
    ev = CanaryEvidence(uri, version=5, base_version=4, started=t0, gamma=0.9, share=0.5)
    assert [a.n for a in ev.refresh()] == [3, 4]
    committer.commit(eps)  # the same episodes in a merged shard
    assert [a.n for a in ev.refresh()] == [3, 4]
    monkeypatch.setattr(snapshot, "open_snapshot", lambda storage: SimpleNamespace(entries=[]))  # all removed
    assert [a.n for a in ev.refresh()] == [3, 4]


def test_services_at_different_fractions_give_both_arms_the_same_population(tmp_path):
    """Service A (easy traffic) opts in at 0.5, service B (1.0 harder) at 0.05; the canary is 0.3
    worse on every episode. Pooled as served, the canary arm is mostly A's traffic and the deployed
    arm mostly B's, and the worse canary is promoted; counted in the test's band (share 0.05) both
    arms hold A and B alike and it is rolled back."""
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.canary_evidence import CanaryEvidence

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    t0 = 1_000_000.0
    rng = np.random.default_rng(3)
    eps = []
    for i in range(3000):
        for svc, frac, shift in (("a", 0.5, 0.0), ("b", 0.05, -1.0)):
            eid = f"{svc}{i}"
            canary = in_canary(eid, frac)
            ret = float(rng.uniform(0.5, 1.5)) + shift - (0.3 if canary else 0.0)
            eps.append(_episode(2 if canary else 1, [ret], int(t0 * 1000) + i, eid, 2, share=frac))
    committer.commit(eps)
    rule = CanaryRule(return_min=-1.0, return_max=2.0, max_exposure=4000, share=0.05)
    ev = CanaryEvidence(uri, version=2, base_version=1, started=t0, gamma=0.9, share=rule.share)
    canary, deployed = ev.refresh(rule.return_min, rule.return_max)
    assert ev.outside_share > 0 and abs(canary.mean - deployed.mean + 0.3) < 0.15  # the true difference
    assert judge(canary, deployed, rule, 10.0).decision != "promote"
    # a service whose fraction lies outside [share, 0.5] gives nothing: its arms are not the test's split
    wide = CanaryEvidence(uri, version=2, base_version=1, started=t0, gamma=0.9, share=0.1)
    c, d = wide.refresh(rule.return_min, rule.return_max)
    assert all(e.startswith("a") for e in wide._episodes) and c.n and d.n
    # only that service's episodes are why the trainer warns; services within [share, 0.5] never are
    assert ev.misconfigured == 0 and wide.misconfigured == 3000  # every episode of B (0.05 < 0.1)


def test_a_canary_return_below_the_range_rolls_it_back_and_voids_promotion(tmp_path):
    """The range comes from the deployed version's history (U(0, 10)); the canary returns 10 in
    97 % of episodes and -1000 in 3 % (true mean -20.3 against 5.0). Clipped to the range's minimum,
    the -1000s made it look better and it was promoted; a canary return below the range rolls it
    back at once, and a deployed return above the range forbids promotion."""
    import time

    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.rollout import CanaryRun

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    rng = np.random.default_rng(1)
    committer.commit([_episode(1, [float(rng.uniform(0, 10))], 1000 + i, f"h{i}") for i in range(200)])
    time.sleep(0.05)
    t0 = time.time()
    eps = []
    for i in range(4000):
        eid = f"e{i}"
        if in_canary(eid, 0.2):
            ret = -1000.0 if rng.random() < 0.03 else 10.0
            eps.append(_episode(2, [ret], int(t0 * 1000) + i, eid, 2, share=0.2))
        else:
            eps.append(_episode(1, [float(rng.uniform(0, 10))], int(t0 * 1000) + i, eid, 2, share=0.2))
    committer.commit(eps)
    run = CanaryRun(version=2, base_version=1, started=t0, gamma=1.0, rule=CanaryRule(episode_max_s=0.0, share=0.2))
    v = run.look(uri, now=t0 + 100)
    assert run.rule.return_min > -1000 and v.canary.below > 0
    assert v.decision == "rollback" and "below the test's range" in v.reason
    record = run.decision_record(v, now=t0 + 100)
    assert record["below_range_canary"] == v.canary.below

    rule = CanaryRule(return_min=0.0, return_max=1.0, min_episodes=2)
    better, deployed = ArmStats(), ArmStats()
    for x in [1.0] * 500:
        better.add(x, 0.0, 1.0)
    for x in [0.0] * 499 + [50.0]:  # one deployed return far above the range
        deployed.add(x, 0.0, 1.0)
    v = judge(better, deployed, rule, 10.0)
    assert v.low > 0 and v.decision == "continue"
    deployed.above = 0
    assert judge(better, deployed, rule, 10.0).decision == "promote"


@pytest.mark.parametrize("stated_s", [30 * 365 * 86400.0, 6 * 86400.0])
def test_an_episode_stating_a_huge_length_cannot_stall_the_canary(tmp_path, stated_s):
    """One deployed-arm episode whose end its producer stamped years (or days, within the longest
    canary) after its start: the cohort rule waits for the longest episode seen, so no episode
    counted and the limits, counted from the cohort's end, never fired -- the canary stayed
    undecided forever. An episode longer than a canary may run is not trusted as the longest, and
    the limits count on the wall clock: the worse canary is rolled back within a day."""
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.rollout import CanaryRun

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    t0 = 1_000_000.0
    rng = np.random.default_rng(0)
    eps = []
    for i in range(3000):
        eid = f"e{i}"
        canary = in_canary(eid, 0.2)
        ret = float(np.clip(rng.normal(0.0 if canary else 1.0, 0.3), -2.0, 3.0))  # canary clearly worse
        eps.append(_episode(2 if canary else 1, [ret], int(t0 * 1000) + i * 100, eid, 2, share=0.2))
    eid = next(f"x{i}" for i in range(1000) if not in_canary(f"x{i}", 0.2) and canary_score(f"x{i}") >= 0.5)
    slow = _episode(1, [1.0], int(t0 * 1000) + 5, eid, 2, share=0.2)
    eps.append(dataclasses.replace(slow, ended_ms=slow.started_ms + int(stated_s * 1000)))
    committer.commit(eps)
    run = CanaryRun(
        version=2, base_version=1, started=t0, gamma=1.0, rule=CanaryRule(return_min=-2.0, return_max=3.0, share=0.2)
    )
    decisions = [run.look(uri, now=t0 + days * 86400).decision for days in (0.1, 1.0)]
    assert decisions[-1] == "rollback", decisions


def test_without_a_stated_episode_length_the_cohort_waits_twice_the_longest_history_episode(tmp_path):
    """The deployed version's episodes sometimes run to a 1-hour time limit: without
    --canary-episode-max-s the test waits twice the longest episode before the start (7200 s, kept
    in the checkpoint), not a fixed 900 s that would count the fast episodes before the slow ones
    end; with no history it waits the floor, 900 s."""
    import time

    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.rollout import CanaryRun
    from rlrec.trainer.sequential import EPISODE_MAX_S_FLOOR

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    now_ms = int(time.time() * 1000)
    history = []
    for i in range(40):
        ep = _episode(1, [1.0], now_ms - 4_000_000 + i, f"h{i}")
        length_ms = 3_600_000 if i % 10 == 0 else 60_000
        history.append(dataclasses.replace(ep, ended_ms=ep.started_ms + length_ms))
    committer.commit(history)
    t0 = time.time() + 1.0
    rule = CanaryRule(return_min=0.0, return_max=2.0)
    run = CanaryRun(version=2, base_version=1, started=t0, gamma=1.0, rule=rule)
    run.look(uri, now=t0 + 10)
    assert run.rule.episode_max_s == pytest.approx(7200.0, abs=1.0)
    assert CanaryRun.from_state(run.to_state()).rule.episode_max_s == run.rule.episode_max_s
    assert run.cohort_end(t0 + 8000) == pytest.approx(t0 + 800, abs=1.0)

    ShardCommitter(str(tmp_path / "none")).claim()  # a store with no episodes yet
    empty = CanaryRun(version=2, base_version=1, started=t0, gamma=1.0, rule=rule)
    empty.look(str(tmp_path / "none"), now=t0 + 10)
    assert empty.rule.episode_max_s == EPISODE_MAX_S_FLOOR


def test_another_roots_canary_of_the_same_number_is_no_evidence(tmp_path):
    """Prod's and staging's trainers both reach v2; their services record into one store under one
    policy id. Only episodes whose logged assignment names this canary's identity (the sha256 of
    its policy.json) count: staging's better v2 cannot promote prod's worse one."""
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.canary_evidence import CanaryEvidence

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    t0 = 1_000_000.0
    prod, staging = "a" * 64, "b" * 64
    eps = []
    for i in range(400):
        for who, sha, bonus in (("p", prod, -0.5), ("s", staging, 1.0)):
            eid = f"{who}{i}"
            canary = in_canary(eid, 0.5)
            ret = 1.0 + (bonus if canary else 0.0)
            eps.append(_episode(2 if canary else 1, [ret], int(t0 * 1000) + i, eid, 2, 0.5, sha))
    committer.commit(eps)
    ev = CanaryEvidence(uri, version=2, base_version=1, started=t0, gamma=0.9, share=0.5, sha256=prod)
    canary, deployed = ev.refresh(0.0, 3.0)
    assert canary.n + deployed.n == 400 and ev.unassigned == 400
    assert canary.mean == pytest.approx(0.5) and deployed.mean == pytest.approx(1.0)


def test_the_maximum_exposure_counts_every_ended_canary_episode(tmp_path):
    """Episodes of the last --canary-episode-max-s are not in the complete cohort yet, but they
    were served: the exposure limit counts every canary episode that ended, so an undecided canary
    is rolled back when it served the stated number, not that plus the cohort's lag."""
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.rollout import CanaryRun

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    t0 = 1_000_000.0
    eps = []
    for i in range(400):
        eid = f"e{i}"
        canary = in_canary(eid, 0.5)
        eps.append(_episode(2 if canary else 1, [1.0], int(t0 * 1000) + 1000 * i, eid, 2, 0.5))
    committer.commit(eps)
    rule = CanaryRule(return_min=0.0, return_max=1000.0, max_exposure=150, episode_max_s=300.0, share=0.5)
    run = CanaryRun(version=2, base_version=1, started=t0, gamma=1.0, rule=rule)
    v = run.look(uri, now=t0 + 400)  # episodes that started in the first 100 s form the cohort
    assert v.canary.n < 150 <= sum(in_canary(f"e{i}", 0.5) for i in range(400))
    assert v.decision == "rollback" and "maximum exposure" in v.reason and "ended" in v.reason


def test_a_nan_return_is_counted_not_added():
    """A NaN return (finite hostile rewards summing to inf - inf) made an arm's mean NaN for the
    rest of the canary, so its bound never decided again; it is counted and left out. An
    infinitely bad return is below any range (the canary is rolled back)."""
    rule = CanaryRule(return_min=0.0, return_max=1.0, min_episodes=2)
    canary, deployed = ArmStats(), ArmStats()
    for x in [1.0] * 300 + [math.nan]:
        canary.add(x, 0.0, 1.0)
    for x in [0.0] * 300:
        deployed.add(x, 0.0, 1.0)
    assert canary.nan == 1 and canary.n == 300 and canary.mean == 1.0
    assert judge(canary, deployed, rule, 10.0).decision == "promote"
    canary.add(-math.inf, 0.0, 1.0)
    assert judge(canary, deployed, rule, 10.0).decision == "rollback"


def test_the_evidence_adds_each_arm_in_the_order_its_episodes_started(tmp_path):
    """The bound depends on the order of the returns: the evidence adds them by start time (then
    episode id), not by the commit order of their shards (short episodes commit first), so every
    look and a restarted trainer see prefixes of one sequence."""
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.canary_evidence import CanaryEvidence

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    t0 = 1_000_000.0
    ids = [_arm_id(f"c{i}", True) for i in range(4)]
    committer.commit([_episode(5, [float(i)], int(t0 * 1000) + 10 * i, ids[i], 5) for i in (2, 3)])
    committer.commit([_episode(5, [float(i)], int(t0 * 1000) + 10 * i, ids[i], 5) for i in (1, 0)])
    canary, _ = CanaryEvidence(uri, version=5, base_version=4, started=t0, gamma=0.9, share=0.5).refresh()
    assert canary.values == [0.0, 1.0, 2.0, 3.0]
    restarted, _ = CanaryEvidence(uri, version=5, base_version=4, started=t0, gamma=0.9, share=0.5).refresh()
    assert restarted.values == canary.values


def test_the_exposure_counts_every_served_canary_episode_band_or_not(tmp_path):
    """Services at canary_fraction 0.5 with the test's band at 0.05 serve ten times the canary
    episodes the test counts: the maximum exposure counted only the band (21,097 served for a
    stated 2,000), and a return below the range outside the band never rolled the canary back.
    Every episode of this canary, band or not (and one logging no assignment), is exposure;
    one below the range anywhere rolls it back."""
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.canary_evidence import CanaryEvidence

    uri = str(tmp_path / "store")
    committer = ShardCommitter(uri)
    committer.claim()
    t0 = 1_000_000.0
    eps = []
    for i in range(2000):
        eid = f"e{i}"
        v = 2 if in_canary(eid, 0.5) else 1
        eps.append(_episode(v, [0.5], int(t0 * 1000) + i, eid, 2, share=0.5))
    eps.append(_episode(2, [0.5], int(t0 * 1000) + 1, "forgot-info"))  # the canary, no assignment logged
    committer.commit(eps)
    ev = CanaryEvidence(uri, version=2, base_version=1, started=t0, gamma=0.9, share=0.05)
    canary, _deployed = ev.refresh(-1.0, 2.0)
    served = sum(in_canary(f"e{i}", 0.5) for i in range(2000)) + 1
    assert canary.n < served / 5 and ev.served_canary == served and ev.below_outside == 0
    outside = next(f"e{i}" for i in range(2000, 9000) if in_canary(f"e{i}", 0.5) and not in_canary(f"e{i}", 0.05))
    committer.commit([_episode(2, [-50.0], int(t0 * 1000) + 5, outside, 2, share=0.5)])
    ev.refresh(-1.0, 2.0)
    assert ev.below_outside == 1 and ev.served_canary == served + 1
