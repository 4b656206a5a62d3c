"""The LM policy: adapter isolation, the reference, full mode, bad model inputs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from lm_helpers import randomize

from ppokit.config import build_config
from ppokit.errors import UserError
from ppokit.lm.generation.engine import assemble
from ppokit.lm.model.checkpoint import save_policy
from ppokit.lm.model.hf import load_causal_lm, load_tokenizer
from ppokit.lm.model.policy import build_policy
from ppokit.trainer import PPOTrainer

CPU = torch.device("cpu")


def lm_config(tiny_dir, **sections):
    base = {
        "workload": "lm",
        "model": {"path": str(tiny_dir)},
        "rollout": {"temperature": 0.7, "max_new_tokens": 6},
        "train": {
            "batch_size": 8,
            "micro_batch_size": 8,
            "epochs": 1,
            "grad_clip": None,
            "iterations": 1,
            "learning_rate": 1e-2,
            "critic_learning_rate": 1e-2,
            "lr_warmup_ratio": 0.0,
        },
        "run": {"precision": "fp32", "progress": False, "tensorboard": False},
    }
    return build_config([base, sections])


def handmade_batch(tokenizer, n=4):
    """Prompts of different lengths (left padding) and responses with EOS at known places."""
    prompts = ["12+3=", "7+88=", "1=", "99+99="][:n]
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(4, tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else 50, (n, 6), generator=g)
    eos = tokenizer.eos_token_id
    raw[0, 2] = eos  # EOS in the middle: tokens after it are masked
    raw[1, 5] = eos  # EOS as the last token
    raw[3, 0] = eos  # an immediate EOS
    return assemble(enc["input_ids"], enc["attention_mask"], raw, eos_ids=[eos], pad_id=tokenizer.pad_token_id)


def grads_of(params):
    return [p.grad for p in params]


def nonzero(g):
    return g is not None and bool(g.abs().sum() > 0)


# ----------------------------------------------------------------------------- isolation
def test_actor_backward_reaches_only_the_actor_adapter(tiny_dir):
    cfg = lm_config(tiny_dir)
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    randomize(policy)
    mb = handmade_batch(load_tokenizer(tiny_dir))
    policy.log_probs(mb, entropy=True)["log_prob"].sum().backward()
    assert all(nonzero(g) for g in grads_of(policy.adapter_parameters("actor")))
    assert all(g is None for g in grads_of(policy.adapter_parameters("critic")))
    assert all(g is None for g in grads_of(policy.value_head.parameters()))
    frozen = [p for n, p in policy.lm.named_parameters() if "lora_" not in n]
    assert frozen and all(not p.requires_grad and p.grad is None for p in frozen)


def test_critic_backward_reaches_only_the_critic_adapter_and_value_head(tiny_dir):
    cfg = lm_config(tiny_dir)
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    randomize(policy)
    mb = handmade_batch(load_tokenizer(tiny_dir))
    policy.values(mb).sum().backward()
    assert all(nonzero(g) for g in grads_of(policy.adapter_parameters("critic")))
    assert all(nonzero(g) for g in grads_of(policy.value_head.parameters()))
    assert all(g is None for g in grads_of(policy.adapter_parameters("actor")))
    assert all(p.grad is None for n, p in policy.lm.named_parameters() if "lora_" not in n)


def test_one_backward_after_the_adapter_swap_reaches_both_adapters(tiny_dir, monkeypatch):
    # evaluate() runs the actor pass, then swaps to the critic adapter. peft's
    # set_adapter clears requires_grad on the actor's weights, and a leaf whose flag is
    # cleared before backward silently gets no gradient: LMPolicy.use restores it.
    cfg = lm_config(tiny_dir)
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    randomize(policy)
    mb = handmade_batch(load_tokenizer(tiny_dir))
    out = policy.evaluate(mb)
    (out["log_prob"].sum() + out["values"].sum()).backward()
    for name in ("actor", "critic"):
        assert all(nonzero(g) for g in grads_of(policy.adapter_parameters(name))), name
    # Without the restore the pitfall is real: the actor's gradient is lost.
    policy.zero_grad(set_to_none=True)
    monkeypatch.setattr(policy, "_restore_requires_grad", lambda: None)
    out = policy.evaluate(mb)
    (out["log_prob"].sum() + out["values"].sum()).backward()
    assert all(g is None for g in grads_of(policy.adapter_parameters("actor")))


def test_updates_never_change_the_backbone(tiny_dir):
    cfg = lm_config(tiny_dir)
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    randomize(policy)
    tok = load_tokenizer(tiny_dir)
    mb = handmade_batch(tok)
    with torch.no_grad():
        old = policy.log_probs(mb)["log_prob"]
        values = policy.values(mb)
    mask = mb["mask"]
    g = torch.Generator().manual_seed(3)
    batch = {
        **{k: v for k, v in mb.items() if k != "truncated"},
        "old_log_prob": old,
        "old_values": values,
        "advantages": torch.randn(mask.shape, generator=g) * mask,
        "returns": torch.randn(mask.shape, generator=g) * mask,
    }
    backbone = {n: p.detach().clone() for n, p in policy.lm.named_parameters() if "lora_" not in n}
    adapters = {n: p.detach().clone() for n, p in policy.lm.named_parameters() if "lora_" in n}
    trainer = PPOTrainer(cfg, policy, total_iterations=1)
    for _ in range(3):
        trainer.update(batch)
    for n, p in policy.lm.named_parameters():
        if n in backbone:
            assert torch.equal(p, backbone[n]), n
    changed = [n for n, p in policy.lm.named_parameters() if n in adapters and not torch.equal(p, adapters[n])]
    assert any(".actor." in n for n in changed) and any(".critic." in n for n in changed)


def test_param_groups_use_the_two_learning_rates(tiny_dir):
    cfg = lm_config(tiny_dir, train={"learning_rate": 1e-4, "critic_learning_rate": 3e-4})
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    actor, critic = policy.param_groups(cfg)
    assert (actor["name"], actor["lr"], critic["name"], critic["lr"]) == ("actor", 1e-4, "critic", 3e-4)
    assert {id(p) for p in actor["params"]} == {id(p) for p in policy.adapter_parameters("actor")}
    assert {id(p) for p in critic["params"]} == (
        {id(p) for p in policy.adapter_parameters("critic")} | {id(p) for p in policy.value_head.parameters()}
    )
    # and exactly those require grad from the start (the run's header counts them)
    assert {id(p) for p in policy.parameters() if p.requires_grad} == {
        id(p) for g in (actor, critic) for p in g["params"]
    }


def test_bf16_keeps_trained_weights_fp32_and_stores_the_frozen_backbone_in_bf16(tiny_dir):
    cfg = lm_config(tiny_dir, run={"precision": "bf16"})
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=torch.bfloat16)
    trained = {id(p) for g in policy.param_groups(cfg) for p in g["params"]}
    assert trained and all(p.dtype == torch.float32 for g in policy.param_groups(cfg) for p in g["params"])
    frozen = [p for p in policy.lm.parameters() if id(p) not in trained]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    out = policy.evaluate(handmade_batch(load_tokenizer(tiny_dir)))
    assert all(v.dtype == torch.float32 for v in out.values())
    (out["log_prob"].sum() + out["values"].sum()).backward()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for g in policy.param_groups(cfg) for p in g["params"])


def test_lora_layers_are_fused_by_the_cpu_acceleration_alone(tiny_dir, tmp_path):
    """A policy is plain peft; ppokit.lm.accel (one call, CPU only) swaps in the fused LoRA layers."""
    from peft.tuners.lora import Linear as LoraLinear

    from ppokit.lm.accel import accelerate_policy
    from ppokit.lm.model.checkpoint import load_policy

    def kinds(policy):
        return {type(m).__name__ for m in policy.lm.modules() if isinstance(m, LoraLinear)}

    policy = build_policy(lm_config(tiny_dir), tiny_dir, device=CPU, autocast_dtype=None)
    assert kinds(policy) == {"Linear"}
    accelerate_policy(policy)
    assert kinds(policy) == {"FusedLinear"}
    save_policy(policy, tmp_path / "ckpt", base_model=str(tiny_dir))
    reloaded = load_policy(tmp_path / "ckpt", trainable=True)
    assert kinds(reloaded) == {"Linear"}
    accelerate_policy(reloaded)
    assert kinds(reloaded) == {"FusedLinear"}


# ----------------------------------------------------------------------------- reference
def full_logits_log_probs(model, mb, temperature):
    """The plain way: all logits of a fresh model, log_softmax, gather (float64)."""
    R = mb["responses"].shape[1]
    with torch.no_grad():
        logits = (
            model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=mb["position_ids"])
            .logits[:, -R - 1 : -1]
            .double()
        )
    return torch.log_softmax(logits / temperature, -1).gather(-1, mb["responses"][..., None]).squeeze(-1)


def test_reference_is_the_base_model(tiny_dir):
    cfg = lm_config(tiny_dir)
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    randomize(policy)
    mb = handmade_batch(load_tokenizer(tiny_dir))
    fresh = load_causal_lm(tiny_dir)
    expected = full_logits_log_probs(fresh, mb, temperature=0.7).float()
    ref = policy.ref_log_probs(mb)
    mask = mb["mask"].bool()
    torch.testing.assert_close(ref[mask], expected[mask], rtol=1e-5, atol=1e-5)
    actor = policy.log_probs(mb)["log_prob"].detach()
    assert (actor[mask] - expected[mask]).abs().max() > 1e-2  # the adapters do matter
    # the reference pass leaves the adapters trainable
    assert all(p.requires_grad for p in policy.adapter_parameters("actor"))


# ----------------------------------------------------------------------------- full mode
def test_full_mode_separate_critic_and_reference_only_when_needed(tiny_dir):
    no_kl = build_policy(lm_config(tiny_dir, model={"mode": "full"}), tiny_dir, device=CPU, autocast_dtype=None)
    assert no_kl.ref_lm is None and not no_kl.has_reference and no_kl.critic_lm is not no_kl.lm
    cfg = lm_config(tiny_dir, model={"mode": "full"}, algo={"beta": 0.1})
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    assert policy.ref_lm is not None and not any(p.requires_grad for p in policy.ref_lm.parameters())
    mb = handmade_batch(load_tokenizer(tiny_dir))
    out = policy.evaluate(mb)
    (out["log_prob"].sum() + out["values"].sum()).backward()
    actor, critic = policy.param_groups(cfg)
    assert sum(nonzero(p.grad) for p in actor["params"]) > 0.8 * len(actor["params"])
    assert all(p.grad is None for p in policy.ref_lm.parameters())
    assert nonzero(policy.value_head.linear.weight.grad)
    assert {id(p) for p in actor["params"]}.isdisjoint({id(p) for p in critic["params"]})
    torch.testing.assert_close(policy.ref_log_probs(mb), out["log_prob"].detach())  # not trained yet


# ----------------------------------------------------------------------------- bad input
def test_model_path_that_does_not_exist(tmp_path):
    with pytest.raises(UserError, match="no such model directory") as info:
        load_causal_lm(tmp_path / "nope")
    assert "\n" not in str(info.value)


def test_directory_that_is_not_a_causal_lm(tmp_path):
    from transformers import ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path
    )
    with pytest.raises(UserError, match="ViTConfig is not a causal language model") as info:
        load_causal_lm(tmp_path)
    assert "\n" not in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="not a Hugging Face model directory"):
        load_causal_lm(empty)


def _without(tiny_dir, tmp_path, token):
    bad = tmp_path / "model"
    shutil.copytree(tiny_dir, bad)
    path = bad / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.pop(token)
    path.write_text(json.dumps(config))
    return bad


def test_a_tokenizer_without_eos_cannot_generate(tiny_dir, tmp_path):
    with pytest.raises(UserError, match="has no EOS token") as info:
        load_tokenizer(_without(tiny_dir, tmp_path, "eos_token"))
    assert "\n" not in str(info.value)


def test_a_tokenizer_without_a_pad_token_pads_with_eos(tiny_dir, tmp_path):
    """One rule for every loader: no pad token (Llama's tokenizers ship none) means EOS pads."""
    tok = load_tokenizer(_without(tiny_dir, tmp_path, "pad_token"))
    assert tok.pad_token_id == tok.eos_token_id and tok.padding_side == "left"
    enc = tok(["1+2=", "12+30="], padding=True)
    assert enc["input_ids"][0][:2] == [tok.eos_token_id] * 2 and enc["attention_mask"][0][:2] == [0, 0]


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "ppokit", *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_bad_inputs_exit_2_with_one_line(tiny_dir, tmp_path, monkeypatch, capsys):
    from ppokit import cli

    (tmp_path / "run.yaml").write_text(
        f"workload: lm\nmodel:\n  path: {tiny_dir}\ntrain:\n  iterations: 1\n  batch_size: 4\n"
    )
    # One real subprocess: exit status 2, one line on stderr, no traceback.
    proc = run_cli("train", "run.yaml", "model.path=" + str(tmp_path / "missing"), "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no such model directory" in lines[0] and "Traceback" not in proc.stderr
    # The other inputs through the same entry point, in-process.
    no_eos = tmp_path / "no_eos"
    shutil.copytree(tiny_dir, no_eos)
    config = json.loads((no_eos / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    (no_eos / "tokenizer_config.json").write_text(json.dumps(config))
    from transformers import ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path / "vit"
    )
    monkeypatch.chdir(tmp_path)
    cases = [
        (["data.reward=no_such_module_xyz:reward"], "cannot import module 'no_such_module_xyz'"),
        ([f"data.reward={tmp_path / 'missing.py'}:fn"], "does not exist"),
        ([f"model.path={no_eos}"], "has no EOS token"),
        ([f"model.path={tmp_path / 'vit'}"], "is not a causal language model"),
    ]
    for overrides, message in cases:
        capsys.readouterr()
        code = cli.main(["train", "run.yaml", *overrides, "run.tensorboard=false", "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], (overrides, err)
