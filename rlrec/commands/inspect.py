"""``rlrec inspect``: committed shards and totals from the manifest; ``--verify`` checks them."""

from __future__ import annotations

import argparse

from rlrec.commands._common import reports_storage_errors


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="show committed shards and totals (from the manifest); --verify checks files",
        description="Read the manifest under URI and show its committed shards and totals. "
        "With --verify, check every shard (exists, size, sha256, duplicate episode ids, the schema "
        "gate's allow-list of columns and Arrow types, decode) and exit 1 if anything is wrong.",
    )
    p.add_argument("uri", metavar="URI", help="output root: /path, file:///path, s3://bucket/prefix, ...")
    p.add_argument("--json", action="store_true", help="print only a JSON document on stdout")
    p.add_argument("--verify", action="store_true", help="verify shards; exit 1 on any problem")
    p.set_defaults(func=run)


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


@reports_storage_errors("inspect")
def run(args: argparse.Namespace) -> int:
    import json
    import logging
    import sys
    from datetime import datetime, timezone

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    from rlrec.store.maintenance import episode_summary, inspect, verify
    from rlrec.store.manifest import read_manifest
    from rlrec.store.storage import Storage

    storage = Storage.from_uri(args.uri)
    doc = inspect(storage)
    notes: list[str] = []
    try:
        summary = episode_summary(storage, read_manifest(storage)) if doc["shards"] else None
    except Exception as e:
        summary = None
        notes.append(f"episode summary skipped: {e}")
    if summary is not None:
        doc["episode_summary"] = summary
    problems: list[str] | None = None
    if args.verify:
        problems = verify(storage, decode_check=_decode_check(notes))
        doc["problems"] = problems

    for n in notes:
        print(f"rlrec inspect: {n}", file=sys.stderr)
    if args.json:
        json.dump(doc, sys.stdout, indent=2, sort_keys=False)
        sys.stdout.write("\n")
        return 1 if problems else 0

    from rich.console import Console
    from rich.table import Table

    console = Console()
    root = storage.uri("")
    table = Table(title=f"committed shards in {root}")
    for col, kw in [
        ("policy", {}),
        ("topic/part", {}),
        ("offsets", {"justify": "right", "no_wrap": True}),
        ("episodes", {"justify": "right"}),
        ("steps", {"justify": "right"}),
        ("bytes", {"justify": "right", "no_wrap": True}),
        ("committed (UTC)", {"no_wrap": True}),
        ("file", {"overflow": "fold"}),
    ]:
        table.add_column(col, **kw)
    for s in doc["shards"]:
        t = datetime.fromtimestamp(s["commit_time"], tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        name = s["path"].split("?", 1)[0].rsplit("/", 1)[-1]
        table.add_row(
            s["policy_id"],
            f"{s['topic']}/{s['partition']}",
            f"{s['first_offset']}-{s['last_offset']}",
            str(s["episodes"]),
            str(s["steps"]),
            _human_bytes(s["bytes"]),
            t,
            name,
        )
    console.print(table)

    tot = doc["totals"]
    totals = Table(title="totals")
    for col in ("policy", "shards", "episodes", "steps", "bytes"):
        totals.add_column(col, justify="left" if col == "policy" else "right")
    for pid, t in tot["policies"].items():
        totals.add_row(pid, str(t["shards"]), str(t["episodes"]), str(t["steps"]), _human_bytes(t["bytes"]))
    totals.add_row(
        "[bold]all[/bold]", str(tot["shards"]), str(tot["episodes"]), str(tot["steps"]), _human_bytes(tot["bytes"])
    )
    console.print(totals)

    if summary:
        st = Table(title="episodes (from shard columns)")
        for col in ("column", "count", "mean", "min", "max"):
            st.add_column(col, justify="left" if col == "column" else "right")
        for c, v in summary.items():
            st.add_row(c, str(v["count"]), f"{v['mean']:.3f}", f"{v['min']:g}", f"{v['max']:g}")
        console.print(st)

    if problems is not None:
        if problems:
            console.print(f"[bold red]{len(problems)} problem(s):[/bold red]")
            for p in problems:
                console.print(f"  - {p}", markup=False, highlight=False)
            return 1
        console.print("[green]verify: no problems[/green]")
    return 0
