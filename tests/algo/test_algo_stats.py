"""Masked statistics against numpy float64."""

import math

import numpy as np
import pytest
import torch

from ppokit.algo import explained_variance, masked_mean, masked_sum, masked_var, whiten


def _case(seed, shape=(4, 9)):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape) * 3 + 1
    mask = rng.random(shape) < 0.6
    mask[0, :2] = True
    return x, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_sum_mean_var_match_numpy(seed):
    x, mask = _case(seed)
    xt, mt = torch.from_numpy(x), torch.from_numpy(mask)
    assert masked_sum(xt, mt).item() == pytest.approx(x[mask].sum(), abs=1e-12)
    assert masked_mean(xt, mt).item() == pytest.approx(x[mask].mean(), abs=1e-12)
    assert masked_var(xt, mt).item() == pytest.approx(x[mask].var(ddof=1), abs=1e-12)
    assert masked_var(xt, mt, unbiased=False).item() == pytest.approx(x[mask].var(ddof=0), abs=1e-12)
    # float 0/1 masks behave like bool masks
    assert masked_mean(xt, mt.double()).item() == pytest.approx(x[mask].mean(), abs=1e-12)
    # per-row reductions
    row_sum = masked_sum(xt, mt, dim=-1)
    row_mean = masked_mean(xt, mt, dim=1)
    for b in range(x.shape[0]):
        assert row_sum[b].item() == pytest.approx(x[b][mask[b]].sum(), abs=1e-12)
        expected = x[b][mask[b]].mean() if mask[b].any() else 0.0
        assert row_mean[b].item() == pytest.approx(expected, abs=1e-12)
    # no mask = plain statistics
    assert masked_mean(xt).item() == pytest.approx(x.mean(), abs=1e-12)
    assert masked_var(xt).item() == pytest.approx(x.var(ddof=1), abs=1e-12)
    torch.testing.assert_close(masked_mean(xt, dim=0), torch.from_numpy(x.mean(0)), rtol=0, atol=1e-12)


def test_masked_stats_broadcast_mask_and_padding_garbage():
    # NaN / inf in masked-out positions must not leak into any statistic
    x = torch.tensor([[1.0, float("nan"), 7.0], [3.0, float("inf"), 5.0]], dtype=torch.float64)
    col_mask = torch.tensor([True, False, True])  # broadcast over rows
    assert masked_sum(x, col_mask).item() == 16.0
    assert masked_mean(x, col_mask).item() == 4.0
    assert masked_var(x, col_mask).item() == pytest.approx(np.var([1, 7, 3, 5], ddof=1), abs=1e-12)
    assert masked_sum(x, col_mask, dim=1).tolist() == [8.0, 8.0]
    out = whiten(x, col_mask.expand(2, 3))
    assert torch.isfinite(out).all() and (out[:, 1] == 0).all()
    with pytest.raises(ValueError, match=r"mask of shape \(4,\) is not broadcastable to x of shape \(2, 3\)"):
        masked_sum(x, torch.ones(4, dtype=torch.bool))


def test_masked_mean_of_nothing_is_zero_and_var_of_one_is_nan():
    x = torch.randn(3, 4)
    assert masked_mean(x, torch.zeros(3, 4)).item() == 0.0
    assert math.isnan(masked_var(x, torch.tensor([[1, 0, 0, 0]] + [[0] * 4] * 2)).item())
    assert masked_var(x, torch.tensor([[1, 0, 0, 0]] + [[0] * 4] * 2), unbiased=False).item() == 0.0


@pytest.mark.parametrize("seed", [0, 3])
def test_whiten_matches_numpy(seed):
    x, mask = _case(seed)
    xt, mt = torch.from_numpy(x), torch.from_numpy(mask)
    sel = x[mask]
    mu, var = sel.mean(), sel.var(ddof=1)
    expected = np.where(mask, (x - mu) / np.sqrt(var + 1e-8), 0.0)
    out = whiten(xt, mt)
    torch.testing.assert_close(out, torch.from_numpy(expected), rtol=0, atol=1e-12)
    assert out[mt].mean().item() == pytest.approx(0.0, abs=1e-12)
    assert out[mt].std().item() == pytest.approx(1.0, abs=1e-6)
    assert (out[~mt] == 0).all()
    kept = whiten(xt, mt, shift_mean=False)
    torch.testing.assert_close(kept, torch.from_numpy(np.where(mask, expected + mu, 0.0)), rtol=0, atol=1e-12)
    unmasked = whiten(xt, eps=0.0)
    torch.testing.assert_close(unmasked, torch.from_numpy((x - x.mean()) / x.std(ddof=1)), rtol=0, atol=1e-12)


def test_whiten_needs_two_valid_elements():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="whiten needs at least 2 valid elements, got 1"):
        whiten(x, torch.tensor([[0, 1, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="got 0"):
        whiten(x, torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="got 1"):
        whiten(torch.ones(1))
    whiten(x, torch.tensor([[0, 1, 1], [0, 0, 0]]))  # 2 is enough


def test_explained_variance():
    rng = np.random.default_rng(7)
    y = rng.normal(size=(3, 8))
    pred = y + rng.normal(size=(3, 8)) * 0.3
    mask = rng.random((3, 8)) < 0.7
    ev = explained_variance(torch.from_numpy(pred), torch.from_numpy(y), torch.from_numpy(mask))
    expected = 1 - np.var(y[mask] - pred[mask], ddof=1) / np.var(y[mask], ddof=1)
    assert ev.item() == pytest.approx(expected, abs=1e-12)
    yt = torch.from_numpy(y)
    assert explained_variance(yt, yt).item() == 1.0
    assert explained_variance(torch.full_like(yt, yt.mean().item()), yt).item() == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(explained_variance(yt, torch.ones_like(yt)).item())  # Var[y] == 0
    with pytest.raises(ValueError, match=r"y_pred shape \(3, 7\) != y_true shape \(3, 8\)"):
        explained_variance(yt[:, :7], yt)
