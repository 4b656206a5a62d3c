"""The learner group: M Ray actors that update one policy on torch.distributed, replicated or sharded.

Every :class:`LearnerRank` builds the workload's learner (:meth:`Workload.learner_replica`); rank 0
picks the rendezvous address and port, and all ranks join one process group (gloo on CPUs, nccl when
the ranks have GPUs). An update sends the batch to the object store once; each rank shuffles it with
the shared generator, takes its slice of every mini-batch and all-reduces the normaliser
(:mod:`ppokit.trainer`), so all ranks take the same step. ``cluster.sharding``: ``ddp``, every rank
holds the whole policy (:class:`~ppokit.cluster.parallel.ProcessGroupParallel`: one all-reduce of the
summed gradients a step); ``fsdp``, each holds ``1/M`` of every parameter, gradient and Adam moment
(:mod:`ppokit.cluster.fsdp`; with ``cluster.learners: 1``, a group of one rank, for CPU offload).

:class:`LearnerGroup` is the run loop's :class:`~ppokit.components.Learner`. The driver keeps its own
replica (weights only) for scoring, evaluation and the rollout's weights, refreshed after each update
bucket by bucket (:mod:`ppokit.cluster.weights`): fsdp ranks all-gather one bucket at a time and the
driver loads it before asking for the next, so no process holds a second whole copy. Checkpoints keep
the single learner's layout; with fsdp each rank writes its Adam shards into ``CKPT/learner_shards/``
(markers in the state), which resume on any layout (docs/scale.md, "Sharded checkpoints").
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ppokit.cluster import ray_get, require_ray
from ppokit.cluster.fsdp import FSDPParallel, full_tensor, local_bytes, local_layout
from ppokit.cluster.parallel import free_port, init_process_group
from ppokit.cluster.weights import MIB, bucket_plan, nbytes
from ppokit.components import Batch
from ppokit.persistence.checkpoint import (
    SHARDED,
    SHARDS_DIR,
    is_sharded_marker,
    load_shards,
    save_shards,
    sharded_marker,
)

# the per-parameter optimizer state of a learner's state dict: "trainer.optimizer.state.<index>.<slot>"
OPTIMIZER_SLOT = re.compile(r"(?:^|\.)optimizer\.state\.(\d+)\.[^.]+$")


class LearnerRank:
    """The actor: rank ``rank`` of ``world_size``, its learner replica built in :meth:`join`."""

    def __init__(self, workload, rank: int, world_size: int):
        self.workload, self.rank, self.world_size = workload, rank, world_size
        self.learner = None
        self.shards: dict[str, torch.Tensor] = {}  # this rank's sharded tensors of the last state_dict()

    def rendezvous(self) -> tuple[str, int]:
        """(this node's address, a free port): rank 0's answer is the group's rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def join(self, address: str, port: int) -> None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.group = init_process_group(self.rank, self.world_size, address, port, backend)
        self.rebuild(self.workload)

    def rebuild(self, workload) -> None:
        """A new learner replica of ``workload`` (another config) on the same process group."""
        self.workload = workload
        c = workload.cfg.cluster
        self.sharded = c.sharding == "fsdp"
        self.parallel = self.group
        if self.sharded:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.parallel = FSDPParallel(self.rank, self.world_size, device_type=device, offload=c.cpu_offload)
        self.learner = workload.learner_replica(self.parallel)

    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        return self.learner.update(batch, iteration)

    # ------------------------------------------------------------------ weights
    def gather(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """The whole tensors of trained weights ``names`` (one bucket) on the CPU, from rank 0 (fsdp:
        every rank takes part in the all-gathers; the others return None)."""
        weights = self.learner.trained_weights()
        whole = {name: full_tensor(weights[name]) for name in names}
        return whole if self.rank == 0 else None

    def load_weights(self, bucket: dict[str, torch.Tensor]) -> None:
        """Copy whole trained weights (one bucket) into this rank's replica or shards."""
        like = self.learner.trained_weights()
        self.learner.load_trained_weights({name: local_layout(t, like[name]) for name, t in bucket.items()})

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The learner's state; fsdp: the optimizer's sharded tensors replaced by markers (written by
        :meth:`save_shards`), any other sharded tensor gathered whole (a collective)."""
        state = self.learner.state_dict()
        if not self.sharded:
            return state
        self.shards = {}

        def mark(obj: Any, path: str) -> Any:
            if isinstance(obj, DTensor):
                if OPTIMIZER_SLOT.search(path):
                    self.shards[path] = obj
                    return sharded_marker(path, obj)
                return full_tensor(obj)
            if isinstance(obj, dict):
                return {k: mark(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(mark(v, f"{path}.{i}") for i, v in enumerate(obj))
            return obj

        return mark(state, "")

    def save_shards(self, directory: str) -> None:
        """Write the shards of the last :meth:`state_dict` into ``directory/learner_shards`` (a collective)."""
        save_shards(Path(directory) / SHARDS_DIR, self.shards)
        self.shards = {}

    def load_state(self, state: dict[str, Any], directory: str | None) -> None:
        """A learner state (its weights come apart, through :meth:`load_weights`): sharded markers are
        read from ``directory/learner_shards`` (this rank's slices), whole tensors of a sharded
        tensor are sliced here."""
        if self.sharded:
            state = self._localise(state, directory)
        self.learner.load_state_dict(state, None)

    def _localise(self, state: dict[str, Any], directory: str | None) -> dict[str, Any]:
        own = _leaves(self.learner.state_dict())
        params = self.learner.trainer.params
        targets: dict[str, torch.Tensor] = {}

        def like(path: str) -> torch.Tensor | None:
            if path in own and isinstance(own[path], torch.Tensor):
                return own[path]
            slot = OPTIMIZER_SLOT.search(path)  # a fresh optimizer has no moments yet: the parameter's layout
            return params[int(slot.group(1))] if slot else None

        def place(obj: Any, path: str) -> Any:
            if is_sharded_marker(obj):
                template = like(path)
                if template is None:
                    raise ValueError(f"the sharded tensor '{obj[SHARDED]}' has no place in this learner")
                targets[obj[SHARDED]] = torch.zeros_like(template)
                return targets[obj[SHARDED]]
            if isinstance(obj, torch.Tensor):  # a whole tensor (a checkpoint of one learner): this rank's slice
                template = like(path)  # (an optimizer's step count has no parameter's shape: kept as it is)
                sharded = isinstance(template, DTensor) and tuple(obj.shape) == tuple(template.shape)
                return local_layout(obj, template) if sharded else obj
            if isinstance(obj, dict):
                return {k: place(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(place(v, f"{path}.{i}") for i, v in enumerate(obj))
            return obj

        state = place(state, "")
        if targets:
            if directory is None:
                raise ValueError("a state with sharded tensors needs the checkpoint directory")
            load_shards(Path(directory) / SHARDS_DIR, targets)
        return state

    # ------------------------------------------------------------------ tests and measurements
    def gradients(self, batch: dict[str, torch.Tensor], iteration: int = 0) -> dict[str, torch.Tensor] | None:
        """The summed gradient of the first optimizer step on ``batch`` (no step taken), whole, from
        rank 0 (fsdp: every rank takes part in the all-gathers)."""
        grads = self.learner.trainer.mini_batch_gradients(batch, iteration)
        whole = {k: full_tensor(v) for k, v in grads.items()}
        return whole if self.rank == 0 else None

    def memory(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        """Bytes of this rank's parameters, gradients (of the first mini-batch of ``batch``) and
        optimizer state, read from its local shards."""
        trainer = self.learner.trainer
        grads = trainer.mini_batch_gradients(batch)
        out = local_bytes(self.learner.policy, trainer.optimizer)
        out["grads"] = sum(
            (g.to_local() if hasattr(g, "to_local") else g).numel() * g.element_size() for g in grads.values()
        )
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _leaves(obj: Any, path: str = "") -> dict[str, Any]:
    """``{dotted path: value}`` of a nested state (dict keys and list indices joined by dots)."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_leaves(v, f"{path}.{k}" if path else str(k)))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(_leaves(v, f"{path}.{i}"))
        return out
    return {path: obj}


def _without_sharded(obj: Any) -> Any:
    """``obj`` without the dictionary entries that are sharded markers."""
    if isinstance(obj, dict):
        return {k: _without_sharded(v) for k, v in obj.items() if not is_sharded_marker(v)}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_without_sharded(v) for v in obj)
    return obj


class LearnerGroup:
    """A :class:`~ppokit.components.Learner` over ``ranks`` (actors of :class:`LearnerRank`)."""

    def __init__(self, local, ranks: list[Any], *, sharded: bool = False, bucket_bytes: float = 256 * MIB):
        self.local, self.ranks = local, ranks
        self.sharded = sharded
        self.bucket_bytes = bucket_bytes
        self.sync_ranks()

    @classmethod
    def start(cls, cluster, workload, local, world_size: int) -> LearnerGroup:
        c = cluster.cfg.cluster
        ranks = [cluster.start_actor(LearnerRank, "learner", r, workload, r, world_size) for r in range(world_size)]
        address, port = ray_get(ranks[0].rendezvous.remote())
        ray_get([r.join.remote(address, port) for r in ranks])
        return cls(local, ranks, sharded=c.sharding == "fsdp", bucket_bytes=c.sync_bucket_mb * MIB)

    @property
    def reads_shards(self) -> bool:
        """fsdp: a checkpoint's sharded tensors are read by the ranks, not whole by the run loop."""
        return self.sharded

    @property
    def policy_version(self) -> int:
        return self.local.policy_version

    # ------------------------------------------------------------------ weights
    def _plan(self) -> list[list[str]]:
        return bucket_plan(((n, nbytes(t)) for n, t in self.local.trained_weights().items()), self.bucket_bytes)

    def pull_weights(self) -> dict[str, float]:
        """The ranks' trained weights into the driver's replica, one bucket at a time."""
        start = time.perf_counter()
        ranks = self.ranks if self.sharded else self.ranks[:1]  # fsdp: every rank takes part in the gathers
        peak = 0
        for names in self._plan():
            bucket = ray_get([r.gather.remote(names) for r in ranks])[0]
            self.local.load_trained_weights(bucket)
            peak = max(peak, sum(nbytes(t) for t in bucket.values()))
        return {"time_learner_sync": time.perf_counter() - start, "learner_sync_bucket_peak": float(peak)}

    def push_weights(self) -> None:
        """The driver's trained weights to every rank, one bucket at a time (each takes its slices)."""
        ray = require_ray()
        weights = self.local.trained_weights()
        for names in self._plan():
            ref = ray.put({n: weights[n].detach().cpu() for n in names})
            ray_get([r.load_weights.remote(ref) for r in self.ranks])

    def sync_ranks(self) -> None:
        """Every rank gets the local learner's state and weights (start, resume)."""
        state = self.local.state_dict()
        ray_get([r.load_state.remote(state, None) for r in self.ranks])
        self.push_weights()

    # ------------------------------------------------------------------ the Learner protocol
    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        ref = require_ray().put(batch)
        results = ray_get([r.update.remote(ref, iteration) for r in self.ranks])
        metrics = dict(results[0])
        metrics.update(self.pull_weights())
        self.local.policy_version += 1
        return metrics

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        return self.local.rollout_weights()

    def trained_weights(self) -> dict[str, torch.Tensor]:
        return self.local.trained_weights()

    def load_trained_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.local.load_trained_weights(weights)
        self.push_weights()

    def weights_finite(self) -> bool:
        return self.local.weights_finite()

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's learner state (ddp: the optimizer moments of the whole model, as one learner's;
        fsdp: markers in their place, the shards written by :meth:`save_files`)."""
        ranks = self.ranks if self.sharded else self.ranks[:1]
        return ray_get([r.state_dict.remote() for r in ranks])[0]

    def save_files(self, directory: Path) -> None:
        self.local.save_files(directory)
        if self.sharded:
            ray_get([r.save_shards.remote(str(directory)) for r in self.ranks])

    def load_state_dict(self, state: dict[str, Any], directory: Path | None) -> None:
        """The driver's replica loads the policy's files and the state (without sharded tensors: it
        never steps); the ranks get the weights from it and the state (fsdp: their own shards)."""
        self.local.load_state_dict(_without_sharded(state) if self.sharded else state, directory)
        ray_get([r.load_state.remote(state, str(directory) if directory else None) for r in self.ranks])
        self.push_weights()

    def gradients(self, batch: dict[str, torch.Tensor], iteration: int = 0) -> dict[str, torch.Tensor]:
        """The group's first-step gradient on ``batch`` (whole, from rank 0)."""
        return ray_get([r.gradients.remote(batch, iteration) for r in self.ranks])[0]

    def memory(self, batch: dict[str, torch.Tensor]) -> list[dict[str, int]]:
        """Each rank's parameter, gradient and optimizer bytes (:meth:`LearnerRank.memory`)."""
        return ray_get([r.memory.remote(batch) for r in self.ranks])
