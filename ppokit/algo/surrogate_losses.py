"""Variants of PPO's ratio surrogate ``-A r``: a soft gate, a geometric mean, covariance control.

Per valid token, with ``log r_t = clamp(log pi_t - log pi_old_t, -20, 20)`` and ``A_t`` the token's
advantage (or its row's); the loss is ``aggregate(L, mask, agg_mode, ...)``::

    sapo      L_t = -A_t (4 / tau_t) sigmoid(tau_t (r_t - 1)),   tau_t = tau_pos if A_t > 0 else tau_neg
    geo_mean  L_b = -A_b exp(mean_t l_t),
              l_t = sgn(A_t) min(sgn(A_t) log r_t, sgn(A_t) clip(log r_t, -eps_low, eps_high))
    clip_cov  L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)) c_t
    kl_cov    L_t = -A_t r_t + k_t coef |log r_t|

Why each: SAPO (Qwen) replaces the hard clip by a smooth gate whose gradient is PPO's at ``r = 1``
and fades as ``r`` leaves 1. GMPO (``geo_mean``) takes the geometric mean of clipped token ratios, so
one outlier token moves a sequence's ratio little. Clip-Cov and KL-Cov (Cui et al., 2025) keep the
entropy from collapsing: they stop the gradient of (``c_t = 0``) or penalise (``k_t = 1``) a few
tokens of large covariance ``(A_t - mean A) (log pi_t - mean log pi)``, which are what drive it down.
They equal verl's losses of the same names (``bench/verl_parity.py``).
"""

from __future__ import annotations

import torch

from .aggregation import aggregate
from .policy_losses import (
    LOG_RATIO_CLAMP,
    check_clip_bounds,
    check_loss_inputs,
    masked_inputs,
    register_policy_loss,
    token_ratio_metrics,
)
from .stats import masked_mean

__all__ = ["clip_cov_loss", "geo_mean_loss", "kl_cov_loss", "sapo_loss"]


