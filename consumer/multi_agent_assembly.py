"""A multi-agent episode's end in assembly: its events -> its agent rows.

The partition's assembler (`rlrec.consumer.assembly.PartitionAssembler`) keeps an open
multi-agent episode as it keeps a single-agent one (the same limits, decisions and offsets); at
its end it calls `agent_rows`: the events are folded (`fold_multi_agent`), split per agent (the
fast path, or RLlib's replay where the fast path does not apply: `split_recording`) and become
one `FinishedAgentRow` per agent episode, each under ``{policy_id}.{module_id}``. A data error of
the fold or of RLlib is a `MultiAgentRefused` with the reason code the dead letters carry.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from rlrec.consumer.multi_agent_fold import fold_multi_agent
from rlrec.consumer.multi_agent_reference import MultiAgentDataError, agent_episode_id
from rlrec.consumer.multi_agent_split import pack_split, split_recording
from rlrec.producer.events import DecodeError, EpisodeAbort, RewardDelta, info_nbytes
from rlrec.producer.multi_agent_events import MultiAgentEpisodeStart, MultiAgentStepBatch, encode_event
from rlrec.producer.spaces import space_nbytes
from rlrec.store.multi_agent_episode import AGENT_MAPS
from rlrec.store.multi_agent_finished import FinishedAgentRow, agent_rows_of
from rlrec.store.multi_agent_shards import MultiAgentShardEpisode

__all__ = [
    "MULTI_AGENT_REASONS",
    "MultiAgentAssembly",
    "MultiAgentRefused",
    "agent_rows",
    "batch_nbytes",
    "canonical_record",
    "event_agent_ids",
    "start_hash",
    "start_nbytes",
]

#: dead-letter reasons of a multi-agent episode RLlib refuses (`MultiAgentDataError` codes); the
#: fold's reasons (``unknown-agent``, ``bad-value``, ...) are in `rlrec.producer.events.DECODE_REASONS`
MULTI_AGENT_REASONS = {
    "multi-agent-no-agents": "a multi-agent episode with no agent",
    "multi-agent-bad-agent-id": "a multi-agent episode with an agent id RLlib cannot hold",
    "multi-agent-bad-module-id": "a module id that cannot make the policy id {policy_id}.{module_id}",
    "multi-agent-unknown-agent": "a multi-agent step for an agent that is not a possible agent",
    "multi-agent-not-done": "a multi-agent episode that ended without RLlib seeing it done",
    "multi-agent-rllib-refused": "a multi-agent episode RLlib's MultiAgentEpisode refuses (MultiAgentEnvError)",
    "multi-agent-inconsistent": "a multi-agent step after the episode's end",
    "multi-agent-no-agent-steps": "a multi-agent episode in which no agent finished a step (no row to store)",
    "multi-agent-record-too-large": "a multi-agent episode whose record is over MAX_RECORD_BYTES",
}


class MultiAgentRefused(Exception):
    """A multi-agent episode whose events do not make an episode RLlib accepts.

    Args:
        reason: the dead letters' reason code (the fold's `DecodeError` reason, or
            ``multi-agent-<code>`` of a `MultiAgentDataError`).
        detail: what was wrong.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}"[:1000])
        self.reason = reason
        self.detail = detail[:1000]


def agent_rows(
    start: MultiAgentEpisodeStart,
    events: list[tuple[int, Any]],
    *,
    aborted: bool,
    first_offset: int,
    last_offset: int,
    ended_ms: int,
    finished_at: float,
    validate_values: bool = True,
) -> list[FinishedAgentRow]:
    """The agent rows of one ended multi-agent episode.

    Args:
        start: its `MultiAgentEpisodeStart`.
        events: (offset, event) of its step batches and delayed rewards, any order.
        aborted: it ended by an abort (a producer's, or a consumer's decision): truncated.
        first_offset: the Kafka offset of its start.
        last_offset: the largest Kafka offset of its events.
        ended_ms: producer wall clock of its end.
        finished_at: consumer wall clock now.
        validate_values: check values against the spaces (``--validate-spaces strict``).

    Raises:
        MultiAgentRefused: the fold or RLlib refused the episode.

    Example:
        >>> # see tests/test_multi_agent_consumer.py (rows of simple_spread events)
    """
    ordered = [start, *(ev for _, ev in sorted(events, key=lambda oe: oe[0]))]
    try:
        rec = fold_multi_agent(ordered, validate_values=validate_values)
    except DecodeError as e:
        raise MultiAgentRefused(e.reason, e.detail) from None
    if aborted:
        rec.aborted = True
    try:
        split = split_recording(rec)
    except MultiAgentDataError as e:
        raise MultiAgentRefused(f"multi-agent-{e.reason}".replace("_", "-"), str(e)) from None
    try:
        record = pack_split(dataclasses.replace(split, record=canonical_record(split.record)))
    except MultiAgentDataError as e:
        raise MultiAgentRefused(f"multi-agent-{e.reason}".replace("_", "-"), str(e)) from None
    episode = MultiAgentShardEpisode(
        episode_id=rec.episode_id,
        policy_id=rec.policy_id,
        policy_version=rec.policy_version,
        env_id=rec.env_id,
        rows=split.rows,
        record=record,
        env_flags=split.env_flags,
        first_offset=first_offset,
        last_offset=last_offset,
        started_ms=start.timestamp_ms,
        ended_ms=ended_ms,
    )
    return agent_rows_of(episode, finished_at)


