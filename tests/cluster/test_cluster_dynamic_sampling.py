"""rollout.dynamic_sampling with Ray rollout workers: the driver filters each merged
generation batch and sends the workers further requests until the batch is full.

One worker carries the driver's RNG stream, so the run equals the in-process run bit for
bit (more than one generation batch drawn in some iteration); two workers draw their
further batches under their own seeded streams (seed, iteration, shard + draw * DRAW_STREAM).
"""

from __future__ import annotations

import json

import torch
from cluster_helpers import DIST_ONLY, arith_cfg, assert_rows_equal, run

from ppokit.algo.dynamic_sampling import groups_with_variance

DS = (
    "algo.adv_estimator=grpo",
    "algo.group_size=4",
    "rollout.max_new_tokens=2",
    "rollout.dynamic_sampling.enable=true",
    "rollout.dynamic_sampling.max_gen_batches=0",
    "data.stop_at_accuracy=null",
    "train.iterations=3",
)


def digit_reward(tmp_path) -> str:
    """1 when the response starts with a digit: some groups of the untrained model vary."""
    path = tmp_path / "digit.py"
    path.write_text("def digit(prompt, response, **fields):\n    return float(response[:1].isdigit())\n")
    return f"{path}:digit"


def samples(run_dir):
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_one_worker_with_dynamic_sampling_equals_in_process(tmp_path, cluster_clean, tiny_model_dir):
    reward = digit_reward(tmp_path)
    local = run(arith_cfg(tiny_model_dir, reward, *DS), tmp_path / "local")
    remote = run(arith_cfg(tiny_model_dir, reward, *DS, "cluster.rollout_workers=1"), tmp_path / "remote")
    assert any(r["dynamic_sampling/gen_batches"] > 1 for r in local)  # further requests were sent
    assert_rows_equal(remote, local, extra=DIST_ONLY)
    assert samples(tmp_path / "remote") == samples(tmp_path / "local")


def test_two_workers_fill_the_batch_with_groups_that_vary(tmp_path, cluster_clean, tiny_model_dir, trained_batches):
    seen = trained_batches  # the driver's source, in this process
    rows = run(arith_cfg(tiny_model_dir, digit_reward(tmp_path), *DS, "cluster.rollout_workers=2"), tmp_path / "w2")
    assert len(rows) == len(seen) == 3
    assert any(r["dynamic_sampling/gen_batches"] > 1 for r in rows)
    for batch, row in zip(seen, rows):
        assert len(batch) == 32 and row["dynamic_sampling/padded_groups"] == 0
        assert groups_with_variance(batch.tensors["scores"], group_ids=batch.tensors["group_ids"]).all()
        assert torch.bincount(batch.tensors["group_ids"]).tolist() == [4] * 8
