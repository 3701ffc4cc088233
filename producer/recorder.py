"""`EpisodeRecorder`: the policy-side client that publishes transitions to Kafka.

Hot path: `log_step` checks the step cheaply, copies it (an observation or action array
becomes its wire bytes, `ndarray.tobytes()`; numbers and numpy scalars are immutable and kept)
and appends it to its episode's buffer. Every `max_batch_steps` steps, at the end of an
episode, or when the oldest buffered step is `max_batch_delay_s` old (a background thread
checks), the buffer is joined column-wise into one `StepBatch` event and handed to librdkafka,
which sends it asynchronously. The policy never waits on the network; only
`on_overflow="block"` with a full buffer waits, for buffer space. It is all Python: nothing
compiled holds or locks the recorder's state.

Encoding a batch: `producer/avro_write.py` writes the Avro bytes directly (the bytes fastavro
writes for the same record; the constant parts are encoded once per recorder or episode). The
observation and action columns are one `bytes.join` of the copies made at `log_step` (a column
of Python ints for an integer scalar leaf, e.g. Discrete, is packed by `array`); extra model
outputs are stacked as numpy stacks them.

Locking. One re-entrant lock guards the recorder's state, always taken by a `with` statement:
in CPython 3.11 `Lock.__enter__` runs no signal handler once it holds the lock, and none runs
between it and the protected block, so an exception raised by a signal handler cannot leave
the lock held (tests/test_recorder_safety.py delivers thousands of signals to prove it). No
method waits while holding the lock; a waiting call re-takes it and looks its episode and the
recorder's state up again. A public method that finds its own thread already inside the
recorder (a finalizer run by a garbage collection, a signal handler, a delivery callback)
raises `RecorderReentryError` instead of deadlocking or working on half-updated state.

Batched calls (`begin_episodes`, `log_steps`: one row per episode, e.g. a vector env's step)
check the whole batch first, take the lock once, and then do exactly what one `begin_episode` /
`log_step` per row in row order does (`producer/batched.py` splits the rows outside the lock).

Accounting is in *records*: one per `begin_episode`, `log_step`, `log_reward` and
`abort_episode` call (one per row of a batched call). At every moment `produced == delivered + failed + buffered`, and `dropped`
counts records discarded by `on_overflow="drop"`. After `close()` returns, `buffered == 0`.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
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
from rlrec.producer.batched import BatchedCalls
from rlrec.producer.bounded import OldestHalfDict
from rlrec.producer.events import (
    DecodeError,
    check_env_id,
    check_policy_id,
    dumps_info,
    encode_record,
    schema_header,
    schema_version,
)
from rlrec.producer.kafka_log import kafka_logger, repeat_limited
from rlrec.producer.multi_agent_recorder import MultiAgentCalls
from rlrec.producer.spaces import Leaf, dumps_space, flatten_value, space_leaves

__all__ = [
    "CLOSE_TIMEOUT_S",
    "EpisodeRecorder",
    "RecorderClosed",
    "RecorderForkedError",
    "RecorderFullError",
    "RecorderReentryError",
    "RecorderStats",
]

log = logging.getLogger("rlrec.producer")
#: librdkafka's error_cb reports (a broker that cannot be reached reports each retry) and
#: delivery failures (one per message when an outage outlasts message.timeout.ms): each distinct
#: line (a delivery failure: each distinct error) at most once a minute, as librdkafka's own lines
_client_log = repeat_limited(logging.getLogger("rlrec.producer.kafka"))

_KINDS = ("EpisodeStart", "StepBatch", "RewardDelta", "EpisodeAbort")
# constant Avro fragments of StepBatch (see avro_write)
_REWARDS_HEAD = string_bytes("float64") + long_bytes(1)  # dtype, then a 1-dim shape: [n]
_FLAGS = {(a, b): bool_byte(a) + bool_byte(b) for a in (False, True) for b in (False, True)}
_UNION_0, _UNION_1 = long_bytes(0), long_bytes(1)  # infos: null, or an array of strings
#: after sending a lingering batch this big, the poller offers the GIL to waiting threads
_YIELD_BYTES = 64 * 1024
#: how long a call that found the buffer full (on_overflow="block") sleeps before looking again
_WAIT_S = 0.005
#: what librdkafka adds to a message's key and value when it checks them against
#: message.max.bytes (36 bytes measured with librdkafka 2.x; counted generously)
_RECORD_OVERHEAD = 64

_recorders: weakref.WeakSet[EpisodeRecorder] = weakref.WeakSet()
#: the spaces of a recorder created without any (multi-agent episodes only); never recorded
_NO_SPACE = gs.Discrete(1)
_MULTI_AGENT_ONLY = (
    "this recorder was created without observation_space and action_space: it records multi-agent "
    "episodes only (begin_multi_agent_episode)"
)
_monotonic = time.monotonic
#: what `EpisodeRecorder.close()` waits for delivery at most when given no timeout, in seconds: a
#: service shutting down with its broker unreachable is not held up longer than this
CLOSE_TIMEOUT_S = 30.0
_time = time.time
_dtype_of = attrgetter("dtype")
_dropping_of = attrgetter("dropping")
_t_of = attrgetter("t")
_shape_of = attrgetter("shape")
_LITTLE = sys.byteorder == "little"
#: dtypes whose native bytes are their wire bytes -> wire name (none on a big-endian host)
_WIRE_NAMES = {np.dtype(name): name for name in ALLOWED_DTYPES} if _LITTLE else {}
#: numpy scalar types of those dtypes -> wire name
_SCALAR_NAMES = {dt.type: name for dt, name in _WIRE_NAMES.items()}
#: `array` typecodes of the integer dtypes, for columns of Python ints (e.g. Discrete actions)
_INT_CODES = {np.dtype(c).name: c for c in "bBhHiIqQ" if array(c).itemsize == np.dtype(c).itemsize} if _LITTLE else {}
#: extra model output values that need no copy: nobody can change them after log_step
_IMMUTABLE = frozenset({int, float, bool, *(np.dtype(name).type for name in ALLOWED_DTYPES)})


_cast_ok: dict[tuple[np.dtype, np.dtype], bool] = {}
_allowed_ok: dict[np.dtype, bool] = {}


_stamp: tuple[int, bytes] = (0, long_bytes(0))


def _now_ms_bytes() -> bytes:
    """The Avro long of the wall clock in milliseconds (`timestamp_ms`), encoded once per
    millisecond (one tuple, swapped whole: safe from any thread)."""
    global _stamp
    ms = int(_time() * 1000)
    stamp = _stamp
    if stamp[0] != ms:
        stamp = _stamp = (ms, long_bytes(ms))
    return stamp[1]


def _can_cast(src: np.dtype, dst: np.dtype) -> bool:
    """np.can_cast(src, dst, "same_kind"), remembered (it costs ~0.5 µs)."""
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


#: the largest `action_logp` the recorder accepts: log-propensities are <= 0, up to rounding
LOGP_TOLERANCE = 1e-6
_VERSION_END = 2**63  # policy versions are Avro longs: 0 <= v < 2**63
_NEG_INF = -math.inf
#: `action_logp` types checked with two comparisons on log_step's hot path
_FLOAT_TYPES = frozenset({float, np.float64, np.float32, np.float16})
_LOGP_ONLY = ("action_logp",)
#: values per buffered step in `_Episode.steps` (`_encode_batch` slices them by this number)
_STEP_FIELDS = 5
_NONE_TYPE = {type(None)}
_NO_KEYS: tuple = ()


def _check_logp(value: Any, episode_id: str) -> None:
    """Refuse an `action_logp` that is no log-propensity (a finite number <= `LOGP_TOLERANCE`).

    Args:
        value: a float, a numpy scalar, or a shape ``()`` or ``(1,)`` array.
        episode_id: named in the error.

    Raises:
        ValueError: `value` is not one finite number <= `LOGP_TOLERANCE`.

    Example:
        >>> _check_logp(np.float32(-0.7), "e1")
        >>> _check_logp(0.3, "e1")
        Traceback (most recent call last):
        ...
        ValueError: extra_model_outputs['action_logp'] must be the behaviour policy's log-propensity of the action it took (a finite number <= 0), got 0.3 (episode e1)
    """
    why = ""
    try:
        arr = np.asarray(value)
        if arr.shape not in ((), (1,)) or arr.dtype.kind not in "fiu":
            why = f" (shape {arr.shape}, dtype {arr.dtype})"
            ok = False
        else:
            x = float(arr.reshape(()))
            ok = math.isfinite(x) and x <= LOGP_TOLERANCE
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            "extra_model_outputs['action_logp'] must be the behaviour policy's log-propensity of the action "
            f"it took (a finite number <= 0), got {value!r}{why} (episode {episode_id})"
        )


def _reward_float(r: Any, what: str = "reward") -> float:
    """A reward `r` that is not a float, as one: TypeError for what is no number, ValueError for
    a number beyond the float range (``10**400``: not finite as a float)."""
    try:
        return float(r)
    except OverflowError:
        raise ValueError(f"{what} must be finite, got a {type(r).__name__} beyond the float range") from None
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {type(r).__name__}") from None


def space_problem(space: gs.Space, value: Any) -> str | None:
    """What `validate_spaces=True` refuses in one value, or None: not in `space`
    (``space.contains``), or holding NaN or ±inf, which an unbounded Box contains but a consumer
    with ``--validate-spaces strict`` (the default) dead-letters the episode for
    (``non-finite-value``).

    Args:
        space: the value's gymnasium space.
        value: an observation or action.

    Returns:
        The end of the error message (``"is not in Box(...)"``), or None for a good value.

    Example:
        >>> import numpy as np; from gymnasium import spaces as gs
        >>> space_problem(gs.Box(-np.inf, np.inf, (2,)), np.array([np.inf, 0.0], np.float32))
        'holds NaN or ±inf: a consumer with --validate-spaces strict dead-letters the episode'
        >>> space_problem(gs.Discrete(3), 1) is None
        True
    """
    if not space.contains(value):
        return f"is not in {space}"
    for x in flatten_value(space, value):
        a = np.asarray(x)
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            return "holds NaN or ±inf: a consumer with --validate-spaces strict dead-letters the episode"
    return None


def _copy_outputs(extra: Any, episode_id: str) -> Any:
    """What log_step keeps of `extra_model_outputs`: a new dict whose mutable values (arrays,
    lists) are copied, its ``action_logp`` checked (`_check_logp`); anything that is not a
    mapping as it is (encoding the batch refuses it and aborts the episode)."""
    try:
        out = {**extra}
    except TypeError:
        return extra
    for k, v in out.items():
        if type(v) not in _IMMUTABLE:  # an array, a list: copied
            out[k] = np.array(v)
    lp = out.get("action_logp", 0.0)
    if type(lp) not in _FLOAT_TYPES or not (_NEG_INF < float(lp) <= LOGP_TOLERANCE):
        _check_logp(lp, episode_id)  # anything else: checked the slow way (or refused)
    return out


def _kept_outputs(extra: Any, episode_id: str) -> Any:
    """What log_step keeps of `extra_model_outputs` (see `_Episode.steps`): a falsy value as it
    is, only a float ``action_logp`` as that scalar (checked), anything else `_copy_outputs`."""
    if not extra:
        return extra
    if type(extra) is dict and len(extra) == 1 and type(lp := extra.get("action_logp")) in _FLOAT_TYPES:
        if not (_NEG_INF < (lp if type(lp) is float else float(lp)) <= LOGP_TOLERANCE):
            _check_logp(lp, episode_id)
        return lp
    return _copy_outputs(extra, episode_id)


def _extra_keys(extra: Any) -> tuple:
    """The keys of an episode's first step's kept outputs, in the caller's order (the order of
    its StepBatches' output columns); TypeError for a non-string key or a value of a dtype the
    wire does not carry."""
    if extra is None:
        return _NO_KEYS
    if type(extra) in _FLOAT_TYPES:  # only the propensity, kept as its scalar
        return _LOGP_ONLY
    keys = tuple(extra or ())
    for k, v in (extra or {}).items():
        if not isinstance(k, str):
            raise TypeError(f"extra_model_outputs keys must be strings, got {k!r}")
        dt = v.dtype if isinstance(v, (np.ndarray, np.generic)) else np.asarray(v).dtype
        if not _dtype_allowed(dt):
            raise TypeError(f"extra_model_outputs[{k!r}] has dtype {dt}; use a numeric dtype")
    return keys


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


class RecorderClosed(RuntimeError):
    """The recorder's `close()` was called: it takes no new episodes, steps or rewards."""


