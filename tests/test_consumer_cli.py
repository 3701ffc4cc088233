"""`rlrec consume`: option resolution, --help, metrics/healthz, tabular output, JSON logs."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid

import numpy as np
import pytest

from rlrec.cli import build_parser
from rlrec.commands.consume import OPTIONS, resolve_options
from rlrec.local import FAST_GROUP_KAFKA
from rlrec.options import OptionError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(*argv: str):
    return build_parser().parse_args(["consume", *argv])


def dest(flag: str) -> str:
    return flag.replace("-", "_")


# -- resolve_options: command line > RLREC_* env > config file > defaults ----------------------


def test_defaults_when_nothing_is_given():
    opts = resolve_options(parse(), environ={})
    for opt in OPTIONS.options.values():
        assert opts[opt.name] == (None if opt.required else opt.default), opt.name
    assert opts["kafka_config"] == {}
    assert opts["create_topics"] is True
    assert opts["processes"] == 1 and opts["log_level"] == "INFO"


@pytest.mark.parametrize("kind", ["json", "toml"])
def test_config_file_overrides_defaults(kind, tmp_path):
    if kind == "json":
        path = tmp_path / "consume.json"
        path.write_text(
            json.dumps(
                {
                    "bootstrap-servers": "file:9092",
                    "topic": "file-topic",
                    "max_file_age_s": 7,
                    "partitions": 3,
                    "format": "tabular",
                    "kafka_config": {"client.id": "from-file", "acks": "all"},
                }
            )
        )
    else:
        path = tmp_path / "consume.toml"
        path.write_text(
            'bootstrap-servers = "file:9092"\ntopic = "file-topic"\nmax_file_age_s = 7\n'
            'partitions = 3\nformat = "tabular"\n'
            '[kafka_config]\n"client.id" = "from-file"\nacks = "all"\n'
        )
    opts = resolve_options(parse("--config", str(path)), environ={})
    assert opts["bootstrap_servers"] == "file:9092"
    assert opts["topic"] == "file-topic"
    assert opts["max_file_age_s"] == 7.0 and isinstance(opts["max_file_age_s"], float)
    assert opts["partitions"] == 3
    assert opts["format"] == "tabular"
    assert opts["kafka_config"] == {"client.id": "from-file", "acks": "all"}
    assert opts["group_id"] is None  # not in the file: the default (derived from the output)
    assert opts["create_topics"] is True


def test_environment_overrides_config_file_and_is_typed(tmp_path):
    path = tmp_path / "consume.json"
    path.write_text(json.dumps({"topic": "file-topic", "max-file-age-s": 7, "group-id": "file-group"}))
    env = {
        "RLREC_TOPIC": "env-topic",
        "RLREC_MAX_FILE_AGE_S": "2.5",
        "RLREC_PARTITIONS": "5",
        "RLREC_METRICS_PORT": "0",
        "UNRELATED": "x",
    }
    opts = resolve_options(parse("--config", str(path)), environ=env)
    assert opts["topic"] == "env-topic"
    assert opts["max_file_age_s"] == 2.5
    assert opts["partitions"] == 5
    assert opts["metrics_port"] == 0
    assert opts["group_id"] == "file-group"  # only in the file


def test_command_line_overrides_environment_and_file(tmp_path):
    path = tmp_path / "consume.toml"
    path.write_text('topic = "file-topic"\nmax-file-age-s = 7.0\ncompression = "snappy"\n')
    env = {"RLREC_TOPIC": "env-topic", "RLREC_MAX_FILE_AGE_S": "2.5"}
    opts = resolve_options(parse("--config", str(path), "--topic", "cli-topic", "--max-file-age-s", "0.5"), environ=env)
    assert opts["topic"] == "cli-topic"
    assert opts["max_file_age_s"] == 0.5
    assert opts["compression"] == "snappy"  # the file still fills what nobody else set


def test_kafka_config_pairs_merge_over_the_file(tmp_path):
    path = tmp_path / "consume.json"
    path.write_text(json.dumps({"kafka-config": {"client.id": "from-file", "acks": "all"}}))
    opts = resolve_options(
        parse(
            "--config",
            str(path),
            "--kafka-config",
            "security.protocol=SASL_SSL",
            "--kafka-config",
            "sasl.password=a=b=c",
            "--kafka-config",
            "client.id=cli",
        ),
        environ={},
    )
    assert opts["kafka_config"] == {
        "client.id": "cli",
        "acks": "all",
        "security.protocol": "SASL_SSL",
        "sasl.password": "a=b=c",
    }  # split at the first '=' only


def test_kafka_config_without_equals_is_an_error():
    with pytest.raises(OptionError, match="KEY=VALUE"):
        resolve_options(parse("--kafka-config", "security.protocol"), environ={})


def test_no_create_topics_from_every_source(tmp_path):
    assert resolve_options(parse("--no-create-topics"), environ={})["create_topics"] is False
    assert resolve_options(parse(), environ={"RLREC_NO_CREATE_TOPICS": "1"})["create_topics"] is False
    assert resolve_options(parse(), environ={"RLREC_NO_CREATE_TOPICS": "true"})["create_topics"] is False
    assert resolve_options(parse(), environ={"RLREC_NO_CREATE_TOPICS": "0"})["create_topics"] is True
    path = tmp_path / "consume.toml"
    path.write_text("no_create_topics = true\n")
    assert resolve_options(parse("--config", str(path)), environ={})["create_topics"] is False
    path.write_text("create-topics = false\n")
    assert resolve_options(parse("--config", str(path)), environ={})["create_topics"] is False
    # the command line wins over the file both ways
    assert resolve_options(parse("--config", str(path), "--create-topics"), environ={})["create_topics"] is True


def _run_cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLREC_")} | {"COLUMNS": "200"} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "rlrec", *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )


def test_help_lists_every_option_with_its_default_and_choices():
    out = _run_cli("consume", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    flags = set(re.findall(r"--[a-z0-9-]+", text))
    for opt in OPTIONS.options.values():
        assert opt.flag in flags, opt.flag
        assert opt.env in text, opt.env
        if opt.shown_default() is not None:
            assert f"default: {opt.shown_default()}" in text, opt.flag
    assert "{zstd,snappy,gzip,lz4,none}" in text and "{strict,shape,off}" in text
    assert "--no-create-topics" in text and "--no-allow-unfenced-storage" in text


@pytest.mark.parametrize(
    ("contents", "says"),
    [
        ("max_file_age = 2\n", "unknown option 'max_file_age' in {path} (did you mean 'max_file_age_s'?)"),
        ("max-file-age = 2\n", "unknown option 'max-file-age' in {path} (did you mean 'max-file-age-s'?)"),
        ('partitions = "many"\n', "'partitions' in {path}: invalid int value: 'many'"),
        (
            'compression = "brotli"\n',
            "'compression' in {path}: invalid choice: 'brotli' (choose from zstd, snappy, gzip, lz4, none)",
        ),
    ],
)
def test_a_bad_config_file_is_one_line_and_exit_2(tmp_path, contents, says):
    path = tmp_path / "consume.toml"
    path.write_text(contents)
    r = _run_cli("consume", "--bootstrap-servers", "b:1", "--output", str(tmp_path / "o"), "--config", str(path))
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [f"rlrec consume: error: {says.format(path=path)}"]


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--partitions", "x"], {}, "--partitions: invalid int value: 'x'"),
        (["--on-timeout", "drop"], {}, "--on-timeout: invalid choice: 'drop' (choose from truncate, dead-letter)"),
        ([], {"RLREC_MAX_FILE_AGE_S": "soon"}, "RLREC_MAX_FILE_AGE_S: invalid float value: 'soon'"),
        ([], {"RLREC_MAX_FILE_AGE": "2"}, "unknown option 'RLREC_MAX_FILE_AGE' in the environment (did you mean "),
        (["--output", ""], {}, "--output is required (or RLREC_OUTPUT, or 'output' in the --config file)"),
        (["--group-id", "g" * 256], {}, "--group-id must be 1-255 printable characters (no tab or newline)"),
        (["--deployment", "blue\tgreen"], {}, "--deployment must be 1-255 printable characters"),
        ([], {"RLREC_GROUP_ID": "a\nb"}, "--group-id must be 1-255 printable characters"),
    ],
)
def test_a_bad_value_is_one_line_and_exit_2(tmp_path, argv, env, says):
    r = _run_cli("consume", "--bootstrap-servers", "b:1", "--output", str(tmp_path / "o"), *argv, env=env)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(f"rlrec consume: error: {says}"), r.stderr


def test_another_commands_environment_variables_are_ignored():
    # RLREC_ALGO is an option of `rlrec train`: one environment may serve both commands
    opts = resolve_options(parse(), environ={"RLREC_ALGO": "CQL", "RLREC_TEST_BROKER": "x", "RLREC_OUTPUT": "/o"})
    assert opts["output"] == "/o" and "algo" not in opts


# -- JSON logs ----------------------------------------------------------------------------------


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_log_format_json_writes_json_lines(monkeypatch, tmp_path, capsys, restore_root_logger):
    """`rlrec consume --log-format json` goes through setup_logging: every log line is a JSON object."""
    import rlrec.consumer.service
    import rlrec.consumer.topics
    from rlrec.cli import main

    seen = {}

    class FakeConsumer:  # the service itself needs a broker; the logging set-up does not
        def __init__(self, config):
            seen["config"] = config

        def stop(self, *_):
            pass

        def run(self, max_seconds=None, install_signals=True):
            log = logging.getLogger("rlrec.consumer")
            log.info("partition %d: claimed epoch %d", 3, 1)
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                log.exception("flush failed")

    monkeypatch.setattr(rlrec.consumer.service, "RecorderConsumer", FakeConsumer)
    monkeypatch.setattr(rlrec.consumer.topics, "check_reachable", lambda *a, **k: None)  # no broker here
    rc = main(
        [
            "consume",
            "--bootstrap-servers",
            "127.0.0.1:1",
            "--output",
            str(tmp_path / "out"),
            "--log-format",
            "json",
            "--log-level",
            "debug",
        ]
    )
    assert rc == 0
    assert seen["config"].bootstrap_servers == "127.0.0.1:1"
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line parses
    assert records[0]["msg"] == "partition 3: claimed epoch 1"
    assert records[0]["level"] == "INFO" and records[0]["logger"] == "rlrec.consumer"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", records[0]["ts"])
    assert records[1]["level"] == "ERROR" and "RuntimeError: boom" in records[1]["exc"]


def test_setup_logging_json_and_text(capsys, restore_root_logger):
    from rlrec.logs import setup_logging

    setup_logging("json", "INFO")
    logging.getLogger("rlrec.consumer").debug("hidden")
    logging.getLogger("rlrec.consumer").warning("lag %s", 12)
    (line,) = capsys.readouterr().err.splitlines()
    assert json.loads(line)["msg"] == "lag 12"
    setup_logging("text", "INFO")
    logging.getLogger("rlrec.consumer").warning("lag %s", 13)
    err = capsys.readouterr().err
    assert "WARNING rlrec.consumer: lag 13" in err
    with pytest.raises(json.JSONDecodeError):
        json.loads(err)
    # a child of `rlrec consume --processes N` tags its lines
    setup_logging("json", "INFO", worker=1)
    logging.getLogger("rlrec.consumer").warning("lag %s", 14)
    (line,) = capsys.readouterr().err.splitlines()
    assert json.loads(line)["worker"] == 1 and json.loads(line)["msg"] == "lag 14"
    setup_logging("text", "INFO", worker=0)
    logging.getLogger("rlrec.consumer").warning("lag %s", 15)
    assert "WARNING [worker 0] rlrec.consumer: lag 15" in capsys.readouterr().err


# -- with a broker ------------------------------------------------------------------------------


def _run_consumer(cfg):
    from rlrec.consumer.service import RecorderConsumer

    c = RecorderConsumer(cfg)
    t = threading.Thread(target=c.run, kwargs={"install_signals": False}, daemon=True)
    t.start()
    return c, t


def _recorder(broker, topic):
    from rlrec.producer import EpisodeRecorder
    from tests.helpers import ACT_SPACE, OBS_SPACE

    return EpisodeRecorder(
        broker.bootstrap_servers,
        topic=topic,
        policy_id="pol",
        observation_space=OBS_SPACE,
        action_space=ACT_SPACE,
        env_id="synthetic",
    )


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _committed_metric(port: int) -> float:
    status, text = _get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    m = re.search(r"^rlrec_episodes_committed_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.broker
def test_metrics_and_healthz_are_served(broker, topic, tmp_path):
    from rlrec.consumer.service import ConsumerConfig
    from tests.helpers import record_episodes, wait_for

    cfg = ConsumerConfig(
        bootstrap_servers=broker.bootstrap_servers,
        output=str(tmp_path / "out"),
        topic=topic,
        group_id=f"g-{uuid.uuid4().hex[:6]}",
        max_file_age_s=0.3,
        commit_interval_s=0.3,
        metrics_port=0,
        kafka_config=FAST_GROUP_KAFKA,
        create_topics=False,
    )
    c, t = _run_consumer(cfg)
    rec = _recorder(broker, topic)
    try:
        port = wait_for(lambda: c.metrics_port, 60, 0.05, what="the metrics server")
        assert port > 0
        status, body = _get(f"http://127.0.0.1:{port}/healthz")
        assert (status, body) == (200, "ok\n")
        assert _committed_metric(port) == 0
        record_episodes(rec, 6, seed=11)
        assert rec.flush(10) == 0
        wait_for(lambda: _committed_metric(port) >= 6, 30, what="rlrec_episodes_committed >= 6 on /metrics")
        status, text = _get(f"http://127.0.0.1:{port}/metrics")
        assert re.search(r"^rlrec_steps_committed_total [1-9]", text, re.M)
        assert re.search(r"^rlrec_assigned_partitions 4\.0$", text, re.M)
        assert _get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    finally:
        c.stop()
        t.join(30)
        rec.close()
    assert not t.is_alive()


@pytest.mark.broker
def test_tabular_format_end_to_end(broker, topic, tmp_path):
    import pandas as pd

    from rlrec.consumer.service import ConsumerConfig
    from rlrec.store.manifest import read_manifest
    from rlrec.store.storage import Storage
    from tests.helpers import record_episodes, wait_for

    output = str(tmp_path / "out")
    storage = Storage.from_uri(output)
    rec = _recorder(broker, topic)
    truth = record_episodes(rec, 12, seed=5, delayed_every=4)
    assert rec.flush(10) == 0
    rec.close()
    cfg = ConsumerConfig(
        bootstrap_servers=broker.bootstrap_servers,
        output=output,
        topic=topic,
        format="tabular",
        group_id=f"g-{uuid.uuid4().hex[:6]}",
        max_file_age_s=0.3,
        commit_interval_s=0.3,
        kafka_config=FAST_GROUP_KAFKA,
        create_topics=False,
    )
    c, t = _run_consumer(cfg)
    try:
        wait_for(
            lambda: sum(e.episodes for e in read_manifest(storage)) >= len(truth), 30, what="all episodes committed"
        )
    finally:
        c.stop()
        t.join(30)
    entries = read_manifest(storage)
    assert {e.format for e in entries} == {"tabular"}
    df = pd.concat([pd.read_parquet(io.BytesIO(storage.read(e.path))) for e in entries], ignore_index=True)
    assert {"eps_id", "obs", "actions", "rewards", "new_obs", "terminateds", "truncateds", "t"} <= set(df.columns)
    assert len(df) == sum(len(ep.actions) for ep in truth.values())  # one row per step
    assert set(df["eps_id"]) == set(truth)
    for eid, rows in df.groupby("eps_id"):
        ep = truth[eid]
        rows = rows.sort_values("t")
        assert list(rows["t"]) == list(range(len(ep.actions)))
        obs = np.stack(rows["obs"].to_numpy())
        assert obs.shape == (len(ep.actions), 4) and np.issubdtype(obs.dtype, np.floating)
        np.testing.assert_array_equal(obs, np.stack(ep.observations[:-1]))
        np.testing.assert_array_equal(np.stack(rows["new_obs"].to_numpy()), np.stack(ep.observations[1:]))
        np.testing.assert_array_equal(rows["actions"].to_numpy(), np.asarray(ep.actions))
        np.testing.assert_allclose(rows["rewards"].to_numpy(), np.asarray(ep.rewards), atol=1e-12)
        assert bool(rows["terminateds"].iloc[-1]) == ep.terminated
        assert bool(rows["truncateds"].iloc[-1]) == ep.truncated
        assert not rows["terminateds"].iloc[:-1].any() and not rows["truncateds"].iloc[:-1].any()
