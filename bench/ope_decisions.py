"""Decision benchmark of the ``ope`` promotion gate (issue "An honest offline gate"): does the gate
publish worse policies, against simulator truth, on a long horizon and on a short one?

Two tasks (`TASKS`; ``--tasks``), each with a deployed version v1, a behaviour that is v1 served
epsilon-greedy (epsilon 0.3 and 0.05) with its exact propensities and action probabilities, and a
ladder of candidates: clearly better (> +10 % of v1's true value), about equal (v1 itself,
rescaled), worse, clearly worse, and ones that leave the behaviour's states (or, on the
contextual task, its actions). True values: Monte-Carlo discounted returns (`--truth-episodes`
episodes, fixed seeds).

* ``cartpole``: ``CartPole-v1`` at gamma 0.99 (horizon up to 500). v1 is a mediocre greedy linear
  controller (angular velocity minus position); the candidates are greedy linear controllers
  (`LADDER`) and `NEAR_V1` candidates, which equal v1 for the first ~100 steps and are worse by 5
  to 20 % after them.
* ``contextual``: ``rlrec/ContextBandit-v0`` (3 steps, gamma 0.9; action a earns x[a] + noise).
  v1 takes the better of actions 0 and 1 and never action 2; the candidates (`CONTEXT_LADDER`)
  range from the best action to the worst, and include ones that take action 2, which the
  behaviour takes only when it explores.

For every dataset (`--datasets` per epsilon, `--episodes` held-out episodes each) and candidate
the gate's question is asked as the trainer asks it: `rlrec.trainer.ope.compare` of candidate
and deployed v1 (paired bootstrap, 90 %, the trainer's thresholds) and the trainer's rule
`rlrec.trainer.ope_jobs.refusal` (margin 0). Rows per rule:

* ``always publish``: every candidate;
* ``<est> (old rule)``: estimable and lower bound >= 0, ignoring the gate verdict (the rule before
  the verdict existed);
* ``<est>``: the gate as it is (verdict included); ``mb`` is the pessimistic model-based estimator;
* ``auto``: the gate's default ``--promotion-estimator auto``: wdr where its verdict holds, else mb,
  decided by the gate's own functions (`rlrec.trainer.ope_jobs.choose_comparison` and
  ``refusal``) on the same comparisons.

The baseline is always the deployed v1 (never the logged behaviour of a first publication).

Reported per task, epsilon and rule: false promotions (a candidate truly worse than v1 by > 5 %
published; target 0), datasets where a clearly better candidate was published (target: every
dataset, else every clearly better one refused with a reason whose code hands it to a canary:
``refusal.judged`` False), and the median Spearman rank correlation of the candidates' point
estimates with the truth (an estimate without a value counts as a miss: -1 for that dataset).
d3rlpy's DiscreteFQE is not run here (see docs/measurements/ope-decisions-*.md).

FQE runs `--fqe-steps` (default 1000, below the trainer's 3000 at gamma 0.99, for time) and is
fitted once per target and dataset (the comparison reuses it: the same numbers as refitting).

Usage: ``python bench/ope_decisions.py [--quick] [--tasks cartpole,contextual] [--json out.json] [--md out.md]``.
A long run can be split and resumed: ``--dataset-ids`` runs chosen datasets (their seeds derive
from the index: dataset d at epsilon e has seed ``1000 d + 100 e``), ``--json-each DIR`` writes
each dataset's decisions as soon as it finishes, and ``--combine FILE...`` makes one table of
such files and whole runs (settings and truths must agree; each dataset once).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import gymnasium as gym
import numpy as np

GAMMA = 0.99
ENV = "CartPole-v1"
#: the deployed version (true discounted value ~64)
DEPLOYED = [-1.0, 0.0, 0.0, 1.0]
#: the candidates: name -> (weights w: action 1 iff w . obs > 0, bias, kind)
LADDER = {
    "expert": ([0, 0, 1, 0.5], None, "better"),
    "ang-velocity": ([0, 0, 0, 1], None, "better"),
    "v1-rescaled": ([-2, 0, 0, 2], None, "equal"),
    "ang-velocity+2position": ([2, 0, 0, 1], None, "worse"),
    "angle": ([0, 0, 1, 0], None, "worse, leaves the states"),
    "position": ([1, 0, 0, 0], None, "worse"),
    "always-left": ([0, 0, 0, 0], [1.0, 0.0], "worse, leaves the states"),
}
#: near-v1 candidates: v1 except that it pushes right whenever the cart's position is beyond x
#: (name -> x); they agree with v1 for the first ~100 steps of most episodes and are worse by
#: 5 to 20 % through what happens after them (the attacker review's case)
NEAR_V1 = {"near-v1 x>0.05": 0.05, "near-v1 x>0.08": 0.08, "near-v1 x>0.1": 0.1}
ESTIMATORS = ("wdr", "fqe", "wpdis", "wis", "mb")

#: the contextual task's gamma
CONTEXT_GAMMA = 0.9
_E = np.eye(3, 4)
#: the contextual task's deployed v1: the better of actions 0 and 1 (never action 2)
CONTEXT_DEPLOYED = 4 * np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]], np.float64)
_NO2 = np.array([0.0, 0.0, -100.0])  # a bias that rules action 2 out
#: the contextual candidates: name -> (weights (3, 4), bias, kind)
CONTEXT_LADDER = {
    "best": (4 * _E, None, "better, takes action 2 where it is best"),
    "v1-rescaled": (2 * CONTEXT_DEPLOYED, _NO2, "equal"),
    "best-or-2-above-0.9": (
        CONTEXT_DEPLOYED + np.array([[0] * 4, [0] * 4, [0, 0, 40, 0]]),
        [0, 0, -36],
        "equal or better",
    ),
    "always-0": (np.zeros((3, 4)), [1.0, 0.0, 0.0], "worse"),
    "always-2": (np.zeros((3, 4)), [0.0, 0.0, 1.0], "worse, leaves the behaviour's actions"),
    "avoids-best-of-2": (-CONTEXT_DEPLOYED, _NO2, "clearly worse"),
    "worst": (-4 * _E, None, "clearly worse, takes action 2 where it is worst"),
}


class NearV1:
    """v1 (`DEPLOYED`) except that it pushes right whenever the cart's position is beyond `x`
    (a greedy policy with ``action_probs``, not an exported artifact)."""

    discrete = True

    def __init__(self, x: float, w=DEPLOYED) -> None:
        self.spec = {"action_dist": {"type": "categorical"}}
        self.w, self.x = np.asarray(w, dtype=np.float64), x

    def action_probs(self, obs):
        obs = np.asarray(obs, dtype=np.float64)
        a = np.where(obs[:, 0] > self.x, 1, (obs @ self.w > 0).astype(int))
        p = np.zeros((len(obs), 2))
        p[np.arange(len(obs)), a] = 1.0
        return p


def mc_truth(policy, episodes: int, seed: int = 777) -> float:
    """The greedy `policy`'s mean discounted return over `episodes` CartPole episodes."""
    env = gym.make(ENV)
    out = []
    for i in range(episodes):
        o, _ = env.reset(seed=seed + i)
        g, t, done = 0.0, 0, False
        while not done:
            a = int(policy.action_probs(o[None])[0].argmax())
            o, r, te, tr, _ = env.step(a)
            g += GAMMA**t * r
            t, done = t + 1, te or tr
        out.append(g)
    env.close()
    return float(np.mean(out))


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def controller(w, bias=None):
    """``(spec, model, policy)`` of the greedy linear controller: action 1 iff ``w . obs > 0``."""
    from rlrec.trainer.policy import version_from_artifact
    from rlrec.trainer.synthetic import linear_policy_artifact

    w = np.asarray(w, np.float32)
    W = np.stack([-w, w]) * 50.0
    b = None if bias is None else np.asarray(bias, np.float32)
    spec, model = linear_policy_artifact(W, b)
    return spec, model, version_from_artifact(spec, model)


