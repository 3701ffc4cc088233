"""Off-policy estimators (rlrec.trainer.ope) against hand-computed cases, their diagnostics, and
the held-out split (rlrec.trainer.holdout). No Ray."""

from __future__ import annotations

import numpy as np
import pytest

from rlrec.trainer.holdout import check_fraction, holdout_score, is_held_out
from rlrec.trainer.ope import Episode, FQEConfig, LoggedData, TargetArrays, Thresholds, compare, evaluate

LOOSE = Thresholds(min_episodes=1, min_ess=0.0, max_weight=1.0, max_support=1.0)


def _two_episodes() -> LoggedData:
    # A: 2 steps, actions 0, 1, rewards 1, 2, behaviour 0.5, 0.5; B: 1 step, action 1, reward 3, behaviour 0.25
    a = Episode(np.zeros((3, 1)), np.array([0, 1]), np.array([1.0, 2.0]), np.log([0.5, 0.5]), id="A")
    b = Episode(np.ones((2, 1)), np.array([1]), np.array([3.0]), np.log([0.25]), id="B")
    return LoggedData([a, b])


def test_hand_computed_is_and_dr():
    data = _two_episodes()
    # target probabilities of the logged actions: A 1.0, 0.25 (rho 2, 0.5: w 2, 1); B 0.75 (rho 3: w 3)
    tgt = TargetArrays(np.log([1.0, 0.25, 0.75]), q=np.array([1.0, 1.0, 1.0]), v=np.array([2.0, 0.5, 2.0]))
    ev = evaluate(data, tgt, gamma=0.5, thresholds=LOOSE, n_boot=50)
    est = {k: v.value for k, v in ev.estimates.items()}
    # WIS: (W_A G_A + W_B G_B) / (W_A + W_B) = (1 * 2 + 3 * 3) / 4
    assert est["wis"] == pytest.approx(11 / 4)
    # WPDIS: t0 (2*1 + 3*3)/5 = 2.2; t1 (1*2 + 3*0)/4 * 0.5 = 0.25
    assert est["wpdis"] == pytest.approx(2.45)
    # FQE: mean V(s_0) = (2 + 2) / 2
    assert est["fqe"] == pytest.approx(2.0)
    # WDR: t0 (2*0 + 3*2)/5 + (2 + 2)/2 = 3.2; t1 [(1*1 + 3*0)/4 + (2*0.5 + 3*0)/5] * 0.5 = 0.225
    assert est["wdr"] == pytest.approx(3.425)
    assert ev.behavior_mean_return == pytest.approx((2.0 + 3.0) / 2)
    assert ev.episodes == 2 and ev.steps == 3
    d = ev.diagnostics
    assert d["coverage"] == 1.0 and d["ess"] == pytest.approx(16 / 10) and d["max_weight"] == pytest.approx(0.75)
    for e in ev.estimates.values():
        assert e.estimable and e.ci_low <= e.ci_high


def test_target_equal_to_behaviour_gives_the_behaviour_return():
    rng = np.random.default_rng(3)
    eps = []
    for i in range(60):
        T = int(rng.integers(1, 8))
        logp = np.log(rng.uniform(0.05, 1.0, T))
        eps.append(Episode(rng.normal(size=(T + 1, 2)), rng.integers(0, 3, T), rng.normal(size=T), logp, id=str(i)))
    data = LoggedData(eps)
    tgt = TargetArrays(data.behavior_logp.copy(), q=np.zeros(data.steps), v=np.zeros(data.steps))
    ev = evaluate(data, tgt, gamma=0.9, estimators=("wis", "wpdis", "wdr"), thresholds=LOOSE)
    truth = data.discounted_returns(0.9).mean()
    for name in ("wis", "wpdis", "wdr"):  # WDR with a zero model is WPDIS
        assert ev.estimates[name].value == pytest.approx(truth), name
    assert ev.diagnostics["ess"] == pytest.approx(60) and ev.diagnostics["support"] == pytest.approx(0.0, abs=1e-9)


