"""Calling an environment safely: validated returns, caught failures.

A rollout calls environments only through these functions:

- :func:`checked_reset` / :func:`checked_step`: call the method and check what came
  back. A return of the wrong shape or type is an :class:`EnvError` (a
  :class:`~ppokit.errors.UserError`: one line, exit status 2) naming the environment
  and what it returned: it is a bug in the environment and every episode would hit it.
- :func:`step_or_fail`: :func:`checked_step`, except that an exception raised *inside*
  ``step`` ends the episode instead of the run: it returns a terminal
  :class:`StepResult` with ``failure_reward`` and ``info["env_error"]`` (the error on
  one line). The rollout counts it (:func:`check_failure_rate`) and goes on.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import numpy as np

from ppokit.errors import Interrupted, UserError
from ppokit.user_code import one_line_error

from .base import OUTCOMES, Observation

__all__ = [
    "EnvError",
    "StepResult",
    "check_failure_rate",
    "check_observation",
    "checked_reset",
    "checked_step",
    "env_label",
    "observation_problem",
    "one_line_error",
    "step_or_fail",
]


class EnvError(UserError):
    """An environment broke the API contract, could not be built, or kept failing."""


class StepResult(NamedTuple):
    """One validated step; unpacks like Gymnasium's 5-tuple."""

    observation: Observation
    reward: float
    terminated: bool
    truncated: bool
    info: dict

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    @property
    def failed(self) -> bool:
        """True when ``step`` raised and :func:`step_or_fail` ended the episode."""
        return "env_error" in self.info


def env_label(env: Any, name: str | None = None) -> str:
    """How errors name an environment: the given name, its registry name, or its class."""
    return name or getattr(env, "env_name", None) or type(env).__name__


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def observation_problem(obs: Any) -> str | None:
    """Why ``obs`` is not a text observation (a str or a list of messages), or None."""
    if isinstance(obs, str):
        return None
    if not isinstance(obs, list):
        return f"a {type(obs).__name__} ({_short(obs)})"
    for i, message in enumerate(obs):
        if not isinstance(message, dict):
            return f"a list whose item {i} is a {type(message).__name__} ({_short(message)}), not a message"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return f"a list whose message {i} has no string {key!r} ({_short(message)})"
        if not message["role"]:
            return f"a list whose message {i} has an empty role"
    return None


_FIX_OBS = 'return a str or a list of {"role": ..., "content": ...} messages'


def check_observation(obs: Any, env: Any, where: str, name: str | None = None) -> Observation:
    """``obs`` if it is a text observation, else :class:`EnvError` naming env and method."""
    problem = observation_problem(obs)
    if problem:
        raise EnvError(
            f"environment '{env_label(env, name)}' {where} returned {problem} as the observation; {_FIX_OBS}"
        )
    return obs


def _check_info(info: Any, env: Any, where: str, name: str | None) -> dict:
    label = env_label(env, name)
    if not isinstance(info, dict):
        raise EnvError(
            f"environment '{label}' {where} returned a {type(info).__name__} ({_short(info)}) as info; "
            "return a dict (empty if there is nothing to say)"
        )
    if "illegal" in info and not isinstance(info["illegal"], (bool, np.bool_)):
        raise EnvError(
            f"environment '{label}' {where}: info['illegal'] is {_short(info['illegal'])}; make it True or False"
        )
    if "outcome" in info and info["outcome"] is not None and info["outcome"] not in OUTCOMES:
        raise EnvError(
            f"environment '{label}' {where}: info['outcome'] is {_short(info['outcome'])}; "
            f"use one of {', '.join(OUTCOMES)} (or leave it out)"
        )
    if "player" in info and (isinstance(info["player"], bool) or not isinstance(info["player"], (int, np.integer))):
        raise EnvError(
            f"environment '{label}' {where}: info['player'] is {_short(info['player'])}; "
            "make it the int seat that acts next"
        )
    return info


