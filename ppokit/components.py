"""The parts of one PPO iteration and the data that flows between them.

The run loop (:mod:`ppokit.loop`) drives four objects that a workload builds
(:class:`Components`)::

    source.sync_weights(learner)             # once before the first iteration, then after each update
    batch = source.collect(iteration)        # RolloutSource: generate text / step envs
    source.prefetch(iteration + j)           # rollout.off_policy_steps=k > 0: for j = 1..k, those
                                             # not queued yet (RolloutQueue): k rollouts run ahead
    scorer.score(batch)                      # Scorer: old/ref log-probs, values, final rewards
    advantages(cfg, batch)                   # components.advantages, else ppokit.trainer.batch_advantages
    metrics = learner.update(batch, iteration)   # Learner: the PPO update
    source.sync_weights(learner)             # the rollout gets the new policy
    evaluator.evaluate(phase)                # Evaluator: on the loop's schedule

Each protocol is small so that a source or a learner can live in another process (Ray
workers, :mod:`ppokit.cluster`): a :class:`Batch` holds tensors and plain per-sample data,
never model objects. The loop does not know which workload it runs, nor where its
components run. A workload that scales out also gives :meth:`Workload.shard_plan`,
:meth:`Workload.rollout_shard` and :meth:`Workload.learner_replica`: the pieces that a
rollout worker or a learner rank builds in its own process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

__all__ = [
    "SEQUENCE_INPUTS",
    "CONTROL_INPUTS",
    "UPDATE_KEYS",
    "Batch",
    "Components",
    "Evaluator",
    "Learner",
    "RolloutQueue",
    "RolloutSource",
    "Scorer",
    "ShardPlan",
    "ShardSource",
    "Workload",
]


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
    ``policy_version``: the :attr:`Learner.policy_version` of the weights that sampled
    the batch (None where the source does not say). The key sets below name these once.
    """

    tensors: dict[str, Tensor]
    extras: dict[str, Tensor] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    policy_version: int | None = None

    def __len__(self) -> int:
        return int(self.tensors["mask"].shape[0])

    def state_dict(self) -> dict[str, Any]:
        """The batch as checkpoint data (a rollout collected ahead of its update)."""
        return {
            "tensors": dict(self.tensors),
            "extras": dict(self.extras),
            "samples": list(self.samples),
            "metrics": dict(self.metrics),
            "policy_version": self.policy_version,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Batch:
        """The batch :meth:`state_dict` describes."""
        version = state.get("policy_version")
        return cls(
            tensors=dict(state["tensors"]),
            extras=dict(state.get("extras", {})),
            samples=[dict(s) for s in state.get("samples", [])],
            metrics={k: float(v) for k, v in state.get("metrics", {}).items()},
            policy_version=int(version) if version is not None else None,
        )


# The batch's key sets (Batch's docstring says what each key holds).
SEQUENCE_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")  # lm: a policy pass's inputs
CONTROL_INPUTS = ("obs", "actions")  # control: a policy pass's inputs
UPDATE_KEYS = ("mask", "old_log_prob", "advantages", "returns", "old_values")  # the update reads these


class RolloutQueue:
    """Rollouts collected ahead of their update (``rollout.off_policy_steps`` = k), by iteration.

    The run loop asks for iterations ``it+1 .. it+k`` after collecting ``it`` (before the
    update of ``it``), so the queue always holds consecutive iterations, oldest first,
    at most k of them, and the batch of iteration i was sampled by the weights of
    version ``max(0, i - k)`` (the version is ``i`` after i updates)::

        version that sampled i = i - min(i, k)        staleness(i) = min(i, k)

    A queued batch is part of its source's checkpoint (:meth:`state_dict`: the first
    iteration and the batches in order), so a resumed run trains on the very batches
    the uninterrupted run does. In-process sources collect at once (sequentially);
    :class:`ppokit.cluster.rollout_workers.RemoteSource` keeps its requests in flight and
    puts them here when gathered.
    """

    def __init__(self) -> None:
        self.batches: dict[int, Batch] = {}  # iteration -> its batch, oldest first

    def __contains__(self, iteration: int) -> bool:
        return iteration in self.batches

    def __len__(self) -> int:
        return len(self.batches)

    def put(self, iteration: int, batch: Batch) -> None:
        """Queue ``batch`` as iteration ``iteration``'s: the one after the newest queued one."""
        if self.batches and iteration != max(self.batches) + 1:
            raise RuntimeError(f"rollout queue: iteration {iteration} after {list(self.batches)} (not consecutive)")
        self.batches[iteration] = batch

    def pop(self, iteration: int) -> Batch | None:
        """The queued batch of ``iteration`` (removed), or None when it is not queued."""
        return self.batches.pop(iteration, None)

    def state_dict(self) -> dict[str, Any] | None:
        """``{"iteration": first, "batches": [Batch.state_dict(), ...]}`` (consecutive iterations
        from ``first``), or None when nothing is queued."""
        if not self.batches:
            return None
        return {"iteration": min(self.batches), "batches": [b.state_dict() for b in self.batches.values()]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (also the one-batch layout of ppokit before k > 1:
        ``{"iteration", "batch"}``)."""
        self.batches = {}
        if not state:
            return
        first = int(state["iteration"])
        saved = state["batches"] if "batches" in state else [state["batch"]]
        for j, batch in enumerate(saved):
            self.put(first + j, Batch.from_state(batch))


class RolloutSource(Protocol):
    """Collects experience with the current policy."""

    steps_per_iteration: int | None  # environment steps per iteration (metrics' global_step), or None

    def collect(self, iteration: int) -> Batch:
        """One iteration's rollouts: at least ``mask`` and, unless the scorer adds them,
        ``rewards``, ``old_log_prob`` and ``old_values``. The batch of a :meth:`prefetch`
        of the same iteration when there is one."""

    def prefetch(self, iteration: int) -> None:
        """Start collecting ``iteration`` with the weights the source has now; with
        ``rollout.off_policy_steps=k`` the loop calls it for ``it+1 .. it+k`` right after
        :meth:`collect` of ``it`` (before its update), and an iteration already queued or
        in flight stays as it is, so each is started once, in order, by the weights of
        version ``iteration - min(iteration, k)`` (:class:`RolloutQueue`). An in-process source collects at
        once; Ray workers overlap it with the update. Its batch carries the behaviour
        policy's ``old_log_prob`` and is part of :meth:`state_dict` until collected (exact
        resume)."""

    def sync_weights(self, learner: Learner) -> dict[str, float] | None:
        """Take the learner's weights (``learner.rollout_weights()``, version
        ``learner.policy_version``); the loop calls it before the first iteration and after
        each update. Returns the sync's metrics (``sync_bytes``, ``sync_time``), or None
        for a source that shares the learner's modules in one process."""

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

    policy_version: int  # updates applied so far (checkpointed): the version of the weights
    reads_shards: bool  # True: the learner reads a checkpoint's sharded tensors itself (FSDP ranks)

    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        """Epochs over the batch; the iteration's metrics. Raises
        :class:`~ppokit.errors.TrainingDiverged` after too many non-finite steps in a row."""

    def rollout_weights(self) -> dict[str, Tensor]:
        """The tensors a rollout copy of the policy needs (lora: the actor adapter only)."""

    def trained_weights(self) -> dict[str, Tensor]:
        """Every trained tensor by name (adapters, value head; full mode: the models'):
        what a replica of this learner needs to equal it."""

    def load_trained_weights(self, weights: dict[str, Tensor]) -> None:
        """Copy :meth:`trained_weights` of a replica into this learner's model."""

    def weights_finite(self) -> bool:
        """Whether every trained weight is finite (checked before a checkpoint is written)."""

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, schedule, counters (and, where they are not written as files, the weights)."""

    def save_files(self, directory: Path) -> None:
        """Write the trained model into a checkpoint directory in its usual format (lm:
        Hugging Face / peft files, loadable by ``ppokit export``); may do nothing."""

    def load_state_dict(self, state: dict[str, Any], directory: Path | None) -> None:
        """Restore :meth:`state_dict` and the files :meth:`save_files` wrote into ``directory``
        (None: only the state; the weights come through :meth:`load_trained_weights`)."""


class Evaluator(Protocol):
    """Measures the policy on its own schedule's terms; the loop decides when.

    ``phase`` is ``"before"`` (a fresh run, before the first iteration, when
    ``at_start``), ``"periodic"`` (every ``every`` iterations) or ``"final"`` (after the
    last iteration). The returned metrics name themselves (``eval_accuracy``,
    ``eval_return_mean``, ...); final metrics go into the last metrics row.
    """

    every: int
    at_start: bool
    # whether the loop hands the heap's free pages back after each evaluation
    # (:func:`~ppokit.monitoring.peak_memory.release_freed_memory`): a language model's evaluation leaves
    # garbage of gigabytes under the next update; a control one little, where the full garbage
    # collection cost a CartPole run about 15% of its time to the threshold
    releases_memory: bool

    def evaluate(self, phase: str) -> dict[str, float]: ...

    def message(self, phase: str, metrics: dict[str, float]) -> str | None:
        """A line to print about this evaluation, or None."""

    def stop_reason(self, metrics: dict[str, float]) -> str | None:
        """Why training should stop after this periodic evaluation (a target reached), or None."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass
