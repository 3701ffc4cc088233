"""Export the trained RLModule's inference network as a code-free artifact, and publish it.

`build_artifact` describes the inference path of RLlib 2.60's default RLModules -- BC
(``_encoder`` + ``_pi_head``), MARWIL (``encoder.encoder`` or ``encoder.actor_encoder`` + ``pi``),
CQL/IQL/SAC (``pi_encoder`` + ``pi``): MLP encoder and MLP head, Linear layers, activations,
LayerNorm, the head's log-std clipping -- as a JSON network spec plus its weights in safetensors
(`rlrec.trainer.policy_net` rebuilds it in plain torch). A module the spec cannot describe (a
custom RLModule, a CNN or LSTM encoder, a free-log-std head, a non-flat observation) falls back
to TorchScript (`model.pt`), which `load_policy` runs only when the version is signed by the
configured key or with ``allow_unsigned_code=True``.

`publish_policy` writes ``v{N:06d}/`` (weights, ``lineage.json``, ``policy.json``, and
``policy.json.sig`` when a signing key is given) and then ``latest.json``; see
`rlrec.trainer.policy` for the layout and the loader. Runs in the trainer (Ray side).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from rlrec.producer.spaces import space_to_json
from rlrec.store.storage import Storage
from rlrec.trainer.binding import check_name, pointer_bytes
from rlrec.trainer.policy import (
    ARTIFACT_VERSION,
    LATEST,
    LINEAGE,
    MAX_BYTES,
    SAFETENSORS_MODEL,
    SPEC,
    TORCHSCRIPT_MODEL,
    VERSION_DIR_RE,
    PolicyLoadError,
    _Files,
    _json,
    _parse_latest,
    version_dir,
)
from rlrec.trainer.publish_lease import PublishRootTaken
from rlrec.trainer.signing import SIG_SUFFIX, SignatureError, public_key_fingerprint, sign, verify

__all__ = [
    "PolicyArtifact",
    "Publication",
    "UndescribableModule",
    "build_artifact",
    "describe_module",
    "highest_version",
    "prepare_publication",
    "publish_policy",
    "refresh_latest",
    "republish_policy",
    "write_publication",
]

log = logging.getLogger("rlrec.trainer")


@dataclass
class Publication:
    """Every file of one version directory, ready to write (`prepare_publication`): weights,
    ``lineage.json``, ``policy.json`` and, when signed, ``policy.json.sig``. ``canary_base``
    (not None): it goes on canary above that version (`rlrec.trainer.canary_publish.write_canary`),
    started at ``canary_started``, instead of moving ``latest.json``."""

    version: int
    directory: str
    files: dict[str, bytes]
    run_id: str | None = None
    channel: str | None = None
    time: float = 0.0
    canary_base: int | None = None
    canary_started: float | None = None

    def describe(self) -> dict:
        """JSON-able fields (the files travel separately)."""
        return {
            "version": self.version,
            "directory": self.directory,
            "files": sorted(self.files),
            "run_id": self.run_id,
            "channel": self.channel,
            "time": self.time,
            "canary_base": self.canary_base,
            "canary_started": self.canary_started,
        }


class UndescribableModule(ValueError):
    """The RLModule's inference path is not a plain MLP the network spec can describe."""


@dataclass
class PolicyArtifact:
    """One exported network: the weights file (name -> bytes) and the spec fields describing it.

    ``fmt`` is ``"safetensors"`` (code-free: JSON network spec + tensors) or ``"torchscript"``
    (the fallback; code). ``fallback_reason`` says why the spec could not describe the module."""

    fmt: str
    files: dict[str, bytes]
    spec: dict
    fallback_reason: str | None = None
    tensors: dict[str, Any] = field(default_factory=dict)


def _dist_spec(module: Any, action_space: gym.Space) -> dict:
    from ray.rllib.core.distribution.torch.torch_distribution import (
        TorchCategorical,
        TorchDiagGaussian,
        TorchSquashedGaussian,
    )
    from ray.rllib.utils.numpy import MAX_LOG_NN_OUTPUT, MIN_LOG_NN_OUTPUT, SMALL_NUMBER

    cls = module.get_inference_action_dist_cls()
    if cls is TorchCategorical and isinstance(action_space, gym.spaces.Discrete):
        return {"type": "categorical", "n": int(action_space.n)}
    if isinstance(action_space, gym.spaces.Box):
        dim = int(np.prod(action_space.shape))
        if cls is TorchDiagGaussian:
            return {"type": "diag_gaussian", "dim": dim}
        if cls is TorchSquashedGaussian:
            return {
                "type": "squashed_gaussian",
                "dim": dim,
                "log_std_min": float(MIN_LOG_NN_OUTPUT),
                "log_std_max": float(MAX_LOG_NN_OUTPUT),
                "small_number": float(SMALL_NUMBER),
            }
    raise UndescribableModule(f"action distribution {getattr(cls, '__name__', cls)} on {action_space}")


