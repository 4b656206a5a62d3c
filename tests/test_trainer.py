"""The shared update loop: gradient accumulation, schedules, early stop, guards."""

from __future__ import annotations

import math

import pytest
import torch

from ppokit import algo
from ppokit.config import build_config
from ppokit.trainer import PPOTrainer, compute_advantages, lr_lambda


class ToyPolicy(torch.nn.Module):
    """A categorical policy and a value head over a one-hot observation, per position."""

    def __init__(self, n_obs: int = 5, n_actions: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.actor = torch.nn.Linear(n_obs, n_actions)
        self.critic = torch.nn.Linear(n_obs, 1)

    def param_groups(self, cfg):
        return [
            {"params": list(self.actor.parameters()), "lr": cfg.train.learning_rate, "name": "actor"},
            {
                "params": list(self.critic.parameters()),
                "lr": cfg.train.critic_learning_rate or cfg.train.learning_rate,
                "name": "critic",
            },
        ]

    def evaluate(self, mb):
        logits = self.actor(mb["obs"])  # (n, T, A)
        return {
            "log_prob": algo.log_probs_from_logits(logits, mb["actions"]),  # (n, T)
            "entropy": algo.entropy_from_logits(logits),
            "values": self.critic(mb["obs"]).squeeze(-1),
        }


def make_batch(n: int = 12, t: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    obs = torch.nn.functional.one_hot(torch.randint(0, 5, (n, t), generator=g), 5).float()
    actions = torch.randint(0, 3, (n, t), generator=g)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    mask[0] = 0.0  # a row with no valid position at all
    return {
        "obs": obs,
        "actions": actions,
        "mask": mask,
        "old_log_prob": torch.log(torch.full((n, t), 1 / 3)) + 0.1 * torch.randn(n, t, generator=g),
        "advantages": torch.randn(n, t, generator=g),
        "returns": torch.randn(n, t, generator=g),
        "old_values": torch.randn(n, t, generator=g),
        "ref_log_prob": torch.randn(n, t, generator=g) - 1,
    }


def lm_like_config(**train):
    # workload=control needs batch_size = num_envs * num_steps; 12 = 3 * 4.
    layer = {
        "env": {"num_envs": 3, "num_steps": 4},
        "train": {
            "epochs": 1,
            "grad_clip": None,
            "learning_rate": 0.1,
            "lr_scheduler_type": "constant",
            "lr_warmup_ratio": 0.0,
            **train,
        },
        "algo": {"entropy_coeff": 0.01, "clip_value": 0.2},
    }
    return build_config([layer])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_give_the_mini_batch_gradient(mode):
    batch = make_batch()
    grads = {}
    for micro in (12, 5, 1):
        # two epochs, the second step's gradient: the first mini-batch of the first epoch
        # is on-policy (ratio 1); the second reads the batch's off-policy old log-probs
        cfg = lm_like_config(micro_batch_size=micro, epochs=2)
        cfg.algo.loss_agg_mode = mode
        policy = ToyPolicy()
        trainer = PPOTrainer(cfg, policy, total_iterations=1)
        captured = []
        trainer.optimizer.step = lambda: captured.append([p.grad.clone() for p in trainer.params])
        metrics = trainer.update(batch)
        assert metrics["clipfrac"] > 0
        grads[micro] = (captured[1], metrics)
    full, full_metrics = grads[12]
    for micro in (5, 1):
        part, part_metrics = grads[micro]
        for a, b in zip(full, part):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for key in ("policy_loss", "value_loss", "entropy"):
            assert part_metrics[key] == pytest.approx(full_metrics[key], rel=1e-5, abs=1e-6)


def test_no_pass_s_outputs_outlive_its_backward():
    """A pass's outputs and loss hold memory of their graph: alive through the next pass's
    forward, they took a SmolLM2 update's peak from 6.5 to 9.1 GB (docs/performance.md). Each
    pass's outputs are gone by the time the next pass starts, and after the update."""
    import gc
    import weakref

    policy = ToyPolicy()
    cfg = lm_like_config(micro_batch_size=3, epochs=2)
    trainer = PPOTrainer(cfg, policy, total_iterations=1)
    evaluate, outputs, alive_at_call = policy.evaluate, [], []

    def tracked(mb):
        gc.collect()
        alive_at_call.append(sum(ref() is not None for ref in outputs))
        out = evaluate(mb)
        outputs.extend(weakref.ref(t) for t in out.values())
        return out

    policy.evaluate = tracked
    trainer.update(make_batch())
    gc.collect()
    assert len(alive_at_call) == 8  # 2 epochs x 12 rows in micro-batches of 3
    assert alive_at_call == [0] * 8 and all(ref() is None for ref in outputs)


def test_the_batchs_old_log_probs_are_used_row_for_row():
    """With the policy's own log-probs as old_log_prob and no learning, every mini-batch of
    every epoch (the on-policy first one and the later ones that read the batch's
    old_log_prob, shuffled) sees ratios of exactly 1: the rows are sliced together."""
    batch = make_batch()
    policy = ToyPolicy()
    with torch.no_grad():
        batch["old_log_prob"] = policy.evaluate(batch)["log_prob"]
    cfg = lm_like_config(micro_batch_size=4, mini_batch_size=6, epochs=3, learning_rate=1e-30)
    trainer = PPOTrainer(cfg, policy, total_iterations=1)
    ratios = []
    loss = trainer.policy_loss

    def spy(inputs, algo_cfg):
        ratios.append(torch.exp(inputs.log_prob.detach() - inputs.old_log_prob)[inputs.mask.bool()])
        return loss(inputs, algo_cfg)

    trainer.policy_loss = spy
    metrics = trainer.update(batch)
    assert len(ratios) == 3 * 2 * 2
    assert all(torch.equal(r, torch.ones_like(r)) for r in ratios)
    assert metrics["clipfrac"] == 0.0 and metrics["approx_kl"] == 0.0 and metrics["old_log_prob_gap"] == 0.0
    batch["old_log_prob"][5, 0] += 1.0  # one changed row shows up as a ratio != 1
    ratios.clear()
    trainer.update(batch)
    assert sum(int((r != 1).sum()) for r in ratios[2:]) > 0


def test_first_mini_batch_is_on_policy_and_reports_the_old_log_prob_gap(monkeypatch):
    batch = make_batch()  # old_log_prob: the policy's, off by up to ~0.3
    policy = ToyPolicy()
    with torch.no_grad():
        current = policy.evaluate(batch)["log_prob"]
    m = batch["mask"].bool()
    expected_gap = float((current - batch["old_log_prob"])[m].abs().max())
    ratios = []
    cfg = lm_like_config(micro_batch_size=5, mini_batch_size=6, epochs=2)
    trainer = PPOTrainer(cfg, policy, total_iterations=1)
    loss = trainer.policy_loss

    def spy(inputs, algo_cfg):
        ratios.append(torch.exp(inputs.log_prob.detach() - inputs.old_log_prob)[inputs.mask.bool()])
        return loss(inputs, algo_cfg)

    trainer.policy_loss = spy
    metrics = trainer.update(batch)
    # 2 epochs x 2 mini-batches x 2 micro-batches: only the first mini-batch's are exactly 1
    assert len(ratios) == 8
    assert all(torch.equal(r, torch.ones_like(r)) for r in ratios[:2])
    assert not torch.equal(ratios[2], torch.ones_like(ratios[2]))
    assert metrics["old_log_prob_gap"] > 0.05
    assert metrics["old_log_prob_gap"] <= expected_gap + 1e-6


def test_a_fully_on_policy_update_needs_no_old_log_prob_and_keeps_its_own():
    batch = make_batch()
    with torch.no_grad():
        before = ToyPolicy().evaluate(batch)["log_prob"]  # (N, T) the sampling policy
    results = {}
    for name in ("with", "without"):
        policy = ToyPolicy()
        trainer = PPOTrainer(lm_like_config(micro_batch_size=5), policy, total_iterations=1)  # one step
        assert trainer.fully_on_policy(12) and not trainer.fully_on_policy(13)
        part = dict(batch) if name == "with" else {k: v for k, v in batch.items() if k != "old_log_prob"}
        metrics = trainer.update(part)
        results[name] = ([p.detach().clone() for p in policy.parameters()], metrics, trainer.on_policy_log_prob)
    (p_with, m_with, lp_with), (p_without, m_without, lp_without) = results["with"], results["without"]
    for a, b in zip(p_with, p_without):
        assert torch.equal(a, b)  # the batch's old log-probs were not used
    assert "old_log_prob_gap" in m_with and "old_log_prob_gap" not in m_without
    assert m_without["policy_loss"] == m_with["policy_loss"] and m_without["clipfrac"] == 0.0
    torch.testing.assert_close(lp_without, before, rtol=0, atol=1e-6)  # every row, in batch order
    assert torch.equal(lp_with, lp_without)


@pytest.mark.parametrize("train", [{"epochs": 2}, {"mini_batch_size": 6}])
def test_an_update_with_several_steps_needs_old_log_prob(train):
    batch = {k: v for k, v in make_batch().items() if k != "old_log_prob"}
    trainer = PPOTrainer(lm_like_config(**train), ToyPolicy(), total_iterations=1)
    assert not trainer.fully_on_policy(12)
    with pytest.raises(KeyError, match="old_log_prob"):
        trainer.update(batch)


def test_update_improves_the_surrogate():
    batch = make_batch()
    policy = ToyPolicy()
    with torch.no_grad():
        batch["old_log_prob"] = policy.evaluate(batch)["log_prob"]
    cfg = lm_like_config(micro_batch_size=12, epochs=4)
    cfg.train.learning_rate = 0.05
    trainer = PPOTrainer(cfg, policy, total_iterations=1)
    trainer.update(batch)
    with torch.no_grad():
        new = policy.evaluate(batch)["log_prob"]
    m = batch["mask"]
    # Positive-advantage actions became more likely on average, negative ones less.
    gain = ((new - batch["old_log_prob"]) * batch["advantages"] * m).sum()
    assert gain > 0


def test_critic_warmup_leaves_the_actor_alone():
    batch = make_batch()
    policy = ToyPolicy()
    actor_before = [p.clone() for p in policy.actor.parameters()]
    critic_before = [p.clone() for p in policy.critic.parameters()]
    cfg = lm_like_config(critic_warmup=1, micro_batch_size=12)
    trainer = PPOTrainer(cfg, policy, total_iterations=2)
    metrics = trainer.update(batch, iteration=0)
    assert "policy_loss" not in metrics
    assert all(torch.equal(a, b) for a, b in zip(actor_before, policy.actor.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(critic_before, policy.critic.parameters()))
    assert "policy_loss" in trainer.update(batch, iteration=1)


def test_target_kl_stops_the_epochs_early():
    batch = make_batch()
    cfg = lm_like_config(micro_batch_size=12, epochs=10)
    cfg.train.learning_rate = 1.0
    cfg.algo.target_kl = 1e-6
    metrics = PPOTrainer(cfg, ToyPolicy(), total_iterations=1).update(batch)
    assert 1 <= metrics["epochs"] < 10


def test_non_finite_gradient_skips_the_step():
    batch = make_batch()
    batch["advantages"][3, 0] = float("nan")
    batch["mask"][3, 0] = 1.0
    policy = ToyPolicy()
    before = [p.clone() for p in policy.parameters()]
    cfg = lm_like_config(micro_batch_size=12)
    trainer = PPOTrainer(cfg, policy, total_iterations=1)
    metrics = trainer.update(batch)
    assert metrics["skipped_steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def lm_config(**sections):
    """A validated language-model config (a reference exists: algo.beta may be > 0)."""
    layer = {
        "workload": "lm",
        "train": {
            "iterations": 1,
            "batch_size": 12,
            "epochs": 1,
            "grad_clip": None,
            "learning_rate": 0.1,
            "lr_warmup_ratio": 0.0,
            **sections.pop("train", {}),
        },
        "algo": {"entropy_coeff": 0.01, "clip_value": 0.2, **sections.pop("algo", {})},
        **sections,
    }
    return build_config([layer])


def test_beta_adds_the_reference_kl_to_the_loss_and_its_gradient():
    """beta * KL(pi || ref), the k3 estimator, token-mean: the metric against a float64
    formula, and the gradient it adds against autograd on that formula."""
    batch = make_batch()
    grads = {}
    for beta in (0.0, 0.5):
        cfg = lm_config(train={"micro_batch_size": 12}, algo={"beta": beta, "kl_loss_type": "low_var_kl"})
        policy = ToyPolicy()
        trainer = PPOTrainer(cfg, policy, total_iterations=1)
        captured = []
        trainer.optimizer.step = lambda: captured.append([p.grad.clone() for p in trainer.params])
        metrics = trainer.update(batch)
        grads[beta] = captured[0]
        assert ("kl_loss" in metrics) == (beta > 0)
    policy = ToyPolicy().double()
    m = batch["mask"].double()
    log_prob = algo.log_probs_from_logits(policy.actor(batch["obs"].double()), batch["actions"])
    d = (batch["ref_log_prob"].double() - log_prob).clamp(-20, 20)
    kl = ((torch.exp(d) - d - 1).clamp(-10, 10) * m).sum() / m.sum()  # k3 (clamped as verl), token-mean
    assert metrics["kl_loss"] == pytest.approx(kl.item(), rel=1e-5)
    want = torch.autograd.grad(0.5 * kl, list(policy.actor.parameters()))
    for with_kl, without, w in zip(grads[0.5][:2], grads[0.0][:2], want):
        torch.testing.assert_close((with_kl - without).double(), w, rtol=1e-4, atol=1e-6)


def test_missing_batch_key_is_named():
    batch = make_batch()
    del batch["returns"]
    with pytest.raises(KeyError, match="returns"):
        PPOTrainer(lm_like_config(), ToyPolicy(), total_iterations=1).update(batch)


@pytest.mark.parametrize(
    "kind, step, expected",
    [
        ("constant", 50, 1.0),
        ("linear", 10, 1.0),
        ("linear", 60, 0.5),
        ("linear", 110, 0.0),
        ("cosine", 60, 0.5),
        ("cosine", 10, 1.0),
        ("constant", 4, 0.5),
    ],
)
def test_lr_schedule_with_warmup(kind, step, expected):
    factor = lr_lambda(kind, warmup_steps=10, total_steps=110)
    assert factor(step) == pytest.approx(expected)


def test_scheduler_anneals_to_zero_over_the_run():
    batch = make_batch()
    cfg = lm_like_config(micro_batch_size=12, epochs=2, lr_scheduler_type="linear")
    trainer = PPOTrainer(cfg, ToyPolicy(), total_iterations=3)
    lrs = [trainer.update(batch, iteration=i)["lr"] for i in range(3)]
    assert lrs[0] > lrs[1] > lrs[2] == pytest.approx(0.0)


def test_compute_advantages_whitens_gae_over_the_mask():
    cfg = lm_like_config()
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    mask = torch.ones(4, 7)
    mask[:, 5:] = 0
    adv, ret = compute_advantages(cfg, rewards=rewards, values=values, mask=mask)
    raw, raw_ret = algo.compute_gae(rewards, values, gamma=cfg.algo.gamma, lam=cfg.algo.gae_lambda, mask=mask)
    valid = mask.bool()
    assert adv[valid].mean().abs() < 1e-6 and adv[valid].std() == pytest.approx(1.0, rel=1e-5)
    torch.testing.assert_close(ret, raw_ret)
    assert torch.all(adv[~valid] == 0)
    assert not math.isnan(adv.sum().item())
