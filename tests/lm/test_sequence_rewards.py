"""SequenceRewards: sources weighted, then overlong, truncation, clipping and normalisation, each
logged; against a float64 computation written out here."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from ppokit.config import build_config
from ppokit.errors import UserError
from ppokit.lm.rewards.pool import RewardResults
from ppokit.lm.rewards.sequence import SequenceRewards


@dataclass
class FakeRollout:
    texts: list[str]
    lengths: list[int]
    truncated_flags: list[bool]
    prompts: list[str] = field(default_factory=list)
    items: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.prompts = ["p"] * len(self.texts)
        self.items = [{}] * len(self.texts)

    def __len__(self):
        return len(self.texts)

    @property
    def response_lengths(self):
        return torch.tensor(self.lengths, dtype=torch.float32)

    @property
    def truncated(self):
        return torch.tensor(self.truncated_flags)


class FakeVerifier:
    name = "fake"

    def __init__(self, scores, errors=None):
        self.scores, self.errors = scores, errors or [None] * len(scores)

    def score(self, prompts, texts, items):
        return RewardResults(list(self.scores), list(self.errors), [None] * len(self.scores))


class FakeRewardModel:
    def __init__(self, scores):
        self.scores = scores

    def score(self, prompts, texts, items):
        return list(self.scores)


def data_cfg(**shaping):
    return build_config(
        [{"workload": "lm", "rollout": {"max_new_tokens": 10}, "data": {"max_reward_errors": None, "shaping": shaping}}]
    ).data


ROLLOUT = FakeRollout(
    texts=["<a>1</a>", "x", "<a>2</a> tail", "yy"], lengths=[3, 7, 9, 10], truncated_flags=[False, False, False, True]
)


def test_every_step_in_order_against_float64():
    cfg = data_cfg(
        verifier_weight=2.0,
        reward_model_weight=0.5,
        format_pattern=r"<a>\d</a>",
        format_weight=0.25,
        overlong_cache_length=4,
        overlong_penalty_factor=0.8,
        truncation_penalty=0.3,
        clip_min=-1.0,
        clip_max=2.0,
        normalize="batch",
    )
    verifier, rm = [1.0, 0.0, 1.0, 1.0], [0.4, -2.0, 3.0, 0.1]
    rewards, metrics, marks = SequenceRewards(
        cfg, 10, verifier=FakeVerifier(verifier), reward_model=FakeRewardModel(rm)
    )(ROLLOUT)
    fmt = [1.0, 0.0, 1.0, 0.0]
    r = torch.tensor([2.0 * v + 0.5 * m + 0.25 * f for v, m, f in zip(verifier, rm, fmt)], dtype=torch.float64)
    start = 10 - 4  # DAPO: no penalty up to L_max - L_cache tokens
    over = torch.tensor([min(0.0, max(-1.0, (start - n) / 4)) * 0.8 for n in ROLLOUT.lengths], dtype=torch.float64)
    trunc = torch.tensor([-0.3 if t else 0.0 for t in ROLLOUT.truncated_flags], dtype=torch.float64)
    shaped = (r + over + trunc).clamp(-1.0, 2.0)
    want = (shaped - shaped.mean()) / (shaped.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(rewards.double(), want, rtol=1e-5, atol=1e-6)
    assert metrics["reward/verifier_mean"] == pytest.approx(0.75) and metrics["reward/format_mean"] == 0.5
    assert metrics["reward/reward_model_mean"] == pytest.approx(sum(rm) / 4)
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(over.mean().item())
    assert metrics["reward/overlong_frac"] == 0.75 and metrics["reward/truncation_penalty_mean"] == pytest.approx(
        -0.075
    )
    assert metrics["reward/clipped_frac"] == pytest.approx(((r + over + trunc) != shaped).double().mean().item())
    assert metrics["reward/before_normalize_mean"] == pytest.approx(shaped.mean().item(), rel=1e-6)
    assert marks == [{"reward_error": None, "reward_note": None}] * 4


def test_running_normalisation_keeps_its_state_across_a_checkpoint():
    cfg = data_cfg(normalize="running")
    first = SequenceRewards(cfg, 10, verifier=FakeVerifier([1.0, 3.0, 0.0, 2.0]))
    first(ROLLOUT)
    second = SequenceRewards(cfg, 10, verifier=FakeVerifier([5.0, 1.0, 1.0, 1.0]))
    second.load_state_dict(first.state_dict())
    rewards, metrics, _ = second(ROLLOUT)
    seen = torch.tensor([1.0, 3.0, 0.0, 2.0, 5.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    std = seen.var(unbiased=False).sqrt()
    torch.testing.assert_close(
        rewards.double(), torch.tensor([5.0, 1.0, 1.0, 1.0], dtype=torch.float64) / std, rtol=1e-5, atol=1e-6
    )
    assert metrics["reward/running_std"] == pytest.approx(std.item(), rel=1e-6)


def test_one_source_unshaped_is_the_score_itself():
    rewards, metrics, _ = SequenceRewards(data_cfg(), 10, verifier=FakeVerifier([0.5, 1.0, 0.0, 0.25]))(ROLLOUT)
    assert rewards.tolist() == [0.5, 1.0, 0.0, 0.25]
    assert not any(
        k.startswith(("reward/overlong", "reward/trunc", "reward/clipped", "reward/before")) for k in metrics
    )
    assert SequenceRewards(data_cfg(), 10, verifier=FakeVerifier([0.0] * 4)).describe() is None
    described = SequenceRewards(
        data_cfg(format_pattern="x", truncation_penalty=1.0), 10, verifier=FakeVerifier([0.0] * 4)
    ).describe()
    assert described == "reward: 1 x verifier + 1 x format; truncation penalty 1"


def test_errors_are_marked_and_counted_over_the_run():
    cfg = build_config([{"workload": "lm", "data": {"max_reward_errors": 3}}]).data
    errors = [None, ("timeout", "timed out after 1 s"), None, ("error", "ValueError: x")]
    rewards = SequenceRewards(cfg, 10, verifier=FakeVerifier([1.0, 0.0, 1.0, 0.0], errors))
    _, metrics, marks = rewards(ROLLOUT)
    assert marks[1]["reward_error"] == "timeout: timed out after 1 s" and marks[0]["reward_error"] is None
    assert metrics["reward_errors"] == 2 and metrics["reward_errors_total"] == 2
    with pytest.raises(UserError, match=r"failed on 4 samples so far \(more than data.max_reward_errors=3\)"):
        rewards(ROLLOUT)


def test_code_reward_says_how_it_is_isolated(monkeypatch):
    from ppokit.lm.rewards import sandbox
    from ppokit.lm.rewards.functions import load_reward_fn
    from ppokit.lm.single_turn.workload import reward_notes

    assert reward_notes(load_reward_fn("math")) == []
    monkeypatch.setenv("PPOKIT_SANDBOX_ISOLATION", "none")
    sandbox.isolation.cache_clear()
    try:
        notes = reward_notes(load_reward_fn("code"))
    finally:
        monkeypatch.delenv("PPOKIT_SANDBOX_ISOLATION")
        sandbox.isolation.cache_clear()
    assert notes[0].startswith("code sandbox: NETWORK NOT ISOLATED") and len(notes) == 2
    assert notes[1].startswith("WARNING: the code reward runs programs WITHOUT network isolation")


def test_long_prompts_are_dropped_and_counted_and_the_tiny_model_grows_to_fit():
    from ppokit.lm.base_model import tiny_positions
    from ppokit.lm.single_turn.workload import drop_long

    cfg = build_config([{"workload": "lm", "data": {"max_prompt_tokens": 6}, "rollout": {"max_new_tokens": 16}}])
    train = [{"prompt": "1+1="}, {"prompt": "123+456="}, {"prompt": "12+3="}]  # 5, 9, 6 tokens (BOS)
    held = [{"prompt": "99999+1="}, {"prompt": "2+2="}]
    sets = drop_long(cfg, train, held)
    assert sets.train == [train[0], train[2]] and sets.held_out == [held[1]] and sets.dropped == 1
    assert sets.note == (
        "data: dropped 1 of 3 training and 1 of 2 held-out prompts longer than 6 tokens (data.max_prompt_tokens)"
    )
    assert tiny_positions(cfg, train) == 64  # 9 + 16 fits the default 64
    assert tiny_positions(cfg, [{"prompt": "1" * 100}]) == 128  # 101 + 16 -> a multiple of 64
    fixed = build_config([{"workload": "lm", "model": {"tiny_max_positions": 300}}])
    assert tiny_positions(fixed, [{"prompt": "1" * 100}]) == 300
