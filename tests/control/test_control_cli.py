"""Bad input through the ``ppokit`` command line: one line on stderr, exit status 2, no traceback.

One case runs ``python -m ppokit`` in a subprocess (the real exit status and stderr);
the others call :func:`ppokit.cli.main` in-process (the same code path, without paying
for a fresh interpreter's imports on a 2-core CI machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppokit.cli import main

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _one_line(stderr: str, *fragments: str) -> None:
    assert "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip() and "WARN" not in ln]
    assert len(lines) == 1, stderr
    for fragment in ("ppokit: error:", *fragments):
        assert fragment in lines[0], lines[0]


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_unknown_env_id_in_a_real_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "ppokit", "train", "cartpole", "env.id=CartPol-v1", "--no-progress"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    _one_line(proc.stderr, "CartPol-v1", "did you mean 'CartPole-v1'")


@pytest.mark.parametrize(
    "env_id, fragment",
    [
        ("control_toy_envs:ppokit-test/MultiBinary-v0", "MultiBinary"),
        ("ppokit-test/DictObs-v0", "observation space"),
        ("Blackjack-v1", "observation space"),
    ],
)
def test_unsupported_space(tmp_path, capsys, env_id, fragment):
    code, _, err = cli(capsys, "train", "cartpole", f"env.id={env_id}", f"run.output_dir={tmp_path}", "--no-progress")
    assert code == 2
    _one_line(err, fragment)


def test_an_argument_the_environment_fails_on_is_one_line_before_a_run_directory(tmp_path, capsys):
    """Pendulum takes ``g`` and fails on a text one only at its first step (a traceback before)."""
    args = ("train", "cartpole", "env.id=Pendulum-v1", f"run.output_dir={tmp_path}", "--no-progress")
    code, _, err = cli(capsys, *args, "env.kwargs.g=abc")
    assert code == 2
    _one_line(err, "env.kwargs: Pendulum-v1 fails with these arguments at its first reset and step (TypeError: ")
    assert not list(tmp_path.iterdir())


def test_corrupt_checkpoint_and_a_good_one(tmp_path, capsys):
    code, _, err = cli(
        capsys,
        "train",
        "cartpole",
        "train.total_steps=512",
        "env.eval_episodes=1",
        "run.name=tiny",
        "run.tensorboard=false",
        f"run.output_dir={tmp_path}",
        "--no-progress",
    )
    assert code == 0, err
    run_dir = tmp_path / "tiny"
    code, out, err = cli(capsys, "eval", str(run_dir), "--episodes", "2")
    assert code == 0 and "return over 2 episodes" in out, err
    code, _, err = cli(capsys, "eval", str(run_dir), "--episodes", "2", "--prompts", "3", "--json")
    assert code == 2  # language-model options are refused, not ignored
    _one_line(err, f"--json, --prompts do not apply to {run_dir}, a control run; it takes --episodes, --seed")
    model = run_dir / "checkpoint" / "learner.safetensors"
    model.write_bytes(model.read_bytes()[:64])
    code, _, err = cli(capsys, "eval", str(run_dir), "--episodes", "2")
    assert code == 2
    _one_line(err, str(model))
    code, _, err = cli(capsys, "eval", str(tmp_path / "missing"), "--episodes", "2")
    assert code == 2
    _one_line(err, "missing")
