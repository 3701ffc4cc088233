"""Optional Confluent schema-registry framing: magic byte 0 + 4-byte big-endian schema id + body.

With a registry URL configured, the producer registers each event schema under the subject
`rlrec.<Kind>` (record-name strategy) and frames values the Confluent way instead of sending the
`rlrec-schema` header; consumers configured with the same registry map a schema id back to
(kind, version) from the schema's `name` and `rlrec.version` attributes. Only the registry's
REST API (`POST /subjects/{subject}/versions`, `GET /schemas/ids/{id}`) is used, through the
standard library, so no extra dependency is needed.
"""

from __future__ import annotations

import json
import struct
import threading
import urllib.error
import urllib.request
from typing import Any

from rlrec.producer.events import SCHEMA_DIR, DecodeError

__all__ = ["MAGIC", "RegistryUnavailable", "SchemaRegistry", "frame", "unframe"]


class RegistryUnavailable(RuntimeError):
    """The registry could not be reached: not the message's fault, so not a dead letter."""


MAGIC = 0
_HEAD = struct.Struct(">bI")


def frame(schema_id: int, body: bytes) -> bytes:
    return _HEAD.pack(MAGIC, schema_id) + body


def unframe(value: bytes) -> tuple[int, bytes]:
    if len(value) < _HEAD.size or value[0] != MAGIC:
        raise DecodeError("bad-header", "not a Confluent-framed value (magic byte 0 + 4-byte schema id)")
    _magic, schema_id = _HEAD.unpack_from(value)
    return schema_id, value[_HEAD.size :]


class SchemaRegistry:
    """A small client of a Confluent-compatible schema registry, with caches both ways."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._ids: dict[str, int] = {}
        self._kinds: dict[int, tuple[str, int]] = {}
        self._lock = threading.Lock()

    def _call(self, method: str, path: str, payload: Any = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            f"{self.url}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return json.loads(resp.read())

    def schema_id(self, kind: str, version: int) -> int:
        """Register (idempotent on the registry side) the shipped schema of kind/version; its id."""
        key = f"{kind}/{version}"
        with self._lock:
            if key not in self._ids:
                text = (SCHEMA_DIR / f"{kind}.v{version}.avsc").read_text()
                schema_id = int(self._call("POST", f"/subjects/rlrec.{kind}/versions", {"schema": text})["id"])
                self._ids[key] = schema_id
                self._kinds[schema_id] = (kind, version)
            return self._ids[key]

    def kind_of(self, schema_id: int) -> tuple[str, int]:
        """(kind, version) of a schema id; DecodeError('unknown-schema') for foreign schemas."""
        with self._lock:
            hit = self._kinds.get(schema_id)
        if hit is not None:
            return hit
        try:
            schema = json.loads(self._call("GET", f"/schemas/ids/{schema_id}")["schema"])
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise DecodeError("unknown-schema", f"schema id {schema_id} is not in the registry") from None
            raise RegistryUnavailable(f"schema registry {self.url}: HTTP {e.code}") from e
        except (urllib.error.URLError, OSError) as e:
            raise RegistryUnavailable(f"schema registry {self.url}: {e}") from e
        try:
            name = schema["name"].rsplit(".", 1)[-1]
            version = int(schema["rlrec.version"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise DecodeError("unknown-schema", f"schema id {schema_id} is not an rlrec event schema") from None
        with self._lock:
            self._kinds[schema_id] = (name, version)
        return name, version
