"""`EpisodeRecorder`'s multi-agent calls: `begin_multi_agent_episode`, `log_multi_agent_step`
and `log_multi_agent_reward` record the per-agent dicts of a multi-agent env (PettingZoo,
RLlib `MultiAgentEnv`) as the events of docs/FORMAT.md, "Multi-agent episodes".

The discipline is the single-agent one: a call is checked whole before anything is recorded
(values copied and checked outside the lock; under it, the episode looked up again and the step
checked against RLlib's acceptance rules, `MultiAgentRules`), so a refused call records nothing;
one record per call (a begin, an env step, a reward) is counted in `stats`; env steps are
buffered per episode and sent as one `MultiAgentStepBatch` every `max_batch_steps` env steps
(fewer for big observations, about `max_batch_bytes` per batch), at the episode's end, or when
the oldest is `max_batch_delay_s` old; `on_overflow`, `flush`, `abort_episode` and `close`
treat multi-agent episodes as they treat single-agent ones.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from rlrec.producer import recorder as _r
from rlrec.producer.arrays import array_to_wire
from rlrec.producer.avro_write import string_bytes
from rlrec.producer.events import DecodeError, dumps_info, encode_record, schema_header, schema_version
from rlrec.producer.multi_agent_batch import encode_step_batch
from rlrec.producer.multi_agent_events import (
    ACTION,
    ALL_TERMINATED,
    ALL_TERMINATED_TRUE,
    ALL_TRUNCATED,
    ALL_TRUNCATED_TRUE,
    INFO,
    MAX_AGENTS,
    MAX_BATCH_CELLS,
    MAX_BATCH_ENV_STEPS,
    OBSERVATION,
    REWARD,
    TERMINATED,
    TERMINATED_TRUE,
    TRUNCATED,
    TRUNCATED_TRUE,
    check_module_id,
)
from rlrec.producer.multi_agent_rules import MultiAgentRules
from rlrec.producer.spaces import dumps_space, per_space

__all__ = ["DEFAULT_MODULE_ID", "MultiAgentCalls"]

#: the module id of every agent when `agent_modules` is not given (RLlib's default module id)
DEFAULT_MODULE_ID = "default_policy"
_ALL = "__all__"
_COMMON = "__common__"  # RLlib's infos key for all/no agents; its MultiAgentEpisode keeps none of it
_space_text = per_space(lambda s: dumps_space(s, compact=True))
_obs_packer = per_space(lambda s: _r._Packer(s, "observation"))
_act_packer = per_space(lambda s: _r._Packer(s, "action"))


class _Layout:
    """What every episode of the same possible agents, spaces and modules shares: the agents'
    order, sets and bit positions, their packers, what their values take on the wire, and a
    MultiAgentEpisodeStart's ``spaces`` and ``agents`` fields. `key` (the
    policy id and per agent its id, the ids of its space objects and its module; `spaces` keeps
    those objects alive, so the ids name them while the layout is kept) says which episodes
    share it."""

    __slots__ = (
        "act_packers",
        "agent_set",
        "agents",
        "all_set",
        "columns",
        "index",
        "key",
        "obs_packers",
        "spaces",
        "specs",
        "stride",
        "texts",
    )

    def __init__(self, key: tuple, modules: Mapping, observation_spaces: Mapping, action_spaces: Mapping) -> None:
        self.key = key
        agents = tuple(observation_spaces)
        self.spaces = tuple((observation_spaces[a], action_spaces[a]) for a in agents)
        self.agents = agents  # possible agents, in order
        self.agent_set = frozenset(agents)
        self.all_set = self.agent_set | {_ALL}  # what terminateds and truncateds may name
        self.index = {a: i for i, a in enumerate(agents)}
        self.stride = (len(agents) + 7) // 8  # bytes of one env step's reward bitmap
        self.obs_packers = {a: _obs_packer(observation_spaces[a]) for a in agents}
        self.act_packers = {a: _act_packer(action_spaces[a]) for a in agents}
        # per agent, for `log_multi_agent_step`: its id, its bit in a reward bitmap, about what its
        # cell adds to a MultiAgentStepBatch (info and extras come on top), its observation packer
        # and what an observation adds, its action packer and what an action adds
        self.columns = tuple(
            (
                a,
                1 << i,
                24 + len(a),
                self.obs_packers[a],
                _leaf_bytes(self.obs_packers[a]),
                self.act_packers[a],
                _leaf_bytes(self.act_packers[a]),
            )
            for i, a in enumerate(agents)
        )
        texts: dict[str, int] = {}
        specs = []
        for a in agents:
            o = texts.setdefault(_space_text(observation_spaces[a]), len(texts))
            c = texts.setdefault(_space_text(action_spaces[a]), len(texts))
            specs.append({"agent_id": a, "module_id": modules[a], "observation_space": o, "action_space": c})
        self.texts = tuple(texts)  # the start's `spaces`
        self.specs = tuple(specs)  # the start's `agents` (fastavro only reads them)


class _MultiAgentEpisode:
    """A multi-agent episode being recorded; the recorder's machinery (overflow, flush,
    lingering batches, aborts, close) handles it as it handles `recorder._Episode`."""

    __slots__ = (
        "act_packers",
        "agent_set",
        "agents",
        "all_set",
        "columns",
        "dropping",
        "env_t",
        "first_buffered",
        "id",
        "id_avro",
        "index",
        "limit",
        "nbytes",
        "obs_packers",
        "rewarded",
        "rules",
        "step_bytes",
        "steps",
        "stride",
        "t0",
    )

    def __init__(self, eid: str, layout: _Layout, observations: Mapping) -> None:
        self.id = eid
        self.id_avro = string_bytes(eid)
        self.agents, self.agent_set, self.all_set = layout.agents, layout.agent_set, layout.all_set
        self.index, self.stride = layout.index, layout.stride
        self.rewarded = bytearray()  # per env step logged: which agents got a reward (bit index[a])
        self.obs_packers, self.act_packers = layout.obs_packers, layout.act_packers
        self.columns = layout.columns
        # about what an env step adds to a MultiAgentStepBatch: its own fields and a presence byte per agent
        self.step_bytes = 32 + len(self.id_avro) + len(self.agents)
        self.rules = MultiAgentRules()
        self.rules.reset(observations)
        self.env_t = 0  # env steps logged so far
        self.t0 = 0  # env step of the first buffered one
        self.steps: list = []  # buffered env steps: (env flag byte, {agent: cell})
        self.first_buffered = 0.0
        self.dropping = False
        self.limit = 0  # env steps per batch at most (set by the recorder)
        self.nbytes = 0  # about how many bytes the buffered env steps take in a message

    @property
    def t(self) -> int:
        raise self.wrong_call()

    def wrong_call(self) -> ValueError:
        """The error of a single-agent call on this episode."""
        return ValueError(
            f"episode {self.id!r} is a multi-agent episode: use log_multi_agent_step / log_multi_agent_reward"
        )

    def note_rewards(self, mask: int) -> None:
        """Remember which agents got a reward at the env step just logged (bit index[a] of
        `mask`), for delayed rewards."""
        self.rewarded += mask.to_bytes(self.stride, "little")

    def finished(self) -> _FinishedMultiAgent:
        """What `log_multi_agent_reward` checks once the episode has ended."""
        return _FinishedMultiAgent(self.env_t, self.index, self.stride, bytes(self.rewarded))


class _FinishedMultiAgent:
    """A finished multi-agent episode, as the recorder remembers it: its length, its agents and
    which of them got a reward at each env step."""

    __slots__ = ("env_t", "index", "rewarded", "stride")

    def __init__(self, env_t: int, index: dict, stride: int, rewarded: bytes | bytearray) -> None:
        self.env_t, self.index, self.stride, self.rewarded = env_t, index, stride, rewarded


def _leaves(packer: Any, value: Any) -> list[dict]:
    """One value's leaves as the Avro records of a `NdArray` array (raises as `packer.copy`)."""
    kept = packer.copy(value)
    values = [kept] if packer.single else list(kept)
    out = []
    for v, leaf in zip(values, packer.leaves):
        a = np.asarray(v, dtype=leaf.dtype) if type(v) is not bytes else np.frombuffer(v, leaf.dtype)
        out.append(array_to_wire(a.reshape(leaf.shape)))
    return out


