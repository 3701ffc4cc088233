"""The continuous data path: manifest -> one never-ending Ray Data pipeline -> Learner(s).

Plugged into RLlib with ``config.offline_data(offline_data_class=ManifestOfflineData, ...)``;
`configure_continuous` sets that and everything it needs in one call. Design (details and
measurements in docs/TRAINER.md):

* `ManifestFollower` reads the consumer's manifest incrementally (never a directory listing of
  shards), so only committed shards are ever read.
* A `ShardFeed` actor (wrapping `rlrec.trainer.feed.FeedState`) decides which chunk of which shard is
  read next: fresh shards first (a configurable share), otherwise a chunk from the replay window.
* The dataset is built ONCE: ``read_datasource(ShardStreamDatasource)`` -- one read task (or
  ``read_tasks`` of them sharing the feed) that never ends: it asks the feed for work, reads the
  chunk (Arrow), tags every row and yields it -- ``.map_batches(PreLearner)`` --
  ``iter_batches`` / ``iterator()`` / ``streaming_split``. A node-local input is read on the
  driver's node only (`ManifestOfflineData._read_task_placement`).
  New shards enter the running pipeline through the feed; nothing is rebuilt per shard, and the
  Learners' cached iterators (`Learner.iterator`) stay valid for the whole run.
* `SafeOfflinePreLearner` decodes episode shards with `rlrec.store.episodes.unpack_episode`
  (refuses pickled payloads) instead of RLlib's ``msgpack_numpy.decode``.
* Blocks are one-row "envelopes" (a never-ending read task cannot use Ray Data's block
  shaping, see `rlrec.trainer.envelopes`); `StreamIterator` unpacks them on the Learner side,
  re-batches and acknowledges to the feed the tags of the rows each Learner takes for a
  gradient step: that defines "trained on" for the shard cursor, ``shards_new`` and lineage,
  and gives the feed its flow-control signal.

Modules: `rlrec.trainer.feed` (which chunk next, pure logic), `rlrec.trainer.feed_actor` (the `ShardFeed`
actor around it), `rlrec.trainer.read_task` (the never-ending read task), `rlrec.trainer.envelopes`
(one-row blocks), `rlrec.trainer.prelearner` (safe PreLearner), `rlrec.trainer.stream_iterator` (Learner
side); this module holds `ManifestOfflineData` and `configure_continuous`.
"""

from __future__ import annotations

import logging
import threading
import time
import types
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import ray
from ray.rllib.core import COMPONENT_RL_MODULE
from ray.rllib.env import INPUT_ENV_SPACES
from ray.rllib.offline.offline_data import OfflineData
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils import force_list, unflatten_dict

from rlrec.store.manifest import ShardEntry, UnsupportedManifestError
from rlrec.store.ownership import one_attempt
from rlrec.store.reader_leases import DEFAULT_READER_LEASE_S, drop_reader_lease, holds_of, renew_reader_lease
from rlrec.store.retry import RetrySchedule
from rlrec.store.storage import Storage, StorageError, is_refusal
from rlrec.trainer.feed import TAG, FeedPolicy, IterationStats
from rlrec.trainer.feed_actor import LEARNER_CONFIG_KEY, ShardFeed
from rlrec.trainer.manifest_follower import ManifestFollower, spaces_from_shard
from rlrec.trainer.prelearner import SafeOfflinePreLearner, envelope_prelearner_class
from rlrec.trainer.read_task import ShardStreamDatasource
from rlrec.trainer.storage_health import StorageHealth
from rlrec.trainer.stream_iterator import StreamIterator

__all__ = [
    "DEFAULT_DATASET_NUM_ITERS_PER_LEARNER",
    "TAG",
    "ManifestFollower",
    "ManifestOfflineData",
    "SafeOfflinePreLearner",
    "ShardFeed",
    "ShardStreamDatasource",
    "StreamIterator",
    "check_holdout_prelearner",
    "configure_continuous",
    "envelope_prelearner_class",
    "spaces_from_shard",
]

log = logging.getLogger("rlrec.trainer")

