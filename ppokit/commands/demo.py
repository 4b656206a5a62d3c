"""``ppokit demo [NAME]``: RL on a CPU in a few minutes, on a built-in preset.

``ppokit demo`` (the ``arith`` preset), RL from a verifiable reward:

1. build the built-in tiny Llama (~0.8 M parameters) and its character tokenizer;
2. supervised warm start on a few hundred worked two-digit additions until the held-out
   exact-match accuracy stops improving (it memorises them: a low plateau);
3. PPO (LoRA actor + LoRA critic + value head on one backbone, reference = adapters
   off) on fresh prompts that carry only the verifier, exact-match reward;
4. print the held-out accuracy before and after PPO and draw the curves into
   ``RUN_DIR/reward_curve.png``, and the training curves of ``ppokit plot`` into
   ``RUN_DIR/curves.png``.

The last line printed is ``held-out accuracy: X% -> Y%`` (X: the SFT plateau, Y: after PPO).

``ppokit demo tictactoe`` (any preset with a text environment: ``frozenlake`` too),
multi-turn PPO (:mod:`ppokit.lm.multi_turn.source`):

1. build the tiny Llama; warm start on demonstration turns played in the environment
   (tic-tac-toe: random legal moves, so that the model knows the board format and the
   legal moves, and nothing of strategy);
2. multi-turn PPO against the environment's opponent (tic-tac-toe: the random player);
3. print the illegal-move rate (greedy, before and after; sampled, in the last
   iterations), draw the curves into ``RUN_DIR/reward_curve.png`` and end with
   ``win rate vs random: X% -> Y%`` (greedy, on the evaluation's fixed games; a
   single-player environment: ``success: X% -> Y%``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ppokit.commands.arguments import add_command
from ppokit.errors import UserError

DEMO_PRESET = "arith"
PLOT_FILE = "reward_curve.png"
# PPO iterations of a demo where the run computes in float32 on a CPU (one without native
# bf16: AVX512-BF16 or AMX): an iteration takes about three times as long there, and a cosine
# schedule over half the preset's iterations reaches the same accuracy in half the time
# (docs/performance.md, "The demo on a CPU without native bf16")
FP32_CPU_ITERATIONS = {"arith": 200}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "demo",
        run,
        help="a built-in demonstration run (arith: SFT, then PPO with a verifier; "
        "tictactoe: multi-turn PPO against a random player)",
        description="Build the built-in tiny Llama, warm-start it, then train it with PPO. "
        "ppokit demo (arith): worked two-digit additions, then an exact-match "
        "reward; prints the held-out accuracy before and after PPO. ppokit demo "
        "tictactoe: random legal games, then multi-turn PPO against a random "
        "player; prints the illegal-move rate and the win rate before and after. "
        "Both draw the reward curve. KEY=VALUE pairs override fields of the preset.",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],
        metavar="[NAME] KEY=VALUE",
        help="the demo (arith, tictactoe, frozenlake; default arith), then overrides, e.g. "
        "train.iterations=5 seed=2 run.output_dir=/tmp/runs run.progress=false",
    )


def run(args: argparse.Namespace) -> int:
    """A demo preset (arith by default: SFT warm start, then PPO); ends with ``held-out accuracy: X% -> Y%``
    (arith) or ``win rate vs random: X% -> Y%`` (tictactoe)."""
    name, overrides = DEMO_PRESET, list(args.overrides)
    if overrides and "=" not in overrides[0]:
        name, overrides = overrides[0], overrides[1:]
    run_demo(overrides, name=name)
    return 0


def fit_iterations(cfg, name: str, overrides: Sequence[str]):
    """The demo's config with its PPO iterations for the precision the run computes in here
    (:data:`FP32_CPU_ITERATIONS`), and the line that says so; ``(cfg, None)`` where the preset's
    count stands (bf16, a GPU, another preset, or ``train.iterations`` given)."""
    from ppokit.config import load_config, parse_overrides
    from ppokit.lm.model.device import resolve_precision, run_device

    train = parse_overrides(list(overrides)).get("train")
    if name not in FP32_CPU_ITERATIONS or (isinstance(train, dict) and "iterations" in train):
        return cfg, None
    device = run_device(cfg)
    if device.type != "cpu" or resolve_precision(cfg.run.precision, device) is not None:
        return cfg, None
    count = FP32_CPU_ITERATIONS[name]
    line = (
        f"PPO iterations: {count} (float32: this CPU has no native bf16; the preset's {cfg.train.iterations} "
        "are for CPUs with it; train.iterations=N sets them)"
    )
    return load_config(name, [*overrides, f"train.iterations={count}"]), line


def summary_line(before: float, after: float) -> str:
    """``held-out accuracy: 12.5% -> 81.6%``."""
    return f"held-out accuracy: {before:.1%} -> {after:.1%}"


def plot_curves(
    run_dir: Path | str, eval_history: Sequence[dict[str, float]] = (), out: Path | str | None = None
) -> Path:
    """Reward mean per PPO iteration (+ held-out accuracy points), and the SFT curve when there is one.

    Reads ``RUN_DIR/metrics.jsonl`` and ``RUN_DIR/base_model/sft_curve.json``; writes a PNG
    (matplotlib, Agg backend) to ``out`` (default ``RUN_DIR/reward_curve.png``).
    """
    fig, ax, rows = _figure(run_dir, "reward_mean", "held-out accuracy")
    if rows:
        its = [r["iteration"] + 1 for r in rows]
        rewards = [100 * r["reward_mean"] for r in rows]
        ax.plot(its, rewards, color="tab:blue", alpha=0.35, lw=1, label="reward mean (samples)")
        window = max(1, len(rows) // 20)
        if window > 1:
            smooth = [
                sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
                for i in range(len(rewards))
            ]
            ax.plot(its, smooth, color="tab:blue", lw=2, label=f"reward mean ({window}-iteration average)")
    if eval_history:
        accuracy = [next(v for k, v in e.items() if k.startswith("eval_accuracy")) for e in eval_history]
        ax.plot(
            [e["iteration"] for e in eval_history],
            [100 * a for a in accuracy],
            "s-",
            color="tab:red",
            ms=5,
            label="held-out accuracy (greedy)",
        )
    _percent_axes(ax, "PPO iteration", "% correct", "PPO with a verifier (exact match)")
    return _save(fig, Path(out) if out is not None else Path(run_dir) / PLOT_FILE)


def _figure(run_dir: Path | str, metric: str, sft_label: str):
    """A figure for a demo run: the warm start's held-out curve on the left when the run has
    one (``base_model/sft_curve.json``), and the PPO panel; returns (figure, PPO axes, the
    rows of ``metrics.jsonl`` that have ``metric``)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from ppokit.lm.base_model import BASE_MODEL_DIR
    from ppokit.lm.sft import CURVE_FILE
    from ppokit.persistence.rundir import read_metrics

    run_dir = Path(run_dir)
    rows = [r for r in read_metrics(run_dir) if isinstance(r.get(metric), (int, float))]
    curve_path = run_dir / BASE_MODEL_DIR / CURVE_FILE
    sft = json.loads(curve_path.read_text()).get("curve", []) if curve_path.exists() else []
    fig, axes = plt.subplots(1, 2 if sft else 1, figsize=(11 if sft else 6.5, 4), squeeze=False)
    axes = axes[0]
    if sft:
        axes[0].plot(
            [r["epoch"] for r in sft],
            [100 * r["heldout_accuracy"] for r in sft],
            "o-",
            ms=3,
            color="tab:gray",
            label=sft_label,
        )
        _percent_axes(axes[0], "SFT epoch", "%", "supervised warm start")
    return fig, axes[-1], rows


