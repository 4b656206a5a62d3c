"""The language-model policy with a value function: actor, critic and reference (:class:`LMPolicy`).

``model.mode``: ``lora`` (default, as in UnstableBaselines) puts two peft adapters, ``actor`` and
``critic``, on one frozen Hugging Face causal LM; the critic adds a value head (:class:`ValueHead`) on
its last hidden state and the reference is the backbone with the adapters disabled, so all three cost
one backbone. ``full`` trains a whole actor and a separate critic model (``model.critic_path`` or the
policy path) and loads a frozen reference copy only when a KL term needs one. The critic-free
estimators (GRPO, RLOO, REINFORCE++) build no critic in either mode. :func:`build_policy` builds it.

Response token ``j`` of ``[left-padded prompt (P) | right-padded response (R)]`` (layout:
:mod:`ppokit.lm.generation.engine`) is predicted from the hidden state at ``P + j - 1``, where the value
of the state before it is read too; only those ``R`` states go through ``lm_head``, never all P + R.
Why: every adapter swap goes through :meth:`LMPolicy.use`, since peft's swaps clear ``requires_grad``;
the models stay in ``eval()`` (no dropout), so the scoring pass and the first update pass are the same
computation and the first importance ratio is exactly 1; under bf16 autocast frozen weights are stored
in bf16 (:meth:`LMPolicy.cast_frozen_weights`), trained ones stay fp32. CPU kernels are added afterwards
(:mod:`ppokit.lm.accel`); checkpoints: :mod:`ppokit.lm.model.checkpoint`; loading: :mod:`ppokit.lm.model.hf`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

from ppokit import algo
from ppokit.errors import UserError, first_line
from ppokit.lm.model.device import attention_implementation
from ppokit.lm.model.heads import decoder_of, hidden_then_head_matches, plain_head
from ppokit.lm.model.hf import (
    MetaModel,
    causal_lm_config,
    input_embedding_rows,
    linear_module_names,
    load_causal_lm,
    meta_build,
    meta_model,
    on_the_meta_device,
)
from ppokit.lm.model.tiny import DEFAULT_TINY_SPEC, tiny_config

ACTOR, CRITIC = "actor", "critic"


class ValueHead(nn.Module):
    """``V(s) = w . h + b`` on the critic's last hidden state, always in float32 (zero-initialised)."""

    keeps_float32 = True  # FSDP mixed precision leaves its weights in float32 (ppokit.cluster.fsdp)

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        # V = 0 at the start: a random head would predict values of order 1 while
        # rewards may be small, and its large first gradients would dominate the
        # global gradient-norm clip that the actor shares.
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:  # (n, R, H) -> (n, R)
        with torch.autocast(hidden.device.type, enabled=False):
            return self.linear(hidden.float()).squeeze(-1)


