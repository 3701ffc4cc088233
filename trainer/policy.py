"""Published policies: verifying, loading and acting with torch only (never Ray).

Layout written by the trainer (`rlrec.trainer.export.publish_policy`) under the publish root
(default ``{checkpoint_dir}/policies``)::

    latest.json              {"policy_version": N, "path": "v00000N", "sha256": <sha256 of its policy.json>,
                              "run_id": R, "channel": C, "time": T}
    latest.json.sig          Ed25519 signature over the exact bytes of latest.json
    v00000N/policy.json      the spec: artifact_version 2, policy_version N, directory "v00000N",
                             run_id, channel, format ("safetensors" or "torchscript"), network (layer sizes,
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

Bindings (`rlrec.trainer.binding`; docs/DEPLOY.md, "Threat model"): ``latest.json.sig``, when
present, must verify; what the caller pins (``run_id``, ``channel``, ``observation_space``,
``action_space``, ``state_file``, ``max_pointer_age_s``) is checked on the pointer and on the
verified ``policy.json`` before the weights are read; a pointer below a version signed for the
same channel (by any run: a newer run may take a channel over) that is present under the root
is a replay and refused.

Canary (`rlrec.trainer.binding`, docs/DEPLOY.md "Canary rollout"): with ``canary_fraction`` a
`Policy` also follows ``canary.json`` and serves it per episode (`Policy.for_episode`); the
replay check excuses exactly the version a signed same-channel ``canary.json`` names above
``latest.json``'s version (`_canary_applies`, the one place).

Only this module, `rlrec.trainer.policy_net`, `rlrec.trainer.signing`, `rlrec.trainer.binding`,
`rlrec.trainer.canary`, numpy, json, torch, safetensors and cryptography are imported (`rlrec.producer.spaces` and
gymnasium when a space object is pinned); URIs other than local paths go through
`rlrec.store.storage.Storage` (pyarrow's filesystems and, for gs:// and az://, the cloud's
client library; lazily).
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

from rlrec.trainer.binding import RUN_ID_RE, Pins, canonical_space, write_state_file
from rlrec.trainer.canary import assignment_info, check_canary_fraction, in_canary
from rlrec.trainer.policy_net import NetworkSpecError, PolicyDistribution, build_network
from rlrec.trainer.signing import PUBLIC_KEY_ENV, SIG_SUFFIX, SignatureError, load_public_key, verify

__all__ = [
    "ARTIFACT_VERSION",
    "Assignment",
    "Policy",
    "PolicyLoadError",
    "UnsignedPolicyWarning",
    "VersionActor",
    "load_policy",
    "read_latest",
    "read_lineage",
    "version_dir",
]

log = logging.getLogger("rlrec.policy")

LATEST = "latest.json"
LATEST_SIG = LATEST + SIG_SUFFIX
#: the canary pointer (`rlrec.trainer.binding`): a candidate served to a share of episodes
CANARY = "canary.json"
CANARY_SIG = CANARY + SIG_SUFFIX
#: marks a canary version decided (written by the trainer before it removes canary.json): a
#: canary pointer naming a version that holds it is never followed (a replay of a decided canary)
CANARY_ENDED = "canary-ended.json"
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
    CANARY: 64 * 1024,
    SPEC: 1024 * 1024,
    "sig": 4 * 1024,
    LINEAGE: 16 * 1024 * 1024,
    "model": 1024 * 1024 * 1024,
    "safetensors_header": 1024 * 1024,
    "state": 64 * 1024,
}
#: the deepest nesting of [ and { a JSON file may have (checked before parsing)
MAX_JSON_DEPTH = 64
#: the most version directories above the pointed one that are checked for a replayed pointer
MAX_NEWER_VERSIONS = 100
#: the most entries of a publish root that are listed
MAX_ROOT_ENTRIES = 100_000


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
            from rlrec.store.storage import Storage  # pyarrow (and a cloud's client), only for object stores

            self.storage = Storage.from_uri(root)
            self.fs, self.root = self.storage.filesystem, self.storage.base

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

    def version_dirs(self) -> list[str]:
        """The names of the root's entries that look like version directories (``v\\d{6}``);
        more than `MAX_ROOT_ENTRIES` entries is a PolicyLoadError."""
        if self.local:
            names = []
            with os.scandir(self.root) as it:
                for n, entry in enumerate(it):
                    if n >= MAX_ROOT_ENTRIES:
                        raise PolicyLoadError(f"{self.root} holds more than {MAX_ROOT_ENTRIES} entries: refused")
                    names.append(entry.name)
        else:
            infos = self.storage.list("")
            if len(infos) > MAX_ROOT_ENTRIES:
                raise PolicyLoadError(f"{self.root} holds more than {MAX_ROOT_ENTRIES} entries: refused")
            names = [i.name for i in infos]
        return sorted(n for n in names if VERSION_DIR_RE.match(n))

    def exists(self, rel: str) -> bool:
        if self.local:
            return os.path.exists(os.path.join(self.root, *rel.split("/")))
        import pyarrow.fs as pafs

        return self.fs.get_file_info(f"{self.root}/{rel}").type != pafs.FileType.NotFound


_JSON_STRING_RE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_JSON_BRACKET_RE = re.compile(rb"[\[\]{}]")


def _json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (brackets inside strings ignored)."""
    depth = deepest = 0
    for b in _JSON_BRACKET_RE.findall(_JSON_STRING_RE.sub(b'""', data)):
        if b in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _json(data: bytes, what: str) -> Any:
    """Parse a small JSON file; every failure (bad JSON, nesting deeper than `MAX_JSON_DEPTH`,
    checked before parsing) is a PolicyLoadError."""
    if isinstance(data, str):
        data = data.encode()
    depth = _json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise PolicyLoadError(f"{what} is nested {depth} deep, over the limit of {MAX_JSON_DEPTH}: refused")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise PolicyLoadError(f"{what} is not usable JSON: {type(e).__name__}: {str(e)[:200]}") from None


