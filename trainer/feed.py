"""What to read next: the shard feed's scheduling logic (pure Python, no Ray).

The continuous data path (see docs/TRAINER.md) is one never-ending Ray Data pipeline::

    read task --(Arrow chunk of one shard, tagged)--> PreLearner (map_batches) --> Learner(s)
        ^                                                                            |
        +---- ShardFeed actor: next_work()  <--- produced(rows) ------ acks(tags) ---+

`FeedState` decides, every time the read task asks, which piece of which shard goes into the
pipeline: a chunk of a *fresh* shard (committed, never trained on) or a chunk of a shard from the
*replay window* (already trained on). It also keeps the pipeline short: it only hands out work
while the rows in flight (delivered but not yet trained on) stay under `max_ahead_rows`, so a
shard committed now is trained on within a few learner steps instead of queueing behind
hundreds of buffered replay chunks.

Every row that enters the pipeline carries a *tag* ``(shard index << 24) | delivery number``
(column/extra-model-output ``rlrec_tag``). Learners report the tags of the rows they actually
did a gradient step on (`ack`); that is what "trained on" means, and it is what moves a shard
from fresh to trained (the cursor) exactly once.
"""

from __future__ import annotations

import bisect
import math
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["TAG", "TAG_SHIFT", "FeedPolicy", "FeedState", "ShardInfo", "Work", "shard_of_tag"]

#: name of the column / extra model output carrying the tag of every row.
TAG = "rlrec_tag"
TAG_SHIFT = 24
_DELIVERY_MASK = (1 << TAG_SHIFT) - 1
_LATE_KEPT_S = 3600.0  # a chunk's PreLearner result counts this long after its delivery at most
_FRESH_TAGS_KEPT = 1 << 16  # fresh chunks remembered until trained (far more than are ever in flight)


def shard_of_tag(tag: int) -> int:
    return int(tag) >> TAG_SHIFT


@dataclass(frozen=True)
class ShardInfo:
    """What the feed and the read task need to know about one committed shard."""

    idx: int  # trainer-local index (stable for this trainer process)
    key: str  # identity across restarts: the shard's path in the output
    path: str
    staging_path: str
    fmt: str  # "episodes" | "tabular"
    rows: int  # episodes (episode shards) or steps (tabular shards)
    steps: int
    commit_time: float
    policy_id: str
    min_policy_version: int | str | None = None
    max_policy_version: int | str | None = None
    sha256: str | None = None
    nbytes: int = 0
    #: (lowest, highest) policy version kept, None on a side: no bound; None: every row. Set
    #: when a version filter (--min/--max-policy-version) keeps only some of the shard's
    #: episodes (a shard of several versions, merged ones most of all): the read task drops
    #: the other rows, episode by episode (`rlrec.trainer.read_task`)
    versions: tuple[int | None, int | None] | None = None
    #: the ids of the shard's episodes to read (None: all): a merged shard delivered for the
    #: shard entries it holds that were not delivered before (`ManifestFollower`)
    episodes: frozenset[str] | None = None

    @classmethod
    def from_entry(
        cls,
        idx: int,
        e: Any,
        versions: tuple[int | None, int | None] | None = None,
        episodes: frozenset[str] | None = None,
    ) -> ShardInfo:
        return cls(
            idx=idx,
            key=e.path,
            path=e.path,
            staging_path=e.staging_path,
            fmt=e.format,
            rows=e.episodes if e.format == "episodes" else e.steps,
            steps=e.steps,
            commit_time=float(e.commit_time),
            policy_id=e.policy_id,
            min_policy_version=e.min_policy_version,
            max_policy_version=e.max_policy_version,
            sha256=e.sha256,
            nbytes=e.bytes,
            versions=versions,
            episodes=episodes,
        )


