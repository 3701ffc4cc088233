"""Accuracy benchmark of the off-policy estimators (`rlrec.trainer.ope`), issue "Benchmark".

Two tasks, each with a stochastic behaviour policy that records its propensities and at least
five greedy target policies of widely different true value (true value: Monte-Carlo discounted
return in the simulator, `--truth-episodes` episodes):

(a) ``rlrec/ContextBandit-v0`` (3 steps per episode, gamma 0.9): behaviour softmax(x) over 3
    actions; targets: linear greedy policies from "best action" to "worst action".
(b) ``CartPole-v1`` (long horizon, gamma 0.99): behaviour takes the scripted expert's action with
    probability 0.9 (else the other one); targets: greedy linear controllers (the expert, angular
    velocity only, angle only, position only, and mixtures).

For `--datasets` independent logged datasets per task, every estimator estimates every target;
reported per estimator: median relative error, median absolute error as a share of the targets'
value range, Spearman rank correlation of the estimates with the true values (a "not estimable"
counts as a miss: a dataset with one scores -1), the share of estimates that were estimable, and the coverage of the 90 % intervals. Beside them, RLlib 2.60's
OfflinePolicyEvaluationRunner formulas ("is", "pdis": `offline_policy_evaluation_runner.py`
lines ~320-352 -- the numerator is the log-probability of a freshly *sampled* action, "pdis" a
per-step ratio, nothing discounted; re-implemented here on the same arrays, compared with the
*undiscounted* truth, their own estimand).

Usage: ``python bench/ope.py [--quick] [--json out.json] [--md out.md]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import gymnasium as gym
import numpy as np


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def _linear(W: np.ndarray, b: np.ndarray | None = None):
    from rlrec.trainer.policy import version_from_artifact
    from rlrec.trainer.synthetic import linear_policy_artifact

    spec, model = linear_policy_artifact(W, b)
    return spec, model, version_from_artifact(spec, model)


# ------------------------------------------------------------------------------------ tasks


def bandit_task():
    from rlrec.trainer.synthetic import CONTEXT_BANDIT_ID

    E = np.eye(3, 4, dtype=np.float32)
    targets = {
        "best": 4 * E,
        "ignores-x2": 4 * np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]], np.float32),
        "always-0": np.zeros((3, 4), np.float32),
        "avoids-best-of-2": -4 * np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]], np.float32),
        "worst": -4 * E,
    }
    biases = {"always-0": np.array([1, 0, 0], np.float32)}

    def behaviour(obs):  # softmax(x[:3])
        z = np.exp(obs[:3] - obs[:3].max())
        return z / z.sum()

    return {
        "name": "(a) ContextBandit, 3 steps",
        "env_id": CONTEXT_BANDIT_ID,
        "gamma": 0.9,
        "targets": {k: _linear(W, biases.get(k)) for k, W in targets.items()},
        "behaviour": behaviour,
    }


def cartpole_task():
    def ctrl(w):  # greedy action 1 iff w . obs > 0
        w = np.asarray(w, np.float32)
        return np.stack([-w, w]) * 50.0

    # greedy controllers whose true values (gamma 0.99) are ~99, ~86, ~63, ~48, ~33, ~9
    targets = {
        "expert": ctrl([0, 0, 1, 0.5]),
        "ang-velocity": ctrl([0, 0, 0, 1]),
        "ang-velocity-position": ctrl([-1, 0, 0, 1]),
        "ang-velocity+2position": ctrl([2, 0, 0, 1]),
        "angle": ctrl([0, 0, 1, 0]),
        "position": ctrl([1, 0, 0, 0]),
    }
    biases: dict = {}

    def behaviour(obs):  # the expert's action w.p. 0.9
        a = int(obs[2] + 0.5 * obs[3] > 0)
        p = np.full(2, 0.1)
        p[a] = 0.9
        return p

    return {
        "name": "(b) CartPole-v1",
        "env_id": "CartPole-v1",
        "gamma": 0.99,
        "targets": {k: _linear(W, biases.get(k)) for k, W in targets.items()},
        "behaviour": behaviour,
    }


def log_dataset(task, n: int, seed: int):
    from rlrec.trainer.ope import Episode

    env = gym.make(task["env_id"])
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        obs, _ = env.reset(seed=seed * 1_000_003 + i)
        observations, actions, rewards, logps, probs = [obs], [], [], [], []
        done = term = False
        while not done:
            p = task["behaviour"](obs)
            a = int(rng.choice(len(p), p=p))
            obs, r, term, trunc, _ = env.step(a)
            observations.append(obs)
            actions.append(a)
            rewards.append(r)
            logps.append(np.log(p[a]))
            probs.append(p)
            done = term or trunc
        out.append(
            Episode(
                np.asarray(observations, np.float32),
                np.asarray(actions),
                np.asarray(rewards, np.float64),
                np.asarray(logps),
                bool(term),
                f"{seed}-{i}",
                0,
                np.asarray(probs),
            )
        )
    env.close()
    return out


def truth(task, spec, model, episodes: int) -> tuple[float, float]:
    from rlrec.trainer.promotion import evaluate_exported

    g = evaluate_exported(model, spec, task["env_id"], episodes, seed=777, gamma=task["gamma"])
    u = evaluate_exported(model, spec, task["env_id"], episodes, seed=777, gamma=1.0)
    return g, u


def rllib_formulas(data, version, rng) -> dict[str, float]:
    """RLlib 2.60 OfflinePolicyEvaluationRunner's "is" and "pdis" per episode, then the mean."""
    import torch

    inputs = version.forward(data.obs)
    sampled = version.dist.sample(inputs, torch.Generator().manual_seed(int(rng.integers(1 << 30))))
    logp_new = version.dist.logp(inputs, sampled).double().numpy()  # of a freshly sampled action
    w = np.exp(logp_new) / np.exp(data.behavior_logp)
    is_, pdis = [], []
    for s, n in zip(data.starts, data.lengths):
        r = data.rewards[s : s + n]
        is_.append(np.prod(w[s : s + n]) * r.sum())
        pdis.append(float(np.dot(w[s : s + n], r)))
    return {"rllib_is": float(np.mean(is_)), "rllib_pdis": float(np.mean(pdis))}