def log_dataset(n: int, eps: float, seed: int, env_id: str = ENV, greedy=None):
    """`n` episodes of v1 (`greedy`: obs -> its action; default CartPole's `DEPLOYED`) served
    epsilon-greedy on `env_id`, with exact propensities."""
    from rlrec.trainer.ope import Episode

    if greedy is None:
        w = np.asarray(DEPLOYED)

        def greedy(obs):
            return int(w @ obs > 0)

    env = gym.make(env_id)
    n_actions = int(env.action_space.n)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        obs, _ = env.reset(seed=seed * 1_000_003 + i)
        observations, actions, rewards, logps, probs = [obs], [], [], [], []
        done = term = False
        while not done:
            p = np.full(n_actions, eps / n_actions)
            p[greedy(obs)] += 1 - eps
            a = int(rng.choice(n_actions, p=p))
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
                f"{seed}-{i:05d}",
                1,
                np.asarray(probs),
            )
        )
    env.close()
    return out


def truth(spec, model, episodes: int, env_id: str = ENV, gamma: float = GAMMA) -> float:
    from rlrec.trainer.promotion import evaluate_exported

    return evaluate_exported(model, spec, env_id, episodes, seed=777, gamma=gamma)


def linear(W, bias=None):
    """``(spec, model, policy)`` of the greedy linear policy with logits ``W @ obs + bias``."""
    from rlrec.trainer.policy import version_from_artifact
    from rlrec.trainer.synthetic import linear_policy_artifact

    spec, model = linear_policy_artifact(
        np.asarray(W, np.float32), None if bias is None else np.asarray(bias, np.float32)
    )
    return spec, model, version_from_artifact(spec, model)


