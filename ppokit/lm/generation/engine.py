"""Generation with transformers, and the batch layout every rollout engine returns.

:class:`HFEngine` is the Hugging Face engine of the rollout-engine seam
(:mod:`ppokit.lm.generation.base`; built by :func:`~ppokit.lm.generation.factory.make_engine`):
rollouts for PPO, the held-out evaluation of a run (``ppokit eval`` too) and the
supervised warm start's evaluation generate through it on the CPU. It runs
``model.generate`` with the KV cache, ``group_size`` samples per prompt, in micro-batches
of ``rollout.micro_batch_size`` sequences; :meth:`HFEngine.for_policy` generates with a
policy's actor (the ``actor`` adapter in lora mode). Sampled batches carry the behaviour
log-probs (``rollout_log_prob``: :class:`BehaviourLogProbs`). Every sequence of a batch
shares one layout::

    input_ids       (N, P + R)   [pad .. pad prompt | response .. EOS pad .. pad]
    attention_mask  (N, P + R)   1 on prompt tokens and on response tokens up to EOS
    position_ids    (N, P + R)   cumsum(attention_mask) - 1 (clamped at 0): a left-padded
                                 prompt starts at position 0, as without padding
    responses       (N, R)       response tokens, pad after EOS
    mask            (N, R)       1 on response tokens up to and including the first EOS
    truncated       (N,)         reached max_new_tokens without EOS
    rollout_log_prob (N, R)      the sampled distribution's log-prob of each token, 0 on
                                 padding (sampling only; None for greedy generation)

``P`` is the longest prompt of the batch (prompts are left-padded, which batched
generation needs), ``R`` the longest response. Tokens after EOS carry ``mask = 0``:
no loss, no reward, no attention. The engine does no scoring: see
:mod:`ppokit.lm.scoring`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from torch import Tensor
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from ppokit.config import STATIC_CACHE_FULL_BF16
from ppokit.errors import UserError
from ppokit.lm.generation.base import EngineMemory, PromptFrontEnd, RolloutBatch, sampling_warpers
from ppokit.monitoring.peak_memory import phase_peak

# transformers 5.24 renamed generate's `past_key_values` to `cache` (the old name warns on every call).
GENERATE_CACHE_KWARG = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"


def response_mask(responses: Tensor, eos_ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(mask, truncated)``: 1 up to and including the first EOS; rows without EOS truncated.

    ``responses`` (N, R) long, ``eos_ids`` (k,) long -> mask (N, R) float32, truncated (N,) bool.
    """
    is_eos = torch.isin(responses, eos_ids)  # (N, R)
    eos_before = (is_eos.cumsum(1) - is_eos.long()) > 0  # an EOS strictly earlier
    return (~eos_before).float(), ~is_eos.any(1)


