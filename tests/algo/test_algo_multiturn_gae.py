"""Token-level GAE on multi-turn rows: compute_gae skips environment tokens correctly.

A multi-turn row interleaves action tokens (mask 1) with observation / tool tokens
(mask 0). The reference below never sees the masked positions: it extracts each row's
action tokens into a plain list and runs textbook GAE on it, in float64 Python.
"""

import random

import pytest
import torch

from ppokit.algo import compute_gae, place_at_turn_ends, turn_index_from_mask


def _layout(rng: random.Random, T: int, n_turns: int):
    """A row: prompt, then turns of 1-4 action tokens separated by 1-5 env tokens, padding.

    Returns (action mask list, list of (start, end) per turn) or None if it does not fit.
    """
    mask = [0] * T
    t = rng.randint(1, 4)  # prompt tokens
    turns = []
    for k in range(n_turns):
        if k:
            t += rng.randint(1, 5)  # observation tokens between turns
        length = rng.randint(1, 4)
        if t + length > T:
            break
        for i in range(t, t + length):
            mask[i] = 1
        turns.append((t, t + length - 1))
        t += length
    return mask, turns


def naive_multiturn_gae(rewards, values, mask, gamma, lam, last_value):
    """Textbook GAE over the action tokens of one row, scattered back (0 elsewhere)."""
    idx = [t for t, m in enumerate(mask) if m]
    r = [rewards[t] for t in idx]
    v = [values[t] for t in idx]
    n = len(idx)
    adv = [0.0] * n
    running = 0.0
    for i in reversed(range(n)):
        v_next = v[i + 1] if i + 1 < n else last_value
        delta = r[i] + gamma * v_next - v[i]
        running = delta + gamma * lam * running
        adv[i] = running
    out_adv = [0.0] * len(mask)
    out_ret = [0.0] * len(mask)
    for i, t in enumerate(idx):
        out_adv[t] = adv[i]
        out_ret[t] = adv[i] + v[i]
    return out_adv, out_ret


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.8, 0.5)])
def test_gae_over_action_tokens_matches_a_reference_that_never_sees_env_tokens(seed, gamma, lam):
    rng = random.Random(seed)
    B, T = 6, 40
    masks, turn_rewards = [], []
    for _ in range(B):
        mask, turns = _layout(rng, T, n_turns=rng.randint(1, 5))
        masks.append(mask)
        turn_rewards.append([rng.gauss(0, 1) for _ in turns])
    mask = torch.tensor(masks, dtype=torch.bool)  # (B, T)
    turn_index = turn_index_from_mask(mask)  # (B, T)
    K = int(turn_index.max()) + 1
    per_turn = torch.zeros(B, K, dtype=torch.float64)
    for b, rs in enumerate(turn_rewards):
        per_turn[b, : len(rs)] = torch.tensor(rs, dtype=torch.float64)
    rewards = place_at_turn_ends(per_turn, turn_index)  # (B, T)
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    values[~mask] = float("nan")  # values on env tokens must never be read
    last_values = torch.randn(B, generator=g, dtype=torch.float64)
    last_values[::2] = 0.0  # terminated rows

    adv, ret = compute_gae(rewards, values, gamma=gamma, lam=lam, mask=mask, last_values=last_values)

    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    for b in range(B):
        ref_adv, ref_ret = naive_multiturn_gae(
            rewards[b].tolist(), values[b].tolist(), masks[b], gamma, lam, float(last_values[b])
        )
        torch.testing.assert_close(adv[b], torch.tensor(ref_adv, dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(ret[b], torch.tensor(ref_ret, dtype=torch.float64), rtol=0, atol=1e-12)


def test_last_token_of_a_turn_bootstraps_from_the_first_token_of_the_next_turn():
    # positions: 0 prompt | 1 2 turn 0 | 3 4 5 observation | 6 turn 1 | 7 padding
    mask = torch.tensor([[0, 1, 1, 0, 0, 0, 1, 0]], dtype=torch.bool)
    values = torch.tensor([[9.0, 0.5, 0.25, 7.0, 7.0, 7.0, 2.0, 9.0]], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 3.0, 0.0]], dtype=torch.float64)
    gamma, lam = 0.9, 0.5
    adv, ret = compute_gae(rewards, values, gamma=gamma, lam=lam, mask=mask)
    a6 = 3.0 - 2.0  # last action token of the episode: terminal
    a2 = 1.0 + gamma * 2.0 - 0.25 + gamma * lam * a6  # bootstraps from V at token 6, one discount step
    a1 = 0.0 + gamma * 0.25 - 0.5 + gamma * lam * a2
    expected = torch.tensor([[0.0, a1, a2, 0.0, 0.0, 0.0, a6, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-14)
    torch.testing.assert_close(ret, torch.where(mask, expected + values, torch.zeros_like(values)), rtol=0, atol=1e-14)


def test_a_reward_left_on_an_environment_token_is_ignored_so_place_it_on_the_turn():
    mask = torch.tensor([[1, 1, 0, 0, 1]], dtype=torch.bool)
    values = torch.zeros(1, 5, dtype=torch.float64)
    on_env_token = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    adv, _ = compute_gae(on_env_token, values, gamma=1.0, lam=1.0, mask=mask)
    assert (adv == 0).all()
    placed = place_at_turn_ends(torch.tensor([[1.0, 0.0]], dtype=torch.float64), turn_index_from_mask(mask))
    assert placed.tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0]]
    adv, _ = compute_gae(placed, values, gamma=1.0, lam=1.0, mask=mask)
    assert adv.tolist() == [[1.0, 1.0, 0.0, 0.0, 0.0]]
