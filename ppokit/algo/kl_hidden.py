"""Exact KL over the vocabulary from hidden states, without the full logits.

For a language model, ``KL(pi || pi_ref)`` over the whole vocabulary needs both
models' logits, (B, T, V) each: in float32 that is the largest pair of tensors in a
PPO step (e.g. 8192 tokens x 152k vocabulary = 5 GB each). :func:`kl_full_from_hidden`
takes the last hidden states and the output projection instead and works on
``chunk_size`` flattened rows at a time, forward and backward::

    z   = (h  W^T  + b)  / temperature        policy logits     (rows, V)
    z'  = (h' W'^T + b') / temperature        reference logits  (rows, V)
    KL  = sum_v p_v (log p_v - log q_v),      p = softmax(z), q = softmax(z')

    dKL / dz_v = p_v ((log p_v - log q_v) - KL)
    dh = (dz / temperature) W,   dW = (dz / temperature)^T h,   db = sum_rows dz / temperature

Only (N,) per-row values are saved between forward and backward; the backward
recomputes each chunk's logits (two more matmuls per chunk, the price of the memory).
The reference is a constant: no gradient reaches ``ref_hidden``, ``ref_weight`` or
``ref_bias`` (with ``ref_weight=None`` the reference shares ``weight``, as the
LoRA reference shares the frozen ``lm_head``; a trainable ``weight`` still gets the
gradient of the policy side only).

Memory: besides the (...) output and (N,) saved KL, at most a few ``(chunk_size, V)``
buffers in the compute dtype exist at any time (two log-prob chunks, plus the temporaries
of ``logsumexp`` and one bool mask), in forward and backward. A bf16/fp16 ``weight`` is
upcast once per pass, a (V, D) float32 copy; a trainable ``weight`` also gets a (V, D)
float32 gradient accumulator.
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["kl_full_from_hidden"]

DEFAULT_KL_CHUNK_SIZE = 1024


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 are upcast)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _chunk_log_probs(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, inv_temp: float) -> torch.Tensor:
    """``log_softmax((h w^T + b) * inv_temp)`` for one chunk of rows, in ``w``'s dtype; (c, V)."""
    z = h.to(w.dtype) @ w.T  # (c, V)
    if b is not None:
        z += b
    if inv_temp != 1.0:
        z *= inv_temp
    z -= torch.logsumexp(z, dim=-1, keepdim=True)
    return z


