"""The text-environment API: Gymnasium's reset/step, with text in and text out.

An environment is any object with these two methods (:class:`TextEnvProtocol`);
subclassing :class:`TextEnv` is optional and gives seeding and defaults::

    reset(seed=None, options=None) -> (observation, info)
    step(action_text)              -> (observation, reward, terminated, truncated, info)

``observation`` is a ``str`` or a list of chat messages; ``terminated``: the episode ended by its
rules (no bootstrap); ``truncated``: it was cut short (bootstrap from the last observation's value).
:attr:`TextEnv.observation_mode`: ``"state"`` (each observation is the whole context; each turn is
its own prompt) or ``"message"`` (``step`` gives the messages to append; the rollout keeps the
conversation). :data:`INFO_KEYS`, the ``info`` keys ppokit reads (an environment sets those that
apply): ``illegal``, ``illegal_reason``, ``outcome`` (the mover's), ``outcomes``, ``player`` (the seat to
act next), ``seat``, ``rewards`` (each seat's at the end: the rollout credits the other seats' last
turns), ``action``, ``legal_actions``, ``example_actions``, ``env_error`` (``step`` raised: the episode
ended, :func:`~ppokit.envs.checks.step_or_fail`). Every key: docs/environments.md, "The environment API".
"""

from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "INFO_KEYS",
    "OBSERVATION_MODES",
    "OUTCOMES",
    "Message",
    "Observation",
    "TextEnv",
    "TextEnvProtocol",
]

Message = dict  # {"role": str, "content": str}
Observation = str | list  # a str, or a list of Message

OUTCOMES = ("win", "draw", "loss")
OBSERVATION_MODES = ("state", "message")
INFO_KEYS = (
    "illegal",
    "illegal_reason",
    "outcome",
    "outcomes",
    "player",
    "seat",
    "rewards",
    "action",
    "legal_actions",
    "example_actions",
    "env_error",
)


@runtime_checkable
class TextEnvProtocol(Protocol):
    """What a rollout needs from an environment: Gymnasium-style reset and step on text."""

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[Observation, dict]: ...

    def step(self, action: str) -> tuple[Observation, float, bool, bool, dict]: ...


class TextEnv:
    """Base class for text environments (optional: duck typing is enough).

    Subclasses implement :meth:`reset` and :meth:`step` and call :meth:`_seed` at the
    start of ``reset``. Class attributes:

    - ``observation_mode``: ``"state"`` or ``"message"`` (see the module docstring).
    - ``num_players``: 1, or 2 for games whose info carries ``player``.
    """

    observation_mode: str = "state"
    num_players: int = 1

    def __init__(self) -> None:
        self.rng = random.Random()

    def _seed(self, seed: int | None) -> None:
        """Gymnasium seeding: a seed restarts the random stream, ``None`` continues it.

        The first reset without a seed draws one from the operating system.
        """
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
            self.rng = random.Random(seed)
        elif not getattr(self, "_seeded", False):
            self.rng = random.Random()
        self._seeded = True

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[Observation, dict]:
        raise NotImplementedError

    def step(self, action: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (nothing by default)."""
