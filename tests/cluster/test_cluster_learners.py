"""The learner group: two gloo ranks take the single learner's step; checkpoints do not
depend on the layout.

Gradient equality: the same LM batch, the same shuffle, ``train.mini_batch_size=8``
split 4 + 4 over two Ray ranks (each in micro-batches of 2); the all-reduced gradient of
the first optimizer step must equal one learner's (8 rows in micro-batches of 2) to
1e-6 for every ``loss_agg_mode``: the normaliser is the whole mini-batch's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cluster_helpers import arith_cfg, cartpole_cfg, run

from ppokit.lm.single_turn.workload import LMWorkload
from ppokit.persistence.rundir import periodic_checkpoint_path
from ppokit.trainer import SingleProcess
from ppokit.workloads import train

AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def random_lm_batch(n: int, prompt: int, response: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts, responses of 1..R real tokens, random advantages and returns."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(n, prompt, dtype=torch.long)
    prompt_mask[: n // 2, 0] = 0  # some left padding
    lengths = torch.randint(1, response + 1, (n,), generator=g)
    mask = (torch.arange(response)[None, :] < lengths[:, None]).float()  # (N, R)
    responses = torch.randint(4, vocab, (n, response), generator=g) * mask.long()
    prompts = torch.randint(4, vocab, (n, prompt), generator=g) * prompt_mask
    attention_mask = torch.cat([prompt_mask, mask.long()], 1)  # (N, P + R)
    return {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "responses": responses,
        "mask": mask,
        "old_log_prob": -torch.rand(n, response, generator=g) * 3 * mask,
        "old_values": torch.randn(n, response, generator=g) * mask,
        "advantages": torch.randn(n, response, generator=g) * mask,
        "returns": torch.randn(n, response, generator=g) * mask,
    }


def test_two_learners_take_the_single_learner_gradient(cluster_clean, tiny_model_dir, digits_reward):
    """For each aggregation mode, a replica of that config on the same two ranks (one group)."""
    from transformers import AutoConfig

    from ppokit.cluster.learner_group import LearnerGroup
    from ppokit.cluster.ray_cluster import Cluster

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    batch = random_lm_batch(16, 3, 5, vocab)

    def workload(mode: str) -> LMWorkload:
        cfg = arith_cfg(
            tiny_model_dir,
            digits_reward,
            f"algo.loss_agg_mode={mode}",
            "cluster.learners=2",
            "train.batch_size=16",
            "train.mini_batch_size=8",
            "train.micro_batch_size=2",
        )
        w = LMWorkload(cfg)
        w.model_path = tiny_model_dir
        return w

    first = workload(AGG_MODES[0])
    cluster = Cluster(first.cfg, rollout_workers=0, learners=2)
    try:
        group = LearnerGroup.start(cluster, first, first.learner_replica(SingleProcess()), 2)
        for mode in AGG_MODES:
            w = workload(mode)
            group.local = w.learner_replica(SingleProcess())
            cluster_clean.get([r.rebuild.remote(w) for r in group.ranks])
            group.sync_ranks()
            together = group.gradients(batch)
            alone = group.local.trainer.mini_batch_gradients(batch)
            assert together.keys() == alone.keys() and len(alone) > 4
            assert any(g.abs().max() > 1e-3 for g in alone.values())  # a gradient worth comparing
            worst = max((together[k] - alone[k]).abs().max().item() for k in alone)
            assert worst <= 1e-6, f"{mode}: max abs gradient difference {worst:.3g}"
            print(f"{mode}: max abs gradient difference {worst:.3g}")
    finally:
        cluster.close()


def close_rows(
    got: list[dict],
    want: list[dict],
    keys=("value_loss", "policy_loss", "grad_norm/actor", "grad_norm/critic", "entropy"),
):
    """Rows after a change of layout: the envs' numbers equal, the losses equal to float32 reduction order."""
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    for g, w in zip(got, want):
        assert g["episodes"] == w["episodes"] and g["global_step"] == w["global_step"]
        for key in keys:
            np.testing.assert_allclose(g[key], w[key], rtol=2e-3, atol=1e-6, err_msg=f"{key} at {g['iteration']}")


@pytest.mark.parametrize(
    "first, then", [("cluster.learners=2", "cluster.learners=1"), ("cluster.learners=1", "cluster.learners=2")]
)
def test_checkpoint_moves_between_layouts(tmp_path, cluster_clean, first, then):
    """A two-learner run resumes in-process and the other way round, continuing the same run."""
    import shutil

    common = ("train.iterations=4", "run.checkpoint_every=2")
    whole = run(cartpole_cfg(*common, first), tmp_path / "whole")
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole", resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoint")
    train(cartpole_cfg(*common, then), resumed_dir, resume_from=periodic_checkpoint_path(resumed_dir, 2))
    from ppokit.persistence.rundir import read_metrics

    resumed = read_metrics(resumed_dir)
    assert len(resumed) == 4
    assert resumed[:2] == whole[:2]
    close_rows(resumed[2:], whole[2:])


@pytest.mark.parametrize("first, then", [(2, 0), (0, 2)])
def test_env_shards_move_between_worker_layouts(tmp_path, cluster_clean, capsys, first, then):
    """Two rollout workers' env shards resume in one process and the other way round: the
    envs start new episodes (the vector env's one RNG cannot be split), said in a note;
    the learner's state and the step count continue."""
    import shutil

    from ppokit.persistence.rundir import read_metrics

    common = ("train.iterations=4", "run.checkpoint_every=2")
    whole = run(cartpole_cfg(*common, f"cluster.rollout_workers={first}"), tmp_path / "whole")
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole", resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoint")
    capsys.readouterr()
    train(
        cartpole_cfg(*common, f"cluster.rollout_workers={then}"),
        resumed_dir,
        resume_from=periodic_checkpoint_path(resumed_dir, 2),
    )
    out = capsys.readouterr()
    assert f"stepped in {max(first, 1)} shard(s) and this run steps them in {max(then, 1)}" in out.out + out.err
    resumed = read_metrics(resumed_dir)
    assert resumed[:2] == whole[:2]
    assert [r["global_step"] for r in resumed] == [r["global_step"] for r in whole]
    assert all(r["grad_norm/actor"] > 0 for r in resumed[2:])


def test_colocated_worker_and_learners_follow_the_in_process_run(tmp_path, cluster_clean):
    """One rollout worker and two learner ranks in two shared bundles (colocated placement):
    the envs see the same actions as in-process, the losses agree to float32 summation order."""
    local = run(cartpole_cfg("train.iterations=3"), tmp_path / "local")
    both = run(
        cartpole_cfg(
            "train.iterations=3", "cluster.rollout_workers=1", "cluster.learners=2", "cluster.placement=colocated"
        ),
        tmp_path / "colocated",
    )
    close_rows(both, local)
