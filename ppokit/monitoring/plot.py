"""``ppokit plot``: training curves of one or more run directories in one PNG.

Reads ``RUN_DIR/metrics.jsonl`` of each run and draws a grid of panels, one per
quantity, with every run overlaid (the legend names the run directories):

======================  ==========================================================
panel                   metrics (whichever a run logged)
======================  ==========================================================
return / reward         ``return_mean`` (+ ``eval_return_mean`` markers; control),
                        ``reward_mean`` (+ ``eval_accuracy`` markers; lm)
KL                      ``approx_kl`` (policy update), ``kl_ref`` (to the reference),
                        ``kl_loss`` (the loss term)
entropy                 ``entropy``
value loss              ``value_loss``
clip fraction           ``clipfrac``
explained variance      ``explained_variance``
======================  ==========================================================

The x axis is ``global_step`` (environment steps) where a run logs it (control), else
the PPO iteration (language models). A panel that no run has data for says "no data".

Default output: ``RUN_DIR/curves.png`` for one run, ``./curves.png`` for several.
matplotlib is imported only when a plot is drawn (``ppokit --help`` stays fast).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ppokit.errors import UserError
from ppokit.persistence.rundir import CURVES_FILE as PLOT_FILE
from ppokit.persistence.rundir import METRICS_FILE, read_metrics

# (panel title, y label, ((metric key, legend name, line style: "-", "--", ":" or "s" for markers), ...))
PANELS: tuple[tuple[str, str, tuple[tuple[str, str, str], ...]], ...] = (
    (
        "return / reward",
        "mean per iteration",
        (
            ("return_mean", "return", "-"),
            ("periodic_eval_return_mean", "eval return", "s"),
            ("eval_return_mean", "final eval return", "s"),
            ("reward_mean", "reward", "-"),
            ("eval_accuracy", "eval accuracy", "s"),
            ("eval_accuracy_after", "final eval accuracy", "s"),
        ),
    ),
    ("KL", "nats", (("approx_kl", "approx_kl", "-"), ("kl_ref", "kl to reference", "--"), ("kl_loss", "kl loss", ":"))),
    ("entropy", "nats", (("entropy", "entropy", "-"),)),
    ("value loss", "loss", (("value_loss", "value loss", "-"),)),
    ("clip fraction", "fraction of samples", (("clipfrac", "clipfrac", "-"),)),
    ("explained variance", "1 - Var[R - V] / Var[R]", (("explained_variance", "explained variance", "-"),)),
)


def read_run_metrics(run_dir: Path | str) -> list[dict[str, Any]]:
    """The rows of ``RUN_DIR/metrics.jsonl``; a missing, empty or corrupt file is a UserError.

    Unlike :func:`ppokit.persistence.rundir.read_metrics` (which a training run uses and which skips
    anything unreadable), a line that is not a JSON object names the file and the line.
    Only a torn last line (no newline at the end: a run killed mid-write) is skipped.
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise UserError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a run directory (give the directory that holds {METRICS_FILE})")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: {run_dir} is not a run directory, or its run logged no iteration yet")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is corrupt: not UTF-8 text (byte {exc.start + 1})") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        torn = number == len(lines) and not text.endswith("\n")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if torn:
                continue
            raise UserError(
                f"{path} line {number} is corrupt: not valid JSON ({exc.msg} at column {exc.colno}); "
                "each line must be one JSON object written by a run"
            ) from None
        if not isinstance(row, dict):
            raise UserError(f"{path} line {number} is corrupt: expected a JSON object, got a {type(row).__name__}")
    rows = read_metrics(run_dir)
    if not rows:
        raise UserError(f"{path} is empty: the run logged no iteration")
    return rows


def _number(value: Any) -> float | None:
    """A float for plotting; the "nan"/"inf" strings the tracker writes become floats."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def _x_key(rows: list[dict[str, Any]]) -> str:
    return "global_step" if any(_number(r.get("global_step")) is not None for r in rows) else "iteration"


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    """Run directory names; parent/name where two runs share a name."""
    names = [p.resolve().name or str(p) for p in run_dirs]
    out = []
    for p, name in zip(run_dirs, names):
        if names.count(name) > 1:
            name = f"{p.resolve().parent.name}/{name}"
        out.append(name)
    return out


def series_of(rows: list[dict[str, Any]], key: str, x_key: str) -> tuple[list[float], list[float]]:
    """(x, y) of metric ``key`` over the rows that have it (non-finite values dropped)."""
    xs, ys = [], []
    for row in rows:
        y, x = _number(row.get(key)), _number(row.get(x_key))
        if y is None or x is None or not math.isfinite(y):
            continue
        xs.append(x + 1 if x_key == "iteration" else x)
        ys.append(y)
    return xs, ys


def plot_runs(run_dirs: Sequence[Path | str], out: Path | str | None = None) -> dict[str, Any]:
    """Draw the curves of ``run_dirs`` into one PNG; returns what was drawn.

    The summary: ``out`` (the PNG path), ``labels`` (one per run), ``x`` (run label ->
    x-axis metric) and ``panels`` (panel title -> list of ``"label: series"`` drawn;
    empty for a "no data" panel).
    """
    if not run_dirs:
        raise UserError("give at least one run directory")
    dirs = [Path(d) for d in run_dirs]
    data = [read_run_metrics(d) for d in dirs]  # all errors before anything is drawn
    labels = _labels(dirs)
    if out is None:
        out = dirs[0] / PLOT_FILE if len(dirs) == 1 else Path(PLOT_FILE)
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise UserError(f"--out {out}: the plot is a PNG; give a file name ending in .png")
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name ending in .png")

    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    x_keys = {label: _x_key(rows) for label, rows in zip(labels, data)}
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    ncols = 3
    nrows = -(-len(PANELS) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)
    summary: dict[str, Any] = {"out": str(out), "labels": labels, "x": x_keys, "panels": {}}
    for index, (title, ylabel, metrics) in enumerate(PANELS):
        ax = axes[index // ncols][index % ncols]
        drawn = []
        for run_index, (label, rows) in enumerate(zip(labels, data)):
            color = colors[run_index % len(colors)]
            present = [(key, name, style, *series_of(rows, key, x_keys[label])) for key, name, style in metrics]
            present = [p for p in present if p[3]]
            for key, name, style, xs, ys in present:
                if len(dirs) == 1:
                    legend = name
                else:
                    legend = f"{label}: {name}" if len(present) > 1 else label
                if style == "s":
                    ax.plot(xs, ys, "s", color=color, ms=6, mec="black", mew=0.8, zorder=3, label=legend)
                else:
                    ax.plot(xs, ys, style, color=color, lw=1.4, label=legend)
                drawn.append(f"{label}: {key}")
        ax.set_title(title)
        ax.set_xlabel(" / ".join(sorted(set(x_keys.values()))))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        summary["panels"][title] = drawn
    for index in range(len(PANELS), nrows * ncols):
        axes[index // ncols][index % ncols].axis("off")
    fig.suptitle(", ".join(labels) if len(labels) <= 4 else f"{len(labels)} runs", fontsize=10)
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=90)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return summary
