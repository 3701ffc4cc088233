"""A manifest follower's first poll of one partition log from its head (`rlrec.store.live_set`):
the same shards, covers and counts as reading the log's history would give, from its newest
live set, the entries after it and the removal records it does not fold.

What the history gives (`rlrec.trainer.manifest_follower.ManifestFollower.poll`): every shard
entry no removal record names, if selected; for the shard entries a record names, the live
merged shard holding them (standing for every shard entry it holds), or their own file while it
is still there. A live set with retention's columns says all of it but the replaced files'
entries (``replaced``: their file names only) -- those are read one by one, up to a budget
(`max_entry_reads`), else the log's history is read. It must fold only removal records whose
files of the log were gone when it was written (``folds_deleted_only``): a shard retention
removed whose file is still there is then in its rows or its replaced table, named by a record
read after it. A shard entry a folded record removed is not seen (its files are gone, so the
history does not deliver it either; it is not counted in ``removed_skipped``) unless a live
merged shard holds it -- and a merged shard's ``covers`` names such entries by seq, with an
empty path (the live set does not say it).

Example:
    >>> max_entry_reads(1000)
    42
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from rlrec.store.live_set import HeadRead
from rlrec.store.manifest import Entry, ReplaceEntry, ShardEntry
from rlrec.store.retention import RemovalRecord

__all__ = ["HeadStart", "StandIns", "deliveries_from_head", "max_entry_reads", "stand_ins"]


def max_entry_reads(seq: int) -> int:
    """The most replaced files' entries a first poll reads one by one for a log whose live set
    is at `seq` before it reads the log's history instead (as `rlrec retain`'s confirmations)."""
    return 32 + seq // 100


@dataclass
class HeadStart:
    """One log's first poll from its head: ``new`` (the shards to deliver, in the order the
    history gives them), ``covers`` (a delivered merged shard's path -> the shard entries it
    stands for: seqs and paths, "" where unknown), ``skipped`` (shard entries not selected),
    ``removed`` (seqs a record after the live set removes) and ``gone`` (shard entries removed,
    not delivered: (entry or None, seq, why))."""

    new: list[ShardEntry] = field(default_factory=list)
    covers: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = field(default_factory=dict)
    skipped: int = 0
    removed: set[int] = field(default_factory=set)
    gone: list[tuple[ShardEntry | None, int, str]] = field(default_factory=list)


def deliveries_from_head(
    key: tuple[str, int],
    head: HeadRead,
    records: Sequence[RemovalRecord],
    *,
    selected: Callable[[ShardEntry], bool],
    file_there: Callable[[ShardEntry], bool],
    read_entry: Callable[[int], Entry | None],
) -> HeadStart | None:
    """What a follower that delivered nothing yet delivers of log `key` (module docstring).

    Args:
        key: (topic, partition).
        head: the log at its head through a live set (`rlrec.store.live_set.head_shards` with no
            removal record applied: ``tail`` set, ``shards`` with retention's facts).
        records: the removal records the live set does not fold (numbered from its ``removals``).
        selected: the follower's filter (called in the history's order: it picks the format).
        file_there: whether a shard's file is still in the store.
        read_entry: entry `seq` of the log as stored.

    Returns None where the head cannot say it: no retention facts, more replaced files than
    `max_entry_reads` allows, or a replaced file whose entry does not commit it -- then the
    caller reads the history.
    """
    live = head.shards
    ret = live.retention()  # type: ignore[attr-defined]
    if ret is None or head.live_set is None:
        return None
    holds = ret.holds  # live merged shard's seq -> the shard entries it holds
    replaced = ret.replaced  # replaced files no folded record names: seq -> (by, policy id, name)
    tail = {e.seq: e for e in head.tail or () if isinstance(e, (ShardEntry, ReplaceEntry))}
    to_read = sorted(q for q in replaced if q not in tail)
    if len(to_read) > max_entry_reads(head.live_set):
        return None
    with ThreadPoolExecutor(max_workers=8) as ex:
        read = dict(zip(to_read, ex.map(read_entry, to_read)))
    visible: dict[int, ShardEntry] = {}  # the shard entries of the log the head sees
    for q, (_, policy, name) in replaced.items():
        e = tail[q] if q in tail else read[q]
        shard = e if isinstance(e, ShardEntry) else e.shard if isinstance(e, ReplaceEntry) else None
        if shard is None or (shard.path, shard.staging_path) != (f"{policy}/{name}", f"{policy}/_staging/{name}"):
            return None
        if isinstance(e, ShardEntry):
            visible[q] = e
    for s in live:
        if s.seq not in holds:
            visible[s.seq] = s  # type: ignore[index]
    out = HeadStart()
    for rec in records:
        for f in rec.files:
            if (f.topic, f.partition) != key:
                continue
            s = visible.get(f.seq) or live.get(f.seq)  # type: ignore[attr-defined]
            if s is not None and (s.path, s.staging_path) == (f.path, f.staging_path):
                out.removed.add(f.seq)
    new = []
    for q in sorted(visible):
        if q not in out.removed:
            if selected(visible[q]):
                new.append(visible[q])
            else:
                out.skipped += 1
    # removed: those a record after the live set names, and the held entries a folded one did
    gone = sorted({q for q in visible if q in out.removed} | {h for hs in holds.values() for h in hs} - set(visible))
    stand = stand_ins(
        [(q, visible.get(q)) for q in gone],
        holds,
        live.get,  # type: ignore[attr-defined]
        removed=out.removed,
        selected=selected,
        file_there=file_there,
    )
    for m, _, rest in stand.covers:
        out.covers[m.path] = (rest, tuple(visible[s].path if s in visible else "" for s in rest))
    out.gone += [(e, q, "expired") for q, e, _ in stand.lost]
    out.new = [e for e in new if e.seq not in stand.covered] + stand.merged
    return out


@dataclass
class StandIns:
    """What a follower delivers for shard entries retention removed (`stand_ins`): ``merged``
    (the live merged shards standing for them, or their own files, in order), ``covered`` (the
    seqs delivered so), ``covers`` ((merged shard, its seq, the seqs it stands for) each) and
    ``lost`` ((seq, its entry or None, the holder found or None) of each that nothing delivers)."""

    merged: list[ShardEntry] = field(default_factory=list)
    covered: set[int] = field(default_factory=set)
    covers: list[tuple[ShardEntry, int, tuple[int, ...]]] = field(default_factory=list)
    lost: list[tuple[int, ShardEntry | None, ShardEntry | None]] = field(default_factory=list)


def stand_ins(
    gone: Sequence[tuple[int, ShardEntry | None]],
    holds: Mapping[int, tuple[int, ...]],
    shard_at: Callable[[int], ShardEntry | None],
    *,
    removed: Container[int],
    selected: Callable[[ShardEntry], bool],
    file_there: Callable[[ShardEntry], bool],
    delivered: Container[int] = frozenset(),
    fresh: Callable[[ShardEntry], bool] = lambda m: True,
) -> StandIns:
    """What stands for removed shard entries: for each (in order) the live merged shard holding
    it, if `fresh` (not delivered before) and no record removed it, standing for the entries it
    holds that were not `delivered`; else the entry's own file while it is still there; else
    nothing (``lost``). A merged shard or file `selected` refuses is not delivered, nor lost.

    Args:
        gone: (seq, its shard entry or None where unknown) of each removed shard entry.
        holds: a live merged shard's seq -> the seqs of the shard entries it holds.
        shard_at: the live shard at a seq (None: none).
        removed: seqs a removal record names (a merged shard among them stands for nothing).
        selected: the follower's filter.
        file_there: whether a shard's own file is still in the store.
        delivered: seqs delivered before.
        fresh: whether a merged shard was not delivered before.

    Example:
        >>> got = stand_ins([(1, None), (2, None), (5, None)], {9: (1, 2)}, {9: "merged shard 9"}.get,
        ...                 removed=(), selected=lambda e: True, file_there=lambda e: False)
        >>> got.merged, sorted(got.covered), [q for q, _, _ in got.lost]
        (['merged shard 9'], [1, 2], [5])
    """
    holder_of = {s: h for h, held in holds.items() for s in held}
    out = StandIns()
    for q, e in gone:
        if q in out.covered:
            continue
        h = holder_of.get(q)
        m = shard_at(h) if h is not None and h not in removed else None
        if m is not None and fresh(m):
            if selected(m):
                rest = tuple(s for s in holds[h] if s not in delivered)  # type: ignore[index]
                out.covers.append((m, h, rest))  # type: ignore[arg-type]
                out.merged.append(m)
                out.covered.update(rest)
            continue
        if e is not None and q not in delivered and file_there(e):
            if selected(e):
                out.merged.append(e)
                out.covered.add(q)
            continue
        out.lost.append((q, e, m))
    return out
