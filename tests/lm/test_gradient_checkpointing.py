"""train.gradient_checkpointing: the update's gradients are those of the run without it, in lora
mode (actor and critic adapters replayed in one backward pass) and in full mode; fewer
activations are kept; the auto setting."""

from __future__ import annotations

import pytest
import torch
from lm_helpers import randomize
from test_policy import handmade_batch, lm_config

from ppokit.lm.model.hf import load_tokenizer
from ppokit.lm.model.policy import build_policy, gradient_checkpointing_wanted
from ppokit.trainer import PPOTrainer

CPU = torch.device("cpu")


def _batch(tokenizer):
    batch = handmade_batch(tokenizer)
    g = torch.Generator().manual_seed(4)
    mask = batch["mask"]
    return {
        **batch,
        "old_log_prob": torch.zeros_like(mask),
        "old_values": torch.randn(mask.shape, generator=g) * mask,
        "advantages": torch.randn(mask.shape, generator=g) * mask,
        "returns": torch.randn(mask.shape, generator=g) * mask,
        "ref_log_prob": -torch.rand(mask.shape, generator=g) * mask,
    }


def _policy(cfg, tiny_dir, mode, checkpointing, cpu_kernels=False):
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None, seed=0)
    if mode == "lora":
        randomize(policy)
    else:
        with torch.no_grad():  # an actor away from its reference copy, a critic with a value head
            g = torch.Generator().manual_seed(0)
            for p in policy.lm.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
            policy.value_head.linear.weight.copy_(torch.randn(policy.value_head.linear.weight.shape, generator=g))
    if cpu_kernels:
        from ppokit.lm.accel import accelerate_policy

        accelerate_policy(policy)
    if checkpointing:
        assert policy.enable_gradient_checkpointing() == (2 if mode == "lora" else 4)  # 2 layers per model
    return policy


def _gradients(cfg, policy, batch):
    trainer = PPOTrainer(cfg, policy, total_iterations=1)
    return trainer.mini_batch_gradients(batch)


@pytest.mark.parametrize(
    "mode,cpu_kernels,sections",
    [
        ("lora", False, {}),
        ("lora", True, {}),
        ("lora", False, {"algo": {"beta": 0.2, "kl_loss_type": "full", "entropy_coeff": 0.01}}),
        ("lora", False, {"algo": {"beta": 0.2, "kl_loss_type": "k3"}, "train": {"micro_batch_size": 2}}),
        ("full", False, {}),
        ("full", False, {"algo": {"beta": 0.2, "kl_loss_type": "full", "entropy_coeff": 0.01}}),
    ],
)
def test_gradients_equal_the_run_without_checkpointing(tiny_dir, mode, cpu_kernels, sections):
    cfg = lm_config(tiny_dir, model={"mode": mode}, **sections)
    batch = _batch(load_tokenizer(tiny_dir))
    want = _gradients(cfg, _policy(cfg, tiny_dir, mode, False, cpu_kernels), batch)
    policy = _policy(cfg, tiny_dir, mode, True, cpu_kernels)
    got = _gradients(cfg, policy, batch)
    assert set(got) == set(want)
    nonzero = 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
        nonzero += bool(want[name].abs().sum() > 0)
    assert nonzero == len(want)  # every trained tensor (both adapters or models, value head) has one
    if mode == "lora":
        # the replay left the adapters trainable and the policy's record of the active adapter true
        assert all(p.requires_grad for name in policy.adapter_names for p in policy.adapter_parameters(name))
        assert policy.lm.active_adapter == policy._active
        # the checkpointing also holds across a second micro-batch and an optimizer step
        trainer = PPOTrainer(cfg, policy, total_iterations=1)
        twin = _policy(cfg, tiny_dir, mode, False, cpu_kernels)
        plain = PPOTrainer(cfg, twin, total_iterations=1)
        for _ in range(2):
            a, b = trainer.update(batch), plain.update(batch)
            assert a["policy_loss"] == pytest.approx(b["policy_loss"], rel=1e-5, abs=1e-7)
        for p, q in zip(trainer.params, plain.params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _saved_bytes(policy, batch) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of one evaluate()."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = policy.evaluate(batch)
    (out["log_prob"].sum() + out["values"].sum()).backward()
    return total


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_checkpointing_keeps_fewer_activations(tiny_dir, mode):
    cfg = lm_config(tiny_dir, model={"mode": mode})
    batch = handmade_batch(load_tokenizer(tiny_dir))
    plain = _saved_bytes(_policy(cfg, tiny_dir, mode, False), batch)
    checkpointed = _saved_bytes(_policy(cfg, tiny_dir, mode, True), batch)
    assert checkpointed < 0.6 * plain, (checkpointed, plain)


def test_scoring_and_generation_are_untouched(tiny_dir):
    """No-grad passes (scoring, generation with its KV cache) run the layers as they are: the same
    log-probs, and generation still uses its cache; the models stay in eval() but for the
    checkpointed layers' own flag."""
    from ppokit.lm.generation.engine import HFEngine

    cfg = lm_config(tiny_dir)
    batch = handmade_batch(load_tokenizer(tiny_dir))
    plain, checkpointed = _policy(cfg, tiny_dir, "lora", False), _policy(cfg, tiny_dir, "lora", True)
    with torch.no_grad():
        torch.testing.assert_close(checkpointed.log_probs(batch)["log_prob"], plain.log_probs(batch)["log_prob"])
    # only the decoder layers' own flags changed (peft's LoRA wrappers are in training mode either way)
    flagged = {name for name, m in checkpointed.lm.named_modules() if m.training}
    before = {name for name, m in plain.lm.named_modules() if m.training}
    assert flagged - before == {"base_model.model.model.layers.0", "base_model.model.model.layers.1"}
    assert before <= flagged
    tokenizer = load_tokenizer(tiny_dir)
    torch.manual_seed(0)
    a = HFEngine.for_policy(plain, tokenizer, cfg.rollout).generate(["1+2="], greedy=True)
    torch.manual_seed(0)
    b = HFEngine.for_policy(checkpointed, tokenizer, cfg.rollout).generate(["1+2="], greedy=True)
    assert a.texts == b.texts


def test_auto_is_on_for_large_models_on_an_accelerator_only():
    small, large = 1_000_000, 400_000_000
    assert not gradient_checkpointing_wanted("auto", torch.device("cpu"), large)
    assert not gradient_checkpointing_wanted("auto", torch.device("cuda"), small)
    assert gradient_checkpointing_wanted("auto", torch.device("cuda"), large)
    assert gradient_checkpointing_wanted(True, torch.device("cpu"), small)
    assert not gradient_checkpointing_wanted(False, torch.device("cuda"), large)


def test_build_policy_applies_the_setting(tiny_dir):
    cfg = lm_config(tiny_dir, train={"gradient_checkpointing": True})
    on = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    assert on.checkpointed_layers == 2
    auto = build_policy(lm_config(tiny_dir), tiny_dir, device=CPU, autocast_dtype=None)
    assert auto.checkpointed_layers == 0  # the tiny model on a CPU: auto is off
