"""Scoring a rollout: old log-probs, reference log-probs, values and token rewards.

:class:`Scorer` (the run loop's :class:`ppokit.components.Scorer`) runs the passes PPO needs before an
update, under no_grad, in chunks of ``train.infer_micro_batch_size`` rows (or of a token budget,
``train.micro_batch_tokens``: :mod:`ppokit.algo.batching`)::

    old_log_prob         (N, R)  actor, under the same autocast and code as the update's forward,
                                 so the first importance ratio of an update is exactly 1
    ref_log_prob         (N, R)  reference: the backbone without adapters (lora) or the frozen copy
    ref_log_prob_metric  (K, R)  lora without a KL term: the first K = ``metric_rows`` rows, for ``kl_ref``
    old_values           (N, R)  critic: V(state before response token t)

The actor pass is skipped in bypass mode (``old_log_prob`` = the engine's ``rollout_log_prob``) and
for a fully on-policy update with no KL in the reward, whose own forward computes the same log-probs
(:mod:`ppokit.trainer`). :func:`token_rewards` puts each sequence's reward on its last real response
token, minus ``kl_coef * KL_t`` per token with ``algo.use_kl_in_reward`` (:mod:`ppokit.algo.kl`).
Multi-turn batches come with their rewards placed (:func:`placed_rewards`: the penalty on action tokens
only); truncated trajectories bootstrap from :meth:`Scorer.bootstrap_values`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from ppokit import algo
from ppokit.components import SEQUENCE_INPUTS, Batch
from ppokit.errors import UserError


@torch.no_grad()
def behaviour_log_probs(policy, tensors: dict[str, Tensor], chunk: int) -> Tensor:
    """(N, R) log-probs of the sampled tokens under ``policy``'s weights now, 0 where ``mask`` is 0:
    the behaviour log-probs of a rollout collected ahead of its update (``rollout.off_policy_steps``),
    in the scorer's numerics, ``chunk`` rows a pass."""
    n = tensors["mask"].shape[0]
    inputs = {k: tensors[k] for k in SEQUENCE_INPUTS}
    parts = [policy.log_probs({k: v[s : s + chunk] for k, v in inputs.items()})["log_prob"] for s in range(0, n, chunk)]
    return torch.cat(parts).float() * tensors["mask"]


