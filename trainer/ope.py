"""Off-policy evaluation (OPE) of a candidate policy on logged episodes: numpy and torch, no Ray.

Estimand: the candidate's expected discounted return per episode, ``E[sum_t gamma^t r_t]``,
from episodes logged by a behaviour policy that recorded its propensity ``action_logp``
(``log pi_b(a_t | s_t)`` of the action it took) at every step.

Estimators (``ESTIMATORS``), with ``rho_t = pi_e(a_t|s_t) / pi_b(a_t|s_t)`` and the cumulative
weight ``w_{i,t} = prod_{k<=t} rho_{i,k}`` of episode i (after an episode ends its weight stays
at its last value and its rewards are 0: the absorbing-state convention):

* ``wis`` -- weighted (per-episode) importance sampling: ``sum_i W_i G_i / sum_i W_i`` with
  ``W_i`` the episode's final weight and ``G_i`` its discounted return.
* ``wpdis`` -- weighted per-decision importance sampling:
  ``sum_t gamma^t sum_i w_{i,t} r_{i,t} / sum_i w_{i,t}``.
* ``fqe`` -- fitted-Q evaluation: a small Q-network fitted to
  ``r + gamma * (1 - terminated) * E_{a'~pi_e}[Q'(s', a')]`` on every logged transition (a target
  network follows by Polyak averaging); the estimate is the mean of ``V(s_0) = E_{a~pi_e} Q(s_0, a)``.
  Discrete actions: one output per action, the expectation is exact; Box actions: Q(s, a) with
  the expectation over `fqe.samples` actions drawn from the candidate (its mean when greedy).
* ``wdr`` -- weighted doubly robust on FQE (Thomas & Brunskill 2016):
  ``sum_t gamma^t [ sum_i wn_{i,t} (r_{i,t} - Q(s_t, a_t)) + sum_i wn_{i,t-1} V(s_t) ]`` with
  per-step normalized weights ``wn`` (``wn_{i,-1} = 1/n``). The default: importance weights
  collapse on long horizons; WDR then leans on the model instead of failing.

Intervals: percentile bootstrap over episodes (`n_boot` resamples, level `ci`). For FQE and WDR
the Q-network is fitted once and not refitted per resample, so their intervals leave out the
fitting error. `compare` bootstraps the *paired* difference of two targets on the same resamples.

Diagnostics (on the held-out data; each gates some estimators, see `Thresholds`): ``coverage``
(share of steps with a propensity; episodes with any step lacking one are left out of every
estimate), ``ess`` (effective sample size of the final episode weights,
``(sum W)^2 / sum W^2``), ``max_weight`` (the largest normalized episode weight), ``support``
(the candidate's probability mass on actions the behaviour policy took with probability below
`Thresholds.min_propensity`; exact when the behaviour's action probabilities are known, else
estimated as ``1 - mean_t(rho_t * 1[pi_b(a_t|s_t) >= eps])``), ``horizon`` (mean episode
length). An estimate whose diagnostics fail is returned with ``estimable=False`` and a reason,
and no value.

Assumptions: the recorded ``action_logp`` is the log-probability with which the behaviour
*sampled* the action it took (a greedy behaviour's propensity is 1, ``action_logp`` 0, which
`rlrec.trainer.policy.Policy.act(explore=False)` logs; a step with propensity 1 overrides the
recorded ``action_dist_inputs``; data where every step has propensity 1, or where the
behaviour took its most likely action at every step, is refused by wis, wpdis and wdr),
states are Markov, and every action the candidate takes has a positive behaviour probability.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rlrec.trainer.ope_fqe import FQEConfig, fit_fqe

__all__ = [
    "DEFAULT_ESTIMATORS",
    "ESTIMATORS",
    "Comparison",
    "Episode",
    "Estimate",
    "Evaluation",
    "FQEConfig",
    "LoggedData",
    "PolicyTarget",
    "TargetArrays",
    "Thresholds",
    "compare",
    "evaluate",
    "target_arrays",
]

#: the estimators `evaluate` knows; the first is the default
ESTIMATORS = ("wdr", "fqe", "wpdis", "wis", "mb")
#: what `evaluate` runs when not told (``mb`` fits an ensemble and rolls out: asked for by name)
DEFAULT_ESTIMATORS = ("wdr", "fqe", "wpdis", "wis")
#: a behaviour log-propensity at least ``-CERTAIN_LOGP`` is a propensity of 1 (a deterministic choice)
CERTAIN_LOGP = 1e-6
#: the bootstrap resamples at most this many units (episodes, or random blocks of them)
MAX_BOOTSTRAP_UNITS = 2000
_IS_FAMILY = ("wis", "wpdis")


# ----------------------------------------------------------------------------------- data


@dataclass
class Episode:
    """One logged episode.

    Args:
        obs: observations, ``(T + 1, *obs_shape)`` (the last one after the last step).
        actions: ``(T,)`` ints (Discrete) or ``(T, *action_shape)`` floats (Box), as the env took them.
        rewards: ``(T,)``.
        behavior_logp: ``(T,)`` behaviour log-propensities of the actions taken (NaN: not
            recorded), or None when the episode has none.
        terminated: True if the last state is terminal (no value after it); False if truncated.
        id: the episode id.
        policy_version: the behaviour policy's version.
        behavior_probs: optional ``(T, n)`` behaviour action probabilities (Discrete), for an
            exact support diagnostic.
    """

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    behavior_logp: np.ndarray | None = None
    terminated: bool = True
    id: str = ""
    policy_version: Any = None
    behavior_probs: np.ndarray | None = None


class LoggedData:
    """Episodes flattened into step arrays (what the estimators work on).

    The episodes are kept sorted by id (a stable sort: episodes with the same id keep their
    order), so every estimate -- the FQE fit's minibatches and the bootstrap's resamples index
    steps and episodes by position -- depends on the data, not on the order it was read in (the
    commit order across partitions depends on timing): the same episodes give the same numbers
    in ``rlrec evaluate``, the gate and a rerun. Per-step arrays (`TargetArrays`) follow this order.

    Args:
        episodes: the held-out episodes (each with at least one step).

    Example:
        >>> ep = Episode(np.zeros((3, 1)), np.array([0, 1]), np.array([1.0, 1.0]), np.log([0.5, 0.5]))
        >>> LoggedData([ep]).steps
        2
    """

    def __init__(self, episodes: list[Episode]) -> None:
        episodes = sorted((e for e in episodes if len(e.rewards) > 0), key=lambda e: str(e.id))
        if not episodes:
            raise ValueError("no episodes with steps to evaluate on")
        self.episodes = episodes
        self.lengths = np.array([len(e.rewards) for e in episodes], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        flat = [np.asarray(e.obs, dtype=np.float32).reshape(len(e.rewards) + 1, -1) for e in episodes]
        self.obs = np.concatenate([f[:-1] for f in flat])
        self.next_obs = np.concatenate([f[1:] for f in flat])
        self.actions = np.concatenate([np.asarray(e.actions) for e in episodes])
        self.rewards = np.concatenate([np.asarray(e.rewards, dtype=np.float64) for e in episodes])
        logps = []
        for e in episodes:
            lp = e.behavior_logp
            logps.append(
                np.full(len(e.rewards), np.nan) if lp is None else np.asarray(lp, dtype=np.float64).reshape(-1)
            )
        self.behavior_logp = np.concatenate(logps)
        self.terminals = np.zeros(len(self.rewards), dtype=bool)
        self.episode = np.repeat(np.arange(len(episodes)), self.lengths)
        self.t = np.concatenate([np.arange(n) for n in self.lengths])
        for i, e in enumerate(episodes):
            self.terminals[self.starts[i] + self.lengths[i] - 1] = bool(e.terminated)
        self.behavior_probs = None
        if all(e.behavior_probs is not None for e in episodes):
            self.behavior_probs = np.concatenate([np.asarray(e.behavior_probs, dtype=np.float64) for e in episodes])
        ok = np.isfinite(self.behavior_logp)
        # propensity 1: a deterministic choice, whatever distribution inputs were recorded with it
        certain = ok & (np.nan_to_num(self.behavior_logp, nan=-np.inf) >= -CERTAIN_LOGP)
        if self.behavior_probs is not None and certain.any() and self.actions.ndim == 1:
            rows = np.flatnonzero(certain)
            self.behavior_probs[rows] = 0.0
            self.behavior_probs[rows, self.actions[rows].astype(np.int64)] = 1.0
        #: episodes whose every step has a propensity (the ones the estimates use)
        self.covered = np.array([ok[s : s + n].all() for s, n in zip(self.starts, self.lengths)])
        self.coverage = float(ok.mean())
        #: share of covered steps whose logged action is the behaviour's most likely one (None:
        #: the behaviour's action probabilities are not recorded); 1.0 over many steps means a
        #: greedy behaviour, whose recorded action_logp is no propensity
        self.greedy_share: float | None = None
        step_cov = self.covered[self.episode]
        #: share of covered steps the behaviour took with propensity 1 (None: no covered step);
        #: 1.0 means a deterministic behaviour, whose data no importance weight can correct
        self.deterministic_share: float | None = float(certain[step_cov].mean()) if step_cov.any() else None
        if self.behavior_probs is not None and step_cov.any() and self.actions.ndim == 1:
            top = np.argmax(self.behavior_probs[step_cov], axis=1)
            self.greedy_share = float(np.mean(top == self.actions[step_cov].astype(np.int64)))

    @property
    def steps(self) -> int:
        return int(self.lengths.sum())

    @property
    def n_episodes(self) -> int:
        return len(self.episodes)

    def discounted_returns(self, gamma: float) -> np.ndarray:
        """``(E,)`` discounted return of every episode."""
        g = gamma ** self.t.astype(np.float64)
        return np.bincount(self.episode, weights=g * self.rewards, minlength=self.n_episodes)

    def padded(self, values: np.ndarray, fill: float = 0.0) -> np.ndarray:
        """A per-step array as ``(E, H)`` (H: the longest episode), `fill` after each end."""
        out = np.full((self.n_episodes, int(self.lengths.max())), fill, dtype=np.float64)
        out[self.episode, self.t] = values
        return out


@dataclass
class TargetArrays:
    """What the estimators need of the candidate, per logged step.

    Args:
        logp: ``(N,)`` log pi_e(a_t | s_t) of the logged actions (-inf: impossible; NaN for a
            deterministic candidate on a continuous action space, which has no density).
        probs: Discrete: ``(N, n)`` pi_e(. | s_t).
        next_probs: Discrete: ``(N, n)`` pi_e(. | s_{t+1}).
        actions: Box: ``(N, K, *action_shape)`` actions of the candidate at s_t.
        next_actions: Box: ``(N, K, *action_shape)`` actions of the candidate at s_{t+1}.
        q: optional ``(N,)`` Q(s_t, a_t) of a model fitted elsewhere (then FQE is not fitted).
        v: optional ``(N,)`` V(s_t) = E_{a~pi_e} Q(s_t, a) of that model.
    """

    logp: np.ndarray
    probs: np.ndarray | None = None
    next_probs: np.ndarray | None = None
    actions: np.ndarray | None = None
    next_actions: np.ndarray | None = None
    q: np.ndarray | None = None
    v: np.ndarray | None = None

    @property
    def has_density(self) -> bool:
        return not np.isnan(self.logp).all()


class PolicyTarget:
    """A candidate as OPE sees it, from a `rlrec.trainer.policy.Policy` (or anything with its
    ``action_probs``, ``logp_env``, ``sample_env_actions``, ``greedy_env_actions`` methods).

    Args:
        policy: the loaded policy.
        explore: evaluate the stochastic policy (True) or its greedy action selection (False).
        samples: actions drawn per state for Box actions when exploring.
        seed: the sampling seed.
    """

    def __init__(self, policy: Any, explore: bool, samples: int = 8, seed: int = 0) -> None:
        self.policy = policy
        self.explore = bool(explore)
        self.samples = int(samples)
        self.seed = int(seed)
        self.discrete = policy.spec["action_dist"]["type"] == "categorical"

    def arrays(self, data: LoggedData) -> TargetArrays:
        """The candidate's `TargetArrays` on `data`."""
        p = self.policy
        if self.discrete:
            probs, next_probs = p.action_probs(data.obs), p.action_probs(data.next_obs)
            if not self.explore:
                probs, next_probs = _greedy_probs(probs), _greedy_probs(next_probs)
            a = data.actions.astype(np.int64).reshape(-1)
            with np.errstate(divide="ignore"):
                logp = np.log(probs[np.arange(len(a)), a])
            return TargetArrays(logp, probs=probs, next_probs=next_probs)
        if self.explore:
            logp = np.asarray(p.logp_env(data.obs, data.actions), dtype=np.float64)
            acts = p.sample_env_actions(data.obs, self.samples, seed=self.seed)
            nxt = p.sample_env_actions(data.next_obs, self.samples, seed=self.seed + 1)
        else:
            logp = np.full(len(data.rewards), np.nan)
            acts = p.greedy_env_actions(data.obs)[:, None]
            nxt = p.greedy_env_actions(data.next_obs)[:, None]
        return TargetArrays(logp, actions=acts, next_actions=nxt)


