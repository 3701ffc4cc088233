"""``rlrec report``: a self-contained HTML report (plots) of a demo run or a deployment."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rlrec.options import OptionSet, option


@dataclass
class ReportOptions:
    """Options of `rlrec report`."""

    uri: str | None = option(
        None,
        positional=True,
        metavar="URI",
        help="demo data dir (default ./demo-data when --input is not given), or a shards root",
    )
    out: str | None = option(
        None, metavar="PATH", help="output HTML file (default: URI/report.html for a demo dir, else ./report.html)"
    )
    input: str | None = option(None, metavar="URI", help="shards root (local or s3://...), overrides the demo's")
    checkpoint_dir: str | None = option(None, metavar="URI", help="trainer checkpoint dir (holds metrics.jsonl)")
    bootstrap_servers: str | None = option(None, help="Kafka bootstrap servers: count dead letters from the DLQ topic")
    dlq_topic: str | None = option(None, help="dead-letter topic (default: the demo's, from demo.json)")
    policies: str | None = option(
        None,
        metavar="URI",
        help="publish root of the policy versions, whose lineage cursors the report shows "
        "(default: {checkpoint-dir}/policies)",
    )
    public_key: str | None = option(
        None,
        metavar="PATH",
        help="the trainer's Ed25519 public key (PEM) that signed the versions (default: $RLREC_POLICY_PUBLIC_KEY)",
    )


#: the options of `rlrec report`
OPTIONS = OptionSet("report", ReportOptions)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="write an HTML report: eval return, returns per policy version, freshness, shards, dead letters",
        description="Write one self-contained HTML file (plots embedded) about a demo data dir (default "
        "./demo-data: demo.json, shards/, trainer/, metrics.jsonl) or, with --input/--checkpoint-dir, about "
        "any deployment. Sections whose data is missing show a note instead. See docs/TOOLS.md.",
    )
    OPTIONS.add_arguments(p)
    p.set_defaults(func=run, options=OPTIONS)


def run(args: argparse.Namespace) -> int:
    import os
    import sys

    opts = OPTIONS.build(ReportOptions, OPTIONS.resolve(args))  # OptionError: one line, exit 2
    uri = opts.uri
    if uri is None and opts.input is None:
        uri = "demo-data"
    if uri is not None and "://" not in uri and not os.path.exists(uri):
        print(f"rlrec report: error: {uri} does not exist (give a demo data dir, or --input URI)", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("rlrec report: error: matplotlib is not installed (pip install 'rlrec[consumer]')", file=sys.stderr)
        return 2
    from rlrec.commands._common import open_output
    from rlrec.report import write_report

    for name, value in (
        ("URI", uri),
        ("--input", opts.input),
        ("--checkpoint-dir", opts.checkpoint_dir),
        ("--policies", opts.policies),
    ):
        if value is not None:
            open_output(value, name)  # UsageError (exit 2): not a URI
    try:
        path = write_report(
            uri,
            opts.out,
            input_uri=opts.input,
            checkpoint_dir=opts.checkpoint_dir,
            bootstrap_servers=opts.bootstrap_servers,
            dlq_topic=opts.dlq_topic,
            policies=opts.policies,
            public_key=opts.public_key,
        )
    except OSError as e:
        print(f"rlrec report: error: {e}", file=sys.stderr)
        return 2
    print(f"report written to {path}")
    return 0
