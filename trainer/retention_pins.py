"""What retention must keep for the policy versions that may serve: lineage pins.

The services serve the version a publish root's ``latest.json`` names (`rlrec.trainer.policy`);
a rollback goes to one of the versions published before it. `lineage_pins` names the data
of those versions -- the deployed version, the `keep_versions` published versions before it,
and every version published after it (a candidate that may be deployed next) -- by the
identity of the shard entries their lineages trained on (``trained``: (topic, partition, seq)
ranges; trained and held-out episodes live in the same shards), not by file: ``rlrec retain
--policies`` resolves them to the shards holding those episodes in the logs it reads itself,
so a compaction that merges a pinned shard between the two cannot unpin it, and neither
expires nor deletes any of them. `pinned_files` is the same, resolved to paths now.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

from rlrec.store.storage import Storage

__all__ = ["DEFAULT_KEEP_VERSIONS", "LineagePins", "PinnedVersions", "lineage_pins", "pinned_files", "pinned_versions"]

log = logging.getLogger("rlrec.retention")

#: rollback candidates kept by default: the versions published before the deployed one
DEFAULT_KEEP_VERSIONS = 3


@dataclass(frozen=True)
class PinnedVersions:
    """The pinned versions: ``versions`` ascending, ``deployed`` the one ``latest.json`` names.

    Example:
        >>> PinnedVersions((2, 3), 3).versions
        (2, 3)
    """

    versions: tuple[int, ...]
    deployed: int


def pinned_versions(policies: str, keep_versions: int = DEFAULT_KEEP_VERSIONS) -> PinnedVersions:
    """The versions whose data retention keeps: the deployed one (``latest.json``), the
    `keep_versions` published before it and every one published after it.

    Raises:
        LineageError: nothing is published under `policies`, or its pointer is unreadable.

    Example:
        >>> pinned_versions("/ckpt/policies", 2)  # doctest: +SKIP
        PinnedVersions(versions=(5, 6, 7), deployed=7)
    """
    from rlrec.trainer.lineage import LineageError
    from rlrec.trainer.policy import PolicyLoadError, _Files, read_latest

    if isinstance(keep_versions, bool) or not isinstance(keep_versions, int) or keep_versions < 0:
        raise ValueError(f"keep_versions must be an integer >= 0, got {keep_versions!r}")
    try:
        deployed = int(read_latest(policies)["policy_version"])
        versions = sorted(int(n[1:]) for n in _Files(policies).version_dirs())
    except FileNotFoundError:
        raise LineageError(
            f"nothing is published under {policies} (no latest.json): give the publish root of the trainer "
            "whose versions serve (default {checkpoint-dir}/policies)"
        ) from None
    except (OSError, PolicyLoadError, ValueError) as e:
        raise LineageError(f"cannot read the publish root {policies}: {e}") from None
    before = [v for v in versions if v < deployed][-keep_versions:] if keep_versions else []
    return PinnedVersions(tuple(sorted({*before, deployed, *(v for v in versions if v > deployed)})), deployed)


@dataclass(frozen=True)
class LineagePins:
    """What retention keeps for the pinned versions (`lineage_pins`).

    Attributes:
        entries: per partition log, the seq ranges of the shard entries their lineages trained
            on (``trained``): retention keeps whichever live shards hold those entries' episodes
            when it reads the logs (`rlrec.store.retention.pinned_live_shards`), so a compaction
            that merges them in the meantime moves the pin with them.
        paths: manifest paths kept as such (lineages that list paths, not ranges; and what is
            left of a version whose data retention already partly removed).
        versions: the pinned versions.

    Example:
        >>> LineagePins({("rl", 0): ((2, 4),)}, frozenset(), PinnedVersions((1,), 1)).count
        2
    """

    entries: dict[tuple[str, int], tuple[tuple[int, int], ...]]
    paths: frozenset[str]
    versions: PinnedVersions

    @property
    def count(self) -> int:
        """Shard entries pinned plus paths pinned."""
        return sum(b - a for rs in self.entries.values() for a, b in rs) + len(self.paths)


def lineage_pins(
    storage: Storage, policies: str, keep_versions: int = DEFAULT_KEEP_VERSIONS, *, public_key: Any = None
) -> LineagePins:
    """The pins of the versions `pinned_versions` names: their lineages' ``trained`` shard
    entries (by identity: (topic, partition, seq)), and paths for lineages without ranges.

    A version's lineage is read with `allow_unsigned` (a pin only keeps more), and its cursor is
    checked to be a point of `storage` (`files_needed`); a version whose lineage cannot be read
    at all is a `LineageError`: retention cannot tell what it needs. A version whose data
    retention already removed (`ExpiredPointError`) pins what is left of it (a warning).

    Raises:
        LineageError: see above (one-line message).
    """
    from rlrec.store.snapshot import ExpiredPointError, merge_ranges, open_snapshot
    from rlrec.trainer.lineage import LineageError, files_needed, read_version_lineage

    versions = pinned_versions(policies, keep_versions)
    newest = open_snapshot(storage)  # the manifest read once, for every version's check
    paths: set[str] = set()
    ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for v in versions.versions:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unsigned version still pins its data
            lin = read_version_lineage(policies, v, public_key=public_key, allow_unsigned=True)
        if lin.cursor is None:  # a lineage written before cursors: it lists its shards' paths
            paths.update(lin.shards or ())
            continue
        try:
            needed = files_needed(newest, lin)  # also checks the cursor is a point of this store
        except ExpiredPointError as e:
            log.warning("policy version %d: its data is already partly removed (%s)", v, e)
            needed = set(lin.shard_paths(_every_shard(storage)))
        except LineageError:
            raise
        except ValueError as e:  # CursorError: the lineage's cursor is no point of this store
            raise LineageError(f"policy version {v}: {e}") from None
        if lin.trained is None:  # a lineage that lists paths: the shards live at its cursor
            paths.update(needed)
            continue
        for key, rs in lin.trained.items():
            ranges.setdefault(key, []).extend(rs)
    entries = {key: tuple(tuple(r) for r in merge_ranges(rs)) for key, rs in ranges.items()}
    return LineagePins(entries, frozenset(paths), versions)  # type: ignore[arg-type]


def pinned_files(
    storage: Storage, policies: str, keep_versions: int = DEFAULT_KEEP_VERSIONS, *, public_key: Any = None
) -> tuple[set[str], PinnedVersions]:
    """(the manifest paths of the shards the pinned versions' data is read from now, those
    versions): `lineage_pins` resolved against the logs as they are at this call. A compaction
    after it moves the data to other files: retention pins by `lineage_pins` instead.

    Raises:
        LineageError: see `lineage_pins`.
    """
    from rlrec.store.retention import pinned_live_shards, read_logs

    pins = lineage_pins(storage, policies, keep_versions, public_key=public_key)
    held = pinned_live_shards(read_logs(storage), pins.entries)
    return set(pins.paths) | {s.path for s in held.values()}, pins.versions


def _every_shard(storage: Storage) -> list:
    """Every shard any manifest entry committed (replaced ones too)."""
    from rlrec.store.manifest import shard_files
    from rlrec.store.retention import read_logs

    return [s for entries in read_logs(storage).values() for s in shard_files(entries)]
