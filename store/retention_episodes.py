"""Retention keeps a multi-agent episode whole: its rows lie in one shard per module (docs/FORMAT.md,
"Multi-agent rows"), each committed by its own shard entry and merged by compaction within its
module's folder only, so each module's shard has its own first-commit times. The rule
(docs/GUARANTEES.md, "Retention"):

    a shard holding part of a multi-agent episode expires only when every live shard holding
    that episode's other parts expires too (keep more, never less).

Enforced here, in `whole_episodes`, which `rlrec.store.retention.plan_removals` applies to what
it plans and `rlrec.store.retention.retain` again after the pins and reader leases asked later
dropped files from it. Two shards of one partition log can share an episode only where their
offset ranges overlap (every agent row carries its multi-agent episode's first and last offsets,
`rlrec.store.multi_agent_finished`); those are read (`multi_agent_ids`: the checked file, its
``multi_agent_episode_id`` column) to tell whether they do. A file that cannot be read shares,
for this rule, an episode with every shard it overlaps. Single-agent shards are never looked at.

Example:
    >>> whole_episodes([], {}, set(), lambda s: frozenset())
    []
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from rlrec.store.manifest import Entry, ShardEntry, live_shards
from rlrec.store.storage import Storage

__all__ = ["is_multi_agent", "multi_agent_ids", "whole_episodes"]

log = logging.getLogger("rlrec.retention")

#: a shard's multi-agent episode ids (None: unknown, it may share an episode with any shard it overlaps)
IdsOf = Callable[[ShardEntry], "frozenset[str] | None"]


def is_multi_agent(s: ShardEntry) -> bool:
    """Whether `s` commits multi-agent rows (`episodes` format version 2).

    Example:
        >>> from rlrec.store.manifest import ShardEntry
        >>> is_multi_agent(ShardEntry(path="p.m/x.parquet", staging_path="p.m/_staging/x.parquet", topic="rl",
        ...     partition=0, policy_id="p.m", first_offset=0, last_offset=0, episode_ids=[], episodes=0, steps=0,
        ...     bytes=0, sha256="", format="episodes", format_version=2))
        True
    """
    from rlrec.store.schema_gate import MULTI_AGENT_SHARD_FORMAT_VERSION

    return s.format == "episodes" and s.format_version == MULTI_AGENT_SHARD_FORMAT_VERSION


def multi_agent_ids(storage: Storage) -> IdsOf:
    """A reader of the multi-agent episode ids a committed shard holds: its file (the published
    or the staging path, at most the entry's ``bytes``), checked as readers check it (sha256,
    schema, format version), column ``multi_agent_episode_id``; None, logged, where that fails.

    Args:
        storage: the store.

    Example:
        >>> import tempfile
        >>> from rlrec.store.storage import Storage
        >>> reader = multi_agent_ids(Storage.from_uri(tempfile.mkdtemp()))
        >>> callable(reader)
        True
    """
    from rlrec.store.commit import read_committed_shard
    from rlrec.store.schema_gate import open_shard

    read: dict[tuple[str, str], frozenset[str] | None] = {}  # each file read once per reader

    def ids_of(s: ShardEntry) -> frozenset[str] | None:
        if (s.path, s.sha256) not in read:
            read[(s.path, s.sha256)] = _read(s)
        return read[(s.path, s.sha256)]

    def _read(s: ShardEntry) -> frozenset[str] | None:
        try:
            data = read_committed_shard(storage, s.path, s.staging_path, s.bytes)
            if s.sha256 and hashlib.sha256(data).hexdigest() != s.sha256:
                raise ValueError("its sha256 differs from the manifest's")
            shard = open_shard(data, fmt=s.format)
            if shard.version != s.format_version:
                raise ValueError(f"the file is version {shard.version}, its entry says {s.format_version}")
            col = shard.read(["multi_agent_episode_id"]).column("multi_agent_episode_id")
            return frozenset(str(v) for v in col.to_pylist())
        except Exception as e:  # unknown: the shard keeps every shard it overlaps
            log.warning(
                "retain: %s: cannot read its multi-agent episode ids (%s): kept with what it overlaps", s.path, e
            )
            return None

    return ids_of


def _overlap(a: ShardEntry, b: ShardEntry) -> bool:
    return a.first_offset <= b.last_offset and b.first_offset <= a.last_offset


def _kept(live: Mapping[int, ShardEntry], going: set[int], staying: set[int], ids_of: IdsOf) -> set[int]:
    """The seqs of `going` kept: until none of the rest shares an episode with a staying shard
    (only shards whose offset ranges overlap are compared, from a list by first offset)."""

    def shares(x: ShardEntry, k: ShardEntry) -> bool:
        if not _overlap(x, k):
            return False
        a, b = ids_of(x), ids_of(k)
        return a is None or b is None or bool(a & b)

    by_first = sorted((live[k].first_offset, k) for k in staying)
    kept: set[int] = set()
    changed = bool(going)
    while changed:
        changed = False
        for x in sorted(going - kept, reverse=True):  # newest first: a chain of shared episodes in one pass
            end = bisect.bisect_right(by_first, (live[x].last_offset, math.inf))
            if any(shares(live[x], live[k]) for _, k in by_first[:end]):
                kept.add(x)
                bisect.insort(by_first, (live[x].first_offset, x))
                changed = True
    return kept


def whole_episodes(
    files: Sequence[Any],
    logs: Mapping[tuple[str, int], Sequence[Entry]],
    gone: Collection[tuple[str, int, int]],
    ids_of: IdsOf,
) -> list[Any]:
    """`files` (`rlrec.store.retention.RemovedFile`s to record) less the expiring multi-agent
    shards that share an episode with a live multi-agent shard that stays: one not in `files`
    and not removed by an earlier record (`gone`), in the same partition log of `logs` -- and so
    on, until every multi-agent episode's live shards are all in the result or none is.

    Args:
        files: what retention would record; only ``expired`` files of multi-agent shards in a
            log of `logs` may be dropped.
        logs: every entry of each partition log those files are decided from.
        gone: (topic, partition, seq) of shards an earlier removal record names.
        ids_of: a shard's multi-agent episode ids (`multi_agent_ids`; None: unknown).

    Example:
        >>> whole_episodes([], {}, set(), lambda s: None)
        []
    """
    dropped: set[tuple[str, int, int]] = set()
    for (topic, part), entries in sorted(logs.items()):
        mine = {f.seq for f in files if (f.topic, f.partition) == (topic, part) and f.reason == "expired"}
        if not mine:
            continue
        live = {q: s for q, s in live_shards(entries).items() if is_multi_agent(s)}
        going = {q for q in mine if q in live}
        staying = {q for q in live if q not in going and (topic, part, q) not in gone}
        dropped |= {(topic, part, q) for q in _kept(live, going, staying, ids_of)}
    if dropped:
        log.info("retain: %d expiring shard(s) kept: they share multi-agent episodes with live shards", len(dropped))
    return [f for f in files if f.key not in dropped]
