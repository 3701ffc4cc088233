"""As-of reads (`rlrec.open`, rlrec.store.snapshot): a snapshot pinned to a point of the manifest
sees every episode committed up to that point exactly once, on real files and a real manifest
written by the real committer (small log snapshots, so folded logs are read too)."""

from __future__ import annotations

import collections
import doctest
import importlib
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq
import pytest

import rlrec
from rlrec.store import snapshot
from rlrec.store.commit import ShardCommitter
from rlrec.store.schema_gate import ShardSchemaError
from rlrec.store.snapshot import STEP_COLUMNS, Cursor, CursorError, open_snapshot
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes
from tests.hostile_shards import hostile_shard, replace_committed


def _grow(root: str, rounds: int = 6) -> list[tuple[str, float, dict[str, int]]]:
    """Commit `rounds` rounds of episodes to two partitions (one episode shards, one tabular),
    returning after each round (its cursor, a time after it, {episode id: length} so far)."""
    writers = [
        ShardCommitter(root, "rl", 0, snapshot_every=3),
        ShardCommitter(root, "rl", 1, fmt="tabular", snapshot_every=3),
    ]
    seen: dict[str, int] = {}
    points = []
    for r in range(rounds):
        for i, w in enumerate(writers):
            if r % 3 == 2 and i == 1:
                continue  # partitions grow unevenly
            for fe in w.commit(expert_cartpole_episodes(2, seed=100 * r + i, max_steps=25)).written:
                seen[fe.episode_id] = fe.length
        time.sleep(0.01)
        t = time.time()
        time.sleep(0.01)
        points.append((rlrec.open(root).cursor, t, dict(seen)))
    return points


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("store"))
    return root, _grow(root)


def _assert_exactly(steps: pa.Table, expected: dict[str, int]) -> None:
    """Every expected episode with each of its steps t = 0..length-1 once, nothing else."""
    rows = collections.Counter(zip(steps.column("episode_id").to_pylist(), steps.column("t").to_pylist()))
    assert set(rows.values()) <= {1}, "a step was read twice"
    per_episode = collections.Counter(eid for eid, _ in rows)
    assert dict(per_episode) == expected
    for eid, n in expected.items():
        assert {t for e, t in rows if e == eid} == set(range(n))


def test_as_of_points_see_each_episode_exactly_once(store, monkeypatch):
    monkeypatch.setattr(snapshot, "APPEND_WINDOW_S", 0.05)  # S: as_of times this far back are fixed
    time.sleep(0.1)
    root, points = store
    for cursor, t, expected in points:
        by_cursor = rlrec.open(root, as_of=cursor)
        by_time = rlrec.open(root, as_of=t)
        assert by_time.cursor == cursor
        assert by_cursor.files() == by_time.files()
        steps = by_cursor.steps()
        assert steps.column_names == list(STEP_COLUMNS)
        _assert_exactly(steps, expected)
        assert by_cursor.num_episodes == len(expected) and by_cursor.num_steps == steps.num_rows
        # the tabular and the episode shards give the same plain types
        assert steps.schema.field("observation").type == pa.list_(pa.float32(), 4)
        assert steps.schema.field("action").type == pa.int64()
    newest = rlrec.open(root)
    assert newest.cursor == points[-1][0]
    assert len(newest.files()) == len(set(newest.files()))


def test_episodes_are_rllib_episodes_once_each(store):
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    root, points = store
    (c1, _, s1), (c2, _, s2) = points[1], points[-1]
    change = rlrec.open(root, as_of=c2).changes(since=c1)
    assert {e.format for e in change.entries} == {"episodes", "tabular"}
    eps = list(change.episodes())
    assert all(isinstance(ep, SingleAgentEpisode) for ep in eps)
    assert {ep.id_: len(ep) for ep in eps} == {e: n for e, n in s2.items() if e not in s1}
    assert len(eps) == len({ep.id_ for ep in eps})
    # an episode rebuilt from tabular rows holds what its steps say
    steps = change.steps()
    for ep in eps:
        rows = steps.filter(pa.compute.equal(steps.column("episode_id"), ep.id_))
        assert rows.column("reward").to_pylist() == list(ep.get_rewards())
        assert rows.column("action").to_pylist() == list(ep.get_actions())
        assert ep.is_terminated == rows.column("terminated")[-1].as_py()
        assert len(ep.get_observations()) == len(ep) + 1
        logp = rows.column("action_logp").to_numpy()
        assert logp == pytest.approx(ep.get_extra_model_outputs("action_logp"))


