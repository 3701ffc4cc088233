"""`rlrec retain`'s decisions from the partition logs' heads (`rlrec.store.live_set`): what to
record as removed, and which removed files to delete, without reading a log's history where its
head can decide -- and never deciding differently from the history but by keeping more.

Per log, the head is its newest live set with retention's columns (`rlrec.store.live_set_retention.Retention`:
each live shard's newest first-commit time and the shard entries it holds, the replaced files no
folded removal record names), the entries after it and the removal records after it. From it:

* **candidates**: the replaced files it lists, and the live shards older than the retention age,
  less what the pins keep (by manifest path, or by shard entry through the shards' holdings);
* an expiring shard of multi-agent rows (as its confirmed entry says; a live set whose format
  differs from the entry's is not trusted) sends the log to its history, where
  `rlrec.store.retention.plan_removals` keeps each multi-agent episode's shards together
  (`rlrec.store.retention_episodes`);
* each candidate is **confirmed from the immutable entries** before it is recorded: a replaced
  file's entry commits exactly that file and its replace entry replaces that seq; an expiring
  shard's entry commits exactly that file, and its merge tree (the replace entries down to the
  shard entries) gives the newest first-commit time and the shard entries it holds, which decide
  again. A live set can hide a candidate (retention then keeps more), never make one: a candidate
  the entries do not confirm sends that log to its history, as does a log with no usable live set
  or one without retention's columns (`LogHead.history`);
* **deleting** a recorded file once due: only files that still exist are considered (one listing
  of each policy directory a due record names); each is resolved against the entry it names
  (read), and kept when pinned -- where a pin by shard entry could hold it (the shard it commits
  holds a pinned entry), that log's history decides.

Confirming reads one entry per node of each candidate's merge tree; where that would read more
entries than the log's history costs (`history_cost`), the history is read instead, so retain
never reads much more than it did before live sets.

Example:
    >>> import tempfile
    >>> from rlrec.store.storage import Storage
    >>> heads_or_history(Storage.from_uri(tempfile.mkdtemp()), [])
    ({}, {})
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rlrec.store.manifest import (
    SNAPSHOT_EVERY,
    Entry,
    ManifestError,
    PartitionLog,
    ReplaceEntry,
    ShardEntry,
)
from rlrec.store.storage import Storage

__all__ = ["LogHead", "heads_or_history", "history_cost"]

log = logging.getLogger("rlrec.retention")


def history_cost(end: int) -> int:
    """About how many reads a log's history of `end` entries costs (its snapshots' chain and the
    entries after the newest): what confirming candidates from the head may read at most."""
    return 32 + end // SNAPSHOT_EVERY


class Undecided(ManifestError):
    """The head cannot decide (a candidate the entries do not confirm, or confirming would cost
    more than the history): the log's history decides."""


class NotThatFile(Undecided):
    """The entry a file names does not commit exactly that file."""


