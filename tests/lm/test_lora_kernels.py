"""LoRA's rank-r products on ppokit's kernels (ppokit/lm/accel/kernels, ``lora_*_bf16``: AMX
tiles, or AVX512-BF16 vectors on CPUs without them): each kernel against its float64
formula on ragged shapes, the threads, oneDNN's matmuls in the same thread (AMX), and the
fused LoRA layer's kernel path against its matmul path and peft."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ppokit.lm.accel.fused_lora import LoRALinearFunction, enable_lora_kernels, fuse_lora_layers
from ppokit.lm.accel.kernels.functions import (
    lora_amx_ready,
    lora_down,
    lora_kernels_eligible,
    lora_kernels_kind,
    lora_outer,
    lora_up_add_,
)

pytestmark = pytest.mark.skipif(lora_kernels_kind() is None, reason="no AMX or AVX512-BF16 here (or no C compiler)")
amx_only = pytest.mark.skipif(not lora_amx_ready(), reason="no AMX here")
BF16 = torch.bfloat16
# (rows, width, rank): whole tiles, and ragged rows, columns and ranks
SHAPES = [
    (64, 128, 8),
    (1568, 640, 8),
    (37, 100, 6),
    (5, 1712, 16),
    (33, 70, 2),
    (300, 96, 14),
    (100, 130, 32),
    (40, 64, 20),
    (70, 200, 36),
    (33, 96, 64),
]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def assert_bf16_of(got: torch.Tensor, want: torch.Tensor):
    """got (bf16) is want (float64) to a bf16 rounding of a float32 sum: within 2^-7 of the
    values' scale (the sum's terms are exact products, summed in another order)."""
    assert got.dtype == BF16 and got.shape == want.shape
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2**-7 * scale)


@pytest.mark.parametrize("n,d,r", SHAPES)
def test_down_is_x_times_m_transposed(n, d, r):
    g = gen(n + d + r)
    x, m = torch.randn(n, d, generator=g).to(BF16), torch.randn(r, d, generator=g).to(BF16)
    assert_bf16_of(lora_down(x, m), x.double() @ m.double().T)


@pytest.mark.parametrize("n,d,r", SHAPES)
def test_up_add_adds_the_scaled_product_in_place_as_addmm_does(n, d, r):
    g = gen(n * d * r)
    y, h, m = (torch.randn(*s, generator=g).to(BF16) for s in ((n, d), (n, r), (r, d)))
    want = y.double() + 1.7 * h.double() @ m.double()
    theirs = y.clone().addmm_(h, m, alpha=1.7)
    out = lora_up_add_(y, h, m, 1.7)
    assert out.data_ptr() == y.data_ptr()
    assert_bf16_of(y, want)
    off = (y.view(torch.int16).int() - theirs.view(torch.int16).int()).abs()
    assert int(off.max()) <= 1 and float((off > 0).float().mean()) <= 1e-3  # oneDNN's sums, one rounding


@pytest.mark.parametrize("n,d,r", SHAPES)
def test_outer_is_the_scaled_weight_gradient(n, d, r):
    g = gen(n + 2 * d + 3 * r)
    p, x = torch.randn(n, r, generator=g).to(BF16), torch.randn(n, d, generator=g).to(BF16)
    assert_bf16_of(lora_outer(p, x, 0.25), 0.25 * p.double().T @ x.double())


def test_strided_rows_are_read_in_place():
    g = gen(7)
    wide = torch.randn(50, 200, generator=g).to(BF16)
    x, m, p = wide[:, 30:130], torch.randn(4, 100, generator=g).to(BF16), torch.randn(50, 4, generator=g).to(BF16)
    assert x.stride(0) == 200
    assert torch.equal(lora_down(x, m), lora_down(x.contiguous(), m))
    assert torch.equal(lora_outer(p, x, 1.0), lora_outer(p, x.contiguous(), 1.0))


def test_two_threads_give_one_threads_numbers():
    g = gen(8)
    x, m, p = (torch.randn(*s, generator=g).to(BF16) for s in ((1000, 640), (8, 640), (1000, 8)))
    y = torch.randn(1000, 640, generator=g).to(BF16)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append((lora_down(x, m), lora_up_add_(y.clone(), p, m, 2.0), lora_outer(p, x, 0.5)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


@amx_only
def test_onednn_bf16_matmuls_between_the_kernels_stay_right():
    """Both use the tile registers of one thread: each kernel configures them on entry and
    releases them on exit, and oneDNN's matmuls before and after give their numbers."""
    g = gen(9)
    a, b = torch.randn(512, 640, generator=g).to(BF16), torch.randn(640, 640, generator=g).to(BF16)
    x, m = torch.randn(300, 640, generator=g).to(BF16), torch.randn(8, 640, generator=g).to(BF16)
    product, h = a @ b, lora_down(x, m)
    for _ in range(3):
        assert torch.equal(a @ b, product)
        assert torch.equal(lora_down(x, m), h)
        assert torch.equal(x @ m.T, x @ m.T)


