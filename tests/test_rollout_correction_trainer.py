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


# ---- rejection rules in the update, and bypass mode


@pytest.mark.parametrize("mode", ["none", "tis"])
def test_rejection_drops_tokens_from_the_actor_loss_and_its_normaliser_only(mode):
    """verl's decoupled_k3_rs (none) and decoupled_k3_rs_token_tis (tis): a rejected row's tokens
    leave the actor's terms as if they were padding; the critic fits every token."""
    batch = batch_with_engine(shift=0.3)
    cfg = lm_like_config(micro_batch_size=4)
    cfg.algo.rollout_correction, cfg.algo.rollout_correction_cap = mode, 1.2
    cfg.algo.rollout_correction_rs, cfg.algo.rollout_correction_rs_threshold = "seq_mean_k3", 0.05
    corrected = gradients(cfg, batch)
    old, engine, mask = batch["old_log_prob"], batch["rollout_log_prob"], batch["mask"]
    keep, _ = algo.rollout_rejection(old, engine, mask, [("seq_mean_k3", None, 0.05)])
    assert 0 < keep.sum() < mask.sum()
    actor_view = {k: v for k, v in batch.items() if k != "rollout_log_prob"}
    actor_view["mask"] = keep
    if mode == "tis":
        rho = algo.correction_ratio(old, engine, mask, "token")
        actor_view["advantages"] = batch["advantages"] * rho.clamp(max=1.2)
    cfg.algo.rollout_correction, cfg.algo.rollout_correction_rs, cfg.algo.rollout_correction_rs_threshold = (
        "none",
        None,
        None,
    )
    actor_expected = gradients(cfg, actor_view)
    critic_expected = gradients(cfg, {k: v for k, v in batch.items() if k != "rollout_log_prob"})
    for name in ACTOR:
        torch.testing.assert_close(corrected[name], actor_expected[name], rtol=1e-5, atol=1e-7)
    for name in CRITIC:
        torch.testing.assert_close(corrected[name], critic_expected[name], rtol=1e-5, atol=1e-7)


def test_the_update_logs_the_rejection_and_weight_metrics():
    batch = batch_with_engine(shift=0.3)
    cfg = lm_like_config(micro_batch_size=4, mini_batch_size=6, epochs=2)
    cfg.algo.rollout_correction, cfg.algo.rollout_correction_cap = "tis", 1.2
    cfg.algo.rollout_correction_rs, cfg.algo.rollout_correction_rs_threshold = "token_k1", "0.8_1.25"
    metrics = PPOTrainer(cfg, ToyPolicy(), total_iterations=1).update(batch)
    _, _, want = algo.rollout_correction(
        batch["old_log_prob"],
        batch["rollout_log_prob"],
        batch["mask"],
        mode="tis",
        cap=1.2,
        rejection=[("token_k1", 0.8, 1.25)],
    )
    for key in (
        "correction_ess",
        "correction_weight_max",
        "correction_weight_min",
        "correction_masked_frac",
        "correction_seq_masked_frac",
        "correction_rs_token_k1_masked_frac",
    ):
        assert metrics[key] == pytest.approx(float(want[key]), rel=1e-6), key
    assert 0 < metrics["correction_masked_frac"] < 1


def engine_equal_to_the_policy(seed: int = 0):
    """A batch whose old and engine log-probs are both the toy policy's own (the sampling weights)."""
    batch = make_batch(seed=seed)
    with torch.no_grad():
        own = ToyPolicy().evaluate(batch)["log_prob"]
    batch["old_log_prob"] = own * batch["mask"]
    batch["rollout_log_prob"] = own * batch["mask"]
    return batch


def test_bypass_gives_the_same_update_when_the_engine_equals_the_trainer():
    batch = engine_equal_to_the_policy()
    params = {}
    for bypass in (False, True):
        cfg = lm_like_config(micro_batch_size=5, mini_batch_size=6, epochs=3)
        cfg.algo.rollout_correction_bypass = bypass
        policy = ToyPolicy()
        metrics = PPOTrainer(cfg, policy, total_iterations=1).update(
            {k: v for k, v in batch.items() if not (bypass and k == "old_log_prob")}  # bypass needs none
        )
        params[bypass] = {k: v.detach().clone() for k, v in policy.named_parameters()}
        assert metrics["epochs"] == 3.0
    for name in ACTOR + CRITIC:
        torch.testing.assert_close(params[True][name], params[False][name], rtol=1e-6, atol=1e-7)
    assert metrics["mismatch_kl"] == pytest.approx(0.0, abs=1e-7)  # from the first mini-batch's own forward


