"""The trainer's optimizer is torch.optim's AdamW, its schedule a LambdaLR over ppokit's factor."""

from __future__ import annotations

import math

import pytest
import torch

from ppokit.trainer import lr_lambda


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_schedule_factor_against_its_formula(kind):
    warmup, total = 3, 11
    factor = lr_lambda(kind, warmup, total)
    for step in range(total + 3):
        if step < warmup:
            want = (step + 1) / warmup
        else:
            progress = min(1.0, (step - warmup) / (total - warmup))
            want = {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[
                kind
            ]
        assert factor(step) == pytest.approx(want, abs=1e-15), (kind, step)


def test_lambda_lr_sets_each_groups_lr_and_resumes():
    p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [p], "lr": 1.0, "name": "actor"}, {"params": [q], "lr": 2.0, "name": "critic"}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("linear", warmup_steps=0, total_steps=4))
    assert [g["lr"] for g in opt.param_groups] == [1.0, 2.0]
    for _ in range(2):
        p.grad, q.grad = torch.ones(1), torch.ones(1)
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.5, 1.0]
    again = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("linear", warmup_steps=0, total_steps=4))
    again.load_state_dict(sched.state_dict())
    again.step()
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.5]
