"""An always-valid two-sample test of a canary: does the candidate's mean return beat the deployed one's?

Each arm's mean return gets a time-uniform confidence sequence: the normal-mixture boundary of
Robbins, in the asymptotic form of Waudby-Smith, Arbour, Sinha, Kennedy and Ramdas (2021,
"Time-uniform central limit theory and asymptotic confidence sequences"; the boundary is
Howard, Ramdas, McAuliffe and Sekhon 2021, eq. (14)). After n episodes with mean m and sample
standard deviation s, the arm's interval is::

    m +- s * sqrt( 2 (n r + 1) / (n^2 r) * log( sqrt(n r + 1) / a ) ),   r = (-2 log a + log(1 - 2 log a)) / n_opt

with a = alpha / 2 per arm, so that both intervals hold at every n at once with probability at
least 1 - alpha, however often they are looked at. The difference canary - deployed lies in
``[low_c - high_d, high_c - low_d]``. `n_opt` is the number of episodes per arm where the
boundary is tightest; any fixed value keeps the guarantee. The guarantee is asymptotic (it
relies on the mean's central limit behaviour), which is why no decision is taken below
`CanaryRule.min_episodes` per arm; `tests/test_canary_sequential.py` simulates continuous peeking
and checks that the rates of wrong decisions stay below alpha.

`judge` applies the rules of ``rlrec train --rollout canary``: roll back when the upper bound is
below 0 (the canary is worse), promote when the lower bound clears ``-margin`` (with at least
`min_episodes` per arm), roll back undecided after `max_exposure` canary episodes, and roll back
when `max_wait_s` passed without enough episodes in either arm. Pure logic: numpy only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["NO_TRAFFIC", "ArmStats", "CanaryRule", "Verdict", "confidence_radius", "judge"]

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

    def add(self, x: float) -> None:
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
        std: their sample standard deviation.
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
        margin: promote when the lower bound of canary - deployed is at least ``-margin``.
        min_episodes: no decision on the bound before this many episodes in each arm.
        max_exposure: roll back undecided once the canary served this many episodes.
        max_wait_s: roll back when this long passed without `min_episodes` in each arm.
        n_opt: episodes per arm where the bound is tightest.
    """

    alpha: float = 0.05
    margin: float = 0.0
    min_episodes: int = 30
    max_exposure: int = 2000
    max_wait_s: float = 3600.0
    n_opt: float = 200.0

    def __post_init__(self) -> None:
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
        }


def difference_bounds(canary: ArmStats, deployed: ArmStats, rule: CanaryRule) -> tuple[float, float]:
    """The always-valid interval of mean(canary) - mean(deployed) at level 1 - alpha.

    Example:
        >>> low, high = difference_bounds(ArmStats.of([1.0, 2.0] * 50), ArmStats.of([0.0, 1.0] * 50), CanaryRule())
        >>> low > 0, round(high - low, 3)
        (True, 0.668)
    """
    a = rule.alpha / 2.0
    rc = confidence_radius(canary.n, math.sqrt(canary.variance), a, rule.n_opt)
    rd = confidence_radius(deployed.n, math.sqrt(deployed.variance), a, rule.n_opt)
    diff = canary.mean - deployed.mean
    return diff - rc - rd, diff + rc + rd


def judge(canary: ArmStats, deployed: ArmStats, rule: CanaryRule, elapsed_s: float) -> Verdict:
    """Decide a canary from its arms so far (module docstring; the bound first, then the limits).

    Args:
        canary: the canary version's discounted returns.
        deployed: the deployed version's, over the same time.
        rule: the rule.
        elapsed_s: seconds since the canary started.

    Example:
        >>> v = judge(ArmStats.of([1.0, 2.0] * 50), ArmStats.of([0.0, 1.0] * 50), CanaryRule(), 60.0)
        >>> v.decision, v.reason
        ('promote', 'the lower bound 0.6659 of canary - deployed clears -margin (-0)')
        >>> judge(ArmStats(), ArmStats(), CanaryRule(max_wait_s=10.0), 11.0).reason
        'no canary traffic: services must opt in with canary_fraction (0 canary and 0 deployed episodes in 11s)'
    """
    low = high = None
    if canary.n >= 2 and deployed.n >= 2:
        low, high = difference_bounds(canary, deployed, rule)
    enough = canary.n >= rule.min_episodes and deployed.n >= rule.min_episodes

    def verdict(decision: str, reason: str) -> Verdict:
        return Verdict(decision, reason, canary, deployed, low, high)

    if enough and high is not None and high < 0.0:
        return verdict("rollback", f"the upper bound {high:.4g} of canary - deployed is below 0: the canary is worse")
    if enough and low is not None and low >= -rule.margin:
        return verdict("promote", f"the lower bound {low:.4g} of canary - deployed clears -margin (-{rule.margin:g})")
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
    return verdict("continue", "undecided")
