"""The event contract: the four single-agent Avro record kinds, their encoding and their safe
decoding (the multi-agent kinds: `rlrec.producer.multi_agent_events`).

Wire format (docs/FORMAT.md):
  * Kafka key   = episode id, UTF-8. All events of an episode go to one partition, in order.
  * Kafka value = the Avro body written schemaless (fastavro) with the schema
    `producer/schemas/<Kind>.v<version>.avsc`. (`EpisodeRecorder` writes the same bytes for
    `StepBatch` and `EpisodeStart` with `rlrec.producer.avro_write`; `encode` uses fastavro.)
  * Kafka header `rlrec-schema` = b"<Kind>/<version>", e.g. b"StepBatch/1". Readers resolve any
    known writer version to the newest reader schema (Avro schema resolution), so old and new
    producers can share a topic.
  * With a schema registry, Confluent framing (magic byte 0, 4-byte big-endian schema id) replaces
    the header; see `rlrec.producer.registry`.

`decode` never executes code from the data: Avro decoding, `numpy.frombuffer` of allow-listed
dtypes and `json.loads` are all it uses. Every kind of bad input raises `DecodeError` with a
`reason` from `DECODE_REASONS`.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import math
import re
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fastavro
import numpy as np
from gymnasium import spaces as gs

from rlrec.producer.arrays import ALLOWED_DTYPES, ArrayError, array_from_wire, array_to_wire
from rlrec.producer.bounded import ByteBoundedLRU
from rlrec.producer.spaces import Leaf, SpaceError, loads_space, space_leaves

__all__ = [
    "DECODE_REASONS",
    "MAX_KEY_BYTES",
    "POLICY_ID_RE",
    "SCHEMA_HEADER",
    "DecodeError",
    "EpisodeAbort",
    "EpisodeStart",
    "Event",
    "RewardDelta",
    "StepBatch",
    "check_env_id",
    "check_leaves",
    "check_policy_id",
    "check_values",
    "decode",
    "decode_body",
    "dumps_info",
    "encode",
    "encode_record",
    "info_nbytes",
    "load_schemas",
    "loads_info",
    "read_header",
    "schema_header",
    "schema_version",
]

SCHEMA_HEADER = "rlrec-schema"
SCHEMA_DIR = Path(__file__).with_name("schemas")

#: every reason `decode` (and `check_leaves`) may give, documented in docs/FORMAT.md.
DECODE_REASONS = {
    "oversize": "the message is larger than the consumer's limit",
    "bad-header": "no rlrec-schema header (or Confluent frame), or an unparsable one",
    "unknown-schema": "schema name or version this reader does not know",
    "malformed": "the body is not a valid Avro record of the named schema (truncated, corrupt, trailing bytes)",
    "bad-dtype": "an array with a dtype outside the allow-list (e.g. object, void)",
    "bad-shape": "an array whose shape, byte length or step count is inconsistent",
    "bad-json": "an info is not a JSON object",
    "bad-space": "an observation or action space description is invalid or unsupported",
    "space-mismatch": "an array contradicts the episode's declared space (dtype or shape)",
    "bad-value": "a field value out of range (empty id, negative t or version, both/neither flags)",
    "non-finite-reward": "a reward that is NaN or infinite",
    "bad-policy-id": "a policy_id that cannot name a directory: it must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$",
    "bad-env-id": "an env_id longer than 256 characters or with control (non-printable) characters",
    "bad-info": "an info value the shard formats cannot represent (an integer outside int64/uint64, a lone surrogate)",
    "key-too-large": "a Kafka key over 1 KiB (keys are episode ids)",
    "extra-output-mismatch": "an extra model output whose dtype or trailing shape differs from the episode's first batch",
    "out-of-space": "an action outside the declared action space (Discrete/MultiDiscrete/MultiBinary range)",
    "non-finite-value": "an observation or action with NaN or infinite values",
    "unknown-agent": "a multi-agent value for an agent that is not among the episode's possible agents",
    "out-of-order": "a multi-agent event out of sequence (no start first, a gap in env steps, a step after the end)",
}

#: `policy_id` names a directory of the output: one safe path component, never hidden or reserved
POLICY_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z")
MAX_ENV_ID_CHARS = 256
MAX_KEY_BYTES = 1024
_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1


class DecodeError(ValueError):
    """A message cannot be used. `reason` is a key of `DECODE_REASONS`."""

    def __init__(self, reason: str, message: str):
        assert reason in DECODE_REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message


# ---------------------------------------------------------------------------------------------
# schemas


@functools.cache
def load_schemas() -> dict[tuple[str, int], dict]:
    """All shipped writer schemas, by (kind, version), parsed."""
    out = {}
    for path in sorted(SCHEMA_DIR.glob("*.v*.avsc")):
        kind, v = path.name[: -len(".avsc")].rsplit(".v", 1)
        named: dict = {}
        out[(kind, int(v))] = fastavro.parse_schema(json.loads(path.read_text()), named_schemas=named)
    return out


@functools.cache
def _latest() -> dict[str, tuple[int, dict]]:
    latest: dict[str, tuple[int, dict]] = {}
    for (kind, v), s in load_schemas().items():
        if kind not in latest or v > latest[kind][0]:
            latest[kind] = (v, s)
    return latest


#: kinds whose producers write an older version than the newest one by default: a single-agent
#: `RewardDelta` stays version 1 (version 2 adds the multi-agent `agent_id`)
_WRITE_VERSION = {"RewardDelta": 1}


def schema_version(kind: str) -> int:
    """The version producers write for an event kind: the newest shipped one, except where
    `_WRITE_VERSION` keeps an older one (single-agent `RewardDelta` is version 1)."""
    return _WRITE_VERSION.get(kind) or _latest()[kind][0]


def schema_header(kind: str, version: int | None = None) -> list[tuple[str, bytes]]:
    """The header list for a kind at `version` (default: `schema_version(kind)`); reuse it: it is
    immutable by convention."""
    return [(SCHEMA_HEADER, f"{kind}/{version or schema_version(kind)}".encode())]


# ---------------------------------------------------------------------------------------------
# infos: JSON objects whose values may include numeric arrays


def _info_default(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        if o.dtype.name not in ALLOWED_DTYPES:
            raise TypeError(f"info array of dtype {o.dtype} is not allowed; use a numeric dtype")
        w = array_to_wire(o)
        return {
            "$ndarray": {"dtype": w["dtype"], "shape": w["shape"], "data": base64.b64encode(w["data"]).decode("ascii")}
        }
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(
        f"info value of type {type(o).__name__} is not JSON-compatible; infos may hold None, bool, "
        "int, float, str, lists, dicts with string keys and numeric numpy arrays"
    )


def dumps_info(info: Mapping | None) -> str:
    """Encode an info dict; '' for an empty one. Raises TypeError for unsupported values."""
    if not info:
        return ""
    if not isinstance(info, Mapping):
        raise TypeError(f"info must be a dict, got {type(info).__name__}")
    return json.dumps(info, default=_info_default, separators=(",", ":"))


def _info_hook(d: dict) -> Any:
    if len(d) == 1 and "$ndarray" in d:
        spec = d["$ndarray"]
        if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
            raise DecodeError("bad-json", "malformed $ndarray in info")
        try:
            return array_from_wire(
                {
                    "dtype": str(spec.get("dtype")),
                    "shape": list(spec.get("shape")),
                    "data": base64.b64decode(spec["data"], validate=True),
                }
            )
        except ArrayError as e:
            raise DecodeError(e.reason, f"info array: {e}") from None
        except (TypeError, ValueError) as e:
            raise DecodeError("bad-json", f"malformed $ndarray in info: {e}") from None
    return d


def loads_info(text: str) -> dict:
    """Decode an info JSON object; DecodeError `bad-json`, or `bad-info` for values the shard
    formats cannot represent (integers outside int64/uint64, strings with lone surrogates)."""
    if not text:
        return {}
    try:
        d = json.loads(text, object_hook=_info_hook)
    except DecodeError:
        raise
    except (ValueError, RecursionError) as e:
        raise DecodeError("bad-json", f"info is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise DecodeError("bad-json", f"info must be a JSON object, got {type(d).__name__}")
    _check_info_values(d)
    return d


def _check_info_values(root: dict) -> None:
    """Iteratively (no recursion limit to hit): every int fits int64 or uint64 and every string
    (keys included) is valid UTF-8 text -- what msgpack (episode shards) and JSON (tabular) keep."""
    stack: list[Any] = [root]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise DecodeError("bad-info", f"info string with a lone surrogate: {v[:40]!r}") from None
        elif isinstance(v, int) and not isinstance(v, bool) and not _INT_MIN <= v <= _UINT_MAX:
            raise DecodeError("bad-info", f"info integer {str(v)[:40]} is outside int64/uint64")


def info_nbytes(info: Any) -> int:
    """Memory held by a decoded info (its Python objects and arrays), approximately. A JSON text
    can cost 20x its size once parsed (many small objects), so budgets count this, not the text."""
    n = 0
    stack: list[Any] = [info]
    while stack:
        v = stack.pop()
        if isinstance(v, np.ndarray):
            n += v.nbytes + 112
            continue
        n += sys.getsizeof(v)
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return n


def check_policy_id(policy_id: Any) -> str:
    """`policy_id` if it can name a directory (POLICY_ID_RE), else DecodeError `bad-policy-id`."""
    if not isinstance(policy_id, str) or not POLICY_ID_RE.match(policy_id):
        raise DecodeError("bad-policy-id", f"policy_id {str(policy_id)[:60]!r} does not match {POLICY_ID_RE.pattern}")
    return policy_id


def check_env_id(env_id: Any) -> str:
    """`env_id` if it is printable text of at most 256 characters (gymnasium ids such as
    ``ALE/Pong-v5`` are), else DecodeError `bad-env-id`."""
    if not isinstance(env_id, str) or len(env_id) > MAX_ENV_ID_CHARS or not env_id.isprintable():
        raise DecodeError("bad-env-id", f"env_id {str(env_id)[:60]!r}: at most {MAX_ENV_ID_CHARS} printable characters")
    return env_id


# ---------------------------------------------------------------------------------------------
# events


@dataclass
class EpisodeStart:
    """An episode begins. `observation` holds the leaves of the first observation."""

    episode_id: str
    policy_id: str
    policy_version: int
    observation: list[np.ndarray]
    observation_space: gs.Space
    action_space: gs.Space
    env_id: str = ""
    info: dict = field(default_factory=dict)
    timestamp_ms: int = 0
    KIND = "EpisodeStart"
    #: the spaces' leaves, as `decode` parsed them (None: compute with `space_leaves` when needed)
    observation_leaves: tuple[Leaf, ...] | None = field(default=None, repr=False, compare=False)
    action_leaves: tuple[Leaf, ...] | None = field(default=None, repr=False, compare=False)


@dataclass
class StepBatch:
    """Steps t0 .. t0+n-1 of one episode; arrays are leaves stacked along a leading step axis."""

    episode_id: str
    t0: int
    actions: list[np.ndarray]
    rewards: np.ndarray
    observations: list[np.ndarray]
    terminated: bool = False
    truncated: bool = False
    infos: list[dict] | None = None
    extra_model_outputs: dict[str, np.ndarray] = field(default_factory=dict)
    timestamp_ms: int = 0
    KIND = "StepBatch"

    @property
    def n(self) -> int:
        return int(self.rewards.shape[0])


@dataclass
class RewardDelta:
    """A delayed reward, added to step `t` of the episode (in a multi-agent episode: to
    `agent_id`'s reward at env step `t`; single-agent deltas have ``agent_id == ""``)."""

    episode_id: str
    t: int
    reward: float
    timestamp_ms: int = 0
    agent_id: str = ""
    KIND = "RewardDelta"


@dataclass
class EpisodeAbort:
    """The episode ends without a terminal step (finalized as truncated)."""

    episode_id: str
    reason: str = ""
    timestamp_ms: int = 0
    KIND = "EpisodeAbort"


Event = EpisodeStart | StepBatch | RewardDelta | EpisodeAbort
_KINDS = {c.KIND: c for c in (EpisodeStart, StepBatch, RewardDelta, EpisodeAbort)}


# ---------------------------------------------------------------------------------------------
# encoding


def encode_record(kind: str, record: dict, version: int | None = None) -> bytes:
    """Avro body of a raw record dict of `kind` at `version` (default: `schema_version(kind)`),
    the producer's fast path."""
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, load_schemas()[(kind, version or schema_version(kind))], record)
    return buf.getvalue()


