"""The CPU benchmarks that the docs' figures come from still run at the current code (a bench that
fails at its end only shows when someone measures again): each in a small setting, its output read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def bench(*args: str, timeout: float = 600) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_the_control_bench_reports_the_steps_to_its_threshold(tmp_path):
    out = tmp_path / "rows.json"
    bench("bench/control.py", "--only", "ppokit", "--seeds", "1", "--threshold", "20", "--json", str(out))
    (row,) = json.loads(out.read_text())
    assert "error" not in row, row
    assert row["steps"] is not None and row["steps"] > 0  # the evaluation rows were read
    assert row["final"] >= 20


def test_the_demo_iteration_bench_prints_its_medians():
    result = json.loads(bench("bench/demo_iteration.py", "--iterations", "4").strip().splitlines()[-1])
    assert set(result) == {"time_iteration", "time_update", "time_score", "time_collect", "process_peak_rss_gb"}
    assert 0 < result["time_update"] < result["time_iteration"] and result["process_peak_rss_gb"] > 0.1
