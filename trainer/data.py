"""The continuous data path: manifest -> one never-ending Ray Data pipeline -> Learner(s).

Plugged into RLlib with ``config.offline_data(offline_data_class=ManifestOfflineData, ...)``;
`configure_continuous` sets that and everything it needs in one call. Design (details and
measurements in docs/TRAINER.md):

* `ManifestFollower` reads the consumer's manifest incrementally (never a directory listing of
  shards), so only committed shards are ever read.
* A `ShardFeed` actor (wrapping `trainer.feed.FeedState`) decides which chunk of which shard is
  read next: fresh shards first (a configurable share), otherwise a chunk from the replay window.
* The dataset is built ONCE: ``read_datasource(ShardStreamDatasource)`` -- a single read task
  that never ends: it asks the feed for work, reads the chunk (Arrow), tags every row and yields
  it -- ``.map_batches(PreLearner)`` -- ``iter_batches`` / ``iterator()`` / ``streaming_split``.
  New shards enter the running pipeline through the feed; nothing is rebuilt per shard, and the
  Learners' cached iterators (`Learner.iterator`) stay valid for the whole run.
* `SafeOfflinePreLearner` decodes episode shards with `consumer.episodes.unpack_episode`
  (refuses pickled payloads) instead of RLlib's ``msgpack_numpy.decode``.
* Blocks are one-row "envelopes" (a never-ending read task cannot use Ray Data's block
  shaping, see below); `StreamIterator` unpacks them on the Learner side, re-batches and
  acknowledges to the feed the tags of the rows each Learner takes for a gradient step: that
  defines "trained on" for the shard cursor, ``shards_new`` and lineage, and gives the feed its
  flow-control signal.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
import types
import uuid
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray.rllib.core import COMPONENT_RL_MODULE
from ray.rllib.env import INPUT_ENV_SPACES
from ray.rllib.offline.offline_data import OfflineData
from ray.rllib.offline.offline_prelearner import OfflinePreLearner
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils import flatten_dict, force_list, unflatten_dict

from consumer.manifest import ShardEntry
from consumer.storage import Storage
from trainer.feed import TAG, FeedPolicy, FeedState, IterationStats, ShardInfo, Work, shard_of_tag
from trainer.manifest import ManifestFollower, _read_shard_bytes, spaces_from_shard

__all__ = [
    "TAG",
    "ManifestFollower",
    "ShardFeed",
    "ShardStreamDatasource",
    "SafeOfflinePreLearner",
    "ManifestOfflineData",
    "StreamIterator",
    "envelope_prelearner_class",
    "configure_continuous",
    "spaces_from_shard",
    "DEFAULT_DATASET_NUM_ITERS_PER_LEARNER",
]

log = logging.getLogger("rlrec.trainer")

#: learner updates (minibatches) per `training_step` when the user does not say.
DEFAULT_DATASET_NUM_ITERS_PER_LEARNER = 10
#: map_batches defaults: one PreLearner actor (RLlib's default of max(2, num_learners) hangs
#: on a 2-CPU box: no CPU is left for anything else).
DEFAULT_MAP_BATCHES_KWARGS = {"concurrency": 1, "zero_copy_batch": True}
_RLREC = "rlrec"  # key in config.learner_config_dict


# =============================================================================================
# the feed actor


@ray.remote(num_cpus=0, max_restarts=0)
class ShardFeed:
    """Ray actor around `FeedState`; `next_work` long-polls (never spins)."""

    def __init__(self, policy: dict) -> None:
        logging.basicConfig(level=logging.INFO)
        self.state = FeedState(FeedPolicy(**policy))
        self._event: asyncio.Event | None = None
        self._acked: dict[str, int] = {}
        self.closed = False

    def _notify(self) -> None:
        if self._event is not None:
            self._event.set()

    async def next_work(self, timeout: float = 1.0) -> Work | str | None:
        if self._event is None:
            self._event = asyncio.Event()
        deadline = time.monotonic() + timeout
        while True:
            if self.closed:
                return "closed"
            w = self.state.next_work()
            if w is not None:
                return w
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._event.clear()
            try:
                await asyncio.wait_for(self._event.wait(), min(remaining, 0.25))
            except asyncio.TimeoutError:
                pass

    async def add_shards(self, infos: list[ShardInfo], trained_keys: list[str] | None = None) -> int:
        n = self.state.add_shards(infos, set(trained_keys or ()))
        self._notify()
        return n

    async def processed(self, tags: list[int], rows_out: int) -> None:
        self.state.processed(tags, rows_out)
        self._notify()

    async def failed(self, tag: int, kind: str, reason: str = "") -> None:
        idx = shard_of_tag(tag)
        self.state.failed(tag, requeue=(kind == "retry"))
        if kind == "missing":
            self.state.mark_missing(idx)
        elif kind == "bad":
            self.state.mark_bad(idx, reason)
        self._notify()

    async def ack(self, counts: dict, t: float, wait_s: float, compute_s: float, updates: int,
                  iter_id: str | None = None, seq: int = 0, consumed: int | None = None) -> None:
        self.state.ack(counts, t, wait_s, compute_s, updates, consumed)
        if iter_id is not None:
            self._acked[iter_id] = max(seq, self._acked.get(iter_id, 0))
        self._notify()

    async def pop_stats(self, marks: list | None = None, timeout: float = 10.0) -> IterationStats:
        """This iteration's stats, once the acks up to `marks` ([(iterator id, seq)]) arrived
        (acks are sent asynchronously by the Learners)."""
        if self._event is None:
            self._event = asyncio.Event()
        deadline = time.monotonic() + timeout
        for iter_id, seq in marks or ():
            while self._acked.get(iter_id, 0) < seq and time.monotonic() < deadline:
                self._event.clear()
                try:
                    await asyncio.wait_for(self._event.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass
        return self.state.pop_stats()

    async def has_data(self) -> bool:
        return self.state.has_data()

    async def has_fresh(self) -> bool:
        return self.state.has_fresh()

    async def summary(self) -> dict:
        return self.state.summary()

    async def set_policy(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self.state.policy, k, v)
        self.state._window_dirty = True
        self._notify()

    async def close(self) -> None:
        self.closed = True
        self._notify()


def _get_feed(spec: dict):
    return ray.get_actor(spec["feed"], namespace=spec["namespace"])


# =============================================================================================
# envelopes
#
# A read task that never ends cannot use Ray Data's normal block shaping: its output buffer
# emits a block only when it exceeds `target_max_block_size` (128 MiB) or when the task ends.
# So the pipeline's dataset gets `target_max_block_size = 1` and every block is ONE row holding
# a whole chunk ("envelope"): emitted as soon as it is yielded, never sliced (a block is only
# ever split between rows). The read task's envelope is the chunk as Arrow IPC; the PreLearner's
# envelope is its output batch packed column by column (`pack_columns`, raw numeric bytes, no
# pickle). `StreamIterator` (Learner side) unpacks and re-batches to exactly the minibatch size.

ENVELOPE = "rlrec_envelope"


def _table_to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _ipc_to_numpy_batch(data: bytes) -> Dict[str, np.ndarray]:
    from ray.data.block import BlockAccessor

    table = pa.ipc.open_stream(pa.BufferReader(data)).read_all()
    # the same Arrow -> numpy conversion Ray Data applies before calling a map_batches UDF
    return BlockAccessor.for_block(table).to_batch_format("numpy")


def pack_columns(batch: Dict[str, np.ndarray]) -> bytes:
    """A flat dict of numeric numpy arrays -> bytes (msgpack of dtype, shape, raw bytes)."""
    import msgpack

    out = {}
    for k, v in batch.items():
        a = np.asarray(v)
        if a.dtype.hasobject:
            raise TypeError(f"PreLearner output column {k!r} has dtype object; only numeric columns can be streamed")
        a = np.ascontiguousarray(a)
        out[k] = [a.dtype.str, list(a.shape), a.tobytes()]
    return msgpack.packb(out, use_bin_type=True)


def unpack_columns(data: bytes) -> Dict[str, np.ndarray]:
    import msgpack

    d = msgpack.unpackb(data, raw=False)
    out = {}
    for k, (dt, shape, raw) in d.items():
        dtype = np.dtype(dt)
        if dtype.hasobject:
            raise TypeError("object arrays are not accepted")
        out[k] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return out


def _rows(batch: Dict[str, np.ndarray]) -> int:
    return len(next(iter(batch.values()))) if batch else 0


# =============================================================================================
# the never-ending read task


class _TableCache:
    """Decoded shard tables, LRU by bytes (replay re-reads the same shards). An entry older
    than `ttl_s` is only served after checking that the shard still exists (deleted shards
    must stop being trained on)."""

    def __init__(self, max_bytes: int, ttl_s: float = 30.0) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.items: OrderedDict[str, tuple[pa.Table, float]] = OrderedDict()
        self.nbytes = 0

    def get(self, key: str, still_there: Any = None) -> pa.Table | None:
        item = self.items.get(key)
        if item is None:
            return None
        table, t = item
        if still_there is not None and time.monotonic() - t > self.ttl_s:
            if not still_there():
                self.drop(key)
                return None
            self.items[key] = (table, time.monotonic())
        self.items.move_to_end(key)
        return table

    def drop(self, key: str) -> None:
        item = self.items.pop(key, None)
        if item is not None:
            self.nbytes -= item[0].nbytes

    def put(self, key: str, table: pa.Table) -> None:
        if key in self.items or table.nbytes > self.max_bytes:
            return
        self.items[key] = (table, time.monotonic())
        self.nbytes += table.nbytes
        while self.nbytes > self.max_bytes and self.items:
            _, (old, _t) = self.items.popitem(last=False)
            self.nbytes -= old.nbytes


class BadShard(Exception):
    """A committed shard whose content cannot be used (checksum, format)."""


def _load_table(storage: Storage, s: ShardInfo, columns: list[str] | None, verify: bool) -> pa.Table:
    data = _read_shard_bytes(storage, s.path, s.staging_path)
    if verify and s.sha256 and hashlib.sha256(data).hexdigest() != s.sha256:
        raise BadShard(f"sha256 mismatch (the manifest says {s.sha256[:12]}...)")
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
        names = pf.schema_arrow.names
        if s.fmt == "episodes" and "item" not in names:
            raise BadShard("episode shard without an `item` column")
        cols = [c for c in columns if c in names] if columns else None
        table = pf.read(columns=cols)
    except (pa.ArrowInvalid, OSError) as e:
        raise BadShard(f"not a readable Parquet file: {e}") from None
    if table.num_rows != s.rows:
        raise BadShard(f"{table.num_rows} rows, the manifest says {s.rows}")
    return table


def _tabular_columns(table: pa.Table, requested: list[str] | None) -> list[str]:
    if requested:
        return [c for c in requested if c in table.column_names]
    # Columns RLlib's tabular PreLearner uses; null-typed agent/module ids, step index and
    # JSON infos are left out (nothing trains on them and their types vary between shards).
    drop = {"agent_id", "module_id", "t", "infos", "policy_version"}
    return [c for c in table.column_names if c not in drop and not pa.types.is_null(table.schema.field(c).type)]


def _read_stream(spec: dict) -> Iterable[pa.Table]:
    """The body of the single, never-ending read task: feed -> chunk -> envelope block."""
    feed = _get_feed(spec)
    storage = Storage.from_uri(spec["input"])
    cache = _TableCache(int(spec.get("cache_bytes", 256 << 20)), float(spec.get("cache_ttl_s", 30.0)))
    columns = spec.get("columns")
    verify = bool(spec.get("verify_checksums", True))
    while True:
        try:
            w = ray.get(feed.next_work.remote(1.0))
        except Exception:  # the feed is gone: the trainer is shutting down, end the stream
            return
        if w is None:
            continue
        if isinstance(w, str):  # "closed"
            return
        s = w.shard
        table = cache.get(s.key, lambda: storage.exists(s.path) or storage.exists(s.staging_path))
        if table is None:
            try:
                table = _load_table(storage, s, columns if s.fmt == "episodes" else None, verify)
                if s.fmt == "tabular":
                    table = table.select(_tabular_columns(table, columns))
            except FileNotFoundError:
                feed.failed.remote(w.tag, "missing")
                continue
            except BadShard as e:
                feed.failed.remote(w.tag, "bad", str(e))
                continue
            except Exception as e:  # storage outage etc.: give the chunk back, retry later
                log.warning("reading %s failed: %s", s.path, e)
                feed.failed.remote(w.tag, "retry", str(e))
                time.sleep(0.5)
                continue
            cache.put(s.key, table)
        n = w.stop - w.start
        chunk = table.slice(w.start, n)
        chunk = chunk.append_column(TAG, pa.array(np.full(n, w.tag, dtype=np.int64)))
        yield pa.table({ENVELOPE: pa.array([_table_to_ipc(chunk)], type=pa.binary()),
                        TAG: pa.array([w.tag], type=pa.int64())})


class ShardStreamDatasource(ray.data.Datasource):
    """A Ray Data source with ONE read task that never ends (see `_read_stream`)."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.spec = dict(spec)

    def estimate_inmemory_data_size(self) -> Optional[int]:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: Optional[int] = None,
                       data_context: Any = None) -> List[ray.data.ReadTask]:
        from ray.data.block import BlockMetadata

        spec = self.spec
        meta = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=None)
        return [ray.data.ReadTask(lambda: _read_stream(spec), meta)]

    def get_name(self) -> str:
        return "RlrecShardStream"


