"""Exact resume, interruption and divergence guards (ppokit.persistence.resume + the control workload).

The end-to-end tests run ``python -m ppokit train`` in subprocesses, kill them (SIGKILL at
several points, one of them right after a metrics row, i.e. most likely inside the
checkpoint write that follows it; SIGTERM for the graceful path), resume with
``--resume`` and compare ``metrics.jsonl`` row by row with an uninterrupted run: every
field but the timing fields in :data:`TIMING` must be equal (floats bit for bit, as JSON
writes them with ``repr``), and the final weights ``torch.equal``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from resume_helpers import (
    assert_same_metrics,
    assert_same_state,
    poison_value_loss,
    read_rows,
    sigterm_run,
    start_and_wait,
    subprocess_env,
    train_cmd,
)

from ppokit.cli import main
from ppokit.errors import SetUpInterrupted, UserError
from ppokit.persistence import checkpoint, resume, rundir

TIMING = {"time", "sps", "time_collect", "time_update", "time_iteration", "wall_time"}  # differ between any two runs
ITERATIONS = 12
RUN_ARGS = [
    "cartpole",
    "env.num_envs=4",
    "env.num_steps=32",
    f"train.total_steps={ITERATIONS * 128}",
    "train.mini_batch_size=64",
    "train.epochs=2",
    "env.eval_every=4",
    "env.eval_episodes=2",
    "env.normalize_obs=true",
    "env.normalize_reward=true",
    "run.progress=false",
    "run.tensorboard=false",
    "run.keep_checkpoints=2",
]


def _assert_same_metrics(got: list[dict], want: list[dict]) -> None:
    assert_same_metrics(got, want, ITERATIONS, TIMING)


def _assert_same_weights(a: Path, b: Path) -> None:
    ca, cb = checkpoint.load_checkpoint(a / "checkpoint"), checkpoint.load_checkpoint(b / "checkpoint")
    assert_same_state(ca.parts["learner"], cb.parts["learner"])  # weights, Adam moments and steps, schedule


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run with a checkpoint every iteration (in this process: the killed
    runs are subprocesses, so the comparison also shows that nothing depends on the process)."""
    out = tmp_path_factory.mktemp("ref")
    assert main(["train", *RUN_ARGS, f"run.output_dir={out}", "run.name=ref", "run.checkpoint_every=1"]) == 0
    return out / "ref"


@pytest.mark.slow
def test_sigkill_at_several_points_then_resume_matches_the_uninterrupted_run(reference, tmp_path, capsys):
    run_dir = tmp_path / "killed"
    args = [*RUN_ARGS, f"run.output_dir={tmp_path}", "run.name=killed", "run.checkpoint_every=1"]
    kills = 0
    for rows in (2, 6, 9):  # SIGKILL as soon as the row appears: usually inside the checkpoint write
        first = rows == 2
        proc = start_and_wait(train_cmd(*args) if first else train_cmd(*args, "--resume"), run_dir, rows)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.communicate(timeout=60)
        assert len(read_rows(run_dir)) >= rows
        # whatever the writer left, the newest complete checkpoint loads
        latest = rundir.latest_checkpoint(run_dir)
        if latest is not None:
            checkpoint.load_checkpoint(latest)
        assert not list((run_dir / "checkpoints").glob(".*")), "stale temp dirs were not cleaned"
    assert kills >= 1  # (>= 2 unless the machine stalls this process for a whole run)
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert "resuming from" in capsys.readouterr().out
    _assert_same_metrics(read_rows(run_dir), read_rows(reference))
    _assert_same_weights(run_dir, reference)
    # resuming a finished run does nothing
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert len(read_rows(run_dir)) == ITERATIONS


def test_sigterm_saves_a_checkpoint_and_the_resumed_run_matches(reference, tmp_path):
    run_dir = tmp_path / "term"
    # no periodic checkpoints: the one written on SIGTERM is all there is to resume from
    saved = sigterm_run(train_cmd(*RUN_ARGS, f"run.output_dir={tmp_path}", "run.name=term"), run_dir, 4)
    assert len(read_rows(run_dir)) == checkpoint.load_checkpoint(saved).meta["iteration"]
    assert main(["train", "--resume", str(run_dir), "run.progress=false"]) == 0
    _assert_same_metrics(read_rows(run_dir), read_rows(reference))
    _assert_same_weights(run_dir, reference)