@amx_only
def test_kernels_ask_for_the_tile_state_in_a_fresh_process():
    """A tile instruction before Linux grants the AMX state is an illegal instruction: the
    kernels' entry points ask for it first, whatever ran before them in the process."""
    code = (
        "import torch\n"
        "from ppokit.lm.accel.kernels.functions import lora_down\n"
        "x, m = torch.ones(40, 64, dtype=torch.bfloat16), torch.ones(8, 64, dtype=torch.bfloat16)\n"
        "assert bool((lora_down(x, m) == 64).all())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_eligibility():
    x, a, b = torch.zeros(4, 8, dtype=BF16), torch.zeros(2, 8, dtype=BF16), torch.zeros(6, 2, dtype=BF16)
    assert lora_kernels_eligible(x, a, b)
    assert not lora_kernels_eligible(x.float(), a.float(), b.float())  # float32: the matmuls
    assert not lora_kernels_eligible(x, torch.zeros(3, 8, dtype=BF16), torch.zeros(6, 3, dtype=BF16))  # odd rank
    assert lora_kernels_eligible(x, torch.zeros(64, 8, dtype=BF16), torch.zeros(6, 64, dtype=BF16))
    assert not lora_kernels_eligible(x, torch.zeros(66, 8, dtype=BF16), torch.zeros(6, 66, dtype=BF16))  # rank > 64


@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_on_the_kernels_matches_its_matmul_path_and_the_float64_formula(with_bias):
    g = gen(10)
    n, d_in, d_out, r, s = 70, 96, 200, 8, 2.0
    x = torch.randn(n, d_in, generator=g).to(BF16)
    w = (torch.randn(d_out, d_in, generator=g) / d_in**0.5).to(BF16)
    bias = torch.randn(d_out, generator=g).to(BF16) if with_bias else None
    a = (torch.randn(r, d_in, generator=g) / d_in**0.5).to(BF16)
    b = torch.randn(d_out, r, generator=g).to(BF16)
    upstream = torch.randn(n, d_out, generator=g).to(BF16)
    results = {}
    for kernels in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, a, b)]
        y = LoRALinearFunction.apply(leaves[0], w, bias, leaves[1], leaves[2], s, kernels)
        y.backward(upstream)
        results[kernels] = [y.detach()] + [t.grad for t in leaves]
    x64, a64, b64 = (t.double().requires_grad_() for t in (x, a, b))
    y64 = x64 @ w.double().T + s * (x64 @ a64.T) @ b64.T + (bias.double() if with_bias else 0)
    y64.backward(upstream.double())
    for kernels in (False, True):
        for got, want in zip(results[kernels], [y64.detach(), x64.grad, a64.grad, b64.grad]):
            assert_bf16_of(got, want)
    for mine, theirs in zip(results[True], results[False]):  # the two paths agree as closely
        scale = theirs.double().abs().max().item()
        assert (mine.double() - theirs.double()).abs().max().item() <= 2**-7 * scale


