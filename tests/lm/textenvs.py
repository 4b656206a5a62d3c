"""Small text environments for the multi-turn source's tests, loaded as ``path/to/textenvs.py:Class``."""

from __future__ import annotations

from ppokit.envs import TextEnv


class Counter(TextEnv):
    """Never ends by itself: each step answers ``"<n>:"`` (state mode: the whole context) and
    rewards 1 for an action that starts with a digit. ``observation_mode`` is a constructor
    argument; in message mode the observations are appended. ``raise_on`` makes ``step``
    raise in episodes whose reset seed is divisible by it; ``bad_return`` makes it return a
    number instead of text."""

    def __init__(
        self,
        observation_mode: str = "state",
        raise_on: int = 0,
        bad_return: bool = False,
        first: str = "0:",
        time_limit: int = 0,
    ):
        super().__init__()
        self.observation_mode = observation_mode
        self.raise_on, self.bad_return, self.first, self.time_limit = raise_on, bad_return, first, time_limit
        self.n = 0
        self.seed = None

    def reset(self, seed=None, options=None):
        self._seed(seed)
        self.seed, self.n = seed, 0
        return self.first, {}

    def step(self, action):
        if self.raise_on and self.seed is not None and self.seed % self.raise_on == 0:
            raise RuntimeError(f"tool crashed on seed {self.seed}")
        if self.bad_return:
            return 42, 0.0, False, False, {}
        self.n += 1
        reward = 1.0 if action[:1].isdigit() else 0.0
        truncated = bool(self.time_limit) and self.n >= self.time_limit
        return f"{self.n}:", reward, False, truncated, {"outcome": "loss"} if truncated else {}
