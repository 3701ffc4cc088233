"""The `policy` extra in a fresh virtual environment: what the slim policy image holds.

torch is installed as the Makefile's `venv` target installs it (the image takes the same version
from PyTorch's CPU index), then the Dockerfile's `policy` stage runs as written, outside Docker:
its dependency step (`pip install ".[policy]"` from the project's metadata alone), the sources,
`pip install --no-deps .` and the image's own checks. In that environment `load_policy` loads a
signed policy from a local publish root and from an S3 one (moto's server on 127.0.0.1), and
Ray cannot be imported.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
import uuid

import gymnasium as gym
import pytest

from tests.compose_model import ROOT
from tests.dockerfile_model import copy_from_context, project_files, run_stage, venv_env

pytestmark = [pytest.mark.system, pytest.mark.slow, pytest.mark.timeout(1200)]

#: run in the fresh environment: load, act once, say what was loaded and whether Ray is there
LOAD = textwrap.dedent("""
    import importlib.util, json, sys
    import rlrec
    from rlrec import load_policy
    p = load_policy(sys.argv[1], public_key=sys.argv[2])
    action, _ = p.act([0.0, 0.0, 0.1, 0.0])
    print(json.dumps({
        "version": p.policy_version,
        "signed": p.signed,
        "action": int(action),
        "rlrec": rlrec.__file__,
        "ray_importable": importlib.util.find_spec("ray") is not None,
    }))
""")


def _torch_version() -> str:
    return re.search(r"^TORCH_VERSION \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def _published(tmp_path, s3_root: str) -> tuple[str, str]:
    """A signed policy (version 1) published to a local root and to `s3_root`; (local root, public key)."""
    from rlrec.trainer.signing import generate_keys, load_private_key
    from tests.test_policy_artifacts import build_module, publish

    priv, pub = generate_keys(tmp_path / "keys")
    act_space = gym.spaces.Discrete(2)
    module = build_module("BC", act_space)
    local = tmp_path / "policies"
    for root in (local, s3_root):
        publish(root, module, act_space, version=1, signing_key=load_private_key(priv))
    return str(local), str(pub)


def _fresh_policy_venv(tmp_path) -> dict[str, str]:
    """A new venv with torch and the Dockerfile's policy stage installed; its shell environment."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = venv_env(venv)
    r = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"torch=={_torch_version()}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    workdir = tmp_path / "opt-rlrec"
    copy_from_context(project_files(), workdir)
    run_stage("policy", workdir, env, timeout=600)
    return env


def _python(tmp_path) -> str:
    return str(tmp_path / "venv" / "bin" / "python")


def test_the_policy_extra_loads_signed_policies_from_a_path_and_s3_without_ray(tmp_path, local_s3, monkeypatch):
    for k, v in local_s3.env().items():
        monkeypatch.setenv(k, v)
    bucket = local_s3.create_bucket(f"t-{uuid.uuid4().hex[:8]}")
    s3_root = f"s3://{bucket}/trainer/policies"
    local_root, public_key = _published(tmp_path, s3_root)

    t0 = time.monotonic()
    env = _fresh_policy_venv(tmp_path)
    install_s = time.monotonic() - t0
    env.update(local_s3.env())
    run = tmp_path / "run"  # not the repository: rlrec must come from the venv
    run.mkdir()
    for root in (local_root, s3_root):
        r = subprocess.run(
            [_python(tmp_path), "-c", LOAD, root, public_key],
            cwd=run,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["rlrec"].startswith(str(tmp_path / "venv")), got
        assert (got["version"], got["signed"], got["ray_importable"]) == (1, True, False), got
        assert got["action"] in (0, 1)
    r = subprocess.run(
        [_python(tmp_path), "-m", "pip", "list", "--format", "json"], cwd=run, env=env, capture_output=True, text=True
    )
    names = {d["name"].lower() for d in json.loads(r.stdout)}
    assert {"torch", "safetensors", "cryptography", "pyarrow", "confluent-kafka", "rlrec"} <= names
    assert not names & {"ray", "boto3", "matplotlib", "rich"}, names
    print(f"fresh policy venv installed in {install_s:.0f} s")