@dataclass
class LogHead:
    """One partition log read at its head for retention (module docstring).

    ``end``: its next seq; ``candidates``: (file, the shard entries it holds) of the replaced
    files and the expiring live shards, confirmed from the entries (`confirm`), before the pins;
    ``reads``: entries read to confirm so far.
    """

    storage: Storage
    topic: str
    partition: int
    end: int
    candidates: list[tuple[Any, tuple[int, ...]]] = field(default_factory=list)
    reads: int = 0
    facts: Any = None  # its live set's `Retention` at the head
    _entries: dict[int, Entry | None] = field(default_factory=dict)
    _holder: dict[int, int] | None = None

    def entries(self, seqs: Iterable[int]) -> dict[int, Entry | None]:
        """The entries at `seqs` (read once each, in parallel; None: none there). Undecided when
        this log's reads would pass `history_cost`."""
        want = sorted({q for q in seqs if q not in self._entries})
        self.reads += len(want)
        if self.reads > history_cost(self.end):
            raise Undecided(f"confirming would read more than {history_cost(self.end)} entries")
        plog = PartitionLog(self.storage, self.topic, self.partition)
        if want:
            with ThreadPoolExecutor(max_workers=min(8, len(want))) as ex:
                self._entries.update(zip(want, ex.map(plog.read_entry, want)))
        return {q: self._entries[q] for q in seqs}

    def shard_at(self, seq: int, path: str, staging_path: str) -> ShardEntry:
        """The shard entry `seq` commits (a merged shard: its replace entry's), which must be
        exactly that file, else Undecided."""
        e = self.entries([seq])[seq]
        s = e if isinstance(e, ShardEntry) else e.shard if isinstance(e, ReplaceEntry) else None
        if s is None or (s.path, s.staging_path) != (path, staging_path):
            raise NotThatFile(f"entry {seq} does not commit {path}")
        return s

    def replaced(self, seq: int) -> bool:
        """Whether the entries prove the shard entry `seq` commits replaced: the live merged
        shard the live set says holds its shard entries has it in its merge tree."""
        if self.facts is None:
            return False
        if self._holder is None:
            self._holder = {h: by for by, hs in self.facts.holds.items() for h in hs}
        leaves = self.tree(seq)[1]
        by = self._holder.get(leaves[0]) if leaves else None
        return by is not None and by != seq and seq in self._nodes(by)

    def _nodes(self, seq: int) -> set[int]:
        """The seqs of the merge tree of the shard `seq` commits (itself included)."""
        level, nodes = [seq], set()
        while level:
            got = self.entries(level)
            nodes |= set(level)
            level = [r for e in got.values() if isinstance(e, ReplaceEntry) for r in e.replaces]
        return nodes

    def tree(self, seq: int) -> tuple[float, tuple[int, ...]]:
        """(the newest first-commit time of its episodes, the shard entries it holds) of the shard
        entry `seq` commits, from its merge tree (`rlrec.store.live_set_retention.Retention`'s rule; the rule
        of replacement checked on the way: each replace entry's episode ids are exactly its
        children's)."""
        level, nodes = [seq], {}
        while level:
            got = self.entries(level)
            nxt = []
            for q, e in got.items():
                if not isinstance(e, (ShardEntry, ReplaceEntry)) or q in nodes:
                    raise Undecided(f"entry {q} is no shard's")
                nodes[q] = e
                if isinstance(e, ReplaceEntry):
                    nxt += list(e.replaces)
            level = nxt

        def walk(q: int) -> tuple[float, tuple[int, ...], tuple[str, ...]]:
            e = nodes[q]
            if isinstance(e, ShardEntry):
                return float(e.commit_time), (q,), tuple(e.episode_ids)
            kids = [walk(r) for r in e.replaces]  # type: ignore[union-attr]
            ids = [i for _, _, k in kids for i in k]
            if len(set(ids)) != len(ids) or set(ids) != set(e.shard.episode_ids):  # type: ignore[union-attr]
                raise Undecided(f"replace entry {q}: its shard's episode ids are not its children's")
            with_episodes = [t for t, _, k in kids if k]
            newest = max(with_episodes) if with_episodes else float(e.shard.commit_time)  # type: ignore[union-attr]
            return newest, tuple(sorted(h for _, hs, _ in kids for h in hs)), tuple(ids)

        newest, held, _ = walk(seq)
        return newest, held


def _in(seq: int, ranges: Sequence[tuple[int, int]]) -> bool:
    return any(a <= seq < b for a, b in ranges)