def _parse_latest(data: bytes, name: str = LATEST) -> dict:
    """A checked pointer (``latest.json``, or ``canary.json`` with its two more fields)."""
    latest = _json(data, name)
    if not isinstance(latest, dict):
        raise PolicyLoadError(f"{name} must be a JSON object")
    path, version = latest.get("path"), latest.get("policy_version")
    if not isinstance(path, str) or not VERSION_DIR_RE.match(path):
        raise PolicyLoadError(f"{name}: path {path!r:.80} is not a version directory (^v\\d{{6}}$)")
    if type(version) is not int or version != int(path[1:]):
        raise PolicyLoadError(f"{name}: policy_version {version!r:.40} does not name directory {path}")
    sha = latest.get("sha256")
    if sha is not None and (not isinstance(sha, str) or not _SHA256_RE.match(sha)):
        raise PolicyLoadError(f"{name}: sha256 {sha!r:.80} is not a sha256")
    for key in ("run_id", "channel"):
        value = latest.get(key)
        if value is not None and (not isinstance(value, str) or not RUN_ID_RE.match(value)):
            raise PolicyLoadError(f"{name}: {key} {value!r:.80} does not match {RUN_ID_RE.pattern}")
    t = latest.get("time")
    if t is not None and (type(t) not in (int, float) or not np.isfinite(t)):
        raise PolicyLoadError(f"{name}: time {t!r:.40} is not a number")
    if name == CANARY:
        base, started = latest.get("base_version"), latest.get("started")
        if type(base) is not int or not 0 <= base < version:
            raise PolicyLoadError(f"{name}: base_version {base!r:.40} is not a version below {version}")
        if type(started) not in (int, float) or not np.isfinite(started):
            raise PolicyLoadError(f"{name}: started {started!r:.40} is not a number")
    return latest


def read_latest(root: str) -> dict:
    """The checked ``latest.json`` pointer of a publish root (FileNotFoundError if nothing is published)."""
    return _parse_latest(_Files(root).read(LATEST, MAX_BYTES[LATEST]))


@dataclass(frozen=True)
class _Pointer:
    """A parsed ``latest.json`` and whether ``latest.json.sig`` verified with the configured key."""

    doc: dict
    signed: bool
    name: str = LATEST

    @property
    def version(self) -> int:
        return int(self.doc["policy_version"])

    @property
    def path(self) -> str:
        return str(self.doc["path"])

    @property
    def run_id(self) -> str | None:
        return self.doc.get("run_id")

    @property
    def channel(self) -> str | None:
        return self.doc.get("channel")

    @property
    def base_version(self) -> int:
        """A canary pointer's base version (the version ``latest.json`` names meanwhile)."""
        return int(self.doc.get("base_version", 0))


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
        self.spec_sha256: str | None = None  # of its policy.json, when the pointer that named it pins it
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


def _check_safetensors_header(data: bytes, what: str) -> None:
    """The safetensors header (8-byte little-endian length, then JSON) is within its size and
    nesting limits and inside the file, before the safetensors parser sees it."""
    limit = MAX_BYTES["safetensors_header"]
    if len(data) < 8:
        raise PolicyLoadError(f"{what}: not a safetensors file (shorter than its header length)")
    n = int.from_bytes(data[:8], "little")
    if n > limit or 8 + n > len(data):
        raise PolicyLoadError(
            f"{what}: its safetensors header claims {n} bytes (limit {limit}, file {len(data)}): refused"
        )
    if not isinstance(_json(bytes(data[8 : 8 + n]), f"{what} (safetensors header)"), dict):
        raise PolicyLoadError(f"{what}: its safetensors header is not a JSON object")


def _build(spec: dict, fmt: str, data: bytes, rel_dir: str) -> Any:
    if fmt == "safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load

        _check_safetensors_header(data, f"{rel_dir}/{spec.get('model')}")
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


def _verified_spec(files: _Files, rel_dir: str, trust: _Trust, expected_sha256: str | None = None) -> tuple[dict, bool]:
    """The policy.json of one version directory and whether its signature verified with the
    configured key: read, checked against `expected_sha256` (the pointer's), signature verified
    before it is parsed, its number and directory checked (the first checks of every load)."""
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
    return spec, signed


def _pinned_lineage(files: _Files, rel_dir: str, hashes: dict[str, str]) -> dict:
    """The version's lineage.json, refused unless its sha256 is the one its policy.json pins."""
    want = hashes.get(LINEAGE)
    if want is None:
        raise PolicyLoadError(f"{rel_dir}/{SPEC} does not pin a {LINEAGE}: its lineage cannot be trusted")
    data = _read_required(files, f"{rel_dir}/{LINEAGE}", rel_dir, MAX_BYTES[LINEAGE])
    if hashlib.sha256(data).hexdigest() != want:
        raise PolicyLoadError(f"{rel_dir}/{LINEAGE} does not match the sha256 in {SPEC}: refused")
    doc = _json(data, f"{rel_dir}/{LINEAGE}")
    if not isinstance(doc, dict):
        raise PolicyLoadError(f"{rel_dir}/{LINEAGE} must be a JSON object")
    return doc


