"""ppokit.lm.model.memory: the model's shape from its config, the estimate's terms, the estimate
against a measured run, the refusal, and every preset, demo and bench run fitting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppokit.config import build_config, load_config, preset_names
from ppokit.errors import UserError
from ppokit.lm.model import memory
from ppokit.lm.model.memory import (
    GB,
    ModelShape,
    check_fits,
    estimate_memory,
    model_shape,
    multi_turn_rows,
    state_prompt_tokens,
)

ROOT = Path(__file__).resolve().parents[2]


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- the shape
def test_the_shape_counts_the_parameters_of_llama_and_qwen2_models(tiny_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

    shape = model_shape(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert shape.num_parameters == _count(model)
    assert shape.vocab_size == 56 and shape.num_layers == 2 and shape.max_positions == 64
    for tied in (False, True):
        config = Qwen2Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
            tie_word_embeddings=tied,
        )
        qwen = AutoModelForCausalLM.from_config(config)
        assert ModelShape.from_hf_config(config).num_parameters == _count(qwen), tied  # q, k, v biases, GQA
    # GPT-2 (ungated MLP, learned positions and biases the formula leaves out): within 5%
    gpt2 = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=64)
    count = _count(AutoModelForCausalLM.from_config(gpt2))
    assert ModelShape.from_hf_config(gpt2).num_parameters == pytest.approx(count, rel=0.05)


def test_the_shape_counts_the_experts_of_a_mixture_of_experts(tmp_path):
    """A mixture of experts holds every expert's MLP, which the dense formula counts once (Mixtral-8x7B:
    7.2B parameters by the formula, 46.7B in the model): model_shape counts the parameters on the model
    its config builds (on the meta device), so the weights are not underestimated."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    from ppokit.lm.model.hf import meta_model

    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    configs = {
        "mixtral": MixtralConfig(**sizes, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2),
        "qwen3_moe": Qwen3MoeConfig(**sizes, intermediate_size=128, moe_intermediate_size=32, num_experts=16),
    }
    for name, config in configs.items():
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(tmp_path / name)
        shape = model_shape(tmp_path / name)
        assert shape.num_parameters == _count(model), name
        assert ModelShape.from_hf_config(config).num_parameters < _count(model) / 2, name  # the formula alone
    assert meta_model(object()) is None  # not a config transformers can build: the formula is used


def test_the_estimate_counts_the_adapters_peft_puts_on_every_expert(tmp_path):
    """peft's all-linear puts LoRA adapters on each expert of a mixture of experts; the run's estimate
    counts them on peft's model of the meta-device model, where the dense formula counts one MLP."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from ppokit.lm.model.policy import build_policy
    from ppokit.lm.model.tiny import build_char_tokenizer

    config = Qwen3MoeConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=16,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    build_char_tokenizer().save_pretrained(tmp_path / "moe")
    cfg = build_config([{"workload": "lm", "model": {"path": str(tmp_path / "moe")}, "run": {"device": "cpu"}}])
    estimator = memory.Estimator.for_run(cfg, memory.IterationSizes(20))
    policy = build_policy(cfg, tmp_path / "moe", device=torch.device("cpu"), autocast_dtype=None)
    actor = sum(p.numel() for p in policy.adapter_parameters("actor"))
    rank, targets = cfg.model.lora_rank, cfg.model.lora_target_modules
    assert estimator.model.lora_parameters(rank, targets) == actor
    assert ModelShape.from_hf_config(config).lora_parameters(rank, targets) < actor / 2  # the formula alone


def test_a_lora_run_s_checks_and_estimate_build_the_model_on_the_meta_device_once(tmp_path, monkeypatch):
    """The pre-start checks (the targets are in the model, peft adapts them) and the estimate (the
    parameters, the adapters; asked again by the micro-batch sizing) read one meta-device model of a
    config, and peft wraps it once (0.5-1 s for SmolLM2-135M): each start built it three to five times."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ppokit.lm.model import policy
    from ppokit.lm.model.policy import check_model_options
    from ppokit.lm.model.tiny import build_char_tokenizer

    sizes = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, vocab_size=72)
    config = LlamaConfig(**sizes)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    build_char_tokenizer().save_pretrained(tmp_path / "llama")
    builds = []
    from_config = AutoModelForCausalLM.from_config
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", lambda *a, **k: builds.append(1) or from_config(*a, **k))
    wraps = []
    monkeypatch.setattr(policy, "get_peft_model", lambda *a, **k: wraps.append(1) or get_peft_model(*a, **k))
    for targets in (["q_proj", "v_proj"], "all-linear"):
        model = {"path": str(tmp_path / "llama"), "lora_target_modules": targets}
        cfg = build_config([{"workload": "lm", "model": model, "run": {"device": "cpu"}}])
        check_model_options(cfg.model)
        for _ in range(2):
            estimator = memory.Estimator.for_run(cfg, memory.IterationSizes(20))
        assert estimator.model.num_parameters == _count(from_config(config))
        assert len(builds) == 1, targets  # the checks' one model: its facts, peft's model and its adapters
        assert len(wraps) == 1, targets
        builds.clear()
        wraps.clear()


def test_the_tiny_spec_gives_the_shape_of_the_model_it_builds(tmp_path):
    from ppokit.lm.model.tiny import DEFAULT_TINY_SPEC, build_tiny_model

    built = model_shape(build_tiny_model(tmp_path / "tiny"))
    assert model_shape("tiny") == built
    assert built.num_parameters == DEFAULT_TINY_SPEC.num_parameters()


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], ["down_proj", "lm_head"]])
def test_lora_parameters_are_peft_s(tiny_dir, targets):
    from ppokit.lm.model.policy import build_policy

    cfg = build_config([{"workload": "lm", "model": {"path": str(tiny_dir), "lora_target_modules": targets}}])
    policy = build_policy(cfg, tiny_dir, device=torch.device("cpu"), autocast_dtype=None)
    actor = sum(p.numel() for p in policy.adapter_parameters("actor"))
    assert model_shape(tiny_dir).lora_parameters(8, targets) == actor


