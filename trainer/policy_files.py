"""The publish root as a policy loader reads it: file names, size limits, bounded JSON, the
pointers (`latest.json`, `canary.json`) and the versions' directories (`rlrec.trainer.policy`
verifies and loads them; the trainer's `rlrec.trainer.export` writes them).

Every read is bounded (`MAX_BYTES`, `MAX_JSON_DEPTH`, `MAX_ROOT_ENTRIES`) and refuses a symlink or
anything that is not a regular file; URIs other than local paths go through
`rlrec.store.storage.Storage` (lazily).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlrec.trainer.binding import RUN_ID_RE
from rlrec.trainer.signing import SIG_SUFFIX

LATEST = "latest.json"
LATEST_SIG = LATEST + SIG_SUFFIX
#: the canary pointer (`rlrec.trainer.binding`): a candidate served to a share of episodes
CANARY = "canary.json"
CANARY_SIG = CANARY + SIG_SUFFIX
#: marks a canary version decided (written by the trainer before it removes canary.json): a
#: canary pointer naming a version that holds it is never followed (a replay of a decided canary)
CANARY_ENDED = "canary-ended.json"
SPEC = "policy.json"
SAFETENSORS_MODEL = "model.safetensors"
TORCHSCRIPT_MODEL = "model.pt"
MODEL = TORCHSCRIPT_MODEL  # the only model file of artifacts published before artifact_version 2
LINEAGE = "lineage.json"
ARTIFACT_VERSION = 2
VERSION_DIR_RE = re.compile(r"^v\d{6}$")
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

#: what a loader reads of each file at most, checked before reading (a larger file is refused):
#: the pointer, the spec and its signature are small JSON; the weights of a policy network
MAX_BYTES = {
    LATEST: 64 * 1024,
    CANARY: 64 * 1024,
    SPEC: 1024 * 1024,
    "sig": 4 * 1024,
    LINEAGE: 16 * 1024 * 1024,
    "model": 1024 * 1024 * 1024,
    "safetensors_header": 1024 * 1024,
    "state": 64 * 1024,
}
#: the deepest nesting of [ and { a JSON file may have (checked before parsing)
MAX_JSON_DEPTH = 64
#: the most version directories above the pointed one that are checked for a replayed pointer
MAX_NEWER_VERSIONS = 100
#: the most entries of a publish root that are listed
MAX_ROOT_ENTRIES = 100_000


class PolicyLoadError(RuntimeError):
    """A published policy is missing, incomplete, tampered with, unsigned or not trusted."""


class UnsignedPolicyWarning(UserWarning):
    """A policy version was loaded without a verified signature (allow_unsigned / allow_unsigned_code)."""


def version_dir(version: int) -> str:
    """``v000042``: the directory of a policy version (1 .. 999999)."""
    if type(version) is not int or not 1 <= version <= 999_999:
        raise ValueError(f"a policy version is an integer in 1..999999, got {version!r}")
    return f"v{version:06d}"


# --------------------------------------------------------------------------------- storage


class _Files:
    """Read files under a root: a local directory or a pyarrow filesystem URI."""

    def __init__(self, root: str) -> None:
        root = os.fspath(root)
        if root.startswith("file://"):
            root = root[len("file://") :]
        self.local = "://" not in root
        if self.local:
            self.root = os.path.abspath(os.path.expanduser(root))
            self.fs = None
        else:
            from rlrec.store.storage import Storage  # pyarrow (and a cloud's client), only for object stores

            self.storage = Storage.from_uri(root)
            self.fs, self.root = self.storage.filesystem, self.storage.base

    def read(self, rel: str, max_bytes: int) -> bytes:
        """The content of the regular file `rel`, refused (PolicyLoadError) before reading if it
        is larger than `max_bytes`, a symlink or not a regular file (a FIFO would block)."""
        if self.local:
            try:
                fd = os.open(os.path.join(self.root, *rel.split("/")), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise PolicyLoadError(f"{rel} is a symlink: refused") from None
                raise
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise PolicyLoadError(f"{rel} is not a regular file: refused")
                if st.st_size > max_bytes:
                    raise PolicyLoadError(f"{rel} holds {st.st_size} bytes, over its limit of {max_bytes}: refused")
                data = f.read(max_bytes + 1)
        else:
            import pyarrow.fs as pafs

            path = f"{self.root}/{rel}"
            try:
                info = self.fs.get_file_info(path)
                if info.type == pafs.FileType.NotFound:
                    raise FileNotFoundError(rel)
                if info.type != pafs.FileType.File:
                    raise PolicyLoadError(f"{rel} is not a file: refused")
                if info.size is not None and info.size > max_bytes:
                    raise PolicyLoadError(f"{rel} holds {info.size} bytes, over its limit of {max_bytes}: refused")
                with self.fs.open_input_stream(path) as f:
                    data = f.read(max_bytes + 1)
            except OSError as e:
                if isinstance(e, FileNotFoundError) or "not found" in str(e).lower() or "no such" in str(e).lower():
                    raise FileNotFoundError(rel) from None
                raise
        if len(data) > max_bytes:  # grew while being read
            raise PolicyLoadError(f"{rel} holds more than its limit of {max_bytes} bytes: refused")
        return data

    def version_dirs(self) -> list[str]:
        """The names of the root's entries that look like version directories (``v\\d{6}``);
        more than `MAX_ROOT_ENTRIES` entries is a PolicyLoadError."""
        if self.local:
            names = []
            with os.scandir(self.root) as it:
                for n, entry in enumerate(it):
                    if n >= MAX_ROOT_ENTRIES:
                        raise PolicyLoadError(f"{self.root} holds more than {MAX_ROOT_ENTRIES} entries: refused")
                    names.append(entry.name)
        else:
            infos = self.storage.list("")
            if len(infos) > MAX_ROOT_ENTRIES:
                raise PolicyLoadError(f"{self.root} holds more than {MAX_ROOT_ENTRIES} entries: refused")
            names = [i.name for i in infos]
        return sorted(n for n in names if VERSION_DIR_RE.match(n))

    def exists(self, rel: str) -> bool:
        if self.local:
            return os.path.exists(os.path.join(self.root, *rel.split("/")))
        import pyarrow.fs as pafs

        return self.fs.get_file_info(f"{self.root}/{rel}").type != pafs.FileType.NotFound


_JSON_STRING_RE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_JSON_BRACKET_RE = re.compile(rb"[\[\]{}]")


def _json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (brackets inside strings ignored)."""
    depth = deepest = 0
    for b in _JSON_BRACKET_RE.findall(_JSON_STRING_RE.sub(b'""', data)):
        if b in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _json(data: bytes, what: str) -> Any:
    """Parse a small JSON file; every failure (bad JSON, nesting deeper than `MAX_JSON_DEPTH`,
    checked before parsing) is a PolicyLoadError."""
    if isinstance(data, str):
        data = data.encode()
    depth = _json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise PolicyLoadError(f"{what} is nested {depth} deep, over the limit of {MAX_JSON_DEPTH}: refused")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise PolicyLoadError(f"{what} is not usable JSON: {type(e).__name__}: {str(e)[:200]}") from None