def cartpole_task(truth_episodes: int) -> dict:
    """The CartPole task: deployed v1, the candidates and their true values."""
    dep_spec, dep_model, deployed = controller(DEPLOYED)
    targets, true = {}, {}
    for k, (w, b, _) in LADDER.items():
        spec, model, policy = controller(w, b)
        targets[k] = policy
        true[k] = truth(spec, model, truth_episodes)
    for k, x in NEAR_V1.items():
        targets[k] = NearV1(x)
        true[k] = mc_truth(targets[k], truth_episodes)
    return {
        "env": ENV,
        "gamma": GAMMA,
        "deployed": deployed,
        "true_v1": truth(dep_spec, dep_model, truth_episodes),
        "targets": targets,
        "true": true,
        "near": set(NEAR_V1),
        "greedy": None,
    }


def contextual_task(truth_episodes: int) -> dict:
    """The contextual task (3 steps): deployed v1, the candidates and their true values."""
    from rlrec.trainer.synthetic import CONTEXT_BANDIT_ID

    dep_spec, dep_model, deployed = linear(CONTEXT_DEPLOYED, _NO2)
    targets, true = {}, {}
    for k, (W, b, _) in CONTEXT_LADDER.items():
        spec, model, policy = linear(W, b)
        targets[k] = policy
        true[k] = truth(spec, model, truth_episodes * 10, CONTEXT_BANDIT_ID, CONTEXT_GAMMA)
    W = np.asarray(CONTEXT_DEPLOYED, np.float32)

    def greedy(obs):
        return int(np.argmax(W @ obs + _NO2))

    return {
        "env": CONTEXT_BANDIT_ID,
        "gamma": CONTEXT_GAMMA,
        "deployed": deployed,
        "true_v1": truth(dep_spec, dep_model, truth_episodes * 10, CONTEXT_BANDIT_ID, CONTEXT_GAMMA),
        "targets": targets,
        "true": true,
        "near": set(),
        "greedy": greedy,
    }


#: the tasks, by name (``--tasks``)
TASKS = {"cartpole": cartpole_task, "contextual": contextual_task}


