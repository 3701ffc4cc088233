"""Multi-agent recordings from real envs, stepped directly (no recorder, no broker): the inputs
of the multi-agent builders' tests and bench.

Cases: PettingZoo simple_spread (mpe2, Parallel API, no ``__all__``), pistonball (image
observations, through RLlib's `ParallelPettingZooEnv`, which adds ``__all__``), tic-tac-toe (AEC
with action masks, through RLlib's `PettingZooEnv`: one agent observes per env step, the other's
action hangs) and `JoinLeaveEnv`, an RLlib `MultiAgentEnv` whose agents join late, leave early,
act without an immediate observation and get a reward before their first observation.
"""

from __future__ import annotations

import numpy as np

from rlrec.producer.multi_agent_recording import MultiAgentEnvStep, MultiAgentRecording, MultiAgentReset


def _logp(rng: np.random.Generator) -> dict:
    return {"action_logp": np.float32(rng.normal())}


def drive(env, episode_id: str, agent_modules: dict, seed: int = 0, policy_id: str = "pol", env_id: str = ""):
    """Step an RLlib-style multi-agent env (reset/step with per-agent dicts) with random legal
    actions for the agents that observed, until ``__all__`` (or every agent) is done."""
    rng = np.random.default_rng(seed)
    obs, infos = env.reset(seed=seed)
    rec = MultiAgentRecording(
        episode_id=episode_id,
        policy_id=policy_id,
        policy_version=3,
        agent_modules=agent_modules,
        reset=MultiAgentReset(observations=dict(obs), infos={a: i for a, i in (infos or {}).items() if a in obs}),
        observation_spaces={a: env.get_observation_space(a) for a in agent_modules},
        action_spaces={a: env.get_action_space(a) for a in agent_modules},
        env_id=env_id,
    )
    done: set = set()
    while True:
        actions = {}
        for aid, o in obs.items():
            if aid in done:
                continue
            space = env.get_action_space(aid)
            if isinstance(o, dict) and "action_mask" in o:
                actions[aid] = int(rng.choice(np.flatnonzero(o["action_mask"])))
            else:
                actions[aid] = _sample(space, rng)
        obs, rewards, terms, truncs, infos = env.step(actions)
        rec.steps.append(
            MultiAgentEnvStep(
                actions=actions,
                rewards=dict(rewards),
                observations=dict(obs),
                terminateds=dict(terms),
                truncateds=dict(truncs),
                infos={a: i for a, i in infos.items() if a in obs},
                extra_model_outputs={a: _logp(rng) for a in actions},
            )
        )
        done |= {a for a, v in terms.items() if v and a != "__all__"} | {
            a for a, v in truncs.items() if v and a != "__all__"
        }
        if terms.get("__all__") or truncs.get("__all__") or done >= set(agent_modules):
            return rec


def _sample(space, rng: np.random.Generator):
    import gymnasium as gym

    if isinstance(space, gym.spaces.Discrete):
        return int(space.start + rng.integers(space.n))
    if isinstance(space, gym.spaces.Box):
        return rng.uniform(space.low, space.high).astype(space.dtype)
    raise NotImplementedError(type(space))


class _ParallelAdapter:
    """A PettingZoo Parallel env as it is: five dicts per step, no ``__all__``."""

    def __init__(self, env) -> None:
        self.env = env

    def reset(self, seed=None):
        return self.env.reset(seed=seed)

    def step(self, actions):
        return self.env.step(actions)

    def get_observation_space(self, aid):
        return self.env.observation_space(aid)

    def get_action_space(self, aid):
        return self.env.action_space(aid)


def simple_spread(episode_id: str = "spread-0", seed: int = 0, max_cycles: int = 25) -> MultiAgentRecording:
    """simple_spread_v3 (3 agents, discrete actions), the raw Parallel API."""
    from mpe2 import simple_spread_v3

    env = simple_spread_v3.parallel_env(N=3, max_cycles=max_cycles, continuous_actions=False)
    modules = dict.fromkeys(env.possible_agents, "spread")
    return drive(_ParallelAdapter(env), episode_id, modules, seed, env_id="simple_spread_v3")


def pistonball(episode_id: str = "piston-0", seed: int = 2) -> MultiAgentRecording:
    """pistonball_v6 (3 pistons, 5 cycles, image observations; seed 2 runs all 5 steps) through RLlib's `ParallelPettingZooEnv`."""
    from pettingzoo.butterfly import pistonball_v6
    from ray.rllib.env.wrappers.pettingzoo_env import ParallelPettingZooEnv

    env = ParallelPettingZooEnv(pistonball_v6.parallel_env(n_pistons=3, max_cycles=5))
    modules = {a: ("left" if a == "piston_0" else "pistons") for a in env.par_env.possible_agents}
    return drive(env, episode_id, modules, seed, env_id="pistonball_v6")