def canonical_record(record: dict) -> dict:
    """`record` with its agent-keyed maps in one order (the record's ``agents``, then any other
    key sorted): RLlib fills some of them (``_agent_to_module_mapping``) in an order that
    follows string hashing, which differs between processes, and every assembly of an episode
    -- a replay after a crash among them -- must write the same record bytes into its rows.

    Args:
        record: a `MultiAgentSplit.record`.

    Example:
        >>> canonical_record({"agents": ["b", "a"], "modules": {"a": "m", "b": "m"}})["modules"]
        {'b': 'm', 'a': 'm'}
    """
    order = {a: i for i, a in enumerate(record.get("agents", ()))}
    out = dict(record)
    for name in AGENT_MAPS:
        d = record.get(name)
        if isinstance(d, dict):
            out[name] = {k: d[k] for k in sorted(d, key=lambda k: (order.get(k, len(order)), str(k)))}
    return out


def event_agent_ids(event: Any) -> list[str]:
    """The agents a multi-agent step batch or delayed reward names (to ask whether their rows
    are committed when the episode's start was not read)."""
    if isinstance(event, MultiAgentStepBatch):
        return [c.agent_id for c in event.agents]
    if isinstance(event, RewardDelta) and event.agent_id:
        return [event.agent_id]
    return []


def start_hash(start: MultiAgentEpisodeStart) -> bytes:
    """A digest of a start's encoded bytes (a re-sent identical start is a duplicate)."""
    return hashlib.blake2b(encode_event(start)[0], digest_size=16).digest()


def start_nbytes(start: MultiAgentEpisodeStart) -> int:
    """Memory a multi-agent start holds: reset observations, infos, and its spaces at what they
    cost built (`space_nbytes`; each distinct space object once)."""
    spaces = {id(s): s for a in start.agents.values() for s in (a.observation_space, a.action_space)}
    n = 1000 + 200 * len(start.agents) + sum(space_nbytes(s) for s in spaces.values())
    n += sum(a.nbytes for leaves in start.observations.values() for a in leaves)
    return n + sum(info_nbytes(i) for i in start.infos.values() if i)


def batch_nbytes(b: MultiAgentStepBatch) -> int:
    """Memory a multi-agent step batch holds: its arrays, parsed infos, a fixed overhead."""
    n = b.env_flags.nbytes + 200
    for c in b.agents:
        n += c.presence.nbytes + c.rewards.nbytes + 100
        n += sum(a.nbytes for a in c.observations) + sum(a.nbytes for a in c.actions)
        n += sum(a.nbytes for a in c.extra_model_outputs.values())
        n += sum(info_nbytes(i) for i in c.infos if i)
    return n


