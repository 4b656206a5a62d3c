"""Tic-tac-toe: rules, rendering, opponents, self-play rewards, and the known statistics by simulation."""

import random
from fractions import Fraction

import pytest

from ppokit.envs import checked_reset, checked_step, evaluate_policy, expert_policy, make_env, play_episode
from ppokit.envs.runner import random_legal_policy
from ppokit.envs.tictactoe import TicTacToeEnv, heuristic_move, parse_cell, render_board
from ppokit.envs.tictactoe_solver import (
    EMPTY_BOARD,
    best_response_moves,
    best_response_value,
    legal_moves,
    minimax_value,
    outcome_probabilities,
)
from ppokit.lm.model.tiny import DEFAULT_ALPHABET


def test_observation_format_is_exact():
    assert render_board(EMPTY_BOARD, "x") == "123\n456\n789\nx to move:"
    assert render_board("....x...o", "x") == "123\n4x6\n78o\nx to move:"
    assert render_board("....x...o", "x", show_cell_numbers=False) == "...\n.x.\n..o\nx to move:"
    env = TicTacToeEnv(opponent="heuristic", policy_seat="x")
    obs, info = env.reset(seed=0)
    assert obs == "123\n456\n789\nx to move:" and len(obs) == 22
    assert info == {"seat": 0, "player": 0, "legal_actions": [str(i) for i in range(1, 10)]}
    obs, reward, terminated, truncated, info = env.step("5")
    assert reward == 0.0 and not terminated and not truncated
    assert info["action"] == "5" and info["player"] == 0 and info["illegal"] is False
    opp = int(info["opponent_action"])
    assert obs[: -len("x to move:")].replace("\n", "")[opp - 1] == "o" and len(obs) == 22


@pytest.mark.parametrize(
    "text,cell,reason",
    [
        ("5", 4, None),
        ("5\n", 4, None),
        (" i play 7 then 3", 6, None),
        ("9", 8, None),
        ("", None, "no move found"),
        ("centre", None, "no move found"),
        ("0", None, "cell 0 does not exist"),
    ],
)
def test_parse_first_digit(text, cell, reason):
    assert parse_cell(text) == (cell, reason)


@pytest.mark.parametrize(
    "action,reason",
    [
        ("5", "occupied"),
        ("pass", "no move found"),
        ("0", "cell 0 does not exist"),
    ],
)
def test_illegal_action_ends_the_episode_with_the_penalty(action, reason):
    env = TicTacToeEnv(opponent="random", policy_seat="o", illegal_penalty=-2.0)
    env.reset(seed=1)
    env.board = "....x...."  # the opponent's opening, made deterministic for the test
    obs, reward, terminated, truncated, info = env.step(action)
    assert (reward, terminated, truncated) == (-2.0, True, False)
    assert info["illegal"] is True and info["illegal_reason"] == reason and info["outcome"] == "loss"
    assert info["rewards"] == [0.0, -2.0]
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("1")


def test_heuristic_wins_then_blocks_then_takes_the_centre():
    rng = random.Random(0)
    assert heuristic_move("xx.oo....", "o", rng) == 5  # o wins on its row rather than blocking x
    assert heuristic_move("xx..o....", "o", rng) == 2  # blocks x
    assert heuristic_move("x........", "o", rng) == 4  # centre
    assert heuristic_move("....x....", "o", rng) in {0, 1, 2, 3, 5, 6, 7, 8}


def test_every_observation_fits_the_tiny_alphabet():
    env = TicTacToeEnv(opponent="self")
    policy = random_legal_policy(random.Random(0))
    for seed in range(200):
        for turn in play_episode(env, policy, seed=seed).turns:
            assert set(turn.observation) <= set(DEFAULT_ALPHABET) and len(turn.observation) == 22


def test_deterministic_given_the_seed():
    def trajectory(seed):
        env = TicTacToeEnv(opponent="random", policy_seat="random")
        episode = play_episode(env, random_legal_policy(random.Random(seed)), seed=seed)
        return [(t.observation, t.action, t.reward) for t in episode.turns]

    assert trajectory(5) == trajectory(5)
    assert len({str(trajectory(s)) for s in range(10)}) > 5


def test_seat_choice_alternates_and_reset_options_override():
    env = TicTacToeEnv(opponent="perfect")
    seats = [env.reset(seed=s)[1]["seat"] for s in range(4)]
    assert seats == [0, 1, 0, 1]
    obs, info = checked_reset(env, seed=0, options={"seat": "o"})
    assert info["seat"] == 1 and info["player"] == 1 and obs.endswith("o to move:")
    assert obs.count("x") == 1  # the opponent opened in reset
    with pytest.raises(Exception, match="must be 'x', 'o', 0 or 1"):
        env.reset(seed=0, options={"seat": "z"})


