"""Reward models (``data.reward_model``): batched scores, truncation, chat format, bad models, runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ppokit.cli import main
from ppokit.errors import UserError
from ppokit.lm.data.chat import RAW_PROMPT
from ppokit.lm.model.tiny import build_char_tokenizer
from ppokit.lm.rewards.reward_model import RewardModel
from ppokit.persistence.rundir import read_metrics

CPU = torch.device("cpu")
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def make_reward_model(
    path: Path, *, num_labels: int = 1, positions: int = 64, chat: bool = False, causal: bool = False
) -> Path:
    """A tiny Llama with a random score head (or an LM head), the character tokenizer, saved."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tok = build_char_tokenizer(padding_side="right")
    if chat:
        tok.chat_template = TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        num_labels=num_labels,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = (LlamaForCausalLM if causal else LlamaForSequenceClassification)(config)
    if not causal:
        with torch.no_grad():
            model.score.weight.normal_(0, 1.0)  # scores of order 1, different for different texts
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    return make_reward_model(tmp_path_factory.mktemp("rm") / "rm")


def one_by_one(rm: RewardModel, texts: list[str]) -> list[float]:
    """The plain way: each text alone, no padding, the logit at its last token."""
    out = []
    for text in texts:
        ids = rm.tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out.append(rm.model(input_ids=ids).logits[0, 0].item())
    return out


def test_batched_scores_equal_each_sequence_alone(rm_dir):
    rm = RewardModel(rm_dir, device=CPU, batch_size=3)
    prompts = ["1+1=", "12+30=", "7=", "99+99=", "5+"]
    responses = ["2", "42", "seven", "198", ""]
    got = rm.score(prompts, responses)
    want = one_by_one(rm, [p + r for p, r in zip(prompts, responses)])
    assert got == pytest.approx(want, abs=1e-5)
    assert len({round(s, 4) for s in got}) == len(got)  # the texts do score differently


def test_long_inputs_are_cut_from_the_left_so_the_response_stays(tmp_path):
    rm = RewardModel(make_reward_model(tmp_path / "short", positions=16), device=CPU)
    prompt, response = "1+2+3+4+5+6+7+8+9=", "45"
    [got] = rm.score([prompt], [response])
    ids = rm.tokenizer(prompt + response)["input_ids"]
    assert len(ids) > 16 and ids[0] == rm.tokenizer.bos_token_id
    kept = ids[:1] + ids[-15:]  # the BOS, then the last 15 tokens: the response is kept
    with torch.no_grad():
        want = rm.model(input_ids=torch.tensor([kept])).logits[0, 0].item()
    assert got == pytest.approx(want, abs=1e-5)


def test_a_chat_reward_model_reads_the_conversation_in_its_own_format(tmp_path):
    rm = RewardModel(make_reward_model(tmp_path / "chat", chat=True), device=CPU)
    item = {RAW_PROMPT: [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="}]}
    assert rm.text("policy-rendered text", "2", item) == "s:add\nu:1+1=\na:2\n"
    assert rm.text("3+3=", "6", {}) == "u:3+3=\na:6\n"  # a plain prompt is one user message
    assert rm.score(["x"], ["2"], [item]) == pytest.approx(one_by_one(rm, ["s:add\nu:1+1=\na:2\n"]), abs=1e-5)


def test_bf16_scores_are_close_to_fp32(rm_dir):
    fp32 = RewardModel(rm_dir, device=CPU).score(["1+1=", "12+30="], ["2", "42"])
    bf16 = RewardModel(rm_dir, device=CPU, autocast_dtype=torch.bfloat16).score(["1+1=", "12+30="], ["2", "42"])
    assert bf16 == pytest.approx(fp32, abs=0.1)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_the_fused_cpu_kernels_score_as_transformers_layers_do(tmp_path, dtype):
    from ppokit.lm.accel.kernels import cpu_library

    if cpu_library() is None:
        pytest.skip("the CPU kernels are not built here (no C compiler)")
    rm = make_reward_model(tmp_path / "rm", positions=64)
    prompts = ["1+1=", "12+30=", "7+8=", "99+1="]
    responses = ["2", "42", "15 and some more text", ""]
    fused = RewardModel(rm, device=CPU, autocast_dtype=dtype)
    plain = RewardModel(rm, device=CPU, autocast_dtype=dtype, cpu_kernels=False)
    assert {"rms_norm", "mlp", "rotary", "attention"} <= set(fused.fused_kernel_counts)
    assert plain.fused_kernel_counts == {}
    want = plain.score(prompts, responses)
    assert len(set(want)) == len(want)  # the texts score apart
    # right-padded batches of different lengths. bf16: the kernels round as transformers'
    # layers do but sum in another order, so a score may land one bf16 step (0.4%) apart
    # (here they are equal; fp32 3e-7 apart)
    tolerance = dict(abs=1e-5) if dtype is None else dict(rel=1e-2, abs=1e-2)
    assert fused.score(prompts, responses) == pytest.approx(want, **tolerance)


def test_the_memory_estimate_counts_the_reward_model_s_own_parameters(rm_dir, tmp_path):
    """A reward model has a score head (H x 1) where a causal LM has an LM head (V x H): the estimate
    counts the parameters of the sequence classifier its config builds, not the LM's formula."""
    from ppokit.lm.model.memory import ModelShape, reward_model_shape

    rm = RewardModel(rm_dir, device=CPU)
    count = sum(p.numel() for p in rm.model.parameters())
    shape = reward_model_shape(rm_dir)
    assert shape.num_parameters == count
    assert ModelShape.from_hf_config(rm.model.config).num_parameters > count  # the formula: an LM head
    assert reward_model_shape(tmp_path / "missing") is None  # its loader says why


@pytest.mark.parametrize(
    "kind, message",
    [
        ("missing", "no such model directory"),
        ("classifier", r"a reward model has one output \(num_labels=1\); this one has 3"),
        ("causal", "no score head"),
    ],
)
def test_models_that_are_not_reward_models(tmp_path, kind, message):
    path = tmp_path / kind
    if kind == "classifier":
        make_reward_model(path, num_labels=3)
    elif kind == "causal":
        make_reward_model(path, causal=True)
    with pytest.raises(UserError, match=message) as info:
        RewardModel(path, device=CPU)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- runs
def train_args(tiny_dir, tmp_path: Path, name: str, *extra: str) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(8)))
    return [
        "train",
        "arith",
        f"model.path={tiny_dir}",
        f"data.prompts={prompts}",
        "data.sft_epochs=0",
        "train.iterations=2",
        "train.batch_size=8",
        "train.mini_batch_size=8",
        "train.micro_batch_size=8",
        "train.infer_micro_batch_size=3",
        "algo.group_size=4",
        "rollout.max_new_tokens=2",
        "run.precision=fp32",
        "run.tensorboard=false",
        *extra,
        "--output-dir",
        str(tmp_path),
        "--name",
        name,
        "--no-progress",
    ]


