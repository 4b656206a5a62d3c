"""Collect ``num_steps`` steps of ``num_envs`` environments into [E, S] tensors.

The buffers are allocated once as numpy arrays with torch views on the same memory
(``torch.from_numpy``): the env writes observations/rewards/flags into numpy rows, the
policy reads the same rows as tensors, no copies and no per-step ``.item()``. Each step
costs one policy forward pass (actor and critic together) and one ``env.step`` for all
envs, under ``torch.inference_mode()``.

After the loop, per step t (layout [E, S], time-major per env):

- ``mask[t] = 0`` on NEXT_STEP reset steps (see ``envs.py``): the action was ignored
  by the env, there is no transition to learn from.
- ``dones[t] = terminated[t] | truncated[t]``: no bootstrap through the end of an episode.
- truncation bootstrap (``env.truncation: bootstrap``): the reward of a truncated step
  gets ``+ gamma * V(final_obs)``. With NEXT_STEP the final observation is the input of
  step t+1 (a reset step), so ``V(final_obs) = values[t+1]`` (or the bootstrap value
  ``last_values`` after the last step): no extra forward pass. With
  ``truncation: terminal`` a time limit is a termination (CleanRL).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ppokit.control.envs import VecEnv
from ppokit.control.networks import ActorCritic


class Rollout:
    """Preallocated step-major (S, E) buffers and the collection loop."""

    def __init__(self, venv: VecEnv, num_steps: int):
        S, E, D = num_steps, venv.num_envs, venv.obs_dim
        self.venv = venv
        self.num_steps = num_steps
        self.obs = np.zeros((S + 1, E, D), np.float32)  # obs[S]: the observation after the last step
        if venv.discrete:
            self.actions = np.zeros((S, E), np.int64)
        else:
            self.actions = np.zeros((S, E, venv.action_dim), np.float32)
        self.log_probs = np.zeros((S, E), np.float32)
        self.values = np.zeros((S, E), np.float32)
        self.rewards = np.zeros((S, E), np.float32)  # normalized when env.normalize_reward
        self.terminated = np.zeros((S, E), bool)
        self.truncated = np.zeros((S, E), bool)
        self.reset_step = np.zeros((S, E), bool)
        # torch views of the same memory
        self._obs = torch.from_numpy(self.obs)
        self._actions = torch.from_numpy(self.actions)
        self._log_probs = torch.from_numpy(self.log_probs)
        self._values = torch.from_numpy(self.values)
        self._started = False

    @property
    def started(self) -> bool:
        """Whether the envs were reset: the next collection continues from ``obs[-1]``."""
        return self._started

    def continue_from(self, last_obs: np.ndarray | None) -> None:
        """Resume: continue from ``last_obs`` (E, D), the observation after the last collected
        step (None: the envs were never reset; the next collection resets them)."""
        if last_obs is not None:
            self.obs[-1] = np.asarray(last_obs, np.float32)
            self._started = True

    def collect(self, policy: ActorCritic) -> dict[str, Tensor]:
        """Run the policy for ``num_steps`` steps; tensors (E, S[, ...]) plus ``last_values`` (E,)."""
        venv = self.venv
        if not self._started:
            self.obs[0] = venv.reset()
            self._started = True
        else:
            self.obs[0] = self.obs[-1]
        with torch.inference_mode():
            for t in range(self.num_steps):
                actions, log_probs, values = policy.act(self._obs[t])
                self._actions[t] = actions
                self._log_probs[t] = log_probs
                self._values[t] = values
                obs, _raw, reward, terminated, truncated, reset_step = venv.step(self.actions[t])
                self.obs[t + 1] = obs
                self.rewards[t] = reward
                self.terminated[t] = terminated
                self.truncated[t] = truncated
                self.reset_step[t] = reset_step
            last_values = policy.value(self._obs[-1])  # (E,)
        return self._to_batch(last_values)

    def _to_batch(self, last_values: Tensor) -> dict[str, Tensor]:
        cfg = self.venv.cfg
        gamma = self.venv.normalizer.gamma
        t = lambda a: torch.from_numpy(a).transpose(0, 1).contiguous()  # (S, E, ...) -> (E, S, ...)
        values = t(self.values)
        rewards = t(self.rewards)
        truncated = t(self.truncated)
        dones = t(self.terminated | self.truncated)
        if cfg.truncation == "bootstrap" and self.truncated.any():
            next_values = torch.cat([values[:, 1:], last_values.float()[:, None]], dim=1)  # V(s_{t+1}) (E, S)
            rewards = rewards + gamma * next_values * truncated
        return {
            "obs": t(self.obs[:-1]),  # (E, S, D)
            "actions": t(self.actions),  # (E, S) or (E, S, A)
            "log_probs": t(self.log_probs),
            "values": values,
            "rewards": rewards,
            "dones": dones,
            "mask": ~t(self.reset_step),
            "last_values": last_values.float().clone(),
        }
