"""FSDP2 learners (``cluster.sharding: fsdp``): the policy sharded over the learner ranks (no Ray here).

:func:`shard_policy` applies PyTorch's ``fully_shard`` bottom-up, each call one unit whose parameters
are all-gathered together and whose gradients are reduce-scattered together: every transformer block
of each Hugging Face model in the policy (:func:`transformer_blocks`), every module that keeps float32
weights (``keeps_float32``: the value head) as a float32 unit of its own, and the policy itself as the
root (embeddings, final norms, LM heads). Each rank then holds ``1/W`` of every parameter (its rows, as
a ``DTensor``), its gradient and its Adam moments (:func:`local_bytes`). :class:`FSDPParallel` is the
trainer's :class:`~ppokit.trainer.DataParallel` for it. Mixed precision and CPU offload: docs/scale.md.

- ``policy.evaluate`` is registered as a forward method: the root is gathered for the whole pass (the
  exact-KL path reads the LM head's weight directly), each block around its own forward and backward.
- The gradient divide factor is 1 (sum-only collectives: gloo has no pre-multiplied sum): the losses
  are already divided by the whole mini-batch's all-reduced normaliser, so each rank's gradient shard
  is its slice of the single learner's, ``slice_r(sum_q d/dθ [sum_{i in part q} l_i(θ) / N_minibatch])``.
- Every pass runs per-unit collectives, so the ranks make the same number of passes per mini-batch
  (:meth:`FSDPParallel.passes`); gradient norms are reduced over the ranks before clipping
  (:func:`ppokit.trainer.clip_grad_norm`), the actor's and the critic's apart.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from ppokit.cluster.parallel import ProcessGroupParallel

__all__ = ["FSDPParallel", "full_tensor", "local_bytes", "local_layout", "shard_policy"]

# the forward method the trainer calls on a policy (ppokit.trainer.TrainablePolicy)
FORWARD_METHODS = ("evaluate",)


class FSDPParallel(ProcessGroupParallel):
    """Rank ``rank`` of ``world_size`` FSDP learners (a :class:`ppokit.trainer.DataParallel`):
    the policy is sharded in :meth:`prepare`, gradients are reduce-scattered by FSDP during
    the backward pass (nothing left for :meth:`all_reduce_grads`)."""

    shards = True  # a learner replica builds its policy in CPU memory; shard_policy moves the shards

    def __init__(self, rank: int, world_size: int, *, device_type: str = "cpu", offload: bool = False):
        super().__init__(rank, world_size)
        self.device_type, self.offload = device_type, offload
        self.mesh = init_device_mesh(device_type, (world_size,))

    def prepare(self, policy: nn.Module) -> None:
        shard_policy(policy, self.mesh, param_dtype=policy.autocast_dtype, offload=self.offload)

    def passes(self, count: int) -> int:
        most = torch.tensor(count, dtype=torch.int64, device=self.device_type)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most)

    def all_reduce_grads(self, params: list[nn.Parameter]) -> None:
        """Nothing: FSDP reduce-scattered each unit's gradients in the backward pass."""


def shard_policy(policy: nn.Module, mesh, *, param_dtype: torch.dtype | None = None, offload: bool = False) -> None:
    """Shard ``policy`` in place over ``mesh`` (see the module docstring)."""
    compute = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    float32 = MixedPrecisionPolicy()
    # pinned host memory needs a CUDA device; on a CPU the shards are in host memory anyway
    offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    for block in transformer_blocks(policy):
        fully_shard(block, mesh=mesh, mp_policy=compute, offload_policy=offload_policy)
    for module in policy.modules():
        if getattr(module, "keeps_float32", False) and module is not policy:
            fully_shard(module, mesh=mesh, mp_policy=float32, offload_policy=offload_policy)
    # the root's inputs are a micro-batch dict: its float tensors (advantages, ...) are not the model's
    fully_shard(policy, mesh=mesh, mp_policy=replace(compute, cast_forward_inputs=False), offload_policy=offload_policy)
    for name in FORWARD_METHODS:
        register_fsdp_forward_method(policy, name)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum over the ranks (module docstring)
            module.set_force_sum_reduction_for_comms(True)
    policy.refresh_parameters()  # cached parameter lists point at the unsharded tensors
    policy.compute_device = torch.device(mesh.device_type)  # offloaded shards live in host memory
    # FSDP warns that a unit's output is a view (the value head's squeeze, the log-probs' slices):
    # an in-place op on it would skip a hook; the trainer never writes into the policy's outputs
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def transformer_blocks(policy: nn.Module) -> list[nn.Module]:
    """The transformer blocks of the Hugging Face models inside ``policy``, in module order: the
    modules whose class (or a base class) a model names in ``_no_split_modules``."""
    names: set[str] = set()
    for module in policy.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    if not names:
        return []
    return [m for m in policy.modules() if any(c.__name__ in names for c in type(m).__mro__)]


# ----------------------------------------------------------------------------- tensors
def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor of ``t`` on the CPU: a ``DTensor`` is all-gathered (a collective: every rank
    calls it), anything else is returned as it is. CPU-offloaded shards of a CUDA mesh are moved
    to the GPU for the all-gather."""
    if not isinstance(t, DTensor):
        return t.detach().cpu()
    local = t.to_local()
    if local.device.type != t.device_mesh.device_type:
        t = DTensor.from_local(local.to(t.device_mesh.device_type), t.device_mesh, t.placements, run_check=False)
    return t.full_tensor().detach().cpu()


def local_layout(value: Tensor, like: Tensor) -> Tensor:
    """``value`` (a whole tensor) in the layout of ``like``: this rank's slice as a ``DTensor`` when
    ``like`` is one (no communication: every rank holds ``value``), else ``value`` on ``like``'s device."""
    if not isinstance(like, DTensor):
        return value.to(device=like.device, dtype=like.dtype)
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(f"a tensor of shape {tuple(value.shape)} for a shard of {tuple(like.shape)}")
    value = value.to(device=like.to_local().device, dtype=like.dtype)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)


def local_bytes(policy: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of the policy's parameters, their gradients and the optimizer's state,
    read from its local shards (a ``DTensor`` counts its local part)."""

    def size(t: Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(policy.parameters())
    out = {
        "params": sum(size(p) for p in params),
        "trained_params": sum(size(p) for p in params if p.requires_grad),
        "grads": sum(size(p.grad) for p in params if p.grad is not None),
    }
    if optimizer is not None:
        out["optimizer"] = sum(
            size(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)
        )
    return out
