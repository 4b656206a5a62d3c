"""Loss aggregation modes and exact micro-batch accumulation."""

import math

import pytest
import torch

from ppokit.algo import AGG_MODES, aggregate, aggregation_normalizer, policy_loss, value_loss

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def naive_aggregate(L, m, mode, normalizer=None, horizon=None):
    """Plain loops over rows and tokens."""
    B, T = len(L), len(L[0])
    row_sums = [sum(L[b][t] for t in range(T) if m[b][t]) for b in range(B)]
    row_lens = [sum(1 for t in range(T) if m[b][t]) for b in range(B)]
    if mode == "token-mean":
        return sum(row_sums) / (normalizer if normalizer is not None else max(sum(row_lens), 1))
    n = normalizer if normalizer is not None else B
    if mode == "seq-mean-token-sum":
        return sum(row_sums) / n
    if mode == "seq-mean-token-mean":
        return sum(s / max(k, 1) for s, k in zip(row_sums, row_lens)) / n
    if mode == "seq-mean-token-sum-norm":
        return sum(row_sums) / (n * (horizon if horizon is not None else T))
    raise AssertionError(mode)


def _case(seed, B=7, T=6):
    g = torch.Generator().manual_seed(seed)
    L = torch.randn(B, T, generator=g, dtype=torch.float64)
    m = torch.rand(B, T, generator=g) < 0.6
    m[2] = False  # a fully padded row
    m[0] = True
    return L, m


def test_registered_modes():
    assert AGG_MODES.names() == tuple(MODES)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_aggregate_matches_naive(mode, seed):
    L, m = _case(seed)
    got = aggregate(L, m, mode)
    assert got.item() == pytest.approx(naive_aggregate(L.tolist(), m.tolist(), mode), abs=1e-12)
    got = aggregate(L, m.double(), mode, normalizer=3.5, horizon=11)  # explicit constants, float mask
    assert got.item() == pytest.approx(naive_aggregate(L.tolist(), m.tolist(), mode, 3.5, 11), abs=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_fully_masked_rows_contribute_zero_without_nan(mode):
    L = torch.full((3, 4), float("nan"), dtype=torch.float64, requires_grad=True)
    m = torch.zeros(3, 4, dtype=torch.bool)
    out = aggregate(L, m, mode)
    assert out.item() == 0.0
    out.backward()
    assert (L.grad == 0).all()
    # padding garbage next to valid tokens is ignored as well
    L2 = torch.tensor([[1.0, float("inf")], [2.0, 3.0]], dtype=torch.float64)
    m2 = torch.tensor([[1, 0], [1, 1]])
    assert aggregate(L2, m2, mode).item() == pytest.approx(naive_aggregate([[1.0, 0.0], [2.0, 3.0]], m2.tolist(), mode))


def test_aggregate_validation():
    L = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"mask shape \(2, 4\) != loss_mat shape \(2, 3\)"):
        aggregate(L, torch.ones(2, 4), "token-mean")
    with pytest.raises(ValueError, match="2-D"):
        aggregate(torch.zeros(6), torch.ones(6), "token-mean")
    with pytest.raises(ValueError, match="did you mean 'seq-mean-token-mean'"):
        aggregate(L, torch.ones(2, 3), "seq-mean-tok-mean")
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        aggregate(L, torch.ones(2, 3), "token-mean", normalizer=0)
    with pytest.raises(ValueError, match="horizon"):
        aggregate(L, torch.ones(2, 3), "seq-mean-token-sum-norm", horizon=0)


def test_aggregation_normalizer():
    m = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert aggregation_normalizer(m, "token-mean").item() == 3
    for mode in MODES[1:]:
        assert aggregation_normalizer(m, mode).item() == 3  # rows, padded ones included
    assert aggregation_normalizer(torch.zeros(2, 2), "token-mean").item() == 1  # never 0


# ----------------------------------------------------------------------------- micro-batches

SPLITS = [(0, 1), (1, 4), (4, 6), (6, 9)]  # uneven; rows 4 and 5 are fully masked


def _minibatch(seed=0, B=9, T=7):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, T, generator=g) < 0.7
    m[4:6] = False  # the micro-batch (4, 6) has no valid token at all
    m[0, 0] = True
    return g, m


def _check_accumulation(make_loss, leaf, mask, mode, horizon):
    """sum over micro-batches with the global normalizer == whole mini-batch (loss and grad)."""
    norm = aggregation_normalizer(mask, mode)
    full = make_loss(slice(0, mask.shape[0]), norm, horizon)
    (full_grad,) = torch.autograd.grad(full, leaf)
    total, grad = 0.0, torch.zeros_like(leaf)
    for lo, hi in SPLITS:
        part = make_loss(slice(lo, hi), norm, horizon)
        assert torch.isfinite(part)
        total = total + part
        grad += torch.autograd.grad(part, leaf, allow_unused=True)[0] if part.requires_grad else 0.0
    assert abs(total.item() - full.item()) <= 1e-12
    torch.testing.assert_close(grad, full_grad, rtol=0, atol=1e-12)
    assert full_grad.abs().sum() > 0


@pytest.mark.parametrize("mode", MODES)
def test_microbatch_accumulation_aggregate(mode):
    g, m = _minibatch()
    L = torch.randn(m.shape, generator=g, dtype=torch.float64, requires_grad=True)
    horizon = m.shape[1]

    def make(rows, norm, h):
        return aggregate(L[rows] ** 2, m[rows], mode, normalizer=norm, horizon=h)

    _check_accumulation(make, L, m, mode, horizon)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("mode", MODES)
def test_microbatch_accumulation_policy_loss(mode, ratio_level):
    g, m = _minibatch(1)
    old = torch.randn(m.shape, generator=g, dtype=torch.float64) * 0.1 - 2
    logp = (old + torch.randn(m.shape, generator=g, dtype=torch.float64) * 0.2).requires_grad_()
    adv = torch.randn(m.shape, generator=g, dtype=torch.float64)

    def make(rows, norm, h):
        loss, _ = policy_loss(
            logp[rows],
            old[rows],
            adv[rows],
            m[rows],
            lower_clip_ratio=0.1,
            upper_clip_ratio=0.25,
            clip_ratio_c=3.0,
            agg_mode=mode,
            ratio_level=ratio_level,
            normalizer=norm,
            horizon=h,
        )
        return loss

    _check_accumulation(make, logp, m, mode, horizon=16)


@pytest.mark.parametrize("mode", MODES)
def test_microbatch_accumulation_value_loss(mode):
    g, m = _minibatch(2)
    old_v = torch.randn(m.shape, generator=g, dtype=torch.float64)
    v = (old_v + torch.randn(m.shape, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    ret = torch.randn(m.shape, generator=g, dtype=torch.float64)

    def make(rows, norm, h):
        loss, _ = value_loss(
            v[rows],
            old_v[rows],
            ret[rows],
            m[rows],
            clip_value=0.2,
            huber_delta=1.0,
            agg_mode=mode,
            normalizer=norm,
            horizon=h,
        )
        return loss

    _check_accumulation(make, v, m, mode, horizon=16)


def test_default_normalizers_do_not_accumulate_to_the_minibatch_loss():
    # guards the test above: without the global normalizer micro-batch sums differ
    g, m = _minibatch(3)
    L = torch.rand(m.shape, generator=g, dtype=torch.float64) + 0.5
    full = aggregate(L, m, "token-mean")
    parts = sum(aggregate(L[lo:hi], m[lo:hi], "token-mean") for lo, hi in SPLITS)
    assert not math.isclose(parts.item(), full.item(), abs_tol=1e-6)