# ------------------------------------------------------------------------------------ run


def run_task(task, datasets: int, episodes: int, truth_episodes: int, fqe_steps: int | None, log) -> dict:
    from rlrec.trainer.ope import DEFAULT_ESTIMATORS, FQEConfig, LoggedData, PolicyTarget, evaluate

    names = list(task["targets"])
    t0 = time.time()
    truths = {k: truth(task, spec, model, truth_episodes) for k, (spec, model, _) in task["targets"].items()}
    log(f"{task['name']}: truth { ({k: round(v[0], 3) for k, v in truths.items()}) } ({time.time() - t0:.0f}s)")
    true = np.array([truths[k][0] for k in names])
    true_u = np.array([truths[k][1] for k in names])
    rows: dict[str, list] = {e: [] for e in (*DEFAULT_ESTIMATORS, "rllib_is", "rllib_pdis")}
    timing = {"is_per_100k_steps_s": [], "fqe_fit_s": []}
    steps = []
    for d in range(datasets):
        data = LoggedData(log_dataset(task, episodes, seed=100 + d))
        steps.append(data.steps)
        rng = np.random.default_rng(d)
        for k in names:
            version = task["targets"][k][2]
            target = PolicyTarget(version, explore=False).arrays(data)
            t1 = time.time()
            ev_is = evaluate(data, target, gamma=task["gamma"], estimators=("wis", "wpdis"), seed=d)
            timing["is_per_100k_steps_s"].append((time.time() - t1) * 1e5 / data.steps)
            t1 = time.time()
            ev_dr = evaluate(
                data,
                target,
                gamma=task["gamma"],
                estimators=("wdr", "fqe"),
                seed=d,
                fqe=FQEConfig(steps=fqe_steps, seed=d),
            )
            timing["fqe_fit_s"].append(time.time() - t1)
            for e, est in {**ev_is.estimates, **ev_dr.estimates}.items():
                rows[e].append((k, est.value, est.ci_low, est.ci_high, est.reason))
            for e, v in rllib_formulas(data, version, rng).items():
                rows[e].append((k, v, None, None, ""))
        log(f"  dataset {d + 1}/{datasets}: {data.n_episodes} episodes, {data.steps} steps ({time.time() - t0:.0f}s)")
    value_range = float(true.max() - true.min())
    out = {"name": task["name"], "gamma": task["gamma"], "targets": names, "true": true.tolist()}
    out["true_undiscounted"] = true_u.tolist()
    out["steps_per_dataset_median"] = float(np.median(steps))
    out["timing"] = {k: float(np.median(v)) for k, v in timing.items()}
    out["estimators"] = {}
    for e, rs in rows.items():
        ref = true_u if e.startswith("rllib") else true
        rng_e = float(ref.max() - ref.min()) if e.startswith("rllib") else value_range
        by_ds = [rs[i * len(names) : (i + 1) * len(names)] for i in range(datasets)]
        rel, absr, rho, cover, estimable = [], [], [], [], []
        for ds in by_ds:
            vals = np.array([np.nan if v is None else v for _, v, _, _, _ in ds], dtype=float)
            ok = np.isfinite(vals)
            estimable.append(ok.mean())
            rel += list(np.abs(vals[ok] - ref[ok]) / np.maximum(np.abs(ref[ok]), 1e-9))
            absr += list(np.abs(vals[ok] - ref[ok]) / rng_e)
            rho.append(_spearman(vals, ref) if ok.all() else -1.0)  # a "not estimable" is a miss
            for (_, _v, lo, hi, _), t in zip(ds, ref):
                if lo is not None and hi is not None:
                    cover.append(lo <= t <= hi)
        reasons = sorted({r for ds in by_ds for *_, r in ds if r})
        out["estimators"][e] = {
            "median_relative_error": float(np.median(rel)) if rel else None,
            "median_abs_error_share_of_range": float(np.median(absr)) if absr else None,
            "spearman_median": float(np.median(rho)),
            "estimable_share": float(np.mean(estimable)),
            "ci90_coverage": float(np.mean(cover)) if cover else None,
            "not_estimable_reasons": [r[:120] for r in reasons[:3]],
        }
    return out