def _leaf_bytes(packer: Any) -> int:
    return sum(lf.dtype.itemsize * math.prod(lf.shape) for lf in packer.leaves)


def _flag(v: Any, key: str, what: str) -> bool:
    """`what[key]`, the value `v`, as a bool (ValueError for None, TypeError for a non-bool)."""
    if v is None:
        raise _none(what, key)
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{what}[{key!r}] must be a bool, got {type(v).__name__}")
    return bool(v)


def _none(what: str, key: str) -> ValueError:
    return ValueError(f"{what}[{key!r}] is None: leave the agent out instead")


def _copy_agent_outputs(a: str, e: Any, episode_id: str) -> dict | None:
    """What the recorder keeps of agent `a`'s extra model outputs `e` (see `_r._copy_outputs`);
    None for an empty mapping."""
    if not isinstance(e, Mapping):
        raise TypeError(f"extra_model_outputs[{a!r}] must be a dict of outputs, got {type(e).__name__}")
    if not e:
        return None
    extra = _r._copy_outputs(e, episode_id)  # checks an action_logp
    if len(extra) != 1 or type(extra.get("action_logp")) not in _r._FLOAT_TYPES:
        _r._extra_keys(extra)  # TypeError for names and dtypes the wire cannot carry
    return extra


def _extra_bytes(extra: dict | None) -> int:
    """About what kept extra model outputs add to a MultiAgentStepBatch."""
    if not extra:
        return 0
    return sum(16 + len(k) + (v.nbytes if isinstance(v, np.ndarray) else 8) for k, v in extra.items())


