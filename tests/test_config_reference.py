"""docs/CONFIG.md is generated from the CLI parsers and must not drift from them."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from rlrec.cli import build_parser
from rlrec.commands.consume import OPTIONS, _env, flag, resolve_options
from rlrec.reference import REFRESH_COMMAND, _subcommands, render

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "CONFIG.md"


def test_docs_config_md_is_up_to_date():
    current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    if current != render():
        pytest.fail(
            f"docs/CONFIG.md is stale (an option, default or help text changed): refresh it with "
            f"`{REFRESH_COMMAND}` (or `.venv/bin/{REFRESH_COMMAND}`) and commit it"
        )


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for name, sub in _subcommands(parser):
        yield (*path, name), sub
        yield from _walk(sub, (*path, name))


def test_every_command_and_option_is_in_the_reference():
    text = render()
    for path, sub in _walk(build_parser()):
        section_start = text.index(f"`rlrec {' '.join(path)}`\n")
        section = text[section_start:]
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = action.option_strings[-1] if action.option_strings else (action.metavar or action.dest.upper())
            assert f"`{name}`" in section, f"rlrec {' '.join(path)}: {name} missing from the reference"


def test_consume_env_vars_in_the_reference_are_the_ones_resolve_options_reads():
    text = render()
    section = text[text.index("`rlrec consume`\n") : text.index("`rlrec train`\n")]
    args = build_parser().parse_args(["consume"])
    for name, typ, default, _ in OPTIONS:
        var = f"RLREC_{_env(name)}"
        row = section.split(f"`--{name}`", 1)[1].split("\n", 1)[0]
        if typ is flag:  # on/off options: documented as VAR=1, default on/off
            assert f"`{var}=1`" in row and f"| {'on' if default else 'off'} |" in row, name
            for value, expected in (("1", True), ("true", True), ("0", False)):
                assert resolve_options(args, environ={var: value})[name.replace("-", "_")] is expected, var
            continue
        assert f"`{var}`" in section, var
        value = "7" if typ in (int, float) else "from-env"
        assert resolve_options(args, environ={var: value})[name.replace("-", "_")] == typ(value), var
        if default is not None:
            assert f"| `{default}` |" in row, name
    assert resolve_options(args, environ={"RLREC_NO_CREATE_TOPICS": "1"})["create_topics"] is False
    assert "`RLREC_NO_CREATE_TOPICS=1`" in section


def test_the_reference_does_not_depend_on_the_environment(monkeypatch):
    clean = render()
    monkeypatch.setenv("RLREC_BOOTSTRAP_SERVERS", "somewhere:9092")
    monkeypatch.setenv("COLUMNS", "37")
    assert render() == clean


def test_check_mode_says_how_to_refresh(tmp_path):
    stale = tmp_path / "CONFIG.md"
    stale.write_text("# old\n")
    cmd = [sys.executable, "-m", "rlrec", "config-reference", "--check", "--output", str(stale)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1 and REFRESH_COMMAND in r.stderr, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "rlrec", "config-reference", "--output", str(stale)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert stale.read_text() == render()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
