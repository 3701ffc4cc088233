"""The consumer's memory bounds: open episodes over ``max_open_episodes``/``max_open_bytes`` evicted
(longest idle first), and no partition read while finished episodes exceed
``max_buffered_bytes`` or unacknowledged dead letters exceed `MAX_PENDING_DEAD_LETTER_BYTES`
(a part of `rlrec.consumer.service.RecorderConsumer`).
"""

from __future__ import annotations

import heapq
import time
from typing import Any

from rlrec.consumer.assembly import DECISION_GRACE_S

#: pending (unacknowledged) dead-letter bytes over which no partition is read
MAX_PENDING_DEAD_LETTER_BYTES = 64 * 1024 * 1024


class MemoryBoundsMixin:
    """Capacity eviction and hold-backs (mixed into `RecorderConsumer`)."""

    def _enforce_capacity(self) -> None:
        """Evict the longest-idle open episodes over max_open_episodes or max_open_bytes."""
        cfg = self.config
        assemblers = [(p, w.assembler) for p, w in self.writers.items() if w.assembler]
        # episodes with a timeout decision on its way count as gone already (they go when it is
        # read back) -- for DECISION_GRACE_S: a decision never read back must not pin memory
        now = time.time()

        def going_soon(ep: Any) -> bool:
            return ep.decided_at is not None and now - ep.decided_at < DECISION_GRACE_S

        going = [(p, ep) for p, a in assemblers for ep in a.open.values() if going_soon(ep)]
        count = sum(len(a.open) for _, a in assemblers) - len(going)
        nbytes = sum(a.open_nbytes for _, a in assemblers) - sum(ep.nbytes for _, ep in going)
        if count <= cfg.max_open_episodes and nbytes <= cfg.max_open_bytes:
            return
        # the longest-idle first, chosen in one pass (one scan per eviction would be quadratic:
        # a burst of 100k new episodes against a 20k cap)
        idle = (
            (ep.last_event_at, p, eid, ep.nbytes)
            for p, a in assemblers
            for eid, ep in a.open.items()
            if not going_soon(ep) and not ep.owed
        )
        over_count = count - cfg.max_open_episodes
        if nbytes <= cfg.max_open_bytes:
            victims = heapq.nsmallest(over_count, idle)
        else:
            victims = []
            for item in sorted(idle):
                if len(victims) >= over_count and nbytes <= cfg.max_open_bytes:
                    break
                victims.append(item)
                nbytes -= item[3]
        for _, p, eid, _n in victims:
            a = self.writers[p].assembler
            first_offset = a.open[eid].first_offset
            d, letters = a.evict_now(eid, "capacity", cfg.on_capacity, now)
            self._decide(p, d, first_offset)
            for dl in letters:
                self._dead_letter(None, dl, partition=p)

    def _hold_back_over_budget(self) -> None:
        """Still over max_buffered_bytes after flushing (the storage is failing): read no partition
        until the finished episodes are written; partitions without a failing flush would otherwise
        keep filling memory. Resumes them once under the budget."""
        total = sum(w.buffered_bytes for w in self.writers.values())
        if total > self.config.max_buffered_bytes:
            for p in self.writers:
                self._pause(p, "budget")
        else:
            for p in list(self._pause_reasons):
                self._resume(p, "budget")

    def _hold_back_dead_letters(self) -> None:
        """Dead letters the broker does not acknowledge stay in memory: past
        MAX_PENDING_DEAD_LETTER_BYTES read nothing more until they are delivered."""
        if self.dlq.pending_bytes > MAX_PENDING_DEAD_LETTER_BYTES:
            for p in self.writers:
                self._pause(p, "dead-letters")
        elif self.dlq.pending_bytes < MAX_PENDING_DEAD_LETTER_BYTES // 2:
            for p in list(self._pause_reasons):
                self._resume(p, "dead-letters")
