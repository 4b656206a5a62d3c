"""Put the fused CPU kernels into a transformers model's layers.

:func:`fuse_cpu_kernels` gives three kinds of modules a forward that calls the kernels:

- RMSNorm layers (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ...): the whole norm;
- SwiGLU MLPs (``down(act(gate(x)) * up(x))`` with SiLU): the activation and product;
- attention layers whose module calls ``apply_rotary_pos_emb``: the rotary embedding.

A module class is fused only after a probe: its own forward, run on random bf16 inputs,
must give what the kernel gives (to one bf16 rounding; float32 runs the same formula).
So a norm with another formula (Gemma's ``1 + w``), another activation or another
rotary layout keeps its own forward, and the fused path computes the same thing as
transformers, only in fewer passes over memory. Even in a fused module each call checks
its inputs (CPU, bf16 or float32 alike, contiguous, frozen norm weight) and falls back
to the module's own forward otherwise, so GPUs, mixed dtypes and full fine-tuning's trained norm weights are unaffected.

Rotary embeddings are a module-level function in transformers, not a module: the
attention module's file gets a dispatcher in place of its ``apply_rotary_pos_emb`` that
calls the kernel only inside a fused attention module's forward (a context variable
says so) and the original function everywhere else. Eager attention is one too
(``eager_attention_forward``): inside a fused attention module, without dropout, a
decoding step (one new token per sequence, no grad) runs the ``decode_attention``
kernel, one pass over the KV cache, and any other call over at most
``ATTENTION_MAX_KEYS`` keys (training and scoring passes) runs ``AttentionFunction``,
one pass per query row forward and backward, where eager attention makes two batched
matmuls, the scaling, the mask, the softmax, a cast and a transpose; their own probe
must agree first.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

from ppokit.lm.accel.class_swap import fused_subclass, restore_classes
from ppokit.lm.accel.kernels import cpu_library
from ppokit.lm.accel.kernels.functions import (
    MAX_HEAD_DIM,
    AttentionFunction,
    RMSNormFunction,
    RotaryFunction,
    SiluMulFunction,
    decode_attention,
    eligible,
)

# set while a fused attention module runs its forward: the dispatchers below call the kernels then
_IN_FUSED_ATTENTION: contextvars.ContextVar[bool] = contextvars.ContextVar("ppokit_fused_attention", default=False)
_FUSED: dict[type, type] = {}  # original class -> fused subclass
_PROBED: dict[type, bool] = {}  # original class -> does the probe agree
_DISPATCHERS: dict[str, Callable] = {}  # module name -> installed rotary dispatcher
_ATTENTION_DISPATCHERS: dict[str, Callable] = {}  # module name -> installed eager-attention dispatcher
_ATTENTION_PROBED: dict[str, bool] = {}  # module name -> do the attention probes agree
_UNSUPPORTED_ATTENTION_KWARGS = ("sliding_window", "softcap", "s_aux", "sinks")
# The attention kernel's longest key length: it computes its products with vector FMAs,
# eager attention with batched matmuls, which win on longer sequences (docs/performance.md).
ATTENTION_MAX_KEYS = 64


def _alike(mine: torch.Tensor, theirs) -> bool:
    """A tensor of the same shape and dtype."""
    return isinstance(theirs, torch.Tensor) and mine.shape == theirs.shape and mine.dtype == theirs.dtype


def _agrees(mine: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Equal to one bf16 rounding (2^-7 relative), shapes and dtypes alike."""
    return _alike(mine, theirs) and bool(torch.allclose(mine.float(), theirs.float(), rtol=2**-7, atol=1e-6))


