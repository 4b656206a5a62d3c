"""Configs and comparisons shared by the scale-out tests."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from ppokit.config import load_config
from ppokit.persistence.rundir import read_metrics
from ppokit.workloads import train

# Wall-clock fields: differ between any two runs.
TIMING_PREFIXES = ("time_", "memory/")  # measurements: they differ between runs
TIMING = {"time", "wall_time", "sps", "gen_tokens_per_s", "score_tokens_per_s", "train_tokens_per_s", "sync_time"}
# What a run with rollout workers adds to each row (beside timing): the weight sync's size.
DIST_ONLY = {"sync_bytes", "sync_bucket_peak", "learner_sync_bucket_peak"}


def is_timing(key: str) -> bool:
    return key in TIMING or key.startswith(TIMING_PREFIXES)


def cartpole_cfg(*overrides: str):
    return load_config(
        "cartpole",
        ["train.iterations=5", "env.eval_episodes=2", "run.progress=false", "run.tensorboard=false", *overrides],
    )


def arith_cfg(model_dir: Path, reward: str, *overrides: str):
    """The arith preset, sized small: the test tiny model, no warm start, a dense reward
    (``reward``), 32 prompts an iteration."""
    return load_config(
        "arith",
        [
            f"model.path={model_dir}",
            f"data.reward={reward}",
            "data.sft_epochs=0",
            "data.eval_size=8",
            "data.eval_every=2",
            "train.iterations=4",
            "train.batch_size=32",
            "train.mini_batch_size=16",
            "train.micro_batch_size=16",
            "train.infer_micro_batch_size=32",
            "rollout.micro_batch_size=32",
            "run.torch_threads=1",
            "run.precision=fp32",
            "run.progress=false",
            "run.tensorboard=false",
            "run.log_samples=2",
            "run.samples_every=1",
            *overrides,
        ],
    )


def run(cfg, run_dir: Path) -> list[dict]:
    train(cfg, run_dir)
    return read_metrics(run_dir)


def assert_rows_equal(got: list[dict], want: list[dict], extra: Iterable[str] = ()) -> None:
    """Row by row the same fields with the same values (floats bit for bit), but for
    timing fields and the ``extra`` fields that either side may have alone."""
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    extra = set(extra)
    for g, w in zip(got, want):
        g_keys = {k for k in g if not is_timing(k)}
        w_keys = {k for k in w if not is_timing(k)}
        assert (g_keys ^ w_keys) <= extra, (g["iteration"], g_keys ^ w_keys)
        w_keys -= extra
        for key in sorted(w_keys):
            assert g[key] == w[key], f"iteration {g['iteration']}: {key} = {g[key]!r}, expected {w[key]!r}"


def kill_first_worker_after(
    monkeypatch, cluster, run_dir: Path, rows: int, timeout: float
) -> tuple[threading.Thread, list]:
    """Record the run's RemoteSource and SIGKILL its first rollout worker's process once ``run_dir``'s
    metrics.jsonl has ``rows`` rows (or after ``timeout`` seconds): the started thread and the killed pids."""
    from ppokit.cluster import rollout_workers

    sources = []
    real_init = rollout_workers.RemoteSource.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        sources.append(self)

    monkeypatch.setattr(rollout_workers.RemoteSource, "__init__", recording_init)
    killed: list[int] = []

    def kill():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(read_metrics(run_dir)) < rows:
            time.sleep(0.01)
        pid = cluster.get(sources[0].workers[0].pid.remote())
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer, killed
