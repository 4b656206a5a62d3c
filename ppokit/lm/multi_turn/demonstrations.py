"""The multi-turn warm start: demonstrations played in the run's text environment.

With ``data.sft_epochs`` > 0 a multi-turn run fine-tunes its backbone on turns played by
``textenv.sft_policy`` (:func:`demonstration_examples`, built on
:func:`ppokit.envs.sft.demonstration_records`) before PPO, as the single-turn warm start
does on a task's SFT split (:mod:`ppokit.lm.base_model`). The held-out score is the
legal-action rate (random play) or agreement with the environment's expert.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ppokit.config import Config
from ppokit.envs import checked_reset, expert_policy, random_legal_policy
from ppokit.envs.sft import demonstration_records
from ppokit.errors import UserError
from ppokit.lm.base_model import BASE_MODEL_DIR, BASE_MODEL_MARKER, prepare_model, progress
from ppokit.lm.data.chat import render_records
from ppokit.lm.inputs import chat_render

SFT_EVAL_SEED = 10**12  # held-out demonstration episodes: seeds far from the training ones


def legal_action_reward(prompt: str, response: str, *, legal_actions: list, **_: Any) -> float:
    """1.0 when the response (stripped) is one of the position's legal actions."""
    return float(response.strip() in legal_actions)


def demonstration_examples(env: Any, policy_kind: str, n: int, *, seed: int, name: str) -> list[dict[str, Any]]:
    """``n`` warm-start records ``{"prompt", "completion", "answer", "legal_actions"}`` from episodes
    played with ``policy_kind`` (``random``: uniform over ``info["legal_actions"]``; ``random_wins``:
    the same play, keeping only the turns of seats that won, i.e. demonstrations chosen by the
    environment's outcome alone, rejection sampling; ``expert``: the environment's
    ``expert_action()``), seeds ``seed, seed + 1, ...``: the observation the policy saw, byte for
    byte what a rollout shows, and the action it wrote."""
    if policy_kind in ("random", "random_wins"):
        _, info = checked_reset(env, seed=seed, name=name)
        if not info.get("legal_actions"):
            raise UserError(
                f"textenv.sft_policy={policy_kind} needs an environment that lists info['legal_actions'] "
                f"('{name}' does not); use textenv.sft_policy=expert"
            )
        policy = random_legal_policy(random.Random(seed))
    else:
        try:
            policy = expert_policy(env)
        except TypeError:
            raise UserError(
                f"textenv.sft_policy=expert needs the environment's expert_action() ('{name}' has "
                "none); use textenv.sft_policy=random or data.sft_epochs=0"
            ) from None
    try:
        records = demonstration_records(
            env, policy, turns=n, seed=seed, legal_only=False, winners_only=policy_kind == "random_wins", name=name
        )
    except UserError as exc:
        if "demonstration episodes gave only" not in str(exc):
            raise
        raise UserError(f"{exc}; use textenv.sft_policy=random") from None
    return [
        {
            "prompt": r["prompt"],
            "completion": r["completion"],
            "answer": r["completion"],
            "legal_actions": r["legal_actions"],
        }
        for r in records
    ]


def check_warm_start_mode(cfg: Config, mode: str, env_name: str) -> None:
    """A warm start (data.sft_epochs > 0) plays demonstrations as prompts of their own: an
    environment in message mode is refused, among the pre-start checks."""
    if cfg.data.sft_epochs and mode != "state":
        raise UserError(
            f"environment '{env_name}' has observation_mode={mode!r}; a warm start from "
            "demonstrations needs 'state' observations: set data.sft_epochs=0"
        )


def warm_started_model(cfg: Config, run_dir: Path, env: Any, env_name: str, mode: str) -> Path:
    """The backbone: model.path or the tiny model, warm-started on demonstrations when data.sft_epochs > 0."""
    check_warm_start_mode(cfg, mode, env_name)
    if not cfg.data.sft_epochs:
        return prepare_model(cfg, run_dir, [], None, progress)
    if (run_dir / BASE_MODEL_DIR / BASE_MODEL_MARKER).is_file():  # a resumed run: warm-started already
        return prepare_model(cfg, run_dir, [], None, progress)
    kind = cfg.textenv.sft_policy
    train = demonstration_examples(env, kind, cfg.data.sft_examples, seed=cfg.seed, name=env_name)
    held_out = demonstration_examples(
        env, kind, cfg.textenv.sft_eval_turns, seed=SFT_EVAL_SEED + cfg.seed, name=env_name
    )
    if cfg.data.chat_template:
        held_out = render_records(held_out, chat_render(cfg))
    reward: Callable | str = legal_action_reward if kind != "expert" else "exact_match"
    score = "the legal-action rate" if kind != "expert" else "agreement with the expert"
    progress(
        f"warm start on {len(train)} {kind} demonstration turns of {env_name} (held out: "
        f"{len(held_out)}, scored by {score})"
    )
    return prepare_model(cfg, run_dir, held_out, reward, progress, sft_examples=train)
