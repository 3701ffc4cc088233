"""The trainer under faults, without Ray: a shard read during an S3 outage (real moto behind a fault
proxy) gives its chunk back and is counted, never skipped; a gone shard and an unusable one are
told apart from it; the driver's storage WARNING; the stall watchdog; a committed checkpoint is
never rewritten. The whole trainer under these faults: tests/test_chaos_trainer.py."""

from __future__ import annotations

import hashlib
import logging
import uuid

import pytest

from rlrec.store.commit import ShardCommitter
from rlrec.store.manifest import read_manifest
from rlrec.store.retry import RetryPolicy
from rlrec.store.storage import Storage
from rlrec.trainer.feed import FeedPolicy, FeedState, ShardInfo, shard_of_tag
from rlrec.trainer.storage_health import StorageHealth
from rlrec.trainer.synthetic import expert_cartpole_episodes
from rlrec.trainer.watchdog import EXIT_STALLED, StallWatchdog
from tests.faults import FaultProxy


class _Call:
    """``feed.method.remote(...)`` of a stand-in for the ShardFeed actor: runs `fn` at once."""

    def __init__(self, fn) -> None:
        self.remote = fn


class FeedStandIn:
    """The ShardFeed actor's methods the read task calls, on a real `FeedState`, in-process."""

    def __init__(self, state: FeedState, on_failed=lambda kind: None) -> None:
        self.state = state

        def next_work(_timeout: float):  # the stream ends once every fresh shard was handed out
            return state.next_work() if state.has_fresh() else "closed"

        def failed(tag: int, kind: str, reason: str = "") -> None:
            state.report(tag, kind, reason)
            on_failed(kind)

        self.next_work = _Call(next_work)
        self.failed = _Call(failed)


@pytest.fixture
def s3_behind_proxy(local_s3, monkeypatch):
    """(direct Storage, Storage through a FaultProxy, the proxy) on one fresh bucket."""
    bucket = local_s3.create_bucket(f"tf-{uuid.uuid4().hex[:8]}")
    for k, v in local_s3.env().items():
        monkeypatch.setenv(k, v)
    direct = Storage.from_uri(f"s3://{bucket}/out")
    proxy = FaultProxy(local_s3.port)
    proxy.server.handle_error = lambda *a: None
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    # few retries in place: the test is about what happens after they are spent
    through = Storage.from_uri(f"s3://{bucket}/out", retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02))
    monkeypatch.setenv("AWS_ENDPOINT_URL", local_s3.env()["AWS_ENDPOINT_URL"])
    try:
        yield direct, through, proxy
    finally:
        proxy.close()


def test_a_shard_read_during_an_outage_is_retried_never_skipped_and_gone_or_unusable_shards_are_told_apart(
    s3_behind_proxy, monkeypatch
):
    from rlrec.trainer import read_task

    direct, through, proxy = s3_behind_proxy
    c = ShardCommitter(direct)
    for i in range(3):
        c.commit(expert_cartpole_episodes(2, seed=i, max_steps=50))
    entries = read_manifest(direct)
    infos = [ShardInfo.from_entry(i, e) for i, e in enumerate(entries)]
    direct.delete(entries[1].path)  # gone: deleted outside the trainer
    infos[2] = ShardInfo(**{**infos[2].__dict__, "sha256": hashlib.sha256(b"other bytes").hexdigest()})  # unusable
    state = FeedState(FeedPolicy(chunk_rows=100, max_ahead_rows=10**6, fresh_fraction=1.0))
    state.add_shards(infos)

    kinds: list[str] = []

    def on_failed(kind: str) -> None:
        kinds.append(kind)
        if kind == "retry":
            proxy.clear_rules()  # the store answers again

    monkeypatch.setattr(read_task.ray, "get", lambda x: x)
    proxy.fail_matching(10**6, ".parquet")  # every shard read fails: an outage of the data files
    blocks = list(
        read_task._serve(FeedStandIn(state, on_failed), through, read_task._TableCache(1 << 24), ["item"], verify=True)
    )
    # unreachable: counted, the chunk given back and read again once the store answered
    assert kinds[0] == "retry" and state.storage_errors >= 1
    assert "503" in state.last_storage_error or "SERVICE_UNAVAILABLE" in state.last_storage_error
    tags = [int(b.column(read_task.TAG)[0].as_py()) for b in blocks]
    assert [shard_of_tag(t) for t in tags] == [0]
    assert 0 not in state.deleted
    # gone and unusable: reported as such, and only those
    st = state.pop_stats()
    assert st.missing == [infos[1].key]
    assert [k for k, _ in st.bad] == [infos[2].key] and "sha256 mismatch" in st.bad[0][1]
    assert state.deleted == {1, 2}


