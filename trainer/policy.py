"""Published policies: verifying, loading and acting with torch only (never Ray).

Layout written by the trainer (`rlrec.trainer.export.publish_policy`) under the publish root
(default ``{checkpoint_dir}/policies``)::

    latest.json              {"policy_version": N, "path": "v00000N", "sha256": <sha256 of its policy.json>}
    v00000N/policy.json      the spec: artifact_version 2, policy_version N, directory "v00000N",
                             format ("safetensors" or "torchscript"), network (layer sizes,
                             activations, log-std clipping), action_dist, spaces, and "files":
                             the sha256 of every other file of the version
    v00000N/policy.json.sig  Ed25519 signature over the exact bytes of policy.json (when the
                             trainer has a signing key: `rlrec train --signing-key PATH`)
    v00000N/model.safetensors  the weights (tensors only) -- or model.pt (TorchScript) for module
                             configurations the spec cannot describe
    v00000N/lineage.json     the shards this version was trained on

`latest.json` is written last, so a reader never sees a half-published version.

Trust rules of `load_policy` (docs/TRAINER.md, "Published policies"): with a public key
(``public_key=`` or the file named by ``RLREC_POLICY_PUBLIC_KEY``) ``policy.json.sig`` is verified
before anything else of the version is read; then every file is checked against the sha256 in
the signed ``policy.json``, and a version whose directory or number disagrees with its
``policy.json`` is refused. Unsigned versions load only with ``allow_unsigned=True`` (safetensors;
warned), TorchScript only when signed or with ``allow_unsigned_code=True`` (warned: TorchScript is
code and can read and write files). ``latest.json``'s ``path`` must match ``^v\\d{6}$`` and its
sha256 must match; `Policy.poll` never moves to a lower version. The weights are rebuilt in plain
torch from the spec (`rlrec.trainer.policy_net`): no ``torch.jit.load``, no pickle.

Only this module, `rlrec.trainer.policy_net`, `rlrec.trainer.signing`, numpy, json, torch,
safetensors and cryptography are imported; URIs other than local paths use pyarrow's
filesystems (lazily).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
import stat
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlrec.trainer.policy_net import NetworkSpecError, PolicyDistribution, build_network
from rlrec.trainer.signing import PUBLIC_KEY_ENV, SIG_SUFFIX, SignatureError, load_public_key, verify

__all__ = [
    "ARTIFACT_VERSION",
    "Policy",
    "PolicyLoadError",
    "UnsignedPolicyWarning",
    "load_policy",
    "read_latest",
    "version_dir",
]

log = logging.getLogger("rlrec.policy")

LATEST = "latest.json"
SPEC = "policy.json"
SAFETENSORS_MODEL = "model.safetensors"
TORCHSCRIPT_MODEL = "model.pt"
MODEL = TORCHSCRIPT_MODEL  # the only model file of artifacts published before artifact_version 2
LINEAGE = "lineage.json"
ARTIFACT_VERSION = 2
VERSION_DIR_RE = re.compile(r"^v\d{6}$")
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

#: what a loader reads of each file at most, checked before reading (a larger file is refused):
#: the pointer, the spec and its signature are small JSON; the weights of a policy network
MAX_BYTES = {
    LATEST: 64 * 1024,
    SPEC: 1024 * 1024,
    "sig": 4 * 1024,
    LINEAGE: 16 * 1024 * 1024,
    "model": 1024 * 1024 * 1024,
}


class PolicyLoadError(RuntimeError):
    """A published policy is missing, incomplete, tampered with, unsigned or not trusted."""


class UnsignedPolicyWarning(UserWarning):
    """A policy version was loaded without a verified signature (allow_unsigned / allow_unsigned_code)."""


def version_dir(version: int) -> str:
    """``v000042``: the directory of a policy version (1 .. 999999)."""
    if type(version) is not int or not 1 <= version <= 999_999:
        raise ValueError(f"a policy version is an integer in 1..999999, got {version!r}")
    return f"v{version:06d}"


# --------------------------------------------------------------------------------- storage


class _Files:
    """Read files under a root: a local directory or a pyarrow filesystem URI."""

    def __init__(self, root: str) -> None:
        root = os.fspath(root)
        if root.startswith("file://"):
            root = root[len("file://") :]
        self.local = "://" not in root
        if self.local:
            self.root = os.path.abspath(os.path.expanduser(root))
            self.fs = None
        else:
            import pyarrow.fs as pafs  # only for object stores

            self.fs, self.root = pafs.FileSystem.from_uri(root)
            self.root = self.root.rstrip("/")

    def read(self, rel: str, max_bytes: int) -> bytes:
        """The content of the regular file `rel`, refused (PolicyLoadError) before reading if it
        is larger than `max_bytes`, a symlink or not a regular file (a FIFO would block)."""
        if self.local:
            try:
                fd = os.open(os.path.join(self.root, *rel.split("/")), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise PolicyLoadError(f"{rel} is a symlink: refused") from None
                raise
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise PolicyLoadError(f"{rel} is not a regular file: refused")
                if st.st_size > max_bytes:
                    raise PolicyLoadError(f"{rel} holds {st.st_size} bytes, over its limit of {max_bytes}: refused")
                data = f.read(max_bytes + 1)
        else:
            import pyarrow.fs as pafs

            path = f"{self.root}/{rel}"
            try:
                info = self.fs.get_file_info(path)
                if info.type == pafs.FileType.NotFound:
                    raise FileNotFoundError(rel)
                if info.type != pafs.FileType.File:
                    raise PolicyLoadError(f"{rel} is not a file: refused")
                if info.size is not None and info.size > max_bytes:
                    raise PolicyLoadError(f"{rel} holds {info.size} bytes, over its limit of {max_bytes}: refused")
                with self.fs.open_input_stream(path) as f:
                    data = f.read(max_bytes + 1)
            except OSError as e:
                if isinstance(e, FileNotFoundError) or "not found" in str(e).lower() or "no such" in str(e).lower():
                    raise FileNotFoundError(rel) from None
                raise
        if len(data) > max_bytes:  # grew while being read
            raise PolicyLoadError(f"{rel} holds more than its limit of {max_bytes} bytes: refused")
        return data

    def exists(self, rel: str) -> bool:
        if self.local:
            return os.path.exists(os.path.join(self.root, *rel.split("/")))
        import pyarrow.fs as pafs

        return self.fs.get_file_info(f"{self.root}/{rel}").type != pafs.FileType.NotFound


def _json(data: bytes, what: str) -> Any:
    """Parse a small JSON file; every failure (bad JSON, nesting deep enough to exhaust the
    stack) is a PolicyLoadError."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise PolicyLoadError(f"{what} is not usable JSON: {type(e).__name__}: {str(e)[:200]}") from None