def _greedy_probs(probs: np.ndarray) -> np.ndarray:
    out = np.zeros_like(probs)
    out[np.arange(len(probs)), np.argmax(probs, axis=-1)] = 1.0
    return out


def target_arrays(target: Any, data: LoggedData) -> TargetArrays:
    """`target` if it is already `TargetArrays`, else ``target.arrays(data)``."""
    return target if isinstance(target, TargetArrays) else target.arrays(data)


# ----------------------------------------------------------------------------------- estimates


@dataclass
class Thresholds:
    """Limits on the diagnostics; an estimator whose diagnostics break one is "not estimable".

    Args:
        min_episodes: fewest covered held-out episodes (all estimators).
        min_coverage: least share of steps with a propensity (wis, wpdis, wdr).
        max_support: most candidate mass on actions the behaviour (almost) never takes (all).
        min_propensity: "almost never": a behaviour probability below this.
        min_ess: least effective sample size of the episode weights (wis, wpdis).
        max_weight: largest normalized episode weight (wis, wpdis).
        max_is_horizon: longest mean episode length for pure importance sampling (wis, wpdis):
            products of that many ratios are not trusted whatever the ESS says.
        greedy_check_steps: at least this many covered steps all with propensity 1 (action_logp
            0) mark a deterministic behaviour; with the behaviour's action probabilities
            recorded, that many steps all taking its most likely action mark a greedy one (its
            action_logp is no propensity): wis, wpdis and wdr are then refused.
        min_step_ess: the gate verdict (not estimability): least effective sample size of the
            weights at a step; t* is the first step below it (`rlrec.trainer.ope_diagnostics`).
        max_tail_share: the gate verdict: most discounted share of the value beyond t* (what
            rests on the model, or on too few episodes) an estimate may decide a publication with.
    """

    min_episodes: int = 10
    min_coverage: float = 0.9
    max_support: float = 0.1
    min_propensity: float = 0.01
    min_ess: float = 10.0
    max_weight: float = 0.25
    max_is_horizon: float = 100.0
    greedy_check_steps: int = 50
    min_step_ess: float = 10.0
    max_tail_share: float = 0.25


