"""Strings from data (manifest entries, paths, notes, metrics) are printed literally by every
command: never read as Rich markup (``[/]``, ``[link=...]``, ``[bold red]``) or ``:emoji:``
codes, and escaped in HTML. Manifest entries are forged directly: the recorder's policy-id check
(`rlrec.producer.events.POLICY_ID_RE`) is not what protects the readers."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from html import escape as html_escape
from pathlib import Path

import pytest

from rlrec.cli import main
from rlrec.store.manifest import PartitionLog
from rlrec.store.storage import Storage
from tests.test_storage_manifest import TOPIC, make_entry

#: policy ids no producer may send; a manifest written by anyone else can hold them
HOSTILE = ("[/]", "[link=http://x]click[/link]", "[bold red]:warning:")
BENIGN = ("p1", "p2", "p3")


def _forge(root: Path, policy_ids: tuple[str, ...]) -> Storage:
    """A committed manifest with one published shard per policy id (shard files under `pol/`)."""
    store = Storage.from_uri(str(root))
    log = PartitionLog(store, TOPIC, 0)
    log.claim("forger")
    for i, pid in enumerate(policy_ids):
        entry, data = make_entry([f"e{i}"], first=10 * i, last=10 * i + 9)
        entry = dataclasses.replace(entry, policy_id=pid)
        store.write(entry.staging_path, data)
        assert log.publish(log.append_shard(entry)) is True
    return store


def _totals_rows(out: str) -> list[str]:
    """The policy column of the totals table, as printed."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == "totals")
    rows = []
    for ln in lines[start + 4 :]:  # title, blank, header, rule
        if not ln.strip():
            break
        rows.append(re.split(r"\s{2,}", ln.strip())[0])
    return rows


@pytest.fixture
def wide(monkeypatch):
    """No wrapping: the tables are compared line by line."""
    monkeypatch.setenv("COLUMNS", "200")


@pytest.mark.parametrize("verify", [False, True])
def test_inspect_prints_hostile_policy_ids_literally(tmp_path, capsys, wide, verify):
    flag = ["--verify"] if verify else []
    _forge(tmp_path / "benign", BENIGN)
    assert main(["inspect", str(tmp_path / "benign"), *flag]) == 0
    benign = capsys.readouterr()
    _forge(tmp_path / "hostile", HOSTILE)
    assert main(["inspect", str(tmp_path / "hostile"), *flag]) == 0
    hostile = capsys.readouterr()
    assert hostile.err == benign.err == ""
    assert _totals_rows(benign.out) == [*BENIGN, "all"]
    assert _totals_rows(hostile.out) == [*sorted(HOSTILE), "all"]
    shard_rows = [ln.strip() for ln in hostile.out.splitlines() if ln.strip().startswith("[")]
    assert [r.split("  ")[0] for r in shard_rows[:3]] == ["[/]", "[link=http://x]click[/l…", "[bold red]:warning:"]
    if verify:
        assert hostile.out.splitlines()[-1].startswith("verify: no problems in 3 shards, 3 episodes, 15 steps, ")


