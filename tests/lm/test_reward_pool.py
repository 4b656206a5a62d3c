"""The reward pool: per-sample time limit, errors become reward_on_error and are counted, the
error limit, workers kept across calls and replaced when killed, results in input order."""

from __future__ import annotations

import math

import pytest

from ppokit.errors import UserError
from ppokit.lm.rewards.pool import (
    InProcessScorer,
    RewardPool,
    RewardResults,
    check_error_limit,
    error_limit,
    make_reward_scorer,
)

REWARDS = """
import os, random, time

def length(prompt, response, **fields):
    time.sleep(random.random() * 0.01)          # workers finish out of order
    return float(len(response)) + fields.get("bonus", 0)

def picky(prompt, response, **fields):
    if response == "raise":
        raise ZeroDivisionError("division by zero")
    if response == "hang":
        while True:
            pass
    if response == "sleep":
        time.sleep(3600)
    if response == "exit":
        os._exit(3)
    if response == "nan":
        return float("nan")
    if response == "text":
        return "1.0"
    if response == "why":
        return 0.0, "no final answer"
    return 1.0

def pid(prompt, response, **fields):
    return float(os.getpid())
"""


@pytest.fixture()
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def test_scores_come_back_in_input_order_with_fields(rewards_file):
    responses = ["x" * (i % 7) for i in range(40)]
    fields = [{"bonus": 100 * (i % 2)} for i in range(40)]
    with RewardPool(f"{rewards_file}:length", num_workers=2, timeout=30) as pool:
        results = pool.score(["p"] * 40, responses, fields)
    assert results.scores == [len(r) + f["bonus"] for r, f in zip(responses, fields)]
    assert results.errors == [None] * 40 and results.num_errors == 0


def test_failures_get_reward_on_error_and_are_counted(rewards_file):
    responses = ["ok", "raise", "nan", "ok", "text", "exit", "why", "ok"]
    with RewardPool(
        f"{rewards_file}:picky", num_workers=2, timeout=30, reward_on_error=-1.0, max_reward_errors=None
    ) as pool:
        results = pool.score(["p"] * len(responses), responses)
    assert results.scores == [1.0, -1.0, -1.0, 1.0, -1.0, -1.0, 0.0, 1.0]
    kinds = [e and e[0] for e in results.errors]
    assert kinds == [None, "error", "bad_value", None, "bad_value", "worker_died", None, None]
    assert results.errors[1][1] == "ZeroDivisionError: division by zero"
    assert "returned nan" in results.errors[2][1] and "exit code 3" in results.errors[5][1]
    assert results.notes[6] == "no final answer"
    assert results.error_counts() == {"error": 1, "bad_value": 2, "worker_died": 1}
    metrics = results.metrics()
    assert metrics["reward_errors"] == 4 and metrics["reward_error_frac"] == 0.5
    assert metrics["reward_errors/bad_value"] == 2 and metrics["reward_notes/no final answer"] == 1


def test_a_hung_worker_is_killed_and_replaced_and_the_pool_lives_on(rewards_file):
    with RewardPool(f"{rewards_file}:picky", num_workers=2, timeout=1.0, max_reward_errors=None) as pool:
        before = set(pool.worker_pids())
        results = pool.score(["p"] * 6, ["ok", "hang", "ok", "sleep", "ok", "ok"])
        assert results.scores == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
        assert [e and e[0] for e in results.errors] == [None, "timeout", None, "timeout", None, None]
        assert pool.workers_replaced == 2 and not before & set(pool.worker_pids())
        assert pool.score(["p"] * 3, ["ok"] * 3).scores == [1.0] * 3  # the replacements work
        assert pool.total_errors == 2


def test_workers_are_kept_across_calls(rewards_file):
    with RewardPool(f"{rewards_file}:pid", num_workers=2, timeout=30) as pool:
        pids = set(pool.worker_pids())
        seen = set()
        for _ in range(3):
            seen |= set(pool.score(["p"] * 8, ["r"] * 8).scores)
        assert {int(p) for p in seen} <= pids and set(pool.worker_pids()) == pids
    assert all(w.process.poll() is not None for w in pool._workers)  # closed: all exited


