"""Rollout correction: the rollout engine's sampling distribution against the trainer's.

The engine samples with its own numerics (bf16 weights with the adapter folded in, its own kernels,
top-k/top-p), so the update is off-policy by ``r_t = pi_old(y_t) / pi_engine(y_t)`` before PPO's
ratio ``pi / pi_old`` starts (the decoupled PPO objective, as in verl's rollout correction).

- :func:`correction_ratio`: ``rho``, per token or per row (the product or geometric mean of ``r_t``).
- :data:`ROLLOUT_CORRECTIONS`: ``none`` (``w = 1``), ``tis`` (``w = min(rho, C)``), ``mis`` (``w = rho``,
  tokens with ``rho`` outside ``[lower, C]`` dropped).
- :func:`rollout_rejection` (:data:`REJECTION_RULES`, verl's ``rollout_rs``): drops tokens or rows
  whose k1/k2/k3 divergence (:func:`rejection_statistic`) leaves its bound.
- :func:`rollout_correction`: a correction and the rules together, ``(weight, keep, metrics)``.
- :func:`mismatch_metrics`: the gap itself, logged every iteration whatever the correction.

The trainer multiplies each token's advantage by ``weight``: for PPO's clip with ``w > 0`` that is the
loss times ``w``, ``w max(-A r, -A clip(r)) = max(-(wA) r, -(wA) clip(r))``. Tokens with ``keep = 0``
leave the actor's terms and their normaliser. Options, verl's and TRL's presets, bypass mode:
docs/algorithms.md, "Rollout correction".
"""

from __future__ import annotations

import math

import torch

from .registry import Registry
from .stats import masked_mean, masked_sum

__all__ = [
    "CORRECTION_LEVELS",
    "REJECTION_RULES",
    "ROLLOUT_CORRECTIONS",
    "correction_ratio",
    "mismatch_metrics",
    "rejection_statistic",
    "rollout_correction",
    "rollout_rejection",
]

ROLLOUT_CORRECTIONS: Registry = Registry("rollout correction")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
LOG_RATIO_BOUND = 20.0  # exp(+-20): the ratio stays finite whatever the log-probs (verl's safety bound)
# verl's rollout_rs rules (ppokit.config.REJECTION_RULE_NAMES names the same)
REJECTION_RULES = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
# a rule with its bounds: (name, lower, upper); lower is a k1 band's (a ratio), None for k2/k3
RejectionRule = tuple[str, float | None, float]


