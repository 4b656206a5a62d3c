"""Run directories and metric tracking, shared by both workloads.

A run directory holds::

    RUN_DIR/
      config.yaml      the resolved configuration (what ``ppokit config show`` prints)
      metrics.jsonl    one JSON object per iteration
      tb/              TensorBoard event files (when tensorboard is installed)
      checkpoint/      the final checkpoint (see ppokit.checkpoint)
      checkpoints/     iter-NNNNNN: periodic (run.checkpoint_every) and SIGINT/SIGTERM checkpoints,
                       the newest run.keep_checkpoints kept (see ppokit.resume)

:class:`Tracker` writes ``metrics.jsonl`` (flushed every line, so a crash loses at most
the iteration in flight), TensorBoard scalars, and draws a live progress bar with the
headline numbers (return or reward, SPS).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Optional

from ppokit.config import Config
from ppokit.errors import UserError

# The progress bar shows the first of these present in an iteration's metrics.
HEADLINE_KEYS = ("return_mean", "reward_mean")
# What a run that never got to its first iteration may hold besides things built from its
# config (an LM run's base_model/, say): with only these it may start over with another config.
NOT_BUILT = ("config.yaml", "metrics.jsonl", "tb")


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` looks like a ppokit run directory (metrics, checkpoints, or ppokit's config.yaml)."""
    path = Path(path)
    if any((path / name).exists() for name in ("metrics.jsonl", "checkpoint", "checkpoints")):
        return True
    saved = read_run_config(path / "config.yaml")
    return saved is not None and "workload" in saved


def has_started(run_dir: Path) -> bool:
    """Whether a run got anywhere: a ``metrics.jsonl`` row or a checkpoint (complete or not)."""
    run_dir = Path(run_dir)
    periodic = run_dir / "checkpoints"
    return bool(read_metrics(run_dir)) or (run_dir / "checkpoint").exists() or \
        (periodic.is_dir() and any(periodic.iterdir()))


def check_reusable(run_dir: Path, cfg: Config) -> None:
    """Refuse an explicit ``run.name`` whose directory holds anything worth keeping.

    A missing or empty directory is fine, and so is a run that never got to its first
    iteration (a failed or interrupted setup: no metrics row, no checkpoint) when its
    config is this one, or it holds nothing built from its config (only :data:`NOT_BUILT`)
    and its ``metrics.jsonl`` shows that ppokit started it (else the config.yaml may be the
    user's own).
    Anything else (another run, files that are not a run) is a :class:`UserError` that
    says how to go on.
    """
    from ppokit.resume import config_differences

    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return
    if not is_run_dir(run_dir):
        raise UserError(f"{run_dir} is not empty and is not a ppokit run directory; choose another run.name "
                        "or delete it")
    if has_started(run_dir):
        rows = len(read_metrics(run_dir))
        if (run_dir / "checkpoint").exists():
            how = "it has finished"
        elif (run_dir / "checkpoints").is_dir():
            how = f"resume it with: ppokit train --resume {run_dir}"
        else:
            how = f"it has no checkpoint: start it over (dropping its {rows} metrics rows) with run.resume=auto"
        raise UserError(f"run directory {run_dir} already holds a run ({rows} iterations logged); {how}; "
                        "or choose another run.name or delete it")
    saved = read_run_config(run_dir / "config.yaml")
    diff = config_differences(saved, cfg.to_dict()) if saved is not None else ""
    built = sorted(p.name for p in run_dir.iterdir() if p.name not in NOT_BUILT)
    started_here = (run_dir / "metrics.jsonl").exists()   # without it the config.yaml may be the user's own
    if diff and (built or not started_here):
        what = (f"holds a run that stopped before its first iteration, with another config ({diff}) and what it "
                f"built ({', '.join(built)})" if started_here else
                f"holds a config.yaml of another config ({diff}) and no run")
        raise UserError(f"run directory {run_dir} {what}; choose another run.name or delete it")


def read_run_config(path: Path) -> Optional[dict]:
    """A run's config.yaml as a dict; None when it is missing, empty or not a mapping."""
    import yaml

    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def create_run_dir(cfg: Config) -> Path:
    """Create a fresh run directory and write the resolved config into it.

    An explicit ``run.name`` whose directory holds a run or other files is refused rather
    than overwritten (:func:`check_reusable`); a run of the same config that never got to
    its first iteration is reused.
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
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        (run_dir / "metrics.jsonl").touch()     # ppokit's mark: a run of this config started here
    except OSError as exc:
        raise UserError(f"cannot create run directory {run_dir}: {exc.strerror or exc}") from None
    return run_dir


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """All iterations of ``RUN_DIR/metrics.jsonl`` (a torn last line is ignored)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class Tracker:
    """Writes each iteration's metrics to JSONL, TensorBoard and a progress bar."""

    def __init__(self, run_dir: Path, cfg: Config, total_iterations: int, *, description: str | None = None,
                 purge_step: Optional[int] = None):
        """``purge_step``: on resume, the first TensorBoard step that the resumed run logs again;
        TensorBoard drops the earlier run's events from that step on (no doubled curves)."""
        self.run_dir = Path(run_dir)
        self.total = total_iterations
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._samples = None             # samples.jsonl, opened with the first samples
        self._tb = None
        if cfg.run.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:   # tensorboard is an optional extra
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=purge_step)
        self._progress = None
        if cfg.run.progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[headline]}"), TimeRemainingColumn(), transient=False)
            self._task = self._progress.add_task(description or cfg.preset or cfg.workload,
                                                 total=total_iterations, headline="")
            self._progress.start()
        self.start_time = time.time()

    def log_samples(self, iteration: int, samples: list[dict[str, Any]]) -> None:
        """Append rollout samples to ``samples.jsonl``, one row each, tagged with ``iteration``."""
        if self._samples is None:
            self._samples = open(self.run_dir / "samples.jsonl", "a", buffering=1)
        for sample in samples:
            self._samples.write(json.dumps({"iteration": iteration, **sample}, default=str) + "\n")

    def log(self, iteration: int, metrics: dict[str, Any]) -> None:
        row = {"iteration": iteration, "time": round(time.time() - self.start_time, 3)}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            step = int(row.get("global_step", iteration))
            for key, value in row.items():
                if isinstance(value, (int, float)) and key not in ("iteration",) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
        if self._progress is not None:
            self._progress.update(self._task, completed=iteration + 1, headline=_headline(row))

    def message(self, text: str) -> None:
        """Print a line above the progress bar (or plainly without one)."""
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if not self._jsonl.closed:
            self._jsonl.close()
        if self._samples is not None and not self._samples.closed:
            self._samples.close()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _plain(value: Any) -> Any:
    """Tensors and numpy scalars to Python numbers; non-finite floats stay JSON-readable."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)   # "nan" / "inf": json.dumps would write invalid JSON otherwise
    return value


def _headline(row: dict[str, Any]) -> str:
    parts = []
    for key in HEADLINE_KEYS:
        if isinstance(row.get(key), (int, float)):
            parts.append(f"{key.split('_')[0]} {row[key]:.3g}")
            break
    if isinstance(row.get("sps"), (int, float)):
        parts.append(f"{row['sps']:,.0f} steps/s")
    return "  ".join(parts)
