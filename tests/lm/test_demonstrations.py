"""Warm-start demonstrations from text environments (textenv.sft_policy)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from ppokit.envs import make_env
from ppokit.errors import UserError
from ppokit.lm.multi_turn.demonstrations import demonstration_examples

# S H      from S: r falls into the hole (a loss), d reaches F; from F: r reaches the goal
# F G
LAKE = {"desc": ["SH", "FG"], "max_steps": 20, "letters": True}


def moves(records):
    """(player's cell, move) per record: the cell is where 'p' is on the map rows."""
    return Counter(("".join(r["prompt"].splitlines()[:2]).index("p"), r["completion"]) for r in records)


def test_random_wins_keeps_only_the_turns_of_won_episodes():
    env = make_env("frozenlake", **LAKE)
    wins = moves(demonstration_examples(env, "random_wins", 300, seed=0, name="frozenlake"))
    played = moves(demonstration_examples(env, "random", 300, seed=0, name="frozenlake"))
    assert played[(0, "r")] > 0  # random play walks into the hole ...
    assert wins[(0, "r")] == 0  # ... and those episodes are dropped
    assert wins[(2, "r")] > 0 and wins[(0, "d")] > 0  # the winning moves are there
    # every kept episode ends with the winning move, and goes through F once per visit of it
    assert wins[(2, "r")] <= wins[(0, "d")]
    assert {cell for cell, _ in wins} <= {0, 2}


def test_random_wins_with_no_win_in_reach_is_a_one_line_error():
    env = make_env("frozenlake", desc=["SH", "HG"], max_steps=5, letters=True)  # the goal cannot be reached
    with pytest.raises(UserError, match="turns of winning seats; use textenv.sft_policy=random"):
        demonstration_examples(env, "random_wins", 2, seed=0, name="frozenlake")


def test_the_warm_start_scores_textenv_sft_eval_turns_held_out_turns(tiny_dir, tmp_path):
    from ppokit.config import build_config
    from ppokit.lm.multi_turn.demonstrations import warm_started_model
    from ppokit.lm.sft import CURVE_FILE

    cfg = build_config(
        [
            {
                "workload": "lm",
                "model": {"path": str(tiny_dir)},
                "data": {"sft_epochs": 1, "sft_examples": 12, "sft_batch_size": 4},
                "textenv": {"env": "frozenlake", "kwargs": LAKE, "sft_eval_turns": 5},
                "rollout": {"max_new_tokens": 2},
                "run": {"precision": "fp32", "progress": False, "tensorboard": False},
            }
        ]
    )
    base = warm_started_model(cfg, tmp_path, make_env("frozenlake", **LAKE), "frozenlake", "state")
    summary = json.loads((base / CURVE_FILE).read_text())
    assert summary["settings"]["examples"] == 12
    assert summary["settings"]["eval_examples"] == 5  # not the 256 a real model would spend minutes on
