"""Canary exposure benchmark: how many episodes a worse canary serves before its rollback, and a
better one needs before its promotion (``rlrec train --rollout canary``'s test).

    python bench/canary.py [--quick] [--rounds N] [--share 0.2] [--effect 0.5] [--json PATH]

Simulated services serve episodes at the canary share (the salted hash of each episode id,
`rlrec.trainer.canary.in_canary`), one step each whose reward is drawn N(mean of its version, 1);
every 20 episodes they are committed as one shard (`rlrec.store.commit.ShardCommitter`, as the
consumer commits them), and the trainer's `rlrec.trainer.rollout.CanaryRun` looks at the
committed shards after each shard (`CanaryEvidence` reading them, `judge` deciding) with the
trainer's default rule (alpha 0.05, margin 0, 30 episodes per arm minimum, 2000 maximum
exposure) and the stated range [-5, 5] (10 sd); each look counts every episode committed so far. A worse canary's mean is ``-effect`` below the deployed one's, a better one's
``+effect`` above (in standard deviations of the returns). Reported per scenario: the decision
of each round and the canary episodes served up to it (median and spread). Nothing to compare
against: the rows are reported, not judged. Local disk, no Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SHARD_EPISODES = 20


def _episode(version: int, reward: float, started_ms: int, eid: str, share: float):
    import gymnasium as gym
    import numpy as np

    from rlrec.trainer.canary import assignment_info, in_canary
    from rlrec.trainer.synthetic import _episode as make

    ep = make(
        "Toy-v0",
        gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
        gym.spaces.Discrete(2),
        np.zeros((2, 2), np.float32),
        np.zeros(1, np.int64),
        [reward],
        True,
        False,
        policy_id="toy",
        policy_version=version,
        episode_id=eid,
    )
    info = assignment_info(2, share, in_canary(eid, share))  # what a service that opted in logs
    return dataclasses.replace(ep, started_ms=started_ms, ended_ms=started_ms + 1, infos=[info, *ep.infos[1:]])


def one_round(effect: float, share: float, seed: int, workdir: str) -> dict:
    """Serve until the canary is decided; its decision and the episodes each arm served."""
    import numpy as np

    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.canary import in_canary
    from rlrec.trainer.rollout import CanaryRun
    from rlrec.trainer.sequential import CanaryRule

    uri = os.path.join(workdir, f"store-{effect:+g}-{seed}")
    committer = ShardCommitter(uri)
    committer.claim()
    rng = np.random.default_rng(seed)
    started = time.time()
    # returns N(mean, 1) with |mean| <= 0.5: the stated range holds all but ~1e-5 of them (clipped);
    # the test's share is the services' (every canary episode counts, deployed ones from score 0.5);
    # an episode starts every millisecond and is committed with its shard (episode_max_s 0: each
    # look counts every episode committed so far, as a cohort of ended episodes)
    rule = CanaryRule(return_min=-5.0, return_max=5.0, share=share, episode_max_s=0.0)
    run = CanaryRun(version=2, base_version=1, started=started, gamma=0.99, rule=rule)
    served = {1: 0, 2: 0}
    i = 0
    while True:
        batch = []
        for _ in range(SHARD_EPISODES):
            eid = f"r{seed}-e{i}"
            i += 1
            v = 2 if in_canary(eid, share) else 1
            served[v] += 1
            mean = effect if v == 2 else 0.0
            batch.append(_episode(v, float(rng.normal(mean, 1.0)), int(started * 1000) + i, eid, share))
        committer.commit(batch)
        verdict = run.look(uri, now=started + (i + 1) / 1000.0)
        if verdict.decision != "continue":
            return {
                "decision": verdict.decision,
                "reason": verdict.reason,
                "canary_episodes": served[2],
                "deployed_episodes": served[1],
                "looks": len(run.history),
            }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 rounds per scenario")
    p.add_argument("--rounds", type=int, default=None, help="rounds per scenario (default 10; quick: 3)")
    p.add_argument("--share", type=float, default=0.2, help="the services' canary_fraction")
    p.add_argument("--effect", type=float, default=0.5, help="|canary - deployed| in standard deviations")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 10)
    result: dict = {"share": args.share, "effect": args.effect, "rounds": rounds, "shard_episodes": SHARD_EPISODES}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="rlrec-bench-canary-") as workdir:
        for name, effect in (("worse", -args.effect), ("better", args.effect)):
            runs = [one_round(effect, args.share, seed, workdir) for seed in range(rounds)]
            exposure = [r["canary_episodes"] for r in runs]
            result[name] = {
                "runs": runs,
                "expected": "rollback" if effect < 0 else "promote",
                "right_decisions": sum(r["decision"] == ("rollback" if effect < 0 else "promote") for r in runs),
                # an undecided canary rolled back at the maximum exposure is no decision of the test
                "decided_on_the_bound": sum(
                    r["reason"].startswith(("the upper bound", "the lower bound")) for r in runs
                ),
                "canary_episodes_median": statistics.median(exposure),
                "canary_episodes_spread": [min(exposure), max(exposure)],
            }
            print(
                f"{name} canary ({effect:+g} sd, share {args.share:g}): {result[name]['right_decisions']}/{rounds} "
                f"right decisions ({result[name]['decided_on_the_bound']} on the bound), canary episodes served: "
                f"median {result[name]['canary_episodes_median']:g} "
                f"[{min(exposure)}, {max(exposure)}]",
                flush=True,
            )
    result["seconds"] = round(time.time() - t0, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
