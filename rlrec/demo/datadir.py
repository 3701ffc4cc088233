"""The demo's data directory (layout shared with `rlrec report`; see the module docstring of
`rlrec.demo.run`): preparing it, demo.json, and the end-of-run summary read from the manifest."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass

__all__ = ["DataDir", "DataDirError", "committed_by_version"]

#: what a previous demo run leaves behind (and a new run may remove)
_OURS = ("demo.json", "metrics.jsonl", "shards", "trainer", "logs", "report.html", "report")


class DataDirError(RuntimeError):
    """The data directory holds something that is not a previous demo run."""


@dataclass
class DataDir:
    root: str

    def __post_init__(self) -> None:
        self.root = os.path.abspath(os.path.expanduser(self.root))

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def prepare(self) -> bool:
        """Create the directory; clear a previous demo run in it. True if one was cleared.
        Refuses (DataDirError) a non-empty directory that is not a demo data dir."""
        os.makedirs(self.root, exist_ok=True)
        entries = set(os.listdir(self.root))
        if not entries:
            cleared = False
        elif "demo.json" in entries:
            for name in _OURS:
                p = self.path(name)
                if os.path.isdir(p):
                    shutil.rmtree(p)
                elif os.path.exists(p):
                    os.remove(p)
            cleared = True
        else:
            raise DataDirError(
                f"{self.root} is not empty and holds no demo.json (not a demo data dir); choose another --data-dir"
            )
        os.makedirs(self.path("logs"), exist_ok=True)
        os.makedirs(self.path("trainer"), exist_ok=True)
        return cleared

    def write_description(self, desc: dict) -> None:
        tmp = self.path("demo.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(desc, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path("demo.json"))


def committed_by_version(shards_uri: str) -> dict:
    """From the manifest and the committed shards' metadata columns: totals and, per policy
    version, episodes and mean episode return."""
    from rlrec.store.commit import read_committed_shard
    from rlrec.store.manifest import manifest_totals, read_manifest
    from rlrec.store.schema_gate import ShardSchemaError, open_shard
    from rlrec.store.storage import Storage

    storage = Storage.from_uri(shards_uri)
    entries = read_manifest(storage)
    by_version: dict[int, list[float]] = {}
    for e in entries:
        data = read_committed_shard(storage, e.path, e.staging_path, e.bytes)
        try:
            t = open_shard(data, fmt=e.format).read(["policy_version", "episode_return"])
        except ShardSchemaError:
            continue  # refused by the schema gate: not counted
        for v, r in zip(t.column("policy_version").to_pylist(), t.column("episode_return").to_pylist()):
            by_version.setdefault(int(v), []).append(float(r))
    totals = manifest_totals(entries)
    totals.pop("policies", None)
    totals["by_version"] = {
        v: {"episodes": len(rs), "return_mean": sum(rs) / len(rs)} for v, rs in sorted(by_version.items())
    }
    totals["newest_commit_age_s"] = round(time.time() - entries[-1].commit_time, 1) if entries else None
    return totals
