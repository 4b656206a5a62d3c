"""Vector environments for the control workload: autoreset, normalization, episode statistics.

Creation (:func:`~ppokit.control.vector_env.make_vector_env`: ``gym.make_vec``, the vectorization
mode) is in :mod:`ppokit.control.vector_env`, which a run's pre-start check imports without torch.

Autoreset is NEXT_STEP everywhere (the native CartPole env has only that): one code path. The call
after an episode's last step ignores its action, resets that env and returns reward 0. That "reset
step" is no transition: :class:`VecEnv` flags it (``reset_step``), the rollout stores ``mask = 0``,
nothing trained reads it. NEXT_STEP is also cheaper for truncation bootstrapping: ``V(final_obs)``
comes from the forward pass the rollout makes anyway on the reset step, where SAME_STEP needs another
over ``infos["final_obs"]``; the price is one wasted step per episode (0.1-0.2% at 500-1000 steps).

:class:`Normalizer`: SB3 ``VecNormalize``'s running mean/variance (:class:`RunningMeanStd`: float64,
Chan's parallel update) of the observations and of the discounted return ``ret = gamma * ret + r``,
for ``r / sqrt(Var[ret] + eps)`` clipped to ``+-clip_reward`` (``ret`` restarts after a done). Reset
steps do not update it; it is saved in checkpoints and frozen (``training=False``) in evaluation.
"""

from __future__ import annotations

import collections
from typing import Any

import gymnasium as gym
import numpy as np

from ppokit.config import EnvConfig
from ppokit.control import envstate
from ppokit.control.vector_env import make_vector_env

EPS = 1e-8


# ---------------------------------------------------------------------- running stats
class RunningMeanStd:
    """Mean and variance of a stream of arrays, merged batch by batch (float64)."""

    def __init__(self, shape: tuple[int, ...] = ()):
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = 1e-4  # as SB3: a tiny prior so the first batch dominates

    def update(self, x: np.ndarray) -> None:
        """Merge a batch ``x`` (n, *shape) into the statistics (Chan et al.)."""
        n = x.shape[0]
        if n == 0:
            return
        b_mean = x.mean(axis=0)
        b_var = x.var(axis=0)
        delta = b_mean - self.mean
        total = self.count + n
        self.mean = self.mean + delta * (n / total)
        m2 = self.var * self.count + b_var * n + delta**2 * (self.count * n / total)
        self.var = m2 / total
        self.count = total

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"mean": self.mean.copy(), "var": self.var.copy(), "count": np.array(self.count, np.float64)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        mean = np.asarray(state["mean"], np.float64)
        if mean.shape != self.mean.shape:
            raise ValueError(f"running stats of shape {mean.shape}, expected {self.mean.shape}")
        self.mean = mean.copy()
        self.var = np.asarray(state["var"], np.float64).copy()
        self.count = float(np.asarray(state["count"]).reshape(-1)[0])


class Normalizer:
    """Observation and reward normalization with SB3 ``VecNormalize`` semantics.

    ``training=False`` freezes the statistics (evaluation, or a loaded checkpoint).
    """

    def __init__(self, env_cfg: EnvConfig, obs_dim: int, num_envs: int, gamma: float, training: bool = True):
        self.norm_obs = env_cfg.normalize_obs
        self.norm_reward = env_cfg.normalize_reward
        self.clip_obs = env_cfg.clip_obs
        self.clip_reward = env_cfg.clip_reward
        self.gamma = gamma
        self.training = training
        self.obs_rms = RunningMeanStd((obs_dim,))
        self.ret_rms = RunningMeanStd(())
        self.returns = np.zeros(num_envs, np.float64)  # discounted return per env, for ret_rms

    def obs(self, obs: np.ndarray, update: np.ndarray | None = None) -> np.ndarray:
        """Normalized float32 observations (E, obs_dim); updates the stats from the ``update`` rows."""
        if not self.norm_obs:
            return obs.astype(np.float32, copy=True)
        if self.training:
            self.obs_rms.update(obs if update is None or update.all() else obs[update])
        out = (obs - self.obs_rms.mean) / np.sqrt(self.obs_rms.var + EPS)
        return np.clip(out, -self.clip_obs, self.clip_obs).astype(np.float32)

    def reward(self, reward: np.ndarray, done: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """Scaled float32 rewards (E,); ``done`` (E,) restarts the discounted return."""
        if not self.norm_reward:
            return reward.astype(np.float32, copy=True)
        if self.training:
            self.returns = np.where(valid, self.returns * self.gamma + reward, 0.0)
            self.ret_rms.update(self.returns[valid])
        out = reward / np.sqrt(self.ret_rms.var + EPS)
        self.returns[done] = 0.0
        return np.clip(out, -self.clip_reward, self.clip_reward).astype(np.float32)

    def state_dict(self) -> dict[str, np.ndarray]:
        state = {f"obs_{k}": v for k, v in self.obs_rms.state_dict().items()}
        state.update({f"ret_{k}": v for k, v in self.ret_rms.state_dict().items()})
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.obs_rms.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("obs_")})
        self.ret_rms.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("ret_")})


