"""The `ShardFeed` Ray actor: one `FeedState` shared by the read task and the Learners."""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from rlrec.trainer.feed import (
    FeedPolicy,
    FeedState,
    IterationStats,
    ShardInfo,
    Work,
)

#: key in `config.learner_config_dict` holding the feed's spec (actor name, namespace, ...).
LEARNER_CONFIG_KEY = "rlrec"


@ray.remote(num_cpus=0, max_restarts=0)
class ShardFeed:
    """Ray actor around `FeedState`; `next_work` long-polls (never spins)."""

    def __init__(self, policy: dict) -> None:
        logging.basicConfig(level=logging.INFO)
        self.state = FeedState(FeedPolicy(**policy))
        self._event: asyncio.Event | None = None
        self._acked: dict[str, int] = {}
        self.readers = 0  # read tasks running (they register when they start, leave when they end)
        self.closed = False

    def _notify(self) -> None:
        if self._event is not None:
            self._event.set()

    async def next_work(self, timeout: float = 1.0) -> Work | str | None:
        if self._event is None:
            self._event = asyncio.Event()
        deadline = time.monotonic() + timeout
        while True:
            if self.closed:
                return "closed"
            w = self.state.next_work()
            if w is not None:
                return w
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._event.clear()
            try:
                await asyncio.wait_for(self._event.wait(), min(remaining, 0.25))
            except asyncio.TimeoutError:
                pass

    async def add_shards(self, infos: list[ShardInfo], trained_keys: list[str] | None = None) -> int:
        n = self.state.add_shards(infos, set(trained_keys or ()))
        self._notify()
        return n

    async def processed(self, tags: list[int], rows_out: int) -> None:
        self.state.processed(tags, rows_out)
        self._notify()

    async def skipped(self, tag: int, episodes: list[str], reason: str) -> None:
        self.state.skipped(tag, episodes, reason)

    async def failed(self, tag: int, kind: str, reason: str = "") -> None:
        self.state.report(tag, kind, reason)
        self._notify()

    async def ack(
        self,
        counts: dict,
        t: float,
        wait_s: float,
        compute_s: float,
        updates: int,
        iter_id: str | None = None,
        seq: int = 0,
        consumed: int | None = None,
    ) -> None:
        self.state.ack(counts, t, wait_s, compute_s, updates, consumed)
        if iter_id is not None:
            by = self.state.stats.rows_streamed_by_learner
            by[iter_id] = by.get(iter_id, 0) + int(consumed if consumed is not None else sum(counts.values()))
            self._acked[iter_id] = max(seq, self._acked.get(iter_id, 0))
        self._notify()

    async def pop_stats(self, marks: list | None = None, timeout: float = 10.0) -> IterationStats:
        """This iteration's stats, once the acks up to `marks` ([(iterator id, seq)]) arrived
        (acks are sent asynchronously by the Learners)."""
        if self._event is None:
            self._event = asyncio.Event()
        deadline = time.monotonic() + timeout
        for iter_id, seq in marks or ():
            while self._acked.get(iter_id, 0) < seq and time.monotonic() < deadline:
                self._event.clear()
                try:
                    await asyncio.wait_for(self._event.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass
        return self.state.pop_stats()

    async def has_data(self) -> bool:
        return self.state.has_data()

    async def has_fresh(self) -> bool:
        return self.state.has_fresh()

    async def reader(self, delta: int) -> None:
        self.readers += int(delta)

    async def unread_keys(self) -> list[str]:
        return self.state.unread_keys()

    async def summary(self) -> dict:
        return {**self.state.summary(), "read_tasks": self.readers}

    async def storage_errors(self) -> tuple[int, str | None, int, str | None]:
        """Reads that failed on an unreachable store so far and the last error; reads the
        store refused so far and the last refusal."""
        st = self.state
        return st.storage_errors, st.last_storage_error, st.refusals, st.last_refusal

    async def close(self) -> None:
        self.closed = True
        self._notify()


def get_feed(spec: dict):
    return ray.get_actor(spec["feed"], namespace=spec["namespace"])
