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

import numpy as np

__all__ = ["GateVerdict", "first_below", "gate_verdict", "step_ess", "tail_share"]


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
