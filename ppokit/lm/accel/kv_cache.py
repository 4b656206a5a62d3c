"""A KV cache that writes each new token in place instead of concatenating.

transformers' ``DynamicCache`` appends a decoding step's keys and values with
``torch.cat``: every step copies the whole cache of every layer, O(T^2) memory traffic
over a response (a fifth of a CPU generation profile here). :func:`preallocated_cache`
builds a cache whose layers each keep one buffer, sized for the prompt plus
``max_new_tokens``, write each step's keys and values into it and hand attention a view
of the filled part. The prompt's own pass gets its keys and values back as they came
(contiguous, as attention over many positions wants them); decoding steps get the views,
which ppokit's decoding kernel (:mod:`ppokit.lm.accel.kernels.fuse`) reads in place. Eager
attention reads them too, only slower (it copies a strided view), so the rollout engine
uses this cache only where that kernel is installed.

Unlike transformers' ``StaticCache`` it attends to the filled positions only and needs
no mask over the empty ones; a buffer that fills up grows (twice the size), so a longer
generation than planned stays correct.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values [B, H, capacity, D] (each its own dtype), filled up to
    ``length``; ``keys`` / ``values`` are views of the filled part."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._keys: Tensor | None = None
        self._values: Tensor | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, H, _, D = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self._keys = key_states.new_empty(B, H, self.capacity, D)  # [B, H, C, D]
        self._values = value_states.new_empty(B, value_states.shape[1], self.capacity, value_states.shape[3])
        self.length = 0
        self._views()
        self.is_initialized = True

    def _views(self) -> None:
        self.keys = self._keys[:, :, : self.length]
        self.values = self._values[:, :, : self.length]

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self._keys.shape[2])
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], capacity, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self._keys.shape[2]:
            self._grow(end)
        self._keys[:, :, start:end] = key_states
        self._values[:, :, start:end] = value_states
        self.length = end
        self._views()
        if start == 0:
            return key_states, value_states  # the prompt's pass: contiguous, as given
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def reset(self) -> None:
        self.length = 0
        self._keys = self._values = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # checks the argument, crops the views
        if self.is_initialized:
            self.length = self.keys.shape[-2]

    def _replace(self, keys: Tensor, values: Tensor) -> None:
        """After a batch operation on the filled part: buffers of the new batch."""
        self._keys, self._values, self.length = keys, values, keys.shape[2]
        self._grow(self.capacity)
        self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self._replace(self.keys.repeat_interleave(repeats, dim=0), self.values.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.get_seq_length() > 0:
            self._replace(self.keys[indices].contiguous(), self.values[indices].contiguous())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            idx = beam_idx.to(self._keys.device)
            self._replace(self.keys.index_select(0, idx), self.values.index_select(0, idx))


def preallocated_cache(model, capacity: int):
    """A transformers ``Cache`` of :class:`PreallocatedLayer`s for ``model`` (``capacity``
    positions per layer), or None for a model with other layer types (sliding windows,
    linear attention), which keep transformers' own cache."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(config, "layer_types", None)
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return None
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return None
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        return None
    return Cache(layers=[PreallocatedLayer(capacity) for _ in range(layers)])
