"""A calculator tool for multi-step arithmetic word problems.

Each episode is a word problem drawn from the reset seed (:func:`generate_problem`: templates
with numbers 2-12 and two or three operations). Each turn the model either calls the calculator,
with a line ``calc: EXPR`` (the form the tiny character model can write) or ``<calc>EXPR</calc>``
(the tag form chat models expect), or answers, with ``answer: N`` or ``<answer>N</answer>``
(:func:`parse_answer`: the first number, compared exactly with the gold answer).
:func:`parse_tool_action` takes the first of these in the text; text with neither is illegal and
ends the episode with ``illegal_penalty``. The calculator is :func:`ppokit.expressions.evaluate`
(exact and safe: no ``eval``); its value is written with :func:`~ppokit.expressions.format_number`.

:class:`CalculatorEnv`: in state mode (the default) the observation is the problem and one line
``calc: EXPR = VALUE`` per call so far (``= error`` for a failed call, and the episode goes on); in
message mode each call's step gives one tool message. Rewards: ``correct_reward`` (1) or
``wrong_reward`` (0) on the answer, ``call_reward`` (0) per call; ``max_turns`` turns without an
answer truncate the episode. Examples and options: docs/environments.md, "Calculator".
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ppokit.errors import UserError
from ppokit.expressions import ExpressionError, evaluate, format_number

from .base import OBSERVATION_MODES, TextEnv

__all__ = ["CalculatorEnv", "INSTRUCTIONS", "Problem", "generate_problem", "parse_tool_action"]

INSTRUCTIONS = (
    "Solve the word problem. To compute something, write a line 'calc: EXPRESSION' (or "
    "<calc>EXPRESSION</calc>) and stop; the result comes back to you. When you know the result, "
    "write a line 'answer: NUMBER' (or <answer>NUMBER</answer>)."
)


@dataclass(frozen=True)
class Problem:
    """A word problem, the calculator steps that solve it, and the answer."""

    text: str
    steps: tuple[str, ...]
    answer: Fraction


# ----------------------------------------------------------------------------- problems
_NAMES = ("ann", "bo", "cy", "dee", "eli", "fay", "gus", "ivy", "jo", "kim")


def _mul_sub(rng: random.Random, name: str) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, a * b - 1)
    return Problem(
        f"{name} has {a} bags of {b} nuts and eats {c}. how many nuts are left?",
        (f"{a}*{b}", f"{a * b}-{c}"),
        Fraction(a * b - c),
    )


def _mul_add(rng: random.Random, name: str) -> Problem:
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
    return Problem(
        f"{name} has {a} boxes of {b} pens and {c} more pens. how many pens?",
        (f"{a}*{b}", f"{a * b}+{c}"),
        Fraction(a * b + c),
    )


def _share_add(rng: random.Random, name: str) -> Problem:
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
    return Problem(
        f"{name} splits {a * b} sweets among {a} kids, then gives each {c} more. how many has each?",
        (f"{a * b}/{a}", f"{b}+{c}"),
        Fraction(b + c),
    )


def _add_mul(rng: random.Random, name: str) -> Problem:
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 12)
    return Problem(
        f"{name} buys {a} red and {b} blue packs of {c} cards. how many cards?",
        (f"{a}+{b}", f"{a + b}*{c}"),
        Fraction((a + b) * c),
    )


def _sub_div(rng: random.Random, name: str) -> Problem:
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 12)
    total = a * b + c
    return Problem(
        f"{name} has {total} coins, spends {c} and splits the rest into {a} piles. how many per pile?",
        (f"{total}-{c}", f"{a * b}/{a}"),
        Fraction(b),
    )


def _earn_spend(rng: random.Random, name: str) -> Problem:
    a, b = rng.randint(2, 12), rng.randint(2, 9)
    c = rng.randint(1, a * b // 2)
    d = rng.randint(1, a * b - c - 1) if a * b - c > 1 else 0
    return Problem(
        f"{name} earns {a} a day for {b} days, then spends {c} and {d}. how much is left?",
        (f"{a}*{b}", f"{a * b}-{c}", f"{a * b - c}-{d}"),
        Fraction(a * b - c - d),
    )


def _wheels(rng: random.Random, name: str) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return Problem(
        f"there are {a} cars with 4 wheels and {b} bikes with 2 wheels. how many wheels?",
        (f"{a}*4", f"{b}*2", f"{a * 4}+{b * 2}"),
        Fraction(a * 4 + b * 2),
    )


def _pages_left(rng: random.Random, name: str) -> Problem:
    a, b = rng.randint(2, 12), rng.randint(2, 9)
    t = a * b + rng.randint(1, 40)
    return Problem(
        f"a book has {t} pages. {name} reads {a} pages a day for {b} days. how many pages are left?",
        (f"{a}*{b}", f"{t}-{a * b}"),
        Fraction(t - a * b),
    )


TEMPLATES: dict[str, Callable[[random.Random, str], Problem]] = {
    "mul_sub": _mul_sub,
    "mul_add": _mul_add,
    "share_add": _share_add,
    "add_mul": _add_mul,
    "sub_div": _sub_div,
    "earn_spend": _earn_spend,
    "wheels": _wheels,
    "pages_left": _pages_left,
}


def generate_problem(rng: random.Random, templates: tuple[str, ...] | None = None) -> Problem:
    """A problem from one of ``templates`` (default: all), drawn with ``rng``."""
    names = tuple(templates) if templates else tuple(TEMPLATES)
    return TEMPLATES[rng.choice(names)](rng, rng.choice(_NAMES))


# ----------------------------------------------------------------------------- parsing
_DIRECTIVES = (
    ("calc", re.compile(r"^[ \t]*calc[ \t]*:[ \t]*([^\n]*)", re.IGNORECASE | re.MULTILINE)),
    ("calc", re.compile(r"<calc>(.*?)</calc>", re.IGNORECASE | re.DOTALL)),
    ("answer", re.compile(r"^[ \t]*answer[ \t]*:[ \t]*([^\n]*)", re.IGNORECASE | re.MULTILINE)),
    ("answer", re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)),
)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def parse_tool_action(text: str) -> tuple[str, str] | None:
    """``("calc", expression)`` or ``("answer", text)`` for the first directive in ``text``, or None.
    A call's text after an ``=`` is dropped (``calc: 12*7 = 84`` asks for ``12*7``)."""
    if not isinstance(text, str):
        return None
    found = [(m.start(), kind, m.group(1)) for kind, pattern in _DIRECTIVES for m in [pattern.search(text)] if m]
    if not found:
        return None
    _, kind, body = min(found)
    if kind == "calc":
        body = body.split("=", 1)[0]
    return kind, body.strip()


