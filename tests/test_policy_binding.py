"""Policy versions bound to what they are for, tested as an attacker with write access to the
policies folder but no signing key would try them (real files, one signing key shared by runs):

* a signed version (and its signed pointer) copied over from another run or channel;
* a signed ``Discrete(3)`` policy offered to a CartPole service;
* a replayed old pointer while a higher signed version exists, and, after deleting the higher
  version, a restart (the state file remembers);
* a pointer frozen in time (``max_pointer_age_s``);
* stripped, edited and hostile pointer files, signatures and headers (FIFOs, huge files,
  100k nested ``[``);
* versions published before run ids and channels: they load unpinned, and pinned never.

`poll()` refuses each with `PolicyLoadError` (logged, counted) and keeps the version in use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import time

import gymnasium as gym
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rlrec.store.storage import Storage  # noqa: E402
from rlrec.trainer.binding import pointer_bytes  # noqa: E402
from rlrec.trainer.export import PolicyArtifact, publish_policy, refresh_latest  # noqa: E402
from rlrec.trainer.policy import MAX_JSON_DEPTH, MAX_NEWER_VERSIONS, PolicyLoadError, load_policy  # noqa: E402
from rlrec.trainer.signing import generate_keys, load_private_key, sign, verify  # noqa: E402

CARTPOLE = gym.make("CartPole-v1")
OBS, ACT = CARTPOLE.observation_space, CARTPOLE.action_space
RUN_A, RUN_B, RUN_C = "a" * 32, "b" * 32, "c" * 32


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    priv, pub = generate_keys(tmp_path_factory.mktemp("keys"))
    return {"private": load_private_key(priv), "public": str(pub)}


def artifact(n_actions: int, seed: int) -> PolicyArtifact:
    """A one-layer categorical policy network (safetensors + spec), as `build_artifact` makes them."""
    from safetensors.torch import save

    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "layers.0.weight": torch.randn(n_actions, 4, generator=gen),
        "layers.0.bias": torch.randn(n_actions, generator=gen),
    }
    network = {"input_dim": 4, "layers": [{"type": "linear", "in": 4, "out": n_actions, "bias": True}]}
    network["log_std_clip"] = None
    return PolicyArtifact(
        "safetensors",
        {"model.safetensors": save(tensors, metadata={"format": "rlrec-policy"})},
        {
            "format": "safetensors",
            "model": "model.safetensors",
            "action_dist": {"type": "categorical", "n": n_actions},
            "network": network,
        },
        tensors=tensors,
    )


def publish(root, version, key, *, run_id=RUN_A, channel="prod", act=ACT, obs=OBS, seed=None) -> dict:
    """Publish `version` as `rlrec train` does (signed policy.json and pointer)."""
    return publish_policy(
        Storage.from_uri(str(root)),
        algo=None,
        version=version,
        algo_name="BC",
        observation_space=obs,
        action_space=act,
        iteration=version,
        timesteps_trained=0,
        shards=[],
        new_shards=[],
        parent_version=version - 1 or None,
        signing_key=key,
        artifact=artifact(int(act.n), version if seed is None else seed),
        run_id=run_id,
        channel=channel,
    )


def snapshot_pointer(root) -> tuple[bytes, bytes]:
    return (root / "latest.json").read_bytes(), (root / "latest.json.sig").read_bytes()


def restore_pointer(root, pointer: tuple[bytes, bytes]) -> None:
    (root / "latest.json").write_bytes(pointer[0])
    (root / "latest.json.sig").write_bytes(pointer[1])


def unsigned_pointer(root, version_dir: str, **extra) -> None:
    """A pointer written without the key (no latest.json.sig)."""
    (root / "latest.json.sig").unlink(missing_ok=True)
    sha = hashlib.sha256((root / version_dir / "policy.json").read_bytes()).hexdigest()
    doc = {"policy_version": int(version_dir[1:]), "path": version_dir, "sha256": sha, **extra}
    (root / "latest.json").write_text(json.dumps(doc))


def signed_pointer(root, version_dir: str, key, *, run_id=RUN_A, channel="prod", age_s: float = 0.0) -> None:
    """A pointer the trainer signed `age_s` seconds ago (how a frozen pointer looks)."""
    sha = hashlib.sha256((root / version_dir / "policy.json").read_bytes()).hexdigest()
    data = pointer_bytes(
        int(version_dir[1:]), version_dir, sha, run_id=run_id, channel=channel, now=time.time() - age_s
    )
    (root / "latest.json").write_bytes(data)
    (root / "latest.json.sig").write_bytes(sign(key, data))


@pytest.fixture
def prod(tmp_path, keys):
    """Run A on channel prod: v1..v3, CartPole spaces."""
    root = tmp_path / "prod"
    for v in (1, 2, 3):
        publish(root, v, keys["private"])
    return root


@contextlib.contextmanager
def deadline(seconds: int = 20):
    """Fail instead of hanging (a read of a FIFO would block for ever)."""

    def expired(*_):
        raise AssertionError(f"blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------ what is signed


def test_versions_and_the_pointer_are_signed_for_a_run_and_a_channel(prod, keys):
    spec = json.loads((prod / "v000003" / "policy.json").read_bytes())
    assert (spec["run_id"], spec["channel"]) == (RUN_A, "prod")
    data, sig = snapshot_pointer(prod)
    pointer = json.loads(data)
    assert pointer["policy_version"] == 3 and pointer["path"] == "v000003"
    assert (pointer["run_id"], pointer["channel"]) == (RUN_A, "prod")
    assert pointer["sha256"] == hashlib.sha256((prod / "v000003" / "policy.json").read_bytes()).hexdigest()
    assert abs(pointer["time"] - time.time()) < 60
    verify(keys["private"].public_key(), data, sig)  # over the exact bytes

    p = load_policy(
        str(prod),
        public_key=keys["public"],
        run_id=RUN_A,
        channel="prod",
        observation_space=OBS,
        action_space=ACT,
    )
    assert (p.policy_version, p.run_id, p.channel, p.signed) == (3, RUN_A, "prod", True)


def test_an_edited_signed_pointer_is_refused(prod, keys):
    doc = json.loads((prod / "latest.json").read_bytes())
    doc["time"] = time.time() + 10
    (prod / "latest.json").write_text(json.dumps(doc, sort_keys=True))  # the old signature kept
    with pytest.raises(PolicyLoadError, match=r"latest\.json: its signature \(latest\.json\.sig\) does not verify"):
        load_policy(str(prod), public_key=keys["public"])


# --------------------------------------------------------------------------------- cross-run


def test_a_version_from_another_run_with_the_same_key_is_refused(prod, tmp_path, keys, caplog):
    """Run B (staging, same key) published v7; its directory and signed pointer are copied into
    production. A service pinned to run A (or to channel prod) refuses it, and keeps v3."""
    staging = tmp_path / "staging"
    publish(staging, 7, keys["private"], run_id=RUN_B, channel="staging")
    by_run = load_policy(str(prod), public_key=keys["public"], run_id=RUN_A)
    by_channel = load_policy(str(prod), public_key=keys["public"], channel="prod")

    shutil.copytree(staging / "v000007", prod / "v000007")
    restore_pointer(prod, snapshot_pointer(staging))  # B's own signed pointer
    with pytest.raises(
        PolicyLoadError, match=rf"latest\.json is signed for run id '{RUN_B}', not the pinned '{RUN_A}'"
    ):
        load_policy(str(prod), public_key=keys["public"], run_id=RUN_A)
    with pytest.raises(PolicyLoadError, match=r"latest\.json is signed for channel 'staging', not the pinned 'prod'"):
        load_policy(str(prod), public_key=keys["public"], channel="prod")
    caplog.set_level(logging.WARNING, "rlrec.policy")
    with pytest.raises(PolicyLoadError, match=rf"signed for run id '{RUN_B}'"):
        by_run.poll()
    with pytest.raises(PolicyLoadError, match=r"signed for channel 'staging'"):
        by_channel.poll()
    assert (by_run.policy_version, by_run.run_id) == (3, RUN_A)
    assert (by_channel.policy_version, by_channel.channel, by_channel.refusals) == (3, "prod", 1)
    assert "policy poll refused, v3 stays in use" in caplog.text

    # an unsigned pointer to B's version: refused pinned, and unpinned too (B's version was
    # published with a signed pointer)
    unsigned_pointer(prod, "v000007")
    with pytest.raises(PolicyLoadError, match=r"latest\.json is not signed by the configured key"):
        load_policy(str(prod), public_key=keys["public"], channel="prod")
    with pytest.raises(PolicyLoadError, match=r"latest\.json is not signed, but v000007 was published with a signed"):
        load_policy(str(prod), public_key=keys["public"])
    with pytest.raises(PolicyLoadError, match=r"latest\.json is not signed by the configured key"):
        by_channel.poll()
    assert by_channel.policy_version == 3 and by_channel.refusals == 2


def test_an_explicit_version_of_another_run_is_refused(prod, tmp_path, keys):
    staging = tmp_path / "staging"
    publish(staging, 4, keys["private"], run_id=RUN_B, channel="staging")
    shutil.copytree(staging / "v000004", prod / "v000004")
    with pytest.raises(PolicyLoadError, match=rf"v000004 is signed for run id '{RUN_B}', not the pinned '{RUN_A}'"):
        load_policy(str(prod), version=4, public_key=keys["public"], run_id=RUN_A)
    with pytest.raises(PolicyLoadError, match=r"v000004 is signed for channel 'staging', not the pinned 'prod'"):
        load_policy(str(prod), version=4, public_key=keys["public"], channel="prod")


# ----------------------------------------------------------------------------------- spaces


def test_a_signed_policy_for_other_spaces_is_refused(tmp_path, keys):
    """A third run's signed Discrete(3) policy, offered to a CartPole service (Discrete(2))."""
    root = tmp_path / "root"
    publish(root, 1, keys["private"], run_id=RUN_C, channel="prod", act=gym.spaces.Discrete(3))
    with pytest.raises(PolicyLoadError, match=r"v000001 is for action space .*\"n\":3.* not the service's .*\"n\":2"):
        load_policy(str(root), public_key=keys["public"], observation_space=OBS, action_space=ACT)

    other = tmp_path / "other"
    publish(other, 1, keys["private"], obs=gym.spaces.Box(-1.0, 1.0, (4,), np.float32))
    with pytest.raises(PolicyLoadError, match=r"v000001 is for observation space"):
        load_policy(str(other), public_key=keys["public"], observation_space=OBS, action_space=ACT)

    # a running CartPole service keeps its version and never emits action 2
    service = tmp_path / "service"
    publish(service, 1, keys["private"])
    p = load_policy(str(service), public_key=keys["public"], observation_space=OBS, action_space=ACT)
    publish(service, 2, keys["private"], act=gym.spaces.Discrete(3))
    with pytest.raises(PolicyLoadError, match=r"v000002 is for action space"):
        p.poll()
    assert p.policy_version == 1
    obs = np.random.default_rng(0).normal(0, 1, (200, 4)).astype(np.float32)
    assert set(p.greedy_env_actions(obs).tolist()) <= {0, 1}
    # the same spaces as JSON (what policy.json holds) pin the same way
    q = load_policy(
        str(service),
        version=1,
        public_key=keys["public"],
        action_space={"type": "Discrete", "n": 2, "start": 0, "dtype": "int64"},
    )
    assert q.policy_version == 1