def _inference_path(module: Any) -> tuple[Any, Any]:
    """(encoder, policy head) of a default RLModule, by exact class (a subclass may override forward)."""
    from ray.rllib.algorithms.bc.torch.default_bc_torch_rl_module import DefaultBCTorchRLModule
    from ray.rllib.algorithms.cql.torch.default_cql_torch_rl_module import DefaultCQLTorchRLModule
    from ray.rllib.algorithms.iql.torch.default_iql_torch_rl_module import DefaultIQLTorchRLModule
    from ray.rllib.algorithms.ppo.torch.default_ppo_torch_rl_module import DefaultPPOTorchRLModule
    from ray.rllib.algorithms.sac.torch.default_sac_torch_rl_module import DefaultSACTorchRLModule

    cls = type(module)
    if cls is DefaultBCTorchRLModule:
        return module._encoder, module._pi_head
    if cls is DefaultPPOTorchRLModule:  # MARWIL's default module
        enc = module.encoder
        return (enc.encoder if enc.config.shared else enc.actor_encoder), module.pi
    if cls in (DefaultCQLTorchRLModule, DefaultIQLTorchRLModule, DefaultSACTorchRLModule):
        return module.pi_encoder, module.pi
    raise UndescribableModule(f"RLModule class {cls.__module__}.{cls.__name__} is not one of RLlib's defaults")


def _mlp_layers(mlp: Any, what: str, layers: list[dict], tensors: dict[str, Any]) -> None:
    import torch
    from torch import nn

    names = {nn.Tanh: "tanh", nn.ReLU: "relu", nn.SiLU: "silu", nn.Sigmoid: "sigmoid"}
    for m in mlp:
        i = len(layers)
        if type(m) is nn.Linear:
            layers.append({"type": "linear", "in": m.in_features, "out": m.out_features, "bias": m.bias is not None})
            tensors[f"layers.{i}.weight"] = m.weight.detach().to(torch.float32).contiguous().clone()
            if m.bias is not None:
                tensors[f"layers.{i}.bias"] = m.bias.detach().to(torch.float32).contiguous().clone()
        elif type(m) is nn.LayerNorm and m.elementwise_affine and m.bias is not None and len(m.normalized_shape) == 1:
            layers.append({"type": "layer_norm", "dim": int(m.normalized_shape[0]), "eps": float(m.eps)})
            tensors[f"layers.{i}.weight"] = m.weight.detach().to(torch.float32).contiguous().clone()
            tensors[f"layers.{i}.bias"] = m.bias.detach().to(torch.float32).contiguous().clone()
        elif type(m) is nn.ELU:
            layers.append({"type": "elu", "alpha": float(m.alpha)})
        elif type(m) in names:
            layers.append({"type": names[type(m)]})
        elif type(m) is nn.Identity:
            continue
        else:
            raise UndescribableModule(f"{what}: layer {type(m).__name__} is not describable")


def describe_module(module: Any, observation_space: gym.Space, action_space: gym.Space) -> tuple[dict, dict, dict]:
    """(network spec, action distribution spec, tensors) of `module`'s inference path.

    Raises `UndescribableModule` when the spec cannot describe it exactly."""
    from ray.rllib.core.models.torch.encoder import TorchMLPEncoder
    from ray.rllib.core.models.torch.heads import TorchMLPHead
    from ray.rllib.core.models.torch.primitives import TorchMLP

    if not isinstance(observation_space, gym.spaces.Box) or len(observation_space.shape) != 1:
        raise UndescribableModule(f"observation space {observation_space} is not a flat Box")
    if module.is_stateful():
        raise UndescribableModule("stateful (recurrent) RLModule")
    encoder, head = _inference_path(module)
    if type(encoder) is not TorchMLPEncoder or type(encoder.net) is not TorchMLP:
        raise UndescribableModule(f"encoder {type(encoder).__name__} is not an MLP encoder")
    if type(head) is not TorchMLPHead or type(head.net) is not TorchMLP:
        raise UndescribableModule(f"policy head {type(head).__name__} is not an MLP head")
    dist = _dist_spec(module, action_space)
    layers: list[dict] = []
    tensors: dict[str, Any] = {}
    _mlp_layers(encoder.net.mlp, "encoder", layers, tensors)
    _mlp_layers(head.net.mlp, "head", layers, tensors)
    clip = float(head.log_std_clip_param_const.reshape(-1)[0]) if head.clip_log_std else None
    network = {"input_dim": int(observation_space.shape[0]), "layers": layers, "log_std_clip": clip}
    from rlrec.trainer.policy_net import NetworkSpecError, check_network_spec

    try:
        check_network_spec(network, dist)
    except NetworkSpecError as e:
        raise UndescribableModule(f"the description is inconsistent: {e}") from None
    return network, dist, tensors


