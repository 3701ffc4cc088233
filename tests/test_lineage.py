"""Lineage: which data trained which policy version, reopened exactly (docs/TRAINER.md, "Lineage").

The fast tests check the pieces on real local stores (`cursor_covering`, `Snapshot.subset`,
`rlrec.open`'s argument errors). The slow ones train with the real trainer (Ray, BC) on two
partition logs, publish signed versions, commit more data afterwards, and reopen each version's
trained and held-out data from its signed lineage: compared by episode id with the episodes of
the shards the trainer's checkpoint says it trained on, split by the held-out rule.
"""

from __future__ import annotations

import doctest
import hashlib
import importlib
import json
import os
import shutil
import threading
import time
import warnings

import pytest

import rlrec
from rlrec.store.commit import ShardCommitter
from rlrec.store.manifest import read_manifest
from rlrec.store.snapshot import Cursor, CursorError, cursor_covering, open_snapshot
from rlrec.store.storage import Storage
from rlrec.trainer.holdout import is_held_out
from rlrec.trainer.lineage import LineageError, list_lineages, read_version_lineage
from rlrec.trainer.synthetic import expert_cartpole_episodes
from tests.helpers import read_metrics

HOLDOUT = 0.3


def _ids(snap) -> list[str]:
    return sorted(set(snap.steps().column("episode_id").to_pylist()))


def _shard_ids(root: str, paths) -> set[str]:
    """Episode ids of the shards at `paths`, read directly from their files (not via a snapshot)."""
    from rlrec.store.shards import read_episodes

    st = Storage.from_uri(root)
    return {ep.id_ for p in paths for ep in read_episodes(st.read(p))}


# ------------------------------------------------------------------------------ the pieces


def test_cursor_covering_reopens_exactly_the_given_entries_across_logs(tmp_path):
    root = str(tmp_path / "s")
    c0, c1 = ShardCommitter(root, "rl", 0), ShardCommitter(root, "rl", 1)
    for i in range(3):
        c0.commit(expert_cartpole_episodes(2, seed=i, max_steps=20))
        c1.commit(expert_cartpole_episodes(2, seed=10 + i, max_steps=20))
    snap = open_snapshot(root)
    # the cursor of every entry is the snapshot's own (same tag: same first-entry identities)
    assert cursor_covering(root, snap.entries) == Cursor.parse(snap.cursor)
    chosen = [e for e in snap.entries if (e.partition, e.seq) in {(0, 1), (1, 2)}]
    point = cursor_covering(root, chosen)
    assert dict(point.positions) == {("rl", 0): chosen[0].seq + 1, ("rl", 1): chosen[1].seq + 1}
    c0.commit(expert_cartpole_episodes(2, seed=99, max_steps=20))  # later data does not leak in
    again = open_snapshot(root, as_of=str(point)).subset([e.path for e in chosen])
    assert [e.path for e in again.entries] == sorted(e.path for e in chosen)
    assert _ids(again) == sorted(_shard_ids(root, [e.path for e in chosen]))
    # the whole point holds the earlier entries of partition 0 too; the subset does not
    assert len(open_snapshot(root, as_of=str(point)).entries) > len(chosen)


def test_cursor_covering_names_the_same_store_after_manifest_snapshots(tmp_path):
    """Logs whose early entries are summarised by snapshot entries give the same tag."""
    root = str(tmp_path / "s")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    for i in range(8):
        c.commit(expert_cartpole_episodes(1, seed=i, max_steps=10))
    snap = open_snapshot(root)
    point = cursor_covering(root, snap.entries)  # ends at the last shard entry, before the last snapshot entry
    assert point.tag == Cursor.parse(snap.cursor).tag
    assert open_snapshot(root, as_of=str(point)).entries == snap.entries
    assert open_snapshot(root, as_of=str(cursor_covering(root, snap.entries[:2]))).entries == snap.entries[:2]


def test_entries_reopen_the_same_episodes_after_compaction_merged_them_with_others(tmp_path):
    """`open_entries` reads shard entries' episodes from whatever holds them now: the same ids
    and steps before and after a compaction that merged them with entries not asked for (and
    after a second compaction merging the merged shard again), under the same selection."""
    from rlrec.store.compaction import compact_partition
    from rlrec.store.snapshot import open_entries

    root = str(tmp_path / "s")
    c = ShardCommitter(root, "rl", 0)
    for i in range(6):
        c.commit(expert_cartpole_episodes(2, seed=i, max_steps=20))
    shard_seqs = [e.seq for e in open_snapshot(root).entries]
    asked = {("rl", 0): [(shard_seqs[1], shard_seqs[3] + 1)]}
    before = open_entries(root, asked)
    want = _shard_ids(root, [e.path for e in before.entries])
    assert len(before.entries) == 3 and _ids(before) == sorted(want) and len(want) == 6
    steps_before = before.num_steps
    with pytest.raises(CursorError, match="past the cursor"):
        open_entries(
            root, asked, within=open_snapshot(root, as_of=str(cursor_covering(root, before.entries[:1]))).cursor
        )

    assert compact_partition(c.log, min_age_s=0).written == 1  # all six into one shard
    after = open_entries(root, asked)
    assert len(after.entries) == 1 and after.entries[0].seq not in shard_seqs  # the merged shard
    assert _ids(after) == sorted(want) and after.num_steps == steps_before
    assert after.selection == before.selection and after.cursor != before.cursor
    # a trainer that trained seqs 1-3 and a shard committed after the replacement: its lineage
    # cursor holds the replace entry, so its data is read from the merged shard
    from rlrec.trainer.lineage import Lineage, _trained_data, files_needed

    c.commit(expert_cartpole_episodes(2, seed=50, max_steps=20))
    newest = open_snapshot(root)
    late = max(newest.entries, key=lambda e: e.seq)
    doc = {"cursor": newest.cursor, "trained": [["rl", 0, [[shard_seqs[1], shard_seqs[4]], [late.seq, late.seq + 1]]]]}
    lin = Lineage.from_doc(7, doc, signed=True)
    assert files_needed(root, lin) == {after.entries[0].path, late.path}
    assert _ids(_trained_data(root, lin)) == sorted(want | _shard_ids(root, [late.path]))
    for i in range(6, 9):
        c.commit(expert_cartpole_episodes(2, seed=i, max_steps=20))
    assert compact_partition(c.log, min_age_s=0).written == 1  # the merged shard merged again
    again = open_entries(root, asked)
    assert _ids(again) == sorted(want) and again.num_steps == steps_before
    assert {ep.id_ for ep in again.episodes()} == want and again.steps().num_rows == steps_before
    with pytest.raises(CursorError, match="entry 0 is no shard entry"):  # the claim
        open_entries(root, {("rl", 0): [(0, 1)]})
    with pytest.raises(CursorError, match="past the end of its log"):  # a forged range: no list of 10**12 seqs
        open_entries(root, {("rl", 0): [(0, 10**12)]})


