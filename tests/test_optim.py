"""ppokit.optim.AdamW against torch.optim.AdamW, and the schedule."""

from __future__ import annotations

import pytest
import torch

from ppokit.optim import AdamW, LRSchedule, lr_lambda


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_matches_torch_step_by_step(weight_decay):
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64)), torch.nn.Parameter(torch.randn(5, dtype=torch.float64))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = AdamW([{"params": ours[:1], "lr": 0.01}, {"params": ours[1:], "lr": 0.03}], eps=1e-6,
                weight_decay=weight_decay)
    torch_opt = torch.optim.AdamW([{"params": ref[:1], "lr": 0.01}, {"params": ref[1:], "lr": 0.03}], eps=1e-6,
                                  weight_decay=weight_decay)
    for step in range(25):
        grads = [torch.randn_like(p) for p in ours]
        if step == 3:
            grads[1] = None   # a parameter without gradient is left alone, as torch does
        for p, q, g in zip(ours, ref, grads):
            p.grad = None if g is None else g.clone()
            q.grad = None if g is None else g.clone()
        opt.step()
        torch_opt.step()
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(6))
    q = torch.nn.Parameter(p.detach().clone())
    a = AdamW([{"params": [p], "lr": 0.1}])
    for _ in range(3):
        p.grad = torch.ones(6)
        a.step()
    b = AdamW([{"params": [q], "lr": 0.1}])
    q.data.copy_(p.data)
    b.load_state_dict(a.state_dict())
    for _ in range(3):
        p.grad = torch.arange(6.0)
        q.grad = torch.arange(6.0)
        a.step()
        b.step()
    assert torch.equal(p, q)


def test_load_state_dict_rejects_a_different_model():
    a = AdamW([{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.1}])
    b = AdamW([{"params": [torch.nn.Parameter(torch.zeros(4))], "lr": 0.1}])
    with pytest.raises(ValueError, match="shape"):
        b.load_state_dict(a.state_dict())


def test_schedule_sets_group_lrs_and_resumes():
    opt = AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1.0},
                 {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 2.0}])
    sched = LRSchedule(opt, lr_lambda("linear", warmup_steps=0, total_steps=4))
    assert [g["lr"] for g in opt.param_groups] == [1.0, 2.0]
    sched.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.5, 1.0]
    again = LRSchedule(opt, lr_lambda("linear", warmup_steps=0, total_steps=4))
    again.load_state_dict(sched.state_dict())
    assert [g["lr"] for g in opt.param_groups] == [0.5, 1.0]


def test_importing_and_using_the_optimizer_does_not_import_dynamo():
    import subprocess
    import sys

    code = ("import sys, torch\nfrom ppokit.optim import AdamW\n"
            "p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.ones(2)\n"
            "AdamW([{'params': [p], 'lr': 0.1}]).step()\n"
            "torch.nn.utils.clip_grad_norm_([p], 1.0, foreach=True)\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
