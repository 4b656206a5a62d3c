"""A start that fails on bad input leaves no empty run directory; one that got anywhere is kept."""

from __future__ import annotations

import json
import shutil

import pytest

from ppokit import workloads
from ppokit.commands.train import run_training
from ppokit.errors import UserError
from ppokit.persistence import rundir

RUN = ["cartpole", "run.progress=false", "run.tensorboard=false"]


def warm_start_model(run_dir):
    (run_dir / "base_model").mkdir()
    (run_dir / "base_model" / "model.safetensors").touch()


def failing_train(made: list, write=None):
    """A stand-in for the workload's train that fails like a model that cannot load, after ``write``."""

    def train(cfg, run_dir, resume_from, workload=None):
        made.append(run_dir)
        if write is not None:
            write(run_dir)
        raise UserError("model.path=x: the model is not causal")

    return train


def test_a_start_that_fails_on_bad_input_removes_its_empty_run_directory(tmp_path, monkeypatch, capsys):
    made = []
    monkeypatch.setattr(workloads, "train", failing_train(made))
    with pytest.raises(UserError, match="not causal"):
        run_training(RUN[0], [*RUN[1:], f"run.output_dir={tmp_path}"])
    (run_dir,) = made
    assert not run_dir.exists() and list(tmp_path.iterdir()) == []
    assert f"run directory {run_dir} removed: the run did not start" in capsys.readouterr().out


@pytest.mark.parametrize(
    "what, write",
    [
        ("a warm start's model", warm_start_model),
        ("a metrics row", lambda d: (d / "metrics.jsonl").write_text(json.dumps({"iteration": 0}) + "\n")),
        ("a file of the user's", lambda d: (d / "notes.txt").write_text("mine")),
    ],
)
def test_a_run_directory_that_holds_anything_more_is_kept(tmp_path, monkeypatch, what, write):
    made = []
    monkeypatch.setattr(workloads, "train", failing_train(made, write))
    with pytest.raises(UserError):
        run_training(RUN[0], [*RUN[1:], f"run.output_dir={tmp_path}"])
    (run_dir,) = made
    assert (run_dir / "config.yaml").is_file(), what


def test_only_a_directory_of_what_a_start_writes_is_discarded(tmp_path):
    run_dir = tmp_path / "named"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("workload: control\n")
    (run_dir / "metrics.jsonl").touch()
    assert rundir.discard_unstarted(run_dir) and not run_dir.exists()
    run_dir.mkdir()
    (run_dir / "checkpoint").mkdir()
    (run_dir / "config.yaml").write_text("workload: control\n")
    assert not rundir.discard_unstarted(run_dir) and run_dir.is_dir()
    shutil.rmtree(run_dir)
    assert not rundir.discard_unstarted(run_dir)  # gone already (removed meanwhile): nothing to do
