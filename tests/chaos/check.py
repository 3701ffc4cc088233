"""The chaos run's verdict: committed shards vs. the producers' ground truth, offsets vs. manifest.

Reads everything from the real systems after the consumers stopped: the transitions topic and
its dead-letter topic (from the beginning), the group's committed offsets, every committed shard
through the manifest. `check()` returns a `Verdict`; `lost`/`duplicated` count episodes,
`problems` lists everything else that is wrong (content differences, unexpected dead letters,
offsets that disagree with the manifest).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from rlrec.consumer.assembly import parse_decision
from rlrec.local import consumer_test_config
from rlrec.producer.events import (
    DecodeError,
    EpisodeAbort,
    EpisodeStart,
    RewardDelta,
    StepBatch,
    decode,
)
from rlrec.store.commit import read_committed_shard
from rlrec.store.manifest import ClaimEntry, ShardEntry, read_partition_logs
from rlrec.store.shards import read_episodes
from rlrec.store.storage import Storage
from tests.chaos.truth import TruthEpisode

__all__ = [
    "DeadLetters",
    "TopicScan",
    "Verdict",
    "check",
    "committed_offsets",
    "scan_dead_letters",
    "scan_tail",
    "scan_topic",
]


def _read_all(
    bootstrap: str,
    topic: str,
    partitions: int,
    idle_s: float = 6.0,
    timeout: float = 300.0,
    at_least: int = 0,
    start: dict[int, int] | None = None,
):
    """Every message of `topic` from the beginning, once: yields Kafka messages, partition by
    partition in offset order. Stops when every partition reported its end (or nothing came for
    idle_s), but not before `at_least` messages came: Tansu's end of partition (its high
    watermark) can be wrong, after a restart most of all, so a reader that knows how many
    messages exist waits for them (until `timeout`). Such a wrong end also makes a fetch "out of
    range": the reader then goes on from where it was (never from the beginning again, which
    under load re-read a partition's head until the timeout), and a message served twice is
    yielded once. `start`: the offset to read each partition from (default: its beginning)."""
    c = Consumer(
        consumer_test_config(
            bootstrap,
            f"chaos-scan-{uuid.uuid4().hex[:8]}",
            {"enable.partition.eof": True, "auto.offset.reset": "error"},
        )
    )
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING if start is None else start[p]) for p in range(partitions)])
    position = {p: 0 if start is None else start[p] for p in range(partitions)}  # the next offset to yield
    at_end: set[int] = set()
    deadline = time.monotonic() + timeout
    last_msg = time.monotonic()
    seen = 0
    try:
        while time.monotonic() < deadline and (
            seen < at_least or (len(at_end) < partitions and time.monotonic() - last_msg < idle_s)
        ):
            for m in c.consume(num_messages=5000, timeout=0.5):
                if m.error() is not None:
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        at_end.add(m.partition())
                    elif m.error().code() == KafkaError._AUTO_OFFSET_RESET and m.partition() is not None:
                        time.sleep(0.2)
                        c.seek(TopicPartition(topic, m.partition(), position[m.partition()]))
                    continue
                p, off = m.partition(), m.offset()
                if off < position[p]:
                    continue  # served again
                position[p] = off + 1
                at_end.discard(p)
                last_msg = time.monotonic()
                seen += 1
                yield m
    finally:
        c.close()


@dataclass
class TopicScan:
    """Where each episode's events are on the transitions topic."""

    end_offsets: dict[int, int] = field(default_factory=dict)  # partition -> last offset + 1
    messages: int = 0
    partition_of: dict[str, int] = field(default_factory=dict)
    start_offset: dict[str, int] = field(default_factory=dict)  # first EpisodeStart
    end_offset: dict[str, int] = field(default_factory=dict)  # first terminal batch or abort
    split: set[str] = field(default_factory=set)  # episodes on several partitions (must stay empty)
    undecodable: int = 0
    decisions: int = 0  # EpisodeAborts consumers wrote for their own decisions (timeouts, evictions)
    per_partition: dict[int, int] = field(default_factory=dict)  # messages read per partition
    #: messages found past the first scan's ends once the consumers stopped (`scan_tail`)
    tail: int = 0

    def add(self, m) -> None:
        """Count Kafka message `m` and note where its episode starts and ends."""
        p, off = m.partition(), m.offset()
        self.messages += 1
        self.per_partition[p] = self.per_partition.get(p, 0) + 1
        self.end_offsets[p] = max(self.end_offsets.get(p, 0), off + 1)
        try:
            ev = decode(m.value(), m.headers())
        except DecodeError:
            self.undecodable += 1
            return
        eid = ev.episode_id
        if isinstance(ev, EpisodeAbort) and parse_decision(ev.reason) is not None:
            self.decisions += 1  # a consumer's, not a producer's: not an end the producer chose
            return
        if self.partition_of.setdefault(eid, p) != p:
            self.split.add(eid)
        if isinstance(ev, EpisodeStart):
            self.start_offset.setdefault(eid, off)
        elif isinstance(ev, EpisodeAbort) or (isinstance(ev, StepBatch) and (ev.terminated or ev.truncated)):
            self.end_offset.setdefault(eid, off)

    def summary(self) -> dict:
        """What result.json keeps of the scan (to tell a short read of a partition from data)."""
        return {
            "messages": self.messages,
            "decisions": self.decisions,
            "end_offsets": self.end_offsets,
            "per_partition": self.per_partition,
            "tail": self.tail,
        }


