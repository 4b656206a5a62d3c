"""Masked reductions and normalisation.

A ``mask`` is a bool tensor or a 0/1 float tensor broadcastable to ``x``; it is
read as a boolean (non-zero = valid). ``mask=None`` means every element is valid.
Masked-out elements are *selected away* (``torch.where``), not multiplied by 0, so
NaN/inf in padding never leaks into a result or a gradient.

Nothing here synchronises with the device except :func:`whiten`, which must check
its element count to raise a clear error.
"""

from __future__ import annotations

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "whiten", "explained_variance"]

Dim = int | tuple[int, ...] | None


def _as_bool_mask(mask: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """Return ``mask`` as a bool tensor expanded to ``x.shape`` (or None)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    m = mask if mask.dtype == torch.bool else mask != 0
    try:
        return m.expand_as(x)
    except RuntimeError:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} is not broadcastable to x of shape {tuple(x.shape)}"
        ) from None


def _count(m: torch.Tensor | None, x: torch.Tensor, dim: Dim = None) -> torch.Tensor:
    """Number of valid elements (in x's dtype), reduced over ``dim``."""
    if m is None:
        if dim is None:
            return torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device)
        dims = (dim,) if isinstance(dim, int) else dim
        n = 1
        for d in dims:
            n *= x.shape[d]
        return torch.full(_reduced_shape(x, dims), float(n), dtype=x.dtype, device=x.device)
    return m.sum() if dim is None else m.sum(dim)


def _reduced_shape(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[int, ...]:
    drop = {d % x.dim() for d in dims}
    return tuple(s for i, s in enumerate(x.shape) if i not in drop)


def masked_sum(x: torch.Tensor, mask: torch.Tensor | None, dim: Dim = None) -> torch.Tensor:
    """Sum of the valid elements: ``sum_i x_i * m_i`` (over all elements or ``dim``).

    Masked-out elements are excluded even if they hold NaN/inf.
    """
    m = _as_bool_mask(mask, x)
    xm = x if m is None else torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return xm.sum() if dim is None else xm.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None = None, dim: Dim = None) -> torch.Tensor:
    """Mean of the valid elements: ``sum_i x_i m_i / max(sum_i m_i, 1)``.

    A selection with no valid element has mean 0 (not NaN), so a fully padded
    micro-batch does not poison a loss or a logged metric.
    """
    m = _as_bool_mask(mask, x)
    total = masked_sum(x, m, dim)
    count = _count(m, x, dim).to(total.dtype)
    return total / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor | None = None, unbiased: bool = True) -> torch.Tensor:
    """Variance of all valid elements (0-dim).

    ``mu = sum_i x_i m_i / N``, ``Var = sum_i (x_i - mu)^2 m_i / (N - 1)`` with
    Bessel's correction (``unbiased=True``) or ``/ N`` otherwise, where
    ``N = sum_i m_i``. Returns NaN when ``N <= 1`` (unbiased) or ``N == 0``
    (biased), computed on device without a host sync.
    """
    m = _as_bool_mask(mask, x)
    n = _count(m, x).to(x.dtype)
    mean = masked_sum(x, m) / n.clamp(min=1)
    sq = masked_sum((x - mean) ** 2, m)
    ddof = 1 if unbiased else 0
    var = sq / (n - ddof).clamp(min=1)
    return torch.where(n > ddof, var, torch.full_like(var, float("nan")))


def whiten(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Normalise the valid elements to zero mean and unit variance.

    ``y = (x - mu) / sqrt(Var + eps)`` with the masked mean ``mu`` and the
    Bessel-corrected masked variance ``Var`` (see :func:`masked_var`). With
    ``shift_mean=False`` the mean is added back: ``y = (x - mu) / sqrt(Var + eps) + mu``.
    The output is 0 outside the mask.

    Raises ValueError when fewer than 2 elements are valid (the variance is
    undefined). That check reads one number from the device.
    """
    m = _as_bool_mask(mask, x)
    n = int(_count(m, x).item())
    if n < 2:
        raise ValueError(f"whiten needs at least 2 valid elements, got {n}")
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    y = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        y = y + mean
    if m is not None:
        y = torch.where(m, y, torch.zeros((), dtype=y.dtype, device=y.device))
    return y


def explained_variance(y_pred: torch.Tensor, y_true: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Fraction of the variance of ``y_true`` explained by ``y_pred`` (0-dim).

    ``EV = 1 - Var[y - y_pred] / Var[y]`` over the valid elements. 1 is a
    perfect prediction, 0 is as good as predicting the mean, negative is worse.
    Returns NaN when ``Var[y] == 0`` (or fewer than 2 valid elements).
    """
    if y_pred.shape != y_true.shape:
        raise ValueError(f"y_pred shape {tuple(y_pred.shape)} != y_true shape {tuple(y_true.shape)}")
    var_y = masked_var(y_true, mask)
    var_res = masked_var(y_true - y_pred, mask)
    ev = 1 - var_res / torch.where(var_y == 0, torch.ones_like(var_y), var_y)
    return torch.where(var_y == 0, torch.full_like(ev, float("nan")), ev)
