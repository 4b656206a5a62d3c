"""Token log-probabilities and entropies from hidden states, without the full logits.

A language model's logits are ``hidden @ weight.T`` (``lm_head``): for a micro-batch of
``N`` positions that is an (N, V) tensor, the largest of a PPO step (8192 tokens x 152k
vocabulary: 2.5 GB in bf16, 5 GB as float32, and as much again for its gradient).
:func:`log_probs_from_hidden` takes the hidden states and the output projection instead
and works on ``chunk_size`` positions at a time, forward and backward::

    z      = (h W^T + b) / temperature               logits of one chunk        (c, V)
    log p  = z - logsumexp(z)                         log-softmax
    lp_i   = log p_i[y_i]                             log-prob of the label y_i
    H_i    = -sum_v p_iv log p_iv                     entropy

    dlp_i / dz_iv = 1[v = y_i] - p_iv
    dH_i  / dz_iv = -p_iv (log p_iv + H_i)
    dz = g_lp (onehot - p) - g_H p (log p + H)         both upstream gradients at once
    dh = (dz / temperature) W,   dW = (dz / temperature)^T h,   db = sum_rows dz / temperature

Only (N,) values (logsumexp and entropy) are kept between forward and backward; the
backward recomputes each chunk's logits (one more matmul per chunk, the price of the
memory). At most a few (chunk_size, V) buffers exist at any time.

Precision: the matmuls run in the autocast dtype when autocast is on for the inputs'
device (bf16 weights and activations, as ``lm_head`` runs under autocast), else in the
inputs' common dtype; the softmax math is float32 (float64 when any input is float64).
The results are float32 (float64). The backward is not itself differentiable.
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "default_chunk_size", "log_probs_from_hidden"]

# logits per chunk: 2**26 float32 values are 256 MiB (441 positions of a 152k vocabulary;
# every position of a small model's micro-batch)
DEFAULT_CHUNK_ELEMENTS = 2**26


def default_chunk_size(vocab_size: int) -> int:
    """Positions per chunk so that one chunk's logits hold at most :data:`DEFAULT_CHUNK_ELEMENTS` values."""
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, vocab_size))


def _math_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 are upcast)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for ``hidden``'s device (and no float64 input), else
    the inputs' common dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and torch.float64 not in (hidden.dtype, weight.dtype):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_log_softmax(hc, w, b, inv_temp: float, math_dtype: torch.dtype) -> torch.Tensor:
    """``log_softmax((hc w^T + b) * inv_temp)`` of one chunk, (c, V) in ``math_dtype``;
    ``hc`` and ``w`` already in the matmul dtype, ``b`` in ``math_dtype``."""
    z = (hc @ w.T).to(math_dtype)  # (c, V): a copy, or the matmul output itself
    if b is not None:
        z += b
    if inv_temp != 1.0:
        z *= inv_temp
    return z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))


