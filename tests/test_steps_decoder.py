"""The column-wise steps decoder (`rlrec.store.episode_arrays`): `Snapshot.steps` and the
evaluator read episode shards into arrays without building `SingleAgentEpisode`s, and give the
rows the object path gives, on both shard formats; readers of steps work without Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import gymnasium as gym
import msgpack
import msgpack_numpy as mnp
import numpy as np
import pyarrow as pa
import pytest

import rlrec
from rlrec.store.commit import ShardCommitter
from rlrec.store.episode_arrays import decode_episode, decode_items
from rlrec.store.episodes import EpisodeDecodeError, pack_episode, to_single_agent_episode, unpack_episode
from rlrec.store.schema_gate import open_shard
from rlrec.store.shards import encode_shard
from rlrec.store.snapshot import STEP_COLUMNS, gated_steps
from rlrec.trainer.synthetic import expert_cartpole_episodes
from tests.test_episodes import CASES, cartpole_case, dict_case
from tests.test_shards import dict_episodes

ENTRY = SimpleNamespace(policy_id="pol", path="x")


def _object_path_columns(episodes: list) -> dict[str, pa.Array]:
    """The step columns of `SingleAgentEpisode`s, episode by episode: the object path's code."""
    from rlrec.store.shards import _column as space_column
    from rlrec.store.steps_table import _leaves

    ep0 = episodes[0]
    obs = [_leaves(ep.observation_space, ep.get_observations()) for ep in episodes]
    acts = [_leaves(ep.action_space, ep.get_actions()) for ep in episodes]
    lengths = np.array([len(ep) for ep in episodes], dtype=np.int64)
    last = np.zeros(int(lengths.sum()), dtype=bool)
    last[np.cumsum(lengths) - 1] = True
    logps = []
    for ep, n in zip(episodes, lengths):
        if "action_logp" in ep.extra_model_outputs:
            logps.append(pa.array(np.asarray(ep.get_extra_model_outputs("action_logp"), dtype=np.float64).reshape(n)))
        else:
            logps.append(pa.nulls(int(n), pa.float64()))
    return {
        "episode_id": pa.array(np.repeat(np.array([ep.id_ for ep in episodes], dtype=object), lengths), pa.string()),
        "t": pa.array(np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])),
        "observation": space_column(ep0.observation_space, [[x[:-1] for x in o] for o in obs], "nested"),
        "action": space_column(ep0.action_space, acts, "nested"),
        "reward": pa.array(np.concatenate([np.asarray(ep.get_rewards(), dtype=np.float64) for ep in episodes])),
        "terminated": pa.array(np.repeat(np.array([bool(ep.is_terminated) for ep in episodes]), lengths) & last),
        "truncated": pa.array(np.repeat(np.array([bool(ep.is_truncated) for ep in episodes]), lengths) & last),
        "action_logp": pa.concat_arrays(logps),
        "next_observation": space_column(ep0.observation_space, [[x[1:] for x in o] for o in obs], "nested"),
    }


def object_path_steps(shard_bytes: bytes) -> pa.Table:
    """The steps of an episode shard through `SingleAgentEpisode`s (`unpack_episode`), episode by
    episode: the object path `gated_steps` took before the column-wise decoder."""
    table = open_shard(shard_bytes, fmt="episodes").read(["item", "policy_version"])
    episodes = [unpack_episode(v) for v in table.column("item").to_pylist()]
    cols = _object_path_columns(episodes)
    versions = np.asarray(table.column("policy_version").to_numpy(), dtype=np.int64)
    cols["policy_version"] = pa.array(np.repeat(versions, [len(ep) for ep in episodes]))
    cols["policy_id"] = pa.array([ENTRY.policy_id] * len(cols["episode_id"]), pa.string())
    return pa.table({k: cols[k] for k in STEP_COLUMNS})


