"""The error contract of every command (rlrec.errors): a user mistake or an unreachable
dependency ends with one line ``rlrec <command>: error: ...``, exit code 2 (usage,
configuration) or 1 (runtime), no traceback unless ``--debug``, within the user's timeout.

Commands that talk to Kafka run as subprocesses: librdkafka writes to the process's stderr
itself unless its lines are routed through our logging, which is part of what is checked.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlrec.cli import main

UNREACHABLE = "127.0.0.1:1"


def _rlrec(*args: str, timeout: float = 60, cwd: Path | None = None) -> tuple[int, str, str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLREC_")}
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "rlrec", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def _one_error_line(err: str, command: str) -> str:
    """The error line of `err` (stderr), checked: no traceback, exactly one error line, last."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(f"rlrec {command}: error: ")]
    assert len(errors) == 1, err
    assert lines[-1] == errors[0], err
    return errors[0]


# -- inspect ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "code", "text"),
    [
        ("foo://bar", 2, "cannot open 'foo://bar'"),
        ("", 2, "URI is empty"),
        ("/nonexistent", 1, "no rlrec manifest at /nonexistent: it does not exist"),
    ],
)
@pytest.mark.parametrize("verify", [False, True])
def test_inspect_bad_uri_is_one_line(capsys, uri, code, text, verify):
    assert main(["inspect", uri, *(["--verify"] if verify else [])]) == code
    line = _one_error_line(capsys.readouterr().err, "inspect")
    assert text in line


def _committed_output(root: Path, episodes: int = 3) -> Path:
    from rlrec.store.commit import ShardCommitter
    from rlrec.trainer.synthetic import expert_cartpole_episodes

    ShardCommitter(str(root)).commit(expert_cartpole_episodes(episodes, max_steps=30))
    return root


def test_inspect_verify_missing_bucket_fails(local_s3, monkeypatch, capsys):
    for k, v in local_s3.env().items():
        monkeypatch.setenv(k, v)
    assert main(["inspect", "s3://rlrec-missing-bucket/x", "--verify"]) == 1
    line = _one_error_line(capsys.readouterr().err, "inspect")
    assert "no rlrec manifest at s3://rlrec-missing-bucket/x: it does not exist" in line


def test_inspect_one_level_too_high_names_the_child(tmp_path, capsys):
    _committed_output(tmp_path / "shards")
    assert main(["inspect", str(tmp_path), "--verify"]) == 1
    line = _one_error_line(capsys.readouterr().err, "inspect")
    assert line == f"rlrec inspect: error: no rlrec manifest at {tmp_path} (did you mean {tmp_path}/shards?)"


def test_inspect_verify_says_what_it_verified_in_80_columns(tmp_path, capsys, monkeypatch):
    out = _committed_output(tmp_path / "out", episodes=4)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["inspect", str(out), "--verify"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= 80, text
    assert any(ln.startswith("verify: no problems in 1 shard, 4 episodes, 120 steps, ") for ln in lines), text
    row = [ln for ln in lines if re.match(r"^\s*expert\s+0\s+\d+-\d+\s+4\s+120\s", ln)]
    assert len(row) == 1, text  # one shard, one line
    assert main(["inspect", str(out), "--verify", "--json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"]["episodes"] == 4 and doc["problems"] == []


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["topics", "create", "--bootstrap-servers", "x", "--partitions"], "topics create"),
        (["consume", "--processes"], "consume"),
        (["nosuch"], ""),
    ],
)
def test_argparse_errors_are_one_line(capsys, argv, command):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    prog = f"rlrec {command}".strip()
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: ") and err.rstrip().endswith("--help)"), err


