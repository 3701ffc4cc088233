"""The continuous trainer service behind ``rlrec train`` (see docs/TRAINER.md).

One process: follows the manifest, trains an RLlib offline algorithm (BC, MARWIL, CQL, IQL)
iteration by iteration on fresh shards plus a replay window, writes one metrics line per
iteration, checkpoints every N iterations (and on SIGTERM), publishes each checkpointed policy
and resumes from the latest checkpoint with its weights, optimizer state and shard cursor.

The checkpoint directory layout is described in `rlrec.trainer.checkpoints`; the metrics in `rlrec.trainer.metrics`.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from rlrec.store.manifest import UnsupportedManifestError
from rlrec.store.retry import RetrySchedule
from rlrec.store.storage import Storage, StorageError
from rlrec.trainer.checkpoints import CheckpointStore
from rlrec.trainer.config import TrainerConfig
from rlrec.trainer.metrics import TrainerMetrics
from rlrec.trainer.service_checkpoint import CheckpointMixin
from rlrec.trainer.service_common import (
    ALGORITHMS,
    PUBLISH_DIR,  # noqa: F401
    LineageLost,  # noqa: F401
    NoFirstShard,
    StoreTooNew,
    TrainerLost,
    UnsupportedCombination,
    _check_spaces,
    _finite,
    _import,
    _result_get,
    log,
    shard_places,  # noqa: F401
)
from rlrec.trainer.service_gate import GateMixin
from rlrec.trainer.service_publish import PublishMixin
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


class ContinuousTrainer(CheckpointMixin, PublishMixin, GateMixin):
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
        self.modules: Any = None  # --multi-agent: rlrec.trainer.multi_agent.StoredModules
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
        self.canary: Any = None  # the running canary (rlrec.trainer.rollout.CanaryRun), saved in checkpoints
        self._canary_next_look = 0.0
        self._canary_signed_at = 0.0  # when this trainer last re-signed its running canary's canary.json
        self._canary_decision: dict | None = None  # taken, not carried out yet (the publish store failed)
        self._canary_failing_since: float | None = None  # the first of the looks failing in a row
        self._deployed = 0  # the version latest.json names by this trainer's own writes (checkpointed)
        self._canary_floor = 0  # the highest canary this trainer ended without a promotion (checkpointed)
        self.publish_lease: Any = None  # rlrec.trainer.publish_lease.PublishLease while publishing

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
            multi_agent=self.cfg.multi_agent,
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

        if self.cfg.multi_agent:
            return self._module_spaces(entries)
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

    def _module_spaces(self, entries: list) -> bool:
        """--multi-agent: the modules, their spaces and the agent -> module mapping from one shard of
        each module folder among `entries` (`rlrec.trainer.multi_agent.modules_from_shards`)."""
        from rlrec.trainer.multi_agent import modules_from_shards

        try:
            self.modules = modules_from_shards(self.input, entries, self.cfg.policy_id)
        except StorageError as e:  # unreachable, not unusable: try again after a wait
            wait = self._outage.failed(time.monotonic())
            log.warning(
                "storage %s: reading the module shards failed (%s); retrying in %.1fs", self.input.uri(), e, wait
            )
            self._stop.wait(wait)
            return False
        except (FileNotFoundError, ValueError) as e:
            raise UnsupportedCombination(f"the multi-agent rows cannot be trained: {e}") from None
        for module_id, (obs, act) in sorted(self.modules.spaces.items()):
            try:
                _check_spaces(self.cfg.algo, obs, act)
            except UnsupportedCombination as e:
                raise UnsupportedCombination(f"module {module_id}: {e}") from None
        if self.cfg.env:  # its agents and spaces must be the stored modules': refused before training
            from rlrec.trainer.multi_agent_env import EnvSpecError, check_env_modules, make_env

            try:
                env = make_env(self.cfg.env, self.cfg.env_config)
                try:
                    whole = check_env_modules(env, self.cfg.env, self.modules.agents, self.modules.spaces)
                finally:
                    env.close()
            except EnvSpecError as e:
                raise UnsupportedCombination(str(e)) from None
            if not whole:
                log.warning(
                    "--env %.80r does not say its possible agents: each is checked when it first appears in the "
                    "gate's episodes (a candidate is refused if one does not fit)",
                    self.cfg.env,
                )
        module = self.cfg.promotion_return.partition(":")[2]
        if module and module not in self.modules.spaces:
            raise UnsupportedCombination(
                f"--promotion-return module:{module!r:.40}: the stored modules are {', '.join(sorted(self.modules.spaces))}"
            )
        log.info("multi-agent modules %s; agents %s", sorted(self.modules.spaces), self.modules.agents)
        return True

    def _read_policy_id(self) -> str | None:
        """The policy whose shards are read: ``--policy-id``; a multi-agent trainer without it
        reads the one multi-agent policy its first shards hold (`_module_spaces`), so another one
        committed later is not mixed into its modules."""
        if self.cfg.policy_id or not self.cfg.multi_agent or self.modules is None:
            return self.cfg.policy_id
        return next(iter(self.modules.policies)) if len(self.modules.policies) == 1 else None

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
        # (a multi-agent --env is played by the env gate only: `rlrec.trainer.multi_agent_env`)
        env = None if cfg.multi_agent else cfg.env
        config.environment(env=env, observation_space=self.obs_space, action_space=self.act_space)
        if cfg.multi_agent:
            from rlrec.trainer.multi_agent import configure_modules

            configure_modules(config, self.modules)
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
            policy_id=self._read_policy_id(),
            min_policy_version=cfg.min_policy_version,
            max_policy_version=cfg.max_policy_version,
            poll_interval_s=cfg.poll_interval_s,
            prelearner_mode=cfg.prelearner_mode,
            cache_ttl_s=cfg.cache_ttl_s,
            read_tasks=cfg.read_tasks,
            holdout_fraction=cfg.ope.holdout_fraction,
            multi_agent=cfg.multi_agent,
            multi_agent_flags=cfg.multi_agent_flags,
        )
        return config

    # ------------------------------------------------------------------ main loop
    def setup(self) -> bool:
        import ray

        resume_from = self._resume_point() if self.cfg.resume else None
        if self.cfg.gate_default:
            log.info("promotion gate: %s", self.cfg.gate_default)
        if self.cfg.publish and self.publish_lease is None:
            from rlrec.trainer.publish_lease import PublishLease

            lease = PublishLease(self.publish_storage, ttl_s=self.cfg.publish_lease_s)
            lease.acquire()  # PublishRootTaken: another trainer publishes there (exit 2)
            self.hold_publish_lease(lease)
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
        self.algo.offline_data.start(self.trained, self.trained_ranges, self._unplaced)
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
        modules = None
        if self.cfg.multi_agent:  # per module: its losses; learner_loss their mean
            modules = {
                m: {k: _finite(_result_get(result, "learners", m, k)) for k in ("total_loss", "policy_loss")}
                for m in sorted(self.modules.spaces)
            }
            totals = [v["total_loss"] for v in modules.values() if v["total_loss"] is not None]
            loss = sum(totals) / len(totals) if totals else None
        rec: dict[str, Any] = {
            "iteration": self.iteration,
            "policy_version": self.policy_version,
            "timesteps_trained": self.timesteps_trained,
            "shards_total": od.shards_total,
            "shards_new": len(st.newly_trained),
            "newest_shard_age_s": round(min(ages), 3) if ages else None,
            "learner_loss": loss,
        }
        if modules is not None:
            rec["learners"] = modules
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
        if self.canary is not None and not self._pending:
            decided = self.look_canary()
            if decided is not None:
                rec["canary"] = decided
                rec["policy_version"] = self.policy_version
                rec["checkpoint"] = True  # the decision is carried out: a checkpoint records it
        if self.canary is not None:
            rec["canary_version"] = self.canary.version
            rec["deployed_version"] = self.canary.base_version
            if self.canary.history:  # the last look: both arms and the bound (rlrec report plots them)
                rec["canary_look"] = self.canary.history[-1]
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
                self._look_canary_idle()  # no new data need not stop a canary's limits from applying
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
        if self.canary is not None:
            log.warning(
                "canary v%d stays on trial with no judge until this trainer runs again with --resume: opted-in "
                "services keep serving it to their share",
                self.canary.version,
            )
        if self._watchdog is not None:
            self._watchdog.stop()
        if self.publish_lease is not None:
            self.publish_lease.release()
            self.publish_lease = None
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