def decide_dataset(
    data, targets: dict, deployed, fqe_steps: int, model_cfg, n_boot: int, seed: int, log, gamma: float = GAMMA
) -> dict:
    """Every rule's decision and point estimate for every candidate on one dataset."""
    from rlrec.trainer.ope import FQEConfig, PolicyTarget, compare, fit_fqe
    from rlrec.trainer.ope_jobs import REFUSALS, choose_comparison, refusal

    fqe = FQEConfig(steps=fqe_steps, seed=seed)

    def arrays(policy):
        t = PolicyTarget(policy, explore=False, seed=seed).arrays(data)
        t.q, t.v = fit_fqe(data, t, gamma, fqe)
        return t

    t0 = time.time()
    dep_arrays = arrays(deployed)
    out: dict = {}
    for name, policy in targets.items():
        cand_arrays = arrays(policy)
        row: dict = {}
        cmps: dict = {}
        for est in ESTIMATORS:
            if est == "mb":
                cmp = compare(
                    data,
                    PolicyTarget(policy, False, seed=seed),
                    PolicyTarget(deployed, False, seed=seed),
                    gamma=gamma,
                    estimator="mb",
                    n_boot=n_boot,
                    seed=seed,
                    model=model_cfg,
                )
            else:
                cmp = compare(data, cand_arrays, dep_arrays, gamma=gamma, estimator=est, n_boot=n_boot, seed=seed)
            cmps[est] = cmp
            code, reason = refusal(cmp, 0.0)
            promoted = code is None
            value = cmp.candidate.estimates[est].value
            row[est] = {
                "promoted": promoted,
                "gate_ok": bool(cmp.gate["ok"]),
                "old_rule": bool(cmp.estimable and cmp.ci_low >= 0.0),
                "value": value,
                "difference": cmp.difference,
                "ci_low": cmp.ci_low,
                "ci_high": cmp.ci_high,
                "reason": reason,
                "refusal": None if promoted else {"code": code, "judged": REFUSALS[code]},
                "diagnostics": cmp.candidate.diagnostics.get("mb") if est == "mb" else None,
                "paired": cmp.extra.get("paired"),
            }
        # the gate's default (--promotion-estimator auto), through the gate's own functions
        cmp, fallback = choose_comparison("auto", cmps.__getitem__)
        code, reason = refusal(cmp, 0.0)
        promoted = code is None
        row["auto"] = {
            "promoted": promoted,
            "estimator": cmp.estimator,
            "fallback_from": fallback,
            "value": cmp.candidate.estimates[cmp.estimator].value,
            "difference": cmp.difference,
            "ci_low": cmp.ci_low,
            "ci_high": cmp.ci_high,
            "reason": reason,
            "refusal": None if promoted else {"code": code, "judged": REFUSALS[code]},
        }
        out[name] = row
        log(
            f"    {name}: "
            + ", ".join(
                f"{e} {'PUB' if r['promoted'] else '-'}"
                f"({'-' if r['difference'] is None else round(r['difference'], 1)}"
                f"{'' if r['ci_low'] is None else ' lo ' + str(round(r['ci_low'], 1))})"
                for e, r in row.items()
            )
            + f" [{time.time() - t0:.0f}s]"
        )
    return out


def summarize(results: list[dict], true: dict, true_v1: float, near_names: set | None = None) -> dict:
    """Per rule: false promotions, datasets with a clearly better candidate published (else, for
    the gated rules, whether every clearly better one was refused to the canary: a refusal code
    with ``judged`` False), Spearman vs truth."""
    names = list(true)
    worse = {k for k in names if true[k] < 0.95 * true_v1}
    better = {k for k in names if true[k] > 1.10 * true_v1}
    near = worse & set(NEAR_V1 if near_names is None else near_names)
    rules = ["always publish"] + [f"{e} (old rule)" for e in ("wdr", "fqe")] + list(ESTIMATORS) + ["auto"]
    table = {}
    for rule in rules:
        fp, fp_near, better_pub, to_canary, refusals, rho, decisions = 0, 0, 0, 0, [], [], 0
        for ds in results:
            pub = set()
            for k in names:
                if rule == "always publish":
                    ok = True
                elif rule.endswith("(old rule)"):
                    ok = ds["decisions"][k][rule.split()[0]]["old_rule"]
                else:
                    ok = ds["decisions"][k][rule]["promoted"]
                decisions += 1
                if ok:
                    pub.add(k)
            fp += len(pub & worse)
            fp_near += len(pub & worse & near)
            if pub & better:
                better_pub += 1
            elif rule in (*ESTIMATORS, "auto"):
                refused = [ds["decisions"][k][rule] for k in better]
                if refused and all(r.get("refusal") and not r["refusal"]["judged"] for r in refused):
                    to_canary += 1
                refusals.append(sorted({r["reason"][:100] for r in refused}))
            if rule == "always publish":
                continue
            est = rule.split()[0]
            vals = np.array(
                [
                    np.nan if ds["decisions"][k][est]["value"] is None else ds["decisions"][k][est]["value"]
                    for k in names
                ]
            )
            t = np.array([true[k] for k in names])
            rho.append(_spearman(vals, t) if np.isfinite(vals).all() else -1.0)
        table[rule] = {
            "false_promotions": fp,
            "decisions": decisions,
            "worse_candidates_offered": len(worse) * len(results),
            "false_promotions_near_v1": fp_near,
            "near_v1_worse_offered": len(near) * len(results),
            "datasets_with_a_clearly_better_published": better_pub,
            "datasets_refused_to_the_canary": to_canary,
            "datasets": len(results),
            "spearman_median": None if not rho else float(np.median(rho)),
            "refusal_reasons": refusals[:2],
        }
    return table


