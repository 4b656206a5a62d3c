"""Whole runs on FSDP learners: the in-process run's metrics, checkpoints that move between layouts,
an exact resume after SIGKILL, and ``ppokit export`` of a sharded checkpoint.

A checkpoint of FSDP learners keeps the Adam moments as the ranks' shards
(``learner_shards/``, written with torch.distributed.checkpoint) and the policy's files as
one learner writes them. It resumes on FSDP learners (each reads its slices), on ddp
learners or in one process (the moments read back whole), and an in-process checkpoint
resumes on FSDP learners (each rank takes its slices of the whole moments). Each test
shares its runs between several checks: starting learner ranks is most of the time.
"""

from __future__ import annotations

import json
import shutil
import signal

import numpy as np
import pytest
from cluster_helpers import DIST_ONLY, arith_cfg, assert_rows_equal, cartpole_cfg, run
from resume_helpers import assert_same_state, start_and_wait, train_cmd
from test_cluster_learners import close_rows

from ppokit.persistence.checkpoint import SHARDS_DIR, load_checkpoint
from ppokit.persistence.rundir import latest_checkpoint, periodic_checkpoint_path, read_metrics
from ppokit.workloads import train

pytestmark = pytest.mark.slow

FSDP2 = ("cluster.learners=2", "cluster.sharding=fsdp")
WITH_A_WORKER = ("cluster.rollout_workers=1", "cluster.placement=colocated")
LM_CLOSE = ("reward_mean", "value_loss", "policy_loss", "grad_norm/actor", "grad_norm/critic", "entropy")


def lm_rows_close(got: list[dict], want: list[dict]) -> None:
    """LM rows of two layouts: the same samples' rewards, losses to float32 summation order."""
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    for g, w in zip(got, want):
        for key in LM_CLOSE:
            np.testing.assert_allclose(g[key], w[key], rtol=1e-4, atol=1e-6, err_msg=f"{key} at {g['iteration']}")


def resume_copy(tmp_path, name: str, cfg, iteration: int = 2) -> list[dict]:
    """Run ``name``'s copy resumed from its iteration-``iteration`` checkpoint with ``cfg``; its rows."""
    resumed = tmp_path / f"{name}-resumed"
    shutil.copytree(tmp_path / name, resumed)
    shutil.rmtree(resumed / "checkpoint")
    train(cfg, resumed, resume_from=periodic_checkpoint_path(resumed, iteration))
    return read_metrics(resumed)


def test_cartpole_on_fsdp_learners_and_its_checkpoints_in_other_layouts(tmp_path, cluster_clean):
    """Two FSDP ranks and one rollout worker follow the in-process run; the sharded checkpoint of
    iteration 2 resumes in one process, and the in-process one on two FSDP ranks."""
    common = ("train.iterations=4", "run.checkpoint_every=2")
    local = run(cartpole_cfg(*common), tmp_path / "local")
    sharded = run(cartpole_cfg(*common, *FSDP2, *WITH_A_WORKER), tmp_path / "fsdp")
    close_rows(sharded, local)
    assert all(r["learner_sync_bucket_peak"] > 0 for r in sharded)
    saved = load_checkpoint(periodic_checkpoint_path(tmp_path / "fsdp", 2))
    assert "__sharded__" in saved.parts["learner"]["trainer"]["optimizer"]["state"][0]["exp_avg"]
    assert len(list((saved.path / SHARDS_DIR).glob("*.safetensors"))) == 2  # one file per rank
    for name, then, whole in (("fsdp", (), sharded), ("local", FSDP2, local)):
        resumed = resume_copy(tmp_path, name, cartpole_cfg(*common, *then))
        assert len(resumed) == 4 and resumed[:2] == whole[:2]
        close_rows(resumed[2:], whole[2:])


def test_lm_full_mode_on_fsdp_learners(tmp_path, cluster_clean, tiny_model_dir, digits_reward):
    """6 iterations of full fine-tuning (actor and critic sharded over two ranks) with one rollout worker,
    weights synced in buckets of 0.1 MiB:

    - the in-process run's rewards and losses (to float32 summation order);
    - the same run as ``ppokit train`` (joining the session's Ray), killed with SIGKILL right after
      its fourth metrics row (most likely inside a checkpoint write) and resumed with the same
      layout: every metric of every row bit for bit, and so are the final learner state, the
      shards of the Adam moments and the policy's files;
    - its sharded checkpoint of iteration 4 resumes in one process as the run it came from;
    - ``ppokit export`` writes its actor as a plain Hugging Face model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ppokit.commands.export import export_merged

    common = ("train.iterations=6", "model.mode=full", "run.checkpoint_every=2", "data.eval_every=5")
    sharded_args = (*common, *FSDP2, *WITH_A_WORKER, "cluster.sync_bucket_mb=0.1")
    local = run(arith_cfg(tiny_model_dir, digits_reward, *common), tmp_path / "local")
    sharded = run(arith_cfg(tiny_model_dir, digits_reward, *sharded_args), tmp_path / "fsdp")
    lm_rows_close(sharded, local)
    assert [r.get("eval_accuracy") for r in sharded] == [r.get("eval_accuracy") for r in local]
    row = sharded[-1]
    assert row["sync_bytes"] > 4 * row["sync_bucket_peak"] and row["sync_bucket_peak"] <= 0.1 * 2**20

    cfg = arith_cfg(tiny_model_dir, digits_reward, *sharded_args, "cluster.address=auto")
    config = tmp_path / "killed.yaml"
    config.write_text(json.dumps(cfg.to_dict()))
    run_dir = tmp_path / "runs" / "killed"
    # killed once 4 rows are written: right after the 4th, the checkpoint of iteration 4 is being written
    # (the one of iteration 2 is complete)
    proc = start_and_wait(
        train_cmd(str(config), "--output-dir", str(tmp_path / "runs"), "--name", "killed"), run_dir, 4, timeout=300
    )
    alive = proc.poll() is None
    if alive:
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert alive, f"the run ended before it could be killed: {err[-2000:]}"
    assert latest_checkpoint(run_dir) is not None
    train(cfg, run_dir, resume_from=latest_checkpoint(run_dir))
    assert_rows_equal(read_metrics(run_dir), sharded, extra=DIST_ONLY)
    reference = tmp_path / "fsdp" / "checkpoint"
    a, b = load_checkpoint(run_dir / "checkpoint"), load_checkpoint(reference)
    assert_same_state(a.parts["learner"], b.parts["learner"], "learner")
    files = [p.relative_to(reference) for p in reference.rglob("*.safetensors")]
    assert len([f for f in files if f.parts[0] == SHARDS_DIR]) == 2  # one file per rank
    for name in files:
        mine, theirs = load_file(str(run_dir / "checkpoint" / name)), load_file(str(reference / name))
        assert mine.keys() == theirs.keys() and all((mine[k] == theirs[k]).all() for k in theirs), name

    resumed = resume_copy(tmp_path, "fsdp", arith_cfg(tiny_model_dir, digits_reward, *common), iteration=4)
    assert resumed[:4] == sharded[:4]
    lm_rows_close(resumed[4:], sharded[4:])
    exported = AutoModelForCausalLM.from_pretrained(export_merged(tmp_path / "fsdp", tmp_path / "export"))
    want = AutoModelForCausalLM.from_pretrained(export_merged(tmp_path / "local", tmp_path / "export-local"))
    worst = max((a - b).abs().max().item() for a, b in zip(exported.parameters(), want.parameters()))
    assert worst < 1e-4
