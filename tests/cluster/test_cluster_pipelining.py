"""k-step-off pipelining (``rollout.off_policy_steps`` = k): the ratios, the staleness, exact resume.

A checkpoint taken while the next k rollouts are queued or in flight waits for them and
stores them in order (``pending``) with the shards' states after the last; the resumed
run collects those batches first. Resumed from such a checkpoint the run equals the
uninterrupted one, bit for bit, with the rollouts on a worker or in-process (both seed
each rollout per iteration). The batch of iteration i is sampled by the weights of
version i - min(i, k), on a worker as in-process.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from cluster_helpers import DIST_ONLY, arith_cfg, assert_rows_equal, cartpole_cfg, run

from ppokit.config import load_config
from ppokit.control.networks import ActorCritic
from ppokit.persistence.rundir import periodic_checkpoint_path, read_metrics
from ppokit.trainer import PPOTrainer
from ppokit.workloads import train


def resumed_run(whole_dir, dest, cfg, at: int) -> list[dict]:
    """``whole_dir`` copied as if stopped after its checkpoint at ``at``, resumed with ``cfg``."""
    shutil.copytree(whole_dir, dest)
    shutil.rmtree(dest / "checkpoint")
    train(cfg, dest, resume_from=periodic_checkpoint_path(dest, at))
    return read_metrics(dest)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("first, then", [(1, 0), (0, 1)])
def test_cartpole_pipelined_resume_is_exact(tmp_path, cluster_clean, first, then, k):
    common = (f"rollout.off_policy_steps={k}", "train.iterations=6", "run.checkpoint_every=3")
    whole = run(cartpole_cfg(*common, f"cluster.rollout_workers={first}"), tmp_path / "whole")
    from ppokit.persistence.checkpoint import load_checkpoint

    saved = load_checkpoint(periodic_checkpoint_path(tmp_path / "whole", 3))
    assert saved.parts["source"]["pending"]["iteration"] == 3  # the rollout in flight is in the checkpoint
    assert len(saved.parts["source"]["pending"]["batches"]) == k  # iterations 3 .. 2 + k
    assert [r["staleness"] for r in whole] == [min(i, k) for i in range(6)]
    resumed = resumed_run(
        tmp_path / "whole", tmp_path / "resumed", cartpole_cfg(*common, f"cluster.rollout_workers={then}"), 3
    )
    assert_rows_equal(resumed, whole, extra=DIST_ONLY)


@pytest.mark.parametrize("k", [2, 3])
def test_cartpole_k_steps_off_on_a_worker_equals_in_process(tmp_path, cluster_clean, k):
    """Up to k rollouts in flight on the worker: the same batches, sampled by the same
    versions (i - min(i, k)), as the in-process queue."""
    common = (f"rollout.off_policy_steps={k}", "train.iterations=7")
    local = run(cartpole_cfg(*common), tmp_path / "local")
    remote = run(cartpole_cfg(*common, "cluster.rollout_workers=1"), tmp_path / "remote")
    assert [r["policy_version"] for r in remote] == [i - min(i, k) for i in range(7)]
    assert [r["staleness"] for r in remote] == [min(i, k) for i in range(7)]
    assert_rows_equal(remote, local, extra=DIST_ONLY)


def test_arith_two_steps_off_on_a_worker_equals_in_process_and_resumes_exactly(
    tmp_path, cluster_clean, tiny_model_dir, digits_reward
):
    """Two LM rollouts in flight on the worker: the prompts drawn ahead do not change a batch's
    ``data_epoch`` (the one after its own draw), and every row equals the in-process run's; the
    worker run's checkpoint after iteration 2 (two rollouts in flight) resumes in one process as
    the run it came from."""
    common = ("rollout.off_policy_steps=2", "train.iterations=4", "run.checkpoint_every=2")
    local = run(arith_cfg(tiny_model_dir, digits_reward, *common), tmp_path / "local")
    remote = run(arith_cfg(tiny_model_dir, digits_reward, *common, "cluster.rollout_workers=1"), tmp_path / "remote")
    assert [r["staleness"] for r in remote] == [0, 1, 2, 2]
    assert all(r["off_policy_kl"] > 0 for r in remote[1:])  # sampled by older weights than the update's
    assert_rows_equal(remote, local, extra=DIST_ONLY)
    resumed = resumed_run(
        tmp_path / "remote", tmp_path / "resumed", arith_cfg(tiny_model_dir, digits_reward, *common), 2
    )
    assert_rows_equal(remote, resumed, extra=DIST_ONLY)


# ----------------------------------------------------------------------------- the ratios
def first_step(off_policy: int, shift: float) -> dict[str, float]:
    """One update of one mini-batch whose rollout log-probs are the current ones minus ``shift``."""
    cfg = load_config(
        "cartpole",
        [
            f"rollout.off_policy_steps={off_policy}",
            "train.epochs=1",
            "train.mini_batch_size=64",
            "train.batch_size=64",
            "env.num_envs=2",
            "env.num_steps=32",
            "train.micro_batch_size=16",
            "algo.upper_clip_ratio=10",
            "algo.lower_clip_ratio=0.9",
        ],
    )
    torch.manual_seed(0)
    policy = ActorCritic(4, 2, True, cfg.network)
    obs = torch.randn(64, 1, 4)
    actions = torch.randint(0, 2, (64, 1))
    with torch.no_grad():
        current = policy.evaluate({"obs": obs, "actions": actions})["log_prob"]  # (64, 1)
    mask = torch.ones(64, 1)
    mask[::4] = 0
    batch = {
        "obs": obs,
        "actions": actions,
        "mask": mask,
        "old_log_prob": current - shift,
        "old_values": torch.zeros(64, 1),
        "advantages": torch.randn(64, 1),
        "returns": torch.randn(64, 1),
    }
    return PPOTrainer(cfg, policy, total_iterations=1).update(batch)


def test_off_policy_ratios_use_the_behaviour_log_probs():
    on = first_step(0, 0.1)
    assert on["ratio_max"] == 1.0  # synchronous: the first ratio is exactly 1
    assert on["old_log_prob_gap"] == pytest.approx(0.1, abs=1e-6)
    off = first_step(1, 0.1)
    assert off["ratio_max"] == pytest.approx(math.exp(0.1), rel=1e-5)  # pi / pi_behaviour
    assert off["old_log_prob_gap"] == pytest.approx(0.1, abs=1e-6)
    # k3 estimate of KL(behaviour || current) with log(current / behaviour) = 0.1 on every token
    assert off["off_policy_kl"] == pytest.approx(math.exp(0.1) - 1.1, rel=1e-4)
    assert "off_policy_kl" not in on
