"""The memory layout of frozen bf16 weights on a CPU, chosen for oneDNN's matmul.

A linear layer computes ``y = x W^T`` with ``W`` [out, in]; PyTorch stores ``W``
row-major, so the matmul's right operand ``W^T`` [K = in, N = out] arrives transposed.
On a CPU, oneDNN's bf16 matmul (the AMX / AVX512-BF16 path) is markedly slower with a
transposed right operand when it is wide (N > K) than with the same operand row-major,
that is with ``W`` stored column-major (the measurements: docs/performance.md, "Weight
layout").

The input gradient ``g W`` has ``W`` itself as its right operand (K = out, N = in), which
is narrow for a wide ``W`` and runs as fast in either layout. A tall weight (out < in,
e.g. the down projection) has the mirror case: its forward is indifferent and its input
gradient is the slow one with a column-major ``W``. A square one gains in the forward
about what it loses in the backward.

So :func:`transpose_wide_weights` stores every frozen bf16 ``nn.Linear`` weight with
more outputs than inputs column-major: the same [out, in] parameter, the same values,
with ``W.t()`` contiguous. Its forward then takes the fast path, its backward is
unchanged, and it costs no memory. Float32 (MKL) runs both layouts at the same speed,
so only bf16 weights move. A matmul's result may differ in the last bit in a few
elements (the kernel sums in another order), as between any two batch shapes.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn


def transpose_wide_weights(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Store each frozen ``dtype`` CPU ``nn.Linear`` weight with ``out > in`` column-major.

    Weights shared with another module (a tied embedding: its row lookups want the row
    layout) and trained weights (their optimizer and gradients expect the usual layout)
    are left as they are. Returns how many weights changed layout.
    """
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is not nn.Linear or not isinstance(weight, torch.Tensor):
            continue
        out_features, in_features = weight.shape
        if (
            weight.requires_grad
            or weight.dtype != dtype
            or weight.device.type != "cpu"
            or out_features <= in_features
            or uses[id(weight)] > 1
            or weight.t().is_contiguous()
        ):
            continue
        weight.data = weight.data.t().contiguous().t()  # [out, in], strides (1, out)
        count += 1
    return count
