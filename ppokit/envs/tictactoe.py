"""Tic-tac-toe as a text environment: against a built-in opponent, or self-play.

:class:`TicTacToeEnv` shows the player to move the board (:func:`render_board`): three rows of
cells, then ``"<mark> to move:"``. An empty cell shows its number 1-9, so the legal moves are
exactly the digits on the board; every character is in the tiny model's alphabet, and the
observation is always 22 characters. The move is the first digit of the text
(:func:`parse_cell`). No digit, ``0`` or an occupied cell ends the episode: ``illegal_penalty``
for the mover, reward 0 and outcome ``"win"`` for the other seat (it did nothing to earn more).

Seats: 0 = x (moves first), 1 = o. Opponents (:data:`OPPONENTS`): :func:`random_move`,
:func:`heuristic_move` (win, else block, else the centre, else random), :func:`perfect_move`
(minimax, never loses), ``"self"`` (the environment plays no seat: self-play), or a function
``(board, mark, rng) -> cell``. Rewards, for the player who just acted: ``win_reward`` 1,
``draw_reward`` 0, ``loss_reward`` -1 when the game ends, 0 before. Deterministic given the reset
seed. The board drawn, ``policy_seat`` and every option: docs/environments.md, "Tic-tac-toe".
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Callable
from typing import Any

from ppokit.errors import UserError, did_you_mean

from .base import TextEnv
from .checks import EnvError
from .tictactoe_solver import (
    EMPTY_BOARD,
    LINES,
    best_response_moves,
    is_full,
    legal_moves,
    other,
    perfect_moves,
    play,
    to_move,
    winner,
)

__all__ = [
    "OPPONENTS",
    "TicTacToeEnv",
    "heuristic_move",
    "parse_cell",
    "perfect_move",
    "random_move",
    "render_board",
]

SEATS = ("x", "o")
Opponent = Callable[[str, str, random.Random], int]


def random_move(board: str, mark: str, rng: random.Random) -> int:
    """A uniformly random legal cell."""
    return rng.choice(legal_moves(board))


def _completing(board: str, mark: str) -> list[int]:
    """Cells where ``mark`` would complete a line."""
    cells = set()
    for line in LINES:
        values = [board[i] for i in line]
        if values.count(mark) == 2 and values.count(".") == 1:
            cells.add(line[values.index(".")])
    return sorted(cells)


def heuristic_move(board: str, mark: str, rng: random.Random) -> int:
    """Win if possible, else block the other mark's win, else the centre, else random."""
    for cells in (_completing(board, mark), _completing(board, other(mark))):
        if cells:
            return rng.choice(cells)
    if board[4] == ".":
        return 4
    return random_move(board, mark, rng)


def perfect_move(board: str, mark: str, rng: random.Random) -> int:
    """Uniformly among the minimax-optimal cells."""
    return rng.choice(perfect_moves(board))


OPPONENTS: dict[str, Opponent | None] = {
    "random": random_move,
    "heuristic": heuristic_move,
    "perfect": perfect_move,
    "self": None,
}

_DIGIT = re.compile(r"\d")


def parse_cell(text: str) -> tuple[int | None, str | None]:
    """``(cell 0..8, None)`` from the first digit of ``text``, or ``(None, reason)``."""
    if not isinstance(text, str):
        return None, "not text"
    match = _DIGIT.search(text)
    if match is None:
        return None, "no move found"
    digit = int(match.group())
    if digit == 0:
        return None, "cell 0 does not exist"
    return digit - 1, None


def render_board(board: str, mark: str, show_cell_numbers: bool = True) -> str:
    """Three rows and ``"<mark> to move:"`` (see the module docstring)."""
    cells = [str(i + 1) if c == "." and show_cell_numbers else c for i, c in enumerate(board)]
    rows = ["".join(cells[r * 3 : r * 3 + 3]) for r in range(3)]
    return "\n".join(rows) + f"\n{mark} to move:"


def _seat_index(value: Any, what: str) -> int:
    if value in (0, "x"):
        return 0
    if value in (1, "o"):
        return 1
    raise UserError(f"tictactoe: {what} must be 'x', 'o', 0 or 1 (got {value!r})")


