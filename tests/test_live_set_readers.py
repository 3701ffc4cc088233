"""Readers beyond `rlrec.open` that start from the newest live set (`rlrec.store.live_set`): gc
decides what is referenced from the heads and reads the history only for a file the heads do not
name; the trainer's start-up discovery reads the heads. Each counts what it reads, and none of
them decides anything a live set could make wrong: a forged live set, one dropped by a kill -9
of its writer, or none, ends in the history's answer. Real local storage; writers killed with
SIGKILL in a subprocess (the harness of tests/test_live_set.py)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlrec.store.commit import ShardCommitter
from rlrec.store.compaction import compact_partition
from rlrec.store.live_set import LiveSetEntry, live_set_path, live_set_seqs, read_live_set, write_live_set
from rlrec.store.maintenance import gc, inspect, verify
from rlrec.store.manifest import PartitionLog, live_shards, read_manifest
from rlrec.store.retention import read_removals, retain
from rlrec.trainer.synthetic import expert_cartpole_episodes

from .test_live_set import ROOT, _history_head, _key, _run_writer


def _commit(c: ShardCommitter, n: int, seed: int) -> None:
    for i in range(n):
        c.commit(expert_cartpole_episodes(2, seed=seed + i, max_steps=20))


@pytest.fixture
def history_loads(monkeypatch) -> list[tuple[str, int]]:
    """Every whole-history read of a partition log (`PartitionLog.load`) from here on."""
    calls: list[tuple[str, int]] = []
    real = PartitionLog.load

    def load(self, **kw):
        calls.append((self.topic, self.partition))
        return real(self, **kw)

    monkeypatch.setattr(PartitionLog, "load", load)
    return calls


def _store_with_live_sets(root: str) -> ShardCommitter:
    """A partition log of 12 shard entries, compacted, the replaced files retained away, and a live
    set at its end (a few entries after it)."""
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    c.log.live_set_every = 5
    _commit(c, 12, 0)
    compact_partition(c.log, min_age_s=0, target_bytes=3 * max(e.bytes for e in read_manifest(c.storage)))
    retain(c.storage, grace_s=0)
    write_live_set(c.storage, "rl", 0, writer="test")
    _commit(c, 2, 100)
    return c


def _policy_files(root: str) -> set[str]:
    out = set()
    for d in Path(root).iterdir():
        if d.is_dir() and not d.name.startswith(("_", ".")):
            out |= {str(p.relative_to(root)) for p in d.rglob("*") if p.is_file()}
    return out


def test_gc_reads_no_history_when_the_heads_name_every_file(tmp_path, history_loads):
    root = str(tmp_path / "out")
    c = _store_with_live_sets(root)
    before = _policy_files(root)
    history_loads.clear()
    assert gc(c.storage, 0) == []
    assert history_loads == []  # main read every log's history here
    assert _policy_files(root) == before


def test_gc_reads_the_history_for_a_file_the_heads_do_not_name(tmp_path, history_loads):
    """Garbage is deleted; a replaced shard retention has not recorded yet (named by the history
    only, not by the head) and a removed one in its grace are kept, as before live sets."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    _commit(c, 6, 0)
    write_live_set(c.storage, "rl", 0)
    compact_partition(c.log, min_age_s=0, target_bytes=3 * max(e.bytes for e in read_manifest(c.storage)))
    write_live_set(c.storage, "rl", 0)  # its rows: the merged shards only
    replaced = [e.path for e in c.log.load() if getattr(e, "path", None) and e.path not in _head_paths(c)]
    assert replaced
    retain(c.storage, grace_s=3600)  # recorded, still in their grace
    ghost = Path(root) / "expert" / "rl+00000+crashed.parquet"
    ghost.write_bytes(b"a crashed writer's file")
    staged = Path(root) / "expert" / "_staging" / "rl+00000+orphan.parquet"
    staged.write_bytes(b"an orphan staging file")
    history_loads.clear()
    assert gc(c.storage, 0) == sorted(["expert/rl+00000+crashed.parquet", "expert/_staging/rl+00000+orphan.parquet"])
    assert history_loads == [("rl", 0)]  # the history decided
    assert all((Path(root) / p).exists() for p in replaced)
    assert not ghost.exists() and not staged.exists()
    assert verify(c.storage) == []


