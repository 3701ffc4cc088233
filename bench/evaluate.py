"""End-to-end benchmark of `rlrec evaluate` (issue 47): how soon it says its first phase and how
its whole run compares with the estimators' own compute.

A CartPole store of `--steps` logged steps with propensities (`bench/evaluate_store.py`), half of
its episodes held out (`--holdout-fraction 0.5`: ~`--steps`/2 held-out steps). Per round, in an
alternating order:

  cli       ``rlrec evaluate ... --json`` as a user runs it (a fresh interpreter): seconds to its
            first phase line on stderr (``rlrec evaluate: loading ...``), to each later phase, and
            to its exit;
  compute   in this process, after a warm-up: `rlrec.trainer.ope.evaluate` (the estimators: FQE
            fit, bootstrap, diagnostics) on the same held-out episodes with the same settings.

Contract (issue 47): first phase line <= 2 s; cli total <= 2x compute (median of the per-round
ratios). Usage: ``python bench/evaluate.py [--steps 200000] [--rounds 3] [--store DIR] [--quick] [--json F]``;
``bench/run.py --only evaluate`` turns its result into two rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from evaluate_store import build

FIRST_LINE_S = 2.0
TOTAL_OVER_COMPUTE = 2.0


def _cli_args(root: str, estimators: str, holdout: float) -> list[str]:
    return [
        "evaluate",
        "--input",
        os.path.join(root, "data"),
        "--policies",
        os.path.join(root, "policies"),
        "--version",
        "2",
        "--allow-unsigned",
        "--holdout-fraction",
        str(holdout),
        "--estimators",
        estimators,
        "--json",
    ]


def run_cli(root: str, estimators: str, holdout: float) -> dict:
    """One ``rlrec evaluate`` run: seconds to each stderr phase line and to the exit."""
    rlrec = os.path.join(os.path.dirname(sys.executable), "rlrec")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [rlrec, *_cli_args(root, estimators, holdout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    phases = []
    for line in proc.stderr:
        if line.startswith("rlrec evaluate: "):
            phases.append((time.perf_counter() - t0, line.strip()[len("rlrec evaluate: ") :][:60]))
    out = proc.stdout.read()
    rc = proc.wait()
    total = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"rlrec evaluate exited {rc}: {phases}")
    doc = json.loads(out)
    return {
        "first_line_s": phases[0][0],
        "total_s": total,
        "phases": phases,
        "cli_steps": doc["steps"],
        "cli_gamma": doc["gamma"],
    }


def compute(root: str, estimators: str, holdout: float) -> dict:
    """Seconds of the estimators alone on the held-out episodes `rlrec evaluate` reads."""
    from rlrec.commands.evaluate import OPTIONS, EvaluateOptions, estimator_settings
    from rlrec.trainer.config import OPESettings
    from rlrec.trainer.ope import LoggedData, PolicyTarget, evaluate
    from rlrec.trainer.ope_data import HeldOutReader, policy_spaces
    from rlrec.trainer.policy import load_policy

    opts = OPTIONS.resolve(_parse(_cli_args(root, estimators, holdout)))
    ev, ope = OPTIONS.build(EvaluateOptions, opts), OPTIONS.build(OPESettings, opts)
    policy = load_policy(ev.policies, version=2, allow_unsigned=True)
    obs_space, act_space = policy_spaces(policy.spec)
    t0 = time.perf_counter()
    reader = HeldOutReader(ev.input, ope.holdout_fraction, observation_space=obs_space, action_space=act_space)
    data = LoggedData(reader.refresh())
    read_s = time.perf_counter() - t0
    names = tuple(estimators.split(","))
    settings = estimator_settings(ev, ope)  # the CLI's own
    gamma = ev.gamma if ev.gamma is not None else float(policy.spec.get("gamma") or 0.99)  # as the CLI takes it
    t0 = time.perf_counter()
    evaluate(data, PolicyTarget(policy, ev.explore, seed=ev.seed), gamma=gamma, estimators=names, **settings)
    return {"compute_s": time.perf_counter() - t0, "read_s": read_s, "steps": data.steps, "gamma": gamma}


def _parse(args: list[str]):
    import argparse as ap

    from rlrec.commands import evaluate as cmd

    parser = ap.ArgumentParser()
    sub = parser.add_subparsers()
    cmd.register(sub)
    return parser.parse_args(args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200_000, help="logged steps of the store (half held out)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--estimators", default="wdr,fqe,wpdis,wis", help="as rlrec evaluate's (its default)")
    ap.add_argument("--holdout-fraction", type=float, default=0.5)
    ap.add_argument("--store", default=None, help="build (or reuse) the store here (default: a temporary folder)")
    ap.add_argument("--quick", action="store_true", help="20k steps, 1 round (a smoke run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = min(args.steps, 20_000), 1
    root = args.store or tempfile.mkdtemp(prefix="rlrec-bench-evaluate-")
    built = build(root, args.steps, episodes_per_shard=20)
    print(f"store: {built}", file=sys.stderr)
    compute(root, args.estimators, args.holdout_fraction)  # warm-up (imports, page cache)
    rounds = []
    for r in range(args.rounds):
        order = ("cli", "compute") if r % 2 == 0 else ("compute", "cli")
        row: dict = {}
        for side in order:
            row.update(
                run_cli(root, args.estimators, args.holdout_fraction)
                if side == "cli"
                else compute(root, args.estimators, args.holdout_fraction)
            )
        if (row["cli_steps"], row["cli_gamma"]) != (row["steps"], row["gamma"]):  # equal work on both sides
            raise RuntimeError(f"the CLI and the compute side differ: {row}")
        row["ratio"] = row["total_s"] / row["compute_s"]
        rounds.append(row)
        print(
            f"round {r}: first line {row['first_line_s']:.2f}s, total {row['total_s']:.2f}s, "
            f"compute {row['compute_s']:.2f}s (read {row['read_s']:.2f}s), ratio {row['ratio']:.2f}, "
            f"{row['steps']:,} held-out steps; phases: " + ", ".join(f"{t:.1f}s {p[:24]}" for t, p in row["phases"]),
            file=sys.stderr,
        )
    first = statistics.median(r["first_line_s"] for r in rounds)
    ratio = statistics.median(r["ratio"] for r in rounds)
    doc = {
        "args": vars(args),
        "store": built,
        "load_average": os.getloadavg(),
        "rounds": rounds,
        "first_line_s": {"median": first, "at_most": FIRST_LINE_S, "met": first <= FIRST_LINE_S},
        "total_over_compute": {"median": ratio, "at_most": TOTAL_OVER_COMPUTE, "met": ratio <= TOTAL_OVER_COMPUTE},
    }
    print(
        f"first phase line: median {first:.2f}s (<= {FIRST_LINE_S:g}s: {'met' if first <= FIRST_LINE_S else 'MISSED'}); "
        f"total / estimators' compute: median {ratio:.2f}x (<= {TOTAL_OVER_COMPUTE:g}x: "
        f"{'met' if ratio <= TOTAL_OVER_COMPUTE else 'MISSED'})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
