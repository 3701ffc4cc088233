"""A published policy network rebuilt in plain torch from data: a JSON spec plus safetensors weights.

The spec (``policy.json`` key ``"network"``) describes the inference path of RLlib 2.60's default
RLModules (an MLP encoder followed by an MLP policy head, Linear layers with an activation) and
the action distribution that reads its output::

    "network": {"input_dim": 4,
                "layers": [{"type": "linear", "in": 4, "out": 256, "bias": true}, {"type": "tanh"},
                           {"type": "linear", "in": 256, "out": 256, "bias": true}, {"type": "tanh"},
                           {"type": "linear", "in": 256, "out": 2, "bias": true}],
                "log_std_clip": null}
    "action_dist": {"type": "categorical", "n": 2}
                 | {"type": "diag_gaussian", "dim": 1}
                 | {"type": "squashed_gaussian", "dim": 1, "log_std_min": -5.0, "log_std_max": 2.0,
                    "small_number": 1e-06}

The i-th layer of type ``linear`` reads the tensors ``layers.{i}.weight`` ``(out, in)`` and
``layers.{i}.bias`` ``(out,)``; ``layer_norm`` reads ``layers.{i}.weight`` / ``.bias`` ``(dim,)``.
Nothing else is loaded: no TorchScript, no pickle, no code from the artifact. Every tensor must be
float32, named by the spec, with the shape the spec implies (extra or missing tensors are refused).

The distributions are re-implemented here with the formulas of RLlib 2.60
(`ray.rllib.core.distribution.torch.torch_distribution`: ``TorchCategorical``,
``TorchDiagGaussian``, ``TorchSquashedGaussian`` with ``low=-1, high=1``), so that action
distribution inputs, greedy actions and log-probabilities equal the RLModule's
(tests/test_policy_artifacts.py). Torch only: never imports Ray.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

__all__ = [
    "ACTIVATIONS",
    "DISTRIBUTIONS",
    "NetworkSpecError",
    "PolicyDistribution",
    "build_network",
    "check_network_spec",
    "dist_output_dim",
]

#: activation name in the spec -> torch.nn class name
ACTIVATIONS = {"tanh": "Tanh", "relu": "ReLU", "silu": "SiLU", "elu": "ELU", "sigmoid": "Sigmoid"}
DISTRIBUTIONS = ("categorical", "diag_gaussian", "squashed_gaussian")
MAX_LAYERS = 64
MAX_WIDTH = 1 << 16


class NetworkSpecError(ValueError):
    """The network spec or its tensors are malformed or inconsistent."""


def _int(d: dict, key: str, lo: int = 1, hi: int = MAX_WIDTH) -> int:
    v = d.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise NetworkSpecError(f"{key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _float(d: dict, key: str) -> float:
    v = d.get(key)
    if type(v) not in (int, float) or not math.isfinite(v):
        raise NetworkSpecError(f"{key!r} must be a finite number, got {v!r}")
    return float(v)


def dist_output_dim(dist: dict) -> int:
    """How many action distribution inputs the distribution `dist` (spec) reads."""
    if not isinstance(dist, dict) or dist.get("type") not in DISTRIBUTIONS:
        raise NetworkSpecError(f"action_dist must be one of {DISTRIBUTIONS}, got {dist!r:.200}")
    if dist["type"] == "categorical":
        return _int(dist, "n")
    return 2 * _int(dist, "dim")


def check_network_spec(network: Any, dist: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Validate `network` against `dist`; the (tensor name, shape) list the weights file must hold."""
    if not isinstance(network, dict):
        raise NetworkSpecError("network must be an object")
    layers = network.get("layers")
    if not isinstance(layers, list) or not 1 <= len(layers) <= MAX_LAYERS:
        raise NetworkSpecError(f"network.layers must be a list of 1..{MAX_LAYERS} layers")
    width = _int(network, "input_dim")
    tensors: list[tuple[str, tuple[int, ...]]] = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise NetworkSpecError(f"layer {i} must be an object")
        kind = layer.get("type")
        if kind == "linear":
            if _int(layer, "in") != width:
                raise NetworkSpecError(f"layer {i}: in={layer['in']} but the previous layer gives {width}")
            width = _int(layer, "out")
            tensors.append((f"layers.{i}.weight", (width, layer["in"])))
            if layer.get("bias") is True:
                tensors.append((f"layers.{i}.bias", (width,)))
            elif layer.get("bias") is not False:
                raise NetworkSpecError(f"layer {i}: bias must be true or false")
        elif kind == "layer_norm":
            if _int(layer, "dim") != width:
                raise NetworkSpecError(f"layer {i}: layer_norm over {layer['dim']}, the input has {width}")
            _float(layer, "eps")
            tensors += [(f"layers.{i}.weight", (width,)), (f"layers.{i}.bias", (width,))]
        elif kind == "elu":
            _float(layer, "alpha")
        elif kind not in ACTIVATIONS:
            raise NetworkSpecError(f"layer {i}: unknown layer type {kind!r}")
    if width != dist_output_dim(dist):
        raise NetworkSpecError(
            f"the network outputs {width} values, the {dist['type']} distribution reads {dist_output_dim(dist)}"
        )
    clip = network.get("log_std_clip")
    # RLlib's TorchMLPHead clamps the second half of its output
    if clip is not None and (width % 2 or _float(network, "log_std_clip") <= 0):
        raise NetworkSpecError("log_std_clip must be positive and needs an even output width")
    if dist["type"] == "squashed_gaussian":
        if _float(dist, "log_std_min") >= _float(dist, "log_std_max"):
            raise NetworkSpecError("log_std_min must be below log_std_max")
        if not 0 < _float(dist, "small_number") < 0.5:
            raise NetworkSpecError("small_number must be in (0, 0.5)")
    return tensors


