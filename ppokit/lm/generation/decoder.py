"""A Llama/Qwen2-style decoder over plain tensors: the CUDA engine's model.

- :class:`DecoderWeights`: the engine's own copy of a Hugging Face causal LM's weights, laid out for
  decoding: per layer one fused ``qkv`` and one fused ``gate_up`` matrix (four matmuls a layer), a
  LoRA adapter folded in, ``W' = W + scale * B @ A``, so a LoRA policy decodes at the speed of a plain
  model. :meth:`~DecoderWeights.load_adapter` refolds the adapted layers after an update,
  :meth:`~DecoderWeights.load_state_dict` copies a whole model (full fine-tuning).
- :class:`KVCache`: every layer's keys and values in one allocation, (B, Hkv, L, D) per layer.
- :func:`prefill`: left-padded prompts, each row with its own positions (``cumsum(mask) - 1``) and a
  causal mask that hides padding keys; a prompt sampled ``g`` times is computed once.
- :func:`decode_step`: one token per row at per-row positions, attention over all L slots with a
  per-row validity mask. Static shapes and no host synchronisation, so the engine captures it in a
  CUDA graph. Grouped queries attend as (B, Hkv, G, D) against the cache's (B, Hkv, L, D): the G query
  heads of a key/value head are the "query positions" of one attention call, so keys are never repeated.

The forward follows transformers' Llama code (:func:`rms_norm`, the model's own rotary tables, an
optional per-head q/k norm for Qwen3). :func:`unsupported_reason` names what keeps any other model out
of :data:`SUPPORTED_MODEL_TYPES`; the engine then falls back to the HF engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn
from transformers.activations import ACT2FN

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# rope types whose cos/sin depend on the position alone (a table built once is exact)
POSITION_ONLY_ROPE = ("default", "linear", "llama3", "yarn")
QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def text_config(model: nn.Module):
    config = model.config
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers ``...ForCausalLM`` inside a peft model (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"


def unsupported_reason(model: nn.Module, adapter: str | None = None) -> str | None:
    """Why :class:`DecoderWeights` cannot run ``model`` (None: it can). ``adapter``: the peft
    adapter to fold in (its layers must be plain LoRA on linear layers)."""
    config = text_config(model)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        return f"model type {kind!r} (it runs {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "sliding_window", None) is not None or any(
        t != "full_attention" for t in getattr(config, "layer_types", None) or []
    ):
        return "sliding-window attention"
    if rope_type(config) not in POSITION_ONLY_ROPE:
        return f"rope type {rope_type(config)!r} (it runs {', '.join(POSITION_ONLY_ROPE)})"
    lm = causal_lm(model)
    decoder = getattr(lm, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "rotary_emb"):
        return f"{type(lm).__name__} does not have the Llama layout (model.layers, model.rotary_emb)"
    if adapter is not None:
        head = lm.get_output_embeddings()
        for name, module in model.named_modules():
            if _adapted(module, adapter):
                if not isinstance(module, LoraLinear):
                    return f"the adapter on {name}, not a LoRA linear layer"
                if module.use_dora.get(adapter, False):
                    return "DoRA adapters"
                if _target_of(name) is None and module is not head:
                    return f"the adapter on {name} (it folds adapters on the layers' projections and the LM head)"
    return None


def _target_of(module_name: str) -> tuple[int, str] | None:
    """``(layer index, projection)`` of ``...layers.<i>.<self_attn|mlp>.<proj>`` (None otherwise)."""
    parts = module_name.split(".")
    if len(parts) < 4 or parts[-4] != "layers" or not parts[-3].isdigit():
        return None
    if parts[-1] not in QKV + GATE_UP + ("o_proj", "down_proj"):
        return None
    return int(parts[-3]), parts[-1]


@dataclass(frozen=True)
class DecoderSpec:
    """The shapes and constants of a decoder, read from its config."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    act: str
    qk_norm: bool

    @classmethod
    def of(cls, model: nn.Module) -> DecoderSpec:
        c = text_config(model)
        heads = c.num_attention_heads
        layer0 = causal_lm(model).model.layers[0]
        return cls(
            num_layers=c.num_hidden_layers,
            hidden=c.hidden_size,
            heads=heads,
            kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            vocab=causal_lm(model).get_output_embeddings().weight.shape[0],
            eps=c.rms_norm_eps,
            act=c.hidden_act,
            qk_norm=hasattr(layer0.self_attn, "q_norm"),
        )

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes of one token (every layer's key and value)."""
        return self.num_layers * 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class Layer:
    """One decoder layer's tensors (the engine's layout)."""

    ln1: Tensor  # (H,)
    qkv: Tensor  # ((Hq + 2 Hkv) D, H)
    o: Tensor  # (H, Hq D)
    ln2: Tensor  # (H,)
    gate_up: Tensor  # (2 F, H)
    down: Tensor  # (H, F)
    qkv_bias: Tensor | None = None
    o_bias: Tensor | None = None
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None
    q_norm: Tensor | None = None  # (D,) Qwen3
    k_norm: Tensor | None = None


@dataclass
class Fold:
    """Where one Hugging Face weight lands: ``dest`` (a view of the engine's tensor), its
    ``source`` in the model (LoRA: the frozen base weight the adapter is added to) and the
    adapter's ``scale`` (alpha / r)."""

    dest: Tensor
    source: Tensor
    scale: float = 1.0

    @torch.no_grad()
    def fold(self, lora_a: Tensor | None = None, lora_b: Tensor | None = None) -> None:
        """``dest = source + scale * B @ A`` in float32, cast to the engine's dtype (no adapter: a copy)."""
        if lora_a is None:
            self.dest.copy_(self.source)
            return
        dev = self.dest.device
        delta = lora_b.to(dev, torch.float32) @ lora_a.to(dev, torch.float32)  # (out, r) @ (r, in)
        self.dest.copy_(self.source.to(dev, torch.float32) + self.scale * delta)


@dataclass
class DecoderWeights:
    """The engine's weights (module docstring): embeddings, layers, final norm, LM head, rotary tables.

    A LoRA fold is computed in float32 and stored in the engine's dtype; an adapted LM head gets its
    own folded copy (the embedding it may be tied to stays as it is). Frozen tensors the engine never
    changes (embeddings, norms, the LM head of a LoRA policy) are shared with the model, not copied,
    where the dtype and the device already match."""

    spec: DecoderSpec
    embed: Tensor  # (V, H)
    layers: list[Layer]
    norm: Tensor  # (H,)
    lm_head: Tensor  # (V, H)
    cos: Tensor  # (max positions, D)
    sin: Tensor  # (max positions, D)
    act: object
    params: dict[str, Fold] = field(default_factory=dict)  # state-dict key -> destination (full refresh)
    adapters: dict[str, Fold] = field(default_factory=dict)  # peft module name -> destination (lora refresh)
    owned_bytes: int = 0  # bytes of the tensors this object allocated (not shared with the model)
    # lora refresh in buckets: an adapted module's lora_A or lora_B whose partner has not come yet
    pending_halves: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    @torch.no_grad()
    def from_model(
        cls, model: nn.Module, *, dtype: torch.dtype, device: torch.device, adapter: str | None = None
    ) -> DecoderWeights:
        """The engine's copy of ``model`` (a transformers causal LM, or a peft model whose
        ``adapter`` is folded in), in ``dtype`` on ``device``."""
        reason = unsupported_reason(model, adapter)
        if reason is not None:
            raise ValueError(f"the CUDA engine's decoder does not run {reason}")
        spec = DecoderSpec.of(model)
        lm = causal_lm(model)
        placer = _Placer(lm, dtype, device)
        share_or_copy, stacked = placer.share_or_copy, placer.stacked
        layers = []
        for block in lm.model.layers:
            attn, mlp = block.self_attn, block.mlp
            qkv_modules = [getattr(attn, n) for n in QKV]
            gu_modules = [getattr(mlp, n) for n in GATE_UP]
            layers.append(
                Layer(
                    ln1=share_or_copy(block.input_layernorm.weight),
                    qkv=stacked(qkv_modules),
                    qkv_bias=stacked(qkv_modules, bias=True),
                    o=stacked([attn.o_proj]),
                    o_bias=stacked([attn.o_proj], bias=True),
                    ln2=share_or_copy(block.post_attention_layernorm.weight),
                    gate_up=stacked(gu_modules),
                    gate_up_bias=stacked(gu_modules, bias=True),
                    down=stacked([mlp.down_proj]),
                    down_bias=stacked([mlp.down_proj], bias=True),
                    q_norm=share_or_copy(attn.q_norm.weight) if spec.qk_norm else None,
                    k_norm=share_or_copy(attn.k_norm.weight) if spec.qk_norm else None,
                )
            )
        embed_param = lm.get_input_embeddings().weight
        head = lm.get_output_embeddings()
        embed = share_or_copy(embed_param)
        if _adapted(head, adapter):  # its own copy to fold into (the embedding, tied or not, stays)
            lm_head = stacked([head])
        elif _linear(head).weight is embed_param:
            lm_head = embed
        else:
            lm_head = share_or_copy(_linear(head).weight)
        cos, sin = rotary_tables(lm, dtype, device)
        weights = cls(
            spec=spec,
            embed=embed,
            layers=layers,
            norm=share_or_copy(lm.model.norm.weight),
            lm_head=lm_head,
            cos=cos,
            sin=sin,
            act=ACT2FN[spec.act],
            params=placer.params,
        )
        for name, module in model.named_modules() if adapter is not None else ():
            if _adapted(module, adapter):
                base = module.get_base_layer().weight
                fold = Fold(placer.module_dest[id(module)], base, float(module.scaling[adapter]))
                fold.fold(module.lora_A[adapter].weight, module.lora_B[adapter].weight)
                weights.adapters[name] = fold
        weights.owned_bytes = placer.owned + cos.numel() * cos.element_size() * 2
        return weights

    @torch.no_grad()
    def load_adapter(self, state: dict[str, Tensor]) -> None:
        """Refold the adapted layers from an adapter state dict (``get_peft_model_state_dict``
        keys: ``<module>.lora_A.weight``, ``<module>.lora_B.weight``), whole or one bucket of
        it (:mod:`ppokit.cluster.weights`): a module is refolded once both its halves have come.
        Other keys are frozen weights peft adds when the LM head is adapted (its base layer):
        unchanged, not read."""
        unknown = [k for k in state if ".lora_" in k and _adapter_module(k) not in self.adapters]
        if unknown:
            raise RuntimeError(f"rollout weights not in the engine's adapter: {unknown[:3]}")
        self.pending_halves.update((k, v) for k, v in state.items() if ".lora_" in k)
        for name in {_adapter_module(k) for k in state if ".lora_" in k}:
            a_key, b_key = f"{name}.lora_A.weight", f"{name}.lora_B.weight"
            if a_key in self.pending_halves and b_key in self.pending_halves:
                self.adapters[name].fold(self.pending_halves.pop(a_key), self.pending_halves.pop(b_key))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Copy a whole model's weights (its ``state_dict()`` keys) into the engine's tensors."""
        unknown = [k for k in state if k not in self.params]
        if unknown:
            raise RuntimeError(f"rollout weights not in the engine's model: {unknown[:3]}")
        for key, f in self.params.items():
            if key in state:
                f.dest.copy_(state[key])


def _adapted(module: nn.Module, adapter: str | None) -> bool:
    """Whether ``module`` is a peft LoRA layer carrying ``adapter``."""
    return adapter is not None and isinstance(module, LoraLayer) and adapter in module.lora_A


def _adapter_module(key: str) -> str:
    """``a.b.lora_A.weight`` -> ``a.b``."""
    return key.rsplit(".lora_", 1)[0]


def _linear(module: nn.Module) -> nn.Linear:
    """The plain linear layer of a module (a peft LoRA layer's base layer)."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


@torch.no_grad()
def rotary_tables(lm: nn.Module, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """(cos, sin), (max positions, D) each in ``dtype``: the model's own rotary module at every
    position (any rope type that depends on the position alone), built once, computed in float32
    and cast as transformers casts them."""
    rotary = lm.model.rotary_emb
    n = getattr(text_config(lm), "max_position_embeddings", None) or 4096
    positions = torch.arange(n, device=rotary.inv_freq.device)[None]  # (1, n)
    probe = torch.zeros((), dtype=torch.float32, device=rotary.inv_freq.device)
    cos, sin = rotary(probe, positions)  # (1, n, D) float32
    return cos[0].to(device, dtype), sin[0].to(device, dtype)


class KVCache:
    """Keys and values of every layer in one allocation, viewed as (B, Hkv, L, D) per layer
    for any ``B * L`` up to the capacity (the views of one storage: graphs captured on them
    stay valid as long as the storage lives)."""

    def __init__(self, spec: DecoderSpec, tokens: int, dtype: torch.dtype, device: torch.device):
        self.spec, self.tokens = spec, tokens
        self.storage = torch.zeros(
            spec.num_layers, 2, tokens * spec.kv_heads * spec.head_dim, dtype=dtype, device=device
        )

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def views(self, rows: int, length: int) -> list[tuple[Tensor, Tensor]]:
        """Each layer's (keys, values), (rows, Hkv, length, D) each."""
        if rows * length > self.tokens:
            raise ValueError(f"a cache of {self.tokens} tokens cannot hold {rows} x {length}")
        n = rows * length * self.spec.kv_heads * self.spec.head_dim
        shape = (rows, self.spec.kv_heads, length, self.spec.head_dim)
        return [(layer[0, :n].view(shape), layer[1, :n].view(shape)) for layer in self.storage]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim: normalised in float32, cast back,
    then scaled (transformers' order; torch's fused kernel for the normalisation)."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding ``x cos + rotate_half(x) sin``; ``cos``/``sin`` broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


def _qkv(w: DecoderWeights, layer: Layer, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rotated queries (..., Hq, D), keys (..., Hkv, D) and values (..., Hkv, D) of ``h`` (..., H);
    ``cos``/``sin`` (..., D)."""
    s = w.spec
    heads = F.linear(h, layer.qkv, layer.qkv_bias).unflatten(-1, (-1, s.head_dim))  # (..., Hq + 2 Hkv, D)
    qk, v = heads.split([s.heads + s.kv_heads, s.kv_heads], -2)
    if layer.q_norm is not None:
        q, k = qk.split([s.heads, s.kv_heads], -2)
        qk = torch.cat([rms_norm(q, layer.q_norm, s.eps), rms_norm(k, layer.k_norm, s.eps)], -2)
    qk = rotate(qk, cos.unsqueeze(-2), sin.unsqueeze(-2))  # queries and keys in one pass; cos/sin over heads
    q, k = qk.split([s.heads, s.kv_heads], -2)
    return q, k, v


def _mlp(w: DecoderWeights, layer: Layer, x: Tensor) -> Tensor:
    """The residual stream after the MLP block: ``x + down(act(gate(h)) * up(h))``, ``h`` the normed ``x``."""
    h = rms_norm(x, layer.ln2, w.spec.eps)
    gate, up = F.linear(h, layer.gate_up, layer.gate_up_bias).chunk(2, -1)
    return x + F.linear(w.act(gate) * up, layer.down, layer.down_bias)


def _logits(w: DecoderWeights, x: Tensor) -> Tensor:
    return F.linear(rms_norm(x, w.norm, w.spec.eps), w.lm_head).float()


def prefill(
    w: DecoderWeights,
    cache: list[tuple[Tensor, Tensor]],
    input_ids: Tensor,
    attention_mask: Tensor,
    first_row: int,
    prompt_of_row: Tensor,
) -> Tensor:
    """Next-token logits (n, V) float32 of left-padded prompts ``input_ids`` (n, P) with
    ``attention_mask`` (n, P). Their keys and values go to slots ``0 .. P-1`` of cache rows
    ``first_row, first_row + 1, ...``: row ``first_row + r`` holds prompt ``prompt_of_row[r]``'s."""
    s = w.spec
    n, P = input_ids.shape
    positions = (attention_mask.long().cumsum(1) - 1).clamp(min=0)  # (n, P)
    keys_valid = attention_mask.bool()[:, None, None, :]  # (n, 1, 1, P)
    causal = torch.ones(P, P, dtype=torch.bool, device=input_ids.device).tril()
    # a padding query sees itself only: no row of the mask is empty (its output is never read)
    mask = (causal & keys_valid) | torch.eye(P, dtype=torch.bool, device=input_ids.device)  # (n, 1, P, P)
    cos, sin = w.cos[positions], w.sin[positions]  # (n, P, D)
    x = F.embedding(input_ids, w.embed)  # (n, P, H)
    rows = slice(first_row, first_row + prompt_of_row.shape[0])
    for layer, (k_cache, v_cache) in zip(w.layers, cache):
        q, k, v = _qkv(w, layer, rms_norm(x, layer.ln1, s.eps), cos, sin)  # (n, P, h, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (n, h, P, D)
        k_cache[rows, :, :P] = k.index_select(0, prompt_of_row)
        v_cache[rows, :, :P] = v.index_select(0, prompt_of_row)
        if s.group > 1:  # each kv head for its query heads (SDPA's own GQA has no masked fused kernel)
            k, v = k.repeat_interleave(s.group, 1), v.repeat_interleave(s.group, 1)  # (n, Hq, P, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (n, Hq, P, D)
        x = x + F.linear(out.transpose(1, 2).flatten(2), layer.o, layer.o_bias)
        x = _mlp(w, layer, x)
    return _logits(w, x[:, -1])  # left padding: the last column is every prompt's last token


def decode_step(
    w: DecoderWeights,
    cache: list[tuple[Tensor, Tensor]],
    tokens: Tensor,
    positions: Tensor,
    slot: Tensor,
    valid: Tensor,
) -> Tensor:
    """Next-token logits (B, V) float32 after ``tokens`` (B,) at ``positions`` (B,), whose keys and
    values go to cache slot ``slot`` (1,) long; ``valid`` (B, L) bool marks the slots each row
    attends to, and this step marks ``slot`` valid. Static shapes, no host synchronisation."""
    s = w.spec
    B = tokens.shape[0]
    valid.index_fill_(1, slot, True)
    attn_mask = valid[:, None, None, :]  # (B, 1, 1, L)
    cos, sin = w.cos[positions], w.sin[positions]  # (B, D)
    x = F.embedding(tokens, w.embed)  # (B, H)
    for layer, (k_cache, v_cache) in zip(w.layers, cache):
        q, k, v = _qkv(w, layer, rms_norm(x, layer.ln1, s.eps), cos, sin)  # (B, h, D)
        k_cache.index_copy_(2, slot, k.unsqueeze(2))  # (B, Hkv, 1, D) into (B, Hkv, L, D)
        v_cache.index_copy_(2, slot, v.unsqueeze(2))
        q = q.view(B, s.kv_heads, s.group, s.head_dim)  # the G query heads of each kv head as positions
        out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=attn_mask)  # (B, Hkv, G, D)
        x = x + F.linear(out.reshape(B, s.heads * s.head_dim), layer.o, layer.o_bias)
        x = _mlp(w, layer, x)
    return _logits(w, x)


class _Placer:
    """Where each tensor of a causal LM lands in the engine's copy (:meth:`DecoderWeights.from_model`):
    ``params`` (state-dict key -> :class:`Fold`), ``module_dest`` (a linear module -> the engine's
    rows of its weight), ``owned`` (bytes the copy allocated)."""

    def __init__(self, lm: nn.Module, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.keys: dict[int, list[str]] = {}  # a tensor's state-dict keys (tied weights have several)
        for key, p in lm.state_dict(keep_vars=True).items():
            self.keys.setdefault(id(p), []).append(key)
        self.params: dict[str, Fold] = {}
        self.module_dest: dict[int, Tensor] = {}
        self.owned = 0

    def place(self, p: Tensor, dest: Tensor) -> Tensor:
        for key in self.keys.get(id(p), []):
            self.params.setdefault(key, Fold(dest, p))  # a tied weight lands where it first did
        return dest

    def share_or_copy(self, p: Tensor) -> Tensor:
        """``p`` itself when frozen and already in place (never changed by training), else a copy."""
        if not p.requires_grad and p.dtype == self.dtype and p.device == self.device:
            return self.place(p, p.detach())
        out = p.detach().to(device=self.device, dtype=self.dtype, copy=True)
        self.owned += out.numel() * out.element_size()
        return self.place(p, out)

    def stacked(self, modules: list[nn.Module], bias: bool = False) -> Tensor | None:
        """The modules' weights (or biases) stacked by rows in one new tensor."""
        parts = [_linear(m).bias if bias else _linear(m).weight for m in modules]
        if parts[0] is None:
            return None
        out = torch.empty(sum(p.shape[0] for p in parts), *parts[0].shape[1:], dtype=self.dtype, device=self.device)
        self.owned += out.numel() * out.element_size()
        row = 0
        for m, p in zip(modules, parts):
            view = self.place(p, out[row : row + p.shape[0]])
            view.copy_(p)
            if not bias:
                self.module_dest[id(m)] = view
            row += p.shape[0]
        return out