@dataclass
class Estimate:
    """One estimator's result: `value` and interval, or ``estimable=False`` and a `reason`; `gate`:
    whether it may decide a publication (``{"ok", "reason", ...}``, `rlrec.trainer.ope_diagnostics`)."""

    value: float | None
    ci_low: float | None
    ci_high: float | None
    estimable: bool
    reason: str = ""
    gate: dict | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["gate"] is None:
            d["gate"] = {"ok": False, "reason": self.reason or "not estimable"}
        return d


@dataclass
class Evaluation:
    """`evaluate`'s result (the ``estimates`` and ``diagnostics`` of ``rlrec evaluate --json``)."""

    gamma: float
    episodes: int
    steps: int
    behavior_mean_return: float
    behavior_versions: list
    estimates: dict[str, Estimate]
    diagnostics: dict[str, float | None]
    default: str = "wdr"
    ci: float = 0.9

    def to_dict(self) -> dict:
        return {
            "gamma": self.gamma,
            "episodes": self.episodes,
            "steps": self.steps,
            "behavior": {"versions": self.behavior_versions, "mean_return": self.behavior_mean_return},
            "default_estimator": self.default,
            "ci_level": self.ci,
            "estimates": {k: v.to_dict() for k, v in self.estimates.items()},
            "diagnostics": self.diagnostics,
        }


