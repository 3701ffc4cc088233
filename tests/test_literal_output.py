"""Strings from data (manifest entries, paths, notes, metrics) are printed literally by every
command: never read as Rich markup (``[/]``, ``[link=...]``, ``[bold red]``) or ``:emoji:``
codes, and escaped in HTML. Manifest entries are forged as files, not through `PartitionLog`:
the recorder's policy-id check (`rlrec.producer.events.POLICY_ID_RE`) is not what protects the
readers -- the manifest reader refuses such an id itself, in one line that shows it as data."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from html import escape as html_escape
from pathlib import Path

import pytest

from rlrec.cli import main
from rlrec.producer.events import POLICY_ID_RE
from rlrec.store.manifest import PartitionLog
from rlrec.store.storage import Storage
from tests.test_storage_manifest import TOPIC, make_entry

#: policy ids no producer may send; a manifest written by anyone else can hold them
HOSTILE = ("[/]", "[link=http://x]click[/link]", "[bold red]:warning:")
BENIGN = ("p1", "p2", "p3")


def _forge(root: Path, policy_ids: tuple[str, ...]) -> Storage:
    """A committed manifest with one published shard per policy id (shard files under
    `{policy_id}/`), its entries written as files directly: `PartitionLog` refuses to append an
    entry whose policy id is not one (`check_shard_paths`), a forger need not use it."""
    from rlrec.store.manifest_entries import entry_path

    store = Storage.from_uri(str(root))
    log = PartitionLog(store, TOPIC, 0)
    log.claim("forger")
    seq, epoch = log.next_seq, log.epoch
    for i, pid in enumerate(policy_ids):
        entry, data = make_entry([f"e{i}"], first=10 * i, last=10 * i + 9)
        name = entry.path.rsplit("/", 1)[-1]
        safe = pid if POLICY_ID_RE.match(pid) else f"forged{i}"  # a hostile id names no folder
        entry = dataclasses.replace(
            entry, policy_id="p", path=f"{safe}/{name}", staging_path=f"{safe}/_staging/{name}", seq=seq, epoch=epoch
        )
        doc = {**entry.to_dict(), "policy_id": pid}
        store.write(entry.path, data)
        store.write(entry_path(TOPIC, 0, seq), json.dumps(doc).encode())
        seq += 1
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
    assert benign.err == "" and _totals_rows(benign.out) == [*BENIGN, "all"]
    if verify:
        assert benign.out.splitlines()[-1].startswith("verify: no problems in 3 shards, 3 episodes, 15 steps, ")
    # a policy id no producer may send is refused by the manifest reader: one line, the id as data
    _forge(tmp_path / "hostile", HOSTILE)
    assert main(["inspect", str(tmp_path / "hostile"), *flag]) == 2
    hostile = capsys.readouterr()
    assert hostile.out == "" and hostile.err.count("\n") == 1
    assert hostile.err.startswith("rlrec inspect: error: ManifestError: ")
    assert "not a valid policy id: '[/]'" in hostile.err


def test_inspect_json_refuses_hostile_policy_ids_in_one_line(tmp_path, capsys):
    _forge(tmp_path / "out", HOSTILE)
    assert main(["inspect", str(tmp_path / "out"), "--verify", "--json"]) == 2
    got = capsys.readouterr()
    assert got.out == "" and got.err.count("\n") == 1 and "'[/]'" in got.err


def test_inspect_verify_problems_and_a_hostile_root_are_literal(tmp_path, capsys, wide):
    """A root folder named like markup appears in the title as typed; a problem exits 1 as usual."""
    root = tmp_path / "[bold red]out[link=http://x]"
    store = _forge(root, BENIGN)
    entry = next(e for e in PartitionLog(store, TOPIC, 0).load() if getattr(e, "policy_id", None) == "p1")
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
    policies = ("a.b", "p-1", "p_2")  # hostile policy ids never pass the manifest reader
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
