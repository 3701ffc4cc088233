"""``rlrec inspect``: committed shards and totals from the manifest; ``--verify`` checks them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from rlrec.commands._common import (
    AS_OF_HELP,
    open_output,
    parse_as_of,
    plain_console,
    reports_storage_errors,
    require_manifest,
)
from rlrec.options import OptionSet, option


@dataclass
class InspectOptions:
    """Options of `rlrec inspect`."""

    uri: str = option(positional=True, metavar="URI", help="output root: /path, file:///path, s3://bucket/prefix, ...")
    json: bool = option(False, help="print only a JSON document on stdout")
    verify: bool = option(False, help="verify shards; exit 1 on any problem (or when URI holds no rlrec manifest)")
    paths: bool = option(
        False,
        help="print only the committed shards' paths (URIs), one a line, from the manifest, each episode in "
        "exactly one (a compacted shard by its replacement): the input for plain directory readers",
    )
    as_of: str | None = option(None, metavar="POINT", help="with --paths: " + AS_OF_HELP)
    policies: str | None = option(
        None,
        metavar="URI",
        help="a publish root (e.g. {checkpoint-dir}/policies): show each published version's lineage "
        "cursor (the manifest point of the data it was trained on)",
    )
    policy_version: int | None = option(
        None,
        metavar="N",
        help="with --paths and --policies: the shards published version N was trained on (at its lineage cursor)",
    )
    public_key: str | None = option(
        None,
        metavar="PATH",
        help="with --policies: the trainer's Ed25519 public key (PEM) that signed the versions "
        "(default: $RLREC_POLICY_PUBLIC_KEY)",
    )
    allow_unsigned: bool = option(False, help="with --policy-version: accept an unsigned version")
    delta: bool = option(
        False,
        help="print each policy's Delta view (rlrec export --to delta): policy, Delta version and the rlrec "
        "cursor it mirrors (from its txns), one a line",
    )
    delta_version: int | None = option(None, metavar="V", help="with --delta: Delta version V instead of the newest")


#: the options of `rlrec inspect`
OPTIONS = OptionSet("inspect", InspectOptions)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="show committed shards and totals (from the manifest); --verify checks files",
        description="Read the manifest under URI and show its committed shards and totals. "
        "With --verify, check every shard (exists, size, sha256, duplicate episode ids, the schema "
        "gate's allow-list of columns and Arrow types, decode) and exit 1 if anything is wrong. "
        "A URI without an rlrec manifest is an error (exit 1) that names a child folder holding one. "
        "With --paths, print only the committed shards' paths, one a line (--as-of: at a point of "
        "the manifest): give that list, not the policy directory, to a plain directory reader "
        "(docs/GUARANTEES.md, 'As-of reads').",
    )
    OPTIONS.add_arguments(p)
    p.set_defaults(func=run, options=OPTIONS)


def _decode_check(notes: list[str]):
    """A decode callback built on rlrec.store.shards, or None if that is not importable.

    Every shard passes the schema gate first (`rlrec.store.schema_gate`: a refused
    shard is a problem with the reason, nothing of it is read); "episodes" shards are
    decoded with ``read_episodes`` (every episode unpacked safely); "tabular" shards
    are counted from their ``eps_id`` column; other formats are not checked (the
    callback returns None).
    """
    try:
        from rlrec.store.shards import read_episodes, read_tabular
    except Exception as e:  # not available / missing optional deps
        notes.append(f"decode checks skipped: rlrec.store.shards is not importable ({e})")
        return None

    def check(data: bytes, entry) -> tuple[int, int] | None:
        if entry.format == "episodes":
            episodes = read_episodes(data)
            return len(episodes), sum(len(ep) for ep in episodes)
        if entry.format == "tabular":
            ids = read_tabular(data, columns=["eps_id"]).column("eps_id")
            return len(set(ids.to_pylist())), len(ids)
        return None

    return check


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _verified(tot: dict) -> str:
    """What verification covered, e.g. ``62 shards, 1,234 episodes, 45,678 steps, 3.1 MiB``."""

    def n(count: int, word: str) -> str:
        return f"{count:,} {word}" + ("" if count == 1 else "s")

    return (
        f"{n(tot['shards'], 'shard')}, {n(tot['episodes'], 'episode')}, {n(tot['steps'], 'step')}, "
        f"{_human_bytes(tot['bytes'])} ({tot['bytes']:,} bytes)"
    )


def _print_propensities(console, counts: dict) -> None:
    """The table of steps without a behaviour propensity per policy version (off-policy
    evaluation needs ``action_logp`` at every step), and the shards whose entry does not say."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    rows = [(pid, v, n) for pid, per in counts["by_policy"].items() for v, n in per.items()]
    if rows:
        t = Table(title="steps without a propensity (action_logp)", box=box.SIMPLE_HEAD)
        for col in ("policy", "version", "steps"):
            t.add_column(col, justify="left" if col == "policy" else "right")
        for pid, v, n in rows:
            t.add_row(Text(pid), Text(str(v)), Text(f"{n:,}", style="yellow") if n else "0")
        console.print(t)
    unknown = counts["unknown"]
    if unknown["shards"]:
        console.print(
            f"steps without a propensity: unknown for {unknown['shards']:,} shard(s) ({unknown['steps']:,} steps) "
            "committed before the count was kept",
            highlight=False,
        )