def test_self_play_reports_turns_and_gives_both_seats_their_final_rewards():
    env = make_env("tictactoe", opponent="self")
    obs, info = env.reset(seed=0)
    assert info == {"player": 0, "legal_actions": [str(i) for i in range(1, 10)]}
    moves = ["1", "4", "2", "5"]
    players = []
    for m in moves:
        obs, reward, terminated, _, info = checked_step(env, m)
        players.append(info["player"])
        assert reward == 0.0 and not terminated
    assert players == [1, 0, 1, 0] and obs.endswith("x to move:")
    obs, reward, terminated, _, info = checked_step(env, "3")  # x completes the top row
    assert terminated and reward == 1.0 and info["outcome"] == "win"
    assert info["rewards"] == [1.0, -1.0] and info["outcomes"] == ["win", "loss"]


def test_self_play_episode_credits_each_seat():
    env = TicTacToeEnv(opponent="self")
    script = iter(["1", "4", "2", "5", "3"])
    episode = play_episode(env, lambda obs, info: next(script), seed=0)
    assert [t.player for t in episode.turns] == [0, 1, 0, 1, 0]
    assert episode.seat_rewards(0) == [0.0, 0.0, 1.0] and episode.seat_rewards(1) == [0.0, -1.0]
    assert episode.records[0].outcome == "win" and episode.records[1].outcome == "loss"
    assert episode.records[1].episode_return == -1.0


def test_draw_reward_and_custom_opponent():
    def first_empty(board, mark, rng):
        return board.index(".")

    env = TicTacToeEnv(opponent=first_empty, policy_seat="x", draw_reward=0.25)
    env.reset(seed=0)
    # x: 5, o: 1 (first empty), x: 2, o: 3, x: 7, o: 4, x: 6, o: 8, x: 9 -> draw
    for move in ["5", "2", "7", "6"]:
        _, reward, terminated, _, info = env.step(move)
        assert not terminated
    _, reward, terminated, _, info = env.step("9")
    assert terminated and reward == 0.25 and info["outcome"] == "draw"

    def cheating(board, mark, rng):
        return 4

    env = TicTacToeEnv(opponent=cheating, policy_seat="x")
    env.reset(seed=0)
    with pytest.raises(Exception, match="opponent cheating returned 4"):
        env.step("5")


# ----------------------------------------------------------------------------- exact solutions and simulation
def test_exact_outcome_probabilities_match_the_known_figures():
    rr = outcome_probabilities("random", "random")
    assert float(rr["x"]) == pytest.approx(0.5849, abs=1e-4)
    assert float(rr["o"]) == pytest.approx(0.2881, abs=1e-4)
    assert float(rr["draw"]) == pytest.approx(0.1270, abs=1e-4)
    br = outcome_probabilities("best_response", "random")
    assert float(br["x"]) == pytest.approx(0.9948, abs=1e-4) and br["o"] == 0
    assert minimax_value(EMPTY_BOARD) == 0
    assert outcome_probabilities("perfect", "perfect")["draw"] == 1
    assert outcome_probabilities("random", "perfect")["x"] == 0
    # the best response's value is its expected reward (win 1, draw 0, loss -1)
    assert best_response_value(EMPTY_BOARD, "x") == br["x"] - br["o"]


def test_best_response_is_better_than_every_other_first_move():
    # the expectimax value of the chosen first move beats the value of any other first move
    best = best_response_moves(EMPTY_BOARD)
    values = {c: best_response_value(EMPTY_BOARD[:c] + "x" + EMPTY_BOARD[c + 1 :], "x") for c in range(9)}
    assert all(values[b] == max(values.values()) for b in best)
    assert max(values.values()) > values[1]  # an edge opening is worse
    assert isinstance(values[0], Fraction)


def test_simulated_random_play_wins_about_58_5_percent_as_x():
    env = TicTacToeEnv(opponent="random", policy_seat="x")
    n = 4000
    metrics = evaluate_policy(env, random_legal_policy(random.Random(1)), episodes=n, seed=0)
    # 4 standard errors: sqrt(0.585 * 0.415 / 4000) = 0.0078
    assert metrics["env/win_rate"] == pytest.approx(0.585, abs=0.031)
    assert metrics["env/loss_rate"] == pytest.approx(0.288, abs=0.029)
    assert metrics["env/illegal_action_rate"] == 0


def test_simulated_best_response_wins_about_99_5_percent_against_random_o():
    env = TicTacToeEnv(opponent="random", policy_seat="x")
    metrics = evaluate_policy(env, expert_policy(env), episodes=2000, seed=0)
    # exact: 0.9948; 4 standard errors = 0.0064
    assert metrics["env/win_rate"] == pytest.approx(0.9948, abs=0.0064)
    assert metrics["env/loss_rate"] == 0.0


def test_perfect_opponent_never_loses():
    env = TicTacToeEnv(opponent="perfect", policy_seat="alternate")
    metrics = evaluate_policy(env, random_legal_policy(random.Random(0)), episodes=300, seed=0)
    assert metrics["env/win_rate"] == 0.0 and metrics["env/loss_rate"] > 0.5


def test_legal_moves_after_a_win_are_empty():
    assert legal_moves("xxxoo....") == []