@register_policy_loss("sapo", settings=lambda a, inputs: {"tau_pos": a.sapo_tau_pos, "tau_neg": a.sapo_tau_neg})
def sapo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    horizon: int | None = None,
    diagnostics: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: ``L_t = -A_t (4 / tau_t) sigmoid(tau_t (r_t - 1))`` (module docstring). Nothing is
    clipped (``clipfrac`` 0); ``gate_mean`` is the mean of ``sigmoid'(tau (r - 1)) 4``, the factor
    on PPO's gradient (1 at the start of an update).

    The gradient ``-A sigmoid'(tau (r - 1)) 4 r grad log pi`` equals PPO's ``-A r grad log pi`` at
    ``r = 1`` and fades as ``r`` leaves 1, faster for negative advantages (``tau_neg > tau_pos``).
    The SAPO paper aggregates with ``seq-mean-token-mean``."""
    check_loss_inputs(log_prob, old_log_prob, advantages, mask, agg_mode)
    if not (tau_pos > 0.0 and tau_neg > 0.0):
        raise ValueError(f"the SAPO temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    m, _, _, adv, tlr = masked_inputs(log_prob, old_log_prob, advantages, mask)
    ratio = torch.exp(tlr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B, T)
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))  # (B, T)
    loss = aggregate(-adv * gate * (4.0 / tau), m, agg_mode, normalizer=normalizer, horizon=horizon)
    metrics = token_ratio_metrics(tlr, m, diagnostics)
    with torch.no_grad():
        metrics["clipfrac"] = loss.new_zeros(())
        g = gate.detach()
        metrics["gate_mean"] = masked_mean(4.0 * g * (1.0 - g), m)
    return loss, metrics


@register_policy_loss(
    "geo_mean",
    "gmpo",
    settings=lambda a, inputs: {"lower_clip_ratio": a.lower_clip_ratio, "upper_clip_ratio": a.upper_clip_ratio},
)
def geo_mean_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    lower_clip_ratio: float = 0.4,
    upper_clip_ratio: float = 0.4,
    agg_mode: str = "seq-mean-token-mean",
    normalizer: torch.Tensor | float | None = None,
    horizon: int | None = None,
    diagnostics: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO: ``L_b = -A_b exp(mean_t l_t)`` with each token's log-ratio clipped in log space to
    ``[-lower_clip_ratio, upper_clip_ratio]`` on the side its advantage's sign pessimises (module
    docstring); ``A_b`` is the row's mean advantage. Metrics: ``clipfrac`` (valid tokens whose
    log-ratio was clipped, ``A != 0``), ``clipfrac_upper`` (A > 0), ``clipfrac_lower`` (A < 0).

    ``L_b`` goes on every valid token of its row: ``seq-mean-token-mean`` (the default) gives GMPO's
    mean over sequences. The log-space clip is wider than PPO's (e.g. ``eps = 0.4``). Meant for one
    advantage per sequence (outcome rewards)."""
    check_loss_inputs(log_prob, old_log_prob, advantages, mask, agg_mode)
    check_clip_bounds(lower_clip_ratio, upper_clip_ratio)
    m, _, _, adv, tlr = masked_inputs(log_prob, old_log_prob, advantages, mask)
    sign = torch.sign(adv)  # (B, T)
    clamped = tlr.clamp(-lower_clip_ratio, upper_clip_ratio)
    pessimistic = sign * torch.minimum(sign * tlr, sign * clamped)  # (B, T), 0 where A = 0
    count = m.sum(-1).clamp(min=1).to(tlr.dtype)  # (B,)
    log_s = (pessimistic.sum(-1) / count).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B,)
    adv_row = advantages if advantages.dim() == 1 else adv.sum(-1) / count  # (B,)
    loss_row = -adv_row * torch.exp(log_s)  # (B,)
    loss = aggregate(loss_row[:, None].expand_as(tlr), m, agg_mode, normalizer=normalizer, horizon=horizon)
    metrics = token_ratio_metrics(tlr, m, diagnostics)
    with torch.no_grad():
        clipped = (tlr != clamped) & m
        upper = masked_mean((clipped & (adv > 0)).to(tlr.dtype), m)
        lower = masked_mean((clipped & (adv < 0)).to(tlr.dtype), m)
        metrics.update(clipfrac=upper + lower, clipfrac_upper=upper, clipfrac_lower=lower)
    return loss, metrics


