"""MLP actor-critic: forward pass, distributions, init gains, parameter groups, named state.

Every formula is checked against a float64 implementation written from the network's
named tensors (``named_state``), not against the network's own code paths.
"""

from __future__ import annotations

import math

import pytest
import torch

from ppokit.control.networks import ActorCritic

OBS_DIM, ACTION_DIM = 5, 3
ACT64 = {"tanh": torch.tanh, "relu": torch.relu, "gelu": lambda x: torch.nn.functional.gelu(x)}


def _net(make_cfg, discrete: bool, *overrides: str, seed: int = 0) -> ActorCritic:
    torch.manual_seed(seed)
    return ActorCritic(OBS_DIM, ACTION_DIM, discrete, make_cfg(*overrides).network)


def _randomize(net: ActorCritic) -> None:
    """Non-trivial weights (the 0.01 policy head would make every check pass near zero)."""
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) * 0.7)


def _reference(net: ActorCritic, obs: torch.Tensor, activation: str = "tanh") -> tuple[torch.Tensor, torch.Tensor]:
    """(policy head output (..., A), value (...)) in float64 from the named tensors."""
    s = {k: v.double() for k, v in net.named_state().items()}
    act = ACT64[activation]

    def hidden(prefix: str) -> torch.Tensor:
        h = obs.double()
        for i in range(0, 99, 2):  # nn.Sequential: Linear at even indices, activation at odd ones
            if f"{prefix}.{i}.weight" not in s:
                return h
            h = act(h @ s[f"{prefix}.{i}.weight"].T + s[f"{prefix}.{i}.bias"])
        raise AssertionError("too many layers")

    h_actor = hidden("trunk" if net.shared else "actor")
    h_critic = h_actor if net.shared else hidden("critic")
    out = h_actor @ s["policy_head.weight"].T + s["policy_head.bias"]
    value = (h_critic @ s["value_head.weight"].T + s["value_head.bias"]).squeeze(-1)
    return out, value