def _wire_leaves(leaves: Iterable) -> list[dict]:
    return [array_to_wire(np.asarray(x)) for x in leaves]


def _to_record(ev: Event) -> dict:
    from rlrec.producer.spaces import dumps_space

    if isinstance(ev, EpisodeStart):
        return {
            "episode_id": ev.episode_id,
            "policy_id": ev.policy_id,
            "policy_version": int(ev.policy_version),
            "env_id": ev.env_id,
            "observation": _wire_leaves(ev.observation),
            "info": dumps_info(ev.info),
            "observation_space": dumps_space(ev.observation_space),
            "action_space": dumps_space(ev.action_space),
            "timestamp_ms": int(ev.timestamp_ms),
        }
    if isinstance(ev, StepBatch):
        infos = None if ev.infos is None or not any(ev.infos) else [dumps_info(i) for i in ev.infos]
        return {
            "episode_id": ev.episode_id,
            "t0": int(ev.t0),
            "actions": _wire_leaves(ev.actions),
            "rewards": array_to_wire(np.asarray(ev.rewards, dtype=np.float64)),
            "observations": _wire_leaves(ev.observations),
            "terminated": bool(ev.terminated),
            "truncated": bool(ev.truncated),
            "infos": infos,
            "extra_model_outputs": {k: array_to_wire(np.asarray(v)) for k, v in ev.extra_model_outputs.items()},
            "timestamp_ms": int(ev.timestamp_ms),
        }
    if isinstance(ev, RewardDelta):
        rec = {
            "episode_id": ev.episode_id,
            "t": int(ev.t),
            "reward": float(ev.reward),
            "timestamp_ms": int(ev.timestamp_ms),
        }
        if ev.agent_id:
            rec["agent_id"] = ev.agent_id
        return rec
    if isinstance(ev, EpisodeAbort):
        return {"episode_id": ev.episode_id, "reason": ev.reason, "timestamp_ms": int(ev.timestamp_ms)}
    raise TypeError(f"not an event: {type(ev).__name__}")