def _covariance(adv: torch.Tensor, lp: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(B, T) ``(A_t - mean A) (log pi_t - mean log pi)``, means over the valid tokens, detached."""
    a, p = adv.detach(), lp.detach()
    return (a - masked_mean(a, m)) * (p - masked_mean(p, m))


def _selection_count(fraction: float, m: torch.Tensor) -> int:
    """``max(1, floor(fraction * valid tokens))`` (a host sync)."""
    return max(int(fraction * int(m.sum().item())), 1)


@register_policy_loss(
    "clip_cov",
    settings=lambda a, inputs: {
        "lower_clip_ratio": a.lower_clip_ratio,
        "upper_clip_ratio": a.upper_clip_ratio,
        "cov_ratio": a.clip_cov_ratio,
        "cov_lower": a.clip_cov_lb,
        "cov_upper": a.clip_cov_ub,
    },
)
def clip_cov_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    lower_clip_ratio: float = 0.2,
    upper_clip_ratio: float = 0.2,
    cov_ratio: float = 2e-4,
    cov_lower: float = 1.0,
    cov_upper: float = 5.0,
    agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    horizon: int | None = None,
    diagnostics: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO's clipped surrogate with the gradient of a random ``cov_ratio`` share of the
    tokens in the covariance band ``(cov_lower, cov_upper)`` stopped (module docstring). Metrics:
    ``clipfrac`` (PPO's clip or the covariance rule zeroes the gradient), ``clip_cov_frac``.

    ``cov_t = (A_t - mean A) (log pi_t - mean log pi)``, means over the micro-batch's valid tokens;
    ``n = max(1, floor(cov_ratio N))`` tokens are drawn at random (the device's torch generator)
    among those with ``cov_lower < cov_t < cov_upper`` that PPO's clip left alone. Counting them
    reads the device (one host sync per call)."""
    check_loss_inputs(log_prob, old_log_prob, advantages, mask, agg_mode)
    check_clip_bounds(lower_clip_ratio, upper_clip_ratio)
    if not 0.0 < cov_ratio <= 1.0:
        raise ValueError(f"clip_cov_ratio must be in (0, 1], got {cov_ratio}")
    m, lp, _, adv, tlr = masked_inputs(log_prob, old_log_prob, advantages, mask)
    ratio = torch.exp(tlr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B, T)
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - lower_clip_ratio, 1.0 + upper_clip_ratio)
    ppo_clipped = (surr_clipped > surr) & m
    cov = _covariance(adv, lp, m)
    candidates = torch.nonzero(m & ~ppo_clipped & (cov > cov_lower) & (cov < cov_upper))  # (K, 2)
    chosen = candidates[torch.randperm(len(candidates))[: _selection_count(cov_ratio, m)]]
    keep = torch.ones_like(surr)
    keep[chosen[:, 0], chosen[:, 1]] = 0.0
    loss_per = torch.maximum(surr, surr_clipped) * keep
    loss = aggregate(loss_per, m, agg_mode, normalizer=normalizer, horizon=horizon)
    metrics = token_ratio_metrics(tlr, m, diagnostics)
    with torch.no_grad():
        detached = keep == 0
        metrics["clip_cov_frac"] = masked_mean(detached.to(tlr.dtype), m)
        metrics["clipfrac"] = masked_mean((detached | (ppo_clipped & (adv != 0))).to(tlr.dtype), m)
    return loss, metrics


@register_policy_loss("kl_cov", settings=lambda a, inputs: {"cov_ratio": a.kl_cov_ratio, "coef": a.kl_cov_coef})
def kl_cov_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cov_ratio: float = 2e-4,
    coef: float = 0.1,
    agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    horizon: int | None = None,
    diagnostics: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: the unclipped surrogate ``-A r`` plus ``coef |log r|`` on the ``cov_ratio`` share of
    tokens with the largest covariance (module docstring). Nothing is clipped (``clipfrac`` 0);
    ``kl_cov_frac`` is the share penalised.

    ``cov_t`` and ``n`` as in :func:`clip_cov_loss`: the ``n`` tokens of largest ``cov_t`` get the
    penalty (one host sync per call)."""
    check_loss_inputs(log_prob, old_log_prob, advantages, mask, agg_mode)
    if not 0.0 < cov_ratio <= 1.0:
        raise ValueError(f"kl_cov_ratio must be in (0, 1], got {cov_ratio}")
    if not coef >= 0.0:
        raise ValueError(f"kl_cov_coef must be >= 0, got {coef}")
    m, lp, _, adv, tlr = masked_inputs(log_prob, old_log_prob, advantages, mask)
    tlr = tlr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    loss_per = -adv * torch.exp(tlr)  # (B, T)
    valid = torch.nonzero(m.reshape(-1)).squeeze(-1)  # (N,) flat indices of the valid tokens
    penalised = torch.zeros_like(m)
    if len(valid):
        cov = _covariance(adv, lp, m).reshape(-1)[valid]  # (N,)
        top = valid[torch.topk(cov, min(_selection_count(cov_ratio, m), len(valid))).indices]
        penalised.view(-1)[top] = True
    loss_per = loss_per + coef * tlr.abs() * penalised.to(tlr.dtype)
    loss = aggregate(loss_per, m, agg_mode, normalizer=normalizer, horizon=horizon)
    metrics = token_ratio_metrics(tlr, m, diagnostics)
    with torch.no_grad():
        metrics["clipfrac"] = loss.new_zeros(())
        metrics["kl_cov_frac"] = masked_mean(penalised.to(tlr.dtype), m)
    return loss, metrics