def markdown(doc: dict) -> str:
    lines: list[str] = []
    for name, task in doc["tasks"].items():
        lines += [
            f"### {name}: {task['env']}, gamma {task['gamma']}; deployed v1 true {task['true_v1']:.2f}; "
            "candidates (true): " + ", ".join(f"{k} {v:.2f}" for k, v in task["true"].items()),
            "",
        ]
        for eps, table in task["by_epsilon"].items():
            lines += [
                f"#### {name}, logging epsilon {eps} ({next(iter(table.values()))['datasets']} datasets x "
                f"{task['episodes']} held-out episodes)",
                "",
                "| rule | false promotions (worse by > 5 % published) | of them near-v1 (-5..-20 %) | "
                "datasets with a clearly better one published | else refused to the canary | "
                "Spearman vs truth (median) |",
                "|---|---|---|---|---|---|",
            ]
            for rule, s in table.items():
                rho = "–" if s["spearman_median"] is None else f"{s['spearman_median']:.2f}"
                lines.append(
                    f"| {rule} | {s['false_promotions']} of {s['worse_candidates_offered']} | "
                    f"{s['false_promotions_near_v1']} of {s['near_v1_worse_offered']} | "
                    f"{s['datasets_with_a_clearly_better_published']} of {s['datasets']} | "
                    f"{s['datasets_refused_to_the_canary']} | {rho} |"
                )
            lines.append("")
    return "\n".join(lines)


def combine(paths: list[str]) -> dict:
    """One benchmark document from several runs' JSON: whole runs (``--json``) and single
    datasets (``--json-each``), grouped by task and epsilon, one result per dataset index (the
    seeds derive from it). The runs must agree on their settings and truths (else ValueError).

    Args:
        paths: the JSON files.
    """
    tasks: dict = {}
    settings: dict[str, dict] = {}
    for path in paths:
        with open(path) as fh:
            doc = json.load(fh)
        if "result" in doc:  # one dataset
            runs = [(doc["task"], doc, {str(doc["epsilon"]): [doc["result"]]}, {str(doc["epsilon"]): [doc["dataset"]]})]
        else:
            ids = doc.get("dataset_ids") or {}
            runs = [(name, t, t["raw"], ids) for name, t in doc["tasks"].items()]
        for name, t, raw, ids in runs:
            if settings.setdefault(name, doc["settings"]) != doc["settings"]:
                raise ValueError(f"{path}: {name} ran with other settings ({doc['settings']})")
            task = tasks.setdefault(
                name,
                {k: t[k] for k in ("env", "gamma", "true", "true_v1", "episodes")} | {"by_dataset": {}},
            )
            if task["true"] != t["true"] or task["episodes"] != t["episodes"]:
                raise ValueError(f"{path}: {name}'s truths or episodes differ from the other runs'")
            for eps, results in raw.items():
                for i, r in enumerate(results):
                    d = r.get("dataset", (ids.get(eps) or list(range(len(results))))[i])
                    by = task["by_dataset"].setdefault(eps, {})
                    if d in by:
                        raise ValueError(f"{path}: {name} epsilon {eps} dataset {d + 1} is also in {by[d]['source']}")
                    by[d] = dict(r, dataset=d, source=os.path.basename(path))
    out: dict = {"tasks": {}, "settings": settings}
    out["datasets"] = max((len(v) for t in tasks.values() for v in t["by_dataset"].values()), default=0)
    for name, task in tasks.items():
        near = set(NEAR_V1) if name == "cartpole" else set()
        o = {k: task[k] for k in ("env", "gamma", "true", "true_v1", "episodes")}
        by_eps = sorted(task["by_dataset"].items(), key=lambda kv: -float(kv[0]))
        o["raw"] = {eps: [by[d] for d in sorted(by)] for eps, by in by_eps}
        o["by_epsilon"] = {eps: summarize(rs, task["true"], task["true_v1"], near) for eps, rs in o["raw"].items()}
        out["tasks"][name] = o
    return out


