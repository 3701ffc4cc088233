"""The trainer's running canary: its identity, its test, and what it has seen so far.

A `CanaryRun` is created when a gated candidate goes on canary (``rlrec train --rollout
canary``), saved in every checkpoint (`to_state`), and restored by ``--resume``
(`from_state`), so a trainer killed mid-canary continues the same test: the same start, the
same rule and the same evidence (re-read from the committed shards since the start), never a
fresh test that peeks again. `look` reads the new evidence and judges it
(`rlrec.trainer.sequential.judge`); the trainer carries out a decision
(`rlrec.trainer.canary_publish.end_canary`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

from rlrec.trainer.canary import SHARE_MAX
from rlrec.trainer.canary_evidence import MIN_HISTORY
from rlrec.trainer.sequential import EPISODE_MAX_S_FLOOR, NO_TRAFFIC, CanaryRule, Verdict, judge

log = logging.getLogger("rlrec.trainer")

__all__ = ["MAX_HISTORY", "CanaryRun", "gate_declined"]

#: the most looks kept for the report's plot (older ones are thinned out)
MAX_HISTORY = 500


@dataclass
class CanaryRun:
    """One canary: `version` on trial above `base_version` since `started` (UNIX time).

    Example:
        >>> run = CanaryRun(version=5, base_version=4, started=0.0, gamma=0.99, rule=CanaryRule())
        >>> CanaryRun.from_state(run.to_state()) == run
        True
    """

    version: int
    base_version: int
    started: float
    gamma: float
    rule: CanaryRule
    candidate_return: float | None = None  # the gate's estimate (deployed_return once promoted)
    sha256: str | None = None  # of the canary's policy.json: the identity its episodes log
    history: list[dict] = field(default_factory=list)
    canary_grew: float | None = None  # when a look last found more canary episodes (UNIX time)
    cohort_furthest: float | None = None  # the furthest cohort end a look found (UNIX ms)
    cohort_moved: float | None = None  # when a look last found it further (UNIX time)
    _evidence: Any = field(default=None, repr=False, compare=False)
    _warned_long: bool = field(default=False, repr=False, compare=False)
    _warned_share: bool = field(default=False, repr=False, compare=False)
    _warned_range: bool = field(default=False, repr=False, compare=False)

    def to_state(self) -> dict:
        """JSON-able (the trainer checkpoint's ``canary``)."""
        return {
            "version": self.version,
            "base_version": self.base_version,
            "started": self.started,
            "gamma": self.gamma,
            "rule": self.rule.to_dict(),
            "candidate_return": self.candidate_return,
            "history": list(self.history),
            "canary_grew": self.canary_grew,
            "sha256": self.sha256,
            "cohort_furthest": self.cohort_furthest,
            "cohort_moved": self.cohort_moved,
        }

    @classmethod
    def from_state(cls, doc: dict) -> CanaryRun:
        """The run a checkpoint saved. Raises ValueError on a malformed record."""
        try:
            return cls(
                version=int(doc["version"]),
                base_version=int(doc["base_version"]),
                started=float(doc["started"]),
                gamma=float(doc["gamma"]),
                rule=CanaryRule(**doc["rule"]),
                candidate_return=None if doc.get("candidate_return") is None else float(doc["candidate_return"]),
                history=[h for h in doc.get("history") or [] if isinstance(h, dict)][-MAX_HISTORY:],
                canary_grew=None if doc.get("canary_grew") is None else float(doc["canary_grew"]),
                sha256=None if doc.get("sha256") is None else str(doc["sha256"]),
                cohort_furthest=None if doc.get("cohort_furthest") is None else float(doc["cohort_furthest"]),
                cohort_moved=None if doc.get("cohort_moved") is None else float(doc["cohort_moved"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a malformed canary record in the checkpoint: {e}") from None

    def look(self, input_storage: Any, policy_id: str | None = None, now: float | None = None) -> Verdict:
        """Read the evidence committed since the last look and judge it; the look is kept in
        `history` (time, both arms' counts and means, the bound).

        Args:
            input_storage: the consumer's output root.
            policy_id: only episodes of this policy id.
            now: the time of the look (default: now).
        """
        from rlrec.trainer.canary_evidence import CanaryEvidence

        if self._evidence is None:
            self._evidence = CanaryEvidence(
                input_storage,
                version=self.version,
                base_version=self.base_version,
                started=self.started,
                gamma=self.gamma,
                policy_id=policy_id,
                share=self.rule.share,
                sha256=self.sha256,
            )
        if self.rule.episode_max_s is None:
            self._fix_episode_max()
        if not self.rule.has_range:
            self._fix_range()
        now = time.time() if now is None else now
        canary, deployed = self._evidence.refresh(
            self.rule.return_min,
            self.rule.return_max,
            now=now,
            episode_max_s=self.rule.episode_max_s,
            longest_cap_s=self.rule.max_duration_s,
        )
        if self._evidence.longest_s > self.rule.episode_max_s + 0.5 and not self._warned_long:
            self._warned_long = True
            log.warning(
                "canary v%d: an episode took %.1fs, longer than the stated --canary-episode-max-s %.1fs: the test "
                "now waits that long for each cohort (state a longer limit)",
                self.version,
                self._evidence.longest_s,
                self.rule.episode_max_s,
            )
        if self._evidence.misconfigured and not self._warned_share:
            self._warned_share = True
            log.warning(
                "canary v%d: %d assigned episodes come from services serving a canary_fraction outside the test's "
                "band and are no evidence: services must serve a canary_fraction between --canary-share %g and %g",
                self.version,
                self._evidence.misconfigured,
                self.rule.share,
                SHARE_MAX,
            )
        last = self.history[-1] if self.history else None
        if canary.n and (last is None or canary.n > last["n_canary"]):
            self.canary_grew = now
        # the limits count on the wall clock from the start (the wait from the stated cohort end),
        # never from the cohort the evidence allows: an episode's stated length cannot stall them
        age = max(0.0, now - self.started)
        elapsed = max(0.0, age - self.rule.episode_max_s)
        idle = elapsed if self.canary_grew is None else max(0.0, now - self.canary_grew)
        verdict = judge(canary, deployed, self.rule, elapsed, idle, age_s=age)
        verdict = self._rollback_early(verdict, now)
        if NO_TRAFFIC in verdict.reason and (self._evidence.unassigned or self._evidence.outside_share):
            verdict = replace(
                verdict,
                reason=f"{verdict.reason}; {self._evidence.unassigned} episodes of v{self.version}/v{self.base_version} "
                f"logged no assignment of this canary (merge Assignment.info into the reset info and record with its "
                f"episode_id) and {self._evidence.outside_share} lay outside the test's band (--canary-share "
                f"{self.rule.share:g}..{SHARE_MAX:g})",
            )
        served = self._evidence.served_canary
        below = self._evidence.below_outside
        if verdict.decision == "continue" and below and self.rule.has_range and not self._evidence.ended[1].below:
            verdict = replace(
                verdict,
                decision="rollback",
                reason=f"the canary returned below the test's range [{self.rule.return_min:.4g}, "
                f"{self.rule.return_max:.4g}] in {below} episodes served outside the test's band, and the deployed "
                "version never did",
            )
        if verdict.decision == "continue" and served >= self.rule.max_exposure:
            # the exposure counts every canary episode that ended, not only the complete cohort's
            verdict = replace(
                verdict,
                decision="rollback",
                reason=f"undecided after the maximum exposure of {self.rule.max_exposure} canary episodes "
                f"({served} ended, {canary.n} in the complete cohort)",
            )
        if last is None or (last["n_canary"], last["n_deployed"]) != (canary.n, deployed.n):
            self.history.append(
                {
                    "time": round(now, 3),
                    "n_canary": canary.n,
                    "n_deployed": deployed.n,
                    "mean_canary": canary.mean if canary.n else None,
                    "mean_deployed": deployed.mean if deployed.n else None,
                    "low": verdict.low,
                    "high": verdict.high,
                }
            )
            if len(self.history) > MAX_HISTORY:
                self.history = self.history[: MAX_HISTORY // 2 : 2] + self.history[MAX_HISTORY // 2 :]
        return verdict

    def _rollback_early(self, verdict: Verdict, now: float) -> Verdict:
        """A verdict to go on with becomes a rollback when every ended episode, in the complete
        cohort or not, already shows the canary worse (a wrong early rollback is the safe error),
        or when the cohort end has not moved for ``rule.max_wait_s`` (an episode that never ends,
        a partition whose consumer stopped writing: the test can never complete a cohort). A
        rollback for want of traffic while the ended episodes have it says the cohort is why."""
        end = self._evidence.cohort_end
        if end is not None and (self.cohort_furthest is None or end > self.cohort_furthest):
            self.cohort_furthest, self.cohort_moved = end, now
        ended = self._evidence.ended
        # the cohort, not the services, lacks episodes: both arms ended enough, the cohort holds too few
        cohort_short = min(verdict.canary.n, verdict.deployed.n) < self.rule.min_episodes <= min(a.n for a in ended)
        if verdict.decision == "promote" or (
            verdict.decision == "rollback" and not (NO_TRAFFIC in verdict.reason and cohort_short)
        ):
            return verdict
        if verdict.decision == "continue":
            # the bound's verdict only: the limits are the look's (exposure: `served_canary`)
            every = judge(*ended, replace(self.rule, max_exposure=2**62), 0.0, 0.0, age_s=0.0)
            if every.decision == "rollback":
                return replace(every, reason=f"{every.reason} (every ended episode, the complete cohort's not yet)")
        stuck = now - (self.cohort_moved if self.cohort_moved is not None else self.started)
        if stuck >= self.rule.max_wait_s or verdict.decision == "rollback":
            at = self.cohort_furthest
            at = "none" if at is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at / 1000))
            return replace(
                verdict,
                decision="rollback",
                reason=f"undecided: the complete cohort (episodes that started before {at}, which last moved "
                f"{stuck:.0f}s ago) holds {verdict.canary.n} canary and {verdict.deployed.n} deployed episodes of the "
                f"{ended[0].n} and {ended[1].n} that ended: an episode that started then is still open, or a "
                "partition's consumer stopped writing"
                + ("" if self._evidence.marks is None else self._evidence.holding(self._evidence.marks, now)),
            )
        return verdict

    def cohort_end(self, now: float) -> float:
        """The latest start (UNIX time) an episode counted at `now` may have, by the partitions'
        watermarks the last look read (`rlrec.trainer.canary_evidence.CanaryEvidence.
        cohort_end_ms`); before any look, the guess ``now - rule.episode_max_s``."""
        ev = self._evidence
        if ev is None or ev.marks is None:
            return now - (self.rule.episode_max_s or 0.0)
        return ev.cohort_end_ms(ev.marks, now, self.rule.episode_max_s or 0.0) / 1000.0

    def _fix_episode_max(self) -> None:
        """A test without a stated longest episode takes twice the longest of the episodes
        before the start (start to commit), at least `EPISODE_MAX_S_FLOOR` (fixed before any
        canary evidence is seen, kept in the checkpoint)."""
        longest = self._evidence.history_longest_s()
        self.rule = replace(self.rule, episode_max_s=round(max(EPISODE_MAX_S_FLOOR, 2.0 * longest), 3))
        log.warning(
            "canary v%d: episodes are taken to end and be committed within %.0fs of their start (twice the longest "
            "before its start, %.0fs, at least %.0fs): the test counts only episodes that started that long ago; "
            "state your episodes' time limit plus the consumer's commit delay with --canary-episode-max-s",
            self.version,
            self.rule.episode_max_s,
            longest,
            EPISODE_MAX_S_FLOOR,
        )

    def _fix_range(self) -> None:
        """A test without a stated return range takes one from the episodes before the start
        (fixed before any canary evidence is seen, kept in the checkpoint); without them it has
        no bound and is decided by its limits only."""
        found = self._evidence.history_range()
        if found is None:
            if self._warned_range:
                return
            self._warned_range = True
            log.error(
                "canary v%d: no return range (fewer than %d episodes before its start): its test has no bound and "
                "it can only be rolled back; state one with --canary-return-min/--canary-return-max",
                self.version,
                MIN_HISTORY,
            )
            return
        low, high, n = found
        if not (math.isfinite(low) and math.isfinite(high)):
            if not self._warned_range:
                self._warned_range = True
                log.error(
                    "canary v%d: the episodes before its start have a return range [%s, %s] that is not finite: its "
                    "test has no bound and it can only be rolled back; state one with --canary-return-min/"
                    "--canary-return-max",
                    self.version,
                    low,
                    high,
                )
            return
        self.rule = replace(self.rule, return_min=round(low, 6), return_max=round(high, 6))
        log.warning(
            "canary v%d: returns are taken to lie in [%.4g, %.4g] (from %d episodes before its start, widened); "
            "state the range with --canary-return-min/--canary-return-max",
            self.version,
            self.rule.return_min,
            self.rule.return_max,
            n,
        )

    def decision_record(self, verdict: Verdict, now: float | None = None) -> dict:
        """What a decision records (metrics.jsonl's ``canary``, the version's ``rollout.json``)."""
        now = time.time() if now is None else now
        return {
            "canary_version": self.version,
            "base_version": self.base_version,
            "started": self.started,
            "decided": round(now, 3),
            "gamma": self.gamma,
            "rule": self.rule.to_dict(),
            **verdict.to_dict(),
            **self.evidence_counts(),
        }

    def evidence_counts(self) -> dict:
        """Episodes read but not counted: without this canary's assignment (``unassigned``),
        outside the test's band (``outside_share``), with a stated length not trusted (``overlong``);
        and those read after a cohort taken as complete should have held them (``late``)."""
        ev = self._evidence
        keys = ("unassigned", "outside_share", "overlong", "late")
        return {k: getattr(ev, k, 0) if ev is not None else 0 for k in keys}


def gate_declined(decision: dict) -> bool:
    """Whether the offline gate's `decision` (`rlrec.trainer.ope_jobs.evaluate_candidate`)
    declined to judge the candidate -- no estimable difference, a gate verdict that does not
    hold, no held-out episodes yet -- rather than judged it worse (``--canary-unjudged`` puts
    the former on canary, never the latter; a failed evaluation is neither).

    A decision with a refusal code (``rlrec.trainer.ope_jobs.REFUSALS``) is decided by the code:
    declined when the code is not a judgement (``judged`` false), except ``failed``.

    Example:
        >>> gate_declined({"promoted": False, "refusal": {"code": "unjudgeable", "judged": False}})
        True
        >>> gate_declined({"promoted": False, "refusal": {"code": "worse", "judged": True}})
        False
        >>> gate_declined({"promoted": False, "estimable": True, "gate_verdict": {"ok": False}})
        True
        >>> gate_declined({"promoted": False, "estimable": True, "gate_verdict": {"ok": True}})
        False
    """
    if decision.get("promoted"):
        return False
    refusal = decision.get("refusal")
    if isinstance(refusal, dict) and "code" in refusal:
        return refusal.get("judged") is False and refusal.get("code") != "failed"
    if decision.get("estimable") is False:
        return True
    verdict = decision.get("gate_verdict")
    if isinstance(verdict, dict) and verdict.get("ok") is False:
        return True
    return decision.get("reason") == "no held-out episodes yet"
