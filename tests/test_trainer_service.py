"""The continuous trainer end to end, with Ray: streaming shards, resume, algorithms, CLI, load_policy.

In-process tests share one module-scoped ``ray.init(num_cpus=4)``; the CLI test runs `rlrec train`
in a subprocess with its own Ray (``--num-cpus 2``) and stops it with SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import numpy as np
import pytest

from rlrec.store.commit import ShardCommitter
from rlrec.store.manifest import read_manifest
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes, pendulum_episodes
from tests.helpers import assert_each_shard_new_exactly_once, read_metrics

pytestmark = pytest.mark.slow


def wait_for(pred, timeout: float, what: str, interval: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def run_in_thread(trainer):
    box: dict = {}

    def target():
        try:
            box["rc"] = trainer.run()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def cfg(out, ck, **kw):
    from rlrec.trainer.service import TrainerConfig

    base = {
        "input": out,
        "checkpoint_dir": ck,
        "algo": "BC",
        "poll_interval_s": 0.2,
        "progress": False,
        "promotion_gate": "off",  # every checkpoint's policy published (the default gates them)
        "cache_ttl_s": 1.0,
        "algo_config": {"train_batch_size_per_learner": 256, "lr": 1e-3},
        "offline_config": {"dataset_num_iters_per_learner": 5},
    }
    base.update(kw)
    return TrainerConfig(**base)


def new_shards_per_line(lines):
    return [set(x.get("new_shards", ())) for x in lines]


# ------------------------------------------------------------------------------------- streaming


# Iteration length: with the Learner in the driver (num_learners=0) the Learner loop competes
# with the pipeline for this 2-CPU box, and commit -> first gradient step measured ~1.3-1.6 s
# (remote Learner: 0.2-0.4 s); 2-s iterations keep "within one iteration" meaningful there.
# a latency bound ("within one iteration") on a live trainer: run with the machine to itself (system part)
@pytest.mark.system
@pytest.mark.parametrize("num_learners,iteration_s", [(0, 2.0), (1, 1.0)])
def test_shards_committed_while_training_are_trained_within_one_iteration(
    ray_cluster, tmp_path, num_learners, iteration_s, caplog
):
    from rlrec.trainer.service import ContinuousTrainer

    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    c = ShardCommitter(out)
    for i in range(3):
        c.commit(expert_cartpole_episodes(3, seed=i, max_steps=200))
    trainer = ContinuousTrainer(
        cfg(
            out,
            ck,
            num_learners=num_learners,
            checkpoint_interval=4,
            min_time_s_per_iteration=iteration_s,
            metrics_port=0,
        )
    )
    t, box = run_in_thread(trainer)
    # the waits below are wall-time safety nets sized for a loaded machine (Ray's start-up above
    # all); what the test proves is counted in iterations, from the metrics lines
    wait_for(lambda: len(read_metrics(ck)) >= 2, 300, "the first iterations")

    # the same numbers on the Prometheus endpoint (127.0.0.1, a free port)
    def scrape() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{trainer.metrics.port}/metrics", timeout=10) as r:
            return {
                ln.split()[0]: float(ln.split()[1])
                for ln in r.read().decode().splitlines()
                if ln.startswith("rlrec_trainer_")
            }

    def scraped_equals_its_line():  # (a scrape may fall between two gauge updates: retry)
        d = scrape()
        line = next((r for r in read_metrics(ck) if r["iteration"] == d.get("rlrec_trainer_iteration")), None)
        keys = ("policy_version", "timesteps_trained", "shards_total", "shards_new")
        return line if line and all(d[f"rlrec_trainer_{k}"] == line[k] for k in keys) else None

    line = wait_for(scraped_equals_its_line, 60, "gauges equal to a metrics.jsonl line")
    assert line["timesteps_trained"] > 0 and line["shards_total"] == 3
    storage = Storage.from_uri(out)
    first = read_manifest(storage)[0]
    if num_learners == 0:  # a shard deleted outside the trainer (retention): skipped with a warning
        storage.delete(first.path)
    committed = {}
    for i in range(4):
        e = c.commit(expert_cartpole_episodes(3, seed=100 + i, max_steps=200)).entries[0]
        committed[e.path] = e.commit_time
        time.sleep(1.3)
    keys = {e.path for e in read_manifest(storage)}
    wait_for(lambda: set().union(*new_shards_per_line(read_metrics(ck))) >= keys, 300, "all shards trained on")
    if num_learners == 0:
        wait_for(lambda: read_metrics(ck)[-1]["shards_missing"] >= 1, 120, "the deleted shard to be noticed")
    trainer.stop("test")
    t.join(60)
    assert not t.is_alive() and "error" not in box, box
    lines = read_metrics(ck)
    assert [r["iteration"] for r in lines] == list(range(1, len(lines) + 1))
    assert_each_shard_new_exactly_once(lines, keys)
    for key, ct in committed.items():
        k = next(i for i, r in enumerate(lines) if r["time"] >= ct)  # the iteration running at commit
        got = next(i for i, r in enumerate(lines) if key in r["new_shards"])
        assert got <= k + 1, f"{key} committed during iteration {k + 1}, first trained in {got + 1}"
        assert lines[got]["newest_shard_age_s"] is not None
    for r in lines:
        assert {
            "iteration",
            "policy_version",
            "timesteps_trained",
            "shards_total",
            "shards_new",
            "newest_shard_age_s",
            "learner_loss",
        } <= r.keys()
        assert r["learner_loss"] is not None and np.isfinite(r["learner_loss"])
    assert lines[-1]["timesteps_trained"] > 0 and lines[-1]["shards_total"] == len(keys)
    # the stop checkpoint holds the cursor: every shard trained on
    latest = json.load(open(os.path.join(ck, "checkpoints", "latest.json")))
    assert latest["iteration"] == lines[-1]["iteration"]
    state = json.load(open(os.path.join(ck, latest["path"], "trainer.json")))
    assert set(state["trained_shards"]) == keys
    if num_learners == 0:
        assert any("deleted outside the trainer" in r.getMessage() for r in caplog.records)


class SimulatedCrash(Exception):
    pass


def test_resume_after_a_crash_loses_and_double_counts_no_fresh_shard(ray_cluster, tmp_path):
    from rlrec.trainer.service import ContinuousTrainer

    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    c = ShardCommitter(out)
    for i in range(2):
        c.commit(expert_cartpole_episodes(2, seed=i, max_steps=200))
    a = ContinuousTrainer(cfg(out, ck, checkpoint_interval=3))
    real = a.train_once
    committed_during = []

    def crashing():
        rec = real()
        if rec["iteration"] == 1:
            committed_during.extend(
                e.path for e in c.commit(expert_cartpole_episodes(2, seed=10, max_steps=200)).entries
            )
        if rec["iteration"] == 5:  # after iteration 5's metrics line; last checkpoint: iteration 3
            raise SimulatedCrash()
        return rec

    a.train_once = crashing
    t, box = run_in_thread(a)
    t.join(120)
    assert isinstance(box.get("error"), SimulatedCrash), box
    before = read_metrics(ck)
    assert [r["iteration"] for r in before] == [1, 2, 3, 4, 5]
    assert json.load(open(os.path.join(ck, "checkpoints", "latest.json")))["iteration"] == 3
    lost = set().union(*(set(r["new_shards"]) for r in before[3:]))  # trained after the checkpoint
    for i in range(2):  # committed while the trainer is down
        c.commit(expert_cartpole_episodes(2, seed=20 + i, max_steps=200))
    keys = {e.path for e in read_manifest(Storage.from_uri(out))}

    b = ContinuousTrainer(cfg(out, ck, resume=True, checkpoint_interval=3))
    t, box = run_in_thread(b)
    wait_for(
        lambda: set().union(*new_shards_per_line(read_metrics(ck))) >= keys and read_metrics(ck)[-1]["iteration"] >= 6,
        90,
        "all shards trained after the resume",
    )
    b.stop("test")
    t.join(60)
    assert "error" not in box, box
    lines = read_metrics(ck)
    its = [r["iteration"] for r in lines]
    assert its == list(range(1, len(lines) + 1)), its  # lost iterations 4-5 were dropped and redone
    assert_each_shard_new_exactly_once(lines, keys)
    for k in lost:  # trained only into weights the crash lost: fresh again after the resume
        assert any(k in r["new_shards"] for r in lines if r["iteration"] >= 4)
    assert lines[3]["timesteps_trained"] > lines[2]["timesteps_trained"]


def test_a_crash_between_a_checkpoint_and_its_publication_publishes_it_at_resume(ray_cluster, tmp_path):
    """The checkpoint commits the version it publishes: killed after the commit and before the
    version is written, the resume writes it (from the checkpoint), and across all versions'
    lineage.json every shard is new exactly once, versions growing one by one."""
    from rlrec.trainer.service import ContinuousTrainer

    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    c = ShardCommitter(out)
    for i in range(2):
        c.commit(expert_cartpole_episodes(2, seed=i, max_steps=200))
    a = ContinuousTrainer(cfg(out, ck, checkpoint_interval=2))

    def crash() -> None:
        raise SimulatedCrash()

    a._write_publications = crash  # the checkpoint is committed; nothing is written to policies/ yet
    t, box = run_in_thread(a)
    t.join(120)
    assert isinstance(box.get("error"), SimulatedCrash), box
    latest = json.load(open(os.path.join(ck, "checkpoints", "latest.json")))
    assert (latest["iteration"], latest["policy_version"]) == (2, 1)
    assert not os.path.exists(os.path.join(ck, "policies", "v000001"))
    state = json.load(open(os.path.join(ck, latest["path"], "trainer.json")))
    assert [p["version"] for p in state["publications"]] == [1] and state["since_publish"] == []
    c.commit(expert_cartpole_episodes(2, seed=5, max_steps=200))
    keys = {e.path for e in read_manifest(Storage.from_uri(out))}

    b = ContinuousTrainer(cfg(out, ck, resume=True, checkpoint_interval=2))
    t, box = run_in_thread(b)
    wait_for(lambda: os.path.exists(os.path.join(ck, "policies", "v000001", "policy.json")), 90, "v1 written")
    wait_for(lambda: set().union(*new_shards_per_line(read_metrics(ck))) >= keys, 90, "every shard trained")
    b.stop("test")
    t.join(60)
    assert "error" not in box, box
    pol = os.path.join(ck, "policies")
    lineages = [json.load(open(os.path.join(pol, d, "lineage.json"))) for d in sorted(os.listdir(pol)) if d[0] == "v"]
    assert lineages[0]["new_shards"] == state["trained_shards"]  # v1: what the checkpoint had trained
    assert [x["policy_version"] for x in lineages] == list(range(1, len(lineages) + 1))
    assert [x["parent_version"] for x in lineages] == [None, *range(1, len(lineages))]
    new = [k for x in lineages for k in x["new_shards"]]
    assert sorted(new) == sorted(keys), new


def test_a_killed_learner_actor_ends_the_run_at_once_with_one_clear_error(ray_cluster, tmp_path):
    """A remote Learner killed mid-run: RLlib does not restart it; the trainer stops within
    seconds with `TrainerLost` (one line: `rlrec train: error: a Ray actor of the trainer died
    ...; restart with --resume ...`), its last checkpoint intact."""
    import ray

    from rlrec.errors import error_line
    from rlrec.trainer.service import ContinuousTrainer, TrainerLost

    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    ShardCommitter(out).commit(expert_cartpole_episodes(3, seed=0, max_steps=200))
    trainer = ContinuousTrainer(cfg(out, ck, num_learners=1, checkpoint_interval=2))
    t, box = run_in_thread(trainer)
    wait_for(
        lambda: trainer.iteration >= 2 and os.path.exists(os.path.join(ck, "checkpoints", "latest.json")),
        90,
        "a checkpoint",
    )
    learners = list(trainer.algo.learner_group._worker_manager.actors().values())
    t0 = time.monotonic()
    ray.kill(learners[0], no_restart=True)
    t.join(60)
    assert not t.is_alive() and time.monotonic() - t0 < 30
    err = box.get("error")
    assert isinstance(err, TrainerLost), box
    line = error_line("train", err)
    assert (
        "\n" not in line
        and line.startswith("rlrec train: error: a Ray actor of the trainer died")
        and "--resume" in line
    )
    assert json.load(open(os.path.join(ck, "checkpoints", "latest.json")))["iteration"] >= 2


def test_an_entry_of_a_newer_rlrec_stops_the_run_after_a_checkpoint_instead_of_going_stale(ray_cluster, tmp_path):
    """A manifest entry this rlrec cannot read (a newer rlrec wrote it) means no new shards from
    its log until an upgrade: the trainer checkpoints and stops with `StoreTooNew` (one line
    naming the log and "upgrade rlrec", exit code 1) instead of training on stale data."""
    from rlrec.errors import error_line
    from rlrec.trainer.service import ContinuousTrainer, StoreTooNew

    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    c = ShardCommitter(out)
    c.commit(expert_cartpole_episodes(3, seed=0, max_steps=200))
    trainer = ContinuousTrainer(cfg(out, ck, checkpoint_interval=1000, poll_interval_s=0.2))
    t, box = run_in_thread(trainer)
    wait_for(lambda: trainer.iteration >= 2, 90, "training")
    seq = c.log.next_seq
    c.storage.create_once(f"_manifest/rl/00000/{seq:012d}.json", json.dumps({"type": "retain", "seq": seq}).encode())
    t.join(60)
    assert not t.is_alive()
    err = box.get("error")
    assert isinstance(err, StoreTooNew) and err.exit_code == 2, box
    line = error_line("train", err)
    assert "\n" not in line and "rl/00000" in line and "upgrade rlrec" in line and "--resume" in line
    assert "checkpointed" in line
    latest = json.load(open(os.path.join(ck, "checkpoints", "latest.json")))
    assert latest["iteration"] == trainer.iteration >= 2  # the final checkpoint holds the last iteration
    # started on that store (resumed): the same error at once, before training anything
    again = ContinuousTrainer(cfg(out, ck, resume=True))
    with pytest.raises(StoreTooNew, match=r"rl/00000.*did not start") as e:
        again.run()
    assert e.value.exit_code == 2
    assert json.load(open(os.path.join(ck, "checkpoints", "latest.json")))["iteration"] == latest["iteration"]


def test_resume_restores_weights_and_optimizer_state(ray_cluster, tmp_path):
    import torch
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rlrec.trainer.service import ContinuousTrainer

    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    ShardCommitter(out).commit(expert_cartpole_episodes(2, seed=0, max_steps=200))
    a = ContinuousTrainer(cfg(out, ck, max_iterations=2, checkpoint_interval=2))
    assert a.run() == 0
    b = ContinuousTrainer(cfg(out, ck, resume=True))
    try:
        assert b.setup()
        assert b.iteration == 2 and b.policy_version == 1
        state = b.algo.learner_group.get_state()["learner"]
        weights = state["rl_module"][DEFAULT_MODULE_ID]
        opt = state["optimizer"]
        steps = [p["step"] for v in opt.values() for p in v["state"]["state"].values()]
        assert steps and min(float(np.asarray(s)) for s in steps) > 0
        # same weights as the policy published at that checkpoint
        from rlrec.trainer.policy import load_policy

        p = load_policy(ck, allow_unsigned=True)  # trained without --signing-key
        obs = np.zeros(4, np.float32)
        spec = b.algo.offline_data.module_spec
        m = spec.build()[DEFAULT_MODULE_ID]
        m.set_state(weights)
        with torch.no_grad():
            ref = m._forward_inference({"obs": torch.as_tensor(obs[None])})["action_dist_inputs"][0].numpy()
        np.testing.assert_allclose(p.act(obs)[1]["action_dist_inputs"], ref, rtol=1e-5, atol=1e-6)
    finally:
        b.close()


# ------------------------------------------------------------------------------------- algorithms


@pytest.mark.parametrize(
    "algo,fmt", [("MARWIL", "episodes"), ("BC", "tabular"), ("CQL", "episodes"), ("IQL", "episodes")]
)
def test_algorithms_and_formats(ray_cluster, tmp_path, algo, fmt):
    from rlrec.trainer.policy import load_policy
    from rlrec.trainer.service import ContinuousTrainer

    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    c = ShardCommitter(out, fmt=fmt)
    continuous = algo in ("CQL", "IQL")
    for i in range(2):
        c.commit(
            pendulum_episodes(2, seed=i, max_steps=100)
            if continuous
            else expert_cartpole_episodes(2, seed=i, max_steps=200)
        )
    algo_config = {"train_batch_size_per_learner": 128}
    from rlrec.trainer.signing import generate_keys

    priv, pub = generate_keys(tmp_path / "keys")
    tr = ContinuousTrainer(
        cfg(
            out,
            ck,
            algo=algo,
            max_iterations=2,
            checkpoint_interval=2,
            algo_config=algo_config,
            env="Pendulum-v1" if continuous else None,
            signing_key=str(priv),
        )
    )
    assert tr.run() == 0
    lines = read_metrics(ck)
    assert [r["iteration"] for r in lines] == [1, 2]
    assert sum(r["shards_new"] for r in lines) >= 1
    assert all(r["learner_loss"] is not None for r in lines)
    p = load_policy(ck, public_key=pub)
    assert p.signed and p.spec["format"] == "safetensors"  # code-free for every algorithm here
    a, extra = p.act(np.zeros(3 if continuous else 4, np.float32))
    if continuous:
        assert p.spec["action_dist"]["type"] in ("squashed_gaussian", "diag_gaussian")
        assert a.shape == (1,) and -2.0 <= float(a[0]) <= 2.0
    else:
        assert a in (0, 1)
    assert np.isfinite(extra["action_logp"])


def test_single_agent_buffer_mode_trains_every_shard_as_new_once(ray_cluster, tmp_path):
    """`--prelearner-mode buffer` without --multi-agent (RLlib's PreLearner keeping an episode
    replay buffer): it trains, every shard counts as new exactly once, and the policy acts."""
    from rlrec.trainer.policy import load_policy
    from rlrec.trainer.service import ContinuousTrainer

    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    c = ShardCommitter(out)
    for i in range(3):
        c.commit(expert_cartpole_episodes(3, seed=i, max_steps=200))
    keys = [e.path for e in read_manifest(Storage.from_uri(out))]
    tr = ContinuousTrainer(cfg(out, ck, prelearner_mode="buffer", max_iterations=40))
    t, box = run_in_thread(tr)
    wait_for(
        lambda: {k for r in read_metrics(ck) for k in r.get("new_shards", ())} >= set(keys),
        300,
        what="every shard trained on",
    )
    tr.stop("test")
    t.join(120)
    assert not t.is_alive() and box.get("rc") == 0, box
    lines = read_metrics(ck)
    assert all(r["learner_loss"] is not None and np.isfinite(r["learner_loss"]) for r in lines)
    assert_each_shard_new_exactly_once(lines, keys)
    a, _ = load_policy(ck, allow_unsigned=True).act(np.zeros(4, np.float32))
    assert a in (0, 1)


# ------------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`rlrec train` on scripted-expert CartPole shards until evaluation reaches 400, then SIGTERM."""
    base = tmp_path_factory.mktemp("cli")
    out, ck = str(base / "out"), str(base / "ck")
    from rlrec.trainer.signing import generate_keys

    priv, pub = generate_keys(base / "keys")
    c = ShardCommitter(out)
    for i in range(8):
        c.commit(expert_cartpole_episodes(4, seed=i, epsilon=0.05))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlrec",
            "train",
            "--input",
            out,
            "--algo",
            "BC",
            "--env",
            "CartPole-v1",
            "--promotion-gate",
            "off",
            "--checkpoint-dir",
            ck,
            "--eval-interval",
            "3",
            "--eval-episodes",
            "3",
            "--checkpoint-interval",
            "1000",
            "--algo-config",
            "lr=0.001",
            "--algo-config",
            "train_batch_size_per_learner=512",
            "--num-cpus",
            "2",
            "--signing-key",
            str(priv),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    t0 = time.time()
    try:
        best = wait_for(
            lambda: (
                max((r.get("eval_return_mean") or 0 for r in read_metrics(ck)), default=0) >= 400
                and max(r.get("eval_return_mean") or 0 for r in read_metrics(ck))
            ),
            150,
            "eval return >= 400",
            interval=0.5,
        )
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return {
        "out": out,
        "ck": ck,
        "rc": proc.returncode,
        "output": output.decode(errors="replace"),
        "best": best,
        "seconds": time.time() - t0,
        "private_key": str(priv),
        "public_key": str(pub),
    }


