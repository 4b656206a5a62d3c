"""Swapping a module's class for a subclass with another forward, and back.

ppokit speeds up layers of peft and transformers models (:mod:`ppokit.lm.accel.fused_lora`,
:mod:`ppokit.lm.accel.kernels.fuse`) by giving each module a subclass of its own class whose
forward takes a faster path: parameters, state dicts, ``isinstance`` checks and saving
stay as they were, and the original forward is one attribute away.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def fused_subclass(registry: dict[type, type], cls: type, forward: Callable, module_name: str) -> type:
    """The subclass ``Fused<cls>`` of ``cls`` with ``forward`` (``cls.forward`` stays reachable
    as ``_unfused_forward``), made once and kept in ``registry`` (original -> subclass)."""
    if cls not in registry:
        registry[cls] = type(
            f"Fused{cls.__name__}",
            (cls,),
            {"forward": forward, "_unfused_forward": cls.forward, "__module__": module_name},
        )
    return registry[cls]


def restore_classes(model: nn.Module, registry: dict[type, type]) -> int:
    """Give every module of ``model`` whose class is a subclass in ``registry`` its original
    class back; returns how many modules changed."""
    originals = {fused: cls for cls, fused in registry.items()}
    count = 0
    for module in model.modules():
        original = originals.get(type(module))
        if original is not None:
            module.__class__ = original
            count += 1
    return count
