"""rlrec.store.shards: episode and tabular Parquet shards, read back by us, pandas, polars, Ray Data
and stock RLlib 2.60 (BC). No broker.

The Ray tests (marked `slow`) share one module-scoped Ray session (`ray.init(num_cpus=4)`: on 2
cores RLlib's default PreLearner concurrency would otherwise starve the read task).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections import OrderedDict

import gymnasium as gym
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlrec.producer.spaces import flatten_value, loads_space, space_from_json, space_leaves, space_to_json
from rlrec.store.episodes import pack_episode, to_single_agent_episode
from rlrec.store.finished import FinishedEpisode
from rlrec.store.shards import (
    EPISODE_COLUMNS,
    SHARD_FORMAT_VERSION,
    EncodedShard,
    encode_shard,
    read_episodes,
    read_tabular,
    shard_metadata,
)

BATCH = 128  # BC train_batch_size_per_learner


# ---------------------------------------------------------------------------------------------
# data: real CartPole-v1 episodes from a scripted controller


def cartpole_episodes(
    n: int, seed: int = 0, max_steps: int = 120, infos: bool = False, prefix: str = "ep"
) -> list[FinishedEpisode]:
    """Every third episode uses a bad controller (terminates fast); the others mostly truncate."""
    env = gym.make("CartPole-v1", max_episode_steps=max_steps)
    out = []
    for e in range(n):
        o, info = env.reset(seed=seed + e)
        obs, acts, rews, infs, logits = [o], [], [], [dict(info)], []
        good = e % 3 != 0
        while True:
            a = int(o[2] + 0.5 * o[3] > 0) if good else 0
            z = float(o[2] + 0.5 * o[3])
            o, r, term, trunc, info = env.step(a)
            obs.append(o)
            acts.append(a)
            rews.append(r)
            logits.append([-z, z])
            infs.append({"step": len(acts)} if infos and len(acts) % 5 == 0 else dict(info))
            if term or trunc:
                break
        out.append(
            FinishedEpisode(
                episode_id=f"{prefix}-{seed}-{e}",
                policy_id="scripted",
                policy_version=e % 4,
                env_id="CartPole-v1",
                observation_space=env.observation_space,
                action_space=env.action_space,
                observations=[np.stack(obs).astype(np.float32)],
                actions=[np.asarray(acts, dtype=np.int64)],
                rewards=np.asarray(rews, dtype=np.float64),
                infos=infs,
                extra_model_outputs={
                    "action_dist_inputs": np.asarray(logits, dtype=np.float32),
                    "action_logp": np.full(len(acts), -0.25, dtype=np.float32),
                },
                terminated=bool(term),
                truncated=bool(trunc),
                first_offset=100 * e,
                last_offset=100 * e + 7,
                started_ms=1_700_000_000_000 + e,
                ended_ms=1_700_000_001_000 + e,
            )
        )
    return out


def dict_episodes(n: int = 3, T: int = 5) -> list[FinishedEpisode]:
    osp = space_from_json(
        space_to_json(
            gym.spaces.Dict(
                OrderedDict(
                    [
                        ("pos", gym.spaces.Box(-1.0, 1.0, (3,), np.float32)),
                        ("img", gym.spaces.Box(0, 255, (2, 3), np.uint8)),
                        ("pair", gym.spaces.Tuple([gym.spaces.Discrete(4), gym.spaces.MultiBinary(2)])),
                    ]
                )
            )
        )
    )
    asp = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    osp.seed(5)
    asp.seed(5)
    out = []
    for e in range(n):
        values = [osp.sample() for _ in range(T + 1)]
        per = [flatten_value(osp, v) for v in values]
        leaves = [np.stack([np.asarray(p[i], dtype=lf.dtype) for p in per]) for i, lf in enumerate(space_leaves(osp))]
        out.append(
            FinishedEpisode(
                f"d-{e}",
                "pol",
                1,
                "DictEnv",
                osp,
                asp,
                leaves,
                [np.stack([asp.sample() for _ in range(T)])],
                np.arange(T, dtype=np.float64),
                [{}] * (T + 1),
                {},
                e % 2 == 0,
                e % 2 == 1,
                e,
                e,
                0,
                0,
            )
        )
    return out


@pytest.fixture(scope="module")
def cartpole() -> list[FinishedEpisode]:
    eps = cartpole_episodes(24, infos=True)
    assert any(e.terminated for e in eps) and any(e.truncated for e in eps)
    return eps


def _table(shard: EncodedShard) -> pa.Table:
    return pq.read_table(pa.BufferReader(shard.data))


# ---------------------------------------------------------------------------------------------
# episode shards


def test_episode_shard_columns_and_counts(cartpole):
    eps = cartpole[:10]
    shard = encode_shard(eps, episodes_per_row_group=4)
    assert shard.fmt == "episodes" and shard.schema_version == SHARD_FORMAT_VERSION == 1
    assert shard.episodes == 10 and shard.steps == sum(e.length for e in eps)
    assert shard.episode_ids == [e.episode_id for e in eps]
    assert shard.sha256 == hashlib.sha256(shard.data).hexdigest()
    assert shard.data[:4] == b"PAR1" and shard.data[-4:] == b"PAR1"

    t = _table(shard)
    assert t.schema.names == ["item", *EPISODE_COLUMNS]
    assert t.schema.field("item").type == pa.binary()
    for name, typ in EPISODE_COLUMNS.items():
        assert t.schema.field(name).type == typ, name
    assert t.num_rows == 10
    assert pq.ParquetFile(pa.BufferReader(shard.data)).metadata.num_row_groups == 3
    assert pq.ParquetFile(pa.BufferReader(shard.data)).metadata.row_group(0).column(0).compression == "ZSTD"
    rows = t.drop_columns(["item"]).to_pylist()
    for e, r in zip(eps, rows):
        assert r == {
            "episode_id": e.episode_id,
            "policy_id": "scripted",
            "policy_version": e.policy_version,
            "env_id": "CartPole-v1",
            "length": e.length,
            "episode_return": e.episode_return,
            "terminated": e.terminated,
            "truncated": e.truncated,
            "first_offset": e.first_offset,
            "last_offset": e.last_offset,
            "started_ms": e.started_ms,
            "ended_ms": e.ended_ms,
        }
    # the item is exactly RLlib's packing of our episode
    assert t.column("item")[3].as_py() == pack_episode(to_single_agent_episode(eps[3]))
    meta = shard_metadata(shard.data)
    assert meta["rlrec.format"] == "episodes" and meta["rlrec.schema_version"] == "1"
    assert loads_space(meta["rlrec.observation_space"]) == eps[0].observation_space


def test_read_episodes_bytes_and_path(cartpole, tmp_path):
    eps = cartpole[:6]
    shard = encode_shard(eps, compression="snappy")
    path = tmp_path / "s.parquet"
    path.write_bytes(shard.data)
    for src in (shard.data, str(path)):
        back = read_episodes(src)
        assert [b.id_ for b in back] == [e.episode_id for e in eps]
        for b, e in zip(back, eps):
            ref = to_single_agent_episode(e)
            assert b.is_numpy and len(b) == e.length
            np.testing.assert_array_equal(b.get_observations(), e.observations[0])
            np.testing.assert_array_equal(b.get_actions(), e.actions[0])
            np.testing.assert_array_equal(b.get_rewards(), e.rewards)
            np.testing.assert_array_equal(
                b.get_extra_model_outputs("action_dist_inputs"), e.extra_model_outputs["action_dist_inputs"]
            )
            assert b.get_infos() == ref.get_infos()
            assert (b.is_terminated, b.is_truncated) == (e.terminated, e.truncated)
            assert b.custom_data == {
                "policy_id": "scripted",
                "policy_version": e.policy_version,
                "env_id": "CartPole-v1",
            }
            assert b.observation_space == e.observation_space and b.action_space == e.action_space
    # pyarrow filesystem argument
    from pyarrow import fs

    assert len(read_episodes(str(path), filesystem=fs.LocalFileSystem())) == 6


def test_dict_space_episode_shard_round_trip():
    eps = dict_episodes()
    back = read_episodes(encode_shard(eps).data)
    for b, e in zip(back, eps):
        obs = b.observations.data
        assert list(obs) == ["pos", "img", "pair"] and isinstance(obs["pair"], tuple)
        np.testing.assert_array_equal(obs["img"], e.observations[1])
        np.testing.assert_array_equal(obs["pair"][1], e.observations[3])


def test_shard_validation(cartpole):
    e0, e1 = cartpole[0], cartpole[1]
    with pytest.raises(ValueError, match="fmt"):
        encode_shard([e0], fmt="csv")
    with pytest.raises(ValueError, match="at least one"):
        encode_shard([])
    with pytest.raises(ValueError, match="twice"):
        encode_shard([e0, e1, e0])
    undone = FinishedEpisode(**{**e0.__dict__, "terminated": False, "truncated": False, "episode_id": "u"})
    with pytest.raises(ValueError, match="neither terminated nor truncated"):
        encode_shard([undone], fmt="tabular")
    empty = FinishedEpisode(
        **{
            **e0.__dict__,
            "episode_id": "z",
            "observations": [e0.observations[0][:1]],
            "actions": [e0.actions[0][:0]],
            "rewards": e0.rewards[:0],
            "infos": [{}],
            "extra_model_outputs": {},
        }
    )
    with pytest.raises(ValueError, match="no steps"):
        encode_shard([empty])
    bad = FinishedEpisode(**{**e0.__dict__, "episode_id": "b", "extra_model_outputs": {"obs": e0.rewards}})
    with pytest.raises(ValueError, match="reserves"):
        encode_shard([bad], fmt="tabular")
    with pytest.raises(ValueError, match="space"):
        encode_shard([e0, dict_episodes(1)[0]], fmt="tabular")


# ---------------------------------------------------------------------------------------------
# tabular shards


def test_tabular_shard_columns_and_values(cartpole):
    eps = cartpole[:5]
    shard = encode_shard(eps, fmt="tabular")
    n = sum(e.length for e in eps)
    assert (shard.fmt, shard.episodes, shard.steps) == ("tabular", 5, n)
    t = read_tabular(shard.data)
    assert t.num_rows == n
    assert t.schema.names == [
        "eps_id",
        "agent_id",
        "module_id",
        "obs",
        "actions",
        "rewards",
        "new_obs",
        "terminateds",
        "truncateds",
        "t",
        "infos",
        "action_dist_inputs",
        "action_logp",
        "policy_version",
    ]
    types = {f.name: f.type for f in t.schema}
    assert types["eps_id"] == pa.string() and types["agent_id"] == pa.null() == types["module_id"]
    assert types["obs"] == pa.list_(pa.float32(), 4) == types["new_obs"]
    assert types["actions"] == pa.int64() and types["rewards"] == pa.float64()
    assert types["terminateds"] == pa.bool_() == types["truncateds"]
    assert types["t"] == pa.int64() == types["policy_version"]
    assert types["action_dist_inputs"] == pa.list_(pa.float32(), 2) and types["action_logp"] == pa.float32()
    assert types["infos"] == pa.string()

    obs = np.stack(t.column("obs").to_numpy(zero_copy_only=False))
    new_obs = np.stack(t.column("new_obs").to_numpy(zero_copy_only=False))
    np.testing.assert_array_equal(obs, np.concatenate([e.observations[0][:-1] for e in eps]))
    np.testing.assert_array_equal(new_obs, np.concatenate([e.observations[0][1:] for e in eps]))
    np.testing.assert_array_equal(t.column("actions").to_numpy(), np.concatenate([e.actions[0] for e in eps]))
    ends = np.cumsum([e.length for e in eps]) - 1
    term, trunc = (
        t.column("terminateds").to_numpy(zero_copy_only=False),
        t.column("truncateds").to_numpy(zero_copy_only=False),
    )
    assert list(np.flatnonzero(term | trunc)) == list(ends)
    assert [bool(term[i]) for i in ends] == [e.terminated for e in eps]
    assert [bool(trunc[i]) for i in ends] == [e.truncated for e in eps]
    assert t.column("t").to_pylist()[: eps[0].length + 1] == [*range(eps[0].length), 0]
    assert t.column("eps_id").to_pylist()[0] == eps[0].episode_id
    infos = t.column("infos").to_pylist()
    assert json.loads(infos[4]) == {"step": 5} and infos[0] is None  # info returned with new_obs
    assert shard_metadata(shard.data)["rlrec.format"] == "tabular"


def test_tabular_without_infos_has_no_infos_column():
    eps = cartpole_episodes(2, infos=False)
    assert "infos" not in read_tabular(encode_shard(eps, fmt="tabular").data).column_names


def test_tabular_missing_extra_output_is_null(cartpole):
    a, b = cartpole[0], cartpole[1]
    b2 = FinishedEpisode(**{**b.__dict__, "extra_model_outputs": {"action_logp": b.extra_model_outputs["action_logp"]}})
    t = read_tabular(encode_shard([a, b2], fmt="tabular").data)
    col = t.column("action_dist_inputs")
    assert col.null_count == b.length and col.type == pa.list_(pa.float32(), 2)


def test_tabular_readable_by_pandas_and_polars(cartpole):
    import pandas as pd
    import polars as pl

    eps = cartpole[:4]
    data = encode_shard(eps, fmt="tabular").data
    expect = np.concatenate([e.observations[0][:-1] for e in eps])

    df = pd.read_parquet(io.BytesIO(data))
    assert len(df) == len(expect)
    first = df["obs"].iloc[0]
    assert isinstance(first, np.ndarray) and first.dtype == np.float32
    np.testing.assert_array_equal(np.stack(df["obs"].to_numpy()), expect)
    assert df["actions"].dtype == np.int64 and df["rewards"].dtype == np.float64

    p = pl.read_parquet(io.BytesIO(data))
    assert p.schema["obs"] == pl.Array(pl.Float32, 4)
    np.testing.assert_array_equal(p["obs"].to_numpy(), expect)
    assert p["action_dist_inputs"].to_numpy().shape == (len(expect), 2)


def test_tabular_dict_space_struct_columns():
    import polars as pl

    eps = dict_episodes()
    data = encode_shard(eps, fmt="tabular").data
    t = read_tabular(data)
    obs_t = t.schema.field("obs").type
    assert pa.types.is_struct(obs_t) and [f.name for f in obs_t] == ["pos", "img", "pair"]
    assert obs_t.field("img").type == pa.list_(pa.list_(pa.uint8(), 3), 2)  # nested fixed-size lists
    assert obs_t.field("pair").type == pa.struct([("0", pa.int64()), ("1", pa.list_(pa.int8(), 2))])
    assert t.schema.field("actions").type == pa.list_(pa.float32(), 2)
    p = pl.read_parquet(io.BytesIO(data))
    img = p["obs"].struct.field("img").to_numpy()
    np.testing.assert_array_equal(img, np.concatenate([e.observations[1][:-1] for e in eps]))
    # the tensor option: arrow.fixed_shape_tensor for k-D leaves
    tt = read_tabular(encode_shard(eps, fmt="tabular", multidim="tensor").data)
    img_t = tt.schema.field("obs").type.field("img").type
    assert isinstance(img_t, pa.FixedShapeTensorType) and list(img_t.shape) == [2, 3]


# ---------------------------------------------------------------------------------------------
# Ray Data and stock RLlib (slow)


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


@pytest.fixture(scope="module")
def shard_dirs(cartpole, tmp_path_factory):
    """Three episode shards and three tabular shards of the same 24 episodes."""
    dirs = {}
    for fmt in ("episodes", "tabular"):
        d = tmp_path_factory.mktemp(fmt)
        for i in range(3):
            shard = encode_shard(cartpole[8 * i : 8 * (i + 1)], fmt=fmt)
            (d / f"shard-{i:05d}.parquet").write_bytes(shard.data)
        dirs[fmt] = d
    return dirs


def _bc_config(input_dir, **offline):
    from ray.rllib.algorithms.bc import BCConfig

    env = gym.make("CartPole-v1")
    return (
        BCConfig()
        .environment(observation_space=env.observation_space, action_space=env.action_space)
        .learners(num_learners=0)
        .training(train_batch_size_per_learner=BATCH)
        .offline_data(
            input_=[str(input_dir)], map_batches_kwargs={"concurrency": 1}, dataset_num_iters_per_learner=1, **offline
        )
    )


def _train_two_iterations(cfg) -> None:
    algo = cfg.build_algo()
    try:
        for i in range(2):
            r = algo.train()
            learner = r["learners"]["default_policy"]
            assert math.isfinite(float(learner["policy_loss"]))
            assert r["learners"]["__all_modules__"]["num_env_steps_trained_lifetime"] == BATCH * (i + 1)
    finally:
        algo.offline_data.batch_iterators = None  # avoids a harmless traceback at stop()
        algo.stop()


def _check_prelearner_batch(cfg, batch, cartpole) -> None:
    """Run stock RLlib's OfflinePreLearner on one Ray Data batch; every (obs, action) it yields
    must be a (obs, action) pair of our data."""
    from ray.rllib.offline.offline_prelearner import OfflinePreLearner

    env = gym.make("CartPole-v1")
    spaces = (env.observation_space, env.action_space)
    pl = OfflinePreLearner(
        config=cfg, spaces=spaces, module_spec=cfg.get_multi_rl_module_spec(spaces={"default_policy": spaces})
    )
    out = pl(batch)
    obs, act = out["default_policy/obs"].numpy(), out["default_policy/actions"].numpy()
    assert obs.shape == (BATCH, 4) and obs.dtype == np.float32
    pairs = {}
    for e in cartpole:
        for o, a in zip(e.observations[0][:-1], e.actions[0]):
            pairs[o.tobytes()] = int(a)
    assert all(pairs.get(o.tobytes()) == int(a) for o, a in zip(obs, act))


@pytest.mark.slow
def test_ray_data_reads_episode_shards(ray_session, shard_dirs, cartpole):
    ds = ray_session.data.read_parquet(str(shard_dirs["episodes"]))
    assert ds.count() == 24
    names = ds.schema().names
    assert names[0] == "item" and set(EPISODE_COLUMNS) <= set(names)
    # projection + filter pushdown on the metadata columns
    # (Ray 2.60 refuses `filter=` in read_parquet; Dataset.filter(expr=...) is the way)
    from ray.data.expressions import col

    sel = ray_session.data.read_parquet(str(shard_dirs["episodes"]), columns=["item", "length", "terminated"])
    sel = sel.filter(expr=col("terminated") == True)  # noqa: E712
    assert sel.count() == sum(e.terminated for e in cartpole)
    batch = next(iter(ds.iter_batches(batch_size=24, batch_format="numpy")))
    assert isinstance(batch["item"][0], bytes)
    cfg = _bc_config(shard_dirs["episodes"], input_read_episodes=True)
    _check_prelearner_batch(cfg, batch, cartpole)


@pytest.mark.slow
def test_stock_bc_trains_on_episode_shards(ray_session, shard_dirs):
    _train_two_iterations(_bc_config(shard_dirs["episodes"], input_read_episodes=True))


@pytest.mark.slow
def test_ray_data_reads_tabular_shards(ray_session, shard_dirs, cartpole):
    ds = ray_session.data.read_parquet(str(shard_dirs["tabular"]))
    assert ds.count() == sum(e.length for e in cartpole)
    batch = next(iter(ds.iter_batches(batch_size=BATCH, batch_format="numpy")))
    first = batch["obs"][0]
    assert isinstance(first, np.ndarray) and first.dtype == np.float32 and first.shape == (4,)
    cfg = _bc_config(shard_dirs["tabular"], input_read_episodes=False, input_compress_columns=[])
    _check_prelearner_batch(cfg, batch, cartpole)


@pytest.mark.slow
def test_ray_data_multidim_leaves(ray_session):
    """k-D leaves in Ray Data (what the PreLearner gets per row): nested fixed-size lists arrive
    as object arrays of arrays (unusable as tensors); the tensor extension as real ndarrays,
    but only as a top-level column: inside a struct (Dict/Tuple space) Ray flattens it."""
    box = space_from_json(space_to_json(gym.spaces.Box(-1.0, 1.0, (2, 3), np.float32)))
    box.seed(2)
    T = 4
    eps = [
        FinishedEpisode(
            f"b-{i}",
            "p",
            0,
            "BoxEnv",
            box,
            gym.spaces.Discrete(2),
            [np.stack([box.sample() for _ in range(T + 1)])],
            [np.zeros(T, np.int64)],
            np.zeros(T),
            [{}] * (T + 1),
            {},
            True,
            False,
            0,
            0,
            0,
            0,
        )
        for i in range(2)
    ]

    def first_obs(episodes, multidim, key=None):
        table = read_tabular(encode_shard(episodes, fmt="tabular", multidim=multidim).data)
        batch = next(iter(ray_session.data.from_arrow(table).iter_batches(batch_size=8, batch_format="numpy")))
        o = batch["obs"][0]
        return o[key] if key else o

    nested = first_obs(eps, "nested")
    assert nested.dtype == object and nested.shape == (2,)
    tensor = first_obs(eps, "tensor")
    assert tensor.dtype == np.float32 and tensor.shape == (2, 3)
    np.testing.assert_array_equal(tensor, eps[0].observations[0][0])
    in_struct = first_obs(dict_episodes(), "tensor", key="img")
    assert in_struct.dtype == np.uint8 and in_struct.shape == (6,)  # flattened by Ray Data


@pytest.mark.slow
@pytest.mark.parametrize("compress", [[], "default"], ids=["input_compress_columns=[]", "default"])
def test_stock_bc_trains_on_tabular_shards(ray_session, shard_dirs, compress):
    offline = {"input_read_episodes": False}
    if compress != "default":
        offline["input_compress_columns"] = compress
    _train_two_iterations(_bc_config(shard_dirs["tabular"], **offline))
