"""The one run loop, for every workload.

A workload (:mod:`ppokit.control.workload`, :mod:`ppokit.lm.single_turn.workload`) builds the
components of a run (:mod:`ppokit.components`); this loop drives them and owns
everything around the update: resume, SIGINT/SIGTERM, the divergence guard, the
evaluation schedule, metrics and samples, checkpoints and their rotation::

    components = workload.build(run_dir)        # a resume builds exactly the same way...
    load the checkpoint's states, RNGs last      # ...then copies the saved state in
    source.sync_weights(learner)                 # rollout workers start from the learner's weights
    for it in range(start, iterations):
        batch = source.collect(it)               # rollouts
        source.prefetch(it + 1 .. it + k)        # rollout.off_policy_steps=k: the queue runs k ahead,
                                                 # overlapping the update (ppokit.components.RolloutQueue)
        scorer.score(batch)                      # old/ref log-probs, values, final rewards
                                                 # (each phase's time and peak memory in the metrics)
        batch += advantages(cfg, batch)          # GAE or a group estimator (ppokit.trainer; multi-turn: its own)
        metrics = learner.update(batch, it)      # epochs x mini-batches x micro-batches
        source.sync_weights(learner)
        evaluation on schedule; tracker.log(it, metrics)      # the row, then the checkpoint
        checkpoint every run.checkpoint_every, on SIGINT/SIGTERM and at the end

A metrics row is written *before* the checkpoint of the same iteration, and a resume
cuts ``metrics.jsonl`` (and ``samples.jsonl``) back to its checkpoint: a kill between
the two loses nothing the resumed run does not write again. One process trains in a run
directory at a time (:class:`ppokit.persistence.rundir.RunLock`). On the CPU a resumed run is bit
for bit the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from ppokit.components import Components, Workload
from ppokit.config import Config
from ppokit.errors import SetUpInterrupted, TrainingDiverged, UserError
from ppokit.monitoring.health import RunHealth
from ppokit.monitoring.peak_memory import PhasePeak, phase_peak, release_freed_memory
from ppokit.monitoring.track import Tracker
from ppokit.persistence import rundir
from ppokit.persistence.checkpoint import Checkpoint, load_checkpoint, resolve_sharded, save_checkpoint
from ppokit.persistence.resume import GracefulStop, capture_rng, restore_rng
from ppokit.trainer import batch_advantages

__all__ = ["run", "diverged_message", "read_resumable_checkpoint"]

REQUIRED_PARTS = ("learner", "source", "rng")


def run(workload: Workload, cfg: Config, run_dir: Path | str, resume_from: Path | str | None = None) -> dict[str, Any]:
    """Train ``workload`` in ``run_dir``; returns the last iteration's metrics with the summary
    (``eval_history``, ``checkpoint``, ``iterations``, ``run_dir``, the evaluator's before/final
    metrics). ``resume_from``: a checkpoint of this run to continue from exactly.

    Raises :class:`~ppokit.errors.Interrupted` after the first SIGINT/SIGTERM (a checkpoint
    saved) and :class:`~ppokit.errors.TrainingDiverged` after ``train.max_bad_steps``
    non-finite steps in a row (naming the last good checkpoint).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with rundir.RunLock(run_dir):
        return _run(workload, cfg, run_dir, Path(resume_from) if resume_from is not None else None)


def _run(workload: Workload, cfg: Config, run_dir: Path, resume_from: Path | None) -> dict[str, Any]:
    saved = None
    if resume_from is not None:
        saved = read_resumable_checkpoint(workload, cfg, resume_from, run_dir)  # before anything is built
        if saved.meta.get("finished") or saved.meta["iteration"] >= cfg.iterations:
            rundir.truncate_logs(run_dir, saved.meta["iteration"])
            return _finished_result(run_dir, saved)
    with GracefulStop() as stop, contextlib.ExitStack() as closing:
        try:  # set-up: a signal stops it at once (nothing to save yet)
            loop, start_it = _set_up(workload, cfg, run_dir, saved, closing)
        except SetUpInterrupted as exc:
            raise stop.set_up_interrupted(run_dir, run_dir / rundir.CONFIG_FILE, resume_from, exc.signum) from None
        loop.run(start_it, stop)
    return loop.result()