def test_peft_layers_on_the_kernels_stay_as_close_to_fp32_as_peft_under_bf16_autocast():
    from peft import LoraConfig, get_peft_model

    def model(seed=0):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 48))
        peft = get_peft_model(net, LoraConfig(r=8, lora_alpha=16, target_modules=["0", "2"]))
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.2)
        return peft

    x = torch.randn(40, 64, generator=gen(11))
    weights = torch.linspace(-1, 1, 40 * 48).view(40, 48)

    def run(net, autocast):
        net.zero_grad()
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            y = net(x)
        (y.float() * weights).sum().backward()
        return [y.float().detach()] + [p.grad.clone() for n, p in net.named_parameters() if "lora_" in n]

    exact = run(model(), autocast=False)
    errors = {}
    for kind in ("peft", "kernels"):
        net = model()
        if kind == "kernels":
            fuse_lora_layers(net)
            assert enable_lora_kernels(net) == 2
        got = run(net, autocast=True)
        errors[kind] = max((a - b).abs().max().item() for a, b in zip(got, exact))
    assert errors["kernels"] <= 2 * errors["peft"] + 1e-6


def test_the_kernels_take_every_pass_on_amx_and_only_decoding_steps_on_vectors():
    """On AVX512-BF16 vectors the kernels run only where no ratio reads the numbers: a
    decoding step (one new position per sequence) without gradient. Training and scoring
    passes keep oneDNN's matmuls, alike, so the first ratio stays exactly 1."""
    from peft import LoraConfig, get_peft_model

    from ppokit.lm.accel.fused_lora import _use_kernels

    net = get_peft_model(torch.nn.Sequential(torch.nn.Linear(64, 96)), LoraConfig(r=8, target_modules=["0"]))
    fuse_lora_layers(net)
    layer = net.base_model.model[0]
    step, sequence = torch.zeros(5, 1, 64, dtype=BF16), torch.zeros(5, 7, 64, dtype=BF16)
    assert not _use_kernels(layer, step)  # not enabled yet
    assert enable_lora_kernels(net) == 1
    on_amx = lora_kernels_kind() == "amx"
    with torch.no_grad():
        assert _use_kernels(layer, step)
        assert _use_kernels(layer, sequence) == on_amx  # scoring and prefill
    assert _use_kernels(layer, step) == on_amx  # with gradient
    assert _use_kernels(layer, sequence) == on_amx  # training
    enable_lora_kernels(net, False)
    with torch.no_grad():
        assert not _use_kernels(layer, step)


def test_a_decoding_step_through_the_kernels_is_the_layers_formula():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(12)
    net = get_peft_model(
        torch.nn.Sequential(torch.nn.Linear(64, 96)), LoraConfig(r=8, lora_alpha=16, target_modules=["0"])
    )
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    layer = net.base_model.model[0]
    x = torch.randn(256, 1, 64, generator=gen(13)).to(BF16)
    fuse_lora_layers(net)
    assert enable_lora_kernels(net) == 1
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        got = net(x)
    w, b = (t.detach().to(BF16).double() for t in (layer.base_layer.weight, layer.base_layer.bias))
    a, bb = (t.detach().to(BF16).double() for t in (layer.lora_A["default"].weight, layer.lora_B["default"].weight))
    x64 = x.double()
    h = (x64 @ a.T).to(BF16).double()  # h is rounded once, as the kernel stores it
    assert_bf16_of(got, (x64 @ w.T + b).to(BF16).double() + 2.0 * h @ bb.T)


def test_ranks_the_kernels_cannot_take_are_refused():
    x, y = torch.zeros(4, 16, dtype=BF16), torch.zeros(4, 16, dtype=BF16)
    with pytest.raises(ValueError, match="rank 66"):
        lora_down(x, torch.zeros(66, 16, dtype=BF16))
    with pytest.raises(ValueError, match="rank 66"):
        lora_outer(torch.zeros(4, 66, dtype=BF16), x, 1.0)
    with pytest.raises(ValueError, match="rank 3 is not an even number"):
        lora_up_add_(y, torch.zeros(4, 3, dtype=BF16), torch.zeros(3, 16, dtype=BF16), 1.0)
    assert torch.equal(y, torch.zeros(4, 16, dtype=BF16))  # nothing written
