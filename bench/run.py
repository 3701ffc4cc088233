"""The benchmark suite: producer, consumer, memory and trainer benchmarks in one go, one table.

    python bench/run.py [--quick] [--json PATH] [--markdown PATH] [--only producer,consumer,memory,trainer,manifest]

Runs `bench/producer.py`, `bench/consumer.py`, `bench/memory.py`, `bench/trainer.py` and
`bench/manifest.py`, each in its own child process with `--json` (so each keeps its own broker,
Ray instance and peak RSS), and merges their results into rows. Every benchmark measures its own
bare baseline in the same run:

  producer  EpisodeRecorder vs bare confluent-kafka `produce()`            (CPU per step)
  consumer  RecorderConsumer vs a bare poll+decode+assemble+pack loop, and vs RLlib's
            `ray.data.from_items(...).write_parquet` write path            (steps/s, peak RSS)
  memory    RecorderConsumer's peak RSS under a hostile mix (huge infos, huge spaces, endless
            episodes) vs the sum of its configured memory budgets
  trainer   ManifestOfflineData vs stock `OfflineData`, same BC config     (timesteps/s);
            streaming: learner wait share, shard commit -> first gradient p95
  manifest  a partition claim at 20k log entries vs the claim before snapshots (commit 51d84f6)
            (seconds on a local dir and on S3, storage calls; alternated rounds)

JSON (`--json PATH`), exactly::

    {"rows": [{"figure": str, "ours": float, "baseline": float|null, "ratio": float,
               "target": str, "pass": true|false|null, "rounds": {...}|null}, ...]}

`rounds` holds a row's raw per-round values and their spread where its benchmark reports them
(`{"ours": [...], "baseline": [...], "spread": {"ours": [min, max], "baseline": [min, max]}}`;
`ours`/`baseline` are then medians), else null.

`ratio` is ours/baseline; for a row without a baseline it is ours/bound of its target (so a
"< bound" target is met by a ratio below 1). Full mode judges every row against its target
(`pass` true/false) and exits 1 if any row fails; `--quick` is a smoke test (small runs, a few
minutes) that judges nothing: every `pass` is null. The Markdown table (for README's
"Benchmarks" section) is printed, or written to `--markdown PATH`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

BENCHES = ("producer", "consumer", "memory", "trainer", "manifest")

#: child arguments per benchmark: (full, quick)
ARGS = {
    "producer": ([], ["--quick"]),
    "consumer": ([], ["--quick"]),
    "memory": ([], ["--quick"]),
    "trainer": (
        [],
        [
            "--shards",
            "4",
            "--episodes-per-shard",
            "3",
            "--seconds",
            "4",
            "--stream-seconds",
            "14",
            "--interval",
            "1.5",
            "--warmup-iterations",
            "1",
        ],
    ),
    "manifest": ([], ["--quick"]),
}
#: seconds a child may take: (full, quick)
TIMEOUTS = {
    "producer": (600, 240),
    "consumer": (900, 300),
    "memory": (1200, 300),
    "trainer": (900, 300),
    "manifest": (2400, 300),
}


@dataclass
class Row:
    """One judged figure. `pass_` is serialized as "pass"."""

    figure: str
    ours: float
    baseline: float | None
    ratio: float
    target: str
    pass_: bool | None
    rounds: dict | None = None

    def as_json(self) -> dict:
        d = asdict(self)
        d["pass"] = d.pop("pass_")
        d["rounds"] = d.pop("rounds")
        return d


class BenchError(RuntimeError):
    """A benchmark child failed or its result lacks a figure."""


def _num(r: dict, *path: str) -> float:
    v = r
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    if v is None:
        raise BenchError(f"benchmark result has no {'.'.join(path)}")
    return float(v)


def _row(
    figure: str,
    ours: float,
    baseline: float | None,
    target: str,
    ok: Callable[[float, float], bool],
    quick: bool,
    bound: float | None = None,
) -> Row:
    ratio = ours / baseline if baseline is not None else ours / bound
    return Row(figure, ours, baseline, ratio, target, None if quick else bool(ok(ours, ratio)))


def producer_rows(r: dict, quick: bool) -> list[Row]:
    from bench.producer import TARGET_RATIO, TARGET_STEPS_PER_S

    return [
        _row(
            "producer: CPU µs per step vs bare produce()",
            _num(r, "ours_cpu_us_per_step"),
            _num(r, "bare_cpu_us_per_step"),
            f"ratio ≤ {TARGET_RATIO:g}",
            lambda o, q: q <= TARGET_RATIO,
            quick,
        ),
        _row(
            "producer: steps/s of CPU vs bare produce() msgs/s",
            _num(r, "steps_per_s"),
            _num(r, "bare_produce_per_s"),
            f"ours ≥ {TARGET_STEPS_PER_S:,} steps/s",
            lambda o, q: o >= TARGET_STEPS_PER_S,
            quick,
        ),
    ]


#: the consumer's peak RSS may be at most this multiple of the bare floor loop's (same imports)
CONSUMER_RSS_VS_FLOOR = 2.0


def consumer_rows(r: dict, quick: bool) -> list[Row]:
    from bench.consumer import TARGET_VS_FLOOR, TARGET_VS_RLLIB

    ours = _num(r, "consumer_steps_per_s")
    return [
        _row(
            "consumer: steps/s vs bare poll+decode+assemble+pack",
            ours,
            _num(r, "floor_steps_per_s"),
            f"ratio ≥ {TARGET_VS_FLOOR:g}",
            lambda o, q: q >= TARGET_VS_FLOOR,
            quick,
        ),
        _row(
            "consumer: steps/s vs RLlib's write path",
            ours,
            _num(r, "rllib_steps_per_s"),
            f"ratio ≥ {TARGET_VS_RLLIB:g}",
            lambda o, q: q >= TARGET_VS_RLLIB,
            quick,
        ),
        _row(
            "consumer: peak RSS MB vs the bare loop's",
            _num(r, "consumer_peak_rss_mb"),
            _num(r, "floor_peak_rss_mb"),
            f"ratio ≤ {CONSUMER_RSS_VS_FLOOR:g}",
            lambda o, q: q <= CONSUMER_RSS_VS_FLOOR,
            quick,
        ),
    ]


TARGET_TRAINER_RATIO = 1.0
TARGET_WAIT_SHARE = 0.10
TARGET_P95_S = 5.0


def trainer_rows(r: dict, quick: bool) -> list[Row]:
    return [
        _row(
            "trainer: timesteps/s vs stock OfflineData (BC)",
            _num(r, "static", "ours", "timesteps_per_s"),
            _num(r, "static", "stock", "timesteps_per_s"),
            f"ratio ≥ {TARGET_TRAINER_RATIO:g}",
            lambda o, q: q >= TARGET_TRAINER_RATIO,
            quick,
        ),
        _row(
            "trainer: learner wait share, streaming (mean)",
            _num(r, "streaming", "learner_wait_share_mean"),
            None,
            f"< {TARGET_WAIT_SHARE:.0%}",
            lambda o, q: o < TARGET_WAIT_SHARE,
            quick,
            bound=TARGET_WAIT_SHARE,
        ),
        _row(
            "trainer: shard commit → first gradient, p95 s",
            _num(r, "streaming", "commit_to_first_gradient_s_p95"),
            None,
            f"< {TARGET_P95_S:g} s",
            lambda o, q: o < TARGET_P95_S,
            quick,
            bound=TARGET_P95_S,
        ),
    ]


def memory_rows(r: dict, quick: bool) -> list[Row]:
    from bench.memory import TARGET_RATIO

    return [
        _row(
            "consumer: peak RSS MB above idle, hostile mix, vs its budgets",
            _num(r, "peak_above_idle_mb_median"),
            _num(r, "bound_mb"),
            f"ratio ≤ {TARGET_RATIO:g}",
            lambda o, q: q <= TARGET_RATIO,
            quick,
        )
    ]


#: our claim must be at most this fraction of the claim before snapshots, at 20k entries
TARGET_CLAIM_RATIO = 0.1


def manifest_rows(r: dict, quick: bool) -> list[Row]:
    from bench.manifest import CLAIM_BUDGET

    n = int(_num(r, "entries"))
    rows = []
    for where, label in (("s3", "S3 (moto)"), ("local", "local dir")):
        raw = r[where]["raw"]
        ours = [x["seconds"] for x in raw["ours"]]
        base = [x["seconds"] for x in raw.get("baseline", [])] or None
        rounds = {
            "ours": ours,
            "baseline": base,
            "spread": {"ours": [min(ours), max(ours)], "baseline": [min(base), max(base)] if base else None},
        }
        row = _row(
            f"manifest: claim s at {n:,} log entries, {label}, vs before snapshots",
            _num(r, where, "ours", "seconds", "median"),
            _num(r, where, "baseline", "seconds", "median") if base else None,
            f"ratio ≤ {TARGET_CLAIM_RATIO:g}",
            lambda o, q: q <= TARGET_CLAIM_RATIO,
            quick,
            bound=1.0,
        )
        row.rounds = rounds
        rows.append(row)
    tail = int(_num(r, "tail_after_snapshot"))
    calls = [x["storage_calls"] for x in r["local"]["raw"]["ours"]]
    base_calls = [x["storage_calls"] for x in r["local"]["raw"].get("baseline", [])] or None
    row = _row(
        f"manifest: storage calls per claim at {n:,} log entries vs before snapshots",
        _num(r, "local", "ours", "storage_calls", "median"),
        _num(r, "local", "baseline", "storage_calls", "median") if base_calls else None,
        f"≤ {CLAIM_BUDGET} + {tail} (entries since the last snapshot)",
        lambda o, q: o <= CLAIM_BUDGET + tail,
        quick,
        bound=float(CLAIM_BUDGET + tail),
    )
    row.rounds = {"ours": calls, "baseline": base_calls, "spread": None}
    rows.append(row)
    return rows


ROWS = {
    "producer": producer_rows,
    "consumer": consumer_rows,
    "memory": memory_rows,
    "trainer": trainer_rows,
    "manifest": manifest_rows,
}


def scaleout_rows(r: dict, quick: bool) -> list[Row]:
    """bench/consumer_scaleout.py: 2 consumer processes vs 1 on 4 partitions (reported, never judged)."""
    two, one = ([x["steps_per_s"] for x in r["runs"] if x["processes"] == n] for n in (2, 1))
    rounds = {"ours": two, "baseline": one, "spread": {"ours": r["spread"]["two"], "baseline": r["spread"]["one"]}}
    ours, base = _num(r, "two_processes_steps_per_s"), _num(r, "one_process_steps_per_s")
    target = f"reported only ({r['cpu_count']} shared cores: contention, not scaling)"
    return [Row("scaleout: consumer steps/s, 2 processes vs 1", ours, base, ours / base, target, None, rounds)]


#: run only when named in --only (bench/consumer_scaleout.py; minutes, not part of the default run)
ARGS["scaleout"], TIMEOUTS["scaleout"], ROWS["scaleout"] = ([], ["--quick"]), (1200, 300), scaleout_rows


def run_child(name: str, quick: bool, workdir: str) -> dict:
    """Run bench/<name>.py with --json in a child process; returns its JSON result."""
    out = os.path.join(workdir, f"{name}.json")
    log_path = os.path.join(workdir, f"{name}.log")
    script = {"scaleout": "consumer_scaleout"}.get(name, name)
    cmd = [sys.executable, os.path.join(HERE, f"{script}.py"), *ARGS[name][quick], "--json", out]
    timeout = TIMEOUTS[name][quick]
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout}s"
    if rc != 0 or not os.path.exists(out):
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise BenchError(f"bench/{name}.py failed ({rc}):\n{tail}")
    with open(out) as f:
        return json.load(f)


def _fmt(v: float | None) -> str:
    if v is None:
        return "–"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def _verdict(p: bool | None) -> str:
    return {True: "PASS", False: "FAIL", None: "not judged"}[p]


def markdown(rows: list[Row]) -> str:
    lines = ["| figure | ours | baseline | ratio | target | pass |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.figure} | {_fmt(r.ours)} | {_fmt(r.baseline)} | {r.ratio:.2f} | {r.target} | {_verdict(r.pass_)} |"
        )
    return "\n".join(lines) + "\n"


def print_table(rows: list[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for col, just in (
        ("figure", "left"),
        ("ours", "right"),
        ("baseline", "right"),
        ("ratio", "right"),
        ("target", "left"),
        ("pass", "center"),
    ):
        t.add_column(col, justify=just)
    style = {True: "green", False: "red", None: "dim"}
    for r in rows:
        t.add_row(
            r.figure,
            _fmt(r.ours),
            _fmt(r.baseline),
            f"{r.ratio:.2f}",
            r.target,
            f"[{style[r.pass_]}]{_verdict(r.pass_)}[/]",
        )
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)
    console.print(t)


def run(quick: bool, only: tuple[str, ...] = BENCHES, workdir: str | None = None) -> list[Row]:
    """Run the chosen benchmarks (in order) and return their rows."""
    from rich.console import Console

    console = Console(stderr=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="rlrec-bench-run-") as tmp:
        workdir = workdir or tmp
        for i, name in enumerate(only, 1):
            t0 = time.time()
            with console.status(f"[{i}/{len(only)}] bench/{name}.py{' --quick' if quick else ''} ..."):
                result = run_child(name, quick, workdir)
            console.log(f"bench/{name}.py done in {time.time() - t0:.0f}s")
            rows += ROWS[name](result, quick)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke test: small runs, nothing judged")
    ap.add_argument("--json", dest="json_path", help="write {'rows': [...]} here")
    ap.add_argument("--markdown", help="write the Markdown table here (printed otherwise)")
    ap.add_argument(
        "--only", default=",".join(BENCHES), help="comma-separated subset of producer,consumer,trainer,manifest"
    )
    ap.add_argument("--keep-logs", metavar="DIR", help="keep each child's log and JSON in DIR")
    args = ap.parse_args(argv)
    only = tuple(s.strip() for s in args.only.split(",") if s.strip())
    unknown = [s for s in only if s not in ROWS]
    if unknown or not only:
        ap.error(f"--only: unknown benchmark(s) {unknown}; choose from {', '.join(ROWS)}")
    if args.keep_logs:
        os.makedirs(args.keep_logs, exist_ok=True)
    t0 = time.time()
    try:
        rows = run(args.quick, only, args.keep_logs)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    title = f"rlrec benchmarks ({'quick: smoke test, not judged' if args.quick else 'full'}; {time.time() - t0:.0f}s)"
    print_table(rows, title)
    md = markdown(rows)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
    else:
        print(md)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"rows": [r.as_json() for r in rows]}, f, indent=2)
            f.write("\n")
    return 1 if any(r.pass_ is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