def test_the_driver_warns_naming_the_store_counts_and_says_when_it_answers_again(caplog):
    now = [100.0]
    counted: list[int] = []
    h = StorageHealth("s3://bucket/run", warn_every_s=10, on_errors=counted.append, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="rlrec.trainer")
    h.failed("manifest poll", "StorageError: HTTP status 503")
    now[0] = 105
    h.reader_errors(2, "StorageError: connection refused")  # the feed's cumulative count
    h.reader_errors(2, "StorageError: connection refused")  # nothing new
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "s3://bucket/run does not answer" in warnings[0] and "HTTP status 503" in warnings[0]
    now[0] = 111  # still failing after warn_every_s: warned again, with the last error
    h.reader_errors(3, "StorageError: connection refused")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "connection refused" in warnings[1] and "4 failed read(s) in 11s" in warnings[1]
    assert counted == [1, 2, 1] and h.total == 4 and h.pop_iteration() == 4 and h.pop_iteration() == 0
    assert h.failing
    h.answered()
    assert not h.failing and any("answers again (after 11.0s)" in r.getMessage() for r in caplog.records)


def test_the_stall_watchdog_ends_the_process_with_one_line_unless_excused(capsys):
    now = [0.0]
    outage = [False]
    exits: list[int] = []
    w = StallWatchdog(60, excuse=lambda: outage[0], clock=lambda: now[0], exit=exits.append)
    now[0] = 500  # the first iteration (Ray Data's and the Learners' start) is not timed
    assert not w.check()
    w.iteration(fresh_chunks=0, backlog=4)  # it arms the watchdog
    now[0] = 550
    w.iteration(fresh_chunks=2, backlog=4)  # a big shard, a few chunks at a time: progress
    now[0] = 600
    outage[0] = True  # the store does not answer: waiting is explained (and reported elsewhere)
    assert not w.check()
    outage[0] = False
    now[0] = 640
    w.iteration(fresh_chunks=0, backlog=3)  # nothing fresh trained in this one
    now[0] = 659
    assert not w.check() and exits == []
    now[0] = 661
    assert w.check() and exits == [EXIT_STALLED]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "rlrec train: error: no fresh data trained for 61s (--stall-timeout-s 60s) while 3 fresh shard(s) waited"
    )


def test_a_big_shard_trained_over_many_iterations_is_progress_for_the_watchdog():
    from rlrec.trainer.feed import IterationStats

    state = FeedState(FeedPolicy(chunk_rows=10, max_ahead_rows=10**6, fresh_fraction=1.0))
    big = ShardInfo(
        0, "big", "big.parquet", "s/big.parquet", "tabular", rows=100, steps=100, commit_time=1.0, policy_id="p"
    )
    waiting = ShardInfo(
        1, "next", "n.parquet", "s/n.parquet", "tabular", rows=10, steps=10, commit_time=2.0, policy_id="p"
    )
    state.add_shards([big, waiting])
    per_iteration: list[IterationStats] = []
    for _ in range(3):  # each iteration trains one more fresh chunk of the big shard, then replays
        w = state.next_work()
        assert w.fresh and w.shard.key == "big"
        state.processed([w.tag], 10)
        state.ack({w.tag: 10})
        state.ack({w.tag: 10})  # the Learner samples those rows again: not fresh data again
        per_iteration.append(state.pop_stats())
    assert [st.fresh_chunks for st in per_iteration] == [1, 1, 1]
    assert [len(st.newly_trained) for st in per_iteration] == [1, 0, 0]  # what the watchdog went by


