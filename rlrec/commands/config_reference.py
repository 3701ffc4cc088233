"""``rlrec config-reference``: print or write the Markdown configuration reference (docs/CONFIG.md)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "config-reference",
        help="print the Markdown configuration reference of every rlrec command (docs/CONFIG.md)",
        description="Generate the configuration reference (every subcommand's options, defaults and help; "
        "for consume also its RLREC_* environment variables and config-file keys) from the CLI's own "
        "parsers. Without --output it goes to stdout.",
    )
    p.add_argument("--output", metavar="FILE", help="write it to FILE instead of stdout")
    p.add_argument(
        "--check",
        action="store_true",
        help="don't write: exit 1 if FILE (--output, default docs/CONFIG.md) differs from what would be generated",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from rlrec.reference import REFRESH_COMMAND, render

    text = render()
    if args.check:
        path = args.output or "docs/CONFIG.md"
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
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