# ----------------------------------------------------------------------------- the terms
def _estimate(sft_eval_rows=None, **overrides):
    layers = [{"workload": "lm", "train": {"iterations": 1}}]
    for key, value in overrides.items():
        section, name = key.split("__")
        layers.append({section: {name: value}})
    cfg = build_config(layers)
    defaults = dict(prompt_tokens=100, bf16=True, device_type="cuda", checkpointing=False, eager_attention=False)
    return estimate_memory(cfg, QWEN_05B, sft_eval_rows=sft_eval_rows, **defaults)


# Qwen2.5-0.5B's shape (config.json of the hub model)
QWEN_05B = ModelShape(
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=4864,
    vocab_size=151936,
    tied_embeddings=True,
    attention_bias=True,
    max_positions=32768,
)


def test_the_terms_move_with_the_fields_that_set_them():
    assert QWEN_05B.num_parameters == 494_032_768  # the hub model's count
    base = _estimate()
    adapters = 2 * 24 * 8 * (2 * (896 + 896) + 2 * (896 + 128) + 3 * (896 + 4864))  # actor and critic, rank 8
    assert adapters == 8_798_208
    assert base.resident["weights"] == pytest.approx(2 * 494_032_768 + 4 * (adapters + 897), rel=1e-9)
    # rollout storage is linear in the batch
    double = _estimate(train__batch_size=512)
    assert double.resident["rollout"] == pytest.approx(2 * base.resident["rollout"])
    # micro-batches set the update's activations; gradient checkpointing keeps the layers' inputs only
    big = _estimate(train__micro_batch_size=8)
    assert big.phases["update"]["activations"] == pytest.approx(8 * base.phases["update"]["activations"])
    layers, H, u = 24, 896, 8 * 116  # 100 prompt tokens + 16 response tokens
    checkpointed = estimate_memory(
        build_config([{"workload": "lm", "train": {"iterations": 1, "micro_batch_size": 8}}]),
        QWEN_05B,
        prompt_tokens=100,
        bf16=True,
        device_type="cuda",
        checkpointing=True,
        eager_attention=False,
    )
    S = (10 * H + 4 * 4864) * 2
    assert checkpointed.phases["update"]["activations"] == pytest.approx(
        2 * layers * u * H * 2 + 3 * u * S + 2 * u * 12 * H
    )
    assert checkpointed.phases["update"]["activations"] < big.phases["update"]["activations"] / 4
    # no critic (GRPO): one pass, one adapter, no value head
    grpo = _estimate(algo__adv_estimator="grpo", algo__group_size=4)
    assert grpo.phases["update"]["activations"] == pytest.approx(base.phases["update"]["activations"] / 2)
    assert grpo.resident["optimizer"] < base.resident["optimizer"]
    # full fine-tuning: fp32 actor and critic with AdamW, a bf16 reference only with a KL term
    full = _estimate(model__mode="full")
    assert full.resident["weights"] == pytest.approx(4 * (2 * 494_032_768 + 897))
    with_ref = _estimate(model__mode="full", algo__beta=0.1)
    assert with_ref.resident["weights"] - full.resident["weights"] == pytest.approx(2 * 494_032_768)
    assert full.resident["optimizer"] == pytest.approx(12 * (2 * 494_032_768 + 897))
    # generation's KV cache: rows at a time x positions x layers
    gen = _estimate(rollout__micro_batch_size=128)
    assert gen.phases["generate"]["kv_cache"] == pytest.approx(2 * 25 * 128 * 128 * 116 * 2)


def test_a_message_mode_generation_prefills_the_conversation_so_far():
    """Each turn of a message-mode episode generates from its whole stream (no cache across turns):
    the prefill term is the longest prompt taken in, eager attention's scores quadratic in it."""
    cfg = build_config([{"workload": "lm", "train": {"iterations": 1}}])
    sizes = {"prompt_tokens": 40, "rows": 8, "response_tokens": 400, "bf16": False, "device_type": "cpu"}
    first = estimate_memory(cfg, QWEN_05B, **sizes, checkpointing=False, eager_attention=True)
    later = estimate_memory(cfg, QWEN_05B, **sizes, checkpointing=False, eager_attention=True, prefill_tokens=440)
    H, F, heads = 896, 4864, 14
    for est, taken_in in ((first, 40), (later, 440)):
        assert est.phases["generate"]["prefill"] == pytest.approx(
            8 * taken_in * (6 * H + 3 * F) * 4 + 8 * heads * taken_in**2 * 4, rel=1e-12
        )
    assert later.phases["update"] == first.phases["update"] and later.phases["score"] == first.phases["score"]


def test_the_largest_phase_and_part_and_the_message():
    est = _estimate(train__batch_size=10**8)
    assert est.largest_part()[0] == "rollout"
    assert est.total == max(est.phase_total(p) for p in ("generate", "score", "update"))
    cfg = build_config([{"workload": "lm", "train": {"iterations": 1, "batch_size": 10**8}}])
    check_fits(est, est.total, "enough", cfg)  # exactly enough: no error
    with pytest.raises(UserError) as err:
        check_fits(est, est.total - 1, "the machine has 1.0 GB available", cfg)
    line = str(err.value)
    assert line.startswith(f"not enough memory: this run needs about {est.total / GB:.1f} GB (largest phase: ")
    assert "rollout" in line and "lower train.batch_size (now 100000000)" in line and "\n" not in line