def test_a_committed_checkpoint_is_never_rewritten_and_its_extra_files_are_verified(tmp_path):
    from rlrec.trainer.checkpoints import CheckpointStore, CheckpointVerificationError
    from rlrec.trainer.signing import generate_keys, load_private_key
    from tests.test_trainer_checkpoints import FakeAlgo

    storage = Storage.from_uri(str(tmp_path / "ck"))
    store = CheckpointStore(storage, signing_key=load_private_key(generate_keys(tmp_path / "keys")[0]))
    first = store.save(5, FakeAlgo({"learner_group/w": b"1"}), {"n": 1}, policy_version=1, extra={"publish/x": b"p1"})
    again = store.save(5, FakeAlgo({"learner_group/w": b"2"}), {"n": 2}, policy_version=2, extra={"publish/x": b"p2"})
    assert (first, again) == ("checkpoints/ckpt-00000005", "checkpoints/ckpt-00000005.1")
    assert storage.read(f"{first}/algo/learner_group/w") == b"1"  # untouched while latest named it
    assert store.latest()["path"] == again and store.read_state(again) == {"n": 2}
    assert store.save(5, FakeAlgo({}), {}, policy_version=2) == "checkpoints/ckpt-00000005.2"
    assert store.read_file(first, "publish/x") == b"p1"
    storage.write(f"{first}/publish/x", b"tampered")
    with pytest.raises(CheckpointVerificationError, match="publish/x does not match"):
        store.read_file(first, "publish/x")


def test_metrics_lines_wait_out_an_outage_of_their_store_and_errors_are_counted_for_prometheus(s3_behind_proxy):
    import json
    import urllib.request

    from rlrec.trainer.metrics import METRICS_FILE, TrainerMetrics

    direct, through, proxy = s3_behind_proxy
    m = TrainerMetrics(through, 0, False)
    try:
        line = {"iteration": 1, "policy_version": 0, "timesteps_trained": 1, "shards_total": 1, "shards_new": 1}
        m.write(line)
        proxy.fail_for(60)
        m.write({**line, "iteration": 2})  # the store does not answer: no exception, the line waits
        proxy.fail_for(0)
        m.write({**line, "iteration": 3})
        assert [json.loads(x)["iteration"] for x in direct.read(METRICS_FILE).decode().splitlines()] == [1, 2, 3]
        m.count_storage_errors(3)
        with urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert "rlrec_trainer_storage_errors_total 3.0" in text
    finally:
        m.close()


def test_metrics_on_an_object_store_roll_into_segments_and_read_back_once(s3_behind_proxy, monkeypatch):
    """An object store's metrics.jsonl is rewritten whole per line: it rolls into
    metrics/{first iteration}.jsonl at ROLL_LINES lines, so each PUT stays small however long the
    trainer runs. Every line reads back once (also after a roll cut between its two writes),
    and truncation on resume works across segments."""
    import json

    from rlrec.trainer.metrics import METRICS_FILE, TrainerMetrics, read_metrics_text

    direct = s3_behind_proxy[0]
    monkeypatch.setattr(TrainerMetrics, "ROLL_LINES", 4)
    puts = []
    real_write = type(direct).write

    def write(self, path, data):
        puts.append((path, len(data)))
        return real_write(self, path, data)

    monkeypatch.setattr(type(direct), "write", write)
    base = {"policy_version": 0, "timesteps_trained": 1, "shards_total": 1, "shards_new": 1}

    def iterations() -> list[int]:
        return [json.loads(x)["iteration"] for x in read_metrics_text(direct).splitlines()]

    m = TrainerMetrics(direct, None, False)
    for i in range(1, 11):
        m.write({**base, "iteration": i})
    assert iterations() == list(range(1, 11))
    assert sorted(i.path.rsplit("/", 1)[-1] for i in direct.list("metrics")) == [
        "000000000001.jsonl",
        "000000000005.jsonl",
    ]
    assert len(direct.read(METRICS_FILE).decode().splitlines()) == 2  # 9, 10
    assert max(n for p, n in puts if p == METRICS_FILE) < 4 * 200  # never more than ROLL_LINES lines
    # a roll cut after its segment was written: the file still holds the same lines
    direct.write(METRICS_FILE, direct.read("metrics/000000000005.jsonl") + direct.read(METRICS_FILE))
    assert iterations() == list(range(1, 11))
    # resume from iteration 6: the lines after it go, across segments and the file
    again = TrainerMetrics(direct, None, False)
    again.truncate_after(6)
    assert iterations() == list(range(1, 7))
    again.write({**base, "iteration": 7})
    assert iterations() == list(range(1, 8))
    again.truncate_after(None)
    assert iterations() == []


