"""`rlrec convert`: RLlib tabular rows / old-stack SampleBatch JSON -> episode shards, round trips."""

from __future__ import annotations

import base64
import gc
import json
import os
import pickle

import gymnasium as gym
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlrec.cli import main
from rlrec.consumer.convert import ConvertError, ConvertOptions, UnsafeInputError, convert
from rlrec.store.manifest import read_manifest
from rlrec.store.shards import read_episodes, tabular_table
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes

ENV = gym.make("CartPole-v1")


def _episodes():
    """Terminated (random-ish actions) and truncated (expert hits the step limit) episodes."""
    eps = expert_cartpole_episodes(3, seed=1, epsilon=0.0, max_steps=40, policy_id="expert", policy_version=7)
    eps += expert_cartpole_episodes(3, seed=2, epsilon=0.9, max_steps=200, policy_id="expert", policy_version=7)
    assert {(e.terminated, e.truncated) for e in eps} == {(False, True), (True, False)}
    for e in eps:
        e.infos = [{}] + [{"step": i, "tag": "x"} for i in range(e.length)]
    return eps


def _read_back(output) -> dict:
    storage = Storage.from_uri(str(output))
    got = {}
    for entry in read_manifest(storage):
        for ep in read_episodes(storage.read(entry.path)):
            assert ep.id_ not in got
            got[ep.id_] = (entry, ep)
    return got


def _assert_same(originals, got, *, policy_id="expert", version=7, infos=True, extras=("action_logp",)):
    assert set(got) == {e.episode_id for e in originals}
    for fe in originals:
        entry, ep = got[fe.episode_id]
        assert entry.policy_id == policy_id and entry.min_policy_version == version
        assert ep.custom_data["policy_id"] == policy_id and ep.custom_data["policy_version"] == version
        np.testing.assert_array_equal(ep.get_observations(slice(None)), fe.observations[0])
        assert ep.get_observations(slice(None)).dtype == np.float32
        np.testing.assert_array_equal(ep.get_actions(slice(None)), fe.actions[0])
        np.testing.assert_array_equal(ep.get_rewards(slice(None)), fe.rewards)
        assert (ep.is_terminated, ep.is_truncated) == (fe.terminated, fe.truncated)
        for k in extras:
            np.testing.assert_array_equal(ep.get_extra_model_outputs(k, slice(None)), fe.extra_model_outputs[k])
        assert set(ep.extra_model_outputs) == set(extras)
        if infos:
            assert ep.get_infos(slice(None)) == fe.infos
        assert (ep.observation_space, ep.action_space) == (ENV.observation_space, ENV.action_space)


def _write_tabular(eps, d, *, shuffle_seed=0):
    """RLlib's tabular column schema (our tabular writer), rows shuffled and spread over two files."""
    table = tabular_table(eps)
    rng = np.random.default_rng(shuffle_seed)
    table = table.take(pa.array(rng.permutation(table.num_rows)))
    d.mkdir(parents=True, exist_ok=True)
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), d / "part-0.parquet")
    pq.write_table(table.slice(half), d / "part-1.parquet")
    # a repeated row (RLlib's recorder may write rows twice): dropped
    pq.write_table(table.slice(3, 2), d / "part-2.parquet")
    return table


def test_tabular_round_trip_and_rerun_is_idempotent(tmp_path, capsys):
    eps = _episodes()
    _write_tabular(eps, tmp_path / "in")
    out = tmp_path / "out"
    args = [
        "convert",
        "--from",
        "tabular",
        str(tmp_path / "in"),
        "--output",
        str(out),
        "--policy-id",
        "expert",
        "--episodes-per-shard",
        "4",
        "--json",
    ]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["episodes_written"] == 6 and doc["shards"] == 2 and doc["duplicate_rows_dropped"] == 2
    assert doc["observation_space"]["type"] == "Box"  # from the files' rlrec metadata
    _assert_same(eps, _read_back(out))

    # the same conversion again: nothing new is written
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["episodes_written"] == 0 and doc["already_committed"] == 6
    assert len(read_manifest(Storage.from_uri(str(out)))) == 2

    assert main(["inspect", str(out), "--verify"]) == 0
    assert "verify: no problems" in capsys.readouterr().out

    # what the trainer does with it: follow the manifest, take the spaces, decode safely
    from rlrec.trainer.manifest_follower import ManifestFollower, spaces_from_shard

    storage = Storage.from_uri(str(out))
    infos = ManifestFollower(storage).poll(force_discover=True)
    assert sum(s.rows for s in infos) == 6
    obs_space, act_space = spaces_from_shard(storage, read_manifest(storage)[0])
    assert obs_space == ENV.observation_space and act_space == ENV.action_space