class _Prepared:
    """One target on the covered episodes: per-estimator values for any bootstrap count matrix."""

    def __init__(
        self,
        data: LoggedData,
        tgt: TargetArrays,
        gamma: float,
        estimators: tuple[str, ...],
        fqe: FQEConfig | None,
        min_propensity: float,
    ) -> None:
        self.min_propensity = min_propensity
        self.gamma = gamma
        self.data = data
        cov = data.covered
        self.idx = np.flatnonzero(cov)  # covered episode indices
        E = len(data.episodes)
        step_cov = cov[data.episode]
        logp_b = np.where(np.isfinite(data.behavior_logp), data.behavior_logp, 0.0)
        has_density = tgt.has_density
        with np.errstate(invalid="ignore", over="ignore"):
            log_rho = np.where(step_cov & has_density, tgt.logp - logp_b, 0.0)
        log_rho = np.nan_to_num(log_rho, nan=-np.inf, posinf=np.inf, neginf=-np.inf)
        # cumulative log weights per episode, padded with the last value
        lr = data.padded(log_rho, 0.0)
        cum = np.cumsum(lr, axis=1)
        self.g = gamma ** np.arange(lr.shape[1], dtype=np.float64)
        cum = cum[self.idx]
        # per-column scaling cancels in every ratio estimator: exp(cum - max over episodes)
        with np.errstate(invalid="ignore"):
            colmax = np.max(np.where(np.isfinite(cum), cum, -np.inf), axis=0, initial=-np.inf)
        colmax = np.where(np.isfinite(colmax), colmax, 0.0)
        self.w = np.exp(cum - colmax)  # (n, H)
        prev = np.concatenate([np.zeros((len(self.idx), 1)), cum[:, :-1]], axis=1)
        pmax = np.max(np.where(np.isfinite(prev), prev, -np.inf), axis=0, initial=-np.inf)
        pmax = np.where(np.isfinite(pmax), pmax, 0.0)
        self.w_prev = np.exp(prev - pmax)
        self.r = data.padded(data.rewards)[self.idx]
        self.G = (self.r * self.g).sum(1)
        self.q = self.v = None
        self.fqe_ok = True
        if {"fqe", "wdr"} & set(estimators):
            if tgt.q is not None and tgt.v is not None:
                q, v = np.asarray(tgt.q, dtype=np.float64), np.asarray(tgt.v, dtype=np.float64)
            else:
                q, v = fit_fqe(data, tgt, gamma, fqe)
            self.fqe_ok = bool(np.isfinite(q).all() and np.isfinite(v).all())
            self.q = data.padded(q)[self.idx]
            self.v = data.padded(v)[self.idx]
        # diagnostics
        W = self.w[:, -1] if len(self.idx) else np.zeros(0)
        sw = W.sum()
        self.ess = float(sw**2 / (W**2).sum()) if sw > 0 else 0.0
        self.max_weight = float(W.max() / sw) if sw > 0 else 1.0
        self.support = self._support(data, tgt, step_cov, logp_b)
        self._blocks: tuple[np.ndarray, np.ndarray] | None = None
        self._cache: dict[str, dict[str, np.ndarray]] = {}
        self.n_episodes = E

    def _support(self, data: LoggedData, tgt: TargetArrays, step_cov: np.ndarray, logp_b: np.ndarray) -> float | None:
        eps = self.min_propensity
        if tgt.probs is not None and data.behavior_probs is not None:
            low = data.behavior_probs < eps
            return float((tgt.probs * low).sum(1).mean())
        if not tgt.has_density or not step_cov.any():
            return None
        pb = np.exp(logp_b[step_cov])
        with np.errstate(over="ignore"):
            rho = np.exp(tgt.logp[step_cov] - logp_b[step_cov])
        rho = np.nan_to_num(rho, nan=0.0)
        mass = float(np.mean(rho * (pb >= eps)))
        return float(min(1.0, max(0.0, 1.0 - mass)))

    @property
    def n_units(self) -> int:
        """Rows of the bootstrap count matrix: episodes, or blocks of them (see `_units`)."""
        n = len(self.idx)
        return n if n <= MAX_BOOTSTRAP_UNITS else MAX_BOOTSTRAP_UNITS

    def _units(self, a: np.ndarray) -> np.ndarray:
        """Per-episode sums -> per-unit sums. Up to `MAX_BOOTSTRAP_UNITS` episodes a unit is an
        episode; beyond, episodes are dealt into that many blocks at random (a fixed
        permutation, the same for every target of the same data): every statistic here is a
        ratio of sums over episodes, and resampling i.i.d. blocks of i.i.d. episodes bootstraps
        it as well while the cost stays bounded."""
        n = len(self.idx)
        if n <= MAX_BOOTSTRAP_UNITS:
            return a
        if self._blocks is None:
            perm = np.random.default_rng(12345).permutation(n)
            order = np.argsort(perm % MAX_BOOTSTRAP_UNITS, kind="stable")
            starts = np.searchsorted((perm % MAX_BOOTSTRAP_UNITS)[order], np.arange(MAX_BOOTSTRAP_UNITS))
            self._blocks = (order, starts)
        order, starts = self._blocks
        return np.add.reduceat(a[order], starts, axis=0)

    def _sums(self, name: str) -> dict[str, np.ndarray]:
        if name not in self._cache:
            W = self.w[:, -1]
            parts: dict[str, np.ndarray] = {"n": np.ones(len(self.idx))}
            if name == "wis":
                parts.update(wg=W * self.G, w=W)
            elif name == "wpdis":
                parts.update(wr=self.w * self.r, w=self.w)
            elif name == "fqe":
                parts.update(v0=self.v[:, 0])
            elif name == "wdr":
                parts.update(w=self.w, wp=self.w_prev, wrq=self.w * (self.r - self.q), wpv=self.w_prev * self.v)
            else:
                raise ValueError(f"unknown estimator {name!r} (choose from {', '.join(ESTIMATORS)})")
            self._cache[name] = {k: self._units(v) for k, v in parts.items()}
        return self._cache[name]

    def values(self, name: str, C: np.ndarray) -> np.ndarray:
        """``(B,)`` estimates for count matrix `C` ``(B, n_units)`` (rows of ones: the point estimate)."""
        S = self._sums(name)
        with np.errstate(invalid="ignore", divide="ignore"):
            if name == "wis":
                return (C @ S["wg"]) / (C @ S["w"])
            if name == "wpdis":
                num, den = C @ S["wr"], C @ S["w"]
                return np.nansum(np.where(den > 0, num / den, 0.0) * self.g, axis=1)
            if name == "fqe":
                return (C @ S["v0"]) / (C @ S["n"])
            den, pden = C @ S["w"], C @ S["wp"]
            a = np.where(den > 0, (C @ S["wrq"]) / den, 0.0)
            b = np.where(pden > 0, (C @ S["wpv"]) / pden, 0.0)
            return ((a + b) * self.g).sum(1)

    def verdict(self, name: str, value: float, th: Thresholds) -> dict:
        """The gate verdict of estimator `name`'s estimate `value` (`rlrec.trainer.ope_diagnostics`)."""
        from rlrec.trainer.ope_diagnostics import gate_verdict

        return gate_verdict(name, value, self.w, self.r, self.g, th.min_step_ess, th.max_tail_share).to_dict()

    def _never_varies(self, th: Thresholds, consequence: str) -> str:
        return _never_varies_reason(self.data, th, consequence)

    def why_not(self, name: str, th: Thresholds, tgt_density: bool) -> str:
        """The first failed diagnostic for estimator `name` ("" if none)."""
        d = self.data
        n = len(self.idx)
        if n < th.min_episodes:
            return f"{n} episodes with propensities at every step (< {th.min_episodes})"
        if name in ("fqe", "wdr") and not self.fqe_ok:
            return "the FQE fit diverged (non-finite Q values)"
        if self.support is not None and self.support > th.max_support:
            return (
                f"support: the candidate puts {self.support:.3f} of its probability on actions the behaviour "
                f"takes with probability < {th.min_propensity} (> {th.max_support})"
            )
        if name == "fqe":
            return ""
        if name == "mb":  # no propensities needed, but a behaviour that never varies its action
            return self._never_varies(th, "mb's model of the actions it never took is a guess")
        if not tgt_density:
            return "a deterministic candidate on a continuous action space has no density: importance weights are undefined (use fqe)"
        if d.coverage < th.min_coverage:
            return f"coverage: {d.coverage:.3f} of the steps have a behaviour propensity (< {th.min_coverage})"
        never = self._never_varies(th, "no importance weight can correct for that")
        if never:
            return never
        if name == "wdr":
            return ""
        horizon = float(d.lengths[d.covered].mean())
        if horizon > th.max_is_horizon:
            return f"horizon: episodes of {horizon:.1f} steps on average (> {th.max_is_horizon:g}): importance weights collapse"
        if self.ess < th.min_ess:
            return f"effective sample size {self.ess:.1f} (< {th.min_ess:g})"
        if self.max_weight > th.max_weight:
            return f"one episode carries {self.max_weight:.3f} of the weight (> {th.max_weight:g})"
        return ""


