"""`EpisodeRecorder`: the policy-side client that publishes transitions to Kafka.

Hot path: `log_step` validates cheaply and appends the step to its episode's in-memory batch.
Every `max_batch_steps` steps, at the end of an episode, or when the oldest buffered step is
`max_batch_delay_s` old (a background thread checks), the batch is stacked column-wise into one
`StepBatch` event and handed to librdkafka, which sends it asynchronously. The policy never waits
on the network; only `on_overflow="block"` with a full buffer waits, for buffer space. Where the
C extension `rlrec.producer._hotpath` is built, a step in the middle of a batch whose values need
no converting is appended by it (the C base `RecorderCore` holds the fields it reads); every
other call runs `_log_step_py`, which is the whole of `log_step`'s behaviour.

Encoding a batch (issue 15): `producer/avro_write.py` writes the Avro bytes directly (the bytes
fastavro writes for the same record; the constant parts are encoded once per recorder or
episode). A column whose values are numpy arrays or scalars of exactly the leaf's dtype (checked
per value) is stacked by one `bytes.join` of their buffers, straight into the message; a column
of Python ints for an integer scalar leaf (Discrete) by `array`; any other column (lists, other
dtypes, non-contiguous views, big-endian) by numpy, casting as before. Where the C extension
`rlrec.producer._stack` is built (`ACCELERATED`), single-leaf columns, rewards and extra model
outputs are first stacked by it in one pass over the batch; it returns bytes only when every
value is exact for its column (the very dtype and shape, or a Python int/float that fits), so
the message is the same either way, and any other batch takes the Python path.

Accounting is in *records*: one per `begin_episode`, `log_step`, `log_reward` and
`abort_episode` call. At every moment `produced == delivered + failed + buffered`, and `dropped`
counts records discarded by `on_overflow="drop"`.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
import types
import uuid
import weakref
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np
from confluent_kafka import KafkaError, KafkaException, Producer
from gymnasium import spaces as gs

from rlrec.producer.arrays import ALLOWED_DTYPES, array_to_wire
from rlrec.producer.avro_write import ARRAY_END, array_parts, bool_byte, long_bytes, shape_bytes, string_bytes
from rlrec.producer.events import (
    DecodeError,
    check_env_id,
    check_policy_id,
    dumps_info,
    encode_record,
    schema_header,
    schema_version,
)
from rlrec.producer.spaces import Leaf, dumps_space, flatten_value, space_leaves

try:  # the column stacking in C (producer/_stack.c); optional: built where a C compiler was
    from rlrec.producer import _stack as _c_stack
except ImportError:  # pragma: no cover - depends on the install
    _c_stack = None
try:  # log_step's fast path in C (producer/_hotpath.c); optional likewise
    from rlrec.producer import _hotpath
except ImportError:  # pragma: no cover - depends on the install
    _hotpath = None

__all__ = ["EpisodeRecorder", "RecorderForkedError", "RecorderFullError", "RecorderStats"]

#: True when batches are stacked by the C extension `rlrec.producer._stack` and a step in the
#: middle of a batch is logged by `rlrec.producer._hotpath` (same effect as the Python path,
#: which anything they do not take exactly falls back to)
ACCELERATED = _c_stack is not None and _hotpath is not None

if _hotpath is not None:
    # the fields log_step's fast path reads live in these C bases (as attributes to Python)
    _RecorderBase, _EpisodeBase, _EPISODE_HOT = _hotpath.RecorderCore, _hotpath.EpisodeState, ()
else:  # pragma: no cover - depends on the install
    _RecorderBase, _EpisodeBase, _EPISODE_HOT = object, object, ("dropping", "steps", "t")

log = logging.getLogger("rlrec.producer")

_KINDS = ("EpisodeStart", "StepBatch", "RewardDelta", "EpisodeAbort")
# constant Avro fragments of StepBatch (see avro_write)
_REWARDS_HEAD = string_bytes("float64") + long_bytes(1)  # dtype, then a 1-dim shape: [n]
_FLAGS = {(a, b): bool_byte(a) + bool_byte(b) for a in (False, True) for b in (False, True)}
_UNION_0, _UNION_1 = long_bytes(0), long_bytes(1)  # infos: null, or an array of strings
#: after sending a lingering batch this big, the poller offers the GIL to waiting threads
_YIELD_BYTES = 64 * 1024

#: the recorder's fields log_step's C path uses: the C base's members and `_lock` (see
#: EpisodeRecorder.__init_subclass__)
_HOT_FIELDS = frozenset(
    name
    for name, attr in vars(_RecorderBase).items()
    if isinstance(attr, (types.MemberDescriptorType, types.GetSetDescriptorType)) and _hotpath is not None
)
_recorders: weakref.WeakSet[EpisodeRecorder] = weakref.WeakSet()
_monotonic = time.monotonic
_time = time.time
_dtype_of = attrgetter("dtype")
_shape_of = attrgetter("shape")
_F64 = np.dtype(np.float64)
_LITTLE = sys.byteorder == "little"
#: dtypes whose native bytes are their wire bytes -> wire name (none on a big-endian host)
_WIRE_NAMES = {np.dtype(name): name for name in ALLOWED_DTYPES} if _LITTLE else {}
#: numpy scalar types of those dtypes -> wire name
_SCALAR_NAMES = {dt.type: name for dt, name in _WIRE_NAMES.items()}
#: `array` typecodes of the integer dtypes, for columns of Python ints (e.g. Discrete actions)
_INT_CODES = {np.dtype(c).name: c for c in "bBhHiIqQ" if array(c).itemsize == np.dtype(c).itemsize} if _LITTLE else {}


_cast_ok: dict[tuple[np.dtype, np.dtype], bool] = {}
_allowed_ok: dict[np.dtype, bool] = {}


def _can_cast(src: np.dtype, dst: np.dtype) -> bool:
    """np.can_cast(src, dst, "same_kind"), remembered (it costs ~0.5 µs; first steps ask it)."""
    ok = _cast_ok.get((src, dst))
    if ok is None:
        ok = bool(np.can_cast(src, dst, "same_kind"))
        if len(_cast_ok) < 1024:
            _cast_ok[(src, dst)] = ok
    return ok


def _dtype_allowed(dt: np.dtype) -> bool:
    """`dt.name in ALLOWED_DTYPES`, remembered (numpy computes `dtype.name` in Python, ~2 µs)."""
    ok = _allowed_ok.get(dt)
    if ok is None:
        ok = dt.name in ALLOWED_DTYPES
        if len(_allowed_ok) < 1024:
            _allowed_ok[dt] = ok
    return ok


def _stack_column(col: Sequence, n: int) -> tuple[str, tuple, Any] | None:
    """(wire dtype name, per-step shape, stacked bytes) of `n` numpy arrays or scalars all of one
    dtype and shape, joined without numpy; None when they are anything else (numpy stacks them)."""
    first = col[0]
    t = type(first)
    name = _SCALAR_NAMES.get(t)
    if name is not None:  # numpy scalars: one type is one dtype, one shape ()
        if list(map(type, col)).count(t) != n:
            return None
        return name, (), b"".join(col)
    if t is not np.ndarray:
        return None
    name = _WIRE_NAMES.get(first.dtype)
    if name is None:
        return None
    try:
        data = b"".join(col)  # needs C-contiguous buffers
        dts, shapes = list(map(_dtype_of, col)), list(map(_shape_of, col))
    except (TypeError, ValueError, BufferError, AttributeError):
        return None
    if dts.count(first.dtype) != n or shapes.count(first.shape) != n:
        return None
    return name, first.shape, data


def _mark_forked() -> None:
    for r in list(_recorders):
        r._forked = r._unusable = True


os.register_at_fork(after_in_child=_mark_forked)


class RecorderFullError(BufferError):
    """`on_overflow="raise"` and `max_buffered_steps` records are waiting for delivery."""


class RecorderForkedError(RuntimeError):
    """A recorder created before `os.fork()` was used in the child process."""


@dataclass(frozen=True)
class RecorderStats:
    """A snapshot of a recorder's counters (in records; see module docstring)."""

    produced: int
    delivered: int
    failed: int
    dropped: int
    buffered: int
    episodes_begun: int
    messages_produced: int
    messages_delivered: int
    messages_failed: int