def encode(ev: Event) -> tuple[bytes, list[tuple[str, bytes]]]:
    """(value, headers) of an event; the key is `ev.episode_id.encode()`. A `RewardDelta` with an
    `agent_id` is written as version 2, one without as version 1."""
    version = 2 if isinstance(ev, RewardDelta) and ev.agent_id else None
    return encode_record(ev.KIND, _to_record(ev), version), schema_header(ev.KIND, version)


# ---------------------------------------------------------------------------------------------
# decoding (untrusted input)


_NO_HEADER = object()


def _schema_header(headers: Any) -> Any:
    """The value of the last ``rlrec-schema`` header, or `_NO_HEADER` where there is none."""
    value = _NO_HEADER
    if headers:
        items = headers.items() if isinstance(headers, Mapping) else headers
        for k, v in items:
            if k == SCHEMA_HEADER:
                value = v
    return value


def _parse_header(value: Any) -> tuple[str, int]:
    if value is _NO_HEADER or value is None:
        raise DecodeError("bad-header", f"no {SCHEMA_HEADER} header")
    try:
        text = value.decode("ascii") if isinstance(value, (bytes, bytearray)) else str(value)
        kind, v = text.split("/")
        return kind, int(v)
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise DecodeError("bad-header", f"unparsable {SCHEMA_HEADER} header {value!r:.80}") from None


