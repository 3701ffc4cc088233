"""What the consumer sends back to Kafka for what it does not record: dead letters (a message, or a
finished episode's events re-encoded) and decisions (an episode's end written to its own
partition), each held until the broker acknowledges it, holding its partition's offset commit
there meanwhile (a part of `rlrec.consumer.service.RecorderConsumer`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from rlrec.consumer.assembly import DeadLetter, Decision, finished_events
from rlrec.consumer.dead_letters import dead_letter_record
from rlrec.producer.events import encode
from rlrec.store.episodes import pack_episode
from rlrec.store.multi_agent_finished import FinishedAgentRow

log = logging.getLogger("rlrec.consumer")


class DeadLettersMixin:
    """Dead letters and decisions (mixed into `RecorderConsumer`)."""

    def _dead_letter(self, m: Any | None, dl: DeadLetter, partition: int | None = None) -> None:
        """Send to the DLQ: the original message (m) or a re-encoded event (dl.value)."""
        cfg = self.config
        if m is not None:
            key, value, headers, partition = m.key(), m.value(), m.headers(), m.partition()
        else:
            key, value, headers = dl.key, dl.value, dl.headers
        key, value, headers = dead_letter_record(
            topic=cfg.topic,
            partition=partition,
            offset=dl.offset,
            reason=dl.reason,
            detail=dl.detail,
            key=key,
            value=value,
            headers=headers,
            max_value_bytes=cfg.dlq_max_message_bytes,
        )
        self.dlq.send(partition, dl.offset, dl.reason, key, value, headers)
        self.metrics.dead_letters.labels(dl.reason).inc()
        log.debug("dead letter %s at %d/%s: %s", dl.reason, partition, dl.offset, dl.detail)

    def _dead_letter_finished(self, p: int, fe: Any, reason: str, detail: str) -> None:
        """Dead-letter a finished episode that cannot be written: its events, re-encoded."""
        eid = fe.episode_id
        try:
            records = (
                agent_row_records(fe)
                if isinstance(fe, FinishedAgentRow)
                else [encode(ev) for ev in finished_events(fe)]
            )
        except Exception as e:  # not even re-encodable: a summary, so the DLQ still says what was lost
            summary = {"episode_id": eid, "steps": fe.length, "error": f"{type(e).__name__}: {e}"[:500]}
            records = [(json.dumps(summary).encode(), [])]
        # both at the start's offset: until every record is acknowledged, the commit stays
        # before the episode's first event (a later offset would let an unacknowledged record's
        # steps fall behind the commit)
        for value, headers in records:
            self._dead_letter(None, DeadLetter(reason, detail, fe.first_offset, eid.encode(), value, headers), p)

    def _decide(self, p: int, d: Decision, first_offset: int) -> None:
        """Write a decision (an EpisodeAbort with the reason) to the episode's own partition, so
        a replay ends the episode the same way. Like a dead letter it is kept until acknowledged
        and holds the partition's commit at the episode's first offset until then."""
        value, headers = encode(d.abort())
        self.dlq.send(
            p,
            first_offset,
            f"decision:{d.reason}",
            d.episode_id.encode(),
            value,
            headers,
            topic=self.config.topic,
            to_partition=p,
        )
        self.metrics.decisions.labels(d.reason).inc()
        log.debug("partition %d: decided %s (%s) for episode %s", p, d.reason, d.action, d.episode_id)

    def _first_unacked(self, p: int) -> int | None:
        """Partition p's first dead letter the broker has not acknowledged (None: none): the
        offset commit stops there, and episodes with dead letters after it wait to be written."""
        return self.dlq.min_unacked(p) if self.dlq is not None else None


def agent_row_records(row: FinishedAgentRow) -> list[tuple[bytes, list[tuple[str, bytes]]]]:
    """An unwritable agent row as dead-letter records: its agent episode packed as its shard
    row's ``item`` would be (`rlrec.store.episodes.pack_episode`), and, with the episode's first
    agent's row, the multi-agent record (``multi_agent_record``): with every row of the episode
    dead-lettered (`ShardCommitter` makes a row's siblings unwritable with it), the episode is
    whole in the DLQ.

    Args:
        row: the unwritable `FinishedAgentRow`.

    Example:
        >>> # see tests/test_multi_agent_replay_rules.py (an unwritable agent row)
    """
    ma_id = row.multi_agent_episode_id.encode()
    head = [("rlrec-multi-agent-episode-id", ma_id), ("rlrec-agent-id", row.agent_id.encode()[:256])]
    out = [(pack_episode(row.agent_episode), [("rlrec-schema", b"AgentEpisodeItem/1"), *head])]
    if row.agent_id == next(iter(row.episode.rows)):
        out.append((row.episode.record, [("rlrec-schema", b"MultiAgentRecord/1"), *head]))
    return out
