"""rlrec.store.finished / rlrec.store.episodes: building RLlib episodes, packing, safe unpacking.

No broker and no Ray cluster: only `ray.rllib`'s SingleAgentEpisode (imported in-process).

Reference: for every case, RLlib builds the episode itself (`add_env_reset` / `add_env_step` on
per-step structures, then `to_numpy()`), and ours must equal it field by field. The only fields
excluded are RLlib's wall-clock timers `_start_time` / `_last_step_time` (`time.perf_counter()`
of the building process): RLlib sets them, we leave them None.
"""

from __future__ import annotations

import base64
import dataclasses
import inspect
import io
import pickle
import zlib
from collections import OrderedDict

import gymnasium as gym
import msgpack
import msgpack_numpy as mnp
import numpy as np
import pytest

from rlrec.producer.spaces import flatten_value, space_from_json, space_leaves, space_to_json
from rlrec.store.episode_arrays import decode_episode
from rlrec.store.episodes import (
    EpisodeDecodeError,
    UnsafeEpisodeError,
    finished_episode_state,
    pack_episode,
    pack_finished_episodes,
    to_single_agent_episode,
    unpack_episode,
)
from rlrec.store.finished import FinishedEpisode

SingleAgentEpisode = pytest.importorskip("ray.rllib.env.single_agent_episode").SingleAgentEpisode

TIMER_FIELDS = ("_start_time", "_last_step_time")


# ---------------------------------------------------------------------------------------------
# data


def _leaves(space: gym.Space, values: list) -> list[np.ndarray]:
    """Per-step values -> stacked leaves (what the assembler produces from events)."""
    if not values:
        return [np.zeros((0, *leaf.shape), dtype=leaf.dtype) for leaf in space_leaves(space)]
    per_step = [flatten_value(space, v) for v in values]
    return [
        np.stack([np.asarray(s[i], dtype=leaf.dtype) for s in per_step]).reshape(len(values), *leaf.shape)
        for i, leaf in enumerate(space_leaves(space))
    ]


def make_case(obs_space, act_space, obs, actions, rewards, infos, extras, terminated, truncated, eid="ep-1"):
    """(FinishedEpisode, RLlib's own numpy episode) for the same per-step data."""
    fe = FinishedEpisode(
        episode_id=eid,
        policy_id="pol-a",
        policy_version=3,
        env_id="Env-v0",
        observation_space=obs_space,
        action_space=act_space,
        observations=_leaves(obs_space, obs),
        actions=_leaves(act_space, actions),
        rewards=np.asarray(rewards, dtype=np.float64),
        infos=infos,
        extra_model_outputs={k: np.asarray(v) for k, v in extras.items()},
        terminated=terminated,
        truncated=truncated,
        first_offset=10,
        last_offset=20,
        started_ms=1000,
        ended_ms=2000,
        finished_at=3.0,
    )
    ref = SingleAgentEpisode(id_=eid, observation_space=obs_space, action_space=act_space)
    ref.add_env_reset(obs[0], infos[0])
    for t in range(len(actions)):
        ref.add_env_step(
            obs[t + 1],
            actions[t],
            rewards[t],
            infos[t + 1],
            terminated=terminated and t == len(actions) - 1,
            truncated=truncated and t == len(actions) - 1,
            extra_model_outputs={k: v[t] for k, v in extras.items()} if extras else None,
        )
    if not actions:  # an aborted episode without steps
        ref.is_terminated, ref.is_truncated = terminated, truncated
    ref.to_numpy()
    ref.custom_data.update({"policy_id": "pol-a", "policy_version": 3, "env_id": "Env-v0"})
    return fe, ref