class RecorderReentryError(RuntimeError):
    """A recorder method was called on a thread that is already inside the recorder: from a
    finalizer (`__del__`, a `weakref.finalize` or `gc.callbacks` hook) that a garbage collection
    ran in the middle of a recorder call, from a signal handler, or from `on_delivery_error`."""


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


def reward_args(t: Any, reward: Any) -> tuple[int, float]:
    """The env step and reward of a delayed reward call (`log_reward`, `log_multi_agent_reward`),
    or ValueError: a reward that is not finite, a negative step (TypeError: one that is no number)."""
    r = _reward_float(reward)
    if not math.isfinite(r):
        raise ValueError(f"reward must be finite, got {r}")
    t = int(t)
    if t < 0:
        raise ValueError(f"t must be >= 0, got {t}")
    return t, r


class _Packer:
    """Per-space copying of step values into their wire bytes, and column-wise joining."""

    def __init__(self, space: gs.Space, what: str):
        self.space = space
        self.what = what
        self.leaves = space_leaves(space)
        self.single = not isinstance(space, (gs.Dict, gs.Tuple))
        leaf = self.leaves[0]
        # single-leaf spaces: a value of exactly this dtype and shape is copied by tobytes()
        # (None on a big-endian host, or for a dtype that is not allowed on the wire)
        self.dtype = leaf.dtype if self.single and leaf.dtype in _WIRE_NAMES else None
        self.shape = leaf.shape if self.single else None
        scalar = self.dtype is not None and not leaf.shape
        # numpy scalars of the leaf's dtype are immutable: kept as they are
        self.scalar_type = leaf.dtype.type if scalar else None
        # scalar integer leaves (Discrete): Python ints in range are kept, and packed by `array`
        self.int_code = _INT_CODES.get(leaf.dtype.name) if scalar else None
        if self.int_code:
            info = np.iinfo(leaf.dtype)
            self.int_lo, self.int_hi = int(info.min), int(info.max)
        else:
            self.int_lo, self.int_hi = 1, 0  # no int is in this range
        self._count = long_bytes(len(self.leaves)) if self.leaves else b""
        # per leaf, for `write`: Avro bytes of the dtype name and the shape's length, and of the
        # trailing dims and the shape's end
        self._heads = [
            (
                string_bytes(lf.dtype.name) + long_bytes(1 + len(lf.shape)),
                b"".join(map(long_bytes, lf.shape)) + ARRAY_END,
            )
            for lf in self.leaves
        ]
        # per leaf, for `write_one`: Avro bytes of the dtype name and the leaf's shape
        self._one_heads = [string_bytes(lf.dtype.name) + shape_bytes(lf.shape) for lf in self.leaves]

    def copy(self, value: Any) -> Any:
        """What the recorder keeps of one value: its wire bytes (a tuple of them per leaf for
        Dict/Tuple spaces), or the value itself when it is immutable (a Python int in range for
        an integer scalar leaf, a numpy scalar of the leaf's dtype). Raises ValueError for a
        wrong shape, TypeError for a dtype that does not cast to the leaf's ("same_kind")."""
        if self.single:
            t = type(value)
            if t is int and self.int_lo <= value <= self.int_hi:
                return value
            if t is self.scalar_type:
                return value
            if t is np.ndarray and value.dtype is self.dtype and value.shape == self.shape:
                return value.tobytes()
            return self._leaf_bytes(value, self.leaves[0], "")
        leaves = flatten_value(self.space, value)
        return tuple(self._leaf_bytes(x, leaf, " leaf") for x, leaf in zip(leaves, self.leaves))

    def _leaf_bytes(self, x: Any, leaf: Leaf, which: str) -> bytes:
        a = np.asarray(x)
        if a.shape != leaf.shape:
            raise ValueError(f"{self.what}{which} has shape {a.shape}, the space needs {leaf.shape}")
        if a.dtype != leaf.dtype:
            if not _can_cast(a.dtype, leaf.dtype):
                raise TypeError(f"{self.what} of dtype {a.dtype} can't be stored as the space's {leaf.dtype}")
            a = a.astype(leaf.dtype, casting="same_kind")
        return array_to_wire(a)["data"]  # little-endian, C order

    def write(self, parts: list, col: Sequence) -> None:
        """Append the Avro array of the stacked leaves of `copy`'s values in `col` to `parts`."""
        n = len(col)
        parts.append(self._count)
        if self.single:
            self._write_leaf(parts, 0, col, n)
        else:
            for i, leaf_col in enumerate(zip(*col)):
                self._write_leaf(parts, i, leaf_col, n)
        parts.append(ARRAY_END)

    def write_empty(self, parts: list) -> None:
        """Append the Avro array of the leaves stacked zero deep (`write` of no values) to `parts`."""
        parts.append(self._count)
        for head, tail in self._heads:
            parts += (head, long_bytes(0), tail, long_bytes(0), b"")
        parts.append(ARRAY_END)

    def _write_leaf(self, parts: list, i: int, col: Sequence, n: int) -> None:
        head, tail = self._heads[i]
        code = self.int_code
        try:
            # Python ints (range-checked by `copy`) and numpy scalars pack with `array`; bytes
            # and numpy scalars join
            data = array(code, col).tobytes() if type(col[0]) is int and code else b"".join(col)
        except TypeError:  # ints mixed with bytes: each int becomes its bytes
            data = b"".join([array(code, (x,)).tobytes() if type(x) is int else x for x in col])
        parts += (head, long_bytes(n), tail, long_bytes(len(data)), data)

    def write_one(self, parts: list, value: Any) -> None:
        """Append the Avro array of the leaves of one value (no step axis) to `parts`; raises
        as `copy` does."""
        self.write_kept(parts, self.copy(value))

    def write_kept(self, parts: list, kept: Any) -> None:
        """`write_one` of what `copy` kept of a value."""
        values = [kept] if self.single else kept
        parts.append(self._count)
        for v, head in zip(values, self._one_heads):
            data = v if type(v) is bytes else array(self.int_code, (v,)).tobytes() if type(v) is int else v.tobytes()
            parts += (head, long_bytes(len(data)), data)
        parts.append(ARRAY_END)