@dataclass
class FeedPolicy:
    """Sampling and flow-control settings (all optional; see docs/TRAINER.md).

    fresh_fraction      share of deliveries that go to fresh shards while both fresh and replay
                        data exist (0 < f <= 1; 1 = fresh first, replay only when idle).
    replay_shards       the replay window holds at most the N most recently committed trained
                        shards (None: no limit).
    replay_max_age_s    ... only shards committed within this many seconds (None: no limit;
                        the newest trained shard always stays in the window).
    replay_policy_versions  ... only shards whose max policy version is among the K newest
                        versions seen (integers only; None: no limit).
    chunk_steps         timesteps per delivered chunk (None: train_batch_size_per_learner).
    chunk_rows          rows per chunk, overriding chunk_steps (e.g. input_read_batch_size).
    max_ahead_rows      flow control: rows in flight (delivered, not yet trained on).
    redeliver_after_s   a fresh shard delivered but not trained on after this long (its rows
                        were dropped somewhere, e.g. evicted from a PreLearner buffer) is fresh
                        again.
    """

    fresh_fraction: float = 0.5
    replay_shards: int | None = None
    replay_max_age_s: float | None = None
    replay_policy_versions: int | None = None
    chunk_steps: int | None = None
    chunk_rows: int | None = None
    batch_rows: int = 512  # rows per PreLearner call in "buffer" mode (train_batch_size_per_learner, per module)
    prelearner_mode: str = "episodes"  # "episodes": a chunk's rows = its timesteps; "buffer": batch_rows
    max_ahead_rows: int = 4096
    redeliver_after_s: float = 30.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < float(self.fresh_fraction) <= 1.0:
            raise ValueError(f"fresh_fraction must be in (0, 1], got {self.fresh_fraction}")
        for k in ("replay_shards", "replay_policy_versions", "chunk_steps", "chunk_rows"):
            v = getattr(self, k)
            if v is not None and int(v) < 1:
                raise ValueError(f"{k} must be >= 1 or None, got {v}")
        if self.replay_max_age_s is not None and self.replay_max_age_s <= 0:
            raise ValueError("replay_max_age_s must be > 0 or None")
        if self.max_ahead_rows < 1:
            raise ValueError("max_ahead_rows must be >= 1")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Work:
    """One unit the read task turns into one tagged Arrow block."""

    tag: int
    shard: ShardInfo
    start: int  # row range [start, stop) of the shard
    stop: int
    fresh: bool


@dataclass
class _Pending:
    shard: int
    rows_est: int
    t: float
    fresh: bool
    start: int = 0
    stop: int = 0


@dataclass
class IterationStats:
    newly_trained: dict = field(default_factory=dict)  # key -> first gradient step time
    seen: set = field(default_factory=set)  # shard keys trained on (any)
    missing: list = field(default_factory=list)  # keys found deleted
    bad: list = field(default_factory=list)  # (key, reason)
    skipped: list = field(default_factory=list)  # (key, new episodes, a reason): unusable episodes, each once
    rows_trained: int = 0
    rows_streamed: int = 0  # of rows_trained, taken from the stream
    fresh_chunks: int = 0  # chunks delivered fresh (new data) whose rows were first trained on
    wait_s: float = 0.0
    compute_s: float = 0.0
    updates: int = 0
    rows_streamed_by_learner: dict = field(default_factory=dict)  # Learner iterator id -> rows from the stream


