"""`PartitionWriter`: one partition's state machine from claimed ownership to committed shards.

    ASSIGNED --claim()--> ACTIVE --flush()*--> ... --drop()--> REVOKED
                              \\--FencedError--> FENCED (state dropped; the new owner replays)

A flush commits episodes with the store's commit protocol (`rlrec.store.commit`: encode,
stage, manifest append, publish) and marks them committed in the partition's assembler; the
caller then commits the Kafka offset `assembler.safe_offset()` (docs/GUARANTEES.md).
"""

from __future__ import annotations

import logging

from rlrec.consumer.assembly import AssemblyConfig, PartitionAssembler
from rlrec.store.commit import CommitResult, ShardCommitter
from rlrec.store.finished import FinishedEpisode
from rlrec.store.manifest import FencedError
from rlrec.store.storage import Storage

__all__ = ["PartitionWriter"]

log = logging.getLogger("rlrec.consumer")


class PartitionWriter:
    """Owns one partition: its assembler, its manifest log and its writer epoch.

    Guarantees: an episode is in at most one committed shard entry, and the assembler learns of
    every committed episode before `flush` returns or raises (so none is written twice by this
    owner); a writer whose epoch was superseded never commits again (FencedError).
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
    ):
        self.topic = topic
        self.partition = partition
        self.committer = ShardCommitter(storage, topic, partition, fmt=fmt, compression=compression)
        self.assembly_config = assembly or AssemblyConfig()
        self.assembler: PartitionAssembler | None = None
        self.state = "ASSIGNED"
        self.replay_from: int | None = None  # the committed Kafka offset the last claim replays from
        self.failing_since: float | None = None
        self.next_attempt = 0.0
        self.attempts = 0

    @property
    def epoch(self) -> int | None:
        return self.committer.epoch

    # -- ownership ----------------------------------------------------------------------------

    def claim(self, replay_from: int | None = None) -> None:
        """Claim a new writer epoch, roll forward unpublished commits, load the committed episode
        ids that can still be replayed from Kafka offset `replay_from` (all if None)."""
        committed = self.committer.claim(replay_from)
        self.replay_from = replay_from
        self.assembler = PartitionAssembler(self.topic, self.partition, committed, self.assembly_config)
        self.state = "ACTIVE"
        log.info(
            "partition %d: claimed epoch %d (%d committed episodes that can be replayed from offset %s)",
            self.partition,
            self.epoch,
            len(committed),
            replay_from,
        )

    # -- flushing -----------------------------------------------------------------------------

    def flush(self, episodes: list[FinishedEpisode]) -> CommitResult:
        """Commit `episodes` (already handed out by the assembler) as shards, one per policy id.

        On a storage error the caller gives the episodes back (`assembler.give_back`) and retries
        later; on FencedError the caller drops this writer.
        """
        try:
            return self.committer.commit(episodes, on_committed=self.assembler.mark_committed)
        except FencedError:
            self.state = "FENCED"
            raise

    def publish_pending(self) -> int:
        """Publish shards committed by earlier flushes whose publish failed (cheap when none)."""
        return self.committer.publish_pending()

    def offsets_committed(self, offset: int) -> None:
        """The partition's Kafka offset is committed at `offset`: drop the committed episode ids
        no owner can replay any more (the store decides which: `ShardCommitter.offsets_committed`)."""
        forgotten = self.committer.offsets_committed(offset)
        if self.assembler is not None:
            for eid in forgotten:
                self.assembler.committed.pop(eid, None)

    def drop(self) -> None:
        """Forget all in-memory state (revoked or fenced). Uncommitted episodes are replayed by the
        next owner from the committed Kafka offset."""
        self.assembler = None
        if self.state != "FENCED":
            self.state = "REVOKED"
