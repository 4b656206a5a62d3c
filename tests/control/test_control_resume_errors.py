"""Run directories and checkpoints a control resume, rerun or eval must refuse or leave alone
(see test_control_resume.py for exact resume)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from resume_helpers import copy_without_final_checkpoint

from ppokit.cli import main
from ppokit.persistence.rundir import read_metrics


def _small(tmp_path, *extra):
    return [
        "cartpole",
        "env.num_envs=2",
        "env.num_steps=16",
        "train.total_steps=128",
        "train.mini_batch_size=16",
        "train.epochs=1",
        "env.eval_episodes=1",
        "run.progress=false",
        "run.tensorboard=false",
        f"run.output_dir={tmp_path}",
        *extra,
    ]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """4 iterations, a checkpoint after each (the newest 3 kept) and the final one."""
    root = tmp_path_factory.mktemp("control-resume-errors")
    assert main(["train", *_small(root, "run.name=run", "run.checkpoint_every=1", "run.keep_checkpoints=3")]) == 0
    return root / "run"


@pytest.fixture
def interrupted(finished_run, tmp_path) -> Path:
    """A copy of the run without its final checkpoint (stopped after 3 iterations)."""
    return copy_without_final_checkpoint(finished_run, tmp_path / "run")


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


def test_a_damaged_checkpoint_file_says_which_checkpoint_to_resume_from(interrupted, capsys):
    latest = interrupted / "checkpoints" / "iter-000003"
    damaged = latest / "learner.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])
    before = (interrupted / "metrics.jsonl").read_bytes()
    assert main(["train", "--resume", str(interrupted)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"checkpoint file {damaged} is corrupt or truncated" in err and "\n" not in err, err
    assert err.endswith(
        f"; move it out of the run directory to resume from {interrupted / 'checkpoints'}/iter-000002"
    ), err
    assert (interrupted / "metrics.jsonl").read_bytes() == before


def test_a_config_yaml_the_user_wrote_is_never_overwritten(tmp_path, capsys):
    """A directory holding only a full config (``ppokit config show ... > config.yaml``) that
    differs from the run's: no ppokit run ever started there, so nothing of it is replaced."""
    from ppokit.config import load_config

    user = tmp_path / "myexp"
    user.mkdir()
    text = load_config("cartpole", ["algo.gamma=0.95"]).to_yaml()
    (user / "config.yaml").write_text(text)
    assert main(["train", *_small(tmp_path, "run.name=myexp")]) == 2
    err = capsys.readouterr().err.strip()
    assert "another config" in err and "algo.gamma" in err and "\n" not in err, err
    assert (user / "config.yaml").read_text() == text and sorted(p.name for p in user.iterdir()) == ["config.yaml"]


def test_a_directory_that_is_not_a_run_is_refused(tmp_path, capsys):
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "config.yaml").write_text("notes\n")
    assert main(["train", *_small(tmp_path, "run.name=userdir")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{user} is not empty and is not a ppokit run directory" in err and "\n" not in err, err
    assert (user / "config.yaml").read_text() == "notes\n" and sorted(p.name for p in user.iterdir()) == ["config.yaml"]
    # the same with run.resume=auto; an empty directory is fine
    assert main(["train", *_small(tmp_path, "run.name=userdir", "run.resume=auto")]) == 2
    assert "not a ppokit run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["train", *_small(tmp_path, "run.name=empty", "train.total_steps=32")]) == 0


def test_a_run_that_failed_before_its_first_iteration_can_be_run_again(tmp_path, capsys, monkeypatch):
    from ppokit.control.rollout import Rollout

    def interrupted(self, policy):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(Rollout, "collect", interrupted)  # Ctrl-C during the first rollout
        assert main(["train", *_small(tmp_path, "run.name=r")]) == 130
    run_dir = tmp_path / "r"
    assert (run_dir / "config.yaml").is_file() and read_metrics(run_dir) == []
    capsys.readouterr()
    # --resume: no checkpoint; the message says what works
    assert main(["train", *_small(tmp_path, "run.name=r"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "has no checkpoint" in err and "run.resume=auto" in err
    # another config, when the attempt built something from its config (as an LM run's base_model): refused
    (run_dir / "base_model").mkdir()
    assert main(["train", *_small(tmp_path, "run.name=r", "seed=7")]) == 2
    err = capsys.readouterr().err
    assert (
        "stopped before its first iteration, with another config (seed (1 in the run, 7 now)) and what it "
        "built (base_model)" in err
    )
    # the same config: the run starts in that directory
    assert main(["train", *_small(tmp_path, "run.name=r")]) == 0
    assert len(read_metrics(run_dir)) == 4
    # now it holds a finished run
    assert main(["train", *_small(tmp_path, "run.name=r")]) == 2
    assert "already holds a run (4 iterations logged); it has finished" in capsys.readouterr().err


def test_a_run_with_rows_but_no_checkpoint_points_to_run_resume_auto(finished_run, tmp_path, capsys):
    run_dir = copy_without_final_checkpoint(finished_run, tmp_path / "run")
    shutil.rmtree(run_dir / "checkpoints")
    assert main(["train", *_small(tmp_path, "run.name=run", "run.checkpoint_every=1", "run.keep_checkpoints=3")]) == 2
    err = capsys.readouterr().err
    assert "already holds a run (4 iterations logged); it has no checkpoint" in err and "run.resume=auto" in err
    assert len(read_metrics(run_dir)) == 4


def test_eval_of_an_interrupted_run_uses_its_newest_checkpoint(interrupted, capsys):
    latest = interrupted / "checkpoints" / "iter-000003"
    assert main(["eval", str(latest), "--episodes", "2"]) == 0
    direct = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(["eval", str(interrupted), "--episodes", "2"]) == 0
    out = capsys.readouterr().out
    assert f"evaluating its newest checkpoint, {latest}" in out and f"ppokit train --resume {interrupted}" in out
    assert out.strip().splitlines()[-1] == direct