def test_the_warm_start_is_a_phase_only_with_sft_epochs_and_grows_with_its_batch():
    """The sft phase: the whole model trained in fp32 (weights, gradients and AdamW's moments) beside
    the runtime alone (it ends before the run's models and rollout exist); its step grows with
    data.sft_batch_size, and the refusal names it with the field that shrinks it."""
    assert "sft" not in _estimate().phases and "sft" not in _estimate(data__sft_epochs=0).phases
    one = _estimate(1, data__sft_epochs=1, data__sft_batch_size=1)
    many = _estimate(1, data__sft_epochs=1)  # one held-out row: the step is the larger moment
    sft = many.phases["sft"]
    W = QWEN_05B.num_parameters
    assert sft["sft_weights"] == 4 * W and sft["sft_optimizer"] == 12 * W and sft["sft_best_copy"] == 0  # cuda
    assert many.phase_total("sft") == pytest.approx(many.resident["runtime"] + sum(sft.values()))
    assert sft["sft_activations"] == pytest.approx(32 * one.phases["sft"]["sft_activations"])  # default batch 32
    assert many.phase_total("sft") > one.phase_total("sft")
    assert many.phases["update"] == one.phases["update"] and many.resident == one.resident
    cfg = build_config([{"workload": "lm", "train": {"iterations": 1}, "data": {"sft_epochs": 1}}])
    with pytest.raises(UserError) as err:
        check_fits(many, many.total - 1, "the machine has 1.0 GB available", cfg)
    assert many.largest_phase == "sft" and "(largest phase: sft; its largest part: sft_" in str(err.value)
    assert "lower data.sft_batch_size (now 32)" in str(err.value)
    # the held-out evaluation, when it is larger than a step: its answer loss over the answers' logits,
    # (e, R + 1, V) at most: the completion and EOS, never the prompt's positions
    held_cfg = build_config([{"workload": "lm", "data": {"sft_epochs": 1, "sft_batch_size": 1}}])
    held = estimate_memory(
        held_cfg,
        QWEN_05B,
        prompt_tokens=100,
        bf16=True,
        device_type="cpu",
        checkpointing=False,
        eager_attention=True,
        sft_eval_rows=64,
    )
    answers = held_cfg.rollout.max_new_tokens + 1
    assert held.phases["sft"]["sft_heldout"] >= 64 * answers * QWEN_05B.vocab_size * 16  # 16 bytes a logit
    assert held.phases["sft"]["sft_heldout"] < 64 * 116 * QWEN_05B.vocab_size * 16 / 4  # not (e, T, V)
    assert held.phases["sft"]["sft_best_copy"] == 4 * (W + QWEN_05B.vocab_size * 896)  # a tied embedding twice


def test_the_warm_start_s_held_out_batch_is_run_sft_s():
    from ppokit.lm.sft import SFTSettings

    assert SFTSettings().eval_batch_size == memory.SFT_EVAL_BATCH


def test_multi_turn_rows():
    cfg = build_config(
        [{"workload": "lm", "textenv": {"env": "tictactoe", "max_turns": 9}, "train": {"iterations": 1}}]
    )
    assert multi_turn_rows(cfg, 40, False, 64) == (256 * 9, 40, 16)
    # message mode: 9 replies and the 8 messages between them, each as long as the first without a probe
    assert multi_turn_rows(cfg, 40, True, 4096) == (512, 40, 9 * 16 + 8 * 40)
    assert multi_turn_rows(cfg, 40, True, 400) == (512, 40, 360)  # within the model's context
    assert multi_turn_rows(cfg, 40, True, 4096, seats=1) == (256, 40, 9 * 16 + 8 * 40)  # one trained seat
    # the environment's own turn limit, where it is lower than textenv.max_turns
    assert multi_turn_rows(cfg, 40, True, 4096, env_turns=6) == (512, 40, 6 * 16 + 5 * 40)
    assert multi_turn_rows(cfg, 40, False, 64, env_turns=6) == (256 * 6, 40, 16)
    assert multi_turn_rows(cfg, 40, False, 64, env_turns=50) == (256 * 9, 40, 16)
    # message mode with a probe's later observations: each turn's reply and the messages between,
    # the probe's longest repeated for the turns beyond it
    probe = [10, 12, 5]
    assert multi_turn_rows(cfg, 40, True, 4096, later_observations=probe) == (512, 40, 9 * 16 + 27 + 5 * 12)
    assert multi_turn_rows(cfg, 40, True, 4096, env_turns=2, later_observations=probe) == (512, 40, 2 * 16 + 10)
    assert multi_turn_rows(cfg, 40, True, 4096, later_observations=[]) == (512, 40, 9 * 16 + 8 * 40)
    assert multi_turn_rows(cfg, 40, False, 64, later_observations=[10]) == (256 * 9, 40, 16)  # state: unused
    # where an invalid reply is asked again, that message may come at any turn: the 8 largest of both
    assert multi_turn_rows(cfg, 40, True, 4096, later_observations=probe, retry_observation=11) == (
        512,
        40,
        9 * 16 + 12 + 7 * 11,
    )
    assert multi_turn_rows(cfg, 40, True, 4096, later_observations=probe, retry_observation=3) == (
        512,
        40,
        9 * 16 + 27 + 5 * 3,
    )


def test_a_multi_turn_run_is_sized_by_its_environment_s_own_turn_limit(chat_dir, monkeypatch):
    from ppokit.envs import make_env
    from ppokit.lm.multi_turn import sizing

    cfg = build_config(
        [
            {
                "workload": "lm",
                "model": {"path": str(chat_dir)},
                "data": {"chat_template": True},  # the calculator's messages need one
                "textenv": {"env": "calculator", "kwargs": {"observation_mode": "message"}},
                "train": {"iterations": 1},
            }
        ]
    )
    seen = []
    monkeypatch.setattr(
        sizing, "multi_turn_rows", lambda *args, **kw: seen.append(args) or multi_turn_rows(*args, **kw)
    )
    env = make_env("calculator", observation_mode="message")
    assert env.max_turns == 6 < cfg.textenv.max_turns == 32
    _sequences(cfg, env)
    (args,) = seen
    assert args[2] is True and args[-1] == 6  # message mode, the environment's 6 turns


