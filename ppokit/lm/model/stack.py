"""A policy ready to train or sample: one recipe for every process that needs one.

"Choose the device and precision, load the tokenizer, build (or load) the policy, add the
CPU acceleration layer, set the torch threads": the PPO run, its rollout workers and
learner ranks, the multi-turn run and ``ppokit generate``/``chat``/``eval`` all get it
from here, so the rules of :mod:`ppokit.lm.model.device` are applied in one place::

    stack = build_policy_stack(cfg, model_path)              # training: a fresh policy
    stack = load_policy_stack(ckpt, cfg, device=None)         # inference: a checkpoint's actor
    stack.policy, stack.tokenizer, stack.kv_cache             # what the rollout engine takes
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ppokit.config import Config
from ppokit.lm.accel import accelerate_policy
from ppokit.lm.model.checkpoint import load_policy
from ppokit.lm.model.device import (
    attention_implementation,
    placement,
    precision_name,
    resolve_device,
    resolve_precision,
    set_threads,
)
from ppokit.lm.model.hf import causal_lm_config, check_tokenizer_fits, input_embedding_rows, load_tokenizer
from ppokit.lm.model.policy import LMPolicy, build_policy
from ppokit.lm.model.tiny import build_char_tokenizer


@dataclass
class PolicyStack:
    """A policy with what runs it: its tokenizer, device, autocast dtype (None: fp32) and,
    with the CPU kernels, the generation cache they read in place."""

    policy: LMPolicy
    tokenizer: Any
    device: torch.device
    autocast_dtype: torch.dtype | None
    model_path: Path
    kv_cache: Callable[[Any, int], Any] | None = None  # (model, capacity) -> a Cache; None: transformers'
    accel_note: str = ""  # " + fused CPU kernels (...)", for the run's header

    def describe(self) -> str:
        """``PATH (lora, 12,345 trainable parameters), cpu, fp32 + fused CPU kernels (...)``."""
        trainable = sum(p.numel() for p in self.policy.parameters() if p.requires_grad)
        return (
            f"{self.model_path} ({self.policy.mode}, {trainable:,} trainable parameters), {self.device}, "
            f"{precision_name(self.autocast_dtype)}{self.accel_note}"
        )


def prompt_tokenizer(cfg: Config):
    """The tokenizer prompts are counted with before the model is built, checked against the
    vocabulary config.json gives the model (the built model's embeddings are checked again)."""
    if cfg.model.path == "tiny":
        return build_char_tokenizer()
    config = causal_lm_config(cfg.model.path)  # (a directory that is no causal LM: that error first)
    tokenizer = load_tokenizer(cfg.model.path, "model.path")
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    check_tokenizer_fits(tokenizer, getattr(text, "vocab_size", None), "model.path", cfg.model.path)
    return tokenizer


def build_policy_stack(
    cfg: Config,
    model_path: str | Path,
    *,
    need_critic: bool | None = None,
    need_reference: bool | None = None,
    in_host_memory: bool = False,
) -> PolicyStack:
    """A fresh policy for a run of ``cfg`` on the backbone ``model_path`` (seeded by ``cfg.seed``):
    ``need_critic``/``need_reference`` as :func:`~ppokit.lm.model.policy.build_policy` (None:
    what the config's algorithm needs; a rollout worker needs the actor alone).
    ``in_host_memory``: the weights are built in CPU memory whatever ``run.device`` says (FSDP
    learners: each rank moves its own shards to its device); the CPU kernels then only where
    the passes run on the CPU."""
    device, autocast_dtype = placement(cfg)
    tokenizer = load_tokenizer(model_path, "model.path")
    policy = build_policy(
        cfg,
        model_path,
        device=torch.device("cpu") if in_host_memory else device,
        autocast_dtype=autocast_dtype,
        seed=cfg.seed,
        need_critic=need_critic,
        need_reference=need_reference,
    )
    check_tokenizer_fits(tokenizer, input_embedding_rows(policy.lm), "model.path", model_path)
    return _finish(cfg, policy, tokenizer, device, autocast_dtype, Path(model_path))


def load_policy_stack(
    ckpt: str | Path, cfg: Config, *, device: str | None = None, precision: str | None = None
) -> PolicyStack:
    """The actor of checkpoint ``ckpt`` (its run's config ``cfg``) for sampling, on ``device``
    with ``precision`` (None: the run's ``run.device``/``run.precision``); its critic is not loaded."""
    dev = resolve_device(device or cfg.run.device)
    autocast_dtype = resolve_precision(precision or cfg.run.precision, dev)
    attn = attention_implementation("auto", dev)
    tokenizer = load_tokenizer(ckpt, "the checkpoint's tokenizer")
    policy = load_policy(ckpt, device=dev, autocast_dtype=autocast_dtype, attn_implementation=attn, with_critic=False)
    return _finish(cfg, policy, tokenizer, dev, autocast_dtype, Path(ckpt))


def _finish(cfg: Config, policy: LMPolicy, tokenizer, device, autocast_dtype, model_path: Path) -> PolicyStack:
    """``model.cpu_kernels`` (a no-op off the CPU), then the torch threads for the model's size."""
    accel_note, kv_cache = "", None
    if cfg.model.cpu_kernels and device.type == "cpu":  # device: where the passes run
        acceleration = accelerate_policy(policy)
        accel_note, kv_cache = acceleration.describe(), acceleration.kv_cache
    set_threads(policy, device, cfg.run.torch_threads)
    return PolicyStack(policy, tokenizer, device, autocast_dtype, model_path, kv_cache, accel_note)
