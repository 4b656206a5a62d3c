"""Tic-tac-toe rules and exact solutions: perfect play and the best response to a random player.

A board is a 9-character string, cells 0..8 row by row, each ``"x"``, ``"o"`` or ``"."``;
``"x"`` moves first. Everything here is exact (``fractions.Fraction``) and memoised
over the 5,478 reachable positions, so it is cheap after the first call.

- :func:`minimax_value` / :func:`perfect_moves`: perfect play (+1 win, 0 draw, -1 loss
  for the player to move).
- :func:`best_response_value` / :func:`best_response_moves`: the moves that maximise
  the learner's expected reward against an opponent that plays uniformly at random
  among the legal cells (expectimax). This is the ceiling a policy can reach against
  the ``random`` opponent, and a source of demonstrations.
- :func:`outcome_probabilities`: the exact win/draw/loss probabilities of a pair of
  strategies (random, best response, perfect), to compare simulations against.
"""

from __future__ import annotations

from fractions import Fraction
from functools import cache

__all__ = [
    "EMPTY_BOARD",
    "LINES",
    "best_response_moves",
    "best_response_value",
    "is_full",
    "legal_moves",
    "minimax_value",
    "other",
    "outcome_probabilities",
    "perfect_moves",
    "play",
    "to_move",
    "winner",
]

EMPTY_BOARD = "." * 9
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))


def other(mark: str) -> str:
    return "o" if mark == "x" else "x"


def winner(board: str) -> str | None:
    """``"x"`` or ``"o"`` if that mark holds a full line, else None."""
    for a, b, c in LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]
    return None


def is_full(board: str) -> bool:
    return "." not in board


def legal_moves(board: str) -> list[int]:
    """The empty cells (0..8) in order; none once the game is over."""
    if winner(board) is not None:
        return []
    return [i for i, c in enumerate(board) if c == "."]


def to_move(board: str) -> str:
    """The mark that moves next (``"x"`` when both have played equally often)."""
    return "x" if board.count("x") == board.count("o") else "o"


def play(board: str, cell: int, mark: str) -> str:
    """The board after ``mark`` plays ``cell`` (which must be empty)."""
    if board[cell] != ".":
        raise ValueError(f"cell {cell} is not empty in {board!r}")
    return board[:cell] + mark + board[cell + 1 :]


# ----------------------------------------------------------------------------- perfect play
@cache
def minimax_value(board: str) -> int:
    """+1 / 0 / -1: the result for the player to move when both play perfectly."""
    w = winner(board)
    if w is not None:
        return 1 if w == to_move(board) else -1
    if is_full(board):
        return 0
    mark = to_move(board)
    return max(-minimax_value(play(board, c, mark)) for c in legal_moves(board))


def perfect_moves(board: str) -> list[int]:
    """Every move that keeps the minimax value (the perfect player's choices)."""
    mark = to_move(board)
    best = minimax_value(board)
    return [c for c in legal_moves(board) if -minimax_value(play(board, c, mark)) == best]


# ----------------------------------------------------------------------------- best response
def _rewards_key(rewards: tuple[float, float, float]) -> tuple[Fraction, Fraction, Fraction]:
    if len(rewards) != 3:
        raise ValueError(f"rewards must be (win, draw, loss), got {rewards!r}")
    return tuple(Fraction(r) for r in rewards)  # type: ignore[return-value]


@cache
def _br_value(board: str, learner: str, rewards: tuple[Fraction, Fraction, Fraction]) -> Fraction:
    w = winner(board)
    if w is not None:
        return rewards[0] if w == learner else rewards[2]
    if is_full(board):
        return rewards[1]
    mark = to_move(board)
    children = [_br_value(play(board, c, mark), learner, rewards) for c in legal_moves(board)]
    if mark == learner:
        return max(children)
    return sum(children, Fraction(0)) / len(children)


def best_response_value(board: str, learner: str, rewards: tuple[float, float, float] = (1, 0, -1)) -> Fraction:
    """The learner's expected reward from ``board`` when it plays the best response and
    the other mark plays uniformly at random. ``rewards`` = (win, draw, loss)."""
    return _br_value(board, learner, _rewards_key(rewards))


def best_response_moves(board: str, rewards: tuple[float, float, float] = (1, 0, -1)) -> list[int]:
    """The moves of the player to move that maximise its expected reward against a
    uniformly random opponent (all of them when several tie), in cell order."""
    mark = to_move(board)
    key = _rewards_key(rewards)
    values = {c: _br_value(play(board, c, mark), mark, key) for c in legal_moves(board)}
    if not values:
        return []
    best = max(values.values())
    return [c for c, v in values.items() if v == best]


# ----------------------------------------------------------------------------- exact outcome probabilities
STRATEGIES = ("random", "best_response", "perfect")


def _choices(board: str, strategy: str, rewards: tuple[float, float, float]) -> list[int]:
    if strategy == "random":
        return legal_moves(board)
    if strategy == "best_response":
        return best_response_moves(board, rewards)[:1]  # the first optimal cell: a deterministic policy
    if strategy == "perfect":
        return perfect_moves(board)  # uniformly among the optimal cells
    raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")


def outcome_probabilities(
    x_strategy: str, o_strategy: str, rewards: tuple[float, float, float] = (1, 0, -1)
) -> dict[str, Fraction]:
    """Exact ``{"x", "o", "draw"}`` probabilities when x and o follow the named strategies.

    ``"random"`` picks uniformly among legal cells, ``"perfect"`` uniformly among the
    minimax-optimal cells, ``"best_response"`` the first cell (in order) that maximises
    the expected ``rewards`` against a random opponent.
    """
    probs = {"x": Fraction(0), "o": Fraction(0), "draw": Fraction(0)}

    def walk(board: str, p: Fraction) -> None:
        w = winner(board)
        if w is not None:
            probs[w] += p
            return
        if is_full(board):
            probs["draw"] += p
            return
        mark = to_move(board)
        cells = _choices(board, x_strategy if mark == "x" else o_strategy, rewards)
        for c in cells:
            walk(play(board, c, mark), p / len(cells))

    walk(EMPTY_BOARD, Fraction(1))
    return probs
