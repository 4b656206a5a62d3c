"""Helpers shared by the language-model tests."""

from __future__ import annotations

import pytest
import torch

# Tests that compare numbers across passes run on every device there is: the CPU always,
# CUDA where a GPU is present (CI has none; the GPU run is reported in the README).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="needs a CUDA device"))]


def randomize(policy, std=0.1, seed=0):
    """LoRA B starts at zero (so dL/dA = 0): give every adapter weight a random value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("actor", "critic"):
            for p in policy.adapter_parameters(name):
                p.copy_(torch.randn(p.shape, generator=g) * std)
        policy.value_head.linear.weight.copy_(torch.randn(policy.value_head.linear.weight.shape, generator=g))


