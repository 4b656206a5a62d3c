"""The learner group: M Ray actors that update one policy data-parallel on torch.distributed.

Every rank builds the workload's learner (:meth:`Workload.learner_replica`) with a
:class:`~ppokit.dist.parallel.ProcessGroupParallel`; rank 0 picks the rendezvous
address and port, all ranks join one process group (gloo on CPUs, nccl when the ranks
have GPUs). An update sends the batch to the object store once; each rank shuffles it
with the shared generator, takes its slice of every mini-batch and all-reduces the
normaliser and the gradients (:mod:`ppokit.trainer`), so all ranks take the same step
and stay equal.

:class:`LearnerGroup` is the run loop's :class:`~ppokit.components.Learner`. The driver
keeps its own replica (the workload's local learner) for scoring, evaluation and
weight sync: after each update it copies rank 0's trained weights into it. A
checkpoint is rank 0's learner state written by the driver beside the local replica's
files, in the layout a single learner writes: a run resumes in-process from it, and a
learner group resumes from an in-process checkpoint (its state is sent to every rank).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from ppokit.components import Batch
from ppokit.dist import ray_get, require_ray
from ppokit.dist.parallel import free_port
from ppokit.dist.parallel import init_process_group
import torch.distributed as dist


class LearnerRank:
    """The actor: rank ``rank`` of ``world_size``, its learner replica built in :meth:`join`."""

    def __init__(self, workload, rank: int, world_size: int):
        self.workload, self.rank, self.world_size = workload, rank, world_size
        self.learner = None

    def rendezvous(self) -> tuple[str, int]:
        """(this node's address, a free port): rank 0's answer is the group's rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def join(self, address: str, port: int) -> None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.parallel = init_process_group(self.rank, self.world_size, address, port, backend)
        self.learner = self.workload.learner_replica(self.parallel)

    def rebuild(self, workload) -> None:
        """A new learner replica of ``workload`` (another config) on the same process group."""
        self.workload = workload
        self.learner = workload.learner_replica(self.parallel)

    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        return self.learner.update(batch, iteration)

    def trained_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.learner.trained_weights().items()}

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    def load(self, state: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
        """A learner state (its weights given apart: they live in a checkpoint's files)."""
        self.learner.load_state_dict(state, None)
        self.learner.load_trained_weights(weights)

    def gradients(self, batch: dict[str, torch.Tensor], iteration: int = 0) -> dict[str, torch.Tensor]:
        """The all-reduced gradient of the first optimizer step on ``batch`` (no step taken)."""
        return {k: v.cpu() for k, v in self.learner.trainer.mini_batch_gradients(batch, iteration).items()}

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class LearnerGroup:
    """A :class:`~ppokit.components.Learner` over ``ranks`` (actors of :class:`LearnerRank`)."""

    def __init__(self, local, ranks: list[Any]):
        self.local, self.ranks = local, ranks
        self.sync_ranks()

    @classmethod
    def start(cls, cluster, workload, local, world_size: int) -> "LearnerGroup":
        ranks = [cluster.start_actor(LearnerRank, "learner", r, workload, r, world_size) for r in range(world_size)]
        address, port = ray_get(ranks[0].rendezvous.remote())
        ray_get([r.join.remote(address, port) for r in ranks])
        return cls(local, ranks)

    def sync_ranks(self) -> None:
        """Every rank gets the local learner's state and weights (start, resume)."""
        state, weights = self.local.state_dict(), self.local.trained_weights()
        ray_get([r.load.remote(state, weights) for r in self.ranks])

    @property
    def policy_version(self) -> int:
        return self.local.policy_version

    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        ref = require_ray().put(batch)
        results = ray_get([r.update.remote(ref, iteration) for r in self.ranks])
        self.local.load_trained_weights(ray_get(self.ranks[0].trained_weights.remote()))
        self.local.policy_version += 1
        return results[0]

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        return self.local.rollout_weights()

    def trained_weights(self) -> dict[str, torch.Tensor]:
        return self.local.trained_weights()

    def load_trained_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.local.load_trained_weights(weights)
        self.sync_ranks()

    def weights_finite(self) -> bool:
        return self.local.weights_finite()

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's learner state (the optimizer moments of the whole model, as one learner's)."""
        return ray_get(self.ranks[0].state_dict.remote())

    def save_files(self, directory: Path) -> None:
        self.local.save_files(directory)

    def load_state_dict(self, state: dict[str, Any], directory: Optional[Path]) -> None:
        self.local.load_state_dict(state, directory)
        self.sync_ranks()

    def gradients(self, batch: dict[str, torch.Tensor], iteration: int = 0) -> dict[str, torch.Tensor]:
        """The group's first-step gradient on ``batch`` (rank 0's; all ranks hold the same)."""
        return ray_get([r.gradients.remote(batch, iteration) for r in self.ranks])[0]
