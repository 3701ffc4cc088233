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
import time
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
    """A small client of a Confluent-compatible schema registry, with caches both ways.

    Guarantees: a known id costs no call; an id that is not one of rlrec's schemas costs at most
    one call per `NEGATIVE_TTL_S`; registry trouble is `RegistryUnavailable`, never a DecodeError.
    """

    NEGATIVE_TTL_S = 60.0
    MAX_UNKNOWN = 10_000

    def __init__(self, url: str, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._ids: dict[str, int] = {}
        self._kinds: dict[int, tuple[str, int]] = {}
        self._unknown: dict[int, tuple[float, str]] = {}  # id -> (expiry, message)
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
        """(kind, version) of a schema id.

        DecodeError('unknown-schema') for ids the registry does not have (404) and for schemas
        that are not rlrec's Avro event schemas -- remembered for `NEGATIVE_TTL_S`, so a flood of
        such messages costs one registry call per id and minute; `RegistryUnavailable` when the
        registry cannot answer (unreachable, 5xx, other 4xx, a reply that is not JSON): not the
        message's fault, so the caller retries instead of dead-lettering.
        """
        now = time.monotonic()
        with self._lock:
            hit = self._kinds.get(schema_id)
            if hit is not None:
                return hit
            miss = self._unknown.get(schema_id)
            if miss is not None and miss[0] > now:
                raise DecodeError("unknown-schema", miss[1])
        try:
            reply = self._call("GET", f"/schemas/ids/{schema_id}")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                self._remember_unknown(schema_id, f"schema id {schema_id} is not in the registry", now)
            raise RegistryUnavailable(f"schema registry {self.url}: HTTP {e.code}") from e
        except ValueError as e:  # a reply that is not JSON: the registry (or a proxy) is broken
            raise RegistryUnavailable(f"schema registry {self.url}: not a JSON reply ({e})") from e
        except (urllib.error.URLError, OSError) as e:
            raise RegistryUnavailable(f"schema registry {self.url}: {e}") from e
        try:
            if reply.get("schemaType", "AVRO") != "AVRO":
                raise ValueError(f"a {reply['schemaType']} schema")
            schema = json.loads(reply["schema"])
            name = schema["name"].rsplit(".", 1)[-1]
            version = int(schema["rlrec.version"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            self._remember_unknown(schema_id, f"schema id {schema_id} is not an rlrec Avro event schema ({e})", now)
        with self._lock:
            self._kinds[schema_id] = (name, version)
        return name, version

    def _remember_unknown(self, schema_id: int, message: str, now: float) -> None:
        """Cache a negative answer for NEGATIVE_TTL_S (bounded: the oldest go first) and raise it."""
        with self._lock:
            self._unknown[schema_id] = (now + self.NEGATIVE_TTL_S, message)
            while len(self._unknown) > self.MAX_UNKNOWN:
                self._unknown.pop(next(iter(self._unknown)))
        raise DecodeError("unknown-schema", message)