def test_debug_shows_the_traceback(capsys):
    assert main(["--debug", "inspect", "foo://bar"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert err.strip().splitlines()[-1].startswith("rlrec inspect: error: ")
    assert main(["inspect", "foo://bar", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_unexpected_exception_is_one_line_with_a_hint(capsys, monkeypatch):
    import rlrec.commands.inspect as cmd

    def boom(*_a, **_k):
        raise KeyError("surprise")

    monkeypatch.setattr(cmd, "open_output", boom)
    assert main(["inspect", "x"]) == 1
    line = _one_error_line(capsys.readouterr().err, "inspect")
    assert line == "rlrec inspect: error: KeyError: 'surprise' (rerun with rlrec --debug for the traceback)"


# -- train: inputs checked before Ray starts ---------------------------------------------------


def test_train_unknown_env_uses_gymnasiums_did_you_mean(tmp_path, capsys):
    rc = main(["train", "--input", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ck"), "--env", "CartPol-v1"])
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err, "train")
    assert "--env 'CartPol-v1'" in line and "Did you mean: `CartPole`?" in line


def test_train_unknown_algo_config_key_before_ray(tmp_path, capsys):
    t0 = time.monotonic()
    rc = main(
        [
            "train",
            "--input",
            str(tmp_path),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--algo-config",
            "learning_rate=0.1",
        ]
    )
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err, "train")
    assert "'learning_rate' is no setting of RLlib's BCConfig (did you mean 'lr'?)" in line
    assert time.monotonic() - t0 < 20
    import ray

    assert not ray.is_initialized()


@pytest.mark.parametrize("extra", [[], ["--multi-agent"], ["--prelearner-mode", "buffer"]])
def test_train_buffer_class_given_as_a_name_is_one_line_before_ray(tmp_path, capsys, extra):
    """RLlib's own validation raised a TypeError traceback from issubclass() on a string, in
    either mode; nothing is imported from the name."""
    argv = ["train", "--input", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ck"), "--promotion-gate", "off"]
    argv += ["--offline-config", "prelearner_buffer_class=ray.rllib.utils.replay_buffers:EpisodeReplayBuffer", *extra]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err, "train")
    assert (
        "--offline-config prelearner_buffer_class: 'ray.rllib.utils.replay_buffers:EpisodeReplayBuffer' is not a class"
        in line
    )
    import ray

    assert not ray.is_initialized()


@pytest.mark.parametrize(
    "flag,value", [("--promotion-episodes", "0"), ("--eval-episodes", "-3"), ("--promotion-episodes", "100001")]
)
def test_train_evaluation_episode_counts_out_of_range_are_one_line(tmp_path, capsys, flag, value):
    argv = ["train", "--input", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ck"), flag, value]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err, "train")
    assert f"{flag} must be between 1 and 100,000, got {value}" in line


@pytest.mark.parametrize("algo", ["BC", "MARWIL", "CQL", "IQL"])
def test_train_accepts_every_training_setting(tmp_path, algo):
    from rlrec.trainer.config import TrainerConfig

    cfg = TrainerConfig(
        input=str(tmp_path),
        checkpoint_dir=str(tmp_path / "ck"),
        algo=algo,
        env="CartPole-v1",
        algo_config={"lr": 1e-3, "train_batch_size_per_learner": 512, "gamma": 0.99},
    )
    cfg.check_inputs()  # nothing raised


def test_train_bad_input_uri(tmp_path, capsys):
    assert main(["train", "--input", "foo://bar", "--checkpoint-dir", str(tmp_path)]) == 2
    assert "--input: cannot open 'foo://bar'" in _one_error_line(capsys.readouterr().err, "train")


# -- consume and topics: configuration and an unreachable broker --------------------------------


def test_consume_missing_config_file(capsys):
    assert main(["consume", "--config", "/tmp/rlrec-nope.toml"]) == 2
    line = _one_error_line(capsys.readouterr().err, "consume")
    assert "cannot read config file /tmp/rlrec-nope.toml" in line


def test_consume_bad_output_uri(capsys):
    assert main(["consume", "--bootstrap-servers", UNREACHABLE, "--output", "foo://bar"]) == 2
    assert "--output: cannot open" in _one_error_line(capsys.readouterr().err, "consume")


def test_consume_misspelt_kafka_config_key(tmp_path):
    rc, _, err, _ = _rlrec(
        "consume",
        "--bootstrap-servers",
        UNREACHABLE,
        "--output",
        str(tmp_path),
        "--kafka-config",
        "sesion.timeout.ms=6000",
    )
    assert rc == 2, err
    line = _one_error_line(err, "consume")
    assert 'No such configuration property: "sesion.timeout.ms"' in line


@pytest.mark.slow
@pytest.mark.parametrize("create", [True, False])
def test_consume_unreachable_broker_ends_in_time(tmp_path, create):
    args = ["consume", "--bootstrap-servers", UNREACHABLE, "--output", str(tmp_path), "--max-seconds", "3"]
    rc, _, err, took = _rlrec(*args, *([] if create else ["--no-create-topics"]))
    assert rc == 1, err
    line = _one_error_line(err, "consume")
    assert f"cannot reach Kafka at {UNREACHABLE} within 3 s" in line and "check --bootstrap-servers" in line
    assert len(err.splitlines()) <= 8, err  # librdkafka's retries: a few lines at most, not hundreds
    assert took < 30


@pytest.mark.parametrize("action", ["create", "list"])
def test_topics_unreachable_broker(action):
    args = ["topics", action, "--bootstrap-servers", UNREACHABLE, "--timeout", "2"]
    if action == "create":
        args += ["--topic", "t", "--partitions", "1"]
    rc, _, err, took = _rlrec(*args)
    assert rc == 1, err
    line = _one_error_line(err, f"topics {action}")
    assert f"cannot reach Kafka at {UNREACHABLE} within 2 s" in line
    assert len(err.splitlines()) <= 4, err
    assert took < 15


def test_topics_misspelt_kafka_config_key(capsys):
    args = ["topics", "list", "--bootstrap-servers", UNREACHABLE, "--kafka-config", "sasl.mechanismz=PLAIN"]
    assert main(args) == 2
    line = _one_error_line(capsys.readouterr().err, "topics list")
    assert 'No such configuration property: "sasl.mechanismz"' in line


# -- librdkafka's own lines ---------------------------------------------------------------------


def test_librdkafka_lines_are_deduplicated(caplog):
    from rlrec.consumer.topics import kafka_logger

    logger = kafka_logger()
    assert logger.level == logging.WARNING
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        for i in range(50):
            logger.warning("FAIL [rdkafka#consumer-%d] 127.0.0.1:1/bootstrap: Connect failed (after %dms)", i, i)
        logger.warning("another line")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages


# -- consume says what it committed -------------------------------------------------------------


def test_consumer_summary_counts_what_was_committed(tmp_path):
    from rlrec.consumer.service import ConsumerConfig, RecorderConsumer

    c = RecorderConsumer(ConsumerConfig(bootstrap_servers=UNREACHABLE, output=str(tmp_path)))
    m = c.metrics
    m.episodes_committed.inc(1200)
    m.steps_committed.inc(43100)
    m.shards_committed.inc(3)
    m.bytes_committed.inc(3 * 2**20)
    m.dead_letters.labels(reason="oversize").inc(2)
    assert c.summary() == "committed 1,200 episodes (43,100 steps) in 3 shards (3.0 MiB); 2 dead letters"


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.parametrize("exists", [True, False])
def test_consume_logs_its_summary_on_shutdown(broker, topic, tmp_path, exists):
    name = topic if exists else f"{topic}-missing"
    rc, _, err, _ = _rlrec(
        "consume",
        "--bootstrap-servers",
        broker.bootstrap_servers,
        "--topic",
        name,
        "--no-create-topics",
        "--output",
        str(tmp_path),
        "--max-seconds",
        "3",
    )
    assert rc == 0, err
    assert "Traceback" not in err
    assert "committed 0 episodes (0 steps) in 0 shards (0.0 MiB); 0 dead letters" in err.splitlines()[-1], err
    assert (f"topic {name} does not exist (--no-create-topics)" in err) is not exists, err


# -- what a newcomer reads -------------------------------------------------------------------------


def test_ray_notices_stay_out_of_the_trainer_log(capsys, monkeypatch):
    import warnings

    from ray.util.annotations import RayDeprecationWarning

    from rlrec.logs import quiet_ray_logging, setup_logging

    # whatever an earlier test in this process left of Ray's own logging set-up
    for name in ("ray", "ray.rllib", "ray.data", "ray.rllib.algorithms.marwil"):
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "propagate", True)
        monkeypatch.setattr(logger, "handlers", list(logger.handlers))
        monkeypatch.setattr(logger, "level", logging.NOTSET)
        monkeypatch.setattr(logger, "disabled", False)
    # Ray's own stderr handlers (as ray.rllib's and ray.data's imports install them)
    logging.getLogger("ray.rllib").addHandler(logging.StreamHandler())
    logging.getLogger("ray.data").addHandler(logging.StreamHandler())
    setup_logging("text", "INFO")
    logging.captureWarnings(False)  # an earlier in-process `rlrec train` turned it on under pytest's own capture
    try:
        quiet_ray_logging()
        for name in ("ray", "ray.rllib", "ray.data"):  # Ray's records reach our handler only
            logger = logging.getLogger(name)
            assert logger.propagate and not any(type(h) is logging.StreamHandler for h in logger.handlers), name
        logging.getLogger("ray.rllib.algorithms.marwil").warning("DeprecationWarning: `build` has been deprecated")
        logging.getLogger("ray.data").info("Starting execution of Dataset")
        logging.getLogger("ray.data._internal.util").warning("The argument ``concurrency`` is deprecated in Ray 2.51")
        logging.getLogger("ray._private.authentication").warning("Token authentication is enabled for this Ray")
        logging.getLogger("ray.tune.utils.util").warning("Install gputil for GPU system monitoring.")
        logging.getLogger("ray.rllib").warning("a learner is slow")
        logging.getLogger("ray.data").error("a read task failed")
        logging.getLogger("rlrec.trainer").info("iteration 1")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("`ray_remote_args` is deprecated", RayDeprecationWarning, stacklevel=1)
            warnings.warn("the env's observation is out of its space", UserWarning, stacklevel=1)
        err = capsys.readouterr().err
    finally:
        logging.captureWarnings(False)
        logging.getLogger().handlers[:] = []
    for notice in ("DeprecationWarning", "Starting execution", "concurrency", "Token authentication", "gputil"):
        assert notice not in err, err
    records = [ln for ln in err.splitlines() if re.match(r"\d{4}-\d\d-\d\d ", ln)]  # all in our format
    assert len(records) == 4, err
    assert "a learner is slow" in err and "a read task failed" in err and "iteration 1" in err
    assert "py.warnings" in err and "out of its space" in err


def test_ray_native_notices_stay_out_of_stderr_and_nothing_else_is_lost():
    """Ray's C++ notice lines (written to fd 2 past Python's logging) are dropped by the stderr
    relay; every other line arrives in order, including one written just before a SIGKILL."""
    script = (
        "import os, signal, sys\n"
        "from rlrec.logs import drop_native_notices\n"
        "assert drop_native_notices()\n"
        'os.write(2, b"[2026-11-27 03:35:12,157 E 9903 10468] core_worker.cc:2465: Actor with class name: '
        "'MapWorker' has constructor arguments in the object store and max_restarts > 0. If the ...\\n\")\n"
        "os.write(2, b'an error of the run\\n')\n"
        "print('a line via sys.stderr', file=sys.stderr, flush=True)\n"
        "os.write(2, b'last words')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == -9, p.stderr
    assert p.stderr == "an error of the run\na line via sys.stderr\nlast words", p.stderr


def test_dashboard_names_the_scripted_expert():
    from rlrec.demo.dashboard import version_name

    assert version_name(None) == version_name(0) == "v0 (scripted expert)"
    assert version_name(2) == "v2"


def test_demo_prints_commands_the_shell_can_run(monkeypatch, tmp_path):
    from rlrec.commands._common import shell_command

    monkeypatch.setenv("PATH", str(tmp_path))  # rlrec not on PATH: the script's path
    cmd = shell_command()
    assert cmd.endswith("rlrec") and os.sep in cmd and os.access(cmd.split()[0], os.X_OK)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    assert shell_command() == "rlrec"


def test_report_behaviour_return_is_the_oldest_versions_mean():
    from rlrec.report import _behaviour_return
    from rlrec.report_data import ReportData

    data = ReportData.__new__(ReportData)
    data.episodes = {"episode_return": [10.0, 30.0, 100.0, None], "policy_version": [0, 0, 2, 0]}
    assert _behaviour_return(data) == (0, 20.0)
    data.episodes = {}
    assert _behaviour_return(data) is None


@pytest.mark.parametrize(
    "module",
    [
        "rlrec.errors",
        "rlrec.commands._common",
        "rlrec.consumer.topics",
        "rlrec.demo.dashboard",
        "rlrec.report",
    ],
)
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
