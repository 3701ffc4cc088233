"""`rlrec evaluate` as a user meets it: data without propensities, a version that is not
published, no key, what it read, and its start-up phases said as they begin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import gymnasium as gym
import numpy as np
import pytest

from rlrec.cli import main
from rlrec.store.commit import ShardCommitter
from rlrec.store.storage import Storage
from rlrec.trainer.export import PolicyArtifact, publish_policy
from rlrec.trainer.holdout import is_held_out
from rlrec.trainer.synthetic import CONTEXT_BANDIT_ID, linear_policy_artifact, logged_episodes

HOLDOUT = 0.2


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """60 episodes recorded without propensities (no action_logp) in three shards, one of which
    holds no held-out episode; versions 1-3 published unsigned."""
    root = tmp_path_factory.mktemp("evaluate")
    spec, model = linear_policy_artifact(np.eye(3, 4, dtype=np.float32))
    eps, _ = logged_episodes(CONTEXT_BANDIT_ID, spec, model, 60, seed=0, policy_version=0)
    for e in eps:
        e.extra_model_outputs = {}
    held = [e for e in eps if is_held_out(e.episode_id, HOLDOUT)]
    kept = [e for e in eps if not is_held_out(e.episode_id, HOLDOUT)]
    assert held and len(kept) > 10
    committer = ShardCommitter(str(root / "data"))
    committer.commit(kept[:10])  # no held-out episode: its manifest entry says so, it is not read
    committer.commit(kept[10:])
    committer.commit(held)
    art = PolicyArtifact(
        "safetensors", {"model.safetensors": model}, {k: spec[k] for k in ("format", "model", "action_dist", "network")}
    )
    for v in (1, 2, 3):
        publish_policy(
            Storage.from_uri(str(root / "policies")),
            algo=None,
            version=v,
            algo_name="BC",
            observation_space=gym.spaces.Box(-1.0, 1.0, (4,), np.float32),
            action_space=gym.spaces.Discrete(3),
            iteration=v,
            timesteps_trained=0,
            shards=[],
            new_shards=[],
            parent_version=None,
            artifact=art,
            metadata={"gamma": 0.9},
        )
    return root, len(eps)


def _args(root, *more):
    return ["evaluate", "--input", str(root / "data"), "--policies", str(root / "policies"), *more]


def _error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1, err
    return err[0]


def test_no_propensities_is_not_estimable_with_a_reason(store, capsys):
    root, n = store
    args = _args(root, "--allow-unsigned", "--holdout-fraction", str(HOLDOUT), "--fqe-steps", "20")
    assert main([*args, "--json", "--ope-bootstrap", "20"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["diagnostics"]["coverage"] == 0.0
    for name, e in doc["estimates"].items():
        assert not e["estimable"] and e["value"] is None and "propensit" in e["reason"], (name, e)
    # every shard's episodes are seen, also those of a shard that holds no held-out episode
    assert doc["data"]["episodes_seen"] == n and doc["data"]["shards"] == 3
    assert main([*args, "--ope-bootstrap", "20"]) == 0
    assert "no held-out step carries the behaviour's propensity (action_logp)" in capsys.readouterr().out


def test_a_version_that_is_not_published_is_named_with_those_that_are(store, capsys):
    root, _ = store
    assert main(_args(root, "--allow-unsigned", "--version", "7")) == 2
    line = _error(capsys)
    assert line == f"rlrec evaluate: error: --version 7: no such version under {root / 'policies'} (published: 1-3)"


def test_without_a_key_the_flags_are_named(store, capsys, monkeypatch):
    root, _ = store
    monkeypatch.delenv("RLREC_POLICY_PUBLIC_KEY", raising=False)
    assert main(_args(root)) == 2
    line = _error(capsys)
    assert "--public-key" in line and "--allow-unsigned" in line and "=" not in line, line


def test_with_a_key_an_unsigned_version_names_the_flag(store, capsys, tmp_path):
    from rlrec.trainer.signing import generate_keys

    root, _ = store
    _, pub = generate_keys(tmp_path)
    assert main(_args(root, "--public-key", str(pub))) == 2
    line = _error(capsys)
    assert "v000003 is not signed" in line and "--allow-unsigned" in line and "allow_unsigned=" not in line, line


def _not_in_extra(extra: str) -> set[str]:
    """The top-level modules that only rlrec's other runtime extras install, not `extra` (with
    the extras it names) nor the base dependencies: what `pip install 'rlrec[extra]'` lacks."""
    import re
    from importlib.metadata import packages_distributions
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(reqs: list[str]) -> set[str]:
        out = set()
        for req in reqs:
            name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
            if name == "rlrec":
                for sub in re.search(r"\[(.*)\]", req).group(1).split(","):
                    out |= names(extras[sub.strip()])
            else:
                out.add(re.sub(r"[-_.]+", "-", name).lower())
        return out

    allowed = names(project["dependencies"]) | names(extras[extra])
    others = set().union(*(names(v) for k, v in extras.items() if k not in ("dev", "profile", "all")))
    blocked = (others - allowed) | {"ray"}
    modules = set()
    for module, dists in packages_distributions().items():
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in dists}
        if dists <= blocked:
            modules.add(module)
    return modules | {"ray"}


def test_evaluate_runs_with_its_extra_only_and_says_its_phases(store):
    """OPE needs numpy and torch only: with every module that only other extras than
    `rlrec[evaluate]` install unimportable (ray, rich, boto3, ...: set to None in `sys.modules` of
    a fresh interpreter, read from pyproject.toml) evaluate reads, fits and answers, saying each phase
    and the shards it read as it goes. (The stricter check, `rlrec[evaluate]` alone in a fresh
    venv, is CI's `make check-evaluate-extra`: it takes minutes.)"""
    root, _ = store
    blocked = sorted(_not_in_extra("evaluate"))
    assert {"ray", "boto3", "rich"} <= set(blocked)
    assert "msgpack" not in blocked and "torch" not in blocked
    script = textwrap.dedent(
        f"""
        import sys

        BLOCKED = set({blocked!r})
        for name in BLOCKED:  # as if not installed: import fails, importlib.util.find_spec gives None
            sys.modules[name] = None
        from rlrec.cli import main
        from rlrec.process_exit import exit_process
        code = main(sys.argv[1:])
        assert not [m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in BLOCKED]
        exit_process(code)  # as the rlrec program ends (torch is imported)
        """
    )
    args = _args(root, "--allow-unsigned", "--holdout-fraction", str(HOLDOUT), "--fqe-steps", "20")
    r = subprocess.run(
        [sys.executable, "-c", script, *args, "--ope-bootstrap", "20", "--compare-to", "behavior"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert r.returncode == 0, r.stderr
    assert "cursor: r1~" in r.stdout, r.stdout
    phases = [line.split(": ", 1)[1] for line in r.stderr.splitlines() if line.startswith("rlrec evaluate: ")]
    starts = ["loading", "reading the held-out", "read 3/3 shard(s)", "estimating with", "comparing with"]
    at = [next(i for i, p in enumerate(phases) if p.startswith(s)) for s in starts]
    assert at == sorted(at), phases


def test_counts_are_printed_in_the_one_number_format(capsys):
    """Thousands separated as `rlrec inspect` prints them (8,310 steps, never 8310)."""
    from rlrec.commands.evaluate import _print

    _print(
        {
            "version": 2,
            "action_selection": "greedy",
            "gamma": 0.99,
            "episodes": 1200,
            "steps": 8310,
            "behavior": {"versions": [1], "mean_return": 91.5},
            "estimates": {},
            "default_estimator": "wdr",
            "ci_level": 0.9,
            "diagnostics": {"coverage": 1.0},
            "data": {"cursor": "r1~0123456789ab~rl:0=2"},
        }
    )
    assert "on 1,200 held-out episodes (8,310 steps) of behaviour version(s) 1" in capsys.readouterr().out