def _never_varies_reason(d: LoggedData, th: Thresholds, consequence: str) -> str:
    if d.deterministic_share == 1.0 and int(d.lengths[d.covered].sum()) >= th.greedy_check_steps:
        return (
            "the behaviour's propensity is 1 at every step: a deterministic behaviour "
            f"(Policy.act(explore=False) logs action_logp 0.0) never shows what other actions do, and {consequence}; "
            "log with an exploring behaviour"
        )
    if d.greedy_share == 1.0 and int(d.lengths[d.covered].sum()) >= th.greedy_check_steps:
        return (
            "the behaviour took its most likely action at every step: a greedy behaviour's action_logp "
            "(e.g. RLlib's log-probability of its greedy action) is not a propensity and it never shows what "
            f"other actions do ({consequence}); log with an exploring behaviour"
        )
    return ""


def _counts(n: int, n_boot: int, seed: int) -> np.ndarray:
    """``(n_boot, n)`` bootstrap counts: how often each episode is drawn in each resample of n
    draws with replacement (a multinomial; the same resamples for every target with one seed)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)


def _interval(samples: np.ndarray, ci: float) -> tuple[float | None, float | None]:
    s = samples[np.isfinite(samples)]
    if len(s) == 0:
        return None, None
    a = (1.0 - ci) / 2.0
    return float(np.quantile(s, a)), float(np.quantile(s, 1.0 - a))


def _diagnostics(data: LoggedData, p: _Prepared, th: Thresholds) -> dict[str, float | None]:
    from rlrec.trainer.ope_diagnostics import first_below, step_ess

    ess_t = step_ess(p.w) if p.w.size else np.zeros(0)
    return {
        "t_star": first_below(ess_t, th.min_step_ess),
        "step_ess_final": round(float(ess_t[-1]), 3) if len(ess_t) else None,
        "coverage": round(data.coverage, 6),
        "ess": round(p.ess, 3),
        "max_weight": round(p.max_weight, 6),
        "support": None if p.support is None else round(p.support, 6),
        "horizon": round(float(data.lengths.mean()), 3),
        "episodes_with_propensities": int(data.covered.sum()),
        "behavior_greedy_share": None if data.greedy_share is None else round(data.greedy_share, 6),
        "behavior_deterministic_share": None
        if data.deterministic_share is None
        else round(data.deterministic_share, 6),
    }


def _check_names(estimators: Any) -> tuple[str, ...]:
    names = tuple(estimators)
    bad = [n for n in names if n not in ESTIMATORS]
    if bad or not names:
        raise ValueError(f"unknown estimator(s) {', '.join(bad) or '(none)'}: choose from {', '.join(ESTIMATORS)}")
    return names


def evaluate(
    data: LoggedData,
    target: Any,
    *,
    gamma: float,
    estimators: tuple[str, ...] = DEFAULT_ESTIMATORS,
    ci: float = 0.9,
    n_boot: int = 500,
    seed: int = 0,
    thresholds: Thresholds | None = None,
    fqe: FQEConfig | None = None,
    model: Any = None,
) -> Evaluation:
    """Estimate the candidate's mean discounted return on `data` with each of `estimators`.

    Args:
        data: held-out episodes.
        target: the candidate (`TargetArrays` or a `PolicyTarget`).
        gamma: the discount.
        estimators: names from `ESTIMATORS`.
        ci: the level of the bootstrap intervals.
        n_boot: bootstrap resamples (over episodes).
        seed: bootstrap seed.
        thresholds: diagnostic limits (default `Thresholds()`).
        fqe: FQE settings.
        model: ``mb`` settings (`rlrec.trainer.ope_model.ModelConfig`; default: its defaults with `seed`).

    Example:
        >>> eps = [Episode(np.zeros((2, 1)), np.array([i % 2]), np.array([float(i % 2)]), np.log([0.5]))
        ...        for i in range(20)]
        >>> data = LoggedData(eps)
        >>> same = TargetArrays(np.log(np.full(20, 0.5)))
        >>> ev = evaluate(data, same, gamma=0.9, estimators=("wis", "wpdis"))
        >>> ev.estimates["wis"].value, ev.estimates["wpdis"].value
        (0.5, 0.5)
    """
    names = _check_names(estimators)
    th = thresholds or Thresholds()
    tgt = target_arrays(target, data)
    p = _Prepared(data, tgt, gamma, names, fqe, th.min_propensity)
    n = p.n_units
    C = _counts(n, n_boot, seed) if n else np.zeros((0, 0))
    ones = np.ones((1, n))
    out: dict[str, Estimate] = {}
    extra: dict[str, Any] = {}
    for name in names:
        why = p.why_not(name, th, tgt.has_density)
        if why:
            out[name] = Estimate(None, None, None, False, why)
            continue
        if name == "mb":
            from rlrec.trainer.ope_model import estimate_mb

            out[name], extra["mb"] = estimate_mb(data, target, gamma=gamma, ci=ci, n_boot=n_boot, seed=seed, cfg=model)
            continue
        value = float(p.values(name, ones)[0])
        if not math.isfinite(value):
            out[name] = Estimate(None, None, None, False, "the estimate is not a finite number (all weights zero)")
            continue
        lo, hi = _interval(p.values(name, C), ci)
        out[name] = Estimate(value, lo, hi, True, "", p.verdict(name, value, th))
    G = data.discounted_returns(gamma)
    versions = sorted({e.policy_version for e in data.episodes if e.policy_version is not None}, key=str)
    return Evaluation(
        gamma=gamma,
        episodes=data.n_episodes,
        steps=data.steps,
        behavior_mean_return=float(G.mean()),
        behavior_versions=versions,
        estimates=out,
        diagnostics={**_diagnostics(data, p, th), **extra},
        default=names[0],
        ci=ci,
    )


@dataclass
class Comparison:
    """`compare`'s result: the paired difference candidate - deployed and both evaluations."""

    estimator: str
    difference: float | None
    ci_low: float | None
    ci_high: float | None
    estimable: bool
    reason: str
    candidate: Evaluation
    deployed: Evaluation
    ci: float = 0.9
    extra: dict = field(default_factory=dict)

    @property
    def gate(self) -> dict:
        """Whether this difference may decide a publication: ``{"ok", "reason"}``, ok only when it
        is estimable and both estimates' gate verdicts are ok (the behaviour's own mean return
        needs no model)."""
        if not self.estimable:
            return {"ok": False, "reason": self.reason or "not estimable"}
        reasons = []
        for who, ev in (("candidate", self.candidate), ("deployed", self.deployed)):
            g = ev.estimates[self.estimator].gate
            if g is not None and not g["ok"]:
                reasons.append(f"{who}: {g['reason']}")
        paired = self.extra.get("paired")
        if paired is not None and not paired["ok"]:
            reasons.append(paired["reason"])
        return {"ok": not reasons, "reason": "; ".join(reasons)}

    def to_dict(self) -> dict:
        return {
            "estimator": self.estimator,
            "gate": self.gate,
            "difference": self.difference,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "ci_level": self.ci,
            "estimable": self.estimable,
            "reason": self.reason,
            "candidate": self.candidate.to_dict(),
            "deployed": self.deployed.to_dict(),
            **self.extra,
        }