def position_ids_from(attention_mask: Tensor) -> Tensor:
    """(N, L) positions counting real tokens only, 0 on left padding."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def assemble(
    prompt_ids: Tensor, prompt_mask: Tensor, raw_responses: Tensor, *, eos_ids: Sequence[int], pad_id: int
) -> dict[str, Tensor]:
    """The batch layout from left-padded prompts (N, P) and generated tokens (N, R).

    Tokens after the first EOS become ``pad_id`` with ``mask = 0`` and attention 0.
    Returns ``input_ids``, ``attention_mask``, ``position_ids``, ``responses``, ``mask``,
    ``truncated``.
    """
    eos = torch.tensor(list(eos_ids), device=raw_responses.device)
    mask, truncated = response_mask(raw_responses, eos)  # (N, R), (N,)
    responses = torch.where(mask.bool(), raw_responses, torch.full_like(raw_responses, pad_id))
    attention_mask = torch.cat([prompt_mask.long(), mask.long()], 1)  # (N, P + R)
    return {
        "input_ids": torch.cat([prompt_ids, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": position_ids_from(attention_mask),
        "responses": responses,
        "mask": mask,
        "truncated": truncated,
    }


def eos_token_ids(tokenizer, model=None) -> list[int]:
    """The tokenizer's EOS plus any extra EOS ids of the model's generation config."""
    ids = [tokenizer.eos_token_id]
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(extra, int):
        extra = [extra]
    for i in extra or []:
        if i is not None and i not in ids:
            ids.append(int(i))
    return ids


def max_positions(model) -> int | None:
    """The longest sequence the model's config declares (``max_position_embeddings``), or None."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_context(
    limit: int | None, prompts: Sequence[str], prompt_lengths: Sequence[int], max_new_tokens: int
) -> None:
    """UserError when the longest prompt plus ``max_new_tokens`` exceeds ``limit`` positions
    (an engine's ``max_positions``; None: no limit)."""
    if limit is None or not len(prompt_lengths):
        return
    longest = max(range(len(prompt_lengths)), key=lambda i: int(prompt_lengths[i]))
    n = int(prompt_lengths[longest])
    if n + max_new_tokens > limit:
        raise UserError(
            f"the prompt {prompts[longest]!r} is {n} tokens and up to {max_new_tokens} more are "
            f"generated (rollout.max_new_tokens), but the model takes at most {limit} positions "
            f"(max_position_embeddings); lower rollout.max_new_tokens to {max(limit - n, 0)} or "
            "shorten the prompts"
        )


def check_prompts_fit(engine, tokenizer, prompts: Sequence[str], max_new_tokens: int) -> None:
    """:func:`check_context` for all ``prompts`` at once against ``engine.max_positions`` (to call
    before any generation)."""
    if engine.max_positions is not None and prompts:
        lengths = [len(ids) for ids in tokenizer(list(prompts))["input_ids"]]
        check_context(engine.max_positions, prompts, lengths, max_new_tokens)


class BehaviourLogProbs(LogitsProcessor):
    """The sampling warpers (temperature, top-k, top-p) as the last logits processor of one
    ``generate`` call, recording the log-prob of each sampled token under the warped distribution.

    transformers appends a caller's processors before its own sampling warpers, so the engine
    switches those off and applies the same warpers here (:func:`~ppokit.lm.generation.base.sampling_warpers`):
    what this processor returns is exactly what ``generate`` samples from. The token sampled
    from step ``t``'s distribution is read at step ``t + 1`` (the last column of ``input_ids``),
    the last one by :meth:`finish`.
    """

    def __init__(self, cfg):
        self.warpers = sampling_warpers(cfg.temperature, cfg.top_k, cfg.top_p)
        self.previous: Tensor | None = None  # (n, V) float32 log-probs of the last step
        self.steps: list[Tensor] = []  # (n,) per generated token

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        scores = self.warpers(input_ids, scores)  # (n, V)
        if self.previous is not None:
            self.steps.append(self.previous.gather(1, input_ids[:, -1:]).squeeze(1))
        self.previous = torch.log_softmax(scores.float(), -1)
        return scores

    def finish(self, sequences: Tensor, width: int) -> Tensor:
        """(n, width) log-probs of the generated tokens (``sequences``' last ``width`` columns)."""
        if self.previous is not None and len(self.steps) < width:
            self.steps.append(self.previous.gather(1, sequences[:, -1:]).squeeze(1))
        self.previous = None
        if not self.steps:
            return torch.zeros(sequences.shape[0], width, device=sequences.device)
        return torch.stack(self.steps, 1)  # (n, width)


