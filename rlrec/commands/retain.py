"""``rlrec retain``: remove replaced and expired shard files after a grace period (retention)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rlrec.commands._common import reports_storage_errors, require_manifest
from rlrec.commands.gc import parse_duration
from rlrec.options import OptionSet, option


@dataclass
class RetainOptions:
    """Options of `rlrec retain`."""

    uri: str = option(positional=True, metavar="URI", help="output root: /path, file:///path, s3://bucket/prefix, ...")
    older_than: float | None = option(
        None,
        parse=parse_duration,
        metavar="DURATION",
        help="expire live shards all of whose episodes were first committed longer ago than this, e.g. 30d "
        "(default: expire nothing, remove only files compaction replaced); needs --policies or --no-lineage-pins; "
        "never taken from RLREC_OLDER_THAN (rlrec gc's grace period)",
    )
    grace: float = option(
        3600.0,
        parse=parse_duration,
        metavar="DURATION",
        help="how long removed files stay after retention records them (readers of older points, a lagging "
        "trainer), e.g. 1h; files are deleted by the first run after it",
    )
    policies: str | None = option(
        None,
        metavar="URI",
        help="the publish root the services load from (e.g. {checkpoint-dir}/policies): the data of its "
        "deployed version, of --keep-versions versions before it and of every newer one is kept",
    )
    keep_versions: int | None = option(
        None,
        metavar="N",
        help="with --policies: how many versions published before the deployed one stay reopenable (default 3)",
    )
    lineage_pins: bool = option(
        True,
        help="refuse --older-than without --policies (--no-lineage-pins: expire by age alone, even data a "
        "deployed version's lineage names)",
    )
    dry_run: bool = option(False, help="list what would be recorded and deleted, change nothing")


#: the options of `rlrec retain`
OPTIONS = OptionSet("retain", RetainOptions)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "retain",
        help="remove replaced and expired shard files after a grace period (retention)",
        description="Record in the store's removal log (_manifest/_removed/) every shard file compaction "
        "replaced and, with --older-than, every live shard whose episodes are all older than that, except "
        "the shards the deployed policy version and its rollback candidates need (--policies); then delete "
        "the files of every record older than --grace. Readers of a point before a removal get a clear "
        "'expired' error once its files are deleted; the newest point never fails. Safe to kill and re-run "
        "(docs/GUARANTEES.md, 'Retention').",
    )
    OPTIONS.add_arguments(p)
    p.set_defaults(func=run, options=OPTIONS)


def check(opts: RetainOptions) -> None:
    """UsageError (one line, exit 2) for options that contradict each other or are out of range."""
    from rlrec.errors import UsageError

    if opts.older_than is not None and opts.older_than <= 0:
        raise UsageError("--older-than must be more than 0 (e.g. 30d)")
    if opts.grace < 0:
        raise UsageError("--grace must be 0 or more")
    if opts.keep_versions is not None and opts.keep_versions < 0:
        raise UsageError("--keep-versions must be 0 or more")
    if opts.keep_versions is not None and not opts.policies:
        raise UsageError("--keep-versions needs --policies URI (the publish root whose versions it keeps)")
    if opts.policies and not opts.lineage_pins:
        raise UsageError("--policies and --no-lineage-pins contradict each other: give one")
    if opts.older_than is not None and opts.lineage_pins and not opts.policies:
        raise UsageError(
            "--older-than expires data a deployed policy version may need: give --policies URI (the publish "
            "root the services load from) or, to expire by age alone, --no-lineage-pins"
        )


@reports_storage_errors("retain")
def run(args: argparse.Namespace) -> int:
    import os
    import sys

    opts = OPTIONS.build(RetainOptions, OPTIONS.resolve(args))  # OptionError: one line, exit 2
    if getattr(args, "older_than", None) is None and os.environ.get("RLREC_OLDER_THAN"):
        from rlrec.errors import UsageError

        # RLREC_OLDER_THAN is also rlrec gc's grace period: it must never expire data by itself
        raise UsageError("give --older-than on the command line or in --config; RLREC_OLDER_THAN is not read here")
    check(opts)
    from rlrec.logs import cli_logging

    cli_logging()
    from rlrec.commands._common import open_output
    from rlrec.store.retention import retain

    storage = open_output(opts.uri)
    require_manifest(storage, opts.uri)
    pins = None
    if opts.policies:
        from rlrec.trainer.retention_pins import DEFAULT_KEEP_VERSIONS, lineage_pins

        keep = DEFAULT_KEEP_VERSIONS if opts.keep_versions is None else opts.keep_versions
        pins = lineage_pins(storage, opts.policies, keep)  # LineageError: exit 2
        print(
            f"rlrec retain: keeping the data of policy versions {', '.join(map(str, pins.versions.versions))} "
            f"(deployed: {pins.versions.deployed}): {pins.count} shard(s)",
            file=sys.stderr,
        )

    def pins_now():  # asked again right before the records and the deletes: a version published meanwhile pins
        now = lineage_pins(storage, opts.policies, keep)
        return now.paths, now.entries

    # pinned by shard entry: resolved to the shards holding them in the logs retain reads itself
    res = retain(
        storage,
        older_than_s=opts.older_than,
        grace_s=opts.grace,
        pinned=pins.paths if pins else (),
        pinned_entries=pins.entries if pins else None,
        pins=pins_now if pins else None,
        dry_run=opts.dry_run,
    )
    would = "would " if opts.dry_run else ""
    for f in res.recorded:
        print(f"{would}record {f.reason} {storage.uri(f.path)}")
    for p in res.deleted:
        print(f"{would}delete {storage.uri(p)}")
    print(
        f"rlrec retain: {would}record {len(res.recorded)} shard(s) as removed "
        f"({sum(f.reason == 'expired' for f in res.recorded)} expired, "
        f"{sum(f.reason == 'replaced' for f in res.recorded)} replaced) and {would}delete {len(res.deleted)} "
        f"file(s) of removals older than {opts.grace:g}s",
        file=sys.stderr,
    )
    return 0
