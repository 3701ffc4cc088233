"""Off-policy evaluation of a trainer's candidate, off the training thread.

At a checkpoint the trainer exports the candidate (`CandidateJob`: the artifact and what its
publication would record) and hands it to `start`, which runs `evaluate_candidate` in a daemon
thread; training goes on. The trainer collects the finished result at a later iteration
(``job.future.done()``) and applies it: publishes the candidate if the ``ope`` gate promoted it,
or only logs it (``--ope-report``). One job at a time.

What runs in the thread: reading the new held-out shards (`rlrec.trainer.ope_data.HeldOutReader`),
loading the deployed version, the estimators (FQE's fit sets torch's intra-op threads to
`FQEConfig.threads` process-wide while it runs; it leaves torch's global random generator
alone) and, with ``--env``, the candidate's true discounted return in the simulator.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "REFUSALS",
    "CandidateJob",
    "choose_comparison",
    "evaluate_candidate",
    "gate_decision",
    "refusal",
    "refusal_record",
    "start",
]

log = logging.getLogger("rlrec.trainer")


@dataclass
class CandidateJob:
    """A candidate to evaluate off-policy, and what its publication records.

    Args:
        version: the version it is published as if promoted.
        artifact: its exported `rlrec.trainer.export.PolicyArtifact`.
        spec: its policy.json fields the loader needs (``format``, ``action_dist``, spaces, ...).
        gamma: the discount of the estimates.
        gating: True: the ``ope`` promotion gate decides on it; False: an estimate for the
            record only (``--ope-report``).
        deployed_version: the published version it is compared with (None: the logged behaviour).
        iteration: the training iteration it was exported at.
        timesteps_trained: timesteps trained at that iteration.
        shards: every shard trained on by then (None: named by ``data["trained"]``).
        new_shards: shards trained on since the deployed version was published.
        data: where those shards are (`rlrec.trainer.lineage`: input, cursor, trained ranges, holdout fraction).
    """

    version: int
    artifact: Any
    spec: dict
    gamma: float
    gating: bool
    deployed_version: int | None
    iteration: int
    timesteps_trained: int = 0
    shards: list[str] | None = None
    new_shards: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    future: Future | None = None
    started: float = field(default_factory=time.time)


def start(job: CandidateJob, work: Callable[[CandidateJob], dict]) -> CandidateJob:
    """Run ``work(job)`` in a daemon thread; its result (or exception) lands in ``job.future``.

    A daemon thread, not an executor: a stopping trainer that gives up waiting for it can exit
    while it runs.

    Args:
        job: the candidate.
        work: the evaluation, e.g. a `functools.partial` of `evaluate_candidate`.

    Example:
        >>> job = start(CandidateJob(1, None, {}, 0.9, False, None, 3), lambda j: {"v": j.version})
        >>> job.future.result(timeout=5)
        {'v': 1}
    """
    fut: Future = Future()
    fut.set_running_or_notify_cancel()

    def run() -> None:
        try:
            fut.set_result(work(job))
        except BaseException as e:  # delivered to whoever collects the result
            fut.set_exception(e)

    job.future = fut
    threading.Thread(target=run, name=f"rlrec-ope-v{job.version}", daemon=True).start()
    return job


def evaluate_candidate(
    job: CandidateJob,
    *,
    cfg: Any,
    held_out: Any,
    deployed: Callable[[int], Any],
) -> dict:
    """Evaluate `job`'s candidate on the held-out episodes: the ``ope`` gate's decision
    (``job.gating``: the paired difference candidate - deployed, promoted if its lower bound is
    at least ``-cfg.promotion_margin``) or the candidate's estimate alone (``--ope-report``).

    Args:
        job: the candidate.
        cfg: the `rlrec.trainer.config.TrainerConfig`.
        held_out: a `rlrec.trainer.ope_data.HeldOutReader` (refreshed here).
        deployed: ``deployed(version)`` -> the loaded published version.

    Returns:
        The decision or report (JSON-able), never raising: a failure is ``"reason"``, not
        promoted.

    Example:
        >>> d = evaluate_candidate(job, cfg=cfg, held_out=reader, deployed=load)  # doctest: +SKIP
        >>> d["promoted"], d["difference"], d["ci_low"]  # doctest: +SKIP
    """
    from rlrec.trainer.policy import version_from_artifact

    t0 = time.time()
    d: dict[str, Any] = {"gate": "ope"} if job.gating else {}
    d.update(
        {
            "candidate_version": job.version,
            "candidate_iteration": job.iteration,
            "deployed_version": job.deployed_version,
            "estimator": cfg.promotion_estimator if job.gating else _report_estimator(cfg),
            "gamma": job.gamma,
            "explore": cfg.promotion_explore,
            "seed": cfg.seed or 0,  # with data.cursor: `rlrec evaluate --as-of` reproduces the numbers
            "candidate_return": None,
        }
    )
    if job.gating:
        d.update({"margin": cfg.promotion_margin, "deployed_return": None, "promoted": False})
    try:
        model = job.artifact.files[job.artifact.spec["model"]]
        candidate = version_from_artifact(job.spec, model)
        episodes = held_out.refresh()
        # the evaluation's own data: the held-out episodes of the shards at this cursor (not the
        # candidate's lineage, which names the shards it was trained on)
        d["data"] = {
            "holdout_fraction": cfg.ope.holdout_fraction,
            "cursor": held_out.cursor,
            "policy_id": cfg.policy_id,
            **held_out.stats.to_dict(),
        }
        if not episodes:
            d["reason"] = "no held-out episodes yet"
            if job.gating:
                d["refusal"] = refusal_record("no_data")
        elif job.gating:
            _decide(d, job, cfg, candidate, episodes, deployed)
        else:
            _report(d, job, cfg, candidate, episodes)
        if cfg.env:  # the simulator's truth beside the estimate (never used for a decision)
            from rlrec.trainer.promotion import evaluate_exported

            d["true_return"] = evaluate_exported(
                model,
                job.spec,
                cfg.env,
                cfg.promotion_episodes,
                seed=cfg.seed or 0,
                gamma=job.gamma,
                explore=cfg.promotion_explore,
            )
    except Exception as e:
        d["reason"] = f"evaluation failed: {type(e).__name__}: {e}"
        if job.gating:
            d["promoted"] = False
            d["refusal"] = refusal_record("failed")
        log.error("evaluating candidate v%d off-policy failed (%s)", job.version, e)
    finally:
        d["seconds"] = round(time.time() - t0, 3)
    return d


def _settings(cfg: Any) -> dict:
    from rlrec.trainer.ope import FQEConfig

    return {
        "ci": cfg.ope.ope_ci,
        "n_boot": cfg.ope.ope_bootstrap,
        "seed": cfg.seed or 0,
        "thresholds": cfg.ope.thresholds(),
        "fqe": FQEConfig(steps=cfg.ope.fqe_steps, seed=cfg.seed or 0),
        "model": cfg.ope.model(cfg.seed or 0),
    }


def _decide(d: dict, job: CandidateJob, cfg: Any, candidate: Any, episodes: list, deployed: Callable) -> None:
    from rlrec.trainer.ope import LoggedData, PolicyTarget, compare

    data = LoggedData(episodes)
    dep = deployed(job.deployed_version) if job.deployed_version else None
    seed = cfg.seed or 0
    cmp, fallback = choose_comparison(
        cfg.promotion_estimator,
        lambda name: compare(
            data,
            PolicyTarget(candidate, cfg.promotion_explore, seed=seed),
            None if dep is None else PolicyTarget(dep, cfg.promotion_explore, seed=seed),
            gamma=job.gamma,
            estimator=name,
            **_settings(cfg),
        ),
    )
    if fallback is not None:
        d["fallback_from"] = fallback
    if cfg.promotion_estimator == "auto":
        d["estimator"], d["estimator_setting"] = cmp.estimator, "auto"
    c_est = cmp.candidate.estimates[cmp.estimator]
    d_est = cmp.deployed.estimates[cmp.estimator]
    d.update(
        {
            "candidate_return": c_est.value,
            "deployed_return": d_est.value,
            "deployed_is_behavior": dep is None,
            "difference": cmp.difference,
            "ci_low": cmp.ci_low,
            "ci_high": cmp.ci_high,
            "ci_level": cmp.ci,
            "estimable": cmp.estimable,
            "reason": cmp.reason,
            "gate_verdict": cmp.gate,
            # the importance-weighted difference's data-only bound (comparison.paired in evaluate)
            "paired": cmp.extra.get("paired"),
            "candidate_estimate": c_est.to_dict(),
            "deployed_estimate": d_est.to_dict(),
            "diagnostics": {"candidate": cmp.candidate.diagnostics, "deployed": cmp.deployed.diagnostics},
        }
    )
    d["data"].update(_data_summary(data, cmp.candidate))
    code, reason = refusal(cmp, cfg.promotion_margin)
    d["promoted"], d["reason"] = code is None, reason or d["reason"]
    if code is not None:
        d["refusal"] = refusal_record(code)


def choose_comparison(setting: str, compare_with: Callable[[str], Any]) -> tuple[Any, dict | None]:
    """The comparison the ope gate decides with under ``--promotion-estimator setting``:
    ``auto`` asks wdr first and keeps it where its gate verdict (the levels' and the paired
    difference's) holds, else asks the pessimistic model (mb); any other setting is that
    estimator alone.

    Args:
        setting: ``auto`` or an estimator's name.
        compare_with: ``compare_with(name)`` -> that estimator's `rlrec.trainer.ope.Comparison`.

    Returns:
        ``(comparison, fallback_from)``: what auto fell back from (estimator, difference, lower
        bound, reason), or None.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cmps = {"wdr": NS(gate={"ok": False, "reason": "r"}, difference=1.0, ci_low=0.5),
        ...         "mb": NS(gate={"ok": True, "reason": ""}, difference=-1.0, ci_low=-2.0)}
        >>> cmp, fb = choose_comparison("auto", cmps.__getitem__)
        >>> cmp is cmps["mb"], fb["estimator"], fb["reason"]
        (True, 'wdr', 'r')
    """
    names = ("wdr", "mb") if setting == "auto" else (setting,)
    fallback = None
    for name in names:
        cmp = compare_with(name)
        if cmp.gate["ok"] or name == names[-1]:
            break
        fallback = {"estimator": name, "difference": cmp.difference, "ci_low": cmp.ci_low, "reason": cmp.gate["reason"]}
    return cmp, fallback


#: why the ope gate refused a candidate, machine-readable (``decision["refusal"]["code"]``), and
#: whether the offline data *judged* it (True: the data show it may be worse) or could not judge
#: it (False: `rlrec train --rollout canary --canary-unjudged` may prove it on a canary)
REFUSALS = {
    "no_data": False,  # no held-out episodes yet
    "failed": False,  # the evaluation raised (the reason names the error)
    "not_estimable": False,  # no value: propensities missing, too few episodes, the model refused
    "unjudgeable": False,  # the gate verdict: the difference rests on the model alone / leaves the data
    "data_bound": False,  # the data-only lower bound (head - worst case after t*) below -margin
    "unproven": False,  # the interval straddles -margin: the data do not show it is better
    "worse": True,  # the whole interval of an estimated difference lies below -margin (not mb's bound)
}


def refusal(cmp: Any, margin: float) -> tuple[str | None, str]:
    """The ope gate's rule on a `rlrec.trainer.ope.Comparison`, with its refusal code: publish
    only when the difference is estimable, its gate verdict is ok (both levels' and, for the
    importance-weighted estimators, the paired difference's: ``cmp.extra["paired"]``), its lower
    bound is at least ``-margin`` and so is the data-only lower bound of the difference
    (``paired["lower_bound"]``: the weighted rewards up to the step the weights collapse at, minus
    the worst case the reward range allows after it).

    Returns:
        ``(code, reason)``: code None and reason "" when promoted, else a key of `REFUSALS` and
        the reason (the comparison's own reason when it is not estimable).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> ok = {"ok": True, "reason": ""}
        >>> refusal(NS(estimable=True, gate=ok, ci_low=-0.5, ci_high=2.0, reason=""), 0.0)[0]
        'unproven'
        >>> refusal(NS(estimable=True, gate={"ok": False, "reason": "state coverage"}, reason=""), 0.0)
        ('unjudgeable', 'not usable for gating: state coverage')
    """
    if not cmp.estimable:
        return "not_estimable", cmp.reason
    if not cmp.gate["ok"]:
        return "unjudgeable", f"not usable for gating: {cmp.gate['reason']}"
    if cmp.ci_low < -margin:
        # mb's difference is a bound (the candidate pessimistic, the baseline optimistic), not an
        # estimate: below -margin it does not show the candidate is worse
        below = cmp.ci_high is not None and cmp.ci_high < -margin
        code = "worse" if below and getattr(cmp, "estimator", None) != "mb" else "unproven"
        return code, f"lower bound {cmp.ci_low:.4g} of the difference < -margin {-margin:g}"
    paired = (getattr(cmp, "extra", None) or {}).get("paired")
    if paired is not None and paired["lower_bound"] < -margin:
        return "data_bound", (
            f"the data-only lower bound of the difference {paired['lower_bound']:.4g} (the weighted rewards' "
            f"{paired['head_low']:.4g} before step {paired['t_star']}, minus the worst case {paired['remainder']:.4g} "
            f"after it) < -margin {-margin:g}"
        )
    return None, ""


def gate_decision(cmp: Any, margin: float) -> tuple[bool, str]:
    """`refusal` as ``(promoted, reason)``: the reason of a refusal ("" when promoted).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> gate_decision(NS(estimable=True, gate={"ok": True, "reason": ""}, ci_low=0.2, reason=""), 0.0)
        (True, '')
    """
    code, reason = refusal(cmp, margin)
    return code is None, reason


def refusal_record(code: str) -> dict:
    """``decision["refusal"]``: the code and whether the offline data judged the candidate.

    Example:
        >>> refusal_record("unjudgeable")
        {'code': 'unjudgeable', 'judged': False}
    """
    return {"code": code, "judged": REFUSALS[code]}


def _report(d: dict, job: CandidateJob, cfg: Any, candidate: Any, episodes: list) -> None:
    from rlrec.trainer.ope import LoggedData, PolicyTarget, evaluate

    data = LoggedData(episodes)
    name = _report_estimator(cfg)
    ev = evaluate(
        data,
        PolicyTarget(candidate, cfg.promotion_explore, seed=cfg.seed or 0),
        gamma=job.gamma,
        estimators=(name,),
        **_settings(cfg),
    )
    est = ev.estimates[name]
    d.update(
        {
            "candidate_return": est.value,
            "estimable": est.estimable,
            "reason": est.reason,
            "candidate_estimate": est.to_dict(),
            "diagnostics": ev.diagnostics,
        }
    )
    d["data"].update(_data_summary(data, ev))


def _report_estimator(cfg: Any) -> str:
    """The estimator of an ``--ope-report`` (it decides nothing: ``auto`` reports wdr)."""
    return "wdr" if cfg.promotion_estimator == "auto" else cfg.promotion_estimator


def _data_summary(data: Any, ev: Any) -> dict:
    return {
        "episodes": data.n_episodes,
        "steps": data.steps,
        "behavior_versions": ev.behavior_versions,
        "behavior_mean_return": ev.behavior_mean_return,
    }
