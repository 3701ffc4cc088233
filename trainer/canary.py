"""Which episodes a canary serves: a deterministic function of the episode id and the share.

An episode runs the canary version when the first 8 bytes of the SHA-256 of
``b"rlrec-canary:" + id`` (UTF-8), read as a big-endian unsigned integer and divided by 2**64,
fall below the canary fraction f (`rlrec.trainer.policy.load_policy`'s ``canary_fraction``).
The salt makes the canary's share independent of the held-out split (`rlrec.trainer.holdout`
hashes the bare id): without it the canary's episodes would be exactly the held-out ones. The
choice depends on nothing but the id and f, so a restarted service, or any of its replicas,
serves an episode the same version, and a larger f serves a superset of a smaller one.

Any reader can recompute it::

    import hashlib
    canary = int.from_bytes(hashlib.sha256(b"rlrec-canary:" + eps_id.encode()).digest()[:8], "big") / 2**64 < f

A service that opts in logs each episode's assignment in the episode's reset info
(`Assignment.info`, under `ASSIGNMENT_KEY`: the canary version, the arm and the fraction); the
trainer counts as evidence only episodes whose logged assignment is the running canary's and
agrees with this hash (`read_assignment`), never the traffic of services that did not opt in.
Services may opt in at different fractions (a cautious one at 0.01, a bold one at 0.2) or ramp
theirs: pooled as served, the canary arm would hold mostly the bold service's traffic and the
deployed arm mostly the cautious one's. So the test counts a fixed band of the score for each arm
(`in_test_band`): canary episodes with a score below the test's share g (``rlrec train
--canary-share``), deployed episodes with a score at or above `SHARE_MAX`, of services serving a
fraction f with g <= f <= `SHARE_MAX`. Every such service and period then gives the same share g
of its episodes to the canary arm and 1 - `SHARE_MAX` to the deployed arm: the two arms are a
randomized split of one population again.

Standard library only.
"""

from __future__ import annotations

import hashlib
import math
import numbers

__all__ = [
    "ASSIGNMENT_KEY",
    "CANARY_RESIGN_S",
    "CANARY_SALT",
    "MAX_CANARY_AGE_S",
    "SHARE_MAX",
    "assignment_info",
    "canary_score",
    "check_canary_age",
    "check_canary_fraction",
    "in_canary",
    "in_test_band",
    "read_assignment",
]

#: the reset-info key under which a service logs an episode's canary assignment
ASSIGNMENT_KEY = "rlrec_canary"

#: prefixed to the episode id before hashing (the holdout split hashes the bare id)
CANARY_SALT = b"rlrec-canary:"

#: the largest canary fraction whose episodes are evidence; deployed episodes count from this score
SHARE_MAX = 0.5

#: services refuse a ``canary.json`` signed longer ago than this by default (`load_policy`'s
#: ``max_canary_age_s``): a replayed pointer of an ended canary, or a dead trainer's canary
#: that nobody judges, is not served past it
MAX_CANARY_AGE_S = 3600.0
#: the trainer re-signs its running canary's ``canary.json`` at least this often while it looks
#: at it (and at every checkpoint), well inside `MAX_CANARY_AGE_S`
CANARY_RESIGN_S = 600.0


