"""The fused LoRA linear: same values and gradients as peft's own forward, and peft's
forward wherever the fused path does not apply."""

from __future__ import annotations

import pytest
import torch
from lm_helpers import DEVICES
from torch import nn

from ppokit.lm.accel.fused_lora import LoRALinearFunction, _fusable_adapter, fuse_lora_layers, unfuse_lora_layers


def naive_lora(x, w, b, a, bb, s):
    """The LoRA linear written out, float64: y = x W^T + b + s (x A^T) B^T."""
    y = x @ w.T + s * (x @ a.T) @ bb.T
    return y + b if b is not None else y


@pytest.mark.parametrize("with_bias", [True, False])
def test_function_matches_the_naive_float64_formula_and_its_gradients(with_bias):
    g = torch.Generator().manual_seed(0)
    n, d_in, d_out, r, s = 7, 5, 6, 3, 1.7
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    b = torch.randn(d_out, generator=g, dtype=torch.float64) if with_bias else None
    a = torch.randn(r, d_in, generator=g, dtype=torch.float64, requires_grad=True)
    bb = torch.randn(d_out, r, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(n, d_out, generator=g, dtype=torch.float64)

    y = LoRALinearFunction.apply(x, w, b, a, bb, s)
    fused = torch.autograd.grad(y, (x, a, bb), upstream)
    y_ref = naive_lora(x, w, b, a, bb, s)
    naive = torch.autograd.grad(y_ref, (x, a, bb), upstream)

    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(fused, naive):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x_, a_, b_: LoRALinearFunction.apply(x_, w, b, a_, b_, s), (x, a, bb))


def test_function_skips_gradients_nobody_asked_for():
    x = torch.randn(4, 3, dtype=torch.float64)  # no grad: the first layer's input
    a = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    bb = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    y = LoRALinearFunction.apply(x, torch.randn(5, 3, dtype=torch.float64), None, a, bb, 0.5)
    y.sum().backward()
    assert a.grad is not None and bb.grad is not None and x.grad is None


# ----------------------------------------------------------------------------- on peft layers
class TwoLinears(nn.Module):
    """Enough of a model for peft: a biased and an unbiased linear, a nonlinearity between."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 9, bias=True)
        self.down = nn.Linear(9, 4, bias=False)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def peft_model(dropout=0.0, seed=0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = lambda: LoraConfig(r=3, lora_alpha=5, lora_dropout=dropout, target_modules=["up", "down"])  # noqa: E731
    model = get_peft_model(TwoLinears(), cfg(), adapter_name="actor")
    model.add_adapter("critic", cfg())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)  # lora_B starts at zero: make every gradient count
    return model


def lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}


def run(model, x, adapter="actor"):
    model.set_adapter(adapter)
    model.zero_grad()
    x = x.clone().requires_grad_(True)
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)).sum().backward()
    return y.detach(), x.grad, lora_grads(model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adapter", ["actor", "critic"])
def test_fused_layers_give_peft_values_and_gradients_in_fp32(adapter, device):
    x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(1)).to(device)
    plain, fused = peft_model().to(device), peft_model().to(device)
    assert fuse_lora_layers(fused) == 2
    y0, gx0, grads0 = run(plain, x, adapter)
    y1, gx1, grads1 = run(fused, x, adapter)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    assert grads0.keys() == grads1.keys() and all(f".{adapter}." in n for n in grads0) and len(grads0) == 4
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_layers_under_bf16_autocast_stay_as_close_to_fp32_as_peft(device):
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(2)).to(device)
    exact_y, _, exact_grads = run(peft_model().to(device), x)
    errors = {}
    for kind in ("peft", "fused"):
        model = peft_model().to(device)
        if kind == "fused":
            fuse_lora_layers(model)
        with torch.autocast(device, dtype=torch.bfloat16):
            y, _, grads = run(model, x)
        assert y.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads.values())
        errors[kind] = max(
            [(y.float() - exact_y).abs().max().item()]
            + [(grads[n] - exact_grads[n]).abs().max().item() for n in exact_grads]
        )
    assert errors["fused"] <= 2 * errors["peft"] + 1e-6


def test_disabled_adapters_and_mixed_batches_take_peft_path():
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))
    base = TwoLinears()
    fused = peft_model()
    base.load_state_dict(
        {
            k.replace("base_model.model.", "").replace(".base_layer", ""): v
            for k, v in fused.state_dict().items()
            if "lora_" not in k
        }
    )
    fuse_lora_layers(fused)
    with fused.disable_adapter(), torch.no_grad():
        torch.testing.assert_close(fused(x), base(x))  # the reference policy: the bare backbone
    plain = peft_model()
    fused.eval(), plain.eval()  # peft takes adapter_names in eval mode only
    with torch.no_grad():  # peft's per-row adapter names
        names = ["actor", "critic", "actor"]
        torch.testing.assert_close(fused(x, adapter_names=names), plain(x, adapter_names=names))


def test_layers_the_fused_path_cannot_compute_exactly_are_left_to_peft():
    layer = peft_model(dropout=0.1).base_model.model.up
    assert _fusable_adapter(layer) is None  # dropout
    layer = peft_model().base_model.model.up
    assert _fusable_adapter(layer) == "actor"
    layer.merge()
    assert _fusable_adapter(layer) is None  # merged into the base weight
    layer.unmerge()
    layer.set_adapter(["actor", "critic"])
    assert _fusable_adapter(layer) is None  # several active adapters


def test_fusing_keeps_the_state_dict_is_idempotent_and_undoes():
    from peft.tuners.lora import Linear as LoraLinear

    plain, fused = peft_model(), peft_model()
    assert fuse_lora_layers(fused) == 2 and fuse_lora_layers(fused) == 0
    assert list(fused.state_dict()) == list(plain.state_dict())
    layers = (fused.base_model.model.up, fused.base_model.model.down)
    assert all(isinstance(m, LoraLinear) and type(m) is not LoraLinear for m in layers)
    assert unfuse_lora_layers(fused) == 2 and unfuse_lora_layers(fused) == 0
    assert all(type(m) is LoraLinear for m in layers)
