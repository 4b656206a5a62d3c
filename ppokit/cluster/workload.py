"""A workload whose rollout and/or update run on Ray (``cluster:`` in the config).

:class:`DistributedWorkload` wraps the run's workload: :meth:`build` starts the cluster and
reserves its resources (an impossible placement fails before anything heavy), builds the
usual in-process components (same seeds, same order: a fresh run and a resume build the
same way), then replaces the source with a
:class:`~ppokit.cluster.rollout_workers.RemoteSource` (``cluster.rollout_workers`` >= 1)
and the learner with a :class:`~ppokit.cluster.learner_group.LearnerGroup`
(``cluster.learners`` > 1). The actors get a copy of the built workload and build
their parts with :meth:`Workload.rollout_shard` / :meth:`Workload.learner_replica`.
The run loop sees the same protocols as in-process; checkpoints keep the in-process
layout, so a run moves between a laptop and a cluster through ``--resume``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ppokit.cluster.learner_group import LearnerGroup
from ppokit.cluster.ray_cluster import Cluster
from ppokit.cluster.rollout_workers import RemoteSource, RolloutWorker
from ppokit.components import Components
from ppokit.config import Config


class DistributedWorkload:
    """``workload`` with its source and/or learner on Ray (:class:`ppokit.components.Workload`)."""

    def __init__(self, workload, cfg: Config):
        self.inner, self.cfg = workload, cfg
        self.name = workload.name

    def check_inputs(self) -> None:
        self.inner.check_inputs()

    def check_checkpoint(self, meta: dict[str, Any], path: Path) -> None:
        self.inner.check_checkpoint(meta, path)

    def build(self, run_dir: Path) -> Components:
        c = self.cfg.cluster
        # one ddp learner is the training process itself; fsdp always runs in ranks (a group of one: CPU offload)
        learners = c.learners if c.learners > 1 or c.sharding == "fsdp" else 0
        # resources first: a placement the cluster cannot give fails before a warm start or a model load
        cluster = Cluster(self.cfg, rollout_workers=c.rollout_workers, learners=learners)
        try:
            components = self.inner.build(run_dir)
        except BaseException:
            cluster.close()
            raise
        try:
            if learners:
                components.learner = LearnerGroup.start(cluster, self.inner, components.learner, learners)
            if c.rollout_workers:
                n = c.rollout_workers
                plan = self.inner.shard_plan(components, n)
                components.source = RemoteSource(
                    self.cfg,
                    plan,
                    lambda s: cluster.start_actor(RolloutWorker, "rollout", s, self.inner, s, n),
                    n,
                    forget_worker=cluster.forget,
                )
            components.header.append(cluster.describe())
            components.closers.append(cluster)
        except BaseException:
            cluster.close()
            components.close()
            raise
        return components
