"""The one way rlrec deletes shard files: `gc` (unreferenced leftovers) and retention
(`rlrec.store.retention`: replaced and expired shards) both go through `delete_files`.

A path is deleted only if it has the shape of a shard file -- ``{dir}/{name}`` or
``{dir}/_staging/{name}``, ``dir`` not starting with ``_`` or ``.`` (so never anything under
``_manifest/``, ``_owners/`` or the root itself) -- and, on a local store, only if it is a regular
file reached without a symlink (`rlrec.store.storage.Storage.check_inside`; the delete itself
walks the path without following links, `rlrec.store.localfs.LocalRoot.unlink`). A path that
breaks the rule is logged and skipped, never deleted; a missing file is already deleted.

Example:
    >>> import tempfile
    >>> from rlrec.store.storage import Storage
    >>> st = Storage.from_uri(tempfile.mkdtemp())
    >>> st.write("expert/a.parquet", b"x"); st.write("_manifest/rl/00000/000000000000.json", b"{}")
    >>> delete_files(st, ["expert/a.parquet", "_manifest/rl/00000/000000000000.json", "expert/gone.parquet"])
    ['expert/a.parquet']
    >>> st.exists("_manifest/rl/00000/000000000000.json")
    True
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from rlrec.store.localfs import EscapesRoot
from rlrec.store.storage import Storage

__all__ = ["STAGING_DIR", "delete_files", "is_shard_file_path"]

log = logging.getLogger("rlrec.deletion")

STAGING_DIR = "_staging"


def is_shard_file_path(path: str) -> bool:
    """Whether `path` (relative to the output root) has the shape of a shard file:
    ``{dir}/{name}`` or ``{dir}/_staging/{name}`` with ``dir`` not starting with ``_`` or ``.``.

    Example:
        >>> is_shard_file_path("expert/_staging/x.parquet"), is_shard_file_path("_manifest/rl/x.json")
        (True, False)
        >>> is_shard_file_path("expert/../_manifest/x"), is_shard_file_path("/etc/passwd")
        (False, False)
    """
    if not isinstance(path, str) or "\\" in path or "\x00" in path:
        return False
    parts = path.split("/")
    if len(parts) == 3 and parts[1] == STAGING_DIR:
        parts = [parts[0], parts[2]]
    if len(parts) != 2:
        return False
    top, name = parts
    return bool(top) and not top.startswith(("_", ".")) and name not in ("", ".", "..")


def delete_files(storage: Storage, paths: Iterable[str], *, dry_run: bool = False, who: str = "gc") -> list[str]:
    """Delete the shard files `paths` (relative to the root; module docstring for what is
    refused). Idempotent: a missing file is skipped.

    Args:
        storage: the store.
        paths: the files to delete.
        dry_run: check each path, delete nothing.
        who: the caller, for the log lines (``gc``, ``retain``).

    Returns:
        The paths deleted (with `dry_run`: those that would be), sorted.
    """
    done: list[str] = []
    for p in sorted(set(paths)):
        if not is_shard_file_path(p):
            log.error("%s: not deleting %r: not a shard file path ({dir}/{name} or {dir}/_staging/{name})", who, p)
            continue
        try:
            storage.check_inside(p)  # a listing or a record may name a link: never delete through one
        except EscapesRoot as e:
            log.error("%s: not deleting %s: %s", who, storage.uri(p), e.strerror)
            continue
        except FileNotFoundError:
            continue
        if dry_run:
            if storage.kind == "local" or storage.exists(p):
                done.append(p)
            continue
        try:
            deleted = storage.delete(p, missing_ok=True)
        except EscapesRoot as e:  # a link planted since the check: the delete refuses it too
            log.error("%s: not deleting %s: %s", who, storage.uri(p), e.strerror)
            continue
        if deleted:
            log.info("%s: deleted %s", who, storage.uri(p))
            done.append(p)
    return done
