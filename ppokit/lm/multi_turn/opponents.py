"""Past policies as self-play opponents: LoRA actor adapters kept as tensors, played from a spare slot.

A snapshot of the policy is its ``actor`` adapter's weights (peft's adapter state dict,
copied to the CPU): for the default LoRA rank on the tiny model about 60 k numbers, a few
MB for a 0.5 B model, against a whole model copy in full fine-tuning (which is why the
pool needs ``model.mode: lora``). To let a snapshot play, its tensors are copied into a
third adapter, :data:`OPPONENT`, added to the policy's backbone once; generation then
runs with that adapter active (the backbone, the actor and the critic untouched). The
actor is never overwritten, so nothing can leave it holding an opponent's weights, and
consecutive turns against the same snapshot copy nothing.

The slot is not trained (it is in no optimizer group) and not saved with the policy
(:func:`ppokit.lm.model.checkpoint.save_policy` writes the actor and critic only); the
snapshots' tensors are part of the source's checkpoint state.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
from torch import Tensor

__all__ = ["OPPONENT", "AdapterSnapshots"]

OPPONENT = "opponent"


class AdapterSnapshots:
    """Snapshot tensors by id, and the spare adapter slot they are played from.

    ``policy``: an :class:`~ppokit.lm.model.policy.LMPolicy` in lora mode; ``lora_cfg``: the
    ``peft.LoraConfig`` of its actor (the slot has the same shape). Counts the time spent
    copying snapshots into the slot (:attr:`load_seconds`, :attr:`loads`).
    """

    def __init__(self, policy, lora_cfg):
        if policy.mode != "lora":
            raise ValueError("opponent snapshots are LoRA adapters: the policy must be in lora mode")
        self.policy = policy
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            policy.lm.add_adapter(OPPONENT, lora_cfg)
        for name, p in policy.lm.named_parameters():
            if f".{OPPONENT}." in name:
                p.requires_grad_(False)
        policy.reset_adapters()  # the actor active again, trained weights requiring grad
        self.tensors: dict[str, dict[str, Tensor]] = {}
        self.loaded: str | None = None
        self.load_seconds = 0.0
        self.loads = 0

    def take(self, snapshot_id: str) -> None:
        """Store the current actor adapter as ``snapshot_id``."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.policy.lm, adapter_name="actor")
        self.tensors[snapshot_id] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def drop(self, snapshot_id: str) -> None:
        self.tensors.pop(snapshot_id, None)
        if self.loaded == snapshot_id:
            self.loaded = None

    def load(self, snapshot_id: str) -> None:
        """Put ``snapshot_id`` into the opponent slot (nothing to do when it is there already)."""
        if self.loaded == snapshot_id:
            return
        from peft import set_peft_model_state_dict

        start = time.perf_counter()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            set_peft_model_state_dict(self.policy.lm, self.tensors[snapshot_id], adapter_name=OPPONENT)
        self.loaded = snapshot_id
        self.loads += 1
        self.load_seconds += time.perf_counter() - start

    def activate(self):
        """The context manager that generates with the slot's adapter (the HF engine's ``activate``)."""
        return self.policy.use(OPPONENT)

    def state_dict(self) -> dict[str, Any]:
        return {"tensors": {k: dict(v) for k, v in self.tensors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tensors = {str(k): {str(n): t.to("cpu") for n, t in v.items()} for k, v in state["tensors"].items()}
        self.loaded = None