#: learner updates (minibatches) per `training_step` when the user does not say.
DEFAULT_DATASET_NUM_ITERS_PER_LEARNER = 10
#: map_batches defaults: one PreLearner actor (RLlib's default of max(2, num_learners) hangs
#: on a 2-CPU box: no CPU is left for anything else).
DEFAULT_MAP_BATCHES_KWARGS = {"concurrency": 1, "zero_copy_batch": True}


# =============================================================================================
# OfflineData


def first_poll_from_heads(
    trained_keys: Iterable[str], trained_ranges: Mapping[tuple[str, int], list], unplaced: Iterable[str] | None
) -> bool:
    """Whether a trainer's first manifest poll may read the logs from their heads
    (`ManifestFollower.from_heads`). A merged shard delivered for removed entries names them,
    from the heads, by seq only (its covers' paths are ""), so every trained shard must be
    placed by `trained_ranges`; a trained shard named by path only (`unplaced`, or any when
    the ranges or the unplaced keys are not known) needs the history, which names the paths.

    Args:
        trained_keys: the shards trained before this start (paths).
        trained_ranges: per log, the ``[start, end)`` seq ranges of the trained shard entries.
        unplaced: the trained keys no range holds; None when not known.

    Example:
        >>> first_poll_from_heads([], {}, None)
        True
        >>> first_poll_from_heads(["a.parquet"], {("rl", 0): [(0, 1)]}, [])
        True
        >>> first_poll_from_heads(["a.parquet", "b.parquet"], {("rl", 0): [(0, 1)]}, ["b.parquet"])
        False
        >>> first_poll_from_heads(["a.parquet"], {}, None)
        False
    """
    keys = set(trained_keys)
    if not keys:
        return True
    return bool(trained_ranges) and unplaced is not None and not keys & set(unplaced)