# =============================================================================================
# PreLearner with a safe decoder


def _tag_episode(ep: Any, tag: int) -> None:
    """Give every timestep of `ep` the extra model output TAG (rows keep it into the batch)."""
    from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer

    rb = ep.rewards
    n = len(rb.data)
    data: Any = [tag] * n if isinstance(rb.data, list) else np.full(n, tag, dtype=np.int64)
    buf = InfiniteLookbackBuffer(data=data, lookback=rb.lookback)
    buf.finalized = rb.finalized
    ep.extra_model_outputs[TAG] = buf


class SafeOfflinePreLearner(OfflinePreLearner):
    """`OfflinePreLearner` that decodes episode rows with `consumer.episodes.unpack_episode`.

    RLlib's own `__call__` runs ``msgpack.unpackb(item, object_hook=msgpack_numpy.decode)`` and
    ``SingleAgentEpisode.from_state``: both unpickle data from the shard (object arrays, space
    bounds), so anyone who can write to the bucket could run code in the trainer. This class
    refuses such payloads (the episode is skipped, logged and counted), skips episodes that are
    not done or empty (RLlib would raise and stop the pipeline), keeps only the extra model
    outputs listed in ``learner_config_dict["rlrec"]["keep_extra_model_outputs"]`` (keys that
    differ between shards would break batching) and tags every timestep (``rlrec_tag``).
    Tabular rows are mapped by RLlib's `_map_to_episodes` (with ``input_compress_columns=[]``
    nothing is unpickled); the tag column rides along as an extra model output.

    Subclass it for custom pre-processing (``--offline-config prelearner_class=pkg.mod.Class``).
    """

    def __init__(self, *, config: Any, spaces: Any = None, module_state: Any = None, **kwargs: Any) -> None:
        super().__init__(config=config, spaces=spaces, module_state=module_state, **kwargs)
        spec = (config.learner_config_dict or {}).get(_RLREC, {})
        self._rlrec_keep = set(spec.get("keep_extra_model_outputs") or ())
        self._rlrec_mode = spec.get("prelearner_mode", "episodes")
        self.rlrec_skipped = 0

    def _decode(self, batch: Dict[str, np.ndarray]) -> list:
        from consumer.episodes import EpisodeDecodeError, unpack_episode

        tags = batch.get(TAG)
        episodes = []
        for i, item in enumerate(batch["item"]):
            try:
                ep = unpack_episode(bytes(item))
            except EpisodeDecodeError as e:
                self.rlrec_skipped += 1
                if self.rlrec_skipped <= 10:
                    log.error("skipping an episode that cannot be decoded safely: %s", e)
                continue
            if not ep.is_done or len(ep) == 0:
                self.rlrec_skipped += 1
                continue
            for k in [k for k in ep.extra_model_outputs if k not in self._rlrec_keep]:
                del ep.extra_model_outputs[k]
            if tags is not None:
                _tag_episode(ep, int(tags[i]))
            episodes.append(ep)
        return episodes

    def _postprocess_and_sample(self, episodes: list) -> list:
        """RLlib's version, except that sampled transitions keep their extra model outputs
        (RLlib drops them: ``include_extra_model_outputs`` defaults to False), so the tag
        survives. All other extra outputs were removed in `_decode` unless kept on purpose."""
        episodes = self._validate_episodes(episodes)
        if self._module.is_stateful() and not self.config.prelearner_use_recorded_module_states:
            from ray.rllib.core.columns import Columns

            for eps in episodes:
                eps.extra_model_outputs.pop(Columns.STATE_OUT, None)
                eps.extra_model_outputs.pop(Columns.STATE_IN, None)
        self.episode_buffer.add(episodes)
        batch_length_T = self.config.model_config.get("max_seq_len", 0) if self._module.is_stateful() else None
        kw = dict(
            num_items=self.config.train_batch_size_per_learner,
            batch_length_T=batch_length_T,
            n_step=self.config.get("n_step", 1),
            sample_episodes=True,
            to_numpy=True,
            lookback=self.config.episode_lookback_horizon,
            min_batch_length_T=getattr(self.config, "burnin_len", 0),
        )
        try:
            return self.episode_buffer.sample(include_extra_model_outputs=True, **kw)
        except TypeError:  # a custom buffer class without that option (no shard tracking then)
            return self.episode_buffer.sample(**kw)

    def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        if self.config.input_read_episodes:
            episodes = self._decode(batch)
            if self._rlrec_mode == "buffer":
                if episodes or self.episode_buffer.get_num_timesteps() > 0:
                    episodes = self._postprocess_and_sample(episodes)
            elif self._module.is_stateful() and not self.config.prelearner_use_recorded_module_states:
                from ray.rllib.core.columns import Columns

                for eps in episodes:
                    eps.extra_model_outputs.pop(Columns.STATE_OUT, None)
                    eps.extra_model_outputs.pop(Columns.STATE_IN, None)
        else:
            from ray.rllib.offline.offline_prelearner import SCHEMA

            schema = SCHEMA | (self.config.input_read_schema or {})
            known = set(schema) | set(schema.values()) | self._rlrec_keep | {TAG}
            batch = {k: v for k, v in batch.items() if k in known}
            episodes = self._map_to_episodes(batch, to_numpy=False)["episodes"]
        if not episodes:
            return {}
        out = self._learner_connector(rl_module=self._module, batch={}, episodes=episodes,
                                      shared_data={}, metrics=None)
        for module_id in list(out):
            if not self._should_module_be_updated(module_id, out):
                del out[module_id]
        return flatten_dict(out)


