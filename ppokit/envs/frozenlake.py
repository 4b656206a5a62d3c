"""FrozenLake as text: Gymnasium's ``FrozenLake-v1`` dynamics, rendered in the tiny alphabet.

Observation (``observation_mode = "state"``), the default 4x4 map with the player on
the start cell::

    p...
    .h.h
    ...h
    h..g
    move (left/down/right/up):

One row per map row: ``p`` the player, ``.`` frozen ice (the start cell too), ``h`` a
hole, ``g`` the goal; then the instruction line. 46 characters for 4x4.

Action: the first of the words ``left``, ``down``, ``right``, ``up`` (or the single
letters ``l``, ``d``, ``r``, ``u``) in the text, any case; no such word is illegal: the
episode ends with ``illegal_penalty`` and ``info["illegal"] = True``. Walking into the
edge is legal and leaves the player where it is (Gymnasium's rule). With
``letters=True`` the instruction line is ``move (l/d/r/u):`` and ``legal_actions`` (and
``expert_action``) are the letters: a one-token move for a character model, where a
word's later letters would only carry noise in a policy gradient.

Dynamics are Gymnasium's: non-slippery by default; ``is_slippery=True`` moves in the
intended direction with probability 1/3 and in each perpendicular direction with 1/3.
The episode terminates in a hole (``hole_reward``, outcome ``"loss"``) or on the goal
(``goal_reward``, outcome ``"win"``) and is truncated after ``max_steps`` moves
(outcome ``"loss"``). Deterministic given the reset seed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from gymnasium.envs.toy_text.frozen_lake import MAPS, FrozenLakeEnv

from ppokit.errors import UserError

from .base import TextEnv

__all__ = ["ACTION_WORDS", "FrozenLakeTextEnv", "parse_direction", "render_lake"]

ACTION_WORDS = ("left", "down", "right", "up")  # Gymnasium's action order 0..3
_LETTERS = {w[0]: i for i, w in enumerate(ACTION_WORDS)}
_WORDS = {w: i for i, w in enumerate(ACTION_WORDS)}
_TOKEN = re.compile(r"[a-z]+")
_TILES = {"S": ".", "F": ".", "H": "h", "G": "g"}
PROMPT = "move (left/down/right/up):"
LETTER_PROMPT = "move (l/d/r/u):"


def parse_direction(text: str) -> int | None:
    """Gymnasium's action index (0 left, 1 down, 2 right, 3 up) of the first direction
    word or letter in ``text``, or None."""
    if not isinstance(text, str):
        return None
    for token in _TOKEN.findall(text.lower()):
        if token in _WORDS:
            return _WORDS[token]
        if token in _LETTERS:
            return _LETTERS[token]
    return None


def render_lake(desc: Sequence[str], position: int, prompt: str = PROMPT) -> str:
    """The map rows with the player at ``position`` (row * ncol + col), then the prompt."""
    ncol = len(desc[0])
    rows = []
    for r, row in enumerate(desc):
        cells = [_TILES[c] for c in row]
        if position // ncol == r:
            cells[position % ncol] = "p"
        rows.append("".join(cells))
    return "\n".join(rows) + "\n" + prompt


class FrozenLakeTextEnv(TextEnv):
    """FrozenLake with a text map; see the module docstring."""

    def __init__(
        self,
        map_name: str = "4x4",
        desc: Sequence[str] | None = None,
        is_slippery: bool = False,
        max_steps: int = 100,
        goal_reward: float = 1.0,
        hole_reward: float = 0.0,
        step_reward: float = 0.0,
        illegal_penalty: float = -1.0,
        letters: bool = False,
    ) -> None:
        super().__init__()

        if desc is None:
            if map_name not in MAPS:
                raise UserError(
                    f"frozenlake: unknown map_name {map_name!r}; valid: {', '.join(MAPS)}, or give desc "
                    "(rows of S, F, H, G)"
                )
            desc = MAPS[map_name]
        desc = [str(row) for row in desc]
        if (
            not desc
            or len({len(r) for r in desc}) != 1
            or any(set(r) - set("SFHG") for r in desc)
            or "".join(desc).count("S") != 1
            or "G" not in "".join(desc)
        ):
            raise UserError(
                f"frozenlake: desc must be equal-length rows of S, F, H, G with one S and a G (got {desc!r})"
            )
        if not isinstance(max_steps, int) or max_steps < 1:
            raise UserError(f"frozenlake: max_steps must be a positive int (got {max_steps!r})")
        self.desc = desc
        self.is_slippery = bool(is_slippery)
        self.max_steps = max_steps
        self.goal_reward, self.hole_reward = float(goal_reward), float(hole_reward)
        self.step_reward, self.illegal_penalty = float(step_reward), float(illegal_penalty)
        self.letters = bool(letters)
        self.actions = [w[0] for w in ACTION_WORDS] if self.letters else list(ACTION_WORDS)
        self._gym = FrozenLakeEnv(desc=desc, is_slippery=self.is_slippery)
        self.position = "".join(desc).index("S")
        self.steps = 0
        self.done = True
        self._policy: list[int] | None = None

    def observation(self) -> str:
        return render_lake(self.desc, self.position, LETTER_PROMPT if self.letters else PROMPT)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self._seed(seed)
        state, _ = self._gym.reset(seed=self.rng.randrange(2**31))  # Gymnasium's RNG follows ours
        self.position = int(state)
        self.steps = 0
        self.done = False
        return self.observation(), {"legal_actions": list(self.actions)}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError("frozenlake: step() after the episode ended; call reset()")
        move = parse_direction(action)
        if move is None:
            self.done = True
            return (
                self.observation(),
                self.illegal_penalty,
                True,
                False,
                {"illegal": True, "illegal_reason": "no direction found", "outcome": "loss"},
            )
        state, _, terminated, _, _ = self._gym.step(move)
        self.position = int(state)
        self.steps += 1
        tile = "".join(self.desc)[self.position]
        info: dict[str, Any] = {"illegal": False, "action": ACTION_WORDS[move]}
        reward = self.step_reward
        if terminated:
            reward += self.goal_reward if tile == "G" else self.hole_reward
            info["outcome"] = "win" if tile == "G" else "loss"
        truncated = not terminated and self.steps >= self.max_steps
        if truncated:
            info["outcome"] = "loss"
        self.done = terminated or truncated
        if not self.done:
            info["legal_actions"] = list(self.actions)
        return self.observation(), reward, bool(terminated), truncated, info

    # ------------------------------------------------------------------ demonstrations
    def expert_action(self) -> str:
        """The optimal move (value iteration on Gymnasium's transition table, discount
        0.99 so that shorter paths win ties): a shortest safe path when non-slippery, the
        move that maximises the chance of reaching the goal when slippery."""
        if self._policy is None:
            self._policy = _optimal_policy(self._gym.P, len(self.desc) * len(self.desc[0]))
        return self.actions[self._policy[self.position]]


def _optimal_policy(transitions: dict, n_states: int, gamma: float = 0.99, tol: float = 1e-12) -> list[int]:
    """Greedy actions of the optimal values; reward 1 on reaching the goal (Gymnasium's)."""
    values = [0.0] * n_states

    def q(s: int, a: int) -> float:
        return sum(p * (r + (0.0 if done else gamma * values[nxt])) for p, nxt, r, done in transitions[s][a])

    while True:
        new = [max(q(s, a) for a in range(4)) for s in range(n_states)]
        delta = max(abs(x - y) for x, y in zip(new, values))
        values = new
        if delta < tol:
            break
    return [max(range(4), key=lambda a: (q(s, a), -a)) for s in range(n_states)]
