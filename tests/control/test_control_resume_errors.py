"""Run directories and checkpoints a control resume, rerun or eval must refuse or leave alone
(see test_control_resume.py for exact resume)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ppokit.cli import main
from ppokit.track import read_metrics


def _small(tmp_path, *extra):
    return ["cartpole", "env.num_envs=2", "env.num_steps=16", "train.total_steps=128", "train.mini_batch_size=16",
            "train.epochs=1", "env.eval_episodes=1", "run.progress=false", "run.tensorboard=false",
            f"run.output_dir={tmp_path}", *extra]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """4 iterations, a checkpoint after each (the newest 3 kept) and the final one."""
    root = tmp_path_factory.mktemp("control-resume-errors")
    assert main(["train", *_small(root, "run.name=run", "run.checkpoint_every=1", "run.keep_checkpoints=3")]) == 0
    return root / "run"


@pytest.fixture
def interrupted(finished_run, tmp_path) -> Path:
    """A copy of the run without its final checkpoint (stopped after 3 iterations)."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    shutil.rmtree(run_dir / "checkpoint")
    return run_dir


@pytest.mark.parametrize("value", [-5, 99, 2, "3", True])
def test_a_corrupt_iteration_count_is_refused_and_names_another_checkpoint(interrupted, capsys, value):
    latest = interrupted / "checkpoints" / "iter-000003"
    body = json.loads((latest / "meta.json").read_text())
    body["iteration"] = value
    (latest / "meta.json").write_text(json.dumps(body))
    before = (interrupted / "metrics.jsonl").read_bytes()
    assert main(["train", "--resume", str(interrupted)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"checkpoint {latest} is corrupt" in err and "\n" not in err, err
    assert str(interrupted / "checkpoints" / "iter-000002") in err
    assert (interrupted / "metrics.jsonl").read_bytes() == before