_envelope_classes: dict[type, type] = {}


def envelope_prelearner_class(cls: type) -> type:
    """`cls` (an OfflinePreLearner class) taking and returning envelopes (see above), and
    reporting to the feed how many rows it produced from which chunks."""
    if cls in _envelope_classes:
        return _envelope_classes[cls]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, *args, **kwargs)
        spec = (kwargs["config"].learner_config_dict or {}).get(_RLREC, {})
        self._rlrec_feed = _get_feed(spec) if spec.get("feed") else None

    def __call__(self, batch: Dict[str, np.ndarray]) -> pa.Table:
        outs, rows = [], []
        for env, tag in zip(batch[ENVELOPE], batch[TAG]):
            out = cls.__call__(self, _ipc_to_numpy_batch(bytes(env)))
            outs.append(pack_columns(out) if out else b"")
            rows.append(_rows(out) if out else 0)
            if self._rlrec_feed is not None:
                self._rlrec_feed.processed.remote([int(tag)], rows[-1])
        # an Arrow table, not a numpy object array: Ray Data sizes Arrow blocks exactly, so each
        # one-row envelope leaves the actor at once (object arrays were held back, unsized)
        return pa.table({ENVELOPE: pa.array(outs, type=pa.binary()), "rlrec_rows": pa.array(rows, type=pa.int64())})

    wrapped = type(f"Envelope{cls.__name__}", (cls,), {"__init__": __init__, "__call__": __call__})
    _envelope_classes[cls] = wrapped
    return wrapped