def test_bypass_takes_every_ratio_against_the_engine_and_measures_the_mismatch():
    """The first mini-batch too: the update is the one whose old log-probs are the engine's (the
    trainer's off-policy path, which keeps the batch's old_log_prob on the first mini-batch)."""
    batch = batch_with_engine(shift=0.2)
    cfg = lm_like_config(micro_batch_size=5)
    cfg.algo.rollout_correction_bypass = True
    bypassed = gradients(cfg, {k: v for k, v in batch.items() if k != "old_log_prob"})
    ref = lm_like_config(micro_batch_size=5)
    ref.rollout.off_policy_steps = 1
    behaviour = {k: v for k, v in batch.items() if k != "rollout_log_prob"}
    behaviour["old_log_prob"] = batch["rollout_log_prob"]
    expected = gradients(ref, behaviour)
    for name in ACTOR + CRITIC:
        torch.testing.assert_close(bypassed[name], expected[name], rtol=1e-5, atol=1e-7)
    plain = gradients(lm_like_config(micro_batch_size=5), behaviour)  # first ratio 1: another gradient
    assert not torch.allclose(plain["actor.weight"], bypassed["actor.weight"], atol=1e-4)
    policy = ToyPolicy()
    with torch.no_grad():
        own = policy.evaluate(batch)["log_prob"]
    metrics = PPOTrainer(cfg, policy, total_iterations=1).update(batch)  # one mini-batch: every row
    want = algo.mismatch_metrics(own, batch["rollout_log_prob"], batch["mask"])
    for key, value in want.items():
        assert metrics[key] == pytest.approx(float(value), rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("micro", [12, 5])
def test_bypass_rejection_is_tested_against_the_current_policy_in_each_pass(micro):
    """verl's bypass_ppo_clip_k3_rs: the rule compares the current log-probs with the engine's; the
    normaliser keeps the rejected tokens (zero advantages there give the same gradient)."""
    batch = batch_with_engine(shift=0.3)
    cfg = lm_like_config(micro_batch_size=micro)
    cfg.algo.entropy_coeff = 0.0
    cfg.algo.rollout_correction_bypass = True
    cfg.algo.rollout_correction_rs, cfg.algo.rollout_correction_rs_threshold = "seq_mean_k3", 0.05
    bypassed = gradients(cfg, {k: v for k, v in batch.items() if k != "old_log_prob"})
    with torch.no_grad():
        own = ToyPolicy().evaluate(batch)["log_prob"]  # the current policy before the first step
    keep, _ = algo.rollout_rejection(own, batch["rollout_log_prob"], batch["mask"], [("seq_mean_k3", None, 0.05)])
    assert 0 < keep.sum() < batch["mask"].sum()
    ref = lm_like_config(micro_batch_size=micro)
    ref.algo.entropy_coeff = 0.0
    ref.rollout.off_policy_steps = 1
    view = {k: v for k, v in batch.items() if k != "rollout_log_prob"}
    view["old_log_prob"], view["advantages"] = batch["rollout_log_prob"], batch["advantages"] * keep
    expected = gradients(ref, view)
    for name in ACTOR + CRITIC:
        torch.testing.assert_close(bypassed[name], expected[name], rtol=1e-5, atol=1e-7)


def test_bypass_without_engine_log_probs_is_an_error():
    cfg = lm_like_config()
    cfg.algo.rollout_correction_bypass = True
    with pytest.raises(ValueError, match="algo.rollout_correction_bypass needs the batch's rollout_log_prob"):
        PPOTrainer(cfg, ToyPolicy(), total_iterations=1).update(make_batch())


class CountingPolicy:
    """What the scorer calls, counting the actor's log-prob passes."""

    has_reference = False
    has_critic = True

    def __init__(self):
        self.actor_passes = 0

    def log_probs(self, mb):
        self.actor_passes += 1
        return {"log_prob": torch.full(mb["responses"].shape, -1.0)}

    def values(self, mb):
        return torch.zeros(mb["responses"].shape)


def scored_batch(bypass: bool, policy: CountingPolicy):
    from ppokit.components import Batch
    from ppokit.lm.scoring import Scorer

    n, p, r = 4, 3, 5
    mask = torch.ones(n, r)
    tensors = {
        "input_ids": torch.ones(n, p + r, dtype=torch.long),
        "attention_mask": torch.ones(n, p + r, dtype=torch.long),
        "position_ids": torch.arange(p + r).expand(n, -1),
        "responses": torch.ones(n, r, dtype=torch.long),
        "mask": mask,
        "scores": torch.ones(n),
        "rollout_log_prob": -0.5 * mask,
    }
    batch = Batch(tensors=tensors, samples=[], metrics={})
    Scorer(policy, 2, need_reference=False, need_old_log_prob=True, bypass=bypass).score(batch)
    return batch.tensors


def test_bypass_skips_the_actor_pass_of_the_scorer():
    policy = CountingPolicy()
    t = scored_batch(False, policy)
    assert policy.actor_passes == 2 and float(t["old_log_prob"][0, 0]) == -1.0  # the trainer's pass
    policy = CountingPolicy()
    t = scored_batch(True, policy)
    assert policy.actor_passes == 0  # no actor forward: the engine's log-probs are pi_old
    torch.testing.assert_close(t["old_log_prob"], t["rollout_log_prob"])
    assert "old_values" in t  # the critic still scores


def test_the_learner_asks_for_no_scored_old_log_prob_in_bypass():
    from types import SimpleNamespace

    from ppokit.lm.learner import LMLearner

    cfg = lm_like_config(epochs=2)
    trainer = PPOTrainer(cfg, ToyPolicy(), total_iterations=1)
    learner = SimpleNamespace(cfg=cfg, trainer=trainer, num_mini_batches=None)
    assert LMLearner.needs_scored_old_log_prob(learner)  # two epochs: the scorer's pass is needed
    cfg.algo.rollout_correction_bypass = True
    assert not LMLearner.needs_scored_old_log_prob(learner)
