"""pass@k: the chance that at least one of k samples is correct, estimated without bias.

With ``n`` samples of a problem of which ``c`` are correct, the unbiased estimator of
Chen et al. 2021 (the Codex paper, "Evaluating Large Language Models Trained on Code") is

    pass@k = 1 - C(n - c, k) / C(n, k)

(the chance that k samples drawn without replacement from the n miss every correct
one, taken from 1). Binomial coefficients overflow and lose precision for n in the
hundreds, so it is computed as the product the ratio reduces to:

    C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i),

which is 1 when c = 0 and does not apply when n - c < k (every draw of k then holds a
correct sample: pass@k = 1). Averaged over problems it is the benchmark's pass@k.
"""

from __future__ import annotations

import torch

__all__ = ["pass_at_k", "pass_at_k_per_problem", "mean_pass_at_k"]


def _check(n: int, c: int, k: int) -> None:
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"pass@k: {name} must be an int (got {value!r})")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: the correct count c={c} must be between 0 and n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: k={k} must be between 1 and the number of samples n={n}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of one problem with ``n`` samples, ``c`` of them correct (module docstring)."""
    _check(n, c, k)
    if n - c < k:
        return 1.0
    miss_all = 1.0
    for i in range(n - c + 1, n + 1):
        miss_all *= 1.0 - k / i
    return 1.0 - miss_all


def pass_at_k_per_problem(correct: torch.Tensor, k: int) -> torch.Tensor:
    """pass@k of each problem from its samples' correctness.

    ``correct``: (P, n) bool or 0/1, n samples for each of P problems. Returns (P,)
    float64. Vectorised form of :func:`pass_at_k`: with t_i = 1 - k / i, the miss-all
    probability of a problem with c correct is the suffix product t_{n-c+1} ... t_n.
    """
    if correct.dim() != 2:
        raise ValueError(f"pass@k: correct must be (problems, samples), got shape {tuple(correct.shape)}")
    n = correct.shape[1]
    _check(n, 0, k)
    c = correct.to(torch.int64).sum(dim=1)  # (P,)
    i = torch.arange(1, n + 1, dtype=torch.float64, device=correct.device)  # (n,)
    terms = 1.0 - k / i  # (n,) t_1 .. t_n
    suffix = torch.flip(torch.cumprod(torch.flip(terms, (0,)), 0), (0,))  # (n,) suffix[j] = t_{j+1} ... t_n
    suffix = torch.cat([suffix, suffix.new_ones(1)])  # (n + 1,) empty product at j = n
    miss_all = suffix[n - c]  # (P,) product over i > n - c
    return torch.where(n - c < k, torch.ones_like(miss_all), 1.0 - miss_all)


def mean_pass_at_k(correct: torch.Tensor, k: int) -> float:
    """The benchmark's pass@k: :func:`pass_at_k_per_problem` averaged over the problems."""
    return pass_at_k_per_problem(correct, k).mean().item()