# ---------------------------------------------------------------------- rollback and restarts


def test_a_replayed_old_pointer_is_refused(tmp_path, keys):
    root = tmp_path / "root"
    publish(root, 1, keys["private"])
    v1_pointer = snapshot_pointer(root)
    for v in (2, 3):
        publish(root, v, keys["private"])
    p = load_policy(str(root), public_key=keys["public"])
    assert p.policy_version == 3

    restore_pointer(root, v1_pointer)  # signed, genuine, old
    with pytest.raises(PolicyLoadError, match=r"latest\.json names v000001, but v000003, signed for the same channel"):
        load_policy(str(root), public_key=keys["public"])
    with pytest.raises(PolicyLoadError, match=r"names v1, older than v3 in use: rollback refused"):
        p.poll()
    unsigned_pointer(root, "v000001")  # the same with a pointer written without the key
    with pytest.raises(PolicyLoadError, match=r"latest\.json is not signed, but v000001 was published with a signed"):
        load_policy(str(root), public_key=keys["public"])
    assert p.policy_version == 3

    # a higher version of another channel, or an unsigned one, does not make a pointer a replay
    shutil.rmtree(root / "v000002")
    shutil.rmtree(root / "v000003")
    publish(tmp_path / "b", 9, keys["private"], channel="prod")
    shutil.copytree(tmp_path / "b" / "v000009", root / "v000009")
    (root / "v000009" / "policy.json.sig").unlink()
    publish(tmp_path / "c", 8, keys["private"], run_id=RUN_C, channel="staging")
    shutil.copytree(tmp_path / "c" / "v000008", root / "v000008")
    restore_pointer(root, v1_pointer)
    assert load_policy(str(root), public_key=keys["public"]).policy_version == 1
    # a newer run that took the channel over: its version counts (an old run's pointer is a replay)
    publish(tmp_path / "d", 7, keys["private"], run_id=RUN_B, channel="prod")
    shutil.copytree(tmp_path / "d" / "v000007", root / "v000007")
    with pytest.raises(PolicyLoadError, match=r"names v000001, but v000007, signed for the same channel"):
        load_policy(str(root), public_key=keys["public"])