@pytest.mark.system
def test_cli_bc_on_scripted_expert_reaches_400(cli_run):
    assert cli_run["rc"] == 143, cli_run["output"][-3000:]  # 128 + SIGTERM, after the clean stop
    assert cli_run["best"] >= 400


#: what Ray, RLlib and Ray Data write to a driver's stderr that reads as a failure but is not one
#: (rlrec.logs: quiet_ray_logging, drop_native_notices)
RAY_NOISE = (
    "core_worker.cc",
    "Token authentication is enabled",
    "on the new API stack",
    "DeprecationWarning",
    "is deprecated",
    "Install gputil",
    "Progress bars disabled",
    "execution finished in",
)


@pytest.mark.system
def test_cli_log_carries_our_lines_not_rays_notices(cli_run):
    out = cli_run["output"]
    assert [n for n in RAY_NOISE if n in out] == [], out[-3000:]
    assert " INFO rlrec.trainer: iter 1 " in out, out[-3000:]


@pytest.mark.system
def test_cli_sigterm_checkpoints_and_publishes(cli_run):
    ck = cli_run["ck"]
    lines = read_metrics(ck)
    latest = json.load(open(os.path.join(ck, "checkpoints", "latest.json")))
    assert latest["iteration"] == lines[-1]["iteration"]  # the SIGTERM checkpoint
    assert lines[-1].get("checkpoint") is not True or lines[-1]["iteration"] % 1000 == 0
    state = json.load(open(os.path.join(ck, latest["path"], "trainer.json")))
    assert set(state["trained_shards"]) == set().union(*(set(r["new_shards"]) for r in lines))
    pub = json.load(open(os.path.join(ck, "policies", "latest.json")))
    assert pub["policy_version"] == 1 == state["policy_version"]
    from rlrec.store.snapshot import open_snapshot
    from rlrec.trainer.lineage import Lineage

    lineage = Lineage.from_doc(1, json.load(open(os.path.join(ck, "policies", pub["path"], "lineage.json"))), True)
    entries = open_snapshot(lineage.input, as_of=lineage.cursor).entries
    assert set(lineage.shard_paths(entries)) == set(state["trained_shards"]) and lineage.num_shards == len(entries)