def test_changes_between_two_cursors_are_the_difference(store):
    root, points = store
    for (c1, _, s1), (c2, _, s2) in [(points[0], points[3]), (points[2], points[5]), (points[4], points[4])]:
        change = rlrec.open(root, as_of=c2).changes(since=c1)
        assert change.cursor == c2
        _assert_exactly(change.steps(), {e: n for e, n in s2.items() if e not in s1})
    assert rlrec.open(root).changes(since="r1~" + _empty_tag() + "~").num_episodes == len(points[-1][2])
    with pytest.raises(CursorError, match="after this snapshot"):
        rlrec.open(root, as_of=points[1][0]).changes(since=points[3][0])


def _empty_tag() -> str:
    from rlrec.store.snapshot import _tag

    return _tag({})


def test_bad_points_are_clear_one_line_errors(store, tmp_path):
    root, points = store
    other = str(tmp_path / "other")
    ShardCommitter(other).commit(expert_cartpole_episodes(1, max_steps=10))
    cursor = points[2][0]
    past_end = cursor.replace("rl:0=", "rl:0=9") if "rl:0=" in cursor else cursor + "+rl:0=999"
    cases = {
        "not a cursor": "yesterday",
        "bad part": "r1~0123456789ab~rl:x=1",
        "another store": rlrec.open(other).cursor,
        "forged tag": "r1~0123456789ab~" + cursor.split("~")[2],
        "unknown point": past_end,
        "future": time.time() + 3600,
        "before any commit": 1.0,
        "not a time": float("nan"),
        "wrong type": [1],
    }
    for what, as_of in cases.items():
        with pytest.raises(CursorError) as err:
            rlrec.open(root, as_of=as_of)
        assert "\n" not in str(err.value) and str(err.value), what
    with pytest.raises(CursorError, match="another store"):
        rlrec.open(other, as_of=cursor)
    with pytest.raises(FileNotFoundError, match="no rlrec manifest"):
        rlrec.open(str(tmp_path))
    with pytest.raises(CursorError, match="ends at"):
        rlrec.open(root, as_of=past_end)


def test_dataframe_readers_read_a_snapshot(store):
    import duckdb  # noqa: F401
    import polars as pl

    root, points = store
    snap = rlrec.open(root, as_of=points[3][0])
    n, reward = snap.num_steps, sum(snap.steps().column("reward").to_pylist())
    df = snap.to_pandas()
    assert len(df) == n and df["reward"].sum() == pytest.approx(reward)
    assert df["observation"].iloc[0].shape == (4,)
    pf = snap.to_polars()
    assert pf.height == n and pf["reward"].sum() == pytest.approx(reward)
    assert pf.schema["observation"] == pl.Array(pl.Float32, 4)
    rel = snap.to_duckdb()
    assert rel.aggregate("count(*), sum(reward)").fetchall() == [(n, pytest.approx(reward))]
    ds = snap.to_pyarrow_dataset()
    assert ds.count_rows() == n


def test_torch_dataset_resumes_without_repeating_or_skipping(store):
    import torch

    root, points = store
    snap = rlrec.open(root, as_of=points[4][0])
    full = [(r["episode_id"], int(r["t"])) for r in snap.to_torch(columns=("episode_id", "t"))]
    assert len(full) == snap.num_steps == len(set(full))
    for k in (0, 7, 25, 26, snap.entries[0].steps, len(full) - 1, len(full)):
        ds = snap.to_torch()
        it = iter(ds)
        head = [next(it) for _ in range(k)]
        state = ds.state_dict()
        resumed = rlrec.open(root, as_of=state["cursor"]).to_torch()
        resumed.load_state_dict(state)
        tail = list(resumed)
        got = [(r["episode_id"], int(r["t"])) for r in head + tail]
        assert got == full, k
    row = head[0]
    assert row["observation"].shape == (4,) and row["observation"].dtype == torch.float32
    assert set(row) == set(STEP_COLUMNS)
    with pytest.raises(ValueError, match="snapshot"):
        snap.to_torch().load_state_dict({"cursor": points[0][0], "position": 0})
    loader = torch.utils.data.DataLoader(snap.to_torch(columns=("reward",)), batch_size=64)
    assert sum(len(b["reward"]) for b in loader) == snap.num_steps


