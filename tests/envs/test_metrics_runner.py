"""Episode metrics and the reference episode loop (failures, truncation, per-seat records)."""

import math

import pytest

from ppokit.envs import (
    EpisodeRecord,
    EpisodeTracker,
    StepResult,
    TextEnv,
    episode_metrics,
    play_episode,
)
from ppokit.envs.tictactoe import TicTacToeEnv


def test_episode_metrics_on_hand_built_records():
    records = [
        EpisodeRecord(1.0, 3, "win", seat=0),
        EpisodeRecord(-1.0, 2, "loss", illegal_actions=1, seat=1),
        EpisodeRecord(0.0, 5, "draw", seat=0),
        EpisodeRecord(0.5, 4, None, truncated=True, seat=1),
        EpisodeRecord(0.0, 1, None, failed=True, seat=0),
    ]
    m = episode_metrics(records, prefix="game/")
    assert m["game/episodes"] == 5
    assert m["game/return_mean"] == pytest.approx(0.1)
    assert m["game/return_std"] == pytest.approx(math.sqrt(sum((x - 0.1) ** 2 for x in [1, -1, 0, 0.5, 0]) / 5))
    assert (m["game/return_min"], m["game/return_max"]) == (-1.0, 1.0)
    assert (m["game/turns_mean"], m["game/turns_max"]) == (3.0, 5.0)
    assert (m["game/win_rate"], m["game/draw_rate"], m["game/loss_rate"]) == (0.2, 0.2, 0.2)
    assert m["game/illegal_action_rate"] == pytest.approx(1 / 15) and m["game/illegal_episode_rate"] == 0.2
    assert (m["game/truncated_rate"], m["game/failure_rate"]) == (0.2, 0.2)
    assert m["game/seat0/episodes"] == 3 and m["game/seat0/win_rate"] == pytest.approx(1 / 3)
    assert m["game/seat1/return_mean"] == pytest.approx(-0.25)
    assert episode_metrics([]) == {"env/episodes": 0}


def test_tracker_accumulates_steps():
    tracker = EpisodeTracker(seat=1)
    tracker.add(StepResult("o", 0.5, False, False, {}))
    tracker.add(StepResult("o", 0.0, False, False, {"illegal": True}))
    tracker.add(StepResult("o", 1.0, True, False, {"outcome": "win"}))
    assert tracker.record == EpisodeRecord(1.5, 3, "win", illegal_actions=1, seat=1)
    assert tracker.finish(-1.0, "loss") == EpisodeRecord(0.5, 3, "loss", illegal_actions=1, seat=1)


class Flaky(TextEnv):
    """Raises on the second step."""

    def reset(self, seed=None, options=None):
        self.t = 0
        return "start", {}

    def step(self, action):
        self.t += 1
        if self.t == 2:
            raise ConnectionError("tool timed out")
        return "next", 1.0, False, False, {}


class Endless(TextEnv):
    def reset(self, seed=None, options=None):
        return "", {}

    def step(self, action):
        return "", 0.25, False, False, {}


def test_play_episode_ends_a_failing_episode_with_the_failure_reward():
    episode = play_episode(Flaky(), lambda obs, info: "a", failure_reward=-3.0)
    assert [t.reward for t in episode.turns] == [1.0, -3.0]
    assert episode.turns[-1].info == {"env_error": "ConnectionError: tool timed out"} and episode.turns[-1].terminated
    record = episode.records[None]
    assert record.failed and record.episode_return == -2.0 and record.turns == 2
    assert episode_metrics([record])["env/failure_rate"] == 1.0


def test_play_episode_truncates_after_max_turns():
    episode = play_episode(Endless(), lambda obs, info: "a", max_turns=4)
    assert len(episode.turns) == 4 and episode.turns[-1].truncated and episode.records[None].truncated
    assert episode.seat_rewards() == [0.25] * 4


def test_per_seat_policies_against_each_other():
    env = TicTacToeEnv(opponent="self")
    moves = {0: iter("123"), 1: iter("45")}
    episode = play_episode(env, {0: lambda o, i: next(moves[0]), 1: lambda o, i: next(moves[1])}, seed=0)
    assert [t.action for t in episode.turns] == ["1", "4", "2", "5", "3"]
    assert episode.final_rewards == {1: -1.0}
    m = episode_metrics(list(episode.records.values()))
    assert m["env/seat0/win_rate"] == 1.0 and m["env/seat1/loss_rate"] == 1.0
