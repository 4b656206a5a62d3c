"""Failures are handled, not hung: a killed rollout worker, a placement the cluster cannot
satisfy, Ray not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from cluster_helpers import DIST_ONLY, assert_rows_equal, cartpole_cfg, kill_first_worker_after, run

from ppokit.errors import UserError


@pytest.mark.parametrize("off_policy", [0, 1, 2])
def test_killed_worker_is_replaced_and_changes_nothing(tmp_path, cluster_clean, monkeypatch, off_policy):
    """SIGKILL on the worker's process after two iterations: a new worker gets the shard's
    last state and the lost request's weights, generates the part again (with two steps
    off, the later request in flight too, after its own weights), and the run equals one
    that never lost a worker."""
    run_dir = tmp_path / "killed"
    overrides = ("train.iterations=8", f"rollout.off_policy_steps={off_policy}")
    killer, killed = kill_first_worker_after(monkeypatch, cluster_clean, run_dir, rows=2, timeout=120)
    rows = run(cartpole_cfg(*overrides, "cluster.rollout_workers=1"), run_dir)
    killer.join(timeout=60)
    assert killed, "the worker was not killed"
    assert len(rows) == 8 and rows[-1]["worker_restarts"] == 1.0
    local = run(cartpole_cfg(*overrides), tmp_path / "local")
    assert_rows_equal(rows, local, extra=DIST_ONLY | {"worker_restarts"})


def test_a_worker_that_dies_on_every_try_stops_the_run(cluster_clean, monkeypatch):
    """A part whose worker process dies each time (a crash the part causes) is tried
    MAX_RESTARTS more times on new workers, then a one-line error, not an endless loop."""
    from ppokit.cluster import rollout_workers
    from ppokit.cluster.rollout_workers import RemoteSource

    MAX_RESTARTS = 1  # each try starts a worker process: keep the test short
    monkeypatch.setattr(rollout_workers, "MAX_RESTARTS", MAX_RESTARTS)

    class Dying:  # defined here: Ray ships it by value
        def collect(self, iteration, request, rng):

            os._exit(1)

        def set_weights(self, weights, version):
            return 0.0

        def load_state(self, state):
            return []

    class Plan:
        steps_per_iteration = None

        def requests(self, iteration):
            return [None]

    started = []

    def start(shard):
        actor = cluster_clean.remote(Dying).options(num_cpus=0, max_restarts=0).remote()
        started.append(actor)
        return actor

    source = RemoteSource(cartpole_cfg(), Plan(), start, 1, forget_worker=cluster_clean.kill)
    try:
        with pytest.raises(UserError) as info:
            source.collect(0)
    finally:
        for actor in started:
            cluster_clean.kill(actor)
    assert f"rollout worker 0 died {MAX_RESTARTS + 1} times in a row on iteration 0" in str(info.value)
    assert len(started) == MAX_RESTARTS + 1 and "\n" not in str(info.value)


def test_actors_run_at_the_drivers_priority(cluster_clean, monkeypatch):
    """Ray's default niceness for worker processes (15) would starve the rollout workers on a
    CPU shared with the driver; the run's actors get niceness 0. A Ray that ppokit starts
    (``start_local_ray``, as this session's) starts every worker at 0, so actors need no
    ``runtime_env`` and Ray's idle workers serve them; on a Ray started elsewhere each actor asks
    for 0 in its ``runtime_env``, which sets its worker's niceness."""
    from ppokit.cluster import ray_cluster

    class Probe:  # defined here: Ray ships it by value
        def niceness(self):

            return os.nice(0)

    cluster = ray_cluster.Cluster(cartpole_cfg("cluster.rollout_workers=1"), rollout_workers=1, learners=0)
    started = []
    try:
        assert "runtime_env" not in cluster.actor_options("rollout", 0)
        probe = cluster.start_actor(Probe, "rollout", 0)
        assert cluster_clean.get(probe.niceness.remote()) == 0
        started.append(cluster_clean.remote(Probe).options(num_cpus=0).remote())  # any worker of this Ray
        assert cluster_clean.get(started[-1].niceness.remote()) == 0

        monkeypatch.setattr(ray_cluster, "_job_at_driver_priority", None)  # as if Ray were started elsewhere
        assert cluster.actor_options("rollout", 0)["runtime_env"] == {"env_vars": ray_cluster.ACTOR_ENV}
        lowered = {"env_vars": {"RAY_worker_niceness": "15"}}  # the option's effect, shown the other way
        started.append(cluster_clean.remote(Probe).options(num_cpus=0, runtime_env=lowered).remote())
        assert cluster_clean.get(started[-1].niceness.remote()) == 15
    finally:
        for actor in started:
            cluster_clean.kill(actor)
        cluster.close()


@pytest.mark.parametrize(
    "override, missing", [("cluster.gpus_per_worker=1", "GPU 1 more"), ("cluster.cpus_per_worker=3", "CPU 1 more")]
)
def test_unsatisfiable_placement_fails_within_the_bound(tmp_path, cluster_clean, override, missing):
    cfg = cartpole_cfg("cluster.rollout_workers=1", "cluster.placement_timeout=2", override)
    with pytest.raises(UserError) as info:
        run(cfg, tmp_path / "run")
    message = str(info.value)
    assert "cannot place 1 rollout worker(s)" in message and missing in message
    assert "waited 2 s, cluster.placement_timeout" in message


def test_errors_for_people_raised_in_an_actor_come_out_as_themselves(cluster_clean):
    """A UserError (or TrainingDiverged: the loop adds the last good checkpoint to it) raised
    in an actor is raised as itself, one line, not as Ray's wrapper with the actor's
    traceback; any other exception keeps Ray's wrapper (a bug's traceback)."""
    from ray.exceptions import RayTaskError

    from ppokit.cluster import ray_get
    from ppokit.errors import TrainingDiverged

    class Failing:  # defined here: Ray ships it by value (the test module is not importable there)
        def fail(self, kind: str):
            from ppokit.errors import TrainingDiverged, UserError

            raise {
                "user": UserError("reward function 'f' returned nan"),
                "diverged": TrainingDiverged("training diverged: 10 optimizer steps in a row"),
                "bug": ValueError("a bug"),
            }[kind]

    actor = cluster_clean.remote(Failing).options(num_cpus=0).remote()
    try:
        with pytest.raises(UserError) as info:
            ray_get(actor.fail.remote("user"))
        assert type(info.value) is UserError and str(info.value) == "reward function 'f' returned nan"
        with pytest.raises(TrainingDiverged) as info:
            ray_get([actor.fail.remote("diverged")])
        assert type(info.value) is TrainingDiverged
        with pytest.raises(RayTaskError):
            ray_get(actor.fail.remote("bug"))
    finally:
        cluster_clean.kill(actor)


def test_workers_without_ray_installed_is_a_one_line_error(monkeypatch, capsys, tmp_path):
    from ppokit.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    code = main(["train", "cartpole", "cluster.rollout_workers=1", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and "cluster.rollout_workers=1 needs Ray" in err and "pip install 'ppokit[ray]'" in err
    assert not list(tmp_path.iterdir())  # no run directory was made


def test_cli_and_local_runs_do_not_import_ray(tmp_path):
    """``ppokit --help``, ``ppokit config`` (with workers asked for) and an in-process run."""
    script = tmp_path / "no_ray.py"
    script.write_text(
        "import contextlib, io, sys\n"
        "from ppokit.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    assert main(['config', 'show', 'cartpole', 'cluster.rollout_workers=2']) == 0\n"
        f"    assert main(['train', 'cartpole', 'train.iterations=1', 'env.eval_episodes=0', "
        f"'run.progress=false', '--output-dir', {str(tmp_path / 'runs')!r}]) == 0\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
