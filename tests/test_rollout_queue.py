"""k-step-off rollouts (``rollout.off_policy_steps`` = k): the queue and the run loop's schedule.

With the queue full the batch trained at iteration i was sampled by the weights of version
i - min(i, k) (``staleness`` = min(i, k)); the rollouts queued at a checkpoint are part of
it, so a resumed run trains on the batches the uninterrupted run does. The workloads' own
sources (in-process and on Ray workers) are tested in tests/cluster/test_cluster_pipelining.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ppokit.components import Batch, Components, RolloutQueue
from ppokit.config import load_config
from ppokit.errors import ConfigError
from ppokit.loop import run
from ppokit.persistence.checkpoint import load_checkpoint
from ppokit.persistence.rundir import periodic_checkpoint_path, read_metrics


def batch(iteration: int, version: int) -> Batch:
    """A one-sample batch that says which iteration it is and which weights sampled it."""
    return Batch(
        tensors={"mask": torch.ones(1, 1), "sampled": torch.tensor([[float(iteration)]])},
        metrics={"sampled_iteration": float(iteration)},
        policy_version=version,
    )


# ----------------------------------------------------------------------------- the queue
def test_queue_holds_consecutive_iterations_and_round_trips():
    queue = RolloutQueue()
    assert queue.state_dict() is None and queue.pop(0) is None
    for i in (3, 4, 5):
        queue.put(i, batch(i, i - 2))
    with pytest.raises(RuntimeError, match="not consecutive"):
        queue.put(7, batch(7, 5))
    state = queue.state_dict()
    assert state["iteration"] == 3 and len(state["batches"]) == 3
    again = RolloutQueue()
    again.load_state_dict(state)
    assert list(again.batches) == [3, 4, 5]
    assert [b.policy_version for b in again.batches.values()] == [1, 2, 3]
    assert again.pop(3).metrics == {"sampled_iteration": 3.0} and 3 not in again and len(again) == 2


def test_queue_reads_the_one_batch_layout_of_earlier_checkpoints():
    queue = RolloutQueue()
    queue.load_state_dict({"iteration": 4, "batch": batch(4, 3).state_dict()})
    assert list(queue.batches) == [4] and queue.pop(4).policy_version == 3


def test_off_policy_steps_is_bounded():
    assert load_config("cartpole", ["rollout.off_policy_steps=8"]).rollout.off_policy_steps == 8
    with pytest.raises(ConfigError, match=r"rollout.off_policy_steps.*less than or equal to 8"):
        load_config("cartpole", ["rollout.off_policy_steps=9"])


# ----------------------------------------------------------------------------- the loop
class QueueSource:
    """An in-process source whose batches record the iteration and the weights' version."""

    steps_per_iteration = None

    def __init__(self) -> None:
        self.version = 0
        self.queue = RolloutQueue()
        self.started: list[tuple[int, int]] = []  # (iteration, version) in the order sampled

    def _sample(self, iteration: int) -> Batch:
        self.started.append((iteration, self.version))
        return batch(iteration, self.version)

    def collect(self, iteration: int) -> Batch:
        queued = self.queue.pop(iteration)
        return queued if queued is not None else self._sample(iteration)

    def prefetch(self, iteration: int) -> None:
        if iteration not in self.queue:
            self.queue.put(iteration, self._sample(iteration))

    def sync_weights(self, learner) -> None:
        self.version = learner.policy_version

    def state_dict(self) -> dict:
        queued = self.queue.state_dict()
        return {} if queued is None else {"pending": queued}

    def load_state_dict(self, state: dict) -> list[str]:
        self.queue.load_state_dict(state.get("pending"))
        return []


class CountingLearner:
    """Each update adds the trained batch's iteration to ``weight`` (so the weights depend on
    the order of the batches) and bumps the version."""

    reads_shards = False

    def __init__(self) -> None:
        self.policy_version = 0
        self.weight = 0.0

    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        assert int(batch.tensors["sampled"]) == iteration, "trained on another iteration's batch"
        self.weight = self.weight * 2 + float(batch.tensors["sampled"])
        self.policy_version += 1
        return {"weight": self.weight}

    def rollout_weights(self) -> dict:
        return {}

    def weights_finite(self) -> bool:
        return True

    def state_dict(self) -> dict:
        return {"version": self.policy_version, "weight": self.weight}

    def save_files(self, directory: Path) -> None:
        pass

    def load_state_dict(self, state: dict, directory: Path | None) -> None:
        self.policy_version, self.weight = int(state["version"]), float(state["weight"])


class QueueWorkload:
    name = "queue-test"

    def __init__(self) -> None:
        self.sources: list[QueueSource] = []

    def check_checkpoint(self, meta, path) -> None:
        pass

    def build(self, run_dir: Path) -> Components:
        self.sources.append(QueueSource())

        def no_advantages(cfg, b):
            return torch.zeros(1, 1), torch.zeros(1, 1)

        return Components(source=self.sources[-1], learner=CountingLearner(), advantages=no_advantages)


def queue_cfg(k: int, *extra: str):
    return load_config(
        "cartpole",
        [f"rollout.off_policy_steps={k}", "train.iterations=7", "run.progress=false", "run.tensorboard=false", *extra],
    )


@pytest.mark.parametrize("k", [0, 1, 2, 3, 8])
def test_each_batch_is_sampled_min_of_iteration_and_k_versions_back(tmp_path, k):
    workload = QueueWorkload()
    run(workload, queue_cfg(k), tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["sampled_iteration"] for r in rows] == list(range(7))
    # each iteration sampled once, in order, by the weights of version i - min(i, k)
    assert workload.sources[0].started == [(i, i - min(i, k)) for i in range(7)]
    if k:
        assert [r["policy_version"] for r in rows] == [i - min(i, k) for i in range(7)]
        assert [r["staleness"] for r in rows] == [min(i, k) for i in range(7)]
    else:
        assert "staleness" not in rows[0] and "policy_version" not in rows[0]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_queue_is_checkpointed_and_the_resumed_run_is_the_same(tmp_path, k):
    cfg = queue_cfg(k, "run.checkpoint_every=3")
    whole = QueueWorkload()
    run(whole, cfg, tmp_path / "whole")
    want = read_metrics(tmp_path / "whole")
    saved = load_checkpoint(periodic_checkpoint_path(tmp_path / "whole", 3))
    pending = saved.parts["source"]["pending"]
    # after iteration 2: iterations 3 .. 2 + k queued, each sampled k versions back
    assert pending["iteration"] == 3 and len(pending["batches"]) == k
    assert [b["policy_version"] for b in pending["batches"]] == [3 + j - k for j in range(k)]
    resumed = QueueWorkload()
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint")
    run(resumed, cfg, tmp_path / "resumed", resume_from=periodic_checkpoint_path(tmp_path / "resumed", 3))
    got = read_metrics(tmp_path / "resumed")
    keys = ("sampled_iteration", "policy_version", "staleness", "weight")
    assert [[r[x] for x in keys] for r in got] == [[r[x] for x in keys] for r in want]
    # the resumed run samples only what the checkpoint did not hold, with the same weights
    assert resumed.sources[0].started == [(i, i - k) for i in range(3 + k, 7)]
