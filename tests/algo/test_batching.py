"""Token-budget micro-batches: every row once, within the budget, the fewest, balanced; padding."""

from __future__ import annotations

import itertools

import pytest
import torch

from ppokit.algo.batching import fixed_micro_batches, padding_fraction, token_budget_micro_batches


def cost(lengths, rows) -> int:
    return len(rows) * max(lengths[i] for i in rows)


def set_partitions(items):
    """Every partition of ``items`` into non-empty blocks."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first]] + partition
        for i in range(len(partition)):
            yield partition[:i] + [[first] + partition[i]] + partition[i + 1 :]


@pytest.mark.parametrize("seed", range(40))
def test_partition_is_optimal_against_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 8, (1,), generator=g))
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    budget = int(torch.randint(max(lengths), 3 * max(lengths) + 1, (1,), generator=g))
    parts = [p.tolist() for p in token_budget_micro_batches(torch.tensor(lengths), budget)]
    assert sorted(i for p in parts for i in p) == list(range(n))  # every row exactly once
    assert all(cost(lengths, p) <= budget for p in parts)
    feasible = [q for q in set_partitions(list(range(n))) if all(cost(lengths, b) <= budget for b in q)]
    fewest = min(len(q) for q in feasible)
    assert len(parts) == fewest  # the fewest micro-batches
    best_max = min(max(cost(lengths, b) for b in q) for q in feasible if len(q) == fewest)
    assert max(cost(lengths, p) for p in parts) == best_max  # balanced: smallest largest cost


def test_rows_are_sorted_longest_first_and_a_long_row_goes_alone():
    lengths = torch.tensor([5, 300, 17, 17, 9, 120, 3])
    parts = token_budget_micro_batches(lengths, 100)
    flat = torch.cat(parts)
    assert lengths[flat].tolist() == sorted(lengths.tolist(), reverse=True)
    assert parts[0].tolist() == [1] and parts[1].tolist() == [5]  # longer than the budget: alone
    assert all(len(p) * int(lengths[p].max()) <= 100 for p in parts[2:])


def test_balancing_lowers_the_largest_micro_batch():
    # greedy alone: [8 8 4 4] [4 4 4 4] (costs 32, 16); balanced: [8 8 4] [4 4 4 4 4] (costs 24, 20)
    lengths = torch.tensor([8, 8] + [4] * 6)
    parts = token_budget_micro_batches(lengths, 32)
    assert [len(p) * int(lengths[p].max()) for p in parts] == [24, 20]


def test_bad_budget_and_empty_input():
    assert token_budget_micro_batches(torch.tensor([], dtype=torch.int64), 8) == []
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError):
            token_budget_micro_batches(torch.tensor([1, 2]), bad)


def test_fixed_micro_batches_keep_the_order():
    assert [p.tolist() for p in fixed_micro_batches(5, 2)] == [[0, 1], [2, 3], [4]]


def test_padding_fraction_against_a_naive_count():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 50, (13,), generator=g)
    parts = token_budget_micro_batches(lengths, 120)
    computed = sum(len(p) * max(int(lengths[i]) for i in p) for p in parts)
    assert padding_fraction(lengths, parts) == pytest.approx(1 - int(lengths.sum()) / computed, abs=1e-12)
    fixed = fixed_micro_batches(13, 4)
    assert padding_fraction(lengths, fixed, width=50) == pytest.approx(1 - int(lengths.sum()) / (13 * 50), abs=1e-12)
    assert padding_fraction(lengths, parts) < padding_fraction(lengths, fixed, width=50)


def test_contiguous_runs_on_a_hand_example():
    # sorted: 8 8 4 4 2 2 with a budget of 16: [8 8] [4 4 2 2]? 4 x 4 = 16 -> 2 micro-batches
    parts = token_budget_micro_batches(torch.tensor([2, 8, 4, 2, 8, 4]), 16)
    assert [sorted(p.tolist()) for p in parts] == [[1, 4], [0, 2, 3, 5]]
    assert list(itertools.chain(*[p.tolist() for p in parts])) == [1, 4, 2, 5, 0, 3]