class ManifestOfflineData(OfflineData):
    """`OfflineData` that follows the manifest and streams shards through one pipeline.

    Unlike RLlib's `OfflineData`, `__init__` reads nothing: the dataset is built on the first
    `sample()` and then lives for the whole run. Call `start(trained_keys)` (the restored cursor)
    before training, `refresh()` to pick up new shards now (a background thread also polls every
    ``poll_interval_s``), `pop_stats()` after each iteration and `stop()` at the end.
    """

    def __init__(self, config: Any) -> None:
        # Every attribute RLlib's OfflineData.__init__ sets (it is not called: it reads the data);
        # tests/test_offline_data_parity.py fails when an RLlib upgrade adds one.
        self.config = config
        self.is_multi_agent = config.is_multi_agent
        spec = (config.learner_config_dict or {}).get(LEARNER_CONFIG_KEY)
        if not spec:
            raise ValueError("ManifestOfflineData needs rlrec.trainer.data.configure_continuous(config, ...)")
        if self.is_multi_agent != bool(spec.get("multi_agent")):
            raise ValueError(
                "a multi-agent config trains multi-agent rows: configure_continuous(..., multi_agent=True)"
            )
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
            self.storage,
            policy_id=spec.get("policy_id"),
            min_policy_version=spec.get("min_policy_version"),
            max_policy_version=spec.get("max_policy_version"),
            fmt="episodes" if config.input_read_episodes else "tabular",
            multi_agent=bool(spec.get("multi_agent")),
            modules=spec.get("modules"),
        )
        self.feed = ShardFeed.options(name=spec["feed"], namespace=spec["namespace"], get_if_exists=True).remote(
            spec["feed_policy"]
        )
        self.poll_interval_s = float(spec.get("poll_interval_s", 0.5))
        self._started = False
        self._trained_keys: set[str] = set()
        self._trained_ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._local_iterators: list[StreamIterator] = []
        self.last_poll_error: str | None = None
        #: a manifest entry this rlrec cannot read (a newer rlrec wrote it): the trainer stops
        self.unsupported: str | None = None
        self.poll_schedule = RetrySchedule()  # manifest polls while they fail: the one retry schedule
        self.health = StorageHealth(self.storage.uri())  # the input store's failed reads, reported here
        #: the reader lease holding the files handed to the feed and not read to the end yet (retention
        #: keeps them: `rlrec.store.reader_leases`), renewed by the poll thread
        self.lease = TrainerLease(self.storage, spec["feed"])

    # ------------------------------------------------------------------ manifest
    def start(
        self,
        trained_keys: Iterable[str] = (),
        trained_ranges: Mapping[tuple[str, int], list] | None = None,
        unplaced: Iterable[str] | None = None,
    ) -> None:
        """Load the manifest (shards in `trained_keys`, or standing for shard entries in
        `trained_ranges` -- per log, ``[start, end)`` seq ranges -- are history, the rest fresh)
        and start polling. `unplaced`: the trained keys `trained_ranges` does not hold (None:
        not known); see `first_poll_from_heads`."""
        if self._started:
            return
        self._trained_keys = set(trained_keys)
        self._trained_ranges = {k: [tuple(r) for r in rs] for k, rs in (trained_ranges or {}).items()}
        self.follower.from_heads = first_poll_from_heads(self._trained_keys, self._trained_ranges, unplaced)
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
            except Exception as e:  # keep training on what we have; the next poll tries again
                self.last_poll_error = f"{type(e).__name__}: {e}"
                if isinstance(e, UnsupportedManifestError):  # no new data until rlrec is upgraded
                    self.unsupported = str(e)
                elif is_refusal(e):
                    self.health.refused("manifest poll", self.last_poll_error)
                elif isinstance(e, (StorageError, OSError)):  # the store does not answer
                    self.health.failed("manifest poll", self.last_poll_error)
                else:
                    log.error("manifest poll failed: %s", self.last_poll_error)
                    log.debug("manifest poll", exc_info=True)
                return 0
            if infos:
                ray.get(self.feed.add_shards.remote(infos, [s.key for s in infos if self._trained_before(s.key)]))
                self.lease.soon()  # the lease holds them from the next turn of the poll thread
            return len(infos)

    def _trained_before(self, key: str) -> bool:
        """Whether shard `key` is history: trained before this start, itself or (a merged shard
        delivered for removed shard entries, `ManifestFollower.covers`) any entry it stands for,
        by path or by seq (an earlier merged shard holding it was trained) -- then all of it is
        history, so no episode is trained as new twice."""
        if key in self._trained_keys:
            return True
        cover = self.follower.covers.get(key)
        if cover is None:
            return False
        ranges = self._trained_ranges.get(cover[0], ())
        trained = [
            p for q, p in zip(cover[1], cover[2]) if p in self._trained_keys or any(a <= q < b for a, b in ranges)
        ]
        if trained and len(trained) < len(cover[2]):
            log.warning(
                "%s merges %d shard(s) trained before with %d not trained yet whose files retention removed: "
                "it is taken as trained before (those episodes are not trained as new)",
                key,
                len(trained),
                len(cover[2]) - len(trained),
            )
        return bool(trained)

    def check_health(self) -> None:
        """Take the read tasks' failed reads from the feed into `health`; the store answers
        again once a manifest poll worked and no read failed since the last check."""
        try:
            errors, last, refusals, last_refusal = ray.get(self.feed.storage_errors.remote(), timeout=10)
        except Exception as e:  # the feed is gone (shutdown) or busy: nothing to learn now
            log.debug("feed storage errors: %s", e)
            return
        before = self.health.total
        self.health.reader_errors(errors, last)
        self.health.reader_refusals(refusals, last_refusal)
        if self.last_poll_error is None and self.health.total == before:
            self.health.answered()

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self._poll_once(time.monotonic())
                self._renew_lease(time.monotonic())
            except Exception as e:  # e.g. the feed actor is gone at shutdown
                if self._stop.is_set():
                    return
                log.warning("manifest poll failed: %s", e)

    def _poll_once(self, now: float) -> None:
        """One turn of the poll thread: read the manifest unless a failed poll scheduled the next
        one later (the one retry schedule, `poll_schedule`), then take the read tasks' errors."""
        if self.poll_schedule.due(now):
            self.refresh()
            if self.last_poll_error is None:
                self.poll_schedule.succeeded()
            else:
                self.poll_schedule.failed(now)
        self.check_health()

    def _renew_lease(self, now: float) -> None:
        """Renew the trainer's reader lease when due: the entries of the shards handed to the
        feed and not read to the end yet (`TrainerLease`)."""
        if not self.lease.due(now):
            return
        try:
            keys = ray.get(self.feed.unread_keys.remote(), timeout=10)
        except Exception as e:  # the feed is busy or gone: the next turn renews
            log.debug("feed untrained keys: %s", e)
            return
        with self._lock:
            entries = [self.follower.entries.get(k) for k in keys]
        self.lease.renew(now, entries)

    @property
    def shards_total(self) -> int:
        return len(self.follower.entries)

    def entry(self, key: str) -> ShardEntry | None:
        return self.follower.entries.get(key)

    def seqs(self, key: str) -> tuple[tuple[str, int], tuple[int, ...]] | None:
        """The partition log and manifest seqs of the shard entries shard `key` stands for
        (itself, or the entries a merged shard delivered in their place holds); None: unknown."""
        cover = self.follower.covers.get(key)
        if cover is not None:
            return cover[0], cover[1]
        e = self.follower.entries.get(key)
        return None if e is None else ((e.topic, e.partition), (int(e.seq),))  # type: ignore[arg-type]

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
        try:  # ends the stream: the read task returns, the iterators see the end
            ray.get(self.feed.close.remote(), timeout=5)
        except Exception:
            pass
        self.lease.drop()
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
        n_tasks = int(self.spec.get("read_tasks", 1))
        ds = ray.data.read_datasource(
            ShardStreamDatasource({**self.spec, "columns": self._columns()}, num_tasks=n_tasks),
            override_num_blocks=n_tasks,
            num_cpus=0,
            ray_remote_args=self._read_task_placement(),
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
            batch_size=None,  # one envelope (one chunk) per call
            **self.map_batches_kwargs,
        )
        self.data_is_mapped = True

    def _read_task_placement(self) -> dict:
        """A node-local input is read on the driver's node only: a read task scheduled on another
        node (e.g. one that joined after the start-up check) would find no file and mark the
        shard missing. Object storage and file:// (shared mount) inputs are read anywhere."""
        from rlrec.trainer.cluster import is_node_local_path

        if not is_node_local_path(self.path):
            return {}
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = ray.get_runtime_context().get_node_id()
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}

    def _columns(self) -> list[str] | None:
        if self.config.input_read_episodes:
            from rlrec.trainer.multi_agent import row_columns

            return row_columns(self.spec) if self.spec.get("multi_agent") else ["item"]
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

    def sample(
        self, num_samples: int, return_iterator: bool = False, num_shards: int = 1, module_state: Any = None
    ) -> Any:
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

                def _collate_fn(_batch: dict[str, np.ndarray]) -> MultiAgentBatch:
                    _batch = unflatten_dict(_batch)
                    return MultiAgentBatch(
                        {mid: SampleBatch(d) for mid, d in _batch.items()},
                        env_steps=sum(len(next(iter(d.values()))) for d in _batch.values()),
                    )

                it = StreamIterator(self.data.iterator(), self.spec)
                self._local_iterators = [it]
                self.batch_iterators = iter(
                    it.iter_batches(batch_size=num_samples, _collate_fn=_collate_fn, **self.iter_batches_kwargs)
                )
        if return_iterator:
            return force_list(self.batch_iterators)
        return next(self.batch_iterators)


