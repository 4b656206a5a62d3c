"""Supervised warm start: masking, memorisation of the training examples, outputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ppokit.commands.sft import sft_main
from ppokit.errors import UserError
from ppokit.lm.data.tasks import ArithmeticTask
from ppokit.lm.model.hf import load_model_and_tokenizer
from ppokit.lm.sft import (
    CURVE_FILE,
    IGNORE_INDEX,
    SFTSettings,
    answer_loss,
    collate,
    encode_examples,
    eval_engine,
    evaluate,
    run_sft,
)


def test_labels_cover_the_completion_and_eos_only(tiny_model_dir):
    _, tok = load_model_and_tokenizer(tiny_model_dir)
    enc = encode_examples(tok, [{"prompt": "12+30=", "completion": "42"}, {"prompt": "1+2=", "answer": "3"}])
    batch = collate(enc, tok.pad_token_id)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert tok.decode(ids[0]) == "<bos>12+30=42<eos>"
    assert labels[0].tolist() == [IGNORE_INDEX] * 7 + tok("42", add_special_tokens=False)["input_ids"] + [3]
    assert labels[1].tolist() == [IGNORE_INDEX] * 5 + [tok.convert_tokens_to_ids("3"), 3] + [IGNORE_INDEX] * 3
    assert mask[1].tolist() == [1] * 7 + [0] * 3  # right padding for training
    assert ids[1, 7:].tolist() == [tok.pad_token_id] * 3
    with pytest.raises(UserError, match="SFT example 0 needs"):
        encode_examples(tok, [{"prompt": "1+1="}])
    with pytest.raises(UserError, match="at most 4"):
        encode_examples(tok, [{"prompt": "1+1=", "completion": "2"}], max_length=4)


def _naive_answer_loss(model, batch):
    """Float64 reference: the full (B, T, V) logits, then -log softmax at every labelled token."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    log_probs = logits.log_softmax(-1)
    total, count = 0.0, 0
    for b in range(batch["labels"].shape[0]):
        for t in range(1, batch["labels"].shape[1]):
            target = int(batch["labels"][b, t])
            if target != IGNORE_INDEX:
                total, count = total - float(log_probs[b, t - 1, target]), count + 1
    return total, count


class _SoftCapped(torch.nn.Module):
    """A model whose logits are not lm_head(last hidden state): they go through tanh soft-capping."""

    def __init__(self, lm):
        super().__init__()
        self.lm, self.config = lm, lm.config

    def forward(self, **kwargs):
        out = self.lm(**kwargs)
        out.logits = 3.0 * torch.tanh(out.logits / 3.0)
        return out

    def get_decoder(self):
        return self.lm.get_decoder()

    def get_output_embeddings(self):
        return self.lm.get_output_embeddings()


def test_answer_loss_reads_only_the_answer_positions(tiny_model_dir):
    """The loss from logits at the answer positions alone equals the full-logits loss in float64,
    for right-padded rows of different lengths, and for a model whose logits are post-processed."""
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    model = model.double()
    items = [
        {"prompt": "12+30=", "completion": "42"},
        {"prompt": "1+2=", "answer": "3"},
        {"prompt": "7=", "answer": "77"},
    ]
    batch = collate(encode_examples(tok, items), tok.pad_token_id)
    for lm in (model, _SoftCapped(model)):
        loss, n = answer_loss(lm, batch)
        expected, count = _naive_answer_loss(lm, batch)
        assert n == count == 3 + 2 + 3  # each completion's tokens + EOS
        assert float(loss) == pytest.approx(expected, rel=1e-12)
    capped, _ = answer_loss(_SoftCapped(model), batch)
    assert abs(float(capped) - float(answer_loss(model, batch)[0])) > 1e-3  # the capping path was taken
    full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    plain = F.cross_entropy(full[:, :-1].reshape(-1, full.shape[-1]), targets.reshape(-1), reduction="sum")
    assert float(answer_loss(model, batch)[0]) == pytest.approx(float(plain), rel=1e-12)


def test_generation_batches_match_single_prompts(tiny_model_dir):
    """SFT evaluates through the run's generation engine: greedy, left-padded batches give
    what each prompt gives alone."""
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    prompts = ["1+2=", "37+48=", "5=", "123+456="]
    together = (
        eval_engine(model, tok, max_new_tokens=5, batch_size=4, autocast_dtype=None)
        .generate(prompts, greedy=True)
        .texts
    )
    alone = [
        eval_engine(model, tok, max_new_tokens=5, batch_size=1, autocast_dtype=None).generate([p], greedy=True).texts[0]
        for p in prompts
    ]
    assert together == alone
    assert all(len(r) <= 5 and "<" not in r for r in together)