def _module_from_algo(algo: Any) -> Any:
    """A fresh local copy of the default RLModule with the Learner's current weights."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    spec = algo.offline_data.module_spec if algo.offline_data is not None else None
    if spec is None:
        spec = algo.config.get_multi_rl_module_spec(
            spaces={DEFAULT_MODULE_ID: (algo.config.observation_space, algo.config.action_space)}
        )
    multi = spec.build()
    weights = algo.learner_group.get_weights()
    multi.set_state(weights)
    module = multi[DEFAULT_MODULE_ID]
    module.eval()
    return module


def _torchscript(module: Any, observation_space: gym.Space) -> bytes:
    """TorchScript (traced) of obs batch -> action distribution inputs, as bytes (the fallback)."""
    import torch
    from ray.rllib.core.columns import Columns

    class _Export(torch.nn.Module):
        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            return self.m._forward_inference({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]

    example = torch.as_tensor(np.stack([observation_space.sample() for _ in range(2)]).astype(np.float32))
    wrapper = _Export(module).eval()
    with torch.no_grad():
        traced = torch.jit.trace(wrapper, example, check_trace=False)
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    return buf.getvalue()


def _fallback_dist(module: Any, action_space: gym.Space) -> dict:
    try:
        return _dist_spec(module, action_space)
    except UndescribableModule as e:
        raise ValueError(f"cannot export a policy with {e}") from None


def build_artifact(module: Any, observation_space: gym.Space, action_space: gym.Space) -> PolicyArtifact:
    """The artifact `publish_policy` would write for `module`: safetensors + spec, else TorchScript."""
    from safetensors.torch import save

    try:
        network, dist, tensors = describe_module(module, observation_space, action_space)
    except UndescribableModule as e:
        reason = str(e)
        dist = _fallback_dist(module, action_space)
        data = _torchscript(module, observation_space)
        return PolicyArtifact(
            "torchscript",
            {TORCHSCRIPT_MODEL: data},
            {"format": "torchscript", "model": TORCHSCRIPT_MODEL, "action_dist": dist},
            fallback_reason=reason,
        )
    data = save(tensors, metadata={"format": "rlrec-policy"})
    return PolicyArtifact(
        "safetensors",
        {SAFETENSORS_MODEL: data},
        {"format": "safetensors", "model": SAFETENSORS_MODEL, "action_dist": dist, "network": network},
        tensors=tensors,
    )


def prepare_publication(
    *,
    algo: Any,
    version: int,
    algo_name: str,
    observation_space: gym.Space,
    action_space: gym.Space,
    iteration: int,
    timesteps_trained: int,
    shards: list[str] | None,
    new_shards: list[str],
    parent_version: int | None,
    signing_key: Any = None,
    artifact: PolicyArtifact | None = None,
    metadata: dict | None = None,
    run_id: str | None = None,
    channel: str | None = None,
    data: dict | None = None,
) -> Publication:
    """Build every file of ``v{version:06d}/`` (weights, lineage.json, policy.json[,
    policy.json.sig]) without writing anything; `write_publication` writes them.

    ``policy.json`` pins the sha256 of every other file of the version, its ``policy_version``,
    its directory name, and the `run_id` and `channel` it is published for; with `signing_key`
    (an Ed25519 private key) ``policy.json.sig`` is the signature over its exact bytes (and
    `write_publication` signs ``latest.json`` the same way). `artifact`: reuse an artifact built already (the promotion gate evaluated it).
    `metadata`: more keys for ``policy.json`` (signed with it; e.g. the promotion gate's
    decision and the algorithm's ``gamma``); keys the spec sets win. `run_id` / `channel`:
    None leaves them out (as before versions were bound; `rlrec train` always sets them).
    `data`: where the data it was trained on is (`rlrec.trainer.lineage`: ``input``, the store's
    URI; ``cursor``, the manifest point holding the shards; ``trained``, their manifest seq ranges
    per partition log, and ``shards_trained``, their number; ``holdout_fraction``), written into
    ``lineage.json``; `rlrec train` always sets it, with `shards` None (not listed: the list
    would grow with every shard of the run).

    Example:
        >>> pub = prepare_publication(algo=algo, version=3, algo_name="BC",  # doctest: +SKIP
        ...     observation_space=obs_space, action_space=act_space, iteration=30,
        ...     timesteps_trained=15360, shards=keys, new_shards=new, parent_version=2,
        ...     signing_key=key, run_id="5f0c...", channel="cartpole")
        >>> pub.directory, sorted(pub.files)  # doctest: +SKIP
        ('v000003', ['lineage.json', 'model.safetensors', 'policy.json', 'policy.json.sig'])
    """
    multi = artifact is not None and artifact.spec.get("format") == "multi_module"  # spaces per module
    if not multi and not isinstance(observation_space, gym.spaces.Box):
        raise ValueError(f"publishing needs a Box observation space, got {observation_space}")
    for what, value in (("run_id", run_id), ("channel", channel)):
        if value is not None:
            check_name(value, what)
    if artifact is None:
        artifact = build_artifact(_module_from_algo(algo), observation_space, action_space)
    if artifact.fallback_reason:
        log.warning(
            "policy v%d is published as TorchScript (code; services load it only when it is signed or "
            "with allow_unsigned_code=True): %s",
            version,
            artifact.fallback_reason,
        )
    d = version_dir(version)
    lineage = json.dumps(
        {
            "policy_version": version,
            "parent_version": parent_version,
            "iteration": iteration,
            **({} if shards is None else {"shards": sorted(shards)}),
            "new_shards": sorted(new_shards),
            **(data or {}),
        }
    ).encode()
    files = {**artifact.files, LINEAGE: lineage}
    spec = {
        **(metadata or {}),
        "artifact_version": ARTIFACT_VERSION,
        "policy_version": version,
        "directory": d,
        "algo": algo_name,
        **artifact.spec,
        **(
            {}
            if multi
            else {
                "observation_space": space_to_json(observation_space),
                "observation_shape": list(observation_space.shape),
                "action_space": space_to_json(action_space),
            }
        ),
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())},
        "iteration": iteration,
        "timesteps_trained": timesteps_trained,
        "parent_version": parent_version,
        "shards_trained": len(shards) if shards is not None else int((data or {}).get("shards_trained") or 0),
        "signing_key": public_key_fingerprint(signing_key.public_key()) if signing_key is not None else None,
        "time": time.time(),
    }
    if run_id is not None:
        spec["run_id"] = run_id
    if channel is not None:
        spec["channel"] = channel
    spec_bytes = json.dumps(spec, indent=1, sort_keys=True).encode()
    files[SPEC] = spec_bytes
    if signing_key is not None:
        files[f"{SPEC}{SIG_SUFFIX}"] = sign(signing_key, spec_bytes)
    return Publication(version=version, directory=d, files=files, run_id=run_id, channel=channel, time=spec["time"])


#: one create-once reservation per version number under the publish root
RESERVED_DIR = "_owners/publisher/versions"


class VersionTaken(PublishRootTaken):
    """Another writer reserved this version number: its directory is not this writer's to fill
    (a second publisher on the root)."""


def reserve_version(storage: Storage, version: int, token: bytes) -> None:
    """Reserve `version` for the publication identified by `token` (`Storage.create_once`, the
    conditional create of docs/GUARANTEES.md §6) before writing any of its files, so two writers
    never fill one version directory (a writer whose lease was taken while a write of its was in
    flight can only complete that write in its own version). Reserving again with the same
    token (a retry, a resumed trainer) succeeds.

    Raises:
        VersionTaken: another publication reserved `version`.

    Example:
        >>> import tempfile
        >>> st = Storage.from_uri(tempfile.mkdtemp())
        >>> reserve_version(st, 1, b"a"); reserve_version(st, 1, b"a")
        >>> reserve_version(st, 1, b"b")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        rlrec.trainer.export.VersionTaken: v1 is reserved by another publication ...
    """
    rel = f"{RESERVED_DIR}/{int(version):012d}"
    if storage.create_once(rel, token):
        return
    if _read_small(storage, rel, 4096) == token:
        return
    raise VersionTaken(f"v{version} is reserved by another publication under {storage.uri()}: not written")


#: how far above the highest signed version a reservation is believed (reservations are not
#: signed: one far above it is junk a key-less writer left, not a publication in flight)
MAX_RESERVED_AHEAD = 100


def highest_reserved(storage: Storage, signed_top: int) -> int:
    """The highest version number reserved under a publish root at most `MAX_RESERVED_AHEAD`
    above `signed_top` (the highest version signed there; 0: none). A reservation further above,
    or a name that is not 12 digits, is logged and ignored: the log is not signed, so it cannot
    push numbering out of range.

    Example:
        >>> highest_reserved(storage, highest_version(storage, key))  # doctest: +SKIP
        7
    """
    found, ignored = 0, []
    for item in storage.list(RESERVED_DIR):
        name = item.name
        if item.is_dir or len(name) != 12 or not name.isdigit():
            continue
        n = int(name)
        if n > signed_top + MAX_RESERVED_AHEAD:
            ignored.append(name)
        else:
            found = max(found, n)
    if ignored:
        log.error(
            "reservations %s under %s lie more than %d above the highest signed version v%d: ignored (not written "
            "by a trainer that publishes here)",
            ", ".join(sorted(ignored)[:5]),
            RESERVED_DIR,
            MAX_RESERVED_AHEAD,
            signed_top,
        )
    return found


def _publication_token(pub: Publication) -> bytes:
    return hashlib.sha256(pub.files[SPEC]).hexdigest().encode()


def write_publication(storage: Storage, pub: Publication, signing_key: Any = None, *, pointer: bool = True) -> None:
    """Write `pub` under the publish root: its files, then ``policy.json`` (which pins their
    sha256, so a version without it is not loadable), its signature, then -- with `pointer` --
    ``latest.json`` (version, path, sha256 of policy.json, run id, channel, time; signed in
    ``latest.json.sig`` with a key). Idempotent: writing the same publication again
    writes the same bytes (a trainer resuming from the checkpoint that carries it does).

    Args:
        storage: the publish root.
        pub: from `prepare_publication`.
        signing_key: the Ed25519 private key that signed it (signs the pointer too).
        pointer: move ``latest.json`` to this version.

    Example:
        >>> write_publication(storage, pub, key)  # doctest: +SKIP
    """
    reserve_version(storage, pub.version, _publication_token(pub))
    last = (SPEC, f"{SPEC}{SIG_SUFFIX}")
    for name, data in pub.files.items():
        if name not in last:
            storage.write(f"{pub.directory}/{name}", data)
    for name in last:
        if name in pub.files:
            storage.write(f"{pub.directory}/{name}", pub.files[name])
    _check_data_kept(storage, pub)  # the version directory pins its data from here on
    if pointer:
        _write_latest(
            storage,
            pointer_bytes(
                pub.version,
                pub.directory,
                hashlib.sha256(pub.files[SPEC]).hexdigest(),
                run_id=pub.run_id,
                channel=pub.channel,
                now=pub.time,
            ),
            signing_key,
        )


def _remove_refused(storage: Storage, pub: Publication) -> None:
    """Remove the version directory of a publication `_check_data_kept` refused (policy.json
    first: a version without it is not loadable nor pinned), so it pins no data."""
    last = (SPEC, f"{SPEC}{SIG_SUFFIX}")
    for name in (*last, *(n for n in pub.files if n not in last)):
        try:
            storage.delete(f"{pub.directory}/{name}")
        except Exception as e:  # left for a later publication of the same version to overwrite
            log.warning("removing %s/%s of refused policy v%d failed: %s", pub.directory, name, pub.version, e)


def _check_data_kept(storage: Storage, pub: Publication) -> None:
    """The pin rule at publication (docs/GUARANTEES.md, "Lineage pins"): once the version's
    directory is written, its lineage's data is checked against the removal log of the store it
    names (`rlrec.trainer.lineage.removed_data`). Data recorded as removed whose files stay long
    enough is re-pinned by the version (a warning). Data deleted, or whose grace is about to end,
    refuses the publication (`LineageError`: ``latest.json`` is not moved to it) only when it was
    trained on since the version before (the lineage's ``trained`` less its ``trained_before``):
    data the versions before had trained on that expired since is named in the lineage's
    ``expired_before_publication`` (a warning here), so one expired shard never blocks the
    versions after it. A refused version's directory is removed (`_remove_refused`)."""
    from rlrec.trainer.lineage import LineageError, _ranges_from_doc, ranges_minus, removed_data

    doc = json.loads(pub.files.get(LINEAGE, b"{}"))
    if not isinstance(doc.get("input"), str) or "trained" not in doc:
        return
    where = f"the lineage of policy version {pub.version}"
    trained = _ranges_from_doc(doc["trained"], where)
    before = _ranges_from_doc(doc.get("trained_before") or [], where)
    repinned, lost = removed_data(doc["input"], dict(trained))
    if lost:
        fresh = {k: ranges_minus(rs, before.get(k, ())) for k, rs in trained.items()}
        _, lost_fresh = removed_data(doc["input"], {k: rs for k, rs in fresh.items() if rs})
        if lost_fresh:
            _remove_refused(storage, pub)
            raise LineageError(
                f"policy version {pub.version}: {len(lost_fresh)} shard(s) of the data it was trained on since the "
                f"version before were removed by retention before it was published (e.g. {lost_fresh[0]}): not "
                "deployed; the next version is checked for the data trained after this one only (raise rlrec "
                "retain's --grace above the time from training on a shard to publishing the version that holds it, "
                "gate included)"
            )
        log.warning(
            "policy version %d: %d shard(s) trained on before the version before it were removed by retention "
            "(e.g. %s); published all the same, its lineage cannot reopen them",
            pub.version,
            len(lost),
            lost[0],
        )
    if repinned:
        log.warning(
            "policy version %d: %d shard(s) of its data are recorded as removed by retention (e.g. %s); the version "
            "pins them, so rlrec retain --policies keeps their files",
            pub.version,
            len(repinned),
            repinned[0],
        )


def publish_policy(storage: Storage, *, signing_key: Any = None, **kw: Any) -> dict:
    """`prepare_publication` (same keyword arguments) then `write_publication`; the policy.json written.

    Example:
        >>> publish_policy(storage, algo=algo, version=3, algo_name="BC",  # doctest: +SKIP
        ...     observation_space=obs_space, action_space=act_space, iteration=30,
        ...     timesteps_trained=15360, shards=keys, new_shards=new, parent_version=2,
        ...     signing_key=key, run_id="5f0c...", channel="cartpole")["directory"]
        'v000003'
    """
    pub = prepare_publication(signing_key=signing_key, **kw)
    write_publication(storage, pub, signing_key)
    return json.loads(pub.files[SPEC])


def _write_latest(storage: Storage, pointer: bytes, signing_key: Any) -> None:
    """Write ``latest.json`` and, with a key, ``latest.json.sig`` (a stale one is removed without)."""
    storage.write(LATEST, pointer)
    if signing_key is not None:
        storage.write(f"{LATEST}{SIG_SUFFIX}", sign(signing_key, pointer))
    else:
        storage.delete(f"{LATEST}{SIG_SUFFIX}")


def signed_floor(storage: Storage, version: int, signing_key: Any, channel: str | None) -> int:
    """The ``canary_floor`` of the ``latest.json`` under `storage` when it is signed by
    `signing_key` for `channel` and names `version` (0 otherwise): a rewrite of that pointer
    keeps it, so a rolled-back canary stays below the floor services trust. Raises OSError when
    it cannot be read now.

    Example:
        >>> signed_floor(Storage.from_uri("/tmp/rlrec-no-such-root"), 1, None, None)
        0
    """
    if signing_key is None:
        return 0
    try:
        data = _read_small(storage, LATEST, MAX_BYTES[LATEST])
        verify(signing_key.public_key(), data, _read_small(storage, f"{LATEST}{SIG_SUFFIX}", MAX_BYTES["sig"]))
        pointer = _parse_latest(data, LATEST)
    except (FileNotFoundError, SignatureError, PolicyLoadError):
        return 0
    if pointer.get("channel") != channel or pointer["policy_version"] != version:
        return 0
    return int(pointer.get("canary_floor") or 0)


def refresh_latest(
    storage: Storage, *, version: int, run_id: str, channel: str, signing_key: Any, canary_floor: int = 0
) -> bool:
    """Re-sign ``latest.json`` for the published `version` with the current time, so services
    with ``max_pointer_age_s`` see the trainer alive while no new version is published.

    Only a version this key signed for this channel (by this run or an earlier one: with
    ``--rollout canary`` an earlier run's version stays deployed until one of this run's
    canaries is promoted; the pointer keeps that version's run id), and only while
    ``latest.json`` names it, is re-pointed; anything else is logged and left as it is.

    Args:
        storage: the publish root.
        version: the version in use (the trainer's last publication).
        run_id: this run's id (logged when the version is an earlier run's).
        channel: this run's channel.
        signing_key: the Ed25519 private key that signed the version.
        canary_floor: the highest canary the trainer ended without a promotion (kept with the
            floor of the signed pointer it rewrites, `signed_floor`).

    Returns:
        True if the pointer was rewritten.

    Example:
        >>> refresh_latest(storage, version=3, run_id=run_id, channel="cartpole",  # doctest: +SKIP
        ...     signing_key=key)
        True
    """
    d = version_dir(version)
    try:
        current = _json(_read_small(storage, LATEST, MAX_BYTES[LATEST]), LATEST)
    except (OSError, PolicyLoadError):
        current = None
    if not isinstance(current, dict) or current.get("path") != d:
        log.info("not refreshing %s: it does not name this run's v%d", LATEST, version)
        return False
    try:
        spec_bytes, spec = _verified_spec(storage, d, signing_key)
    except (OSError, SignatureError, ValueError, PolicyLoadError) as e:
        log.error("not refreshing %s: %s/%s cannot be verified (%s)", LATEST, d, SPEC, e)
        return False
    if (spec.get("policy_version"), spec.get("channel")) != (version, channel):
        log.error("not refreshing %s: %s/%s is not this key's v%d on channel %s", LATEST, d, SPEC, version, channel)
        return False
    if spec.get("run_id") != run_id:
        log.debug("refreshing %s for v%d of an earlier run (%s)", LATEST, version, spec.get("run_id"))
    floor = max(canary_floor, signed_floor(storage, version, signing_key, channel))
    sha = hashlib.sha256(spec_bytes).hexdigest()
    pointer = pointer_bytes(version, d, sha, run_id=spec.get("run_id"), channel=channel, canary_floor=floor)
    _write_latest(storage, pointer, signing_key)
    return True


def _read_small(storage: Storage, rel: str, max_bytes: int) -> bytes:
    """A file of the publish root (which others may write), refused (PolicyLoadError) before it
    is read if it is larger than `max_bytes` or, on a local disk, not a regular file (a FIFO
    would block the trainer)."""
    if storage.kind == "local":
        return _Files(storage.uri("")).read(rel, max_bytes)
    info = storage.filesystem.get_file_info(storage.full_path(rel))
    if info.size is not None and info.size > max_bytes:
        raise PolicyLoadError(f"{rel} holds {info.size} bytes, over its limit of {max_bytes}: refused")
    data = storage.read(rel, limit=max_bytes)  # bounded: it may have grown since
    if len(data) > max_bytes:
        raise PolicyLoadError(f"{rel} holds more than {max_bytes} bytes, over its limit: refused")
    return data


def _verified_spec(storage: Storage, d: str, signing_key: Any) -> tuple[bytes, dict]:
    """(bytes, parsed) of ``d/policy.json`` after checking its signature with `signing_key`'s
    public key. Raises FileNotFoundError, SignatureError or ValueError (PolicyLoadError: a
    hostile file)."""
    spec_bytes = _read_small(storage, f"{d}/{SPEC}", MAX_BYTES[SPEC])
    verify(signing_key.public_key(), spec_bytes, _read_small(storage, f"{d}/{SPEC}{SIG_SUFFIX}", MAX_BYTES["sig"]))
    spec = _json(spec_bytes, f"{d}/{SPEC}")
    if not isinstance(spec, dict) or spec.get("policy_version") != int(d[1:]):
        raise ValueError(f"{d}/{SPEC} is not the policy.json of {d}")
    return spec_bytes, spec


def highest_version(storage: Storage, signing_key: Any = None) -> int:
    """The highest version published under a publish root (0: none); with `signing_key`, only
    versions whose policy.json that key signed count (junk directories do not).

    Args:
        storage: the publish root.
        signing_key: the Ed25519 private key of the publisher, or None.

    Example:
        >>> highest_version(Storage.from_uri("/tmp/rlrec-empty-policies"))
        0
    """
    names = sorted(i.name for i in storage.list("") if i.is_dir and VERSION_DIR_RE.match(i.name))
    for name in reversed(names):
        if signing_key is None:
            return int(name[1:])
        try:
            _verified_spec(storage, name, signing_key)
        except (OSError, SignatureError, ValueError, PolicyLoadError):
            continue
        return int(name[1:])
    return 0


def republish_policy(
    storage: Storage,
    *,
    version: int,
    signing_key: Any,
    new_version: int | None = None,
    run_id: str | None = None,
    channel: str | None = None,
    metadata: dict | None = None,
) -> dict:
    """Roll back: publish `version`'s weights again as a new, higher version and point
    ``latest.json`` at it (services never go back to a lower version).

    The old version's ``policy.json`` must verify with `signing_key` and its files must match
    their sha256; the new one keeps its weights, spec and lineage, and records
    ``republished_from``; it is deployed, never a canary (an old canary's ``"rollout"`` is not
    copied). Stop the trainer first: its next publication goes above the highest
    version present.

    Args:
        storage: the publish root.
        version: the version whose weights to serve again.
        signing_key: the Ed25519 private key (the trainer's).
        new_version: the new version number (default: the highest signed version present + 1).
        run_id: the run id to sign it for (default: the old version's).
        channel: the channel to sign it for (default: the old version's).
        metadata: more keys for the new policy.json (e.g. the canary decision that rolled back).
            Without `signing_key` (None) the old version is read unverified and the new one
            is unsigned, as an unsigned trainer publishes.

    Returns:
        The new version's policy.json.

    Raises:
        ValueError: the old version cannot be verified, or `new_version` is not above every
            published version.

    Example:
        >>> from rlrec.trainer.signing import load_private_key  # doctest: +SKIP
        >>> republish_policy(Storage.from_uri("s3://bucket/run1/policies"), version=3,  # doctest: +SKIP
        ...     signing_key=load_private_key("/keys/policy-signing.key"))["policy_version"]
        8
    """
    d = version_dir(version)
    try:
        if signing_key is None:
            spec = _json(_read_small(storage, f"{d}/{SPEC}", MAX_BYTES[SPEC]), f"{d}/{SPEC}")
            if not isinstance(spec, dict) or spec.get("policy_version") != version:
                raise ValueError(f"{d}/{SPEC} is not the policy.json of {d}")
        else:
            _spec_bytes, spec = _verified_spec(storage, d, signing_key)
        files = {name: _read_small(storage, f"{d}/{name}", MAX_BYTES["model"]) for name in spec["files"]}
    except (OSError, SignatureError, ValueError, KeyError, TypeError, PolicyLoadError) as e:
        raise ValueError(f"{d} cannot be republished: {type(e).__name__}: {e}") from None
    for name, data in files.items():
        if hashlib.sha256(data).hexdigest() != spec["files"][name]:
            raise ValueError(f"{d}/{name} does not match the sha256 in its policy.json")
    top = highest_version(storage, signing_key)
    new = max(top, highest_reserved(storage, top)) + 1 if new_version is None else int(new_version)
    if new <= top:
        raise ValueError(f"the new version must be above v{top}, got v{new}")
    nd = version_dir(new)
    run_id, channel = run_id or spec.get("run_id"), channel or spec.get("channel")
    new_spec = {
        **{k: v for k, v in spec.items() if k not in ("rolled_back", "rollout")},
        **(metadata or {}),
        "policy_version": new,
        "directory": nd,
        "parent_version": top or None,
    }
    new_spec.update({"republished_from": version, "time": time.time(), "run_id": run_id, "channel": channel})
    new_spec = {k: v for k, v in new_spec.items() if not (k in ("run_id", "channel") and v is None)}
    spec_bytes = json.dumps(new_spec, indent=1, sort_keys=True).encode()
    reserve_version(storage, new, hashlib.sha256(spec_bytes).hexdigest().encode())
    for name, data in files.items():
        storage.write(f"{nd}/{name}", data)
    storage.write(f"{nd}/{SPEC}", spec_bytes)
    if signing_key is not None:
        storage.write(f"{nd}/{SPEC}{SIG_SUFFIX}", sign(signing_key, spec_bytes))
    sha = hashlib.sha256(spec_bytes).hexdigest()
    _write_latest(storage, pointer_bytes(new, nd, sha, run_id=run_id, channel=channel), signing_key)
    log.info("republished %s as %s (run %s, channel %s)", d, nd, run_id, channel)
    return new_spec
