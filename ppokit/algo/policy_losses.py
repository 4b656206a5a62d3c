"""PPO policy losses (the PPO paper, Schulman et al., 2017) and the registry every loss is called through.

- ``clip`` (:func:`policy_loss`): the clipped surrogate, asymmetric clip range, dual clip.
- ``penalty`` (:func:`ppo_penalty_loss`): the unclipped surrogate plus ``beta * KL(pi_old || pi)``,
  ``beta`` adapted between iterations (:class:`~ppokit.algo.kl.AdaptivePenaltyCoef`).
- The 2026 set: :mod:`.weighted_losses` (``cispo``, ``dppo_tv``, ``dppo_kl``, ``gpg``, ``dro``) and
  :mod:`.surrogate_losses` (``sapo``, ``geo_mean``, ``clip_cov``, ``kl_cov``).

Every loss has one signature and returns at least ``clipfrac``, ``approx_kl_k1``, ``approx_kl_k3``
and ``ratio_max``::

    loss, metrics = fn(log_prob, old_log_prob, advantages, mask, *,
                       agg_mode=..., normalizer=..., horizon=..., diagnostics=..., **its_own)

:func:`register_policy_loss` records the hyperparameters a loss reads from ``cfg.algo``, so a trainer
calls every loss alike: ``get_policy_loss(cfg.algo.loss_mode)(PolicyLossInputs(...), cfg.algo)``. A
new loss is one function, one registration and a test. ``ratio_level`` (``clip``, ``penalty``) picks
the ratio: per token, per sequence, or GSPO-token (:func:`_importance_ratio` derives them).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .aggregation import AGG_MODES, aggregate
from .registry import Registry
from .stats import masked_mean

__all__ = [
    "POLICY_LOSSES",
    "PolicyLoss",
    "PolicyLossInputs",
    "get_policy_loss",
    "policy_loss",
    "token_advantages",
    "token_ratio_metrics",
    "ppo_penalty_loss",
    "register_policy_loss",
]

POLICY_LOSSES: Registry = Registry("policy loss")

LOG_RATIO_CLAMP = 20.0
RATIO_LEVELS = ("token", "sequence", "gspo")


@dataclass(frozen=True)
class PolicyLossInputs:
    """What every policy loss gets from the update: the batch's tensors and how to reduce them."""

    log_prob: torch.Tensor  # (B, T) current policy, with gradient
    old_log_prob: torch.Tensor  # (B, T) behaviour policy, a constant
    advantages: torch.Tensor  # (B, T) or (B,), a constant
    mask: torch.Tensor  # (B, T) bool or 0/1
    agg_mode: str = "token-mean"
    normalizer: torch.Tensor | float | None = None
    horizon: int | None = None
    diagnostics: bool = False
    penalty_coef: torch.Tensor | float | None = None  # this iteration's adaptive KL coefficient (penalty)


Settings = Callable[[Any, PolicyLossInputs], dict[str, Any]]


class PolicyLoss:
    """A registered loss: its function (:attr:`fn`) and the hyperparameters it reads from ``cfg.algo``."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]], settings: Settings):
        self.fn = fn
        self.settings = settings

    def __call__(self, inputs: PolicyLossInputs, algo: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metrics)`` of ``inputs`` under the hyperparameters of ``algo`` (an ``AlgoConfig``)."""
        return self.fn(
            inputs.log_prob,
            inputs.old_log_prob,
            inputs.advantages,
            inputs.mask,
            agg_mode=inputs.agg_mode,
            normalizer=inputs.normalizer,
            horizon=inputs.horizon,
            diagnostics=inputs.diagnostics,
            **self.settings(algo, inputs),
        )

    def __repr__(self) -> str:
        return f"PolicyLoss({getattr(self.fn, '__name__', self.fn)!r})"