def cartpole_case(terminated: bool, seed: int = 0):
    """A real CartPole-v1 rollout: terminated (bad controller) or truncated (time limit 40)."""
    env = gym.make("CartPole-v1", max_episode_steps=None if terminated else 40)
    o, info = env.reset(seed=seed)
    obs, acts, rews, infos, logits = [o], [], [], [info], []
    while True:
        a = 0 if terminated else int(o[2] + 0.5 * o[3] > 0)
        z = float(o[2] + 0.5 * o[3])
        o, r, term, trunc, info = env.step(a)
        obs.append(o)
        acts.append(a)
        rews.append(r)
        infos.append(info)
        logits.append([-z, z])
        if term or trunc:
            break
    assert (term, trunc) == (terminated, not terminated)
    extras = {
        "action_dist_inputs": np.asarray(logits, dtype=np.float32),
        "action_logp": np.full(len(acts), -0.5, dtype=np.float32),
    }
    return make_case(
        env.observation_space,
        env.action_space,
        obs,
        acts,
        rews,
        infos,
        extras,
        term,
        trunc,
        eid=f"cartpole-{seed}-{terminated}",
    )


def dict_space() -> gym.spaces.Dict:
    # keys deliberately not sorted: the producer keeps the sender's order
    sp = gym.spaces.Dict(
        OrderedDict(
            [
                ("pos", gym.spaces.Box(-1.0, 1.0, (2,), np.float32)),
                ("kind", gym.spaces.Discrete(3)),
                ("aux", gym.spaces.Tuple([gym.spaces.MultiBinary(3), gym.spaces.Box(0.0, 1.0, (2, 2), np.float64)])),
                ("md", gym.spaces.MultiDiscrete([3, 4])),
            ]
        )
    )
    return space_from_json(space_to_json(sp))  # as the consumer sees it (decoded from events)


def dict_case(terminated: bool, T: int = 7, seed: int = 1):
    osp = dict_space()
    asp = space_from_json(
        space_to_json(gym.spaces.Tuple([gym.spaces.Discrete(3), gym.spaces.Box(-2, 2, (2,), np.float32)]))
    )
    osp.seed(seed)
    asp.seed(seed)
    obs = [osp.sample() for _ in range(T + 1)]
    acts = [asp.sample() for _ in range(T)]
    infos = [{"reset": True, "arr": np.arange(3, dtype=np.int32)}] + [{"t": t} if t % 2 else {} for t in range(T)]
    extras = {"vf_preds": np.linspace(0, 1, T).astype(np.float32), "state_out": np.ones((T, 2, 3), np.float32)}
    return make_case(
        osp,
        asp,
        obs,
        acts,
        [0.5 * t for t in range(T)],
        infos,
        extras,
        terminated,
        not terminated,
        eid=f"dict-{terminated}",
    )


CASES = {
    "cartpole-terminated": lambda: cartpole_case(True),
    "cartpole-truncated": lambda: cartpole_case(False),
    "dict-terminated": lambda: dict_case(True),
    "dict-truncated": lambda: dict_case(False),
}


# ---------------------------------------------------------------------------------------------
# comparison helpers


