"""reward_main: one response scored by a built-in or a user's function, fields parsed from text."""

from __future__ import annotations

import pytest

from ppokit.commands.reward import parse_field_args, parse_value, reward_main
from ppokit.errors import UserError


def test_parse_value():
    assert parse_value("[1, 2]") == [1, 2] and parse_value('{"a": 1}') == {"a": 1}
    assert parse_value("true") is True and parse_value("null") is None
    assert parse_value("42") == 42 and parse_value("-2.5") == -2.5
    assert parse_value("1.50") == "1.50" and parse_value("007") == "007"  # numbers keep what was typed
    assert parse_value("hello") == "hello" and parse_value("") == "" and parse_value("1/2") == "1/2"


def test_parse_field_args_errors():
    assert parse_field_args(["answer=42", 'tests=["assert True"]']) == {"answer": 42, "tests": ["assert True"]}
    assert parse_field_args(["expr=a=b"]) == {"expr": "a=b"}
    for bad, pattern in [
        (["answer"], "KEY=VALUE"),
        (["=1"], "KEY=VALUE"),
        (["response=x"], "given with --response"),
        (["a=1", "a=2"], "given twice"),
    ]:
        with pytest.raises(UserError, match=pattern):
            parse_field_args(bad)


def test_builtins(tmp_path):
    assert reward_main("numeric_match", "p", "so #### 1,234", {"answer": "1234"}) == (1.0, None)
    assert reward_main("exact_match", "p", "1.50", ["answer=1.50"]) == (1.0, None)
    assert reward_main("math", "p", "\\boxed{\\frac{1}{2}}", ["answer=0.5"]) == (1.0, None)
    assert reward_main("countdown", "p", "<answer>3 * 5</answer>", ["numbers=[3, 5, 7]", "target=15"]) == (1.0, None)
    assert reward_main("countdown", "p", "<answer>3 * 7</answer>", ["numbers=[3, 5, 7]", "target=15"]) == (
        0.0,
        "wrong value",
    )
    score, reason = reward_main("code", "p", "def f():\n    return 1\n", ['tests=["assert f() == 1"]'])
    assert (score, reason) == (1.0, None)
    score, reason = reward_main("exact_match", "p", "1", {})
    assert score == 0.0 and reason.startswith("error: ") and "needs the field(s) answer" in reason


def test_user_functions_that_raise_or_hang(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(
        "import time\n"
        "def strict(prompt, response, answer):\n    return float(response == str(answer))\n"
        "def broken(prompt, response):\n    return 1 / 0\n"
        "def slow(prompt, response):\n    time.sleep(60)\n"
    )
    assert reward_main(f"{path}:strict", "p", "7", ["answer=7"]) == (1.0, None)
    assert reward_main(f"{path}:broken", "p", "7") == (0.0, "error: ZeroDivisionError: division by zero")
    assert reward_main(f"{path}:slow", "p", "7", timeout=1.0) == (0.0, "timeout: timed out after 1 s")
    with pytest.raises(UserError, match="has no attribute 'strikt'; did you mean 'strict'"):
        reward_main(f"{path}:strikt", "p", "7")
