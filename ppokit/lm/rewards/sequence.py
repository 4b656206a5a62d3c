"""The sequence reward of each response of a rollout: sources, weights, shaping, failures.

:class:`SequenceRewards` turns a rollout into one reward per response, (N,) float32::

    sources     verifier       data.reward (or the task's own) through the reward pool:
                               a raise, a hang or a bad value gives data.reward_on_error
                reward_model   data.reward_model's score
                format         1 where data.shaping.format_pattern is found in the response
    combine     r = sum_s w_s r_s            (verifier_weight, reward_model_weight, format_weight)
    overlong    r += DAPO's soft overlong punishment over the last overlong_cache_length tokens
    truncation  r -= truncation_penalty for a response cut off without EOS
    clip        r = clamp(r, clip_min, clip_max)
    normalize   batch: (r - mean) / std; running: r / running std (state in checkpoints)

(:mod:`ppokit.lm.rewards.shaping` has the formulas.) Every step that is configured is
logged: each source's mean (``reward/<source>_mean``), the penalties' means and the
share they hit, the share clipped, the running std. Reward-function failures are
counted (``reward_errors``, ``reward_errors/<kind>``) and marked on each sample; the run
stops with a one-line :class:`~ppokit.errors.UserError` when they exceed
``data.max_reward_errors``: a count (>= 1) over the whole run (kept in checkpoints), or
a fraction (< 1) of one batch.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from ppokit.errors import UserError
from ppokit.lm.rewards.pool import check_error_limit
from ppokit.lm.rewards.shaping import (
    RunningRewardScaler,
    clip_rewards,
    combine_rewards,
    format_score,
    normalize_batch,
    overlong_penalty,
    truncation_penalty,
)


class SequenceRewards:
    """Rewards of a rollout's responses (module docstring). ``verifier``: a scorer with
    ``score(prompts, texts, items) -> RewardResults`` (:mod:`ppokit.lm.rewards.pool`) or None;
    ``reward_model``: a :class:`~ppokit.lm.rewards.reward_model.RewardModel` or None."""

    def __init__(self, data_cfg, max_new_tokens: int, *, verifier=None, reward_model=None) -> None:
        self.cfg, self.shaping = data_cfg, data_cfg.shaping
        self.max_new_tokens = max_new_tokens
        self.verifier, self.reward_model = verifier, reward_model
        if verifier is None and reward_model is None and self.shaping.format_pattern is None:
            raise UserError("no reward: set data.reward (a verifier), data.reward_model or data.shaping.format_pattern")
        self.scaler = RunningRewardScaler() if self.shaping.normalize == "running" else None
        self.total_errors = 0  # reward-function failures over the run
        # each source's (N,) scores in the last call, before weights and shaping (the verifier's is
        # what rollout.dynamic_sampling.metric=verifier filters on)
        self.last_sources: dict[str, torch.Tensor] = {}
        self.reasons: Counter = Counter()

    def __call__(self, rollout) -> tuple[torch.Tensor, dict[str, float], list[dict[str, Any]]]:
        """``(rewards (N,), metrics, marks)``; ``marks[i]`` has ``reward_error`` (``"kind: reason"``
        or None) and ``reward_note`` (the reason a function gave with its score, or None)."""
        s = self.shaping
        n = len(rollout)
        sources: dict[str, torch.Tensor] = {}
        weights: dict[str, float] = {}
        metrics: dict[str, float] = {}
        marks: list[dict[str, Any]] = [{"reward_error": None, "reward_note": None} for _ in range(n)]
        if self.verifier is not None:
            results = self.verifier.score(rollout.prompts, rollout.texts, rollout.items)
            sources["verifier"], weights["verifier"] = (
                torch.tensor(results.scores, dtype=torch.float32),
                s.verifier_weight,
            )
            metrics.update(results.metrics())
            for mark, error, note in zip(marks, results.errors, results.notes):
                mark["reward_error"] = f"{error[0]}: {error[1]}" if error is not None else None
                mark["reward_note"] = note
            self._count_errors(results)
            metrics["reward_errors_total"] = float(self.total_errors)
        if self.reward_model is not None:
            sources["reward_model"] = torch.tensor(
                self.reward_model.score(rollout.prompts, rollout.texts, rollout.items), dtype=torch.float32
            )
            weights["reward_model"] = s.reward_model_weight
        if s.format_pattern is not None:
            sources["format"], weights["format"] = format_score(rollout.texts, s.format_pattern), s.format_weight
        self.last_sources = sources
        rewards, source_metrics = combine_rewards(sources, weights)  # (N,)
        metrics.update(source_metrics)
        lengths = rollout.response_lengths.cpu()
        if s.overlong_cache_length is not None:
            penalty = overlong_penalty(
                lengths, self.max_new_tokens, s.overlong_cache_length, s.overlong_penalty_factor
            )  # (N,) <= 0
            rewards = rewards + penalty
            metrics["reward/overlong_penalty_mean"] = penalty.mean().item()
            metrics["reward/overlong_frac"] = (penalty < 0).float().mean().item()
        if s.truncation_penalty:
            penalty = truncation_penalty(rollout.truncated.cpu(), s.truncation_penalty)
            rewards = rewards + penalty
            metrics["reward/truncation_penalty_mean"] = penalty.mean().item()
        if s.clip_min is not None or s.clip_max is not None:
            clipped = clip_rewards(rewards, s.clip_min, s.clip_max)
            metrics["reward/clipped_frac"] = (clipped != rewards).float().mean().item()
            rewards = clipped
        if s.normalize != "none":
            metrics["reward/before_normalize_mean"] = rewards.mean().item()
            if s.normalize == "batch":
                rewards = normalize_batch(rewards)
            else:
                rewards = self.scaler(rewards)
                metrics["reward/running_std"] = self.scaler.var**0.5
        return rewards, metrics, marks

    def _count_errors(self, results) -> None:
        limit = self.cfg.max_reward_errors
        name = getattr(self.verifier, "name", "reward")
        self.total_errors += results.num_errors
        self.reasons.update(e[1] for e in results.errors if e is not None)
        if limit is None:
            return
        if limit < 1:  # a fraction of this batch
            check_error_limit(results, limit, name)
        elif self.total_errors > limit:  # a count over the run
            reason, count = self.reasons.most_common(1)[0]
            raise UserError(
                f"reward function '{name}' failed on {self.total_errors} samples so far (more than "
                f"data.max_reward_errors={int(limit)}); most often ({count}x): {reason}; fix the "
                "function (try it with: ppokit reward NAME --prompt ... --response ...), or raise "
                "data.max_reward_errors"
            )

    def describe(self) -> str | None:
        """One line for the run's header: the sources and weights and the shaping, or None when
        the reward is one source used as it is."""
        s = self.shaping
        sources = [
            ("verifier", self.verifier is not None, s.verifier_weight),
            ("reward_model", self.reward_model is not None, s.reward_model_weight),
            ("format", s.format_pattern is not None, s.format_weight),
        ]
        used = [(name, w) for name, on, w in sources if on]
        parts = []
        if len(used) > 1 or any(w != 1.0 for _, w in used):
            parts.append(" + ".join(f"{w:g} x {name}" for name, w in used))
        parts += s.active
        return "reward: " + "; ".join(parts) if parts else None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"total_errors": self.total_errors, "reasons": dict(self.reasons)}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total_errors = int(state.get("total_errors", 0))
        self.reasons = Counter({str(k): int(v) for k, v in state.get("reasons", {}).items()})
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