def per_dataset(doc: dict, rule: str = "auto") -> str:
    """Per dataset, under `rule`: false promotions, and each clearly better candidate published
    (difference, lower bound) or refused (the refusal code)."""
    lines = [
        f"| task | epsilon | dataset (seed) | steps | false promotions ({rule}) | clearly better: {rule}'s decision |",
        "|---|---|---|---|---|---|",
    ]
    for name, task in doc["tasks"].items():
        true, v1 = task["true"], task["true_v1"]
        worse = {k for k in true if true[k] < 0.95 * v1}
        better = [k for k in true if true[k] > 1.10 * v1]
        for eps, results in task["raw"].items():
            for r in results:
                dec = r["decisions"]
                fp = sorted(k for k in worse if dec[k][rule]["promoted"])
                outcome = []
                for k in better:
                    x = dec[k][rule]
                    if x["promoted"]:
                        outcome.append(f"{k}: published, {x['difference']:+.2f} (lower bound {x['ci_low']:.2f})")
                    else:
                        code = (x.get("refusal") or {}).get("code", "?")
                        outcome.append(f"{k}: refused `{code}`")
                seed = 1000 * r["dataset"] + int(float(eps) * 100)
                lines.append(
                    f"| {name} | {eps} | {r['dataset'] + 1} ({seed}) | {r['steps']:,} | "
                    f"{len(fp)}{' (' + ', '.join(fp) + ')' if fp else ''} | {'; '.join(outcome)} |"
                )
    return "\n".join(lines)


