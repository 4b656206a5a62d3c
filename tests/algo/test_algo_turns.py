"""Turn-level credit (ppokit.algo.turns) against float64 Python references and closed forms."""

import itertools
import math
import random

import pytest
import torch

from ppokit.algo import (
    compute_gae,
    gather_turn_values,
    place_at_turn_ends,
    spread_over_turns,
    sum_turn_rewards,
    turn_end_mask,
    turn_gae,
    turn_gae_advantages,
    turn_gae_rows,
    turn_group_advantages,
    turn_index_from_mask,
    turn_level_gae,
    turn_start_mask,
    turns_present,
)

F64 = torch.float64


# ----------------------------------------------------------------------------- layout helpers
def test_turn_index_from_mask_numbers_runs_of_action_tokens():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0], [1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0], [0] * 11])
    ti = turn_index_from_mask(mask)
    assert ti.tolist() == [[-1, 0, 0, -1, -1, 1, -1, 2, 2, 2, -1], [0, -1, 1, 1, 1, 1, -1, -1, -1, -1, -1], [-1] * 11]
    assert turn_start_mask(ti).int().tolist()[0] == [0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0]
    assert turn_end_mask(ti).int().tolist()[0] == [0, 0, 1, 0, 0, 1, 0, 0, 0, 1, 0]
    assert turns_present(ti, 4).tolist() == [[True, True, True, False], [True, True, False, False], [False] * 4]


def test_gather_sum_spread_and_place_are_inverse_views_of_the_layout():
    ti = torch.tensor([[-1, 0, 0, -1, 1, 1, 1, -1], [0, -1, -1, 1, -1, 2, 2, -1]])
    token_values = torch.arange(16, dtype=F64).reshape(2, 8)
    assert gather_turn_values(token_values, ti, 3).tolist() == [[1.0, 4.0, 0.0], [8.0, 11.0, 13.0]]
    token_rewards = torch.ones(2, 8, dtype=F64)
    assert sum_turn_rewards(token_rewards, ti, 3).tolist() == [[2.0, 3.0, 0.0], [1.0, 1.0, 2.0]]
    per_turn = torch.tensor([[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]], dtype=F64)
    assert spread_over_turns(per_turn, ti).tolist() == [[0, 10, 10, 0, 20, 20, 20, 0], [40, 0, 0, 50, 0, 60, 60, 0]]
    assert place_at_turn_ends(per_turn, ti).tolist() == [[0, 0, 10, 0, 0, 0, 20, 0], [40, 0, 0, 50, 0, 0, 60, 0]]
    assert sum_turn_rewards(place_at_turn_ends(per_turn, ti), ti, 3)[0, :2].tolist() == [10.0, 20.0]


def test_layout_errors_are_clear():
    with pytest.raises(ValueError, match="K = 2 turn slots"):
        spread_over_turns(torch.zeros(1, 2), torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match="found -2"):
        turn_start_mask(torch.tensor([[-2, 0]]))
    with pytest.raises(ValueError, match="integer tensor"):
        turn_start_mask(torch.tensor([[0.0, 1.0]]))


# ----------------------------------------------------------------------------- turn-level GAE
def naive_turn_level(turn_index, turn_values, turn_rewards, final_rewards, truncated, last_values, gamma, lam):
    """Per row: the turns present, textbook GAE over them, each turn's A/R on its tokens."""
    B, T = len(turn_index), len(turn_index[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        present = sorted({k for k in turn_index[b] if k >= 0})
        if not present:
            continue
        r = [turn_rewards[b][k] for k in present]
        r[-1] += final_rewards[b]
        v = [turn_values[b][k] for k in present]
        boot = last_values[b] if truncated[b] else 0.0
        a = [0.0] * len(present)
        running = 0.0
        for i in reversed(range(len(present))):
            v_next = v[i + 1] if i + 1 < len(present) else boot
            running = r[i] + gamma * v_next - v[i] + gamma * lam * running
            a[i] = running
        by_turn = {k: (a[i], a[i] + v[i]) for i, k in enumerate(present)}
        for t, k in enumerate(turn_index[b]):
            if k >= 0:
                adv[b][t], ret[b][t] = by_turn[k]
    return adv, ret


def _random_turn_batch(seed, B=5, T=30, K=5):
    rng = random.Random(seed)
    rows = []
    for b in range(B):
        n_turns = rng.randint(0 if b == B - 1 else 1, K)
        row, t = [-1] * T, rng.randint(1, 3)
        for k in range(n_turns):
            length = rng.randint(1, 3)
            if t + length > T:
                break
            row[t : t + length] = [k] * length
            t += length + rng.randint(1, 3)
        rows.append(row)
    g = torch.Generator().manual_seed(seed)
    turn_index = torch.tensor(rows)
    turn_values = torch.randn(B, K, generator=g, dtype=F64)
    turn_rewards = torch.randn(B, K, generator=g, dtype=F64)
    final_rewards = torch.randn(B, generator=g, dtype=F64)
    truncated = torch.tensor([rng.random() < 0.5 for _ in range(B)])
    last_values = torch.randn(B, generator=g, dtype=F64)
    return turn_index, turn_values, turn_rewards, final_rewards, truncated, last_values


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.3)])
def test_turn_level_gae_matches_naive(seed, gamma, lam):
    ti, tv, tr, fr, trunc, lv = _random_turn_batch(seed)
    adv, ret = turn_level_gae(
        turn_index=ti,
        turn_values=tv,
        turn_rewards=tr,
        final_rewards=fr,
        truncated=trunc,
        last_values=lv,
        gamma=gamma,
        lam=lam,
    )
    ref_adv, ref_ret = naive_turn_level(
        ti.tolist(), tv.tolist(), tr.tolist(), fr.tolist(), trunc.tolist(), lv.tolist(), gamma, lam
    )
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=F64), rtol=0, atol=1e-12)
    assert (adv[ti < 0] == 0).all() and (ret[ti < 0] == 0).all()


