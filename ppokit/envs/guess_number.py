"""Guess the number, with "higher" / "lower" after each wrong guess.

Observation (``observation_mode = "state"``): the range, the guesses so far with their
feedback, and how many guesses are left. After guessing 50 (the number is lower) and
25 (the number is higher) with the defaults::

    guess 1-100
    50 lower
    25 higher
    5 left:

``lower`` means the secret number is lower than the guess. Action: the first integer
in the text (``"37"``, ``"i guess 37"``); no integer, or one outside the range, is
illegal: the episode ends with ``illegal_penalty`` and ``info["illegal"] = True``.

The secret is uniform in ``[low, high]`` (deterministic given the reset seed). A right
guess ends the episode with ``win_reward`` (outcome ``"win"``); using up
``max_guesses`` ends it with ``loss_reward`` (outcome ``"loss"``); every wrong guess
earns ``guess_reward`` (0 by default; negative for a per-guess cost). Bisection needs
``ceil(log2(high - low + 2))`` guesses: 7 for 1-100.
"""

from __future__ import annotations

import re
from typing import Any

from ppokit.errors import UserError

from .base import TextEnv

__all__ = ["GuessNumberEnv", "parse_guess", "render_guesses"]

_INT = re.compile(r"-?\d+")


def parse_guess(text: str) -> int | None:
    """The first integer in ``text`` (a leading ``-`` counts), or None."""
    if not isinstance(text, str):
        return None
    match = _INT.search(text)
    return int(match.group()) if match else None


def render_guesses(low: int, high: int, history: list[tuple[int, str]], left: int) -> str:
    """The observation for ``history`` = [(guess, "higher" | "lower"), ...]."""
    lines = [f"guess {low}-{high}"] + [f"{g} {hint}" for g, hint in history] + [f"{left} left:"]
    return "\n".join(lines)


class GuessNumberEnv(TextEnv):
    """Guess-the-number; see the module docstring."""

    def __init__(
        self,
        low: int = 1,
        high: int = 100,
        max_guesses: int = 7,
        win_reward: float = 1.0,
        loss_reward: float = 0.0,
        guess_reward: float = 0.0,
        illegal_penalty: float = -1.0,
    ) -> None:
        super().__init__()
        for name, value in (("low", low), ("high", high), ("max_guesses", max_guesses)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise UserError(f"guess_number: {name} must be an int (got {value!r})")
        if low < 0 or high <= low:
            raise UserError(f"guess_number: need 0 <= low < high (got low={low}, high={high})")
        if max_guesses < 1:
            raise UserError(f"guess_number: max_guesses must be at least 1 (got {max_guesses})")
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.win_reward, self.loss_reward = float(win_reward), float(loss_reward)
        self.guess_reward, self.illegal_penalty = float(guess_reward), float(illegal_penalty)
        self.secret = low
        self.history: list[tuple[int, str]] = []
        self.done = True

    def observation(self) -> str:
        return render_guesses(self.low, self.high, self.history, self.max_guesses - len(self.history))

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self._seed(seed)
        self.secret = self.rng.randint(self.low, self.high)
        self.history = []
        self.done = False
        return self.observation(), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError("guess_number: step() after the episode ended; call reset()")
        guess = parse_guess(action)
        if guess is None or not self.low <= guess <= self.high:
            self.done = True
            reason = "no number found" if guess is None else f"{guess} is outside {self.low}-{self.high}"
            return (
                self.observation(),
                self.illegal_penalty,
                True,
                False,
                {"illegal": True, "illegal_reason": reason, "outcome": "loss"},
            )
        info: dict[str, Any] = {"illegal": False, "action": str(guess)}
        if guess == self.secret:
            self.done = True
            info["outcome"] = "win"
            return self.observation(), self.win_reward, True, False, info
        self.history.append((guess, "lower" if self.secret < guess else "higher"))
        reward = self.guess_reward
        if len(self.history) >= self.max_guesses:
            self.done = True
            info["outcome"] = "loss"
            return self.observation(), reward + self.loss_reward, True, False, info
        return self.observation(), reward, False, False, info

    # ------------------------------------------------------------------ demonstrations
    def expert_action(self) -> str:
        """Bisection: the middle of the interval the feedback so far leaves open."""
        lo, hi = self.low, self.high
        for guess, hint in self.history:
            if hint == "lower":
                hi = min(hi, guess - 1)
            else:
                lo = max(lo, guess + 1)
        return str((lo + hi) // 2)
