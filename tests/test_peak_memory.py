"""ppokit.monitoring.peak_memory: the peak memory of a phase (CPU: the resident peak, reset per phase), nested
phases, the fallback without a reset, and the memory metrics of a run."""

from __future__ import annotations

import multiprocessing
import sys

import pytest
import torch

from ppokit.loop import memory_metrics
from ppokit.monitoring import peak_memory
from ppokit.monitoring.peak_memory import PhasePeak, phase_peak

MB = 1e6 / 1e9  # one megabyte in GB


def _touch(megabytes: int) -> torch.Tensor:
    """A tensor of ``megabytes`` whose pages are all resident."""
    t = torch.empty(megabytes * 1_000_000, dtype=torch.uint8)
    t.fill_(1)
    return t


def _resident_gb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024 / 1e9


needs_reset = pytest.mark.skipif(peak_memory.source() != "vm_hwm", reason="needs a resettable VmHWM (Linux)")


def _in_a_fresh_process(measure):
    """``measure()`` in a new interpreter: the resident peak is the whole process's, and a process
    that has run the rest of the suite may keep freed pages resident (its heap, other threads)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure)


def _two_phases() -> tuple[float, float, float]:
    base = _resident_gb()
    with phase_peak() as big:
        t = _touch(300)
        del t  # freed before the phase ends: the peak stays
    with phase_peak() as small:
        t = _touch(20)
        del t
    return base, big.gb, small.gb


@needs_reset
def test_a_phase_sees_its_own_peak_and_the_next_phase_starts_afresh():
    base, big, small = _in_a_fresh_process(_two_phases)
    assert big >= base + 280 * MB, (big, base)
    assert small < big - 200 * MB, (small, big)  # the first phase's peak was reset


def _nested_phases() -> tuple[float, float, float]:
    base = _resident_gb()
    with phase_peak() as outer:
        t = _touch(300)
        del t
        with phase_peak() as inner:
            u = _touch(50)
            del u
        after = _touch(10)
        del after
    return base, outer.gb, inner.gb


@needs_reset
def test_nested_phases_keep_the_outer_peak_from_before_the_inner_phase():
    base, outer, inner = _in_a_fresh_process(_nested_phases)
    assert inner < outer - 200 * MB
    assert outer >= base + 280 * MB  # the inner phase's reset did not lose it
    assert outer >= inner


def test_without_a_reset_each_phase_reports_the_peak_so_far(monkeypatch):
    monkeypatch.setattr(peak_memory, "_resettable", False)
    monkeypatch.setattr(peak_memory, "_cuda", lambda: False)
    assert peak_memory.source() == "ru_maxrss"
    with phase_peak() as first:
        t = _touch(50)
        del t
    with phase_peak() as second:
        pass
    assert first.gb > 0 and second.gb >= first.gb  # never reset: monotone


def test_memory_metrics_name_each_phase_and_the_largest():
    out = memory_metrics(collect=PhasePeak(1.5), score=PhasePeak(0.5), update=PhasePeak(2.25))
    assert out == {
        "memory/peak_gb/collect": 1.5,
        "memory/peak_gb/score": 0.5,
        "memory/peak_gb/update": 2.25,
        "memory/peak_gb": 2.25,
    }


def test_a_control_run_logs_the_memory_of_each_phase(tmp_path):
    from ppokit.cli import main
    from ppokit.persistence.rundir import read_metrics

    args = ["train", "cartpole", "train.total_steps=256", "env.num_envs=2", "env.num_steps=64"]
    args += ["train.mini_batch_size=64", "env.eval_episodes=0"]
    assert main([*args, "--output-dir", str(tmp_path), "--name", "run", "--no-progress", "run.tensorboard=false"]) == 0
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2
    for row in rows:
        phases = [row[f"memory/peak_gb/{p}"] for p in ("collect", "score", "update")]
        assert all(0.01 < gb < 100 for gb in phases), row  # a Python process with torch: tens of MB at least
        assert row["memory/peak_gb"] == max(phases)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap and /proc/self/status")
def test_release_freed_memory_hands_a_fragmented_heaps_free_pages_back():
    """Small blocks freed in the middle of the heap stay resident (glibc trims only its top);
    after release_freed_memory they are not."""
    blocks = [bytearray(16384) for _ in range(16000)]  # 262 MB in heap blocks, below mmap's threshold
    kept = blocks[::100]  # every 100th kept: the heap cannot shrink from its top
    del blocks
    freed = _resident_gb()
    peak_memory.release_freed_memory()
    assert freed - _resident_gb() > 0.15, "the freed blocks stayed resident"
    assert len(kept) == 160


@pytest.mark.parametrize("workload", ["control", "lm"])
def test_a_language_models_evaluations_hand_their_garbage_back_and_a_control_runs_do_not(
    workload, tmp_path, monkeypatch
):
    """After each evaluation of a language model the run releases the heap's free pages (an LM
    evaluation's garbage stayed resident under the next update: 4.56 GB against 3.05 on SmolLM2);
    a control run does not (the full collection cost a CartPole run about 15% of its time to the threshold)."""
    from ppokit import loop
    from ppokit.cli import main

    releases, evaluations = [], []
    monkeypatch.setattr(loop, "release_freed_memory", lambda: releases.append(1))
    evaluate = loop._Loop.evaluate

    def counted(self, phase, done):
        evaluations.append(phase)
        return evaluate(self, phase, done)

    monkeypatch.setattr(loop._Loop, "evaluate", counted)
    if workload == "control":
        args = ["train", "cartpole", "train.total_steps=384", "env.num_envs=2", "env.num_steps=64"]
        args += ["train.mini_batch_size=64", "env.eval_episodes=1", "env.eval_every=1"]
    else:
        args = ["train", "arith", "data.sft_epochs=0", "train.iterations=2", "data.eval_every=1", "data.eval_size=8"]
        args += ["train.batch_size=8", "train.mini_batch_size=8"]
    assert main([*args, "--output-dir", str(tmp_path), "--name", "run", "--no-progress", "run.tensorboard=false"]) == 0
    assert len(evaluations) >= 3  # periodic ones and the final one (and an LM run's before PPO)
    assert len(releases) == (len(evaluations) if workload == "lm" else 0)