def _write_rewards(parts: list, ep: _Episode, rewards: array, n: int) -> None:
    """Append the batch's `n` float64 rewards with the delayed rewards of its buffered steps added."""
    for t, add in ep.reward_adds.items():
        rewards[t - ep.t0] += add
    parts += (_REWARDS_HEAD, long_bytes(n), ARRAY_END, long_bytes(8 * n), rewards)


class _Episode:
    __slots__ = ("dropping", "extra_keys", "first_buffered", "id", "id_avro", "reward_adds", "steps", "t", "t0")

    def __init__(self, eid: str, id_avro: bytes | None = None):
        self.id = eid
        # the Avro string, as every batch of the episode starts (given: a batched begin made it)
        self.id_avro = string_bytes(eid) if id_avro is None else id_avro
        self.t = 0  # steps logged so far
        self.t0 = 0  # t of the first buffered step
        # buffered steps t0..t-1, flat: _STEP_FIELDS values per step (action, reward,
        # observation, info_json, extra_model_outputs), each a copy the caller cannot change (see
        # _Packer.copy, _copy_outputs); outputs that are only ``action_logp`` are kept as its
        # scalar (a float or numpy float), not as a dict
        self.steps: list = []
        self.reward_adds: dict[int, float] = {}  # delayed rewards for buffered steps, by t
        self.extra_keys: tuple = _NO_KEYS
        self.first_buffered = 0.0
        self.dropping = False  # on_overflow="drop" dropped it: its further records are dropped too


