"""Weights in bounded buckets: from the learner ranks to the training process, and on to the rollout workers.

A model's tensors travel in the order of its state dict, which is layer order, grouped
into buckets of at most ``cluster.sync_bucket_mb`` MiB (a tensor larger than that goes
alone). No process ever holds more than one bucket of the weights as a dictionary of its
own: FSDP ranks all-gather one bucket's parameters at a time, the training process
copies each bucket into its model before it asks for the next, and rollout workers load
each bucket as it comes. What moved is logged: its bytes, its time and the largest
bucket (``sync_bytes``, ``sync_time``, ``sync_bucket_peak``; ``learner_sync_*`` between
the ranks and the training process).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor

__all__ = ["MIB", "bucket_plan", "buckets", "nbytes"]

MIB = 2**20


def nbytes(t: Tensor) -> int:
    """Bytes of the whole tensor (a ``DTensor``: its global shape, not its shard)."""
    return t.numel() * t.element_size()


def bucket_plan(sizes: Iterable[tuple[str, int]], max_bytes: float) -> list[list[str]]:
    """Names grouped in their order into buckets whose sizes sum to at most ``max_bytes``
    (a name whose size alone exceeds it gets a bucket of its own)."""
    plan: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, size in sizes:
        if current and filled + size > max_bytes:
            plan.append(current)
            current, filled = [], 0
        current.append(name)
        filled += size
    if current:
        plan.append(current)
    return plan


def buckets(tensors: Iterable[tuple[str, Tensor]], max_bytes: float) -> Iterator[dict[str, Tensor]]:
    """``tensors`` (name, tensor) in their order, as dictionaries of at most ``max_bytes`` each."""
    current: dict[str, Tensor] = {}
    filled = 0
    for name, t in tensors:
        size = nbytes(t)
        if current and filled + size > max_bytes:
            yield current
            current, filled = {}, 0
        current[name] = t
        filled += size
    if current:
        yield current
