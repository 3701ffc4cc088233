"""The trainer's promotion gate and canary: evaluating a candidate (env or off-policy) against the deployed
version, and looking at and deciding a running canary (a part of `rlrec.trainer.service.ContinuousTrainer`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rlrec.trainer.publish_lease import PublishRootTaken
from rlrec.trainer.service_common import (
    LineageLost,
    log,
)


class GateMixin:
    """The trainer's promotion gate and canary (mixed into `ContinuousTrainer`)."""

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
            deployed_version=self.deployed_version or None,
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
            if not d.get("promoted") and self.cfg.rollout == "canary" and self.cfg.canary_unjudged:
                from rlrec.trainer.rollout import gate_declined

                if gate_declined(d):
                    d["canary_unjudged"] = True
            if d.get("promoted") or d.get("canary_unjudged"):
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

    # ------------------------------------------------------------------ canary rollout
    def look_canary(self, now: float | None = None) -> dict | None:
        """Look at the running canary's evidence (at most every ``canary_look_interval_s``) and
        carry out a decision: promote it, or roll it back (`rlrec.trainer.canary_publish.end_canary`).
        A canary whose publication is pending (not written yet: a publish-store outage, or
        `UndecidedCanary`) is not looked at: no decision, nothing signed.

        Returns:
            The decision record (metrics.jsonl's ``canary``), or None while undecided.

        Example:
            >>> trainer.look_canary()  # doctest: +SKIP
            {'decision': 'promote', 'canary_version': 5, 'low': 0.4, ...}
        """
        run = self.canary
        now = time.time() if now is None else now
        if run is None or now < self._canary_next_look:
            return None
        if any(p.version == run.version for p in self._pending):
            return None  # not published yet (an outage, an undecided canary under the root): nothing to judge
        self._canary_next_look = now + self.cfg.canary_look_interval_s
        record = self._canary_decision  # a decision whose carrying out failed: again, unchanged
        if record is None:
            try:
                verdict = run.look(self.input, self.cfg.policy_id, now=now)
                self._canary_failing_since = None
            except Exception as e:  # the store does not answer: the next look tries again, within the limits
                verdict = self._failed_look(run, e, now)
                if verdict is None:
                    return None
            if verdict.decision == "continue":
                self._resign_canary(run)
                return None
            record = self._canary_decision = run.decision_record(verdict, now)
        self._check_lease()
        from rlrec.trainer.canary_publish import end_canary

        try:
            deployed = end_canary(
                self.publish_storage,
                self.signing_key,
                version=run.version,
                base_version=run.base_version,
                promote=record["decision"] == "promote",
                decision=record,
                run_id=self.run_id,
                channel=self.cfg.publish_channel,
                sha256=run.sha256,
                canary_floor=self._canary_floor,
            )
        except PublishRootTaken:
            raise
        except Exception as e:  # the publish store does not answer: carried out at the next look
            log.error("carrying out canary v%d's %s failed (%s); trying again", run.version, record["decision"], e)
            return None
        self._canary_decision = None
        self._deployed = deployed
        record["deployed_version"] = deployed
        self._log_canary(record)
        if record["decision"] == "promote" and run.candidate_return is not None:
            self.deployed_return = run.candidate_return
        if record["decision"] == "promote":
            self.policy_version = max(self.policy_version, deployed)
        else:  # the base stays deployed: the next candidate is judged against it
            self.policy_version = deployed
            self._canary_floor = max(self._canary_floor, run.version)
        self.canary = None
        return record

    def _failed_look(self, run: Any, error: Exception, now: float) -> Any:
        """A look that raised: logged, and tried again at the next look -- unless the looks have
        failed for ``--canary-max-wait-s`` in a row or the canary is past ``--canary-max-duration-s``:
        then a rollback (a `Verdict`; logged as an ERROR), so an input the evidence cannot read
        never keeps a canary served, untested, past its limits."""
        from rlrec.trainer.sequential import ArmStats, Verdict

        self._canary_failing_since = self._canary_failing_since or now
        failing, age = now - self._canary_failing_since, now - run.started
        if failing < run.rule.max_wait_s and age < run.rule.max_duration_s:
            log.warning("reading canary v%d's evidence failed (%s); looking again later", run.version, error)
            return None
        log.error("reading canary v%d's evidence failed for %.0fs (%s): rolled back", run.version, failing, error)
        reason = f"its evidence could not be read for {failing:.0f}s ({type(error).__name__}: {error})"
        return Verdict("rollback", reason, ArmStats(), ArmStats(), None, None)

    def _resign_canary(self, run: Any) -> None:
        """Re-sign the running canary's ``canary.json`` when it was last signed
        `rlrec.trainer.canary.CANARY_RESIGN_S` ago or more (by wall-clock time): services refuse
        one older than their ``max_canary_age_s``, and a trainer that trains rarely (little
        data) checkpoints rarely."""
        from rlrec.trainer.canary import CANARY_RESIGN_S
        from rlrec.trainer.canary_publish import refresh_canary

        wall = time.time()
        if wall - self._canary_signed_at < CANARY_RESIGN_S:  # unsigned too: services check its time
            return
        self._check_lease()
        try:
            refresh_canary(
                self.publish_storage,
                run.version,
                self.signing_key,
                base_version=run.base_version,
                started=run.started,
                channel=self.cfg.publish_channel,
                sha256=run.sha256,
            )
            self._canary_signed_at = wall
        except OSError as e:
            log.error(
                "re-signing %s for canary v%d failed (%s); tried again at the next look", "canary.json", run.version, e
            )

    def _look_canary_idle(self) -> None:
        """Look at the running canary while no data arrives to train on; a decision goes to
        metrics.jsonl as a late line (the next checkpoint records it)."""
        if self.canary is None or self._pending:
            return
        decided = self.look_canary()
        if decided is None or self.metrics is None or self.last_record is None:
            return
        late = {k: self.last_record.get(k) for k in ("iteration", "timesteps_trained", "shards_total")}
        late.update({"policy_version": self.policy_version, "time": round(time.time(), 3), "shards_new": 0})
        self.metrics.write({**late, "late": True, "canary": decided})

    def _log_canary(self, record: dict) -> None:
        from rlrec.trainer.sequential import NO_TRAFFIC

        level = logging.ERROR if NO_TRAFFIC in record["reason"] else logging.WARNING
        if record["decision"] == "promote":
            level = logging.INFO
        log.log(
            level,
            "canary v%d %s after %d canary and %d deployed episodes: %s (canary - deployed %s, bound [%s, %s]); "
            "v%d is deployed",
            record["canary_version"],
            "PROMOTED" if record["decision"] == "promote" else "ROLLED BACK",
            record["episodes_canary"],
            record["episodes_deployed"],
            record["reason"],
            "-" if record["difference"] is None else f"{record['difference']:.4g}",
            "-" if record["low"] is None else f"{record['low']:.4g}",
            "-" if record["high"] is None else f"{record['high']:.4g}",
            record["deployed_version"],
        )

    def _restore_canary(self, doc: Any, path: str, decision: Any = None) -> None:
        """The checkpoint's running canary, continued (the same test) while its publication is
        pending or ``canary.json`` names it (or cannot be read now). A decision taken before the
        kill -- the checkpoint's `decision`, or the signed ``rollout.json`` the trainer writes
        before carrying one out -- is carried out unchanged at the next look, never judged again.
        One whose decision was carried out (its signed ``canary-ended.json``) and whose pointer is
        gone is over."""
        if not doc:
            return
        from rlrec.trainer.canary_publish import _ended, read_decision, read_pointer
        from rlrec.trainer.policy import CANARY, PolicyLoadError, version_dir
        from rlrec.trainer.rollout import CanaryRun

        run = CanaryRun.from_state(doc)
        pending = any(p.version == run.version for p in self._pending)
        if not pending and not isinstance(decision, dict):
            decision = read_decision(self.publish_storage, run.version, self.signing_key)  # OSError: resume fails
            if decision is not None and decision.get("base_version") != run.base_version:
                log.error(
                    "%s/rollout.json decides a canary above v%s, not this one (above v%d): ignored",
                    version_dir(run.version),
                    decision.get("base_version"),
                    run.base_version,
                )
                decision = None
            elif decision is not None and run.sha256 is not None and decision.get("sha256") != run.sha256:
                log.error(
                    "%s/rollout.json decides a version with policy.json sha256 %.12s, not this canary's %.12s: ignored",
                    version_dir(run.version),
                    decision.get("sha256"),
                    run.sha256,
                )
                decision = None
        try:
            pointer = read_pointer(self.publish_storage, CANARY)
        except (OSError, PolicyLoadError) as e:
            log.warning("cannot read %s at resume (%s): canary v%d is taken as running", CANARY, e, run.version)
            pointer = {"policy_version": run.version}
        named = pointer is not None and pointer["policy_version"] == run.version
        ended = _ended(self.publish_storage, version_dir(run.version), self.signing_key) is not None
        if isinstance(decision, dict) and not pending and (named or not ended):
            self.canary, self._canary_decision, self._canary_next_look = run, dict(decision), 0.0
            log.warning(
                "canary v%d was decided (%s) before the trainer stopped: carrying the decision out, not judging again",
                run.version,
                decision.get("decision"),
            )
            return
        if not pending and not named and not ended and pointer is None and self._own_canary_here(run):
            named = True  # its pointer was removed (not by a decision: none is recorded): rewritten at the refresh
            log.warning(
                "%s is missing under %s but canary v%d, undecided, is there: the same test continues and the pointer "
                "is rewritten",
                CANARY,
                self.publish_storage.uri(),
                run.version,
            )
        if pending or (named and not ended):
            self.canary = run
            log.info(
                "resumed canary v%d above v%d (started %.0fs ago, %d looks so far): the same test continues",
                run.version,
                run.base_version,
                time.time() - run.started,
                len(run.history),
            )
            return
        if ended:
            log.info("canary v%d was decided before checkpoint %s's run stopped: it is over", run.version, path)
            return
        log.warning(
            "canary v%d of checkpoint %s is neither named by %s under %s nor ended there (a signed %s): dropped "
            "unjudged; if it runs under another publish root, services there keep serving it",
            run.version,
            path,
            CANARY,
            self.publish_storage.uri(),
            "canary-ended.json",
        )

    def _own_canary_here(self, run: Any) -> bool:
        """Whether the publish root holds `run`'s version signed by this trainer's key for its
        channel, with the sha256 the run recorded (not another root's canary of that number)."""
        import hashlib

        from rlrec.trainer.export import _verified_spec
        from rlrec.trainer.policy import PolicyLoadError, version_dir
        from rlrec.trainer.signing import SignatureError

        if self.signing_key is None:
            return False
        try:
            spec_bytes, spec = _verified_spec(self.publish_storage, version_dir(run.version), self.signing_key)
        except (OSError, SignatureError, ValueError, PolicyLoadError):
            return False
        sha = hashlib.sha256(spec_bytes).hexdigest()
        return spec.get("channel") == self.cfg.publish_channel and (run.sha256 is None or sha == run.sha256)

    def _promote_env(self, version: int, artifact: Any) -> bool:
        """The simulator gate: evaluate the candidate `artifact` in --env; True if it is not worse
        than the deployed version (the decision is `last_promotion`)."""
        from rlrec.trainer.promotion import decide, evaluate_exported

        self._progress()  # evaluating a candidate in the simulator: its episodes are not a stall
        if self.cfg.multi_agent:
            return self._promote_multi_agent_env(version, artifact)
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

    def _promote_multi_agent_env(self, version: int, artifact: Any) -> bool:
        """The simulator gate of a multi-module candidate: each agent of the multi-agent --env
        played by its module (`rlrec.trainer.multi_agent_env`); decided on what
        --promotion-return names by the single-agent gate's rule, the per-module returns recorded.
        An agent the start-up check could not see that does not fit, or a summed return that
        cannot judge (a zero-sum env), refuses the candidate in one line."""
        from rlrec.trainer.multi_agent_env import (
            EnvSpecError,
            candidate_policy,
            check_agent,
            evaluate_modules,
            gate_verdict,
            make_env,
        )

        t0 = time.time()
        cfg = self.cfg
        try:
            policy = candidate_policy(artifact, version)
            env = make_env(cfg.env, cfg.env_config)
            try:
                returns = evaluate_modules(
                    policy,
                    env,
                    cfg.promotion_episodes,
                    seed=cfg.seed or 0,
                    check=lambda a: check_agent(env, cfg.env, a, self.modules.agents, self.modules.spaces),
                    progress=self._progress,
                )
            finally:
                env.close()
        except EnvSpecError as e:
            log.error("promotion gate refused candidate v%d: the env does not fit the stored modules: %s", version, e)
            return False
        except Exception as e:
            log.error("evaluating candidate v%d failed (%s): not promoted", version, e)
            return False
        self.last_promotion = gate_verdict(
            returns, cfg.promotion_return, version, self.policy_version or None, self.deployed_return, time.time() - t0
        )
        return self.last_promotion["promoted"]