def register_policy_loss(name: str, *aliases: str, settings: Settings):
    """Decorator: register ``fn`` as policy loss ``name`` (and ``aliases``); ``settings(algo, inputs)``
    gives its own keyword arguments. Returns ``fn`` unchanged (callable with keywords)."""

    def decorator(fn):
        POLICY_LOSSES.register(name, *aliases)(PolicyLoss(fn, settings))
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name`` (e.g. ``"clip"``/``"ppo"``/``"vanilla"``, ``"penalty"``,
    ``"cispo"``).

    Unknown names raise :class:`~ppokit.algo.registry.UnknownNameError` (a ValueError)
    with a did-you-mean hint and the valid names.
    """
    return POLICY_LOSSES.get(name)


def _masked_extreme(x: torch.Tensor, m: torch.Tensor, largest: bool) -> torch.Tensor:
    """max (or min) of ``x`` over ``m``; 0 if nothing is valid. No host sync."""
    fill = float("-inf") if largest else float("inf")
    filled = torch.where(m, x, torch.full((), fill, dtype=x.dtype, device=x.device))
    ext = filled.amax() if largest else filled.amin()
    return torch.where(m.any(), ext, torch.zeros_like(ext))


def token_ratio_metrics(token_log_ratio: torch.Tensor, m: torch.Tensor, diagnostics: bool) -> dict[str, torch.Tensor]:
    """What a trainer logs of the token ratios ``r = exp(log pi - log pi_old)`` over valid tokens:
    ``approx_kl_k1`` (mean ``-log r``), ``approx_kl_k3`` (mean ``r - 1 - log r``), ``ratio_max`` and,
    with ``diagnostics``, ``ratio_mean`` and ``ratio_min``. Detached 0-dim tensors, no host sync."""
    with torch.no_grad():
        tlr = token_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
        r = torch.exp(tlr)
        metrics = {
            "approx_kl_k1": masked_mean(-tlr, m),
            "approx_kl_k3": masked_mean(torch.expm1(tlr) - tlr, m),
            "ratio_max": _masked_extreme(r, m, largest=True),
        }
        if diagnostics:
            metrics["ratio_mean"] = masked_mean(r, m)
            metrics["ratio_min"] = _masked_extreme(r, m, largest=False)
    return metrics


def token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B, T) advantages: as given, or one per row (B,) put on every token of the row."""
    return advantages if advantages.dim() == 2 else advantages[:, None].expand_as(like)


def check_loss_inputs(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    agg_mode: str,
    ratio_level: str = "token",
) -> None:
    """Shape and name checks shared by every loss (cheap, no host sync)."""
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be 2-D (B, T), got shape {tuple(log_prob.shape)}")
    if old_log_prob.shape != log_prob.shape:
        raise ValueError(f"old_log_prob shape {tuple(old_log_prob.shape)} != log_prob shape {tuple(log_prob.shape)}")
    if mask.shape != log_prob.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != log_prob shape {tuple(log_prob.shape)}")
    B = log_prob.shape[0]
    if advantages.shape not in (log_prob.shape, (B,)):
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} must be log_prob shape {tuple(log_prob.shape)} "
            f"or (B,) = ({B},)"
        )
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {', '.join(RATIO_LEVELS)}, got {ratio_level!r}")
    AGG_MODES.get(agg_mode)


def masked_inputs(log_prob, old_log_prob, advantages, mask):
    """``(m, lp, old, adv, token_log_ratio)``: (B, T) each, 0 where ``mask`` is False (padding may
    hold anything, even inf)."""
    m = mask if mask.dtype == torch.bool else mask != 0  # (B, T)
    zero = log_prob.new_zeros(())
    lp = torch.where(m, log_prob, zero)
    old = torch.where(m, old_log_prob, zero)
    adv = torch.where(m, token_advantages(advantages, log_prob), zero)
    return m, lp, old, adv, lp - old


def check_clip_bounds(lower_clip_ratio: float, upper_clip_ratio: float) -> None:
    if not 0.0 <= lower_clip_ratio < 1.0:
        raise ValueError(f"lower_clip_ratio must be in [0, 1), got {lower_clip_ratio}")
    if not upper_clip_ratio >= 0.0:
        raise ValueError(f"upper_clip_ratio must be >= 0, got {upper_clip_ratio}")


