"""Evaluation of a language model: greedy and sampled responses scored by a verifier.

:func:`heldout_accuracy` generates through the run's one generation path
(a rollout engine, :mod:`ppokit.lm.generation.base`; greedy) and scores the responses with the
reward function: the accuracy, for 0/1 verifiers. The PPO run (before, during and after
training) and the supervised warm start measure it so, scoring through the run's reward
pool (:func:`score_texts`).

:func:`find_lm_checkpoint` is the checkpoint a run directory is evaluated from (its
``checkpoint``, the end of training, else the newest periodic checkpoint, or a checkpoint
directory itself); ``ppokit eval`` itself is :mod:`ppokit.commands.evaluate`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ppokit.errors import UserError
from ppokit.lm.rewards.functions import score_responses

POLICY_META = "policy.json"


def score_texts(reward, prompts: Sequence[str], texts: Sequence[str], items: Sequence[dict[str, Any]]):
    """:class:`~ppokit.lm.rewards.pool.RewardResults` of ``texts``: through ``reward.score`` when
    ``reward`` is a scorer (a :class:`~ppokit.lm.rewards.pool.RewardPool`: failures become
    ``reward_on_error`` and are counted), else by calling the function in this process
    (a failure is a :class:`UserError`)."""
    from ppokit.lm.rewards.pool import RewardResults

    if hasattr(reward, "score"):
        return reward.score(list(prompts), list(texts), list(items))
    scores = score_responses(reward, list(prompts), list(texts), list(items))
    return RewardResults(scores, [None] * len(scores), [None] * len(scores))


def heldout_results(engine, items: Sequence[dict[str, Any]], reward, *, max_new_tokens: int | None = None):
    """``(rollout, RewardResults)`` of ``engine``'s greedy responses to ``items`` (prompt records
    whose other fields go to the reward; ``reward``: a scorer or a function, :func:`score_texts`)."""
    if not items:
        raise UserError("the evaluation set is empty")
    prompts = [it["prompt"] for it in items]
    rollout = engine.generate(prompts, greedy=True, max_new_tokens=max_new_tokens, items=list(items))
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


def is_lm_checkpoint(path: Path) -> bool:
    return (path / POLICY_META).is_file()


def find_lm_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``ppokit eval`` reads for ``run_dir`` (None: not a language-model run)."""
    from ppokit.rundir import FINAL_DIR, latest_checkpoint

    if is_lm_checkpoint(run_dir):
        return run_dir
    if is_lm_checkpoint(run_dir / FINAL_DIR):
        return run_dir / FINAL_DIR
    found = latest_checkpoint(run_dir)
    return found if found is not None and is_lm_checkpoint(found) else None


def _config_of(ckpt: Path):
    """The run's config, from the checkpoint's meta.json or the run directory's config.yaml."""
    import json

    from ppokit.config import build_config, read_yaml
    from ppokit.rundir import CONFIG_FILE, META

    saved = None
    for meta in (ckpt / META, ckpt / "trainer" / META):  # (trainer/: checkpoints before the run loop)
        if meta.is_file():
            try:
                saved = json.loads(meta.read_text()).get("config")
            except (OSError, ValueError, AttributeError):
                raise UserError(f"checkpoint file {meta} is corrupt or truncated") from None
            break
    if not isinstance(saved, dict):
        for candidate in (ckpt / CONFIG_FILE, ckpt.parent / CONFIG_FILE, ckpt.parent.parent / CONFIG_FILE):
            if candidate.is_file():
                saved = read_yaml(candidate)
                break
    if not isinstance(saved, dict):
        raise UserError(f"{ckpt}: no config found (neither {ckpt / META} nor the run's config.yaml)")
    return build_config([saved])  # an invalid config is a one-line ConfigError
