"""Fold the events of one multi-agent episode back into the dicts its env returned.

`fold_multi_agent` is pure: it takes the decoded events of one multi-agent episode in the order
their partition holds them (`MultiAgentEpisodeStart`, `MultiAgentStepBatch`es, `RewardDelta`s with
an `agent_id`, at most one `EpisodeAbort`) and returns the `MultiAgentRecording` they describe:
the reset dicts and one `MultiAgentEnvStep` per env step, each value rebuilt from its leaves as
the space nests it. A `RewardDelta` is added to that env step's reward for that agent; an
`EpisodeAbort` sets `aborted`. An inconsistent sequence raises `DecodeError` with a reason code
(docs/FORMAT.md, "Multi-agent episodes"), and so do env steps RLlib's `MultiAgentEpisode` would
refuse (`MultiAgentRules`) and an `ended` that disagrees with RLlib's done-ness: a recording this
returns replays through RLlib.

Example:
    >>> import numpy as np
    >>> from gymnasium import spaces
    >>> from rlrec.producer.multi_agent_events import (
    ...     ACTION, OBSERVATION, REWARD, AgentColumn, AgentSpec, MultiAgentEpisodeStart,
    ...     MultiAgentStepBatch)
    >>> box, act = spaces.Box(-1.0, 1.0, (2,), np.float32), spaces.Discrete(2)
    >>> start = MultiAgentEpisodeStart("ep", "p", 1, {"a": AgentSpec("a", "m", box, act)},
    ...                                observations={"a": [np.zeros(2, np.float32)]})
    >>> col = AgentColumn("a", np.array([OBSERVATION | ACTION | REWARD], np.uint8),
    ...                   [np.ones((1, 2), np.float32)], [np.array([1])], np.array([0.5]))
    >>> rec = fold_multi_agent([start, MultiAgentStepBatch("ep", 0, np.array([3], np.uint8), [col], True)])
    >>> rec.steps[0].rewards, rec.steps[0].terminateds
    ({'a': 0.5}, {'__all__': True})
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from rlrec.producer.events import DecodeError, EpisodeAbort, RewardDelta, check_leaves, check_values
from rlrec.producer.multi_agent_events import (
    ACTION,
    ALL_TERMINATED,
    ALL_TERMINATED_TRUE,
    ALL_TRUNCATED,
    ALL_TRUNCATED_TRUE,
    INFO,
    OBSERVATION,
    REWARD,
    TERMINATED,
    TERMINATED_TRUE,
    TRUNCATED,
    TRUNCATED_TRUE,
    AgentColumn,
    AgentSpec,
    MultiAgentEpisodeStart,
    MultiAgentStepBatch,
)
from rlrec.producer.multi_agent_recording import MultiAgentEnvStep, MultiAgentRecording, MultiAgentReset
from rlrec.producer.multi_agent_rules import MultiAgentRules
from rlrec.producer.spaces import unflatten_leaves

__all__ = ["fold_multi_agent"]


def _value(space: Any, leaves: list[np.ndarray], i: int | None) -> Any:
    """The value at row `i` of stacked leaves (`i` None: unstacked leaves), nested as `space`."""
    row = leaves if i is None else [a[i] for a in leaves]
    return unflatten_leaves(space, row)


class _Folder:
    def __init__(self, start: MultiAgentEpisodeStart, validate_values: bool) -> None:
        self.start = start
        self.validate_values = validate_values
        self.extra: dict[str, dict[str, tuple]] = {}  # agent -> name -> (dtype, per-step shape)
        agents = start.agents
        if validate_values:  # the reset observations as the env steps' (`column`)
            for a, leaves in start.observations.items():
                check_values(leaves, agents[a].observation_leaves, f"reset observation of {a[:60]!r}")
        self.rec = MultiAgentRecording(
            episode_id=start.episode_id,
            policy_id=start.policy_id,
            policy_version=start.policy_version,
            agent_modules={a: s.module_id for a, s in agents.items()},
            reset=MultiAgentReset(
                observations={
                    a: _value(agents[a].observation_space, leaves, None) for a, leaves in start.observations.items()
                },
                infos=dict(start.infos),
            ),
            observation_spaces={a: s.observation_space for a, s in agents.items()},
            action_spaces={a: s.action_space for a, s in agents.items()},
            env_id=start.env_id,
        )
        self.ended = False
        self.rules = MultiAgentRules()  # what RLlib's MultiAgentEpisode accepts
        self.rules.reset(start.observations)

    def batch(self, b: MultiAgentStepBatch) -> None:
        steps = self.rec.steps
        if self.ended or self.rec.aborted:
            raise DecodeError("out-of-order", f"episode {b.episode_id}: env steps after its end")
        if b.t0 != len(steps):
            raise DecodeError(
                "out-of-order", f"episode {b.episode_id}: batch at env step {b.t0}, expected {len(steps)}"
            )
        new = [MultiAgentEnvStep({}, {}, {}) for _ in range(b.n)]
        for i, f in enumerate(b.env_flags.tolist()):
            if f & ALL_TERMINATED:
                new[i].terminateds["__all__"] = bool(f & ALL_TERMINATED_TRUE)
            if f & ALL_TRUNCATED:
                new[i].truncateds["__all__"] = bool(f & ALL_TRUNCATED_TRUE)
        for col in b.agents:
            self.column(col, new)
        self.check_rules(b, new)
        steps += new
        self.ended = bool(b.ended)

    def check_rules(self, b: MultiAgentStepBatch, new: list[MultiAgentEnvStep]) -> None:
        """DecodeError unless RLlib's `MultiAgentEpisode` accepts every env step and is done
        exactly at the last one of a batch marked `ended`."""
        rules = self.rules
        for i, s in enumerate(new):
            if rules.done:
                raise DecodeError("out-of-order", f"episode {b.episode_id}: env step {b.t0 + i} after its last")
            try:
                state = rules.check_step(
                    s.observations, s.actions, s.rewards, s.infos, s.terminateds, s.truncateds, s.extra_model_outputs
                )
            except ValueError as e:
                raise DecodeError("bad-value", f"env step {b.t0 + i}: {str(e)[:200]}") from None
            rules.accept(state)
        if rules.done != bool(b.ended):
            raise DecodeError(
                "bad-value",
                f"episode {b.episode_id}: ended={bool(b.ended)} but RLlib's rules say "
                f"{'done' if rules.done else 'not done'} after env step {b.t0 + b.n - 1}",
            )

    def column(self, col: AgentColumn, new: list[MultiAgentEnvStep]) -> None:
        aid = col.agent_id
        spec = self.start.agents.get(aid)
        if spec is None:
            raise DecodeError("unknown-agent", f"a column for agent {aid[:60]!r}, not a possible agent")
        what = f"agent {aid[:60]!r}"
        presence = col.presence
        k_obs, k_act = int(np.count_nonzero(presence & OBSERVATION)), int(np.count_nonzero(presence & ACTION))
        check_leaves(col.observations, spec.observation_leaves, k_obs, f"{what} observations")
        check_leaves(col.actions, spec.action_leaves, k_act, f"{what} actions")
        if self.validate_values:
            check_values(col.observations, spec.observation_leaves, f"{what} observations")
            check_values(col.actions, spec.action_leaves, f"{what} actions")
        self.check_extra(spec, col)
        rewards = col.rewards.tolist()
        extras = col.extra_model_outputs
        at = dict.fromkeys(col.extra_rows, 0)  # per masked name: its next stacked row
        io = ia = ir = ii = 0
        for i, p in enumerate(presence.tolist()):
            if not p:
                continue
            step = new[i]
            if p & OBSERVATION:
                step.observations[aid] = _value(spec.observation_space, col.observations, io)
                io += 1
            if p & ACTION:
                step.actions[aid] = _value(spec.action_space, col.actions, ia)
                if extras:
                    out = {}
                    for k, v in extras.items():
                        mask = col.extra_rows.get(k)
                        if mask is None:
                            out[k] = v[ia]
                        elif mask[ia]:
                            out[k] = v[at[k]]
                            at[k] += 1
                    if out:
                        step.extra_model_outputs[aid] = out
                ia += 1
            if p & REWARD:
                step.rewards[aid] = rewards[ir]
                ir += 1
            if p & INFO:
                step.infos[aid] = col.infos[ii]
                ii += 1
            if p & TERMINATED:
                step.terminateds[aid] = bool(p & TERMINATED_TRUE)
            if p & TRUNCATED:
                step.truncateds[aid] = bool(p & TRUNCATED_TRUE)

    def check_extra(self, spec: AgentSpec, col: AgentColumn) -> None:
        if not col.extra_model_outputs:
            return
        got = {k: (v.dtype, v.shape[1:]) for k, v in col.extra_model_outputs.items()}
        first = self.extra.setdefault(spec.agent_id, got)
        if got != first:
            raise DecodeError(
                "extra-output-mismatch", f"agent {spec.agent_id[:60]!r}: extra outputs {got} after {first}"
            )

    def reward(self, d: RewardDelta) -> None:
        if d.agent_id not in self.start.agents:
            raise DecodeError("unknown-agent", f"a delayed reward for agent {d.agent_id[:60]!r}")
        if d.t >= len(self.rec.steps):
            raise DecodeError("bad-value", f"a delayed reward for env step {d.t} of {len(self.rec.steps)}")
        rewards = self.rec.steps[d.t].rewards
        if d.agent_id not in rewards:
            raise DecodeError(
                "bad-value", f"a delayed reward for agent {d.agent_id[:60]!r}, which got none at env step {d.t}"
            )
        total = rewards[d.agent_id] + d.reward
        if not np.isfinite(total):
            raise DecodeError("non-finite-reward", f"agent {d.agent_id[:60]!r}: reward {total} at env step {d.t}")
        rewards[d.agent_id] = total


def fold_multi_agent(events: Iterable[Any], *, validate_values: bool = True) -> MultiAgentRecording:
    """The `MultiAgentRecording` the events of one multi-agent episode describe.

    Args:
        events: the decoded events of one multi-agent episode in partition order (see the
            module docstring); a partial episode folds to its steps so far.
        validate_values: also check that observations and actions hold values of their spaces
            (integer ranges, finiteness), as ``--validate-spaces strict`` does.

    Returns:
        The recording; ``aborted`` when an `EpisodeAbort` ended it.

    Raises:
        DecodeError: `out-of-order`, `unknown-agent`, `space-mismatch`, `out-of-space`,
            `non-finite-value`, `extra-output-mismatch` or `bad-value` (docs/FORMAT.md).

    Example:
        >>> fold_multi_agent([start, batch]).steps[0].actions  # doctest: +SKIP
        {'a0': 1, 'a1': 0}
    """
    folder: _Folder | None = None
    for ev in events:
        if folder is None:
            if not isinstance(ev, MultiAgentEpisodeStart):
                raise DecodeError("out-of-order", f"a {type(ev).__name__} before the MultiAgentEpisodeStart")
            folder = _Folder(ev, validate_values)
            continue
        if ev.episode_id != folder.start.episode_id:
            raise DecodeError("out-of-order", f"an event of episode {ev.episode_id!r} in {folder.start.episode_id!r}")
        if isinstance(ev, MultiAgentStepBatch):
            folder.batch(ev)
        elif isinstance(ev, RewardDelta):
            folder.reward(ev)
        elif isinstance(ev, EpisodeAbort):
            if folder.ended or folder.rec.aborted:
                raise DecodeError("out-of-order", f"episode {ev.episode_id}: an abort after its end")
            folder.rec.aborted = True
        else:
            raise DecodeError("out-of-order", f"a {type(ev).__name__} inside a multi-agent episode")
    if folder is None:
        raise DecodeError("out-of-order", "no MultiAgentEpisodeStart")
    return folder.rec
