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
directory at a time (:class:`ppokit.rundir.RunLock`). On the CPU a resumed run is bit
for bit the uninterrupted one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ppokit import rundir
from ppokit.checkpoint import Checkpoint, load_checkpoint, resolve_sharded, save_checkpoint
from ppokit.components import Components, Workload
from ppokit.config import Config
from ppokit.errors import TrainingDiverged, UserError
from ppokit.health import RunHealth
from ppokit.peak_memory import PhasePeak, phase_peak
from ppokit.resume import GracefulStop, capture_rng, restore_rng
from ppokit.track import Tracker
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
    iterations = cfg.iterations
    saved = None
    if resume_from is not None:
        saved = read_resumable_checkpoint(workload, cfg, resume_from, run_dir)  # before anything is built
        if saved.meta.get("finished") or saved.meta["iteration"] >= iterations:
            rundir.truncate_logs(run_dir, saved.meta["iteration"])
            return _finished_result(run_dir, saved)
    components: Components | None = None
    tracker = None
    try:
        components = workload.build(run_dir)
        source, scorer, learner, evaluator = (
            components.source,
            components.scorer,
            components.learner,
            components.evaluator,
        )
        advantages = components.advantages or batch_advantages
        start_it, history, summary, notes = 0, [], {}, []
        if saved is not None:
            start_it, history, summary, notes = _load_state(saved, components, run_dir)
            rundir.truncate_logs(run_dir, start_it)  # only now: the resume goes ahead
        steps = source.steps_per_iteration
        # The tracker comes once the run is built and any checkpoint loaded: a resume that fails
        # leaves metrics.jsonl and TensorBoard as they were. TensorBoard's x axis is the global
        # step where there is one: the resumed run's first logged step is purged and written again.
        purge = None if saved is None else (start_it * steps + 1 if steps else start_it)
        tracker = Tracker(run_dir, cfg, iterations, description=components.description or None, purge_step=purge)
        for line in components.header + notes:
            tracker.message(line)
        if saved is not None:
            tracker.message(f"resumed from {resume_from} at iteration {start_it}")

        def evaluate(phase: str, done: int) -> dict[str, float]:
            result = evaluator.evaluate(phase)
            row = {"iteration": done, "phase": phase, "time": time.time(), **result}
            if steps:
                row["global_step"] = done * steps
            history.append(row)
            line = evaluator.message(phase, result)
            if line:
                tracker.message(line)
            return result

        if saved is None and evaluator is not None and evaluator.at_start:
            summary.update(evaluate("before", 0))
        start = time.perf_counter()
        metrics: dict[str, Any] = {}
        final_path: Path | None = None
        it = start_it - 1
        ahead = cfg.rollout.off_policy_steps  # k: rollouts queued ahead of the update
        health = RunHealth(cfg)
        with GracefulStop() as stop:
            source.sync_weights(learner)  # a source in other processes starts from these weights
            for it in range(start_it, iterations):
                t0 = time.perf_counter()
                with phase_peak() as collect_peak:
                    batch = source.collect(it)
                    # sampled by these weights (version it) while the updates run: iteration
                    # it + k trains on version it (lag k); those queued already stay queued
                    for later in range(it + 1, min(it + ahead, iterations - 1) + 1):
                        source.prefetch(later)
                t1 = time.perf_counter()
                with phase_peak() as score_peak:
                    if scorer is not None:
                        scorer.score(batch)
                t2 = time.perf_counter()
                with phase_peak() as update_peak:
                    batch.tensors.update(zip(("advantages", "returns"), advantages(cfg, batch)))
                    version = learner.policy_version
                    try:
                        metrics = learner.update(batch, it)
                    except TrainingDiverged as exc:
                        raise diverged_message(exc, run_dir) from None
                    sync_metrics = source.sync_weights(learner)
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
                if scorer is not None:
                    metrics["time_score"] = t2 - t1
                if steps:
                    metrics["global_step"] = (it + 1) * steps
                    metrics["sps"] = (it + 1 - start_it) * steps / max(t3 - start, 1e-9)
                else:
                    metrics["samples"] = (it + 1) * len(batch)
                for line in health.check(it, metrics):  # no signal to learn from, runaway updates
                    tracker.message(line)
                if batch.samples and cfg.run.log_samples and it % cfg.run.samples_every == 0:
                    tracker.log_samples(it, batch.samples[: cfg.run.log_samples])
                last = it == iterations - 1
                stop_reason = None
                if evaluator is not None and evaluator.every and (it + 1) % evaluator.every == 0 and not last:
                    result = evaluate("periodic", it + 1)
                    metrics.update(result)
                    stop_reason = evaluator.stop_reason(result)
                    if stop_reason:
                        tracker.message(f"{stop_reason}: stopping after iteration {it}")
                        summary["stop_reason"] = stop_reason  # in the result and the final checkpoint's meta
                if last or stop_reason:
                    if evaluator is not None:
                        result = evaluate("final", it + 1)
                        metrics.update(result)
                        summary.update(result)
                    metrics["wall_time"] = time.perf_counter() - start
                metrics["time_iteration"] = time.perf_counter() - t0
                tracker.log(it, metrics)
                state = dict(
                    components=components, workload=workload, cfg=cfg, history=history, summary=summary, run_dir=run_dir
                )
                if last or stop_reason:
                    final_path = _save(run_dir / rundir.FINAL_DIR, it + 1, finished=True, **state)
                    break
                periodic = cfg.run.checkpoint_every and (it + 1) % cfg.run.checkpoint_every == 0
                if stop.requested:
                    tracker.message(f"received {stop.signal_name}: saving a checkpoint after iteration {it}")
                if periodic or stop.requested:
                    path = _save(rundir.periodic_checkpoint_path(run_dir, it + 1), it + 1, **state)
                    rundir.prune_checkpoints(run_dir, cfg.run.keep_checkpoints)
                    if stop.requested:
                        raise stop.interrupted(path, run_dir)
    finally:
        if tracker is not None:
            tracker.close()
        if components is not None:
            components.close()
    result = dict(metrics)
    result.update(summary)
    result.update(
        iterations=it + 1,
        eval_history=history,
        run_dir=str(run_dir),
        checkpoint=str(final_path) if final_path is not None else None,
    )
    return result


