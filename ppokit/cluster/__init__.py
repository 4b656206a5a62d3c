"""Scale-out on Ray: rollout workers and a learner group, chosen by the config alone.

``cluster.rollout_workers: N`` runs the rollout in N Ray actors and
``cluster.learners: M`` (M > 1) the update in M Ray actors that form a
``torch.distributed`` group; everything else stays in the training process (the
driver): the run loop, scoring, advantages, evaluation and checkpoints. The pieces
are the run's usual components (:mod:`ppokit.components`) in other processes::

    driver (ppokit train)                         Ray actors
    loop.run ── RemoteSource.collect(k) ────────> RolloutWorker s: shard source (envs / prompts),
             │      (plan: requests, merge)          a policy copy, the rollout RNG
             ├─ Scorer, advantages (driver)
             ├─ LearnerGroup.update(batch) ─────> LearnerRank r: learner replica, DDP-style
             │      rank 0's weights -> driver       gradient all-reduce (gloo / nccl)
             └─ RemoteSource.sync_weights ──────> set_weights(learner.rollout_weights())

- :mod:`ppokit.cluster.ray_cluster`: Ray start or join, the placement group with a bounded
  wait, shutting everything down.
- :mod:`ppokit.cluster.rollout_workers`: :class:`RemoteSource` (a RolloutSource) and the
  worker actor; fixed shard order, one-step-off pipelining, restart of a dead worker.
- :mod:`ppokit.cluster.learner_group`: :class:`LearnerGroup` (a Learner) and the rank actor.
- :mod:`ppokit.cluster.parallel`: the torch.distributed side of the trainer (no Ray).
- :mod:`ppokit.cluster.fsdp`: FSDP2 learners (``cluster.sharding: fsdp``): the policy sharded per
  decoder layer and root, sum-reduced gradients, local shard sizes.
- :mod:`ppokit.cluster.weights`: weights in bounded buckets (``cluster.sync_bucket_mb``), layer order.
- :mod:`ppokit.cluster.workload`: :class:`DistributedWorkload`, a workload that builds the
  local components and moves the source and/or the learner onto the cluster.

Ray is imported only here and only when a run asks for workers: ``ppokit --help``,
``ppokit config`` and in-process runs never import it.
"""

from __future__ import annotations

from ppokit.errors import UserError

__all__ = ["RAY_EXTRA", "ray_get", "require_ray", "wants_cluster"]

RAY_EXTRA = "pip install 'ppokit[ray]'"


def wants_cluster(cfg) -> bool:
    """Whether ``cfg`` runs anything on Ray (rollout workers, more than one learner, or FSDP learners)."""
    c = cfg.cluster
    return c.rollout_workers > 0 or c.learners > 1 or c.sharding == "fsdp"


def require_ray(cfg=None):
    """The ``ray`` module, or a :class:`UserError` naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        what = "a Ray cluster"
        if cfg is not None:
            parts = [f"cluster.rollout_workers={cfg.cluster.rollout_workers}"] if cfg.cluster.rollout_workers else []
            parts += [f"cluster.learners={cfg.cluster.learners}"] if cfg.cluster.learners > 1 else []
            parts += ["cluster.sharding=fsdp"] if cfg.cluster.sharding == "fsdp" else []
            what = " and ".join(parts) or what
        raise UserError(
            f"{what} needs Ray, which is not installed: {RAY_EXTRA} (or set "
            "cluster.rollout_workers=0, cluster.learners=1 and cluster.sharding=ddp to train in one "
            "process)"
        ) from None
    return ray


def ray_get(refs, timeout=None):
    """``ray.get``; a :class:`UserError` raised in an actor (a bad reward function, a diverged
    update) comes out as itself, one line, not wrapped in Ray's traceback."""
    ray = require_ray()
    from ray.exceptions import RayTaskError

    try:
        return ray.get(refs, timeout=timeout)
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, UserError):
            raise cause from None
        raise
