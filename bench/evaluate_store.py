"""A store and a published policy for `rlrec evaluate` runs (bench/evaluate.py, the CI check of
`rlrec[evaluate]` in a fresh venv: `make check-evaluate-extra`).

CartPole-v1 episodes played by a stochastic linear controller that logs its propensities
(``action_logp``, `rlrec.trainer.synthetic.logged_episodes`), committed with the project's shard
writer in shards of `--episodes-per-shard` episodes under ``DIR/data``; versions 1 (the
behaviour itself) and 2 (a greedier controller) published unsigned under ``DIR/policies``.
Built with the full install (it imports torch and the trainer's exporter); the evaluation that
reads it needs only ``rlrec[evaluate]``.

Usage: ``python bench/evaluate_store.py DIR [--steps 20000] [--episodes-per-shard 20]``; prints a
JSON line (episodes, steps, shards). A DIR that holds a store already is left as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

#: logits of the behaviour controller: action 1 iff angle + 0.5 angular velocity > 0, softened
BEHAVIOUR = np.array([[0.0, 0.0, -1.0, -0.5], [0.0, 0.0, 1.0, 0.5]], np.float32) * 8.0
#: the candidate: the same controller, sharper
CANDIDATE = BEHAVIOUR * 4.0


def build(root: str, steps: int, episodes_per_shard: int = 20, seed: int = 0) -> dict:
    """Write at least `steps` logged CartPole steps and versions 1-2 under `root` (see module)."""
    import gymnasium as gym

    from rlrec.store.commit import ShardCommitter
    from rlrec.store.storage import Storage
    from rlrec.trainer.export import PolicyArtifact, publish_policy
    from rlrec.trainer.synthetic import linear_policy_artifact, logged_episodes

    done = os.path.join(root, "built.json")
    if os.path.exists(done):
        with open(done) as f:
            return {**json.load(f), "reused": True}
    committer = ShardCommitter(os.path.join(root, "data"))
    spec, model = linear_policy_artifact(BEHAVIOUR)
    written = episodes = shards = 0
    while written < steps:
        eps, _ = logged_episodes(
            "CartPole-v1", spec, model, episodes_per_shard, seed=seed + shards, policy_version=1, gamma=0.99
        )
        committer.commit(eps)
        written += sum(e.length for e in eps)
        episodes += len(eps)
        shards += 1
    for version, weights in ((1, BEHAVIOUR), (2, CANDIDATE)):
        s, m = linear_policy_artifact(weights)
        publish_policy(
            Storage.from_uri(os.path.join(root, "policies")),
            algo=None,
            version=version,
            algo_name="BC",
            observation_space=gym.make("CartPole-v1").observation_space,
            action_space=gym.spaces.Discrete(2),
            iteration=version,
            timesteps_trained=0,
            shards=[],
            new_shards=[],
            parent_version=None,
            artifact=PolicyArtifact(
                "safetensors",
                {"model.safetensors": m},
                {k: s[k] for k in ("format", "model", "action_dist", "network")},
            ),
            metadata={"gamma": 0.99},
        )
    out = {"episodes": episodes, "steps": written, "shards": shards}
    with open(done, "w") as f:
        json.dump(out, f)
    return {**out, "reused": False}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--steps", type=int, default=20_000, help="logged steps (at least)")
    ap.add_argument("--episodes-per-shard", type=int, default=20)
    args = ap.parse_args(argv)
    print(json.dumps(build(args.dir, args.steps, args.episodes_per_shard)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
