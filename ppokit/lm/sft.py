"""Supervised warm start (SFT before RL) and held-out evaluation by generation.

RL improves a policy only where it sometimes succeeds: a randomly initialised model never
writes a correct answer, so every reward is 0 and PPO has nothing to follow. The
warm start fine-tunes the whole model on ``prompt + completion + <eos>`` with the loss on
the completion and the EOS only (prompt and padding tokens are masked out), and stops
when the held-out accuracy stops improving:

- every ``eval_every`` epochs the model answers the held-out prompts greedily
  (``model.generate``, KV cache, left padding, stop at EOS) and the reward function
  scores them; accuracy is the mean reward (for 0/1 verifiers, the fraction right);
- an evaluation improves on the best one when its accuracy is higher, or equal with a
  held-out answer loss at least 0.1% lower (so the early epochs where nothing is right
  yet still count as progress while the loss falls);
- after ``patience`` evaluations without improvement training stops, and the best model
  (weights + tokenizer) is saved to ``out_dir`` with its curve in ``sft_curve.json``.

With few examples the model memorises them and generalises little (the held-out
plateau is low); that is the intended starting point for RL.

Precision: master weights stay float32; ``precision="bf16"`` runs forward passes under
``torch.autocast`` (bf16 matmuls), ``"auto"`` picks bf16 where the hardware has it (the
rule of :func:`ppokit.lm.model.device.resolve_precision`). For the tiny model on CPU the two
run at the same speed: its matmuls are too small for bf16 to pay.

Evaluation generates through ppokit's one generation path
(a rollout engine, :mod:`ppokit.lm.generation.base`) and scores with
:func:`~ppokit.lm.evaluate.heldout_accuracy`, as the PPO run's held-out evaluation does.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ppokit.config import RolloutConfig
from ppokit.errors import SetUpInterrupted, UserError
from ppokit.lm.evaluate import heldout_accuracy
from ppokit.lm.generation.factory import make_model_engine
from ppokit.lm.model.device import (
    autocast,
    precision_name,
    resolve_device,
    resolve_precision,
    threads_for,
    torch_threads,
)
from ppokit.lm.model.heads import logits_at
from ppokit.lm.model.hf import load_model_and_tokenizer, quiet_transformers
from ppokit.lm.rewards.functions import load_reward_fn
from ppokit.monitoring.peak_memory import phase_peak
from ppokit.output_paths import check_output_dir, writing_to
from ppokit.persistence.checkpoint_files import atomic_directory

IGNORE_INDEX = -100
CURVE_FILE = "sft_curve.json"
TRAIN_ACCURACY_EXAMPLES = 256  # the most training examples the summary's train accuracy generates for


# ---------------------------------------------------------------------------- batching
def completion_of(item: dict[str, Any]) -> str | None:
    """The SFT target of a record: ``completion``, else ``answer`` (as text), else None."""
    if isinstance(item.get("completion"), str):
        return item["completion"]
    if "answer" in item and item["answer"] is not None:
        return str(item["answer"])
    return None


def encode_examples(
    tokenizer, examples: Sequence[dict[str, Any]], *, max_length: int | None = None
) -> list[tuple[list[int], int]]:
    """``(token ids of prompt + completion + eos, number of prompt tokens)`` per example."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the tokenizer has no EOS token; SFT needs one to teach the model to stop")
    encoded = []
    for i, item in enumerate(examples):
        target = completion_of(item)
        if not isinstance(item.get("prompt"), str) or target is None:
            raise UserError(
                f'SFT example {i} needs a "prompt" and a "completion" (or "answer"); '
                f"it has {', '.join(item) or 'no fields'}"
            )
        prompt_ids = tokenizer(item["prompt"])["input_ids"]
        target_ids = tokenizer(target, add_special_tokens=False)["input_ids"] + [eos]
        ids = prompt_ids + target_ids
        if max_length is not None and len(ids) > max_length:
            raise UserError(
                f"SFT example {i} is {len(ids)} tokens long; the model takes at most {max_length} "
                f"(prompt {item['prompt']!r})"
            )
        encoded.append((ids, len(prompt_ids)))
    return encoded


