"""`rlrec evaluate`: off-policy evaluation of a published policy version on held-out episodes.

Reads the committed shards under --input (through the schema gate; nothing is unpickled), keeps
the episodes held out for evaluation (`--holdout-fraction F`: the first 8 bytes of
sha256(episode id) / 2**64 < F, the same episodes `rlrec train --holdout-fraction F` never trains
on), optionally only those recorded by behaviour version V, and estimates the mean discounted
return per episode of the published version (at --gamma; default: the gamma in its policy.json,
else 0.99) from the behaviour's recorded propensities (`action_logp`). Estimators: wdr (weighted
doubly robust on FQE, the default), fqe, wpdis, wis, and mb (pessimistic model-based: an
ensemble of dynamics models, the candidate rolled out from held-out initial states, ended where
it leaves the data; asked for by name); an estimate whose diagnostics fail (coverage of
propensities, effective sample size, largest weight, support, horizon) is reported as not
estimable, with the reason. Every estimate carries a gate verdict ("gate": ok, or why it may not
decide a publication: what rests on the model alone past the step t* where the weights'
effective sample size falls below --ope-min-step-ess; fqe never; mb when its rollouts leave the
logged states). Intervals: wis/wpdis are bootstrap confidence intervals; fqe/wdr resample around
one fit and mb over refits, neither includes the model's bias: they are not valid bounds.
See docs/TRAINER.md.

Examples:
  rlrec evaluate --input s3://bucket/exp --policies s3://bucket/run1/policies --json
  rlrec evaluate --input /data/exp --policies /ckpt/policies --version 3 --behavior-version 2 \\
      --estimators wdr,wis --explore
  rlrec evaluate --input /data/exp --policies /ckpt/policies --version 5 --compare-to 4 \\
      --as-of CURSOR --seed 0 --json   # a gate decision again: its data.cursor, its seed
  rlrec evaluate --input /data/exp --policies /ckpt/policies --candidate candidates/KEY \\
      --version 5 --compare-to 4 --as-of CURSOR --json   # a refusal again (its refused_candidate)

`--compare-to N` (or `behavior`) adds the gate's question: the paired difference version -
version N (or - the logged behaviour's own return) under the first estimator, bootstrapped on the
same resamples, with the gate verdict; `--as-of CURSOR` reads the store at that manifest point.
With a decision's cursor, its estimator first, the trainer's --seed, --holdout-fraction,
--policy-id and OPE settings, the numbers are the decision's exactly.

Every option can also come from a config file (`--config FILE`) or from `RLREC_<OPTION>`
environment variables, as for `rlrec train`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rlrec.options import OptionSet, option
from rlrec.trainer.config import OPESettings

__all__ = ["OPTIONS", "EvaluateOptions"]


@dataclass
class EvaluateOptions:
    """Options of `rlrec evaluate` (besides the shared `OPESettings`)."""

    input: str = option(help="the consumer's output URI or path (its committed shards are read)")
    policies: str = option(help="the publish root of the policies (e.g. {checkpoint-dir}/policies)")
    version: str = option("latest", metavar="N|latest", help="the published version to evaluate")
    behavior_version: int | None = option(
        None, help="evaluate only on episodes recorded by this behaviour policy version"
    )
    estimators: str = option(
        "wdr,fqe,wpdis,wis", help="comma-separated estimators (wdr, fqe, wpdis, wis, mb); the first is the default"
    )
    as_of: str | None = option(
        None, metavar="CURSOR", help="read the store at this manifest point (a decision's data.cursor, or a UNIX time)"
    )
    compare_to: str | None = option(
        None,
        metavar="N|behavior",
        help="also the paired difference against published version N (or the logged behaviour) under the "
        "first estimator, as the ope promotion gate computes it",
    )
    candidate: str | None = option(
        None,
        metavar="DIR",
        help="evaluate a candidate the ope gate refused: its decision's refused_candidate.dir "
        "(candidates/KEY under the publish root; --version N is its refused_candidate.version)",
    )
    explore: bool = option(
        False,
        help="evaluate the policy's exploring (sampling) action selection; default: its greedy actions (--greedy)",
    )
    json: bool = option(False, help="print only the JSON result on stdout")
    gamma: float | None = option(None, help="discount (default: the version's gamma in policy.json, else 0.99)")
    policy_id: str | None = option(None, help="read only this policy id's shards")
    seed: int = option(0, help="seed of the bootstrap, the FQE fit and sampled actions")
    public_key: str | None = option(
        None, help="the trainer's Ed25519 public key (PEM) to verify the version (default: $RLREC_POLICY_PUBLIC_KEY)"
    )
    allow_unsigned: bool = option(False, help="load an unsigned version")


#: the options of `rlrec evaluate`, declared on these dataclasses
OPTIONS = OptionSet("evaluate", EvaluateOptions, OPESettings)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "evaluate",
        help="off-policy evaluation of a published policy on held-out episodes (no simulator)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    OPTIONS.add_arguments(p)
    p.add_argument(
        "--greedy", dest="explore", action="store_const", const=False, help="evaluate the greedy actions (default)"
    )
    p.set_defaults(func=_run, options=OPTIONS)


def _say(message: str) -> None:
    """A start-up phase, on stderr as it begins (stdout stays the result's)."""
    print(f"rlrec evaluate: {message}", file=sys.stderr, flush=True)


def _fail(message: str) -> int:
    print(f"rlrec evaluate: error: {message}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    try:
        opts = OPTIONS.resolve(args)
        ev = OPTIONS.build(EvaluateOptions, opts)
        ope = OPTIONS.build(OPESettings, opts)
    except ValueError as e:
        return _fail(str(e))
    names = tuple(n.strip().lower() for n in ev.estimators.split(",") if n.strip())
    from rlrec.trainer.ope import ESTIMATORS

    bad = [n for n in names if n not in ESTIMATORS]
    if bad or not names:
        return _fail(f"--estimators: unknown {', '.join(bad) or '(none)'} (choose from {', '.join(ESTIMATORS)})")
    if ev.version != "latest" and not ev.version.isdigit():
        return _fail(f"--version must be a number or latest, got {ev.version!r}")
    if ev.candidate is not None:
        if not re.fullmatch(CANDIDATE_DIR, ev.candidate):
            return _fail(
                f"--candidate must be a decision's refused_candidate.dir (candidates/KEY), got {ev.candidate!r}"
            )
        if not ev.version.isdigit():
            return _fail("--candidate needs --version N (the decision's refused_candidate.version)")
    if not ope.holdout_fraction:
        return _fail("--holdout-fraction 0 holds out no episodes: nothing to evaluate on")
    if ev.compare_to is not None and ev.compare_to != "behavior" and not ev.compare_to.isdigit():
        return _fail(f"--compare-to must be a version number or behavior, got {ev.compare_to!r}")
    if ev.gamma is not None and not 0.0 < ev.gamma <= 1.0:
        return _fail(f"--gamma must be in (0, 1], got {ev.gamma}")
    if not ev.public_key and not os.environ.get("RLREC_POLICY_PUBLIC_KEY") and not ev.allow_unsigned:
        return _fail(NO_KEY)
    try:
        result = evaluate_published(ev, ope, names, say=_say)
    except _UserError as e:
        return _fail(str(e))
    if ev.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    _print(result)
    return 0


class _UserError(Exception):
    pass


#: what --candidate accepts: a refused candidate's folder under the publish root (`rlrec.trainer.refused`)
CANDIDATE_DIR = r"(candidates/)?\d{10}-[0-9a-f]{12}"


def _candidate_root(policies: str, candidate: str) -> str:
    """The folder holding refused candidate `candidate`'s ``v{N:06d}/`` under the publish root
    `policies` (or a checkpoint dir holding ``policies/``)."""
    from rlrec.store.storage import Storage
    from rlrec.trainer.refused import CANDIDATES

    root = policies.rstrip("/")
    try:
        storage = Storage.from_uri(root)
        if not storage.exists("latest.json") and storage.exists("policies/latest.json"):
            root = f"{root}/policies"
    except Exception:  # unreachable or not a URI: the loader says what is wrong
        pass
    return f"{root}/{CANDIDATES}/{candidate.rpartition('/')[2]}"


#: the one line for a command line that gives no way to trust a version
NO_KEY = (
    "no public key to verify the policy with: give --public-key FILE (the trainer's Ed25519 public key, "
    "or set RLREC_POLICY_PUBLIC_KEY), or --allow-unsigned to evaluate an unsigned version"
)

#: the loader's (Python) names of its options -> this command's flags, in its messages
_FLAG_NAMES = (
    ("public_key= or RLREC_POLICY_PUBLIC_KEY", "--public-key or RLREC_POLICY_PUBLIC_KEY"),
    ("allow_unsigned=True", "--allow-unsigned"),
    ("public_key=", "--public-key"),
)


def _in_flags(message: str) -> str:
    """A policy loader's message with its keyword names replaced by the command's flags.

    Example:
        >>> _in_flags("v000003 is not signed: configure (public_key= or RLREC_POLICY_PUBLIC_KEY), or pass allow_unsigned=True")
        'v000003 is not signed: configure (--public-key or RLREC_POLICY_PUBLIC_KEY), or pass --allow-unsigned'
    """
    for name, flag in _FLAG_NAMES:
        message = message.replace(name, flag)
    return message


def published_versions(policies: str) -> list[int]:
    """The versions published under `policies` (a publish root, or a checkpoint dir holding
    ``policies/``), in order; empty when none is (or the root cannot be listed).

    Example:
        >>> published_versions("/nonexistent")
        []
    """
    from rlrec.store.storage import Storage

    try:
        storage = Storage.from_uri(policies)
        if not storage.exists("latest.json") and storage.exists("policies/latest.json"):
            storage = Storage.from_uri(policies.rstrip("/") + "/policies")
        names = [f.name for f in storage.list("") if f.is_dir]
    except Exception:  # unreachable or not a URI: the loader says what is wrong
        return []
    return sorted(int(n[1:]) for n in names if re.fullmatch(r"v\d{6}", n))


def _ranges(versions: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    out: list[str] = []
    for v in versions:
        if out and int(out[-1].rpartition("-")[2]) == v - 1:
            out[-1] = f"{out[-1].partition('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


def estimator_settings(ev: EvaluateOptions, ope: OPESettings) -> dict:
    """The estimators' settings `rlrec evaluate` passes to `evaluate` and `compare` (with the
    data, the target, gamma and the estimators' names)."""
    from rlrec.trainer.ope import FQEConfig

    return {
        "ci": ope.ope_ci,
        "n_boot": ope.ope_bootstrap,
        "seed": ev.seed,
        "thresholds": ope.thresholds(),
        "fqe": FQEConfig(steps=ope.fqe_steps, seed=ev.seed),
        "model": ope.model(ev.seed),
    }


def evaluate_published(
    ev: EvaluateOptions, ope: OPESettings, names: tuple[str, ...], say: Callable[[str], None] = lambda m: None
) -> dict:
    """The result document of `rlrec evaluate` (the ``--json`` contract); `say` is told each
    phase as it begins."""
    say(
        f"loading {'the latest version' if ev.version == 'latest' else 'version ' + ev.version} of the policy under "
        + (ev.policies if ev.candidate is None else f"{ev.policies} (refused candidate {ev.candidate})")
    )
    from rlrec.producer.spaces import SpaceError
    from rlrec.store.cursor import CursorError
    from rlrec.store.storage import StorageError
    from rlrec.trainer.ope import LoggedData, PolicyTarget, compare, evaluate
    from rlrec.trainer.ope_data import HeldOutReader, policy_spaces
    from rlrec.trainer.policy import PolicyLoadError, UnsignedPolicyWarning, load_policy

    where = ev.policies if ev.candidate is None else _candidate_root(ev.policies, ev.candidate)
    if ev.version != "latest" and ev.candidate is None:
        versions = published_versions(ev.policies)
        if int(ev.version) not in versions:
            published = f"published: {_ranges(versions)}" if versions else "no version is published there"
            raise _UserError(f"--version {int(ev.version)}: no such version under {ev.policies} ({published})")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UnsignedPolicyWarning)
            policy = load_policy(
                where,
                version=None if ev.version == "latest" else int(ev.version),
                public_key=ev.public_key,
                allow_unsigned=ev.allow_unsigned,
            )
    except (PolicyLoadError, ValueError, OSError) as e:
        raise _UserError(f"cannot load the policy: {_in_flags(str(e))}") from None
    for w in caught:
        if issubclass(w.category, UnsignedPolicyWarning):
            print(f"rlrec evaluate: warning: {_in_flags(str(w.message))}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if policy.spec.get("format") != "safetensors":
        raise _UserError("only code-free (safetensors) policy versions can be evaluated")
    try:  # the episodes are checked against the evaluated version's spaces, as the ope gate does
        obs_space, act_space = policy_spaces(policy.spec)
    except SpaceError as e:
        raise _UserError(f"cannot load the policy: its policy.json states a malformed space: {e}") from None
    say(f"reading the held-out episodes (--holdout-fraction {ope.holdout_fraction}) under {ev.input}")
    try:
        reader = HeldOutReader(
            ev.input, ope.holdout_fraction, policy_id=ev.policy_id, observation_space=obs_space, action_space=act_space
        )
        episodes = reader.refresh(as_of=ev.as_of, progress=_Throttled(say).reading)
    except CursorError as e:
        raise _UserError(f"--as-of: {e}") from None
    except (StorageError, OSError) as e:
        raise _UserError(f"cannot read {ev.input}: {type(e).__name__}: {e}") from None
    if ev.behavior_version is not None:
        episodes = [e for e in episodes if e.policy_version == ev.behavior_version]
    if not episodes:
        raise _UserError(
            f"no held-out episodes under {ev.input} (--holdout-fraction {ope.holdout_fraction}"
            + (f", --behavior-version {ev.behavior_version}" if ev.behavior_version is not None else "")
            + ")"
        )
    gamma = ev.gamma if ev.gamma is not None else float(policy.spec.get("gamma") or 0.99)
    data = LoggedData(episodes)
    obs_dim = int(policy.spec["network"]["input_dim"])
    if data.obs.shape[1] != obs_dim:
        raise _UserError(f"the episodes' observations have {data.obs.shape[1]} values, the policy takes {obs_dim}")
    say(f"estimating with {', '.join(names)} on {data.n_episodes} episodes ({data.steps} steps)")
    settings = estimator_settings(ev, ope)
    target = PolicyTarget(policy, ev.explore, seed=ev.seed)
    with _still_running(say, "estimating"):
        result = evaluate(data, target, gamma=gamma, estimators=names, **settings).to_dict()
    comparison = None
    if ev.compare_to is not None:
        base = None
        if ev.compare_to != "behavior":
            try:
                base = load_policy(
                    ev.policies, version=int(ev.compare_to), public_key=ev.public_key, allow_unsigned=ev.allow_unsigned
                )
            except (PolicyLoadError, ValueError, OSError) as e:
                raise _UserError(f"cannot load --compare-to {ev.compare_to}: {_in_flags(str(e))}") from None
        say(f"comparing with {ev.compare_to} under {names[0]}")
        with _still_running(say, "comparing"):
            cmp = compare(
                data,
                target,
                None if base is None else PolicyTarget(base, ev.explore, seed=ev.seed),
                gamma=gamma,
                estimator=names[0],
                **settings,
            )
        comparison = {
            "compare_to": ev.compare_to,
            "estimator": cmp.estimator,
            "difference": cmp.difference,
            "ci_low": cmp.ci_low,
            "ci_high": cmp.ci_high,
            "ci_level": cmp.ci,
            "estimable": cmp.estimable,
            "reason": cmp.reason,
            "gate": cmp.gate,
            "paired": cmp.extra.get("paired"),  # the importance-weighted difference's data-only bound
            "candidate_estimate": cmp.candidate.estimates[cmp.estimator].to_dict(),
            "deployed_estimate": cmp.deployed.estimates[cmp.estimator].to_dict(),
        }
    out = {
        "version": policy.policy_version,
        "gamma": gamma,
        "episodes": result["episodes"],
        "steps": result["steps"],
        "behavior": result["behavior"],
        "estimates": result["estimates"],
        "diagnostics": result["diagnostics"],
        "default_estimator": names[0],
        "action_selection": "explore" if ev.explore else "greedy",
        "ci_level": ope.ope_ci,
        "holdout_fraction": ope.holdout_fraction,
        "data": {**reader.stats.to_dict(), "cursor": reader.cursor},
    }
    if comparison is not None:
        out["comparison"] = comparison
    return out


class _Throttled:
    """Progress lines of a long phase, at most one every `every` seconds (and the last)."""

    def __init__(self, say: Callable[[str], None], every: float = 2.0) -> None:
        self.say, self.every = say, every
        self._last = time.monotonic()

    def reading(self, done: int, total: int, held_out: int) -> None:
        now = time.monotonic()
        if done == total or now - self._last >= self.every:
            self._last = now
            self.say(f"read {done:,}/{total:,} shard(s): {held_out:,} held-out episode(s)")


@contextlib.contextmanager
def _still_running(say: Callable[[str], None], what: str, every: float = 10.0) -> Iterator[None]:
    """Say every `every` seconds that `what` is still running, and for how long, until it ends
    (the fits of fqe, wdr and mb take minutes on large data)."""
    stop = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not stop.wait(every):
            say(f"{what}: {time.monotonic() - t0:,.0f} s so far")

    thread = threading.Thread(target=beat, name="rlrec-evaluate-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _print(r: dict) -> None:
    print(
        f"policy v{r['version']} ({r['action_selection']}), gamma {r['gamma']}, on {r['episodes']:,} held-out "
        f"episodes ({r['steps']:,} steps) of behaviour version(s) {', '.join(map(str, r['behavior']['versions'])) or '?'}"
    )
    print(f"behaviour's mean discounted return: {r['behavior']['mean_return']:.4f}")
    for name, e in r["estimates"].items():
        mark = " (default)" if name == r["default_estimator"] else ""
        if e["estimable"]:
            print(f"  {name:6s}{mark}: {e['value']:.4f}  [{e['ci_low']:.4f}, {e['ci_high']:.4f}] ({r['ci_level']:.0%})")
        else:
            print(f"  {name:6s}{mark}: not estimable: {e['reason']}")
    d = r["diagnostics"]
    print("diagnostics: " + ", ".join(f"{k} {v}" for k, v in d.items()))
    for name, e in r["estimates"].items():
        if e["estimable"] and not e["gate"]["ok"]:
            print(f"  {name} may not gate a publication: {e['gate']['reason']}")
    c = r.get("comparison")
    if c:
        if c["estimable"]:
            print(
                f"v{r['version']} - {c['compare_to']} ({c['estimator']}): {c['difference']:.4f} "
                f"[{c['ci_low']:.4f}, {c['ci_high']:.4f}]; gate verdict: "
                + ("ok" if c["gate"]["ok"] else f"not ok: {c['gate']['reason']}")
            )
        else:
            print(f"v{r['version']} - {c['compare_to']} ({c['estimator']}): not estimable: {c['reason']}")
    print(f"cursor: {r['data']['cursor']}")
    if r["data"].get("episodes_unusable"):
        print(
            f"{r['data']['episodes_unusable']:,} episode(s) left out as unusable: "
            + "; ".join(f"{n:,} {why}" for why, n in r["data"]["unusable_reasons"].items())
        )
    if not d.get("coverage"):
        print(
            "no held-out step carries the behaviour's propensity (action_logp): record it with each step "
            "(Policy.act returns it; EpisodeRecorder.log_step(..., extra_model_outputs={'action_logp': ...}))"
        )
