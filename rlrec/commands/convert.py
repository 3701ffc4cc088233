"""``rlrec convert``: legacy RLlib recordings (tabular Parquet, SampleBatch JSON) -> episode shards."""

from __future__ import annotations

import argparse

from rlrec.commands._common import reports_storage_errors


def _kv(text: str) -> tuple[str, str]:
    key, sep, col = text.partition("=")
    if not sep or not key or not col:
        raise argparse.ArgumentTypeError(f"expected KEY=COLUMN, got {text!r}")
    return key.strip(), col.strip()


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert legacy RLlib recordings (tabular Parquet, SampleBatch JSON) into episode shards",
        description="Read RLlib tabular recordings (Parquet, one row per step) or old-stack SampleBatch "
        "JSON lines, rebuild episodes (rows grouped by eps_id, ordered by t; terminated and truncated "
        "kept apart) and commit them as episode shards with a manifest under --output, exactly like "
        "the consumer does. Re-running into the same output skips episodes already committed under "
        "--topic (idempotent). See docs/TOOLS.md.",
    )
    p.add_argument(
        "--from", dest="input_format", required=True, choices=("tabular", "sample-batch"), help="input format"
    )
    p.add_argument("input", metavar="INPUT", help="input file or directory (local path or URI, e.g. s3://...)")
    p.add_argument("--output", required=True, metavar="URI", help="output root: /path, s3://bucket/prefix, ...")
    p.add_argument(
        "--schema",
        action="append",
        type=_kv,
        default=[],
        metavar="KEY=COLUMN",
        help="map a column of the input to one of our keys, like RLlib's input_read_schema "
        "(repeatable), e.g. --schema obs=observation; keys: eps_id agent_id module_id obs actions "
        "rewards new_obs terminateds truncateds t infos dones policy_version",
    )
    p.add_argument(
        "--observation-space",
        metavar="JSON",
        help="observation space as JSON (docs/FORMAT.md); "
        "default: from the files' rlrec metadata or inferred from the data",
    )
    p.add_argument("--action-space", metavar="JSON", help="action space as JSON; default: inferred")
    p.add_argument("--env", metavar="ID", help="gymnasium env id: its spaces (unless given) and the env_id column")
    p.add_argument(
        "--policy-id",
        help="policy id of every episode (default: module_id column, the MultiAgentBatch key, else default_policy)",
    )
    p.add_argument(
        "--policy-version",
        type=int,
        help="policy version of every episode (default: policy_version / weights_seq_no column, else 0)",
    )
    p.add_argument(
        "--incomplete",
        choices=("drop", "truncate", "error"),
        default="drop",
        help="episodes without a terminal row: drop them (default), mark them truncated, or fail",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="decode RLlib's compressed columns (base64(LZ4(cloudpickle)) strings). This UNPICKLES, "
        "i.e. executes code from the data: only for recordings you trust",
    )
    p.add_argument(
        "--topic",
        default="converted",
        help="manifest topic name of the converted shards "
        "(default: converted); episode ids already committed under it are skipped",
    )
    p.add_argument("--episodes-per-shard", type=int, default=1000, help="episodes per shard (default 1000)")
    p.add_argument("--compression", default="zstd", help="Parquet codec (default zstd)")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.set_defaults(func=run)


def _space(text: str | None, what: str):
    if text is None:
        return None
    from rlrec.producer.spaces import SpaceError, loads_space

    try:
        return loads_space(text)
    except SpaceError as e:
        raise ValueError(f"--{what}: {e}") from None


@reports_storage_errors("convert")
def run(args: argparse.Namespace) -> int:
    import json
    import logging
    import sys

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    from rlrec.commands._common import open_output
    from rlrec.consumer.convert import ConvertError, ConvertOptions, convert

    open_output(args.input, "INPUT")  # UsageError (exit 2): not a URI
    open_output(args.output, "--output")
    try:
        obs_space = _space(args.observation_space, "observation-space")
        act_space = _space(args.action_space, "action-space")
    except ValueError as e:
        print(f"rlrec convert: error: {e}", file=sys.stderr)
        return 2
    env_id = args.env or ""
    if args.env and (obs_space is None or act_space is None):
        import gymnasium as gym

        try:
            env = gym.make(args.env)
        except Exception as e:
            print(f"rlrec convert: error: --env {args.env}: {e}", file=sys.stderr)
            return 2
        obs_space = obs_space or env.observation_space
        act_space = act_space or env.action_space
        env.close()
    opts = ConvertOptions(
        input_format=args.input_format,
        schema=dict(args.schema),
        observation_space=obs_space,
        action_space=act_space,
        env_id=env_id,
        policy_id=args.policy_id,
        policy_version=args.policy_version,
        allow_pickle=args.allow_pickle,
        incomplete=args.incomplete,
        topic=args.topic,
        episodes_per_shard=args.episodes_per_shard,
        compression=args.compression,
    )

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=args.json or not console.is_terminal,
    )
    tasks: dict[str, int] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(
                {"read": "reading files", "write": "writing episodes"}.get(stage, stage), total=total
            )
        bar.update(tasks[stage], completed=done, total=total)

    try:
        with bar:
            res = convert(args.input, args.output, opts, progress)
    except ConvertError as e:
        print(f"rlrec convert: error: {e}", file=sys.stderr)
        return 2

    from rlrec.producer.spaces import dumps_space

    doc = {
        "files": res.files,
        "rows": res.rows,
        "duplicate_rows_dropped": res.duplicate_rows,
        "episodes": res.episodes,
        "incomplete_dropped": res.incomplete_dropped,
        "incomplete_truncated": res.incomplete_truncated,
        "discontinuous_episodes": res.discontinuous,
        "already_committed": res.skipped_committed,
        "episodes_written": res.written_episodes,
        "steps_written": res.steps,
        "shards": res.shards,
        "bytes": res.bytes,
        "observation_space": json.loads(dumps_space(res.observation_space)),
        "action_space": json.loads(dumps_space(res.action_space)),
        "policies": sorted({e.policy_id for e in res.entries}),
        "notes": res.notes,
    }
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for n in res.notes[:10]:
        console.print(f"note: {n}", markup=False, highlight=False)
    if len(res.notes) > 10:
        console.print(f"note: ... and {len(res.notes) - 10} more")
    out = Console()
    out.print(
        f"read {res.files} file(s), {res.rows} rows -> {res.episodes} episodes "
        f"({res.duplicate_rows} duplicate rows dropped; incomplete episodes: {res.incomplete_dropped} dropped, "
        f"{res.incomplete_truncated} marked truncated)"
    )
    out.print(
        f"wrote {res.written_episodes} episodes ({res.steps} steps) in {res.shards} shard(s), "
        f"{res.bytes} bytes; {res.skipped_committed} already committed under topic {args.topic!r}"
    )
    out.print(f"spaces: observation {res.observation_space}, action {res.action_space}")
    from rlrec.commands._common import shell_command

    out.print(f"check with: {shell_command()} inspect {args.output} --verify")
    return 0
