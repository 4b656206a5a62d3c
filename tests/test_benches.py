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


def test_the_real_model_bench_reports_each_phase_against_the_machines_own_rates():
    result = json.loads(bench("bench/real_model.py", "--smoke").strip().splitlines()[-1])
    assert result["run"]["model"] == "tiny" and result["run"]["measured_iterations"] == [2]
    assert {"avx2", "avx512f", "avx512_bf16"} <= set(result["machine"]["flags"])
    assert result["machine"]["cpu"] and result["machine"]["torch_threads"] >= 1
    assert result["run"]["lm_head_calls_in_score_and_update"] == 0  # the hooks left the run's own path alone
    for phase in ("generate", "score", "update"):
        p = result["phases"][phase]
        assert p["time_s"] > 0 and p["flops"] > 0 and p["rate"] > 0 and p["rate_fp32"] > 0, (phase, p)
        assert p["fraction"] == pytest.approx(p["flops"] / p["rate"] / p["time_s"]), (phase, p)
    assert result["phases"]["update"]["flops"] > result["phases"]["score"]["flops"]  # its backward is counted
    decode = result["phases"]["generate"]["decode"]
    assert decode["steps"] > 0 and decode["step_s"] > 0 and decode["memory_floor_s"] > 0
    assert result["bandwidth"]["read"] > 0


def test_the_call_path_bench_counts_modules_and_returns(tmp_path):
    out = tmp_path / "path.json"
    bench("bench/call_path.py", "--json", str(out), "config", "show", "cartpole")
    result = json.loads(out.read_text())
    assert result["status"] == 0
    run = result["run"]
    assert run["order"][0] == "ppokit.commands.config" and "ppokit.config" in run["order"]
    assert run["modules"] == len(run["order"]) and 0 <= run["returns"] < run["entries"]
    assert result["all"]["modules"] >= run["modules"]
    stopped = tmp_path / "stopped.json"
    bench("bench/call_path.py", "--until", "load_config", "--json", str(stopped), "config", "show", "cartpole")
    cut = json.loads(stopped.read_text())
    assert cut["status"] == "stopped at load_config" and cut["run"]["order"][-1] == "ppokit.config"
