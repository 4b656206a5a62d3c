"""Autograd functions around the fused CPU kernels (see ``cpu_kernels.c`` for the math).

Each function takes CPU tensors of one dtype, bf16 or float32, whose last dimension is
contiguous, and returns what PyTorch's graph of the same computation returns in that
dtype (``R`` rounds to it):

- :class:`RMSNormFunction`  ``y = w * R(x * rstd)``, ``rstd = 1 / sqrt(mean(x^2) + eps)``
  (a frozen weight: no weight gradient);
- :class:`SiluMulFunction`  ``out = R(silu(gate)) * up`` (SwiGLU's product);
- :class:`RotaryFunction`   ``out = q * cos + rotate_half(q) * sin``;
- :class:`AttentionFunction` eager attention, ``out = R(softmax(R(R(q k^T) * scale) + mask)) v``,
  forward and backward (:func:`decode_attention`: its decoding step, reading the KV cache).

:func:`eligible` says whether tensors can take this path; callers fall back to
PyTorch's operations otherwise.

Threads: a kernel call over at least ``PARALLEL_MIN_ELEMENTS`` values is split into
``torch.get_num_threads()`` row ranges, run by a pool of Python threads (ctypes
releases the GIL during the call), so the kernels use the cores PyTorch is told to use.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from ppokit.lm.accel.kernels import cpu_library

KEY_BLOCK = 32  # keys per block in the attention kernels (cpu_kernels.c)
MAX_HEAD_DIM = 256  # their largest head size
PARALLEL_MIN_ELEMENTS = 1 << 17  # below this a thread hand-off costs more than it saves
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_SIZE
    if _POOL is None or workers > _POOL_SIZE:
        _POOL, _POOL_SIZE = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ppokit-kernel"), workers
    return _POOL


def _forget_pool_after_fork() -> None:
    """A forked child has none of the pool's threads: it makes a pool of its own."""
    global _POOL, _POOL_SIZE
    _POOL, _POOL_SIZE = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def in_parallel(rows: int, elements_per_row: int, run: Callable[[int, int], None]) -> None:
    """``run(start, stop)`` over ``[0, rows)``: in one call, or split into one range per
    torch thread when the work is large enough (the calling thread takes the first)."""
    parts = min(torch.get_num_threads(), rows, rows * elements_per_row // PARALLEL_MIN_ELEMENTS)
    if parts <= 1:
        run(0, rows)
        return
    bounds = [rows * i // parts for i in range(parts + 1)]
    pool = _pool(parts - 1)
    futures = [pool.submit(run, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
    run(bounds[0], bounds[1])
    for f in futures:
        f.result()


SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}


def eligible(*tensors: torch.Tensor) -> bool:
    """True when the kernels are built and the tensors are CPU tensors of one dtype, bf16
    or float32, each with a contiguous last dimension (the kernels' layout)."""
    if cpu_library() is None or not tensors or tensors[0].dtype not in SUFFIXES:
        return False
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != tensors[0].dtype or (t.dim() and t.stride(-1) != 1):
            return False
    return True


def _kernel(name: str, dtype: torch.dtype):
    """The C function ``name`` for tensors of ``dtype``."""
    return getattr(cpu_library(), f"{name}_{SUFFIXES[dtype]}")


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm over the last dimension with a frozen weight. x [..., d] contiguous, weight [d]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        d = x.shape[-1]
        rows = x.numel() // d
        y = torch.empty_like(x, memory_format=torch.contiguous_format)  # [..., d]
        rstd = torch.empty(rows, dtype=torch.float32)  # [rows]
        kernel, size = _kernel("rms_norm_forward", x.dtype), x.element_size()
        xp, wp, yp, rp = _ptr(x), _ptr(weight), _ptr(y), _ptr(rstd)
        in_parallel(
            rows, d, lambda a, b: kernel(xp + size * a * d, wp, yp + size * a * d, rp + 4 * a, b - a, d, float(eps))
        )
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad_y = grad_y.to(x.dtype).contiguous()
        grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
        d = x.shape[-1]
        kernel, size = _kernel("rms_norm_backward", x.dtype), x.element_size()
        gp, xp, wp, rp, dp = _ptr(grad_y), _ptr(x), _ptr(weight), _ptr(rstd), _ptr(grad_x)
        in_parallel(
            x.numel() // d,
            d,
            lambda a, b: kernel(gp + size * a * d, xp + size * a * d, wp, rp + 4 * a, dp + size * a * d, b - a, d),
        )
        return grad_x, None, None


class SiluMulFunction(torch.autograd.Function):
    """``R(silu(gate)) * up`` for gate, up [..., F] contiguous, of one shape. Saves only
    gate and up (PyTorch's graph also keeps silu(gate))."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(gate, memory_format=torch.contiguous_format)
        kernel, size = _kernel("silu_mul_forward", gate.dtype), gate.element_size()
        gp, up_, op = _ptr(gate), _ptr(up), _ptr(out)
        in_parallel(gate.numel(), 1, lambda a, b: kernel(gp + size * a, up_ + size * a, op + size * a, b - a))
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_out = grad_out.to(gate.dtype).contiguous()
        grad_gate = torch.empty_like(gate, memory_format=torch.contiguous_format)
        grad_up = torch.empty_like(up, memory_format=torch.contiguous_format)
        kernel, size = _kernel("silu_mul_backward", gate.dtype), gate.element_size()
        go, gp, up_, dg, du = _ptr(grad_out), _ptr(gate), _ptr(up), _ptr(grad_gate), _ptr(grad_up)
        in_parallel(
            gate.numel(),
            1,
            lambda a, b: kernel(go + size * a, gp + size * a, up_ + size * a, dg + size * a, du + size * a, b - a),
        )
        return grad_gate, grad_up


def _rotary(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    B, H, T, D = q.shape
    out = torch.empty(B, H, T, D, dtype=q.dtype)  # [B, H, T, D]
    kernel, size = _kernel("rotary", q.dtype), q.element_size()
    qp, cp, sp, op = _ptr(q), _ptr(cos), _ptr(sin), _ptr(out)
    (sq_b, sq_h, sq_t), sc_b, sc_t = q.stride()[:3], cos.stride(0), cos.stride(1)
    in_parallel(
        B,
        H * T * D,
        lambda a, b: kernel(
            qp + size * a * sq_b,
            cp + size * a * sc_b,
            sp + size * a * sc_b,
            op + size * a * H * T * D,
            b - a,
            H,
            T,
            D,
            sq_b,
            sq_h,
            sq_t,
            sc_b,
            sc_t,
            int(backward),
        ),
    )
    return out


class RotaryFunction(torch.autograd.Function):
    """Rotary embedding of q [B, H, T, D] (any strides, last dimension contiguous) with
    cos, sin [B, T, D] (one set of strides, batch stride 0 allowed). Returns a contiguous
    [B, H, T, D]; cos and sin get no gradient."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotary(q, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        cos, sin = ctx.saved_tensors
        grad_out = grad_out.to(cos.dtype)
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        return _rotary(grad_out, cos, sin, backward=True), None, None


def _mask_rows(mask: torch.Tensor | None, query: torch.Tensor, T: int, S: int):
    """The additive mask as float32 [B or 1, T, S] rows, its batch stride, and whether the
    add rounds (a mask of the query's dtype, as eager attention adds it)."""
    if mask is None:
        return None, 0, 0
    m = mask[:, 0].float().expand(mask.shape[0], T, S).contiguous()  # [B or 1, T, S]
    round_mask = int(mask.dtype == query.dtype and query.dtype != torch.float32)
    return m, (T * S if m.shape[0] > 1 else 0), round_mask


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Eager attention for one new token per sequence, in one pass over the cache, no grad.

    query [B, H, 1, D], key and value [B, Hkv, T, D] (H a multiple of Hkv; any strides with
    a contiguous last dimension); mask None or additive [B or 1, 1, 1, T] (float32 or the
    query's dtype). Returns attn_output [B, 1, H, D] contiguous, as eager attention does.
    """
    B, H, _, D = query.shape
    Hkv, T = key.shape[1], key.shape[2]
    out = torch.empty(B, 1, H, D, dtype=query.dtype)  # [B, 1, H, D]
    m, sm_b, round_mask = _mask_rows(mask, query, 1, T)  # [B or 1, 1, T]
    mask_ptr = _ptr(m) if m is not None else None
    kernel = _kernel("decode_attention", query.dtype)
    qp, kp, vp, op = _ptr(query), _ptr(key), _ptr(value), _ptr(out)
    (sq_b, sq_h), (sk_b, sk_h, sk_t), (sv_b, sv_h, sv_t) = query.stride()[:2], key.stride()[:3], value.stride()[:3]

    def run(a: int, b: int) -> None:
        scratch = torch.empty(T + D, dtype=torch.float32)
        kernel(
            qp,
            kp,
            vp,
            mask_ptr,
            op,
            _ptr(scratch),
            a,
            b,
            H,
            Hkv,
            T,
            D,
            sq_b,
            sq_h,
            sk_b,
            sk_h,
            sk_t,
            sv_b,
            sv_h,
            sv_t,
            sm_b,
            scaling,
            round_mask,
        )

    in_parallel(B * H, 2 * T * D, run)
    return out


class AttentionFunction(torch.autograd.Function):
    """Eager attention (no dropout) over every query position, forward and backward.

    query [B, H, T, D], key and value [B, Hkv, S, D] (H a multiple of Hkv; any strides
    with a contiguous last dimension); mask None or additive [B or 1, 1, T, S] (float32
    or the query's dtype), no gradient. Returns attn_output [B, T, H, D] contiguous, as
    eager attention returns it after its transpose. One pass per query row where eager
    attention makes two batched matmuls, the scaling, the mask add, the softmax and the
    cast; it keeps the float32 softmax for the backward, as autograd keeps eager's.
    Gradients: dq [B, H, T, D] and dk [B, Hkv, S, D] contiguous, dv a [B, Hkv, S, D]
    view of a contiguous [B, S, Hkv, D] (the value projection's own layout). In bf16 on a
    CPU with AMX (up to 64 queries and keys, D a multiple of 32 up to 128) the products
    run on the tile units, the same formulas and roundings.
    """

    @staticmethod
    def forward(ctx, query, key, value, mask, scaling: float):
        B, H, T, D = query.shape
        Hkv, S = key.shape[1], key.shape[2]
        if D > MAX_HEAD_DIM:
            raise ValueError(f"AttentionFunction takes head sizes up to {MAX_HEAD_DIM}, not {D}")
        out = torch.empty(B, T, H, D, dtype=query.dtype)  # [B, T, H, D]
        probs = torch.empty(B, H, T, S, dtype=torch.float32)  # [B, H, T, S]
        m, sm_b, round_mask = _mask_rows(mask, query, T, S)
        kernel = _kernel("attention_forward", query.dtype)
        ptrs = [_ptr(t) for t in (query, key, value)] + [_ptr(m) if m is not None else None, _ptr(out), _ptr(probs)]
        strides = [*query.stride()[:3], *key.stride()[:3], *value.stride()[:3]]

        floats = max(D * (2 * S + KEY_BLOCK) + D + S, cpu_library().attention_amx_scratch_floats(H // Hkv, D))

        def run(a: int, b: int) -> None:
            scratch = torch.empty(floats, dtype=torch.float32)
            kernel(*ptrs, _ptr(scratch), a, b, H, Hkv, T, S, D, *strides, sm_b, scaling, round_mask)

        in_parallel(B * Hkv, 2 * (H // Hkv) * T * S * D, run)
        ctx.save_for_backward(query, key, value, probs)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, probs = ctx.saved_tensors
        B, H, T, D = query.shape
        Hkv, S = key.shape[1], key.shape[2]
        grad_out = grad_out.to(query.dtype)
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        dq = torch.empty(B, H, T, D, dtype=query.dtype)  # [B, H, T, D]
        dk = torch.empty(B, Hkv, S, D, dtype=query.dtype)  # [B, Hkv, S, D]
        dv = torch.empty(B, S, Hkv, D, dtype=query.dtype)  # [B, S, Hkv, D]
        kernel = _kernel("attention_backward", query.dtype)
        ptrs = [_ptr(t) for t in (query, key, value, probs, grad_out, dq, dk, dv)]
        strides = [
            *query.stride()[:3],
            *key.stride()[:3],
            *value.stride()[:3],
            grad_out.stride(0),
            grad_out.stride(1),
            grad_out.stride(2),
        ]

        floats = max(D * (4 * S + KEY_BLOCK) + 2 * S + 2 * D, cpu_library().attention_amx_scratch_floats(H // Hkv, D))

        def run(a: int, b: int) -> None:
            scratch = torch.empty(floats, dtype=torch.float32)
            kernel(*ptrs, _ptr(scratch), a, b, H, Hkv, T, S, D, *strides, ctx.scaling)

        in_parallel(B * Hkv, 4 * (H // Hkv) * T * S * D, run)
        return dq, dk, dv.transpose(1, 2), None, None


# ----------------------------------------------------------------------------- LoRA's kernels
LORA_MAX_RANK = 64  # the LoRA kernels' largest rank (AMX and vectors)


def lora_amx_ready() -> bool:
    """True when the kernels are built with AMX and Linux granted this process the tile state."""
    lib = cpu_library()
    return lib is not None and bool(lib.lora_amx_available())


def lora_kernels_kind() -> str | None:
    """Which kernels run LoRA's rank-r products here: ``"amx"`` (the tile units), ``"avx512"``
    (AVX512-BF16 vectors, on CPUs without tiles) or None (oneDNN's matmuls)."""
    if lora_amx_ready():  # asks Linux for the tile state first
        return "amx"
    lib = cpu_library()
    return "avx512" if lib is not None and lib.lora_vector_available() else None


def lora_kernels_eligible(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """Whether LoRA's rank-r products for input x [N, d_in], A [r, d_in] and B [d_out, r] can
    run on ppokit's kernels: bf16 CPU tensors, an even rank up to ``LORA_MAX_RANK``."""
    r = lora_a.shape[0]
    return (
        x.dtype == lora_a.dtype == lora_b.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and 0 < r <= LORA_MAX_RANK
        and r % 2 == 0
        and lora_kernels_kind() is not None
    )


def _lora_library():
    """The kernels, once Linux has granted this process the AMX tile state where they run on
    AMX (a tile instruction before that is an illegal instruction); RuntimeError where
    neither AMX nor AVX512-BF16 runs them."""
    if lora_kernels_kind() is None:
        raise RuntimeError(
            "the LoRA kernels need a CPU with AMX or AVX512-BF16 and the fused CPU kernels "
            "built (check lora_kernels_kind() first)"
        )
    return cpu_library()


def _check_rank(r: int, even: bool = False) -> None:
    """The kernels' ranks: 1 to LORA_MAX_RANK (up_add: even); beyond that they would read
    and write past their buffers, so they refuse."""
    if not 0 < r <= LORA_MAX_RANK or (even and r % 2):
        raise ValueError(
            f"LoRA kernels: rank {r} is not {'an even number' if even else 'a number'} from "
            f"{2 if even else 1} to {LORA_MAX_RANK} (use oneDNN's matmuls for it)"
        )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [N, d] with a contiguous last dimension (a copy only when it has none)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def lora_down(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """h = R(x m^T): x [N, d] bf16, m [r, d] -> h [N, r] bf16 (one float32 sum per element)."""
    x, m = _rows(x), m.contiguous()
    N, d = x.shape
    r = m.shape[0]
    _check_rank(r)
    h = torch.empty(N, r, dtype=torch.bfloat16)
    kernel, chunks = _lora_library().lora_down_bf16, (d + 31) // 32
    scratch_bytes = max(
        2 * ((r + 15) // 16 * chunks * 512 + 32 * chunks * 32) + 4 * 512,  # AMX
        2 * ((r + 7) // 8 * 8) * (32 * chunks),
    )  # vectors

    def run(a: int, b: int) -> None:
        scratch = torch.empty(scratch_bytes, dtype=torch.uint8)
        kernel(_ptr(x), x.stride(0), _ptr(m), _ptr(h), a, b, d, r, _ptr(scratch))

    in_parallel(N, d, run)
    return h


def lora_up_add_(y: torch.Tensor, h: torch.Tensor, m: torch.Tensor, scale: float) -> torch.Tensor:
    """y = R(y + scale h m) in place: y [N, d] bf16 (contiguous last dimension), h [N, r], m [r, d]."""
    assert y.stride(-1) == 1
    h, m = h.contiguous(), m.contiguous()
    N, d = y.shape
    r = m.shape[0]
    _check_rank(r, even=True)
    kernel, chunks = _lora_library().lora_up_add_bf16, (d + 63) // 64
    scratch_bytes = max(2 * (chunks * 64 * r + 1024) + 4 * 1024, 2 * r * ((d + 15) // 16 * 16))  # AMX, vectors

    def run(a: int, b: int) -> None:
        scratch = torch.empty(scratch_bytes, dtype=torch.uint8)
        kernel(_ptr(y), y.stride(0), _ptr(h), _ptr(m), a, b, d, r, scale, _ptr(scratch))

    in_parallel(N, d, run)
    return y


def lora_outer(p: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """R(scale p^T x): p [N, r] bf16, x [N, d] bf16 -> [r, d] bf16 (a LoRA weight gradient)."""
    p, x = p.contiguous(), _rows(x)
    N, d = x.shape
    r = p.shape[1]
    _check_rank(r)
    out = torch.empty(r, d, dtype=torch.bfloat16)
    kernel, chunks = _lora_library().lora_outer_bf16, (d + 63) // 64
    scratch_bytes = 2 * ((r + 15) // 16 * 16 * ((N + 31) // 32 * 32) + 2048) + 4 * 1024

    def run(a: int, b: int) -> None:
        scratch = torch.empty(scratch_bytes, dtype=torch.uint8)
        kernel(_ptr(p), _ptr(x), x.stride(0), _ptr(out), N, d, r, 64 * a, min(64 * b, d), scale, _ptr(scratch))

    in_parallel(chunks, 64 * N, run)
    return out
