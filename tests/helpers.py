"""Shared test helpers: recording ground-truth episodes and waiting on the manifest."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from gymnasium import spaces as gs

OBS_SPACE = gs.Box(-np.inf, np.inf, (4,), np.float32)
ACT_SPACE = gs.Discrete(2)


@dataclass
class TruthEpisode:
    episode_id: str
    policy_id: str
    observations: list = field(default_factory=list)  # T+1
    actions: list = field(default_factory=list)
    rewards: list = field(default_factory=list)
    logp: list = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False


def record_episodes(
    recorder,
    n: int,
    *,
    seed: int = 0,
    min_len: int = 3,
    max_len: int = 40,
    abort_every: int = 0,
    delayed_every: int = 0,
    policy_id: str | None = None,
) -> dict[str, TruthEpisode]:
    """Log `n` synthetic episodes (random lengths) through `recorder`; returns the ground truth.

    abort_every=k aborts every k-th episode (truncated); delayed_every=k adds a delayed reward to
    step 0 of every k-th episode after it ended.
    """
    rng = np.random.default_rng(seed)
    truth: dict[str, TruthEpisode] = {}
    for i in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        obs = rng.standard_normal(4).astype(np.float32)
        eid = recorder.begin_episode(obs)
        ep = TruthEpisode(eid, policy_id or recorder.policy_id, [obs])
        aborted = abort_every and i % abort_every == abort_every - 1
        steps = length - 1 if aborted else length
        for t in range(steps):
            a = int(rng.integers(0, 2))
            r = float(rng.standard_normal())
            obs = rng.standard_normal(4).astype(np.float32)
            lp = np.float32(-rng.random())
            last = t == steps - 1 and not aborted
            term = last and (i % 2 == 0)
            trunc = last and not term
            recorder.log_step(eid, a, r, obs, terminated=term, truncated=trunc, extra_model_outputs={"action_logp": lp})
            ep.observations.append(obs)
            ep.actions.append(a)
            ep.rewards.append(r)
            ep.logp.append(lp)
            ep.terminated, ep.truncated = term, trunc
        if aborted:
            recorder.abort_episode(eid)
            ep.truncated = True
        elif delayed_every and i % delayed_every == 0:
            recorder.log_reward(eid, 0, 0.5)
            ep.rewards[0] += 0.5
        truth[eid] = ep
    return truth


def assert_episode_matches(ep, truth: TruthEpisode) -> None:
    """`ep` is an RLlib SingleAgentEpisode read back from a shard."""
    assert ep.id_ == truth.episode_id
    np.testing.assert_allclose(np.asarray(ep.get_observations()), np.stack(truth.observations), rtol=0, atol=0)
    np.testing.assert_array_equal(np.asarray(ep.get_actions()), np.asarray(truth.actions))
    np.testing.assert_allclose(np.asarray(ep.get_rewards()), np.asarray(truth.rewards), rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(ep.get_extra_model_outputs("action_logp")), np.asarray(truth.logp))
    assert bool(ep.is_terminated) == truth.terminated
    assert bool(ep.is_truncated) == truth.truncated


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = predicate()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def read_metrics(ck: str) -> list[dict]:
    """The trainer's metrics.jsonl lines under checkpoint dir `ck` ([] before the first)."""
    import json
    import os

    try:
        with open(os.path.join(ck, "metrics.jsonl")) as f:
            return [json.loads(x) for x in f if x.strip()]
    except FileNotFoundError:
        return []


def assert_each_shard_new_exactly_once(lines, keys):
    """Every key in `keys` is counted new (``new_shards``) in exactly one metrics line."""
    seen: dict[str, int] = {}
    for rec in lines:
        for k in rec["new_shards"]:
            assert k not in seen, f"shard {k} counted new in iterations {seen[k]} and {rec['iteration']}"
            seen[k] = rec["iteration"]
        assert rec["shards_new"] == len(rec["new_shards"])
    assert set(seen) == set(keys), (set(keys) - set(seen), set(seen) - set(keys))
    assert sum(r["shards_new"] for r in lines) == len(keys)


