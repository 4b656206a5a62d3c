"""A tiny name -> function registry with aliases and helpful errors.

Every pluggable piece of PPO math (advantage estimators, aggregation modes, KL
estimators, policy losses) lives in a :class:`Registry`, so a configuration can
name it by string and a typo gives a one-line message such as::

    unknown advantage estimator 'gea'; did you mean 'gae'? valid: gae, grpo, rloo

This module imports nothing but the standard library.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Registry", "UnknownNameError"]

T = TypeVar("T")


class UnknownNameError(ValueError):
    """A name that is not in a :class:`Registry`.

    Attributes:
        kind: the registry's human name, e.g. ``"advantage estimator"``.
        name: the name that was asked for.
        suggestion: the closest valid name, or ``None``.
        valid: every accepted name (canonical names and aliases).
    """

    def __init__(self, kind: str, name: object, suggestion: str | None, valid: tuple[str, ...], listing: str):
        self.kind = kind
        self.name = name
        self.suggestion = suggestion
        self.valid = valid
        hint = f"; did you mean {suggestion!r}?" if suggestion else ";"
        super().__init__(f"unknown {kind} {name!r}{hint} valid: {listing}")


class Registry(Generic[T]):
    """Maps names (and aliases) to objects, typically functions.

    Example::

        LOSSES = Registry("policy loss")

        @LOSSES.register("ppo", "vanilla")
        def ppo_loss(...): ...

        LOSSES.get("vanilla") is ppo_loss   # True
    """

    def __init__(self, kind: str):
        """``kind`` is the human name used in error messages, e.g. ``"KL estimator"``."""
        self.kind = kind
        self._entries: dict[str, T] = {}  # every accepted name -> object
        self._canonical: dict[str, str] = {}  # every accepted name -> canonical name
        self._order: list[str] = []  # canonical names, registration order

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        """Decorator registering an object under ``name`` and any ``aliases``.

        Raises ValueError if any of the names is already taken.
        """
        names = (name, *aliases)
        for n in names:
            if not isinstance(n, str) or not n:
                raise ValueError(f"{self.kind} names must be non-empty strings, got {n!r}")
            if n in self._entries:
                raise ValueError(f"{self.kind} {n!r} is already registered")
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate names in register{names!r}")

        def decorator(obj: T) -> T:
            for n in names:
                if n in self._entries:  # registered between the call and the decoration
                    raise ValueError(f"{self.kind} {n!r} is already registered")
            for n in names:
                self._entries[n] = obj
                self._canonical[n] = name
            self._order.append(name)
            return obj

        return decorator

    def get(self, name: str) -> T:
        """Return the object registered as ``name`` (or an alias of it).

        Raises :class:`UnknownNameError` (a ValueError) with a did-you-mean hint.
        """
        if isinstance(name, str) and name in self._entries:
            return self._entries[name]
        valid = tuple(self._entries)
        suggestion = None
        if isinstance(name, str):
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
            suggestion = close[0] if close else None
        raise UnknownNameError(self.kind, name, suggestion, valid, self._listing())

    def canonical(self, name: str) -> str:
        """The canonical name of ``name`` (which may be an alias)."""
        self.get(name)
        return self._canonical[name]

    def names(self, include_aliases: bool = False) -> tuple[str, ...]:
        """Canonical names in registration order (plus aliases if asked)."""
        if include_aliases:
            return tuple(self._entries)
        return tuple(self._order)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __iter__(self):
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {self._listing()})"

    def _listing(self) -> str:
        aliases = [n for n in self._entries if n not in self._order]
        text = ", ".join(self._order) if self._order else "(none registered)"
        if aliases:
            text += f" (aliases: {', '.join(aliases)})"
        return text
