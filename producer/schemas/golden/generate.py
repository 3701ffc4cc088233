"""Write the golden vectors of the rlrec event format (docs/FORMAT.md, "Golden vectors").

For each vector NAME this writes, next to this script:

  NAME.bin   the Kafka message value (the Avro body), byte for byte
  NAME.json  {"kind", "version", "key", "headers", "value_file", "value_size", "value_sha256",
              "fields": the decoded fields}

In "fields", every numeric array is {"dtype": ..., "shape": [...], "values": [flat, row-major]}
(floats that are not finite would be the strings "nan", "inf", "-inf"); spaces are given both as
the exact JSON text on the wire (`*_space_json`) and parsed (`*_space`); infos both as the exact
wire text (`info_json` / `infos_json`) and parsed, with arrays in the form above.

Everything is fixed (ids, timestamps, values), so the output is deterministic:

    python producer/schemas/golden/generate.py          # (re)write the files
    python producer/schemas/golden/generate.py --check  # exit 1 if the files are out of date
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces as gs

from rlrec.producer.events import EpisodeAbort, EpisodeStart, RewardDelta, StepBatch, dumps_info
from rlrec.producer.multi_agent_events import (
    AgentColumn,
    AgentSpec,
    MultiAgentEpisodeStart,
    MultiAgentStepBatch,
    encode_event,
)
from rlrec.producer.spaces import dumps_space, unflatten_leaves

HERE = Path(__file__).resolve().parent
TS = 1_767_225_600_000  # 2026-01-01T00:00:00Z, in ms


def _f32(*v: float) -> np.ndarray:
    return np.array(v, dtype=np.float32)


def cartpole_spaces() -> tuple[gs.Box, gs.Discrete]:
    high = _f32(4.8, np.inf, 0.41887903, np.inf)
    return gs.Box(-high, high, dtype=np.float32), gs.Discrete(2)


def dict_spaces() -> tuple[gs.Dict, gs.Tuple]:
    obs = gs.Dict(
        [  # a list of pairs keeps this (unsorted) key order
            ("pos", gs.Box(-1.0, 1.0, (2, 3), np.float32)),
            (
                "inv",
                gs.Tuple(
                    [
                        gs.Discrete(5, start=1),
                        gs.Dict([("z", gs.MultiBinary([2, 2])), ("a", gs.MultiDiscrete([[2, 3], [4, 5]]))]),
                    ]
                ),
            ),
            ("health", gs.Box(0, 100, (), np.uint8)),
            ("flag", gs.Box(0, 1, (), bool)),
        ]
    )
    act = gs.Tuple([gs.Discrete(3), gs.Box(-1.0, 1.0, (2,), np.float64)])
    return obs, act


def dict_obs(i: int) -> list[np.ndarray]:
    """Leaves of a Dict-space observation, in leaf order: pos, inv[0], inv[1].z, inv[1].a, health, flag."""
    return [
        ((np.arange(6).reshape(2, 3) - 2.5) / 4 + i / 64).astype(np.float32),
        np.array(1 + i % 5, dtype=np.int64),
        np.array([[1, 0], [i % 2, 1]], dtype=np.int8),
        np.array([[1, 2], [3, i % 5]], dtype=np.int64),
        np.array(100 - i, dtype=np.uint8),
        np.array(i % 2 == 0),
    ]


def events() -> dict[str, Any]:
    """The golden events, by vector name."""
    cp_obs, cp_act = cartpole_spaces()
    d_obs, d_act = dict_spaces()
    d_steps = [dict_obs(i) for i in (5, 6, 7)]
    return {
        "episode_start": EpisodeStart(
            "golden-cartpole-0001",
            "golden-policy",
            3,
            [_f32(0.03125, -0.015625, 0.0234375, 0.046875)],
            cp_obs,
            cp_act,
            "CartPole-v1",
            {},
            TS,
        ),
        "step_batch": StepBatch(
            "golden-cartpole-0001",
            0,
            [np.array([1, 0, 1], dtype=np.int64)],
            np.array([1.0, 1.0, 1.0]),
            [
                np.array(
                    [
                        [0.03125, 0.1875, 0.0234375, -0.25],
                        [0.03125, -0.015625, 0.0234375, 0.0625],
                        [0.0390625, 0.1875, 0.03125, -0.21875],
                    ],
                    dtype=np.float32,
                )
            ],
            False,
            False,
            None,
            {},
            TS + 60,
        ),
        "reward_delta": RewardDelta("golden-cartpole-0001", 1, -0.25, TS + 90),
        "episode_abort": EpisodeAbort("golden-cartpole-0001", "env-closed", TS + 120),
        "episode_start_dict": EpisodeStart(
            "golden-dict-0001",
            "golden-policy",
            12,
            dict_obs(4),
            d_obs,
            d_act,
            "Maze-v0",
            {
                "seed": 7,
                "level": {"name": "maze-1", "walls": [[0, 1], [2, 3]], "dark": False, "gravity": None},
                "map": np.array([[1, -2], [3, 400]], dtype=np.int16),
            },
            TS + 1000,
        ),
        "step_batch_multi": StepBatch(
            "golden-dict-0001",
            4,
            [np.array([2, 0, 1], dtype=np.int64), np.array([[0.5, -0.5], [1.0, 0.0], [-0.25, 0.75]])],
            np.array([0.5, -1.0, 2.25]),
            [np.stack([s[j] for s in d_steps]) for j in range(len(d_steps[0]))],
            False,
            True,
            [{"x": 1}, {}, {"note": "time limit", "arr": _f32(1.5, -2.0)}],
            {
                "action_logp": _f32(-0.125, -2.25, -1.5),
                "action_dist_inputs": np.array([[2.0, 0.125, -1.0, 0.0, 0.5]] * 2 + [[0.0] * 5], dtype=np.float32),
            },
            TS + 1240,
        ),
        **multi_agent_events(),
    }


def multi_agent_events() -> dict[str, Any]:
    """A two-agent episode: a1 gets a reward before its first observation, a0 acts without an
    immediate observation at env step 3, both are done at env step 4 (a compact Box bound); one
    extra output of a0 is on its second action only (`extra_rows`)."""
    obs, act = gs.Box(-1.0, 1.0, (2,), np.float32), gs.Discrete(3)
    img = gs.Box(0, 255, (2, 2), np.uint8)
    eid = "golden-multi-0001"
    return {
        "multi_agent_episode_start": MultiAgentEpisodeStart(
            eid,
            "golden-policy",
            5,
            {"a0": AgentSpec("a0", "walker", obs, act), "a1": AgentSpec("a1", "camera", img, act)},
            {"a0": [_f32(0.25, -0.5)]},
            {"a0": {"seed": 3}},
            "Relay-v0",
            TS + 2000,
        ),
        "multi_agent_step_batch": MultiAgentStepBatch(
            eid,
            2,
            np.array([0, 0, 1 | 2 | 4], dtype=np.uint8),
            [
                AgentColumn(
                    "a0",
                    np.array([1 | 2 | 4, 2 | 4, 1 | 4 | 8 | 16 | 32 | 64], dtype=np.uint8),
                    [np.array([[0.5, 0.5], [-1.0, 1.0]], dtype=np.float32)],
                    [np.array([2, 0], dtype=np.int64)],
                    np.array([1.0, 0.5, -2.0]),
                    [{"why": "goal"}],
                    {"action_logp": _f32(-1.0986123, -0.5), "vf_preds": _f32(0.75)},
                    {"vf_preds": np.array([0, 1], dtype=np.uint8)},  # only the second action has it
                ),
                AgentColumn(
                    "a1",
                    np.array([4, 1 | 8, 1 | 2 | 4 | 16 | 64 | 128], dtype=np.uint8),
                    [np.array([[[0, 255], [7, 9]], [[1, 2], [3, 4]]], dtype=np.uint8)],
                    [np.array([1], dtype=np.int64)],
                    np.array([0.25, 1.5]),
                    [{"frame": 1}],
                    {"action_logp": _f32(-0.25)},
                ),
            ],
            True,
            TS + 2240,
        ),
        "reward_delta_agent": RewardDelta(eid, 3, 0.75, TS + 2300, "a1"),
    }


# ---------------------------------------------------------------------------------- JSON form


def _scalar(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def array_json(a: np.ndarray) -> dict:
    a = np.asarray(a)
    return {"dtype": a.dtype.name, "shape": list(a.shape), "values": [_scalar(x) for x in a.reshape(-1).tolist()]}


def info_json(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return array_json(v)
    if isinstance(v, dict):
        return {k: info_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [info_json(x) for x in v]
    return _scalar(v)


def fields_json(ev: Any) -> dict:
    """The fields of an event in the JSON form described in the module docstring."""
    if isinstance(ev, EpisodeStart):
        return {
            "episode_id": ev.episode_id,
            "policy_id": ev.policy_id,
            "policy_version": ev.policy_version,
            "env_id": ev.env_id,
            "observation": [array_json(a) for a in ev.observation],
            "info": info_json(ev.info),
            "info_json": dumps_info(ev.info),
            "observation_space": json.loads(dumps_space(ev.observation_space)),
            "observation_space_json": dumps_space(ev.observation_space),
            "action_space": json.loads(dumps_space(ev.action_space)),
            "action_space_json": dumps_space(ev.action_space),
            "timestamp_ms": ev.timestamp_ms,
        }
    if isinstance(ev, StepBatch):
        sent_infos = None if ev.infos is None or not any(ev.infos) else ev.infos
        return {
            "episode_id": ev.episode_id,
            "t0": ev.t0,
            "n": ev.n,
            "actions": [array_json(a) for a in ev.actions],
            "rewards": array_json(ev.rewards),
            "observations": [array_json(a) for a in ev.observations],
            "terminated": ev.terminated,
            "truncated": ev.truncated,
            "infos": None if sent_infos is None else [info_json(i) for i in sent_infos],
            "infos_json": None if sent_infos is None else [dumps_info(i) for i in sent_infos],
            "extra_model_outputs": {k: array_json(v) for k, v in ev.extra_model_outputs.items()},
            "timestamp_ms": ev.timestamp_ms,
        }
    if isinstance(ev, RewardDelta):
        out = {"episode_id": ev.episode_id, "t": ev.t, "reward": ev.reward, "timestamp_ms": ev.timestamp_ms}
        return {**out, "agent_id": ev.agent_id} if ev.agent_id else out
    if isinstance(ev, MultiAgentEpisodeStart):
        return {
            "episode_id": ev.episode_id,
            "policy_id": ev.policy_id,
            "policy_version": ev.policy_version,
            "env_id": ev.env_id,
            "agents": [
                {
                    "agent_id": a.agent_id,
                    "module_id": a.module_id,
                    "observation_space_json": dumps_space(a.observation_space, compact=True),
                    "action_space_json": dumps_space(a.action_space, compact=True),
                }
                for a in ev.agents.values()
            ],
            "observations": {k: [array_json(x) for x in v] for k, v in ev.observations.items()},
            "infos": {k: info_json(v) for k, v in ev.infos.items()},
            "infos_json": {k: dumps_info(v) for k, v in ev.infos.items()},
            "timestamp_ms": ev.timestamp_ms,
        }
    if isinstance(ev, MultiAgentStepBatch):
        return {
            "episode_id": ev.episode_id,
            "t0": ev.t0,
            "n": ev.n,
            "env_flags": ev.env_flags.tolist(),
            "agents": [
                {
                    "agent_id": c.agent_id,
                    "presence": c.presence.tolist(),
                    "observations": [array_json(a) for a in c.observations],
                    "actions": [array_json(a) for a in c.actions],
                    "rewards": array_json(c.rewards),
                    "infos": [info_json(i) for i in c.infos],
                    "infos_json": [dumps_info(i) for i in c.infos],
                    "extra_model_outputs": {k: array_json(v) for k, v in c.extra_model_outputs.items()},
                    "extra_rows": {k: np.asarray(v).tolist() for k, v in c.extra_rows.items()},
                }
                for c in ev.agents
            ],
            "ended": ev.ended,
            "timestamp_ms": ev.timestamp_ms,
        }
    return {"episode_id": ev.episode_id, "reason": ev.reason, "timestamp_ms": ev.timestamp_ms}


def _check_values(evs: dict[str, Any]) -> None:
    """The golden observations and actions are values of their episode's spaces."""
    spaces: dict[str, tuple[gs.Space, gs.Space]] = {}
    for name, ev in evs.items():
        if isinstance(ev, EpisodeStart):
            spaces[ev.episode_id] = (ev.observation_space, ev.action_space)
            assert ev.observation_space.contains(unflatten_leaves(ev.observation_space, ev.observation)), name
        elif isinstance(ev, StepBatch):
            obs_space, act_space = spaces[ev.episode_id]
            for i in range(ev.n):
                assert obs_space.contains(unflatten_leaves(obs_space, [np.asarray(a[i]) for a in ev.observations])), (
                    name,
                    i,
                )
                assert act_space.contains(unflatten_leaves(act_space, [np.asarray(a[i]) for a in ev.actions])), (
                    name,
                    i,
                )


