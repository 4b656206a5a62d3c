"""The safe arithmetic evaluator: exact values, and everything that is not arithmetic refused."""

from fractions import Fraction

import pytest

from ppokit.expressions import ExpressionError, evaluate, format_number, numbers_used


@pytest.mark.parametrize(
    "text, value",
    [
        ("1+2*3", 7),
        ("(1+2)*3", 9),
        ("25 - 5 * 3 / 4", Fraction(85, 4)),
        ("-3 + +4", 1),
        ("2**10", 1024),
        ("2**-2", Fraction(1, 4)),
        ("0.1 + 0.2", Fraction(3, 10)),
        ("1/3*3", 1),
        ("7 // 2", 3),
        ("7 % 4", 3),
        ("6 × 7", 42),
        ("8 ÷ 2", 4),
        ("  (((5)))  ", 5),
        ("1e3", 1000),
    ],
)
def test_values_are_exact(text, value):
    assert evaluate(text) == value


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "x + 1",
        "abs(-1)",
        "(1).real",
        "1 < 2",
        "'a' * 3",
        "[1, 2]",
        "lambda: 1",
        "1 if 1 else 2",
        "True + 1",
        "",
        "   ",
        "2 +",
        "1/0",
        "5 % 0",
        "0 ** -1",
        "1e999",
        "2 ** 0.5",
        "10 ** 100000",
        "9" * 300,
        "-" * 40 + "1",
    ],
)
def test_everything_else_is_an_expression_error(text):
    with pytest.raises(ExpressionError):
        evaluate(text)


def test_huge_intermediate_values_are_refused():
    with pytest.raises(ExpressionError):
        evaluate("((10**60)**2)**2 * 10**60 * 10**60 * 10**60")


def test_powers_can_be_forbidden():
    assert evaluate("2*3", allow_power=False) == 6
    with pytest.raises(ExpressionError, match="powers"):
        evaluate("2**3", allow_power=False)


def test_numbers_used_in_order_and_formatting():
    assert numbers_used("(25 - 5) * 3 / 4") == [25, 5, 3, 4]
    assert numbers_used("-7 + 0.5") == [7, Fraction(1, 2)]
    assert [format_number(Fraction(x)) for x in (7, -2.5, 0.125)] == ["7", "-2.5", "0.125"]
    assert format_number(Fraction(1, 3)) == "1/3"
