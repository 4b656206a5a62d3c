"""The text-environment API: Gymnasium's reset/step, with text in and text out.

An environment is any object with these two methods (:class:`TextEnvProtocol`);
subclassing :class:`TextEnv` is optional and gives seeding and defaults::

    reset(seed=None, options=None) -> (observation, info)
    step(action_text)              -> (observation, reward, terminated, truncated, info)

``observation`` is a ``str`` or a list of chat messages ``[{"role": ..., "content": ...}]``;
``action_text`` is what the model wrote for this turn (decoded, up to EOS); ``reward`` a
finite float; ``terminated`` means the episode ended by its own rules (no bootstrap),
``truncated`` that it was cut short (a turn limit: bootstrap from the value of the last
observation); ``info`` a dict.

What an observation means (:attr:`TextEnv.observation_mode`):

- ``"state"``: every observation is the whole context the model needs for its next
  action (a board, the problem plus the tool results so far). The rollout builds each
  turn's prompt from the latest observation alone, so context stays short and no token
  stream is re-tokenized across turns. All built-in environments default to this.
- ``"message"``: ``reset`` gives the opening conversation and each ``step`` the new
  message(s) to append after the model's reply (tool results, the other player's
  move); the rollout keeps the conversation.

Documented ``info`` keys (:data:`INFO_KEYS`); an environment sets those that apply:

- ``illegal`` (bool): the action just given was illegal or could not be parsed. The
  built-in environments then end the episode with their ``illegal_penalty``.
- ``illegal_reason`` (str): why, e.g. ``"occupied"``, ``"no move found"``.
- ``outcome`` (``"win"`` | ``"draw"`` | ``"loss"``): set when the episode ends, from the
  point of view of the player who just acted. Puzzles and tools use ``"win"`` for solved
  and ``"loss"`` otherwise (including running out of turns).
- ``outcomes`` (list of str): each seat's outcome when a two-player episode ends.
- ``player`` (int): the seat that acts next (two-player environments; seat 0 moves
  first). Present in the info of ``reset`` and of every ``step`` that does not end the
  episode.
- ``seat`` (int): the seat the learning policy plays against a built-in opponent.
- ``rewards`` (list of float): each seat's reward for the final step, when a
  two-player episode ends. The step's own ``reward`` is the mover's entry; the rollout
  adds ``rewards[s]`` to the last turn of every other seat ``s`` (self-play).
- ``action`` (str): the action as the environment understood it (canonical form).
- ``legal_actions`` (list of str): the legal actions for the next turn, where finite.
- ``example_actions`` (list of str): where the legal actions are not finite (a tool's
  calls), a few the environment accepts next; the memory estimate's probe episodes play
  them (:mod:`ppokit.lm.multi_turn.sizing`) to size the later observations.
- ``env_error`` (str): set by :func:`ppokit.envs.checks.step_or_fail` when ``step``
  raised; the episode ended there with the configured failure reward.

Exceptions: ``step`` may raise; :func:`~ppokit.envs.checks.step_or_fail` catches it and
returns a terminal step with the failure reward and ``info["env_error"]``, so a rollout
ends that episode, counts a failure and goes on. A return of the wrong type is a bug in
the environment and raises :class:`~ppokit.envs.checks.EnvError` at once.
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