def memory_metrics(**phases: PhasePeak) -> dict[str, float]:
    """``memory/peak_gb/<phase>`` for each phase of the iteration and ``memory/peak_gb``, the
    largest (:mod:`ppokit.peak_memory`: the CUDA allocator's peak, or the process's resident peak)."""
    out = {f"memory/peak_gb/{name}": peak.gb for name, peak in phases.items()}
    out["memory/peak_gb"] = max(out.values())
    return out


# ----------------------------------------------------------------------------- checkpoints
def _save(
    path: Path,
    iteration: int,
    *,
    components: Components,
    workload: Workload,
    cfg: Config,
    history: list,
    summary: dict,
    run_dir: Path,
    finished: bool = False,
) -> Path:
    """The whole run state at ``path`` (atomically; ``meta.json`` last). Non-finite weights are
    never written over (or pruned into) the good checkpoints."""
    if not components.learner.weights_finite():
        raise diverged_message(
            TrainingDiverged(f"training diverged: the policy's weights are not finite after iteration {iteration}"),
            run_dir,
        )
    parts: dict[str, Any] = {"learner": components.learner.state_dict(), "source": components.source.state_dict()}
    if components.scorer is not None:
        parts["scorer"] = components.scorer.state_dict()
    if components.evaluator is not None:
        parts["evaluator"] = components.evaluator.state_dict()
    parts["rng"] = capture_rng()
    meta = {
        "workload": workload.name,
        "iteration": iteration,
        "finished": finished,
        "eval_history": history,
        "summary": summary,
        **components.checkpoint_meta,
        "config": cfg.to_dict(),
    }
    steps = components.source.steps_per_iteration
    if steps:
        meta["global_step"] = iteration * steps
    return save_checkpoint(path, parts, meta, files=components.learner.save_files)


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
