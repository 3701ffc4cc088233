"""Golden vectors of the multi-agent kinds (producer/schemas/golden/multi_agent_*): decode each
.bin, compare with its .json (rebuilt from the JSON alone), re-encode byte for byte."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from rlrec.producer.events import SCHEMA_HEADER, RewardDelta
from rlrec.producer.multi_agent_events import (
    AgentColumn,
    AgentSpec,
    MultiAgentEpisodeStart,
    MultiAgentStepBatch,
    decode_event,
    encode_event,
)
from rlrec.producer.spaces import dumps_space, loads_space
from tests.test_golden import GOLDEN, _array, _info, assert_same

NAMES = ["multi_agent_episode_start", "multi_agent_step_batch", "reward_delta_agent"]


def _load(name: str):
    doc = json.loads((GOLDEN / f"{name}.json").read_text())
    value = (GOLDEN / doc["value_file"]).read_bytes()
    return doc, value, [(k, v.encode()) for k, v in doc["headers"]]


def _space(text: str):
    d = json.loads(text)
    from rlrec.producer.spaces import space_from_json

    return space_from_json(d, broadcast=True)


def expected_event(doc: dict):
    f = doc["fields"]
    if doc["kind"] == "MultiAgentEpisodeStart":
        agents = {
            a["agent_id"]: AgentSpec(
                a["agent_id"], a["module_id"], _space(a["observation_space_json"]), _space(a["action_space_json"])
            )
            for a in f["agents"]
        }
        return MultiAgentEpisodeStart(
            f["episode_id"],
            f["policy_id"],
            f["policy_version"],
            agents,
            {k: [_array(x) for x in v] for k, v in f["observations"].items()},
            {k: _info(v) for k, v in f["infos"].items()},
            f["env_id"],
            f["timestamp_ms"],
        )
    if doc["kind"] == "MultiAgentStepBatch":
        cols = [
            AgentColumn(
                c["agent_id"],
                np.array(c["presence"], dtype=np.uint8),
                [_array(a) for a in c["observations"]],
                [_array(a) for a in c["actions"]],
                _array(c["rewards"]),
                [_info(i) for i in c["infos"]],
                {k: _array(v) for k, v in c["extra_model_outputs"].items()},
                {k: np.array(v, dtype=np.uint8) for k, v in c["extra_rows"].items()},
            )
            for c in f["agents"]
        ]
        return MultiAgentStepBatch(
            f["episode_id"], f["t0"], np.array(f["env_flags"], dtype=np.uint8), cols, f["ended"], f["timestamp_ms"]
        )
    assert doc["kind"] == "RewardDelta"
    return RewardDelta(f["episode_id"], f["t"], f["reward"], f["timestamp_ms"], f["agent_id"])


@pytest.mark.parametrize("name", NAMES)
def test_multi_agent_golden_decodes_to_its_json(name):
    doc, value, headers = _load(name)
    assert hashlib.sha256(value).hexdigest() == doc["value_sha256"] and len(value) == doc["value_size"]
    assert headers == [(SCHEMA_HEADER, f"{doc['kind']}/{doc['version']}".encode())]
    ev = decode_event(value, headers)
    want = expected_event(doc)
    assert type(ev) is type(want) and ev.episode_id == doc["key"]
    if isinstance(ev, MultiAgentEpisodeStart):
        assert (ev.policy_id, ev.policy_version, ev.env_id, ev.timestamp_ms) == (
            want.policy_id,
            want.policy_version,
            want.env_id,
            want.timestamp_ms,
        )
        assert list(ev.agents) == list(want.agents)
        for aid, spec in ev.agents.items():
            assert spec.module_id == want.agents[aid].module_id
            assert spec.observation_space == want.agents[aid].observation_space
            assert spec.action_space == want.agents[aid].action_space
        assert_same(ev.observations, want.observations)
        assert_same(ev.infos, want.infos)
    elif isinstance(ev, MultiAgentStepBatch):
        assert (ev.t0, ev.n, ev.ended, ev.timestamp_ms) == (want.t0, doc["fields"]["n"], want.ended, want.timestamp_ms)
        assert_same(ev.env_flags, want.env_flags)
        assert [c.agent_id for c in ev.agents] == [c.agent_id for c in want.agents]
        for got, exp in zip(ev.agents, want.agents):
            for attr in (
                "presence",
                "observations",
                "actions",
                "rewards",
                "infos",
                "extra_model_outputs",
                "extra_rows",
            ):
                assert_same(getattr(got, attr), getattr(exp, attr))
    else:
        assert ev == want and ev.agent_id == "a1"


@pytest.mark.parametrize("name", NAMES)
def test_multi_agent_golden_reencodes_identically(name):
    doc, value, headers = _load(name)
    assert encode_event(expected_event(doc)) == (value, headers)
    assert encode_event(decode_event(value, headers)) == (value, headers)


def test_compact_bound_is_on_the_wire():
    doc, _, _ = _load("multi_agent_episode_start")
    text = doc["fields"]["agents"][1]["observation_space_json"]
    assert json.loads(text)["low"] == [0] and json.loads(text)["high"] == [255]
    assert loads_space(dumps_space(_space(text))).shape == (2, 2)  # the full form of the same space


@pytest.mark.parametrize(
    "module",
    [
        "rlrec.producer.multi_agent_events",
        "rlrec.producer.multi_agent_rules",
        "rlrec.producer.multi_agent_recording",
        "rlrec.consumer.multi_agent_fold",
    ],
)
def test_module_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
