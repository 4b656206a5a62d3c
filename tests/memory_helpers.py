"""Test helpers on memory: the bytes that tensor operations allocate, tracked while they run."""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """Tracks the bytes of storages created by tensor ops (not the inputs) that are alive.

    ``peak``: the most bytes alive at once; ``max_rows_of_v``: the most rows of any
    new 2-D tensor whose last dimension is ``V`` (a logits-shaped buffer).
    """

    def __init__(self, external, V):
        super().__init__()
        self.external = {t.untyped_storage().data_ptr() for t in external}
        self.V = V
        self.live = {}  # storage pointer -> [bytes, tensors referencing it]
        self.cur = self.peak = self.max_rows_of_v = 0

    def _drop(self, key):
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.cur -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(o, torch.Tensor):
                continue
            storage = o.untyped_storage()
            key = storage.data_ptr()
            if key in self.external or storage.nbytes() == 0:
                continue
            if o.dim() == 2 and o.shape[-1] == self.V:
                self.max_rows_of_v = max(self.max_rows_of_v, o.shape[0])
            if key not in self.live:
                self.live[key] = [storage.nbytes(), 0]
                self.cur += storage.nbytes()
                self.peak = max(self.peak, self.cur)
            self.live[key][1] += 1
            weakref.finalize(o, self._drop, key)
        return out
