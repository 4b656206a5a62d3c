"""Exact resume, graceful interruption and the divergence guard: the pieces the run loop
(:mod:`ppokit.loop`) uses for every workload.

- :func:`capture_rng` / :func:`restore_rng`: Python ``random``, the numpy global RNG,
  the torch CPU (and initialized CUDA) RNG, plus any ``torch.Generator`` or
  ``np.random.Generator`` the run owns, as checkpoint-storable data (JSON + tensors,
  nothing pickled).
- :func:`rollout_rngs`: every global RNG seeded from (seed, iteration, shard) for one
  rollout, the caller's RNGs untouched: with ``rollout.off_policy_steps`` >= 1 rollouts
  run ahead of the update (and in another process), so their draws cannot follow the
  run's one stream; seeded per iteration they are the same in-process and on Ray
  workers, and again after a resume.
- :class:`GracefulStop`: the first SIGINT/SIGTERM only sets a flag, so the loop ends
  the iteration, saves a checkpoint and exits 130/143 with a resume hint
  (:class:`~ppokit.errors.Interrupted`); a second signal stops at once
  (``KeyboardInterrupt``; the last checkpoint on disk is intact).
- :class:`BadStepGuard`: counts consecutive skipped (non-finite) optimizer steps and
  raises :class:`~ppokit.errors.TrainingDiverged` after ``train.max_bad_steps``.
"""

from __future__ import annotations

import contextlib
import random
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppokit.errors import Interrupted, SetUpInterrupted, TrainingDiverged
from ppokit.persistence.signals import STOP_SIGNALS, handlers_restored

__all__ = [
    "DRAW_STREAM",
    "BadStepGuard",
    "GracefulStop",
    "Interrupted",
    "TrainingDiverged",
    "all_finite",
    "capture_rng",
    "generator_state",
    "restore_rng",
    "rollout_rngs",
    "rollout_seed",
    "set_generator_state",
]


# ----------------------------------------------------------------------------- RNG
def _tag_arrays(obj: Any) -> Any:
    """numpy arrays inside an RNG state -> ``{"__array__": dtype, "data": list}`` (JSON, exact)."""
    if isinstance(obj, np.ndarray):
        return {"__array__": obj.dtype.str, "data": obj.tolist()}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _tag_arrays(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tag_arrays(v) for v in obj]
    return obj


def _untag_arrays(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__array__" in obj:
            return np.array(obj["data"], dtype=np.dtype(obj["__array__"]))
        return {k: _untag_arrays(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_untag_arrays(v) for v in obj]
    return obj


def generator_state(gen: Any) -> Any:
    """The state of a ``torch.Generator`` (uint8 tensor) or ``np.random.Generator`` (dict)."""
    if isinstance(gen, torch.Generator):
        return gen.get_state()
    if isinstance(gen, np.random.Generator):
        return _tag_arrays(gen.bit_generator.state)
    raise TypeError(f"not a random generator: {type(gen).__name__}")


def set_generator_state(gen: Any, state: Any) -> None:
    """Inverse of :func:`generator_state`."""
    if isinstance(gen, torch.Generator):
        gen.set_state(state)
    elif isinstance(gen, np.random.Generator):
        gen.bit_generator.state = _untag_arrays(state)
    else:
        raise TypeError(f"not a random generator: {type(gen).__name__}")


def seed_globals(seed: int) -> None:
    """Seed every global RNG a model build, a reward function or a sampler may draw from
    (Python's, NumPy's and torch's; all of them are checkpointed by :func:`capture_rng`)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def own_random_stream(seed: int) -> Iterator[None]:
    """Inside the block torch's global generators (CPU, and CUDA's once in use) start from ``seed``;
    after it they are as before: an evaluation that samples takes no numbers from the run's stream
    and draws the same ones each time."""
    in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if in_use else []):
        torch.manual_seed(seed)
        yield


def capture_rng(generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every RNG state a run depends on, as checkpoint-storable data (see :mod:`ppokit.persistence.checkpoint`).

    ``generators``: the run's own ``torch.Generator`` / ``np.random.Generator`` objects by name.
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": _tag_arrays(np.random.get_state(legacy=False)),
        "torch": torch.get_rng_state(),
        "generators": {name: generator_state(gen) for name, gen in (generators or {}).items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: Mapping[str, Any], generators: Mapping[str, Any] | None = None) -> None:
    """Set the RNGs captured by :func:`capture_rng` (a generator missing from the state is an error)."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
    np.random.set_state(_untag_arrays(state["numpy"]))
    torch.set_rng_state(_as_byte_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = [_as_byte_tensor(s) for s in state["cuda"]]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
    saved_gens = state.get("generators", {})
    for name, gen in (generators or {}).items():
        if name not in saved_gens:
            raise ValueError(f"the checkpoint has no state for the random generator '{name}'")
        set_generator_state(gen, saved_gens[name])


# The ``shard`` offset of an iteration's further generation batches (rollout.dynamic_sampling
# draws more prompts): batch d of shard s is seeded with shard s + d * DRAW_STREAM.
DRAW_STREAM = 2**20


def rollout_seed(seed: int, iteration: int, shard: int = 0) -> int:
    """A 63-bit seed for the rollout of ``iteration`` on ``shard`` (numpy's SeedSequence
    hashes the three numbers: nearby inputs give unrelated seeds)."""
    words = np.random.SeedSequence([seed, iteration, shard]).generate_state(2, np.uint32)
    return (int(words[0]) << 31 | int(words[1]) >> 1) & (2**63 - 1)


@contextlib.contextmanager
def rollout_rngs(seed: int, iteration: int, shard: int = 0) -> Iterator[None]:
    """Python ``random``, numpy's and torch's global RNGs (CUDA's too) seeded with
    :func:`rollout_seed` inside the block; the states from before come back after it."""
    saved = capture_rng()
    value = rollout_seed(seed, iteration, shard)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)
    try:
        yield
    finally:
        restore_rng(saved)


def _as_byte_tensor(x: Any):
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.uint8)


