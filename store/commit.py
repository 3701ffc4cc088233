"""The shard commit protocol: finished episodes -> a committed, published shard.

A `ShardCommitter` owns one (topic, partition) of the manifest once it has claimed a writer
epoch. For a commit, per policy id present (see docs/GUARANTEES.md):

  1. encode the episodes into one Parquet shard, in memory;
  2. write it to `{policy}/_staging/{name}` (hidden from Ray Data and RLlib);
  3. append a shard entry to the partition's manifest log (create-once): the commit point.
     A conflict means another writer appended first: if it claimed a newer epoch we are fenced
     (`FencedError`), otherwise drop the episodes it committed and retry with the rest;
  4. publish: move the staged file to `{policy}/{name}`. If that fails (or a conflict reveals an
     entry of ours that landed although its append raised), the entry is *pending*: published
     at the start of the next `commit()` or by `publish_pending()` (the consumer calls it every
     loop tick), re-written from memory if the staged file is gone; the next owner's claim
     rolls it forward if we crash first.

The caller (the consumer) then commits its Kafka offsets and tells the committer
(`offsets_committed`), which forgets committed ids that can no longer be replayed. Shard names derive from (topic,
partition, offset range, writer epoch, attempt), never random ids, and an attempt never
overwrites a file an earlier (maybe landed) attempt staged.

Readers use `read_committed_shard`: a committed shard is readable from the moment its entry
exists, at its published path or, until it is published, at its staging path (and a publish
between the two reads is caught by reading the published path again).
"""

from __future__ import annotations

import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rlrec.producer.events import load_schemas
from rlrec.store.finished import FinishedEpisode
from rlrec.store.manifest import SNAPSHOT_EVERY, ConflictError, FencedError, PartitionLog, ShardEntry, default_writer_id
from rlrec.store.shards import EncodedShard, encode_shard
from rlrec.store.storage import Storage

__all__ = [
    "EVENT_SCHEMA_VERSIONS",
    "AmbiguousCommitError",
    "CommitResult",
    "PreparedShards",
    "ShardCommitter",
    "read_committed_shard",
]

log = logging.getLogger("rlrec.store")

#: newest event schema version per kind, recorded in every shard entry
EVENT_SCHEMA_VERSIONS = dict(sorted(load_schemas()))

#: `on_committed(episodes, entry_last_offset)`: these episodes are in a committed entry
OnCommitted = Callable[[list[FinishedEpisode], int], None]


class AmbiguousCommitError(Exception):
    """Storage failed while appending a shard entry: it may or may not have landed. `episodes`
    must be committed again exactly as they are (a later append finds out: a conflict with the
    landed entry marks them committed); they must not change meanwhile (no delayed rewards)."""

    def __init__(self, episodes: list[FinishedEpisode], cause: BaseException) -> None:
        super().__init__(
            f"append of {len(episodes)} episode(s) failed, outcome unknown: {type(cause).__name__}: {cause}"
        )
        self.episodes = episodes
        self.cause = cause


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


@dataclass
class PreparedShards:
    """Step 1's output (`ShardCommitter.prepare`): encoded shards with their episodes, and the
    episodes the shard format cannot encode (with the reason)."""

    groups: list[tuple[list[FinishedEpisode], EncodedShard]] = field(default_factory=list)
    unwritable: list[tuple[FinishedEpisode, str]] = field(default_factory=list)