class TicTacToeEnv(TextEnv):
    """Tic-tac-toe (module docstring). ``policy_seat`` (against an opponent): ``"x"``/0, ``"o"``/1,
    ``"alternate"`` (x on the first reset, then alternating) or ``"random"`` (from the episode's random
    stream); ``reset(options={"seat": ...})`` overrides it for one episode. An opponent that plays x
    makes its first move in ``reset``. ``show_cell_numbers=False`` shows ``.`` for an empty cell."""

    num_players = 2

    def __init__(
        self,
        opponent: str | Opponent = "random",
        policy_seat: str | int = "alternate",
        win_reward: float = 1.0,
        draw_reward: float = 0.0,
        loss_reward: float = -1.0,
        illegal_penalty: float = -1.0,
        show_cell_numbers: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(opponent, str):
            if opponent not in OPPONENTS:
                raise UserError(
                    f"tictactoe: unknown opponent '{opponent}'{did_you_mean(opponent, OPPONENTS)} "
                    f"valid: {', '.join(OPPONENTS)}, or a function (board, mark, rng) -> cell"
                )
            self.opponent_name, self._opponent = opponent, OPPONENTS[opponent]
        elif callable(opponent):
            self.opponent_name = getattr(opponent, "__name__", "custom")
            self._opponent = opponent
        else:
            raise UserError(
                f"tictactoe: opponent must be one of {', '.join(OPPONENTS)} or a function "
                f"(board, mark, rng) -> cell (got {opponent!r})"
            )
        if policy_seat not in ("alternate", "random"):
            _seat_index(policy_seat, "policy_seat (or 'alternate' / 'random')")
        self.policy_seat = policy_seat
        self.win_reward, self.draw_reward, self.loss_reward = float(win_reward), float(draw_reward), float(loss_reward)
        self.illegal_penalty = float(illegal_penalty)
        self.show_cell_numbers = bool(show_cell_numbers)
        self.board = EMPTY_BOARD
        self.seat: int | None = None  # the learner's seat; None in self-play
        self.done = True
        self._episodes = 0

    @property
    def self_play(self) -> bool:
        return self._opponent is None

    # ------------------------------------------------------------------ helpers
    def observation(self) -> str:
        """The current board for the player to move."""
        return render_board(self.board, to_move(self.board), self.show_cell_numbers)

    def legal_actions(self) -> list[str]:
        return [str(c + 1) for c in legal_moves(self.board)]

    def _turn_info(self) -> dict[str, Any]:
        return {"player": SEATS.index(to_move(self.board)), "legal_actions": self.legal_actions()}

    def _final(self, mover: int, rewards: list[float], outcomes: list[str], info: dict[str, Any]) -> tuple:
        self.done = True
        info.update(rewards=rewards, outcome=outcomes[mover], outcomes=outcomes)
        return self.observation(), rewards[mover], True, False, info

    def _result(self) -> tuple[list[float], list[str]] | None:
        """Per-seat rewards and outcomes if the game is over, else None."""
        w = winner(self.board)
        if w is not None:
            s = SEATS.index(w)
            rewards, outcomes = [0.0, 0.0], ["", ""]
            rewards[s], rewards[1 - s] = self.win_reward, self.loss_reward
            outcomes[s], outcomes[1 - s] = "win", "loss"
            return rewards, outcomes
        if is_full(self.board):
            return [self.draw_reward] * 2, ["draw", "draw"]
        return None

    def _opponent_move(self) -> int:
        mark = to_move(self.board)
        raw = self._opponent(self.board, mark, self.rng)
        try:
            cell = None if isinstance(raw, bool) else operator.index(raw)
        except TypeError:
            cell = None
        if cell is None or not 0 <= cell <= 8 or self.board[cell] != ".":
            raise EnvError(
                f"tictactoe: opponent {self.opponent_name} returned {raw!r} on board "
                f"{self.board!r}; it must return an empty cell 0-8"
            )
        self.board = play(self.board, cell, mark)
        return cell

    # ------------------------------------------------------------------ API
    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self._seed(seed)
        self.board = EMPTY_BOARD
        self.done = False
        info: dict[str, Any] = {}
        if not self.self_play:
            choice = (options or {}).get("seat", self.policy_seat)
            if choice == "alternate":
                self.seat = self._episodes % 2
            elif choice == "random":
                self.seat = self.rng.randrange(2)
            else:
                self.seat = _seat_index(choice, "the seat")
            info["seat"] = self.seat
            if self.seat == 1:
                info["opponent_action"] = str(self._opponent_move() + 1)
        self._episodes += 1
        info.update(self._turn_info())
        return self.observation(), info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.done:
            raise RuntimeError("tictactoe: step() after the episode ended; call reset()")
        mover = SEATS.index(to_move(self.board))
        cell, reason = parse_cell(action)
        if cell is not None and self.board[cell] != ".":
            cell, reason = None, "occupied"
        if cell is None:
            rewards = [0.0, 0.0]
            rewards[mover] = self.illegal_penalty
            outcomes = ["", ""]
            outcomes[mover], outcomes[1 - mover] = "loss", "win"
            return self._final(mover, rewards, outcomes, {"illegal": True, "illegal_reason": reason})
        info: dict[str, Any] = {"illegal": False, "action": str(cell + 1)}
        self.board = play(self.board, cell, SEATS[mover])
        result = self._result()
        if result is not None:
            return self._final(mover, *result, info)
        if self.self_play:
            info.update(self._turn_info())
            return self.observation(), 0.0, False, False, info
        info["opponent_action"] = str(self._opponent_move() + 1)
        result = self._result()
        if result is not None:
            return self._final(mover, *result, info)
        info.update(self._turn_info())
        return self.observation(), 0.0, False, False, info

    # ------------------------------------------------------------------ demonstrations
    def expert_action(self) -> str:
        """A strong move for the player to move: the best response when the opponent is
        ``random`` (the ceiling against it), else a minimax-optimal move."""
        if self.opponent_name == "random":
            rewards = (self.win_reward, self.draw_reward, self.loss_reward)
            return str(best_response_moves(self.board, rewards)[0] + 1)
        return str(perfect_moves(self.board)[0] + 1)