def _set_up(
    workload: Workload, cfg: Config, run_dir: Path, saved: Checkpoint | None, closing: contextlib.ExitStack
) -> tuple[_Loop, int]:
    """The run built, ``saved``'s state loaded, the tracker opened (each closed by ``closing``) and
    the evaluation before PPO made: the loop and its first iteration."""
    components = workload.build(run_dir)
    closing.callback(components.close)
    start_it, history, summary, notes = 0, [], {}, []
    if saved is not None:
        start_it, history, summary, notes = _load_state(saved, components, run_dir)
        rundir.truncate_logs(run_dir, start_it)  # only now: the resume goes ahead
    steps = components.source.steps_per_iteration
    # The tracker comes once the run is built and any checkpoint loaded: a resume that fails
    # leaves metrics.jsonl and TensorBoard as they were. TensorBoard's x axis is the global
    # step where there is one: the resumed run's first logged step is purged and written again.
    purge = None if saved is None else (start_it * steps + 1 if steps else start_it)
    description = components.description or None
    tracker = Tracker(run_dir, cfg, cfg.iterations, description=description, purge_step=purge)
    closing.callback(tracker.close)  # closed first, then the components
    for line in components.header + notes:
        tracker.message(line)
    if saved is not None:
        tracker.message(f"resumed from {saved.path} at iteration {start_it}")
    loop = _Loop(workload, cfg, run_dir, components, tracker, history, summary)
    if saved is None and components.evaluator is not None and components.evaluator.at_start:
        summary.update(loop.evaluate("before", 0))
    return loop, start_it