def compare(
    data: LoggedData,
    candidate: Any,
    deployed: Any,
    *,
    gamma: float,
    estimator: str = "wdr",
    ci: float = 0.9,
    n_boot: int = 500,
    seed: int = 0,
    thresholds: Thresholds | None = None,
    fqe: FQEConfig | None = None,
    model: Any = None,
) -> Comparison:
    """The paired difference of `candidate` and `deployed` under one estimator, on the same data
    and the same bootstrap resamples of its episodes.

    Args:
        data: held-out episodes.
        candidate: the candidate (`TargetArrays` or `PolicyTarget`).
        deployed: the deployed version, the same way; None: the logged behaviour (its mean
            discounted return on the same episodes).
        gamma: the discount.
        estimator: one of `ESTIMATORS`.
        ci: interval level (the gate uses the lower bound).
        n_boot: bootstrap resamples.
        seed: bootstrap seed.
        thresholds: diagnostic limits (both targets must pass them).
        fqe: FQE settings.
        model: ``mb`` settings (`rlrec.trainer.ope_model.ModelConfig`).

    Example:
        >>> eps = [Episode(np.zeros((2, 1)), np.array([i % 2]), np.array([float(i % 2)]), np.log([0.5]))
        ...        for i in range(40)]
        >>> data = LoggedData(eps)
        >>> better = TargetArrays(np.log(np.where(np.arange(40) % 2 == 1, 0.9, 0.1)))
        >>> same = TargetArrays(np.log(np.full(40, 0.5)))
        >>> c = compare(data, better, same, gamma=0.9, estimator="wis")
        >>> round(c.difference, 3)
        0.4
    """
    (name,) = _check_names((estimator,))
    th = thresholds or Thresholds()
    if name == "mb":
        from rlrec.trainer.ope_model import compare_mb

        return compare_mb(data, candidate, deployed, gamma=gamma, ci=ci, n_boot=n_boot, seed=seed, th=th, cfg=model)
    if deployed is None:
        return _compare_to_behavior(data, candidate, gamma, name, ci, n_boot, seed, th, fqe)
    preps, evals = [], []
    for tgt_like in (candidate, deployed):
        tgt = target_arrays(tgt_like, data)
        p = _Prepared(data, tgt, gamma, (name,), fqe, th.min_propensity)
        preps.append((p, tgt))
        evals.append(_evaluation_from(p, tgt, data, name, th, ci, n_boot, seed))
    reasons = []
    for who, (p, tgt) in zip(("candidate", "deployed"), preps):
        why = p.why_not(name, th, tgt.has_density)
        if why:
            reasons.append(f"{who}: {why}")
    if reasons:
        return Comparison(name, None, None, None, False, "; ".join(reasons), evals[0], evals[1], ci)
    n = preps[0][0].n_units
    C = _counts(n, n_boot, seed)
    ones = np.ones((1, n))
    diff = float(preps[0][0].values(name, ones)[0] - preps[1][0].values(name, ones)[0])
    lo, hi = _interval(preps[0][0].values(name, C) - preps[1][0].values(name, C), ci)
    if not math.isfinite(diff) or lo is None:
        return Comparison(
            name, None, None, None, False, "the difference is not a finite number", evals[0], evals[1], ci
        )
    extra = _paired(preps[0][0], preps[1][0], name, C, ci, th)
    return Comparison(name, diff, lo, hi, True, "", evals[0], evals[1], ci, extra)


