"""Object stores for tests: S3 (moto), GCS (fake-gcs-server) and Azure Blob (Azurite), each a real
server on 127.0.0.1 reached through its cloud's standard environment variables.

The ``object_store`` fixture (tests/conftest.py) is parametrized over the three: a test written
against an :class:`ObjectStore` runs on each. ``output()`` makes a fresh bucket (container) and
points this process's environment (and so every child process it starts) at the server, or at a
:class:`tests.faults.FaultProxy` in front of it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest

#: the ``object_store`` fixture's parameters, and the server fixture of each
SERVER_FIXTURES = {"s3": "local_s3", "gcs": "local_gcs", "azure": "local_azurite"}
SCHEMES = {"s3": "s3", "gcs": "gs", "azure": "az"}


@dataclass
class ObjectStore:
    """One started object-store server and how to reach it."""

    kind: str  # "s3", "gcs", "azure"
    server: Any  # LocalS3, LocalGcs or LocalAzurite

    @property
    def port(self) -> int:
        """The server's port (a FaultProxy forwards to it)."""
        return self.server.port

    def env(self, port: int | None = None) -> dict[str, str]:
        """The cloud's standard environment pointing at the server, or at *port* (a proxy)."""
        if self.kind == "s3":
            env = self.server.env()
            if port:
                env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
            return env
        return self.server.env(port)

    def bucket(self, prefix: str = "t") -> str:
        """A fresh bucket (container), created."""
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        if self.kind == "azure":
            return self.server.create_container(name)
        return self.server.create_bucket(name)

    def uri(self, bucket: str, path: str = "") -> str:
        return f"{SCHEMES[self.kind]}://{bucket}/{path}".rstrip("/")

    def output(self, monkeypatch: pytest.MonkeyPatch, path: str = "out", *, proxy_port: int | None = None) -> str:
        """The URI of *path* in a fresh bucket; this process's environment points at the server
        (or at *proxy_port*) until the test ends."""
        for k, v in self.env(proxy_port).items():
            monkeypatch.setenv(k, v)
        return self.uri(self.bucket(), path)
