"""Log-probabilities and entropies from (B, T, V) logits, memory-frugally.

For a language model the logits are the largest tensor in a PPO step. Both
functions here work on chunks of flattened rows (``chunk_size`` rows of V at a
time) with custom autograd functions: the forward saves only the input logits (a
reference, not a copy) and per-row scalars, and the backward recomputes the
softmax chunk by chunk, writing straight into the one gradient tensor. So no
full-size temporary such as a ``log_softmax`` copy or a float32 upcast of the
whole tensor ever exists.

bf16/fp16 logits are upcast to float32 one chunk at a time and the results are
float32; float32/float64 logits are computed in their own dtype. The backward
functions are not themselves differentiable (no double backward).
"""

from __future__ import annotations

import torch

__all__ = ["entropy_from_logits", "log_probs_from_logits"]

DEFAULT_CHUNK_SIZE = 1024


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _check_chunk(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError("logits must be a tensor of shape (..., V)")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point, got {logits.dtype}")


class _ChunkedLogSumExp(torch.autograd.Function):
    """``lse_i = log sum_v exp(z_iv)``; ``d lse_i / d z_iv = softmax(z_i)_v``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_size: int) -> torch.Tensor:
        V = logits.shape[-1]
        z = logits.reshape(-1, V)  # (N, V)
        cdtype = _compute_dtype(logits.dtype)
        lse = torch.empty(z.shape[0], dtype=cdtype, device=logits.device)  # (N,)
        for i in range(0, z.shape[0], chunk_size):
            lse[i : i + chunk_size] = torch.logsumexp(z[i : i + chunk_size].to(cdtype), dim=-1)
        ctx.save_for_backward(logits, lse)
        ctx.chunk_size = chunk_size
        return lse.reshape(logits.shape[:-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse = ctx.saved_tensors
        V = logits.shape[-1]
        z = logits.reshape(-1, V)  # (N, V)
        g = grad_out.reshape(-1)  # (N,)
        grad = torch.empty(z.shape, dtype=logits.dtype, device=logits.device)  # (N, V)
        cs = ctx.chunk_size
        for i in range(0, z.shape[0], cs):
            zc = z[i : i + cs].to(lse.dtype)
            p = torch.exp(zc - lse[i : i + cs, None])  # (n, V) softmax
            grad[i : i + cs] = (p * g[i : i + cs, None].to(lse.dtype)).to(logits.dtype)
        return grad.reshape(logits.shape), None


class _ChunkedEntropy(torch.autograd.Function):
    """``H_i = lse_i - sum_v p_iv z_iv``; ``dH_i / dz_iv = -p_iv (log p_iv + H_i)``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_size: int) -> torch.Tensor:
        V = logits.shape[-1]
        z = logits.reshape(-1, V)  # (N, V)
        cdtype = _compute_dtype(logits.dtype)
        N = z.shape[0]
        lse = torch.empty(N, dtype=cdtype, device=logits.device)  # (N,)
        ent = torch.empty(N, dtype=cdtype, device=logits.device)  # (N,)
        zero = torch.zeros((), dtype=cdtype, device=logits.device)
        for i in range(0, N, chunk_size):
            zc = z[i : i + chunk_size].to(cdtype)  # (n, V)
            lse_c = torch.logsumexp(zc, dim=-1)  # (n,)
            p = torch.exp(zc - lse_c[:, None])  # (n, V)
            pz = torch.where(p > 0, p * zc, zero)  # 0 * (-inf) -> 0
            lse[i : i + chunk_size] = lse_c
            ent[i : i + chunk_size] = lse_c - pz.sum(-1)
        ctx.save_for_backward(logits, lse, ent)
        ctx.chunk_size = chunk_size
        return ent.reshape(logits.shape[:-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse, ent = ctx.saved_tensors
        V = logits.shape[-1]
        z = logits.reshape(-1, V)  # (N, V)
        g = grad_out.reshape(-1).to(lse.dtype)  # (N,)
        grad = torch.empty(z.shape, dtype=logits.dtype, device=logits.device)  # (N, V)
        zero = torch.zeros((), dtype=lse.dtype, device=logits.device)
        cs = ctx.chunk_size
        for i in range(0, z.shape[0], cs):
            logp = z[i : i + cs].to(lse.dtype) - lse[i : i + cs, None]  # (n, V)
            p = logp.exp()
            d = torch.where(p > 0, -p * (logp + ent[i : i + cs, None]), zero)  # dH/dz
            grad[i : i + cs] = (d * g[i : i + cs, None]).to(logits.dtype)
        return grad.reshape(logits.shape), None


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """``log p(y) = z_y - logsumexp(z)`` for the label ``y`` of every position.

    ``logits`` (..., V), e.g. (B, T, V); ``labels`` (...) integer indices in
    [0, V) (replace padding such as -100 by a valid index and mask it later).
    Returns (...) in the logits' dtype (float32 for bf16/fp16). No (..., V)
    ``log_softmax`` is materialised; the logsumexp runs over ``chunk_size`` rows
    at a time. Gradients flow to ``logits``.
    """
    _check_logits(logits)
    _check_chunk(chunk_size)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} != logits shape without vocab {tuple(logits.shape[:-1])}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    picked = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)  # (...)
    lse = _ChunkedLogSumExp.apply(logits, chunk_size)  # (...)
    return picked.to(lse.dtype) - lse


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Entropy of ``softmax(z)`` at every position, numerically stable.

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` over the last dim: (..., V) -> (...).
    Computed over ``chunk_size`` flattened rows at a time; bf16/fp16 input is
    upcast per chunk and the result is float32. Differentiable w.r.t. ``logits``
    (``dH/dz = -p (log p + H)``); ``-inf`` logits (banned tokens) contribute 0.
    """
    _check_logits(logits)
    _check_chunk(chunk_size)
    return _ChunkedEntropy.apply(logits, chunk_size)
