"""A reward model: a Hugging Face sequence-classification model whose one output is the reward.

``data.reward_model: PATH`` loads ``AutoModelForSequenceClassification`` (and its own
tokenizer) from a local directory, frozen, once per run. Each rollout's sequences are
scored in chunks of ``train.infer_micro_batch_size``, under the run's autocast::

    reward_i = RM(text_i)[0]      # the logit at the last real token

``text_i`` is the conversation in the reward model's own format: with a chat template,
``apply_chat_template(prompt messages + [{"role": "assistant", "content": response}])``
(a string prompt is one user message; the prompt as written in the data, before the
policy's own template); without one, the prompt the policy saw followed by its response.
The reward model's tokenizer need not be the policy's: the response is passed as text.
Inputs longer than the model takes are cut from the left, so the response is kept.
On a CPU (with ``model.cpu_kernels``) the reward model gets the policy's CPU acceleration
(:mod:`ppokit.lm.accel`: the fused kernels and, in bf16, the column-major wide weights).

Several PPO settings want a sequence reward plus a rule (a format check, a verifier):
with ``data.reward`` set as well, the reward is the sum of the two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

from ppokit.errors import UserError
from ppokit.lm.accel import accelerate_model
from ppokit.lm.data.chat import RAW_PROMPT, apply_template, as_messages, encoder_adds_bos
from ppokit.lm.model.hf import hf_config, load_hf_model, load_tokenizer


class RewardModel:
    """``score(prompts, responses, items) -> list[float]`` with a sequence-classification model."""

    def __init__(
        self,
        path: str | Path,
        *,
        device: torch.device,
        autocast_dtype: torch.dtype | None = None,
        batch_size: int = 8,
        where: str = "data.reward_model",
        cpu_kernels: bool = True,
    ) -> None:
        path = Path(path)
        self.where = f"{where}={path}"
        self.tokenizer = load_tokenizer(path, where, generation=False)  # right padding, cut from the left
        model = _load_model(path, where)
        if self.tokenizer.pad_token_id is None:  # batched scoring needs a pad id to find the last token
            self.tokenizer.pad_token = self.tokenizer.eos_token  # (ppokit.lm.model.hf's rule)
        if self.tokenizer.pad_token_id is None:
            raise UserError(
                f"{self.where}: the tokenizer has neither a pad nor an EOS token; add a pad token "
                "to its tokenizer_config.json"
            )
        model.config.pad_token_id = self.tokenizer.pad_token_id
        model.requires_grad_(False)  # (load_hf_model leaves it in eval mode)
        if autocast_dtype is not None:
            model.to(autocast_dtype)  # frozen: stored in the autocast dtype, as the backbone
        self.model = model.to(device)
        self.device = torch.device(device)
        self.fused_kernel_counts: dict[str, int] = {}
        if cpu_kernels:  # CPU acceleration (ppokit.lm.accel), CPU only
            self.fused_kernel_counts = accelerate_model(model, autocast_dtype)
        self.autocast_dtype = autocast_dtype
        self.batch_size = int(batch_size)
        self.max_length = _max_length(model, self.tokenizer)
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        self._strip_bos = encoder_adds_bos(self.tokenizer)

    def text(self, prompt: str, response: str, item: dict[str, Any]) -> str:
        """The reward model's input for one sample (see the module docstring)."""
        if not self.chat:
            return prompt + response
        messages = as_messages(item.get(RAW_PROMPT, item.get("prompt", prompt)))
        messages.append({"role": "assistant", "content": response})
        return apply_template(
            self.tokenizer,
            messages,
            strip_bos=self._strip_bos,
            generation_prompt=False,
            where=self.where,
            prompt=prompt,
        )

    @torch.no_grad()
    def score(
        self, prompts: Sequence[str], responses: Sequence[str], items: Sequence[dict[str, Any]] | None = None
    ) -> list[float]:
        """One float per sample: the reward model's output at the last real token."""
        items = list(items) if items is not None else [{}] * len(prompts)
        texts = [self.text(p, r, it) for p, r, it in zip(prompts, responses, items)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            with torch.autocast(
                self.device.type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
            ):
                logits = self.model(**enc).logits  # (n, 1)
            scores += logits[:, 0].float().cpu().tolist()
        bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
        if bad:
            raise UserError(
                f"{self.where} gave a non-finite score ({scores[bad[0]]}) on sample {bad[0]} "
                f"(prompt {prompts[bad[0]]!r}); check the model's weights"
            )
        return scores


def _load_model(path: Path, where: str):
    """``AutoModelForSequenceClassification`` of a local directory, checked to be a reward model
    (a trained score head with one output); a UserError names any problem."""
    config = hf_config(
        path,
        where,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
        "has no sequence-classification head (AutoModelForSequenceClassification cannot load it)",
    )

    def is_reward_model(model, info: dict) -> None:
        head = [k for k in info.get("missing_keys", ()) if k.split(".")[0] in ("score", "classifier")]
        if head:
            raise UserError(
                f"{where}={path}: the weights have no score head ({head[0]} would start random): "
                "a language model, not a trained reward model (AutoModelForSequenceClassification)"
            )
        labels = getattr(model.config, "num_labels", None)
        if labels != 1:
            raise UserError(
                f"{where}={path}: a reward model has one output (num_labels=1); this one has "
                f"{labels} (a classifier, not a reward model?)"
            )

    return load_hf_model(
        AutoModelForSequenceClassification, path, where, config, check=is_reward_model, dtype=torch.float32
    )


def _max_length(model, tokenizer) -> int | None:
    """The longest input the model takes: its positions, else the tokenizer's (None: no limit)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and limit > 0:
        return limit
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**9 else None
