"""The held-out evaluation split: a deterministic function of the episode id.

An episode is *held out* when the first 8 bytes of the SHA-256 of its id (UTF-8), read as a
big-endian unsigned integer and divided by 2**64, fall below the holdout fraction F. The split
depends on nothing but the id and F, so it is stable across restarts, replays, shard layouts and
processes, and a larger F holds out a superset of a smaller one. ``rlrec train --holdout-fraction F``
never trains on held-out episodes; ``rlrec evaluate --holdout-fraction F`` reads only them.

The id split is `holdout_key`'s: an agent row of a multi-agent shard (format version 2) is split by
its ``multi_agent_episode_id``, so all agents of one multi-agent episode fall on one side; every
other episode by its own id. The trainer's PreLearner, lineage (`rlrec.trainer.lineage.HoldoutSplit`)
and the evaluator all split through it.

A stock RLlib reader applies the same split with::

    import hashlib
    held_out = int.from_bytes(hashlib.sha256(eps_id.encode()).digest()[:8], "big") / 2**64 < F

Standard library only.
"""

from __future__ import annotations

import hashlib

__all__ = ["DEFAULT_HOLDOUT_FRACTION", "check_fraction", "holdout_key", "holdout_score", "is_held_out"]

#: the default of ``--holdout-fraction`` for ``rlrec train`` and ``rlrec evaluate``
DEFAULT_HOLDOUT_FRACTION = 0.1


def holdout_key(episode_id: str | None, multi_agent_episode_id: str | None = None) -> str:
    """The id an episode is held out by: the multi-agent episode id of an agent row of a
    multi-agent shard, else the episode's own id (a null id as its text "None").

    Args:
        episode_id: the episode's id (``SingleAgentEpisode.id_``, the ``eps_id`` column).
        multi_agent_episode_id: the row's ``multi_agent_episode_id`` when the row is an agent row of a
            multi-agent shard (format version 2); None for every other episode, whatever its
            `SingleAgentEpisode.multi_agent_episode_id` says.

    Example:
        >>> holdout_key("agent-ep-1", "ma-ep-1"), holdout_key("ep-1")
        ('ma-ep-1', 'ep-1')
    """
    return str(multi_agent_episode_id) if multi_agent_episode_id else str(episode_id)


def holdout_score(episode_id: str) -> float:
    """The episode's position in [0, 1): first 8 bytes of sha256(id) / 2**64.

    Args:
        episode_id: the episode id as recorded (``SingleAgentEpisode.id_``, the ``eps_id`` column).

    Example:
        >>> holdout_score("episode-1") == holdout_score("episode-1")
        True
        >>> 0.0 <= holdout_score("episode-1") < 1.0
        True
    """
    digest = hashlib.sha256(str(episode_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_held_out(episode_id: str, fraction: float) -> bool:
    """Whether the episode belongs to the held-out evaluation data for `fraction`.

    Args:
        episode_id: the episode id.
        fraction: the holdout fraction F in [0, 1); 0 holds out nothing.

    Example:
        >>> is_held_out("episode-1", 0.0)
        False
        >>> sum(is_held_out(f"e{i}", 0.1) for i in range(10_000)) in range(900, 1100)
        True
    """
    return fraction > 0.0 and holdout_score(episode_id) < fraction


def check_fraction(fraction: float, flag: str = "--holdout-fraction") -> float:
    """`fraction` as a float if it is in [0, 1), else ValueError naming `flag`.

    Args:
        fraction: the value to check.
        flag: the option it came from, for the message.

    Example:
        >>> check_fraction(0.1)
        0.1
    """
    f = float(fraction)
    if not 0.0 <= f < 1.0:
        raise ValueError(f"{flag} must be in [0, 1), got {fraction!r}")
    return f
