"""The LM head's input made contiguous on the CPU: transformers' generation keeps the last
position of each row as a strided view, ``hidden[:, -1:, :]`` of shape (n, 1, H).

PyTorch cannot fold such a view into one (n, H) matrix, so ``F.linear`` on it broadcasts the
(V, H) weight to (n, H, V) and runs a batched product, materialising the copy on a CPU: n x H x V
elements (1.8 GB in bf16 for 32 rows of SmolLM2's 49,152-token head) for a product of n rows.
A contiguous input takes the plain matrix product. Measured on SmolLM2-135M's prefill (32 rows,
bf16, 2 AMD EPYC cores with AVX512-BF16): 3,485 ms -> 17 ms for the head's call, 3.6 s of a
10.0 s generation phase (``bench/real_model.py``; docs/performance.md). The values are the
same product; decoding steps, whose input is contiguous already, do not change.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["contiguous_head_input"]


def _contiguous(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    x = args[0] if args else None
    if x is None or x.is_contiguous():
        return None
    return (x.contiguous(), *args[1:])


def contiguous_head_input(model: nn.Module) -> int:
    """A forward pre-hook on ``model``'s output embedding (its LM head) that makes a strided input
    contiguous; 1 when there was a linear head to hook, else 0."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear) or getattr(head, "_ppokit_contiguous_input", False):
        return 0
    head.register_forward_pre_hook(_contiguous)
    head._ppokit_contiguous_input = True
    return 1
