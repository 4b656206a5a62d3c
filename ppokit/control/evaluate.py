"""Deterministic evaluation: argmax / Gaussian-mean actions, frozen normalization.

Episodes run in their own vector env (``min(episodes, 16)`` copies) seeded
``seed .. seed + n - 1``; env ``i`` contributes ``(episodes + i) // n`` episodes (as SB3's
``evaluate_policy``), so the result does not favour short episodes. The default seed is
``cfg.seed + EVAL_SEED_OFFSET``: the evaluation at the end of training and
``ppokit eval RUN_DIR`` see the same initial states and give the same number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppokit.config import Config, build_config
from ppokit.control.envs import VecEnv
from ppokit.control.networks import ActorCritic
from ppokit.errors import UserError
from ppokit.persistence.checkpoint import load_checkpoint
from ppokit.persistence.checkpoint_files import META
from ppokit.persistence.rundir import RunDir

EVAL_SEED_OFFSET = 10_000
MAX_EVAL_ENVS = 16


class Evaluator:
    """A vector env for repeated deterministic evaluations during or after training."""

    def __init__(self, cfg: Config, episodes: int, seed: int | None = None):
        self.episodes = episodes
        self.num_envs = max(1, min(episodes, MAX_EVAL_ENVS))
        self.venv = VecEnv(
            cfg.env,
            self.num_envs,
            seed=cfg.seed + EVAL_SEED_OFFSET if seed is None else seed,
            gamma=cfg.algo.gamma,
            training=False,
        )
        spec = self.venv.env.spec
        limit = cfg.env.max_episode_steps or (spec.max_episode_steps if spec is not None else None)
        # A policy that never ends an episode in an env without a time limit must not hang the run.
        self.max_steps = (limit + 1) * (-(-episodes // self.num_envs)) if limit else 1_000_000

    def run(self, policy: ActorCritic, normalizer_state: dict | None = None) -> np.ndarray:
        """Returns of ``episodes`` episodes (raw env rewards) under the deterministic policy."""
        venv = self.venv
        if normalizer_state is not None:
            venv.normalizer.load_state_dict(normalizer_state)
        n = self.num_envs
        targets = np.array([(self.episodes + i) // n for i in range(n)])
        counts = np.zeros(n, np.int64)
        ep_return = np.zeros(n, np.float64)
        returns: list[float] = []
        obs = venv.reset()  # seeded on the first call, then continues the env's RNG
        with torch.inference_mode():
            for _ in range(self.max_steps):
                actions = policy.act_deterministic(torch.from_numpy(obs)).numpy()
                obs, raw, _, terminated, truncated, _ = venv.step(actions)
                ep_return += raw
                done = terminated | truncated
                if done.any():
                    for i in np.flatnonzero(done & (counts < targets)):
                        returns.append(float(ep_return[i]))
                        counts[i] += 1
                    ep_return[done] = 0.0
                    if (counts >= targets).all():
                        break
            else:
                raise UserError(
                    f"evaluation of {self.venv.cfg.id}: episodes did not end within {self.max_steps} "
                    "steps; set env.max_episode_steps"
                )
        return np.asarray(returns)

    def close(self) -> None:
        self.venv.close()


def evaluate_policy(
    cfg: Config, policy: ActorCritic, normalizer_state: dict | None, episodes: int, seed: int | None = None
) -> tuple[float, float]:
    """(mean, std) of the deterministic return over ``episodes`` episodes in a fresh env."""
    evaluator = Evaluator(cfg, episodes, seed)
    try:
        returns = evaluator.run(policy, normalizer_state)
    finally:
        evaluator.close()
    return float(returns.mean()), float(returns.std())


def load_policy(path: Path | str) -> tuple[Config, ActorCritic, dict]:
    """(config, policy with the checkpoint's weights, normalizer state) from a checkpoint directory."""
    ckpt = load_checkpoint(path)
    meta_file = Path(path) / META
    parts = ckpt.parts  # the run loop's layout
    model, norm = parts.get("learner", {}).get("model"), parts.get("source", {}).get("normalizer")
    if ckpt.meta.get("workload") != "control" or model is None or norm is None:
        raise UserError(f"checkpoint file {meta_file} is not a control-workload checkpoint")
    try:
        cfg = build_config([ckpt.meta["config"]])
        policy = ActorCritic(
            int(ckpt.meta["obs_dim"]), int(ckpt.meta["action_dim"]), bool(ckpt.meta["discrete"]), cfg.network
        )
        policy.load_named_state(model)
        for key, shape in (
            ("obs_mean", (policy.obs_dim,)),
            ("obs_var", (policy.obs_dim,)),
            ("obs_count", ()),
            ("ret_mean", ()),
            ("ret_var", ()),
            ("ret_count", ()),
        ):
            if np.shape(norm[key]) != shape:
                raise ValueError(f"normalizer '{key}' has shape {np.shape(norm[key])}, expected {shape}")
    except UserError as exc:
        raise UserError(f"checkpoint file {meta_file}: {exc}") from None
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"checkpoint {Path(path)} does not match its config ({reason})") from None
    policy.eval()
    return cfg, policy, norm


def evaluate_run(run_dir: str | Path | RunDir, episodes: int, seed: int | None = None) -> tuple[float, float]:
    """Load ``RUN_DIR``'s config and checkpoint, run the deterministic policy: (mean, std).

    The checkpoint is ``RUN_DIR/checkpoint`` (the end of training), else the newest periodic
    one (an interrupted or running run; a note says which), or RUN_DIR itself when it is a
    checkpoint directory (:meth:`ppokit.persistence.rundir.RunDir.control_checkpoint`). Reads only: a run
    training in ``RUN_DIR`` is left alone.
    """
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    ckpt_dir, note = run.control_checkpoint()
    if note:
        print(note, flush=True)
    cfg, policy, normalizer_state = load_policy(ckpt_dir)
    torch.set_num_threads(cfg.run.torch_threads or 1)
    return evaluate_policy(cfg, policy, normalizer_state, episodes, seed)


def report_run(run: RunDir, /, *, episodes: int | None = None, seed: int | None = None, **_: Any) -> str:
    """What ``ppokit eval`` prints for a control run: the deterministic return over ``episodes``
    (default 10) episodes (:func:`evaluate_run`)."""
    episodes = episodes or 10
    mean, std = evaluate_run(run, episodes, seed=seed)
    return f"return over {episodes} episodes: {mean:.2f} +- {std:.2f}"