def test_resume_refuses_a_checkpoint_dir_with_checkpoints_but_no_latest_json_and_touches_nothing(tmp_path, capsys):
    from rlrec.cli import main
    from rlrec.trainer.checkpoints import CKPT_LATEST, CheckpointStore, ResumeRefused
    from rlrec.trainer.metrics import METRICS_FILE
    from tests.test_trainer_checkpoints import FakeAlgo

    ck = tmp_path / "ck"
    storage = Storage.from_uri(str(ck))
    store = CheckpointStore(storage)
    assert store.resume_point() is None  # nothing there: a new run
    storage.write("checkpoints/ckpt-00000001/algo/x", b"half")  # a first save that crashed: no index
    assert store.resume_point() is None
    path = store.save(3, FakeAlgo({"learner_group/w": b"1"}), {"n": 1}, policy_version=0)
    assert store.resume_point()["path"] == path
    storage.delete(CKPT_LATEST)  # a store that did not answer with it, or a damaged dir
    with pytest.raises(ResumeRefused, match="ckpt-00000003 exists"):
        store.resume_point()
    storage.delete_tree("checkpoints")
    with pytest.raises(ResumeRefused, match="published policy v2"):
        store.resume_point(published=2)

    storage.write(f"{path}/index.json", b"{}")
    metrics = b'{"iteration": 1}\n{"iteration": 2}\n'
    storage.write(METRICS_FILE, metrics)
    rc = main(["train", "--input", str(tmp_path / "in"), "--checkpoint-dir", str(ck), "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("rlrec train: error: ")]
    assert len(lines) == 1 and "latest.json is missing but checkpoint checkpoints/ckpt-00000003" in lines[0], err
    assert storage.read(METRICS_FILE) == metrics


def test_prune_orders_saves_numerically_and_counts_only_complete_checkpoints(tmp_path):
    from rlrec.trainer.checkpoints import CheckpointStore
    from tests.test_trainer_checkpoints import FakeAlgo

    storage = Storage.from_uri(str(tmp_path / "ck"))
    store = CheckpointStore(storage)
    paths = [store.save(5, FakeAlgo({"learner_group/w": bytes([i])}), {}, policy_version=1) for i in range(12)]
    assert paths[10:] == ["checkpoints/ckpt-00000005.10", "checkpoints/ckpt-00000005.11"]
    storage.write("checkpoints/ckpt-00000004/algo/w", b"a crashed save")  # half-written, older
    storage.write("checkpoints/ckpt-00000009/algo/w", b"a crashed save")  # half-written, newer
    store.prune(3, current=paths[-1])
    left = [i.path for i in storage.list("checkpoints") if i.is_dir]
    assert sorted(left) == sorted([*paths[9:], "checkpoints/ckpt-00000009"])
    assert store.complete_checkpoints() == paths[9:]


FAST = RetryPolicy(attempts=None, base_delay=0.01, max_delay=0.02, jitter=0)


def _local_shards(tmp_path, n: int):
    """(Storage, FeedState with `n` committed shards, their ShardInfos) on a local store."""
    storage = Storage.from_uri(str(tmp_path / "in"))
    c = ShardCommitter(storage)
    for i in range(n):
        c.commit(expert_cartpole_episodes(2, seed=i, max_steps=50))
    infos = [ShardInfo.from_entry(i, e) for i, e in enumerate(read_manifest(storage))]
    state = FeedState(FeedPolicy(chunk_rows=10**6, max_ahead_rows=10**6, fresh_fraction=1.0))
    state.add_shards(infos)
    return storage, state, infos


def _served(read_task, state, storage, on_failed=lambda kind: None) -> list[int]:
    """Shard indices of the blocks one read task yields until every fresh shard was handed out."""
    blocks = read_task._serve(
        FeedStandIn(state, on_failed), storage, read_task._TableCache(1 << 24), ["item"], verify=True, policy=FAST
    )
    return [shard_of_tag(int(b.column(read_task.TAG)[0].as_py())) for b in blocks]


def test_one_failed_read_does_not_condemn_a_shard_two_a_retry_wait_apart_do(tmp_path, monkeypatch):
    from rlrec.trainer import read_task

    monkeypatch.setattr(read_task.ray, "get", lambda x: x)
    storage, state, infos = _local_shards(tmp_path, 3)
    real_read = read_task.read_committed_shard
    reads: dict[str, int] = {}

    def flaky_read(st, path, staging, size=0):
        reads[path] = reads.get(path, 0) + 1
        data = real_read(st, path, staging, size)
        if path == infos[0].path and reads[path] == 1:
            return data[:-7] + b"flipped"  # damaged once in transit: the sha256 does not match
        if path == infos[1].path and reads[path] == 1:
            raise FileNotFoundError(path)  # a 404 once (a replica not there yet)
        if path == infos[2].path:
            return data[:-7] + b"flipped"  # damaged for good
        return data

    monkeypatch.setattr(read_task, "read_committed_shard", flaky_read)
    assert sorted(_served(read_task, state, storage)) == [0, 1]
    st = state.pop_stats()
    assert st.missing == [] and [k for k, _ in st.bad] == [infos[2].key] and "sha256" in st.bad[0][1]
    assert reads == {infos[0].path: 2, infos[1].path: 2, infos[2].path: 2}

    storage2, state2, infos2 = _local_shards(tmp_path / "gone", 1)
    monkeypatch.setattr(read_task, "read_committed_shard", real_read)
    storage2.delete(infos2[0].path)  # gone at both reads
    assert _served(read_task, state2, storage2) == []
    assert state2.pop_stats().missing == [infos2[0].key]


def test_a_reader_out_of_memory_gives_the_chunk_back_and_is_not_a_bad_shard_nor_a_storage_error(tmp_path, monkeypatch):
    import pyarrow as pa

    from rlrec.trainer import read_task

    monkeypatch.setattr(read_task.ray, "get", lambda x: x)
    storage, state, _ = _local_shards(tmp_path, 1)
    real_open = read_task.open_shard
    calls = [0]

    def open_once_oom(data, fmt):
        calls[0] += 1
        if calls[0] == 1:
            raise pa.ArrowMemoryError("malloc of size 1073741824 failed")
        return real_open(data, fmt=fmt)

    monkeypatch.setattr(read_task, "open_shard", open_once_oom)
    kinds: list[str] = []
    assert _served(read_task, state, storage, kinds.append) == [0]
    assert kinds == ["busy"] and state.storage_errors == 0 and state.pop_stats().bad == []


def test_a_store_that_refuses_is_retried_never_skipped_logged_as_an_error_and_not_an_outage(
    s3_behind_proxy, monkeypatch, caplog
):
    from rlrec.trainer import read_task

    direct, through, proxy = s3_behind_proxy
    ShardCommitter(direct).commit(expert_cartpole_episodes(2, seed=0, max_steps=50))
    infos = [ShardInfo.from_entry(i, e) for i, e in enumerate(read_manifest(direct))]
    state = FeedState(FeedPolicy(chunk_rows=10**6, max_ahead_rows=10**6, fresh_fraction=1.0))
    state.add_shards(infos)
    monkeypatch.setattr(read_task.ray, "get", lambda x: x)
    caplog.set_level(logging.INFO, logger="rlrec.trainer")
    kinds: list[str] = []

    def on_failed(kind: str) -> None:
        kinds.append(kind)
        if len(kinds) == 3:
            proxy.clear_rules()  # someone fixed the bucket policy

    proxy.deny_matching(10**6, ".parquet")
    assert _served(read_task, state, through, on_failed) == [0]
    assert kinds == ["refused"] * 3 and state.refusals == 3 and state.storage_errors == 0
    assert "AccessDenied" in state.last_refusal or "ACCESS_DENIED" in state.last_refusal
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3 and all(m.startswith("store refuses (") for m in errors)

    # on the driver: an ERROR of its own, counted, and no outage (the stall watchdog is not excused)
    counted: list[int] = []
    h = StorageHealth("s3://bucket/run", on_errors=counted.append, clock=lambda: 0.0)
    h.failed("manifest poll", "StorageError: HTTP status 503")  # an outage first, then the store refuses
    assert h.failing
    h.reader_refusals(state.refusals, state.last_refusal)
    h.reader_refusals(state.refusals, state.last_refusal)  # nothing new
    assert not h.failing and h.refusals == 3 and counted == [1, 3] and h.pop_iteration() == 4
    drv = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR][3:]
    assert len(drv) == 1 and "storage s3://bucket/run refuses (shard read" in drv[0]


def test_manifest_poll_failures_are_told_apart_outage_refusal_or_a_bug(caplog):
    import threading
    from types import SimpleNamespace

    from rlrec.store.storage import StorageError
    from rlrec.trainer.data import ManifestOfflineData

    errors = [
        StorageError("HTTP status 503"),
        OSError("AWS Error ACCESS_DENIED during ListObjectsV2"),
        ValueError("bug"),
    ]

    def poll(force_discover=False):
        raise errors.pop(0)

    od = SimpleNamespace(_lock=threading.Lock(), follower=SimpleNamespace(poll=poll), health=StorageHealth("s3://b/in"))
    caplog.set_level(logging.INFO, logger="rlrec.trainer")
    assert ManifestOfflineData.refresh(od) == 0
    assert od.health.failing and od.health.refusals == 0
    od.health.answered()
    assert ManifestOfflineData.refresh(od) == 0
    assert not od.health.failing and od.health.refusals == 1
    assert ManifestOfflineData.refresh(od) == 0
    assert not od.health.failing and od.health.total == 2
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("refuses (manifest poll" in m for m in msgs) and msgs[-1] == "manifest poll failed: ValueError: bug"


def test_manifest_polls_during_an_outage_follow_the_retry_schedule():
    from types import SimpleNamespace

    from rlrec.store.retry import RetrySchedule
    from rlrec.trainer.data import ManifestOfflineData

    polls: list[float] = []
    answers = [False] * 4 + [True] * 10
    od = SimpleNamespace(
        poll_schedule=RetrySchedule(RetryPolicy(attempts=None, base_delay=1.0, max_delay=4.0, jitter=0)),
        last_poll_error=None,
        check_health=lambda: None,
    )

    def refresh():
        polls.append(now)
        od.last_poll_error = None if answers.pop(0) else "StorageError: HTTP status 503"

    od.refresh = refresh
    for tick in range(0, 24):  # the poll thread's turns, every 0.5 s
        now = tick * 0.5
        ManifestOfflineData._poll_once(od, now)
    assert polls[:5] == [0.0, 1.0, 3.0, 7.0, 11.0]  # waits 1, 2, 4, 4: then the store answers
    assert polls[5:] == [11.5]


def test_a_checkpoint_waiting_for_its_store_excuses_the_watchdog_and_a_stop_ends_the_wait(monkeypatch):
    import threading
    from types import SimpleNamespace

    from rlrec.store.storage import StorageError
    from rlrec.trainer import service

    down_seen: list[bool] = []
    trainer = SimpleNamespace(iteration=7, policy_version=1, algo=None, _stop=threading.Event())
    trainer.out = Storage.from_uri("/tmp/rlrec-unused")
    trainer._checkpoint_store_down = False

    def save(*_a, **_k):
        down_seen.append(trainer._checkpoint_store_down)
        trainer._stop.set()  # SIGTERM while the store does not answer
        raise StorageError("HTTP status 503")

    trainer.checkpoints = SimpleNamespace(save=save)
    monkeypatch.setattr(service.time, "sleep", lambda s: pytest.fail(f"slept {s}s instead of waiting on the stop"))
    with pytest.raises(StorageError):
        service.ContinuousTrainer._save_committed(trainer, {}, {})
    assert down_seen == [False, True, True, True] and trainer._checkpoint_store_down is False