def test_turn_level_gae_closed_form_three_turns():
    # one row, three turns of 2, 1, 2 tokens; final reward 1; terminated
    ti = torch.tensor([[-1, 0, 0, -1, 1, -1, -1, 2, 2, -1]])
    v = torch.tensor([[0.2, 0.4, 0.8]], dtype=F64)
    r = torch.tensor([[0.0, -0.1, 0.0]], dtype=F64)
    gamma, lam = 0.9, 0.8
    adv, ret = turn_level_gae(
        turn_index=ti, turn_values=v, turn_rewards=r, final_rewards=torch.tensor([1.0], dtype=F64), gamma=gamma, lam=lam
    )
    a2 = 1.0 - 0.8
    a1 = -0.1 + gamma * 0.8 - 0.4 + gamma * lam * a2
    a0 = 0.0 + gamma * 0.4 - 0.2 + gamma * lam * a1
    assert adv[0].tolist() == pytest.approx([0, a0, a0, 0, a1, 0, 0, a2, a2, 0], abs=1e-14)
    assert ret[0].tolist() == pytest.approx(
        [0, a0 + 0.2, a0 + 0.2, 0, a1 + 0.4, 0, 0, a2 + 0.8, a2 + 0.8, 0], abs=1e-14
    )


def test_truncation_bootstraps_from_last_values_and_termination_from_zero():
    ti = torch.tensor([[0, -1, 1], [0, -1, 1]])
    v = torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=F64)
    trunc = torch.tensor([True, False])
    lv = torch.tensor([2.0, 2.0], dtype=F64)
    adv, _ = turn_level_gae(turn_index=ti, turn_values=v, truncated=trunc, last_values=lv, gamma=1.0, lam=1.0)
    assert adv[0, 2].item() == pytest.approx(2.0 - 0.5) and adv[1, 2].item() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="truncated episodes need last_values"):
        turn_level_gae(turn_index=ti, turn_values=v, truncated=trunc, gamma=1.0, lam=1.0)


