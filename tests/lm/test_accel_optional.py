"""The CPU acceleration is an opt-in layer: LM training runs without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = [
    "data.eval_size=8",
    "data.sft_examples=32",
    "data.sft_epochs=1",
    "train.iterations=2",
    "train.batch_size=16",
    "train.mini_batch_size=16",
    "train.micro_batch_size=16",
    "train.infer_micro_batch_size=16",
    "rollout.max_new_tokens=4",
    "run.progress=false",
    "run.tensorboard=false",
    "run.precision=fp32",
]


def train_without_a_compiler(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``ppokit train arith`` in a process whose PATH has no C compiler, no ``CC`` and an
    empty kernel cache: the machine a user without build tools has."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env.update(PATH=str(empty), PPOKIT_CACHE=str(tmp_path / "kernel-cache"), OMP_NUM_THREADS="1")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ppokit",
            "train",
            "arith",
            *TINY,
            *overrides,
            f"run.output_dir={tmp_path}",
            "run.name=run",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )


@pytest.mark.slow
def test_lm_training_runs_without_a_c_compiler(tmp_path):
    proc = train_without_a_compiler(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("lm: "))
    assert "fused CPU kernels" not in header  # none could be built
    assert not (tmp_path / "kernel-cache").exists() or not any((tmp_path / "kernel-cache").rglob("*.so"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1] and "held-out accuracy" in proc.stdout


@pytest.mark.slow
def test_lm_training_runs_with_the_acceleration_switched_off(tmp_path):
    proc = train_without_a_compiler(tmp_path, "model.cpu_kernels=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "checkpoint" / "meta.json").is_file()