# --------------------------------------------------------------------------- rollouts queued ahead
K_OFF = 2  # rollout.off_policy_steps: two rollouts queued ahead of the update


@pytest.fixture(scope="module")
def reference_k_off(tmp_path_factory) -> Path:
    """The uninterrupted run with ``rollout.off_policy_steps=2``, a checkpoint every iteration."""
    out = tmp_path_factory.mktemp("ref-k-off")
    args = [*RUN_ARGS, f"rollout.off_policy_steps={K_OFF}", f"run.output_dir={out}", "run.name=ref"]
    assert main(["train", *args, "run.checkpoint_every=1"]) == 0
    return out / "ref"


@pytest.mark.slow
def test_sigkill_with_rollouts_queued_ahead_then_resume_matches(reference_k_off, tmp_path, capsys):
    """k = 2: every checkpoint holds the next two iterations' batches, sampled by older weights;
    after SIGKILLs the resumed run trains on them and equals the uninterrupted run bit for bit."""
    run_dir = tmp_path / "killed"
    args = [*RUN_ARGS, f"rollout.off_policy_steps={K_OFF}", f"run.output_dir={tmp_path}", "run.name=killed"]
    args.append("run.checkpoint_every=1")
    kills = 0
    for rows in (3, 7):
        proc = start_and_wait(train_cmd(*args) if rows == 3 else train_cmd(*args, "--resume"), run_dir, rows)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.communicate(timeout=60)
    assert kills >= 1
    latest = rundir.latest_checkpoint(run_dir)
    done = checkpoint.load_checkpoint(latest).meta["iteration"]
    pending = checkpoint.load_checkpoint(latest).parts["source"]["pending"]
    assert pending["iteration"] == done and len(pending["batches"]) == K_OFF
    assert [b["policy_version"] for b in pending["batches"]] == [done - K_OFF + j for j in range(K_OFF)]
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert "resuming from" in capsys.readouterr().out
    want = read_rows(reference_k_off)
    assert [r["staleness"] for r in want] == [min(i, K_OFF) for i in range(ITERATIONS)]
    _assert_same_metrics(read_rows(run_dir), want)
    _assert_same_weights(run_dir, reference_k_off)


# --------------------------------------------------------------------------- in process
def _small(tmp_path, *extra):
    return [
        "cartpole",
        "env.num_envs=2",
        "env.num_steps=16",
        "train.total_steps=192",
        "train.mini_batch_size=16",
        "train.epochs=2",
        "run.progress=false",
        "run.tensorboard=false",
        f"run.output_dir={tmp_path}",
        *extra,
    ]