def test_the_trainers_start_up_discovery_reads_the_heads_not_the_history(tmp_path, history_loads):
    from rlrec.trainer.config import TrainerConfig
    from rlrec.trainer.service import ContinuousTrainer

    root = str(tmp_path / "out")
    c = _store_with_live_sets(root)
    svc = ContinuousTrainer(TrainerConfig(input=root, checkpoint_dir=str(tmp_path / "ck")))
    history_loads.clear()
    found = svc._first_shards()
    assert history_loads == []  # main read every log's history here (its follower's first poll)
    assert sorted(e.path for e in found) == sorted(s.path for s in read_manifest(c.storage))
    assert svc.fmt == "episodes"
    skip = {found[0].path}
    assert sorted(e.path for e in svc._first_shards(skip)) == sorted(e.path for e in found[1:])


def test_start_up_discovery_waiting_on_a_store_without_live_sets_reads_its_history_once(tmp_path, history_loads):
    """Every shard filtered out (another policy), no live set: the trainer waits, polling; the
    heads are read once, then the follower's incremental polls -- not the history per retry."""
    from rlrec.trainer.config import TrainerConfig
    from rlrec.trainer.service import ContinuousTrainer, NoFirstShard

    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    _commit(c, 4, 0)
    assert not live_set_seqs(c.storage, "rl", 0)
    cfg = TrainerConfig(input=root, checkpoint_dir=str(tmp_path / "ck"), policy_id="nobody", first_shard_timeout_s=1.5)
    cfg.poll_interval_s = 0.2
    svc = ContinuousTrainer(cfg)
    history_loads.clear()
    with pytest.raises(NoFirstShard):
        svc._first_shards()
    assert history_loads == [("rl", 0), ("rl", 0)]  # the heads' (no live set), then the follower's first poll


def test_start_up_discovery_with_a_log_whose_head_cannot_be_read_reads_what_poll_delivers(tmp_path):
    """A log whose live set does not fit the entries after it and whose history is broken too
    (a gap): the head read fails, and discovery falls back to the follower's poll, which skips
    that log with a warning and finds the other log's shards (as before live sets)."""
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    a = ShardCommitter(root, "rl", 0, snapshot_every=100)
    b = ShardCommitter(root, "rl", 1, snapshot_every=100)
    _commit(a, 3, 0)
    _commit(b, 2, 10)
    write_live_set(b.storage, "rl", 1)
    _commit(b, 1, 20)
    os.remove(os.path.join(root, "_manifest", "rl", "00000", "000000000002.json"))  # a gap in log 0
    got = ManifestFollower(a.storage).live_head()
    assert sorted(e.path for e in got) == sorted(
        e.path for e in live_shards(PartitionLog(b.storage, "rl", 1).load()).values()
    )


def _head_paths(c: ShardCommitter) -> set[str]:
    return {s.path for s in read_manifest(c.storage)}


