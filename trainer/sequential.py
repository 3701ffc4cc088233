"""An always-valid two-sample test of a canary: does the candidate's mean return beat the deployed one's?

Returns are bounded: each arm's discounted returns are clipped into a stated range
``[return_min, return_max]`` (``--canary-return-min/--canary-return-max``, or fixed from the
episodes before the canary started, `CanaryRun`). The bound is about the clipped returns, so a
clip in the canary's favour voids it: a canary return below the range rolls the canary back at
once (unless the deployed arm had one too), and a deployed return above it forbids a promotion.
Clips the other way only make a promotion harder.

**Each arm's bound** is the betting confidence sequence of Waudby-Smith and Ramdas (2023,
"Estimating means of bounded random variables by betting", JRSS-B, §4: the hedged capital
process with predictable plug-in bets), at level ``a = alpha / 2`` per arm. The returns are
scaled to ``x_i`` in [0, 1]; for a candidate mean ``m`` a gambler who bets that the mean is
above ``m`` holds the capital ``K+_t(m) = prod_{i<=t} (1 + l_i(m) (x_i - m))`` after t episodes,
with the bet ``l_i(m) = min(l_i, c / m)`` (``c`` = `BET_CAP`) and ``l_i`` fixed from the episodes
before i only (predictable): ``sqrt(2 log(2 / a) / (s2_{i-1} T))`` with the running variance
estimate ``s2 = (1/4 + sum (x_j - mu_j)^2) / (t + 1)`` around the running mean
``mu = (1/2 + sum x_j) / (t + 1)``. The capital is averaged over the target times ``T`` in
`TARGET_EPISODES` (a mixture of bettors: tight near each of them, so at every n within a
factor of the best single one). Symmetrically ``K-_t(m)`` bets below ``m``. If ``m`` is the true
mean, both are nonnegative martingales, and by Ville's inequality either ever reaches
``2 / a`` with probability at most ``a / 2``; so the set of ``m`` neither has *ever* reached it
(the running intersection over every prefix of the sequence) holds the true mean at every n at
once with probability at least 1 - a -- **however often it is looked at, at every n, not
only asymptotically**. `K+` falls as ``m`` grows (and `K-` rises), so that set is an interval;
its ends are found by bisection to ``2**-20`` of the range (`BISECT_STEPS`), rounded outward. The bets follow the
returns' spread (a variance-adaptive, empirical-Bernstein-like width): a low-variance arm is
resolved in a few hundred episodes (the simulations in `tests/test_canary_sequential.py`), while
a sample whose returns so far are all equal (capped episodes, a sparse reward that has not
fired) is not taken as exact: the running variance starts at the range's worst case, 1/4.
The difference canary - deployed lies in ``[low_c - high_d, high_c - low_d]`` (both arms'
intervals hold at once with probability at least 1 - alpha).

**The order of the episodes.** The martingale argument needs each arm's returns taken in an
order that does not depend on their values, and the same order at every look (and after a
restart), so that every look sees a prefix of one sequence. `ArmStats` keeps the returns in the
order they were added, and `rlrec.trainer.canary_evidence.CanaryEvidence` adds them by the
episode's start time (``started_ms``, then the episode id): an episode's start is fixed before
its return is drawn (the order cannot favour good or bad episodes, as the commit order of
shards would: short episodes commit first), it is in the data (a restarted trainer re-reads the
same sequence), and the cohort rule counts exactly the episodes that started by a cut
(`CanaryRule.episode_max_s`), so each look's sample is the prefix of the start-ordered sequence
up to that cut -- as long as the cohort is complete, the assumption the cut itself rests on.
Without a range no bound is computed and the canary is decided only by its limits (rolled back).
`tests/test_canary_sequential.py` simulates continuous peeking on normal, degenerate (capped),
sparse and skewed returns and checks that the rates of wrong decisions, and of intervals that
ever miss the true mean, stay below alpha.

`judge` applies the rules of ``rlrec train --rollout canary``: promote when the lower bound clears
``-margin`` (with at least `min_episodes` per arm; a canary proven worse by less than the margin
is promoted: the margin is what the user accepts), roll back when the upper bound is below 0, roll back undecided after `max_exposure` canary episodes, and roll back
when `max_wait_s` passed without enough episodes in either arm. Pure logic: numpy only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rlrec.trainer.canary import SHARE_MAX

__all__ = [
    "BET_CAP",
    "BISECT_STEPS",
    "EPISODE_MAX_S_FLOOR",
    "NO_TRAFFIC",
    "TARGET_EPISODES",
    "ArmStats",
    "CanaryRule",
    "Verdict",
    "arm_interval",
    "arm_interval_path",
    "difference_bounds",
    "ever_misses",
    "judge",
]

#: the least `CanaryRule.episode_max_s` taken from the history when none is stated
EPISODE_MAX_S_FLOOR = 900.0

#: what a canary rolled back for lack of episodes says (loudly)
NO_TRAFFIC = "no canary traffic: services must opt in with canary_fraction"

#: the most a bet stakes: each factor of the capital is at least ``1 - BET_CAP``
BET_CAP = 0.75
#: the numbers of episodes at which the mixture's bettors are tightest (module docstring)
TARGET_EPISODES = (8, 32, 128, 512, 2048, 8192)
#: the bisection steps of an interval's ends (to 2**-BISECT_STEPS of the range)
BISECT_STEPS = 20
#: elements of one (bettors x runs x episodes x candidate means) block (memory of a path)
_BLOCK = 4_000_000


@dataclass
class ArmStats:
    """Running count, mean and sum of squared deviations of one arm's returns (Welford).

    Example:
        >>> a = ArmStats()
        >>> for x in (1.0, 2.0, 3.0):
        ...     a.add(x)
        >>> a.n, a.mean, a.variance
        (3, 2.0, 1.0)
    """

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    clipped: int = 0  # returns outside the rule's range, counted at the nearest end
    below: int = 0  # of those, below the range's minimum
    above: int = 0  # of those, above its maximum
    least: float | None = None  # the least return added, before clipping
    nan: int = 0  # returns that were NaN: not added (an infinite one is clipped like any other)
    values: list[float] = field(default_factory=list, repr=False)  # the returns added, in order, clipped

    def add(self, x: float, lo: float | None = None, hi: float | None = None) -> None:
        """Add one return (clipped into ``[lo, hi]`` when given; each clip is counted, by side;
        a NaN return is counted in `nan` and not added)."""
        x = float(x)
        if math.isnan(x):
            self.nan += 1
            return
        self.least = x if self.least is None else min(self.least, x)
        if lo is not None and hi is not None and not lo <= x <= hi:
            self.below += x < lo
            self.above += x > hi
            x = min(max(x, lo), hi)
            self.clipped += 1
        self.values.append(x)
        self.n += 1
        d = float(x) - self.mean
        self.mean += d / self.n
        self.m2 += d * (float(x) - self.mean)

    @property
    def variance(self) -> float:
        """The sample variance (n - 1 in the denominator); inf below two episodes."""
        return self.m2 / (self.n - 1) if self.n > 1 else math.inf

    @classmethod
    def of(cls, values: list[float]) -> ArmStats:
        a = cls()
        for x in values:
            a.add(x)
        return a

    def to_dict(self) -> dict:
        """The counts and moments (not the returns)."""
        d = asdict(self)
        del d["values"]
        return d


def _scaled(values: Any, lo: float, hi: float) -> np.ndarray:
    """Returns scaled from ``[lo, hi]`` to [0, 1] (clipped: a value outside counts at the nearest end)."""
    return np.clip((np.asarray(values, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)


def _bets(x: np.ndarray, a: float) -> np.ndarray:
    """The predictable plug-in bets ``l_i`` of each bettor (module docstring): shape
    ``(len(TARGET_EPISODES), *x.shape)``, each from the returns before i only."""
    t = np.arange(1, x.shape[-1] + 1, dtype=np.float64)
    mu = (0.5 + np.cumsum(x, axis=-1)) / (t + 1.0)
    s2 = (0.25 + np.cumsum((x - mu) ** 2, axis=-1)) / (t + 1.0)
    before = np.concatenate([np.full((*x.shape[:-1], 1), 0.25), s2[..., :-1]], axis=-1)
    targets = np.asarray(TARGET_EPISODES, dtype=np.float64).reshape((-1,) + (1,) * x.ndim)
    return np.sqrt(2.0 * math.log(2.0 / a) / (before[None] * targets))


def _log_capital(x: np.ndarray, bets: np.ndarray, m: np.ndarray, path: bool) -> np.ndarray:
    """The running maximum of ``log K+_t(m)`` (the mixture's capital betting above `m`) for
    returns `x` (``(..., n)``, in [0, 1]) and candidate means `m` (``(..., G)``): its value
    after the last episode, ``(..., G)``, or after each, ``(..., n, G)`` with `path`."""
    xm = x[..., :, None] - m[..., None, :]  # (..., n, G)
    with np.errstate(divide="ignore"):
        cap = BET_CAP / m  # m = 0: no cap (the factor 1 + l x is at least 1)
    stake = np.minimum(bets[..., :, None], cap[None, ..., None, :])  # (D, ..., n, G)
    logk = np.cumsum(np.log1p(stake * xm[None]), axis=-2)
    top = logk.max(axis=0)
    mixed = top + np.log(np.exp(logk - top[None]).mean(axis=0))  # log of the bettors' mean capital
    return np.maximum.accumulate(mixed, axis=-2) if path else mixed.max(axis=-2)


def _lower_end(x: np.ndarray, a: float) -> np.ndarray:
    """The lower end of the interval of each row of `x` (``(..., n)`` in [0, 1]) after its last
    episode: the greatest ``m`` found by bisection (to ``2**-BISECT_STEPS``) whose `K+` ever
    reached ``2 / a``, 0 when none did. `K+` falls as ``m`` grows, so the excluded means form
    ``[0, end)``; the end returned is an excluded mean (rounded outward)."""
    bets = _bets(x, a)
    threshold = math.log(2.0 / a)
    batch = x.shape[:-1]
    low, high = np.zeros(batch), np.ones(batch)  # low excluded (or 0), high never is (K+(1) <= 1)
    any_excluded = _log_capital(x, bets, low[..., None], path=False)[..., 0] >= threshold
    for _ in range(BISECT_STEPS):
        mid = (low + high) / 2.0
        excluded = _log_capital(x, bets, mid[..., None], path=False)[..., 0] >= threshold
        low, high = np.where(excluded, mid, low), np.where(excluded, high, mid)
    return np.where(any_excluded, low, 0.0)


def arm_interval(values: Any, lo: float, hi: float, alpha: float) -> tuple[Any, Any]:
    """One arm's always-valid interval for the mean of `values` (in the order given, clipped into
    ``[lo, hi]``) at level 1 - `alpha`, after the last one: the running intersection over every
    prefix (module docstring). A 2-d array gives one interval per row (simulations).

    Args:
        values: the returns, in the order they were drawn (``(n,)`` or ``(runs, n)``).
        lo: the least return of the range.
        hi: the greatest.
        alpha: the probability that the interval ever misses the mean.

    Example:
        >>> [round(x, 3) for x in arm_interval([0.5] * 200, 0.0, 1.0, 0.025)]
        [0.484, 0.516]
        >>> [round(x, 3) for x in arm_interval([0.0, 1.0] * 100, 0.0, 1.0, 0.025)]
        [0.381, 0.618]
    """
    x = _scaled(values, lo, hi)
    if x.shape[-1] == 0:
        low, high = np.zeros(x.shape[:-1]), np.ones(x.shape[:-1])
    else:
        low, high = _lower_end(x, alpha), 1.0 - _lower_end(1.0 - x, alpha)
    low, high = lo + (hi - lo) * low, lo + (hi - lo) * high
    return (float(low), float(high)) if np.ndim(low) == 0 else (low, high)


def arm_interval_path(values: Any, lo: float, hi: float, alpha: float, grid: int = 200) -> tuple[Any, Any]:
    """`arm_interval` after *every* episode (``(..., n)`` arrays, rows of a 2-d `values` apart),
    on a grid of `grid` + 1 candidate means over the range, rounded outward to it (so a little
    wider than `arm_interval`'s): for simulations that look after every episode.

    Example:
        >>> low, high = arm_interval_path([0.0, 1.0] * 100, 0.0, 1.0, 0.025)
        >>> float(low[-1]), float(high[-1]), bool((low[1:] >= low[:-1]).all())
        (0.38, 0.62, True)
    """
    x = _scaled(values, lo, hi)
    flat = x.reshape(-1, x.shape[-1])
    g = np.linspace(0.0, 1.0, grid + 1)
    rows = max(1, _BLOCK // max(1, len(TARGET_EPISODES) * flat.shape[1] * (grid + 1)))
    ends = []
    for side in (flat, 1.0 - flat):
        out = np.empty(side.shape)
        for i in range(0, side.shape[0], rows):
            block = side[i : i + rows]
            logk = _log_capital(block, _bets(block, alpha), np.broadcast_to(g, (block.shape[0], g.size)), path=True)
            k = (logk >= math.log(2.0 / alpha)).sum(axis=-1)  # excluded grid means by each episode: a prefix
            out[i : i + rows] = np.maximum(k - 1, 0) / grid
        ends.append(out.reshape(x.shape))
    low, high = lo + (hi - lo) * ends[0], lo + (hi - lo) * (1.0 - ends[1])
    return low, high


def ever_misses(values: Any, mean: Any, lo: float, hi: float, alpha: float) -> Any:
    """Whether an arm's interval at level 1 - `alpha` excludes `mean` after some episode of
    `values` (rows of a 2-d array apart): exactly, at `mean` alone (simulations of the
    guarantee: a true mean must be missed in at most `alpha` of the runs).

    Example:
        >>> bool(ever_misses([0.0, 1.0] * 100, 0.5, 0.0, 1.0, 0.025)), bool(ever_misses([1.0] * 40, 0.5, 0.0, 1.0, 0.025))
        (False, True)
    """
    x = _scaled(values, lo, hi)
    flat = x.reshape(-1, x.shape[-1])
    m = (float(mean) - lo) / (hi - lo)
    threshold = math.log(2.0 / alpha)
    rows = max(1, _BLOCK // max(1, len(TARGET_EPISODES) * flat.shape[1]))
    out = np.empty(flat.shape[0], dtype=bool)
    for i in range(0, flat.shape[0], rows):
        block = flat[i : i + rows]
        at = np.full((block.shape[0], 1), m)
        above = _log_capital(block, _bets(block, alpha), at, path=False)[..., 0] >= threshold
        below = _log_capital(1.0 - block, _bets(1.0 - block, alpha), 1.0 - at, path=False)[..., 0] >= threshold
        out[i : i + rows] = above | below
    out = out.reshape(x.shape[:-1])
    return bool(out) if np.ndim(out) == 0 else out


@dataclass(frozen=True)
class CanaryRule:
    """When a canary is promoted or rolled back (``rlrec train --canary-*`` options).

    Attributes:
        alpha: the probability, over the whole canary however often it is checked, that the
            confidence sequence of the difference misses the truth.
        return_min: the least discounted return an episode can have (returns below are clipped
            to it and counted); None: not known yet.
        return_max: the greatest (likewise).
        episode_max_s: the longest an episode takes from its start until its shard is
            committed: a look at time t counts only the episodes that started by
            ``t - episode_max_s`` (a complete cohort: slow episodes, often the failures, are
            not missing from it), and the wait for traffic counts from ``start + episode_max_s``.
            None: fixed at the first look (`rlrec.trainer.rollout.CanaryRun`) to twice the
            longest episode before the start, at least `EPISODE_MAX_S_FLOOR`.
        margin: promote when the lower bound of canary - deployed is at least ``-margin``.
        min_episodes: no decision on the bound before this many episodes in each arm.
        max_exposure: roll back undecided once the canary served this many episodes.
        max_wait_s: roll back when this long passed without `min_episodes` in each arm, or, once
            both arms have them, without a new canary episode (its traffic stopped).
        max_duration_s: roll back a canary still undecided this long after its start.
        share: the test's share g of each service's episodes (`rlrec.trainer.canary.in_test_band`).
    """

    alpha: float = 0.05
    margin: float = 0.0
    min_episodes: int = 30
    max_exposure: int = 2000
    max_wait_s: float = 3600.0
    return_min: float | None = None
    return_max: float | None = None
    episode_max_s: float | None = None
    max_duration_s: float = 7 * 86400.0
    share: float = 0.05

    @property
    def has_range(self) -> bool:
        return self.return_min is not None and self.return_max is not None

    def __post_init__(self) -> None:
        if (self.return_min is None) != (self.return_max is None):
            raise ValueError("the canary's return range needs both its minimum and its maximum")
        if self.has_range and not (
            math.isfinite(self.return_min) and math.isfinite(self.return_max) and self.return_min < self.return_max
        ):
            raise ValueError(
                f"the canary's return range must be finite with min < max, got [{self.return_min!r}, "
                f"{self.return_max!r}]"
            )
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"the canary's alpha must be in (0, 1), got {self.alpha!r}")
        if not self.margin >= 0.0:
            raise ValueError(f"the canary's margin must be >= 0, got {self.margin!r}")
        if self.min_episodes < 2:
            raise ValueError(f"the canary's minimum episodes per arm must be >= 2, got {self.min_episodes!r}")
        if self.max_exposure < self.min_episodes:
            raise ValueError(
                f"the canary's maximum exposure ({self.max_exposure}) must be at least its minimum episodes "
                f"per arm ({self.min_episodes})"
            )
        if not self.max_wait_s > 0:
            raise ValueError(f"the canary's wall-clock limit must be > 0, got {self.max_wait_s!r}")
        if self.episode_max_s is not None and not (self.episode_max_s >= 0 and math.isfinite(self.episode_max_s)):
            raise ValueError(f"the canary's longest episode must be >= 0 seconds, got {self.episode_max_s!r}")
        if not self.max_duration_s > 0:
            raise ValueError(f"the canary's longest duration must be > 0, got {self.max_duration_s!r}")
        if not 0.0 < self.share <= SHARE_MAX:
            raise ValueError(f"the canary's test share must be in (0, {SHARE_MAX:g}], got {self.share!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Verdict:
    """One look at a canary: ``decision`` is ``"promote"``, ``"rollback"`` or ``"continue"``;
    ``low``/``high`` bound canary - deployed (None below two episodes in an arm)."""

    decision: str
    reason: str
    canary: ArmStats
    deployed: ArmStats
    low: float | None
    high: float | None

    @property
    def difference(self) -> float | None:
        if self.canary.n == 0 or self.deployed.n == 0:
            return None
        return self.canary.mean - self.deployed.mean

    def to_dict(self) -> dict:
        return {
            "decision": self.decision,
            "reason": self.reason,
            "episodes_canary": self.canary.n,
            "episodes_deployed": self.deployed.n,
            "mean_canary": self.canary.mean if self.canary.n else None,
            "mean_deployed": self.deployed.mean if self.deployed.n else None,
            "difference": self.difference,
            "low": self.low,
            "high": self.high,
            "clipped_canary": self.canary.clipped,
            "clipped_deployed": self.deployed.clipped,
            "below_range_canary": self.canary.below,
            "above_range_deployed": self.deployed.above,
        }


def difference_bounds(canary: ArmStats, deployed: ArmStats, rule: CanaryRule) -> tuple[float, float]:
    """The always-valid interval of mean(canary) - mean(deployed) at level 1 - alpha: each arm's
    `arm_interval` at ``alpha / 2`` over its returns in the order added (clipped into the rule's
    range), the canary's lower end minus the deployed one's upper end and vice versa.

    Example:
        >>> rule = CanaryRule(return_min=-1.0, return_max=3.0)
        >>> low, high = difference_bounds(ArmStats.of([1.0, 2.0] * 200), ArmStats.of([0.0, 1.0] * 200), rule)
        >>> low > 0, round(high - low, 3)
        (True, 0.321)
    """
    a = rule.alpha / 2.0
    low_c, high_c = arm_interval(canary.values, rule.return_min, rule.return_max, a)
    low_d, high_d = arm_interval(deployed.values, rule.return_min, rule.return_max, a)
    return low_c - high_d, high_c - low_d


def judge(
    canary: ArmStats,
    deployed: ArmStats,
    rule: CanaryRule,
    elapsed_s: float,
    idle_s: float | None = None,
    age_s: float | None = None,
) -> Verdict:
    """Decide a canary from its arms so far (module docstring; the bound first, then the limits).

    Args:
        canary: the canary version's discounted returns.
        deployed: the deployed version's, over the same time.
        rule: the rule.
        elapsed_s: seconds the canary has waited for traffic (`max_wait_s`).
        idle_s: seconds since the canary arm last grew (None: as long as `elapsed_s`).
        age_s: seconds since the canary started (`max_duration_s`; None: `elapsed_s`).

    Example:
        >>> rule = CanaryRule(return_min=-1.0, return_max=3.0)
        >>> v = judge(ArmStats.of([1.0, 2.0] * 200), ArmStats.of([0.0, 1.0] * 200), rule, 60.0)
        >>> v.decision, v.reason
        ('promote', 'the lower bound 0.8473 of canary - deployed clears -margin (-0)')
        >>> judge(ArmStats(), ArmStats(), CanaryRule(max_wait_s=10.0), 11.0).reason
        'no canary traffic: services must opt in with canary_fraction (0 canary and 0 deployed episodes in 11s)'
    """
    low = high = None
    if canary.n >= 2 and deployed.n >= 2 and rule.has_range:
        low, high = difference_bounds(canary, deployed, rule)
    enough = canary.n >= rule.min_episodes and deployed.n >= rule.min_episodes

    def verdict(decision: str, reason: str) -> Verdict:
        return Verdict(decision, reason, canary, deployed, low, high)

    if canary.below and not deployed.below:
        return verdict(
            "rollback",
            f"the canary returned {canary.least:.4g}, below the test's range [{rule.return_min:.4g}, "
            f"{rule.return_max:.4g}] ({canary.below} such episodes), and the deployed version never did: the "
            "bound does not hold for it",
        )
    # a canary return below the range or a deployed one above it would be clipped in the canary's
    # favour: the bound no longer holds for the difference, so no promotion (the limits decide)
    voided = canary.below or deployed.above
    if enough and low is not None and low >= -rule.margin and not voided:  # within the margin: promoted even if below 0
        return verdict("promote", f"the lower bound {low:.4g} of canary - deployed clears -margin (-{rule.margin:g})")
    if enough and high is not None and high < 0.0:
        return verdict("rollback", f"the upper bound {high:.4g} of canary - deployed is below 0: the canary is worse")
    if canary.n >= rule.max_exposure:
        return verdict(
            "rollback",
            f"undecided after the maximum exposure of {rule.max_exposure} canary episodes "
            f"(bound [{low:.4g}, {high:.4g}])"
            if low is not None
            else f"undecided after the maximum exposure of {rule.max_exposure} canary episodes",
        )
    if not enough and elapsed_s >= rule.max_wait_s:
        return verdict(
            "rollback",
            f"{NO_TRAFFIC} ({canary.n} canary and {deployed.n} deployed episodes in {elapsed_s:.0f}s)",
        )
    idle = elapsed_s if idle_s is None else idle_s
    if enough and idle >= rule.max_wait_s:
        return verdict(
            "rollback",
            f"undecided and {NO_TRAFFIC}: no new canary episode in {idle:.0f}s "
            f"({canary.n} canary and {deployed.n} deployed episodes)",
        )
    if (elapsed_s if age_s is None else age_s) >= rule.max_duration_s:
        return verdict("rollback", f"undecided after the longest canary duration of {rule.max_duration_s:.0f}s")
    return verdict("continue", "undecided")
