"""Fused CPU kernels for a decoder layer's elementwise work (RMSNorm, SwiGLU, rotary), for
its attention (training and scoring passes, and decoding steps), and, on CPUs with AMX,
for LoRA's rank-r products (used by :mod:`ppokit.lm.accel.fused_lora`).

PyTorch's elementwise operations are bound by memory, one pass per operation, and on a
CPU with bf16 matrix units a layer's matmuls run several times faster than in float32, so
in bf16 that elementwise work takes most of a small model's time:
transformers' RMSNorm alone makes six passes over its input forward (casts, square,
mean, scale, weight) and more backward. The kernels in ``cpu_kernels.c`` make one pass
per row instead, with the same bf16 roundings.

The C source is compiled on first use with the system C compiler (``$CC``, else ``cc``,
``gcc`` or ``clang``) into ``kernels/`` of the cache (``$PPOKIT_CACHE``, default ``~/.cache/ppokit``), keyed by
the source, the flags, the compiler and the CPU, and loaded with ``ctypes``: no PyTorch
headers, 7-8 s to build at ``-O3`` on a 2-core AVX2 CPU, once: processes starting together (a
run's Ray workers) wait for the first one's build. Without a compiler, or when the build fails, nothing
changes: every layer keeps transformers' own forward (:func:`cpu_library` returns None
and says why once in the log).

``PPOKIT_CPU_KERNELS`` picks the build (the *level*, :data:`LEVELS`): unset or ``native``,
for this CPU (``-march=native``: AVX-512 and AMX code where the CPU has them, AVX2 and FMA
code on CPUs without AVX-512); ``avx2``, the AVX2 + FMA code even on a CPU with AVX-512
(x86-64 CPUs with AVX2 only); ``generic``, plain C that the compiler vectorizes for the
baseline of the architecture; ``0`` (or ``off``), no kernels. The tests run the kernels at
every level the machine can run, so that each path stays tested on any CPU.

:mod:`ppokit.lm.accel.kernels.functions` wraps them as autograd functions and
:mod:`ppokit.lm.accel.kernels.fuse` puts them into a model's layers.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from ppokit.errors import UserError
from ppokit.output_paths import cache_entry_lock, cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FAST_FLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fopenmp-simd",
    "-fno-math-errno",
    "-fno-trapping-math",
]
PORTABLE_FLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math"]
# x86-64-v3's vector units (AVX2, FMA, F16C) and nothing newer, whatever the CPU
AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math"]
LEVEL_ENV = "PPOKIT_CPU_KERNELS"
OFF_VALUES = ("0", "false", "off", "no")
# level -> the flags tried in turn (native falls back to the portable build)
LEVELS = {"native": [FAST_FLAGS, PORTABLE_FLAGS], "avx2": [AVX2_FLAGS], "generic": [PORTABLE_FLAGS]}

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
KERNEL_ARGS = {
    "rms_norm_forward": [_P, _P, _P, _P, _L, _L, _F],
    "rms_norm_backward": [_P, _P, _P, _P, _P, _L, _L],
    "silu_mul_forward": [_P, _P, _P, _L],
    "silu_mul_backward": [_P, _P, _P, _P, _P, _L],
    "rotary": [_P, _P, _P, _P, _L, _L, _L, _L, _L, _L, _L, _L, _L, _I],
    "decode_attention": [_P, _P, _P, _P, _P, _P] + [_L] * 15 + [_F, _I],
    "attention_forward": [_P] * 7 + [_L] * 17 + [_F, _I],
    "attention_backward": [_P] * 9 + [_L] * 19 + [_F],
}
TYPE_SUFFIXES = ("bf16", "f32")  # each kernel is built for bf16 and for float32
# LoRA's rank-r products on AMX: bf16 only, and stubs in a build without AMX
BF16_KERNEL_ARGS = {
    "lora_down": [_P, _L, _P, _P, _L, _L, _L, _L, _P],
    "lora_up_add": [_P, _L, _P, _P, _L, _L, _L, _L, _F, _P],
    "lora_outer": [_P, _P, _L, _P, _L, _L, _L, _L, _L, _F, _P],
}
SIGNATURES = {f"{name}_{suffix}": args for name, args in KERNEL_ARGS.items() for suffix in TYPE_SUFFIXES}
SIGNATURES.update({f"{name}_bf16": args for name, args in BF16_KERNEL_ARGS.items()})


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    """The CPU's model and feature flags (``-march=native`` builds for exactly these)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


