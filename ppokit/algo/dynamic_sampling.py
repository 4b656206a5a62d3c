"""DAPO's dynamic-sampling filter: which groups of samples carry a learning signal.

A group estimator (GRPO, RLOO, REINFORCE++ with a group baseline) compares the samples
of one prompt with each other: a group whose rewards are all equal (every answer right,
or every answer wrong) gets an advantage of exactly zero on every sample, so it adds rows
to the batch and nothing to the gradient. DAPO (Yu et al., 2025, "dynamic sampling";
verl: ``algorithm.filter_groups``) drops such groups and samples more prompts until the
batch is full of groups that do. For a group g of n_g samples with rewards
r_{g,1} .. r_{g,n_g}::

    keep_g = n_g >= 2  and  std_g > 0,     std_g = sqrt( 1/n_g * sum_i (r_{g,i} - mean_g)^2 )

``std_g > 0`` is evaluated exactly, as ``max_i r_{g,i} > min_i r_{g,i}`` (equivalent in
exact arithmetic): a mean-based std of equal values can round to a tiny positive number
(numpy's std of [0.1, 0.1, 0.1] is 1.4e-17), which would keep a group without signal. A
group of one sample is dropped (its group advantage is zero too; verl keeps it), and a
group holding a NaN is dropped (NaN compares false).

Groups are given by ``group_size`` (rows ``g*n .. g*n+n-1`` are group g: the single-turn
layout, one prompt's samples next to each other) or by ``group_ids`` (B,) integer ids, in
any order (rows with equal ids are one group: e.g. multi-turn episodes of one seed).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_index", "group_range", "groups_with_variance", "varied"]


def group_index(n: int, group_size: int | None = None, group_ids: Tensor | None = None) -> tuple[Tensor, int]:
    """``(index (n,) long in 0..G-1, G)``: the group of each of ``n`` rows, from exactly one of
    ``group_size`` (contiguous groups; ``n`` must be a multiple) or ``group_ids`` (n,)."""
    if (group_size is None) == (group_ids is None):
        raise ValueError("give exactly one of group_size and group_ids")
    if group_ids is not None:
        group_ids = torch.as_tensor(group_ids)
        if group_ids.shape != (n,):
            raise ValueError(f"group_ids shape {tuple(group_ids.shape)} != (N,) = ({n},)")
        uniq, index = torch.unique(group_ids, return_inverse=True)
        return index, int(uniq.numel())
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of group_size={group_size}")
    return torch.arange(n).div(group_size, rounding_mode="floor"), n // group_size


def group_range(
    rewards: Tensor, group_size: int | None = None, *, group_ids: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each group's smallest and largest reward and size: ``(lo (G,), hi (G,), count (G,),
    index (N,))``, ``index`` the group of each row (:func:`group_index`). ``rewards`` (N,)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (N,), got shape {tuple(rewards.shape)}")
    index, G = group_index(rewards.shape[0], group_size, group_ids)
    index = index.to(rewards.device)
    inf = torch.full((G,), float("inf"), dtype=rewards.dtype, device=rewards.device)
    lo = inf.scatter_reduce(0, index, rewards, "amin")  # (G,)
    hi = (-inf).scatter_reduce(0, index, rewards, "amax")  # (G,)
    count = torch.zeros(G, dtype=torch.long, device=rewards.device).index_add_(0, index, torch.ones_like(index))
    return lo, hi, count, index


def groups_with_variance(rewards: Tensor, group_size: int | None = None, *, group_ids: Tensor | None = None) -> Tensor:
    """``keep`` (N,) bool: True on every row of a group with ``n_g >= 2`` and reward std > 0
    (module docstring). ``rewards`` (N,) float: one scalar per sample (a sequence reward, an
    episode return, a correctness score)."""
    lo, hi, count, index = group_range(
        rewards.float() if not rewards.is_floating_point() else rewards, group_size, group_ids=group_ids
    )
    return varied(lo, hi, count)[index]  # (N,)


def varied(lo: Tensor, hi: Tensor, count: Tensor) -> Tensor:
    """``keep_g`` (G,) bool from :func:`group_range`'s ``lo``, ``hi``, ``count``: ``n_g >= 2 and max > min``."""
    return (hi > lo) & (count >= 2)