def scan_topic(bootstrap: str, topic: str, partitions: int, at_least: int = 0, timeout: float = 300.0) -> TopicScan:
    """What the topic holds; `at_least`: the messages known to be on it (read until they came,
    for `timeout` seconds at most)."""
    s = TopicScan(end_offsets=dict.fromkeys(range(partitions), 0))
    for m in _read_all(bootstrap, topic, partitions, at_least=at_least, timeout=timeout):
        s.add(m)
    return s


def scan_tail(bootstrap: str, topic: str, scan: TopicScan, timeout: float = 120.0) -> int:
    """Read what came to the topic after `scan` (from its ends on), once the consumers stopped,
    into `scan`; the number of such messages. The scan runs while the consumers drain, and a
    consumer that reaches an episode only then can still write a decision abort (a timeout) to
    the topic: without this read, the check would take the partition's end from before it."""
    n = 0
    for m in _read_all(bootstrap, topic, len(scan.end_offsets), idle_s=4.0, timeout=timeout, start=scan.end_offsets):
        scan.add(m)
        n += 1
    scan.tail += n
    return n


@dataclass
class DeadLetters:
    """The dead-letter topic, by reason."""

    reasons: Counter = field(default_factory=Counter)  # messages per reason
    late_rewards: set[tuple[str, int, float]] = field(default_factory=set)  # (episode, t, reward)
    empty: set[str] = field(default_factory=set)  # episodes dead-lettered as empty-episode
    #: step batches after a committed episode's end and starts of committed episodes: a producer's
    #: re-sends the consumer could not tell from new events (the episode was committed by an
    #: earlier owner); checked against the truth
    after_end: list = field(default_factory=list)
    other: list[str] = field(default_factory=list)  # anything else: unexpected in a chaos run


def scan_dead_letters(bootstrap: str, topic: str, partitions: int) -> DeadLetters:
    d = DeadLetters()
    for m in _read_all(bootstrap, f"{topic}.dlq", partitions, idle_s=4.0):
        headers = m.headers() or []
        reason = dict(headers).get("rlrec-dlq-reason", b"?").decode()
        d.reasons[reason] += 1
        try:
            ev = decode(m.value(), headers)
        except DecodeError as e:
            d.other.append(f"{reason}: undecodable dead letter ({e})")
            continue
        if reason == "late-reward" and isinstance(ev, RewardDelta):
            d.late_rewards.add((ev.episode_id, ev.t, ev.reward))
        elif reason == "empty-episode":
            d.empty.add(ev.episode_id)
        elif reason == "step-after-end" and isinstance(ev, StepBatch):
            d.after_end.append(ev)
        elif reason == "duplicate-start" and isinstance(ev, EpisodeStart):
            d.after_end.append(ev)  # a re-sent start after an earlier owner committed the episode
        else:
            d.other.append(
                f"{reason}: {type(ev).__name__} of episode {ev.episode_id}: "
                f"{dict(headers).get('rlrec-dlq-detail', b'').decode()}"
            )
    return d


def committed_offsets(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    """The group's committed offset per partition (0 where nothing was committed)."""
    c = Consumer(consumer_test_config(bootstrap, group))
    try:
        tps = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=20)
    finally:
        c.close()
    return {tp.partition: max(tp.offset, 0) for tp in tps}