@pytest.mark.system
def test_load_policy_acts_without_ray(cli_run, tmp_path):
    import shutil

    pol = tmp_path / "policies"
    shutil.copytree(os.path.join(cli_run["ck"], "policies"), pol)
    script = textwrap.dedent(f"""
        import importlib.abc, json, shutil, sys
        class NoRay(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "ray" or name.startswith("ray."):
                    raise ImportError("ray must not be imported")
        sys.meta_path.insert(0, NoRay())
        import gymnasium as gym, hashlib
        from rlrec import load_policy
        from rlrec.trainer.binding import pointer_bytes
        from rlrec.trainer.signing import load_private_key, sign
        p = load_policy({str(pol)!r}, public_key={cli_run["public_key"]!r})
        assert p.run_id and p.channel == "default"
        env = gym.make("CartPole-v1")
        rets = []
        for ep in range(3):
            obs, _ = env.reset(seed=ep)
            done, ret = False, 0.0
            while not done:
                action, extra = p.act(obs)
                obs, r, term, trunc, _ = env.step(action)
                ret += r
                done = term or trunc
            rets.append(ret)
        assert set(extra) >= {{"action_dist_inputs", "action_logp"}}
        v1 = p.policy_version
        assert p.poll() is False
        # a newer version appears (signed by the trainer's key): poll() switches to it
        shutil.copytree({str(pol / "v000001")!r}, {str(pol / "v000002")!r})
        spec = json.load(open({str(pol / "v000002" / "policy.json")!r}))
        spec["policy_version"], spec["directory"] = 2, "v000002"
        data = json.dumps(spec).encode()
        open({str(pol / "v000002" / "policy.json")!r}, "wb").write(data)
        key = load_private_key({cli_run["private_key"]!r})
        open({str(pol / "v000002" / "policy.json.sig")!r}, "wb").write(sign(key, data))
        pointer = pointer_bytes(2, "v000002", hashlib.sha256(data).hexdigest(),
                                run_id=spec["run_id"], channel=spec["channel"])
        open({str(pol / "latest.json")!r}, "wb").write(pointer)
        open({str(pol / "latest.json.sig")!r}, "wb").write(sign(key, pointer))
        assert p.poll() is True and p.policy_version == 2
        print(json.dumps({{"returns": rets, "v1": v1, "ray": "ray" in sys.modules}}))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["ray"] is False and res["v1"] == 1
    assert np.mean(res["returns"]) >= 400, res


def test_ray_listens_on_loopback_only(ray_cluster):
    """Test servers bind 127.0.0.1 only, Ray's too (conftest calls rlrec.local.ray_on_loopback).

    A remote Learner of an earlier test may still be exiting: its torch.distributed TCPStore
    listens on every interface while it lives (torch has no option to bind it; docs/TRAINER.md),
    so exposure must be gone within a few seconds; Ray's own servers would stay exposed."""
    import psutil
    import ray

    @ray.remote
    def where() -> str:
        return ray.util.get_node_ip_address()

    assert ray.get(where.remote()) == "127.0.0.1"
    loopback = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}

    def exposed() -> list:
        ours = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
        listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in ours]
        assert len(listening) >= 3, listening  # GCS, raylet, the worker at least
        out = []
        for c in listening:
            if c.laddr.ip not in loopback:
                try:
                    out.append((c.laddr.ip, c.laddr.port, psutil.Process(c.pid).name()))
                except psutil.NoSuchProcess:
                    pass
        return out

    deadline = time.time() + 20
    left = exposed()
    while left and time.time() < deadline:
        time.sleep(0.5)
        left = exposed()
    assert not left, f"Ray listens beyond loopback: {left}"
