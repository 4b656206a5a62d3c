"""Saving, reloading and exporting: the checkpoint and the merged model give the trained policy."""

from __future__ import annotations

import json

import pytest
import torch

from ppokit.commands.export import export_merged
from ppokit.config import build_config
from ppokit.errors import UserError
from ppokit.lm.generation.factory import make_engine
from ppokit.lm.model.checkpoint import load_policy
from ppokit.lm.model.hf import load_tokenizer
from ppokit.lm.model.stack import load_policy_stack


def train(tiny_dir, out, mode):
    """Two quick PPO iterations at a high learning rate: adapters far from their init."""
    from ppokit.workloads import train as train_lm

    out.mkdir(parents=True, exist_ok=True)
    reward = out / "length_reward.py"
    reward.write_text("def length(prompt, response, **fields):\n    return len(response) / 5\n")
    cfg = build_config(
        [
            {
                "workload": "lm",
                "model": {"path": str(tiny_dir), "mode": mode},
                "rollout": {"temperature": 0.8, "max_new_tokens": 5},
                "data": {"prompts": "arithmetic", "reward": f"{reward}:length", "eval_size": 0},
                "train": {
                    "iterations": 2,
                    "batch_size": 8,
                    "mini_batch_size": 8,
                    "micro_batch_size": 8,
                    "learning_rate": 3e-2 if mode == "lora" else 3e-3,
                    "critic_learning_rate": 1e-2,
                },
                "run": {"precision": "fp32", "progress": False, "tensorboard": False},
            }
        ]
    )
    train_lm(cfg, out)
    return cfg, out / "checkpoint"


@pytest.fixture(scope="module")
def lora_run(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-run")
    return train(tiny_dir, out, "lora")


def probe_batch(ckpt, policy, cfg):
    torch.manual_seed(0)
    tok = load_tokenizer(ckpt)
    return make_engine(policy, tok, cfg.rollout).generate(["12+34=", "5+6=", "77+8="], group_size=2)


def test_checkpoint_layout(lora_run):
    cfg, ckpt = lora_run
    # peft puts adapters with names other than "default" into sub-folders
    for name in ("actor", "critic"):
        assert (ckpt / name / "adapter_model.safetensors").is_file()
        assert json.loads((ckpt / name / "adapter_config.json").read_text())["r"] == cfg.model.lora_rank
    assert (ckpt / "value_head.safetensors").is_file() and (ckpt / "tokenizer_config.json").is_file()
    meta = json.loads((ckpt / "policy.json").read_text())
    assert meta["mode"] == "lora" and meta["temperature"] == cfg.rollout.temperature
    assert (ckpt / "meta.json").is_file() and (ckpt / "learner.safetensors").is_file()  # the run loop's state
    assert not (ckpt.parent / ".checkpoint.tmp").exists()


def test_reload_gives_the_trained_policy(lora_run, tiny_dir):
    cfg, ckpt = lora_run
    policy = load_policy(ckpt)
    ro = probe_batch(ckpt, policy, cfg)
    with torch.no_grad():
        lp = policy.log_probs(ro.tensors())["log_prob"]
        values = policy.values(ro.tensors())
        ref = policy.ref_log_probs(ro.tensors())
    mask = ro.mask.bool()
    assert (lp - ref)[mask].abs().max() > 1e-2  # the trained actor is not the base model
    assert values.abs().max() > 0  # nor is the value head its zero init
    again = load_policy(ckpt)
    with torch.no_grad():
        assert torch.equal(again.log_probs(ro.tensors())["log_prob"], lp)
        assert torch.equal(again.values(ro.tensors()), values)
    # and it is trainable again when asked
    trainable = load_policy(ckpt, trainable=True)
    assert all(p.requires_grad for p in trainable.adapter_parameters("actor"))
    # sampling (generate, chat, eval) loads the actor's adapter alone
    sampler = load_policy_stack(ckpt, cfg, device="cpu", precision="fp32").policy
    assert set(sampler.lm.peft_config) == {"actor"} < set(policy.lm.peft_config) and sampler.value_head is None
    with torch.no_grad():
        torch.testing.assert_close(sampler.log_probs(ro.tensors())["log_prob"][mask], lp[mask], rtol=1e-5, atol=1e-5)


def test_exported_model_gives_the_policy_log_probs(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, ckpt = lora_run
    policy = load_policy(ckpt)
    ro = probe_batch(ckpt, policy, cfg)
    with torch.no_grad():
        expected = policy.log_probs(ro.tensors())["log_prob"]
    out = export_merged(ckpt.parent, tmp_path / "export")
    assert not list(out.glob("adapter_*"))
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == load_tokenizer(ckpt).eos_token_id and tok.padding_side == "left"
    R = ro.responses.shape[1]
    with torch.no_grad():
        logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask, position_ids=ro.position_ids).logits[
            :, -R - 1 : -1
        ]
    got = torch.log_softmax(logits / policy.temperature, -1).gather(-1, ro.responses[..., None]).squeeze(-1)
    mask = ro.mask.bool()
    torch.testing.assert_close(got[mask], expected[mask], rtol=1e-4, atol=1e-4)
    with pytest.raises(UserError, match="not empty"):
        export_merged(ckpt.parent, out)


def test_full_mode_round_trip(tiny_dir, tmp_path):
    cfg, ckpt = train(tiny_dir, tmp_path / "run", "full")
    assert (ckpt / "actor" / "config.json").is_file() and (ckpt / "critic" / "config.json").is_file()
    policy = load_policy(ckpt)
    ro = probe_batch(ckpt, policy, cfg)
    with torch.no_grad():
        expected = policy.log_probs(ro.tensors())["log_prob"]
    out = export_merged(tmp_path / "run", tmp_path / "export")
    from ppokit.lm.model.hf import load_causal_lm

    model = load_causal_lm(out)
    R = ro.responses.shape[1]
    with torch.no_grad():
        logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask, position_ids=ro.position_ids).logits[
            :, -R - 1 : -1
        ]
    got = torch.log_softmax(logits / policy.temperature, -1).gather(-1, ro.responses[..., None]).squeeze(-1)
    torch.testing.assert_close(got[ro.mask.bool()], expected[ro.mask.bool()], rtol=1e-5, atol=1e-5)
    # generate, chat and eval load the actor alone: not the critic's whole model, nor its head
    sampler = load_policy_stack(ckpt, cfg, device="cpu", precision="fp32").policy
    assert sampler.critic_lm is None and sampler.value_head is None and policy.critic_lm is not None
    assert sum(p.numel() for p in sampler.parameters()) == sum(p.numel() for p in policy.lm.parameters())
    with torch.no_grad():
        actor_only = sampler.log_probs(ro.tensors())["log_prob"]
    torch.testing.assert_close(actor_only[ro.mask.bool()], expected[ro.mask.bool()], rtol=1e-5, atol=1e-5)


def test_export_of_a_directory_without_checkpoint(tmp_path):
    with pytest.raises(UserError, match="holds no LM checkpoint"):
        export_merged(tmp_path, tmp_path / "out")


def test_export_of_an_unfinished_run_names_its_newest_checkpoint(lora_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(lora_run[1], run / "checkpoints" / "iter-000002")  # a periodic one, no final one
    with pytest.raises(UserError, match=r"has no final checkpoint .*--resume .*checkpoints/iter-000002"):
        export_merged(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()
