"""The trainer's data-parallel side on ``torch.distributed`` (no Ray here).

:class:`ProcessGroupParallel` is a :class:`ppokit.trainer.DataParallel`: rank ``r`` of
``W`` takes the ``r``-th of ``W`` contiguous, near-equal slices of every mini-batch
(``torch.tensor_split``), and the gradients are summed with one all-reduce over a
flat buffer of all trainable parameters (what DDP's bucketed all-reduce computes;
DDP itself needs ``forward`` called through its wrapper, while the trainer calls the
policy's ``evaluate``). Because every loss is divided by the whole mini-batch's
normaliser (all-reduced too, :meth:`ppokit.trainer.PPOTrainer._global_normalizer`), the
sum of the ranks' gradients is the single-learner gradient::

    g = sum_r  d/dθ [ sum_{i in slice r} l_i(θ) / N_minibatch ]  = d/dθ [ sum_i l_i(θ) / N_minibatch ]
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class ProcessGroupParallel:
    """Rank ``rank`` of the default process group of ``world_size`` ranks."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def prepare(self, policy) -> None:
        """Nothing: every rank holds the whole policy."""

    def passes(self, count: int) -> int:
        return count  # one all-reduce after the passes: the ranks need not make as many

    def shard(self, index: Tensor) -> Tensor:
        return index.tensor_split(self.world_size)[self.rank]

    def all_reduce(self, tensor: Tensor, op: str = "sum") -> Tensor:
        dist.all_reduce(tensor, op=_OPS[op])
        return tensor

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)  # one buffer, one all-reduce
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)


def free_port() -> int:
    """A TCP port free on this host now (the rendezvous of rank 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_process_group(
    rank: int, world_size: int, address: str, port: int, backend: str, timeout_s: float = 300.0
) -> ProcessGroupParallel:
    """Join the group at ``tcp://address:port`` (gloo on CPUs, nccl on GPUs)."""
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return ProcessGroupParallel(rank, world_size)
