"""The fused bf16 CPU kernels (ppokit/lm/accel/kernels): each against its float64 formula and
against transformers' bf16 graph of the same computation, the probes that decide which
modules take them, the fallbacks, and the build."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama import modeling_llama

from ppokit.errors import UserError
from ppokit.lm.accel import kernels
from ppokit.lm.accel.kernels import LEVEL_ENV, LEVELS, cpu_library, cpu_supports_avx2, library_at, requested_level
from ppokit.lm.accel.kernels.functions import (
    AttentionFunction,
    RMSNormFunction,
    RotaryFunction,
    SiluMulFunction,
    decode_attention,
    lora_amx_ready,
    lora_kernels_kind,
)
from ppokit.lm.accel.kernels.fuse import fuse_cpu_kernels, unfuse_cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(cpu_library() is None, reason="no C compiler: the kernels are not built")
BF16 = torch.bfloat16


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (for values of one sign)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def assert_same_bf16(mine: torch.Tensor, theirs: torch.Tensor, max_fraction_off: float = 0.0, max_ulps: int = 1):
    """Equal bit for bit, except a fraction of elements one rounding apart (sums taken in
    another order round differently now and then; ``max_ulps`` 2 where two roundings
    follow each other, so that one falling the other way can move the second by two)."""
    assert mine.dtype == theirs.dtype == BF16 and mine.shape == theirs.shape
    off = ulps(mine, theirs)
    assert int(off.max()) <= max_ulps
    assert float((off > 0).float().mean()) <= max_fraction_off


def assert_close_to_float64(got: torch.Tensor, want: torch.Tensor):
    """Kernel results against a float64 reference: within a few roundings of the kernel's
    dtype (bf16: 2^-8, float32: 2^-24), relative to the scale of the values."""
    rel = 2e-2 if got.dtype == BF16 else 2e-5
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=rel, atol=rel * scale)


DTYPES = [BF16, torch.float32]


@pytest.fixture(params=list(LEVELS))
def level(request, monkeypatch) -> str:
    """The test runs on the kernels built at each level (``PPOKIT_CPU_KERNELS``) that this
    machine runs and that differs from its native build: on a CPU with AVX-512 the native
    (AVX-512) code, the AVX2 + FMA code and the plain C one; on an AVX2 laptop the native
    (AVX2) and the plain C one. So each path stays tested on any CPU."""
    name = request.param
    lib = library_at(name)
    if lib is None:
        pytest.skip(f"the {name} build does not run here")
    if name != "native" and lib.kernels_vector_bits() == library_at("native").kernels_vector_bits():
        pytest.skip(f"the native build has the {name} build's vector code")
    monkeypatch.setenv(LEVEL_ENV, name)
    assert cpu_library() is lib
    return name


# ----------------------------------------------------------------------------- RMSNorm
def naive_rms_norm(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def transformers_rms_norm(x, w, eps):
    """transformers' LlamaRMSNorm graph in bf16."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 37])  # 37: the vector loops' remainders
