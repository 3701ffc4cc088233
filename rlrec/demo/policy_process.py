"""One simulated deployed policy of `rlrec demo` (run as ``python -m rlrec.demo.policy_process``).

Plays CartPole-v1, publishing every step through `EpisodeRecorder`. It starts as the scripted
expert with epsilon-noise (policy version 0) and, between episodes, polls the trainer's published
policies (`rlrec.load_policy`: torch only, never Ray); it switches to every newer version
published for its channel (``--channel``) and CartPole's spaces, and the episodes it records from
then on carry that `policy_version`. With ``--canary-fraction f`` it opts in to the trainer's
canary (``rlrec train --rollout canary``): each episode's version is `Policy.for_episode`'s (the
canary for a salted-hash share f of the episode ids), and the episode logs its assignment in
its reset info, as a service does (docs/DEPLOY.md, "Canary rollout").
Steps are throttled to `--steps-per-s`. Every second a JSON status line goes to stdout. SIGTERM
or SIGINT: the current episode is played to its end, the recorder is flushed and closed, exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections import deque

POLICY_ID = "cartpole"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlrec.demo.policy_process", description=__doc__)
    p.add_argument("--bootstrap-servers", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--policies", required=True, help="the trainer's publish root ({checkpoint_dir}/policies)")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--epsilon", type=float, default=0.3, help="random-action probability of the scripted expert")
    p.add_argument(
        "--policy-epsilon",
        type=float,
        default=0.05,
        help="random-action probability once acting with a published policy",
    )
    p.add_argument("--steps-per-s", type=float, default=800.0, help="throttle (0: unthrottled)")
    p.add_argument("--poll-s", type=float, default=2.0, help="how often to look for a newer published policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--public-key",
        default=os.environ.get("RLREC_POLICY_PUBLIC_KEY"),
        help="the trainer's policy-signing public key (PEM) [$RLREC_POLICY_PUBLIC_KEY]; published "
        "versions must carry its signature",
    )
    p.add_argument(
        "--canary-fraction",
        type=float,
        default=0.0,
        help="the share of episodes that run the trainer's canary while one runs (0: none, at most 0.5)",
    )
    p.add_argument(
        "--channel",
        default=POLICY_ID,
        help="load only versions signed for this channel (the trainer's --channel)",
    )
    return p.parse_args(argv)


class _Throttle:
    """Sleeps so that `tick()` is called at most `rate` times per second on average."""

    def __init__(self, rate: float) -> None:
        self.period = 1.0 / rate if rate > 0 else 0.0
        self.t = time.monotonic()

    def tick(self) -> None:
        if not self.period:
            return
        self.t += self.period
        delay = self.t - time.monotonic()
        if delay > 0.002:
            time.sleep(delay)
        elif delay < -1.0:  # fell behind (busy machine): do not try to catch up
            self.t = time.monotonic()


def run(args: argparse.Namespace) -> int:
    import gymnasium as gym
    import numpy as np

    from rlrec.commands.record_demo import scripted_action
    from rlrec.producer import EpisodeRecorder
    from rlrec.trainer.policy import load_policy  # = rlrec.load_policy (torch only); imported now, not mid-episode

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    env = gym.make("CartPole-v1")
    recorder = EpisodeRecorder(
        args.bootstrap_servers,
        args.topic,
        policy_id=POLICY_ID,
        policy_version=0,
        observation_space=env.observation_space,
        action_space=env.action_space,
        env_id="CartPole-v1",
    )
    rng = np.random.default_rng(args.seed)
    throttle = _Throttle(args.steps_per_s)
    policy = None
    last_poll = 0.0
    steps = episodes = canary_episodes = 0
    returns: deque = deque(maxlen=20)
    last_status = 0.0
    poll_errors = 0

    def status(final: bool = False) -> None:
        print(
            json.dumps(
                {
                    "index": args.index,
                    "steps": steps,
                    "episodes": episodes,
                    "policy_version": policy.policy_version if policy is not None else 0,
                    "canary_version": policy.canary_version if policy is not None else None,
                    "canary_episodes": canary_episodes,
                    "return_mean": float(np.mean(returns)) if returns else None,
                    "delivered": recorder.stats.messages_delivered,
                    "final": final,
                }
            ),
            flush=True,
        )

    def maybe_switch() -> None:
        nonlocal policy, last_poll, poll_errors
        if time.monotonic() - last_poll < args.poll_s:
            return
        last_poll = time.monotonic()
        try:
            if policy is None:
                policy = load_policy(
                    args.policies,
                    seed=args.seed,
                    public_key=args.public_key,
                    channel=args.channel,
                    observation_space=env.observation_space,
                    action_space=env.action_space,
                    canary_fraction=args.canary_fraction,
                )
                switched = True
            else:
                switched = policy.poll()
        except Exception as e:  # nothing published yet, or a version being written
            if "no policy is published" not in str(e) and poll_errors < 5:
                print(f"policy-{args.index}: poll failed: {e}", file=sys.stderr, flush=True)
                poll_errors += 1
            return
        if switched:
            canary = f" (canary v{policy.canary_version})" if policy.canary_version else ""
            print(
                f"policy-{args.index}: now acting with policy v{policy.policy_version}{canary}",
                file=sys.stderr,
                flush=True,
            )

    try:
        k = 0
        while not stop.is_set():
            maybe_switch()
            obs, info = env.reset(seed=args.seed * 100_003 + k)
            k += 1
            eid = uuid.uuid4().hex
            chosen = policy.for_episode(eid) if policy is not None else None  # the whole episode's version
            actor = chosen.actor if chosen is not None else None
            canary_episodes += bool(chosen is not None and chosen.canary)
            recorder.begin_episode(
                obs,
                {**info, **(chosen.info if chosen is not None else {})},  # the canary assignment, if any
                episode_id=eid,
                policy_version=chosen.policy_version if chosen is not None else 0,
            )
            total, done = 0.0, False
            while not done:  # a started episode is always finished, even when stopping
                if actor is None:
                    action, logp = scripted_action(obs, rng, args.epsilon)
                else:
                    eps = args.policy_epsilon  # epsilon-greedy around the policy's greedy action
                    greedy, _ = actor.act(obs)
                    action = int(rng.integers(2)) if rng.random() < eps else int(greedy)
                    logp = float(np.log(max(1 - eps / 2 if action == greedy else eps / 2, 1e-12)))
                obs, reward, terminated, truncated, info = env.step(action)
                recorder.log_step(
                    eid,
                    action,
                    reward,
                    obs,
                    terminated=terminated,
                    truncated=truncated,
                    info=info,
                    extra_model_outputs={"action_logp": np.float32(logp)},
                )
                total += float(reward)
                steps += 1
                done = terminated or truncated
                if not stop.is_set():
                    throttle.tick()
                if time.monotonic() - last_status >= 1.0:
                    last_status = time.monotonic()
                    status()
            episodes += 1
            returns.append(total)
    finally:
        env.close()
        left = recorder.close(timeout=30)
        status(final=True)
        if left:
            print(f"policy-{args.index}: {left} records undelivered at exit", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run(parse()))
