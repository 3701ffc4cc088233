"""``rlrec`` command line.

Each subcommand lives in a *command module* exposing::

    def register(subparsers: argparse._SubParsersAction) -> None:
        p = subparsers.add_parser("name", help="...")
        p.add_argument(...)
        p.set_defaults(func=_run)      # _run(args) -> int | None (exit code)

Command modules are imported every time ``rlrec`` runs, so at module level they
may import only the standard library: import heavy things (ray, torch, pyarrow,
confluent_kafka, ...) inside the handler.  ``rlrec --help`` must stay fast and
must never import ray.

Modules are found in two ways: the names in :data:`COMMAND_MODULES` (the help
order), then every other module in the ``rlrec.commands`` package (modules whose
name starts with ``_`` are helpers, not commands).  To add a command, drop a file
into ``rlrec/commands/``; no change here is needed.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import typing
from collections.abc import Sequence

#: Command modules listed first in the help, in this order.
COMMAND_MODULES: list[str] = [
    "rlrec.commands.broker",
    "rlrec.commands.topics",
    "rlrec.commands.demo",
    "rlrec.commands.record_demo",
    "rlrec.commands.consume",
    "rlrec.commands.train",
]


def _discovered() -> list[str]:
    import rlrec.commands as pkg

    return sorted(f"{pkg.__name__}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def _load(name: str):
    try:
        return importlib.import_module(name)
    except Exception as e:  # a broken command must not take the others down
        print(f"rlrec: warning: command module {name} failed to import: {e!r}", file=sys.stderr)
        return None


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors follow the error contract: one line
    ``PROG: error: MESSAGE (see PROG --help)``, exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rlrec",
        allow_abbrev=False,
        description="Event-sourced recorder of RL experience: Kafka transitions -> RLlib episode shards -> trainer.",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error (also accepted after the command)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    seen: set[str] = set()
    for name in [*COMMAND_MODULES, *_discovered()]:
        if name in seen:
            continue
        seen.add(name)
        mod = _load(name)
        register = getattr(mod, "register", None) if mod is not None else None
        if register is None:
            continue
        try:
            register(subparsers)
        except Exception as e:  # e.g. two modules registering the same name
            print(f"rlrec: warning: command module {name} failed to register: {e!r}", file=sys.stderr)
    for p in _all_parsers(parser):  # `--max-second` is no `--max-seconds`: a typo, not an abbreviation
        p.allow_abbrev = False
    return parser


def _all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`parser` and every subcommand's parser below it."""
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                out += _all_parsers(sub)
    return out


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command `args` were parsed for (``rlrec topics create``'s)."""
    while True:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = None if action is None else action.choices.get(getattr(args, action.dest, None) or "")
        if chosen is None:
            return parser
        parser = chosen


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """The error for arguments `parser` does not take, with the nearest option of the command.

    Example:
        >>> p = argparse.ArgumentParser(prog="rlrec consume")
        >>> _ = p.add_argument("--output")
        >>> _unrecognized(p, ["--ouput", "x"])
        "unrecognized option '--ouput' (did you mean --output?)"
    """
    import difflib

    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    for extra in extras:
        if extra.startswith("--"):
            name = extra.partition("=")[0]
            near = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]}?)" if near else ""
            return f"unrecognized option {name!r}{hint}"
    return f"unrecognized arguments: {' '.join(extras)}"


def command_name(args: argparse.Namespace) -> str:
    """The command as typed after ``rlrec`` (``inspect``, ``topics create``), for error lines."""
    words = [args.command or ""]
    words += [str(v) for k, v in sorted(vars(args).items()) if k.endswith("_command") and isinstance(v, str)]
    return " ".join(w for w in words if w)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rlrec ARGV``; returns the exit code.

    Every error ends with one line ``rlrec COMMAND: error: ...`` on stderr and the exit code of
    :mod:`rlrec.errors` (2: usage or configuration, 1: a runtime failure); ``--debug`` (before
    or after the command) prints the traceback first.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = _command_parser(parser, args)
        sub.error(_unrecognized(sub, extras))
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        rc = func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from rlrec.errors import error_line, exit_code_for

        if debug:
            import traceback

            traceback.print_exc()
        print(error_line(command_name(args), e), file=sys.stderr)
        return exit_code_for(e)
    return int(rc or 0)


def run() -> int:
    """The ``rlrec`` program (the console script, ``python -m rlrec``): :func:`main` on
    ``sys.argv``, its exit code returned for ``sys.exit``; once torch was imported, the process
    ends here instead, through :func:`rlrec.process_exit.exit_process` (every Python exit hook
    runs, output is flushed, the exit code and an escaping exception's traceback are the same;
    the native teardown, where torch and pyarrow may abort, is skipped).

    Example:
        >>> import subprocess, sys
        >>> script = "import sys; from rlrec.cli import run; sys.argv = ['rlrec', '--help']; sys.exit(run())"
        >>> p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        >>> p.returncode, p.stdout.startswith("usage: rlrec")
        (0, True)
    """
    try:
        code = main()
    except BaseException as e:  # argparse's SystemExit (--help: 0, bad arguments: 2), or any other
        if "torch" not in sys.modules:
            raise
        from rlrec.process_exit import exit_uncaught

        exit_uncaught(e)  # the code and the traceback the interpreter would give
    if "torch" in sys.modules:
        from rlrec.process_exit import exit_process

        exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(run())