def _importance_ratio(
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    m: torch.Tensor,
    token_log_ratio: torch.Tensor,
    ratio_level: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ratio, adv, unit_mask)`` at ``ratio_level``.

    ``token_log_ratio`` (B, T) is ``log pi - log pi_old`` with masked-out positions 0.
    ``token`` and ``gspo`` give (B, T) tensors and ``unit_mask = m``; ``sequence``
    gives (B,) tensors and ``unit_mask`` = rows with at least one valid token.

    ``sequence``: one ratio per row, with the row's mean advantage (or ``advantages`` (B,) as
    given); the loss puts its ``L_b`` on every valid token of the row::

        log r_b = clamp(sum_t m_bt (log pi_bt - log pi_old_bt), -20, 20)

    (with ``clip`` and ``seq-mean-token-mean``: ``-(1/B) sum_b min(A_b r_b, A_b clip(r_b))``).
    ``gspo`` (GSPO-token, the GSPO paper, Zheng et al., 2025)::

        log s_b = clamp((1/|y_b|) sum_t m_bt (log pi_bt - log pi_old_bt), -20, 20)
        s_bt    = sg[s_b] * pi_bt / sg[pi_bt]            (sg = stop gradient)

    ``s_bt`` equals ``s_b`` on every token and ``d s_bt / d log pi_bt = s_b``; the advantage may
    differ per token. With one advantage per row and ``seq-mean-token-mean`` the value and the
    gradient equal GSPO's sequence objective ``-(1/B) sum_b min(s_b A_b, clip(s_b) A_b)``. A
    geometric mean stays much closer to 1 than token ratios: GSPO uses clip ranges about 1000x
    smaller (``lower_clip_ratio=3e-4``, ``upper_clip_ratio=4e-4``); at 0.2 nothing is clipped.
    """
    if ratio_level == "sequence":
        log_ratio = token_log_ratio.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B,)
        adv = advantages if advantages.dim() == 1 else masked_mean(advantages, m, dim=-1)  # (B,)
        return torch.exp(log_ratio), adv, m.any(-1)
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(log_prob)  # (B, T)
    if ratio_level == "token":
        log_ratio = token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
        return torch.exp(log_ratio), adv, m
    # gspo: log s_it = sg[log s_i] + log pi_t - sg[log pi_t]; value log s_i, d/d(log pi_t) = 1
    row_len = m.sum(-1).clamp(min=1)  # (B,)
    log_s = (token_log_ratio.detach().sum(-1) / row_len).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B,)
    lp = torch.where(m, log_prob, log_prob.new_zeros(()))  # (B, T) padding may hold inf
    log_ratio = log_s[:, None] + (lp - lp.detach())  # (B, T)
    return torch.exp(log_ratio), adv, m


def _ratio_inputs(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, ratio_level: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, token_log_ratio, ratio, adv, unit_mask)``: the bool (B, T) mask, ``log pi - log pi_old``
    (B, T) with masked-out positions 0, and :func:`_importance_ratio` at ``ratio_level``."""
    m = mask if mask.dtype == torch.bool else mask != 0  # (B, T)
    zero = log_prob.new_zeros(())
    # masked-out positions may hold garbage (even inf); select them away early
    token_log_ratio = torch.where(m, log_prob - old_log_prob, zero)  # (B, T)
    ratio, adv, unit_mask = _importance_ratio(log_prob, advantages, m, token_log_ratio, ratio_level)
    return m, token_log_ratio, ratio, adv, unit_mask


