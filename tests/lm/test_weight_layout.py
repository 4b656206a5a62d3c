"""Column-major storage of wide frozen bf16 weights (ppokit.lm.accel.weight_layout)."""

from __future__ import annotations

import torch
from test_policy import handmade_batch, lm_config
from torch import nn

from ppokit.lm.accel.weight_layout import transpose_wide_weights
from ppokit.lm.model.hf import load_tokenizer
from ppokit.lm.model.policy import build_policy

BF16 = torch.bfloat16


def frozen_linear(n_in, n_out, dtype=BF16, trainable=False):
    layer = nn.Linear(n_in, n_out, bias=True).to(dtype)
    layer.requires_grad_(trainable)
    return layer


def is_column_major(w: torch.Tensor) -> bool:
    return w.t().is_contiguous() and not w.is_contiguous()


def test_only_frozen_wide_bf16_unshared_weights_move_and_keep_their_values():
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "wide": frozen_linear(8, 24),
            "tall": frozen_linear(24, 8),
            "square": frozen_linear(8, 8),
            "trained": frozen_linear(8, 24, trainable=True),
            "fp32": frozen_linear(8, 24, dtype=torch.float32),
            "embed": nn.Embedding(24, 8).to(BF16).requires_grad_(False),
            "tied_head": frozen_linear(8, 24),
        }
    )
    model["tied_head"].weight = model["embed"].weight  # [24, 8], shared
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    assert transpose_wide_weights(model) == 1
    assert is_column_major(model["wide"].weight)
    for name in ("tall", "square", "trained", "fp32", "embed"):
        assert model[name].weight.is_contiguous(), name
    for name, p in model.named_parameters():
        assert p.shape == before[name].shape and torch.equal(p, before[name]), name
    assert transpose_wide_weights(model) == 0  # already in place


def test_a_column_major_weight_computes_the_same_linear_and_input_gradient():
    torch.manual_seed(1)
    layer = frozen_linear(64, 176)
    x = torch.randn(96, 64, dtype=BF16, requires_grad=True)
    g = torch.randn(96, 176, dtype=BF16)
    exact = x.detach().double() @ layer.weight.double().t() + layer.bias.double()  # [96, 176]
    exact_dx = g.double() @ layer.weight.double()  # [96, 64]
    outputs = {}
    for layout in ("row", "column"):
        if layout == "column":
            assert transpose_wide_weights(layer) == 1
        y = layer(x)
        (dx,) = torch.autograd.grad(y, x, g)
        outputs[layout] = (y, dx)
        # Both within bf16 rounding of the float64 result (one ulp of |y| <= ~16 is 1/16).
        assert (y.double() - exact).abs().max() <= 2**-7 * exact.abs().max()
        assert (dx.double() - exact_dx).abs().max() <= 2**-7 * exact_dx.abs().max()
    (y_row, dx_row), (y_col, dx_col) = outputs["row"], outputs["column"]
    torch.testing.assert_close(y_col, y_row, rtol=2**-7, atol=0)
    torch.testing.assert_close(dx_col, dx_row, rtol=2**-7, atol=0)


def test_a_bf16_cpu_policy_stores_its_wide_frozen_weights_column_major(tiny_dir):
    from peft.tuners.lora import Linear as LoraLinear

    from ppokit.lm.accel import accelerate_policy

    cfg = lm_config(tiny_dir, run={"precision": "bf16"})
    policy = build_policy(cfg, tiny_dir, device=torch.device("cpu"), autocast_dtype=BF16)
    accelerate_policy(policy)  # the CPU acceleration layer stores them so
    bases = [m.get_base_layer() for m in policy.lm.modules() if isinstance(m, LoraLinear)]
    wide = [b for b in bases if b.out_features > b.in_features]
    assert wide and all(is_column_major(b.weight) for b in wide)
    assert all(b.weight.is_contiguous() for b in bases if b.out_features <= b.in_features)
    trained = [p for group in policy.param_groups(cfg) for p in group["params"]]
    assert all(p.is_contiguous() for p in trained)

    batch = handmade_batch(load_tokenizer(tiny_dir))
    with torch.no_grad():
        column = policy.evaluate(batch)
        for b in wide:
            b.weight.data = b.weight.data.contiguous()
        row = policy.evaluate(batch)
    for key in ("log_prob", "values"):
        torch.testing.assert_close(column[key], row[key], rtol=0.02, atol=0.02)


def test_an_fp32_policy_keeps_every_weight_row_major(tiny_dir):
    from ppokit.lm.accel import accelerate_policy

    policy = build_policy(lm_config(tiny_dir), tiny_dir, device=torch.device("cpu"), autocast_dtype=None)
    accelerate_policy(policy)
    assert all(p.is_contiguous() for p in policy.lm.parameters())