def _chunk_terms(logp: torch.Tensor, logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``logq <- log p - log q`` (0 where p = 0), ``logp <- p``; returns ``(p, diff)``."""
    diff = torch.sub(logp, logq, out=logq)  # (c, V)
    p = logp.exp_()  # (c, V)
    # p = 0 (a banned token) contributes nothing, even where log q = -inf too
    return p, diff.masked_fill_(p == 0, 0.0)


class _KLFromHidden(torch.autograd.Function):
    """Per-row ``KL(softmax(z) || softmax(z'))`` from hidden states, chunked; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, ref_hidden, weight, ref_weight, bias, ref_bias, inv_temp, chunk_size):
        D, D_ref = hidden.shape[-1], ref_hidden.shape[-1]
        h = hidden.reshape(-1, D)  # (N, D)
        rh = ref_hidden.reshape(-1, D_ref)  # (N, D_ref)
        cdtype = _compute_dtype(hidden, ref_hidden, weight, ref_weight, bias, ref_bias)
        w = weight.to(cdtype)  # (V, D): no copy unless low precision
        rw = w if ref_weight is None else ref_weight.to(cdtype)  # (V, D_ref); None: shared
        b = None if bias is None else bias.to(cdtype)  # (V,)
        rb = None if ref_bias is None else ref_bias.to(cdtype)  # (V,)
        N = h.shape[0]
        kl = torch.empty(N, dtype=cdtype, device=hidden.device)  # (N,)
        for i in range(0, N, chunk_size):
            logp = _chunk_log_probs(h[i : i + chunk_size], w, b, inv_temp)  # (c, V)
            logq = _chunk_log_probs(rh[i : i + chunk_size], rw, rb, inv_temp)  # (c, V)
            p, diff = _chunk_terms(logp, logq)
            kl[i : i + chunk_size] = diff.mul_(p).sum(-1)
            del logp, logq, p, diff
        ctx.save_for_backward(hidden, ref_hidden, weight, ref_weight, bias, ref_bias, kl)
        ctx.inv_temp = inv_temp
        ctx.chunk_size = chunk_size
        return kl.reshape(hidden.shape[:-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        hidden, ref_hidden, weight, ref_weight, bias, ref_bias, kl = ctx.saved_tensors
        need_h, _, need_w, _, need_b = ctx.needs_input_grad[:5]
        inv_temp, cs = ctx.inv_temp, ctx.chunk_size
        D, D_ref = hidden.shape[-1], ref_hidden.shape[-1]
        h = hidden.reshape(-1, D)  # (N, D)
        rh = ref_hidden.reshape(-1, D_ref)  # (N, D_ref)
        cdtype = kl.dtype
        w = weight.to(cdtype)  # (V, D)
        rw = w if ref_weight is None else ref_weight.to(cdtype)  # (V, D_ref)
        b = None if bias is None else bias.to(cdtype)
        rb = None if ref_bias is None else ref_bias.to(cdtype)
        g = grad_out.reshape(-1).to(cdtype)  # (N,)
        grad_h = torch.empty(h.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None  # (N, D)
        grad_w = torch.zeros(w.shape, dtype=cdtype, device=w.device) if need_w else None  # (V, D)
        grad_b = torch.zeros(w.shape[0], dtype=cdtype, device=w.device) if need_b else None  # (V,)
        for i in range(0, h.shape[0], cs):
            hc = h[i : i + cs].to(cdtype)  # (c, D)
            logp = _chunk_log_probs(hc, w, b, inv_temp)  # (c, V)
            logq = _chunk_log_probs(rh[i : i + cs], rw, rb, inv_temp)  # (c, V)
            p, dz = _chunk_terms(logp, logq)
            # dL/dz' = g p (log p - log q - KL), times 1/temperature for the pre-scale logits
            dz.sub_(kl[i : i + cs, None]).mul_(p).mul_((g[i : i + cs] * inv_temp)[:, None])  # (c, V)
            del logp, logq, p
            if need_h:
                grad_h[i : i + cs] = (dz @ w).to(hidden.dtype)  # (c, D)
            if need_w:
                grad_w.addmm_(dz.T, hc)  # (V, D)
            if need_b:
                grad_b += dz.sum(0)
            del dz
        return (
            None if grad_h is None else grad_h.reshape(hidden.shape),
            None,
            None if grad_w is None else grad_w.to(weight.dtype),
            None,
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
        )


def _check_kl_inputs(hidden, ref_hidden, weight, ref_weight, bias, ref_bias, temperature, chunk_size) -> None:
    """The types and shapes :func:`kl_full_from_hidden` takes; a ValueError naming the first one wrong."""
    for name, t in (("hidden", hidden), ("ref_hidden", ref_hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor")
    if hidden.dim() < 1 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be (..., D) and weight (V, D), got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {hidden.shape[-1]}")
    if ref_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"ref_hidden shape {tuple(ref_hidden.shape)} != hidden shape {tuple(hidden.shape)} before the hidden size"
        )
    rw = weight if ref_weight is None else ref_weight
    if not isinstance(rw, torch.Tensor) or rw.dim() != 2 or rw.shape != (weight.shape[0], ref_hidden.shape[-1]):
        raise ValueError(
            f"ref_weight must be (V, D_ref) = ({weight.shape[0]}, {ref_hidden.shape[-1]}), "
            f"got {tuple(rw.shape) if isinstance(rw, torch.Tensor) else rw!r}"
        )
    for name, b in (("bias", bias), ("ref_bias", ref_bias)):
        if b is not None and (not isinstance(b, torch.Tensor) or b.shape != (weight.shape[0],)):
            raise ValueError(f"{name} must be None or shape (V,) = ({weight.shape[0]},)")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 < temperature < float("inf"):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def kl_full_from_hidden(
    hidden: torch.Tensor,
    ref_hidden: torch.Tensor,
    weight: torch.Tensor,
    ref_weight: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_KL_CHUNK_SIZE,
) -> torch.Tensor:
    """Exact ``KL(pi || pi_ref)`` over the vocabulary at every position, from hidden states.

    ``logits = (hidden @ weight.T + bias) / temperature`` for the policy and
    ``(ref_hidden @ ref_weight.T + ref_bias) / temperature`` for the reference;
    ``KL_t = sum_v p_v (log p_v - log q_v)``. Equals
    :func:`~ppokit.algo.kl.kl_full` on those logits, without materialising them.

    Args:
        hidden: (..., D), e.g. (n, T, D), the policy's last hidden states; gradients
            flow to it.
        ref_hidden: (..., D_ref) with the same leading shape, the reference's (a
            constant, no gradient).
        weight: (V, D) the policy's output projection (``lm_head.weight``); receives a
            gradient if it requires one.
        ref_weight: (V, D_ref); None: the reference shares the output layer,
            ``weight`` and ``bias``.
        bias: (V,) or None; receives a gradient if it requires one.
        ref_bias: (V,) or None; None with ``ref_weight=None`` means ``bias`` (the
            shared layer), with a ``ref_weight`` it means no bias.
        temperature: > 0, divides both models' logits (the sampling temperature).
        chunk_size: rows of the flattened (N = prod(...)) positions per chunk.

    Returns:
        (...) KL per position, float32 (float64 if any input is float64): bf16/fp16
        inputs are computed in float32. Memory: a few ``(chunk_size, V)`` buffers at a time
        (the module docstring).
    """
    _check_kl_inputs(hidden, ref_hidden, weight, ref_weight, bias, ref_bias, temperature, chunk_size)
    # the reference is a constant, even when it shares a trainable weight (None: use
    # weight's values inside, where nothing is recorded for autograd)
    shared = ref_weight is None or ref_weight is weight
    if ref_weight is None and ref_bias is None:
        ref_bias = bias
    return _KLFromHidden.apply(
        hidden,
        ref_hidden.detach(),
        weight,
        None if shared else ref_weight.detach(),
        bias,
        None if ref_bias is None else ref_bias.detach(),
        1.0 / float(temperature),
        chunk_size,
    )
