"""The trainer and the maintenance commands on GCS and Azure Blob (fake-gcs-server and Azurite on
127.0.0.1, plain gs:// and az:// URIs, settings from each cloud's standard environment): `rlrec
train` streams committed shards from the store and checkpoints and publishes there; `load_policy`
loads the signed policy from it; `inspect --verify`, `gc` and `report` work on it. The consumer
on these stores: tests/test_consumer_e2e.py and tests/test_consumer_faults.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from rlrec.cli import main
from rlrec.store.commit import ShardCommitter
from rlrec.store.manifest import read_manifest
from rlrec.store.storage import Storage
from rlrec.trainer.synthetic import expert_cartpole_episodes
from tests.stores import SERVER_FIXTURES, ObjectStore

pytestmark = [pytest.mark.system, pytest.mark.slow]


@pytest.mark.parametrize("kind", ["gcs", "azure"])
def test_train_publish_load_inspect_gc_and_report_on_the_cloud(kind, tmp_path, monkeypatch, request, capsys):
    import rlrec
    from rlrec import load_policy
    from rlrec.trainer.signing import generate_keys

    store = ObjectStore(kind, request.getfixturevalue(SERVER_FIXTURES[kind]))
    out = store.output(monkeypatch, "exp")  # this process's and the trainer's environment
    ck = out.rsplit("/", 1)[0] + "/run1"
    committer = ShardCommitter(out)
    for i in range(3):
        committer.commit(expert_cartpole_episodes(3, seed=i, max_steps=100))
    keys = {e.path for e in read_manifest(Storage.from_uri(out))}
    priv, pub = generate_keys(tmp_path / "keys")
    cmd = [sys.executable, "-m", "rlrec", "train", "--input", out, "--checkpoint-dir", ck, "--algo", "BC"]
    cmd += ["--promotion-gate", "off"]  # every checkpoint's policy published
    cmd += ["--env", "CartPole-v1", "--max-iterations", "3", "--checkpoint-interval", "3", "--num-cpus", "2"]
    cmd += ["--algo-config", "train_batch_size_per_learner=256", "--signing-key", str(priv)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]

    checkpoints = Storage.from_uri(ck)
    metrics = [json.loads(x) for x in checkpoints.read("metrics.jsonl").decode().splitlines() if x.strip()]
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    assert set().union(*(set(m.get("new_shards", ())) for m in metrics)) == keys  # every shard trained
    policy = load_policy(f"{ck}/policies", public_key=pub)
    assert policy.signed and policy.policy_version == 1
    action, extra = policy.act(np.zeros(4, np.float32))
    assert action in (0, 1) and np.isfinite(extra["action_logp"])
    lineage = json.loads(checkpoints.read(f"policies/{policy.spec['directory']}/lineage.json"))
    assert lineage["shards_trained"] == len(keys) and lineage["input"] == Storage.from_uri(out).uri()
    trained = rlrec.open(out, policy_version=1, policies=f"{ck}/policies", public_key=pub)  # reopened on the cloud
    assert {e.path for e in trained.entries} == keys

    assert main(["inspect", out, "--verify"]) == 0
    shards = Storage.from_uri(out)
    stray = "expert/_staging/abandoned.parquet"  # an upload no manifest entry names
    shards.write(stray, b"partial")
    time.sleep(2.5)
    capsys.readouterr()
    assert main(["gc", out, "--older-than", "2s"]) == 0
    assert stray in capsys.readouterr().out and not shards.exists(stray)
    assert all(shards.exists(k) for k in keys) and main(["inspect", out, "--verify"]) == 0
    html = tmp_path / "report.html"
    assert main(["report", "--input", out, "--checkpoint-dir", ck, "--out", str(html)]) == 0
    assert "no committed shards" not in html.read_text()
