"""`PartitionWriter`: one partition's state machine, from claimed ownership to the offset it may commit.

    CLAIMING --claim ok--> ACTIVE --flush fails (storage)--> BACKING_OFF --retry ok--> ACTIVE
        ^  \\--claim fails (retried)                 \\--fenced--> FENCED --60 s, still assigned--> CLAIMING
        |                                                         any state --drop()--> REVOKED
        +-- re-claim

The exactly-once argument reads in two places: the store's `ShardCommitter.commit` runs steps
1-4 (encode, stage, append to the manifest log -- the commit point --, publish) and owns their
state; this writer adds rotation, backoff and step 5:

  5. the Kafka offset it hands the service (`offset_to_commit`): its assembler's safe offset,
     never past the first event of an episode the committer does not hold committed, nor past a
     dead letter the broker has not acknowledged; once the service committed it
     (`offsets_committed`), the committer forgets the ids no owner can replay any more.

The state drives what the service does with the partition: it reads it only while ACTIVE (every
other state pauses it), re-claims it when a CLAIMING or FENCED writer is due, and commits its
offset only while it holds a claim.

While it holds a claim, `upkeep` renews its owner lease (`rlrec.store.ownership`: tools such as
``rlrec compact`` leave the partition alone; on `lease_executor`, one storage attempt, never on
the caller's thread when one is given) and, with a `Compaction` schedule, compacts the
partition's log (`rlrec.store.compaction`) on the encoder between shard writes.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from enum import Enum

from rlrec.consumer.assembly import AssemblyConfig, Counters, PartitionAssembler
from rlrec.consumer.summary import human_bytes
from rlrec.store.commit import CommitResult, ShardCommitter
from rlrec.store.finished import FinishedEpisode
from rlrec.store.manifest import FencedError
from rlrec.store.ownership import DEFAULT_LEASE_S, one_attempt, release_lease, renew_lease
from rlrec.store.retry import RetrySchedule
from rlrec.store.storage import Storage
from rlrec.store.watermark import write_watermark

__all__ = ["Compaction", "Flushed", "PartitionWriter", "Rotation", "Tick", "WriterState"]

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


@dataclass(frozen=True)
class Compaction:
    """When an owner compacts its partition (`rlrec.store.compaction`): shards at least
    ``after_s`` old merge into shards of up to ``target_bytes``; checked every ``after_s``
    seconds (at least every 5 s), one merged shard per check (a second later while a backlog
    remains)."""

    after_s: float
    target_bytes: int = 128 * 1024 * 1024


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
    """What `_write` did: per committed chunk its result and seconds, and the error that stopped
    it (the chunks after the last result are not committed, or not all of them)."""

    results: list[CommitResult] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    error: Exception | None = None


def _write(committer: ShardCommitter, chunks: list[list[FinishedEpisode]], floor: int | None) -> _Written:
    """Steps 1-4 for each chunk in order, each entry recording where the partition resumes
    (`_positions`), stopping at the first error, which is returned, not raised (on the encoding
    thread or the caller's)."""
    done = _Written()
    position = _positions(committer, chunks, floor)
    for chunk in chunks:
        t0 = time.time()
        try:
            res = committer.commit(chunk, resume_offset=position)
        except Exception as e:  # FencedError, storage, MemoryError: the caller decides
            done.error = e
            break
        done.results.append(res)
        done.seconds.append(time.time() - t0)
    return done


def _positions(
    committer: ShardCommitter, chunks: list[list[FinishedEpisode]], floor: int | None
) -> Callable[[list[FinishedEpisode]], int | None]:
    """The resume position of each shard entry of a write (`ShardEntry.resume_offset`; the one
    place it is decided): `floor` -- what holds the partition outside this write
    (`PartitionWriter.position`) -- held back to the first offset of every episode of the write
    that is not committed once the entry lands: a later shard's, and one the format cannot
    encode (its dead letter is sent after the write; `PartitionWriter.dead_lettered`)."""
    episodes = [fe for chunk in chunks for fe in chunk]

    def position(entry: list[FinishedEpisode]) -> int | None:
        if floor is None:
            return None
        landing = {fe.episode_id for fe in entry}
        held = [
            fe.first_offset
            for fe in episodes
            if fe.episode_id not in landing and committer.committed_offset(fe.episode_id) is None
        ]
        return min([floor, *held])

    return position


class PartitionWriter:
    """Owns one partition: its assembler, its committer (steps 1-4 and their state), its state
    machine, and step 5: the Kafka offset it hands the service.

    Guarantees: an episode is in at most one committed shard entry (the committer's); the
    assembler asks the committer what is committed, so no episode is written twice by this
    owner; a writer whose epoch was superseded never commits again (FENCED); episodes whose
    append had an unknown outcome stay handed out -- unchanged, no delayed reward applied --
    and are committed again first, until a retry settles it (`ShardCommitter.uncertain`); the
    offset it hands out never passes an episode that is not committed.

    With an `encoder` (an executor; the service gives every writer the same one-thread pool),
    steps 1-4 run there while the service reads on: a tick hands the episodes out and starts
    writing them, a later tick (as soon as `due` sees it done, or at once with `force`) applies
    the outcome on the caller's thread -- the assembler lets go of what the committer holds
    committed, failures back off or fence exactly as a synchronous commit's would. Until then the
    episodes are in flight: no delayed reward applies and the partition's safe offset stays at
    or before their first offset, so the Kafka offset cannot pass them. While a write is under
    way the caller's thread leaves the committer's writing alone (`publish_pending` waits,
    `offsets_committed` is applied afterwards) and dropping the writer waits for a write that
    has started.

    Args:
        storage: the output store.
        topic: the transitions topic.
        partition: the partition this writer owns.
        fmt: shard format (``"episodes"`` or ``"tabular"``).
        compression: Parquet codec.
        assembly: assembly limits and policies.
        rotation: when finished episodes become a shard.
        encoder: where steps 1-4 run (None: on the caller's thread).
        counters: what its assemblers count into (shared by a consumer's writers).
        compaction: when it compacts its partition (None: never; `upkeep`).
        lease_s: the owner lease it keeps while claimed (`rlrec.store.ownership`; `upkeep`).
        lease_executor: where lease renewals run (None: on the caller's thread). The consumer
            gives one thread shared by its writers, so a slow store never stalls its polling.
            The partition's watermark is written there too.
        watermark_every_s: the partition's watermark (`rlrec.store.watermark`) is written at
            most this often, when it moved (`upkeep`).
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
        counters: Counters | None = None,
        compaction: Compaction | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        lease_executor: Executor | None = None,
        watermark_every_s: float = 5.0,
    ):
        self.storage = storage
        self.topic = topic
        self.partition = partition
        self.committer = ShardCommitter(storage, topic, partition, fmt=fmt, compression=compression)
        self.assembly_config = assembly or AssemblyConfig()
        self.rotation = rotation or Rotation()
        self.assembler: PartitionAssembler | None = None
        self.state = WriterState.CLAIMING
        self.replay_from: int | None = None  # the Kafka offset the last claim replays from
        self.retry = RetrySchedule()  # failed flushes (wall clock); a claim's retry time too
        self.encoder = encoder
        self.counters = counters if counters is not None else Counters()
        #: chunks handed out and being written on `encoder`, with the future of a `_Written`
        self._encoding: tuple[list[list[FinishedEpisode]], Future] | None = None
        self._encoding_bytes = 0
        self._kafka_committed: int | None = None  # the offset the service last committed for this owner
        #: episodes found unwritable whose dead letters the caller has not sent yet: {id: first offset}
        self._undelivered: dict[str, int] = {}
        self.compaction = compaction
        self.lease_s = lease_s
        self._lease_due = 0.0  # when the owner lease is renewed next (wall clock)
        self.lease_executor = lease_executor
        self._renewing: Future | None = None  # a renewal running on `lease_executor`
        self._lease_storage = one_attempt(storage)
        self._compact_due = 0.0  # when compaction is checked next (wall clock)
        self._compacting: Future | None = None  # a compaction running on `encoder`
        self._compaction_view = None  # a reader of this partition's log, refreshed by each compaction
        self._compaction_removals = None  # a reader of the removal log, made with the view
        self._compaction_avoid: set[int] = set()  # seqs of shards found unmergeable (with the view)
        self.watermark_every_s = watermark_every_s
        self._watermark_due = 0.0  # when the watermark may be written next (wall clock)
        self._watermark: int | None = None  # the value last written by this owner
        self._watermarking: Future | None = None  # a watermark write running on `lease_executor`
        #: the topic's partition count as the consumer last saw it (written with the watermark)
        self.topic_partitions: int | None = None

    @property
    def epoch(self) -> int | None:
        return self.committer.epoch

    @property
    def uncertain(self) -> list[FinishedEpisode]:
        """Handed-out episodes whose last append had an unknown outcome (the committer's)."""
        return self.committer.uncertain

    @property
    def next_attempt(self) -> float:
        """When a claim or a failed flush is tried again (wall clock)."""
        return self.retry.next_at

    @next_attempt.setter
    def next_attempt(self, at: float) -> None:
        self.retry.next_at = at

    @property
    def failing_since(self) -> float | None:
        """Since when flushes fail (None: the last one worked)."""
        return self.retry.since

    @property
    def kafka_committed(self) -> int | None:
        """The Kafka offset the service last committed for this owner (None: none yet)."""
        return self._kafka_committed

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

    def claim(
        self,
        replay_from: int | None = None,
        *,
        from_store: bool = False,
        group: str | None = None,
        deployment: str | None = None,
        start_at: Callable[[], int] | None = None,
    ) -> None:
        """Claim a new writer epoch (the committer rolls forward unpublished commits and learns
        the committed episode ids that can still be replayed from Kafka offset `replay_from`,
        all if None; with `from_store`, from the store's resume position where it has one:
        `replay_from` then says where reading resumes, None if the store has no position) and
        start a new assembler that asks it. `group` and `deployment` name the writer in its
        claim; `start_at` says where a partition the store holds nothing of starts, recorded in
        the claim (`PartitionLog.claim`). Raises on storage errors (the state stays CLAIMING)."""
        self._discard_encoding()  # before the committer is used here (none is under way: unclaimed() waited)
        self.committer.claim(
            replay_from, from_position=from_store, group=group, deployment=deployment, start_at=start_at
        )
        if from_store:
            replay_from = self.committer.resume_offset
        self.replay_from = replay_from
        self._kafka_committed = None
        self._undelivered = {}
        self.assembler = PartitionAssembler(
            self.topic, self.partition, self.committer, self.assembly_config, self.counters
        )
        self.state = WriterState.ACTIVE
        self.retry.succeeded()
        log.info(
            "partition %d: claimed epoch %d (committed episodes replayable from offset %s are skipped)",
            self.partition,
            self.epoch,
            replay_from,
        )

    def unclaimed(self, retry_in: float, state: WriterState = WriterState.CLAIMING) -> None:
        """No claim held (it failed, or we were fenced): drop the state, claim again later and
        start over from the store's position."""
        self._release(state)
        self.retry.next_at = time.time() + retry_in

    def claim_due(self, now: float) -> bool:
        return self.state in (WriterState.CLAIMING, WriterState.FENCED) and now >= self.next_attempt

    def drop(self) -> None:
        """Forget all in-memory state (revoked). Uncommitted episodes are replayed by the next
        owner from the store's position."""
        self._release(WriterState.REVOKED)

    def _release(self, state: WriterState) -> None:
        self.assembler = None
        self._kafka_committed = None
        self._undelivered = {}
        self._discard_encoding()
        self._finish_compaction(wait=True)
        self._compaction_view = None
        self._compaction_avoid = set()
        self._lease_due = 0.0
        self.state = state

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
            if not ok or not force:
                return out
        background = self.encoder is not None and not force
        # in the background one shard at a time: in memory, one shard's episodes and its bytes
        chunks = self._hand_out(now, force, first_unacked, only_first=background)
        if not chunks:
            return out
        floor = self.position(first_unacked, writing=(fe.episode_id for chunk in chunks for fe in chunk))
        if background:
            try:
                future = self.encoder.submit(_write, self.committer, chunks, floor)
            except RuntimeError:  # the executor is shut down (or cannot start its thread): write here
                log.warning("partition %d: the encoding thread is not available; writing on this one", self.partition)
            else:
                self._encoding = (chunks, future)
                self._encoding_bytes = sum(fe.nbytes() for chunk in chunks for fe in chunk)
                return out
        self._apply_written(chunks, _write(self.committer, chunks, floor), out)
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

    def _hand_out(
        self, now: float, force: bool, first_unacked: int | None, only_first: bool = False
    ) -> list[list[FinishedEpisode]]:
        """The chunks to write now (the uncertain append's first; with `only_first` just the
        first), their episodes handed out by the assembler."""
        a = self.assembler
        uncertain = self.uncertain
        chunks: list[list[FinishedEpisode]] = [uncertain] if uncertain else []
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
        a.hand_out([fe for chunk in chunks[1 if uncertain else 0 :] for fe in chunk])  # uncertain: still out
        return chunks

    def _apply_written(self, chunks: list[list[FinishedEpisode]], done: _Written, out: Tick) -> bool:
        """The outcome of `_write` for these chunks, on the caller's thread: the assembler lets go
        of every episode the committer now holds committed, each committed chunk is accounted,
        then an error fences the writer or backs it off with the chunks not written. False if it
        stopped (fenced, storage failure)."""
        a = self.assembler
        committed = self.committer.committed_offset
        a.mark_committed(fe for chunk in chunks for fe in chunk if committed(fe.episode_id) is not None)
        if done.results and self.committer.resume_offset is not None:
            # no owner resumes before the store's position: the ids no replay can meet go
            self.committer.offsets_committed(self.committer.resume_offset)
        for res, seconds in zip(done.results, done.seconds):
            for fe, _detail in res.unwritable:
                a.drop_unwritable(fe)
                self._undelivered[fe.episode_id] = fe.first_offset  # held until the caller dead-letters it
            out.unwritable += res.unwritable
            out.flushed.append(Flushed(res, seconds, res.written))
        err = done.error
        if isinstance(err, FencedError):
            log.error("partition %d: fenced by a newer writer; dropping its state", self.partition)
            self.unclaimed(FENCED_RETRY_S, WriterState.FENCED)
            out.fenced = True
            return False
        if err is not None:  # storage, or MemoryError and the like (data errors come back in unwritable)
            self._back_off(err, (fe for c in chunks[len(done.results) :] for fe in c))
            out.failed = f"{type(err).__name__}: {err}"
            return False
        self.retry.succeeded()
        self.state = WriterState.ACTIVE
        return True

    def _back_off(self, err: Exception, unwritten: Iterable[FinishedEpisode]) -> None:
        """A flush failed on storage: give the episodes that are not committed back for the retry
        (delayed rewards apply again) -- except those of an append with an unknown outcome, which
        stay handed out."""
        a = self.assembler
        keep = {fe.episode_id for fe in self.uncertain}
        a.give_back(fe for fe in unwritten if fe.episode_id not in keep)
        wait = self.retry.failed(time.time())
        self.state = WriterState.BACKING_OFF
        log.error(
            "partition %d: flush failed (%s: %s); retry in %.1fs%s",
            self.partition,
            type(err).__name__,
            err,
            wait,
            f" ({len(keep)} episode(s) of an uncertain append kept as they are)" if keep else "",
        )

    # -- step 5: the Kafka offset -------------------------------------------------------------

    def position(self, first_unacked: int | None, writing: Iterable[str] = ()) -> int | None:
        """Where the partition resumes once the episodes `writing` (handed out) are committed,
        or None (no claim, or nothing read yet): the assembler's safe offset -- never past the
        first event of an episode the committer does not hold committed --, never past an
        episode found unwritable whose dead letter the caller has not sent (`dead_lettered`),
        and never past `first_unacked`, the partition's first dead letter the broker has not
        acknowledged. What each shard entry records (`_positions`) and what the service
        commits to the consumer group (`offset_to_commit`)."""
        if self.assembler is None:
            return None
        off = self.assembler.safe_offset(writing)
        if off is None:
            return None
        held = [*self._undelivered.values(), *([] if first_unacked is None else [first_unacked])]
        return min([off, *held])

    def dead_lettered(self, episode_ids: Iterable[str]) -> None:
        """The caller sent these unwritable episodes' dead letters (`Tick.unwritable`), at their
        first offsets: from now on the dead-letter queue holds the position there until the
        broker acknowledges them (`first_unacked`)."""
        for eid in episode_ids:
            self._undelivered.pop(eid, None)

    def offset_to_commit(self, first_unacked: int | None) -> int | None:
        """The Kafka offset the service may commit for this partition now (`position`), or None
        (no claim, or nothing read yet). Handed out again while it does not move, so that the
        group's offset, which lag tools read, comes back where another output's consumer of the
        same group moved it."""
        return self.position(first_unacked)

    def offsets_committed(self, offset: int) -> None:
        """The service committed `offset` for this partition to the consumer group. Only for
        lag tools and the next `offset_to_commit`: where the partition resumes is the store's
        position (`ShardEntry.resume_offset`), and the committer forgets committed ids below it
        as each write is applied."""
        self._kafka_committed = offset

    # -- upkeep -------------------------------------------------------------------------------

    def upkeep(self, now: float) -> None:
        """While claimed: renew the owner lease (every third of `lease_s`) and, with
        `compaction`, compact the partition when due -- on the `encoder` after the shard being
        written, so commits and compaction of this log never run at once. Storage errors are
        logged and retried at the next due time; they never stop the writer."""
        if self.state not in (WriterState.ACTIVE, WriterState.BACKING_OFF) or self.epoch is None:
            return
        if now >= self._lease_due and (self._renewing is None or self._renewing.done()):
            # staggered: the writers claimed together do not all renew at once
            self._lease_due = now + self.lease_s / 3 * random.uniform(0.8, 1.0)
            writer, epoch = self.committer.log.writer_id or "", self.epoch
            if self.lease_executor is None:
                self._renew(writer, epoch)
            else:
                try:
                    self._renewing = self.lease_executor.submit(self._renew, writer, epoch)
                except RuntimeError:  # the executor is shut down: nothing more to renew
                    pass
        self._keep_watermark(now)
        self._finish_compaction(wait=False)
        c = self.compaction
        if c is None or c.after_s <= 0 or self._compacting is not None or now < self._compact_due:
            return
        self._compact_due = now + max(5.0, c.after_s)
        if self.encoder is None:
            self._compacted(self._compact)
            return
        try:
            self._compacting = self.encoder.submit(self._compact)
        except RuntimeError:  # the executor is shut down: compact at the next due time
            pass

    def _keep_watermark(self, now: float) -> None:
        """Write the partition's watermark (`PartitionAssembler.open_since_ms`) when it moved, at
        most every `watermark_every_s`, on `lease_executor`. Decided here, on the caller's
        thread, after every write's outcome is applied: it never passes an episode whose entry
        has not landed. A storage error is logged; the next due time writes it again."""
        if self.assembler is None or now < self._watermark_due:
            return
        if self._watermarking is not None and not self._watermarking.done():
            return
        value = self.assembler.open_since_ms(now)
        if value is None or value == self._watermark:
            return
        self._watermark_due = now + self.watermark_every_s
        writer, epoch, n = self.committer.log.writer_id, self.epoch, self.topic_partitions
        if self.lease_executor is None:
            self._write_watermark(value, writer, epoch, n)
            return
        try:
            self._watermarking = self.lease_executor.submit(self._write_watermark, value, writer, epoch, n)
        except RuntimeError:  # the executor is shut down: nothing more to write
            pass

    def _write_watermark(self, value: int, writer: str | None, epoch: int | None, partitions: int | None) -> None:
        try:
            write_watermark(
                self._lease_storage,
                self.topic,
                self.partition,
                value,
                epoch=epoch,
                writer=writer,
                partitions=partitions,
            )
            self._watermark = value
        except Exception as e:  # a hint: the next due time writes it again
            log.warning("partition %d: cannot write the watermark (%s)", self.partition, e)

    def release_lease(self) -> None:
        """A clean stop, after the last commit: mark the owner lease released, so tools such as
        ``rlrec compact`` take the partition at once. A renewal in flight is waited for first
        (it would overwrite the release); a storage error is logged (the lease then expires)."""
        if self.state not in (WriterState.ACTIVE, WriterState.BACKING_OFF) or self.epoch is None:
            return
        if self._renewing is not None:
            try:
                self._renewing.result(timeout=10)
            except Exception:
                pass
        try:
            release_lease(
                self._lease_storage,
                self.topic,
                self.partition,
                writer=self.committer.log.writer_id or "",
                epoch=self.epoch,
                ttl_s=self.lease_s,
            )
        except Exception as e:
            log.warning(
                "partition %d: cannot release the owner lease (%s); it expires in %.0f s",
                self.partition,
                e,
                self.lease_s,
            )

    def _renew(self, writer: str, epoch: int) -> None:
        try:
            renew_lease(self._lease_storage, self.topic, self.partition, writer=writer, epoch=epoch, ttl_s=self.lease_s)
        except Exception as e:  # a lease is a courtesy: the next renewal tries again
            log.warning("partition %d: cannot renew the owner lease (%s)", self.partition, e)

    def _compact(self):
        from rlrec.store.compaction import compact_partition
        from rlrec.store.manifest import PartitionLog
        from rlrec.store.retention import RemovalLogView

        c = self.compaction
        if self._compaction_view is None:
            self._compaction_view = PartitionLog(self.storage, self.topic, self.partition, snapshot_every=0)
            self._compaction_removals = RemovalLogView(self.storage)
        return compact_partition(
            self.committer.log,
            target_bytes=c.target_bytes,
            min_age_s=c.after_s,
            compression=self.committer.compression,
            max_runs=1,
            view=self._compaction_view,
            avoid=self._compaction_avoid,
            removals=self._compaction_removals,
        )

    def _finish_compaction(self, *, wait: bool) -> None:
        f = self._compacting
        if f is None or not (wait or f.done()):
            return
        self._compacting = None
        if wait and f.cancel():
            return
        self._compacted(f.result)

    def _compacted(self, result) -> None:
        try:
            res = result()
        except FencedError:
            log.warning("partition %d: compaction stopped: a newer writer claimed the partition", self.partition)
            return
        except Exception as e:  # storage: the next due time re-plans from the log
            log.warning("partition %d: compaction failed (%s: %s); retried later", self.partition, type(e).__name__, e)
            return
        if res.remaining:  # a backlog (compaction just turned on): the next run soon, not in after_s
            self._compact_due = min(self._compact_due, time.time() + 1.0)
        if res.written:
            log.info(
                "partition %d: compacted %d shard(s) (%s) into %d (%s)",
                self.partition,
                res.replaced,
                human_bytes(res.bytes_before),
                res.written,
                human_bytes(res.bytes_after),
            )

    def publish_pending(self) -> int:
        """Publish shards committed by earlier flushes whose publish failed (cheap when none);
        nothing while a write is under way (it publishes them first itself)."""
        if self._encoding is not None:
            return 0
        return self.committer.publish_pending()