def test_inspect_json_keeps_hostile_policy_ids(tmp_path, capsys):
    _forge(tmp_path / "out", HOSTILE)
    assert main(["inspect", str(tmp_path / "out"), "--verify", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["policy_id"] for s in doc["shards"]] == list(HOSTILE)
    assert list(doc["totals"]["policies"]) == sorted(HOSTILE)
    assert doc["problems"] == []


def test_inspect_verify_problems_and_a_hostile_root_are_literal(tmp_path, capsys, wide):
    """A root folder named like markup appears in the title as typed; a problem exits 1 as usual."""
    root = tmp_path / "[bold red]out[link=http://x]"
    store = _forge(root, HOSTILE)
    entry = next(e for e in PartitionLog(store, TOPIC, 0).load() if getattr(e, "policy_id", None) == "[/]")
    store.delete(entry.path)
    assert main(["inspect", str(root), "--verify"]) == 1
    out = capsys.readouterr().out
    squeezed = "".join(out.split())  # the title wraps at the table's width
    assert "".join(f"committed shards in {store.uri('')}, topic {TOPIC}".split()) in squeezed
    assert "[bold red]out[link=http:/x]" in str(root)
    assert "1 problem(s):" in out
    problems = [ln for ln in out.splitlines() if ln.startswith("  - ")]
    assert len(problems) == 1 and entry.path in problems[0]


def test_plain_console_keeps_markup_and_emoji_codes():
    from rlrec.commands._common import plain_console

    console = plain_console(file=io.StringIO(), width=200)
    for s in (*HOSTILE, "trailing backslash \\", "[/bold]"):
        console.print(s)
    assert console.file.getvalue().splitlines() == [*HOSTILE, "trailing backslash \\", "[/bold]"]


# ------------------------------------------------------------------------------------ dashboard


def _render(renderable) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_the_demo_dashboard_shows_process_and_metric_strings_literally(capsys):
    from rlrec.demo.dashboard import Dashboard, Snapshot

    board = Dashboard("[bold]demo[/] :warning:", live=False)
    board.note = "[link=http://x]click[/link]"
    snap = Snapshot(
        time=0.0,
        elapsed_s=3.0,
        dead_letters={"[/]": 2},
        policy_versions_in_use=["[bold red]"],
        policies=[{"index": "[/]", "policy_version": "[link=http://x]v[/link]", "episodes": 1, "return_mean": None}],
    )
    text = _render(board._table(snap))
    assert "[bold]demo[/] :warning:  3 s" in text
    assert "[/] 2" in text
    assert "v[bold red]" in text
    assert "policy-[/]" in text and "v[link=http://x]v[/link]  1 episodes" in text
    assert "[link=http://x]click[/link]" in text
    board.say("[/] logs in [bold]x[/bold]")
    assert capsys.readouterr().out == "[/] logs in [bold]x[/bold]\n"


def test_the_live_dashboard_says_messages_literally():
    from rlrec.demo.dashboard import Dashboard

    board = Dashboard("demo", live=True)
    board.live.console.file = io.StringIO()
    board.say("[/] stopping [link=http://x]x[/link] :warning:")
    assert board.live.console.file.getvalue() == "[/] stopping [link=http://x]x[/link] :warning:\n"


# --------------------------------------------------------------------------------------- report


def test_the_report_escapes_hostile_strings(tmp_path):
    from rlrec.report import write_report

    d = tmp_path / "demo-data"
    policies = ("<script>alert(1)</script>", "a&b", *HOSTILE)
    _forge(d / "shards", policies)
    (d / "demo.json").write_text(json.dumps({"started": 0, "shards_uri": str(d / "shards"), "policies": 1}))
    (d / "metrics.jsonl").write_text(
        json.dumps({"time": 1, "dead_letters": {"<img src=x onerror=alert(1)>": 1, "$\\frac$ ^_^": 2}}) + "\n"
    )
    html = write_report(d, tmp_path / "report.html").read_text()
    assert "<script>" not in html and "<img src=x" not in html
    summary = dict(re.findall(r"<tr><th>([^<]+)</th><td class=\"v\">([^<]*)</td></tr>", html))
    assert summary["policies"] == html_escape(", ".join(sorted(policies)))
    assert summary["dead letters"] == "3"
    assert 'id="plot-dead-letters"' in html  # a label that is not valid mathtext is still drawn


# -------------------------------------------------------------------------------------- convert


def test_convert_prints_its_output_path_literally(tmp_path, capsys, wide):
    from tests.test_convert import _episodes, _write_tabular

    _write_tabular(_episodes(), tmp_path / "in")
    out = tmp_path / "[/]" / "[link=http://x]out[/link]"
    argv = ["convert", "--from", "tabular", str(tmp_path / "in"), "--output", str(out), "--policy-id", "expert"]
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].endswith(f" inspect {out} --verify")
    assert printed[-1].startswith("check with: ")
    assert main(["inspect", str(out), "--verify"]) == 0
