"""Golden vectors (producer/schemas/golden): decode every .bin, compare with its .json, re-encode byte for byte.

The expected events are rebuilt here from the .json alone (not from the generator), so these
tests also check that the .json files carry everything an implementer in another language needs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import rlrec.producer.events as events
from rlrec.producer.events import EpisodeAbort, EpisodeStart, RewardDelta, StepBatch, decode, dumps_info, encode
from rlrec.producer.spaces import dumps_space, loads_space, space_leaves, space_to_json

GOLDEN = Path(events.__file__).with_name("schemas") / "golden"
KINDS = {"EpisodeStart": EpisodeStart, "StepBatch": StepBatch, "RewardDelta": RewardDelta, "EpisodeAbort": EpisodeAbort}
ALL_NAMES = sorted(p.stem for p in GOLDEN.glob("*.json"))
#: the single-agent vectors (the multi-agent kinds: tests/test_multi_agent_golden.py)
NAMES = [n for n in ALL_NAMES if json.loads((GOLDEN / f"{n}.json").read_text())["kind"] in KINDS]


def _load(name: str) -> tuple[dict, bytes, list[tuple[str, bytes]]]:
    doc = json.loads((GOLDEN / f"{name}.json").read_text())
    value = (GOLDEN / doc["value_file"]).read_bytes()
    headers = [(k, v.encode()) for k, v in doc["headers"]]
    return doc, value, headers


def _is_array(d) -> bool:
    return isinstance(d, dict) and set(d) == {"dtype", "shape", "values"}


def _array(d: dict) -> np.ndarray:
    values = [float(v) if isinstance(v, str) else v for v in d["values"]]  # "nan", "inf", "-inf"
    return np.array(values, dtype=np.dtype(d["dtype"])).reshape(d["shape"])


def _info(v):
    if _is_array(v):
        return _array(v)
    if isinstance(v, dict):
        return {k: _info(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_info(x) for x in v]
    return v


def _space(f: dict, which: str):
    space = loads_space(f[f"{which}_json"])
    assert space_to_json(space) == f[which]  # the parsed form and the wire text agree
    return space


def expected_event(doc: dict):
    """The event described by a golden .json, built from the JSON only."""
    f = doc["fields"]
    kind = doc["kind"]
    if kind == "EpisodeStart":
        return EpisodeStart(
            f["episode_id"],
            f["policy_id"],
            f["policy_version"],
            [_array(a) for a in f["observation"]],
            _space(f, "observation_space"),
            _space(f, "action_space"),
            f["env_id"],
            _info(f["info"]),
            f["timestamp_ms"],
        )
    if kind == "StepBatch":
        return StepBatch(
            f["episode_id"],
            f["t0"],
            [_array(a) for a in f["actions"]],
            _array(f["rewards"]),
            [_array(a) for a in f["observations"]],
            f["terminated"],
            f["truncated"],
            None if f["infos"] is None else [_info(i) for i in f["infos"]],
            {k: _array(v) for k, v in f["extra_model_outputs"].items()},
            f["timestamp_ms"],
        )
    if kind == "RewardDelta":
        return RewardDelta(f["episode_id"], f["t"], f["reward"], f["timestamp_ms"], f.get("agent_id", ""))
    assert kind == "EpisodeAbort", kind
    return EpisodeAbort(f["episode_id"], f["reason"], f["timestamp_ms"])


def assert_array_equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype.name == want.dtype.name and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    le = want.dtype.newbyteorder("<")
    assert np.ascontiguousarray(got, dtype=le).tobytes() == np.ascontiguousarray(want, dtype=le).tobytes()


def assert_same(got, want) -> None:
    if isinstance(want, np.ndarray):
        assert_array_equal(got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (got, want)
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert got == want and type(got) is type(want), (got, want)


# ------------------------------------------------------------------------------------- tests


def test_golden_set_is_complete():
    assert {
        "episode_start",
        "step_batch",
        "reward_delta",
        "episode_abort",
        "episode_start_dict",
        "step_batch_multi",
    } <= set(NAMES)
    assert {json.loads((GOLDEN / f"{n}.json").read_text())["kind"] for n in NAMES} == set(KINDS)
    bins = {p.stem for p in GOLDEN.glob("*.bin")}
    assert bins == set(ALL_NAMES), "every .bin needs its .json and vice versa"


@pytest.mark.parametrize("name", NAMES)
def test_golden_decodes_to_its_json(name):
    doc, value, headers = _load(name)
    assert len(value) == doc["value_size"]
    assert hashlib.sha256(value).hexdigest() == doc["value_sha256"]
    assert headers == [(events.SCHEMA_HEADER, f"{doc['kind']}/{doc['version']}".encode())]
    ev = decode(value, headers)
    assert type(ev) is KINDS[doc["kind"]]
    assert ev.episode_id == doc["key"]
    want = expected_event(doc)
    f = doc["fields"]
    if isinstance(ev, EpisodeStart):
        assert (ev.policy_id, ev.policy_version, ev.env_id, ev.timestamp_ms) == (
            want.policy_id,
            want.policy_version,
            want.env_id,
            want.timestamp_ms,
        )
        assert_same(ev.observation, want.observation)
        assert dumps_space(ev.observation_space) == f["observation_space_json"]
        assert dumps_space(ev.action_space) == f["action_space_json"]
        assert ev.observation_space == want.observation_space and ev.action_space == want.action_space
        assert_same(ev.info, want.info)
        assert [(x.dtype.name, list(x.shape)) for x in space_leaves(ev.observation_space)] == [
            (a["dtype"], a["shape"]) for a in f["observation"]
        ]
    elif isinstance(ev, StepBatch):
        assert (ev.t0, ev.n, ev.terminated, ev.truncated, ev.timestamp_ms) == (
            f["t0"],
            f["n"],
            f["terminated"],
            f["truncated"],
            f["timestamp_ms"],
        )
        assert_same(ev.actions, want.actions)
        assert_same(ev.rewards, want.rewards)
        assert_same(ev.observations, want.observations)
        assert_same(ev.extra_model_outputs, want.extra_model_outputs)
        assert_same(ev.infos, want.infos)
        if f["infos"] is not None:
            assert [dumps_info(i) for i in ev.infos] == f["infos_json"]
    else:
        assert ev == want  # plain dataclasses of scalars


@pytest.mark.parametrize("name", NAMES)
def test_golden_reencodes_identically(name):
    doc, value, headers = _load(name)
    # from the JSON description ...
    v1, h1 = encode(expected_event(doc))
    assert h1 == headers
    assert v1 == value
    # ... and from the decoded event
    v2, h2 = encode(decode(value, headers))
    assert (v2, h2) == (value, headers)


def test_golden_files_are_up_to_date():
    spec = importlib.util.spec_from_file_location("rlrec_golden_generate", GOLDEN / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    files = gen.build()
    assert sorted(files) == sorted(p.name for p in GOLDEN.iterdir() if p.suffix in (".bin", ".json"))
    for fname, content in files.items():
        assert (GOLDEN / fname).read_bytes() == content, f"{fname} is stale: run python {GOLDEN / 'generate.py'}"
    assert gen.build() == files  # deterministic
