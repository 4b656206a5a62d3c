"""Countdown: reach a target number from given numbers with + - * / (the TinyZero task).

A problem is a list of ``num_count`` numbers (from 1 to ``max_number``) and a target; the
model writes an arithmetic expression that uses each given number at most once, only
``+ - * /`` and parentheses, and equals the target. Every problem is solvable: its
target is the value of an expression built at random from some of its numbers (kept
when the value is a positive integer of at most ``max_target``, reached by exact
divisions), and that expression is the SFT completion.

Splits are fixed by a hash of the problem (its sorted numbers and target), as in the
arithmetic task: membership of train, SFT and held-out never depends on the seed, so
the held-out set of one seed never leaks into another seed's training set. The seed
orders each split; ``items(split, n)`` is a prefix of ``items(split, m)`` for n < m.

The verifier, :func:`countdown_reward`, reads the last ``<answer>...</answer>`` of the
response (else its last non-empty line), drops an ``= value`` tail, and evaluates the
expression exactly with :mod:`ppokit.expressions` (never as Python).
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction
from typing import Any

import numpy as np

from ppokit.errors import UserError
from ppokit.expressions import ExpressionError, evaluate, numbers_used
from ppokit.lm.data.splits import hashed_split, split_cuts

SPLITS = ("eval", "sft", "train")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_NOT_ALLOWED = re.compile(r"//|%|\*\*")
PROMPT = (
    "Using the numbers {numbers}, each at most once, and + - * / with parentheses, write an expression "
    "equal to {target}. Give the expression in <answer> </answer> tags.\n"
)


class CountdownTask:
    """Countdown problems with disjoint train / SFT / held-out splits (module docstring).

    ``num_count`` numbers from 1 to ``max_number``; targets from 1 to ``max_target``.
    ``train_size``: problems in the train split when no number is asked for (the split
    is unbounded). ``eval_fraction`` and ``sft_fraction`` size the held-out and SFT splits.
    """

    name = "countdown"
    default_reward = "countdown"

    def __init__(
        self,
        num_count: int = 4,
        max_number: int = 100,
        max_target: int = 1000,
        seed: int = 0,
        train_size: int = 20000,
        eval_fraction: float = 0.1,
        sft_fraction: float = 0.3,
    ) -> None:
        for label, value, low in (
            ("num_count", num_count, 2),
            ("max_number", max_number, 2),
            ("max_target", max_target, 1),
            ("seed", seed, 0),
            ("train_size", train_size, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UserError(f"task countdown: {label} must be an integer >= {low} (got {value!r})")
        if num_count > 8:
            raise UserError(f"task countdown: num_count must be at most 8 (got {num_count})")
        self._cuts = split_cuts("task countdown", eval_fraction, sft_fraction)
        self.num_count, self.max_number, self.max_target = num_count, max_number, max_target
        self.seed, self.train_size = seed, train_size
        self._cache: dict[str, list[dict[str, Any]]] = {}
        self._rng: dict[str, np.random.Generator] = {}
        self._seen: dict[str, set] = {}

    def __repr__(self) -> str:
        return f"CountdownTask(num_count={self.num_count}, max_number={self.max_number}, seed={self.seed})"

    # ---------------------------------------------------------------- problems
    def split_of(self, numbers: list[int], target: int) -> str:
        """The split a problem belongs to: a fixed hash of its sorted numbers and target."""
        return hashed_split(f"{sorted(numbers)}->{target}".encode(), self._cuts)

    def _problem_from(self, u: list[float]) -> tuple[list[int], int, str] | None:
        """A random problem from uniforms ``u`` (:meth:`_width` of them), or None when the
        drawn expression is not usable (a fraction, a division by 0, a target out of range)."""
        k = self.num_count
        numbers = [1 + int(x * self.max_number) for x in u[:k]]
        used = 2 + int(u[k] * (k - 1))  # 2 .. k numbers in the solution
        order = sorted(range(k), key=lambda i: u[k + 1 + i])[:used]
        terms = [(str(numbers[i]), numbers[i]) for i in order]
        draws = iter(u[2 * k + 1 :])
        while len(terms) > 1:  # combine two random terms until one is left
            i = int(next(draws) * len(terms))
            j = int(next(draws) * (len(terms) - 1))
            j += j >= i
            op = "+-*/"[int(next(draws) * 4)]
            (a_text, a), (b_text, b) = terms[i], terms[j]
            if op == "/":
                if b == 0 or a % b:  # exact divisions only: every value stays an integer
                    return None
                value = a // b
            else:
                value = a + b if op == "+" else a - b if op == "-" else a * b
            terms = [t for m, t in enumerate(terms) if m != i and m != j] + [(f"({a_text} {op} {b_text})", value)]
        text, value = terms[0]
        if not 1 <= value <= self.max_target:
            return None
        return numbers, value, text[1:-1] if text.startswith("(") else text

    def _width(self) -> int:
        return 2 * self.num_count + 1 + 3 * (self.num_count - 1)

    def _generate(self, split: str, n: int) -> list[dict[str, Any]]:
        items = self._cache.setdefault(split, [])
        if len(items) >= n:
            return items[:n]
        # one generator per split, continued on later calls: a longer list extends a shorter one
        rng = self._rng.setdefault(split, np.random.default_rng([self.seed, SPLITS.index(split)]))
        seen = self._seen.setdefault(split, set())
        blocks = 0
        while len(items) < n:
            blocks += 1
            if blocks > 1000 + n:
                raise UserError(f"{self!r}: could not find {n} {split} problems; raise max_number or max_target")
            for u in rng.random((4096, self._width())).tolist():
                problem = self._problem_from(u)
                if problem is None:
                    continue
                numbers, target, solution = problem
                key = (tuple(sorted(numbers)), target)
                if key in seen or self.split_of(numbers, target) != split:
                    continue
                seen.add(key)
                items.append(
                    {
                        "prompt": PROMPT.format(numbers=numbers, target=target),
                        "numbers": numbers,
                        "target": target,
                        "answer": solution,
                    }
                )
        return items[:n]

    def items(self, split: str, n: int | None = None) -> list[dict[str, Any]]:
        """The first ``n`` problems of a split (``train``: ``train_size`` when ``n`` is None).

        Records: ``{"prompt", "numbers", "target", "answer"}`` (``answer``: one solution);
        the SFT split adds ``"completion"``, the solution in answer tags.
        """
        if split not in SPLITS:
            raise UserError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
        if n is None:
            if split != "train":
                raise UserError(f"{self!r}: the {split} split is unbounded; ask for a number of problems")
            n = self.train_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise UserError(
                f"task countdown: the number of {split} problems must be a non-negative integer (got {n!r})"
            )
        items = [dict(it) for it in self._generate(split, n)]
        if split == "sft":
            for it in items:
                it["completion"] = f"<answer>{it['answer']}</answer>"
        return items


# --------------------------------------------------------------------------- verifier
def extract_expression(response: str) -> str | None:
    """The expression a response gives: the last ``<answer>...</answer>``, else its last
    non-empty line; an ``= value`` tail is dropped. None when there is nothing."""
    tagged = _ANSWER.findall(response)
    if tagged:
        text = tagged[-1]
    else:
        lines = [line for line in response.strip().splitlines() if line.strip()]
        if not lines:
            return None
        text = lines[-1]
    text = text.split("=")[0].strip()
    return text or None


def check_countdown(expression: str, numbers: list[int], target: int) -> str | None:
    """None when ``expression`` is a valid solution, else the reason it is not."""
    if _NOT_ALLOWED.search(expression):
        return "operator not allowed (only + - * /)"
    try:
        value = evaluate(expression, allow_power=False)
        used = numbers_used(expression)
    except ExpressionError:
        return "not an arithmetic expression"
    extra = Counter(used) - Counter(Fraction(x) for x in numbers)
    if extra:
        return "uses numbers not given (each number at most once)"
    if value != target:
        return "wrong value"
    return None


def countdown_reward(prompt: str, response: str, *, numbers: Any, target: Any, **_: Any) -> tuple[float, str | None]:
    """``(1.0, None)`` when the response's expression uses only the given ``numbers`` (each at
    most once) and ``+ - * /``, and equals ``target``; else ``(0.0, reason)`` with reason
    ``no expression``, ``operator not allowed``, ``not an arithmetic expression``, ``uses
    numbers not given`` or ``wrong value``."""
    if not isinstance(numbers, (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in numbers
    ):
        raise ValueError(f"countdown: the numbers field must be a list of integers (got {numbers!r})")
    expression = extract_expression(response)
    if expression is None:
        return 0.0, "no expression"
    problem = check_countdown(expression, list(numbers), int(target))
    return (0.0, problem) if problem else (1.0, None)