class Scorer:
    """``score(batch)``: adds ``old_values``, ``old_log_prob`` (unless the update computes it),
    ``ref_log_prob`` (with a KL term; else ``extras["ref_log_prob_metric"]`` of the first
    ``metric_rows`` sequences) and the token ``rewards`` from the sequence ``scores``, minus
    ``kl_coef * KL_t`` when ``kl_ctrl`` puts the KL into the reward.

    ``KL_t`` is a per-token estimator, or with ``algo.kl_penalty: full`` the exact KL over the
    vocabulary. The adaptive controller's input is verl's: the mean over sequences of each
    sequence's mean KL per token (:func:`ppokit.algo.mean_sequence_kl`), so
    ``algo.kl_ctrl.target_kl`` is a KL per token. Without a KL term the reference runs on the first
    ``metric_rows`` rows only (a third of the scoring work saved; the prompts are shuffled, so they
    are a random sample): a fully on-policy GRPO-style run without a critic or a KL term scores that
    sample alone."""

    def __init__(
        self,
        policy,
        infer_micro_batch_size: int,
        *,
        need_reference: bool,
        metric_rows: int | None = None,
        need_old_log_prob: bool = True,
        bypass: bool = False,
        kl_ctrl=None,
        kl_penalty: str = "kl",
        micro_batch_tokens: int | None = None,
    ):
        self.policy = policy
        self.chunk = infer_micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.bypass = bypass  # algo.rollout_correction_bypass: old_log_prob = the engine's rollout_log_prob
        self.need_old_log_prob = (need_old_log_prob or kl_ctrl is not None) and not bypass
        self.need_reference = (need_reference or kl_ctrl is not None) and policy.has_reference
        # no KL term: reference log-probs of a few rows only, for the kl_ref metric
        self.metric_rows = metric_rows if policy.has_reference and not self.need_reference else None
        self.kl_ctrl, self.kl_penalty = kl_ctrl, kl_penalty

    def score(self, batch: Batch) -> None:
        start = time.perf_counter()
        t = batch.tensors
        if self.bypass:  # bypass mode: the engine's behaviour log-probs are pi_old, no actor pass
            if "rollout_log_prob" not in t:
                raise UserError(
                    "algo.rollout_correction_bypass needs the engine's behaviour log-probs (rollout_log_prob), "
                    "which this batch lacks: set algo.rollout_correction_bypass=false"
                )
            t["old_log_prob"] = t["rollout_log_prob"]
        # a rollout that ran ahead of the update brings its behaviour policy's old_log_prob
        inputs = {k: t[k] for k in (*SEQUENCE_INPUTS, "mask")}
        scored = self.forward_passes(inputs, old_log_prob="old_log_prob" not in t)
        if "ref_log_prob_metric" in scored:  # (K, R): not per sample
            batch.extras["ref_log_prob_metric"] = scored.pop("ref_log_prob_metric")
        t.update(scored)
        mask = t["mask"]
        kl = None
        if self.kl_ctrl is not None:
            kl = (
                t.pop("kl_full") * mask
                if self.kl_penalty == "full"
                else kl_to_reference(t["old_log_prob"], t["ref_log_prob"], mask, self.kl_penalty)
            )  # (N, R)
        kl_coef = self.kl_ctrl.value if kl is not None else 0.0
        if "token_scores" in t:  # multi-turn: each turn's reward is already on its last action token
            t["rewards"] = placed_rewards(t["token_scores"], mask, kl=kl, kl_coef=kl_coef)
        else:
            t["rewards"] = token_rewards(t["scores"], mask, kl=kl, kl_coef=kl_coef)
        if "traj_truncated" in batch.extras:  # multi-turn: the values truncated trajectories bootstrap from
            batch.extras["last_values"] = self.bootstrap_values(batch.extras)
        if kl is not None:
            # verl's controller input: each sequence's mean KL per token, averaged over the batch
            reward_kl = algo.mean_sequence_kl(kl, mask).item()
            batch.metrics.update(kl_coef=self.kl_ctrl.value, reward_kl=reward_kl)
            self.kl_ctrl.update(reward_kl, len(batch))
        batch.metrics["score_tokens_per_s"] = float(t["attention_mask"].sum()) / max(time.perf_counter() - start, 1e-9)

    def state_dict(self) -> dict[str, Any]:
        return {"kl_ctrl": self.kl_ctrl.state_dict()} if self.kl_ctrl is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.kl_ctrl is not None:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])

    @torch.no_grad()
    def bootstrap_values(self, extras: dict[str, Tensor]) -> Tensor:
        """(E,) float32: the critic's value of each truncated trajectory's next prompt
        (``bootstrap_input_ids`` / ``bootstrap_attention_mask`` (B, L), ``bootstrap_traj`` (B,)),
        0 for the trajectories that do not bootstrap. The value of a prompt is read where
        a response's first token would be, as for every row's first action token."""
        E = extras["traj_truncated"].shape[0]
        out = torch.zeros(E, dtype=torch.float32, device=extras["traj_truncated"].device)
        if "bootstrap_input_ids" not in extras or not self.policy.has_critic:
            return out
        ids, am = extras["bootstrap_input_ids"], extras["bootstrap_attention_mask"]
        pad = torch.zeros_like(ids[:, :1])  # (B, 1) a response slot, never attended
        values = []
        for s in range(0, ids.shape[0], self.chunk):
            attention = torch.cat([am[s : s + self.chunk], pad[s : s + self.chunk]], 1)  # (b, L + 1)
            mb = {
                "input_ids": torch.cat([ids[s : s + self.chunk], pad[s : s + self.chunk]], 1),
                "attention_mask": attention,
                "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
                "responses": pad[s : s + self.chunk],
            }
            values.append(self.policy.values(mb)[:, 0])
        out[extras["bootstrap_traj"]] = torch.cat(values).float()
        return out

    @torch.no_grad()
    def forward_passes(self, tensors: dict[str, Tensor], old_log_prob: bool = True) -> dict[str, Tensor]:
        """The passes on a rollout's tensors (``input_ids``, ..., ``mask``), each (N, R) and 0 on
        padding; ``old_log_prob=False``: not the actor's (a rollout that ran ahead has them)."""
        need_old = self.need_old_log_prob and old_log_prob
        mask = tensors["mask"]
        names = (
            ["old_values"]
            + (["old_log_prob"] if need_old else [])
            + (["ref_log_prob"] if self.need_reference else [])
            + (["kl_full"] if self.kl_ctrl is not None and self.kl_penalty == "full" else [])
        )
        out = {k: torch.zeros(mask.shape, dtype=torch.float32, device=mask.device) for k in names}  # (N, R)
        inputs = {k: tensors[k] for k in SEQUENCE_INPUTS}
        n = mask.shape[0]
        for rows in algo.micro_batch_indices(tensors, self.chunk, self.micro_batch_tokens):
            if isinstance(rows, slice):  # rows in order: a view of the batch
                mb = {k: v[rows] for k, v in inputs.items()}
            else:  # rows of similar length, cut to their longest
                rows = rows.to(mask.device)
                mb = self.policy.compact({k: v[rows] for k, v in inputs.items()})
            width = mb["responses"].shape[1]
            if need_old:
                out["old_log_prob"][rows, :width] = self.policy.log_probs(mb)["log_prob"].float()
            out["old_values"][rows, :width] = self.policy.values(mb).float()
            if self.need_reference:
                out["ref_log_prob"][rows, :width] = self.policy.ref_log_probs(mb).float()
            if "kl_full" in out:
                out["kl_full"][rows, :width] = self.policy.kl_to_reference(mb).float()
        out = {k: v * mask for k, v in out.items()}  # zeros on padding
        if self.metric_rows:
            k = min(self.metric_rows, n)
            out["ref_log_prob_metric"] = (
                self.policy.ref_log_probs({key: v[:k] for key, v in inputs.items()}) * mask[:k]
            )  # (K, R)
        return out