def _sets():
    return {
        "cartpole-logp": expert_cartpole_episodes(5, epsilon=0.2, max_steps=60),
        "cartpole-no-logp": expert_cartpole_episodes(3, max_steps=30, with_logp=False),
        "some-logp": expert_cartpole_episodes(2, seed=1, max_steps=25)
        + expert_cartpole_episodes(2, seed=2, max_steps=25, with_logp=False),
        "dict-tuple": dict_episodes(4, T=6),
        "extras": [cartpole_case(True)[0], cartpole_case(False, seed=3)[0]],
        "nested-action": [dict_case(True)[0]],
    }


@pytest.mark.parametrize("name", list(_sets()))
def test_decoder_rows_equal_the_object_path_on_both_formats(name):
    """Same rows, same Arrow types: episode shards through the new decoder and through
    `SingleAgentEpisode`s, and the tabular shard of the same episodes."""
    episodes = _sets()[name]
    shard = encode_shard(episodes, fmt="episodes").data
    new = gated_steps(open_shard(shard), ENTRY)
    old = object_path_steps(shard)
    assert new.schema == old.schema
    assert new.equals(old)
    assert new.num_rows == sum(fe.length for fe in episodes)
    if name != "nested-action":  # a tabular shard holds no Tuple actions with Box leaves as RLlib names them
        tabular = gated_steps(open_shard(encode_shard(episodes, fmt="tabular").data), ENTRY)
        assert tabular.equals(new)


def test_decoder_reads_rllib_list_form_episodes_like_unpack_episode():
    """RLlib's own recorder writes list-form episodes (one value per step): the decoder stacks
    them to the arrays the numpy form holds."""
    for make in CASES.values():
        fe, ref = make()
        numpy_form = decode_episode(pack_episode(ref))
        from ray.rllib.env.single_agent_episode import SingleAgentEpisode

        listy = SingleAgentEpisode(id_=ref.id_, observation_space=ref.observation_space, action_space=ref.action_space)
        # rebuild in list form from the per-step values RLlib gives back
        obs = [ref.get_observations(i) for i in range(len(ref) + 1)]
        listy.add_env_reset(obs[0], {})
        for t in range(len(ref)):
            listy.add_env_step(
                obs[t + 1],
                ref.get_actions(t),
                float(ref.get_rewards(t)),
                {},
                terminated=ref.is_terminated and t == len(ref) - 1,
                truncated=ref.is_truncated and t == len(ref) - 1,
                extra_model_outputs={k: ref.get_extra_model_outputs(k, t) for k in ref.extra_model_outputs},
            )
        assert not listy.is_numpy
        packed = msgpack.packb(listy.get_state(), default=mnp.encode)
        list_form = decode_episode(packed)
        if isinstance(ref.action_space, gym.spaces.Tuple):  # each step's Tuple action back as a tuple
            assert all(isinstance(a, tuple) for a in unpack_episode(packed).get_actions())
        for a, b in ((numpy_form.observations, list_form.observations), (numpy_form.actions, list_form.actions)):
            np.testing.assert_equal(a, b)
        np.testing.assert_array_equal(numpy_form.rewards, np.asarray(list_form.rewards, np.float64))
        assert len(list_form) == len(numpy_form) == fe.length
        assert (list_form.is_terminated, list_form.is_truncated) == (fe.terminated, fe.truncated)


def test_decoder_arrays_equal_unpack_episode():
    for make in CASES.values():
        fe, _ = make()
        data = pack_episode(to_single_agent_episode(fe))
        ep, arrays = unpack_episode(data), decode_episode(data)
        assert arrays.id_ == ep.id_ and len(arrays) == len(ep) and arrays.is_done
        np.testing.assert_equal(arrays.get_observations(), ep.get_observations())
        np.testing.assert_equal(arrays.get_actions(), ep.get_actions())
        np.testing.assert_array_equal(arrays.get_rewards(), ep.get_rewards())
        assert set(arrays.extra_model_outputs) == set(ep.extra_model_outputs)
        for k in arrays.extra_model_outputs:
            np.testing.assert_array_equal(arrays.get_extra_model_outputs(k), ep.get_extra_model_outputs(k))
        assert arrays.custom_data == ep.custom_data
        assert arrays.observation_space == ep.observation_space and arrays.action_space == ep.action_space