def _log_prob_entropy64(
    net: ActorCritic, out: torch.Tensor, actions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 log pi(a|s) and H(pi(.|s)) written out."""
    if net.discrete:
        log_p = out - torch.log(torch.exp(out).sum(-1, keepdim=True))  # (..., K)
        log_prob = torch.take_along_dim(log_p, actions.long()[..., None], -1).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        return log_prob, entropy
    log_std = net.named_state()["log_std"].double()  # (A,)
    z = (actions.double() - out) / torch.exp(log_std)
    log_prob = (-0.5 * z**2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
    entropy = (0.5 + 0.5 * math.log(2 * math.pi) + log_std).sum().expand(out.shape[:-1])
    return log_prob, entropy


# ----------------------------------------------------------------------------- forward pass
@pytest.mark.parametrize("activation", ["tanh", "relu", "gelu"])
@pytest.mark.parametrize("shared", [False, True])
def test_forward_matches_float64_mlp(make_cfg, activation, shared):
    net = _net(
        make_cfg,
        False,
        f"network.activation={activation}",
        f"network.shared_trunk={shared}",
        "network.hidden_sizes=[16,8,12]",
    )
    _randomize(net)
    obs = torch.randn(7, OBS_DIM)
    out, value = _reference(net, obs, activation)
    torch.testing.assert_close(net.act_deterministic(obs).double(), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(net.value(obs).double(), value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("discrete", [True, False])
@pytest.mark.parametrize("shared", [False, True])
def test_evaluate_log_prob_entropy_and_values_match_float64_formulas(make_cfg, discrete, shared):
    net = _net(make_cfg, discrete, "network.init_log_std=-0.3", f"network.shared_trunk={shared}")
    _randomize(net)  # log_std too: a different std per action dimension
    obs = torch.randn(6, 4, OBS_DIM)  # (n, T, D)
    out, value = _reference(net, obs)
    if discrete:
        actions = torch.randint(0, ACTION_DIM, (6, 4))  # (n, T)
    else:
        actions = out.float() + torch.randn(6, 4, ACTION_DIM) * 2.0  # (n, T, A), also far from the mean
    ref_lp, ref_ent = _log_prob_entropy64(net, out, actions)
    res = net.evaluate({"obs": obs, "actions": actions})
    assert res["log_prob"].shape == res["values"].shape == res["entropy"].shape == (6, 4)
    torch.testing.assert_close(res["log_prob"].double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res["entropy"].double(), ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res["values"].double(), value, rtol=1e-5, atol=1e-5)
    # the outputs carry gradients to the parameters (the trainer backpropagates through them)
    (res["log_prob"].sum() + res["values"].sum() + res["entropy"].sum()).backward()
    assert all(p.grad is not None for p in net.parameters())


def test_entropy_of_extreme_logits_is_finite_and_exact(make_cfg):
    # a near-deterministic policy: p log p with p ~ 0 must be 0, not NaN
    net = _net(make_cfg, True)
    with torch.no_grad():
        net.policy_head.bias.copy_(torch.tensor([0.0, -200.0, -1e4]))
        net.policy_head.weight.zero_()
    res = net.evaluate({"obs": torch.randn(3, 1, OBS_DIM), "actions": torch.zeros(3, 1, dtype=torch.long)})
    assert torch.all(res["entropy"].abs() < 1e-30)
    assert torch.all(res["log_prob"] == 0)


# ----------------------------------------------------------------------------- acting
@pytest.mark.parametrize("discrete", [True, False])
def test_act_returns_the_sampled_actions_log_prob_and_value(make_cfg, discrete):
    net = _net(make_cfg, discrete, "network.init_log_std=-0.5")
    _randomize(net)
    obs = torch.randn(64, OBS_DIM)
    with torch.inference_mode():
        actions, log_prob, values = net.act(obs)
    assert actions.shape == ((64,) if discrete else (64, ACTION_DIM))
    assert actions.dtype == (torch.int64 if discrete else torch.float32)
    out, value = _reference(net, obs)
    ref_lp, _ = _log_prob_entropy64(net, out, actions)
    torch.testing.assert_close(log_prob.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values.double(), value, rtol=1e-5, atol=1e-5)
    # the rollout's log-probs are the ones the update recomputes (from the rollout buffers: not
    # inference tensors, which autograd refuses to save)
    res = net.evaluate({"obs": obs[:, None], "actions": actions.clone()[:, None]})
    torch.testing.assert_close(res["log_prob"][:, 0], log_prob, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("discrete", [True, False])
def test_act_samples_from_the_policy_distribution(make_cfg, discrete):
    net = _net(make_cfg, discrete, "network.init_log_std=-0.7")
    _randomize(net)
    obs = torch.randn(1, OBS_DIM).expand(20_000, OBS_DIM)  # one state, many draws
    torch.manual_seed(3)
    with torch.inference_mode():
        actions, _, _ = net.act(obs)
    out, _ = _reference(net, obs[:1])
    if discrete:
        freq = torch.bincount(actions, minlength=ACTION_DIM).double() / len(actions)
        torch.testing.assert_close(freq, torch.softmax(out[0], -1), rtol=0, atol=0.015)  # > 5 sigma
    else:
        std = torch.exp(net.named_state()["log_std"].double())
        torch.testing.assert_close(actions.double().mean(0), out[0], rtol=0, atol=float(6 * std.max() / 141))
        torch.testing.assert_close(actions.double().std(0), std, rtol=0.03, atol=0)


@pytest.mark.parametrize("discrete", [True, False])
def test_sampling_draws_only_from_the_global_torch_rng(make_cfg, discrete):
    net = _net(make_cfg, discrete)
    obs = torch.randn(16, OBS_DIM)
    state = torch.get_rng_state()
    with torch.inference_mode():
        first = [net.act(obs)[0].clone() for _ in range(3)]
        after = torch.get_rng_state()
        torch.set_rng_state(state)  # what a resumed run does
        again = [net.act(obs)[0].clone() for _ in range(3)]
    assert not torch.equal(after, state)  # the global generator was consumed
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], first[1])  # fresh draws on every call


def test_deterministic_action_is_the_mode(make_cfg):
    net = _net(make_cfg, True)
    _randomize(net)
    obs = torch.randn(50, OBS_DIM)
    out, _ = _reference(net, obs)
    mode = net.act_deterministic(obs)
    assert mode.dtype == torch.int64 and torch.equal(mode, out.argmax(-1))
    cont = _net(make_cfg, False)
    _randomize(cont)
    out, _ = _reference(cont, obs)
    torch.testing.assert_close(cont.act_deterministic(obs).double(), out, rtol=1e-5, atol=1e-5)  # the mean
    state = torch.get_rng_state()
    cont.act_deterministic(obs)
    assert torch.equal(torch.get_rng_state(), state)  # no random draw


# ----------------------------------------------------------------------------- init
def _svals(w: torch.Tensor) -> torch.Tensor:
    """Singular values; all equal to the gain for an orthogonally initialised matrix."""
    return torch.linalg.svdvals(w.double())


@pytest.mark.parametrize("shared", [False, True])
def test_orthogonal_init_gains_and_zero_biases(make_cfg, shared):
    net = _net(
        make_cfg, False, "network.hidden_sizes=[32,16]", "network.init_log_std=-0.4", f"network.shared_trunk={shared}"
    )
    state = net.named_state()
    trunks = ["trunk"] if shared else ["actor", "critic"]
    hidden = [f"{t}.{i}" for t in trunks for i in (0, 2)]
    assert {f"{h}.weight" for h in hidden} == {k for k in state if k.endswith(".weight") and "head" not in k}
    for name in hidden:
        w = state[f"{name}.weight"]
        torch.testing.assert_close(
            _svals(w), torch.full((min(w.shape),), math.sqrt(2), dtype=torch.float64), rtol=1e-5, atol=1e-6
        )
        assert torch.all(state[f"{name}.bias"] == 0)
    torch.testing.assert_close(
        _svals(state["policy_head.weight"]), torch.full((ACTION_DIM,), 0.01, dtype=torch.float64), rtol=1e-5, atol=1e-8
    )
    torch.testing.assert_close(
        _svals(state["value_head.weight"]), torch.ones(1, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )
    assert torch.all(state["policy_head.bias"] == 0) and torch.all(state["value_head.bias"] == 0)
    assert torch.all(state["log_std"] == -0.4)


def test_without_ortho_init_pytorch_default_init(make_cfg):
    net = _net(make_cfg, False, "network.ortho_init=false", "network.hidden_sizes=[32,16]", "network.init_log_std=0.2")
    state = net.named_state()
    for name, fan_in in (
        ("actor.0", OBS_DIM),
        ("actor.2", 32),
        ("critic.2", 32),
        ("policy_head", 16),
        ("value_head", 16),
    ):
        w, b = state[f"{name}.weight"], state[f"{name}.bias"]
        bound = 1 / math.sqrt(fan_in)  # nn.Linear: kaiming_uniform(a=sqrt(5)) and U(-bound, bound) biases
        assert w.abs().max() <= bound and b.abs().max() <= bound
        assert b.abs().max() > 0  # not the zero biases of the orthogonal init
    s = _svals(state["actor.2.weight"])
    assert s.max() / s.min() > 1.5  # not orthogonal
    assert _svals(state["policy_head.weight"]).max() > 0.1  # not the 0.01 head
    assert torch.all(state["log_std"] == 0.2)


# ----------------------------------------------------------------------------- parameter groups
def test_param_groups_separate_trunks(make_cfg):
    cfg = make_cfg("train.learning_rate=0.001", "train.critic_learning_rate=0.01")
    net = ActorCritic(4, 2, False, cfg.network)
    groups = {g["name"]: g for g in net.param_groups(cfg)}
    assert groups["actor"]["lr"] == 0.001 and groups["critic"]["lr"] == 0.01
    named = dict(net.named_parameters())
    ids = lambda names: {id(named[n]) for n in names}  # noqa: E731
    actor = {n for n in named if n.startswith(("actor.", "policy_head.")) or n == "log_std"}
    critic = {n for n in named if n.startswith(("critic.", "value_head."))}
    assert actor | critic == set(named) and len(actor) == 7 and len(critic) == 6
    assert {id(p) for p in groups["actor"]["params"]} == ids(actor) and len(groups["actor"]["params"]) == 7
    assert {id(p) for p in groups["critic"]["params"]} == ids(critic) and len(groups["critic"]["params"]) == 6
    # a value gradient reaches only the critic, a policy gradient only the actor
    obs = torch.randn(8, 4)
    net.value(obs).sum().backward()
    assert all(p.grad is None for p in groups["actor"]["params"])
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in groups["critic"]["params"])
    net.zero_grad(set_to_none=True)
    net.evaluate({"obs": obs[:, None], "actions": torch.randn(8, 1, 2)})["log_prob"].sum().backward()
    assert all(p.grad is None for p in groups["critic"]["params"])
    assert all(p.grad is not None for p in groups["actor"]["params"])


def test_param_groups_shared_trunk(make_cfg):
    cfg = make_cfg("network.shared_trunk=true")
    net = ActorCritic(4, 2, True, cfg.network)
    groups = {g["name"]: g for g in net.param_groups(cfg)}
    assert groups["critic"]["lr"] == groups["actor"]["lr"] == cfg.train.learning_rate  # critic lr null -> lr
    names = set(net.named_state())
    assert names == {
        "trunk.0.weight",
        "trunk.0.bias",
        "trunk.2.weight",
        "trunk.2.bias",
        "policy_head.weight",
        "policy_head.bias",
        "value_head.weight",
        "value_head.bias",
    }  # discrete: no log_std
    assert [tuple(p.shape) for p in groups["critic"]["params"]] == [(1, 64), (1,)]  # the value head only
    trunk = {id(p) for p in net.trunk.parameters()}
    assert trunk <= {id(p) for p in groups["actor"]["params"]}
    assert len(groups["actor"]["params"]) + len(groups["critic"]["params"]) == len(list(net.parameters()))
    net.value(torch.randn(8, 4)).sum().backward()
    assert all(p.grad.abs().sum() > 0 for p in net.trunk.parameters())  # the shared trunk learns from the critic
    assert net.policy_head.weight.grad is None


# ----------------------------------------------------------------------------- named state
@pytest.mark.parametrize("shared", [False, True])
def test_named_state_round_trip(make_cfg, shared):
    a = _net(make_cfg, False, f"network.shared_trunk={shared}", seed=0)
    b = _net(make_cfg, False, f"network.shared_trunk={shared}", seed=1)
    _randomize(a)
    obs = torch.randn(4, OBS_DIM)
    assert not torch.equal(a.act_deterministic(obs), b.act_deterministic(obs))
    state = a.named_state()
    b.load_named_state(state)
    assert torch.equal(a.act_deterministic(obs), b.act_deterministic(obs))
    assert torch.equal(a.value(obs), b.value(obs))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    # named_state is a copy: changing it (or the loaded net) leaves the source alone
    state["log_std"].fill_(5.0)
    with torch.no_grad():
        b.log_std.fill_(7.0)
    assert torch.all(a.log_std != 5.0) and torch.all(a.log_std != 7.0)


def test_load_named_state_errors(make_cfg):
    net = _net(make_cfg, False)
    good = net.named_state()
    missing = {k: v for k, v in good.items() if k != "log_std"}
    with pytest.raises(ValueError, match=r"network layers differ \(missing \['log_std'\], unexpected \[\]\)"):
        net.load_named_state(missing)
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['extra.weight'\]"):
        net.load_named_state({**good, "extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"'actor.2.weight' has shape \(64, 32\), the config makes \(64, 64\)"):
        net.load_named_state({**good, "actor.2.weight": torch.zeros(64, 32)})
    wide = ActorCritic(OBS_DIM, ACTION_DIM, False, make_cfg("network.hidden_sizes=[32]").network)
    with pytest.raises(ValueError, match="differ"):
        wide.load_named_state(good)
    discrete = _net(make_cfg, True)
    with pytest.raises(ValueError, match=r"unexpected \['log_std'\]"):
        discrete.load_named_state(good)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError):
        net.load_named_state({**{k: torch.zeros_like(v) for k, v in good.items()}, "value_head.bias": torch.zeros(2)})
    assert all(torch.equal(x, y) for x, y in zip(before, net.parameters()))  # nothing half-loaded
