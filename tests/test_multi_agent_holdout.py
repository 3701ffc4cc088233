"""One held-out rule for multi-agent rows: the trainer's PreLearner, lineage's split
(`HoldoutSplit` over a snapshot, as `open_lineage` applies it) and `rlrec evaluate`'s reader hold
out an agent row with its multi-agent episode (`rlrec.trainer.holdout.holdout_key`), so they agree
row by row and no multi-agent episode has agents on both sides; single-agent episodes keep their
own id's split."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("mpe2")

from rlrec.store.multi_agent_shards import read_agent_rows
from rlrec.store.schema_gate import open_shard
from rlrec.store.snapshot import open_snapshot
from rlrec.store.storage import Storage
from rlrec.trainer.holdout import is_held_out
from rlrec.trainer.lineage import HoldoutSplit
from rlrec.trainer.ope_data import HeldOutReader
from rlrec.trainer.prelearner import SafeOfflinePreLearner
from tests.multi_agent_stores import commit_spread

F = 0.3


def _prelearner(multi_agent: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(_rlrec_holdout=F, rlrec_held_out=0, _rlrec_multi_agent=multi_agent)


@pytest.fixture(scope="module")
def spread(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("spread"))
    paths = commit_spread(root, 2, 20)
    st = Storage.from_uri(root)
    rows = [r for p in paths for r in read_agent_rows(open_shard(st.read(p), fmt="episodes"))]
    return root, rows


def test_the_prelearner_holds_an_agent_row_out_with_its_multi_agent_episode(spread):
    _, rows = spread
    stub = _prelearner(True)
    held = {r.episode_id: SafeOfflinePreLearner._held_out(stub, r.episode) for r in rows}
    sides: dict[str, set[bool]] = {}
    for r in rows:
        sides.setdefault(r.multi_agent_episode_id, set()).add(held[r.episode_id])
    assert len(sides) == 40 and all(len(s) == 1 for s in sides.values())
    # keyed by the agent episode id instead, the agents of some episodes would be split
    by_agent: dict[str, set[bool]] = {}
    for r in rows:
        by_agent.setdefault(r.multi_agent_episode_id, set()).add(is_held_out(r.episode_id, F))
    assert any(len(s) == 2 for s in by_agent.values())
    assert 0 < sum(held.values()) < len(rows)


def test_lineage_and_evaluate_split_agent_rows_as_the_trainer_does(spread):
    root, rows = spread
    stub = _prelearner(True)
    trainer_held = {r.episode_id for r in rows if SafeOfflinePreLearner._held_out(stub, r.episode)}
    snap = open_snapshot(root)
    lineage_held = {str(ep.id_) for ep in snap.subset(keep_episode=HoldoutSplit(F, held_out=True)).episodes()}
    lineage_trained = {str(ep.id_) for ep in snap.subset(keep_episode=HoldoutSplit(F, held_out=False)).episodes()}
    assert lineage_held == trainer_held
    assert lineage_trained == {r.episode_id for r in rows} - trainer_held
    steps_held = set(snap.subset(keep_episode=HoldoutSplit(F, held_out=True)).steps()["episode_id"].to_pylist())
    assert steps_held == trainer_held
    ma_held = {ep.id_ for ep in snap.subset(keep_episode=HoldoutSplit(F, held_out=True)).multi_agent_episodes()}
    assert ma_held == {r.multi_agent_episode_id for r in rows if r.episode_id in trainer_held}
    evaluated = {ep.id for ep in HeldOutReader(root, F).refresh()}
    assert evaluated == trainer_held


def test_a_single_agent_episode_is_held_out_by_its_own_id():
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    stub = _prelearner(False)
    eps = [SingleAgentEpisode(id_=f"ep-{i}", multi_agent_episode_id=f"ma-{i // 2}") for i in range(200)]
    held = [SafeOfflinePreLearner._held_out(stub, ep) for ep in eps]
    assert held == [is_held_out(ep.id_, F) for ep in eps]
    assert held == [HoldoutSplit(F, held_out=True)(ep.id_) for ep in eps]
    assert held != [is_held_out(ep.multi_agent_episode_id, F) for ep in eps]


def test_held_out_steps_read_each_multi_agent_shard_once(spread, monkeypatch):
    """The split by multi-agent episode takes its ids from the shard the steps came from."""
    from collections import Counter

    from rlrec.store.snapshot import Snapshot

    root, rows = spread
    reads: Counter[str] = Counter()
    gated = Snapshot._gated

    def counted(self, entry):
        reads[entry.path] += 1
        return gated(self, entry)

    monkeypatch.setattr(Snapshot, "_gated", counted)
    snap = open_snapshot(root).subset(keep_episode=HoldoutSplit(F, held_out=True))
    held = set(snap.steps()["episode_id"].to_pylist())
    assert held and held < {r.episode_id for r in rows}
    assert sorted(reads) == sorted(e.path for e in snap.entries) and set(reads.values()) == {1}
