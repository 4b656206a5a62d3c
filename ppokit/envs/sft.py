"""Warm-start data from environments: ``{"prompt", "completion"}`` records of played turns.

The records use the environment's own observations as prompts and the actions as
completions, byte for byte what the rollout will show and parse, so a supervised warm
start (``ppokit sft`` with a JSONL file of these records) teaches the format and the
legal moves before PPO.

- :func:`demonstration_records`: any ``observation_mode="state"`` environment and any
  policy (e.g. :func:`~ppokit.envs.runner.expert_policy`); the multi-turn warm start
  (:mod:`ppokit.lm.multi_turn.demonstrations`) builds its records with it.
- :func:`tictactoe_sft_records`: tic-tac-toe games by random legal play (both seats),
  by the best response to a random opponent, or by perfect play.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from ppokit.errors import UserError

from .checks import env_label
from .runner import Policy, expert_policy, play_episode, random_legal_policy
from .tictactoe import TicTacToeEnv
from .tictactoe_solver import perfect_moves

__all__ = ["TICTACTOE_SFT_POLICIES", "demonstration_records", "tictactoe_sft_records"]


def demonstration_records(
    env: Any,
    policy: Policy | Mapping[int, Policy],
    *,
    episodes: int | None = None,
    turns: int | None = None,
    seed: int = 0,
    seats: Sequence[int | None] | None = None,
    legal_only: bool = True,
    unique: bool = False,
    winners_only: bool = False,
    name: str | None = None,
) -> list[dict[str, Any]]:
    """One record per turn of episodes played with ``policy`` (seeds ``seed, seed + 1, ...``).

    A record: ``{"prompt": observation, "completion": action, "seat": seat or None,
    "episode": i, "legal_actions": the legal actions the policy was shown (or [])}``.
    Either ``episodes`` (play that many) or ``turns`` (play until that many records, then
    cut; a :class:`UserError` after 1000 episodes per record without them). ``seats``: whose
    turns to keep (default: all). ``legal_only``: drop turns the environment called illegal.
    ``unique``: keep the first record of each distinct (prompt, completion). ``winners_only``:
    keep the turns of seats that won their episode (demonstrations chosen by the
    environment's outcome alone: rejection sampling).
    """
    if (episodes is None) == (turns is None):
        raise ValueError("give exactly one of episodes and turns")
    target = episodes if episodes is not None else turns
    what = "episodes" if episodes is not None else "turns"
    if isinstance(target, bool) or not isinstance(target, int) or target < 0:
        raise UserError(f"{what} must be a non-negative int (got {target!r})")
    label = name or env_label(env)
    records: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    shown: list[list] = []  # the legal actions each turn's policy call saw, in turn order

    def recording(play: Policy) -> Policy:
        def act(observation: Any, info: dict) -> str:
            if not isinstance(observation, str):
                raise UserError(
                    f"environment '{label}': demonstrations need text observations "
                    "(observation_mode='state'); this one gives chat messages"
                )
            shown.append(list(info.get("legal_actions") or []))
            return play(observation, info)

        return act

    played = {seat: recording(p) for seat, p in policy.items()} if isinstance(policy, Mapping) else recording(policy)

    i = 0
    while (i < episodes) if episodes is not None else (len(records) < turns):
        if turns is not None and i > 1000 * max(turns, 1):
            kept = " of winning seats" if winners_only else ""
            raise UserError(f"environment '{label}': {i} demonstration episodes gave only {len(records)} turns{kept}")
        shown.clear()
        episode = play_episode(env, played, seed=seed + i, name=name)
        winners = {seat for seat, record in episode.records.items() if record.outcome == "win"}
        for turn, legal in zip(episode.turns, shown):
            if (seats is not None and turn.player not in seats) or (winners_only and turn.player not in winners):
                continue
            if legal_only and turn.info.get("illegal"):
                continue
            key = (turn.observation, turn.action)
            if unique and key in seen:
                continue
            seen.add(key)
            records.append(
                {
                    "prompt": turn.observation,
                    "completion": turn.action,
                    "seat": turn.player,
                    "episode": i,
                    "legal_actions": legal,
                }
            )
        i += 1
    return records if turns is None else records[:turns]


TICTACTOE_SFT_POLICIES = ("random", "best_response", "perfect")


def tictactoe_sft_records(
    games: int, *, policy: str = "random", seed: int = 0, unique: bool = False, show_cell_numbers: bool = True
) -> list[dict[str, Any]]:
    """Tic-tac-toe warm-start records in :class:`~ppokit.envs.tictactoe.TicTacToeEnv`'s format.

    ``policy``:

    - ``"random"``: both seats play uniformly random legal moves (self-play); every
      turn of both seats is a record. Teaches the board format and legal moves only.
    - ``"best_response"``: the learner plays the best response to a random opponent
      (x and o alternately); the learner's turns are records. The ceiling against the
      ``random`` opponent.
    - ``"perfect"``: the learner plays minimax-optimal moves against a random opponent.
    """
    if policy == "random":
        env = TicTacToeEnv(opponent="self", show_cell_numbers=show_cell_numbers)
        return demonstration_records(
            env, random_legal_policy(random.Random(seed)), episodes=games, seed=seed, unique=unique
        )
    if policy in ("best_response", "perfect"):
        env = TicTacToeEnv(opponent="random", policy_seat="alternate", show_cell_numbers=show_cell_numbers)

        def perfect(observation: Any, info: dict) -> str:
            return str(perfect_moves(env.board)[0] + 1)

        expert = perfect if policy == "perfect" else expert_policy(env)
        return demonstration_records(env, expert, episodes=games, seed=seed, unique=unique)
    raise UserError(f"tictactoe SFT policy must be one of {', '.join(TICTACTOE_SFT_POLICIES)} (got {policy!r})")