def _save(fig, out: Path) -> Path:
    """Write ``fig`` as a PNG to ``out`` and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _percent_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Labels, a 0-100 y range, a light grid and the legend of one percentage panel."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")  # accuracy rises: the lower right stays empty


def eval_curve_line(history: Sequence[dict[str, Any]], label: str, is_score: Callable[[str], bool]) -> str | None:
    """``held-out accuracy (greedy) by PPO iteration: 0: 28.9%, 20: 41.0%, ...``: each evaluation
    of the run (before, periodic, final; one point per iteration) by its score, the value of the
    first key of the history row that ``is_score``. None when no evaluation has one."""
    points: dict[int, float] = {}
    for row in history:
        score = next((v for k, v in row.items() if is_score(k)), None)
        if isinstance(score, (int, float)):
            points.setdefault(int(row["iteration"]), float(score))
    if not points:
        return None
    return f"{label} by PPO iteration: " + ", ".join(f"{it}: {score:.1%}" for it, score in sorted(points.items()))


def textenv_summary(result: dict[str, Any], opponents: Sequence[str]) -> tuple[str, list[str]]:
    """The last line (``win rate vs random: X% -> Y%``, or ``success: X% -> Y%`` without an
    opponent) and the lines before it (illegal moves, the other opponents) of a text-environment
    demo's result."""
    first = opponents[0] if opponents else None
    where = lambda phase: f"eval_{phase}" + (f"/{first}" if first else "")
    lines = []
    before, after = result[where("before") + "/win_rate"], result[where("after") + "/win_rate"]
    lines.append(
        f"illegal moves (greedy{', vs ' + first if first else ''}): "
        f"{result[where('before') + '/illegal_action_rate']:.2%} -> "
        f"{result[where('after') + '/illegal_action_rate']:.2%}"
    )
    if "env/illegal_action_rate" in result:
        lines.append(f"illegal moves while training (sampled, last iteration): {result['env/illegal_action_rate']:.2%}")
    for other in opponents[1:]:
        lines.append(
            f"win rate vs {other}: {result[f'eval_before/{other}/win_rate']:.1%} -> "
            f"{result[f'eval_after/{other}/win_rate']:.1%} (draws {result[f'eval_after/{other}/draw_rate']:.1%})"
        )
    label = f"win rate vs {first}" if first else "success"
    return f"{label}: {before:.1%} -> {after:.1%}", lines


