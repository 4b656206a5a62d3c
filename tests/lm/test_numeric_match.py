"""numeric_match reads a response's final answer: #### N, else the last \\boxed{}, else the last number."""

from __future__ import annotations

import pytest

from ppokit.lm.rewards.functions import final_number, last_boxed, numeric_match, parse_last_number


@pytest.mark.parametrize(
    "text,expected",
    [
        # 1. the answer marked "#### N" wins over everything after or before it
        ("First 3 apples, then 5. #### 8", 8.0),
        ("#### 1,234 and then 7 more words 9", 1234.0),
        ("#### -2.5", -2.5),
        ("a #### b #### 17 tail 3", 17.0),  # the last mark
        ("\\boxed{5} #### 6", 6.0),
        # 2. else the last \boxed{...}, nested braces matched, one number inside
        ("try \\boxed{3} then \\boxed{4}. 99 words", 4.0),
        ("\\boxed{\\text{-7}}", -7.0),
        ("\\boxed{x = -3.5} so 12", -3.5),
        ("\\boxed{1,000,000}", 1_000_000.0),
        ("\\boxed{\\frac{1}{2}} 7", None),  # two numbers in the box: not a single number
        ("\\boxed{no number} 7", None),  # a box without a number is not skipped
        ("\\boxed{12", 12.0),  # unclosed box: the last-number rule
        # 3. else the last number
        ("The answer is 85.", 85.0),
        ("first 12, then 3-5, finally 42", 42.0),
        ("3-5", 5.0),  # a minus between operands is no sign
        ("x = -3", -3.0),
        ("(-12)", -12.0),
        ("costs $1,234.50 in total", 1234.5),
        ("about 2e3 of them", 2000.0),
        (".5 of it", 0.5),
        ("no number here", None),
        ("", None),
    ],
)
def test_final_number_rule(text, expected):
    assert final_number(text) == expected


def test_last_boxed_matches_nested_braces():
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("a \\boxed{1} b \\boxed{{2}+{3}} c") == "{2}+{3}"
    assert last_boxed("\\fbox{9}") == "9"
    assert last_boxed("\\boxed{open") is None and last_boxed("none") is None
    assert parse_last_number("1, 2, 3") == 3.0 and parse_last_number("") is None


@pytest.mark.parametrize(
    "response,answer,score",
    [
        ("Let me think: 40 + 2 = 42. #### 42", "42", 1.0),
        ("Let me think: 40 + 2 = 42. #### 43", "42", 0.0),  # the marked answer counts, not the last 42
        ("so the total is \\boxed{1,234}", "1234", 1.0),
        ("-5 is wrong, it is 7", "7", 1.0),
        ("7 is wrong, it is -5", "-5", 1.0),
        ("It is 0.1 + 0.2 = 0.3", 0.3, 1.0),
        ("It is 0.30000001", "0.3", 1.0),  # within the tolerance
        ("It is 0.31", "0.3", 0.0),
        ("I don't know", "42", 0.0),  # no number -> 0
        ("42", "Natalia sold 48/2 = 24 clips. #### 42", 1.0),  # a GSM8K-style gold answer
        ("42", 42, 1.0),
    ],
)
def test_numeric_match_cases(response, answer, score):
    assert numeric_match("prompt", response, answer=answer) == score


def test_numeric_match_refuses_a_gold_answer_without_a_number():
    with pytest.raises(ValueError, match="not a number"):
        numeric_match("p", "42", answer="forty-two")
