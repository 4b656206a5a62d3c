"""Rollout parts from several workers made one rollout (:func:`ppokit.lm.single_turn.source.concat_parts`).

Parts of different prompt and response widths are re-padded to one layout: every row
keeps its tokens, positions and mask, so a policy's log-probs of a row are the part's
(the padding is masked out); the prompts, texts and items follow in shard order.
"""

from __future__ import annotations

import torch
from lm_helpers import randomize

from ppokit.components import SEQUENCE_INPUTS
from ppokit.config import build_config
from ppokit.lm.generation.factory import make_engine
from ppokit.lm.model.hf import load_tokenizer
from ppokit.lm.model.policy import build_policy
from ppokit.lm.single_turn.source import RolloutPart, concat_parts


def test_parts_of_different_widths_keep_their_rows(tiny_dir):
    cfg = build_config(
        [
            {
                "workload": "lm",
                "model": {"path": str(tiny_dir)},
                "rollout": {"temperature": 1.0, "max_new_tokens": 6},
                "train": {"iterations": 1, "batch_size": 8},
                "run": {"precision": "fp32"},
            }
        ]
    )
    tok = load_tokenizer(tiny_dir)
    torch.manual_seed(0)
    policy = build_policy(cfg, tiny_dir, device=torch.device("cpu"), autocast_dtype=None, seed=0)
    randomize(policy)
    engine = make_engine(policy, tok, cfg.rollout)
    parts = []
    for prompts, seconds in ((["1+2=", "3+4="], 2.0), (["123+456=", "99*99+1="], 3.0)):
        rollout = engine.generate(prompts, group_size=2)
        rollout.generation_time = seconds
        parts.append(RolloutPart(rollout, -torch.rand(rollout.mask.shape) * rollout.mask, seconds / 10))
    a, b = parts[0].rollout, parts[1].rollout
    assert a.input_ids.shape[1] != b.input_ids.shape[1]
    merged = concat_parts(parts, tok.pad_token_id)
    m = merged.rollout
    R = max(a.responses.shape[1], b.responses.shape[1])
    assert m.responses.shape == (8, R) and m.prompt_length == max(a.prompt_length, b.prompt_length)
    for rows, part in ((slice(0, 4), parts[0]), (slice(4, 8), parts[1])):
        src = part.rollout.tensors()
        dst = {k: v[rows] for k, v in m.tensors().items()}
        for i in range(4):
            keep, kept = src["attention_mask"][i].bool(), dst["attention_mask"][i].bool()
            assert torch.equal(dst["input_ids"][i][kept], src["input_ids"][i][keep])
            assert torch.equal(dst["position_ids"][i][kept], src["position_ids"][i][keep])
        r = src["responses"].shape[1]
        assert torch.equal(dst["mask"][:, :r], src["mask"]) and not dst["mask"][:, r:].any()
        assert torch.equal(merged.old_log_prob[rows, :r], part.old_log_prob)
        assert not merged.old_log_prob[rows, r:].any()
        with torch.no_grad():
            own = policy.log_probs({k: src[k] for k in SEQUENCE_INPUTS})["log_prob"] * src["mask"]
            joined = policy.log_probs({k: dst[k] for k in SEQUENCE_INPUTS})["log_prob"] * dst["mask"]
        torch.testing.assert_close(joined[:, :r], own, atol=1e-5, rtol=1e-5)
    assert m.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert m.prompts == a.prompts + b.prompts and m.texts == a.texts + b.texts
    assert torch.equal(m.truncated, torch.cat([a.truncated, b.truncated]))
    assert m.generation_time == 3.0 and merged.behaviour_time == 0.3  # the slowest worker