# =============================================================================================
# Learner side: unpack, re-batch, acknowledge


class _RowBuffer:
    """A ring buffer of processed rows (flat dict of arrays) for re-sampling on the Learner."""

    def __init__(self, capacity: int, seed: int | None = None) -> None:
        self.capacity = max(1, int(capacity))
        self.cols: Dict[str, np.ndarray] | None = None
        self.size = 0
        self.pos = 0
        self.rng = np.random.default_rng(seed)

    def add(self, batch: Dict[str, np.ndarray]) -> None:
        n = _rows(batch)
        if n == 0:
            return
        if self.cols is None or set(batch) != set(self.cols):
            if self.cols is not None and self.size:
                log.warning("the PreLearner's output columns changed; the Learner-side buffer restarts")
            self.cols = {k: np.empty((self.capacity, *v.shape[1:]), dtype=v.dtype) for k, v in batch.items()}
            self.size = self.pos = 0
        if n >= self.capacity:
            batch = {k: v[-self.capacity:] for k, v in batch.items()}
            n = self.capacity
        idx = (self.pos + np.arange(n)) % self.capacity
        for k, v in batch.items():
            self.cols[k][idx] = v
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.capacity, self.size + n)

    def sample(self, n: int) -> Dict[str, np.ndarray]:
        idx = self.rng.integers(0, self.size, n)
        return {k: v[idx] for k, v in self.cols.items()}