def _paired(p: _Prepared, p_dep: _Prepared | None, name: str, C: np.ndarray, ci: float, th: Thresholds) -> dict:
    """``{"paired": ...}``: the gate's verdict on the difference of an importance-weighted
    estimator (`rlrec.trainer.ope_diagnostics.paired_bound`); nothing for ``fqe`` (never gates)."""
    from rlrec.trainer.ope_diagnostics import paired_bound, reward_range

    if name not in ("wdr", "wpdis", "wis"):
        return {}
    bound = paired_bound(
        p.w,
        None if p_dep is None else p_dep.w,
        p.r,
        p.g,
        p.gamma,
        p._units,
        C,
        ci,
        th.min_step_ess,
        th.max_tail_share,
        reward_range(p.data.rewards),
    )
    return {"paired": bound}


def _compare_to_behavior(
    data: LoggedData,
    candidate: Any,
    gamma: float,
    name: str,
    ci: float,
    n_boot: int,
    seed: int,
    th: Thresholds,
    fqe: FQEConfig | None,
) -> Comparison:
    """`compare` against the logged behaviour itself: its on-policy value is the mean discounted
    return of the same (covered) episodes, resampled together with the candidate's estimate."""
    tgt = target_arrays(candidate, data)
    p = _Prepared(data, tgt, gamma, (name,), fqe, th.min_propensity)
    ev = _evaluation_from(p, tgt, data, name, th, ci, n_boot, seed)
    n = p.n_units
    G, cnt = p._units(p.G), p._units(np.ones(len(p.idx)))
    C = _counts(n, n_boot, seed) if n else np.zeros((0, 0))
    base = Evaluation(
        gamma,
        data.n_episodes,
        data.steps,
        float(data.discounted_returns(gamma).mean()),
        ev.behavior_versions,
        {
            name: Estimate(
                float(G.sum() / cnt.sum()) if n else None,
                *_interval((C @ G) / (C @ cnt), ci),
                n > 0,
                "",
                {"ok": n > 0, "reason": "" if n else "no episodes", "behavior_on_policy": True},
            )
        },
        {},
        name,
        ci,
    )
    why = p.why_not(name, th, tgt.has_density)
    if why:
        return Comparison(
            name, None, None, None, False, f"candidate: {why}", ev, base, ci, {"deployed_is_behavior": True}
        )
    ones = np.ones((1, n))
    diff = float(p.values(name, ones)[0] - G.sum() / cnt.sum())
    lo, hi = _interval(p.values(name, C) - (C @ G) / (C @ cnt), ci)
    extra = {"deployed_is_behavior": True, **_paired(p, None, name, C, ci, th)}
    return Comparison(name, diff, lo, hi, lo is not None, "", ev, base, ci, extra)


def _evaluation_from(
    p: _Prepared, tgt: TargetArrays, data: LoggedData, name: str, th: Thresholds, ci: float, n_boot: int, seed: int
) -> Evaluation:
    why = p.why_not(name, th, tgt.has_density)
    if why:
        est = Estimate(None, None, None, False, why)
    else:
        n = p.n_units
        value = float(p.values(name, np.ones((1, n)))[0])
        lo, hi = _interval(p.values(name, _counts(n, n_boot, seed)), ci)
        ok = math.isfinite(value)
        est = Estimate(
            value, lo, hi, ok, "" if ok else "not a finite number", p.verdict(name, value, th) if ok else None
        )
    G = data.discounted_returns(p.gamma)
    versions = sorted({e.policy_version for e in data.episodes if e.policy_version is not None}, key=str)
    return Evaluation(
        p.gamma,
        data.n_episodes,
        data.steps,
        float(G.mean()),
        versions,
        {name: est},
        _diagnostics(data, p, th),
        name,
        ci,
    )
