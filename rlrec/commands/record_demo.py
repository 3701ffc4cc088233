"""``rlrec record-demo``: record CartPole episodes through Kafka and read them back.

A scripted controller plays ``CartPole-v1`` behind a :class:`producer.RecordingWrapper`; every
step goes to Kafka as rlrec events (with ``action_logp`` as an extra model output). The topic is
then read back with a consumer group, every message is decoded with ``rlrec.producer.events.decode``
and the counts are compared with what was recorded. Exit code 0 when they match, 1 otherwise.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rlrec.options import OptionSet, option

DEFAULT_TOPIC = "rlrec.demo"


@dataclass
class RecordDemoOptions:
    """Options of `rlrec record-demo`."""

    episodes: int = option(20, help="episodes to record")
    topic: str = option(DEFAULT_TOPIC, help="topic (created if missing)")
    bootstrap_servers: str | None = option(None, help="host:port of a broker (default: an embedded local broker)")
    seed: int = option(0, help="seed of the env resets and of the exploration")
    epsilon: float = option(0.05, help="probability of a uniformly random action")
    timeout: float = option(30.0, help="seconds to wait for delivery and read-back")
    progress: bool = option(True, help="show a progress bar on a terminal (--no-progress: plain lines only)")


#: the options of `rlrec record-demo`
OPTIONS = OptionSet("record-demo", RecordDemoOptions)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "record-demo",
        help="record scripted CartPole episodes through Kafka, read them back and check them",
        description="Record N CartPole-v1 episodes played by a scripted controller through "
        "EpisodeRecorder/RecordingWrapper (action_logp as an extra model output), flush, then "
        "read the topic back with a consumer group, decode every message and print the counts "
        "(episodes started, step batches, steps, aborts, mean episode return). Without "
        "--bootstrap-servers an embedded local broker (Tansu, memory://) is started and stopped. "
        "Exit code 0 when what was read back matches what was recorded, 1 otherwise.",
    )
    OPTIONS.add_arguments(p)
    p.set_defaults(func=run, options=OPTIONS)


class _Progress:
    """A rich progress bar on a terminal, plain lines otherwise."""

    def __init__(self, enabled: bool):
        self._bar = None
        if enabled:
            try:
                from rich.progress import Progress

                self._bar = Progress(transient=True)
            except ImportError:
                self._bar = None
        self._tasks: dict[str, int] = {}

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def task(self, name: str, total: int) -> None:
        if self._bar is not None:
            self._tasks[name] = self._bar.add_task(name, total=total)

    def advance(self, name: str, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._tasks[name], n)


def scripted_action(obs, rng, epsilon: float) -> tuple[int, float]:
    """The scripted CartPole expert with epsilon-noise: (action, log-probability of it).

    Pushes the cart towards where the pole falls (``obs[2] + 0.5 * obs[3] > 0``); with
    probability *epsilon* a uniformly random action instead. Also used by ``rlrec demo``.
    """
    import math

    greedy = int(obs[2] + 0.5 * obs[3] > 0)
    action = int(rng.integers(2)) if rng.random() < epsilon else greedy
    p = 1 - epsilon / 2 if action == greedy else epsilon / 2
    return action, (math.log(p) if p > 0 else -math.inf)


def _record(opts: RecordDemoOptions, bootstrap: str, progress: _Progress) -> dict:
    """Play and record the episodes; returns what was recorded."""
    import gymnasium as gym
    import numpy as np

    from rlrec.producer import EpisodeRecorder, RecordingWrapper

    env = gym.make("CartPole-v1")
    recorder = EpisodeRecorder(
        bootstrap,
        opts.topic,
        policy_id="scripted-cartpole",
        policy_version=1,
        observation_space=env.observation_space,
        action_space=env.action_space,
        env_id="CartPole-v1",
    )
    wrapped = RecordingWrapper(env, recorder)
    rng = np.random.default_rng(opts.seed)
    eps = min(max(opts.epsilon, 0.0), 1.0)
    recorded: dict = {"episodes": {}, "steps": 0}
    progress.task("recording", opts.episodes)
    try:
        for k in range(opts.episodes):
            obs, _ = wrapped.reset(seed=opts.seed + k)
            eid = wrapped.episode_id
            ret, n, done = 0.0, 0, False
            while not done:
                action, logp = scripted_action(obs, rng, eps)
                wrapped.set_model_outputs({"action_logp": np.float32(logp)})
                obs, reward, terminated, truncated, _ = wrapped.step(action)
                ret += float(reward)
                n += 1
                done = terminated or truncated
            recorded["episodes"][eid] = {"steps": n, "return": ret, "terminated": bool(terminated)}
            recorded["steps"] += n
            progress.advance("recording")
        wrapped.close()
        left = recorder.flush(opts.timeout)
    finally:
        left_close = recorder.close(timeout=opts.timeout)
    st = recorder.stats
    recorded.update(undelivered=left + left_close, stats=st)
    return recorded


def _read_back(opts: RecordDemoOptions, bootstrap: str, recorded: dict, progress: _Progress) -> dict:
    """Read the topic with a consumer group until every delivered message of ours is back."""
    import time
    import uuid

    from confluent_kafka import Consumer

    from rlrec.local import consumer_test_config
    from rlrec.producer.events import DecodeError, EpisodeAbort, EpisodeStart, RewardDelta, StepBatch, decode

    ours = {eid.encode() for eid in recorded["episodes"]}
    expected = recorded["stats"].messages_delivered
    got = {
        "messages": 0,
        "foreign": 0,
        "undecodable": 0,
        "episodes_started": 0,
        "step_batches": 0,
        "steps": 0,
        "aborts": 0,
        "reward_deltas": 0,
        "returns": {},
        "lengths": {},
        "ended": set(),
        "gaps": 0,
    }
    consumer = Consumer(
        consumer_test_config(bootstrap, f"rlrec-record-demo-{uuid.uuid4().hex[:12]}", {"fetch.wait.max.ms": 100})
    )
    progress.task("reading back", expected)
    try:
        consumer.subscribe([opts.topic])
        deadline = time.monotonic() + opts.timeout
        while got["messages"] < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            if msg.error():
                print(f"consumer error: {msg.error()}")
                continue
            if msg.key() not in ours:  # an earlier run's data on a shared topic
                got["foreign"] += 1
                continue
            got["messages"] += 1
            progress.advance("reading back")
            try:
                ev = decode(msg.value(), msg.headers())
            except DecodeError as e:
                got["undecodable"] += 1
                print(f"undecodable message at {msg.partition()}/{msg.offset()}: {e}")
                continue
            eid = ev.episode_id
            if isinstance(ev, EpisodeStart):
                got["episodes_started"] += 1
                got["returns"].setdefault(eid, 0.0)
                got["lengths"].setdefault(eid, 0)
            elif isinstance(ev, StepBatch):
                got["step_batches"] += 1
                got["steps"] += ev.n
                if ev.t0 != got["lengths"].get(eid, 0):
                    got["gaps"] += 1
                got["lengths"][eid] = got["lengths"].get(eid, 0) + ev.n
                got["returns"][eid] = got["returns"].get(eid, 0.0) + float(ev.rewards.sum())
                if ev.terminated or ev.truncated:
                    got["ended"].add(eid)
            elif isinstance(ev, RewardDelta):
                got["reward_deltas"] += 1
                got["returns"][eid] = got["returns"].get(eid, 0.0) + ev.reward
            elif isinstance(ev, EpisodeAbort):
                got["aborts"] += 1
    finally:
        consumer.close()
    return got


def run(args: argparse.Namespace) -> int:
    import sys

    opts = OPTIONS.build(RecordDemoOptions, OPTIONS.resolve(args))  # OptionError: one line, exit 2

    if opts.episodes < 1:
        print("rlrec record-demo: --episodes must be >= 1", file=sys.stderr)
        return 2

    broker = None
    bootstrap = opts.bootstrap_servers
    try:
        from rlrec.consumer.topics import create_topics
        from rlrec.local import BrokerStartError, LocalBroker

        if not bootstrap:
            broker = LocalBroker("memory")
            try:
                broker.start()
            except BrokerStartError as e:
                print(f"rlrec record-demo: {e}", file=sys.stderr)
                return 1
            bootstrap = broker.bootstrap_servers
            print(f"embedded broker: {bootstrap} (memory://)")
        create_topics(bootstrap, {opts.topic: 4}, timeout=opts.timeout)
        print(f"topic: {opts.topic}")

        show_bar = opts.progress and sys.stderr.isatty()
        with _Progress(show_bar) as progress:
            recorded = _record(opts, bootstrap, progress)
            st = recorded["stats"]
            n_rec = len(recorded["episodes"])
            mean_rec = sum(e["return"] for e in recorded["episodes"].values()) / n_rec
            print(
                f"recorded: episodes={n_rec} steps={recorded['steps']} mean_return={mean_rec:.2f} "
                f"messages={st.messages_produced} delivered={st.messages_delivered} failed={st.messages_failed}"
            )
            got = _read_back(opts, bootstrap, recorded, progress)

        returns = got["returns"]
        mean_got = sum(returns.values()) / len(returns) if returns else float("nan")
        print(
            f"read back: episodes_started={got['episodes_started']} step_batches={got['step_batches']} "
            f"steps={got['steps']} aborts={got['aborts']} reward_deltas={got['reward_deltas']} "
            f"mean_return={mean_got:.2f} undecodable={got['undecodable']}"
            + (f" other_messages={got['foreign']}" if got["foreign"] else "")
        )

        # the recorder sent one EpisodeStart per episode, step batches, no aborts, no reward deltas
        problems = []
        expect_batches = st.messages_delivered - n_rec
        checks = [
            ("undelivered messages", recorded["undelivered"] + st.messages_failed, 0),
            ("messages read back", got["messages"], st.messages_delivered),
            ("episodes started", got["episodes_started"], n_rec),
            ("step batches", got["step_batches"], expect_batches),
            ("steps", got["steps"], recorded["steps"]),
            ("aborts", got["aborts"], 0),
            ("undecodable", got["undecodable"], 0),
            ("episodes ended", len(got["ended"]), n_rec),
            ("batches out of order", got["gaps"], 0),
        ]
        for what, have, want in checks:
            if have != want:
                problems.append(f"{what}: {have}, expected {want}")
        for eid, e in recorded["episodes"].items():
            if got["lengths"].get(eid) != e["steps"] or eid not in returns or abs(returns[eid] - e["return"]) > 1e-9:
                problems.append(
                    f"episode {eid}: {got['lengths'].get(eid)} steps, return {returns.get(eid)}; "
                    f"recorded {e['steps']} steps, return {e['return']}"
                )
        if problems:
            for p in problems:
                print(f"MISMATCH {p}")
            return 1
        print(f"OK: {n_rec} episodes, {recorded['steps']} steps read back as recorded")
        return 0
    finally:
        if broker is not None:
            import gc

            gc.collect()  # drop the demo's Kafka clients first: Tansu drains open connections on SIGTERM
            broker.stop()
