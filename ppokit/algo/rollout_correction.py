"""Rollout correction: the rollout engine's sampling distribution against the trainer's.

The tokens of a rollout are sampled by an engine (``pi_engine``: its own kernels, bf16
weights with the adapter folded in, top-k/top-p truncation); PPO's ratio is taken
against ``pi_old``, the trainer's own computation of the same weights (the scorer's
``old_log_prob``). Where the two differ, the update is off-policy by
``r_t = pi_old(y_t) / pi_engine(y_t)`` before PPO's own ratio ``pi / pi_old`` starts
(the decoupled PPO objective, as in verl's rollout correction). For each response
token ``t`` of row ``b`` with mask ``m``::

    log r_t   = log pi_old(y_t) - log pi_engine(y_t)
    rho_t     = exp(clamp(log r_t, -20, 20))                          level "token"
    rho_b     = exp(clamp(sum_t m_t log r_t, -20, 20))                level "sequence" (product of ratios)
    rho_b     = exp(clamp(sum_t m_t log r_t / max(sum_t m_t, 1), -20, 20))   level "geometric" (their geometric mean)

A sequence-level ``rho_b`` is broadcast to every token of its row. The corrections
(:data:`ROLLOUT_CORRECTIONS`, each ``fn(rho, mask, *, cap, lower) -> (weight, keep)``)::

    none   weight = 1                                     keep = 1
    tis    weight = min(rho, C)                           keep = 1           truncated importance sampling
    mis    weight = rho * [lower <= rho <= C]             keep = [lower <= rho <= C]
                                                          masked importance sampling; lower defaults to 1/C

(times ``m``: 0 on padding). The trainer multiplies each token's advantage by ``weight``
(for the PPO surrogates this is the per-token loss times ``weight``: with ``w > 0``,
``w max(-A r, -A clip(r)) = max(-(wA) r, -(wA) clip(r))``, and the dual clip alike),
and drops the tokens with ``keep = 0`` from the actor's loss terms and from their
normaliser. ``C`` is ``algo.rollout_correction_cap``: TIS with token ratios and C = 2 is
verl's ``decoupled_token_is`` preset; MIS at the sequence level with ``lower = 0`` and
C = 3 is TRL's default (``sequence_mask``); MIS at the token or geometric level with
``lower = 1/C`` is verl's rejection sampling with IS weights.

:func:`mismatch_metrics` measures the gap every iteration, whatever the correction:
``mismatch_kl`` (the k3 estimate of KL(pi_engine || pi_old) per token: the mean of
``r - 1 - log r`` over tokens sampled from the engine, >= 0), ``mismatch_kl_k1`` (the
mean of ``-log r``, unbiased, may be negative), ``mismatch_ratio_max`` /
``mismatch_ratio_min`` (the extreme token ratios ``r``).
"""

from __future__ import annotations

import torch

from .registry import Registry
from .stats import masked_mean, masked_sum

__all__ = [
    "CORRECTION_LEVELS",
    "ROLLOUT_CORRECTIONS",
    "correction_ratio",
    "mismatch_metrics",
    "rollout_correction",
]

ROLLOUT_CORRECTIONS: Registry = Registry("rollout correction")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
LOG_RATIO_BOUND = 20.0  # exp(+-20): the ratio stays finite whatever the log-probs (verl's safety bound)


