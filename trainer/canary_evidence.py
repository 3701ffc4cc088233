"""A canary's evidence: the discounted returns of its two arms, read from committed shards.

`CanaryEvidence` follows the manifest under the consumer's output root (committed shards only,
as `rlrec.trainer.ope_data.HeldOutReader` does: sha256 checked, the schema gate before any column,
episodes decoded without unpickling) and keeps, of each new episode shard, the episodes tagged
with the canary version or the base (deployed) version whose ``started_ms`` (the producer's
clock at the episode's start) is at or after the canary's start, and that log this canary's
randomized assignment to that version's arm in their reset info (`rlrec.trainer.canary.
read_assignment`; services that did not opt in log none and are no evidence), in the test's band of
the score (`rlrec.trainer.canary.in_test_band`: services at different fractions give the
arms the same shares). Each arm's statistic is the
mean discounted return ``sum_t gamma^t r_t``, each return clipped into the test's range (counted).
Shards read once; a shard that cannot be read is skipped with an error line (its episodes are no
evidence). Tabular shards are not read. `history_range` fixes a range from the episodes committed
before the start, for a test whose range the user did not state.

The cohort cut (`cohort_end_ms`, the one place it is decided): the arms a promotion may rest on
hold only the episodes that started before the cohort end, the least over the store's partition
logs of each log's watermark (`rlrec.store.watermark`, read before the shards, less
`WATERMARK_SLACK_S`; docs/GUARANTEES.md, "Watermark"), a log without one (an older consumer)
counting as ``now - episode_max_s``. Every episode that started before it has been committed,
so a slow episode, often a failure, is never missing from a cohort a promotion rests on. The
arms over every episode read (`ended`) serve rollbacks and the exposure count.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np

from rlrec.store.storage import Storage
from rlrec.trainer.sequential import ArmStats

__all__ = [
    "CLOCK_SKEW_S",
    "HISTORY_SHARDS",
    "MIN_HISTORY",
    "WATERMARK_SLACK_S",
    "CanaryEvidence",
    "discounted_return",
]

#: how many of the newest shards committed before a canary's start `history_range` reads
HISTORY_SHARDS = 20
#: the fewest episodes before the start from which `history_range` fixes a range
MIN_HISTORY = 30
#: how far the consumer's clock (a shard's commit time) may lag the trainer's (the canary's start)
#: before a shard is skipped unread as committed before the start
CLOCK_SKEW_S = 600.0
#: what the cohort end stays below a partition's watermark: an episode's start event reaches the
#: broker after its timestamp (the producer's delivery delay), and a consumer counts as caught
#: up while it reads events up to 10 s old (`rlrec.consumer.service.LIVE_LAG_S`)
WATERMARK_SLACK_S = 60.0

log = logging.getLogger("rlrec.trainer")


def discounted_return(rewards: Any, gamma: float) -> float:
    """``sum_t gamma**t * rewards[t]``.

    Example:
        >>> discounted_return([1.0, 1.0, 1.0], 0.5)
        1.75
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    return float(np.sum(r * gamma ** np.arange(r.shape[0], dtype=np.float64)))