def _parse_latest(data: bytes, name: str = LATEST) -> dict:
    """A checked pointer (``latest.json``, or ``canary.json`` with its two more fields)."""
    latest = _json(data, name)
    if not isinstance(latest, dict):
        raise PolicyLoadError(f"{name} must be a JSON object")
    path, version = latest.get("path"), latest.get("policy_version")
    if not isinstance(path, str) or not VERSION_DIR_RE.match(path):
        raise PolicyLoadError(f"{name}: path {path!r:.80} is not a version directory (^v\\d{{6}}$)")
    if type(version) is not int or version != int(path[1:]):
        raise PolicyLoadError(f"{name}: policy_version {version!r:.40} does not name directory {path}")
    sha = latest.get("sha256")
    if sha is not None and (not isinstance(sha, str) or not _SHA256_RE.match(sha)):
        raise PolicyLoadError(f"{name}: sha256 {sha!r:.80} is not a sha256")
    for key in ("run_id", "channel"):
        value = latest.get(key)
        if value is not None and (not isinstance(value, str) or not RUN_ID_RE.match(value)):
            raise PolicyLoadError(f"{name}: {key} {value!r:.80} does not match {RUN_ID_RE.pattern}")
    t = latest.get("time")
    if t is not None and (type(t) not in (int, float) or not np.isfinite(t)):
        raise PolicyLoadError(f"{name}: time {t!r:.40} is not a number")
    floor = latest.get("canary_floor")
    if floor is not None and (type(floor) is not int or floor <= version):
        raise PolicyLoadError(f"{name}: canary_floor {floor!r:.40} is not a version above {version}")
    if name == CANARY:
        base, started = latest.get("base_version"), latest.get("started")
        if type(base) is not int or not 0 <= base < version:
            raise PolicyLoadError(f"{name}: base_version {base!r:.40} is not a version below {version}")
        if type(started) not in (int, float) or not np.isfinite(started):
            raise PolicyLoadError(f"{name}: started {started!r:.40} is not a number")
    return latest


def read_latest(root: str) -> dict:
    """The checked ``latest.json`` pointer of a publish root (FileNotFoundError if nothing is published)."""
    return _parse_latest(_Files(root).read(LATEST, MAX_BYTES[LATEST]))


@dataclass(frozen=True)
class _Pointer:
    """A parsed ``latest.json`` and whether ``latest.json.sig`` verified with the configured key."""

    doc: dict
    signed: bool
    name: str = LATEST

    @property
    def version(self) -> int:
        return int(self.doc["policy_version"])

    @property
    def path(self) -> str:
        return str(self.doc["path"])

    @property
    def run_id(self) -> str | None:
        return self.doc.get("run_id")

    @property
    def channel(self) -> str | None:
        return self.doc.get("channel")

    @property
    def canary_floor(self) -> int:
        """A ``latest.json``'s canary floor: canaries at or below it ended without a promotion (0: none)."""
        return int(self.doc.get("canary_floor", 0))

    @property
    def base_version(self) -> int:
        """A canary pointer's base version (the version ``latest.json`` names meanwhile)."""
        return int(self.doc.get("base_version", 0))
