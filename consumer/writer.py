"""`PartitionWriter`: one partition's state machine, from claimed ownership to committed shards.

    CLAIMING --claim ok--> ACTIVE --flush fails (storage)--> BACKING_OFF --retry ok--> ACTIVE
        ^  \\--claim fails (retried)                 \\--fenced--> FENCED --60 s, still assigned--> CLAIMING
        |                                                         any state --drop()--> REVOKED
        +-- re-claim

The state drives what the service does with the partition: it reads it only while ACTIVE (every
other state pauses it), re-claims it when a CLAIMING or FENCED writer is due, and commits its
offset only while it holds a claim. In ACTIVE and BACKING_OFF a `tick` buffers finished
episodes, rotates them into shards (count, bytes, age), writes them with the store's commit
protocol (`rlrec.store.commit.ShardCommitter`: 1 encode, 2 stage, 3 append to the manifest log,
4 publish) -- on the service's encoding thread when it has one -- and backs off after a
storage failure. Step 5 -- committing the Kafka offset
`assembler.safe_offset()`, never past an unacknowledged dead letter -- is the service's
(docs/GUARANTEES.md quotes the same steps).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from enum import Enum

from rlrec.consumer.assembly import AssemblyConfig, PartitionAssembler
from rlrec.store.commit import AmbiguousCommitError, CommitResult, ShardCommitter
from rlrec.store.finished import FinishedEpisode
from rlrec.store.manifest import FencedError
from rlrec.store.storage import Storage

__all__ = ["Flushed", "PartitionWriter", "Rotation", "Tick", "WriterState"]

log = logging.getLogger("rlrec.consumer")

#: after being fenced, claim again only if the group still assigns the partition this much later
FENCED_RETRY_S = 60.0


class WriterState(Enum):
    CLAIMING = "claiming"  # assigned, no claim held (yet): not read; claimed at `next_attempt`
    ACTIVE = "active"  # claimed: read, assembled, rotated into shards
    BACKING_OFF = "backing-off"  # a flush failed (storage): not read; retried at `next_attempt`
    FENCED = "fenced"  # a newer writer claimed the partition: state dropped, nothing written
    REVOKED = "revoked"  # no longer assigned: state dropped


#: states in which the partition is not read
PAUSED_STATES = frozenset({WriterState.CLAIMING, WriterState.BACKING_OFF, WriterState.FENCED})


@dataclass(frozen=True)
class Rotation:
    """When finished episodes become a shard (RLlib's output_max_rows_per_file, output_max_file_size)."""

    max_episodes: int = 1000
    max_bytes: int = 128 * 1024 * 1024
    max_age_s: float = 60.0


@dataclass
class Flushed:
    """One committed chunk: what the store committed, how long it took, the episodes written."""

    result: CommitResult
    seconds: float
    episodes: list[FinishedEpisode]


@dataclass
class Tick:
    """What a tick did: chunks committed, episodes that cannot be written (to dead-letter)."""

    flushed: list[Flushed] = field(default_factory=list)
    unwritable: list[tuple[FinishedEpisode, str]] = field(default_factory=list)
    failed: str | None = None  # the storage error that sent the writer BACKING_OFF
    fenced: bool = False


@dataclass
class _Written:
    """What `_write` did: per committed chunk its result and seconds, every `on_committed`
    call in order, and the error that stopped it (the chunks after the last result are not
    committed; those of an append with an unknown outcome are named by the error)."""

    results: list[CommitResult] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    committed: list[tuple[list[FinishedEpisode], int]] = field(default_factory=list)
    error: Exception | None = None


def _write(
    committer: ShardCommitter,
    chunks: list[list[FinishedEpisode]],
    on_committed: Callable[[list[FinishedEpisode], int], None] | None = None,
) -> _Written:
    """Steps 1-4 for each chunk in order, stopping at the first error, which is returned, not
    raised. `on_committed` (the assembler's, on the caller's thread) is called as commits
    happen; without it (on the encoding thread) the calls are recorded for the caller to apply."""
    done = _Written()
    for chunk in chunks:
        t0 = time.time()
        try:
            res = committer.commit(chunk, on_committed=on_committed or _record(done))
        except Exception as e:  # FencedError, storage, MemoryError: the caller decides
            done.error = e
            break
        done.results.append(res)
        done.seconds.append(time.time() - t0)
    return done


def _record(done: _Written) -> Callable[[list[FinishedEpisode], int], None]:
    return lambda eps, last_offset: done.committed.append((eps, last_offset))


class PartitionWriter:
    """Owns one partition: its assembler, its manifest log, its writer epoch and its state.

    Guarantees: an episode is in at most one committed shard entry, and the assembler learns of
    every committed episode before `tick` returns (so none is written twice by this owner); a
    writer whose epoch was superseded never commits again (FENCED); episodes whose append had an
    unknown outcome stay handed out -- unchanged, no delayed reward applied -- until a retry
    settles it (`AmbiguousCommitError`).

    With an `encoder` (an executor; the service gives every writer the same one-thread pool),
    steps 1-4 run there while the service reads on: a tick hands the episodes out and starts
    writing them, a later tick (as soon as `due` sees it done, or at once with `force`) applies
    the outcome on the caller's thread -- the assembler learns which episodes are committed,
    failures back off or fence exactly as a synchronous commit's would. Until then the episodes
    are in flight: no delayed reward applies and the partition's safe offset stays at or before
    their first offset, so the Kafka offset cannot pass them. While a write is under way the
    caller's thread leaves the committer alone (`publish_pending` waits, `offsets_committed` is
    applied afterwards) and dropping the writer waits for a write that has started.
    """

    def __init__(
        self,
        storage: Storage,
        topic: str,
        partition: int,
        *,
        fmt: str = "episodes",
        compression: str = "zstd",
        assembly: AssemblyConfig | None = None,
        rotation: Rotation | None = None,
        encoder: Executor | None = None,
    ):
        self.topic = topic
        self.partition = partition
        self.committer = ShardCommitter(storage, topic, partition, fmt=fmt, compression=compression)
        self.assembly_config = assembly or AssemblyConfig()
        self.rotation = rotation or Rotation()
        self.assembler: PartitionAssembler | None = None
        self.state = WriterState.CLAIMING
        self.replay_from: int | None = None  # the committed Kafka offset the last claim replays from
        self.failing_since: float | None = None
        self.next_attempt = 0.0
        self.attempts = 0
        self.uncertain: list[FinishedEpisode] = []  # handed out; their last append's outcome is unknown
        self.encoder = encoder
        #: chunks handed out and being written on `encoder`, with the future of a `_Written`
        self._encoding: tuple[list[list[FinishedEpisode]], Future] | None = None
        self._encoding_bytes = 0
        self._forget_upto: int | None = None  # offsets_committed() deferred while a write is under way

    @property
    def epoch(self) -> int | None:
        return self.committer.epoch

    @property
    def encoding(self) -> bool:
        """Whether a shard is being written on the `encoder` (its outcome applied by a later tick)."""
        return self._encoding is not None

    @property
    def paused(self) -> bool:
        return self.state in PAUSED_STATES

    @property
    def buffered_bytes(self) -> int:
        """Finished episodes held in memory and not committed: waiting to be written plus being
        encoded (what the service's max_buffered_bytes budget counts)."""
        waiting = self.assembler.finished_bytes if self.assembler is not None else 0
        return waiting + (self._encoding_bytes if self._encoding is not None else 0)

    # -- ownership ----------------------------------------------------------------------------

    def claim(self, replay_from: int | None = None) -> None:
        """Claim a new writer epoch, roll forward unpublished commits, load the committed episode
        ids that can still be replayed from Kafka offset `replay_from` (all if None). Raises on
        storage errors (the state stays CLAIMING)."""
        self._discard_encoding()  # before the committer is used here (none is under way: unclaimed() waited)
        committed = self.committer.claim(replay_from)
        self.replay_from = replay_from
        self.assembler = PartitionAssembler(self.topic, self.partition, committed, self.assembly_config)
        self.state = WriterState.ACTIVE
        self.uncertain = []
        self.attempts, self.failing_since = 0, None
        log.info(
            "partition %d: claimed epoch %d (%d committed episodes that can be replayed from offset %s)",
            self.partition,
            self.epoch,
            len(committed),
            replay_from,
        )

    def unclaimed(self, retry_in: float, state: WriterState = WriterState.CLAIMING) -> None:
        """No claim held (it failed, or we were fenced): drop the state, claim again later and
        start over from the committed offset."""
        self.assembler = None
        self.uncertain = []
        self._discard_encoding()
        self.state = state
        self.next_attempt = time.time() + retry_in

    def claim_due(self, now: float) -> bool:
        return self.state in (WriterState.CLAIMING, WriterState.FENCED) and now >= self.next_attempt

    def drop(self) -> None:
        """Forget all in-memory state (revoked). Uncommitted episodes are replayed by the next
        owner from the committed Kafka offset."""
        self.assembler = None
        self.uncertain = []
        self._discard_encoding()
        self.state = WriterState.REVOKED

    # -- rotation and writing -----------------------------------------------------------------

    def due(self, now: float, over_budget: bool = False, first_unacked: int | None = None) -> bool:
        """Whether finished episodes should be written now (a rotation limit, the buffered-bytes
        budget, or a retry that is due)."""
        a = self.assembler
        if a is None or self.state not in (WriterState.ACTIVE, WriterState.BACKING_OFF):
            return False
        if self._encoding is not None:  # due once encoded: then it is committed
            return self._encoding[1].done()
        if now < self.next_attempt:
            return False
        if self.uncertain or self.state is WriterState.BACKING_OFF:
            return True
        ready = a.ready(now, first_unacked=first_unacked)
        if not ready:
            return False
        r = self.rotation
        return (
            len(ready) >= r.max_episodes
            or a.finished_bytes >= r.max_bytes
            or now - min(fe.finished_at for fe in ready) >= r.max_age_s
            or over_budget
        )

    def tick(self, now: float, *, force: bool = False, first_unacked: int | None = None) -> Tick:
        """Write what is ready (all finished episodes with `force`, except those waiting for
        their dead letters' acknowledgement: `PartitionAssembler.may_write`): episodes of
        uncertain appends first, then the rest in shards of at most `rotation`'s count and bytes.
        With an `encoder`, a tick either starts writing them there or, once written, applies
        the outcome; `force` (revoke, shutdown) waits for a write under way, applies it and
        writes the rest at once on this thread."""
        out = Tick()
        if self.assembler is None or self.state not in (WriterState.ACTIVE, WriterState.BACKING_OFF):
            return out
        if self._encoding is not None:
            chunks, future = self._encoding
            if not (force or future.done()):
                return out
            self._encoding = None
            ok = self._apply_written(chunks, future.result(), out)
            if self._forget_upto is not None:
                self.offsets_committed(self._forget_upto)
            if not ok or not force:
                return out
        background = self.encoder is not None and not force
        # in the background one shard at a time: in memory, one shard's episodes and its bytes
        chunks = self._hand_out(now, force, first_unacked, only_first=background)
        if not chunks:
            return out
        if background:
            try:
                future = self.encoder.submit(_write, self.committer, chunks)
            except RuntimeError:  # the executor is shut down (or cannot start its thread): write here
                log.warning("partition %d: the encoding thread is not available; writing on this one", self.partition)
            else:
                self._encoding = (chunks, future)
                self._encoding_bytes = sum(fe.nbytes() for chunk in chunks for fe in chunk)
                return out
        self._apply_written(chunks, _write(self.committer, chunks, self.assembler.mark_committed), out)
        return out

    def _discard_encoding(self) -> None:
        """Forget a write under way (its episodes belonged to state being dropped). One that has
        not started is cancelled; one that has is waited for, so that nothing else uses the
        committer meanwhile (what it committed is in the manifest: the next claim skips it)."""
        if self._encoding is not None:
            future = self._encoding[1]
            self._encoding = None
            if not future.cancel():
                future.result()  # `_write` returns its errors
        self._forget_upto = None

    def _hand_out(
        self, now: float, force: bool, first_unacked: int | None, only_first: bool = False
    ) -> list[list[FinishedEpisode]]:
        """The chunks to write now (the uncertain append's first; with `only_first` just the
        first), their episodes handed out by the assembler."""
        a = self.assembler
        chunks: list[list[FinishedEpisode]] = []
        if self.uncertain:
            chunks.append(self.uncertain)
        ready = a.ready(now, force=force, first_unacked=first_unacked)
        cur: list[FinishedEpisode] = []
        cur_bytes = 0
        for fe in ready:
            if cur and (len(cur) >= self.rotation.max_episodes or cur_bytes >= self.rotation.max_bytes):
                chunks.append(cur)
                cur, cur_bytes = [], 0
            cur.append(fe)
            cur_bytes += fe.nbytes()
        if cur:
            chunks.append(cur)
        if only_first:
            chunks = chunks[:1]
        a.hand_out([fe for chunk in chunks if chunk is not self.uncertain for fe in chunk])
        return chunks

    def _apply_written(self, chunks: list[list[FinishedEpisode]], done: _Written, out: Tick) -> bool:
        """The outcome of `_write` for these chunks, on the caller's thread: the assembler learns
        what is committed (in the order the commits happened), then each committed chunk is
        accounted, then an error fences the writer or backs it off with the chunks not written.
        False if it stopped (fenced, storage failure)."""
        a = self.assembler
        for eps, last_offset in done.committed:  # already applied when written on this thread
            a.mark_committed(eps, last_offset)
        for chunk, res, seconds in zip(chunks, done.results, done.seconds):
            if chunk is self.uncertain:
                self.uncertain = []
            for fe, _detail in res.unwritable:
                a.drop_unwritable(fe)
            out.unwritable += res.unwritable
            written = {eid for entry in res.entries for eid in entry.episode_ids}
            out.flushed.append(Flushed(res, seconds, [fe for fe in chunk if fe.episode_id in written]))
        err = done.error
        if isinstance(err, FencedError):
            log.error("partition %d: fenced by a newer writer; dropping its state", self.partition)
            self.unclaimed(FENCED_RETRY_S, WriterState.FENCED)
            out.fenced = True
            return False
        if err is not None:  # storage, or MemoryError and the like (data errors come back in unwritable)
            self._back_off(err, [fe for c in chunks[len(done.results) :] for fe in c])
            out.failed = f"{type(err).__name__}: {err}"
            return False
        self.attempts, self.failing_since = 0, None
        self.state = WriterState.ACTIVE
        return True

    def _back_off(self, err: Exception, unwritten: list[FinishedEpisode]) -> None:
        """A flush failed on storage: give the episodes back for the retry (delayed rewards apply
        again) -- except those of an append with an unknown outcome, which stay handed out."""
        a = self.assembler
        uncertain_ids = {fe.episode_id for fe in self.uncertain}
        if isinstance(err, AmbiguousCommitError):
            uncertain_ids |= {fe.episode_id for fe in err.episodes}
        a.give_back([fe for fe in unwritten if fe.episode_id not in uncertain_ids])
        self.uncertain = [fe for fe in unwritten if fe.episode_id in uncertain_ids and fe.episode_id in a.in_flight]
        self.attempts += 1
        backoff = min(30.0, 0.5 * 2 ** min(self.attempts, 6)) * (0.5 + random.random())
        self.next_attempt = time.time() + backoff
        self.failing_since = self.failing_since or time.time()
        self.state = WriterState.BACKING_OFF
        log.error(
            "partition %d: flush failed (%s: %s); retry in %.1fs%s",
            self.partition,
            type(err).__name__,
            err,
            backoff,
            f" ({len(self.uncertain)} episode(s) of an uncertain append kept as they are)" if self.uncertain else "",
        )

    # -- upkeep -------------------------------------------------------------------------------

    def publish_pending(self) -> int:
        """Publish shards committed by earlier flushes whose publish failed (cheap when none);
        nothing while a write is under way (it publishes them first itself)."""
        if self._encoding is not None:
            return 0
        return self.committer.publish_pending()

    def offsets_committed(self, offset: int) -> None:
        """The partition's Kafka offset is committed at `offset`: drop the committed episode ids
        no owner can replay any more (the store decides which: `ShardCommitter.offsets_committed`);
        while a write is under way, once it is applied."""
        if self._encoding is not None:
            self._forget_upto = offset
            return
        self._forget_upto = None
        forgotten = self.committer.offsets_committed(offset)
        if self.assembler is not None:
            for eid in forgotten:
                self.assembler.committed.pop(eid, None)
                self.assembler.committed_steps.pop(eid, None)
