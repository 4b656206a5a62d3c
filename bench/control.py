"""ppokit vs Stable-Baselines3 on the same Gymnasium task, step budget and seeds.

Each run is its own Python process (imports count), ppokit and SB3 one after the other
for every seed. Both evaluate the deterministic policy every ``--eval-every`` env steps
on ``--eval-episodes`` episodes in a separate vector env of 10 envs, and (unless
``--full``) stop as soon as that evaluation reaches the threshold. Reported per run:

- ``to_thr``   wall seconds from process start to the first evaluation >= threshold
- ``steps``    env steps at that point
- ``final``    deterministic return (mean over ``--eval-episodes``) after training stops
- ``sps``      env steps per second of training (evaluations included)
- ``wall``     whole-process wall seconds

Examples::

    python bench/control.py                                  # CartPole-v1, seeds 1 2 3
    python bench/control.py --env halfcheetah --seeds 1      # HalfCheetah-v5, 1M steps
    python bench/control.py --env halfcheetah --only ppokit --full

SB3 settings: CartPole uses rl-zoo's tuned hyperparameters (n_envs 8, n_steps 32,
batch 256, gae_lambda 0.8, gamma 0.98, n_epochs 20, ent_coef 0, lr lin 1e-3, clip lin
0.2). HalfCheetah uses SB3's defaults with VecNormalize and a linear learning-rate decay,
i.e. the same algorithm as CleanRL's ppo_continuous_action.py (1 env, 2048 steps,
mini-batch 64, 10 epochs, lr 3e-4, gamma 0.99, lambda 0.95). ppokit uses its presets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TASKS = {
    "cartpole": {"id": "CartPole-v1", "preset": "cartpole", "steps": 100_000, "threshold": 475.0, "eval_every": 4096},
    "halfcheetah": {
        "id": "HalfCheetah-v5",
        "preset": "halfcheetah",
        "steps": 1_000_000,
        "threshold": 1450.0,
        "eval_every": 50_000,
    },
}


# ----------------------------------------------------------------------------- children
def child_ppokit(a: argparse.Namespace) -> dict:
    from ppokit.config import load_config
    from ppokit.persistence.rundir import create_run_dir
    from ppokit.workloads import train as train_control

    task = TASKS[a.env]
    out = tempfile.mkdtemp(prefix="ppokit-bench-")
    probe = load_config(task["preset"])
    per_iter = probe.env.num_envs * probe.env.num_steps
    overrides = [
        f"seed={a.seed}",
        f"train.total_steps={a.steps}",
        f"env.eval_episodes={a.eval_episodes}",
        f"env.eval_every={max(1, round(a.eval_every / per_iter))}",
        "run.progress=false",
        "run.tensorboard=false",
        f"run.output_dir={out}",
    ]
    if not a.full:
        overrides.append(f"env.stop_at_return={a.threshold}")
    cfg = load_config(task["preset"], overrides)
    result = train_control(cfg, create_run_dir(cfg))
    # the periodic evaluations' rows carry periodic_eval_return_mean, the final one eval_return_mean
    returns = ((h, h.get("periodic_eval_return_mean", h.get("eval_return_mean"))) for h in result["eval_history"])
    hit = next((h for h, r in returns if r is not None and r >= a.threshold), None)
    return {
        "to_thr": hit["time"] - a.t0 if hit else None,
        "steps": hit["global_step"] if hit else None,
        "final": result.get("eval_return_mean"),
        "final_std": result.get("eval_return_std"),
        "global_step": result["global_step"],
        "sps": result["global_step"] / result["wall_time"],
    }


def child_sb3(a: argparse.Namespace) -> dict:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import EvalCallback, StopTrainingOnRewardThreshold
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.vec_env import VecNormalize

    if a.sb3_threads:
        torch.set_num_threads(a.sb3_threads)
    task = TASKS[a.env]
    lin = lambda v: lambda progress_remaining: progress_remaining * v  # noqa: E731
    if a.env == "cartpole":
        n_envs = 8
        env = make_vec_env(task["id"], n_envs=n_envs, seed=a.seed)
        eval_env = make_vec_env(task["id"], n_envs=10, seed=a.seed + 10_000)
        model = PPO(
            "MlpPolicy",
            env,
            n_steps=32,
            batch_size=256,
            gae_lambda=0.8,
            gamma=0.98,
            n_epochs=20,
            ent_coef=0.0,
            learning_rate=lin(1e-3),
            clip_range=lin(0.2),
            seed=a.seed,
            device="cpu",
            verbose=0,
        )
    else:
        n_envs = 1
        env = VecNormalize(make_vec_env(task["id"], n_envs=n_envs, seed=a.seed), gamma=0.99)
        eval_env = VecNormalize(
            make_vec_env(task["id"], n_envs=10, seed=a.seed + 10_000), training=False, norm_reward=False
        )
        model = PPO(
            "MlpPolicy",
            env,
            n_steps=2048,
            batch_size=64,
            n_epochs=10,
            learning_rate=lin(3e-4),
            gamma=0.99,
            gae_lambda=0.95,
            clip_range=0.2,
            ent_coef=0.0,
            vf_coef=0.5,
            max_grad_norm=0.5,
            seed=a.seed,
            device="cpu",
            verbose=0,
        )
    history: list[dict] = []

    class RecordingEvalCallback(EvalCallback):
        # (callback_after_eval is skipped when callback_on_new_best stops training)
        def _on_step(self) -> bool:
            evaluated = self.eval_freq > 0 and self.n_calls % self.eval_freq == 0
            keep_going = super()._on_step()
            if evaluated:
                history.append(
                    {
                        "global_step": self.num_timesteps,
                        "time": time.time(),
                        "return_mean": float(self.last_mean_reward),
                    }
                )
            return keep_going

    stop = None if a.full else StopTrainingOnRewardThreshold(reward_threshold=a.threshold, verbose=0)
    callback = RecordingEvalCallback(
        eval_env,
        callback_on_new_best=stop,
        n_eval_episodes=a.eval_episodes,
        eval_freq=max(1, a.eval_every // n_envs),
        deterministic=True,
        verbose=0,
    )
    start = time.time()
    model.learn(total_timesteps=a.steps, callback=callback)
    train_time = time.time() - start
    if isinstance(env, VecNormalize):
        eval_env.obs_rms = env.obs_rms
    final, final_std = evaluate_policy(model, eval_env, n_eval_episodes=a.eval_episodes, deterministic=True)
    hit = next((h for h in history if h["return_mean"] >= a.threshold), None)
    return {
        "to_thr": hit["time"] - a.t0 if hit else None,
        "steps": hit["global_step"] if hit else None,
        "final": float(final),
        "final_std": float(final_std),
        "global_step": model.num_timesteps,
        "sps": model.num_timesteps / train_time,
    }


# ----------------------------------------------------------------------------- parent
def run_child(lib: str, a: argparse.Namespace, seed: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        lib,
        "--env",
        a.env,
        "--seed",
        str(seed),
        "--steps",
        str(a.steps),
        "--threshold",
        str(a.threshold),
        "--eval-every",
        str(a.eval_every),
        "--eval-episodes",
        str(a.eval_episodes),
    ]
    if a.full:
        cmd.append("--full")
    if a.sb3_threads:
        cmd += ["--sb3-threads", str(a.sb3_threads)]
    t0 = time.time()
    proc = subprocess.run(
        cmd + ["--t0", repr(t0)], cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    wall = time.time() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-3000:])
        return {"lib": lib, "seed": seed, "error": f"exit {proc.returncode}", "wall": wall}
    return {"lib": lib, "seed": seed, "wall": wall, **json.loads(lines[-1])}


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", choices=sorted(TASKS), default="cartpole")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, help="env step budget (default: the task's)")
    p.add_argument("--threshold", type=float, help="deterministic-eval return to reach (default: the task's)")
    p.add_argument("--eval-every", type=int, help="env steps between evaluations (default: the task's)")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--full", action="store_true", help="train the whole budget instead of stopping at the threshold")
    p.add_argument("--only", choices=["ppokit", "sb3"], help="run one library only")
    p.add_argument(
        "--sb3-threads",
        type=int,
        default=1,
        help="torch threads for SB3 (default 1, as ppokit; 0 = torch's default, which is much slower "
        "on a busy 2-core machine)",
    )
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--child", choices=["ppokit", "sb3"], help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    a = p.parse_args()
    task = TASKS[a.env]
    a.steps = a.steps or task["steps"]
    a.threshold = task["threshold"] if a.threshold is None else a.threshold
    a.eval_every = a.eval_every or task["eval_every"]
    if a.child:
        result = child_ppokit(a) if a.child == "ppokit" else child_sb3(a)
        print(json.dumps(result), flush=True)
        return

    libs = [a.only] if a.only else ["ppokit", "sb3"]
    print(
        f"{task['id']}: budget {a.steps} steps, threshold {a.threshold:g} (deterministic eval, "
        f"{a.eval_episodes} episodes every {a.eval_every} steps), {'full budget' if a.full else 'stop at threshold'}",
        flush=True,
    )
    rows = []
    header = f"{'lib':8s} {'seed':>4s} {'to_thr s':>9s} {'steps':>8s} {'final':>14s} {'sps':>8s} {'wall s':>8s}"
    print(header)
    for seed in a.seeds:
        for lib in libs:
            r = run_child(lib, a, seed)
            rows.append(r)
            if "error" in r:
                print(f"{lib:8s} {seed:4d} failed: {r['error']}", flush=True)
                continue
            final = f"{r['final']:.1f}+-{r['final_std']:.1f}" if r["final"] is not None else "-"
            print(
                f"{lib:8s} {seed:4d} {fmt(r['to_thr'], '9.2f')} {fmt(r['steps'], '8d')} {final:>14s} "
                f"{r['sps']:8.0f} {r['wall']:8.1f}",
                flush=True,
            )
    if len(libs) == 2:
        print("\nratios sb3 / ppokit (higher = ppokit faster):")
        for seed in a.seeds:
            mine = next((r for r in rows if r["lib"] == "ppokit" and r["seed"] == seed and "error" not in r), None)
            theirs = next((r for r in rows if r["lib"] == "sb3" and r["seed"] == seed and "error" not in r), None)
            if not mine or not theirs:
                continue
            t = (theirs["to_thr"] / mine["to_thr"]) if mine["to_thr"] and theirs["to_thr"] else None
            print(
                f"  seed {seed}: time to threshold x{fmt(t, '.2f')}, steps/s x{mine['sps'] / theirs['sps']:.2f}, "
                f"wall x{theirs['wall'] / mine['wall']:.2f}"
            )
        for lib in libs:
            ok = [r for r in rows if r["lib"] == lib and r.get("to_thr") is not None]
            if ok:
                print(
                    f"  {lib}: reached the threshold in {len(ok)}/{len(a.seeds)} seeds, median time to threshold "
                    f"{statistics.median(r['to_thr'] for r in ok):.2f} s"
                )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