def tictactoe(episode_id: str = "ttt-0", seed: int = 0) -> MultiAgentRecording:
    """tictactoe_v3 (AEC, action masks) through RLlib's `PettingZooEnv`."""
    from pettingzoo.classic import tictactoe_v3
    from ray.rllib.env.wrappers.pettingzoo_env import PettingZooEnv

    env = PettingZooEnv(tictactoe_v3.env())
    modules = {"player_1": "first", "player_2": "second"}
    return drive(env, episode_id, modules, seed, env_id="tictactoe_v3")


def join_leave(episode_id: str = "join-0", seed: int = 0) -> MultiAgentRecording:
    """`JoinLeaveEnv`: joins, early exits, hanging actions, rewards before a first observation."""
    env = _join_leave_env_class()()
    return drive(env, episode_id, {a: f"m_{a}" for a in env.possible_agents}, seed, env_id="join_leave")


def _join_leave_env_class():
    import gymnasium as gym
    from ray.rllib.env.multi_agent_env import MultiAgentEnv

    class JoinLeaveEnv(MultiAgentEnv):
        """Scripted: who observes, is rewarded and ends at each env step.

        env step: observations / rewards / done
          reset: a
          1: a, b / a, c (c before its first observation), d / -
          2: b / b (a acted, no observation: its action hangs) / -
          3: a, b, c / a, b / -  (a's hanging step completes; c joins)
          4: a, c / a, b, c / b terminated without an observation (leaves early)
          5: a, c / a, c, d / __all__ truncated
        """

        SCRIPT = (
            ({"a", "b"}, {"a": 1.0, "c": 0.5, "d": 0.25}, {}),
            ({"b"}, {"b": 1.0}, {}),
            ({"a", "b", "c"}, {"a": 2.0, "b": 1.0}, {}),
            ({"a", "c"}, {"a": 1.0, "b": -1.0, "c": 1.0}, {"b": True}),
            ({"a", "c"}, {"a": 1.0, "c": 1.0, "d": 2.0}, "trunc"),
        )

        def __init__(self, config=None) -> None:
            super().__init__()
            self.possible_agents = ["a", "b", "c", "d"]
            self.agents = list(self.possible_agents)
            self.observation_spaces = {a: gym.spaces.Box(-10.0, 10.0, (2,), np.float32) for a in self.possible_agents}
            self.action_spaces = {a: gym.spaces.Discrete(3) for a in self.possible_agents}
            self.t = 0

        def _obs(self, aid):
            return np.array([self.t, ord(aid) - 97], dtype=np.float32)

        def reset(self, *, seed=None, options=None):
            self.t = 0
            return {"a": self._obs("a")}, {"a": {"start": 1}}

        def step(self, action_dict):
            obs_ids, rewards, done = self.SCRIPT[self.t]
            self.t += 1
            obs = {a: self._obs(a) for a in sorted(obs_ids)}
            infos = {a: {"t": self.t} for a in obs if self.t % 2}
            if done == "trunc":
                return obs, dict(rewards), {"__all__": False}, {"a": True, "c": True, "__all__": True}, infos
            return obs, dict(rewards), {**done, "__all__": False}, {"__all__": False}, infos

    return JoinLeaveEnv


def __getattr__(name):
    if name == "JoinLeaveEnv":
        return _join_leave_env_class()
    raise AttributeError(name)


CASES = {"simple_spread": simple_spread, "pistonball": pistonball, "tictactoe": tictactoe, "join_leave": join_leave}


def comparable_state(ep) -> dict:
    """`MultiAgentEpisode.get_state()` as plain data, timers and the mapping function aside:
    lookback buffers as their states, defaultdicts as dicts, agent episodes by agent id."""
    state = ep.get_state()
    for k in ("agent_to_module_mapping_fn", "_start_time", "_last_step_time"):
        state.pop(k)
    state["env_t_to_agent_t"] = {a: b.get_state() for a, b in state["env_t_to_agent_t"].items()}
    agents = {}
    for aid, sa in state["agent_episodes"]:
        sa = dict(sa)
        sa.pop("_start_time")
        sa.pop("_last_step_time")
        agents[aid] = sa
    state["agent_episodes"] = agents
    return state


def assert_same(a, b, path="state") -> None:
    """Recursive equality with numpy arrays and scalars compared by value and dtype-kind."""
    import gymnasium as gym

    if isinstance(a, dict) or isinstance(b, dict):
        assert isinstance(a, dict) and isinstance(b, dict), f"{path}: {type(a).__name__} vs {type(b).__name__}"
        assert set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)) and not isinstance(b, np.ndarray):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {a!r:.80} vs {b!r:.80}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        x, y = np.asarray(a), np.asarray(b)
        assert x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y), f"{path}: {a!r:.80} vs {b!r:.80}"
    elif isinstance(a, gym.Space):
        assert a == b, f"{path}: {a} vs {b}"
    else:
        assert type(a) is type(b) and a == b, (
            f"{path}: {a!r:.80} ({type(a).__name__}) vs {b!r:.80} ({type(b).__name__})"
        )