def test_state_prompts_are_the_longest_observation_of_an_episode_with_room_for_the_replies():
    assert state_prompt_tokens([40], 8) == 40
    assert state_prompt_tokens([40, 100, 300], 8) == 300 + 2 * 8
    assert state_prompt_tokens([400, 100, 60], 8) == 400  # a shrinking observation: the first
    # an environment that asks again after an invalid reply: k legal moves, then j retries, each
    # retry growing the transcript as it grew the all-invalid episode (+50, +100), within 5 turns
    assert state_prompt_tokens([40, 100, 300], 8, retried=[40, 90, 140], turns=5) == 300 + 100 + 4 * 8
    assert state_prompt_tokens([40, 100, 300], 8, retried=[40, 90, 140], turns=4) == 300 + 50 + 3 * 8
    assert state_prompt_tokens([40, 100, 300], 8, retried=[40, 90, 140], turns=3) == 300 + 2 * 8  # no turn left
    assert state_prompt_tokens([40, 100, 300], 8, retried=[40]) == 300 + 2 * 8  # the first retry ended it
    assert state_prompt_tokens([400, 100], 8, retried=[400, 405, 410], turns=3) == 400 + 10 + 2 * 8  # a board view


def _sized_run(model_dir, max_turns: int, **sections):
    """The config of a multi-turn run of 8 episodes on the model at ``model_dir`` that the probe sizes."""
    layer = {
        "workload": "lm",
        "model": {"path": str(model_dir)},
        "textenv": {"env": "tictactoe", "max_turns": max_turns},
        "train": {"iterations": 1, "batch_size": 8},
    }
    return build_config([{**layer, **sections}])


def _sequences(cfg, env):
    """``(rows, P, R)`` of an iteration of ``cfg`` on ``env``, as the multi-turn workload probes it."""
    from ppokit.lm.multi_turn.sizing import iteration_sequences

    return iteration_sequences(cfg, env, "env")


class _Transcript:
    """A state-mode environment whose observation is the whole transcript: it grows each turn,
    as TextArena's view=history does; 4 steps of one legal move."""

    observation_mode = "state"
    first = "start"

    def later(self, turn: int) -> str:
        return "start" + " more" * 50 * turn

    def reset(self, seed=None, options=None):
        self.turn = 0
        return self.first, {"legal_actions": ["go"]}

    def step(self, action):
        self.turn += 1
        done = self.turn == 4
        return self.later(self.turn), float(done), done, False, {"legal_actions": ["go"]}


class _Chat(_Transcript):
    """A message-mode environment: a long first message (the rules), then a short one per move
    (as a game's board after the opponent's move); 4 steps of one legal move; anything else is
    illegal and ends the episode."""

    observation_mode = "message"
    first = "rules" + " word" * 200

    def later(self, turn: int) -> str:
        return "move" + " x" * turn

    def step(self, action):
        if action != "go":
            return "", -1.0, True, False, {"illegal": True}
        return super().step(action)


class _Retrying(_Chat):
    """:class:`_Chat` that asks again after an illegal reply, with a message of its own."""

    retry = "that is not a move, try again" + " please" * 10

    def step(self, action):
        if action != "go":
            return self.retry, 0.0, False, False, {"illegal": True, "legal_actions": ["go"]}
        return super().step(action)


class _RetryingTranscript(_Transcript):
    """:class:`_Transcript` that asks again after an invalid reply, the notice added to the transcript."""

    def reset(self, seed=None, options=None):
        self.notices = 0
        return super().reset(seed)

    def later(self, turn: int) -> str:
        return super().later(turn) + " notice" * 30 * self.notices

    def step(self, action):
        if action != "go":
            self.notices += 1
            return self.later(self.turn), 0.0, False, False, {"illegal": True, "legal_actions": ["go"]}
        return super().step(action)


def test_a_state_mode_run_is_sized_by_the_longest_prompt_of_an_episode_not_the_first(tiny_dir):
    """The measured reason (docs/performance.md, "SmolLM2 on TextArena games"): sized by its first
    observation, a whole-transcript run's estimate was a third of the peak that ended it; a probe
    episode by random legal moves finds the longest prompt (here the third step's: the fourth ends
    the episode), plus R per reply before it."""
    from ppokit.lm.model.stack import prompt_tokenizer

    cfg = _sized_run(tiny_dir, 9, rollout={"max_new_tokens": 5})
    count = prompt_tokenizer(cfg)
    longest = len(count("start" + " more" * 150)["input_ids"])
    rows, prompt, response = _sequences(cfg, _Transcript())
    assert (rows, prompt, response) == (8 * 9, longest + 3 * 5, 5)
    assert prompt > 3 * len(count("start")["input_ids"])
    # the turn limit bounds the probe: two turns see the first step's observation at most
    cfg2 = cfg.model_copy(update={"textenv": cfg.textenv.model_copy(update={"max_turns": 2})})
    _, prompt2, _ = _sequences(cfg2, _Transcript())
    assert prompt2 == len(count("start" + " more" * 50)["input_ids"]) + 5
    # retried invalid replies grow the transcript too: 3 legal moves and 5 notices in 9 turns
    retrying = _sequences(cfg, _RetryingTranscript())[1]
    assert retrying == len(count("start" + " more" * 150 + " notice" * 150)["input_ids"]) + 8 * 5
    # an environment without legal actions is sized by its first observation, as before
    bare = _Transcript()
    bare.reset = lambda seed=None, options=None: ("start", {})
    assert _sequences(cfg, bare)[1] == len(count("start")["input_ids"])