class CanaryEvidence:
    """The two arms of one canary (module docstring); `refresh()` reads new shards.

    Args:
        input_uri: the consumer's output root (or a `Storage`).
        version: the canary version.
        base_version: the deployed version meanwhile (0: what services ran before anything was
            deployed, logged as policy version 0).
        started: the canary's start (UNIX time).
        gamma: the discount.
        policy_id: only shards of this policy id.
        share: the test's share g: only episodes in its band count
            (`rlrec.trainer.canary.in_test_band`; the others are counted in `outside_share`).
        sha256: the canary's identity (the sha256 of its ``policy.json``): only episodes whose
            logged assignment names it count (None: not checked).

    Example:
        >>> ev = CanaryEvidence("/data/exp", version=5, base_version=4, started=t0, gamma=0.99)  # doctest: +SKIP
        >>> canary, deployed = ev.refresh()  # doctest: +SKIP
    """

    def __init__(
        self,
        input_uri: Any,
        *,
        version: int,
        base_version: int,
        started: float,
        gamma: float,
        policy_id: str | None = None,
        share: float = 0.05,
        sha256: str | None = None,
    ) -> None:
        self.storage = input_uri if isinstance(input_uri, Storage) else Storage.from_uri(str(input_uri))
        self.version = int(version)
        self.base_version = int(base_version)
        self.started_ms = int(float(started) * 1000)
        self.gamma = float(gamma)
        self.policy_id = policy_id
        self._read_shards: set[str] = set()
        self._episodes: dict[str, tuple[int, int, float]] = {}  # episode id: (version, started_ms, return)
        self.longest_s = 0.0  # the longest episode of either arm read so far (start to end)
        self._bad: set[str] = set()
        self._history_read: tuple[list[float], float] | None = None
        self.shards_skipped = 0
        self.unassigned = 0  # episodes of either version without this canary's logged assignment
        self.share = float(share)
        self.sha256 = sha256
        self.outside_share = 0  # assigned episodes outside the test's band (a service's fraction, the score)
        self.misconfigured = 0  # of those, from services whose fraction lies outside [share, SHARE_MAX]
        self.overlong = 0
        self.served_canary = 0  # this canary's episodes that ended, in the band or not, in a complete cohort or not
        #: this canary's episodes outside the test's band, or logging no assignment: episode id -> return
        #: (not evidence: counted in the exposure `served_canary` and the below-range rollback)
        self._outside: dict[str, float] = {}
        self.below_outside = 0  # of those, returns below the range `refresh` was given
        #: (canary, deployed) over every episode read, in a complete cohort or not (rollbacks)
        self.ended: tuple[ArmStats, ArmStats] = (ArmStats(), ArmStats())
        #: the cohort end of the last `refresh` with `now` (Unix ms; `cohort_end_ms`)
        self.cohort_end: float | None = None
        #: the partition logs whose cohort end came from their watermark at the last `refresh`
        self.watermarked = 0
        #: episodes read after a cohort end past their start: a cohort taken as complete lacked
        #: them (a start event delivered over `WATERMARK_SLACK_S` late, a guessed episode_max_s)
        self.late = 0
        #: the partition logs' watermarks the last `refresh` with `now` read (`watermarks`)
        self.marks: dict[tuple[str, int], int | None] | None = None

    def history_range(self, widen: float = 0.25) -> tuple[float, float, int] | None:
        """``(low, high, episodes)``: the range of the discounted returns of this policy id's
        episodes (any version) in the newest `HISTORY_SHARDS` shards committed before the start,
        widened by `widen` of its span on each side; None with fewer than `MIN_HISTORY` episodes."""
        returns, _longest = self._history()
        if len(returns) < MIN_HISTORY:
            return None
        lo, hi = min(returns), max(returns)
        pad = widen * (hi - lo) if hi > lo else max(1.0, abs(lo))
        return lo - pad, hi + pad, len(returns)

    def history_longest_s(self) -> float:
        """The longest of the same episodes, from its start to its end (clamped to its shard's
        commit time), in seconds; 0.0 without any."""
        return self._history()[1]

    def _history(self) -> tuple[list[float], float]:
        """(returns, longest duration in s) of the history episodes (`history_range`), read once."""
        if self._history_read is not None:
            return self._history_read
        from rlrec.store.snapshot import open_snapshot

        snap = open_snapshot(self.storage)
        before = [
            e
            for e in snap.entries
            if e.format == "episodes"
            and (self.policy_id is None or e.policy_id == self.policy_id)
            and e.commit_time
            and e.commit_time * 1000 < self.started_ms
        ]
        before.sort(key=lambda e: e.commit_time)
        returns: list[float] = []
        longest_ms = 0
        for e in before[-HISTORY_SHARDS:]:
            try:
                for values in self._read(e, history=True).values():
                    returns.extend(x for _e, _s, _d, x in values)
                    longest_ms = max([longest_ms, *(d for _e, _s, d, _x in values)])
            except (FileNotFoundError, ValueError, KeyError, TypeError) as err:
                log.warning("shard %s cannot be read for the canary's return range (%s)", e.path, err)
        self._history_read = (returns, longest_ms / 1000.0)
        return self._history_read

    def refresh(
        self,
        low: float | None = None,
        high: float | None = None,
        now: float | None = None,
        episode_max_s: float = 0.0,
        longest_cap_s: float = float("inf"),
    ) -> tuple[ArmStats, ArmStats]:
        """Read the shards committed since the last call; (canary, deployed) over every episode
        read so far, each counted once by its episode id (a shard compacted into a merged one
        adds nothing new; one removed by retention or compaction keeps what it gave: the
        evidence only grows), each return clipped into ``[low, high]`` when given, each arm in
        the order its episodes started (then by episode id): the order the sequential test's
        bound needs (`rlrec.trainer.sequential`, "The order of the episodes").

        Args:
            low: the least return (clip).
            high: the greatest return (clip).
            now: with it, count only episodes that started before the cohort end
                (`cohort_end_ms`): a cohort whose episodes have all ended and been committed.
            episode_max_s: the longest an episode takes from its start to its committed shard
                (for partition logs without a watermark).
            longest_cap_s: an episode that took longer (by its producer's clocks, its end
                clamped to its shard's commit time) does not widen the cohort rule (`longest_s`):
                it is counted in `overlong` and logged, not trusted.
        """
        from rlrec.store.snapshot import open_snapshot

        late = self.late
        marks = None if now is None else self.watermarks()  # before the shards it vouches for
        self.marks = marks if marks is not None else self.marks
        snap = open_snapshot(self.storage)
        for e in snap.entries:
            if self.policy_id is not None and e.policy_id != self.policy_id:
                continue
            if e.format != "episodes":
                continue
            if e.path in self._read_shards or e.path in self._bad:
                continue
            outside: dict[str, float] = {}
            try:
                by_version = self._read(e, outside=outside)
            except FileNotFoundError:
                log.warning("shard %s was removed before the canary's evidence read it", e.path)
                continue
            except (ValueError, KeyError, TypeError) as err:  # a column missing or null where one is needed
                self._bad.add(e.path)
                self.shards_skipped += 1
                log.error("shard %s cannot be read as canary evidence (%s); skipping it", e.path, err)
                continue
            self._read_shards.add(e.path)
            self._outside.update(outside)
            for v, episodes in by_version.items():
                for eid, start, duration, x in episodes:
                    if eid not in self._episodes and self.cohort_end is not None and start < self.cohort_end:
                        self.late += 1  # a cohort already taken as complete lacked it
                    self._episodes.setdefault(eid, (v, start, x))
                    if duration / 1000.0 > longest_cap_s:
                        self.overlong += 1
                        log.warning(
                            "episode %s of v%d took %.0fs by its producer's clock, longer than a canary may run "
                            "(%.0fs): not trusted as the longest episode",
                            eid,
                            v,
                            duration / 1000.0,
                            longest_cap_s,
                        )
                        continue
                    self.longest_s = max(self.longest_s, duration / 1000.0)
        arms = {self.version: ArmStats(), self.base_version: ArmStats()}
        ended = {self.version: ArmStats(), self.base_version: ArmStats()}
        if self.late > late:
            log.warning(
                "%d canary/deployed episode(s) read only after the cohort end passed their start: cohorts taken as "
                "complete lacked them (a start event delivered more than %.0fs late, or a partition without a "
                "watermark whose episodes outlast --canary-episode-max-s)",
                self.late - late,
                WATERMARK_SLACK_S,
            )
        end_ms = None if marks is None else self.cohort_end_ms(marks, now, episode_max_s)
        self.cohort_end = end_ms
        self.served_canary = len(self._outside)
        self.below_outside = sum(x < low for x in self._outside.values())
        for _eid, (v, start, x) in sorted(self._episodes.items(), key=lambda kv: (kv[1][1], kv[0])):  # start order
            self.served_canary += v == self.version
            ended[v].add(x, low, high)
            if end_ms is None or start < end_ms:
                arms[v].add(x, low, high)
        self.ended = (ended[self.version], ended[self.base_version])
        return arms[self.version], arms[self.base_version]

    def watermarks(self) -> dict[tuple[str, int], int | None]:
        """``{(topic, partition): watermark}`` (Unix ms; None: none) of every partition log of
        the store (`rlrec.store.watermark.read_watermark`) and of every partition without a log
        below the largest partition count its topic's watermarks state; storage errors raise."""
        from rlrec.store.manifest import list_partition_logs
        from rlrec.store.watermark import read_watermark

        read = {k: read_watermark(self.storage, *k) for k in list_partition_logs(self.storage)}
        marks: dict[tuple[str, int], int | None] = {k: None if w is None else w.open_since_ms for k, w in read.items()}
        counts: dict[str, int] = {}
        for (topic, _p), w in read.items():
            if w is not None and w.partitions:
                counts[topic] = max(counts.get(topic, 0), w.partitions)
        for topic, n in counts.items():  # once per topic: many logs stating a count cost one pass
            for p in range(n):
                marks.setdefault((topic, p), None)  # a partition no consumer wrote yet: the guess
        return marks

    def holding(self, marks: dict[tuple[str, int], int | None], now: float) -> str:
        """Which partition's watermark holds the cohort end, and how old it is (for the log line
        of a cohort that does not move: a consumer down, or a retired topic left in the root --
        docs/TRAINER.md, "The cohort end does not move"); "" when none has a watermark."""
        known = [(v, k) for k, v in marks.items() if v is not None]
        if not known:
            return ""
        v, (topic, partition) = min(known)
        return f"; the lowest watermark is topic {topic!r} partition {partition}'s, {now - v / 1000.0:.0f}s old"

    def cohort_end_ms(self, marks: dict[tuple[str, int], int | None], now: float, episode_max_s: float) -> float:
        """The cohort end at `now` (Unix ms; module docstring): the least, over the partition logs
        of `marks` (`watermarks`), of each log's watermark (one in the future taken as `now`)
        less `WATERMARK_SLACK_S`, or, for a log without one, ``now - max(episode_max_s,
        longest_s)``; at most `now`.

        Example:
            >>> ev = CanaryEvidence("/tmp", version=2, base_version=1, started=0.0, gamma=1.0)
            >>> ev.cohort_end_ms({("rl", 0): 500_000, ("rl", 1): 900_000}, now=10_000.0, episode_max_s=900.0)
            440000.0
            >>> ev.cohort_end_ms({("rl", 0): 500_000, ("rl", 1): None}, now=1_000.0, episode_max_s=900.0)
            100000.0
            >>> ev.cohort_end_ms({("rl", 0): 99_000_000}, now=1_000.0, episode_max_s=900.0)  # a clock ahead
            940000.0
        """
        guess = (now - max(episode_max_s, self.longest_s)) * 1000.0
        self.watermarked = sum(v is not None for v in marks.values())
        ends = [guess if v is None else min(v, now * 1000.0) - WATERMARK_SLACK_S * 1000.0 for v in marks.values()]
        return min([now * 1000.0, *ends]) if ends else guess

    def _assigned(self, ep: Any, version: int) -> str:
        """How `ep` logs this canary's randomized assignment to the arm of `version`: "band" (in
        the test's band), "outside" (outside it, counted in `outside_share`), "none" (it logs no
        assignment at all) or "other" (another canary's, or the other arm's)."""
        from rlrec.trainer.canary import ASSIGNMENT_KEY, SHARE_MAX, in_test_band, read_assignment

        try:
            info = ep.get_infos(0)
        except (IndexError, KeyError, TypeError):
            return "none"
        got = read_assignment(info, str(ep.id_))
        if got is None:
            return "none"
        if got[0] != self.version or got[1] != (version == self.version):
            return "other"
        if self.sha256 is not None and info[ASSIGNMENT_KEY].get("sha256") != self.sha256:
            return "other"  # another root's or channel's canary of the same number
        if not in_test_band(str(ep.id_), got[1], got[2], self.share):
            self.outside_share += 1
            self.misconfigured += not self.share <= got[2] <= SHARE_MAX
            return "outside"
        return "band"

    def _read(
        self, entry: Any, history: bool = False, outside: dict[str, float] | None = None
    ) -> dict[int, list[tuple[str, int, int, float]]]:
        """Of each kept episode: (episode id, started_ms, duration_ms, discounted return), by
        version; the canary version's episodes outside the test's band or without an assignment
        go to `outside` (episode id -> return) instead."""
        from rlrec.store.commit import read_committed_shard
        from rlrec.store.episodes import EpisodeDecodeError, unpack_episode
        from rlrec.store.schema_gate import open_shard

        if not history and entry.commit_time and (entry.commit_time + CLOCK_SKEW_S) * 1000 < self.started_ms:
            return {}  # committed well before the canary began: every episode in it began before too
        data = read_committed_shard(self.storage, entry.path, entry.staging_path, entry.bytes)
        if entry.sha256 and hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ValueError("sha256 does not match the manifest")
        table = open_shard(data, fmt="episodes").read(["item", "policy_version", "started_ms", "ended_ms"])
        versions = table.column("policy_version").to_pylist()
        starts = table.column("started_ms").to_pylist()
        ends = table.column("ended_ms").to_pylist()
        out: dict[int, list[tuple[str, int, int, float]]] = {}
        items = table.column("item")
        for i, (v, s) in enumerate(zip(versions, starts)):
            if not history and (v not in (self.version, self.base_version) or s is None or s < self.started_ms):
                continue
            try:
                ep = unpack_episode(items[i].as_py())
            except EpisodeDecodeError as err:
                log.debug("undecodable episode in %s: %s", entry.path, err)
                continue
            if not history:
                assigned = self._assigned(ep, int(v))
                if assigned in ("none", "other"):
                    self.unassigned += 1
                if assigned != "band":
                    if outside is not None and int(v) == self.version and assigned in ("outside", "none"):
                        outside[str(ep.id_)] = discounted_return(ep.get_rewards(), self.gamma)  # served all the same
                    continue
            start = int(s) if s is not None else 0
            end = ends[i]
            if end is not None and entry.commit_time:
                end = min(int(end), int(entry.commit_time * 1000))  # it cannot end after its shard's commit
            duration = max(0, int(end) - start) if end is not None and s is not None else 0
            ret = discounted_return(ep.get_rewards(), self.gamma)
            out.setdefault(int(v), []).append((str(ep.id_), start, duration, ret))
        return out