def test_entries_tell_a_reused_episode_id_apart_per_shard(tmp_path):
    """An id reused in another log: the entry asked for is read once, the other never, also when
    compaction merged the other one with an entry asked for."""
    import dataclasses

    from rlrec.store.compaction import compact_partition
    from rlrec.store.snapshot import open_entries

    root = str(tmp_path / "s")
    c0, c1 = ShardCommitter(root, "rl", 0), ShardCommitter(root, "rl", 1)
    a = expert_cartpole_episodes(2, seed=1, max_steps=20)
    c0.commit(a)
    twin = dataclasses.replace(expert_cartpole_episodes(1, seed=2, max_steps=30)[0], episode_id=a[0].episode_id)
    c1.commit([twin, *expert_cartpole_episodes(1, seed=3, max_steps=20)])  # not asked for
    later = expert_cartpole_episodes(2, seed=4, max_steps=20)
    c1.commit(later)
    s0 = [e.seq for e in open_snapshot(root).entries if e.partition == 0]
    s1 = [e.seq for e in open_snapshot(root).entries if e.partition == 1]
    asked = {("rl", 0): [(s0[0], s0[0] + 1)], ("rl", 1): [(s1[1], s1[1] + 1)]}
    before = open_entries(root, asked)
    assert compact_partition(c1.log, min_age_s=0).written == 1
    after = open_entries(root, asked)
    for snap in (before, after):
        steps = snap.steps()
        ids = steps.column("episode_id").to_pylist()
        assert ids.count(a[0].episode_id) == a[0].length  # the twin (30 steps) is not read
        assert steps.num_rows == sum(e.length for e in a + later)
        assert len(set(ids)) == 4 and snap.num_episodes == 4
        assert sorted(str(ep.id_) for ep in snap.episodes()) == sorted(set(ids))
    assert before.steps().num_rows == after.steps().num_rows


def test_entries_refuse_points_past_a_logs_end_and_merge_overlapping_ranges(tmp_path):
    from rlrec.store.compaction import compact_partition
    from rlrec.store.snapshot import open_entries

    root = str(tmp_path / "s")
    c = ShardCommitter(root, "rl", 0)
    for i in range(6):
        c.commit(expert_cartpole_episodes(2, seed=i, max_steps=20))
    snap = open_snapshot(root)
    seqs = [e.seq for e in snap.entries]
    tag = Cursor.parse(snap.cursor).tag
    with pytest.raises(CursorError, match="unknown point"):  # a store restored from an older backup
        open_entries(root, {("rl", 0): [(seqs[0], seqs[1])]}, within=str(Cursor({("rl", 0): 100}, tag)))
    whole = open_entries(root, {("rl", 0): [(seqs[0], seqs[-1] + 1)]})
    overlapping = open_entries(root, {("rl", 0): [(seqs[1], seqs[-1] + 1), (seqs[0], seqs[2]), (seqs[2], seqs[3])]})
    assert overlapping.selection == whole.selection and _ids(overlapping) == _ids(whole)
    # changes of a version's data: the episodes of its entries from `since` on, after a compaction too
    since = str(cursor_covering(root, snap.entries[:3]))
    want = sorted(_shard_ids(root, [e.path for e in snap.entries[3:]]))
    assert _ids(whole.changes(since)) == want
    assert compact_partition(c.log, min_age_s=0).written == 1
    merged = open_entries(root, {("rl", 0): [(seqs[0], seqs[-1] + 1)]})
    new = merged.changes(since)
    assert _ids(new) == want and new.num_steps == sum(e.steps for e in snap.entries[3:])
    assert new.selection not in (None, merged.selection)


def test_subset_filters_every_reader_and_refuses_unknown_shards(tmp_path):
    root = str(tmp_path / "s")
    c = ShardCommitter(root)
    for i in range(3):
        c.commit(expert_cartpole_episodes(5, seed=i, max_steps=30))
    snap = open_snapshot(root)
    every = _ids(snap)
    keep = {eid for eid in every if is_held_out(eid, 0.5)}
    assert 0 < len(keep) < len(every)
    sub = snap.subset([e.path for e in snap.entries[1:]], keep_episode=lambda eid: eid in keep)
    want = sorted(keep & _shard_ids(root, [e.path for e in snap.entries[1:]]))
    assert _ids(sub) == want
    assert sorted({ep.id_ for ep in sub.episodes()}) == want
    assert sub.num_episodes == len(want) and sub.num_steps == sub.steps().num_rows
    assert len(list(iter(sub.to_torch(columns=("episode_id",))))) == sub.num_steps
    assert _ids(sub.changes(since=sub.cursor)) == []
    assert sub.cursor == snap.cursor and sub.files() == snap.files()[1:]  # whole shards
    with pytest.raises(CursorError, match="not in the snapshot"):
        snap.subset(["rl/00000/not-a-shard.parquet"])


