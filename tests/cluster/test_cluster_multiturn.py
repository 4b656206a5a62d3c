"""Multi-turn rollouts on Ray workers: the in-process run's metrics with one worker (self-play with an
opponent pool included), training with two, a killed worker replaced, and k-step-off pipelining.

One worker plays every episode with the driver's RNG stream, the driver draws the seats and the
pool's opponents and scores, so ``metrics.jsonl`` and ``samples.jsonl`` equal the in-process
run's but for timing fields and the weight sync's sizes. With ``rollout.off_policy_steps: k`` the
workers play iteration i with the weights of version i - min(i, k) and send each turn's behaviour
log-probs with it (taken there, right after the play): one worker equals the pipelined in-process
run (both seed each iteration's rollout from (seed, iteration, shard)), and a run resumed from a
checkpoint with rollouts in flight equals the uninterrupted one.
"""

from __future__ import annotations

import json
import shutil

import pytest
from cluster_helpers import DIST_ONLY, assert_rows_equal, kill_first_worker_after, run

from ppokit.config import build_config, parse_overrides
from ppokit.persistence.checkpoint import load_checkpoint
from ppokit.persistence.rundir import periodic_checkpoint_path, read_metrics
from ppokit.workloads import train

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


@pytest.mark.parametrize("off_policy", [0, 2])
def test_killed_worker_is_replaced_and_changes_nothing(
    tmp_path, cluster_clean, tiny_model_dir, monkeypatch, off_policy
):
    """FrozenLake on one worker, killed with SIGKILL after the first iteration: the new worker plays the
    lost part again (with k = 2 every request in flight, each after the weights it was sent after,
    its behaviour log-probs taken with them), and the run equals the in-process run."""
    run_dir = tmp_path / "killed"
    common = (f"rollout.off_policy_steps={off_policy}", f"train.iterations={3 + off_policy}")  # k: requests after it
    killer, killed = kill_first_worker_after(monkeypatch, cluster_clean, run_dir, rows=1, timeout=300)
    rows = run(textenv_cfg(tiny_model_dir, LAKE, *common, "cluster.rollout_workers=1"), run_dir)
    killer.join(timeout=60)
    assert killed, "the worker was not killed"
    assert rows[-1]["worker_restarts"] == 1.0
    local = run(textenv_cfg(tiny_model_dir, LAKE, *common), tmp_path / "local")
    assert_rows_equal(rows, local, extra=DIST_ONLY | {"worker_restarts"})


# ----------------------------------------------------------------------------- k steps off
K = 2


def test_self_play_k_steps_off_on_one_worker_equals_in_process_and_resumes_exactly(
    tmp_path, cluster_clean, tiny_model_dir
):
    """Tic-tac-toe self-play against the pool, two rollouts in flight on the worker: iteration i is
    played with version i - min(i, k) (the pool's snapshots reach the worker with the requests), and
    its old_log_prob are the behaviour log-probs the worker took with those weights: every row and
    sample equals the pipelined in-process run's (whose old_log_prob are the scorer's on the weights
    that played, tests/lm/test_multiturn_off_policy.py). Resumed from the checkpoint after iteration
    2 (k rollouts in flight), the run equals the uninterrupted one: its first weight sync (the weights
    it resumed with) takes no snapshot, so the pool is the same."""
    common = (f"rollout.off_policy_steps={K}", "train.iterations=5", "run.checkpoint_every=2")
    local = run(textenv_cfg(tiny_model_dir, SELF_PLAY, *common), tmp_path / "local")
    cfg = textenv_cfg(tiny_model_dir, SELF_PLAY, *common, "cluster.rollout_workers=1")
    remote = run(cfg, tmp_path / "remote")
    assert [r["policy_version"] for r in remote] == [i - min(i, K) for i in range(5)]
    assert [r["staleness"] for r in remote] == [min(i, K) for i in range(5)]
    assert remote[0]["off_policy_kl"] == 0.0 and all(r["off_policy_kl"] > 0 for r in remote[1:])
    assert all("time_behaviour_log_prob" in r for r in remote)  # taken on the worker: no actor pass here
    assert_rows_equal(remote, local, extra=DIST_ONLY)
    assert samples(tmp_path / "remote") == samples(tmp_path / "local")
    assert sum(r["selfplay/vs_pool_episodes"] for r in remote) > 0
    # the pinned start, the first sync's, one per update before the iteration's opponents were drawn
    assert [r["selfplay/pool_size"] for r in remote] == [2 + i - min(i, K) for i in range(5)]
    shutil.copytree(tmp_path / "remote", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint")
    train(cfg, tmp_path / "resumed", resume_from=periodic_checkpoint_path(tmp_path / "resumed", 2))
    assert_rows_equal(read_metrics(tmp_path / "resumed"), remote, extra=DIST_ONLY)


def test_k_steps_off_on_two_workers_resumes_exactly(tmp_path, cluster_clean, tiny_model_dir):
    """FrozenLake on two workers, two rollouts in flight: the lag is min(i, k), the checkpoint after
    iteration 2 holds the k rollouts in flight (``pending``), and the run resumed from it equals
    the uninterrupted one, bit for bit."""
    common = (f"rollout.off_policy_steps={K}", "train.iterations=5", "run.checkpoint_every=2")
    cfg = textenv_cfg(tiny_model_dir, LAKE, *common, "cluster.rollout_workers=2")
    whole = run(cfg, tmp_path / "whole")
    assert [r["staleness"] for r in whole] == [min(i, K) for i in range(5)]
    assert [r["policy_version"] for r in whole] == [i - min(i, K) for i in range(5)]
    pending = load_checkpoint(periodic_checkpoint_path(tmp_path / "whole", 2)).parts["source"]["pending"]
    assert pending["iteration"] == 2 and len(pending["batches"]) == K
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint")
    train(cfg, tmp_path / "resumed", resume_from=periodic_checkpoint_path(tmp_path / "resumed", 2))
    assert_rows_equal(read_metrics(tmp_path / "resumed"), whole, extra=DIST_ONLY)
    assert samples(tmp_path / "resumed") == samples(tmp_path / "whole")


def test_self_play_against_the_pool_resumes_exactly(tmp_path, cluster_clean, tiny_model_dir):
    """Self-play against the pool in one process, resumed from the checkpoint after iteration 2: the
    resumed run's first weight sync (the weights it resumed with) takes no snapshot, so the pool and
    every row equal the uninterrupted run's (on a worker with k rollouts in flight: above)."""
    cfg = textenv_cfg(tiny_model_dir, SELF_PLAY, "train.iterations=5", "run.checkpoint_every=2")
    whole = run(cfg, tmp_path / "whole")
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint")
    train(cfg, tmp_path / "resumed", resume_from=periodic_checkpoint_path(tmp_path / "resumed", 2))
    assert_rows_equal(read_metrics(tmp_path / "resumed"), whole, extra=DIST_ONLY)
    # the pinned start, the first sync's, one per update before the iteration's opponents were drawn
    assert [r["selfplay/pool_size"] for r in whole] == [2 + i for i in range(5)]
