"""Reward shaping: small pure functions on sequence rewards, each configured and logged by the caller.

Shapes are (N,) float tensors, one value per response. In the order a caller applies them:

- :func:`combine_rewards`: a weighted sum of several sources (reward model, verifier,
  format check), with each source's mean for the metrics;
- :func:`overlong_penalty`: DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An
  Open-Source LLM Reinforcement Learning System at Scale", Eq. 13);
- :func:`truncation_penalty`: a fixed penalty for a response cut off without EOS;
- :func:`clip_rewards` and reward normalisation, by batch (:func:`normalize_batch`) or
  by running statistics (:class:`RunningRewardScaler`).

Which normalisation: with a group estimator (GRPO, RLOO) the advantages are already
centred and scaled within each prompt's group, so normalising rewards adds nothing. With
a critic (GAE), :class:`RunningRewardScaler` divides by a running standard deviation
kept across iterations and does not subtract the mean: the value head then learns
targets whose scale stays put from one batch to the next, and a reward's sign (and the
zero of a penalty or of the KL term) keeps its meaning; the state goes into checkpoints.
:func:`normalize_batch` (centre and scale within a batch) is for a reward model whose
offset is arbitrary, and its scale then depends on each batch's spread.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import torch


def overlong_penalty(lengths: torch.Tensor, max_length: int, cache_length: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment of responses of ``lengths`` tokens, (N,) -> (N,).

        R(|y|) = 0                                  for |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache for L_max - L_cache < |y| <= L_max
               = -1                                 for |y| > L_max

    times ``factor``: no penalty up to ``max_length - cache_length`` tokens, then linear
    to ``-factor`` at ``max_length`` (``L_max``: the generation limit).
    """
    if not (isinstance(cache_length, int) and 0 < cache_length <= max_length):
        raise ValueError(
            f"overlong_penalty: cache_length must be in [1, max_length] (got {cache_length}, max_length {max_length})"
        )
    lengths = lengths.to(torch.float64)  # (N,)
    start = max_length - cache_length
    penalty = ((start - lengths) / cache_length).clamp(min=-1.0, max=0.0)  # (N,)
    return (penalty * factor).to(torch.float32)


def truncation_penalty(truncated: torch.Tensor, penalty: float) -> torch.Tensor:
    """``-penalty`` for each response that hit the length limit without EOS, else 0; (N,) bool -> (N,)."""
    return truncated.to(torch.float32) * -float(penalty)


def clip_rewards(rewards: torch.Tensor, low: float | None = None, high: float | None = None) -> torch.Tensor:
    """Rewards clamped to ``[low, high]`` (either bound may be None)."""
    if low is not None and high is not None and low > high:
        raise ValueError(f"clip_rewards: low {low} > high {high}")
    return rewards.clamp(min=low, max=high)


def normalize_batch(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean(r)) / (std(r) + eps)`` over the batch (population std); (N,) -> (N,)."""
    r = rewards.to(torch.float64)
    return ((r - r.mean()) / (r.std(unbiased=False) + eps)).to(rewards.dtype)


class RunningRewardScaler:
    """Divides rewards by the running standard deviation of all rewards seen (module docstring).

    ``update(r)`` folds a batch into the count, mean and sum of squared deviations
    (Chan et al.'s parallel form of Welford's algorithm, float64); ``scale(r)`` returns
    ``r / sqrt(var + eps)``. The state is plain floats (``state_dict``) for checkpoints.
    """

    def __init__(self, eps: float = 1e-8) -> None:
        self.eps = eps
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count else 1.0

    def update(self, rewards: torch.Tensor) -> None:
        r = rewards.detach().to(torch.float64).flatten()
        n = r.numel()
        if n == 0:
            return
        batch_mean = r.mean().item()
        batch_m2 = ((r - batch_mean) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    def scale(self, rewards: torch.Tensor) -> torch.Tensor:
        return (rewards.to(torch.float64) / math.sqrt(self.var + self.eps)).to(rewards.dtype)

    def __call__(self, rewards: torch.Tensor) -> torch.Tensor:
        """Update with ``rewards``, then scale them."""
        self.update(rewards)
        return self.scale(rewards)

    def state_dict(self) -> dict[str, float]:
        return {"count": float(self.count), "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def combine_rewards(
    sources: Mapping[str, torch.Tensor], weights: Mapping[str, float] | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """``(sum_s w_s * r_s, metrics)``: the weighted sum of reward sources, (N,) each -> (N,).

    A source without a weight counts once (w = 1). ``metrics`` has each source's mean as
    ``reward/<name>_mean`` (before weighting). A weight naming no source is an error.
    """
    if not sources:
        raise ValueError("combine_rewards: no reward sources")
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(sources))
    if unknown:
        raise ValueError(f"combine_rewards: weights for unknown sources {unknown}; sources: {sorted(sources)}")
    shapes = {tuple(r.shape) for r in sources.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"combine_rewards: every source must be one (N,) tensor of the same N (got {shapes})")
    total = torch.zeros_like(next(iter(sources.values())), dtype=torch.float32)
    metrics = {}
    for name, rewards in sources.items():
        total += float(weights.get(name, 1.0)) * rewards.to(torch.float32)
        metrics[f"reward/{name}_mean"] = rewards.to(torch.float64).mean().item()
    return total, metrics


def format_score(texts: Sequence[str], pattern: str) -> torch.Tensor:
    """1.0 for each text in which the regular expression ``pattern`` is found (``re.search``,
    DOTALL), else 0.0: a format check such as ``r"<answer>.*</answer>\\s*$"``; (N,)."""
    compiled = re.compile(pattern, re.DOTALL)
    return torch.tensor([float(compiled.search(t) is not None) for t in texts], dtype=torch.float32)