def test_one_token_turns_reduce_turn_level_to_token_level_gae():
    g = torch.Generator().manual_seed(7)
    mask = torch.tensor([[0, 1, 0, 0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    ti = turn_index_from_mask(mask)
    values = torch.randn(2, 9, generator=g, dtype=F64)
    rewards = torch.where(mask, torch.randn(2, 9, generator=g, dtype=F64), torch.zeros((), dtype=F64))
    token_adv, token_ret = compute_gae(rewards, values, gamma=0.95, lam=0.9, mask=mask)
    adv, ret = turn_gae_advantages(rewards=rewards, mask=mask, values=values, gamma=0.95, lam=0.9)
    torch.testing.assert_close(adv, token_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, token_ret, rtol=0, atol=1e-12)
    adv2, _ = turn_gae_advantages(rewards=rewards, mask=mask, values=values, turn_index=ti, gamma=0.95, lam=0.9)
    torch.testing.assert_close(adv2, adv, rtol=0, atol=0)


def test_uniform_signature_reads_values_at_turn_starts_and_sums_token_rewards():
    ti = torch.tensor([[-1, 0, 0, 0, -1, 1, 1]])
    mask = ti >= 0
    values = torch.tensor([[9.0, 0.3, 5.0, 5.0, 9.0, 0.6, 5.0]], dtype=F64)
    rewards = torch.tensor([[0.0, -0.01, -0.01, 0.2, 0.0, -0.01, 1.0]], dtype=F64)  # per-token KL + turn rewards
    adv, ret = turn_gae_advantages(
        rewards=rewards,
        mask=mask,
        values=values,
        turn_index=ti,
        gamma=1.0,
        lam=1.0,
        last_values=torch.zeros(1, dtype=F64),
        group_ids=None,
        unused_option=1,
    )
    ref_adv, ref_ret = turn_level_gae(
        turn_index=ti,
        turn_values=torch.tensor([[0.3, 0.6]], dtype=F64),
        turn_rewards=torch.tensor([[0.18, 0.99]], dtype=F64),
        gamma=1.0,
        lam=1.0,
    )
    torch.testing.assert_close(adv, ref_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=0, atol=1e-12)
    assert adv[0, 1].item() == pytest.approx(0.18 + 0.99 - 0.3)


def test_turn_level_argument_errors():
    ti = torch.tensor([[0, -1, 1]])
    v = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(ValueError, match="turn_mask excludes a turn"):
        turn_level_gae(turn_index=ti, turn_values=v, turn_mask=torch.tensor([[True, False]]))
    with pytest.raises(ValueError, match="K = 2 turn slots"):
        turn_level_gae(turn_index=torch.tensor([[0, 2]]), turn_values=v)
    with pytest.raises(ValueError, match=r"final_rewards shape \(2,\)"):
        turn_level_gae(turn_index=ti, turn_values=v, final_rewards=torch.zeros(2, dtype=F64))
    with pytest.raises(ValueError, match="needs values"):
        turn_gae_advantages(rewards=v, mask=None, turn_index=ti)
    with pytest.raises(ValueError, match="one episode per row"):
        turn_gae_advantages(
            rewards=torch.zeros(1, 3, dtype=F64),
            mask=None,
            values=torch.zeros(1, 3, dtype=F64),
            turn_index=ti,
            dones=torch.tensor([[0.0, 1.0, 0.0]]),
        )
    with pytest.raises(ValueError, match="mask excludes"):
        turn_gae_advantages(
            rewards=torch.zeros(1, 3, dtype=F64),
            mask=torch.tensor([[True, False, False]]),
            values=torch.zeros(1, 3, dtype=F64),
            turn_index=ti,
        )


def test_turn_gae_with_a_gap_in_the_turn_mask_skips_the_missing_turn():
    r = torch.tensor([[1.0, 100.0, 2.0]], dtype=F64)
    v = torch.tensor([[0.5, 100.0, 0.25]], dtype=F64)
    adv, ret = turn_gae(r, v, gamma=0.5, lam=1.0, turn_mask=torch.tensor([[True, False, True]]))
    a2 = 2.0 - 0.25
    assert adv.tolist()[0] == pytest.approx([1.0 + 0.5 * 0.25 - 0.5 + 0.5 * a2, 0.0, a2])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_turn_gae_rows_matches_the_stream_layout_for_shuffled_rows(seed):
    ti, tv, tr, fr, trunc, lv = _random_turn_batch(seed)
    stream_adv, stream_ret = turn_level_gae(
        turn_index=ti,
        turn_values=tv,
        turn_rewards=tr,
        final_rewards=fr,
        truncated=trunc,
        last_values=lv,
        gamma=0.9,
        lam=0.7,
    )
    rows = []  # one row per (episode, turn present), with the final reward on the last turn
    for b in range(ti.shape[0]):
        present = sorted({k for k in ti[b].tolist() if k >= 0})
        for k in present:
            reward = tr[b, k].item() + (fr[b].item() if k == present[-1] else 0.0)
            first_token = ti[b].tolist().index(k)
            rows.append(
                (b, k, tv[b, k].item(), reward, stream_adv[b, first_token].item(), stream_ret[b, first_token].item())
            )
    random.Random(seed).shuffle(rows)
    columns = list(zip(*rows))
    adv, ret = turn_gae_rows(
        episode_index=torch.tensor(columns[0]),
        turn_number=torch.tensor(columns[1]),
        values=torch.tensor(columns[2], dtype=F64),
        rewards=torch.tensor(columns[3], dtype=F64),
        truncated=trunc,
        last_values=lv,
        num_episodes=ti.shape[0],
        gamma=0.9,
        lam=0.7,
    )
    torch.testing.assert_close(adv, torch.tensor(columns[4], dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(columns[5], dtype=F64), rtol=0, atol=1e-12)


def test_turn_gae_rows_errors():
    one = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError, match="same"):
        turn_gae_rows(episode_index=torch.tensor([0, 0]), turn_number=torch.tensor([1, 1]), values=one, rewards=one)
    with pytest.raises(ValueError, match="turn_number must be an integer tensor"):
        turn_gae_rows(episode_index=torch.tensor([0, 0]), turn_number=one, values=one, rewards=one)
    with pytest.raises(ValueError, match="num_episodes is 1"):
        turn_gae_rows(
            episode_index=torch.tensor([0, 1]),
            turn_number=torch.tensor([0, 0]),
            values=one,
            rewards=one,
            num_episodes=1,
        )


# ----------------------------------------------------------------------------- per-turn group advantages
def naive_turn_group(rewards, mask, groups, gamma, absent, norm_by_std, eps=1e-6):
    B, K = len(rewards), len(rewards[0])
    centered = [[0.0] * K for _ in range(B)]
    for b in range(B):
        for k in range(K):
            if absent == "skip" and not mask[b][k]:
                continue
            members = [j for j in range(B) if groups[j] == groups[b] and (absent == "zero" or mask[j][k])]
            vals = [rewards[j][k] if mask[j][k] else 0.0 for j in members]
            if len(members) < 2:
                continue
            mu = sum(vals) / len(vals)
            c = (rewards[b][k] if mask[b][k] else 0.0) - mu
            if norm_by_std:
                sd = math.sqrt(sum((x - mu) ** 2 for x in vals) / (len(vals) - 1))
                c /= sd + eps
            centered[b][k] = c
    adv = [[0.0] * K for _ in range(B)]
    for b in range(B):
        for t in range(K):
            if mask[b][t]:
                adv[b][t] = sum(gamma ** (k - t) * centered[b][k] for k in range(t, K))
    return adv


@pytest.mark.parametrize("absent", ["zero", "skip"])
@pytest.mark.parametrize("norm_by_std", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_turn_group_advantages_match_naive(absent, norm_by_std, seed):
    rng = random.Random(seed)
    B, K = 9, 4
    groups = [0, 0, 0, 1, 1, 2, 2, 2, 3]  # group 3 has one sample
    lengths = [rng.randint(1, K) for _ in range(B)]
    mask = [[k < lengths[b] for k in range(K)] for b in range(B)]
    rewards = [[rng.gauss(0, 1) for _ in range(K)] for _ in range(B)]
    adv = turn_group_advantages(
        torch.tensor(rewards, dtype=F64),
        torch.tensor(groups),
        turn_mask=torch.tensor(mask),
        gamma=0.9,
        absent=absent,
        norm_by_std=norm_by_std,
    )
    ref = naive_turn_group(rewards, mask, groups, 0.9, absent, norm_by_std)
    torch.testing.assert_close(adv, torch.tensor(ref, dtype=F64), rtol=0, atol=1e-10)
    assert (adv[8] == 0).all()  # single-sample group


def _expected_gradients(p, r_stop, r_cont, r_next, n, absent):
    """Exact E[(1/n) sum_b A_{b,0} d/dtheta log pi(a_{b,0})] for a group of n episodes.

    Turn 0: continue with probability p = sigmoid(theta) (reward r_cont, then a forced
    turn 1 with reward r_next) or stop (reward r_stop). Enumerates all 2^n groups.
    """
    total = 0.0
    for actions in itertools.product([0, 1], repeat=n):  # 1 = continue
        prob = math.prod(p if a else 1 - p for a in actions)
        rewards = torch.tensor([[r_cont, r_next] if a else [r_stop, 0.0] for a in actions], dtype=F64)
        mask = torch.tensor([[True, bool(a)] for a in actions])
        adv = turn_group_advantages(rewards, torch.zeros(n, dtype=torch.long), turn_mask=mask, absent=absent)
        score = [(1 - p) if a else -p for a in actions]  # d log pi(a) / d theta
        total += prob * sum(adv[b, 0].item() * score[b] for b in range(n)) / n
    return total


def test_zero_filled_turn_statistics_are_unbiased_and_skipping_absent_turns_is_biased():
    p, r_stop, r_cont, r_next, n = 0.3, 0.2, 0.1, 0.5, 4
    true_gradient = p * (1 - p) * (r_cont + r_next - r_stop)  # d/dtheta of J = (1-p) r_stop + p (r_cont + r_next)
    zero = _expected_gradients(p, r_stop, r_cont, r_next, n, "zero")
    skip = _expected_gradients(p, r_stop, r_cont, r_next, n, "skip")
    # group-mean centring scales the gradient by (n-1)/n and adds no bias
    assert zero == pytest.approx((n - 1) / n * true_gradient, abs=1e-12)
    # per-index means over the surviving episodes cancel the value of continuing:
    # the turn-1 reward (r_next) disappears from the gradient, a hidden penalty on "continue"
    assert skip == pytest.approx((n - 1) / n * p * (1 - p) * (r_cont - r_stop), abs=1e-12)
    assert skip < 0 < true_gradient  # here the biased estimator even points the wrong way


def test_turn_group_argument_errors():
    with pytest.raises(ValueError, match="absent must be"):
        turn_group_advantages(torch.zeros(2, 2), torch.tensor([0, 0]), absent="drop")
    with pytest.raises(ValueError, match=r"group_ids shape \(3,\)"):
        turn_group_advantages(torch.zeros(2, 2), torch.tensor([0, 0, 1]))
