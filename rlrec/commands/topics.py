"""``rlrec topics``: create or list topics (a topic plus its ``.dlq`` by default)."""

from __future__ import annotations

import argparse
import os
import sys

from rlrec.options import parse_key_values


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("topics", help="create or list Kafka topics")
    sub = p.add_subparsers(dest="topics_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    bootstrap = os.environ.get("RLREC_BOOTSTRAP_SERVERS")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--bootstrap-servers",
        default=bootstrap,
        required=bootstrap is None,
        help="host:port[,host:port] (default: $RLREC_BOOTSTRAP_SERVERS)",
    )
    common.add_argument("--timeout", type=float, default=30.0, help="seconds (default 30)")
    common.add_argument(
        "--kafka-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="librdkafka client setting (repeatable), e.g. security.protocol=SASL_SSL, sasl.mechanism=PLAIN",
    )

    c = sub.add_parser(
        "create",
        parents=[common],
        help="create topics and their dead-letter topics (TOPIC.dlq)",
        description="Create each --topic and, unless --no-dlq, its dead-letter topic "
        "TOPIC.dlq. Topics that already exist are left as they are.",
    )
    c.add_argument("--topic", action="append", required=True, help="topic name (repeatable)")
    c.add_argument("--partitions", type=int, required=True)
    c.add_argument("--replication-factor", type=int, default=1)
    c.add_argument("--no-dlq", action="store_true", help="do not create TOPIC.dlq")
    c.add_argument("--dlq-partitions", type=int, default=None, help="partitions of TOPIC.dlq (default: --partitions)")
    c.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", help="topic config (repeatable)")
    c.set_defaults(func=run_create)

    ls = sub.add_parser("list", parents=[common], help="list topics and their partition counts")
    ls.set_defaults(func=run_list)


def _client_config(args: argparse.Namespace) -> dict[str, str]:
    """The --kafka-config settings, checked by librdkafka before any connection (UsageError)."""
    from rlrec.consumer.topics import check_client_config

    client = parse_key_values(args.kafka_config, "--kafka-config")
    check_client_config(client)
    return client


def run_create(args: argparse.Namespace) -> int:
    from rlrec.consumer.topics import create_topics, dlq_topic_name

    config = parse_key_values(args.config, "--config")
    client = _client_config(args)
    topics: dict[str, int] = {}
    for t in args.topic:
        topics[t] = args.partitions
        if not args.no_dlq:
            topics[dlq_topic_name(t)] = args.dlq_partitions or args.partitions
    from confluent_kafka import KafkaException

    from rlrec.consumer.topics import describe_kafka_error

    try:
        seen = create_topics(
            args.bootstrap_servers,
            topics,
            config=config or None,
            timeout=args.timeout,
            replication_factor=args.replication_factor,
            client_config=client,
        )
    except (KafkaException, TimeoutError) as e:
        print(f"rlrec topics create: error: {describe_kafka_error(e)}", file=sys.stderr)
        return 1
    for name, n in seen.items():
        print(f"{name}\t{n}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from rlrec.consumer.topics import check_reachable

    client = _client_config(args)
    md = check_reachable(args.bootstrap_servers, args.timeout, client)  # RuntimeFailure: one line, exit 1
    for name in sorted(md.topics):
        if not name.startswith("__"):
            print(f"{name}\t{len(md.topics[name].partitions)}")
    return 0
