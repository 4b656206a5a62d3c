"""The control workload: the components of PPO on a Gymnasium environment.

One iteration, as the run loop (:mod:`ppokit.loop`) drives it::

    batch = ControlSource.collect()        # (E, S) tensors from E envs x S steps (rollout.py)
    advantages: GAE over each env's steps, through episode ends (ppokit.trainer)
    ControlLearner.update(batch)           # flattened to N = E*S samples of T = 1: the mini-batches
                                           # shuffle transitions; ppokit.trainer's epochs
    ControlEvaluator                       # deterministic returns, periodic and final (evaluate.py)

Speed on a CPU: one torch thread (unless ``run.torch_threads``), numpy/torch buffers that
share memory, one forward pass and one ``env.step`` per step for all envs. The control
workload always runs on the CPU: its MLPs are too small for an accelerator to pay off.
Exact resume: the checkpoint holds the weights, the optimizer, the envs mid-episode (see
envstate.py) and the normalization statistics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ppokit.components import Batch, Components
from ppokit.config import Config
from ppokit.control.envs import VecEnv, make_vector_env
from ppokit.control.evaluate import Evaluator, evaluate_policy
from ppokit.control.networks import ActorCritic
from ppokit.control.rollout import Rollout
from ppokit.resume import all_finite
from ppokit.trainer import PPOTrainer

# The per-sample tensors of the update (N = E*S transitions, each a sequence of T = 1 step).
UPDATE_KEYS = ("obs", "actions", "mask", "old_log_prob", "old_values", "advantages", "returns")


class ControlSource:
    """E vector envs stepped by the policy: ``collect() -> Batch`` of (E, S) tensors."""

    def __init__(self, venv: VecEnv, policy: ActorCritic, num_steps: int):
        self.venv, self.policy = venv, policy
        self.rollout = Rollout(venv, num_steps)
        self.steps_per_iteration = venv.num_envs * num_steps
        self._finished_before = venv.episodes_finished

    def collect(self, iteration: int) -> Batch:
        data = self.rollout.collect(self.policy)
        venv = self.venv
        metrics: dict[str, float] = {"episodes": venv.episodes_finished - self._finished_before}
        self._finished_before = venv.episodes_finished
        if venv.episode_returns:
            metrics.update(return_mean=float(np.mean(venv.episode_returns)),
                           return_std=float(np.std(venv.episode_returns)),
                           episode_length=float(np.mean(venv.episode_lengths)))
        tensors = {"obs": data["obs"], "actions": data["actions"], "mask": data["mask"],
                   "old_log_prob": data["log_probs"], "old_values": data["values"], "rewards": data["rewards"],
                   "dones": data["dones"]}
        return Batch(tensors=tensors, extras={"last_values": data["last_values"]}, metrics=metrics)

    def sync_weights(self, learner: "ControlLearner") -> None:
        """Nothing to do: the rollout runs the learner's own network."""

    def state_dict(self) -> dict[str, Any]:
        return {"venv": self.venv.state_dict(), "normalizer": self.venv.normalizer.state_dict(),
                "rollout": {"started": self.rollout.started, "last_obs": self.rollout.obs[-1].copy()}}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        self.venv.normalizer.load_state_dict(state["normalizer"])
        exact = self.venv.load_state_dict(state["venv"])
        self._finished_before = self.venv.episodes_finished
        if exact:
            self.rollout.continue_from(state["rollout"]["last_obs"] if state["rollout"]["started"] else None)
            return []
        # AsyncVectorEnv: the episodes in flight cannot be captured; start new ones.
        cfg = self.venv.cfg
        self.rollout.continue_from(self.venv.reset(seed=self.venv.seed + 100_003 * self.venv.episodes_finished))
        return [f"note: env.vectorization={cfg.vectorization} ({type(self.venv.env).__name__}) cannot be "
                "snapshotted: the episodes in flight restart, so the resumed run is not bit-identical"]