def parse_answer(text: str) -> Fraction | None:
    """The first number in ``text`` (``79``, ``-2.5``, ``1/3``; ``1,000`` reads as 1000), or None."""
    match = _NUMBER.search(re.sub(r"(?<=\d),(?=\d{3})", "", text))
    if match is None:
        return None
    try:
        return Fraction(match.group())
    except (ValueError, ZeroDivisionError):
        return None


# ----------------------------------------------------------------------------- environment
class CalculatorEnv(TextEnv):
    """Word problems with a calculator tool (module docstring). In message mode ``reset`` gives
    ``[system: instructions, user: problem]`` and each call's step ``[{"role": tool_role, "content": value}]``."""

    def __init__(
        self,
        observation_mode: str = "state",
        max_turns: int = 6,
        templates: list[str] | None = None,
        correct_reward: float = 1.0,
        wrong_reward: float = 0.0,
        call_reward: float = 0.0,
        illegal_penalty: float = -1.0,
        instructions: str | None = None,
        tool_role: str = "tool",
    ) -> None:
        super().__init__()
        if observation_mode not in OBSERVATION_MODES:
            raise UserError(
                f"calculator: observation_mode must be one of {', '.join(OBSERVATION_MODES)} (got {observation_mode!r})"
            )
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise UserError(f"calculator: max_turns must be a positive int (got {max_turns!r})")
        unknown = [t for t in templates or () if t not in TEMPLATES]
        if unknown:
            raise UserError(f"calculator: unknown template {unknown[0]!r}; valid: {', '.join(TEMPLATES)}")
        self.observation_mode = observation_mode
        self.max_turns = max_turns
        self.templates = tuple(templates) if templates else None
        self.correct_reward, self.wrong_reward = float(correct_reward), float(wrong_reward)
        self.call_reward, self.illegal_penalty = float(call_reward), float(illegal_penalty)
        # state mode: no instructions unless given (the tiny model learns the format from SFT)
        self.instructions = instructions if instructions is not None or observation_mode == "state" else INSTRUCTIONS
        self.tool_role = tool_role
        self.problem: Problem | None = None
        self.calls: list[tuple[str, str]] = []  # (expression, result text)
        self.turns = 0
        self.done = True

    def observation(self) -> str:
        """The state-mode rendering: the problem and the calls so far, ending in a newline."""
        assert self.problem is not None
        head = f"{self.instructions}\n" if self.instructions else ""
        lines = [self.problem.text] + [f"calc: {expr} = {value}" for expr, value in self.calls]
        return head + "\n".join(lines) + "\n"

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        self._seed(seed)
        self.problem = generate_problem(self.rng, self.templates)
        self.calls, self.turns, self.done = [], 0, False
        info = {"gold_answer": format_number(self.problem.answer), "example_actions": self.example_actions()}
        if self.observation_mode == "message":
            messages = [{"role": "user", "content": self.problem.text}]
            if self.instructions:
                messages.insert(0, {"role": "system", "content": self.instructions})
            return messages, info
        return self.observation(), info

    def _reply(self, text: str | None) -> Any:
        """State mode: the whole observation; message mode: the tool's reply (none when the episode ended)."""
        if self.observation_mode == "message":
            return [] if text is None else [{"role": self.tool_role, "content": text}]
        return self.observation()

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        if self.done or self.problem is None:
            raise RuntimeError("calculator: step() after the episode ended; call reset()")
        self.turns += 1
        parsed = parse_tool_action(action)
        if parsed is None:
            self.done = True
            return (
                self._reply(None),
                self.illegal_penalty,
                True,
                False,
                {"illegal": True, "illegal_reason": "no 'calc:' or 'answer:' found", "outcome": "loss"},
            )
        kind, body = parsed
        if kind == "answer":
            self.done = True
            value = parse_answer(body)
            correct = value is not None and value == self.problem.answer
            info = {
                "illegal": False,
                "action": f"answer: {body}",
                "outcome": "win" if correct else "loss",
                "gold_answer": format_number(self.problem.answer),
            }
            return self._reply(None), self.correct_reward if correct else self.wrong_reward, True, False, info
        info: dict[str, Any] = {"illegal": False, "action": f"calc: {body}"}
        try:
            result = format_number(evaluate(body))
        except ExpressionError as exc:
            result = "error"
            info["tool_error"] = str(exc)
        self.calls.append((body, result))
        truncated = self.turns >= self.max_turns
        if truncated:
            self.done = True
            info["outcome"] = "loss"
        else:
            info["example_actions"] = self.example_actions()
        return self._reply(result), self.call_reward, False, truncated, info

    def example_actions(self) -> list[str]:
        """Calls this problem's solution makes (``info["example_actions"]``: tool calls are not finite)."""
        assert self.problem is not None
        return [f"calc: {step}" for step in self.problem.steps]

    # ------------------------------------------------------------------ demonstrations
    def expert_action(self) -> str:
        """The next gold step (``calc: ...``), then ``answer: N``."""
        assert self.problem is not None
        k = len(self.calls)
        if k < len(self.problem.steps):
            return f"calc: {self.problem.steps[k]}"
        return f"answer: {format_number(self.problem.answer)}"
