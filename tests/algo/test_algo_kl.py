"""KL estimators, exact KL, the mean sequence KL and KL-coefficient controllers."""

import json
import math

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from ppokit.algo import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    AdaptivePenaltyCoef,
    FixedKLController,
    UnknownNameError,
    kl_full,
    kl_penalty,
    make_kl_controller,
    mean_sequence_kl,
)

D = torch.float64
ALL_KINDS = KL_ESTIMATORS.names(include_aliases=True)


def test_estimator_names():
    assert set(ALL_KINDS) == {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_zero_when_equal(kind):
    lp = torch.randn(3, 7, dtype=D)
    assert (kl_penalty(lp, lp.clone(), kind) == 0).all()


def test_formulas_on_a_hand_case():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=D)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=D)
    diff = [0.5, -1.0, 0.0]
    assert kl_penalty(lp, ref, "kl").tolist() == pytest.approx(diff)
    assert kl_penalty(lp, ref, "abs").tolist() == pytest.approx([abs(x) for x in diff])
    assert kl_penalty(lp, ref, "mse").tolist() == pytest.approx([0.5 * x * x for x in diff])
    assert kl_penalty(lp, ref, "low_var_kl").tolist() == pytest.approx([math.exp(-x) + x - 1 for x in diff])
    # k3 is clamped to 10 for wildly different log-probs, and stays finite
    big = kl_penalty(torch.tensor([-500.0], dtype=D), torch.tensor([0.0], dtype=D), "k3")
    assert big.item() == 10.0


@pytest.mark.parametrize("kind", ["k2", "k3", "abs"])
def test_nonnegative_estimators(kind):
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(1000, generator=g, dtype=D) * 3
    ref = torch.randn(1000, generator=g, dtype=D) * 3
    assert (kl_penalty(lp, ref, kind) >= 0).all()


def test_k1_and_k3_are_unbiased_for_samples_from_p():
    g = torch.Generator().manual_seed(1)
    logits_p = torch.randn(6, generator=g, dtype=D)
    logits_q = torch.randn(6, generator=g, dtype=D)
    p, q = Categorical(logits=logits_p), Categorical(logits=logits_q)
    true_kl = kl_divergence(p, q).item()
    x = torch.multinomial(p.probs, 200_000, replacement=True, generator=g)
    lp, lq = p.log_prob(x), q.log_prob(x)
    for kind in ("k1", "k3"):
        est = kl_penalty(lp, lq, kind).mean().item()
        assert est == pytest.approx(true_kl, rel=0.03, abs=0.005), kind
    assert kl_penalty(lp, lq, "k1").std() > kl_penalty(lp, lq, "k3").std()  # low variance estimator


def test_kl_full_matches_torch_distributions():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 4, 11, generator=g, dtype=D) * 2
    b = torch.randn(3, 4, 11, generator=g, dtype=D) * 2
    expected = kl_divergence(Categorical(logits=a), Categorical(logits=b))
    out = kl_full(a, b)
    assert out.shape == (3, 4)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert (kl_full(a, a).abs() < 1e-12).all()
    # banned tokens (-inf in both) contribute nothing; bf16 inputs compute in float32
    a2, b2 = a.clone(), b.clone()
    a2[..., 0] = float("-inf")
    b2[..., 0] = float("-inf")
    torch.testing.assert_close(
        kl_full(a2, b2), kl_divergence(Categorical(logits=a2[..., 1:]), Categorical(logits=b2[..., 1:]))
    )
    assert kl_full(a.bfloat16(), b.bfloat16()).dtype == torch.float32


def test_full_kind_points_to_kl_full_and_unknown_kind_suggests():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="kl_full"):
        kl_penalty(x, x, "full")
    with pytest.raises(UnknownNameError, match="unknown KL estimator 'low_var'; did you mean 'low_var_kl'"):
        kl_penalty(x, x, "low_var")
    with pytest.raises(ValueError, match=r"log_prob shape \(3,\) != ref_log_prob shape \(2,\)"):
        kl_penalty(x, torch.zeros(2), "k1")


def test_fixed_controller_stays_fixed():
    c = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        c.update(kl, 256)
    assert c.value == 0.05


