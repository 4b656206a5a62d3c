"""Errors meant for people.

A :class:`UserError` is a mistake in what the user gave us (a config, a path, a data
file, a reward function). The CLI prints its message on one line and exits with
status 2, without a traceback. Everything else is a bug in ppokit and keeps its
traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """A mistake in the user's input: printed as one line, exit status 2."""


class ConfigError(UserError):
    """An invalid configuration value, key or combination."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Return ``"; did you mean 'x'?"`` for the closest candidate, or ``""``."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{matches[0]}'?" if matches else ""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (at most 200 characters), or its type's name."""
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


class TrainingDiverged(UserError):
    """Training stopped on non-finite losses/gradients (``train.max_bad_steps``): one line, exit 2."""


class SetUpInterrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM (``signum``) while a run is set up (:class:`ppokit.persistence.resume.GracefulStop`): it stops
    the run at once, unlike the Ctrl-C with which ``ppokit sft`` ends its training early and keeps the
    best model."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Interrupted(Exception):
    """SIGINT/SIGTERM stopped training after saving a checkpoint: one line, exit 128 + signal."""

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code
