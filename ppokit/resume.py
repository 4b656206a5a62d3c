"""Exact resume, graceful interruption and divergence guards, shared by the workloads.

The CLI picks the run directory and the checkpoint (:func:`prepare_run_dir` for
``ppokit train CONFIG [--resume]`` and ``run.resume``, :func:`open_run_for_resume` for
``ppokit train --resume RUN_DIR``) and hands the checkpoint path to the workload, which
continues a run bit for bit like this (``ppokit/control/workload.py`` is the example)::

    ...build everything exactly as for a fresh run (same seeds, same construction order)...
    if resume_from:
        ckpt = checkpoint.load_checkpoint(resume_from)
        check_resumable_config(ckpt.meta["config"], cfg.to_dict(), run_dir)
        load weights, optimizer + schedule, env/data state, counters from ckpt
        restore_rng(ckpt.parts["rng"], generators)       # last: construction used RNGs too
        truncate_metrics(run_dir, ckpt.meta["iteration"])
    with GracefulStop() as stop:
        for it in range(start, iterations):
            ...one iteration (trainer.update raises TrainingDiverged -> diverged_message)...
            tracker.log(it, metrics)                     # the row first, then the checkpoint
            if periodic or stop.requested:
                parts = {..., "rng": capture_rng(generators)}
                path = save_checkpoint(periodic_checkpoint_path(run_dir, it + 1), parts, meta)
            if stop.requested: raise stop.interrupted(path, run_dir)

The pieces:

- :func:`capture_rng` / :func:`restore_rng`: Python ``random``, the numpy global RNG,
  the torch CPU (and initialized CUDA) RNG, plus any ``torch.Generator`` or
  ``np.random.Generator`` the run owns, as checkpoint-storable data (JSON + tensors,
  nothing pickled).
- :class:`GracefulStop`: the first SIGINT/SIGTERM only sets a flag, so the loop ends
  the iteration, saves a checkpoint and exits 130/143 with a resume hint
  (:class:`~ppokit.errors.Interrupted`); a second signal stops at once
  (``KeyboardInterrupt``; the last checkpoint on disk is intact).
- :class:`BadStepGuard`: counts consecutive skipped (non-finite) optimizer steps and
  raises :class:`~ppokit.errors.TrainingDiverged` after ``train.max_bad_steps``.
- :func:`find_checkpoints` / :func:`latest_checkpoint`: the newest complete checkpoint of
  a run directory (``RUN_DIR/checkpoint`` or ``RUN_DIR/checkpoints/iter-NNNNNN``);
  leftovers of a writer that was killed mid-write are recovered or removed first.
- :func:`truncate_metrics`: drop the ``metrics.jsonl`` rows written after the checkpoint.
- :func:`find_resume_checkpoint` / :func:`check_resumable_config`: what ``run.resume``,
  ``ppokit train CONFIG --resume`` and ``ppokit train --resume RUN_DIR`` share.

A metrics row is written *before* the checkpoint of the same iteration: a kill between
the two loses nothing that the resumed run does not write again.

This module imports torch and numpy lazily (the CLI imports it for argument handling).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

from ppokit.errors import Interrupted, TrainingDiverged, UserError

__all__ = [
    "FINAL_DIR", "PERIODIC_DIR", "BadStepGuard", "GracefulStop", "Interrupted", "TrainingDiverged",
    "capture_rng", "restore_rng", "find_checkpoints", "latest_checkpoint", "periodic_checkpoint_path",
    "truncate_metrics", "find_resume_checkpoint", "checked_iteration", "resume_instead", "advising_on_damage",
    "check_resumable_config",
    "config_differences", "all_finite", "PRESENTATION_FIELDS",
    "prepare_run_dir", "open_run_for_resume", "diverged_message", "generator_state", "set_generator_state",
]

FINAL_DIR = "checkpoint"      # RUN_DIR/checkpoint: written when training ends
PERIODIC_DIR = "checkpoints"  # RUN_DIR/checkpoints/iter-NNNNNN: run.checkpoint_every, interruptions


# ----------------------------------------------------------------------------- RNG
def _tag_arrays(obj: Any) -> Any:
    """numpy arrays inside an RNG state -> ``{"__array__": dtype, "data": list}`` (JSON, exact)."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return {"__array__": obj.dtype.str, "data": obj.tolist()}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _tag_arrays(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tag_arrays(v) for v in obj]
    return obj