class _Packer:
    """Per-space validation of step values and column-wise stacking into wire arrays."""

    def __init__(self, space: gs.Space, what: str):
        self.space = space
        self.what = what
        self.leaves = space_leaves(space)
        self.single = not isinstance(space, (gs.Dict, gs.Tuple))
        self.shape = self.leaves[0].shape if self.single else None
        # per leaf, for `write`: (dtype, bytes per step, Avro bytes of the dtype name and the
        # shape's length, Avro bytes of the trailing dims and the shape's end; None when the
        # leaf's dtype has no fast path: not allowed on the wire, or not little-endian)
        self._fast = []
        for leaf in self.leaves:
            dt = leaf.dtype
            head = string_bytes(dt.name) + long_bytes(1 + len(leaf.shape))
            tail = b"".join(long_bytes(d) for d in leaf.shape) + ARRAY_END
            fast = dt in _WIRE_NAMES
            self._fast.append((dt, dt.itemsize * math.prod(leaf.shape), head, tail) if fast else None)
        # scalar integer leaves (Discrete): a column of Python ints packs with `array`
        self._int_code = _INT_CODES.get(self.leaves[0].dtype.name) if self.single and not self.shape else None
        self._count = long_bytes(len(self.leaves)) if self.leaves else b""
        # per leaf, for `write_one`: Avro bytes of the dtype name and the leaf's shape
        self._one_heads = [string_bytes(leaf.dtype.name) + shape_bytes(leaf.shape) for leaf in self.leaves]
        # single-leaf spaces with a fast dtype, for `write_c`: (dtype, per-step shape)
        self._c_args = (self.leaves[0].dtype, self.leaves[0].shape) if self.single and self._fast[0] else None

    def prepare(self, value: Any) -> Any:
        """Cheap check of one value; returns what the batch buffer stores (value or its leaves)."""
        if self.single:
            shape = getattr(value, "shape", None)
            if shape is None:
                if not self.shape and isinstance(value, (int, float)):
                    return value  # a Python scalar for a scalar space (Discrete): nothing to check
                shape = np.shape(value)
            if shape != self.shape:
                raise ValueError(f"{self.what} has shape {tuple(shape)}, the space needs {self.shape}")
            return value
        leaves = flatten_value(self.space, value)
        for x, leaf in zip(leaves, self.leaves):
            if np.shape(x) != leaf.shape:
                raise ValueError(f"{self.what} leaf has shape {np.shape(x)}, the space needs {leaf.shape}")
        return leaves

    def check_dtypes(self, prepared: Any, only: Leaf | None = None) -> None:
        """TypeError unless every leaf value casts to its leaf's dtype (`only`: one leaf's value)."""
        values = [prepared] if self.single or only is not None else prepared
        for x, leaf in zip(values, self.leaves if only is None else [only]):
            dt = x.dtype if type(x) is np.ndarray else np.asarray(x).dtype
            if not _can_cast(dt, leaf.dtype):
                raise TypeError(f"{self.what} of dtype {dt} can't be stored as the space's {leaf.dtype}")

    def write(self, parts: list, buf: Sequence) -> None:
        """Append the Avro array of stacked leaves of the `prepare`d values in `buf` to `parts`."""
        n = len(buf)
        parts.append(self._count)
        if self.single:
            self._write_leaf(parts, buf, n, 0)
        else:
            for i, col in enumerate(zip(*buf)):
                self._write_leaf(parts, col, n, i)
        parts.append(ARRAY_END)

    def write_c(self, parts: list, steps: list, index: int) -> bool:
        """As `write` for field `index` of the buffered step tuples, stacked by the C extension;
        False (nothing appended) unless it took every value exactly."""
        if self._c_args is None:
            return False
        dt, shape = self._c_args
        data = _c_stack.stack(steps, index, None, 0, dt, shape, False)
        if data is None:
            return False
        head, tail = self._fast[0][2:]
        parts += (self._count, head, long_bytes(len(steps)), tail, long_bytes(len(data)), data, ARRAY_END)
        return True

    def _write_leaf(self, parts: list, col: Sequence, n: int, i: int) -> None:
        fast = self._fast[i]
        if fast is not None:
            # values are checked to have the leaf's shape when logged: if every one is a numpy
            # array (or scalar) of exactly the leaf's dtype, their buffers are the stacked
            # column's bytes, and one join copies them into the message
            dt, nbytes, head, tail = fast
            first = col[0]
            if type(first) is int and self._int_code:
                try:
                    data = array(self._int_code, col)  # TypeError/OverflowError: numpy decides
                except (TypeError, OverflowError):
                    pass
                else:
                    parts += (head, long_bytes(n), tail, long_bytes(n * nbytes), data)
                    return
            elif type(first) is np.ndarray or isinstance(first, np.generic):
                try:
                    data = b"".join(col)
                    same = list(map(_dtype_of, col)).count(dt) == n
                except (TypeError, ValueError, BufferError, AttributeError):
                    same = False  # not contiguous, not a buffer, no dtype: stack it with numpy
                if same and len(data) == n * nbytes:
                    parts += (head, long_bytes(n), tail, long_bytes(len(data)), data)
                    return
        w = array_to_wire(self._col(col, self.leaves[i].dtype))
        array_parts(parts, w["dtype"], w["shape"], w["data"])

    def write_one(self, parts: list, value: Any) -> None:
        """Append the Avro array of the leaves of one value (no step axis) to `parts`; raises
        as `prepare` and `check_dtypes` do."""
        prepared = self.prepare(value)
        values = [prepared] if self.single else prepared
        parts.append(self._count)
        for v, leaf, fast, head in zip(values, self.leaves, self._fast, self._one_heads):
            if fast is not None and type(v) is np.ndarray and v.dtype == fast[0]:
                data = v.tobytes()  # C order, whatever the strides; the shape was checked
                parts += (head, long_bytes(len(data)), data)
            else:
                self.check_dtypes(v, leaf)
                w = array_to_wire(self._col(v, leaf.dtype))
                array_parts(parts, w["dtype"], w["shape"], w["data"])
        parts.append(ARRAY_END)

    @staticmethod
    def _col(values: Any, dtype: np.dtype) -> np.ndarray:
        a = np.asarray(values)
        if a.dtype != dtype:
            a = a.astype(dtype, casting="same_kind")
        return a