def test_the_state_file_refuses_older_versions_across_restarts(tmp_path, keys):
    root, state = tmp_path / "root", tmp_path / "svc" / "policy-state.json"
    publish(root, 1, keys["private"])
    v1_pointer = snapshot_pointer(root)
    publish(root, 2, keys["private"])
    p = load_policy(str(root), public_key=keys["public"], state_file=state)
    assert json.loads(state.read_bytes())["policy_version"] == 2
    publish(root, 3, keys["private"])
    assert p.poll() is True and p.policy_version == 3
    assert json.loads(state.read_bytes()) | {"time": 0} == {
        "policy_version": 3,
        "run_id": RUN_A,
        "channel": "prod",
        "sha256": json.loads((root / "latest.json").read_bytes())["sha256"],
        "time": 0,
    }
    assert os.listdir(state.parent) == ["policy-state.json"]  # written atomically: no temporary left

    # "restart": v2 and v3 are deleted and v1's genuine signed pointer is put back
    shutil.rmtree(root / "v000002")
    shutil.rmtree(root / "v000003")
    restore_pointer(root, v1_pointer)
    with pytest.raises(PolicyLoadError, match=r"v000001 is older than v000003, which this service has loaded before"):
        load_policy(str(root), public_key=keys["public"], state_file=state)
    with pytest.raises(PolicyLoadError, match=r"v000001 is older than v000003"):
        load_policy(str(root), version=1, public_key=keys["public"], state_file=state)
    # without its state file the same service would have gone back to v1
    assert load_policy(str(root), public_key=keys["public"]).policy_version == 1
    assert json.loads(state.read_bytes())["policy_version"] == 3


