"""Critic-free estimators (GRPO, RLOO, REINFORCE++) build no critic.

No ``critic`` adapter or critic model, no value head, no optimizer state for them; the
update has no value term; checkpoints hold the actor alone; and a checkpoint written
when such runs still carried an untrained critic resumes into the run without one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from lm_helpers import randomize
from resume_helpers import LM_TIMING_KEYS, assert_same_metrics, copy_without_final_checkpoint, read_rows
from test_policy import handmade_batch, lm_config

from ppokit.cli import main
from ppokit.config import ConfigError
from ppokit.errors import UserError
from ppokit.lm.model.checkpoint import load_policy, load_trained_state, save_policy
from ppokit.lm.model.hf import load_tokenizer
from ppokit.lm.model.policy import build_policy
from ppokit.trainer import PPOTrainer

CPU = torch.device("cpu")
GRPO = {"adv_estimator": "grpo", "group_size": 2}
VALUE_METRICS = {"value_loss", "vf_clipfrac", "explained_variance"}


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_critic_free_estimators_build_no_critic_adapter(tiny_dir, estimator):
    cfg = lm_config(tiny_dir, algo={"adv_estimator": estimator, "group_size": 2})
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    assert not policy.has_critic and policy.value_head is None
    assert set(policy.lm.peft_config) == {"actor"}
    assert not any(".critic." in name for name, _ in policy.lm.named_parameters())
    [group] = policy.param_groups(cfg)
    assert group["name"] == "actor"
    assert {id(p) for p in group["params"]} == {id(p) for p in policy.adapter_parameters("actor")}
    with_critic = build_policy(lm_config(tiny_dir), tiny_dir, device=CPU, autocast_dtype=None)
    assert with_critic.has_critic and set(with_critic.lm.peft_config) == {"actor", "critic"}
    critic_size = sum(p.numel() for p in with_critic.adapter_parameters("critic")) + n_params(with_critic.value_head)
    assert n_params(policy) == n_params(with_critic) - critic_size


def test_full_mode_grpo_loads_no_critic_model(tiny_dir):
    gae = build_policy(lm_config(tiny_dir, model={"mode": "full"}), tiny_dir, device=CPU, autocast_dtype=None)
    cfg = lm_config(tiny_dir, model={"mode": "full"}, algo=GRPO)
    grpo = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    assert gae.critic_lm is not None and grpo.critic_lm is None and grpo.value_head is None
    assert n_params(grpo) == n_params(gae.lm)  # one model where gae holds two
    trainer = PPOTrainer(cfg, grpo, total_iterations=1)
    assert sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"]) == n_params(grpo.lm)


def test_critic_free_update_trains_the_actor_and_reports_no_value_metrics(tiny_dir):
    cfg = lm_config(tiny_dir, algo=GRPO)
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    randomize(policy)
    mb = handmade_batch(load_tokenizer(tiny_dir))
    with torch.no_grad():
        old = policy.log_probs(mb)["log_prob"]
        values = policy.values(mb)
    assert "values" not in policy.evaluate(mb) and not values.any()
    mask = mb["mask"]
    g = torch.Generator().manual_seed(3)
    batch = {
        **{k: v for k, v in mb.items() if k != "truncated"},
        "old_log_prob": old,
        "old_values": values,
        "advantages": torch.randn(mask.shape, generator=g) * mask,
        "returns": torch.zeros_like(mask),
    }
    before = [p.detach().clone() for p in policy.adapter_parameters("actor")]
    metrics = PPOTrainer(cfg, policy, total_iterations=1).update(batch)
    assert not VALUE_METRICS & set(metrics)
    assert {"policy_loss", "approx_kl", "clipfrac", "grad_norm/actor", "lr"} <= set(metrics)
    assert "grad_norm/critic" not in metrics
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.adapter_parameters("actor")))


def test_critic_warmup_without_a_critic_is_a_config_error(tiny_dir):
    with pytest.raises(
        ConfigError, match="train.critic_warmup=2 trains the critic, but algo.adv_estimator=grpo has none"
    ):
        lm_config(tiny_dir, algo=GRPO, train={"critic_warmup": 2, "iterations": 5})


def test_a_critic_path_without_a_critic_is_a_config_error(tiny_dir):
    with pytest.raises(
        ConfigError,
        match=r"model.critic_path=/some/critic is the critic's model, but "
        r"algo.adv_estimator=grpo trains no critic; remove model.critic_path",
    ):
        lm_config(tiny_dir, algo=GRPO, model={"mode": "full", "critic_path": "/some/critic"})


def test_a_critic_path_in_lora_mode_is_a_config_error(tiny_dir):
    with pytest.raises(
        ConfigError,
        match=r"in lora mode the critic is a LoRA adapter on model.path: "
        r"set model.mode=full, or remove model.critic_path",
    ):
        lm_config(tiny_dir, model={"mode": "lora", "critic_path": "/some/critic"})
    assert lm_config(tiny_dir, model={"mode": "full", "critic_path": "/some/critic"}).model.critic_path


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_checkpoint_of_a_critic_free_policy_holds_the_actor_alone(tiny_dir, tmp_path, mode):
    cfg = lm_config(tiny_dir, model={"mode": mode}, algo=GRPO)
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    randomize(policy)
    save_policy(policy, tmp_path / "ckpt", base_model=str(tiny_dir))
    files = {p.relative_to(tmp_path / "ckpt").parts[0] for p in (tmp_path / "ckpt").rglob("*")}
    assert "actor" in files and not {"critic", "value_head.safetensors"} & files
    assert json.loads((tmp_path / "ckpt" / "policy.json").read_text())["critic"] is False
    reloaded = load_policy(tmp_path / "ckpt")
    assert not reloaded.has_critic
    mb = handmade_batch(load_tokenizer(tiny_dir))
    with torch.no_grad():
        torch.testing.assert_close(reloaded.log_probs(mb)["log_prob"], policy.log_probs(mb)["log_prob"], rtol=0, atol=0)
    # a gae run cannot take this checkpoint's (missing) critic
    gae = build_policy(lm_config(tiny_dir, model={"mode": mode}), tiny_dir, device=CPU, autocast_dtype=None)
    with pytest.raises(UserError, match="has no critic"):
        load_trained_state(gae, tmp_path / "ckpt")


# ----------------------------------------------------------------------------- runs
ITERATIONS = 3
TIMING = LM_TIMING_KEYS


def grpo_run(tiny_dir, out: Path, name: str) -> Path:
    args = [
        "train",
        "arith",
        f"model.path={tiny_dir}",
        "data.prompts=arithmetic:digits=1",
        "data.reward=exact_match",
        "data.sft_epochs=0",
        "data.eval_size=4",
        f"train.iterations={ITERATIONS}",
        "train.batch_size=8",
        "train.mini_batch_size=4",
        "train.micro_batch_size=4",
        "train.epochs=2",
        "algo.adv_estimator=grpo",
        "algo.group_size=4",
        "rollout.max_new_tokens=2",
        "run.precision=fp32",
        "run.checkpoint_every=1",
        "run.keep_checkpoints=3",
        "run.tensorboard=false",
        "run.log_samples=3",
        "run.samples_every=1",
        "--output-dir",
        str(out),
        "--name",
        name,
        "--no-progress",
    ]
    assert main(args) == 0
    return out / name


@pytest.fixture(scope="module")
def finished(tiny_dir, tmp_path_factory) -> Path:
    return grpo_run(tiny_dir, tmp_path_factory.mktemp("grpo"), "run")


def test_a_grpo_run_resumes_exactly_without_a_critic(finished, tmp_path):
    assert not (finished / "checkpoint" / "critic").exists()
    assert not VALUE_METRICS & set(read_rows(finished)[-1])
    run = copy_without_final_checkpoint(finished, tmp_path / "run")
    (run / "samples.jsonl").write_text((run / "samples.jsonl").read_text() + '{"iteration": 2, "torn')
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert_same_metrics(read_rows(run), read_rows(finished), ITERATIONS, TIMING)
    # the samples after the checkpoint (and a torn line) are dropped, then written again
    assert (run / "samples.jsonl").read_text() == (finished / "samples.jsonl").read_text()


def test_samples_jsonl_holds_each_iterations_first_sequences_and_their_rewards(finished):
    rows = [json.loads(line) for line in (finished / "samples.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for r in rows:
        assert r["reward"] == float(r["response"].strip() == r["fields"]["answer"])  # exact_match
        assert set(r) == {
            "iteration",
            "prompt",
            "response",
            "reward",
            "length",
            "truncated",
            "fields",
            "reward_error",
            "reward_note",
        }
        assert r["reward_error"] is None and r["reward_note"] is None
        assert r["prompt"].endswith("=") and 1 <= r["length"] <= 2


def test_eval_and_export_of_a_grpo_run(finished, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from ppokit.commands.export import export_merged

    assert main(["eval", str(finished), "--prompts", "4"]) == 0
    out = capsys.readouterr().out
    assert "mean reward (greedy)" in out and re.search(r"^prompts +4$", out, re.M), out
    out = export_merged(finished, tmp_path / "merged")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    policy = load_policy(finished / "checkpoint")
    mb = handmade_batch(load_tokenizer(out))
    R = mb["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=mb["position_ids"]
        ).logits[:, -R - 1 : -1]
        want = policy.log_probs(mb)["log_prob"]
    got = torch.log_softmax(logits / policy.temperature, -1).gather(-1, mb["responses"][..., None]).squeeze(-1)
    mask = mb["mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-4, atol=1e-4)