class ControlLearner:
    """The actor-critic and the shared PPO update over the flattened transitions."""

    def __init__(self, cfg: Config, policy: ActorCritic):
        self.policy = policy
        self.trainer = PPOTrainer(cfg, policy, total_iterations=cfg.iterations)

    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        n = batch.tensors["mask"].numel()             # E * S transitions
        flat = {k: v.reshape(n, 1, *v.shape[2:]) for k, v in batch.tensors.items() if k in UPDATE_KEYS}
        return self.trainer.update(flat, iteration)

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """The whole actor-critic: the rollout computes values too."""
        return self.policy.named_state()

    def weights_finite(self) -> bool:
        return all_finite(self.policy.named_state().values())

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.policy.named_state(), "trainer": self.trainer.state_dict()}

    def save_files(self, directory: Path) -> None:
        """Nothing beside the state: the weights are in it (``ppokit eval`` reads them there)."""

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        self.policy.load_named_state(state["model"])
        self.trainer.load_state_dict(state["trainer"])


class ControlEvaluator:
    """Deterministic returns: every ``env.eval_every`` iterations in a vector env of its own
    (``periodic_eval_return_mean``; ``env.stop_at_return`` ends training once reached), and
    over ``env.eval_episodes`` fresh episodes at the end (``eval_return_mean``)."""

    at_start = False

    def __init__(self, cfg: Config, policy: ActorCritic, venv: VecEnv):
        e = cfg.env
        self.cfg, self.policy, self.venv = cfg, policy, venv
        self.every = e.eval_every
        self.periodic = Evaluator(cfg, e.eval_episodes) if e.eval_every else None

    def evaluate(self, phase: str) -> dict[str, float]:
        normalizer = self.venv.normalizer.state_dict()
        if phase == "final":
            mean, std = evaluate_policy(self.cfg, self.policy, normalizer, self.cfg.env.eval_episodes)
            return {"eval_return_mean": mean, "eval_return_std": std}
        returns = self.periodic.run(self.policy, normalizer)
        return {"periodic_eval_return_mean": float(returns.mean()), "periodic_eval_return_std": float(returns.std())}

    def message(self, phase: str, metrics: dict[str, float]) -> Optional[str]:
        return None

    def stop_reason(self, metrics: dict[str, float]) -> Optional[str]:
        target, got = self.cfg.env.stop_at_return, metrics.get("periodic_eval_return_mean")
        if target is not None and got is not None and got >= target:
            return f"periodic eval return {got:.1f} >= env.stop_at_return={target:g}"
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"venv": self.periodic.venv.state_dict()} if self.periodic is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.periodic is not None and "venv" in state:
            self.periodic.venv.load_state_dict(state["venv"])

    def close(self) -> None:
        if self.periodic is not None:
            self.periodic.close()


class ControlWorkload:
    """Builds the components of a control run (:class:`ppokit.components.Workload`)."""

    name = "control"

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def check_inputs(self) -> None:
        """The errors a run would hit (unknown env id, unsupported spaces), before a run directory exists."""
        make_vector_env(self.cfg.env, 1).close()

    def check_checkpoint(self, meta: dict[str, Any], path: Path) -> None:
        """Nothing beyond the loop's checks: the config equality covers the env and the network."""

    def build(self, run_dir: Path) -> Components:
        cfg, e = self.cfg, self.cfg.env
        torch.set_num_threads(cfg.run.torch_threads or 1)
        torch.manual_seed(cfg.seed)                  # network init, then action sampling
        np.random.seed(cfg.seed % 2**32)
        venv = VecEnv(e, e.num_envs, seed=cfg.seed, gamma=cfg.algo.gamma, training=True)
        try:
            policy = ActorCritic(venv.obs_dim, venv.action_dim, venv.discrete, cfg.network)
            learner = ControlLearner(cfg, policy)
            source = ControlSource(venv, policy, e.num_steps)
            evaluator = ControlEvaluator(cfg, policy, venv) if e.eval_episodes else None
        except BaseException:
            venv.close()
            raise
        header = []
        if cfg.run.device not in ("auto", "cpu"):
            header.append(f"note: the control workload runs on the CPU (run.device={cfg.run.device} ignored)")
        meta = {"env_id": e.id, "obs_dim": venv.obs_dim, "action_dim": venv.action_dim, "discrete": venv.discrete}
        return Components(source=source, learner=learner, evaluator=evaluator, description=cfg.preset or e.id,
                          header=header, checkpoint_meta=meta, closers=[venv])