class HFEngine(PromptFrontEnd):
    """The Hugging Face engine (``rollout.engine: hf``): ``generate(prompts) -> RolloutBatch``
    with transformers' ``generate`` over the model it is given (the seam:
    :mod:`ppokit.lm.generation.base`).

    ``autocast_dtype``: the precision of the forward passes (None: float32).
    ``activate``: a context manager factory entered around each generation (a policy's
    ``use("actor")``). ``kv_cache(model, capacity)``: a generation cache to use instead of
    transformers' dynamic one (:mod:`ppokit.lm.accel` gives one on a CPU). ``policy``: the
    LMPolicy the model belongs to (where :meth:`load_weights` puts an actor adapter's weights).
    Sampled batches carry ``rollout_log_prob`` (:class:`BehaviourLogProbs`).
    """

    name = "hf"
    weights_shared = True  # samples with the modules it was built on (in-process: the trainer's)

    def __init__(
        self,
        model,
        tokenizer,
        rollout_cfg,
        *,
        autocast_dtype: torch.dtype | None = None,
        activate: Callable[[], AbstractContextManager] | None = None,
        kv_cache: Callable[[Any, int], Any] | None = None,
        eos_ids: Sequence[int] | None = None,
        generation_kwargs: dict[str, Any] | None = None,
        policy=None,
    ):
        if tokenizer.padding_side != "left":
            raise ValueError("the tokenizer must pad on the left for batched generation")
        self.model = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.tokenizer = tokenizer
        self.cfg = rollout_cfg
        self.autocast_dtype = autocast_dtype
        self.activate = activate
        self.policy = policy
        self.generation_kwargs = dict(generation_kwargs or {})  # extra GenerationConfig fields
        self.eos_ids = list(eos_ids) if eos_ids is not None else eos_token_ids(tokenizer, self.model)
        self.pad_id = int(tokenizer.pad_token_id)
        self.kv_cache = kv_cache if rollout_cfg.use_cache and rollout_cfg.cache_implementation == "dynamic" else None

    @classmethod
    def for_policy(
        cls, policy, tokenizer, rollout_cfg, *, kv_cache: Callable[[Any, int], Any] | None = None, **kwargs: Any
    ) -> HFEngine:
        """An engine generating with ``policy``'s actor, in its precision."""
        if rollout_cfg.cache_implementation == "static" and policy.mode == "full" and policy.autocast_dtype:
            # Under autocast the rotary embedding returns fp32 keys (fp32 model) beside bf16
            # values, and a preallocated cache holds one dtype.
            raise UserError(STATIC_CACHE_FULL_BF16)
        kwargs.setdefault("activate", lambda: policy.use("actor"))
        return cls(
            policy.actor_model,
            tokenizer,
            rollout_cfg,
            autocast_dtype=policy.autocast_dtype,
            kv_cache=kv_cache,
            policy=policy,
            **kwargs,
        )

    @classmethod
    def for_model(
        cls, model, tokenizer, rollout_cfg, *, autocast_dtype: torch.dtype | None = None, **kwargs: Any
    ) -> HFEngine:
        """An engine generating with a plain Hugging Face causal LM."""
        return cls(model, tokenizer, rollout_cfg, autocast_dtype=autocast_dtype, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_positions(self) -> int | None:
        return max_positions(self.model)

    def load_weights(self, weights: dict[str, Tensor]) -> None:
        """``learner.rollout_weights()`` into the model generated with: the actor adapter's weights
        (lora) or the actor model's (full), all of them or one bucket."""
        if self.policy is not None:
            self.policy.load_actor_weights(weights)  # whole, or one bucket (ppokit.cluster.weights)
        else:
            self.model.load_state_dict(weights)

    def memory(self) -> EngineMemory:
        """Nothing of its own: the model is the caller's and transformers' caches live for one call."""
        return EngineMemory()

    def generation_config(self, *, greedy: bool, max_new_tokens: int):
        """transformers' GenerationConfig of a call. Sampling: the warpers are off here (temperature
        1, top_k 0, top_p 1) and applied by :class:`BehaviourLogProbs` instead, so that the
        behaviour log-probs are those of the distribution sampled from. Processors that
        transformers runs before a caller's (a model's ``repetition_penalty``, ``min_new_tokens``)
        stay; they are part of that distribution, and the scorer knows nothing of them: they
        show in the mismatch metrics."""
        c = self.cfg
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            use_cache=c.use_cache,
            do_sample=not greedy,
        )
        if c.cache_implementation == "static":  # the config requires use_cache for it
            kwargs["cache_implementation"] = "static"
        if not greedy:
            # the warpers transformers would run after ours (from the model's generation_config) are off too
            kwargs.update(temperature=1.0, top_p=1.0, top_k=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
            if getattr(getattr(self.model, "generation_config", None), "min_p", None) is not None:
                kwargs["min_p"] = 0.0  # (None would be filled from the model's; 0 keeps every token)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        kwargs.update(self.generation_kwargs)
        return GenerationConfig(**kwargs)

    def _generate(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        prompts: list[str],
        *,
        group_size: int,
        items: list[dict] | None,
        greedy: bool,
        max_new_tokens: int | None,
        start: float,
    ) -> RolloutBatch:
        device = self.device
        max_new = max_new_tokens or self.cfg.max_new_tokens
        ids = prompt_ids.repeat_interleave(group_size, 0).to(device)  # (N, P)
        am = prompt_mask.repeat_interleave(group_size, 0).to(device)  # (N, P)
        group_ids = torch.arange(len(prompts)).repeat_interleave(group_size)  # (N,)
        P = ids.shape[1]
        check_context(self.max_positions, prompts, prompt_mask.sum(1).tolist(), max_new)
        gen_cfg = self.generation_config(greedy=greedy, max_new_tokens=max_new)
        chunks, log_prob_chunks = [], []
        dtype = self.autocast_dtype
        with (
            phase_peak() as peak,
            self.activate() if self.activate is not None else contextlib.nullcontext(),
            torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None),
        ):
            for s in range(0, ids.shape[0], self.cfg.micro_batch_size):
                extra: dict[str, Any] = {}
                if self.kv_cache is not None:
                    cache = self.kv_cache(self.model, P + max_new)
                    if cache is not None:
                        extra[GENERATE_CACHE_KWARG] = cache
                recorder = None if greedy else BehaviourLogProbs(self.cfg)
                if recorder is not None:
                    extra["logits_processor"] = LogitsProcessorList([recorder])
                out = self.model.generate(
                    input_ids=ids[s : s + self.cfg.micro_batch_size],
                    attention_mask=am[s : s + self.cfg.micro_batch_size],
                    generation_config=gen_cfg,
                    **extra,
                )
                chunks.append(out[:, P:])  # (n, R_chunk)
                if recorder is not None:
                    log_prob_chunks.append(recorder.finish(out, out.shape[1] - P))  # (n, R_chunk)
        R = max(c.shape[1] for c in chunks)
        raw = torch.cat([F.pad(c, (0, R - c.shape[1]), value=self.pad_id) for c in chunks])  # (N, R)
        tensors = assemble(ids, am, raw, eos_ids=self.eos_ids, pad_id=self.pad_id)
        rollout_log_prob = None
        if log_prob_chunks:
            lp = torch.cat([F.pad(c, (0, R - c.shape[1])) for c in log_prob_chunks])  # (N, R)
            # after EOS a finished row is fed pad tokens, which top-k/top-p may give -inf: zeroed, not multiplied
            rollout_log_prob = torch.where(tensors["mask"].bool(), lp, torch.zeros_like(lp))
        lengths = tensors["mask"].sum(1).long().tolist()
        texts = self.tokenizer.batch_decode(
            [r[:n] for r, n in zip(tensors["responses"].tolist(), lengths)], skip_special_tokens=True
        )
        per_seq_prompts = [p for p in prompts for _ in range(group_size)]
        per_seq_items = [it for it in (items or [{}] * len(prompts)) for _ in range(group_size)]
        return RolloutBatch(
            **tensors,
            group_ids=group_ids.to(device),
            prompts=per_seq_prompts,
            texts=texts,
            items=per_seq_items,
            rollout_log_prob=rollout_log_prob,
            generation_time=time.perf_counter() - start,
            generation_peak_gb=peak.gb,
        )
