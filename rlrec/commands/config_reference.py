"""``rlrec config-reference``: print or write the Markdown configuration reference (docs/CONFIG.md)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rlrec.options import OptionSet, option


@dataclass
class ConfigReferenceOptions:
    """Options of `rlrec config-reference`."""

    file: str | None = option(None, metavar="FILE", help="write it to FILE instead of stdout")
    check: bool = option(
        False, help="don't write: exit 1 if FILE (--file, default docs/CONFIG.md) differs from what would be generated"
    )


#: the options of `rlrec config-reference`
OPTIONS = OptionSet("config-reference", ConfigReferenceOptions)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "config-reference",
        help="print the Markdown configuration reference of every rlrec command (docs/CONFIG.md)",
        description="Generate the configuration reference (every subcommand's options, defaults, help, "
        "RLREC_* environment variables and config-file keys) from the CLI's own parsers. Without --file "
        "it goes to stdout.",
    )
    OPTIONS.add_arguments(p)
    p.set_defaults(func=run, options=OPTIONS)


def run(args: argparse.Namespace) -> int:
    import sys

    from rlrec.reference import REFRESH_COMMAND, render

    opts = OPTIONS.build(ConfigReferenceOptions, OPTIONS.resolve(args))  # OptionError: one line, exit 2
    text = render()
    if opts.check:
        path = opts.file or "docs/CONFIG.md"
        try:
            with open(path, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            print(f"rlrec config-reference: {path} is stale; refresh it with: {REFRESH_COMMAND}", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    if opts.file:
        with open(opts.file, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {opts.file}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
