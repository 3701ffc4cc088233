"""`rlrec consume`: run the consumer service (Kafka transitions -> exactly-once episode shards).

Every option can also come from a config file (`--config FILE`, JSON or TOML, keys as the long
option names with dashes or underscores) or from `RLREC_<OPTION>` environment variables
(e.g. `RLREC_BOOTSTRAP_SERVERS`, `RLREC_MAX_FILE_AGE_S`). Precedence: command line, then
environment, then config file, then defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rlrec.commands._common import parse_key_values


def flag(text: str | bool) -> bool:
    """An on/off option: given alone on the command line; `1`/`true`/`yes`/`on` or
    `0`/`false`/`no`/`off` in the environment; a boolean (or those strings) in a config file."""
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not an on/off value: {text!r} (use 1/0, true/false)")


# (flag, type, default, help) - the single source for the CLI, the env vars and the config file
OPTIONS: list[tuple[str, type, object, str]] = [
    ("bootstrap-servers", str, None, "Kafka bootstrap servers (required)"),
    ("topic", str, "rlrec.transitions", "transitions topic"),
    ("group-id", str, "rlrec-consumer", "consumer group id; run more processes with the same id to scale out"),
    ("output", str, None, "output URI or path: /dir, file:///dir, s3://bucket/prefix, gs://... (required)"),
    ("format", str, "episodes", "episodes (RLlib output_write_episodes=True) or tabular"),
    ("compression", str, "zstd", "Parquet compression: zstd, snappy, gzip, lz4, none"),
    ("max-episodes-per-file", int, 1000, "roll a shard after this many episodes (RLlib output_max_rows_per_file)"),
    (
        "max-file-bytes",
        int,
        128 * 1024 * 1024,
        "roll a shard at about this many bytes of episodes (output_max_file_size)",
    ),
    (
        "max-file-age-s",
        float,
        60.0,
        "write finished episodes at the latest this long after they finish (idle partitions too)",
    ),
    ("reward-join-window-s", float, 0.0, "keep a finished episode this long for delayed rewards before writing it"),
    ("episode-timeout-s", float, 600.0, "an open episode with no event for this long is finalized"),
    ("on-timeout", str, "truncate", "truncate (write it as truncated) or dead-letter"),
    ("max-open-episodes", int, 100_000, "cap on episodes being assembled; over it the longest-idle is evicted"),
    ("on-capacity", str, "dead-letter", "what eviction does: dead-letter (reason capacity) or truncate"),
    (
        "max-open-bytes",
        int,
        1024 * 1024 * 1024,
        "memory budget of all open episodes (observations, actions, infos, extra outputs); over it the "
        "longest-idle is evicted as --on-capacity says",
    ),
    ("max-episode-bytes", int, 64 * 1024 * 1024, "memory budget of one open episode"),
    (
        "on-episode-too-large",
        str,
        "dead-letter",
        "an episode over --max-episode-bytes: dead-letter (reason episode-too-large) or truncate",
    ),
    (
        "validate-spaces",
        str,
        "strict",
        "strict (dtypes, shapes, action ranges, finite obs/actions: out-of-space, non-finite-value), "
        "shape (dtypes and shapes only) or off",
    ),
    ("max-buffered-bytes", int, 512 * 1024 * 1024, "budget of finished-but-unwritten episode bytes; over it, flush"),
    ("dlq-topic", str, None, "dead-letter topic (default: {topic}.dlq)"),
    ("partitions", int, 8, "partitions for topics this command creates"),
    ("max-message-bytes", int, 8 * 1024 * 1024, "messages larger than this are dead-lettered (oversize)"),
    ("commit-interval-s", float, 5.0, "how often offsets are committed when no flush did it"),
    ("schema-registry-url", str, None, "read Confluent-framed values through this schema registry"),
    ("metrics-port", int, None, "serve Prometheus /metrics and /healthz here (0: pick a free port)"),
    ("metrics-host", str, "127.0.0.1", "interface for the metrics server (0.0.0.0 in containers)"),
    (
        "allow-unfenced-storage",
        flag,
        False,
        "start even if the output store ignores create-once writes (S3 If-None-Match; probed at "
        "start): LOSES writer fencing and episode deduplication - only with one consumer per "
        "partition guaranteed by other means",
    ),
    (
        "processes",
        int,
        1,
        "consumer processes of the group to run here (one core each; at most the partition count); "
        "the memory budgets are split between them",
    ),
    ("max-seconds", float, None, "stop after this many seconds (tests, demos)"),
    ("log-format", str, "text", "text or json (one JSON object per line)"),
    ("log-level", str, "INFO", "DEBUG, INFO, WARNING, ERROR"),
]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "consume",
        help="consume transitions into exactly-once Parquet episode shards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="JSON or TOML file with option values")
    for name, typ, _default, help_ in OPTIONS:
        if typ is flag:
            p.add_argument(
                f"--{name}", action="store_const", const=True, default=None, help=f"{help_} [env RLREC_{_env(name)}]"
            )
        else:
            p.add_argument(f"--{name}", type=typ, default=None, help=f"{help_} [env RLREC_{_env(name)}]")
    p.add_argument(
        "--no-create-topics", action="store_true", help="don't create the topic and its DLQ (ops provision them)"
    )
    p.add_argument(
        "--kafka-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="librdkafka setting passed through (repeatable), e.g. security.protocol=SASL_SSL",
    )
    p.set_defaults(func=_run)


def _env(flag: str) -> str:
    return flag.upper().replace("-", "_")


def _load_file(path: str) -> dict:
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".toml"):
        import tomllib

        data = tomllib.loads(raw.decode())
    else:
        data = json.loads(raw)
    return {k.replace("_", "-"): v for k, v in data.items()}


def resolve_options(args: argparse.Namespace, environ: dict | None = None) -> dict:
    """Merge command line > RLREC_* environment > config file > defaults into {dest: value}."""
    environ = os.environ if environ is None else environ
    file_values = _load_file(args.config) if args.config else {}
    out = {}
    for name, typ, default, _ in OPTIONS:
        dest = name.replace("-", "_")
        value = getattr(args, dest)
        try:
            if value is None and f"RLREC_{_env(name)}" in environ:
                value = typ(environ[f"RLREC_{_env(name)}"])
            if value is None and name in file_values:
                value = typ(file_values[name])
        except ValueError as e:
            raise SystemExit(f"rlrec consume: --{name}: {e}") from None
        out[dest] = default if value is None else value
    kafka = dict(file_values.get("kafka-config", {}))
    try:
        kafka.update(parse_key_values(args.kafka_config, "--kafka-config"))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out["kafka_config"] = kafka
    out["create_topics"] = not (
        args.no_create_topics
        or file_values.get("no-create-topics", False)
        or environ.get("RLREC_NO_CREATE_TOPICS", "") in ("1", "true")
    )
    return out


def freeze_startup_objects() -> None:
    """This process is the consumer's own: once its modules are imported (RLlib's episode
    classes bring Ray and RLlib, about 300k objects that live as long as the process), move
    them to the garbage collector's permanent generation (`gc.freeze`), so its full passes walk
    only what the consumer allocates (at CartPole size they cost about a tenth of the loop's
    time otherwise). A program that embeds `RecorderConsumer` may do the same after its imports."""
    import gc

    from rlrec.store.episodes import import_episode_classes

    import_episode_classes()
    gc.collect()
    gc.freeze()


def _run(args: argparse.Namespace) -> int:
    opts = resolve_options(args)
    for required in ("bootstrap_servers", "output"):
        if not opts[required]:
            print(f"rlrec consume: --{required.replace('_', '-')} is required", file=sys.stderr)
            return 2
    if opts["format"] not in ("episodes", "tabular"):
        print("rlrec consume: --format must be episodes or tabular", file=sys.stderr)
        return 2
    from rlrec.logs import setup_logging

    logging_args = (opts.pop("log_format"), opts.pop("log_level"))
    setup_logging(*logging_args)
    from rlrec.consumer.service import ConsumerConfig, RecorderConsumer
    from rlrec.store.storage import ConditionalWritesError

    max_seconds = opts.pop("max_seconds")
    processes = opts.pop("processes")
    if processes < 1:
        print("rlrec consume: --processes must be at least 1", file=sys.stderr)
        return 2
    try:
        config = ConsumerConfig(**opts)
        if processes > 1:
            from rlrec.supervisor import check_split

            check_split(config, processes)
    except ValueError as e:
        print(f"rlrec consume: {e}", file=sys.stderr)
        return 2
    try:
        if processes > 1:
            from rlrec.supervisor import ConsumerProcesses

            return ConsumerProcesses(config, processes, max_seconds, logging_args).run()
        freeze_startup_objects()
        RecorderConsumer(config).run(max_seconds=max_seconds)
    except ConditionalWritesError as e:
        print(f"rlrec consume: {e}", file=sys.stderr)
        return 2
    return 0