def _parse_latest(data: bytes) -> dict:
    latest = _json(data, LATEST)
    if not isinstance(latest, dict):
        raise PolicyLoadError(f"{LATEST} must be a JSON object")
    path, version = latest.get("path"), latest.get("policy_version")
    if not isinstance(path, str) or not VERSION_DIR_RE.match(path):
        raise PolicyLoadError(f"{LATEST}: path {path!r:.80} is not a version directory (^v\\d{{6}}$)")
    if type(version) is not int or version != int(path[1:]):
        raise PolicyLoadError(f"{LATEST}: policy_version {version!r:.40} does not name directory {path}")
    sha = latest.get("sha256")
    if sha is not None and (not isinstance(sha, str) or not _SHA256_RE.match(sha)):
        raise PolicyLoadError(f"{LATEST}: sha256 {sha!r:.80} is not a sha256")
    return latest


def read_latest(root: str) -> dict:
    """The checked ``latest.json`` pointer of a publish root (FileNotFoundError if nothing is published)."""
    return _parse_latest(_Files(root).read(LATEST, MAX_BYTES[LATEST]))


# ------------------------------------------------------------------------------- trust


@dataclass(frozen=True)
class _Trust:
    """What a loader accepts: the public key (None: none configured) and the two opt-ins."""

    public_key: Any
    allow_unsigned: bool
    allow_unsigned_code: bool


def _trust(public_key: Any, allow_unsigned: bool, allow_unsigned_code: bool) -> _Trust:
    if public_key is None:
        public_key = os.environ.get(PUBLIC_KEY_ENV) or None
    key = None
    if public_key is not None:
        try:
            key = load_public_key(public_key)
        except SignatureError as e:
            raise PolicyLoadError(f"the configured public key cannot be used: {e}") from None
    return _Trust(key, bool(allow_unsigned), bool(allow_unsigned_code))


