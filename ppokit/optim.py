"""AdamW and the learning-rate schedule, in a few foreach tensor ops.

Why not ``torch.optim.AdamW`` + ``LambdaLR``: in torch 2.x, ``Optimizer.add_param_group``
is wrapped by ``torch._disable_dynamo``, so constructing any ``torch.optim`` optimizer
imports ``torch._dynamo`` (about 1.5 s here). A CartPole run trains in 2-3 s; paying
half as much again before the first step is not acceptable for a CLI that should feel
instant. The update below is the same algorithm (tests/test_optim.py checks it against
``torch.optim.AdamW`` step by step).

AdamW (Loshchilov & Hutter), per parameter ``p`` with gradient ``g`` at step ``t``::

    p <- p * (1 - lr * weight_decay)
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

Each parameter group has its own ``lr`` (``initial_lr`` times the schedule's factor).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor


class AdamW:
    """AdamW over parameter groups ``[{"params": [...], "lr": float, "name": str}, ...]``."""

    def __init__(self, param_groups: list[dict[str, Any]], *, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        self.param_groups = []
        for group in param_groups:
            group = dict(group)
            group["params"] = list(group["params"])
            group.setdefault("initial_lr", group["lr"])
            self.param_groups.append(group)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.steps = [0] * len(self.params)   # per parameter: one without a gradient does not step
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]

    def zero_grad(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step on every parameter that has a gradient."""
        offset = 0
        for group in self.param_groups:
            by_step: dict[int, list[int]] = {}   # step count -> flat parameter indices
            for i, p in enumerate(group["params"], start=offset):
                if p.grad is not None:
                    self.steps[i] += 1
                    by_step.setdefault(self.steps[i], []).append(i)
            offset += len(group["params"])
            for step, index in by_step.items():   # one foreach batch per distinct step count
                self._update(index, step, group["lr"])

    def _update(self, index: list[int], step: int, lr: float) -> None:
        beta1, beta2 = self.betas
        ps = [self.params[i] for i in index]
        grads = [p.grad for p in ps]
        ms = [self.exp_avg[i] for i in index]
        vs = [self.exp_avg_sq[i] for i in index]
        if self.weight_decay:
            torch._foreach_mul_(ps, 1 - lr * self.weight_decay)
        torch._foreach_lerp_(ms, grads, 1 - beta1)                     # m = b1 m + (1 - b1) g
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)    # v = b2 v + (1 - b2) g^2
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, math.sqrt(1 - beta2 ** step))
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(ps, ms, denom, value=-lr / (1 - beta1 ** step))

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "exp_avg": list(self.exp_avg), "exp_avg_sq": list(self.exp_avg_sq),
                "lr": [g["lr"] for g in self.param_groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["exp_avg"]) != len(self.exp_avg):
            raise ValueError(f"optimizer state holds {len(state['exp_avg'])} parameters, "
                             f"the model has {len(self.exp_avg)}")
        with torch.no_grad():
            for mine, saved in zip(self.exp_avg + self.exp_avg_sq, list(state["exp_avg"]) + list(state["exp_avg_sq"])):
                if mine.shape != saved.shape:
                    raise ValueError(f"optimizer state shape {tuple(saved.shape)} != parameter shape "
                                     f"{tuple(mine.shape)}")
                mine.copy_(saved)
        self.steps = [int(n) for n in state["steps"]]
        for group, lr in zip(self.param_groups, state["lr"]):
            group["lr"] = float(lr)


def lr_lambda(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base learning rate after ``step`` optimizer steps.

    Linear warm-up from 1/warmup to 1 over ``warmup_steps``, then ``constant`` (1),
    ``linear`` (to 0 at ``total_steps``) or ``cosine`` (half cosine to 0).
    """
    total_steps = max(total_steps, 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if kind == "linear":
            return 1.0 - progress
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


class LRSchedule:
    """Sets each group's ``lr = initial_lr * factor(step)``; :meth:`step` advances one optimizer step."""

    def __init__(self, optimizer: AdamW, factor: Callable[[int], float]):
        self.optimizer, self.factor, self.last_step = optimizer, factor, 0
        self._apply()

    def _apply(self) -> None:
        f = self.factor(self.last_step)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * f

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = int(state["last_step"])
        self._apply()

