"""Per-partition episode assembly: events in offset order in, finished episodes and dead letters out.

Pure logic (no Kafka, no storage), so every rule below is unit-testable. One `PartitionAssembler`
per assigned partition. For an event of episode E at offset o:

  E committed (in a committed shard)  o <= the shard's last offset: replay, skipped silently;
                                      later: a reward is `late-reward` (dead-lettered), anything
                                      else a duplicate (dropped, counted).
  E finished, not yet written         reward: applied; step/start/abort: duplicate or dead letter.
  E open                              step t0 == t: applied (terminal steps finish it);
                                      t0 < t, fully seen: duplicate; t0 < t overlapping:
                                      `backwards-t`; t0 > t: `gap`; abort: finishes it truncated;
                                      identical start: duplicate, different start: `duplicate-start`.
  E unknown                           start: opens it; anything else: `unknown-episode` (or the
                                      reason E was evicted with, e.g. `capacity`).

The offset that may be committed to Kafka for the partition is `safe_offset()`: never past the
start of an episode that is not yet in a committed shard.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlrec.producer.events import (
    DecodeError,
    EpisodeAbort,
    EpisodeStart,
    RewardDelta,
    StepBatch,
    check_leaves,
    encode,
)
from rlrec.producer.spaces import space_leaves
from rlrec.store.finished import FinishedEpisode

__all__ = ["CONSUMER_REASONS", "AssemblyConfig", "Counters", "DeadLetter", "OpenEpisode", "PartitionAssembler"]

#: dead-letter reasons decided by assembly (decode reasons come from rlrec.producer.events.DECODE_REASONS).
CONSUMER_REASONS = {
    "unknown-episode": "a step, reward or abort for an episode this partition never started",
    "duplicate-start": "a start, different from the first, for an episode that is open or finished",
    "gap": "a step batch whose t0 is past the episode's next step (events were lost)",
    "backwards-t": "a step batch overlapping steps already applied, with different content",
    "step-after-end": "a step for an episode that already ended",
    "bad-reward-t": "a delayed reward for a step the episode does not have",
    "late-reward": "a delayed reward for an episode already in a committed shard",
    "extra-mismatch": "a step batch whose extra_model_outputs keys differ from the episode's first batch",
    "empty-episode": "an episode aborted (or timed out) before its first step",
    "timeout": "an open episode idle for episode_timeout_s (with on_timeout='dead-letter')",
    "capacity": "an open episode evicted because max_open_episodes was reached",
}


@dataclass
class DeadLetter:
    """A message (or a re-encoded evicted episode's event) bound for the dead-letter topic."""

    reason: str
    detail: str
    offset: int
    key: bytes | None = None
    value: bytes | None = None
    headers: list[tuple[str, bytes]] | None = None


@dataclass
class AssemblyConfig:
    reward_join_window_s: float = 0.0
    episode_timeout_s: float = 600.0
    on_timeout: str = "truncate"  # or "dead-letter"


@dataclass
class Counters:
    events: int = 0
    duplicates: int = 0
    replay_skipped: int = 0
    rewards_applied: int = 0
    episodes_finished: int = 0
    timeouts: int = 0
    evicted: int = 0


@dataclass
class OpenEpisode:
    start: EpisodeStart
    first_offset: int
    start_hash: bytes
    batches: list[StepBatch] = field(default_factory=list)
    rewards_later: list[RewardDelta] = field(default_factory=list)  # for steps already applied
    t: int = 0
    last_offset: int = 0
    last_event_at: float = 0.0
    extra_keys: frozenset | None = None
    nbytes: int = 0


def _batch_nbytes(b: StepBatch) -> int:
    n = b.rewards.nbytes + sum(a.nbytes for a in b.actions) + sum(a.nbytes for a in b.observations)
    return n + sum(a.nbytes for a in b.extra_model_outputs.values()) + 200


class PartitionAssembler:
    """Applies one partition's events in offset order.

    Guarantees: an episode is handed out (`take_ready`) at most once and only when complete;
    every event it cannot use becomes a `DeadLetter` with a reason; `safe_offset` never passes
    the first event of an episode not handed out and confirmed committed (`mark_committed`).
    """

    def __init__(
        self, topic: str, partition: int, committed: dict[str, int] | None = None, config: AssemblyConfig | None = None
    ):
        self.topic = topic
        self.partition = partition
        self.config = config or AssemblyConfig()
        #: episode id -> last offset of the committed shard entry that holds it
        self.committed: dict[str, int] = dict(committed or {})
        self.open: dict[str, OpenEpisode] = {}
        self.finished: dict[str, FinishedEpisode] = {}  # in finish order
        self.in_flight: dict[str, FinishedEpisode] = {}  # handed out, commit not yet confirmed
        self.evicted: dict[str, str] = {}  # episode id -> reason, bounded
        self.next_offset: int | None = None
        self.counters = Counters()
        self.finished_bytes = 0

    # -- events -------------------------------------------------------------------------------

    def apply(self, offset: int, event: Any, now: float | None = None) -> list[DeadLetter]:
        """Apply one decoded event at `offset`. Returns dead letters (without raw bytes: the caller
        attaches the original message)."""
        now = time.time() if now is None else now
        self.next_offset = offset + 1
        self.counters.events += 1
        eid = event.episode_id

        last = self.committed.get(eid)
        if last is not None:
            if offset <= last:
                self.counters.replay_skipped += 1
            elif isinstance(event, RewardDelta):
                return [DeadLetter("late-reward", f"episode {eid} is already committed", offset)]
            else:
                self.counters.duplicates += 1
            return []

        if isinstance(event, EpisodeStart):
            return self._on_start(offset, event, now)

        ep = self.open.get(eid)
        if ep is not None:
            ep.last_event_at = now
            if isinstance(event, StepBatch):
                return self._on_steps(ep, offset, event, now)
            if isinstance(event, RewardDelta):
                if event.t >= ep.t:
                    return [
                        DeadLetter("bad-reward-t", f"episode {eid} has {ep.t} steps; reward for t={event.t}", offset)
                    ]
                ep.rewards_later.append(event)
                ep.last_offset = offset
                self.counters.rewards_applied += 1
                return []
            if isinstance(event, EpisodeAbort):
                ep.last_offset = offset
                return self._finish(ep, terminated=False, truncated=True, ended_ms=event.timestamp_ms, now=now)
            raise TypeError(type(event))

        fe = self.finished.get(eid) or self.in_flight.get(eid)
        if fe is not None:
            if isinstance(event, RewardDelta):
                if eid in self.in_flight:  # being written right now: too late for this shard
                    return [DeadLetter("late-reward", f"episode {eid} is being committed", offset)]
                if event.t >= fe.length:
                    return [
                        DeadLetter(
                            "bad-reward-t", f"episode {eid} has {fe.length} steps; reward for t={event.t}", offset
                        )
                    ]
                fe.rewards[event.t] += event.reward
                fe.last_offset = offset
                self.counters.rewards_applied += 1
                return []
            if isinstance(event, StepBatch) and event.t0 >= fe.length:
                return [
                    DeadLetter("step-after-end", f"episode {eid} ended after {fe.length} steps; t0={event.t0}", offset)
                ]
            self.counters.duplicates += 1
            return []

        reason = self.evicted.get(eid, "unknown-episode")
        return [DeadLetter(reason, f"{type(event).__name__} for episode {eid} not open on this partition", offset)]

    def _on_start(self, offset: int, ev: EpisodeStart, now: float) -> list[DeadLetter]:
        h = _start_hash(ev)
        ep = self.open.get(ev.episode_id)
        if ep is not None or ev.episode_id in self.finished or ev.episode_id in self.in_flight:
            same = ep.start_hash == h if ep is not None else True
            if same:
                self.counters.duplicates += 1
                return []
            return [
                DeadLetter("duplicate-start", f"episode {ev.episode_id} is already open with a different start", offset)
            ]
        self.evicted.pop(ev.episode_id, None)
        self.open[ev.episode_id] = OpenEpisode(
            ev, offset, h, last_offset=offset, last_event_at=now, nbytes=sum(a.nbytes for a in ev.observation) + 1000
        )
        return []

    def _on_steps(self, ep: OpenEpisode, offset: int, b: StepBatch, now: float) -> list[DeadLetter]:
        eid = ep.start.episode_id
        if b.t0 > ep.t:
            return [DeadLetter("gap", f"episode {eid} expects t={ep.t}, got t0={b.t0}", offset)]
        if b.t0 < ep.t:
            if b.t0 + b.n <= ep.t:
                self.counters.duplicates += 1
                return []
            return [
                DeadLetter("backwards-t", f"episode {eid} at t={ep.t}, batch covers {b.t0}..{b.t0 + b.n - 1}", offset)
            ]
        obs_leaves = _leaves(ep.start.observation_space)
        act_leaves = _leaves(ep.start.action_space)
        try:
            check_leaves(b.observations, obs_leaves, b.n, "observations")
            check_leaves(b.actions, act_leaves, b.n, "actions")
        except DecodeError as e:
            return [DeadLetter(e.reason, e.detail, offset)]
        keys = frozenset(b.extra_model_outputs)
        if ep.extra_keys is None:
            ep.extra_keys = keys
        elif keys != ep.extra_keys:
            return [
                DeadLetter("extra-mismatch", f"episode {eid}: keys {sorted(keys)} != {sorted(ep.extra_keys)}", offset)
            ]
        ep.batches.append(b)
        ep.t += b.n
        ep.last_offset = offset
        ep.nbytes += _batch_nbytes(b)
        if b.terminated or b.truncated:
            return self._finish(ep, terminated=b.terminated, truncated=b.truncated, ended_ms=b.timestamp_ms, now=now)
        return []

    def _finish(
        self, ep: OpenEpisode, *, terminated: bool, truncated: bool, ended_ms: int, now: float, reason: str = "aborted"
    ) -> list[DeadLetter]:
        eid = ep.start.episode_id
        del self.open[eid]
        if ep.t == 0:
            return self._dead_letter_episode(
                ep, "empty-episode", f"episode {eid} ended ({reason}) before its first step"
            )
        fe = _build(ep, terminated, truncated, ended_ms, now)
        self.finished[eid] = fe
        self.finished_bytes += fe.nbytes()
        self.counters.episodes_finished += 1
        return []

    # -- time-driven --------------------------------------------------------------------------

    def expire(self, now: float | None = None) -> list[DeadLetter]:
        """Finalize (truncated) or dead-letter open episodes idle for episode_timeout_s."""
        now = time.time() if now is None else now
        limit = now - self.config.episode_timeout_s
        out: list[DeadLetter] = []
        for ep in [e for e in self.open.values() if e.last_event_at <= limit]:
            self.counters.timeouts += 1
            if self.config.on_timeout == "dead-letter":
                del self.open[ep.start.episode_id]
                out += self._dead_letter_episode(ep, "timeout", f"no event for {self.config.episode_timeout_s}s")
            else:
                last_ms = ep.batches[-1].timestamp_ms if ep.batches else ep.start.timestamp_ms
                out += self._finish(ep, terminated=False, truncated=True, ended_ms=last_ms, now=now, reason="timeout")
        return out

    def evict(self, eid: str, reason: str = "capacity", truncate: bool = False) -> list[DeadLetter]:
        """Remove an open episode to bound memory: dead-letter its events, or finish it truncated."""
        ep = self.open[eid]
        self.counters.evicted += 1
        if truncate:
            last_ms = ep.batches[-1].timestamp_ms if ep.batches else ep.start.timestamp_ms
            return self._finish(ep, terminated=False, truncated=True, ended_ms=last_ms, now=time.time(), reason=reason)
        del self.open[eid]
        return self._dead_letter_episode(ep, reason, f"evicted: {reason}")

    def _dead_letter_episode(self, ep: OpenEpisode, reason: str, detail: str) -> list[DeadLetter]:
        """Re-encode everything received for `ep` as dead letters, so nothing vanishes."""
        eid = ep.start.episode_id
        self.evicted[eid] = reason
        if len(self.evicted) > 100_000:
            for k in list(self.evicted)[:50_000]:
                del self.evicted[k]
        out = []
        for ev in [ep.start, *ep.batches, *ep.rewards_later]:
            value, headers = encode(ev)
            out.append(DeadLetter(reason, detail, ep.first_offset, eid.encode(), value, headers))
        return out

    # -- hand-off to the writer ---------------------------------------------------------------

    def ready(self, now: float | None = None, force: bool = False) -> list[FinishedEpisode]:
        """Finished episodes past the reward join window (all of them with `force`)."""
        now = time.time() if now is None else now
        limit = now - self.config.reward_join_window_s
        return [fe for fe in self.finished.values() if force or fe.finished_at <= limit]

    def hand_out(self, episodes: Iterable[FinishedEpisode]) -> None:
        """The writer takes these: no more rewards are applied to them."""
        for fe in episodes:
            self.finished_bytes -= fe.nbytes()
            self.in_flight[fe.episode_id] = self.finished.pop(fe.episode_id)

    def mark_committed(self, episodes: Iterable[FinishedEpisode], entry_last_offset: int) -> None:
        for fe in episodes:
            self.in_flight.pop(fe.episode_id, None)
            self.committed[fe.episode_id] = entry_last_offset

    def give_back(self, episodes: Iterable[FinishedEpisode]) -> None:
        """A write failed: the episodes wait for the next attempt (rewards apply again)."""
        for fe in episodes:
            if self.in_flight.pop(fe.episode_id, None) is not None:
                self.finished[fe.episode_id] = fe
                self.finished_bytes += fe.nbytes()

    def safe_offset(self) -> int | None:
        """The offset the consumer group may commit for this partition (None: nothing seen)."""
        firsts = [ep.first_offset for ep in self.open.values()]
        firsts += [fe.first_offset for fe in self.finished.values()]
        firsts += [fe.first_offset for fe in self.in_flight.values()]
        if firsts:
            return min(firsts)
        return self.next_offset


# ---------------------------------------------------------------------------------------------


_leaf_cache: dict[int, tuple] = {}


def _leaves(space: Any) -> tuple:
    key = id(space)
    hit = _leaf_cache.get(key)
    if hit is None or hit[0] is not space:
        hit = (space, tuple(space_leaves(space)))
        if len(_leaf_cache) > 1024:
            _leaf_cache.clear()
        _leaf_cache[key] = hit
    return hit[1]


def _start_hash(ev: EpisodeStart) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{ev.policy_id}\0{ev.policy_version}\0{ev.env_id}\0".encode())
    for a in ev.observation:
        h.update(a.tobytes())
    return h.digest()


def _build(ep: OpenEpisode, terminated: bool, truncated: bool, ended_ms: int, now: float) -> FinishedEpisode:
    s = ep.start
    batches = ep.batches
    observations = [
        np.concatenate([s.observation[i][None], *(b.observations[i] for b in batches)])
        for i in range(len(s.observation))
    ]
    actions = [np.concatenate([b.actions[i] for b in batches]) for i in range(len(batches[0].actions))]
    rewards = np.concatenate([b.rewards for b in batches]).astype(np.float64, copy=True)
    for r in ep.rewards_later:
        rewards[r.t] += r.reward
    infos: list[dict] = [s.info]
    for b in batches:
        infos.extend(b.infos if b.infos is not None else ({} for _ in range(b.n)))
    extra = {k: np.concatenate([b.extra_model_outputs[k] for b in batches]) for k in (ep.extra_keys or ())}
    return FinishedEpisode(
        episode_id=s.episode_id,
        policy_id=s.policy_id,
        policy_version=s.policy_version,
        env_id=s.env_id,
        observation_space=s.observation_space,
        action_space=s.action_space,
        observations=observations,
        actions=actions,
        rewards=rewards,
        infos=infos,
        extra_model_outputs=extra,
        terminated=terminated,
        truncated=truncated,
        first_offset=ep.first_offset,
        last_offset=ep.last_offset,
        started_ms=s.timestamp_ms,
        ended_ms=ended_ms,
        finished_at=now,
    )