def _log_ratio(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(B, T) ``log pi_old - log pi_engine``, 0 where ``m`` is False (padding may hold anything)."""
    return torch.where(m, old_log_prob - rollout_log_prob, torch.zeros((), dtype=old_log_prob.dtype))


def correction_ratio(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """(B, T) ``rho`` at ``level``, 1 on padding. With ``l_t = log pi_old(y_t) - log pi_engine(y_t)``
    and the mask ``m``::

        token      rho_t = exp(clamp(l_t, -20, 20))
        sequence   rho_b = exp(clamp(sum_t m_t l_t, -20, 20))                      (the product of ratios)
        geometric  rho_b = exp(clamp(sum_t m_t l_t / max(sum_t m_t, 1), -20, 20))   (their geometric mean)

    A row's ``rho_b`` is put on every token of the row."""
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


def rejection_statistic(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, rule: str
) -> torch.Tensor:
    """The statistic rule ``rule`` tests: (B, T) per token for the token rules (0 on padding), (B,)
    per row for the others (0 for a row without a token). With ``l_t = clamp(log r_t, -20, 20)`` on
    the valid tokens (``r_t = pi_old / pi_engine``)::

        k1_t = -l_t          k2_t = l_t^2 / 2          k3_t = exp(l_t) - 1 - l_t  (>= 0)

        token_kK       kK_t
        seq_sum_kK     sum_t m_t kK_t
        seq_mean_kK    sum_t m_t kK_t / sum_t m_t
        seq_max_kK     max_t kK_t   (K = 2, 3; 0 for an empty row)"""
    if rule not in REJECTION_RULES:
        raise ValueError(f"unknown rejection rule {rule!r}; valid: {', '.join(REJECTION_RULES)}")
    _check(old_log_prob, rollout_log_prob, mask)
    m = mask != 0
    log_r = _log_ratio(old_log_prob, rollout_log_prob, m).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    kind = rule[-2:]
    if kind == "k1":
        per_token = -log_r
    elif kind == "k2":
        per_token = 0.5 * log_r.square()
    else:
        per_token = torch.expm1(log_r) - log_r
    per_token = torch.where(m, per_token, torch.zeros((), dtype=per_token.dtype))  # (B, T)
    if rule.startswith("token_"):
        return per_token
    if rule.startswith("seq_sum_"):
        return per_token.sum(-1)
    if rule.startswith("seq_mean_"):
        return masked_mean(per_token, m, dim=-1)
    return torch.where(m, per_token, -torch.inf).amax(-1).clamp(min=0.0)  # seq_max: k2, k3 >= 0


def rollout_rejection(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    rules: tuple[RejectionRule, ...] | list[RejectionRule],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(keep, metrics)``: (B, T) float, 1 where every rule of ``rules`` (``(name, lower, upper)``,
    as :func:`ppokit.config.parse_rejection_rules` gives them) keeps the token, 0 where one
    rejects it and on padding; per rule ``correction_rs_<rule>_masked_frac`` (share of the valid
    tokens it drops), ``_mean`` (its statistic over the valid tokens, a row's value on each of its
    tokens) and ``_max`` (over the valid tokens or rows).

    A k1 rule with the band ``[L, U]`` keeps where ``log L <= k1 <= log U``: it bounds
    ``pi_engine / pi_old`` of the token, of the response (seq_sum) or their geometric mean (seq_mean,
    verl's Geo-RS). A k2 or k3 rule keeps where its statistic is ``<= U`` (K3-RS is ``seq_mean_k3``).
    A row rule's verdict holds for every token of the row."""
    m = mask != 0
    keep = m.clone()
    metrics: dict[str, torch.Tensor] = {}
    has_row = m.any(-1)  # (B,)
    for name, lower, upper in rules:
        stat = rejection_statistic(old_log_prob, rollout_log_prob, mask, name)  # (B, T) or (B,)
        if name.endswith("k1"):
            if lower is None or not 0 < lower <= upper:
                raise ValueError(f"rejection rule {name} needs a ratio band 0 < lower <= upper, got {lower}, {upper}")
            passed = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            passed = stat <= upper
        per_token = passed if stat.dim() == 2 else passed[:, None].expand_as(m)  # (B, T)
        keep &= per_token
        with torch.no_grad():
            token_stat = stat if stat.dim() == 2 else stat[:, None].expand_as(m)
            valid = m if stat.dim() == 2 else has_row  # the tokens, or the rows with a token
            prefix = f"correction_rs_{name}"
            metrics[f"{prefix}_masked_frac"] = masked_mean((~per_token).to(old_log_prob.dtype), m)
            metrics[f"{prefix}_mean"] = masked_mean(token_stat, m)
            metrics[f"{prefix}_max"] = torch.where(
                valid.any(), torch.where(valid, stat, -torch.inf).amax(), torch.zeros((), dtype=stat.dtype)
            )
    return keep.to(old_log_prob.dtype), metrics


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "none",
    level: str = "token",
    cap: float = 2.0,
    lower: float | None = None,
    rejection: tuple[RejectionRule, ...] | list[RejectionRule] = (),
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(weight, keep, metrics)`` of correction ``mode`` (:data:`ROLLOUT_CORRECTIONS`) and the
    rejection rules ``rejection`` (:func:`rollout_rejection`), (B, T) float each, 0 on padding and on
    the dropped tokens. ``lower`` (MIS) defaults to ``1 / cap``.

    Metrics: detached 0-dim tensors, no host sync; ``w`` is the weight before the rules (0 where MIS
    drops) over the ``N`` valid tokens; verl's names in brackets::

        correction_weight_mean      mean of the final weight over the kept tokens
        correction_weight_max/_min  max / min of w                          (rollout_is_max / _min)
        correction_ess              (sum w)^2 / (N sum w^2), in (0, 1]      (rollout_is_eff_sample_size)
        correction_truncated_frac   tis: share of tokens with rho > C       (rollout_is_ratio_fraction_high)
        correction_masked_frac      share of tokens dropped, band and rules (rollout_rs_masked_fraction)
        correction_seq_masked_frac  share of rows that lose a token        (rollout_rs_seq_masked_fraction)
        correction_rs_<rule>_*      each rule's, from :func:`rollout_rejection`

    The weight's metrics only when ``mode`` weighs; the masked shares when MIS or a rule may drop."""
    fn = ROLLOUT_CORRECTIONS.get(mode)
    if not cap >= 1.0:
        raise ValueError(f"the rollout correction cap must be >= 1, got {cap}")
    lower = 1.0 / cap if lower is None else lower
    if not 0.0 <= lower <= 1.0:
        raise ValueError(f"the lower bound of the MIS band must be in [0, 1], got {lower}")
    rho = correction_ratio(old_log_prob, rollout_log_prob, mask, level)  # (B, T)
    weight, keep = fn(rho, mask, cap=cap, lower=lower)  # (B, T) each
    is_weight = weight
    m = mask != 0
    metrics: dict[str, torch.Tensor] = {}
    if rejection:
        rs_keep, metrics = rollout_rejection(old_log_prob, rollout_log_prob, mask, rejection)
        keep = keep * rs_keep
        weight = weight * rs_keep
    dtype = rho.dtype
    with torch.no_grad():
        metrics["correction_weight_mean"] = masked_mean(weight, keep != 0)
        if mode != "none":
            any_token = m.any()
            zero = torch.zeros((), dtype=dtype, device=rho.device)
            metrics["correction_weight_max"] = torch.where(
                any_token, torch.where(m, is_weight, -torch.inf).amax(), zero
            )
            metrics["correction_weight_min"] = torch.where(any_token, torch.where(m, is_weight, torch.inf).amin(), zero)
            # (sum w)^2 / (N sum w^2) = mean(w)^2 / mean(w^2): 1 for equal weights, 0 without any weight
            mean_w, mean_w2 = masked_mean(is_weight, m), masked_mean(is_weight.square(), m)
            metrics["correction_ess"] = torch.where(mean_w2 > 0, mean_w.square() / mean_w2.clamp(min=1e-30), zero)
        if mode == "tis":
            metrics["correction_truncated_frac"] = masked_mean((rho > cap).to(dtype), m)
        if mode == "mis" or rejection:
            dropped = (keep == 0) & m  # (B, T)
            metrics["correction_masked_frac"] = masked_mean(dropped.to(dtype), m)
            has_row = m.any(-1)  # (B,)
            metrics["correction_seq_masked_frac"] = masked_mean(dropped.any(-1).to(dtype), has_row)
    return weight.detach(), keep.detach(), metrics


@torch.no_grad()
def mismatch_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The gap between the engine's log-probs and the trainer's on the sampled tokens, with
    ``r = pi_old / pi_engine``: ``mismatch_kl`` (the k3 estimate of KL(pi_engine || pi_old) per token,
    the mean of ``r - 1 - log r`` over tokens sampled from the engine, >= 0), ``mismatch_kl_k1`` (the
    mean of ``-log r``: unbiased, may be negative), ``mismatch_ratio_max`` and ``mismatch_ratio_min``
    (the extreme token ratios). 0-dim tensors (0, 0, 1, 1 without any valid token)."""
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
