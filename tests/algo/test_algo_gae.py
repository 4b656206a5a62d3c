"""compute_gae against plain-Python float64 references and closed forms."""

import math

import pytest
import torch

from ppokit.algo import compute_gae, get_advantage_estimator


def naive_gae(rewards, values, gamma, lam, mask=None, dones=None, last_values=None):
    """Forward-sum form, independent of the backward recursion under test.

    For every valid t, walk forward over the valid positions t = t0 < t1 < ...:
    A_t = sum_k (gamma lam)^k delta_{t_k}, stopping after a done step, where
    delta_s = r_s + gamma * V(next valid after s, else last_value) * (1 - done_s) - V_s.
    """
    B, T = len(rewards), len(rewards[0])
    mask = mask or [[1] * T for _ in range(B)]
    dones = dones or [[0] * T for _ in range(B)]
    last_values = last_values or [0.0] * B
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        valid = [t for t in range(T) if mask[b][t]]

        def delta(i):
            s = valid[i]
            v_next = values[b][valid[i + 1]] if i + 1 < len(valid) else last_values[b]
            return rewards[b][s] + gamma * v_next * (1 - dones[b][s]) - values[b][s]

        for i, t in enumerate(valid):
            total = 0.0
            for k, j in enumerate(range(i, len(valid))):
                total += (gamma * lam) ** k * delta(j)
                if dones[b][valid[j]]:
                    break
            adv[b][t] = total
            ret[b][t] = total + values[b][t]
    return adv, ret


def _random_case(seed, B=5, T=17):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.75
    mask[0, :] = True  # a full row
    mask[1, 3:7] = False  # an observation gap inside a turn sequence
    mask[2, 10:] = False  # padding after EOS
    dones = (torch.rand(B, T, generator=g) < 0.15).to(torch.float64)
    last_values = torch.randn(B, generator=g, dtype=torch.float64)
    return rewards, values, mask, dones, last_values


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.9, 0.5), (1.0, 1.0)])
def test_gae_matches_naive_with_masks_dones_and_bootstrap(seed, gamma, lam):
    rewards, values, mask, dones, last_values = _random_case(seed)
    adv, ret = compute_gae(rewards, values, gamma=gamma, lam=lam, mask=mask, dones=dones, last_values=last_values)
    ref_adv, ref_ret = naive_gae(
        rewards.tolist(), values.tolist(), gamma, lam, mask.int().tolist(), dones.int().tolist(), last_values.tolist()
    )
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


@pytest.mark.parametrize("seed", [5, 6])
def test_gae_without_mask_matches_naive_and_all_ones_mask(seed):
    rewards, values, _, dones, last_values = _random_case(seed, B=4, T=9)
    adv, ret = compute_gae(rewards, values, gamma=0.97, lam=0.9, dones=dones, last_values=last_values)
    ref_adv, ref_ret = naive_gae(
        rewards.tolist(), values.tolist(), 0.97, 0.9, None, dones.int().tolist(), last_values.tolist()
    )
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), rtol=0, atol=1e-12)
    adv2, ret2 = compute_gae(
        rewards, values, gamma=0.97, lam=0.9, mask=torch.ones(4, 9), dones=dones, last_values=last_values
    )
    torch.testing.assert_close(adv2, adv, rtol=0, atol=0)
    torch.testing.assert_close(ret2, ret, rtol=0, atol=0)


