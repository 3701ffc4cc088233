"""The multi-agent loop on PettingZoo's simple_spread (2 agents), end to end with rlrec.

``record``: runs simple_spread episodes through `MultiAgentRecordingWrapper` into Kafka: agent_0
follows a script (module ``scripted``), agent_1 acts at random (module ``random``); `rlrec
consume` then writes each module's rows to its own folder (``spread.scripted/``,
``spread.random/``). ``act``: loads the version `rlrec train --multi-agent` published, per module
and whole (torch only, no Ray), and plays fresh episodes with it, acting on per-agent
observations; it prints how often the scripted module does what the script does.

docs/TRAINER.md ("Multi-agent training") shows the commands around it; tests/test_multi_agent_example.py
runs exactly those. Needs ``pip install 'rlrec[multiagent]'`` (PettingZoo, mpe2).

    python examples/multi_agent_spread.py record --bootstrap-servers 127.0.0.1:9092 --topic spread
    python examples/multi_agent_spread.py act --policies run/policies --public-key keys/policy-signing.pub
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

#: agent -> module: each module's rows are recorded under the folder spread.{module}
MODULES = {"agent_0": "scripted", "agent_1": "random"}
POLICY = "spread"


def script(obs: np.ndarray) -> int:
    """agent_0's scripted action: along the larger axis toward landmark 0 (obs[4:6] is the
    landmark's position relative to the agent): 1/2 left/right, 3/4 down/up."""
    dx, dy = float(obs[4]), float(obs[5])
    if abs(dx) >= abs(dy):
        return 2 if dx > 0 else 1
    return 4 if dy > 0 else 3


def make_env():
    """simple_spread with 2 agents and discrete actions (PettingZoo Parallel API)."""
    from mpe2 import simple_spread_v3

    return simple_spread_v3.parallel_env(N=2, max_cycles=25, continuous_actions=False)


def record(bootstrap_servers: str, topic: str, episodes: int, flush_timeout_s: float = 30.0) -> None:
    """Record `episodes` episodes of simple_spread into `topic` through the wrapper; exits
    (code 1, one line) if a message is still undelivered `flush_timeout_s` after the last step."""
    from rlrec import EpisodeRecorder
    from rlrec.producer import MultiAgentRecordingWrapper

    recorder = EpisodeRecorder(bootstrap_servers, topic, policy_id=POLICY, env_id="simple_spread_v3")
    env = MultiAgentRecordingWrapper(make_env(), recorder, agent_modules=MODULES)
    rng = np.random.default_rng(0)
    for seed in range(episodes):
        obs, _ = env.reset(seed=seed)
        while env.agents:
            actions = {a: script(o) if a == "agent_0" else int(rng.integers(5)) for a, o in obs.items()}
            obs, _, _, _, _ = env.step(actions)
    env.close()
    undelivered = recorder.flush(flush_timeout_s)
    recorder.close(flush_timeout_s)
    line = f"recorded {episodes} episodes, {recorder.stats.messages_produced} messages, {undelivered} undelivered"
    if undelivered:
        raise SystemExit(f"multi_agent_spread.py record: error: {line} (is the broker at {bootstrap_servers} up?)")
    print(line)


def act(policies: str, public_key: str, episodes: int) -> None:
    """Play `episodes` fresh episodes with the published version (the whole policy acts for
    every agent) and print how often agent_0's action is the script's, and agent_1's module's
    mean top action probability (uniform: 0.2)."""
    from rlrec.trainer.policy import load_policy

    whole = load_policy(policies, public_key=public_key)
    scripted = load_policy(policies, public_key=public_key, module_id="scripted")
    rand = load_policy(policies, public_key=public_key, module_id="random")
    env = make_env()
    agree, obs1 = [], []
    for seed in range(10_000, 10_000 + episodes):
        obs, _ = env.reset(seed=seed)
        while env.agents:
            actions, _ = whole.act(obs)  # {agent_id: observation} -> {agent_id: action}
            agree.append(int(actions["agent_0"]) == script(obs["agent_0"]))
            if int(scripted.act(obs["agent_0"])[0]) != int(actions["agent_0"]):  # one module, served alone
                raise SystemExit("the scripted module alone acts unlike the whole version")
            obs1.append(obs["agent_1"])
            obs, _, _, _, _ = env.step({a: int(x) for a, x in actions.items()})
    top = float(rand.action_probs(np.array(obs1)).max(axis=1).mean())
    print(f"policy_version={whole.policy_version} signed={whole.signed} ray_imported={'ray' in sys.modules}")
    print(f"scripted_agreement={np.mean(agree):.3f} random_top_probability={top:.3f} steps={len(agree)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record simple_spread episodes into Kafka")
    r.add_argument("--bootstrap-servers", required=True)
    r.add_argument("--topic", default="spread")
    r.add_argument("--episodes", type=int, default=80)
    r.add_argument("--flush-timeout-s", type=float, default=30.0, help="wait this long for delivery, then fail")
    a = sub.add_parser("act", help="play episodes with the published version")
    a.add_argument("--policies", required=True)
    a.add_argument("--public-key", required=True)
    a.add_argument("--episodes", type=int, default=20)
    args = p.parse_args(argv)
    if args.cmd == "record":
        record(args.bootstrap_servers, args.topic, args.episodes, args.flush_timeout_s)
    else:
        act(args.policies, args.public_key, args.episodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