def test_rms_norm_matches_its_float64_formula_and_gradient(d, dtype, level):
    g = gen()
    x = torch.randn(3, 5, d, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    upstream = torch.randn(3, 5, d, generator=g).to(dtype)
    x[0, 0] = 0  # a zero row: eps keeps it finite
    xk = x.clone().requires_grad_()
    y = RMSNormFunction.apply(xk, w, 1e-5)
    (grad,) = torch.autograd.grad(y, xk, upstream)

    x64 = x.double().requires_grad_()
    y64 = naive_rms_norm(x64, w.double(), 1e-5)
    (grad64,) = torch.autograd.grad(y64, x64, upstream.double())
    assert_close_to_float64(y, y64.detach())
    assert_close_to_float64(grad, grad64)
    assert torch.equal(y[0, 0], torch.zeros(d, dtype=dtype)) and torch.isfinite(grad).all()


def test_rms_norm_rounds_like_transformers_bf16_graph(level):
    g = gen(1)
    x = (4 * torch.randn(64, 640, generator=g)).to(BF16)
    w = (1 + 0.3 * torch.randn(640, generator=g)).to(BF16)
    upstream = torch.randn(64, 640, generator=g).to(BF16)
    mine_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    mine = RMSNormFunction.apply(mine_x, w, 1e-6)
    theirs = transformers_rms_norm(theirs_x, w, 1e-6)
    mine.backward(upstream)
    theirs.backward(upstream)
    # y = R(w R(x r)): where the row's float32 r = rsqrt(mean x^2 + eps) comes out one step
    # apart (its sum runs in the order of the build's vectors), the inner rounding may fall
    # the other way, and the outer one then lands up to two steps apart
    assert_same_bf16(mine, theirs, max_fraction_off=1e-3, max_ulps=2)
    assert_same_bf16(mine_x.grad, theirs_x.grad, max_fraction_off=1e-3)


# ----------------------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_its_float64_formula_and_gradients_including_saturation(dtype, level):
    g = gen(2)
    gate = (4 * torch.randn(6, 53, generator=g)).to(dtype)
    gate[0, :4] = torch.tensor([100.0, -100.0, 0.0, -30.0])  # far into both tails
    up = torch.randn(6, 53, generator=g).to(dtype)
    upstream = torch.randn(6, 53, generator=g).to(dtype)
    gk, uk = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = SiluMulFunction.apply(gk, uk)
    grads = torch.autograd.grad(out, (gk, uk), upstream)
    out = out.detach()

    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    out64 = g64 * torch.sigmoid(g64) * u64
    grads64 = torch.autograd.grad(out64, (g64, u64), upstream.double())
    assert_close_to_float64(out, out64.detach())
    for got, want in zip(grads, grads64):
        assert_close_to_float64(got, want)
    assert out[0, 0] == (100 * up[0, 0].float()).to(dtype)  # silu(100) = 100
    assert abs(float(out[0, 1])) < 1e-30 and float(out[0, 2]) == 0.0


def test_silu_mul_rounds_like_torch_bf16_graph(level):
    g = gen(3)
    gate = (3 * torch.randn(128, 300, generator=g)).to(BF16)
    up = torch.randn(128, 300, generator=g).to(BF16)
    upstream = torch.randn(128, 300, generator=g).to(BF16)
    mine_in = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    theirs_in = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    mine = SiluMulFunction.apply(*mine_in)
    theirs = F.silu(theirs_in[0]) * theirs_in[1]
    mine.backward(upstream)
    theirs.backward(upstream)
    assert_same_bf16(mine, theirs, max_fraction_off=1e-2)  # exp differs from torch's in the last bits
    for a, b in zip(mine_in, theirs_in):
        assert_same_bf16(a.grad, b.grad, max_fraction_off=1e-2)


# ----------------------------------------------------------------------------- rotary
def rotary_inputs(seed, batch=2, heads=3, length=5, dim=8, cos_batch=None, tied=True, dtype=BF16):
    """q [B, H, T, D] (a strided view, as transformers makes it) and cos, sin [B, T, D];
    ``tied``: both halves of the tables alike, as rotary tables are; else any values."""
    g = gen(seed)
    q = torch.randn(batch, length, heads, dim, generator=g).to(dtype).transpose(1, 2)
    angle = torch.randn(cos_batch or batch, length, dim // 2 if tied else dim, generator=g)
    if tied:
        angle = angle.repeat(1, 1, 2)
    return q, angle.cos().to(dtype), angle.sin().to(dtype)


@pytest.mark.parametrize(
    "shape",
    [
        dict(),
        dict(length=1),
        dict(cos_batch=1),
        dict(dim=16, heads=1),
        dict(tied=False),
        dict(tied=False, dtype=torch.float32),
    ],
)
def test_rotary_matches_its_float64_formula_and_gradient(shape, level):
    q, cos, sin = rotary_inputs(4, **shape)
    upstream = torch.randn(q.shape, generator=gen(5)).to(q.dtype)
    qk = q.detach().clone().requires_grad_()
    c, s = cos.expand(q.shape[0], *cos.shape[1:]), sin.expand(q.shape[0], *sin.shape[1:])
    out = RotaryFunction.apply(qk, c, s)
    (grad,) = torch.autograd.grad(out, qk, upstream)

    q64 = q.double().requires_grad_()
    half = q.shape[-1] // 2
    rotated = torch.cat((-q64[..., half:], q64[..., :half]), dim=-1)
    out64 = q64 * c.double().unsqueeze(1) + rotated * s.double().unsqueeze(1)
    (grad64,) = torch.autograd.grad(out64, q64, upstream.double())
    assert out.is_contiguous()
    assert_close_to_float64(out, out64.detach())
    assert_close_to_float64(grad, grad64)


def test_rotary_rounds_exactly_like_transformers(level):
    q, cos, sin = rotary_inputs(6, batch=3, heads=4, length=7, dim=16, tied=False)
    k = torch.randn(3, 7, 2, 16, generator=gen(7)).to(BF16).transpose(1, 2)
    upstream = torch.randn(q.shape, generator=gen(8)).to(BF16)
    mine_q, theirs_q = q.detach().clone().requires_grad_(), q.detach().clone().requires_grad_()
    mine = RotaryFunction.apply(mine_q, cos, sin)
    original = getattr(modeling_llama.apply_rotary_pos_emb, "__wrapped__", modeling_llama.apply_rotary_pos_emb)
    theirs, _ = original(theirs_q, k, cos, sin)
    mine.backward(upstream)
    theirs.backward(upstream)
    assert_same_bf16(mine, theirs)
    assert_same_bf16(mine_q.grad, theirs_q.grad)


def test_threads_split_the_work_without_changing_a_bit():
    """Above PARALLEL_MIN_ELEMENTS a call runs on torch.get_num_threads() threads, each on
    its own rows; every kernel is per row (or per element), so the split changes nothing."""
    from ppokit.lm.accel.kernels import functions

    g = gen(13)
    rows, d = 3 * functions.PARALLEL_MIN_ELEMENTS // 256 + 7, 256
    x = torch.randn(rows, d, generator=g).to(BF16).requires_grad_()
    w = torch.randn(d, generator=g).to(BF16)
    gate, up = torch.randn(rows, d, generator=g).to(BF16).requires_grad_(), torch.randn(rows, d, generator=g).to(BF16)
    q, cos, sin = rotary_inputs(14, batch=64, heads=4, length=16, dim=64)  # 262144 values
    q.requires_grad_()
    aq, ak, av, am = attention_inputs(15, B=8, H=4, Hkv=2, T=16, S=16, D=32)  # 16 KV groups of 32768 products
    calls = []

    def everything():
        outs = [
            RMSNormFunction.apply(x, w, 1e-6),
            SiluMulFunction.apply(gate, up),
            RotaryFunction.apply(q, cos, sin),
            AttentionFunction.apply(aq, ak, av, am, 0.25),
        ]
        grads = torch.autograd.grad([o.float().square().sum() for o in outs], [x, gate, q, aq, ak, av])
        return [o.detach() for o in outs] + list(grads)

    original = functions.in_parallel
    functions.in_parallel = lambda rows_, per_row, run: calls.append(rows_ * per_row) or original(rows_, per_row, run)
    try:
        torch.set_num_threads(1)
        one = everything()
        torch.set_num_threads(3)
        three = everything()
    finally:
        functions.in_parallel = original
    assert all(torch.equal(a, b) for a, b in zip(one, three))
    assert min(calls) >= functions.PARALLEL_MIN_ELEMENTS  # every call was big enough to split


def test_float32_kernels_agree_with_pytorch_float32_graphs(level):
    g = gen(15)
    x = torch.randn(50, 96, generator=g, requires_grad=True)
    w = 1 + 0.3 * torch.randn(96, generator=g)
    gate = (3 * torch.randn(50, 96, generator=g)).requires_grad_()
    up = torch.randn(50, 96, generator=g, requires_grad=True)
    q, cos, sin = rotary_inputs(16, batch=3, heads=2, length=7, dim=16, tied=False, dtype=torch.float32)
    q.requires_grad_()
    k = torch.randn(3, 7, 1, 16, generator=g).transpose(1, 2)
    original = getattr(modeling_llama.apply_rotary_pos_emb, "__wrapped__", modeling_llama.apply_rotary_pos_emb)
    pairs = [
        (RMSNormFunction.apply(x, w, 1e-6), transformers_rms_norm(x, w, 1e-6)),
        (SiluMulFunction.apply(gate, up), F.silu(gate) * up),
        (RotaryFunction.apply(q, cos, sin), original(q, k, cos, sin)[0]),
    ]
    for mine, theirs in pairs:
        upstream = torch.randn(mine.shape, generator=g)
        leaves = [t for t in (x, gate, up, q) if t.requires_grad]
        got = torch.autograd.grad(mine, leaves, upstream, allow_unused=True)
        want = torch.autograd.grad(theirs, leaves, upstream, allow_unused=True)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_splits_work_on_threads_of_its_own():
    from ppokit.lm.accel.kernels import functions

    x = torch.randn(4 * functions.PARALLEL_MIN_ELEMENTS // 128, 128).to(BF16)
    w = torch.ones(128, dtype=BF16)
    torch.set_num_threads(2)
    expected = RMSNormFunction.apply(x, w, 1e-6)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # the child (compared in numpy: torch's own threads are not ours to test)
        got = RMSNormFunction.apply(x, w, 1e-6)
        os._exit(0 if (got.view(torch.int16).numpy() == expected.view(torch.int16).numpy()).all() else 3)
    deadline = __import__("time").monotonic() + 60
    while __import__("time").monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, f"the child exited with {os.waitstatus_to_exitcode(status)}"
            return
        __import__("time").sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the forked child hung on the kernels' thread pool")


# ----------------------------------------------------------------------------- decoding attention
def naive_decode_attention(q, k, v, mask, scale):
    """float64: softmax(q k^T * scale + mask) v per head, kv head h // (H / Hkv); [B, 1, H, D]."""
    B, H, _, D = q.shape
    rep = H // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)  # [B, H, T, D]
    s = (q.double() @ k.transpose(2, 3)) * scale  # [B, H, 1, T]
    if mask is not None:
        s = s + mask.double()
    return (torch.softmax(s, -1) @ v).transpose(1, 2)  # [B, 1, H, D]


def decode_inputs(seed, B=3, H=4, Hkv=2, T=9, D=16, dtype=BF16, mask="min"):
    g = gen(seed)
    q = torch.randn(B, 1, H, D, generator=g).to(dtype).transpose(1, 2)  # [B, H, 1, D], strided
    k = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    m = None
    if mask is not None:
        m = torch.zeros(B, 1, 1, T, dtype=dtype if mask == "min" else torch.float32)
        m[0, ..., :3] = torch.finfo(m.dtype).min if mask == "min" else float("-inf")  # left padding
        if B > 1:
            m[1, ..., :1] = m[0, 0, 0, 0]
    return q, k, v, m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 4, 2, 9, 16), (2, 6, 6, 1, 64), (2, 8, 1, 40, 128), (1, 2, 2, 5, 24)])