def test_gae_gap_bootstraps_across_observation_tokens_hand_case():
    # one row: valid, obs, obs, valid; the first step bootstraps from V[3]
    gamma, lam = 0.9, 0.8
    r = torch.tensor([[1.0, 100.0, 100.0, 2.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 7.0, 7.0, 0.25]], dtype=torch.float64)
    m = torch.tensor([[1, 0, 0, 1]])
    adv, ret = compute_gae(r, v, gamma=gamma, lam=lam, mask=m, last_values=torch.tensor([3.0], dtype=torch.float64))
    a3 = 2.0 + gamma * 3.0 - 0.25
    a0 = (1.0 + gamma * 0.25 - 0.5) + gamma * lam * a3
    expected = torch.tensor([[a0, 0.0, 0.0, a3]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-14)
    torch.testing.assert_close(
        ret, torch.tensor([[a0 + 0.5, 0, 0, a3 + 0.25]], dtype=torch.float64), rtol=0, atol=1e-14
    )


@pytest.mark.parametrize("gamma,lam,c", [(0.99, 0.95, 0.0), (0.9, 0.7, 2.0), (0.5, 1.0, -1.0)])
def test_gae_closed_form_constant_value_unit_reward(gamma, lam, c):
    # Episode of n steps, reward 1 each step, constant value prediction c, done at the end
    # (the set-up of Stable-Baselines3's GAE test). With m = n - 1 - t:
    # A_t = (1 + gamma c - c) (1 - (gamma lam)^m) / (1 - gamma lam) + (gamma lam)^m (1 - c).
    n = 12
    rewards = torch.ones(1, n, dtype=torch.float64)
    values = torch.full((1, n), c, dtype=torch.float64)
    dones = torch.zeros(1, n)
    dones[0, -1] = 1
    adv, ret = compute_gae(
        rewards, values, gamma=gamma, lam=lam, dones=dones, last_values=torch.tensor([123.0], dtype=torch.float64)
    )
    gl = gamma * lam
    for t in range(n):
        m = n - 1 - t
        expected = (1 + gamma * c - c) * (1 - gl**m) / (1 - gl) + gl**m * (1 - c)
        assert adv[0, t].item() == pytest.approx(expected, abs=1e-12)
        if lam == 1.0:  # the return is the discounted sum of the remaining rewards
            assert ret[0, t].item() == pytest.approx((1 - gamma ** (n - t)) / (1 - gamma), abs=1e-12)


def _discounted_mc(rewards, dones, last_values, gamma):
    B, T = len(rewards), len(rewards[0])
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            g, k, s = 0.0, 0, t
            while True:
                g += gamma**k * rewards[b][s]
                if dones[b][s]:
                    break
                if s == T - 1:
                    g += gamma ** (k + 1) * last_values[b]
                    break
                s += 1
                k += 1
            out[b][t] = g
    return out


def test_gae_lambda_one_is_monte_carlo_return_minus_value():
    rewards, values, _, dones, last_values = _random_case(11, B=3, T=10)
    gamma = 0.95
    adv, ret = compute_gae(rewards, values, gamma=gamma, lam=1.0, dones=dones, last_values=last_values)
    mc = torch.tensor(
        _discounted_mc(rewards.tolist(), dones.int().tolist(), last_values.tolist(), gamma), dtype=torch.float64
    )
    torch.testing.assert_close(adv, mc - values, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, mc, rtol=0, atol=1e-12)


def test_gae_lambda_zero_is_one_step_td_error():
    rewards, values, _, dones, last_values = _random_case(12, B=3, T=10)
    gamma = 0.9
    adv, _ = compute_gae(rewards, values, gamma=gamma, lam=0.0, dones=dones, last_values=last_values)
    v_next = torch.cat([values[:, 1:], last_values[:, None]], dim=1)
    td = rewards + gamma * v_next * (1 - dones) - values
    torch.testing.assert_close(adv, td, rtol=0, atol=1e-14)


def test_gae_keeps_input_dtype_and_validates():
    r = torch.randn(2, 5)
    v = torch.randn(2, 5)
    adv, ret = compute_gae(r, v, gamma=0.99, lam=0.95)
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    with pytest.raises(ValueError, match=r"values shape \(2, 4\) != rewards shape \(2, 5\)"):
        compute_gae(r, v[:, :4], gamma=0.99, lam=0.95)
    with pytest.raises(ValueError, match="last_values"):
        compute_gae(r, v, gamma=0.99, lam=0.95, last_values=torch.zeros(3))
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(r, v, gamma=1.5, lam=0.95)


def test_gae_estimator_wrapper_needs_values_and_matches():
    rewards, values, mask, dones, last_values = _random_case(3)
    fn = get_advantage_estimator("gae")
    adv, ret = fn(
        rewards=rewards,
        mask=mask,
        values=values,
        gamma=0.9,
        lam=0.8,
        dones=dones,
        last_values=last_values,
        group_ids=None,
    )
    adv2, ret2 = compute_gae(rewards, values, gamma=0.9, lam=0.8, mask=mask, dones=dones, last_values=last_values)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    with pytest.raises(ValueError, match="needs values"):
        fn(rewards=rewards, mask=mask)


def test_gae_is_not_whitened():
    r = torch.tensor([[0.0, 0.0, 10.0]], dtype=torch.float64)
    v = torch.zeros(1, 3, dtype=torch.float64)
    adv, _ = compute_gae(r, v, gamma=1.0, lam=1.0)
    assert adv.tolist() == [[10.0, 10.0, 10.0]]
    assert not math.isnan(adv.sum().item())