def read_lineage(
    uri: str,
    version: int,
    *,
    public_key: Any = None,
    allow_unsigned: bool = False,
    run_id: str | None = None,
    channel: str | None = None,
) -> tuple[dict, bool]:
    """The lineage.json of published `version` under the publish root `uri`, verified as
    `load_policy` verifies a version (the same checks, without reading the weights), and
    whether its policy.json's signature verified.

    With a public key (``public_key=`` or ``RLREC_POLICY_PUBLIC_KEY``) policy.json's signature
    must verify; lineage.json must match the sha256 that policy.json pins. An unsigned version
    is refused unless ``allow_unsigned=True`` (warned). A pinned `run_id` / `channel` needs a
    signed version for exactly that run / channel (as `load_policy` pins them): a signed
    version directory copied in from another run or channel is refused.

    Args:
        uri: the publish root (a path or URI).
        version: the policy version (1 .. 999999).
        public_key: the trainer's Ed25519 public key (PEM bytes, a path, or a key object).
        allow_unsigned: accept a version without a verified signature (not with a pin).
        run_id: only a version signed for this run (its ``run_id``).
        channel: only a version signed for this channel.

    Raises:
        FileNotFoundError: the version is not published under `uri`.
        PolicyLoadError: tampered, unsigned, or not a version of this layout.

    Example:
        >>> doc, signed = read_lineage("/ckpt/policies", 3, public_key="trainer.pub")  # doctest: +SKIP
        >>> doc["cursor"]  # doctest: +SKIP
        'r1~4be0c6a2f1d9~rl:0=14'
    """
    try:
        pins = Pins.of(run_id=run_id, channel=channel)
    except ValueError as e:
        raise PolicyLoadError(str(e)) from None
    trust = _trust(public_key, allow_unsigned, False)
    files = _Files(uri)
    rel_dir = version_dir(version)
    if not files.exists(f"{rel_dir}/{SPEC}"):
        raise FileNotFoundError(f"policy version {version} is not published under {uri} (no {rel_dir}/{SPEC})")
    spec, signed = _verified_spec(files, rel_dir, trust)
    _check_identity_pins(spec, rel_dir, signed, pins)
    if not signed:
        if not trust.allow_unsigned:
            hint = (
                "configure the trainer's public key (public_key= or RLREC_POLICY_PUBLIC_KEY)"
                if trust.public_key is None
                else "the version carries no signature of the configured key"
            )
            raise PolicyLoadError(f"{rel_dir} is not signed: {hint}, or pass allow_unsigned=True (--allow-unsigned)")
        warnings.warn(f"reading the lineage of unsigned policy {rel_dir}", UnsignedPolicyWarning, stacklevel=2)
    return _pinned_lineage(files, rel_dir, _file_hashes(spec, rel_dir)), signed


def _load_version(
    files: _Files, rel_dir: str, trust: _Trust, expected_sha256: str | None = None, check: Any = None
) -> _LoadedVersion:
    """Verify and load one version directory (see the module docstring for the order of checks);
    `check(spec, rel_dir, signed)` runs on the verified policy.json before the weights are read."""
    spec, signed = _verified_spec(files, rel_dir, trust, expected_sha256)
    fmt = spec.get("format", "torchscript") if spec.get("artifact_version") is not None else "torchscript"
    _check_allowed(spec, fmt, rel_dir, signed, trust)
    if check is not None:
        check(spec, rel_dir, signed)
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


# ------------------------------------------------------------------------------- bindings


def _read_pointer(files: _Files, trust: _Trust, root: str, name: str = LATEST) -> _Pointer:
    """Read, verify and parse ``latest.json`` (or ``canary.json``). With a public key and a
    signature file, the signature must verify (both files are re-read a few times first: a
    publication writes one after the other). A missing pointer is a PolicyLoadError for
    ``latest.json``, FileNotFoundError for ``canary.json``."""
    for attempt in range(3):
        try:
            data = files.read(name, MAX_BYTES[name])
        except FileNotFoundError:
            if name != LATEST:
                raise
            raise PolicyLoadError(f"no policy is published under {root} (no {LATEST})") from None
        if trust.public_key is None:
            return _Pointer(_parse_latest(data, name), False, name)
        try:
            sig = files.read(name + SIG_SUFFIX, MAX_BYTES["sig"])
        except FileNotFoundError:
            return _Pointer(_parse_latest(data, name), False, name)
        try:
            verify(trust.public_key, data, sig)
        except SignatureError:
            time.sleep(0.05 * (attempt + 1))
            continue
        return _Pointer(_parse_latest(data, name), True, name)
    raise PolicyLoadError(
        f"{name}: its signature ({name}{SIG_SUFFIX}) does not verify with the configured public key "
        "(the pointer was changed after signing, or another key signed it)"
    )


def _read_canary(files: _Files, trust: _Trust, root: str) -> _Pointer | None:
    """The checked ``canary.json`` (None: there is none, or it names a version the trainer marked
    decided with ``canary-ended.json``). With a public key it must be signed: an unsigned canary
    pointer is refused (PolicyLoadError) wherever a key is configured."""
    try:
        pointer = _read_pointer(files, trust, root, CANARY)
    except FileNotFoundError:
        return None
    if trust.public_key is not None and not pointer.signed:
        raise PolicyLoadError(f"{CANARY} is not signed by the configured key ({CANARY_SIG}): not followed")
    if _end_decision(files, trust, pointer.path, signed=trust.public_key is not None) is not None:
        return None  # decided: a replayed canary pointer is not a canary
    return pointer