def _clip_metrics(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    token_log_ratio: torch.Tensor,
    m: torch.Tensor,
    unit_mask: torch.Tensor,
    lower_clip_ratio: float,
    upper_clip_ratio: float,
    clip_ratio_c: float | None,
    diagnostics: bool,
) -> dict[str, torch.Tensor]:
    """:func:`policy_loss`'s metrics (see its Returns), detached, on device."""
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
            return {
                "clipfrac": masked_mean((lower | upper | dual_hit).to(r.dtype), unit_mask),
                "approx_kl_k1": masked_mean(-tlr, m),
                "approx_kl_k3": masked_mean(torch.expm1(tlr) - tlr, m),
                "ratio_max": _masked_extreme(r, unit_mask, largest=True),
            }
        return {
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


def _check_penalty_coef(penalty_coef: Any) -> None:
    """``penalty_coef`` is a 0-dim tensor (not read: no host sync) or a finite number >= 0."""
    if isinstance(penalty_coef, torch.Tensor):
        if penalty_coef.dim() != 0:
            raise ValueError(f"penalty_coef must be a number or a 0-dim tensor, got shape {tuple(penalty_coef.shape)}")
    elif (
        not isinstance(penalty_coef, numbers.Real)
        or isinstance(penalty_coef, bool)
        or not (0.0 <= penalty_coef < float("inf"))
    ):
        raise ValueError(f"penalty_coef must be a finite number >= 0, got {penalty_coef!r}")


def _clip_settings(a: Any, inputs: PolicyLossInputs) -> dict[str, Any]:
    return {
        "lower_clip_ratio": a.lower_clip_ratio,
        "upper_clip_ratio": a.upper_clip_ratio,
        "clip_ratio_c": a.clip_ratio_c,
        "ratio_level": a.ratio_level,
    }


@register_policy_loss("clip", "ppo", "vanilla", settings=_clip_settings)
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
    """Clipped surrogate policy loss (the PPO paper, Schulman et al., 2017).

    Per position (token, or sequence with ``ratio_level="sequence"``)::

        log r = clamp(log pi - log pi_old, -20, 20),   r = exp(log r)
        L     = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
        L     = min(L, -A c)        for A < 0, if clip_ratio_c = c (dual clip, c > 1)

    and the loss is ``aggregate(L, mask, agg_mode, normalizer=..., horizon=...)``.
    The gradient w.r.t. ``log_prob`` is exactly 0 wherever a clip is active.
    ``ratio_level`` ``"sequence"`` and ``"gspo"`` (GSPO-token, Zheng et al., 2025) replace
    ``r`` by a sequence ratio: :func:`_importance_ratio` derives both (GSPO wants clip ranges
    about 1000x smaller than token-level PPO).

    Args:
        log_prob: (B, T) log-probs of the taken tokens/actions under the current policy.
        old_log_prob: (B, T) log-probs under the behaviour policy (a constant).
        advantages: (B, T) or (B,) (one per row), a constant.
        mask: (B, T) bool or 0/1 float.
        lower_clip_ratio, upper_clip_ratio: eps_low in [0, 1) and eps_high >= 0.
        clip_ratio_c: dual-clip constant c > 1, or None.
        agg_mode, normalizer, horizon: see :func:`~ppokit.algo.aggregation.aggregate`.
        ratio_level: ``"token"``, ``"sequence"`` or ``"gspo"``.
        diagnostics: False returns only ``clipfrac``, ``approx_kl_k1``, ``approx_kl_k3``
            and ``ratio_max`` (what a training loop logs every step; each metric is a
            handful of tiny ops that cost more than the loss itself on small batches).

    Returns:
        ``(loss, metrics)``; metrics are detached 0-dim tensors (no host sync):
        ``clipfrac`` (fraction of valid positions where any clip zeroes the
        gradient), ``clipfrac_lower`` (A < 0, r < 1 - eps_low), ``clipfrac_upper``
        (A > 0, r > 1 + eps_high), ``clipfrac_dual`` (A < 0, r > c), ``ratio_mean``,
        ``ratio_max``, ``ratio_min`` -- over valid tokens (``token``, ``gspo``: a
        row's ratio counts once per valid token), or over rows with at least one
        valid token (``sequence``) -- and ``approx_kl_k1`` (mean of
        ``log pi_old - log pi``) and ``approx_kl_k3`` (mean of ``(r - 1) - log r``),
        always over valid tokens with token-level ratios.
    """
    check_loss_inputs(log_prob, old_log_prob, advantages, mask, agg_mode, ratio_level)
    check_clip_bounds(lower_clip_ratio, upper_clip_ratio)
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {clip_ratio_c}")
    m, token_log_ratio, ratio, adv, unit_mask = _ratio_inputs(log_prob, old_log_prob, advantages, mask, ratio_level)

    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - lower_clip_ratio, 1.0 + upper_clip_ratio)
    loss_per = torch.maximum(surr, surr_clipped)
    if clip_ratio_c is not None:
        dual = torch.minimum(loss_per, -adv * clip_ratio_c)
        loss_per = torch.where(adv < 0, dual, loss_per)

    if ratio_level == "sequence":
        loss_per = loss_per[:, None].expand_as(log_prob)  # (B, T)
    loss = aggregate(loss_per, m, agg_mode, normalizer=normalizer, horizon=horizon)
    metrics = _clip_metrics(
        ratio, adv, token_log_ratio, m, unit_mask, lower_clip_ratio, upper_clip_ratio, clip_ratio_c, diagnostics
    )
    return loss, metrics


