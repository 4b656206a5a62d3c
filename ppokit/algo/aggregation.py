"""Reducing a per-token loss matrix ``L`` (B, T) with a mask ``m`` (B, T) to a scalar.

Modes (``N`` = ``normalizer``, ``H`` = ``horizon``)::

    token-mean               sum_{b,t} L m / N                      N default: sum m (token count)
    seq-mean-token-sum       sum_b (sum_t L m) / N                  N default: B
    seq-mean-token-mean      sum_b (sum_t L m / max(sum_t m, 1)) / N  N default: B
    seq-mean-token-sum-norm  sum_{b,t} L m / (N * H)                N default: B, H default: T

``seq-mean-token-sum-norm`` is the Dr. GRPO aggregation: ``H`` should be a
constant (e.g. the maximum response length) so micro-batches padded to different
lengths still agree.

Micro-batching: every mode is a sum over rows divided by a constant. Compute
``N = aggregation_normalizer(mask_of_whole_minibatch, mode)`` once, pass it (and a
fixed ``horizon``) for each micro-batch (a split of the rows); the sum of the
micro-batch losses then equals the loss of the whole mini-batch exactly, and so
do the gradients. With the defaults, each micro-batch is normalised on its own
(a mean of means, not the mini-batch loss).

Rows whose mask is all zero contribute 0 (never NaN). The sequence modes count
every row in ``B``, padded-out rows included; to count only sequences with at
least one valid token, pass ``normalizer=(mask.sum(-1) > 0).sum()``.
"""

from __future__ import annotations

import numbers

import torch

from .registry import Registry
from .stats import masked_sum

__all__ = ["AGG_MODES", "aggregate", "aggregation_normalizer"]

AGG_MODES: Registry = Registry("aggregation mode")

Normalizer = torch.Tensor | float | int | None


def _bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


@AGG_MODES.register("token-mean")
def _token_mean(loss_mat: torch.Tensor, m: torch.Tensor, normalizer: Normalizer, horizon: int | None) -> torch.Tensor:
    """``sum_{b,t} L m / N``, N defaults to the token count (at least 1)."""
    total = masked_sum(loss_mat, m)  # ()
    if normalizer is None:
        normalizer = m.sum().clamp(min=1)  # int64: exact for any token count
    return total / normalizer


@AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(
    loss_mat: torch.Tensor, m: torch.Tensor, normalizer: Normalizer, horizon: int | None
) -> torch.Tensor:
    """``sum_b (sum_t L m) / N``, N defaults to B."""
    total = masked_sum(loss_mat, m)  # () == sum_b sum_t L m
    if normalizer is None:
        normalizer = max(loss_mat.shape[0], 1)
    return total / normalizer


@AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(
    loss_mat: torch.Tensor, m: torch.Tensor, normalizer: Normalizer, horizon: int | None
) -> torch.Tensor:
    """``sum_b (sum_t L m / max(sum_t m, 1)) / N``, N defaults to B."""
    row_sum = masked_sum(loss_mat, m, dim=-1)  # (B,)
    row_len = m.sum(-1).to(row_sum.dtype).clamp(min=1)  # (B,)
    if normalizer is None:
        normalizer = max(loss_mat.shape[0], 1)
    return (row_sum / row_len).sum() / normalizer


@AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    loss_mat: torch.Tensor, m: torch.Tensor, normalizer: Normalizer, horizon: int | None
) -> torch.Tensor:
    """``sum_{b,t} L m / (N * H)``, N defaults to B, H to T (Dr. GRPO)."""
    total = masked_sum(loss_mat, m)  # ()
    if normalizer is None:
        normalizer = max(loss_mat.shape[0], 1)
    if horizon is None:
        horizon = loss_mat.shape[-1]
    return total / (normalizer * horizon)


def _check(loss_mat: torch.Tensor, mask: torch.Tensor, normalizer: Normalizer, horizon: int | None) -> None:
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be 2-D (B, T), got shape {tuple(loss_mat.shape)}")
    if mask.shape != loss_mat.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != loss_mat shape {tuple(loss_mat.shape)}")
    if isinstance(normalizer, numbers.Number) and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    if horizon is not None and (not isinstance(horizon, numbers.Integral) or horizon <= 0):
        raise ValueError(f"horizon must be a positive int, got {horizon!r}")


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    normalizer: Normalizer = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``loss_mat`` (B, T) under ``mask`` (B, T) to a 0-dim loss.

    See the module docstring for each mode's formula. ``normalizer`` (a number or
    0-dim tensor) replaces the mode's default denominator; ``horizon`` (int) is
    the ``H`` of ``seq-mean-token-sum-norm`` and ignored by the other modes.
    Unknown modes raise :class:`~ppokit.algo.registry.UnknownNameError`.
    """
    fn = AGG_MODES.get(mode)
    _check(loss_mat, mask, normalizer, horizon)
    return fn(loss_mat, _bool(mask), normalizer, horizon)


def aggregation_normalizer(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The global ``normalizer`` of a whole mini-batch for ``mode`` (0-dim int64 tensor).

    ``token-mean``: ``max(sum m, 1)`` (the token count); sequence modes: ``B``
    (the number of rows). Compute it once per mini-batch and pass it to every
    micro-batch's :func:`aggregate` / loss call. An integer tensor keeps the
    count exact and does not change the loss dtype when dividing. No host sync.
    """
    AGG_MODES.get(mode)
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D (B, T), got shape {tuple(mask.shape)}")
    if AGG_MODES.canonical(mode) == "token-mean":
        return _bool(mask).sum().clamp(min=1)  # () int64
    return torch.tensor(max(mask.shape[0], 1), dtype=torch.int64, device=mask.device)