def markdown(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines.append(f"### {r['name']} (gamma {r['gamma']}, {r['steps_per_dataset_median']:.0f} steps per dataset)")
        lines.append("")
        lines.append("true values: " + ", ".join(f"{k} {v:.3f}" for k, v in zip(r["targets"], r["true"])))
        lines.append("")
        lines.append(
            "| estimator | median rel. error | median abs. error / range | Spearman (median) | estimable | 90 % CI coverage |"
        )
        lines.append("|---|---|---|---|---|---|")

        def f(x, pct=False):
            return "–" if x is None else (f"{100 * x:.1f} %" if pct else f"{x:.2f}")

        for e, s in r["estimators"].items():
            lines.append(
                f"| {e} | {f(s['median_relative_error'], True)} | {f(s['median_abs_error_share_of_range'], True)} | "
                f"{f(s['spearman_median'])} | {f(s['estimable_share'], True)} | {f(s['ci90_coverage'], True)} |"
            )
        t = r["timing"]
        lines.append("")
        lines.append(
            f"Time (median): wis+wpdis {t['is_per_100k_steps_s']:.3f} s per 100k steps; FQE fit + wdr/fqe "
            f"{t['fqe_fit_s']:.1f} s per target and dataset."
        )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small datasets (a smoke run)")
    ap.add_argument("--datasets", type=int, default=None)
    ap.add_argument("--only", choices=["a", "b"], default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    import rlrec.trainer.synthetic  # noqa: F401  (registers the bandit env)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results = []
    if args.only in (None, "a"):
        results.append(
            run_task(
                bandit_task(),
                args.datasets or (2 if args.quick else 10),
                200 if args.quick else 500,
                500 if args.quick else 4000,
                300 if args.quick else None,
                log,
            )
        )
    if args.only in (None, "b"):
        results.append(
            run_task(
                cartpole_task(),
                args.datasets or (1 if args.quick else 4),
                20 if args.quick else 60,
                20 if args.quick else 100,
                300 if args.quick else None,
                log,
            )
        )
    text = markdown(results)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
