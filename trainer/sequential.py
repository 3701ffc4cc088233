"""An always-valid two-sample test of a canary: does the candidate's mean return beat the deployed one's?

Returns are bounded: each arm's discounted returns are clipped into a stated range
``[return_min, return_max]`` (``--canary-return-min/--canary-return-max``, or fixed from the
episodes before the canary started, `CanaryRun`). The bound is about the clipped returns, so a
clip in the canary's favour voids it: a canary return below the range rolls the canary back at
once (unless the deployed arm had one too), and a deployed return above it forbids a promotion.
Clips the other way only make a promotion harder. With the range, a variable in a range of width ``w`` is
sub-Gaussian with variance proxy ``(w / 2)**2`` (Hoeffding's lemma). Each arm's mean then gets the
time-uniform normal-mixture confidence sequence of Robbins for sub-Gaussian increments (Howard,
Ramdas, McAuliffe and Sekhon 2021, "Time-uniform, nonparametric, nonasymptotic confidence
sequences", eq. (14)); after n episodes with mean m::

    m +- (w / 2) * sqrt( 2 (n r + 1) / (n^2 r) * log( sqrt(n r + 1) / a ) ),   r = (-2 log a + log(1 - 2 log a)) / n_opt

with a = alpha / 2 per arm, so that both intervals hold at every n at once with probability at
least 1 - alpha, however often they are looked at -- **at every n, not only asymptotically**: a
sample whose returns so far are all equal (a capped episode, a sparse reward that has not fired)
is not taken as exact, and skewed returns do not break it. The width depends only on n (not on
the order the episodes arrive in), so re-reading the evidence in another order keeps the
guarantee. The difference canary - deployed lies in ``[low_c - high_d, high_c - low_d]``. `n_opt`
is the number of episodes per arm where the boundary is tightest; any fixed value keeps the
guarantee. The price of validity without a variance estimate: the bound is as wide as the range
allows (a tight range decides sooner). Without a range no bound is computed and the canary is
decided only by its limits (rolled back). `tests/test_canary_sequential.py` simulates continuous
peeking on normal, degenerate (capped) and sparse returns and checks that the rates of wrong
decisions stay below alpha.

`judge` applies the rules of ``rlrec train --rollout canary``: promote when the lower bound clears
``-margin`` (with at least `min_episodes` per arm; a canary proven worse by less than the margin
is promoted: the margin is what the user accepts), roll back when the upper bound is below 0, roll back undecided after `max_exposure` canary episodes, and roll back
when `max_wait_s` passed without enough episodes in either arm. Pure logic: numpy only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from rlrec.trainer.canary import SHARE_MAX

__all__ = [
    "EPISODE_MAX_S_FLOOR",
    "NO_TRAFFIC",
    "ArmStats",
    "CanaryRule",
    "Verdict",
    "confidence_radius",
    "difference_bounds",
    "difference_interval",
    "judge",
]

#: the least `CanaryRule.episode_max_s` taken from the history when none is stated
EPISODE_MAX_S_FLOOR = 900.0

#: what a canary rolled back for lack of episodes says (loudly)
NO_TRAFFIC = "no canary traffic: services must opt in with canary_fraction"


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
        return asdict(self)


def _rho2(alpha: float, n_opt: float) -> float:
    la = -2.0 * math.log(alpha)
    return (la + math.log(1.0 + la)) / float(n_opt)


def confidence_radius(n: Any, std: Any, alpha: float, n_opt: float = 200.0) -> Any:
    """Half-width of an arm's time-uniform interval after `n` episodes (module docstring);
    numpy arrays of `n` and `std` give an array (simulations look at every n at once).

    Args:
        n: episodes so far.
        std: the sub-Gaussian scale of one return: half the width of the returns' range.
        alpha: the error probability of this arm's sequence (both sides).
        n_opt: where the boundary is tightest.

    Example:
        >>> round(confidence_radius(100, 1.0, 0.025), 3)
        0.332
        >>> confidence_radius(1, 1.0, 0.025)
        inf
    """
    n_arr = np.asarray(n, dtype=np.float64)
    std_arr = np.asarray(std, dtype=np.float64)
    r = _rho2(alpha, n_opt)
    ok = (n_arr >= 2) & np.isfinite(std_arr)
    safe = np.where(ok, n_arr, 2.0)
    width = std_arr * np.sqrt(2.0 * (safe * r + 1.0) / (safe * safe * r) * np.log(np.sqrt(safe * r + 1.0) / alpha))
    out = np.where(ok, width, np.inf)
    return float(out) if out.ndim == 0 else out


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
        n_opt: episodes per arm where the bound is tightest.
        share: the test's share g of each service's episodes (`rlrec.trainer.canary.in_test_band`).
    """

    alpha: float = 0.05
    margin: float = 0.0
    min_episodes: int = 30
    max_exposure: int = 2000
    max_wait_s: float = 3600.0
    n_opt: float = 200.0
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
        if not self.n_opt > 0:
            raise ValueError(f"n_opt must be > 0, got {self.n_opt!r}")

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


def difference_interval(n_c: Any, mean_c: Any, n_d: Any, mean_d: Any, rule: CanaryRule) -> tuple[Any, Any]:
    """The always-valid interval of mean(canary) - mean(deployed) at level 1 - alpha from each
    arm's count and mean of clipped returns (numpy arrays give arrays: simulations); needs the
    rule's return range.

    Example:
        >>> rule = CanaryRule(return_min=0.0, return_max=1.0)
        >>> [round(float(x), 3) for x in difference_interval(400, 0.7, 1600, 0.5, rule)]
        [0.074, 0.326]
    """
    a = rule.alpha / 2.0
    scale = (rule.return_max - rule.return_min) / 2.0
    rc = confidence_radius(n_c, scale, a, rule.n_opt)
    rd = confidence_radius(n_d, scale, a, rule.n_opt)
    diff = np.asarray(mean_c, dtype=np.float64) - np.asarray(mean_d, dtype=np.float64)
    low, high = diff - rc - rd, diff + rc + rd
    return (float(low), float(high)) if np.ndim(low) == 0 else (low, high)


def difference_bounds(canary: ArmStats, deployed: ArmStats, rule: CanaryRule) -> tuple[float, float]:
    """The always-valid interval of mean(canary) - mean(deployed) at level 1 - alpha (the arms'
    returns clipped into the rule's range).

    Example:
        >>> rule = CanaryRule(return_min=-1.0, return_max=3.0)
        >>> low, high = difference_bounds(ArmStats.of([1.0, 2.0] * 200), ArmStats.of([0.0, 1.0] * 200), rule)
        >>> low > 0, round(high - low, 3)
        (True, 1.322)
    """
    return difference_interval(canary.n, canary.mean, deployed.n, deployed.mean, rule)


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
        ('promote', 'the lower bound 0.3391 of canary - deployed clears -margin (-0)')
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
