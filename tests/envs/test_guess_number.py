"""Guess the number: feedback, limits, illegal guesses, bisection."""

import math

import pytest

from ppokit.envs import evaluate_policy, expert_policy
from ppokit.envs.guess_number import GuessNumberEnv, parse_guess
from ppokit.lm.model.tiny import DEFAULT_ALPHABET


def test_observation_format_and_feedback():
    env = GuessNumberEnv()
    obs, info = env.reset(seed=0)
    assert obs == "guess 1-100\n7 left:" and info == {}
    env.secret = 30
    obs, reward, terminated, truncated, info = env.step("50")
    assert obs == "guess 1-100\n50 lower\n6 left:" and (reward, terminated, truncated) == (0.0, False, False)
    obs, *_ = env.step("i guess 25")
    assert obs == "guess 1-100\n50 lower\n25 higher\n5 left:"
    obs, reward, terminated, truncated, info = env.step("30")
    assert (reward, terminated, info["outcome"], info["action"]) == (1.0, True, "win", "30")
    assert set(obs) <= set(DEFAULT_ALPHABET)


def test_running_out_of_guesses_is_a_loss():
    env = GuessNumberEnv(low=1, high=10, max_guesses=2, loss_reward=-1.0, guess_reward=-0.1)
    env.reset(seed=0)
    env.secret = 7
    assert env.step("1")[1:4] == (pytest.approx(-0.1), False, False)
    obs, reward, terminated, truncated, info = env.step("2")
    assert (terminated, truncated, info["outcome"]) == (True, False, "loss") and reward == pytest.approx(-1.1)


@pytest.mark.parametrize(
    "action,reason", [("none", "no number found"), ("101", "101 is outside 1-100"), ("-3", "-3 is outside 1-100")]
)
def test_illegal_guesses(action, reason):
    env = GuessNumberEnv(illegal_penalty=-2.0)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(action)
    assert (reward, terminated, info["illegal"], info["illegal_reason"]) == (-2.0, True, True, reason)


def test_parse_guess():
    assert parse_guess("37") == 37 and parse_guess("maybe 12 or 13") == 12 and parse_guess("x") is None


@pytest.mark.parametrize("low,high", [(1, 100), (1, 16), (5, 9)])
def test_bisection_finds_every_secret_within_the_bound(low, high):
    bound = math.ceil(math.log2(high - low + 2))
    env = GuessNumberEnv(low=low, high=high, max_guesses=bound)
    for secret in range(low, high + 1):
        env.reset(seed=0)
        env.secret = secret
        for _ in range(bound):
            _, reward, terminated, _, info = env.step(env.expert_action())
            if terminated:
                break
        assert info["outcome"] == "win", secret


def test_secret_is_uniform_and_deterministic_given_the_seed():
    env = GuessNumberEnv(low=1, high=4)
    secrets = []
    for seed in range(4000):
        env.reset(seed=seed)
        secrets.append(env.secret)
    env.reset(seed=17)
    assert env.secret == secrets[17]
    for v in range(1, 5):
        assert secrets.count(v) / 4000 == pytest.approx(0.25, abs=0.03)


def test_expert_wins_every_episode_of_the_default_game():
    env = GuessNumberEnv()
    metrics = evaluate_policy(env, expert_policy(env), episodes=300, seed=0)
    assert metrics["env/win_rate"] == 1.0 and metrics["env/turns_max"] <= 7
    assert 5.0 < metrics["env/turns_mean"] < 6.5  # bisection over 100 numbers: 5.8 guesses on average


def test_bad_arguments():
    with pytest.raises(Exception, match="need 0 <= low < high"):
        GuessNumberEnv(low=5, high=5)
    with pytest.raises(Exception, match="low must be an int"):
        GuessNumberEnv(low=1.5)