def _log_ratio(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(B, T) ``log pi_old - log pi_engine``, 0 where ``m`` is False (padding may hold anything)."""
    return torch.where(m, old_log_prob - rollout_log_prob, torch.zeros((), dtype=old_log_prob.dtype))


def correction_ratio(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """(B, T) ``rho`` at ``level`` (module docstring), 1 on padding."""
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r}; valid: {', '.join(CORRECTION_LEVELS)}")
    _check(old_log_prob, rollout_log_prob, mask)
    m = mask != 0
    log_r = _log_ratio(old_log_prob, rollout_log_prob, m)  # (B, T)
    if level == "token":
        log_rho = log_r
    else:
        total = masked_sum(log_r, m, dim=-1)  # (B,)
        if level == "geometric":
            total = total / m.sum(-1).clamp(min=1).to(total.dtype)
        log_rho = total[:, None].expand_as(log_r)  # (B, T)
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return torch.where(m, rho, torch.ones((), dtype=rho.dtype))


@ROLLOUT_CORRECTIONS.register("none")
def no_correction(
    rho: torch.Tensor, mask: torch.Tensor, *, cap: float, lower: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight 1 and keep 1 on every token (the mismatch is only measured)."""
    m = (mask != 0).to(rho.dtype)
    return m, m


@ROLLOUT_CORRECTIONS.register("tis")
def truncated_importance_sampling(
    rho: torch.Tensor, mask: torch.Tensor, *, cap: float, lower: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight = min(rho, cap)``, every token kept."""
    m = (mask != 0).to(rho.dtype)
    return rho.clamp(max=cap) * m, m


@ROLLOUT_CORRECTIONS.register("mis")
def masked_importance_sampling(
    rho: torch.Tensor, mask: torch.Tensor, *, cap: float, lower: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight = rho`` inside the band ``[lower, cap]``, the token (or its sequence) dropped outside it."""
    keep = ((rho >= lower) & (rho <= cap) & (mask != 0)).to(rho.dtype)
    return rho * keep, keep


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "none",
    level: str = "token",
    cap: float = 2.0,
    lower: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(weight, keep, metrics)`` of correction ``mode`` (module docstring), (B, T) float each, 0 on
    padding. ``lower`` (MIS) defaults to ``1 / cap``. Metrics (detached 0-dim tensors):
    ``correction_weight_mean`` (over the kept tokens), ``correction_truncated_frac`` (TIS: tokens
    whose weight was capped) or ``correction_masked_frac`` (MIS: tokens dropped), over the tokens."""
    fn = ROLLOUT_CORRECTIONS.get(mode)
    if not cap >= 1.0:
        raise ValueError(f"the rollout correction cap must be >= 1, got {cap}")
    lower = 1.0 / cap if lower is None else lower
    if not 0.0 <= lower <= 1.0:
        raise ValueError(f"the lower bound of the MIS band must be in [0, 1], got {lower}")
    rho = correction_ratio(old_log_prob, rollout_log_prob, mask, level)  # (B, T)
    weight, keep = fn(rho, mask, cap=cap, lower=lower)
    m = mask != 0
    with torch.no_grad():
        metrics = {"correction_weight_mean": masked_mean(weight, keep != 0)}
        if mode == "tis":
            metrics["correction_truncated_frac"] = masked_mean((rho > cap).to(rho.dtype), m)
        elif mode == "mis":
            metrics["correction_masked_frac"] = masked_mean((keep == 0).to(rho.dtype), m)
    return weight.detach(), keep.detach(), metrics


@torch.no_grad()
def mismatch_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The gap between the engine's log-probs and the trainer's on the sampled tokens (module
    docstring): ``mismatch_kl`` (k3, per token), ``mismatch_kl_k1``, ``mismatch_ratio_max``,
    ``mismatch_ratio_min``; 0-dim tensors (0, 0, 1, 1 without any valid token)."""
    _check(old_log_prob, rollout_log_prob, mask)
    m = mask != 0
    log_r = _log_ratio(old_log_prob, rollout_log_prob, m).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    ratio = torch.exp(log_r)
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
    any_token = m.any()  # no host sync: selected with where
    return {
        "mismatch_kl": masked_mean(torch.expm1(log_r) - log_r, m),
        "mismatch_kl_k1": masked_mean(-log_r, m),
        "mismatch_ratio_max": torch.where(any_token, torch.where(m, ratio, 0.0).amax(), one),
        "mismatch_ratio_min": torch.where(any_token, torch.where(m, ratio, torch.inf).amin(), one),
    }


def _check(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor) -> None:
    if old_log_prob.dim() != 2 or old_log_prob.shape != rollout_log_prob.shape or mask.shape != old_log_prob.shape:
        raise ValueError(
            "old_log_prob, rollout_log_prob and mask must share one (B, T) shape; got "
            f"{tuple(old_log_prob.shape)}, {tuple(rollout_log_prob.shape)}, {tuple(mask.shape)}"
        )