def _legacy_dist(spec: dict) -> dict:
    """The action distribution of an artifact published before artifact_version 2 (a name)."""
    name, space = spec.get("action_dist"), spec.get("action_space") or {}
    if name == "categorical":
        return {"type": "categorical", "n": int(space.get("n", 0))}
    dim = int(np.prod(space.get("shape", [0])))
    if name == "squashed_gaussian":
        return {"type": name, "dim": dim, "log_std_min": -5.0, "log_std_max": 2.0, "small_number": 1e-6}
    return {"type": str(name), "dim": dim}


class _LoadedVersion:
    """One verified, loaded version: its spec, network (obs batch -> action distribution inputs),
    action distribution and whether its signature was verified."""

    def __init__(self, spec: dict, network: Any, dist: PolicyDistribution, signed: bool, files: dict) -> None:
        self.spec = spec
        self.network = network
        self.dist = dist
        self.signed = signed
        self.files = files  # name -> sha256 (from the verified policy.json)
        self.version = int(spec["policy_version"])
        self.obs_shape = tuple(spec["observation_shape"])
        self.input_shape = (
            (int(spec["network"]["input_dim"]),) if spec.get("format") == "safetensors" else self.obs_shape
        )

    def forward(self, obs: np.ndarray) -> Any:
        import torch

        x = np.asarray(obs, dtype=np.float32).reshape((-1, *self.input_shape))
        with torch.no_grad():
            return self.network(torch.as_tensor(x))

    def act(self, obs: Any, explore: bool, generator: Any) -> tuple[Any, dict]:
        inputs = self.forward(obs)
        if explore:
            a = self.dist.sample(inputs, generator)
            logp = np.float32(self.dist.logp(inputs, a)[0])
        else:  # a deterministic choice: the action's propensity is 1
            a = self.dist.greedy(inputs)
            logp = np.float32(0.0)
        return self.dist.to_env(a[0].numpy()), {
            "action_dist_inputs": inputs[0].numpy().astype(np.float32),
            "action_logp": logp,
        }

    # -- what off-policy evaluation needs (rlrec.trainer.ope.PolicyTarget)
    def action_probs(self, obs_batch: Any) -> np.ndarray:
        """Categorical policies: every action's probability per observation, ``(B, n)`` float64.

        Args:
            obs_batch: ``(B, *observation_shape)`` observations.

        Raises:
            ValueError: the policy's actions are not categorical.

        Example:
            >>> version.action_probs(obs_batch).sum(-1)  # doctest: +SKIP
            array([1., 1.])
        """
        import torch

        m = self
        if m.dist.kind != "categorical":
            raise ValueError(f"action_probs needs a categorical policy, this one is {m.dist.kind}")
        return torch.softmax(m.forward(obs_batch).double(), dim=-1).numpy()

    def logp_env(self, obs_batch: Any, actions: Any) -> np.ndarray:
        """Log-probability of `actions` given in env units (as episodes record them) under the
        exploring policy, ``(B,)`` float64 (`logp` takes distribution units; for a squashed
        Gaussian this maps the bounds back to [-1, 1] first).

        Args:
            obs_batch: ``(B, *observation_shape)`` observations.
            actions: ``(B,)`` or ``(B, *action_shape)`` actions as the environment took them.

        Example:
            >>> version.logp_env(obs_batch, episode_actions)  # doctest: +SKIP
        """
        import torch

        m = self
        a = torch.as_tensor(m.dist.from_env(np.asarray(actions)))
        return m.dist.logp(m.forward(obs_batch), a).double().numpy()

    def sample_env_actions(self, obs_batch: Any, n: int, seed: int = 0) -> np.ndarray:
        """`n` exploring actions per observation in env units, ``(B, n, *action_shape)``.

        Args:
            obs_batch: ``(B, *observation_shape)`` observations.
            n: samples per observation.
            seed: the sampling seed.

        Example:
            >>> version.sample_env_actions(obs_batch, 8).shape  # doctest: +SKIP
            (2, 8, 1)
        """
        import torch

        m = self
        inputs = m.forward(obs_batch)
        gen = torch.Generator().manual_seed(int(seed))
        draws = [m.dist.to_env_batch(m.dist.sample(inputs, gen).numpy()) for _ in range(int(n))]
        return np.stack(draws, axis=1)

    def greedy_env_actions(self, obs_batch: Any) -> np.ndarray:
        """The action ``act(obs, explore=False)`` takes for each observation, in env units.

        Args:
            obs_batch: ``(B, *observation_shape)`` observations.

        Example:
            >>> version.greedy_env_actions(obs_batch)  # doctest: +SKIP
            array([1, 0])
        """
        m = self
        return m.dist.to_env_batch(m.dist.greedy(m.forward(obs_batch)).numpy())


