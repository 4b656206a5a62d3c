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
``lower = 1/C`` is verl's rejection sampling with IS weights. MIS's weights are verl's
IcePop (``rollout_is_threshold: "lower_upper"``), whose dropped tokens stay in the
normaliser with weight 0 where ppokit's leave it.

Rejection rules (:data:`REJECTION_RULES`, verl's ``rollout_rs``; :func:`rollout_rejection`),
beside any weight and all of them required to pass. With ``l_t = clamp(log r_t, -20, 20)``
on the valid tokens::

    k1_t = -l_t          k2_t = l_t^2 / 2          k3_t = exp(l_t) - 1 - l_t  (>= 0)

    token_kK       token t kept if    k1: log L <= k1_t <= log U      k2, k3: kK_t <= U
    seq_sum_kK     row b kept if the same test holds for  sum_t m_t kK_t
    seq_mean_kK                                            sum_t m_t kK_t / sum_t m_t
    seq_max_kK     (K = 2, 3)                              max_t kK_t   (0 for an empty row)

A k1 band ``[L, U]`` bounds ``pi_engine / pi_old`` (of the token, of the response for
seq_sum, their geometric mean for seq_mean: verl's Geo-RS, ``0.999_1.001``); K3-RS is
``seq_mean_k3`` (``0.01``). A rejected token (every token of a rejected row) leaves the
actor's loss and its normaliser like a MIS-dropped one. verl's presets map to
``rollout_correction`` x ``rollout_correction_rs``: decoupled_token_is = tis/token;
decoupled_seq_is = tis/sequence; decoupled_seq_is_rs = tis/sequence + seq_sum_k1 0.5_2.0;
decoupled_geo_rs = none + seq_mean_k1 0.999_1.001; decoupled_k3_rs = none + seq_mean_k3
0.01; decoupled_k3_rs_token_tis = tis/token + seq_mean_k3; decoupled_geo_rs_seq_tis =
tis/sequence + seq_mean_k1. Bypass mode (``algo.rollout_correction_bypass``, verl's
``bypass_mode`` with ``loss_type: ppo_clip``): ``pi_old = pi_engine``, no weight (PPO's
ratio ``pi / pi_engine`` and its clip correct), the rules tested in each pass against
the current policy's log-probs (the normaliser keeps the rejected tokens, as verl's does).

Metrics of :func:`rollout_correction` (detached 0-dim tensors, no host sync; ``w`` the
weight before the rules, 0 where MIS drops, over the ``N`` valid tokens; verl's names in
brackets)::

    correction_weight_mean      mean of the final weight over the kept tokens
    correction_weight_max/_min  max / min of w          (rollout_is_max / _min, token level)
    correction_ess              (sum w)^2 / (N sum w^2), in (0, 1]   (rollout_is_eff_sample_size)
    correction_truncated_frac   tis: share of tokens with rho > C     (rollout_is_ratio_fraction_high)
    correction_masked_frac      share of tokens dropped, band and rules  (rollout_rs_masked_fraction)
    correction_seq_masked_frac  share of rows with a token that lose one (rollout_rs_seq_masked_fraction)
    correction_rs_<rule>_masked_frac / _mean / _max   each rule's drops and statistic (rollout_rs_<rule>_*)

:func:`mismatch_metrics` measures the gap every iteration, whatever the correction:
``mismatch_kl`` (the k3 estimate of KL(pi_engine || pi_old) per token: the mean of
``r - 1 - log r`` over tokens sampled from the engine, >= 0), ``mismatch_kl_k1`` (the
mean of ``-log r``, unbiased, may be negative), ``mismatch_ratio_max`` /
``mismatch_ratio_min`` (the extreme token ratios ``r``).
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


def rejection_statistic(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, rule: str
) -> torch.Tensor:
    """The statistic rule ``rule`` tests (module docstring): (B, T) per token for the token rules
    (0 on padding), (B,) per row for the others (0 for a row without a token)."""
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
    tokens) and ``_max`` (over the valid tokens or rows)."""
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
    """``(weight, keep, metrics)`` of correction ``mode`` and the rejection rules ``rejection``
    (module docstring), (B, T) float each, 0 on padding and on the dropped tokens. ``lower`` (MIS)
    defaults to ``1 / cap``. Metrics: the module docstring's list (the weight's only when
    ``mode`` weighs; the masked shares when MIS or a rule may drop)."""
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