def test_a_message_mode_run_sizes_its_later_messages_by_a_probe_episode(tiny_dir, monkeypatch):
    """Each turn adds a reply and the environment's next message: sized by the probe's later
    messages (the longest repeated past the probe's end), not as long as the first, which also
    holds the rules (the calculator's SmolLM2 run was estimated 4.1x its peak that way); where an
    invalid reply is asked again, that message may fill any turn (the largest of both kinds)."""
    from ppokit.lm.model.memory import IterationSizes
    from ppokit.lm.model.stack import prompt_tokenizer
    from ppokit.lm.multi_turn.sizing import iteration_sizes

    cfg = _sized_run(tiny_dir, 6, rollout={"max_new_tokens": 5})
    monkeypatch.setattr("ppokit.lm.multi_turn.sizing.model_shape", lambda path: None)  # no context limit (64)
    count = prompt_tokenizer(cfg)

    def appended(text):  # a later message adds its own tokens to the stream (no chat template here)
        return len(count(text, add_special_tokens=False)["input_ids"])

    first = len(count(_Chat.first)["input_ids"])
    later = [appended("move" + " x" * k) for k in (1, 2, 3)]  # the 4th step ends the episode
    rows, prompt, response = _sequences(cfg, _Chat())
    assert (rows, prompt) == (8, first)  # one seat: no "player" in the info
    sizes = iteration_sizes(cfg, _Chat(), "chat")  # a later turn prefills the conversation so far
    assert sizes == IterationSizes(first, rows=8, response_tokens=response, prefill_tokens=first + response)
    assert iteration_sizes(cfg, _Transcript(), "state").prefill_tokens is None
    assert response == 6 * 5 + sum(later) + 2 * max(later) < 6 * 5 + 5 * first
    retry = appended(_Retrying.retry)
    assert retry > max(later)
    assert _sequences(cfg, _Retrying())[2] == 6 * 5 + 5 * retry
    bare = _Chat()  # no legal actions listed: no probe, every message as long as the first
    bare.reset = lambda seed=None, options=None: ("rules" + " word" * 200, {})
    assert _sequences(cfg, bare)[2] == 6 * 5 + 5 * first


class _Seated(_Chat):
    """:class:`_Chat` against the environment's own opponent: seat 0 unless ``options`` say; the
    second seat's first message holds the opponent's first move too."""

    def reset(self, seed=None, options=None):
        super().reset(seed)
        seat = (options or {}).get("seat", 0)
        first = self.first + " opponent" * 40 * seat
        return first, {"legal_actions": ["go"], "seat": seat, "player": seat}


def test_the_probe_plays_the_learner_in_each_seat_against_the_environment_s_opponent(tiny_dir):
    from ppokit.lm.model.stack import prompt_tokenizer
    from ppokit.lm.multi_turn import sizing

    cfg = _sized_run(tiny_dir, 6)
    count = prompt_tokenizer(cfg)
    probe = sizing.probe_environment(cfg, _Seated(), "seated")
    assert probe.first == len(count(_Chat.first + " opponent" * 40)["input_ids"])  # seat 1's, the longer
    assert probe.seats == 1  # the environment plays the other seat: one stream an episode


def test_a_chat_stream_s_later_messages_count_what_the_template_appends(chat_dir):
    """With a chat template a later message appends the end of the reply's turn, the message and
    the next generation prompt, not the message rendered as a conversation of its own (that counted
    the default system prompt again for each one)."""
    from ppokit.lm.data.chat import chat_renderer
    from ppokit.lm.model.stack import prompt_tokenizer
    from ppokit.lm.multi_turn import sizing

    cfg = _sized_run(chat_dir, 6, data={"chat_template": True})
    tok = prompt_tokenizer(cfg)
    render = chat_renderer(tok, "model.path")
    probe = sizing.probe_environment(cfg, _Chat(), "chat")
    conversation = [{"role": "user", "content": _Chat.first}]
    lengths = [len(tok(render(conversation))["input_ids"])]
    for k in (1, 2, 3):
        conversation += [{"role": "assistant", "content": "go"}, {"role": "user", "content": _Chat().later(k)}]
        lengths.append(len(tok(render(conversation))["input_ids"]))
    # the rendered conversation grows by the reply's text and what follows it (this template ends a
    # reply with its own text: the model's stop token belongs to the reply, counted among R)
    reply = len(tok("go", add_special_tokens=False)["input_ids"])
    assert probe.first == lengths[0]
    assert probe.later == [b - a - reply for a, b in zip(lengths, lengths[1:])]


def test_a_chat_run_counts_its_prompts_with_the_template(chat_dir):
    """The rows are the observation rendered with the chat template (SmolLM2's adds 30 tokens)."""
    from ppokit.lm.data.chat import chat_renderer
    from ppokit.lm.model.stack import prompt_tokenizer

    layer = {
        "workload": "lm",
        "model": {"path": str(chat_dir)},
        "textenv": {"env": "tictactoe", "max_turns": 1},
        "train": {"iterations": 1, "batch_size": 8},
    }
    plain = build_config([layer])
    chat = build_config([{**layer, "data": {"chat_template": True}}])
    count = prompt_tokenizer(chat)
    rendered = chat_renderer(count, "model.path")("start")
    assert len(count(rendered)["input_ids"]) > len(count("start")["input_ids"])
    assert _sequences(chat, _Transcript())[1] == len(count(rendered)["input_ids"])
    assert _sequences(plain, _Transcript())[1] == len(count("start")["input_ids"])


