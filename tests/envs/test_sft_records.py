"""Warm-start records: the env's exact observation/action format, legal moves, expert moves."""

import random

import pytest

from ppokit.envs import make_env
from ppokit.envs.calculator import CalculatorEnv
from ppokit.envs.runner import expert_policy
from ppokit.envs.sft import demonstration_records, tictactoe_sft_records
from ppokit.envs.tictactoe import TicTacToeEnv, parse_cell
from ppokit.envs.tictactoe_solver import best_response_moves, perfect_moves
from ppokit.errors import UserError


def _board(prompt: str) -> str:
    """The 9-cell board string behind a tic-tac-toe observation."""
    rows = prompt.splitlines()[:3]
    return "".join("." if c.isdigit() else c for c in "".join(rows))


def test_random_records_are_legal_moves_of_both_seats_in_the_env_format():
    records = tictactoe_sft_records(300, policy="random", seed=0)
    assert {r["seat"] for r in records} == {0, 1}
    for r in records:
        board = _board(r["prompt"])
        cell, reason = parse_cell(r["completion"])
        assert reason is None and board[cell] == "." and r["completion"] == str(cell + 1)
        mark = "x" if board.count("x") == board.count("o") else "o"
        assert r["prompt"].endswith(f"{mark} to move:") and len(r["prompt"]) == 22
    # the games are replayable in the env: every record is an observation the env shows
    env = TicTacToeEnv(opponent="self")
    episode0 = [r for r in records if r["episode"] == 0]
    obs, _ = env.reset(seed=0)
    for r in episode0:
        assert r["prompt"] == obs
        obs, *_ = env.step(r["completion"])


def test_random_records_are_deterministic_and_can_be_deduplicated():
    assert tictactoe_sft_records(20, seed=3) == tictactoe_sft_records(20, seed=3)
    assert tictactoe_sft_records(20, seed=3) != tictactoe_sft_records(20, seed=4)
    unique = tictactoe_sft_records(500, seed=0, unique=True)
    pairs = [(r["prompt"], r["completion"]) for r in unique]
    assert len(pairs) == len(set(pairs)) < len(tictactoe_sft_records(500, seed=0))


@pytest.mark.parametrize("policy,moves", [("best_response", best_response_moves), ("perfect", perfect_moves)])
def test_expert_records_play_the_expert_move(policy, moves):
    records = tictactoe_sft_records(100, policy=policy, seed=0)
    assert {r["seat"] for r in records} == {0, 1}  # x and o alternate
    for r in records:
        assert int(r["completion"]) - 1 == moves(_board(r["prompt"]))[0]


def test_show_cell_numbers_off_changes_only_the_rendering():
    records = tictactoe_sft_records(5, seed=0, show_cell_numbers=False)
    assert records[0]["prompt"] == "...\n...\n...\nx to move:"


def test_demonstrations_of_other_envs_and_errors():
    env = CalculatorEnv()
    records = demonstration_records(env, expert_policy(env), episodes=3, seed=0)
    assert records[0]["prompt"] == env.reset(seed=0)[0] and records[0]["completion"].startswith("calc: ")
    assert records[-1]["completion"].startswith("answer: ")
    guess = make_env("guess")
    assert demonstration_records(guess, expert_policy(guess), episodes=1, seed=0)[0]["completion"] == "50"
    chat = CalculatorEnv(observation_mode="message")
    with pytest.raises(UserError, match="demonstrations need text observations"):
        demonstration_records(chat, expert_policy(chat), episodes=1)
    with pytest.raises(UserError, match="policy must be one of random, best_response, perfect"):
        tictactoe_sft_records(1, policy="minimax")


def test_illegal_turns_are_dropped_unless_asked():
    def sloppy():
        rng = random.Random(0)
        return lambda obs, info: rng.choice(["5", "x"])  # "5" again, or no move: illegal

    kept = demonstration_records(TicTacToeEnv(policy_seat="x"), sloppy(), episodes=30, seed=0)
    everything = demonstration_records(TicTacToeEnv(policy_seat="x"), sloppy(), episodes=30, seed=0, legal_only=False)
    assert [r for r in everything if r["completion"] == "5" and "5" in r["prompt"]] == kept
    assert len(kept) < len(everything)