def test_a_forged_live_set_never_makes_gc_delete_a_live_shard(tmp_path):
    """A live set that parses but hides a live shard (bucket write access) makes gc read the
    history for that file, which names it: kept. One naming a garbage file only keeps it."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    _commit(c, 4, 0)
    live = sorted(live_shards(c.log.load()).values(), key=lambda s: s.seq)
    hidden = live[1]
    forged = LiveSetEntry(
        topic="rl",
        partition=0,
        seq=c.log.next_seq,
        first=_first(c),
        removals=0,
        shards=tuple(dataclasses.replace(s, episode_ids=()) for s in live if s is not hidden),
        writer="forger",
    )
    c.storage.write(live_set_path("rl", 0, forged.seq), forged.to_bytes())
    assert read_live_set(c.storage, "rl", 0).seq == forged.seq  # readers at the head trust it
    assert hidden.path not in {s.path for s in read_manifest(c.storage)}
    os.utime(Path(root) / hidden.path, (time.time() - 7200, time.time() - 7200))
    assert gc(c.storage, 3600) == []
    assert (Path(root) / hidden.path).exists()


def _first(c: ShardCommitter) -> str:
    from rlrec.store.live_set import first_entry_key

    return first_entry_key(c.log.read_entry(0))


def _history_files(st) -> set[str]:
    """Every file an entry of the history names, and those of the removal records."""
    from rlrec.store.manifest import list_partition_logs, shard_files

    out = set()
    for k in list_partition_logs(st):
        out |= {p for s in shard_files(PartitionLog(st, *k).load()) for p in (s.path, s.staging_path)}
    return out


_COMPACTOR = textwrap.dedent(
    """
    import os, signal, sys
    from rlrec.store.compaction import compact_partition
    from rlrec.store.manifest import PartitionLog, read_manifest
    from rlrec.store.storage import Storage

    root, crash_at = sys.argv[1], sys.argv[2]
    real = Storage.create_once

    def create_once(self, path, data):
        if "/_live/" in path and crash_at == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        if "/_live/" in path and crash_at == "torn":
            self.write(path + ".tmp-torn", data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        done = real(self, path, data)
        if "/_live/" in path and crash_at == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    Storage.create_once = create_once
    st = Storage.from_uri(root)
    plog = PartitionLog(st, "rl", 0, snapshot_every=1, live_set_every=1)
    plog.claim("compactor")
    plog.recover()
    target = 2 * max(e.bytes for e in read_manifest(st))
    print(compact_partition(plog, min_age_s=0, target_bytes=target), flush=True)
    if plog._live_builder is not None:  # a log without a live set: its writer builds one in the background
        plog._live_builder.join()
    """
)


_RETAINER = textwrap.dedent(
    """
    import os, signal, sys
    from rlrec.store.retention import retain
    from rlrec.store.storage import Storage

    real = Storage.create_once

    def create_once(self, path, data):
        done = real(self, path, data)
        if "/_removed/" in path:  # its first record is written, no file deleted yet
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    Storage.create_once = create_once
    retain(Storage.from_uri(sys.argv[1]), grace_s=0)
    """
)


def _run_script(script: str, *args: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=300)
    return p.returncode


@pytest.mark.slow
def test_kill_9_of_writers_around_the_live_set_write_every_reader_sees_the_history(tmp_path):
    """The partition's writer killed before, during and after writing a live set, then
    compaction killed at the same point of its own live set write (and retention killed between
    its record and its deletes): after each, `rlrec.open` (through `_history_head`'s
    comparison), `read_manifest`, `inspect`, the trainer's start-up discovery and gc see exactly
    the live shards the history gives, and gc deletes no file an entry names."""
    from rlrec.store.snapshot import open_snapshot
    from rlrec.trainer.manifest_follower import ManifestFollower

    root = str(tmp_path / "out")
    codes = []
    from_heads: list[bool] = []
    for n, crash_at in enumerate(["before", "torn", "after", "none"]):
        code, _ = _run_writer(root, crash_at, 1000 * n)
        codes.append(code)
        st = open_snapshot(root).storage
        if crash_at != "none":  # compaction (a new writer of the log) killed at the same point
            codes.append(_run_script(_COMPACTOR, root, crash_at))
        if n == 1:  # retention killed after recording replaced files, before deleting them: no
            codes.append(_run_script(_RETAINER, root))  # live set folds the record while they are there
        if n == 2:  # its re-run deletes them (later live sets fold the record); then replaced files
            assert retain(st, grace_s=0).deleted  # recorded inside their grace: no live set folds that one
            plog = PartitionLog(st, "rl", 0)
            plog.claim("test-compactor")
            plog.recover()
            # a target no live shard reaches: how much the killed compactions merged before
            # depends on when their background live set build ran, so a target sized from the
            # live shards could leave no run of two (CI saw written == 0)
            assert len(read_manifest(st)) >= 2
            assert compact_partition(plog, min_age_s=0, target_bytes=1 << 30).written
            assert retain(st, grace_s=3600).recorded
        want = _history_head(st)
        assert sorted(_key(s) for s in open_snapshot(root).entries) == want, crash_at
        assert sorted(_key(s) for s in read_manifest(st)) == want, crash_at
        assert sorted(s["path"] for s in inspect(st)["shards"]) == sorted(st.uri(k[3]) for k in want)
        found = ManifestFollower(st, fmt="episodes").live_head()
        assert sorted(e.path for e in found) == sorted(k[3] for k in want), crash_at
        heads, history = ManifestFollower(st), ManifestFollower(st)
        history.from_heads = False
        assert _delivered(heads) == _delivered(history), crash_at  # the trainer's first poll
        from_heads.append(bool(heads._heads))
        named = _history_files(st)
        before = _policy_files(root)
        gc(st, 0)
        after = _policy_files(root)
        assert named & before <= after, crash_at  # gc deleted no file an entry names
        assert all(k[3] in after or k[4] in after for k in want), crash_at  # published, or staged (killed before)
    assert codes == [-signal.SIGKILL] * 7 + [0]  # each planted kill was reached
    assert read_live_set(st, "rl", 0).removals > 0  # a live set folded the killed retention's record, once re-run
    assert read_live_set(st, "rl", 0).removals < len(read_removals(st))  # not the one inside its grace
    assert from_heads[-1]  # the last first poll read the log from its head
    assert verify(open_snapshot(root).storage) == []


def _delivered(f) -> list[tuple]:
    """A follower's first poll: each shard delivered (oldest commit first), the shard entries it
    stands for and its episode filter."""
    got = f.poll(force_discover=True)
    return [(s.key, f.covers.get(s.key, (None, None))[:2], s.episodes) for s in got]


def test_start_up_discovery_returns_the_oldest_committed_shard_first(tmp_path):
    """The trainer takes its spaces from the first usable shard discovery returns: the oldest
    committed one, whichever log it is in (here partition 1's, committed before partition 0's)."""
    from rlrec.trainer.config import TrainerConfig
    from rlrec.trainer.service import ContinuousTrainer

    root = str(tmp_path / "out")
    older = ShardCommitter(root, "rl", 1)
    _commit(older, 1, 1)
    time.sleep(0.05)
    newer = ShardCommitter(root, "rl", 0)
    _commit(newer, 1, 2)
    for p in (0, 1):
        write_live_set(older.storage, "rl", p)
    found = ContinuousTrainer(TrainerConfig(input=root, checkpoint_dir=str(tmp_path / "ck")))._first_shards()
    assert [e.partition for e in found] == [1, 0]
    assert found == sorted(found, key=lambda e: e.commit_time)


def test_a_trainer_waiting_for_its_first_shard_reads_each_live_set_once(tmp_path, monkeypatch):
    """Waiting (no shard of its policy yet) on a store with live sets: the heads are read once,
    then the follower's incremental polls -- not every log's live set per retry."""
    from rlrec.store.storage import Storage
    from rlrec.trainer.config import TrainerConfig
    from rlrec.trainer.service import ContinuousTrainer, NoFirstShard

    root = str(tmp_path / "out")
    c = _store_with_live_sets(root)
    newest = live_set_path("rl", 0, read_live_set(c.storage, "rl", 0).seq)
    reads: list[str] = []
    real = Storage.read

    def read(self, path, **kw):
        reads.append(path)
        return real(self, path, **kw)

    monkeypatch.setattr(Storage, "read", read)
    cfg = TrainerConfig(input=root, checkpoint_dir=str(tmp_path / "ck"), policy_id="nobody", first_shard_timeout_s=1.5)
    cfg.poll_interval_s = 0.2
    with pytest.raises(NoFirstShard):
        ContinuousTrainer(cfg)._first_shards()
    assert [p for p in reads if p.endswith(".live")] == [newest]  # once, not per retry


@pytest.fixture
def storage_calls(monkeypatch) -> list[str]:
    """Every storage call that reaches the store (read, exists, info, list) from here on."""
    from rlrec.store.storage import Storage

    calls: list[str] = []
    for name in ("read", "exists", "info", "list"):
        real = getattr(Storage, name)

        def counted(self, *a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(Storage, name, counted)
    return calls


def _main_gc_calls(storage, calls: list[str]) -> int:
    """What gc cost before live sets: its listing, then every log's history."""
    from rlrec.store import maintenance
    from rlrec.store.manifest import read_partition_logs

    calls.clear()
    maintenance._candidate_files(storage)
    read_partition_logs(storage)
    return len(calls)


def test_gc_costs_no_more_storage_calls_than_the_history_where_there_is_garbage(tmp_path, storage_calls):
    """The states gc runs in: replaced files between a compaction and the next retain run, a
    crashed writer's staging file: gc reads the history alone there, never the heads as well."""
    root = str(tmp_path / "out")
    c = ShardCommitter(root, "rl", 0, snapshot_every=3)
    c.log.live_set_every = 4
    _commit(c, 12, 0)
    retain(c.storage, grace_s=0)
    write_live_set(c.storage, "rl", 0)
    assert gc(c.storage, 0) == []
    compact_partition(c.log, min_age_s=0, target_bytes=3 * max(e.bytes for e in read_manifest(c.storage)))
    write_live_set(c.storage, "rl", 0)  # folds the compaction: the replaced files are named by the history only
    before = _policy_files(root)
    storage_calls.clear()
    assert gc(c.storage, 0) == []
    assert len(storage_calls) <= _main_gc_calls(c.storage, storage_calls)
    assert _policy_files(root) == before
    retain(c.storage, grace_s=3600)  # recorded, in their grace
    staged = Path(root) / "expert" / "_staging" / "rl+00000+orphan.parquet"
    staged.parent.mkdir(exist_ok=True)
    staged.write_bytes(b"an orphan staging file")
    storage_calls.clear()
    assert gc(c.storage, 0) == ["expert/_staging/rl+00000+orphan.parquet"]
    assert len(storage_calls) <= _main_gc_calls(c.storage, storage_calls)
    assert _policy_files(root) == before