def test_a_hostile_state_file_is_refused(prod, tmp_path, keys):
    state = tmp_path / "state.json"
    state.write_bytes(b"[" * 60_000)
    with pytest.raises(PolicyLoadError, match=rf"state file .* nested 60000 deep, over the limit of {MAX_JSON_DEPTH}"):
        load_policy(str(prod), public_key=keys["public"], state_file=state)
    state.write_text('{"policy_version": "3"}')
    with pytest.raises(PolicyLoadError, match=r"holds no policy_version"):
        load_policy(str(prod), public_key=keys["public"], state_file=state)
    state.unlink()
    os.mkfifo(state)
    with deadline(), pytest.raises(PolicyLoadError, match=r"is not a regular file"):
        load_policy(str(prod), public_key=keys["public"], state_file=state)


# ---------------------------------------------------------------------------------- freezing


def test_a_stale_pointer_is_reported_and_never_followed(tmp_path, keys, caplog):
    root = tmp_path / "root"
    for v in (1, 2):
        publish(root, v, keys["private"])
    signed_pointer(root, "v000002", keys["private"], age_s=3600)
    with pytest.raises(PolicyLoadError, match=r"latest\.json \(v2\) is 3600 s old, over max_pointer_age_s=60"):
        load_policy(str(root), public_key=keys["public"], max_pointer_age_s=60)
    assert load_policy(str(root), public_key=keys["public"]).policy_version == 2  # no age configured

    signed_pointer(root, "v000002", keys["private"])
    p = load_policy(str(root), public_key=keys["public"], max_pointer_age_s=60)
    assert p.policy_version == 2 and not p.stale_pointer
    caplog.set_level(logging.WARNING, "rlrec.policy")
    publish(root, 3, keys["private"])
    signed_pointer(root, "v000003", keys["private"], age_s=3600)  # a newer version, but a frozen pointer
    assert p.poll() is False and p.poll() is False
    assert (p.policy_version, p.stale_pointer, p.stale_pointers) == (2, True, 2)
    assert caplog.text.count("stale policy pointer, v2 stays in use") == 1
    unsigned_pointer(root, "v000003", time=time.time())  # a fresh time, but nobody signed it
    assert p.poll() is False and p.stale_pointers == 3

    # the trainer re-signs the pointer while it publishes nothing new
    storage = Storage.from_uri(str(root))
    assert refresh_latest(storage, version=3, run_id=RUN_A, channel="prod", signing_key=keys["private"])
    assert p.poll() is True and (p.policy_version, p.stale_pointer) == (3, False)
    # another run of this key and channel (a fresh run while v3 stays deployed) re-signs it too,
    # keeping v3's run id; another channel's run does not
    assert refresh_latest(storage, version=3, run_id=RUN_B, channel="prod", signing_key=keys["private"])
    assert json.loads((root / "latest.json").read_bytes())["run_id"] == RUN_A
    assert not refresh_latest(storage, version=3, run_id=RUN_B, channel="staging", signing_key=keys["private"])


