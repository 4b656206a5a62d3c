"""The rollout-engine seam: the one protocol every generator of rollouts implements.

Everything that samples from a policy (the single-turn and multi-turn sources, the held-out
evaluation, ``ppokit generate``/``chat``/``eval``) goes through an engine built by
:func:`ppokit.lm.generation.factory.make_engine`. ``rollout.engine`` picks ``hf``
(:class:`~ppokit.lm.generation.engine.HFEngine`, transformers' ``generate``; the engine on the CPU)
or ``cuda`` (``ppokit/lm/generation/cuda_engine.py``: its own bf16 weights with the LoRA adapter
folded in, a KV cache allocated once, the decoding step in CUDA graphs).

- :class:`RolloutEngine`: the protocol (``generate``, ``generate_ids``, ``load_weights``, ``memory``).
- :class:`RolloutBatch`: what an engine returns, with the **behaviour log-probs**
  ``rollout_log_prob``, the log-probability of each sampled token under the distribution the engine
  actually sampled it from (:func:`sampling_log_probs`: temperature, then top-k, then top-p).
- :class:`PromptFrontEnd`: ``generate``/``generate_ids`` over an engine's own ``_generate``.

Why the behaviour log-probs: an engine whose numerics differ from the trainer's shows it in their gap
to the scorer's ``old_log_prob``, which ppokit logs every iteration and ``algo.rollout_correction``
corrects for (:mod:`ppokit.algo.rollout_correction`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ppokit.components import SEQUENCE_INPUTS

TENSOR_KEYS = (*SEQUENCE_INPUTS, "mask")  # a rollout's tensors


@dataclass
class RolloutBatch:
    """One iteration's sequences (layout in :mod:`ppokit.lm.generation.engine`; build them with its
    ``assemble``).

    ``group_size`` samples per prompt, each prompt's samples next to each other (row
    ``i * group_size + j``), prompts left-padded, responses right-padded, ``mask`` 1 up to and
    including the first EOS. ``rollout_log_prob`` (N, R) float32: the behaviour log-probs, the
    log-probability of each sampled token under the distribution the engine sampled it from
    (:func:`sampling_log_probs` of the engine's logits: temperature, then top-k, then top-p,
    transformers' order and definitions), 0 where ``mask`` is 0; None for greedy generation.
    """

    input_ids: Tensor  # (N, P + R) long
    attention_mask: Tensor  # (N, P + R) long
    position_ids: Tensor  # (N, P + R) long
    responses: Tensor  # (N, R) long
    mask: Tensor  # (N, R) float32
    truncated: Tensor  # (N,) bool
    group_ids: Tensor  # (N,) long: index of the prompt each sequence answers
    prompts: list[str]  # (N) the prompt of each sequence
    texts: list[str]  # (N) the decoded responses (special tokens dropped)
    items: list[dict[str, Any]] = field(default_factory=list)  # (N) the prompt's data fields
    # (N, R) float32: the engine's behaviour log-probs (the sampled distribution's), 0 on padding;
    # None for greedy generation
    rollout_log_prob: Tensor | None = None
    generation_time: float = 0.0
    generation_peak_gb: float = 0.0  # peak memory while generating (ppokit.monitoring.peak_memory)

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.responses.shape[1]

    @property
    def response_lengths(self) -> Tensor:
        return self.mask.sum(1)

    def tensors(self) -> dict[str, Tensor]:
        """The tensors a policy pass needs (``input_ids``, ``attention_mask``, ...)."""
        return {k: getattr(self, k) for k in TENSOR_KEYS}

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass(frozen=True)
class EngineMemory:
    """What an engine holds between calls, in bytes: ``weights`` (its own copy of the weights;
    0 when it samples with the trainer's modules) and ``cache`` (a KV cache kept allocated)."""

    weights: int = 0
    cache: int = 0

    def metrics(self) -> dict[str, float]:
        """``engine/weights_gb`` and ``engine/cache_gb`` (GB = 1e9 bytes)."""
        return {"engine/weights_gb": self.weights / 1e9, "engine/cache_gb": self.cache / 1e9}


@runtime_checkable
class RolloutEngine(Protocol):
    """What generates rollouts::

        name            str            "hf", "cuda", ... (the run's header, metrics)
        cfg             RolloutConfig  sampling options, read on every call; a caller may
                                       assign a new one (``ppokit chat``'s ``/set``)
        eos_ids         list[int]      tokens that end a response (the tokenizer's EOS first)
        pad_id          int            the tokenizer's pad token
        max_positions   int | None     the longest prompt + response the engine takes
        device          torch.device   where the tensors of a RolloutBatch are
        weights_shared  bool           True: the engine samples with the trainer's own modules
                                       (in-process HF engine), so new weights need no copy;
                                       False: it holds its own copy, refreshed by load_weights

        generate(prompts, *, group_size=1, items=None, greedy=False, max_new_tokens=None)
            -> RolloutBatch              prompts: list[str], tokenised by the engine's tokenizer
        generate_ids(prompt_ids, *, prompts=None, group_size=1, items=None, greedy=False,
                     max_new_tokens=None) -> RolloutBatch
                                         prompts as token ids (multi-turn streams, never re-tokenised)
        load_weights(weights)            ``learner.rollout_weights()``: lora: the actor adapter's
                                         peft state dict (``get_peft_model_state_dict(lm,
                                         adapter_name="actor")`` keys); full: the actor model's
                                         ``state_dict()``. After it, generation samples from them.
        memory() -> EngineMemory         what the engine holds between calls

    An engine class is built with ``EngineClass.for_policy(policy, tokenizer, rollout_cfg,
    **options)`` (an :class:`~ppokit.lm.model.policy.LMPolicy`: lora = its backbone with the
    ``actor`` adapter, full = its actor model; the policy's ``autocast_dtype`` is the precision)
    and, for a plain model directory, ``EngineClass.for_model(model, tokenizer, rollout_cfg, *,
    autocast_dtype=None, **options)``. Options an engine does not use (``kv_cache``: the CPU
    kernels' cache factory; ``activate``) it may ignore.

    A prompt that does not fit ``max_positions`` with ``max_new_tokens`` is a
    :class:`~ppokit.errors.UserError` (:func:`~ppokit.lm.generation.engine.check_context`), raised
    before any generation.
    """

    name: str
    cfg: Any  # ppokit.config.RolloutConfig
    eos_ids: list[int]
    pad_id: int
    weights_shared: bool

    @property
    def max_positions(self) -> int | None: ...

    @property
    def device(self) -> torch.device: ...

    def generate(
        self,
        prompts: Sequence[str],
        *,
        group_size: int = 1,
        items: list[dict] | None = None,
        greedy: bool = False,
        max_new_tokens: int | None = None,
    ) -> RolloutBatch: ...

    def generate_ids(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        prompts: Sequence[str] | None = None,
        group_size: int = 1,
        items: list[dict] | None = None,
        greedy: bool = False,
        max_new_tokens: int | None = None,
    ) -> RolloutBatch: ...

    def load_weights(self, weights: dict[str, Tensor]) -> None: ...

    def memory(self) -> EngineMemory: ...


def sampling_warpers(temperature: float, top_k: int, top_p: float):
    """transformers' logits warpers for sampling, in ``generate``'s order (temperature, top-k,
    top-p), as a ``LogitsProcessorList``; the ones at their neutral value are left out."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return warpers


def sampling_log_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """(n, V) float32 log-probs of the distribution a token is sampled from, given the model's
    next-token logits (n, V): ``log_softmax`` of the logits divided by ``temperature``, with the
    tokens outside the top ``top_k`` and outside the top-``top_p`` nucleus at ``-inf``
    (transformers' ``TopKLogitsWarper``/``TopPLogitsWarper``, at least one token kept)."""
    scores = logits.float()
    for warp in sampling_warpers(temperature, top_k, top_p):
        scores = warp(None, scores)
    return torch.log_softmax(scores, -1)


class PromptFrontEnd:
    """The two entry points of an engine (the seam's ``generate`` and ``generate_ids``) over its
    ``_generate(prompt_ids, prompt_mask, prompts, *, group_size, items, greedy, max_new_tokens,
    start)``: prompts as text are tokenized with left padding, token ids are left-padded the same
    way (multi-turn streams: never re-tokenised). Needs ``tokenizer`` and ``pad_id``."""

    tokenizer: Any
    pad_id: int

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[str],
        *,
        group_size: int = 1,
        items: list[dict] | None = None,
        greedy: bool = False,
        max_new_tokens: int | None = None,
    ) -> RolloutBatch:
        """``group_size`` samples for each prompt (greedy: one deterministic sample each)."""
        start = time.perf_counter()
        enc = self.tokenizer(list(prompts), padding=True, return_tensors="pt")
        return self._generate(
            enc["input_ids"],
            enc["attention_mask"],
            list(prompts),
            group_size=group_size,
            items=items,
            greedy=greedy,
            max_new_tokens=max_new_tokens,
            start=start,
        )

    @torch.no_grad()
    def generate_ids(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        prompts: Sequence[str] | None = None,
        group_size: int = 1,
        items: list[dict] | None = None,
        greedy: bool = False,
        max_new_tokens: int | None = None,
    ) -> RolloutBatch:
        """:meth:`generate` from token ids (the model's earlier tokens as sampled). ``prompts``:
        their text for the batch's records (default: decoded)."""
        start = time.perf_counter()
        ids, am = left_pad(prompt_ids, self.pad_id)  # (n, P) each
        if prompts is None:
            prompts = self.tokenizer.batch_decode([list(p) for p in prompt_ids], skip_special_tokens=True)
        return self._generate(
            ids,
            am,
            list(prompts),
            group_size=group_size,
            items=items,
            greedy=greedy,
            max_new_tokens=max_new_tokens,
            start=start,
        )

    def _generate(self, prompt_ids: Tensor, prompt_mask: Tensor, prompts: list[str], **options: Any) -> RolloutBatch:
        raise NotImplementedError


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """``(input_ids, attention_mask)``, (n, L) long each: token lists left-padded to the longest,
    as a tokenizer with ``padding_side="left"`` pads."""
    if not len(sequences) or any(len(s) == 0 for s in sequences):
        raise ValueError("left_pad needs at least one sequence, and no empty ones")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids, mask
