"""End to end: EpisodeRecorder -> real broker -> RecorderConsumer -> local dir and S3 -> episodes."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
from confluent_kafka import Consumer, TopicPartition

from rlrec.consumer.service import ConsumerConfig, RecorderConsumer
from rlrec.local import FAST_GROUP_KAFKA
from rlrec.producer import EpisodeRecorder
from rlrec.store.commit import read_committed_shard
from rlrec.store.maintenance import verify
from rlrec.store.manifest import read_manifest
from rlrec.store.shards import read_episodes
from rlrec.store.storage import Storage
from tests.helpers import ACT_SPACE, OBS_SPACE, assert_episode_matches, record_episodes, wait_for
from tests.stores import SERVER_FIXTURES, ObjectStore

pytestmark = pytest.mark.broker


def run_consumer(cfg: ConsumerConfig, storage: Storage | None = None):
    c = RecorderConsumer(cfg, storage)
    t = threading.Thread(target=c.run, kwargs={"install_signals": False}, daemon=True)
    t.start()
    return c, t


def committed_episodes(storage: Storage) -> int:
    return sum(e.episodes for e in read_manifest(storage))


def read_all(storage: Storage) -> dict:
    out = {}
    for e in read_manifest(storage):
        for ep in read_episodes(read_committed_shard(storage, e.path, e.staging_path)):
            assert ep.id_ not in out, f"episode {ep.id_} committed twice"
            out[ep.id_] = (ep, e)
    return out


def drain_dlq(bootstrap: str, topic: str, timeout: float = 4.0) -> list:
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"dlq-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            **FAST_GROUP_KAFKA,
        }
    )
    c.subscribe([f"{topic}.dlq"])
    out = []
    deadline = time.time() + timeout + 3
    while time.time() < deadline:
        m = c.poll(0.5)
        if m is None or m.error():
            continue
        out.append(m)
    c.close()
    return out


def _recorders(bootstrap, topic):
    kw = {"topic": topic, "observation_space": OBS_SPACE, "action_space": ACT_SPACE, "env_id": "synthetic"}
    return (EpisodeRecorder(bootstrap, policy_id="pol-a", **kw), EpisodeRecorder(bootstrap, policy_id="pol-b", **kw))


@pytest.mark.parametrize("where", ["local", *sorted(SERVER_FIXTURES)])
def test_recorded_episodes_land_exactly_once(where, broker, topic, tmp_path, monkeypatch, recorder_config, request):
    if where == "local":
        output = str(tmp_path / "out")
    else:  # s3, gcs, azure: a real server on 127.0.0.1
        output = ObjectStore(where, request.getfixturevalue(SERVER_FIXTURES[where])).output(monkeypatch, "exp")
    ra, rb = _recorders(broker.bootstrap_servers, topic)
    truth = record_episodes(ra, 30, seed=1, abort_every=7, delayed_every=5)
    truth.update(record_episodes(rb, 20, seed=2))
    assert ra.flush(10) == 0 and rb.flush(10) == 0
    cfg = recorder_config(output, max_file_age_s=0.5, commit_interval_s=0.5)
    storage = Storage.from_uri(output)
    c, t = run_consumer(cfg, storage)
    try:
        wait_for(lambda: committed_episodes(storage) >= len(truth), 40, what="all episodes committed")
        # a second wave after the first commit goes to new shards
        more = record_episodes(ra, 10, seed=3)
        ra.flush(10)
        truth.update(more)
        wait_for(lambda: committed_episodes(storage) >= len(truth), 30, what="second wave committed")
    finally:
        c.stop()
        t.join(30)
        messages = ra.stats.messages_produced + rb.stats.messages_produced
        ra.close()
        rb.close()
    assert not t.is_alive()
    got = read_all(storage)
    assert set(got) == set(truth)
    for eid, (ep, entry) in got.items():
        assert_episode_matches(ep, truth[eid])
        assert entry.policy_id == truth[eid].policy_id == ep.custom_data["policy_id"]
    # layout: {output}/{policy_id}/..., names from topic+partition+offsets
    for e in read_manifest(storage):
        assert e.path.startswith(f"{e.policy_id}/{topic}+{e.partition:05d}+")
        assert storage.exists(e.path)
    assert verify(storage) == []
    assert drain_dlq(broker.bootstrap_servers, topic) == []
    # offsets were committed past everything: nothing is left to replay
    k = Consumer({"bootstrap.servers": broker.bootstrap_servers, "group.id": cfg.group_id, **FAST_GROUP_KAFKA})
    committed = k.committed([TopicPartition(topic, p) for p in range(4)], timeout=10)
    k.close()
    assert sum(max(tp.offset, 0) for tp in committed) == messages


def test_restart_replays_without_duplicates(broker, topic, tmp_path, recorder_config):
    """Stop after a partial commit, restart with the same group: no episode twice, none lost."""
    output = str(tmp_path / "out")
    ra, rb = _recorders(broker.bootstrap_servers, topic)
    rb.close()  # one policy is enough here
    version = ra.policy_version
    # open (unfinished) episodes hold the committed offset back: they must be replayed
    open_ids = [ra.begin_episode(OBS_SPACE.sample()) for _ in range(3)]
    for eid in open_ids:
        ra.log_step(eid, 0, 1.0, OBS_SPACE.sample())
    truth = record_episodes(ra, 25, seed=4)
    ra.flush(10)
    cfg = recorder_config(output)
    storage = Storage.from_uri(output)
    c, t = run_consumer(cfg, storage)
    wait_for(lambda: committed_episodes(storage) >= 25, 40, what="first run committed")
    c.stop()
    t.join(30)
    # finish the open episodes; the restarted consumer replays from before their starts
    for eid in open_ids:
        ra.log_step(eid, 1, 1.0, OBS_SPACE.sample(), terminated=True)
    ra.flush(10)
    c2, t2 = run_consumer(cfg, storage)
    try:
        wait_for(lambda: committed_episodes(storage) >= 28, 40, what="replayed episodes committed")
    finally:
        c2.stop()
        t2.join(30)
        ra.close()
    got = read_all(storage)
    assert set(got) == set(truth) | set(open_ids)
    assert c2.metrics.episodes_committed._value.get() == 3  # only the 3 replayed ones were new
    # the open episodes were logged without action_logp (2 steps each): counted per policy version,
    # by the consumer that committed them and in their shard entries
    labels = {"policy_id": "pol-a", "policy_version": str(version)}
    assert c.metrics.registry.get_sample_value("rlrec_steps_without_propensity_total", labels) is None
    assert c2.metrics.registry.get_sample_value("rlrec_steps_without_propensity_total", labels) == 6
    counts = [e.steps_without_logp for e in read_manifest(storage)]
    assert sum(n for d in counts for n in d.values()) == 6 and all(set(d) == {str(version)} for d in counts)


def test_claim_replays_from_the_store_position_not_the_group_offset(broker, topic, tmp_path, recorder_config):
    """The consumer resumes each partition from the store's position (the largest resume_offset of
    its shard entries) and claims with it (`replay_from`), so the claim loads only the committed
    episode ids that can still be replayed; the group's committed offsets, even far ahead, are
    not trusted."""
    output = str(tmp_path / "out")
    ra, rb = _recorders(broker.bootstrap_servers, topic)
    rb.close()
    record_episodes(ra, 12, seed=5)
    ra.flush(10)
    cfg = recorder_config(output)
    storage = Storage.from_uri(output)
    c, t = run_consumer(cfg, storage)
    try:
        wait_for(
            lambda: (
                committed_episodes(storage) >= 12 and any(w.kafka_committed is not None for w in c.writers.values())
            ),
            40,
            what="committed",
        )
        time.sleep(1.0)  # one more offset commit
    finally:
        c.stop()
        t.join(30)
        ra.close()
    positions: dict[int, int] = {}
    for e in read_manifest(storage):
        positions[e.partition] = max(positions.get(e.partition, 0), e.resume_offset)
    probe = Consumer({"bootstrap.servers": broker.bootstrap_servers, "group.id": cfg.group_id, **FAST_GROUP_KAFKA})
    committed = {
        tp.partition: tp.offset for tp in probe.committed([TopicPartition(topic, p) for p in range(4)], timeout=10)
    }
    # the store's positions are the offsets the group committed (all events are in shards)
    assert positions and all(committed[p] == off for p, off in positions.items()), (positions, committed)
    # the group runs ahead of the store (another output consumed with the same group id)
    probe.commit(offsets=[TopicPartition(topic, p, 10_000) for p in range(4)], asynchronous=False)
    probe.close()
    c2, t2 = run_consumer(cfg, storage)
    try:
        wait_for(lambda: len(c2.writers) == 4 and all(w.assembler for w in c2.writers.values()), 40, what="claims")
        # a partition without shards resumes where its first claim recorded it starts (the
        # topic's earliest offset, 0 here), or from nowhere if the first run never claimed it
        replayed = {p: w.replay_from for p, w in c2.writers.items()}
        assert {p: replayed[p] for p in positions} == positions, (replayed, positions)
        assert all(replayed[p] in (0, None) for p in range(4) if p not in positions), replayed
    finally:
        c2.stop()
        t2.join(30)
    # nothing new was read, yet the group's offsets (which lag tools read) came back to the store's
    probe = Consumer({"bootstrap.servers": broker.bootstrap_servers, "group.id": cfg.group_id, **FAST_GROUP_KAFKA})
    after = {
        tp.partition: tp.offset for tp in probe.committed([TopicPartition(topic, p) for p in range(4)], timeout=10)
    }
    probe.close()
    assert all(after[p] == off for p, off in positions.items()), (positions, after)


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # starts Ray
def test_stock_rllib_bc_trains_on_consumer_shards(broker, topic, tmp_path, recorder_config):
    """Stock, unmodified BC reads {output}/{policy_id} (committed shards only) and trains 2 iterations."""
    import gymnasium as gym
    import ray
    from ray.rllib.algorithms.bc import BCConfig

    from rlrec.producer import RecordingWrapper

    output = tmp_path / "out"
    env = gym.make("CartPole-v1")
    rec = EpisodeRecorder(
        broker.bootstrap_servers,
        topic=topic,
        policy_id="expert",
        observation_space=env.observation_space,
        action_space=env.action_space,
        env_id="CartPole-v1",
    )
    wrapped = RecordingWrapper(env, rec)
    for i in range(20):
        obs, _ = wrapped.reset(seed=i)
        done = False
        while not done:
            wrapped.set_model_outputs({"action_logp": np.float32(-0.05)})
            obs, _, te, tr, _ = wrapped.step(int(obs[2] + 0.5 * obs[3] > 0))
            done = te or tr
    rec.close()
    storage = Storage.from_uri(str(output))
    cfg = recorder_config(str(output))
    c, t = run_consumer(cfg, storage)
    try:
        wait_for(lambda: committed_episodes(storage) >= 20, 40, what="episodes committed")
    finally:
        c.stop()
        t.join(30)
    # a staged, uncommitted leftover must not be read by stock RLlib
    (output / "expert" / "_staging").mkdir(exist_ok=True)
    (output / "expert" / "_staging" / "junk.parquet").write_bytes(b"not parquet")
    ray.init(address="local", num_cpus=4, include_dashboard=False, ignore_reinit_error=True)
    try:
        config = (
            BCConfig()
            .environment(observation_space=env.observation_space, action_space=env.action_space)
            .offline_data(
                input_=[str(output / "expert")],
                input_read_episodes=True,
                map_batches_kwargs={"concurrency": 1},
                dataset_num_iters_per_learner=2,
            )
            .training(train_batch_size_per_learner=256)
        )
        algo = config.build()
        results = [algo.train() for _ in range(2)]
        learner = results[-1]["learners"]["default_policy"]
        assert np.isfinite(learner["policy_loss"])
        assert results[-1]["learners"]["__all_modules__"]["num_env_steps_trained_lifetime"] > 0
        algo.offline_data.batch_iterators = None
        algo.stop()
    finally:
        ray.shutdown()


@pytest.mark.system  # two consumer processes
def test_a_second_consumer_process_joins_mid_run_exactly_once(broker, topic, tmp_path, recorder_config):
    """Scale-out: a second `rlrec consume` process joins the group while episodes are open and
    traffic flows. The group rebalances (partitions move to the new process with their open
    episodes), and every episode is committed exactly once, by one of the two processes."""
    import signal
    import subprocess
    import sys

    output = str(tmp_path / "out")
    ra, rb = _recorders(broker.bootstrap_servers, topic)
    rb.close()
    truth = record_episodes(ra, 20, seed=6)
    open_ids = [ra.begin_episode(OBS_SPACE.sample()) for _ in range(8)]  # open across the rebalance
    for eid in open_ids:
        ra.log_step(eid, 0, 1.0, OBS_SPACE.sample())
    assert ra.flush(10) == 0
    group = f"g-{uuid.uuid4().hex[:6]}"
    cfg = recorder_config(output, group_id=group)
    storage = Storage.from_uri(output)
    a, ta = run_consumer(cfg, storage)
    proc = None
    try:
        wait_for(lambda: committed_episodes(storage) >= 20 and len(a.writers) == 4, 40, what="first process")
        args = ["consume", "--bootstrap-servers", broker.bootstrap_servers, "--topic", topic, "--group-id", group]
        args += ["--output", output, "--no-create-topics", "--max-file-age-s", "0.3", "--commit-interval-s", "0.3"]
        args += [x for k, v in FAST_GROUP_KAFKA.items() for x in ("--kafka-config", f"{k}={v}")]
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlrec", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        stop_traffic = threading.Event()
        seeds = iter(range(100, 10_000))

        def traffic():  # episodes keep arriving while the group rebalances
            while not stop_traffic.is_set():
                truth.update(record_episodes(ra, 2, seed=next(seeds)))
                ra.flush(10)
                time.sleep(0.1)

        tt = threading.Thread(target=traffic, daemon=True)
        tt.start()
        wait_for(lambda: 0 < len(a.writers) < 4, 60, what="the rebalance giving partitions to the new process")
        for eid in open_ids:  # finish the open episodes after the rebalance
            ra.log_step(eid, 1, 1.0, OBS_SPACE.sample(), terminated=True)
        time.sleep(1.0)
        stop_traffic.set()
        tt.join(30)
        assert ra.flush(10) == 0
        expected = set(truth) | set(open_ids)
        wait_for(lambda: committed_episodes(storage) >= len(expected), 60, what="every episode committed")
        time.sleep(1.0)  # a late duplicate would show up here
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            err = proc.communicate(timeout=60)[1] if proc is not None else ""
        except subprocess.TimeoutExpired:  # never leave it running
            proc.kill()
            err = proc.communicate()[1]
        a.stop()
        ta.join(30)
        ra.close()
    assert proc.returncode == 143, err[-3000:]  # 128 + SIGTERM, after the clean stop
    got = read_all(storage)  # raises on an episode committed twice
    assert set(got) == expected and len(got) == committed_episodes(storage)
    assert {e.partition for e in read_manifest(storage)} == {0, 1, 2, 3}
    a_committed = a.metrics.episodes_committed._value.get()
    assert 0 < a_committed < len(expected)  # both processes committed some episodes
    assert verify(storage) == []
    assert drain_dlq(broker.bootstrap_servers, topic) == []