def _read_required(files: _Files, rel: str, rel_dir: str, max_bytes: int) -> bytes:
    try:
        return files.read(rel, max_bytes)
    except FileNotFoundError:
        raise PolicyLoadError(f"published policy {rel_dir} is incomplete: {rel} is missing") from None


def _verify_signature(files: _Files, rel_dir: str, spec_bytes: bytes, trust: _Trust) -> bool:
    """True if policy.json carries a signature that verifies with the configured key."""
    if trust.public_key is None:
        return False
    try:
        sig = files.read(f"{rel_dir}/{SPEC}{SIG_SUFFIX}", MAX_BYTES["sig"])
    except FileNotFoundError:
        return False
    try:
        verify(trust.public_key, spec_bytes, sig)
    except SignatureError:
        raise PolicyLoadError(
            f"{rel_dir}/{SPEC}: the signature does not verify with the configured public key "
            "(policy.json was changed after signing, or another key signed it)"
        ) from None
    return True


def _check_identity(spec: dict, rel_dir: str) -> None:
    version = spec.get("policy_version")
    if type(version) is not int or not 1 <= version <= 999_999 or version_dir(version) != rel_dir:
        raise PolicyLoadError(f"{rel_dir}/{SPEC} is policy version {version!r:.40}: it does not belong in {rel_dir}")
    if spec.get("artifact_version") is not None and spec.get("directory") != rel_dir:
        raise PolicyLoadError(f"{rel_dir}/{SPEC} names directory {spec.get('directory')!r:.40}, not {rel_dir}")


def _file_hashes(spec: dict, rel_dir: str) -> dict[str, str]:
    if spec.get("artifact_version") is None:  # published before signed, code-free artifacts
        return {MODEL: str(spec.get("model_sha256"))}
    files = spec.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and _FILE_NAME_RE.match(k) and isinstance(v, str) and _SHA256_RE.match(v)
        for k, v in files.items()
    ):
        raise PolicyLoadError(f"{rel_dir}/{SPEC}: 'files' must map file names to sha256 digests")
    if spec.get("model") not in files:
        raise PolicyLoadError(f"{rel_dir}/{SPEC}: the model file is not pinned in 'files'")
    return files


def _check_allowed(spec: dict, fmt: str, rel_dir: str, signed: bool, trust: _Trust) -> None:
    key_hint = (
        "configure the trainer's public key (public_key= or RLREC_POLICY_PUBLIC_KEY)"
        if trust.public_key is None
        else "the version carries no signature of the configured key"
    )
    if fmt == "safetensors":
        if signed:
            return
        if not trust.allow_unsigned:
            raise PolicyLoadError(f"{rel_dir} is not signed: {key_hint}, or pass allow_unsigned=True")
        warnings.warn(f"loading unsigned policy {rel_dir} (allow_unsigned=True)", UnsignedPolicyWarning, stacklevel=4)
    elif fmt == "torchscript":
        if signed:
            return
        if not trust.allow_unsigned_code:
            raise PolicyLoadError(
                f"{rel_dir} is TorchScript, i.e. code that can read and write files, and is not signed: "
                f"{key_hint}, or pass allow_unsigned_code=True only if you trust everyone who can "
                "write the policies folder (versions published before rlrec's signed, code-free "
                "artifacts are all TorchScript)"
            )
        warnings.warn(
            f"loading unsigned TorchScript policy {rel_dir} (allow_unsigned_code=True): it is code",
            UnsignedPolicyWarning,
            stacklevel=4,
        )
    else:
        raise PolicyLoadError(f"{rel_dir}/{SPEC}: unknown artifact format {fmt!r:.40}")


