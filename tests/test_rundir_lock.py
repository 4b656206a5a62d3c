"""One process trains in a run directory at a time: a second one is refused with a
one-line error naming the holder; a lock left by a killed process is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from resume_helpers import start_and_wait, subprocess_env, train_cmd

from ppokit.cli import main
from ppokit.errors import UserError
from ppokit.persistence.rundir import RunLock, read_metrics

RUN = [
    "cartpole",
    "train.total_steps=20480",
    "env.eval_episodes=2",
    "run.progress=false",
    "run.tensorboard=false",
    "run.checkpoint_every=1",
]


@pytest.mark.slow
def test_a_second_train_on_a_run_in_use_exits_2_and_the_first_finishes_intact(tmp_path, capsys):
    run_dir = tmp_path / "busy"
    first = start_and_wait(train_cmd(*RUN, f"run.output_dir={tmp_path}", "run.name=busy"), run_dir, rows=2)
    assert first.poll() is None, first.communicate()
    # the second one in this process (the command line's own path, without a second start-up)
    for args in (["--resume", str(run_dir)], [*RUN, f"run.output_dir={tmp_path}", "run.name=busy", "run.resume=auto"]):
        status = main(["train", *args])
        lines = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"ppokit: error: run directory {run_dir} is in use by process {first.pid} ")
    assert first.poll() is None, "the first run ended before the second one was refused: nothing was tested"
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == list(range(20480 // 256))  # every row once, in order
    assert (run_dir / "checkpoint" / "meta.json").is_file()


@pytest.mark.slow
def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path):
    run_dir = tmp_path / "killed"
    # 40 iterations: killed at its third, the run has 37 left (seconds; the kill comes within milliseconds)
    run = [*RUN, "train.total_steps=10240"]
    proc = start_and_wait(train_cmd(*run, f"run.output_dir={tmp_path}", "run.name=killed"), run_dir, rows=3)
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert f"process {proc.pid}" in (run_dir / ".lock").read_text()  # left behind, naming the dead holder
    resumed = subprocess.run(
        train_cmd("--resume", str(run_dir)), capture_output=True, text=True, timeout=300, env=subprocess_env()
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"was locked by process {proc.pid}" in resumed.stderr and "taking it over" in resumed.stderr
    assert [r["iteration"] for r in read_metrics(run_dir)] == list(range(10240 // 256))
    assert (run_dir / ".lock").read_text() == ""  # released at the end


def test_the_lock_is_reentrant_in_one_process_and_free_after_release(tmp_path):
    with RunLock(tmp_path) as outer:
        with RunLock(tmp_path) as inner:
            assert inner is outer
        code = (
            "import sys\nfrom ppokit.persistence.rundir import RunLock\nfrom ppokit.errors import UserError\n"
            f"try:\n    RunLock({str(tmp_path)!r}).acquire()\nexcept UserError as e:\n    print(e)\n"
        )
        held = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert f"is in use by process {os.getpid()} " in held.stdout
    free = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert free.stdout == "" and free.returncode == 0


def test_reading_commands_take_no_lock(tmp_path):
    """eval, plot and export only read: they work on a run while another process holds it."""
    from ppokit.cli import main

    assert (
        main(
            [
                *["train"],
                *RUN[:1],
                "train.total_steps=512",
                "env.eval_episodes=1",
                "run.progress=false",
                "run.tensorboard=false",
                f"run.output_dir={tmp_path}",
                "run.name=done",
            ]
        )
        == 0
    )
    run_dir = tmp_path / "done"
    code = (
        "import time, sys\nfrom ppokit.persistence.rundir import RunLock\nRunLock(sys.argv[1]).acquire()\n"
        "print('locked', flush=True)\ntime.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["eval", str(run_dir), "--episodes", "1"]) == 0
        assert main(["plot", str(run_dir), "--out", str(tmp_path / "c.png")]) == 0
        with pytest.raises(UserError, match="is in use by process"):
            RunLock(run_dir).acquire()
    finally:
        holder.kill()
        holder.wait()
