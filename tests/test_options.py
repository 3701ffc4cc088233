"""Options declared once on dataclasses (rlrec.options): command line, environment, config file."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from rlrec.cli import build_parser
from rlrec.options import OptionError, OptionSet, check_choices, option, parse_key_values

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Example:
    output: str = option(help="where")
    mode: Literal["fast", "safe"] = option("safe", help="how")
    count: int = option(3, help="how many")
    ratio: float | None = option(None, help="a share")
    resume: bool = option(False, help="continue")
    extra: dict[str, Any] = option(default_factory=dict, help="pass-through")
    internal: int = 5  # no option()


EXAMPLE = OptionSet("example", Example)


def _parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    EXAMPLE.add_arguments(parser)
    return parser.parse_args(argv)


def test_precedence_is_command_line_then_environment_then_file_then_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('output = "file"\nmode = "fast"\ncount = 7\nratio = 0.25\n[extra]\na = 1\nb = 2\n')
    env = {"RLREC_COUNT": "8", "RLREC_RATIO": "0.5", "RLREC_EXTRA": '{"b": 20, "c": 30}'}
    got = EXAMPLE.resolve(_parse("--config", str(path), "--ratio", "0.75", "--extra", "c=300"), environ=env)
    assert got == {
        "output": "file",  # only in the file
        "mode": "fast",  # the file over the default
        "count": 8,  # the environment over the file
        "ratio": 0.75,  # the command line over both
        "resume": False,  # the default
        "extra": {"a": 1, "b": 20, "c": 300},  # tables merge, later layers winning per key
    }
    assert EXAMPLE.build(Example, got) == Example(output="file", mode="fast", count=8, ratio=0.75, extra=got["extra"])


def test_booleans_both_ways_from_every_source(tmp_path):
    assert EXAMPLE.resolve(_parse("--resume"), environ={})["resume"] is True
    assert EXAMPLE.resolve(_parse("--no-resume"), environ={"RLREC_RESUME": "1"})["resume"] is False
    assert EXAMPLE.resolve(_parse(), environ={"RLREC_RESUME": "true"})["resume"] is True
    assert EXAMPLE.resolve(_parse(), environ={"RLREC_NO_RESUME": "1"})["resume"] is False
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"no-resume": False}))
    assert EXAMPLE.resolve(_parse("--config", str(path)), environ={})["resume"] is True
    with pytest.raises(OptionError, match="RLREC_RESUME: not an on/off value"):
        EXAMPLE.resolve(_parse(), environ={"RLREC_RESUME": "maybe"})


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("cuont = 1\n", "unknown option 'cuont' in {path} (did you mean 'count'?)"),
        ("re-sume = true\n", "unknown option 're-sume' in {path} (did you mean 'resume'?)"),
        ("internal = 1\n", "unknown option 'internal' in {path}"),
        ('count = "x"\n', "'count' in {path}: invalid int value: 'x'"),
        ("count = true\n", "'count' in {path}: expected int, got True"),
        ('mode = "slow"\n', "'mode' in {path}: invalid choice: 'slow' (choose from fast, safe)"),
        ("extra = 1\n", "'extra' in {path}: expected a table (JSON object), got 1"),
        ("count = \n", "cannot read config file {path}"),
    ],
)
def test_file_errors_name_the_key_and_the_nearest_option(tmp_path, text, says):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(OptionError) as e:
        EXAMPLE.resolve(_parse("--config", str(path)), environ={})
    assert str(e.value).startswith(says.format(path=path)), str(e.value)
    assert "\n" not in str(e.value)


def test_environment_variables_of_no_command_are_refused_others_ignored():
    build_parser()  # every command's options declared
    with pytest.raises(
        OptionError, match=r"unknown option 'RLREC_CUONT' in the environment \(did you mean 'RLREC_COUNT'\?\)"
    ):
        EXAMPLE.resolve(_parse(), environ={"RLREC_CUONT": "1"})
    # another command's options, rlrec's other variables and the tests' own are no error
    env = {"RLREC_BOOTSTRAP_SERVERS": "b:1", "RLREC_ALGO": "CQL", "RLREC_POLICY_PUBLIC_KEY": "k", "RLREC_TEST_X": "1"}
    assert EXAMPLE.resolve(_parse(), environ=env)["count"] == 3


def test_required_options_are_refused_by_build_not_by_resolve():
    values = EXAMPLE.resolve(_parse(), environ={})
    assert values["output"] is None
    with pytest.raises(
        OptionError, match=r"--output is required \(or RLREC_OUTPUT, or 'output' in the --config file\)"
    ):
        EXAMPLE.build(Example, values)


def test_choices_are_checked_on_the_dataclass_too():
    with pytest.raises(ValueError, match="--mode must be one of fast, safe, got 'slow'"):
        check_choices(Example(output="o", mode="slow"))


def test_parse_key_values_is_the_one_key_value_parser():
    assert parse_key_values(["a=1", "b=x=y", " c =z"], "--kafka-config") == {"a": "1", "b": "x=y", "c": "z"}
    assert parse_key_values(
        ["lr=0.001", "x=abc", "m={'fcnet_hiddens': [64]}", "b=true", "s=[1, 2]"], "--algo-config", literal=True
    ) == {"lr": 0.001, "x": "abc", "m": {"fcnet_hiddens": [64]}, "b": True, "s": [1, 2]}
    for bad in ("novalue", "=1"):
        with pytest.raises(OptionError, match=f"--algo-config expects KEY=VALUE, got '{bad}'"):
            parse_key_values([bad], "--algo-config", literal=True)


# -- rlrec train: the same layering as rlrec consume ---------------------------------------------


def _train_options(*argv: str, environ: dict[str, str]):
    args = build_parser().parse_args(["train", *argv])
    return args.options.resolve(args, environ=environ)


def test_train_reads_the_environment_and_a_config_file(tmp_path):
    from rlrec.commands.train import OPTIONS
    from rlrec.trainer.config import TrainerConfig

    path = tmp_path / "train.toml"
    path.write_text(
        'input = "/data/exp"\ncheckpoint-dir = "/ckpt/file"\nalgo = "marwil"\neval-interval = 4\nenv = "CartPole-v1"\n'
        "no-publish = true\n[algo-config]\nlr = 0.0003\ntrain_batch_size_per_learner = 512\n"
    )
    env = {"RLREC_CHECKPOINT_DIR": "/ckpt/env", "RLREC_NUM_CPUS": "2", "RLREC_BOOTSTRAP_SERVERS": "kafka:9092"}
    opts = _train_options("--config", str(path), "--algo-config", "lr=1e-3", "--resume", environ=env)
    assert opts["input"] == "/data/exp" and opts["checkpoint_dir"] == "/ckpt/env" and opts["num_cpus"] == 2
    assert opts["algo"] == "MARWIL" and opts["eval_interval"] == 4 and opts["publish"] is False and opts["resume"]
    assert opts["algo_config"] == {"lr": 1e-3, "train_batch_size_per_learner": 512}
    cfg = OPTIONS.build(TrainerConfig, opts)
    assert cfg.algo == "MARWIL" and cfg.placement.num_cpus == 2 and cfg.progress is True


def test_train_algorithms_are_the_ones_the_service_runs():
    from rlrec.trainer.config import ALGORITHM_NAMES
    from rlrec.trainer.service import ALGORITHMS

    assert tuple(ALGORITHMS) == ALGORITHM_NAMES


def test_validate_spaces_choices_are_the_assemblers():
    import typing

    from rlrec.consumer.assembly import VALIDATE_SPACES
    from rlrec.consumer.config import ConsumerConfig

    assert typing.get_args(typing.get_type_hints(ConsumerConfig)["validate_spaces"]) == VALIDATE_SPACES


def _run_cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLREC_")} | {"COLUMNS": "200"} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "rlrec", *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )


def test_train_config_file_typo_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"input": str(tmp_path), "checkpoint_dir": str(tmp_path / "ck"), "eval_intervall": 3}))
    r = _run_cli("train", "--config", str(path))
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"rlrec train: error: unknown option 'eval_intervall' in {path} (did you mean 'eval_interval'?)"
    ]
    r = _run_cli("train", "--input", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ck"), "--algo", "PPO")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "rlrec train: error: --algo: invalid choice: 'PPO' (choose from BC, MARWIL, CQL, IQL)"
    ]
    r = _run_cli("train", "--checkpoint-dir", str(tmp_path / "ck"))
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "rlrec train: error: --input is required (or RLREC_INPUT, or 'input' in the --config file)"
    ]


def test_train_help_lists_every_option_with_its_default_and_choices():
    from rlrec.commands.train import OPTIONS

    r = _run_cli("train", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for opt in OPTIONS.options.values():
        assert opt.flag in text and opt.env in text, opt.flag
        if opt.shown_default() is not None:
            assert f"default: {opt.shown_default()}" in text, opt.flag
    assert "{BC,MARWIL,CQL,IQL}" in text and "{episodes,buffer}" in text and "--no-publish" in text


def test_the_docstring_examples_run():
    import doctest

    import rlrec.options

    result = doctest.testmod(rlrec.options)
    assert result.attempted >= 3 and result.failed == 0


# -- every command ---------------------------------------------------------------------------


def _leaf_commands(parser, path=()):
    from rlrec.reference import _subcommands

    subs = _subcommands(parser)
    if not subs:
        yield " ".join(path), parser
    for name, sub in subs:
        yield from _leaf_commands(sub, (*path, name))


def test_every_command_declares_its_options_once():
    commands = dict(_leaf_commands(build_parser()))
    assert {"consume", "train", "evaluate", "gc", "inspect", "convert", "topics create", "keys generate"} <= set(
        commands
    )
    undeclared = sorted(
        name for name, parser in commands.items() if not isinstance(parser.get_default("options"), OptionSet)
    )
    assert undeclared == []


def test_a_variable_several_commands_read_means_the_same_to_each():
    """One environment serves every command: an RLREC_* variable that two commands read must have
    one type (a list option also takes one comma-separated text) and one set of values (or a
    subset: `demo --algo` takes BC and MARWIL of `train --algo`'s four)."""
    build_parser()
    from rlrec import options

    by_var: dict[str, list] = {}
    for s in options._ALL:
        for opt in s._settable.values():
            by_var.setdefault(opt.env, []).append((s.command, opt))
    for var, users in by_var.items():
        kinds = {o.kind for _, o in users} - ({list} if str in {o.kind for _, o in users} else set())
        assert len(kinds) == 1, f"{var}: {[(c, o.kind.__name__) for c, o in users]}"
        choices = sorted((set(o.choices) for _, o in users if o.choices is not None), key=len)
        assert all(a <= b for a, b in itertools.pairwise(choices)), f"{var}: {[(c, o.choices) for c, o in users]}"
        if choices:
            assert all(o.choices is not None for _, o in users), f"{var}: only some commands check its values"


def _resolve(argv: list[str], environ: dict[str, str]) -> dict:
    args = build_parser().parse_args(argv)
    return args.options.resolve(args, environ=environ)


def test_positional_arguments_come_from_the_command_line_only(tmp_path):
    assert _resolve(["gc", "/data", "--older-than", "15m"], {})["uri"] == "/data"
    with pytest.raises(OptionError, match="unknown option 'RLREC_URI' in the environment"):
        _resolve(["gc", "/data", "--older-than", "1h"], {"RLREC_URI": "/elsewhere"})
    path = tmp_path / "gc.toml"
    path.write_text('uri = "/elsewhere"\n')
    with pytest.raises(OptionError, match="unknown option 'uri' in"):
        _resolve(["gc", "/data", "--config", str(path)], {})


def test_a_parsed_option_takes_text_from_every_source(tmp_path):
    path = tmp_path / "gc.toml"
    path.write_text('older-than = "2d"\n')
    assert _resolve(["gc", "/d", "--config", str(path)], {})["older_than"] == 172800.0
    assert _resolve(["gc", "/d", "--config", str(path)], {"RLREC_OLDER_THAN": "1.5h"})["older_than"] == 5400.0
    assert _resolve(["gc", "/d", "--older-than", "90"], {"RLREC_OLDER_THAN": "1h"})["older_than"] == 90.0
    with pytest.raises(OptionError, match=r"--older-than: not a duration: 'soon' \(use e.g. 90s, 15m, 1h, 2d\)"):
        _resolve(["gc", "/d", "--older-than", "soon"], {})


def test_a_list_option_repeats_on_the_command_line_and_is_comma_separated_in_the_environment(tmp_path):
    base = ["topics", "create", "--partitions", "2"]
    assert _resolve([*base, "--topic", "a", "--topic", "b"], {})["topic"] == ["a", "b"]
    assert _resolve(base, {"RLREC_TOPIC": "a, b"})["topic"] == ["a", "b"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"topic": ["x"], "topic-config": {"retention.ms": "1"}, "no-dlq": True}))
    got = _resolve([*base, "--config", str(path)], {})
    assert (got["topic"], got["topic_config"], got["dlq"]) == (["x"], {"retention.ms": "1"}, False)
    with pytest.raises(OptionError, match="expected a list of strings"):
        path.write_text(json.dumps({"topic": [1]}))
        _resolve([*base, "--config", str(path)], {})


