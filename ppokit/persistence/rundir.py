"""The run directory: its layout, the lock of the process that trains in it, and what a
resume reads back from it.

::

    RUN_DIR/
      config.yaml      the resolved configuration (what ``ppokit config show`` prints)
      metrics.jsonl    one JSON object per iteration
      samples.jsonl    lm: a few rollout samples every run.samples_every iterations
      tb/              TensorBoard event files (when tensorboard is installed)
      curves.png       the training curves, drawn when the run ends (``ppokit plot``)
      checkpoint/      the final checkpoint (meta.json; lm: policy.json, the policy's files)
      checkpoints/     iter-NNNNNN: periodic (run.checkpoint_every) and SIGINT/SIGTERM
                       checkpoints, the newest run.keep_checkpoints kept
      .lock            held by the process that trains in the directory
      base_model/      lm: the built-in tiny model or the warm-started model

A checkpoint is complete when its ``meta.json`` (written last, see
:mod:`ppokit.persistence.checkpoint`) exists. One process at a time trains in a run directory:
:class:`RunLock` is an exclusive ``flock`` on ``.lock``, which the kernel releases when
the process ends, however it ends (a lock left by a process killed with SIGKILL is free
for the next one). ``ppokit eval``, ``plot`` and ``export`` only read and take no lock.

The CLI picks the run directory and the checkpoint to resume from with
:func:`prepare_run_dir` (``ppokit train CONFIG [--resume]`` and ``run.resume``) or
:func:`open_run_for_resume` (``ppokit train --resume RUN_DIR``). The commands that read a run
(``eval``, ``export``, ``generate``, ``chat``) read it through one :class:`RunDir`: the
checkpoint each of them reads, its saved config, the workload kind and the metrics.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from ppokit.config import build_config, parse_overrides, read_yaml
from ppokit.errors import UserError
from ppokit.persistence.checkpoint_files import META, recover_interrupted  # META: a checkpoint's completion marker

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TB_DIR = "tb"
CURVES_FILE = "curves.png"
FINAL_DIR = "checkpoint"
PERIODIC_DIR = "checkpoints"
LOCK_FILE = ".lock"
POLICY_META_FILE = "policy.json"  # an LM checkpoint's policy (ppokit.lm.model.checkpoint)
MODEL_CONFIG_FILE = "config.json"  # a Hugging Face model directory's
ITERATION_LOGS = (METRICS_FILE, SAMPLES_FILE)  # one row per iteration (or per logged sample)
# What a run that never got to its first iteration may hold besides things built from its
# config (an LM run's base_model/, say): with only these it may start over with another config.
NOT_BUILT = (CONFIG_FILE, METRICS_FILE, TB_DIR, LOCK_FILE)


# ----------------------------------------------------------------------------- the lock
_HELD: dict[str, RunLock] = {}  # realpath -> this process's lock (re-entrant within a process)


class RunLock:
    """An exclusive lock on a run directory, for the process that trains in it.

    ``acquire()`` takes ``RUN_DIR/.lock`` with a non-blocking ``flock`` and writes this
    process's PID and command into it; when another live process holds it, a
    :class:`UserError` names that process. The kernel drops the lock when its process
    ends, so a lock left by a killed process is taken over (and said so). Re-entrant in
    one process: the CLI locks before it prepares the directory, the run loop locks again.
    """

    def __init__(self, run_dir: Path | str):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self._depth = 0
        self._holder: RunLock | None = None  # this process's lock on the directory, when taken again
        self.took_over: str | None = None  # the previous holder's line, when it had died

    def acquire(self) -> RunLock:
        key = os.path.realpath(self.run_dir)
        held = _HELD.get(key)
        if held is not None:
            held._depth += 1
            self._holder = held
            return held
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"cannot lock run directory {self.run_dir}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(f"cannot lock run directory {self.run_dir}: {exc.strerror or exc}") from None
            holder = _read_holder(self.path) or "another process"
            raise UserError(
                f"run directory {self.run_dir} is in use by {holder}; wait for it to finish, or stop "
                "it (its checkpoint is kept), or choose another run.name"
            ) from None
        previous = os.read(fd, 4096).decode(errors="replace").strip()
        self.took_over = previous.splitlines()[0] if previous else None
        if self.took_over:  # its holder ended without releasing it (killed): the lock is free
            print(
                f"ppokit: note: {self.run_dir} was locked by {self.took_over}, which has ended; taking it over",
                file=sys.stderr,
                flush=True,
            )
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"process {os.getpid()} ({' '.join(sys.argv)[:200]}) since {time.strftime('%H:%M:%S')}\n".encode())
        self._fd, self._depth = fd, 1
        _HELD[key] = self
        return self

    def release(self) -> None:
        if self._holder is not None:
            holder, self._holder = self._holder, None
            holder.release()
            return
        if self._fd is None:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        _HELD.pop(os.path.realpath(self.run_dir), None)
        try:
            os.ftruncate(self._fd, 0)  # the file stays (removing a locked file races); empty = free
        except OSError:
            pass
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def release_locks() -> None:
    """Release every run-directory lock this process holds, however often it was taken (the
    end of a command, whether it succeeded or not)."""
    for held in list(_HELD.values()):
        held._depth = 1
        held.release()


def _read_holder(path: Path) -> str | None:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return None
    return text.splitlines()[0] if text else None


# ----------------------------------------------------------------------------- creating
def is_run_dir(path: Path | str) -> bool:
    """Whether ``path`` looks like a ppokit run directory (metrics, checkpoints, or ppokit's config.yaml)."""
    path = Path(path)
    if any((path / name).exists() for name in (METRICS_FILE, FINAL_DIR, PERIODIC_DIR)):
        return True
    saved = read_run_config(path / CONFIG_FILE)
    return saved is not None and "workload" in saved


def has_started(run_dir: Path | str) -> bool:
    """Whether a run got anywhere: a ``metrics.jsonl`` row or a checkpoint (complete or not)."""
    run_dir = Path(run_dir)
    periodic = run_dir / PERIODIC_DIR
    return (
        bool(read_metrics(run_dir)) or (run_dir / FINAL_DIR).exists() or (periodic.is_dir() and any(periodic.iterdir()))
    )


def read_run_config(path: Path | str) -> dict | None:
    """A run's config.yaml as a dict; None when it is missing, empty or not a mapping."""
    try:
        saved = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def read_metrics(run_dir: Path | str) -> list[dict[str, Any]]:
    """All iterations of ``RUN_DIR/metrics.jsonl`` (a torn last line is ignored)."""
    path = Path(run_dir) / METRICS_FILE
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def check_reusable(run_dir: Path, cfg: Any) -> None:
    """Refuse an explicit ``run.name`` whose directory holds anything worth keeping.

    A missing or empty directory is fine, and so is a run that never got to its first
    iteration (a failed or interrupted setup: no metrics row, no checkpoint) when its
    config is this one, or it holds nothing built from its config (only :data:`NOT_BUILT`)
    and its ``metrics.jsonl`` shows that ppokit started it (else the config.yaml may be the
    user's own). Anything else (another run, files that are not a run) is a
    :class:`UserError` that says how to go on.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not any(p.name != LOCK_FILE for p in run_dir.iterdir()):
        return
    if not is_run_dir(run_dir):
        raise UserError(
            f"{run_dir} is not empty and is not a ppokit run directory; choose another run.name or delete it"
        )
    if has_started(run_dir):
        rows = len(read_metrics(run_dir))
        if (run_dir / FINAL_DIR).exists():
            how = "it has finished"
        elif (run_dir / PERIODIC_DIR).is_dir():
            how = f"resume it with: ppokit train --resume {run_dir}"
        else:
            how = f"it has no checkpoint: start it over (dropping its {rows} metrics rows) with run.resume=auto"
        raise UserError(
            f"run directory {run_dir} already holds a run ({rows} iterations logged); {how}; "
            "or choose another run.name or delete it"
        )
    saved = read_run_config(run_dir / CONFIG_FILE)
    diff = config_differences(saved, cfg.to_dict()) if saved is not None else ""
    built = sorted(p.name for p in run_dir.iterdir() if p.name not in NOT_BUILT)
    started_here = (run_dir / METRICS_FILE).exists()  # without it the config.yaml may be the user's own
    if diff and (built or not started_here):
        what = (
            f"holds a run that stopped before its first iteration, with another config ({diff}) and what it "
            f"built ({', '.join(built)})"
            if started_here
            else f"holds a config.yaml of another config ({diff}) and no run"
        )
        raise UserError(f"run directory {run_dir} {what}; choose another run.name or delete it")


def create_run_dir(cfg: Any, lock: bool = False) -> Path:
    """Create a fresh run directory, lock it (``lock``: until the process ends) and write the
    resolved config into it.

    An explicit ``run.name`` whose directory holds a run or other files is refused rather
    than overwritten (:func:`check_reusable`); a run of the same config that never got to
    its first iteration is reused. Without a name the directory is
    ``<preset>-s<seed>-<time>`` under ``run.output_dir``.
    """
    root = Path(cfg.run.output_dir)
    if cfg.run.name:
        run_dir = root / cfg.run.name
        check_reusable(run_dir, cfg)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = f"{cfg.preset or cfg.workload}-s{cfg.seed}-{stamp}"
        run_dir = root / base
        suffix = 1
        while run_dir.exists():
            suffix += 1
            run_dir = root / f"{base}-{suffix}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create run directory {run_dir}: {exc.strerror or exc}") from None
    if lock:
        RunLock(run_dir).acquire()
    try:
        (run_dir / CONFIG_FILE).write_text(cfg.to_yaml())
        (run_dir / METRICS_FILE).touch()  # ppokit's mark: a run of this config started here
    except OSError as exc:
        raise UserError(f"cannot create run directory {run_dir}: {exc.strerror or exc}") from None
    return run_dir


def discard_unstarted(run_dir: Path | str) -> bool:
    """Remove a run directory that holds only what starting it wrote (:data:`NOT_BUILT`: its
    config, an empty ``metrics.jsonl``, its lock), as a start that failed on bad input leaves it:
    nothing of a run is lost. Anything else there (a warm start's ``base_model/``, a row, a
    checkpoint) keeps it. True when it was removed."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or has_started(run_dir) or any(entry.name not in NOT_BUILT for entry in run_dir.iterdir()):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)  # (the lock goes with it: this process holds it)
    return not run_dir.exists()


# ----------------------------------------------------------------------------- checkpoints
def periodic_checkpoint_path(run_dir: Path | str, iteration: int) -> Path:
    """``RUN_DIR/checkpoints/iter-NNNNNN`` for the state after ``iteration`` iterations."""
    return Path(run_dir) / PERIODIC_DIR / f"iter-{iteration:06d}"


def _iteration_of(path: Path) -> int:
    if path.name.startswith("iter-") and path.name[5:].isdigit():
        return int(path.name[5:])
    meta = path / META
    try:
        value = json.loads(meta.read_text()).get("iteration")
    except (OSError, ValueError, AttributeError):
        raise UserError(f"checkpoint file {meta} is corrupt or truncated") from None
    if not isinstance(value, int):
        raise UserError(f"checkpoint file {meta} has no iteration count")
    return value


def find_checkpoints(run_dir: Path | str) -> list[tuple[int, Path]]:
    """``(iteration, path)`` of the run's complete checkpoints, oldest first.

    Candidates are ``RUN_DIR/checkpoint`` and ``RUN_DIR/checkpoints/iter-NNNNNN``; a
    candidate counts when its ``meta.json`` (written last) exists. Leftovers of a killed
    writer are recovered first (:func:`ppokit.persistence.checkpoint_files.recover_interrupted`). At equal
    iterations the final checkpoint sorts last.
    """
    run_dir = Path(run_dir)
    found: list[tuple[int, int, Path]] = []
    periodic = run_dir / PERIODIC_DIR
    if periodic.is_dir():
        recover_interrupted(periodic)
        for p in periodic.iterdir():
            if p.is_dir() and p.name.startswith("iter-") and (p / META).is_file():
                found.append((_iteration_of(p), 0, p))
    if run_dir.is_dir():
        recover_interrupted(run_dir)
    final = run_dir / FINAL_DIR
    if (final / META).is_file():
        found.append((_iteration_of(final), 1, final))
    return [(it, p) for it, _, p in sorted(found)]


def latest_checkpoint(run_dir: Path | str) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` (see :func:`find_checkpoints`), or None."""
    found = find_checkpoints(run_dir)
    return found[-1][1] if found else None


def saved_config(ckpt: Path | str) -> dict | None:
    """The config a checkpoint was trained with, as a plain dict: its ``meta.json``'s, else the
    run's ``config.yaml`` (beside the checkpoint or one or two levels up); None when neither
    exists. A corrupt ``meta.json`` is a :class:`UserError`."""
    ckpt = Path(ckpt)
    meta = ckpt / META
    if meta.is_file():
        try:
            saved = json.loads(meta.read_text()).get("config")
        except (OSError, ValueError, AttributeError):
            raise UserError(f"checkpoint file {meta} is corrupt or truncated") from None
        if isinstance(saved, dict):
            return saved
    for candidate in (ckpt / CONFIG_FILE, ckpt.parent / CONFIG_FILE, ckpt.parent.parent / CONFIG_FILE):
        if candidate.is_file():
            return read_run_config(candidate)
    return None


class RunDir:
    """A run directory (or one of its checkpoint directories, or a Hugging Face model directory) as
    the commands read it: each thing below is resolved once, on first use, and the object is
    passed down rather than the path resolved again.

    - :attr:`checkpoint`: what is evaluated or sampled (``ppokit eval``, ``generate``, ``chat``):
      ``path`` itself when it is a checkpoint directory, else ``RUN_DIR/checkpoint`` (the end of
      training), else the newest periodic checkpoint (an interrupted or running run); None when
      there is none.
    - :attr:`lm_checkpoint`: the language-model checkpoint (``path`` itself when it holds a
      policy, else :attr:`checkpoint` when it does).
    - :meth:`export_checkpoint`, :meth:`control_checkpoint`, :meth:`resume_checkpoint`: the
      checkpoint ``ppokit export``, a control evaluation and a resume read, with their errors.
    - :attr:`saved`, :meth:`config`: the config a checkpoint was trained with (:func:`saved_config`).
    - :attr:`kind`: the workload kind that reads it (:attr:`ppokit.config.Config.kind`).
    - :attr:`metrics_file`, :meth:`metrics`: ``metrics.jsonl``.
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.is_dir = self.path.is_dir()
        self._saved: dict[Path, dict | None] = {}

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_FILE

    def metrics(self) -> list[dict[str, Any]]:
        """The rows of :attr:`metrics_file` (:func:`read_metrics`)."""
        return read_metrics(self.path)

    @cached_property
    def latest(self) -> Path | None:
        """The newest complete checkpoint (:func:`latest_checkpoint`); None when there is none."""
        return latest_checkpoint(self.path) if self.is_dir else None

    @cached_property
    def checkpoint(self) -> Path | None:
        """The checkpoint a run is evaluated or sampled from (class docstring)."""
        if not self.is_dir:
            return None
        if (self.path / META).is_file():
            return self.path
        if (self.path / FINAL_DIR / META).is_file():
            return self.path / FINAL_DIR
        return self.latest

    @cached_property
    def lm_checkpoint(self) -> Path | None:
        """The language-model checkpoint: ``path`` itself when it holds a policy
        (:data:`POLICY_META_FILE`), else :attr:`checkpoint` when it does; None otherwise (not a
        language-model run, or no checkpoint yet)."""
        if (self.path / POLICY_META_FILE).is_file():
            return self.path
        ckpt = self.checkpoint
        return ckpt if ckpt is not None and (ckpt / POLICY_META_FILE).is_file() else None

    def saved_config(self, ckpt: Path | None = None) -> dict | None:
        """:func:`saved_config` of ``ckpt`` (default :attr:`checkpoint`), read once."""
        ckpt = self.checkpoint if ckpt is None else ckpt
        if ckpt is None:
            return None
        if ckpt not in self._saved:
            self._saved[ckpt] = saved_config(ckpt)
        return self._saved[ckpt]

    @property
    def saved(self) -> dict | None:
        """The config :attr:`checkpoint` was trained with, as a plain dict (None: none found)."""
        return self.saved_config()

    def config(self, ckpt: Path | None = None) -> Any:
        """The :class:`~ppokit.config.Config` ``ckpt`` (default :attr:`checkpoint`) was trained
        with, validated (an invalid one is a one-line :class:`~ppokit.config.ConfigError`)."""
        ckpt = self.checkpoint if ckpt is None else ckpt
        saved = self.saved_config(ckpt)
        if saved is None:
            raise UserError(f"{ckpt}: no config found (neither {Path(ckpt) / META} nor the run's config.yaml)")
        return build_config([saved])

    @cached_property
    def kind(self) -> str:
        """The workload kind that reads this directory: the saved config's (as
        :attr:`ppokit.config.Config.kind`: ``textenv`` for ``workload: lm`` with ``textenv.env``,
        ``lm``, ``control``); ``lm`` for a Hugging Face model directory; else ``control``, whose
        evaluation says what is missing."""
        saved = self.saved or {}
        if saved.get("workload") == "lm":
            return "textenv" if (saved.get("textenv") or {}).get("env") is not None else "lm"
        return "lm" if self.is_dir and (self.path / MODEL_CONFIG_FILE).is_file() else "control"

    def export_checkpoint(self) -> Path:
        """The language-model checkpoint ``ppokit export`` reads: ``path`` itself, else
        ``RUN_DIR/checkpoint``; a run that has not finished, or holds no policy, is a
        :class:`UserError`."""
        p = self.path
        if (p / POLICY_META_FILE).is_file():
            return p
        if (p / FINAL_DIR / POLICY_META_FILE).is_file():
            return p / FINAL_DIR
        newest = self.latest
        if newest is not None and (newest / POLICY_META_FILE).is_file():
            raise UserError(
                f"{p} has no final checkpoint (training has not finished): finish it with "
                f"ppokit train --resume {p}, or export its newest checkpoint, {newest}"
            )
        if (self.saved or {}).get("workload") == "control":
            raise UserError(f"{p} is a control run: export writes a language model's trained actor as a model folder")
        raise UserError(
            f"{p} holds no LM checkpoint (expected {p}/{FINAL_DIR}/{POLICY_META_FILE}); "
            "a run writes it when training finishes"
        )

    def control_checkpoint(self) -> tuple[Path, str | None]:
        """The checkpoint a control run is evaluated from, and a note to print when it is not the
        final one: ``path`` itself when it is a checkpoint directory, else ``RUN_DIR/checkpoint``,
        else (none there) the newest periodic one. A missing directory, a language-model run or
        no checkpoint at all is a :class:`UserError`."""
        run_dir = self.path
        if not self.is_dir:
            raise UserError(f"run directory {run_dir} does not exist")
        ckpt_dir = run_dir if (run_dir / META).is_file() else run_dir / FINAL_DIR
        if ckpt_dir.is_dir() and (self.saved_config(ckpt_dir) or {}).get("workload") == "lm":
            raise UserError(
                f"{run_dir} is a language-model run; `ppokit eval` runs control policies in their "
                "environment (an LM run prints its held-out accuracy; `ppokit export` writes the model)"
            )
        if ckpt_dir.exists() or ckpt_dir == run_dir:
            return ckpt_dir, None
        newest = self.latest
        if newest is None:
            raise UserError(
                f"run directory {run_dir} has no checkpoint (the final one is written when training "
                "finishes, others every run.checkpoint_every iterations and on SIGINT/SIGTERM)"
            )
        return newest, (
            f"note: {run_dir} has not finished training (no {FINAL_DIR}/); evaluating its newest "
            f"checkpoint, {newest} (to finish the run: ppokit train --resume {run_dir})"
        )

    def resume_checkpoint(self, *, required: bool) -> Path | None:
        """The checkpoint to resume from, the newest; None to start fresh (only when not ``required``)."""
        if not self.is_dir:
            if required:
                raise UserError(f"cannot resume: run directory {self.path} does not exist")
            return None
        if self.latest is None and required:
            raise UserError(
                f"cannot resume: run directory {self.path} has no checkpoint (one is written every "
                "run.checkpoint_every iterations, on SIGINT/SIGTERM and at the end); to start it over "
                "in the same directory, run its config with run.resume=auto"
            )
        return self.latest


def checked_iteration(meta: Mapping[str, Any], path: Path | str, iterations: int, run_dir: Path | str) -> int:
    """The checkpoint's count of completed iterations, checked to be sane.

    It must be an integer in ``[0, iterations]`` and, for ``iter-N``, equal ``N``. Anything
    else means the checkpoint is corrupt: a :class:`UserError` naming its ``meta.json``
    and the newest other checkpoint of ``run_dir`` to resume from instead.
    """
    path = Path(path)
    value = meta.get("iteration")
    named = int(path.name[5:]) if path.name.startswith("iter-") and path.name[5:].isdigit() else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= iterations and named in (None, value):
        return value
    expected = f"{named}" if named is not None else f"0..{iterations}"
    raise UserError(
        f"checkpoint {path} is corrupt: {path / META} says iteration {value!r} "
        f"(expected {expected}); {resume_instead(path, run_dir)}"
    )


def resume_instead(path: Path | str, run_dir: Path | str) -> str:
    """What to do about a damaged checkpoint ``path``: resume from the newest other one."""
    path = Path(path)
    others = [p for _, p in find_checkpoints(run_dir) if p != path] if Path(run_dir).is_dir() else []
    return (
        f"move it out of the run directory to resume from {others[-1]}"
        if others
        else "no other checkpoint to resume from: start the run over"
    )


@contextlib.contextmanager
def advising_on_damage(path: Path | str, run_dir: Path | str) -> Iterator[None]:
    """A damaged file of checkpoint ``path`` found inside the block ("checkpoint file ... is
    corrupt or truncated"): its error also says what to do (:func:`resume_instead`)."""
    try:
        yield
    except UserError as exc:
        if not str(exc).startswith("checkpoint file "):
            raise
        raise UserError(f"{exc}; {resume_instead(path, run_dir)}") from None


def prune_checkpoints(run_dir: Path | str, keep: int) -> None:
    """Keep the ``keep`` newest periodic checkpoints."""
    directory = Path(run_dir) / PERIODIC_DIR
    if not directory.is_dir():
        return
    entries = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    for stale in entries[:-keep] if keep > 0 else entries:
        shutil.rmtree(stale, ignore_errors=True)


# ----------------------------------------------------------------------------- logs
def truncate_logs(run_dir: Path | str, iteration: int) -> int:
    """Keep the rows of ``metrics.jsonl`` and ``samples.jsonl`` with ``row["iteration"] < iteration``;
    returns how many metrics rows.

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
PRESENTATION_FIELDS = (
    "preset",
    "run.output_dir",
    "run.name",
    "run.progress",
    "run.tensorboard",
    "run.resume",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.log_samples",
    "run.samples_every",
    # where the run executes: a checkpoint does not depend on the cluster layout
    "cluster.rollout_workers",
    "cluster.learners",
    "cluster.address",
    "cluster.cpus_per_worker",
    "cluster.gpus_per_worker",
    "cluster.placement",
    "cluster.placement_timeout",
    # how memory is spent and checked: the same run either way (checkpointing replays the same forward)
    "run.memory_check",
    "train.gradient_checkpointing",
    "cluster.sharding",
    "cluster.cpu_offload",
    "cluster.sync_bucket_mb",
)


def _leaves(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and k != "kwargs":
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(saved: Mapping[str, Any], given: Mapping[str, Any]) -> str:
    """``"seed (1 in the run, 5 now), ..."``: the fields beyond :data:`PRESENTATION_FIELDS` where
    ``given`` differs from ``saved`` (the first three); ``""`` when there are none."""
    a, b = _leaves(saved), _leaves(given)
    diff = [k for k in sorted(set(a) | set(b)) if k not in PRESENTATION_FIELDS and a.get(k) != b.get(k)]
    shown = ", ".join(f"{k} ({a.get(k)!r} in the run, {b.get(k)!r} now)" for k in diff[:3])
    return shown + (f" and {len(diff) - 3} more" if len(diff) > 3 else "")


def check_resumable_config(
    saved: Mapping[str, Any], given: Mapping[str, Any], where: Path | str, hint: str | None = None
) -> None:
    """Raise :class:`UserError` when ``given`` differs from the run's ``saved`` config beyond
    :data:`PRESENTATION_FIELDS` (resuming with other settings would not be the same run)."""
    diff = config_differences(saved, given)
    if diff:
        hint = hint or f"resume with the run's own config: ppokit train --resume {where}"
        raise UserError(f"cannot resume {where}: the config differs from the run's in {diff}; {hint}")


def fixed_run_dir(cfg: Any) -> Path:
    """``run.output_dir/run.name``, the directory ``ppokit train CONFIG --resume`` resumes; without
    ``run.name`` a :class:`UserError`."""
    if not cfg.run.name:
        raise UserError(
            "--resume needs a fixed run directory: set run.name (or --name), or name the "
            "directory: ppokit train --resume RUN_DIR"
        )
    return Path(cfg.run.output_dir) / cfg.run.name


def check_resume_target(cfg: Any) -> None:
    """``ppokit train CONFIG --resume``: its run directory is named and exists, checked before the
    run's inputs are read (the checkpoint is chosen later, under the run's lock: :func:`prepare_run_dir`)."""
    run = RunDir(fixed_run_dir(cfg))
    if not run.is_dir:
        run.resume_checkpoint(required=True)  # the one line saying it does not exist


def prepare_run_dir(cfg: Any, *, required: bool = False) -> tuple[Path, Path | None]:
    """The run directory of ``cfg``, locked, and the checkpoint to resume from (None: a fresh start).

    ``required`` (``ppokit train CONFIG --resume``): the run directory ``run.output_dir/run.name``
    must hold a checkpoint. Otherwise ``run.resume`` decides: ``never`` creates a new run
    directory (:func:`create_run_dir`); ``auto`` resumes from the newest checkpoint when
    there is one and else starts over in that directory (rows of an attempt that never
    reached a checkpoint are dropped). The lock is taken before anything is changed.
    """
    if not required and cfg.run.resume == "never":
        return create_run_dir(cfg, lock=True), None
    run_dir = fixed_run_dir(cfg)
    if run_dir.is_dir():
        RunLock(run_dir).acquire()
    found = RunDir(run_dir).resume_checkpoint(required=required)
    if found is not None:
        return run_dir, found
    if not has_started(run_dir):
        return create_run_dir(cfg, lock=True), None  # new, or a run that never got to its first iteration
    config_file = run_dir / CONFIG_FILE
    saved = read_run_config(config_file)
    if saved is not None:
        check_resumable_config(saved, cfg.to_dict(), run_dir, hint="choose another run.name or delete the directory")
    truncate_logs(run_dir, 0)
    config_file.write_text(cfg.to_yaml())
    return run_dir, None


def open_run_for_resume(run_dir: Path | str, overrides: list[str]) -> tuple[Any, Path, Path]:
    """``ppokit train --resume RUN_DIR [KEY=VALUE ...]``: (config, run dir, checkpoint), the
    directory locked.

    The config is the run's own, from its newest checkpoint; overrides may change only
    :data:`PRESENTATION_FIELDS` (e.g. ``run.progress=false``).
    """
    run = RunDir(run_dir)
    run_dir, config_file = run.path, run.config_file
    if not run.is_dir or not config_file.is_file():
        raise UserError(
            f"--resume {run_dir}: not a run directory (no config.yaml); to resume the run.name of a "
            "config, write: ppokit train CONFIG --resume"
        )
    RunLock(run_dir).acquire()
    readable = read_run_config(config_file) is not None
    found = run.resume_checkpoint(required=readable)
    if found is None:
        raise UserError(
            f"cannot resume: run directory {run_dir} has no checkpoint, and its {config_file} is "
            "empty or not a ppokit config"
        )
    try:
        saved = json.loads((found / META).read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        raise UserError(f"checkpoint file {found / META} is corrupt or truncated") from None
    if not isinstance(saved, dict):
        saved = read_yaml(config_file)
    elif not readable:
        print(
            f"ppokit: warning: {config_file} is empty or not a ppokit config; using the config saved in {found / META}",
            file=sys.stderr,
            flush=True,
        )
    cfg = build_config([saved, parse_overrides(overrides)])
    check_resumable_config(
        saved,
        cfg.to_dict(),
        run_dir,
        hint=f"with --resume RUN_DIR only these may change: {', '.join(PRESENTATION_FIELDS[3:])}",
    )
    return cfg, run_dir, found