# ----------------------------------------------------------------------------- against a measured run
def _measured_peaks(args: list[str], out: Path) -> dict[str, float]:
    """Train ``args`` for its one iteration in a fresh process; each phase's resident peak in bytes."""
    run = subprocess.run(
        [sys.executable, "-m", "ppokit", "train", *args, "--output-dir", str(out), "--name", "run"]
        + ["--no-progress", "run.tensorboard=false"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1800,
        env={**os.environ, "PPOKIT_CPU_KERNELS": "0"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return {phase: row[f"memory/peak_gb/{phase}"] * GB for phase in ("generate", "score", "update")}


@pytest.mark.slow
def test_the_estimate_is_within_a_quarter_of_the_measured_peaks_on_a_cpu(tmp_path):
    """One iteration in a fresh process (the metric is its resident peak per phase): each phase's
    estimate within 25% of what was measured (docs/performance.md has the figures). The estimate
    models the Hugging Face layers, so the run has the fused CPU kernels off: they keep less for
    the backward pass (the update's peak 0.9 GB against 1.5 GB on an AVX512 CPU), and where they
    run the estimate errs high.

    The same run's update peak measured 1.27-1.31 GB alone but 1.13-1.15 GB in two full-suite runs
    beside other jobs (cause not found: the mapped libraries are 0.08 GB of it), so a measurement
    outside the band is taken once more before the test fails."""
    args = [
        "arith",
        "data.sft_epochs=0",
        "data.eval_size=0",
        "train.iterations=1",
        "train.batch_size=256",
        "train.micro_batch_size=256",
        "train.infer_micro_batch_size=256",
        "rollout.max_new_tokens=32",
        "run.torch_threads=1",
    ]
    cfg = load_config("arith", args[1:])
    est = estimate_memory(
        cfg,
        model_shape("tiny"),
        prompt_tokens=7,  # "37+48=" and <bos>
        bf16=False,
        device_type="cpu",
        checkpointing=False,
        eager_attention=True,
    )
    estimated = {phase: est.phase_total(phase) for phase in ("generate", "score", "update")}
    tries = []
    for attempt in range(2):
        measured = _measured_peaks(args, tmp_path / f"try{attempt}")
        tries.append(measured)
        if all(estimated[p] == pytest.approx(measured[p], rel=0.25) for p in estimated):
            return
    pytest.fail(f"estimate {estimated} not within 25% of the measured peaks {tries}")


# ----------------------------------------------------------------------------- nothing we ship is refused
SFT_MEASURE = """
import json, sys, tempfile
from pathlib import Path
import torch
torch.set_num_threads(1)
from ppokit.lm.model.tiny import build_tiny_model
from ppokit.monitoring import peak_memory
from ppokit.lm.sft import SFTSettings, run_sft
peak_memory._resettable = False  # the evaluation's phase_peak must not reset VmHWM, the process's peak
tmp = Path(tempfile.mkdtemp())
rows, prompt = int(sys.argv[1]), int(sys.argv[2])
examples = [{"prompt": ("abc" * prompt)[: prompt - 1] + str(i % 10), "answer": "12"} for i in range(2 * rows)]
settings = SFTSettings(epochs_max=1, batch_size=rows, warmup_steps=1, precision="fp32", max_new_tokens=4)
model = build_tiny_model(tmp / "tiny", max_position_embeddings=256)
run_sft(model, tmp / "out", examples, examples[:8], settings, log=None)
print([int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM")][0])
"""


@pytest.mark.slow
def test_the_warm_start_s_estimate_is_within_half_of_its_measured_peak_on_a_cpu():
    """run_sft of the tiny model (fp32, 64 rows of 125 tokens, two steps) in a fresh process: its
    resident peak within 1.5x of the sft phase's estimate either way (measured 1.01-1.05 GB
    against 1.13 GB estimated; docs/performance.md). The heap's reuse of freed memory varies from run to
    run, so a measurement outside the band is taken once more before the test fails."""
    rows, prompt = 64, 120
    cfg = build_config(
        [{"workload": "lm", "data": {"sft_epochs": 1, "sft_batch_size": rows}, "rollout": {"max_new_tokens": 4}}]
    )
    est = estimate_memory(
        cfg,
        model_shape("tiny"),
        prompt_tokens=prompt + 1,  # <bos>
        bf16=False,
        device_type="cpu",
        checkpointing=False,
        eager_attention=True,
        sft_eval_rows=8,
    )
    estimated = est.phase_total("sft")
    tries = []
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, "-c", SFT_MEASURE, str(rows), str(prompt)], capture_output=True, text=True, cwd=ROOT
        )
        assert run.returncode == 0, run.stderr[-2000:]
        tries.append(int(run.stdout.split()[-1]))
        if estimated / 1.5 <= tries[-1] <= estimated * 1.5:
            return
    pytest.fail(f"the warm start's estimate {estimated / GB:.2f} GB not within 1.5x of the measured {tries}")


LM_PRESETS = [name for name in preset_names() if load_config(name, []).workload == "lm"]


@pytest.mark.parametrize("preset", LM_PRESETS)
def test_every_preset_and_demo_fits_a_laptop(preset, monkeypatch):
    """Each lm preset (the demos are presets) through the workload's own check: its PPO phases on a
    machine with 4 GB; a SmolLM2 preset's warm start (full fine-tuning of 135M parameters: 2.2 GB
    of weights, gradients and AdamW's moments alone; measured 7.6 GB for smollm2_tictactoe's) on one
    with 16 GB."""
    from ppokit.workloads import make_workload

    estimates = []
    checked = memory.check_run_fits

    def check(cfg, *args, **kwargs):
        estimates.append(checked(cfg, *args, **kwargs))
        return estimates[-1]

    monkeypatch.setattr(memory, "available_memory", lambda device: (16e9, "a laptop has 16 GB"))
    for module in ("ppokit.lm.single_turn.workload", "ppokit.lm.multi_turn.workload"):
        monkeypatch.setattr(f"{module}.check_run_fits", check)
    cfg = load_config(preset, ["run.device=cpu"])
    make_workload(cfg).check_inputs()
    (est,) = estimates
    assert est is not None and all(est.phase_total(p) < 4e9 for p in est.phases if p != "sft")
    assert "sft" not in est.phases or est.phase_total("sft") < (16e9 if preset.startswith("smollm2") else 4e9)
    # the dist bench runs the preset with a rollout worker, or two learners, beside it
    for extra in (["cluster.rollout_workers=1"], ["cluster.learners=2"]):
        if preset == "arith":
            estimates.clear()
            make_workload(load_config(preset, ["run.device=cpu", *extra])).check_inputs()
            assert estimates[0].other_processes > 0 and estimates[0].total < 4e9


def test_the_lm_bench_defaults_fit_this_kind_of_machine():
    """bench/lm.py's default iteration (a ~50 M-parameter model, 256 sequences, micro-batches of 32
    for the throughput runs) on a CPU with 16 GB, in both modes."""
    import argparse

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import lm as bench
    finally:
        sys.path.pop(0)
    shape = ModelShape(640, 10, 10, 10, 64, 1712, 56, max_positions=512)
    a = argparse.Namespace(batch=256, micro=32, response_len=32, precision="fp32", device="cpu")
    for mode in ("lora", "full"):
        cfg = bench.make_config(a, mode, Path("tiny"))
        est = estimate_memory(
            cfg, shape, prompt_tokens=24, bf16=False, device_type="cpu", checkpointing=False, eager_attention=True
        )
        assert est.total < 16e9, (mode, est.total / GB)


# ----------------------------------------------------------------------------- auto micro-batch sizes
def _auto_config(tiny_dir, **train):
    return build_config(
        [
            {
                "workload": "lm",
                "model": {"path": str(tiny_dir)},
                "run": {"device": "cpu"},
                "train": {"iterations": 1, "batch_size": 64, "mini_batch_size": 32, **train},
            }
        ]
    )


def _phase_at(cfg, phase: str, field: str, rows: int, prompt_tokens: int = 20) -> float:
    estimator = memory.Estimator.for_run(cfg, memory.IterationSizes(prompt_tokens))
    trial = cfg.model_copy(update={"train": cfg.train.model_copy(update={field: rows})})
    return estimator.estimate(trial).phase_total(phase)


def test_auto_micro_batches_are_the_largest_power_of_two_whose_phase_fits_half_the_memory(tiny_dir, monkeypatch):
    cfg = _auto_config(tiny_dir)
    assert cfg.train.micro_batch_size == "auto" == cfg.train.infer_micro_batch_size  # the lm defaults
    assert (cfg.micro_batch_size, cfg.infer_micro_batch_size) == (1, 4)  # unresolved: what fits anything
    # a device whose half lies between the update phase at 4 and at 8 rows, and the scoring phase at 16 and 32
    update = (_phase_at(cfg, "update", "micro_batch_size", 4) + _phase_at(cfg, "update", "micro_batch_size", 8)) / 2
    score = (
        _phase_at(cfg, "score", "infer_micro_batch_size", 16) + _phase_at(cfg, "score", "infer_micro_batch_size", 32)
    ) / 2
    assert score != update  # (the two phases need their own devices below)
    for half, expected in ((update, ("micro_batch_size", 4)), (score, ("infer_micro_batch_size", 16))):
        monkeypatch.setattr(memory, "total_memory", lambda device, half=half: (2 * half, "a test device's memory"))
        resolved, line = memory.resolve_micro_batches(cfg, memory.IterationSizes(20))
        name, rows = expected
        assert getattr(resolved.train, name) == rows
        assert (
            _phase_at(cfg, expected_phase(name), name, rows)
            <= half
            < _phase_at(cfg, expected_phase(name), name, 2 * rows)
        )
        assert line.startswith("micro-batches (auto): ") and "half of a test device's memory" in line
        assert "\n" not in line


def expected_phase(name: str) -> str:
    return "update" if name == "micro_batch_size" else "score"


def test_auto_micro_batches_stop_at_a_learner_s_share_and_at_one(tiny_dir, monkeypatch):
    cfg = _auto_config(tiny_dir)
    monkeypatch.setattr(memory, "total_memory", lambda device: (1e15, "a large device's memory"))
    resolved, _ = memory.resolve_micro_batches(cfg, memory.IterationSizes(20))
    assert (resolved.train.micro_batch_size, resolved.train.infer_micro_batch_size) == (32, 64)  # mini, batch
    two = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"learners": 2})})
    assert memory.resolve_micro_batches(two, memory.IterationSizes(20))[0].train.micro_batch_size == 16
    odd = _auto_config(tiny_dir, batch_size=48, mini_batch_size=48)  # a share that is no power of two
    assert memory.resolve_micro_batches(odd, memory.IterationSizes(20))[0].train.micro_batch_size == 48
    monkeypatch.setattr(memory, "total_memory", lambda device: (1.0, "a device without memory"))
    resolved, _ = memory.resolve_micro_batches(cfg, memory.IterationSizes(20))
    assert (resolved.train.micro_batch_size, resolved.train.infer_micro_batch_size) == (1, 1)


