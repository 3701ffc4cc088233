"""The demo's numbers and how they are shown.

`Collector.snapshot()` gathers one `Snapshot` per refresh: steps published (the policy processes'
status lines), episodes/shards committed and dead letters (the consumer's Prometheus endpoint),
trainer iteration, timesteps, newest-shard age, evaluation return, the newest off-policy
estimate of a candidate beside its true discounted return, promotions (the trainer's
metrics.jsonl). `Dashboard` shows snapshots: a rich Live table on a terminal, else one compact
line every few seconds. Each snapshot is also one line of demo-data/metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Collector", "Dashboard", "Snapshot", "TrainerTail", "scrape_consumer"]


@dataclass
class Snapshot:
    """One refresh; `to_record()` is the demo metrics.jsonl line (docs: briefs/layout.md)."""

    time: float
    elapsed_s: float
    steps_published: int = 0
    steps_per_s: float = 0.0
    episodes_committed: int = 0
    shards_committed: int = 0
    dead_letters: dict = field(default_factory=dict)
    trainer_iteration: int | None = None
    timesteps_trained: int | None = None
    newest_shard_age_s: float | None = None
    eval_return_mean: float | None = None
    policy_version: int | None = None  # newest deployed version a policy process acts with (not a canary)
    policy_versions_in_use: list = field(default_factory=list)
    published_version: int | None = None  # newest version the trainer published
    deployed_return: float | None = None  # evaluation return of the published version
    promotions: int = 0
    rejections: int = 0
    #: the newest off-policy evaluation of a candidate (`latest_ope`), None before the first
    ope: dict | None = None
    #: the running canary's last look, or the last canary's decision (`TrainerTail.canary`)
    canary: dict | None = None
    policies: list = field(default_factory=list)  # per process: index, policy_version, steps, return_mean

    def to_record(self) -> dict:
        d = asdict(self)
        d["time"] = round(d["time"], 3)
        d["elapsed_s"] = round(d["elapsed_s"], 2)
        d["steps_per_s"] = round(d["steps_per_s"], 1)
        return d


def scrape_consumer(port: int, timeout: float = 1.0) -> dict | None:
    """episodes/shards committed and dead letters by reason from the consumer's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return None
    out: dict[str, Any] = {"episodes": 0, "shards": 0, "dead_letters": {}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "rlrec_episodes_committed_total":
                out["episodes"] = int(s.value)
            elif s.name == "rlrec_shards_committed_total":
                out["shards"] = int(s.value)
            elif s.name == "rlrec_dead_letters_total":
                out["dead_letters"][s.labels.get("reason", "?")] = int(s.value)
    return out


def latest_ope(rec: dict) -> dict | None:
    """The off-policy evaluation a trainer metrics line carries (an ope gate decision or an
    ``--ope-report`` estimate), as the dashboard shows it; None if it carries none.

    Args:
        rec: one line of the trainer's metrics.jsonl.

    Example:
        >>> est = {"value": 41.0, "ci_low": 37.5, "ci_high": 44.0, "estimable": True, "reason": ""}
        >>> latest_ope({"ope_report": {"candidate_version": 3, "estimator": "wdr", "candidate_estimate": est,
        ...                            "true_return": 43.2}})
        {'version': 3, 'estimator': 'wdr', 'value': 41.0, 'ci_low': 37.5, 'ci_high': 44.0, 'true_return': 43.2, 'reason': ''}
    """
    p = rec.get("promotion")
    if not (isinstance(p, dict) and p.get("gate") == "ope"):
        p = rec.get("ope_report")
    if not isinstance(p, dict):
        return None
    est = p.get("candidate_estimate") if isinstance(p.get("candidate_estimate"), dict) else {}
    return {
        "version": p.get("candidate_version"),
        "estimator": p.get("estimator"),
        "value": est.get("value"),
        "ci_low": est.get("ci_low"),
        "ci_high": est.get("ci_high"),
        "true_return": p.get("true_return"),
        "reason": str(p.get("reason") or est.get("reason") or ""),
    }


def ope_text(ope: dict | None) -> str:
    """`latest_ope` as one line: ``v3 wdr 41.0 [37.5, 44.0]  true 43.2`` (discounted returns).

    Args:
        ope: what `latest_ope` returned.

    Example:
        >>> ope_text({"version": 3, "estimator": "wdr", "value": 41.0, "ci_low": 37.5, "ci_high": 44.0,
        ...           "true_return": 43.2, "reason": ""})
        'v3 wdr 41.0 [37.5, 44.0]  true 43.2'
        >>> ope_text({"version": 4, "estimator": "wis", "value": None, "true_return": 40.0, "reason": "support"})
        'v4 wis not estimable (support)  true 40.0'
    """
    if not ope:
        return "-"
    if ope.get("value") is None:
        est = f"not estimable ({ope.get('reason') or '?'})"
    else:
        est = f"{ope['value']:.1f}"
        if ope.get("ci_low") is not None and ope.get("ci_high") is not None:
            est += f" [{ope['ci_low']:.1f}, {ope['ci_high']:.1f}]"
    true = f"  true {ope['true_return']:.1f}" if ope.get("true_return") is not None else ""
    return f"v{ope.get('version')} {ope.get('estimator')} {est}{true}"


class TrainerTail:
    """Follows the trainer's metrics.jsonl (complete lines only)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pos = 0
        self._partial = b""
        self.last: dict | None = None
        self.eval_return: float | None = None
        self.published_version: int | None = None
        self.deployed_return: float | None = None
        self.promotions = self.rejections = 0
        self.ope: dict | None = None
        self.canary: dict | None = None

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._pos:  # restarted (truncated)
                    self._pos, self._partial = 0, b""
                f.seek(self._pos)
                data = f.read()
                self._pos = f.tell()
        except FileNotFoundError:
            return []
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        new = []
        for ln in lines:
            try:
                rec = json.loads(ln)
            except ValueError:
                continue
            new.append(rec)
            self.last = rec
            if rec.get("eval_return_mean") is not None:
                self.eval_return = float(rec["eval_return_mean"])
            if rec.get("policy_version"):
                self.published_version = int(rec["policy_version"])
            ope = latest_ope(rec)
            if ope is not None:
                self.ope = ope
            self._follow_canary(rec)
            promo = rec.get("promotion")
            if promo:
                if promo.get("promoted"):
                    self.promotions += 1
                    self.deployed_return = float(promo["candidate_return"])
                else:
                    self.rejections += 1
        return new

    def _follow_canary(self, rec: dict) -> None:
        """The canary of a trainer line: its look (``canary_look``) while it runs, its decision
        (``canary``) once taken (`canary_text` shows either)."""
        look, decided = rec.get("canary_look"), rec.get("canary")
        if isinstance(decided, dict) and isinstance(decided.get("canary_version"), int):
            self.canary = {
                "version": decided["canary_version"],
                "base_version": decided.get("base_version"),
                "n_canary": decided.get("episodes_canary"),
                "n_deployed": decided.get("episodes_deployed"),
                "mean_canary": decided.get("mean_canary"),
                "mean_deployed": decided.get("mean_deployed"),
                "low": decided.get("low"),
                "high": decided.get("high"),
                "decision": decided.get("decision"),
                "deployed_version": decided.get("deployed_version"),
            }
        elif isinstance(look, dict) and isinstance(rec.get("canary_version"), int):
            self.canary = {"version": rec["canary_version"], "base_version": rec.get("deployed_version"), **look}
            self.canary["decision"] = None


def canary_text(c: dict | None) -> str:
    """The canary as the dashboard shows it: both arms' mean discounted returns (episodes), the
    always-valid bound on canary - deployed, and the decision.

    Args:
        c: `TrainerTail.canary` (None: no canary yet).

    Example:
        >>> canary_text({"version": 3, "base_version": 2, "n_canary": 40, "n_deployed": 70, "mean_canary": 51.0,
        ...              "mean_deployed": 33.25, "low": 2.5, "high": 30.0, "decision": "promote", "deployed_version": 3})
        'v3 51.0 (40 ep) vs v2 33.2 (70 ep), bound [2.5, 30.0]: promoted, v3 deployed'
    """
    if c is None:
        return "-"
    base = c.get("base_version")
    arms = (
        f"v{c['version']} {_f(c.get('mean_canary'))} ({_f(c.get('n_canary'), '{}', '0')} ep) vs "
        f"{version_name(base)} {_f(c.get('mean_deployed'))} ({_f(c.get('n_deployed'), '{}', '0')} ep), "
        f"bound [{_f(c.get('low'))}, {_f(c.get('high'))}]"
    )
    decision = c.get("decision")
    if decision is None:
        return f"{arms}: testing"
    done = {"promote": "promoted", "rollback": "rolled back"}.get(decision, decision)
    return f"{arms}: {done}, {version_name(c.get('deployed_version'))} deployed"


class Collector:
    """Builds snapshots from the policy processes, the consumer and the trainer."""

    def __init__(self, policies: list, consumer_port: int | None, trainer_metrics: str) -> None:
        self.policies = policies  # processes.Child with .status
        self.consumer_port = consumer_port
        self.trainer = TrainerTail(trainer_metrics)
        self.t0 = time.time()
        self._consumer = {"episodes": 0, "shards": 0, "dead_letters": {}}
        self._rate: list[tuple[float, int]] = []

    def snapshot(self) -> Snapshot:
        now = time.time()
        if self.consumer_port is not None:
            got = scrape_consumer(self.consumer_port)
            if got is not None:  # keep the last numbers once the consumer is gone
                self._consumer = got
        self.trainer.poll()
        st = [p.status for p in self.policies if p.status]
        steps = sum(int(s.get("steps", 0)) for s in st)
        self._rate.append((now, steps))
        while len(self._rate) > 2 and now - self._rate[0][0] > 5.0:
            self._rate.pop(0)
        t_old, s_old = self._rate[0]
        rate = (steps - s_old) / (now - t_old) if now > t_old else 0.0
        deployed = sorted({int(s["policy_version"]) for s in st if s.get("policy_version") is not None})
        versions = sorted({*deployed, *(int(s["canary_version"]) for s in st if s.get("canary_version") is not None)})
        last = self.trainer.last or {}
        return Snapshot(
            time=now,
            elapsed_s=now - self.t0,
            steps_published=steps,
            steps_per_s=rate,
            episodes_committed=self._consumer["episodes"],
            shards_committed=self._consumer["shards"],
            dead_letters=dict(self._consumer["dead_letters"]),
            trainer_iteration=last.get("iteration"),
            timesteps_trained=last.get("timesteps_trained"),
            newest_shard_age_s=last.get("newest_shard_age_s"),
            eval_return_mean=self.trainer.eval_return,
            policy_version=deployed[-1] if deployed else None,
            policy_versions_in_use=versions,
            published_version=self.trainer.published_version,
            deployed_return=self.trainer.deployed_return,
            promotions=self.trainer.promotions,
            rejections=self.trainer.rejections,
            ope=self.trainer.ope,
            canary=self.trainer.canary,
            policies=[
                {
                    "index": s.get("index"),
                    "policy_version": s.get("policy_version"),
                    "canary_version": s.get("canary_version"),
                    "steps": s.get("steps"),
                    "episodes": s.get("episodes"),
                    "return_mean": s.get("return_mean"),
                }
                for s in st
            ],
        )


def _f(x: Any, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if x is None else fmt.format(x)


def version_name(v: int | None) -> str:
    """A policy version as the dashboard names it: ``v0 (scripted expert)`` for version 0 (or
    none published yet), ``v3`` otherwise.

    Args:
        v: the policy version.

    Example:
        >>> version_name(0), version_name(3)
        ('v0 (scripted expert)', 'v3')
    """
    return f"v{v}" if v else "v0 (scripted expert)"


def compact_line(s: Snapshot) -> str:
    dl = sum(s.dead_letters.values())
    return (
        f"[{s.elapsed_s:5.0f}s] steps {s.steps_published:,} ({s.steps_per_s:,.0f}/s)  "
        f"episodes {s.episodes_committed:,}  shards {s.shards_committed:,}  dead letters {dl:,}  "
        f"iter {_f(s.trainer_iteration, '{}')}  trained {_f(s.timesteps_trained, '{:,}')}  "
        f"newest shard {_f(s.newest_shard_age_s, '{:.1f}s')}  eval {_f(s.eval_return_mean)}  "
        f"published {version_name(s.published_version)}  acting {s.policy_versions_in_use}"
        + (f"  ope {ope_text(s.ope)}" if s.ope is not None else "")
        + (f"  canary {canary_text(s.canary)}" if s.canary is not None else "")
    )


class Dashboard:
    """rich Live on a terminal; otherwise a compact line every `line_every_s` seconds."""

    def __init__(self, title: str, live: bool, line_every_s: float = 5.0) -> None:
        self.title = title
        self.live = None
        self.line_every_s = line_every_s
        self._last_line = 0.0
        self.note = ""
        if live:
            from rich.live import Live

            from rlrec.commands._common import plain_console

            # messages and metric labels are data: printed literally, never as markup
            self.live = Live(console=plain_console(), refresh_per_second=2, transient=False)

    def __enter__(self) -> Dashboard:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def say(self, msg: str) -> None:
        """A message above the dashboard (or a plain line)."""
        if self.live is not None:
            self.live.console.print(msg)
        else:
            print(msg, flush=True)

    def show(self, s: Snapshot) -> None:
        if self.live is not None:
            self.live.update(self._table(s))
        elif time.time() - self._last_line >= self.line_every_s:
            self._last_line = time.time()
            print(compact_line(s), flush=True)

    def _table(self, s: Snapshot):
        """The dashboard table: labels styled here, every value a literal Text."""
        from rich.table import Table
        from rich.text import Text

        title = Text.assemble(self.title, (f"  {s.elapsed_s:.0f} s", "dim"))
        t = Table(title=title, show_header=False, min_width=64)
        t.add_column("what", style="cyan")
        t.add_column("value", justify="right")
        dl = ", ".join(f"{k} {v}" for k, v in sorted(s.dead_letters.items())) or "0"
        rows = [
            (("policies", " steps published"), f"{s.steps_published:,}  ({s.steps_per_s:,.0f}/s)"),
            ("  acting with policy versions", ", ".join(f"v{v}" for v in s.policy_versions_in_use) or "-"),
            (("consumer", " episodes committed"), f"{s.episodes_committed:,}"),
            ("  shards committed", f"{s.shards_committed:,}"),
            ("  dead letters", dl),
            (("trainer", " iteration"), _f(s.trainer_iteration, "{}")),
            ("  timesteps trained", _f(s.timesteps_trained, "{:,}")),
            ("  newest shard age", _f(s.newest_shard_age_s, "{:.1f} s")),
            ("  evaluation return", _f(s.eval_return_mean)),
            (
                "  published policy version",
                f"{version_name(s.published_version)}  (return {_f(s.deployed_return)}; "
                f"{s.promotions} promoted, {s.rejections} held back)",
            ),
        ]
        if s.ope is not None:  # discounted returns: not comparable with the evaluation return above
            rows.append(("  off-policy estimate (discounted)", ope_text(s.ope)))
        if s.canary is not None:  # discounted returns of both arms, the bound on their difference
            rows.append(("  canary (discounted returns)", canary_text(s.canary)))
        for label, value in rows:
            if isinstance(label, tuple):
                label = Text.assemble((label[0], "bold"), label[1])
            t.add_row(Text(label) if isinstance(label, str) else label, Text(value))
        for p in s.policies:
            t.add_row(
                Text(f"  policy-{p['index']}"),
                Text(
                    f"v{p['policy_version']}"
                    + (f" + canary v{p['canary_version']}" if p.get("canary_version") else "")
                    + f"  {p['episodes']} episodes  return {_f(p['return_mean'])}"
                ),
            )
        if self.note:
            t.caption = Text(self.note)
        return t


def write_line(path: str, s: Snapshot) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(s.to_record()) + "\n")
