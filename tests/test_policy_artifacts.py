"""Published policies are data: safetensors weights + a JSON network spec, rebuilt in plain torch.

* Equivalence, for every algorithm x action space RLlib 2.60 supports here (BC and MARWIL x
  {Discrete, Box}; CQL and IQL x Box): the rebuilt network's action distribution inputs are within
  1e-6 of the RLModule's on the same observations, its deterministic action is RLlib's
  ``to_deterministic().sample()`` and the log-probability of given actions is RLlib's
  ``dist.logp``.
* The artifact holds no code (no TorchScript/pickle): loading never calls ``torch.jit.load``.
* Trust: unsigned versions load only with the opt-ins; tampered files, a tampered policy.json, a
  foreign key, a `latest.json` pointing outside the root and re-published older versions are
  refused with `PolicyLoadError`; `poll()` never moves to a lower version.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import gymnasium as gym
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ray.rllib")

from rlrec.trainer.policy import PolicyLoadError, UnsignedPolicyWarning, load_policy  # noqa: E402
from rlrec.trainer.signing import generate_keys, load_private_key  # noqa: E402

OBS = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
CASES = {
    "BC-Discrete": ("BC", gym.spaces.Discrete(3)),
    "BC-Box": ("BC", gym.spaces.Box(-2.0, 2.0, (2,), np.float32)),
    "MARWIL-Discrete": ("MARWIL", gym.spaces.Discrete(2)),
    "MARWIL-Box": ("MARWIL", gym.spaces.Box(-1.0, 3.0, (1,), np.float32)),
    "CQL-Box": ("CQL", gym.spaces.Box(-2.0, 2.0, (1,), np.float32)),
    "IQL-Box": ("IQL", gym.spaces.Box(-2.0, 2.0, (2,), np.float32)),
}


def build_module(algo: str, act_space: gym.Space, seed: int = 0):
    """The algorithm's default RLModule for (OBS, act_space), weights perturbed (not the init)."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    from rlrec.trainer.service import ALGORITHMS, _import

    config = _import(ALGORITHMS[algo][0])().environment(observation_space=OBS, action_space=act_space)
    module = config.get_multi_rl_module_spec(spaces={DEFAULT_MODULE_ID: (OBS, act_space)}).build()[DEFAULT_MODULE_ID]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    module.eval()
    return module


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    priv, pub = generate_keys(d)
    return {"dir": d, "private": load_private_key(priv), "private_path": priv, "public": pub}


