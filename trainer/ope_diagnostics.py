"""Whether an off-policy estimate may *gate* a publication: what of it the data check, and what
rests on a model alone. numpy only.

An estimate can be *estimable* (it has a value, `rlrec.trainer.ope.Thresholds` pass) and still
unusable for a decision: a greedy candidate's cumulative importance weight is 0 after the first
logged action it would not take, so on a long horizon the weighted doubly robust estimate is, after
a few steps, the fitted Q-model's guess and nothing else. The gate verdict makes that explicit:

* ``step_ess``: the effective sample size of the weights at every step t,
  ``(sum_i w_{i,t})^2 / sum_i w_{i,t}^2`` over the held-out episodes (an ended episode keeps its
  last weight: the absorbing-state convention of the estimators);
* ``t_star``: the first step where it falls below `Thresholds.min_step_ess` (None: never);
* the *discounted share of the value beyond t**: with ``head`` the reweighted observed rewards
  before t*, ``sum_{t<t*} gamma^t sum_i wn_{i,t} r_{i,t}`` (what the data show with enough
  episodes behind it), and ``tail = value - head`` (what the estimate takes from the model, or
  from a handful of episodes), the share ``|tail| / (|head| + |tail|)``; above
  `Thresholds.max_tail_share` the estimate is refused for gating, with that reason.

`fqe` is the Q-model alone (nothing in the data checks its extrapolation) and never gates;
`mb` (`rlrec.trainer.ope_model`) gates on its own state-coverage diagnostic.

Example:
    >>> import numpy as np
    >>> w = np.ones((20, 3))
    >>> w[1:, 2] = 0.0  # from step 2 on one episode carries all the weight
    >>> [round(float(x), 1) for x in step_ess(w)]
    [20.0, 20.0, 1.0]
    >>> first_below(step_ess(w), 10.0)
    2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "GateVerdict",
    "first_below",
    "gate_verdict",
    "paired_bound",
    "remainder_bound",
    "reward_range",
    "step_ess",
    "tail_share",
]


@dataclass
class GateVerdict:
    """May this estimate decide a publication? ``ok`` or the ``reason`` it may not.

    Args:
        ok: the estimate may gate.
        reason: why not ("" when ok).
        t_star: the first step whose weights' effective sample size is below the minimum (None: none).
        tail_share: the discounted share of the value beyond `t_star` (None: not computed).
    """

    ok: bool
    reason: str = ""
    t_star: int | None = None
    tail_share: float | None = None

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "reason": self.reason,
            "t_star": self.t_star,
            "value_share_beyond_t_star": None if self.tail_share is None else round(self.tail_share, 6),
        }


def step_ess(w: np.ndarray) -> np.ndarray:
    """``(H,)`` effective sample size of the cumulative weights ``w`` ``(n, H)`` at every step (0
    where every weight is 0). A per-column scale cancels."""
    s = w.sum(0)
    s2 = (w * w).sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(s2 > 0, s * s / np.where(s2 > 0, s2, 1.0), 0.0)


def first_below(ess: np.ndarray, minimum: float) -> int | None:
    """The first step whose effective sample size is below `minimum` (None: none)."""
    low = np.flatnonzero(ess < minimum)
    return int(low[0]) if len(low) else None


def tail_share(w: np.ndarray, r: np.ndarray, g: np.ndarray, t_star: int | None, value: float) -> float:
    """The discounted share of `value` beyond `t_star`: ``|value - head| / (|head| + |value - head|)``
    with ``head`` the per-step normalized reweighted rewards before `t_star` (0 when none).

    Args:
        w: ``(n, H)`` cumulative weights.
        r: ``(n, H)`` rewards (0 after an episode's end).
        g: ``(H,)`` discounts ``gamma^t``.
        t_star: the step the weights collapse at (None: never, share 0).
        value: the estimate.
    """
    if t_star is None:
        return 0.0
    den = w[:, :t_star].sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_step = np.where(den > 0, (w[:, :t_star] * r[:, :t_star]).sum(0) / np.where(den > 0, den, 1.0), 0.0)
    head = float((per_step * g[:t_star]).sum())
    tail = float(value) - head
    total = abs(head) + abs(tail)
    return abs(tail) / total if total > 0 else 0.0


def gate_verdict(
    name: str, value: float, w: np.ndarray, r: np.ndarray, g: np.ndarray, min_step_ess: float, max_tail_share: float
) -> GateVerdict:
    """The gate verdict of estimator `name` whose (estimable) estimate is `value`.

    Args:
        name: the estimator (``wdr``, ``wpdis``, ``wis``, ``fqe``).
        value: its estimate.
        w: ``(n, H)`` cumulative importance weights of the held-out episodes.
        r: ``(n, H)`` their rewards.
        g: ``(H,)`` discounts.
        min_step_ess: `Thresholds.min_step_ess`.
        max_tail_share: `Thresholds.max_tail_share`.

    Example:
        >>> w = np.ones((20, 3)); w[1:, 1:] = 0.0
        >>> v = gate_verdict("wdr", 10.0, w, np.ones((20, 3)), np.ones(3), 10.0, 0.25)
        >>> v.ok, v.t_star
        (False, 1)
    """
    if name == "fqe":
        return GateVerdict(
            False,
            "fqe is the fitted Q-model alone: nothing in the data checks where it extrapolates; "
            "gate with wdr or mb (a pessimistic model-based estimate with a state-coverage check)",
        )
    t_star = first_below(step_ess(w), min_step_ess)
    share = tail_share(w, r, g, t_star, value)
    if share > max_tail_share:
        what = "the fitted Q-model's guess" if name == "wdr" else "fewer than that many episodes"
        return GateVerdict(
            False,
            f"the weights' effective sample size falls below {min_step_ess:g} at step {t_star}, and "
            f"{share:.0%} of the discounted value lies beyond it (> {max_tail_share:.0%}): that part is {what}",
            t_star,
            share,
        )
    return GateVerdict(True, "", t_star, share)


def reward_range(rewards: np.ndarray) -> tuple[float, float]:
    """``(r_lo, r_hi)``: the range a step's reward can take, from the logged rewards, widened to
    include 0 (the reward after an episode's end)."""
    if rewards.size == 0:
        return 0.0, 0.0
    return min(0.0, float(rewards.min())), max(0.0, float(rewards.max()))


def remainder_bound(gamma: float, t: int, horizon: int, width: float) -> float:
    """The worst case of ``sum_{k>=t} gamma^k (r_k - r'_k)`` over two policies' unknown rewards
    after step `t`, each in a range of `width`: ``gamma^t width / (1 - gamma)`` for gamma < 1 (no
    horizon assumed: a candidate may run longer than any logged episode); for gamma = 1,
    ``width`` per step up to the longest logged episode (`horizon`). 0 when ``t >= horizon``:
    every logged episode had ended (nothing of the value is beyond the data's steps)."""
    if t >= horizon:
        return 0.0
    if gamma < 1.0:
        return float(gamma**t * width / (1.0 - gamma))
    return float(width * (horizon - t))


def paired_bound(
    w_c: np.ndarray,
    w_d: np.ndarray | None,
    r: np.ndarray,
    g: np.ndarray,
    gamma: float,
    units: Any,
    C: np.ndarray,
    ci: float,
    min_step_ess: float,
    max_share: float,
    r_range: tuple[float, float],
) -> dict:
    """The gate's verdict on a paired *difference* of importance-weighted estimates, resting on
    the data only up to the step the weights collapse at (HCOPE-style, Thomas et al. 2015).

    ``T`` is the first step where the candidate's or the deployed version's weights have an
    effective sample size below `min_step_ess` (the longest episode when never). Before ``T`` the
    per-decision weighted rewards of both (no model) give the paired *head* difference and its
    bootstrap lower quantile ``head_low`` (the same resamples `C`); after ``T`` nothing in the
    data checks either value, so the difference there is bounded only by the reward range:
    ``remainder`` (`remainder_bound`). The data-only lower bound of the difference is
    ``head_low - remainder``; the model's share of the difference is
    ``remainder / (|head| + remainder)``, and above `max_share` the difference may not gate
    (however the levels' own verdicts came out: two policies that agree for T steps differ only
    where the model guesses).

    Args:
        w_c: ``(n, H)`` the candidate's cumulative weights.
        w_d: the deployed version's, or None: the behaviour (weights 1).
        r: ``(n, H)`` rewards (0 after an episode's end).
        g: ``(H,)`` discounts.
        gamma: the discount.
        units: per-episode sums -> bootstrap units (`rlrec.trainer.ope._Prepared._units`).
        C: ``(B, n_units)`` the bootstrap counts of the comparison.
        ci: the interval level (the lower quantile ``(1 - ci) / 2``).
        min_step_ess: `Thresholds.min_step_ess`.
        max_share: `Thresholds.max_tail_share`.
        r_range: ``(r_lo, r_hi)`` a step's reward range (`reward_range`).

    Returns:
        ``{"ok", "reason", "t_star", "head_difference", "head_low", "remainder",
        "lower_bound", "model_share", "reward_range"}``.

    Example:
        >>> w = np.ones((30, 200)); r = np.ones((30, 200)); g = 0.99 ** np.arange(200)
        >>> w_c = w.copy(); w_c[1:, 100:] = 0.0  # the candidate's weights collapse at step 100
        >>> C = np.ones((5, 30))
        >>> b = paired_bound(w_c, None, r, g, 0.99, lambda a: a, C, 0.9, 10.0, 0.25, (0.0, 1.0))
        >>> b["ok"], b["t_star"], b["head_difference"], round(b["remainder"], 1)
        (False, 100, 0.0, 36.6)
    """
    H = r.shape[1]
    t_c = first_below(step_ess(w_c), min_step_ess)
    t_d = None if w_d is None else first_below(step_ess(w_d), min_step_ess)
    T = min([t for t in (t_c, t_d) if t is not None] + [H])
    ones_w = np.ones_like(r) if w_d is None else None

    def head(w: np.ndarray, counts: np.ndarray) -> np.ndarray:
        num = counts @ units(w[:, :T] * r[:, :T])
        den = counts @ units(w[:, :T])
        with np.errstate(invalid="ignore", divide="ignore"):
            per_step = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
        return (per_step * g[:T]).sum(1)

    wd = ones_w if w_d is None else w_d
    one = np.ones((1, C.shape[1]))
    head_diff = float(head(w_c, one)[0] - head(wd, one)[0])
    samples = head(w_c, C) - head(wd, C) if len(C) else np.zeros(0)
    samples = samples[np.isfinite(samples)]
    head_low = float(np.quantile(samples, (1.0 - ci) / 2.0)) if len(samples) else head_diff
    rem = remainder_bound(gamma, T, H, r_range[1] - r_range[0])
    total = abs(head_diff) + rem
    share = rem / total if total > 0 else 0.0
    out = {
        "t_star": None if T >= H else T,
        "head_difference": round(head_diff, 6),
        "head_low": round(head_low, 6),
        "remainder": round(rem, 6),
        "lower_bound": round(head_low - rem, 6),
        "model_share": round(share, 6),
        "reward_range": [r_range[0], r_range[1]],
    }
    if share > max_share:
        reason = (
            f"the paired difference: the weights' effective sample size falls below {min_step_ess:g} at step {T}; "
            f"the data show a difference of {head_diff:.4g} before it, and after it the difference can be anything "
            f"within +-{rem:.4g} (rewards in [{r_range[0]:g}, {r_range[1]:g}], gamma {gamma:g}): {share:.0%} of it "
            f"rests on the model (> {max_share:.0%})"
        )
        return {"ok": False, "reason": reason, **out}
    return {"ok": True, "reason": "", **out}
