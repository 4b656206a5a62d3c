"""``ppokit train`` on a local Ray it starts itself: both workloads, SIGTERM, nothing left behind.

Each run here starts and stops its own Ray (cluster.address null), as a user's does;
the processes of the session's shared Ray are told apart by being there before.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cluster_helpers import DIST_ONLY, arith_cfg, assert_rows_equal, cartpole_cfg, run
from resume_helpers import TEST_TAG, start_and_wait, subprocess_env, train_cmd

from ppokit.persistence.rundir import read_metrics
from ppokit.workloads import train

pytestmark = pytest.mark.slow

RAY_PROCESS_MARKS = (
    "raylet",
    "gcs_server",
    "ray::",
    "default_worker.py",
    "log_monitor.py",
    "monitor.py",
    "dashboard",
    "runtime_env/agent",
)


def ray_processes() -> set[int]:
    """PIDs of the Ray processes this test session started (from /proc/*/cmdline, and
    :data:`TEST_TAG` in /proc/*/environ: other jobs' Ray processes on the machine do not count)."""
    found = set()
    tag = f"PPOKIT_TEST_TAG={TEST_TAG}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ours = tag in (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ours and any(mark in cmdline for mark in RAY_PROCESS_MARKS):
            found.add(int(proc.name))
    return found


def assert_no_new_ray_processes(before: set[int]) -> None:
    deadline = time.monotonic() + 15  # ray.shutdown returns before every child has exited
    while (left := ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"Ray processes left behind: {sorted(left)}"


def test_cartpole_two_workers_from_the_command_line(tmp_path, cluster_clean):
    before = ray_processes()
    proc = subprocess.run(
        train_cmd(
            "cartpole",
            "cluster.rollout_workers=2",
            "train.iterations=4",
            "env.eval_episodes=2",
            "--output-dir",
            str(tmp_path),
            "--name",
            "w2",
        ),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_metrics(tmp_path / "w2")
    assert [r["global_step"] for r in rows] == [256, 512, 768, 1024]  # two shards of 4 envs x 32 steps
    assert "2 rollout worker(s)" in proc.stdout
    assert_no_new_ray_processes(before)


def test_arith_one_worker_from_the_command_line(tmp_path, cluster_clean, tiny_model_dir, digits_reward):
    before = ray_processes()
    cfg = arith_cfg(tiny_model_dir, digits_reward, "train.iterations=2")
    config = tmp_path / "arith.yaml"
    config.write_text(json.dumps(cfg.to_dict()))
    proc = subprocess.run(
        train_cmd(str(config), "cluster.rollout_workers=1", "--output-dir", str(tmp_path), "--name", "w1"),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(read_metrics(tmp_path / "w1")) == 2
    assert_no_new_ray_processes(before)


def test_sigterm_checkpoints_and_stops_the_workers(tmp_path, cluster_clean):
    """SIGTERM on the driver mid-run: exit 143 with a checkpoint, no Ray process left; resumed
    in-process (another layout) the run equals an uninterrupted in-process run."""
    before = ray_processes()
    run_dir = tmp_path / "runs" / "stopped"
    args = ("train.iterations=12", "env.eval_episodes=2", "rollout.off_policy_steps=1")
    proc = start_and_wait(
        train_cmd(
            "cartpole",
            *args,
            "cluster.rollout_workers=1",
            "run.progress=false",
            "--output-dir",
            str(tmp_path / "runs"),
            "--name",
            "stopped",
        ),
        run_dir,
        3,
    )
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "checkpoint saved at" in err
    assert_no_new_ray_processes(before)
    from ppokit.persistence.rundir import latest_checkpoint

    saved = latest_checkpoint(run_dir)
    train(cartpole_cfg(*args), run_dir, resume_from=saved)
    local = run(cartpole_cfg(*args), tmp_path / "local")
    assert_rows_equal(read_metrics(run_dir), local, extra=DIST_ONLY)


def test_sigterm_while_the_local_ray_starts_stops_the_run_at_once(tmp_path, cluster_clean):
    """SIGTERM while ``ray.init`` starts the run's Ray (nothing to save yet): one line, exit 143, no
    Ray process left: not the agents of a raylet stopped early either (it was Ray's own handler's
    exit status 15, without a word, and the agents stayed)."""
    before = ray_processes()
    proc = subprocess.Popen(
        train_cmd("cartpole", "cluster.rollout_workers=1", "--output-dir", str(tmp_path), "--name", "early"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    deadline = time.monotonic() + 120
    while not any("raylet" in _cmdline(pid) for pid in ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGTERM)  # ray.init returns seconds after its raylet starts
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "ppokit: interrupted while the run was set up, before its first iteration: start it again with: "
        f"ppokit train {tmp_path / 'early' / 'config.yaml'} run.resume=auto"
    )
    assert_no_new_ray_processes(before)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_a_local_ray_without_the_resources_fails_at_once(tmp_path, cluster_clean):
    """The local Ray a run starts has no autoscaler: a request beyond it is an error without
    the placement wait (exit 2, one line), and Ray is shut down."""
    before = ray_processes()
    proc = subprocess.run(
        train_cmd(
            "cartpole",
            "cluster.rollout_workers=1",
            "cluster.gpus_per_worker=1",
            "--output-dir",
            str(tmp_path),
            "--name",
            "gpu",
        ),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ppokit: error: the Ray cluster cannot place 1 rollout worker(s)")
    assert "missing: GPU 1 more (the local Ray this run started: no node will join)" in last
    assert_no_new_ray_processes(before)
