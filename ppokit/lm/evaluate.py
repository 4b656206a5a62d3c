"""``ppokit eval RUN_DIR`` for a language-model run: greedy held-out accuracy of its actor.

The checkpoint is ``RUN_DIR/checkpoint`` (the end of training), else the newest periodic
checkpoint, or RUN_DIR itself when it is a checkpoint directory. The held-out prompts
and the reward function come from the run's config (``data.eval_prompts`` or the
built-in task's held-out split, ``data.reward``), so the number is the one the run
printed as "held-out accuracy after PPO" (same prompts, same greedy decoding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ppokit.errors import UserError

POLICY_META = "policy.json"


def is_lm_checkpoint(path: Path) -> bool:
    return (path / POLICY_META).is_file()


def find_lm_checkpoint(run_dir: Path) -> Optional[Path]:
    """The checkpoint ``ppokit eval`` reads for ``run_dir`` (None: not a language-model run)."""
    from ppokit.rundir import FINAL_DIR, latest_checkpoint

    if is_lm_checkpoint(run_dir):
        return run_dir
    if is_lm_checkpoint(run_dir / FINAL_DIR):
        return run_dir / FINAL_DIR
    found = latest_checkpoint(run_dir)
    return found if found is not None and is_lm_checkpoint(found) else None


def _config_of(ckpt: Path):
    """The run's config, from the checkpoint's trainer state or the run directory's config.yaml."""
    import json

    from ppokit.config import build_config, read_yaml
    from ppokit.lm.workload import TRAINER_DIR

    meta = ckpt / TRAINER_DIR / "meta.json"
    saved = None
    if meta.is_file():
        try:
            saved = json.loads(meta.read_text()).get("config")
        except (OSError, ValueError, AttributeError):
            raise UserError(f"checkpoint file {meta} is corrupt or truncated") from None
    if not isinstance(saved, dict):
        for candidate in (ckpt / "config.yaml", ckpt.parent / "config.yaml", ckpt.parent.parent / "config.yaml"):
            if candidate.is_file():
                saved = read_yaml(candidate)
                break
    if not isinstance(saved, dict):
        raise UserError(f"{ckpt}: no config found (neither {meta} nor the run's config.yaml)")
    return build_config([saved])     # an invalid config is a one-line ConfigError


def evaluate_lm_run(run_dir: str | Path, size: Optional[int] = None) -> dict:
    """``{"accuracy", "prompts", "checkpoint"}``: greedy mean reward over the held-out prompts."""
    import torch

    from ppokit.lm.policy import load_policy, load_tokenizer, resolve_precision
    from ppokit.lm.workload import evaluate, load_data, one_thread_if_small, resolve_device_name

    run_dir = Path(run_dir)
    ckpt = find_lm_checkpoint(run_dir)
    if ckpt is None:
        raise UserError(f"{run_dir} has no language-model checkpoint (no {POLICY_META})")
    cfg = _config_of(ckpt)
    tokenizer = load_tokenizer(ckpt, "the checkpoint's tokenizer")
    _, eval_items, reward_fn = load_data(cfg, tokenizer, where=f"the checkpoint {ckpt}")
    if size is not None:
        if size < 1:
            raise UserError(f"--prompts must be at least 1 (got {size})")
        eval_items = eval_items[:size]
    if reward_fn is None:
        raise UserError(f"{run_dir}: the run is scored by its reward model alone, and held-out accuracy needs a "
                        "verifier (data.reward); evaluate with a config that names one")
    if not eval_items:
        raise UserError(f"{run_dir}: the run has no held-out prompts (set data.eval_prompts, or use a built-in "
                        "task, and data.eval_size > 0)")
    device = resolve_device_name(cfg)
    policy = load_policy(ckpt, device=device, autocast_dtype=resolve_precision(cfg.run.precision, device),
                         cpu_kernels=cfg.model.cpu_kernels)
    if cfg.run.torch_threads:
        torch.set_num_threads(cfg.run.torch_threads)
    one_thread_if_small(cfg, policy, policy.device)
    accuracy = evaluate(policy, tokenizer, eval_items, reward_fn, cfg)
    return {"accuracy": accuracy, "prompts": len(eval_items), "checkpoint": str(ckpt)}
