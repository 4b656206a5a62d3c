"""The memory a language-model run needs, estimated from its config and its model's shape before
it starts; a run that cannot fit is refused with one line (:func:`check_run_fits`).

An iteration has three phases (generate, score, update; a warm start, ``sft``, may come before the
run). A phase's peak is what stays for the whole run (:func:`_resident_memory`: runtime, weights,
optimizer, rollout) plus what the phase adds and frees again (:func:`_generate_memory`,
:func:`_score_memory`, :func:`_update_memory`, :func:`_sft_memory`). The largest phase is compared
with the device's memory (a GPU's free memory, or the machine's available memory on a CPU); the
estimate aims at the peak the run reaches, not at a bound on it. :func:`resolve_micro_batches`
sizes ``auto`` micro-batches from the same estimate.

Notation (bytes): ``H`` hidden size, ``ℓ`` layers, ``h`` attention heads, ``k`` key/value heads,
``d`` head size, ``F`` MLP size, ``V`` vocabulary, ``W`` the model's parameters, ``P`` the longest
prompt, ``R`` = ``rollout.max_new_tokens``, ``L = P + R``, ``N`` sequences per iteration, ``w`` and
``a`` the bytes of a frozen weight and of an activation (2 under bf16 autocast, 4 in fp32), ``S``
what a layer keeps per token for the backward pass (:func:`saved_per_token_layer`). All formulas,
with what they were checked against: docs/algorithms.md, "Memory estimate".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ppokit.algo.hidden_log_probs import DEFAULT_CHUNK_ELEMENTS
from ppokit.errors import UserError

__all__ = [
    "IterationSizes",
    "MemoryEstimate",
    "ModelShape",
    "available_memory",
    "check_run_fits",
    "estimate_note",
    "has_auto_micro_batches",
    "resolve_micro_batches",
    "estimate_memory",
    "longest_prompt_tokens",
    "model_shape",
    "multi_turn_rows",
    "state_prompt_tokens",
]

GB = 1e9
CPU_RUNTIME = 0.45e9  # resident size of a process with torch, transformers and peft loaded
CUDA_CONTEXT = 0.5e9  # the CUDA context and kernels, outside the caching allocator
ROLLOUT_INT64_TENSORS = 3  # input_ids, attention_mask, position_ids over (N, L)
ROLLOUT_FLOAT_TENSORS = 10  # float32 tensors over (N, R) (plus responses, int64)
# a CPU warm start's later steps peak higher than its first: the heap keeps the previous step's freed
# pieces, which tensors of other sizes cannot reuse (tiny model, 128 x 245 tokens: 1.17x fp32, 1.43x bf16)
CPU_HEAP_SLACK = 1.5
SFT_EVAL_BATCH = 256  # the warm start's held-out rows at a time (ppokit.lm.sft.SFTSettings.eval_batch_size)
SAMPLE_OBJECTS = 1536  # bytes of a sample's Python objects (its text, token lists, record), measured
# models whose MLP is not gated (two matrices, not three)
UNGATED_MODEL_TYPES = ("gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "codegen", "mpt")


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only transformer."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False
    gated_mlp: bool = True
    attention_bias: bool = False  # q, k, v (and o) projections with biases (Qwen2: q, k, v)
    max_positions: int | None = None
    # the model's parameters counted on the model itself (model_shape): exact where the formula of
    # num_parameters is not (a mixture of experts' experts, ungated or other layers it does not know);
    # derived, so not part of the shape's equality
    counted_parameters: int | None = field(default=None, compare=False)
    # (rank, targets, one adapter's parameters counted on peft's model) for a run's own LoRA settings
    counted_lora: tuple[int, Any, int] | None = field(default=None, compare=False)

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """From a transformers config (Llama/Qwen/Mistral names, or GPT-2's)."""
        get = getattr(config, "get_text_config", None)
        c = get() if callable(get) else config

        def first(*names: str, default: Any = None) -> Any:
            for name in names:
                value = getattr(c, name, None)
                if value is not None:
                    return value
            return default

        hidden = int(first("hidden_size", "n_embd", "d_model"))
        heads = int(first("num_attention_heads", "n_head", default=1))
        return cls(
            hidden_size=hidden,
            num_layers=int(first("num_hidden_layers", "n_layer", "num_layers")),
            num_heads=heads,
            num_kv_heads=int(first("num_key_value_heads", default=heads)),
            head_dim=int(first("head_dim", default=hidden // heads)),
            intermediate_size=int(first("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)),
            vocab_size=int(first("vocab_size")),
            tied_embeddings=bool(first("tie_word_embeddings", default=False)),
            gated_mlp=getattr(c, "model_type", "") not in UNGATED_MODEL_TYPES,
            attention_bias=bool(first("attention_bias", default=getattr(c, "model_type", "") == "qwen2")),
            max_positions=first("max_position_embeddings", "n_positions"),
        )

    @classmethod
    def from_tiny_spec(cls, spec: Any) -> ModelShape:
        """From the built-in tiny model's :class:`~ppokit.lm.model.tiny.TinySpec`."""
        return cls(
            hidden_size=spec.hidden_size,
            num_layers=spec.num_layers,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_heads,
            head_dim=spec.hidden_size // spec.num_heads,
            intermediate_size=spec.mlp_size,
            vocab_size=spec.vocab_size,
            max_positions=spec.max_position_embeddings,
        )

    def linear_layers(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer, by the name LoRA targets."""
        H, F = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layers = {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H)}
        if self.gated_mlp:
            layers.update(gate_proj=(H, F), up_proj=(H, F), down_proj=(F, H))
        else:
            layers.update(up_proj=(H, F), down_proj=(F, H))
        return layers

    @property
    def num_parameters(self) -> int:
        """:attr:`counted_parameters` where known, else ``V H`` (embedding) ``+ V H`` (untied
        lm_head) ``+ ℓ (linear layers + 2 H) + H`` (+ the q, k, v biases of models that have them)."""
        if self.counted_parameters is not None:
            return self.counted_parameters
        per_layer = sum(i * o for i, o in self.linear_layers().values()) + 2 * self.hidden_size
        if self.attention_bias:  # q, k, v
            per_layer += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        heads = 1 if self.tied_embeddings else 2
        return heads * self.vocab_size * self.hidden_size + self.num_layers * per_layer + self.hidden_size

    def lora_parameters(self, rank: int, targets: str | list[str]) -> int:
        """One adapter's parameters: :attr:`counted_lora` where it was counted at this ``rank`` and
        ``targets``, else ``rank (in + out)`` of every targeted linear layer (``all-linear``: every
        one but lm_head)."""
        if self.counted_lora is not None and self.counted_lora[:2] == (rank, targets):
            return self.counted_lora[2]
        names = set(self.linear_layers()) if targets == "all-linear" else set(targets)
        per_layer = sum(rank * (i + o) for name, (i, o) in self.linear_layers().items() if name in names)
        head = rank * (self.hidden_size + self.vocab_size) if "lm_head" in names else 0
        return self.num_layers * per_layer + head


@dataclass
class MemoryEstimate:
    """Bytes: what stays for the run (``resident``) and what each phase adds (``phases``)."""

    resident: dict[str, float] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    other_processes: float = 0.0  # CPU: local Ray processes beside this one
    # phases that end before the run's resident memory exists (the warm start): the runtime alone beside them
    before_run: set[str] = field(default_factory=set)

    def beside(self, phase: str) -> dict[str, float]:
        """What stays beside ``phase``: the resident parts (and the other processes), or for a phase
        before the run the runtime alone."""
        if phase in self.before_run:
            return {"runtime": self.resident.get("runtime", 0.0)}
        parts = dict(self.resident)
        if self.other_processes:
            parts["other_processes"] = self.other_processes
        return parts

    def phase_total(self, phase: str) -> float:
        return sum(self.beside(phase).values()) + sum(self.phases[phase].values())

    @property
    def largest_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @property
    def total(self) -> float:
        """The largest phase, everything resident included."""
        return self.phase_total(self.largest_phase)

    def largest_part(self) -> tuple[str, float]:
        """The single largest term of the largest phase (resident or its own)."""
        parts = {**self.beside(self.largest_phase), **self.phases[self.largest_phase]}
        name = max(parts, key=parts.get)
        return name, parts[name]


MICRO_BATCH = "lower train.micro_batch_size (or set train.micro_batch_tokens)"
GENERATION = "lower rollout.micro_batch_size"
SCORING = "lower train.infer_micro_batch_size"


def advice(part: str, cfg: Any) -> str:
    """The config field that shrinks ``part`` of an estimate, in words for the message."""
    t = cfg.train
    if part in ("rollout", "batch_tokens"):
        return f"lower train.batch_size (now {t.batch_size})"
    if part == "weights":
        if cfg.model.mode == "full":
            return "use model.mode=lora (one frozen backbone, no critic or reference copies) or a smaller model"
        return "use a smaller model (model.path)" + ("" if cfg.run.precision == "bf16" else " or run.precision=bf16")
    if part in ("optimizer", "autocast_copies"):
        return "use model.mode=lora (or a smaller model)"
    if part == "activations":
        checkpointing = "" if t.gradient_checkpointing is True else ", or set train.gradient_checkpointing=true"
        return f"lower train.micro_batch_size (now {cfg.micro_batch_size}){checkpointing}"
    if part in ("backward", "update_logits"):
        return MICRO_BATCH
    if part in ("kv_cache", "prefill", "sampling"):
        return f"{GENERATION} (now {cfg.rollout.micro_batch_size})"
    if part.startswith("score_"):
        return f"{SCORING} (now {cfg.infer_micro_batch_size})"
    if part in ("sft_activations", "sft_logits", "sft_autocast_copies"):
        return f"lower data.sft_batch_size (now {cfg.data.sft_batch_size})"
    if part == "sft_heldout":
        return "hold out fewer warm-start examples (data.eval_size; multi-turn: textenv.sft_eval_turns)"
    if part.startswith("sft_"):
        return "use a smaller model (model.path), or no warm start (data.sft_epochs=0)"
    if part == "other_processes":
        return "use fewer cluster.rollout_workers or cluster.learners"
    return "free memory on the machine"


def _resident_memory(
    cfg: Any, model: ModelShape, N: int, R: int, L: int, bf16: bool, device_type: str, reward_model: ModelShape | None
) -> tuple[dict[str, float], int]:
    """``(resident, trained_models)``: what stays for the whole run (runtime, weights, optimizer,
    rollout) and the number of fully trained models (0 with LoRA; their autocast copies)::

        weights    lora: W w + 4 A (A: the adapters' and value head's parameters, fp32)
                   full: 4 W actor + 4 W critic + W w reference (each only when built)
                   + the reward model's W_rm w
        optimizer  12 per trained parameter (its gradient and AdamW's two moments, fp32)
        rollout    N (24 L + 48 R + 1536): input ids, attention mask and positions (int64), responses,
                   ~10 float32 tensors per response token (log-probs, values, rewards, advantages,
                   ...) and a sample's Python strings and token lists (1536 bytes: measured,
                   512 -> 8192 sequences of the arith task)
        runtime    CPU: 0.45 GB (Python, torch, transformers); CUDA: 0.5 GB (its context, outside
                   the allocator)
    """
    m, H, W = cfg.model, model.hidden_size, model.num_parameters
    w = 2 if bf16 else 4
    critic = cfg.uses_critic
    if m.mode == "lora":
        adapters = model.lora_parameters(m.lora_rank, m.lora_target_modules) * (2 if critic else 1)
        trained = adapters + ((H + 1) if critic else 0)
        weights = W * w + 4 * trained
        trained_models = 0
    else:
        trained_models = 2 if critic else 1
        trained = trained_models * W + ((H + 1) if critic else 0)
        reference = cfg.algo.beta > 0 or cfg.algo.use_kl_in_reward
        weights = 4 * trained + (W * w if reference else 0)
    if reward_model is not None:
        weights += reward_model.num_parameters * w
    resident = {
        "runtime": CUDA_CONTEXT if device_type == "cuda" else CPU_RUNTIME,
        "weights": weights,
        "optimizer": 12 * trained,
        "rollout": N * (8 * ROLLOUT_INT64_TENSORS * L + (8 + 4 * ROLLOUT_FLOAT_TENSORS) * R + SAMPLE_OBJECTS),
    }
    return resident, trained_models


def _generate_memory(g: int, model: ModelShape, N: int, P: int, L: int, act: int, eager: bool) -> dict[str, float]:
    """The generate phase: ``g = min(rollout.micro_batch_size, N)`` sequences at a time::

        KV cache      2 (ℓ + 1) k d g L a   (a layer's cache is copied as it grows)
        prefill       g P' (6 H + 3 F) a    the prompts' pass, one layer at a time
                      (+ eager attention scores g h P'² 4)
        sampling      4 g V x 4             the next-token distribution and sampling
        batch tokens  32 N L                the token tensors of the whole batch being assembled

    ``P`` here is P', the longest prompt taken in (a message-mode episode's later turns take in the
    conversation so far, up to L)."""
    H, F, heads = model.hidden_size, model.intermediate_size, model.num_heads
    kv = model.num_kv_heads * model.head_dim
    prefill = g * P * (6 * H + 3 * F) * act + (g * heads * P * P * 4 if eager else 0)
    return {
        "kv_cache": 2 * (model.num_layers + 1) * kv * g * L * act,  # + one layer's growing copy
        "prefill": prefill,
        "sampling": 4 * g * model.vocab_size * 4,
        "batch_tokens": 32 * N * L,
    }


def _score_memory(cfg: Any, model: ModelShape, N: int, R: int, L: int, act: int, eager: bool) -> dict[str, float]:
    """The score phase: ``s = min(train.infer_micro_batch_size, N)`` sequences per pass without
    gradients: one layer's activations ``s L (6 H + 3 F) a`` (+ scores ``s h L² 4``, eager), the last
    hidden states ``4 s L H``, the logits of one chunk of positions (:func:`ppokit.algo.log_probs_from_hidden`)
    ``3 c V 4`` with ``c = min(2^26 / V, s R)``."""
    H, F, V, heads = model.hidden_size, model.intermediate_size, model.vocab_size, model.num_heads
    s = min(cfg.infer_micro_batch_size, N)
    chunk = min(max(1, DEFAULT_CHUNK_ELEMENTS // V), s * R)
    return {
        "score_layer": s * L * (6 * H + 3 * F) * act + (s * heads * L * L * 4 if eager else 0),
        "score_hidden": 4 * s * L * H,
        "score_logits": 3 * chunk * V * 4,
    }


def saved_per_token_layer(model: ModelShape, L: int, bf16: bool, eager: bool) -> int:
    """``S``: the bytes a decoder layer keeps for the backward pass per token,
    ``(10 H + 4 F) a`` (+ ``h L s_att`` with eager attention).

    Measured with autograd's saved-tensor hooks on Llama layers (docs/performance.md, "Memory"):
    8-10 ``H`` and 3-4 ``F`` values per pass in fp32, ~10 ``H`` and 4 ``F`` (plus a few float32 norm
    statistics) in bf16. Eager attention keeps its ``h L`` probabilities per token, 4 bytes each in
    fp32, ``s_att`` = 6 in bf16 (the bf16 probabilities and their float32 softmax); SDPA keeps O(L)."""
    act, s_att = (2, 6) if bf16 else (4, 4)
    H, F = model.hidden_size, model.intermediate_size
    return (10 * H + 4 * F) * act + (model.num_heads * L * s_att if eager else 0)


def _update_memory(
    cfg: Any,
    model: ModelShape,
    N: int,
    R: int,
    L: int,
    bf16: bool,
    checkpointing: bool,
    eager: bool,
    trained_models: int,
) -> dict[str, float]:
    """The update phase: a micro-batch of ``u`` tokens (``train.micro_batch_size x L``, or
    ``train.micro_batch_tokens``), ``passes`` = 2 with a critic (actor and critic both keep their
    activations until the one backward pass), else 1::

        saved activations            passes ℓ u S
        with gradient checkpointing  passes ℓ u H a + 3 u S  (the layers' inputs; the replayed
                                     layer's activations, its temporaries and gradients)
        + one layer's gradients in flight u S, outside the layers passes u 12 H, the logits chunk
          3 c V 4, and under bf16 the autocast copies 2 W of each trained model (full mode)
    """
    t = cfg.train
    H, V = model.hidden_size, model.vocab_size
    act = 2 if bf16 else 4
    micro_rows = min(cfg.micro_batch_size, N)
    u = t.micro_batch_tokens if t.micro_batch_tokens is not None else micro_rows * L
    passes = 2 if cfg.uses_critic else 1
    per_token_layer = saved_per_token_layer(model, L, bf16, eager)  # S
    if checkpointing:  # the layers' inputs, and the replayed layer: its activations, temporaries, gradients
        activations = passes * model.num_layers * u * H * act + 3 * u * per_token_layer
    else:
        activations = passes * model.num_layers * u * per_token_layer
    update_chunk = min(max(1, DEFAULT_CHUNK_ELEMENTS // V), micro_rows * R)
    return {
        "activations": activations + passes * u * 12 * H,
        "backward": u * per_token_layer,
        "update_logits": 3 * update_chunk * V * 4,
        "autocast_copies": 2 * model.num_parameters * trained_models if bf16 else 0,
    }


def _sft_memory(
    cfg: Any, model: ModelShape, P: int, R: int, bf16: bool, device_type: str, eval_rows: int | None
) -> dict[str, float]:
    """The warm start (:func:`ppokit.lm.sft.run_sft`): the whole model trained in fp32 with AdamW,
    ``b = data.sft_batch_size`` sequences of ``T = P + R`` tokens a step (SDPA attention: the
    model's default), then at its largest either the step (activations, logits, autocast copies)
    or the held-out evaluation (greedy generation and the answer loss, ``e`` rows at a time)::

        fixed     weights 4 W, gradients and AdamW's moments 12 W, the best model's copy on the
                  host 4 (W + V H if tied) (CPU only)
        step      activations (ℓ + 1) b T S' + 12 b T H, S' = S (+ 8 H under bf16: the float32
                  residual stream the norms keep), x 1.5 on a CPU (the heap keeps the previous
                  step's freed pieces); logits at the answer tokens only (R + 1 a row: the
                  completion and EOS), their float32 copy and log-softmax 3 b (R + 1) V 4;
                  under bf16 the autocast copies 2 W
        held-out  e = min(256, held-out examples): the larger of greedy generation (as generate,
                  g = N = e) and the answer loss without gradients, e T (6 H + 3 F) a + 4 e (R + 1) V 4
    """
    H, V, W = model.hidden_size, model.vocab_size, model.num_parameters
    act = 2 if bf16 else 4
    T, b = P + R, cfg.data.sft_batch_size
    e = min(SFT_EVAL_BATCH, eval_rows if eval_rows is not None else SFT_EVAL_BATCH)
    u = b * T
    answers = min(R + 1, T)  # positions a row gets logits at: the completion and its EOS (ppokit.lm.sft.answer_loss)
    # + under bf16 the residual stream's float32 values the RMSNorms keep, 8 H (saved-tensor hooks on the
    # tiny model, 128 x 245 tokens: 7.9 kB a token and layer against S = 5.3 kB; fp32 12.0 against 10.6)
    S = saved_per_token_layer(model, T, bf16, eager=False) + (8 * H if bf16 else 0)
    activations = model.num_layers * u * S + u * 12 * H + u * S  # + one layer's gradients in flight
    step = {
        "sft_activations": activations * (CPU_HEAP_SLACK if device_type == "cpu" else 1),
        "sft_logits": 3 * b * answers * V * 4,  # the answers' logits, a float32 copy, log-softmax (or its gradient)
        "sft_autocast_copies": 2 * W if bf16 else 0,
    }
    generation = sum(_generate_memory(e, model, e, P, T, act, eager=False).values())
    # no gradients: one layer's activations, and 16 bytes per logit of the answers' logits (the logits,
    # their float32 copy, log-softmax and a buffer)
    answer_loss = e * T * (6 * H + 3 * model.intermediate_size) * act + 4 * e * answers * V * 4
    held_out = {"sft_heldout": max(generation, answer_loss)}
    # the best model's state_dict copied to the host (a tied embedding copied twice); not on a GPU
    tied = V * H if model.tied_embeddings else 0
    best_copy = 4 * (W + tied) if device_type == "cpu" else 0
    fixed = {"sft_weights": 4 * W, "sft_optimizer": 12 * W, "sft_best_copy": best_copy}
    return {**fixed, **(step if sum(step.values()) >= sum(held_out.values()) else held_out)}


def estimate_memory(
    cfg: Any,
    model: ModelShape,
    *,
    prompt_tokens: int,
    rows: int | None = None,
    response_tokens: int | None = None,
    bf16: bool,
    device_type: str,
    checkpointing: bool,
    eager_attention: bool,
    reward_model: ModelShape | None = None,
    sft_eval_rows: int | None = None,
    prefill_tokens: int | None = None,
) -> MemoryEstimate:
    """The estimate for ``cfg`` on ``model`` (the phase functions give the formulas): what stays
    resident and each phase's own (generate, score, update, and ``sft`` before the run with ``data.sft_epochs`` > 0).

    ``prompt_tokens``: the longest prompt (P); ``rows``: sequences per iteration (default
    ``train.batch_size``; multi-turn: rows); ``response_tokens``: R (default
    ``rollout.max_new_tokens``); ``bf16``: autocast in bf16; ``checkpointing``: gradient
    checkpointing on; ``eager_attention``: attention keeps its (L x L) probabilities;
    ``sft_eval_rows``: the warm start's held-out examples (None: as many as it evaluates at once);
    ``prefill_tokens``: the longest prompt a generation call takes in (default P; a message-mode
    episode's later turns prefill the conversation so far, up to L).
    The warm start is estimated whenever ``data.sft_epochs`` > 0, also for a resumed run that
    reuses its warm-started model (the estimate then errs high).
    """
    N = rows if rows is not None else cfg.train.batch_size
    R = response_tokens if response_tokens is not None else cfg.rollout.max_new_tokens
    P = prompt_tokens
    L = P + R
    act = 2 if bf16 else 4
    est = MemoryEstimate()
    est.resident, trained_models = _resident_memory(cfg, model, N, R, L, bf16, device_type, reward_model)
    g = min(cfg.rollout.micro_batch_size, N)
    prefill = prefill_tokens if prefill_tokens is not None else P
    est.phases["generate"] = _generate_memory(g, model, N, prefill, L, act, eager_attention)
    est.phases["score"] = _score_memory(cfg, model, N, R, L, act, eager_attention)
    est.phases["update"] = _update_memory(cfg, model, N, R, L, bf16, checkpointing, eager_attention, trained_models)
    if cfg.data.sft_epochs:
        est.phases["sft"] = _sft_memory(cfg, model, P, R, bf16, device_type, sft_eval_rows)
        est.before_run.add("sft")
    return est


def add_local_processes(est: MemoryEstimate, cfg: Any, model: ModelShape, bf16: bool) -> None:
    """CPU, local Ray: the rollout workers (runtime, actor weights and generation each) and the
    learner ranks beyond the first (each an update phase) share this machine's memory. With GPUs
    every process has its own, and the estimate is the largest process's."""
    c = cfg.cluster
    if c.address is not None:
        return
    w = 2 if bf16 else 4
    worker = CPU_RUNTIME + model.num_parameters * w + sum(est.phases["generate"].values())
    learner = est.phase_total("update") - est.other_processes
    est.other_processes = c.rollout_workers * worker + max(0, c.learners - 1) * learner


def available_memory(device: Any) -> tuple[float, str]:
    """(bytes, words) of the memory a run on ``device`` may use: a GPU's free memory
    (``torch.cuda.mem_get_info``), or the machine's ``MemAvailable`` plus this process's
    own resident size (a CPU)."""
    device, free, total = _device_memory(device)
    if device.type == "cuda":
        return free, f"{device} has {free / GB:.1f} GB free of {total / GB:.1f} GB"
    if free is None:
        return float("inf"), "the machine's memory is unknown"
    return free + _own_resident_bytes(), f"the machine has {free / GB:.1f} GB available"


def _device_memory(device: Any) -> tuple[Any, float | None, float | None]:
    """``(torch.device, free, total)`` bytes: a GPU's (``torch.cuda.mem_get_info``), or the machine's
    ``MemAvailable`` and ``MemTotal`` (None where /proc/meminfo does not say)."""
    import torch  # noqa: PLC0415 - heavy; the checks import it only when a run starts

    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return device, float(free), float(total)
    return device, _meminfo_bytes("MemAvailable"), _meminfo_bytes("MemTotal")


def _meminfo_bytes(key: str) -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


def _own_resident_bytes() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def describe(est: MemoryEstimate) -> str:
    """``about 132.5 GB (largest phase: generate; its largest part: rollout 96.8 GB)``."""
    part, size = est.largest_part()
    phase = est.largest_phase
    return f"about {est.total / GB:.1f} GB (largest phase: {phase}; its largest part: {part} {size / GB:.1f} GB)"


def check_fits(est: MemoryEstimate, available: float, where: str, cfg: Any) -> None:
    """UserError when the estimate's largest phase exceeds ``available`` bytes."""
    if est.total <= available:
        return
    part, _ = est.largest_part()
    fix = advice(part, cfg)
    raise UserError(
        f"not enough memory: this run needs {describe(est)} but {where}; {fix}, or set run.memory_check=false "
        "to start anyway"
    )


# ----------------------------------------------------------------------------- the model's shape
def model_shape(path: str | Path, what: str = "model.path") -> ModelShape | None:
    """The shape of the model at ``path`` (its config.json; its parameters counted on the model built
    from it on the meta device), or of the built-in tiny model; None when the config does not say
    (an architecture without the usual size fields)."""
    if str(path) == "tiny":
        from ppokit.lm.model.tiny import DEFAULT_TINY_SPEC  # noqa: PLC0415 - tokenizers on import

        return ModelShape.from_tiny_spec(DEFAULT_TINY_SPEC)
    from ppokit.lm.model.hf import causal_lm_config, meta_model  # noqa: PLC0415 - transformers on use

    try:
        config = causal_lm_config(path, what)
        shape = ModelShape.from_hf_config(config)
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    built = meta_model(config)
    return replace(shape, counted_parameters=None if built is None else built.parameters)


def reward_model_shape(path: str | Path) -> ModelShape | None:
    """A reward model's shape from its config.json, its parameters counted on the sequence classifier
    the config builds on the meta device (a score head where the formula counts an LM head); None when
    the config cannot be read (the reward model's loader says why)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification  # noqa: PLC0415 - on use

    from ppokit.lm.model.hf import meta_model  # noqa: PLC0415 - transformers on use

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        shape = ModelShape.from_hf_config(config)
    except Exception:  # noqa: BLE001 - any failure: the reward model's loader says why
        return None
    built = meta_model(config, AutoModelForSequenceClassification)
    return replace(shape, counted_parameters=None if built is None else built.parameters)


def longest_prompt_tokens(tokenizer: Any, texts: list[str], sample: int = 64) -> int:
    """The token count of the longest of ``texts``, from the ``sample`` longest by characters
    (tokenizing a large data set whole would cost more than the check is worth)."""
    longest = sorted((t for t in texts if isinstance(t, str)), key=len, reverse=True)[:sample]
    if not longest:
        return 0
    return max(len(ids) for ids in tokenizer(longest)["input_ids"])


def state_prompt_tokens(
    observation_tokens: list[int], reply_tokens: int, retried: list[int] | None = None, turns: int | None = None
) -> int:
    """P of a state-mode multi-turn run: the longest prompt of an episode, from the token counts
    of its observations in turn order (one episode played by random legal moves, the first
    observation at 0), observation k counted with room for the k replies before it
    (``reply_tokens`` = R each). A state observation may be the whole transcript (TextArena's
    ``view: history`` echoes every reply and notice), so the last prompts of an episode can be
    several times the first: sized by the first alone, a TicTacToe-v0 run with SmolLM2 was
    estimated at 7.6 GB and killed at 18 GB for lack of memory, and with the shorter
    ``view: board`` one measured 8.6 GB against 4.4 GB estimated (8.3 GB from the probe and the
    chat template's tokens; docs/performance.md, "SmolLM2 on TextArena games"). The probe's
    moves are short, the model's replies up to R tokens: the R per earlier turn covers a
    transcript that echoes them.

    ``retried``: the observations of an episode of invalid replies from a first observation
    (``[first, after one, after two, ...]``, as long as the environment asks again), where an
    invalid reply does not end the episode: a turn may come after k legal moves and j retries,
    sized ``n_k + retried_j - retried_0`` with room for its k + j replies, within ``turns``
    (a whole transcript grows by each notice: TicTacToe-v0's by 129 tokens, 8 retries reaching
    1,247 tokens where the legal probe's longest prompt was 997)."""
    R = reply_tokens
    longest = max(n + k * R for k, n in enumerate(observation_tokens))
    if not retried or turns is None:
        return longest
    for k, n in enumerate(observation_tokens[:turns]):
        for j in range(1, min(len(retried), turns - k)):
            longest = max(longest, n + retried[j] - retried[0] + (k + j) * R)
    return longest


def multi_turn_rows(
    cfg: Any,
    observation_tokens: int,
    message_mode: bool,
    context: int | None,
    env_turns: int | None = None,
    later_observations: list[int] | None = None,
    retry_observation: int | None = None,
    seats: int = 2,
) -> tuple[int, int, int]:
    """``(rows, P, R)`` of a multi-turn iteration from the first observation's length:
    state mode, one row per turn (``train.batch_size x`` turns, both seats of a self-play
    game included), the observation as the prompt and ``rollout.max_new_tokens``; message
    mode, one row per trained seat of an episode (``seats``: 2 in self-play) with the rest
    of the conversation as its response region (``textenv.max_episode_tokens``, else every
    turn's reply and the ``turns - 1`` messages between them, within the model's context).

    The messages after the first are ``later_observations`` (token counts from a probe
    episode; a game's later messages are a move and a board, its first the rules too) and,
    where an invalid reply does not end the episode, ``retry_observation`` (the message
    asking again), which may come at any turn: the ``turns - 1`` largest of the probe's
    messages and the retry's, repeated. Without a retry the probe's longest is repeated for
    the turns beyond it; without a probe every message is as long as the first. Turns:
    ``textenv.max_turns``, or the environment's own limit ``env_turns`` when that is lower
    (the calculator ends an episode after 6 turns, where the default ``textenv.max_turns``
    is 32)."""
    t, R = cfg.textenv, cfg.rollout.max_new_tokens
    turns = min(t.max_turns, env_turns) if env_turns else t.max_turns
    if not message_mode:
        return cfg.train.batch_size * turns, observation_tokens, R
    slots = turns - 1  # the messages between the replies
    later = list(later_observations or [])
    if not later:
        later = [observation_tokens] * slots
    elif retry_observation is not None:
        later = sorted(later + [retry_observation] * slots, reverse=True)
    else:
        later += [max(later)] * slots
    stream = t.max_episode_tokens or turns * R + sum(later[:slots])
    if context is not None:
        stream = min(stream, max(context - observation_tokens, R))
    return seats * cfg.train.batch_size, observation_tokens, stream


@dataclass(frozen=True)
class IterationSizes:
    """The sequences of an iteration as the estimate sizes them: ``P`` the longest prompt (in
    tokens), ``N`` the rows an iteration trains (None: ``train.batch_size``, its sequences),
    ``R`` each row's response region (None: ``rollout.max_new_tokens``) and ``P'`` the longest
    prompt a generation call takes in (None: ``P``; a message-mode turn prefills its conversation)."""

    prompt_tokens: int
    rows: int | None = None
    response_tokens: int | None = None
    prefill_tokens: int | None = None


def check_run_fits(cfg: Any, sizes: IterationSizes, *, sft_eval_rows: int | None = None) -> MemoryEstimate | None:
    """Estimate ``cfg``'s memory (module docstring) and refuse, with one line, a run whose
    largest phase exceeds the memory of its device; the estimate (None when
    ``run.memory_check`` is off, or the model's config does not give its sizes). An ``auto``
    micro-batch size counts at its unresolved value (:data:`ppokit.config.UNRESOLVED_MICRO_BATCH`):
    the run fits if that fits, and auto picks no more than fits."""
    if not cfg.run.memory_check:
        return None
    estimator = Estimator.for_run(cfg, sizes)
    if estimator is None:
        return None
    est = estimator.run_estimate(cfg, sft_eval_rows)
    check_fits(est, *available_memory(estimator.device), cfg)
    return est


def estimate_note(
    cfg: Any, sizes: IterationSizes, *, sft_eval_rows: int | None = None, known: MemoryEstimate | None = None
) -> str | None:
    """The run header's line with the estimate of ``cfg`` as it will run (its micro-batch sizes
    resolved), beside which each iteration logs the measured peaks; None without the model's sizes.
    ``known``: this very estimate, already made (the pre-start check's, where no size was ``auto``)."""
    est = known
    if est is None:
        estimator = Estimator.for_run(cfg, sizes)
        if estimator is None:
            return None
        est = estimator.run_estimate(cfg, sft_eval_rows)
    phases = ", ".join(f"{p} {est.phase_total(p) / GB:.2f}" for p in est.phases)
    return f"memory estimate: {describe(est)}; by phase (GB): {phases}; measured peaks: memory/peak_gb"


@dataclass
class Estimator:
    """What a run's estimate depends on besides its config: the model's (and reward model's)
    shape, the sequences of an iteration, the device and its numerics."""

    model: ModelShape
    device: Any  # torch.device
    bf16: bool
    checkpointing: bool
    eager_attention: bool
    sizes: IterationSizes
    reward_model: ModelShape | None
    sft_eval_rows: int | None = None  # the warm start's held-out examples (None: unknown)

    @classmethod
    def for_run(cls, cfg: Any, sizes: IterationSizes) -> Estimator | None:
        """The estimator of ``cfg``'s run (None when the model's config does not give its sizes)."""
        from ppokit.lm.model.device import (  # noqa: PLC0415 - torch on import
            attention_implementation,
            resolve_precision,
            run_device,
        )
        from ppokit.lm.model.policy import (  # noqa: PLC0415 - peft, transformers
            gradient_checkpointing_wanted,
            lora_parameter_count,
        )

        device = run_device(cfg)
        model = model_shape(cfg.model.path)
        if model is None:
            return None
        m = cfg.model
        if m.mode == "lora" and m.path != "tiny":  # the tiny Llama's formula is exact
            counted = lora_parameter_count(m)
            if counted is not None:
                model = replace(model, counted_lora=(m.lora_rank, m.lora_target_modules, counted))
        if cfg.data.max_prompt_tokens is not None:  # longer prompts are dropped
            sizes = replace(sizes, prompt_tokens=min(sizes.prompt_tokens, cfg.data.max_prompt_tokens))
        return cls(
            model=model,
            device=device,
            bf16=resolve_precision(cfg.run.precision, device) is not None,
            checkpointing=gradient_checkpointing_wanted(cfg.train.gradient_checkpointing, device, model.num_parameters),
            eager_attention=attention_implementation(cfg.model.attn_implementation, device) == "eager",
            sizes=sizes,
            reward_model=reward_model_shape(cfg.data.reward_model) if cfg.data.reward_model else None,
        )

    def estimate(self, cfg: Any) -> MemoryEstimate:
        return estimate_memory(
            cfg,
            self.model,
            prompt_tokens=self.sizes.prompt_tokens,
            rows=self.sizes.rows,
            response_tokens=self.sizes.response_tokens,
            bf16=self.bf16,
            device_type=self.device.type,
            checkpointing=self.checkpointing,
            eager_attention=self.eager_attention,
            reward_model=self.reward_model,
            sft_eval_rows=self.sft_eval_rows,
            prefill_tokens=self.sizes.prefill_tokens,
        )

    def run_estimate(self, cfg: Any, sft_eval_rows: int | None) -> MemoryEstimate:
        """The whole run's estimate: with the warm start's held-out rows, and on a CPU the local
        Ray processes beside this one."""
        self.sft_eval_rows = sft_eval_rows
        est = self.estimate(cfg)
        if self.device.type == "cpu":
            add_local_processes(est, cfg, self.model, self.bf16)
        return est


# the share of the device's memory an ``auto`` micro-batch size lets its phase reach: half, a
# margin for what the estimate leaves out (the allocator's fragmentation, other processes)
AUTO_MEMORY_SHARE = 0.5


def resolve_micro_batches(cfg: Any, sizes: IterationSizes) -> tuple[Any, str | None]:
    """``cfg`` with its ``auto`` micro-batch sizes replaced by numbers, and a line for the run's
    header saying what was chosen (None when neither size is ``auto``).

    ``train.micro_batch_size: auto``: the largest power of two ``m`` (or a learner's whole share
    of the mini-batch, ``ceil(mini_batch / learners)``) for which the estimate of the update
    phase, micro-batches of ``m`` rows, stays within :data:`AUTO_MEMORY_SHARE` of the device's
    total memory; ``train.infer_micro_batch_size: auto``: the same for the scoring phase, up to
    the rows of an iteration. At least 1. The device's total (not its free) memory makes the
    choice the same at every start of a run on one machine, so that a resumed run computes as
    it did. Without the model's sizes: the unresolved sizes (1 and 4). The sizes are
    :func:`check_run_fits`'s (:attr:`IterationSizes.prefill_tokens` sets the generate phase alone)."""
    from ppokit.config import UNRESOLVED_INFER_MICRO_BATCH, UNRESOLVED_MICRO_BATCH  # noqa: PLC0415 - a cycle

    t = cfg.train
    auto_train, auto_infer = t.micro_batch_size == "auto", t.infer_micro_batch_size == "auto"
    if not has_auto_micro_batches(cfg):
        return cfg, None
    estimator = Estimator.for_run(cfg, sizes)
    total, where = total_memory(estimator.device) if estimator is not None else (0.0, "")
    known = estimator is not None and total > 0

    def largest(name: str, phase: str, cap: int, fallback: int) -> int:
        if not known:
            return fallback
        best = 1
        for m in candidate_sizes(cap):
            trial = cfg.model_copy(update={"train": t.model_copy(update={name: m})})
            if estimator.estimate(trial).phase_total(phase) <= AUTO_MEMORY_SHARE * total:
                best = m
        return best

    chosen: dict[str, int] = {}
    parts = []
    if auto_train:
        share = -(-cfg.mini_batch_size // max(1, cfg.cluster.learners))
        chosen["micro_batch_size"] = largest("micro_batch_size", "update", share, UNRESOLVED_MICRO_BATCH)
        parts.append(f"{chosen['micro_batch_size']} rows a pass in the update")
    if auto_infer:
        n = sizes.rows if sizes.rows is not None else t.batch_size
        chosen["infer_micro_batch_size"] = largest("infer_micro_batch_size", "score", n, UNRESOLVED_INFER_MICRO_BATCH)
        parts.append(f"{chosen['infer_micro_batch_size']} in scoring")
    why = f"the largest the memory estimate fits in half of {where}" if known else "the model's sizes are unknown"
    resolved = cfg.model_copy(update={"train": t.model_copy(update=chosen)})
    return resolved, f"micro-batches (auto): {', '.join(parts)} ({why})"


def has_auto_micro_batches(cfg: Any) -> bool:
    """Whether ``cfg`` leaves a micro-batch size to :func:`resolve_micro_batches` (the run then sizes
    its sequences for it; otherwise it need not)."""
    return "auto" in (cfg.train.micro_batch_size, cfg.train.infer_micro_batch_size)


def candidate_sizes(cap: int) -> list[int]:
    """1, 2, 4, ... below ``cap``, then ``cap`` itself."""
    sizes, m = [], 1
    while m < cap:
        sizes.append(m)
        m *= 2
    return sizes + [max(1, cap)]


def total_memory(device: Any) -> tuple[float, str]:
    """(bytes, words) of all the memory of ``device``: a GPU's, or the machine's (``MemTotal``;
    0 where it is unknown)."""
    device, _, total = _device_memory(device)
    if total is None:
        return 0.0, ""
    where = f"{device}'s" if device.type == "cuda" else "the machine's"
    return total, f"{where} {total / GB:.1f} GB"