def test_the_error_limit_stops_with_one_line(rewards_file):
    with RewardPool(f"{rewards_file}:picky", num_workers=1, timeout=30, max_reward_errors=1) as pool:
        assert pool.score(["p"] * 3, ["ok", "raise", "ok"]).num_errors == 1  # at the limit: fine
        with pytest.raises(UserError) as info:
            pool.score(["p"] * 4, ["raise", "ok", "raise", "nan"])
    message = str(info.value)
    assert "\n" not in message and "failed on 3 of 4 samples" in message
    assert "(2x, first on sample 0): ZeroDivisionError: division by zero" in message
    assert "data.max_reward_errors" in message


def test_error_limit_is_a_count_or_a_fraction():
    assert error_limit(None, 100) is None
    assert error_limit(3, 100) == 3 and error_limit(0.25, 10) == 2 and error_limit(0, 10) == 0
    failing = RewardResults([0.0] * 4, [("error", "boom")] * 2 + [None] * 2, [None] * 4)
    check_error_limit(failing, 0.5, "f")  # 2 <= 0.5 * 4
    with pytest.raises(UserError, match=r"more than data.max_reward_errors=0.25 of the batch"):
        check_error_limit(failing, 0.25, "f")


def test_bad_specs_fail_before_any_worker_starts(tmp_path):
    with pytest.raises(UserError, match="did you mean 'exact_match'"):
        RewardPool("exact_mach", num_workers=1)
    with pytest.raises(UserError, match="not importable.*module:function"):
        RewardPool(lambda prompt, response: 1.0, num_workers=1)
    plain = tmp_path / "plain.py"
    plain.write_text("def f(prompt, response):\n    return 1.0\n")
    with RewardPool(f"{plain}:f", num_workers=1) as pool:  # a file spec and a module spec both load
        assert pool.score(["p"], ["r"]).scores == [1.0]
    with RewardPool("ppokit.lm.rewards.functions:exact_match", num_workers=1) as pool:
        assert pool.score(["p", "p"], ["2", "3"], [{"answer": "2"}] * 2).scores == [1.0, 0.0]


def test_a_worker_that_cannot_load_the_function_is_a_user_error(tmp_path):
    path = tmp_path / "loads_once.py"
    marker = tmp_path / "loaded"
    # the first import (in the trainer) succeeds; in the worker the file raises
    path.write_text(
        f"import pathlib\nm = pathlib.Path({str(marker)!r})\n"
        "if m.exists():\n    raise RuntimeError('no GPU here')\nm.write_text('x')\n"
        "def f(prompt, response):\n    return 1.0\n"
    )
    with pytest.raises(UserError, match="RuntimeError: no GPU here"):
        RewardPool(f"{path}:f", num_workers=1)


def test_in_process_scorer_has_the_same_results():
    scorer = make_reward_scorer("exact_match", max_reward_errors=None)
    assert isinstance(scorer, InProcessScorer)
    results = scorer.score(["p"] * 3, ["2", "3", "2"], [{"answer": "2"}, {"answer": "2"}, {"other": 1}])
    assert results.scores == [1.0, 0.0, 0.0]
    assert results.errors[2][0] == "error" and "needs the field(s) answer" in results.errors[2][1]
    assert math.isclose(results.metrics()["reward_error_frac"], 1 / 3)
    with pytest.raises(UserError, match="failed on 1 of 3 samples"):
        make_reward_scorer("exact_match", max_reward_errors=0).score(["p"] * 3, ["2"] * 3, [{"answer": "2"}] * 2 + [{}])
    pooled = make_reward_scorer("numeric_match", in_process=False, num_workers=1)
    try:
        assert isinstance(pooled, RewardPool)
        assert pooled.score(["p"], ["so 42"], [{"answer": "42"}]).scores == [1.0]
    finally:
        pooled.close()


def test_loaded_functions_and_importable_callables_reach_the_workers(rewards_file):
    from ppokit.lm.rewards.functions import exact_match, load_reward_fn

    loaded = load_reward_fn(f"{rewards_file}:length")  # as the workload holds it
    with RewardPool(loaded, num_workers=1) as pool:
        assert pool.score(["p"], ["abc"]).scores == [3.0]
    with RewardPool(exact_match, num_workers=1) as pool:  # a module-level function: pickled by name
        assert pool.score(["p"], ["2"], [{"answer": "2"}]).scores == [1.0]