class LMPolicy(nn.Module):
    """Actor, critic (value head) and reference over one or more causal LMs.

    Implements the trainer's policy protocol (:meth:`param_groups`, :meth:`evaluate`)
    plus the passes rollouts and scoring need: :meth:`log_probs`, :meth:`values`,
    :meth:`ref_log_probs`, and :meth:`use` to put the actor adapter in place for
    generation. Inputs of every pass (``micro_batch`` keys)::

        input_ids       (n, P + R)  left-padded prompt, then the response
        attention_mask  (n, P + R)  1 on real tokens (prompt and response up to EOS)
        position_ids    (n, P + R)  cumsum(attention_mask) - 1, clamped at 0
        responses       (n, R)      the response tokens (pad after EOS)
    """

    def __init__(
        self,
        lm: nn.Module,
        value_head: ValueHead | None,
        *,
        mode: str,
        temperature: float = 1.0,
        autocast_dtype: torch.dtype | None = None,
        critic_lm: nn.Module | None = None,
        ref_lm: nn.Module | None = None,
        compute_entropy: bool = True,
    ):
        super().__init__()
        if mode not in ("lora", "full"):
            raise ValueError(f"mode must be 'lora' or 'full', got {mode!r}")
        self.mode = mode
        self.lm = lm  # lora: a PeftModel with adapters actor (+ critic)
        self.value_head = value_head  # None: no critic (critic-free estimators)
        self.critic_lm = critic_lm  # full mode with a critic only
        self.ref_lm = ref_lm  # full mode only, frozen, None unless a KL term needs it
        self.temperature = float(temperature)
        self.autocast_dtype = autocast_dtype
        self.compute_entropy = compute_entropy
        self.full_kl = False  # evaluate() adds kl_full (algo.kl_loss_type: full)
        self.trainable = True  # False: adapters stay frozen across swaps (inference)
        self.checkpointed_layers = 0  # decoder layers under gradient checkpointing
        self.compute_device: torch.device | None = None  # where the passes run, when not the weights' device (FSDP)
        self._active: str | None = None
        self._in_reference = False  # lora: inside reference() (adapters disabled)
        self._adapter_params: dict[str, list[nn.Parameter]] = {}
        if mode == "full" and (critic_lm is None) != (value_head is None):
            raise ValueError("full mode takes a critic model and a value head together, or neither")
        if mode == "lora":
            self.refresh_parameters()
            ids = {id(p) for ps in self._adapter_params.values() for p in ps}
            for p in lm.parameters():
                if id(p) not in ids:
                    p.requires_grad_(False)  # the backbone is frozen
            with self.use(ACTOR):  # the actor active, both adapters trainable
                pass
        else:
            if ref_lm is not None:
                ref_lm.requires_grad_(False)
        self._direct_head = {id(m): hidden_then_head_matches(m) for m in self.models()}

    # ------------------------------------------------------------------ structure
    def refresh_parameters(self) -> None:
        """lora: find each adapter's LoRA parameters (again, after FSDP replaced every parameter
        by its shard: :mod:`ppokit.cluster.fsdp`)."""
        if self.mode != "lora":
            return
        for name in self.adapter_names:
            params = [p for n, p in self.lm.named_parameters() if "lora_" in n and f".{name}." in n]
            if not params:
                raise ValueError(f"the peft model has no LoRA weights for adapter '{name}'")
            self._adapter_params[name] = params

    def models(self) -> list[nn.Module]:
        """The Hugging Face models the policy holds: the actor's (lora: with both adapters), the
        critic's and the reference's where they are separate (full mode)."""
        return [m for m in (self.lm, self.critic_lm, self.ref_lm) if m is not None]

    @property
    def has_critic(self) -> bool:
        """Whether there is a critic (adapter or model, and value head). The critic-free
        estimators (GRPO, RLOO, REINFORCE++) build none: no memory, no optimizer state."""
        return self.value_head is not None

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """lora: the trained adapters, ``("actor", "critic")`` or ``("actor",)``."""
        return (ACTOR, CRITIC) if self.has_critic else (ACTOR,)

    @property
    def device(self) -> torch.device:
        return self.compute_device or next(self.lm.parameters()).device

    @property
    def actor_model(self) -> nn.Module:
        """The Hugging Face model that generates (lora: call inside ``use('actor')``)."""
        return self.lm

    @property
    def has_reference(self) -> bool:
        return self.mode == "lora" or self.ref_lm is not None

    def adapter_parameters(self, name: str) -> list[nn.Parameter]:
        return self._adapter_params[name]

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[None]:
        """Make ``actor`` / ``critic`` the active adapter (lora); restore grads after the swap.

        peft's ``set_adapter`` and ``disable_adapter`` reset ``requires_grad`` (only the active
        adapter keeps it; disabling clears it for all). An autograd leaf whose ``requires_grad`` is
        cleared between forward and backward silently gets no gradient, and the actor pass runs
        before the critic pass swaps adapters. So every swap re-enables ``requires_grad`` on the
        LoRA weights of both adapters; the tests check that both adapters and the value head get
        gradients from one backward.
        """
        if self.mode == "lora" and self._active != name:
            self.lm.set_adapter(name)
            self._active = name
            self._restore_requires_grad()
        yield

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """lora: adapters disabled (the backbone); full: nothing (pass ``ref_lm``)."""
        if self.mode == "lora":
            outer, self._in_reference = self._in_reference, True
            try:
                with self.lm.disable_adapter():
                    yield
            finally:
                self._in_reference = outer
                self._restore_requires_grad()  # disabling cleared it on every adapter
        else:
            if self.ref_lm is None:
                raise RuntimeError("no reference model loaded (full mode loads one only when a KL term needs it)")
            yield

    def reset_adapters(self) -> None:
        """The adapter state of a freshly built policy: the actor active, every trained weight
        requiring grad (after weights were copied in behind peft's back)."""
        self._active = None
        with self.use(ACTOR):
            pass

    def load_actor_weights(self, weights: dict[str, Tensor]) -> None:
        """Copy some or all of the actor's weights in: lora, the ``actor`` adapter's (peft's adapter
        state dict names); full, the actor model's (its state dict names). A name the actor does
        not have is a RuntimeError."""
        if self.mode == "lora":
            result = set_peft_model_state_dict(self.lm, weights, adapter_name=ACTOR)
        else:
            result = self.lm.load_state_dict(weights, strict=False)
        if getattr(result, "unexpected_keys", None):
            raise RuntimeError(f"weights not in the actor: {result.unexpected_keys[:3]}")

    def freeze(self) -> LMPolicy:
        """Inference only: no parameter requires grad, and swaps do not re-enable them."""
        self.trainable = False
        self.requires_grad_(False)
        return self

    def _restore_requires_grad(self) -> None:
        if not self.trainable:
            for params in self._adapter_params.values():
                for p in params:
                    p.requires_grad_(False)
            return
        for params in self._adapter_params.values():
            for p in params:
                p.requires_grad_(True)

    def cast_frozen_weights(self, dtype: torch.dtype | None) -> int:
        """Store frozen parameters (the lora backbone, the full-mode reference) in ``dtype``.

        Under bf16 autocast every matmul casts an fp32 weight to bf16 on each call (the
        autocast cache only keeps casts of trainable leaves): a frozen weight gains
        nothing from fp32 storage. Stored in bf16 it costs half the memory, no copies,
        and the residual stream between frozen layers is bf16 too, so the inputs of the
        next matmuls need no cast either (as with FSDP's bf16 ``param_dtype``). Trained
        weights (LoRA, value head, full-mode actor and critic) stay fp32 master weights;
        buffers (rotary frequencies) stay fp32. Returns the number of tensors cast.
        """
        if dtype is None:
            return 0
        count = 0
        for lm in self.models():
            for name, p in lm.named_parameters():
                if not p.requires_grad and "lora_" not in name and p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
                    count += 1
            for module in lm.modules():
                # peft casts a LoRA layer's (now bf16) input up to the adapter's fp32 weight
                # dtype, and autocast casts it straight back: two copies per layer for
                # nothing. Every pass runs under autocast, which handles the dtypes.
                if hasattr(module, "cast_input_dtype_enabled"):
                    module.cast_input_dtype_enabled = False
        return count

    def enable_gradient_checkpointing(self) -> int:
        """Checkpoint every decoder layer of the trained models (the actor's, full mode's critic):
        transformers' activation checkpointing, non-reentrant. A layer keeps only its input for
        the backward pass and runs its forward again there. Returns the number of layers.

        Two details make it fit the policy. transformers checkpoints a layer only in training
        mode; the models stay in ``eval()`` (no dropout), so only the checkpointed layers' own
        ``training`` flag is set, which nothing but the checkpointing reads (their attention and
        dropout modules keep theirs). And with LoRA the actor and critic passes share the
        layers, recorded with different adapters and replayed in one backward pass: each
        layer's replay runs under the adapter state its forward had (``context_fn``).
        """
        from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: PLC0415 - heavy, only when enabled

        count = 0
        for lm in (self.lm, self.critic_lm):
            if lm is None:
                continue
            base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
            if not getattr(base, "supports_gradient_checkpointing", False):
                continue
            kwargs: dict[str, Any] = {"use_reentrant": False}
            if self.mode == "lora":
                kwargs["context_fn"] = self._replay_context
            if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.24
                base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            for module in base.modules():
                if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
                    module.training = True  # this module's flag only: its children stay in eval()
                    count += 1
        self.checkpointed_layers = count
        return count

    def _replay_context(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """torch.utils.checkpoint's ``context_fn``, called as a layer's forward is recorded: the
        forward runs as it is, the replay in the backward pass under this moment's adapter
        state (the ``actor`` or ``critic`` adapter, or adapters disabled)."""
        replay = self.reference() if self._in_reference else self.use(self._active)
        return contextlib.nullcontext(), replay

    def autocast(self):
        dtype = self.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)

    # ------------------------------------------------------------------ the passes
    def _hidden(self, lm: nn.Module, mb: dict[str, Tensor]) -> Tensor:
        """Hidden states that predict the response tokens (n, R, H)."""
        input_ids, responses = mb["input_ids"], mb["responses"]
        R = responses.shape[1]
        start = input_ids.shape[1] - R - 1  # position P - 1
        kwargs = dict(
            input_ids=input_ids, attention_mask=mb["attention_mask"], position_ids=mb["position_ids"], use_cache=False
        )
        if self._direct_head[id(lm)]:
            hidden = decoder_of(lm)(**kwargs).last_hidden_state  # (n, P + R, H)
        else:
            hidden = lm(**kwargs, output_hidden_states=True).hidden_states[-1]
        return hidden[:, start : start + R]

    def _token_log_probs(
        self, lm: nn.Module, mb: dict[str, Tensor], entropy: bool, keep_hidden: bool = False
    ) -> dict[str, Tensor]:
        """``log_prob`` (and ``entropy``) (n, R) float32; with ``keep_hidden`` also ``hidden``
        (n, R, H), the states the logits came from (models whose logits are lm_head(hidden)).

        A plain ``lm_head`` gives them from the hidden states in chunks of positions
        (:func:`ppokit.algo.log_probs_from_hidden`): no (n, R, V) logits exist, forward or
        backward. Any other model (post-processed logits, a LoRA adapter on ``lm_head``) takes
        its (n, R, V) logits whole."""
        responses = mb["responses"]
        out: dict[str, Tensor] = {}
        with self.autocast():
            head = plain_head(lm) if self._direct_head[id(lm)] else None
            if head is not None:
                hidden = self._hidden(lm, mb)  # (n, R, H)
                if keep_hidden:
                    out["hidden"] = hidden
                out["log_prob"], ent = algo.log_probs_from_hidden(
                    hidden, head.weight, responses, bias=head.bias, temperature=self.temperature, entropy=entropy
                )  # (n, R) float32 each
                if entropy:
                    out["entropy"] = ent
                return out
            if self._direct_head[id(lm)]:  # lm_head(hidden) with a LoRA adapter on lm_head
                hidden = self._hidden(lm, mb)  # (n, R, H)
                if keep_hidden:
                    out["hidden"] = hidden
                logits = lm.get_output_embeddings()(hidden)  # (n, R, V)
            else:  # a model whose logits are not lm_head(last hidden state): full logits, sliced
                R = responses.shape[1]
                start = mb["input_ids"].shape[1] - R - 1
                logits = lm(
                    input_ids=mb["input_ids"],
                    attention_mask=mb["attention_mask"],
                    position_ids=mb["position_ids"],
                    use_cache=False,
                ).logits[:, start : start + R]
            logits = logits / self.temperature
            out["log_prob"] = algo.log_probs_from_logits(logits, responses)  # (n, R) float32
            if entropy:
                out["entropy"] = algo.entropy_from_logits(logits)
        return out

    def log_probs(self, mb: dict[str, Tensor], entropy: bool = False, keep_hidden: bool = False) -> dict[str, Tensor]:
        """Actor log-probs (and entropy) of the response tokens, (n, R) float32."""
        with self.use(ACTOR):
            return self._token_log_probs(self.lm, mb, entropy, keep_hidden)

    def kl_to_reference(self, mb: dict[str, Tensor], hidden: Tensor | None = None) -> Tensor:
        """The exact ``KL(pi || pi_ref)`` over the vocabulary at each response token, (n, R) float32.

        ``sum_v p_v (log p_v - log q_v)`` on the temperature-scaled distributions of the actor
        (``hidden``: its states from the pass that computed its log-probs; gradients flow
        through them) and the reference (a no-grad pass). Computed from hidden states in
        chunks of positions (:func:`ppokit.algo.kl_full_from_hidden`): no (n, R, V) float32
        logits exist at once. A model whose logits are not ``lm_head(hidden)`` takes the
        full logits of both.
        """
        ref_lm = self.lm if self.mode == "lora" else self.ref_lm
        if ref_lm is None:
            raise RuntimeError("no reference model loaded (full mode loads one only when a KL term needs it)")
        head, ref_head = plain_head(self.lm), plain_head(ref_lm)
        if not self._direct_head[id(self.lm)] or head is None or ref_head is None:
            logits = self._full_logits(self.lm, mb, ACTOR)
            with torch.no_grad(), self.reference():
                ref_logits = self._full_logits(ref_lm, mb, None)
            return algo.kl_full(logits, ref_logits)
        if hidden is None:
            hidden = self.log_probs(mb, keep_hidden=True)["hidden"]
        with torch.no_grad(), self.reference(), self.autocast():
            ref_hidden = self._hidden(ref_lm, mb)  # (n, R, H)
        return algo.kl_full_from_hidden(
            hidden,
            ref_hidden,
            head.weight,
            None if ref_head is head else ref_head.weight,
            bias=getattr(head, "bias", None),
            ref_bias=None if ref_head is head else getattr(ref_head, "bias", None),
            temperature=self.temperature,
        )

    def _full_logits(self, lm: nn.Module, mb: dict[str, Tensor], adapter: str | None) -> Tensor:
        """(n, R, V) temperature-scaled logits of the response positions (the general path)."""
        R = mb["responses"].shape[1]
        start = mb["input_ids"].shape[1] - R - 1
        with self.use(adapter) if adapter else contextlib.nullcontext(), self.autocast():
            logits = lm(
                input_ids=mb["input_ids"],
                attention_mask=mb["attention_mask"],
                position_ids=mb["position_ids"],
                use_cache=False,
            ).logits[:, start : start + R]
        return logits.float() / self.temperature

    def ref_log_probs(self, mb: dict[str, Tensor]) -> Tensor:
        """Reference log-probs (n, R): the backbone without adapters, or the frozen copy."""
        with torch.no_grad(), self.reference():
            lm = self.lm if self.mode == "lora" else self.ref_lm
            return self._token_log_probs(lm, mb, entropy=False)["log_prob"]

    def values(self, mb: dict[str, Tensor]) -> Tensor:
        """Token-level values (n, R) float32 from the critic pass (zeros without a critic)."""
        if not self.has_critic:
            return torch.zeros(mb["responses"].shape, dtype=torch.float32, device=mb["responses"].device)
        lm = self.lm if self.mode == "lora" else self.critic_lm
        with self.use(CRITIC), self.autocast():
            hidden = self._hidden(lm, mb)  # (n, R, H)
        return self.value_head(hidden)

    # ------------------------------------------------------------------ trainer protocol
    @staticmethod
    def compact(micro_batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``micro_batch`` without its padding columns: the prompt columns left of its longest
        prompt and the response columns right of its longest response. ``input_ids``,
        ``attention_mask`` and ``position_ids`` (n, P + R) become (n, P' + R'); every other
        (n, R) tensor (``responses``, ``mask``, advantages, ...) becomes (n, R'). Only padding is
        dropped (positions are kept as they were), so every pass gives the same values on the
        real tokens."""
        am = micro_batch["attention_mask"]  # (n, P + R)
        R = micro_batch["responses"].shape[1]
        P = am.shape[1] - R
        response_len = max(int(am[:, P:].sum(1).max()), 1)  # R'
        prompt_start = int((am[:, :P].sum(0) > 0).int().argmax())  # first column any prompt uses
        out = {}
        for key, value in micro_batch.items():
            if key in ("input_ids", "attention_mask", "position_ids"):
                out[key] = value[:, prompt_start : P + response_len]
            elif value.dim() >= 2 and value.shape[1] == R:
                out[key] = value[:, :response_len]
            else:
                out[key] = value
        return out

    def evaluate(self, micro_batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``log_prob``, ``values`` (with a critic) and ``entropy``, each (n, R) float32; with
        ``full_kl`` also ``kl_full``, the exact KL to the reference over the vocabulary."""
        out = self.log_probs(micro_batch, entropy=self.compute_entropy, keep_hidden=self.full_kl)
        if self.full_kl:
            out["kl_full"] = self.kl_to_reference(micro_batch, hidden=out.pop("hidden", None))
        if self.has_critic:
            out["values"] = self.values(micro_batch)
        return out

    def param_groups(self, cfg) -> list[dict[str, Any]]:
        t = cfg.train
        critic_lr = t.critic_learning_rate or t.learning_rate
        if self.mode == "lora":
            actor = list(self._adapter_params[ACTOR])
        else:
            actor = [p for p in self.lm.parameters() if p.requires_grad]
        groups = [{"params": actor, "lr": t.learning_rate, "name": "actor"}]
        if self.has_critic:
            if self.mode == "lora":
                critic = list(self._adapter_params[CRITIC])
            else:
                critic = [p for p in decoder_of(self.critic_lm).parameters() if p.requires_grad]
            critic += list(self.value_head.parameters())
            groups.append({"params": critic, "lr": critic_lr, "name": "critic"})
        return groups


# ----------------------------------------------------------------------------- building
def lora_config(model_cfg):
    return LoraConfig(
        r=model_cfg.lora_rank,
        lora_alpha=model_cfg.lora_alpha,
        lora_dropout=0.0,
        target_modules=model_cfg.lora_target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


# lora_parameter_count's counts by (model config, rank, targets): the pre-start check counts, the estimate asks
_LORA_COUNTS: dict[tuple[str, int, str], int | None] = {}


def lora_parameter_count(model_cfg) -> int | None:
    """One adapter's parameters at ``model_cfg``'s rank and targets, counted on peft's model of the
    model its config builds on the meta device (no memory): exact where the memory estimate's formula
    is not (peft's all-linear puts adapters on every expert of a mixture of experts: Qwen3-30B-A3B at
    rank 16, 993M against the formula's 29M). None where the model or peft's model cannot be built so."""
    config = _causal_lm_config(model_cfg.path)
    key = _lora_key(config, model_cfg)
    if key not in _LORA_COUNTS:
        lm = meta_build(config)
        try:
            peft_model = None if lm is None else _meta_lora_model(lm, model_cfg)
        except Exception:  # noqa: BLE001 - peft refuses the targets (the pre-start check says so): the formula
            peft_model = None
        _LORA_COUNTS[key] = None if peft_model is None else _adapter_parameters(peft_model)
    return _LORA_COUNTS[key]


def _lora_key(config, model_cfg) -> tuple[str, int, str]:
    return (config.to_json_string(), model_cfg.lora_rank, repr(model_cfg.lora_target_modules))


def _adapter_parameters(peft_model: nn.Module) -> int:
    return sum(p.numel() for name, p in peft_model.named_parameters() if "lora_" in name)


def _meta_lora_model(lm: nn.Module, model_cfg) -> nn.Module:
    """peft's LoRA model (``model_cfg``'s rank and targets) of ``lm``, a model on the meta device
    (:func:`~ppokit.lm.model.hf.meta_build`), its adapters there too (0.5-1 s for SmolLM2-135M's 210
    layers, where the build takes 0.05-0.1 s). peft's refusal of the targets raises (ValueError)."""
    with on_the_meta_device(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's, about the targets it adapts
        return get_peft_model(lm, lora_config(model_cfg))


# train.gradient_checkpointing=auto: on for models of at least this many parameters on an accelerator
CHECKPOINTING_MIN_PARAMS = 100_000_000


def gradient_checkpointing_wanted(setting: bool | str, device: torch.device, num_parameters: int) -> bool:
    """``train.gradient_checkpointing``: true/false as given; ``auto``: on on an accelerator (not
    a CPU) for a model of at least :data:`CHECKPOINTING_MIN_PARAMS` parameters. There the
    activations of a micro-batch outgrow the weights (a 0.5B model: ~0.5 GB per layer for 64 x
    192 tokens, 24 layers), and recomputing them costs one more forward pass. A CPU trains small
    models whose activations are small beside the machine's memory, and the forward pass again
    only costs time (docs/performance.md)."""
    if setting != "auto":
        return bool(setting)
    return torch.device(device).type != "cpu" and num_parameters >= CHECKPOINTING_MIN_PARAMS


def build_policy(
    cfg,
    model_path: str | Path,
    *,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    need_reference: bool | None = None,
    need_critic: bool | None = None,
    seed: int | None = None,
) -> LMPolicy:
    """The configured policy around the model at ``model_path`` (fresh adapters / value head).

    ``need_reference`` (full mode): load the frozen reference copy; default: when
    ``algo.beta > 0`` or ``algo.use_kl_in_reward``. ``need_critic``: build the critic
    (lora: the ``critic`` adapter; full: the critic model) and the value head; default:
    when the advantage estimator uses values (``gae``), not for GRPO, RLOO or REINFORCE++.
    """
    m = cfg.model
    attn = attention_implementation(m.attn_implementation, device)
    if need_reference is None:
        need_reference = cfg.algo.beta > 0 or cfg.algo.use_kl_in_reward
    if need_critic is None:
        need_critic = cfg.uses_critic
    if seed is not None:
        torch.manual_seed(seed)
    lm = load_causal_lm(model_path, "model.path", attn_implementation=attn)
    hidden = _hidden_size(lm)
    if m.mode == "lora":
        lm.requires_grad_(False)
        names = linear_module_names(lm)  # before peft wraps them
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # peft asks a deprecated transformers property
                # GPT-2's Conv1D layers: peft says it sets fan_in_fan_out itself, which it does
                warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False", category=UserWarning)
                peft_model = get_peft_model(lm, lora_config(m), adapter_name=ACTOR)
                if need_critic:
                    peft_model.add_adapter(CRITIC, lora_config(m))
        except ValueError as exc:
            if "not found in the base model" not in str(exc):
                raise
            raise _no_such_target(m, names) from None
        policy = LMPolicy(
            peft_model,
            ValueHead(hidden) if need_critic else None,
            mode="lora",
            temperature=cfg.rollout.temperature,
            autocast_dtype=autocast_dtype,
        )
    else:
        critic = _load_critic(m, model_path, lm, attn) if need_critic else None
        ref = (
            load_causal_lm(model_path, "model.path", attn_implementation=attn).requires_grad_(False)
            if need_reference
            else None
        )
        policy = LMPolicy(
            lm,
            ValueHead(_hidden_size(critic)) if need_critic else None,
            mode="full",
            temperature=cfg.rollout.temperature,
            autocast_dtype=autocast_dtype,
            critic_lm=critic,
            ref_lm=ref,
        )
    policy.full_kl = cfg.algo.beta > 0 and cfg.algo.kl_loss_type == "full"
    policy.to(device)
    policy.cast_frozen_weights(autocast_dtype)
    if gradient_checkpointing_wanted(cfg.train.gradient_checkpointing, device, sum(p.numel() for p in lm.parameters())):
        policy.enable_gradient_checkpointing()
    return policy


def _load_critic(m, model_path: str | Path, lm: nn.Module, attn: str | None) -> nn.Module:
    """Full mode's critic model: ``model.critic_path`` (or the policy's path), its LM head frozen."""
    critic_path = m.critic_path or model_path
    critic = load_causal_lm(
        critic_path, "model.critic_path" if m.critic_path else "model.path", attn_implementation=attn
    )
    vocab, critic_vocab = input_embedding_rows(lm), input_embedding_rows(critic)
    if critic_vocab < vocab:
        raise UserError(
            f"model.critic_path={critic_path}: the critic embeds {critic_vocab} tokens but the "
            f"policy (model.path={model_path}) and its tokenizer use {vocab}; give a critic with "
            "the policy's tokenizer and vocabulary (or leave model.critic_path null)"
        )
    out_emb = critic.get_output_embeddings()
    if out_emb is not None and out_emb.weight is not critic.get_input_embeddings().weight:
        out_emb.requires_grad_(False)  # the critic's LM head is unused
    return critic


def check_model_options(model_cfg) -> None:
    """Among the pre-start checks (the model's build would refuse them once the run directory and
    the warm start exist): full mode's ``model.critic_path`` is a causal LM's directory; LoRA's
    target modules are in the model (:func:`_check_lora_targets`) and peft can adapt them
    (:func:`_check_peft_adapts_targets`), both on one model built from the config on the meta
    device (no weights; what it is stays known to the memory estimate)."""
    if model_cfg.mode == "full" and model_cfg.critic_path:
        causal_lm_config(model_cfg.critic_path, "model.critic_path")
    if model_cfg.mode != "lora":
        return
    config = _causal_lm_config(model_cfg.path)
    lm = meta_build(config)
    if lm is None:
        return  # not buildable from its config alone: the model's load says why
    _check_lora_targets(model_cfg, meta_model(config))
    _check_peft_adapts_targets(model_cfg, config, lm)


def _check_lora_targets(model_cfg, built: MetaModel) -> None:
    """``model.lora_target_modules`` (a list of names) names a module of the model, as peft matches
    them (the whole name, or its last dotted parts)."""
    targets = model_cfg.lora_target_modules
    if not isinstance(targets, list):
        return  # "all-linear", or a regular expression: peft's to match
    if not any(name == t or name.endswith("." + t) for name in built.module_names for t in targets):
        raise _no_such_target(model_cfg, built.linear_names)


def _check_peft_adapts_targets(model_cfg, config, lm: nn.Module) -> None:
    """peft's LoRA model of ``lm`` (``config``'s model on the meta device): peft accepts the targets (it
    refuses ``out_proj`` and ``conv1d`` of Mamba-based models, which ``all-linear`` names), and each
    adapted layer with a forward of its own returns a tensor (Llama 4's router is a linear layer that
    returns a tuple: peft's LoRA fails on it at the first forward pass). One line naming the fix, else
    the adapters' count is kept for the memory estimate (:func:`lora_parameter_count`)."""
    linear_names = meta_model(config).linear_names
    try:
        peft_model = _meta_lora_model(lm, model_cfg)
    except ValueError as exc:  # peft's refusal: the line names the layers it could adapt
        raise _peft_refuses(model_cfg, first_line(exc), linear_names) from None
    for name, module in peft_model.named_modules():
        base = module.get_base_layer() if isinstance(module, LoraLayer) else None
        own_forward = isinstance(base, nn.Linear) and type(base).forward is not nn.Linear.forward
        if own_forward and not _returns_a_tensor(base):
            why = f"{name.split('.')[-1]} ({type(base).__name__}) returns more than a tensor"
            raise _peft_refuses(model_cfg, why, linear_names)
    _LORA_COUNTS[_lora_key(config, model_cfg)] = _adapter_parameters(peft_model)


def _returns_a_tensor(layer: nn.Linear) -> bool:
    """Whether ``layer`` (on the meta device) returns a tensor for an input row."""
    try:
        out = layer(torch.empty(1, layer.in_features, device="meta"))
    except Exception:  # noqa: BLE001 - a forward the meta device cannot run: the run itself will tell
        return True
    return isinstance(out, Tensor)


def _peft_refuses(model_cfg, why: str, linear_names: list[str]) -> UserError:
    return UserError(
        f"model.lora_target_modules={model_cfg.lora_target_modules}: peft's LoRA cannot adapt these layers of "
        f"model.path={model_cfg.path}: {why}; list the layers to adapt in model.lora_target_modules "
        f"(its linear layers are {', '.join(linear_names)})"
    )


def _causal_lm_config(path):
    """The config of the model at ``path``, the built-in tiny model's for ``tiny``."""
    return tiny_config(DEFAULT_TINY_SPEC) if path == "tiny" else causal_lm_config(path)


def _no_such_target(model_cfg, linear_names: list[str]) -> UserError:
    return UserError(
        f"model.lora_target_modules={model_cfg.lora_target_modules}: no such module in model.path={model_cfg.path}; "
        f"its linear layers are {', '.join(linear_names)} (or use all-linear)"
    )


def _hidden_size(lm: nn.Module) -> int:
    config = lm.config
    get = getattr(config, "get_text_config", None)
    text = get() if callable(get) else config
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(text, name, None):
            return int(getattr(text, name))
    return int(lm.get_input_embeddings().weight.shape[1])
