"""The shard commit protocol: finished episodes -> a committed, published shard.

A `ShardCommitter` owns one (topic, partition) of the manifest once it has claimed a writer
epoch. For a commit, per policy id present (see docs/GUARANTEES.md):

  1. encode the episodes into one Parquet shard, in memory;
  2. write it to `{policy}/_staging/{name}` (hidden from Ray Data and RLlib);
  3. append a shard entry to the partition's manifest log (create-once): the commit point.
     A conflict means another writer appended first: if it claimed a newer epoch we are fenced
     (`FencedError`), otherwise drop the episodes it committed and retry with the rest;
  4. publish: move the staged file to `{policy}/{name}` (rolled forward by the next owner's
     claim if we crash first).

The caller (the consumer) then commits its Kafka offsets. Shard names derive from (topic,
partition, offset range, writer epoch, attempt), never random ids, and an attempt never
overwrites a file an earlier (maybe landed) attempt staged.

Readers use `read_committed_shard`: a committed shard is readable from the moment its entry
exists, at its published path or, until it is published, at its staging path.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rlrec.producer.events import load_schemas
from rlrec.store.finished import FinishedEpisode
from rlrec.store.manifest import ConflictError, PartitionLog, ShardEntry, default_writer_id
from rlrec.store.shards import EncodedShard, encode_shard
from rlrec.store.storage import Storage

__all__ = ["EVENT_SCHEMA_VERSIONS", "CommitResult", "ShardCommitter", "read_committed_shard"]

log = logging.getLogger("rlrec.store")

#: newest event schema version per kind, recorded in every shard entry
EVENT_SCHEMA_VERSIONS = dict(sorted(load_schemas()))

#: `on_committed(episodes, entry_last_offset)`: these episodes are in a committed entry
OnCommitted = Callable[[list[FinishedEpisode], int], None]


@dataclass
class CommitResult:
    """What one `ShardCommitter.commit` call committed (by this writer)."""

    shards: int = 0
    episodes: int = 0
    steps: int = 0
    bytes: int = 0
    duplicates_dropped: int = 0  # episodes another writer had committed already
    entries: list[ShardEntry] = field(default_factory=list)
    #: episodes the shard format cannot encode (data errors: written nowhere), with the reason
    unwritable: list[tuple[FinishedEpisode, str]] = field(default_factory=list)


class ShardCommitter:
    """Commits lists of finished episodes as shards of one (topic, partition).

    Guarantees: an episode is in at most one committed shard entry (the manifest log's
    create-once appends, with committed ids re-checked on conflict); once another writer has
    claimed the partition, this one commits nothing more (`FencedError`); a staged file becomes
    visible to readers only after its entry exists. Use one instance per partition and owner.
    """

    def __init__(
        self,
        storage: Storage | str,
        topic: str = "rl",
        partition: int = 0,
        *,
        fmt: str = "episodes",
        compression: str = "zstd",
    ) -> None:
        self.storage = Storage.from_uri(storage) if isinstance(storage, str) else storage
        self.topic = topic
        self.partition = partition
        self.fmt = fmt
        self.compression = compression
        self.log = PartitionLog(self.storage, topic, partition)
        self.epoch: int | None = None
        self._attempt = 0

    def claim(self) -> dict[str, int]:
        """Claim a new writer epoch and roll forward unpublished commits.

        Returns the committed episode ids, each with the last offset of its entry."""
        self.epoch = self.log.claim(default_writer_id())
        recovered = self.log.recover()
        if recovered:
            log.info("partition %d: published %d committed shard(s) left staged by a crash", self.partition, recovered)
        committed: dict[str, int] = {}
        for e in self.log.shard_entries():
            for eid in e.episode_ids:
                committed[eid] = e.last_offset
        return committed

    def commit(self, episodes: Iterable[FinishedEpisode], on_committed: OnCommitted | None = None) -> CommitResult:
        """Commit `episodes` as shards, one per policy id (steps 1-4 above).

        `on_committed(episodes, last_offset)` is called as soon as episodes are known committed,
        by this writer or (found on a conflict) by another one. Episodes the shard format cannot
        encode (data errors) are written nowhere and returned in `CommitResult.unwritable`; the
        others are committed. Claims the partition first if `claim()` was not called. Raises
        `FencedError` when a newer writer claimed the partition, and storage errors as they come
        (the episodes committed before the error stay committed and were reported to
        `on_committed`).
        """
        if self.epoch is None:  # a one-off committer (tools, tests): claim on first use
            self.claim()
        result = CommitResult()
        by_policy: dict[str, list[FinishedEpisode]] = defaultdict(list)
        for fe in episodes:
            by_policy[fe.policy_id].append(fe)
        pending = [group for eps in by_policy.values() for group in self._encode(eps, result)]
        while pending:
            eps, shard = pending.pop(0)
            entry, remaining = self._commit_one(eps[0].policy_id, eps, shard, on_committed)
            if entry is None:  # a conflict removed some episodes: the rest again
                result.duplicates_dropped += len(eps) - len(remaining)
                if remaining:
                    pending[:0] = self._encode(remaining, result)
                continue
            if on_committed is not None:
                on_committed(eps, entry.last_offset)
            result.shards += 1
            result.episodes += entry.episodes
            result.steps += entry.steps
            result.bytes += entry.bytes
            result.entries.append(entry)
        return result

    def _encode(
        self, eps: list[FinishedEpisode], result: CommitResult
    ) -> list[tuple[list[FinishedEpisode], EncodedShard]]:
        """Step 1: encode episodes of one policy into a shard. Encoding touches no storage, so
        whatever it raises is the data's fault: then each episode is tried alone, those that
        fail go to `result.unwritable` and the rest make the shard (or, if only together they
        fail -- e.g. tabular episodes whose spaces give different column types -- a shard each)."""
        try:
            return [(eps, encode_shard(eps, fmt=self.fmt, compression=self.compression))]
        except MemoryError:  # the machine's fault, not the data's
            raise
        except Exception as e:
            log.warning(
                "partition %d: %d episode(s) do not encode together (%s); trying them alone",
                self.partition,
                len(eps),
                e,
            )
        alone = []
        for fe in eps:
            try:
                alone.append(([fe], encode_shard([fe], fmt=self.fmt, compression=self.compression)))
            except MemoryError:
                raise
            except Exception as e:
                result.unwritable.append((fe, f"{type(e).__name__}: {e}"[:1000]))
        good = [group[0][0] for group in alone]
        if 1 < len(good) < len(eps):
            try:
                return [(good, encode_shard(good, fmt=self.fmt, compression=self.compression))]
            except Exception:
                pass
        return alone

    def _commit_one(
        self, policy_id: str, eps: list[FinishedEpisode], shard: EncodedShard, on_committed: OnCommitted | None
    ) -> tuple[ShardEntry | None, list[FinishedEpisode]]:
        first = min(fe.first_offset for fe in eps)
        last = max(fe.last_offset for fe in eps)
        self._attempt += 1
        name = f"{self.topic}+{self.partition:05d}+{first:020d}+{last:020d}+e{self.epoch}.{self._attempt}.parquet"
        path = f"{policy_id}/{name}"
        staging = f"{policy_id}/_staging/{name}"
        self.storage.write(staging, shard.data)  # 2. stage
        versions = sorted({fe.policy_version for fe in eps})
        entry = ShardEntry(
            path=path,
            staging_path=staging,
            topic=self.topic,
            partition=self.partition,
            policy_id=policy_id,
            first_offset=first,
            last_offset=last,
            episode_ids=list(shard.episode_ids),
            episodes=shard.episodes,
            steps=shard.steps,
            bytes=len(shard.data),
            sha256=shard.sha256,
            format=shard.fmt,
            format_version=shard.schema_version,
            event_schema_versions=EVENT_SCHEMA_VERSIONS,
            commit_time=time.time(),
            min_policy_version=versions[0],
            max_policy_version=versions[-1],
        )
        try:
            entry = self.log.append_shard(entry)  # 3. the commit point (FencedError propagates)
        except ConflictError as c:
            taken = {eid for e in c.entries if isinstance(e, ShardEntry) for eid in e.episode_ids}
            if on_committed is not None:
                for e in c.entries:
                    if isinstance(e, ShardEntry):
                        on_committed([fe for fe in eps if fe.episode_id in taken], e.last_offset)
            log.warning(
                "partition %d: manifest conflict; %d episode(s) were committed by another writer",
                self.partition,
                sum(fe.episode_id in taken for fe in eps),
            )
            return None, [fe for fe in eps if fe.episode_id not in taken]
        try:
            self.storage.move(staging, path)  # 4. publish
        except Exception as e:  # committed already; the next claim rolls the publish forward
            log.error(
                "partition %d: publish of %s failed (%s); it stays staged until recovered", self.partition, path, e
            )
        return entry, eps


def read_committed_shard(storage: Storage, path: str, staging_path: str | None) -> bytes:
    """The bytes of a committed shard (its entry's `path` and `staging_path`): the published file
    or, until it is published, the staged one."""
    try:
        return storage.read(path)
    except FileNotFoundError:
        if not staging_path:
            raise
        # committed but not yet published (the writer publishes right after committing, or its
        # next owner rolls the publish forward): the staged file is the committed content
        return storage.read(staging_path)