class KeepingProducer:
    """Stands in for confluent_kafka.Producer in a recorder: keeps every (key, value, headers)
    in produce order and delivers them when polled or flushed. As librdkafka's, `flush` returns
    once every message's delivery callback has run, also those another thread's `poll` (the
    recorder's poller) took and is running."""

    def __init__(self):
        import threading

        self.messages: list[tuple] = []
        self._pending: list = []
        self._running = 0  # callbacks taken by a poll and not yet run
        self._lock = threading.Lock()

    def produce(self, topic, value, key=None, headers=None, on_delivery=None):
        with self._lock:
            self.messages.append((key, value, headers))
            self._pending.append(on_delivery)

    def poll(self, timeout=0):
        with self._lock:
            pending, self._pending = self._pending, []
            self._running += len(pending)
        try:
            for cb in pending:
                cb(None, None)
        finally:
            with self._lock:
                self._running -= len(pending)
        if not pending and timeout:
            time.sleep(min(timeout, 0.01))
        return len(pending)

    def flush(self, timeout=-1):
        deadline = time.monotonic() + 10
        while self.poll(0) or (len(self) and time.monotonic() < deadline):
            time.sleep(0.001)
        return 0

    def purge(self):
        pass

    def __len__(self):
        return len(self._pending) + self._running


def keeping_recorder(observation_space, action_space, **kw):
    """An `EpisodeRecorder` whose messages a `KeepingProducer` keeps (no broker); returns both."""
    from rlrec.producer import EpisodeRecorder

    kw.setdefault("max_batch_delay_s", 3600)
    rec = EpisodeRecorder(
        "127.0.0.1:1",
        "t",
        observation_space=observation_space,
        action_space=action_space,
        kafka_config={"log_level": 0},
        **kw,
    )
    real, fake = rec._producer, KeepingProducer()
    rec._producer = fake
    real.purge()
    return rec, fake


class RecorderClock:
    """A stand-in for the recorder's monotonic clock that stands still until `run()`: while it
    stands, no buffered step ages (however slowly a busy machine runs the test), so only a
    batch's size or its episode's end sends it; after `run()` it is the real clock again.

    Example:
        >>> clock = RecorderClock()
        >>> clock() == clock() == clock.frozen_at
        True
        >>> clock.run()
        >>> clock() >= clock.frozen_at
        True
    """

    def __init__(self) -> None:
        self.frozen_at = time.monotonic()
        self._running = False

    def __call__(self) -> float:
        return time.monotonic() if self._running else self.frozen_at

    def run(self) -> None:
        """From now on the real clock: steps buffered meanwhile age from `frozen_at`."""
        self._running = True


def frozen_recorder_clock(monkeypatch) -> RecorderClock:
    """Put a standing `RecorderClock` in place of `rlrec.producer.recorder`'s clock (batch ages,
    the poller's schedule, close and flush deadlines) for the rest of the test; returns it."""
    from rlrec.producer import recorder

    clock = RecorderClock()
    monkeypatch.setattr(recorder, "_monotonic", clock)
    return clock


def assemble(messages) -> tuple[dict, list]:
    """Run kept messages through the consumer's assembly (one partition, in order): the finished
    episodes by id (`FinishedEpisode`, in finish order) and the dead letters."""
    from rlrec.consumer.assembly import PartitionAssembler
    from rlrec.producer.events import decode

    a = PartitionAssembler("t", 0)
    letters: list = []
    for offset, (_key, value, headers) in enumerate(messages):
        letters += a.apply(offset, decode(value, headers))
    return dict(a.finished), letters


def episode_fields(fe) -> dict:
    """What a finished episode holds, without where and when it was recorded (ids, offsets,
    clocks): two recordings of one trajectory compare equal on it."""
    from rlrec.producer.events import dumps_info

    return {
        "policy_id": fe.policy_id,
        "policy_version": fe.policy_version,
        "env_id": fe.env_id,
        "observation_space": fe.observation_space,
        "action_space": fe.action_space,
        "observations": [(o.dtype.str, o.shape, o.tobytes()) for o in fe.observations],
        "actions": [(a.dtype.str, a.shape, a.tobytes()) for a in fe.actions],
        "rewards": fe.rewards.tobytes(),
        "infos": [dumps_info(i) for i in fe.infos],
        "extra_model_outputs": {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in fe.extra_model_outputs.items()},
        "terminated": fe.terminated,
        "truncated": fe.truncated,
    }