def test_sizes_given_stay_and_unknown_shapes_keep_the_unresolved_sizes(tiny_dir, monkeypatch):
    given = _auto_config(tiny_dir, micro_batch_size=2, infer_micro_batch_size=8)
    assert memory.resolve_micro_batches(given, memory.IterationSizes(20)) == (given, None)
    monkeypatch.setattr(memory, "model_shape", lambda path, what="model.path": None)  # a config without sizes
    resolved, line = memory.resolve_micro_batches(_auto_config(tiny_dir), memory.IterationSizes(20))
    assert (resolved.train.micro_batch_size, resolved.train.infer_micro_batch_size) == (1, 4)
    assert "sizes are unknown" in line


def test_a_run_trains_with_the_sizes_auto_chose_and_says_so(tiny_dir, tmp_path, monkeypatch):
    from ppokit.lm.single_turn.workload import LMWorkload

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(80)))
    cfg = _auto_config(tiny_dir, batch_size=64, mini_batch_size=32)
    cfg = cfg.model_copy(
        update={
            "data": cfg.data.model_copy(update={"prompts": str(data), "reward": "exact_match", "eval_size": 0}),
            # rows and responses enough that the update at 32 rows a pass and at 1 differ by more than the
            # header's 0.01 GB in fp32 and bf16 alike (at 8 rows and 16 tokens bf16 printed 0.45 for both)
            "rollout": cfg.rollout.model_copy(update={"max_new_tokens": 48}),
        }
    )
    monkeypatch.setattr(memory, "total_memory", lambda device: (1e15, "a large device's memory"))
    workload = LMWorkload(cfg)
    components = workload.build(tmp_path / "run")
    try:
        assert (workload.cfg.train.micro_batch_size, workload.cfg.train.infer_micro_batch_size) == (32, 64)
        assert components.learner.trainer.cfg.micro_batch_size == 32
        assert any(
            line.startswith("micro-batches (auto): 32 rows a pass in the update, 64 in scoring")
            for line in components.header
        )
        # the header's estimate is the run's as it runs: at the sizes auto chose, not the unresolved ones
        from ppokit.lm.model.stack import prompt_tokenizer

        longest = memory.longest_prompt_tokens(prompt_tokenizer(cfg), [f"{i}+1=" for i in range(80)])
        (note,) = [line for line in components.header if line.startswith("memory estimate: about ")]
        update = float(note.split("update ")[1].split(";")[0])
        chosen, unresolved = (_phase_at(cfg, "update", "micro_batch_size", rows, longest) for rows in (32, 1))
        assert chosen - unresolved > 0.01e9  # the two are told apart at the header's rounding
        assert update == round(chosen / 1e9, 2)
        assert update != round(unresolved / 1e9, 2)
        assert note.endswith("measured peaks: memory/peak_gb") and "\n" not in note
    finally:
        components.close()


