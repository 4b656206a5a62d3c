"""Critic-free estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++) on hand-made groups."""

import math

import numpy as np
import pytest
import torch

from ppokit.algo import ADVANTAGE_ESTIMATORS, get_advantage_estimator

# six samples, interleaved groups: 7 -> rows 0, 2, 5; 3 -> rows 1, 4; 9 -> row 3 (alone)
GROUP_IDS = torch.tensor([7, 3, 7, 9, 3, 7])
SCORES = [1.0, 4.0, 0.0, 5.0, 2.0, 2.0]
LENGTHS = [3, 5, 1, 2, 4, 5]
T = 5


def _batch():
    """Sequence rewards on the last valid token; junk (100) on padding that must be ignored."""
    mask = torch.zeros(6, T, dtype=torch.bool)
    rewards = torch.full((6, T), 100.0, dtype=torch.float64)
    for b, (n, s) in enumerate(zip(LENGTHS, SCORES)):
        mask[b, :n] = True
        rewards[b, :n] = 0.0
        rewards[b, n - 1] = s
    return rewards, mask


def _tokens(per_row, mask):
    return torch.tensor(per_row, dtype=torch.float64)[:, None] * mask


def test_grpo_hand_computed():
    rewards, mask = _batch()
    eps = 1e-6
    adv, ret = get_advantage_estimator("grpo")(rewards=rewards, mask=mask, group_ids=GROUP_IDS, eps=eps)
    # group 7: scores 1, 0, 2 -> mean 1, unbiased std 1; group 3: 4, 2 -> mean 3, std sqrt(2); group 9 alone -> 0
    s2 = math.sqrt(2)
    expected = [0.0, 1 / (s2 + eps), -1 / (1 + eps), 0.0, -1 / (s2 + eps), 1 / (1 + eps)]
    torch.testing.assert_close(adv, _tokens(expected, mask), rtol=0, atol=1e-12)
    assert torch.equal(ret, adv)
    assert (adv[~mask] == 0).all()


def test_dr_grpo_does_not_divide_by_std():
    rewards, mask = _batch()
    adv, _ = get_advantage_estimator("grpo")(rewards=rewards, mask=mask, group_ids=GROUP_IDS, norm_by_std=False)
    torch.testing.assert_close(adv, _tokens([0.0, 1.0, -1.0, 0.0, -1.0, 1.0], mask), rtol=0, atol=1e-12)


def test_grpo_with_the_batch_std_divides_by_the_spread_of_all_scores():
    """TRL's scale_rewards="batch": the group's mean, the whole batch's unbiased std."""
    rewards, mask = _batch()
    eps = 1e-6
    adv, ret = get_advantage_estimator("grpo")(rewards=rewards, mask=mask, group_ids=GROUP_IDS, batch_std=True, eps=eps)
    spread = float(np.std(SCORES, ddof=1))  # all six scores, the lone group's too
    expected = [c / (spread + eps) for c in [0.0, 1.0, -1.0, 0.0, -1.0, 1.0]]  # Dr. GRPO's centring
    torch.testing.assert_close(adv, _tokens(expected, mask), rtol=0, atol=1e-12)
    assert torch.equal(ret, adv)
    # a batch whose scores are all equal: zero, not nan; a batch of one sample: zero
    flat, _ = get_advantage_estimator("grpo")(
        rewards=torch.ones(4, 1, dtype=torch.float64), mask=None, group_ids=torch.tensor([0, 0, 1, 1]), batch_std=True
    )
    one, _ = get_advantage_estimator("grpo")(
        rewards=torch.ones(1, 1, dtype=torch.float64), mask=None, group_ids=torch.tensor([0]), batch_std=True
    )
    assert torch.equal(flat, torch.zeros(4, 1)) and torch.equal(one, torch.zeros(1, 1))
    # without the std (Dr. GRPO) the switch changes nothing
    plain, _ = get_advantage_estimator("grpo")(rewards=rewards, mask=mask, group_ids=GROUP_IDS, norm_by_std=False)
    both, _ = get_advantage_estimator("grpo")(
        rewards=rewards, mask=mask, group_ids=GROUP_IDS, norm_by_std=False, batch_std=True
    )
    assert torch.equal(plain, both)


def test_rloo_leave_one_out():
    rewards, mask = _batch()
    adv, ret = get_advantage_estimator("rloo")(rewards=rewards, mask=mask, group_ids=GROUP_IDS)
    # group 7: 1-(0+2)/2=0, 0-(1+2)/2=-1.5, 2-(1+0)/2=1.5; group 3: 4-2=2, 2-4=-2; alone: 0
    torch.testing.assert_close(adv, _tokens([0.0, 2.0, -1.5, 0.0, -2.0, 1.5], mask), rtol=0, atol=1e-12)
    assert torch.equal(ret, adv)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_single_sample_groups_give_zero_not_nan(name):
    rewards, mask = _batch()
    ids = torch.arange(6)  # every group has one sample
    adv, ret = get_advantage_estimator(name)(rewards=rewards, mask=mask, group_ids=ids)
    assert not torch.isnan(adv).any() and not torch.isnan(ret).any()
    assert (adv == 0).all()