class ShardCommitter:
    """Commits lists of finished episodes as shards of one (topic, partition).

    Guarantees: an episode is in at most one committed shard entry (the manifest log's
    create-once appends, with committed ids re-checked on conflict); once another writer has
    claimed the partition, this one commits nothing more (`FencedError`); a staged file becomes
    visible to readers only after its entry exists; a shard this writer committed is published
    by its next flush cycle (`commit` / `publish_pending`) once storage works, from memory if
    its staged file is gone. Use one instance per partition and owner.
    """

    def __init__(
        self,
        storage: Storage | str,
        topic: str = "rl",
        partition: int = 0,
        *,
        fmt: str = "episodes",
        compression: str = "zstd",
        snapshot_every: int | None = None,
    ) -> None:
        self.storage = Storage.from_uri(storage) if isinstance(storage, str) else storage
        self.topic = topic
        self.partition = partition
        self.fmt = fmt
        self.compression = compression
        self.log = PartitionLog(
            self.storage, topic, partition, snapshot_every=SNAPSHOT_EVERY if snapshot_every is None else snapshot_every
        )
        self.epoch: int | None = None
        self._attempt = 0
        #: committed by this writer, not yet published: seq -> (entry, shard bytes)
        self._pending: dict[int, tuple[ShardEntry, bytes]] = {}
        #: staged attempts whose append raised (the entry may have landed): staging path ->
        #: (episode ids, shard). A retry of the same episodes re-uses its name and bytes, so one
        #: copy is kept per set of episodes however often the append fails.
        self._ambiguous: dict[str, tuple[frozenset[str], str, EncodedShard]] = {}
        self._publish_failures = 0
        self._next_publish = 0.0

    def claim(self, replay_from: int | None = None) -> dict[str, int]:
        """Claim a new writer epoch and roll forward unpublished commits.

        Returns the committed episode ids that can still be replayed, each with the last offset
        of its entry: with `replay_from` (the partition's committed Kafka offset, where this
        writer's consumer starts reading) those of entries with `last_offset >= replay_from`
        plus the most recent ones (the newest snapshot's segment and after); without it,
        every committed id (reads the log's whole history).
        """
        self.epoch = self.log.claim(default_writer_id(), replay_from=replay_from)
        recovered = self.log.recover()
        if recovered:
            log.info("partition %d: published %d committed shard(s) left staged by a crash", self.partition, recovered)
        return self.log.committed_last_offsets()

    def offsets_committed(self, offset: int) -> list[str]:
        """The partition's Kafka offset was committed at `offset`: returns the committed episode
        ids forgotten because no owner can replay them any more (see `PartitionLog.forget_before`);
        the caller drops them from its own skip set."""
        return self.log.forget_before(offset)

    @property
    def pending(self) -> list[ShardEntry]:
        """Entries this writer committed that are not published yet."""
        return [e for e, _ in self._pending.values()]

    def publish_pending(self, *, force: bool = False) -> int:
        """Publish the shards this writer committed but could not publish yet (roll forward);
        returns how many were published. Costs nothing when none are pending; after a failure
        it waits (exponential backoff, up to 30 s) unless `force`."""
        if not self._pending or (not force and time.monotonic() < self._next_publish):
            return 0
        done = 0
        for seq, (entry, data) in sorted(self._pending.items()):
            try:
                self.log.publish(entry, data)
            except Exception as e:  # stays pending; retried by the next cycle
                self._publish_failures += 1
                delay = min(30.0, 0.5 * 2 ** min(self._publish_failures, 6)) * (0.5 + random.random())
                self._next_publish = time.monotonic() + delay
                log.warning(
                    "partition %d: publish of %s failed (%s: %s); retry in %.1fs",
                    self.partition,
                    entry.path,
                    type(e).__name__,
                    e,
                    delay,
                )
                return done
            del self._pending[seq]
            done += 1
            log.info("partition %d: rolled forward the publish of %s (seq %d)", self.partition, entry.path, seq)
        self._publish_failures = 0
        return done

    def prepare(self, episodes: Iterable[FinishedEpisode]) -> PreparedShards:
        """Step 1 alone: encode `episodes` into shards, one per policy id (data errors go to
        `unwritable`, see `_encode`). Touches no storage and no state of this committer."""
        by_policy: dict[str, list[FinishedEpisode]] = defaultdict(list)
        for fe in episodes:
            by_policy[fe.policy_id].append(fe)
        prepared = PreparedShards()
        for eps in by_policy.values():
            prepared.groups += self._encode(eps, prepared.unwritable)
        return prepared

    def commit(
        self,
        episodes: Iterable[FinishedEpisode],
        on_committed: OnCommitted | None = None,
    ) -> CommitResult:
        """Commit `episodes` as shards, one per policy id (steps 1-4 above).

        `on_committed(episodes, last_offset)` is called as soon as episodes are known committed,
        by this writer or (found on a conflict) by another one. Episodes the shard format cannot
        encode (data errors) are written nowhere and returned in `CommitResult.unwritable`; the
        others are committed. Claims the partition first if `claim()` was not called. Raises
        `FencedError` when a newer writer claimed the partition, and storage errors as they come
        (the episodes committed before the error stay committed and were reported to
        `on_committed`). The consumer calls it on its encoding thread (`rlrec.consumer.writer`).
        """
        if self.epoch is None:  # a one-off committer (tools, tests): claim on first use
            self.claim()
        self.publish_pending()  # roll forward earlier commits first (unless backing off after a failure)
        prepared = self.prepare(episodes)
        result = CommitResult(unwritable=list(prepared.unwritable))
        pending = list(prepared.groups)
        while pending:
            eps, shard = pending.pop(0)
            entry, remaining = self._commit_one(eps[0].policy_id, eps, shard, on_committed)
            if entry is None:  # a conflict removed some episodes: the rest again
                result.duplicates_dropped += len(eps) - len(remaining)
                if remaining:
                    pending[:0] = self._encode(remaining, result.unwritable)
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
        self, eps: list[FinishedEpisode], unwritable: list[tuple[FinishedEpisode, str]]
    ) -> list[tuple[list[FinishedEpisode], EncodedShard]]:
        """Step 1: encode episodes of one policy into a shard. Encoding touches no storage, so
        whatever it raises is the data's fault: then each episode is tried alone, those that
        fail go to `unwritable` and the rest make the shard (or, if only together they
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
                unwritable.append((fe, f"{type(e).__name__}: {e}"[:1000]))
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
        ids = frozenset(fe.episode_id for fe in eps)
        again = next(((n, sh) for i, n, sh in self._ambiguous.values() if i == ids), None)
        if again is not None:  # the retry of an append with an unknown outcome: the same attempt
            name, shard = again
        else:
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
            self._roll_forward_landed(c.entries)
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
        except FencedError:  # certain: nothing of this writer's lands from now on
            raise
        except Exception as e:  # StorageError: the entry may have landed; the next append finds out
            self._ambiguous[staging] = (ids, name, shard)
            raise AmbiguousCommitError(eps, e) from e
        self._ambiguous.clear()  # entry `seq` was free: no earlier attempt landed
        try:
            self.log.publish(entry, shard.data)  # 4. publish
        except Exception as e:  # committed already: published by the next flush cycle
            self._pending[entry.seq] = (entry, shard.data)
            log.error("partition %d: publish of %s failed (%s); retried next cycle", self.partition, path, e)
        return entry, eps

    def _roll_forward_landed(self, entries: Iterable[object]) -> None:
        """A conflict revealed entries: those of this writer's earlier attempts (an append that
        raised although it landed) are committed and must be published now."""
        for e in entries:
            if isinstance(e, ShardEntry) and e.staging_path in self._ambiguous and e.seq is not None:
                self._pending[e.seq] = (e, self._ambiguous.pop(e.staging_path)[2].data)
        if self._pending:
            self.publish_pending(force=True)


def read_committed_shard(storage: Storage, path: str, staging_path: str | None) -> bytes:
    """The bytes of a committed shard (its entry's `path` and `staging_path`): the published file
    or, until it is published, the staged one. A publish between the two reads (the staged file
    moved to `path` after `path` was found missing) is caught by reading `path` again, so a
    committed shard is never reported missing because it moved: FileNotFoundError means neither
    file exists."""
    try:
        return storage.read(path)
    except FileNotFoundError:
        if not staging_path:
            raise
    try:
        # committed but not yet published (the writer publishes right after committing, or at
        # its next flush cycle, or its next owner rolls the publish forward)
        return storage.read(staging_path)
    except FileNotFoundError:
        pass
    return storage.read(path)  # published meanwhile (publishing moves staging -> path)