def test_open_refuses_contradicting_arguments_with_one_line(tmp_path):
    root = str(tmp_path / "s")
    ShardCommitter(root).commit(expert_cartpole_episodes(1))
    cur = rlrec.open(root).cursor
    cases = [
        ({"as_of": cur, "policy_version": 1, "policies": root}, "not both"),
        ({"policy_version": 1}, "needs policies="),
        ({"policies": root}, "policies needs policy_version"),
        ({"held_out": True}, "held_out needs policy_version"),
        ({"policy_version": 0, "policies": root}, "1..999999"),
    ]
    for kw, msg in cases:
        with pytest.raises(LineageError, match=msg) as e:
            rlrec.open(root, **kw)
        assert "\n" not in str(e.value)


def test_unknown_version_is_a_clear_error(tmp_path):
    root = str(tmp_path / "s")
    ShardCommitter(root).commit(expert_cartpole_episodes(1))
    (tmp_path / "pol").mkdir()
    with pytest.raises(LineageError, match="policy version 7 is not published under"):
        rlrec.open(root, policy_version=7, policies=str(tmp_path / "pol"))


def _checkpoint(ck: str, **state) -> str:
    """A committed checkpoint under `ck` whose trainer.json holds `state` (no Ray, no RLlib)."""
    from rlrec.trainer.checkpoints import CheckpointStore
    from tests.test_trainer_checkpoints import FakeAlgo

    base = {"version": 1, "iteration": 3, "policy_version": 1, "algo": "BC", "trained_shards": []}
    return CheckpointStore(Storage.from_uri(ck)).save(
        3, FakeAlgo({"learner_group/w": b"1"}), {**base, **state}, policy_version=1
    )


def test_resume_with_another_holdout_fraction_is_refused(tmp_path):
    """The shards trained so far were split with the checkpoint's fraction: a resume with
    another one would record a wrong fraction for them in every later lineage."""
    from rlrec.trainer.checkpoints import ResumeRefused
    from rlrec.trainer.config import OPESettings
    from rlrec.trainer.service import ContinuousTrainer

    ck = str(tmp_path / "ck")
    path = _checkpoint(ck, holdout_fraction=0.1)
    for f in (0.2, 0.0):
        t = ContinuousTrainer(_cfg(str(tmp_path / "in"), ck, resume=True, ope=OPESettings(holdout_fraction=f)))
        with pytest.raises(ResumeRefused, match=r"trained with --holdout-fraction 0\.1, not") as e:
            t._resume_point()
        assert "\n" not in str(e.value)
    same = ContinuousTrainer(_cfg(str(tmp_path / "in"), ck, resume=True, ope=OPESettings(holdout_fraction=0.1)))
    assert same._resume_point()["path"] == path


def test_a_subsets_torch_state_loads_only_into_the_same_selection(tmp_path):
    """The cursor names the whole point; a subset (a version's data) is named by the cursor and
    its selection, so a training loop's state never resumes on other data."""
    import pickle

    from rlrec.trainer.lineage import HoldoutSplit

    root = str(tmp_path / "s")
    c = ShardCommitter(root)
    for i in range(3):
        c.commit(expert_cartpole_episodes(5, seed=i, max_steps=30))
    full = open_snapshot(root)
    paths = [e.path for e in full.entries[1:]]
    sub = full.subset(paths, keep_episode=HoldoutSplit(0.5, held_out=False))
    assert sub.cursor == full.cursor and full.selection is None and sub.selection
    ds = sub.to_torch(columns=("episode_id", "t"))
    it = iter(ds)
    first = [next(it) for _ in range(5)]
    state = ds.state_dict()
    assert state["selection"] == sub.selection
    whole = rlrec.open(root, as_of=state["cursor"]).to_torch(columns=("episode_id", "t"))
    with pytest.raises(ValueError, match="selection"):
        whole.load_state_dict(state)
    with pytest.raises(ValueError, match="selection"):
        sub.to_torch().load_state_dict(whole.state_dict())
    other = open_snapshot(root, as_of=state["cursor"]).subset(paths, keep_episode=HoldoutSplit(0.5, held_out=True))
    with pytest.raises(ValueError, match="selection"):
        other.to_torch().load_state_dict(state)
    # the same selection, rebuilt (another process: a pickled filter) continues after the steps handed out
    again = open_snapshot(root, as_of=state["cursor"]).subset(
        paths, keep_episode=pickle.loads(pickle.dumps(sub.keep_episode))
    )
    assert again.selection == sub.selection
    ds2 = again.to_torch(columns=("episode_id", "t"))
    ds2.load_state_dict(state)
    reads = []
    real = again.shard_steps
    again.shard_steps = lambda e: reads.append(e.path) or real(e)
    rest = list(iter(ds2))
    assert sorted(reads) == sorted(paths)  # each shard read once: counted and handed out from one read
    past = again.to_torch()
    past.load_state_dict({**state, "position": 10**6})  # past its end: found while reading
    with pytest.raises(ValueError, match="bad position"):
        list(iter(past))
    every = list(iter(again.to_torch(columns=("episode_id", "t"))))
    key = [(r["episode_id"], int(r["t"])) for r in first + rest]
    assert key == [(r["episode_id"], int(r["t"])) for r in every]
    # a subset of a subset: both filters, picklable
    inner = sub.subset(keep_episode=HoldoutSplit(0.2, held_out=False))
    assert inner.selection not in (None, sub.selection)
    assert pickle.loads(pickle.dumps(inner.keep_episode))("x") == inner.keep_episode("x")


