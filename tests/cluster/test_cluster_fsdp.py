"""FSDP learners (``cluster.sharding=fsdp``): two gloo ranks holding half of the policy each take
the single learner's step, and hold about half of its memory.

The same LM batch and shuffle as ``test_cluster_learners.py``: ``train.mini_batch_size=8`` split
4 + 4 over two Ray ranks, each in micro-batches of 2 (or by a token budget, which gives the
ranks different numbers of micro-batches). The gradient of the first optimizer step,
gathered from the shards, must equal one learner's to 1e-6 for every ``loss_agg_mode``, in
lora and full mode; one whole update must log the same gradient norms (actor and critic,
clipped apart); each rank's parameter, gradient and Adam bytes, read from its local shards,
must be at most 0.55x what a replicating (ddp) learner holds.
"""

from __future__ import annotations

import pytest
from cluster_helpers import arith_cfg
from test_cluster_learners import AGG_MODES, random_lm_batch

from ppokit.cluster.fsdp import local_bytes
from ppokit.components import Batch
from ppokit.lm.single_turn.workload import LMWorkload
from ppokit.trainer import SingleProcess

CASES = [("lora", mode, None) for mode in AGG_MODES] + [
    ("full", "token-mean", None),
    ("full", "seq-mean-token-sum", 16),
]


def workload(model_dir, reward, mode: str, agg: str, budget: int | None) -> LMWorkload:
    extra = [f"train.micro_batch_tokens={budget}"] if budget else []
    cfg = arith_cfg(
        model_dir,
        reward,
        f"model.mode={mode}",
        f"algo.loss_agg_mode={agg}",
        "cluster.learners=2",
        "cluster.sharding=fsdp",
        "train.batch_size=16",
        "train.mini_batch_size=8",
        "train.micro_batch_size=2",
        "train.grad_clip=0.05",
        "algo.entropy_coeff=0.01",
        *extra,
    )
    w = LMWorkload(cfg)
    w.model_path = model_dir
    return w


@pytest.fixture(scope="module")
def fsdp_group(ray_cluster, tiny_model_dir, digits_reward):
    """Two FSDP learner ranks on the session's Ray, rebuilt per case; closed at the end."""
    from ppokit.cluster.learner_group import LearnerGroup
    from ppokit.cluster.ray_cluster import Cluster

    first = workload(tiny_model_dir, digits_reward, *CASES[0])
    cluster = Cluster(first.cfg, rollout_workers=0, learners=2)
    try:
        yield LearnerGroup.start(cluster, first, first.learner_replica(SingleProcess()), 2)
    finally:
        cluster.close()


def rebuild(group, ray, w: LMWorkload) -> None:
    group.local = w.learner_replica(SingleProcess())
    ray.get([r.rebuild.remote(w) for r in group.ranks])
    group.sync_ranks()


@pytest.mark.parametrize("mode, agg, budget", CASES)
def test_fsdp_learners_take_the_single_learner_gradient(
    fsdp_group, ray_cluster, tiny_model_dir, digits_reward, mode, agg, budget
):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    batch = random_lm_batch(16, 3, 5, vocab)
    rebuild(fsdp_group, ray_cluster, workload(tiny_model_dir, digits_reward, mode, agg, budget))
    together = fsdp_group.gradients(batch)
    alone = fsdp_group.local.trainer.mini_batch_gradients(batch)
    assert together.keys() == alone.keys() and len(alone) > 4
    assert any(g.abs().max() > 1e-3 for g in alone.values())  # a gradient worth comparing
    worst = max((together[k] - alone[k]).abs().max().item() for k in alone)
    assert worst <= 1e-6, f"{mode} {agg} budget={budget}: max abs gradient difference {worst:.3g}"
    if agg == "token-mean":
        check_memory(fsdp_group, batch, mode)
    if budget is None:
        return
    # a whole update (two epochs of two mini-batches): the logged gradient norms are the one learner's
    # (the local learner first: the group's update copies the ranks' new weights into it)
    local_metrics = fsdp_group.local.trainer.update(dict(batch), 0)
    group_metrics = fsdp_group.update(Batch(tensors=dict(batch)), 0)
    # (not compared: padding_frac and the rates, approx_kl and clipfrac, which are means per micro-batch
    # weighted by its share, and each rank packs its own rows into token budgets)
    for key in ("grad_norm/actor", "grad_norm/critic", "policy_loss", "value_loss", "entropy"):
        assert group_metrics[key] == pytest.approx(local_metrics[key], rel=1e-6, abs=1e-9), key


def check_memory(group, batch, mode: str) -> None:
    """After one update (the Adam moments exist): each rank's parameter, gradient and optimizer bytes,
    read from its local shards, are at most 0.55x what the in-process (ddp) learner holds."""
    local = group.local
    local.trainer.update(dict(batch), 0)
    whole = local_bytes(local.policy, local.trainer.optimizer)
    whole["grads"] = sum(g.numel() * g.element_size() for g in local.trainer.mini_batch_gradients(batch).values())
    group.update(Batch(tensors=dict(batch)), 0)
    for rank, shard in enumerate(group.memory(batch)):
        for part in ("params", "grads", "optimizer"):
            assert whole[part] > 0
            ratio = shard[part] / whole[part]
            assert ratio <= 0.55, f"{mode} rank {rank}: {part} {shard[part]} bytes, {ratio:.3f} of one learner's"
        total = sum(shard[p] for p in ("params", "grads", "optimizer"))
        print(f"{mode} rank {rank}: {total} of {sum(whole[p] for p in ('params', 'grads', 'optimizer'))} bytes")


def test_one_fsdp_learner_check_runs_on_the_cpu():
    """``bench/fsdp_check.py --smoke``: a one-rank group (the GPU check's FSDP step, on gloo), without and
    with CPU offload: updates with finite gradient norms, whole weights gathered equal to the shards,
    the Adam moments written and read back with DCP's safetensors storage."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from resume_helpers import subprocess_env

    script = Path(__file__).resolve().parents[2] / "bench" / "fsdp_check.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--updates", "1"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("FSDP_CHECK_RESULT ")][-1]
    result = json.loads(line.split(" ", 1)[1])
    assert result["ok"] and [r["offload"] for r in result["learners"]] == [False, True]


def test_fsdp_in_bf16_agrees_with_the_unsharded_learner_within_bf16_tolerance():
    """``--smoke --bf16``: FSDP's bf16 parameters against the unsharded learner's bf16 autocast are
    not bit-identical (on the GPU they differed by 8% in a token fraction and 27% in the weights'
    relative change), but their continuous metrics agree within 5% and the first update points the
    same way (measured here: 4.3e-4 after one update, 4.7e-2 by the third; cosine 0.995)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from resume_helpers import subprocess_env

    script = Path(__file__).resolve().parents[2] / "bench" / "fsdp_check.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--bf16", "--updates", "1"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=600,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("FSDP_CHECK_RESULT ")][-1]
    against = json.loads(line.split(" ", 1)[1])["against_ddp"]
    assert proc.returncode == 0 and against["ok"], against
    assert against["ddp_max_rel_metric"] > 0  # bf16 on both sides, but not the same numerics
    assert against["ddp_first_update_cosine"] >= 0.99
