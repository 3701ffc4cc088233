"""The never-ending read task: asks the feed for work, reads committed shards, yields chunks."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from rlrec.producer.bounded import ByteBoundedLRU
from rlrec.store.commit import read_committed_shard
from rlrec.store.retry import BACKGROUND, RetryPolicy, RetrySchedule
from rlrec.store.schema_gate import ShardSchemaError, open_shard
from rlrec.store.storage import Storage, StorageError, is_refusal
from rlrec.trainer.envelopes import ENVELOPE, table_to_ipc
from rlrec.trainer.feed import TAG, ShardInfo
from rlrec.trainer.feed_actor import get_feed
from rlrec.trainer.multi_agent import FOLDER

log = logging.getLogger("rlrec.trainer")


class _TableCache:
    """Decoded shard tables, LRU by bytes (replay re-reads the same shards). An entry older
    than `ttl_s` is only served after checking that the shard still exists (deleted shards
    must stop being trained on)."""

    def __init__(self, max_bytes: int, ttl_s: float = 30.0) -> None:
        self.ttl_s = ttl_s
        self.lru: ByteBoundedLRU[str, tuple[pa.Table, float]] = ByteBoundedLRU(max_bytes)

    def get(self, key: str, still_there: Any = None) -> pa.Table | None:
        item = self.lru.get(key)
        if item is None:
            return None
        table, t = item
        if still_there is not None and time.monotonic() - t > self.ttl_s:
            try:
                there = still_there()
            except Exception:  # the store does not answer: the table was read and verified, keep serving it
                return table
            if not there:
                self.lru.pop(key)
                return None
            self.lru.put(key, (table, time.monotonic()), table.nbytes)
        return table

    def clear(self) -> None:
        """Drop every table (the reader ran out of memory)."""
        self.lru.clear()

    def put(self, key: str, table: pa.Table) -> None:
        if key not in self.lru:
            self.lru.put(key, (table, time.monotonic()), table.nbytes)


class BadShard(Exception):
    """A committed shard whose content cannot be used (checksum, format)."""


def _load_table(storage: Storage, s: ShardInfo, columns: list[str] | None, verify: bool) -> pa.Table:
    data = read_committed_shard(storage, s.path, s.staging_path, s.nbytes)
    if verify and s.sha256 and hashlib.sha256(data).hexdigest() != s.sha256:
        raise BadShard(f"sha256 mismatch (the manifest says {s.sha256[:12]}...)")
    try:  # the bytes are here: from now on a failure is the data's, not the store's
        shard = open_shard(data, fmt=s.fmt)  # the schema gate: nothing is read before it passes
        table = shard.read(columns or None)
    except ShardSchemaError as e:
        raise BadShard(f"refused by the schema gate: {e.reason}") from None
    except MemoryError:  # pa.ArrowMemoryError too: the reader's memory, not the data's fault
        raise
    except Exception as e:  # e.g. a corrupt page (pyarrow raises OSError for some)
        raise BadShard(f"unreadable: {type(e).__name__}: {e}") from None
    if table.num_rows != s.rows:
        raise BadShard(f"{table.num_rows} rows, the manifest says {s.rows}")
    return table


def _judged_table(
    storage: Storage, s: ShardInfo, columns: list[str] | None, verify: bool, policy: RetryPolicy
) -> pa.Table:
    """The shard's table, or a verdict that stands: `FileNotFoundError` (gone) or `BadShard`
    only when a second read, one retry wait (`policy`) after the first, fails that way too (a
    torn read, a replica not yet there, a flipped bit in transit do not condemn a shard)."""
    try:
        return _load_table(storage, s, columns, verify)
    except (FileNotFoundError, BadShard) as e:
        wait = policy.delay(0)
        log.info("shard %s: %s; reading it again in %.1fs before judging it", s.key, e or "not found", wait)
        time.sleep(wait)
    return _load_table(storage, s, columns, verify)


def _tabular_columns(table: pa.Table, requested: list[str] | None) -> list[str]:
    if requested:
        return [c for c in requested if c in table.column_names]
    # Columns RLlib's tabular PreLearner uses; null-typed agent/module ids, step index and
    # JSON infos are left out (nothing trains on them and their types vary between shards).
    drop = {"agent_id", "module_id", "t", "infos", "policy_version"}
    return [c for c in table.column_names if c not in drop and not pa.types.is_null(table.schema.field(c).type)]


#: the column holding each row's policy version (an episode's, in both shard formats)
VERSION = "policy_version"


def _id_column(s: ShardInfo) -> str:
    return "episode_id" if s.fmt == "episodes" else "eps_id"


def _filter_columns(s: ShardInfo) -> list[str]:
    """The columns the row filters of `s` read (`_rows_kept`)."""
    return [*([VERSION] if s.versions is not None else []), *([_id_column(s)] if s.episodes is not None else [])]


def _rows_kept(chunk: pa.Table, s: ShardInfo, columns: list[str] | None) -> pa.Table:
    """The rows of `chunk` (of shard `s`) that its filters keep, episode by episode (an episode's
    rows share its id and version): a policy version within `s.versions` (lowest, highest; None:
    no bound; a row without a version is dropped) and an episode id in `s.episodes`; the columns
    read only for the filters are dropped (unless asked for in `columns`)."""
    mask = pa.array([True] * chunk.num_rows, pa.bool_())
    if s.versions is not None:
        lo, hi = s.versions
        v = chunk.column(VERSION) if VERSION in chunk.column_names else pa.nulls(chunk.num_rows, pa.int64())
        mask = pc.and_(mask, pc.is_valid(v))
        if lo is not None:
            mask = pc.and_(mask, pc.greater_equal(v, lo))
        if hi is not None:
            mask = pc.and_(mask, pc.less_equal(v, hi))
    if s.episodes is not None:
        ids = chunk.column(_id_column(s)).cast(pa.string())
        mask = pc.and_(mask, pc.is_in(ids, value_set=pa.array(sorted(s.episodes), pa.string())))
    out = chunk.filter(pc.fill_null(mask, False))
    drop = [c for c in _filter_columns(s) if c in out.column_names and c not in (columns or ())]
    if s.fmt == "tabular":  # a tabular chunk keeps the columns _tabular_columns keeps
        drop = [c for c in drop if c == VERSION]
    return out.drop_columns(drop) if drop else out


def _read_stream(spec: dict) -> Iterable[pa.Table]:
    """The body of each never-ending read task: feed -> chunk -> envelope block."""
    feed = get_feed(spec)
    storage = Storage.from_uri(spec["input"])
    cache = _TableCache(int(spec.get("cache_bytes", 256 << 20)), float(spec.get("cache_ttl_s", 30.0)))
    columns = spec.get("columns")
    if columns and FOLDER in columns:  # not read: each chunk gets its shard's folder
        columns = [c for c in columns if c != FOLDER]
        spec = {**spec, "folder": True}
    verify = bool(spec.get("verify_checksums", True))
    feed.reader.remote(1)
    try:
        yield from _serve(feed, storage, cache, columns, verify, folder=bool(spec.get("folder")))
    finally:
        try:
            feed.reader.remote(-1)
        except Exception:  # the feed is gone (shutdown)
            pass


def _serve(
    feed: Any,
    storage: Storage,
    cache: _TableCache,
    columns: list[str] | None,
    verify: bool,
    policy: RetryPolicy = BACKGROUND,
    folder: bool = False,
):
    """Serve the feed's work until it closes.

    A shard is reported ``missing`` (gone) or ``bad`` (checksum, schema gate, decoding) only
    when two reads a retry wait apart agree (`_judged_table`). Otherwise the chunk goes back to
    the feed and the next read waits for the one retry schedule (`policy`): a `StorageError`
    or other OSError means the store did not answer (``retry``, counted as a storage error,
    which the driver reports); a refusal (permission, credentials: `is_refusal`) is ``refused``,
    logged as an ERROR here and on the driver, and retried all the same -- a shard is never
    skipped because the store would not give it; a MemoryError is the reader's (``busy``: the
    table cache is dropped)."""
    outage = RetrySchedule(policy)
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
        table = cache.get(s.key, lambda s=s: storage.exists(s.path) or storage.exists(s.staging_path))
        if table is None:
            try:
                extra = _filter_columns(s)  # what the row filters read, dropped per chunk
                wanted = columns if s.fmt == "episodes" else None
                if wanted:
                    wanted = [*wanted, *(c for c in extra if c not in wanted)]
                table = _judged_table(storage, s, wanted, verify, policy)
                if s.fmt == "tabular":
                    kept = _tabular_columns(table, columns)
                    kept += [c for c in extra if c in table.column_names and c not in kept]
                    table = table.select(kept)
            except FileNotFoundError:
                feed.failed.remote(w.tag, "missing")
                continue
            except BadShard as e:
                feed.failed.remote(w.tag, "bad", str(e))
                continue
            except MemoryError as e:
                cache.clear()
                wait = outage.failed(time.monotonic())
                log.warning("reading %s: out of memory (%s); chunk given back, next read in %.1fs", s.key, e, wait)
                feed.failed.remote(w.tag, "busy", f"{type(e).__name__}: {e}")
                time.sleep(wait)
                continue
            except (StorageError, OSError) as e:  # give the chunk back, retry on the schedule
                wait = outage.failed(time.monotonic())
                if is_refusal(e):
                    log.error("store refuses (%s) reading %s; next read in %.1fs", e, storage.uri(s.path), wait)
                    feed.failed.remote(w.tag, "refused", f"{type(e).__name__}: {e}")
                else:
                    log.warning("reading %s failed (%s); next read in %.1fs", storage.uri(s.path), e, wait)
                    feed.failed.remote(w.tag, "retry", f"{type(e).__name__}: {e}")
                time.sleep(wait)
                continue
            except Exception as e:  # the verified table cannot be used (e.g. its columns): unusable
                feed.failed.remote(w.tag, "bad", f"unreadable: {type(e).__name__}: {e}")
                continue
            outage.succeeded()
            cache.put(s.key, table)
        chunk = table.slice(w.start, w.stop - w.start)
        if s.versions is not None or s.episodes is not None:
            chunk = _rows_kept(chunk, s, columns)
            if not chunk.num_rows:  # every episode of it outside the filters: nothing to train on
                feed.processed.remote([w.tag], 0)
                continue
        n = chunk.num_rows
        if folder:
            chunk = chunk.append_column(FOLDER, pa.array([s.policy_id] * n, pa.string()))
        chunk = chunk.append_column(TAG, pa.array(np.full(n, w.tag, dtype=np.int64)))
        yield pa.table(
            {ENVELOPE: pa.array([table_to_ipc(chunk)], type=pa.binary()), TAG: pa.array([w.tag], type=pa.int64())}
        )


class ShardStreamDatasource(ray.data.Datasource):
    """A Ray Data source of `num_tasks` read tasks (one by default) that never end (see
    `_read_stream`); they share the feed, so no chunk is read twice."""

    def __init__(self, spec: dict, num_tasks: int = 1) -> None:
        super().__init__()
        self.spec = dict(spec)
        self.num_tasks = max(1, int(num_tasks))

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ray.data.ReadTask]:
        from ray.data.block import BlockMetadata

        spec = dict(self.spec)  # the table cache budget is shared by the tasks
        spec["cache_bytes"] = int(spec.get("cache_bytes", 256 << 20)) // self.num_tasks
        meta = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=None)
        return [ray.data.ReadTask(lambda: _read_stream(spec), meta) for _ in range(self.num_tasks)]

    def get_name(self) -> str:
        return "RlrecShardStream"