def assert_same(a, b, path="") -> None:
    """Recursive equality: same container types, dict key order, dtypes, shapes and values."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), (path, type(a), type(b))
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, a.shape, b.dtype, b.shape)
        assert np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b) if isinstance(b, dict) else b)
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (path, type(a), type(b))
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, np.generic) or isinstance(b, np.generic):
        assert type(a) is type(b) and a == b, (path, a, b)
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


def assert_episodes_equal(ours, ref, *, tuples_as_lists=False) -> None:
    assert isinstance(ours, SingleAgentEpisode)
    assert ours.id_ == ref.id_
    assert (ours.agent_id, ours.module_id, ours.multi_agent_episode_id) == (
        ref.agent_id,
        ref.module_id,
        ref.multi_agent_episode_id,
    )
    assert ours.is_numpy == ref.is_numpy
    for name in ("observations", "actions", "rewards", "infos"):
        x, y = getattr(ours, name), getattr(ref, name)
        assert_same(x.data, y.data, name)
        assert (x.lookback, x.finalized) == (y.lookback, y.finalized), name
        assert x.space == y.space, name
    assert list(ours.extra_model_outputs) == list(ref.extra_model_outputs)
    for k, y in ref.extra_model_outputs.items():
        x = ours.extra_model_outputs[k]
        assert_same(x.data, y.data, k)
        assert (x.lookback, x.finalized, x.space) == (y.lookback, y.finalized, y.space), k
    assert (ours.is_terminated, ours.is_truncated) == (ref.is_terminated, ref.is_truncated)
    assert (ours.t_started, ours.t, len(ours)) == (ref.t_started, ref.t, len(ref))
    assert ours.observation_space == ref.observation_space
    assert ours.action_space == ref.action_space
    assert ours.custom_data == ref.custom_data
    # and the whole serialisable state, minus the wall-clock timers
    s1, s2 = ours.get_state(), ref.get_state()
    assert set(s1) == set(s2)
    for k in s1:
        if k not in TIMER_FIELDS:
            assert_same(s1[k], s2[k], k)


# ---------------------------------------------------------------------------------------------
# FinishedEpisode


def test_finished_episode_properties():
    fe, _ = cartpole_case(False)
    assert fe.length == 40 == len(fe.actions[0]) == len(fe.observations[0]) - 1
    assert fe.episode_return == pytest.approx(40.0)
    arrays = (
        fe.observations[0].nbytes
        + fe.actions[0].nbytes
        + fe.rewards.nbytes
        + sum(v.nbytes for v in fe.extra_model_outputs.values())
    )
    assert arrays < fe.nbytes() < arrays + 2048
    assert fe.finished_at == 3.0


# ---------------------------------------------------------------------------------------------
# building equals RLlib's own


@pytest.mark.parametrize("case", list(CASES))
def test_episode_equals_rllib_built(case):
    fe, ref = CASES[case]()
    ep = to_single_agent_episode(fe)
    assert_episodes_equal(ep, ref)
    # the only fields that differ: RLlib's perf_counter timers
    assert ref._start_time is not None and ref._last_step_time is not None
    assert ep._start_time is None and ep._last_step_time is None
    assert ep.get_duration_s() == 0.0
    # a few spot checks in plain terms
    assert ep.is_done and ep.is_terminated == fe.terminated and ep.is_truncated == fe.truncated
    assert len(ep) == fe.length and len(ep.get_infos()) == fe.length + 1
    assert ep.custom_data == {"policy_id": "pol-a", "policy_version": 3, "env_id": "Env-v0"}


def test_dict_space_layout():
    fe, _ = dict_case(True)
    ep = to_single_agent_episode(fe)
    obs = ep.observations.data
    assert list(obs) == ["pos", "kind", "aux", "md"]
    assert isinstance(obs["aux"], tuple) and obs["aux"][1].shape == (fe.length + 1, 2, 2)
    one = ep.get_observations(2)
    assert list(one) == ["pos", "kind", "aux", "md"] and one["pos"].shape == (2,)
    assert isinstance(ep.actions.data, tuple) and ep.actions.data[0].dtype == np.int64


def test_zero_length_episode_equals_rllib():
    env = gym.make("CartPole-v1")
    o, _ = env.reset(seed=3)
    fe, ref = make_case(env.observation_space, env.action_space, [o], [], [], [{}], {}, False, True)
    fe.extra_model_outputs = {"action_logp": np.zeros(0, np.float32)}  # dropped, as RLlib has none
    ep = to_single_agent_episode(fe)
    assert_episodes_equal(ep, ref)
    assert len(ep) == 0 and not ep.is_numpy and ep.is_truncated


def test_inconsistent_arrays_are_refused():
    fe, _ = cartpole_case(True)
    fe.observations = [fe.observations[0][:-1]]
    with pytest.raises(ValueError, match="observations"):
        to_single_agent_episode(fe)
    fe, _ = cartpole_case(True)
    fe.actions = [fe.actions[0].astype(np.int32)]
    with pytest.raises(ValueError, match="actions"):
        to_single_agent_episode(fe)
    fe, _ = cartpole_case(True)
    fe.infos = fe.infos[:-1]
    with pytest.raises(ValueError, match="infos"):
        to_single_agent_episode(fe)


# ---------------------------------------------------------------------------------------------
# packing


def test_pack_is_what_rllib_writes_and_reads():
    """Guard: RLlib's recorder packs and its PreLearner unpacks exactly the way we assume."""
    from ray.rllib.offline.offline_env_runner import OfflineSingleAgentEnvRunner
    from ray.rllib.offline.offline_prelearner import OfflinePreLearner

    assert "msgpack.packb(eps.get_state(), default=mnp.encode)" in inspect.getsource(OfflineSingleAgentEnvRunner.sample)
    src = inspect.getsource(OfflinePreLearner.__call__)
    assert 'batch["item"]' in src and "msgpack.unpackb(state, object_hook=mnp.decode)" in src

    fe, _ = cartpole_case(True)
    ep = to_single_agent_episode(fe)
    assert pack_episode(ep) == msgpack.packb(ep.get_state(), default=mnp.encode)