@pytest.mark.parametrize(
    "current,expected_error",
    [(0.12, 0.2), (0.09, 0.125), (0.08, 0.0), (0.06, -0.2), (0.0, -0.2), (5.0, 0.2)],
)
def test_adaptive_controller_rule(current, expected_error):
    # target 0.08: e = clip(current / target - 1, -0.2, 0.2); value *= 1 + e * n / horizon
    c = AdaptiveKLController(0.1, target_kl=0.08, horizon=10_000)
    c.update(current, n_steps=500)
    assert c.value == pytest.approx(0.1 * (1 + expected_error * 500 / 10_000), rel=1e-12)
    if current > 0.08:
        assert c.value > 0.1
    elif current < 0.08:
        assert c.value < 0.1


def test_adaptive_controller_accepts_tensor_kl_and_validates():
    c = AdaptiveKLController(0.2, 1.0, 100)
    c.update(torch.tensor(2.0), 10)
    assert c.value == pytest.approx(0.2 * 1.02)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.2, 0.0, 100)
    with pytest.raises(ValueError, match="current_kl"):
        c.update(float("nan"), 1)


def test_state_dict_round_trip():
    c = AdaptiveKLController(0.1, 0.05, 1000)
    c.update(0.3, 64)
    state = json.loads(json.dumps(c.state_dict()))  # plain floats
    d = AdaptiveKLController(0.1, 0.05, 1000)
    d.load_state_dict(state)
    assert d.value == c.value != 0.1
    c.update(0.0, 64)
    d.update(0.0, 64)
    assert d.value == c.value
    f = FixedKLController(0.3)
    f2 = FixedKLController(0.0)
    f2.load_state_dict(json.loads(json.dumps(f.state_dict())))
    assert f2.value == 0.3


def test_make_kl_controller():
    assert isinstance(make_kl_controller("fixed", 0.1), FixedKLController)
    a = make_kl_controller("adaptive", 0.1, target_kl=0.02, horizon=5000)
    assert isinstance(a, AdaptiveKLController) and a.value == 0.1 and a.target_kl == 0.02
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="needs horizon"):
        make_kl_controller("adaptive", 0.1, target_kl=0.1)
    with pytest.raises(ValueError, match="did you mean 'adaptive'"):
        make_kl_controller("adaptve", 0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        make_kl_controller("fixed", -1.0)


# ----------------------------------------------------------------------------- mean sequence KL


def _naive_mean_sequence_kl(kl, mask):
    """Loops: the mean over rows with a valid token of each row's mean KL over its valid tokens."""
    row_means = []
    for b in range(kl.shape[0]):
        vals = [kl[b, t].item() for t in range(kl.shape[1]) if mask[b, t]]
        if vals:
            row_means.append(sum(vals) / len(vals))
    return sum(row_means) / len(row_means) if row_means else 0.0


def test_mean_sequence_kl_matches_loops():
    g = torch.Generator().manual_seed(3)
    for trial in range(5):
        kl = torch.rand(7, 9, generator=g, dtype=D) * 0.3
        mask = torch.rand(7, 9, generator=g) < 0.6
        mask[trial] = False  # an empty row: left out, not counted as 0
        kl = torch.where(mask, kl, torch.full_like(kl, float("nan") if trial % 2 else float("inf")))
        out = mean_sequence_kl(kl, mask.to(torch.float32) if trial == 4 else mask)
        assert out.dim() == 0 and out.dtype == D
        assert out.item() == pytest.approx(_naive_mean_sequence_kl(kl, mask), rel=1e-14)
    # every sequence weighs the same: a long and a short row
    kl = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert mean_sequence_kl(kl, mask).item() == 2.0  # not the token mean 7 / 5
    assert mean_sequence_kl(kl, torch.zeros_like(mask)).item() == 0.0  # nothing valid: 0, not NaN


def test_mean_sequence_kl_equals_verls_reduction_when_every_row_has_tokens():
    """verl's apply_kl_penalty: per-row masked mean (sum / (count + eps)), then the mean over rows."""
    g = torch.Generator().manual_seed(4)
    kl = torch.randn(6, 8, generator=g, dtype=D).abs()
    mask = (torch.rand(6, 8, generator=g) < 0.5).to(D)
    mask[:, 0] = 1.0
    verl_like = ((kl * mask).sum(-1) / (mask.sum(-1) + 1e-8)).mean()
    assert mean_sequence_kl(kl, mask).item() == pytest.approx(verl_like.item(), rel=1e-8)


def test_mean_sequence_kl_validates_shapes():
    with pytest.raises(ValueError, match=r"mask shape \(2, 3\) != kl shape \(2, 4\)"):
        mean_sequence_kl(torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="2-D"):
        mean_sequence_kl(torch.zeros(4), torch.ones(4))


def test_adaptive_controller_trace_follows_verls_rule():
    """The trace of value for a KL sequence, against verl's AdaptiveKLController rule written out."""
    init, target, horizon = 0.05, 0.1, 10_000
    kls = [0.3, 0.1, 0.11, 0.05, 0.0, 0.09, 0.2, 0.125]
    steps = [256, 256, 512, 128, 256, 1, 1000, 256]
    expected, value = [], init
    for kl, n in zip(kls, steps):
        error = kl / target - 1
        error = 0.2 if error > 0.2 else -0.2 if error < -0.2 else error  # proportional error, clipped
        value = value * (1 + error * n / horizon)
        expected.append(value)
    ctrl = make_kl_controller("adaptive", init, target_kl=target, horizon=horizon)
    trace = []
    for kl, n in zip(kls, steps):
        ctrl.update(kl, n)
        trace.append(ctrl.value)
    assert trace == pytest.approx(expected, rel=1e-14)
    assert trace[0] == pytest.approx(0.05 * (1 + 0.2 * 256 / 10_000))  # first step by hand


def test_adaptive_controller_fed_by_mean_sequence_kl():
    """One iteration as verl does it: per-token KL -> mean sequence KL -> update(kl, batch size)."""
    g = torch.Generator().manual_seed(5)
    lp = torch.randn(4, 6, generator=g, dtype=D) - 1
    ref = lp + 0.3 * torch.randn(4, 6, generator=g, dtype=D)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 3:] = False
    kl = kl_penalty(lp, ref, "kl")
    ctrl = AdaptiveKLController(0.2, target_kl=0.05, horizon=100)
    current = mean_sequence_kl(kl, mask)
    ctrl.update(current, n_steps=4)
    error = max(min(_naive_mean_sequence_kl(kl, mask) / 0.05 - 1, 0.2), -0.2)
    assert ctrl.value == pytest.approx(0.2 * (1 + error * 4 / 100), rel=1e-14)