def _print_lineages(console, rows: list[dict], policies: str) -> None:
    """The table of published versions and the manifest cursor of the data each was trained on."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    if not rows:
        console.print(f"no policy version is published under {policies}", highlight=False)
        return
    t = Table(title=f"lineage of the versions under {policies}", box=box.SIMPLE_HEAD)
    for col in ("version", "verified", "shards", "held out", "cursor (rlrec export --policy-version N)"):
        t.add_column(col, justify="right" if col in ("version", "shards", "held out") else "left")
    for r in rows:
        signed = "?" if r["signed"] is None else ("yes" if r["signed"] else "no")
        cursor = r["cursor"] or (Text(r["error"], style="red") if r["error"] else "not recorded")
        held = "–" if r["holdout_fraction"] is None else f"{r['holdout_fraction']:g}"
        if isinstance(cursor, str):  # stored text, never Rich markup
            cursor = Text(cursor)
        t.add_row(str(r["policy_version"]), signed, str(r["shards"] if r["shards"] is not None else "–"), held, cursor)
    console.print(t)


def _no_shards_yet(storage) -> str:
    """What a store with a manifest but no committed shard is waiting for."""
    from rlrec.store.manifest import PartitionLog, list_partition_logs

    logs = list_partition_logs(storage)
    if not logs:
        return "no shard committed yet, and no partition claimed: no consumer has started on this --output"
    claims = [e for key in logs for e in PartitionLog(storage, *key).load() if not hasattr(e, "episodes")]
    last = max((getattr(e, "time", 0.0) for e in claims), default=0.0)
    import time

    ago = f", the last {max(0.0, time.time() - last):,.0f} s ago" if last else ""
    return (
        f"no shard committed yet: {len(logs):,} partition(s) claimed{ago}; a consumer commits a partition's "
        "first shard after --max-file-age-s (60 s by default) or once a shard is full"
    )


def _print_delta_views(storage, version: int | None) -> int:
    """``--delta``: each view's version and the cursor it mirrors (`rlrec.delta_view.version_cursor`)."""
    from rlrec.errors import RuntimeFailure, UsageError

    try:
        import deltalake  # noqa: F401

        from rlrec.delta_view import ViewError, list_views, version_cursor
    except ImportError:
        raise UsageError("--delta needs the deltalake package: pip install 'rlrec[delta]'") from None
    views = list_views(storage)
    if not views:
        raise RuntimeFailure(f"no Delta view in {storage.uri('')} (rlrec export URI URI --to delta)")
    for policy in views:
        try:
            v, cursor = version_cursor(storage, policy, version)
        except ViewError as e:
            raise RuntimeFailure(str(e)) from None
        print(f"{policy}\t{v}\t{cursor}")
    return 0