@pytest.mark.parametrize("workload", ["single_turn", "multi_turn"])
def test_the_header_reuses_the_pre_start_estimate_where_no_size_is_auto(workload, tiny_dir, tmp_path, monkeypatch):
    """With numbered micro-batch sizes the run is estimated once (the pre-start check's), and the
    header's line is the one an estimate made afresh at the same sizes gives."""
    from ppokit.workloads import make_workload

    train = {"iterations": 1, "batch_size": 8, "mini_batch_size": 8, "micro_batch_size": 8, "infer_micro_batch_size": 8}
    extra = {"textenv": {"env": "tictactoe", "max_turns": 9, "eval_episodes": 0}} if workload == "multi_turn" else {}
    run = {"device": "cpu"}
    cfg = build_config([{"workload": "lm", "model": {"path": str(tiny_dir)}, "run": run, "train": train, **extra}])
    calls = []
    run_estimate = memory.Estimator.run_estimate

    def counted(self, cfg, sft_eval_rows):
        calls.append((self.sizes, sft_eval_rows))
        return run_estimate(self, cfg, sft_eval_rows)

    monkeypatch.setattr(memory.Estimator, "run_estimate", counted)
    workload = make_workload(cfg)
    workload.check_inputs()
    components = workload.build(tmp_path / "run")
    try:
        (note,) = [line for line in components.header if line.startswith("memory estimate: ")]
    finally:
        components.close()
    ((sizes, sft_eval_rows),) = calls  # the pre-start check's estimate, reused by the header
    assert note == memory.estimate_note(cfg, sizes, sft_eval_rows=sft_eval_rows)
    assert len(calls) == 2  # (afresh, the line above)


def test_a_multi_turn_run_s_header_says_its_estimate(tiny_dir, tmp_path):
    """The multi-turn header's estimate is sized as the pre-start check sizes the run (its probe
    episode's rows, prompt and replies) and says each phase."""
    from ppokit.envs import make_env
    from ppokit.lm.multi_turn import workload

    cfg = build_config(
        [
            {
                "workload": "lm",
                "model": {"path": str(tiny_dir)},
                "run": {"device": "cpu"},
                "textenv": {"env": "tictactoe", "max_turns": 9, "eval_episodes": 0},
                "rollout": {"max_new_tokens": 2},
                "train": {
                    "iterations": 1,
                    "batch_size": 8,
                    "mini_batch_size": 8,
                    "micro_batch_size": 8,
                    "infer_micro_batch_size": 8,
                },
            }
        ]
    )
    run = workload.MultiTurnWorkload(cfg)
    rows, prompt, response = _sequences(cfg, make_env("tictactoe"))
    expected = memory.Estimator.for_run(cfg, memory.IterationSizes(prompt, rows=rows, response_tokens=response))
    est = expected.run_estimate(cfg, cfg.textenv.sft_eval_turns)
    components = run.build(tmp_path / "run")
    try:
        (note,) = [line for line in components.header if line.startswith("memory estimate: ")]
    finally:
        components.close()
    assert note.startswith(f"memory estimate: {memory.describe(est)}; by phase (GB): ")
    for phase in ("generate", "score", "update"):
        assert f"{phase} {est.phase_total(phase) / 1e9:.2f}" in note