def _rllib_recorder_style(eps, d):
    """Like RLlib 2.60's OfflineSingleAgentEnvRunner tabular output: obs/new_obs compressed with
    `ray.rllib.utils.compression.pack`, no `t` column, `weights_seq_no`, every row written twice."""
    from ray.data.extensions.tensor_extension import ArrowTensorArray
    from ray.rllib.utils.compression import pack

    table = tabular_table(eps)
    rows = table.num_rows
    obs = table.column("obs").combine_chunks().flatten().to_numpy().reshape(rows, 4).astype(np.float32)
    new_obs = table.column("new_obs").combine_chunks().flatten().to_numpy().reshape(rows, 4).astype(np.float32)
    cols = {
        "eps_id": table.column("eps_id"),
        "agent_id": table.column("agent_id"),
        "module_id": table.column("module_id"),
        "obs": pa.array([pack(o) for o in obs], pa.string()),
        "new_obs": pa.array([pack(o) for o in new_obs], pa.string()),
        "actions": table.column("actions").cast(pa.int32()),
        "rewards": table.column("rewards"),
        "terminateds": table.column("terminateds"),
        "truncateds": table.column("truncateds"),
        "action_logp": table.column("action_logp"),
        "action_dist_inputs": ArrowTensorArray.from_numpy(
            table.column("action_dist_inputs").combine_chunks().flatten().to_numpy().reshape(rows, 2)
        ),
        "weights_seq_no": pa.array(np.full(rows, 3, np.int64)),
    }
    t = pa.table(cols)
    d.mkdir(parents=True, exist_ok=True)
    pq.write_table(t, d / "run-000001-00001.parquet")
    pq.write_table(t, d / "run-000001-00002.parquet")


