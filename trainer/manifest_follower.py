"""Following the manifest (no Ray): which shards are committed, and their spaces."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlrec.store.commit import read_committed_shard
from rlrec.store.live_set import (
    HeadRead,
    LiveSetEntry,
    fold,
    head_shards,
    read_heads,
    read_live_set,
    read_live_sets,
)
from rlrec.store.log_shards import live_holders
from rlrec.store.manifest import MANIFEST_DIR, Entry, ManifestError, PartitionLog, ShardEntry, UnsupportedManifestError
from rlrec.store.retention import RemovalLogView
from rlrec.store.storage import Storage
from rlrec.trainer.feed import ShardInfo
from rlrec.trainer.follower_heads import HeadStart, deliveries_from_head, stand_ins

__all__ = ["ManifestFollower", "spaces_from_shard"]

log = logging.getLogger("rlrec.trainer")


class ManifestFollower:
    """Incremental reader of the consumer's manifest (`_manifest/{topic}/{partition}/{seq}`).

    `poll()` returns the `ShardInfo`s of shard entries committed since the last poll that pass
    the filters. Partition logs are discovered by listing the manifest's *directories* every
    `discover_interval_s`; a new log is read once through its snapshots (the chain of snapshot
    entries plus the entries after the newest: `PartitionLog.load`), known logs are refreshed by
    probing their next sequence numbers only (`PartitionLog.refresh`), so a poll costs one small
    read per partition.

    New data is shard entries only: a replace entry (compaction) holds episodes already
    committed by the shard entries it replaces, so it is never delivered -- an episode is
    delivered once, in the shard that committed it. A log holding an entry this rlrec cannot
    read (a newer manifest format, `UnsupportedManifestError`) stops `poll` with that error
    instead of being skipped, and that poll delivers nothing from any log: the next one that
    succeeds delivers every log's new shards.

    A shard that retention removed (`rlrec.store.retention`: a replaced file, or an expired one)
    is not delivered: its file is gone or going. Its episodes are delivered in the merged shard
    that holds them now (a trainer started on a compacted store, or one that had not polled
    since the shards were merged and removed): once, as that shard, whose `covers` entry names
    the shard entries it stands for -- those not delivered before; when others of it were, the
    shard is read for the episodes of those entries only (`ShardInfo.episodes`). Expired data
    is not delivered: the first such shard is logged, `removed_skipped` counts them -- unless
    its own file is still there (a recorded removal whose grace runs): then it is delivered from
    it, as any shard, and held by the trainer's reader lease. Each poll
    reads the removal records appended since the last (one read).

    The first poll reads each log from its head where it can (``from_heads``; `rlrec.trainer.
    follower_heads`): its newest live set, the entries after it and the removal records it does
    not fold -- not the log's history -- and delivers what the history gives (the live set
    folds only records whose files were gone: shards the history would not deliver either),
    but for ``removed_skipped`` and the log line, which do not count the shards of the records
    it folds, and the paths in ``covers`` of the entries such a record removed (""). A log
    without a usable live set (none, malformed, stale, without retention's columns, not
    ``folds_deleted_only``) is read from its history.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        policy_id: str | None = None,
        min_policy_version: int | None = None,
        max_policy_version: int | None = None,
        fmt: str | None = None,
        discover_interval_s: float = 2.0,
        multi_agent: bool = False,
        modules: list[str] | None = None,
    ) -> None:
        self.storage = storage
        #: multi-agent: the modules the trainer trains (None: any); another module's folder is not
        #: delivered (its shards stay untrained, for a new run to train), and said once
        self.modules = None if modules is None else frozenset(modules)
        self.policy_id = policy_id
        #: select multi-agent rows (every module folder ``{policy_id}.{module_id}``), else only single-agent shards
        self.multi_agent = multi_agent
        self.min_policy_version = min_policy_version
        self.max_policy_version = max_policy_version
        self.fmt = fmt
        self.discover_interval_s = discover_interval_s
        self.logs: dict[tuple[str, int], PartitionLog] = {}
        self._done: dict[tuple[str, int], int] = {}
        self._last_discover = -1e18
        self._next_idx = 0
        self._warned: set[str] = set()
        self.entries: dict[str, ShardEntry] = {}  # key -> entry (selected shards)
        self.skipped = 0
        self.removed_skipped = 0
        #: a delivered merged shard's key -> the shard entries it stands for: ((topic, partition), seqs, paths)
        self.covers: dict[str, tuple[tuple[str, int], tuple[int, ...], tuple[str, ...]]] = {}
        self._delivered: dict[tuple[str, int], set[int]] = {}  # per log: seqs of shard entries delivered
        self._removals = RemovalLogView(storage)
        #: a merged shard delivered for part of the entries it holds -> the ids of their episodes
        self._only: dict[str, frozenset[str]] = {}
        #: the first poll reads the logs from their heads (False: from their histories, as a
        #: resumed trainer whose checkpoint names trained shards by path only needs)
        self.from_heads = True
        self._polled = False  # a poll succeeded
        self._heads: dict[tuple[str, int], HeadRead] = {}  # the logs the first poll read from their heads
        self._sets_read: dict[tuple[str, int], LiveSetEntry | None] = {}  # by `live_head`, for the first poll

    def _discover(self) -> None:
        for t in self.storage.list(MANIFEST_DIR):
            if not t.is_dir:
                continue
            for p in self.storage.list(t.path):
                if not p.is_dir or not p.name.isdigit() or len(p.name) != 5:
                    continue
                key = (t.name, int(p.name))
                if key not in self.logs:
                    try:
                        self.logs[key] = PartitionLog(self.storage, t.name, int(p.name))
                    except ValueError as e:
                        self._warn_once(f"bad-log:{key}", "ignoring manifest log %s: %s", key, e)

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _selected(self, e: ShardEntry) -> bool:
        if not self._kind_selected(e):
            return False
        lo, hi = e.min_policy_version, e.max_policy_version
        if self.min_policy_version is not None and isinstance(hi, int) and hi < self.min_policy_version:
            return False
        if self.max_policy_version is not None and isinstance(lo, int) and lo > self.max_policy_version:
            return False
        if e.format not in ("episodes", "tabular"):
            self._warn_once(f"fmt:{e.format}", "skipping shards of unknown format %r", e.format)
            return False
        if self.fmt is None:
            self.fmt = e.format
        if e.format != self.fmt:
            self._warn_once(
                f"mixed:{e.format}",
                "the input holds %s and %s shards; training on %s shards "
                "only (select with --offline-config input_read_episodes=...)",
                self.fmt,
                e.format,
                self.fmt,
            )
            return False
        return True

    def _kind_selected(self, e: ShardEntry) -> bool:
        """Single-agent shards for a single-agent trainer, every module's multi-agent rows (of
        ``--policy-id``'s modules, if given) for a multi-agent one."""
        rows = e.multi_agent
        if rows != self.multi_agent:
            kind = "multi-agent rows (train them with --multi-agent)" if rows else "single-agent shards"
            self._warn_once(f"kind:{rows}", "skipping %s, e.g. %s", kind, e.path)
            return False
        if rows and self.modules is not None and e.policy_id.rpartition(".")[2] not in self.modules:
            module = e.policy_id.rpartition(".")[2]
            if f"module:{module}" not in self._warned:
                self._warned.add(f"module:{module}")
                log.error(
                    "module %.40r appeared after this trainer started (it trains %s): its shards are not trained, "
                    "e.g. %s; train it in a new run (another --checkpoint-dir)",
                    module,
                    ", ".join(sorted(self.modules)),
                    e.path,
                )
            return False
        if self.policy_id is None:
            return True
        if self.multi_agent:  # exactly the folders {policy_id}.{module} (a module id holds no '.')
            prefix = f"{self.policy_id}."
            return e.policy_id.startswith(prefix) and "." not in e.policy_id[len(prefix) :]
        return e.policy_id == self.policy_id

    def _row_filter(self, e: ShardEntry) -> tuple[int | None, int | None] | None:
        """The version bounds the read task applies to `e`'s rows, episode by episode: None when
        no filter is set or every episode of the shard is within it (by the entry's range)."""
        lo, hi = self.min_policy_version, self.max_policy_version
        if lo is None and hi is None:
            return None
        emin, emax = e.min_policy_version, e.max_policy_version
        known = all(isinstance(v, int) and not isinstance(v, bool) for v in (emin, emax))
        if known and (lo is None or emin >= lo) and (hi is None or emax <= hi):  # type: ignore[operator]
            return None
        return (lo, hi)

    def live_head(self) -> list[ShardEntry]:
        """The selected live shards at the head of every partition log, less those retention
        removed, oldest commit first (the order of a first `poll`): through each log's newest
        live set where it has a usable one (`rlrec.store.live_set.read_heads`, the one decision
        readers make about a live set; its history where it has none) -- what a trainer reads to
        find a store's first shards and their spaces (the oldest committed usable shard's). It
        delivers nothing; the first `poll` starts from the live sets it read (not read again). A
        log the head cannot be read of (ManifestError but a newer format, or OSError) makes it
        read what `poll` delivers first.

        Example:
            >>> import tempfile
            >>> from rlrec.store.storage import Storage
            >>> ManifestFollower(Storage.from_uri(tempfile.mkdtemp())).live_head()
            []
        """
        try:
            self._sets_read = read_live_sets(self.storage)  # the first poll starts from them too
            heads, _, _ = read_heads(self.storage, sets=self._sets_read)
        except UnsupportedManifestError:
            raise
        except (ManifestError, OSError) as e:  # as `poll` treats a log it cannot read
            self._warn_once(f"head:{e}", "cannot read the manifest's head (%s): reading its history", e)
            return [self.entries[i.key] for i in self.poll(force_discover=True)]
        found = [s for h in heads.values() for s in h.shards if self._selected(s)]
        return sorted(found, key=lambda e: (e.commit_time, e.topic, e.partition, e.seq))

    def poll(self, force_discover: bool = False) -> list[ShardInfo]:
        """The `ShardInfo`s of the shards committed since the last poll that pass the filters,
        oldest commit first (class docstring).

        Example:
            >>> import tempfile
            >>> from rlrec.store.storage import Storage
            >>> ManifestFollower(Storage.from_uri(tempfile.mkdtemp())).poll(force_discover=True)
            []
        """
        now = time.monotonic()
        if force_discover or now - self._last_discover >= self.discover_interval_s:
            self._discover()
            self._last_discover = now
        # what this poll found, kept only if every log could be read: a log this rlrec cannot
        # read stops the whole poll, and the next one finds the other logs' new shards again
        found: list[tuple[tuple[str, int], int, list[ShardEntry], int]] = []
        unsupported: UnsupportedManifestError | None = None
        sets = self._live_sets() if self.from_heads and not self._polled else {}
        first = 0  # the first removal record read: the oldest a head-read log does not fold
        if sets and len(sets) == len(self.logs):
            first = min(ls.removals for ls in sets.values())
        self._refresh_removals(None if self._polled else first)
        starts: dict[tuple[str, int], tuple[HeadRead, HeadStart]] = {}
        for key, plog in list(self.logs.items()):
            if key in sets:
                got = self._head_start(key, sets[key])
                if got is not None:
                    starts[key] = got
                    found.append((key, got[0].end, got[1].new, got[1].skipped))
                    continue
                if first > 0:  # read from its history, which needs every removal record
                    first = 0
                    self._refresh_removals(0)
            try:
                plog.refresh()
            except UnsupportedManifestError as e:
                unsupported = unsupported or UnsupportedManifestError(f"manifest log {key[0]}/{key[1]:05d}: {e}")
                continue
            except (ManifestError, OSError) as e:
                self._warn_once(f"refresh:{key}:{e}", "cannot read manifest log %s/%05d: %s", key[0], key[1], e)
                continue
            new, skipped, gone = [], 0, []
            if key in self._heads:  # records naming entries below its head, read by any poll: seen
                self._removals.forget_below(*key, self._heads[key].end)
            removed = self._removals.seqs(*key, plog.entries)  # resolved against the log, as readers do
            for e in plog.entries_since(self._done.get(key, 0)):
                if isinstance(e, ShardEntry) and e.path not in self.entries:
                    if e.seq in removed:
                        gone.append(e)
                    elif self._selected(e):
                        new.append(e)
                    else:
                        skipped += 1
            if gone:
                merged, new = self._holders(key, plog, gone, new, removed)
                new += merged
            found.append((key, plog.next_seq, new, skipped))
        if unsupported is not None:
            raise unsupported
        for key, (head, start) in starts.items():  # from now on, these logs are read from their heads
            self.logs[key].follow_from(head.live_set, head.tail or [])  # type: ignore[arg-type]
            self._removals.forget_below(*key, head.end)  # records naming entries below: seen
            self._heads[key] = head
            for path, (seqs, paths) in start.covers.items():
                self.covers[path] = (key, seqs, paths)
            for e, q, why in start.gone:
                self.removed_skipped += 1
                self._warn_removed(key, e.path if e is not None else "?", q, why)
        self._polled = True
        out: list[ShardInfo] = []
        for key, done, new, skipped in found:
            for e in new:
                self.entries[e.path] = e
                cover = self.covers.get(e.path)
                self._delivered.setdefault(key, set()).update(cover[1] if cover else (e.seq,))
                out.append(
                    ShardInfo.from_entry(
                        self._next_idx, e, versions=self._row_filter(e), episodes=self._only.get(e.path)
                    )
                )
                self._next_idx += 1
            self.skipped += skipped
            self._done[key] = done
        out.sort(key=lambda s: (s.commit_time, s.idx))
        return out

    def _live_sets(self) -> dict[tuple[str, int], LiveSetEntry]:
        """The newest live set of each known log that a first poll can start from: with
        retention's columns, folding only records whose files were gone."""
        read, self._sets_read = self._sets_read, {}  # those `live_head` read, once
        keys = list(self.logs)
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(keys)))) as ex:
            got = list(ex.map(lambda k: read[k] if k in read else _quiet(read_live_set, self.storage, *k), keys))
        return {k: ls for k, ls in zip(keys, got) if ls is not None and ls.tables is not None and ls.folds_deleted_only}

    def _head_start(self, key: tuple[str, int], ls: LiveSetEntry) -> tuple[HeadRead, HeadStart] | None:
        """Log `key` at its head through live set `ls`, and what a first poll delivers of it
        (`deliveries_from_head`); None: it is read from its history."""
        try:
            head = head_shards(self.storage, *key, None, ls, apply_removals=False, history=False)
            start = deliveries_from_head(
                key,
                head,
                [r for r in self._removals.records if r.n >= ls.removals],
                selected=self._selected,
                file_there=self._file_there,
                read_entry=self.logs[key].read_entry,
            )
        except (ManifestError, OSError) as e:  # a newer format too: its history says so, and stops the poll
            log.info("%s/%05d: reading its history (its head cannot be read: %s)", key[0], key[1], e)
            return None
        if start is None:
            log.info("%s/%05d: reading its history (its live set does not say what to deliver)", key[0], key[1])
            return None
        return head, start

    def _warn_removed(self, key: tuple[str, int], path: str, seq: Any, why: str) -> None:
        self._warn_once(
            "removed",
            "not delivering shards retention removed (first: %s, seq %s of %s/%05d, %s): their episodes are "
            "not trained as new",
            path,
            seq,
            key[0],
            key[1],
            why,
        )

    def _holdings(self, key: tuple[str, int], plog: PartitionLog) -> tuple[dict[int, tuple[int, ...]], Any]:
        """The log's live shards' held shard entries (seq -> seqs) and a lookup of a live shard by
        seq: from its history, or from its head and the entries since (a log the first poll read
        from its head)."""
        head = self._heads.get(key)
        if head is None:
            live = live_holders(plog.entries_since(0))
            return {seq: held for seq, (_, held) in live.items()}, lambda q: live[q][0] if q in live else None
        now = fold(key[0], key[1], head.shards, plog.entries_since(head.end), [])
        ret = now.retention()
        # merged shards only: a removed shard entry is no holder (its seq is among the removed)
        return (ret.holds if ret is not None else {}), now.get

    def _entry(self, plog: PartitionLog, by_seq: dict[int, Entry], seq: int) -> ShardEntry | None:
        e = by_seq.get(seq) or plog.read_entry(seq)  # below a head-read log's live set: read
        return e if isinstance(e, ShardEntry) else None

    def _refresh_removals(self, start: int | None = None) -> None:
        """Read the removal records appended since the last read; with `start`, in a new view
        that reads from record `start` on. A record it cannot read is warned about once: the
        records read so far still count."""
        if start is not None:
            self._removals = RemovalLogView(self.storage, start=start)
        try:
            self._removals.refresh()
        except (ManifestError, OSError) as e:
            self._warn_once(f"removals:{e}", "cannot read the removal log: %s", e)

    def _file_there(self, e: ShardEntry) -> bool:
        """Whether `e`'s file (or its staged copy) is still in the store."""
        return _exists(self.storage, e)

    def _holders(
        self, key: tuple[str, int], plog: PartitionLog, gone: list[ShardEntry], new: list[ShardEntry], removed: set
    ) -> tuple[list[ShardEntry], list[ShardEntry]]:
        """The merged shards to deliver for the removed shard entries `gone` of one log, and
        `new` without the entries one of them stands for (their episodes are in it)."""
        by_seq = {e.seq: e for e in plog.entries_since(0)}
        holds, shard_at = self._holdings(key, plog)  # live seq -> the shard entries' seqs it holds
        delivered = self._delivered.get(key, set())
        stand = stand_ins(
            [(e.seq, e) for e in gone],  # type: ignore[misc]
            holds,
            shard_at,
            removed=removed,
            selected=self._selected,
            file_there=self._file_there,
            delivered=delivered,
            fresh=lambda m: m.path not in self.entries,
        )
        for m, h, rest in stand.covers:
            # the entries it holds that were not delivered: the merged shard stands for them,
            # read for their episodes only when others of it were delivered before
            parts = [self._entry(plog, by_seq, s) for s in rest]
            if len(rest) < len(holds[h]):
                self._only[m.path] = frozenset(i for p in parts if p is not None for i in p.episode_ids)
            self.covers[m.path] = (key, rest, tuple(p.path if p is not None else "" for p in parts))
        for _, e, m in stand.lost:  # no merged shard or own file (inside the grace) stands for it
            self.removed_skipped += 1
            why = "expired" if m is None else "the merged shard holding them was delivered before"
            self._warn_removed(key, e.path, e.seq, why)  # type: ignore[union-attr]
        return stand.merged, [e for e in new if e.seq not in stand.covered]