def test_sft_memorises_its_training_examples(tiny_model_dir, tmp_path):
    examples = ArithmeticTask(digits=1, seed=0).items("sft", 24)
    out = tmp_path / "sft"
    summary = run_sft(
        tiny_model_dir,
        out,
        examples,
        examples,
        SFTSettings(
            epochs_max=25, batch_size=8, learning_rate=3e-3, patience=25, warmup_steps=5, seed=0, precision="fp32"
        ),
        log=None,
    )
    curve = summary["curve"]
    assert curve[0]["epoch"] == 0 and curve[0]["heldout_accuracy"] <= 0.1  # random init: nothing right
    assert summary["best_heldout_loss"] < 0.5 * curve[0]["heldout_loss"]  # answer loss falls
    assert curve[-1]["train_loss"] < 0.5 * curve[1]["train_loss"]
    assert summary["train_accuracy"] >= 0.75  # memorised
    assert summary["best_accuracy"] == max(row["heldout_accuracy"] for row in curve)

    saved = json.loads((out / CURVE_FILE).read_text())
    assert saved["best_epoch"] == summary["best_epoch"] and len(saved["curve"]) == len(curve)
    # the warm start's own peak (this process's resident peak on a CPU): at least the fp32 model and AdamW's moments
    n_params = sum(p.numel() for p in load_model_and_tokenizer(tiny_model_dir)[0].parameters())
    assert saved["peak_gb"] == summary["peak_gb"] >= 16 * n_params / 1e9
    model, tok = load_model_and_tokenizer(out)  # the best model, reloadable
    assert tok.padding_side == "left" and not (out / "ppokit_tiny.json").exists()
    accuracy = evaluate(model, tok, examples, "exact_match", batch_size=16, max_new_tokens=4)
    assert accuracy == pytest.approx(summary["train_accuracy"])

    with pytest.raises(UserError, match="not empty"):
        run_sft(tiny_model_dir, out, examples, examples, SFTSettings(epochs_max=1), log=None)


def test_no_batch_s_loss_outlives_its_step(tiny_model_dir, tmp_path, monkeypatch):
    """A batch's loss holds memory of its graph: alive through the next batch's forward it
    raises the warm start's peak (SmolLM2: 9.45 GB with it, 8.67 without; docs/performance.md)."""
    import gc
    import weakref

    from ppokit.lm import sft

    losses, alive_at_call = [], []

    def tracked(*args, **kwargs):
        gc.collect()
        alive_at_call.append(sum(ref() is not None for ref in losses))
        loss_sum, n_tokens = answer_loss(*args, **kwargs)
        if loss_sum.requires_grad:  # a training batch (the held-out loss runs without gradients)
            losses.append(weakref.ref(loss_sum))
        return loss_sum, n_tokens

    monkeypatch.setattr(sft, "answer_loss", tracked)
    examples = ArithmeticTask(digits=1, seed=0).items("sft", 12)
    settings = SFTSettings(epochs_max=1, batch_size=4, learning_rate=1e-3, warmup_steps=1, precision="fp32")
    run_sft(tiny_model_dir, tmp_path / "sft", examples, examples, settings, log=None)
    assert len(losses) == 3 and alive_at_call and not any(alive_at_call)


def test_sft_stops_on_patience(tiny_model_dir, tmp_path):
    examples = ArithmeticTask(digits=1, seed=0).items("sft", 8)
    lines = []
    summary = run_sft(
        tiny_model_dir,
        tmp_path / "sft",
        examples,
        examples,
        SFTSettings(epochs_max=50, batch_size=8, learning_rate=1e-7, patience=2, warmup_steps=1, precision="fp32"),
        log=lines.append,
    )
    assert summary["stopped"] == "patience" and summary["epochs_run"] == 2  # nothing improves at lr 1e-7
    assert len(lines) == 1 + 2 + 1 and "held-out accuracy" in lines[1]


def test_sft_main_resolves_task_reward_and_model(tmp_path):
    summary = sft_main("arithmetic:digits=1", tmp_path / "out", examples=8, eval_size=4, epochs_max=1, log=None)
    assert summary["settings"]["model_dir"] == "tiny" and summary["settings"]["reward_fn"] == "exact_match"
    assert (summary["settings"]["examples"], summary["settings"]["eval_examples"]) == (8, 4)
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / CURVE_FILE).is_file()
    data = tmp_path / "sft.jsonl"
    data.write_text('{"prompt": "hi ", "completion": "there"}\n')
    with pytest.raises(UserError, match="name a reward function"):
        sft_main(str(data), tmp_path / "x")
    with pytest.raises(UserError, match="needs held-out prompts"):
        sft_main(str(data), tmp_path / "x", reward="exact_match")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_ppokit_sft_stopped_by_a_signal_keeps_the_best_model(tmp_path, sig):
    """Ctrl-C ends ``ppokit sft``'s training early and keeps the best model so far; SIGTERM (a
    scheduler's stop) does the same, where it used to kill the process without saving anything."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ppokit", "sft", "arithmetic:digits=2", "--out", str(out)]
    cmd += ["--examples", "64", "--eval-size", "16", "--epochs-max", "300", "--patience", "300"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("sft epoch    2"):
                break
        assert proc.poll() is None, "".join(seen)
        proc.send_signal(sig)
        text = "".join(seen) + proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "sft: interrupted; saving the best model so far" in text, text[-2000:]
    assert text.strip().splitlines()[-1].startswith("held-out accuracy after SFT:")
    curve = json.loads((out / CURVE_FILE).read_text())
    assert curve["stopped"] == "interrupted" and 2 <= curve["epochs_run"] < 300
    assert (out / "model.safetensors").is_file()
