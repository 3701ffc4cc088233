"""Verifying a published version before its weights are read: trust (signatures, opt-ins),
the sha256 of every file, pins and bindings, replays and the state file, and building the
network from the verified spec (`rlrec.trainer.policy` acts with what this returns; the trust
rules are in its module docstring).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlrec.trainer.binding import Pins, canonical_space
from rlrec.trainer.policy_files import (
    _FILE_NAME_RE,
    _SHA256_RE,
    CANARY,
    CANARY_ENDED,
    CANARY_SIG,
    LATEST,
    LINEAGE,
    MAX_BYTES,
    MAX_NEWER_VERSIONS,
    MODEL,
    SPEC,
    VERSION_DIR_RE,
    PolicyLoadError,
    UnsignedPolicyWarning,
    _Files,
    _json,
    _parse_latest,
    _Pointer,
    version_dir,
)
from rlrec.trainer.policy_net import NetworkSpecError, PolicyDistribution, build_network
from rlrec.trainer.policy_state import (  # noqa: F401  (the state file's checks; importable from here)
    _check_state,
    _check_state_deployed,
    _read_state,
    _remember,
    _State,
    _state_floor,
)
from rlrec.trainer.signing import PUBLIC_KEY_ENV, SIG_SUFFIX, SignatureError, load_public_key, verify

log = logging.getLogger("rlrec.policy")

# ------------------------------------------------------------------------------- trust


@dataclass(frozen=True)
class _Trust:
    """What a loader accepts: the public key (None: none configured) and the two opt-ins."""

    public_key: Any
    allow_unsigned: bool
    allow_unsigned_code: bool
    #: the module a loader serves of a multi-module version (`rlrec.trainer.policy_modules`); None: all
    module_id: str | None = None


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
    from rlrec.trainer.policy_modules import MULTI_MODULE

    modules = spec.get("modules") if spec.get("format") == MULTI_MODULE else None
    if isinstance(modules, dict):  # a multi-module version: every module's model file
        models = [e.get("model") if isinstance(e, dict) else None for e in modules.values()]
    else:
        models = [spec.get("model")]
    if not models or any(m not in files for m in models):
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
    from rlrec.trainer.policy_modules import MULTI_MODULE, load_modules

    if spec.get("format") == MULTI_MODULE or trust.module_id is not None:
        return load_modules(files, rel_dir, spec, signed, trust, check)
    return _load_verified(files, rel_dir, spec, signed, trust, check)


def _load_verified(files: _Files, rel_dir: str, spec: dict, signed: bool, trust: _Trust, check: Any) -> _LoadedVersion:
    """Load one network of a version whose policy.json (`spec`) is verified."""
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
    is the pointer's does not count either: a canary runs above the deployed version. Nor do
    versions at or below the pointer's ``canary_floor`` (signed with it: canaries that ended
    without a promotion), which are not counted against ``MAX_NEWER_VERSIONS`` either."""
    if trust.public_key is None:
        return
    channel = spec.get("channel")
    try:
        names = files.version_dirs()
    except OSError as e:
        raise PolicyLoadError(f"cannot list the versions under {files.root}: {e}") from None
    # versions at or below the pointer's signed canary floor are canaries that ended unpromoted:
    # never deployed, never counted (rollbacks in a row would otherwise fill the window)
    newer = [d for d in names if int(d[1:]) > max(pointer.version, pointer.canary_floor)]
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
                "a replayed old pointer is refused"
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
    ident = _version_identity(files, trust, rel_dir, signed)
    if ident is None or any(doc.get(k) != v for k, v in ident.items()):
        log.warning(
            "%s/%s is not bound to the version there now (its policy.json sha256, channel, run id): ignored",
            rel_dir,
            CANARY_ENDED,
        )
        return None
    return doc["decision"]


def _version_identity(files: _Files, trust: _Trust, rel_dir: str, signed: bool) -> dict | None:
    """The sha256 of `rel_dir`'s policy.json (signed by the configured key, with `signed`), its
    channel and run id: what a decision record names to be bound to that version. None when it
    cannot be verified. Raises OSError when it cannot be read now."""
    try:
        data = files.read(f"{rel_dir}/{SPEC}", MAX_BYTES[SPEC])
        if signed:
            verify(trust.public_key, data, files.read(f"{rel_dir}/{SPEC}{SIG_SUFFIX}", MAX_BYTES["sig"]))
        spec = _json(data, f"{rel_dir}/{SPEC}")
    except (FileNotFoundError, PolicyLoadError, SignatureError):
        return None
    if not isinstance(spec, dict) or spec.get("policy_version") != int(rel_dir[1:]):
        return None
    return {"sha256": hashlib.sha256(data).hexdigest(), "channel": spec.get("channel"), "run_id": spec.get("run_id")}


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
        _check_state(rel_dir, pins, canary, None if pointer is None else pointer.doc.get("sha256"))
        if pointer is not None and not canary:
            _check_not_replayed(files, trust, pointer, spec)

    return check
