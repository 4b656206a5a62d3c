"""The run tracker: metrics.jsonl rows and TensorBoard events, also across a resume."""

from __future__ import annotations

import pytest

from ppokit.config import load_config
from ppokit.monitoring.track import Tracker
from ppokit.persistence.rundir import read_metrics


def _tb_scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return [(event.step, event.value) for event in acc.Scalars(tag)]


def test_a_resumed_tracker_purges_the_tensorboard_steps_it_logs_again(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = load_config("arith", ["run.progress=false", "run.tensorboard=true"])
    first = Tracker(tmp_path, cfg, 6)
    for it in range(5):  # the killed run got to iteration 4 ...
        first.log(it, {"reward_mean": float(it)})
    first.close()
    resumed = Tracker(tmp_path, cfg, 6, purge_step=3)  # ... but its checkpoint holds 3 iterations
    for it in range(3, 6):
        resumed.log(it, {"reward_mean": 10.0 + it})
    resumed.close()
    assert _tb_scalars(tmp_path, "reward_mean") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [
        0,
        1,
        2,
        3,
        4,
        3,
        4,
        5,
    ]  # jsonl: truncated by resume.truncate_metrics, not here