def _quiet(fn: Any, *args: Any) -> Any:
    """`fn(*args)`, None where the store does not answer (the history is read instead)."""
    try:
        return fn(*args)
    except OSError:
        return None


def _exists(storage: Storage, e: ShardEntry) -> bool:
    try:
        return storage.exists(e.path) or storage.exists(e.staging_path)
    except OSError:  # cannot tell: not delivered now (logged as removed)
        return False


def spaces_from_shard(storage: Storage, entry: ShardEntry):
    """(observation_space, action_space) of a shard: from its ``rlrec.*`` schema metadata or,
    for episode shards without it, from its first episode (decoded safely). The shard's schema
    passes the gate first (`rlrec.store.schema_gate.ShardSchemaError`, a ValueError)."""
    from rlrec.producer.spaces import loads_space
    from rlrec.store.episodes import unpack_episode
    from rlrec.store.schema_gate import open_shard

    shard = open_shard(read_committed_shard(storage, entry.path, entry.staging_path, entry.bytes), fmt=entry.format)
    meta = shard.metadata()
    if "rlrec.observation_space" in meta and "rlrec.action_space" in meta:
        return loads_space(meta["rlrec.observation_space"]), loads_space(meta["rlrec.action_space"])
    if shard.fmt == "episodes" and shard.num_rows:
        ep = unpack_episode(shard.read(["item"]).column("item")[0].as_py())
        return ep.observation_space, ep.action_space
    raise ValueError(f"shard {entry.path} carries no spaces; pass --env")
