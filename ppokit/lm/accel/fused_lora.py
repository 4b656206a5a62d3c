"""A fused forward and backward for peft's LoRA linear layers.

peft computes ``y = base(x) + lora_B(lora_A(x)) * scaling`` as four operations, each a pass over
memory (a full-size scaled copy and add among them), and autograd's backward adds more. At the sizes
trained on a CPU (hidden 640-1024, rank 8) that elementwise work cost about as much as the matmuls.
:class:`LoRALinearFunction` computes the same with matmuls only (x [N, d_in], upstream gradient
g [N, d_out], s = scaling)::

    h   = x A^T          y  = x W^T + b;  y += s h B^T      (addmm into y: no scaled copy, no add)
    g_h = s g B          dx = g W;  dx += g_h A
    dA  = g_h^T x        dB = s g^T h                       (W and b are frozen: no gradient)

Casting to the autocast dtype happens once, outside the function, so the fp32 master weights A and B
get fp32 gradients through autograd's own cast backward. :func:`fuse_lora_layers` puts every plain
``nn.Linear`` LoRA layer on this path; a layer keeps peft's forward where it does not apply (adapters
disabled or merged, several active adapters, dropout, DoRA, ``fan_in_fan_out``: GPT-2's Conv1D).
:func:`enable_lora_kernels` (``model.cpu_kernels``) runs the rank-r products on ppokit's AMX or
AVX512-BF16 kernels.
"""

from __future__ import annotations

import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from ppokit.lm.accel.class_swap import fused_subclass, restore_classes
from ppokit.lm.accel.kernels.functions import (
    lora_down,
    lora_kernels_eligible,
    lora_kernels_kind,
    lora_outer,
    lora_up_add_,
)


def _matmul_down(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x m^T: x [N, d], m [r, d] -> [N, r]."""
    return x @ m.t()


def _matmul_up_add_(y: torch.Tensor, h: torch.Tensor, m: torch.Tensor, scale: float) -> torch.Tensor:
    """y += scale h m in place: y [N, d], h [N, r], m [r, d]."""
    return y.addmm_(h, m, alpha=scale)


def _matmul_outer(p: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """scale p^T x: p [N, r], x [N, d] -> [r, d]. The skinny factor is transposed into a
    contiguous [r, N] copy on the left: oneDNN runs a transposed big operand (x^T p) slower
    (same numbers, bit for bit; docs/performance.md, "Fused LoRA layers")."""
    out = p.t().contiguous() @ x
    return out.mul_(scale) if scale != 1.0 else out


# LoRA's rank-r products (down, up_add_, outer): oneDNN's matmuls, or ppokit's kernels
MATMUL_PRODUCTS = (_matmul_down, _matmul_up_add_, _matmul_outer)
KERNEL_PRODUCTS = (lora_down, lora_up_add_, lora_outer)


class LoRALinearFunction(torch.autograd.Function):
    """``y = x W^T + b + s (x A^T) B^T`` with a matmul-only backward (see the module doc).

    Shapes: x [N, d_in], W [d_out, d_in], b [d_out] or None, A [r, d_in], B [d_out, r];
    all in one dtype. Returns y [N, d_out]. ``kernels``: the rank-r products on ppokit's
    kernels where :func:`lora_kernels_eligible` says they apply.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, kernels: bool = False):
        kernels = kernels and lora_kernels_eligible(x, lora_a, lora_b)
        down, up_add_, _ = KERNEL_PRODUCTS if kernels else MATMUL_PRODUCTS
        # The order keeps x in cache between the two products that read it.
        y = torch.addmm(bias, x, weight.t()) if bias is not None else x @ weight.t()  # [N, d_out]
        h = down(x, lora_a)  # [N, r]
        up_add_(y, h, lora_b.t(), scaling)
        ctx.save_for_backward(x, weight, lora_a, lora_b, h)
        ctx.scaling, ctx.kernels = scaling, kernels
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, lora_a, lora_b, h = ctx.saved_tensors
        s = ctx.scaling
        down, up_add_, outer = KERNEL_PRODUCTS if ctx.kernels else MATMUL_PRODUCTS
        # Ordered by the tensor each product reads, so that it is still in cache: the two
        # passes over g first, then the input gradient, then the pass over x.
        grad_h = down(grad_y, lora_b.t()).mul_(s)  # [N, r]
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[4]:
            grad_b = outer(h, grad_y, s).t()  # [d_out, r] (a view)
        if ctx.needs_input_grad[0]:
            grad_x = up_add_(grad_y @ weight, grad_h, lora_a, 1.0)  # [N, d_in]
        if ctx.needs_input_grad[3]:
            grad_a = outer(grad_h, x, 1.0)  # [r, d_in]
        return grad_x, None, None, grad_a, grad_b, None, None


