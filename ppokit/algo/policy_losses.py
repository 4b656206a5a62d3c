"""The clipped PPO policy loss (Schulman et al., 2017), with dual clip and sequence-level ratios."""

from __future__ import annotations

import torch

from .aggregation import AGG_MODES, aggregate
from .registry import Registry
from .stats import masked_mean

__all__ = ["POLICY_LOSSES", "policy_loss"]

POLICY_LOSSES: Registry = Registry("policy loss")

LOG_RATIO_CLAMP = 20.0
RATIO_LEVELS = ("token", "sequence")


def _masked_extreme(x: torch.Tensor, m: torch.Tensor, largest: bool) -> torch.Tensor:
    """max (or min) of ``x`` over ``m``; 0 if nothing is valid. No host sync."""
    fill = float("-inf") if largest else float("inf")
    filled = torch.where(m, x, torch.full((), fill, dtype=x.dtype, device=x.device))
    ext = filled.amax() if largest else filled.amin()
    return torch.where(m.any(), ext, torch.zeros_like(ext))


@POLICY_LOSSES.register("ppo", "vanilla")
def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    lower_clip_ratio: float = 0.2,
    upper_clip_ratio: float = 0.2,
    clip_ratio_c: float | None = None,
    agg_mode: str = "token-mean",
    ratio_level: str = "token",
    normalizer: torch.Tensor | float | None = None,
    horizon: int | None = None,
    diagnostics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss.

    Per position (token, or sequence with ``ratio_level="sequence"``)::

        log r = clamp(log pi - log pi_old, -20, 20),   r = exp(log r)
        L     = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
        L     = min(L, -A c)        for A < 0, if clip_ratio_c = c (dual clip, c > 1)

    and the loss is ``aggregate(L, mask, agg_mode, normalizer=..., horizon=...)``.
    The gradient w.r.t. ``log_prob`` is exactly 0 wherever a clip is active.

    ``ratio_level="sequence"`` (GSPO-like / sequence-level importance ratio)::

        log r_b = clamp(sum_t m_bt (log pi_bt - log pi_old_bt), -20, 20)
        A_b     = masked mean of advantages over row b  (or advantages (B,) as given)

    the per-sequence loss ``L_b`` is put on every valid token of row b and then
    aggregated; ``seq-mean-token-mean`` gives ``-(1/B) sum_b min(A_b r_b, A_b clip(r_b))``.

    Args:
        log_prob: (B, T) log-probs of the taken tokens/actions under the current policy.
        old_log_prob: (B, T) log-probs under the behaviour policy (a constant).
        advantages: (B, T) or (B,) (one per row), a constant.
        mask: (B, T) bool or 0/1 float.
        lower_clip_ratio, upper_clip_ratio: eps_low in [0, 1) and eps_high >= 0.
        clip_ratio_c: dual-clip constant c > 1, or None.
        agg_mode, normalizer, horizon: see :func:`~ppokit.algo.aggregation.aggregate`.
        diagnostics: False returns only ``clipfrac``, ``approx_kl_k1``, ``approx_kl_k3``
            and ``ratio_max`` (what a training loop logs every step; each metric is a
            handful of tiny ops that cost more than the loss itself on small batches).

    Returns:
        ``(loss, metrics)``; metrics are detached 0-dim tensors (no host sync):
        ``clipfrac`` (fraction of valid positions where any clip zeroes the
        gradient), ``clipfrac_lower`` (A < 0, r < 1 - eps_low), ``clipfrac_upper``
        (A > 0, r > 1 + eps_high), ``clipfrac_dual`` (A < 0, r > c), ``ratio_mean``,
        ``ratio_max``, ``ratio_min`` -- over valid tokens, or over rows with at
        least one valid token at sequence level -- and ``approx_kl_k1``
        (mean of ``log pi_old - log pi``) and ``approx_kl_k3`` (mean of
        ``(r - 1) - log r``), always over valid tokens with token-level ratios.
    """
    # ---- validation (cheap, no host sync)
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be 2-D (B, T), got shape {tuple(log_prob.shape)}")
    if old_log_prob.shape != log_prob.shape:
        raise ValueError(f"old_log_prob shape {tuple(old_log_prob.shape)} != log_prob shape {tuple(log_prob.shape)}")
    if mask.shape != log_prob.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != log_prob shape {tuple(log_prob.shape)}")
    B = log_prob.shape[0]
    if advantages.shape not in (log_prob.shape, (B,)):
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} must be log_prob shape {tuple(log_prob.shape)} or (B,) = ({B},)"
        )
    if not 0.0 <= lower_clip_ratio < 1.0:
        raise ValueError(f"lower_clip_ratio must be in [0, 1), got {lower_clip_ratio}")
    if not upper_clip_ratio >= 0.0:
        raise ValueError(f"upper_clip_ratio must be >= 0, got {upper_clip_ratio}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {clip_ratio_c}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {', '.join(RATIO_LEVELS)}, got {ratio_level!r}")
    AGG_MODES.get(agg_mode)

    m = mask if mask.dtype == torch.bool else mask != 0  # (B, T)
    zero = log_prob.new_zeros(())
    # masked-out positions may hold garbage (even inf); select them away early
    token_log_ratio = torch.where(m, log_prob - old_log_prob, zero)  # (B, T)

    if ratio_level == "token":
        log_ratio = token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(log_prob)  # (B, T)
        unit_mask = m  # (B, T)
    else:
        log_ratio = token_log_ratio.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B,)
        adv = advantages if advantages.dim() == 1 else masked_mean(advantages, m, dim=-1)  # (B,)
        unit_mask = m.any(-1)  # (B,) rows with at least one valid token

    ratio = torch.exp(log_ratio)  # (B, T) or (B,)
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - lower_clip_ratio, 1.0 + upper_clip_ratio)
    loss_per = torch.maximum(surr, surr_clipped)
    if clip_ratio_c is not None:
        dual = torch.minimum(loss_per, -adv * clip_ratio_c)
        loss_per = torch.where(adv < 0, dual, loss_per)

    if ratio_level == "sequence":
        loss_per = loss_per[:, None].expand_as(log_prob)  # (B, T)
    loss = aggregate(loss_per, m, agg_mode, normalizer=normalizer, horizon=horizon)

    # ---- metrics (detached, on device)
    with torch.no_grad():
        r = ratio.detach()
        a = adv.detach()
        lower = (a < 0) & (r < 1.0 - lower_clip_ratio)
        upper = (a > 0) & (r > 1.0 + upper_clip_ratio)
        if clip_ratio_c is not None:
            dual_hit = (a < 0) & (r > clip_ratio_c)
        else:
            dual_hit = torch.zeros_like(lower)
        tlr = token_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
        if not diagnostics:
            return loss, {
                "clipfrac": masked_mean((lower | upper | dual_hit).to(r.dtype), unit_mask),
                "approx_kl_k1": masked_mean(-tlr, m),
                "approx_kl_k3": masked_mean(torch.expm1(tlr) - tlr, m),
                "ratio_max": _masked_extreme(r, unit_mask, largest=True),
            }
        metrics = {
            "clipfrac": masked_mean((lower | upper | dual_hit).to(r.dtype), unit_mask),
            "clipfrac_lower": masked_mean(lower.to(r.dtype), unit_mask),
            "clipfrac_upper": masked_mean(upper.to(r.dtype), unit_mask),
            "clipfrac_dual": masked_mean(dual_hit.to(r.dtype), unit_mask),
            "approx_kl_k1": masked_mean(-tlr, m),
            "approx_kl_k3": masked_mean(torch.expm1(tlr) - tlr, m),
            "ratio_mean": masked_mean(r, unit_mask),
            "ratio_max": _masked_extreme(r, unit_mask, largest=True),
            "ratio_min": _masked_extreme(r, unit_mask, largest=False),
        }
    return loss, metrics
