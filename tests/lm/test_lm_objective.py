"""The language model's KL terms end to end: the exact KL over the vocabulary in the loss and
in the reward, the adaptive controller's input, and Dr.GRPO's horizon."""

from __future__ import annotations

import pytest
import torch
from lm_helpers import randomize
from test_policy import handmade_batch, lm_config

from ppokit import algo
from ppokit.lm.model.hf import load_causal_lm, load_tokenizer
from ppokit.lm.model.policy import build_policy
from ppokit.lm.scoring import Scorer
from ppokit.trainer import PPOTrainer

CPU = torch.device("cpu")


def float64_kl(policy, tiny_dir, batch, temperature):
    """KL(actor || reference) at each response position from full float64 logits: the actor
    is the backbone with the actor adapter merged in by hand, the reference the backbone."""
    R = batch["responses"].shape[1]

    def logits(model):
        out = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits[:, -R - 1 : -1]
        return out.double() / temperature

    with torch.no_grad(), policy.use("actor"):
        actor = logits(policy.lm)
    reference = logits(load_causal_lm(tiny_dir))
    p, q = torch.log_softmax(actor, -1), torch.log_softmax(reference, -1)
    return (p.exp() * (p - q)).sum(-1)  # (n, R)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_the_full_kl_in_the_loss_against_float64(tiny_dir, mode):
    cfg = lm_config(tiny_dir, model={"mode": mode}, algo={"beta": 0.3, "kl_loss_type": "full"})
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    assert policy.full_kl
    if mode == "lora":
        randomize(policy)
    else:
        with torch.no_grad():  # an actor away from its reference copy
            for p in policy.lm.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.02)
    batch = handmade_batch(load_tokenizer(tiny_dir))
    want = float64_kl(policy, tiny_dir, batch, cfg.rollout.temperature) if mode == "lora" else None
    out = policy.evaluate(batch)
    if mode == "full":
        with torch.no_grad():
            R = batch["responses"].shape[1]
            a = (
                policy.lm(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"],
                )
                .logits[:, -R - 1 : -1]
                .double()
                / 0.7
            )
            r = (
                policy.ref_lm(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"],
                )
                .logits[:, -R - 1 : -1]
                .double()
                / 0.7
            )
            want = algo.kl_full(a, r)
    mask = batch["mask"].bool()
    torch.testing.assert_close(out["kl_full"].double()[mask], want[mask], rtol=1e-4, atol=1e-6)
    assert want[mask].min() > 0
    # through the trainer: kl_loss is the token-mean of that KL, and it has a gradient
    trainer = PPOTrainer(cfg, policy, total_iterations=1)
    grads = []
    trainer.optimizer.step = lambda: grads.append([p.grad for p in trainer.params])
    tensors = {
        **batch,
        "old_values": torch.zeros_like(batch["mask"]),
        "advantages": torch.zeros_like(batch["mask"]),
        "returns": torch.zeros_like(batch["mask"]),
    }
    metrics = trainer.update(tensors)
    m = batch["mask"].double()
    assert metrics["kl_loss"] == pytest.approx(((want * m).sum() / m.sum()).item(), rel=1e-4)
    assert any(g is not None and g.abs().sum() > 0 for g in grads[0])  # zero advantages: the KL's gradient


def test_the_full_kl_in_the_reward_and_verls_controller_input(tiny_dir):
    cfg = lm_config(tiny_dir)
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None, need_reference=True)
    randomize(policy)
    batch = handmade_batch(load_tokenizer(tiny_dir))
    fed = []

    class Controller:
        value = 0.25

        def update(self, current_kl, n_steps):
            fed.append((current_kl, n_steps))

    scorer = Scorer(policy, 3, need_reference=False, kl_ctrl=Controller(), kl_penalty="full")
    from ppokit.components import Batch

    scores = torch.tensor([1.0, -2.0, 0.5, 3.0])
    b = Batch(tensors={**batch, "scores": scores})
    scorer.score(b)
    kl = float64_kl(policy, tiny_dir, batch, cfg.rollout.temperature) * batch["mask"].double()
    last = (batch["mask"].sum(1) - 1).long()
    want = -0.25 * kl
    want[torch.arange(4), last] += scores.double()
    torch.testing.assert_close(b.tensors["rewards"].double(), want, rtol=1e-4, atol=1e-6)
    # verl's input: each sequence's mean KL per token, averaged over the sequences
    per_seq = [kl[i][batch["mask"][i].bool()].mean() for i in range(4)]
    assert fed == [(pytest.approx(torch.stack(per_seq).mean().item(), rel=1e-4), 4)]
    assert b.metrics["kl_coef"] == 0.25


def test_the_lm_learner_uses_the_generation_budget_as_horizon(tiny_dir):
    from ppokit.lm.learner import LMLearner

    cfg = lm_config(
        tiny_dir,
        rollout={"max_new_tokens": 9},
        train={"batch_size": 8},
        algo={"loss_agg_mode": "seq-mean-token-sum-norm", "adv_estimator": "grpo", "group_size": 2},
    )
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    learner = LMLearner(cfg, policy, load_tokenizer(tiny_dir), tiny_dir)
    assert learner.trainer.horizon == 9
