"""Reward shaping against float64 naive implementations and hand cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppokit.lm.rewards.shaping import (
    RunningRewardScaler,
    clip_rewards,
    combine_rewards,
    format_score,
    normalize_batch,
    overlong_penalty,
    truncation_penalty,
)


def naive_overlong(length: int, l_max: int, l_cache: int) -> float:
    """DAPO Eq. 13, written case by case."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def test_overlong_penalty_matches_the_dapo_formula():
    rng = np.random.default_rng(0)
    for _ in range(20):
        l_max = int(rng.integers(8, 4096))
        l_cache = int(rng.integers(1, l_max + 1))
        factor = float(rng.uniform(0.1, 2.0))
        lengths = rng.integers(0, l_max + 20, size=64)
        got = overlong_penalty(torch.tensor(lengths), l_max, l_cache, factor)
        expected = torch.tensor([factor * naive_overlong(int(n), l_max, l_cache) for n in lengths], dtype=torch.float32)
        torch.testing.assert_close(got, expected)
    hand = overlong_penalty(torch.tensor([0, 12, 13, 14, 16, 20]), max_length=16, cache_length=4, factor=0.5)
    torch.testing.assert_close(hand, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(torch.tensor([1]), 16, 0)


def test_truncation_and_clipping():
    torch.testing.assert_close(
        truncation_penalty(torch.tensor([True, False, True]), 0.5), torch.tensor([-0.5, 0.0, -0.5])
    )
    r = torch.tensor([-3.0, -0.5, 0.2, 4.0])
    torch.testing.assert_close(clip_rewards(r, -1.0, 1.0), torch.tensor([-1.0, -0.5, 0.2, 1.0]))
    torch.testing.assert_close(clip_rewards(r, high=0.0), torch.tensor([-3.0, -0.5, 0.0, 0.0]))
    with pytest.raises(ValueError):
        clip_rewards(r, 1.0, -1.0)


def test_batch_normalisation():
    rng = np.random.default_rng(1)
    x = rng.normal(3.0, 2.0, size=100)
    got = normalize_batch(torch.tensor(x, dtype=torch.float64), eps=0.0)
    np.testing.assert_allclose(got.numpy(), (x - x.mean()) / x.std(), rtol=1e-12)
    assert torch.all(normalize_batch(torch.ones(4)) == 0)  # no spread: zeros, not NaN


def test_running_scaler_matches_the_variance_of_everything_seen():
    rng = np.random.default_rng(2)
    batches = [rng.normal(rng.uniform(-5, 5), rng.uniform(0.1, 3), size=int(rng.integers(1, 50))) for _ in range(30)]
    scaler = RunningRewardScaler(eps=0.0)
    for b in batches:
        scaler.update(torch.tensor(b))
    seen = np.concatenate(batches)
    assert scaler.count == len(seen)
    assert scaler.mean == pytest.approx(seen.mean(), rel=1e-12)
    assert scaler.var == pytest.approx(seen.var(), rel=1e-10)
    last = torch.tensor(batches[-1])
    np.testing.assert_allclose(scaler.scale(last).numpy(), batches[-1] / seen.std(), rtol=1e-10)
    restored = RunningRewardScaler(eps=0.0)
    restored.load_state_dict(scaler.state_dict())
    torch.testing.assert_close(restored.scale(last), scaler.scale(last))
    assert RunningRewardScaler().var == 1.0  # nothing seen: unscaled


def test_combine_rewards_weights_sources_and_reports_means():
    sources = {
        "reward_model": torch.tensor([0.5, -1.0, 2.0]),
        "verifier": torch.tensor([1.0, 0.0, 1.0]),
        "format": torch.tensor([1.0, 1.0, 0.0]),
    }
    total, metrics = combine_rewards(sources, {"reward_model": 0.5, "format": 0.1})
    torch.testing.assert_close(total, torch.tensor([0.25 + 1.0 + 0.1, -0.5 + 0.0 + 0.1, 1.0 + 1.0 + 0.0]))
    assert metrics == pytest.approx(
        {"reward/reward_model_mean": 0.5, "reward/verifier_mean": 2 / 3, "reward/format_mean": 2 / 3}
    )
    with pytest.raises(ValueError, match="unknown sources \\['verifer'\\]"):
        combine_rewards(sources, {"verifer": 1.0})
    with pytest.raises(ValueError, match="same N"):
        combine_rewards({"a": torch.zeros(2), "b": torch.zeros(3)})


def test_format_score():
    texts = ["think... <answer>3</answer>", "<answer>3</answer> trailing", "no tags"]
    torch.testing.assert_close(format_score(texts, r"<answer>.*</answer>\s*$"), torch.tensor([1.0, 0.0, 0.0]))