def _write_rewards(parts: list, ep: _Episode, rewards: bytes | array, n: int) -> None:
    """Append the batch's `n` float64 rewards (their bytes, or an array) with the delayed
    rewards of its buffered steps added."""
    if ep.reward_adds:
        rewards = array("d", rewards)
        for t, add in ep.reward_adds.items():
            rewards[t - ep.t0] += add
    parts += (_REWARDS_HEAD, long_bytes(n), ARRAY_END, long_bytes(8 * n), rewards)


class _Episode(_EpisodeBase):
    __slots__ = ("extra_keys", "first_buffered", "id", "id_avro", "reward_adds", "t0", "version", *_EPISODE_HOT)

    def __init__(self, eid: str, version: int):
        self.id = eid
        self.id_avro = string_bytes(eid)  # the Avro string, as every batch of the episode starts
        self.version = version
        self.t = 0  # steps logged so far
        self.t0 = 0  # t of the first buffered step
        # buffered steps t0..t-1 as (action, reward, observation, info_json, extra_model_outputs)
        self.steps: list[tuple] = []
        self.reward_adds: dict[int, float] = {}  # delayed rewards for buffered steps, by t
        self.extra_keys: frozenset = frozenset()
        self.first_buffered = 0.0
        self.dropping = False


class EpisodeRecorder(_RecorderBase):
    """Publishes the episodes of one policy to a Kafka topic as rlrec events.

    Guarantees: every record is either delivered to the broker (idempotent producer, acks=all),
    reported as failed (counted, and passed to `on_delivery_error`), or - only with
    `on_overflow="drop"` - counted as dropped; nothing disappears silently. Events of an episode
    share its key (the episode id) and so arrive in order on one partition. Thread-safe: several
    threads may log different episodes. After `os.fork()` the child must create its own recorder.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str = "rlrec.transitions",
        policy_id: str = "default",
        policy_version: int = 1,
        observation_space: gs.Space | None = None,
        action_space: gs.Space | None = None,
        env_id: str = "",
        kafka_config: Mapping[str, Any] | None = None,
        max_buffered_steps: int = 100_000,
        on_overflow: str = "block",
        *,
        max_batch_steps: int = 256,
        max_batch_delay_s: float = 0.2,
        max_batch_bytes: int = 256 * 1024,
        validate_spaces: bool = False,
        on_delivery_error: Callable[[KafkaError, str, int], None] | None = None,
        schema_registry_url: str | None = None,
    ):
        if observation_space is None or action_space is None:
            raise TypeError(
                "observation_space and action_space are required (the consumer rebuilds episodes with them)"
            )
        if on_overflow not in ("block", "drop", "raise"):
            raise ValueError(f"on_overflow must be 'block', 'drop' or 'raise', got {on_overflow!r}")
        for check, value in ((check_policy_id, policy_id), (check_env_id, env_id)):
            try:  # the consumer dead-letters what breaks these rules: say so here, at once
                check(value)
            except DecodeError as e:
                raise ValueError(e.detail) from None
        if max_buffered_steps < 1 or max_batch_steps < 1:
            raise ValueError("max_buffered_steps and max_batch_steps must be >= 1")
        self.topic = topic
        self.policy_id = policy_id
        self._policy_version = self._check_version(policy_version)
        self.observation_space = observation_space
        self.action_space = action_space
        self.env_id = env_id
        self.max_buffered_steps = max_buffered_steps
        self.on_overflow = on_overflow
        self.max_batch_steps = int(max_batch_steps)
        self.max_batch_delay_s = float(max_batch_delay_s)
        self.max_batch_bytes = int(max_batch_bytes)
        self.validate_spaces = validate_spaces
        self.on_delivery_error = on_delivery_error

        # per kind: (value prefix, headers) - the rlrec-schema header, or Confluent framing
        if schema_registry_url:
            from rlrec.producer.registry import SchemaRegistry, frame

            reg = SchemaRegistry(schema_registry_url)
            self._wire = {k: (frame(reg.schema_id(k, schema_version(k)), b""), None) for k in _KINDS}
        else:
            self._wire = {k: (b"", schema_header(k)) for k in _KINDS}
        self._obs = _Packer(observation_space, "observation")
        self._act = _Packer(action_space, "action")
        # single-leaf spaces: the shape a value must have (None for Dict/Tuple: always flattened)
        self._obs_shape = self._obs.shape if self._obs.single else object()
        self._act_shape = self._act.shape if self._act.single else object()
        self._act_scalar = self._act.single and self._act.shape == ()
        self._obs_space_json = dumps_space(observation_space)
        self._act_space_json = dumps_space(action_space)
        # EpisodeStart's constant fields as Avro: (policy_id, env_id), then both spaces
        self._start_avro = (
            (string_bytes(policy_id), string_bytes(env_id)),
            string_bytes(self._obs_space_json) + string_bytes(self._act_space_json),
        )

        conf = {
            "bootstrap.servers": bootstrap_servers,
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": "lz4",
            "linger.ms": 20,
            "queue.buffering.max.messages": 1_000_000,
        }
        conf.update(kafka_config or {})
        self._user_error_cb = conf.pop("error_cb", None)
        conf["error_cb"] = self._on_kafka_error
        self._conf = conf
        self._producer = Producer(conf)
        self._fatal: KafkaError | None = None  # set by error_cb; the poller replaces the producer
        self.producer_restarts = 0

        self._lock = threading.Lock()
        self._space_freed = threading.Condition(self._lock)
        self._episodes: dict[str, _Episode] = {}
        self._finished: dict[str, int] = {}  # recent finished episode -> length, for log_reward checks
        self._delivered = self._failed = self._dropped = 0  # produced = delivered + failed + buffered
        self._buffered = 0
        self._episodes_begun = 0
        self._msgs = [0, 0, 0]  # produced, delivered, failed
        self._last_drop_log = 0.0
        self._closed = False
        self._forked = False
        self._unusable = False  # closed or forked: checked first on the hot path
        # bytes per step, estimated from the spaces until the first batch measures it
        est = sum(leaf.dtype.itemsize * int(np.prod(leaf.shape)) for leaf in self._obs.leaves + self._act.leaves) + 16
        self._set_batch_limit(est)
        self._step_bytes = None  # estimated bytes per buffered step, set at first emit

        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="rlrec-recorder", daemon=True)
        self._poller.start()
        _recorders.add(self)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # log_step's C path reads and writes these as C fields: a subclass's property or class
        # attribute of the same name would hide them from Python but not from C
        super().__init_subclass__(**kwargs)
        shadowed = sorted(_HOT_FIELDS & vars(cls).keys())
        if shadowed:
            raise TypeError(f"{cls.__name__} may not redefine EpisodeRecorder's {', '.join(shadowed)}")

    # -- public API -----------------------------------------------------------------------------

    @property
    def max_buffered_steps(self) -> int:
        """Records that may await delivery before `on_overflow` applies (>= 1)."""
        return self._max_buffered_steps

    @max_buffered_steps.setter
    def max_buffered_steps(self, value: int) -> None:
        value = int(value)
        if value < 1:
            raise ValueError(f"max_buffered_steps must be >= 1, got {value}")
        self._max_buffered_steps = min(value, sys.maxsize)  # a C Py_ssize_t where ACCELERATED

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        value = self._check_version(value)
        if value < self._policy_version:
            raise ValueError(f"policy_version only grows: {value} < {self._policy_version}")
        self._policy_version = value

    def begin_episode(
        self,
        observation: Any,
        info: Mapping | None = None,
        episode_id: str | None = None,
        policy_version: int | None = None,
    ) -> str:
        """Start an episode from its first observation; returns its id."""
        self._check_usable()
        version = self._policy_version if policy_version is None else self._check_version(policy_version)
        if self.validate_spaces and not self.observation_space.contains(observation):
            raise ValueError(f"observation {observation!r:.200} is not in {self.observation_space}")
        obs_parts: list = []
        self._obs.write_one(obs_parts, observation)
        info_json = dumps_info(info)
        eid = uuid.uuid4().hex if episode_id is None else str(episode_id)
        if type(eid) is not str:  # a str subclass's __str__ may return itself: keys are plain str
            eid = str.__str__(eid)
        if not eid or len(eid) > 256:
            raise ValueError("episode_id must be 1..256 characters")
        with self._lock:
            if eid in self._episodes:
                raise ValueError(f"episode {eid} is already open")
            # admit first: if that raises (RecorderFullError) or the producer refuses the message,
            # no half-registered episode is left open
            if not self._admit(None):
                ep = _Episode(eid, version)
                ep.dropping = True  # nothing of it is sent
                self._episodes_begun += 1
                self._episodes[eid] = ep
                return eid
            if eid in self._episodes:  # opened by another thread while this one waited for room
                self._buffered -= 1
                self._space_freed.notify_all()
                raise ValueError(f"episode {eid} is already open")
            # the EpisodeStart record (see avro_write), its constant fields encoded once
            pid_env, spaces = self._start_avro
            parts = [string_bytes(eid), pid_env[0], long_bytes(version), pid_env[1], *obs_parts]
            parts += (string_bytes(info_json), spaces, long_bytes(int(_time() * 1000)))
            self._send(eid, b"".join(parts), "EpisodeStart", 1)
            self._episodes_begun += 1
            self._episodes[eid] = _Episode(eid, version)
        return eid

    def _log_step_py(
        self,
        episode_id: str,
        action: Any,
        reward: float,
        observation: Any,
        terminated: bool = False,
        truncated: bool = False,
        info: Mapping | None = None,
        extra_model_outputs: Mapping[str, Any] | None = None,
    ) -> None:
        """Record one step: `action` taken, `reward` received, `observation` after it.

        Values are stacked when the batch is sent (within `max_batch_delay_s`): don't mutate an
        array after passing it in.
        """
        # hot path: every attribute lookup and call here costs a visible share of a step
        if self._unusable:
            self._check_usable()
        if type(reward) is not float:
            try:
                reward = float(reward)
            except (TypeError, ValueError):
                raise TypeError(f"reward must be a number, got {type(reward).__name__}") from None
        if reward - reward != 0.0:  # NaN or +-inf (cheaper than math.isfinite)
            raise ValueError(f"reward must be finite, got {reward} (episode {episode_id})")
        if self.validate_spaces:
            self._validate(action, observation)
        # cheap shape checks (the common single-leaf spaces inline, nested spaces flattened)
        try:
            prepare = observation.shape != self._obs_shape
        except AttributeError:  # no shape: a list, a Python scalar, a dict of leaves
            prepare = True
        if prepare:
            observation = self._obs.prepare(observation)
        if not (type(action) is int and self._act_scalar) and getattr(action, "shape", None) != self._act_shape:
            action = self._act.prepare(action)
        info_json = dumps_info(info) if info else ""
        # acquire/release: `with` on a Lock costs about twice as much (its __exit__ takes *args)
        lock = self._lock
        lock.acquire()
        try:
            try:
                ep = self._episodes[episode_id]
            except KeyError:
                raise ValueError(
                    f"episode {episode_id!r} is not open (never begun, already ended or aborted)"
                ) from None
            t = ep.t
            if not t and not ep.dropping:  # before counting the record: these checks may raise
                self._first_step_checks(ep, observation, action, extra_model_outputs)
            buffered = self._buffered
            if buffered < self._max_buffered_steps and not ep.dropping:
                self._buffered = buffered + 1
            elif not self._admit(ep):
                if terminated or truncated:
                    self._end(ep)
                return
            steps = ep.steps
            if not steps:
                ep.first_buffered = _monotonic()
            steps.append((action, reward, observation, info_json, extra_model_outputs))
            ep.t = t + 1
            if terminated or truncated:
                self._emit(ep, bool(terminated), bool(truncated))
                self._end(ep)
            elif len(steps) >= self._batch_limit:
                self._emit(ep, False, False)
        finally:
            lock.release()

    _log_step_py.__qualname__ = "EpisodeRecorder.log_step"  # in the errors a bad call raises

    if _hotpath is not None:
        # a step in the middle of a batch is taken by the C base (producer/_hotpath.c), which
        # hands every other call to _log_step_py as it came
        log_step = _hotpath.RecorderCore.log_step
    else:  # pragma: no cover - depends on the install
        log_step = _log_step_py

    def log_reward(self, episode_id: str, t: int, reward: float) -> None:
        """Add a delayed `reward` to step `t` (0-based) of an episode, open or finished."""
        self._check_usable()
        r = float(reward)
        if not math.isfinite(r):
            raise ValueError(f"reward must be finite, got {r}")
        t = int(t)
        if t < 0:
            raise ValueError(f"t must be >= 0, got {t}")
        with self._lock:
            ep = self._episodes.get(episode_id)
            length = ep.t if ep is not None else self._finished.get(episode_id)
            if length is not None and t >= length:
                raise ValueError(f"episode {episode_id} has {length} steps; no step t={t}")
            if ep is not None and t >= ep.t0 and not ep.dropping:
                ep.reward_adds[t] = ep.reward_adds.get(t, 0.0) + r  # still buffered: no message needed
                return
            if not self._admit(None):
                return
            rec = {"episode_id": episode_id, "t": t, "reward": r, "timestamp_ms": int(time.time() * 1000)}
            self._send(episode_id, encode_record("RewardDelta", rec), "RewardDelta", 1)

    def abort_episode(self, episode_id: str, reason: str = "") -> None:
        """End an open episode without a terminal step; the consumer finalizes it as truncated."""
        self._check_usable()
        with self._lock:
            ep = self._episodes.get(episode_id)
            if ep is None:
                raise ValueError(f"episode {episode_id!r} is not open")
            self._abort(ep, reason)

    def flush(self, timeout: float | None = None) -> int:
        """Send every buffered step and wait for delivery; returns messages still undelivered."""
        if self._forked:  # librdkafka's handle is unusable after fork(): flush(-1) would never return
            self._check_usable()
        if self._closed:  # close() flushed; what it could not deliver was purged and counted failed
            return 0
        with self._lock:
            for ep in list(self._episodes.values()):
                if ep.steps and not ep.dropping:
                    self._emit(ep, False, False)
        return self._producer.flush(-1 if timeout is None else timeout)

    def close(self, timeout: float | None = None) -> int:
        """Abort still-open episodes (reason "recorder-closed"), flush, stop. Idempotent.

        Returns the number of messages still undelivered when `timeout` expired; those are purged
        from librdkafka's queues and counted as failed (their records reach `on_delivery_error`).
        """
        if self._closed or self._forked:
            return 0
        with self._lock:
            for ep in list(self._episodes.values()):
                try:
                    self._abort(ep, "recorder-closed")
                except ValueError as e:  # its last batch was refused: counted failed, episode aborted
                    log.error("%s", e)
        left = self.flush(timeout)
        self._closed = self._unusable = True
        self._stop.set()
        self._poller.join(timeout=5)
        if left:
            # Nobody polls a closed recorder: without this, undelivered messages would stay
            # "buffered" forever, and librdkafka's references to their delivery callbacks would
            # keep this recorder and its Producer (threads, connections) alive for good.
            log.warning("recorder closed with %d messages undelivered: purged, counted as failed", left)
            try:
                self._producer.purge()
            except (KafkaException, RuntimeError) as e:
                log.error("could not purge undelivered messages: %s", e)
        self._producer.poll(0)  # serve the remaining delivery callbacks (purged ones fail)
        self._release_producer()
        return left

    def _release_producer(self) -> None:
        """Shut librdkafka's instance down now (threads, connections), not when the garbage
        collector gets to it: a closed recorder kept around must not keep reconnecting."""
        close = getattr(self._producer, "close", None)  # confluent-kafka >= 2.11
        if close is None or len(self._producer):
            return
        try:
            close()
        except (KafkaException, RuntimeError) as e:
            log.debug("producer close: %s", e)

    @property
    def stats(self) -> RecorderStats:
        with self._lock:
            return RecorderStats(
                self._delivered + self._failed + self._buffered,
                self._delivered,
                self._failed,
                self._dropped,
                self._buffered,
                self._episodes_begun,
                *self._msgs,
            )

    @property
    def open_episodes(self) -> int:
        return len(self._episodes)

    def __enter__(self) -> EpisodeRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals (called with the lock held unless said otherwise) ----------------------------

    @staticmethod
    def _check_version(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"policy_version must be a non-negative integer, got {v!r}")
        return int(v)

    def _set_batch_limit(self, step_bytes: int) -> None:
        """Batches of at most `max_batch_steps` steps and about `max_batch_bytes` (a C Py_ssize_t)."""
        self._batch_limit = max(1, min(self.max_batch_steps, self.max_batch_bytes // step_bytes, sys.maxsize))

    def _check_usable(self) -> None:
        if self._forked:
            raise RecorderForkedError(
                "this EpisodeRecorder was created before os.fork(); create a new recorder in the child process"
            )
        if self._closed:
            raise RuntimeError("the recorder is closed")

    def _validate(self, action: Any, observation: Any) -> None:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r:.200} is not in {self.action_space}")
        if not self.observation_space.contains(observation):
            raise ValueError(f"observation {observation!r:.200} is not in {self.observation_space}")

    def _first_step_checks(self, ep: _Episode, obs: Any, act: Any, extra: Mapping | None) -> None:
        self._obs.check_dtypes(obs)
        self._act.check_dtypes(act)
        keys = frozenset(extra or ())
        for k, v in (extra or {}).items():
            if not isinstance(k, str):
                raise TypeError(f"extra_model_outputs keys must be strings, got {k!r}")
            dt = v.dtype if isinstance(v, (np.ndarray, np.generic)) else np.asarray(v).dtype
            if not _dtype_allowed(dt):
                raise TypeError(f"extra_model_outputs[{k!r}] has dtype {dt}; use a numeric dtype")
        ep.extra_keys = keys

    def _admit(self, ep: _Episode | None) -> bool:
        """Reserve room for one record, applying the overflow policy. False: the record is dropped."""
        if ep is not None and ep.dropping:
            self._count_drop()
            return False
        if self._buffered >= self._max_buffered_steps:
            if self.on_overflow == "raise":
                raise RecorderFullError(
                    f"{self._buffered} records await delivery (max_buffered_steps="
                    f"{self._max_buffered_steps}); flush() or slow down"
                )
            if self.on_overflow == "drop":
                self._count_drop()
                if ep is not None:  # the rest of the episode goes too; what was sent ends as truncated
                    self._abort_dropping(ep)
                return False
            self._emit_all_buffered()
            while self._buffered >= self._max_buffered_steps:
                self._space_freed.wait(0.1)
        self._buffered += 1
        return True

    def _count_drop(self) -> None:
        self._dropped += 1
        now = time.monotonic()
        if now - self._last_drop_log > 10:
            self._last_drop_log = now
            log.warning("recorder buffer full: %d records dropped so far (on_overflow='drop')", self._dropped)

    def _emit_all_buffered(self) -> None:
        for other in list(self._episodes.values()):
            if other.steps and not other.dropping:
                self._emit(other, False, False)

    def _emit(self, ep: _Episode, terminated: bool, truncated: bool) -> None:
        try:
            value = self._encode_batch(ep, terminated, truncated)
        except (ValueError, TypeError) as e:
            # a step that passed the cheap checks can't be stacked (ragged values, dtype change):
            # its batch is lost - count it as failed, close the episode, tell the caller
            n = len(ep.steps)
            self._buffered -= n
            self._failed += n
            ep.steps, ep.reward_adds = [], {}
            self._abort(ep, "encode-error")
            raise ValueError(
                f"episode {ep.id}: steps {ep.t0}..{ep.t - 1} could not be encoded and the episode was aborted: {e}"
            ) from e
        n = len(ep.steps)
        if self._step_bytes is None:  # size batches of big observations under max_batch_bytes
            self._step_bytes = max(1, len(value) // n)
            self._set_batch_limit(self._step_bytes)
        try:
            self._send(ep.id, value, "StepBatch", n)
        except ValueError as e:
            # refused by librdkafka (e.g. larger than message.max.bytes): `_send` took the n records
            # off `buffered`; they are failed, and the episode is aborted as for an encode error
            self._failed += n
            ep.steps, ep.reward_adds = [], {}
            self._abort(ep, "produce-error")
            raise ValueError(
                f"episode {ep.id}: steps {ep.t0}..{ep.t - 1} could not be sent and the episode was aborted: {e}"
            ) from e
        ep.t0 = ep.t
        ep.steps, ep.reward_adds = [], {}

    def _encode_batch(self, ep: _Episode, terminated: bool, truncated: bool) -> bytes:
        """The Avro body of a StepBatch of the episode's buffered steps (see `avro_write`)."""
        parts = [ep.id_avro, long_bytes(ep.t0)]
        fast = _c_stack is not None and self._act._c_args and self._obs._c_args  # single-leaf spaces
        columns = self._columns_c(parts, ep) if fast else None
        if columns is None:
            parts = [ep.id_avro, long_bytes(ep.t0)]
            columns = self._columns_py(parts, ep)
        extra, infos = columns
        parts.append(_FLAGS[bool(terminated), bool(truncated)])
        if infos:
            parts += (_UNION_1, long_bytes(len(infos)))
            parts += map(string_bytes, infos)
            parts.append(ARRAY_END)
        else:
            parts.append(_UNION_0)
        if extra:
            n = len(ep.steps)
            parts.append(long_bytes(len(extra)))
            for k, (name, shape, data) in extra:
                parts.append(string_bytes(k))
                array_parts(parts, name, (n, *shape), data)
        parts.append(ARRAY_END)
        parts.append(long_bytes(int(_time() * 1000)))
        return b"".join(parts)

    def _columns_c(self, parts: list, ep: _Episode) -> tuple[list, list | None] | None:
        """Append the batch's actions, rewards and observations to `parts`, stacked by the C
        extension, and return (extra model outputs as [(key, (wire dtype, per-step shape,
        bytes))], infos as a list or None); None when a column holds a value it does not take
        exactly (`parts` is then to be discarded)."""
        steps = ep.steps
        n = len(steps)
        rewards = _c_stack.stack(steps, 1, None, 0, _F64, (), False)  # floats: log_step converted them
        if rewards is None or not self._act.write_c(parts, steps, 0):
            return None
        _write_rewards(parts, ep, rewards, n)
        if not self._obs.write_c(parts, steps, 2):
            return None
        keys = ep.extra_keys
        extra = []
        if keys:
            first = steps[0][4]
            if type(first) is not dict:
                return None
            for k in keys:  # the order the Python path writes them in
                v = first.get(k)
                if type(v) is np.ndarray:
                    dt, shape = v.dtype, v.shape
                elif isinstance(v, np.generic):
                    dt, shape = v.dtype, ()
                else:
                    return None
                name = _WIRE_NAMES.get(dt)
                # numpy infers these columns' dtypes: a Python int only joins an int64 one
                data = _c_stack.stack(steps, 4, k, len(keys), dt, shape, True) if name else None
                if data is None:
                    return None
                extra.append((k, (name, shape, data)))
        elif _c_stack.any_set(steps, 4) is not False:
            return None  # extra outputs on a later step only: the Python path says so
        has_infos = _c_stack.any_set(steps, 3)
        if has_infos is None:
            return None
        return extra, [s[3] for s in steps] if has_infos else None

    def _columns_py(self, parts: list, ep: _Episode) -> tuple[list, list | None]:
        """As `_columns_c`, in Python (numpy stacks and casts what the fast paths don't take);
        raises ValueError/TypeError for values that cannot be stacked."""
        actions, rewards, observations, infos, extras = zip(*ep.steps)
        n = len(rewards)
        keys = ep.extra_keys
        if keys:
            # fast path: as many keys as the first step's and none missing (KeyError) means the
            # same keys; anything else takes the per-step check below
            try:
                same = set(map(len, extras)) == {len(keys)}
                columns = {k: list(map(itemgetter(k), extras)) for k in keys} if same else None
            except (KeyError, TypeError):
                same = False
            if not same:
                for i, e in enumerate(extras):
                    if not isinstance(e, Mapping):  # e.g. None, or a number: no keys at all
                        raise ValueError(
                            f"step {ep.t0 + i}: extra_model_outputs is {type(e).__name__}, not a mapping "
                            f"with the episode's first step's keys {sorted(keys)}"
                        )
                    if e.keys() != keys:
                        raise ValueError(
                            f"step {ep.t0 + i}: extra_model_outputs keys {sorted(map(str, e))} differ "
                            f"from the episode's first step {sorted(keys)}"
                        )
                columns = {k: [e[k] for e in extras] for k in keys}
            extra = []
            for k, col in columns.items():
                stacked = _stack_column(col, n)
                if stacked is None:
                    w = array_to_wire(np.asarray(col))
                    stacked = w["dtype"], w["shape"][1:], w["data"]
                extra.append((k, stacked))
        elif any(e for e in extras):
            raise ValueError("extra_model_outputs given on a later step but not on the episode's first step")
        else:
            extra = []
        self._act.write(parts, actions)
        _write_rewards(parts, ep, array("d", rewards), n)  # floats: log_step converted them
        self._obs.write(parts, observations)
        return extra, list(infos) if any(infos) else None

    def _abort(self, ep: _Episode, reason: str) -> None:
        if ep.dropping:
            self._episodes.pop(ep.id, None)
            return
        if ep.steps:
            self._emit(ep, False, False)
        self._buffered += 1  # aborts always get room: they are what makes partial data usable
        rec = {"episode_id": ep.id, "reason": reason, "timestamp_ms": int(time.time() * 1000)}
        self._send(ep.id, encode_record("EpisodeAbort", rec), "EpisodeAbort", 1)
        self._end(ep)

    def _abort_dropping(self, ep: _Episode) -> None:
        """An episode hit the full buffer in drop mode: discard its unsent steps, close what was sent."""
        ep.dropping = True
        self._dropped += len(ep.steps)
        self._buffered -= len(ep.steps)
        ep.steps, ep.reward_adds = [], {}
        self._buffered += 1
        rec = {"episode_id": ep.id, "reason": "dropped", "timestamp_ms": int(time.time() * 1000)}
        self._send(ep.id, encode_record("EpisodeAbort", rec), "EpisodeAbort", 1)

    def _end(self, ep: _Episode) -> None:
        self._episodes.pop(ep.id, None)
        self._finished[ep.id] = ep.t
        if len(self._finished) > 10_000:
            for k in list(self._finished)[:5_000]:
                del self._finished[k]

    def _send(self, key: str, value: bytes, kind: str, records: int) -> None:
        prefix, headers = self._wire[kind]
        if prefix:
            value = prefix + value
        cb = partial(self._on_delivery, key, records)
        while True:
            try:
                self._producer.produce(self.topic, value, key.encode(), headers=headers, on_delivery=cb)
                break
            except BufferError:  # librdkafka's own queue is full: wait for it (rare; our cap is lower)
                self._lock.release()
                try:
                    self._producer.poll(0.05)
                finally:
                    self._lock.acquire()
            except KafkaException as e:
                self._buffered -= records
                err = e.args[0] if e.args and isinstance(e.args[0], KafkaError) else None
                if err is not None and err.fatal():  # the poller is replacing the producer
                    self._fatal = err
                    self._failed += records
                    self._msgs[0] += 1
                    self._msgs[2] += 1
                    log.error("episode %s: %d records failed, the producer hit a fatal error: %s", key, records, err)
                    return
                raise ValueError(f"message of {len(value)} bytes refused by the producer: {e}") from None
        self._msgs[0] += 1

    def _on_delivery(self, key: str, records: int, err: KafkaError | None, msg: Any) -> None:
        # runs on the poller thread (or a flush() caller), never with the lock held by this thread
        with self._lock:
            self._buffered -= records
            if err is None:
                self._delivered += records
                self._msgs[1] += 1
            else:
                self._failed += records
                self._msgs[2] += 1
            self._space_freed.notify_all()
        if err is not None:
            log.error("delivery failed for episode %s (%d records): %s", key, records, err)
            if self.on_delivery_error is not None:
                try:
                    self.on_delivery_error(err, key, records)
                except Exception:
                    log.exception("on_delivery_error callback raised")

    def _on_kafka_error(self, err: KafkaError) -> None:
        # librdkafka's error callback (poller thread). Transport errors are retried by librdkafka;
        # a fatal one (e.g. the idempotent producer's sequence state lost by a restarted broker)
        # leaves the producer unusable: the poller replaces it (see _replace_producer).
        if err.fatal():
            log.error("fatal producer error, starting a new producer: %s", err)
            self._fatal = err
        else:
            log.warning("producer error (retried by librdkafka): %s", err)
        if self._user_error_cb is not None:
            try:
                self._user_error_cb(err)
            except Exception:
                log.exception("error_cb raised")

    def _replace_producer(self) -> None:
        """Swap in a new Producer after a fatal error, so recording goes on. Messages the old one
        still held fail through their delivery callbacks (counted as failed, passed to
        `on_delivery_error`); the consumer dead-letters the episodes they leave incomplete."""
        with self._lock:
            old, self._producer = self._producer, Producer(self._conf)
            self._fatal = None
            self.producer_restarts += 1
        try:
            old.purge()
        except (KafkaException, RuntimeError) as e:
            log.debug("purge after a fatal error: %s", e)
        deadline = time.monotonic() + 10
        while len(old) and time.monotonic() < deadline:
            try:
                old.poll(0.05)  # serves the failed messages' delivery callbacks
            except KafkaException as e:
                log.debug("poll after a fatal error: %s", e)
        if len(old):
            log.error("%d messages of the failed producer got no delivery report", len(old))

    def _poll_loop(self) -> None:
        next_linger = time.monotonic()
        while not self._stop.is_set():
            try:
                self._producer.poll(0.05)
            except KafkaException as e:  # defensive: librdkafka raises fatal errors without error_cb
                err = e.args[0] if e.args and isinstance(e.args[0], KafkaError) else None
                log.error("producer poll failed: %s", e)
                if err is not None and err.fatal():
                    self._fatal = err
            if self._fatal is not None:
                self._replace_producer()
            now = time.monotonic()
            if now >= next_linger:
                next_linger = now + self.max_batch_delay_s / 2
                self._emit_lingering(now - self.max_batch_delay_s)

    def _emit_lingering(self, deadline: float) -> None:
        """Send every batch whose oldest step was buffered before `deadline` (poller thread).

        The lock is taken per episode, not for the whole pass: a pass over many episodes of big
        observations takes milliseconds, which a thread logging meanwhile would wait out. After
        a big batch the GIL is offered too (a thread woken by the lock needs it to go on).
        """

        def due(ep: _Episode) -> bool:
            return bool(ep.steps) and not ep.dropping and ep.first_buffered <= deadline

        with self._lock:
            episodes = [ep for ep in self._episodes.values() if due(ep)]
        for ep in episodes:
            with self._lock:
                if not due(ep) or self._episodes.get(ep.id) is not ep:
                    continue  # sent, ended or dropped meanwhile
                big = len(ep.steps) * (self._step_bytes or 0) >= _YIELD_BYTES
                try:
                    self._emit(ep, False, False)
                except ValueError as e:
                    log.error("%s", e)
            if big:
                time.sleep(0)