@pytest.mark.parametrize("case", list(CASES))
def test_pack_gives_the_bytes_of_packing_get_state(case):
    """`pack_episode` builds the state itself (spaces serialised once per space object): for every
    kind of space, ours and RLlib's own episodes (with its timers set), the bytes equal packing
    RLlib's `get_state()` -- twice, so a remembered space serialises the same."""
    fe, ref = CASES[case]()
    for ep in (to_single_agent_episode(fe), ref, to_single_agent_episode(fe)):
        assert pack_episode(ep) == msgpack.packb(ep.get_state(), default=mnp.encode)
    # shards pack straight from the FinishedEpisode (no SingleAgentEpisode built): same bytes
    ours = msgpack.packb(to_single_agent_episode(fe).get_state(), default=mnp.encode)
    assert msgpack.packb(finished_episode_state(fe), default=mnp.encode) == ours
    data, ends = pack_finished_episodes([fe, fe])
    assert bytes(data) == ours + ours and ends == [len(ours), 2 * len(ours)]


@pytest.mark.parametrize("case", list(CASES))
def test_pack_unpack_round_trip(case):
    fe, ref = CASES[case]()
    ep = to_single_agent_episode(fe)
    data = pack_episode(ep)
    back = unpack_episode(data)
    assert_episodes_equal(back, ref)
    assert back.custom_data == {"policy_id": "pol-a", "policy_version": 3, "env_id": "Env-v0"}
    # RLlib's own (unsafe) decoder reads our bytes too; msgpack turns tuples into lists there
    stock = SingleAgentEpisode.from_state(msgpack.unpackb(data, object_hook=mnp.decode))
    assert stock.custom_data == back.custom_data and stock.id_ == ep.id_
    assert stock.observation_space == ep.observation_space and stock.action_space == ep.action_space
    assert len(stock) == len(ep) and stock.is_terminated == ep.is_terminated and stock.is_truncated == ep.is_truncated
    np.testing.assert_array_equal(stock.get_rewards(), ep.get_rewards())


def test_custom_data_survives_get_state_from_state():
    fe, _ = dict_case(False)
    ep = to_single_agent_episode(fe)
    again = SingleAgentEpisode.from_state(ep.get_state())
    assert again.custom_data == {"policy_id": "pol-a", "policy_version": 3, "env_id": "Env-v0"}


def test_numpy_form_is_smaller_than_list_form():
    fe, _ref = cartpole_case(False)
    numpy_bytes = len(pack_episode(to_single_agent_episode(fe)))
    listy = SingleAgentEpisode(id_="x", observation_space=fe.observation_space, action_space=fe.action_space)
    listy.add_env_reset(fe.observations[0][0])
    for t in range(fe.length):
        listy.add_env_step(
            fe.observations[0][t + 1],
            int(fe.actions[0][t]),
            1.0,
            extra_model_outputs={k: v[t] for k, v in fe.extra_model_outputs.items()},
        )
    assert numpy_bytes < 0.7 * len(pack_episode(listy))


