"""Where a store of shards is, said to a user who gave the wrong folder.

A reader (``rlrec train``, ``rlrec inspect``) is pointed at a folder; :func:`locate_store` says
whether it is a store (it holds ``_manifest``), a mistake that waiting cannot fix (a folder of
published policies, a trainer's checkpoint dir, a folder inside a store), or a store that is not
there *yet* (with what it is waiting for: the folder, its ``_manifest``, its first shard).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from rlrec.store.manifest import MANIFEST_DIR
from rlrec.store.storage import Storage

__all__ = ["StoreLocation", "locate_store", "parent_uri"]

#: how many folders up a folder inside a store is looked for
_ANCESTORS = 3
_VERSION_DIR = re.compile(r"v\d{6}")


@dataclass(frozen=True)
class StoreLocation:
    """What :func:`locate_store` found.

    Attributes:
        mistake: why the folder can never be a store of shards (None: it can be).
        waiting_for: what is missing before it holds a shard (None: it holds a manifest).
    """

    mistake: str | None = None
    waiting_for: str | None = None


def parent_uri(uri: str) -> str | None:
    """The folder above `uri` (a path or URI), None at a bucket or the file system's root.

    Example:
        >>> parent_uri("s3://bucket/exp/shards?endpoint_override=x"), parent_uri("s3://bucket"), parent_uri("/a/b/")
        ('s3://bucket/exp?endpoint_override=x', None, '/a')
    """
    parts = urlsplit(uri)
    if len(parts.scheme) <= 1:  # a local path (or a Windows drive)
        path = os.path.abspath(os.path.expanduser(uri))
        up = os.path.dirname(path)
        return None if up == path else up
    path = parts.path.rstrip("/")
    if not path.strip("/"):
        return None
    return urlunsplit((parts.scheme, parts.netloc, path.rpartition("/")[0], parts.query, ""))


def _what_it_is(storage: Storage) -> str | None:
    """The kind of rlrec (or RLlib) folder that is not a store, or None."""
    if storage.exists("latest.json") or storage.exists("policies/latest.json"):
        return "holds published policies (latest.json)"
    if storage.exists("policy.json"):
        return "is a published policy version (policy.json)"
    if storage.exists("checkpoints/latest.json") or storage.exists("metrics.jsonl"):
        return "is a trainer's --checkpoint-dir"
    if storage.exists("rllib_checkpoint.json"):
        return "is an RLlib checkpoint"
    names = [f.name for f in storage.list("") if f.is_dir]
    if any(_VERSION_DIR.fullmatch(n) for n in names):
        return "holds published policy versions (v000001/ ...)"
    return None


def locate_store(uri: str, storage: Storage | None = None) -> StoreLocation:
    """Whether `uri` is a store of shards, a mistake, or a store still to come.

    Args:
        uri: the path or URI as the user gave it (for the messages).
        storage: its Storage (made from `uri` when None).

    Raises:
        rlrec.store.storage.StorageError: the store does not answer (the caller retries).

    Example:
        >>> import tempfile, pathlib
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> (root / "data" / "_manifest").mkdir(parents=True)
        >>> locate_store(str(root / "data" / "_manifest")).mistake.endswith("give " + str(root / "data"))
        True
        >>> locate_store(str(root / "nothing")).waiting_for
        'it does not exist yet (rlrec consume --output creates it)'
    """
    storage = storage or Storage.from_uri(uri)
    if storage.exists(MANIFEST_DIR):
        return StoreLocation()
    up = uri
    for _ in range(_ANCESTORS):
        up = parent_uri(up)
        if up is None:
            break
        if Storage.from_uri(up).exists(MANIFEST_DIR):
            return StoreLocation(
                mistake=f"{uri} is a folder inside the store {up} (it holds {MANIFEST_DIR}): give {up}"
            )
    if not storage.exists(""):
        return StoreLocation(waiting_for="it does not exist yet (rlrec consume --output creates it)")
    kind = _what_it_is(storage)
    if kind is not None:
        return StoreLocation(mistake=f"{uri} {kind}, not shards: give the --output of rlrec consume")
    base = uri.rstrip("/")
    children = [f.name for f in storage.list("") if f.is_dir and not f.name.startswith((".", "_"))]
    found = [c for c in children if storage.exists(f"{c}/{MANIFEST_DIR}")]
    if found:
        hint = " or ".join(f"{base}/{c}" for c in found[:3])
        return StoreLocation(waiting_for=f"it holds no {MANIFEST_DIR} (did you mean {hint}?)")
    return StoreLocation(waiting_for=f"it holds no {MANIFEST_DIR} yet: no consumer has written to it")
