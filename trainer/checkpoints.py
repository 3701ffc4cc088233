"""The continuous trainer's checkpoints: where they live in its checkpoint dir, save, prune, restore.

Checkpoint directory layout (a local path or any URI `rlrec.store.storage.Storage` accepts)::

    metrics.jsonl                         one JSON object per iteration (see rlrec.trainer.metrics)
    checkpoints/latest.json               {"iteration", "path", "policy_version"}: the commit point
    checkpoints/ckpt-00000012/algo/       RLlib checkpoint (Algorithm.save_to_path): weights,
                                          optimizer state, ...
    checkpoints/ckpt-00000012/trainer.json  cursor (shards trained on), counters, policy version
    policies/                             published policies (see rlrec.trainer.policy)

What goes into ``trainer.json`` is the trainer's business (`rlrec.trainer.service`); this module
stores it. Ray is never imported here: the algorithm is passed in.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any

from rlrec.store.storage import Storage

__all__ = ["CKPT_DIR", "CKPT_LATEST", "STATE_FILE", "STATE_VERSION", "CheckpointStore", "checkpoint_path"]

log = logging.getLogger("rlrec.trainer")

CKPT_DIR = "checkpoints"
CKPT_LATEST = f"{CKPT_DIR}/latest.json"
STATE_FILE = "trainer.json"
STATE_VERSION = 1
ALGO_DIR = "algo"


def checkpoint_path(iteration: int) -> str:
    """``checkpoints/ckpt-00000012``: the checkpoint of *iteration*, relative to the checkpoint dir."""
    return f"{CKPT_DIR}/ckpt-{iteration:08d}"


class CheckpointStore:
    """The checkpoints in a trainer's checkpoint dir (a `Storage`), in the layout above.

    Guarantees: :meth:`latest` names only complete checkpoints -- :meth:`save` writes the
    algorithm and ``trainer.json`` first and ``latest.json`` (the commit point) last; saving the
    same iteration again replaces its algorithm files instead of mixing old and new ones;
    :meth:`prune` never deletes the checkpoint it is told to keep, and a failed prune only logs.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def latest(self) -> dict | None:
        """The ``latest.json`` pointer (``{"iteration", "path", "policy_version"}``), None if nothing is saved."""
        try:
            return json.loads(self.storage.read(CKPT_LATEST))
        except FileNotFoundError:
            return None

    def save(self, iteration: int, algo: Any, state: dict, *, policy_version: int) -> str:
        """Save the algorithm (``Algorithm.save_to_path``) and *state*, then commit; the checkpoint's path."""
        path = checkpoint_path(iteration)
        with tempfile.TemporaryDirectory(prefix="rlrec-ckpt-") as tmp:
            algo.save_to_path(tmp)
            self.storage.upload_dir(tmp, f"{path}/{ALGO_DIR}")
        self.storage.write(f"{path}/{STATE_FILE}", json.dumps(state).encode())
        self.storage.write(
            CKPT_LATEST, json.dumps({"iteration": iteration, "path": path, "policy_version": policy_version}).encode()
        )
        return path

    def prune(self, keep: int, current: str) -> None:
        """Delete all but the newest *keep* (at least 1) checkpoints, never *current*."""
        try:
            dirs = sorted(i.path for i in self.storage.list(CKPT_DIR) if i.is_dir and i.name.startswith("ckpt-"))
        except Exception:
            return
        for d in dirs[: -max(1, keep)]:
            if d == current:
                continue
            try:
                self.storage.delete_tree(d)
            except Exception as e:
                log.warning("could not prune checkpoint %s: %s", d, e)

    def read_state(self, path: str) -> dict:
        """The ``trainer.json`` of the checkpoint at *path* (as named by :meth:`latest`)."""
        return json.loads(self.storage.read(f"{path}/{STATE_FILE}"))

    def restore_learner_group(self, algo: Any, path: str) -> None:
        """Restore *algo*'s LearnerGroup (weights + optimizer state) from the checkpoint at *path*.

        Only the LearnerGroup: ``Algorithm.restore_from_path`` syncs weights to an EnvRunnerGroup
        that offline algorithms without an env do not have (AttributeError in RLlib 2.60).
        Evaluation EnvRunners get the weights before evaluating.
        """
        with tempfile.TemporaryDirectory(prefix="rlrec-restore-") as tmp:
            local = os.path.join(tmp, "learner_group")
            self.storage.download_dir(f"{path}/{ALGO_DIR}/learner_group", local)
            algo.learner_group.restore_from_path(local)
