"""Markdown configuration reference generated from the ``rlrec`` argparse parsers.

:func:`render` walks every registered subcommand (nested ones such as ``topics create``
too) and writes one table per command: option, default, help, plus, for a command whose
options are declared once (an :class:`rlrec.options.OptionSet` set as its parser's ``options``
default: every command), the ``RLREC_*`` environment variable and
config-file key of each option, from the same declaration.  docs/CONFIG.md
is this output; ``tests/test_config_reference.py`` fails when the file is stale.

The output depends only on the parsers, never on the environment: ``RLREC_*`` variables
(some commands take defaults from them) are hidden while the parser is built, and no
terminal-width dependent argparse formatting is used.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

__all__ = ["REFRESH_COMMAND", "render"]

#: The command that rewrites docs/CONFIG.md (quoted in the file and in the staleness test).
REFRESH_COMMAND = "rlrec config-reference --file docs/CONFIG.md"


@contextlib.contextmanager
def _without_rlrec_env() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith("RLREC_")}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """(name, parser) of each subcommand, in registration order, aliases left out."""
    out: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    out.append((name, sub))
    return out


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _expand_help(action: argparse.Action, prog: str) -> str:
    if not action.help:
        return ""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = prog
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    try:
        return action.help % params
    except (KeyError, TypeError, ValueError):
        return action.help


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if isinstance(action, argparse._StoreTrueAction) else "on"
    if action.required:
        return "**required**"
    d = action.default
    if d is None or d is argparse.SUPPRESS or d == []:
        return ""
    return f"`{d}`"


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}` (positional)"
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or (
        action.dest.upper() if action.choices is None else "{" + ",".join(map(str, action.choices)) + "}"
    )
    return f"{names} {metavar}"


def _sources(sub: argparse.ArgumentParser) -> dict[str, tuple[str, str, str, str]] | None:
    """``--flag`` -> (default, env var, config-file key, help) of a command whose options are
    declared once (an :class:`rlrec.options.OptionSet` in its parser's defaults); None otherwise."""
    options = sub.get_default("options")
    if options is None:
        return None
    out = {}
    for opt in options.options.values():
        shown = opt.shown_default()
        default = "**required**" if opt.required else "" if shown is None else f"`{shown}`"
        if opt.positional:  # the command line only
            env = key = ""
        elif opt.kind is bool:  # --flag/--no-flag on the command line, 1/0 in the environment
            default = shown or ""
            env, key = f"`{opt.env}={0 if opt.default else 1}`", f"`{opt.key}`"
        elif opt.kind is dict:
            env, key = f"`{opt.env}` (JSON object)", f"`{opt.key}` (a table)"
        elif opt.kind is list:
            env, key = f"`{opt.env}` (comma-separated)", f"`{opt.key}` (an array)"
        else:
            env, key = f"`{opt.env}`", f"`{opt.key}`"
        help_ = opt.help
        if opt.choices:
            help_ += f" (one of {', '.join(map(str, opt.choices))})"
        if opt.kind in (dict, list):
            help_ += " (repeatable)"
        out[opt.name if opt.positional else opt.flag] = (default, env, key, help_)
    return out


def _description(sub: argparse.ArgumentParser) -> list[str]:
    text = (sub.description or "").strip("\n")
    if not text:
        return []
    if issubclass(sub.formatter_class, argparse.RawDescriptionHelpFormatter):
        return ["```text", text.rstrip(), "```", ""]
    return [" ".join(text.split()), ""]


def _command_section(path: list[str], sub: argparse.ArgumentParser, help_: str) -> list[str]:
    name = " ".join(path)
    lines = [f"{'#' * min(len(path) + 1, 4)} `rlrec {name}`", ""]
    if help_:
        lines += [_cell(help_).rstrip(".") + ".", ""]
    lines += _description(sub)
    sources = _sources(sub)
    rows = []
    for action in sub._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help is argparse.SUPPRESS:
            continue
        help_text = _cell(_expand_help(action, sub.prog))
        if isinstance(action, argparse._AppendAction) and "repeatable" not in help_text:
            help_text += " (repeatable)"
        default = _default(action)
        if sources is not None:
            opt = action.option_strings[0] if action.option_strings else action.dest
            default, env, key, help_text = sources.get(opt, (default, "", "", help_text))
            rows.append(f"| {_flag(action)} | {default} | {env} | {key} | {_cell(help_text)} |")
        else:
            rows.append(f"| {_flag(action)} | {default} | {help_text} |")
    if rows:
        if sources is not None:
            lines += ["| option | default | environment | config-file key | description |", "|---|---|---|---|---|"]
        else:
            lines += ["| option | default | description |", "|---|---|---|"]
        lines += [*rows, ""]
    for child, child_parser in _subcommands(sub):
        lines += _command_section([*path, child], child_parser, _help_of(sub, child))
    return lines


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _anchor(path: str) -> str:
    return "rlrec-" + path.replace(" ", "-")


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole reference as Markdown (deterministic for a given set of command modules)."""
    if parser is None:
        from rlrec.cli import build_parser

        with _without_rlrec_env():
            parser = build_parser()
    commands = _subcommands(parser)
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the CLI's argparse parsers by `{REFRESH_COMMAND}`. Do not edit by hand:",
        "     tests/test_config_reference.py fails when this file is stale. -->",
        "",
        "Every `rlrec` subcommand with its options, defaults and help, generated from the parsers the",
        "CLI itself uses. Every command declares its options once (dataclass fields) and reads each",
        "option (positional arguments aside) also from an `RLREC_<OPTION>` environment variable or a",
        "`--config` file (TOML by its `.toml` suffix, else JSON; keys are the long option names, with",
        "dashes or underscores); precedence: command line, then environment, then config file, then defaults.",
        "A config-file key that is no option of the command, or an `RLREC_*` variable that is no option",
        "of any of them, is an error naming the nearest valid one; another command's `RLREC_*` options",
        "are ignored (an option both have, such as `RLREC_METRICS_PORT`, applies to both). Booleans are",
        "`--flag`/`--no-flag`, `1`/`0` in the environment, and may be negated as a key",
        "(`no-create-topics = true`, `RLREC_NO_CREATE_TOPICS=1`).",
        "S3 endpoint and credentials always come from the standard AWS environment (`AWS_ENDPOINT_URL`,",
        "`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`), never from options.",
        "",
        "Commands: " + " · ".join(f"[{name}](#{_anchor(name)})" for name, _ in commands),
        "",
    ]
    for name, sub in commands:
        out += _command_section([name], sub, _help_of(parser, name))
    return "\n".join(out).rstrip("\n") + "\n"
