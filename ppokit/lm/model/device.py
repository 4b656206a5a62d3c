"""Where and in which precision a language model runs: ``run.device``, ``run.precision``,
the attention kernel and the number of torch threads.

The one owner of these rules: the PPO run, rollout workers, learner ranks, the supervised
warm start and ``ppokit generate``/``eval`` all ask here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import torch

from ppokit.errors import UserError

SMALL_MODEL_PARAMS = 20_000_000  # CPU: below this, one torch thread unless run.torch_threads says otherwise
PRECISIONS = ("auto", "bf16", "fp32")
log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"run.device={name} but no CUDA device is available; use run.device=cpu")
    return torch.device(name)


def bf16_supported(device: torch.device) -> bool:
    """True where bf16 matmuls run natively (CUDA with bf16, CPU with AVX512-BF16/AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            try:
                flags = Path("/proc/cpuinfo").read_text()
            except OSError:
                return False
            return "avx512_bf16" in flags or "amx_bf16" in flags
    return False


def resolve_precision(name: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype: ``torch.bfloat16`` or None (fp32). ``auto`` = bf16 where supported."""
    if name not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)} (got {name!r})")
    if name == "fp32":
        return None
    if name == "bf16":
        if device.type == "cpu" and not bf16_supported(device):
            warn_emulated_bf16()
            return torch.bfloat16
        if bf16_supported(device):
            return torch.bfloat16
        raise UserError(f"run.precision=bf16 is not supported on {device}; use fp32 or auto")
    return torch.bfloat16 if bf16_supported(device) else None


def precision_name(autocast_dtype: torch.dtype | None) -> str:
    """``"bf16"`` or ``"fp32"``: how an autocast dtype is written in headers and summaries."""
    return "bf16" if autocast_dtype == torch.bfloat16 else "fp32"


def autocast(autocast_dtype: torch.dtype | None, device: torch.device | str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``autocast_dtype`` on ``device``'s type; a no-op for None (fp32)."""
    if autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=autocast_dtype)


def placement(cfg) -> tuple[torch.device, torch.dtype | None]:
    """(device, autocast dtype or None) of a run, from ``run.device`` and ``run.precision``."""
    device = run_device(cfg)
    return device, resolve_precision(cfg.run.precision, device)


def bf16_matmul_slowdown(size: int = 192, repeats: int = 3) -> float:
    """How many times longer a bf16 matmul takes than a float32 one here: the best of
    ``repeats`` timings of a ``size``-cubed product in each (a few tens of milliseconds on a
    CPU without native bf16, where oneDNN emulates it)."""
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size).to(dtype)
        a @ a  # first call: oneDNN's setup
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - start)
        times[dtype] = max(best, 1e-9)
    return times[torch.bfloat16] / times[torch.float32]


@cache
def warn_emulated_bf16() -> None:
    """One warning line per process: bf16 asked for on a CPU without native bf16, the cost
    measured here, and the way back."""
    log.warning(
        "warning: run.precision=bf16 on a CPU without native bf16 (no AVX512-BF16 or AMX): a bf16 matmul "
        "takes %.0fx as long as float32 here (a whole training iteration several times as long); "
        "run.precision=auto (fp32 on this CPU) is faster",
        bf16_matmul_slowdown(),
    )


def attention_implementation(name: str, device: torch.device) -> str | None:
    """``auto``: eager attention on CPU (its backward is faster there than the CPU SDPA
    kernel's at the short lengths a CPU trains), the model's default elsewhere."""
    if name == "auto":
        return "eager" if torch.device(device).type == "cpu" else None
    return name


def available_devices() -> list[str]:
    """The ``run.device`` values this machine can run: auto, cpu, then cuda, cuda:N and mps when present."""
    names = ["auto", "cpu"]
    if torch.cuda.is_available():
        names += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        names.append("mps")
    return names


def run_device(cfg) -> torch.device:
    """``run.device`` as a ``torch.device``; one this machine lacks is a :class:`UserError` naming the choices."""
    name = cfg.run.device
    choices = available_devices()
    if name not in choices:
        raise UserError(f"run.device={name}: no such device on this machine; available: {', '.join(choices)}")
    return resolve_device(name)


def threads_for(model: torch.nn.Module, device: torch.device, requested: int | None = None) -> int | None:
    """torch intra-op threads for ``model``: ``requested`` (``run.torch_threads``) when set, else
    1 on a CPU for a model under :data:`SMALL_MODEL_PARAMS`, else None (torch's default).

    Small matmuls gain little from threads, and more threads than free cores (other
    processes) slow them down many times over.
    """
    if requested:
        return requested
    if device.type == "cpu" and sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
        return 1
    return None


def set_threads(model: torch.nn.Module, device: torch.device, requested: int | None = None) -> None:
    """``torch.set_num_threads`` by :func:`threads_for` (None: torch's count stays)."""
    n = threads_for(model, device, requested)
    if n is not None:
        torch.set_num_threads(n)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)`` (None: unchanged), then restore."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n is not None:
            torch.set_num_threads(before)