def _check_pointer_pins(pointer: _Pointer, pins: Pins) -> None:
    """A pinned run id or channel needs a signed pointer for exactly that run and channel."""
    if not pins.binds_identity:
        return
    if not pointer.signed:
        raise PolicyLoadError(
            f"{pointer.name} is not signed by the configured key ({pointer.name}{SIG_SUFFIX}): a pinned run id or "
            "channel needs a signed pointer (rlrec train --signing-key signs it)"
        )
    for what, pinned, got in (("run id", pins.run_id, pointer.run_id), ("channel", pins.channel, pointer.channel)):
        if pinned is not None and got != pinned:
            raise PolicyLoadError(
                f"{pointer.name} is signed for {what} {got!r:.80}, not the pinned {pinned!r}: refused"
            )


def _stale_reason(pointer: _Pointer, pins: Pins, trust: _Trust, now: float) -> str | None:
    """Why the pointer is too old to be followed (None: it is not, or no age is configured)."""
    limit = pins.max_pointer_age_s
    if limit is None:
        return None
    if trust.public_key is not None and not pointer.signed:
        return f"{pointer.name} is not signed, so its time cannot be trusted (max_pointer_age_s={limit:g})"
    t = pointer.doc.get("time")
    if t is None:
        return f"{pointer.name} carries no time (max_pointer_age_s={limit:g})"
    if now - t > limit:
        return f"{pointer.name} (v{pointer.version}) is {now - t:.0f} s old, over max_pointer_age_s={limit:g}"
    return None


def _check_identity_pins(spec: dict, rel_dir: str, signed: bool, pins: Pins) -> None:
    if not pins.binds_identity:
        return
    if not signed:
        raise PolicyLoadError(
            f"{rel_dir} is not signed by the configured key: a pinned run id or channel needs a signed version"
        )
    for what, key, pinned in (("run id", "run_id", pins.run_id), ("channel", "channel", pins.channel)):
        got = spec.get(key)
        if pinned is None or got == pinned:
            continue
        if got is None:
            raise PolicyLoadError(f"{rel_dir} carries no {what} (published before versions were bound): refused")
        raise PolicyLoadError(f"{rel_dir} is signed for {what} {got!r:.80}, not the pinned {pinned!r}: refused")


def _check_pointer_matches(spec: dict, rel_dir: str, signed: bool, pointer: _Pointer, trust: _Trust) -> None:
    """The pointer and the version it names are for the same run and channel; a version that
    was published with a signed pointer (it carries a run id) is not followed through an
    unsigned one."""
    ident = (spec.get("run_id"), spec.get("channel"))
    if pointer.signed:
        if (pointer.run_id, pointer.channel) != ident:
            raise PolicyLoadError(
                f"{pointer.name} is signed for run {pointer.run_id!r:.40} channel {pointer.channel!r:.40}, but "
                f"{rel_dir} for run {ident[0]!r:.40} channel {ident[1]!r:.40}: refused"
            )
    elif trust.public_key is not None and signed and ident[0] is not None:
        raise PolicyLoadError(
            f"{pointer.name} is not signed, but {rel_dir} was published with a signed pointer (it carries a run "
            f"id): a stripped or replaced {pointer.name}{SIG_SUFFIX} is refused"
        )


def _check_spaces(spec: dict, rel_dir: str, pins: Pins) -> None:
    for what, key, pinned in (
        ("observation", "observation_space", pins.observation_space),
        ("action", "action_space", pins.action_space),
    ):
        if pinned is None:
            continue
        got = spec.get(key)
        if not isinstance(got, dict):
            raise PolicyLoadError(
                f"{rel_dir}/{SPEC} states no {what} space: it cannot be checked against the service's"
            )
        try:
            canon = canonical_space(got)
        except (TypeError, ValueError) as e:
            raise PolicyLoadError(f"{rel_dir}/{SPEC}: {key} is not a space: {e}") from None
        if canon != pinned:
            raise PolicyLoadError(
                f"{rel_dir} is for {what} space {canon:.200}, not the service's {pinned:.200}: refused"
            )


def _signed_spec(files: _Files, rel_dir: str, trust: _Trust) -> dict | None:
    """The policy.json of `rel_dir` if it carries a valid signature of the configured key, else None."""
    try:
        data = files.read(f"{rel_dir}/{SPEC}", MAX_BYTES[SPEC])
        sig = files.read(f"{rel_dir}/{SPEC}{SIG_SUFFIX}", MAX_BYTES["sig"])
        verify(trust.public_key, data, sig)
        spec = _json(data, f"{rel_dir}/{SPEC}")
    except (OSError, PolicyLoadError, SignatureError):
        return None
    if not isinstance(spec, dict) or spec.get("policy_version") != int(rel_dir[1:]):
        return None
    return spec


def _check_not_replayed(files: _Files, trust: _Trust, pointer: _Pointer, spec: dict) -> None:
    """Refuse a pointer naming a version below the highest version present under the root that
    is signed by the configured key for the same channel (a replayed old pointer). Versions of
    other channels do not count: copying them in cannot stop a service from (re)starting. The
    one version a signed ``canary.json`` of the same channel names while its ``base_version``
    is the pointer's does not count either: a canary runs above the deployed version."""
    if trust.public_key is None:
        return
    channel = spec.get("channel")
    try:
        names = files.version_dirs()
    except OSError as e:
        raise PolicyLoadError(f"cannot list the versions under {files.root}: {e}") from None
    newer = [d for d in names if int(d[1:]) > pointer.version]
    if len(newer) > MAX_NEWER_VERSIONS:
        raise PolicyLoadError(
            f"{len(newer)} version directories above {pointer.path}, over the limit of {MAX_NEWER_VERSIONS}: refused"
        )
    excused: str | None = None
    for d in reversed(newer):
        other = _signed_spec(files, d, trust)
        if other is not None and other.get("channel") == channel:
            if excused is None:
                excused = _canary_above(files, trust, pointer, channel)
            if d == excused or _never_deployed(files, trust, d):
                continue
            raise PolicyLoadError(
                f"{LATEST} names {pointer.path}, but {d}, signed for the same channel, exists: "
                "a replayed old pointer is refused (a rollback is a new, higher version)"
            )


