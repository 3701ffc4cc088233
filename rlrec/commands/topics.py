"""``rlrec topics``: create or list topics (a topic plus its ``.dlq`` by default)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from rlrec.options import OptionSet, option


@dataclass
class BrokerClient:
    """How `rlrec topics` reaches the broker (options of both actions)."""

    bootstrap_servers: str = option(help="Kafka bootstrap servers, host:port[,host:port]")
    timeout: float = option(30.0, help="seconds to wait for the broker")
    kafka_config: dict[str, str] = option(
        default_factory=dict,
        help="librdkafka client setting, e.g. security.protocol=SASL_SSL, sasl.mechanism=PLAIN",
    )


@dataclass
class TopicsCreate:
    """Options of `rlrec topics create` besides `BrokerClient`'s."""

    topic: list[str] = option(help="topic name (repeatable)")
    partitions: int = option(help="partitions of each topic")
    replication_factor: int = option(1, help="replicas of each partition")
    dlq: bool = option(True, help="also create each topic's dead-letter topic TOPIC.dlq")
    dlq_partitions: int | None = option(None, help="partitions of TOPIC.dlq (default: --partitions)")
    topic_config: dict[str, str] = option(default_factory=dict, help="topic config, e.g. retention.ms=604800000")


#: the options of `rlrec topics create` and `rlrec topics list`
CREATE_OPTIONS = OptionSet("topics create", BrokerClient, TopicsCreate)
LIST_OPTIONS = OptionSet("topics list", BrokerClient)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("topics", help="create or list Kafka topics")
    sub = p.add_subparsers(dest="topics_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    c = sub.add_parser(
        "create",
        help="create topics and their dead-letter topics (TOPIC.dlq)",
        description="Create each --topic and, unless --no-dlq, its dead-letter topic "
        "TOPIC.dlq. Topics that already exist are left as they are.",
    )
    CREATE_OPTIONS.add_arguments(c)
    c.set_defaults(func=run_create, options=CREATE_OPTIONS)

    ls = sub.add_parser("list", help="list topics and their partition counts")
    LIST_OPTIONS.add_arguments(ls)
    ls.set_defaults(func=run_list, options=LIST_OPTIONS)


def _client(client: BrokerClient) -> dict[str, str]:
    """The --kafka-config settings, checked by librdkafka before any connection (UsageError)."""
    from rlrec.consumer.topics import check_client_config

    check_client_config(client.kafka_config)
    return client.kafka_config


def run_create(args: argparse.Namespace) -> int:
    values = CREATE_OPTIONS.resolve(args)  # OptionError: one line, exit 2
    broker = CREATE_OPTIONS.build(BrokerClient, values)
    opts = CREATE_OPTIONS.build(TopicsCreate, values)
    from rlrec.consumer.topics import create_topics, dlq_topic_name

    client = _client(broker)
    topics: dict[str, int] = {}
    for t in opts.topic:
        topics[t] = opts.partitions
        if opts.dlq:
            topics[dlq_topic_name(t)] = opts.dlq_partitions or opts.partitions
    from confluent_kafka import KafkaException

    from rlrec.consumer.topics import describe_kafka_error

    try:
        seen = create_topics(
            broker.bootstrap_servers,
            topics,
            config=opts.topic_config or None,
            timeout=broker.timeout,
            replication_factor=opts.replication_factor,
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

    broker = LIST_OPTIONS.build(BrokerClient, LIST_OPTIONS.resolve(args))  # OptionError: exit 2
    client = _client(broker)
    md = check_reachable(broker.bootstrap_servers, broker.timeout, client)  # RuntimeFailure: one line, exit 1
    for name in sorted(md.topics):
        if not name.startswith("__"):
            print(f"{name}\t{len(md.topics[name].partitions)}")
    return 0
