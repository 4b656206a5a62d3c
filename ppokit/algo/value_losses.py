"""The (optionally clipped, optionally Huber) value-function loss."""

from __future__ import annotations

import torch

from .aggregation import AGG_MODES, aggregate
from .stats import explained_variance, masked_mean

__all__ = ["value_loss"]


def _half_sq_or_huber(x: torch.Tensor, delta: float | None) -> torch.Tensor:
    """``0.5 x^2``, or Huber: ``0.5 x^2 if |x| <= d else d (|x| - 0.5 d)``."""
    if delta is None:
        return 0.5 * x.square()
    ax = x.abs()
    return torch.where(ax <= delta, 0.5 * x.square(), delta * (ax - 0.5 * delta))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor | None,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_value: float | None = None,
    huber_delta: float | None = None,
    agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    horizon: int | None = None,
    diagnostics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Value loss, per position then aggregated::

        V_clip = V_old + clamp(V - V_old, -clip_value, clip_value)
        L      = max(f(V - R), f(V_clip - R))        with clip_value
        L      = f(V - R)                            without
        f(x)   = 0.5 x^2, or Huber_d(x) = 0.5 x^2 if |x| <= d else d (|x| - 0.5 d)

    and the loss is ``aggregate(L, mask, agg_mode, normalizer=..., horizon=...)``.
    ``old_values`` and ``returns`` are constants (pass them detached);
    ``old_values`` may be None when ``clip_value`` is None.

    Returns ``(loss, metrics)`` with detached 0-dim metrics: ``vf_clipfrac``
    (fraction of valid positions where the clipped term is strictly larger),
    ``explained_variance`` (of ``values`` as predictions of ``returns``),
    ``value_mean``, ``return_mean``; with ``diagnostics=False`` only ``vf_clipfrac``
    (a training loop's per-step log; the others cost more than the loss on small batches).
    """
    if values.dim() != 2:
        raise ValueError(f"values must be 2-D (B, T), got shape {tuple(values.shape)}")
    if returns.shape != values.shape:
        raise ValueError(f"returns shape {tuple(returns.shape)} != values shape {tuple(values.shape)}")
    if mask.shape != values.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != values shape {tuple(values.shape)}")
    if clip_value is not None:
        if not clip_value > 0:
            raise ValueError(f"clip_value must be > 0, got {clip_value}")
        if old_values is None:
            raise ValueError("clip_value needs old_values")
    if old_values is not None and old_values.shape != values.shape:
        raise ValueError(f"old_values shape {tuple(old_values.shape)} != values shape {tuple(values.shape)}")
    if huber_delta is not None and not huber_delta > 0:
        raise ValueError(f"huber_delta must be > 0, got {huber_delta}")
    AGG_MODES.get(agg_mode)

    m = mask if mask.dtype == torch.bool else mask != 0  # (B, T)
    # select padding away before any arithmetic so NaN/inf there cannot reach a gradient
    zero = values.new_zeros(())
    values = torch.where(m, values, zero)
    returns = torch.where(m, returns, zero)
    if old_values is not None:
        old_values = torch.where(m, old_values, zero)
    loss_unclipped = _half_sq_or_huber(values - returns, huber_delta)  # (B, T)
    if clip_value is not None:
        v_clip = old_values + (values - old_values).clamp(-clip_value, clip_value)  # (B, T)
        loss_clipped = _half_sq_or_huber(v_clip - returns, huber_delta)  # (B, T)
        loss_per = torch.maximum(loss_unclipped, loss_clipped)
    else:
        loss_clipped = None
        loss_per = loss_unclipped
    loss = aggregate(loss_per, m, agg_mode, normalizer=normalizer, horizon=horizon)

    with torch.no_grad():
        v = values.detach()
        if loss_clipped is None:
            clipfrac = v.new_zeros(())
        else:
            clipfrac = masked_mean((loss_clipped.detach() > loss_unclipped.detach()).to(v.dtype), m)
        if not diagnostics:
            return loss, {"vf_clipfrac": clipfrac}
        metrics = {
            "vf_clipfrac": clipfrac,
            "explained_variance": explained_variance(v, returns.detach(), m),
            "value_mean": masked_mean(v, m),
            "return_mean": masked_mean(returns.detach(), m),
        }
    return loss, metrics
