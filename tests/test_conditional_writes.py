"""The start-up probe of conditional writes: a store that ignores create-once preconditions
would silently turn off writer fencing and deduplication, so the consumer refuses it (unless
`--allow-unfenced-storage`).  The emulators enforce them (moto and Azurite `If-None-Match: *`,
fake-gcs-server `ifGenerationMatch=0` on a multipart upload); stores that do not are played by a
proxy that strips `If-None-Match` (tests/faults.py) in front of moto and of Azurite, and by
`gcp-storage-emulator`, a GCS emulator that ignores `ifGenerationMatch`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from rlrec.consumer.service import ConsumerConfig, RecorderConsumer
from rlrec.local import free_port
from rlrec.store.storage import (
    PROBE_PREFIX,
    ConditionalWritesError,
    RetryPolicy,
    Storage,
    probe_conditional_writes,
    require_conditional_writes,
)
from tests.faults import FaultProxy
from tests.stores import SERVER_FIXTURES, ObjectStore

FAST_RETRY = RetryPolicy(attempts=3, base_delay=0.005, max_delay=0.02)
#: what each store that ignores the precondition is said to ignore
IGNORED = {"s3": "If-None-Match", "azure": "If-None-Match", "gcs": "ifGenerationMatch=0"}


@pytest.fixture(params=sorted(IGNORED))
def unfenced(request, monkeypatch) -> Iterator[tuple[str, dict[str, str], str]]:
    """(an output URI, its environment, the kind) on a store that ignores create-once preconditions."""
    kind = request.param
    if kind == "gcs":
        from gcp_storage_emulator.server import create_server

        port = free_port()
        server = create_server("127.0.0.1", port, in_memory=True, default_bucket="ignores-preconditions")
        server.start()
        env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "GOOGLE_CLOUD_PROJECT": "rlrec-test"}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        try:
            yield "gs://ignores-preconditions/out", env, kind
        finally:
            server.stop()
        return
    store = ObjectStore(kind, request.getfixturevalue(SERVER_FIXTURES[kind]))
    proxy = FaultProxy(store.port)
    proxy.strip_request_headers = {"if-none-match"}
    uri = store.output(monkeypatch, proxy_port=proxy.port)
    env = store.env(proxy.port)
    if kind == "azure":  # a key signs If-None-Match (the stripped request would be refused): a SAS does not
        env = {"AZURE_STORAGE_CONNECTION_STRING": store.server.sas_connection_string(proxy.port)}
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", env["AZURE_STORAGE_CONNECTION_STRING"])
    try:
        yield uri, env, kind
    finally:
        proxy.close()


def _probe_keys(storage: Storage) -> list[str]:
    return [f.path for f in storage.list("_manifest") if f.path.startswith(PROBE_PREFIX)]


def test_enforcing_stores_pass_and_leave_nothing_behind(tmp_path, object_store, monkeypatch) -> None:
    remote = Storage.from_uri(object_store.output(monkeypatch), retry=FAST_RETRY)
    local = Storage.from_uri(str(tmp_path / "out"))
    for st in (remote, local):
        assert require_conditional_writes(st) is True
        assert _probe_keys(st) == []


def test_a_store_that_ignores_the_precondition_is_refused(unfenced, caplog) -> None:
    uri, _, kind = unfenced
    st = Storage.from_uri(uri, retry=FAST_RETRY)
    assert probe_conditional_writes(st) is False
    with pytest.raises(ConditionalWritesError, match=rf"ignores {IGNORED[kind]}.*--allow-unfenced-storage"):
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


def test_the_consumer_refuses_to_start_before_touching_kafka(unfenced) -> None:
    uri, _, _ = unfenced
    cfg = ConsumerConfig(bootstrap_servers="127.0.0.1:1", output=uri)  # nothing listens there
    with pytest.raises(ConditionalWritesError):
        RecorderConsumer(cfg, storage=Storage.from_uri(uri, retry=FAST_RETRY)).run(max_seconds=5)


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_cli_says_why_and_exits_2(unfenced, processes) -> None:
    uri, env, _ = unfenced
    cmd = [sys.executable, "-m", "rlrec", "consume", "--bootstrap-servers", "127.0.0.1:1", "--output", uri]
    cmd += ["--processes", str(processes)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "does not enforce create-once writes" in r.stderr and "--allow-unfenced-storage" in r.stderr
    assert "worker 0 started" not in r.stderr  # refused before any child (or Kafka) is touched


@pytest.mark.broker
def test_allow_unfenced_storage_starts_anyway(unfenced, broker, topic, caplog, recorder_config) -> None:
    uri, _, _ = unfenced

    cfg = recorder_config(uri, allow_unfenced_storage=True)
    with caplog.at_level(logging.ERROR, logger="rlrec.storage"):
        RecorderConsumer(cfg, storage=Storage.from_uri(uri, retry=FAST_RETRY)).run(max_seconds=1.0)
    assert "--allow-unfenced-storage is set" in caplog.text
