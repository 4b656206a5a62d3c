"""Early stopping on periodic evaluations (ppokit.monitoring.stopping): the target, the patience, resume."""

from __future__ import annotations

import pytest

from ppokit.monitoring.stopping import EarlyStop


def decisions(stop: EarlyStop, scores):
    return [stop.update(s) for s in scores]


def test_the_target_stops_at_the_first_evaluation_that_reaches_it():
    stop = EarlyStop("held-out accuracy", 0.8, "data.stop_at_accuracy")
    got = decisions(stop, [0.3, 0.79, 0.8, 0.9])
    assert got[:2] == [None, None]
    assert got[2] == "held-out accuracy 80.0% >= data.stop_at_accuracy=0.8"


def test_patience_counts_evaluations_without_a_new_best():
    stop = EarlyStop("held-out accuracy", patience=2)
    # 0.5 is the best; 0.5 again is no improvement, 0.45 neither: two in a row
    got = decisions(stop, [0.3, 0.5, 0.5, 0.45, 0.9])
    assert got[:3] == [None, None, None]
    assert got[3] == "held-out accuracy has not improved on its best (50.0%) in 2 evaluations (train.eval_patience=2)"


def test_a_new_best_resets_the_patience():
    stop = EarlyStop("win rate vs random", patience=2)
    assert decisions(stop, [0.5, 0.4, 0.6, 0.55, 0.7, 0.65]) == [None] * 6
    assert stop.best == 0.7 and stop.since_best == 1


def test_no_rule_never_stops_and_a_missing_score_changes_nothing():
    assert decisions(EarlyStop("x"), [0.1, 0.0, 1.0, 0.0, 0.0]) == [None] * 5
    stop = EarlyStop("x", 0.5, "t", patience=1)
    assert stop.update(None) is None and stop.best is None and stop.since_best == 0


def test_returns_are_formatted_as_numbers():
    stop = EarlyStop("periodic eval return", 490, "env.stop_at_return", fmt="{:.1f}")
    assert stop.update(500.0) == "periodic eval return 500.0 >= env.stop_at_return=490"


@pytest.mark.parametrize("cut", range(6))
def test_a_resumed_rule_decides_what_the_uninterrupted_one_does(cut):
    scores = [0.2, 0.4, 0.35, 0.41, 0.41, 0.3, 0.2]
    whole = decisions(EarlyStop("acc", 0.95, "t", patience=3), scores)
    first = EarlyStop("acc", 0.95, "t", patience=3)
    head = decisions(first, scores[:cut])
    resumed = EarlyStop("acc", 0.95, "t", patience=3)
    resumed.load_state_dict(first.state_dict())
    assert head + decisions(resumed, scores[cut:]) == whole
    assert [i for i, r in enumerate(whole) if r] == [6]  # the best, 0.41 at index 3; 0.41, 0.3, 0.2 do not beat it
