"""``rlrec report``: a self-contained HTML report (plots) of a demo run or a deployment."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="write an HTML report: eval return, returns per policy version, freshness, shards, dead letters",
        description="Write one self-contained HTML file (plots embedded) about a demo data dir (default "
        "./demo-data: demo.json, shards/, trainer/, metrics.jsonl) or, with --input/--checkpoint-dir, about "
        "any deployment. Sections whose data is missing show a note instead. See docs/TOOLS.md.",
    )
    p.add_argument(
        "uri",
        metavar="URI",
        nargs="?",
        default=None,
        help="demo data dir (default ./demo-data when --input is not given), or a shards root",
    )
    p.add_argument(
        "--out", metavar="PATH", help="output HTML file (default: URI/report.html for a demo dir, else ./report.html)"
    )
    p.add_argument("--input", metavar="URI", help="shards root (local or s3://...), overrides the demo's")
    p.add_argument("--checkpoint-dir", metavar="URI", help="trainer checkpoint dir (holds metrics.jsonl)")
    p.add_argument("--bootstrap-servers", help="Kafka bootstrap servers: count dead letters from the DLQ topic")
    p.add_argument("--dlq-topic", help="dead-letter topic (default: the demo's, from demo.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os
    import sys

    uri = args.uri
    if uri is None and args.input is None:
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

    for option, value in (("URI", uri), ("--input", args.input), ("--checkpoint-dir", args.checkpoint_dir)):
        if value is not None:
            open_output(value, option)  # UsageError (exit 2): not a URI
    try:
        path = write_report(
            uri,
            args.out,
            input_uri=args.input,
            checkpoint_dir=args.checkpoint_dir,
            bootstrap_servers=args.bootstrap_servers,
            dlq_topic=args.dlq_topic,
        )
    except OSError as e:
        print(f"rlrec report: error: {e}", file=sys.stderr)
        return 2
    print(f"report written to {path}")
    return 0
