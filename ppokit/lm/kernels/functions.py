"""Autograd functions around the fused CPU kernels (see ``cpu_kernels.c`` for the math).

Each function takes bf16 CPU tensors whose last dimension is contiguous and returns
what transformers' bf16 graph of the same computation returns:

- :class:`RMSNormFunction`  ``y = w * bf16(x * rstd)``, ``rstd = 1 / sqrt(mean(x^2) + eps)``
  (a frozen weight: no weight gradient);
- :class:`SiluMulFunction`  ``out = bf16(silu(gate)) * up`` (SwiGLU's product);
- :class:`RotaryFunction`   ``out = q * cos + rotate_half(q) * sin``.

:func:`eligible` says whether tensors can take this path; callers fall back to
PyTorch's operations otherwise.
"""

from __future__ import annotations

import torch

from ppokit.lm.kernels import cpu_library


def eligible(*tensors: torch.Tensor) -> bool:
    """True when the kernels are built and every tensor is a bf16 CPU tensor with a
    contiguous last dimension (the kernels' layout)."""
    if cpu_library() is None:
        return False
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.bfloat16 or (t.dim() and t.stride(-1) != 1):
            return False
    return True


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm over the last dimension with a frozen weight. x [..., d] contiguous, weight [d]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        d = x.shape[-1]
        rows = x.numel() // d
        y = torch.empty_like(x, memory_format=torch.contiguous_format)           # [..., d]
        rstd = torch.empty(rows, dtype=torch.float32)                              # [rows]
        cpu_library().rms_norm_forward(_ptr(x), _ptr(weight), _ptr(y), _ptr(rstd), rows, d, float(eps))
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad_y = grad_y.to(torch.bfloat16).contiguous()
        grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
        d = x.shape[-1]
        cpu_library().rms_norm_backward(_ptr(grad_y), _ptr(x), _ptr(weight), _ptr(rstd), _ptr(grad_x),
                                        x.numel() // d, d)
        return grad_x, None, None


class SiluMulFunction(torch.autograd.Function):
    """``bf16(silu(gate)) * up`` for gate, up [..., F] contiguous, of one shape. Saves only
    gate and up (PyTorch's graph also keeps silu(gate))."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(gate, memory_format=torch.contiguous_format)
        cpu_library().silu_mul_forward(_ptr(gate), _ptr(up), _ptr(out), gate.numel())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_out = grad_out.to(torch.bfloat16).contiguous()
        grad_gate = torch.empty_like(gate, memory_format=torch.contiguous_format)
        grad_up = torch.empty_like(up, memory_format=torch.contiguous_format)
        cpu_library().silu_mul_backward(_ptr(grad_out), _ptr(gate), _ptr(up), _ptr(grad_gate), _ptr(grad_up),
                                        gate.numel())
        return grad_gate, grad_up


def _rotary(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    B, H, T, D = q.shape
    out = torch.empty(B, H, T, D, dtype=q.dtype)                                   # [B, H, T, D]
    cpu_library().rotary(_ptr(q), _ptr(cos), _ptr(sin), _ptr(out), B, H, T, D, q.stride(0), q.stride(1),
                         q.stride(2), cos.stride(0), cos.stride(1), int(backward))
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
        grad_out = grad_out.to(torch.bfloat16)
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        return _rotary(grad_out, cos, sin, backward=True), None, None