class MultiAgentAssembly:
    """The multi-agent part of `rlrec.consumer.assembly.PartitionAssembler` (mixed into it; the
    state is the assembler's: an open multi-agent episode is an ``OpenEpisode`` of its ``open``
    whose ``start`` is a `MultiAgentEpisodeStart`, ``t`` counting env steps, so the timeouts,
    decisions, capacity eviction, memory caps and `safe_offset` apply to it unchanged)."""

    def _multi_agent(self, event: Any) -> bool:
        """An event for an open or ended multi-agent episode, or a delayed reward with an agent
        id for no open episode (what an open episode is decides, not the event's kind)."""
        eid = event.episode_id
        ep = self.open.get(eid)
        if ep is not None:
            return isinstance(ep.start, MultiAgentEpisodeStart) or (
                isinstance(event, RewardDelta) and bool(event.agent_id)
            )
        return eid in self.multi_agent_ended or (isinstance(event, RewardDelta) and bool(event.agent_id))

    def _apply_multi_agent(self, offset: int, event: Any, now: float) -> list[_a.DeadLetter]:
        """A multi-agent event. An open episode takes its events whatever is committed: its
        start was read, so this pass assembles it whole (a replay after a crash between two of
        its modules' commits rebuilds the same rows, and `_finish` keeps only the uncommitted).
        Without an open episode, the event's agents' committed rows say whether the episode is
        committed: the partition resumes before the start of an episode not wholly committed."""
        eid = event.episode_id
        ep = self.open.get(eid)
        if ep is not None:
            mismatch = _kind_mismatch(ep, event)
            if mismatch:
                return [_a.DeadLetter("kind-mismatch", f"episode {eid}: {mismatch}", offset)]
            ep.last_event_at = now
            if isinstance(event, MultiAgentStepBatch):
                return self._on_multi_agent_steps(ep, offset, event, now)
            if isinstance(event, RewardDelta):
                if event.agent_id not in ep.start.agents:
                    return [
                        _a.DeadLetter("unknown-agent", f"episode {eid}: a reward for {event.agent_id[:60]!r}", offset)
                    ]
                return self._open_reward(ep, offset, event, "env steps")
            if isinstance(event, EpisodeAbort):
                return self._open_abort(ep, offset, event, now)
            return self._on_multi_agent_start(offset, event, now)
        ended = self.multi_agent_ended.get(eid)
        if isinstance(event, MultiAgentEpisodeStart):
            if ended is not None:
                return [_a.DeadLetter("duplicate-start", f"multi-agent episode {eid} already ended", offset)]
            return self._on_multi_agent_start(offset, event, now)
        if ended is None and eid in self.evicted:  # ended early on this pass: its rest is dead-lettered
            reason = self.evicted[eid]
            return [_a.DeadLetter(reason, f"{type(event).__name__} for episode {eid}, ended early ({reason})", offset)]
        offsets = [self.committed.committed_offset(agent_episode_id(eid, a)) for a in event_agent_ids(event)]
        last = max((o for o in offsets if o is not None), default=None)
        if last is not None and offset <= last:
            self.counters.replay_skipped += 1
            return []
        if ended is None and last is None:
            reason = self.evicted.get(eid) or ("partition-change" if self.split_suspected else "unknown-episode")
            return [
                _a.DeadLetter(reason, f"{type(event).__name__} for episode {eid} not open on this partition", offset)
            ]
        if isinstance(event, RewardDelta):
            return [_a.DeadLetter("late-reward", f"multi-agent episode {eid} has ended (its rows are built)", offset)]
        if isinstance(event, EpisodeAbort) or (
            isinstance(event, MultiAgentStepBatch) and ended is not None and event.t0 + event.n <= ended
        ):
            self.counters.duplicates += 1
            return []
        reason = self.evicted.get(eid, "step-after-end")
        return [_a.DeadLetter(reason, f"multi-agent episode {eid} has ended; t0={event.t0}", offset)]

    def _on_multi_agent_start(self, offset: int, ev: MultiAgentEpisodeStart, now: float) -> list[_a.DeadLetter]:
        """Open a multi-agent episode. Its agents' committed rows say whether this is a replay
        of an episode committed in part (a committed entry reaching past this start: its rows
        are owed, no limit re-judges it) or a reused id (every committed row before it: a
        `duplicate-start`, as for a single-agent episode)."""
        eid = ev.episode_id
        h = start_hash(ev)
        ep = self.open.get(eid)
        if ep is not None:
            if ep.start_hash == h:
                self.counters.duplicates += 1
                return []
            return [_a.DeadLetter("duplicate-start", f"episode {eid} is already open with a different start", offset)]
        committed = [self.committed.committed_offset(agent_episode_id(eid, a)) for a in ev.agents]
        committed = [o for o in committed if o is not None]
        if committed and max(committed) < offset:
            self._remember_evicted(eid, "duplicate-start")
            return [_a.DeadLetter("duplicate-start", f"multi-agent episode {eid} is already committed", offset)]
        owed = bool(committed)
        nbytes = start_nbytes(ev)
        if nbytes > self.config.max_episode_bytes and not owed:
            self._remember_evicted(eid, "episode-too-large")
            return [_a.DeadLetter("episode-too-large", f"start holds {nbytes} bytes", offset)]
        self.evicted.pop(eid, None)
        self.open[eid] = _a.OpenEpisode(ev, offset, h, last_offset=offset, last_event_at=now, nbytes=nbytes, owed=owed)
        self.open_nbytes += nbytes
        return []

    def _on_multi_agent_steps(
        self, ep: _a.OpenEpisode, offset: int, b: MultiAgentStepBatch, now: float
    ) -> list[_a.DeadLetter]:
        """Env steps of an open multi-agent episode: in order, within max_episode_bytes; their
        content is checked by the fold when the episode ends (a bad value spoils the episode)."""
        eid = ep.start.episode_id
        if b.t0 > ep.t:
            return [_a.DeadLetter("gap", f"episode {eid} expects env step {ep.t}, got t0={b.t0}", offset)]
        if b.t0 < ep.t:
            if b.t0 + b.n <= ep.t:
                self.counters.duplicates += 1
                return []
            return [
                _a.DeadLetter(
                    "backwards-t", f"episode {eid} at t={ep.t}, batch covers {b.t0}..{b.t0 + b.n - 1}", offset
                )
            ]
        unknown = [c.agent_id for c in b.agents if c.agent_id not in ep.start.agents]
        if unknown:
            return self._poison(
                ep, offset, "unknown-agent", f"episode {eid}: agent {unknown[0][:60]!r} is not possible"
            )
        nbytes = batch_nbytes(b)
        if ep.nbytes + nbytes > self.config.max_episode_bytes and not ep.owed:
            # never truncated: where it would be cut is a limit a replay may not share
            detail = f"episode {eid} would hold {ep.nbytes + nbytes} bytes > max_episode_bytes"
            return self._poison(ep, offset, "episode-too-large", f"{detail} {self.config.max_episode_bytes}")
        self._keep_batch(ep, offset, b, nbytes)
        if b.ended:
            return self._finish(ep, terminated=True, truncated=False, ended_ms=b.timestamp_ms, now=now)
        return []

    def _finish_multi_agent(
        self, ep: _a.OpenEpisode, *, aborted: bool, ended_ms: int, now: float
    ) -> list[_a.DeadLetter]:
        """Rows of an ended multi-agent episode into `finished`, except those already committed
        (a replay's re-assembly of an episode committed in part or whole)."""
        eid = ep.start.episode_id
        try:
            rows = agent_rows(
                ep.start,
                [*zip(ep.batch_offsets, ep.batches), *zip(ep.reward_offsets, ep.rewards_later)],
                aborted=aborted,
                first_offset=ep.first_offset,
                last_offset=ep.last_offset,
                ended_ms=ended_ms,
                finished_at=now,
                validate_values=self.config.validate_spaces == "strict",
            )
        except MultiAgentRefused as e:
            return self._dead_letter_episode(ep, e.reason, e.detail)
        except Exception as e:  # a data case the checks missed: the episode, not the consumer
            return self._dead_letter_episode(ep, "internal", f"building episode {eid}: {type(e).__name__}: {e}")
        for row in rows:
            rid = row.episode_id
            last = self.committed.committed_offset(rid)
            if (
                rid in self.open
                or rid in self.finished
                or rid in self.in_flight
                or (last is not None and last < ep.first_offset)
            ):
                detail = f"multi-agent episode {eid}: agent {row.agent_id[:60]!r}'s row id {rid} is another episode's"
                return self._dead_letter_episode(ep, "id-collision", detail)
        self.multi_agent_ended[eid] = ep.t
        self.counters.episodes_finished += 1
        for row in rows:
            if self.committed.committed_offset(row.episode_id) is not None:
                self.counters.duplicates += 1
                continue
            self.finished[row.episode_id] = row
            self.finished_bytes += row.nbytes()
        return []


def _kind_mismatch(ep: Any, event: Any) -> str:
    """Why `event` cannot be an event of open episode `ep` ("" if it can): a multi-agent event
    for a single-agent episode, or a single-agent one for a multi-agent episode."""
    if isinstance(event, EpisodeAbort):
        return ""
    multi = isinstance(ep.start, MultiAgentEpisodeStart)
    if isinstance(event, RewardDelta):
        event_multi = bool(event.agent_id)
    else:
        event_multi = isinstance(event, (MultiAgentEpisodeStart, MultiAgentStepBatch))
    if event_multi == multi:
        return ""
    kind = type(event).__name__ + (f"/{2 if event_multi else 1}" if isinstance(event, RewardDelta) else "")
    return f"a {kind} for a {'multi' if multi else 'single'}-agent episode"


# the assembler mixes this class in: imported after it is defined (either module may be imported first)
import rlrec.consumer.assembly as _a  # noqa: E402
