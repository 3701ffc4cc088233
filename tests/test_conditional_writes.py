"""The start-up probe of conditional writes: a store that ignores S3 `If-None-Match` would
silently turn off writer fencing and deduplication, so the consumer refuses it (unless
`--allow-unfenced-storage`).  The local S3 server enforces the header; a proxy that strips it
(tests/faults.py) plays a store that does not.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from rlrec.consumer.service import ConsumerConfig, RecorderConsumer
from rlrec.store.storage import (
    PROBE_PREFIX,
    ConditionalWritesError,
    RetryPolicy,
    Storage,
    probe_conditional_writes,
    require_conditional_writes,
)
from tests.faults import FaultProxy

FAST_RETRY = RetryPolicy(attempts=3, base_delay=0.005, max_delay=0.02)


@pytest.fixture
def unfenced_s3(local_s3, monkeypatch) -> Iterator[tuple[str, dict[str, str]]]:
    """(an s3:// output URI, its environment) behind a proxy that drops If-None-Match."""
    proxy = FaultProxy(local_s3.port)
    proxy.strip_request_headers = {"if-none-match"}
    env = {**local_s3.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    bucket = local_s3.create_bucket(f"u-{uuid.uuid4().hex[:10]}")
    try:
        yield f"s3://{bucket}/out", env
    finally:
        proxy.close()


def _probe_keys(storage: Storage) -> list[str]:
    return [f.path for f in storage.list("_manifest") if f.path.startswith(PROBE_PREFIX)]


def test_enforcing_stores_pass_and_leave_nothing_behind(tmp_path, local_s3, monkeypatch) -> None:
    for k, v in local_s3.env().items():
        monkeypatch.setenv(k, v)
    s3 = Storage.from_uri(f"s3://{local_s3.create_bucket(f'p-{uuid.uuid4().hex[:10]}')}/out", retry=FAST_RETRY)
    local = Storage.from_uri(str(tmp_path / "out"))
    for st in (s3, local):
        assert require_conditional_writes(st) is True
        assert _probe_keys(st) == []


def test_a_store_that_ignores_if_none_match_is_refused(unfenced_s3, caplog) -> None:
    uri, _ = unfenced_s3
    st = Storage.from_uri(uri, retry=FAST_RETRY)
    assert probe_conditional_writes(st) is False
    with pytest.raises(ConditionalWritesError, match=r"ignores If-None-Match.*--allow-unfenced-storage"):
        require_conditional_writes(st)
    with caplog.at_level(logging.ERROR, logger="rlrec.storage"):
        assert require_conditional_writes(st, allow_unfenced=True) is False
    assert "does not enforce create-once writes" in caplog.text
    assert _probe_keys(st) == []  # the probe key is deleted afterwards


def test_stores_without_conditional_creates_in_pyarrow_are_refused() -> None:
    import pyarrow.fs as pafs

    mock = Storage(pafs._MockFileSystem(), "bucket/out")  # pyarrow's in-memory test filesystem
    assert mock.kind == "mock" and probe_conditional_writes(mock) is False
    with pytest.raises(ConditionalWritesError, match="no conditional create for mock storage"):
        require_conditional_writes(mock)


def test_the_consumer_refuses_to_start_before_touching_kafka(unfenced_s3) -> None:
    uri, _ = unfenced_s3
    cfg = ConsumerConfig(bootstrap_servers="127.0.0.1:1", output=uri)  # nothing listens there
    with pytest.raises(ConditionalWritesError):
        RecorderConsumer(cfg, storage=Storage.from_uri(uri, retry=FAST_RETRY)).run(max_seconds=5)


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_cli_says_why_and_exits_2(unfenced_s3, processes) -> None:
    uri, env = unfenced_s3
    cmd = [sys.executable, "-m", "rlrec", "consume", "--bootstrap-servers", "127.0.0.1:1", "--output", uri]
    cmd += ["--processes", str(processes)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "does not enforce create-once writes" in r.stderr and "--allow-unfenced-storage" in r.stderr
    assert "worker 0 started" not in r.stderr  # refused before any child (or Kafka) is touched


@pytest.mark.broker
def test_allow_unfenced_storage_starts_anyway(unfenced_s3, broker, topic, caplog, recorder_config) -> None:
    uri, _ = unfenced_s3

    cfg = recorder_config(uri, allow_unfenced_storage=True)
    with caplog.at_level(logging.ERROR, logger="rlrec.storage"):
        RecorderConsumer(cfg, storage=Storage.from_uri(uri, retry=FAST_RETRY)).run(max_seconds=1.0)
    assert "--allow-unfenced-storage is set" in caplog.text
