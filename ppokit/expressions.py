"""Safe evaluation of arithmetic expressions written by a model or a user.

Verifiers (the Countdown task) and tool environments (the calculator) must compute what
a model wrote, such as ``(25 - 5) * 3 / 4``, without ever running it as Python. This
module parses the text with :mod:`ast` and walks a whitelist of node types: numbers,
``+ - * / // % **``, unary ``+``/``-`` and parentheses. Anything else (names, calls,
attributes, comparisons, strings) is an :class:`ExpressionError`, and so are the ways a
small expression can still cost a lot: a long text, deep nesting, huge powers and
results too large to hold.

Arithmetic is exact: integers and decimals become :class:`fractions.Fraction`, so
``1/3*3 == 1`` and ``0.1+0.2 == 0.3`` hold, as a verifier needs.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction

__all__ = ["ExpressionError", "evaluate", "numbers_used", "format_number"]

MAX_LENGTH = 256  # characters of an expression
MAX_DEPTH = 32  # nesting of operations
MAX_EXPONENT = 64  # |b| in a ** b (b must be an integer)
MAX_DIGITS = 400  # digits of any numerator or denominator along the way


class ExpressionError(ValueError):
    """The text is not a safe arithmetic expression, or evaluating it fails (division by 0)."""


_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def evaluate(text: str, *, allow_power: bool = True) -> Fraction:
    """The exact value of the arithmetic expression ``text``.

    Raises :class:`ExpressionError` for anything that is not a number, one of
    ``+ - * / // % **`` (``**`` only with ``allow_power`` and an integer exponent of at
    most :data:`MAX_EXPONENT`), unary ``+``/``-`` or parentheses, for division by zero,
    and for inputs beyond the size limits above.
    """
    if not isinstance(text, str):
        raise ExpressionError(f"expected a string, got {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression longer than {MAX_LENGTH} characters")
    source = text.strip().replace("×", "*").replace("÷", "/").replace("−", "-")
    if not source:
        raise ExpressionError("empty expression")
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError):
        raise ExpressionError(f"not an arithmetic expression: {text.strip()[:40]!r}") from None
    return _eval(tree.body, 0, allow_power)


def numbers_used(text: str) -> list[Fraction]:
    """The number literals of the expression ``text``, left to right (for "use each number once")."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        raise ExpressionError(f"not an arithmetic expression: {text.strip()[:40]!r}") from None
    found = [(node.lineno, node.col_offset, node) for node in ast.walk(tree) if isinstance(node, ast.Constant)]
    return [_literal(node) for _, _, node in sorted(found, key=lambda x: (x[0], x[1]))]


def format_number(value: Fraction) -> str:
    """``7``, ``-2.5``, ``1/3``: an integer or a terminating decimal as such, else a fraction."""
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d == 1:
        digits = 0
        while (value * 10**digits).denominator != 1:
            digits += 1
        return f"{float(value):.{digits}f}"
    return f"{value.numerator}/{value.denominator}"


def _literal(node: ast.Constant) -> Fraction:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ExpressionError(f"{value!r} is not a number")
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ExpressionError("numbers must be finite")
        return Fraction(repr(value))  # the decimal as written, exactly: 0.1 -> 1/10
    return Fraction(value)


def _checked(value: Fraction) -> Fraction:
    if len(str(abs(value.numerator))) > MAX_DIGITS or len(str(value.denominator)) > MAX_DIGITS:
        raise ExpressionError(f"a value has more than {MAX_DIGITS} digits")
    return value


def _eval(node: ast.AST, depth: int, allow_power: bool) -> Fraction:
    if depth > MAX_DEPTH:
        raise ExpressionError(f"expression nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant):
        return _checked(_literal(node))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand, depth + 1, allow_power)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left = _eval(node.left, depth + 1, allow_power)
        right = _eval(node.right, depth + 1, allow_power)
        if isinstance(node.op, ast.Pow):
            if not allow_power:
                raise ExpressionError("powers (**) are not allowed here")
            if right.denominator != 1 or abs(right.numerator) > MAX_EXPONENT:
                raise ExpressionError(f"exponents must be integers between -{MAX_EXPONENT} and {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise ExpressionError("division by zero")
            return _checked(left ** int(right))
        op = _BINARY.get(type(node.op))
        if op is None:
            raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ExpressionError("division by zero")
        return _checked(Fraction(op(left, right)))
    raise ExpressionError(f"{type(node).__name__} is not allowed in an arithmetic expression")