def test_an_option_may_be_named_apart_from_its_field():
    """`rlrec convert --from` fills `ConvertOptions.input_format`; RLREC_FROM and key `from` too."""
    assert _resolve(["convert", "in", "--from", "sample-batch"], {})["input_format"] == "sample-batch"
    assert _resolve(["convert", "in"], {"RLREC_FROM": "sample-batch"})["input_format"] == "sample-batch"
    with pytest.raises(OptionError, match="invalid choice: 'csv'"):
        _resolve(["convert", "in", "--from", "csv"], {})


def test_each_command_refuses_a_config_file_typo_in_one_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("dry-runn = true\n")
    out = subprocess.run(
        [sys.executable, "-m", "rlrec", "gc", str(tmp_path), "--older-than", "1h", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("RLREC_")},
    )
    assert out.returncode == 2
    assert out.stderr == f"rlrec gc: error: unknown option 'dry-runn' in {path} (did you mean 'dry-run'?)\n"


def test_what_a_command_s_dataclass_refuses_is_a_usage_error(tmp_path, capsys):
    from rlrec.cli import main

    (tmp_path / "in").mkdir()
    argv = ["convert", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--schema", "foo=bar"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlrec convert: error: --schema: unknown key 'foo'") and err.count("\n") == 1


def test_every_rlrec_variable_the_package_reads_is_known_to_the_options():
    """A variable rlrec reads itself (`os.environ.get("RLREC_...")`) that is no option must be in
    OTHER_ENV (or start RLREC_TEST_): otherwise setting it makes every command refuse to run."""
    import pathlib
    import re

    from rlrec.options import OTHER_ENV, known_env_vars

    root = pathlib.Path(__file__).resolve().parents[1]
    read = {
        m
        for d in ("producer", "store", "consumer", "trainer", "rlrec")
        for f in (root / d).rglob("*.py")
        for m in re.findall(r"environ(?:\.get\(|\[)\"(RLREC_[A-Z0-9_]+)\"", f.read_text())
    }
    assert read, "the scan found nothing: the pattern is wrong"
    unknown = {v for v in read if v not in OTHER_ENV and v not in known_env_vars() and not v.startswith("RLREC_TEST_")}
    assert not unknown, unknown


@pytest.mark.parametrize("value", ["[" * 100_000, "[" * 5000 + "]" * 5000])
def test_a_value_nested_too_deeply_is_one_option_error(value):
    with pytest.raises(OptionError, match=r"^--env-config N: the value nests too deeply$"):
        parse_key_values([f"N={value}"], "--env-config", literal=True)
