"""The trainer service's shared names: its logger, the algorithms it trains, its errors and small helpers
(`rlrec.trainer.service` and its parts import them from here; re-exported there).
"""

from __future__ import annotations

import importlib
import logging
import math
from typing import Any

from rlrec.store.manifest import ShardEntry
from rlrec.store.storage import Storage

log = logging.getLogger("rlrec.trainer")

#: where a checkpoint keeps the files of the policy versions it commits to publishing
PUBLISH_DIR = "publish"

#: algorithm name -> (config class path, allowed action space types)
ALGORITHMS = {
    "BC": ("ray.rllib.algorithms.bc:BCConfig", ("Discrete", "Box")),
    "MARWIL": ("ray.rllib.algorithms.marwil:MARWILConfig", ("Discrete", "Box")),
    "CQL": ("ray.rllib.algorithms.cql:CQLConfig", ("Box",)),
    "IQL": ("ray.rllib.algorithms.iql:IQLConfig", ("Box",)),
}


class TrainerLost(RuntimeError):
    """A part of the running trainer (a Ray actor, a Learner) died and cannot be replaced in place."""

    #: a runtime failure: `rlrec train` prints the message as its one error line, exit code 1
    exit_code = 1


class LineageLost(TrainerLost):
    """A trained shard is in no partition log of the input: no version's lineage can name the
    data it was trained on, so the trainer stops rather than publish without it (exit code 1)."""


class StoreTooNew(RuntimeError):
    """The input's manifest holds an entry this rlrec cannot read (a newer rlrec wrote it): the
    trainer would take no new shards from that log until it is upgraded, so it checkpoints and
    stops rather than go on training on stale data, at start or mid-run (exit code 2: a restart
    without an upgrade fails the same way)."""

    #: `rlrec train` prints the message as its one error line
    exit_code = 2


class NoFirstShard(RuntimeError):
    """No committed shard appeared within ``--first-shard-timeout-s`` (exit code 1, one line saying why)."""

    exit_code = 1


class UnsupportedCombination(ValueError):
    """The algorithm cannot train on these spaces (RLlib 2.60)."""


def _import(path: str) -> Any:
    """``"pkg.mod:Name"`` or ``"pkg.mod.Name"`` -> the object."""
    mod, name = path.split(":", 1) if ":" in path else path.rsplit(".", 1)
    return getattr(importlib.import_module(mod), name)


# ---------------------------------------------------------------------------------- helpers


def _check_spaces(algo: str, obs_space: Any, act_space: Any) -> None:
    import gymnasium as gym

    allowed = ALGORITHMS[algo][1]
    kind = type(act_space).__name__
    if kind not in allowed:
        hint = (
            " (RLlib 2.60's CQL and IQL assume continuous Box actions; use BC or MARWIL for discrete actions)"
            if algo in ("CQL", "IQL")
            else ""
        )
        raise UnsupportedCombination(
            f"{algo} cannot train on a {kind} action space{hint}; supported: {', '.join(allowed)}"
        )
    if not isinstance(obs_space, gym.spaces.Box):
        raise UnsupportedCombination(
            f"{algo} with RLlib's default models needs a Box observation space, got {type(obs_space).__name__}"
        )
    if isinstance(act_space, gym.spaces.Box) and not (
        (act_space.bounded_below.all() and act_space.bounded_above.all()) or algo in ("BC", "MARWIL")
    ):
        raise UnsupportedCombination(f"{algo} needs a bounded Box action space, got {act_space}")


def _result_get(d: dict, *path: str, default: Any = None) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def _finite(x: Any) -> float | None:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


# ---------------------------------------------------------------------------------- trainer


def _ranges_state(doc: Any) -> dict[tuple[str, int], list[list[int]]]:
    """Per partition log, seq ranges from their JSON form (`rlrec.trainer.lineage.ranges_doc`)."""
    return {(str(t), int(p)): [[int(a), int(b)] for a, b in rs] for t, p, rs in doc}


def shard_places(storage: Storage) -> dict[str, tuple[tuple[str, int], tuple[int, ...]]]:
    """Every shard of a store by path: its partition log and the seqs of the shard entries it
    stands for in a lineage -- a shard entry itself (compacted since or not), a merged shard
    the entries it holds (`rlrec.store.log_shards.merged_shards`)."""
    from rlrec.store.log_shards import merged_shards
    from rlrec.store.manifest import read_partition_logs

    places: dict[str, tuple[tuple[str, int], tuple[int, ...]]] = {}
    for key, entries in read_partition_logs(storage).items():
        for e in entries:
            if isinstance(e, ShardEntry):
                places[e.path] = (key, (int(e.seq),))  # type: ignore[arg-type]
        places.update({p: (key, seqs) for p, seqs in merged_shards(entries).items()})
    return places