def canary_score(episode_id: str) -> float:
    """The episode's position in [0, 1) for the canary split: sha256(salt + id)[:8] / 2**64.

    Args:
        episode_id: the episode id as the service records it.

    Example:
        >>> canary_score("episode-1") == canary_score("episode-1")
        True
        >>> from rlrec.trainer.holdout import holdout_score
        >>> canary_score("episode-1") != holdout_score("episode-1")
        True
    """
    digest = hashlib.sha256(CANARY_SALT + str(episode_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def in_canary(episode_id: str, fraction: float) -> bool:
    """Whether the episode runs the canary version when a share `fraction` of episodes does.

    Args:
        episode_id: the episode id.
        fraction: the canary share f in [0, 1]; 0 serves the canary nothing.

    Example:
        >>> in_canary("episode-1", 0.0)
        False
        >>> sum(in_canary(f"e{i}", 0.1) for i in range(10_000)) in range(900, 1100)
        True
    """
    return fraction > 0.0 and canary_score(episode_id) < fraction


def check_canary_fraction(fraction: float) -> float:
    """`fraction` as a float if it is in [0, `SHARE_MAX`], else ValueError: a service serving a
    larger share serves an untested canary to most of its traffic and gives the test nothing
    (`in_test_band`).

    Example:
        >>> check_canary_fraction(0.05)
        0.05
    """
    f = float(fraction)
    if not 0.0 <= f <= SHARE_MAX:
        raise ValueError(
            f"canary_fraction must be in [0, {SHARE_MAX:g}], got {fraction!r} (a larger share serves the untested "
            "canary to most episodes, and none of them is evidence for its test)"
        )
    return f


def check_canary_age(limit: object) -> float | None:
    """`limit` (``max_canary_age_s``) as a float if it is a positive finite number, None if None,
    else ValueError: a string would fail at the first canary instead of at load, NaN would switch
    the limit off and a limit <= 0 would refuse every canary.

    Example:
        >>> check_canary_age(3600)
        3600.0
    """
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real) or not math.isfinite(limit) or limit <= 0:
        raise ValueError(f"max_canary_age_s must be a positive finite number of seconds or None, got {limit!r}")
    return float(limit)


def assignment_info(canary_version: int, fraction: float, canary: bool, sha256: str | None = None) -> dict:
    """The reset-info entry that logs an episode's canary assignment (`Assignment.info`): with
    `sha256`, the canary's identity (the sha256 of its signed ``policy.json``, as ``canary.json``
    names it), so the trainer counts no other root's or channel's canary of the same number.

    Example:
        >>> assignment_info(5, 0.2, False)
        {'rlrec_canary': {'version': 5, 'arm': 'deployed', 'fraction': 0.2}}
    """
    entry = {"version": int(canary_version), "arm": "canary" if canary else "deployed", "fraction": fraction}
    if sha256 is not None:
        entry["sha256"] = sha256
    return {ASSIGNMENT_KEY: entry}


def read_assignment(info: object, episode_id: str) -> tuple[int, bool, float] | None:
    """``(canary_version, in the canary arm, fraction)`` an episode's reset `info` logs, None when
    it logs none or one that the hash of `episode_id` contradicts (not a randomized assignment).

    Example:
        >>> eid = next(f"e{i}" for i in range(100) if not in_canary(f"e{i}", 0.2))
        >>> read_assignment(assignment_info(5, 0.2, False), eid)
        (5, False, 0.2)
        >>> read_assignment(assignment_info(5, 0.2, True), eid) is None
        True
    """
    if not isinstance(info, dict):
        return None
    a = info.get(ASSIGNMENT_KEY)
    if not isinstance(a, dict) or a.get("arm") not in ("canary", "deployed"):
        return None
    version, fraction = a.get("version"), a.get("fraction")
    if type(version) is not int or isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        return None
    if not 0.0 < float(fraction) <= 1.0:
        return None
    canary = a["arm"] == "canary"
    if in_canary(episode_id, float(fraction)) != canary:
        return None
    return version, canary, float(fraction)


def in_test_band(episode_id: str, canary: bool, fraction: float, share: float) -> bool:
    """Whether an episode a service assigned at `fraction` to the canary arm (`canary`) or the
    deployed one is evidence of a test at `share` (module docstring): the service's fraction lies
    in ``[share, SHARE_MAX]`` and the episode's score below `share` (canary) or at or above
    `SHARE_MAX` (deployed).

    Args:
        episode_id: the episode id.
        canary: the arm the service logged (it agrees with the hash: `read_assignment`).
        fraction: the fraction the service logged.
        share: the test's share g.

    Example:
        >>> eid = next(f"e{i}" for i in range(1000) if 0.05 <= canary_score(f"e{i}") < 0.2)
        >>> in_test_band(eid, True, 0.2, 0.05)  # served the canary, but above the test's share
        False
        >>> in_test_band(eid, True, 0.2, 0.2), in_test_band(eid, True, 0.01, 0.01)  # f=0.01: not served it
        (True, False)
    """
    if not share <= fraction <= SHARE_MAX:
        return False
    score = canary_score(episode_id)
    return score < share if canary else score >= SHARE_MAX