def test_a_holdout_fraction_the_prelearner_would_not_apply_is_refused(tmp_path):
    """Only a SafeOfflinePreLearner drops the held-out episodes: with stock RLlib's class a
    lineage would record F for episodes that were trained on. Refused before Ray starts."""
    from ray.rllib.algorithms.bc import BCConfig

    from rlrec.errors import UsageError
    from rlrec.trainer.config import OPESettings
    from rlrec.trainer.data import configure_continuous

    stock = "ray.rllib.offline.offline_prelearner.OfflinePreLearner"
    safe = "rlrec.trainer.prelearner.SafeOfflinePreLearner"
    ins, ck = str(tmp_path / "in"), str(tmp_path / "ck")
    with pytest.raises(UsageError, match="needs a prelearner_class that subclasses") as e:
        _cfg(ins, ck, offline_config={"prelearner_class": stock}).check_inputs()
    assert "\n" not in str(e.value) and "OfflinePreLearner would train on them" in str(e.value)
    _cfg(ins, ck, offline_config={"prelearner_class": stock}, ope=OPESettings(holdout_fraction=0.0)).check_inputs()
    _cfg(ins, ck, offline_config={"prelearner_class": safe}).check_inputs()
    from ray.rllib.offline.offline_prelearner import OfflinePreLearner

    config = BCConfig().offline_data(prelearner_class=OfflinePreLearner)
    with pytest.raises(ValueError, match="needs a prelearner_class"):
        configure_continuous(config, ins, fmt="tabular", holdout_fraction=HOLDOUT)


def test_the_lineage_cursor_needs_no_follower_entry_and_a_lost_shard_stops_the_trainer(tmp_path):
    """The trainer keeps the manifest positions of what it trained in its checkpoint: a resume
    that selects other shards (another --policy-id, version bounds) still publishes a lineage
    of the shards trained before; an old checkpoint gets them from the manifest; a trained shard
    in no partition log stops the trainer (exit code 1) instead of never publishing again."""
    from rlrec.errors import exit_code_for
    from rlrec.trainer.lineage import ranges_doc
    from rlrec.trainer.service import ContinuousTrainer, LineageLost

    root = str(tmp_path / "s")
    c0, c1 = ShardCommitter(root, "rl", 0), ShardCommitter(root, "rl", 1)
    for i in range(3):
        c0.commit(expert_cartpole_episodes(1, seed=i, max_steps=10))
        c1.commit(expert_cartpole_episodes(1, seed=10 + i, max_steps=10))
    entries = open_snapshot(root).entries
    trained = [e for e in entries if e.seq < 2]
    want = str(cursor_covering(root, trained))

    def resumed(state: dict) -> ContinuousTrainer:
        t = ContinuousTrainer(_cfg(root, str(tmp_path / "ck"), policy_id="another-policy"))
        t.trained = {e.path for e in trained}
        t._restore_ranges(state)  # t.algo is None: the follower knows no entry
        return t

    saved = resumed({})  # positions from the manifest (a checkpoint without them)
    kept = ranges_doc(saved.trained_ranges)
    assert kept == [["rl", 0, [[1, 2]]], ["rl", 1, [[1, 2]]]]  # seq 0 of each log: its writer's claim
    for state in ({"trained_ranges": kept}, {}):
        lineage = resumed(state)._lineage()
        assert lineage["data"]["cursor"] == want and lineage["data"]["trained"] == kept
        assert lineage["data"]["shards_trained"] == len(trained)
    lost = resumed({})
    lost.trained.add("rl/00000/gone.parquet")
    lost._note_trained({"rl/00000/gone.parquet"})
    with pytest.raises(LineageLost, match="in no partition log") as e:
        lost.publish()
    assert exit_code_for(e.value) == 1 and "\n" not in str(e.value)
    gone = resumed({"trained_ranges": [*kept, ["rl", 7, [[1, 2]]]]})  # a log no longer in the input
    with pytest.raises(LineageLost, match="rl/7 has no manifest entries"):
        gone.publish()
    # compaction replaced the trained shards since: a checkpoint without ranges still finds them
    from rlrec.store.compaction import compact_partition

    assert compact_partition(c0.log, min_age_s=0).written == 1
    assert not {e.path for e in trained} <= {e.path for e in open_snapshot(root).entries}
    after = resumed({})
    assert ranges_doc(after.trained_ranges) == kept and after._lineage()["data"]["trained"] == kept
    # a merged shard trained in place of removed shard entries (a follower started after
    # retention): its lineage names the entries it stands for, which reopen its episodes
    merged = next(e for e in open_snapshot(root).entries if e.partition == 0 and e.seq > 3)
    m = ContinuousTrainer(_cfg(root, str(tmp_path / "ck"), policy_id="another-policy"))
    m.trained = {merged.path}
    m._restore_ranges({})
    assert ranges_doc(m.trained_ranges) == [["rl", 0, [[1, 4]]]]  # the three shard entries of rl/0
    from rlrec.store.snapshot import open_entries

    assert _ids(open_entries(root, m.trained_ranges)) == sorted(merged.episode_ids)


