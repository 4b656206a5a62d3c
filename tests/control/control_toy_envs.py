"""Tiny Gymnasium environments for the control tests (registered on import).

Usable from the command line as ``env.id=control_toy_envs:ppokit-test/NAME-v0`` with
this directory on PYTHONPATH.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class IdentityDiscrete(gym.Env):
    """SB3's identity test: obs = one-hot of a random state, reward 1 iff action == state."""

    def __init__(self, n: int = 4):
        self.n = n
        self.observation_space = spaces.Box(0.0, 1.0, (n,), np.float32)
        self.action_space = spaces.Discrete(n)
        self.state = 0

    def _obs(self):
        obs = np.zeros(self.n, np.float32)
        obs[self.state] = 1.0
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.state = int(self.np_random.integers(self.n))
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action) == self.state)
        self.state = int(self.np_random.integers(self.n))
        return self._obs(), reward, False, False, {}


class IdentityBox(gym.Env):
    """Continuous identity: obs uniform in [-1, 1], reward 1 iff |action - obs| < eps."""

    def __init__(self, eps: float = 0.5):
        self.eps = eps
        self.observation_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.state = np.zeros(1, np.float32)

    def _draw(self):
        self.state = self.np_random.uniform(-1.0, 1.0, (1,)).astype(np.float32)
        return self.state.copy()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._draw(), {}

    def step(self, action):
        reward = float(abs(float(np.asarray(action).reshape(-1)[0]) - float(self.state[0])) < self.eps)
        return self._draw(), reward, False, False, {}


class ConstantReward(gym.Env):
    """Constant observation, reward 1 per step, never terminates (a time limit truncates it)."""

    observation_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.ones(1, np.float32), {}

    def step(self, action):
        return np.ones(1, np.float32), 1.0, False, False, {}


class OneStep(ConstantReward):
    """Constant observation, reward 1, every episode terminates after one step."""

    def step(self, action):
        return np.ones(1, np.float32), 1.0, True, False, {}


class Countdown(gym.Env):
    """obs = steps left / 10; terminates after ``length`` steps with reward = the action (Box)."""

    observation_space = spaces.Box(0.0, 1.0, (1,), np.float32)
    action_space = spaces.Box(-2.0, 2.0, (1,), np.float32)

    def __init__(self, length: int = 3):
        self.length = length
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([self.length / 10], np.float32), {}

    def step(self, action):
        self.t += 1
        obs = np.array([(self.length - self.t) / 10], np.float32)
        return obs, float(np.asarray(action).reshape(-1)[0]), self.t >= self.length, False, {}


class MultiBinaryActions(ConstantReward):
    action_space = spaces.MultiBinary(3)


class DictObservations(ConstantReward):
    observation_space = spaces.Dict({"a": spaces.Box(-1.0, 1.0, (1,), np.float32)})

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return {"a": np.ones(1, np.float32)}, {}

    def step(self, action):
        return {"a": np.ones(1, np.float32)}, 1.0, False, False, {}


_ENVS = {
    "IdentityDiscrete-v0": (IdentityDiscrete, 50),
    "IdentityBox-v0": (IdentityBox, 50),
    "ConstantReward-v0": (ConstantReward, 10),
    "OneStep-v0": (OneStep, None),
    "Countdown-v0": (Countdown, None),
    "MultiBinary-v0": (MultiBinaryActions, 10),
    "DictObs-v0": (DictObservations, 10),
}
for _name, (_cls, _limit) in _ENVS.items():
    if f"ppokit-test/{_name}" not in gym.registry:
        gym.register(f"ppokit-test/{_name}", entry_point=_cls, max_episode_steps=_limit)
