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

Standard library only.
"""

from __future__ import annotations

import hashlib

__all__ = ["CANARY_SALT", "canary_score", "check_canary_fraction", "in_canary"]

#: prefixed to the episode id before hashing (the holdout split hashes the bare id)
CANARY_SALT = b"rlrec-canary:"


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
    """`fraction` as a float if it is in [0, 1], else ValueError.

    Example:
        >>> check_canary_fraction(0.05)
        0.05
    """
    f = float(fraction)
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"canary_fraction must be in [0, 1], got {fraction!r}")
    return f
