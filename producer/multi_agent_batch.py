"""The Avro body of a `MultiAgentStepBatch` (docs/FORMAT.md, "Multi-agent episodes") from what
`EpisodeRecorder`'s multi-agent calls buffered: per agent one column of the env steps' cells.
Byte for byte `multi_agent_events.encode_event` of the same batch (tests/test_multi_agent_recording.py
checks every recorded message)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlrec.producer import recorder as _r
from rlrec.producer.arrays import array_to_wire
from rlrec.producer.avro_write import ARRAY_END, array_parts, bool_byte, long_bytes, string_bytes
from rlrec.producer.multi_agent_events import ACTION, INFO, OBSERVATION, REWARD

__all__ = ["encode_step_batch"]

_REWARDS_HEAD = string_bytes("float64") + long_bytes(1)
#: a column's extra outputs when they are only float propensities: one name, then its float64 (k,) array up to k
_LOGP_ONLY_HEAD = long_bytes(1) + string_bytes("action_logp") + _REWARDS_HEAD
_EMPTY_STRING = string_bytes("")
_DATA = OBSERVATION | ACTION | REWARD | INFO  # the flags of a cell that say which values it has


def encode_step_batch(ep: Any, ended: bool) -> bytes:
    """The Avro body of a MultiAgentStepBatch of an episode's buffered env steps.

    Args:
        ep: the recorder's `_MultiAgentEpisode`: its id, agents, packers, ``t0`` and buffered
            ``steps`` (per env step its flag byte and ``{agent: cell}``; a cell is the agent's
            presence flags, then its kept observation, action, reward, info and outputs).
        ended: the batch ends the episode.

    Example:
        >>> value = encode_step_batch(ep, ended=True)  # doctest: +SKIP
    """
    steps = ep.steps
    n = len(steps)
    flags = bytes([f for f, _ in steps])
    parts = [ep.id_avro, long_bytes(ep.t0), long_bytes(n), flags]
    columns = []
    for a in ep.agents:
        col = [cells.get(a) for _, cells in steps]
        if any(col):
            columns.append((a, col))
    if columns:
        parts.append(long_bytes(len(columns)))
    for a, col in columns:
        if None not in col and len({c[0] & _DATA for c in col}) == 1:
            # the agent has the same fields at every env step: its column is a transpose
            ps, obs, acts, rewards, infos, outputs = zip(*col)
            p = ps[0]
            presence = bytes(ps)
            obs = obs if p & OBSERVATION else ()
            if not p & ACTION:
                acts = outputs = ()
            rewards = rewards if p & REWARD else ()
            infos = infos if p & INFO else ()
        else:
            presence = bytes([c[0] if c else 0 for c in col])
            obs = [c[1] for c in col if c and c[0] & OBSERVATION]
            acting = [c for c in col if c and c[0] & ACTION]
            acts = [c[2] for c in acting]
            outputs = [c[5] for c in acting]
            rewards = [c[3] for c in col if c and c[0] & REWARD]
            infos = [c[4] for c in col if c and c[0] & INFO]
        parts += (string_bytes(a), long_bytes(n), presence)
        _write(parts, ep.obs_packers[a], obs)
        _write(parts, ep.act_packers[a], acts)
        k = len(rewards)
        parts += (_REWARDS_HEAD, long_bytes(k), ARRAY_END, long_bytes(8 * k), struct.pack(f"<{k}d", *rewards))
        if infos:
            parts.append(long_bytes(len(infos)))
            if any(infos):
                parts += [string_bytes(x) if x else _EMPTY_STRING for x in infos]
            else:  # only empty infos (an env's {} at every step)
                parts.append(_EMPTY_STRING * len(infos))
        parts.append(ARRAY_END)
        _extras(parts, outputs)
    parts.append(ARRAY_END)
    parts += (bool_byte(ended), _r._now_ms_bytes())
    return b"".join(parts)


def _extras(parts: list, kept: Sequence) -> None:
    """The column's `extra_model_outputs` and `extra_rows` maps: per name (in the order the
    actions gave them) its values stacked over the actions that have it, and the row mask of
    a name only some of them have. `kept`: per action what the recorder kept of its outputs
    (None, a dict, or only the propensity as its scalar)."""
    k = len(kept)
    if k and list(map(type, kept)).count(float) == k:  # only float propensities, at every action
        parts += (_LOGP_ONLY_HEAD, long_bytes(k), ARRAY_END, long_bytes(8 * k), struct.pack(f"<{k}d", *kept))
        parts += (ARRAY_END, ARRAY_END)
        return
    outputs = [o if type(o) not in _r._FLOAT_TYPES else {"action_logp": o} for o in kept]
    outputs = [o or {} for o in outputs]
    names = list(dict.fromkeys(k for o in outputs for k in o))
    masks = []
    if names:
        parts.append(long_bytes(len(names)))
        for name in names:
            rows = [name in o for o in outputs]
            w = array_to_wire(np.asarray([o[name] for o in outputs if name in o]))
            parts.append(string_bytes(name))
            array_parts(parts, w["dtype"], w["shape"], w["data"])
            if not all(rows):
                masks.append((name, bytes(rows)))
    parts.append(ARRAY_END)
    if masks:
        parts.append(long_bytes(len(masks)))
        for name, mask in masks:
            parts += (string_bytes(name), long_bytes(len(mask)), mask)
    parts.append(ARRAY_END)


def _write(parts: list, packer: Any, col: Sequence) -> None:
    """The Avro array of the stacked leaves of `col` (kept values), also when it is empty."""
    if col:
        packer.write(parts, col)
    else:
        packer.write_empty(parts)