def pinned_by(held: Iterable[int], seq: int, ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether a live shard committed at `seq` holding the shard entries `held` holds episodes
    of a pinned entry (`rlrec.store.retention.pinned_live_shards`' rule)."""
    return bool(ranges) and any(_in(h, ranges) for h in (seq, *held))


def heads_or_history(
    storage: Storage,
    records: Sequence[Any],
    *,
    older_than_s: float | None = None,
    now: float = 0.0,
    pinned: Collection[str] = (),
    pinned_entries: Mapping[tuple[str, int], Sequence[tuple[int, int]]] | None = None,
) -> tuple[dict[tuple[str, int], LogHead], dict[tuple[str, int], list[Entry]]]:
    """Every partition log, read for retention (`records`: every removal record, read before):
    (the logs whose head decides, with their confirmed candidates; every entry of the others,
    read from their history as `rlrec.store.retention.read_logs` does)."""
    from rlrec.store.live_set import read_heads, read_live_sets
    from rlrec.store.retention import RemovedFile, merge_ranges, read_logs

    sets = read_live_sets(storage)
    if not any(ls is not None and ls.tables is not None for ls in sets.values()):
        return {}, read_logs(storage)  # no head can decide: the history, as before live sets
    try:
        heads, _, _ = read_heads(storage, sets=sets, removals=records)
    except ManifestError as e:  # a record or log the heads cannot fold: the history decides
        log.warning("retain: the manifest's head cannot be read (%s): reading its history", e)
        return {}, read_logs(storage)
    keys = list(heads)
    named = {f.key for rec in records for f in rec.files}  # recorded before: never recorded again
    out: dict[tuple[str, int], LogHead] = {}
    history: dict[tuple[str, int], list[Entry]] = {}
    pins = set(pinned)
    for key in keys:
        h = heads.get(key)
        facts = h.shards.retention() if h is not None and h.live_set is not None else None  # type: ignore[attr-defined]
        if h is None or facts is None:
            if h is not None and h.entries is not None:
                history[key] = h.entries  # read_heads read its history (strict)
            else:
                history[key] = PartitionLog(storage, *key).load(strict=True)
            continue
        topic, part = key
        ranges = merge_ranges((pinned_entries or {}).get(key, ()))
        head = LogHead(storage, topic, part, h.end, facts=facts)
        try:
            replaced = facts.replaced
            for q in sorted(replaced):
                by, policy, name = replaced[q]
                path, staging = f"{policy}/{name}", f"{policy}/_staging/{name}"
                if path in pins or (topic, part, q) in named:
                    continue
                head.shard_at(q, path, staging)
                r = head.entries([by])[by]
                if not isinstance(r, ReplaceEntry) or q not in r.replaces:
                    raise Undecided(f"entry {by} does not replace {q}")
                head.candidates.append((RemovedFile(topic, part, q, path, staging, "replaced"), ()))
            if older_than_s is not None:
                for q in facts.expiring(now - older_than_s):
                    s = h.shards.get(q)  # type: ignore[attr-defined]
                    if s is None or (topic, part, q) in named:
                        continue
                    if now - facts.newest_of(q) <= older_than_s or s.path in pins:
                        continue  # not expired by the live set's word: kept (it may only keep more)
                    if pinned_by(facts.holds_of(q), q, ranges):
                        continue
                    e = head.shard_at(q, s.path, s.staging_path)
                    if (e.format, e.format_version) != (s.format, s.format_version):
                        raise Undecided(f"{s.path}: the live set's format differs from its entry's")
                    if e.multi_agent:  # its episodes' other shards: `plan_removals` keeps them whole
                        raise Undecided(f"{s.path} holds multi-agent rows")
                    newest, held = head.tree(q)
                    if now - newest > older_than_s and not pinned_by(held, q, ranges):
                        head.candidates.append((RemovedFile.of(s, "expired"), held))
            head.candidates.sort(key=lambda c: c[0].seq)
            out[key] = head
        except Undecided as e:
            log.info("retain: %s/%d: reading its history (%s)", topic, part, e)
            history[key] = PartitionLog(storage, *key).load(strict=True)
    return out, history


def existing(storage: Storage, paths: Iterable[str]) -> set[str]:
    """Which of `paths` (shard files: ``{dir}/{name}``, ``{dir}/_staging/{name}``) exist: one
    listing of each directory they lie in."""
    by_dir: dict[str, set[str]] = {}
    for p in paths:
        d = p.rsplit("/", 1)[0] if "/" in p else ""
        by_dir.setdefault(d, set()).add(p)
    out: set[str] = set()
    for d, ps in sorted(by_dir.items()):
        try:
            names = {i.path for i in storage.list(d) if not i.is_dir}
        except FileNotFoundError:
            continue
        out |= ps & names
    return out


def due_from_heads(
    heads: Mapping[tuple[str, int], LogHead],
    records: Sequence[Any],
    due: Callable[[Any], bool],
    keep_paths: Collection[str],
    pinned_entries: Mapping[tuple[str, int], Sequence[tuple[int, int]]] | None,
) -> tuple[list[str], set[tuple[str, int]]]:
    """What to delete of the files whose first naming record is due (`due(record)`; a later
    record naming a file again never shortens its grace) in the logs whose head decides:
    (the published and staging paths of the files that still exist, are resolved against the
    entry they name and are not kept; the logs whose history must decide instead: one where a
    file's shard may hold a pinned entry, or a file cannot be checked)."""
    from rlrec.store.retention import merge_ranges

    if not heads:
        return [], set()
    storage = next(iter(heads.values())).storage
    first: dict[tuple[str, int, int], tuple[Any, Any]] = {}  # the first record naming a file rules its grace
    for rec in records:
        for f in rec.files:
            if (f.topic, f.partition) in heads:
                first.setdefault(f.key, (rec, f))
    files = {k: f for k, (rec, f) in first.items() if due(rec)}
    there = existing(storage, (p for f in files.values() for p in (f.path, f.staging_path)))
    paths: dict[tuple[str, int], list[str]] = {}
    undecided: set[tuple[str, int]] = set()
    for _, f in sorted(files.items()):
        lk = (f.topic, f.partition)
        if lk in undecided or f.path in keep_paths or not ({f.path, f.staging_path} & there):
            continue
        head = heads[lk]
        try:
            head.shard_at(f.seq, f.path, f.staging_path)
            ranges = merge_ranges((pinned_entries or {}).get(lk, ()))
            if ranges and pinned_by(head.tree(f.seq)[1], f.seq, ranges) and not head.replaced(f.seq):
                raise Undecided(f"{f.path} holds a pinned entry: kept only while it is live")
        except NotThatFile:
            continue  # names no such file: never deleted (as `resolve_removals` rules)
        except ManifestError as e:
            log.info("retain: %s/%d: reading its history (%s)", *lk, e)
            undecided.add(lk)
            continue
        paths.setdefault(lk, []).extend(p for p in (f.path, f.staging_path) if p in there)
    return [p for lk, ps in paths.items() if lk not in undecided for p in ps], undecided
