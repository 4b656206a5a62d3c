"""Token-budget micro-batches (train.micro_batch_tokens) give the mini-batch's loss and gradient.

For each of the four aggregation modes, one optimizer step's gradient and losses with
micro-batches formed by a token budget (sorted by length, cut to their own longest row)
equal those of fixed micro-batches and of the whole mini-batch in one pass: on a toy
float64 policy exactly (1e-12), and on the tiny Llama with LoRA actor and critic within
float32 rounding. The scorer's passes agree the same way.
"""

from __future__ import annotations

import pytest
import torch
from lm_helpers import randomize

from ppokit.config import build_config
from ppokit.lm.generation.engine import assemble
from ppokit.lm.model.hf import load_tokenizer
from ppokit.lm.model.policy import LMPolicy, build_policy
from ppokit.lm.scoring import Scorer
from ppokit.trainer import PPOTrainer, StepPlan

CPU = torch.device("cpu")
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def lm_cfg(tiny_dir, mode, micro_batch_size=None, micro_batch_tokens=None, **algo):
    return build_config(
        [
            {
                "workload": "lm",
                "model": {"path": str(tiny_dir), "lora_rank": 4},
                "rollout": {"max_new_tokens": 12},
                "algo": {"loss_agg_mode": mode, "entropy_coeff": 0.01, "beta": 0.1, **algo},
                "train": {
                    "batch_size": 8,
                    "micro_batch_size": micro_batch_size,
                    "micro_batch_tokens": micro_batch_tokens,
                    "epochs": 1,
                    "grad_clip": None,
                    "iterations": 1,
                    "lr_warmup_ratio": 0.0,
                },
                "run": {"precision": "fp32", "progress": False, "tensorboard": False},
            }
        ]
    )