def test_decoder_refuses_inconsistent_and_non_numeric_buffers():
    fe, ref = cartpole_case(True)
    for change in (
        lambda s: s["rewards"].update(data=s["rewards"]["data"][:-1]),
        lambda s: s["infos"].update(data=s["infos"]["data"][:-1]),
        lambda s: s["extra_model_outputs"]["action_logp"].update(
            data=s["extra_model_outputs"]["action_logp"]["data"][:-1]
        ),
        lambda s: s.update(t=s["t"] + 1),
        lambda s: s["observations"].update(data="not an array"),
        lambda s: s["actions"].update(data=[{"a": 1}] * len(ref)),
        lambda s: s["infos"].update(data=7),
    ):
        state = to_single_agent_episode(fe).get_state()
        change(state)
        data = msgpack.packb(state, default=mnp.encode)
        with pytest.raises(EpisodeDecodeError):
            decode_episode(data)
    with pytest.raises(EpisodeDecodeError, match="NoneType"):
        decode_items(pa.array([None, pack_episode(ref)], pa.binary()))


def test_decode_items_reads_sliced_and_chunked_columns():
    episodes = expert_cartpole_episodes(4, max_steps=20)
    items = pa.array([pack_episode(to_single_agent_episode(fe)) for fe in episodes], pa.binary())
    chunked = pa.chunked_array([items.slice(0, 1), items.slice(1, 3)])
    assert [e.id_ for e in decode_items(chunked)] == [fe.episode_id for fe in episodes]
    assert [e.id_ for e in decode_items(items.slice(2))] == [fe.episode_id for fe in episodes[2:]]
    large = items.cast(pa.large_binary())
    assert [len(e) for e in decode_items(large)] == [fe.length for fe in episodes]


def test_to_pandas_arrow_backed_keeps_arrow_types(tmp_path):
    pd = pytest.importorskip("pandas")
    root = str(tmp_path / "out")
    ShardCommitter(root).commit(expert_cartpole_episodes(3, max_steps=20))
    snap = rlrec.open(root)
    plain, arrow = snap.to_pandas(), snap.to_pandas(arrow_backed=True)
    assert isinstance(plain["observation"].iloc[0], np.ndarray)
    assert all(isinstance(t, pd.ArrowDtype) for t in arrow.dtypes)
    assert pa.Table.from_pandas(arrow, preserve_index=False).equals(snap.steps())
    np.testing.assert_array_equal(arrow["reward"].to_numpy(), plain["reward"].to_numpy())
    assert arrow.equals(snap.to_pandas(types_mapper=pd.ArrowDtype))