def _build(spec: dict, fmt: str, data: bytes, rel_dir: str) -> Any:
    if fmt == "safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            tensors = load(data)
        except (SafetensorError, ValueError, RuntimeError) as e:
            raise PolicyLoadError(f"{rel_dir}/{spec.get('model')}: not a safetensors file: {e}") from None
        try:
            return build_network(spec.get("network"), spec.get("action_dist"), tensors)
        except NetworkSpecError as e:
            raise PolicyLoadError(f"{rel_dir}: {e}") from None
    import torch

    module = torch.jit.load(io.BytesIO(data), map_location="cpu")
    module.eval()
    return module


def _load_version(files: _Files, rel_dir: str, trust: _Trust, expected_sha256: str | None = None) -> _LoadedVersion:
    """Verify and load one version directory (see the module docstring for the order of checks)."""
    if not VERSION_DIR_RE.match(rel_dir):
        raise PolicyLoadError(f"{rel_dir!r:.80} is not a version directory")
    spec_bytes = _read_required(files, f"{rel_dir}/{SPEC}", rel_dir, MAX_BYTES[SPEC])
    if expected_sha256 is not None and hashlib.sha256(spec_bytes).hexdigest() != expected_sha256:
        raise PolicyLoadError(f"{rel_dir}/{SPEC} does not match the sha256 in {LATEST}")
    signed = _verify_signature(files, rel_dir, spec_bytes, trust)
    spec = _json(spec_bytes, f"{rel_dir}/{SPEC}")
    if not isinstance(spec, dict):
        raise PolicyLoadError(f"{rel_dir}/{SPEC} must be a JSON object")
    _check_identity(spec, rel_dir)
    fmt = spec.get("format", "torchscript") if spec.get("artifact_version") is not None else "torchscript"
    _check_allowed(spec, fmt, rel_dir, signed, trust)
    hashes = _file_hashes(spec, rel_dir)
    model = spec.get("model", MODEL) if spec.get("artifact_version") is not None else MODEL
    data = _read_required(files, f"{rel_dir}/{model}", rel_dir, MAX_BYTES["model"])
    if hashlib.sha256(data).hexdigest() != hashes[model]:
        raise PolicyLoadError(f"{rel_dir}/{model} does not match the sha256 in {SPEC}")
    dist_spec = spec.get("action_dist") if spec.get("artifact_version") is not None else _legacy_dist(spec)
    try:
        dist = PolicyDistribution(dist_spec, spec.get("action_space"))
    except (NetworkSpecError, KeyError, TypeError, ValueError) as e:
        raise PolicyLoadError(f"{rel_dir}/{SPEC}: bad action distribution: {e}") from None
    if "observation_shape" not in spec:
        raise PolicyLoadError(f"{rel_dir}/{SPEC} lacks observation_shape")
    return _LoadedVersion(spec, _build(spec, fmt, data, rel_dir), dist, signed, hashes)


def version_from_artifact(spec: dict, model: bytes) -> _LoadedVersion:
    """Load an artifact this process has just built itself (the promotion gate evaluates the
    candidate exactly as it would be published): no signature or file checks, the same rebuild."""
    fmt = spec.get("format", "torchscript")
    dist = PolicyDistribution(spec["action_dist"], spec.get("action_space"))
    spec = {"policy_version": spec.get("policy_version", 0), **spec}
    return _LoadedVersion(spec, _build(spec, fmt, model, "candidate"), dist, False, {})


# ------------------------------------------------------------------------------- acting


