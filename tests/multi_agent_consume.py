"""Helpers of the multi-agent consumer tests: recordings sent through the real recorder calls,
the committed agent rows counted, the store's episodes compared with RLlib's replay."""

from __future__ import annotations

import numpy as np

from rlrec.consumer.multi_agent_reference import reference_episode
from rlrec.producer import EpisodeRecorder
from rlrec.producer.multi_agent_recording import MultiAgentRecording
from rlrec.store.manifest import read_manifest
from rlrec.store.storage import Storage
from tests.multi_agent_cases import assert_same, comparable_state


def recordable(rec: MultiAgentRecording) -> MultiAgentRecording:
    """`rec` as the recorder takes it, changed in place (again: no change): its ``action_logp``
    outputs (random normals in `tests.multi_agent_cases`) made log propensities (``-|x|``) and its
    rewards Python floats (the wire's float64; tic-tac-toe returns ints), so the reference replay
    of `rec` sees what is sent."""
    for s in rec.steps:
        s.rewards = {a: float(r) for a, r in s.rewards.items()}
        for out in s.extra_model_outputs.values():
            if "action_logp" in out:
                out["action_logp"] = -np.abs(out["action_logp"])
    return rec


def send(recorder: EpisodeRecorder, rec: MultiAgentRecording) -> None:
    """`rec` recorded through `EpisodeRecorder.begin_multi_agent_episode` / `log_multi_agent_step`
    (made `recordable` first)."""
    recordable(rec)
    recorder.begin_multi_agent_episode(
        rec.reset.observations,
        rec.reset.infos,
        episode_id=rec.episode_id,
        policy_version=rec.policy_version,
        observation_spaces=rec.observation_spaces,
        action_spaces=rec.action_spaces,
        agent_modules=rec.agent_modules,
    )
    for s in rec.steps:
        recorder.log_multi_agent_step(
            rec.episode_id,
            s.observations,
            s.actions,
            s.rewards,
            s.terminateds,
            s.truncateds,
            s.infos,
            s.extra_model_outputs,
        )


def agent_rows_committed(storage: Storage) -> int:
    """Rows of every committed multi-agent (version 2) shard entry."""
    return sum(e.episodes for e in read_manifest(storage) if e.format_version == 2)


def expected_rows(recs: list[MultiAgentRecording]) -> int:
    """The agent rows the recordings make (agents with a step, as RLlib's replay has them)."""
    n = 0
    for rec in recs:
        ep = reference_episode(rec)
        n += sum(1 for sa in ep.agent_episodes.values() if sa.is_done and len(sa) >= 1)
    return n


def assert_store_equals_reference(output: str, recs: list[MultiAgentRecording]) -> None:
    """`rlrec.open(output).multi_agent_episodes()` holds each recording once, equal field by field
    (timers aside) to `reference_episode` of it."""
    import rlrec

    got: dict = {}
    for ep in rlrec.open(output).multi_agent_episodes():
        assert ep.id_ not in got, f"episode {ep.id_} twice"
        got[ep.id_] = ep
    assert sorted(got) == sorted(r.episode_id for r in recs)
    for rec in recs:
        assert_same(comparable_state(got[rec.episode_id]), comparable_state(reference_episode(rec)), rec.episode_id)


def send_all(bootstrap: str, topic: str, recs: list[MultiAgentRecording], policy_id: str = "pol", **kw) -> int:
    """Send `recs` through one recorder per env id (a recorder's ``env_id`` names what every
    episode it records ran in; `kw`: more `EpisodeRecorder` options); returns the messages
    produced."""
    n = 0
    for env_id in dict.fromkeys(r.env_id for r in recs):
        recorder = EpisodeRecorder(bootstrap, topic, policy_id=policy_id, env_id=env_id, **kw)
        for rec in recs:
            if rec.env_id == env_id:
                send(recorder, rec)
        assert recorder.flush(10) == 0
        n += recorder.stats.messages_produced
        recorder.close()
    return n
