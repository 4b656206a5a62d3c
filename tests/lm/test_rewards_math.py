"""The math reward (math-verify): equivalent forms, wrong answers, and scoring off the main thread
(math-verify's own signal timeout is off; the reward pool enforces the time limit)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("math_verify")

from ppokit.lm.rewards.functions import load_reward_fn  # noqa: E402
from ppokit.lm.rewards.math_answers import math_reward  # noqa: E402
from ppokit.lm.rewards.pool import RewardPool  # noqa: E402


@pytest.mark.parametrize(
    "gold,response",
    [
        ("\\frac{1}{2}", "0.5"),
        ("0.5", "The answer is $\\frac{1}{2}$."),
        ("2", "so the answer is \\boxed{2}"),
        ("\\boxed{2}", "2"),
        ("1/2", "0.5"),
        ("x+1", "We get $1+x$."),
        ("\\frac{\\sqrt{2}}{2}", "$\\frac{1}{\\sqrt{2}}$"),
        (42, "First 40, then \\boxed{42}"),
    ],
)
def test_equivalent_answers_are_accepted(gold, response):
    assert math_reward("p", response, answer=gold) == 1.0


@pytest.mark.parametrize(
    "gold,response",
    [
        ("\\frac{1}{2}", "0.4"),
        ("2", "\\boxed{3}"),
        ("x+1", "$x-1$"),
        ("42", "I do not know"),
        ("42", ""),
    ],
)
def test_wrong_answers_are_rejected(gold, response):
    assert math_reward("p", response, answer=gold) == 0.0


def test_a_gold_answer_that_does_not_parse_is_an_error():
    with pytest.raises(ValueError, match="cannot parse the gold answer"):
        math_reward("p", "1", answer="")


def test_math_is_a_built_in_reward_and_works_off_the_main_thread():
    reward = load_reward_fn("math")
    out = {}

    def score():
        out["right"] = reward("p", "\\boxed{\\frac{1}{2}}", answer="0.5")
        out["wrong"] = reward("p", "\\boxed{3}", answer="0.5")

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(120)
    assert out == {"right": 1.0, "wrong": 0.0}  # not 0 for everything, not an exception


def test_the_pool_enforces_the_time_limit_on_math():
    # SymPy takes minutes on 9^(9^(9^9)); the pool kills that worker after the limit
    responses = ["\\boxed{\\frac{1}{2}}", "\\boxed{9^{9^{9^{9}}}}", "0.5", "0.4"]
    with RewardPool("math", num_workers=2, timeout=2.0, max_reward_errors=None) as pool:
        results = pool.score(["p"] * 4, responses, [{"answer": "0.5"}] * 4)
        assert results.scores == [1.0, 0.0, 1.0, 0.0]
        assert [e and e[0] for e in results.errors] == [None, "timeout", None, None]
        assert pool.score(["p"], ["\\boxed{1/2}"], [{"answer": "0.5"}]).scores == [1.0]