def _read_body(kind: str, version: int, body: bytes) -> dict:
    writer = load_schemas().get((kind, version))
    if writer is None:
        raise DecodeError("unknown-schema", f"{kind}/{version} is not a known schema")
    latest_v, reader = _latest()[kind]
    buf = io.BytesIO(body)
    try:
        rec = fastavro.schemaless_reader(buf, writer, reader if latest_v != version else None)
    except Exception as e:  # fastavro raises many types on corrupt input
        raise DecodeError("malformed", f"{kind}/{version}: {type(e).__name__}: {e}"[:300]) from None
    if buf.tell() != len(body):
        raise DecodeError("malformed", f"{kind}/{version}: {len(body) - buf.tell()} trailing bytes")
    return rec


def _arrays(recs: list[dict], what: str) -> list[np.ndarray]:
    try:
        return [array_from_wire(r) for r in recs]
    except ArrayError as e:
        raise DecodeError(e.reason, f"{what}: {e}") from None


class _SpaceCache:
    """Parsed spaces by their JSON text, least recently used first out, bounded by bytes. `get`
    parses a text it misses (an entry costs about 8x its text: the parsed space and its leaves;
    texts over `max_entry_chars` are parsed every time and never cached); `cached` and `keep`
    serve a caller that budgets and builds the spaces itself
    (`rlrec.producer.multi_agent_events`). Thread-safe."""

    def __init__(self, max_bytes: int = 64 * 1024 * 1024, max_entry_chars: int = 256 * 1024) -> None:
        self.max_entry_chars = max_entry_chars
        self._entries: ByteBoundedLRU[str, tuple[gs.Space, tuple[Leaf, ...]]] = ByteBoundedLRU(max_bytes)
        self._lock = threading.Lock()

    @staticmethod
    def _cost(text: str) -> int:
        return 8 * len(text) + 1024

    def cached(self, texts: list[Any]) -> list[tuple[gs.Space, tuple[Leaf, ...]] | None]:
        """The parsed space of each text, None where it is not cached (or not a str)."""
        with self._lock:
            return [self._entries.get(text) if type(text) is str else None for text in texts]

    def keep(self, text: str, parsed: tuple[gs.Space, tuple[Leaf, ...]], cost: int) -> None:
        """Cache `parsed` under `text` at `cost` bytes (a text cached already is left as it is)."""
        with self._lock:
            if text not in self._entries:
                self._entries.put(text, parsed, cost)

    def get(self, text: str, what: str) -> tuple[gs.Space, tuple[Leaf, ...]]:
        hit = self.cached([text])[0]
        if hit is not None:
            return hit
        try:
            space = loads_space(text)
            parsed = (space, tuple(space_leaves(space)))
        except SpaceError as e:
            raise DecodeError("bad-space", f"{what}: {e}") from None
        except RecursionError:
            raise DecodeError("bad-space", f"{what}: nested too deeply") from None
        if len(text) <= self.max_entry_chars:
            self.keep(text, parsed, self._cost(text))
        return parsed


