"""`rlrec consume`: run the consumer service (Kafka transitions -> exactly-once episode shards).

Every option can also come from a config file (`--config FILE`, TOML or JSON, keys as the long
option names with dashes or underscores) or from `RLREC_<OPTION>` environment variables
(e.g. `RLREC_BOOTSTRAP_SERVERS`, `RLREC_MAX_FILE_AGE_S`). Precedence: command line, then
environment, then config file, then defaults. A config-file key that is no option of this
command, or an RLREC_* variable that is no option of any command, is an error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlrec.consumer.config import ConsumerConfig
from rlrec.logs import LogOptions
from rlrec.options import OptionError, OptionSet, option


@dataclass
class ConsumeProcesses:
    """How `rlrec consume` runs the consumer (options of the command, not of `ConsumerConfig`)."""

    processes: int = option(
        1,
        help="consumer processes of the group to run here (one core each; at most the partition count); "
        "the memory budgets are split between them",
    )
    max_seconds: float | None = option(
        None, help="stop after this many seconds (tests, demos; default: run until stopped)"
    )


#: the options of `rlrec consume`, declared on these dataclasses
OPTIONS = OptionSet("consume", ConsumerConfig, ConsumeProcesses, LogOptions)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "consume",
        help="consume transitions into exactly-once Parquet episode shards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    OPTIONS.add_arguments(p)
    p.set_defaults(func=_run, options=OPTIONS)


def resolve_options(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Merge command line > RLREC_* environment > config file > defaults into {field: value}
    (None for a required option given nowhere); OptionError (one line) for an unknown key or
    variable or a bad value."""
    return OPTIONS.resolve(args, environ)


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
    try:
        opts = resolve_options(args)
        processes = opts.pop("processes")
        if processes < 1:
            raise OptionError("--processes must be at least 1")
        config = OPTIONS.build(ConsumerConfig, opts)
    except ValueError as e:  # OptionError too
        print(f"rlrec consume: error: {e}", file=sys.stderr)
        return 2
    if processes > 1:
        from rlrec.supervisor import check_split

        try:
            check_split(config, processes)
        except ValueError as e:
            print(f"rlrec consume: error: {e}", file=sys.stderr)
            return 2
    from rlrec.commands._common import open_output

    output = open_output(config.output, "--output")  # UsageError (exit 2) before Kafka is contacted
    from rlrec.store.storage import ConditionalWritesError, StorageError, require_conditional_writes

    try:  # a store that ignores create-once writes is a configuration error: said before Kafka is
        require_conditional_writes(output, allow_unfenced=config.allow_unfenced_storage)
    except ConditionalWritesError as e:
        print(f"rlrec consume: error: {e}", file=sys.stderr)
        return 2
    except StorageError:
        pass  # unreachable now: infrastructure, the consumer probes it again until it answers
    from rlrec.consumer.service import startup_timeout
    from rlrec.consumer.topics import check_client_config, check_reachable, client_settings

    check_client_config(config.kafka_config, kind="consumer")
    # an unreachable broker: one line, exit 1, before RLlib is imported and children are started
    check_reachable(
        config.bootstrap_servers, startup_timeout(opts["max_seconds"]), client_settings(config.kafka_config)
    )
    from rlrec.logs import setup_logging

    logging_args = (opts["log_format"], opts["log_level"])
    setup_logging(*logging_args)
    from rlrec.commands._signals import StopSignals
    from rlrec.consumer.service import RecorderConsumer

    max_seconds = opts["max_seconds"]
    signals = None
    try:
        if processes > 1:
            from rlrec.supervisor import ConsumerProcesses

            supervisor = ConsumerProcesses(config, processes, max_seconds, logging_args)
            signals = StopSignals(supervisor.stop).install()
            return signals.exit_code(supervisor.run(install_signals=False))
        freeze_startup_objects()
        consumer = RecorderConsumer(config)
        signals = StopSignals(consumer.stop).install()
        consumer.run(max_seconds=max_seconds, install_signals=False)
        return signals.exit_code(0)
    except ConditionalWritesError as e:
        print(f"rlrec consume: error: {e}", file=sys.stderr)
        return 2
    finally:
        if signals is not None:
            signals.restore()