class EpisodeRecorder(BatchedCalls, MultiAgentCalls):
    """Publishes the episodes of one policy to a Kafka topic as rlrec events.

    Guarantees: every record is either delivered to the broker (idempotent producer, acks=all),
    reported as failed (counted, and passed to `on_delivery_error`), or - only with
    `on_overflow="drop"` - counted as dropped; nothing disappears silently: after `close()`
    returns, `stats.buffered == 0`. Events of an episode share its key (the episode id) and so
    arrive in order on one partition.

    Copies: `begin_episode` and `log_step` copy what they are given before returning (arrays
    become bytes, `extra_model_outputs` a new dict of copied values), so the caller may reuse or
    change its observation, action and output arrays right after the call.

    Threads: every public method is thread-safe; several threads may log, abort and close at
    once (steps of one episode are recorded in the order their calls took the lock, so an
    episode is best stepped by one thread at a time). `close()` refuses new episodes, steps and
    rewards (`RecorderClosed`) from the moment it is called; a call that was waiting for buffer
    space raises `RecorderClosed`, or ValueError when another thread ended or aborted its
    episode meanwhile - it never reports success for a step it did not record. A method called
    from a finalizer or signal handler while its thread is inside the recorder raises
    `RecorderReentryError` (`stats` and `open_episodes` work there). An exception raised by a
    signal handler (KeyboardInterrupt, SystemExit) leaves no lock held. After `os.fork()` the
    child must create its own recorder (`RecorderForkedError`).

    Args:
        bootstrap_servers: Kafka bootstrap servers ("host:port,...").
        topic: the topic every event goes to.
        policy_id: names the policy (the consumer files episodes under it).
        policy_version: version of the policy that acts; only grows (also per episode).
        observation_space: gymnasium space of the observations (required, unless the recorder
            records multi-agent episodes only: give neither space then).
        action_space: gymnasium space of the actions (required, as `observation_space`).
        env_id: names the environment.
        kafka_config: librdkafka settings added to (or overriding) the recorder's; librdkafka's own log
            lines go to the `logging` logger ``rlrec.librdkafka`` (WARNING and up, each distinct line
            at most once a minute) unless it names its own ``logger``.
        max_buffered_steps: records that may await delivery before `on_overflow` applies.
        on_overflow: "block" (wait for room), "drop" (count and drop the episode's rest) or
            "raise" (`RecorderFullError`).
        max_batch_steps: at most this many steps per StepBatch event.
        max_batch_delay_s: a buffered step is sent at most this late.
        max_batch_bytes: about this many bytes per StepBatch event.
        validate_spaces: check every value with `space.contains` and refuse NaN or ±inf in it (what
            a consumer with `--validate-spaces strict` dead-letters; `space_problem`; slow).
        on_delivery_error: called as (error, episode_id, records) for records that failed.
        schema_registry_url: frame events for a Confluent Schema Registry instead of headers.

    Example:
        >>> import numpy as np
        >>> from gymnasium import spaces
        >>> from rlrec import EpisodeRecorder, LocalBroker
        >>> with LocalBroker() as broker, EpisodeRecorder(
        ...     broker.bootstrap_servers,
        ...     observation_space=spaces.Box(-1, 1, (4,), np.float32),
        ...     action_space=spaces.Discrete(2),
        ... ) as rec:
        ...     obs = np.zeros(4, np.float32)
        ...     eid = rec.begin_episode(obs)
        ...     obs[:] = 0.5  # fine: begin_episode copied it
        ...     rec.log_step(eid, 1, 1.0, obs, terminated=True)
        ...     rec.close()
        ...     rec.stats.buffered
        0
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
        if (observation_space is None) != (action_space is None):
            raise TypeError(
                "observation_space and action_space are required (the consumer rebuilds episodes with them); "
                "give neither for a recorder of multi-agent episodes only"
            )
        #: no spaces given: only multi-agent episodes (their spaces come with each episode)
        self._multi_agent_only = observation_space is None
        if self._multi_agent_only:
            observation_space = action_space = _NO_SPACE
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

            reg = self._registry = SchemaRegistry(schema_registry_url)
            self._wire = {k: (frame(reg.schema_id(k, schema_version(k)), b""), None) for k in _KINDS}
        else:
            self._registry = None
            self._wire = {k: (b"", schema_header(k)) for k in _KINDS}
        self._obs = _Packer(observation_space, "observation")
        self._act = _Packer(action_space, "action")
        # log_step's inline copy of the common single-leaf observation (see _Packer.copy)
        self._obs_dtype, self._obs_shape = self._obs.dtype, self._obs.shape
        self._act_lo, self._act_hi = self._act.int_lo, self._act.int_hi  # Python ints kept as they are
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
        conf.setdefault("logger", kafka_logger())  # librdkafka's lines through logging, not to stderr
        self._user_error_cb = conf.pop("error_cb", None)
        conf["error_cb"] = self._on_kafka_error
        self._conf = conf
        # the largest EpisodeStart (key and value) librdkafka takes: begin_episode(s) refuse a
        # bigger one before anything is sent
        prefix, headers = self._wire["EpisodeStart"]
        head_bytes = sum(len(k) + len(v) + 10 for k, v in headers or ())
        self._message_max_bytes = int(conf.get("message.max.bytes", 1_000_000))
        self._max_start = self._message_max_bytes - _RECORD_OVERHEAD - len(prefix) - head_bytes
        self._producer = Producer(conf)
        self._fatal: KafkaError | None = None  # set by error_cb; the poller replaces the producer
        self.producer_restarts = 0

        # the recorder's state; only ever taken by `with` (see the module docstring)
        self._lock = threading.RLock()
        self._busy = False  # a method of this thread is working on the state (re-entry guard)
        self._close_lock = threading.RLock()  # one close() at a time; later ones wait for it
        self._in_close = False
        self._episodes: dict[str, _Episode] = {}
        self._finished = OldestHalfDict(10_000)  # recent finished episode -> length, for log_reward checks
        self._ma_open = 0  # open multi-agent episodes (log_steps checks episode kinds only when some are)
        self._ma_last_layout = None  # the last multi-agent episode's layout (multi_agent_recorder._Layout)
        self._delivered = self._failed = self._dropped = 0  # produced = delivered + failed + buffered
        self._buffered = 0
        self._episodes_begun = 0
        self._msgs = [0, 0, 0]  # produced, delivered, failed
        self._last_drop_log = 0.0
        self._closing = False  # close() was called: nothing new is taken
        self._closed = False  # close() finished
        self._forked = False
        self._unusable = False  # closing or forked: checked first on the hot path
        # bytes per step, estimated from the spaces until the first batch measures it
        est = sum(leaf.dtype.itemsize * int(np.prod(leaf.shape)) for leaf in self._obs.leaves + self._act.leaves) + 16
        self._set_batch_limit(est)
        self._step_bytes = None  # measured bytes per buffered step, set at first emit

        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="rlrec-recorder", daemon=True)
        self._poller.start()
        _recorders.add(self)

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
        self._max_buffered_steps = value

    @property
    def policy_version(self) -> int:
        """The version new episodes are recorded with (only grows)."""
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
        """Start an episode from its first observation; returns its id.

        The observation is encoded before the call returns: the caller may change it afterwards.

        Args:
            observation: the reset observation, in `observation_space`.
            info: the reset info (JSON-able, numpy arrays allowed).
            episode_id: the episode's id (1..256 characters); a new uuid4 hex when None.
            policy_version: the version acting in this episode; the recorder's when None.

        Returns:
            The episode id, for `log_step`, `log_reward` and `abort_episode`.

        Raises:
            RecorderClosed: `close()` was called.
            ValueError: the episode is already open, or a value is invalid.
            RecorderFullError: `on_overflow="raise"` and the buffer is full.
        """
        self._check_usable()
        if self._multi_agent_only:
            raise TypeError(_MULTI_AGENT_ONLY)
        version = self._policy_version if policy_version is None else self._check_version(policy_version)
        if self.validate_spaces and (bad := space_problem(self.observation_space, observation)):
            raise ValueError(f"observation {observation!r:.200} {bad}")
        obs_parts: list = []
        self._obs.write_one(obs_parts, observation)
        info_json = dumps_info(info)
        eid = uuid.uuid4().hex if episode_id is None else str(episode_id)
        if type(eid) is not str:  # a str subclass's __str__ may return itself: keys are plain str
            eid = str.__str__(eid)
        if not eid or len(eid) > 256:
            raise ValueError("episode_id must be 1..256 characters")
        value = self._start_value(eid, version, obs_parts, info_json, _now_ms_bytes())
        if len(value) + 4 * len(eid) > self._max_start:  # UTF-8: at most 4 bytes a character
            self._check_start_size(eid.encode(), value)
        while True:
            with self._lock:
                if self._busy:
                    raise self._reentry("begin_episode")
                self._busy = True
                try:
                    if self._closing:
                        raise RecorderClosed("the recorder is closed")
                    if eid in self._episodes:
                        raise ValueError(f"episode {eid} is already open")
                    if self._buffered < self._max_buffered_steps:
                        self._send(eid, value, "EpisodeStart", 1, 1)  # before registering: it may raise
                        self._episodes_begun += 1
                        self._episodes[eid] = _Episode(eid)
                        return eid
                    if not self._overflow(None, False):
                        ep = _Episode(eid)
                        ep.dropping = True  # nothing of it is sent
                        self._episodes_begun += 1
                        self._episodes[eid] = ep
                        return eid
                finally:
                    self._busy = False
            time.sleep(_WAIT_S)  # on_overflow="block": wait for room without the lock, then look again

    def log_step(
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

        The recorder copies `action`, `observation` and `extra_model_outputs` before returning:
        the caller may reuse or change its arrays right after the call.

        Args:
            episode_id: an open episode's id (from `begin_episode`).
            action: the action taken, in `action_space`.
            reward: the reward received (a finite number).
            observation: the observation after the step, in `observation_space`.
            terminated: the episode ended in a terminal state (the episode is closed).
            truncated: the episode was cut short (the episode is closed).
            info: the step's info (JSON-able, numpy arrays allowed).
            extra_model_outputs: per-step model outputs, the same keys on every step of an
                episode. ``action_logp`` is the behaviour policy's log-propensity of the action
                it took: ``log pi_b(action | previous observation)`` under the distribution the
                action was *sampled* from (a finite number <= 0, up to `LOGP_TOLERANCE`; a
                float, a numpy scalar or a shape ``()`` or ``(1,)`` array). Off-policy
                evaluation (`rlrec evaluate`, ``--promotion-gate ope``) needs it at every step;
                a deterministic (greedy) behaviour's propensity is 1 (``action_logp`` 0.0) and
                its data cannot serve importance-weighted estimates. For continuous actions,
                ``action_dist_inputs`` are the distribution inputs (e.g. mean and log-std) the
                propensity came from.

        Raises:
            RecorderClosed: `close()` was called (also while this call waited for room).
            ValueError: the episode is not open (never begun, ended, or aborted - also by
                another thread while this call waited for room), or a value is invalid (a
                reward that is not finite, an ``action_logp`` that is no log-propensity; these
                are refused before anything is buffered).
            TypeError: a value's dtype does not cast to its space's.
            RecorderFullError: `on_overflow="raise"` and the buffer is full.
            RecorderReentryError: called from a finalizer or signal handler while this thread
                was inside the recorder.

        Example:
            >>> eid = rec.begin_episode(obs)  # doctest: +SKIP
            >>> rec.log_step(eid, 0, 1.0, obs, extra_model_outputs={"action_logp": -0.7})  # doctest: +SKIP
        """
        # hot path: every attribute lookup and call here costs a visible share of a step
        if self._unusable:
            self._check_usable()
        if type(reward) is not float:
            reward = _reward_float(reward)
        if reward - reward != 0.0:  # NaN or +-inf (cheaper than math.isfinite)
            raise ValueError(f"reward must be finite, got {reward} (episode {episode_id})")
        if self.validate_spaces:
            self._validate(action, observation)
        # copy what the caller may change later: arrays become their wire bytes
        if (
            type(observation) is np.ndarray
            and observation.dtype is self._obs_dtype
            and observation.shape == self._obs_shape
        ):
            observation = observation.tobytes()
        else:
            observation = self._obs.copy(observation)
        if not (type(action) is int and self._act_lo <= action <= self._act_hi):
            action = self._act.copy(action)
        if extra_model_outputs:
            extra_model_outputs = _kept_outputs(extra_model_outputs, episode_id)
        step = (action, reward, observation, dumps_info(info) if info else "", extra_model_outputs)
        with self._lock:
            if self._busy:
                raise self._reentry("log_step")
            self._busy = True
            try:
                try:
                    ep = self._episodes[episode_id]
                except KeyError:
                    raise self._not_open(episode_id) from None
                t = ep.t
                if not t and not ep.dropping:  # before counting the record: these checks may raise
                    self._first_step_checks(ep, extra_model_outputs)
                buffered = self._buffered
                if buffered < self._max_buffered_steps and not ep.dropping:
                    steps = ep.steps
                    if not steps:
                        ep.first_buffered = _monotonic()
                    # no call between these three: a signal handler's exception can't split them
                    steps += step
                    ep.t = t + 1
                    self._buffered = buffered + 1
                    if terminated or truncated:
                        self._emit(ep, bool(terminated), bool(truncated))
                        self._end(ep)
                    elif t + 1 - ep.t0 >= self._batch_limit:
                        self._emit(ep, False, False)
                    return
                if not self._overflow(ep, terminated or truncated):
                    return  # dropped (on_overflow="drop")
            finally:
                self._busy = False
        self._log_step_waiting(ep, step, terminated, truncated)

    def log_reward(self, episode_id: str, t: int, reward: float) -> None:
        """Add a delayed `reward` to step `t` (0-based) of an episode, open or finished.

        Args:
            episode_id: the episode's id.
            t: the step the reward belongs to (0-based).
            reward: a finite number, added to that step's reward.

        Raises:
            RecorderClosed: `close()` was called.
            ValueError: the episode is known to have no step `t`, or the reward is not finite.
        """
        self._check_usable()
        t, r = reward_args(t, reward)
        while True:
            with self._lock:
                if self._busy:
                    raise self._reentry("log_reward")
                self._busy = True
                try:
                    if self._closing:
                        raise RecorderClosed("the recorder is closed")
                    ep = self._episodes.get(episode_id)
                    length = ep.t if ep is not None else self._finished.get(episode_id)
                    if length is not None and type(length) is not int:  # a finished multi-agent episode
                        raise ValueError(f"episode {episode_id!r} is a multi-agent episode: use log_multi_agent_reward")
                    if length is not None and t >= length:
                        raise ValueError(f"episode {episode_id} has {length} steps; no step t={t}")
                    if ep is not None and t >= ep.t0 and not ep.dropping:
                        ep.reward_adds[t] = ep.reward_adds.get(t, 0.0) + r  # still buffered: no message needed
                        return
                    if self._send_reward(episode_id, t, r):
                        return
                finally:
                    self._busy = False
            time.sleep(_WAIT_S)

    def _send_reward(self, episode_id: str, t: int, reward: float, agent_id: str | None = None) -> bool:
        """(Lock held.) Send a `RewardDelta` for a step no longer buffered (version 2 with
        `agent_id`) when the buffer has room. True: done with it (sent, or dropped by
        `on_overflow`); False: wait and try again."""
        if self._buffered >= self._max_buffered_steps:
            return not self._overflow(None, False)
        rec = {"episode_id": episode_id, "t": t, "reward": reward, "timestamp_ms": int(_time() * 1000)}
        if agent_id is None:
            self._send(episode_id, encode_record("RewardDelta", rec), "RewardDelta", 1, 1)
        else:
            rec["agent_id"] = agent_id
            self._ma_wire("RewardDelta", 2)
            self._send(episode_id, encode_record("RewardDelta", rec, 2), "RewardDelta/2", 1, 1)
        return True

    def abort_episode(self, episode_id: str, reason: str = "") -> None:
        """End an open episode without a terminal step; the consumer finalizes it as truncated.

        Args:
            episode_id: an open episode's id.
            reason: recorded with the EpisodeAbort event.

        Raises:
            RecorderClosed: `close()` was called (it aborted every open episode).
            ValueError: the episode is not open.
        """
        self._check_usable()
        with self._lock:
            if self._busy:
                raise self._reentry("abort_episode")
            self._busy = True
            try:
                ep = self._episodes.get(episode_id)
                if ep is None:
                    raise self._not_open(episode_id)
                self._abort(ep, reason)
            finally:
                self._busy = False

    def flush(self, timeout: float | None = None) -> int:
        """Send every buffered step and wait for delivery; returns messages still undelivered.

        Args:
            timeout: seconds to wait at most; None waits until everything is delivered or failed.
        """
        if self._forked:  # librdkafka's handle is unusable after fork(): flush(-1) would never return
            self._check_usable()
        if self._closed:  # close() flushed; what it could not deliver was purged and counted failed
            return 0
        with self._lock:
            if self._busy:
                raise self._reentry("flush")
            self._busy = True
            try:
                self._emit_all_buffered()
            finally:
                self._busy = False
        return self._producer.flush(-1 if timeout is None else timeout)

    def close(self, timeout: float | None = None) -> int:
        """Refuse new records, abort still-open episodes (reason "recorder-closed"), flush, stop.

        From the moment it is called, new episodes, steps and rewards raise `RecorderClosed`.
        When it returns, every record ever accepted is delivered, failed or dropped (`stats`
        says which; `buffered == 0`). Idempotent: a second call waits for the first to finish.

        Args:
            timeout: seconds to wait for delivery at most; None: `CLOSE_TIMEOUT_S` (30 s), so a
                service never hangs in shutdown on an unreachable broker; ``math.inf`` waits
                until every message is delivered or failed (librdkafka's `message.timeout.ms`).

        Returns:
            The number of messages still undelivered when `timeout` expired (also in `stats`:
            ``failed``, and a WARNING names the count); those are purged
            from librdkafka's queues and counted as failed (their records reach
            `on_delivery_error`).
        """
        if self._forked:
            return 0
        with self._close_lock:
            if self._in_close:
                raise self._reentry("close")
            if self._closed:
                return 0
            self._in_close = True
            try:
                return self._close(timeout)
            finally:
                self._in_close = False

    @property
    def stats(self) -> RecorderStats:
        """A consistent snapshot of the counters (works from finalizers too)."""
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
        """Episodes begun and not yet ended or aborted."""
        return len(self._episodes)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "an EpisodeRecorder cannot be pickled (it holds a Kafka producer and its threads): create it "
            "in the process that records, e.g. inside the env function of each vector env worker"
        )

    def __enter__(self) -> EpisodeRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals (called with the lock held unless said otherwise) ----------------------------

    @staticmethod
    def _check_version(v: Any) -> int:
        """`v` as a policy version: an int in 0..2**63-1 (an Avro long), else ValueError."""
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < _VERSION_END:
            raise ValueError(f"policy_version must be a non-negative integer below 2**63, got {v!r}")
        return int(v)

    def _set_batch_limit(self, step_bytes: int) -> None:
        """Batches of at most `max_batch_steps` steps and about `max_batch_bytes`."""
        self._batch_limit = max(1, min(self.max_batch_steps, self.max_batch_bytes // step_bytes))

    def _check_usable(self) -> None:
        if self._forked:
            raise RecorderForkedError(
                "this EpisodeRecorder was created before os.fork(); create a new recorder in the child process"
            )
        if self._closing:
            raise RecorderClosed("the recorder is closed")

    @staticmethod
    def _reentry(method: str) -> RecorderReentryError:
        return RecorderReentryError(
            f"EpisodeRecorder.{method} was called while this thread is inside the recorder (from a "
            "finalizer, a signal handler or on_delivery_error); call it from ordinary code instead, "
            "e.g. by setting a flag there"
        )

    def _not_open(self, episode_id: Any) -> Exception:
        if self._closing:
            return RecorderClosed("the recorder is closed (close() aborted its open episodes)")
        return ValueError(f"episode {episode_id!r} is not open (never begun, already ended or aborted)")

    def _validate(self, action: Any, observation: Any) -> None:
        if bad := space_problem(self.action_space, action):
            raise ValueError(f"action {action!r:.200} {bad}")
        if bad := space_problem(self.observation_space, observation):
            raise ValueError(f"observation {observation!r:.200} {bad}")

    def _start_value(self, eid: str, version: int, obs_parts: list, info_json: str, timestamp: bytes) -> bytes:
        """The EpisodeStart record (see avro_write), its constant fields encoded once."""
        pid_env, spaces = self._start_avro
        parts = [string_bytes(eid), pid_env[0], long_bytes(version), pid_env[1], *obs_parts]
        parts += (string_bytes(info_json), spaces, timestamp)
        return b"".join(parts)

    def _check_start_size(self, key: bytes, value: bytes) -> None:
        """ValueError for an EpisodeStart librdkafka would refuse as too large (checked before
        anything of the call is sent)."""
        if len(key) + len(value) > self._max_start:
            raise ValueError(
                f"episode {key.decode()!r}: its start (reset observation and info) is {len(value)} bytes, "
                f"more than message.max.bytes ({self._message_max_bytes}) allows; send a smaller reset "
                "info or raise message.max.bytes (producer and broker)"
            )

    def _first_step_checks(self, ep: _Episode, extra: Any) -> None:
        ep.extra_keys = _extra_keys(extra)

    def _log_step_waiting(self, ep: _Episode, step: tuple, terminated: bool, truncated: bool) -> None:
        """log_step found the buffer full with on_overflow="block": wait for room without the
        lock, then look the episode and the recorder up again (not called with the lock held)."""
        while True:
            time.sleep(_WAIT_S)
            with self._lock:
                if self._busy:
                    raise self._reentry("log_step")
                self._busy = True
                try:
                    if self._closing:
                        raise RecorderClosed("the recorder was closed while log_step waited for buffer space")
                    if self._episodes.get(ep.id) is not ep:
                        raise ValueError(
                            f"episode {ep.id!r} was ended or aborted while log_step waited for buffer space; "
                            "the step was not recorded"
                        )
                    if self._buffered < self._max_buffered_steps and not ep.dropping:
                        if not ep.t:
                            self._first_step_checks(ep, step[4])
                        steps = ep.steps
                        if not steps:
                            ep.first_buffered = _monotonic()
                        steps += step
                        ep.t += 1
                        self._buffered += 1
                        if terminated or truncated:
                            self._emit(ep, bool(terminated), bool(truncated))
                            self._end(ep)
                        elif len(steps) >= self._batch_limit * _STEP_FIELDS:
                            self._emit(ep, False, False)
                        return
                    if not self._overflow(ep, terminated or truncated):
                        return
                finally:
                    self._busy = False

    def _overflow(self, ep: _Episode | None, done: bool) -> bool:
        """No room for one more record (or `ep` is being dropped): apply the overflow policy.
        True: on_overflow="block", the caller waits (without the lock) and tries again.
        False: the record is dropped. Raises RecorderFullError for on_overflow="raise"."""
        if ep is not None and ep.dropping:
            self._count_drop()
            if done:
                self._end(ep)
            return False
        if self.on_overflow == "raise":
            raise RecorderFullError(
                f"{self._buffered} records await delivery (max_buffered_steps="
                f"{self._max_buffered_steps}); flush() or slow down"
            )
        if self.on_overflow == "drop":
            self._count_drop()
            if ep is not None:  # the rest of the episode goes too; what was sent ends as truncated
                self._abort_dropping(ep)
                if done:
                    self._end(ep)
            return False
        self._emit_all_buffered()  # sooner sent, sooner delivered
        return True

    def _count_drop(self) -> None:
        self._dropped += 1
        now = _monotonic()
        if now - self._last_drop_log > 10:
            self._last_drop_log = now
            log.warning("recorder buffer full: %d records dropped so far (on_overflow='drop')", self._dropped)

    def _emit_all_buffered(self) -> None:
        for other in list(self._episodes.values()):
            if other.steps and not other.dropping:
                try:
                    self._emit(other, False, False)
                except ValueError as e:  # its batch could not be encoded or sent: it is aborted
                    log.error("%s", e)

    def _emit(self, ep: _Episode, terminated: bool, truncated: bool) -> None:
        if type(ep) is not _Episode:  # a multi-agent episode (producer/multi_agent_recorder.py)
            return self._ma_emit(ep, terminated or truncated)
        n = len(ep.steps) // _STEP_FIELDS
        t0, t1 = ep.t0, ep.t
        try:
            value = self._encode_batch(ep, terminated, truncated)
        except (ValueError, TypeError) as e:
            # an extra model output that passed the cheap checks can't be stacked (ragged,
            # another mapping): the batch is lost - count it as failed, close the episode, tell the caller
            ep.steps, ep.reward_adds = [], {}
            self._buffered -= n
            self._failed += n
            self._abort(ep, "encode-error")
            raise ValueError(
                f"episode {ep.id}: steps {t0}..{t1 - 1} could not be encoded and the episode was aborted: {e}"
            ) from e
        # taken off the episode before it is handed over: whatever interrupts the hand-over
        # never sends these steps twice (close() counts steps lost that way as failed)
        ep.steps, ep.reward_adds = [], {}
        ep.t0 = t1
        if self._step_bytes is None:  # size batches of big observations under max_batch_bytes
            self._step_bytes = max(1, len(value) // n)
            self._set_batch_limit(self._step_bytes)
        try:
            self._send(ep.id, value, "StepBatch", n, 0)
        except ValueError as e:
            # refused by librdkafka (e.g. larger than message.max.bytes): counted failed by
            # `_send`; the episode is aborted as for an encode error
            self._abort(ep, "produce-error")
            raise ValueError(
                f"episode {ep.id}: steps {t0}..{t1 - 1} could not be sent and the episode was aborted: {e}"
            ) from e

    def _encode_batch(self, ep: _Episode, terminated: bool, truncated: bool) -> bytes:
        """The Avro body of a StepBatch of the episode's buffered steps (see `avro_write`)."""
        parts = [ep.id_avro, long_bytes(ep.t0)]
        steps = ep.steps
        actions, rewards, observations, infos, extras = steps[0::5], steps[1::5], steps[2::5], steps[3::5], steps[4::5]
        n = len(rewards)
        extra = self._extra_columns(ep, extras, n)
        self._act.write(parts, actions)
        _write_rewards(parts, ep, array("d", rewards), n)  # floats: log_step converted them
        self._obs.write(parts, observations)
        parts.append(_FLAGS[bool(terminated), bool(truncated)])
        if any(infos):
            parts += (_UNION_1, long_bytes(n))
            parts += map(string_bytes, infos)
            parts.append(ARRAY_END)
        else:
            parts.append(_UNION_0)
        if extra:
            parts.append(long_bytes(len(extra)))
            for k, (name, shape, data) in extra:
                parts.append(string_bytes(k))
                array_parts(parts, name, (n, *shape), data)
        parts.append(ARRAY_END)
        parts.append(_now_ms_bytes())
        return b"".join(parts)

    @staticmethod
    def _extra_columns(ep: _Episode, extras: Sequence, n: int) -> list:
        """[(key, (wire dtype, per-step shape, bytes))] of the batch's extra model outputs,
        stacked as numpy stacks them; ValueError/TypeError for values that cannot be."""
        keys = ep.extra_keys
        if not keys:
            if set(map(type, extras)) == _NONE_TYPE:  # no step has outputs
                return []
            if any(type(e) in _FLOAT_TYPES or e for e in extras):
                raise ValueError("extra_model_outputs given on a later step but not on the episode's first step")
            return []
        if keys == _LOGP_ONLY:
            types = set(map(type, extras))
            t = types.pop() if len(types) == 1 else None
            if t is float and _LITTLE:  # every step: only its propensity, a float
                return [("action_logp", ("float64", (), array("d", extras).tobytes()))]
            if t in _SCALAR_NAMES:  # ... or a numpy scalar, all of one type
                return [("action_logp", (_SCALAR_NAMES[t], (), b"".join(extras)))]
        if any(type(e) in _FLOAT_TYPES for e in extras):  # some steps kept their propensity alone
            extras = [{"action_logp": e} if type(e) in _FLOAT_TYPES else e for e in extras]
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
                if e.keys() != set(keys):
                    raise ValueError(
                        f"step {ep.t0 + i}: extra_model_outputs keys {sorted(map(str, e))} differ "
                        f"from the episode's first step {sorted(keys)}"
                    )
            columns = {k: [e[k] for e in extras] for k in keys}
        out = []
        for k, col in columns.items():
            stacked = _stack_column(col, n)
            if stacked is None:
                w = array_to_wire(np.asarray(col))
                stacked = w["dtype"], w["shape"][1:], w["data"]
            out.append((k, stacked))
        return out

    def _abort(self, ep: _Episode, reason: str) -> None:
        if ep.dropping:
            self._forget(ep)
            return
        if ep.steps:
            self._emit(ep, False, False)  # raises after aborting the episode itself when it fails
        rec = {"episode_id": ep.id, "reason": reason, "timestamp_ms": int(_time() * 1000)}
        # aborts always get room: they are what makes partial data usable
        self._send(ep.id, encode_record("EpisodeAbort", rec), "EpisodeAbort", 1, 1)
        self._end(ep)

    def _abort_dropping(self, ep: _Episode) -> None:
        """An episode hit the full buffer in drop mode: discard its unsent steps, close what was sent."""
        if type(ep) is not _Episode:
            return self._ma_abort_dropping(ep)
        n = len(ep.steps) // _STEP_FIELDS
        ep.dropping = True
        ep.steps, ep.reward_adds = [], {}
        self._dropped += n
        self._buffered -= n
        rec = {"episode_id": ep.id, "reason": "dropped", "timestamp_ms": int(_time() * 1000)}
        self._send(ep.id, encode_record("EpisodeAbort", rec), "EpisodeAbort", 1, 1)

    def _forget(self, ep: _Episode) -> None:
        """Drop `ep` from the open episodes (and from the count of open multi-agent ones)."""
        if self._episodes.pop(ep.id, None) is not None and type(ep) is not _Episode:
            self._ma_open -= 1

    def _end(self, ep: _Episode) -> None:
        self._forget(ep)
        self._finished[ep.id] = ep.t if type(ep) is _Episode else ep.finished()

    def _send(self, key: str, value: bytes, kind: str, records: int, new: int) -> None:
        """Hand one message of `records` records to librdkafka; `new` of them are counted as
        buffered here (a StepBatch's steps were counted when logged). A full librdkafka queue is
        waited out with the lock held, serving delivery reports meanwhile (they free it); a
        refused message is counted failed and raises ValueError."""
        prefix, headers = self._wire[kind]
        if prefix:
            value = prefix + value
        cb = partial(self._on_delivery, key, records)
        kb = key.encode()
        self._buffered += new
        self._msgs[0] += 1
        while True:
            try:
                self._producer.produce(self.topic, value, kb, headers=headers, on_delivery=cb)
                return
            except BufferError:  # librdkafka's own queue is full (its settings are lower than ours)
                self._producer.poll(0.05)  # delivery reports free it; they run here, re-entering the lock
            except KafkaException as e:
                self._buffered -= records
                self._failed += records
                self._msgs[2] += 1
                err = e.args[0] if e.args and isinstance(e.args[0], KafkaError) else None
                if err is not None and err.fatal():  # the poller is replacing the producer
                    self._fatal = err
                    log.error("episode %s: %d records failed, the producer hit a fatal error: %s", key, records, err)
                    return
                raise ValueError(f"message of {len(value)} bytes refused by the producer: {e}") from None

    def _on_delivery(self, key: str, records: int, err: KafkaError | None, msg: Any) -> None:
        # runs on the poller thread, a flush() caller, or inside `_send` (lock already held)
        with self._lock:
            self._buffered -= records
            if err is None:
                self._delivered += records
                self._msgs[1] += 1
            else:
                self._failed += records
                self._msgs[2] += 1
        if err is not None:
            _client_log.error(
                "delivery failed for episode %s (%d records): %s",
                key,
                records,
                err,
                extra={"repeat_key": f"delivery failed: {err}"},
            )
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
            _client_log.warning("producer error (retried by librdkafka): %s", err)
        if self._user_error_cb is not None:
            try:
                self._user_error_cb(err)
            except Exception:
                log.exception("error_cb raised")

    def _close(self, timeout: float | None) -> int:
        """close()'s work (not called with the lock held)."""
        with self._lock:
            if self._busy:
                raise self._reentry("close")
            self._busy = True
            try:
                # from here on nothing new is taken (calls waiting for room look again and see it)
                self._closing = self._unusable = True
                for ep in list(self._episodes.values()):
                    try:
                        self._abort(ep, "recorder-closed")
                    except ValueError as e:  # its last batch was refused: counted failed, episode aborted
                        log.error("%s", e)
            finally:
                self._busy = False
        if timeout is None:
            timeout = CLOSE_TIMEOUT_S
        left = self._producer.flush(-1 if math.isinf(timeout) else timeout)
        self._closed = True
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
        deadline = _monotonic() + 5
        self._producer.poll(0)  # serve the remaining delivery callbacks (purged ones fail)
        while len(self._producer) and _monotonic() < deadline:
            self._producer.poll(0.01)
        with self._lock:
            if self._buffered and not len(self._producer):
                # every message handed over got its report: records still counted were never
                # handed over (an exception from a signal handler interrupted their call)
                log.error("%d records were interrupted before they were sent: counted as failed", self._buffered)
                self._failed += self._buffered
                self._buffered = 0
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
        deadline = _monotonic() + 10
        while len(old) and _monotonic() < deadline:
            try:
                old.poll(0.05)  # serves the failed messages' delivery callbacks
            except KafkaException as e:
                log.debug("poll after a fatal error: %s", e)
        if len(old):
            log.error("%d messages of the failed producer got no delivery report", len(old))

    def _poll_loop(self) -> None:
        next_linger = _monotonic()
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
            now = _monotonic()
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
            if self._busy:  # this thread is inside the recorder already (cannot happen)
                return
            self._busy = True
            try:
                episodes = [ep for ep in self._episodes.values() if due(ep)]
            finally:
                self._busy = False
        for ep in episodes:
            big = False
            with self._lock:
                if self._busy:  # this thread is inside the recorder already (cannot happen)
                    return
                self._busy = True
                try:
                    if due(ep) and self._episodes.get(ep.id) is ep:  # not sent, ended or dropped meanwhile
                        if type(ep) is _Episode:
                            big = len(ep.steps) // _STEP_FIELDS * (self._step_bytes or 0) >= _YIELD_BYTES
                        else:  # a multi-agent episode counts its buffered bytes
                            big = ep.nbytes >= _YIELD_BYTES
                        try:
                            self._emit(ep, False, False)
                        except ValueError as e:
                            log.error("%s", e)
                finally:
                    self._busy = False
            if big:
                time.sleep(0)
