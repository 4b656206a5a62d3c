"""wandb as an option beside TensorBoard: never required, a clear line when asked for and unusable.

The real wandb is not a dependency (and is not installed for the tests); a fake module in
``sys.modules`` records what ppokit hands it.
"""

from __future__ import annotations

import sys
import types

import pytest

from ppokit.cli import main
from ppokit.config import load_config
from ppokit.monitoring.track import WANDB_ID_FILE, Tracker
from ppokit.persistence.rundir import read_metrics

CARTPOLE = [
    "train",
    "cartpole",
    "train.iterations=2",
    "env.num_envs=2",
    "env.num_steps=16",
    "env.eval_episodes=1",
    "train.mini_batch_size=16",
    "run.tensorboard=false",
    "--no-progress",
]


class FakeRun:
    def __init__(self, record, kwargs):
        self.record = record
        record["init"].append(kwargs)

    def log(self, row, step):
        self.record["log"].append((step, dict(row)))

    def finish(self):
        self.record["finish"] += 1


@pytest.fixture
def fake_wandb(monkeypatch):
    record = {"init": [], "log": [], "finish": 0}
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: FakeRun(record, kwargs)
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.setenv("WANDB_MODE", "offline")
    return record


def test_metrics_go_to_wandb_and_a_resume_continues_the_same_run(fake_wandb, tmp_path):
    cfg = load_config(
        "cartpole", ["run.wandb=true", "run.wandb_project=proj", "run.progress=false", "run.tensorboard=false"]
    )
    with Tracker(tmp_path, cfg, 3) as tracker:
        tracker.log(0, {"return_mean": 1.5, "global_step": 32, "note": "text", "bad": float("nan")})
    with Tracker(tmp_path, cfg, 3, purge_step=1) as tracker:
        tracker.log(1, {"return_mean": 2.5, "global_step": 64})
    first, second = fake_wandb["init"]
    assert first["project"] == "proj" and first["name"] == tmp_path.name and first["resume"] == "allow"
    assert first["id"] == second["id"] == (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert first["config"]["run"]["wandb_project"] == "proj"
    assert fake_wandb["log"][0][0] == 32 and fake_wandb["log"][0][1]["return_mean"] == 1.5
    assert "note" not in fake_wandb["log"][0][1] and "bad" not in fake_wandb["log"][0][1]  # scalars, finite
    assert fake_wandb["log"][1] == (
        64,
        {"time": fake_wandb["log"][1][1]["time"], "return_mean": 2.5, "global_step": 64},
    )
    assert fake_wandb["finish"] == 2


def test_a_training_run_logs_every_row_to_wandb(fake_wandb, tmp_path):
    assert main(CARTPOLE + ["run.wandb=true", "--output-dir", str(tmp_path), "--name", "run"]) == 0
    rows = read_metrics(tmp_path / "run")
    assert [step for step, _ in fake_wandb["log"]] == [r["global_step"] for r in rows] == [32, 64]
    assert fake_wandb["finish"] == 1


def test_wandb_asked_for_but_not_installed_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    assert main(CARTPOLE + ["run.wandb=true", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "ppokit: error: run.wandb=true needs the wandb package: pip install wandb (or pip install "
        "'ppokit[wandb]'); or set run.wandb=false"
    ]
    assert not any(tmp_path.iterdir())  # no run directory was made


def test_wandb_not_logged_in_is_one_line(fake_wandb, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert main(CARTPOLE + ["run.wandb=true", "--output-dir", str(tmp_path / "runs")]) == 2
    assert "wandb is not logged in" in capsys.readouterr().err and not fake_wandb["init"]
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert main(CARTPOLE + ["run.wandb=true", "--output-dir", str(tmp_path / "runs")]) == 0


def test_wandb_is_off_by_default_and_never_imported(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert main(CARTPOLE + ["--output-dir", str(tmp_path)]) == 0
