"""Opt-in CPU acceleration for language models: one call at model build, nothing else depends on it.

On a CPU, with ``model.cpu_kernels`` (the default), :func:`accelerate_policy` (the
policy) and :func:`accelerate_model` (a reward model) put these into a transformers /
peft model after its weights are loaded and cast; every one computes what transformers
and peft compute (each is tested against them) in fewer passes over memory:

- :mod:`.fused_lora`: peft's LoRA linear layers as one autograd function of matmuls
  (no scaled copies, no separate adds), and in bf16 LoRA's rank-r products on ppokit's
  AMX or AVX512-BF16 kernels;
- :mod:`.kernels`: RMSNorm, SwiGLU, rotary embeddings and attention (training and
  scoring passes, and decoding steps) as C kernels the system compiler builds on first
  use; without a compiler the layers stay transformers' own;
- :mod:`.weight_layout`: frozen wide bf16 weights stored column-major, as oneDNN's bf16
  matmul wants them;
- :mod:`.kv_cache`: a generation cache that writes each step in place, which the
  decoding-attention kernel reads without copies;
- :mod:`.head_input`: the LM head's strided input (generation's last positions) made
  contiguous, so that its product is one matrix product and not a batched one over copies.

They swap a module's class for a subclass with a faster forward (:mod:`.class_swap`):
parameters, state dicts and ``save_pretrained`` are unchanged. On any other device
nothing is applied and the model is plain transformers + peft. Measurements of each
piece: docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ppokit.lm.accel.fused_lora import enable_lora_kernels, fuse_lora_layers
from ppokit.lm.accel.head_input import contiguous_head_input
from ppokit.lm.accel.kernels.functions import lora_kernels_kind
from ppokit.lm.accel.kernels.fuse import fuse_cpu_kernels
from ppokit.lm.accel.kv_cache import preallocated_cache
from ppokit.lm.accel.weight_layout import transpose_wide_weights

__all__ = ["Acceleration", "accelerate_model", "accelerate_policy"]


@dataclass
class Acceleration:
    """What :func:`accelerate_policy` applied: fused layers by kind, and the generation cache to use."""

    counts: dict[str, int] = field(default_factory=dict)
    # (model, capacity) -> a transformers Cache for ``generate``; None: transformers' own cache
    kv_cache: Callable[[Any, int], Any] | None = None

    def describe(self) -> str:
        """``" + fused CPU kernels (rms_norm 21, mlp 10, ...)"``, or ``""`` when nothing was fused."""
        counts = {kind: n for kind, n in self.counts.items() if n}
        if not counts:
            return ""
        return " + fused CPU kernels (" + ", ".join(f"{kind} {n}" for kind, n in counts.items()) + ")"


def accelerate_model(model: nn.Module, autocast_dtype: torch.dtype | None) -> dict[str, int]:
    """The CPU kernels and, in bf16, the column-major wide frozen weights for one transformers
    model (not LoRA: see :func:`accelerate_policy`); how many layers of each kind were fused."""
    if next(model.parameters()).device.type != "cpu":
        return {}
    if autocast_dtype == torch.bfloat16:
        transpose_wide_weights(model, autocast_dtype)
    contiguous_head_input(model)  # (no kernel: not counted among the fused layers)
    return {kind: n for kind, n in fuse_cpu_kernels(model).items() if n}


def accelerate_policy(policy) -> Acceleration:
    """Apply the CPU acceleration to an :class:`~ppokit.lm.model.policy.LMPolicy` (its frozen weights
    already cast to the autocast dtype); on other devices nothing changes."""
    if policy.device.type != "cpu":
        return Acceleration()
    counts: dict[str, int] = {}
    if policy.mode == "lora":
        fuse_lora_layers(policy.lm)  # matmul-only LoRA forward and backward
    for lm in policy.models():
        for kind, n in accelerate_model(lm, policy.autocast_dtype).items():
            counts[kind] = counts.get(kind, 0) + n
    if policy.mode == "lora" and policy.autocast_dtype == torch.bfloat16:
        layers = enable_lora_kernels(policy.lm)  # LoRA's rank-r products on AMX or AVX512-BF16
        if layers:
            counts[f"lora_{lora_kernels_kind()}"] = layers
    # The preallocated cache pays where the decoding-attention kernel reads it in place; not in
    # full mode under bf16 autocast, whose fp32 keys beside bf16 values that kernel does not take.
    in_place = counts.get("attention", 0) > 0 and (policy.mode == "lora" or policy.autocast_dtype is None)
    return Acceleration(counts=counts, kv_cache=preallocated_cache if in_place else None)