@register_policy_loss(
    "penalty",
    "ppo_penalty",
    settings=lambda a, inputs: {"penalty_coef": inputs.penalty_coef, "ratio_level": a.ratio_level},
)
def ppo_penalty_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    horizon: int | None = None,
    diagnostics: bool = True,
    ratio_level: str = "token",
    penalty_coef: torch.Tensor | float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO with an adaptive KL penalty instead of clipping (the PPO paper's second variant).

    Per valid token, with ``beta = penalty_coef``::

        log r_t = clamp(log pi_t - log pi_old_t, -20, 20),   r_t = exp(log r_t)
        KL_t    = (r_t - 1) - log r_t
        L_t     = -A_t rho_t + beta * KL_t

    and the loss is ``aggregate(L, mask, agg_mode, normalizer=..., horizon=...)``.
    ``rho_t`` is the importance ratio at ``ratio_level`` (``token``: ``r_t``;
    ``sequence``: the row's ``prod_t r_t`` with the row's mean advantage; ``gspo``:
    the GSPO-token ratio, see :func:`policy_loss`); nothing is clipped. Update ``beta``
    between iterations with :class:`~ppokit.algo.kl.AdaptivePenaltyCoef` from the measured ``kl_old``.

    The penalty is always per token: ``KL_t`` is Schulman's k3 estimator of ``KL(pi_old || pi)``
    from tokens sampled by ``pi_old``. Since ``E_old[r - 1] = 0`` its mean is the unbiased k1
    estimate ``E_old[-log r]``, while each term is >= 0 (``x - 1 >= log x``) with far less
    variance than ``-log r``, so the penalty never rewards moving away. Its gradient
    ``d KL_t / d log pi_t = r_t - 1`` is 0 at the start of the update and pulls back as the
    policy moves.

    Args:
        log_prob, old_log_prob, advantages, mask, agg_mode, normalizer, horizon,
        ratio_level, diagnostics: as in :func:`policy_loss`.
        penalty_coef: ``beta >= 0``, a number or a 0-dim tensor (read without host sync).

    Returns:
        ``(loss, metrics)``; detached 0-dim tensors: ``kl_old`` (masked mean of
        ``KL_t`` over valid tokens: the measurement the adaptive coefficient wants;
        the same value as ``approx_kl_k3``), ``clipfrac`` (always 0: nothing is
        clipped), ``approx_kl_k1``, ``approx_kl_k3``, ``ratio_max`` and, with
        ``diagnostics``, ``ratio_mean`` and ``ratio_min`` (over valid tokens, or
        rows at sequence level).
    """
    check_loss_inputs(log_prob, old_log_prob, advantages, mask, agg_mode, ratio_level)
    _check_penalty_coef(penalty_coef)
    m, token_log_ratio, ratio, adv, unit_mask = _ratio_inputs(log_prob, old_log_prob, advantages, mask, ratio_level)

    surr = -adv * ratio  # (B, T) or (B,)
    if ratio_level == "sequence":
        surr = surr[:, None].expand_as(log_prob)  # (B, T)
    tlr = token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    kl = torch.expm1(tlr) - tlr  # (B, T) k3 of KL(pi_old || pi), >= 0
    loss = aggregate(surr + penalty_coef * kl, m, agg_mode, normalizer=normalizer, horizon=horizon)

    with torch.no_grad():
        r = ratio.detach()
        tlr = tlr.detach()
        kl_old = masked_mean(kl.detach(), m)
        metrics = {
            "kl_old": kl_old,
            "clipfrac": torch.zeros((), dtype=r.dtype, device=r.device),
            "approx_kl_k1": masked_mean(-tlr, m),
            "approx_kl_k3": kl_old,
            "ratio_max": _masked_extreme(r, unit_mask, largest=True),
        }
        if diagnostics:
            metrics["ratio_mean"] = masked_mean(r, unit_mask)
            metrics["ratio_min"] = _masked_extreme(r, unit_mask, largest=False)
    return loss, metrics
