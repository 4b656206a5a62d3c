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

import pytest

from dist_helpers import DIST_ONLY, arith_cfg, assert_rows_equal, cartpole_cfg, run


def samples(run_dir):
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("off_policy", [0, 1])
def test_cartpole_one_worker_equals_in_process(tmp_path, cluster_clean, off_policy):
    local = run(cartpole_cfg(f"rollout.off_policy_steps={off_policy}"), tmp_path / "local")
    remote = run(cartpole_cfg(f"rollout.off_policy_steps={off_policy}", "cluster.rollout_workers=1"),
                 tmp_path / "remote")
    assert len(local) == 5
    assert_rows_equal(remote, local, extra=DIST_ONLY)
    assert all(r["sync_bytes"] > 0 for r in remote)
    if off_policy:
        assert [r["staleness"] for r in remote] == [0, 1, 1, 1, 1]


@pytest.mark.parametrize("off_policy", [0, 1])
def test_arith_one_worker_equals_in_process(tmp_path, cluster_clean, tiny_model_dir, digits_reward, off_policy):
    local = run(arith_cfg(tiny_model_dir, digits_reward, f"rollout.off_policy_steps={off_policy}"), tmp_path / "local")
    remote = run(arith_cfg(tiny_model_dir, digits_reward, f"rollout.off_policy_steps={off_policy}", "cluster.rollout_workers=1"),
                 tmp_path / "remote")
    assert all(r["grad_norm"] > 0 for r in local)          # the runs learn something to compare
    assert_rows_equal(remote, local, extra=DIST_ONLY)
    assert samples(tmp_path / "remote") == samples(tmp_path / "local")
    # lora: only the actor adapter travels (rank-8 A and B of every linear layer, fp32)
    assert remote[0]["sync_bytes"] < 0.5 * sum(p.stat().st_size for p in tiny_model_dir.glob("*.safetensors"))
    if off_policy:
        assert remote[0]["old_log_prob_gap"] == 0.0       # sampled by the weights it is updated from
        assert all(r["old_log_prob_gap"] > 0 for r in remote[1:])    # one update behind
        assert [r["staleness"] for r in remote] == [0, 1, 1, 1]
