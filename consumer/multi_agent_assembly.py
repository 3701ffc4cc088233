"""A multi-agent episode's end in assembly: its events -> its agent rows.

The partition's assembler (`rlrec.consumer.assembly.PartitionAssembler`) keeps an open
multi-agent episode as it keeps a single-agent one (the same limits, decisions and offsets); at
its end it calls `agent_rows`: the events are folded (`fold_multi_agent`), split per agent (the
fast path, or RLlib's replay where the fast path does not apply: `split_recording`) and become
one `FinishedAgentRow` per agent episode, each under ``{policy_id}.{module_id}``. A data error of
the fold or of RLlib is a `MultiAgentRefused` with the reason code the dead letters carry.
"""

from __future__ import annotations

import hashlib
from typing import Any

from rlrec.consumer.multi_agent_fold import fold_multi_agent
from rlrec.consumer.multi_agent_reference import MultiAgentDataError
from rlrec.consumer.multi_agent_split import split_recording
from rlrec.producer.events import DecodeError, RewardDelta, info_nbytes
from rlrec.producer.multi_agent_events import MultiAgentEpisodeStart, MultiAgentStepBatch, encode_event
from rlrec.store.episodes import pack_episode
from rlrec.store.multi_agent_episode import pack_record
from rlrec.store.multi_agent_finished import FinishedAgentRow, agent_rows_of
from rlrec.store.multi_agent_shards import MultiAgentShardEpisode

__all__ = ["MultiAgentRefused", "agent_rows", "batch_nbytes", "event_agent_ids", "start_hash", "start_nbytes"]


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
    episode = MultiAgentShardEpisode(
        episode_id=rec.episode_id,
        policy_id=rec.policy_id,
        policy_version=rec.policy_version,
        env_id=rec.env_id,
        rows=split.rows,
        record=pack_record(split.record, {a: pack_episode(e) for a, e in split.carried.items()}),
        env_flags=split.env_flags,
        first_offset=first_offset,
        last_offset=last_offset,
        started_ms=start.timestamp_ms,
        ended_ms=ended_ms,
    )
    return agent_rows_of(episode, finished_at)


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
    """Memory a multi-agent start holds: reset observations, infos, spaces (a fixed estimate each)."""
    n = 1000 + 1000 * len(start.agents)
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