# ------------------------------------------------------------------------- older publications


def test_versions_published_before_bindings_load_unpinned_only(tmp_path, keys):
    """policy.json without run id or channel, latest.json unsigned (as published before)."""
    root = tmp_path / "root"
    for v in (1, 2):
        publish(root, v, keys["private"], run_id=None, channel=None)
    unsigned_pointer(root, "v000002", time=time.time())
    spec = json.loads((root / "v000002" / "policy.json").read_bytes())
    assert "run_id" not in spec and "channel" not in spec
    p = load_policy(str(root), public_key=keys["public"], observation_space=OBS, action_space=ACT)
    assert (p.policy_version, p.signed, p.run_id, p.channel) == (2, True, None, None)
    with pytest.raises(
        PolicyLoadError, match=r"latest\.json is not signed by the configured key \(latest\.json\.sig\)"
    ):
        load_policy(str(root), public_key=keys["public"], channel="prod")
    with pytest.raises(PolicyLoadError, match=r"v000002 carries no channel \(published before versions were bound\)"):
        load_policy(str(root), version=2, public_key=keys["public"], channel="prod")
    with pytest.raises(PolicyLoadError, match=r"v000001 carries no run id"):
        load_policy(str(root), version=1, public_key=keys["public"], run_id=RUN_A)
    # a replayed old pointer is refused for them too
    unsigned_pointer(root, "v000001")
    with pytest.raises(PolicyLoadError, match=r"names v000001, but v000002, signed for the same channel"):
        load_policy(str(root), public_key=keys["public"])


