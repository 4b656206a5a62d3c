r"""The ``math`` reward: Hugging Face's math-verify decides whether an answer is right.

math-verify extracts the final answer of a response (the last ``\boxed{...}``, a LaTeX
expression or a plain one), parses it into SymPy, and compares it with the gold answer
through string, numeric and symbolic checks: ``\frac{1}{2}``, ``0.5`` and ``1/2`` are
one answer; ``x + 1`` and ``1 + x`` too. Its ``verify`` is not symmetric, so the gold
answer goes first, as its documentation asks.

Timeouts: math-verify's own timeout uses ``signal.alarm``, which works only in a
process's main thread; elsewhere it raises, and a caller that turns errors into 0 scores
every sample 0 (verl's reward workers did, verl PR 5635). Here math-verify's timeouts are
off (``parsing_timeout=None``, ``timeout_seconds=None``) and the time limit is enforced
from outside, per sample, by the process pool that runs reward functions
(:mod:`ppokit.lm.rewards.pool`), which kills a worker stuck in SymPy (``9^{9^{9^9}}``
takes minutes) and replaces it. Called on its own, ``math_reward`` has no time limit.
"""

from __future__ import annotations

from typing import Any

from ppokit.errors import UserError

_LATEX_MARKS = ("$", "\\boxed", "\\(", "\\[", "\\fbox")


def _math_verify():
    try:
        import math_verify
        import math_verify.grader
        import math_verify.parser
    except ImportError:
        raise UserError("the math reward needs the math-verify library: pip install math-verify") from None
    # The time limit is the reward pool's (module docstring): silence the warning that
    # math-verify prints when its own signal-based timeout is off.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    return math_verify


def parse_gold(answer: Any) -> list:
    r"""The gold answer parsed by math-verify: a bare ``\frac{1}{2}`` or ``x+1`` is read as
    LaTeX math (``$...$``) first, then as plain text; ``[]`` when neither parses."""
    mv = _math_verify()
    text = str(answer).strip()
    tries = [text] if any(mark in text for mark in _LATEX_MARKS) else [f"${text}$", text]
    for candidate in tries:
        parsed = mv.parse(candidate, parsing_timeout=None)
        if parsed:
            return parsed
    return []


def math_reward(prompt: str, response: str, *, answer: Any, **_: Any) -> float:
    r"""1.0 when math-verify finds the response's final answer equal to ``answer``, else 0.0.

    ``answer`` is the gold answer as text or a number (``"\frac{1}{2}"``, ``"0.5"``, ``2``);
    the response's answer is what math-verify extracts from it (its last ``\boxed{}``, else
    its last LaTeX or plain expression). A gold answer that math-verify cannot parse is a
    ``ValueError`` (the data is wrong, not the response). No time limit of its own: run it
    through :class:`ppokit.lm.rewards.pool.RewardPool` for one.
    """
    mv = _math_verify()
    gold = parse_gold(answer)
    if not gold:
        raise ValueError(f"math-verify cannot parse the gold answer {answer!r}")
    predicted = mv.parse(response, parsing_timeout=None)
    if not predicted:
        return 0.0
    return float(mv.verify(gold, predicted, timeout_seconds=None))


def warm_up() -> None:
    """Import math-verify and SymPy and parse once (about a second), so that a reward worker
    pays for it before its first sample's time limit starts."""
    mv = _math_verify()
    mv.verify(mv.parse("$1$", parsing_timeout=None), mv.parse("1", parsing_timeout=None), timeout_seconds=None)
