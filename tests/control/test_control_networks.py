"""MLP actor-critic: distributions, init gains, parameter groups."""

from __future__ import annotations

import math

import pytest
import torch

from ppokit.control.networks import ActorCritic


def _out(net: ActorCritic, obs: torch.Tensor) -> torch.Tensor:
    """The policy head's output (logits or mean)."""
    return net._forward(obs, *net._views())[0]


def _net(make_cfg, discrete: bool, *overrides: str, obs_dim: int = 5, action_dim: int = 3) -> ActorCritic:
    torch.manual_seed(0)
    return ActorCritic(obs_dim, action_dim, discrete, make_cfg(*overrides).network)


@pytest.mark.parametrize("discrete", [True, False])
def test_log_prob_and_entropy_match_torch_distributions(make_cfg, discrete):
    net = _net(make_cfg, discrete, "network.init_log_std=-0.3")
    obs = torch.randn(6, 2, 5)
    out = _out(net, obs.reshape(12, 5)).detach()
    if discrete:
        dist = torch.distributions.Categorical(logits=out)
        actions = dist.sample()
        ref_lp, ref_ent = dist.log_prob(actions), dist.entropy()
        actions = actions.view(6, 2)
    else:
        dist = torch.distributions.Normal(out, net.named_state()["log_std"].exp())
        actions = dist.sample()
        ref_lp, ref_ent = dist.log_prob(actions).sum(-1), dist.entropy().sum(-1)
        actions = actions.view(6, 2, 3)
    res = net.evaluate({"obs": obs, "actions": actions})
    assert res["log_prob"].shape == res["values"].shape == res["entropy"].shape == (6, 2)
    torch.testing.assert_close(res["log_prob"].reshape(-1), ref_lp)
    torch.testing.assert_close(res["entropy"].reshape(-1), ref_ent)


@pytest.mark.parametrize("discrete", [True, False])
def test_act_log_prob_equals_evaluate_log_prob(make_cfg, discrete):
    net = _net(make_cfg, discrete)
    obs = torch.randn(64, 5)
    with torch.inference_mode():
        actions, log_prob, values = net.act(obs)
    actions, log_prob, values = actions.clone(), log_prob.clone(), values.clone()
    res = net.evaluate({"obs": obs[:, None], "actions": actions[:, None]})
    torch.testing.assert_close(res["log_prob"][:, 0], log_prob, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res["values"][:, 0], values)
    torch.testing.assert_close(net.value(obs), values)


def test_deterministic_action_is_the_mode(make_cfg):
    net = _net(make_cfg, True)
    obs = torch.randn(10, 5)
    assert torch.equal(net.act_deterministic(obs), _out(net, obs).argmax(-1))
    cont = _net(make_cfg, False)
    torch.testing.assert_close(cont.act_deterministic(obs), _out(cont, obs))


def _row_gain(w: torch.Tensor) -> torch.Tensor:
    """Singular values of an orthogonally initialised matrix, all equal to its gain."""
    return torch.linalg.svdvals(w)


def test_orthogonal_init_gains(make_cfg):
    net = _net(make_cfg, False, "network.hidden_sizes=[32,32]", obs_dim=5, action_dim=3)
    state = net.named_state()
    for name in ("actor.0", "actor.1", "critic.0", "critic.1"):
        w = state[f"{name}.weight"]
        torch.testing.assert_close(_row_gain(w), torch.full((min(w.shape),), math.sqrt(2)))
        assert torch.all(state[f"{name}.bias"] == 0)
    torch.testing.assert_close(_row_gain(state["policy_head.weight"]), torch.full((3,), 0.01))
    torch.testing.assert_close(_row_gain(state["value_head.weight"]), torch.full((1,), 1.0))
    assert torch.all(state["log_std"] == 0)


def test_named_state_round_trip_and_mismatch(make_cfg):
    a = _net(make_cfg, False)
    torch.manual_seed(1)
    b = ActorCritic(5, 3, False, make_cfg().network)
    obs = torch.randn(4, 5)
    assert not torch.equal(a.act_deterministic(obs), b.act_deterministic(obs))
    b.load_named_state(a.named_state())
    assert torch.equal(a.act_deterministic(obs), b.act_deterministic(obs))
    assert torch.equal(a.value(obs), b.value(obs))
    wide = ActorCritic(5, 3, False, make_cfg("network.hidden_sizes=[32]").network)
    with pytest.raises(ValueError, match="differ|shape"):
        wide.load_named_state(a.named_state())


def test_param_groups_separate_and_shared(make_cfg):
    cfg = make_cfg("train.learning_rate=0.001", "train.critic_learning_rate=0.01")
    sep = ActorCritic(4, 2, False, cfg.network)
    groups = {g["name"]: g for g in sep.param_groups(cfg)}
    assert groups["actor"]["lr"] == 0.001 and groups["critic"]["lr"] == 0.01
    assert groups["actor"]["params"] == [sep.actor_params] and groups["critic"]["params"] == [sep.critic_params]
    names = set(sep.named_state())
    assert {"actor.0.weight", "critic.1.bias", "policy_head.weight", "value_head.bias", "log_std"} <= names
    # a gradient of the value reaches only the critic, of the policy only the actor
    obs = torch.randn(8, 4)
    sep.value(obs).sum().backward()
    assert sep.actor_params.grad is None and sep.critic_params.grad.abs().sum() > 0

    cfg = make_cfg("network.shared_trunk=true")
    shared = ActorCritic(4, 2, True, cfg.network)
    groups = {g["name"]: g for g in shared.param_groups(cfg)}
    assert groups["critic"]["lr"] == cfg.train.learning_rate  # critic_learning_rate null -> learning_rate
    names = set(shared.named_state())
    assert "trunk.0.weight" in names and not any(n.startswith(("actor.", "critic.")) for n in names)
    assert shared.critic_params.numel() == 64 + 1  # the value head only
    shared.value(obs).sum().backward()
    assert shared.actor_params.grad.abs().sum() > 0  # the shared trunk learns from the critic
