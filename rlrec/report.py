"""``rlrec report``: one self-contained HTML file of plots (PNG, base64-embedded; matplotlib Agg).

Sections, each replaced by a note when its data is absent:

* summary table: episodes, shards, steps, bytes, policy versions, dead letters, trainer
  iterations/timesteps, best evaluation return, time span;
* evaluation return over time, policy-version changes marked (and promotion-gate decisions
  when the trainer metrics carry them; for ``--promotion-gate ope`` or ``--ope-report`` each
  candidate's off-policy estimate with its interval, beside its true discounted return when the
  trainer had ``--env``, in the plot and in a table below it);
* with ``--rollout canary``, below it: each canary's two arms (mean discounted returns) and the
  always-valid bound on their difference over time, its decision marked (``plot-canary``; only
  when the metrics carry a canary);
* episode return distribution per policy version (box plots, from the shards' columns);
* freshness: episode end -> shard commit, shard commit -> first trained on, episode end ->
  first trained on (histograms);
* shard sizes (bytes and episodes per shard);
* dead letters by reason.

`write_report(data_dir, out)` is what ``rlrec demo`` calls at the end of a run.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from rlrec.report_data import ReportData, collect

__all__ = ["SECTIONS", "render_html", "write_report"]

#: (id, title) of every plot section, in order; the <img> of a section has id "plot-{id}".
SECTIONS = (
    ("eval", "Evaluation return over time"),
    ("returns", "Episode return per policy version"),
    ("freshness", "Freshness: episode end → shard commit → first trained on"),
    ("shards", "Shard sizes"),
    ("dead-letters", "Dead letters by reason"),
)


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _plt().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _tidy(ax, counts: str = "y") -> None:
    """Whole-number ticks on the count axis, at most 6 ticks on the value axis."""
    from matplotlib.ticker import MaxNLocator

    (ax.yaxis if counts == "y" else ax.xaxis).set_major_locator(MaxNLocator(integer=True))
    (ax.xaxis if counts == "y" else ax.yaxis).set_major_locator(MaxNLocator(6))


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def _t0(data: ReportData) -> float:
    cands = [_num(data.demo.get("started"))]
    cands += [data.shards[0].commit_time] if data.shards else []
    cands += [_num(m.get("time")) for m in data.trainer[:1] + data.demo_metrics[:1]]
    cands = [c for c in cands if c is not None]
    return min(cands) if cands else 0.0


# ------------------------------------------------------------------------------------- plots


def plot_eval(data: ReportData) -> str | None:
    pts = [
        (t, ev, m.get("policy_version"))
        for m in data.trainer
        if (t := _num(m.get("time"))) is not None and (ev := _num(m.get("eval_return_mean"))) is not None
    ]
    source = "trainer"
    if not pts:
        pts = [
            (t, ev, m.get("policy_version"))
            for m in data.demo_metrics
            if (t := _num(m.get("time"))) is not None and (ev := _num(m.get("eval_return_mean"))) is not None
        ]
        source = "demo dashboard"
    ope = ope_records(data)
    if not pts and not ope:
        data.note("eval", "no evaluation results yet (no eval_return_mean in the trainer or demo metrics)")
        return None
    t0 = _t0(data)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    if pts:
        ax.plot([p[0] - t0 for p in pts], [p[1] for p in pts], marker=".", label=f"eval return ({source})")
    _plot_ope(ax, ope, t0)
    changes, prev = [], None
    for m in data.trainer if source == "trainer" else data.demo_metrics:
        v, t = m.get("policy_version"), _num(m.get("time"))
        if isinstance(v, int) and t is not None:
            if prev is not None and v != prev:
                changes.append((t - t0, v))
            prev = v
    for i, (t, v) in enumerate(changes):
        ax.axvline(
            t, color="tab:gray", linestyle="--", linewidth=0.8, label="policy version change" if i == 0 else None
        )
        ax.text(
            t,
            0.98,
            f" v{v}",
            transform=ax.get_xaxis_transform(),
            fontsize=8,
            va="top",
            ha="left",
            color="dimgray",
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
        )
    base = _behaviour_return(data)
    if base is not None:
        v, mean = base
        ax.axhline(mean, color="tab:orange", linestyle=":", linewidth=1.2, label=f"behaviour policy v{v}: {mean:.0f}")
    promo = [
        (t - t0, p)
        for m in data.trainer
        if isinstance(p := m.get("promotion"), dict)
        and (t := _num(m.get("time"))) is not None
        and _num(p.get("candidate_return")) is not None
    ]
    if promo:
        ok = [(t, p["candidate_return"]) for t, p in promo if p.get("promoted")]
        no = [(t, p["candidate_return"]) for t, p in promo if not p.get("promoted")]
        if ok:
            ax.scatter(*zip(*ok), marker="^", color="tab:green", zorder=3, label="candidate promoted")
        if no:
            ax.scatter(*zip(*no), marker="x", color="tab:red", zorder=3, label="candidate rejected")
    ax.ticklabel_format(axis="x", useOffset=False, style="plain")
    ax.set_xlabel("seconds since start")
    shown = [p[1] for p in pts] + [float(p["candidate_return"]) for _, p in promo]
    shown += [base[1]] if base is not None else []
    if min(shown) >= 0:  # returns start at a meaningful zero: small changes are not exaggerated
        ax.set_ylim(bottom=0, top=max(shown) * 1.08 or 1)
        ax.set_ylabel("mean episode return")
    else:
        ax.set_ylabel("mean episode return\n(axis not from 0: negative returns)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _png(fig)


def _behaviour_return(data: ReportData) -> tuple[int, float] | None:
    """(version, mean recorded return) of the oldest policy version in the committed episodes:
    the behaviour policy the trainer learns from (the scripted expert, v0, in the demo)."""
    by_version: dict[int, list[float]] = defaultdict(list)
    for r, v in zip(data.episodes.get("episode_return", []), data.episodes.get("policy_version", [])):
        if isinstance(v, int) and (x := _num(r)) is not None:
            by_version[v].append(x)
    if not by_version:
        return None
    v = min(by_version)
    return v, sum(by_version[v]) / len(by_version[v])


def ope_records(data: ReportData) -> list[tuple[float, dict]]:
    """``(time, record)`` of every off-policy evaluation in the trainer metrics: the ope gate's
    decisions (``promotion`` with ``gate: "ope"``) and ``--ope-report`` estimates (``ope_report``).

    Args:
        data: the collected report data.

    Example:
        >>> d = ReportData()
        >>> d.trainer = [{"time": 5.0, "ope_report": {"candidate_version": 2}}, {"time": 6.0, "promotion": {}}]
        >>> ope_records(d)
        [(5.0, {'candidate_version': 2})]
    """
    out = []
    for m in data.trainer:
        if (t := _num(m.get("time"))) is None:
            continue
        if isinstance(p := m.get("promotion"), dict) and p.get("gate") == "ope":
            out.append((t, p))
        if isinstance(r := m.get("ope_report"), dict):
            out.append((t, r))
    return out


def ope_rows(data: ReportData) -> list[dict]:
    """One row per off-policy evaluation of a candidate: its version, the estimator, the estimate
    and its interval (discounted return), the true discounted return in the simulator (when the
    trainer had ``--env``), the gate's verdict (None: an ``--ope-report`` estimate, no decision)
    and the reason when it is not estimable.

    Args:
        data: the collected report data.

    Example:
        >>> d = ReportData()
        >>> est = {"value": 40.0, "ci_low": 35.0, "ci_high": 44.0, "estimable": True, "reason": ""}
        >>> d.trainer = [{"time": 1.0, "ope_report": {"candidate_version": 2, "estimator": "wdr",
        ...               "candidate_estimate": est, "true_return": 42.5}}]
        >>> row = ope_rows(d)[0]
        >>> row["version"], row["estimate"], row["true_return"], row["promoted"]
        (2, 40.0, 42.5, None)
    """
    rows = []
    for t, p in ope_records(data):
        est = p.get("candidate_estimate") if isinstance(p.get("candidate_estimate"), dict) else {}
        rows.append(
            {
                "time": t,
                "version": p.get("candidate_version"),
                "estimator": p.get("estimator"),
                "estimate": _num(est.get("value")),
                "ci_low": _num(est.get("ci_low")),
                "ci_high": _num(est.get("ci_high")),
                "true_return": _num(p.get("true_return")),
                "promoted": p.get("promoted") if p.get("gate") == "ope" else None,
                "reason": str(p.get("reason") or est.get("reason") or ""),
            }
        )
    return rows


def ope_table_html(data: ReportData) -> str | None:
    """The `ope_rows` as an HTML table (None: no off-policy evaluation in the metrics)."""
    rows = ope_rows(data)
    if not rows:
        return None
    e = html.escape

    def num(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}"

    verdict = {True: "promoted", False: "rejected", None: "(report only)"}
    out = [
        '<table id="ope-table"><tr><th>candidate</th><th>estimator</th><th>OPE estimate</th>'
        "<th>interval</th><th>true discounted return</th><th>gate</th><th>note</th></tr>"
    ]
    for r in rows:
        interval = "–" if r["ci_low"] is None else f"[{num(r['ci_low'])}, {num(r['ci_high'])}]"
        out.append(
            f"<tr><td>v{e(str(r['version']))}</td><td>{e(str(r['estimator'] or '–'))}</td>"
            f'<td class="v">{num(r["estimate"])}</td><td class="v">{interval}</td>'
            f'<td class="v">{num(r["true_return"])}</td><td>{verdict.get(r["promoted"], "?")}</td>'
            f"<td>{e(r['reason'])}</td></tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def _plot_ope(ax: Any, ope: list[tuple[float, dict]], t0: float) -> None:
    """The off-policy estimates of each candidate (the ope gate's or --ope-report's, with their
    intervals) and, when the trainer also had --env, the candidate's true discounted return
    beside them."""
    est = [
        (t - t0, v, e.get("ci_low"), e.get("ci_high"))
        for t, p in ope
        if isinstance(e := p.get("candidate_estimate"), dict) and (v := _num(e.get("value"))) is not None
    ]
    if est:
        xs, ys = [x for x, *_ in est], [y for _, y, _, _ in est]
        lo = [y - (_num(a) if _num(a) is not None else y) for _, y, a, _ in est]
        hi = [(_num(b) if _num(b) is not None else y) - y for _, y, _, b in est]
        ax.errorbar(
            xs, ys, yerr=[lo, hi], fmt="o", color="tab:purple", ms=4, capsize=3, label="OPE estimate (discounted)"
        )
    true = [(t - t0, v) for t, p in ope if (v := _num(p.get("true_return"))) is not None]
    if true:
        ax.scatter(*zip(*true), marker="s", color="tab:orange", zorder=3, label="true discounted return (--env)")


def plot_returns(data: ReportData) -> str | None:
    rets, vers = data.episodes.get("episode_return", []), data.episodes.get("policy_version", [])
    by_version: dict[Any, list[float]] = defaultdict(list)
    for r, v in zip(rets, vers):
        if _num(r) is not None:
            by_version[v if v is not None else "?"].append(float(r))
    if not by_version:
        data.note("returns", "no episode returns (no committed episode shards with an episode_return column)")
        return None
    keys = sorted(by_version, key=lambda v: (not isinstance(v, int), v if isinstance(v, int) else str(v)))
    if len(keys) > 40:  # keep the plot readable: the 40 most recent versions
        data.note("returns", f"{len(keys)} policy versions; showing the last 40")
        keys = keys[-40:]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(keys) + 3), 3.6))
    # the mean as a white diamond: the green triangle marks promoted candidates in the evaluation plot
    ax.boxplot(
        [by_version[k] for k in keys],
        showmeans=True,
        meanprops={"marker": "D", "markerfacecolor": "white", "markeredgecolor": "black", "markersize": 5},
    )
    ax.set_xticks(range(1, len(keys) + 1), [f"v{k}" for k in keys], rotation=90 if len(keys) > 12 else 0, fontsize=8)
    for i, k in enumerate(keys, 1):
        ax.annotate(
            f"n={len(by_version[k])}",
            (i, 0),
            xycoords=("data", "axes fraction"),
            fontsize=6,
            ha="center",
            va="bottom",
            color="tab:gray",
        )
    ax.set_xlabel("policy version (box: quartiles, line: median, ◆: mean)")
    if min(min(by_version[k]) for k in keys) >= 0:  # from a meaningful zero
        ax.set_ylim(bottom=0, top=max(max(by_version[k]) for k in keys) * 1.08 or 1)
        ax.set_ylabel("episode return")
    else:
        ax.set_ylabel("episode return\n(axis not from 0: negative returns)")
    ax.grid(alpha=0.3, axis="y")
    return _png(fig)


def freshness(data: ReportData) -> dict[str, list[float]]:
    """Latencies in seconds: end->commit and end->trained per episode, commit->trained per shard."""
    end_commit, end_trained = [], []
    ends = data.episodes.get("ended_ms", [])
    for ended, commit, path in zip(ends, data.episode_commit_time, data.episode_shard):
        if not isinstance(ended, int) or ended <= 0:
            continue  # unknown (converted data)
        end_commit.append(commit - ended / 1000.0)
        if path in data.first_trained:
            end_trained.append(data.first_trained[path] - ended / 1000.0)
    commit_trained = [data.first_trained[e.path] - e.commit_time for e in data.shards if e.path in data.first_trained]
    return {
        "episode end → shard commit": end_commit,
        "shard commit → first trained on": commit_trained,
        "episode end → first trained on": end_trained,
    }


def plot_freshness(data: ReportData) -> str | None:
    f = freshness(data)
    if not any(f.values()):
        data.note(
            "freshness",
            "no latencies: needs committed episode shards with ended_ms and, for the "
            "training side, trainer metrics with new_shards",
        )
        return None
    if not f["shard commit → first trained on"]:
        data.note("freshness", "no shard was trained on yet (no trainer metrics with new_shards)")
    plt = _plt()
    present = [(k, v) for k, v in f.items() if v]
    fig, axes = plt.subplots(1, len(present), figsize=(4 * len(present), 3.2), squeeze=False)
    for ax, (title, vals) in zip(axes[0], present):
        ax.hist(vals, bins=min(40, max(5, int(math.sqrt(len(vals))))), color="tab:blue", alpha=0.8)
        vs = sorted(vals)
        p50, p95 = vs[len(vs) // 2], vs[min(len(vs) - 1, int(0.95 * len(vs)))]
        ax.set_title(f"{title}\nmedian {p50:.2f}s, p95 {p95:.2f}s, n={len(vs)}", fontsize=8)
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        _tidy(ax)
    axes[0][0].set_ylabel("count")
    return _png(fig)


def plot_shards(data: ReportData) -> str | None:
    if not data.shards:
        data.note("shards", "no committed shards")
        return None
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    sizes = [e.bytes / 1024 for e in data.shards]
    a1.hist(sizes, bins=min(40, max(5, int(math.sqrt(len(sizes))))), color="tab:purple", alpha=0.8)
    a1.set_xlabel("shard size (KiB)")
    a1.set_ylabel("shards")
    a1.set_title(f"{len(sizes)} shards, median {sorted(sizes)[len(sizes) // 2]:.1f} KiB", fontsize=8)
    eps = [e.episodes for e in data.shards]
    a2.hist(eps, bins=min(40, max(5, int(math.sqrt(len(eps))))), color="tab:orange", alpha=0.8)
    a2.set_xlabel("episodes per shard")
    a2.set_title(f"{sum(e.steps for e in data.shards)} steps in all", fontsize=8)
    for a in (a1, a2):
        a.grid(alpha=0.3)
        _tidy(a)
    return _png(fig)


def _literal_label(s: str) -> str:
    r"""A data string as a matplotlib label shown as it is: ``$`` never starts mathtext.

    Example:
        >>> _literal_label("costs $5, not $6")
        'costs \\$5, not \\$6'
    """
    return s.replace("$", r"\$")


def plot_dead_letters(data: ReportData) -> str | None:
    if data.dead_letters_source is None:
        return None
    items = sorted(((k, v) for k, v in data.dead_letters.items() if v), key=lambda kv: -kv[1])
    if not items:
        data.note("dead-letters", f"no dead letters (source: {data.dead_letters_source})")
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(items) + 1.2))
    ax.barh([_literal_label(k) for k, _ in items][::-1], [v for _, v in items][::-1], color="tab:red", alpha=0.8)
    ax.set_xlabel(f"messages (source: {data.dead_letters_source})")
    ax.grid(alpha=0.3, axis="x")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _png(fig)


# ----------------------------------------------------------------------------------- summary


def summary(data: ReportData) -> list[tuple[str, str]]:
    """The summary table's (label, value) rows."""
    from rlrec.store.manifest import manifest_totals

    tot = manifest_totals(data.shards if data.live_shards is None else data.live_shards)  # as rlrec inspect
    versions = sorted({v for v in data.episodes.get("policy_version", []) if isinstance(v, int)})
    if not versions:
        versions = sorted(
            {v for e in data.shards for v in (e.min_policy_version, e.max_policy_version) if isinstance(v, int)}
        )
    policies = sorted(tot["policies"])
    rows = [
        ("episodes", f"{tot['episodes']:,}"),
        ("shards", f"{tot['shards']:,}"),
        ("steps", f"{tot['steps']:,}"),
        ("bytes", f"{tot['bytes']:,}"),
        ("policies", ", ".join(policies) if policies else "–"),
        ("policy versions", f"{len(versions)} ({_ranges(versions)})" if versions else "–"),
        ("dead letters", f"{sum(data.dead_letters.values()):,}" if data.dead_letters_source else "–"),
    ]
    if data.trainer:
        last = data.trainer[-1]
        rows.append(("trainer iterations", str(last.get("iteration", len(data.trainer)))))
        rows.append(("timesteps trained", f"{last.get('timesteps_trained', 0):,}"))
        evs = [ev for m in data.trainer if (ev := _num(m.get("eval_return_mean"))) is not None]
        if evs:
            rows.append(("evaluation return (last / best)", f"{evs[-1]:.1f} / {max(evs):.1f}"))
    rets = [r for r in data.episodes.get("episode_return", []) if _num(r) is not None]
    if rets:
        rows.append(("episode return (mean)", f"{sum(rets) / len(rets):.1f}"))
    times = [e.commit_time for e in data.shards]
    times += [t for m in data.trainer + data.demo_metrics if (t := _num(m.get("time"))) is not None]
    times += [t for k in ("started", "ended") if (t := _num(data.demo.get(k))) is not None]
    starts = [s / 1000.0 for s in data.episodes.get("started_ms", []) if isinstance(s, int) and s > 0]
    if starts:
        times.append(min(starts))
    if times:
        a, b = min(times), max(times)
        rows.append(("time span", f"{_utc(a)} → {_utc(b)} UTC ({b - a:,.0f} s)"))
    return rows


