"""Published policies: loading and acting with torch only (never Ray).

Layout written by the trainer (`rlrec.trainer.export.publish_policy`) under the publish root
(default ``{checkpoint_dir}/policies``)::

    latest.json                      {"policy_version": N, "path": "v00000N", "sha256": <policy.json>}
    v00000N/policy.json              spec: version, algo, spaces, action distribution, model sha256,
                                     training iteration/timesteps, time
    v00000N/model.pt                 TorchScript: obs batch (float32) -> action distribution inputs
    v00000N/lineage.json             the shards this version was trained on

`latest.json` is written last (atomically), so a reader never sees a half-published version.
``policy_version`` increases by one per publication and survives trainer restarts.

A deployed service::

    from rlrec import load_policy            # or: from rlrec.trainer import load_policy
    policy = load_policy("s3://bucket/run/policies")
    action, extra = policy.act(obs)          # extra: action_dist_inputs, action_logp
    recorder.policy_version = policy.policy_version   # data recorded now carries the version
    ...
    if policy.poll():                        # a newer version was published: now loaded
        recorder.policy_version = policy.policy_version

Loading checks the model file against the sha256 in ``policy.json`` and uses `torch.jit.load`
(TorchScript: restricted deserialisation, no arbitrary pickles). Only this module, numpy, json
and torch are imported; other URIs than local paths use pyarrow's filesystems (lazily).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import threading
import time
from typing import Any

import numpy as np

__all__ = ["Policy", "PolicyLoadError", "load_policy", "read_latest"]

LATEST = "latest.json"
SPEC = "policy.json"
MODEL = "model.pt"
LINEAGE = "lineage.json"


class PolicyLoadError(RuntimeError):
    """A published policy is missing, incomplete or does not match its checksum."""


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

    def read(self, rel: str) -> bytes:
        if self.local:
            with open(os.path.join(self.root, *rel.split("/")), "rb") as f:
                return f.read()
        try:
            with self.fs.open_input_stream(f"{self.root}/{rel}") as f:
                return f.read()
        except OSError as e:
            if "not found" in str(e).lower() or "no such" in str(e).lower():
                raise FileNotFoundError(rel) from None
            raise

    def exists(self, rel: str) -> bool:
        if self.local:
            return os.path.exists(os.path.join(self.root, *rel.split("/")))
        import pyarrow.fs as pafs

        return self.fs.get_file_info(f"{self.root}/{rel}").type != pafs.FileType.NotFound


def read_latest(root: str) -> dict:
    """The ``latest.json`` pointer of a publish root (FileNotFoundError if nothing is published)."""
    return json.loads(_Files(root).read(LATEST))


# ------------------------------------------------------------------------------- acting


def _logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    return m + math.log(float(np.sum(np.exp(x - m))))


class _Model:
    """One loaded version: TorchScript module + spec."""

    def __init__(self, spec: dict, module: Any) -> None:
        self.spec = spec
        self.module = module
        self.version = int(spec["policy_version"])
        self.dist = spec["action_dist"]
        self.action_space = spec["action_space"]  # rlrec.producer.spaces JSON
        self.obs_shape = tuple(spec["observation_shape"])
        a = self.action_space
        if a.get("type") == "Box":
            self.low = np.asarray(a["low"], dtype=np.float32).reshape(a["shape"])
            self.high = np.asarray(a["high"], dtype=np.float32).reshape(a["shape"])
            self.act_shape = tuple(a["shape"])

    def forward(self, obs: np.ndarray) -> np.ndarray:
        import torch

        x = torch.as_tensor(np.asarray(obs, dtype=np.float32).reshape((1, *self.obs_shape)))
        with torch.no_grad():
            out = self.module(x)
        return out[0].cpu().numpy().astype(np.float32)

    def act(self, obs: Any, explore: bool, rng: np.random.Generator) -> tuple[Any, dict]:
        logits = self.forward(obs)
        if self.dist == "categorical":
            logp_all = logits - _logsumexp(logits)
            a = (
                int(rng.choice(len(logits), p=np.exp(logp_all) / np.exp(logp_all).sum()))
                if explore
                else int(np.argmax(logits))
            )
            return a, {"action_dist_inputs": logits, "action_logp": np.float32(logp_all[a])}
        if self.dist in ("diag_gaussian", "squashed_gaussian"):
            n = logits.shape[-1] // 2
            mean, log_std = logits[:n], logits[n:]
            std = np.exp(log_std)
            z = mean + std * rng.standard_normal(n).astype(np.float32) if explore else mean
            logp = float(np.sum(-0.5 * ((z - mean) / std) ** 2 - log_std - 0.5 * math.log(2 * math.pi)))
            if self.dist == "squashed_gaussian":
                t = np.tanh(z)
                logp -= float(np.sum(np.log(1 - t**2 + 1e-6)))
                a = self.low + (t + 1.0) * 0.5 * (self.high - self.low)
            else:
                a = np.clip(z, self.low, self.high)
            a = a.reshape(self.act_shape).astype(np.float32)
            return a, {"action_dist_inputs": logits, "action_logp": np.float32(logp)}
        raise PolicyLoadError(f"unsupported action distribution {self.dist!r}")


def _load_version(files: _Files, rel_dir: str) -> _Model:
    import torch

    try:
        spec = json.loads(files.read(f"{rel_dir}/{SPEC}"))
        data = files.read(f"{rel_dir}/{MODEL}")
    except FileNotFoundError as e:
        raise PolicyLoadError(f"published policy {rel_dir} is incomplete: {e} missing") from None
    if hashlib.sha256(data).hexdigest() != spec.get("model_sha256"):
        raise PolicyLoadError(f"{rel_dir}/{MODEL} does not match the sha256 in {SPEC}")
    module = torch.jit.load(io.BytesIO(data), map_location="cpu")
    module.eval()
    return _Model(spec, module)


class Policy:
    """A published policy, ready to act; `poll()` switches to a newer published version."""

    def __init__(
        self, root: str, *, version: int | None = None, explore: bool = False, seed: int | None = None
    ) -> None:
        self.root = root
        self.explore = explore
        self._files = _Files(root)
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        if version is None:
            latest = self._latest()
            self._model = _load_version(self._files, latest["path"])
        else:
            self._model = _load_version(self._files, f"v{int(version):06d}")

    def _latest(self) -> dict:
        try:
            return json.loads(self._files.read(LATEST))
        except FileNotFoundError:
            raise PolicyLoadError(f"no policy is published under {self.root} (no {LATEST})") from None

    @property
    def policy_version(self) -> int:
        return self._model.version

    @property
    def spec(self) -> dict:
        return dict(self._model.spec)

    def act(self, obs: Any, explore: bool | None = None) -> tuple[Any, dict]:
        """One observation -> (action, extra_model_outputs)."""
        with self._lock:
            model = self._model
        return model.act(obs, self.explore if explore is None else explore, self._rng)

    def poll(self) -> bool:
        """Load the published `latest` version if it is newer than the current one; True if switched."""
        latest = self._latest()
        if int(latest["policy_version"]) <= self._model.version:
            return False
        model = _load_version(self._files, latest["path"])
        with self._lock:
            if model.version <= self._model.version:
                return False
            self._model = model
        return True

    def start_polling(self, interval_s: float = 5.0, on_update: Any = None) -> None:
        """Poll in a daemon thread; `on_update(policy)` after each switch."""

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    if self.poll() and on_update is not None:
                        on_update(self)
                except Exception:  # keep acting with the current version
                    pass

        if self._poller is None:
            self._poller = threading.Thread(target=loop, name="rlrec-policy-poll", daemon=True)
            self._poller.start()

    def stop_polling(self) -> None:
        self._stop.set()

    def lineage(self) -> dict:
        return json.loads(self._files.read(f"v{self.policy_version:06d}/{LINEAGE}"))

    def __repr__(self) -> str:
        return f"Policy({self.root!r}, policy_version={self.policy_version}, dist={self._model.dist!r})"


def load_policy(
    uri: str, *, version: int | None = None, explore: bool = False, seed: int | None = None, wait_s: float = 0.0
) -> Policy:
    """Load the latest (or a given) published policy under `uri` (a publish root, e.g.
    ``{checkpoint_dir}/policies``; a checkpoint dir with a ``policies/`` folder works too).
    `wait_s` > 0: wait that long for a first publication."""
    root = os.fspath(uri).rstrip("/")
    files = _Files(root)
    if not files.exists(LATEST) and files.exists(f"policies/{LATEST}"):
        root = f"{root}/policies"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return Policy(root, version=version, explore=explore, seed=seed)
        except PolicyLoadError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
