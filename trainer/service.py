"""The continuous trainer service behind ``rlrec train`` (see docs/TRAINER.md).

One process: follows the manifest, trains an RLlib offline algorithm (BC, MARWIL, CQL, IQL)
iteration by iteration on fresh shards plus a replay window, writes one metrics line per
iteration, checkpoints every N iterations (and on SIGTERM), publishes each checkpointed policy
and resumes from the latest checkpoint with its weights, optimizer state and shard cursor.

The checkpoint directory layout is described in `rlrec.trainer.checkpoints`; the metrics in `rlrec.trainer.metrics`.
"""

from __future__ import annotations

import importlib
import logging
import math
import signal
import threading
import time
from typing import Any

from rlrec.store.manifest import ShardEntry, UnsupportedManifestError
from rlrec.store.retry import RetrySchedule
from rlrec.store.storage import Storage, StorageError
from rlrec.trainer.checkpoints import STATE_VERSION, CheckpointStore
from rlrec.trainer.config import TrainerConfig
from rlrec.trainer.lineage import LineageError, add_seq, ranges_doc
from rlrec.trainer.metrics import TrainerMetrics
from rlrec.trainer.storage_health import StorageHealth

__all__ = [
    "ALGORITHMS",
    "ContinuousTrainer",
    "NoFirstShard",
    "StoreTooNew",
    "TrainerConfig",
    "TrainerLost",
    "UnsupportedCombination",
]

log = logging.getLogger("rlrec.trainer")

#: where a checkpoint keeps the files of the policy versions it commits to publishing
PUBLISH_DIR = "publish"

#: algorithm name -> (config class path, allowed action space types)
ALGORITHMS = {
    "BC": ("ray.rllib.algorithms.bc:BCConfig", ("Discrete", "Box")),
    "MARWIL": ("ray.rllib.algorithms.marwil:MARWILConfig", ("Discrete", "Box")),
    "CQL": ("ray.rllib.algorithms.cql:CQLConfig", ("Box",)),
    "IQL": ("ray.rllib.algorithms.iql:IQLConfig", ("Box",)),
}


class TrainerLost(RuntimeError):
    """A part of the running trainer (a Ray actor, a Learner) died and cannot be replaced in place."""

    #: a runtime failure: `rlrec train` prints the message as its one error line, exit code 1
    exit_code = 1


class LineageLost(TrainerLost):
    """A trained shard is in no partition log of the input: no version's lineage can name the
    data it was trained on, so the trainer stops rather than publish without it (exit code 1)."""


class StoreTooNew(RuntimeError):
    """The input's manifest holds an entry this rlrec cannot read (a newer rlrec wrote it): the
    trainer would take no new shards from that log until it is upgraded, so it checkpoints and
    stops rather than go on training on stale data, at start or mid-run (exit code 2: a restart
    without an upgrade fails the same way)."""

    #: `rlrec train` prints the message as its one error line
    exit_code = 2


class NoFirstShard(RuntimeError):
    """No committed shard appeared within ``--first-shard-timeout-s`` (exit code 1, one line saying why)."""

    exit_code = 1


class UnsupportedCombination(ValueError):
    """The algorithm cannot train on these spaces (RLlib 2.60)."""


def _import(path: str) -> Any:
    """``"pkg.mod:Name"`` or ``"pkg.mod.Name"`` -> the object."""
    mod, name = path.split(":", 1) if ":" in path else path.rsplit(".", 1)
    return getattr(importlib.import_module(mod), name)


# ---------------------------------------------------------------------------------- helpers


def _check_spaces(algo: str, obs_space: Any, act_space: Any) -> None:
    import gymnasium as gym

    allowed = ALGORITHMS[algo][1]
    kind = type(act_space).__name__
    if kind not in allowed:
        hint = (
            " (RLlib 2.60's CQL and IQL assume continuous Box actions; use BC or MARWIL for discrete actions)"
            if algo in ("CQL", "IQL")
            else ""
        )
        raise UnsupportedCombination(
            f"{algo} cannot train on a {kind} action space{hint}; supported: {', '.join(allowed)}"
        )
    if not isinstance(obs_space, gym.spaces.Box):
        raise UnsupportedCombination(
            f"{algo} with RLlib's default models needs a Box observation space, got {type(obs_space).__name__}"
        )
    if isinstance(act_space, gym.spaces.Box) and not (
        (act_space.bounded_below.all() and act_space.bounded_above.all()) or algo in ("BC", "MARWIL")
    ):
        raise UnsupportedCombination(f"{algo} needs a bounded Box action space, got {act_space}")


def _result_get(d: dict, *path: str, default: Any = None) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def _finite(x: Any) -> float | None:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


# ---------------------------------------------------------------------------------- trainer


def _ranges_state(doc: Any) -> dict[tuple[str, int], list[list[int]]]:
    """Per partition log, seq ranges from their JSON form (`rlrec.trainer.lineage.ranges_doc`)."""
    return {(str(t), int(p)): [[int(a), int(b)] for a, b in rs] for t, p, rs in doc}


def shard_places(storage: Storage) -> dict[str, tuple[tuple[str, int], tuple[int, ...]]]:
    """Every shard of a store by path: its partition log and the seqs of the shard entries it
    stands for in a lineage -- a shard entry itself (compacted since or not), a merged shard
    the entries it holds (`rlrec.store.manifest.merged_shards`)."""
    from rlrec.store.manifest import merged_shards, read_partition_logs

    places: dict[str, tuple[tuple[str, int], tuple[int, ...]]] = {}
    for key, entries in read_partition_logs(storage).items():
        for e in entries:
            if isinstance(e, ShardEntry):
                places[e.path] = (key, (int(e.seq),))  # type: ignore[arg-type]
        places.update({p: (key, seqs) for p, seqs in merged_shards(entries).items()})
    return places


