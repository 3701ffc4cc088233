"""A chaos-run producer process: publishes a mix of episodes and logs their ground truth.

    python -m tests.chaos.producer --bootstrap-servers B --topic T --index I --episodes N \
        --seed S --duration D --truth PATH --stats PATH [--hold PATH]

Episodes start evenly over `duration` seconds; up to 6 are open at once and advance at random
speeds (a few slow ones stay open for many seconds, across kills and rebalances). The mix: mostly
terminated/truncated episodes of 1..400 steps (several step batches each when long), ~10% aborted
after at least one step, ~2% aborted before their first step ("empty"), ~20% with delayed
rewards (during the episode, and after it ended - some after the consumer's reward join window),
~10% with duplicate sends (the start, a step batch mid-episode, the whole episode at its end, the
abort).

Duplicates go through a second idempotent producer after `recorder.flush()` confirmed that the
originals were delivered: same key, so same partition, later offsets - what a producer that
retries or replays without idempotence would cause. Rewards are never sent twice: a RewardDelta
adds, and the product does not promise to deduplicate it (docs/GUARANTEES.md §8).

While the file `--hold` exists the producer holds: everything it sent is delivered, nothing is
in flight, it writes `{hold}.{index}` and waits. The controller restarts the broker only then:
Tansu 0.6 does not keep idempotent-producer state across a restart, so a produce request in
flight at the restart, retried afterwards, ends in OUT_OF_ORDER_SEQUENCE_NUMBER - a fatal
error for an idempotent producer (seen in a chaos run; a Tansu limit, not the recorder's).

Exit code 0 only if every message was delivered (the ground truth is then what the broker has).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from confluent_kafka import Producer

from rlrec.producer import EpisodeRecorder
from rlrec.producer.events import EpisodeAbort, EpisodeStart, StepBatch, encode
from tests.chaos.truth import TruthEpisode
from tests.helpers import ACT_SPACE, OBS_SPACE

ENV_ID = "chaos-env"
MAX_OPEN = 6
MAX_SLOW = 2


@dataclass
class _Live:
    """An episode being produced, with its plan and what was logged so far."""

    eid: str
    kind: str
    length: int  # steps to log (before the abort, for aborted episodes)
    speed: float  # probability of advancing per loop
    dup: bool
    with_infos: bool
    policy_version: int
    observations: list = field(default_factory=list)
    actions: list = field(default_factory=list)
    rewards: list = field(default_factory=list)
    infos: list = field(default_factory=list)
    logp: list = field(default_factory=list)
    vf: list = field(default_factory=list)
    dup_mid_at: int = -1  # after this step, re-send a few steps
    reward_during_at: int = -1  # after this step, a delayed reward for an earlier step
    delayed: list = field(default_factory=list)  # (t, delta) - decided as they are logged
    used_t: set = field(default_factory=set)
    pending: int = 0  # delayed rewards scheduled but not sent yet
    ended: bool = False
    terminated: bool = False
    truncated: bool = False
    dup_messages: int = 0

    @property
    def t(self) -> int:
        return len(self.actions)


class ChaosProducer:
    """Publishes `episodes` episodes over `duration` seconds and writes their ground truth.

    Guarantees: every episode whose line is in the truth file had all its events (and its
    delayed rewards) handed to the recorder before the line was written; `run()` returns 0 only
    if the recorder and the duplicate producer delivered every message.
    """

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = np.random.default_rng(args.seed)
        self.errors: list[str] = []
        self.rec = EpisodeRecorder(
            args.bootstrap_servers,
            topic=args.topic,
            policy_id=f"chaos-pol-{args.index % 2}",
            observation_space=OBS_SPACE,
            action_space=ACT_SPACE,
            env_id=ENV_ID,
            max_batch_steps=32,
            kafka_config={"linger.ms": 100},  # fewer, larger produce requests: each is an S3 object for Tansu
            on_delivery_error=lambda err, key, n: self.errors.append(f"{key}: {err}"),
        )
        self.raw = Producer(
            {"bootstrap.servers": args.bootstrap_servers, "enable.idempotence": True, "acks": "all", "linger.ms": 5}
        )
        self.dup_messages = 0
        self.live: dict[str, _Live] = {}
        self.rewards_due: list[tuple[float, int, str, int, float]] = []
        self._seq = 0
        self.truth_file = open(args.truth, "a", encoding="utf-8")
        self.written = 0

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        a, rng = self.args, self.rng
        t_start = time.monotonic()
        started = 0
        bump_every = max(1, a.episodes // 3)
        while started < a.episodes or self.live or self.rewards_due:
            now = time.monotonic()
            if (
                started < a.episodes
                and len(self.live) < MAX_OPEN
                and now >= t_start + a.duration * started / a.episodes
            ):
                if started and started % bump_every == 0:
                    self.rec.policy_version = self.rec.policy_version + 1
                self._begin()
                started += 1
            for ep in list(self.live.values()):
                if not ep.ended and rng.random() < ep.speed:
                    for _ in range(int(rng.integers(1, 4))):
                        if ep.ended:
                            break
                        self._step(ep)
            while self.rewards_due and self.rewards_due[0][0] <= now:
                _, _, eid, t, delta = heapq.heappop(self.rewards_due)
                self.rec.log_reward(eid, t, delta)
                self.live[eid].pending -= 1
            for ep in [e for e in self.live.values() if e.ended and e.pending == 0]:
                self._write_truth(ep)
            if a.hold and os.path.exists(a.hold):
                self._hold()
            time.sleep(0.01)
        return self._finish()

    def _hold(self) -> None:
        self._confirm_sent()
        if self.raw.flush(300):
            raise RuntimeError("duplicate producer could not deliver in 300 s")
        held = f"{self.args.hold}.{self.args.index}"
        open(held, "w").close()
        while os.path.exists(self.args.hold):
            time.sleep(0.05)
        os.unlink(held)

    def _finish(self) -> int:
        left = self.rec.flush(300)
        left_raw = self.raw.flush(300)
        stats = self.rec.stats
        self.rec.close(30)
        self.truth_file.close()
        ok = left == 0 and left_raw == 0 and stats.failed == 0 and stats.dropped == 0 and not self.errors
        with open(self.args.stats, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "index": self.args.index,
                    "episodes": self.written,
                    "messages": stats.messages_delivered + self.dup_messages,
                    "duplicate_messages": self.dup_messages,
                    "failed": stats.failed,
                    "dropped": stats.dropped,
                    "undelivered": left + left_raw,
                    "errors": self.errors[:20],
                    "ok": ok,
                },
                f,
            )
        return 0 if ok else 1

    # -- one episode --------------------------------------------------------------------------

    def _begin(self) -> None:
        rng = self.rng
        u = rng.random()
        kind = "empty" if u < 0.02 else "aborted" if u < 0.12 else "done"
        r = rng.random()
        length = int(rng.integers(1, 31) if r < 0.7 else rng.integers(31, 101) if r < 0.95 else rng.integers(101, 401))
        slow = sum(e.speed < 0.1 for e in self.live.values()) < MAX_SLOW and rng.random() < 0.05
        ep = _Live(
            "",
            kind,
            0 if kind == "empty" else length,
            0.03 if slow else float(rng.uniform(0.3, 1.0)),
            dup=rng.random() < 0.10,
            with_infos=rng.random() < 0.3,
            policy_version=self.rec.policy_version,
        )
        if ep.dup and ep.length >= 2:
            ep.dup_mid_at = int(rng.integers(0, ep.length - 1))
        if ep.length >= 20 and rng.random() < 0.4:
            ep.reward_during_at = int(rng.integers(17, ep.length))
        obs = rng.standard_normal(4).astype(np.float32)
        info = {"seed": int(rng.integers(1 << 30)), "producer": self.args.index} if ep.with_infos else None
        ep.eid = self.rec.begin_episode(obs, info=info)
        ep.observations.append(obs)
        ep.infos.append(info or {})
        self.live[ep.eid] = ep
        if ep.dup:
            self._confirm_sent()
            self._resend(
                ep,
                EpisodeStart(
                    ep.eid, self.rec.policy_id, ep.policy_version, [obs], OBS_SPACE, ACT_SPACE, ENV_ID, info or {}
                ),
            )
        if kind == "empty":
            self._end(ep, aborted=True)

    def _step(self, ep: _Live) -> None:
        rng = self.rng
        t = ep.t
        a = int(rng.integers(0, 2))
        r = float(rng.standard_normal())
        obs = rng.standard_normal(4).astype(np.float32)
        lp, vf = np.float32(-rng.random()), np.float32(rng.standard_normal())
        info = {"t": t, "tag": "x"} if ep.with_infos and t % 3 == 0 else None
        last = t == ep.length - 1
        term = last and ep.kind == "done" and rng.random() < 0.6
        trunc = last and ep.kind == "done" and not term
        self.rec.log_step(
            ep.eid,
            a,
            r,
            obs,
            terminated=term,
            truncated=trunc,
            info=info,
            extra_model_outputs={"action_logp": lp, "vf_preds": vf},
        )
        ep.actions.append(a)
        ep.rewards.append(r)
        ep.observations.append(obs)
        ep.infos.append(info or {})
        ep.logp.append(lp)
        ep.vf.append(vf)
        if t == ep.reward_during_at:  # a delayed reward for an earlier step of an open episode
            self._delay(ep, int(rng.integers(0, t)), due=0.0)
        if t == ep.dup_mid_at:
            self._confirm_sent()
            self._resend(ep, self._batch(ep, max(0, ep.t - int(rng.integers(1, 5))), ep.t, False, False))
        if last:
            ep.terminated, ep.truncated = term, trunc
            self._end(ep, aborted=ep.kind == "aborted")

    def _end(self, ep: _Live, aborted: bool) -> None:
        rng = self.rng
        ep.ended = True
        if aborted:
            self.rec.abort_episode(ep.eid, "chaos")
            ep.terminated, ep.truncated = False, True
        if ep.dup:
            self._confirm_sent()
            if aborted:
                self._resend(ep, EpisodeAbort(ep.eid, "chaos"))
            elif ep.t:
                self._resend(ep, self._batch(ep, 0, ep.t, ep.terminated, ep.truncated))
        if ep.t and rng.random() < 0.15:  # delayed rewards after the end
            for _ in range(int(rng.integers(1, 3))):
                late = rng.random() < 0.2  # after the consumer's join window: may be dead-lettered
                self._delay(
                    ep, int(rng.integers(0, ep.t)), due=float(rng.uniform(2.5, 6.0) if late else rng.uniform(0, 1.2))
                )

    def _delay(self, ep: _Live, t: int, due: float) -> None:
        if t in ep.used_t:  # one delayed reward per step: the checker knows the float64 sum exactly
            return
        ep.used_t.add(t)
        delta = float(np.round(self.rng.uniform(0.1, 2.0), 3)) * (1 if self.rng.random() < 0.5 else -1)
        ep.delayed.append((t, delta))
        ep.pending += 1
        self._seq += 1
        heapq.heappush(self.rewards_due, (time.monotonic() + due, self._seq, ep.eid, t, delta))

    # -- duplicates ---------------------------------------------------------------------------

    def _confirm_sent(self) -> None:
        """Wait until the recorder delivered everything so far (originals before duplicates)."""
        left = self.rec.flush(300)
        if left:
            raise RuntimeError(f"recorder could not deliver {left} messages in 300 s")

    def _batch(self, ep: _Live, t0: int, t1: int, term: bool, trunc: bool) -> StepBatch:
        return StepBatch(
            ep.eid,
            t0,
            [np.asarray(ep.actions[t0:t1], np.int64)],
            np.asarray(ep.rewards[t0:t1], np.float64),
            [np.stack(ep.observations[t0 + 1 : t1 + 1])],
            term,
            trunc,
            ep.infos[t0 + 1 : t1 + 1],
            {"action_logp": np.asarray(ep.logp[t0:t1], np.float32), "vf_preds": np.asarray(ep.vf[t0:t1], np.float32)},
        )

    def _resend(self, ep: _Live, event) -> None:
        value, headers = encode(event)
        self.raw.produce(self.args.topic, value, ep.eid.encode(), headers=headers, on_delivery=self._on_dup)
        self.raw.poll(0)
        self.dup_messages += 1
        ep.dup_messages += 1

    def _on_dup(self, err, msg) -> None:
        if err is not None:
            self.errors.append(f"duplicate send failed: {err}")

    # -- ground truth -------------------------------------------------------------------------

    def _write_truth(self, ep: _Live) -> None:
        del self.live[ep.eid]
        truth = TruthEpisode(
            ep.eid,
            self.rec.policy_id,
            ep.policy_version,
            ENV_ID,
            ep.kind,
            np.stack(ep.observations),
            np.asarray(ep.actions, np.int64),
            np.asarray(ep.rewards, np.float64),
            ep.terminated,
            ep.truncated,
            ep.infos,
            {}
            if not ep.t
            else {"action_logp": np.asarray(ep.logp, np.float32), "vf_preds": np.asarray(ep.vf, np.float32)},
            sorted(ep.delayed),
            ep.dup_messages,
        )
        self.truth_file.write(truth.to_json() + "\n")
        self.truth_file.flush()
        self.written += 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bootstrap-servers", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--episodes", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--truth", required=True)
    p.add_argument("--stats", required=True)
    p.add_argument("--hold", default=None, help="while this file exists: deliver everything, then wait")
    return ChaosProducer(p.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
