"""Which shards the entries of one partition log hold: the live shards at a point
(`live_shards`, which enforces the rule of replacement for every reader of a log's episodes:
docs/GUARANTEES.md §3, R4), the shard entries whose episodes each holds (`live_holders`,
`merged_shards`) and every shard file the log ever committed (`shard_files`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from rlrec.store.manifest_entries import Entry, ManifestError, ReplaceEntry, ShardEntry, SnapshotEntry

__all__ = ["live_holders", "live_shards", "merged_shards", "shard_files"]


def _replaced_by(e: Entry) -> tuple[int, ...]:
    """The seqs an entry replaces (a snapshot: those its folded replace entries replace)."""
    if isinstance(e, ReplaceEntry):
        return e.replaces
    if isinstance(e, SnapshotEntry):
        return tuple(r for x in e.entries if isinstance(x, ReplaceEntry) for r in x.replaces)
    return ()


def live_shards(entries: Iterable[Entry], *, below: int | None = None) -> dict[int, ShardEntry]:
    """The live shards of one partition log: ``{seq of the entry that committed it: shard}``.

    Args:
        entries: the log's entries in seq order (`PartitionLog.load`).
        below: only entries with ``seq < below`` count (a point of the log; None: all).

    A shard entry adds its shard; a replace entry removes the shards of ``replaces`` and adds
    its own. The rule of replacement is enforced here (every reader of the log's episodes goes
    through this function): each replaced seq must be live, and the new shard's episode ids
    exactly the union of theirs, else ManifestError -- so an episode is in exactly one live
    shard at every point of a log where it is committed.

    Example:
        >>> live_shards([])
        {}
    """
    live: dict[int, ShardEntry] = {}
    for e in entries:
        if below is not None and e.seq >= below:  # type: ignore[operator]
            break
        if isinstance(e, ShardEntry):
            live[e.seq] = e  # type: ignore[index]
        elif isinstance(e, ReplaceEntry):
            missing = [r for r in e.replaces if r not in live]
            if missing:
                raise ManifestError(f"replace entry {e.seq} replaces seq {missing}, which are not live shards")
            old = [i for r in e.replaces for i in live[r].episode_ids]
            if len(set(old)) != len(old) or set(old) != set(e.shard.episode_ids):
                raise ManifestError(
                    f"replace entry {e.seq}: its shard's episode ids are not exactly those of seq {list(e.replaces)}"
                )
            for r in e.replaces:
                del live[r]
            live[e.seq] = e.shard  # type: ignore[index]
    return live


def _holdings(entries: Iterable[Entry], below: int | None = None) -> Iterator[tuple[Entry, tuple[int, ...]]]:
    """Each shard and replace entry of one log (in seq order, below `below`) with the seqs of
    the shard entries whose episodes its shard holds: itself, or what a replacement (of
    replacements) merged."""
    held: dict[int, tuple[int, ...]] = {}
    for e in entries:
        if below is not None and e.seq >= below:  # type: ignore[operator]
            break
        if isinstance(e, ShardEntry):
            h: tuple[int, ...] = (e.seq,)  # type: ignore[assignment]
        elif isinstance(e, ReplaceEntry):
            h = tuple(sorted(s for r in e.replaces for s in held.pop(r, ())))
        else:
            continue
        held[e.seq] = h  # type: ignore[index]
        yield e, h


def live_holders(
    entries: Iterable[Entry], *, below: int | None = None
) -> dict[int, tuple[ShardEntry, tuple[int, ...]]]:
    """The live shards of one partition log (as `live_shards`, which checks the rule of
    replacement) with the shard entries whose episodes each holds: ``{seq of the live shard:
    (shard, seqs of the shard entries that first committed its episodes)}`` -- the shard entry
    itself, or every shard entry a replacement (of replacements) merged into it.

    Args:
        entries: the log's entries in seq order (`PartitionLog.load`).
        below: only entries with ``seq < below`` count (None: all).

    Example:
        >>> live_holders([])
        {}
    """
    entries = list(entries)
    live = live_shards(entries, below=below)
    held = {e.seq: h for e, h in _holdings(entries, below)}
    return {seq: (shard, held[seq]) for seq, shard in live.items()}


def merged_shards(entries: Iterable[Entry]) -> dict[str, tuple[int, ...]]:
    """Every merged shard the replace entries of one partition log committed (live or replaced
    since): ``{its path: seqs of the shard entries whose episodes it holds}``.

    Args:
        entries: the log's entries in seq order (`PartitionLog.load`).

    Example:
        >>> merged_shards([])
        {}
    """
    return {e.shard.path: h for e, h in _holdings(entries) if isinstance(e, ReplaceEntry)}


def shard_files(entries: Iterable[Entry]) -> list[ShardEntry]:
    """Every shard any entry of a log ever committed: live, replaced, and the shards of replace
    entries (what gc keeps; retention decides when replaced ones go)."""
    return [e if isinstance(e, ShardEntry) else e.shard for e in entries if isinstance(e, (ShardEntry, ReplaceEntry))]
