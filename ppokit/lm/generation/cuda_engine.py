"""The CUDA rollout engine (``rollout.engine: cuda``): a static KV cache, decoding steps in CUDA graphs.

:class:`CudaEngine` serves the seam of :mod:`ppokit.lm.generation.base` with the model of
:mod:`ppokit.lm.generation.decoder`. What makes it faster than transformers' ``generate``:

- Its own weights, the LoRA adapter folded in (``W + scale * B @ A``): LoRA decodes as fast as a plain
  model, where transformers runs two extra matmuls per adapted layer. Refolded after each update.
- One KV cache, allocated once for the largest batch bucket x (prompt + max_new_tokens) needed.
- CUDA graphs over the decoding step (:class:`StepRunner`), one per (batch, length) bucket pair
  (:func:`batch_bucket`, :func:`length_bucket`): few shapes and no compiler, so a capture costs one
  warm-up step and one recorded step.
- Per-row positions and a validity mask over the cache slots: a short prompt decodes as if alone; a
  prompt sampled ``group_size`` times is prefilled once. Rows run in chunks of at most ``max_batch_size``.
- No host synchronisation per step, but an "all rows done?" check every :data:`SYNC_EVERY` steps.

Sampling is the HF engine's. Other models or adapters fall back to the HF engine with a note; on a CPU
the same code runs eagerly, which is what the tests check. Its floor and measurements:
docs/algorithms.md, "The CUDA rollout engine".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ppokit.lm.generation.base import EngineMemory, PromptFrontEnd, sampling_log_probs
from ppokit.lm.generation.decoder import (
    DecoderWeights,
    KVCache,
    causal_lm,
    decode_step,
    prefill,
    unsupported_reason,
)
from ppokit.lm.generation.engine import (
    HFEngine,
    RolloutBatch,
    assemble,
    check_context,
    eos_token_ids,
)
from ppokit.monitoring.peak_memory import phase_peak

SYNC_EVERY = 8  # decoding steps between checks that every row has ended
MAX_BATCH_SIZE = 256  # the largest batch bucket
CACHE_FRACTION = 0.1  # default cache budget on CUDA: this share of the device's memory
PREFILL_TOKENS = 16384  # prompt tokens per prefill pass (bounds its activations)


def batch_bucket(rows: int, largest: int = MAX_BATCH_SIZE) -> int:
    """The smallest power of two >= ``rows`` (at most ``largest``, itself a power of two)."""
    if rows < 1 or rows > largest:
        raise ValueError(f"{rows} rows do not fit buckets up to {largest}")
    return 1 << (rows - 1).bit_length()


def length_bucket(length: int) -> int:
    """The smallest of 64, 96, 128, 192, 256, 384, ... (2^k and 1.5 * 2^k) >= ``length``."""
    size = 64
    while True:
        if length <= size:
            return size
        if length <= size * 3 // 2:
            return size * 3 // 2
        size *= 2


class StepRunner:
    """The decoding step at one shape, ``rows`` x ``length`` cache slots: static input buffers
    (``tokens``, ``positions``, ``slot``, ``valid``) written before each :meth:`step`, and on
    CUDA a graph captured over them (replayed by :meth:`step`); elsewhere the step runs eagerly
    on the same buffers."""

    def __init__(self, weights: DecoderWeights, cache: KVCache, rows: int, length: int, *, graph: bool, pool=None):
        device = weights.embed.device
        self.weights, self.cache = weights, cache.views(rows, length)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)  # (B,)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # (B,)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # the cache slot of this step
        self.valid = torch.zeros(rows, length, dtype=torch.bool, device=device)  # (B, L)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None
        if graph:
            self._capture(pool)

    def _run(self) -> Tensor:
        return decode_step(self.weights, self.cache, self.tokens, self.positions, self.slot, self.valid)

    def _capture(self, pool) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (lazy initialisations, workspaces)
            self._run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = self._run()  # (B, V) float32, lives in the graph's pool
        self.valid.zero_()  # the warm-up and the capture marked a slot

    def step(self) -> Tensor:
        """Next-token logits (B, V) float32 for the buffers' tokens (read before the next step)."""
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.logits


