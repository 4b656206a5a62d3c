"""The built-in environments' text through the tiny model's character tokenizer: no <unk>, known lengths."""

import random

import pytest

from ppokit.envs import expert_policy, make_env, play_episode, random_legal_policy
from ppokit.envs.frozenlake import ACTION_WORDS
from ppokit.envs.guess_number import render_guesses
from ppokit.lm.model.tiny import DEFAULT_TINY_SPEC, build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _longest(tokenizer, env, policy, episodes):
    """Most tokens of <bos> + observation + action + <eos> over the turns played; asserts no <unk>."""
    longest = 0
    for seed in range(episodes):
        for turn in play_episode(env, policy, seed=seed).turns:
            ids = tokenizer(turn.observation + turn.action)["input_ids"]
            assert tokenizer.unk_token_id not in ids, (turn.observation, turn.action)
            longest = max(longest, len(ids) + 1)
    return longest


def test_games_fit_the_default_tiny_context(tokenizer):
    context = DEFAULT_TINY_SPEC.max_position_embeddings
    ttt = _longest(tokenizer, make_env("tictactoe", opponent="self"), random_legal_policy(random.Random(0)), 100)
    assert ttt == 25 <= context
    rng = random.Random(0)
    lake = _longest(tokenizer, make_env("frozenlake"), lambda obs, info: rng.choice(ACTION_WORDS), 100)
    assert lake == 53 <= context


def test_guess_and_calculator_lengths(tokenizer):
    guess = make_env("guess")
    assert _longest(tokenizer, guess, expert_policy(guess), 200) <= 84
    worst = len(render_guesses(1, 100, [(99, "higher")] * 6, 1)) + len("100") + 2  # longest lines, 3-digit guess
    assert worst == 84  # 1-100 with 7 guesses: build the tiny model with a context of 96 or more
    small = make_env("guess", low=1, high=30, max_guesses=5)
    assert _longest(tokenizer, small, expert_policy(small), 200) <= DEFAULT_TINY_SPEC.max_position_embeddings
    calc = make_env("calculator")
    assert _longest(tokenizer, calc, expert_policy(calc), 300) <= 140
