"""Policy losses whose gradient is a constant weight times the score: ``-w_t A_t grad log pi_t``.

Per valid token, with ``r_t = exp(clamp(log pi_t - log pi_old_t, -20, 20))``, ``sg`` = stop gradient
and ``A_t`` the token's advantage (or its row's); the loss is ``aggregate(L, mask, agg_mode, ...)``::

    cispo    L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi_t
    dppo_tv  L_t = -sg(min(r_t, C)) A_t log pi_t [the move stays inside the TV trust region]
    dppo_kl  L_t = -sg(min(r_t, C)) A_t log pi_t [the move stays inside the binary-KL trust region]
    gpg      L_t = -A_t log pi_t
    dro      L_t = -(A_t log pi_t - beta/2 (log r_t)^2)

Why each: CISPO (MiniMax-M1) clips the importance weight instead of dropping the gradient, so rare
tokens outside the band still learn. DPPO bounds a divergence of the sampled token's old and new
probability instead of their ratio, so rare tokens may move as far as common ones (:func:`dppo_loss`).
GPG is the plain policy gradient with group advantages; DRO puts a quadratic penalty on the log-ratio
in place of a clip. They equal verl's losses of the same names (``bench/verl_parity.py``). A loss's
value is not 0 at the start of an update (it carries ``log pi``); its gradient is what matters.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .aggregation import aggregate
from .policy_losses import (
    LOG_RATIO_CLAMP,
    PolicyLossInputs,
    check_clip_bounds,
    check_loss_inputs,
    masked_inputs,
    register_policy_loss,
    token_ratio_metrics,
)
from .stats import masked_mean

__all__ = ["cispo_loss", "dppo_loss", "dro_loss", "gpg_loss", "DPPO_DEFAULT_CAP"]

DPPO_DEFAULT_CAP = 20.0  # the DPPO paper's truncation of the importance weight when clip_ratio_c is null
BINARY_KL_EPS = 1e-8


def _finish(loss_per, m, token_log_ratio, clipped, diagnostics, agg, extra=None):
    loss = aggregate(loss_per, m, agg["agg_mode"], normalizer=agg["normalizer"], horizon=agg["horizon"])
    metrics = token_ratio_metrics(token_log_ratio, m, diagnostics)
    with torch.no_grad():
        metrics["clipfrac"] = masked_mean(clipped.to(loss_per.dtype), m) if clipped is not None else loss.new_zeros(())
        metrics.update(extra or {})
    return loss, metrics


@register_policy_loss(
    "cispo",
    settings=lambda a, inputs: {"lower_clip_ratio": a.lower_clip_ratio, "upper_clip_ratio": a.upper_clip_ratio},
)
def cispo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    lower_clip_ratio: float = 0.2,
    upper_clip_ratio: float = 0.2,
    agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    horizon: int | None = None,
    diagnostics: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: ``L_t = -sg(clip(r_t, 1 - lower_clip_ratio, 1 + upper_clip_ratio)) A_t log pi_t``
    (module docstring): every token keeps its gradient, the weight is clipped. Metrics: ``clipfrac``
    (tokens whose weight was clipped) and the ratio's."""
    check_loss_inputs(log_prob, old_log_prob, advantages, mask, agg_mode)
    check_clip_bounds(lower_clip_ratio, upper_clip_ratio)
    m, lp, _, adv, tlr = masked_inputs(log_prob, old_log_prob, advantages, mask)
    ratio = torch.exp(tlr.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B, T)
    weight = ratio.clamp(1.0 - lower_clip_ratio, 1.0 + upper_clip_ratio)
    agg = {"agg_mode": agg_mode, "normalizer": normalizer, "horizon": horizon}
    return _finish(-weight * adv * lp, m, tlr, weight != ratio, diagnostics, agg)


def _dppo_settings(a: Any, inputs: PolicyLossInputs) -> dict[str, Any]:
    return {
        "lower_divergence": a.lower_clip_ratio,
        "upper_divergence": a.upper_clip_ratio,
        "ratio_cap": a.clip_ratio_c if a.clip_ratio_c is not None else DPPO_DEFAULT_CAP,
    }


def dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    divergence: str = "tv",
    lower_divergence: float = 0.2,
    upper_divergence: float = 0.2,
    ratio_cap: float = DPPO_DEFAULT_CAP,
    agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    horizon: int | None = None,
    diagnostics: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO with the ``"tv"`` or ``"kl"`` trust region (module docstring):
    ``L_t = -sg(min(r_t, ratio_cap)) A_t log pi_t`` where the token's move stays inside it, else 0.
    With ``p = pi_t``, ``q = pi_old_t``, ``d_high = upper_divergence`` (A > 0) and
    ``d_low = lower_divergence`` (A <= 0), a token keeps its gradient when::

        tv  A > 0: p - q <= d_high            A <= 0: p - q >= -d_low
        kl  A > 0: KL_b <= d_high or p <= q   A <= 0: KL_b <= d_low or p >= q
            KL_b = q (log q - log p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))

    (the Bernoulli KL of "this token or another"; its 1e-8 guards p = 1). The weight is the ratio
    truncated at ``ratio_cap`` (truncated IS in place of the dual clip; the DPPO paper advises a
    large cap). Metrics: ``clipfrac`` (tokens outside the region) and ``clipfrac_truncated`` (tokens
    inside whose weight was truncated at ``ratio_cap``)."""
    check_loss_inputs(log_prob, old_log_prob, advantages, mask, agg_mode)
    if divergence not in ("tv", "kl"):
        raise ValueError(f"divergence must be tv or kl, got {divergence!r}")
    if not (lower_divergence >= 0.0 and upper_divergence >= 0.0):
        raise ValueError(f"the divergence thresholds must be >= 0, got {lower_divergence}, {upper_divergence}")
    if not ratio_cap > 0.0:
        raise ValueError(f"ratio_cap must be > 0, got {ratio_cap}")
    m, lp, old, adv, tlr = masked_inputs(log_prob, old_log_prob, advantages, mask)
    with torch.no_grad():
        ratio = torch.exp(tlr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B, T)
        weight = ratio.clamp(max=ratio_cap)
        p, q = torch.exp(lp), torch.exp(old)  # (B, T) the sampled token's new and old probability
        if divergence == "tv":
            up_ok, down_ok = p - q <= upper_divergence, p - q >= -lower_divergence
        else:
            kl = q * (old - lp) + (1.0 - q) * torch.log((1.0 - q + BINARY_KL_EPS) / (1.0 - p + BINARY_KL_EPS))
            up_ok, down_ok = (kl <= upper_divergence) | (p <= q), (kl <= lower_divergence) | (p >= q)
        inside = torch.where(adv > 0, up_ok, down_ok)  # (B, T) bool
        extra = {"clipfrac_truncated": masked_mean(((ratio > ratio_cap) & inside).to(lp.dtype), m)}
    loss_per = -adv * weight * lp * inside.to(lp.dtype)
    agg = {"agg_mode": agg_mode, "normalizer": normalizer, "horizon": horizon}
    return _finish(loss_per, m, tlr, ~inside, diagnostics, agg, extra)


# DPPO-Binary-TV and DPPO-Binary-KL: one function, two trust regions
register_policy_loss("dppo_tv", settings=_dppo_settings)(functools.partial(dppo_loss, divergence="tv"))
register_policy_loss("dppo_kl", settings=_dppo_settings)(functools.partial(dppo_loss, divergence="kl"))


@register_policy_loss("gpg", settings=lambda a, inputs: {})
def gpg_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    horizon: int | None = None,
    diagnostics: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG: ``L_t = -A_t log pi_t`` (module docstring): no ratio and no clip, meant for one epoch on
    fresh samples; ``old_log_prob`` only feeds the metrics."""
    check_loss_inputs(log_prob, old_log_prob, advantages, mask, agg_mode)
    m, lp, _, adv, tlr = masked_inputs(log_prob, old_log_prob, advantages, mask)
    agg = {"agg_mode": agg_mode, "normalizer": normalizer, "horizon": horizon}
    return _finish(-adv * lp, m, tlr, None, diagnostics, agg)


@register_policy_loss("dro", settings=lambda a, inputs: {"beta": a.dro_beta})
def dro_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float | None,
    agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    horizon: int | None = None,
    diagnostics: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO: ``L_t = -(A_t log pi_t - beta/2 (log pi_t - log pi_old_t)^2)`` (module docstring)."""
    check_loss_inputs(log_prob, old_log_prob, advantages, mask, agg_mode)
    if beta is None or not beta > 0.0:
        raise ValueError(f"dro needs beta > 0 (algo.dro_beta), got {beta}")
    m, lp, _, adv, tlr = masked_inputs(log_prob, old_log_prob, advantages, mask)
    agg = {"agg_mode": agg_mode, "normalizer": normalizer, "horizon": horizon}
    return _finish(-(adv * lp - 0.5 * beta * tlr.square()), m, tlr, None, diagnostics, agg)