class CudaEngine(PromptFrontEnd):
    """The CUDA engine of the rollout-engine seam (module docstring; protocol in
    :mod:`ppokit.lm.generation.base`). Build it with :meth:`for_policy` or :meth:`for_model`.

    ``model``: a transformers causal LM, or a peft model whose ``adapter`` is folded in.
    ``dtype``: the weights' and the cache's precision. ``max_batch_size``: the largest batch
    bucket (a power of two). ``cache_gb``: the KV cache's budget (default: 10% of a CUDA
    device's memory, no limit elsewhere). ``graphs``: capture the decoding step (default:
    on CUDA).
    """

    name = "cuda"
    weights_shared = False  # it decodes with its own copy: load_weights after each update

    def __init__(
        self,
        model,
        tokenizer,
        rollout_cfg,
        *,
        dtype: torch.dtype,
        adapter: str | None = None,
        eos_ids: Sequence[int] | None = None,
        max_batch_size: int = MAX_BATCH_SIZE,
        cache_gb: float | None = None,
        graphs: bool | None = None,
    ):
        if tokenizer.padding_side != "left":
            raise ValueError("the tokenizer must pad on the left for batched generation")
        if max_batch_size < 1 or max_batch_size & (max_batch_size - 1):
            raise ValueError(f"max_batch_size must be a power of two, got {max_batch_size}")
        self.model, self.tokenizer, self.cfg, self.adapter = model, tokenizer, rollout_cfg, adapter
        device = next(model.parameters()).device
        self.weights = DecoderWeights.from_model(model, dtype=dtype, device=device, adapter=adapter)
        self.eos_ids = list(eos_ids) if eos_ids is not None else eos_token_ids(tokenizer, causal_lm(model))
        self.pad_id = int(tokenizer.pad_token_id)
        self.max_batch_size = max_batch_size
        self.graphs = device.type == "cuda" if graphs is None else graphs
        if cache_gb is None and device.type == "cuda":
            cache_gb = CACHE_FRACTION * torch.cuda.get_device_properties(device).total_memory / 1e9
        self.cache_bytes = None if cache_gb is None else int(cache_gb * 1e9)
        self.cache: KVCache | None = None
        self.runners: dict[tuple[int, int], StepRunner] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._eos = torch.tensor(self.eos_ids, device=device)

    # ------------------------------------------------------------------ building
    @classmethod
    def for_policy(cls, policy, tokenizer, rollout_cfg, **options: Any):
        """The engine of ``policy``'s actor (lora: the backbone with the ``actor`` adapter folded
        in; full: the actor model), in the policy's precision; the HF engine, with a note, for a
        model it does not run."""
        adapter = "actor" if policy.mode == "lora" else None
        reason = unsupported_reason(policy.actor_model, adapter)
        if reason is not None:
            return _fall_back(reason, lambda: HFEngine.for_policy(policy, tokenizer, rollout_cfg, **options))
        return cls(
            policy.actor_model,
            tokenizer,
            rollout_cfg,
            dtype=policy.autocast_dtype or torch.float32,
            adapter=adapter,
            **_own_options(options),
        )

    @classmethod
    def for_model(cls, model, tokenizer, rollout_cfg, *, autocast_dtype: torch.dtype | None = None, **options: Any):
        """The engine of a plain transformers causal LM (the HF engine, with a note, for one it does not run)."""
        reason = unsupported_reason(model)
        if reason is not None:
            return _fall_back(
                reason,
                lambda: HFEngine.for_model(model, tokenizer, rollout_cfg, autocast_dtype=autocast_dtype, **options),
            )
        return cls(model, tokenizer, rollout_cfg, dtype=autocast_dtype or torch.float32, **_own_options(options))

    # ------------------------------------------------------------------ the seam
    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    @property
    def max_positions(self) -> int:
        """The model's ``max_position_embeddings`` (the rotary table's length)."""
        return self.weights.cos.shape[0]

    def load_weights(self, weights: dict[str, Tensor]) -> None:
        """``learner.rollout_weights()``: lora: the adapter's state dict, refolded into the adapted
        layers; full: the actor's state dict, copied."""
        if self.adapter is not None:
            self.weights.load_adapter(weights)
        else:
            self.weights.load_state_dict(weights)

    def memory(self) -> EngineMemory:
        """Its own weights (the fused, folded copies; frozen tensors shared with the model are not
        counted) and the KV cache."""
        return EngineMemory(weights=self.weights.owned_bytes, cache=self.cache.nbytes if self.cache else 0)

    # ------------------------------------------------------------------ generation
    def _generate(self, prompt_ids: Tensor, prompt_mask: Tensor, prompts: list[str], **options: Any) -> RolloutBatch:
        """:meth:`_generate_rows`, its peak memory in ``generation_peak_gb``."""
        with phase_peak() as peak:
            rollout = self._generate_rows(prompt_ids, prompt_mask, prompts, **options)
        rollout.generation_peak_gb = peak.gb
        return rollout

    def _generate_rows(
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
        check_context(self.max_positions, prompts, prompt_mask.sum(1).tolist(), max_new)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)  # (n, P)
        n, P = prompt_ids.shape
        prompt_of_row = torch.arange(n, device=device).repeat_interleave(group_size)  # (N,)
        rows_per_chunk = self._rows_per_chunk(P + max_new)
        tokens, log_probs = [], []
        for s in range(0, n * group_size, rows_per_chunk):
            chunk = prompt_of_row[s : s + rows_per_chunk]
            first, last = s // group_size, (s + len(chunk) - 1) // group_size  # the chunk's prompts
            t, lp = self._generate_chunk(
                prompt_ids[first : last + 1], prompt_mask[first : last + 1], chunk - first, greedy, max_new
            )
            tokens.append(t)
            log_probs.append(lp)
        R = max(t.shape[1] for t in tokens)
        raw = torch.cat([F.pad(t, (0, R - t.shape[1]), value=self.pad_id) for t in tokens])  # (N, R)
        ids, am = prompt_ids[prompt_of_row], prompt_mask[prompt_of_row]  # (N, P)
        tensors = assemble(ids, am, raw, eos_ids=self.eos_ids, pad_id=self.pad_id)
        longest = int(tensors["mask"].sum(1).max())  # < R when every row ended before the last check
        if longest < R:
            raw, R = raw[:, :longest], longest
            tensors = assemble(ids, am, raw, eos_ids=self.eos_ids, pad_id=self.pad_id)
        rollout_log_prob = None
        if not greedy:
            lp = torch.cat([F.pad(x[:, :R], (0, R - x[:, :R].shape[1])) for x in log_probs])  # (N, R)
            rollout_log_prob = torch.where(tensors["mask"].bool(), lp, torch.zeros_like(lp))
        lengths = tensors["mask"].sum(1).long().tolist()
        texts = self.tokenizer.batch_decode(
            [r[:k] for r, k in zip(tensors["responses"].tolist(), lengths)], skip_special_tokens=True
        )
        return RolloutBatch(
            **tensors,
            group_ids=prompt_of_row.clone(),
            prompts=[p for p in prompts for _ in range(group_size)],
            texts=texts,
            items=[it for it in (items or [{}] * len(prompts)) for _ in range(group_size)],
            rollout_log_prob=rollout_log_prob,
            generation_time=time.perf_counter() - start,
        )

    def _rows_per_chunk(self, length: int) -> int:
        """The largest batch bucket whose cache (bucket x ``length`` bucket) fits the budget."""
        rows = self.max_batch_size
        per_row = length_bucket(length) * self.weights.spec.kv_bytes_per_token(self.weights.embed.dtype)
        while rows > 1 and self.cache_bytes is not None and rows * per_row > self.cache_bytes:
            rows //= 2
        return rows

    def _runner(self, rows: int, length: int) -> StepRunner:
        """The step runner of shape ``rows`` x ``length`` (the cache grown and runners dropped when
        it does not fit: once per run in practice)."""
        if self.cache is None or rows * length > self.cache.tokens:
            self.runners.clear()
            self.cache = None  # free the old storage before the new one
            w = self.weights
            self.cache = KVCache(w.spec, rows * length, w.embed.dtype, w.embed.device)
        key = (rows, length)
        if key not in self.runners:
            try:
                runner = StepRunner(self.weights, self.cache, rows, length, graph=self.graphs, pool=self.pool)
            except RuntimeError as exc:  # a platform where the step does not capture: eager, said once
                if not self.graphs:
                    raise
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                print(
                    f"ppokit: note: the CUDA engine decodes without CUDA graphs (capture failed: {first})",
                    file=sys.stderr,
                )
                self.graphs = False
                runner = StepRunner(self.weights, self.cache, rows, length, graph=False)
            self.runners[key] = runner
        return self.runners[key]

    def _generate_chunk(
        self, prompt_ids: Tensor, prompt_mask: Tensor, prompt_of_row: Tensor, greedy: bool, max_new: int
    ) -> tuple[Tensor, Tensor]:
        """Tokens (rows, R) and their behaviour log-probs (rows, R) for the rows of one chunk:
        row ``r`` answers prompt ``prompt_of_row[r]`` of ``prompt_ids`` (m, P); ``R <= max_new``.
        The chunk's prompts are trimmed to its longest. Rows that end early ride along to the
        chunk's end (static batching, no refill); :meth:`_generate_rows` cuts each row at its
        first EOS (later tokens pad, ``mask`` 0)."""
        lengths = prompt_mask.sum(1)  # (m,)
        P = int(lengths.max())
        prompt_ids, prompt_mask = prompt_ids[:, -P:], prompt_mask[:, -P:]  # the chunk's own left padding
        rows = prompt_of_row.shape[0]
        runner = self._runner(batch_bucket(rows, self.max_batch_size), length_bucket(P + max_new))
        runner.valid.zero_()
        runner.valid[:rows, :P] = prompt_mask[prompt_of_row].bool()
        runner.tokens.zero_()
        runner.positions.zero_()
        logits = self._prefill(runner, prompt_ids, prompt_mask, prompt_of_row)  # (rows, V)
        row_lengths = lengths[prompt_of_row]  # (rows,)
        tokens = torch.full((rows, max_new), self.pad_id, dtype=torch.long, device=self.device)
        log_probs = torch.zeros(rows, max_new, device=self.device)
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        steps = max_new
        for t in range(max_new):
            if t:
                if t % SYNC_EVERY == 0 and bool(done.all()):
                    steps = t
                    break
                runner.tokens[:rows] = tokens[:, t - 1]
                torch.add(row_lengths, t - 1, out=runner.positions[:rows])  # the previous token's position
                runner.slot.fill_(P + t - 1)
                logits = runner.step()[:rows]
            tokens[:, t], lp = self._sample(logits, greedy)
            if lp is not None:
                log_probs[:, t] = lp
            done |= torch.isin(tokens[:, t], self._eos)
        return tokens[:, :steps], log_probs[:, :steps]

    def _prefill(self, runner: StepRunner, ids: Tensor, mask: Tensor, prompt_of_row: Tensor) -> Tensor:
        """The prompts' keys and values in the runner's cache rows; the first tokens' logits (rows, V)."""
        per_pass = max(1, PREFILL_TOKENS // ids.shape[1])  # prompts per pass
        logits = []
        for a in range(0, ids.shape[0], per_pass):
            b = min(a + per_pass, ids.shape[0])
            rows = ((prompt_of_row >= a) & (prompt_of_row < b)).nonzero()[:, 0]  # contiguous
            first = int(rows[0]) if len(rows) else 0
            out = prefill(self.weights, runner.cache, ids[a:b], mask[a:b], first, prompt_of_row[rows] - a)  # (b - a, V)
            logits.append(out)
        return torch.cat(logits)[prompt_of_row]

    def _sample(self, logits: Tensor, greedy: bool) -> tuple[Tensor, Tensor | None]:
        """Next tokens (B,) from logits (B, V) float32, and their log-probs under the distribution
        sampled from (None for greedy). Sampling means what it means in the HF engine: transformers'
        temperature, top-k and top-p warpers in ``generate``'s order (:func:`sampling_log_probs`),
        then one exact draw by Gumbel-max, ``argmax(log p + G)``; greedy is ``argmax`` of the raw
        logits."""
        if greedy:
            return logits.argmax(-1), None
        c = self.cfg
        log_p = sampling_log_probs(logits, c.temperature, c.top_k, c.top_p)  # (B, V), -inf outside top-k/top-p
        noise = torch.empty_like(log_p).exponential_().clamp_(min=torch.finfo(log_p.dtype).tiny)
        tokens = (log_p - noise.log()).argmax(-1)  # Gumbel-max: a draw from softmax(log_p)
        return tokens, log_p.gather(1, tokens[:, None])[:, 0]


def _own_options(options: dict[str, Any]) -> dict[str, Any]:
    """The seam's options this engine takes (it ignores ``kv_cache`` and ``activate``: its own cache,
    its own weights)."""
    return {k: v for k, v in options.items() if k not in ("kv_cache", "activate")}


def _fall_back(reason: str, build):
    print(f"ppokit: note: rollout.engine=cuda does not run {reason}; generating with the HF engine", file=sys.stderr)
    return build()
