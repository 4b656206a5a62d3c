"""Rollout correction inside the update: the weights reach the advantages, the kept tokens the actor's
mask and normaliser, the critic is left alone, and the mismatch is measured every iteration."""

from __future__ import annotations

import math

import pytest
import torch
from test_trainer import ToyPolicy, lm_like_config, make_batch

from ppokit import algo
from ppokit.trainer import PPOTrainer

ACTOR = ("actor.weight", "actor.bias")
CRITIC = ("critic.weight", "critic.bias")


def batch_with_engine(seed: int = 0, shift: float = 0.3):
    """A batch whose engine log-probs differ from old_log_prob: by +-shift on alternate rows, plus noise."""
    batch = make_batch(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    n, t = batch["mask"].shape
    sign = torch.tensor([1.0 if i % 2 else -1.0 for i in range(n)])[:, None]
    batch["rollout_log_prob"] = batch["old_log_prob"] - shift * sign + 0.05 * torch.randn(n, t, generator=g)
    return batch


def gradients(cfg, batch):
    trainer = PPOTrainer(cfg, ToyPolicy(), total_iterations=1)
    return trainer.mini_batch_gradients(batch)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_weighs_each_tokens_advantage(mode, level):
    """TIS's gradient is the uncorrected gradient of advantages times min(r, C), C computed apart."""
    batch = batch_with_engine()
    cfg = lm_like_config(micro_batch_size=5)
    cfg.algo.loss_agg_mode = mode
    cfg.algo.rollout_correction, cfg.algo.rollout_correction_level, cfg.algo.rollout_correction_cap = "tis", level, 1.2
    corrected = gradients(cfg, batch)
    old, engine = batch["old_log_prob"].double(), batch["rollout_log_prob"].double()
    rho = algo.correction_ratio(old, engine, batch["mask"], level)
    by_hand = {k: v for k, v in batch.items() if k != "rollout_log_prob"}
    by_hand["advantages"] = batch["advantages"] * rho.clamp(max=1.2).float()
    cfg.algo.rollout_correction = "none"
    expected = gradients(cfg, by_hand)
    for name in ACTOR + CRITIC:
        torch.testing.assert_close(corrected[name], expected[name], rtol=1e-5, atol=1e-7)
    assert (rho[batch["mask"].bool()] > 1.2).any() and (rho[batch["mask"].bool()] < 1.2).any()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_mis_drops_tokens_from_the_actor_loss_and_its_normaliser_only(mode):
    batch = batch_with_engine(shift=0.3)
    cfg = lm_like_config(micro_batch_size=4)
    cfg.algo.loss_agg_mode = mode
    cfg.algo.rollout_correction, cfg.algo.rollout_correction_cap = "mis", 1.2
    corrected = gradients(cfg, batch)
    rho = algo.correction_ratio(batch["old_log_prob"], batch["rollout_log_prob"], batch["mask"], "token")
    keep = ((rho >= 1 / 1.2) & (rho <= 1.2)).float() * batch["mask"]
    assert 0 < keep.sum() < batch["mask"].sum()
    # the actor: as if the dropped tokens were padding, advantages times r on the others
    actor_view = {k: v for k, v in batch.items() if k != "rollout_log_prob"}
    actor_view["mask"], actor_view["advantages"] = keep, batch["advantages"] * rho * keep
    cfg.algo.rollout_correction = "none"
    actor_expected = gradients(cfg, actor_view)
    critic_expected = gradients(cfg, {k: v for k, v in batch.items() if k != "rollout_log_prob"})
    for name in ACTOR:
        torch.testing.assert_close(corrected[name], actor_expected[name], rtol=1e-5, atol=1e-7)
    for name in CRITIC:  # the critic fits every token
        torch.testing.assert_close(corrected[name], critic_expected[name], rtol=1e-5, atol=1e-7)


def test_the_update_logs_the_mismatch_and_the_correction():
    batch = batch_with_engine(shift=0.3)
    cfg = lm_like_config(micro_batch_size=4, mini_batch_size=6, epochs=2)
    cfg.algo.rollout_correction, cfg.algo.rollout_correction_cap = "tis", 1.2
    metrics = PPOTrainer(cfg, ToyPolicy(), total_iterations=1).update(batch)
    want = algo.mismatch_metrics(batch["old_log_prob"], batch["rollout_log_prob"], batch["mask"])
    for key, value in want.items():
        assert metrics[key] == pytest.approx(float(value), rel=1e-6), key
    _, _, corr = algo.rollout_correction(
        batch["old_log_prob"], batch["rollout_log_prob"], batch["mask"], mode="tis", cap=1.2
    )
    assert metrics["correction_truncated_frac"] == pytest.approx(float(corr["correction_truncated_frac"]))
    assert metrics["mismatch_ratio_max"] > math.exp(0.2)  # the rows shifted up by 0.3


def test_without_correction_the_mismatch_is_measured_and_nothing_changes():
    batch = batch_with_engine()
    cfg = lm_like_config(micro_batch_size=5)
    plain = gradients(cfg, {k: v for k, v in batch.items() if k != "rollout_log_prob"})
    measured = gradients(cfg, batch)
    for name in ACTOR + CRITIC:
        torch.testing.assert_close(measured[name], plain[name], rtol=0, atol=0)


def test_a_fully_on_policy_update_measures_against_its_own_forward():
    """One optimizer step and no old_log_prob in the batch: the mismatch is taken against the
    first (only) mini-batch's own log-probs."""
    batch = batch_with_engine()
    policy = ToyPolicy()
    with torch.no_grad():
        own = policy.evaluate(batch)["log_prob"]
    batch["rollout_log_prob"] = own - 0.1 * batch["mask"]
    del batch["old_log_prob"]
    cfg = lm_like_config(micro_batch_size=5)  # one epoch, mini-batch = the batch
    metrics = PPOTrainer(cfg, policy, total_iterations=1).update(batch)
    assert metrics["mismatch_kl_k1"] == pytest.approx(-0.1, rel=1e-5)
    assert metrics["mismatch_ratio_max"] == pytest.approx(math.exp(0.1), rel=1e-5)


def test_a_correction_without_the_log_probs_it_needs_is_an_error():
    batch = make_batch()
    cfg = lm_like_config()
    cfg.algo.rollout_correction = "tis"
    with pytest.raises(ValueError, match="needs the batch's rollout_log_prob"):
        PPOTrainer(cfg, ToyPolicy(), total_iterations=1).update(batch)
