"""Steps without a behaviour propensity (`action_logp`): counted per policy version in the shard
entries the committer writes, in `rlrec inspect`, and in the consumer's Prometheus counter. No
broker."""

from __future__ import annotations

import json

import pytest

from rlrec.consumer.metrics import MAX_PROPENSITY_SERIES, ConsumerMetrics
from rlrec.store.commit import ShardCommitter
from rlrec.store.finished import steps_without_logp
from rlrec.store.manifest import ManifestError, read_manifest
from rlrec.store.manifest_entries import parse_entry
from rlrec.trainer.synthetic import expert_cartpole_episodes


def _episodes():
    with_logp = expert_cartpole_episodes(3, seed=1, policy_version=2, max_steps=20)
    without_v2 = expert_cartpole_episodes(2, seed=2, policy_version=2, max_steps=20, with_logp=False)
    without_v10 = expert_cartpole_episodes(1, seed=3, policy_version=10, max_steps=20, with_logp=False)
    return with_logp, without_v2, without_v10


def test_committed_shard_entries_count_steps_without_logp_per_version(tmp_path, capsys):
    from rlrec.cli import main

    with_logp, without_v2, without_v10 = _episodes()
    assert all("action_logp" in fe.extra_model_outputs for fe in with_logp)
    assert all("action_logp" not in fe.extra_model_outputs for fe in without_v2 + without_v10)
    want2 = sum(fe.length for fe in without_v2)
    want10 = sum(fe.length for fe in without_v10)
    assert steps_without_logp(with_logp + without_v2 + without_v10) == {"2": want2, "10": want10}

    out = tmp_path / "out"
    c = ShardCommitter(str(out))
    c.commit(with_logp + without_v2 + without_v10)
    (entry,) = read_manifest(c.storage)
    assert entry.steps_without_logp == {"2": want2, "10": want10}
    assert parse_entry(entry.to_json()) == entry  # survives the JSON round trip

    assert main(["inspect", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps_without_logp"] == {
        "by_policy": {"expert": {"2": want2, "10": want10}},  # numeric version order
        "unknown": {"shards": 0, "steps": 0},
    }
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "steps without a propensity" in text and f"{want10:,}" in text


def test_entries_without_the_count_are_unknown_and_bad_counts_are_refused(tmp_path):
    from rlrec.store.maintenance import propensity_counts

    c = ShardCommitter(str(tmp_path / "out"))
    c.commit(_episodes()[0])
    (entry,) = read_manifest(c.storage)
    d = json.loads(entry.to_json())
    del d["steps_without_logp"]  # an entry written before the count existed
    old = parse_entry(d)
    assert old.steps_without_logp is None and "steps_without_logp" not in json.loads(old.to_json())
    assert propensity_counts([old, entry])["unknown"] == {"shards": 1, "steps": entry.steps}
    for bad in ({"2": -1}, {"2": 1.5}, {"2": True}, [1], "x"):
        with pytest.raises(ManifestError, match="steps_without_logp"):
            parse_entry({**d, "steps_without_logp": bad})


def test_consumer_counter_per_policy_version_with_bounded_series():
    m = ConsumerMetrics()
    with_logp, without_v2, without_v10 = _episodes()
    result = type("R", (), {"shards": 1, "episodes": 6, "steps": 0, "bytes": 0})()
    m.on_commit(result, 0.1, with_logp + without_v2 + without_v10)

    def value(pid: str, version: str) -> float | None:
        return m.registry.get_sample_value(
            "rlrec_steps_without_propensity_total", {"policy_id": pid, "policy_version": version}
        )

    assert value("expert", "2") == sum(fe.length for fe in without_v2)
    assert value("expert", "10") == sum(fe.length for fe in without_v10)
    for v in range(100, 100 + MAX_PROPENSITY_SERIES):
        m.count_without_propensity("p", v, 1)
    assert value("expert", "2") is None and value("expert", "10") is None  # the oldest series went
    assert value("p", "100") == 1.0 and value("p", str(99 + MAX_PROPENSITY_SERIES)) == 1.0
    m.count_without_propensity("p", 100, 2)  # counted again: the most recent now
    m.count_without_propensity("q", 1, 1)
    assert value("p", "100") == 3.0 and value("p", "101") is None