class _Loop:
    """The iterations of one run: collect, score, update, evaluate on schedule, log, checkpoint.
    ``history`` (the evaluations) and ``summary`` (what the result and the final checkpoint
    report) are the run's, restored from its checkpoint on a resume."""

    def __init__(
        self,
        workload: Workload,
        cfg: Config,
        run_dir: Path,
        components: Components,
        tracker: Tracker,
        history: list[dict],
        summary: dict,
    ):
        self.workload, self.cfg, self.run_dir, self.components = workload, cfg, run_dir, components
        self.tracker, self.history, self.summary = tracker, history, summary
        self.steps = components.source.steps_per_iteration
        self.advantages = components.advantages or batch_advantages
        self.metrics: dict[str, Any] = {}  # the last iteration's
        self.final_path: Path | None = None
        self.last = -1  # the last iteration run

    def evaluate(self, phase: str, done: int) -> dict[str, float]:
        """The evaluator's metrics at ``phase`` after ``done`` iterations, kept in the history and said."""
        evaluator = self.components.evaluator
        result = evaluator.evaluate(phase)
        if evaluator.releases_memory:
            # its garbage (reference cycles among its episodes' objects) stayed resident under the next
            # update's peak: SmolLM2 on Nim-v0, 40 episodes before PPO, 4.56 GB in the update, 3.05 without
            release_freed_memory()
        row = {"iteration": done, "phase": phase, "time": time.time(), **result}
        if self.steps:
            row["global_step"] = done * self.steps
        self.history.append(row)
        line = evaluator.message(phase, result)
        if line:
            self.tracker.message(line)
        return result

    def run(self, start_it: int, stop: GracefulStop) -> None:
        """Iterations ``start_it`` .. the last (or a stopping rule's); a checkpoint on schedule,
        on SIGINT/SIGTERM (``stop``; then :class:`~ppokit.errors.Interrupted`) and at the end."""
        cfg, source, learner = self.cfg, self.components.source, self.components.learner
        self.last = start_it - 1
        self.start = time.perf_counter()
        self.start_it = start_it
        self.health = RunHealth(cfg)
        stop.defer()  # from here a signal stops the run at the end of an iteration, with a checkpoint
        source.sync_weights(learner)  # a source in other processes starts from these weights
        for it in range(start_it, cfg.iterations):
            self.last = it
            t0 = time.perf_counter()
            metrics = self.metrics = self._iterate(it)
            last = it == cfg.iterations - 1
            stop_reason = self._evaluate_on_schedule(it, metrics, last)
            metrics["time_iteration"] = time.perf_counter() - t0
            self.tracker.log(it, metrics)
            if last or stop_reason:
                self.final_path = self.save(self.run_dir / rundir.FINAL_DIR, it + 1, finished=True)
                break
            periodic = cfg.run.checkpoint_every and (it + 1) % cfg.run.checkpoint_every == 0
            if stop.requested:
                self.tracker.message(f"received {stop.signal_name}: saving a checkpoint after iteration {it}")
            if periodic or stop.requested:
                path = self.save(rundir.periodic_checkpoint_path(self.run_dir, it + 1), it + 1)
                rundir.prune_checkpoints(self.run_dir, cfg.run.keep_checkpoints)
                if stop.requested:
                    raise stop.interrupted(path, self.run_dir)

    def _iterate(self, it: int) -> dict[str, Any]:
        """Iteration ``it``'s rollouts, scores and update: its metrics (times, peaks, health said)."""
        cfg, c = self.cfg, self.components
        ahead = cfg.rollout.off_policy_steps  # k: rollouts queued ahead of the update
        t0 = time.perf_counter()
        with phase_peak() as collect_peak:
            batch = c.source.collect(it)
            # sampled by these weights (version it) while the updates run: iteration
            # it + k trains on version it (lag k); those queued already stay queued
            for later in range(it + 1, min(it + ahead, cfg.iterations - 1) + 1):
                c.source.prefetch(later)
        t1 = time.perf_counter()
        with phase_peak() as score_peak:
            if c.scorer is not None:
                c.scorer.score(batch)
        t2 = time.perf_counter()
        with phase_peak() as update_peak:
            batch.tensors.update(zip(("advantages", "returns"), self.advantages(cfg, batch)))
            version = c.learner.policy_version
            try:
                metrics = c.learner.update(batch, it)
            except TrainingDiverged as exc:
                raise diverged_message(exc, self.run_dir) from None
            sync_metrics = c.source.sync_weights(c.learner)
        t3 = time.perf_counter()
        metrics.update(batch.metrics)
        metrics.update(sync_metrics or {})
        metrics.update(memory_metrics(collect=collect_peak, score=score_peak, update=update_peak))
        if ahead and batch.policy_version is not None:
            # the weights that sampled the batch, and the updates between them and this
            # update's: min(it, k) with the queue full (RolloutQueue)
            metrics["policy_version"] = batch.policy_version
            metrics["staleness"] = version - batch.policy_version
        metrics.update(time_collect=t1 - t0, time_update=t3 - t2)
        if c.scorer is not None:
            metrics["time_score"] = t2 - t1
        if self.steps:
            metrics["global_step"] = (it + 1) * self.steps
            metrics["sps"] = (it + 1 - self.start_it) * self.steps / max(t3 - self.start, 1e-9)
        else:
            metrics["samples"] = (it + 1) * len(batch)
        for line in self.health.check(it, metrics):  # no signal to learn from, runaway updates
            self.tracker.message(line)
        if batch.samples and cfg.run.log_samples and it % cfg.run.samples_every == 0:
            self.tracker.log_samples(it, batch.samples[: cfg.run.log_samples])
        return metrics

    def _evaluate_on_schedule(self, it: int, metrics: dict[str, Any], last: bool) -> str | None:
        """The periodic evaluation after iteration ``it`` and its stopping rule, the final one at the
        end, into ``metrics`` (and the summary); the reason to stop early, or None."""
        evaluator = self.components.evaluator
        stop_reason = None
        if evaluator is not None and evaluator.every and (it + 1) % evaluator.every == 0 and not last:
            result = self.evaluate("periodic", it + 1)
            metrics.update(result)
            stop_reason = evaluator.stop_reason(result)
            if stop_reason:
                self.tracker.message(f"{stop_reason}: stopping after iteration {it}")
                self.summary["stop_reason"] = stop_reason  # in the result and the final checkpoint's meta
        if last or stop_reason:
            if evaluator is not None:
                result = self.evaluate("final", it + 1)
                metrics.update(result)
                self.summary.update(result)
            metrics["wall_time"] = time.perf_counter() - self.start
        return stop_reason

    def save(self, path: Path, iteration: int, finished: bool = False) -> Path:
        """The whole run state at ``path`` (atomically; ``meta.json`` last). Non-finite weights are
        never written over (or pruned into) the good checkpoints."""
        c = self.components
        if not c.learner.weights_finite():
            raise diverged_message(
                TrainingDiverged(f"training diverged: the policy's weights are not finite after iteration {iteration}"),
                self.run_dir,
            )
        parts: dict[str, Any] = {"learner": c.learner.state_dict(), "source": c.source.state_dict()}
        if c.scorer is not None:
            parts["scorer"] = c.scorer.state_dict()
        if c.evaluator is not None:
            parts["evaluator"] = c.evaluator.state_dict()
        parts["rng"] = capture_rng()
        meta = {
            "workload": self.workload.name,
            "iteration": iteration,
            "finished": finished,
            "eval_history": self.history,
            "summary": self.summary,
            **c.checkpoint_meta,
            "config": self.cfg.to_dict(),
        }
        if self.steps:
            meta["global_step"] = iteration * self.steps
        return save_checkpoint(path, parts, meta, files=c.learner.save_files)

    def result(self) -> dict[str, Any]:
        """The last iteration's metrics with the summary, the history and where the run and its
        final checkpoint are."""
        result = dict(self.metrics)
        result.update(self.summary)
        result.update(
            iterations=self.last + 1,
            eval_history=self.history,
            run_dir=str(self.run_dir),
            checkpoint=str(self.final_path) if self.final_path is not None else None,
        )
        return result