class Policy:
    """A verified published policy, ready to act; `poll()` switches to a newer published version.

    Guarantees: every loaded version passed the trust rules of the module docstring; the
    version in use never decreases (`poll` refuses a ``latest.json`` naming a lower version
    with `PolicyLoadError`); `act` uses one version from start to end even while `poll` swaps."""

    def __init__(
        self,
        root: str,
        *,
        version: int | None = None,
        explore: bool = False,
        seed: int | None = None,
        public_key: Any = None,
        allow_unsigned: bool = False,
        allow_unsigned_code: bool = False,
    ) -> None:
        import torch

        self.root = root
        self.explore = explore
        self._files = _Files(root)
        self._trust = _trust(public_key, allow_unsigned, allow_unsigned_code)
        self._generator = torch.Generator()
        self._generator.manual_seed(int(seed) if seed is not None else int(np.random.SeedSequence().entropy % 2**63))
        self._lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        if version is None:
            latest = self._latest()
            self._model = _load_version(self._files, latest["path"], self._trust, latest.get("sha256"))
        else:
            self._model = _load_version(self._files, version_dir(int(version)), self._trust)

    def _latest(self) -> dict:
        try:
            data = self._files.read(LATEST, MAX_BYTES[LATEST])
        except FileNotFoundError:
            raise PolicyLoadError(f"no policy is published under {self.root} (no {LATEST})") from None
        return _parse_latest(data)

    @property
    def policy_version(self) -> int:
        return self._model.version

    @property
    def signed(self) -> bool:
        """Whether the version in use carries a signature verified with the configured key."""
        return self._model.signed

    @property
    def spec(self) -> dict:
        return dict(self._model.spec)

    # -- batch API (what the equivalence tests compare with the RLModule)
    def action_dist_inputs(self, obs_batch: Any) -> np.ndarray:
        """Action distribution inputs for a batch of observations, ``(B, k)`` float32."""
        return self._model.forward(obs_batch).numpy().astype(np.float32)

    def deterministic_actions(self, obs_batch: Any) -> np.ndarray:
        """RLlib's ``to_deterministic().sample()`` per observation (see `PolicyDistribution`)."""
        m = self._model
        return m.dist.deterministic(m.forward(obs_batch)).numpy()

    def logp(self, obs_batch: Any, actions: Any) -> np.ndarray:
        """Log-probability of `actions` (distribution units) under each observation's distribution."""
        import torch

        m = self._model
        return m.dist.logp(m.forward(obs_batch), torch.as_tensor(np.asarray(actions))).numpy()

    # -- what off-policy evaluation needs (rlrec.trainer.ope.PolicyTarget; see _LoadedVersion)
    def action_probs(self, obs_batch: Any) -> np.ndarray:
        """Categorical policies: every action's probability per observation, ``(B, n)`` float64.

        Args:
            obs_batch: ``(B, *observation_shape)`` observations.

        Example:
            >>> policy.action_probs(obs_batch).sum(-1)  # doctest: +SKIP
            array([1., 1.])
        """
        return self._model.action_probs(obs_batch)

    def logp_env(self, obs_batch: Any, actions: Any) -> np.ndarray:
        """Log-probability of env-unit `actions` (as episodes record them) under the exploring policy.

        Args:
            obs_batch: ``(B, *observation_shape)`` observations.
            actions: ``(B,)`` or ``(B, *action_shape)`` actions as the environment took them.

        Example:
            >>> policy.logp_env(obs_batch, episode_actions)  # doctest: +SKIP
        """
        return self._model.logp_env(obs_batch, actions)

    def sample_env_actions(self, obs_batch: Any, n: int, seed: int = 0) -> np.ndarray:
        """`n` exploring actions per observation in env units, ``(B, n, *action_shape)``.

        Args:
            obs_batch: ``(B, *observation_shape)`` observations.
            n: samples per observation.
            seed: the sampling seed.

        Example:
            >>> policy.sample_env_actions(obs_batch, 8).shape  # doctest: +SKIP
            (2, 8, 1)
        """
        return self._model.sample_env_actions(obs_batch, n, seed)

    def greedy_env_actions(self, obs_batch: Any) -> np.ndarray:
        """The action ``act(obs, explore=False)`` takes for each observation, in env units.

        Args:
            obs_batch: ``(B, *observation_shape)`` observations.

        Example:
            >>> policy.greedy_env_actions(obs_batch)  # doctest: +SKIP
            array([1, 0])
        """
        return self._model.greedy_env_actions(obs_batch)

    # -- acting
    def act(self, obs: Any, explore: bool | None = None) -> tuple[Any, dict]:
        """One observation -> (action, extra_model_outputs) to pass to `EpisodeRecorder.log_step`.

        Args:
            obs: one observation.
            explore: sample from the policy's distribution (True) or take its most likely action
                (False); default: the `explore` given at construction.

        Returns:
            The action in env units and ``{"action_dist_inputs": ..., "action_logp": ...}``:
            the distribution's inputs, and the log-propensity of the action taken. Exploring,
            that is the action's log-probability under the distribution it was sampled from;
            with ``explore=False`` the choice is deterministic, its propensity is 1 and
            ``action_logp`` is 0.0. Data logged that way cannot be used by importance-weighted
            off-policy estimators (`rlrec.trainer.ope` reports them "not estimable"): log with
            ``explore=True`` to evaluate other policies on it later.

        Example:
            >>> action, extra = policy.act(obs, explore=True)  # doctest: +SKIP
            >>> rec.log_step(eid, action, reward, next_obs, extra_model_outputs=extra)  # doctest: +SKIP
        """
        with self._lock:
            m = self._model
        return m.act(obs, self.explore if explore is None else explore, self._generator)

    def poll(self) -> bool:
        """Load the published `latest` version if it is newer than the current one; True if switched.

        Raises `PolicyLoadError` when ``latest.json`` names an older version (no rollback) or the
        newer version fails verification; the current version stays in use either way."""
        latest = self._latest()
        current = self._model.version
        if latest["policy_version"] < current:
            raise PolicyLoadError(
                f"{LATEST} names v{latest['policy_version']}, older than v{current} in use: rollback refused"
            )
        if latest["policy_version"] == current:
            return False
        model = _load_version(self._files, latest["path"], self._trust, latest.get("sha256"))
        with self._lock:
            if model.version <= self._model.version:
                return False
            self._model = model
        return True

    def start_polling(self, interval_s: float = 5.0, on_update: Any = None) -> None:
        """Poll in a daemon thread; `on_update(policy)` after each switch. Failures are logged
        (once per distinct message) and the current version stays in use."""

        def loop() -> None:
            last_error = None
            while not self._stop.wait(interval_s):
                try:
                    if self.poll() and on_update is not None:
                        on_update(self)
                    last_error = None
                except Exception as e:  # keep acting with the current version
                    if str(e) != last_error:
                        log.warning("policy poll: %s", e)
                        last_error = str(e)

        if self._poller is None:
            self._poller = threading.Thread(target=loop, name="rlrec-policy-poll", daemon=True)
            self._poller.start()

    def stop_polling(self) -> None:
        self._stop.set()

    def lineage(self) -> dict:
        """The version's lineage.json (checked against its sha256 in policy.json when pinned)."""
        m = self._model
        rel_dir = version_dir(m.version)
        data = self._files.read(f"{rel_dir}/{LINEAGE}", MAX_BYTES[LINEAGE])
        want = m.files.get(LINEAGE)
        if want is not None and hashlib.sha256(data).hexdigest() != want:
            raise PolicyLoadError(f"{rel_dir}/{LINEAGE} does not match the sha256 in {SPEC}")
        return _json(data, f"{rel_dir}/{LINEAGE}")

    def __repr__(self) -> str:
        return (
            f"Policy({self.root!r}, policy_version={self.policy_version}, "
            f"dist={self._model.dist.kind!r}, signed={self.signed})"
        )


