"""`ppokit demo` end to end with tiny overrides: exit status, summary line, reward-curve PNG."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

from ppokit.cli import main
from ppokit.persistence.rundir import read_metrics

# A few seconds: a handful of SFT examples and epochs, two PPO iterations of 16 sequences.
TINY_DEMO = [
    "data.sft_examples=32",
    "data.sft_epochs=2",
    "data.eval_size=16",
    "train.iterations=2",
    "train.batch_size=16",
    "train.mini_batch_size=16",
    "train.micro_batch_size=16",
    "train.infer_micro_batch_size=16",
    "algo.group_size=4",
    "data.eval_every=1",
    "run.progress=false",
    "run.tensorboard=false",
]
SUMMARY = re.compile(r"^held-out accuracy: (\d+\.\d)% -> (\d+\.\d)%$")


def test_demo_cli_prints_summary_and_writes_png(tmp_path, capsys):
    status = main(["demo", *TINY_DEMO, f"run.output_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert status == 0
    lines = [line for line in out.splitlines() if line.strip()]
    assert SUMMARY.match(lines[-1]), lines[-1]  # the last line
    assert sum(bool(SUMMARY.match(line)) for line in lines) == 1  # exactly one summary
    before, after = (float(x) for x in SUMMARY.match(lines[-1]).groups())

    run_dirs = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(run_dirs) == 1
    # the line reports the accuracies the run measured (its checkpoint's summary)
    summary = json.loads((run_dirs[0] / "checkpoint" / "meta.json").read_text())["summary"]
    assert (before, after) == (
        round(100 * summary["eval_accuracy_before"], 1),
        round(100 * summary["eval_accuracy_after"], 1),
    )
    png = run_dirs[0] / "reward_curve.png"
    assert png.is_file()
    assert f"reward curve: {png}" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and data.rstrip()[-8:-4] == b"IEND"
    assert (run_dirs[0] / "metrics.jsonl").is_file()
    curves = run_dirs[0] / "curves.png"  # the `ppokit plot` panels too
    assert f"curves: {curves}" in out and curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def script_heldout_accuracy(monkeypatch, accuracies):
    """A fake held-out evaluation: each call scores the next of ``accuracies`` (fractions of
    the 16 prompts), so that the stopping rule is tested on a known curve in seconds.
    (The evaluator calls ``heldout_results`` from the module it is defined in.)"""
    from ppokit.lm.single_turn.evaluator import LMEvaluator

    scripted = iter(accuracies)

    def fake(engine, items, reward, greedy=True, **kwargs):
        if not greedy:  # the sampled check before PPO: not part of the scripted curve
            return None, SimpleNamespace(scores=[0.0] * len(items), num_errors=0)
        right = round(next(scripted) * len(items))
        return None, SimpleNamespace(scores=[1.0] * right + [0.0] * (len(items) - right), num_errors=0)

    monkeypatch.setattr(sys.modules[LMEvaluator.__module__], "heldout_results", fake)


def test_demo_stops_once_the_heldout_accuracy_reaches_the_target(tmp_path, capsys, monkeypatch):
    # before PPO 25%, then 37.5% after iteration 1, 81.25% after 2 (>= 0.8: stop), never 3-6
    script_heldout_accuracy(monkeypatch, [0.25, 0.375, 0.8125, 0.8125])
    overrides = [*TINY_DEMO, "train.iterations=6", "data.stop_at_accuracy=0.8", f"run.output_dir={tmp_path}"]
    assert main(["demo", *overrides]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(read_metrics(run_dir)) == 2  # two iterations trained, then the stop
    reason = "held-out accuracy 81.2% >= data.stop_at_accuracy=0.8"
    assert f"{reason}: stopping after iteration 1" in lines
    assert "held-out accuracy (greedy) by PPO iteration: 0: 25.0%, 1: 37.5%, 2: 81.2%" in lines
    assert f"stopped after 2 of 6 PPO iterations: {reason}" in lines
    assert lines[-1] == "held-out accuracy: 25.0% -> 81.2%"
    meta = json.loads((run_dir / "checkpoint" / "meta.json").read_text())
    assert meta["finished"] and meta["iteration"] == 2 and meta["summary"]["stop_reason"] == reason


def test_demo_stops_once_the_heldout_accuracy_stops_growing(tmp_path, capsys, monkeypatch):
    # the best, 50%, after iteration 2; iterations 3 and 4 do not beat it: patience 2 stops there
    script_heldout_accuracy(monkeypatch, [0.25, 0.375, 0.5, 0.5, 0.4375, 0.4375])
    overrides = [*TINY_DEMO, "train.iterations=8", "train.eval_patience=2", f"run.output_dir={tmp_path}"]
    assert main(["demo", *overrides]) == 0
    out = capsys.readouterr().out
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(read_metrics(run_dir)) == 4
    reason = "held-out accuracy has not improved on its best (50.0%) in 2 evaluations (train.eval_patience=2)"
    assert f"stopped after 4 of 8 PPO iterations: {reason}" in out
    assert out.rstrip().endswith("held-out accuracy: 25.0% -> 43.8%")


def test_demo_rejects_a_bad_override(tmp_path, capsys):
    assert main(["demo", "train.iterations=0", f"run.output_dir={tmp_path}"]) == 2
    assert "train.iterations" in capsys.readouterr().err


def test_demo_refuses_a_run_that_cannot_fit_before_it_starts(tmp_path, capsys):
    assert main(["demo", "train.batch_size=100000000", f"run.output_dir={tmp_path}"]) == 2
    assert "not enough memory" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no run directory


def test_plot_curves_without_metrics(tmp_path):
    from ppokit.commands.demo import plot_curves, summary_line

    png = plot_curves(tmp_path, [{"iteration": 0, "eval_accuracy_before": 0.1}], out=Path(tmp_path) / "x.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary_line(0.125, 0.8164) == "held-out accuracy: 12.5% -> 81.6%"


# The tic-tac-toe demo in a few seconds: a tiny warm start, two PPO iterations of 8 games.
TINY_TTT = [
    "data.sft_examples=64",
    "data.sft_epochs=1",
    "train.iterations=2",
    "train.batch_size=8",
    "train.mini_batch_size=8",
    "train.micro_batch_size=64",
    "train.infer_micro_batch_size=64",
    "textenv.eval_episodes=16",
    "textenv.eval_every=0",
    "run.progress=false",
    "run.tensorboard=false",
]
WIN = re.compile(r"^win rate vs random: (\d+\.\d)% -> (\d+\.\d)%$")


def test_tictactoe_demo_prints_illegal_moves_and_ends_with_the_win_rates(tmp_path, capsys):
    status = main(["demo", "tictactoe", *TINY_TTT, f"run.output_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert status == 0
    lines = [line for line in out.splitlines() if line.strip()]
    assert WIN.match(lines[-1]), lines[-1]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "checkpoint" / "meta.json").read_text())["summary"]
    before, after = (float(x) for x in WIN.match(lines[-1]).groups())
    assert (before, after) == (
        round(100 * summary["eval_before/random/win_rate"], 1),
        round(100 * summary["eval_after/random/win_rate"], 1),
    )
    illegal = [line for line in lines if line.startswith("illegal moves (greedy, vs random): ")]
    assert illegal == [
        f"illegal moves (greedy, vs random): {summary['eval_before/random/illegal_action_rate']:.2%} "
        f"-> {summary['eval_after/random/illegal_action_rate']:.2%}"
    ]
    assert any(line.startswith("illegal moves while training (sampled") for line in lines)
    assert any(line.startswith("win rate vs heuristic: ") for line in lines)
    assert (run_dir / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unknown_demo_is_a_one_line_error(tmp_path, capsys):
    assert main(["demo", "tictactoo", f"run.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "unknown demo 'tictactoo'" in err and "tictactoe" in err and "Traceback" not in err


def test_the_arith_demo_runs_half_the_iterations_in_float32_on_a_cpu(monkeypatch):
    from ppokit.commands.demo import FP32_CPU_ITERATIONS, fit_iterations
    from ppokit.config import load_config
    from ppokit.lm.model import device

    preset = load_config("arith")
    monkeypatch.setattr(device, "bf16_supported", lambda d: False)  # an AVX2 laptop
    cfg, line = fit_iterations(preset, "arith", [])
    assert cfg.train.iterations == FP32_CPU_ITERATIONS["arith"] < preset.train.iterations
    assert line.startswith(f"PPO iterations: {cfg.train.iterations} (float32: this CPU has no native bf16")
    assert fit_iterations(load_config("arith", ["seed=3"]), "arith", ["seed=3"])[0].seed == 3  # overrides kept
    for given in (["train.iterations=7"], ["train={iterations: 7}"]):  # the user's count stands
        cfg = load_config("arith", given)
        assert fit_iterations(cfg, "arith", given) == (cfg, None)
    assert fit_iterations(load_config("tictactoe"), "tictactoe", [])[1] is None  # a preset without the rule
    monkeypatch.setattr(device, "bf16_supported", lambda d: True)  # AVX512-BF16 or AMX: the preset's count
    assert fit_iterations(preset, "arith", []) == (preset, None)
