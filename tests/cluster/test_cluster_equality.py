"""One Ray rollout worker gives the in-process run's metrics, bit for bit.

The worker holds the same shard source (all E envs / generation for all prompts) and
the driver's RNG stream travels with each request, so every sampled action or token is
the one the in-process run draws: ``metrics.jsonl`` (and ``samples.jsonl``) must be
equal but for wall-clock fields and the rows' ``sync_bytes``. With
``rollout.off_policy_steps=1`` the same holds between the pipelined in-process run and
the pipelined worker run (rollouts seeded per iteration in both).
"""

from __future__ import annotations

import json
import shutil

import pytest
from cluster_helpers import DIST_ONLY, arith_cfg, assert_rows_equal, cartpole_cfg, run

from ppokit.persistence.rundir import periodic_checkpoint_path, read_metrics
from ppokit.workloads import train


def samples(run_dir):
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("off_policy", [0, 1])
def test_cartpole_one_worker_equals_in_process(tmp_path, cluster_clean, off_policy):
    local = run(cartpole_cfg(f"rollout.off_policy_steps={off_policy}"), tmp_path / "local")
    remote = run(
        cartpole_cfg(f"rollout.off_policy_steps={off_policy}", "cluster.rollout_workers=1"), tmp_path / "remote"
    )
    assert len(local) == 5
    assert_rows_equal(remote, local, extra=DIST_ONLY)
    assert all(r["sync_bytes"] > 0 for r in remote)
    if off_policy:
        assert [r["staleness"] for r in remote] == [0, 1, 1, 1, 1]


@pytest.mark.parametrize("off_policy", [0, 1])
def test_arith_one_worker_equals_in_process(tmp_path, cluster_clean, tiny_model_dir, digits_reward, off_policy):
    """One step off, the worker run's checkpoint after iteration 2 (the rollout in flight in it) also
    resumes in one process as the run it came from (two steps off: tests/cluster/test_cluster_pipelining.py)."""
    common = (f"rollout.off_policy_steps={off_policy}", "run.checkpoint_every=2")
    local = run(arith_cfg(tiny_model_dir, digits_reward, *common), tmp_path / "local")
    remote = run(arith_cfg(tiny_model_dir, digits_reward, *common, "cluster.rollout_workers=1"), tmp_path / "remote")
    assert all(r["grad_norm/actor"] > 0 for r in local)  # the runs learn something to compare
    assert_rows_equal(remote, local, extra=DIST_ONLY)
    assert samples(tmp_path / "remote") == samples(tmp_path / "local")
    # lora: only the actor adapter travels (rank-8 A and B of every linear layer, fp32)
    assert remote[0]["sync_bytes"] < 0.5 * sum(p.stat().st_size for p in tiny_model_dir.glob("*.safetensors"))
    if off_policy:
        assert remote[0]["old_log_prob_gap"] == 0.0  # sampled by the weights it is updated from
        assert all(r["old_log_prob_gap"] > 0 for r in remote[1:])  # one update behind
        assert [r["staleness"] for r in remote] == [0, 1, 1, 1]
        resumed = tmp_path / "resumed"
        shutil.copytree(tmp_path / "remote", resumed)
        shutil.rmtree(resumed / "checkpoint")
        train(
            arith_cfg(tiny_model_dir, digits_reward, *common), resumed, resume_from=periodic_checkpoint_path(resumed, 2)
        )
        assert_rows_equal(remote, read_metrics(resumed), extra=DIST_ONLY)


@pytest.mark.slow
def test_arith_two_workers_answer_every_prompt_once(tmp_path, cluster_clean, tiny_model_dir, digits_reward):
    """Two workers, 8 prompts each: the merged batches hold all 16 prompts of each iteration
    (drawn by the driver as in-process) in order; the run trains and logs as one batch."""
    cfg = arith_cfg(
        tiny_model_dir,
        digits_reward,
        "cluster.rollout_workers=2",
        "train.iterations=2",
        "run.log_samples=32",
        "algo.group_size=2",
        "algo.adv_estimator=grpo",
    )
    rows = run(cfg, tmp_path / "w2")
    assert [r["samples"] for r in rows] == [32, 64]
    logged = samples(tmp_path / "w2")
    local_cfg = arith_cfg(
        tiny_model_dir,
        digits_reward,
        "train.iterations=2",
        "run.log_samples=32",
        "algo.group_size=2",
        "algo.adv_estimator=grpo",
    )
    local = run(local_cfg, tmp_path / "local")
    local_logged = samples(tmp_path / "local")
    for it in (0, 1):
        got = [s["prompt"] for s in logged if s["iteration"] == it]
        want = [s["prompt"] for s in local_logged if s["iteration"] == it]
        assert got == want and len(got) == 32  # the same prompts, in the same order
        rewards = [s["reward"] for s in logged if s["iteration"] == it]
        assert abs(rows[it]["reward_mean"] - sum(rewards) / 32) < 1e-6
    assert all(r["grad_norm/actor"] > 0 for r in rows) and len(local) == 2
