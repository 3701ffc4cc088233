"""The trainer's promotion gate (trainer/promotion.py): the decision rule and the evaluation of an
exported policy artifact (safetensors + network spec, rebuilt like load_policy does; torch +
gymnasium only, no Ray). The gate inside the running trainer is
covered end to end by tests/test_demo.py (decisions in metrics.jsonl)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rlrec.trainer.promotion import decide, evaluate_exported  # noqa: E402

SPEC = {
    "policy_version": 1,
    "format": "safetensors",
    "action_dist": {"type": "categorical", "n": 2},
    "network": {"input_dim": 4, "layers": [{"type": "linear", "in": 4, "out": 2, "bias": False}], "log_std_clip": None},
    "action_space": {"type": "Discrete", "n": 2},
    "observation_shape": [4],
}


def _expert(sign: float) -> bytes:
    """safetensors weights of the scripted CartPole expert's logits (push towards where the pole
    falls: s = obs[2] + 0.5 obs[3], logits (-s, s)), or of its opposite."""
    from safetensors.torch import save

    w = sign * torch.tensor([[0.0, 0.0, -1.0, -0.5], [0.0, 0.0, 1.0, 0.5]])
    return save({"layers.0.weight": w})


def test_decide_promotes_only_when_not_worse():
    assert decide(1, 100.0, None, None).promoted  # nothing deployed yet
    assert decide(1, 100.0, None, 120.0).promoted is False  # below the baseline
    assert decide(3, 500.0, 2, 500.0).promoted  # equal is not worse
    d = decide(3, 499.0, 2, 500.0)
    assert d.promoted is False
    assert d.to_dict() == {
        "candidate_version": 3,
        "candidate_return": 499.0,
        "deployed_version": 2,
        "deployed_return": 500.0,
        "promoted": False,
    }


def test_evaluate_exported_measures_the_artifact():
    good = evaluate_exported(_expert(1.0), SPEC, "CartPole-v1", episodes=3, seed=0)
    bad = evaluate_exported(_expert(-1.0), SPEC, "CartPole-v1", episodes=3, seed=0)
    assert good == 500.0
    assert bad < 50.0
    # same seeds, same greedy policy: the same number (candidates and deployed compare fairly)
    assert evaluate_exported(_expert(-1.0), SPEC, "CartPole-v1", episodes=3, seed=0) == bad
