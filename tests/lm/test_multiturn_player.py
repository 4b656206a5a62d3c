"""EpisodePlayer and the evaluator with a scripted "model": the same episodes as the reference loop.

``generate`` here decodes each prompt, plays a Python policy on the board it shows and
returns that move's tokens: the batched, token-level player must then produce exactly
the turns, rewards and outcomes of :func:`ppokit.envs.play_episode` with that policy.
"""

from __future__ import annotations

import pytest

from ppokit.config import build_config
from ppokit.envs import CURRENT, make_env, play_episode
from ppokit.envs.tictactoe_solver import best_response_moves, legal_moves
from ppokit.lm.model.tiny import build_char_tokenizer
from ppokit.lm.multi_turn.episodes import EpisodePlayer
from ppokit.lm.multi_turn.source import MultiTurnSource, TextEnvEvaluator
from ppokit.lm.multi_turn.streams import StreamCodec


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def board_of(text: str) -> str:
    """The 9-cell board (x / o / .) of a tic-tac-toe observation."""
    rows = text.split("\n")[:3]
    return "".join("." if c.isdigit() else c for c in "".join(rows))


def scripted(tok, move):
    """A ``generate`` that plays ``move(board) -> cell`` on each prompt, as digit + EOS tokens."""
    calls = []

    def generate(actor, prompts, greedy):
        calls.append((actor, len(prompts)))
        texts = [str(move(board_of(tok.decode(p, skip_special_tokens=True))) + 1) for p in prompts]
        return [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts], texts

    generate.calls = calls
    return generate


def first_legal(board):
    return legal_moves(board)[0]


def test_self_play_turns_rewards_and_outcomes_equal_the_reference_loop(tok):
    envs = [make_env("tictactoe", opponent="self") for _ in range(6)]
    generate = scripted(tok, first_legal)
    player = EpisodePlayer(
        envs, StreamCodec(tok, mode="state", chat=False), generate, max_turns=9, max_new_tokens=2, context=64
    )
    seeds = [3, 4, 5, 6, 7, 8]
    result = player.play(seeds, seat_actors=lambda i, info: {0: CURRENT, 1: CURRENT, "learner": i % 2})
    # one batched generate per turn (every live episode at once), not one per episode
    assert len(generate.calls) == 7 and generate.calls[0] == (CURRENT, 6)
    for e, seed in enumerate(seeds):
        env = make_env("tictactoe", opponent="self")
        ref = play_episode(env, lambda obs, info: str(first_legal(board_of(obs)) + 1), seed=seed)
        for seat in (0, 1):
            [traj] = [t for t in result.trajectories if t.episode == e and t.seat == seat]
            assert [turn.reward for turn in traj.turns] == ref.seat_rewards(seat)
            assert [turn.action_text for turn in traj.turns] == [t.action for t in ref.seat_turns(seat)]
            assert result.records[e][seat] == ref.records[seat]
    # x takes cells 1, 3, 5, 7 in order: the first player wins on the diagonal 3-5-7 (+1; o gets -1 on its last turn)
    assert {t.seat: t.episode_return for t in result.trajectories if t.episode == 0} == {0: 1.0, 1: -1.0}


def test_the_evaluator_tracks_win_rates_against_random_and_heuristic(tok):
    cfg = build_config(
        [
            {
                "workload": "lm",
                "train": {"iterations": 1},
                "textenv": {
                    "env": "tictactoe",
                    "kwargs": {"opponent": "self", "policy_seat": "x"},
                    "eval_episodes": 200,
                    "eval_opponents": ["random", "heuristic"],
                    "stop_at_win_rate": 0.95,
                },
                "rollout": {"max_new_tokens": 2},
            }
        ]
    )
    codec = StreamCodec(tok, mode="state", chat=False)
    best = TextEnvEvaluator(cfg, scripted(tok, lambda b: best_response_moves(b)[0]), codec, 64, "tictactoe")
    metrics = best.evaluate("final")
    # the best response to a random o wins 99.5% (tictactoe_solver); against the heuristic it cannot
    assert metrics["eval_after/random/win_rate"] > 0.97 and metrics["eval_after/random/illegal_action_rate"] == 0
    assert metrics["eval_after/heuristic/win_rate"] < metrics["eval_after/random/win_rate"]
    naive = TextEnvEvaluator(cfg, scripted(tok, first_legal), codec, 64, "tictactoe").evaluate("before")
    assert naive["eval_before/random/win_rate"] < 0.9
    line = best.message("final", metrics)
    assert line.startswith("after PPO: vs random 9") and "vs heuristic" in line and "200 episodes each, greedy" in line
    # periodic evaluations: the first opponent only, which the stopping rule reads
    periodic = best.evaluate("periodic")
    assert {key.split("/")[1] for key in periodic} == {"random"}
    assert periodic["eval/random/win_rate"] == metrics["eval_after/random/win_rate"]  # the same fixed games
    assert "vs heuristic" not in best.message("periodic", periodic)
    rate = periodic["eval/random/win_rate"]
    assert best.stop_reason(periodic) == f"win rate vs random {rate:.1%} >= textenv.stop_at_win_rate=0.95"
    assert best.state_dict()["early_stop"]["best"] == rate


def test_an_illegal_move_is_counted_and_ends_the_episode(tok):
    envs = [make_env("tictactoe", opponent="random", policy_seat="x") for _ in range(4)]
    player = EpisodePlayer(
        envs,
        StreamCodec(tok, mode="state", chat=False),
        scripted(tok, lambda b: 4),
        max_turns=9,
        max_new_tokens=2,
        context=64,
    )
    result = player.play([1, 2, 3, 4], seat_actors=lambda i, info: {})
    # cell 5 (index 4) every turn: legal once, then occupied: illegal, -1, a loss
    for traj in result.trajectories:
        assert [t.action_text for t in traj.turns] == ["5", "5"] and traj.turns[-1].reward == -1.0
        assert traj.record.illegal_actions == 1 and traj.record.outcome == "loss"


def test_role_baselines_subtract_each_seats_running_mean(tok):
    cfg = build_config(
        [
            {
                "workload": "lm",
                "train": {"iterations": 1, "batch_size": 4},
                "textenv": {"env": "tictactoe", "kwargs": {"opponent": "self"}, "role_baseline_tau": 0.5},
            }
        ]
    )
    envs = [make_env("tictactoe", opponent="self") for _ in range(4)]
    player = EpisodePlayer(
        envs,
        StreamCodec(tok, mode="state", chat=False),
        scripted(tok, first_legal),
        max_turns=9,
        max_new_tokens=2,
        context=64,
    )
    source = MultiTurnSource(cfg, player, mode="state", pad_id=tok.pad_token_id, device="cpu")
    result = player.play([1, 2, 3, 4], seat_actors=lambda i, info: {0: CURRENT, 1: CURRENT, "learner": 0})
    returns = {(t.episode, t.seat): t.episode_return for t in result.trajectories}
    metrics = source._role_baselines(result.trajectories)
    ema, shifted = {"0": 0.0, "1": 0.0}, {}
    for t in result.trajectories:  # in order: subtract the mean so far, then update it
        key = str(t.seat)
        shifted[(t.episode, t.seat)] = returns[(t.episode, t.seat)] - ema[key]
        ema[key] = 0.5 * ema[key] + 0.5 * returns[(t.episode, t.seat)]
    assert {(t.episode, t.seat): t.episode_return for t in result.trajectories} == pytest.approx(shifted)
    assert metrics == pytest.approx({"role_baseline/seat0": ema["0"], "role_baseline/seat1": ema["1"]})