def collate(encoded: Sequence[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (prompt/padding = -100), (B, T)."""
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(encoded), width), dtype=torch.long)
    labels = torch.full((len(encoded), width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, n_prompt) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        labels[row, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def answer_loss(
    model, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the completion + EOS tokens, and their count.

    Only the n positions that predict an answer token get logits, (n, V)
    (:func:`~ppokit.lm.model.heads.logits_at`): an answer is a few tokens after a prompt of
    hundreds, and (B, T, V) logits of a 49k-token vocabulary were most of the warm start's memory."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    targets = batch["labels"][:, 1:]  # (B, T-1): the token each position predicts
    keep = torch.zeros_like(batch["labels"], dtype=torch.bool)  # (B, T)
    keep[:, :-1] = targets != IGNORE_INDEX
    with autocast(autocast_dtype, device):
        logits = logits_at(model, batch["input_ids"], batch["attention_mask"], keep)  # (n, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> float32; float64 kept
    loss = F.cross_entropy(logits, targets[keep[:, :-1]], reduction="sum")
    return loss, int(keep.sum())


@torch.no_grad()
def mean_answer_loss(
    model,
    encoded: Sequence[tuple[list[int], int]],
    pad_id: int,
    *,
    batch_size: int,
    autocast_dtype: torch.dtype | None = None,
) -> float:
    """Mean per-token completion loss over ``encoded`` (no gradient)."""
    total, count = 0.0, 0
    for start in range(0, len(encoded), batch_size):
        loss, n = answer_loss(model, collate(encoded[start : start + batch_size], pad_id), autocast_dtype)
        total, count = total + float(loss), count + n
    return total / max(count, 1)


# -------------------------------------------------------------------------- evaluation
def eval_engine(model, tokenizer, *, max_new_tokens: int, batch_size: int, autocast_dtype: torch.dtype | None):
    """A rollout engine over ``model`` (:func:`~ppokit.lm.generation.factory.make_model_engine`) for
    the greedy held-out evaluation."""
    return make_model_engine(
        model,
        tokenizer,
        RolloutConfig(max_new_tokens=max_new_tokens, micro_batch_size=batch_size),
        autocast_dtype=autocast_dtype,
    )


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    items: Sequence[dict[str, Any]],
    reward_fn,
    *,
    max_new_tokens: int,
    batch_size: int = 64,
    autocast_dtype: torch.dtype | None = None,
) -> float:
    """Greedy held-out accuracy of ``model`` (in eval mode for the evaluation, then as it was)."""
    was_training = model.training
    model.eval()
    try:
        engine = eval_engine(
            model, tokenizer, max_new_tokens=max_new_tokens, batch_size=batch_size, autocast_dtype=autocast_dtype
        )
        return heldout_accuracy(engine, items, reward_fn)
    finally:
        model.train(was_training)


# ---------------------------------------------------------------------------------- SFT
@dataclass(frozen=True)
class SFTSettings:
    """The warm start's settings (``ppokit sft``'s flags; a PPO run's ``data.sft_*`` fields:
    :meth:`for_run`). ``patience``: evaluations (every ``eval_every`` epochs) without
    improvement before stopping, not before ``min_epochs``. ``max_new_tokens``: None, the
    longest completion + 2. ``num_threads``: torch intra-op threads (None: the model-size rule
    of :func:`ppokit.lm.model.device.threads_for`)."""

    epochs_max: int = 300
    batch_size: int = 32
    learning_rate: float = 1e-3
    patience: int = 8
    seed: int = 0
    precision: str = "auto"
    eval_every: int = 1
    min_epochs: int = 0
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    max_new_tokens: int | None = None
    eval_batch_size: int = 256
    device: str = "cpu"
    num_threads: int | None = None

    @classmethod
    def for_run(cls, cfg: Any, device: str) -> SFTSettings:
        """A PPO run's warm start: its data.sft_* fields, seed, precision, length and threads."""
        return cls(
            epochs_max=cfg.data.sft_epochs,
            batch_size=cfg.data.sft_batch_size,
            learning_rate=cfg.data.sft_learning_rate,
            seed=cfg.seed,
            precision=cfg.run.precision,
            max_new_tokens=cfg.rollout.max_new_tokens,
            device=device,
            num_threads=cfg.run.torch_threads,
        )

    def check(self) -> None:
        """UserError on a count below 1 or a learning rate not above 0."""
        for name in ("epochs_max", "batch_size", "patience", "eval_every", "eval_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be a positive integer (got {value!r})")
        if not self.learning_rate > 0:
            raise UserError(f"learning_rate must be > 0 (got {self.learning_rate})")


@dataclass(frozen=True)
class SFTData:
    """The warm start's examples and held-out set, tokenized once."""

    train: list[tuple[list[int], int]]  # (token ids, prompt length) per example
    held_out: Sequence[dict[str, Any]]  # prompt records, scored by generation
    held_out_encoded: list[tuple[list[int], int]] | None  # with their completions, for the answer loss


def run_sft(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    examples: Sequence[dict[str, Any]],
    eval_set: Sequence[dict[str, Any]],
    settings: SFTSettings = SFTSettings(),
    *,
    reward_fn: str | Callable[..., float] = "exact_match",
    overwrite: bool = False,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Fine-tune all weights of the model in ``model_dir`` on ``examples``; keep the best.

    ``examples``: ``{"prompt", "completion"}`` records (``answer`` serves when there is no
    completion). ``eval_set``: held-out prompt records scored by ``reward_fn``. ``log``: called
    with one line per evaluation (None: quiet).

    Returns the summary that is also written to ``out_dir/sft_curve.json``: ``curve`` (one
    row per evaluation: epoch, train_loss, heldout_accuracy, heldout_loss, elapsed_s;
    epoch 0 is the model before training), ``best_epoch``, ``best_accuracy``,
    ``train_accuracy`` (of the best model on the first SFT examples, as many as were held out,
    at most 256), ``stopped`` (``patience``, ``epochs_max`` or ``interrupted``), ``wall_time_s``
    and ``settings``.
    """
    settings.check()
    if not examples:
        raise UserError("no SFT examples")
    if not eval_set:
        raise UserError("no held-out examples to evaluate SFT on")
    out = Path(out_dir)
    check_output_dir(out, "choose a new or empty output directory", replace=overwrite)  # before the work
    reward = reward_fn if hasattr(reward_fn, "score") else load_reward_fn(reward_fn)  # a scorer: the run's pool
    log = log or (lambda _msg: None)
    started = time.perf_counter()
    with phase_peak() as peak:  # the warm start's own peak: the memory estimate's phase ``sft``
        model, tokenizer, settings, summary = _fit(model_dir, examples, eval_set, settings, reward, started, log)
    summary["wall_time_s"] = round(time.perf_counter() - started, 2)
    summary["peak_gb"] = round(peak.gb, 2)
    keys = ("best_epoch", "best_accuracy", "best_heldout_loss", "train_accuracy", "stopped", "epochs_run")
    summary = {
        **{k: summary[k] for k in (*keys, "wall_time_s", "peak_gb")},
        "settings": _described(settings, model_dir, examples, eval_set, reward),
        "curve": summary["curve"],
    }
    with writing_to(out):
        _save(model, tokenizer, out, summary)
    log(
        f"sft: best held-out accuracy {summary['best_accuracy']:.1%} at epoch {summary['best_epoch']} "
        f"({summary['stopped']}); train accuracy {summary['train_accuracy']:.1%}; "
        f"saved to {out} in {summary['wall_time_s']:.1f}s; peak memory {summary['peak_gb']:.2f} GB"
    )
    return summary


def _fit(model_dir, examples, eval_set, settings: SFTSettings, reward, started: float, log):
    """Load the model, train it (:func:`_train`) and score the best one on training examples:
    the model, its tokenizer, the settings as resolved, and the summary so far."""
    dev = resolve_device(settings.device)
    autocast_dtype = resolve_precision(settings.precision, dev)
    model, tokenizer = load_model_and_tokenizer(model_dir)
    model.to(dev)
    data = _encode(tokenizer, examples, eval_set, getattr(model.config, "max_position_embeddings", None))
    if settings.max_new_tokens is None:
        longest = max(len(ids) - n for ids, n in data.train + (data.held_out_encoded or []))
        settings = replace(settings, max_new_tokens=longest + 2)  # the answer, its EOS, and one token of slack
    settings = replace(settings, num_threads=threads_for(model, dev, settings.num_threads))
    with torch_threads(settings.num_threads):
        summary = _train(model, tokenizer, data, reward, settings, autocast_dtype, started, log)
        summary["train_accuracy"] = evaluate(
            model,
            tokenizer,
            list(examples[: min(TRAIN_ACCURACY_EXAMPLES, len(eval_set))]),  # as many as were held out
            reward,
            batch_size=settings.eval_batch_size,
            max_new_tokens=settings.max_new_tokens,
            autocast_dtype=autocast_dtype,
        )
    return model, tokenizer, settings, summary


def _encode(tokenizer, examples, eval_set, max_length: int | None) -> SFTData:
    """The examples tokenized, and the held-out set with its completions where every record has one."""
    held_out_encoded = (
        encode_examples(tokenizer, eval_set, max_length=max_length)
        if all(completion_of(it) is not None for it in eval_set)
        else None
    )
    return SFTData(encode_examples(tokenizer, examples, max_length=max_length), eval_set, held_out_encoded)


def _described(settings: SFTSettings, model_dir, examples, eval_set, reward) -> dict[str, Any]:
    """The summary's ``settings``: what ran, the resolved precision, length and threads included."""
    described = {"model_dir": str(model_dir), "examples": len(examples), "eval_examples": len(eval_set)}
    described.update({k: v for k, v in asdict(settings).items() if k != "device"})
    autocast_dtype = resolve_precision(settings.precision, resolve_device(settings.device))
    described.update(reward_fn=reward.name, precision=precision_name(autocast_dtype))
    return described


def _train(
    model,
    tokenizer,
    data: SFTData,
    reward,
    s: SFTSettings,
    autocast_dtype: torch.dtype | None,
    started: float,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The SFT loop; leaves the best weights in ``model``."""
    pad_id = tokenizer.pad_token_id
    torch.manual_seed(s.seed)
    shuffle = torch.Generator().manual_seed(s.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=s.learning_rate, weight_decay=s.weight_decay, betas=(0.9, 0.98)
    )
    warmup = max(1, s.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))

    def evaluate_now() -> tuple[float, float | None]:
        return _held_out_scores(model, tokenizer, data, reward, s, autocast_dtype)

    accuracy, heldout_loss = evaluate_now()
    curve = [_row(0, None, accuracy, heldout_loss, started)]
    best = {"epoch": 0, "accuracy": accuracy, "loss": heldout_loss, "state": _snapshot(model)}
    log(
        f"sft: {len(data.train)} examples, {len(data.held_out)} held out, {model.num_parameters():,} parameters, "
        f"precision {precision_name(autocast_dtype)}, {torch.get_num_threads()} thread(s); before training "
        f"held-out accuracy {accuracy:.1%}"
    )
    stale, stopped, epoch = 0, "epochs_max", 0
    model.train()
    try:
        for epoch in range(1, s.epochs_max + 1):
            order = torch.randperm(len(data.train), generator=shuffle).tolist()
            train_loss = _epoch(model, [data.train[i] for i in order], pad_id, s, optimizer, scheduler, autocast_dtype)
            if not math.isfinite(train_loss):
                raise UserError(f"SFT diverged at epoch {epoch} (loss {train_loss}); lower the learning rate")
            if epoch % s.eval_every and epoch != s.epochs_max:
                continue
            accuracy, heldout_loss = evaluate_now()
            curve.append(_row(epoch, train_loss, accuracy, heldout_loss, started))
            if _improves(accuracy, heldout_loss, best):
                best = {"epoch": epoch, "accuracy": accuracy, "loss": heldout_loss, "state": _snapshot(model)}
                stale = 0
            else:
                stale += 1
            log(
                f"sft epoch {epoch:4d}  train loss {train_loss:.4f}  held-out accuracy {accuracy:6.1%}"
                + (f"  loss {heldout_loss:.3f}" if heldout_loss is not None else "")
                + f"  best {best['accuracy']:.1%} @ {best['epoch']}  {time.perf_counter() - started:6.1f}s"
            )
            if stale >= s.patience and epoch >= s.min_epochs:
                stopped = "patience"
                break
    except KeyboardInterrupt as exc:
        if isinstance(exc, SetUpInterrupted):  # a PPO run's warm start: the run stops at once
            raise
        stopped = "interrupted"
        log("sft: interrupted; saving the best model so far")
    model.load_state_dict(best["state"])
    model.eval()
    return {
        "best_epoch": best["epoch"],
        "best_accuracy": best["accuracy"],
        "best_heldout_loss": best["loss"],
        "stopped": stopped,
        "epochs_run": epoch,
        "curve": curve,
    }


def _held_out_scores(model, tokenizer, data: SFTData, reward, s: SFTSettings, autocast_dtype):
    """The held-out accuracy (greedy, scored by ``reward``) and answer loss (None where a record has
    no completion)."""
    accuracy = evaluate(
        model,
        tokenizer,
        data.held_out,
        reward,
        batch_size=s.eval_batch_size,
        max_new_tokens=s.max_new_tokens,
        autocast_dtype=autocast_dtype,
    )
    if data.held_out_encoded is None:
        return accuracy, None
    pad_id = tokenizer.pad_token_id
    loss = mean_answer_loss(
        model, data.held_out_encoded, pad_id, batch_size=s.eval_batch_size, autocast_dtype=autocast_dtype
    )
    return accuracy, loss


def _epoch(model, examples, pad_id: int, s: SFTSettings, optimizer, scheduler, autocast_dtype) -> float:
    """One pass over ``examples`` (in this order) in batches of ``s.batch_size``: the answer
    tokens' mean loss."""
    total, count = 0.0, 0
    for start in range(0, len(examples), s.batch_size):
        batch = collate(examples[start : start + s.batch_size], pad_id)
        loss_sum, n_tokens = answer_loss(model, batch, autocast_dtype)
        optimizer.zero_grad(set_to_none=True)
        (loss_sum / max(n_tokens, 1)).backward()
        if s.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        optimizer.step()
        scheduler.step()
        total, count = total + loss_sum.item(), count + n_tokens
        del loss_sum  # its graph would hold memory through the next batch's forward (as in the PPO update)
    return total / max(count, 1)


def _row(
    epoch: int, train_loss: float | None, accuracy: float, heldout_loss: float | None, started: float
) -> dict[str, Any]:
    return {
        "epoch": epoch,
        "train_loss": train_loss,
        "heldout_accuracy": accuracy,
        "heldout_loss": heldout_loss,
        "elapsed_s": round(time.perf_counter() - started, 2),
    }


def _improves(accuracy: float, loss: float | None, best: dict[str, Any]) -> bool:
    if accuracy > best["accuracy"] + 1e-9:
        return True
    if accuracy >= best["accuracy"] - 1e-9 and loss is not None and best["loss"] is not None:
        return loss < best["loss"] * (1 - 1e-3)  # equal accuracy, answer loss 0.1% lower
    return False


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _save(model, tokenizer, out: Path, summary: dict[str, Any]) -> None:
    """Write model, tokenizer and curve into a sibling temp dir, then move it into place."""
    with atomic_directory(out) as tmp:
        with quiet_transformers():
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        config_path = tmp / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
            if config.get("tokenizer_class") == "TokenizersBackend":  # the generic name 4.x also knows
                config["tokenizer_class"] = "PreTrainedTokenizerFast"
                config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        (tmp / CURVE_FILE).write_text(json.dumps(summary, indent=2) + "\n")
