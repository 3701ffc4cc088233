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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rlrec.consumer.multi_agent_assembly import MultiAgentAssembly, batch_nbytes
from rlrec.producer.bounded import OldestHalfDict
from rlrec.producer.events import (
    DecodeError,
    EpisodeAbort,
    EpisodeStart,
    RewardDelta,
    StepBatch,
    check_leaves,
    check_values,
    info_nbytes,
)
from rlrec.producer.multi_agent_events import MultiAgentEpisodeStart, MultiAgentStepBatch
from rlrec.producer.multi_agent_events import encode_event as encode
from rlrec.producer.spaces import Leaf, space_leaves, space_nbytes
from rlrec.store.finished import EMPTY_INFO, FinishedEpisode
from rlrec.store.multi_agent_finished import FinishedAgentRow

__all__ = [
    "CONSUMER_REASONS",
    "VALIDATE_SPACES",
    "AssemblyConfig",
    "CommittedEpisodes",
    "Counters",
    "DeadLetter",
    "OpenEpisode",
    "PartitionAssembler",
    "finished_events",
]

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
    "capacity": "an open episode evicted because max_open_episodes or max_open_bytes was reached",
    "partition-change": "part of an episode split across partitions when the topic's partition count changed",
    "episode-too-large": "an open episode over max_episode_bytes (with on_episode_too_large='dead-letter')",
    "unwritable": "a finished episode the shard format cannot encode (found when its shard was written)",
    "internal": "data that made rlrec's own code fail (the exception class is in the detail): a bug to report",
    "kind-mismatch": "a single-agent event for a multi-agent episode, or a multi-agent event for a single-agent one",
    "id-collision": "a multi-agent episode whose agent row id is the id of another episode read or committed",
}

#: --validate-spaces: what an event is checked against before it is applied
VALIDATE_SPACES = ("strict", "shape", "off")

#: an `EpisodeAbort` reason of this form is a decision of a consumer: "rlrec:<reason>:<action>"
DECISION_PREFIX = "rlrec:"
DECISION_ACTIONS = ("truncate", "dead-letter")
#: an episode whose decision is on its way counts as gone for the memory caps for this long;
#: after it (the decision is not read back: a backlog, or the topic refuses our writes) it
#: counts again and may be evicted
DECISION_GRACE_S = 30.0
#: decisions taken because an episode was idle: void if it has stepped since (`Decision`)
IDLE_DECISIONS = ("timeout", "partition-change")


@dataclass(frozen=True)
class Decision:
    """An early end a consumer decided for an open episode (reason: timeout, capacity,
    partition-change), written as an `EpisodeAbort` to the episode's own partition so that every
    consumer, now or on replay, builds the same episode. A timeout takes effect when the abort is
    read back (the episode holds every event before it in the log), and only if the episode has
    no more steps than when it was found idle (`cut_t`): a step that reached the log before the
    abort voids it, on every pass alike. A capacity eviction frees memory at once: `cut_t`
    records where the episode was cut (truncate), and a replay that reads the abort cuts it
    there too; events after the cut are dead-lettered either way."""

    episode_id: str
    reason: str
    action: str  # truncate | dead-letter
    cut_t: int | None = None

    def abort(self) -> EpisodeAbort:
        cut = "" if self.cut_t is None else f"@{self.cut_t}"
        reason = f"{DECISION_PREFIX}{self.reason}:{self.action}{cut}"
        return EpisodeAbort(self.episode_id, reason, int(time.time() * 1000))


def parse_decision(abort_reason: str) -> tuple[str, str, int | None] | None:
    """(reason, action, cut_t) of a decision abort, None for a producer's own abort."""
    if not abort_reason.startswith(DECISION_PREFIX):
        return None
    body, _, cut = abort_reason[len(DECISION_PREFIX) :].partition("@")
    reason, _, action = body.rpartition(":")
    valid_cut = not cut or (len(cut) <= 18 and cut.isascii() and cut.isdecimal())
    if reason not in CONSUMER_REASONS or action not in DECISION_ACTIONS or not valid_cut:
        return None
    return reason, action, int(cut) if cut else None


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
    #: strict: dtypes and shapes of the declared spaces, action ranges, finite observations and
    #: actions; shape: dtypes and shapes only; off: only what building the episode needs (every
    #: batch like the episode's first)
    validate_spaces: str = "strict"
    max_episode_bytes: int = 64 * 1024 * 1024
    on_episode_too_large: str = "dead-letter"  # or "truncate"

    def __post_init__(self) -> None:
        if self.validate_spaces not in VALIDATE_SPACES:
            raise ValueError(f"validate_spaces must be one of {VALIDATE_SPACES}, got {self.validate_spaces!r}")
        for name, value in (("on_timeout", self.on_timeout), ("on_episode_too_large", self.on_episode_too_large)):
            if value not in ("truncate", "dead-letter"):
                raise ValueError(f"{name} must be 'truncate' or 'dead-letter', got {value!r}")