class StreamIterator:
    """What the Learner(s) iterate: a `ray.data.DataIterator` of PreLearner envelopes, unpacked
    and re-batched to exactly `batch_size` rows (``iter_torch_batches`` for the iterator path,
    ``iter_batches`` for the local single-batch path).

    A background thread pulls envelopes as they come. Each minibatch takes the rows that arrived
    since the last one first (at most ``fresh_share`` of the batch while the buffer is warm, so
    consecutive rows of one chunk are spread over several minibatches) and fills up with rows
    sampled from a ring buffer of recently streamed rows (``learner_buffer_rows``): the Learner
    never waits for the pipeline once the buffer holds a batch, every streamed row is trained on
    right after it arrives, and when the pipeline is slower than the Learner, recent rows are
    replayed (as RLlib's materialized BC data is, epoch after epoch).

    Every minibatch is acknowledged to the feed (asynchronously, numbered): its rows' tags say
    which shards were trained on; the number of rows taken from the stream releases the feed's
    flow control. The tag column is removed before the Learner sees the batch. Picklable (remote
    Learners get it inside `TrainingData`); the thread starts where it is iterated.
    """

    def __init__(self, it: Any, spec: dict) -> None:
        self._it = it
        self._spec = {"feed": spec.get("feed"), "namespace": spec.get("namespace"),
                      "learner_buffer_rows": spec.get("learner_buffer_rows"),
                      "fresh_share": float(spec.get("fresh_share", 0.5))}
        self.iter_id = uuid.uuid4().hex
        self.seq = 0
        self._feed = None
        self._thread = None
        self._queue = None
        self._stop = None
        self._done = False
        self._buffer = None
        self.stats = {"rows_streamed": 0, "rows_replayed": 0}

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d.update(_feed=None, _thread=None, _queue=None, _stop=None, _buffer=None, _done=False)
        d.pop("_unsent", None)
        return d

    def _get_feed(self) -> Any:
        if self._feed is None and self._spec.get("feed"):
            self._feed = _get_feed(self._spec)
        return self._feed

    def rlrec_mark(self) -> tuple[str, int]:
        """Send what is not acknowledged yet; (iterator id, acks sent): an iteration barrier."""
        self._flush()
        return self.iter_id, self.seq

    def _ack(self, counts: dict[int, int], wait: float, consumed: int) -> None:
        """Acks are batched (every 50 ms or 8 minibatches): an actor call per minibatch costs
        about as much as a small gradient step."""
        p = self.__dict__.setdefault("_unsent", {"counts": {}, "wait": 0.0, "consumed": 0, "n": 0,
                                                 "t": time.time(), "sent": time.monotonic()})
        if not p["n"]:
            p["t"] = time.time()        # time of the first minibatch of this ack
        for k, v in counts.items():
            p["counts"][k] = p["counts"].get(k, 0) + v
        p["wait"] += wait
        p["consumed"] += consumed
        p["n"] += 1
        if p["n"] >= 8 or time.monotonic() - p["sent"] >= 0.05:
            self._flush()

    def _flush(self) -> None:
        p = self.__dict__.get("_unsent")
        if not p or not p["n"]:
            return
        feed = self._get_feed()
        self.seq += 1
        if feed is not None:
            feed.ack.remote(p["counts"], p["t"], p["wait"], 0.0, p["n"], self.iter_id, self.seq, p["consumed"])
        self._unsent = {"counts": {}, "wait": 0.0, "consumed": 0, "n": 0, "t": time.time(),
                        "sent": time.monotonic()}

    def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _start(self) -> None:
        import queue

        self._queue = queue.Queue(maxsize=64)
        self._stop = threading.Event()

        def pump() -> None:
            # prefetch_batches=0: Ray Data's prefetcher yields a block only once newer blocks
            # have arrived, i.e. it would hold the freshest chunks back until more data comes.
            inner = self._it.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0)
            try:
                for env_batch in inner:
                    for blob in env_batch[ENVELOPE]:
                        if blob:
                            d = unpack_columns(bytes(blob))
                            if _rows(d):
                                while not self._stop.is_set():
                                    try:
                                        self._queue.put(d, timeout=0.2)
                                        break
                                    except queue.Full:
                                        continue
                    if self._stop.is_set():
                        break
            except Exception as e:  # the stream ended badly (shutdown): the Learner sees the end
                if not self._stop.is_set():
                    log.warning("stream iterator stopped: %s", e)
            finally:
                try:
                    inner.close()
                except Exception:
                    pass
                self._queue.put(None)

        self._thread = threading.Thread(target=pump, name="rlrec-stream", daemon=True)
        self._thread.start()
        # The Learner loop (mostly Python between short torch calls) would otherwise hold the
        # GIL for whole 5 ms switch intervals and starve this thread and Ray Data's executor
        # thread when the Learner runs in the driver (num_learners=0): measured 3k vs 17k rows/s.
        import sys

        if sys.getswitchinterval() > 0.0005:
            sys.setswitchinterval(0.0005)

    def _batches(self, batch_size: int, *, local_shuffle_buffer_size: int | None = None,
                 local_shuffle_seed: int | None = None, drop_last: bool = False, **_: Any):
        import queue

        if self._thread is None:
            self._start()
        self._get_feed()  # creates the feed actor if missing
        B = int(batch_size)
        cap = int(self._spec.get("learner_buffer_rows") or 0) or 64 * B
        cap = max(cap, int(local_shuffle_buffer_size or 0), 2 * B)
        if self._buffer is None:
            self._buffer = _RowBuffer(cap, local_shuffle_seed)
        buf = self._buffer
        max_fresh = max(1, int(round(self._spec["fresh_share"] * B)))
        pending: list[Dict[str, np.ndarray]] = []
        n_pending = 0
        wait = 0.0
        while True:
            # everything that arrived (non-blocking); block only while nothing can be trained
            while True:
                try:
                    d = self._queue.get_nowait()
                except queue.Empty:
                    if n_pending or buf.size >= B or self._done:
                        break
                    t0 = time.perf_counter()
                    d = self._queue.get()
                    wait += time.perf_counter() - t0
                if d is None:
                    self._done = True
                    break
                pending.append(d)
                n_pending += _rows(d)
            if self._done and not n_pending:
                return
            if pending:
                keys = set(pending[0])
                for p in pending[1:]:
                    keys &= set(p)
                merged = {k: np.concatenate([p[k] for p in pending]) if len(pending) > 1 else pending[0][k]
                          for k in keys}
            else:
                merged = {}
            # fresh rows first: all of them while the buffer is cold, else up to max_fresh
            take = min(n_pending, B if buf.size < B else max_fresh)
            fresh = {k: v[:take] for k, v in merged.items()}
            rest = {k: v[take:] for k, v in merged.items()}
            pending, n_pending = ([rest], n_pending - take) if n_pending > take else ([], 0)
            if take:
                buf.add(fresh)
            if take < B:
                if buf.size == 0:
                    continue
                fill = buf.sample(B - take)
                out = {k: np.concatenate([fresh[k], fill[k]]) for k in fill} if take else fill
            else:
                out = fresh
            self.stats["rows_streamed"] += take
            self.stats["rows_replayed"] += B - take
            counts: dict[int, int] = {}
            for k in [k for k in out if k == TAG or k.endswith("/" + TAG)]:
                vals, cnts = np.unique(out.pop(k), return_counts=True)
                for v, c in zip(vals.tolist(), cnts.tolist()):
                    counts[int(v)] = counts.get(int(v), 0) + int(c)
            self._ack(counts, wait, take)
            wait = 0.0
            yield out

    def iter_batches(self, *, batch_size: int, _collate_fn: Any = None, **kwargs: Any):
        for b in self._batches(batch_size, **kwargs):
            yield _collate_fn(b) if _collate_fn is not None else b

    def iter_torch_batches(self, *, batch_size: int, device: Any = None, dtypes: Any = None,
                           collate_fn: Any = None, **kwargs: Any):
        import torch

        dev = device if device is not None else "cpu"
        for b in self._batches(batch_size, **kwargs):
            if collate_fn is not None:
                yield collate_fn(b)
                continue
            yield {k: torch.as_tensor(_writable(v), device=dev) for k, v in b.items()}


