"""Rollout layout: masks on NEXT_STEP reset steps, dones, truncation bootstrap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppokit.control.envs import VecEnv
from ppokit.control.networks import ActorCritic
from ppokit.control.rollout import Rollout


def _rollout(make_cfg, env_id, num_envs, num_steps, *overrides):
    cfg = make_cfg(f"env.id={env_id}", f"env.num_envs={num_envs}", f"env.num_steps={num_steps}", *overrides)
    torch.manual_seed(0)
    venv = VecEnv(cfg.env, num_envs, seed=0, gamma=cfg.algo.gamma)
    policy = ActorCritic(venv.obs_dim, venv.action_dim, venv.discrete, cfg.network)
    return cfg, venv, policy, Rollout(venv, num_steps)


def test_one_step_episodes_alternate_transition_and_masked_reset_step(make_cfg):
    _, venv, policy, rollout = _rollout(make_cfg, "ppokit-test/OneStep-v0", 3, 8)
    data = rollout.collect(policy)
    assert data["mask"].shape == data["dones"].shape == data["rewards"].shape == (3, 8)
    assert data["obs"].shape == (3, 8, 1) and data["actions"].shape == (3, 8)
    expect = torch.tensor([True, False] * 4).expand(3, 8)
    assert torch.equal(data["mask"], expect)
    assert torch.equal(data["dones"], expect)
    assert torch.equal(data["rewards"], expect.float())  # reset steps carry reward 0
    # the next rollout continues where this one stopped (its first step is a transition again)
    data2 = rollout.collect(policy)
    assert torch.equal(data2["mask"], expect)
    venv.close()


def test_mask_carries_over_an_iteration_boundary(make_cfg):
    # episodes of 1 step and rollouts of 3 steps: the second rollout starts on a reset step
    _, venv, policy, rollout = _rollout(make_cfg, "ppokit-test/OneStep-v0", 2, 3)
    first = rollout.collect(policy)
    second = rollout.collect(policy)
    assert first["mask"][0].tolist() == [True, False, True]
    assert second["mask"][0].tolist() == [False, True, False]
    venv.close()


@pytest.mark.parametrize("truncation", ["bootstrap", "terminal"])
def test_truncated_steps_bootstrap_from_the_final_observation(make_cfg, truncation):
    # ConstantReward has a 10-step time limit: truncated at t = 9 and t = 20; t = 10, 21 are reset steps
    cfg, venv, policy, rollout = _rollout(
        make_cfg, "ppokit-test/ConstantReward-v0", 2, 25, f"env.truncation={truncation}", "algo.gamma=0.9"
    )
    state = policy.named_state()
    state["value_head.bias"].fill_(3.0)  # V(s) = 3 + a little for the constant observation
    policy.load_named_state(state)
    data = rollout.collect(policy)
    v_final = data["values"][:, 10]  # value of the final observation, computed on the reset step
    assert torch.allclose(v_final, policy.value(torch.ones(1, 1)).expand(2), atol=1e-6)
    assert data["dones"][0].nonzero().flatten().tolist() == [9, 20]
    assert (~data["mask"][0]).nonzero().flatten().tolist() == [10, 21]
    if truncation == "bootstrap":
        torch.testing.assert_close(data["rewards"][:, 9], 1.0 + 0.9 * v_final)
        torch.testing.assert_close(data["rewards"][:, 20], 1.0 + 0.9 * data["values"][:, 21])
    else:
        assert torch.all(data["rewards"][:, [9, 20]] == 1.0)
    others = [t for t in range(25) if t not in (9, 10, 20, 21)]
    assert torch.all(data["rewards"][:, others] == 1.0)
    venv.close()


def test_truncation_on_the_last_step_bootstraps_from_last_values(make_cfg):
    _, venv, policy, rollout = _rollout(make_cfg, "ppokit-test/ConstantReward-v0", 2, 10, "algo.gamma=0.9")
    data = rollout.collect(policy)
    assert data["dones"][:, 9].all()
    torch.testing.assert_close(data["rewards"][:, 9], 1.0 + 0.9 * data["last_values"])
    venv.close()


def test_stored_observations_are_the_policy_inputs(make_cfg):
    cfg, venv, policy, rollout = _rollout(make_cfg, "CartPole-v1", 4, 16, "env.normalize_obs=true")
    data = rollout.collect(policy)
    res = policy.evaluate({"obs": data["obs"], "actions": data["actions"]})
    torch.testing.assert_close(res["log_prob"], data["log_probs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res["values"], data["values"], rtol=1e-5, atol=1e-5)
    assert np.isfinite(data["obs"].numpy()).all() and data["obs"].abs().max() <= cfg.env.clip_obs
    venv.close()
