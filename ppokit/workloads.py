"""Which workload trains a config: control, single-turn LM or multi-turn LM (:func:`workload_kind`),
and what each kind does that the commands need: its :data:`WORKLOADS` class, its evaluation of a
run directory (:data:`EVALUATORS`, ``ppokit eval``) and the line that sums up a finished run
(:func:`summary_line`, ``ppokit train``). Light to import: the kinds' modules load on demand.

:func:`train` is the library's entry point for a whole run (what ``ppokit train`` calls)::

    from ppokit.config import load_config
    from ppokit.persistence.rundir import create_run_dir
    from ppokit.workloads import train

    cfg = load_config("cartpole", ["seed=3"])
    result = train(cfg, create_run_dir(cfg))
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, NamedTuple

from ppokit.config import Config
from ppokit.errors import UserError


class WorkloadKind(NamedTuple):
    """A workload kind's class, ``module.name``, imported on demand (the LM stack is heavy), and
    ``reads``: ``module:function(cfg) -> dict``, light, run by :func:`check_inputs` before that
    import (a bad path or name is then one line at once); its dict goes to the class as keywords."""

    module: str
    name: str
    reads: str | None = None


WORKLOADS = {
    "control": WorkloadKind("ppokit.control.workload", "ControlWorkload", "ppokit.control.vector_env:check_env_run"),
    "lm": WorkloadKind("ppokit.lm.single_turn.workload", "LMWorkload", "ppokit.lm.inputs:read_prompt_run"),
    "textenv": WorkloadKind("ppokit.lm.multi_turn.workload", "MultiTurnWorkload", "ppokit.lm.inputs:check_episode_run"),
}


class Evaluator(NamedTuple):
    """What ``ppokit eval`` runs for a run directory of one workload kind, imported on demand:
    ``module.function(run, /, **options) -> str`` (run: a :class:`ppokit.persistence.rundir.RunDir`; options:
    the command's parsed arguments by name, each evaluation reading its own)."""

    module: str
    function: str
    what: str  # what such a run directory is, for messages
    options: frozenset[str]  # the options of ``ppokit eval`` it reads (by name); the others are refused


LM_EVAL_OPTIONS = frozenset(
    {"data", "reward", "prompts", "samples", "k", "threshold", "prompt_key", "answer_key", "chat_template"}
    | {"reward_timeout", "seed", "device", "temperature", "top_p", "max_new_tokens", "json"}
)

# workload kind -> its evaluation (``ppokit eval``)
EVALUATORS = {
    "control": Evaluator("ppokit.control.evaluate", "report_run", "a control run", frozenset({"episodes", "seed"})),
    "lm": Evaluator("ppokit.lm.run_eval", "report_run", "a language-model run or model directory", LM_EVAL_OPTIONS),
    "textenv": Evaluator(
        "ppokit.lm.multi_turn.run_eval", "report_run", "a text-environment run", frozenset({"episodes", "device"})
    ),
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


def make_workload(cfg: Config, **read: Any):
    """The :class:`~ppokit.components.Workload` of :func:`workload_kind`, built from ``cfg`` (and
    ``read``: what its kind's ``reads`` returned); with ``cluster.rollout_workers`` or
    ``cluster.learners`` > 1, on Ray (:mod:`ppokit.cluster`)."""
    from ppokit.cluster import require_ray, wants_cluster

    kind = WORKLOADS[workload_kind(cfg)]
    workload = getattr(importlib.import_module(kind.module), kind.name)(cfg, **read)
    if wants_cluster(cfg):
        from ppokit.cluster.workload import DistributedWorkload

        require_ray(cfg)  # a one-line error naming the extra, before a run directory exists
        workload = DistributedWorkload(workload, cfg)
    return workload


def check_inputs(cfg: Config):
    """Fail on a bad env id, model directory, data file or reward function, or wandb asked for and not
    usable, before a run directory exists. Returns the checked workload (:func:`make_workload`): given
    to :func:`train`, it builds the run from what the check read (``ppokit train`` reads its inputs once)."""
    from ppokit.monitoring.track import check_wandb

    check_wandb(cfg)
    reads = WORKLOADS[workload_kind(cfg)].reads
    read = {}
    if reads is not None:  # light: before the workload's modules are imported
        module, _, function = reads.partition(":")
        read = getattr(importlib.import_module(module), function)(cfg)
    workload = make_workload(cfg, **read)
    workload.check_inputs()
    return workload


def train(
    cfg: Config, run_dir: Path | str, resume_from: Path | str | None = None, *, workload: Any = None
) -> dict[str, Any]:
    """Train ``cfg`` in ``run_dir`` (see :func:`ppokit.loop.run`). ``workload``: what
    :func:`check_inputs` returned for ``cfg``, built once; None: a new :func:`make_workload`."""
    from ppokit.loop import run

    return run(workload if workload is not None else make_workload(cfg), cfg, run_dir, resume_from)


def evaluate_run(run: Any, /, **options: Any) -> str:
    """What ``ppokit eval`` prints for ``run`` (a :class:`ppokit.persistence.rundir.RunDir`): the evaluation of its
    kind (:data:`EVALUATORS`) with the command's ``options`` (None: not given). An option given that
    this evaluation does not read is a :class:`UserError` naming it, not silently ignored."""
    if not run.is_dir:  # before the evaluation's modules (torch) are imported
        problem = "is a file" if run.path.exists() else "does not exist"
        raise UserError(
            f"run directory {run.path} {problem}; give a run directory, one of its checkpoints, "
            "a model directory or a GGUF file"
        )
    evaluator = EVALUATORS[run.kind]
    given = {name: value for name, value in options.items() if value is not None}
    ignored = sorted(set(given) - evaluator.options)
    if ignored:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in ignored)
        takes = ", ".join(f"--{name.replace('_', '-')}" for name in sorted(evaluator.options))
        verb = "does" if len(ignored) == 1 else "do"
        raise UserError(f"{flags} {verb} not apply to {run.path}, {evaluator.what}; it takes {takes}")
    return getattr(importlib.import_module(evaluator.module), evaluator.function)(run, **given)


def _control_summary(result: dict[str, Any]) -> str | None:
    if "eval_return_mean" not in result:
        return None
    return f"deterministic eval: return {result['eval_return_mean']:.1f} +- {result.get('eval_return_std', 0.0):.1f}"


def _lm_summary(result: dict[str, Any]) -> str | None:
    if "eval_accuracy_after" not in result:
        return None
    return f"held-out accuracy: {result['eval_accuracy_before']:.1%} before, {result['eval_accuracy_after']:.1%} after"


def _no_summary(result: dict[str, Any]) -> None:
    return None  # a multi-turn run's evaluations print their win rates as they run (ppokit.loop)


# workload kind -> the line ``ppokit train`` prints after a finished run, from :func:`train`'s result
# (None: nothing to add, e.g. no final evaluation)
SUMMARIES = {"control": _control_summary, "lm": _lm_summary, "textenv": _no_summary}


def summary_line(cfg: Config, result: dict[str, Any]) -> str | None:
    """The line that sums up ``result``, a finished run of ``cfg`` (:data:`SUMMARIES`)."""
    return SUMMARIES[workload_kind(cfg)](result)