def test_missing_propensities_count_against_coverage_and_are_left_out():
    data_eps = [Episode(np.zeros((2, 1)), np.array([1]), np.array([1.0]), np.log([0.5]), id=f"e{i}") for i in range(12)]
    data_eps.append(Episode(np.zeros((3, 1)), np.array([0, 0]), np.array([100.0, 100.0]), None, id="nolog"))
    data = LoggedData(data_eps)
    tgt = TargetArrays(np.log(np.full(data.steps, 0.5)))
    ev = evaluate(data, tgt, gamma=1.0, estimators=("wis",), thresholds=Thresholds(min_episodes=1, min_ess=1))
    assert ev.diagnostics["coverage"] == pytest.approx(12 / 14)
    assert not ev.estimates["wis"].estimable and "coverage" in ev.estimates["wis"].reason
    ev = evaluate(data, tgt, gamma=1.0, estimators=("wis",), thresholds=Thresholds(min_episodes=1, min_coverage=0.5))
    assert ev.estimates["wis"].value == pytest.approx(1.0)  # the episode without propensities is not used


def test_diagnostics_refuse_collapsed_weights_and_missing_support():
    n = 50
    eps = [
        Episode(np.zeros((2, 1)), np.array([i % 2]), np.array([float(i)]), np.log([0.5]), id=str(i)) for i in range(n)
    ]
    data = LoggedData(eps)
    # all the weight on one episode
    logp = np.log(np.full(n, 1e-6))
    logp[7] = 0.0
    ev = evaluate(
        data, TargetArrays(logp), gamma=1.0, estimators=("wis", "wpdis"), thresholds=Thresholds(max_support=1.0)
    )
    for e in ev.estimates.values():
        assert not e.estimable and e.value is None and "effective sample size" in e.reason
    # the candidate mostly takes action 2, which the behaviour never takes
    for ep in eps:
        ep.behavior_probs = np.array([[0.5, 0.5, 0.0]])
    data = LoggedData(eps)
    probs = np.tile([0.1, 0.1, 0.8], (n, 1))
    tgt = TargetArrays(
        np.log(probs[np.arange(n), data.actions]), probs=probs, next_probs=probs, q=np.zeros(n), v=np.zeros(n)
    )
    ev = evaluate(data, tgt, gamma=1.0)
    assert ev.diagnostics["support"] == pytest.approx(0.8)
    for e in ev.estimates.values():
        assert not e.estimable and "support" in e.reason
    # a horizon too long for pure importance sampling
    long = [
        Episode(np.zeros((201, 1)), np.zeros(200, int), np.ones(200), np.log(np.full(200, 0.5)), id=str(i))
        for i in range(20)
    ]
    data = LoggedData(long)
    ev = evaluate(
        data, TargetArrays(data.behavior_logp.copy(), q=np.zeros(data.steps), v=np.zeros(data.steps)), gamma=0.99
    )
    assert "horizon" in ev.estimates["wis"].reason and ev.estimates["wdr"].estimable


def test_fqe_discrete_two_step_chain():
    # s0 --a--> s1 --a--> end; reward = action at each step; behaviour uniform; target takes 1 w.p. 0.9
    rng = np.random.default_rng(0)
    eps = []
    for i in range(300):
        a = rng.integers(0, 2, 2)
        eps.append(Episode(np.array([[0.0], [1.0], [2.0]]), a, a.astype(float), np.log([0.5, 0.5]), id=str(i)))
    data = LoggedData(eps)
    probs = np.tile([0.1, 0.9], (data.steps, 1))
    tgt = TargetArrays(np.log(probs[np.arange(data.steps), data.actions]), probs=probs, next_probs=probs)
    ev = evaluate(data, tgt, gamma=0.5, fqe=FQEConfig(steps=1000, seed=1))
    truth = 0.9 + 0.5 * 0.9
    for name in ("fqe", "wdr", "wpdis", "wis"):
        assert ev.estimates[name].value == pytest.approx(truth, abs=0.08), name
        assert ev.estimates[name].ci_low < truth + 0.08 and ev.estimates[name].ci_high > truth - 0.08