@dataclass
class Verdict:
    """The outcome: `ok` only if nothing was lost or duplicated and no problem was found."""

    expected: int = 0  # episodes the product must commit
    committed: int = 0  # distinct episode ids in committed shards
    lost: int = 0
    duplicated: int = 0  # extra copies of episodes in committed shards
    mismatched: int = 0  # committed episodes that differ from the ground truth
    shards: int = 0
    claims: int = 0  # manifest claims beyond the first of each partition (ownership changes)
    rewards_applied: int = 0
    rewards_dead_lettered: int = 0
    rewards_both: int = 0  # applied after a consumer that dead-lettered it died (see the report)
    resent_dead_lettered: int = 0  # re-sends after a commit by an earlier owner (step-after-end, duplicate-start)
    #: offsets between the store's position and each partition's end, summed: what a restart reads
    #: again (dead letters and decisions after the last shard)
    replay_tail: int = 0
    dead_letters: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and not self.problems


def _same(got, want: np.ndarray) -> bool:
    got = np.asarray(got)
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def compare_episode(ep, entry: ShardEntry, t: TruthEpisode, late: set, v: Verdict) -> list[str]:
    """Differences between a committed RLlib episode and its ground truth (also counts rewards)."""
    out = []
    if not _same(ep.get_observations(), t.observations):
        out.append("observations differ")
    if not _same(ep.get_actions(), t.actions):
        out.append("actions differ")
    if bool(ep.is_terminated) != t.terminated or bool(ep.is_truncated) != t.truncated:
        out.append(f"flags {ep.is_terminated}/{ep.is_truncated} != {t.terminated}/{t.truncated}")
    extra_keys = set(ep.extra_model_outputs.keys()) if len(ep) else set()
    if extra_keys != set(t.extra):
        out.append(f"extra model outputs {sorted(extra_keys)} != {sorted(t.extra)}")
    for k, want in t.extra.items():
        if k in extra_keys and not _same(ep.get_extra_model_outputs(k), want):
            out.append(f"extra model output {k} differs")
    if list(ep.get_infos()) != t.infos:
        out.append("infos differ")
    cd = ep.custom_data
    if (cd.get("policy_id"), cd.get("policy_version"), cd.get("env_id")) != (t.policy_id, t.policy_version, t.env_id):
        out.append(f"policy fields {cd} != {t.policy_id}/{t.policy_version}/{t.env_id}")
    if entry.policy_id != t.policy_id or not entry.min_policy_version <= t.policy_version <= entry.max_policy_version:
        out.append("manifest entry's policy fields disagree")
    rewards = np.asarray(ep.get_rewards())
    if rewards.dtype != np.float64 or rewards.shape != t.rewards.shape:
        return [*out, f"rewards {rewards.dtype}{rewards.shape} != float64{t.rewards.shape}"]
    expect = t.rewards.copy()
    delayed = dict(t.delayed)
    for step, delta in t.delayed:
        applied = rewards[step] == t.rewards[step] + delta
        dead = (t.episode_id, step, delta) in late
        if applied:
            expect[step] = t.rewards[step] + delta
            v.rewards_applied += 1
            v.rewards_both += dead
        elif dead:
            v.rewards_dead_lettered += 1
        else:
            out.append(f"delayed reward {delta} for t={step} neither applied nor dead-lettered")
    if expect.tobytes() != rewards.tobytes():
        bad = [i for i in range(len(expect)) if expect[i] != rewards[i] and i not in delayed]
        out.append(f"rewards differ at steps {bad[:5]}")
    return out


