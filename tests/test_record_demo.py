"""``rlrec record-demo``: CartPole through the recorder, Kafka and back."""

from __future__ import annotations

import gc
import re

import pytest

from rlrec.cli import main


@pytest.fixture(autouse=True)
def _collect_clients():
    """Free Kafka clients caught in reference cycles (create_topics' futures hold a traceback of
    its frame when the topic already exists): the session broker drains open connections for 5 s
    when it stops."""
    yield
    gc.collect()


def _counts(out: str, prefix: str) -> dict[str, float]:
    line = next(ln for ln in out.splitlines() if ln.startswith(prefix))
    return {k: float(v) for k, v in re.findall(r"(\w+)=([-\d.]+)", line)}


@pytest.mark.broker
def test_record_demo_embedded_broker(capsys, monkeypatch):
    monkeypatch.delenv("RLREC_BOOTSTRAP_SERVERS", raising=False)
    rc = main(["record-demo", "--episodes", "5"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "embedded broker: 127.0.0.1:" in out
    rec = _counts(out, "recorded:")
    got = _counts(out, "read back:")
    assert rec["episodes"] == 5 and rec["failed"] == 0 and rec["delivered"] == rec["messages"]
    assert got["episodes_started"] == 5
    assert got["steps"] == rec["steps"] > 5
    assert got["step_batches"] == rec["delivered"] - 5 >= 5  # one EpisodeStart per episode, the rest are batches
    assert got["aborts"] == 0 and got["reward_deltas"] == 0 and got["undecodable"] == 0
    assert got["mean_return"] == rec["mean_return"] == pytest.approx(rec["steps"] / 5)
    assert rec["mean_return"] > 100  # the scripted controller balances
    assert re.search(r"^OK: 5 episodes, \d+ steps read back as recorded$", out, re.M)


@pytest.mark.broker
def test_record_demo_external_broker_shared_topic(broker, topic, capsys):
    args = ["record-demo", "--episodes", "2", "--bootstrap-servers", broker.bootstrap_servers, "--topic", topic]
    assert main(args) == 0
    first = _counts(capsys.readouterr().out, "read back:")
    # a second run on the same topic counts only its own episodes
    assert main([*args, "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "embedded broker" not in out
    got = _counts(out, "read back:")
    assert got["episodes_started"] == 2 and got["aborts"] == 0
    assert got.get("other_messages", 0) <= first["step_batches"] + 2  # the first run's messages, skipped


@pytest.mark.broker
def test_record_demo_reports_mismatch(broker, topic, capsys, monkeypatch):
    import rlrec.producer.events as events

    real = events.decode

    def flaky(value, headers=None, **kw):
        ev = real(value, headers, **kw)
        if isinstance(ev, events.StepBatch) and ev.t0 == 0:
            raise events.DecodeError("malformed", "injected")
        return ev

    monkeypatch.setattr(events, "decode", flaky)
    rc = main(["record-demo", "--episodes", "2", "--bootstrap-servers", broker.bootstrap_servers, "--topic", topic])
    out = capsys.readouterr().out
    assert rc == 1
    assert "MISMATCH" in out and _counts(out, "read back:")["undecodable"] == 2


def test_record_demo_registered_and_light():
    from rlrec.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["record-demo"])
    opts = args.options.resolve(args, environ={})
    assert opts["episodes"] == 20 and opts["topic"] == "rlrec.demo"
    assert main(["record-demo", "--episodes", "0"]) == 2
