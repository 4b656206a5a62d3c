"""Shared by the kill-and-resume tests of both workloads (tests/control, tests/lm)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from ppokit.persistence.rundir import read_metrics

# The fields of an LM run's metrics rows that differ between any two runs (wall-clock times and
# rates); every other field of a resumed run must match the uninterrupted run's.
LM_TIMING_KEYS = frozenset(
    {
        "time",
        "wall_time",
        "time_collect",
        "time_iteration",
        "time_generate",
        "time_score",
        "time_reward",
        "time_update",
        "gen_tokens_per_s",
        "score_tokens_per_s",
        "train_tokens_per_s",
    }
)


def train_cmd(*args: str) -> list[str]:
    """``python -m ppokit train ARGS`` with this interpreter."""
    return [sys.executable, "-m", "ppokit", "train", *args]


# Marks the processes this test session starts (and every process they start: Ray's raylet and
# workers inherit the environment), so that a check for leftovers ignores other jobs' processes.
TEST_TAG = f"ppokit-tests-{os.getpid()}"


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PPOKIT_TEST_TAG"] = TEST_TAG
    return env


# The complete rows of RUN_DIR/metrics.jsonl (a torn last line is skipped): the library's reader.
read_rows = read_metrics


def start_and_wait(cmd: list[str], run_dir: Path, rows: int, timeout: float = 120) -> subprocess.Popen:
    """Start ``cmd``; return once ``metrics.jsonl`` has ``rows`` rows (or the process ended)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if len(read_rows(run_dir)) >= rows:
            break
        time.sleep(0.002)
    return proc


def assert_same_metrics(got: list[dict], want: list[dict], iterations: int, timing: Iterable[str]) -> None:
    """Row by row, every field but the ``timing`` ones and the memory measurements (``memory/...``,
    the process's state) equal (floats bit for bit)."""
    timing = set(timing) | {k for row in got + want for k in row if k.startswith("memory/")}
    assert [r["iteration"] for r in got] == list(range(iterations)) == [r["iteration"] for r in want]
    assert timing <= set(want[0]) | {"wall_time"}, "a timing field was renamed: update the test's TIMING"
    for g, w in zip(got, want):
        g_keys, w_keys = set(g) - timing, set(w) - timing
        assert g_keys == w_keys, (g["iteration"], g_keys ^ w_keys)
        for key in sorted(g_keys):
            assert g[key] == w[key], f"iteration {g['iteration']}: {key} = {g[key]!r}, uninterrupted {w[key]!r}"


def assert_same_state(a, b, where: str = "state") -> None:
    """Two checkpoint states (nested dicts/lists of tensors and plain values) are equal, tensors bit for bit."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b) if isinstance(b, dict) else b)
        for key in a:
            assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


def poison_value_loss(monkeypatch, bad) -> None:
    """Make the trainer's value loss NaN on the calls ``n`` (1-based) where ``bad(n)`` is true."""
    from ppokit import trainer as trainer_mod

    real = trainer_mod.algo.value_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss, metrics = real(*args, **kwargs)
        return (loss * float("nan") if bad(calls["n"]) else loss), metrics

    monkeypatch.setattr(trainer_mod.algo, "value_loss", poisoned)


def sigterm_run(cmd: list[str], run_dir: Path, rows: int, marker: str = "meta.json") -> Path:
    """Start ``cmd``, send SIGTERM after ``rows`` metrics rows; check exit 143 and the resume hint.

    Returns the checkpoint written on the signal (the newest one, under ``checkpoints/``)."""
    import signal

    from ppokit.persistence import rundir

    proc = start_and_wait(cmd, run_dir, rows)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    line = [x for x in err.splitlines() if "interrupted" in x][-1]
    assert "checkpoint saved at" in line and f"ppokit train --resume {run_dir}" in line
    saved = rundir.latest_checkpoint(run_dir)
    assert saved is not None and saved.parent.name == "checkpoints" and str(saved) in line
    return saved


def dead_pid() -> int:
    """The PID of a process that has exited (and been reaped): a killed checkpoint writer's."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def copy_without_final_checkpoint(finished_run: Path, dest: Path) -> Path:
    """A copy of a finished run as if stopped after its last periodic checkpoint."""
    import shutil

    shutil.copytree(finished_run, dest)
    shutil.rmtree(dest / "checkpoint")
    return dest
