"""Held-out episodes for off-policy evaluation, read from committed shards without unpickling.

`HeldOutReader` follows the manifest under an output root (committed shards only), reads each
new shard once (sha256 checked against the manifest, the schema gate `rlrec.store.schema_gate`
before any column, episodes decoded into arrays by `rlrec.store.episode_arrays.decode_items`,
which refuses pickled payloads as `rlrec.store.episodes.unpack_episode` does), keeps the episodes `rlrec.trainer.holdout.is_held_out` selects and turns them
into `rlrec.trainer.ope.Episode` (behaviour propensity: the ``action_logp`` extra model output;
behaviour version: the episode's ``policy_version``; for Discrete actions with recorded
``action_dist_inputs`` of width n, the behaviour's action probabilities, softmax of them, which
make the support diagnostic exact). Episodes the trainer could not use either
(`rlrec.trainer.episode_check.unusable_reason`) are counted and left out, with their reasons.

The one rule for which episodes an evaluation may use, shared by the ``ope`` gate and
`rlrec evaluate`: each held-out episode is checked against the spaces of the policy being judged,
as its policy.json states them (`policy_spaces`), never against the episode's own spaces; one
whose data do not fit them (an action outside the action space, observations of another shape)
is unusable, counted in ``episodes_unusable`` and, by reason, in ``unusable_reasons``. So the
gate and `rlrec evaluate --as-of CURSOR` read the same episodes even where the store holds
episodes recorded under other spaces. Tabular shards are not read (counted in
``shards_skipped``). Neither Ray nor RLlib is imported: no `SingleAgentEpisode` is built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlrec.store.storage import Storage
from rlrec.trainer.holdout import holdout_key, is_held_out
from rlrec.trainer.ope import Episode

__all__ = ["HeldOutReader", "HeldOutStats", "episode_from_rllib", "policy_spaces"]

log = logging.getLogger("rlrec.trainer.ope")

#: the extra model output holding the behaviour's log-propensity (RLlib's Columns.ACTION_LOGP)
ACTION_LOGP = "action_logp"
#: the behaviour's action distribution inputs (categorical: logits), when recorded
INPUTS = "action_dist_inputs"
#: distinct unusable-episode reasons kept in `HeldOutStats.unusable_reasons` (the rest: OTHER)
MAX_REASONS = 8
OTHER = "other reasons"


def policy_spaces(spec: dict) -> tuple[Any, Any]:
    """The (observation, action) spaces a policy version's policy.json states (None where it
    states none): the spaces a `HeldOutReader` checks held-out episodes against when that
    version is judged.

    Args:
        spec: the policy.json fields (``observation_space``, ``action_space``: JSON spaces).

    Raises:
        rlrec.producer.spaces.SpaceError: a stated space is malformed.

    Example:
        >>> policy_spaces({"action_space": {"type": "Discrete", "n": 2, "start": 0, "dtype": "int64"}})
        (None, Discrete(2))
    """
    from rlrec.producer.spaces import space_from_json

    return tuple(
        None if spec.get(k) is None else space_from_json(spec[k]) for k in ("observation_space", "action_space")
    )


def episode_from_rllib(ep: Any, action_space: Any = None) -> Episode:
    """A decoded `SingleAgentEpisode` (numpy or list form) or
    `rlrec.store.episode_arrays.EpisodeArrays` -> `rlrec.trainer.ope.Episode`.

    Args:
        ep: the episode.
        action_space: the judged policy's action space (the behaviour's action probabilities
            are read for a Discrete one of the same width); None: the episode's own.

    Example:
        >>> from rlrec.store.episodes import to_single_agent_episode  # doctest: +SKIP
        >>> episode_from_rllib(to_single_agent_episode(finished)).behavior_logp  # doctest: +SKIP
    """
    T = len(ep)
    obs = np.asarray(ep.get_observations(), dtype=np.float32).reshape(T + 1, -1)
    actions = np.asarray(ep.get_actions())
    rewards = np.asarray(ep.get_rewards(), dtype=np.float64).reshape(T)
    logp = None
    if ACTION_LOGP in ep.extra_model_outputs:
        raw = np.asarray(ep.get_extra_model_outputs(ACTION_LOGP), dtype=np.float64).reshape(-1)
        if raw.shape == (T,):
            logp = raw
    probs = None
    space = action_space if action_space is not None else getattr(ep, "action_space", None)
    if INPUTS in ep.extra_model_outputs and space is not None and type(space).__name__ == "Discrete":
        logits = np.asarray(ep.get_extra_model_outputs(INPUTS), dtype=np.float64)
        if logits.shape == (T, int(space.n)) and np.isfinite(logits).all():
            z = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs = z / z.sum(axis=1, keepdims=True)
    version = (ep.custom_data or {}).get("policy_version")
    return Episode(
        obs=obs,
        actions=actions,
        rewards=rewards,
        behavior_logp=logp,
        terminated=bool(ep.is_terminated),
        id=str(ep.id_),
        policy_version=version,
        behavior_probs=probs,
    )


@dataclass
class HeldOutStats:
    """What a `HeldOutReader` read: shards, episodes seen / held out / unusable (and how many for
    each reason: at most `MAX_REASONS` distinct ones, the rest under `OTHER`), skipped shards."""

    shards: int = 0
    episodes_seen: int = 0
    episodes_held_out: int = 0
    episodes_unusable: int = 0
    unusable_reasons: dict[str, int] = field(default_factory=dict)
    shards_skipped: list[tuple[str, str]] = field(default_factory=list)

    def count_unusable(self, reasons: dict[str, int]) -> None:
        """Add one shard's unusable episodes, by reason."""
        for reason, n in reasons.items():
            key = reason if reason in self.unusable_reasons or len(self.unusable_reasons) < MAX_REASONS else OTHER
            self.unusable_reasons[key] = self.unusable_reasons.get(key, 0) + n
            self.episodes_unusable += n

    def to_dict(self) -> dict:
        return {
            "shards": self.shards,
            "episodes_seen": self.episodes_seen,
            "episodes_held_out": self.episodes_held_out,
            "episodes_unusable": self.episodes_unusable,
            "unusable_reasons": dict(sorted(self.unusable_reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
            "shards_skipped": len(self.shards_skipped),
        }


class HeldOutReader:
    """The held-out episodes of the committed shards under `input_uri`; `refresh()` reads new shards.

    Args:
        input_uri: the consumer's output root (or a `Storage`).
        fraction: the holdout fraction F (`rlrec.trainer.holdout`).
        policy_id: only shards of this policy id.
        observation_space: the judged policy's observation space (`policy_spaces`): each
            held-out episode's observations must fit it; None: not checked.
        action_space: likewise for actions.

    Example:
        >>> reader = HeldOutReader("/data/exp", 0.1)  # doctest: +SKIP
        >>> episodes = reader.refresh()  # doctest: +SKIP
    """

    def __init__(
        self,
        input_uri: Any,
        fraction: float,
        *,
        policy_id: str | None = None,
        observation_space: Any = None,
        action_space: Any = None,
    ) -> None:
        self.storage = input_uri if isinstance(input_uri, Storage) else Storage.from_uri(str(input_uri))
        self.fraction = float(fraction)
        self.policy_id = policy_id
        self.observation_space = observation_space
        self.action_space = action_space
        self._by_shard: dict[str, list[Episode]] = {}
        self._reported: set[str] = set()  # shards whose refusal was logged (once per shard)
        self.stats = HeldOutStats()
        #: the manifest point the last `refresh` read (None: not yet): its episodes are the
        #: held-out episodes of the shards at this cursor (of `policy_id`), which
        #: ``rlrec.open(uri, as_of=cursor)`` reopens
        self.cursor: str | None = None

    def refresh(
        self, as_of: str | None = None, progress: Callable[[int, int, int], None] | None = None
    ) -> list[Episode]:
        """Read the shards committed since the last call; every held-out episode known, in commit
        order, of the shards at the manifest point it read (`cursor`). The estimators sort them
        by id (`rlrec.trainer.ope.LoggedData`): the order does not change an estimate.

        The same point gives the same episodes to every reader, fresh or long-lived (the gate's
        and `rlrec evaluate`'s): a shard that fails its checks (schema gate, checksum, decode) is
        read a second time at once, and if it fails again it is skipped in this call only
        (``stats.shards_skipped``) and read again at the next; a storage error (after the
        storage's own retries) raises, so both fail rather than differ.

        Args:
            as_of: read the store at this point (a cursor a decision recorded, or a UNIX time;
                `rlrec.store.snapshot.open_snapshot`); None: the newest.
            progress: called after each shard with (shards done, shards to read, held-out
                episodes so far).
        """
        from rlrec.store.snapshot import open_snapshot

        snap = open_snapshot(self.storage, as_of=as_of)
        ordered = sorted(snap.entries, key=lambda e: (e.commit_time, e.topic, e.partition, e.seq))
        entries = [e for e in ordered if self.policy_id is None or e.policy_id == self.policy_id]
        live = set()
        skipped: list[tuple[str, str]] = []
        entries = self._with_ids(snap, entries)
        for done, e in enumerate(entries, 1):
            if progress is not None and done > 1:
                progress(done - 1, len(entries), self.stats.episodes_held_out)
            key = e.path
            live.add(key)
            if key in self._by_shard:
                continue
            try:
                self._by_shard[key] = self._read_twice(e)
                self.stats.shards += 1
            except FileNotFoundError:
                continue  # deleted (retention): nothing to evaluate on
            except ValueError as err:  # schema gate, checksum, decode: twice in a row
                skipped.append((key, str(err)))
                if key not in self._reported:
                    self._reported.add(key)
                    log.error("shard %s cannot be used for evaluation (%s); skipping it", key, err)
        if progress is not None and entries:
            progress(len(entries), len(entries), self.stats.episodes_held_out)
        for key in [k for k in self._by_shard if k not in live]:
            del self._by_shard[key]
        self.stats.shards_skipped = skipped
        self.cursor = snap.cursor
        return [ep for k in self._by_shard for ep in self._by_shard[k]]

    def _with_ids(self, snap: Any, entries: list[Any]) -> list[Any]:
        """`entries` with their episode ids where the head was opened through live sets (rows
        without ids): the ids are what lets `_read` skip a shard holding no held-out episode. Read
        from the snapshot's history (the manifest only, once, and only when a shard not read yet
        lacks them), so that only shards holding held-out episodes are read."""
        if not any(not e.episode_ids and e.path not in self._by_shard for e in entries):
            return entries
        from rlrec.store.manifest import ReplaceEntry, ShardEntry

        ids: dict[str, tuple[str, ...]] = {}
        for es in (snap._logs or {}).values():
            for x in es:
                shard = x.shard if isinstance(x, ReplaceEntry) else x
                if isinstance(shard, ShardEntry) and shard.episode_ids:
                    ids[shard.path] = tuple(shard.episode_ids)
        out = []
        for e in entries:
            known = ids.get(e.path, ()) if not e.episode_ids else ()
            out.append(dataclasses.replace(e, episode_ids=known) if len(known) == e.episodes else e)
        return out

    def _read_twice(self, entry: Any) -> list[Episode]:
        """`_read`, and once more if it fails with a ValueError (a torn read fails its checksum
        once; a damaged shard fails the same way again)."""
        try:
            return self._read(entry)
        except ValueError:
            return self._read(entry)

    def _read(self, entry: Any) -> list[Episode]:
        from rlrec.store.commit import read_committed_shard
        from rlrec.store.episode_arrays import decode_episode, item_views
        from rlrec.store.episodes import EpisodeDecodeError
        from rlrec.store.schema_gate import MULTI_AGENT_SHARD_FORMAT_VERSION, open_shard
        from rlrec.trainer.episode_check import unusable_reason

        multi_agent = entry.format_version == MULTI_AGENT_SHARD_FORMAT_VERSION  # split by multi-agent id
        if (
            not multi_agent
            and entry.episode_ids
            and not any(is_held_out(str(i), self.fraction) for i in entry.episode_ids)
        ):
            self.stats.episodes_seen += len(entry.episode_ids)
            return []  # the manifest names its episodes: none is held out, nothing to read
        if entry.format != "episodes":
            raise ValueError(f"{entry.format} shards are not read by the evaluator (episode shards only)")
        data = read_committed_shard(self.storage, entry.path, entry.staging_path, entry.bytes)
        if entry.sha256 and hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ValueError("sha256 does not match the manifest")
        shard = open_shard(data, fmt="episodes")
        multi_agent = shard.version == MULTI_AGENT_SHARD_FORMAT_VERSION
        table = shard.read(["item", "multi_agent_episode_id"] if multi_agent else ["item"])
        ma_ids = table.column("multi_agent_episode_id").to_pylist() if multi_agent else None
        out = []
        seen = 0
        unusable: dict[str, int] = {}  # counted into the stats once the whole shard is read
        for chunk in table.column("item").chunks:
            for v in item_views(chunk):
                seen += 1
                try:
                    ep = decode_episode(v)
                except EpisodeDecodeError as err:
                    unusable["undecodable episode"] = unusable.get("undecodable episode", 0) + 1
                    log.debug("undecodable episode in %s: %s", entry.path, err)
                    continue
                ma_id = ma_ids[seen - 1] if ma_ids is not None else None
                if not is_held_out(holdout_key(ep.id_, ma_id), self.fraction):
                    continue
                reason = unusable_reason(ep, self.observation_space, self.action_space)
                if reason is not None:
                    unusable[reason] = unusable.get(reason, 0) + 1
                    continue
                out.append(episode_from_rllib(ep, self.action_space))
        self.stats.episodes_seen += seen
        self.stats.count_unusable(unusable)
        self.stats.episodes_held_out += len(out)
        return out