@dataclass
class Counters:
    """What assembly did with events, episodes and decisions; one object may be shared by every
    assembler of a consumer (exported as `rlrec_assembly_total{what=...}`)."""

    events: int = 0
    duplicates: int = 0
    replay_skipped: int = 0
    rewards_applied: int = 0
    episodes_finished: int = 0
    timeouts: int = 0
    evicted: int = 0
    decisions: int = 0  # decision aborts applied
    decisions_superseded: int = 0  # decision aborts for episodes no longer open (a repeat, or too late)


class CommittedEpisodes(Protocol):
    """What the assembler asks about committed episodes; the partition's committer
    (`rlrec.store.commit.ShardCommitter`) answers, and keeps the only copy."""

    def committed_offset(self, episode_id: str) -> int | None:
        """The last offset of the committed shard entry holding the episode (None: none known)."""

    def committed_length(self, episode_id: str) -> int | None:
        """The committed episode's steps, where known (None: not known)."""


class NothingCommitted:
    """`CommittedEpisodes` of a partition with no committed episode (pure-logic tests, tools)."""

    def committed_offset(self, episode_id: str) -> int | None:
        return None

    def committed_length(self, episode_id: str) -> int | None:
        return None


@dataclass
class OpenEpisode:
    start: EpisodeStart
    first_offset: int
    start_hash: bytes
    obs_leaves: tuple = ()
    act_leaves: tuple = ()
    batches: list[StepBatch] = field(default_factory=list)
    rewards_later: list[RewardDelta] = field(default_factory=list)  # for steps already applied
    batch_offsets: list[int] = field(default_factory=list)  # Kafka offset of each of `batches`
    reward_offsets: list[int] = field(default_factory=list)  # ... and of each of `rewards_later`
    t: int = 0
    last_offset: int = 0
    last_event_at: float = 0.0
    extra_keys: frozenset | None = None
    #: (dtype, per-step shape) of each extra model output, from the episode's first batch, in its
    #: key order (the order of the finished episode's outputs)
    extra_layout: dict[str, tuple[np.dtype, tuple[int, ...]]] | None = None
    nbytes: int = 0
    decided_at: float | None = None  # when a decision for it was produced (not yet read back)
    #: a multi-agent episode some of whose agent rows are committed (a replay): no limit
    #: re-judges it, its remaining rows are owed (docs/GUARANTEES.md, "Multi-agent episodes
    #: exactly once")
    owed: bool = False


def _batch_nbytes(b: StepBatch) -> int:
    """Memory a step batch holds: arrays, parsed infos, a fixed overhead."""
    n = b.rewards.nbytes + sum(a.nbytes for a in b.actions) + sum(a.nbytes for a in b.observations)
    n += sum(a.nbytes for a in b.extra_model_outputs.values()) + 200
    if b.infos is not None:
        n += sum(info_nbytes(i) for i in b.infos if i)
    return n


def _held_nbytes(b: StepBatch | MultiAgentStepBatch) -> int:
    """Memory a step batch of either kind holds."""
    return batch_nbytes(b) if isinstance(b, MultiAgentStepBatch) else _batch_nbytes(b)


def _start_nbytes(ev: EpisodeStart) -> int:
    n = sum(a.nbytes for a in ev.observation) + (info_nbytes(ev.info) if ev.info else 0) + 1000
    return n + space_nbytes(ev.observation_space) + space_nbytes(ev.action_space)


