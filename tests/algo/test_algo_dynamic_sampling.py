"""DAPO's dynamic-sampling filter (ppokit.algo.dynamic_sampling) against a naive float64 loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ppokit.algo.dynamic_sampling import group_range, groups_with_variance


def naive_keep(rewards, group_of) -> list[bool]:
    """Python loop in float64: a group is kept when it has >= 2 samples and some sample's
    reward differs from the group's first (std > 0 in exact arithmetic)."""
    values = [float(r) for r in rewards]
    members: dict[int, list[float]] = {}
    for value, g in zip(values, group_of):
        members.setdefault(int(g), []).append(value)
    varied = {g: len(v) >= 2 and any(x != v[0] for x in v) for g, v in members.items()}
    return [varied[int(g)] for g in group_of]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_filter_matches_the_naive_loop(seed, group_size):
    gen = torch.Generator().manual_seed(seed)
    n = group_size * 16
    rewards = torch.randint(0, 2, (n,), generator=gen).float()  # 0/1 rewards: many constant groups
    rewards[: group_size * 3] = torch.tensor([0.0, 1.0, 0.5])[torch.arange(3).repeat_interleave(group_size)]
    keep = groups_with_variance(rewards, group_size)
    group_of = [i // group_size for i in range(n)]
    assert keep.dtype == torch.bool and keep.shape == (n,)
    assert keep.tolist() == naive_keep(rewards, group_of)
    assert not keep[: group_size * 3].any()  # all 0, all 1, all 0.5
    # where the mean-based std is exact (0/1 values) it agrees: std > 0 <=> kept
    stds = [np.std(rewards[g * group_size : (g + 1) * group_size].double().numpy()) for g in range(16)]
    assert [s > 0 for s in stds] == keep[::group_size].tolist()


@pytest.mark.parametrize("seed", range(3))
def test_filter_by_group_ids_matches_the_naive_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    group_ids = torch.randint(0, 7, (40,), generator=gen) * 3 + 11  # any order, sparse ids, uneven sizes
    rewards = torch.randint(0, 3, (40,), generator=gen).double() / 2
    keep = groups_with_variance(rewards, group_ids=group_ids)
    assert keep.tolist() == naive_keep(rewards, group_ids.tolist())
    # the same groups laid out contiguously give the same decision per row
    order = torch.argsort(group_ids, stable=True)
    assert keep[order].tolist() == naive_keep(rewards[order], group_ids[order].tolist())


def test_equal_non_representable_rewards_are_constant():
    """0.1 three times: numpy's mean-based std is 1.4e-17 > 0; the exact test drops the group."""
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.3], dtype=torch.float64)
    assert np.std([0.1, 0.1, 0.1]) > 0  # what a mean-based test would keep
    assert groups_with_variance(rewards, 3).tolist() == [False] * 3 + [True] * 3


def test_edge_cases():
    # every group constant: nothing kept
    assert not groups_with_variance(torch.tensor([1.0, 1.0, 0.0, 0.0, -2.0, -2.0]), 2).any()
    # one group: kept when it varies
    assert groups_with_variance(torch.tensor([0.0, 0.0, 1.0, 0.0]), 4).all()
    assert not groups_with_variance(torch.tensor([3.0, 3.0, 3.0, 3.0]), 4).any()
    # integer rewards work as numbers
    assert groups_with_variance(torch.tensor([0, 1, 1, 1]), 2).tolist() == [True, True, False, False]
    # groups of one (by ids) have no variance; a NaN group is dropped
    assert groups_with_variance(torch.tensor([1.0, 0.0, 0.0]), group_ids=torch.tensor([5, 6, 6])).tolist() == [
        False,
        False,
        False,
    ]
    nan = torch.tensor([math.nan, 1.0, 0.0, 1.0])
    assert groups_with_variance(nan, 2).tolist() == [False, False, True, True]
    # an empty batch
    assert groups_with_variance(torch.zeros(0), 4).shape == (0,)


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="6 rewards do not split into groups of group_size=4"):
        groups_with_variance(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="exactly one of group_size and group_ids"):
        groups_with_variance(torch.zeros(4))
    with pytest.raises(ValueError, match="exactly one of group_size and group_ids"):
        groups_with_variance(torch.zeros(4), 2, group_ids=torch.zeros(4))
    with pytest.raises(ValueError, match=r"group_ids shape \(3,\) != \(N,\) = \(4,\)"):
        groups_with_variance(torch.zeros(4), group_ids=torch.zeros(3))
    with pytest.raises(ValueError, match=r"rewards must be \(N,\)"):
        groups_with_variance(torch.zeros(2, 2), 2)


def test_group_range_gives_each_groups_extremes_and_size():
    lo, hi, count, index = group_range(
        torch.tensor([3.0, -1.0, 2.0, 2.0, 7.0]), group_ids=torch.tensor([9, 9, 4, 4, 9])
    )
    assert lo.tolist() == [2.0, -1.0] and hi.tolist() == [2.0, 7.0] and count.tolist() == [2, 3]
    assert index.tolist() == [1, 1, 0, 0, 1]