class ContinuousTrainer:
    """Build with a `TrainerConfig`, then `run()` (blocks until max_iterations or stop())."""

    def __init__(self, cfg: TrainerConfig, *, install_signals: bool = False) -> None:
        self.cfg = cfg
        self.install_signals = install_signals
        self.input = Storage.from_uri(cfg.input)
        self.out = Storage.from_uri(cfg.checkpoint_dir)
        self.signing_key = self._load_signing_key(cfg.signing_key)
        self.checkpoints = CheckpointStore(self.out, signing_key=self.signing_key)
        self.publish_storage = Storage.from_uri(cfg.publish_dir or self.out.uri("policies"))
        self._stop = threading.Event()
        self._checkpoint_store_down = False  # a checkpoint save waits for its store (excuses the watchdog)
        self.stop_reason: str | None = None
        self.algo: Any = None
        self.iteration = 0
        self.policy_version = 0
        self.run_id: str | None = None  # chosen at the first publication, kept across --resume
        self.timesteps_trained = 0
        self.trained: set[str] = set()  # the cursor: shard keys trained on
        self.since_publish: set[str] = set()
        self.missing_total = 0
        self.metrics: TrainerMetrics | None = None
        self._started_ray = False
        self._connected = False
        self.obs_space = self.act_space = None
        self.fmt: str | None = None
        self.last_record: dict | None = None
        self.deployed_return: float | None = cfg.promotion_baseline  # promotion gate state
        self.last_promotion: dict | None = None
        self._held_out: Any = None  # HeldOutReader of the ope gate
        self._deployed_cache: Any = None
        self._job: Any = None  # the running off-policy evaluation (rlrec.trainer.ope_jobs.CandidateJob)
        self.shards_skipped = 0  # shards refused (schema gate, checksum, unreadable), cumulative
        self.episodes_skipped = 0  # episodes the PreLearner could not use, cumulative
        self._skip_logged: set[str] = set()
        self._outage = RetrySchedule()  # waits between the driver's own failed reads of the input
        self._watchdog: Any = None  # rlrec.trainer.watchdog.StallWatchdog while running
        self._pending: list[Any] = []  # prepared publications (export.Publication) not yet written
        self._log_firsts: dict = {}  # (topic, partition) -> its first manifest entry's key (lineage cursors)
        #: per partition log (topic, partition): the manifest seq ranges [start, end) of the trained shards
        self.trained_ranges: dict[tuple[str, int], list[list[int]]] = {}
        #: `trained_ranges` as the last version prepared recorded them (its lineage's ``trained``)
        self.published_ranges: dict[tuple[str, int], list[list[int]]] = {}
        self._lineage_lost: str | None = None  # why the trained data has no cursor (LineageLost at publish)
        self._unplaced: set[str] = set()  # trained shards whose manifest entry is not found yet

    @staticmethod
    def _load_signing_key(path: str | None) -> Any:
        if not path:
            return None
        from rlrec.trainer.signing import SignatureError, load_private_key

        try:
            return load_private_key(path)
        except SignatureError as e:
            raise ValueError(f"--signing-key: {e}") from None

    # ------------------------------------------------------------------ lifecycle
    def stop(self, reason: str = "stop requested") -> None:
        self.stop_reason = self.stop_reason or reason
        self._stop.set()

    def install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            name = signal.Signals(signum).name
            if self._stop.is_set():
                log.warning("%s again: exiting without waiting", name)
                raise KeyboardInterrupt
            log.info("%s: finishing the current iteration, then checkpointing", name)
            self.stop(name)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    # ------------------------------------------------------------------ data discovery
    def _first_shards(self, skip: set[str] | None = None) -> list:
        from rlrec.trainer.manifest_follower import ManifestFollower

        fmt = None
        if "input_read_episodes" in self.cfg.offline_config:
            fmt = "episodes" if self.cfg.offline_config["input_read_episodes"] else "tabular"
        follower = ManifestFollower(
            self.input,
            policy_id=self.cfg.policy_id,
            min_policy_version=self.cfg.min_policy_version,
            max_policy_version=self.cfg.max_policy_version,
            fmt=fmt,
        )
        last_log = 0.0
        health = StorageHealth(self.input.uri())
        timeout = self.cfg.first_shard_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        head = True  # the heads first; while waiting, the follower's incremental polls (one history read)
        while not self._stop.is_set():
            try:
                if head:
                    found = follower.live_head()
                else:
                    found = [follower.entries[i.key] for i in follower.poll(force_discover=True)]
                head = False
                found = [e for e in found if e.path not in (skip or ())]
            except UnsupportedManifestError as e:
                raise StoreTooNew(f"{e}; the trainer did not start (restart it once rlrec is upgraded)") from None
            except StorageError as e:  # the store does not answer: wait for it, on the retry schedule
                health.failed("manifest poll", str(e))
                self._stop.wait(self._outage.failed(time.monotonic()))
                continue
            self._outage.succeeded()
            health.answered()
            if found:
                self.fmt = follower.fmt
                return found
            if deadline is not None and time.monotonic() >= deadline:
                raise NoFirstShard(
                    f"no committed shard under {self.input.uri()} within {timeout:g} s "
                    f"(--first-shard-timeout-s): {self._why_no_shard()}"
                )
            if time.monotonic() - last_log > self.cfg.idle_log_interval_s:
                log.info("waiting for the first committed shard under %s: %s", self.input.uri(), self._why_no_shard())
                last_log = time.monotonic()
            self._stop.wait(max(0.2, self.cfg.poll_interval_s))
        return []

    def _why_no_shard(self) -> str:
        """What the input lacks before its first shard (for the waiting line)."""
        from rlrec.store.locate import locate_store

        try:
            where = locate_store(self.input.uri(), self.input)
        except Exception as e:  # a hint only: never what stops the wait
            return f"the store does not answer ({type(e).__name__}: {e})"
        why = where.mistake or where.waiting_for
        if why is None:
            why = (
                "no shard is committed yet (a consumer commits its first one after --max-file-age-s, "
                "60 s by default, or --max-episodes-per-file episodes)"
            )
        if self.cfg.policy_id:
            why += f"; only policy {self.cfg.policy_id}'s shards are read (--policy-id)"
        return why

    def _spaces(self, entries: list) -> bool:
        """Set the spaces (from --env, else the first usable shard); False: no usable shard yet."""
        from rlrec.trainer.manifest_follower import spaces_from_shard

        shard_spaces = None
        for e in entries:
            try:
                shard_spaces = spaces_from_shard(self.input, e)
                break
            except FileNotFoundError:
                log.warning("shard %s is missing; trying the next one for the spaces", e.path)
            except StorageError as e2:  # unreachable, not unusable: try again after a wait
                wait = self._outage.failed(time.monotonic())
                log.warning(
                    "storage %s: reading shard %s failed (%s); retrying in %.1fs", self.input.uri(), e.path, e2, wait
                )
                self._stop.wait(wait)
                return False
            except ValueError as e2:  # refused by the schema gate, undecodable, no spaces
                self._skip_shard(e.path, str(e2))
        if self.cfg.env:
            import gymnasium as gym

            env = gym.make(self.cfg.env)
            self.obs_space, self.act_space = env.observation_space, env.action_space
            env.close()
            if shard_spaces is not None and (
                shard_spaces[0].shape != self.obs_space.shape or type(shard_spaces[1]) is not type(self.act_space)
            ):
                raise UnsupportedCombination(
                    f"the shards' spaces {shard_spaces} do not match {self.cfg.env}'s "
                    f"{(self.obs_space, self.act_space)}"
                )
        elif shard_spaces is None:
            return False  # no usable shard yet and no --env: wait for more shards
        else:
            self.obs_space, self.act_space = shard_spaces
        _check_spaces(self.cfg.algo, self.obs_space, self.act_space)
        return True

    def _skip_shard(self, key: str, why: str) -> None:
        """Count a shard the trainer cannot use; log it once."""
        if key in self._skip_logged:
            return
        self._skip_logged.add(key)
        self.shards_skipped += 1
        log.error("shard %s cannot be used (%s); skipping it", key, why)

    # ------------------------------------------------------------------ config
    def build_config(self) -> Any:
        from rlrec.trainer.data import configure_continuous

        cfg = self.cfg
        config_cls = _import(ALGORITHMS[cfg.algo][0])
        config = config_cls()
        # spaces always (RLlib requires them whenever no evaluation runs); env for evaluation
        config.environment(env=cfg.env, observation_space=self.obs_space, action_space=self.act_space)
        config.env_runners(num_env_runners=0)
        config.learners(num_learners=cfg.num_learners, num_gpus_per_learner=cfg.num_gpus_per_learner)
        config.reporting(min_time_s_per_iteration=cfg.min_time_s_per_iteration)
        if cfg.seed is not None:
            config.debugging(seed=cfg.seed)
        algo_kw = dict(cfg.algo_config)
        if cfg.algo == "CQL" and "lr" not in algo_kw:
            algo_kw["lr"] = None  # CQLConfig's default lr fails its own (SAC) validation in RLlib 2.60
        try:
            config.training(**algo_kw)
        except TypeError as e:
            raise ValueError(f"--algo-config: {e}") from None
        off = dict(cfg.offline_config)
        off.pop("input_", None)
        pre = off.get("prelearner_class")
        if isinstance(pre, str):
            off["prelearner_class"] = _import(pre)
        if cfg.map_batches_concurrency is not None:
            mb = dict(off.get("map_batches_kwargs") or {})
            mb["concurrency"] = int(cfg.map_batches_concurrency)
            off["map_batches_kwargs"] = mb
        for k in ("materialize_data", "materialize_mapped_data"):
            if off.pop(k, False):
                log.warning("--offline-config %s=True is ignored: it would freeze the data of a continuous trainer", k)
        if off.pop("input_compress_columns", None):
            raise ValueError(
                "--offline-config input_compress_columns: compressed columns are "
                "unpickled by RLlib; the trainer never unpickles shard data"
            )
        off.pop("input_read_episodes", None)
        if off:
            config.offline_data(**off)
        if cfg.eval_interval:
            config.evaluation(
                evaluation_interval=cfg.eval_interval,
                evaluation_duration=cfg.eval_episodes,
                evaluation_duration_unit="episodes",
                evaluation_num_env_runners=0,
                evaluation_config={"explore": False},
            )
        configure_continuous(
            config,
            cfg.input,
            fmt=self.fmt or "episodes",
            feed_policy=cfg.feed_policy(),
            policy_id=cfg.policy_id,
            min_policy_version=cfg.min_policy_version,
            max_policy_version=cfg.max_policy_version,
            poll_interval_s=cfg.poll_interval_s,
            prelearner_mode=cfg.prelearner_mode,
            cache_ttl_s=cfg.cache_ttl_s,
            read_tasks=cfg.read_tasks,
            holdout_fraction=cfg.ope.holdout_fraction,
        )
        return config

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, final: bool = False) -> str:
        """Save the algorithm + trainer state, move `latest` (the commit point), then publish.

        A policy version is committed by the checkpoint that carries it: `publish` only prepares
        it (its files, its lineage, the version number, the shards it counts as new); the
        checkpoint saves those files and the state *after* the publication, and only then are
        they written to the publish root (`_write_publications`). A crash before the commit
        publishes nothing and the resume trains those shards as new again; a crash after it
        leaves the publication to the resume, which writes it from the checkpoint
        (`_restore`). So the versions' ``new_shards`` list every shard once, versions only
        grow, and a half-written version directory (no policy.json) is completed, never loaded.

        With the promotion gate, the final (stop) checkpoint publishes nothing: every candidate
        is exported at a periodic checkpoint; the env gate's decision is recorded in that
        iteration's metrics line, the ope gate's in the line of the iteration it arrives at."""
        t0 = time.time()
        self._prepare_checkpoint(final)
        name = self._commit()
        log.info("checkpoint %s (policy v%d) in %.2fs", name, self.policy_version, time.time() - t0)
        return name

    def _prepare_checkpoint(self, final: bool = False) -> None:
        """The publication step of a checkpoint: prepare the next version (or re-sign the pointer)."""
        if self.cfg.publish:
            published = self.policy_version
            if not (final and self.cfg.gate):
                self.publish(final=final)
            if self.policy_version == published and not self._pending:
                self._refresh_pointer()

    def _commit(self) -> str:
        """Save the checkpoint (state and the pending publications' files), then write the
        publications and prune; the checkpoint's path."""
        state = {
            "version": STATE_VERSION,
            "iteration": self.iteration,
            "policy_version": self.policy_version,
            "run_id": self.run_id,
            "channel": self.cfg.publish_channel,
            "timesteps_trained": self.timesteps_trained,
            "algo": self.cfg.algo,
            "input": self.input.uri(),
            "trained_shards": sorted(self.trained),
            "since_publish": sorted(self.since_publish),
            "trained_ranges": ranges_doc(self.trained_ranges),
            "published_ranges": ranges_doc(self.published_ranges),
            "trained_unplaced": sorted(self._unplaced),
            "holdout_fraction": float(self.cfg.ope.holdout_fraction),
            "deployed_return": self.deployed_return,
            "publications": [p.describe() for p in self._pending],
            "time": time.time(),
        }
        extra = {f"{PUBLISH_DIR}/{p.directory}/{n}": data for p in self._pending for n, data in p.files.items()}
        name = self._save_committed(state, extra)
        self._write_publications()
        self.checkpoints.prune(self.cfg.keep_checkpoints, current=name)
        return name

    def _save_committed(self, state: dict, extra: dict[str, bytes]) -> str:
        """`CheckpointStore.save`, retried on the one schedule while the checkpoint store does
        not answer (the Learners' state is kept meanwhile; a stop ends the wait with an error)."""
        outage = RetrySchedule()
        try:
            while True:
                try:
                    return self.checkpoints.save(
                        self.iteration, self.algo, state, policy_version=self.policy_version, extra=extra
                    )
                except StorageError as e:
                    wait = outage.failed(time.monotonic())
                    self._checkpoint_store_down = True  # the stall watchdog waits too
                    if self._stop.is_set() and outage.failures > 3:
                        raise
                    log.warning(
                        "saving checkpoint %d to %s failed (%s); retrying in %.1fs",
                        self.iteration,
                        self.out.uri(),
                        e,
                        wait,
                    )
                    self._stop.wait(wait)
        finally:
            self._checkpoint_store_down = False

    def _write_publications(self) -> None:
        """Write the committed publications not written yet (oldest first); one that fails stays
        pending (in memory and in every later checkpoint) and is written again later."""
        from rlrec.trainer.export import highest_version, write_publication

        while self._pending:
            pub = self._pending[0]
            try:
                pointer = highest_version(self.publish_storage, self.signing_key) <= pub.version
                write_publication(self.publish_storage, pub, self.signing_key, pointer=pointer)
            except LineageError as e:  # its data is gone: never deployed, not retried
                log.error("%s", e)
                self._pending.pop(0)
                continue
            except Exception as e:
                log.error("publishing policy v%d failed (%s); it is written again later", pub.version, e)
                return
            self._pending.pop(0)
            log.info("published policy v%d", pub.version)

    def publish(self, final: bool = False) -> None:
        """Publish the current policy as the next version, or hand it to its gate.

        ``--promotion-gate env`` evaluates it here and publishes it if it passes; ``ope``
        starts its off-policy evaluation in the background (`rlrec.trainer.ope_jobs`) and
        publishes it when the decision comes (`collect_evaluation`). With ``--ope-report`` (and
        no ope gate) the candidate's off-policy estimate is started in the background too.

        Args:
            final: the stop's checkpoint (no ``--ope-report`` estimate is started).

        Example:
            >>> trainer.publish()  # doctest: +SKIP
            >>> trainer.policy_version  # doctest: +SKIP
            1
        """
        from rlrec.trainer.promotion import export_candidate

        version = self._next_version()
        if self.run_id is None:
            from rlrec.trainer.binding import new_run_id

            self.run_id = new_run_id()
            log.info(
                "run id %s (channel %s): signed into every policy version it publishes",
                self.run_id,
                self.cfg.publish_channel,
            )
        if self.cfg.promotion_gate == "ope":
            self._start_evaluation(version, gating=True)
            return
        artifact = None
        report = self.cfg.ope_report and not final
        if self.cfg.promotion_gate == "env" or report:
            try:
                artifact = export_candidate(self.algo, self.obs_space, self.act_space)
            except Exception as e:
                log.error("exporting candidate v%d failed (%s): not published", version, e)
                return
        if report:
            self._start_evaluation(version, gating=False, artifact=artifact)
        metadata = {"gamma": self._gamma()}
        try:
            lineage = self._lineage()
        except LineageLost:
            raise
        except Exception as e:
            log.error("publishing policy v%d failed: its lineage: %s (a later checkpoint publishes)", version, e)
            return
        if self.cfg.promotion_gate == "env":
            if not self._promote_env(version, artifact):
                return
            metadata["promotion"] = self.last_promotion
        self._publish(version, artifact, metadata, lineage)

    def _lineage(self) -> dict:
        """What a version published now records of its training (docs/TRAINER.md, "Lineage"):
        the shards new since the last version, and ``data``: the input store, the shards trained
        on (at least one row of each in a gradient step) as manifest seq ranges per partition
        log (``trained``; `trained_ranges`, kept in the checkpoint) and their number, the
        manifest cursor holding them (`rlrec.store.snapshot.cursor_at`) and the holdout
        fraction whose held-out episodes of those shards were not trained on.

        Raises:
            LineageLost: a trained shard is in no partition log of the input (the trainer stops).
            StorageError: the store does not answer (a later checkpoint publishes)."""
        from rlrec.store.snapshot import CursorError, cursor_at

        if self._lineage_lost is not None:
            raise LineageLost(
                f"no lineage can be recorded: {self._lineage_lost}; not publishing without one. Check --input "
                "(the store this run trained on); start a new run (another --checkpoint-dir) if its manifest "
                "lost those entries"
            )
        if not self._place_trained():
            raise StorageError(f"the manifest entries of {len(self._unplaced)} trained shard(s) are not read yet")
        ends = {k: rs[-1][1] for k, rs in self.trained_ranges.items() if rs}
        try:
            cursor = cursor_at(self.input, ends, self._log_firsts)
        except CursorError as e:  # a partition log of trained shards is gone from the input
            self._lineage_lost = str(e)
            return self._lineage()
        return {
            "iteration": self.iteration,
            "timesteps_trained": self.timesteps_trained,
            "shards": None,  # named by data["trained"]: a list of every shard would grow without bound
            "new_shards": sorted(self.since_publish),
            "data": {
                "input": self.input.uri(),
                "cursor": str(cursor),
                "trained": ranges_doc(self.trained_ranges),
                "trained_before": ranges_doc(self.published_ranges),
                **self._expired_before_publication(),
                "shards_trained": len(self.trained),
                "holdout_fraction": float(self.cfg.ope.holdout_fraction),
            },
        }

    def _expired_before_publication(self) -> dict:
        """``expired_before_publication``: the shards holding data the versions before had trained
        on (`published_ranges`) that retention removed since (`rlrec.trainer.lineage.removed_data`):
        the new version's lineage cannot reopen them, and its publication is not refused for them."""
        from rlrec.trainer.lineage import removed_data

        if not self.published_ranges:
            return {}
        try:
            _, lost = removed_data(self.input, {k: [tuple(r) for r in rs] for k, rs in self.published_ranges.items()})
        except Exception as e:  # the publication's own check reads the removal log again
            log.warning("reading the removal log of %s for the lineage failed: %s", self.input.uri(), e)
            return {}
        return {"expired_before_publication": sorted(lost)} if lost else {}

    def _note_trained(self, keys: Any) -> None:
        """Add the shards `keys` (just trained) to `trained_ranges`, by their manifest
        entries (`_place_trained`)."""
        self._unplaced |= set(keys)
        self._place_trained()

    def _place_trained(self) -> bool:
        """Find the manifest entries of the trained shards not placed yet: from the follower,
        else from the input's manifest (read once per call that needs it: a shard the follower
        no longer selects, a checkpoint without ranges). A shard in no partition log marks
        the lineage lost (`LineageLost` at the next publish); a store that does not answer
        leaves them for the next call. True when every trained shard is placed."""
        if not self._unplaced:
            return True
        od = self.algo.offline_data if self.algo is not None else None
        found = {k: od.seqs(k) if od is not None else None for k in self._unplaced}
        unknown = [k for k, e in found.items() if e is None]
        if unknown:
            try:
                by_path = shard_places(self.input)
            except StorageError as e:
                log.warning(
                    "reading the manifest of %s for the lineage failed (%s); retried later", self.input.uri(), e
                )
                by_path = None
            if by_path is not None:
                found.update({k: by_path.get(k) for k in unknown})
                lost = sorted(k for k in unknown if found[k] is None)
                if lost and self._lineage_lost is None:
                    self._lineage_lost = (
                        f"{len(lost)} trained shard(s) are in no partition log of {self.input.uri()}, e.g. {lost[0]}"
                    )
                    log.error("%s: no version can be published with a lineage", self._lineage_lost)
                self._unplaced -= set(lost)
        for k, place in found.items():
            if place is not None:
                key, seqs = place
                for q in seqs:
                    add_seq(self.trained_ranges.setdefault(key, []), q)
                self._unplaced.discard(k)
        return not self._unplaced

    def _publish(self, version: int, artifact: Any, metadata: dict, lineage: dict) -> bool:
        """Prepare `artifact` (None: export the Learner's weights now) as `version`, to be
        committed by the next checkpoint and written after it (`checkpoint`); True if it was."""
        from rlrec.trainer.export import prepare_publication

        try:
            pub = prepare_publication(
                algo=self.algo,
                version=version,
                algo_name=self.cfg.algo,
                observation_space=self.obs_space,
                action_space=self.act_space,
                iteration=lineage["iteration"],
                timesteps_trained=lineage["timesteps_trained"],
                shards=lineage["shards"],
                new_shards=lineage["new_shards"],
                data=lineage["data"],
                parent_version=self.policy_version or None,
                signing_key=self.signing_key,
                artifact=artifact,
                metadata=metadata,
                run_id=self.run_id,
                channel=self.cfg.publish_channel,
            )
        except Exception as e:
            log.error("publishing policy v%d failed: %s", version, e)
            if self.last_promotion is not None and self.last_promotion["candidate_version"] == version:
                self.last_promotion["promoted"] = False  # not deployed after all
            return False
        self._pending.append(pub)
        self.published_ranges = _ranges_state(lineage["data"]["trained"])
        self.policy_version = version
        self.since_publish -= set(lineage["new_shards"])
        if self.last_promotion is not None and self.last_promotion["candidate_version"] == version:
            self.deployed_return = self.last_promotion["candidate_return"]
        return True

    def _next_version(self) -> int:
        """One above this run's last version and above every version (signed by this trainer's
        key, when it has one) already under the publish root: a fresh run or a rollback
        republished there is never overwritten."""
        from rlrec.trainer.export import highest_version

        try:
            present = highest_version(self.publish_storage, self.signing_key)
        except Exception as e:
            log.warning("cannot list the published versions (%s); numbering from v%d", e, self.policy_version)
            present = 0
        if present > self.policy_version:
            log.info("v%d is published already under %s: publishing above it", present, self.publish_storage.uri())
        return max(self.policy_version, present) + 1

    def _refresh_pointer(self) -> None:
        """Re-sign the pointer to this run's latest version (a fresh time for services that
        check its age); only with a signing key, after this run has published."""
        if self.signing_key is None or self.run_id is None or not self.policy_version:
            return
        from rlrec.trainer.export import refresh_latest

        try:
            refresh_latest(
                self.publish_storage,
                version=self.policy_version,
                run_id=self.run_id,
                channel=self.cfg.publish_channel,
                signing_key=self.signing_key,
            )
        except Exception as e:
            log.error("refreshing the policy pointer failed: %s", e)

    def _gamma(self) -> float | None:
        try:
            return float(self.algo.config.gamma)
        except (AttributeError, TypeError, ValueError):
            return None

    def _candidate_spec(self, artifact: Any, version: int) -> dict:
        from rlrec.producer.spaces import space_to_json

        return {
            **artifact.spec,
            "policy_version": version,
            "observation_space": space_to_json(self.obs_space),
            "action_space": space_to_json(self.act_space),
            "observation_shape": list(self.obs_space.shape),
        }

    def _deployed_policy(self, version: int) -> Any:
        """Published `version`, loaded as services load it (the last one loaded is cached)."""
        import warnings

        from rlrec.trainer.policy import UnsignedPolicyWarning, load_policy

        cached = self._deployed_cache
        if cached is not None and cached.policy_version == version:
            return cached
        public_key = None
        if self.signing_key is not None:
            from cryptography.hazmat.primitives import serialization

            public_key = self.signing_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnsignedPolicyWarning)
            self._deployed_cache = load_policy(
                self.publish_storage.uri(""),
                version=version,
                public_key=public_key,
                allow_unsigned=public_key is None,
            )
        return self._deployed_cache

    # ------------------------------------------------------------------ off-policy evaluation
    def _start_evaluation(self, version: int, *, gating: bool, artifact: Any = None) -> None:
        """Export the candidate (unless given) and evaluate it off-policy in the background;
        one evaluation at a time (a checkpoint meanwhile starts none)."""
        from functools import partial

        from rlrec.trainer import ope_jobs
        from rlrec.trainer.promotion import export_candidate

        running = self._job
        if running is not None:
            log.info(
                "candidate v%d (iteration %d) is not evaluated off-policy: the evaluation of v%d "
                "(iteration %d) is still running",
                version,
                self.iteration,
                running.version,
                running.iteration,
            )
            return
        try:
            if artifact is None:
                artifact = export_candidate(self.algo, self.obs_space, self.act_space)
            lineage = self._lineage()
        except LineageLost:
            raise
        except Exception as e:
            log.error("exporting candidate v%d failed (%s): not evaluated", version, e)
            return
        job = ope_jobs.CandidateJob(
            version=version,
            artifact=artifact,
            spec=self._candidate_spec(artifact, version),
            gamma=self._gamma() or 0.99,
            gating=gating,
            deployed_version=self.policy_version or None,
            **lineage,
        )
        if self._held_out is None:
            from rlrec.trainer.ope_data import HeldOutReader, policy_spaces

            # the candidate's spaces, as its policy.json states them: `rlrec evaluate` checks the
            # held-out episodes against the evaluated version's the same way
            obs_space, act_space = policy_spaces(job.spec)
            self._held_out = HeldOutReader(
                self.input,
                self.cfg.ope.holdout_fraction,
                policy_id=self.cfg.policy_id,
                observation_space=obs_space,
                action_space=act_space,
            )
        work = partial(
            ope_jobs.evaluate_candidate, cfg=self.cfg, held_out=self._held_out, deployed=self._deployed_policy
        )
        self._job = ope_jobs.start(job, work)

    def collect_evaluation(self, timeout: float | None = 0.0) -> dict | None:
        """Apply the background evaluation if it finished (waiting up to `timeout` seconds; None:
        until it does): the ope gate publishes a promoted candidate. Returns the decision (the
        ope gate: also `last_promotion`) or report, None if none finished.

        Args:
            timeout: seconds to wait; 0: only look.

        Example:
            >>> trainer.publish(); trainer.collect_evaluation(None)["promoted"]  # doctest: +SKIP
            True
        """
        import concurrent.futures

        from rlrec.trainer import ope_jobs

        job = self._job
        if job is None:
            return None
        try:
            d = job.future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return None
        except Exception as e:  # evaluate_candidate reports its failures; anything else lands here
            d = {"candidate_version": job.version, "reason": f"evaluation failed: {type(e).__name__}: {e}"}
            if job.gating:
                d.update({"gate": "ope", "promoted": False, "refusal": ope_jobs.refusal_record("failed")})
        self._job = None
        if job.gating:
            self.last_promotion = d
            if d.get("promoted"):
                lineage = {
                    k: getattr(job, k) for k in ("iteration", "timesteps_trained", "shards", "new_shards", "data")
                }
                self._publish(job.version, job.artifact, {"gamma": job.gamma, "promotion": d}, lineage)
            elif job.artifact is not None and d.get("refusal", {}).get("code") != "no_data":
                self._keep_refused(job, d)
            self._log_decision(job, d)
        else:
            log.info(
                "off-policy estimate (%s) of candidate v%d (iteration %d): %s%s%s",
                d.get("estimator"),
                job.version,
                job.iteration,
                d.get("candidate_return"),
                f", true discounted return {d['true_return']:.4g}" if d.get("true_return") is not None else "",
                f" ({d['reason']})" if d.get("reason") else "",
            )
        return d

    def _keep_refused(self, job: Any, d: dict) -> None:
        """Keep the refused candidate where `rlrec evaluate --candidate` loads it
        (`rlrec.trainer.refused`); the decision records where (``refused_candidate``)."""
        from rlrec.trainer.refused import keep_refused

        try:
            d["refused_candidate"] = keep_refused(
                self.publish_storage,
                job,
                dict(d),
                observation_space=self.obs_space,
                action_space=self.act_space,
                algo_name=self.cfg.algo,
                signing_key=self.signing_key,
                run_id=self.run_id,
                channel=self.cfg.publish_channel,
                parent_version=self.policy_version or None,
            )
        except Exception as e:  # the decision stands; only its reproduction is lost
            d["refused_candidate"] = None
            log.warning("keeping refused candidate v%d for rlrec evaluate failed: %s", job.version, e)

    def _log_decision(self, job: Any, d: dict) -> None:
        log.info(
            "promotion gate (ope, %s): candidate v%d (iteration %d) vs %s: difference %s [%s, %s]: %s%s (%.2fs)",
            d.get("estimator"),
            job.version,
            job.iteration,
            f"v{job.deployed_version}" if job.deployed_version else "the logged behaviour",
            d.get("difference"),
            d.get("ci_low"),
            d.get("ci_high"),
            "promoted" if d.get("promoted") else "kept the deployed version",
            f" ({d['reason']})" if d.get("reason") else "",
            d.get("seconds") or 0.0,
        )

    def _finish_evaluation_at_stop(self) -> None:
        """At a stop: wait up to --evaluation-wait-s for a running evaluation and apply it (a late
        metrics line records it); else drop it, with a log line, its candidate unpublished."""
        job = self._job
        if job is None:
            return
        log.info(
            "waiting up to %gs for the off-policy evaluation of candidate v%d", self.cfg.evaluation_wait_s, job.version
        )
        d = self.collect_evaluation(timeout=self.cfg.evaluation_wait_s)
        if d is None:
            self._job = None
            log.warning(
                "stopping: dropped the off-policy evaluation of candidate v%d (iteration %d) after %gs; "
                "it is not published",
                job.version,
                job.iteration,
                self.cfg.evaluation_wait_s,
            )
            return
        if self.metrics is not None and self.last_record is not None:
            late = {
                k: self.last_record.get(k) for k in ("iteration", "timesteps_trained", "shards_total", "shards_new")
            }
            late.update(
                {"policy_version": self.policy_version, "time": round(time.time(), 3), "shards_new": 0, "late": True}
            )
            late["promotion" if job.gating else "ope_report"] = d
            self.metrics.write(late)

    def _promote_env(self, version: int, artifact: Any) -> bool:
        """The simulator gate: evaluate the candidate `artifact` in --env; True if it is not worse
        than the deployed version (the decision is `last_promotion`)."""
        from rlrec.trainer.promotion import decide, evaluate_exported

        self._progress()  # evaluating a candidate in the simulator: its episodes are not a stall
        t0 = time.time()
        try:
            spec = self._candidate_spec(artifact, version)
            model = artifact.files[artifact.spec["model"]]
            ret = evaluate_exported(model, spec, self.cfg.env, self.cfg.promotion_episodes, seed=self.cfg.seed or 0)
        except Exception as e:
            log.error("evaluating candidate v%d failed (%s): not promoted", version, e)
            return False
        d = decide(version, ret, self.policy_version or None, self.deployed_return)
        self.last_promotion = d.to_dict()
        log.info(
            "promotion gate: candidate v%d return %.1f vs deployed %s return %s: %s (%.2fs)",
            version,
            ret,
            f"v{self.policy_version}" if self.policy_version else "(baseline)",
            "-" if d.deployed_return is None else f"{d.deployed_return:.1f}",
            "promoted" if d.promoted else "kept the deployed version",
            time.time() - t0,
        )
        return d.promoted

    def _load_publications(self, path: str, described: list) -> None:
        """The publications checkpoint `path` committed; written now (again, if the crash came
        after they were: the same bytes)."""
        from rlrec.trainer.export import Publication
        from rlrec.trainer.policy import VERSION_DIR_RE

        for d in described:
            if not (
                isinstance(d, dict) and isinstance(d.get("directory"), str) and VERSION_DIR_RE.match(d["directory"])
            ):
                raise ValueError(f"checkpoint {path}: a malformed publication record {str(d)[:80]!r}")
            files = {n: self.checkpoints.read_file(path, f"{PUBLISH_DIR}/{d['directory']}/{n}") for n in d["files"]}
            self._pending.append(
                Publication(
                    version=int(d["version"]),
                    directory=d["directory"],
                    files=files,
                    run_id=d.get("run_id"),
                    channel=d.get("channel"),
                    time=float(d.get("time") or 0.0),
                )
            )
        if self._pending:
            log.info(
                "checkpoint %s commits policy v%s: writing it", path, ", v".join(str(p.version) for p in self._pending)
            )
            self._write_publications()

    def _resume_point(self) -> dict | None:
        """What ``--resume`` continues from (`CheckpointStore.resume_point`); checked before Ray
        starts, and a refusal (`ResumeRefused`, exit 2) touches nothing."""
        from rlrec.trainer.export import highest_version

        latest = self.checkpoints.resume_point(highest_version(self.publish_storage, self.signing_key))
        if latest is not None:
            self._check_resume_holdout(self.checkpoints.read_state(latest["path"]), latest["path"])
        return latest

    def _check_resume_holdout(self, state: dict, path: str) -> None:
        """Refuse (`ResumeRefused`) to resume with another ``--holdout-fraction`` than the
        checkpoint's: the shards trained so far were split with its fraction, and every later
        version's lineage records one fraction for all of its shards (docs/TRAINER.md, L1)."""
        from rlrec.trainer.checkpoints import ResumeRefused

        then = state.get("holdout_fraction")
        if then is None:  # a checkpoint that did not record it: nothing to compare
            return
        now = float(self.cfg.ope.holdout_fraction)
        if float(then) != now:
            raise ResumeRefused(
                f"--resume: checkpoint {path} trained with --holdout-fraction {float(then):g}, not {now:g}: "
                "the shards trained so far were split with it (their lineage would be wrong); resume with "
                f"--holdout-fraction {float(then):g}, or start a new run in another --checkpoint-dir"
            )

    def _restore(self, latest: dict | None) -> bool:
        if latest is None:
            log.info("--resume: no checkpoint under %s; starting fresh", self.out.uri())
            self.metrics.truncate_after(None)
            return False
        path = latest["path"]
        state = self.checkpoints.read_state(path)
        if state.get("algo") != self.cfg.algo:
            raise ValueError(f"the checkpoint was written by {state.get('algo')}, not {self.cfg.algo}")
        self.checkpoints.restore_learner_group(self.algo, path)
        self.iteration = int(state["iteration"])
        self.algo._iteration = self.iteration
        self.policy_version = int(state["policy_version"])
        self.run_id = state.get("run_id")
        if state.get("channel") not in (None, self.cfg.publish_channel):
            log.warning(
                "the checkpoint's versions were published for channel %s; publishing for %s from now on",
                state.get("channel"),
                self.cfg.publish_channel,
            )
        published = self._next_version() - 1  # the highest version present, bounded reads
        if published > self.policy_version:  # published (by a late gate decision) after the checkpoint
            log.info(
                "policy v%d was published after checkpoint %s: the next version is v%d", published, path, published + 1
            )
            self.policy_version = published
        self._load_publications(path, state.get("publications") or [])
        self.timesteps_trained = int(state["timesteps_trained"])
        self.trained = set(state["trained_shards"])
        self.since_publish = set(state.get("since_publish", ()))
        self._restore_ranges(state)
        if state.get("deployed_return") is not None:
            self.deployed_return = float(state["deployed_return"])
        self.metrics.truncate_after(self.iteration)
        log.info(
            "resumed from %s: iteration %d, policy v%d, %d shards trained on",
            path,
            self.iteration,
            self.policy_version,
            len(self.trained),
        )
        return True

    def _restore_ranges(self, state: dict) -> None:
        """`trained_ranges` from a checkpoint's state; a checkpoint without them (or with
        malformed ones) gets them from the input's manifest (`_place_trained`); `published_ranges`
        too (none kept: the next version checks all its data at publication)."""
        self.trained_ranges = {}
        try:
            self.published_ranges = _ranges_state(state.get("published_ranges") or [])
        except (TypeError, ValueError):
            self.published_ranges = {}
        try:
            self.trained_ranges = _ranges_state(state["trained_ranges"])
            unplaced = {str(k) for k in state.get("trained_unplaced") or ()}
        except (KeyError, TypeError, ValueError):
            if self.trained:
                log.info("the checkpoint keeps no manifest ranges: finding its %d trained shards", len(self.trained))
            unplaced = set(self.trained)
        self._note_trained(unplaced & self.trained)

    # ------------------------------------------------------------------ main loop
    def setup(self) -> bool:
        import ray

        resume_from = self._resume_point() if self.cfg.resume else None
        if self.cfg.placement.address is not None:  # joining a cluster: check it before waiting for data
            self._connect()
        entries = self._first_shards()
        if not entries:
            return False
        while not self._spaces(entries):  # every shard so far refused, and no --env
            entries = self._first_shards(skip=self._skip_logged)
            if not entries:
                return False
        if not self._connected:  # start-up phases, said as each begins (each takes seconds)
            log.info("found %d committed shard(s): starting Ray", len(entries))
        self._connect()
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        config = self.build_config()
        log.info("building %s and its Learner(s); the first iteration follows its first batches", self.cfg.algo)
        self.algo = config.build_algo()
        if self.cfg.num_learners:
            self._log_learner_nodes()
        self.metrics = TrainerMetrics(self.out, self.cfg.metrics_port, self.cfg.progress, self.cfg.metrics_host)
        self.algo.offline_data.health.on_errors = self.metrics.count_storage_errors
        if self.cfg.resume:
            self._restore(resume_from)
        else:
            if self.checkpoints.latest() is not None:
                log.warning(
                    "%s holds a checkpoint; starting fresh because --resume was not given (metrics.jsonl is restarted)",
                    self.out.uri(),
                )
            self.metrics.truncate_after(None)
        self.algo.offline_data.start(self.trained, self.trained_ranges)
        return True

    def _connect(self) -> None:
        """Start or join Ray (once), check the cluster, then install the signal handlers."""
        import ray

        if self._connected:
            return
        if not ray.is_initialized():
            ray.init(**self.cfg.placement.init_kwargs())
            self._started_ray = True
        self._connected = True
        self._check_cluster()
        if self.install_signals:  # after ray.init: Ray installs its own SIGTERM handler
            self.install_signal_handlers()

    def _log_learner_nodes(self) -> None:
        def node(_learner: Any) -> str:
            import ray

            return ray.get_runtime_context().get_node_id()

        try:
            nodes = [r.get() for r in self.algo.learner_group.foreach_learner(node)]
        except Exception as e:  # informational only
            log.debug("learner nodes: %s", e)
            return
        log.info("%d Learner(s) on %d node(s): %s", len(nodes), len(set(nodes)), ", ".join(n[:8] for n in nodes))

    def _check_cluster(self) -> None:
        """Refuse what cannot work on this cluster (a node-local input with several nodes)."""
        from rlrec.trainer.cluster import alive_nodes, check_input_reachable

        nodes = alive_nodes()
        check_input_reachable(self.cfg.input, len(nodes))
        if len(nodes) > 1 or self.cfg.placement.address is not None:
            log.info(
                "Ray cluster: %d node(s), %s CPUs, %s GPUs",
                len(nodes),
                sum(n.get("Resources", {}).get("CPU", 0) for n in nodes),
                sum(n.get("Resources", {}).get("GPU", 0) for n in nodes),
            )

    def _record(self, result: dict, st: Any, dt: float) -> dict:
        from ray.rllib.core import DEFAULT_MODULE_ID

        od = self.algo.offline_data
        now = time.time()
        ages = [now - e.commit_time for k in st.seen if (e := od.entry(k)) is not None]
        loss = _finite(_result_get(result, "learners", DEFAULT_MODULE_ID, "total_loss"))
        rec: dict[str, Any] = {
            "iteration": self.iteration,
            "policy_version": self.policy_version,
            "timesteps_trained": self.timesteps_trained,
            "shards_total": od.shards_total,
            "shards_new": len(st.newly_trained),
            "newest_shard_age_s": round(min(ages), 3) if ages else None,
            "learner_loss": loss,
        }
        ev = _finite(_result_get(result, "evaluation", "env_runners", "episode_return_mean"))
        if ev is not None:
            rec["eval_return_mean"] = ev
        lat = sorted(t - e.commit_time for k, t in st.newly_trained.items() if (e := od.entry(k)) is not None)
        try:
            summary = od.summary()
            rec["fresh_backlog"] = int(summary["fresh"])
            rec["read_tasks_running"] = int(summary.get("read_tasks", 0))
        except Exception:
            pass
        rec.update(
            {
                "time": round(now, 3),
                "iteration_s": round(dt, 3),
                "rows_trained": st.rows_trained,
                "rows_streamed": st.rows_streamed,
                "fresh_chunks_trained": st.fresh_chunks,
                # rows each Learner took from the stream this iteration (fresh data reaching every Learner)
                "rows_streamed_per_learner": sorted(st.rows_streamed_by_learner.values(), reverse=True),
                "shards_trained_iter": len(st.seen),
                "learner_wait_s": round(st.wait_s, 3),
                "learner_wait_share": round(min(1.0, st.wait_s / dt), 4) if dt > 0 else None,
                "commit_to_train_s_max": round(lat[-1], 3) if lat else None,
                "shards_missing": self.missing_total,
                "storage_errors": od.health.pop_iteration(),
                "shards_skipped": self.shards_skipped,
                "episodes_skipped": self.episodes_skipped,
                "new_shards": sorted(st.newly_trained),
            }
        )
        return rec

    def train_once(self) -> dict:
        algo = self.algo
        od = algo.offline_data
        if self._pending:  # committed by the last checkpoint, its writing failed: again
            self._write_publications()
        t0 = time.time()
        result = algo.train()
        marks = od.iteration_marks(algo.learner_group)
        st = od.pop_stats(marks)
        dt = time.time() - t0
        self.iteration = algo.iteration
        self.timesteps_trained += st.rows_trained
        new = set(st.newly_trained) - self.trained
        st.newly_trained = {k: v for k, v in st.newly_trained.items() if k in new}
        self.trained |= new
        self.since_publish |= new
        if new:
            self._note_trained(new)
        for k in st.missing:
            self.missing_total += 1
            log.warning("shard %s was deleted outside the trainer; skipping it", k)
        for k, why in st.bad:
            self._skip_shard(k, why)
        for k, n, why in st.skipped:
            self.episodes_skipped += n
            if f"episodes:{k}" not in self._skip_logged:
                self._skip_logged.add(f"episodes:{k}")
                log.error("shard %s: skipping %d episode(s) the trainer cannot use (first: %s)", k, n, why)
        rec = self._record(result, st, dt)
        job = self._job
        done = self.collect_evaluation()  # before the checkpoint: it saves the version published
        if done is not None:
            rec["promotion" if job.gating else "ope_report"] = done
            rec["policy_version"] = self.policy_version
        # the iteration's line is written before its checkpoint commits: a crash in between loses
        # the checkpoint, and the resume drops the line with the iterations after the one it restores
        if self.iteration % self.cfg.checkpoint_interval == 0:
            self.last_promotion = None
            self._prepare_checkpoint()
            rec["policy_version"] = self.policy_version
            rec["checkpoint"] = True
            if self.last_promotion is not None:  # the env gate's decision (and its evaluation)
                rec["promotion"] = self.last_promotion
                if self.cfg.promotion_gate == "env":  # (an ope estimate is a discounted return: not mixed in)
                    rec.setdefault("eval_return_mean", self.last_promotion["candidate_return"])
        elif self._pending:  # the ope gate promoted a candidate: a checkpoint commits its publication
            rec["checkpoint"] = True
        self.metrics.write(rec)
        self.last_record = rec
        if rec.get("checkpoint"):
            t = time.time()
            name = self._commit()
            log.info("checkpoint %s (policy v%d) in %.2fs", name, self.policy_version, time.time() - t)
        return rec

    def run(self) -> int:
        """Train until max_iterations, stop() or a signal. Returns a process exit code.

        A Ray actor of the data path or a Learner that dies for good ends the run with
        `TrainerLost` (one error line); a pipeline that stops delivering fresh data ends it
        through the stall watchdog (`rlrec.trainer.watchdog`)."""
        import ray.exceptions

        try:
            try:
                return self._run()
            except ray.exceptions.RayActorError as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise TrainerLost(
                    f"a Ray actor of the trainer died and was not restarted ({first}); "
                    "restart with --resume to continue from the last checkpoint"
                ) from None
        finally:
            self.close()

    def _run(self) -> int:
        if not self.setup():
            return 0
        od = self.algo.offline_data
        if self.cfg.stall_timeout_s:
            from rlrec.trainer.watchdog import StallWatchdog

            self._watchdog = StallWatchdog(
                self.cfg.stall_timeout_s, excuse=lambda: od.health.failing or self._checkpoint_store_down
            )
            self._watchdog.start()
        last_idle_log = 0.0
        while not self._stop.is_set():
            if od.unsupported:
                self.stop_reason = "store too new"
                break
            if self.cfg.max_iterations is not None and self.iteration >= self.cfg.max_iterations:
                self.stop_reason = self.stop_reason or "max iterations"
                break
            ready = od.has_fresh() if self.cfg.wait_for_data else od.has_data()
            if not ready:
                self._progress()
                if time.monotonic() - last_idle_log > self.cfg.idle_log_interval_s:
                    log.info("no %s data; waiting for new shards", "fresh" if self.cfg.wait_for_data else "usable")
                    last_idle_log = time.monotonic()
                self._stop.wait(self.cfg.poll_interval_s)
                continue
            rec = self.train_once()
            if self._watchdog is not None:
                self._watchdog.iteration(
                    fresh_chunks=int(rec.get("fresh_chunks_trained") or 0),
                    backlog=rec.get("fresh_backlog"),
                    shards_new=int(rec.get("shards_new") or 0),
                )
        if self._watchdog is not None:
            self._watchdog.stop()
        if self.algo is not None and self.iteration > 0:
            self._finish_evaluation_at_stop()
            latest = self.checkpoints.latest()
            if latest is None or latest.get("iteration") != self.iteration or self._pending:
                self.checkpoint(final=True)
        if od.unsupported:
            saved = "checkpointed, " if self.iteration > 0 else ""
            raise StoreTooNew(
                f"{od.unsupported}; the trainer stopped ({saved}rather than train on without that log's new "
                "shards): restart it with --resume once rlrec is upgraded"
            )
        return 0

    def _progress(self) -> None:
        if self._watchdog is not None:
            self._watchdog.progress()

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        if self.metrics is not None:
            self.metrics.close()
        if self.algo is not None or self._started_ray:
            log.info("stopping the algorithm and Ray (a few seconds)")
        if self.algo is not None:
            try:
                self.algo.offline_data.stop()
                self.algo.offline_data.batch_iterators = None
                self.algo.stop()
            except Exception as e:
                log.debug("algo.stop: %s", e)
            self.algo = None
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False
        self._connected = False