def _end_decision(files: _Files, trust: _Trust, rel_dir: str, signed: bool = True) -> str | None:
    """The decision ("promote", "rollback" or "abandoned") of `rel_dir`'s ``canary-ended.json``:
    signed by the configured key (with `signed`; else any record), and naming the version of
    `rel_dir` itself -- a record copied from another version's directory is none. None without
    such a record (absent, unsigned, not this version's). Raises OSError when it cannot be read now."""
    try:
        data = files.read(f"{rel_dir}/{CANARY_ENDED}", 4096)
        if signed:
            verify(trust.public_key, data, files.read(f"{rel_dir}/{CANARY_ENDED}{SIG_SUFFIX}", MAX_BYTES["sig"]))
        doc = _json(data, f"{rel_dir}/{CANARY_ENDED}")
    except (FileNotFoundError, PolicyLoadError, SignatureError):
        return None
    if not isinstance(doc, dict) or type(doc.get("canary_version")) is not int:
        return None
    if doc["canary_version"] != int(rel_dir[1:]) or doc.get("decision") not in ("promote", "rollback", "abandoned"):
        return None
    return doc["decision"]


def _never_deployed(files: _Files, trust: _Trust, rel_dir: str) -> bool:
    """Whether `rel_dir` holds a ``canary-ended.json`` of its own version signed by the configured
    key whose decision is not "promote" (a canary rolled back or abandoned: never deployed, so a
    pointer below it is no replay)."""
    try:
        return trust.public_key is not None and _end_decision(files, trust, rel_dir) in ("rollback", "abandoned")
    except OSError:
        return False  # unreadable now: counted as deployed (a pointer below it stays a replay)


def _canary_applies(canary: _Pointer | None, base_version: int, channel: Any, trust: _Trust) -> bool:
    """The canary rule (docs/GUARANTEES.md, "Canary rollout"): a version above ``latest.json``'s
    is served only when it is the one a ``canary.json`` -- signed by the configured key, for the
    same channel -- names above exactly that base version. The one place that excuses it: the
    replay check (`_canary_above`) and `Policy._poll_canary` both ask here."""
    if canary is None or (trust.public_key is not None and not canary.signed):
        return False
    return canary.channel == channel and canary.base_version == base_version and canary.version > base_version


def _canary_above(files: _Files, trust: _Trust, pointer: _Pointer, channel: Any) -> str:
    """The directory a signed ``canary.json`` of `channel` names while it runs above `pointer`
    (its ``base_version`` is the pointer's version); "" when there is no such canary."""
    try:
        canary = _read_canary(files, trust, files.root)
    except (OSError, PolicyLoadError):
        return ""
    return canary.path if canary is not None and _canary_applies(canary, pointer.version, channel, trust) else ""


def _read_state(path: str) -> tuple[int, int | None] | None:
    """The newest version recorded in the service's state file and the newest canary (None: no file yet)."""
    directory, name = os.path.split(path)
    try:
        data = _Files(directory or ".").read(name, MAX_BYTES["state"])
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PolicyLoadError(f"state file {path}: {e}") from None
    doc = _json(data, f"state file {path}")
    version = doc.get("policy_version") if isinstance(doc, dict) else None
    if type(version) is not int or version < 0:
        raise PolicyLoadError(f"state file {path} holds no policy_version: refused (delete it to start over)")
    canary = doc.get("canary_version")
    if canary is not None and (type(canary) is not int or canary < 0):
        raise PolicyLoadError(f"state file {path}: canary_version {canary!r:.40} is not a version: refused")
    return version, canary


def _check_state(rel_dir: str, pins: Pins, canary: bool = False) -> None:
    """A version below the newest this service loaded through ``latest.json`` (a canary: below
    the newest canary it ran) is refused."""
    if pins.state_file is None:
        return
    state = _read_state(pins.state_file)
    if state is None:
        return
    newest = state[1] if canary else state[0]
    if newest is not None and int(rel_dir[1:]) < newest:
        what = "the canary " if canary else ""
        raise PolicyLoadError(
            f"{rel_dir} is older than {what}v{newest:06d}, which this service has loaded before "
            f"(state file {pins.state_file}): refused"
        )


def _remember(model: _LoadedVersion, pins: Pins, canary: bool = False) -> None:
    """Record a loaded version (or canary) in the state file (never lowering either)."""
    if pins.state_file is None:
        return
    state = _read_state(pins.state_file)
    newest, newest_canary = state if state is not None else (None, None)
    if canary:
        if newest_canary is not None and newest_canary >= model.version:
            return
        newest_canary = model.version
    else:
        if newest is not None and newest >= model.version:
            return
        newest = model.version
    try:
        write_state_file(
            pins.state_file, newest or 0, model.spec.get("run_id"), model.spec.get("channel"), newest_canary
        )
    except OSError as e:
        raise PolicyLoadError(f"cannot write the state file {pins.state_file}: {e}") from None


def _spec_check(files: _Files, trust: _Trust, pins: Pins, pointer: _Pointer | None) -> Any:
    """The checks of a version's verified policy.json, run before its weights are read (a
    canary pointer's version is checked against the state file's canary; a canary is not a
    replay: it is followed only above the version ``latest.json`` names, checked itself)."""
    canary = pointer is not None and pointer.name == CANARY

    def check(spec: dict, rel_dir: str, signed: bool) -> None:
        _check_identity_pins(spec, rel_dir, signed, pins)
        if pointer is not None:
            _check_pointer_matches(spec, rel_dir, signed, pointer, trust)
        _check_spaces(spec, rel_dir, pins)
        _check_state(rel_dir, pins, canary)
        if pointer is not None and not canary:
            _check_not_replayed(files, trust, pointer, spec)

    return check


