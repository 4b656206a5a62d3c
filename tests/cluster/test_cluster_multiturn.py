"""Multi-turn rollouts on Ray workers: the in-process run's metrics with one worker (self-play with an
opponent pool included), training with two, and a killed worker replaced.

One worker plays every episode with the driver's RNG stream, the driver draws the seats and the
pool's opponents and scores, so ``metrics.jsonl`` and ``samples.jsonl`` equal the in-process
run's but for timing fields and the weight sync's sizes.
"""

from __future__ import annotations

import json

import pytest
from cluster_helpers import DIST_ONLY, assert_rows_equal, kill_first_worker_after, run

from ppokit.config import build_config, parse_overrides

pytestmark = pytest.mark.slow


def textenv_cfg(model_dir, env: dict, *overrides: str):
    base = {
        "workload": "lm",
        "seed": 3,
        "model": {"path": str(model_dir), "lora_rank": 4, "lora_alpha": 8},
        "textenv": {"eval_episodes": 4, "eval_every": 2, **env},
        "rollout": {"max_new_tokens": 2, "temperature": 1.0},
        "train": {
            "batch_size": 8,
            "mini_batch_size": 4,
            "micro_batch_size": 16,
            "infer_micro_batch_size": 16,
            "epochs": 1,
            "iterations": 3,
            "learning_rate": 3e-3,
        },
        "algo": {"gamma": 1.0, "gae_lambda": 1.0, "credit": "turn"},
        "run": {
            "precision": "fp32",
            "torch_threads": 1,
            "progress": False,
            "tensorboard": False,
            "log_samples": 2,
            "samples_every": 1,
        },
    }
    return build_config([base, parse_overrides(list(overrides))])


SELF_PLAY = {
    "env": "tictactoe",
    "kwargs": {"opponent": "self"},
    "max_turns": 9,
    "pool": {"snapshot_every": 1, "current_prob": 0.25},
}
LAKE = {"env": "frozenlake", "kwargs": {"desc": ["SFFG", "HHHH"], "max_steps": 6, "letters": True}, "max_turns": 6}


def samples(run_dir):
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_self_play_on_one_worker_equals_in_process(tmp_path, cluster_clean, tiny_model_dir):
    """Tic-tac-toe self-play against a pool of past adapters (FrozenLake: the killed-worker test)."""
    local = run(textenv_cfg(tiny_model_dir, SELF_PLAY), tmp_path / "local")
    remote = run(textenv_cfg(tiny_model_dir, SELF_PLAY, "cluster.rollout_workers=1"), tmp_path / "remote")
    assert len(local) == 3 and all(r["grad_norm/actor"] > 0 for r in local)
    assert_rows_equal(remote, local, extra=DIST_ONLY)
    assert samples(tmp_path / "remote") == samples(tmp_path / "local")
    # the pool's snapshots reached the worker and were played against
    assert local[-1]["selfplay/pool_size"] == 4 and sum(r["selfplay/vs_pool_episodes"] for r in remote) > 0


def test_two_workers_and_two_fsdp_learners_train(tmp_path, cluster_clean, tiny_model_dir):
    """Self-play on two rollout workers (4 episodes each) and two FSDP learner ranks, in a 2-CPU Ray
    (colocated): the driver merges the parts in episode order, every episode is counted once."""
    rows = run(
        textenv_cfg(
            tiny_model_dir,
            SELF_PLAY,
            "cluster.rollout_workers=2",
            "cluster.learners=2",
            "cluster.sharding=fsdp",
            "cluster.placement=colocated",
        ),
        tmp_path / "w2",
    )
    assert len(rows) == 3
    assert all(r["grad_norm/actor"] > 0 and r["grad_norm/critic"] > 0 for r in rows)
    for r in rows:  # each of the 8 episodes of an iteration, once
        assert r["selfplay/vs_pool_episodes"] + r["selfplay/vs_current_episodes"] == 8
    assert rows[-1]["selfplay/pool_size"] == 4  # the pinned start and one per weight sync


def test_killed_worker_is_replaced_and_changes_nothing(tmp_path, cluster_clean, tiny_model_dir, monkeypatch):
    """FrozenLake on one worker, killed with SIGKILL after the first iteration: the new worker plays the
    lost part again, and the run equals the in-process run."""
    run_dir = tmp_path / "killed"
    killer, killed = kill_first_worker_after(monkeypatch, cluster_clean, run_dir, rows=1, timeout=300)
    rows = run(textenv_cfg(tiny_model_dir, LAKE, "cluster.rollout_workers=1"), run_dir)
    killer.join(timeout=60)
    assert killed, "the worker was not killed"
    assert rows[-1]["worker_restarts"] == 1.0
    local = run(textenv_cfg(tiny_model_dir, LAKE), tmp_path / "local")
    assert_rows_equal(rows, local, extra=DIST_ONLY | {"worker_restarts"})