# =============================================================================================
# configuration


def check_holdout_prelearner(prelearner_class: Any, holdout_fraction: float) -> None:
    """ValueError unless a holdout fraction F > 0 is applied by `prelearner_class` (None: the
    default, `SafeOfflinePreLearner`): only a subclass of it drops the held-out episodes, so
    another class would train on them while every lineage records F (docs/TRAINER.md, L1) and
    the ope gate evaluates on data the candidate was trained on.

    Example:
        >>> check_holdout_prelearner(None, 0.1)
        >>> check_holdout_prelearner(object, 0.0)
        >>> check_holdout_prelearner(object, 0.1)
        Traceback (most recent call last):
        ...
        ValueError: --holdout-fraction 0.1 needs a prelearner_class that subclasses rlrec.trainer.prelearner.SafeOfflinePreLearner (only it drops the held-out episodes; object would train on them): give --holdout-fraction 0 or subclass it
    """
    if not holdout_fraction or prelearner_class is None:
        return
    if isinstance(prelearner_class, type) and issubclass(prelearner_class, SafeOfflinePreLearner):
        return
    name = getattr(prelearner_class, "__name__", repr(prelearner_class)[:60])
    raise ValueError(
        f"--holdout-fraction {holdout_fraction:g} needs a prelearner_class that subclasses "
        f"rlrec.trainer.prelearner.SafeOfflinePreLearner (only it drops the held-out episodes; {name} would "
        "train on them): give --holdout-fraction 0 or subclass it"
    )


