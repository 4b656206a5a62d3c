"""Choosing and building the rollout engine: every call site builds its engine here.

``rollout.engine`` picks the engine (:mod:`ppokit.lm.generation.base` describes the seam):

    hf     transformers' ``generate`` (:class:`~ppokit.lm.generation.engine.HFEngine`), any device
    cuda   the CUDA-graph engine (``ppokit/lm/generation/cuda_engine.py``, class ``CudaEngine``);
           CUDA devices only
    auto   :data:`AUTO_ON_CUDA` (cuda) on a CUDA device, else hf

The GPU check measured the CUDA engine 4.6-4.8x faster per PPO iteration than the HF engine
at Qwen2.5-0.5B's shape (one H200, 2026-11-28, LoRA and full mode; its log-probs within
``mismatch_kl`` 9e-5 of the trainer's), so ``auto`` picks it on CUDA; a model it does not run
falls back to the HF engine with a note (``decoder.unsupported_reason``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from ppokit.errors import UserError
from ppokit.lm.generation.base import RolloutEngine
from ppokit.lm.generation.engine import HFEngine

AUTO_ON_CUDA = "cuda"  # what rollout.engine=auto picks on a CUDA device (see the module docstring)
CUDA_ENGINE_MODULE = "ppokit.lm.generation.cuda_engine"


def engine_kind(requested: str, device: torch.device | str) -> str:
    """The engine ``rollout.engine = requested`` means on ``device``: ``"hf"`` or ``"cuda"``;
    a :class:`UserError` when ``cuda`` cannot run there."""
    device = torch.device(device)
    if requested == "auto":
        return AUTO_ON_CUDA if device.type == "cuda" else "hf"
    if requested == "cuda":
        if device.type != "cuda":
            raise UserError(
                f"rollout.engine=cuda needs a CUDA device, but the run is on {device.type}; "
                "set rollout.engine=auto (or hf)"
            )
        return "cuda"
    if requested != "hf":
        raise UserError(f"rollout.engine={requested!r} is not an engine; use auto, hf or cuda")
    return "hf"


def engine_class(kind: str) -> Any:
    """The class of engine ``kind`` (``"hf"`` or ``"cuda"``)."""
    if kind == "cuda":
        return importlib.import_module(CUDA_ENGINE_MODULE).CudaEngine
    return HFEngine


def make_engine(policy, tokenizer, rollout_cfg, *, kind: str | None = None, **options: Any) -> RolloutEngine:
    """The engine that samples from ``policy``'s actor (an LMPolicy): ``rollout_cfg.engine``
    (or ``kind``, which overrides it) on the policy's device. ``options`` go to the engine
    class's ``for_policy`` (``kv_cache``, ``activate``, ``eos_ids``: see the seam)."""
    chosen = engine_kind(kind or rollout_cfg.engine, policy.device)
    return engine_class(chosen).for_policy(policy, tokenizer, rollout_cfg, **options)


def make_model_engine(
    model, tokenizer, rollout_cfg, *, autocast_dtype: torch.dtype | None = None, **options: Any
) -> RolloutEngine:
    """The engine that samples from a plain Hugging Face causal LM (``ppokit generate`` on a
    model directory, the warm start's evaluation)."""
    chosen = engine_kind(rollout_cfg.engine, next(model.parameters()).device)
    return engine_class(chosen).for_model(model, tokenizer, rollout_cfg, autocast_dtype=autocast_dtype, **options)
