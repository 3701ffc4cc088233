"""The trainer against hostile or unusable data, and signed checkpoints, with real Ray/RLlib.

* The FIRST committed shard carries a pickled-object `item` column (re-hashed manifest entry):
  the trainer refuses it at the schema gate (marker file: nothing executes), takes the spaces from
  the next shard, keeps training and counts it (`shards_skipped`): `rlrec train` neither dies on
  it nor runs the payload.
* A shard holding episodes the RLModule cannot use (action 7 for Discrete(2), which made RLlib's
  ``TorchCategorical.logp`` fail with "index out of bounds"; a NaN observation): those episodes are
  skipped and counted (`episodes_skipped`), the others trained on; the Learner does not raise.
* Published policies are signed when the trainer has a key; `--resume` with the key refuses a
  checkpoint whose files no longer match its signed index.json.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from rlrec.store.commit import ShardCommitter
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes
from tests.hostile_shards import hostile_shard, replace_committed

pytestmark = pytest.mark.slow


def _cfg(out, ck, **kw):
    from rlrec.trainer.service import TrainerConfig

    base = {
        "input": out,
        "checkpoint_dir": ck,
        "algo": "BC",
        "poll_interval_s": 0.2,
        "progress": False,
        "promotion_gate": "off",  # every checkpoint's policy published (the default gates them)
        "cache_ttl_s": 1.0,
        "algo_config": {"train_batch_size_per_learner": 128, "lr": 1e-3},
        "offline_config": {"dataset_num_iters_per_learner": 3},
        "min_time_s_per_iteration": 0.5,
    }
    base.update(kw)
    return TrainerConfig(**base)


def _metrics(ck) -> list[dict]:
    with open(os.path.join(ck, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def test_trainer_skips_hostile_shards_and_unusable_episodes(ray_cluster, tmp_path):
    from rlrec.trainer.service import ContinuousTrainer

    out, ck, marker = str(tmp_path / "out"), str(tmp_path / "ck"), tmp_path / "pwned"
    storage = Storage.from_uri(out)
    # 1. the first shard: a pickled-object `item` column, manifest entry re-hashed
    evil = ShardCommitter(storage, topic="evil")
    eps = expert_cartpole_episodes(2, seed=50, max_steps=50)
    (entry,) = evil.commit(eps).entries
    replace_committed(storage, entry, hostile_shard(eps, "episodes", "item", str(marker)))
    # 2. a shard with two unusable episodes among good ones
    bad_eps = expert_cartpole_episodes(4, seed=51, max_steps=80)
    bad_eps[0].actions[0][3] = 7  # outside Discrete(2)
    bad_eps[1].observations[0][5, 1] = np.nan
    good = ShardCommitter(storage, topic="good")
    good.commit(bad_eps)
    # 3. good shards
    for i in range(3):
        good.commit(expert_cartpole_episodes(3, seed=i, max_steps=200))

    tr = ContinuousTrainer(_cfg(out, ck, max_iterations=3, checkpoint_interval=3))
    assert tr.run() == 0
    lines = _metrics(ck)
    assert [r["iteration"] for r in lines] == [1, 2, 3]
    assert all(np.isfinite(r["learner_loss"]) for r in lines)
    assert lines[-1]["shards_skipped"] == 1
    assert lines[-1]["episodes_skipped"] == 2
    trained = set().union(*(set(r["new_shards"]) for r in lines))
    assert entry.path not in trained and len(trained) >= 2
    assert not marker.exists(), "a pickled payload was executed"


def test_signed_policies_and_checkpoints(ray_cluster, tmp_path):
    from rlrec.trainer.checkpoints import CheckpointVerificationError
    from rlrec.trainer.policy import PolicyLoadError, load_policy
    from rlrec.trainer.service import ContinuousTrainer
    from rlrec.trainer.signing import generate_keys

    priv, pub = generate_keys(tmp_path / "keys")
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    c = ShardCommitter(out)
    for i in range(2):
        c.commit(expert_cartpole_episodes(2, seed=i, max_steps=100))
    assert ContinuousTrainer(_cfg(out, ck, max_iterations=2, checkpoint_interval=2, signing_key=str(priv))).run() == 0
    p = load_policy(ck, public_key=pub)
    assert p.signed and p.spec["format"] == "safetensors" and p.policy_version == 1
    _, other_pub = generate_keys(tmp_path / "other")
    with pytest.raises(PolicyLoadError, match=r"another key signed it"):
        load_policy(ck, public_key=other_pub)

    latest = json.load(open(os.path.join(ck, "checkpoints", "latest.json")))
    ckpt = os.path.join(ck, latest["path"])
    assert os.path.exists(os.path.join(ckpt, "index.json.sig"))
    # resume with the key: fine
    tr = ContinuousTrainer(_cfg(out, ck, max_iterations=3, checkpoint_interval=10, resume=True, signing_key=str(priv)))
    assert tr.run() == 0 and tr.iteration == 3
    # tamper with a file RLlib would unpickle: refused before RLlib reads it
    latest = json.load(open(os.path.join(ck, "checkpoints", "latest.json")))
    lg = os.path.join(ck, latest["path"], "algo", "learner_group")
    victim = next(os.path.join(d, f) for d, _, fs in os.walk(lg) for f in fs)
    with open(victim, "ab") as f:
        f.write(b"\0")
    tr = ContinuousTrainer(_cfg(out, ck, max_iterations=4, resume=True, signing_key=str(priv)))
    with pytest.raises(CheckpointVerificationError, match="do not match its signed index"):
        tr.run()
