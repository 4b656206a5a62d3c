"""Multi-turn episodes played k iterations ahead of their update (``rollout.off_policy_steps: k``).

In the training process the episodes of iterations ``it+1 .. it+k`` are played right after those
of ``it``, with the weights of that moment (version ``it``), and queued; their behaviour
log-probs are the scorer's on those weights. The queue is part of the checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from resume_helpers import LM_TIMING_KEYS, assert_same_metrics, copy_without_final_checkpoint, read_rows
from test_multiturn_source import build, mt_config

from ppokit.lm.multi_turn.shards import MultiTurnShard, MultiTurnShardPlan
from ppokit.persistence.checkpoint import load_checkpoint
from ppokit.persistence.resume import rollout_rngs
from ppokit.workloads import train

pytestmark = pytest.mark.filterwarnings("ignore:Seems like .optimizer.step:UserWarning")
ITERATIONS = 5
K = 2


def off_policy_config(tiny_dir, tmp_path, **sections):
    return mt_config(
        tiny_dir,
        tmp_path,
        rollout={"max_new_tokens": 3, "temperature": 1.0, "off_policy_steps": K},
        train={"iterations": ITERATIONS, "epochs": 2},
        run={"name": "run", "checkpoint_every": 1, "keep_checkpoints": 8},
        **sections,
    )


@pytest.fixture(scope="module")
def finished(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offpolicy")
    cfg = off_policy_config(tiny_dir, tmp)
    train(cfg, tmp / "run")
    return tmp / "run"


def test_each_iteration_trains_on_episodes_played_min_it_k_versions_earlier(finished):
    rows = read_rows(finished)
    assert [r["staleness"] for r in rows] == [min(i, K) for i in range(ITERATIONS)]
    assert [r["policy_version"] for r in rows] == [i - min(i, K) for i in range(ITERATIONS)]
    # the behaviour log-probs came with the batch (the scorer ran no actor pass), and the lag is measured
    assert all("time_behaviour_log_prob" in r and "off_policy_kl" in r for r in rows)
    assert rows[0]["off_policy_kl"] == 0.0 and rows[-1]["off_policy_kl"] > 0.0


def test_queued_episodes_carry_the_behaviour_log_probs_of_the_weights_that_played_them(tiny_dir, tmp_path):
    cfg = off_policy_config(tiny_dir, tmp_path)
    c = build(cfg, tmp_path)
    batch = c.source.collect(0)
    c.source.prefetch(1)
    ahead = c.source.queue.batches[1]
    for b in (batch, ahead):  # the scorer's own numerics on these weights
        t = b.tensors
        with torch.no_grad():
            want = c.learner.policy.log_probs(
                {k: t[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
            )
        torch.testing.assert_close(t["old_log_prob"], want["log_prob"].float() * t["mask"])
        assert b.policy_version == 0
    assert c.source.collect(1) is ahead and 1 not in c.source.queue


def test_a_multi_turn_run_k_steps_off_resumes_exactly(finished, tiny_dir, tmp_path):
    """Resumed from the checkpoint after two iterations (the episodes of the next K iterations
    queued in it): the same rows as the uninterrupted run, bit for bit."""
    run = copy_without_final_checkpoint(finished, tmp_path / "run")
    checkpoint = run / "checkpoints" / "iter-000002"
    assert len(load_checkpoint(checkpoint).parts["source"]["pending"]["batches"]) == K
    train(off_policy_config(tiny_dir, tmp_path), run, resume_from=checkpoint)
    rows = read_rows(finished)
    timing = {k for k in LM_TIMING_KEYS | {"time_behaviour_log_prob", "time_env"} if k in rows[0]} | {"wall_time"}
    assert_same_metrics(read_rows(run), rows, ITERATIONS, timing)


@pytest.mark.parametrize(
    "textenv",
    [
        {},  # state mode: a row per turn
        {"kwargs": {"observation_mode": "message"}},  # a row per trajectory, observations between the turns
        {"env": "tictactoe", "kwargs": {"opponent": "self"}, "max_turns": 9},  # both seats trained
    ],
)
def test_a_workers_turns_carry_the_behaviour_log_probs_of_the_weights_that_played_them(tiny_dir, tmp_path, textenv):
    """What a Ray worker does (``MultiTurnShard.collect_shard``), here in one process over two shares of
    the episodes: each turn gets its action tokens' log-probs under the weights that played it right
    after the play, and the driver's batch of the merged shares carries them as ``old_log_prob``
    (rows aligned, 0 off the action tokens), so the scorer runs no actor pass with newer weights."""
    cfg = off_policy_config(tiny_dir, tmp_path, textenv=textenv)
    c = build(cfg, tmp_path)
    shard = MultiTurnShard(
        c.source.player, c.learner.policy, cfg=cfg, mode=c.source.mode, pad_id=c.source.pad_id, device="cpu"
    )
    plan = MultiTurnShardPlan(c.source, 2)
    with rollout_rngs(cfg.seed, 0):
        parts = [shard.collect_shard(0, request) for request in plan.requests(0)]
    assert all(turn.behaviour_log_probs is not None for p in parts for t in p[0].trajectories for turn in t.turns)
    batch = plan.merge(0, parts, [{}, {}])
    t = batch.tensors
    assert "time_behaviour_log_prob" in batch.metrics and t["old_log_prob"].shape == t["mask"].shape
    with torch.no_grad():
        want = c.learner.policy.log_probs(
            {k: t[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")}
        )
    torch.testing.assert_close(t["old_log_prob"], want["log_prob"].float() * t["mask"])
    assert (t["old_log_prob"][t["mask"] == 0] == 0).all() and (t["old_log_prob"][t["mask"] == 1] < 0).all()