def _writable(a: np.ndarray) -> np.ndarray:
    """A contiguous array torch may share: arrays viewed from Arrow buffers are read-only, and
    torch warns about (and must not write through) a tensor over read-only memory."""
    a = np.ascontiguousarray(a)
    return a if a.flags.writeable else a.copy()


# =============================================================================================
# OfflineData


class ManifestOfflineData(OfflineData):
    """`OfflineData` that follows the manifest and streams shards through one pipeline.

    Unlike RLlib's `OfflineData`, `__init__` reads nothing: the dataset is built on the first
    `sample()` and then lives for the whole run. Call `start(trained_keys)` (the restored cursor)
    before training, `refresh()` to pick up new shards now (a background thread also polls every
    ``poll_interval_s``), `pop_stats()` after each iteration and `stop()` at the end.
    """

    def __init__(self, config: Any) -> None:  # noqa: D401 - deliberately no super().__init__
        self.config = config
        self.is_multi_agent = config.is_multi_agent
        if self.is_multi_agent:
            raise ValueError("the continuous trainer supports single-agent data only")
        spec = (config.learner_config_dict or {}).get(_RLREC)
        if not spec:
            raise ValueError("ManifestOfflineData needs trainer.data.configure_continuous(config, ...)")
        self.spec = spec
        self.path = spec["input"]
        self.storage = Storage.from_uri(spec["input"])
        self.data_read_method = "rlrec_manifest"
        self.data_read_method_kwargs = dict(config.input_read_method_kwargs or {})
        self.data_read_batch_size = config.input_read_batch_size
        self.materialize_data = False
        self.materialize_mapped_data = False
        self.data_is_mapped = False
        self.filesystem = self.filesystem_kwargs = self.filesystem_object = None
        self.data = None
        self.batch_iterators = None
        self.map_batches_kwargs = DEFAULT_MAP_BATCHES_KWARGS | dict(config.map_batches_kwargs or {})
        self.iter_batches_kwargs = self.default_iter_batches_kwargs | dict(config.iter_batches_kwargs or {})
        self.returned_streaming_split = False
        self.prelearner_class = config.prelearner_class or SafeOfflinePreLearner
        self.locality_hints = None
        self.learner_handles = None
        self.module_spec = None
        self.follower = ManifestFollower(
            self.storage, policy_id=spec.get("policy_id"), min_policy_version=spec.get("min_policy_version"),
            max_policy_version=spec.get("max_policy_version"),
            fmt="episodes" if config.input_read_episodes else "tabular",
        )
        self.feed = ShardFeed.options(name=spec["feed"], namespace=spec["namespace"],
                                      get_if_exists=True).remote(spec["feed_policy"])
        self.poll_interval_s = float(spec.get("poll_interval_s", 0.5))
        self._started = False
        self._trained_keys: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._local_iterators: list[StreamIterator] = []
        self.last_poll_error: str | None = None

    # ------------------------------------------------------------------ manifest
    def start(self, trained_keys: Iterable[str] = ()) -> None:
        """Load the manifest (shards in `trained_keys` are history, the rest fresh) and start polling."""
        if self._started:
            return
        self._trained_keys = set(trained_keys)
        self._started = True
        self.refresh(force_discover=True)
        self._thread = threading.Thread(target=self._poll_loop, name="rlrec-manifest", daemon=True)
        self._thread.start()

    def refresh(self, force_discover: bool = False) -> int:
        """Read new manifest entries now and hand them to the feed; returns how many."""
        with self._lock:
            try:
                infos = self.follower.poll(force_discover=force_discover)
                self.last_poll_error = None
            except Exception as e:  # storage hiccup: keep training on what we have
                self.last_poll_error = f"{type(e).__name__}: {e}"
                log.warning("manifest poll failed: %s", self.last_poll_error)
                return 0
            if infos:
                ray.get(self.feed.add_shards.remote(infos, [s.key for s in infos if s.key in self._trained_keys]))
            return len(infos)

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self.refresh()
            except Exception as e:  # e.g. the feed actor is gone at shutdown
                if self._stop.is_set():
                    return
                log.warning("manifest poll failed: %s", e)

    @property
    def shards_total(self) -> int:
        return len(self.follower.entries)

    def entry(self, key: str) -> ShardEntry | None:
        return self.follower.entries.get(key)

    def pop_stats(self, marks: list | None = None) -> IterationStats:
        """Stats since the last call (call after `algo.train()` with `iteration_marks(...)`)."""
        return ray.get(self.feed.pop_stats.remote(marks))

    def has_data(self) -> bool:
        return ray.get(self.feed.has_data.remote())

    def has_fresh(self) -> bool:
        return ray.get(self.feed.has_fresh.remote())

    def summary(self) -> dict:
        return ray.get(self.feed.summary.remote())

    def stop(self) -> None:
        """Stop polling, close the local iterators (while Ray is still up) and end the stream
        (the read task returns, the PreLearner actors are released, the feed actor is killed)."""
        self._stop.set()
        gens = [self.batch_iterators] if isinstance(self.batch_iterators, types.GeneratorType) else []
        for h in self.learner_handles or ():
            if isinstance(h, ray.actor.ActorHandle):
                continue
            it = getattr(h, "iterator", None)
            gens.append(getattr(it, "_epoch_iterator", None))
            try:
                h.iterator = None
            except Exception:
                pass
        for g in gens:
            if hasattr(g, "close"):
                try:
                    g.close()
                except Exception:
                    pass
        self.batch_iterators = None
        try:   # ends the stream: the read task returns, the iterators see the end
            ray.get(self.feed.close.remote(), timeout=5)
        except Exception:
            pass
        for it in self._local_iterators:
            it.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            ray.kill(self.feed)
        except Exception:
            pass

    # ------------------------------------------------------------------ pipeline
    def _module_state(self, num_shards: int) -> Any:
        if num_shards >= 1:
            return ray.get(self.learner_handles[0].get_state.remote(component=COMPONENT_RL_MODULE))[COMPONENT_RL_MODULE]
        return self.learner_handles[0].get_state(component=COMPONENT_RL_MODULE)[COMPONENT_RL_MODULE]

    def build_pipeline(self, num_shards: int, module_state: Any = None) -> None:
        """Build the one dataset of the run: stream source -> PreLearner (map_batches)."""
        if not self._started:
            self.start()
        ds = ray.data.read_datasource(
            ShardStreamDatasource({**self.spec, "columns": self._columns()}),
            override_num_blocks=1,
            num_cpus=0,
        )
        # every block is one envelope row: emit each as soon as it is yielded (see above)
        ds.context.target_max_block_size = 1
        ds.context.enable_progress_bars = False
        ds.context.enable_operator_progress_bars = False
        ds.context.print_on_execution_start = False
        self.data = ds.map_batches(
            envelope_prelearner_class(self.prelearner_class),
            fn_constructor_kwargs={
                "config": self.config,
                "spaces": self.spaces[INPUT_ENV_SPACES],
                "module_spec": self.module_spec,
                "module_state": module_state if module_state is not None else self._module_state(num_shards),
            },
            batch_size=None,   # one envelope (one chunk) per call
            **self.map_batches_kwargs,
        )
        self.data_is_mapped = True

    def _columns(self) -> list[str] | None:
        if self.config.input_read_episodes:
            return ["item"]
        cols = self.data_read_method_kwargs.get("columns")
        return list(cols) if cols else None

    def iteration_marks(self, learner_group: Any = None) -> list[tuple[str, int]]:
        """Barrier marks of every StreamIterator in use (local and remote Learners)."""
        marks = [it.rlrec_mark() for it in self._local_iterators]
        if learner_group is not None and learner_group.is_remote:
            def mark(learner: Any) -> Any:
                it = getattr(getattr(learner, "iterator", None), "_iterator", None)
                return it.rlrec_mark() if hasattr(it, "rlrec_mark") else None

            for r in learner_group.foreach_learner(mark):
                try:
                    v = r.get()
                except Exception:
                    continue
                if v is not None:
                    marks.append(tuple(v))
        return marks

    def sample(self, num_samples: int, return_iterator: bool = False, num_shards: int = 1,
               module_state: Any = None) -> Any:
        if not self.data_is_mapped:
            self.build_pipeline(num_shards, module_state)
        if not self.batch_iterators:
            if num_shards > 1:
                splits = self.data.streaming_split(n=num_shards, equal=True, locality_hints=self.locality_hints)
                self.batch_iterators = [StreamIterator(it, self.spec) for it in splits]
            elif return_iterator:
                self.batch_iterators = [StreamIterator(self.data.iterator(), self.spec)]
                if num_shards == 0:
                    self._local_iterators = list(self.batch_iterators)
            else:
                def _collate_fn(_batch: Dict[str, np.ndarray]) -> MultiAgentBatch:
                    _batch = unflatten_dict(_batch)
                    return MultiAgentBatch(
                        {mid: SampleBatch(d) for mid, d in _batch.items()},
                        env_steps=sum(len(next(iter(d.values()))) for d in _batch.values()),
                    )

                it = StreamIterator(self.data.iterator(), self.spec)
                self._local_iterators = [it]
                self.batch_iterators = iter(it.iter_batches(batch_size=num_samples, _collate_fn=_collate_fn,
                                                            **self.iter_batches_kwargs))
        if return_iterator:
            return force_list(self.batch_iterators)
        return next(self.batch_iterators)


