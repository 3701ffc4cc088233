"""Retention keeps a multi-agent episode whole: its rows lie in one shard per module (docs/FORMAT.md,
"Multi-agent rows"), each committed by its own shard entry and merged by compaction within its
module's folder only, so each module's shard has its own first-commit times. The rule
(docs/GUARANTEES.md, "Retention"):

    a shard holding part of a multi-agent episode expires only when every live shard holding
    that episode's other parts expires too (keep more, never less); the shards expiring
    together are named by one removal record.

Enforced here, in `episode_groups`, which `rlrec.store.retention.plan_removals` applies to what
it plans and `rlrec.store.retention.retain` again after the pins and reader leases asked later
dropped files from it (its groups are what `rlrec.store.retention.append_removals` never splits
across records). Two shards of one partition log can share an episode only where their offset
ranges overlap (every agent row carries its multi-agent episode's first and last offsets,
`rlrec.store.multi_agent_finished`). So the files read are those of the live multi-agent shards
whose offset range overlaps another's, one of the two expiring (`multi_agent_ids`: the whole
checked file, its ``multi_agent_episode_id`` column), each once per run; shards then join
(union-find, one pass) those holding the same ids. A file whose bytes fail the readers' checks
(or is missing) shares, for this rule, an episode with every shard it overlaps; a storage error
reading it fails the run (`rlrec.store.storage.StorageError`), as every storage error of retain
does. Single-agent shards are never looked at.

Example:
    >>> whole_episodes([], {}, set(), lambda s: frozenset())
    []
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from rlrec.store.log_shards import live_shards
from rlrec.store.manifest import Entry, ShardEntry
from rlrec.store.storage import Storage

__all__ = ["episode_groups", "multi_agent_ids", "whole_episodes"]

log = logging.getLogger("rlrec.retention")

#: a shard's multi-agent episode ids (None: unknown, it may share an episode with any shard it overlaps)
IdsOf = Callable[[ShardEntry], "frozenset[str] | None"]


def multi_agent_ids(storage: Storage) -> IdsOf:
    """A reader of the multi-agent episode ids a committed shard holds: its file, checked as
    readers check it (`rlrec.store.commit.read_gated_shard`), column ``multi_agent_episode_id``;
    None, logged, where the file is missing or its bytes fail (data errors). A storage error
    (`rlrec.store.storage.StorageError` after its retries, a refused permission) is raised.

    Args:
        storage: the store.

    Example:
        >>> import tempfile
        >>> from rlrec.store.storage import Storage
        >>> reader = multi_agent_ids(Storage.from_uri(tempfile.mkdtemp()))
        >>> callable(reader)
        True
    """
    from rlrec.store.commit import read_gated_shard
    from rlrec.store.schema_gate import ShardSchemaError

    read: dict[tuple[str, str], frozenset[str] | None] = {}  # each file read once per reader

    def ids_of(s: ShardEntry) -> frozenset[str] | None:
        if (s.path, s.sha256) not in read:
            read[(s.path, s.sha256)] = _read(s)
        return read[(s.path, s.sha256)]

    def _read(s: ShardEntry) -> frozenset[str] | None:
        try:  # a storage error (after the storage's retries) is no data error: it fails the run
            shard = read_gated_shard(storage, s)
        except (FileNotFoundError, ShardSchemaError) as e:
            return _unknown(s, e)
        try:  # the bytes are in memory, checked: what fails now is data
            col = shard.read(["multi_agent_episode_id"]).column("multi_agent_episode_id")
            return frozenset(str(v) for v in col.to_pylist())
        except Exception as e:
            return _unknown(s, e)

    return ids_of


def _unknown(s: ShardEntry, e: Exception) -> None:
    log.warning("retain: %s: cannot read its multi-agent episode ids (%s): kept with what it overlaps", s.path, e)
    return None


def _overlap(a: ShardEntry, b: ShardEntry) -> bool:
    return a.first_offset <= b.last_offset and b.first_offset <= a.last_offset


def _components(live: Mapping[int, ShardEntry], going: set[int], staying: set[int], ids_of: IdsOf) -> dict[int, int]:
    """Each shard of `going` and `staying` -> its component's root under "shares a multi-agent
    episode" (union-find, one pass). Only shards whose offset range overlaps another's, one of the
    two going, are read (`_read_set`); they join the shards holding the same ids, and a shard of
    unknown ids joins every such shard it overlaps."""
    parent = {q: q for q in going | staying}

    def find(q: int) -> int:
        while parent[q] != q:
            parent[q] = parent[parent[q]]
            q = parent[q]
        return q

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    everyone = _Index(live, going | staying)
    goers = _Index(live, going)
    owner: dict[str, int] = {}
    for q in sorted(_read_set(live, going, staying, everyone, goers)):
        ids = ids_of(live[q])
        if ids is None:  # unknown: it shares with every shard it overlaps (one of the two going)
            for k in (everyone if q in going else goers).overlapping(q):
                union(q, k)
            continue
        for i in ids:
            union(q, owner.setdefault(i, q))
    return {q: find(q) for q in parent}


class _Index:
    """Shards `qs` of `live` by first offset, with the two largest last offsets of each prefix:
    which overlap a range, and whether any but a given one does (O(log n))."""

    def __init__(self, live: Mapping[int, ShardEntry], qs: Collection[int]) -> None:
        self.live = live
        rows = sorted((live[q].first_offset, q) for q in qs)
        self.firsts = [f for f, _ in rows]
        self.seqs = [q for _, q in rows]
        self.top: list[tuple[float, int, float]] = []  # (largest last offset, its seq, the second largest)
        best, who, second = -math.inf, -1, -math.inf
        for q in self.seqs:
            last = live[q].last_offset
            if last > best:
                best, who, second = last, q, best
            elif last > second:
                second = last
            self.top.append((best, who, second))

    def overlaps_another(self, q: int) -> bool:
        s = self.live[q]
        i = bisect.bisect_right(self.firsts, s.last_offset)
        if not i:
            return False
        best, who, second = self.top[i - 1]
        return (best if who != q else second) >= s.first_offset

    def overlapping(self, q: int) -> list[int]:
        s = self.live[q]
        end = bisect.bisect_right(self.firsts, s.last_offset)
        return [k for k in self.seqs[:end] if k != q and _overlap(s, self.live[k])]


def _read_set(
    live: Mapping[int, ShardEntry], going: set[int], staying: set[int], everyone: _Index, goers: _Index
) -> set[int]:
    """The shards whose episode ids decide anything: those overlapping another shard, one of the two going."""
    return {q for q in going if everyone.overlaps_another(q)} | {q for q in staying if goers.overlaps_another(q)}


def episode_groups(
    files: Sequence[Any],
    logs: Mapping[tuple[str, int], Sequence[Entry]],
    gone: Collection[tuple[str, int, int]],
    ids_of: IdsOf,
) -> list[list[Any]]:
    """`files` (`rlrec.store.retention.RemovedFile`s to record) less the expiring multi-agent
    shards that share an episode with a live multi-agent shard that stays (one not in `files`
    and not removed by an earlier record, `gone`, in the same partition log of `logs`), directly
    or through other expiring shards; the rest grouped: the files whose shards share episodes
    form one group, which must be recorded in one removal record (a reader between two records,
    or a run killed after the first, would see part of an episode); every other file is a group
    of its own. Groups in the order of their first file in `files`.

    Args:
        files: what retention would record; only ``expired`` files of multi-agent shards in a
            log of `logs` may be dropped.
        logs: every entry of each partition log those files are decided from.
        gone: (topic, partition, seq) of shards an earlier removal record names.
        ids_of: a shard's multi-agent episode ids (`multi_agent_ids`; None: unknown).

    Example:
        >>> episode_groups([], {}, set(), lambda s: None)
        []
    """
    dropped: set[tuple[str, int, int]] = set()
    group_of: dict[tuple[str, int, int], tuple[str, int, int]] = {}
    for (topic, part), entries in sorted(logs.items()):
        mine = {f.seq for f in files if (f.topic, f.partition) == (topic, part) and f.reason == "expired"}
        if not mine:
            continue
        live = {q: s for q, s in live_shards(entries).items() if s.multi_agent}
        going = {q for q in mine if q in live}
        staying = {q for q in live if q not in going and (topic, part, q) not in gone}
        root_of = _components(live, going, staying, ids_of)
        held = {root_of[q] for q in staying}
        for q in going:
            if root_of[q] in held:
                dropped.add((topic, part, q))
            else:
                group_of[(topic, part, q)] = (topic, part, root_of[q])
    if dropped:
        log.info("retain: %d expiring shard(s) kept: they share multi-agent episodes with live shards", len(dropped))
    groups: dict[Any, list[Any]] = {}
    for i, f in enumerate(files):
        if f.key not in dropped:
            groups.setdefault(group_of.get(f.key, ("alone", i)), []).append(f)
    return list(groups.values())


def whole_episodes(
    files: Sequence[Any],
    logs: Mapping[tuple[str, int], Sequence[Entry]],
    gone: Collection[tuple[str, int, int]],
    ids_of: IdsOf,
) -> list[Any]:
    """`files` less the expiring multi-agent shards kept (`episode_groups`, flattened, in the
    order of `files`): every multi-agent episode's live shards are all in the result or none is.

    Args:
        files: what retention would record (`rlrec.store.retention.RemovedFile`s).
        logs: every entry of each partition log those files are decided from.
        gone: (topic, partition, seq) of shards an earlier removal record names.
        ids_of: a shard's multi-agent episode ids (`multi_agent_ids`; None: unknown).

    Example:
        >>> whole_episodes([], {}, set(), lambda s: None)
        []
    """
    kept = {f.key for g in episode_groups(files, logs, gone, ids_of) for f in g}
    return [f for f in files if f.key in kept]