def plot_textenv_curves(
    run_dir: Path | str, eval_history: Sequence[dict[str, float]] = (), out: Path | str | None = None
) -> Path:
    """A text-environment run: the sampled win rate and illegal-action rate per PPO iteration, the
    greedy evaluations as markers, and the warm start's held-out score. Writes a PNG (default
    ``RUN_DIR/reward_curve.png``)."""
    fig, ax, rows = _figure(run_dir, "env/win_rate", "held-out score")
    if rows:
        its = [r["iteration"] + 1 for r in rows]
        ax.plot(its, [100 * r["env/win_rate"] for r in rows], color="tab:blue", lw=1.5, label="win rate (sampled)")
        ax.plot(
            its,
            [100 * r["env/illegal_action_rate"] for r in rows],
            color="tab:orange",
            lw=1,
            label="illegal actions (sampled)",
        )
    markers = {}
    for e in eval_history:
        for key, value in e.items():
            if key.startswith("eval") and key.endswith("/win_rate"):
                opponent = key.split("/")[1] if key.count("/") == 2 else "success"
                markers.setdefault(opponent, []).append((e["iteration"], 100 * value))
    for (opponent, points), style in zip(sorted(markers.items()), ("s-", "^-", "o-", "d-")):
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            style,
            ms=5,
            label=f"greedy win rate vs {opponent}" if opponent != "success" else "greedy success",
        )
    _percent_axes(ax, "PPO iteration", "%", "multi-turn PPO")
    return _save(fig, Path(out) if out is not None else Path(run_dir) / PLOT_FILE)


def _check_lm(cfg) -> None:
    if cfg.data.eval_size == 0:
        raise UserError("the demo reports held-out accuracy; data.eval_size must be > 0")


def _check_textenv(cfg) -> None:
    if not cfg.textenv.eval_episodes:
        raise UserError("the demo reports win rates; textenv.eval_episodes must be > 0")


