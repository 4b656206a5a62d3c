"""KL estimators, exact KL and KL-coefficient controllers."""

import json
import math

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from ppokit.algo import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    UnknownNameError,
    kl_full,
    kl_penalty,
    make_kl_controller,
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
    torch.testing.assert_close(kl_full(a2, b2), kl_divergence(Categorical(logits=a2[..., 1:]), Categorical(logits=b2[..., 1:])))
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