def _compile(compiler: str, flags: list[str], out: Path) -> str | None:
    """Build ``out``; returns None on success, else the compiler's last error line."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *flags, "-shared", "-fPIC", str(SOURCE), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            return lines[-1] if lines else f"exit status {proc.returncode}"
        os.replace(tmp, out)  # atomic: a concurrent process sees the old or the whole file
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(compiler: str, flags: list[str]) -> tuple[Path | None, str]:
    """The built library for ``flags`` (from the cache when present) and, on failure, why."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{compiler} --version failed ({exc})"
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(flags), version, _cpu_signature()]).encode()
    ).hexdigest()[:16]
    for directory in (cache_root(), Path(tempfile.gettempdir()) / "ppokit-cache"):
        out = directory / "kernels" / f"cpu_kernels-{key}.so"
        if out.is_file():
            return out, ""
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            with cache_entry_lock(out):  # processes starting together build it once
                error = None if out.is_file() else _compile(compiler, flags, out)
        except subprocess.SubprocessError as exc:
            return None, str(exc)
        except OSError as exc:  # an unwritable cache directory: try the temporary one
            error = f"{directory}: {exc}"
            continue
        return (out, "") if error is None else (None, error)
    return None, error


def _load(path: Path) -> tuple[ctypes.CDLL | None, str]:
    try:
        lib = ctypes.CDLL(str(path))
        for name, argtypes in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        lib.lora_amx_available.argtypes, lib.lora_amx_available.restype = [], ctypes.c_int
        lib.lora_vector_available.argtypes, lib.lora_vector_available.restype = [], ctypes.c_int
        lib.attention_amx_scratch_floats.argtypes = [ctypes.c_long, ctypes.c_long]
        lib.attention_amx_scratch_floats.restype = ctypes.c_long
        lib.attention_on_amx.argtypes, lib.attention_on_amx.restype = [ctypes.c_long] * 3, ctypes.c_int
        lib.kernels_vector_bits.argtypes, lib.kernels_vector_bits.restype = [], ctypes.c_int
    except (OSError, AttributeError) as exc:  # unloadable, or a stale build without a kernel
        return None, f"loading {path} failed ({exc})"
    return lib, ""


def _build_and_load(compiler: str, level: str = "native") -> tuple[ctypes.CDLL | None, str]:
    errors = []
    for flags in LEVELS[level]:
        path, error = build(compiler, flags)
        if path is not None:
            lib, error = _load(path)
            if lib is None:  # a damaged cache entry: build it once more
                path.unlink(missing_ok=True)
                path, error = build(compiler, flags)
                lib, error = _load(path) if path is not None else (None, error)
            if lib is not None:
                return lib, ""
        errors.append(error)
    return None, "; ".join(errors)


def requested_level() -> str | None:
    """The level ``$PPOKIT_CPU_KERNELS`` asks for: ``native`` (unset), ``avx2``, ``generic``, or
    None (switched off). Any other value is a :class:`~ppokit.errors.UserError`."""
    return _level_of(os.environ.get(LEVEL_ENV, ""))


@cache
def _level_of(raw: str) -> str | None:
    value = raw.strip().lower()
    if value in OFF_VALUES:
        return None
    if value in ("", "1", "true", "on", "yes"):
        return "native"
    if value not in LEVELS:
        raise UserError(
            f"{LEVEL_ENV}={raw!r}: expected one of {', '.join(LEVELS)} (the kernels' build), or 0 to switch them off"
        )
    return value


def cpu_supports_avx2() -> bool:
    """Whether this CPU runs AVX2 and FMA code (Linux: its flags in /proc/cpuinfo)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def cpu_library() -> ctypes.CDLL | None:
    """The loaded kernels at the level ``$PPOKIT_CPU_KERNELS`` asks for, or None (switched off,
    no compiler, the build failed, or a level this CPU cannot run)."""
    level = requested_level()
    return None if level is None else library_at(level)


@cache
def library_at(level: str) -> ctypes.CDLL | None:
    """The kernels built at ``level`` (one of :data:`LEVELS`), or None, saying why once in the log."""
    if level == "avx2" and not cpu_supports_avx2():
        log.warning("fused CPU kernels off: %s=avx2 needs an x86-64 CPU with AVX2 and FMA", LEVEL_ENV)
        return None
    compiler = find_compiler()
    if compiler is None:
        log.info("fused CPU kernels off: no C compiler found (set CC); transformers' layers are used")
        return None
    lib, error = _build_and_load(compiler, level)
    if lib is None:
        log.warning("fused CPU kernels off: building %s failed (%s); transformers' layers are used", SOURCE.name, error)
    return lib
