"""The shard commit protocol: finished episodes -> a committed, published shard.

One `ShardCommitter` per (topic, partition) and owner runs steps 1-4 of the protocol in one
method, `ShardCommitter.commit` (docs/GUARANTEES.md quotes them from there), and owns all their
state: the writer epoch, the attempt counter, the shards committed but not yet published, the
appends whose outcome is unknown, and -- through the partition's manifest log -- the committed
episode ids. Callers ask it (`committed_offset`, `committed_length`, `uncertain`); they keep no
copy. It needs no Kafka: the consumer's `PartitionWriter` adds step 5 (the Kafka offset) on top,
and `rlrec convert` commits through it directly.

Readers use `read_committed_shard`: a committed shard is readable from the moment its entry
exists, at its published path or, until it is published, at its staging path (and a publish
between the two reads is caught by reading the published path again).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rlrec.producer.events import load_schemas
from rlrec.store.finished import FinishedEpisode, steps_without_logp
from rlrec.store.manifest import (
    SNAPSHOT_EVERY,
    ConflictError,
    EntryTooLargeError,
    FencedError,
    PartitionLog,
    ShardEntry,
    default_writer_id,
)
from rlrec.store.multi_agent_finished import FinishedAgentRow, encode_agent_rows
from rlrec.store.retry import RetrySchedule
from rlrec.store.shards import EncodedShard, encode_shard
from rlrec.store.storage import Storage

__all__ = [
    "EVENT_SCHEMA_VERSIONS",
    "AmbiguousCommitError",
    "CommitResult",
    "ShardCommitter",
    "read_committed_shard",
    "read_gated_shard",
]

log = logging.getLogger("rlrec.store")


#: tests only (tests/test_multi_agent_kill9.py): a marker file path; the first time an entry is
#: appended while a sibling row of one of its multi-agent episodes is not committed yet, the
#: process writes the episode id there and kills itself with SIGKILL (a crash between two
#: modules' entries, deterministically)
_KILL_BETWEEN_ENTRIES = "RLREC_TEST_KILL_BETWEEN_ENTRIES"


def _kill_between_entries(eps: list[FinishedEpisode], committed: Callable[[str], int | None]) -> None:
    """The `_KILL_BETWEEN_ENTRIES` fault hook, after `eps`' entry landed: `committed` answers
    `ShardCommitter.committed_offset`."""
    marker = os.environ[_KILL_BETWEEN_ENTRIES]
    split = sorted(
        fe.multi_agent_episode_id
        for fe in eps
        if isinstance(fe, FinishedAgentRow) and any(committed(sa.id_) is None for sa in fe.episode.rows.values())
    )
    if split and not os.path.exists(marker):
        with open(marker, "w", encoding="utf-8") as f:
            f.write(split[0])
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)


#: newest event schema version per kind, recorded in every shard entry
EVENT_SCHEMA_VERSIONS = dict(sorted(load_schemas()))


class AmbiguousCommitError(Exception):
    """Storage failed while appending a shard entry: it may or may not have landed. The
    committer keeps the attempt (`ShardCommitter.uncertain`); its episodes must be committed
    again exactly as they are, by a later `commit` (a conflict with the landed entry marks them
    committed, or the same attempt lands); they must not change meanwhile (no delayed rewards)."""

    def __init__(self, episodes: list[FinishedEpisode], cause: BaseException) -> None:
        super().__init__(
            f"append of {len(episodes)} episode(s) failed, outcome unknown: {type(cause).__name__}: {cause}"
        )
        self.episodes = episodes
        self.cause = cause


@dataclass
class CommitResult:
    """What one `ShardCommitter.commit` call committed."""

    shards: int = 0
    episodes: int = 0
    steps: int = 0
    bytes: int = 0
    duplicates_dropped: int = 0  # episodes another writer had committed already
    entries: list[ShardEntry] = field(default_factory=list)
    #: the episodes of `entries` (committed by this call)
    written: list[FinishedEpisode] = field(default_factory=list)
    #: episodes the shard format cannot encode (data errors: written nowhere), with the reason
    unwritable: list[tuple[FinishedEpisode, str]] = field(default_factory=list)


@dataclass
class _Attempt:
    """A staged shard whose append raised: it may have landed. Retried under the same name with
    the same bytes, so one copy is kept per set of episodes however often the append fails."""

    name: str
    shard: EncodedShard
    episodes: list[FinishedEpisode]
    seq: int  # the manifest seq it may have landed at; settled once the log has read that seq


class ShardCommitter:
    """Commits lists of finished episodes as shards of one (topic, partition); the one owner of
    the commit protocol's state.

    Guarantees: an episode is in at most one committed shard entry (the manifest log's
    create-once appends, with committed ids re-checked on conflict); once another writer has
    claimed the partition, this one commits nothing more (`FencedError`); a staged file becomes
    visible to readers only after its entry exists; a shard this writer committed is published
    by its next `commit` or `publish_pending` once storage works, from memory if its staged file
    is gone. Use one instance per partition and owner.

    Thread use: one thread at a time calls `claim`, `commit`, `publish_pending` and
    `offsets_committed`; `committed_offset` and `committed_length` may be asked from another
    thread meanwhile (one dict lookup each, no lock taken, so a slow storage call never blocks
    the asker).

    Args:
        storage: where shards and the manifest live (a `Storage` or a URI).
        topic: the Kafka topic the episodes came from (names shards and the manifest log).
        partition: the topic's partition this committer owns.
        fmt: shard format, ``"episodes"`` (RLlib's episode column) or ``"tabular"``.
        compression: the Parquet codec.
        snapshot_every: fold the manifest log into a snapshot every this many entries.

    Example::

        >>> import tempfile
        >>> from rlrec.trainer.synthetic import expert_cartpole_episodes  # doctest: +SKIP
        >>> c = ShardCommitter(tempfile.mkdtemp())  # doctest: +SKIP
        >>> c.claim()  # doctest: +SKIP
        1
        >>> res = c.commit(expert_cartpole_episodes(3))  # doctest: +SKIP
        >>> res.shards, c.committed_offset(res.written[0].episode_id) is not None  # doctest: +SKIP
        (1, True)
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
        #: staged attempts whose append raised (the entry may have landed), by staging path
        self._ambiguous: dict[str, _Attempt] = {}
        #: steps of the committed episodes this owner saw committed (a re-send within them is a
        #: duplicate); forgotten with their ids (`offsets_committed`)
        self._lengths: dict[str, int] = {}
        self._publish_retry = RetrySchedule()

    # -- ownership ----------------------------------------------------------------------------

    def claim(
        self,
        replay_from: int | None = None,
        *,
        from_position: bool = False,
        group: str | None = None,
        deployment: str | None = None,
        start_at: Callable[[], int] | None = None,
    ) -> int:
        """Claim a new writer epoch and roll forward unpublished commits; returns the epoch.

        The committed episode ids this owner then knows (`committed_offset`) are, with
        `replay_from` (the Kafka offset where this owner's consumer starts reading), those of
        entries with `last_offset >= replay_from` plus the most recent ones (the newest
        snapshot's segment and after); without it, every committed id (reads the log's whole
        history). With `from_position` the log's own resume position (`resume_offset`) is
        that offset where it has one. `group` and `deployment` name the writer in its claim;
        `start_at` says where a partition the log holds nothing of starts (`PartitionLog.claim`).
        What an earlier claim of this object held (appends of unknown outcome, seen lengths)
        is dropped: the log says what landed.
        """
        self._ambiguous.clear()
        self._lengths.clear()
        self.epoch = self.log.claim(
            default_writer_id(),
            replay_from=replay_from,
            from_position=from_position,
            group=group,
            deployment=deployment,
            start_at=start_at,
        )
        recovered = self.log.recover()
        if recovered:
            log.info("partition %d: published %d committed shard(s) left staged by a crash", self.partition, recovered)
        return self.epoch

    # -- what is committed (asked, never copied) ----------------------------------------------

    def committed_offset(self, episode_id: str) -> int | None:
        """The last Kafka offset of the committed entry holding `episode_id`, or None if this
        owner knows no committed entry with it (not committed, or forgotten as no longer
        replayable: `offsets_committed`)."""
        return self.log.committed_offset(episode_id)

    def committed_length(self, episode_id: str) -> int | None:
        """The steps of a committed episode, if this owner saw it committed (None otherwise)."""
        return self._lengths.get(episode_id)

    @property
    def resume_offset(self) -> int | None:
        """Where the partition resumes, as the log says (`PartitionLog.resume_offset`)."""
        return self.log.resume_offset

    def committed_episode_ids(self) -> set[str]:
        """Every committed episode id this owner knows (a copy: for tools and reports)."""
        return self.log.committed_episode_ids()

    @property
    def uncertain(self) -> list[FinishedEpisode]:
        """Episodes of appends whose outcome is unknown (`AmbiguousCommitError`): commit them
        again, unchanged, before anything else."""
        return list({fe.episode_id: fe for a in self._ambiguous.values() for fe in a.episodes}.values())

    @property
    def pending(self) -> list[ShardEntry]:
        """Entries this writer committed that are not published yet."""
        return [e for e, _ in self._pending.values()]

    def offsets_committed(self, offset: int) -> None:
        """The partition's Kafka offset was committed at `offset`: forget the committed episode
        ids no owner can replay any more (`PartitionLog.forget_before`)."""
        for eid in self.log.forget_before(offset):
            self._lengths.pop(eid, None)

    # -- the protocol -------------------------------------------------------------------------

    def commit(
        self,
        episodes: Iterable[FinishedEpisode],
        resume_offset: Callable[[list[FinishedEpisode]], int | None] | None = None,
    ) -> CommitResult:
        """Commit `episodes` as shards, one per policy id.

        `resume_offset`: asked, with a shard's episodes, just before its entry is appended, for
        the entry's `resume_offset` (where the partition resumes once the entry exists; the
        caller decides it: `rlrec.consumer.writer`); None: entries carry none (the caller reads
        no Kafka).

        Episodes the shard format cannot encode (data errors) are written nowhere and returned
        in `CommitResult.unwritable`; the others are committed, by this call or -- found on a
        conflict -- by another writer already (`committed_offset` says so for both). Claims the
        partition first if `claim()` was not called. Raises `FencedError` when a newer writer
        claimed the partition, `AmbiguousCommitError` when an append's outcome is unknown, and
        storage errors as they come; what was committed before the error stays committed.
        """
        if self.epoch is None:  # a one-off committer (tools, tests): claim on first use
            self.claim()
        self.publish_pending()  # roll forward earlier commits first (unless backing off after a failure)
        result = CommitResult()
        by_policy: dict[str, list[FinishedEpisode]] = defaultdict(list)
        for fe in episodes:
            by_policy[fe.policy_id].append(fe)
        todo = [eps for group in by_policy.values() for eps in self._encode(group, result.unwritable)]
        todo = self._without_unwritable_siblings(todo, result.unwritable)
        while todo:
            # 1. encode the episodes into one Parquet shard, in memory (done above, and again
            #    for the rest after a conflict); an append of unknown outcome is retried as it
            #    was: the same name and bytes
            eps, shard = todo.pop(0)
            name, shard = self._name(eps, shard)
            policy_id = eps[0].policy_id
            path, staging = f"{policy_id}/{name}", f"{policy_id}/_staging/{name}"
            # 2. stage it at `{policy}/_staging/{name}`: hidden from Ray Data and RLlib
            self.storage.write(staging, shard.data)
            # 3. append its entry to the partition's manifest log, create-once: the commit point
            for fe in eps:  # asked only once an entry holds the episode
                self._lengths[fe.episode_id] = fe.length
            resume = None if resume_offset is None else resume_offset(eps)
            try:
                entry = self.log.append_shard(self._entry(eps, shard, path, staging, resume))
            except ConflictError as c:
                # another writer, or an earlier attempt of ours, committed some of them first
                taken = self._learn_committed(c.entries, eps)
                result.duplicates_dropped += len(taken)
                rest = [fe for fe in eps if fe.episode_id not in taken]
                if rest:
                    todo[:0] = self._encode(rest, result.unwritable)
                continue
            except FencedError:  # certain: nothing of this writer's lands from now on
                raise
            except EntryTooLargeError:  # nothing written: its readers would refuse it; split the shard
                if len(eps) < 2:
                    raise
                half = len(eps) // 2
                log.warning(
                    "partition %d: a shard entry of %d episodes is too large; split in two", self.partition, len(eps)
                )
                todo[:0] = self._encode(eps[:half], result.unwritable) + self._encode(eps[half:], result.unwritable)
                continue
            except Exception as e:  # storage: the entry may have landed; the next append finds out
                self._ambiguous[staging] = _Attempt(name, shard, eps, self.log.next_seq)
                raise AmbiguousCommitError(eps, e) from e
            self._ambiguous.clear()  # entry `seq` was free: no earlier attempt landed
            result.shards += 1
            result.episodes += entry.episodes
            result.steps += entry.steps
            result.bytes += entry.bytes
            result.entries.append(entry)
            result.written += eps
            # 4. publish: move the staged file to `{policy}/{name}`; if that fails the entry is
            #    pending, published by the next commit or publish_pending (or rolled forward by
            #    the next owner's claim)
            try:
                self.log.publish(entry, shard.data)
            except Exception as e:
                self._pending[entry.seq] = (entry, shard.data)
                log.error("partition %d: publish of %s failed (%s); retried next cycle", self.partition, path, e)
            if _KILL_BETWEEN_ENTRIES in os.environ:
                _kill_between_entries(eps, self.committed_offset)
        return result

    def publish_pending(self, *, force: bool = False) -> int:
        """Publish the shards this writer committed but could not publish yet (roll forward);
        returns how many were published. Costs nothing when none are pending; after a failure
        it waits (`rlrec.store.retry.BACKGROUND`) unless `force`."""
        if not self._pending or (not force and not self._publish_retry.due(time.monotonic())):
            return 0
        done = 0
        for seq, (entry, data) in sorted(self._pending.items()):
            try:
                self.log.publish(entry, data)
            except Exception as e:  # stays pending; retried by the next cycle
                wait = self._publish_retry.failed(time.monotonic())
                log.warning(
                    "partition %d: publish of %s failed (%s: %s); retry in %.1fs",
                    self.partition,
                    entry.path,
                    type(e).__name__,
                    e,
                    wait,
                )
                return done
            del self._pending[seq]
            done += 1
            log.info("partition %d: rolled forward the publish of %s (seq %d)", self.partition, entry.path, seq)
        self._publish_retry.succeeded()
        return done

    # -- the steps' parts ---------------------------------------------------------------------

    def _encode(
        self, eps: list[FinishedEpisode], unwritable: list[tuple[FinishedEpisode, str]]
    ) -> list[tuple[list[FinishedEpisode], EncodedShard]]:
        """Step 1: encode episodes of one policy into a shard. Encoding touches no storage, so
        whatever it raises is the data's fault: then each episode is tried alone, those that
        fail go to `unwritable` and the rest make the shard (or, if only together they
        fail -- e.g. tabular episodes whose spaces give different column types -- a shard each)."""
        try:
            return [(eps, self._encode_one(eps))]
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
                alone.append(([fe], self._encode_one([fe])))
            except MemoryError:
                raise
            except Exception as e:
                unwritable.append((fe, f"{type(e).__name__}: {e}"[:1000]))
        good = [group[0][0] for group in alone]
        if 1 < len(good) < len(eps):
            try:
                return [(good, self._encode_one(good))]
            except Exception:
                pass
        return alone

    def _without_unwritable_siblings(
        self,
        todo: list[tuple[list[FinishedEpisode], EncodedShard]],
        unwritable: list[tuple[FinishedEpisode, str]],
    ) -> list[tuple[list[FinishedEpisode], EncodedShard]]:
        """A multi-agent episode one of whose agent rows is unwritable is unwritable whole: its
        other rows join `unwritable` before anything is appended (no partial episode), and the
        shards are encoded again without them."""
        bad = {fe.multi_agent_episode_id for fe, _ in unwritable if isinstance(fe, FinishedAgentRow)}
        if not bad:
            return todo
        out = []
        for eps, shard in todo:
            keep = []
            for fe in eps:
                if isinstance(fe, FinishedAgentRow) and fe.multi_agent_episode_id in bad:
                    unwritable.append(
                        (fe, f"multi-agent episode {fe.multi_agent_episode_id}: a sibling row is unwritable")
                    )
                else:
                    keep.append(fe)
            if len(keep) == len(eps):
                out.append((eps, shard))
            elif keep:
                out += self._encode(keep, unwritable)
        return out

    def _encode_one(self, eps: list[FinishedEpisode]) -> EncodedShard:
        """A shard of one policy's episodes: multi-agent rows in the version-2 ``episodes``
        format whatever `fmt` is (they have no tabular form), others in `fmt`."""
        if isinstance(eps[0], FinishedAgentRow):
            return encode_agent_rows(eps, compression=self.compression)
        return encode_shard(eps, fmt=self.fmt, compression=self.compression)

    def _name(self, eps: list[FinishedEpisode], shard: EncodedShard) -> tuple[str, EncodedShard]:
        """The shard's file name, from (topic, partition, offset range, writer epoch, attempt):
        never random, and never one an earlier (maybe landed) attempt staged -- except the
        retry of that very attempt, which re-uses its name and bytes."""
        ids = {fe.episode_id for fe in eps}
        for a in self._ambiguous.values():
            if {fe.episode_id for fe in a.episodes} == ids:
                return a.name, a.shard
        self._attempt += 1
        first = min(fe.first_offset for fe in eps)
        last = max(fe.last_offset for fe in eps)
        name = f"{self.topic}+{self.partition:05d}+{first:020d}+{last:020d}+e{self.epoch}.{self._attempt}.parquet"
        return name, shard

    def _entry(
        self, eps: list[FinishedEpisode], shard: EncodedShard, path: str, staging: str, resume: int | None = None
    ) -> ShardEntry:
        versions = sorted({fe.policy_version for fe in eps})
        return ShardEntry(
            path=path,
            staging_path=staging,
            topic=self.topic,
            partition=self.partition,
            policy_id=eps[0].policy_id,
            first_offset=min(fe.first_offset for fe in eps),
            last_offset=max(fe.last_offset for fe in eps),
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
            steps_without_logp=steps_without_logp(eps),
            resume_offset=resume,
        )

    def _learn_committed(self, entries: Iterable[object], eps: list[FinishedEpisode]) -> set[str]:
        """A conflict revealed `entries`: those of this writer's earlier attempts (an append that
        raised although it landed) are committed and published now; an attempt whose seq the log
        has read without finding it did not land and is forgotten. Returns the ids of `eps` that
        are committed."""
        for e in entries:
            if isinstance(e, ShardEntry) and e.staging_path in self._ambiguous and e.seq is not None:
                self._pending[e.seq] = (e, self._ambiguous.pop(e.staging_path).shard.data)
        for path, a in list(self._ambiguous.items()):
            if a.seq < self.log.next_seq:
                del self._ambiguous[path]
        if self._pending:
            self.publish_pending(force=True)
        taken = {eid for e in entries if isinstance(e, ShardEntry) for eid in e.episode_ids}
        taken = {fe.episode_id for fe in eps if fe.episode_id in taken}
        log.warning(
            "partition %d: manifest conflict; %d episode(s) were committed by another writer",
            self.partition,
            len(taken),
        )
        return taken


def read_committed_shard(storage: Storage, path: str, staging_path: str | None, size: int = 0) -> bytes:
    """The bytes of a committed shard (its entry's `path` and `staging_path`): the published file
    or, until it is published, the staged one. A publish between the two reads (the staged file
    moved to `path` after `path` was found missing) is caught by reading `path` again, so a
    committed shard is never reported missing because it moved: FileNotFoundError means neither
    file exists. `size` (the entry's ``bytes``; 0: unknown) bounds the read at ``size + 1``
    bytes: a file larger than its entry says then fails its checksum instead of being read whole."""
    limit = size if size > 0 else None
    try:
        return storage.read(path, limit=limit)
    except FileNotFoundError:
        if not staging_path:
            raise
    try:
        # committed but not yet published (the writer publishes right after committing, or at
        # its next flush cycle, or its next owner rolls the publish forward)
        return storage.read(staging_path, limit=limit)
    except FileNotFoundError:
        pass
    return storage.read(path, limit=limit)  # published meanwhile (publishing moves staging -> path)


def read_gated_shard(storage: Storage, entry: ShardEntry):
    """A committed shard (`read_committed_shard`) opened as a `rlrec.store.schema_gate.GatedShard`
    once its bytes match the entry's sha256, pass the schema gate and are the format version the
    entry says. Data errors are `rlrec.store.schema_gate.ShardSchemaError` (FileNotFoundError:
    neither file exists); storage errors are raised as the storage raises them.

    Args:
        storage: the store.
        entry: the shard entry committing the file.

    Example:
        >>> import tempfile
        >>> from rlrec.trainer.synthetic import expert_cartpole_episodes
        >>> c = ShardCommitter(tempfile.mkdtemp(), "rl", 0)
        >>> entry = c.commit(expert_cartpole_episodes(2, seed=0)).entries[0]
        >>> read_gated_shard(c.storage, entry).version == entry.format_version
        True
    """
    import hashlib

    from rlrec.store.schema_gate import ShardSchemaError, open_shard

    where = storage.uri(entry.path)
    data = read_committed_shard(storage, entry.path, entry.staging_path, entry.bytes)
    if entry.sha256 and hashlib.sha256(data).hexdigest() != entry.sha256:
        raise ShardSchemaError(f"{where}: sha256 differs from the manifest's: refused")
    try:
        shard = open_shard(data, fmt=entry.format)
    except ShardSchemaError as e:
        raise ShardSchemaError(f"{where}: {e.reason}") from None
    if entry.format_version is not None and shard.version != entry.format_version:
        raise ShardSchemaError(
            f"{where}: the file is {shard.fmt} version {shard.version}, its manifest entry says version "
            f"{entry.format_version}: refused"
        )
    return shard