def test_a_run_scored_by_the_reward_model_alone(tiny_dir, rm_dir, tmp_path, capsys):
    # (the arith preset names exact_match: null leaves the reward model alone)
    assert main(train_args(tiny_dir, tmp_path, "rm", f"data.reward_model={rm_dir}", "data.reward=null")) == 0
    rows = read_metrics(tmp_path / "rm")
    assert len(rows) == 2 and "reward/verifier_mean" not in rows[0]
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "rm")]) == 2  # no verifier: no held-out accuracy
    assert "scored by its reward model alone" in capsys.readouterr().err
    for row in rows:
        assert row["reward_mean"] == pytest.approx(row["reward/reward_model_mean"], abs=1e-6)
        assert row["reward_std"] > 0  # real, varying scores


def test_a_reward_model_plus_a_verifier_sums_them_with_their_weights(tiny_dir, rm_dir, tmp_path):
    assert (
        main(
            train_args(
                tiny_dir,
                tmp_path,
                "both",
                f"data.reward_model={rm_dir}",
                "data.reward=exact_match",
                "data.shaping.reward_model_weight=0.5",
                "data.shaping.verifier_weight=2",
            )
        )
        == 0
    )
    for row in read_metrics(tmp_path / "both"):
        assert row["reward_mean"] == pytest.approx(
            0.5 * row["reward/reward_model_mean"] + 2 * row["reward/verifier_mean"], abs=1e-5
        )


def test_held_out_prompts_with_only_a_reward_model_are_refused(tiny_dir, rm_dir, tmp_path, capsys):
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    assert (
        main(
            train_args(
                tiny_dir, tmp_path, "r", f"data.reward_model={rm_dir}", "data.reward=null", f"data.eval_prompts={held}"
            )
        )
        == 2
    )
    assert "the held-out accuracy is scored by data.reward" in capsys.readouterr().err
    assert main(train_args(tiny_dir, tmp_path, "r2", f"data.reward_model={tmp_path / 'nope'}")) == 2
    assert "data.reward_model=" in capsys.readouterr().err


def digit_reward_model(path: Path) -> Path:
    """A reward model that scores 1 when the text ends in a digit and 0 otherwise, by hand:
    the layer's outputs are zeroed, so the last hidden state is the last token's embedding
    (normalised), and the score head reads the one direction only digits have."""
    make_reward_model(path)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path)
    tok = build_char_tokenizer()
    digits = tok.convert_tokens_to_ids(list("0123456789"))
    width = model.config.hidden_size
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, 0] = 1.0  # every token: direction 0
        embed[digits, 0] = 0.0
        embed[digits, 1] = 1.0  # digits alone: direction 1
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.score.weight.zero_()
        model.score.weight[0, 1] = width**-0.5  # RMSNorm scales a unit vector by sqrt(width)
    model.save_pretrained(path)
    return path


def test_ppo_raises_the_reward_models_score(tiny_dir, tmp_path):
    from test_lm_learning import config

    from ppokit.workloads import train as train_lm

    rm = digit_reward_model(tmp_path / "digit-rm")
    scores = RewardModel(rm, device=CPU).score(["1+1="] * 4, ["7", "2x0", "72a", ""])
    assert scores == pytest.approx([1.0, 1.0, 0.0, 0.0], abs=1e-3)
    # 16 iterations: after 12, seeds 1-6 ended at 0.55-0.95 (the last two averaged); after 16,
    # seeds 1, 7 and 8 at 0.90-0.99
    cfg = config(tiny_dir, tmp_path, data={"reward_model": str(rm), "eval_size": 0}, train={"iterations": 16})
    train_lm(cfg, tmp_path / "run")
    rewards = [r["reward/reward_model_mean"] for r in read_metrics(tmp_path / "run")]
    assert len(rewards) == 16
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    # a random model ends its answer with a digit about one time in five
    assert first < 0.4 and last > 0.7 and last > first + 0.35, rewards
