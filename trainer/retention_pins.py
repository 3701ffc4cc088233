"""What retention must keep for the policy versions that may serve: lineage pins.

The services serve the version a publish root's ``latest.json`` names (`rlrec.trainer.policy`);
a rollback goes to one of the versions published before it. `pinned_files` is the set of
manifest paths of the shards that reopening the data of those versions reads
(`rlrec.trainer.lineage.files_needed`: trained and held out): the deployed version, the
`keep_versions` published versions before it, and every version published after it (a
candidate that may be deployed next). ``rlrec retain --policies`` neither expires nor deletes
any of them.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

from rlrec.store.storage import Storage

__all__ = ["DEFAULT_KEEP_VERSIONS", "PinnedVersions", "pinned_files", "pinned_versions"]

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


def pinned_files(
    storage: Storage, policies: str, keep_versions: int = DEFAULT_KEEP_VERSIONS, *, public_key: Any = None
) -> tuple[set[str], PinnedVersions]:
    """(the manifest paths of the shards the pinned versions' data is read from, those versions).

    A version's lineage is read with `allow_unsigned` (a pin only keeps more); a version whose
    lineage cannot be read at all is a `LineageError`: retention cannot tell what it needs. A
    version whose data retention already removed (`ExpiredPointError`) pins what is left of it
    by path (a warning).

    Raises:
        LineageError: see above (one-line message).
    """
    from rlrec.store.snapshot import ExpiredPointError
    from rlrec.trainer.lineage import LineageError, read_version_lineage

    versions = pinned_versions(policies, keep_versions)
    from rlrec.trainer.lineage import files_needed

    files: set[str] = set()
    for v in versions.versions:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unsigned version still pins its data
            lin = read_version_lineage(policies, v, public_key=public_key, allow_unsigned=True)
        if lin.cursor is None:  # a lineage written before cursors: it lists its shards' paths
            files.update(lin.shards or ())
            continue
        try:
            files.update(files_needed(storage, lin))
        except ExpiredPointError as e:
            log.warning("policy version %d: its data is already partly removed (%s)", v, e)
            files.update(lin.shard_paths(_every_shard(storage)))
        except LineageError:
            raise
        except ValueError as e:  # CursorError: the lineage's cursor is no point of this store
            raise LineageError(f"policy version {v}: {e}") from None
    return files, versions


def _every_shard(storage: Storage) -> list:
    """Every shard any manifest entry committed (replaced ones too)."""
    from rlrec.store.manifest import shard_files
    from rlrec.store.retention import read_logs

    return [s for entries in read_logs(storage).values() for s in shard_files(entries)]