def build_network(network: dict, dist: dict, tensors: dict[str, Any]) -> Any:
    """A `torch.nn.Module`: obs batch ``(B, input_dim)`` float32 -> action distribution inputs."""
    import torch
    from torch import nn

    expected = check_network_spec(network, dist)
    names = {n for n, _ in expected}
    extra = sorted(set(tensors) - names)
    if extra:
        raise NetworkSpecError(f"the weights file holds tensors the spec does not name: {extra[:5]}")
    for name, shape in expected:
        t = tensors.get(name)
        if t is None:
            raise NetworkSpecError(f"the weights file lacks tensor {name}")
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise NetworkSpecError(f"tensor {name} is {t.dtype}{list(t.shape)}, expected float32{list(shape)}")
        if not torch.isfinite(t).all():
            raise NetworkSpecError(f"tensor {name} holds NaN or infinite values")
    modules: list[nn.Module] = []
    for i, layer in enumerate(network["layers"]):
        kind = layer["type"]
        if kind == "linear":
            m = nn.Linear(layer["in"], layer["out"], bias=layer["bias"])
            with torch.no_grad():
                m.weight.copy_(tensors[f"layers.{i}.weight"])
                if layer["bias"]:
                    m.bias.copy_(tensors[f"layers.{i}.bias"])
        elif kind == "layer_norm":
            m = nn.LayerNorm(layer["dim"], eps=float(layer["eps"]))
            with torch.no_grad():
                m.weight.copy_(tensors[f"layers.{i}.weight"])
                m.bias.copy_(tensors[f"layers.{i}.bias"])
        elif kind == "elu":
            m = nn.ELU(alpha=float(layer["alpha"]))
        else:
            m = getattr(nn, ACTIVATIONS[kind])()
        modules.append(m)
    clip = network.get("log_std_clip")
    return _Network(nn.Sequential(*modules), None if clip is None else float(clip)).eval()


@functools.lru_cache(maxsize=1)
def _network_class() -> type:
    from torch import nn

    class Network(nn.Module):
        """The MLP, then RLlib's ``TorchMLPHead`` log-std clipping (when its head clips)."""

        def __init__(self, mlp: nn.Module, log_std_clip: float | None) -> None:
            super().__init__()
            self.mlp = mlp
            self.log_std_clip = log_std_clip

        def forward(self, obs: Any) -> Any:
            import torch

            out = self.mlp(obs)
            if self.log_std_clip is None:
                return out
            mean, log_std = torch.chunk(out, 2, dim=-1)
            return torch.cat((mean, torch.clamp(log_std, -self.log_std_clip, self.log_std_clip)), dim=-1)

    return Network


def _Network(mlp: Any, log_std_clip: float | None) -> Any:
    return _network_class()(mlp, log_std_clip)


