"""The embedded local stack (rlrec.local), its fixtures and the broker/topics CLI."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from rlrec.consumer.topics import create_topics, dlq_topic_name
from rlrec.local import (
    BrokerStartError,
    LocalBroker,
    consumer_test_config,
    free_port,
    wait_for_broker,
)

REPO = Path(__file__).resolve().parents[1]


def _poll(consumer, n: int, timeout: float = 20.0) -> list:
    """Poll until *n* messages arrived or *timeout*; errors fail the test."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        msg = consumer.poll(0.2)
        if msg is None:
            continue
        assert not msg.error(), msg.error()
        got.append(msg)
    return got


def _produce(bootstrap: str, topic: str, n: int) -> dict[bytes, bytes]:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True})
    sent = {f"k{i}".encode(): f"v{i}".encode() for i in range(n)}
    for k, v in sent.items():
        p.produce(topic, key=k, value=v)
    assert p.flush(15) == 0
    del p  # closes its connections (Tansu drains open ones on SIGTERM)
    return sent


def _metadata(bootstrap: str):
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)


# ------------------------------------------------------------------ no broker


def test_consumer_test_config_is_fast_and_consistent():
    cfg = consumer_test_config("127.0.0.1:1", "g", {"client.id": "x"})
    assert cfg["bootstrap.servers"] == "127.0.0.1:1" and cfg["group.id"] == "g"
    assert cfg["session.timeout.ms"] == 2000
    # A heartbeat at or above the session timeout expires the member (duplicates).
    assert cfg["heartbeat.interval.ms"] * 3 <= cfg["session.timeout.ms"]
    assert cfg["auto.offset.reset"] == "earliest" and cfg["enable.auto.commit"] is False
    assert cfg["client.id"] == "x"
    assert dlq_topic_name("steps") == "steps.dlq"


def test_local_s3_pyarrow_filesystem_and_conditional_put(local_s3, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from botocore.exceptions import ClientError
    from pyarrow import fs as pafs

    bucket = local_s3.create_bucket(f"t-{uuid.uuid4().hex[:8]}")
    fs = local_s3.filesystem()
    table = pa.table({"x": list(range(100)), "y": [str(i) for i in range(100)]})
    pq.write_table(table, f"{bucket}/shards/a.parquet", filesystem=fs)
    assert pq.read_table(f"{bucket}/shards/a.parquet", filesystem=fs).equals(table)

    # env() makes a plain s3:// URI reach the local server.
    for k, v in local_s3.env().items():
        monkeypatch.setenv(k, v)
    fs2, path = pafs.FileSystem.from_uri(f"s3://{bucket}/shards/a.parquet")
    assert pq.read_table(path, filesystem=fs2).num_rows == 100

    client = local_s3.client()
    client.put_object(Bucket=bucket, Key="manifest/00001", Body=b"a", IfNoneMatch="*")
    with pytest.raises(ClientError) as ei:
        client.put_object(Bucket=bucket, Key="manifest/00001", Body=b"b", IfNoneMatch="*")
    assert ei.value.response["Error"]["Code"] == "PreconditionFailed"
    assert ei.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=bucket, Key="manifest/00001")["Body"].read() == b"a"


