"""Helpers shared by the language-model tests."""

from __future__ import annotations

import pytest
import torch

# Tests that compare numbers across passes run on every device there is: the CPU always,
# CUDA where a GPU is present (CI has none; the GPU run is reported in the README).
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


def randomize(policy, std=0.1, seed=0):
    """LoRA B starts at zero (so dL/dA = 0): give every adapter weight (lora mode) and the
    value head (if any) a random value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in policy.adapter_names if policy.mode == "lora" else ():
            for p in policy.adapter_parameters(name):
                p.copy_(torch.randn(p.shape, generator=g) * std)
        if policy.value_head is not None:
            weight = policy.value_head.linear.weight
            weight.copy_(torch.randn(weight.shape, generator=g))


# A chat template written with characters of the tiny alphabet; it writes the BOS itself,
# as Llama 3's does.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