class PolicyDistribution:
    """RLlib 2.60's action distribution named by a spec, on one row of action distribution inputs.

    Guarantees (tested against RLlib): `deterministic` is RLlib's ``to_deterministic().sample()``;
    `logp(inputs, action)` is RLlib's ``dist.logp(action)``; `sample` draws like RLlib's
    ``sample()``. Actions here are in the distribution's own units (for the squashed Gaussian
    [-1, 1], like RLlib's ``TorchSquashedGaussian`` with ``low=-1, high=1``); `to_env` maps them
    to the action space (squashed Gaussian: scaled to the bounds; diagonal Gaussian: clipped).
    """

    def __init__(self, dist: dict, action_space: dict | None = None) -> None:
        dist_output_dim(dist)
        self.kind = dist["type"]
        self.spec = dict(dist)
        self.low = self.high = None
        self.shape: tuple[int, ...] = ()
        if action_space is not None and action_space.get("type") == "Box":
            self.shape = tuple(action_space["shape"])
            self.low = np.asarray(action_space["low"], dtype=np.float32).reshape(self.shape)
            self.high = np.asarray(action_space["high"], dtype=np.float32).reshape(self.shape)

    def _gauss(self, inputs: Any) -> tuple[Any, Any]:
        import torch

        mean, log_std = torch.chunk(inputs, 2, dim=-1)
        if self.kind == "squashed_gaussian":
            log_std = torch.clamp(log_std, self.spec["log_std_min"], self.spec["log_std_max"])
        return mean, log_std

    def deterministic(self, inputs: Any) -> Any:
        """RLlib's ``dist.to_deterministic().sample()``: the argmax, or the Gaussian's mean (for the
        squashed Gaussian RLlib returns the mean *before* the tanh)."""
        import torch

        if self.kind == "categorical":
            return torch.argmax(inputs, dim=-1)
        return self._gauss(inputs)[0]

    def greedy(self, inputs: Any) -> Any:
        """The action `Policy.act` takes without exploring, in distribution units: `deterministic`,
        squashed into [-1, 1] for the squashed Gaussian (its samples live there)."""
        import torch

        a = self.deterministic(inputs)
        return torch.clamp(torch.tanh(a), -1.0, 1.0) if self.kind == "squashed_gaussian" else a

    def sample(self, inputs: Any, generator: Any = None) -> Any:
        import torch

        if self.kind == "categorical":
            return torch.multinomial(torch.softmax(inputs, dim=-1), 1, generator=generator).squeeze(-1)
        mean, log_std = self._gauss(inputs)
        z = mean + torch.exp(log_std) * torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
        return torch.clamp(torch.tanh(z), -1.0, 1.0) if self.kind == "squashed_gaussian" else z

    def logp(self, inputs: Any, action: Any) -> Any:
        import torch

        if self.kind == "categorical":
            logp_all = torch.log_softmax(inputs, dim=-1)
            return torch.gather(logp_all, -1, action.long().unsqueeze(-1)).squeeze(-1)
        mean, log_std = self._gauss(inputs)
        if self.kind == "squashed_gaussian":
            eps = self.spec["small_number"]
            action = torch.atanh(torch.clamp(action, -1.0 + eps, 1.0 - eps))
        scale = torch.exp(log_std)
        normal = torch.distributions.Normal(mean, scale, validate_args=False)
        logp = normal.log_prob(action).sum(-1)
        if self.kind == "squashed_gaussian":
            jacobian = 2.0 * (math.log(2.0) - action - torch.nn.functional.softplus(-2.0 * action))
            logp = logp - jacobian.sum(-1)
        return logp

    def from_env(self, actions: np.ndarray) -> np.ndarray:
        """Env actions (a batch, as recorded) -> distribution units (inverse of `to_env` where it
        is invertible: the squashed Gaussian's scaling; a clipped Gaussian action stays clipped)."""
        a = np.asarray(actions)
        if self.kind == "categorical":
            return a.astype(np.int64).reshape(-1)
        a = a.astype(np.float32).reshape((len(a), -1))
        if self.kind == "squashed_gaussian" and self.low is not None:
            low, high = self.low.reshape(1, -1), self.high.reshape(1, -1)
            a = 2.0 * (a - low) / (high - low) - 1.0
        return a

    def to_env_batch(self, actions: Any) -> np.ndarray:
        """A batch of distribution-unit actions -> env actions, ``(B,)`` ints or ``(B, *shape)``."""
        a = np.asarray(actions)
        if self.kind == "categorical":
            return a.astype(np.int64)
        a = a.astype(np.float32).reshape((len(a), -1))
        if self.low is None:
            return a
        low, high = self.low.reshape(1, -1), self.high.reshape(1, -1)
        if self.kind == "squashed_gaussian":
            a = low + (a + 1.0) * 0.5 * (high - low)
        return np.clip(a, low, high).reshape((len(a), *self.shape)).astype(np.float32)

    def to_env(self, action: np.ndarray) -> Any:
        """A distribution-unit action (one row) -> the action the environment takes."""
        if self.kind == "categorical":
            return int(action)
        a = np.asarray(action, dtype=np.float32)
        if self.low is None:
            return a
        if self.kind == "squashed_gaussian":
            a = self.low + (a.reshape(self.shape) + 1.0) * 0.5 * (self.high - self.low)
        return np.clip(a.reshape(self.shape), self.low, self.high).astype(np.float32)