def test_config_resume_and_run_resume_auto(tmp_path, capsys):
    assert main(["train", *_small(tmp_path, "run.name=a", "run.checkpoint_every=2")]) == 0
    rows = read_rows(tmp_path / "a")
    assert len(rows) == 6
    # an explicit run.name that holds a run is refused without resume
    assert main(["train", *_small(tmp_path, "run.name=a")]) == 2
    assert "already holds a run" in capsys.readouterr().err
    # drop the final checkpoint and the last rows: CONFIG --resume continues from iter-000004
    import shutil

    shutil.rmtree(tmp_path / "a" / "checkpoint")
    assert main(["train", *_small(tmp_path, "run.name=a", "run.checkpoint_every=2"), "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().out
    again = read_rows(tmp_path / "a")
    assert [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("memory/")} for r in again] == [
        {k: v for k, v in r.items() if k not in TIMING and not k.startswith("memory/")} for r in rows
    ]
    # run.resume=auto: a fresh start when there is no checkpoint, a resume when there is
    assert main(["train", *_small(tmp_path, "run.name=b", "run.resume=auto")]) == 0
    assert main(["train", *_small(tmp_path, "run.name=b", "run.resume=auto")]) == 0
    assert "already finished" in capsys.readouterr().out
    assert len(read_rows(tmp_path / "b")) == 6


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--resume"], "--resume needs a fixed run directory: set run.name"),
        (["run.name=nothing", "--resume"], "run directory"),
        (["run.resume=auto"], "run.resume=auto needs a fixed run directory"),
    ],
)
def test_resume_without_a_run_directory_is_a_one_line_error(tmp_path, capsys, argv, message):
    assert main(["train", *_small(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_resume_errors_name_the_problem(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path / "missing")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    # a run directory without a checkpoint (killed before the first one)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.yaml").write_text("workload: control\n")
    assert main(["train", "--resume", str(tmp_path / "empty")]) == 2
    assert "has no checkpoint" in capsys.readouterr().err
    assert main(["train", *_small(tmp_path, "run.name=c", "run.checkpoint_every=1", "train.total_steps=64")]) == 0
    capsys.readouterr()
    # another config for the same run directory
    assert main(["train", *_small(tmp_path, "run.name=c", "train.total_steps=64", "seed=5"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "config differs from the run's in seed (1 in the run, 5 now)" in err
    # only presentation fields may be overridden with --resume RUN_DIR
    assert main(["train", "--resume", str(tmp_path / "c"), "algo.gamma=0.5"]) == 2
    assert "algo.gamma" in capsys.readouterr().err
    # a tampered checkpoint: one line naming the file
    import shutil

    shutil.rmtree(tmp_path / "c" / "checkpoint")
    latest = rundir.latest_checkpoint(tmp_path / "c")
    (latest / "learner.safetensors").write_bytes(b"\x00garbage")
    assert main(["train", "--resume", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert str(latest / "learner.safetensors") in err and "\n" not in err


def test_non_finite_steps_stop_the_run_and_keep_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    poison_value_loss(monkeypatch, lambda n: n > 8)  # 4 optimizer steps per iteration: NaN from the 3rd on
    argv = _small(tmp_path, "run.name=nan", "run.checkpoint_every=1", "train.max_bad_steps=3")
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    good = tmp_path / "nan" / "checkpoints" / "iter-000002"
    assert "training diverged: 3 optimizer steps in a row" in err and str(good) in err and "\n" not in err
    assert not (tmp_path / "nan" / "checkpoint").exists()
    assert rundir.latest_checkpoint(tmp_path / "nan") == good
    weights = checkpoint.load_checkpoint(good).parts["learner"]["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert [r["skipped_steps"] for r in read_rows(tmp_path / "nan")] == [0.0, 0.0]


def test_a_few_bad_steps_are_skipped_and_counted_per_iteration(tmp_path, monkeypatch):
    poison_value_loss(monkeypatch, lambda n: n in (2, 3))
    assert main(["train", *_small(tmp_path, "run.name=few", "train.max_bad_steps=3")]) == 0
    assert [r["skipped_steps"] for r in read_rows(tmp_path / "few")] == [2.0, 0, 0, 0, 0, 0]


# --------------------------------------------------------------------------- pieces
def test_rng_capture_and_restore_round_trip_through_a_checkpoint(tmp_path):
    tgen = torch.Generator().manual_seed(3)
    ngen = np.random.default_rng(4)
    random.seed(1), np.random.seed(2), torch.manual_seed(5)
    random.random(), np.random.normal(), torch.rand(3), torch.rand(2, generator=tgen), ngen.normal()
    gens = {"shuffle": tgen, "env": ngen}
    checkpoint.save_checkpoint(tmp_path / "ck", {"rng": resume.capture_rng(gens)}, {})
    draw = lambda: (
        random.random(),
        np.random.normal(),
        torch.rand(3).tolist(),  # noqa: E731
        torch.rand(2, generator=tgen).tolist(),
        ngen.normal(),
        ngen.integers(1 << 60),
    )
    want = draw()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    tgen.manual_seed(9)
    ngen = gens["env"] = np.random.default_rng(9)
    resume.restore_rng(checkpoint.load_checkpoint(tmp_path / "ck").parts["rng"], gens)
    assert draw() == want


def _vec(env_id: str, n: int, **env):
    from ppokit.config import load_config
    from ppokit.control.envs import VecEnv

    overrides = [f"env.id={env_id}", f"env.num_envs={n}", "env.num_steps=8", "train.total_steps=64"]
    overrides += [f"env.{k}={v}" for k, v in env.items()]
    cfg = load_config(None, overrides)
    return VecEnv(cfg.env, n, seed=7, gamma=0.99)


@pytest.mark.parametrize(
    "env_id, extra",
    [
        ("CartPole-v1", {"max_episode_steps": 15}),  # native vector env
        ("CartPole-v1", {"max_episode_steps": 15, "vectorization": "sync"}),
        ("Acrobot-v1", {"max_episode_steps": 12, "normalize_obs": True, "normalize_reward": True}),
        ("Pendulum-v1", {"max_episode_steps": 10}),
        ("HalfCheetah-v5", {"max_episode_steps": 10}),  # MuJoCo: mj_getState/mj_setState
    ],
)
def test_env_snapshot_continues_bit_identically(tmp_path, env_id, extra):
    if env_id.startswith("HalfCheetah"):
        pytest.importorskip("mujoco")
    a, b = _vec(env_id, 3, **extra), _vec(env_id, 3, **extra)
    rng = np.random.default_rng(0)

    def actions():
        if a.discrete:
            return rng.integers(0, a.action_dim, a.num_envs)
        return rng.uniform(-1, 1, (a.num_envs, a.action_dim)).astype(np.float32)

    try:
        a.reset()
        for _ in range(23):  # mid-episode, after some time-limit resets
            a.step(actions())
        checkpoint.save_checkpoint(tmp_path / "ck", {"venv": a.state_dict(), "norm": a.normalizer.state_dict()}, {})
        parts = checkpoint.load_checkpoint(tmp_path / "ck").parts
        assert b.load_state_dict(parts["venv"]) is True
        b.normalizer.load_state_dict(parts["norm"])
        for _ in range(30):
            act = actions()
            for x, y in zip(a.step(act), b.step(act.copy())):
                assert np.array_equal(x, y)
        assert list(a.episode_returns) == list(b.episode_returns) and a.episodes_finished == b.episodes_finished
    finally:
        a.close(), b.close()


def test_async_env_is_not_snapshotted_but_resume_still_works(tmp_path):
    venv = _vec("CartPole-v1", 2, vectorization="async")
    try:
        venv.reset()
        venv.step(np.zeros(2, np.int64))
        state = venv.state_dict()
        assert state["env"] is None and state["exact"] is False
    finally:
        venv.close()


def _processes_with(mark: str) -> list[int]:
    """PIDs of the live processes whose environment holds ``mark`` (``KEY=VALUE``)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark.encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def test_ctrl_c_to_the_process_group_of_an_async_run_saves_a_checkpoint(tmp_path):
    """Ctrl-C in a terminal signals the whole foreground process group, the async envs' worker
    processes too: they used to die mid-step (a traceback, exit 1, no checkpoint). Now the run
    steps them to the end of the iteration, saves a checkpoint, exits 130 and leaves no worker."""
    mark = f"PPOKIT_ASYNC_RUN={os.getpid()}-{random.random()}"
    env = {**subprocess_env(), mark.split("=")[0]: mark.split("=")[1]}
    args = [*RUN_ARGS[:-1], "env.vectorization=async", f"run.output_dir={tmp_path}", "run.name=async"]
    args += [f"train.total_steps={10**6}"]  # longer than the test: only the signal ends it
    run_dir = tmp_path / "async"
    proc = subprocess.Popen(
        train_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )  # its own process group, as a terminal's foreground job
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and len(read_rows(run_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("ppokit: interrupted: checkpoint saved at"), err
    saved = rundir.latest_checkpoint(run_dir)
    assert saved is not None and checkpoint.load_checkpoint(saved).meta["iteration"] == len(read_rows(run_dir))
    deadline = time.monotonic() + 15
    while (left := _processes_with(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"env worker processes left behind: {left}"


def test_truncate_metrics_keeps_rows_before_the_checkpoint(tmp_path):
    rows = [json.dumps({"iteration": i, "x": i / 3}) for i in range(5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"iteration": 5, "x"')
    assert rundir.truncate_logs(tmp_path, 3) == 3
    assert (tmp_path / "metrics.jsonl").read_text() == "\n".join(rows[:3]) + "\n"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_leftovers_of_a_killed_writer_are_recovered(tmp_path):
    from resume_helpers import dead_pid

    ck = tmp_path / "checkpoints"
    pid = dead_pid()  # the killed writer's
    for i in (1, 2):
        checkpoint.save_checkpoint(ck / f"iter-{i:06d}", {"a": {"x": torch.full((2,), float(i))}}, {"iteration": i})
    # killed while writing iter-3 (temp dir only) ...
    (ck / f".iter-000003.tmp-{pid}").mkdir()
    (ck / f".iter-000003.tmp-{pid}" / "a.safetensors").write_bytes(b"partial")
    # ... and while replacing iter-2: moved aside, new one not yet renamed into place
    (ck / "iter-000002").rename(ck / f".iter-000002.old-{pid}")
    (ck / f".iter-000002.tmp-{pid}").mkdir()
    assert rundir.latest_checkpoint(tmp_path) == ck / "iter-000002"
    assert sorted(p.name for p in ck.iterdir()) == ["iter-000001", "iter-000002"]
    assert checkpoint.load_checkpoint(ck / "iter-000002").meta["iteration"] == 2
    # the final checkpoint wins at equal iterations; none at all -> None
    checkpoint.save_checkpoint(tmp_path / "checkpoint", {"a": {"x": torch.zeros(1)}}, {"iteration": 2})
    assert rundir.latest_checkpoint(tmp_path) == tmp_path / "checkpoint"
    assert rundir.latest_checkpoint(tmp_path / "nothing") is None
    with pytest.raises(UserError, match="has no checkpoint"):
        rundir.RunDir(ck / "iter-000001").resume_checkpoint(required=True)


def test_graceful_stop_stops_the_set_up_at_once_and_the_iterations_at_a_safe_point(tmp_path):
    """While a run is set up a signal raises SetUpInterrupted at once (nothing to save yet; not
    the Ctrl-C that ends ``ppokit sft`` early); once deferred, the first only asks for a stop and
    the second raises KeyboardInterrupt. The set-up's message says how to go on."""
    (tmp_path / "config.yaml").write_text("{}")
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with resume.GracefulStop() as stop:
        with pytest.raises(SetUpInterrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs at the next bytecode; never reached
        assert stop.signum == signal.SIGTERM
        fresh = stop.set_up_interrupted(tmp_path, tmp_path / "config.yaml", None, stop.signum)
        assert fresh.exit_code == 143 and str(fresh) == (
            "interrupted while the run was set up, before its first iteration: start it again with: "
            f"ppokit train {tmp_path / 'config.yaml'} run.resume=auto"
        )
        newest = tmp_path / "checkpoints" / "iter-000004"
        resumed = str(stop.set_up_interrupted(tmp_path, tmp_path / "config.yaml", newest, signal.SIGINT))
        assert f"{newest} is still the newest checkpoint; resume with: ppokit train --resume {tmp_path}" in resumed
    with resume.GracefulStop() as stop:
        stop.defer()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert stop.requested and stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt) as second:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert not isinstance(second.value, SetUpInterrupted)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # handlers back


def test_bad_step_guard_counts_consecutive_steps_only():
    guard = resume.BadStepGuard(3)
    for ok in (False, False, True, False, False):
        guard.step(ok)
    assert guard.streak == 2 and guard.total == 4
    with pytest.raises(resume.TrainingDiverged, match="3 optimizer steps in a row"):
        guard.step(False)
    never = resume.BadStepGuard(0)
    for _ in range(100):
        never.step(False)