@reports_storage_errors("inspect")
def run(args: argparse.Namespace) -> int:
    import json

    opts = OPTIONS.build(InspectOptions, OPTIONS.resolve(args))  # OptionError: one line, exit 2
    import sys
    from datetime import datetime, timezone

    from rlrec.logs import cli_logging

    cli_logging()
    from rlrec.store.maintenance import episode_summary, inspect, verify
    from rlrec.store.manifest import read_manifest

    storage = open_output(opts.uri)
    require_manifest(storage, opts.uri)
    from rlrec.errors import UsageError

    for flag, given in (("--as-of", opts.as_of is not None), ("--policy-version", opts.policy_version is not None)):
        if given and not opts.paths:
            raise UsageError(f"{flag} needs --paths")
    if opts.delta_version is not None and not opts.delta:
        raise UsageError("--delta-version needs --delta")
    if opts.delta:
        return _print_delta_views(storage, opts.delta_version)
    if opts.paths:
        from rlrec.reading import open as open_store

        if opts.policy_version is None:
            snap = open_store(storage, as_of=parse_as_of(opts.as_of))
        elif opts.as_of is not None:
            raise UsageError("give --as-of or --policy-version, not both")
        elif not opts.policies:
            raise UsageError("--policy-version needs --policies URI (the publish root)")
        else:
            snap = open_store(
                storage,
                policy_version=opts.policy_version,
                policies=opts.policies,
                public_key=opts.public_key,
                allow_unsigned=opts.allow_unsigned,
            )
        for path in snap.files():
            print(path)
        held = (
            f" (selection {snap.selection}; whole shards: they hold its held-out episodes too, and a "
            "merged shard the episodes merged into it from shards the version did not train on)"
            if opts.policy_version is not None
            else ""
        )
        print(f"rlrec inspect: {len(snap.entries)} shard(s) at {snap.cursor}{held}", file=sys.stderr)
        return 0
    doc = inspect(storage)
    lineages = None
    if opts.policies:
        from rlrec.trainer.lineage import list_lineages

        open_output(opts.policies, "--policies")  # UsageError (exit 2): not a URI
        lineages = list_lineages(opts.policies, public_key=opts.public_key)
        doc["lineage"] = lineages
    notes: list[str] = []
    try:
        summary = episode_summary(storage, read_manifest(storage)) if doc["shards"] else None
    except Exception as e:
        summary = None
        notes.append(f"episode summary skipped: {e}")
    if summary is not None:
        doc["episode_summary"] = summary
    problems: list[str] | None = None
    verified: dict[str, Any] = {}  # what verify checked: the head as the history says
    if opts.verify:
        problems = verify(storage, decode_check=_decode_check(notes), totals=verified)
        doc["problems"] = problems

    for n in notes:
        print(f"rlrec inspect: {n}", file=sys.stderr)
    if opts.json:
        if problems is not None:
            doc["verified"] = {k: verified[k] for k in ("shards", "episodes", "steps", "bytes")}
        json.dump(doc, sys.stdout, indent=2, sort_keys=False)
        sys.stdout.write("\n")
        return 1 if problems else 0

    from rich import box
    from rich.table import Table
    from rich.text import Text

    console = plain_console()  # manifest strings are data, never markup
    root = storage.uri("")
    topics = sorted({s["topic"] for s in doc["shards"]})
    one_topic = len(topics) == 1
    title = f"committed shards in {root}" + (f", topic {topics[0]}" if one_topic else "")
    if not doc["shards"]:
        console.print(_no_shards_yet(storage))
    rows = [
        (
            s["policy_id"],
            str(s["partition"]) if one_topic else f"{s['topic']}/{s['partition']}",
            f"{s['first_offset']}-{s['last_offset']}",  # Kafka offsets: positions, printed as Kafka's tools do
            f"{s['episodes']:,}",
            f"{s['steps']:,}",
            _human_bytes(s["bytes"]),
            datetime.fromtimestamp(s["commit_time"], tz=timezone.utc).strftime("%m-%d %H:%M:%S"),
        )
        for s in doc["shards"]
    ]
    table = Table(title=title, caption="file paths: --paths; everything: --json", box=box.SIMPLE_HEAD, padding=(0, 1))
    headers = [
        "policy",
        "part" if one_topic else "topic/part",
        "offsets",
        "episodes",
        "steps",
        "bytes",
        "committed (UTC)",
    ]
    for i, col in enumerate(headers):
        if i == 0:  # policy ids may shorten (an ellipsis); numbers never do: their columns keep their width
            table.add_column(col, overflow="ellipsis", max_width=24, min_width=6)
        else:
            widest = max([len(col), *(len(r[i]) for r in rows)])
            table.add_column(col, justify="left" if i == 6 else "right", no_wrap=True, min_width=widest)
    for r in rows:
        table.add_row(Text(r[0]), *r[1:])
    if rows:
        console.print(table)

    tot = doc["totals"]
    totals = Table(title="totals", box=box.SIMPLE_HEAD)
    for col in ("policy", "shards", "episodes", "steps", "bytes"):
        totals.add_column(col, justify="left" if col == "policy" else "right")
    for pid, t in tot["policies"].items():
        totals.add_row(Text(pid), f"{t['shards']:,}", f"{t['episodes']:,}", f"{t['steps']:,}", _human_bytes(t["bytes"]))
    totals.add_row(
        Text("all", style="bold"),
        f"{tot['shards']:,}",
        f"{tot['episodes']:,}",
        f"{tot['steps']:,}",
        _human_bytes(tot["bytes"]),
    )
    console.print(totals)

    _print_propensities(console, doc["steps_without_logp"])
    if lineages is not None:
        _print_lineages(console, lineages, opts.policies)

    if summary:
        st = Table(title="episodes (from shard columns)", box=box.SIMPLE_HEAD)
        for col in ("column", "count", "mean", "min", "max"):
            st.add_column(col, justify="left" if col == "column" else "right")
        for c, v in summary.items():
            st.add_row(Text(c), f"{v['count']:,}", f"{v['mean']:,.3f}", f"{v['min']:,g}", f"{v['max']:,g}")
        console.print(st)

    if problems is not None:
        if problems:
            console.print(Text(f"{len(problems)} problem(s):", style="bold red"))
            for p in problems:
                console.print(f"  - {p}")
            return 1
        if not verified["shards"]:
            console.print("verify: nothing to verify: no shard is committed yet")
        else:
            console.print(Text.assemble(("verify: no problems", "green"), f" in {_verified(verified)}"))
    return 0