def checked_reset(
    env: Any, seed: int | None = None, options: dict | None = None, name: str | None = None
) -> tuple[Observation, dict]:
    """``env.reset(seed=seed[, options=options])``, validated.

    ``options`` is passed only when given, so ``reset(self, seed=None)`` suffices. An
    exception inside ``reset`` becomes an :class:`EnvError` naming the seed: there is
    no episode yet to end.
    """
    label = env_label(env, name)
    try:
        out = env.reset(seed=seed) if options is None else env.reset(seed=seed, options=options)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the environment's own code failed
        if isinstance(exc, (EnvError, Interrupted)):
            raise
        raise EnvError(f"environment '{label}' reset(seed={seed!r}) failed: {one_line_error(exc)}") from None
    if not isinstance(out, tuple) or len(out) != 2:
        raise EnvError(f"environment '{label}' reset returned {_short(out)}; return (observation, info)")
    obs, info = out
    return check_observation(obs, env, "reset", name), _check_info(info, env, "reset", name)


def _as_flag(value: Any, what: str, env: Any, name: str | None) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise EnvError(
        f"environment '{env_label(env, name)}' step returned {_short(value)} as {what}; return True or False"
    )


def _as_reward(value: Any, env: Any, name: str | None) -> float:
    label = env_label(env, name)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy / torch scalar
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise EnvError(
            f"environment '{label}' step returned {type(value).__name__} {_short(value)} as the reward; "
            "return a finite float (did the tuple come out in the wrong order? "
            "(observation, reward, terminated, truncated, info))"
        )
    reward = float(value)
    if not math.isfinite(reward):
        raise EnvError(f"environment '{label}' step returned the reward {reward}; rewards must be finite")
    return reward


def checked_step(env: Any, action: str, name: str | None = None) -> StepResult:
    """``env.step(action)`` validated into a :class:`StepResult`; exceptions propagate."""
    out = env.step(action)
    label = env_label(env, name)
    if not isinstance(out, tuple) or len(out) != 5:
        got = f"a {len(out)}-tuple" if isinstance(out, tuple) else _short(out)
        raise EnvError(
            f"environment '{label}' step returned {got}; return (observation, reward, terminated, "
            "truncated, info) as Gymnasium does"
        )
    obs, reward, terminated, truncated, info = out
    return StepResult(
        check_observation(obs, env, "step", name),
        _as_reward(reward, env, name),
        _as_flag(terminated, "terminated", env, name),
        _as_flag(truncated, "truncated", env, name),
        _check_info(info, env, "step", name),
    )


def step_or_fail(env: Any, action: str, *, failure_reward: float = 0.0, name: str | None = None) -> StepResult:
    """:func:`checked_step`, with an exception raised inside ``step`` turned into a failed, terminal step.

    The result: observation ``""``, reward ``failure_reward``, ``terminated=True``,
    ``info = {"env_error": "<Type>: <message>"}``. The episode must end there (the
    environment's state is unknown). Contract violations (:class:`EnvError`) and
    interruptions still raise.
    """
    try:
        return checked_step(env, action, name)
    except (EnvError, Interrupted):
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the environment's own code failed
        return StepResult("", float(failure_reward), True, False, {"env_error": one_line_error(exc)})


def check_failure_rate(
    failures: int, episodes: int, *, max_rate: float, env_name: str, first_error: str | None = None
) -> None:
    """Raise :class:`EnvError` when more than ``max_rate`` of a rollout's episodes failed.

    A few failing steps (a flaky tool) end their episodes; an environment that fails in
    most episodes is broken, and training on failure rewards would hide it.
    """
    if episodes <= 0 or failures <= max_rate * episodes:
        return
    detail = f" (first: {first_error})" if first_error else ""
    raise EnvError(
        f"environment '{env_name}' failed in {failures} of {episodes} episodes{detail}; fix the "
        f"environment, or allow more failures than {max_rate:g} of the episodes"
    )