def _pretty(v: Any, indent: int = 0) -> str:
    """JSON with one key per line, but lists of scalars (array values, shapes) on one line."""
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(v, dict) and v:
        items = [f"{inner}{json.dumps(k)}: {_pretty(x, indent + 1)}" for k, x in v.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(v, list) and v and any(isinstance(x, (dict, list)) for x in v):
        if all(isinstance(x, list) and not any(isinstance(y, (dict, list)) for y in x) for x in v):
            return json.dumps(v, allow_nan=False)  # e.g. headers: short lists of scalars
        return "[\n" + ",\n".join(inner + _pretty(x, indent + 1) for x in v) + "\n" + pad + "]"
    return json.dumps(v, allow_nan=False)


def build() -> dict[str, bytes]:
    """{file name: content} of every golden file."""
    out: dict[str, bytes] = {}
    evs = events()
    _check_values(evs)
    for name, ev in evs.items():
        value, headers = encode_event(ev)
        kind, version = headers[0][1].decode().split("/")
        doc = {
            "kind": kind,
            "version": int(version),
            "key": ev.episode_id,
            "headers": [[k, v.decode()] for k, v in headers],
            "value_file": f"{name}.bin",
            "value_size": len(value),
            "value_sha256": hashlib.sha256(value).hexdigest(),
            "fields": fields_json(ev),
        }
        out[f"{name}.bin"] = value
        text = _pretty(doc) + "\n"
        assert json.loads(text) == doc
        out[f"{name}.json"] = text.encode()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the files on disk instead of writing")
    ap.add_argument("--out", type=Path, default=HERE, help="directory (default: next to this script)")
    args = ap.parse_args(argv)
    files = build()
    if args.check:
        stale = [n for n, b in files.items() if not (args.out / n).is_file() or (args.out / n).read_bytes() != b]
        for n in stale:
            print(f"out of date: {args.out / n}", file=sys.stderr)
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for n, b in files.items():
        (args.out / n).write_bytes(b)
        print(args.out / n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