def test_fqe_box_actions():
    # one step, reward = -(a - 0.5)^2; target: greedy at 0.5 (deterministic) -> value 0
    rng = np.random.default_rng(1)
    n = 400
    acts = rng.uniform(-1, 1, (n, 1))
    eps = [
        Episode(np.zeros((2, 1)), acts[i : i + 1], -((acts[i] - 0.5) ** 2), np.log([0.5]), id=str(i)) for i in range(n)
    ]
    data = LoggedData(eps)
    tgt = TargetArrays(np.full(n, np.nan), actions=np.full((n, 1, 1), 0.5), next_actions=np.full((n, 1, 1), 0.5))
    ev = evaluate(data, tgt, gamma=0.9, fqe=FQEConfig(steps=800))
    assert ev.estimates["fqe"].value == pytest.approx(0.0, abs=0.05)
    assert not ev.estimates["wis"].estimable and "no density" in ev.estimates["wis"].reason


def test_paired_comparison_orders_candidates():
    rng = np.random.default_rng(5)
    n = 400
    a = rng.integers(0, 2, n)
    eps = [Episode(np.zeros((2, 1)), a[i : i + 1], np.array([float(a[i])]), np.log([0.5]), id=str(i)) for i in range(n)]
    data = LoggedData(eps)

    def target(p1: float) -> TargetArrays:  # per-step arrays follow the data's order (sorted by id)
        return TargetArrays(np.log(np.where(data.actions == 1, p1, 1 - p1)), q=np.zeros(n), v=np.zeros(n))

    better = compare(data, target(0.8), target(0.5), gamma=0.9, estimator="wdr")
    assert better.estimable and better.ci_low > 0 and better.difference == pytest.approx(0.3, abs=0.06)
    worse = compare(data, target(0.2), target(0.5), gamma=0.9, estimator="wis")
    assert worse.ci_high < 0


def test_holdout_split_is_deterministic_and_nested():
    ids = [f"ep-{i}" for i in range(5000)]
    small = {i for i in ids if is_held_out(i, 0.05)}
    large = {i for i in ids if is_held_out(i, 0.2)}
    assert small <= large and 150 < len(small) < 350 and 850 < len(large) < 1150
    assert not any(is_held_out(i, 0.0) for i in ids)
    import hashlib

    i = ids[0]
    assert holdout_score(i) == int.from_bytes(hashlib.sha256(i.encode()).digest()[:8], "big") / 2**64
    with pytest.raises(ValueError, match="holdout-fraction"):
        check_fraction(1.0)


def test_a_greedy_behaviour_is_flagged():
    # logged with Policy.act(explore=False): the action is always the argmax and action_logp is
    # log pi(argmax) < 0, which looks like a propensity but is not one
    rng = np.random.default_rng(2)
    eps = []
    for i in range(40):
        logits = rng.normal(size=(3, 2))
        p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        a = p.argmax(1)
        eps.append(Episode(np.zeros((4, 1)), a, np.ones(3), np.log(p[np.arange(3), a]), id=str(i), behavior_probs=p))
    data = LoggedData(eps)
    assert data.greedy_share == 1.0
    tgt = TargetArrays(np.zeros(data.steps), q=np.zeros(data.steps), v=np.zeros(data.steps))
    ev = evaluate(data, tgt, gamma=0.9, thresholds=Thresholds(max_support=1.0))
    for name in ("wdr", "wis", "wpdis"):
        assert not ev.estimates[name].estimable and "greedy behaviour" in ev.estimates[name].reason
    assert ev.estimates["fqe"].estimable and ev.diagnostics["behavior_greedy_share"] == 1.0