# ------------------------------------------------------------------------- VecEnv
class VecEnv:
    """A NEXT_STEP vector env with normalization, action clipping and episode statistics.

    ``step`` returns, per env (E,): the (normalized) next observation, the raw and the
    normalized reward, ``terminated``, ``truncated``, and ``reset_step``: True where
    this call was a NEXT_STEP reset (action ignored, not a transition).
    """

    def __init__(
        self, env_cfg: EnvConfig, num_envs: int, seed: int, gamma: float, training: bool = True, stats_window: int = 100
    ):
        self.cfg = env_cfg
        self.num_envs = num_envs
        self.seed = seed
        self.env = make_vector_env(env_cfg, num_envs)
        self.obs_space = self.env.single_observation_space
        self.action_space = self.env.single_action_space
        self.obs_dim = int(self.obs_space.shape[0])
        self.discrete = isinstance(self.action_space, gym.spaces.Discrete)
        if self.discrete:
            self.action_dim = int(self.action_space.n)
            self._low = self._high = None
            self._start = int(self.action_space.start)  # Discrete(n, start): policy index i is action start + i
        else:
            self.action_dim = int(self.action_space.shape[0])
            low, high = self.action_space.low, self.action_space.high
            bounded = np.isfinite(low).all() and np.isfinite(high).all()
            self._low, self._high = (low.astype(np.float32), high.astype(np.float32)) if bounded else (None, None)
            self._act_dtype = self.action_space.dtype
        self.normalizer = Normalizer(env_cfg, self.obs_dim, num_envs, gamma, training)
        self._prev_done = np.zeros(num_envs, bool)
        self._ep_return = np.zeros(num_envs, np.float64)
        self._ep_length = np.zeros(num_envs, np.int64)
        self.episode_returns: collections.deque = collections.deque(maxlen=stats_window)
        self.episode_lengths: collections.deque = collections.deque(maxlen=stats_window)
        self.episodes_finished = 0
        self._seeded = False

    # ------------------------------------------------------------------ api
    def reset(self, seed: int | None = None) -> np.ndarray:
        """Reset every env (seeded ``seed .. seed + E - 1`` on the first call); normalized obs."""
        if seed is None and not self._seeded:
            seed = self.seed
        self._seeded = True
        obs, _ = self.env.reset(seed=seed)
        self.env.action_space.seed(seed)
        self._prev_done[:] = False
        self._ep_return[:] = 0.0
        self._ep_length[:] = 0
        self.normalizer.returns[:] = 0.0
        return self.normalizer.obs(obs)

    def step(self, actions: np.ndarray):
        """Step with ``actions`` (E,) or (E, A); Box actions are clipped to the bounds here."""
        if self.discrete:
            if self._start:
                actions = actions + self._start
        else:
            if self._low is not None:
                actions = np.clip(actions, self._low, self._high)
            if actions.dtype != self._act_dtype:
                actions = actions.astype(self._act_dtype)
        reset_step = self._prev_done.copy()
        valid = ~reset_step
        obs, reward, terminated, truncated, _ = self.env.step(actions)
        terminated = np.asarray(terminated, bool)
        truncated = np.asarray(truncated, bool) & ~terminated
        done = terminated | truncated
        reward = np.asarray(reward, np.float64)
        self._prev_done = done
        # episode statistics of the raw reward
        self._ep_return += reward
        self._ep_length += valid
        if done.any():
            idx = np.flatnonzero(done)
            self.episode_returns.extend(self._ep_return[idx].tolist())
            self.episode_lengths.extend(self._ep_length[idx].tolist())
            self.episodes_finished += idx.size
            self._ep_return[idx] = 0.0
            self._ep_length[idx] = 0
        obs_n = self.normalizer.obs(obs, ~done)  # a final observation is never trained on
        reward_n = self.normalizer.reward(reward, done, valid)
        return obs_n, reward, reward_n, terminated, truncated, reset_step

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue these envs exactly (normalizer stats apart).

        ``env`` is the Gymnasium vector env's snapshot (:mod:`ppokit.control.envstate`), or
        None where it cannot be taken (``AsyncVectorEnv``): then :meth:`load_state_dict`
        leaves the envs to a fresh reset and returns False.
        """
        try:
            env_state = envstate.snapshot(self.env) if self._seeded else None
        except envstate.NotSnapshottable:
            env_state = None
        return {
            "env": env_state,
            "exact": env_state is not None or not self._seeded,
            "seeded": self._seeded,
            "prev_done": self._prev_done.copy(),
            "ep_return": self._ep_return.copy(),
            "ep_length": self._ep_length.copy(),
            "episode_returns": np.asarray(self.episode_returns, np.float64),
            "episode_lengths": np.asarray(self.episode_lengths, np.int64),
            "episodes_finished": int(self.episodes_finished),
            "norm_returns": self.normalizer.returns.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Restore :meth:`state_dict`; False when the envs could not be restored exactly."""
        if np.shape(state["prev_done"]) != (self.num_envs,):
            raise ValueError(f"env state for {np.shape(state['prev_done'])} envs, this run has {self.num_envs}")
        exact = bool(state.get("exact", True))
        if state.get("env") is not None:
            envstate.restore(self.env, state["env"])
            self._seeded = bool(state["seeded"])
        self._prev_done = np.asarray(state["prev_done"], bool).copy()
        self._ep_return = np.asarray(state["ep_return"], np.float64).copy()
        self._ep_length = np.asarray(state["ep_length"], np.int64).copy()
        self.episode_returns.clear()
        self.episode_returns.extend(np.asarray(state["episode_returns"], np.float64).tolist())
        self.episode_lengths.clear()
        self.episode_lengths.extend(np.asarray(state["episode_lengths"], np.int64).tolist())
        self.episodes_finished = int(state["episodes_finished"])
        self.normalizer.returns = np.asarray(state["norm_returns"], np.float64).copy()
        return exact

    def close(self) -> None:
        self.env.close()