def memory_metrics(**phases: PhasePeak) -> dict[str, float]:
    """``memory/peak_gb/<phase>`` for each phase of the iteration and ``memory/peak_gb``, the
    largest (:mod:`ppokit.monitoring.peak_memory`: the CUDA allocator's peak, or the process's resident peak)."""
    out = {f"memory/peak_gb/{name}": peak.gb for name, peak in phases.items()}
    out["memory/peak_gb"] = max(out.values())
    return out


# ----------------------------------------------------------------------------- checkpoints
def read_resumable_checkpoint(workload: Workload, cfg: Config, path: Path, run_dir: Path) -> Checkpoint:
    """The checkpoint at ``path``, checked to continue this run: its workload, its config (equal
    but for how the run reports), its iteration count and its parts. Every problem is a
    one-line :class:`UserError` naming the checkpoint (and what to resume from instead)."""
    with rundir.advising_on_damage(path, run_dir):
        ckpt = load_checkpoint(path)
    meta_file = path / rundir.META
    if ckpt.meta.get("workload") != workload.name:
        raise UserError(f"checkpoint file {meta_file} is not a {workload.name}-workload checkpoint")
    if ckpt.meta.get("version", 1) < 2:
        raise UserError(
            f"checkpoint {path} was written by an older ppokit and cannot be resumed (ppokit eval "
            "and export still read it); start the run over"
        )
    workload.check_checkpoint(ckpt.meta, path)
    rundir.check_resumable_config(ckpt.meta.get("config", {}), cfg.to_dict(), run_dir)
    rundir.checked_iteration(ckpt.meta, path, cfg.iterations, run_dir)
    missing = [k for k in REQUIRED_PARTS if k not in ckpt.parts]
    if missing:
        raise UserError(
            f"checkpoint {path} cannot be resumed from: it has no {', '.join(missing)} state; "
            f"{rundir.resume_instead(path, run_dir)}"
        )
    return ckpt


def _load_state(ckpt: Checkpoint, components: Components, run_dir: Path) -> tuple[int, list, dict, list[str]]:
    """Copy a checkpoint into freshly built components, RNGs last (building used them too).

    Returns (completed iterations, evaluation history, summary, notes to print).
    """
    path = ckpt.path
    try:
        with rundir.advising_on_damage(path, run_dir):
            learner_state = ckpt.parts["learner"]
            if not components.learner.reads_shards:  # FSDP learners read their own slices
                learner_state = resolve_sharded(learner_state, path)
            components.learner.load_state_dict(learner_state, path)
        notes = list(components.source.load_state_dict(ckpt.parts["source"]) or [])
        if components.scorer is not None:
            components.scorer.load_state_dict(ckpt.parts.get("scorer", {}))
        if components.evaluator is not None and "evaluator" in ckpt.parts:
            components.evaluator.load_state_dict(ckpt.parts["evaluator"])
        restore_rng(ckpt.parts["rng"])
    except UserError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"checkpoint {path} does not match this run ({reason})") from None
    history = [dict(row) for row in ckpt.meta.get("eval_history", [])]
    return int(ckpt.meta["iteration"]), history, dict(ckpt.meta.get("summary", {})), notes


def _finished_result(run_dir: Path, ckpt: Checkpoint) -> dict[str, Any]:
    rows = rundir.read_metrics(run_dir)
    result = dict(rows[-1]) if rows else {}
    result.update(ckpt.meta.get("summary", {}))
    result.update(
        iterations=int(ckpt.meta["iteration"]),
        eval_history=ckpt.meta.get("eval_history", []),
        checkpoint=str(ckpt.path),
        run_dir=str(run_dir),
        already_finished=True,
    )
    return result


def diverged_message(exc: TrainingDiverged, run_dir: Path | str) -> TrainingDiverged:
    """``exc`` with where the last good checkpoint is (nothing newer was written)."""
    last = rundir.latest_checkpoint(run_dir)
    where = (
        f"the last good checkpoint is {last} (resume with: ppokit train --resume {run_dir}, "
        "after lowering train.learning_rate)"
        if last is not None
        else "no checkpoint was written (set run.checkpoint_every to keep one)"
    )
    return TrainingDiverged(f"{exc}; {where}")