def _ranges(vs: list[int]) -> str:
    out, start, prev = [], None, None
    for v in vs:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}" if start == prev else f"{start}–{prev}")
            start = prev = v
    out.append(f"{start}" if start == prev else f"{start}–{prev}")
    return ", ".join(out)


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


# -------------------------------------------------------------------------------------- HTML

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; } td, th { padding: 3px 12px; border-bottom: 1px solid #eee; text-align: left; }
td.v { text-align: right; font-variant-numeric: tabular-nums; }
p.note { color: #8a6d3b; background: #fcf8e3; padding: 4px 8px; border-radius: 3px; }
img { max-width: 100%; } .src { color: #777; font-size: 0.85em; }
"""


def lineage_html(data: ReportData) -> list[str]:
    """The "Lineage" section: per published version, the manifest cursor of the data it was
    trained on (``rlrec export URI DIR --policy-version N --policies ...`` reopens it)."""
    e = html.escape
    parts = ['<h2 id="lineage">Lineage: the data each policy version was trained on</h2>']
    if data.lineages:
        parts.append('<table id="lineage-table">')
        parts.append(
            "<tr><th>version</th><th>signature verified</th><th>shards</th><th>held out</th><th>cursor</th></tr>"
        )
        for r in data.lineages:
            signed = "?" if r["signed"] is None else ("yes" if r["signed"] else "no")
            cursor = r["cursor"] or r["error"] or "not recorded"
            held = "–" if r["holdout_fraction"] is None else f"{r['holdout_fraction']:g}"
            shards = "–" if r["shards"] is None else str(r["shards"])
            parts.append(
                f'<tr><td class="v">{r["policy_version"]}</td><td>{signed}</td><td class="v">{shards}</td>'
                f'<td class="v">{held}</td><td><code>{e(str(cursor))}</code></td></tr>'
            )
        parts.append("</table>")
    for n in data.notes.get("lineage", []):
        parts.append(f'<p class="note">{e(n)}</p>')
    return parts


def canary_series(data: ReportData) -> dict[int, dict]:
    """Per canary version: its looks (``time``, both arms' counts and means, the bound ``low`` /
    ``high`` of canary - deployed) from the trainer's metrics lines (``canary_look``), and its
    decision (``canary``), if any.

    Example:
        >>> d = ReportData()
        >>> d.trainer = [{"time": 5.0, "canary_version": 3, "canary_look": {"time": 4.0, "low": -1.0}},
        ...              {"time": 6.0, "canary": {"canary_version": 3, "decision": "promote"}}]
        >>> s = canary_series(d)[3]
        >>> len(s["looks"]), s["decision"]["decision"]
        (1, 'promote')
    """
    out: dict[int, dict] = {}
    for m in data.trainer:
        look, v = m.get("canary_look"), m.get("canary_version")
        if isinstance(look, dict) and isinstance(v, int) and _num(look.get("time")) is not None:
            series = out.setdefault(v, {"looks": [], "decision": None})
            if not series["looks"] or series["looks"][-1]["time"] != look["time"]:
                series["looks"].append(look)
        d = m.get("canary")
        if isinstance(d, dict) and isinstance(d.get("canary_version"), int):
            out.setdefault(d["canary_version"], {"looks": [], "decision": None})["decision"] = d
    return out


def plot_canary(data: ReportData) -> str | None:
    """Each canary: both arms' mean discounted returns and the always-valid bound on their
    difference over time, its decision marked (None: no canary in the metrics)."""
    series = canary_series(data)
    if not series:
        return None
    plt = _plt()
    t0 = _t0(data)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for v, s in sorted(series.items()):
        looks = s["looks"]
        decision = s["decision"]
        if decision is not None and _num(decision.get("decided")) is not None:
            looks = [
                *looks,
                {
                    "time": decision["decided"],
                    **{k: decision.get(k) for k in ("low", "high")},
                    "mean_canary": decision.get("mean_canary"),
                    "mean_deployed": decision.get("mean_deployed"),
                },
            ]
        ts = [(float(x["time"]) - t0) / 60 for x in looks]
        for key, style, label in (("mean_canary", "-", f"canary v{v}"), ("mean_deployed", "--", "deployed")):
            ys = [_num(x.get(key)) for x in looks]
            top.plot(ts, [y if y is not None else float("nan") for y in ys], style, marker=".", label=label)
        lows = [_num(x.get("low")) for x in looks]
        highs = [_num(x.get("high")) for x in looks]
        pts = [(t, lo, hi) for t, lo, hi in zip(ts, lows, highs) if lo is not None and hi is not None]
        if pts:
            bottom.fill_between(
                [p[0] for p in pts],
                [p[1] for p in pts],
                [p[2] for p in pts],
                alpha=0.3,
                label=f"v{v}: canary - deployed, always-valid bound",
            )
        if decision is not None and ts:
            word = "promoted" if decision.get("decision") == "promote" else "rolled back"
            bottom.axvline(ts[-1], color="tab:green" if word == "promoted" else "tab:red", linestyle=":")
            bottom.annotate(f"v{v} {word}", (ts[-1], 0), fontsize=7, rotation=90, va="bottom")
    bottom.axhline(0.0, color="black", linewidth=0.8)
    top.set_ylabel("mean discounted return")
    bottom.set_ylabel("canary - deployed")
    bottom.set_xlabel("minutes")
    top.legend(fontsize=7)
    bottom.legend(fontsize=7)
    top.grid(alpha=0.3)
    bottom.grid(alpha=0.3)
    return _png(fig)


def render_html(data: ReportData) -> str:
    """The report as one HTML document (no external resources)."""
    e = html.escape
    plots = {
        "eval": plot_eval(data),
        "returns": plot_returns(data),
        "freshness": plot_freshness(data),
        "shards": plot_shards(data),
        "dead-letters": plot_dead_letters(data),
    }
    rows = summary(data)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>rlrec report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>rlrec report</h1>",
        f'<p class="src">generated {_utc(time.time())} UTC · shards: {e(str(data.shards_uri or "–"))} · '
        f"trainer: {e(str(data.trainer_uri or '–'))}</p>",
        '<h2 id="summary">Summary</h2>',
        '<table id="summary-table">',
    ]
    parts += [f'<tr><th>{e(k)}</th><td class="v">{e(v)}</td></tr>' for k, v in rows]
    parts.append("</table>")
    for n in data.notes.get("summary", []):
        parts.append(f'<p class="note">{e(n)}</p>')
    parts += lineage_html(data)
    extra_notes = {
        "shards": ["shards", "episodes"],
        "returns": ["episodes"],
        "eval": ["trainer"],
        "freshness": ["trainer"],
    }
    for sid, title in SECTIONS:
        parts.append(f'<h2 id="{sid}">{e(title)}</h2>')
        img = plots[sid]
        if img is not None:
            parts.append(f'<img id="plot-{sid}" alt="{e(title)}" src="data:image/png;base64,{img}">')
        if sid == "eval" and (table := ope_table_html(data)) is not None:
            parts.append(table)
        if sid == "eval" and (canary := plot_canary(data)) is not None:
            parts.append(
                f'<img id="plot-canary" alt="canary rollout: both arms and the bound" src="data:image/png;base64,{canary}">'
            )
        seen: set[str] = set()
        for key in [sid, *extra_notes.get(sid, [])]:
            for n in data.notes.get(key, []):
                if n not in seen:
                    seen.add(n)
                    parts.append(f'<p class="note">{e(n)}</p>')
        if img is None and not seen:
            parts.append('<p class="note">no data for this section</p>')
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(
    data_dir: str | os.PathLike | None,
    out: str | os.PathLike | None = None,
    *,
    input_uri: str | None = None,
    checkpoint_dir: str | None = None,
    bootstrap_servers: str | None = None,
    dlq_topic: str | None = None,
    policies: str | None = None,
    public_key: str | None = None,
) -> Path:
    """Write the HTML report and return its path.

    `data_dir`: a demo data dir (demo.json, shards/, trainer/, metrics.jsonl) or a shards root;
    `out` defaults to ``{data_dir}/report.html`` for a demo data dir, else ``./report.html``.
    Each section degrades to a note when its data is absent; this never fails for missing data.
    """
    data = collect(
        data_dir,
        input_uri=input_uri,
        checkpoint_dir=checkpoint_dir,
        bootstrap_servers=bootstrap_servers,
        dlq_topic=dlq_topic,
        policies=policies,
        public_key=public_key,
    )
    if out is None:
        out = os.path.join(data.demo_dir, "report.html") if data.demo_dir else "report.html"
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(render_html(data), encoding="utf-8")
    os.replace(tmp, path)
    return path
