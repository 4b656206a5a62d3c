"""Evaluation of a language model: greedy and sampled responses scored by a verifier.

:func:`heldout_accuracy` generates through the run's one generation path
(a rollout engine, :mod:`ppokit.lm.generation.base`; greedy) and scores the responses with the
reward function: the accuracy, for 0/1 verifiers. The PPO run (before, during and after
training) and the supervised warm start measure it so, scoring through the run's reward
pool (:func:`score_texts`).
``ppokit eval`` itself is :mod:`ppokit.commands.evaluate`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ppokit.errors import UserError
from ppokit.lm.rewards.functions import score_responses
from ppokit.lm.rewards.pool import RewardResults


def score_texts(reward, prompts: Sequence[str], texts: Sequence[str], items: Sequence[dict[str, Any]]):
    """:class:`~ppokit.lm.rewards.pool.RewardResults` of ``texts``: through ``reward.score`` when
    ``reward`` is a scorer (a :class:`~ppokit.lm.rewards.pool.RewardPool`: failures become
    ``reward_on_error`` and are counted), else by calling the function in this process
    (a failure is a :class:`UserError`)."""
    if hasattr(reward, "score"):
        return reward.score(list(prompts), list(texts), list(items))
    scores = score_responses(reward, list(prompts), list(texts), list(items))
    return RewardResults(scores, [None] * len(scores), [None] * len(scores))


def heldout_results(
    engine, items: Sequence[dict[str, Any]], reward, *, max_new_tokens: int | None = None, greedy: bool = True
):
    """``(rollout, RewardResults)`` of ``engine``'s greedy responses to ``items`` (prompt records
    whose other fields go to the reward; ``reward``: a scorer or a function, :func:`score_texts`);
    ``greedy=False``: one response sampled for each, as the engine samples rollouts."""
    if not items:
        raise UserError("the evaluation set is empty")
    prompts = [it["prompt"] for it in items]
    rollout = engine.generate(prompts, greedy=greedy, max_new_tokens=max_new_tokens, items=list(items))
    return rollout, score_texts(reward, prompts, rollout.texts, items)


def heldout_accuracy(
    engine,
    items: Sequence[dict[str, Any]],
    reward_fn: str | Callable[..., float],
    *,
    max_new_tokens: int | None = None,
    return_responses: bool = False,
):
    """Mean reward of ``engine``'s greedy responses to ``items`` (prompt records whose other
    fields go to the reward; ``reward_fn``: a function or a scorer, :func:`score_texts`). With
    ``return_responses``: ``(accuracy, responses, rewards)``."""
    rollout, results = heldout_results(engine, items, reward_fn, max_new_tokens=max_new_tokens)
    rewards = results.scores
    accuracy = sum(rewards) / len(rewards)
    return (accuracy, rollout.texts, rewards) if return_responses else accuracy
