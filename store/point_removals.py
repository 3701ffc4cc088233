"""What retention removed from a point of the manifest: the removal records in effect at it
(`counted_records`), the shards it then leaves out and when its data is expired
(`_apply_removals`); the rules: `rlrec.store.snapshot`, docs/GUARANTEES.md "As-of reads".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rlrec.store.cursor import _expired
from rlrec.store.manifest import ShardEntry
from rlrec.store.retention import RemovalRecord, RemovedFile
from rlrec.store.storage import Storage

__all__ = ["Removed", "counted_records"]

#: (topic, partition, seq) of a removed shard -> the record removing it and its removed files
Removed = Mapping[tuple[str, int, int], tuple[RemovalRecord, RemovedFile]]


def _deleted(storage: Storage, e: ShardEntry) -> bool:
    """Whether removed shard `e` cannot be read any more: its files are gone (deleted after the
    grace, or earlier by a deleting host whose clock runs ahead of this one's). Past the grace
    with its files kept (a lineage pin or a reader lease kept them) it is still read."""
    return not (storage.exists(e.path) or storage.exists(e.staging_path))


def counted_records(
    records: Iterable[RemovalRecord], positions: Mapping[tuple[str, int], int], removals: int
) -> list[RemovalRecord]:
    """The removal records in effect at a point: numbered below its `Cursor.removals` (they
    existed when the point was taken) *and* planned at or below its positions in every log
    (`RemovalRecord.positions` <= the point's, a log the point does not name being at 0) -- so
    retention only drops a shard from a point whose logs had already reached what retention
    decided from (a replacement it saw is below the point, so the replaced shard is not live
    there; an expired shard was live and old at the record's positions)."""
    return [r for r in records if r.n < removals and all(n <= positions.get(k, 0) for k, n in r.positions.items())]


def _dropped(counted: Iterable[RemovalRecord], removed: Removed) -> set[tuple[str, int, int]]:
    """The (topic, partition, seq) of the removed shards (`resolve_removals`) that one of the
    `counted` records names: not part of the point."""
    out: set[tuple[str, int, int]] = set()
    for rec in counted:
        for f in rec.files:
            hit = removed.get(f.key)
            if hit is not None and (hit[1].path, hit[1].staging_path) == (f.path, f.staging_path):
                out.add(f.key)
    return out


def _apply_removals(
    storage: Storage,
    entries: list[ShardEntry],
    dropped: set[tuple[str, int, int]],
    removed: Removed,
    *,
    what: str,
) -> list[ShardEntry]:
    """`entries` (the live shards of a point) less the shards removed by a record in effect at
    the point (`dropped`: `counted_records`); ExpiredPointError if others are removed and their
    files are gone (`_deleted`), while they are there (within the grace, or kept past it by a
    pin or a reader lease) they are read as usual."""
    kept: list[ShardEntry] = []
    gone: list[RemovalRecord] = []
    for e in entries:
        key = (e.topic, e.partition, e.seq)
        if key in dropped:
            continue  # a record in effect at this point removed it: not part of it
        hit = removed.get(key)  # type: ignore[arg-type]
        if hit is None:
            kept.append(e)
        elif _deleted(storage, e):
            gone.append(hit[0])
        else:
            kept.append(e)  # within the grace: read as before
    if gone:
        raise _expired(what, gone, len(gone))
    return kept