class PartitionAssembler(MultiAgentAssembly):
    """Applies one partition's events in offset order.

    Guarantees: an episode is handed out (`take_ready`) at most once and only when complete;
    every event it cannot use becomes a `DeadLetter` with a reason; `safe_offset` never passes
    the first event of an episode not handed out and confirmed committed (`mark_committed`).

    Args:
        topic: the partition's topic.
        partition: the partition whose events it applies.
        committed: asked which episodes are committed (the partition's committer); the
            assembler keeps no copy.
        config: assembly limits and policies.
        counters: where it counts what it did (shared by a consumer's assemblers; a new one if None).
    """

    def __init__(
        self,
        topic: str,
        partition: int,
        committed: CommittedEpisodes | None = None,
        config: AssemblyConfig | None = None,
        counters: Counters | None = None,
    ):
        self.topic = topic
        self.partition = partition
        self.config = config or AssemblyConfig()
        self.committed: CommittedEpisodes = committed or NothingCommitted()
        self.open: dict[str, OpenEpisode] = {}
        self.finished: dict[str, FinishedEpisode] = {}  # in finish order
        self.in_flight: dict[str, FinishedEpisode] = {}  # handed out, commit not yet confirmed
        self.evicted: OldestHalfDict = OldestHalfDict(100_000)  # episode id -> reason
        #: multi-agent episode id -> its env steps, for those that ended on this pass (their rows
        #: are keyed by agent episode id in `finished` and `in_flight`)
        self.multi_agent_ended: OldestHalfDict = OldestHalfDict(100_000)
        #: episode id -> offset of the latest dead letter made from its events while it was open
        #: or finished (see `may_write`)
        self.letters_upto: dict[str, int] = {}
        self.next_offset: int | None = None
        self.counters = counters if counters is not None else Counters()
        self.finished_bytes = 0
        self.open_nbytes = 0  # memory held by open episodes (OpenEpisode.nbytes summed)
        #: since when the partition has been read live (caught up, not paused); None: it is not.
        #: Timeouts count only live time, so an outage never ends an episode early.
        self.live_since: float | None = None
        #: when the last poll after which the partition was read live began (its events appended
        #: before then have been read); None: it is not live (`open_since_ms`)
        self.caught_up_at: float | None = None
        #: a fetch has answered for the partition since its claim (set by the consumer: a message,
        #: or the partition's end reached where its claim started reading or later); until then it
        #: is not read live and has no watermark, whatever offset the claim starts at
        self.fetched = False
        #: the partition ended where its claim started reading (set by the consumer from the
        #: fetched end): with no event read, there was nothing to replay (`open_since_ms`)
        self.nothing_to_replay = False
        #: the topic's partition count changed lately: episodes may be split across partitions
        self.split_suspected = False

    # -- events -------------------------------------------------------------------------------

    def apply(self, offset: int, event: Any, now: float | None = None) -> list[DeadLetter]:
        """Apply one decoded event at `offset`. Returns dead letters (without raw bytes: the caller
        attaches the original message)."""
        letters = self._apply(offset, event, now)
        eid = event.episode_id
        if letters and (eid in self.open or eid in self.finished):
            self.letters_upto[eid] = max(self.letters_upto.get(eid, -1), *(dl.offset for dl in letters))
        return letters

    def may_write(self, fe: FinishedEpisode, first_unacked: int | None) -> bool:
        """Whether finished episode `fe` may go into a shard now, given the partition's first dead
        letter the broker has not acknowledged (None: none). A replay skips every event of a
        committed episode up to its shard's last offset, dead-lettered ones included: so an
        episode whose own events made dead letters waits until they are all acknowledged, else
        the next owner would skip, not re-send, a dead letter that was never delivered."""
        upto = self.letters_upto.get(getattr(fe, "multi_agent_episode_id", fe.episode_id))
        return upto is None or first_unacked is None or upto < first_unacked

    def _apply(self, offset: int, event: Any, now: float | None) -> list[DeadLetter]:
        now = time.time() if now is None else now
        self.next_offset = offset + 1
        self.fetched = True
        self.counters.events += 1
        eid = event.episode_id
        if isinstance(event, EpisodeAbort):
            decision = parse_decision(event.reason)
            if decision is not None:
                return self._on_decision(offset, event, *decision, now=now)

        if isinstance(event, (MultiAgentEpisodeStart, MultiAgentStepBatch)) or self._multi_agent(event):
            return self._apply_multi_agent(offset, event, now)

        last = self.committed.committed_offset(eid)
        if last is not None:
            if offset <= last:
                self.counters.replay_skipped += 1
            elif isinstance(event, RewardDelta):
                return [DeadLetter("late-reward", f"episode {eid} is already committed", offset)]
            elif eid in self.evicted:  # cut short by us (e.g. episode-too-large): its rest is dead-lettered
                return [DeadLetter(self.evicted[eid], f"episode {eid} was ended early ({self.evicted[eid]})", offset)]
            elif isinstance(event, EpisodeStart):
                return [DeadLetter("duplicate-start", f"episode {eid} is already committed", offset)]
            elif isinstance(event, EpisodeAbort) or (
                isinstance(event, StepBatch) and event.t0 + event.n <= (self.committed.committed_length(eid) or -1)
            ):
                self.counters.duplicates += 1  # a re-sent abort (adds no step), or steps the shard holds
            else:  # a step after the committed end in the log: never silently a duplicate
                return [DeadLetter("step-after-end", f"episode {eid} is committed (through offset {last})", offset)]
            return []

        if isinstance(event, EpisodeStart):
            return self._on_start(offset, event, now)

        ep = self.open.get(eid)
        if ep is not None:
            ep.last_event_at = now
            if isinstance(event, StepBatch):
                return self._on_steps(ep, offset, event, now)
            if isinstance(event, RewardDelta):
                return self._open_reward(ep, offset, event, "steps")
            if isinstance(event, EpisodeAbort):
                return self._open_abort(ep, offset, event, now)
            raise TypeError(type(event))

        fe = self.finished.get(eid) or self.in_flight.get(eid)
        if isinstance(fe, FinishedAgentRow):
            return [DeadLetter("kind-mismatch", f"{type(event).__name__}: {eid} is an agent row id", offset)]
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
            if isinstance(event, StepBatch) and event.t0 + event.n > fe.length:  # reaches past the end
                reason = self.evicted.get(eid, "step-after-end")  # cut short by us: that reason
                return [DeadLetter(reason, f"episode {eid} ended after {fe.length} steps; t0={event.t0}", offset)]
            self.counters.duplicates += 1
            return []

        reason = self.evicted.get(eid) or ("partition-change" if self.split_suspected else "unknown-episode")
        return [DeadLetter(reason, f"{type(event).__name__} for episode {eid} not open on this partition", offset)]

    def _keep_batch(self, ep: Any, offset: int, b: StepBatch | MultiAgentStepBatch, nbytes: int) -> None:
        """Add step batch `b` (holding `nbytes`) to an open episode of either kind."""
        ep.batches.append(b)
        ep.batch_offsets.append(offset)
        ep.t += b.n
        ep.last_offset = offset
        ep.nbytes += nbytes
        self.open_nbytes += nbytes

    def _open_reward(self, ep: Any, offset: int, event: RewardDelta, steps: str) -> list[DeadLetter]:
        """A reward for step `event.t` of an open episode (single- or multi-agent, its steps
        counted in `steps`): kept to add when the episode finishes, or `bad-reward-t` past its end."""
        if event.t >= ep.t:
            return [
                DeadLetter(
                    "bad-reward-t", f"episode {event.episode_id} has {ep.t} {steps}; reward for t={event.t}", offset
                )
            ]
        ep.rewards_later.append(event)
        ep.reward_offsets.append(offset)
        ep.last_offset = offset
        self.counters.rewards_applied += 1
        return []

    def _open_abort(self, ep: Any, offset: int, event: EpisodeAbort, now: float) -> list[DeadLetter]:
        """An open episode (single- or multi-agent) aborted: finished, truncated at its last step."""
        ep.last_offset = offset
        return self._finish(ep, terminated=False, truncated=True, ended_ms=event.timestamp_ms, now=now)

    def _on_start(self, offset: int, ev: EpisodeStart, now: float) -> list[DeadLetter]:
        h = _start_hash(ev)
        ep = self.open.get(ev.episode_id)
        if isinstance(self.finished.get(ev.episode_id) or self.in_flight.get(ev.episode_id), FinishedAgentRow):
            return [
                DeadLetter("id-collision", f"episode {ev.episode_id} is an agent row of a multi-agent episode", offset)
            ]
        if ep is not None or ev.episode_id in self.finished or ev.episode_id in self.in_flight:
            same = ep.start_hash == h if ep is not None else True
            if same:
                self.counters.duplicates += 1
                return []
            return [
                DeadLetter("duplicate-start", f"episode {ev.episode_id} is already open with a different start", offset)
            ]
        obs_leaves = ev.observation_leaves or _leaves(ev.observation_space)
        act_leaves = ev.action_leaves or _leaves(ev.action_space)
        if self.config.validate_spaces == "strict":
            try:
                check_values(ev.observation, obs_leaves, "observation")
            except DecodeError as e:
                self._remember_evicted(ev.episode_id, e.reason)
                return [DeadLetter(e.reason, e.detail, offset)]
        nbytes = _start_nbytes(ev)
        if nbytes > self.config.max_episode_bytes:  # nothing to truncate to: the start alone is too large
            self._remember_evicted(ev.episode_id, "episode-too-large")
            return [DeadLetter("episode-too-large", f"start holds {nbytes} bytes", offset)]
        self.evicted.pop(ev.episode_id, None)
        self.open[ev.episode_id] = OpenEpisode(
            ev, offset, h, obs_leaves, act_leaves, last_offset=offset, last_event_at=now, nbytes=nbytes
        )
        self.open_nbytes += nbytes
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
        mode = self.config.validate_spaces
        try:
            if mode == "off":  # no declared space: only what stacking the batches needs
                ref = ep.batches[0] if ep.batches else None
                first_obs = tuple(Leaf(a.dtype, a.shape) for a in ep.start.observation)
                check_leaves(b.observations, _layout(ref.observations) if ref else first_obs, b.n, "observations")
                if ref is not None:
                    check_leaves(b.actions, _layout(ref.actions), b.n, "actions")
            else:
                check_leaves(b.observations, ep.obs_leaves, b.n, "observations")
                check_leaves(b.actions, ep.act_leaves, b.n, "actions")
        except DecodeError as e:
            return [DeadLetter(e.reason, e.detail, offset)]
        if mode == "strict":
            try:
                check_values(b.observations, ep.obs_leaves, "observations")
                check_values(b.actions, ep.act_leaves, "actions")
            except DecodeError as e:  # the values themselves are bad: so is the episode
                return self._poison(ep, offset, e.reason, e.detail)
        keys = frozenset(b.extra_model_outputs)
        if ep.extra_keys is None:
            ep.extra_keys = keys
            ep.extra_layout = {k: (a.dtype, a.shape[1:]) for k, a in b.extra_model_outputs.items()}
        elif keys != ep.extra_keys:
            return [
                DeadLetter("extra-mismatch", f"episode {eid}: keys {sorted(keys)} != {sorted(ep.extra_keys)}", offset)
            ]
        else:
            for k, a in b.extra_model_outputs.items():
                want = ep.extra_layout[k]
                if (a.dtype, a.shape[1:]) != want:
                    detail = f"episode {eid}: {k} is {a.dtype}{list(a.shape[1:])}, first batch {want[0]}{list(want[1])}"
                    return [DeadLetter("extra-output-mismatch", detail, offset)]
        nbytes = _batch_nbytes(b)
        if ep.nbytes + nbytes > self.config.max_episode_bytes:
            return self._too_large(ep, offset, ep.nbytes + nbytes, now)
        self._keep_batch(ep, offset, b, nbytes)
        if b.terminated or b.truncated:
            return self._finish(ep, terminated=b.terminated, truncated=b.truncated, ended_ms=b.timestamp_ms, now=now)
        return []

    def _finish(
        self, ep: OpenEpisode, *, terminated: bool, truncated: bool, ended_ms: int, now: float, reason: str = "aborted"
    ) -> list[DeadLetter]:
        eid = ep.start.episode_id
        del self.open[eid]
        self.open_nbytes -= ep.nbytes
        if ep.t == 0:
            return self._dead_letter_episode(
                ep, "empty-episode", f"episode {eid} ended ({reason}) before its first step"
            )
        if isinstance(ep.start, MultiAgentEpisodeStart):
            return self._finish_multi_agent(ep, aborted=truncated, ended_ms=ended_ms, now=now)
        try:
            fe = _build(ep, terminated, truncated, ended_ms, now)
        except Exception as e:  # a data case the checks above missed: the episode, not the consumer
            return self._dead_letter_episode(ep, "internal", f"building episode {eid}: {type(e).__name__}: {e}")
        self.finished[eid] = fe
        self.finished_bytes += fe.nbytes()
        self.counters.episodes_finished += 1
        return []

    # -- time-driven --------------------------------------------------------------------------

    def decide_timeouts(self, now: float | None = None) -> list[Decision]:
        """Decisions to end open episodes idle for episode_timeout_s of *live* time (since the
        later of their last event and `live_since`); none while the partition is not live."""
        if self.live_since is None:
            return []
        now = time.time() if now is None else now
        limit = now - self.config.episode_timeout_s
        out = []
        for ep in self.open.values():
            if max(ep.last_event_at, self.live_since) <= limit:
                # after a partition-count change an idle episode may be the first part of a split one
                reason, action = ("partition-change", "dead-letter") if self.split_suspected else ("timeout", "")
                d = self.decide(ep.start.episode_id, reason, action or self.config.on_timeout, now)
                if d is not None:
                    out.append(d)
        return out

    def decide(self, eid: str, reason: str, action: str, now: float | None = None) -> Decision | None:
        """A decision to end open episode `eid` early (None if one is already on its way: the
        decision is sent until the broker acknowledges it, so it is taken once)."""
        ep = self.open.get(eid)
        now = time.time() if now is None else now
        if ep is None or ep.decided_at is not None:
            return None
        ep.decided_at = now
        return Decision(eid, reason, action, cut_t=ep.t)

    def _on_decision(
        self, offset: int, ev: EpisodeAbort, reason: str, action: str, cut_t: int | None, *, now: float
    ) -> list[DeadLetter]:
        """A consumer's decision read back from the log: applied to the episode if it is still
        open (a timeout; or a replay of an eviction this pass did not make); else a no-op."""
        eid = ev.episode_id
        ep = self.open.get(eid)
        if ep is None or (reason in IDLE_DECISIONS and cut_t is not None and ep.t > cut_t):
            if ep is not None:  # it stepped after it was found idle: not idle after all
                ep.decided_at = None
            self.counters.decisions_superseded += 1
            return []
        self.counters.decisions += 1
        if reason == "timeout":
            self.counters.timeouts += 1
        if action == "dead-letter":
            out = self.evict(eid, reason, truncate=False)
            return [*out, DeadLetter(reason, f"decision: {reason}", offset)]
        out = self._cut(ep, cut_t, reason) if cut_t is not None else []
        ep.last_offset = offset
        self._remember_evicted(eid, reason)
        return out + self._truncate(ep, reason, now)

    def _cut(self, ep: OpenEpisode, cut_t: int, reason: str) -> list[DeadLetter]:
        """Drop (dead-letter) the batches at or after step `cut_t` (a batch boundary when the cut
        was made) and the delayed rewards for those steps."""
        eid = ep.start.episode_id
        out = []
        keep_b, keep_o = [], []
        for b, o in zip(ep.batches, ep.batch_offsets):
            if b.t0 < cut_t:
                keep_b.append(b)
                keep_o.append(o)
            else:
                value, headers = encode(b)
                out.append(DeadLetter(reason, f"after the cut at t={cut_t}", o, eid.encode(), value, headers))
                ep.nbytes -= _held_nbytes(b)
                self.open_nbytes -= _held_nbytes(b)
        ep.batches, ep.batch_offsets = keep_b, keep_o
        ep.t = sum(b.n for b in keep_b)
        keep_r, keep_ro = [], []
        for r, o in zip(ep.rewards_later, ep.reward_offsets):
            if r.t < ep.t:
                keep_r.append(r)
                keep_ro.append(o)
            else:
                value, headers = encode(r)
                out.append(DeadLetter(reason, f"after the cut at t={cut_t}", o, eid.encode(), value, headers))
        ep.rewards_later, ep.reward_offsets = keep_r, keep_ro
        return out

    def _truncate(self, ep: OpenEpisode, reason: str, now: float) -> list[DeadLetter]:
        last_ms = ep.batches[-1].timestamp_ms if ep.batches else ep.start.timestamp_ms
        return self._finish(ep, terminated=False, truncated=True, ended_ms=last_ms, now=now, reason=reason)

    def evict_now(
        self, eid: str, reason: str, action: str, now: float | None = None
    ) -> tuple[Decision, list[DeadLetter]]:
        """Free an open episode's memory at once (capacity): dead-letter its events, or finish it
        truncated where it stands. Returns the decision to write to the log (so a replay ends
        the episode the same way) and the dead letters."""
        now = time.time() if now is None else now
        ep = self.open[eid]
        if action == "dead-letter" or isinstance(ep.start, MultiAgentEpisodeStart):
            # a multi-agent episode is never cut by a limit: its rows could be committed before
            # the decision is durable, and a replay could end it differently
            return Decision(eid, reason, "dead-letter"), self.evict(eid, reason, truncate=False)
        self.counters.evicted += 1
        decision = Decision(eid, reason, action, cut_t=ep.t)
        self._remember_evicted(eid, reason)
        return decision, self._truncate(ep, reason, now)

    def evict(self, eid: str, reason: str = "capacity", truncate: bool = False) -> list[DeadLetter]:
        """Remove an open episode to bound memory: dead-letter its events, or finish it truncated."""
        ep = self.open[eid]
        self.counters.evicted += 1
        if truncate:
            last_ms = ep.batches[-1].timestamp_ms if ep.batches else ep.start.timestamp_ms
            return self._finish(ep, terminated=False, truncated=True, ended_ms=last_ms, now=time.time(), reason=reason)
        del self.open[eid]
        self.open_nbytes -= ep.nbytes
        return self._dead_letter_episode(ep, reason, f"evicted: {reason}")

    def poison(self, eid: str, offset: int, reason: str, detail: str) -> list[DeadLetter]:
        """The event at `offset` of episode `eid` is bad in a way that spoils the episode: dead-letter
        the episode's events so far (if it is open) and remember the reason for its later events.
        The caller dead-letters the message at `offset` itself."""
        ep = self.open.get(eid)
        if ep is None:
            self._remember_evicted(eid, reason)
            return []
        return self._poison(ep, offset, reason, detail)[:-1]

    def _poison(self, ep: OpenEpisode, offset: int, reason: str, detail: str) -> list[DeadLetter]:
        del self.open[ep.start.episode_id]
        self.open_nbytes -= ep.nbytes
        self.counters.evicted += 1
        return [*self._dead_letter_episode(ep, reason, detail), DeadLetter(reason, detail, offset)]

    def _too_large(self, ep: OpenEpisode, offset: int, nbytes: int, now: float) -> list[DeadLetter]:
        """The batch at `offset` would take `ep` over max_episode_bytes."""
        eid = ep.start.episode_id
        detail = f"episode {eid} would hold {nbytes} bytes > max_episode_bytes {self.config.max_episode_bytes}"
        if self.config.on_episode_too_large == "dead-letter" or ep.t == 0:
            return self._poison(ep, offset, "episode-too-large", detail)
        # truncate: keep the steps so far as a truncated episode; this batch and the rest are dead letters
        last_ms = ep.batches[-1].timestamp_ms if ep.batches else ep.start.timestamp_ms
        out = self._finish(ep, terminated=False, truncated=True, ended_ms=last_ms, now=now, reason="episode-too-large")
        self._remember_evicted(eid, "episode-too-large")
        return [*out, DeadLetter("episode-too-large", detail, offset)]

    def _remember_evicted(self, eid: str, reason: str) -> None:
        self.evicted[eid] = reason

    def _dead_letter_episode(self, ep: OpenEpisode, reason: str, detail: str) -> list[DeadLetter]:
        """Re-encode everything received for `ep` as dead letters, so nothing vanishes."""
        eid = ep.start.episode_id
        self._remember_evicted(eid, reason)
        self.letters_upto.pop(eid, None)
        out = []
        events = [ep.start, *ep.batches, *ep.rewards_later]
        offsets = [ep.first_offset, *ep.batch_offsets, *ep.reward_offsets]
        for ev, offset in zip(events, offsets):
            value, headers = encode(ev)
            out.append(DeadLetter(reason, detail, offset, eid.encode(), value, headers))
        return out

    # -- hand-off to the writer ---------------------------------------------------------------

    def ready(
        self, now: float | None = None, force: bool = False, first_unacked: int | None = None
    ) -> list[FinishedEpisode]:
        """Finished episodes past the reward join window (all of them with `force`) that may be
        written given the first unacknowledged dead letter (`may_write`)."""
        now = time.time() if now is None else now
        limit = now - self.config.reward_join_window_s
        return [
            fe
            for fe in self.finished.values()
            if (force or fe.finished_at <= limit) and self.may_write(fe, first_unacked)
        ]

    def hand_out(self, episodes: Iterable[FinishedEpisode]) -> None:
        """The writer takes these: no more rewards are applied to them."""
        for fe in episodes:
            self.finished_bytes -= fe.nbytes()
            self.in_flight[fe.episode_id] = self.finished.pop(fe.episode_id)

    def mark_committed(self, episodes: Iterable[FinishedEpisode]) -> None:
        """These handed-out episodes are committed (`committed` answers for them from now on)."""
        for fe in episodes:
            self.in_flight.pop(fe.episode_id, None)
            self._forget_letters(fe)

    def drop_unwritable(self, fe: FinishedEpisode) -> None:
        """A handed-out episode the shard format cannot encode (dead-lettered by the caller): it
        leaves for good; its later events are dead-lettered `unwritable` too."""
        self.in_flight.pop(fe.episode_id, None)
        self._forget_letters(fe)
        self._remember_evicted(fe.episode_id, "unwritable")

    def _forget_letters(self, fe: FinishedEpisode) -> None:
        """`letters_upto` of an episode gone from this assembler: a single-agent episode's, or a
        multi-agent episode's once none of its agent rows is still finished or handed out."""
        self.letters_upto.pop(fe.episode_id, None)
        if isinstance(fe, FinishedAgentRow):
            siblings = [r.id_ for r in fe.episode.rows.values()]
            if not any(s in self.finished or s in self.in_flight for s in siblings):
                self.letters_upto.pop(fe.multi_agent_episode_id, None)

    def give_back(self, episodes: Iterable[FinishedEpisode]) -> None:
        """A write failed: the episodes wait for the next attempt (rewards apply again)."""
        for fe in episodes:
            if self.in_flight.pop(fe.episode_id, None) is not None:
                self.finished[fe.episode_id] = fe
                self.finished_bytes += fe.nbytes()

    def open_since_ms(self, now: float | None = None) -> int | None:
        """The partition's watermark (`rlrec.store.watermark`; docs/GUARANTEES.md, "Watermark";
        the one place it is decided), in Unix ms: the earliest start (``started_ms``, the start
        event's timestamp) of the episodes read and not committed -- open, finished, handed out
        and not confirmed committed --, at most `now`; with none, `caught_up_at` (None while the
        partition is not read live: an episode not read yet may have started earlier). None
        until a fetch answered for the partition (`fetched`: an offset a claim starts at says
        nothing of what is there), and before any event was read unless the partition had
        nothing to read (`nothing_to_replay`). Episodes ended by ``episode_timeout_s``, evicted or
        dead-lettered are no longer open. The time form of `safe_offset`: every episode read
        that started before it is committed.

        Example:
            >>> a = PartitionAssembler("t", 0)
            >>> a.open_since_ms(now=100.0) is None  # nothing read
            True
        """
        if not self.fetched or (self.next_offset is None and not self.nothing_to_replay):
            return None
        starts = [ep.start.timestamp_ms for ep in self.open.values()]
        starts += [fe.started_ms for fe in (*self.finished.values(), *self.in_flight.values())]
        now_ms = int((time.time() if now is None else now) * 1000)
        if starts:
            return max(0, min(now_ms, *(int(x) for x in starts)))
        return None if self.caught_up_at is None else min(now_ms, int(self.caught_up_at * 1000))

    def safe_offset(self, committing: Iterable[str] = ()) -> int | None:
        """The offset the consumer group may commit for this partition (None: nothing seen);
        with `committing`, once those handed-out episodes are committed too."""
        skip = set(committing)
        firsts = [ep.first_offset for ep in self.open.values()]
        firsts += [fe.first_offset for fe in self.finished.values()]
        firsts += [fe.first_offset for eid, fe in self.in_flight.items() if eid not in skip]
        if firsts:
            return min(firsts)
        return self.next_offset