# ------------------------------------------------------------------------------- acting


class VersionActor:
    """One loaded version of a `Policy`, to act for the whole of one episode (`Policy.for_episode`).

    Args:
        policy: the policy it belongs to (its sampling generator and `explore` default).
        model: the loaded version.
        canary: whether it is the canary version.
    """

    def __init__(self, policy: Policy, model: _LoadedVersion, canary: bool) -> None:
        self._policy = policy
        self._version = model
        self.canary = canary

    @property
    def policy_version(self) -> int:
        """The version to log for the episode (``begin_episode(policy_version=...)``)."""
        return self._version.version

    def act(self, obs: Any, explore: bool | None = None) -> tuple[Any, dict]:
        """As `Policy.act`, with this version.

        Example:
            >>> action, extra = actor.act(obs)  # doctest: +SKIP
        """
        p = self._policy
        return self._version.act(obs, p.explore if explore is None else explore, p._generator)

    def __repr__(self) -> str:
        return f"VersionActor(policy_version={self.policy_version}, canary={self.canary})"


class Assignment(tuple):
    """``(actor, policy_version)`` of one episode (`Policy.for_episode`): `actor` is a
    `VersionActor`, or None for the deployed share before anything is deployed (the service
    runs what it ran before and logs `policy_version` 0). `info` is what to merge into the
    episode's reset info while a canary runs (its randomized assignment; the trainer counts only
    episodes that log one), else ``{}``."""

    def __new__(cls, actor: VersionActor | None, policy_version: int, info: dict | None = None) -> Assignment:
        self = super().__new__(cls, (actor, policy_version))
        self.info = dict(info or {})
        return self

    @property
    def actor(self) -> VersionActor | None:
        return self[0]

    @property
    def policy_version(self) -> int:
        return self[1]

    @property
    def canary(self) -> bool:
        return self[0] is not None and self[0].canary


