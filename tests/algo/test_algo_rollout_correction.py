"""Rollout correction (TIS, MIS) and the mismatch metrics against float64 loops written out."""

from __future__ import annotations

import math

import pytest
import torch

from ppokit import algo
from ppokit.algo import UnknownNameError


def random_case(seed: int = 0, b: int = 6, t: int = 7, scale: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(b, t, generator=g, dtype=torch.float64) - 2.0
    rollout = old + scale * torch.randn(b, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    mask[1] = 0.0  # a row without a token
    old[mask == 0] = float("inf")  # padding may hold anything
    rollout[mask == 0] = float("nan")
    return old, rollout, mask


def naive_rho(old, rollout, mask, level):
    """rho per token, row by row in Python floats (module formula), 1 on padding."""
    out = torch.ones_like(old)
    for b in range(old.shape[0]):
        logs = [float(old[b, t] - rollout[b, t]) for t in range(old.shape[1]) if mask[b, t]]
        for t in range(old.shape[1]):
            if not mask[b, t]:
                continue
            if level == "token":
                value = float(old[b, t] - rollout[b, t])
            elif level == "sequence":
                value = sum(logs)
            else:
                value = sum(logs) / max(len(logs), 1)
            out[b, t] = math.exp(min(max(value, -20.0), 20.0))
    return out


def naive_correction(old, rollout, mask, mode, level, cap, lower):
    rho = naive_rho(old, rollout, mask, level)
    weight, keep = torch.zeros_like(old), torch.zeros_like(old)
    for b in range(old.shape[0]):
        for t in range(old.shape[1]):
            if not mask[b, t]:
                continue
            r = float(rho[b, t])
            if mode == "none":
                weight[b, t], keep[b, t] = 1.0, 1.0
            elif mode == "tis":
                weight[b, t], keep[b, t] = min(r, cap), 1.0
            else:
                inside = lower <= r <= cap
                weight[b, t], keep[b, t] = (r if inside else 0.0), float(inside)
    return weight, keep


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_the_ratio_of_each_level(level):
    old, rollout, mask = random_case()
    rho = algo.correction_ratio(old, rollout, mask, level)
    torch.testing.assert_close(rho, naive_rho(old, rollout, mask, level), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    "mode,level,cap,lower",
    [
        ("none", "token", 2.0, None),
        ("tis", "token", 1.3, None),
        ("tis", "sequence", 2.0, None),
        ("mis", "token", 1.3, None),
        ("mis", "token", 1.3, 0.0),
        ("mis", "sequence", 3.0, 0.0),  # TRL's default: a sequence's ratio, masked above 3
        ("mis", "geometric", 1.1, 0.9),
    ],
)
def test_weights_and_kept_tokens_match_the_formula(mode, level, cap, lower):
    old, rollout, mask = random_case(seed=3)
    weight, keep, metrics = algo.rollout_correction(old, rollout, mask, mode=mode, level=level, cap=cap, lower=lower)
    want_weight, want_keep = naive_correction(
        old, rollout, mask, mode, level, cap, 1.0 / cap if lower is None else lower
    )
    torch.testing.assert_close(weight, want_weight, rtol=1e-12, atol=0)
    torch.testing.assert_close(keep, want_keep, rtol=0, atol=0)
    kept = want_keep.bool()
    assert float(metrics["correction_weight_mean"]) == pytest.approx(
        float(want_weight[kept].mean()) if kept.any() else 0.0, rel=1e-12
    )
    valid = mask.bool()
    rho = naive_rho(old, rollout, mask, level)
    if mode == "tis":
        assert float(metrics["correction_truncated_frac"]) == pytest.approx(float((rho[valid] > cap).double().mean()))
        assert 0 < float(metrics["correction_truncated_frac"]) < 1  # the case exercises both sides
    if mode == "mis":
        assert float(metrics["correction_masked_frac"]) == pytest.approx(float((want_keep[valid] == 0).double().mean()))
        assert 0 < float(metrics["correction_masked_frac"]) < 1
    assert not weight.isnan().any() and not keep.isnan().any()  # nan / inf padding selected away


def test_float32_inputs_agree_with_float64():
    old, rollout, mask = random_case(seed=5)
    old, rollout = old.masked_fill(mask == 0, 0.0), rollout.masked_fill(mask == 0, 0.0)
    w64, k64, _ = algo.rollout_correction(old, rollout, mask, mode="tis", level="sequence", cap=2.0)
    w32, k32, _ = algo.rollout_correction(old.float(), rollout.float(), mask.float(), mode="tis", level="sequence")
    torch.testing.assert_close(w32.double(), w64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k32.double(), k64)


def test_identical_log_probs_change_nothing():
    old, _, mask = random_case(seed=1)
    old = old.masked_fill(mask == 0, 0.0)
    for mode in ("tis", "mis"):
        weight, keep, _ = algo.rollout_correction(old, old.clone(), mask, mode=mode, level="sequence", cap=1.5)
        torch.testing.assert_close(weight, mask)
        torch.testing.assert_close(keep, mask)
    metrics = algo.mismatch_metrics(old, old.clone(), mask)
    assert float(metrics["mismatch_kl"]) == 0.0 and float(metrics["mismatch_kl_k1"]) == 0.0
    assert float(metrics["mismatch_ratio_max"]) == 1.0 == float(metrics["mismatch_ratio_min"])


def test_mismatch_metrics_match_a_loop():
    old, rollout, mask = random_case(seed=7)
    metrics = algo.mismatch_metrics(old, rollout, mask)
    logs = [float(old[b, t] - rollout[b, t]) for b in range(old.shape[0]) for t in range(old.shape[1]) if mask[b, t]]
    k3 = sum(math.exp(x) - 1 - x for x in logs) / len(logs)
    assert float(metrics["mismatch_kl"]) == pytest.approx(k3, rel=1e-12)
    assert float(metrics["mismatch_kl_k1"]) == pytest.approx(-sum(logs) / len(logs), rel=1e-12)
    assert float(metrics["mismatch_ratio_max"]) == pytest.approx(math.exp(max(logs)), rel=1e-12)
    assert float(metrics["mismatch_ratio_min"]) == pytest.approx(math.exp(min(logs)), rel=1e-12)
    assert float(metrics["mismatch_kl"]) > 0


def test_no_token_at_all_and_a_single_token():
    empty = torch.zeros(2, 3)
    metrics = algo.mismatch_metrics(torch.zeros(2, 3), torch.ones(2, 3), empty)
    assert {k: float(v) for k, v in metrics.items()} == {
        "mismatch_kl": 0.0,
        "mismatch_kl_k1": 0.0,
        "mismatch_ratio_max": 1.0,
        "mismatch_ratio_min": 1.0,
    }
    weight, keep, m = algo.rollout_correction(torch.zeros(2, 3), torch.ones(2, 3), empty, mode="mis")
    assert float(weight.abs().sum()) == 0 and float(keep.sum()) == 0 and float(m["correction_weight_mean"]) == 0.0
    one = torch.tensor([[1.0]])
    old, rollout = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])  # r = e^0.5 = 1.65
    assert float(algo.rollout_correction(old, rollout, one, mode="tis", cap=1.5)[0]) == 1.5
    assert float(algo.rollout_correction(old, rollout, one, mode="mis", cap=1.5)[1]) == 0.0
    assert float(algo.rollout_correction(old, rollout, one, mode="mis", cap=2.0)[0]) == pytest.approx(math.exp(0.5))


