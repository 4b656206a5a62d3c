"""Shared helpers of the control tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import control_toy_envs  # noqa: E402,F401  (registers ppokit-test/* envs)


@pytest.fixture
def make_cfg(tmp_path):
    """``make_cfg("env.id=...", ..., preset=None)``: a validated control config writing under tmp_path."""
    from ppokit.config import load_config

    def make(*overrides: str, preset: str | None = None):
        base = ["workload=control", "run.progress=false", "run.tensorboard=false", f"run.output_dir={tmp_path}"]
        return load_config(preset, base + list(overrides))

    return make


@pytest.fixture
def train(tmp_path):
    """Run ``train_control`` on a config; returns (result, run_dir)."""
    from ppokit.persistence.rundir import create_run_dir
    from ppokit.workloads import train as train_control

    def run(cfg):
        run_dir = create_run_dir(cfg)
        return train_control(cfg, run_dir), run_dir

    return run