def _agrees_to_scale(mine: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Equal to one bf16 rounding of the tensor's largest value: sums of rounded terms
    (a gradient summed over heads) differ by that much from one rounded sum."""
    if not _alike(mine, theirs):
        return False
    scale = theirs.float().abs().max().item()
    return bool((mine.float() - theirs.float()).abs().max().item() <= 2**-7 * scale + 1e-6)


def _probe_generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ----------------------------------------------------------------------------- RMSNorm
def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and getattr(module, "bias", None) is None
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def _probe_rms_norm(cls: type, module: nn.Module) -> bool:
    g = _probe_generator()
    d = module.weight.shape[0]
    x = torch.randn(2, 3, d, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    with torch.no_grad():
        theirs = cls.forward(SimpleNamespace(weight=w, variance_epsilon=module.variance_epsilon), x)
        mine = RMSNormFunction.apply(x, w, module.variance_epsilon)
    return _agrees(mine, theirs)


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if (
        hidden_states.is_contiguous()
        and eligible(hidden_states, w)
        and hidden_states.shape[-1] == w.shape[0]
        and not (w.requires_grad and torch.is_grad_enabled())
    ):
        return RMSNormFunction.apply(hidden_states, w, self.variance_epsilon)
    return self._unfused_forward(hidden_states)


# ----------------------------------------------------------------------------- SwiGLU MLP
def _is_swiglu_mlp(module: nn.Module) -> bool:
    return all(
        isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")
    ) and isinstance(getattr(module, "act_fn", None), nn.Module)


def _probe_mlp(cls: type, module: nn.Module) -> bool:
    g = _probe_generator()
    gate = (3 * torch.randn(2, 3, 40, generator=g)).bfloat16()
    up = torch.randn(2, 3, 40, generator=g).bfloat16()
    stand_in = SimpleNamespace(
        gate_proj=lambda x: gate, up_proj=lambda x: up, down_proj=lambda t: t, act_fn=module.act_fn
    )
    with torch.no_grad():
        theirs = cls.forward(stand_in, torch.zeros(2, 3, 8, dtype=torch.bfloat16))
        mine = SiluMulFunction.apply(gate, up)
    return _agrees(mine, theirs)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate = self.gate_proj(x)  # [..., F]
    up = self.up_proj(x)  # [..., F]
    if gate.shape == up.shape and gate.is_contiguous() and up.is_contiguous() and eligible(gate, up):
        return self.down_proj(SiluMulFunction.apply(gate, up))
    return self.down_proj(self.act_fn(gate) * up)  # the probed forward, without projecting twice


# ----------------------------------------------------------------------------- rotary
def _file_function(cls: type, name: str) -> Callable | None:
    """The module-level function ``name`` of the file that defines ``cls``, if any."""
    return getattr(sys.modules.get(cls.__module__), name, None)


def _install_into_file(
    cls: type, name: str, installed: dict[str, Callable], make_dispatcher: Callable[[Callable], Callable]
) -> None:
    """Replace the function ``name`` of the file of ``cls`` by ``make_dispatcher(original)``,
    once per file (``installed``: file -> dispatcher)."""
    if cls.__module__ not in installed:
        module = sys.modules[cls.__module__]
        installed[cls.__module__] = make_dispatcher(getattr(module, name))
        setattr(module, name, installed[cls.__module__])


def _rotary_function(cls: type) -> Callable | None:
    return _file_function(cls, "apply_rotary_pos_emb")


def _fast_rotary(q, k, cos, sin, args, kwargs):
    """(q_embed, k_embed) by the kernel, or None when these inputs cannot take it."""
    unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
    if len(args) > 1 or set(kwargs) - {"unsqueeze_dim"} or unsqueeze_dim != 1:
        return None
    if (
        q.dim() != 4
        or k.dim() != 4
        or cos.dim() != 3
        or cos.shape != sin.shape
        or cos.requires_grad
        or sin.requires_grad
        or not eligible(q, k, cos, sin)
    ):
        return None
    B, _, T, D = q.shape
    if (
        D % 2
        or k.shape[0] != B
        or k.shape[2:] != q.shape[2:]
        or cos.shape[0] not in (1, B)
        or tuple(cos.shape[1:]) != (T, D)
    ):
        return None
    cos, sin = cos.expand(B, T, D), sin.expand(B, T, D)  # [B, T, D]
    if cos.stride() != sin.stride():
        return None
    return RotaryFunction.apply(q, cos, sin), RotaryFunction.apply(k, cos, sin)


def _make_dispatcher(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if _IN_FUSED_ATTENTION.get():
            fast = _fast_rotary(q, k, cos, sin, args, kwargs)
            if fast is not None:
                return fast
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb.__doc__ = "ppokit's dispatcher: the fused CPU kernel inside fused attention, else:\n\n" + (
        original.__doc__ or ""
    )
    return apply_rotary_pos_emb


def _probe_rotary(cls: type, module: nn.Module) -> bool:
    original = _rotary_function(cls)  # an installed dispatcher calls the original here
    if original is None:
        return False
    g = _probe_generator()
    q = torch.randn(2, 5, 3, 8, generator=g).bfloat16().transpose(1, 2)  # [B, H, T, D], strided
    k = torch.randn(2, 5, 1, 8, generator=g).bfloat16().transpose(1, 2)  # one KV head
    cos = torch.randn(2, 5, 8, generator=g).bfloat16()
    sin = torch.randn(2, 5, 8, generator=g).bfloat16()
    with torch.no_grad():
        theirs = original(q, k, cos, sin)
        mine = _fast_rotary(q, k, cos, sin, (), {})
    return (
        mine is not None
        and isinstance(theirs, tuple)
        and len(theirs) == 2
        and all(_agrees(a, b) for a, b in zip(mine, theirs))
    )


def _install_dispatcher(cls: type) -> None:
    _install_into_file(cls, "apply_rotary_pos_emb", _DISPATCHERS, _make_dispatcher)


# ----------------------------------------------------------------------------- attention
def _attention_shapes_fit(module, query, key, value, scaling, dropout, kwargs) -> bool:
    """Whether q [B, H, T, D], k and v [B, Hkv, S, D] and the call's options are ones the
    attention kernels compute exactly as eager attention does."""
    if dropout or scaling is None or any(kwargs.get(k) is not None for k in _UNSUPPORTED_ATTENTION_KWARGS):
        return False
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape or not eligible(query, key, value):
        return False
    B, H, _, D = query.shape
    Hkv = key.shape[1]
    return (
        key.shape[0] == B
        and key.shape[3] == D
        and Hkv > 0
        and H % Hkv == 0
        and H // Hkv == getattr(module, "num_key_value_groups", H // Hkv)
    )


def _mask_fits(attention_mask, query: torch.Tensor, T: int, S: int) -> bool:
    """None, or an additive [B or 1, 1, T or 1, S] CPU mask of the query's dtype or float32, no grad."""
    if attention_mask is None:
        return True
    m = attention_mask
    return (
        isinstance(m, torch.Tensor)
        and m.dim() == 4
        and m.shape[1] == 1
        and m.shape[2] in (1, T)
        and m.shape[3] == S
        and m.shape[0] in (1, query.shape[0])
        and m.dtype in (query.dtype, torch.float32)
        and m.device.type == "cpu"
        and not m.requires_grad
    )


def _fast_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """attn_output [B, T, H, D] by a kernel, or None when this call cannot take one: a
    decoding step (one query, no grad) reads the KV cache with ``decode_attention``; other
    calls up to :data:`ATTENTION_MAX_KEYS` keys (training and scoring passes, prefill) take
    :class:`AttentionFunction`, forward and backward."""
    if not _attention_shapes_fit(module, query, key, value, scaling, dropout, kwargs):
        return None
    T, S, D = query.shape[2], key.shape[2], query.shape[3]
    if not _mask_fits(attention_mask, query, T, S):
        return None
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if (
        T == 1
        and not needs_grad
        and not getattr(module, "training", False)
        and (attention_mask is None or attention_mask.shape[2] == 1)
    ):
        return decode_attention(query, key, value, attention_mask, float(scaling))
    if S > ATTENTION_MAX_KEYS or D > MAX_HEAD_DIM:
        return None
    return AttentionFunction.apply(query, key, value, attention_mask, float(scaling))


def _make_attention_dispatcher(original: Callable) -> Callable:
    def eager_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if _IN_FUSED_ATTENTION.get():
            fast = _fast_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)
            if fast is not None:
                return fast, None
        return original(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    eager_attention_forward.__wrapped__ = original
    eager_attention_forward.__doc__ = (
        "ppokit's dispatcher: the fused CPU attention kernels inside fused "
        "attention, else:\n\n" + (original.__doc__ or "")
    )
    return eager_attention_forward


def _probe_attention(cls: type) -> bool:
    """Whether the kernels give what the model file's eager attention gives, in bf16 with
    two query heads per KV head and a padding mask: a decoding step, and a causal pass
    over several positions with its gradients."""
    original = _file_function(cls, "eager_attention_forward")
    if original is None:
        return False
    original = getattr(original, "__wrapped__", original)
    g = _probe_generator()
    stand_in = SimpleNamespace(num_key_value_groups=2, training=False)
    low = torch.finfo(torch.bfloat16).min
    # a decoding step: one query against five cached positions
    q = torch.randn(2, 1, 4, 8, generator=g).bfloat16().transpose(1, 2)  # [B, H, 1, D], strided
    k = torch.randn(2, 2, 5, 8, generator=g).bfloat16()  # [B, Hkv, S, D]
    v = torch.randn(2, 2, 5, 8, generator=g).bfloat16()
    mask = torch.zeros(2, 1, 1, 5).bfloat16()
    mask[0, ..., :2] = low
    with torch.no_grad():
        theirs = original(stand_in, q, k, v, mask, scaling=8**-0.5, dropout=0.0)
        mine = _fast_attention(stand_in, q, k, v, mask, 8**-0.5, 0.0, {})
    if mine is None or not isinstance(theirs, tuple) or not _agrees(mine, theirs[0]):
        return False
    # a causal pass over five positions, left padding in the first sequence, and its backward
    q = torch.randn(2, 5, 4, 8, generator=g).bfloat16().transpose(1, 2).requires_grad_()
    k = torch.randn(2, 5, 2, 8, generator=g).bfloat16().transpose(1, 2).requires_grad_()
    v = torch.randn(2, 5, 2, 8, generator=g).bfloat16().transpose(1, 2).requires_grad_()
    mask = torch.full((5, 5), low).triu(1).bfloat16()[None, None].repeat(2, 1, 1, 1)
    mask[0, ..., :2] = low
    grad = torch.randn(2, 5, 4, 8, generator=g).bfloat16()
    results = []
    for run in (
        lambda: original(stand_in, q, k, v, mask, scaling=8**-0.5, dropout=0.0)[0],
        lambda: _fast_attention(stand_in, q, k, v, mask, 8**-0.5, 0.0, {}),
    ):
        out = run()
        if out is None:
            return False
        grads = torch.autograd.grad(out, (q, k, v), grad)
        results.append((out.detach(), *grads))
    (their_out, *their_grads), (out, *grads) = results
    return _agrees(out, their_out) and all(_agrees_to_scale(a, b) for a, b in zip(grads, their_grads))


def _install_attention_dispatcher(cls: type) -> bool:
    """Put the dispatcher into the file of ``cls`` (once) when its probe agrees."""
    name = cls.__module__
    if name not in _ATTENTION_PROBED:
        try:
            _ATTENTION_PROBED[name] = _probe_attention(cls)
        except Exception:  # an eager function the stand-in cannot run: leave it
            _ATTENTION_PROBED[name] = False
    if not _ATTENTION_PROBED[name]:
        return False
    _install_into_file(cls, "eager_attention_forward", _ATTENTION_DISPATCHERS, _make_attention_dispatcher)
    return True


def _attention_forward(self, *args, **kwargs):
    token = _IN_FUSED_ATTENTION.set(True)
    try:
        return self._unfused_forward(*args, **kwargs)
    finally:
        _IN_FUSED_ATTENTION.reset(token)


def _is_rotary_attention(module: nn.Module) -> bool:
    return (
        all(hasattr(module, n) for n in ("q_proj", "k_proj", "head_dim")) and _rotary_function(type(module)) is not None
    )


# ----------------------------------------------------------------------------- fusing
_KINDS = (
    ("rms_norm", _is_rms_norm, _probe_rms_norm, _rms_norm_forward),
    ("mlp", _is_swiglu_mlp, _probe_mlp, _mlp_forward),
    ("rotary", _is_rotary_attention, _probe_rotary, _attention_forward),
)


def fuse_cpu_kernels(model: nn.Module) -> dict[str, int]:
    """Give ``model``'s RMSNorm, SwiGLU MLP and rotary attention modules the fused kernels;
    returns how many modules of each kind were fused (all zero when the kernels are not
    built), and as ``attention`` how many of those attention modules also take the
    attention kernels. State dicts, parameters and ``save_pretrained`` are unchanged."""
    counts = {kind: 0 for kind, *_ in _KINDS}
    counts["attention"] = 0
    if cpu_library() is None:
        return counts
    fused_classes = set(_FUSED.values())
    for module in model.modules():
        cls = type(module)
        if cls in fused_classes:
            continue
        for kind, matches, probe, forward in _KINDS:
            if not matches(module):
                continue
            if cls not in _PROBED:
                try:
                    _PROBED[cls] = probe(cls, module)
                except Exception:  # a forward the stand-in cannot run: not this kind
                    _PROBED[cls] = False
            if _PROBED[cls]:
                if kind == "rotary":
                    _install_dispatcher(cls)
                    counts["attention"] += _install_attention_dispatcher(cls)
                module.__class__ = fused_subclass(_FUSED, cls, forward, __name__)
                counts[kind] += 1
            break
    return counts


def unfuse_cpu_kernels(model: nn.Module) -> int:
    """Undo :func:`fuse_cpu_kernels` (transformers' forwards again); returns how many modules changed."""
    return restore_classes(model, _FUSED)