class Policy:
    """A verified published policy, ready to act; `poll()` switches to a newer published version.

    Guarantees: every loaded version passed the trust rules of the module docstring and the
    pins it was built with (run id, channel, spaces, state file, pointer age); the version in
    use never decreases (`poll` refuses a ``latest.json`` naming a lower version with
    `PolicyLoadError`); a refused or stale pointer leaves the current version in use; `act`
    uses one version from start to end even while `poll` swaps.

    With ``canary_fraction`` f > 0 it also follows ``canary.json`` (a candidate on trial,
    ``rlrec train --rollout canary``) while ``latest.json`` names the canary's base version, and
    `for_episode` serves it to the share f of episodes chosen by `rlrec.trainer.canary.in_canary`;
    a canary that is refused or ends (promoted, rolled back) leaves the deployed version serving
    every episode. `act` and the batch methods always use the deployed version.

    Readable by the caller: `stale_pointer` (the last poll found the pointer too old),
    `stale_pointers` (how many polls did), `refusals` (how many polls raised),
    `last_refusal` (the last refusal's message) and `canary_refusals` (canary pointers or
    versions refused)."""

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
        run_id: str | None = None,
        channel: str | None = None,
        observation_space: Any = None,
        action_space: Any = None,
        state_file: Any = None,
        max_pointer_age_s: float | None = None,
        canary_fraction: float = 0.0,
    ) -> None:
        import torch

        try:
            self.canary_fraction = check_canary_fraction(canary_fraction)
        except (TypeError, ValueError) as e:
            raise PolicyLoadError(str(e)) from None
        if self.canary_fraction and version is not None:
            raise PolicyLoadError("canary_fraction follows the pointers: it cannot be used with version=")
        self._deployed: _LoadedVersion | None = None
        self._canary: _LoadedVersion | None = None
        self.canary_refusals = 0
        self._last_canary_refusal: str | None = None
        self.root = root
        self.explore = explore
        self._files = _Files(root)
        self._trust = _trust(public_key, allow_unsigned, allow_unsigned_code)
        try:
            self._pins = Pins.of(
                run_id=run_id,
                channel=channel,
                observation_space=observation_space,
                action_space=action_space,
                state_file=state_file,
                max_pointer_age_s=max_pointer_age_s,
            )
        except (TypeError, ValueError) as e:
            raise PolicyLoadError(f"bad pin: {e}") from None
        self._generator = torch.Generator()
        self._generator.manual_seed(int(seed) if seed is not None else int(np.random.SeedSequence().entropy % 2**63))
        self._lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self.stale_pointer = False
        self.stale_pointers = 0
        self.refusals = 0
        self.last_refusal: str | None = None
        if version is None and self.canary_fraction and not self._files.exists(LATEST):
            self._poll_canary()  # nothing deployed yet: a first version may be on canary
            if self._canary is None:
                raise PolicyLoadError(f"no policy is published under {root} (no {LATEST}, no usable {CANARY})")
            return
        if version is None:
            pointer = self._pointer()
            reason = _stale_reason(pointer, self._pins, self._trust, time.time())
            if reason is not None:
                raise PolicyLoadError(f"{reason}: a stale pointer is not followed")
            self._model = self._load_pointed(pointer)
        else:
            rel_dir = version_dir(int(version))
            check = _spec_check(self._files, self._trust, self._pins, None)
            self._model = _load_version(self._files, rel_dir, self._trust, check=check)
        _remember(self._model, self._pins)
        if self.canary_fraction:
            self._poll_canary()

    @property
    def _model(self) -> _LoadedVersion:
        m = self._deployed
        if m is None:
            raise PolicyLoadError(
                f"nothing is deployed under {self.root} yet (only a canary): use for_episode(), whose "
                "other episodes run what the service ran before"
            )
        return m

    @_model.setter
    def _model(self, model: _LoadedVersion) -> None:
        self._deployed = model

    @property
    def canary_version(self) -> int | None:
        """The canary version served to a share of episodes now (None: no canary)."""
        c = self._canary
        return None if c is None else c.version

    def for_episode(self, episode_id: str) -> Assignment:
        """The version to run for a whole episode, and the version to log for it.

        The episode runs the canary when there is one and `rlrec.trainer.canary.in_canary`
        (episode_id, canary_fraction) holds: a salted hash of the id, so every replica and
        every restart choose alike; else the deployed version (``latest.json``'s). Before
        anything is deployed (only a canary published), the other episodes get ``(None, 0)``:
        run what the service ran before, and log policy version 0.

        Args:
            episode_id: the id the episode is recorded with.

        Returns:
            `Assignment` ``(actor, policy_version)``; keep the actor for the whole episode
            (a `poll` meanwhile does not change it). While a canary runs, log its ``info`` in
            the episode's reset info: only episodes that do are the canary test's evidence.

        Example:
            >>> a = policy.for_episode(eid)  # doctest: +SKIP
            >>> rec.begin_episode(obs, {**info, **a.info}, episode_id=eid, policy_version=a.policy_version)  # doctest: +SKIP
            >>> action, extra = a.actor.act(obs)  # doctest: +SKIP
            >>> action, extra = actor.act(obs)  # doctest: +SKIP
        """
        with self._lock:
            deployed, canary = self._deployed, self._canary
        if canary is None:
            if deployed is None:
                return Assignment(None, 0)
            return Assignment(VersionActor(self, deployed, False), deployed.version)
        arm = in_canary(episode_id, self.canary_fraction)
        info = assignment_info(canary.version, self.canary_fraction, arm, canary.spec_sha256)
        if arm:
            return Assignment(VersionActor(self, canary, True), canary.version, info)
        if deployed is None:
            return Assignment(None, 0, info)
        return Assignment(VersionActor(self, deployed, False), deployed.version, info)

    def _poll_canary(self) -> bool:
        """Follow ``canary.json`` (module docstring); True if the canary changed. A refused
        canary pointer or version is logged (once per message), counted in `canary_refusals`,
        and no canary is served."""
        try:
            pointer = _read_canary(self._files, self._trust, self.root)
            if pointer is not None:
                _check_pointer_pins(pointer, self._pins)
                stale = _stale_reason(pointer, self._pins, self._trust, time.time())
                if stale is not None:  # its trainer stopped re-signing it: nobody judges the canary
                    raise PolicyLoadError(stale)
        except (OSError, PolicyLoadError) as e:
            return self._refuse_canary(str(e))
        deployed = self._deployed
        base = deployed.version if deployed is not None else 0
        channel = deployed.spec.get("channel") if deployed is not None else (pointer and pointer.channel)
        if not _canary_applies(pointer, base, channel, self._trust):
            return self._set_canary(None)
        current = self._canary
        if current is not None and current.version == pointer.version:
            return False
        try:
            check = _spec_check(self._files, self._trust, self._pins, pointer)
            model = _load_version(self._files, pointer.path, self._trust, pointer.doc.get("sha256"), check)
            model.spec_sha256 = pointer.doc.get("sha256")  # checked against its policy.json
            _remember(model, self._pins, canary=True)
        except (OSError, PolicyLoadError) as e:
            return self._refuse_canary(str(e))
        self._last_canary_refusal = None
        return self._set_canary(model)

    def _refuse_canary(self, why: str) -> bool:
        self.canary_refusals += 1
        if why != self._last_canary_refusal:
            log.warning("canary refused, the deployed version serves every episode: %s", why)
        self._last_canary_refusal = why
        return self._set_canary(None)

    def _set_canary(self, model: _LoadedVersion | None) -> bool:
        with self._lock:
            before, self._canary = self._canary, model
        if (before is None) != (model is None) or (before is not None and before.version != model.version):
            if model is not None:
                log.info("canary v%d serves %.3g of episodes", model.version, self.canary_fraction)
            else:
                log.info("canary v%d ended: the deployed version serves every episode", before.version)
            return True
        return False

    def _pointer(self) -> _Pointer:
        pointer = _read_pointer(self._files, self._trust, self.root)
        _check_pointer_pins(pointer, self._pins)
        return pointer

    def _load_pointed(self, pointer: _Pointer) -> _LoadedVersion:
        check = _spec_check(self._files, self._trust, self._pins, pointer)
        return _load_version(self._files, pointer.path, self._trust, pointer.doc.get("sha256"), check)

    @property
    def policy_version(self) -> int:
        """The deployed version in use (0: none yet, only a canary)."""
        m = self._deployed
        return 0 if m is None else m.version

    @property
    def run_id(self) -> str | None:
        """The run that published the version in use (None: published before run ids)."""
        return self._model.spec.get("run_id")

    @property
    def channel(self) -> str | None:
        """The channel the version in use was published for (None: published before channels)."""
        return self._model.spec.get("channel")

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
        """Switch to the version ``latest.json`` names if it is newer and passes every check.

        Returns:
            True if switched; False if the pointer names the version in use, or is stale
            (older than ``max_pointer_age_s``: logged, counted in `stale_pointers`,
            `stale_pointer` set, never followed).

        Raises:
            PolicyLoadError: the pointer or the version it names is refused (a lower version,
            another run or channel than pinned, other spaces, a replayed pointer, a failed
            verification); it is logged, counted in `refusals`, and the current version stays
            in use.

        Example:
            >>> if policy.poll():  # doctest: +SKIP
            ...     recorder.policy_version = policy.policy_version
        """
        try:
            return self._poll()
        except PolicyLoadError as e:
            self.refusals += 1
            if str(e) != self.last_refusal:
                log.warning("policy poll refused, v%d stays in use: %s", self.policy_version, e)
            self.last_refusal = str(e)
            raise

    def _poll(self) -> bool:
        if self._deployed is None and not self._files.exists(LATEST):
            return self._poll_canary()
        try:
            switched = self._poll_deployed()
        except PolicyLoadError:
            if self.canary_fraction:  # a refused latest.json never keeps serving a canary the trainer ended
                self._poll_canary()
            raise
        if self.canary_fraction:
            switched = self._poll_canary() or switched
        return switched

    def _poll_deployed(self) -> bool:
        pointer = self._pointer()
        current = self.policy_version
        if pointer.version < current:
            raise PolicyLoadError(f"{LATEST} names v{pointer.version}, older than v{current} in use: rollback refused")
        reason = _stale_reason(pointer, self._pins, self._trust, time.time())
        if reason is not None:
            self.stale_pointers += 1
            if not self.stale_pointer:
                log.warning("stale policy pointer, v%d stays in use: %s", current, reason)
            self.stale_pointer = True
            return False
        self.stale_pointer = False
        if pointer.version == current:
            return False
        model = self._load_pointed(pointer)
        with self._lock:
            if model.version <= self.policy_version:
                return False
            _remember(model, self._pins)
            self._model = model
        return True

    def start_polling(self, interval_s: float = 5.0, on_update: Any = None) -> None:
        """Poll in a daemon thread; `on_update(policy)` after each switch. Refusals are logged by
        `poll` (once per distinct message), other failures here; the current version stays in use."""

        def loop() -> None:
            last_error = None
            while not self._stop.wait(interval_s):
                try:
                    if self.poll() and on_update is not None:
                        on_update(self)
                    last_error = None
                except PolicyLoadError:
                    pass
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
        if self._deployed is None:
            return f"Policy({self.root!r}, policy_version=0, canary_version={self.canary_version})"
        canary = f", canary_version={self.canary_version}" if self.canary_fraction else ""
        return (
            f"Policy({self.root!r}, policy_version={self.policy_version}{canary}, "
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
    run_id: str | None = None,
    channel: str | None = None,
    observation_space: Any = None,
    action_space: Any = None,
    state_file: Any = None,
    max_pointer_age_s: float | None = None,
    canary_fraction: float = 0.0,
) -> Policy:
    """Load the latest (or a given) published policy, checked against what the service pins.

    Args:
        uri: a publish root (e.g. ``{checkpoint_dir}/policies``; a checkpoint dir with a
            ``policies/`` folder works too), a local path or a pyarrow filesystem URI.
        version: load this version instead of the one ``latest.json`` names.
        explore: `Policy.act` samples instead of taking the greedy action.
        seed: the sampling seed.
        wait_s: > 0: retry refusals for that long (a first publication, a publication in progress).
        public_key: the trainer's Ed25519 public key (a PEM file path, or the PEM text/bytes);
            default: the file named by ``RLREC_POLICY_PUBLIC_KEY``.
        allow_unsigned: load safetensors versions without a verified signature (warned).
        allow_unsigned_code: load TorchScript versions without a verified signature (warned).
        run_id: only versions and pointers signed for this run (`Policy.run_id` of a version
            you trust; kept across ``rlrec train --resume``).
        channel: only versions and pointers signed for this channel (``rlrec train --channel``).
        observation_space: the service's observation space (a gymnasium space or its JSON
            form): a version for another one is refused.
        action_space: the service's action space, likewise.
        state_file: a local JSON file this service owns: a version below the newest it has
            loaded before (across restarts) is refused; rewritten atomically after each load.
        max_pointer_age_s: a ``latest.json`` older than this is stale: not followed (here a
            `PolicyLoadError`; `Policy.poll` reports it and keeps the current version).
        canary_fraction: opt in to canaries (``rlrec train --rollout canary``): this share of
            episodes, chosen by a salted hash of the episode id (`rlrec.trainer.canary`), runs
            the candidate ``canary.json`` names; act with `Policy.for_episode`. 0: never.

    Raises:
        PolicyLoadError: nothing loadable is published, or it fails a check (module docstring;
            docs/TRAINER.md "Published policies").

    Example:
        >>> import gymnasium as gym  # doctest: +SKIP
        >>> env = gym.make("CartPole-v1")  # doctest: +SKIP
        >>> policy = load_policy(  # doctest: +SKIP
        ...     "s3://bucket/run1/policies", public_key="/etc/rlrec/policy-signing.pub",
        ...     channel="cartpole", observation_space=env.observation_space,
        ...     action_space=env.action_space, state_file="/var/lib/svc/policy-state.json")
        >>> action, extra = policy.act(obs)  # doctest: +SKIP
    """
    root = os.fspath(uri).rstrip("/")
    files = _Files(root)
    if (
        not files.exists(LATEST)
        and not files.exists(CANARY)
        and (files.exists(f"policies/{LATEST}") or files.exists(f"policies/{CANARY}"))
    ):
        root = f"{root}/policies"  # a checkpoint directory: its publish root (a first canary has no latest.json)
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
                run_id=run_id,
                channel=channel,
                observation_space=observation_space,
                action_space=action_space,
                state_file=state_file,
                max_pointer_age_s=max_pointer_age_s,
                canary_fraction=canary_fraction,
            )
        except PolicyLoadError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
