"""`PartitionWriter`: one partition's state machine from claimed ownership to committed shards.

    ASSIGNED --claim()--> ACTIVE --flush()*--> ... --close()--> REVOKED
                              \\--FencedError--> FENCED (state dropped; the new owner replays)

Commit protocol for a flush (see docs/GUARANTEES.md), per policy id present:
  1. encode the ready episodes into one Parquet shard, in memory;
  2. write it to `{policy}/_staging/{name}` (hidden from Ray Data and RLlib);
  3. append a shard entry to the partition's manifest log (create-once): the commit point.
     A conflict means another writer appended first: if it claimed a newer epoch we are fenced,
     otherwise drop the episodes it committed and retry;
  4. publish: move the staged file to `{policy}/{name}` (rolled forward by the next owner if we
     crash first);
  5. the caller commits the Kafka offset `assembler.safe_offset()`.
Shard names derive from (topic, partition, offset range, writer epoch), never random ids.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass

from consumer.assembly import AssemblyConfig, PartitionAssembler
from consumer.finished import FinishedEpisode
from consumer.manifest import ConflictError, FencedError, PartitionLog, ShardEntry
from consumer.shards import encode_shard
from consumer.storage import Storage
from producer.events import load_schemas

EVENT_SCHEMA_VERSIONS = {kind: v for kind, v in sorted(load_schemas())}  # newest version per kind

__all__ = ["PartitionWriter", "FlushResult", "WRITER_ID"]

log = logging.getLogger("rlrec.consumer")

WRITER_ID = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass
class FlushResult:
    shards: int = 0
    episodes: int = 0
    steps: int = 0
    bytes: int = 0
    duplicates_dropped: int = 0
    entries: list | None = None


class PartitionWriter:
    """Owns one partition: its assembler, its manifest log and its writer epoch.

    Guarantees: an episode is in at most one committed shard entry (the manifest log's
    create-once appends, with committed ids re-checked on conflict); a writer whose epoch was
    superseded never commits again (FencedError); staged files become visible to readers only
    after their entry exists.
    """

    def __init__(self, storage: Storage, topic: str, partition: int, *, fmt: str = "episodes",
                 compression: str = "zstd", assembly: AssemblyConfig | None = None):
        self.storage = storage
        self.topic = topic
        self.partition = partition
        self.fmt = fmt
        self.compression = compression
        self.log = PartitionLog(storage, topic, partition)
        self.assembly_config = assembly or AssemblyConfig()
        self.assembler: PartitionAssembler | None = None
        self.state = "ASSIGNED"
        self.epoch: int | None = None
        self.failing_since: float | None = None
        self.next_attempt = 0.0
        self.attempts = 0
        self.attempt_seq = 0

    # -- ownership ----------------------------------------------------------------------------

    def claim(self) -> None:
        """Claim a new writer epoch, roll forward unpublished commits, load committed episode ids."""
        self.epoch = self.log.claim(WRITER_ID)
        recovered = self.log.recover()
        if recovered:
            log.info("partition %d: published %d committed shard(s) left staged by a crash", self.partition, recovered)
        committed: dict[str, int] = {}
        for e in self.log.shard_entries():
            for eid in e.episode_ids:
                committed[eid] = e.last_offset
        self.assembler = PartitionAssembler(self.topic, self.partition, committed, self.assembly_config)
        self.state = "ACTIVE"
        log.info("partition %d: claimed epoch %d (%d committed episodes known)", self.partition, self.epoch,
                 len(committed))

    # -- flushing -----------------------------------------------------------------------------

    def flush(self, episodes: list[FinishedEpisode]) -> FlushResult:
        """Commit `episodes` (already handed out by the assembler) as shards, one per policy id.

        On a storage error the caller gives the episodes back (`assembler.give_back`) and retries
        later; on FencedError the caller drops this writer.
        """
        result = FlushResult(entries=[])
        by_policy: dict[str, list[FinishedEpisode]] = defaultdict(list)
        for fe in episodes:
            by_policy[fe.policy_id].append(fe)
        for policy_id, eps in by_policy.items():
            while eps:
                entry, shard = self._commit_one(policy_id, eps)
                if entry is None:  # a conflict removed some episodes; `shard` holds the survivors
                    result.duplicates_dropped += len(eps) - len(shard)
                    eps = shard
                    continue
                self.assembler.mark_committed(eps, entry.last_offset)
                result.shards += 1
                result.episodes += entry.episodes
                result.steps += entry.steps
                result.bytes += entry.bytes
                result.entries.append(entry)
                break
        return result

    def _commit_one(self, policy_id: str, eps: list[FinishedEpisode]):
        first = min(fe.first_offset for fe in eps)
        last = max(fe.last_offset for fe in eps)
        shard = encode_shard(eps, fmt=self.fmt, compression=self.compression)
        # unique per append attempt, so a retry never overwrites a file an earlier (maybe landed)
        # attempt staged; still derived from the offsets and the writer epoch, not a random id
        self.attempt_seq += 1
        name = f"{self.topic}+{self.partition:05d}+{first:020d}+{last:020d}+e{self.epoch}.{self.attempt_seq}.parquet"
        path = f"{policy_id}/{name}"
        staging = f"{policy_id}/_staging/{name}"
        self.storage.write(staging, shard.data)
        versions = sorted({fe.policy_version for fe in eps})
        entry = ShardEntry(
            path=path, staging_path=staging, topic=self.topic, partition=self.partition, policy_id=policy_id,
            first_offset=first, last_offset=last, episode_ids=list(shard.episode_ids), episodes=shard.episodes,
            steps=shard.steps, bytes=len(shard.data), sha256=shard.sha256, format=shard.fmt,
            format_version=shard.schema_version, event_schema_versions=EVENT_SCHEMA_VERSIONS,
            commit_time=time.time(), min_policy_version=versions[0], max_policy_version=versions[-1],
        )
        try:
            entry = self.log.append_shard(entry)
        except ConflictError as c:
            taken = {eid for e in c.entries if isinstance(e, ShardEntry) for eid in e.episode_ids}
            for e in c.entries:
                if isinstance(e, ShardEntry):
                    self.assembler.mark_committed([fe for fe in eps if fe.episode_id in taken], e.last_offset)
            log.warning("partition %d: manifest conflict; %d episode(s) were committed by another writer",
                        self.partition, sum(fe.episode_id in taken for fe in eps))
            return None, [fe for fe in eps if fe.episode_id not in taken]
        except FencedError:
            self.state = "FENCED"
            raise
        try:
            self.storage.move(staging, path)
        except Exception as e:  # committed already; the next claim rolls the publish forward
            log.error("partition %d: publish of %s failed (%s); it stays staged until recovered", self.partition, path, e)
        return entry, shard

    def drop(self) -> None:
        """Forget all in-memory state (revoked or fenced). Uncommitted episodes are replayed by the
        next owner from the committed Kafka offset."""
        self.assembler = None
        if self.state != "FENCED":
            self.state = "REVOKED"