def _untag_arrays(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, dict):
        if "__array__" in obj:
            return np.array(obj["data"], dtype=np.dtype(obj["__array__"]))
        return {k: _untag_arrays(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_untag_arrays(v) for v in obj]
    return obj


def generator_state(gen: Any) -> Any:
    """The state of a ``torch.Generator`` (uint8 tensor) or ``np.random.Generator`` (dict)."""
    import numpy as np
    import torch

    if isinstance(gen, torch.Generator):
        return gen.get_state()
    if isinstance(gen, np.random.Generator):
        return _tag_arrays(gen.bit_generator.state)
    raise TypeError(f"not a random generator: {type(gen).__name__}")


def set_generator_state(gen: Any, state: Any) -> None:
    """Inverse of :func:`generator_state`."""
    import numpy as np
    import torch

    if isinstance(gen, torch.Generator):
        gen.set_state(state)
    elif isinstance(gen, np.random.Generator):
        gen.bit_generator.state = _untag_arrays(state)
    else:
        raise TypeError(f"not a random generator: {type(gen).__name__}")


def capture_rng(generators: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Every RNG state a run depends on, as checkpoint-storable data (see :mod:`ppokit.checkpoint`).

    ``generators``: the run's own ``torch.Generator`` / ``np.random.Generator`` objects by name.
    """
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": _tag_arrays(np.random.get_state(legacy=False)),
        "torch": torch.get_rng_state(),
        "generators": {name: generator_state(gen) for name, gen in (generators or {}).items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: Mapping[str, Any], generators: Optional[Mapping[str, Any]] = None) -> None:
    """Set the RNGs captured by :func:`capture_rng` (a generator missing from the state is an error)."""
    import numpy as np
    import torch

    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
    np.random.set_state(_untag_arrays(state["numpy"]))
    torch.set_rng_state(_as_byte_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = [_as_byte_tensor(s) for s in state["cuda"]]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
    saved_gens = state.get("generators", {})
    for name, gen in (generators or {}).items():
        if name not in saved_gens:
            raise ValueError(f"the checkpoint has no state for the random generator '{name}'")
        set_generator_state(gen, saved_gens[name])


def _as_byte_tensor(x: Any):
    import torch

    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.uint8)


# ----------------------------------------------------------------------------- signals
class GracefulStop:
    """Context manager: the first SIGINT/SIGTERM asks the loop to stop at a safe point.

    ``requested`` turns true and ``signum`` records the signal; the loop checks it once
    per iteration, saves a checkpoint and raises :meth:`interrupted`. A second signal
    raises ``KeyboardInterrupt`` at once. The handler only sets the flag (printing from a
    signal handler can collide with a write in progress). Outside the main thread (where
    handlers cannot be installed) it does nothing. The previous handlers come back on exit.
    """

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def interrupted(self, checkpoint_path: Path | str, run_dir: Path | str) -> Interrupted:
        """The exception to raise after the interruption checkpoint is on disk (exit 128 + signum)."""
        return Interrupted(f"interrupted: checkpoint saved at {checkpoint_path}; resume with: "
                           f"ppokit train --resume {run_dir}", exit_code=128 + int(self.signum or signal.SIGINT))


# ----------------------------------------------------------------------------- divergence
class BadStepGuard:
    """Counts consecutive bad (skipped, non-finite) optimizer steps.

    ``step(ok)`` after every optimizer step; after ``limit`` bad steps in a row it raises
    :class:`TrainingDiverged` (``limit=0``: never). The workload re-raises it through
    :func:`diverged_message`, which adds where the last good checkpoint is. The guard is
    part of the trainer's state (``state_dict``), so a streak survives a resume.
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.streak = 0
        self.total = 0

    def step(self, ok: bool) -> None:
        if ok:
            self.streak = 0
            return
        self.streak += 1
        self.total += 1
        if self.limit and self.streak >= self.limit:
            raise TrainingDiverged(f"training diverged: {self.streak} optimizer steps in a row had a non-finite "
                                   f"loss or gradient (train.max_bad_steps={self.limit})")

    def state_dict(self) -> dict[str, int]:
        return {"streak": self.streak, "total": self.total}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.streak = int(state.get("streak", 0))
        self.total = int(state.get("total", 0))


def diverged_message(exc: TrainingDiverged, run_dir: Path | str, **lookup: Any) -> TrainingDiverged:
    """``exc`` with where the last good checkpoint is (nothing newer was written)."""
    last = latest_checkpoint(run_dir, **lookup)
    where = (f"the last good checkpoint is {last} (resume with: ppokit train --resume {run_dir}, "
             "after lowering train.learning_rate)" if last is not None
             else "no checkpoint was written (set run.checkpoint_every to keep one)")
    return TrainingDiverged(f"{exc}; {where}")


def all_finite(tensors: Any) -> bool:
    """True when every tensor in ``tensors`` (an iterable) holds only finite values."""
    import torch

    return all(bool(torch.isfinite(t).all()) for t in tensors)


# ----------------------------------------------------------------------------- checkpoints
def periodic_checkpoint_path(run_dir: Path | str, iteration: int) -> Path:
    """``RUN_DIR/checkpoints/iter-NNNNNN`` for the state after ``iteration`` iterations."""
    return Path(run_dir) / PERIODIC_DIR / f"iter-{iteration:06d}"


def _iteration_of(path: Path, marker: str) -> Optional[int]:
    if path.name.startswith("iter-") and path.name[5:].isdigit():
        return int(path.name[5:])
    meta = path / marker
    try:
        value = json.loads(meta.read_text()).get("iteration")
    except (OSError, ValueError, AttributeError):
        raise UserError(f"checkpoint file {meta} is corrupt or truncated") from None
    if not isinstance(value, int):
        raise UserError(f"checkpoint file {meta} has no iteration count")
    return value


def checked_iteration(meta: Mapping[str, Any], path: Path | str, iterations: int, run_dir: Path | str,
                      *, marker: str = "meta.json") -> int:
    """The checkpoint's count of completed iterations, checked to be sane.

    It must be an integer in ``[0, iterations]`` and, for ``iter-N``, equal ``N``. Anything
    else means the checkpoint is corrupt: a :class:`UserError` naming its ``marker`` file
    and the newest other checkpoint of ``run_dir`` to resume from instead.
    """
    path = Path(path)
    value = meta.get("iteration")
    named = int(path.name[5:]) if path.name.startswith("iter-") and path.name[5:].isdigit() else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= iterations \
            and named in (None, value):
        return value
    expected = f"{named}" if named is not None else f"0..{iterations}"
    raise UserError(f"checkpoint {path} is corrupt: {path / marker} says iteration {value!r} "
                    f"(expected {expected}); {resume_instead(path, run_dir, marker=marker)}")


def resume_instead(path: Path | str, run_dir: Path | str, *, marker: str = "meta.json") -> str:
    """What to do about a damaged checkpoint ``path``: resume from the newest other one."""
    path = Path(path)
    others = [p for _, p in find_checkpoints(run_dir, marker=marker) if p != path] if Path(run_dir).is_dir() else []
    return (f"move it out of the run directory to resume from {others[-1]}" if others
            else "no other checkpoint to resume from: start the run over")


@contextlib.contextmanager
def advising_on_damage(path: Path | str, run_dir: Path | str, *, marker: str = "meta.json") -> Iterator[None]:
    """A damaged file of checkpoint ``path`` found inside the block ("checkpoint file ... is
    corrupt or truncated"): its error also says what to do (:func:`resume_instead`)."""
    try:
        yield
    except UserError as exc:
        if not str(exc).startswith("checkpoint file "):
            raise
        raise UserError(f"{exc}; {resume_instead(path, run_dir, marker=marker)}") from None


def find_checkpoints(run_dir: Path | str, *, marker: str = "meta.json") -> list[tuple[int, Path]]:
    """``(iteration, path)`` of the run's complete checkpoints, oldest first.

    Candidates are ``RUN_DIR/checkpoint`` and ``RUN_DIR/checkpoints/iter-NNNNNN``; a
    candidate counts when its ``marker`` file (relative to it; written last) exists.
    Leftovers of a killed writer are recovered first (:func:`ppokit.checkpoint.recover_interrupted`).
    At equal iterations the final checkpoint sorts last.
    """
    from ppokit.checkpoint import recover_interrupted

    run_dir = Path(run_dir)
    found: list[tuple[int, int, Path]] = []
    periodic = run_dir / PERIODIC_DIR
    if periodic.is_dir():
        recover_interrupted(periodic)
        for p in periodic.iterdir():
            if p.is_dir() and p.name.startswith("iter-") and (p / marker).is_file():
                found.append((_iteration_of(p, marker), 0, p))
    if run_dir.is_dir():
        recover_interrupted(run_dir)
    final = run_dir / FINAL_DIR
    if (final / marker).is_file():
        found.append((_iteration_of(final, marker), 1, final))
    return [(it, p) for it, _, p in sorted(found)]


def latest_checkpoint(run_dir: Path | str, *, marker: str = "meta.json") -> Optional[Path]:
    """The newest complete checkpoint of ``run_dir`` (see :func:`find_checkpoints`), or None."""
    found = find_checkpoints(run_dir, marker=marker)
    return found[-1][1] if found else None


# ----------------------------------------------------------------------------- metrics
# The run's JSONL logs, one row per iteration (metrics) or per logged rollout sample.
ITERATION_LOGS = ("metrics.jsonl", "samples.jsonl")


def truncate_metrics(run_dir: Path | str, iteration: int) -> int:
    """Keep the rows of ``metrics.jsonl`` (and ``samples.jsonl``) with ``row["iteration"] <
    iteration``; returns how many metrics rows.

    ``iteration`` is the checkpoint's count of completed iterations (rows are numbered
    from 0). Rows after it and a torn last line are dropped; each file is replaced atomically.
    """
    kept = [_truncate_rows(Path(run_dir) / name, iteration) for name in ITERATION_LOGS]
    return kept[0]


def _truncate_rows(path: Path, iteration: int) -> int:
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("iteration"), int) and row["iteration"] < iteration:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(kept)


# ----------------------------------------------------------------------------- resume policy
# Fields that may differ between the saved config and the one a run resumes with: they
# change how a run reports or where it keeps checkpoints, not what it computes.
PRESENTATION_FIELDS = ("preset", "run.output_dir", "run.name", "run.progress", "run.tensorboard", "run.resume",
                       "run.checkpoint_every", "run.keep_checkpoints", "run.log_samples", "run.samples_every")


def _leaves(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and k != "kwargs":
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resumable_config(saved: Mapping[str, Any], given: Mapping[str, Any], where: Path | str,
                           hint: Optional[str] = None) -> None:
    """Raise :class:`UserError` when ``given`` differs from the run's ``saved`` config beyond
    :data:`PRESENTATION_FIELDS` (resuming with other settings would not be the same run)."""
    diff = config_differences(saved, given)
    if diff:
        hint = hint or f"resume with the run's own config: ppokit train --resume {where}"
        raise UserError(f"cannot resume {where}: the config differs from the run's in {diff}; {hint}")


def config_differences(saved: Mapping[str, Any], given: Mapping[str, Any]) -> str:
    """``"seed (1 in the run, 5 now), ..."``: the fields beyond :data:`PRESENTATION_FIELDS` where
    ``given`` differs from ``saved`` (the first three); ``""`` when there are none."""
    a, b = _leaves(saved), _leaves(given)
    diff = [k for k in sorted(set(a) | set(b)) if k not in PRESENTATION_FIELDS and a.get(k) != b.get(k)]
    shown = ", ".join(f"{k} ({a.get(k)!r} in the run, {b.get(k)!r} now)" for k in diff[:3])
    return shown + (f" and {len(diff) - 3} more" if len(diff) > 3 else "")


# Where each workload's checkpoint keeps the JSON with "iteration" and "config" (written last).
CHECKPOINT_MARKERS = {"control": "meta.json", "lm": "trainer/meta.json"}


def prepare_run_dir(cfg: Any, *, required: bool = False) -> tuple[Path, Optional[Path]]:
    """The run directory of ``cfg`` and the checkpoint to resume from (None: a fresh start).

    ``required`` (``ppokit train CONFIG --resume``): the run directory ``run.output_dir/run.name``
    must hold a checkpoint. Otherwise ``run.resume`` decides: ``never`` creates a new run
    directory (:func:`ppokit.track.create_run_dir`); ``auto`` resumes from the newest
    checkpoint when there is one and else starts over in that directory (rows of an
    attempt that never reached a checkpoint are dropped).
    """
    from ppokit.track import create_run_dir, has_started, read_run_config

    if not required and cfg.run.resume == "never":
        return create_run_dir(cfg), None
    if not cfg.run.name:
        raise UserError("--resume needs a fixed run directory: set run.name (or --name), or name the "
                        "directory: ppokit train --resume RUN_DIR")
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    marker = CHECKPOINT_MARKERS.get(cfg.workload, "meta.json")
    found = find_resume_checkpoint(run_dir, required=required, marker=marker)
    if found is not None:
        return run_dir, found
    if not has_started(run_dir):
        return create_run_dir(cfg), None    # new, or a run that never got to its first iteration
    config_file = run_dir / "config.yaml"
    saved = read_run_config(config_file)
    if saved is not None:
        check_resumable_config(saved, cfg.to_dict(), run_dir, hint="choose another run.name or delete the directory")
    truncate_metrics(run_dir, 0)
    config_file.write_text(cfg.to_yaml())
    return run_dir, None


def open_run_for_resume(run_dir: Path | str, overrides: list[str]) -> tuple[Any, Path, Path]:
    """``ppokit train --resume RUN_DIR [KEY=VALUE ...]``: (config, run dir, checkpoint).

    The config is the run's own, from its newest checkpoint; overrides may change only
    :data:`PRESENTATION_FIELDS` (e.g. ``run.progress=false``).
    """
    from ppokit.config import build_config, parse_overrides, read_yaml
    from ppokit.track import read_run_config

    run_dir = Path(run_dir)
    config_file = run_dir / "config.yaml"
    if not run_dir.is_dir() or not config_file.is_file():
        raise UserError(f"--resume {run_dir}: not a run directory (no config.yaml); to resume the run.name of a "
                        "config, write: ppokit train CONFIG --resume")
    workload = (read_run_config(config_file) or {}).get("workload")
    if workload in CHECKPOINT_MARKERS:
        marker = CHECKPOINT_MARKERS[workload]
        found = find_resume_checkpoint(run_dir, required=True, marker=marker)
    else:   # an empty or damaged config.yaml: the checkpoint's own copy of the config can stand in
        found, marker = None, ""
        for candidate in CHECKPOINT_MARKERS.values():
            found, marker = find_resume_checkpoint(run_dir, required=False, marker=candidate), candidate
            if found is not None:
                break
        if found is None:
            raise UserError(f"cannot resume: run directory {run_dir} has no checkpoint, and its {config_file} is "
                            "empty or not a ppokit config")
    try:
        saved = json.loads((found / marker).read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        raise UserError(f"checkpoint file {found / marker} is corrupt or truncated") from None
    if not isinstance(saved, dict):
        saved = read_yaml(config_file)
    elif workload not in CHECKPOINT_MARKERS:
        print(f"ppokit: warning: {config_file} is empty or not a ppokit config; using the config saved in "
              f"{found / marker}", file=sys.stderr, flush=True)
    cfg = build_config([saved, parse_overrides(overrides)])
    check_resumable_config(saved, cfg.to_dict(), run_dir,
                           hint=f"with --resume RUN_DIR only these may change: {', '.join(PRESENTATION_FIELDS[3:])}")
    return cfg, run_dir, found


def find_resume_checkpoint(run_dir: Path | str, *, required: bool, marker: str = "meta.json") -> Optional[Path]:
    """The checkpoint to resume ``run_dir`` from; None to start fresh (only when not ``required``)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        if required:
            raise UserError(f"cannot resume: run directory {run_dir} does not exist")
        return None
    last = latest_checkpoint(run_dir, marker=marker)
    if last is None and required:
        raise UserError(f"cannot resume: run directory {run_dir} has no checkpoint (one is written every "
                        "run.checkpoint_every iterations, on SIGINT/SIGTERM and at the end); to start it over "
                        "in the same directory, run its config with run.resume=auto")
    return last