def publish(root, module, act_space, version: int, signing_key=None, algo: str = "BC") -> dict:
    from rlrec.store.storage import Storage
    from rlrec.trainer.export import build_artifact, publish_policy

    artifact = build_artifact(module, OBS, act_space)
    return publish_policy(
        Storage.from_uri(str(root)),
        algo=None,
        version=version,
        algo_name=algo,
        observation_space=OBS,
        action_space=act_space,
        iteration=version,
        timesteps_trained=0,
        shards=[],
        new_shards=[],
        parent_version=version - 1 or None,
        signing_key=signing_key,
        artifact=artifact,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_rebuilt_network_matches_the_rl_module(case, tmp_path, keys):
    from ray.rllib.core.columns import Columns

    algo, act_space = CASES[case]
    module = build_module(algo, act_space)
    spec = publish(tmp_path, module, act_space, 1, keys["private"], algo)
    assert spec["format"] == "safetensors" and set(os.listdir(tmp_path / "v000001")) == {
        "model.safetensors",
        "lineage.json",
        "policy.json",
        "policy.json.sig",
    }
    policy = load_policy(str(tmp_path), public_key=keys["public"])
    assert policy.signed

    obs = np.random.default_rng(1).normal(0, 2, (256, 4)).astype(np.float32)
    with torch.no_grad():
        ref = module._forward_inference({Columns.OBS: torch.as_tensor(obs)})[Columns.ACTION_DIST_INPUTS]
    ours = policy.action_dist_inputs(obs)
    assert ours.shape == tuple(ref.shape)
    assert np.max(np.abs(ours - ref.numpy())) <= 1e-6

    dist = module.get_inference_action_dist_cls().from_logits(ref)
    ref_greedy = dist.to_deterministic().sample().numpy()
    np.testing.assert_array_equal(policy.deterministic_actions(obs), ref_greedy)

    torch.manual_seed(3)
    actions = dist.sample()
    ref_logp = dist.logp(actions).numpy()
    ours_logp = policy.logp(obs, actions.numpy())
    np.testing.assert_allclose(ours_logp, ref_logp, rtol=1e-5, atol=1e-5)

    a, extra = policy.act(obs[0])
    assert np.isfinite(extra["action_logp"])
    if isinstance(act_space, gym.spaces.Discrete):
        assert a == int(ref_greedy[0])
    else:
        assert act_space.contains(a)


def test_loading_never_runs_torchscript_or_pickle(tmp_path, keys, monkeypatch):
    module = build_module("BC", gym.spaces.Discrete(2))
    publish(tmp_path, module, gym.spaces.Discrete(2), 1, keys["private"])

    def forbidden(*_a, **_k):
        raise AssertionError("a code-free artifact must not be loaded through torch.jit.load / torch.load")

    monkeypatch.setattr(torch.jit, "load", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    import pickle

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    assert load_policy(str(tmp_path), public_key=keys["public"]).policy_version == 1


# ------------------------------------------------------------------------------------- trust


@pytest.fixture
def published(tmp_path, keys):
    """v1 and v2 of a BC CartPole-like policy, signed."""
    space = gym.spaces.Discrete(2)
    for v in (1, 2):
        publish(tmp_path, build_module("BC", space, seed=v), space, v, keys["private"])
    return tmp_path


def _rewrite_spec(root, version_dir: str, **changes) -> None:
    p = root / version_dir / "policy.json"
    spec = json.loads(p.read_bytes())
    spec.update(changes)
    p.write_bytes(json.dumps(spec, indent=1, sort_keys=True).encode())


def _point_latest(root, version_dir: str) -> None:
    """An unsigned pointer, as someone without the signing key writes it."""
    (root / "latest.json.sig").unlink(missing_ok=True)
    data = (root / version_dir / "policy.json").read_bytes()
    (root / "latest.json").write_text(
        json.dumps(
            {"policy_version": int(version_dir[1:]), "path": version_dir, "sha256": hashlib.sha256(data).hexdigest()}
        )
    )


def test_unsigned_versions_need_the_opt_in(tmp_path, keys, monkeypatch):
    monkeypatch.delenv("RLREC_POLICY_PUBLIC_KEY", raising=False)
    space = gym.spaces.Discrete(2)
    publish(tmp_path, build_module("BC", space), space, 1)  # no signing key
    with pytest.raises(PolicyLoadError, match=r"not signed.*allow_unsigned=True"):
        load_policy(str(tmp_path))
    with pytest.raises(PolicyLoadError, match="not signed"):
        load_policy(str(tmp_path), public_key=keys["public"])  # a key is configured: still unsigned
    with pytest.warns(UnsignedPolicyWarning):
        p = load_policy(str(tmp_path), allow_unsigned=True)
    assert p.policy_version == 1 and not p.signed


def test_public_key_from_the_environment(published, keys, monkeypatch):
    monkeypatch.setenv("RLREC_POLICY_PUBLIC_KEY", str(keys["public"]))
    p = load_policy(str(published))
    assert p.signed and p.policy_version == 2


def test_tampered_weights_are_refused(published, keys):
    w = published / "v000002" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-3] ^= 0x55
    w.write_bytes(bytes(data))
    with pytest.raises(PolicyLoadError, match=r"model.safetensors does not match the sha256 in policy.json"):
        load_policy(str(published), public_key=keys["public"])


def test_tampered_policy_json_is_refused(published, keys):
    # re-hash the weights into policy.json as an attacker would; latest.json re-pointed too
    _rewrite_spec(published, "v000002", iteration=999)
    _point_latest(published, "v000002")
    with pytest.raises(PolicyLoadError, match="signature does not verify"):
        load_policy(str(published), public_key=keys["public"])


def test_stripped_signature_is_refused(published, keys):
    (published / "v000002" / "policy.json.sig").unlink()
    with pytest.raises(PolicyLoadError, match="not signed"):
        load_policy(str(published), public_key=keys["public"])


def test_version_signed_by_another_key_is_refused(published, keys, tmp_path_factory):
    other_priv, _ = generate_keys(tmp_path_factory.mktemp("other"))
    space = gym.spaces.Discrete(2)
    publish(published, build_module("BC", space, seed=9), space, 3, load_private_key(other_priv))
    with pytest.raises(PolicyLoadError, match="another key signed it"):
        load_policy(str(published), public_key=keys["public"])


@pytest.mark.parametrize("path", ["../outside", "/etc", "v1", "v0000001", "v000002/../../x", "policies"])
def test_latest_pointing_outside_the_root_is_refused(published, keys, path):
    (published / "latest.json.sig").unlink()  # written by someone without the key
    (published / "latest.json").write_text(json.dumps({"policy_version": 2, "path": path}))
    with pytest.raises(PolicyLoadError, match=r"is not a version directory"):
        load_policy(str(published), public_key=keys["public"])


def test_latest_sha256_is_checked(published, keys):
    latest = json.loads((published / "latest.json").read_text())
    latest["sha256"] = "0" * 64
    (published / "latest.json.sig").unlink()
    (published / "latest.json").write_text(json.dumps(latest))
    with pytest.raises(PolicyLoadError, match=r"does not match the sha256 in latest\.json"):
        load_policy(str(published), public_key=keys["public"])


def test_older_version_republished_as_latest_is_refused(published, keys):
    p = load_policy(str(published), public_key=keys["public"])
    assert p.policy_version == 2
    # 1. the signed v1 copied into a new version directory: its signed policy.json says v1
    shutil.copytree(published / "v000001", published / "v000003")
    _point_latest(published, "v000003")
    with pytest.raises(PolicyLoadError, match="does not belong in v000003"):
        p.poll()
    with pytest.raises(PolicyLoadError, match="does not belong in v000003"):
        load_policy(str(published), public_key=keys["public"])
    # 2. latest.json pointed back at v1: poll() never moves to a lower version
    _point_latest(published, "v000001")
    with pytest.raises(PolicyLoadError, match="rollback refused"):
        p.poll()
    assert p.policy_version == 2


def test_poll_moves_to_a_newer_signed_version(published, keys):
    p = load_policy(str(published), version=1, public_key=keys["public"])
    _point_latest(published, "v000001")
    assert p.poll() is False
    _point_latest(published, "v000002")
    assert p.poll() is True and p.policy_version == 2
    assert p.lineage()["policy_version"] == 2


def test_torchscript_fallback_needs_a_signature_or_the_code_opt_in(tmp_path, keys, monkeypatch):
    """A module the spec cannot describe is published as TorchScript; it runs only when signed,
    or with allow_unsigned_code=True. Versions published without a spec (`model.pt` only) are TorchScript too."""
    from rlrec.trainer import export

    monkeypatch.setattr(export, "describe_module", lambda *a: (_ for _ in ()).throw(export.UndescribableModule("x")))
    space = gym.spaces.Discrete(2)
    module = build_module("BC", space)
    (tmp_path / "signed").mkdir()
    spec = publish(tmp_path / "signed", module, space, 1, keys["private"])
    assert spec["format"] == "torchscript"
    assert load_policy(str(tmp_path / "signed"), public_key=keys["public"]).signed
    (tmp_path / "unsigned").mkdir()
    publish(tmp_path / "unsigned", module, space, 1)
    with pytest.raises(PolicyLoadError, match=r"TorchScript.*allow_unsigned_code=True"):
        load_policy(str(tmp_path / "unsigned"), allow_unsigned=True)
    with pytest.warns(UnsignedPolicyWarning):
        assert load_policy(str(tmp_path / "unsigned"), allow_unsigned_code=True).policy_version == 1


def test_old_torchscript_artifacts_need_the_code_opt_in(tmp_path):
    """The layout published before signed, code-free artifacts (model.pt + model_sha256)."""
    import io

    class Net(torch.nn.Module):
        def forward(self, obs):
            return torch.stack([-obs[:, 2], obs[:, 2]], dim=1)

    buf = io.BytesIO()
    torch.jit.save(torch.jit.trace(Net(), torch.zeros(2, 4)), buf)
    d = tmp_path / "v000001"
    d.mkdir()
    (d / "model.pt").write_bytes(buf.getvalue())
    spec = {
        "policy_version": 1,
        "action_dist": "categorical",
        "action_space": {"type": "Discrete", "n": 2},
        "observation_shape": [4],
        "format": "torchscript",
        "model": "model.pt",
        "model_sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
    }
    (d / "policy.json").write_text(json.dumps(spec))
    (tmp_path / "latest.json").write_text(json.dumps({"policy_version": 1, "path": "v000001"}))
    with pytest.raises(PolicyLoadError, match="allow_unsigned_code=True"):
        load_policy(str(tmp_path), allow_unsigned=True)
    with pytest.warns(UnsignedPolicyWarning):
        p = load_policy(str(tmp_path), allow_unsigned_code=True)
    assert p.act(np.array([0, 0, 0.1, 0], np.float32))[0] == 1


def test_load_policy_imports_no_ray(published, keys):
    script = textwrap.dedent(f"""
        import importlib.abc, sys, time
        class NoRay(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "ray" or name.startswith("ray."):
                    raise ImportError("ray must not be imported")
        sys.meta_path.insert(0, NoRay())
        t0 = time.perf_counter()
        from rlrec import load_policy
        p = load_policy({str(published)!r}, public_key={str(keys["public"])!r})
        dt = time.perf_counter() - t0
        a, extra = p.act([0.0, 0.0, 0.1, 0.0])
        print(p.policy_version, p.signed, "ray" in sys.modules, round(dt, 3))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    version, signed, ray_loaded, _seconds = r.stdout.split()
    assert (version, signed, ray_loaded) == ("2", "True", "False")


@pytest.mark.parametrize("hostile", ["huge", "fifo", "nested", "symlink"])
def test_hostile_pointer_files_are_refused_before_they_are_read(published, keys, tmp_path_factory, hostile):
    """What an attacker with write access to the policies folder can put as latest.json: a file
    far over its size limit (sparse: no disk used), a FIFO (a read would block for ever), nesting
    that exhausts the parser's stack, a symlink to a file elsewhere. Each is a PolicyLoadError
    at once, and poll() keeps the version in use."""
    p = load_policy(str(published), public_key=keys["public"])
    latest = published / "latest.json"
    latest.unlink()
    if hostile == "huge":
        with open(latest, "wb") as f:
            f.truncate(768 * 1024 * 1024)
    elif hostile == "fifo":
        os.mkfifo(latest)
    elif hostile == "nested":
        latest.write_bytes(b"[" * 60_000)
    else:
        elsewhere = tmp_path_factory.mktemp("elsewhere") / "pointer.json"
        _point_latest(published, "v000002")
        os.replace(latest, elsewhere)
        os.symlink(elsewhere, latest)
    with pytest.raises(PolicyLoadError):
        load_policy(str(published), public_key=keys["public"])
    with pytest.raises(PolicyLoadError):
        p.poll()
    assert p.policy_version == 2
