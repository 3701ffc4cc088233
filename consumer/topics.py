"""Kafka topic administration for rlrec: the dead-letter topic's name, creating topics, and the
client settings that carry a cluster's security configuration.

Used by the consumer service (it creates its topics unless told not to) and `rlrec topics`.
confluent_kafka is imported lazily, so importing this module is cheap.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from rlrec.errors import RuntimeFailure, UsageError
from rlrec.producer.kafka_log import KAFKA_LOGGER, kafka_logger

__all__ = [
    "KAFKA_LOGGER",
    "SECURITY_PREFIXES",
    "check_client_config",
    "check_reachable",
    "client_settings",
    "create_topics",
    "describe_kafka_error",
    "dlq_topic_name",
    "kafka_logger",
]

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


def check_client_config(settings: Mapping[str, Any], option: str = "--kafka-config", *, kind: str = "admin") -> None:
    """UsageError (exit 2) when librdkafka refuses one of `settings` (an unknown property, a
    bad value), before any connection is made.

    Args:
        settings: librdkafka client settings.
        option: the option they came from, for the message.
        kind: the client they are for: ``admin`` or ``consumer`` (consumer properties are
            checked by a consumer; an admin client would only warn about them).

    Example:
        >>> check_client_config({"sesion.timeout.ms": "6000"}, kind="consumer")
        Traceback (most recent call last):
        ...
        rlrec.errors.UsageError: --kafka-config: No such configuration property: "sesion.timeout.ms" ...
    """
    from confluent_kafka import Consumer, KafkaException
    from confluent_kafka.admin import AdminClient

    # the client is never used: librdkafka checks every property when the client is made; the
    # address is never contacted before it is closed
    silent = logging.getLogger(f"{KAFKA_LOGGER}.config-check")  # its connection attempts mean nothing
    silent.propagate = False
    silent.setLevel(logging.CRITICAL + 1)
    conf = {**settings, "bootstrap.servers": "127.0.0.1:9", "logger": silent}
    try:
        if kind == "consumer":
            Consumer({"group.id": "rlrec-config-check", **conf}).close()
        else:
            AdminClient(conf)
    except (KafkaException, ValueError, TypeError) as e:
        raise UsageError(
            f"{option}: {describe_kafka_error(e)} (see librdkafka's CONFIGURATION.md for the property names)"
        ) from e


def describe_kafka_error(e: BaseException) -> str:
    """The text of a confluent_kafka exception (its KafkaError's message), else ``str(e)``.

    Args:
        e: a KafkaException (or any exception).

    Example:
        >>> describe_kafka_error(ValueError("bad"))
        'bad'
    """
    err = e.args[0] if e.args else None
    text = err.str() if hasattr(err, "str") else str(e)
    return text or type(e).__name__


def check_reachable(
    bootstrap_servers: str,
    timeout: float = 30.0,
    client_config: Mapping[str, Any] | None = None,
    option: str = "--bootstrap-servers",
) -> Any:
    """The cluster's metadata; RuntimeFailure (exit 1) with one line if no broker at
    `bootstrap_servers` answers within `timeout` seconds, UsageError (exit 2) if librdkafka
    refuses a setting of `client_config`.

    Args:
        bootstrap_servers: ``host:port[,host:port]``.
        timeout: seconds to wait for an answer.
        client_config: librdkafka settings of the admin client (SASL/SSL).
        option: the option that named the servers, for the message.

    Example:
        >>> check_reachable("127.0.0.1:1", timeout=1)
        Traceback (most recent call last):
        ...
        rlrec.errors.RuntimeFailure: cannot reach Kafka at 127.0.0.1:1 within 1 s ...
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    try:
        admin = AdminClient({**(client_config or {}), "bootstrap.servers": bootstrap_servers, "logger": kafka_logger()})
    except (KafkaException, ValueError, TypeError) as e:
        raise UsageError(f"--kafka-config: {describe_kafka_error(e)} (see librdkafka's CONFIGURATION.md)") from e
    try:
        return admin.list_topics(timeout=timeout)
    except KafkaException as e:
        raise RuntimeFailure(
            f"cannot reach Kafka at {bootstrap_servers} within {timeout:g} s ({describe_kafka_error(e)}): "
            f"check {option} and that the broker is running"
        ) from e


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
    Raises :class:`rlrec.errors.RuntimeFailure` if no broker answers within *timeout*,
    ``confluent_kafka.KafkaException`` on other errors and ``TimeoutError`` if metadata
    does not show every topic with all partitions in time.
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    wanted = dict(topics.items() if isinstance(topics, Mapping) else topics)
    if not wanted:
        return {}
    deadline = time.monotonic() + timeout
    check_reachable(bootstrap_servers, timeout, client_config)
    admin = AdminClient({**(client_config or {}), "bootstrap.servers": bootstrap_servers, "logger": kafka_logger()})
    new = [
        NewTopic(name, num_partitions=int(n), replication_factor=int(replication_factor), config=dict(config or {}))
        for name, n in wanted.items()
    ]
    existed: set[str] = set()
    futures = admin.create_topics(new, request_timeout=max(1.0, timeout))
    for name, fut in futures.items():
        try:
            fut.result(timeout=max(0.1, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"Kafka at {bootstrap_servers} did not create topic {name} within {timeout:g} s"
            ) from None
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