def test_pins_need_a_signature(tmp_path, monkeypatch):
    monkeypatch.delenv("RLREC_POLICY_PUBLIC_KEY", raising=False)
    root = tmp_path / "root"
    publish(root, 1, None)
    with pytest.warns(UserWarning):
        assert load_policy(str(root), allow_unsigned=True).channel == "prod"
    with pytest.raises(PolicyLoadError, match=r"latest\.json is not signed by the configured key"):
        load_policy(str(root), allow_unsigned=True, channel="prod")
    with pytest.raises(PolicyLoadError, match=r"bad pin: channel '../x' must match"):
        load_policy(str(root), allow_unsigned=True, channel="../x")


# --------------------------------------------------------------------------- bounded reads


@pytest.mark.parametrize(
    ("target", "hostile", "message"),
    [
        ("latest.json.sig", "fifo", r"latest\.json\.sig is not a regular file"),
        ("latest.json.sig", "huge", r"latest\.json\.sig holds 1073741824 bytes, over its limit of 4096"),
        ("v000003/policy.json", "fifo", r"v000003/policy\.json is not a regular file"),
        ("v000003/policy.json.sig", "fifo", r"v000003/policy\.json\.sig is not a regular file"),
        ("v000003/policy.json", "huge", r"v000003/policy\.json holds 1073741824 bytes"),
        ("latest.json", "nested", rf"latest\.json is nested 60000 deep, over the limit of {MAX_JSON_DEPTH}"),
        ("latest.json", "fifo", r"latest\.json is not a regular file"),
    ],
)
def test_hostile_files_are_refused_without_blocking(prod, keys, target, hostile, message):
    p = load_policy(str(prod), public_key=keys["public"], version=2)
    path = prod / target
    path.unlink()
    if target == "latest.json":
        (prod / "latest.json.sig").unlink()  # the pointer is rewritten without the key
    if hostile == "fifo":
        os.mkfifo(path)
    elif hostile == "huge":
        with open(path, "wb") as f:
            f.truncate(1 << 30)  # sparse
    else:
        path.write_bytes(b"[" * 60_000)  # within the size limit of latest.json
    with deadline(), pytest.raises(PolicyLoadError, match=message):
        load_policy(str(prod), public_key=keys["public"])
    with deadline(), pytest.raises(PolicyLoadError, match=message):
        p.poll()
    assert p.policy_version == 2


def test_a_hostile_higher_version_does_not_block_the_replay_check(prod, keys):
    """Directories above the pointed version are read for the replay check: FIFOs and junk there are skipped."""
    (prod / "v000009").mkdir()
    os.mkfifo(prod / "v000009" / "policy.json")
    (prod / "v000008").mkdir()
    (prod / "v000008" / "policy.json").write_bytes(b"[" * 100_000)
    (prod / "v000008" / "policy.json.sig").write_bytes(b"x" * 64)
    with deadline():
        assert load_policy(str(prod), public_key=keys["public"]).policy_version == 3
    for v in range(10, 10 + MAX_NEWER_VERSIONS):  # more than are checked: refused, not read one by one
        (prod / f"v{v:06d}").mkdir()
    with pytest.raises(
        PolicyLoadError, match=rf"102 version directories above v000003, over the limit of {MAX_NEWER_VERSIONS}"
    ):
        load_policy(str(prod), public_key=keys["public"])


def test_a_hostile_safetensors_header_is_refused_before_parsing(tmp_path, keys):
    """An unsigned version (allow_unsigned) whose weights claim a huge header, or nest deeply."""
    root = tmp_path / "root"
    publish(root, 1, None, run_id=None, channel=None)
    for body, message in [
        ((1 << 40).to_bytes(8, "little") + b"{}", r"its safetensors header claims 1099511627776 bytes"),
        ((100_000).to_bytes(8, "little") + b"[" * 100_000, r"safetensors header\) is nested 100000 deep"),
    ]:
        (root / "v000001" / "model.safetensors").write_bytes(body)
        spec = json.loads((root / "v000001" / "policy.json").read_bytes())
        spec["files"]["model.safetensors"] = hashlib.sha256(body).hexdigest()
        (root / "v000001" / "policy.json").write_text(json.dumps(spec))
        unsigned_pointer(root, "v000001")
        with pytest.warns(UserWarning), pytest.raises(PolicyLoadError, match=message):
            load_policy(str(root), allow_unsigned=True)


