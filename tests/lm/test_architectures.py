"""The model families users bring beside Llama, each as a tiny random model with ppokit's character
tokenizer: the fused CPU kernels give transformers' own logits and gradients (or leave the model as
it is), a LoRA run of one PPO iteration trains, checkpoints and exports a model that transformers
loads again with its tokenizer, and layers peft's LoRA cannot adapt are one line before the run."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from ppokit.cli import main
from ppokit.commands.export import export_merged
from ppokit.config import load_config
from ppokit.lm.accel.kernels import cpu_library
from ppokit.lm.accel.kernels.fuse import fuse_cpu_kernels
from ppokit.lm.model.hf import load_tokenizer
from ppokit.lm.model.tiny import build_char_tokenizer
from ppokit.persistence.rundir import read_metrics
from ppokit.workloads import train

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
SPECIAL = dict(max_position_embeddings=128, pad_token_id=0, bos_token_id=2, eos_token_id=3)
# model type: (its config, the config's fields beyond SIZES and SPECIAL, whether rotary attention
# makes some layer a fused kernel's)
ARCHITECTURES = {
    "gemma": (transformers.GemmaConfig, dict(head_dim=16), True),
    "gemma2": (transformers.Gemma2Config, dict(head_dim=16, sliding_window=16), True),  # soft-capping, a window
    "gemma3_text": (transformers.Gemma3TextConfig, dict(head_dim=16, sliding_window=16), True),
    "phi3": (transformers.Phi3Config, {}, False),  # fused qkv and gate-up projections
    "phi": (transformers.PhiConfig, {}, True),  # partial rotary, an ungated MLP, LayerNorm
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16), True),
    "mistral": (transformers.MistralConfig, {}, True),
    "olmo2": (transformers.Olmo2Config, {}, True),
    "granite": (transformers.GraniteConfig, {}, True),  # attention, residual and logit multipliers
    "smollm3": (transformers.SmolLM3Config, {}, True),
    "starcoder2": (transformers.Starcoder2Config, {}, True),
    "gpt_neox": (transformers.GPTNeoXConfig, {}, False),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2), True),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        True,
    ),
}


# families peft's LoRA cannot adapt as all-linear says: (config, its fields, the layers it can adapt)
UNADAPTABLE = {
    "mamba": (transformers.MambaConfig, dict(hidden_size=64, num_hidden_layers=2), "[in_proj,x_proj,dt_proj]"),
    "llama4_text": (
        transformers.Llama4TextConfig,
        dict(SIZES, intermediate_size_mlp=128, head_dim=16, num_local_experts=2),
        "[q_proj,k_proj,v_proj,o_proj]",
    ),
}


def build_model(model_type: str, out: Path) -> Path:
    """A randomly initialised ``model_type`` model (seed 0) and the character tokenizer, saved in ``out``."""
    tokenizer = build_char_tokenizer()
    if model_type in UNADAPTABLE:
        config_class, fields, _ = UNADAPTABLE[model_type]
    else:
        config_class, extra, _ = ARCHITECTURES[model_type]
        fields = {k: v for k, v in SIZES.items() if not (model_type == "gpt_neox" and k == "num_key_value_heads")}
        fields.update(extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_class(vocab_size=len(tokenizer), **SPECIAL, **fields))
    model.generation_config = GenerationConfig(bos_token_id=2, eos_token_id=3, pad_token_id=0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def logits_and_gradients(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the unmasked positions and the gradient of their mean square, all parameters."""
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    logits.square().mean().backward()
    return logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.skipif(cpu_library() is None, reason="the fused CPU kernels could not be built here")
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_the_fused_cpu_kernels_give_transformers_logits_and_gradients(model_type, tmp_path):
    theirs = AutoModelForCausalLM.from_pretrained(build_model(model_type, tmp_path / model_type)).eval()
    mine = copy.deepcopy(theirs)
    fused = fuse_cpu_kernels(mine)
    assert (fused.get("attention", 0) > 0) == ARCHITECTURES[model_type][2], fused
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 50, (3, 40), generator=generator)  # 40 positions: past gemma2's window of 16
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding
    mask[1, :2] = 0
    want_logits, want_grads = logits_and_gradients(theirs, ids, mask)
    got_logits, got_grads = logits_and_gradients(mine, ids, mask)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=2e-6)
    torch.testing.assert_close(got_grads, want_grads, rtol=0, atol=1e-7)


def one_iteration(model_dir: Path, tmp_path: Path) -> list[str]:
    """The overrides of a one-iteration arith run on ``model_dir`` with a reward that is dense for an
    untrained model (the share of digits in the response), no warm start, no evaluation."""
    reward = tmp_path / "digits.py"
    reward.write_text("def digits(prompt, response, **fields):\n    return sum(c.isdigit() for c in response) / 4\n")
    return [
        f"model.path={model_dir}",
        f"data.reward={reward}:digits",
        "data.sft_epochs=0",
        "data.eval_size=0",
        "train.iterations=1",
        "train.batch_size=8",
        "train.mini_batch_size=8",
        "rollout.max_new_tokens=4",
        "run.precision=fp32",
        "run.torch_threads=1",
        "run.progress=false",
        "run.tensorboard=false",
    ]


@pytest.mark.parametrize("model_type", ["gemma2", "phi3", "gpt_neox", "qwen3_moe"])
def test_a_lora_run_trains_one_iteration_and_exports_a_model_transformers_loads(model_type, tmp_path):
    model_dir = build_model(model_type, tmp_path / "model")
    train(load_config("arith", one_iteration(model_dir, tmp_path)), tmp_path / "run")
    (row,) = read_metrics(tmp_path / "run")
    assert row["grad_norm/actor"] > 0 and row["grad_norm/critic"] > 0, row
    exported = export_merged(tmp_path / "run", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(exported)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(merged) is type(base)
    assert sum(p.numel() for p in merged.parameters()) == sum(p.numel() for p in base.parameters())
    changed = [n for (n, a), b in zip(merged.named_parameters(), base.parameters()) if not torch.equal(a, b)]
    assert changed, "the exported actor is the untrained base model"
    assert load_tokenizer(exported).eos_token_id == 3


@pytest.mark.parametrize("model_type", UNADAPTABLE)
def test_layers_peft_cannot_adapt_are_one_line_before_the_run_and_the_named_ones_train(model_type, tmp_path, capsys):
    """all-linear names Mamba's out_proj and conv1d, which peft refuses, and Llama 4's router, a linear
    layer returning a tuple, on which peft's LoRA fails at the first forward pass: one line, exit status
    2, no run directory; with the layers the line points to listed, the run trains."""
    model_dir = build_model(model_type, tmp_path / "model")
    overrides = [*one_iteration(model_dir, tmp_path), f"run.output_dir={tmp_path}", "run.name=run"]
    capsys.readouterr()
    assert main(["train", "arith", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.lora_target_modules=all-linear: peft's LoRA cannot adapt" in err, err
    assert "its linear layers are" in err and not (tmp_path / "run").exists()
    named = UNADAPTABLE[model_type][2]
    assert main(["train", "arith", *overrides, f"model.lora_target_modules={named}"]) == 0
    assert len(read_metrics(tmp_path / "run")) == 1
