"""Rollout parts from several workers made one batch (:func:`ppokit.lm.workload.concat_lm_batches`).

Parts of different prompt and response widths are re-padded to one layout: every row
keeps its tokens, positions and mask, so a policy's log-probs of a row are the part's
(the padding is masked out), and the metrics are over all sequences.
"""

from __future__ import annotations

import torch

from ppokit.components import Batch
from ppokit.config import build_config
from ppokit.lm.hf import load_tokenizer
from ppokit.lm.policy import build_policy
from ppokit.lm.rollout import RolloutEngine
from ppokit.lm.scoring import POLICY_INPUTS
from ppokit.lm.workload import concat_lm_batches
from lm_helpers import randomize


def part(engine, prompts, group_size, scores, seconds):
    rollout = engine.generate(prompts, group_size=group_size)
    n = len(rollout)
    tensors = {**rollout.tensors(), "scores": torch.tensor(scores[:n]), "group_ids": rollout.group_ids,
               "old_log_prob": -torch.rand(rollout.mask.shape) * rollout.mask}
    metrics = {"reward_mean": 0.0, "truncated_frac": rollout.truncated.float().mean().item(),
               "time_generate": seconds, "time_reward": 0.1}
    return Batch(tensors=tensors, samples=[{"prompt": p} for p in rollout.prompts], metrics=metrics)


def test_parts_of_different_widths_keep_their_rows(tiny_dir):
    cfg = build_config([{"workload": "lm", "model": {"path": str(tiny_dir)},
                         "rollout": {"temperature": 1.0, "max_new_tokens": 6},
                         "train": {"iterations": 1, "batch_size": 8}, "run": {"precision": "fp32"}}])
    tok = load_tokenizer(tiny_dir)
    torch.manual_seed(0)
    policy = build_policy(cfg, tiny_dir, device=torch.device("cpu"), autocast_dtype=None, seed=0)
    randomize(policy)
    engine = RolloutEngine.for_policy(policy, tok, cfg.rollout)
    a = part(engine, ["1+2=", "3+4="], 2, [1.0, 0.0, 0.5, 0.25], 2.0)
    b = part(engine, ["123+456=", "99*99+1="], 2, [0.0, 1.0, 1.0, 1.0], 3.0)
    assert a.tensors["input_ids"].shape[1] != b.tensors["input_ids"].shape[1]
    merged = concat_lm_batches([a, b], tok.pad_token_id, log_samples=3)
    t = merged.tensors
    n_a = len(a)
    R = max(a.tensors["responses"].shape[1], b.tensors["responses"].shape[1])
    assert t["responses"].shape == (8, R) and t["input_ids"].shape[1] - R == 8 + 1   # longest prompt: BOS + 8
    for rows, p in ((slice(0, n_a), a), (slice(n_a, 8), b)):
        src, dst = p.tensors, {k: v[rows] for k, v in t.items()}
        for i in range(len(p)):
            keep = src["attention_mask"][i].bool()
            assert torch.equal(dst["input_ids"][i][dst["attention_mask"][i].bool()], src["input_ids"][i][keep])
            assert torch.equal(dst["position_ids"][i][dst["attention_mask"][i].bool()], src["position_ids"][i][keep])
        r = src["responses"].shape[1]
        assert torch.equal(dst["mask"][:, :r], src["mask"]) and not dst["mask"][:, r:].any()
        assert torch.equal(dst["old_log_prob"][:, :r], src["old_log_prob"]) and not dst["old_log_prob"][:, r:].any()
        with torch.no_grad():
            own = policy.log_probs({k: src[k] for k in POLICY_INPUTS})["log_prob"] * src["mask"]
            joined = policy.log_probs({k: dst[k] for k in POLICY_INPUTS})["log_prob"] * dst["mask"]
        torch.testing.assert_close(joined[:, :r], own, atol=1e-5, rtol=1e-5)
    assert t["group_ids"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    scores = torch.cat([a.tensors["scores"], b.tensors["scores"]]).double()
    assert merged.metrics["reward_mean"] == torch.tensor(scores.mean().item(), dtype=torch.float32).item()
    assert merged.metrics["time_generate"] == 3.0                      # the slowest worker
    want_truncated = (a.metrics["truncated_frac"] * 4 + b.metrics["truncated_frac"] * 4) / 8
    assert abs(merged.metrics["truncated_frac"] - want_truncated) < 1e-12
    assert [s["prompt"] for s in merged.samples] == ["1+2=", "1+2=", "3+4="]
