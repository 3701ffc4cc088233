"""``rlrec export``: the steps of a store at a point of its manifest, as plain Parquet files, or the
store as a read-only Delta Lake view (``--to delta``, `rlrec.delta_view`)."""

from __future__ import annotations

import argparse
import math
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
    dir: str = option(
        positional=True,
        metavar="DIR",
        help="where to write the files (a path or URI; empty or new); with --to delta: the store itself "
        "(URI again), whose policy directories hold the views",
    )
    to: typing.Literal["parquet", "delta"] = option(
        help="parquet: one row per step, plain Arrow types; delta: a read-only Delta Lake view per policy "
        "referencing the store's shards (needs the delta extra; docs/DELTA.md)"
    )
    follow: bool = option(False, help="with --to delta: keep the views up to date until SIGINT/SIGTERM")
    interval: float = option(1.0, metavar="S", help="with --follow: seconds between polls of the manifest")
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
        "whole point, which holds more). See docs/TOOLS.md. With --to delta (DIR = URI): a read-only "
        "Delta Lake view per policy at URI/POLICY_ID/_delta_log, one commit per manifest entry, no data "
        "copied; --follow keeps it up to date. See docs/DELTA.md.",
    )
    OPTIONS.add_arguments(p)
    p.set_defaults(func=run, options=OPTIONS)


def _export_delta(opts: ExportOptions) -> int:
    """``--to delta``: bring each policy's Delta view up to the point (docs/DELTA.md)."""
    import sys

    from rlrec.commands._common import open_output, require_manifest
    from rlrec.errors import RuntimeFailure, UsageError

    if opts.follow and opts.as_of is not None:
        raise UsageError("give --follow or --as-of, not both (a view follows the newest point)")
    if opts.policy_version is not None:
        raise UsageError("--policy-version is not available with --to delta (a view mirrors whole points)")
    if not (math.isfinite(opts.interval) and opts.interval > 0):
        raise UsageError(f"--interval must be a finite number > 0, got {opts.interval}")
    storage = open_output(opts.uri)
    require_manifest(storage, opts.uri)
    target = open_output(opts.dir, "DIR")
    policy = None
    if target.uri("") != storage.uri(""):
        parent, _, name = target.uri("").rstrip("/").rpartition("/")
        if parent != storage.uri("").rstrip("/") or name.startswith(("_", ".")):
            raise UsageError(
                f"DIR {opts.dir}: a Delta view lives in the store (give URI again, or URI/POLICY_ID for one "
                "policy): Delta readers (delta-rs) resolve a file path only below the table's folder"
            )
        policy = name
    try:
        import deltalake  # noqa: F401
    except ImportError:
        raise UsageError("--to delta needs the deltalake package: pip install 'rlrec[delta]'") from None
    from rlrec.delta_view import ViewError, export_views, follow_views
    from rlrec.store.schema_gate import ShardSchemaError

    def report(results) -> None:
        for r in results:
            if r.commits or not opts.follow:
                print(f"{r.uri}\t{r.version}\t{r.cursor}", flush=True)
            for n, what in ((r.waiting, "wait for publication"), (r.skipped, "of another format skipped")):
                if n:
                    print(f"rlrec export: {r.policy_id}: {n} shard(s) {what}", file=sys.stderr)

    try:
        if not opts.follow:
            results = export_views(storage, as_of=parse_as_of(opts.as_of), policy_id=policy)
            report(results)
            print(
                f"rlrec export: {sum(r.commits for r in results)} Delta commit(s) to {len(results)} view(s)",
                file=sys.stderr,
            )
            return 0
        from rlrec.commands._signals import StopSignals

        stopping = []
        signals = StopSignals(lambda: stopping.append(1)).install()
        try:
            follow_views(
                storage, interval_s=opts.interval, policy_id=policy, stop=lambda: bool(stopping), on_poll=report
            )
        finally:
            signals.restore()
        return signals.exit_code(0)
    except (ViewError, ShardSchemaError) as e:
        raise RuntimeFailure(str(e)) from None


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
    if opts.to == "delta":
        return _export_delta(opts)
    if opts.follow:
        from rlrec.errors import UsageError

        raise UsageError("--follow needs --to delta")
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