def test_a_deeply_nested_policy_json_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("RLREC_POLICY_PUBLIC_KEY", raising=False)
    root = tmp_path / "root"
    publish(root, 1, None, run_id=None, channel=None)
    (root / "v000001" / "policy.json").write_bytes(b"[" * 100_000)
    unsigned_pointer(root, "v000001")
    with pytest.raises(
        PolicyLoadError, match=rf"v000001/policy\.json is nested 100000 deep, over the limit of {MAX_JSON_DEPTH}"
    ):
        load_policy(str(root), allow_unsigned=True)


# ------------------------------------------------------------------------------ the trainer


class _FakeLearnerGroup:
    def restore_from_path(self, path: str) -> None:
        pass


class _FakeAlgo:
    """What `ContinuousTrainer.checkpoint` touches of an RLlib Algorithm (no Ray)."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.config = SimpleNamespace(gamma=0.99)
        self.learner_group = _FakeLearnerGroup()

    def save_to_path(self, path: str) -> None:
        os.makedirs(os.path.join(path, "learner_group"), exist_ok=True)
        with open(os.path.join(path, "learner_group", "weights"), "wb") as f:
            f.write(b"w")


def _trainer(tmp_path, keys_dir, monkeypatch, *, resume: bool, gate_rejects: bool = False, **kw):
    from rlrec.trainer import export
    from rlrec.trainer.config import TrainerConfig
    from rlrec.trainer.service import ContinuousTrainer

    monkeypatch.setattr(export, "_module_from_algo", lambda algo: None)
    monkeypatch.setattr(export, "build_artifact", lambda module, obs, act: artifact(2, 0))
    kw.setdefault("promotion_gate", "off")  # every checkpoint's policy published (the default gates them)
    cfg = TrainerConfig(
        input=str(tmp_path / "in"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        signing_key=str(keys_dir / "policy-signing.key"),
        resume=resume,
        **kw,
    )
    t = ContinuousTrainer(cfg)
    t.algo, t.obs_space, t.act_space = _FakeAlgo(), OBS, ACT
    if gate_rejects:
        monkeypatch.setattr(t, "publish", lambda final=False: None)
    return t


def test_the_trainer_keeps_its_run_id_across_resume_and_refreshes_the_pointer(tmp_path, monkeypatch):
    from types import SimpleNamespace

    keys_dir = tmp_path / "keys"
    generate_keys(keys_dir)
    pub = str(keys_dir / "policy-signing.pub")
    first = _trainer(tmp_path, keys_dir, monkeypatch, resume=False, policy_id="cartpole")
    first.iteration = 3
    first.checkpoint()
    run_id = first.run_id
    assert run_id and len(run_id) == 32
    p = load_policy(str(tmp_path / "ckpt"), public_key=pub, run_id=run_id, channel="cartpole")
    assert (p.policy_version, p.run_id, p.channel) == (1, run_id, "cartpole")  # channel: the policy id

    second = _trainer(tmp_path, keys_dir, monkeypatch, resume=True, policy_id="cartpole")
    second.metrics = SimpleNamespace(truncate_after=lambda _i: None)
    assert second._restore(second._resume_point())
    assert second.run_id == run_id and second.policy_version == 1
    second.iteration = 6
    second.checkpoint()
    assert p.poll() is True and (p.policy_version, p.run_id) == (2, run_id)

    # nothing new published (the promotion gate kept v2): the pointer is re-signed with a new time
    third = _trainer(tmp_path, keys_dir, monkeypatch, resume=True, gate_rejects=True, policy_id="cartpole")
    third.metrics = SimpleNamespace(truncate_after=lambda _i: None)
    third._restore(third._resume_point())
    before = json.loads((tmp_path / "ckpt" / "policies" / "latest.json").read_bytes())["time"]
    time.sleep(0.01)
    third.iteration = 9
    third.checkpoint()
    after = json.loads((tmp_path / "ckpt" / "policies" / "latest.json").read_bytes())
    assert after["policy_version"] == 2 and after["time"] > before
    assert load_policy(str(tmp_path / "ckpt"), public_key=pub, run_id=run_id, max_pointer_age_s=60).policy_version == 2


def test_the_channel_option(tmp_path):
    from rlrec.trainer.config import TrainerConfig

    base = {"input": str(tmp_path), "checkpoint_dir": str(tmp_path)}
    assert TrainerConfig(**base).publish_channel == "default"
    assert TrainerConfig(**base, policy_id="cartpole").publish_channel == "cartpole"
    assert TrainerConfig(**base, policy_id="cartpole", channel="prod").publish_channel == "prod"
    with pytest.raises(ValueError, match=r"--channel '../prod' must match"):
        TrainerConfig(**base, channel="../prod")


# --------------------------------------------------------------------------------- rollback


def test_a_rollback_is_a_new_publication(prod, keys, tmp_path):
    from rlrec.trainer.export import highest_version, republish_policy

    storage = Storage.from_uri(str(prod))
    state = tmp_path / "state.json"
    p = load_policy(str(prod), public_key=keys["public"], channel="prod", state_file=state)
    assert p.policy_version == 3
    spec = republish_policy(storage, version=1, signing_key=keys["private"])
    assert (spec["policy_version"], spec["republished_from"], spec["run_id"], spec["channel"]) == (4, 1, RUN_A, "prod")
    assert p.poll() is True and p.policy_version == 4
    obs = np.random.default_rng(0).normal(0, 1, (64, 4)).astype(np.float32)
    v1 = load_policy(str(prod), version=1, public_key=keys["public"])
    np.testing.assert_array_equal(p.action_dist_inputs(obs), v1.action_dist_inputs(obs))  # v1's weights
    assert json.loads(state.read_bytes())["policy_version"] == 4
    assert highest_version(storage, keys["private"]) == 4
    with pytest.raises(ValueError, match=r"the new version must be above v4, got v2"):
        republish_policy(storage, version=1, new_version=2, signing_key=keys["private"])
    # the trainer's pointer refresh leaves the rollback alone
    assert not refresh_latest(storage, version=3, run_id=RUN_A, channel="prod", signing_key=keys["private"])
    assert json.loads((prod / "latest.json").read_bytes())["policy_version"] == 4
    # junk or unsigned directories do not count as published versions
    (prod / "v000090").mkdir()
    assert highest_version(storage, keys["private"]) == 4


def test_a_trainer_publishes_above_the_versions_present(tmp_path, monkeypatch):
    keys_dir = tmp_path / "keys"
    generate_keys(keys_dir)
    key = load_private_key(keys_dir / "policy-signing.key")
    publish(tmp_path / "ckpt" / "policies", 5, key, run_id=RUN_B, channel="default")
    t = _trainer(tmp_path, keys_dir, monkeypatch, resume=False)
    t.iteration = 3
    t.checkpoint()
    assert t.policy_version == 6
    p = load_policy(str(tmp_path / "ckpt"), public_key=str(keys_dir / "policy-signing.pub"), channel="default")
    assert (p.policy_version, p.run_id) == (6, t.run_id) and t.run_id != RUN_B


def test_hostile_files_do_not_block_the_trainer(prod, keys):
    """The trainer reads its publish root too (the highest version, the pointer it refreshes)."""
    from rlrec.trainer.export import highest_version

    storage = Storage.from_uri(str(prod))
    (prod / "v000009").mkdir()
    os.mkfifo(prod / "v000009" / "policy.json")
    (prod / "v000008").mkdir()
    (prod / "v000008" / "policy.json").write_bytes(b"[" * 100_000)
    (prod / "v000008" / "policy.json.sig").write_bytes(b"x" * 64)
    with deadline():
        assert highest_version(storage, keys["private"]) == 3
    (prod / "latest.json").unlink()
    os.mkfifo(prod / "latest.json")
    with deadline():
        assert not refresh_latest(storage, version=3, run_id=RUN_A, channel="prod", signing_key=keys["private"])