def test_a_missing_publish_root_is_an_error_and_an_unreadable_version_one_row(tmp_path, capsys):
    from rlrec.cli import main
    from rlrec.trainer.lineage import Lineage

    root = str(tmp_path / "s")
    ShardCommitter(root).commit(expert_cartpole_episodes(1))
    with pytest.raises(LineageError, match="no publish root at"):
        list_lineages(str(tmp_path / "polcies"))  # mistyped
    assert main(["inspect", root, "--policies", str(tmp_path / "polcies")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlrec inspect: error: no publish root at") and "\n" not in err, err
    pol = tmp_path / "pol"
    (pol / "v000001" / "policy.json").mkdir(parents=True)  # unreadable as a file: an OSError
    (pol / "v000002").mkdir()
    rows = list_lineages(str(pol))
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert "IsADirectoryError" in rows[0]["error"] and "is not published" in rows[1]["error"]
    with pytest.raises(LineageError, match="not an rlrec cursor"):
        Lineage.from_doc(1, {"cursor": "[red]x[/red]", "shards": []}, True)


def _publish_version(
    pol: str,
    version: int,
    store: str,
    priv: str,
    *,
    run_id: str,
    channel: str = "default",
    fraction: float = HOLDOUT,
    skip: str | None = None,
    trained_before: list | None = None,
) -> None:
    """Publish a signed CartPole BC policy `version` under `pol` whose lineage names every shard
    of `store` but `skip` at its newest cursor (as `rlrec train` publishes one; no Ray), and
    `trained_before` (what the version before had trained on) when given."""
    import gymnasium as gym
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rlrec.trainer.export import build_artifact, publish_policy
    from rlrec.trainer.service import ALGORITHMS, _import
    from rlrec.trainer.signing import load_private_key

    env = gym.make("CartPole-v1")
    obs, act = env.observation_space, env.action_space
    config = _import(ALGORITHMS["BC"][0])().environment(observation_space=obs, action_space=act)
    module = config.get_multi_rl_module_spec(spaces={DEFAULT_MODULE_ID: (obs, act)}).build()
    from rlrec.trainer.lineage import add_seq, ranges_doc

    entries = [e for e in open_snapshot(store).entries if e.path != skip]  # `skip`: below the cursor, not trained
    shards = [e.path for e in entries]
    ranges: dict = {}
    for e in entries:
        add_seq(ranges.setdefault((e.topic, e.partition), []), e.seq)
    data = {
        "input": Storage.from_uri(store).uri(),
        "cursor": str(cursor_covering(store, entries)),
        "trained": ranges_doc(ranges),
        "shards_trained": len(shards),
    }
    publish_policy(
        Storage.from_uri(pol),
        algo=None,
        version=version,
        algo_name="BC",
        observation_space=obs,
        action_space=act,
        iteration=1,
        timesteps_trained=0,
        shards=None,
        new_shards=shards,
        data={
            **data,
            "holdout_fraction": fraction,
            **({} if trained_before is None else {"trained_before": trained_before}),
        },
        parent_version=None,
        signing_key=load_private_key(priv),
        artifact=build_artifact(module[DEFAULT_MODULE_ID].eval(), obs, act),
        run_id=run_id,
        channel=channel,
    )


def test_a_pinned_run_or_channel_refuses_a_version_of_another_and_another_input_name_warns(tmp_path):
    from rlrec.trainer.lineage import LineageInputWarning
    from rlrec.trainer.signing import generate_keys

    root = str(tmp_path / "s")
    c = ShardCommitter(root)
    for i in range(3):
        c.commit(expert_cartpole_episodes(4, seed=i, max_steps=20))
    skipped = open_snapshot(root).entries[1].path  # below the cursor, not trained (e.g. refused by the gate)
    priv, pub = generate_keys(tmp_path / "keys")
    pol = str(tmp_path / "pol")
    _publish_version(pol, 1, root, str(priv), run_id="run-a", channel="cartpole", skip=skipped)
    kw = {"policy_version": 1, "policies": pol, "public_key": str(pub)}
    for pin, msg in (
        ({"run_id": "run-b"}, "run id 'run-a', not the pinned 'run-b'"),
        ({"channel": "other"}, "channel"),
    ):
        with pytest.raises(LineageError, match=msg) as e:
            rlrec.open(root, **kw, **pin)
        assert "\n" not in str(e.value)
    with pytest.raises(LineageError, match="run_id needs policy_version"):
        rlrec.open(root, run_id="run-a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the store by the name it was trained on: no warning
        snap = rlrec.open(root, **kw, run_id="run-a", channel="cartpole")
    every = _shard_ids(root, [e.path for e in open_snapshot(root).entries if e.path != skipped])
    assert _ids(snap) == sorted(i for i in every if not is_held_out(i, HOLDOUT))  # the trained ranges reopened
    assert not set(_ids(snap)) & _shard_ids(root, [skipped]) and skipped not in {e.path for e in snap.entries}
    alias = tmp_path / "alias"
    alias.symlink_to(root)
    with pytest.warns(LineageInputWarning, match="the same store by another name"):
        assert rlrec.open(str(alias), **kw).num_episodes == snap.num_episodes


def test_a_lineage_names_its_shards_in_ranges_that_do_not_grow_with_each_shard(tmp_path):
    """lineage.json records the trained shards as manifest seq ranges per partition log: their
    number grows with the manifest's snapshot entries and gaps, not with every shard."""
    from rlrec.trainer.lineage import Lineage
    from rlrec.trainer.service import ContinuousTrainer

    root = str(tmp_path / "s")
    c = ShardCommitter(root, "rl", 0, snapshot_every=50)
    for i in range(120):
        c.commit(expert_cartpole_episodes(1, seed=i, max_steps=5))
    entries = open_snapshot(root).entries
    skipped = entries[30].path  # e.g. refused by the schema gate: below the cursor, not trained
    t = ContinuousTrainer(_cfg(root, str(tmp_path / "ck")))
    t.trained = {e.path for e in entries if e.path != skipped}
    t._note_trained(t.trained)  # t.algo is None: entries from the manifest
    lineage = t._lineage()
    ranges = lineage["data"]["trained"][0][2]
    assert lineage["shards"] is None and len(ranges) <= 5, ranges  # the gap, and the manifest's snapshot entries
    doc = {**lineage["data"], "new_shards": []}
    lin = Lineage.from_doc(1, doc, True)
    snap = open_snapshot(root, as_of=lin.cursor)
    assert sorted(lin.shard_paths(snap.entries)) == sorted(t.trained) and lin.num_shards == len(t.trained)
    assert len(json.dumps(lineage["data"]["trained"])) < 200


def test_held_out_of_a_version_that_held_nothing_out_is_an_error_and_a_null_id_splits_as_none(tmp_path):
    from rlrec.trainer.lineage import HoldoutSplit
    from rlrec.trainer.signing import generate_keys

    root = str(tmp_path / "s")
    ShardCommitter(root).commit(expert_cartpole_episodes(3, max_steps=20))
    priv, pub = generate_keys(tmp_path / "keys")
    pol = str(tmp_path / "pol")
    _publish_version(pol, 1, root, str(priv), run_id="run-a", fraction=0.0)
    kw = {"policy_version": 1, "policies": pol, "public_key": str(pub)}
    assert rlrec.open(root, **kw).num_episodes == 3
    with pytest.raises(LineageError, match="held nothing out"):
        rlrec.open(root, **kw, held_out=True)
    for f in (0.3, 0.7):  # a tabular shard's null eps_id: the trainer splits it by the text "None"
        assert HoldoutSplit(f, held_out=True)(None) == is_held_out("None", f)


def test_export_of_a_version_reads_each_shard_once_and_prints_how_to_export_it_again(tmp_path, capsys, monkeypatch):
    import pyarrow.parquet as pq

    from rlrec.cli import main
    from rlrec.store.snapshot import Snapshot
    from rlrec.trainer.signing import generate_keys

    root = str(tmp_path / "s")
    c = ShardCommitter(root)
    ids: list[str] = []
    while len(ids) < 12 or not any(is_held_out(i, HOLDOUT) for i in ids):  # ids are random: 1.4% hold none out
        ids += [fe.episode_id for fe in c.commit(expert_cartpole_episodes(4, seed=len(ids) // 4, max_steps=20)).written]
    priv, pub = generate_keys(tmp_path / "keys")
    pol = str(tmp_path / "pol")
    _publish_version(pol, 1, root, str(priv), run_id="run-a")
    reads = []
    real = Snapshot.shard_steps
    monkeypatch.setattr(Snapshot, "shard_steps", lambda self, e: reads.append(e.path) or real(self, e))
    dest = tmp_path / "v1"
    argv = ["export", root, str(dest), "--to", "parquet", "--policy-version", "1", "--policies", pol]
    assert main([*argv, "--public-key", str(pub), "--held-out"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == f"--policy-version 1 --policies {pol} --held-out"
    assert sorted(reads) == sorted(e.path for e in open_snapshot(root).entries)  # once each
    held = sorted(set(pq.read_table(dest).column("episode_id").to_pylist()))
    assert held and held == sorted(i for i in _shard_ids(root, reads) if is_held_out(i, HOLDOUT))
    assert f"steps of {len(held)} episodes" in err
    meta = pq.read_schema(next(dest.iterdir())).metadata
    assert meta[b"rlrec.lineage"] == out.strip().encode() and b"rlrec.cursor" not in meta


def test_docstring_examples():
    for module in ("rlrec.reading", "rlrec.store.snapshot", "rlrec.trainer.lineage"):
        result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module


# ------------------------------------------------------------------------------ with the trainer


def _cfg(out, ck, **kw):
    from rlrec.trainer.config import OPESettings, TrainerConfig

    base = {
        "input": out,
        "checkpoint_dir": ck,
        "algo": "BC",
        "poll_interval_s": 0.2,
        "progress": False,
        "promotion_gate": "off",  # every checkpoint's policy published (the default gates them)
        "cache_ttl_s": 1.0,
        "algo_config": {"train_batch_size_per_learner": 128, "lr": 1e-3},
        "offline_config": {"dataset_num_iters_per_learner": 3},
        "ope": OPESettings(holdout_fraction=HOLDOUT),
    }
    base.update(kw)
    return TrainerConfig(**base)


def _wait(pred, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _trained_keys(ck: str) -> set[str]:
    return set().union(*(set(r.get("new_shards", ())) for r in read_metrics(ck)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two signed versions of a real trainer: v1 trained on batch A (two partition logs), v2 on
    A and B; batch C is committed after training. Returns paths, keys and each version's
    trained shard set (from the trainer's checkpoint state at its publication)."""
    import ray

    from rlrec.trainer.service import ContinuousTrainer
    from rlrec.trainer.signing import generate_keys

    tmp = tmp_path_factory.mktemp("lineage")
    out, ck = str(tmp / "out"), str(tmp / "ck")
    priv, pub = generate_keys(tmp / "keys")
    c0, c1 = ShardCommitter(out, "rl", 0), ShardCommitter(out, "rl", 1)
    st = Storage.from_uri(out)

    def commit(seed: int) -> None:
        c0.commit(expert_cartpole_episodes(10, seed=seed, max_steps=60))
        c1.commit(expert_cartpole_episodes(10, seed=seed + 1, max_steps=60))

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        commit(0)
        batch_a = {e.path for e in read_manifest(st)}
        a = ContinuousTrainer(_cfg(out, ck, signing_key=str(priv), checkpoint_interval=1000))
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("rc", a.run()), daemon=True)
        t.start()
        _wait(lambda: _trained_keys(ck) >= batch_a, 120, "batch A trained")
        a.stop("test")
        t.join(90)
        v1_state = {"trained": set(a.trained), "version": a.policy_version}
        commit(100)
        batch_ab = {e.path for e in read_manifest(st)}
        b = ContinuousTrainer(_cfg(out, ck, signing_key=str(priv), checkpoint_interval=1000, resume=True))
        t = threading.Thread(target=lambda: box.setdefault("rc2", b.run()), daemon=True)
        t.start()
        _wait(lambda: _trained_keys(ck) >= batch_ab, 120, "batch B trained")
        b.stop("test")
        t.join(90)
        v2_state = {"trained": set(b.trained), "version": b.policy_version}
    finally:
        ray.shutdown()
    commit(200)  # after training: in the store, in no version's data
    return {
        "out": out,
        "policies": os.path.join(ck, "policies"),
        "private": str(priv),
        "public": str(pub),
        "versions": {v1_state["version"]: v1_state["trained"], v2_state["version"]: v2_state["trained"]},
        "batch_a": batch_a,
        "batch_ab": batch_ab,
    }


@pytest.mark.slow
def test_each_version_reopens_exactly_the_episodes_it_trained_on_and_held_out(trained):
    out, pol, pub = trained["out"], trained["policies"], trained["public"]
    assert sorted(trained["versions"]) == [1, 2]
    assert trained["versions"][1] == trained["batch_a"] and trained["versions"][2] == trained["batch_ab"]
    everything = _shard_ids(out, [e.path for e in read_manifest(Storage.from_uri(out))])
    for version, shards in trained["versions"].items():
        lineage = json.load(open(os.path.join(pol, f"v{version:06d}", "lineage.json")))
        lin = read_version_lineage(pol, version, public_key=pub)
        assert set(lin.shard_paths(open_snapshot(out, as_of=lin.cursor).entries)) == shards
        assert "shards" not in lineage and lineage["shards_trained"] == len(shards) == lin.num_shards
        assert lineage["holdout_fraction"] == HOLDOUT
        assert lineage["input"] == Storage.from_uri(out).uri() and lineage["cursor"].startswith("r1~")
        ids = _shard_ids(out, shards)
        want_trained = sorted(i for i in ids if not is_held_out(i, HOLDOUT))
        want_held = sorted(i for i in ids if is_held_out(i, HOLDOUT))
        assert want_trained and want_held  # the split is not empty on either side
        got = rlrec.open(out, policy_version=version, policies=pol, public_key=pub)
        held = rlrec.open(out, policy_version=version, policies=pol, public_key=pub, held_out=True)
        assert _ids(got) == want_trained and _ids(held) == want_held
        assert sorted({ep.id_ for ep in got.episodes()}) == want_trained
        assert got.cursor == lineage["cursor"] and len(everything) > len(ids)  # later data left out
        # the cursor alone reopens the same point: every shard up to it is one the version trained on
        assert {e.path for e in open_snapshot(out, as_of=lineage["cursor"]).entries} == shards


@pytest.mark.slow
def test_each_version_reopens_the_same_data_after_its_shards_are_compacted(trained, tmp_path):
    """Compaction merges trained shards with shards committed after training: each version's
    data is still exactly what it trained on and held out, read from the merged shards, and
    `files_needed` (what retention must keep) names the merged shards, not the replaced ones."""
    from rlrec.cli import main
    from rlrec.trainer.lineage import files_needed

    out, pol, pub = trained["out"], trained["policies"], trained["public"]
    copy = str(tmp_path / "out")
    shutil.copytree(out, copy)
    want = {
        v: (
            _ids(rlrec.open(out, policy_version=v, policies=pol, public_key=pub)),
            _ids(rlrec.open(out, policy_version=v, policies=pol, public_key=pub, held_out=True)),
        )
        for v in trained["versions"]
    }
    assert main(["compact", copy, "--min-age", "0", "--force"]) == 0
    live = {e.path for e in read_manifest(Storage.from_uri(copy))}
    assert not live & trained["batch_ab"]  # every trained shard was replaced
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the copy is the same store under another name
        for v, (trained_ids, held_ids) in want.items():
            got = rlrec.open(copy, policy_version=v, policies=pol, public_key=pub)
            held = rlrec.open(copy, policy_version=v, policies=pol, public_key=pub, held_out=True)
            assert _ids(got) == trained_ids and _ids(held) == held_ids
            assert got.num_steps == rlrec.open(out, policy_version=v, policies=pol, public_key=pub).num_steps
            lin = read_version_lineage(pol, v, public_key=pub)
            assert files_needed(copy, lin) == {e.path for e in got.entries} and files_needed(copy, lin) <= live
            assert files_needed(out, lin) == trained["versions"][v]  # before compaction: its own shards


@pytest.mark.slow
def test_tampered_or_unsigned_lineage_is_refused(trained, tmp_path, monkeypatch):
    pol = tmp_path / "pol"
    shutil.copytree(trained["policies"], pol)
    out, pub = trained["out"], trained["public"]
    lineage_file = pol / "v000001" / "lineage.json"
    doc = json.loads(lineage_file.read_text())
    doc["cursor"] = json.loads((pol / "v000002" / "lineage.json").read_text())["cursor"]  # claim more data
    lineage_file.write_text(json.dumps(doc))
    with pytest.raises(LineageError, match=r"lineage\.json does not match the sha256 in policy\.json") as e:
        rlrec.open(out, policy_version=1, policies=str(pol), public_key=pub)
    assert "\n" not in str(e.value)
    # re-pinning the edited lineage in policy.json breaks its signature
    spec_file = pol / "v000001" / "policy.json"
    spec = json.loads(spec_file.read_text())
    spec["files"]["lineage.json"] = hashlib.sha256(lineage_file.read_bytes()).hexdigest()
    spec_file.write_text(json.dumps(spec))
    with pytest.raises(LineageError, match="signature does not verify"):
        rlrec.open(out, policy_version=1, policies=str(pol), public_key=pub)
    # without a key nothing is verified: refused unless allow_unsigned
    monkeypatch.delenv("RLREC_POLICY_PUBLIC_KEY", raising=False)
    with pytest.raises(LineageError, match="is not signed"):
        rlrec.open(out, policy_version=2, policies=str(pol))
    with pytest.warns(UserWarning, match="unsigned"):
        snap = rlrec.open(out, policy_version=2, policies=str(pol), allow_unsigned=True)
    assert snap.cursor == json.loads((pol / "v000002" / "lineage.json").read_text())["cursor"]


@pytest.mark.slow
def test_a_lineage_without_a_cursor_is_refused_clearly(trained, tmp_path):
    """A version published before lineage recorded cursors (its lineage lists shards only),
    signed like any other: readable, but its data cannot be reopened exactly."""
    from rlrec.trainer.signing import load_private_key, sign

    pol = tmp_path / "pol"
    shutil.copytree(trained["policies"], pol)
    d = pol / "v000001"
    doc = json.loads((d / "lineage.json").read_text())
    old = {k: doc[k] for k in ("policy_version", "parent_version", "iteration", "new_shards")}
    old["shards"] = sorted(trained["versions"][1])  # a lineage of then: its shards listed
    (d / "lineage.json").write_text(json.dumps(old))
    spec = json.loads((d / "policy.json").read_text())
    spec["files"]["lineage.json"] = hashlib.sha256((d / "lineage.json").read_bytes()).hexdigest()
    spec_bytes = json.dumps(spec, indent=1, sort_keys=True).encode()
    (d / "policy.json").write_bytes(spec_bytes)
    (d / "policy.json.sig").write_bytes(sign(load_private_key(trained["private"]), spec_bytes))
    with pytest.raises(LineageError, match="records no manifest cursor") as e:
        rlrec.open(trained["out"], policy_version=1, policies=str(pol), public_key=trained["public"])
    assert "\n" not in str(e.value)
    # still readable: its shards, and listed as having no cursor
    old_lineage = read_version_lineage(str(pol), 1, public_key=trained["public"])
    assert old_lineage.cursor is None and set(old_lineage.shards) == trained["versions"][1]
    rows = list_lineages(str(pol), public_key=trained["public"])
    assert [(r["policy_version"], r["cursor"] is None, r["signed"], r["error"]) for r in rows] == [
        (1, True, True, None),
        (2, False, True, None),
    ]


@pytest.mark.slow
def test_cli_export_inspect_and_report_show_and_reopen_a_versions_data(trained, tmp_path, capsys, monkeypatch):
    import pyarrow.parquet as pq

    from rlrec.cli import main

    out, pol, pub = trained["out"], trained["policies"], trained["public"]
    dest = tmp_path / "v1"
    lineage_flags = ["--policy-version", "1", "--policies", pol, "--public-key", pub]
    assert main(["export", out, str(dest), "--to", "parquet", *lineage_flags]) == 0
    table = pq.read_table(dest)
    want = sorted(i for i in _shard_ids(out, trained["versions"][1]) if not is_held_out(i, HOLDOUT))
    assert sorted(set(table.column("episode_id").to_pylist())) == want
    cursor = json.load(open(os.path.join(pol, "v000001", "lineage.json")))["cursor"]
    # not the bare cursor (it names the whole point): the options that export this data again
    assert capsys.readouterr().out.strip() == f"--policy-version 1 --policies {pol}"
    meta = pq.read_schema(next(dest.iterdir())).metadata
    assert b"rlrec.cursor" not in meta and meta[b"rlrec.lineage_cursor"] == cursor.encode()
    assert meta[b"rlrec.lineage"] == f"--policy-version 1 --policies {pol}".encode()
    # errors: one line, exit 2
    for argv, msg in [
        (["--policy-version", "9", "--policies", pol, "--public-key", pub], "policy version 9 is not published"),
        (["--policy-version", "1"], "--policy-version needs --policies"),
        (["--policy-version", "1", "--policies", pol, "--as-of", cursor], "not both"),
        (["--held-out"], "--held-out needs --policy-version"),
    ]:
        assert main(["export", out, str(tmp_path / "x"), "--to", "parquet", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("rlrec export: error: ") and msg in err and "\n" not in err, err
    # inspect: the lineage table and JSON
    assert main(["inspect", out, "--json", "--policies", pol, "--public-key", pub]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["policy_version"], r["signed"]) for r in doc["lineage"]] == [(1, True), (2, True)]
    assert doc["lineage"][0]["cursor"] == cursor
    assert main(["inspect", out, "--policies", pol, "--public-key", pub]) == 0
    assert cursor in capsys.readouterr().out.replace("\n", "")
    assert main(["inspect", out, "--paths", "--policy-version", "1", "--policies", pol, "--public-key", pub]) == 0
    paths = capsys.readouterr().out.split()
    assert sorted(paths) == sorted(Storage.from_uri(out).uri(p) for p in trained["versions"][1])
    # report: the lineage section names each version's cursor
    monkeypatch.delenv("RLREC_POLICY_PUBLIC_KEY", raising=False)
    report = tmp_path / "r.html"
    assert main(["report", "--input", out, "--policies", pol, "--out", str(report)]) == 0
    html = report.read_text()
    assert 'id="lineage-table"' in html and cursor in html
