"""The trainer's checkpoints and resume: saving the algorithm and trainer state, moving `latest` (the commit
point), and restoring the state, the publications it committed to and the shard cursor at ``--resume``
(a part of `rlrec.trainer.service.ContinuousTrainer`).
"""

from __future__ import annotations

import json
import time

from rlrec.store.retry import RetrySchedule
from rlrec.store.storage import StorageError
from rlrec.trainer.checkpoints import STATE_VERSION
from rlrec.trainer.lineage import ranges_doc
from rlrec.trainer.service_common import (
    PUBLISH_DIR,
    _ranges_state,
    log,
)


class CheckpointMixin:
    """The trainer's checkpoints and resume (mixed into `ContinuousTrainer`)."""

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
        self._check_lease()  # a trainer fenced off its publish root moves no checkpoint another may resume
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
            "modules": None if self.modules is None else sorted(self.modules.spaces),
            "deployed_return": self.deployed_return,
            "deployed_measure": self._gate_measure(),
            "deployed_version": self._deployed,
            "canary_floor": self._canary_floor,
            "canary": None if self.canary is None else self.canary.to_state(),
            "canary_decision": self._canary_decision,
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
                    canary_base=None if d.get("canary_base") is None else int(d["canary_base"]),
                    canary_started=None if d.get("canary_started") is None else float(d["canary_started"]),
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

    def _check_resume_modules(self, state: dict, path: str) -> None:
        """Refuse (`ResumeRefused`) to resume a multi-agent run whose store's modules now differ
        from the checkpoint's: a module of the checkpoint would vanish from the next version, a
        new one start from scratch inside a version line that never had it."""
        from rlrec.trainer.checkpoints import ResumeRefused

        then = state.get("modules")
        now = None if self.modules is None else sorted(self.modules.spaces)
        if then is None and now is None:
            return
        if then != now:
            raise ResumeRefused(
                f"--resume: checkpoint {path} trained modules {_names(then)}, the store now holds {_names(now)}: "
                "start a new run in another --checkpoint-dir"
            )

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
        self._check_resume_modules(state, path)
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
        self._deployed = int(state.get("deployed_version") or 0)  # before what reads or raises them below
        self._canary_floor = int(state.get("canary_floor") or 0)
        published = self._next_version() - 1  # the highest version present, bounded reads
        if published > self.policy_version:  # published (by a late gate decision) after the checkpoint
            log.info(
                "policy v%d was published after checkpoint %s: the next version is v%d", published, path, published + 1
            )
            self.policy_version = published
        self._load_publications(path, state.get("publications") or [])
        self._restore_canary(state.get("canary"), path, state.get("canary_decision"))
        self.timesteps_trained = int(state["timesteps_trained"])
        self.trained = set(state["trained_shards"])
        self.since_publish = set(state.get("since_publish", ()))
        self._restore_ranges(state)
        self._restore_deployed_return(state)
        self.metrics.truncate_after(self.iteration)
        log.info(
            "resumed from %s: iteration %d, policy v%d, %d shards trained on",
            path,
            self.iteration,
            self.policy_version,
            len(self.trained),
        )
        return True

    def _gate_measure(self) -> dict | None:
        """What the env gate's returns are measured on (a return measured on another is not
        comparable); None for the other gates."""
        cfg = self.cfg
        if cfg.promotion_gate != "env":
            return None
        return {
            "env": cfg.env,
            "env_config": json.loads(json.dumps(cfg.env_config, sort_keys=True, default=str)),
            "seed": cfg.seed or 0,
            "promotion_episodes": cfg.promotion_episodes,
            "promotion_return": cfg.promotion_return,
        }

    def _restore_deployed_return(self, state: dict) -> None:
        """The deployed return of the checkpoint, unless it was measured on another env, env
        config, seed, episode count or judged return than this run's gate measures on: then it
        is unknown (--promotion-baseline, if given, is what the next candidate must reach)."""
        if state.get("deployed_return") is None:
            return
        then, now = state.get("deployed_measure"), self._gate_measure()
        if "deployed_measure" in state and then != now:
            changed = sorted(k for k in set(then or {}) | set(now or {}) if (then or {}).get(k) != (now or {}).get(k))
            log.warning(
                "--resume: the deployed return %.4g was measured on other %s than this run's gate: it is not "
                "compared; the next candidate is judged against %s",
                float(state["deployed_return"]),
                ", ".join(changed) or "gate settings",
                "nothing (promoted)" if self.cfg.promotion_baseline is None else "--promotion-baseline",
            )
            return
        self.deployed_return = float(state["deployed_return"])

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


def _names(modules: list | None) -> str:
    """Module ids for a one-line message (none: single-agent)."""
    if modules is None:
        return "none (single-agent)"
    names = [repr(str(m))[:42] for m in modules[:10]]
    return "[" + ", ".join(names) + (f", and {len(modules) - 10} more" if len(modules) > 10 else "") + "]"
