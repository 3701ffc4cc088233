"""The chaos run's ground truth: what each produced episode must look like once committed.

Producers append one JSON line per episode (`TruthEpisode.to_json`) after its last event was
handed to the recorder. Arrays travel as raw bytes (base64) with dtype and shape, so the checker
compares bit for bit.

What the product promises (docs/GUARANTEES.md §8), and so what the checker accepts:

* `kind == "done"` or `"aborted"`: committed exactly once, observations/actions/extra model
  outputs/infos/flags/policy fields identical; an aborted episode is truncated, not terminated.
* `kind == "empty"` (aborted before its first step): never committed; dead-lettered with reason
  `empty-episode`.
* `delayed` rewards `(t, delta)`: each is either applied (committed reward of step t equals
  `rewards[t] + delta`, computed in float64) or dead-lettered with reason `late-reward` (it
  arrived after the episode was handed to the writer); never silently dropped.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TruthEpisode", "array_from_json", "array_to_json", "read_truth"]


def array_to_json(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def array_from_json(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["b64"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"])


@dataclass
class TruthEpisode:
    """One episode as the product must commit it (see the module docstring for the rules)."""

    episode_id: str
    policy_id: str
    policy_version: int
    env_id: str
    kind: str  # "done", "aborted" or "empty"
    observations: np.ndarray  # (T+1, *obs_shape)
    actions: np.ndarray  # (T,)
    rewards: np.ndarray  # float64 (T,), without the delayed rewards
    terminated: bool
    truncated: bool
    infos: list[dict]  # T+1, {} where none was given
    extra: dict[str, np.ndarray]  # each (T,)
    delayed: list[tuple[int, float]] = field(default_factory=list)  # (t, delta), at most one per t
    duplicate_messages: int = 0  # events this producer sent twice on purpose

    @property
    def committed(self) -> bool:
        """Whether the product must commit it (empty episodes go to the dead-letter topic)."""
        return self.kind != "empty"

    def to_json(self) -> str:
        return json.dumps(
            {
                "episode_id": self.episode_id,
                "policy_id": self.policy_id,
                "policy_version": self.policy_version,
                "env_id": self.env_id,
                "kind": self.kind,
                "observations": array_to_json(self.observations),
                "actions": array_to_json(self.actions),
                "rewards": array_to_json(self.rewards),
                "terminated": self.terminated,
                "truncated": self.truncated,
                "infos": self.infos,
                "extra": {k: array_to_json(v) for k, v in self.extra.items()},
                "delayed": [[t, d] for t, d in self.delayed],
                "duplicate_messages": self.duplicate_messages,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, line: str) -> TruthEpisode:
        d: dict[str, Any] = json.loads(line)
        return cls(
            d["episode_id"],
            d["policy_id"],
            d["policy_version"],
            d["env_id"],
            d["kind"],
            array_from_json(d["observations"]),
            array_from_json(d["actions"]),
            array_from_json(d["rewards"]),
            d["terminated"],
            d["truncated"],
            d["infos"],
            {k: array_from_json(v) for k, v in d["extra"].items()},
            [(int(t), float(x)) for t, x in d["delayed"]],
            d["duplicate_messages"],
        )


def read_truth(paths: Iterable[str | Path]) -> dict[str, TruthEpisode]:
    """All producers' truth logs, by episode id (an id logged twice is an error)."""
    out: dict[str, TruthEpisode] = {}
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    t = TruthEpisode.from_json(line)
                    if t.episode_id in out:
                        raise ValueError(f"episode {t.episode_id} is in the ground truth twice")
                    out[t.episode_id] = t
    return out
