"""`ppokit plot`: curves of one or more runs in a PNG; `ppokit train` draws RUN_DIR/curves.png."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppokit.cli import main
from ppokit.monitoring.plot import PANELS, plot_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR" and data.rstrip()[-8:-4] == b"IEND"
    assert len(data) > 20_000  # six panels with axes and curves, not an empty canvas


def write_run(run_dir: Path, rows: list[dict], *, trailing: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + trailing)
    return run_dir


def control_rows(n: int, scale: float = 1.0) -> list[dict]:
    return [
        {
            "iteration": i,
            "global_step": 256 * (i + 1),
            "return_mean": scale * (20 + 5 * i),
            "approx_kl": 0.01 / (i + 1),
            "entropy": 0.69 - 0.01 * i,
            "value_loss": 5.0 - 0.1 * i,
            "clipfrac": 0.05,
            "explained_variance": 0.1 * i,
            "sps": 5000.0,
        }
        for i in range(n)
    ]


def lm_rows(n: int) -> list[dict]:
    # what the lm workload logs: no global_step, reward instead of return, kl to the reference
    return [
        {
            "iteration": i,
            "reward_mean": 0.1 * i,
            "kl_ref": 0.02 * i,
            "approx_kl": 0.001,
            "entropy": 1.5,
            "value_loss": "nan" if i == 1 else 0.3,
            "clipfrac": 0.0,
        }
        for i in range(n)
    ]


def test_one_run_defaults_to_run_dir_curves_png(tmp_path, capsys):
    run = write_run(tmp_path / "cartpole-s1", control_rows(5))
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == f"curves: {run / 'curves.png'}"
    assert_png(run / "curves.png")


def test_several_runs_overlay_with_their_names(tmp_path):
    a = write_run(tmp_path / "a" / "run", control_rows(4))
    b = write_run(tmp_path / "b" / "run", control_rows(6, scale=2.0))  # same name: parent/name labels
    c = write_run(tmp_path / "arith-s1", lm_rows(3))
    summary = plot_runs([a, b, c], tmp_path / "out" / "all.png")
    assert_png(tmp_path / "out" / "all.png")
    assert summary["labels"] == ["a/run", "b/run", "arith-s1"]
    assert summary["x"] == {"a/run": "global_step", "b/run": "global_step", "arith-s1": "iteration"}
    panels = summary["panels"]
    assert set(panels) == {title for title, _, _ in PANELS}
    assert panels["return / reward"] == ["a/run: return_mean", "b/run: return_mean", "arith-s1: reward_mean"]
    assert panels["KL"] == ["a/run: approx_kl", "b/run: approx_kl", "arith-s1: approx_kl", "arith-s1: kl_ref"]
    assert panels["explained variance"] == ["a/run: explained_variance", "b/run: explained_variance"]
    assert panels["value loss"][-1] == "arith-s1: value_loss"  # a "nan" value is dropped, the rest drawn


def test_several_runs_default_to_cwd(tmp_path, monkeypatch):
    a, b = write_run(tmp_path / "a", control_rows(2)), write_run(tmp_path / "b", control_rows(2))
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(a), str(b)]) == 0
    assert_png(tmp_path / "curves.png")


def test_missing_metrics_show_no_data(tmp_path):
    run = write_run(tmp_path / "r", [{"iteration": 0, "reward_mean": 0.5}, {"iteration": 1, "reward_mean": 0.7}])
    summary = plot_runs([run])
    assert summary["panels"]["return / reward"] == ["r: reward_mean"]
    assert summary["panels"]["clip fraction"] == [] and summary["panels"]["KL"] == []


def test_a_torn_last_line_is_skipped(tmp_path):
    run = write_run(tmp_path / "r", control_rows(3), trailing='{"iteration": 3, "ret')
    assert plot_runs([run])["panels"]["entropy"] == ["r: entropy"]


@pytest.mark.parametrize(
    "make, args, message",
    [
        (lambda d: None, ["{d}/nope"], "run directory {d}/nope does not exist"),
        (lambda d: (d / "r").mkdir(), ["{d}/r"], "{d}/r/metrics.jsonl is missing"),
        (lambda d: write_run(d / "r", []), ["{d}/r"], "{d}/r/metrics.jsonl is empty"),
        (
            lambda d: write_run(d / "r", control_rows(1), trailing="{oops\n" + json.dumps(control_rows(1)[0]) + "\n"),
            ["{d}/r"],
            "{d}/r/metrics.jsonl line 2 is corrupt: not valid JSON",
        ),
        (
            lambda d: write_run(d / "r", control_rows(1), trailing="[1, 2]\n"),
            ["{d}/r"],
            "{d}/r/metrics.jsonl line 2 is corrupt: expected a JSON object, got a list",
        ),
        (
            lambda d: write_run(d / "r", control_rows(2)),
            ["{d}/r", "--out", "{d}/x.jpg"],
            "give a file name ending in .png",
        ),
    ],
)
def test_errors_exit_2_with_one_line(tmp_path, capsys, make, args, message):
    make(tmp_path)
    status = main(["plot", *(a.format(d=tmp_path) for a in args)])
    err = capsys.readouterr().err
    assert status == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("ppokit: error: "), err
    assert message.format(d=tmp_path) in err


def test_train_writes_curves_png(tmp_path, capsys):
    status = main(
        [
            "train",
            "cartpole",
            "train.iterations=2",
            "run.tensorboard=false",
            "--output-dir",
            str(tmp_path),
            "--name",
            "c",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert f"curves: {tmp_path / 'c' / 'curves.png'}" in out
    assert_png(tmp_path / "c" / "curves.png")


def test_a_plotting_failure_after_training_is_only_a_warning(tmp_path, capsys):
    from ppokit.commands.train import write_curves

    write_curves(tmp_path / "gone")  # no metrics: plot_runs raises; the run must not be lost
    err = capsys.readouterr().err
    assert err.startswith("ppokit: warning: could not draw") and "ppokit plot" in err