# ----------------------------------------------------------------------------- PPO-penalty coefficient


def test_adaptive_penalty_coef_trace():
    # target 0.02: doubles above 0.03, halves below 0.01333..., unchanged in between
    coef = AdaptivePenaltyCoef(1.0, target_kl=0.02)
    kls = [0.05, 0.031, 0.02, 0.029, 0.014, 0.013, 0.001, 0.0, 0.1, 0.02]
    hand = [2.0, 4.0, 4.0, 4.0, 4.0, 2.0, 1.0, 0.5, 1.0, 1.0]
    trace = [coef.update(kl) for kl in kls]
    assert trace == hand
    assert coef.value == 1.0


def test_adaptive_penalty_coef_band_edges_are_unchanged():
    coef = AdaptivePenaltyCoef(0.5, target_kl=1.0)
    assert coef.update(1.5) == 0.5  # not above 1.5 * target
    assert coef.update(1.0 / 1.5) == 0.5  # not below target / 1.5
    assert coef.update(torch.tensor(1.5000001, dtype=D)) == 1.0  # a 0-dim tensor is read once
    assert coef.update(0.6666) == 0.5


def test_adaptive_penalty_coef_state_and_validation():
    coef = AdaptivePenaltyCoef(0.3, target_kl=0.01)
    for kl in (0.1, 0.1, 0.0):
        coef.update(kl)
    state = json.loads(json.dumps(coef.state_dict()))  # plain floats
    assert state == {"value": 0.6, "target_kl": 0.01}
    other = AdaptivePenaltyCoef(0.3, target_kl=0.01)
    other.load_state_dict(state)
    assert other.value == coef.value == 0.6
    assert other.update(0.1) == coef.update(0.1) == 1.2
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="init_coef must be a positive finite number"):
            AdaptivePenaltyCoef(bad, target_kl=0.01)
        with pytest.raises(ValueError, match="target_kl must be a positive finite number"):
            AdaptivePenaltyCoef(0.1, target_kl=bad)
    with pytest.raises(ValueError, match="measured_kl must be finite"):
        coef.update(float("inf"))
    with pytest.raises(ValueError, match="measured_kl must be a number"):
        coef.update("0.1")
    with pytest.raises(ValueError, match="value must be a positive finite number"):
        coef.load_state_dict({"value": 0.0})
