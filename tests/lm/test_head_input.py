"""ppokit.lm.accel.head_input: the LM head's strided input (generation's last positions) is made
contiguous: the same product, the same greedy tokens, one hook however often it is applied."""

from __future__ import annotations

import torch
from torch import nn

from ppokit.lm.accel.head_input import contiguous_head_input


class _Model(nn.Module):
    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def get_output_embeddings(self):
        return self.head


def test_a_strided_input_gives_the_contiguous_product_and_the_hook_is_added_once():
    torch.manual_seed(0)
    model = _Model(nn.Linear(16, 50, bias=False))
    hidden = torch.randn(4, 7, 16)
    last = hidden[:, -1:, :]  # what generation hands the head: a view with the sequence stride
    assert not last.is_contiguous()
    assert contiguous_head_input(model) == 1 and contiguous_head_input(model) == 0  # once
    assert len(model.head._forward_pre_hooks) == 1
    seen = []
    model.head.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous()))
    out = model.head(last)
    assert seen == [True]
    assert torch.equal(out, nn.functional.linear(last.contiguous(), model.head.weight))
    assert contiguous_head_input(_Model(nn.Identity())) == 0 and contiguous_head_input(nn.Linear(2, 2)) == 0


def test_the_policy_s_greedy_tokens_are_the_same_with_the_hook(tiny_dir):
    from ppokit.config import build_config
    from ppokit.lm.generation.factory import make_engine
    from ppokit.lm.model.stack import build_policy_stack

    cfg = build_config([{"workload": "lm", "model": {"path": str(tiny_dir)}, "run": {"device": "cpu"}}])
    stack = build_policy_stack(cfg, tiny_dir)
    head = stack.policy.lm.get_output_embeddings()
    assert len(head._forward_pre_hooks) == 1  # the stack applied it (CPU)
    engine = make_engine(stack.policy, stack.tokenizer, cfg.rollout, kv_cache=stack.kv_cache)
    prompts = ["12+34=", "5+6=", "77+8="]
    with_hook = engine.generate(prompts, greedy=True).texts
    hooks = dict(head._forward_pre_hooks)
    head._forward_pre_hooks.clear()
    try:
        assert engine.generate(prompts, greedy=True).texts == with_hook
    finally:
        head._forward_pre_hooks.update(hooks)