def test_huge_log_ratios_stay_finite():
    mask = torch.ones(1, 4)
    old = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    rollout = torch.tensor([[-80.0, -1.0, -2.0, -3.0]])  # r = e^80 on the first token
    rho = algo.correction_ratio(old, rollout, mask, "sequence")
    assert torch.isfinite(rho).all() and float(rho[0, 0]) == pytest.approx(math.exp(20.0), rel=1e-6)
    weight, keep, _ = algo.rollout_correction(old, rollout, mask, mode="mis", level="token", cap=2.0)
    assert keep.tolist() == [[0.0, 1.0, 1.0, 1.0]] and weight.tolist() == [[0.0, 1.0, 1.0, 1.0]]
    assert float(algo.mismatch_metrics(old, rollout, mask)["mismatch_ratio_max"]) == pytest.approx(math.exp(20.0))


def test_bad_names_and_arguments_are_clear():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(UnknownNameError, match="did you mean 'tis'"):
        algo.rollout_correction(x, x, m, mode="tsi")
    with pytest.raises(ValueError, match="level 'row'"):
        algo.rollout_correction(x, x, m, mode="tis", level="row")
    with pytest.raises(ValueError, match="cap must be >= 1"):
        algo.rollout_correction(x, x, m, mode="tis", cap=0.5)
    with pytest.raises(ValueError, match="share one"):
        algo.mismatch_metrics(x, torch.zeros(2, 4), m)
    assert algo.ROLLOUT_CORRECTIONS.names() == ("none", "tis", "mis")
