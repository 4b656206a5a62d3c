"""pass@k (Chen et al. 2021) against the closed form 1 - C(n-c, k)/C(n, k) in exact arithmetic."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from ppokit.algo.evaluation import mean_pass_at_k, pass_at_k, pass_at_k_per_problem


def closed_form(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_matches_the_closed_form_on_random_inputs():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 300)
        c, k = rng.randint(0, n), rng.randint(1, n)
        assert pass_at_k(n, c, k) == pytest.approx(float(closed_form(n, c, k)), rel=1e-12, abs=1e-14)


def test_edge_cases():
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 0, 10) == 0.0  # c = 0
    assert pass_at_k(10, 8, 3) == 1.0 and pass_at_k(5, 1, 5) == 1.0  # n - c < k
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(7, 3, 1) == pytest.approx(3 / 7)  # k = 1 is the fraction correct
    for c in range(1, 6):
        assert pass_at_k(5, c, 5) == 1.0  # k = n, any correct
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, abs=1e-12)  # large n: no overflow
    for bad in [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)
    with pytest.raises(TypeError):
        pass_at_k(3.0, 1, 1)


@pytest.mark.parametrize("n,k", [(1, 1), (8, 1), (8, 3), (8, 8), (50, 10)])
def test_per_problem_tensor_form_matches_the_scalar(n, k):
    generator = torch.Generator().manual_seed(n * 100 + k)
    correct = torch.rand(64, n, generator=generator) < torch.rand(64, 1, generator=generator)  # (P, n)
    correct[0] = False
    correct[1] = True
    got = pass_at_k_per_problem(correct, k)
    assert got.dtype == torch.float64 and got.shape == (64,)
    expected = torch.tensor([float(closed_form(n, int(row.sum()), k)) for row in correct], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    assert got[0] == 0.0 and got[1] == 1.0
    assert mean_pass_at_k(correct, k) == pytest.approx(expected.mean().item(), rel=1e-12)
    with pytest.raises(ValueError):
        pass_at_k_per_problem(correct, n + 1)