def test_torch_workers_split_the_shards(store, monkeypatch):
    """With DataLoader workers each reads every n-th shard: together every step once."""
    from types import SimpleNamespace

    import rlrec.store.snapshot_torch as snapshot_torch

    root, points = store
    snap = rlrec.open(root, as_of=points[4][0])
    parts = []
    for worker in range(3):
        monkeypatch.setattr(snapshot_torch, "get_worker_info", lambda w=worker: SimpleNamespace(num_workers=3, id=w))
        parts.append([(r["episode_id"], int(r["t"])) for r in snap.to_torch(columns=("episode_id", "t"))])
    rows = [row for part in parts for row in part]
    assert len(rows) == len(set(rows)) == snap.num_steps
    assert all(parts)


def test_ray_dataset_reads_a_snapshot(store, ray_cluster):
    root, points = store
    snap = rlrec.open(root, as_of=points[2][0])
    ds = snap.to_ray_dataset()
    assert ds.count() == snap.num_steps
    assert ds.sum("reward") == pytest.approx(sum(snap.steps().column("reward").to_pylist()))


@pytest.mark.parametrize(("fmt", "column"), [("episodes", "item"), ("tabular", "obs")])
def test_hostile_shard_is_refused(tmp_path, capsys, fmt, column):
    root, marker = str(tmp_path / "out"), tmp_path / "pwned"
    storage = Storage.from_uri(root)
    eps = expert_cartpole_episodes(2, seed=7, max_steps=20)
    (entry,) = ShardCommitter(storage, fmt=fmt).commit(eps).entries
    replace_committed(storage, entry, hostile_shard(eps, fmt, column, str(marker)))
    snap = rlrec.open(root)
    readers = [snap.steps, lambda: list(snap.to_torch())]
    if fmt == "episodes":
        readers.append(lambda: list(snap.episodes()))
    for read in readers:
        with pytest.raises(ShardSchemaError, match=entry.path.split("/")[-1].replace("+", r"\+")):
            read()
    from rlrec.cli import main

    assert main(["export", root, "--to", "parquet", str(tmp_path / "steps")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rlrec export: error: ") and "refused" in err and err.count("\n") == 1, err
    assert not marker.exists(), "a pickled value was executed"


def test_a_shard_changed_after_its_commit_is_refused(tmp_path):
    root = str(tmp_path / "out")
    storage = Storage.from_uri(root)
    (entry,) = ShardCommitter(storage).commit(expert_cartpole_episodes(1, max_steps=10)).entries
    storage.write(entry.path, storage.read(entry.path) + b"x")
    with pytest.raises(ShardSchemaError, match="sha256"):
        open_snapshot(root).steps()


def test_cli_export_and_paths(store, tmp_path, capsys):
    from rlrec.cli import main

    root, points = store
    cursor, _, expected = points[3]
    out = str(tmp_path / "steps")
    assert main(["export", root, "--to", "parquet", out, "--as-of", cursor]) == 0
    assert capsys.readouterr().out.strip() == cursor
    table = pq.read_table(out)  # plain pyarrow: nothing of rlrec is needed to read it
    _assert_exactly(table, expected)
    assert table.schema.field("observation").type == pa.list_(pa.float32(), 4)
    assert table.schema.metadata[b"rlrec.cursor"] == cursor.encode()

    assert main(["inspect", root, "--paths", "--as-of", cursor]) == 0
    paths = capsys.readouterr().out.split()
    assert paths == rlrec.open(root, as_of=cursor).files()
    assert all(Storage.from_uri(root).exists(p[len(root) + 1 :]) for p in paths)

    assert main(["export", root, "--to", "parquet", out]) == 2
    assert capsys.readouterr().err.startswith(f"rlrec export: error: DIR {out} is not empty")
    for bad in ("junk", "r1~0123456789ab~rl:0=1", "2000-01-01T00:00:00Z"):
        assert main(["export", root, "--to", "parquet", str(tmp_path / "x"), "--as-of", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("rlrec export: error: ") and err.count("\n") == 1, err
    assert main(["inspect", root, "--as-of", cursor]) == 2
    assert capsys.readouterr().err.startswith("rlrec inspect: error: --as-of needs --paths")


@pytest.mark.parametrize(
    "module",
    [
        "rlrec.store.snapshot",
        "rlrec.store.snapshot_reader",
        "rlrec.store.cursor",
        "rlrec.store.steps_table",
    ],
)
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_docstring_examples_pass_when_the_file_is_run_by_path(monkeypatch):
    """`pytest --doctest-modules store/snapshot.py` imports the file as ``store.snapshot`` and sets
    no option flags: the examples must not depend on the module's name or on ELLIPSIS."""
    import importlib.util

    path = Path(importlib.import_module("rlrec.store.snapshot").__file__)
    spec = importlib.util.spec_from_file_location("store.snapshot", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "store.snapshot", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0


def test_nested_spaces_give_the_same_plain_steps_from_every_shard_format(tmp_path):
    """Dict/Tuple observations with 2-D leaves: episode shards, tabular shards (nested lists or
    tensor columns) give one and the same steps table and the same episodes."""
    from types import SimpleNamespace

    from rlrec.store.schema_gate import open_shard
    from rlrec.store.shards import encode_shard
    from rlrec.store.snapshot import gated_steps
    from tests.test_shards import dict_episodes

    eps = dict_episodes(3, T=4)
    root = str(tmp_path / "out")
    ShardCommitter(root, "rl", 0).commit(eps)
    ShardCommitter(root, "rl", 1, fmt="tabular").commit(eps)
    by_partition = {e.partition: e for e in rlrec.open(root).entries}
    snap = rlrec.open(root)
    from_episodes, from_tabular = (snap.shard_steps(by_partition[p]) for p in (0, 1))
    assert from_episodes.equals(from_tabular)
    tensor = open_shard(encode_shard(eps, fmt="tabular", multidim="tensor").data)
    assert gated_steps(tensor, SimpleNamespace(policy_id="pol", path="x")).equals(from_tabular)
    obs = from_episodes.schema.field("observation").type
    assert obs.field("img").type == pa.list_(pa.list_(pa.uint8(), 3), 2)
    assert obs.field("pair").type.field("0").type == pa.int64()
    row = from_episodes.slice(5, 1).to_pylist()[0]
    fe = eps[1]  # rows 0-3: episode d-0, row 5: d-1 at t=1
    assert (row["episode_id"], row["t"]) == ("d-1", 1)
    assert row["observation"]["img"] == fe.observations[1][1].tolist()
    assert row["next_observation"]["pos"] == pytest.approx(fe.observations[0][2].tolist())
    assert row["action_logp"] is None  # no propensity logged
    rebuilt = {(p, ep.id_): ep for p in (0, 1) for ep in snap.shard_episodes(by_partition[p])}
    for fe in eps:
        a, b = rebuilt[(1, fe.episode_id)], rebuilt[(0, fe.episode_id)]
        assert (a.is_terminated, a.is_truncated) == (fe.terminated, fe.truncated)
        for k in ("pos", "img"):
            assert (a.get_observations()[k] == b.get_observations()[k]).all()
        assert (a.get_actions() == b.get_actions()).all()


def test_snapshots_taken_while_a_writer_commits_are_consistent(tmp_path):
    """Points read while a consumer-like writer commits (and folds its log every 3 entries): each
    is a prefix of every log, holds each committed episode once, and reopens to the same files."""
    import threading

    root = str(tmp_path / "out")
    writer = ShardCommitter(root, "rl", 0, snapshot_every=3)
    writer.commit(expert_cartpole_episodes(1, seed=0, max_steps=10))
    stop = threading.Event()

    def write() -> None:
        for i in range(1, 40):
            if stop.is_set():
                return
            writer.commit(expert_cartpole_episodes(1, seed=i, max_steps=10))

    t = threading.Thread(target=write)
    t.start()
    points = []
    try:
        while t.is_alive():
            snap = rlrec.open(root)
            ids = snap.steps().column("episode_id").to_pylist()
            per_entry = [set(e.episode_ids) for e in snap.entries]
            assert sum(len(s) for s in per_entry) == len(set().union(*per_entry)), "an episode in two entries"
            assert {e.episodes for e in snap.entries} == {1}  # one episode per commit
            assert collections.Counter(ids) == {e.episode_ids[0]: e.steps for e in snap.entries}
            assert [e.seq for e in snap.entries] == sorted(e.seq for e in snap.entries)
            points.append((snap.cursor, snap.files()))
    finally:
        stop.set()
        t.join()
    assert len({c for c, _ in points}) >= 2, "no commit happened while reading"
    final = rlrec.open(root)
    for cursor, files in points:
        assert rlrec.open(root, as_of=cursor).files() == files
        seen = Cursor.parse(cursor).positions.get(("rl", 0), 0)
        assert files == [f for f, e in zip(final.files(), final.entries) if e.seq < seen]  # a prefix of the log


@pytest.mark.parametrize("fmt", ["episodes", "tabular"])
def test_steps_without_a_propensity_are_null(tmp_path, fmt):
    root = str(tmp_path / "out")
    logged = expert_cartpole_episodes(1, seed=1, max_steps=15)
    unlogged = expert_cartpole_episodes(1, seed=2, max_steps=15, with_logp=False)
    (entry,) = ShardCommitter(root, fmt=fmt).commit(logged + unlogged).entries
    snap = rlrec.open(root)
    steps = snap.steps()
    by_episode = {e: steps.filter(pa.compute.equal(steps.column("episode_id"), e)) for e in entry.episode_ids}
    assert by_episode[logged[0].episode_id].column("action_logp").null_count == 0
    assert by_episode[unlogged[0].episode_id].column("action_logp").null_count == unlogged[0].length
    eps = {ep.id_: ep for ep in snap.shard_episodes(entry)}
    assert "action_logp" in eps[logged[0].episode_id].extra_model_outputs
    assert "action_logp" not in eps[unlogged[0].episode_id].extra_model_outputs


def test_an_episode_whose_decoding_would_unpickle_is_refused_with_its_shard(tmp_path, capsys):
    """An episode shard whose schema passes the gate but whose `item` holds a msgpack-numpy object
    array (RLlib's decoder would unpickle it): refused by `unpack_episode`, named by its shard."""
    import io

    import msgpack
    import msgpack_numpy as mnp
    import numpy as np

    from rlrec.cli import main
    from rlrec.store.episodes import UnsafeEpisodeError, to_single_agent_episode
    from rlrec.store.shards import encode_shard
    from tests.hostile_shards import Boom, to_parquet

    root, marker = str(tmp_path / "out"), tmp_path / "pwned"
    storage = Storage.from_uri(root)
    eps = expert_cartpole_episodes(1, seed=3, max_steps=10)
    (entry,) = ShardCommitter(storage).commit(eps).entries
    state = to_single_agent_episode(eps[0]).get_state()
    state["custom_data"]["evil"] = np.array([Boom(str(marker))], dtype=object)
    table = pq.read_table(io.BytesIO(encode_shard(eps).data))
    evil = pa.array([msgpack.packb(state, default=mnp.encode)], pa.binary())
    replace_committed(storage, entry, to_parquet(table.set_column(0, "item", evil)))
    snap = rlrec.open(root)
    for read in (snap.steps, lambda: list(snap.episodes())):
        with pytest.raises(UnsafeEpisodeError, match=entry.path.split("/")[-1].replace("+", r"\+")):
            read()
    assert main(["export", root, "--to", "parquet", str(tmp_path / "steps")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rlrec export: error: ") and err.count("\n") == 1, err
    assert not marker.exists(), "a pickled value was executed"