def configure_continuous(
    config: Any,
    input_uri: str,
    *,
    fmt: str = "episodes",
    feed_policy: FeedPolicy | dict | None = None,
    policy_id: str | None = None,
    min_policy_version: int | None = None,
    max_policy_version: int | None = None,
    poll_interval_s: float = 0.5,
    verify_checksums: bool = True,
    keep_extra_model_outputs: Iterable[str] = (),
    cache_bytes: int = 256 << 20,
    cache_ttl_s: float = 30.0,
    prelearner_mode: str = "episodes",
    learner_buffer_rows: int | None = None,
    fresh_share: float = 0.5,
    read_tasks: int = 1,
    holdout_fraction: float = 0.0,
    multi_agent: bool = False,
    multi_agent_flags: str = "rllib",
) -> Any:
    """Make an RLlib offline `config` (BC, MARWIL, CQL, IQL, ...) train continuously on the
    shards committed under `input_uri`. Returns the config (changed in place).

    Sets: ``offline_data_class=ManifestOfflineData``, ``input_=input_uri``,
    ``input_read_episodes`` from `fmt`, ``input_compress_columns=[]`` (never unpickle),
    no materialization, ``prelearner_class=SafeOfflinePreLearner`` unless one is set (episode
    shards need a subclass of it), ``dataset_num_iters_per_learner`` (10 unless set: a stream
    has no epochs), PreLearner concurrency 1 unless set, and ``learner_config_dict["rlrec"]``
    with the feed's name and the data-path settings. `learner_buffer_rows` (default 64 x
    train_batch_size_per_learner) and `fresh_share` configure the Learner side (`StreamIterator`).
    `read_tasks` never-ending read tasks share the feed (more than one helps when reading and
    decoding shards, not the PreLearner, limits fresh-data throughput).
    `holdout_fraction` F: episodes with `rlrec.trainer.holdout.is_held_out(id, F)` are dropped
    by the PreLearner and never trained on (they are `rlrec evaluate`'s data).
    `multi_agent`: train the multi-agent rows of every module folder (`rlrec.trainer.multi_agent`;
    the config must be multi-agent, its policies the modules); held out by multi-agent episode id;
    `multi_agent_flags` ``"env"`` gives each agent episode the env's own last flags.
    """
    if fmt not in ("episodes", "tabular"):
        raise ValueError(f"fmt must be 'episodes' or 'tabular', got {fmt!r}")
    if prelearner_mode not in ("episodes", "buffer"):
        raise ValueError(f"prelearner_mode must be 'episodes' or 'buffer', got {prelearner_mode!r}")
    if not 0.0 < fresh_share <= 1.0:
        raise ValueError("fresh_share must be in (0, 1]")
    if int(read_tasks) < 1:
        raise ValueError("read_tasks must be >= 1")
    pre = config.prelearner_class
    if pre is not None and fmt == "episodes" and not issubclass(pre, SafeOfflinePreLearner):
        raise ValueError(
            f"prelearner_class {pre.__name__} must subclass rlrec.trainer.prelearner.SafeOfflinePreLearner for "
            "episode shards: RLlib's OfflinePreLearner decodes them with msgpack_numpy, which "
            "unpickles data from the bucket"
        )
    check_holdout_prelearner(pre, holdout_fraction)
    if isinstance(feed_policy, dict):
        feed_policy = FeedPolicy(**feed_policy)
    feed_policy = feed_policy or FeedPolicy()
    B = int(config.train_batch_size_per_learner or config.train_batch_size or 512)
    # rows a "buffer"-mode PreLearner call returns: B sampled timesteps (multi-agent rows: B per module)
    feed_policy.batch_rows = B * (len(config.policies) if multi_agent and prelearner_mode == "buffer" else 1)
    feed_policy.prelearner_mode = prelearner_mode
    if config.input_read_batch_size:
        feed_policy.chunk_rows = int(config.input_read_batch_size)
    if feed_policy.chunk_steps is None and feed_policy.chunk_rows is None:
        feed_policy.chunk_steps = 4 * B  # fewer, larger PreLearner calls (measured: ~1.5x rows/s vs 1*B)
    chunk = int(feed_policy.chunk_steps or feed_policy.chunk_rows or B)
    batch = B
    if prelearner_mode == "buffer" and fmt == "episodes":
        chunk = batch = feed_policy.batch_rows  # a call samples every module's buffer: B rows each
    n_learners = max(1, int(config.num_learners or 0))
    # rows in flight between the feed and the Learner: one chunk being read + two minibatches.
    # The Learner never waits on the pipeline (it re-samples its buffer), so a short pipeline
    # costs no throughput and keeps a fresh chunk from queueing behind older ones.
    floor = n_learners * (chunk + 2 * batch)
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
        "read_tasks": int(read_tasks),
        "holdout_fraction": float(holdout_fraction),
        "multi_agent": bool(multi_agent),
        "modules": sorted(config.policies) if multi_agent else None,
        "multi_agent_flags": multi_agent_flags,
    }
    config.learners(learner_config_dict={LEARNER_CONFIG_KEY: spec})
    return config


