"""Multi-agent producer benchmark: CPU per env step of `log_multi_agent_step` on simple_spread.

    python bench/multi_agent_producer.py [--rounds R] [--episodes E] [--bootstrap-servers B] [--json PATH]

The trace: PettingZoo simple_spread (mpe2, 3 agents, 18 float32 observations each, Discrete(5)
actions, 25 cycles) stepped with random actions before any clock; every env step's dicts are
kept. Two sides record the same trace, each in a fresh recorder (connected and warmed up
outside the clock) against the same broker with the recorder's producer settings:

  * ``multi_agent``:  one `begin_multi_agent_episode` per episode and one `log_multi_agent_step`
    per env step (with an ``action_logp`` per agent);
  * ``three_single``: the same values as three single-agent episodes, one per agent: three
    `begin_episode`s per episode and three `log_step`s per env step - the cheapest way to send
    the same observations, actions, rewards and propensities with the single-agent calls.

Figures: CPU µs per env step (``time.process_time()``: every thread, from the first call until
``flush()`` returns), and for ``multi_agent`` the latency of one `log_multi_agent_step` call
p50/p99 (µs). Rounds alternate which side goes first; one discarded warm-up round; medians and
spread (min..max) over the measured rounds; the raw rounds go to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid

import numpy as np


def trace(episodes: int, seed: int = 0) -> tuple[list, dict, dict]:
    """[(reset observations, [(actions, obs, rewards, terms, truncs, infos), ...]), ...] and the spaces."""
    from mpe2 import simple_spread_v3

    env = simple_spread_v3.parallel_env(N=3, max_cycles=25)
    rng = np.random.default_rng(seed)
    out = []
    for e in range(episodes):
        obs, _ = env.reset(seed=seed + e)
        reset = {a: o.copy() for a, o in obs.items()}
        steps = []
        while env.agents:
            actions = {a: int(rng.integers(5)) for a in env.agents}
            o, r, te, tr, i = env.step(actions)
            steps.append((actions, {a: x.copy() for a, x in o.items()}, r, te, tr, i))
        out.append((reset, steps))
    agents = env.possible_agents
    return out, {a: env.observation_space(a) for a in agents}, {a: env.action_space(a) for a in agents}


def _recorder(bootstrap: str, topic: str, **kw):
    from rlrec import EpisodeRecorder

    rec = EpisodeRecorder(bootstrap, topic, **kw)
    rec._producer.produce(topic, b"warm-up")  # connect outside the clock
    rec._producer.flush(10)
    return rec


def run_multi_agent(bootstrap: str, topic: str, episodes: list, obs_spaces: dict, act_spaces: dict) -> dict:
    rec = _recorder(bootstrap, topic)
    logp = {a: {"action_logp": -1.6094} for a in obs_spaces}
    lat = []
    n = 0
    perf = time.perf_counter
    cpu0 = time.process_time()
    for reset, steps in episodes:
        eid = rec.begin_multi_agent_episode(reset, observation_spaces=obs_spaces, action_spaces=act_spaces)
        for actions, obs, rew, te, tr, info in steps:
            t = perf()
            rec.log_multi_agent_step(eid, obs, actions, rew, te, tr, info, logp)
            lat.append(perf() - t)
        n += len(steps)
    rec.flush()
    cpu = time.process_time() - cpu0
    rec.close()
    lat.sort()
    return {
        "cpu_us_per_env_step": 1e6 * cpu / n,
        "call_p50_us": 1e6 * lat[len(lat) // 2],
        "call_p99_us": 1e6 * lat[int(len(lat) * 0.99)],
        "env_steps": n,
        "messages": rec.stats.messages_produced,
    }


def run_three_single(bootstrap: str, topic: str, episodes: list, obs_spaces: dict, act_spaces: dict) -> dict:
    agents = list(obs_spaces)
    a0 = agents[0]
    rec = _recorder(bootstrap, topic, observation_space=obs_spaces[a0], action_space=act_spaces[a0])
    logp = {"action_logp": -1.6094}
    n = 0
    cpu0 = time.process_time()
    for reset, steps in episodes:
        ids = {a: rec.begin_episode(reset[a]) for a in agents}
        for actions, obs, rew, te, tr, info in steps:
            for a in agents:
                rec.log_step(ids[a], actions[a], rew[a], obs[a], te[a], tr[a], info[a] or None, logp)
        n += len(steps)
    rec.flush()
    cpu = time.process_time() - cpu0
    rec.close()
    return {"cpu_us_per_env_step": 1e6 * cpu / n, "env_steps": n, "messages": rec.stats.messages_produced}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--bootstrap-servers", default=None, help="default: a local Tansu broker started here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    episodes, obs_spaces, act_spaces = trace(args.episodes)
    broker = None
    bootstrap = args.bootstrap_servers
    if bootstrap is None:
        from rlrec.local import LocalBroker

        broker = LocalBroker()
        broker.__enter__()
        bootstrap = broker.bootstrap_servers
    sides = {"multi_agent": run_multi_agent, "three_single": run_three_single}
    rounds: list[dict] = []
    try:
        for r in range(args.rounds + 1):  # round 0: warm-up, discarded
            order = list(sides) if r % 2 else list(reversed(sides))
            got = {
                s: sides[s](bootstrap, f"bench-ma-{uuid.uuid4().hex[:8]}", episodes, obs_spaces, act_spaces)
                for s in order
            }
            if r:
                rounds.append(got)
    finally:
        if broker is not None:
            broker.__exit__(None, None, None)
    print(f"simple_spread (3 agents, 25 cycles), {args.episodes} episodes, {args.rounds} rounds: median (min..max)")
    for side in sides:
        for key in rounds[0][side]:
            if key in ("env_steps", "messages"):
                continue
            vals = [r[side][key] for r in rounds]
            print(f"  {side:13s} {key:22s} {statistics.median(vals):8.2f}  ({min(vals):.2f}..{max(vals):.2f})")
    ratio = [r["multi_agent"]["cpu_us_per_env_step"] / r["three_single"]["cpu_us_per_env_step"] for r in rounds]
    print(f"  multi_agent / three_single CPU: {statistics.median(ratio):.2f}  ({min(ratio):.2f}..{max(ratio):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"episodes": args.episodes, "rounds": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
