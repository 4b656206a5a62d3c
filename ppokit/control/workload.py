"""The control workload: PPO on a Gymnasium environment.

One iteration, all of it visible here::

    data = rollout.collect(policy)                       # (E, S) tensors, see rollout.py
    adv, ret = compute_advantages(cfg, rewards, values, mask, dones, last_values)   # GAE
    batch = flatten (E, S) -> (N = E*S, T = 1)           # mini-batches shuffle transitions
    metrics = trainer.update(batch, iteration)           # ppokit.trainer: epochs x mini-batches
    tracker.log(iteration, metrics + episode stats + sps [+ periodic eval])
    checkpoint every run.checkpoint_every iterations and on SIGINT/SIGTERM (exact resume:
    weights, optimizer, RNGs, the envs mid-episode; see ppokit.resume, envstate.py)

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


def train_control(cfg: Config, run_dir: Path | str, resume_from: Optional[Path | str] = None) -> dict[str, Any]:
    """Train, save ``RUN_DIR/checkpoint``, evaluate deterministically; the final metrics.

    Besides the last iteration's metrics the result holds ``eval_history``: one
    ``{"global_step", "time" (unix), "return_mean"}`` per periodic evaluation.

    ``resume_from``: a checkpoint of this run (see :func:`ppokit.resume.find_resume_checkpoint`);
    training continues exactly where it stopped, ``metrics.jsonl`` rows written after it
    are dropped first. The first SIGINT/SIGTERM ends the iteration, saves a checkpoint and
    raises :class:`~ppokit.errors.Interrupted`; ``train.max_bad_steps`` non-finite steps in
    a row raise :class:`~ppokit.errors.TrainingDiverged` naming the last good checkpoint.
    """
    from ppokit import resume
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
        history: list[dict[str, float]] = []
        start_it = 0
        notes: list[str] = []
        if resume_from is not None:
            start_it, history, finished, notes = load_training_state(
                Path(resume_from), cfg, policy, trainer, venv, rollout, evaluator, run_dir=run_dir)
            resume.truncate_metrics(run_dir, start_it)
            if finished or start_it >= iterations:
                return _finished_result(run_dir, start_it, history)
        # TensorBoard steps are global steps: the resumed run logs (start_it + 1) * per_iter first
        purge = start_it * e.num_envs * e.num_steps + 1 if resume_from is not None else None
        tracker = Tracker(run_dir, cfg, iterations, description=cfg.preset or e.id, purge_step=purge)
        for note in notes:
            tracker.message(note)
        if resume_from is not None:
            tracker.message(f"resumed from {resume_from} at iteration {start_it}")
        if cfg.run.device not in ("auto", "cpu"):
            tracker.message(f"note: the control workload runs on the CPU (run.device={cfg.run.device} ignored)")
        per_iter = e.num_envs * e.num_steps
        start = time.perf_counter()
        metrics: dict[str, Any] = {}
        finished_before = venv.episodes_finished
        it = start_it - 1
        with resume.GracefulStop() as stop:
            for it in range(start_it, iterations):
                t0 = time.perf_counter()
                data = rollout.collect(policy)
                t1 = time.perf_counter()
                advantages, returns = compute_advantages(
                    cfg, rewards=data["rewards"], values=data["values"], mask=data["mask"],
                    dones=data["dones"], last_values=data["last_values"])
                batch = flatten_batch(data, advantages, returns)
                try:
                    metrics = trainer.update(batch, it)
                except resume.TrainingDiverged as exc:
                    raise resume.diverged_message(exc, run_dir) from None
                t2 = time.perf_counter()
                global_step = (it + 1) * per_iter
                metrics.update(global_step=global_step, sps=(it + 1 - start_it) * per_iter / (t2 - start),
                               collect_time=t1 - t0, update_time=t2 - t1)
                metrics["episodes"] = venv.episodes_finished - finished_before
                finished_before = venv.episodes_finished
                if venv.episode_returns:
                    metrics["return_mean"] = float(np.mean(venv.episode_returns))
                    metrics["return_std"] = float(np.std(venv.episode_returns))
                    metrics["episode_length"] = float(np.mean(venv.episode_lengths))
                last = it == iterations - 1
                stop_training = False
                if evaluator is not None and ((it + 1) % e.eval_every == 0 or last):
                    returns_eval = evaluator.run(policy, venv.normalizer.state_dict())
                    metrics["periodic_eval_return_mean"] = float(returns_eval.mean())
                    metrics["periodic_eval_return_std"] = float(returns_eval.std())
                    history.append({"global_step": global_step, "time": time.time(),
                                    "return_mean": float(returns_eval.mean())})
                    stop_training = e.stop_at_return is not None and returns_eval.mean() >= e.stop_at_return
                    if stop_training and not last:
                        tracker.message(f"periodic eval return {returns_eval.mean():.1f} >= env.stop_at_return="
                                        f"{e.stop_at_return:g} at step {global_step}: stopping")
                if last or stop_training:
                    if e.eval_episodes:
                        mean, std = evaluate_policy(cfg, policy, venv.normalizer.state_dict(), e.eval_episodes)
                        metrics.update(eval_return_mean=mean, eval_return_std=std)
                    metrics["wall_time"] = time.perf_counter() - start
                # The row goes out before the checkpoint of the same iteration: a resumed run
                # truncates metrics.jsonl to its checkpoint, so nothing is lost or repeated.
                tracker.log(it, metrics)
                state = dict(cfg=cfg, policy=policy, trainer=trainer, venv=venv, rollout=rollout,
                             evaluator=evaluator, iteration=it + 1, global_step=global_step, history=history)
                if last or stop_training:
                    _check_finite(policy, run_dir, it + 1)
                    save_training_state(run_dir / CHECKPOINT_DIR, finished=True, **state)
                    break
                periodic = cfg.run.checkpoint_every and (it + 1) % cfg.run.checkpoint_every == 0
                if stop.requested:
                    tracker.message(f"received {stop.signal_name}: saving a checkpoint after iteration {it}")
                if periodic or stop.requested:
                    _check_finite(policy, run_dir, it + 1)
                    path = save_training_state(resume.periodic_checkpoint_path(run_dir, it + 1), **state)
                    checkpoint.prune_checkpoints(run_dir / PERIODIC_DIR, cfg.run.keep_checkpoints)
                    if stop.requested:
                        raise stop.interrupted(path, run_dir)
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


def _check_finite(policy: ActorCritic, run_dir: Path, iteration: int) -> None:
    """Refuse to save non-finite weights over (or prune) the good checkpoints."""
    from ppokit import resume

    if not resume.all_finite(policy.named_state().values()):
        raise resume.diverged_message(resume.TrainingDiverged(
            f"training diverged: the policy's weights are not finite after iteration {iteration}"), run_dir)


def _finished_result(run_dir: Path, iterations: int, history: list) -> dict[str, Any]:
    from ppokit.track import read_metrics

    rows = read_metrics(run_dir)
    result = dict(rows[-1]) if rows else {}
    result.update(iterations=iterations, eval_history=history, run_dir=str(run_dir), already_finished=True)
    return result


# ---------------------------------------------------------------------------- checkpoints
def save_training_state(path: Path, cfg: Config, policy: ActorCritic, trainer: Any, venv: VecEnv,
                        iteration: int, global_step: int, rollout: Optional[Rollout] = None,
                        evaluator: Optional[Evaluator] = None, history: Optional[list] = None,
                        finished: bool = False) -> Path:
    """The whole training state: policy, trainer (optimizer, schedule, shuffle generator),
    normalization statistics, the envs mid-episode, RNGs, counters, eval history, config."""
    from ppokit import resume

    parts = {"model": policy.named_state(), "normalizer": venv.normalizer.state_dict(),
             "trainer": trainer.state_dict(), "rng": resume.capture_rng(), "venv": venv.state_dict()}
    if rollout is not None:
        parts["rollout"] = {"started": rollout._started, "last_obs": rollout.obs[-1].copy()}
    if evaluator is not None:
        parts["eval_venv"] = evaluator.venv.state_dict()
    meta = {"workload": "control", "env_id": cfg.env.id, "iteration": iteration, "global_step": global_step,
            "finished": finished, "episodes_finished": venv.episodes_finished, "eval_history": history or [],
            "obs_dim": venv.obs_dim, "action_dim": venv.action_dim, "discrete": venv.discrete,
            "config": cfg.to_dict()}
    return checkpoint.save_checkpoint(path, parts, meta)


def load_training_state(path: Path, cfg: Config, policy: ActorCritic, trainer: Any, venv: VecEnv,
                        rollout: Rollout, evaluator: Optional[Evaluator],
                        run_dir: Optional[Path] = None) -> tuple[int, list, bool, list[str]]:
    """Restore :func:`save_training_state` into freshly built objects.

    Returns (completed iterations, eval history, finished, notes to print). Any mismatch
    or damage is a one-line :class:`UserError` naming the checkpoint.
    """
    from ppokit import resume

    run_dir = Path(run_dir) if run_dir is not None else Path(path).parent
    with resume.advising_on_damage(path, run_dir, marker=checkpoint.META):
        ckpt = checkpoint.load_checkpoint(path)
    meta_file = Path(path) / checkpoint.META
    notes: list[str] = []
    if ckpt.meta.get("workload") != "control":
        raise UserError(f"checkpoint file {meta_file} is not a control-workload checkpoint")
    resume.check_resumable_config(ckpt.meta.get("config", {}), cfg.to_dict(), run_dir)
    iteration = resume.checked_iteration(ckpt.meta, path, cfg.iterations, run_dir, marker=checkpoint.META)
    missing = [k for k in ("model", "normalizer", "trainer", "rng", "venv") if k not in ckpt.parts]
    if missing:
        raise UserError(f"checkpoint {path} cannot be resumed from: it has no {', '.join(missing)} state "
                        "(written by an older ppokit?)")
    try:
        policy.load_named_state(ckpt.parts["model"])
        trainer.load_state_dict(ckpt.parts["trainer"])
        venv.normalizer.load_state_dict(ckpt.parts["normalizer"])
        exact = venv.load_state_dict(ckpt.parts["venv"])
        roll = ckpt.parts.get("rollout")
        if roll is not None and roll["started"] and exact:
            rollout.obs[-1] = np.asarray(roll["last_obs"], np.float32)
            rollout._started = True
        if evaluator is not None and "eval_venv" in ckpt.parts:
            evaluator.venv.load_state_dict(ckpt.parts["eval_venv"])
        resume.restore_rng(ckpt.parts["rng"])
        history = list(ckpt.meta.get("eval_history", []))
    except UserError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"checkpoint {path} does not match this run ({reason})") from None
    if not exact:
        # AsyncVectorEnv: the episodes in flight cannot be captured; start new ones.
        rollout.obs[-1] = venv.reset(seed=cfg.seed + 100_003 * iteration)
        rollout._started = True
        notes.append(f"note: env.vectorization={cfg.env.vectorization} ({type(venv.env).__name__}) cannot be "
                     "snapshotted: the episodes in flight restart, so the resumed run is not bit-identical")
    return iteration, history, bool(ckpt.meta.get("finished", False)), notes


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
