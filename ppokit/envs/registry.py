"""Environments by name: built-ins, registered ones, a user's ``module:Class`` or ``file.py:Class``,
and TextArena's games as ``textarena:<id>`` (:mod:`ppokit.envs.textarena`, an optional extra).

::

    make_env("tictactoe", opponent="heuristic")
    make_env("my_pkg.games:Nim", heaps=3)
    make_env("envs/nim.py:Nim")
    make_env("textarena:KuhnPoker-v0", opponent="self")

Every problem (unknown name, module not importable, file missing, attribute missing,
not a class or factory, a keyword the constructor does not take, the constructor
failing, an object without reset/step) is a one-line :class:`~ppokit.envs.checks.EnvError`
naming the spec and the fix.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from ppokit.errors import UserError, did_you_mean
from ppokit.user_code import is_user_spec, load_user_object, one_line_error

from .checks import EnvError

__all__ = ["env_names", "load_env_factory", "make_env", "register_env"]

# name -> "module:attribute" (imported on first use) or a factory
_REGISTRY: dict[str, Any] = {}
_ALIASES: dict[str, str] = {}


def register_env(name: str, factory: Any, *aliases: str, overwrite: bool = False) -> None:
    """Register ``factory`` (a class, a callable returning an environment, or a
    ``"module:attribute"`` string imported on first use) under ``name`` and ``aliases``."""
    for n in (name, *aliases):
        if not isinstance(n, str) or not n or ":" in n:
            raise ValueError(f"environment names must be non-empty strings without ':', got {n!r}")
        if not overwrite and (n in _REGISTRY or n in _ALIASES):
            raise ValueError(f"environment {n!r} is already registered")
    _REGISTRY[name] = factory
    for alias in aliases:
        _ALIASES[alias] = name


def env_names(include_aliases: bool = False) -> tuple[str, ...]:
    """The registered names (and aliases if asked), in registration order."""
    return tuple(_REGISTRY) + (tuple(_ALIASES) if include_aliases else ())


register_env("tictactoe", "ppokit.envs.tictactoe:TicTacToeEnv", "tic-tac-toe", "tic_tac_toe")
register_env("frozenlake", "ppokit.envs.frozenlake:FrozenLakeTextEnv", "frozen-lake", "frozen_lake")
register_env("guess_number", "ppokit.envs.guess_number:GuessNumberEnv", "guess-number", "guess")
register_env("calculator", "ppokit.envs.calculator:CalculatorEnv", "calc")


def load_env_factory(spec: Any) -> tuple[Callable[..., Any], str]:
    """``(factory, name)`` for a registered name, ``module:Class``, ``path/to/file.py:Class``,
    ``textarena:<id>``, or a class / callable given directly."""
    if callable(spec) and not isinstance(spec, str):
        return spec, getattr(spec, "__qualname__", None) or getattr(spec, "__name__", repr(spec))
    if not isinstance(spec, str) or not spec.strip():
        raise EnvError(
            f"an environment must be a built-in name ({', '.join(env_names())}), module:Class or "
            f"path/to/file.py:Class (got {spec!r})"
        )
    spec = spec.strip()
    if spec.startswith("textarena:"):
        # imported here: `python -m ppokit.envs.textarena` must not find it imported already
        from .textarena import textarena_factory  # noqa: PLC0415

        return textarena_factory(spec), spec
    name = _ALIASES.get(spec, spec)
    if name in _REGISTRY:
        factory = _REGISTRY[name]
        if isinstance(factory, str):
            module_name, _, attr = factory.partition(":")
            factory = getattr(importlib.import_module(module_name), attr)
        return factory, name
    if not is_user_spec(spec):
        raise EnvError(
            f"unknown environment '{spec}'{did_you_mean(spec, env_names(True)) or ';'} built-ins: "
            f"{', '.join(env_names())}; or give module:Class or path/to/file.py:Class (or textarena:<id> for a "
            "TextArena game)"
        )
    factory = load_user_object(
        spec,
        what="environment",
        kind="class",
        error=EnvError,
        candidates=inspect.isclass,
        fix="point at a class with reset(seed=None) and step(action)",
    )
    return factory, spec


def make_env(spec: Any, **kwargs: Any) -> Any:
    """Build the environment ``spec`` names with keyword arguments ``kwargs``.

    The instance gets ``env_name`` (the name or spec) for error messages, where it
    accepts attributes.
    """
    factory, name = load_env_factory(spec)
    _check_kwargs(factory, name, kwargs)
    try:
        env = factory(**kwargs)
    except UserError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the environment's constructor failed
        raise EnvError(f"environment '{name}': building it failed: {one_line_error(exc)}") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise EnvError(
            f"environment '{name}' built a {type(env).__name__} without {' or '.join(missing)}; an "
            "environment needs reset(seed=None) -> (observation, info) and step(action) -> "
            "(observation, reward, terminated, truncated, info)"
        )
    try:
        env.env_name = name
    except (AttributeError, TypeError):
        pass
    return env


def _check_kwargs(factory: Callable[..., Any], name: str, kwargs: dict[str, Any]) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    for key in kwargs:
        if key not in accepted:
            listing = ", ".join(accepted) if accepted else "none"
            raise EnvError(
                f"environment '{name}' does not take '{key}'{did_you_mean(key, accepted) or ';'} parameters: {listing}"
            )
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise EnvError(f"environment '{name}': {exc}") from None
