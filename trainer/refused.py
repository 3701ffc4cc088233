"""Candidates the ope promotion gate refused, kept so that a refusal can be reproduced.

A refused candidate is written, signed like a publication (weights, ``lineage.json``,
``policy.json`` with the decision under ``"promotion"``, its signature), to
``{publish root}/candidates/{key}/v{N:06d}/``, where ``key`` is the time it was refused and the
sha256 of its weights. Nothing that serves or retains looks there: services follow
``latest.json`` and load ``v{N:06d}/`` directories of the root only, the version numbering
(`rlrec.trainer.export.highest_version`) and retention's lineage pins
(`rlrec.trainer.retention_pins`) read those directories only, so a refused candidate is never
served and pins no data. The decision records where it is (``refused_candidate``: ``dir`` and
``version``), and ``rlrec evaluate --candidate DIR --version N --compare-to M --as-of CURSOR``
asks the gate's question of it again. The newest `KEEP` are kept; older ones are removed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

__all__ = ["CANDIDATES", "KEEP", "keep_refused"]

log = logging.getLogger("rlrec.trainer")

#: the folder of the publish root holding refused candidates
CANDIDATES = "candidates"
#: refused candidates kept (the newest)
KEEP = 20


def keep_refused(storage: Any, job: Any, decision: dict, **publication: Any) -> dict:
    """Write the refused candidate of `job` under ``candidates/`` of the publish root `storage`
    and remove all but the newest `KEEP`.

    Args:
        storage: the publish root (`rlrec.store.storage.Storage`).
        job: the `rlrec.trainer.ope_jobs.CandidateJob` (its ``artifact``, ``version``, lineage).
        decision: the gate's decision (recorded in the candidate's ``policy.json``).
        publication: `rlrec.trainer.export.prepare_publication`'s spaces, algorithm name,
            signing key, run id, channel and parent version.

    Returns:
        ``{"dir": "candidates/{key}", "version": N}``: what ``rlrec evaluate --candidate DIR
        --version N`` loads.

    Example:
        >>> keep_refused(storage, job, d, observation_space=obs, action_space=act,  # doctest: +SKIP
        ...              algo_name="BC", signing_key=key, run_id=run, channel=None, parent_version=1)
        {'dir': 'candidates/1764361234-9f86d081884c', 'version': 2}
    """
    from rlrec.trainer.export import SPEC, prepare_publication

    pub = prepare_publication(
        algo=None,
        version=job.version,
        iteration=job.iteration,
        timesteps_trained=job.timesteps_trained,
        shards=job.shards,
        new_shards=job.new_shards,
        data=job.data,
        artifact=job.artifact,
        metadata={"gamma": job.gamma, "promotion": decision},
        **publication,
    )
    weights = hashlib.sha256(job.artifact.files[job.artifact.spec["model"]]).hexdigest()[:12]
    where = f"{CANDIDATES}/{int(time.time()):010d}-{weights}"
    last = (SPEC, f"{SPEC}.sig")
    for name in (*(n for n in pub.files if n not in last), *(n for n in last if n in pub.files)):
        storage.write(f"{where}/{pub.directory}/{name}", pub.files[name])  # policy.json last: loadable once whole
    _prune(storage)
    return {"dir": where, "version": job.version}


def _prune(storage: Any) -> None:
    """Remove all but the newest `KEEP` refused candidates (their names begin with the time)."""
    kept = sorted(f.path.rsplit("/", 1)[-1] for f in storage.list(CANDIDATES) if f.is_dir)
    for name in kept[:-KEEP]:
        try:
            storage.delete_tree(f"{CANDIDATES}/{name}")
        except Exception as e:  # tried again after the next refusal
            log.warning("removing the refused candidate %s/%s failed: %s", CANDIDATES, name, e)
