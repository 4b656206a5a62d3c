"""Scoring a rollout: old log-probs, reference log-probs, values and token rewards.

:class:`Scorer` runs the forward passes PPO needs before an update, in chunks of
``train.infer_micro_batch_size`` sequences, under no_grad::

    old_log_prob  (N, R)  actor, sampling temperature applied, under the same autocast
                          and through the same code as the update's forward: the first
                          importance ratio of an update is exactly 1
    ref_log_prob  (N, R)  reference: the backbone with adapters disabled (lora) or the
                          frozen copy (full mode; only loaded when a KL term needs it)
    ref_log_prob_metric (K, R)  without a KL term, in lora mode: the reference log-probs
                          of the first K = ``metric_rows`` sequences only, for the
                          ``kl_ref`` metric (a third of the scoring work saved; the
                          prompts are shuffled, so the K rows are a random sample)
    old_values    (N, R)  critic: V(state before response token t)

Without ``need_old_log_prob`` the actor pass is skipped and ``old_log_prob`` left out:
for an update that is fully on-policy (one epoch, one mini-batch: see
:mod:`ppokit.trainer`) whose rewards carry no KL term, the update's own forward pass
computes the same log-probs. That saves one of the three passes; a GRPO-style run
without a critic or a KL term is left with the reference on the ``metric_rows`` sample.

:func:`token_rewards` puts each sequence's reward on its last real response token
(the EOS, or the last token of a truncated response; never on padding) and, with
``algo.use_kl_in_reward``, subtracts ``kl_coef * KL_t`` on every response token, the
coefficient coming from a fixed or adaptive controller (:mod:`ppokit.algo.kl`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ppokit import algo
from ppokit.lm.rollout import RolloutBatch


class Scorer:
    """``score(rollout) -> {["old_log_prob"], "old_values", ["ref_log_prob" | "ref_log_prob_metric"]}``."""

    def __init__(self, policy, infer_micro_batch_size: int, *, need_reference: bool,
                 metric_rows: Optional[int] = None, need_old_log_prob: bool = True):
        self.policy = policy
        self.chunk = infer_micro_batch_size
        self.need_old_log_prob = need_old_log_prob
        self.need_reference = need_reference and policy.has_reference
        # no KL term: reference log-probs of a few rows only, for the kl_ref metric
        self.metric_rows = metric_rows if policy.has_reference and not self.need_reference else None

    @torch.no_grad()
    def score(self, rollout: RolloutBatch) -> dict[str, Tensor]:
        tensors = rollout.tensors()
        n = len(rollout)
        parts: dict[str, list[Tensor]] = {"old_values": []}
        if self.need_old_log_prob:
            parts["old_log_prob"] = []
        if self.need_reference:
            parts["ref_log_prob"] = []
        for s in range(0, n, self.chunk):
            mb = {k: v[s:s + self.chunk] for k, v in tensors.items()}
            if self.need_old_log_prob:
                parts["old_log_prob"].append(self.policy.log_probs(mb)["log_prob"])
            parts["old_values"].append(self.policy.values(mb))
            if self.need_reference:
                parts["ref_log_prob"].append(self.policy.ref_log_probs(mb))
        mask = rollout.mask
        out = {k: torch.cat(v) * mask for k, v in parts.items()}   # zeros on padding
        if self.metric_rows:
            k = min(self.metric_rows, n)
            out["ref_log_prob_metric"] = self.policy.ref_log_probs(
                {key: v[:k] for key, v in tensors.items()}) * mask[:k]               # (K, R)
        return out


def last_token_index(mask: Tensor) -> Tensor:
    """(N,) index of the last real response token of each row (mask is 1 on a prefix)."""
    return (mask.sum(1).long() - 1).clamp(min=0)


def token_rewards(scores: Tensor, mask: Tensor, *, kl: Optional[Tensor] = None, kl_coef: float = 0.0) -> Tensor:
    """(N, R) token rewards: ``scores`` (N,) on the last real token, minus ``kl_coef * kl`` (N, R)."""
    rewards = torch.zeros_like(mask, dtype=torch.float32)
    rows = torch.arange(mask.shape[0], device=mask.device)
    has_token = mask.sum(1) > 0
    rewards[rows[has_token], last_token_index(mask)[has_token]] = scores.float().to(mask.device)[has_token]
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    return rewards


def kl_to_reference(log_prob: Tensor, ref_log_prob: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """(N, R) per-token KL estimate, 0 on padding."""
    return algo.kl_penalty(log_prob, ref_log_prob, estimator) * mask
