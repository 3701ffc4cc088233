"""`rlrec demo --canary-share`: the simulated services opt in to the trainer's canary and the
dashboard shows both arms and the decision.

* a demo policy process (`rlrec.demo.policy_process --canary-fraction f`) against a real broker
  and publish root (``latest.json`` v1, ``canary.json`` v2): each episode runs and logs the
  version `Policy.for_episode` chose by the salted hash, with its assignment in the reset info,
  and the trainer's evidence reader (`CanaryEvidence`, over the real consumer's shards) counts
  both arms;
* the dashboard follows the trainer's ``canary_look`` and ``canary`` lines;
* the demo passes the canary options to the trainer and the share to the policy processes.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from rlrec.demo.dashboard import Collector, Dashboard, canary_text
from rlrec.demo.run import DemoConfig, canary_trainer_args
from rlrec.store.storage import Storage
from rlrec.trainer.canary import in_canary
from rlrec.trainer.canary_evidence import CanaryEvidence
from rlrec.trainer.canary_publish import read_pointer
from rlrec.trainer.signing import generate_keys, load_private_key
from tests.helpers import wait_for
from tests.test_canary import canary
from tests.test_consumer_e2e import committed_episodes, read_all, run_consumer
from tests.test_policy_binding import publish


@pytest.mark.broker
def test_a_demo_policy_process_serves_and_logs_both_arms(broker, topic, tmp_path, recorder_config):
    priv, pub = generate_keys(tmp_path / "keys")
    key = load_private_key(priv)
    root = tmp_path / "policies"
    publish(root, 1, key)
    started = time.time() - 1.0
    canary(root, 2, key, base=1, started=started)
    sha = read_pointer(Storage.from_uri(str(root)), "canary.json")["sha256"]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlrec.demo.policy_process",
            *("--bootstrap-servers", broker.bootstrap_servers, "--topic", topic, "--policies", str(root)),
            *("--public-key", str(pub), "--channel", "prod", "--canary-fraction", "0.3", "--poll-s", "0.2"),
            *("--steps-per-s", "4000", "--policy-epsilon", "0.0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    status = {}
    try:
        deadline = time.time() + 90
        for line in proc.stdout:
            if line.startswith("{"):
                status = json.loads(line)
                if status["episodes"] >= 60:
                    break
            assert time.time() < deadline, f"too few episodes: {status}"
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
    final = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    assert final["final"] and final["policy_version"] == 1 and final["canary_version"] == 2
    assert 0 < final["canary_episodes"] < final["episodes"]
    out_dir = str(tmp_path / "out")
    storage = Storage.from_uri(out_dir)
    c, t = run_consumer(recorder_config(out_dir), storage)
    try:
        wait_for(lambda: committed_episodes(storage) >= final["episodes"], 60, what="every episode committed")
    finally:
        c.stop()
        t.join(30)
    got = read_all(storage)
    versions = {eid: int(ep.custom_data["policy_version"]) for eid, (ep, _e) in got.items()}
    played = [eid for eid, v in versions.items() if v in (1, 2)]
    assert len(played) >= final["episodes"] - 1  # the episodes before the first poll run version 0
    assert all((versions[eid] == 2) == in_canary(eid, 0.3) for eid in played)  # the salted hash chose
    assert {1, 2} <= set(versions.values())
    ev = CanaryEvidence(out_dir, version=2, base_version=1, started=started, gamma=0.99, share=0.3, sha256=sha)
    arm_c, arm_d = ev.refresh()
    assert arm_c.n > 0 and arm_d.n > 0 and ev.unassigned == 0  # both arms are the test's evidence
    assert arm_c.n == sum(1 for v in versions.values() if v == 2)


def test_the_dashboard_shows_both_arms_the_bound_and_the_decision(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    look = {"time": 5.0, "n_canary": 31, "n_deployed": 52, "mean_canary": 80.5, "mean_deployed": 30.0}
    lines = [
        {"iteration": 4, "policy_version": 1, "canary_version": 2, "deployed_version": 1, "canary_look": {**look}},
    ]
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    serving = {"index": 0, "policy_version": 1, "canary_version": 2, "steps": 900, "episodes": 9, "return_mean": 99.0}
    col = Collector([SimpleNamespace(status=serving)], None, str(metrics))
    s = col.snapshot()
    assert s.policy_versions_in_use == [1, 2] and s.policy_version == 1  # a canary is in use, not deployed
    assert canary_text(s.canary) == "v2 80.5 (31 ep) vs v1 30.0 (52 ep), bound [-, -]: testing"
    decided = {
        "canary_version": 2,
        "base_version": 1,
        "decision": "promote",
        "episodes_canary": 60,
        "episodes_deployed": 100,
        "mean_canary": 81.0,
        "mean_deployed": 31.0,
        "low": 12.25,
        "high": 88.0,
        "deployed_version": 2,
    }
    with open(metrics, "a") as f:
        f.write(json.dumps({"iteration": 5, "policy_version": 2, "canary": decided}) + "\n")
    s = col.snapshot()
    assert canary_text(s.canary) == "v2 81.0 (60 ep) vs v1 31.0 (100 ep), bound [12.2, 88.0]: promoted, v2 deployed"
    assert s.to_record()["canary"]["decision"] == "promote"
    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(Dashboard("demo", live=False)._table(s))
    shown = console.export_text()
    assert "canary (discounted returns)" in shown and "promoted, v2 deployed" in shown
    assert "v1 + canary v2  9 episodes" in shown


def test_the_demo_opts_in_with_a_canary_share():
    args = canary_trainer_args(0.3)
    assert args[:4] == ["--rollout", "canary", "--canary-share", "0.3"]
    assert canary_trainer_args(0.0) == []
    # the processes get str(share): the trainer's share is the same number, not rounded above it
    assert float(canary_trainer_args(0.1234567)[3]) == 0.1234567
    assert DemoConfig(canary_share=0.3).canary_share == 0.3
    with pytest.raises(ValueError, match="--canary-share must be in"):
        DemoConfig(canary_share=0.6)
    with pytest.raises(ValueError, match="needs the promotion gate"):
        DemoConfig(canary_share=0.3, promotion_gate=False)


def test_until_return_counts_a_version_served_on_canary_as_in_use(tmp_path):
    """With --canary-share a version that passed the gate is served on canary, not deployed, until
    its live test promotes it: the demo ended rc=1 "the evaluation return did not reach 400" while
    its summary said v1 (evaluated 500) was published. Served on canary, it is in use."""
    import time
    from types import SimpleNamespace

    from rlrec.demo.run import Demo

    demo = Demo(DemoConfig(canary_share=0.3, until_return=400, settle_s=0, data_dir=str(tmp_path / "d")))
    demo.collector = SimpleNamespace(
        trainer=SimpleNamespace(deployed_return=500.0, eval_return=500.0, published_version=1)
    )
    t0 = time.time()
    assert not demo._target(SimpleNamespace(policy_version=None, policy_versions_in_use=[]), t0)
    assert demo._target(SimpleNamespace(policy_version=None, policy_versions_in_use=[1]), t0)
    assert demo.outcome["target_on_canary"] is True
    plain = Demo(DemoConfig(until_return=400, settle_s=0, data_dir=str(tmp_path / "p")))
    plain.collector = demo.collector
    assert not plain._target(SimpleNamespace(policy_version=None, policy_versions_in_use=[1]), t0)