def test_a_deterministic_behaviour_is_not_estimable_by_importance_weights():
    # propensity 1 at every step (action_logp 0.0, what Policy.act(explore=False) logs), with the
    # distribution inputs recorded beside it: they do not make the behaviour stochastic
    rng = np.random.default_rng(4)
    eps = []
    for i in range(40):
        p = np.full((3, 2), 0.5)
        a = rng.integers(0, 2, 3)
        eps.append(Episode(np.zeros((4, 1)), a, np.ones(3), np.zeros(3), id=str(i), behavior_probs=p))
    data = LoggedData(eps)
    assert data.deterministic_share == 1.0
    np.testing.assert_array_equal(data.behavior_probs[np.arange(data.steps), data.actions], 1.0)
    same = TargetArrays(np.zeros(data.steps), q=np.zeros(data.steps), v=np.zeros(data.steps))
    ev = evaluate(data, same, gamma=0.9, thresholds=Thresholds(max_support=1.0))
    for name in ("wdr", "wis", "wpdis"):
        e = ev.estimates[name]
        assert not e.estimable and e.value is None and "deterministic behaviour" in e.reason, name
    assert ev.diagnostics["behavior_deterministic_share"] == 1.0
    # a stochastic candidate on the same data: the exact support diagnostic sees the missing actions
    half = np.full((data.steps, 2), 0.5)
    ev = evaluate(
        data,
        TargetArrays(np.log(np.full(data.steps, 0.5)), probs=half, next_probs=half),
        gamma=0.9,
        estimators=("wis",),
    )
    assert ev.diagnostics["support"] == pytest.approx(0.5) and "support" in ev.estimates["wis"].reason
    # Box actions (no action probabilities): the propensities alone decide
    box = [Episode(np.zeros((3, 1)), rng.normal(size=(2, 1)), np.ones(2), np.zeros(2), id=str(i)) for i in range(40)]
    ev = evaluate(
        LoggedData(box),
        TargetArrays(np.log(np.full(80, 0.3))),
        gamma=0.9,
        estimators=("wis", "wpdis"),
        thresholds=Thresholds(max_support=1.0),
    )
    for e in ev.estimates.values():
        assert not e.estimable and "deterministic behaviour" in e.reason


class _SoftmaxTarget:
    """A discrete candidate pi(a|s) = softmax(s @ W), as `PolicyTarget` gives it: arrays on any data."""

    def __init__(self, W: np.ndarray, greedy: bool = False) -> None:
        self.W, self.greedy = W, greedy

    def _probs(self, obs: np.ndarray) -> np.ndarray:
        z = obs @ self.W
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        if self.greedy:
            p = np.eye(p.shape[1])[p.argmax(1)]
        return p

    def arrays(self, data: LoggedData) -> TargetArrays:
        probs, nxt = self._probs(data.obs), self._probs(data.next_obs)
        with np.errstate(divide="ignore"):
            logp = np.log(probs[np.arange(data.steps), data.actions])
        return TargetArrays(logp, probs=probs, next_probs=nxt)


def _random_walk_episodes(n: int, seed: int, horizon: int = 6) -> list[Episode]:
    """Episodes of a 2-action walk on a 2-d state, uniform behaviour, reward = 1 when the action
    matches the sign of the state's first coordinate."""
    rng = np.random.default_rng(seed)
    eps = []
    for _i in range(n):
        T = int(rng.integers(1, horizon + 1))
        obs = rng.normal(size=(T + 1, 2)).astype(np.float32)
        a = rng.integers(0, 2, T)
        r = (a == (obs[:-1, 0] > 0)).astype(float)
        eps.append(Episode(obs, a, r, np.log(np.full(T, 0.5)), id=f"ep-{rng.integers(1 << 40):x}"))
    return eps


def test_estimates_do_not_depend_on_the_order_of_the_episodes():
    # the same episodes read in another order (commit order across partitions depends on timing)
    # give the same numbers, FQE fit and bootstrap intervals included
    eps = _random_walk_episodes(120, seed=11)
    target = _SoftmaxTarget(np.array([[-2.0, 2.0], [0.0, 0.0]]))
    kw = {"gamma": 0.9, "n_boot": 100, "seed": 3, "fqe": FQEConfig(steps=150, seed=2), "thresholds": LOOSE}
    first = evaluate(LoggedData(eps), target, **kw).to_dict()
    shuffled = [eps[i] for i in np.random.default_rng(0).permutation(len(eps))]
    assert [e.id for e in shuffled] != [e.id for e in eps]
    second = evaluate(LoggedData(shuffled), target, **kw).to_dict()
    assert second == first
    assert {k for k, e in first["estimates"].items() if e["estimable"]} == {"wdr", "fqe", "wpdis", "wis"}
    cmp1 = compare(LoggedData(eps), target, None, estimator="wdr", **kw).to_dict()
    cmp2 = compare(LoggedData(list(reversed(eps))), target, None, estimator="wdr", **kw).to_dict()
    assert cmp1 == cmp2 and cmp1["difference"] is not None