def test_rllib_compressed_columns_need_allow_pickle(tmp_path, capsys):
    eps = _episodes()
    for e in eps:
        e.extra_model_outputs["action_dist_inputs"] = np.random.default_rng(0).random((e.length, 2), np.float32)
    _rllib_recorder_style(eps, tmp_path / "in")
    out = tmp_path / "out"
    assert main(["convert", "--from", "tabular", str(tmp_path / "in"), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--allow-pickle" in err and "executes code" in err
    assert not (out / "_manifest").exists()

    assert (
        main(
            [
                "convert",
                "--from",
                "tabular",
                str(tmp_path / "in"),
                "--output",
                str(out),
                "--allow-pickle",
                "--env",
                "CartPole-v1",
                "--json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    # no t column: the complete second copy of every episode is recognised and dropped
    assert doc["episodes_written"] == 6 and doc["duplicate_rows_dropped"] == sum(e.length for e in eps)
    # module_id is null -> RLlib's default module id; weights_seq_no -> policy_version
    _assert_same(
        eps,
        _read_back(out),
        policy_id="default_policy",
        version=3,
        infos=False,
        extras=("action_logp", "action_dist_inputs"),
    )


def _write_sample_batches(eps, d, *, compress=()):
    """Old-stack JsonWriter output: episodes cut into fragments, spread over lines, one MultiAgentBatch."""
    from ray.rllib.offline.json_writer import JsonWriter
    from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

    w = JsonWriter(str(d), compress_columns=list(compress))
    for n, e in enumerate(eps):
        T = e.length
        for lo in range(0, T, 17):
            hi = min(T, lo + 17)
            b = SampleBatch(
                {
                    "obs": e.observations[0][lo:hi],
                    "new_obs": e.observations[0][lo + 1 : hi + 1],
                    "actions": e.actions[0][lo:hi],
                    "rewards": e.rewards[lo:hi],
                    "terminateds": np.array([e.terminated and i == T - 1 for i in range(lo, hi)]),
                    "truncateds": np.array([e.truncated and i == T - 1 for i in range(lo, hi)]),
                    "eps_id": np.full(hi - lo, 1000 + n),
                    "t": np.arange(lo, hi),
                    "agent_index": np.zeros(hi - lo, int),
                    "action_logp": e.extra_model_outputs["action_logp"][lo:hi],
                    "infos": np.array(e.infos[lo + 1 : hi + 1]),
                }
            )
            w.write(MultiAgentBatch({"expert": b}, hi - lo) if n == 0 else b)
    w.cur_file.close()


def test_sample_batch_round_trip(tmp_path, capsys):
    eps = _episodes()
    _write_sample_batches(eps, tmp_path / "in")
    # fragments written in reverse order of time: rebuilt from t
    f = next((tmp_path / "in").iterdir())
    lines = f.read_text().splitlines()
    f.write_text("\n".join(reversed(lines)) + "\n")
    out = tmp_path / "out"
    assert (
        main(
            [
                "convert",
                "--from",
                "sample-batch",
                str(tmp_path / "in"),
                "--output",
                str(out),
                "--env",
                "CartPole-v1",
                "--policy-version",
                "7",
                "--json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["episodes_written"] == 6 and sorted(doc["policies"]) == ["default_policy", "expert"]
    for e, n in zip(eps, range(len(eps))):
        e.episode_id = str(1000 + n)
    got = _read_back(out)
    first = eps[0]
    _assert_same([first], {first.episode_id: got.pop(first.episode_id)})  # the MultiAgentBatch's policy
    _assert_same(eps[1:], got, policy_id="default_policy")
    assert main(["inspect", str(out), "--verify"]) == 0


class _Boom:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['RLREC_TEST_MARKER']}",))


def test_pickled_sample_batch_columns_are_refused_without_running_them(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("RLREC_TEST_MARKER", str(marker))
    import lz4.frame

    evil = base64.b64encode(lz4.frame.compress(pickle.dumps(_Boom()))).decode()
    d = tmp_path / "evil"
    d.mkdir()
    (d / "x.json").write_text(
        json.dumps(
            {
                "type": "SampleBatch",
                "obs": evil,
                "new_obs": evil,
                "actions": [0],
                "rewards": [1.0],
                "terminateds": [True],
                "eps_id": [1],
            }
        )
        + "\n"
    )
    with pytest.raises(UnsafeInputError):
        convert(str(d), str(tmp_path / "o"), ConvertOptions(input_format="sample-batch"))
    assert not marker.exists()
    assert not (tmp_path / "o" / "_manifest").exists()


_VALID_BATCH = {
    "obs": [[0.0], [1.0]],
    "new_obs": [[1.0], [2.0]],
    "actions": [0, 1],
    "rewards": [1.0, 1.0],
    "terminateds": [False, True],
    "eps_id": [5, 5],
    "t": [0, 1],
}


@pytest.mark.parametrize(
    ("change", "options", "says"),
    [
        ({"new_obs": None}, {}, r"missing column\(s\) \['new_obs'\]"),
        ({"obs": [[0.0], [1.0, 2.0]]}, {}, "not a rectangular numeric array"),
        ({"terminateds": [True, True]}, {}, "rows after its terminal row"),
        ({"t": [0, 0], "rewards": [1.0, 2.0]}, {}, "two different rows for t=0"),
        ({"t": [0, 2]}, {}, "steps are missing after t=0"),
        ({"rewards": [1.0]}, {}, "has 1 rows, expected 2"),
        ({"obs": [["a"], ["b"]]}, {}, "expected numbers"),
        ({}, {"policy_id": "../up"}, "cannot name a directory"),
        ({"terminateds": [False, False]}, {"incomplete": "error"}, "has no terminal row"),
    ],
)
def test_an_invalid_sample_batch_is_refused_with_the_reason(tmp_path, change, options, says):
    rows = {k: v for k, v in {**_VALID_BATCH, **change}.items() if v is not None}
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x.json").write_text(json.dumps(rows) + "\n")
    with pytest.raises(ConvertError, match=says):
        convert(str(tmp_path / "in"), str(tmp_path / "o"), ConvertOptions(input_format="sample-batch", **options))
    assert not (tmp_path / "o" / "_manifest").exists()  # nothing is committed by a failed run


def test_unreadable_input_is_refused(tmp_path):
    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / "x.json").write_text("{not json\n")
    with pytest.raises(ConvertError, match="not JSON"):
        convert(str(tmp_path / "notjson"), str(tmp_path / "o"), ConvertOptions(input_format="sample-batch"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.parquet").write_bytes(b"PAR1 not parquet")
    with pytest.raises(ConvertError, match="cannot read"):
        convert(str(tmp_path / "junk"), str(tmp_path / "o"), ConvertOptions())
    with pytest.raises(ConvertError, match="does not exist"):
        convert(str(tmp_path / "nope"), str(tmp_path / "o"), ConvertOptions())
    assert not (tmp_path / "o" / "_manifest").exists()  # nothing is committed by a failed run


def _mapped_rows(tmp_path) -> tuple[str, dict]:
    """Input under other column names, and the schema naming them.  Episode a: terminated; b: no
    terminal row; c: row 1's obs is not row 0's new_obs (a row is missing)."""
    rows = {
        "observation": [[0.0], [1.0], [5.0], [6.0], [10.0], [20.0]],
        "next_observation": [[1.0], [2.0], [6.0], [7.0], [11.0], [21.0]],
        "action": [0, 1, 1, 0, 0, 0],
        "reward": [1.0, 1.0, 0.5, 0.5, 0.0, 0.0],
        "dones": [False, True, False, False, False, True],
        "episode": ["a", "a", "b", "b", "c", "c"],
    }
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x.jsonl").write_text(json.dumps(rows) + "\n")
    schema = {
        "obs": "observation",
        "new_obs": "next_observation",
        "actions": "action",
        "rewards": "reward",
        "eps_id": "episode",
    }
    return str(tmp_path / "in"), schema


def test_schema_mapping_drops_incomplete_and_discontinuous_episodes(tmp_path):
    src, schema = _mapped_rows(tmp_path)
    res = convert(src, str(tmp_path / "o1"), ConvertOptions(input_format="sample-batch", schema=schema))
    assert (res.written_episodes, res.incomplete_dropped, res.discontinuous) == (2, 1, 1)
    assert any("new_obs of the row before" in n for n in res.notes)


def test_schema_mapping_with_incomplete_truncate_keeps_an_episode_without_terminal_row(tmp_path):
    src, schema = _mapped_rows(tmp_path)
    res = convert(
        src,
        str(tmp_path / "o2"),
        ConvertOptions(input_format="sample-batch", schema=schema, incomplete="truncate"),
    )
    assert (res.written_episodes, res.incomplete_truncated) == (3, 1)
    got = _read_back(tmp_path / "o2")
    a, b = got["a"][1], got["b"][1]
    assert (a.is_terminated, a.is_truncated, b.is_terminated, b.is_truncated) == (True, False, False, True)
    np.testing.assert_array_equal(b.get_observations(slice(None)), np.array([[5.0], [6.0], [7.0]]))
    assert res.action_space == gym.spaces.Discrete(2)


# convert -> trainer -> report -> stock BC; which shards two short iterations reach depends on how
# Ray Data's read tasks are scheduled, so it runs with the machine to itself (system part)
@pytest.mark.system
@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # starts Ray
def test_trainer_and_stock_bc_train_on_converted_shards(tmp_path):
    """Our trainer (manifest-following) and stock, unmodified BC ({output}/{policy_id}) both train on a
    conversion; the report maps the trainer's real `new_shards` onto the converted shards."""
    import ray
    from ray.rllib.algorithms.bc import BCConfig

    from rlrec.report_data import collect
    from rlrec.trainer.service import ContinuousTrainer, TrainerConfig

    eps = expert_cartpole_episodes(12, seed=3, max_steps=100, policy_id="expert")
    _write_tabular(eps, tmp_path / "in")
    out, ck = tmp_path / "out", tmp_path / "ck"
    res = convert(str(tmp_path / "in"), str(out), ConvertOptions(policy_id="expert", episodes_per_shard=6))
    assert (res.written_episodes, res.shards) == (12, 2)
    ray.init(address="local", num_cpus=4, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    try:
        tr = ContinuousTrainer(
            TrainerConfig(
                input=str(out),
                checkpoint_dir=str(ck),
                algo="BC",
                promotion_gate="off",
                max_iterations=2,
                checkpoint_interval=2,
                progress=False,
                poll_interval_s=0.2,
                algo_config={"train_batch_size_per_learner": 128},
                offline_config={"dataset_num_iters_per_learner": 2},
            )
        )
        assert tr.run() == 0
        data = collect(None, input_uri=str(out), checkpoint_dir=str(ck))
        assert [r["iteration"] for r in data.trainer] == [1, 2]
        assert set(data.first_trained) == {e.path for e in data.shards}  # trained on both converted shards

        algo = (
            BCConfig()
            .environment(observation_space=ENV.observation_space, action_space=ENV.action_space)
            .offline_data(
                input_=[str(out / "expert")],
                input_read_episodes=True,
                map_batches_kwargs={"concurrency": 1},
                dataset_num_iters_per_learner=2,
            )
            .training(train_batch_size_per_learner=256)
        ).build()
        result = algo.train()
        assert np.isfinite(result["learners"]["default_policy"]["policy_loss"])
        assert result["learners"]["__all_modules__"]["num_env_steps_trained_lifetime"] > 0
        algo.offline_data.batch_iterators = None
        algo.stop()
        del algo, result
    finally:
        gc.collect()  # finalize Ray Data's iterators while Ray is still up (else they log at exit)
        ray.shutdown()


def _structured_episodes():
    """Dict observations (a 2x3 Box and a Discrete) and a Tuple action, two episodes."""
    from rlrec.store.finished import FinishedEpisode

    obs_space = gym.spaces.Dict({"img": gym.spaces.Box(0.0, 1.0, (2, 3), np.float32), "k": gym.spaces.Discrete(5)})
    act_space = gym.spaces.Tuple([gym.spaces.Discrete(3), gym.spaces.Box(-1.0, 1.0, (2,), np.float32)])
    rng = np.random.default_rng(0)
    out = []
    for n, T in enumerate((4, 6)):
        out.append(
            FinishedEpisode(
                episode_id=f"ep{n}",
                policy_id="p",
                policy_version=1,
                env_id="",
                observation_space=obs_space,
                action_space=act_space,
                observations=[rng.random((T + 1, 2, 3), dtype=np.float32), rng.integers(0, 5, T + 1)],
                actions=[rng.integers(0, 3, T), rng.uniform(-1, 1, (T, 2)).astype(np.float32)],
                rewards=rng.random(T),
                infos=[{}] * (T + 1),
                extra_model_outputs={},
                terminated=n == 0,
                truncated=n == 1,
                first_offset=0,
                last_offset=T,
                started_ms=0,
                ended_ms=0,
            )
        )
    return out


@pytest.mark.parametrize("multidim", ["nested", "tensor"])
def test_tabular_dict_and_tuple_spaces_round_trip(tmp_path, multidim):
    eps = _structured_episodes()
    (tmp_path / "in").mkdir()
    table = tabular_table(eps, multidim=multidim)
    pq.write_table(table.replace_schema_metadata({}), tmp_path / "in" / "x.parquet")  # no space metadata
    res = convert(str(tmp_path / "in"), str(tmp_path / "out"), ConvertOptions())
    # inferred from the struct columns: Dict/Tuple of Box (floats) and Discrete (integer scalars)
    assert isinstance(res.observation_space, gym.spaces.Dict) and list(res.observation_space) == ["img", "k"]
    assert res.observation_space["img"].shape == (2, 3) and res.observation_space["k"] == gym.spaces.Discrete(5)
    assert isinstance(res.action_space, gym.spaces.Tuple) and res.action_space[0] == gym.spaces.Discrete(3)
    got = _read_back(tmp_path / "out")
    for fe in eps:
        _, ep = got[fe.episode_id]
        obs = ep.get_observations(slice(None))
        np.testing.assert_array_equal(obs["img"], fe.observations[0])
        np.testing.assert_array_equal(obs["k"], fe.observations[1])
        acts = ep.get_actions(slice(None))
        np.testing.assert_array_equal(acts[0], fe.actions[0])
        np.testing.assert_array_equal(acts[1], fe.actions[1])
        assert (ep.is_terminated, ep.is_truncated) == (fe.terminated, fe.truncated)
        assert ep.custom_data["policy_id"] == "default_policy"


# Rules of `rows_to_episodes` the round trips do not pin down (see the module docstring).


def _rule_episodes(tmp_path, name: str, *batches: dict, **kw):
    from rlrec.consumer.convert import ConvertResult, read_rows, rows_to_episodes

    d = tmp_path / name
    d.mkdir()
    (d / "x.jsonl").write_text("".join(json.dumps(b) + "\n" for b in batches))
    opts = ConvertOptions(input_format="sample-batch", **kw)
    res = ConvertResult()
    out = rows_to_episodes(read_rows(str(d), opts)[0], opts, res)
    return {fe.episode_id: fe for fe in out}, res


#: no t column: one complete episode
_ONE = {
    "eps_id": [4, 4],
    "obs": [[0.0], [1.0]],
    "new_obs": [[1.0], [2.0]],
    "actions": [0, 1],
    "rewards": [1.0, 0.5],
    "terminateds": [False, True],
}


def test_offsets_are_input_positions_and_the_policy_comes_from_the_first_row_by_t(tmp_path):
    # "a" at input rows 1, 3, 4 (written out of order of t), "b" at rows 0, 2: offsets are input positions;
    # policy id = module_id, policy version = policy_version (not weights_seq_no) of the episode's first row by t
    rows = {
        "eps_id": ["b", "a", "b", "a", "a"],
        "t": [0, 2, 1, 0, 1],
        "obs": [[10.0], [2.0], [11.0], [0.0], [1.0]],
        "new_obs": [[11.0], [3.0], [12.0], [1.0], [2.0]],
        "actions": [0, 1, 0, 1, 0],
        "rewards": [1.0, 2.0, 3.0, 4.0, 5.0],
        "terminateds": [False, True, False, False, False],
        "truncateds": [False, False, True, False, False],
        "module_id": ["pb", "pa2", "pb2", "pa", "pa3"],
        "policy_version": [7, 9, 8, 5, 6],
        "weights_seq_no": [1, 1, 1, 1, 1],
    }
    got, res = _rule_episodes(tmp_path, "offsets", rows)
    a, b = got["a"], got["b"]
    assert (a.first_offset, a.last_offset, b.first_offset, b.last_offset) == (1, 4, 0, 2)
    assert (a.policy_id, a.policy_version, b.policy_id, b.policy_version) == ("pa", 5, "pb", 7)
    np.testing.assert_array_equal(a.observations[0], [[0.0], [1.0], [2.0], [3.0]])
    np.testing.assert_array_equal(a.rewards, [4.0, 5.0, 2.0])
    assert (a.terminated, a.truncated, b.terminated, b.truncated) == (True, False, False, True)
    assert a.infos == [{}] * 4 and res.discontinuous == 0
    got, _ = _rule_episodes(tmp_path, "override", rows, policy_id="p", policy_version=3)
    assert {(fe.policy_id, fe.policy_version) for fe in got.values()} == {("p", 3)}
    got, _ = _rule_episodes(tmp_path, "wsn", {k: v for k, v in rows.items() if k != "policy_version"})
    assert {fe.policy_version for fe in got.values()} == {1}


def test_identical_copies_of_an_episode_keep_one_and_differing_copies_are_refused(tmp_path):
    got, res = _rule_episodes(tmp_path, "copies", _ONE, _ONE, _ONE)
    assert res.duplicate_rows == 4 and len(got["4"].rewards) == 2
    assert (got["4"].first_offset, got["4"].last_offset) == (0, 1)
    with pytest.raises(ConvertError, match="rows after its terminal row"):
        _rule_episodes(tmp_path, "differ", _ONE, dict(_ONE, rewards=[1.0, 0.0]))


def test_integer_arrays_infer_a_box_over_the_dtype_and_bool_arrays_multibinary(tmp_path):
    ints = dict(_ONE, obs=[[0, 1], [1, 2]], new_obs=[[1, 2], [2, 3]], actions=[[True, False], [False, True]])
    _, res = _rule_episodes(tmp_path, "spaces", ints)
    info = np.iinfo(res.observation_space.dtype)
    assert res.observation_space.dtype.kind == "i" and res.observation_space.shape == (2,)
    assert (res.observation_space.low.min(), res.observation_space.high.max()) == (info.min, info.max)
    assert res.action_space == gym.spaces.MultiBinary([2])


def test_an_episode_of_two_agents_is_refused(tmp_path):
    with pytest.raises(ConvertError, match="multi-agent recordings are not supported"):
        _rule_episodes(tmp_path, "multi", dict(_ONE, agent_id=["agent0", "agent1"]))


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"schema": {"observations": "obs"}}, "unknown key 'observations'"),
        ({"schema": {"obs": " "}}, "give the input's column"),
        ({"episodes_per_shard": 0}, "at least 1"),
        ({"incomplete": "keep"}, "--incomplete must be one of drop, truncate, error"),
    ],
)
def test_convert_options_refuse_what_no_conversion_can_use(options, says):
    with pytest.raises(ValueError, match=says):
        ConvertOptions(**options)