# ----------------------------------------------------------------------------- signals
class GracefulStop:
    """Context manager for a run's SIGINT/SIGTERM, set up and iterations alike.

    ``signum`` records the first signal. While the run is set up (model load, warm start, the
    evaluation before PPO) nothing can be saved yet and a signal stops it at once: the handler
    raises :class:`~ppokit.errors.SetUpInterrupted` where the process is (what the set-up writes
    is made atomically and built again on a restart), which the loop turns into
    :meth:`set_up_interrupted`. Once
    the iterations start (:meth:`defer`) the first signal only sets ``requested`` (printing from
    a signal handler can collide with a write in progress): the loop checks it once per
    iteration, saves a checkpoint and raises :meth:`interrupted`; a second signal raises
    ``KeyboardInterrupt`` at once. Outside the main thread (where handlers cannot be installed)
    it does nothing. The previous handlers come back on exit.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferred = False  # False while the run is set up: a signal stops it at once
        self._handlers = contextlib.ExitStack()
        self._installed = False  # False outside the main thread, where no handler can be installed

    def defer(self) -> None:
        """From now on the first signal only asks for a stop at the next safe point. The handlers
        are installed again: the set-up may have replaced them (``ray.init`` installs Ray's own
        SIGTERM handler, which aborts the process)."""
        self.deferred = True
        if self._installed:
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.deferred:
            self.signum = self.signum or signum
            raise SetUpInterrupted(signum)
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> GracefulStop:
        self._installed = self._handlers.enter_context(handlers_restored(install=self._handle))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handlers.close()
        self._installed = False

    def interrupted(self, checkpoint_path: Path | str, run_dir: Path | str) -> Interrupted:
        """The exception to raise after the interruption checkpoint is on disk (exit 128 + signum)."""
        return Interrupted(
            f"interrupted: checkpoint saved at {checkpoint_path}; resume with: ppokit train --resume {run_dir}",
            exit_code=128 + int(self.signum or signal.SIGINT),
        )

    def set_up_interrupted(
        self, run_dir: Path, config_file: Path, resumed_from: Path | None, signum: int
    ) -> Interrupted:
        """The exception for signal ``signum`` while the run was set up (exit 128 + signum): nothing new was
        saved; how to go on (``config_file``: the run's saved config, which a restart in the same
        directory reads; it reuses what the set-up finished, such as an LM run's warm start)."""
        if resumed_from is not None:
            then = f"{resumed_from} is still the newest checkpoint; resume with: ppokit train --resume {run_dir}"
        elif config_file.is_file():
            then = f"start it again with: ppokit train {config_file} run.resume=auto"
        else:
            then = "start it again"
        return Interrupted(
            f"interrupted while the run was set up, before its first iteration: {then}",
            exit_code=128 + signum,
        )


# ----------------------------------------------------------------------------- divergence
class BadStepGuard:
    """Counts consecutive bad (skipped, non-finite) optimizer steps.

    ``step(ok)`` after every optimizer step; after ``limit`` bad steps in a row it raises
    :class:`TrainingDiverged` (``limit=0``: never). The run loop adds where the last good
    checkpoint is (:func:`ppokit.loop.diverged_message`). The guard is
    part of the trainer's state (``state_dict``), so a streak survives a resume.
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.streak = 0
        self.total = 0

    def step(self, ok: bool) -> None:
        if ok:
            self.streak = 0
            return
        self.streak += 1
        self.total += 1
        if self.limit and self.streak >= self.limit:
            raise TrainingDiverged(
                f"training diverged: {self.streak} optimizer steps in a row had a non-finite "
                f"loss or gradient (train.max_bad_steps={self.limit})"
            )

    def state_dict(self) -> dict[str, int]:
        return {"streak": self.streak, "total": self.total}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.streak = int(state.get("streak", 0))
        self.total = int(state.get("total", 0))


def all_finite(tensors: Any) -> bool:
    """True when every tensor in ``tensors`` (an iterable) holds only finite values."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)
