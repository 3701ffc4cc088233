"""The continuous trainer's checkpoints: where they live in its checkpoint dir, save, prune, restore.

Checkpoint directory layout (a local path or any URI `rlrec.store.storage.Storage` accepts)::

    metrics.jsonl                         one JSON object per iteration (see rlrec.trainer.metrics)
    checkpoints/latest.json               {"iteration", "path", "policy_version"}: the commit point
    checkpoints/ckpt-00000012/algo/       RLlib checkpoint (Algorithm.save_to_path): weights,
                                          optimizer state, ...
    checkpoints/ckpt-00000012/trainer.json  cursor (shards trained on), counters, policy version, run id
    checkpoints/ckpt-00000012/index.json    {"iteration", "path", "files": {relative path: sha256}}:
                                          every file of the checkpoint, written after them
    checkpoints/ckpt-00000012/index.json.sig  Ed25519 signature of index.json (with a signing key)
    checkpoints/ckpt-00000012/publish/v000004/...  the files of a policy version this checkpoint
                                          commits to publishing (see rlrec.trainer.service)
    checkpoints/ckpt-00000012.1/          the same iteration saved again (latest.json named
                                          ckpt-00000012 meanwhile: a committed checkpoint is never rewritten)
    policies/                             published policies (see rlrec.trainer.policy)

What goes into ``trainer.json`` is the trainer's business (`rlrec.trainer.service`); this module
stores it. Ray is never imported here: the algorithm is passed in.

Trust boundary: RLlib restores checkpoints through pickle (optimizer and module state), so
whoever can write a checkpoint dir can run code in a trainer that resumes from it. With a
signing key, `restore_learner_group` and `read_state` first verify ``index.json.sig`` and the
sha256 of every file they read against the signed index, and refuse anything else
(`CheckpointVerificationError`); without a key the checkpoint dir must be trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from typing import Any

from rlrec.errors import UsageError
from rlrec.store.storage import Storage

__all__ = [
    "CKPT_DIR",
    "CKPT_LATEST",
    "INDEX_FILE",
    "STATE_FILE",
    "STATE_VERSION",
    "CheckpointStore",
    "CheckpointVerificationError",
    "ResumeRefused",
    "checkpoint_path",
]

log = logging.getLogger("rlrec.trainer")

CKPT_DIR = "checkpoints"
CKPT_LATEST = f"{CKPT_DIR}/latest.json"
STATE_FILE = "trainer.json"
STATE_VERSION = 1
ALGO_DIR = "algo"
INDEX_FILE = "index.json"
SIG_SUFFIX = ".sig"
_CKPT_NAME_RE = re.compile(r"^ckpt-(\d+)(?:\.(\d+))?$")


class CheckpointVerificationError(RuntimeError):
    """A checkpoint's files do not match its signed index (or it has no valid signed index)."""


class ResumeRefused(UsageError):
    """``--resume`` found checkpoints (or published versions) but no ``latest.json``: starting a
    new run over them would train every shard as new again (exit code 2)."""


def _checkpoint_order(path: str) -> tuple[int, int] | None:
    """(iteration, save) of ``.../ckpt-00000012.3`` -> (12, 3); None for any other name."""
    m = _CKPT_NAME_RE.match(path.rstrip("/").rsplit("/", 1)[-1])
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def _local_hashes(root: str, prefix: str) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            full = os.path.join(dirpath, n)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            with open(full, "rb") as f:
                out[f"{prefix}/{rel}"] = hashlib.sha256(f.read()).hexdigest()
    return out


def checkpoint_path(iteration: int) -> str:
    """``checkpoints/ckpt-00000012``: the checkpoint of *iteration*, relative to the checkpoint dir."""
    return f"{CKPT_DIR}/ckpt-{iteration:08d}"


