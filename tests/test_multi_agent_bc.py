"""Stock single-agent RLlib trains one module of multi-agent rows from its folder: BC reads the
``item`` column of a ``{policy_id}.{module_id}`` folder the multi-agent row writer wrote."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("pettingzoo")
pytest.importorskip("mpe2")

from rlrec.store.multi_agent_shards import encode_multi_agent_shards
from rlrec.store.schema_gate import open_shard
from tests import multi_agent_cases as cases
from tests.test_multi_agent_shards import shard_episode

BATCH = 64


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # someone else's session: use it, leave it running
        yield ray
        return
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_stock_bc_trains_on_one_modules_folder(ray_session, tmp_path):
    from ray.rllib.algorithms.bc import BCConfig

    recs = [cases.simple_spread(f"spread-{i}", seed=i) for i in range(4)] + [cases.pistonball()]
    for policy, enc in encode_multi_agent_shards([shard_episode(r, i) for i, r in enumerate(recs)]).items():
        (tmp_path / policy).mkdir()
        (tmp_path / policy / "shard-00000.parquet").write_bytes(enc.data)
    folder = tmp_path / "pol.spread"
    assert open_shard(str(folder / "shard-00000.parquet")).num_rows == 12  # 4 episodes x 3 agents
    spaces = recs[0].observation_spaces["agent_0"], recs[0].action_spaces["agent_0"]
    cfg = (
        BCConfig()
        .environment(observation_space=spaces[0], action_space=spaces[1])
        .learners(num_learners=0)
        .training(train_batch_size_per_learner=BATCH)
        .offline_data(
            input_=[str(folder)],
            input_read_episodes=True,
            map_batches_kwargs={"concurrency": 1},
            dataset_num_iters_per_learner=1,
        )
    )
    algo = cfg.build_algo()
    try:
        for i in range(2):
            r = algo.train()
            assert math.isfinite(float(r["learners"]["default_policy"]["policy_loss"]))
            assert r["learners"]["__all_modules__"]["num_env_steps_trained_lifetime"] == BATCH * (i + 1)
    finally:
        algo.offline_data.batch_iterators = None  # avoids a harmless traceback at stop()
        algo.stop()