class TrainerLease:
    """A trainer's reader lease (`rlrec.store.reader_leases`): the manifest entries of the shards
    it was handed and has not read to the end, renewed every third of its ``ttl_s`` and as soon as new
    shards are handed to the feed (one storage attempt each; a failed renewal waits for the next
    turn), dropped when the trainer stops.

    Example:
        >>> import tempfile
        >>> from rlrec.store.reader_leases import live_holds
        >>> lease = TrainerLease(Storage.from_uri(tempfile.mkdtemp()), "rlrec-feed-1")
        >>> lease.due(0.0)
        True
    """

    def __init__(self, storage: Storage, reader: str, ttl_s: float = DEFAULT_READER_LEASE_S) -> None:
        self.storage = one_attempt(storage)
        self.reader = reader
        self.ttl_s = ttl_s
        self._next: float | None = None  # monotonic time of the next renewal (None: at once)
        self._written = False  # renewed at least once (there may be a lease to drop)

    def due(self, now: float) -> bool:
        """Whether the lease should be renewed at monotonic time `now`."""
        return self._next is None or now >= self._next

    def soon(self) -> None:
        """Renew at the next chance (shards were handed to the feed)."""
        self._next = None

    def renew(self, now: float, entries: Iterable[Any]) -> bool:
        """Write the lease holding `entries` (shard entries; None items are skipped); True if
        it was written."""
        self._next = now + self.ttl_s / 3
        self._written = True
        holds = holds_of((e.topic, e.partition, e.seq) for e in entries if e is not None and e.seq is not None)
        try:
            renew_reader_lease(self.storage, self.reader, holds, ttl_s=self.ttl_s)
            return True
        except Exception as e:  # retention may take the files if this goes on for a whole ttl_s
            log.warning("renewing the trainer's reader lease failed (%s); next try in %.0fs", e, self.ttl_s / 3)
            return False

    def drop(self) -> None:
        """Remove the lease (the trainer stops reading)."""
        if not self._written:
            return
        try:
            drop_reader_lease(self.storage, self.reader)
        except Exception as e:  # it expires by itself
            log.debug("dropping the reader lease: %s", e)