_SPACES = _SpaceCache()


def parse_space(text: str, what: str = "space") -> tuple[gs.Space, tuple[Leaf, ...]]:
    """Parse (cached, byte-bounded) a space JSON into the space and its leaves; DecodeError('bad-space')."""
    return _SPACES.get(text, what)


def check_leaves(arrays: list[np.ndarray], leaves: tuple[Leaf, ...] | list[Leaf], n: int | None, what: str) -> None:
    """Raise DecodeError('space-mismatch') unless `arrays` match `leaves` (stacked `n` deep if given)."""
    if len(arrays) != len(leaves):
        raise DecodeError("space-mismatch", f"{what}: {len(arrays)} leaves, the space has {len(leaves)}")
    for i, (a, leaf) in enumerate(zip(arrays, leaves)):
        shape = leaf.shape if n is None else (n, *leaf.shape)
        if a.dtype != leaf.dtype or a.shape != shape:
            raise DecodeError(
                "space-mismatch", f"{what}[{i}]: got {a.dtype}{list(a.shape)}, space says {leaf.dtype}{list(shape)}"
            )


def check_values(arrays: list[np.ndarray], leaves: tuple[Leaf, ...] | list[Leaf], what: str) -> None:
    """Raise DecodeError unless `arrays` (leaves already matching `leaves`, stacked or not) hold
    values of their space: `non-finite-value` for NaN/inf, `out-of-space` for integers outside a
    Discrete/MultiDiscrete/MultiBinary range. Box bounds are not enforced."""
    for i, (a, leaf) in enumerate(zip(arrays, leaves)):
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            raise DecodeError("non-finite-value", f"{what}[{i}]: {a[~np.isfinite(a)][:3]}")
        if leaf.low is not None and a.size:
            outside = (a < leaf.low) | (a > leaf.high)  # low/high have the leaf's shape: they broadcast
            if outside.any():
                raise DecodeError(
                    "out-of-space",
                    f"{what}[{i}]: values {a[outside][:3].tolist()} outside [{leaf.low.min()}, {leaf.high.max()}]",
                )


