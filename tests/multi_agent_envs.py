"""Small multi-agent envs for the env gate's tests: a PettingZoo Parallel env whose agent a1 joins
at step 2 (``pettingzoo:tests.multi_agent_envs``: its ``parallel_env``), and RLlib MultiAgentEnv
classes (``tests.multi_agent_envs:CLASS``): one with a tick on which no agent observes, one that
never ends, one whose spaces lack an agent, and one that does not say its possible agents."""

from __future__ import annotations

import functools
from typing import ClassVar

import numpy as np
from gymnasium.spaces import Box, Discrete
from pettingzoo import ParallelEnv
from ray.rllib.env.multi_agent_env import MultiAgentEnv

OBS = Box(-1.0, 1.0, (3,), np.float32)
ACT = Discrete(2)


class LateJoin(ParallelEnv):
    """possible_agents a0 and a1; only a0 is alive at reset, a1 joins at step 2 (`late_obs`: a1's
    observation space). Reward 1 per alive agent per step, `steps` steps."""

    metadata: ClassVar[dict] = {"name": "latejoin_v0"}

    def __init__(self, steps: int = 5, late_obs: int = 3):
        self.possible_agents = ["a0", "a1"]
        self.steps, self.late = steps, Box(-1.0, 1.0, (late_obs,), np.float32)

    @functools.cache  # noqa: B019 (PettingZoo's idiom; the env lives for a test)
    def observation_space(self, agent):
        return self.late if agent == "a1" else OBS

    def action_space(self, agent):
        return ACT

    def reset(self, seed=None, options=None):
        self.t, self.agents = 0, ["a0"]
        return {"a0": np.zeros(3, np.float32)}, {"a0": {}}

    def step(self, actions):
        self.t += 1
        if self.t == 2:
            self.agents = ["a0", "a1"]
        over = self.t >= self.steps
        obs = {a: np.zeros(self.observation_space(a).shape, np.float32) for a in self.agents}
        rewards = dict.fromkeys(self.agents, 1.0)
        out = obs, rewards, dict.fromkeys(self.agents, False), dict.fromkeys(self.agents, over)
        if over:
            self.agents = []
        return *out, {a: {} for a in obs}


def parallel_env(**kw):
    return LateJoin(**kw)


class Gap(MultiAgentEnv):
    """One agent that observes every other tick (no agent observes on odd ticks); 10 ticks, reward
    1 per tick."""

    def __init__(self, config=None):
        super().__init__()
        self.possible_agents = self.agents = ["a0"]
        self.observation_spaces, self.action_spaces = {"a0": OBS}, {"a0": ACT}

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return {"a0": np.zeros(3, np.float32)}, {}

    def step(self, actions):
        self.t += 1
        over = self.t >= 10
        obs = {"a0": np.zeros(3, np.float32)} if self.t % 2 == 0 or over else {}
        return obs, {"a0": 1.0}, {"__all__": over}, {"__all__": False}, {}


class Endless(MultiAgentEnv):
    """Two agents; never terminates nor truncates; reward 1 per agent and step."""

    def __init__(self, config=None):
        super().__init__()
        self.possible_agents = self.agents = ["a0", "a1"]
        self.observation_spaces = dict.fromkeys(self.agents, OBS)
        self.action_spaces = dict.fromkeys(self.agents, ACT)

    def reset(self, *, seed=None, options=None):
        return {a: np.zeros(3, np.float32) for a in self.agents}, {}

    def step(self, actions):
        obs = {a: np.zeros(3, np.float32) for a in actions}
        return obs, dict.fromkeys(actions, 1.0), {"__all__": False}, {"__all__": False}, {}


class PartialSpaces(Endless):
    """An env whose observation_spaces lack agent a1 (an operator's mistake)."""

    def __init__(self, config=None):
        super().__init__()
        self.observation_spaces = {"a0": OBS}


class Unlisted(Gap):
    """An env that does not say its possible agents; agent a1 (observation space `config["obs"]`
    wide) appears at tick 2."""

    def __init__(self, config=None):
        super().__init__()
        self.possible_agents = self.agents = []
        width = (config or {}).get("obs", 3)
        self.observation_spaces = {"a0": OBS, "a1": Box(-1.0, 1.0, (width,), np.float32)}
        self.action_spaces = {"a0": ACT, "a1": ACT}

    def step(self, actions):
        self.t += 1
        over = self.t >= 4
        agents = ["a0", "a1"] if self.t >= 2 else ["a0"]
        obs = {a: np.zeros(self.observation_spaces[a].shape, np.float32) for a in agents}
        return obs, dict.fromkeys(agents, 1.0), {"__all__": over}, {"__all__": False}, {}
