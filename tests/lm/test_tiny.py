"""The tiny model and the character tokenizer: round trips through Hugging Face files."""

from __future__ import annotations

import json

import pytest
import torch

from ppokit.errors import UserError
from ppokit.lm.model.hf import load_model_and_tokenizer
from ppokit.lm.model.tiny import (
    DEFAULT_ALPHABET,
    DEFAULT_TINY_SPEC,
    SPEC_FILE,
    TinySpec,
    build_char_tokenizer,
    build_tiny_model,
    read_tiny_spec,
)


def test_char_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    tok = build_char_tokenizer(DEFAULT_ALPHABET, padding_side="left")
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for t in (tok, loaded):
        ids = t("37+48=")["input_ids"]
        assert ids[0] == t.bos_token_id
        assert len(ids) == 1 + len("37+48=")  # one id per character
        assert t.convert_ids_to_tokens(ids[1:]) == list("37+48=")
        text = "12 + 3 = 15, what?\nok"
        assert t.decode(t(text)["input_ids"], skip_special_tokens=True) == text  # no inserted spaces
        assert (t.pad_token_id, t.unk_token_id, t.bos_token_id, t.eos_token_id) == (0, 1, 2, 3)
        assert t.padding_side == "left"
        batch = t(["1+2=", "37+48="], padding=True)
        assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0][:2] == [0, 0]
    assert loaded("37+48=")["input_ids"] == tok("37+48=")["input_ids"]
    assert loaded.decode([7, 11, 3, 0, 0], skip_special_tokens=True) == "37"
    assert len(loaded) == DEFAULT_TINY_SPEC.vocab_size


def test_unknown_characters_and_bad_alphabets():
    tok = build_char_tokenizer("0123456789+=")
    assert tok("1x2", add_special_tokens=False)["input_ids"] == [5, tok.unk_token_id, 6]
    with pytest.raises(UserError, match="repeats"):
        build_char_tokenizer("0123401")
    with pytest.raises(UserError, match="padding_side"):
        build_char_tokenizer("01", padding_side="middle")


def test_default_spec_is_about_point_eight_million_parameters():
    n = DEFAULT_TINY_SPEC.num_parameters()
    assert 750_000 < n < 850_000
    assert DEFAULT_TINY_SPEC.mlp_size == 344
    spec = TinySpec(hidden_size=64, num_layers=2, num_heads=2)
    from transformers import LlamaForCausalLM

    from ppokit.lm.model.tiny import tiny_config

    assert LlamaForCausalLM(tiny_config(spec)).num_parameters() == spec.num_parameters()


def test_model_save_reload_gives_identical_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert tok.padding_side == "left"
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (0, 2, 3)
    assert model.generation_config.eos_token_id == 3 and model.generation_config.pad_token_id == 0
    assert (tiny_model_dir / "model.safetensors").is_file()
    batch = tok(["12+34=", "5+6="], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    reloaded, _ = load_model_and_tokenizer(tiny_model_dir)
    with torch.no_grad():
        again = reloaded(**batch).logits
    assert logits.shape == (2, 7, len(tok))
    assert torch.equal(logits, again)


def test_build_is_seeded_and_idempotent(tmp_path, tiny_model_dir):
    spec = read_tiny_spec(tiny_model_dir)
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    again = build_tiny_model(tiny_model_dir, **spec.to_dict())  # reused, not rebuilt
    assert again == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before
    record = json.loads((tiny_model_dir / SPEC_FILE).read_text())
    assert record["spec"] == spec.to_dict() and record["num_parameters"] == spec.num_parameters()
    small = dict(hidden_size=32, num_layers=1, num_heads=2)
    a = build_tiny_model(tmp_path / "a", **small)
    b = build_tiny_model(tmp_path / "b", **small)
    c = build_tiny_model(tmp_path / "c", **small, seed=1)
    from safetensors.torch import load_file

    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    with pytest.raises(UserError, match="different spec"):
        build_tiny_model(a, **small, seed=5)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a ppokit tiny model"):
        build_tiny_model(tmp_path / "busy", **small)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_bad_specs_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="multiple of num_heads"):
        build_tiny_model(tmp_path / "x", hidden_size=100, num_heads=3)
    with pytest.raises(UserError, match="num_layers"):
        TinySpec(num_layers=0)
    with pytest.raises(UserError, match="no config.json"):
        load_model_and_tokenizer(tmp_path)
