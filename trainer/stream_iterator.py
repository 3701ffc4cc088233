"""Learner side: unpack envelopes, re-batch to exact minibatches, acknowledge trained rows."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import numpy as np

from rlrec.trainer.envelopes import ENVELOPE, row_count, unpack_columns
from rlrec.trainer.feed import TAG
from rlrec.trainer.feed_actor import get_feed

log = logging.getLogger("rlrec.trainer")

#: how long the first minibatch of a multi-agent Learner waits for a row of every module (seconds)
MODULES_WAIT_S = 60.0


class _RowBuffer:
    """A ring buffer of processed rows (flat dict of arrays) for re-sampling on the Learner."""

    def __init__(self, capacity: int, seed: int | None = None) -> None:
        self.capacity = max(1, int(capacity))
        self.cols: dict[str, np.ndarray] | None = None
        self.size = 0
        self.pos = 0
        self.rng = np.random.default_rng(seed)

    def add(self, batch: dict[str, np.ndarray]) -> None:
        n = row_count(batch)
        if n == 0:
            return
        if self.cols is None or set(batch) != set(self.cols):
            if self.cols is not None and self.size:
                log.warning("the PreLearner's output columns changed; the Learner-side buffer restarts")
            self.cols = {k: np.empty((self.capacity, *v.shape[1:]), dtype=v.dtype) for k, v in batch.items()}
            self.size = self.pos = 0
        if n >= self.capacity:
            batch = {k: v[-self.capacity :] for k, v in batch.items()}
            n = self.capacity
        idx = (self.pos + np.arange(n)) % self.capacity
        for k, v in batch.items():
            self.cols[k][idx] = v
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.capacity, self.size + n)

    def sample(self, n: int) -> dict[str, np.ndarray]:
        idx = self.rng.integers(0, self.size, n)
        return {k: v[idx] for k, v in self.cols.items()}


def _by_module(batch: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """A PreLearner batch's flat columns (``{module_id}/{column}``) grouped by module: each
    module's rows line up with each other, not with another module's."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for k, v in batch.items():
        out.setdefault(k.partition("/")[0] if "/" in k else "", {})[k] = v
    return out


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
        self._spec = {
            "feed": spec.get("feed"),
            "namespace": spec.get("namespace"),
            "learner_buffer_rows": spec.get("learner_buffer_rows"),
            "fresh_share": float(spec.get("fresh_share", 0.5)),
            "device_prefetch": spec.get("device_prefetch"),  # None: one batch ahead on CUDA only
            "modules": spec.get("modules"),  # multi-agent: the module ids the Learner trains
            "modules_wait_s": float(spec.get("modules_wait_s", MODULES_WAIT_S)),
        }
        self.iter_id = uuid.uuid4().hex
        self.seq = 0
        self._feed = None
        self._thread = None
        self._queue = None
        self._stop = None
        self._done = False
        self._buffer = None
        # rows pulled from the stream but not trained yet: kept here, not in a generator, so
        # the rows a Learner's iteration leaves when it stops iterating are the next one's first
        self._pending: dict[str, list[dict[str, np.ndarray]]] = {}  # per module (the flat keys' prefix)
        self._n_pending: dict[str, int] = {}
        #: the first minibatch's wait for every module (`_waiting_for_modules`): since when; over
        self._modules_wait_since: float | None = None
        self._modules_wait_over = False
        self.stats = {"rows_streamed": 0, "rows_replayed": 0}

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d.update(
            _feed=None, _thread=None, _queue=None, _stop=None, _buffer=None, _done=False, _pending={}, _n_pending={}
        )
        d.pop("_unsent", None)
        return d

    def _get_feed(self) -> Any:
        if self._feed is None and self._spec.get("feed"):
            self._feed = get_feed(self._spec)
        return self._feed

    def rlrec_mark(self) -> tuple[str, int]:
        """Send what is not acknowledged yet; (iterator id, acks sent): an iteration barrier."""
        self._flush()
        return self.iter_id, self.seq

    def _ack(self, counts: dict[int, int], wait: float, consumed: int) -> None:
        """Acks are batched (every 50 ms or 8 minibatches): an actor call per minibatch costs
        about as much as a small gradient step."""
        p = self.__dict__.setdefault(
            "_unsent", {"counts": {}, "wait": 0.0, "consumed": 0, "n": 0, "t": time.time(), "sent": time.monotonic()}
        )
        if not p["n"]:
            p["t"] = time.time()  # time of the first minibatch of this ack
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
        self._unsent = {"counts": {}, "wait": 0.0, "consumed": 0, "n": 0, "t": time.time(), "sent": time.monotonic()}

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
                            if row_count(d):
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
        # Interpreter settings (sys.setswitchinterval) are the application's to choose, not ours:
        # bench/trainer.py sets them for every side alike (--switch-interval).

    def _batches(self, batch_size: int, **kwargs: Any):
        """Minibatches, each acknowledged right before the Learner gets it."""
        for out, ack in self._raw_batches(batch_size, **kwargs):
            self._ack(*ack)
            yield out

    def _raw_batches(
        self,
        batch_size: int,
        *,
        local_shuffle_buffer_size: int | None = None,
        local_shuffle_seed: int | None = None,
        drop_last: bool = False,
        **_: Any,
    ):
        import queue

        if self._thread is None:
            self._start()
        self._get_feed()  # creates the feed actor if missing
        B = int(batch_size)
        cap = int(self._spec.get("learner_buffer_rows") or 0) or 64 * B
        cap = max(cap, int(local_shuffle_buffer_size or 0), 2 * B)
        if self._buffer is None:
            self._buffer = {}
        bufs: dict[str, _RowBuffer] = self._buffer  # module -> its rows (one module unless multi-agent)
        max_fresh = max(1, round(self._spec["fresh_share"] * B))
        pending, n_pending = self._pending, self._n_pending  # module -> its rows not trained yet
        wait = 0.0
        while True:
            # everything that arrived (non-blocking); block only while nothing can be trained
            while True:
                if self._spec["modules"] and max(n_pending.values(), default=0) >= cap:
                    self._waiting_for_modules(cap)  # a module holds `cap` untrained rows: pull no more (ends a wait)
                    break
                try:
                    d = self._queue.get_nowait()
                except queue.Empty:
                    ready = any(n_pending.values()) or any(b.size >= B for b in bufs.values())
                    if (ready and not self._waiting_for_modules(cap)) or self._done:
                        break
                    t0 = time.perf_counter()
                    try:  # while waiting for modules, look again at the wait's bounds now and then
                        d = self._queue.get(timeout=0.5 if ready else None)
                    except queue.Empty:
                        continue
                    finally:
                        wait += time.perf_counter() - t0
                if d is None:
                    self._done = True
                    break
                for m, part in _by_module(d).items():
                    n = row_count(part)
                    if n:
                        pending.setdefault(m, []).append(part)
                        n_pending[m] = n_pending.get(m, 0) + n
            if self._done and not any(n_pending.values()):
                return
            out: dict[str, np.ndarray] = {}
            took = 0
            for i, m in enumerate(sorted(set(pending) | set(bufs))):
                if m not in bufs:
                    seed = None if local_shuffle_seed is None else int(local_shuffle_seed) + i
                    bufs[m] = _RowBuffer(cap, seed)
                part, take = self._module_batch(m, bufs[m], B, max_fresh)
                out.update(part)
                took += take
                if part:
                    self.stats["rows_streamed"] += take
                    self.stats["rows_replayed"] += B - take
            if not out:
                continue
            counts: dict[int, int] = {}
            for k in [k for k in out if k == TAG or k.endswith("/" + TAG)]:
                vals, cnts = np.unique(out.pop(k), return_counts=True)
                for v, c in zip(vals.tolist(), cnts.tolist()):
                    counts[int(v)] = counts.get(int(v), 0) + int(c)
            yield out, (counts, wait, took)  # acknowledged when handed to the Learner
            wait = 0.0

    def _waiting_for_modules(self, cap: int) -> bool:
        """Whether the first minibatch still waits for a module the Learner trains (multi-agent:
        ``spec["modules"]``) that has no row yet, so that every module trains from the first
        iteration on. The wait is bounded: it ends after ``spec["modules_wait_s"]`` (default
        `MODULES_WAIT_S`) or once a module holds `cap` rows not trained yet; then the modules
        that have rows train, and those without any are logged (a module joins the minibatches
        once its rows come)."""
        if not self._spec.get("modules") or self._modules_wait_over:
            return False
        have = set(self._buffer or ()) | {m for m, n in self._n_pending.items() if n}
        missing = sorted(set(self._spec["modules"]) - have)
        if not missing:
            return False
        now = time.monotonic()
        if self._modules_wait_since is None:
            self._modules_wait_since = now
        waited = now - self._modules_wait_since
        full = max(self._n_pending.values(), default=0) >= cap
        if waited < self._spec["modules_wait_s"] and not full:
            return True
        self._modules_wait_over = True
        log.warning(
            "modules without a trainable row after %.0f s (%s): training the others; these join once their rows "
            "come: %s",
            waited,
            "a module's rows reached the buffer's size" if full else "waited long enough",
            ", ".join(repr(m)[:42] for m in missing[:10])
            + (f" and {len(missing) - 10} more" if len(missing) > 10 else ""),
        )
        return False

    def _module_batch(self, m: str, buf: _RowBuffer, B: int, max_fresh: int) -> tuple[dict, int]:
        """One module's B rows of the next minibatch, and how many came fresh from the stream:
        its fresh rows first (all of them while its buffer is cold, else up to max_fresh),
        filled up from its buffer; ({}, 0) while it has no row at all."""
        pend, n = self._pending.get(m, []), self._n_pending.get(m, 0)
        if pend:
            keys = set(pend[0])
            for p in pend[1:]:
                keys &= set(p)
            merged = {k: np.concatenate([p[k] for p in pend]) if len(pend) > 1 else pend[0][k] for k in keys}
        else:
            merged = {}
        take = min(n, B if buf.size < B else max_fresh)
        fresh = {k: v[:take] for k, v in merged.items()}
        rest = {k: v[take:] for k, v in merged.items()}
        self._pending[m], self._n_pending[m] = ([rest], n - take) if n > take else ([], 0)
        if take:
            buf.add(fresh)
        if take >= B:
            return fresh, take
        if buf.size == 0:
            return {}, 0
        fill = buf.sample(B - take)
        return ({k: np.concatenate([fresh[k], fill[k]]) for k in fill} if take else fill), take

    def iter_batches(self, *, batch_size: int, _collate_fn: Any = None, **kwargs: Any):
        for b in self._batches(batch_size, **kwargs):
            yield _collate_fn(b) if _collate_fn is not None else b

    def iter_torch_batches(
        self, *, batch_size: int, device: Any = None, dtypes: Any = None, collate_fn: Any = None, **kwargs: Any
    ):
        """Torch minibatches on `device`. On a CUDA device the next minibatch is copied to it
        (pinned host memory, a side stream) while the Learner computes on this one
        (`rlrec.trainer.device_prefetch.DevicePrefetcher`); each minibatch is acknowledged when
        the Learner gets it, never when it is prefetched."""
        if collate_fn is not None:
            for b in self._batches(batch_size, **kwargs):
                yield collate_fn(b)
            return
        from rlrec.trainer.device_prefetch import DevicePrefetcher

        prefetcher = DevicePrefetcher(device if device is not None else "cpu", self._spec.get("device_prefetch"))
        for tensors, ack in prefetcher.iterate(self._raw_batches(batch_size, **kwargs)):
            self._ack(*ack)
            yield tensors