def test_gate_verdict_refuses_what_rests_on_the_model_alone():
    # 60-step episodes, uniform behaviour, a greedy candidate: its cumulative weight is 0 after
    # the first logged action it would not take, so beyond a few steps WDR is the Q-model's guess
    # (here a model that claims 1 per remaining step: estimable, and useless for a decision)
    rng = np.random.default_rng(5)
    eps = []
    for i in range(200):
        obs = rng.normal(size=(61, 2)).astype(np.float32)
        a = rng.integers(0, 2, 60)
        eps.append(Episode(obs, a, np.ones(60), np.log(np.full(60, 0.5)), id=f"e{i:04d}"))
    data = LoggedData(eps)
    greedy = _SoftmaxTarget(np.array([[-1.0, 1.0], [0.0, 0.0]]), greedy=True).arrays(data)
    remaining = np.concatenate([np.arange(n, 0, -1) for n in data.lengths]).astype(float)
    greedy.q, greedy.v = remaining.copy(), remaining.copy()
    ev = evaluate(data, greedy, gamma=0.99, estimators=("wdr", "fqe"))
    wdr = ev.estimates["wdr"]
    assert wdr.estimable and wdr.value is not None  # estimable as before: it has a value
    assert not wdr.gate["ok"] and "effective sample size" in wdr.gate["reason"]
    assert wdr.gate["t_star"] == ev.diagnostics["t_star"] and 2 <= wdr.gate["t_star"] <= 6
    assert wdr.gate["value_share_beyond_t_star"] > 0.5
    fqe = ev.estimates["fqe"]
    assert fqe.estimable and not fqe.gate["ok"] and "model alone" in fqe.gate["reason"]
    # the gate's comparison carries the verdict; the behaviour needs no model
    c = compare(data, greedy, None, gamma=0.99, estimator="wdr")
    assert c.estimable and not c.gate["ok"] and c.gate["reason"].startswith("candidate: ")
    assert c.to_dict()["gate"] == c.gate
    # a short horizon keeps enough weight at every step: the verdict is ok
    short = LoggedData(_random_walk_episodes(400, seed=4, horizon=3))
    ev = evaluate(short, _SoftmaxTarget(np.array([[-2.0, 2.0], [0.0, 0.0]])), gamma=0.9, fqe=FQEConfig(steps=100))
    assert ev.estimates["wdr"].gate == {"ok": True, "reason": "", "t_star": None, "value_share_beyond_t_star": 0.0}
    assert ev.estimates["wis"].gate["ok"] and not ev.estimates["fqe"].gate["ok"]


def test_a_short_horizon_difference_rests_on_the_data_and_its_data_only_bound_gates():
    """Weights that never collapse (3 steps): the paired verdict is ok, nothing remains beyond
    the data (remainder 0) and the data-only bound is the per-decision weighted difference; the
    gate refuses when that bound is below -margin even where wdr's own interval is not."""
    from types import SimpleNamespace

    from rlrec.trainer.ope_jobs import gate_decision

    short = LoggedData(_random_walk_episodes(400, seed=4, horizon=3))
    better = _SoftmaxTarget(np.array([[-2.0, 2.0], [0.0, 0.0]]))
    c = compare(short, better, None, gamma=0.9, estimator="wdr", fqe=FQEConfig(steps=100))
    p = c.to_dict()["paired"]
    assert p["ok"] and p["t_star"] is None and p["remainder"] == 0.0 and p["model_share"] == 0.0
    assert p["lower_bound"] == p["head_low"] and c.gate["ok"]
    # the rule reads the data-only bound: the same comparison with a bound below -margin refuses
    fake = SimpleNamespace(estimable=True, gate={"ok": True}, ci_low=0.5, extra={"paired": {**p, "lower_bound": -1.0}})
    promoted, reason = gate_decision(fake, 0.0)
    assert not promoted and reason.startswith("the data-only lower bound of the difference -1")
