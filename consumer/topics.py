"""Kafka topic administration for rlrec: the dead-letter topic's name, creating topics, and the
client settings that carry a cluster's security configuration.

Used by the consumer service (it creates its topics unless told not to) and `rlrec topics`.
confluent_kafka is imported lazily, so importing this module is cheap.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["SECURITY_PREFIXES", "client_settings", "create_topics", "dlq_topic_name"]

#: librdkafka settings that every client of a cluster needs (authentication, encryption)
SECURITY_PREFIXES = ("security.", "sasl.", "ssl.")


def dlq_topic_name(topic: str) -> str:
    """The dead-letter topic paired with *topic*."""
    return f"{topic}.dlq"


def client_settings(kafka_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The security settings (``security.*``, ``sasl.*``, ``ssl.*``) of a consumer's
    ``kafka_config``: what an admin client or a producer of the same cluster needs too (the
    group and fetch settings would be rejected or meaningless there)."""
    return {k: v for k, v in (kafka_config or {}).items() if k.startswith(SECURITY_PREFIXES)}


def create_topics(
    bootstrap_servers: str,
    topics: Mapping[str, int] | Iterable[tuple[str, int]],
    config: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    *,
    replication_factor: int = 1,
    client_config: Mapping[str, Any] | None = None,
) -> dict[str, int]:
    """Create *topics* (name -> partitions) and wait until metadata shows them.

    *config* holds topic configs, *client_config* librdkafka settings of the admin client
    (e.g. SASL/SSL: see `client_settings`). "Already exists" counts as success (the existing
    partition count is kept and returned). Returns ``{name: partitions seen in metadata}``.
    Raises ``confluent_kafka.KafkaException`` on other errors and ``TimeoutError`` if metadata
    does not show every topic with all partitions in time.
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    wanted = dict(topics.items() if isinstance(topics, Mapping) else topics)
    if not wanted:
        return {}
    deadline = time.monotonic() + timeout
    admin = AdminClient({**(client_config or {}), "bootstrap.servers": bootstrap_servers})
    new = [
        NewTopic(name, num_partitions=int(n), replication_factor=int(replication_factor), config=dict(config or {}))
        for name, n in wanted.items()
    ]
    existed: set[str] = set()
    futures = admin.create_topics(new, request_timeout=max(1.0, timeout))
    for name, fut in futures.items():
        try:
            fut.result(timeout=max(0.1, deadline - time.monotonic()))
        except KafkaException as e:
            err = e.args[0] if e.args else None
            if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                existed.add(name)
                continue
            raise

    seen: dict[str, int] = {}
    while True:
        try:
            md = admin.list_topics(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            seen = {}
            for name, n in wanted.items():
                t = md.topics.get(name)
                if t is None or t.error is not None:
                    continue
                if (name in existed and len(t.partitions) > 0) or len(t.partitions) >= int(n):
                    seen[name] = len(t.partitions)
            if len(seen) == len(wanted):
                return seen
        except KafkaException:
            pass
        if time.monotonic() >= deadline:
            missing = sorted(set(wanted) - set(seen))
            raise TimeoutError(f"topics {missing} not visible in metadata after {timeout:.0f}s")
        time.sleep(0.05)
