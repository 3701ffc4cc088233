"""docs/CONFIG.md is generated from the CLI parsers and must not drift from them."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from rlrec.cli import build_parser
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


@pytest.mark.parametrize("command", ["consume", "train"])
def test_env_vars_and_keys_in_the_reference_are_the_ones_the_command_reads(command, tmp_path):
    text = render()
    start = text.index(f"`rlrec {command}`\n")
    section = text[start : text.index("\n## ", start)]
    args = build_parser().parse_args([command])
    options = args.options
    for opt in options.options.values():
        row = section.split(f"`{opt.flag}`", 1)[1].split("\n", 1)[0]
        if opt.kind is bool:  # --flag/--no-flag: documented as VAR=1 (VAR=0 when on), default on/off
            assert f"`{opt.env}={0 if opt.default else 1}`" in row and f"| {'on' if opt.default else 'off'} |" in row, (
                opt.name
            )
            for value, expected in (("1", True), ("true", True), ("0", False)):
                assert options.resolve(args, environ={opt.env: value})[opt.name] is expected, opt.env
            continue
        assert f"`{opt.env}`" in row, opt.env
        assert f"`{opt.key}`" in row, opt.key
        if opt.kind is dict:
            assert options.resolve(args, environ={opt.env: '{"k": "v"}'})[opt.name]["k"] == "v"
            continue
        value = (opt.choices or ("7",))[-1] if opt.kind is not str or opt.choices else "from-env"
        assert options.resolve(args, environ={opt.env: value})[opt.name] == opt.convert(value, ""), opt.env
        path = tmp_path / "c.json"
        path.write_text(f'{{"{opt.key}": "{value}"}}')
        assert options.resolve_values({}, {}, str(path))[opt.name] == opt.convert(value, ""), opt.key
        if opt.shown_default() is not None:
            assert f"| `{opt.shown_default()}` |" in row, opt.name


def test_the_reference_does_not_depend_on_the_environment(monkeypatch):
    clean = render()
    monkeypatch.setenv("RLREC_BOOTSTRAP_SERVERS", "somewhere:9092")
    monkeypatch.setenv("COLUMNS", "37")
    assert render() == clean


def test_check_mode_says_how_to_refresh(tmp_path):
    stale = tmp_path / "CONFIG.md"
    stale.write_text("# old\n")
    cmd = [sys.executable, "-m", "rlrec", "config-reference", "--check", "--file", str(stale)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1 and REFRESH_COMMAND in r.stderr, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "rlrec", "config-reference", "--file", str(stale)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert stale.read_text() == render()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