# =============================================================================================
# configuration


def configure_continuous(config: Any, input_uri: str, *, fmt: str = "episodes",
                         feed_policy: FeedPolicy | dict | None = None, policy_id: str | None = None,
                         min_policy_version: int | None = None, max_policy_version: int | None = None,
                         poll_interval_s: float = 0.5, verify_checksums: bool = True,
                         keep_extra_model_outputs: Iterable[str] = (), cache_bytes: int = 256 << 20,
                         cache_ttl_s: float = 30.0,
                         prelearner_mode: str = "episodes", learner_buffer_rows: int | None = None,
                         fresh_share: float = 0.5) -> Any:
    """Make an RLlib offline `config` (BC, MARWIL, CQL, IQL, ...) train continuously on the
    shards committed under `input_uri`. Returns the config (changed in place).

    Sets: ``offline_data_class=ManifestOfflineData``, ``input_=input_uri``,
    ``input_read_episodes`` from `fmt`, ``input_compress_columns=[]`` (never unpickle),
    no materialization, ``prelearner_class=SafeOfflinePreLearner`` unless one is set (episode
    shards need a subclass of it), ``dataset_num_iters_per_learner`` (10 unless set: a stream
    has no epochs), PreLearner concurrency 1 unless set, and ``learner_config_dict["rlrec"]``
    with the feed's name and the data-path settings. `learner_buffer_rows` (default 64 x
    train_batch_size_per_learner) and `fresh_share` configure the Learner side (`StreamIterator`).
    """
    if fmt not in ("episodes", "tabular"):
        raise ValueError(f"fmt must be 'episodes' or 'tabular', got {fmt!r}")
    if prelearner_mode not in ("episodes", "buffer"):
        raise ValueError(f"prelearner_mode must be 'episodes' or 'buffer', got {prelearner_mode!r}")
    if not 0.0 < fresh_share <= 1.0:
        raise ValueError("fresh_share must be in (0, 1]")
    pre = config.prelearner_class
    if pre is not None:
        if fmt == "episodes" and not issubclass(pre, SafeOfflinePreLearner):
            raise ValueError(
                f"prelearner_class {pre.__name__} must subclass trainer.data.SafeOfflinePreLearner for "
                "episode shards: RLlib's OfflinePreLearner decodes them with msgpack_numpy, which "
                "unpickles data from the bucket")
    if isinstance(feed_policy, dict):
        feed_policy = FeedPolicy(**feed_policy)
    feed_policy = feed_policy or FeedPolicy()
    B = int(config.train_batch_size_per_learner or config.train_batch_size or 512)
    feed_policy.batch_rows = B
    feed_policy.prelearner_mode = prelearner_mode
    if config.input_read_batch_size:
        feed_policy.chunk_rows = int(config.input_read_batch_size)
    if feed_policy.chunk_steps is None and feed_policy.chunk_rows is None:
        feed_policy.chunk_steps = 4 * B   # fewer, larger PreLearner calls (measured: ~1.5x rows/s vs 1*B)
    chunk = int(feed_policy.chunk_steps or feed_policy.chunk_rows or B)
    if prelearner_mode == "buffer" and fmt == "episodes":
        chunk = B
    n_learners = max(1, int(config.num_learners or 0))
    # rows in flight between the feed and the Learner: one chunk being read + two minibatches.
    # The Learner never waits on the pipeline (it re-samples its buffer), so a short pipeline
    # costs no throughput and keeps a fresh chunk from queueing behind older ones.
    floor = n_learners * (chunk + 2 * B)
    if feed_policy.max_ahead_rows < floor:
        feed_policy.max_ahead_rows = floor
    mb = dict(DEFAULT_MAP_BATCHES_KWARGS)
    mb.update(config.map_batches_kwargs or {})
    config.offline_data(
        offline_data_class=ManifestOfflineData,
        input_=input_uri,
        input_read_episodes=(fmt == "episodes"),
        input_compress_columns=[],
        materialize_data=False,
        materialize_mapped_data=False,
        map_batches_kwargs=mb,
        dataset_num_iters_per_learner=config.dataset_num_iters_per_learner or DEFAULT_DATASET_NUM_ITERS_PER_LEARNER,
    )
    if pre is None:
        config.offline_data(prelearner_class=SafeOfflinePreLearner)
    ctx = ray.get_runtime_context() if ray.is_initialized() else None
    spec = {
        "input": input_uri,
        "feed": f"rlrec-feed-{uuid.uuid4().hex[:12]}",
        "namespace": (ctx.namespace if ctx is not None else None) or "rlrec",
        "feed_policy": feed_policy.to_dict(),
        "policy_id": policy_id,
        "min_policy_version": min_policy_version,
        "max_policy_version": max_policy_version,
        "poll_interval_s": poll_interval_s,
        "verify_checksums": verify_checksums,
        "keep_extra_model_outputs": sorted(set(keep_extra_model_outputs)),
        "cache_bytes": int(cache_bytes),
        "cache_ttl_s": float(cache_ttl_s),
        "prelearner_mode": prelearner_mode,
        "learner_buffer_rows": learner_buffer_rows,
        "fresh_share": float(fresh_share),
    }
    config.learners(learner_config_dict={_RLREC: spec})
    return config
