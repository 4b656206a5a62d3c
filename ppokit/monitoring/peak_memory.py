"""The peak memory of a phase of an iteration (generate, score, update), for the metrics.

::

    with phase_peak() as peak:
        scorer.score(batch)
    metrics["memory/peak_gb/score"] = peak.gb

What is measured, in GB (10^9 bytes):

- **CUDA** (once the process has used it): the caching allocator's peak of allocated
  memory on the current device, ``torch.cuda.max_memory_allocated`` after
  ``torch.cuda.reset_peak_memory_stats`` at the start of the phase (tensors only: the
  allocator's reserve and the CUDA context come on top).
- **CPU**: the process's resident peak, ``VmHWM`` of ``/proc/self/status``, which writing
  ``5`` to ``/proc/self/clear_refs`` resets to the current resident size (Linux). It counts
  everything resident, the weights and what the allocator keeps from earlier phases
  included. Where it cannot be reset (not Linux, or the write is refused) it is
  ``ru_maxrss``, the process's peak since it started: each phase then reports the peak so
  far (``memory_source`` says which: :func:`source`).

Phases nest: a phase measured inside another (generation inside collection) resets the
counter, so the outer phase's reading merges the peak it had before the inner one began
with the inner phase's peak. Only this process is measured: rollout workers and learner
ranks in other processes report their own (generation measures itself where it runs).

:func:`release_freed_memory` hands the heap's free pages back to the system after a phase
that does not come again (the warm start): glibc keeps them resident otherwise, and every
later phase's resident peak would read the warm start's (4.8 GB of a SmolLM2 warm start
stayed resident through PPO).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import resource
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["PhasePeak", "phase_peak", "release_freed_memory", "source"]

GB = 1e9
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


@dataclass
class PhasePeak:
    """The peak of one phase, filled in when the phase ends (and by phases nested in it)."""

    gb: float = 0.0


_open: list[PhasePeak] = []  # the phases being measured, outermost first
_resettable: bool | None = None  # CPU: whether VmHWM can be reset (found out on first use)


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _vm_hwm_bytes() -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_vm_hwm() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def source() -> str:
    """What :func:`phase_peak` measures here: ``cuda``, ``vm_hwm`` or ``ru_maxrss``."""
    if _cuda():
        return "cuda"
    global _resettable
    if _resettable is None:
        _resettable = _vm_hwm_bytes() is not None and _reset_vm_hwm()
    return "vm_hwm" if _resettable else "ru_maxrss"


def _reset() -> None:
    kind = source()
    if kind == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elif kind == "vm_hwm":
        _reset_vm_hwm()


def _read_gb() -> float:
    kind = source()
    if kind == "cuda":
        return torch.cuda.max_memory_allocated() / GB
    if kind == "vm_hwm":
        value = _vm_hwm_bytes()
        if value is not None:
            return value / GB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024) / GB


@contextlib.contextmanager
def phase_peak() -> Iterator[PhasePeak]:
    """Measure the peak memory of the block into the yielded :class:`PhasePeak` (``.gb``)."""
    peak = PhasePeak()
    if _open:  # the enclosing phase keeps what it reached so far
        _open[-1].gb = max(_open[-1].gb, _read_gb())
    _reset()
    _open.append(peak)
    try:
        yield peak
    finally:
        _open.pop()
        peak.gb = max(peak.gb, _read_gb())
        if _open:
            _open[-1].gb = max(_open[-1].gb, peak.gb)


def release_freed_memory() -> None:
    """Collect garbage and return the C heap's free memory to the system (glibc's
    ``malloc_trim(0)``): the resident size drops to what is in use. A no-op without glibc."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return
    if trim is not None:
        trim(0)