class Components:
    """What a workload builds for one run."""

    source: RolloutSource
    learner: Learner
    scorer: Scorer | None = None
    evaluator: Evaluator | None = None
    description: str = ""  # the progress bar's label
    header: list[str] = field(default_factory=list)  # lines printed when the run starts
    checkpoint_meta: dict[str, Any] = field(default_factory=dict)  # extra JSON in every checkpoint
    closers: list[Any] = field(default_factory=list)  # objects with close(), called when the run ends
    # (cfg, batch) -> (advantages, returns), each (N, T); None: ppokit.trainer.batch_advantages
    advantages: Callable[[Any, Batch], tuple[Tensor, Tensor]] | None = None

    def close(self) -> None:
        for obj in [self.evaluator, *self.closers]:
            if obj is not None:
                obj.close()


class ShardSource(Protocol):
    """A rollout worker's source (:mod:`ppokit.cluster.rollout_workers`): a shard of the envs
    (control) or generation for the prompts it is sent (lm), with its own policy copy."""

    def collect_shard(self, iteration: int, request: Any) -> Any:
        """This shard's part of ``iteration``'s batch for ``request`` (from :meth:`ShardPlan.requests`):
        plain data and tensors that :meth:`ShardPlan.merge` turns into the batch (control: a
        :class:`Batch`; lm: the generated sequences, scored by the driver)."""

    def load_rollout_weights(self, weights: dict[str, Tensor]) -> None:
        """Copy :meth:`Learner.rollout_weights` into the shard's policy."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> list[str]: ...


class ShardPlan(Protocol):
    """The driver's side of N rollout shards: what each is asked, how their parts make one
    batch (in shard order, equal to the in-process source's batch when N = 1) and the
    checkpoint state (the in-process source's layout when N = 1)."""

    steps_per_iteration: int | None

    def requests(self, iteration: int) -> list[Any]:
        """One request per shard for ``iteration`` (lm: its prompts; control: nothing)."""

    def merge(self, iteration: int, parts: list[Any], states: list[dict[str, Any]]) -> Batch | None:
        """Iteration ``iteration``'s batch from the shards' parts, in shard order; ``states``:
        each shard's :meth:`ShardSource.state_dict` after its part. None: the iteration needs
        another round of :meth:`requests` (lm: ``rollout.dynamic_sampling`` draws more prompts or episodes)."""

    def sync_weights(self, learner: Learner) -> None:
        """After the workers got the learner's new weights: the driver's own share of the sync
        (multi-turn: the opponent pool's snapshots; else nothing)."""

    def state_dict(self, shard_states: list[dict[str, Any]]) -> dict[str, Any]:
        """The source's checkpoint state from the driver's own state and the shards'."""

    def load_state_dict(self, state: dict[str, Any]) -> tuple[list[dict[str, Any] | None], list[str]]:
        """Restore the driver's state; each shard's state (None: nothing to restore) and notes."""


class Workload(Protocol):
    """Builds a run's components from its config (:mod:`ppokit.control.workload`,
    :mod:`ppokit.lm.single_turn.workload`, :mod:`ppokit.lm.multi_turn.workload`)."""

    name: str

    def check_inputs(self) -> None:
        """Raise :class:`~ppokit.errors.UserError` on an input that cannot work (a data file, a
        model directory, an environment id, a reward function), before a run directory exists."""

    def build(self, run_dir: Path) -> Components:
        """Everything a run needs, built exactly the same way for a fresh run and a resume
        (same seeds, same order): a resume then copies the checkpoint's state in."""

    def check_checkpoint(self, meta: dict[str, Any], path: Path) -> None:
        """Raise :class:`~ppokit.errors.UserError` when a checkpoint cannot be resumed by this
        workload (another workload's, or state missing), before anything is built."""

    def shard_plan(self, components: Components, num_shards: int) -> ShardPlan:
        """The driver's side of ``num_shards`` rollout workers, after :meth:`build`."""

    def rollout_shard(self, shard: int, num_shards: int) -> ShardSource:
        """Called in a rollout worker's process on a copy of this workload made after
        :meth:`build`: shard ``shard``'s source, seeded as the in-process source is."""

    def learner_replica(self, parallel: Any) -> Learner:
        """Called in a learner rank's process on a copy of this workload made after
        :meth:`build`: a learner whose trainer shares mini-batches through ``parallel``
        (a :class:`ppokit.trainer.DataParallel`)."""