@pytest.mark.parametrize("mask", ["min", "-inf", None])
def test_decode_attention_matches_its_float64_formula(dtype, shape, mask, level):
    B, H, Hkv, T, D = shape
    q, k, v, m = decode_inputs(20, B, H, Hkv, T, D, dtype, mask if T > 3 else None)
    got = decode_attention(q, k, v, m, D**-0.5)
    assert got.shape == (B, 1, H, D) and got.dtype == dtype and got.is_contiguous()
    assert_close_to_float64(got, naive_decode_attention(q, k, v, m, D**-0.5))
    if m is not None:  # one mask row for the whole batch
        got = decode_attention(q, k, v, m[:1], D**-0.5)
        assert_close_to_float64(got, naive_decode_attention(q, k, v, m[:1], D**-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", ["-inf", "min"])
def test_decode_attention_masks_keys_in_every_lane(dtype, masked, level):
    """Masked keys anywhere in a row (every position of a 16-key block, across blocks), not
    only a left padding: each row's own random mask."""
    B, H, T, D = 5, 2, 37, 64
    q, k, v, _ = decode_inputs(24, B, H, H, T, D, dtype, mask=None)
    m = torch.zeros(B, 1, 1, T, dtype=dtype if masked == "min" else torch.float32)
    hide = torch.rand(B, 1, 1, T, generator=gen(25)) < 0.4
    hide[..., 0] = False  # every row keeps a key
    hide[0, ..., 15] = hide[1, ..., 31] = hide[2, ..., 16] = True
    m[hide] = torch.finfo(m.dtype).min if masked == "min" else float("-inf")
    got = decode_attention(q, k, v, m, D**-0.5)
    assert_close_to_float64(got, naive_decode_attention(q, k, v, m, D**-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_rounds_like_transformers_eager_attention(dtype, level):
    from types import SimpleNamespace

    original = getattr(modeling_llama.eager_attention_forward, "__wrapped__", modeling_llama.eager_attention_forward)
    # 1/8 is a power of two (scaling a rounded score is exact); 128^-0.5 is not
    for seed, mask, scale in ((21, "min", 0.125), (22, None, 0.125), (23, "min", 128**-0.5)):
        q, k, v, m = decode_inputs(seed, B=4, H=8, Hkv=4, T=33, D=64, dtype=dtype, mask=mask)
        with torch.no_grad():
            theirs, _ = original(
                SimpleNamespace(num_key_value_groups=2, training=False), q, k, v, m, scaling=scale, dropout=0.0
            )
        mine = decode_attention(q, k, v, m, scale)
        if dtype == BF16:
            assert_same_up_to_rounding(mine, theirs, attention_rounding_bounds(q, k, v, m, scale)[0])
        else:
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_generation_through_the_decoding_kernel_equals_transformers(monkeypatch):
    from ppokit.lm.accel.kernels import fuse

    model = tiny_llama(3)
    ids = torch.randint(0, 50, (3, 6), generator=gen(23))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row
    with torch.no_grad():
        plain = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    fuse_cpu_kernels(model)
    calls = []
    kernel = fuse.decode_attention
    monkeypatch.setattr(fuse, "decode_attention", lambda *a: calls.append(a[0].shape) or kernel(*a))
    with torch.no_grad():
        fused = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    assert len(calls) == 2 * 5 and all(shape[2] == 1 for shape in calls)  # 2 layers x 5 decoding steps
    assert torch.equal(fused.sequences, plain.sequences)
    for a, b in zip(fused.scores, plain.scores):
        torch.testing.assert_close(a, b, rtol=0, atol=0.05)
    calls.clear()
    model(ids, attention_mask=mask)  # a whole sequence: the other kernel
    with torch.no_grad():
        model(ids[:, :1], attention_mask=mask[:, :1])  # no cache, one token: the kernel
    assert len(calls) == 2


# ----------------------------------------------------------------------------- attention (training, scoring)
def naive_attention(q, k, v, mask, scale):
    """float64: softmax(q k^T * scale + mask) v per head, kv head h // (H / Hkv); [B, T, H, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)  # [B, H, S, D]
    s = (q.double() @ k.transpose(2, 3)) * scale  # [B, H, T, S]
    if mask is not None:
        s = s + mask.double()
    return (torch.softmax(s, -1) @ v).transpose(1, 2)  # [B, T, H, D]


def attention_rounding_bounds(q, k, v, mask, scale, go=None):
    """How far a bf16 rounding that falls the other way can move each element of eager
    attention's output and gradients (float64): one bf16 step (at most 2^-7 of a value)
    on every term the element sums, plus one on the element itself. The terms are
    out_t = sum_j R(p_tj) v_j;  dq_t = scale sum_j ds_tj k_j;  dk_j = scale sum_t ds_tj q_t;
    dv_j = sum_t R(p_tj) go_t, with ds_tj = p_tj (dP_tj - sum_i p_ti dP_ti), dP = R(go v^T),
    so |ds_tj| is bounded by p_tj (|dP_tj| + sum_i p_ti |dP_ti|). Returns the bounds for
    out [B, T, H, D] and, given the upstream gradient go [B, T, H, D], for dq [B, H, T, D]
    and dk, dv [B, Hkv, S, D] (grouped heads summed)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = H // Hkv
    q64 = q.detach().double()
    k64, v64 = (t.detach().double().repeat_interleave(rep, 1) for t in (k, v))  # [B, H, S, D]
    s = (q64 @ k64.transpose(2, 3)) * scale
    p = torch.softmax(s + mask.double() if mask is not None else s, -1)  # [B, H, T, S]
    step = 2**-7
    bounds = [step * (p @ v64.abs()).transpose(1, 2)]  # out [B, T, H, D]
    if go is not None:
        go64 = go.double().transpose(1, 2)  # [B, H, T, D]
        dp = (go64 @ v64.transpose(2, 3)).abs()
        ds = p * (dp + (p * dp).sum(-1, keepdim=True))  # >= |ds|
        group = lambda x: x.view(B, Hkv, rep, S, D).sum(2)  # noqa: E731
        bounds += [
            step * scale * (ds @ k64.abs()),  # dq
            group(step * scale * (ds.transpose(2, 3) @ q64.abs())),  # dk
            group(step * (p.transpose(2, 3) @ go64.abs())),
        ]  # dv
    return bounds


def assert_same_up_to_rounding(mine, theirs, bound, max_fraction_off=0.01):
    """The kernel's bf16 attention results against eager attention's: bit for bit, except
    where a float32 value lands on the other side of a bf16 rounding boundary (the two
    softmaxes' exp functions differ in the last bits, and sums run in an order that
    depends on the CPU's vector code): at most ``max_fraction_off`` of the elements, each
    within ``bound`` (attention_rounding_bounds) plus one step of its own."""
    assert mine.dtype == theirs.dtype == BF16 and mine.shape == theirs.shape
    assert float((mine != theirs).float().mean()) <= max_fraction_off
    off = (mine.double() - theirs.double()).abs()
    assert bool((off <= bound + 2**-7 * theirs.double().abs()).all())


def attention_inputs(seed, B=3, H=4, Hkv=2, T=9, S=9, D=16, dtype=BF16, mask="min"):
    """q [B, H, T, D], k, v [B, Hkv, S, D] as strided views of projections, leaves with
    grad; a causal mask (the last T of S positions are the queries) with left padding
    in the first sequences: the dtype's minimum or -inf (float32), or None."""
    g = gen(seed)
    q = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, S, Hkv, D, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    v = torch.randn(B, S, Hkv, D, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    m = None
    if mask is not None:
        mdtype = dtype if mask == "min" else torch.float32
        low = torch.finfo(mdtype).min if mask == "min" else float("-inf")
        m = torch.zeros(B, 1, T, S, dtype=mdtype)
        m[:, :, torch.arange(T)[:, None] + (S - T) < torch.arange(S)[None, :]] = low  # causal
        m[0, ..., :3] = low  # left padding
        if B > 1:
            m[1, ..., :1] = low
        rows = torch.arange(T)
        m[:, 0, rows, rows + S - T] = 0  # each query sees itself: no row is all masked
    return q, k, v, m


def attention_and_grads(fn, q, k, v, upstream):
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), upstream)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [
        (3, 4, 2, 9, 9, 16),
        (2, 6, 6, 5, 5, 64),
        (2, 8, 1, 40, 40, 128),
        (1, 2, 2, 7, 19, 24),
        (2, 2, 1, 33, 33, 32),
        (2, 4, 4, 11, 11, 20),  # the demo's sequences; a head size that is no multiple of 8
        (1, 2, 1, 6, 6, 18),  # a head size that is no multiple of 4: the score loop's last rows
    ],
)
@pytest.mark.parametrize("mask", ["min", "-inf", None])
def test_attention_matches_its_float64_formula_and_gradients(dtype, shape, mask, level):
    B, H, Hkv, T, S, D = shape
    q, k, v, m = attention_inputs(30, B, H, Hkv, T, S, D, dtype, mask)
    upstream = torch.randn(B, T, H, D, generator=gen(31)).to(dtype)
    got = attention_and_grads(lambda *a: AttentionFunction.apply(*a, m, D**-0.5), q, k, v, upstream)
    assert got[0].shape == (B, T, H, D) and got[0].dtype == dtype and got[0].is_contiguous()
    assert [t.shape for t in got[1:]] == [q.shape, k.shape, v.shape]
    want = attention_and_grads(
        lambda *a: naive_attention(*a, m, D**-0.5),
        *(t.detach().double().requires_grad_() for t in (q, k, v)),
        upstream.double(),
    )
    for a, b in zip(got, want):
        assert_close_to_float64(a, b)
    if m is not None:  # one mask for the whole batch
        got = AttentionFunction.apply(q, k, v, m[:1], D**-0.5)
        assert_close_to_float64(got, naive_attention(q, k, v, m[:1], D**-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rounds_like_transformers_eager_attention(dtype, level):
    """Forward bit for bit (bf16) up to values that round the other way (see
    assert_same_up_to_rounding); gradients too without grouped heads. With two query
    heads per KV head autograd rounds each head's key and value gradient before their
    sum, the kernel sums in float32 and rounds once: one rounding of the largest value."""
    from types import SimpleNamespace

    original = getattr(modeling_llama.eager_attention_forward, "__wrapped__", modeling_llama.eager_attention_forward)
    # 1/8 is a power of two (scaling a rounded score is exact); 128^-0.5 is not
    for seed, (H, Hkv), mask, scale in (
        (32, (8, 8), "min", 0.125),
        (33, (8, 4), "min", 0.125),
        (34, (4, 4), None, 0.125),
        (38, (4, 4), "min", 128**-0.5),
    ):
        q, k, v, m = attention_inputs(seed, B=4, H=H, Hkv=Hkv, T=33, S=33, D=64, dtype=dtype, mask=mask)
        upstream = torch.randn(4, 33, H, 64, generator=gen(seed)).to(dtype)
        stand_in = SimpleNamespace(num_key_value_groups=H // Hkv, training=True)
        theirs = attention_and_grads(
            lambda *a: original(stand_in, *a, m, scaling=scale, dropout=0.0)[0], q, k, v, upstream
        )
        mine = attention_and_grads(lambda *a: AttentionFunction.apply(*a, m, scale), q, k, v, upstream)
        bounds = attention_rounding_bounds(q, k, v, m, scale, upstream)
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
            elif i < 2 or Hkv == H:  # output and dq; dk, dv without groups
                assert_same_up_to_rounding(a, b, bounds[i])
            else:
                assert (a.float() - b.float()).abs().max() <= 2**-7 * b.float().abs().max()


def test_attention_with_an_additive_bias_rounds_the_sum_like_eager_attention(level):
    """A bf16 mask of arbitrary values (a bias, not only 0 and the minimum): eager rounds
    scores + mask to bf16 before its float32 softmax, and so must the kernel."""
    from types import SimpleNamespace

    original = getattr(modeling_llama.eager_attention_forward, "__wrapped__", modeling_llama.eager_attention_forward)
    q, k, v, _ = attention_inputs(36, B=4, H=4, Hkv=4, T=33, S=33, D=64, mask=None)
    bias = (torch.randn(4, 1, 33, 33, generator=gen(37)) * 3).to(BF16)
    with torch.no_grad():
        theirs = original(
            SimpleNamespace(num_key_value_groups=1, training=False), q, k, v, bias, scaling=0.125, dropout=0.0
        )[0]
        mine = AttentionFunction.apply(q, k, v, bias, 0.125)
    assert_same_up_to_rounding(mine, theirs, attention_rounding_bounds(q, k, v, bias, 0.125)[0])


def test_attention_runs_on_the_tile_units_where_the_cpu_has_them():
    """On a CPU with AMX, bf16 attention of the training shapes takes the tile path (the
    tests above then check its numbers); other shapes, and CPUs without AMX, the vectors."""
    lib = cpu_library()
    amx = lora_amx_ready()
    assert bool(lib.attention_on_amx(49, 49, 64)) == amx and bool(lib.attention_on_amx(64, 64, 128)) == amx
    assert not any(lib.attention_on_amx(*shape) for shape in ((49, 49, 24), (65, 65, 64), (49, 49, 256)))


def test_attention_scratch_sizes_follow_the_c_constants():
    """The Python side sizes the kernels' scratch from KEY_BLOCK and checks MAX_HEAD_DIM,
    both defined in cpu_kernels.c: they must agree, or the kernels write past a buffer."""
    import re

    from ppokit.lm.accel.kernels import SOURCE, functions

    source = SOURCE.read_text()
    for name in ("KEY_BLOCK", "MAX_HEAD_DIM"):
        assert int(re.search(rf"#define {name} (\d+)", source).group(1)) == getattr(functions, name)


def test_attention_rows_that_mask_everything_give_what_eager_attention_gives(level):
    """A row masked to the dtype's minimum everywhere: eager's softmax is uniform there
    (nothing may be skipped); a row of -inf: NaN, as in eager attention."""
    from types import SimpleNamespace

    original = getattr(modeling_llama.eager_attention_forward, "__wrapped__", modeling_llama.eager_attention_forward)
    q, k, v, _ = attention_inputs(35, B=2, H=2, Hkv=2, T=4, S=4, D=8, mask=None)
    stand_in = SimpleNamespace(num_key_value_groups=1, training=True)
    m = torch.zeros(2, 1, 4, 4, dtype=BF16)
    m[0, 0, 1] = torch.finfo(BF16).min
    with torch.no_grad():
        theirs = original(stand_in, q, k, v, m, scaling=0.5, dropout=0.0)[0]
        mine = AttentionFunction.apply(q, k, v, m, 0.5)
    assert_same_bf16(mine, theirs)
    m = m.float()
    m[0, 0, 1] = float("-inf")
    with torch.no_grad():
        mine = AttentionFunction.apply(q, k, v, m, 0.5)
    assert torch.isnan(mine[0, 1]).all() and not torch.isnan(mine[0, [0, 2, 3]]).any()


def test_attention_dispatcher_takes_the_kernels_only_where_they_apply(monkeypatch):
    """Inside fused attention: training passes up to ATTENTION_MAX_KEYS keys take the
    kernel; longer ones, dropout, or a sliding window take eager attention."""
    from ppokit.lm.accel.kernels import fuse

    model = tiny_llama()
    fuse_cpu_kernels(model)
    calls = []
    kernel = fuse.AttentionFunction.apply
    monkeypatch.setattr(fuse.AttentionFunction, "apply", lambda *a: calls.append(a[0].shape[2]) or kernel(*a))
    model.train()
    ids = torch.randint(0, 50, (2, 7), generator=gen(36))
    model(ids).logits.float().sum().backward()
    assert calls == [7, 7]  # one per layer
    calls.clear()
    monkeypatch.setattr(fuse, "ATTENTION_MAX_KEYS", 6)
    model(ids)
    assert calls == []
    monkeypatch.setattr(fuse, "ATTENTION_MAX_KEYS", 64)
    q, k, v, m = attention_inputs(37, B=1, H=4, Hkv=2, T=5, S=5, D=16)
    stand_in = SimpleNamespace(num_key_value_groups=2, training=True)
    assert fuse._fast_attention(stand_in, q, k, v, m, 0.25, 0.1, {}) is None  # dropout
    assert fuse._fast_attention(stand_in, q, k, v, m, 0.25, 0.0, {"sliding_window": 4}) is None
    assert fuse._fast_attention(stand_in, q, k, v, m.float()[:, :, :2], 0.25, 0.0, {}) is None  # wrong shape
    assert fuse._fast_attention(stand_in, q, k, v, m, 0.25, 0.0, {}) is not None


# ----------------------------------------------------------------------------- fusing a model
def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).to(BF16).eval()


def forward_and_input_gradient(model, ids):
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=emb).logits.float()
    (grad,) = torch.autograd.grad(logits.logsumexp(-1).sum(), emb)
    return logits.detach(), grad


def test_fused_model_computes_what_transformers_computes(level):
    model = tiny_llama()
    ids = torch.randint(0, 50, (3, 11), generator=gen(9))
    plain_logits, plain_grad = forward_and_input_gradient(model, ids)
    counts = fuse_cpu_kernels(model)
    assert counts == {"rms_norm": 5, "mlp": 2, "rotary": 2, "attention": 2}  # 2 per layer + the final norm
    assert type(model.model.norm).__name__ == "FusedLlamaRMSNorm"
    fused_logits, fused_grad = forward_and_input_gradient(model, ids)
    # one bf16 rounding apart here and there, carried through two layers
    torch.testing.assert_close(fused_logits, plain_logits, rtol=0, atol=0.05)
    torch.testing.assert_close(
        fused_grad.float(), plain_grad.float(), rtol=0.05, atol=0.05 * plain_grad.float().abs().max().item()
    )
    assert fuse_cpu_kernels(model) == {"rms_norm": 0, "mlp": 0, "rotary": 0, "attention": 0}  # already fused
    assert unfuse_cpu_kernels(model) == 9
    assert torch.equal(forward_and_input_gradient(model, ids)[0], plain_logits)


def test_mixed_dtypes_and_trained_norm_weights_take_transformers_path(monkeypatch):
    from ppokit.lm.accel.kernels import fuse

    model = tiny_llama()
    fuse_cpu_kernels(model)
    norm = model.model.norm
    calls = []
    kernel = fuse.RMSNormFunction.apply
    monkeypatch.setattr(fuse.RMSNormFunction, "apply", lambda *a: calls.append(1) or kernel(*a))
    x = torch.randn(2, 3, 64, generator=gen(10)).to(BF16)
    w = 1 + 0.3 * torch.randn(64, generator=gen(11))

    norm.weight.data = w.clone()  # a float32 weight on a bf16 stream
    out = norm(x)
    assert out.dtype == torch.float32 and torch.equal(out, transformers_rms_norm(x, w, norm.variance_epsilon))
    norm.weight.data = w.to(BF16)
    norm.weight.requires_grad_(True)  # a trained weight gets its gradient
    norm(x).float().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0
    assert calls == []
    norm.weight.requires_grad_(False)
    norm(x)  # frozen and of the stream's dtype: the kernel
    assert calls == [1]


def test_rotary_dispatcher_calls_the_original_outside_fused_attention():
    model = tiny_llama()
    fuse_cpu_kernels(model)
    dispatcher = modeling_llama.apply_rotary_pos_emb
    original = dispatcher.__wrapped__
    q, cos, sin = rotary_inputs(11)
    k = q[:, :1].contiguous()
    calls = []
    modeling_llama.apply_rotary_pos_emb = lambda *a, **kw: calls.append(1) or dispatcher(*a, **kw)
    try:
        outside = dispatcher(q, k, cos, sin)
        model(torch.randint(0, 50, (1, 4), generator=gen(12)))  # inside: the kernel
    finally:
        modeling_llama.apply_rotary_pos_emb = dispatcher
    expected = original(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(outside, expected))
    assert len(calls) == 2  # one per layer went through the dispatcher


class OnePlusWeightNorm(nn.Module):
    """Gemma's norm: scales by (1 + w); the probe must keep its own forward."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GeluMLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f), nn.Linear(d, f), nn.Linear(f, d)
        self.act_fn = nn.GELU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_probe_leaves_other_formulas_alone():
    model = nn.Sequential(OnePlusWeightNorm(16), GeluMLP(16, 24)).to(BF16)
    assert fuse_cpu_kernels(model) == {"rms_norm": 0, "mlp": 0, "rotary": 0, "attention": 0}
    assert type(model[0]) is OnePlusWeightNorm and type(model[1]) is GeluMLP


# ----------------------------------------------------------------------------- the build
def run_python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **env,
    }
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, cwd=ROOT, timeout=300
    )


@pytest.mark.slow
def test_build_is_cached_across_processes_and_a_damaged_entry_is_built_again(tmp_path, monkeypatch):
    code = "from ppokit.lm.accel.kernels import cpu_library\nlib = cpu_library()\nprint('LIB', lib._name)"
    cache = tmp_path / "cache"
    first = run_python(code, PPOKIT_CACHE=str(cache))
    built = first.stdout.split("LIB ")[1].strip()
    assert built.startswith(str(cache)) and Path(built).is_file(), first.stderr
    mtime = Path(built).stat().st_mtime_ns
    second = run_python(code, PPOKIT_CACHE=str(cache))
    assert second.stdout.split("LIB ")[1].strip() == built and Path(built).stat().st_mtime_ns == mtime

    good = Path(built).read_bytes()
    Path(built).write_bytes(b"not a shared library")  # a damaged cache entry is built again
    monkeypatch.setenv("PPOKIT_CACHE", str(cache))
    compiled = []

    def compile_again(compiler, flags, out):  # the build made above, as the compiler writes it (its time spent once)
        compiled.append(out)
        out.write_bytes(good)

    monkeypatch.setattr(kernels, "_compile", compile_again)
    lib, error = kernels._build_and_load(kernels.find_compiler(), "native")
    assert error == "" and lib._name == built and compiled == [Path(built)] and Path(built).read_bytes() == good


def test_switched_off_or_failing_builds_leave_transformers_layers(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PPOKIT_CACHE", str(tmp_path / "off"))
    monkeypatch.setenv(LEVEL_ENV, "0")
    assert cpu_library() is None and not (tmp_path / "off").exists()
    monkeypatch.delenv(LEVEL_ENV)
    monkeypatch.setenv("PPOKIT_CACHE", str(tmp_path / "broken"))
    monkeypatch.setenv("CC", "false")
    library_at.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=kernels.__name__):
            assert cpu_library() is None
    finally:
        library_at.cache_clear()  # the next caller loads this session's build again
    assert "fused CPU kernels off: building cpu_kernels.c failed" in caplog.text


def test_processes_starting_together_build_the_library_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PPOKIT_CACHE", str(tmp_path))
    compiled = []

    def slow_compile(compiler, flags, out):
        compiled.append(out)
        time.sleep(0.5)  # the others arrive meanwhile
        out.write_bytes(b"built")

    monkeypatch.setattr(kernels, "_compile", slow_compile)
    with ThreadPoolExecutor(3) as pool:  # flock: each thread opens the lock file for itself, as processes do
        results = list(pool.map(lambda _: kernels.build("cc", ["-O3"]), range(3)))
    assert len(compiled) == 1 and results == [(compiled[0], "")] * 3 and compiled[0].read_bytes() == b"built"


def test_each_level_builds_its_own_vector_code(monkeypatch):
    monkeypatch.delenv(LEVEL_ENV, raising=False)
    assert requested_level() == "native"
    assert library_at("generic").kernels_vector_bits() == 0  # plain C: the compiler's own vectors
    avx2 = library_at("avx2")
    if cpu_supports_avx2():
        assert avx2.kernels_vector_bits() == 256  # AVX2 + FMA, even on a CPU with AVX-512
    else:
        assert avx2 is None  # its code would not run here
    monkeypatch.setenv(LEVEL_ENV, "generic")
    assert cpu_library() is library_at("generic")
    monkeypatch.setenv(LEVEL_ENV, "off")
    assert cpu_library() is None


def test_an_unknown_level_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(LEVEL_ENV, "avx3")
    with pytest.raises(UserError, match=r"^PPOKIT_CPU_KERNELS='avx3': expected one of native, avx2, generic"):
        cpu_library()


def test_the_accel_layer_fuses_a_cpu_policy_in_one_call(tiny_dir):
    from ppokit.config import build_config
    from ppokit.lm.accel import accelerate_policy
    from ppokit.lm.model.policy import build_policy

    def lm_config(tiny_dir, model=None):
        return build_config(
            [
                {
                    "workload": "lm",
                    "model": {"path": str(tiny_dir), **(model or {})},
                    "run": {"progress": False, "tensorboard": False},
                }
            ]
        )

    def fused_modules(policy):
        return sum(type(m).__module__ == "ppokit.lm.accel.kernels.fuse" for m in policy.lm.modules())

    cpu = torch.device("cpu")
    bf16 = build_policy(lm_config(tiny_dir), tiny_dir, device=cpu, autocast_dtype=BF16)
    assert fused_modules(bf16) == 0  # a built policy is plain transformers + peft
    acceleration = accelerate_policy(bf16)
    layers = 2  # the test model's
    kind = lora_kernels_kind()  # amx, avx512 or None
    lora = {f"lora_{kind}": 7 * layers} if kind else {}  # every linear layer's LoRA
    assert acceleration.counts == {
        "rms_norm": 2 * layers + 1,
        "mlp": layers,
        "rotary": layers,
        "attention": layers,
        **lora,
    }
    assert fused_modules(bf16) == 4 * layers + 1
    assert acceleration.kv_cache is not None  # the decoding kernel reads it in place
    assert acceleration.describe() == (
        " + fused CPU kernels (rms_norm 5, mlp 2, rotary 2, attention 2" + (f", lora_{kind} 14)" if kind else ")")
    )
    fp32 = build_policy(lm_config(tiny_dir), tiny_dir, device=cpu, autocast_dtype=None)
    fp32_counts = {name: n for name, n in acceleration.counts.items() if not name.startswith("lora_")}
    assert accelerate_policy(fp32).counts == fp32_counts  # the float32 kernels; LoRA's are bf16 only