def mixed_batch(tokenizer, seed=0):
    """8 rows: prompts of 2 to 7 characters, responses ending (EOS) after 1 to 12 tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = ["1+2=", "12+34=", "5=", "123+4=", "9+9=", "77+1=", "1234+56=", "3="]
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    raw = torch.randint(4, 30, (8, 12), generator=g)
    for row, end in enumerate([0, 11, 3, 7, 1, 5, 9, 2]):
        raw[row, end] = tokenizer.eos_token_id
    return assemble(
        enc["input_ids"], enc["attention_mask"], raw, eos_ids=[tokenizer.eos_token_id], pad_id=tokenizer.pad_token_id
    )


def update_batch(policy, mb, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = mb["mask"]
    with torch.no_grad():
        old = policy.log_probs(mb)["log_prob"]
        ref = policy.ref_log_probs(mb)
    batch = {k: mb[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "mask")}
    noise = lambda: torch.randn(mask.shape, generator=g) * mask  # noqa: E731
    batch.update(
        old_log_prob=(old + 0.1 * noise()) * mask,
        ref_log_prob=(ref + 0.1 * noise()) * mask,
        advantages=noise(),
        returns=noise(),
        old_values=noise(),
    )
    return batch


def one_step(cfg, policy, batch):
    """Gradients and loss terms of one optimizer step (the step itself is not taken)."""
    trainer = PPOTrainer(cfg, policy, total_iterations=1)
    trainer._clip_and_step = lambda: {}  # keep the gradients, leave the weights
    plan = StepPlan(micro=cfg.micro_batch_size, horizon=batch["mask"].shape[1], critic_only=False, penalty_coef=None)
    totals, _ = trainer._optimizer_step(batch, plan)
    grads = [p.grad.detach().clone() for p in trainer.params]
    return grads, {k: float(v) for k, v in totals.items() if k != "grad_norm"}, trainer


@pytest.mark.parametrize("mode", MODES)
def test_tiny_llama_gradient_is_the_mini_batch_gradient(tiny_dir, mode):
    tokenizer = load_tokenizer(tiny_dir)
    policy = build_policy(lm_cfg(tiny_dir, mode, 8), tiny_dir, device=CPU, autocast_dtype=None)
    randomize(policy)
    batch = update_batch(policy, mixed_batch(tokenizer))
    whole, whole_terms, _ = one_step(lm_cfg(tiny_dir, mode, 8), policy, batch)
    fixed, fixed_terms, _ = one_step(lm_cfg(tiny_dir, mode, 3), policy, batch)
    budget, budget_terms, trainer = one_step(lm_cfg(tiny_dir, mode, 3, micro_batch_tokens=40), policy, batch)
    for grads, terms in ((fixed, fixed_terms), (budget, budget_terms)):
        for g, w in zip(grads, whole):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * float(w.abs().max()))
        for key in ("policy_loss", "value_loss", "entropy", "kl_loss"):
            assert terms[key] == pytest.approx(whole_terms[key], rel=1e-4, abs=1e-7), key
        if mode == "token-mean":  # rates are weighted by each micro-batch's share of the normaliser: tokens here
            for key in ("clipfrac", "approx_kl"):
                assert terms[key] == pytest.approx(whole_terms[key], rel=1e-4, abs=1e-7), key
    # the budget cut the padding: fewer positions computed than fixed micro-batches of the full width
    assert (
        float(trainer._positions_real) / trainer._positions_computed
        > float(batch["attention_mask"].sum()) / batch["attention_mask"].numel()
    )
    assert any(g.abs().sum() > 0 for g in budget)


class ToyPolicy(torch.nn.Module):
    """Per-position log-prob, value and entropy from a float64 linear map of token features."""

    def __init__(self, vocab=24, features=5):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(vocab, features, generator=g, dtype=torch.float64)  # fixed features
        self.w = torch.nn.Parameter(torch.randn(features, 3, generator=g, dtype=torch.float64))
        self.compact = LMPolicy.compact  # the LM policy's cut, on the same layout

    def param_groups(self, cfg):
        return [{"params": [self.w], "lr": 1e-3, "name": "actor"}]

    def evaluate(self, mb):
        R = mb["responses"].shape[1]
        out = self.table[mb["input_ids"][:, -R:]] @ self.w  # (n, R, 3)
        return {
            "log_prob": -torch.nn.functional.softplus(out[..., 0]),
            "values": out[..., 1],
            "entropy": torch.nn.functional.softplus(out[..., 2]),
        }


@pytest.mark.parametrize("mode", MODES)
def test_toy_policy_exact_in_float64(tiny_dir, mode):
    g = torch.Generator().manual_seed(5)
    n, P, R = 9, 5, 10
    prompt_len = torch.randint(1, P + 1, (n,), generator=g)
    response_len = torch.randint(1, R + 1, (n,), generator=g)
    cols = torch.arange(P + R)
    am = ((cols >= P - prompt_len[:, None]) & (cols < P + response_len[:, None])).long()  # (n, P + R)
    ids = torch.randint(1, 24, (n, P + R), generator=g) * am  # 0 on padding
    mask = am[:, P:].double()  # (n, R)
    noise = lambda: torch.randn(n, R, generator=g, dtype=torch.float64) * mask  # noqa: E731
    batch = {
        "input_ids": ids,
        "attention_mask": am,
        "position_ids": (am.cumsum(1) - 1).clamp(min=0),
        "responses": ids[:, P:].clone(),
        "mask": mask,
        "old_log_prob": noise() - 1,
        "advantages": noise(),
        "returns": noise(),
        "old_values": noise(),
    }
    results = []
    for micro, tokens in ((n, None), (2, None), (2, 24), (2, 7)):
        cfg = lm_cfg(tiny_dir, mode, micro, micro_batch_tokens=tokens, beta=0.0)
        results.append(one_step(cfg, ToyPolicy(), batch)[:2])
    (whole, whole_terms), *others = results
    for grads, terms in others:
        torch.testing.assert_close(grads[0], whole[0], rtol=1e-12, atol=1e-14)
        for key in ("policy_loss", "value_loss", "entropy"):
            assert terms[key] == pytest.approx(whole_terms[key], rel=1e-12, abs=1e-14), key


def test_scorer_passes_agree_with_a_token_budget(tiny_dir):
    tokenizer = load_tokenizer(tiny_dir)
    policy = build_policy(lm_cfg(tiny_dir, "token-mean", 8), tiny_dir, device=CPU, autocast_dtype=None)
    randomize(policy)
    mb = mixed_batch(tokenizer, seed=3)
    fixed = Scorer(policy, 3, need_reference=True).forward_passes(mb)
    budget = Scorer(policy, 3, need_reference=True, micro_batch_tokens=30).forward_passes(mb)
    assert fixed.keys() == budget.keys() == {"old_log_prob", "old_values", "ref_log_prob"}
    for key in fixed:
        torch.testing.assert_close(budget[key], fixed[key], rtol=1e-4, atol=1e-5)
        assert not budget[key][mb["mask"] == 0].any()


def test_compact_drops_only_padding(tiny_dir):
    mb = mixed_batch(load_tokenizer(tiny_dir))
    rows = torch.tensor([0, 4, 7])  # responses of 1, 2 and 3 tokens
    part = LMPolicy.compact({k: v[rows] for k, v in mb.items() if k != "truncated"})
    assert part["responses"].shape[1] == 3 and part["mask"].shape == (3, 3)
    assert int(part["attention_mask"].sum()) == int(mb["attention_mask"][rows].sum())
    assert part["input_ids"].shape[1] == int(mb["attention_mask"][rows, :-12].sum(1).max()) + 3
