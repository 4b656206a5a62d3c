"""Advantage estimators.

All tensors are time-major per row: ``rewards``, ``values``, ``mask``, ``dones``
are (B, T). For language models a sequence-level reward sits on the last valid
(response) token of its row and ``mask`` marks the response tokens (possibly with
gaps: observation/tool tokens between turns).

Every estimator in :data:`ADVANTAGE_ESTIMATORS` has the same keyword-only
signature so a trainer can call any of them::

    fn(*, rewards, mask, values=None, group_ids=None, gamma=1.0, lam=1.0,
       dones=None, last_values=None, norm_by_std=True, batch_std=False, eps=1e-6, **_)
        -> (advantages (B, T), returns (B, T))

``group_ids`` (B,) is an integer tensor; rows with equal ids are samples of the
same prompt. Group statistics are computed with vectorised scatter operations.
"""

from __future__ import annotations

import torch

from .registry import Registry
from .stats import masked_sum, whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "compute_gae",
    "gae_advantages",
    "get_advantage_estimator",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
]

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


# ----------------------------------------------------------------------------- checks


def _check_bt(name: str, x: torch.Tensor | None, ref: torch.Tensor, ref_name: str = "rewards") -> None:
    if x is not None and x.shape != ref.shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} != {ref_name} shape {tuple(ref.shape)}")


def _check_rewards(rewards: torch.Tensor) -> None:
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 2-D (B, T) tensor, got {shape}")
    if not rewards.dtype.is_floating_point:
        raise ValueError(f"rewards must be floating point, got {rewards.dtype}")


def _check_unit(name: str, v: float) -> None:
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {v}")


def _bool(mask: torch.Tensor | None) -> torch.Tensor | None:
    if mask is None:
        return None
    return mask if mask.dtype == torch.bool else mask != 0


# ----------------------------------------------------------------------------- GAE


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    mask: torch.Tensor | None = None,
    dones: torch.Tensor | None = None,
    last_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al., 2016).

    Backward over t = T-1 .. 0, with ``d_t = dones[:, t]``::

        delta_t = r_t + gamma * V_next * (1 - d_t) - V_t
        A_t     = delta_t + gamma * lam * (1 - d_t) * A_next
        R_t     = A_t + V_t                     (the lambda-return, a value target)

    ``V_next`` / ``A_next`` are the value / advantage of the next *valid* position:
    positions with ``mask == 0`` are skipped, the recursion carries ``V_next`` and
    ``A_next`` through them unchanged (so a gap of observation tokens between two
    turns is bootstrapped across), and ``A`` and ``R`` are 0 there. ``dones`` at
    masked positions are ignored. After the last valid position (t = T-1 without a
    mask) ``V_next = last_values`` (B,) (default 0) and ``A_next = 0``.

    ``dones[b, t] = 1`` means the episode ended at step t (after the action at t):
    no bootstrap from t+1 and the running advantage resets.

    Computed in the (promoted) dtype of ``rewards`` and ``values``; a Python loop
    over T, vectorised over B. No whitening.

    Returns ``(advantages, returns)``, both (B, T).
    """
    _check_rewards(rewards)
    _check_bt("values", values, rewards)
    _check_bt("mask", mask, rewards)
    _check_bt("dones", dones, rewards)
    _check_unit("gamma", gamma)
    _check_unit("lam", lam)
    B, T = rewards.shape
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    r = rewards.to(dtype)  # (B, T)
    v = values.to(dtype)  # (B, T)
    m = _bool(mask)  # (B, T) bool or None
    if last_values is None:
        next_value = r.new_zeros(B)  # (B,)
    else:
        if last_values.shape != (B,):
            raise ValueError(f"last_values shape {tuple(last_values.shape)} != (B,) = ({B},)")
        next_value = last_values.to(dtype)
    nonterminal = None if dones is None else 1.0 - dones.to(dtype)  # (B, T)
    next_adv = r.new_zeros(B)  # (B,)
    zero = r.new_zeros(())
    advs: list[torch.Tensor] = []
    for t in range(T - 1, -1, -1):
        cont = 1.0 if nonterminal is None else nonterminal[:, t]  # (B,)
        delta = r[:, t] + gamma * next_value * cont - v[:, t]  # (B,)
        adv = delta + (gamma * lam) * cont * next_adv  # (B,)
        if m is None:
            next_adv, next_value = adv, v[:, t]
            advs.append(adv)
        else:
            valid = m[:, t]  # (B,)
            next_adv = torch.where(valid, adv, next_adv)
            next_value = torch.where(valid, v[:, t], next_value)
            advs.append(torch.where(valid, adv, zero))
    advantages = torch.stack(advs[::-1], dim=1) if T else r.new_zeros(B, 0)  # (B, T)
    returns = advantages + v
    if m is not None:
        returns = torch.where(m, returns, zero)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_advantages(
    *,
    rewards: torch.Tensor,
    mask: torch.Tensor | None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    dones: torch.Tensor | None = None,
    last_values: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE through the uniform estimator signature; see :func:`compute_gae`.

    Needs ``values`` (a critic).
    """
    if values is None:
        raise ValueError(
            "advantage estimator 'gae' needs values (a critic); use a critic-free estimator such as 'grpo'"
        )
    return compute_gae(rewards, values, gamma=gamma, lam=lam, mask=mask, dones=dones, last_values=last_values)