def _lm_report(cfg, result: dict[str, Any]) -> tuple[str, list[str], str | None]:
    """The last line, the lines before it and the evaluation curve's line of an LM demo."""
    curve = eval_curve_line(  # eval_accuracy_before, eval_accuracy, eval_accuracy_after
        result.get("eval_history", ()), "held-out accuracy (greedy)", lambda k: k.startswith("eval_accuracy")
    )
    return summary_line(result["eval_accuracy_before"], result["eval_accuracy_after"]), [], curve


def _textenv_report(cfg, result: dict[str, Any]) -> tuple[str, list[str], str | None]:
    """The same of a text-environment demo: eval_before/random/win_rate, eval/random/win_rate, ...
    (eval_before/win_rate alone without an opponent)."""
    summary, lines = textenv_summary(result, cfg.textenv.eval_opponents)
    first = cfg.textenv.eval_opponents[0] if cfg.textenv.eval_opponents else None
    tail = f"/{first}/win_rate" if first else "/win_rate"
    label = f"greedy win rate vs {first}" if first else "greedy success"
    curve = eval_curve_line(result.get("eval_history", ()), label, lambda k: k.startswith("eval") and k.endswith(tail))
    return summary, lines, curve


# workload kind (Config.kind) -> its demo: the check of the config, the reward curve, the report
# (last line, lines before it, evaluation curve line); a kind without one has no demo
DEMOS = {
    "lm": (_check_lm, plot_curves, _lm_report),
    "textenv": (_check_textenv, plot_textenv_curves, _textenv_report),
}


def run_demo(overrides: Sequence[str] = (), echo=print, name: str = DEMO_PRESET) -> dict[str, Any]:
    """Train the preset ``name`` (``arith`` by default) with ``overrides``; print the summary;
    return the result.

    The result is :func:`ppokit.workloads.train`'s, plus ``run_dir``, ``plot``,
    ``wall_time_s`` and ``summary`` (the last line printed).
    """
    from ppokit.config import load_config, preset_names
    from ppokit.errors import did_you_mean
    from ppokit.persistence.rundir import create_run_dir, release_locks
    from ppokit.workloads import check_inputs, train

    started = time.perf_counter()
    if name not in preset_names():
        raise UserError(
            f"unknown demo '{name}'{did_you_mean(name, preset_names()) or ';'} demos: arith (the "
            "default), tictactoe, frozenlake"
        )
    cfg = load_config(name, list(overrides))
    if cfg.kind not in DEMOS:
        raise UserError(f"the demo runs the language-model workload (got workload={cfg.workload})")
    check, plot_reward_curve, report = DEMOS[cfg.kind]
    check(cfg)
    cfg, fitted = fit_iterations(cfg, name, overrides)
    workload = check_inputs(cfg)  # as ppokit train does: data, model, memory, before a run directory exists
    run_dir = create_run_dir(cfg, lock=True)
    echo(f"run directory: {run_dir}")
    if fitted:
        echo(fitted)
    try:
        result = train(cfg, run_dir, workload=workload)
    finally:
        release_locks()
    plot = plot_reward_curve(run_dir, result.get("eval_history", ()))
    echo(f"reward curve: {plot}")
    try:  # the training curves of `ppokit plot` as well; a drawing failure must not lose the run
        from ppokit.monitoring.plot import plot_runs

        result["curves"] = plot_runs([run_dir])["out"]
        echo(f"curves: {result['curves']}")
    except Exception as exc:  # noqa: BLE001
        echo(f"warning: could not draw {run_dir}/curves.png ({str(exc).splitlines()[0] if str(exc) else exc!r})")
    result["run_dir"] = str(run_dir)
    result["plot"] = str(plot)
    result["wall_time_s"] = time.perf_counter() - started
    result["summary"], lines, curve = report(cfg, result)
    echo(f"wall time: {result['wall_time_s']:.0f} s")
    if curve:
        echo(curve)
    if result.get("stop_reason"):
        echo(f"stopped after {result['iterations']} of {cfg.iterations} PPO iterations: {result['stop_reason']}")
    for line in lines:
        echo(line)
    echo(result["summary"])
    return result
