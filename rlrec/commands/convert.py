"""``rlrec convert``: legacy RLlib recordings (tabular Parquet, SampleBatch JSON) -> episode shards."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rlrec.commands._common import reports_storage_errors
from rlrec.consumer.convert_options import ConvertOptions
from rlrec.options import OptionSet, option


@dataclass
class ConvertCommand:
    """Options of `rlrec convert` besides those of `ConvertOptions`."""

    input: str = option(
        positional=True, metavar="INPUT", help="input file or directory (local path or URI, e.g. s3://...)"
    )
    output: str = option(metavar="URI", help="output root: /path, s3://bucket/prefix, ...")
    observation_space: str | None = option(
        None,
        metavar="JSON",
        help="observation space as JSON (docs/FORMAT.md); default: from the files' rlrec metadata or inferred from the data",
    )
    action_space: str | None = option(None, metavar="JSON", help="action space as JSON; default: inferred")
    env: str | None = option(
        None, metavar="ID", help="gymnasium env id: its spaces (unless given) and the env_id column"
    )
    json: bool = option(False, help="print a JSON summary on stdout")


#: the options of `rlrec convert`, declared on these dataclasses
OPTIONS = OptionSet("convert", ConvertCommand, ConvertOptions)


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
    OPTIONS.add_arguments(p)
    p.set_defaults(func=run, options=OPTIONS)


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
    import sys

    from rlrec.logs import cli_logging

    cli_logging()
    values = OPTIONS.resolve(args)  # OptionError: one line, exit 2
    cmd = OPTIONS.build(ConvertCommand, values)
    from rlrec.commands._common import open_output
    from rlrec.consumer.convert import ConvertError, convert

    open_output(cmd.input, "INPUT")  # UsageError (exit 2): not a URI
    open_output(cmd.output, "--output")
    try:
        obs_space = _space(cmd.observation_space, "observation-space")
        act_space = _space(cmd.action_space, "action-space")
    except ValueError as e:
        print(f"rlrec convert: error: {e}", file=sys.stderr)
        return 2
    if cmd.env and (obs_space is None or act_space is None):
        import gymnasium as gym

        try:
            env = gym.make(cmd.env)
        except Exception as e:
            print(f"rlrec convert: error: --env {cmd.env}: {e}", file=sys.stderr)
            return 2
        obs_space = obs_space or env.observation_space
        act_space = act_space or env.action_space
        env.close()
    opts = OPTIONS.build(
        ConvertOptions, values, observation_space=obs_space, action_space=act_space, env_id=cmd.env or ""
    )

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rlrec.commands._common import plain_console

    console = plain_console(stderr=True)  # notes, paths and spaces are data, never markup
    bar = Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=cmd.json or not console.is_terminal,
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
            res = convert(cmd.input, cmd.output, opts, progress)
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
    if cmd.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for n in res.notes[:10]:
        console.print(f"note: {n}")
    if len(res.notes) > 10:
        console.print(f"note: ... and {len(res.notes) - 10} more")
    out = plain_console()
    out.print(
        f"read {res.files} file(s), {res.rows} rows -> {res.episodes} episodes "
        f"({res.duplicate_rows} duplicate rows dropped; incomplete episodes: {res.incomplete_dropped} dropped, "
        f"{res.incomplete_truncated} marked truncated)"
    )
    out.print(
        f"wrote {res.written_episodes} episodes ({res.steps} steps) in {res.shards} shard(s), "
        f"{res.bytes} bytes; {res.skipped_committed} already committed under topic {opts.topic!r}"
    )
    out.print(f"spaces: observation {res.observation_space}, action {res.action_space}")
    from rlrec.commands._common import shell_command

    out.print(f"check with: {shell_command()} inspect {cmd.output} --verify")
    return 0
