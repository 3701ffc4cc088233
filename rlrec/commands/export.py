"""``rlrec export``: the steps of a store at a point of its manifest, as plain Parquet files."""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass

from rlrec.commands._common import AS_OF_HELP, parse_as_of, reports_storage_errors
from rlrec.options import OptionSet, option


@dataclass
class ExportOptions:
    """Options of `rlrec export`."""

    uri: str = option(
        positional=True, metavar="URI", help="output root of rlrec consume: /path, s3://bucket/prefix, ..."
    )
    dir: str = option(positional=True, metavar="DIR", help="where to write the files (a path or URI; empty or new)")
    to: typing.Literal["parquet"] = option(help="the file format written: one row per step, plain Arrow types")
    as_of: str | None = option(None, metavar="POINT", help=AS_OF_HELP)
    policy_version: int | None = option(
        None,
        metavar="N",
        help="instead of --as-of: the data published policy version N was trained on (its signed "
        "lineage's cursor; needs --policies)",
    )
    policies: str | None = option(
        None, metavar="URI", help="with --policy-version: the publish root (e.g. {checkpoint-dir}/policies)"
    )
    held_out: bool = option(False, help="with --policy-version: the episodes the version held out instead")
    public_key: str | None = option(
        None,
        metavar="PATH",
        help="with --policy-version: the trainer's Ed25519 public key (PEM) that signed the version "
        "(default: $RLREC_POLICY_PUBLIC_KEY)",
    )
    allow_unsigned: bool = option(False, help="with --policy-version: accept an unsigned version")
    run_id: str | None = option(
        None, metavar="ID", help="with --policy-version: only a version signed for this run (rlrec train logs its id)"
    )
    channel: str | None = option(
        None, metavar="NAME", help="with --policy-version: only a version signed for this channel"
    )


#: the options of `rlrec export`
OPTIONS = OptionSet("export", ExportOptions)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="write the steps at a point of the manifest as plain Parquet files (readable without rlrec)",
        description="Pin the store at URI to a point of its manifest (--as-of; default the newest), "
        "read its committed shards through the schema gate and write one row per step "
        "(episode_id, t, observation, action, reward, terminated, truncated, action_logp, "
        "policy_version, next_observation, policy_id; docs/FORMAT.md, 'Steps table') to DIR as "
        "steps-NNNNN.parquet, one file per shard. Prints the point's cursor on stdout: export "
        "again with --as-of CURSOR for the same data. With --policy-version N --policies URI: the "
        "data version N was trained on (--held-out: the episodes it held out), from its signed "
        "lineage; prints the options that export that data again (its cursor alone names the "
        "whole point, which holds more). See docs/TOOLS.md.",
    )
    OPTIONS.add_arguments(p)
    p.set_defaults(func=run, options=OPTIONS)


def _writer(table, schema_meta: dict[bytes, bytes]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = pa.BufferOutputStream()
    meta = dict(table.schema.metadata or {}) | schema_meta
    pq.write_table(table.replace_schema_metadata(meta), buf, compression="zstd")
    return buf.getvalue().to_pybytes()


def _snapshot(storage, opts: ExportOptions):
    """The snapshot to export: at --as-of, or a version's trained (or held-out) data."""
    from rlrec.errors import UsageError
    from rlrec.reading import open as open_store

    if opts.policy_version is None:
        # (--run-id / --channel may come from the environment a trainer runs in: ignored here)
        for flag, given in (("--policies", opts.policies), ("--held-out", opts.held_out)):
            if given:
                raise UsageError(f"{flag} needs --policy-version")
        return open_store(storage, as_of=parse_as_of(opts.as_of))
    if opts.as_of is not None:
        raise UsageError("give --as-of or --policy-version, not both")
    if not opts.policies:
        raise UsageError("--policy-version needs --policies URI (the publish root, e.g. {checkpoint-dir}/policies)")
    return open_store(
        storage,
        policy_version=opts.policy_version,
        policies=opts.policies,
        held_out=opts.held_out,
        public_key=opts.public_key,
        allow_unsigned=opts.allow_unsigned,
        run_id=opts.run_id,
        channel=opts.channel,
    )


@reports_storage_errors("export")
def run(args: argparse.Namespace) -> int:
    import sys

    opts = OPTIONS.build(ExportOptions, OPTIONS.resolve(args))  # OptionError: one line, exit 2
    from rlrec.logs import cli_logging

    cli_logging()
    from rlrec.commands._common import open_output, require_manifest
    from rlrec.errors import RuntimeFailure, UsageError
    from rlrec.store.snapshot import empty_steps

    storage = open_output(opts.uri)
    require_manifest(storage, opts.uri)
    out = open_output(opts.dir, "DIR")
    if out.exists("") and out.list(""):
        raise UsageError(f"DIR {opts.dir} is not empty: give a new or empty folder")
    snap = _snapshot(storage, opts)
    if opts.policy_version is None:
        again = snap.cursor
        meta = {b"rlrec.cursor": snap.cursor.encode()}
    else:  # a part of the point: the cursor alone would name all of it
        again = f"--policy-version {opts.policy_version} --policies {opts.policies}" + (
            " --held-out" if opts.held_out else ""
        )
        for flag, value in (("--run-id", opts.run_id), ("--channel", opts.channel)):
            if value is not None:
                again += f" {flag} {value}"
        meta = {
            b"rlrec.lineage": again.encode(),
            b"rlrec.lineage_cursor": str(snap.lineage.cursor).encode(),
            b"rlrec.read_cursor": snap.cursor.encode(),
            b"rlrec.selection": str(snap.selection).encode(),
        }
    files = steps = episodes = 0
    try:
        for table in snap.iter_steps():
            out.write(f"steps-{files:05d}.parquet", _writer(table, meta))
            files += 1
            steps += table.num_rows
            episodes += len(set(table.column("episode_id").to_pylist()))  # an episode is in one shard
        if not files:
            out.write("steps-00000.parquet", _writer(empty_steps(), meta))
            files = 1
    except ValueError as e:  # a shard the gate refuses, an undecodable episode, shards of different spaces
        raise RuntimeFailure(f"{e} ({files} file(s) written to {opts.dir} before it)") from None
    print(again)
    if snap.keep_episode is None:  # the manifest counts them (a filtered snapshot would read every shard again)
        episodes = snap.num_episodes
    print(
        f"rlrec export: wrote {steps:,} steps of {episodes:,} episodes from {len(snap.entries)} shard(s) "
        f"to {out.uri('')} ({files} file(s))",
        file=sys.stderr,
    )
    return 0