class CheckpointStore:
    """The checkpoints in a trainer's checkpoint dir (a `Storage`), in the layout above.

    Guarantees: :meth:`latest` names only complete checkpoints -- :meth:`save` writes the
    algorithm, the extra files and ``trainer.json`` first and ``latest.json`` (the commit point)
    last, and never into the directory ``latest.json`` names (saving that iteration again goes to
    ``ckpt-N.1``, ``.2``, ...); saving into a directory a crashed save left half-written replaces
    its files instead of mixing old and new ones; :meth:`prune` never deletes the checkpoint it
    is told to keep, and a failed prune only logs.
    """

    def __init__(self, storage: Storage, signing_key: Any = None) -> None:
        self.storage = storage
        self.signing_key = signing_key  # Ed25519 private key: signs index.json, verifies on restore

    def latest(self) -> dict | None:
        """The ``latest.json`` pointer (``{"iteration", "path", "policy_version"}``), None if nothing is saved."""
        try:
            return json.loads(self.storage.read(CKPT_LATEST))
        except FileNotFoundError:
            return None

    def complete_checkpoints(self) -> list[str]:
        """Paths of the checkpoints whose ``index.json`` was written (every file of theirs is
        there), oldest first in (iteration, save) order; a half-written one is not listed."""
        return [d for d in self._checkpoint_dirs() if self.storage.exists(f"{d}/{INDEX_FILE}")]

    def _checkpoint_dirs(self) -> list[str]:
        """Every ``ckpt-*`` directory, complete or not, in (iteration, save) order."""
        dirs = [i.path for i in self.storage.list(CKPT_DIR) if i.is_dir and _checkpoint_order(i.path) is not None]
        return sorted(dirs, key=_checkpoint_order)

    def resume_point(self, published: int = 0) -> dict | None:
        """The ``latest.json`` pointer ``--resume`` continues from; None for a checkpoint dir
        with nothing to resume (a new run starts).

        Args:
            published: the highest policy version under the run's publish root (0: none).

        Raises:
            ResumeRefused: no ``latest.json``, yet complete checkpoints or published versions
                exist (a store that did not answer with it, a mistyped or damaged dir).

        Example::

            >>> CheckpointStore(Storage.from_uri("/tmp/rlrec-empty-ckpt")).resume_point() is None
            True
        """
        latest = self.latest()
        if latest is not None:
            return latest
        found = self.complete_checkpoints()
        if not found and published <= 0:
            return None
        what = f"checkpoint {found[-1]}" if found else f"published policy v{published}"
        raise ResumeRefused(
            f"--resume: {self.storage.uri(CKPT_LATEST)} is missing but {what} exists: not starting a new "
            "run over it (every shard would be trained as new); check --checkpoint-dir and the store, "
            "then retry, or start a new run without --resume"
        )

    def _new_path(self, iteration: int) -> str:
        path = checkpoint_path(iteration)
        latest = self.latest()
        committed = latest.get("path") if isinstance(latest, dict) else None
        if not isinstance(committed, str) or not (committed == path or committed.startswith(path + ".")):
            return path
        tail = committed[len(path) + 1 :]
        return f"{path}.{int(tail) + 1 if tail.isdigit() else 1}"

    def save(
        self, iteration: int, algo: Any, state: dict, *, policy_version: int, extra: dict[str, bytes] | None = None
    ) -> str:
        """Save the algorithm (``Algorithm.save_to_path``), the `extra` files (relative path ->
        bytes, in the signed index too) and *state*, then commit; the checkpoint's path."""
        path = self._new_path(iteration)
        with tempfile.TemporaryDirectory(prefix="rlrec-ckpt-") as tmp:
            algo.save_to_path(tmp)
            files = _local_hashes(tmp, ALGO_DIR)
            self.storage.upload_dir(tmp, f"{path}/{ALGO_DIR}")
        for rel, data in (extra or {}).items():
            self.storage.write(f"{path}/{rel}", data)
            files[rel] = hashlib.sha256(data).hexdigest()
        state_bytes = json.dumps(state).encode()
        self.storage.write(f"{path}/{STATE_FILE}", state_bytes)
        files[STATE_FILE] = hashlib.sha256(state_bytes).hexdigest()
        index = json.dumps({"iteration": iteration, "path": path, "files": files}, sort_keys=True).encode()
        self.storage.write(f"{path}/{INDEX_FILE}", index)
        if self.signing_key is not None:
            from rlrec.trainer.signing import sign

            self.storage.write(f"{path}/{INDEX_FILE}{SIG_SUFFIX}", sign(self.signing_key, index))
        self.storage.write(
            CKPT_LATEST, json.dumps({"iteration": iteration, "path": path, "policy_version": policy_version}).encode()
        )
        return path

    def prune(self, keep: int, current: str) -> None:
        """Delete all but the newest *keep* (at least 1) complete checkpoints, in (iteration,
        save) order, never *current*; half-written ones older than *current* go too (a crashed
        save), without counting toward *keep*."""
        try:
            dirs = self._checkpoint_dirs()
            complete = [d for d in dirs if self.storage.exists(f"{d}/{INDEX_FILE}")]
        except Exception as e:
            log.warning("could not list checkpoints to prune: %s", e)
            return
        mark = _checkpoint_order(current)
        half = [d for d in dirs if d not in complete and mark is not None and _checkpoint_order(d) < mark]
        for d in complete[: -max(1, keep)] + half:
            if d == current:
                continue
            try:
                self.storage.delete_tree(d)
            except Exception as e:
                log.warning("could not prune checkpoint %s: %s", d, e)

    def verified_index(self, path: str) -> dict[str, str] | None:
        """{relative path: sha256} of the checkpoint at *path* from its signed index; None without
        a signing key (nothing to verify with). Raises `CheckpointVerificationError`."""
        if self.signing_key is None:
            return None
        from rlrec.trainer.signing import SignatureError, verify

        try:
            index_bytes = self.storage.read(f"{path}/{INDEX_FILE}")
            sig = self.storage.read(f"{path}/{INDEX_FILE}{SIG_SUFFIX}")
        except FileNotFoundError:
            raise CheckpointVerificationError(
                f"checkpoint {path} has no signed index.json (written without a signing key, or by an older "
                "rlrec): refusing to restore it through RLlib's pickle; resume without --signing-key only if "
                "you trust everyone who can write the checkpoint dir"
            ) from None
        try:
            verify(self.signing_key.public_key(), index_bytes, sig)
        except SignatureError:
            raise CheckpointVerificationError(f"checkpoint {path}: index.json.sig does not verify") from None
        index = json.loads(index_bytes)
        if index.get("path") != path or not isinstance(index.get("files"), dict):
            raise CheckpointVerificationError(f"checkpoint {path}: its signed index names {index.get('path')!r}")
        return index["files"]

    def read_state(self, path: str) -> dict:
        """The ``trainer.json`` of the checkpoint at *path* (as named by :meth:`latest`), checked
        against the signed index when a signing key is configured."""
        data = self.storage.read(f"{path}/{STATE_FILE}")
        files = self.verified_index(path)
        if files is not None and files.get(STATE_FILE) != hashlib.sha256(data).hexdigest():
            raise CheckpointVerificationError(f"checkpoint {path}: {STATE_FILE} does not match its signed index")
        return json.loads(data)

    def read_file(self, path: str, rel: str) -> bytes:
        """The file `rel` of the checkpoint at *path* (one of `save`'s `extra` files), checked
        against the signed index when a signing key is configured."""
        data = self.storage.read(f"{path}/{rel}")
        files = self.verified_index(path)
        if files is not None and files.get(rel) != hashlib.sha256(data).hexdigest():
            raise CheckpointVerificationError(f"checkpoint {path}: {rel} does not match its signed index")
        return data

    def restore_learner_group(self, algo: Any, path: str) -> None:
        """Restore *algo*'s LearnerGroup (weights + optimizer state) from the checkpoint at *path*.

        Only the LearnerGroup: ``Algorithm.restore_from_path`` syncs weights to an EnvRunnerGroup
        that offline algorithms without an env do not have (AttributeError in RLlib 2.60).
        Evaluation EnvRunners get the weights before evaluating. With a signing key, every
        downloaded file must be in the signed index with its sha256 and every indexed file of the
        LearnerGroup must be there, before RLlib (pickle) reads any of them.
        """
        files = self.verified_index(path)
        with tempfile.TemporaryDirectory(prefix="rlrec-restore-") as tmp:
            local = os.path.join(tmp, "learner_group")
            prefix = f"{ALGO_DIR}/learner_group"
            self.storage.download_dir(f"{path}/{prefix}", local)
            if files is not None:
                got = _local_hashes(local, prefix)
                want = {k: v for k, v in files.items() if k.startswith(prefix + "/")}
                if got != want:
                    bad = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
                    raise CheckpointVerificationError(
                        f"checkpoint {path}: files do not match its signed index: {bad[:5]}"
                    )
            algo.learner_group.restore_from_path(local)