_LOGP_CELL_BYTES = _extra_bytes({"action_logp": 0.0})


class MultiAgentCalls:
    """The multi-agent calls of `EpisodeRecorder` (its base class; see the module docstring)."""

    def begin_multi_agent_episode(
        self,
        observations: Mapping[str, Any],
        infos: Mapping[str, Mapping] | None = None,
        episode_id: str | None = None,
        policy_version: int | None = None,
        *,
        observation_spaces: Mapping[str, Any],
        action_spaces: Mapping[str, Any],
        agent_modules: Mapping[str, str] | None = None,
    ) -> str:
        """Begin a multi-agent episode with what the env's ``reset()`` returned; returns its id.

        Args:
            observations: agent id -> reset observation (the agents reset returned one for).
            infos: agent id -> reset info; RLlib's ``"__common__"`` entry is accepted and not
                recorded (RLlib's `MultiAgentEpisode` keeps none of it either).
            episode_id: the episode's id (default: a new uuid4 hex); the key of all its events.
            policy_version: the acting policy's version (default: the recorder's).
            observation_spaces: every possible agent id -> its observation space (in order).
            action_spaces: the same agent ids -> their action spaces.
            agent_modules: agent id -> module id (default: every agent ``"default_policy"``);
                ``{policy_id}.{module_id}`` must name a policy directory.

        Raises:
            ValueError: an invalid argument (nothing is recorded), a start over message.max.bytes.
            TypeError: a value whose dtype does not cast to its space's.
            RecorderClosed, RecorderFullError, RecorderReentryError: as `begin_episode`.

        Example:
            >>> eid = rec.begin_multi_agent_episode(  # doctest: +SKIP
            ...     {"a0": obs0, "a1": obs1}, observation_spaces=env.observation_spaces,
            ...     action_spaces=env.action_spaces)
        """
        self._check_usable()
        agents = tuple(observation_spaces)
        if set(agents) != set(action_spaces):
            raise ValueError("observation_spaces and action_spaces must name the same agents")
        if not 1 <= len(agents) <= MAX_AGENTS:
            raise ValueError(f"{len(agents)} agents: 1..{MAX_AGENTS} possible agents")
        for a in agents:
            if type(a) is not str or not 1 <= len(a) <= 256 or a == _ALL:
                raise ValueError(f"agent ids must be strings of 1..256 characters other than '__all__', got {a!r}")
        modules = dict.fromkeys(agents, DEFAULT_MODULE_ID) if agent_modules is None else dict(agent_modules)
        if set(modules) != set(agents):
            raise ValueError(f"agent_modules must map exactly the agents {sorted(agents)}, got {sorted(modules)}")
        layout = self._ma_layout(modules, observation_spaces, action_spaces)
        version = self._policy_version if policy_version is None else self._check_version(policy_version)
        infos = dict(infos or {})
        infos.pop(_COMMON, None)  # as RLlib's MultiAgentEpisode: not recorded
        self._check_agents(layout.agent_set, observations, "observations")
        self._check_agents(layout.agent_set, infos, "infos")
        reset = []
        for a in agents:
            if a in observations or a in infos:
                obs = None
                if a in observations:
                    packer = layout.obs_packers[a]
                    if self.validate_spaces and (bad := _r.space_problem(packer.space, observations[a])):
                        raise ValueError(f"observation of {a!r} {bad}")
                    obs = _leaves(packer, observations[a])
                info = None if a not in infos else dumps_info(infos[a])
                reset.append({"agent_id": a, "observation": obs, "info": info})
        eid = uuid.uuid4().hex if episode_id is None else str.__str__(str(episode_id))
        if not 1 <= len(eid) <= 256:
            raise ValueError("episode_id must be 1..256 characters")
        record = {
            "episode_id": eid,
            "policy_id": self.policy_id,
            "policy_version": version,
            "env_id": self.env_id,
            "spaces": list(layout.texts),
            "agents": list(layout.specs),
            "reset": reset,
            "timestamp_ms": int(time.time() * 1000),
        }
        # once per episode: fastavro, with its type and range checks (the per-step path is hand-written)
        value = encode_record("MultiAgentEpisodeStart", record)
        self._ma_wire("MultiAgentEpisodeStart")
        self._ma_wire("MultiAgentStepBatch")
        self._check_start_size(eid.encode(), value)
        ep = _MultiAgentEpisode(eid, layout, observations)
        ep.limit = max(1, min(self.max_batch_steps, MAX_BATCH_ENV_STEPS, MAX_BATCH_CELLS // len(agents)))
        while True:
            with self._lock:
                if self._busy:
                    raise self._reentry("begin_multi_agent_episode")
                self._busy = True
                try:
                    if self._closing:
                        raise _r.RecorderClosed("the recorder is closed")
                    if eid in self._episodes:
                        raise ValueError(f"episode {eid} is already open")
                    if self._buffered < self._max_buffered_steps:
                        self._send(eid, value, "MultiAgentEpisodeStart", 1, 1)
                        self._episodes_begun += 1
                        self._episodes[eid] = ep
                        self._ma_open += 1
                        return eid
                    if not self._overflow(None, False):
                        ep.dropping = True
                        self._episodes_begun += 1
                        self._episodes[eid] = ep
                        self._ma_open += 1
                        return eid
                finally:
                    self._busy = False
            time.sleep(_r._WAIT_S)

    def log_multi_agent_step(
        self,
        episode_id: str,
        observations: Mapping[str, Any],
        actions: Mapping[str, Any],
        rewards: Mapping[str, float],
        terminateds: Mapping[str, bool],
        truncateds: Mapping[str, bool],
        infos: Mapping[str, Mapping] | None = None,
        extra_model_outputs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> bool:
        """Record one env step of a multi-agent episode: the actions sent and what ``step()``
        returned, all keyed by agent id. Returns True when this env step ended the episode.

        The step is refused (nothing recorded) when RLlib's `MultiAgentEpisode.add_env_step`
        would refuse it (`MultiAgentRules`), and when a value is invalid. The episode ends at an
        env step with a true ``"__all__"`` in `terminateds` or `truncateds`, or when every agent
        that has appeared is done (RLlib's rule).

        Args:
            episode_id: an open multi-agent episode's id.
            observations: agent id -> observation returned by this step.
            actions: agent id -> action taken.
            rewards: agent id -> reward (a finite number).
            terminateds: agent id (or ``"__all__"``) -> bool.
            truncateds: agent id (or ``"__all__"``) -> bool.
            infos: agent id -> info dict (a ``"__common__"`` entry: accepted, not recorded).
            extra_model_outputs: agent id -> {name: value}, only for agents that acted
                (``action_logp``: the log-propensity of its action); RLlib refuses names that
                change within an agent's episode, and so does this call.

        Raises:
            ValueError: the episode is not open, or the step is invalid or refused by RLlib's rules.
            TypeError: a value's dtype does not cast to its space's.
            RecorderClosed, RecorderFullError, RecorderReentryError: as `log_step`.

        Example:
            >>> rec.log_multi_agent_step(eid, obs, actions, rewards, terms, truncs)  # doctest: +SKIP
            False
        """
        if self._unusable:
            self._check_usable()
        ep = self._episodes.get(episode_id)
        if type(ep) is not _MultiAgentEpisode:
            raise self._not_open(episode_id)
        infos = infos or {}
        if _COMMON in infos:  # as RLlib's MultiAgentEpisode: not recorded
            infos = {a: v for a, v in infos.items() if a != _COMMON}
        extras = extra_model_outputs or {}
        names, all_set = ep.agent_set, ep.all_set
        if not (
            isinstance(observations, dict)
            and isinstance(actions, dict)
            and isinstance(rewards, dict)
            and isinstance(infos, dict)
            and isinstance(terminateds, dict)
            and isinstance(truncateds, dict)
            and isinstance(extras, dict)
            and names.issuperset(observations)
            and names.issuperset(actions)
            and names.issuperset(rewards)
            and names.issuperset(infos)
            and all_set.issuperset(terminateds)
            and all_set.issuperset(truncateds)
            and names.issuperset(extras)
        ):  # the usual dicts are checked for None values in the loop below
            for what, d in (("observations", observations), ("actions", actions), ("rewards", rewards)):
                self._check_agents(names, d, what)
            self._check_agents(names, infos, "infos")
            self._check_agents(all_set, terminateds, "terminateds")
            self._check_agents(all_set, truncateds, "truncateds")
            self._check_agents(names, extras, "extra_model_outputs")
        if not extras.keys() <= actions.keys():
            a = next(a for a in extras if a not in actions)
            raise ValueError(f"extra_model_outputs for agent {a!r}, which did not act")
        flags = 0
        if _ALL in terminateds:
            flags |= ALL_TERMINATED | (ALL_TERMINATED_TRUE if _flag(terminateds[_ALL], _ALL, "terminateds") else 0)
        if _ALL in truncateds:
            flags |= ALL_TRUNCATED | (ALL_TRUNCATED_TRUE if _flag(truncateds[_ALL], _ALL, "truncateds") else 0)
        cells = {}
        rewarded = 0  # which agents got a reward (bit index[a])
        validate = self.validate_spaces
        float_types = _r._FLOAT_TYPES
        # about what this env step adds to a MultiAgentStepBatch: its flag, a presence byte per
        # agent column (counted for every agent), its cells; and the batch's own fields
        size = ep.step_bytes
        for a, bit, n, obs_packer, obs_bytes, act_packer, act_bytes in ep.columns:
            p = 0
            obs = act = info = extra = None
            rew = 0.0
            if a in observations:
                v = observations[a]
                if v is None:
                    raise _none("observations", a)
                if validate and (bad := _r.space_problem(obs_packer.space, v)):
                    raise ValueError(f"observation of {a!r} {bad}")
                obs = obs_packer.copy(v)
                p = OBSERVATION
                n += obs_bytes
            if a in actions:
                v = actions[a]
                if v is None:
                    raise _none("actions", a)
                if validate and (bad := _r.space_problem(act_packer.space, v)):
                    raise ValueError(f"action of {a!r} {bad}")
                act = act_packer.copy(v)
                p |= ACTION
                n += act_bytes
                e = extras.get(a)
                if type(e) is dict and len(e) == 1 and type(e.get("action_logp")) in float_types:
                    # only the propensity, the usual case: kept as its scalar (`multi_agent_batch`)
                    extra = _r._kept_outputs(e, episode_id)
                    n += _LOGP_CELL_BYTES
                elif e is None:
                    if a in extras:
                        raise _none("extra_model_outputs", a)
                else:
                    extra = _copy_agent_outputs(a, e, episode_id)
                    n += _extra_bytes(extra)
            if a in rewards:
                rew = rewards[a]
                if type(rew) is not float:
                    if rew is None:
                        raise _none("rewards", a)
                    rew = _r._reward_float(rew, f"rewards[{a!r}]")
                if rew - rew != 0.0:  # NaN or +-inf
                    raise ValueError(f"rewards[{a!r}] must be finite, got {rew} (episode {episode_id})")
                p |= REWARD
                rewarded |= bit
            if a in infos:
                v = infos[a]
                if v is None:
                    raise _none("infos", a)
                info = dumps_info(v) if v else ""
                p |= INFO
                n += len(info) + 4
            v = terminateds.get(a)
            if v is not None:
                p |= TERMINATED | (
                    TERMINATED_TRUE if v is True or (v is not False and _flag(v, a, "terminateds")) else 0
                )
            elif a in terminateds:
                raise _none("terminateds", a)
            v = truncateds.get(a)
            if v is not None:
                p |= TRUNCATED | (TRUNCATED_TRUE if v is True or (v is not False and _flag(v, a, "truncateds")) else 0)
            elif a in truncateds:
                raise _none("truncateds", a)
            if p:
                cells[a] = (p, obs, act, rew, info, extra)
                size += n
        step = (flags, cells)
        batch_bytes = min(self.max_batch_bytes, self._max_start)
        if size > self._max_start:
            raise ValueError(
                f"env step of about {size} bytes: more than message.max.bytes ({self._message_max_bytes}) allows; "
                "raise message.max.bytes (producer and broker)"
            )
        while True:
            with self._lock:
                if self._busy:
                    raise self._reentry("log_multi_agent_step")
                self._busy = True
                try:
                    if self._closing:
                        raise _r.RecorderClosed("the recorder is closed")
                    if self._episodes.get(episode_id) is not ep:
                        raise self._not_open(episode_id)
                    state = ep.rules.check_step(observations, actions, rewards, infos, terminateds, truncateds, extras)
                    if not ep.dropping and self._buffered < self._max_buffered_steps:
                        if ep.steps and ep.nbytes + size > batch_bytes:  # this step starts the next batch
                            self._emit(ep, False, False)  # raises after aborting the episode when it fails
                        ep.rules.accept(state)
                        if not ep.steps:
                            ep.first_buffered = _r._monotonic()
                        ep.steps.append(step)
                        ep.nbytes += size
                        ep.note_rewards(rewarded)
                        ep.env_t += 1
                        self._buffered += 1
                        if ep.rules.done:
                            self._emit(ep, True, False)
                            self._end(ep)
                            return True
                        if len(ep.steps) >= ep.limit or ep.nbytes >= batch_bytes:
                            self._emit(ep, False, False)
                        return False
                    ended = state[1] or state[2]
                    if ep.dropping or self.on_overflow == "drop":  # dropped: counted before _overflow ends it
                        ep.rules.accept(state)
                        ep.note_rewards(rewarded)
                        ep.env_t += 1
                        self._overflow(ep, ended)
                        return ended
                    self._overflow(ep, ended)  # raises for "raise"; "block": wait below
                finally:
                    self._busy = False
            time.sleep(_r._WAIT_S)  # on_overflow="block": wait for room without the lock, then look again

    def log_multi_agent_reward(self, episode_id: str, t: int, agent_id: str, reward: float) -> None:
        """Add a delayed `reward` to `agent_id`'s reward at env step `t` (0-based) of a
        multi-agent episode, open or finished (a `RewardDelta/2`, or folded into a buffered step).

        Args:
            episode_id: the multi-agent episode's id.
            t: the env step (0-based).
            agent_id: a possible agent of the episode.
            reward: a finite number.

        While the recorder remembers the episode (open, or among its last 10,000 finished ones)
        it checks what the consumer's fold checks: the episode is a multi-agent one, `agent_id`
        is one of its agents and got a reward at env step `t`; the bitmap of who got a reward
        costs ceil(agents / 8) bytes per env step.

        Raises:
            ValueError: a reward that is not finite (or that makes a buffered reward so), a
                single-agent episode, an env step or agent the episode does not have, an agent
                that got no reward at `t`; nothing is recorded.
            RecorderClosed: `close()` was called.

        Example:
            >>> rec.log_multi_agent_reward(eid, 3, "a1", 0.75)  # doctest: +SKIP
        """
        self._check_usable()
        t, r = _r.reward_args(t, reward)
        if type(agent_id) is not str or not 1 <= len(agent_id) <= 256:
            raise ValueError(f"agent_id must be a string of 1..256 characters, got {agent_id!r}")
        while True:
            with self._lock:
                if self._busy:
                    raise self._reentry("log_multi_agent_reward")
                self._busy = True
                try:
                    if self._closing:
                        raise _r.RecorderClosed("the recorder is closed")
                    ep = self._episodes.get(episode_id)
                    known = ep if ep is not None else self._finished.get(episode_id)
                    if known is not None and type(known) not in (_MultiAgentEpisode, _FinishedMultiAgent):
                        raise ValueError(f"episode {episode_id!r} is not a multi-agent episode: use log_reward")
                    if known is not None:  # what the fold will check, checked here (unknown: long gone)
                        if agent_id not in known.index:
                            raise ValueError(f"agent {agent_id!r} is not a possible agent of episode {episode_id}")
                        if t >= known.env_t:
                            raise ValueError(f"episode {episode_id} has {known.env_t} env steps; no env step t={t}")
                        i = known.index[agent_id]
                        if not known.rewarded[t * known.stride + i // 8] >> (i % 8) & 1:
                            raise ValueError(f"agent {agent_id!r} got no reward at env step {t} to add to")
                    if ep is not None and t >= ep.t0 and not ep.dropping:  # still buffered: no message needed
                        cells = ep.steps[t - ep.t0][1]
                        cell = cells[agent_id]
                        total = cell[3] + r
                        if not math.isfinite(total):
                            raise ValueError(
                                f"reward {cell[3]} + {r} of agent {agent_id!r} at env step {t} is not finite"
                            )
                        cells[agent_id] = (*cell[:3], total, *cell[4:])
                        return
                    if self._send_reward(episode_id, t, r, agent_id):
                        return
                finally:
                    self._busy = False
            time.sleep(_r._WAIT_S)

    def _ma_layout(self, modules: Mapping, observation_spaces: Mapping, action_spaces: Mapping) -> _Layout:
        """The `_Layout` of these agents, spaces and modules: the last one made again when it has
        the same key (the same space objects). ValueError for a module id the policy cannot have.
        Without the lock."""
        key = (
            self.policy_id,
            tuple((a, id(observation_spaces[a]), id(action_spaces[a]), modules[a]) for a in observation_spaces),
        )
        layout = self._ma_last_layout
        if layout is not None and layout.key == key:
            return layout
        for a, m in modules.items():
            try:
                check_module_id(self.policy_id, m)
            except DecodeError as e:
                raise ValueError(f"agent {a!r}: {e.detail}") from None
        layout = _Layout(key, modules, observation_spaces, action_spaces)
        self._ma_last_layout = layout
        return layout

    # -- internals (with the lock held unless said otherwise) -----------------------------------

    @staticmethod
    def _check_agents(agents: Any, d: Any, what: str) -> None:
        """ValueError unless `d` is a mapping of possible agents (a set or tuple) to values that
        are not None."""
        if type(d) is not dict and not isinstance(d, Mapping):
            raise TypeError(f"{what} must be a dict keyed by agent id, got {type(d).__name__}")
        if not d:
            return
        if not agents.issuperset(d) if type(agents) is frozenset else any(a not in agents for a in d):
            bad = next(a for a in d if a not in agents)
            raise ValueError(f"{what}: {bad!r} is not a possible agent of the episode")
        for bad, v in d.items():
            if v is None:
                raise ValueError(f"{what}[{bad!r}] is None: leave the agent out instead")

    def _ma_emit(self, ep: _MultiAgentEpisode, ended: bool) -> None:
        """Send the episode's buffered env steps as one MultiAgentStepBatch (see `_emit`)."""
        n = len(ep.steps)
        t0, t1 = ep.t0, ep.env_t
        try:
            value = encode_step_batch(ep, ended)
        except (ValueError, TypeError) as e:
            ep.steps = []
            ep.nbytes = 0
            self._buffered -= n
            self._failed += n
            self._abort(ep, "encode-error")
            raise ValueError(
                f"episode {ep.id}: env steps {t0}..{t1 - 1} could not be encoded and the episode was aborted: {e}"
            ) from e
        ep.steps = []
        ep.nbytes = 0
        ep.t0 = t1
        try:
            self._send(ep.id, value, "MultiAgentStepBatch", n, 0)
        except ValueError as e:
            self._abort(ep, "produce-error")
            raise ValueError(
                f"episode {ep.id}: env steps {t0}..{t1 - 1} could not be sent and the episode was aborted: {e}"
            ) from e

    def _ma_wire(self, kind: str, version: int | None = None) -> None:
        """Make sure `_send` knows how to frame `kind` (at `version`: the key ``kind/version``)."""
        key = kind if version is None else f"{kind}/{version}"
        if key not in self._wire:
            v = version or schema_version(kind)
            if self._registry is not None:
                from rlrec.producer.registry import frame

                self._wire[key] = (frame(self._registry.schema_id(kind, v), b""), None)
            else:
                self._wire[key] = (b"", schema_header(kind, v))

    def _ma_abort_dropping(self, ep: _MultiAgentEpisode) -> None:
        n = len(ep.steps)
        ep.dropping = True
        ep.steps = []
        ep.nbytes = 0
        self._dropped += n
        self._buffered -= n
        rec = {"episode_id": ep.id, "reason": "dropped", "timestamp_ms": int(time.time() * 1000)}
        self._send(ep.id, encode_record("EpisodeAbort", rec), "EpisodeAbort", 1, 1)