def _fusable_adapter(layer) -> str | None:
    """The single active adapter of ``layer`` when the fused path computes exactly what
    peft would, else None (peft's forward then runs)."""
    if layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1:
        return None
    name = active[0]
    if name not in layer.lora_A:
        return None
    if layer.use_dora.get(name, False) or getattr(layer, "fan_in_fan_out", False):
        return None
    if not isinstance(layer.lora_dropout[name], nn.Identity):
        return None
    if type(layer.get_base_layer()) is not nn.Linear:
        return None
    if getattr(layer, "lora_bias", {}).get(name, False):
        return None
    return name


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward of a fused peft LoRA layer: x [..., d_in] -> [..., d_out] in the compute
    dtype (autocast's when it is on, the base weight's otherwise), as peft returns it."""
    name = None if args or kwargs else _fusable_adapter(self)
    if name is None:
        return self._unfused_forward(x, *args, **kwargs)
    base = self.get_base_layer()
    lora_a, lora_b = self.lora_A[name].weight, self.lora_B[name].weight
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = base.weight.dtype
    weight = base.weight.to(dtype)
    bias = base.bias.to(dtype) if base.bias is not None else None
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)  # [N, d_in]
    with torch.autocast(device_type, enabled=False):
        y = LoRALinearFunction.apply(
            x2, weight, bias, lora_a.to(dtype), lora_b.to(dtype), float(self.scaling[name]), _use_kernels(self, x)
        )
    return y.view(*x.shape[:-1], y.shape[-1])


_FUSED_CLASSES: dict[type, type] = {}  # peft layer class -> its fused subclass


def fuse_lora_layers(model: nn.Module) -> int:
    """Give every peft LoRA ``Linear`` layer of ``model`` the fused forward; returns how many.

    The layers stay peft layers (same parameters, state dict, adapter switching, merging);
    only their forward changes, and only where it computes exactly what peft would.
    """
    count = 0
    for module in model.modules():
        cls = type(module)
        if isinstance(module, LoraLinear) and cls not in _FUSED_CLASSES.values():
            module.__class__ = fused_subclass(_FUSED_CLASSES, cls, _fused_forward, __name__)
            count += 1
    return count


KERNELS_ALWAYS, KERNELS_WHEN_DECODING = "always", "decoding"  # a layer's ppokit_lora_kernels


def enable_lora_kernels(model: nn.Module, enabled: bool = True) -> int:
    """Let ``model``'s fused LoRA layers run their rank-r products on ppokit's kernels where
    they apply (:func:`lora_kernels_kind` says which); returns how many
    layers can. Without AMX or AVX512-BF16 (or without the kernels) none can, and nothing
    changes.

    On AMX (bf16, an even rank up to 64) the kernels run every pass: ``h`` and ``g_h`` in one pass
    over ``x`` and ``g`` each, the two ``addmm_`` in one pass over ``y`` and ``dx`` each, and the weight
    gradients in one pass over ``g`` and ``x``. Each is a single rounding of a float32 sum, where the
    matmul path rounds ``g B`` and ``h^T g`` before scaling them: a rounding less.

    On AVX512-BF16 vectors they run only the decoding steps of generation (one new position per
    sequence, no gradient), where oneDNN's fixed cost per call dominates: on the update's thousands
    of rows its ``addmm_`` runs at the memory bound and the vector kernels do not win
    (docs/performance.md). Training and scoring passes then both take oneDNN's matmuls, so they
    round alike and the first ratio stays exactly 1; no ratio reads a decoding step's numbers."""
    kind = lora_kernels_kind()
    if enabled and kind is None:
        return 0
    mode = (KERNELS_ALWAYS if kind == "amx" else KERNELS_WHEN_DECODING) if enabled else None
    count = 0
    for module in model.modules():
        if isinstance(module, LoraLinear) and type(module) in _FUSED_CLASSES.values():
            module.ppokit_lora_kernels = mode
            count += 1
    return count if enabled else 0


def _use_kernels(layer, x: torch.Tensor) -> bool:
    """Whether this call of a fused layer runs its rank-r products on ppokit's kernels."""
    mode = getattr(layer, "ppokit_lora_kernels", None)
    if mode == KERNELS_WHEN_DECODING:  # x [B, 1, d_in]: one new position per sequence
        return x.dim() == 3 and x.shape[1] == 1 and not torch.is_grad_enabled()
    return mode == KERNELS_ALWAYS


def unfuse_lora_layers(model: nn.Module) -> int:
    """Undo :func:`fuse_lora_layers` (peft's own forward again); returns how many layers changed."""
    return restore_classes(model, _FUSED_CLASSES)
