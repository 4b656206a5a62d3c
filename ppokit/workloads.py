"""Which workload trains a config: control, single-turn LM or multi-turn LM (:func:`workload_kind`).

:func:`train` is the library's entry point for a whole run (what ``ppokit train`` calls)::

    from ppokit.config import load_config
    from ppokit.rundir import create_run_dir
    from ppokit.workloads import train

    cfg = load_config("cartpole", ["seed=3"])
    result = train(cfg, create_run_dir(cfg))
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ppokit.config import Config

# workload kind -> (module, class); imported on demand (the LM stack is heavy)
WORKLOADS = {
    "control": ("ppokit.control.workload", "ControlWorkload"),
    "lm": ("ppokit.lm.single_turn.workload", "LMWorkload"),
    "textenv": ("ppokit.lm.multi_turn.workload", "MultiTurnWorkload"),
}


def workload_kind(cfg: Config) -> str:
    """:attr:`Config.kind`: ``control``, ``lm`` (single-turn) or ``textenv`` (multi-turn)."""
    return cfg.kind


def describe(cfg: Config) -> str:
    """What ``cfg`` trains, in a few words (``ppokit config list``)."""
    kind = workload_kind(cfg)
    if kind == "control":
        return cfg.env.id
    if kind == "textenv":
        opponent = cfg.textenv.kwargs.get("opponent")
        against = f" against {opponent}" if opponent else ""
        return f"{cfg.textenv.env} episodes{against} on model {cfg.model.path}"
    return f"{cfg.data.prompts} on model {cfg.model.path}"


def make_workload(cfg: Config):
    """The :class:`~ppokit.components.Workload` of :func:`workload_kind`, built from ``cfg``; with
    ``cluster.rollout_workers`` or ``cluster.learners`` > 1, on Ray (:mod:`ppokit.dist`)."""
    from ppokit.dist import require_ray, wants_cluster

    module, name = WORKLOADS[workload_kind(cfg)]
    workload = getattr(importlib.import_module(module), name)(cfg)
    if wants_cluster(cfg):
        from ppokit.dist.workload import DistributedWorkload

        require_ray(cfg)  # a one-line error naming the extra, before a run directory exists
        workload = DistributedWorkload(workload, cfg)
    return workload


def check_inputs(cfg: Config) -> None:
    """Fail on a bad env id, model directory, data file or reward function, or wandb asked for and not
    usable, before a run directory exists."""
    from ppokit.track import check_wandb

    check_wandb(cfg)
    make_workload(cfg).check_inputs()


def train(cfg: Config, run_dir: Path | str, resume_from: Path | str | None = None) -> dict[str, Any]:
    """Train ``cfg`` in ``run_dir`` (see :func:`ppokit.loop.run`)."""
    from ppokit.loop import run

    return run(make_workload(cfg), cfg, run_dir, resume_from)