def _id(s: str, what: str = "episode_id") -> str:
    if not s or len(s) > 256:
        raise DecodeError("bad-value", f"{what} must be 1..256 characters")
    return s


def read_header(
    value: bytes, headers: Any = None, *, max_bytes: int | None = None, registry: Any = None, key: bytes | None = None
) -> tuple[str, int, bytes]:
    """The kind, schema version and Avro body of one Kafka message of any rlrec kind, or raise
    `DecodeError`; `decode_body` (or `rlrec.producer.multi_agent_events.decode_event`) decodes the body.

    Args:
        value: the message value.
        headers: the message headers (the ``rlrec-schema`` header names the kind and version).
        max_bytes: refuse larger values (`oversize`).
        registry: a `rlrec.producer.registry.SchemaRegistry`: values without the header are read as
            Confluent-framed; its `RegistryUnavailable` (not the message's fault) propagates.
        key: the message key, refused over `MAX_KEY_BYTES` (`key-too-large`).

    Example:
        >>> from rlrec.producer.events import EpisodeAbort, encode, read_header
        >>> value, headers = encode(EpisodeAbort("ep-1", "crash", 0))
        >>> read_header(value, headers, key=b"ep-1")[:2]
        ('EpisodeAbort', 1)
    """
    if key is not None and len(key) > MAX_KEY_BYTES:
        raise DecodeError("key-too-large", f"{len(key)}-byte key > {MAX_KEY_BYTES}")
    if value is None:
        raise DecodeError("malformed", "empty (tombstone) message")
    if max_bytes is not None and len(value) > max_bytes:
        raise DecodeError("oversize", f"{len(value)} bytes > limit {max_bytes}")
    header = _schema_header(headers)
    if header is _NO_HEADER and registry is not None:  # Confluent framing (rlrec.producer.registry)
        from rlrec.producer.registry import unframe

        schema_id, body = unframe(bytes(value))
        kind, version = registry.kind_of(schema_id)
        return kind, version, body
    kind, version = _parse_header(header)
    return kind, version, value


def decode(
    value: bytes, headers: Any = None, *, max_bytes: int | None = None, registry: Any = None, key: bytes | None = None
) -> Event:
    """Decode one Kafka message value (with its headers and, if given, its key) into an event, or
    raise `DecodeError`.

    Checks structure (schema, dtypes, shapes, step counts, finite rewards, JSON infos and their
    values, spaces, policy and env ids, the key's size). Whether a step batch matches its
    episode's spaces needs the episode: see `check_leaves`. With `registry` (a
    `rlrec.producer.registry.SchemaRegistry`), values without the rlrec-schema header are read as
    Confluent-framed; its `RegistryUnavailable` (not the message's fault) propagates.
    """
    return decode_body(*read_header(value, headers, max_bytes=max_bytes, registry=registry, key=key))


