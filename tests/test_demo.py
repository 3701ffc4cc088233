"""`rlrec demo` end to end, in a subprocess with the real broker, consumer, trainer (Ray) and policies.

* the closed loop: episodes committed, trained on, a policy version published by the promotion
  gate and used by a policy process (committed episodes carry policy_version >= 1);
* Ctrl-C (SIGINT): exit code 130, no child process left, every episode played is committed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from rlrec.store.manifest import read_manifest
from rlrec.store.shards import read_episodes
from rlrec.store.storage import Storage

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.broker]

LAYOUT_KEYS = {
    "time",
    "elapsed_s",
    "steps_published",
    "steps_per_s",
    "episodes_committed",
    "shards_committed",
    "dead_letters",
    "trainer_iteration",
    "timesteps_trained",
    "newest_shard_age_s",
    "eval_return_mean",
    "policy_version",
    "policy_versions_in_use",
}


def _demo(data_dir, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RLREC_BOOTSTRAP_SERVERS", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlrec",
            "demo",
            "--data-dir",
            str(data_dir),
            "--no-live",
            "--no-report",
            "--policy-processes",
            "2",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _jsonl(path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.strip()]
    except FileNotFoundError:
        return []


def _committed_versions(shards: str) -> list[int]:
    storage = Storage.from_uri(shards)
    return [
        int(ep.custom_data["policy_version"])
        for e in read_manifest(storage)
        for ep in read_episodes(storage.read(e.path))
    ]


def _assert_gone(pids: list[int]) -> None:
    deadline = time.time() + 15
    left = []
    while time.time() < deadline:
        left = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        if not left:
            return
        time.sleep(0.5)
    raise AssertionError(f"processes left behind: {left}")


def test_demo_closes_the_loop(tmp_path):
    # ends as soon as a published version (the gate: better than the noisy expert) is in use
    proc = _demo(tmp_path, "--duration", "200", "--until-return", "1", "--settle-s", "3", "--checkpoint-interval", "2")
    out, _ = proc.communicate(timeout=280)
    assert proc.returncode == 0, out[-4000:]
    desc = json.load(open(tmp_path / "demo.json"))
    assert desc["ended"] is not None and desc["outcome"]["target_used_s"] is not None, desc
    summary = desc["summary"]
    # committed: every episode the policies played, and the manifest agrees
    versions = _committed_versions(desc["shards_uri"])
    assert len(versions) == summary["episodes"] == summary["episodes_played"] > 0
    # trained on
    tmetrics = _jsonl(tmp_path / "trainer" / "metrics.jsonl")
    assert sum(r["shards_new"] for r in tmetrics) > 0 and tmetrics[-1]["timesteps_trained"] > 0
    # published by the gate, decisions recorded; promoted returns never decrease
    decisions = [r["promotion"] for r in tmetrics if "promotion" in r]
    promoted = [d for d in decisions if d["promoted"]]
    assert promoted and promoted[0]["deployed_return"] == pytest.approx(desc["baseline_return"], abs=1e-3)
    rets = [d["candidate_return"] for d in promoted]
    assert rets == sorted(rets) and rets[0] >= desc["baseline_return"]
    # the off-policy estimates that finished in time sit beside the true discounted return (--env)
    for r in [r["ope_report"] for r in tmetrics if "ope_report" in r]:
        assert r["estimator"] == "wdr" and r.get("true_return") is not None, r
        assert r["candidate_return"] is not None or r["reason"], r
    latest = json.load(open(tmp_path / "trainer" / "policies" / "latest.json"))
    assert latest["policy_version"] == len(promoted) >= 1
    # used: episodes recorded by a policy process acting with a published version are committed
    assert 0 in versions and max(versions) >= 1, sorted(set(versions))
    assert max(versions) <= latest["policy_version"]
    # the key pair made on first start signs what is published (the policies verify with its public key)
    assert (tmp_path / "keys" / "policy-signing.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "trainer" / "policies" / latest["path"] / "policy.json.sig").exists()
    # the demo's own metrics follow the layout
    lines = _jsonl(tmp_path / "metrics.jsonl")
    assert len(lines) >= 3 and all(r.keys() >= LAYOUT_KEYS for r in lines)
    assert lines[-1]["episodes_committed"] == summary["episodes"]
    assert max(r["policy_version"] or 0 for r in lines) >= 1
    assert f"rlrec inspect {desc['shards_uri']}" in out and "rlrec report" in out


def test_demo_stops_cleanly_on_sigint(tmp_path):
    proc = _demo(tmp_path, "--duration", "300", "--until-return", "0")
    try:
        deadline = time.time() + 150  # everything running: episodes committed, the trainer training
        while time.time() < deadline:
            lines = _jsonl(tmp_path / "metrics.jsonl")
            if lines and lines[-1]["episodes_committed"] > 0 and (lines[-1]["trainer_iteration"] or 0) >= 1:
                break
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.5)
        else:
            raise AssertionError("no episode committed and trained on within 150 s")
        children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(children) >= 5  # broker, consumer, trainer, 2 policies (+ Ray's processes)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-4000:]
    assert "stopping (SIGINT)" in out
    _assert_gone(children)
    desc = json.load(open(tmp_path / "demo.json"))
    assert desc["ended"] is not None and desc["killed"] == []
    summary = desc["summary"]
    assert len(_committed_versions(desc["shards_uri"])) == summary["episodes"] == summary["episodes_played"] > 0
    # the trainer finished its iteration and checkpointed on the way out
    last = _jsonl(tmp_path / "trainer" / "metrics.jsonl")[-1]
    latest = json.load(open(tmp_path / "trainer" / "checkpoints" / "latest.json"))
    assert latest["iteration"] == last["iteration"] >= 1
