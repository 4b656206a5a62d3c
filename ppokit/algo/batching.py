"""Micro-batches by a token budget (verl's ``use_dynamic_bsz``): sorted by length, balanced.

A forward pass over a micro-batch of rows padded to its longest row costs
``rows x longest`` token positions, whatever the rows' own lengths. With a fixed
number of rows per micro-batch, a batch whose responses run from 8 to 256 tokens
spends most of its compute on padding. Here a mini-batch's rows are instead

1. sorted by length (longest first), so that rows of similar length share a
   micro-batch and little is padded;
2. cut into the fewest contiguous runs whose cost ``rows x longest`` is at most
   ``budget`` (a greedy cut is optimal for the count, because extending a run
   never lowers its cost);
3. balanced: with that count fixed, the cuts are moved so that the largest cost
   is as small as it can be (a binary search over the bound, each tested by the
   greedy cut): the peak memory of a pass is the least any partition into that
   many micro-batches allows.

A row longer than the budget gets a micro-batch of its own. The partition only
decides which rows go together: the loss stays the mini-batch's, because every
micro-batch's loss is divided by the mini-batch's normaliser
(:func:`ppokit.algo.aggregation.aggregation_normalizer`), so the sum of the
micro-batch losses (and gradients) is the mini-batch loss whatever the partition.

:func:`padding_fraction` measures the padding of a partition: ``1 - sum(lengths) /
sum(rows x longest)`` over its micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["fixed_micro_batches", "micro_batch_indices", "padding_fraction", "row_tokens", "token_budget_micro_batches"]


def fixed_micro_batches(n: int, size: int) -> list[torch.Tensor]:
    """``[0..size), [size..2 size), ...``: rows in their order, ``size`` per micro-batch."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1 (got {size})")
    return list(torch.arange(n).split(size))


def _greedy_cuts(lengths: Sequence[int], bound: int) -> list[int]:
    """Start indices of the fewest runs of descending ``lengths`` with ``rows x lengths[start] <= bound``
    (a row alone is always allowed)."""
    starts, start = [], 0
    n = len(lengths)
    while start < n:
        starts.append(start)
        longest = lengths[start]  # descending: the run's first row is its longest
        rows = max(1, bound // longest) if longest > 0 else n - start
        start = min(n, start + rows)
    return starts


def token_budget_micro_batches(lengths: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Index tensors of micro-batches of ``lengths`` (N,) rows, by token budget (module docstring).

    Each micro-batch holds rows of similar length, longest first; ``rows x longest <= budget``
    unless one row alone is longer. Every row is in exactly one micro-batch.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"the token budget must be a positive int (got {budget!r})")
    lengths = torch.as_tensor(lengths).to(torch.int64).cpu()  # (N,)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D (N,), got shape {tuple(lengths.shape)}")
    n = lengths.numel()
    if n == 0:
        return []
    order = torch.sort(lengths, descending=True, stable=True).indices  # (N,) longest first
    sorted_lengths = lengths[order].tolist()
    count = len(_greedy_cuts(sorted_lengths, budget))
    # the smallest bound (<= budget) that still needs no more than `count` runs: balanced micro-batches
    low, high = 1, budget
    while low < high:
        mid = (low + high) // 2
        if len(_greedy_cuts(sorted_lengths, mid)) <= count:
            high = mid
        else:
            low = mid + 1
    starts = _greedy_cuts(sorted_lengths, low) + [n]
    return [order[a:b] for a, b in zip(starts[:-1], starts[1:])]


def padding_fraction(lengths: torch.Tensor, micro_batches: Sequence[torch.Tensor], width: int | None = None) -> float:
    """Padding share of the token positions the micro-batches compute: ``1 - sum(lengths) /
    sum(rows x width)``, with ``width`` each micro-batch's longest row (or a fixed ``width``,
    e.g. the whole batch's padded length)."""
    lengths = torch.as_tensor(lengths).to(torch.int64).cpu()
    computed = 0
    for index in micro_batches:
        if index.numel():
            computed += index.numel() * (width if width is not None else int(lengths[index.cpu()].max()))
    return 1.0 - float(lengths.sum()) / computed if computed else 0.0


def row_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N,) tokens a forward pass reads per row: ``attention_mask`` (language models: prompt and
    response) where the batch has one, else ``mask``."""
    return batch["attention_mask" if "attention_mask" in batch else "mask"].sum(1)


def micro_batch_indices(
    batch: dict[str, torch.Tensor], micro_batch_size: int, micro_batch_tokens: int | None
) -> list[slice | torch.Tensor]:
    """The rows of each micro-batch: slices of ``micro_batch_size`` rows in order (views, no
    copies), or with a token budget index tensors of rows of similar length
    (:func:`token_budget_micro_batches`)."""
    n = batch["mask"].shape[0]
    if micro_batch_tokens is None:
        return [slice(start, start + micro_batch_size) for start in range(0, n, micro_batch_size)]
    return token_budget_micro_batches(row_tokens(batch), micro_batch_tokens)
