"""How the trainer combines the math: which advantages are whitened, the actor's and the
critic's gradient clips, Dr.GRPO's constant normaliser, GSPO ratios and PPO-penalty."""

from __future__ import annotations

import pytest
import torch
from test_trainer import ToyPolicy, lm_config, make_batch

from ppokit import algo
from ppokit.trainer import PPOTrainer, compute_advantages


# ----------------------------------------------------------------------------- advantages
def group_rewards(lengths: list[int], scores: list[float], T: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards (score on the last real token) and masks for rows of the given lengths."""
    n = len(lengths)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()  # (n, T)
    rewards = torch.zeros(n, T)
    rewards[torch.arange(n), torch.tensor(lengths) - 1] = torch.tensor(scores)
    return rewards, mask


@pytest.mark.parametrize(
    "estimator, extra",
    [("grpo", {}), ("grpo", {"norm_adv_by_std_in_grpo": False}), ("grpo", {"scale_rewards": "batch"}), ("rloo", {})],
)
def test_a_group_with_one_reward_gets_exactly_zero_advantage_whatever_its_lengths(estimator, extra):
    # group 0 informative; group 1: every sample got 1.0, responses of very different lengths;
    # group 2 informative
    rewards, mask = group_rewards([2, 5, 3, 1, 6, 2, 4, 6, 1], [1, 0, 1, 1.0, 1.0, 1.0, 0, 0.25, 1])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    cfg = lm_config(
        algo={"adv_estimator": estimator, "group_size": 3, "normalize_adv": True, **extra}, train={"batch_size": 9}
    )
    adv, _ = compute_advantages(cfg, rewards=rewards, mask=mask, group_ids=group_ids)
    assert torch.equal(adv[3:6], torch.zeros(3, 6))
    assert adv[0:3][mask[0:3].bool()].abs().min() > 0 and adv[6:9][mask[6:9].bool()].abs().min() > 0
    raw, _ = algo.get_advantage_estimator(estimator)(
        rewards=rewards,
        mask=mask,
        group_ids=group_ids,
        norm_by_std=cfg.algo.scale_rewards != "none",
        batch_std=cfg.algo.scale_rewards == "batch",
    )
    torch.testing.assert_close(adv, raw, rtol=0, atol=0)  # normalize_adv leaves them as defined


def test_gae_advantages_are_whitened_once():
    g = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    mask = torch.ones(5, 7)
    cfg = lm_config(train={"batch_size": 5})
    adv, _ = compute_advantages(cfg, rewards=rewards, values=values, mask=mask)
    raw, _ = algo.compute_gae(rewards, values, gamma=cfg.algo.gamma, lam=cfg.algo.gae_lambda, mask=mask)
    torch.testing.assert_close(adv, algo.whiten(raw, mask))


# ----------------------------------------------------------------------------- clipping
def test_actor_and_critic_gradients_are_clipped_apart():
    """A critic gradient 10^4 times larger does not shrink the actor's step: each group is
    clipped to its own limit, and the norms before clipping are logged per group."""
    batch = make_batch()
    batch["returns"] = batch["returns"] * 1e4  # a huge value loss
    cfg = lm_config(train={"micro_batch_size": 12, "grad_clip": 0.2, "critic_grad_clip": 0.5})
    policy = ToyPolicy()
    trainer = PPOTrainer(cfg, policy, total_iterations=1)
    # the raw gradients, from the same (first, on-policy) step without clipping
    raw_cfg = lm_config(train={"micro_batch_size": 12, "grad_clip": None})
    raw_trainer = PPOTrainer(raw_cfg, ToyPolicy(), total_iterations=1)
    raw = []
    raw_trainer.optimizer.step = lambda: raw.append([p.grad.clone() for p in raw_trainer.params])
    raw_trainer.update(batch)
    clipped = []
    trainer.optimizer.step = lambda: clipped.append([p.grad.clone() for p in trainer.params])
    metrics = trainer.update(batch)
    actor_raw, critic_raw = raw[0][:2], raw[0][2:]
    norm = lambda grads: torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    assert metrics["grad_norm/actor"] == pytest.approx(norm(actor_raw), rel=1e-5)
    assert metrics["grad_norm/critic"] == pytest.approx(norm(critic_raw), rel=1e-5)
    assert norm(critic_raw) > 100 and norm(actor_raw) < 10
    for got, want in zip(clipped[0][:2], actor_raw):  # the actor: only its own clip applies
        torch.testing.assert_close(got, want * min(1.0, 0.2 / norm(actor_raw)), rtol=1e-5, atol=1e-8)
    assert norm(clipped[0][2:]) == pytest.approx(0.5, rel=1e-5)


def test_the_critic_clip_defaults_to_the_actors():
    cfg = lm_config(train={"grad_clip": 0.3})
    trainer = PPOTrainer(cfg, ToyPolicy(), total_iterations=1)
    assert [(name, clip) for name, _, clip in trainer.clip_groups] == [("actor", 0.3), ("critic", 0.3)]


# ----------------------------------------------------------------------------- Dr.GRPO horizon
def test_the_dr_grpo_normaliser_is_the_constant_horizon_not_the_batch_length():
    """seq-mean-token-sum-norm divides by B x horizon: padding the batch to a longer T (a
    longer response elsewhere in an iteration) must not change the loss."""
    batch = make_batch()
    wide = {k: torch.cat([v, torch.zeros(v.shape[0], 4, *v.shape[2:], dtype=v.dtype)], 1) for k, v in batch.items()}
    wide["old_log_prob"][:, 6:] = batch["old_log_prob"][:, :4]
    losses = {}
    for name, b in (("narrow", batch), ("wide", wide)):
        for horizon in (None, 16):
            cfg = lm_config(train={"micro_batch_size": 12}, algo={"loss_agg_mode": "seq-mean-token-sum-norm"})
            metrics = PPOTrainer(cfg, ToyPolicy(), total_iterations=1, horizon=horizon).update(b)
            losses[name, horizon] = metrics["policy_loss"]
    assert losses["narrow", 16] == pytest.approx(losses["wide", 16], rel=1e-6)
    assert losses["narrow", None] != pytest.approx(losses["wide", None], rel=1e-3)  # the batch's T moved it
    # the constant: sum over valid tokens / (B * 16)
    assert losses["narrow", 16] == pytest.approx(losses["narrow", None] * 6 / 16, rel=1e-6)


# ----------------------------------------------------------------------------- GSPO
def spy_on_policy_loss(trainer: PPOTrainer) -> list[tuple]:
    """Record every policy-loss call of ``trainer``: (log_prob, old_log_prob, advantages, mask) in
    float64, the keyword arguments, and the loss it returned."""
    calls: list[tuple] = []
    loss_fn = trainer.policy_loss

    def spy(inputs, algo_cfg):
        loss, metrics = loss_fn(inputs, algo_cfg)
        kwargs = {"normalizer": inputs.normalizer, **loss_fn.settings(algo_cfg, inputs)}
        tensors = (inputs.log_prob.detach(), inputs.old_log_prob, inputs.advantages, inputs.mask)
        calls.append((*(t.double() for t in tensors), kwargs, loss.item()))
        return loss, metrics

    trainer.policy_loss = spy
    return calls


def test_gspo_ratios_reach_the_loss_through_the_trainer():
    """ratio_level=gspo: the loss the trainer computes equals GSPO's objective written out
    in float64 on the inputs it used."""
    batch = make_batch()
    cfg = lm_config(
        train={"micro_batch_size": 6, "mini_batch_size": 6, "epochs": 2},
        algo={
            "ratio_level": "gspo",
            "lower_clip_ratio": 3e-4,
            "upper_clip_ratio": 4e-4,
            "loss_agg_mode": "seq-mean-token-mean",
        },
    )
    trainer = PPOTrainer(cfg, ToyPolicy(), total_iterations=1)
    calls = spy_on_policy_loss(trainer)
    trainer.update(batch)
    assert all(kw["ratio_level"] == "gspo" for *_, kw, _ in calls)
    lp, old, adv, m, kw, got = calls[-1]  # the second epoch: old log-probs differ
    want, rows = 0.0, 0
    for b in range(lp.shape[0]):
        valid = m[b].bool()
        if not valid.any():
            continue
        s = torch.exp((lp[b] - old[b])[valid].mean())  # length-normalised sequence ratio
        a = adv[b][valid]
        per_token = torch.maximum(-a * s, -a * s.clamp(1 - 3e-4, 1 + 4e-4))
        want += per_token.mean().item()
        rows += 1
    assert got == pytest.approx(
        want / kw["normalizer"].item() if torch.is_tensor(kw["normalizer"]) else want / kw["normalizer"], rel=1e-5
    )


# ----------------------------------------------------------------------------- PPO-penalty
@pytest.mark.parametrize("target, factor", [(1e-9, 2.0), (1e3, 0.5)])
def test_penalty_mode_adapts_its_coefficient_after_each_update(target, factor):
    batch = make_batch()
    cfg = lm_config(
        train={"micro_batch_size": 12, "epochs": 3},
        algo={"loss_mode": "penalty", "penalty_coef": 0.7, "penalty_target_kl": target},
    )
    trainer = PPOTrainer(cfg, ToyPolicy(), total_iterations=1)
    m1 = trainer.update(batch)
    m2 = trainer.update(batch)
    assert m1["penalty_coef"] == 0.7 and m2["penalty_coef"] == pytest.approx(0.7 * factor)
    assert m1["clipfrac"] == 0.0 and m1["kl_old"] > 0
    state = trainer.state_dict()
    again = PPOTrainer(cfg, ToyPolicy(), total_iterations=1)
    again.load_state_dict(state)
    assert again.penalty.value == pytest.approx(0.7 * factor**2)


def test_penalty_loss_in_the_trainer_equals_its_formula():
    batch = make_batch()
    cfg = lm_config(train={"micro_batch_size": 12, "epochs": 2}, algo={"loss_mode": "penalty", "penalty_coef": 0.3})
    trainer = PPOTrainer(cfg, ToyPolicy(), total_iterations=1)
    calls = spy_on_policy_loss(trainer)
    trainer.update(batch)
    lp, old, adv, m, kw, got = calls[-1]
    coef = kw["penalty_coef"]
    r = torch.exp(lp - old)
    per_token = -r * adv + coef * ((r - 1) - torch.log(r))
    assert got == pytest.approx(((per_token * m).sum() / m.sum()).item(), rel=1e-5)