class _LogProbsFromHidden(torch.autograd.Function):
    """``(log_prob, entropy)`` per position from hidden states, chunked; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_temp, chunk_size, with_entropy, mm_dtype):
        h = hidden.reshape(-1, hidden.shape[-1])  # (N, D)
        y = labels.reshape(-1)  # (N,)
        math_dtype = _math_dtype(hidden, weight, bias)
        N = h.shape[0]
        log_prob = torch.empty(N, dtype=math_dtype, device=hidden.device)  # (N,)
        entropy = torch.empty(N if with_entropy else 0, dtype=math_dtype, device=hidden.device)  # (N,)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(mm_dtype)  # (V, D): no copy unless the dtype differs
            b = None if bias is None else bias.to(math_dtype)  # (V,)
            for i in range(0, N, chunk_size):
                logp = _chunk_log_softmax(h[i : i + chunk_size].to(mm_dtype), w, b, inv_temp, math_dtype)  # (c, V)
                log_prob[i : i + chunk_size] = logp.gather(1, y[i : i + chunk_size, None]).squeeze(1)
                if with_entropy:
                    p = logp.exp()  # (c, V)
                    entropy[i : i + chunk_size] = -p.mul_(logp).sum(-1)
                    del p
                del logp
        ctx.save_for_backward(hidden, weight, bias, labels, entropy)
        ctx.inv_temp, ctx.chunk_size, ctx.mm_dtype = inv_temp, chunk_size, mm_dtype
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        shape = hidden.shape[:-1]
        return log_prob.reshape(shape), entropy.reshape(shape) if with_entropy else entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_prob, grad_entropy):
        hidden, weight, bias, labels, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (grad_log_prob is None and grad_entropy is None) or not (need_h or need_w or need_b):
            return None, None, None, None, None, None, None, None
        inv_temp, cs, mm_dtype = ctx.inv_temp, ctx.chunk_size, ctx.mm_dtype
        math_dtype = _math_dtype(hidden, weight, bias)
        h = hidden.reshape(-1, hidden.shape[-1])  # (N, D)
        y = labels.reshape(-1)  # (N,)
        N = h.shape[0]
        g_lp = None if grad_log_prob is None else grad_log_prob.reshape(-1).to(math_dtype)  # (N,)
        g_h = None if grad_entropy is None or not entropy.numel() else grad_entropy.reshape(-1).to(math_dtype)
        grad_h = torch.empty(h.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None  # (N, D)
        grad_w = torch.zeros(weight.shape, dtype=math_dtype, device=weight.device) if need_w else None  # (V, D)
        grad_b = torch.zeros(weight.shape[0], dtype=math_dtype, device=weight.device) if need_b else None  # (V,)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(mm_dtype)  # (V, D)
            b = None if bias is None else bias.to(math_dtype)
            for i in range(0, N, cs):
                hc = h[i : i + cs].to(mm_dtype)  # (c, D)
                logp = _chunk_log_softmax(hc, w, b, inv_temp, math_dtype)  # (c, V)
                p = logp.exp()  # (c, V)
                # dz = -p * (g_lp + g_H (log p + H)) + g_lp onehot(y), built in logp's buffer
                if g_h is not None:
                    dz = logp.add_(entropy[i : i + cs, None]).mul_(g_h[i : i + cs, None])
                    if g_lp is not None:
                        dz.add_(g_lp[i : i + cs, None])
                    dz.mul_(p).neg_()
                else:
                    dz = p.mul_(-g_lp[i : i + cs, None])
                if g_lp is not None:
                    dz.scatter_add_(1, y[i : i + cs, None], g_lp[i : i + cs, None])
                if inv_temp != 1.0:
                    dz.mul_(inv_temp)  # through z = (h W^T + b) / temperature
                del p
                dz_mm = dz.to(mm_dtype)  # (c, V)
                if need_h:
                    grad_h[i : i + cs] = (dz_mm @ w).to(hidden.dtype)  # (c, D)
                if need_w:
                    if mm_dtype == math_dtype:
                        grad_w.addmm_(dz_mm.T, hc)  # (V, D)
                    else:
                        grad_w += dz_mm.T @ hc
                if need_b:
                    grad_b += dz.sum(0)
                del logp, dz, dz_mm
        return (
            None if grad_h is None else grad_h.reshape(hidden.shape),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(y)`` (and the entropy) at every position, from hidden states, chunked.

    ``logits = (hidden @ weight.T + bias) / temperature``; returns ``(log_prob, entropy)``
    with ``log_prob = log_softmax(logits)[label]`` and ``entropy = -sum_v p_v log p_v``
    (None unless ``entropy``). Equals :func:`~ppokit.algo.logits.log_probs_from_logits` and
    :func:`~ppokit.algo.logits.entropy_from_logits` on those logits, without materialising them.

    Args:
        hidden: (..., D), e.g. (n, T, D): the last hidden states; gradients flow to it.
        weight: (V, D), the output projection (``lm_head.weight``); gets a gradient if it
            requires one (full fine-tuning).
        labels: (...) integer token ids in [0, V) (replace padding by a valid id and mask
            the result).
        bias: (V,) or None.
        temperature: > 0, divides the logits (the sampling temperature).
        entropy: also compute the entropy.
        chunk_size: positions per chunk (None: :func:`default_chunk_size` of V).

    Returns:
        ``(log_prob, entropy)``, each (...) float32 (float64 if an input is float64).
    """
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"hidden must be (..., D) and weight (V, D), got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError("labels must be an integer tensor")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} != hidden shape without D {tuple(hidden.shape[:-1])}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)):
        raise ValueError(f"bias must be None or shape (V,) = ({weight.shape[0]},)")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 < temperature < float("inf"):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0])
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    log_prob, ent = _LogProbsFromHidden.apply(
        hidden,
        weight,
        bias,
        labels.long(),
        1.0 / float(temperature),
        chunk_size,
        bool(entropy),
        _matmul_dtype(hidden, weight),
    )
    return log_prob, (ent if entropy else None)
