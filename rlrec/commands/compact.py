"""``rlrec compact``: merge small committed shards of partitions no live consumer owns."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rlrec.commands._common import reports_storage_errors, require_manifest
from rlrec.commands.gc import parse_duration
from rlrec.options import OptionSet, option

_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2, "g": 1024**3, "gib": 1024**3}


def parse_size(text: str) -> int:
    """``"1048576"``, ``"512k"``, ``"128MiB"``, ``"1g"`` -> bytes (powers of 1024); ValueError otherwise.

    Example:
        >>> parse_size("128MiB"), parse_size("512k"), parse_size("100")
        (134217728, 524288, 100)
    """
    import re

    m = re.fullmatch(r"\s*(\d+)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _SIZE_UNITS or int(m.group(1)) < 1:
        raise ValueError(f"not a size: {text!r} (use e.g. 134217728, 512k, 128MiB, 1g)")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


@dataclass
class CompactOptions:
    """Options of `rlrec compact`."""

    uri: str = option(positional=True, metavar="URI", help="output root: /path, file:///path, s3://bucket/prefix, ...")
    policy: str | None = option(None, metavar="POLICY_ID", help="compact only this policy's shards (default: all)")
    target_bytes: int = option(
        128 * 1024 * 1024,
        parse=parse_size,
        metavar="SIZE",
        help="a merged shard's size at most, e.g. 128MiB (shards this size or larger are left alone)",
    )
    min_age: float = option(
        600.0,
        parse=parse_duration,
        metavar="DURATION",
        help="merge only shards committed at least this long ago, e.g. 600, 10m, 1h",
    )
    force: bool = option(
        False,
        help="also compact partitions without a live owner lease that a consumer wrote to within the lease "
        "time (60 s): only when no consumer of an rlrec without owner leases can be running them",
    )


#: the options of `rlrec compact`
OPTIONS = OptionSet("compact", CompactOptions)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compact",
        help="merge small committed shards into large ones (no data change), for partitions no consumer runs",
        description="Merge runs of small committed shards of each partition under URI into shards of up to "
        "--target-bytes, episodes never split, committed in the manifest as 'these files replace those' "
        "(create-once, crash-safe; a re-run is idempotent). A partition a live consumer owns (its owner "
        "lease is fresh by the clock, or is renewed while watched for up to a lease time) is left alone -- that consumer compacts it itself with rlrec consume "
        "--compact-after -- and named in one error line (exit 1), and so is one without a lease that a consumer "
        "wrote to within the lease time (an older rlrec keeps no lease) unless --force. The replaced files stay until retention: "
        "a plain directory reader sees both; give it rlrec inspect --paths instead (docs/GUARANTEES.md).",
    )
    OPTIONS.add_arguments(p)
    p.set_defaults(func=run, options=OPTIONS)


@reports_storage_errors("compact")
def run(args: argparse.Namespace) -> int:
    import sys

    opts = OPTIONS.build(CompactOptions, OPTIONS.resolve(args))  # OptionError: one line, exit 2
    from rlrec.logs import cli_logging

    cli_logging()
    from rlrec.commands._common import open_output
    from rlrec.errors import RuntimeFailure
    from rlrec.store.compaction import compact_unowned

    storage = open_output(opts.uri)
    require_manifest(storage, opts.uri)
    from rlrec.consumer.summary import human_bytes
    from rlrec.store.manifest import list_partition_logs

    print(
        f"rlrec compact: {len(list_partition_logs(storage)):,} partition log(s) under {opts.uri}: checking their "
        "owner leases (one that looks expired is watched up to 60 s for a renewal), then merging",
        file=sys.stderr,
        flush=True,
    )
    results, refused = compact_unowned(
        storage, target_bytes=opts.target_bytes, min_age_s=opts.min_age, policy_id=opts.policy, force=opts.force
    )
    for r in results:
        skipped = f"; {len(r.skipped)} run(s) left alone" if r.skipped else ""
        print(
            f"{r.topic}/{r.partition:05d}: replaced {r.replaced:,} shard(s) ({human_bytes(r.bytes_before)}) "
            f"with {r.written:,} ({human_bytes(r.bytes_after)}){skipped}"
        )
        for s in r.skipped:
            print(f"rlrec compact: warning: {r.topic}/{r.partition:05d}: {s}", file=sys.stderr)
    if refused:
        raise RuntimeFailure(
            f"{len(refused)} partition(s) not compacted: {'; '.join(refused)} "
            "(a live consumer compacts its own partitions: rlrec consume --compact-after)"
        )
    return 0
