"""Producer benchmark: process CPU per logged step, EpisodeRecorder vs bare `Producer.produce()`.

    python bench/producer.py [--steps N] [--episode-len L] [--bootstrap-servers B] [--json PATH] [--quick]

Both sides run in this process against the same broker (an embedded Tansu broker unless
`--bootstrap-servers` is given). CPU is `time.process_time()` (all threads, so librdkafka's
background work counts) from the first call until `flush()` returns.

  * baseline: one pre-encoded ~100-byte message per step, bare `produce()` (no callback, no
    poll), then `flush()` - the floor of "one Kafka message per transition";
  * ours: `EpisodeRecorder.begin_episode` + `log_step` (CartPole-size observation, a Discrete
    action, one extra model output), including the background encoding, until `flush()`.

Target: ratio (ours / bare, CPU per step) <= 2.0 and >= 50k steps/s of CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

TARGET_RATIO = 2.0
TARGET_STEPS_PER_S = 50_000


def _bare(bootstrap: str, topic: str, steps: int) -> float:
    from confluent_kafka import Producer

    p = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": "lz4",
            "linger.ms": 20,
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    value = os.urandom(100)
    key = uuid.uuid4().hex.encode()
    p.produce(topic, value, key)  # connect before timing
    p.flush(10)
    produce = p.produce
    t = time.process_time()
    for _ in range(steps):
        produce(topic, value, key)
    left = p.flush(60)
    cpu = time.process_time() - t
    assert left == 0, f"bare producer left {left} messages undelivered"
    return cpu


def _ours(bootstrap: str, topic: str, steps: int, episode_len: int) -> tuple[float, object]:
    import gymnasium as gym

    from rlrec.producer import EpisodeRecorder

    obs_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    act_space = gym.spaces.Discrete(2)
    rng = np.random.default_rng(0)
    observations = rng.standard_normal((episode_len + 1, 4)).astype(np.float32)
    rec = EpisodeRecorder(
        bootstrap,
        topic=topic,
        policy_id="bench",
        observation_space=obs_space,
        action_space=act_space,
        env_id="CartPole-v1",
    )
    warm = rec.begin_episode(observations[0])
    rec.log_step(warm, 0, 1.0, observations[1], terminated=True)
    rec.flush(10)
    logp = np.float32(-0.69)
    t = time.process_time()
    done = 0
    while done < steps:
        eid = rec.begin_episode(observations[0])
        n = min(episode_len, steps - done)
        for i in range(n):
            rec.log_step(
                eid, i & 1, 1.0, observations[i + 1], terminated=(i == n - 1), extra_model_outputs={"action_logp": logp}
            )
        done += n
    left = rec.flush(60)
    cpu = time.process_time() - t
    stats = rec.stats
    rec.close()
    assert left == 0 and stats.failed == 0, f"recorder left {left} undelivered, stats {stats}"
    return cpu, stats


def run(steps: int, episode_len: int, bootstrap: str | None, rounds: int = 3) -> dict:
    broker = None
    if bootstrap is None:
        from rlrec.local import LocalBroker

        broker = LocalBroker().start()
        bootstrap = broker.bootstrap_servers
    try:
        topic = f"bench-producer-{uuid.uuid4().hex[:8]}"
        # alternate the two sides and keep each one's best round: this machine is noisy
        bare_runs, our_runs = [], []
        for _ in range(rounds):
            bare_runs.append(_bare(bootstrap, topic + "-bare", steps))
            cpu, stats = _ours(bootstrap, topic, steps, episode_len)
            our_runs.append(cpu)
        bare_cpu, ours_cpu = min(bare_runs), min(our_runs)
    finally:
        if broker is not None:
            broker.stop()
    ratio = ours_cpu / bare_cpu
    return {
        "steps": steps,
        "episode_len": episode_len,
        "steps_per_s": steps / ours_cpu,
        "bare_produce_per_s": steps / bare_cpu,
        "ours_cpu_us_per_step": ours_cpu / steps * 1e6,
        "bare_cpu_us_per_step": bare_cpu / steps * 1e6,
        "ratio": ratio,
        "messages": stats.messages_produced,
        "rounds": rounds,
        "pass": ratio <= TARGET_RATIO and steps / ours_cpu >= TARGET_STEPS_PER_S,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300_000)
    ap.add_argument("--episode-len", type=int, default=200)
    ap.add_argument("--bootstrap-servers", default=None)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each side counts")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--quick", action="store_true", help="small run, smoke test only")
    args = ap.parse_args(argv)
    steps = 20_000 if args.quick else args.steps
    r = run(steps, args.episode_len, args.bootstrap_servers, rounds=1 if args.quick else args.rounds)
    print(f"{'figure':<34}{'ours':>14}{'bare':>14}{'ratio':>8}  target")
    print(
        f"{'CPU µs per step':<34}{r['ours_cpu_us_per_step']:>14.2f}{r['bare_cpu_us_per_step']:>14.2f}"
        f"{r['ratio']:>8.2f}  <= {TARGET_RATIO}"
    )
    print(
        f"{'steps/s of CPU':<34}{r['steps_per_s']:>14,.0f}{r['bare_produce_per_s']:>14,.0f}"
        f"{'':>8}  >= {TARGET_STEPS_PER_S:,}"
    )
    print(
        f"messages sent: {r['messages']:,} for {r['steps']:,} steps; "
        f"{'PASS' if r['pass'] else 'FAIL'}{' (quick: not judged)' if args.quick else ''}"
    )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
