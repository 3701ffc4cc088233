"""``rlrec gc``: delete shard files that no manifest entry references."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from rlrec.commands._common import reports_storage_errors, require_manifest
from rlrec.options import OptionSet, option

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``"90"``/``"90s"``, ``"15m"``, ``"1.5h"``, ``"2d"`` -> seconds; ValueError otherwise.

    Example:
        >>> parse_duration("1.5h")
        5400.0
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*", text.lower())
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 15m, 1h, 2d)")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass
class GCOptions:
    """Options of `rlrec gc`."""

    uri: str = option(positional=True, metavar="URI", help="output root: /path, file:///path, s3://bucket/prefix, ...")
    older_than: float = option(
        parse=parse_duration,
        metavar="DURATION",
        help="grace period, e.g. 90s, 15m, 1h, 2d; must exceed the longest commit",
    )
    dry_run: bool = option(False, help="list what would be deleted, delete nothing")


#: the options of `rlrec gc`
OPTIONS = OptionSet("gc", GCOptions)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "gc",
        help="delete unreferenced shard files (crashed/fenced writers' leftovers)",
        description="Delete files in policy directories and their _staging/ that no manifest "
        "entry names and that are older than --older-than (exit 1 when URI holds no rlrec "
        "manifest). A file an entry names (published or staged) is never deleted, whatever its age; neither is anything under _manifest/. Prints "
        "the deleted (or, with --dry-run, deletable) files.",
    )
    OPTIONS.add_arguments(p)
    p.set_defaults(func=run, options=OPTIONS)


@reports_storage_errors("gc")
def run(args: argparse.Namespace) -> int:
    import sys

    opts = OPTIONS.build(GCOptions, OPTIONS.resolve(args))  # OptionError: one line, exit 2
    from rlrec.logs import cli_logging

    cli_logging()
    from rlrec.commands._common import open_output
    from rlrec.store.maintenance import gc

    storage = open_output(opts.uri)
    # a root without a manifest is a mistaken URI: gc must not judge its files unreferenced
    require_manifest(storage, opts.uri)
    paths = gc(storage, opts.older_than, dry_run=opts.dry_run)
    for p in paths:
        print(storage.uri(p))
    verb = "would delete" if opts.dry_run else "deleted"
    print(f"rlrec gc: {verb} {len(paths)} file(s) older than {opts.older_than:g}s", file=sys.stderr)
    return 0