class FeedState:
    """The feed's bookkeeping (see module docstring). Not thread-safe: one owner."""

    def __init__(self, policy: FeedPolicy | None = None, clock=time.time) -> None:
        self.policy = policy or FeedPolicy()
        self.clock = clock
        self.rng = random.Random(self.policy.seed)
        self.shards: dict[int, ShardInfo] = {}
        self.by_key: dict[str, int] = {}
        self.trained: set[int] = set()
        self.deleted: set[int] = set()
        self.fresh: deque[int] = deque()  # fresh shards not yet (fully) delivered
        self.fresh_queued: set[int] = set()
        self._chunks: deque[tuple[int, int, int]] = deque()  # chunks of the fresh shard being delivered
        self.inflight_fresh: dict[int, float] = {}  # fully delivered fresh shard -> last delivery time
        self.pending: dict[int, _Pending] = {}  # tag -> delivered chunk not yet through the PreLearner
        # fresh chunks given up on in `pending` (no longer counted in flight) whose PreLearner result
        # may still come: it counts when it does (oldest forgotten past _FRESH_TAGS_KEPT)
        self._late: dict[int, _Pending] = {}
        self.produced = 0  # rows out of the PreLearner
        self.acked = 0  # rows trained on
        self.credit = 1.0
        self._seq = 0
        self._window: list[int] = []
        self._cum: list[float] = []
        self._window_dirty = True
        self._window_time = 0.0
        self.stats = IterationStats()
        self._skips_seen: set[tuple[int, str]] = set()
        self._fresh_rows_out: dict[int, int] = {}  # fresh shard -> rows its chunks produced so far
        self._fresh_ranges: dict[int, set[tuple[int, int]]] = {}  # fresh shard -> its row ranges processed
        self._fresh_tags: dict[int, None] = {}  # fresh chunks out of the PreLearner, not trained on yet
        # shard -> first times: added, delivered, processed (its first fresh chunk out of the PreLearner), trained
        self.timeline: dict[int, dict] = {}
        self.totals = {"deliveries": 0, "fresh_deliveries": 0, "replay_deliveries": 0, "rows_delivered": 0}
        self.storage_errors = 0  # reads that failed on an unreachable store (the chunk was given back), cumulative
        self.last_storage_error: str | None = None
        self.refusals = 0  # reads the store refused (permission, credentials; the chunk was given back), cumulative
        self.last_refusal: str | None = None

    # ------------------------------------------------------------------ shards
    def add_shards(self, infos: list[ShardInfo], trained_keys: set[str] | frozenset = frozenset()) -> int:
        """Register newly committed shards; those whose key is in `trained_keys` (the restored
        cursor) are history, the others fresh. Returns how many were new."""
        n = 0
        for s in sorted(infos, key=lambda s: (s.commit_time, s.idx)):
            if s.idx in self.shards:
                continue
            self.shards[s.idx] = s
            self.by_key[s.key] = s.idx
            n += 1
            self.timeline[s.idx] = {"added": self.clock()}
            if s.key in trained_keys:
                self.trained.add(s.idx)
            else:
                self.fresh.append(s.idx)
                self.fresh_queued.add(s.idx)
        if n:
            self._window_dirty = True
        return n

    def _drop(self, idx: int) -> bool:
        if idx in self.deleted or idx not in self.shards:
            return False
        self.deleted.add(idx)
        self.fresh_queued.discard(idx)
        self.inflight_fresh.pop(idx, None)
        self._chunks = deque(c for c in self._chunks if c[0] != idx)
        self._forget_counts(idx)
        self._window_dirty = True
        return True

    def _forget_counts(self, idx: int) -> None:
        """What the processed and late chunks of shard `idx` counted towards "nothing to train
        on": not needed once it is trained or gone."""
        self._fresh_rows_out.pop(idx, None)
        self._fresh_ranges.pop(idx, None)
        for tag in [t for t, p in self._late.items() if p.shard == idx]:
            del self._late[tag]

    def mark_missing(self, idx: int) -> None:
        """The shard's file is gone (deleted outside the trainer): never read it again."""
        if self._drop(idx):
            self.stats.missing.append(self.shards[idx].key)

    def mark_bad(self, idx: int, reason: str) -> None:
        """The shard cannot be used (checksum mismatch, unsafe or malformed content)."""
        if self._drop(idx):
            self.stats.bad.append((self.shards[idx].key, reason))

    # ----------------------------------------------------------------- window
    def _versions_floor(self, eligible: list[int]) -> float | None:
        k = self.policy.replay_policy_versions
        if not k:
            return None
        versions = sorted(
            {v for i in eligible if isinstance(v := self.shards[i].max_policy_version, int) and not isinstance(v, bool)}
        )
        if not versions:
            return None
        return versions[-k] if len(versions) >= k else versions[0]

    def window(self) -> list[int]:
        """Shard indices eligible for replay, oldest first (recomputed lazily)."""
        now = self.clock()
        if not self._window_dirty and (self.policy.replay_max_age_s is None or now - self._window_time < 1.0):
            return self._window
        p = self.policy
        eligible = sorted(
            (i for i in self.trained if i not in self.deleted), key=lambda i: (self.shards[i].commit_time, i)
        )
        # delivered fresh shards not yet acknowledged may be read again too: the Learner side
        # may be holding their rows (e.g. in its shuffle buffer) until more data arrives, so the
        # stream must not run dry while they are in flight. They are not "trained" until acked.
        inflight = [i for i in self.inflight_fresh if i not in self.deleted and i not in self.trained]
        if eligible:
            newest = eligible[-1]
            floor = self._versions_floor(eligible)
            if floor is not None:
                eligible = [
                    i for i in eligible if not isinstance(v := self.shards[i].max_policy_version, int) or v >= floor
                ]
            if p.replay_max_age_s is not None:
                eligible = [i for i in eligible if now - self.shards[i].commit_time <= p.replay_max_age_s]
            if p.replay_shards is not None:
                eligible = eligible[-int(p.replay_shards) :]
            if not eligible:  # never let the window run dry while history exists
                eligible = [newest]
        eligible = eligible + sorted(inflight, key=lambda i: (self.shards[i].commit_time, i))
        self._window = eligible
        cum, acc = [], 0.0
        for i in eligible:
            acc += max(1, self.shards[i].steps)
            cum.append(acc)
        self._cum = cum
        self._window_dirty = False
        self._window_time = now
        return eligible

    # --------------------------------------------------------------- delivery
    def _chunk_rows(self, s: ShardInfo) -> int:
        p = self.policy
        if p.chunk_rows:
            return int(p.chunk_rows)
        steps = p.chunk_steps or p.batch_rows
        if s.fmt == "episodes":
            per = max(1.0, s.steps / max(1, s.rows))
            return max(1, math.ceil(steps / per))
        return max(1, int(steps))

    def _rows_est(self, s: ShardInfo, start: int, stop: int) -> int:
        if s.fmt != "episodes":
            return stop - start
        if self.policy.prelearner_mode == "buffer":  # RLlib samples batch_rows timesteps per call
            return self.policy.batch_rows
        return max(1, round((stop - start) * s.steps / max(1, s.rows)))

    def in_flight_rows(self) -> int:
        return sum(p.rows_est for p in self.pending.values()) + max(0, self.produced - self.acked)

    def _expire(self, now: float) -> None:
        p = self.policy
        patience = max(60.0, p.redeliver_after_s)
        for tag in [t for t, x in self.pending.items() if now - x.t > patience]:
            late = self.pending.pop(tag)
            if late.fresh:
                self._late[tag] = late
                if len(self._late) > _FRESH_TAGS_KEPT:
                    del self._late[next(iter(self._late))]
        while self._late and now - next(iter(self._late.values())).t > _LATE_KEPT_S:  # oldest first
            del self._late[next(iter(self._late))]
        for idx in [i for i, t in self.inflight_fresh.items() if now - t > p.redeliver_after_s]:
            del self.inflight_fresh[idx]
            self._window_dirty = True
            if idx not in self.trained and idx not in self.deleted and idx not in self.fresh_queued:
                self.fresh.appendleft(idx)
                self.fresh_queued.add(idx)

    def has_fresh(self) -> bool:
        return bool(self._chunks) or any(i not in self.deleted for i in self.fresh)

    def has_data(self) -> bool:
        return self.has_fresh() or bool(self.window())

    def _next_fresh_chunk(self) -> tuple[int, int, int] | None:
        while not self._chunks and self.fresh:
            idx = self.fresh.popleft()
            self.fresh_queued.discard(idx)
            if idx in self.deleted or idx in self.trained:
                continue
            s = self.shards[idx]
            n = self._chunk_rows(s)
            self._chunks.extend((idx, a, min(a + n, s.rows)) for a in range(0, max(1, s.rows), n))
        return self._chunks.popleft() if self._chunks else None

    def _replay_chunk(self) -> tuple[int, int, int] | None:
        w = self.window()
        if not w:
            return None
        x = self.rng.random() * self._cum[-1]
        idx = w[min(bisect.bisect_right(self._cum, x), len(w) - 1)]
        s = self.shards[idx]
        n = min(self._chunk_rows(s), max(1, s.rows))
        start = self.rng.randrange(0, max(1, s.rows - n + 1))
        return idx, start, min(start + n, s.rows)

    def next_work(self) -> Work | None:
        """The next chunk to read, or None (nothing to read, or enough rows in flight)."""
        now = self.clock()
        self._expire(now)
        in_flight = self.in_flight_rows()
        if in_flight >= self.policy.max_ahead_rows:
            # flow control: replay waits; a fresh chunk may still go out while the rows in flight
            # stay under twice the limit (waiting here would be pure latency for new data)
            if in_flight >= 2 * self.policy.max_ahead_rows or not self.has_fresh():
                return None
            chunk = self._next_fresh_chunk()
            return self._deliver(chunk, True, now) if chunk is not None else None
        fresh_first = self.credit >= 1.0 - 1e-9
        chunk, fresh = None, False
        if fresh_first:
            chunk = self._next_fresh_chunk()
            fresh = chunk is not None
        if chunk is None:
            chunk = self._replay_chunk()
        if chunk is None and not fresh_first:
            chunk = self._next_fresh_chunk()
            fresh = chunk is not None
        if chunk is None:
            return None
        if fresh:
            self.credit = max(0.0, self.credit - 1.0)
        self.credit = min(1.0, self.credit + self.policy.fresh_fraction)
        return self._deliver(chunk, fresh, now)

    def _deliver(self, chunk: tuple[int, int, int], fresh: bool, now: float) -> Work:
        idx, start, stop = chunk
        s = self.shards[idx]
        self._seq = (self._seq + 1) & _DELIVERY_MASK
        tag = (idx << TAG_SHIFT) | self._seq
        self.pending[tag] = _Pending(idx, self._rows_est(s, start, stop), now, fresh, start, stop)
        self.timeline.setdefault(idx, {}).setdefault("delivered", now)
        if fresh and not any(c[0] == idx for c in self._chunks):
            self.inflight_fresh[idx] = now
            self._window_dirty = True
        self.totals["deliveries"] += 1
        self.totals["fresh_deliveries" if fresh else "replay_deliveries"] += 1
        self.totals["rows_delivered"] += stop - start
        return Work(tag=tag, shard=s, start=start, stop=stop, fresh=fresh)

    # --------------------------------------------------------------- feedback
    def processed(self, tags: list[int], rows_out: int) -> None:
        """The PreLearner turned the chunks `tags` into `rows_out` rows.

        A fresh shard all of whose chunks came out empty (every episode held out for
        evaluation, or unusable) has nothing to train on: it counts as trained on now, once,
        instead of being delivered again and again -- also when a chunk's result comes after
        the chunk stopped counting as in flight (a PreLearner slower than a minute)."""
        now = self.clock()
        for t in tags:
            p = self.pending.pop(int(t), None) or self._late.pop(int(t), None)
            if p is not None and p.fresh:
                self._fresh_tags[int(t)] = None
                if len(self._fresh_tags) > _FRESH_TAGS_KEPT:
                    del self._fresh_tags[next(iter(self._fresh_tags))]
                self.timeline.setdefault(p.shard, {}).setdefault("processed", now)
                idx = p.shard
                if idx in self.trained or idx in self.deleted:
                    continue
                self._fresh_rows_out[idx] = self._fresh_rows_out.get(idx, 0) + int(rows_out)
                self._fresh_ranges.setdefault(idx, set()).add((p.start, p.stop))
                if self._fresh_rows_out[idx] == 0 and self._covers_shard(idx):
                    self._mark_trained(idx, now)
        self.produced += int(rows_out)

    def _covers_shard(self, idx: int) -> bool:
        """Whether the fresh chunks processed so far cover every row of shard `idx` (a
        redelivered chunk counts once, whichever delivery's result comes first)."""
        s = self.shards.get(idx)
        if s is None:
            return False
        end = 0
        for start, stop in sorted(self._fresh_ranges.get(idx, ())):
            if start > end:
                return False
            end = max(end, stop)
        return end >= s.rows

    def _mark_trained(self, idx: int, t: float) -> None:
        s = self.shards.get(idx)
        if s is None or idx in self.trained:
            return
        self.trained.add(idx)
        self._window_dirty = True
        self.inflight_fresh.pop(idx, None)
        self._forget_counts(idx)
        self.stats.newly_trained.setdefault(s.key, t)
        self.timeline.setdefault(idx, {})["trained"] = t

    def skipped(self, tag: int, episodes: list[str], reason: str) -> None:
        """The PreLearner skipped these unusable `episodes` (ids; ``#i``: the i-th row of the chunk,
        undecodable) of chunk `tag`. Each episode of a shard is counted once: replays skip it again
        without counting it again."""
        p = self.pending.get(int(tag))
        idx = shard_of_tag(tag)
        s = self.shards.get(idx)
        if s is None:
            return
        new = 0
        for e in episodes:
            if e.startswith("#") and e[1:].isdigit():
                e = f"row {p.start + int(e[1:])}" if p is not None else f"chunk {tag} {e}"
            if (idx, e) not in self._skips_seen:
                self._skips_seen.add((idx, e))
                new += 1
        if new:
            self.stats.skipped.append((s.key, new, reason))

    def report(self, tag: int, kind: str, reason: str = "") -> None:
        """What became of a delivered chunk a read task could not read; `kind` is the read
        task's verdict: ``retry`` (the store did not answer), ``refused`` (the store refused:
        permission, credentials), ``busy`` (the read task ran out of memory) -- the chunk is
        delivered again -- or ``missing`` / ``bad`` (the shard is gone / unusable: never read
        again)."""
        if kind == "refused":
            self.refusals += 1
            self.last_refusal = reason or None
        self.failed(tag, requeue=kind in ("retry", "refused", "busy"), reason=reason, counted=kind == "retry")
        if kind == "missing":
            self.mark_missing(shard_of_tag(tag))
        elif kind == "bad":
            self.mark_bad(shard_of_tag(tag), reason)

    def failed(self, tag: int, requeue: bool = False, reason: str = "", counted: bool = True) -> None:
        """A delivered chunk could not be read. `requeue`: the store did not answer (a transient
        error, counted in `storage_errors`): deliver a fresh chunk again; the shard stays
        committed and fresh (missing and bad shards are marked separately); `counted`: a requeue
        counted in `storage_errors`."""
        if requeue and counted:
            self.storage_errors += 1
            self.last_storage_error = reason or None
        p = self.pending.pop(int(tag), None)
        if requeue and p is not None and p.fresh and p.shard not in self.deleted:
            self._chunks.appendleft((p.shard, p.start, p.stop))

    def ack(
        self,
        counts: dict[int, int],
        t: float | None = None,
        wait_s: float = 0.0,
        compute_s: float = 0.0,
        updates: int = 0,
        consumed: int | None = None,
    ) -> None:
        """A learner did gradient steps on rows with these tags (tag -> row count), `consumed` of
        them taken from the stream (the others re-sampled from its buffer; default: all)."""
        t = self.clock() if t is None else t
        st = self.stats
        self.acked += int(sum(counts.values()) if consumed is None else consumed)
        if consumed is not None:
            st.rows_streamed += int(consumed)
        for tag, n in counts.items():
            idx = shard_of_tag(tag)
            st.rows_trained += int(n)
            if self._fresh_tags.pop(tag, False) is None:  # its first rows trained (a replay of the buffer is not)
                st.fresh_chunks += 1
            s = self.shards.get(idx)
            if s is None:
                continue
            st.seen.add(s.key)
            self._mark_trained(idx, t)
        st.wait_s += wait_s
        st.compute_s += compute_s
        st.updates += updates

    def pop_stats(self) -> IterationStats:
        st, self.stats = self.stats, IterationStats()
        return st

    def unread_keys(self) -> list[str]:
        """The keys of the shards handed to the feed that are not gone and not read to the end:
        not trained on yet, or trained on (a first chunk) while chunks of them still wait to be
        delivered or are delivered and not processed -- what the trainer still reads as new (its
        reader lease holds their files)."""
        reading = {c[0] for c in self._chunks} | {p.shard for p in self.pending.values() if p.fresh}
        return [
            s.key for i, s in self.shards.items() if i not in self.deleted and (i not in self.trained or i in reading)
        ]

    def summary(self) -> dict:
        return {
            "shards": len(self.shards),
            "trained": len(self.trained),
            "deleted": len(self.deleted),
            "fresh": sum(1 for i in self.fresh if i not in self.deleted) + len({c[0] for c in self._chunks}),
            "inflight_fresh": len(self.inflight_fresh),
            "window": len(self.window()),
            "in_flight_rows": self.in_flight_rows(),
            "storage_errors": self.storage_errors,
            "last_storage_error": self.last_storage_error,
            "refusals": self.refusals,
            **self.totals,
        }