def last_token_index(mask: Tensor) -> Tensor:
    """(N,) index of the last real response token of each row (mask is 1 on a prefix)."""
    return (mask.sum(1).long() - 1).clamp(min=0)


def token_rewards(scores: Tensor, mask: Tensor, *, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """(N, R) token rewards: ``scores`` (N,) on the last real token, minus ``kl_coef * kl`` (N, R)."""
    rewards = torch.zeros_like(mask, dtype=torch.float32)
    rows = torch.arange(mask.shape[0], device=mask.device)
    has_token = mask.sum(1) > 0
    rewards[rows[has_token], last_token_index(mask)[has_token]] = scores.float().to(mask.device)[has_token]
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    return rewards


def placed_rewards(token_scores: Tensor, mask: Tensor, *, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """(N, R) token rewards from rewards already placed on tokens (multi-turn: each turn's on its
    last action token), minus ``kl_coef * kl`` on the action tokens."""
    rewards = token_scores.float() * mask
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    return rewards


def kl_ref_metric(old_log_prob: Tensor, ref_log_prob: Tensor, mask: Tensor) -> float:
    """The ``kl_ref`` metric: the mean over sequences of ``sum_t (old - ref)`` (k1), over the rows
    ``ref_log_prob`` (K, R) has (all N, or the first K for the metric alone)."""
    k = ref_log_prob.shape[0]
    return ((old_log_prob[:k] - ref_log_prob) * mask[:k]).sum(1).mean().item()


def kl_to_reference(log_prob: Tensor, ref_log_prob: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """(N, R) per-token KL estimate, 0 on padding."""
    return algo.kl_penalty(log_prob, ref_log_prob, estimator) * mask