def test_reinforce_pp_restarts_after_eos_hand_case():
    gamma = 0.5
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 2.0, 9.0, 0.0, 4.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 1, 1]])
    adv, ret = get_advantage_estimator("reinforce_pp")(rewards=rewards, mask=mask, gamma=gamma)
    # row 0: G = .25, .5, 1 then padding; row 1 restarts at the masked position 2 (its reward 9 is ignored):
    # G4 = 4, G3 = 0 + .5 * 4 = 2, G2 = 0 (reset), G1 = 2 + .5 * 0 = 2, G0 = 0 + .5 * 2 = 1
    expected_ret = torch.tensor([[0.25, 0.5, 1.0, 0, 0], [1.0, 2.0, 0.0, 2.0, 4.0]], dtype=torch.float64)
    torch.testing.assert_close(ret, expected_ret, rtol=0, atol=1e-14)
    valid = np.array([0.25, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0])
    whitened = (expected_ret.numpy() - valid.mean()) / math.sqrt(valid.var(ddof=1) + 1e-8)
    expected_adv = torch.from_numpy(np.where(mask.numpy() == 1, whitened, 0.0))
    torch.testing.assert_close(adv, expected_adv, rtol=0, atol=1e-12)
    assert adv[mask.bool()].mean().item() == pytest.approx(0.0, abs=1e-12)


def test_reinforce_pp_alias_and_gamma_one():
    rewards, mask = _batch()
    a1, r1 = get_advantage_estimator("reinforce_plus_plus")(rewards=rewards, mask=mask)
    # gamma = 1: every valid token of a row gets the row's score
    torch.testing.assert_close(r1, _tokens(SCORES, mask), rtol=0, atol=1e-14)
    a2, _ = get_advantage_estimator("reinforce_pp")(rewards=rewards, mask=mask)
    assert torch.equal(a1, a2)


def test_reinforce_pp_baseline_hand_computed():
    rewards, mask = _batch()
    adv, ret = get_advantage_estimator("reinforce_pp_baseline")(rewards=rewards, mask=mask, group_ids=GROUP_IDS)
    centered = np.array([0.0, 1.0, -1.0, 0.0, -1.0, 1.0])  # score - group mean
    tok = centered[:, None] * mask.numpy()
    sel = tok[mask.numpy()]
    expected = np.where(mask.numpy(), (tok - sel.mean()) / math.sqrt(sel.var(ddof=1) + 1e-8), 0.0)
    torch.testing.assert_close(adv, torch.from_numpy(expected), rtol=0, atol=1e-12)
    assert torch.equal(ret, adv)
    a2, _ = get_advantage_estimator("reinforce_plus_plus_baseline")(rewards=rewards, mask=mask, group_ids=GROUP_IDS)
    assert torch.equal(a2, adv)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_need_group_ids(name):
    rewards, mask = _batch()
    with pytest.raises(ValueError, match="needs group_ids"):
        get_advantage_estimator(name)(rewards=rewards, mask=mask)
    with pytest.raises(ValueError, match=r"group_ids shape \(5,\) != \(B,\) = \(6,\)"):
        get_advantage_estimator(name)(rewards=rewards, mask=mask, group_ids=GROUP_IDS[:5])


def test_every_estimator_accepts_the_uniform_signature():
    rewards, mask = _batch()
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    values = torch.zeros_like(rewards)
    kwargs = dict(
        rewards=rewards,
        mask=mask,
        values=values,
        group_ids=GROUP_IDS,
        gamma=1.0,
        lam=1.0,
        dones=None,
        last_values=None,
        norm_by_std=True,
        eps=1e-6,
        some_future_option=123,
    )
    for name in ADVANTAGE_ESTIMATORS.names():
        adv, ret = ADVANTAGE_ESTIMATORS.get(name)(**kwargs)
        assert adv.shape == rewards.shape == ret.shape, name
        assert torch.isfinite(adv).all() and (adv[~mask] == 0).all(), name
    # gae with gamma = lam = 1 and zero values: the advantage of each token is the row's score
    adv, _ = ADVANTAGE_ESTIMATORS.get("gae")(**kwargs)
    torch.testing.assert_close(adv, _tokens(SCORES, mask), rtol=0, atol=1e-14)
