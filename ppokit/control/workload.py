"""The control workload: PPO on a Gymnasium environment.

One iteration, all of it visible here::

    data = rollout.collect(policy)                       # (E, S) tensors, see rollout.py
    adv, ret = compute_advantages(cfg, rewards, values, mask, dones, last_values)   # GAE
    batch = flatten (E, S) -> (N = E*S, T = 1)           # mini-batches shuffle transitions
    metrics = trainer.update(batch, iteration)           # ppokit.trainer: epochs x mini-batches
    tracker.log(iteration, metrics + episode stats + sps [+ periodic eval])

Speed on a CPU: one torch thread (unless ``run.torch_threads``), numpy/torch buffers that
share memory, one forward pass and one ``env.step`` per step for all envs. The control
workload always runs on the CPU: its MLPs are too small for an accelerator to pay off.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ppokit import checkpoint
from ppokit.config import Config, build_config
from ppokit.control.envs import VecEnv, make_vector_env
from ppokit.control.evaluate import Evaluator, evaluate_policy
from ppokit.control.networks import ActorCritic
from ppokit.control.rollout import Rollout
from ppokit.errors import UserError

CHECKPOINT_DIR = "checkpoint"  # RUN_DIR/checkpoint: the final checkpoint
PERIODIC_DIR = "checkpoints"  # RUN_DIR/checkpoints/iter-NNNNNN: run.checkpoint_every


def check_env(cfg: Config) -> None:
    """Raise the UserError that ``train_control`` would (unknown id, unsupported spaces) without training.

    Cheap (one env is made and closed): the CLI can call it before creating a run directory.
    """
    make_vector_env(cfg.env, 1).close()


def setup(cfg: Config) -> None:
    """Threads and seeds (global torch RNG: action sampling; the trainer has its own)."""
    torch.set_num_threads(cfg.run.torch_threads or 1)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)


def make_policy(cfg: Config, venv: VecEnv) -> ActorCritic:
    return ActorCritic(venv.obs_dim, venv.action_dim, venv.discrete, cfg.network)


def flatten_batch(data: dict[str, torch.Tensor], advantages: torch.Tensor, returns: torch.Tensor) -> dict[str, torch.Tensor]:
    """(E, S, ...) -> (N = E*S, T = 1, ...): every transition is one sample of the trainer."""
    n = data["mask"].numel()
    flat = lambda x: x.reshape(n, 1, *x.shape[2:])
    return {
        "obs": flat(data["obs"]),
        "actions": flat(data["actions"]),
        "mask": flat(data["mask"]),
        "old_log_prob": flat(data["log_probs"]),
        "old_values": flat(data["values"]),
        "advantages": flat(advantages),
        "returns": flat(returns),
    }


def train_control(cfg: Config, run_dir: Path | str) -> dict[str, Any]:
    """Train, save ``RUN_DIR/checkpoint``, evaluate deterministically; the final metrics.

    Besides the last iteration's metrics the result holds ``eval_history``: one
    ``{"global_step", "time" (unix), "return_mean"}`` per periodic evaluation.
    """
    from ppokit.trainer import PPOTrainer, compute_advantages
    from ppokit.track import Tracker

    run_dir = Path(run_dir)
    setup(cfg)
    e = cfg.env
    venv = VecEnv(e, e.num_envs, seed=cfg.seed, gamma=cfg.algo.gamma, training=True)
    evaluator: Optional[Evaluator] = None
    tracker = None
    try:
        policy = make_policy(cfg, venv)
        iterations = cfg.iterations
        trainer = PPOTrainer(cfg, policy, total_iterations=iterations)
        rollout = Rollout(venv, e.num_steps)
        if e.eval_every and e.eval_episodes:
            evaluator = Evaluator(cfg, e.eval_episodes)
        tracker = Tracker(run_dir, cfg, iterations, description=cfg.preset or e.id)
        if cfg.run.device not in ("auto", "cpu"):
            tracker.message(f"note: the control workload runs on the CPU (run.device={cfg.run.device} ignored)")
        per_iter = e.num_envs * e.num_steps
        start = time.perf_counter()
        history: list[dict[str, float]] = []
        metrics: dict[str, Any] = {}
        finished_before = 0
        for it in range(iterations):
            t0 = time.perf_counter()
            data = rollout.collect(policy)
            t1 = time.perf_counter()
            advantages, returns = compute_advantages(
                cfg, rewards=data["rewards"], values=data["values"], mask=data["mask"],
                dones=data["dones"], last_values=data["last_values"])
            batch = flatten_batch(data, advantages, returns)
            metrics = trainer.update(batch, it)
            t2 = time.perf_counter()
            global_step = (it + 1) * per_iter
            metrics.update(global_step=global_step, sps=global_step / (t2 - start),
                           collect_time=t1 - t0, update_time=t2 - t1)
            metrics["episodes"] = venv.episodes_finished - finished_before
            finished_before = venv.episodes_finished
            if venv.episode_returns:
                metrics["return_mean"] = float(np.mean(venv.episode_returns))
                metrics["return_std"] = float(np.std(venv.episode_returns))
                metrics["episode_length"] = float(np.mean(venv.episode_lengths))
            last = it == iterations - 1
            stop = False
            if evaluator is not None and ((it + 1) % e.eval_every == 0 or last):
                returns_eval = evaluator.run(policy, venv.normalizer.state_dict())
                metrics["periodic_eval_return_mean"] = float(returns_eval.mean())
                metrics["periodic_eval_return_std"] = float(returns_eval.std())
                history.append({"global_step": global_step, "time": time.time(),
                                "return_mean": float(returns_eval.mean())})
                stop = e.stop_at_return is not None and returns_eval.mean() >= e.stop_at_return
                if stop and not last:
                    tracker.message(f"periodic eval return {returns_eval.mean():.1f} >= env.stop_at_return="
                                    f"{e.stop_at_return:g} at step {global_step}: stopping")
            if cfg.run.checkpoint_every and (it + 1) % cfg.run.checkpoint_every == 0 and not (last or stop):
                save_training_state(run_dir / PERIODIC_DIR / f"iter-{it + 1:06d}", cfg, policy, trainer, venv,
                                    it + 1, global_step)
                checkpoint.prune_checkpoints(run_dir / PERIODIC_DIR, cfg.run.keep_checkpoints)
            if last or stop:
                save_training_state(run_dir / CHECKPOINT_DIR, cfg, policy, trainer, venv, it + 1, global_step)
                if e.eval_episodes:
                    mean, std = evaluate_policy(cfg, policy, venv.normalizer.state_dict(), e.eval_episodes)
                    metrics.update(eval_return_mean=mean, eval_return_std=std)
                metrics["wall_time"] = time.perf_counter() - start
            tracker.log(it, metrics)
            if stop:
                break
        result = {k: v for k, v in metrics.items()}
        result["iterations"] = it + 1
        result["eval_history"] = history
        result["run_dir"] = str(run_dir)
        return result
    finally:
        if tracker is not None:
            tracker.close()
        if evaluator is not None:
            evaluator.close()
        venv.close()


# ---------------------------------------------------------------------------- checkpoints
def save_training_state(path: Path, cfg: Config, policy: ActorCritic, trainer: Any, venv: VecEnv,
                        iteration: int, global_step: int) -> Path:
    """Policy, trainer (optimizer, schedule, RNG), normalization statistics, config, counters."""
    parts = {"model": policy.named_state(), "normalizer": venv.normalizer.state_dict(),
             "trainer": trainer.state_dict(), "rng": {"torch": torch.get_rng_state()}}
    meta = {"workload": "control", "env_id": cfg.env.id, "iteration": iteration, "global_step": global_step,
            "obs_dim": venv.obs_dim, "action_dim": venv.action_dim, "discrete": venv.discrete,
            "config": cfg.to_dict()}
    return checkpoint.save_checkpoint(path, parts, meta)


def load_policy(path: Path | str) -> tuple[Config, ActorCritic, dict]:
    """(config, policy with the checkpoint's weights, normalizer state) from a checkpoint directory."""
    ckpt = checkpoint.load_checkpoint(path)
    meta_file = Path(path) / checkpoint.META
    if ckpt.meta.get("workload") != "control" or "model" not in ckpt.parts or "normalizer" not in ckpt.parts:
        raise UserError(f"checkpoint file {meta_file} is not a control-workload checkpoint")
    try:
        cfg = build_config([ckpt.meta["config"]])
        policy = ActorCritic(int(ckpt.meta["obs_dim"]), int(ckpt.meta["action_dim"]), bool(ckpt.meta["discrete"]),
                             cfg.network)
        policy.load_named_state(ckpt.parts["model"])
        norm = ckpt.parts["normalizer"]
        for key, shape in (("obs_mean", (policy.obs_dim,)), ("obs_var", (policy.obs_dim,)), ("obs_count", ()),
                           ("ret_mean", ()), ("ret_var", ()), ("ret_count", ())):
            if np.shape(norm[key]) != shape:
                raise ValueError(f"normalizer '{key}' has shape {np.shape(norm[key])}, expected {shape}")
    except UserError as exc:
        raise UserError(f"checkpoint file {meta_file}: {exc}") from None
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"checkpoint {Path(path)} does not match its config ({reason})") from None
    policy.eval()
    return cfg, policy, ckpt.parts["normalizer"]