# ---------------------------------------------------------------------------------------------


def _leaves(space: Any) -> tuple:
    """Leaves of a space an EpisodeStart did not come with (built in code, not decoded)."""
    return tuple(space_leaves(space))


def _layout(arrays: list[np.ndarray]) -> tuple[Leaf, ...]:
    """Leaves (dtype, per-step shape) of stacked arrays, to check later batches against."""
    return tuple(Leaf(a.dtype, a.shape[1:]) for a in arrays)


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
    infos: list[Mapping] = [s.info]
    for b in batches:
        infos += b.infos if b.infos is not None else [EMPTY_INFO] * b.n
    extra = {k: np.concatenate([b.extra_model_outputs[k] for b in batches]) for k in (ep.extra_layout or ())}
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


def finished_events(fe: FinishedEpisode) -> list[EpisodeStart | StepBatch]:
    """A finished episode as events again (its start and one batch of all its steps, delayed
    rewards folded in): what the DLQ gets for an episode that cannot be written."""
    start = EpisodeStart(
        fe.episode_id,
        fe.policy_id,
        fe.policy_version,
        [o[0] for o in fe.observations],
        fe.observation_space,
        fe.action_space,
        fe.env_id,
        fe.infos[0] if fe.infos else {},
        fe.started_ms,
    )
    infos = list(fe.infos[1:]) if any(fe.infos[1:]) else None
    steps = StepBatch(
        fe.episode_id,
        0,
        list(fe.actions),
        np.asarray(fe.rewards, np.float64),
        [o[1:] for o in fe.observations],
        fe.terminated,
        fe.truncated,
        infos,
        dict(fe.extra_model_outputs),
        fe.ended_ms,
    )
    return [start, steps] if fe.length else [start]
