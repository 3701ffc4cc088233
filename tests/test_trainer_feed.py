"""Trainer units without Ray: the feed's scheduling, the manifest follower, CLI parsing, space checks,
the policy loader's refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest

from rlrec.store.commit import ShardCommitter
from rlrec.store.storage import Storage
from rlrec.trainer.feed import TAG_SHIFT, FeedPolicy, FeedState, ShardInfo, shard_of_tag
from rlrec.trainer.manifest_follower import ManifestFollower, spaces_from_shard
from rlrec.trainer.synthetic import expert_cartpole_episodes


def shard(idx, *, t=None, rows=10, steps=1000, fmt="episodes", v=1):
    return ShardInfo(
        idx=idx,
        key=f"p/s{idx}.parquet",
        path=f"p/s{idx}.parquet",
        staging_path=f"p/_staging/s{idx}",
        fmt=fmt,
        rows=rows,
        steps=steps,
        commit_time=float(idx if t is None else t),
        policy_id="p",
        min_policy_version=v,
        max_policy_version=v,
    )


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def drain(st: FeedState, n: int):
    out = []
    for _ in range(n):
        w = st.next_work()
        if w is None:
            break
        out.append(w)
    return out


def test_fresh_shards_are_delivered_oldest_first_in_chunks():
    st = FeedState(FeedPolicy(chunk_steps=500, max_ahead_rows=10**9, fresh_fraction=1.0), clock=Clock())
    st.add_shards([shard(2), shard(1)])
    ws = drain(st, 10)
    # 1000 steps / 10 episodes -> 100 steps per episode -> 5 episodes per chunk -> 2 chunks per shard
    assert [(shard_of_tag(w.tag), w.start, w.stop, w.fresh) for w in ws[:4]] == [
        (1, 0, 5, True),
        (1, 5, 10, True),
        (2, 0, 5, True),
        (2, 5, 10, True),
    ]
    # then delivered-but-unacknowledged shards are read again (the stream never runs dry while
    # their rows may sit in a Learner's shuffle buffer), as replay: not fresh, not yet trained
    assert len(ws) == 10 and all(not w.fresh for w in ws[4:])
    assert st.pop_stats().newly_trained == {}


def test_ack_marks_trained_once_and_feeds_the_replay_window():
    clock = Clock()
    st = FeedState(FeedPolicy(chunk_steps=1000, max_ahead_rows=10**9, fresh_fraction=0.5, seed=1), clock=clock)
    st.add_shards([shard(0), shard(1), shard(2)])
    w0 = st.next_work()
    assert w0.fresh and shard_of_tag(w0.tag) == 0
    st.ack({w0.tag: 100})
    st.ack({w0.tag: 50})
    stats = st.pop_stats()
    assert set(stats.newly_trained) == {"p/s0.parquet"} and stats.rows_trained == 150
    # fresh and replay alternate while both exist (fresh_fraction 0.5)
    kinds = [w.fresh for w in drain(st, 4)]
    assert kinds == [False, True, False, True]
    assert st.window()[0] == 0 and set(st.window()) == {0, 1, 2}  # trained + in flight
    st.ack({(1 << TAG_SHIFT) | 99: 1})
    assert set(st.pop_stats().newly_trained) == {"p/s1.parquet"}


def test_restored_cursor_shards_are_history_not_fresh():
    st = FeedState(FeedPolicy(chunk_steps=1000, max_ahead_rows=10**9), clock=Clock())
    st.add_shards([shard(0), shard(1)], trained_keys={"p/s0.parquet"})
    ws = drain(st, 20)
    assert ws[0].fresh and shard_of_tag(ws[0].tag) == 1
    assert all(not w.fresh for w in ws[1:]) and 0 in {shard_of_tag(w.tag) for w in ws[1:]}
    st.ack({w.tag: 5 for w in ws[1:] if shard_of_tag(w.tag) == 0})
    assert st.pop_stats().newly_trained == {}  # shard 0 was trained before the restart


def test_flow_control_limits_rows_in_flight():
    st = FeedState(FeedPolicy(chunk_steps=1000, max_ahead_rows=2500), clock=Clock())
    st.add_shards([shard(i) for i in range(10)])
    ws = drain(st, 10)
    assert len(ws) == 5  # fresh chunks may fill up to twice the limit
    st.processed([ws[0].tag], 1000)
    assert st.next_work() is None  # produced but not trained: still in flight
    st.ack({w.tag: 1000 for w in ws[:3]})  # 2000 in flight: under 2 x 2500 again
    assert st.next_work().fresh
    # replay only (nothing fresh left): held at the limit itself
    st2 = FeedState(FeedPolicy(chunk_steps=1000, max_ahead_rows=2500), clock=Clock())
    st2.add_shards([shard(i) for i in range(3)], trained_keys={f"p/s{i}.parquet" for i in range(3)})
    assert len(drain(st2, 10)) == 3


def test_missing_shards_are_dropped_and_reported():
    st = FeedState(FeedPolicy(chunk_steps=1000, max_ahead_rows=10**9), clock=Clock())
    st.add_shards([shard(0), shard(1)])
    w = st.next_work()
    st.failed(w.tag)
    st.mark_missing(shard_of_tag(w.tag))
    st.mark_missing(shard_of_tag(w.tag))
    assert st.pop_stats().missing == ["p/s0.parquet"]
    assert all(shard_of_tag(x.tag) == 1 for x in drain(st, 5))


def test_fresh_shard_not_trained_in_time_is_delivered_again():
    clock = Clock()
    st = FeedState(FeedPolicy(chunk_steps=1000, max_ahead_rows=10**9, redeliver_after_s=5), clock=clock)
    st.add_shards([shard(0)])
    w = st.next_work()
    assert w.fresh and not st.next_work().fresh  # in flight: replayable, not fresh again
    clock.t += 6
    w2 = st.next_work()
    assert w2.fresh and shard_of_tag(w2.tag) == 0
    st.ack({w2.tag: 3})
    assert list(st.pop_stats().newly_trained) == ["p/s0.parquet"]


@pytest.mark.parametrize(
    "kw,expected",
    [
        ({"replay_shards": 2}, [3, 4]),
        ({"replay_max_age_s": 2.5}, [3, 4]),  # now=5: commit times 3, 4 are within 2.5 s... 2.5 >= 5-3
        ({"replay_policy_versions": 1}, [2, 3, 4]),  # versions: 0,0,1,1,1
        ({}, [0, 1, 2, 3, 4]),
    ],
)
def test_replay_window(kw, expected):
    st = FeedState(FeedPolicy(max_ahead_rows=10**9, **kw), clock=Clock(5.0))
    st.add_shards([shard(i, v=0 if i < 2 else 1) for i in range(5)], trained_keys={f"p/s{i}.parquet" for i in range(5)})
    assert st.window() == expected


def test_window_never_runs_dry_while_history_exists():
    st = FeedState(FeedPolicy(max_ahead_rows=10**9, replay_max_age_s=1.0), clock=Clock(100.0))
    st.add_shards([shard(0), shard(1)], trained_keys={"p/s0.parquet", "p/s1.parquet"})
    assert st.window() == [1]
    assert st.has_data()


def test_policy_validation():
    with pytest.raises(ValueError):
        FeedPolicy(fresh_fraction=0)
    with pytest.raises(ValueError):
        FeedPolicy(replay_shards=0)


# ------------------------------------------------------------------------------ manifest


def test_manifest_follower_is_incremental_and_filters(tmp_path):
    out = str(tmp_path / "out")
    ca = ShardCommitter(out, partition=0)
    cb = ShardCommitter(out, partition=1)
    ca.commit(expert_cartpole_episodes(2, seed=0, policy_id="a", policy_version=1))
    cb.commit(expert_cartpole_episodes(2, seed=1, policy_id="b", policy_version=1))
    storage = Storage.from_uri(out)
    f = ManifestFollower(storage)
    first = f.poll()
    assert len(first) == 2 and f.poll() == []
    ca.commit(expert_cartpole_episodes(1, seed=2, policy_id="a", policy_version=3))
    new = f.poll()
    assert [s.policy_id for s in new] == ["a"] and new[0].idx == 2
    only_a = ManifestFollower(storage, policy_id="a", min_policy_version=2)
    got = only_a.poll()
    assert [(s.policy_id, s.max_policy_version) for s in got] == [("a", 3)]
    # never a listing: an uncommitted (staged-only or stray) file is invisible
    storage.write("a/stray.parquet", b"x")
    assert f.poll() == []
    obs, act = spaces_from_shard(storage, f.entries[first[0].key])
    assert obs.shape == (4,) and isinstance(act, gym.spaces.Discrete)


# ------------------------------------------------------------------------------ service bits


def test_unsupported_algorithm_space_combinations():
    from rlrec.trainer.service import UnsupportedCombination, _check_spaces

    box = gym.spaces.Box(-1, 1, (3,), np.float32)
    _check_spaces("BC", box, gym.spaces.Discrete(2))
    _check_spaces("CQL", box, gym.spaces.Box(-2, 2, (1,), np.float32))
    with pytest.raises(UnsupportedCombination, match="continuous"):
        _check_spaces("CQL", box, gym.spaces.Discrete(2))
    with pytest.raises(UnsupportedCombination):
        _check_spaces("IQL", box, gym.spaces.Discrete(2))
    with pytest.raises(UnsupportedCombination, match="Box observation"):
        _check_spaces("BC", gym.spaces.Discrete(3), gym.spaces.Discrete(2))


def test_cli_rejects_cql_on_discrete_actions_without_starting_ray(tmp_path):
    out = str(tmp_path / "out")
    ShardCommitter(out).commit(expert_cartpole_episodes(1))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlrec",
            "train",
            "--input",
            out,
            "--algo",
            "CQL",
            "--checkpoint-dir",
            str(tmp_path / "ck"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "CQL cannot train on a Discrete action space" in r.stderr
    assert "Started a local Ray instance" not in r.stderr


def test_load_policy_refuses_missing_and_tampered(tmp_path):
    from rlrec.trainer.policy import PolicyLoadError, load_policy

    with pytest.raises(PolicyLoadError, match="no policy is published"):
        load_policy(str(tmp_path))
    d = tmp_path / "v000001"
    d.mkdir()
    (d / "model.pt").write_bytes(b"not a model")
    (d / "policy.json").write_text(json.dumps({"policy_version": 1, "model_sha256": "0" * 64}))
    (tmp_path / "latest.json").write_text(json.dumps({"policy_version": 1, "path": "v000001"}))
    with pytest.raises(PolicyLoadError, match="sha256"), pytest.warns(UserWarning, match="unsigned TorchScript"):
        load_policy(str(tmp_path), allow_unsigned_code=True)


def test_skipped_episodes_are_counted_once_per_shard():
    """Replays skip an unusable episode again (at random chunk offsets) without counting it again;
    undecodable rows are identified by their row in the shard."""
    st = FeedState(FeedPolicy(chunk_steps=500, max_ahead_rows=10**9, fresh_fraction=1.0), clock=Clock())
    st.add_shards([shard(1)])
    w1, w2 = drain(st, 2)
    st.skipped(w1.tag, ["ep-a", "#1"], "actions holds 7")
    st.skipped(w2.tag, ["ep-b"], "NaN")
    st.skipped(w1.tag, ["ep-a", "#1"], "actions holds 7")  # the same chunk again
    stats = st.pop_stats()
    assert sum(n for _, n, _ in stats.skipped) == 3 and {k for k, _, _ in stats.skipped} == {"p/s1.parquet"}
    replay = (1 << 24) | 999  # a replay delivery of chunk 1 (tag = shard index << 24 | delivery)
    st.pending[replay] = type(st.pending[w2.tag])(1, 1, 0.0, False, start=w1.start)
    st.skipped(replay, ["#1", "ep-a", "ep-c"], "x")
    assert [n for _, n, _ in st.pop_stats().skipped] == [1]
