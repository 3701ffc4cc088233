"""Multi-agent stores for the trainer's tests: simple_spread (2 agents) stepped with a scripted
policy for agent_0 (module ``scripted``) and random actions for agent_1 (module ``random``),
split into multi-agent rows and committed through a manifest partition log, as the consumer
commits them (one shard per module per commit)."""

from __future__ import annotations

import hashlib

import numpy as np

from rlrec.producer.multi_agent_recording import MultiAgentEnvStep, MultiAgentRecording, MultiAgentReset
from rlrec.store.manifest import PartitionLog, ShardEntry
from rlrec.store.multi_agent_shards import encode_multi_agent_shards
from rlrec.store.storage import Storage
from tests.test_multi_agent_shards import shard_episode

MODULES = {"agent_0": "scripted", "agent_1": "random"}
POLICY = "spread"


def script(obs: np.ndarray) -> int:
    """agent_0's scripted action: along the larger axis toward landmark 0 (obs[4:6] is its
    position relative to the agent): 1/2 left/right, 3/4 down/up."""
    dx, dy = float(obs[4]), float(obs[5])
    if abs(dx) >= abs(dy):
        return 2 if dx > 0 else 1
    return 4 if dy > 0 else 3


def scripted_spread(episode_id: str, seed: int, max_cycles: int = 25) -> MultiAgentRecording:
    """One simple_spread episode: agent_0 follows `script`, agent_1 acts at random."""
    from mpe2 import simple_spread_v3

    env = simple_spread_v3.parallel_env(N=2, max_cycles=max_cycles, continuous_actions=False)
    rng = np.random.default_rng(seed)
    obs, infos = env.reset(seed=seed)
    rec = MultiAgentRecording(
        episode_id=episode_id,
        policy_id=POLICY,
        policy_version=1,
        agent_modules=dict(MODULES),
        reset=MultiAgentReset(observations=dict(obs), infos={a: i for a, i in infos.items() if a in obs}),
        observation_spaces={a: env.observation_space(a) for a in MODULES},
        action_spaces={a: env.action_space(a) for a in MODULES},
        env_id="simple_spread_v3",
    )
    while obs:
        actions = {a: (script(o) if a == "agent_0" else int(rng.integers(5))) for a, o in obs.items()}
        obs, rewards, terms, truncs, infos = env.step(actions)
        rec.steps.append(
            MultiAgentEnvStep(
                actions=actions,
                rewards=dict(rewards),
                observations=dict(obs),
                terminateds=dict(terms),
                truncateds=dict(truncs),
                infos={a: i for a, i in infos.items() if a in obs},
                extra_model_outputs={a: {"action_logp": np.float32(np.log(0.2))} for a in actions},
            )
        )
        if all(terms.get(a) or truncs.get(a) for a in MODULES):
            break
    return rec


def commit_spread(
    root: str,
    commits: int,
    episodes_per_commit: int,
    first_seed: int = 0,
    first_offset: int | None = None,
) -> list[str]:
    """Commit `commits` x (one shard per module) of `episodes_per_commit` episodes each under
    `root`; returns the committed shard paths (2 per commit). `first_offset`: every shard
    entry's (default: its own commit's offset; a lower one makes the commits' offset ranges
    overlap, as long interleaved episodes do)."""
    st = Storage.from_uri(root, fsync=False)
    log = PartitionLog(st, "rl", 0)
    log.claim("test-writer")
    log.recover()
    paths = []
    seed = first_seed
    for _ in range(commits):
        recs = []
        for _i in range(episodes_per_commit):
            recs.append(scripted_spread(f"ma-{seed}", seed))
            seed += 1
        offset = log.next_seq * 1000
        shards = encode_multi_agent_shards([shard_episode(r, offset + i * 100) for i, r in enumerate(recs)])
        for policy, enc in sorted(shards.items()):
            name = f"rl+00000+{offset:020d}+{offset:020d}+e1.{log.next_seq}.parquet"
            entry = ShardEntry(
                path=f"{policy}/{name}",
                staging_path=f"{policy}/_staging/{name}",
                topic="rl",
                partition=0,
                policy_id=policy,
                first_offset=offset if first_offset is None else first_offset,
                last_offset=offset,
                episode_ids=list(enc.episode_ids),
                episodes=enc.episodes,
                steps=enc.steps,
                bytes=len(enc.data),
                sha256=hashlib.sha256(enc.data).hexdigest(),
                format="episodes",
                format_version=enc.schema_version,
            )
            st.write(entry.staging_path, enc.data)
            log.publish(log.append_shard(entry), enc.data)
            paths.append(entry.path)
    return paths