# ----------------------------------------------------------------------------- groups


def _sequence_scores(rewards: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``score_b = sum_t r_{b,t} m_{b,t}`` (B,)."""
    return masked_sum(rewards, mask, dim=-1)


def _group_index(group_ids: torch.Tensor | None, B: int, device: torch.device, who: str) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids (B,) to dense indices 0..G-1; returns (index (B,), G)."""
    if group_ids is None:
        raise ValueError(f"advantage estimator {who!r} needs group_ids (B,): the prompt each sample belongs to")
    group_ids = torch.as_tensor(group_ids, device=device)
    if group_ids.shape != (B,):
        raise ValueError(f"group_ids shape {tuple(group_ids.shape)} != (B,) = ({B},)")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, uniq.numel()


def _group_sum(x: torch.Tensor, index: torch.Tensor, G: int) -> torch.Tensor:
    """``S_g = sum_{b: index_b = g} x_b`` (G,)."""
    return x.new_zeros(G).index_add(0, index, x)


def _broadcast_to_tokens(adv: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(B,) -> (B, T), zero outside the mask."""
    out = adv[:, None].expand_as(rewards)  # (B, T)
    m = _bool(mask)
    if m is None:
        return out.clone()
    return torch.where(m, out, out.new_zeros(()))


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    *,
    rewards: torch.Tensor,
    mask: torch.Tensor | None,
    group_ids: torch.Tensor | None = None,
    norm_by_std: bool = True,
    batch_std: bool = False,
    eps: float = 1e-6,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Relative Policy Optimization (Shao et al., 2024) outcome advantages.

    ``s_b = sum_t r_{b,t} m_{b,t}``; for the group g of b with n_g samples,
    mean ``mu_g`` and unbiased std ``sigma_g``; ``sigma`` the unbiased std of all B scores::

        A_b = (s_b - mu_g) / (sigma_g + eps)     norm_by_std=True
        A_b = (s_b - mu_g) / (sigma + eps)       norm_by_std=True, batch_std=True (TRL's
                                                 scale_rewards="batch", after Lite PPO)
        A_b =  s_b - mu_g                        norm_by_std=False (Dr. GRPO)

    With the group's std every group that varies is scaled to unit spread (three wins and a
    loss give the loss -1.5, as two and two give each -0.87); with the batch's std the groups
    keep their spreads relative to each other (one scale for all).
    Single-sample groups get ``A_b = 0``. ``A_b`` is broadcast onto the valid
    tokens of row b; ``returns = advantages``.
    """
    _check_rewards(rewards)
    _check_bt("mask", mask, rewards)
    B = rewards.shape[0]
    index, G = _group_index(group_ids, B, rewards.device, "grpo")
    score = _sequence_scores(rewards, mask)  # (B,)
    count = _group_sum(torch.ones_like(score), index, G)  # (G,)
    mean = _group_sum(score, index, G) / count  # (G,)
    centered = score - mean[index]  # (B,), exactly 0 for single-sample groups
    if norm_by_std and batch_std:
        spread = score.std() if B > 1 else score.new_zeros(())  # unbiased, over all B scores
        centered = centered / (spread + eps)
    elif norm_by_std:
        var = _group_sum(centered**2, index, G) / (count - 1).clamp(min=1)  # (G,), 0 if n_g = 1
        centered = centered / (var.sqrt()[index] + eps)
    adv = _broadcast_to_tokens(centered, rewards, mask)  # (B, T)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(
    *,
    rewards: torch.Tensor,
    mask: torch.Tensor | None,
    group_ids: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Kool et al., 2019; Ahmadian et al., 2024).

    ``A_b = s_b - (S_g - s_b) / (n_g - 1)``: the score minus the mean score of the
    *other* samples of its group (``S_g`` = group sum). Single-sample groups get
    0. Broadcast onto the valid tokens; ``returns = advantages``.
    """
    _check_rewards(rewards)
    _check_bt("mask", mask, rewards)
    B = rewards.shape[0]
    index, G = _group_index(group_ids, B, rewards.device, "rloo")
    score = _sequence_scores(rewards, mask)  # (B,)
    count = _group_sum(torch.ones_like(score), index, G)[index]  # (B,) n_g per row
    others_mean = (_group_sum(score, index, G)[index] - score) / (count - 1).clamp(min=1)  # (B,)
    adv_b = torch.where(count > 1, score - others_mean, torch.zeros_like(score))
    adv = _broadcast_to_tokens(adv_b, rewards, mask)
    return adv, adv


@ADVANTAGE_ESTIMATORS.register("reinforce_pp", "reinforce_plus_plus")
def reinforce_pp_advantages(
    *,
    rewards: torch.Tensor,
    mask: torch.Tensor | None,
    gamma: float = 1.0,
    dones: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025): whitened token-level discounted returns.

    Backward over t: ``G_t = m_t * (r_t + gamma * (1 - d_t) * G_{t+1})``, ``G_T = 0``:
    the return restarts (is reset to 0) at every masked position (after EOS,
    between sequences or turns) and, if ``dones`` is given, after a done step.
    ``advantages = whiten(G, mask)`` over the whole batch (needs >= 2 valid
    tokens); ``returns = G`` (not whitened, 0 outside the mask).
    """
    _check_rewards(rewards)
    _check_bt("mask", mask, rewards)
    _check_bt("dones", dones, rewards)
    _check_unit("gamma", gamma)
    B, T = rewards.shape
    m = _bool(mask)
    nonterminal = None if dones is None else 1.0 - dones.to(rewards.dtype)
    running = rewards.new_zeros(B)  # (B,)
    zero = rewards.new_zeros(())
    out: list[torch.Tensor] = []
    for t in range(T - 1, -1, -1):
        cont = 1.0 if nonterminal is None else nonterminal[:, t]
        running = rewards[:, t] + gamma * cont * running  # (B,)
        if m is not None:
            running = torch.where(m[:, t], running, zero)
        out.append(running)
    returns = torch.stack(out[::-1], dim=1) if T else rewards.new_zeros(B, 0)  # (B, T)
    return whiten(returns, m), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline", "reinforce_plus_plus_baseline")
def reinforce_pp_baseline_advantages(
    *,
    rewards: torch.Tensor,
    mask: torch.Tensor | None,
    group_ids: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline.

    ``A_b = s_b - mu_g`` broadcast onto the valid tokens, then whitened over the
    mask across the whole batch: ``advantages = whiten(A, mask)``;
    ``returns = advantages``.
    """
    _check_rewards(rewards)
    _check_bt("mask", mask, rewards)
    B = rewards.shape[0]
    index, G = _group_index(group_ids, B, rewards.device, "reinforce_pp_baseline")
    score = _sequence_scores(rewards, mask)  # (B,)
    count = _group_sum(torch.ones_like(score), index, G)  # (G,)
    centered = score - (_group_sum(score, index, G) / count)[index]  # (B,)
    adv = whiten(_broadcast_to_tokens(centered, rewards, mask), _bool(mask))
    return adv, adv


def get_advantage_estimator(name: str):
    """The estimator registered as ``name``; raises UnknownNameError with a hint."""
    return ADVANTAGE_ESTIMATORS.get(name)
