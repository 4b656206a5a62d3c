"""Model directories that cannot work: each is a one-line UserError naming the directory and the fix."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from test_policy import lm_config

from ppokit.errors import UserError
from ppokit.lm.model.hf import later_tokens_influence, load_causal_lm, load_model_and_tokenizer
from ppokit.lm.model.policy import build_policy
from ppokit.lm.model.tiny import build_tiny_model

CPU = torch.device("cpu")


def copy_model(tiny_dir, tmp_path, name="model"):
    out = tmp_path / name
    shutil.copytree(tiny_dir, out)
    return out


def truncated(tiny_dir, tmp_path):
    model = copy_model(tiny_dir, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    return model


def edit_config(tiny_dir, tmp_path, **changes):
    model = copy_model(tiny_dir, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))
    return model


def one_line(info) -> str:
    text = str(info.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("load", [load_causal_lm, load_model_and_tokenizer], ids=["policy", "sft"])
def test_truncated_weights(tiny_dir, tmp_path, load, capfd):
    model = truncated(tiny_dir, tmp_path)
    with pytest.raises(UserError, match="corrupt or truncated") as info:
        load(model)
    assert str(model) in one_line(info)


@pytest.mark.parametrize(
    "change, weight", [({"intermediate_size": 100}, "mlp"), ({"vocab_size": 20}, "embed_tokens|lm_head")]
)
@pytest.mark.parametrize("load", [load_causal_lm, load_model_and_tokenizer], ids=["policy", "sft"])
def test_config_that_does_not_fit_the_weights(tiny_dir, tmp_path, load, change, weight, capfd):
    model = edit_config(tiny_dir, tmp_path, **change)
    capfd.readouterr()
    with pytest.raises(UserError, match="do not fit config.json") as info:
        load(model)
    text = one_line(info)
    assert str(model) in text
    assert re.search(weight, text), text
    assert "LOAD REPORT" not in capfd.readouterr().err  # transformers' table is not printed


@pytest.mark.parametrize("load", [load_causal_lm, load_model_and_tokenizer], ids=["policy", "sft"])
def test_weights_without_the_output_layer(tiny_dir, tmp_path, load, capfd):
    """The bare decoder saved (AutoModel's save_pretrained): the untied output layer would start random."""
    from transformers import AutoModelForCausalLM

    headless = tmp_path / "headless"
    AutoModelForCausalLM.from_pretrained(tiny_dir).model.save_pretrained(headless)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (tiny_dir / name).is_file():
            shutil.copy(tiny_dir / name, headless / name)
    capfd.readouterr()
    with pytest.raises(UserError, match=r"lack 1 of the model's tensors \(lm_head.weight\), which would start random"):
        load(headless)
    assert "LOAD REPORT" not in capfd.readouterr().err


def test_a_tokenizer_with_more_tokens_than_the_model_embeds(tiny_dir, tmp_path):
    """A pad token added to the tokenizer without resizing the model: an index error inside the
    first forward pass before; one line from the pre-start check, the warm start's load, the
    policy's build and ``ppokit generate`` on the directory now."""
    from transformers import AutoTokenizer

    from ppokit.lm.generation.loading import load_generator
    from ppokit.lm.model.stack import build_policy_stack, prompt_tokenizer

    model = copy_model(tiny_dir, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = len(tokenizer)
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    tokenizer.save_pretrained(model)
    want = rf"model embeds {rows} \(ids from {rows} on, \[PAD\], have no embedding\); resize the model"
    for load in (
        lambda: prompt_tokenizer(lm_config(model)),
        lambda: load_model_and_tokenizer(model),
        lambda: build_policy_stack(lm_config(model), model),
        lambda: load_generator(model, device="cpu"),
    ):
        with pytest.raises(UserError, match=want) as info:
            load()
        assert str(model) in one_line(info)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(model)
    assert len(prompt_tokenizer(lm_config(model))) == rows


def test_full_mode_critic_with_a_smaller_vocabulary(tiny_dir, tmp_path):
    small = build_tiny_model(tmp_path / "small", hidden_size=32, num_layers=1, num_heads=2, alphabet="0123456789")
    cfg = lm_config(tiny_dir, model={"mode": "full", "critic_path": str(small)})
    with pytest.raises(UserError, match="model.critic_path=.*embeds 14 tokens.*use 56") as info:
        build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    one_line(info)


def test_lora_target_modules_that_do_not_exist(tiny_dir):
    cfg = lm_config(tiny_dir, model={"lora_target_modules": ["nonexistent_proj"]})
    with pytest.raises(UserError, match=r"model.lora_target_modules=\['nonexistent_proj'\]: no such module") as info:
        build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    assert "q_proj" in one_line(info) and "down_proj" in str(info.value)


def test_flash_attention_without_flash_attn(tiny_dir):
    try:
        import flash_attn  # noqa: F401

        pytest.skip("flash-attn is installed")
    except ImportError:
        pass
    with pytest.raises(
        UserError, match="model.attn_implementation=flash_attention_2:.*use auto, sdpa or eager"
    ) as info:
        load_causal_lm(tiny_dir, attn_implementation="flash_attention_2")
    one_line(info)


# ----------------------------------------------------------------------------- context length
@pytest.fixture
def short_gpt2(tiny_dir, tmp_path):
    """A GPT-2 that takes at most 8 positions, with the tiny model's tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from ppokit.lm.model.hf import load_tokenizer

    tok = load_tokenizer(tiny_dir)
    config = GPT2Config(
        n_positions=8,
        vocab_size=len(tok),
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    out = tmp_path / "gpt2short"
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_prompt_plus_response_longer_than_the_model_takes(short_gpt2):
    from ppokit.lm.generation.engine import check_prompts_fit
    from ppokit.lm.generation.factory import make_engine
    from ppokit.lm.model.hf import load_tokenizer
    from ppokit.lm.sft import evaluate

    cfg = lm_config(short_gpt2, rollout={"max_new_tokens": 6})
    policy = build_policy(cfg, short_gpt2, device=CPU, autocast_dtype=None)
    tok = load_tokenizer(short_gpt2)
    prompts = ["1+2=", "12+30="]  # 5 and 7 tokens with <bos>
    message = r"'12\+30=' is 7 tokens .* at most 8 positions .* lower rollout.max_new_tokens to 1"
    with pytest.raises(UserError, match=message):
        check_prompts_fit(make_engine(policy, tok, cfg.rollout), tok, prompts, 6)
    with pytest.raises(UserError, match=message):
        make_engine(policy, tok, cfg.rollout).generate(prompts)
    with pytest.raises(UserError, match=message):
        evaluate(
            policy.actor_model.get_base_model(),
            tok,
            [{"prompt": p, "answer": "3"} for p in prompts],
            "exact_match",
            max_new_tokens=6,
        )
    check_prompts_fit(make_engine(policy, tok, cfg.rollout), tok, prompts, 1)  # fits: no error
    assert len(make_engine(policy, tok, cfg.rollout).generate(prompts, max_new_tokens=1)) == 2


def test_train_with_a_model_too_short_for_the_rollouts(short_gpt2, tmp_path, monkeypatch, capsys):
    from ppokit import cli

    monkeypatch.chdir(tmp_path)
    code = cli.main(
        [
            "train",
            "arith",
            f"model.path={short_gpt2}",
            "train.iterations=1",
            "train.batch_size=8",
            "train.mini_batch_size=8",
            "train.micro_batch_size=8",
            "train.infer_micro_batch_size=8",
            "rollout.micro_batch_size=8",
            "data.sft_epochs=0",
            "data.eval_size=4",
            "run.tensorboard=false",
            "--output-dir",
            "runs",
            "--no-progress",
            "--name",
            "short",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "max_position_embeddings" in err[0], err


def test_train_checks_every_prompt_before_the_first_rollout(short_gpt2, tmp_path, monkeypatch, capsys):
    """A too-long prompt anywhere in the prompt file stops the run before anything is generated."""
    from ppokit import cli
    from ppokit.lm.generation import engine as rollout

    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    records = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [*records, {"prompt": "12+30=12+30=", "answer": "42"}]))
    calls = []
    generate = rollout.HFEngine.generate
    monkeypatch.setattr(rollout.HFEngine, "generate", lambda self, *a, **k: calls.append(1) or generate(self, *a, **k))
    code = cli.main(
        [
            "train",
            "arith",
            f"model.path={short_gpt2}",
            f"data.prompts={prompts}",
            "rollout.max_new_tokens=1",
            "train.iterations=1",
            "train.batch_size=8",
            "train.mini_batch_size=8",
            "train.micro_batch_size=8",
            "train.infer_micro_batch_size=8",
            "rollout.micro_batch_size=8",
            "data.sft_epochs=0",
            "run.tensorboard=false",
            "--output-dir",
            "runs",
            "--no-progress",
            "--name",
            "long",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "'12+30=12+30='" in err[0] and "max_position_embeddings" in err[0], err
    assert calls == []


def test_lora_on_conv1d_layers_prints_no_peft_note(short_gpt2):
    """GPT-2's Conv1D layers: peft's note that it sets fan_in_fan_out would precede any one-line error."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_policy(lm_config(short_gpt2), short_gpt2, device=CPU, autocast_dtype=None)
    assert not [w for w in caught if "fan_in_fan_out" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("load", [load_causal_lm, load_model_and_tokenizer], ids=["policy", "sft"])
def test_an_encoder_with_a_language_model_head_is_not_causal(tiny_dir, tmp_path, load, capfd):
    """A BERT saved with its head loads through AutoModelForCausalLM (as BertLMHeadModel) but attends
    to later tokens: sampling token by token and scoring whole sequences would disagree. Refused,
    and the same weights as a decoder (``is_decoder: true``) load."""
    from transformers import AutoTokenizer, BertConfig, BertLMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        initializer_range=0.2,  # (at BERT's 0.02 a random encoder barely mixes its positions)
    )
    encoder = tmp_path / "bert"
    torch.manual_seed(0)
    BertLMHeadModel(config).save_pretrained(encoder)
    tokenizer.save_pretrained(encoder)
    capfd.readouterr()
    with pytest.raises(
        UserError, match=r"the model is not causal: its outputs at a position change with later"
    ) as info:
        load(encoder)
    assert str(encoder) in one_line(info) and "BertLMHeadModel" in one_line(info)
    decoder = edit_config(encoder, tmp_path / "as-decoder", is_decoder=True)
    loaded = load_causal_lm(decoder)
    assert later_tokens_influence(loaded, "it") == 0.0
    assert later_tokens_influence(load_causal_lm(tiny_dir), "it") == 0.0  # the tests' tiny Llama
