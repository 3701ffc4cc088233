"""The pessimistic model-based estimator ``mb``: a learned simulator of the logged data, never a
real one. numpy and torch, no Ray.

What it does, on the held-out episodes:

1. **Fit** an ensemble of `ModelConfig.members` small MLPs, each on its own bootstrap resample
   of the episodes with its own seed (``seed * 1000 + k``): from ``(s_t, a_t)`` (observation
   normalized, Discrete actions one-hot) each predicts the change of state ``s_{t+1} - s_t``, the
   reward and the logit of termination (squared error, squared error, cross-entropy; Adam).
2. **Roll out** the candidate from the held-out episodes' initial states (the first
   `ModelConfig.starts` episodes by id) in every member's world, for at most the longest logged
   episode's length (and no longer than where ``gamma^t`` < 1e-3): discounted rewards, each
   weighted by the probability that the member has not predicted termination before it.
3. **Pessimism where the model is not the data.** At every step, a state *leaves the data* when
   its nearest logged state (normalized observations, a fixed subsample of at most
   `ModelConfig.reference_states` distinct ones) is farther than the 99th percentile of the logged states' own
   nearest-neighbour distances times `ModelConfig.max_distance`, and the members *disagree* when
   the largest deviation of one member's predicted next state from their mean exceeds
   `ModelConfig.max_disagreement` (in units of the data's state changes). Either ends the rollout
   there (for the rest of the probability that it is still running) as a termination would, with
   the worst the rewards allow after it
   (``min(0, r_min)`` per remaining step); below those limits each reward is lowered by
   ``penalty * disagreement * max|r|`` (a MOPO-style penalty, `ModelConfig.penalty` 0.1). The deployed version (the gate's
   baseline) is rolled out **optimistically** by the same rules: where it leaves the data it gets
   the best the rewards allow (``max(0, r_max)`` per remaining step up to the horizon, no
   termination) and the penalty is added, so the difference candidate - deployed leans towards
   refusing on both sides (its ``offdata_share`` is reported in its verdict).
4. **State coverage**, the gating diagnostic: ``offdata_share``, the discounted share of the
   candidate's rollouts' horizon that lies after they left the data (0: the candidate stays where
   the data are), averaged over members and starts; above `ModelConfig.max_offdata_share` the
   estimate is not usable for gating.
5. **Intervals that include the model**: each of the `n_boot` resamples takes one ensemble member
   (in turn) and a bootstrap resample of the initial states (paired with the same episodes'
   returns when the baseline is the behaviour). The spread of the refits (resampled data, seeds)
   is in the interval; the model's shared bias (what every member gets wrong alike) is not: they
   are not valid bounds, and the gate uses their low quantile with the pessimism above.

Costs: `members` fits of `steps` minibatches each plus ``members x starts x horizon`` predicted
steps (CartPole, 200 held-out episodes, 5 members of 2x64 units, 1500 steps: see
docs/TRAINER.md §7).

Example (through `rlrec.trainer.ope`):
    >>> from rlrec.trainer.ope import LoggedData, PolicyTarget, compare, evaluate  # doctest: +SKIP
    >>> ev = evaluate(LoggedData(episodes), PolicyTarget(policy, False), gamma=0.99,
    ...               estimators=("mb",), model=ModelConfig(seed=0))  # doctest: +SKIP
    >>> ev.estimates["mb"].value, ev.estimates["mb"].gate, ev.diagnostics["mb"]  # doctest: +SKIP
    >>> c = compare(data, PolicyTarget(candidate, False), PolicyTarget(deployed, False),
    ...             gamma=0.99, estimator="mb")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ModelConfig", "ModelError", "Rollouts", "fit_ensemble", "rollout"]


@dataclass
class ModelConfig:
    """Settings of the ``mb`` estimator.

    Args:
        members: ensemble members (refits, each on its own bootstrap resample of episodes and seed).
        hidden: hidden layer sizes of each member (ReLU).
        steps: gradient steps per member.
        batch_size: transitions per step.
        lr: Adam learning rate.
        starts: most held-out initial states rolled out from (the first by episode id).
        reference_states: most logged states the coverage check compares with.
        max_distance: a state leaves the data beyond this many times the logged states' 99th
            percentile nearest-neighbour distance.
        max_disagreement: the members disagree beyond this (largest member deviation of the
            predicted next state, in standard deviations of the logged state changes).
        penalty: reward penalty per unit of disagreement, times the largest absolute reward.
        max_offdata_share: the gate verdict: most discounted share of the rollouts' horizon after
            leaving the data.
        max_reward_disagreement: the members disagree beyond this largest deviation of one
            member's predicted reward from their mean, times the largest absolute reward.
        max_termination_disagreement: likewise for the predicted probability of termination.
        max_horizon: the most steps a rollout may need (the longest logged episode, or where
            ``gamma^t`` < 1e-3 if shorter); beyond it mb refuses (e.g. gamma 1 with very long episodes).
        max_seconds: the wall-time budget of one fit and of one rollout; beyond it mb refuses.
        seed: the fits' and rollouts' seed.
        threads: torch CPU threads while fitting and rolling out, set only when called from the
            main thread (torch's thread count is process-wide: from a background thread, e.g. the
            trainer's evaluation, it is left as it is so the training thread keeps its threads).
    """

    members: int = 5
    hidden: tuple[int, ...] = (64, 64)
    steps: int = 1500
    batch_size: int = 256
    lr: float = 1e-3
    starts: int = 256
    reference_states: int = 4000
    max_distance: float = 1.0
    max_disagreement: float = 0.5
    penalty: float = 0.1
    max_offdata_share: float = 0.2
    max_reward_disagreement: float = 0.3
    max_termination_disagreement: float = 0.5
    max_horizon: int = 1000
    max_seconds: float = 900.0
    seed: int = 0
    threads: int = 1


@dataclass
class _Ensemble:
    nets: list
    obs_mean: np.ndarray
    obs_std: np.ndarray
    d_mean: np.ndarray
    d_std: np.ndarray
    r_scale: float
    n_actions: int | None
    act_mean: np.ndarray | None
    act_std: np.ndarray | None
    fit_seconds: float
    logged_actions: np.ndarray | None = None  # the Discrete actions the data show
    left_out: int = 0  # transitions left out of the fit (beyond FAR)


#: transitions whose normalized observation or state change lies beyond this many robust scale
#: units are left out of the fit
FAR = 1e3


class ModelError(ValueError):
    """The model cannot be fitted or rolled out on these data (the message says why)."""


def _finite(what: str, x: np.ndarray) -> None:
    if not np.isfinite(np.asarray(x, dtype=np.float64)).all():
        raise ModelError(
            f"mb: the {what} are not all finite numbers (an observation too large for float32 arithmetic?): "
            "no model is fitted on them"
        )


def _robust_scale(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(center, scale)`` per column: the median and the inter-quartile range / 1.349 (the
    standard deviation of a normal distribution); where that is 0 (a mostly constant column), the
    mean absolute deviation from the median, else 1."""
    med = np.median(x, axis=0)
    q75, q25 = np.percentile(x, [75, 25], axis=0)
    scale = (q75 - q25) / 1.349
    mad = np.mean(np.abs(x - med), axis=0) if len(x) else np.zeros_like(med)
    scale = np.where(scale > 0, scale, np.where(np.isfinite(mad) & (mad > 0), mad, 1.0))
    return med.astype(np.float32), (scale + 1e-6).astype(np.float32)


def _inputs(ens: _Ensemble, obs: Any, act: Any) -> Any:
    import torch

    x = (torch.as_tensor(obs, dtype=torch.float32) - torch.as_tensor(ens.obs_mean)) / torch.as_tensor(ens.obs_std)
    x = x.clamp(-1e4, 1e4)  # far outside the data either way (the coverage check says so): finite arithmetic
    if ens.n_actions is not None:  # an action never logged is encoded as the last logged one (see `rollout`)
        idx = torch.as_tensor(act, dtype=torch.int64).reshape(-1).clamp(0, ens.n_actions - 1)
        a = torch.nn.functional.one_hot(idx, ens.n_actions).float()
    else:
        a = (torch.as_tensor(act, dtype=torch.float32).reshape(len(x), -1) - torch.as_tensor(ens.act_mean)) / (
            torch.as_tensor(ens.act_std)
        )
    return torch.cat([x, a], dim=1)


def fit_ensemble(data: Any, cfg: ModelConfig) -> _Ensemble:
    """Fit `cfg.members` dynamics/reward/termination models on `data` (a `rlrec.trainer.ope.LoggedData`)."""
    import torch

    from rlrec.trainer.ope_fqe import _linear

    t0 = time.time()
    discrete = data.actions.ndim == 1 and np.issubdtype(data.actions.dtype, np.integer)
    obs = data.obs.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        delta = data.next_obs.astype(np.float64) - obs
    _finite("observations", obs)
    _finite("state changes (next observation - observation)", delta)
    _finite("rewards", data.rewards)
    # robust scaling (median, inter-quartile range): one hostile observation cannot inflate the
    # scale and switch off the coverage and disagreement checks
    obs_mean, obs_std = _robust_scale(obs)
    d_mean, d_std = _robust_scale(delta)
    r_scale = max(float(np.abs(data.rewards).max()), 1e-8)
    acts = data.actions if discrete else data.actions.reshape(len(data.rewards), -1).astype(np.float32)
    if not discrete:
        _finite("actions", acts)
    ens = _Ensemble(
        [],
        obs_mean.astype(np.float32),
        obs_std.astype(np.float32),
        d_mean.astype(np.float32),
        d_std.astype(np.float32),
        r_scale,
        int(max(acts.max() + 1, 2)) if discrete else None,
        None if discrete else _robust_scale(acts.astype(np.float64))[0].astype(np.float32),
        None if discrete else _robust_scale(acts.astype(np.float64))[1].astype(np.float32),
        0.0,
        np.unique(acts) if discrete else None,
    )
    x_all = _inputs(ens, data.obs, acts)
    z_d = (delta - d_mean) / d_std
    # transitions beyond FAR robust scale units (a hostile or broken observation) are left out of
    # the fit: finite, and no single one can dominate the squared errors
    keep = (np.abs(x_all.numpy()[:, : obs.shape[1]]) <= FAR).all(1) & (np.abs(z_d) <= FAR).all(1)
    ens.left_out = int((~keep).sum())
    if not keep.any():
        raise ModelError(f"mb: every transition lies beyond {FAR:g} scale units of the data's median: refused")
    y_d = torch.as_tensor(np.clip(z_d, -FAR, FAR), dtype=torch.float32)
    y_r = torch.as_tensor(data.rewards / r_scale, dtype=torch.float32)
    y_t = torch.as_tensor(data.terminals, dtype=torch.float32)
    n_out = data.obs.shape[1] + 2
    for k in range(cfg.members):
        seed = cfg.seed * 1000 + k
        rng = np.random.default_rng(seed)
        # a bootstrap resample of the episodes: this member's data
        pick = rng.integers(0, data.n_episodes, data.n_episodes)
        rows = np.concatenate([np.arange(data.starts[i], data.starts[i] + data.lengths[i]) for i in pick])
        rows = rows[keep[rows]]
        if not len(rows):
            rows = np.flatnonzero(keep)
        rows_t = torch.as_tensor(rows)
        gen = torch.Generator().manual_seed(seed)
        layers: list[Any] = []
        d = x_all.shape[1]
        for h in cfg.hidden:
            layers += [_linear(d, h, gen), torch.nn.ReLU()]
            d = h
        layers.append(_linear(d, n_out, gen))
        net = torch.nn.Sequential(*layers)
        opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
        for step in range(cfg.steps):
            if step % 100 == 0 and time.time() - t0 > cfg.max_seconds:
                raise ModelError(
                    f"mb: fitting the model took longer than its budget of {cfg.max_seconds:g} s "
                    f"(member {k + 1} of {cfg.members}, step {step}): refused"
                )
            idx = rows_t[torch.randint(0, len(rows), (min(cfg.batch_size, len(rows)),), generator=gen)]
            out = net(x_all[idx])
            loss = (
                torch.nn.functional.mse_loss(out[:, :-2], y_d[idx])
                + torch.nn.functional.mse_loss(out[:, -2], y_r[idx])
                + torch.nn.functional.binary_cross_entropy_with_logits(out[:, -1], y_t[idx])
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
        if not all(bool(torch.isfinite(q).all()) for q in net.parameters()):
            raise ModelError(f"mb: the fit of ensemble member {k + 1} diverged (non-finite weights): refused")
        ens.nets.append(net.eval())
    ens.fit_seconds = time.time() - t0
    return ens


def _predict(ens: _Ensemble, obs: np.ndarray, act: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every member's ``(M, B, d)`` next states, ``(M, B)`` rewards, ``(M, B)`` termination probabilities."""
    import torch

    x = _inputs(ens, obs, act)
    with torch.no_grad():
        out = torch.stack([net(x) for net in ens.nets]).numpy().astype(np.float64)
    nxt = obs[None] + out[..., :-2] * ens.d_std + ens.d_mean
    return nxt, out[..., -2] * ens.r_scale, 1.0 / (1.0 + np.exp(-out[..., -1]))


class _Coverage:
    """Nearest-logged-(state, action) distances and the radius of the data, on normalized
    observations and actions: a Box action joins the normalized observation as its normalized
    value; a Discrete one as a one-hot vector times `SEPARATE`, so only logged pairs with the same
    action are near (an action the data never take in a region is not covered there)."""

    SEPARATE = 1e3

    def __init__(self, obs: np.ndarray, acts: np.ndarray, ens: _Ensemble, cfg: ModelConfig) -> None:
        import torch

        self.ens = ens
        rng = np.random.default_rng(cfg.seed)
        feats = np.unique(self.features(obs, acts), axis=0)  # repeated pairs would make the radius 0
        ref = (
            feats
            if len(feats) <= cfg.reference_states
            else feats[rng.choice(len(feats), cfg.reference_states, replace=False)]
        )
        self.ref = torch.as_tensor(ref, dtype=torch.float32)
        dist = torch.cdist(self.ref, self.ref)
        dist.fill_diagonal_(float("inf"))
        nn = dist.min(1).values.numpy()
        nn = nn[np.isfinite(nn) & (nn < self.SEPARATE / 2)]  # a pair alone with its action has no neighbour
        self.radius = float(np.quantile(nn, 0.99)) * cfg.max_distance if len(nn) else 0.0

    def features(self, obs: np.ndarray, act: np.ndarray) -> np.ndarray:
        ens = self.ens
        x = np.clip((np.asarray(obs, np.float64) - ens.obs_mean) / ens.obs_std, -1e4, 1e4)
        if ens.n_actions is not None:
            idx = np.clip(np.asarray(act).reshape(-1).astype(np.int64), 0, ens.n_actions - 1)
            a = np.eye(ens.n_actions)[idx] * self.SEPARATE
        else:
            a = np.clip((np.asarray(act, np.float64).reshape(len(x), -1) - ens.act_mean) / ens.act_std, -1e4, 1e4)
        return np.concatenate([x, a], axis=1).astype(np.float32)

    def distance(self, obs: np.ndarray, act: np.ndarray) -> np.ndarray:
        import torch

        q = torch.as_tensor(self.features(obs, act))
        out = np.empty(len(q))
        for s in range(0, len(q), 4096):
            out[s : s + 4096] = torch.cdist(q[s : s + 4096], self.ref).min(1).values.numpy()
        return out


@dataclass
class Rollouts:
    """The candidate in the model: ``values`` ``(members, starts)`` discounted returns,
    ``offdata`` ``(members, starts)`` the discounted share of the horizon after leaving the data,
    and the costs."""

    values: np.ndarray
    offdata: np.ndarray
    horizon: int
    fit_seconds: float
    rollout_seconds: float

    @property
    def offdata_share(self) -> float:
        return float(self.offdata.mean())


def _act(target: Any, obs: np.ndarray, explore: bool, rng: np.random.Generator) -> np.ndarray:
    """The candidate's actions at `obs` (a `PolicyTarget`, or anything with ``policy`` and
    ``explore`` as it has)."""
    policy = target.policy
    if target.discrete:
        probs = policy.action_probs(obs)
        if not explore:
            return np.argmax(probs, axis=-1)
        u = rng.random((len(probs), 1))
        return np.minimum((np.cumsum(probs, axis=1) < u).sum(1), probs.shape[1] - 1)
    if not explore:
        return np.asarray(policy.greedy_env_actions(obs))
    return np.asarray(policy.sample_env_actions(obs, 1, seed=int(rng.integers(1 << 31))))[:, 0]


def rollout(
    data: Any, target: Any, ens: _Ensemble, cov: _Coverage, gamma: float, cfg: ModelConfig, pessimistic: bool | str
) -> Rollouts:
    """Roll `target` out in every member's world from the first `cfg.starts` held-out initial states.

    `pessimistic`: True (the candidate): where a state leaves the data (or the members disagree,
    or an action was never logged) the rollout ends with the worst the rewards allow per
    remaining step and each reward is lowered by the disagreement penalty; ``"optimistic"`` (the
    deployed version, the gate's baseline): the same stops, with the *best* the rewards allow
    (``max(0, r_max)`` per remaining step up to the horizon, no termination) and the penalty
    added, an upper bound of its value where the model is not the data; False: neither."""
    t0 = time.time()
    M = len(ens.nets)
    n0 = min(cfg.starts, data.n_episodes)
    s0 = data.obs[data.starts[:n0]].astype(np.float64)
    H = int(data.lengths.max())
    if gamma < 1.0:
        H = min(H, math.ceil(math.log(1e-3) / math.log(gamma)))
    if cfg.max_horizon < H:
        raise ModelError(
            f"mb: the rollouts would need {H} steps (the longest logged episode, gamma {gamma:g}), "
            f"more than its cap of {cfg.max_horizon}: refused"
        )
    optimistic = pessimistic == "optimistic"
    # leaving the data: the worst (candidate) or the best (deployed) the rewards allow from there
    r_stop = max(0.0, float(data.rewards.max())) if optimistic else min(0.0, float(data.rewards.min()))
    lam = cfg.penalty * ens.r_scale * (-1.0 if optimistic else 1.0)
    g = gamma ** np.arange(H + 1, dtype=np.float64)
    tail = np.cumsum(g[::-1])[::-1]  # tail[t] = sum_{k>=t} g^k (up to H)
    total = tail[0]
    rng = np.random.default_rng(cfg.seed + 7)
    state = np.repeat(s0[None], M, axis=0)  # (M, n0, d)
    alive = np.ones((M, n0), dtype=bool)
    survive = np.ones((M, n0))  # the probability that the rollout has not terminated yet
    values = np.zeros((M, n0))
    offdata = np.zeros((M, n0))
    sign = -1.0 if optimistic else 1.0
    for t in range(H):
        if not alive.any():
            break
        if time.time() - t0 > cfg.max_seconds:
            raise ModelError(
                f"mb: the rollouts took longer than their budget of {cfg.max_seconds:g} s (at step {t} of {H}): refused"
            )
        mi, si = np.nonzero(alive)
        obs = state[mi, si]
        act = _act(target, obs.astype(np.float32), bool(getattr(target, "explore", False)), rng)
        if pessimistic:
            left = cov.distance(obs, act) > cov.radius
        nxt, rew, term = _predict(ens, obs.astype(np.float32), act)
        # member m's world for the rollouts of member m
        world_next = nxt[mi, np.arange(len(mi))]
        world_r = rew[mi, np.arange(len(mi))]
        world_term = term[mi, np.arange(len(mi))]
        if pessimistic:
            zero = np.zeros(len(mi))
            # the members' disagreement on every head: next state (in the data's state changes),
            # reward (in units of the largest reward) and probability of termination
            spread = np.abs((nxt - nxt.mean(0, keepdims=True)) / ens.d_std).max(axis=(0, 2)) if M > 1 else zero
            r_dev = np.abs(rew - rew.mean(0, keepdims=True)).max(0) / ens.r_scale if M > 1 else zero
            t_dev = np.abs(term - term.mean(0, keepdims=True)).max(0) if M > 1 else zero
            # an action the data never show leaves the data too
            unknown = (
                ~np.isin(np.asarray(act).reshape(-1), ens.logged_actions)
                if ens.logged_actions is not None
                else np.zeros(len(mi), dtype=bool)
            )
            stop = (
                left
                | (spread > cfg.max_disagreement)
                | (r_dev > cfg.max_reward_disagreement)
                | (t_dev > cfg.max_termination_disagreement)
                | unknown
            )
            world_r = world_r - lam * (spread + r_dev)
            # termination: pessimistic (candidate) or optimistic (baseline) by the members' spread
            world_term = np.clip(world_term + sign * t_dev, 0.0, 1.0)
            # leaving: the worst the rewards allow from here on; the share of the horizon it cuts off
            ms, ss = mi[stop], si[stop]
            values[ms, ss] += r_stop * tail[t] * survive[ms, ss]
            offdata[ms, ss] = tail[t] / total * survive[ms, ss]
            alive[ms, ss] = False
            keep = ~stop
        else:
            keep = np.ones(len(mi), dtype=bool)
        mk, sk = mi[keep], si[keep]
        values[mk, sk] += g[t] * world_r[keep] * survive[mk, sk]
        state[mk, sk] = world_next[keep]
        # termination in expectation: the member's probability of it, not a threshold
        survive[mk, sk] *= 1.0 - world_term[keep]
        alive[mk, sk] &= survive[mk, sk] > 1e-4
    if not np.isfinite(values).all():
        raise ModelError("mb: the model's rollouts are not finite numbers (extreme observations?): refused")
    return Rollouts(values, offdata, H, ens.fit_seconds, time.time() - t0)


def draw(n_boot: int, members: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The resamples of the interval: ``(n_boot,)`` member of each (in turn) and ``(n_boot, n)``
    bootstrap counts of the initial states (the same for every target with one seed)."""
    rng = np.random.default_rng(seed + 99)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)
    return np.arange(n_boot) % members, counts


def resampled(values: np.ndarray, member: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``(n_boot,)`` the mean of `values` ``(members, n)`` for each resample."""
    return (counts * values[member]).sum(1) / counts.sum(1)


# ------------------------------------------------------------------ the estimator in evaluate / compare


def _gate(ro: Rollouts, cfg: ModelConfig) -> dict:
    share = ro.offdata_share
    if share > cfg.max_offdata_share:
        return {
            "ok": False,
            "reason": f"state coverage: {share:.0%} of the candidate's discounted horizon in the model lies "
            f"after its states left the logged data (> {cfg.max_offdata_share:.0%})",
            "offdata_share": round(share, 6),
        }
    return {"ok": True, "reason": "", "offdata_share": round(share, 6)}


def _diag(ro: Rollouts, cfg: ModelConfig, ens: _Ensemble, cov: _Coverage) -> dict:
    return {
        "offdata_share": round(ro.offdata_share, 6),
        "left_data": round(float((ro.offdata > 0).mean()), 6),
        "refits": len(ens.nets),
        "starts": int(ro.values.shape[1]),
        "horizon": ro.horizon,
        "radius": round(cov.radius, 6),
        "transitions_left_out": ens.left_out,
        "fit_seconds": round(ens.fit_seconds, 3),
        "rollout_seconds": round(ro.rollout_seconds, 3),
    }


def _model(data: Any, cfg: ModelConfig) -> tuple[_Ensemble, _Coverage]:
    """The ensemble and coverage check fitted on `data` with `cfg` (fitted once per data and
    fit settings: the candidate and the deployed version of a comparison share them)."""

    key = (cfg.members, cfg.hidden, cfg.steps, cfg.batch_size, cfg.lr, cfg.reference_states, cfg.max_distance, cfg.seed)
    cache = data.__dict__.setdefault("_mb_models", {})
    if key in cache:
        return cache[key]

    with _threads(cfg):
        ens = fit_ensemble(data, cfg)
        acts = data.actions if ens.n_actions is not None else data.actions.reshape(len(data.rewards), -1)
        cache[key] = (ens, _Coverage(data.obs, acts, ens, cfg))
        return cache[key]


@contextlib.contextmanager
def _threads(cfg: ModelConfig) -> Iterator[None]:
    """torch's intra-op threads set to `cfg.threads` while the block runs, only on the main
    thread: the count is process-wide, and from a background thread (the trainer's evaluation)
    setting it would take the training thread's threads away; there it is left as it is."""
    import torch

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(cfg.threads)))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _roll(data: Any, target: Any, model: tuple, gamma: float, cfg: ModelConfig, pessimistic: bool | str) -> Rollouts:
    with _threads(cfg):
        return rollout(data, target, model[0], model[1], gamma, cfg, pessimistic)


def _needs_policy(target: Any) -> str:
    if getattr(target, "policy", None) is None:
        return (
            "mb rolls the candidate out in a learned model: it needs the policy (a PolicyTarget), not per-step arrays"
        )
    return ""


def estimate_mb(
    data: Any, target: Any, *, gamma: float, ci: float, n_boot: int, seed: int, cfg: ModelConfig | None
) -> tuple[Any, dict]:
    """The ``mb`` `rlrec.trainer.ope.Estimate` of `target` on `data` and its diagnostics."""
    from rlrec.trainer.ope import Estimate, _interval

    cfg = cfg or ModelConfig(seed=seed)
    why = _needs_policy(target)
    if why:
        return Estimate(None, None, None, False, why), {}
    try:
        model = _model(data, cfg)
        ro = _roll(data, target, model, gamma, cfg, pessimistic=True)
    except ModelError as e:
        return Estimate(None, None, None, False, str(e)), {}
    member, counts = draw(n_boot, len(model[0].nets), ro.values.shape[1], seed)
    lo, hi = _interval(resampled(ro.values, member, counts), ci)
    est = Estimate(float(ro.values.mean()), lo, hi, True, "", _gate(ro, cfg))
    return est, _diag(ro, cfg, *model)


def compare_mb(
    data: Any,
    candidate: Any,
    deployed: Any,
    *,
    gamma: float,
    ci: float,
    n_boot: int,
    seed: int,
    th: Any,
    cfg: ModelConfig | None,
) -> Any:
    """`rlrec.trainer.ope.compare` for ``mb``: the candidate's pessimistic rollouts against the
    deployed version's optimistic ones (the best the rewards allow where it leaves the data) in the same fitted models (or the behaviour's own returns
    of the same episodes), on the same resamples of members and initial states.

    Args:
        data: the held-out `rlrec.trainer.ope.LoggedData`.
        candidate: a `rlrec.trainer.ope.PolicyTarget`.
        deployed: likewise, or None: the logged behaviour.
        gamma: the discount.
        ci: the interval level.
        n_boot: resamples.
        seed: their seed.
        th: the `rlrec.trainer.ope.Thresholds` (episodes, support).
        cfg: the model's settings.
    """
    from rlrec.trainer.ope import Comparison, Estimate, Evaluation, _diagnostics, _interval, _Prepared, target_arrays

    cfg = cfg or ModelConfig(seed=seed)
    name = "mb"
    why: list[str] = []
    G = data.discounted_returns(gamma)
    versions = sorted({e.policy_version for e in data.episodes if e.policy_version is not None}, key=str)
    evals = []
    for who, t in (("candidate", candidate), ("deployed", deployed)):
        diag: dict = {}
        if t is not None:
            if _needs_policy(t):
                why.append(f"{who}: {_needs_policy(t)}")
            tgt = target_arrays(t, data)
            p = _Prepared(data, tgt, gamma, (), None, th.min_propensity)
            reason = p.why_not(name, th, tgt.has_density)
            if reason:
                why.append(f"{who}: {reason}")
            diag = _diagnostics(data, p, th)
        evals.append(Evaluation(gamma, data.n_episodes, data.steps, float(G.mean()), versions, {}, diag, name, ci))
    ev_c, ev_d = evals
    if why:
        for ev in evals:
            ev.estimates[name] = Estimate(None, None, None, False, "; ".join(why))
        return Comparison(name, None, None, None, False, "; ".join(why), ev_c, ev_d, ci)
    try:
        model = _model(data, cfg)
        ro_c = _roll(data, candidate, model, gamma, cfg, pessimistic=True)
        # the baseline is optimistic where it leaves the data: an upper bound of its value there
        ro_d = None if deployed is None else _roll(data, deployed, model, gamma, cfg, pessimistic="optimistic")
    except ModelError as e:
        for ev in evals:
            ev.estimates[name] = Estimate(None, None, None, False, str(e))
        return Comparison(name, None, None, None, False, str(e), ev_c, ev_d, ci)
    n0 = ro_c.values.shape[1]
    member, counts = draw(n_boot, len(model[0].nets), n0, seed)
    c_samples = resampled(ro_c.values, member, counts)
    ev_c.estimates[name] = Estimate(float(ro_c.values.mean()), *_interval(c_samples, ci), True, "", _gate(ro_c, cfg))
    ev_c.diagnostics["mb"] = _diag(ro_c, cfg, *model)
    extra: dict = {}
    if deployed is None:  # the behaviour: the discounted returns of the same episodes
        d_values = np.repeat(G[None, :n0], len(model[0].nets), axis=0)
        d_gate = {"ok": True, "reason": "", "behavior_on_policy": True}
        extra["deployed_is_behavior"] = True
    else:
        d_values = ro_d.values
        d_gate = {"ok": True, "reason": "", "optimistic": True, "offdata_share": round(ro_d.offdata_share, 6)}
        ev_d.diagnostics["mb"] = _diag(ro_d, cfg, *model)
    d_samples = resampled(d_values, member, counts)
    ev_d.estimates[name] = Estimate(float(d_values.mean()), *_interval(d_samples, ci), True, "", d_gate)
    diff = float(ro_c.values.mean() - d_values.mean())
    lo, hi = _interval(c_samples - d_samples, ci)
    if lo is None or not math.isfinite(diff):
        return Comparison(name, None, None, None, False, "mb: the difference is not a finite number", ev_c, ev_d, ci)
    return Comparison(name, diff, lo, hi, True, "", ev_c, ev_d, ci, extra)