def test_cli_help_is_light_and_tolerates_missing_command_modules(monkeypatch):
    code = (
        "import sys\n"
        "from rlrec.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in ('ray', 'torch', 'pyarrow', 'confluent_kafka', 'moto') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr
    assert "broker" in out.stdout and "topics" in out.stdout

    import rlrec.cli as cli

    monkeypatch.setattr(cli, "COMMAND_MODULES", ["rlrec.commands.no_such_command", *cli.COMMAND_MODULES])
    parser = cli.build_parser()
    args = parser.parse_args(["broker", "--port", "1"])
    assert args.options.resolve(args, environ={})["port"] == 1


# ---------------------------------------------------------------------- broker


@pytest.mark.broker
def test_broker_answers_metadata_and_advertises_loopback(broker):
    md = _metadata(broker.bootstrap_servers)
    assert {f"{b.host}:{b.port}" for b in md.brokers.values()} == {broker.bootstrap_servers}


@pytest.mark.broker
def test_produce_consume_round_trip_with_group(broker, topic, consumer_config):
    from confluent_kafka import Consumer

    md = _metadata(broker.bootstrap_servers)
    assert len(md.topics[topic].partitions) == 4
    assert len(md.topics[dlq_topic_name(topic)].partitions) == 4

    sent = _produce(broker.bootstrap_servers, topic, 20)
    c = Consumer(consumer_config())
    try:
        c.subscribe([topic])
        msgs = _poll(c, len(sent))
        assert {m.key(): m.value() for m in msgs} == sent
        assert len(msgs) == len(sent)
        assert {m.partition() for m in msgs} <= {0, 1, 2, 3}
        c.commit(asynchronous=False)
        assert _poll(c, 1, timeout=1.0) == []  # no duplicates after the commit
        committed = c.committed(c.assignment(), timeout=10)
        assert sum(tp.offset for tp in committed if tp.offset >= 0) == len(sent)
    finally:
        c.close()


@pytest.mark.broker
def test_s3_broker_restart_keeps_messages_and_committed_offsets(s3_broker):
    from confluent_kafka import Consumer, TopicPartition

    b = s3_broker
    name = f"restart-{uuid.uuid4().hex[:8]}"
    group = f"g-{name}"
    create_topics(b.bootstrap_servers, {name: 2})
    sent = _produce(b.bootstrap_servers, name, 10)

    # Consume everything, commit the middle of each partition.
    c = Consumer(consumer_test_config(b.bootstrap_servers, group))
    c.subscribe([name])
    msgs = _poll(c, 10)
    assert len(msgs) == 10
    by_part: dict[int, list] = defaultdict(list)
    for m in msgs:
        by_part[m.partition()].append(m)
    commits = [TopicPartition(name, p, ms[len(ms) // 2].offset()) for p, ms in by_part.items()]
    c.commit(offsets=commits, asynchronous=False)
    c.close()
    expected = {m.key() for ms in by_part.values() for m in ms[len(ms) // 2 :]}
    want_offsets = {tp.partition: tp.offset for tp in commits}

    try:
        t0 = time.monotonic()
        b.restart()  # graceful (SIGTERM) stop, same port, same bucket
        assert time.monotonic() - t0 < 4, "clients left open? Tansu drains them for 5 s"

        c = Consumer(consumer_test_config(b.bootstrap_servers, group))
        got = c.committed([TopicPartition(name, p) for p in want_offsets], timeout=10)
        assert {tp.partition: tp.offset for tp in got} == want_offsets
        c.subscribe([name])
        resumed = _poll(c, len(expected))
        assert {m.key() for m in resumed} == expected
        c.close()

        b.kill()  # crash: acknowledged data and commits are already in S3
        assert not b.running
        b.ensure_running()
        c = Consumer(consumer_test_config(b.bootstrap_servers, f"{group}-fresh"))
        c.subscribe([name])
        everything = _poll(c, 10)
        assert {m.key(): m.value() for m in everything} == sent
        c.close()
    finally:
        b.ensure_running()


@pytest.mark.broker
def test_bad_storage_url_raises_with_log_lines(tmp_path):
    b = LocalBroker("postgres://x", log_path=tmp_path / "tansu.log", startup_timeout=10)
    with pytest.raises(BrokerStartError) as ei:
        b.start()
    msg = str(ei.value)
    assert "postgres" in msg and "FeatureNotEnabled" in msg, msg
    assert "\x1b[" not in msg  # no terminal colours in the message
    assert not b.running
    b.stop()  # harmless when not running


@pytest.mark.broker
def test_cli_topics_create_creates_topic_and_dlq(broker, capsys):
    from rlrec.cli import main

    name = f"cli-{uuid.uuid4().hex[:8]}"
    args = ["topics", "create", "--bootstrap-servers", broker.bootstrap_servers]
    assert main([*args, "--topic", name, "--partitions", "3"]) == 0
    assert main([*args, "--topic", name, "--partitions", "3"]) == 0  # already exists: fine
    assert main([*args, "--topic", f"{name}-x", "--partitions", "2", "--no-dlq"]) == 0
    out = capsys.readouterr().out
    assert f"{name}\t3" in out and f"{dlq_topic_name(name)}\t3" in out

    md = _metadata(broker.bootstrap_servers)
    assert len(md.topics[name].partitions) == 3
    assert len(md.topics[dlq_topic_name(name)].partitions) == 3
    assert len(md.topics[f"{name}-x"].partitions) == 2
    assert dlq_topic_name(f"{name}-x") not in md.topics


@pytest.mark.broker
def test_cli_topics_kafka_config_reaches_the_admin_client(broker, capsys):
    """--kafka-config (SASL/SSL settings) is passed to the admin client of create and list."""
    from rlrec.cli import main

    name = f"cli-{uuid.uuid4().hex[:8]}"
    args = ["--bootstrap-servers", broker.bootstrap_servers, "--timeout", "10"]
    ok = ["--kafka-config", "client.id=rlrec-topics-test"]
    assert main(["topics", "create", *args, *ok, "--topic", name, "--partitions", "1", "--no-dlq"]) == 0
    assert main(["topics", "list", *args, *ok]) == 0
    assert f"{name}\t1" in capsys.readouterr().out
    # librdkafka refuses an unknown property (a usage error): proof that the setting reached the client
    bad = ["--kafka-config", "no.such.property=1"]
    assert main(["topics", "create", *args, *bad, "--topic", f"{name}-b", "--partitions", "1"]) == 2
    assert main(["topics", "list", *args, *bad]) == 2
    assert capsys.readouterr().err.count("no.such.property") == 2
    assert main(["topics", "list", *args, "--kafka-config", "security.protocol"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert f"{name}-b" not in _metadata(broker.bootstrap_servers).topics


@pytest.mark.broker
def test_cli_broker_prints_bootstrap_and_exits_0_on_sigterm(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        # an explicit free port: Kafka's 9092 is what every `rlrec broker` on this machine tries
        # first (tests/test_broker_port.py covers that choice)
        [sys.executable, "-m", "rlrec", "broker", "--port", str(free_port()), "--log-path", str(tmp_path / "b.log")],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "no output within 30 s"
        line = proc.stdout.readline().strip()
        assert line.startswith("bootstrap_servers=127.0.0.1:"), line + proc.stderr.read()
        bootstrap = line.split("=", 1)[1]
        wait_for_broker(bootstrap, timeout=10)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "log_path=" in proc.stdout.read()
        assert (tmp_path / "b.log").read_text().startswith("=== rlrec LocalBroker start")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