def test_reading_steps_and_evaluating_data_need_no_ray(tmp_path):
    """Steps, pandas, polars, torch and the evaluator's held-out reader with Ray unimportable."""
    root = str(tmp_path / "out")
    ShardCommitter(root).commit(expert_cartpole_episodes(6, max_steps=40))
    code = textwrap.dedent(
        f"""
        import sys

        class NoRay:
            def find_spec(self, name, path=None, target=None):
                if name == "ray" or name.startswith("ray."):
                    raise ImportError("ray is blocked in this test")

        sys.meta_path.insert(0, NoRay())
        import rlrec
        from rlrec.trainer.ope_data import HeldOutReader

        snap = rlrec.open({root!r})
        assert snap.steps().num_rows == snap.num_steps > 0
        assert len(snap.to_pandas(arrow_backed=True)) == snap.num_steps
        batches = iter(snap.to_torch())
        assert next(batches)["observation"].shape == (4,)
        batches.close()  # stops its read-ahead threads before the interpreter exits
        eps = HeldOutReader({root!r}, 1.0).refresh()
        assert len(eps) == 6 and eps[0].behavior_logp is not None
        assert not any(m == "ray" or m.startswith("ray.") for m in sys.modules)
        print("ok", flush=True)
        # what this test checks ends here: skip the interpreter's teardown, where a process that
        # imported torch and read through pyarrow aborts now and then ("terminate called without an
        # active exception": a native thread pool destroyed during static destruction, no Python
        # frame; 2-4 in 40 runs under load, none without torch) -- see docs/TOOLS.md
        import os
        os._exit(0)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_reading_ahead_keeps_order_errors_and_stops_with_the_reader(tmp_path, monkeypatch):
    """iter_steps fetches shards ahead in threads: tables come in the snapshot's order, the first
    refused shard in that order is the error, and a reader that stops leaves nothing running."""
    from rlrec.store import snapshot as snapshot_module
    from rlrec.store.schema_gate import ShardSchemaError
    from rlrec.store.storage import Storage

    monkeypatch.setattr(snapshot_module, "READ_AHEAD_SHARDS", 2)
    root = str(tmp_path / "out")
    c = ShardCommitter(root)
    for seed in range(6):
        c.commit(expert_cartpole_episodes(2, seed=seed, max_steps=15))
    snap = rlrec.open(root)
    whole = [t.column("episode_id").to_pylist() for t in snap.iter_steps()]
    assert whole == [snap.shard_steps(e).column("episode_id").to_pylist() for e in snap.entries]
    it = snap.iter_steps()
    next(it)
    assert snap._ahead  # fetched ahead
    it.close()
    assert not snap._ahead
    storage = Storage.from_uri(root)
    for e in snap.entries[2:]:  # the third and every later shard changed after its commit
        storage.write(e.path, storage.read(e.path) + b"x")
    with pytest.raises(ShardSchemaError, match=snap.entries[2].path.split("/")[-1].replace("+", r"\+")):
        rlrec.open(root).steps()


def test_the_evaluator_gets_the_same_episodes_and_reasons_from_arrays():
    """What the held-out reader makes of an episode (`episode_from_rllib`: observations,
    propensities, the behaviour's probabilities from `action_dist_inputs`) and why one is unusable
    (`unusable_reason`) are the same from arrays as from `SingleAgentEpisode`s."""
    from rlrec.trainer.episode_check import unusable_reason
    from rlrec.trainer.ope_data import episode_from_rllib

    cases = [make()[0] for make in CASES.values()]
    fe, _ = cartpole_case(True, seed=5)
    fe.actions = [np.full_like(fe.actions[0], 7)]  # outside Discrete(2)
    cases.append(fe)
    for fe in cases:
        data = pack_episode(to_single_agent_episode(fe))
        ep, arrays = unpack_episode(data), decode_episode(data)
        for spaces in ((None, None), (ep.observation_space, ep.action_space), (gym.spaces.Box(-1, 1, (3,)), None)):
            assert unusable_reason(arrays, *spaces) == unusable_reason(ep, *spaces)
        if isinstance(ep.observation_space, gym.spaces.Box):
            a, b = episode_from_rllib(arrays), episode_from_rllib(ep)
            for field in ("obs", "actions", "rewards", "behavior_logp", "behavior_probs"):
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
            assert (a.id, a.terminated, a.policy_version) == (b.id, b.terminated, b.policy_version)
    assert unusable_reason(decode_episode(data), ep.observation_space, ep.action_space)  # the action 7
    assert (
        episode_from_rllib(decode_episode(pack_episode(to_single_agent_episode(cases[0])))).behavior_probs is not None
    )


# ----------------------------------------------------------------- hostile items cost one episode


def _raw_state(fe) -> dict:
    """A packed episode's state as plain msgpack values (arrays as msgpack-numpy maps), to mutate."""
    return msgpack.unpackb(pack_episode(to_single_agent_episode(fe)), strict_map_key=False)


def _deep(levels: int) -> object:
    d: object = [1.0]
    for _ in range(levels):
        d = {"a": d}
    return d


def _deep_items() -> dict[str, bytes]:
    """Valid CartPole episodes but for one buffer's data: a map nested 505 deep (within
    msgpack.packb's own limit of 512, so a stock packer writes it)."""
    fe = expert_cartpole_episodes(1, max_steps=5)[0]
    out = {}
    s = _raw_state(fe)
    s["observations"] = dict(s["observations"], data=_deep(505), lookback=1)
    out["observations"] = msgpack.packb(s)
    s = _raw_state(fe)
    s["infos"] = dict(s["infos"], data=_deep(505))
    out["infos"] = msgpack.packb(s)
    s = _raw_state(fe)
    s["extra_model_outputs"] = {"action_logp": dict(s["extra_model_outputs"]["action_logp"], data=_deep(505))}
    out["extra_model_outputs"] = msgpack.packb(s)
    return out


def _huge_empty_item() -> bytes:
    """A zero-step episode whose declared observation space numpy cannot shape (MultiBinary
    2**40 x 2**40): costs nothing to decode, but ``np.zeros((0, *shape))`` raises ValueError."""
    s = _raw_state(expert_cartpole_episodes(1, max_steps=5)[0])
    space = {"space": "multi-binary", "n": [2**40, 2**40]}
    s["_observation_space"] = space
    s["observations"].update(data=[], space=space, lookback=0)
    s["infos"].update(data=[], lookback=0)
    s["actions"].update(data=[], lookback=0)
    s["rewards"].update(data=[], lookback=0)
    s["extra_model_outputs"] = None
    s.update(t=0, t_started=0)
    return msgpack.packb(s)


@pytest.mark.parametrize("where", ["observations", "infos", "extra_model_outputs"])
def test_deeply_nested_buffer_data_is_one_undecodable_episode(where):
    with pytest.raises(EpisodeDecodeError):
        decode_episode(_deep_items()[where])


def test_a_declared_shape_numpy_cannot_hold_is_one_undecodable_episode():
    with pytest.raises(EpisodeDecodeError):
        decode_episode(_huge_empty_item())


def test_decode_failures_other_than_refusals_are_episode_decode_errors(monkeypatch):
    import rlrec.store.episode_arrays as ea

    def boom(*a, **k):
        raise MemoryError("out of memory")

    monkeypatch.setattr(ea, "_stacked", boom)
    with pytest.raises(EpisodeDecodeError, match="MemoryError"):
        decode_episode(pack_episode(to_single_agent_episode(expert_cartpole_episodes(1, max_steps=5)[0])))


def _store_with(root: str, hostile: bytes) -> None:
    """Two shards of 5 episodes: the first with its last item replaced by `hostile`."""
    import dataclasses
    import hashlib
    import io

    import pyarrow.parquet as pq

    import rlrec.store.commit as C

    real = C.encode_shard
    state = {"swap": True}

    def patched(eps, **kw):
        shard = real(eps, **kw)
        if not state["swap"]:
            return shard
        t = pq.read_table(io.BytesIO(bytes(shard.data)))
        items = t.column("item").to_pylist()
        items[-1] = hostile
        t = t.set_column(t.schema.get_field_index("item"), t.schema.field("item"), pa.array(items, pa.binary()))
        buf = io.BytesIO()
        pq.write_table(t, buf, compression="zstd")
        data = buf.getvalue()
        return dataclasses.replace(shard, data=data, sha256=hashlib.sha256(data).hexdigest())

    C.encode_shard = patched
    try:
        committer = C.ShardCommitter(root)
        committer.commit(expert_cartpole_episodes(5, seed=1, max_steps=20))
        state["swap"] = False
        committer.commit(expert_cartpole_episodes(5, seed=2, max_steps=20))
    finally:
        C.encode_shard = real


@pytest.mark.parametrize("case", ["deep", "huge_empty"])
def test_a_hostile_item_costs_the_evaluator_one_episode_not_its_shard(tmp_path, case):
    from rlrec.trainer.ope_data import HeldOutReader

    root = str(tmp_path / "store")
    _store_with(root, _deep_items()["observations"] if case == "deep" else _huge_empty_item())
    reader = HeldOutReader(root, 1.0)
    for _ in range(2):  # a later refresh neither fails nor reads the shard again
        episodes = reader.refresh()
        assert len(episodes) == 9
        assert reader.stats.episodes_held_out == len(episodes)
        assert reader.stats.episodes_unusable == 1 and reader.stats.shards_skipped == []
    # the steps readers refuse the shard by name (as unpack_episode's readers do)
    with pytest.raises(EpisodeDecodeError, match=r"\.parquet"):
        rlrec.open(root).steps()


def test_the_evaluators_counts_are_of_the_episodes_it_returns(tmp_path, monkeypatch):
    """A shard refused after some of its episodes were read adds nothing to the stats (the
    reader reads a refused shard twice, so the third episode of each read fails)."""
    import rlrec.trainer.ope_data as od

    root = str(tmp_path / "store")
    ShardCommitter(root).commit(expert_cartpole_episodes(4, max_steps=20))
    calls = {"n": 0}
    real = od.episode_from_rllib

    def fails_on_the_third(ep, *args):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise ValueError("boom")
        return real(ep, *args)

    monkeypatch.setattr(od, "episode_from_rllib", fails_on_the_third)
    reader = od.HeldOutReader(root, 1.0)
    assert reader.refresh() == []
    assert len(reader.stats.shards_skipped) == 1
    assert reader.stats.episodes_held_out == 0 and reader.stats.episodes_seen == 0


def _read_threads(monkeypatch) -> list[str]:
    from rlrec.store.schema_gate import GatedShard

    names: list[str] = []
    real = GatedShard.read

    def read(self, columns=None):
        import threading

        names.append(threading.current_thread().name)
        return real(self, columns)

    monkeypatch.setattr(GatedShard, "read", read)
    return names


def test_read_ahead_is_budgeted_by_what_shards_decode_to(tmp_path, monkeypatch):
    import rlrec.store.snapshot_reader as snapshot_mod

    root = str(tmp_path / "store")
    committer = ShardCommitter(root)
    for seed in range(4):
        committer.commit(expert_cartpole_episodes(2, seed=seed, max_steps=20))
    expected = rlrec.open(root).steps()
    names = _read_threads(monkeypatch)
    assert rlrec.open(root).steps().equals(expected)
    assert any(n.startswith("rlrec-read-ahead") for n in names)  # read ahead within the budget
    names.clear()
    # a budget smaller than one shard decodes to: nothing is read ahead, whatever the file sizes
    monkeypatch.setattr(snapshot_mod, "READ_AHEAD_DECODED_BYTES", 1, raising=False)
    assert rlrec.open(root).steps().equals(expected)
    assert len(names) == 4 and not any(n.startswith("rlrec-read-ahead") for n in names)


@pytest.mark.parametrize("path", ["joined", "written once", "past int32 offsets"])
@pytest.mark.parametrize(
    ("values", "counts"),
    [(["é", "", "xyz"], [0, 3, 2]), ([], []), (["pol"], [4]), ([""], [3]), (["x"], [0]), (["a", "bc"], [1, 1])],
)
def test_repeated_strings_equal_a_python_list_of_the_rows(values, counts, path, monkeypatch):
    """The id columns built from buffers hold what a Python list of every row's string gives, on
    each of the builder's paths (the limits lowered to take the larger columns' paths)."""
    from rlrec.store import steps_table

    if path == "written once":
        monkeypatch.setattr(steps_table, "_JOINED_BYTES", 0)
    elif path == "past int32 offsets":
        monkeypatch.setattr(steps_table, "_MAX_STRING_BYTES", 0)
    col = steps_table.repeated_strings(values, np.array(counts, dtype=np.int64))
    col.validate(full=True)
    expected = pa.array([v for v, c in zip(values, counts) for _ in range(c)], pa.string())
    assert col.type == pa.string() and col.equals(expected)