def decode_body(kind: str, version: int, body: bytes) -> Event:
    """Decode the Avro body of a single-agent event whose kind and version `read_header` gave, or
    raise `DecodeError` (`unknown-schema` for a kind that is not single-agent).

    Args:
        kind: the event kind, e.g. ``"StepBatch"``.
        version: its schema version.
        body: the Avro body (the value without any Confluent framing).

    Example:
        >>> from rlrec.producer.events import EpisodeAbort, decode_body, encode, read_header
        >>> value, headers = encode(EpisodeAbort("ep-1", "crash", 0))
        >>> decode_body(*read_header(value, headers)).reason
        'crash'
    """
    if kind not in _KINDS:
        raise DecodeError("unknown-schema", f"unknown event kind {kind!r}")
    rec = _read_body(kind, version, bytes(body))
    eid = _id(rec["episode_id"])
    ts = rec["timestamp_ms"]

    if kind == "StepBatch":
        rewards = _arrays([rec["rewards"]], "rewards")[0]
        if rewards.dtype != np.float64 or rewards.ndim != 1 or rewards.shape[0] == 0:
            raise DecodeError(
                "bad-shape", f"rewards must be float64 of shape (n>=1,), got {rewards.dtype}{list(rewards.shape)}"
            )
        n = rewards.shape[0]
        if not np.isfinite(rewards).all():
            raise DecodeError(
                "non-finite-reward", f"episode {eid} t0={rec['t0']}: {rewards[~np.isfinite(rewards)][:3]}"
            )
        actions = _arrays(rec["actions"], "actions")
        observations = _arrays(rec["observations"], "observations")
        extra = {}
        for k, r in rec["extra_model_outputs"].items():
            extra[k] = _arrays([r], f"extra_model_outputs[{k!r}]")[0]
        for what, arrs in (
            ("actions", actions),
            ("observations", observations),
            ("extra_model_outputs", list(extra.values())),
        ):
            for a in arrs:
                if a.ndim == 0 or a.shape[0] != n:
                    raise DecodeError("bad-shape", f"{what}: leading dim {a.shape[:1]} != n={n}")
        infos = rec["infos"]
        if infos is not None:
            if len(infos) != n:
                raise DecodeError("bad-shape", f"{len(infos)} infos for n={n} steps")
            infos = [loads_info(s) for s in infos]
        if rec["t0"] < 0:
            raise DecodeError("bad-value", f"negative t0 {rec['t0']}")
        return StepBatch(
            eid, rec["t0"], actions, rewards, observations, rec["terminated"], rec["truncated"], infos, extra, ts
        )

    if kind == "EpisodeStart":
        if rec["policy_version"] < 0:
            raise DecodeError("bad-value", f"negative policy_version {rec['policy_version']}")
        check_policy_id(rec["policy_id"])
        check_env_id(rec["env_id"])
        obs_space, obs_leaves = parse_space(rec["observation_space"], "observation_space")
        act_space, act_leaves = parse_space(rec["action_space"], "action_space")
        observation = _arrays(rec["observation"], "observation")
        check_leaves(observation, obs_leaves, None, "observation")
        return EpisodeStart(
            eid,
            rec["policy_id"],
            rec["policy_version"],
            observation,
            obs_space,
            act_space,
            rec["env_id"],
            loads_info(rec["info"]),
            ts,
            observation_leaves=obs_leaves,
            action_leaves=act_leaves,
        )

    if kind == "RewardDelta":
        if rec["t"] < 0:
            raise DecodeError("bad-value", f"negative t {rec['t']}")
        if not math.isfinite(rec["reward"]):
            raise DecodeError("non-finite-reward", f"episode {eid} t={rec['t']}: {rec['reward']}")
        agent_id = rec["agent_id"]
        if agent_id:
            _id(agent_id, "agent_id")
        return RewardDelta(eid, rec["t"], rec["reward"], ts, agent_id)

    return EpisodeAbort(eid, rec["reason"], ts)
