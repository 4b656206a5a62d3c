"""The parts of one PPO iteration and the data that flows between them.

The run loop (:mod:`ppokit.loop`) drives four objects that a workload builds
(:class:`Components`)::

    batch = source.collect(iteration)        # RolloutSource: generate text / step envs
    scorer.score(batch)                      # Scorer: old/ref log-probs, values, final rewards
    advantages(batch)                        # ppokit.trainer.compute_advantages (the loop)
    metrics = learner.update(batch, iteration)   # Learner: the PPO update
    source.sync_weights(learner)             # the rollout gets the new policy
    evaluator.evaluate(phase)                # Evaluator: on the loop's schedule

Each protocol is small so that a source or a learner can live in another process (Ray
workers): a :class:`Batch` holds tensors and plain per-sample data, never model objects.
The loop does not know which workload it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

from torch import Tensor

__all__ = ["Batch", "Components", "Evaluator", "Learner", "RolloutSource", "Scorer", "Workload"]


@dataclass
class Batch:
    """One iteration's data.

    ``tensors``: dim 0 indexes samples (N: sequences or environments), dim 1 positions
    (T: response tokens or environment steps). The keys the loop and the learner read:

    ==================  =========  ==================================================
    ``mask``            (N, T)     1 where a position is trained on
    ``rewards``         (N, T)     reward at each position (final, after any KL shaping)
    ``old_log_prob``    (N, T)     log-prob of the taken action under the sampling policy
    ``old_values``      (N, T)     the critic's value of the state before the action
    ``dones``           (N, T)     control: the episode ended at this step
    ``group_ids``       (N,)       lm: which prompt a sequence answers (group estimators)
    ``ref_log_prob``    (N, T)     lm: the reference policy's log-prob (KL terms)
    ``advantages``      (N, T)     added by the loop
    ``returns``         (N, T)     added by the loop
    ==================  =========  ==================================================

    plus what the policy's forward pass needs (``obs``/``actions``, or ``input_ids``,
    ``attention_mask``, ``position_ids``, ``responses``). ``extras``: tensors that are not
    per sample (control: ``last_values`` (N,), the bootstrap value after the last step).
    ``samples``: plain per-sample records for ``samples.jsonl`` (lm: prompt, response,
    reward, fields), or empty. ``metrics``: what the source and the scorer measured.
    """

    tensors: dict[str, Tensor]
    extras: dict[str, Tensor] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.tensors["mask"].shape[0])


class RolloutSource(Protocol):
    """Collects experience with the current policy."""

    steps_per_iteration: Optional[int]   # environment steps per iteration (metrics' global_step), or None

    def collect(self, iteration: int) -> Batch:
        """One iteration's rollouts: at least ``mask`` and, unless the scorer adds them,
        ``rewards``, ``old_log_prob`` and ``old_values``."""

    def sync_weights(self, learner: "Learner") -> None:
        """Take the learner's new weights (``learner.rollout_weights()``); a source that
        shares the learner's modules in one process has nothing to do."""

    def state_dict(self) -> dict[str, Any]:
        """Plain data and tensors to continue exactly after a resume (env states, data position)."""

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Restore :meth:`state_dict`; returns notes to print (e.g. what could not be restored)."""


class Scorer(Protocol):
    """Adds what the update needs beyond the rollout: old and reference log-probs, values,
    and the final token rewards (with a KL penalty when the rewards carry one)."""

    def score(self, batch: Batch) -> None:
        """Fill ``batch`` in place."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Learner(Protocol):
    """The PPO update and the trained weights."""

    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        """Epochs over the batch; the iteration's metrics. Raises
        :class:`~ppokit.errors.TrainingDiverged` after too many non-finite steps in a row."""

    def rollout_weights(self) -> dict[str, Tensor]:
        """The tensors a rollout copy of the policy needs (lora: the actor adapter only)."""

    def weights_finite(self) -> bool:
        """Whether every trained weight is finite (checked before a checkpoint is written)."""

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, schedule, counters (and, where they are not written as files, the weights)."""

    def save_files(self, directory: Path) -> None:
        """Write the trained model into a checkpoint directory in its usual format (lm:
        Hugging Face / peft files, loadable by ``ppokit export``); may do nothing."""

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        """Restore :meth:`state_dict` and the files :meth:`save_files` wrote into ``directory``."""


class Evaluator(Protocol):
    """Measures the policy on its own schedule's terms; the loop decides when.

    ``phase`` is ``"before"`` (a fresh run, before the first iteration, when
    ``at_start``), ``"periodic"`` (every ``every`` iterations) or ``"final"`` (after the
    last iteration). The returned metrics name themselves (``eval_accuracy``,
    ``eval_return_mean``, ...); final metrics go into the last metrics row.
    """

    every: int
    at_start: bool

    def evaluate(self, phase: str) -> dict[str, float]: ...

    def message(self, phase: str, metrics: dict[str, float]) -> Optional[str]:
        """A line to print about this evaluation, or None."""

    def stop_reason(self, metrics: dict[str, float]) -> Optional[str]:
        """Why training should stop after this periodic evaluation (a target reached), or None."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass
class Components:
    """What a workload builds for one run."""

    source: RolloutSource
    learner: Learner
    scorer: Optional[Scorer] = None
    evaluator: Optional[Evaluator] = None
    description: str = ""                  # the progress bar's label
    header: list[str] = field(default_factory=list)   # lines printed when the run starts
    checkpoint_meta: dict[str, Any] = field(default_factory=dict)   # extra JSON in every checkpoint
    closers: list[Any] = field(default_factory=list)  # objects with close(), called when the run ends

    def close(self) -> None:
        for obj in [self.evaluator, *self.closers]:
            if obj is not None:
                obj.close()


class Workload(Protocol):
    """Builds a run's components from its config (``ppokit.control.workload``, ``ppokit.lm.workload``)."""

    name: str

    def build(self, run_dir: Path) -> Components:
        """Everything a run needs, built exactly the same way for a fresh run and a resume
        (same seeds, same order): a resume then copies the checkpoint's state in."""

    def check_checkpoint(self, meta: dict[str, Any], path: Path) -> None:
        """Raise :class:`~ppokit.errors.UserError` when a checkpoint cannot be resumed by this
        workload (another workload's, or state missing), before anything is built."""