def check(
    storage: Storage, truth: dict[str, TruthEpisode], scan: TopicScan, dlq: DeadLetters, offsets: dict[int, int]
) -> Verdict:
    v = Verdict(expected=sum(t.committed for t in truth.values()), dead_letters=dict(dlq.reasons))
    logs = read_partition_logs(storage)
    entries = [e for log in logs.values() for e in log if isinstance(e, ShardEntry)]
    v.shards = len(entries)
    v.claims = sum(sum(isinstance(e, ClaimEntry) for e in log) - 1 for log in logs.values())
    copies: dict[str, int] = defaultdict(int)
    for entry in sorted(entries, key=lambda e: (e.partition, e.seq)):
        for ep in read_episodes(read_committed_shard(storage, entry.path, entry.staging_path)):
            eid = ep.id_
            copies[eid] += 1
            if copies[eid] > 1:
                continue
            t = truth.get(eid)
            if t is None or not t.committed:
                v.problems.append(f"episode {eid} committed but {'not produced' if t is None else 'empty'}")
                continue
            diff = compare_episode(ep, entry, t, dlq.late_rewards, v)
            if diff:
                v.mismatched += 1
                v.problems.append(f"episode {eid} ({entry.path}): {'; '.join(diff)}")
    v.committed = len(copies)
    v.duplicated = sum(n - 1 for n in copies.values())
    lost = [eid for eid, t in truth.items() if t.committed and eid not in copies]
    lost += [eid for eid, t in truth.items() if not t.committed and eid not in dlq.empty]  # vanished
    v.lost = len(lost)
    v.problems += [f"lost episode {eid} ({truth[eid].kind}, {len(truth[eid].actions)} steps)" for eid in lost[:20]]
    v.problems += [f"unexpected dead letter: {x}" for x in dlq.other[:20]]
    for sb in dlq.after_end:  # must be re-sends of what the committed episode holds, nothing new
        t = truth.get(sb.episode_id)
        if isinstance(sb, EpisodeStart):
            if t is None or not t.committed or not _same(sb.observation[0], t.observations[0]):
                v.problems.append(f"duplicate-start dead letter that is not a re-send: {sb.episode_id}")
            else:
                v.resent_dead_lettered += 1
            continue
        if t is None or sb.t0 + sb.n > len(t.actions) or not _same(sb.actions[0], t.actions[sb.t0 : sb.t0 + sb.n]):
            v.problems.append(f"step-after-end dead letter that is not a re-send: {sb.episode_id} t0={sb.t0}")
        else:
            v.resent_dead_lettered += 1
    v.problems += _offset_problems(entries, scan, offsets)
    positions = store_positions(entries)
    v.replay_tail = sum(max(0, end - positions.get(p, 0)) for p, end in scan.end_offsets.items())
    return v


def store_positions(entries: list[ShardEntry]) -> dict[int, int]:
    """Where the store resumes each partition: the largest resume_offset of its shard entries."""
    out: dict[int, int] = {}
    for e in entries:
        if e.resume_offset is not None:
            out[e.partition] = max(out.get(e.partition, 0), e.resume_offset)
    return out


def _offset_problems(entries: list[ShardEntry], scan: TopicScan, offsets: dict[int, int]) -> list[str]:
    """Manifest entries vs. where their episodes' events are; the store's position (which decides
    where a partition resumes) and the group's committed offsets (for lag tools) vs. partition ends."""
    out = [f"episode {eid} has events on several partitions" for eid in sorted(scan.split)[:5]]
    if scan.undecodable:
        out.append(f"{scan.undecodable} undecodable messages on the transitions topic")
    for e in entries:
        starts = []
        for eid in e.episode_ids:
            if scan.partition_of.get(eid) != e.partition or eid not in scan.start_offset:
                out.append(f"{e.path}: episode {eid} is not on partition {e.partition}")
                continue
            starts.append(scan.start_offset[eid])
            if scan.end_offset.get(eid, 1 << 62) > e.last_offset:
                out.append(f"{e.path}: episode {eid} ends after the entry's last_offset {e.last_offset}")
        if starts and min(starts) != e.first_offset:
            out.append(f"{e.path}: first_offset {e.first_offset} != first start {min(starts)}")
        if e.last_offset >= scan.end_offsets.get(e.partition, 0):
            out.append(f"{e.path}: last_offset {e.last_offset} beyond the partition's end")
    positions = store_positions(entries)
    for p, end in sorted(scan.end_offsets.items()):
        if positions.get(p, 0) > end:
            out.append(f"partition {p}: the store resumes at {positions[p]}, past the end of the partition {end}")
        if any(e.partition == p for e in entries) and p not in positions:
            out.append(f"partition {p}: shards but no resume position in the store")
        # the consumers commit their offsets again every interval: another output's consumer of
        # the same group moved them only for a while
        if offsets.get(p, 0) != end:
            out.append(f"partition {p}: the group's committed offset {offsets.get(p, 0)} != end of partition {end}")
    return out
