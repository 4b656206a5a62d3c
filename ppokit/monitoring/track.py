"""Metric tracking, shared by both workloads: ``metrics.jsonl``, TensorBoard, wandb and a progress bar.

:class:`Tracker` writes each iteration's metrics to ``RUN_DIR/metrics.jsonl`` (flushed
every line, so a crash loses at most the iteration in flight), rollout samples to
``samples.jsonl``, TensorBoard scalars to ``tb/``, and draws a live progress bar with
the headline numbers (return or reward, SPS). The layout of the run directory is
:mod:`ppokit.persistence.rundir`'s.

With ``run.wandb`` the same scalars go to Weights & Biases as well (project
``run.wandb_project``, entity ``run.wandb_entity``, the run directory's name as the
run's name). wandb is optional: :func:`check_wandb` says in one line, before a run
directory exists, when it is not installed or not logged in (no API key in
``WANDB_API_KEY`` or ``~/.netrc``), unless ``WANDB_MODE`` is ``offline`` or
``disabled``, which wandb itself then honours. The wandb run id is kept in
``RUN_DIR/wandb_id``, so a resumed run continues the same wandb run.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ppokit.config import Config
from ppokit.errors import UserError
from ppokit.persistence.rundir import METRICS_FILE, SAMPLES_FILE, TB_DIR, read_metrics

__all__ = ["Tracker", "read_metrics"]

# The progress bar shows the first of these present in an iteration's metrics.
HEADLINE_KEYS = ("return_mean", "reward_mean")
WANDB_ID_FILE = "wandb_id"
WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")


def check_wandb(cfg: Config):
    """The wandb module when ``run.wandb`` is on (None when off); a one-line UserError when it
    is not installed, or is neither logged in nor in an offline mode."""
    if not cfg.run.wandb:
        return None
    try:
        import wandb
    except ImportError:
        raise UserError(
            "run.wandb=true needs the wandb package: pip install wandb (or pip install "
            "'ppokit[wandb]'); or set run.wandb=false"
        ) from None
    if os.environ.get("WANDB_MODE", "").lower() not in WANDB_LOCAL_MODES and not _wandb_logged_in():
        raise UserError(
            "run.wandb=true but wandb is not logged in: run `wandb login` or set WANDB_API_KEY; or "
            "set WANDB_MODE=offline to log locally (wandb sync uploads it later)"
        )
    return wandb


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        with open(netrc) as f:
            return "api.wandb.ai" in f.read()
    except OSError:
        return False


def start_wandb(run_dir: Path, cfg: Config):
    """A wandb run for ``run_dir`` (the same one again on resume: ``RUN_DIR/wandb_id``)."""
    wandb = check_wandb(cfg)
    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else ""
    if not run_id:
        run_id = secrets.token_hex(8)
        id_file.write_text(run_id + "\n")
    return wandb.init(
        project=cfg.run.wandb_project,
        entity=cfg.run.wandb_entity,
        name=run_dir.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        config=cfg.to_dict(),
    )


class Tracker:
    """Writes each iteration's metrics to JSONL, TensorBoard and a progress bar."""

    def __init__(
        self,
        run_dir: Path,
        cfg: Config,
        total_iterations: int,
        *,
        description: str | None = None,
        purge_step: int | None = None,
    ):
        """``purge_step``: on resume, the first TensorBoard step that the resumed run logs again;
        TensorBoard drops the earlier run's events from that step on (no doubled curves)."""
        self.run_dir = Path(run_dir)
        self.total = total_iterations
        self._jsonl = open(self.run_dir / METRICS_FILE, "a", buffering=1)  # noqa: SIM115 (open for the run)
        self._samples = None  # samples.jsonl, opened with the first samples
        self._tb = None
        if cfg.run.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is an optional extra
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(str(self.run_dir / TB_DIR), purge_step=purge_step)
        self._wandb = start_wandb(self.run_dir, cfg) if cfg.run.wandb else None
        self._progress = None
        if cfg.run.progress:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[headline]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._task = self._progress.add_task(
                description or cfg.preset or cfg.workload, total=total_iterations, headline=""
            )
            self._progress.start()
        self.start_time = time.time()

    def log_samples(self, iteration: int, samples: list[dict[str, Any]]) -> None:
        """Append rollout samples to ``samples.jsonl``, one row each, tagged with ``iteration``."""
        if self._samples is None:
            self._samples = open(self.run_dir / SAMPLES_FILE, "a", buffering=1)  # noqa: SIM115
        for sample in samples:
            self._samples.write(json.dumps({"iteration": iteration, **sample}, default=str) + "\n")

    def log(self, iteration: int, metrics: dict[str, Any]) -> None:
        row = {"iteration": iteration, "time": round(time.time() - self.start_time, 3)}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(row) + "\n")
        step = int(row.get("global_step", iteration))
        scalars = {
            key: value
            for key, value in row.items()
            if isinstance(value, (int, float)) and key != "iteration" and math.isfinite(value)
        }
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
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
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if not self._jsonl.closed:
            self._jsonl.close()
        if self._samples is not None and not self._samples.closed:
            self._samples.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _plain(value: Any) -> Any:
    """Tensors and numpy scalars to Python numbers; non-finite floats stay JSON-readable."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan" / "inf": json.dumps would write invalid JSON otherwise
    return value


def _headline(row: dict[str, Any]) -> str:
    parts = []
    for key in HEADLINE_KEYS:
        if isinstance(row.get(key), (int, float)):
            parts.append(f"{key.split('_')[0]} {row[key]:.3g}")
            break
    if isinstance(row.get("sps"), (int, float)):
        parts.append(f"{row['sps']:,.0f} steps/s")
    if isinstance(row.get("memory/peak_gb"), (int, float)):  # the iteration's largest phase
        parts.append(f"peak {row['memory/peak_gb']:.2f} GB")
    return "  ".join(parts)