def dataset_ids(spec: str | None, epsilons: list[float], datasets: int) -> dict[float, list[int]]:
    """Dataset indexes per epsilon from ``--dataset-ids`` (``"2,3"`` or ``"0.3=2,3;0.05=1,2,3"``).

    >>> dataset_ids("0.3=2,3;0.05=1", [0.3, 0.05], 4)
    {0.3: [2, 3], 0.05: [1]}
    >>> dataset_ids(None, [0.3], 2)
    {0.3: [0, 1]}
    """
    if not spec:
        return {eps: list(range(datasets)) for eps in epsilons}

    def parse(text: str) -> list[int]:
        out = [int(x) for x in text.split(",") if x.strip()]
        if not out or min(out) < 0 or len(set(out)) != len(out):
            raise ValueError(f"expected distinct indexes >= 0, got {text!r}")
        return out

    if "=" not in spec:
        return {eps: parse(spec) for eps in epsilons}
    ids: dict[float, list[int]] = {}
    for part in spec.split(";"):
        eps_text, _, rest = part.partition("=")
        ids[float(eps_text)] = parse(rest)
    if set(ids) != set(epsilons):
        raise ValueError(f"name every epsilon of --epsilons ({', '.join(map(str, epsilons))}) once")
    return {eps: ids[eps] for eps in epsilons}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small datasets and fits (a smoke run)")
    ap.add_argument("--tasks", default="cartpole,contextual", help="comma-separated: " + ", ".join(TASKS))
    ap.add_argument("--datasets", type=int, default=None, help="datasets per epsilon (default 4)")
    ap.add_argument("--episodes", type=int, default=None, help="held-out episodes per CartPole dataset (default 200)")
    ap.add_argument(
        "--context-episodes", type=int, default=None, help="held-out episodes per contextual dataset (default 400)"
    )
    ap.add_argument("--epsilons", default="0.3,0.05")
    ap.add_argument("--truth-episodes", type=int, default=None)
    ap.add_argument("--fqe-steps", type=int, default=None, help="default 1000 (quick: 200)")
    ap.add_argument("--mb-members", type=int, default=5)
    ap.add_argument("--mb-steps", type=int, default=None, help="default 1500 (quick: 300)")
    ap.add_argument("--n-boot", type=int, default=None, help="default 500 (quick: 100)")
    ap.add_argument(
        "--dataset-ids",
        default=None,
        help="which datasets to run, by index (their seeds derive from it): '2,3' for every epsilon, or "
        "'0.3=2,3;0.05=1,2,3' per epsilon (default 0..--datasets-1); to add datasets to an earlier run",
    )
    ap.add_argument(
        "--json-each",
        default=None,
        metavar="DIR",
        help="write each dataset's decisions to DIR/{task}-eps{epsilon}-d{index}.json as soon as it finishes",
    )
    ap.add_argument(
        "--combine",
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: combine earlier runs' --json / --json-each files into one table (per dataset index)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    if args.combine:
        try:
            doc = combine(args.combine)
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--combine: {e}")
        text = markdown(doc) + "\n\n" + per_dataset(doc)
        print(text)
        if args.json:  # the summaries and the per-dataset table; the decisions stay in the inputs
            for task in doc["tasks"].values():
                task["raw"] = {eps: [r["source"] for r in rs] for eps, rs in task["raw"].items()}
            doc["per_dataset"] = text.rsplit("\n\n", 1)[1]
        return _write(doc, text, args)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks or any(t not in TASKS for t in tasks):
        ap.error(f"--tasks: choose from {', '.join(TASKS)}")
    import torch

    from rlrec.trainer.ope import LoggedData
    from rlrec.trainer.ope_model import ModelConfig

    torch.set_num_threads(1)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    quick = args.quick
    datasets = args.datasets or (1 if quick else 4)
    epsilons = [float(x) for x in args.epsilons.split(",")]
    try:
        ids = dataset_ids(args.dataset_ids, epsilons, datasets)
    except ValueError as e:
        ap.error(f"--dataset-ids: {e}")
    truth_eps = args.truth_episodes or (30 if quick else 300)
    fqe_steps = args.fqe_steps or (200 if quick else 1000)
    mb_steps = args.mb_steps or (300 if quick else 1500)
    n_boot = args.n_boot or (100 if quick else 500)
    episodes = {
        "cartpole": args.episodes or (40 if quick else 200),
        "contextual": args.context_episodes or (200 if quick else 400),
    }
    t0 = time.time()
    doc: dict = {
        "datasets": max(len(v) for v in ids.values()),
        "dataset_ids": {str(k): v for k, v in ids.items()},
        "tasks": {},
    }
    doc["settings"] = {
        "fqe_steps": fqe_steps,
        "mb_members": args.mb_members,
        "mb_steps": mb_steps,
        "n_boot": n_boot,
        "truth_episodes": truth_eps,
        "quick": quick,
    }
    for name in tasks:
        task = TASKS[name](truth_eps)
        true, true_v1 = task["true"], task["true_v1"]
        log(
            f"{name} truth: v1 {true_v1:.2f}, { ({k: round(v, 2) for k, v in true.items()}) } ({time.time() - t0:.0f}s)"
        )
        out: dict = {
            "env": task["env"],
            "gamma": task["gamma"],
            "true": true,
            "true_v1": true_v1,
            "episodes": episodes[name],
            "by_epsilon": {},
            "raw": {},
        }
        for eps in epsilons:
            results = []
            for d in ids[eps]:
                seed = 1000 * d + int(eps * 100)
                data = LoggedData(log_dataset(episodes[name], eps, seed, task["env"], task["greedy"]))
                log(
                    f"  {name} epsilon {eps} dataset {d + 1} (seed {seed}): {data.n_episodes} episodes, "
                    f"{data.steps} steps"
                )
                t1 = time.time()
                decisions = decide_dataset(
                    data,
                    task["targets"],
                    task["deployed"],
                    fqe_steps,
                    ModelConfig(members=args.mb_members, steps=mb_steps, seed=d),
                    n_boot,
                    d,
                    log,
                    task["gamma"],
                )
                result = {"decisions": decisions, "steps": data.steps, "seconds": time.time() - t1, "dataset": d}
                results.append(result)
                if args.json_each:
                    os.makedirs(args.json_each, exist_ok=True)
                    one = {"task": name, "epsilon": eps, "dataset": d, "seed": seed, "settings": doc["settings"]}
                    one.update({k: out[k] for k in ("env", "gamma", "true", "true_v1", "episodes")})
                    one["result"] = result
                    with open(os.path.join(args.json_each, f"{name}-eps{eps}-d{d}.json"), "w") as fh:
                        json.dump(one, fh, indent=1, default=float)
            out["by_epsilon"][str(eps)] = summarize(results, true, true_v1, task["near"])
            out["raw"][str(eps)] = results
        doc["tasks"][name] = out
    doc["seconds"] = time.time() - t0
    text = markdown(doc)
    print(text)
    return _write(doc, text, args)


def _write(doc: dict, text: str, args: argparse.Namespace) -> int:
    """Write the run's JSON (`--json`) and its markdown table (`--md`); the exit code."""
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1, default=float)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