# ---------------------------------------------------------------------------------------------
# safe unpacking


class _Marker:
    """Unpickling this creates a file: proof that decoding executed code from the data."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _state_with_object_array(marker) -> bytes:
    fe, _ = cartpole_case(True)
    state = to_single_agent_episode(fe).get_state()
    state["custom_data"]["evil"] = np.array([_Marker(str(marker))], dtype=object)
    return msgpack.packb(state, default=mnp.encode)


#: the safe decoders of packed episodes: to `SingleAgentEpisode`s and to arrays (the steps readers')
DECODERS = (unpack_episode, decode_episode)


def test_unpack_refuses_object_arrays(tmp_path):
    data = _state_with_object_array(tmp_path / "marker")
    for decoder in DECODERS:
        with pytest.raises(UnsafeEpisodeError):
            decoder(data)
    assert not (tmp_path / "marker").exists()
    # the payload is real: RLlib's decoder runs it
    msgpack.unpackb(data, object_hook=mnp.decode)
    assert (tmp_path / "marker").exists()


def test_unpack_refuses_pickled_space_bounds(tmp_path):
    """`from_state` -> gym_space_from_dict -> np.load(allow_pickle=True): also code execution."""
    marker = tmp_path / "marker-space"
    buf = io.BytesIO()
    np.save(buf, np.array([_Marker(str(marker))], dtype=object), allow_pickle=True)
    evil = base64.b64encode(zlib.compress(buf.getvalue())).decode("ascii")
    fe, _ = cartpole_case(True)
    for where in ("episode", "buffer"):
        state = to_single_agent_episode(fe).get_state()
        sp = state["_observation_space"] if where == "episode" else state["observations"]["space"]
        sp["low"] = evil
        data = msgpack.packb(state, default=mnp.encode)
        for decoder in DECODERS:
            with pytest.raises(UnsafeEpisodeError):
                decoder(data)
        assert not marker.exists()
    with pytest.raises(ValueError):  # gymnasium's Box then rejects the unpickled bound...
        SingleAgentEpisode.from_state(msgpack.unpackb(data, object_hook=mnp.decode))
    assert marker.exists()  # ...but the stock path has already executed the payload


def test_unpack_refuses_other_bad_payloads(tmp_path):
    fe, _ = cartpole_case(True)
    state = to_single_agent_episode(fe).get_state()
    good = msgpack.packb(state, default=mnp.encode)
    for bad in (b"", b"\x00\x01garbage", good[: len(good) // 2], msgpack.packb([1, 2, 3]), msgpack.packb({"id_": "x"})):
        for decoder in DECODERS:
            with pytest.raises(EpisodeDecodeError):
                decoder(bad)
    # an object scalar, a structured dtype, a byte-length lie
    for hooked, error in (
        ({b"nd": False, b"type": "|O", b"data": pickle.dumps(_Marker(str(tmp_path / "m2")))}, UnsafeEpisodeError),
        ({b"nd": True, b"type": "|O", b"kind": b"", b"shape": [1], b"data": b"x" * 8}, UnsafeEpisodeError),
        ({b"nd": True, b"type": [["a", "|O"]], b"kind": b"V", b"shape": [1], b"data": b"x" * 8}, UnsafeEpisodeError),
        ({b"nd": True, b"type": "<M8[s]", b"kind": b"", b"shape": [1], b"data": b"x" * 8}, EpisodeDecodeError),
        ({b"nd": True, b"type": "<f4", b"kind": b"", b"shape": [1000], b"data": b"x" * 8}, EpisodeDecodeError),
        ({b"nd": True, b"type": "<f4", b"kind": b"", b"shape": [-1, 2], b"data": b"x" * 8}, EpisodeDecodeError),
    ):
        st = dict(state, custom_data={"x": hooked})
        for decoder in DECODERS:
            with pytest.raises(error):
                decoder(msgpack.packb(st, default=mnp.encode))
    assert not (tmp_path / "m2").exists()
    # inconsistent lengths
    st = to_single_agent_episode(fe).get_state()
    st["rewards"]["data"] = st["rewards"]["data"][:-1]
    for decoder in DECODERS:
        with pytest.raises(EpisodeDecodeError):
            decoder(msgpack.packb(st, default=mnp.encode))
    assert issubclass(UnsafeEpisodeError, EpisodeDecodeError) and issubclass(EpisodeDecodeError, ValueError)


def test_steps_without_info_share_one_immutable_info():
    """The assembler gives a step without an info the shared, immutable `EMPTY_INFO` (no Python
    object per step in a buffered episode): it packs to RLlib's bytes for fresh empty dicts,
    and the `SingleAgentEpisode` built from it still gets a dict of its own per step."""
    from rlrec.consumer.assembly import PartitionAssembler
    from rlrec.store.finished import EMPTY_INFO
    from tests.test_assembly import start, steps

    a = PartitionAssembler("t", 0)
    a.apply(0, start("e"))
    a.apply(1, steps("e", 0, 3))
    a.apply(2, steps("e", 3, 2, terminated=True))
    (fe,) = a.finished.values()
    assert fe.infos[1:] == [EMPTY_INFO] * 5 and all(i is EMPTY_INFO for i in fe.infos[1:])
    with pytest.raises(TypeError):
        fe.infos[1]["x"] = 1  # immutable: sharing it cannot leak a change into other steps
    fresh = dataclasses.replace(fe, infos=[dict(i) for i in fe.infos])
    packed = msgpack.packb(finished_episode_state(fe), default=mnp.encode)
    assert packed == msgpack.packb(to_single_agent_episode(fresh).get_state(), default=mnp.encode)
    assert bytes(pack_finished_episodes([fe])[0]) == packed
    infos = to_single_agent_episode(fe).get_infos()
    assert len({id(i) for i in infos}) == len(infos) == 6 and all(type(i) is dict for i in infos)


def _box_bomb(n: int) -> dict:
    """A Box space dict whose bounds are n float32 zeros each: ~50 KB compressed, 8n bytes decoded."""
    buf = io.BytesIO()
    np.save(buf, np.zeros(n, np.float32))
    z = base64.b64encode(zlib.compress(buf.getvalue(), 9)).decode("ascii")
    return {"space": "box", "low": z, "high": z, "shape": [n], "dtype": "<f4"}


def test_a_space_bomb_is_refused_within_the_episode_budget():
    """Every extra model output carries its own space: a few KB of compressed Box bounds per key
    would make a reader hold gigabytes. The spaces of one episode decode within a budget."""
    from rlrec.store import episodes

    fe, _ = cartpole_case(True)
    state = to_single_agent_episode(fe).get_state()
    n = episodes.MAX_SPACE_BYTES_PER_EPISODE // 8 // 3  # one key's space: a third of the budget
    emo = state["extra_model_outputs"]
    for i in range(8):
        emo[f"bomb{i}"] = dict(emo["action_logp"], space=_box_bomb(n + i))  # distinct: no cache hit
    data = msgpack.packb(state, default=mnp.encode)
    assert len(data) < 2 * 1024 * 1024
    for decoder in DECODERS:
        with pytest.raises(EpisodeDecodeError, match="budget"):
            decoder(data)
    assert episodes._spaces.nbytes <= episodes.SPACE_CACHE_BYTES
    # two of them fit: decoded, and kept for the next episode within the cache's bytes
    for i in range(2, 8):
        del emo[f"bomb{i}"]
    ep = unpack_episode(msgpack.packb(state, default=mnp.encode))
    assert ep.extra_model_outputs["bomb1"].space.shape == (n + 1,)
    assert episodes._spaces.nbytes <= episodes.SPACE_CACHE_BYTES