def load_policy(
    uri: str,
    *,
    version: int | None = None,
    explore: bool = False,
    seed: int | None = None,
    wait_s: float = 0.0,
    public_key: Any = None,
    allow_unsigned: bool = False,
    allow_unsigned_code: bool = False,
) -> Policy:
    """Load the latest (or a given) published policy under `uri` (a publish root, e.g.
    ``{checkpoint_dir}/policies``; a checkpoint dir with a ``policies/`` folder works too).

    `public_key`: the trainer's Ed25519 public key (a PEM file path, or the PEM text/bytes);
    default: the file named by ``RLREC_POLICY_PUBLIC_KEY``. Without a verified signature a
    version loads only with `allow_unsigned` (safetensors) or `allow_unsigned_code` (TorchScript).
    `wait_s` > 0: wait that long for a first publication. Raises `PolicyLoadError`."""
    root = os.fspath(uri).rstrip("/")
    files = _Files(root)
    if not files.exists(LATEST) and files.exists(f"policies/{LATEST}"):
        root = f"{root}/policies"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return Policy(
                root,
                version=version,
                explore=explore,
                seed=seed,
                public_key=public_key,
                allow_unsigned=allow_unsigned,
                allow_unsigned_code=allow_unsigned_code,
            )
        except PolicyLoadError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
