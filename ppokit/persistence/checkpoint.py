"""Checkpoints: tensors in safetensors, everything else in JSON, written atomically.

A checkpoint is a directory::

    CKPT/
      meta.json              format, version, the run's config, counters, and for each
                             part the JSON skeleton of its state (numbers, strings, lists,
                             dicts) with tensors replaced by {"__tensor__": key}
      <part>.safetensors     the tensors of one part (model, trainer, normalizer, ...)

Nothing is pickled: a state is any nesting of dicts (keys: str or int), lists/tuples,
numbers, strings, None, ``torch.Tensor`` and ``numpy.ndarray`` (arrays come back as
arrays). That covers ``nn.Module.state_dict()``, optimizer and LR-scheduler state and
``torch.Generator`` states.

Sharded tensors (the Adam moments of FSDP learners, :mod:`ppokit.cluster.fsdp`) are written by
the ranks themselves with ``torch.distributed.checkpoint`` into ``CKPT/learner_shards/``:
its Hugging Face storage writes one safetensors file per rank, each chunk's offsets in the
file's JSON header (no ``.metadata`` file, nothing pickled; :func:`save_shards`). The state
holds a marker in their place, ``{"__sharded__": key, "shape": [...], "dtype": "float32"}``:
learners that read their own shards take their slices (any number of ranks, DCP reshards),
any other reader gets whole tensors (:func:`resolve_sharded`).

Writes go to a temporary sibling directory that is renamed into place, so a crash
leaves either the old checkpoint or the new one (files and directory are fsynced);
:func:`~ppokit.persistence.checkpoint_files.recover_interrupted` tidies up the temporary directories
of a killed writer. A missing, truncated or corrupt checkpoint raises
:class:`~ppokit.errors.UserError` naming the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ppokit.errors import UserError
from ppokit.persistence.checkpoint_files import META, atomic_directory, fsync_path, read_json_file

FORMAT = "ppokit-checkpoint"
VERSION = 2  # 2: one checkpoint per run state (parts "learner", "source", ...), both workloads


@dataclass
class Checkpoint:
    """A loaded checkpoint: ``meta`` (the JSON, config included) and ``parts`` (rebuilt states)."""

    path: Path
    meta: dict[str, Any]
    parts: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- flatten
def _flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": prefix}
    if isinstance(obj, np.ndarray):
        tensors[prefix] = torch.from_numpy(np.array(obj, copy=True, order="C"))  # (keeps 0-d arrays 0-d)
        return {"__ndarray__": prefix}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _flatten(v, f"{prefix}.{k}", tensors) for k, v in obj.items()}
        if all(isinstance(k, (str, int)) for k in obj):
            return {"__items__": [[k, _flatten(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
        raise TypeError(f"{prefix}: dict keys must be str or int")
    if isinstance(obj, (list, tuple)):
        return [_flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{prefix}: cannot store a {type(obj).__name__} in a checkpoint (no pickling)")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor], where: Path) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj or "__ndarray__" in obj:
            key = obj.get("__tensor__", obj.get("__ndarray__"))
            if key not in tensors:
                raise UserError(f"checkpoint file {where} is corrupt: tensor '{key}' is missing")
            t = tensors[key]
            return t.numpy() if "__ndarray__" in obj else t
        if "__items__" in obj:
            return {k: _unflatten(v, tensors, where) for k, v in obj["__items__"]}
        return {k: _unflatten(v, tensors, where) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, tensors, where) for v in obj]
    return obj


# ----------------------------------------------------------------------------- save
def save_checkpoint(
    path: Path | str, parts: dict[str, Any], meta: dict[str, Any], files: Callable[[Path], None] | None = None
) -> Path:
    """Write ``parts`` (name -> state) and ``meta`` (JSON-able) atomically to directory ``path``.

    ``files(directory)``, when given, first writes more files into the checkpoint (a
    language model's adapters in Hugging Face format, say); ``meta.json`` comes last, so a
    checkpoint with it is complete.
    """
    with atomic_directory(path) as tmp:
        if files is not None:
            files(tmp)
            for file in tmp.rglob("*"):
                if file.is_file():
                    fsync_path(file)
        skeletons = {}
        for name, state in parts.items():
            tensors: dict[str, torch.Tensor] = {}
            skeletons[name] = _flatten(state, name, tensors)
            save_file(tensors, str(tmp / f"{name}.safetensors"))
            fsync_path(tmp / f"{name}.safetensors")
        body = {"format": FORMAT, "version": VERSION, **meta, "parts": skeletons}
        with open(tmp / META, "w") as f:
            json.dump(body, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


# ----------------------------------------------------------------------------- load
def load_checkpoint(path: Path | str) -> Checkpoint:
    """Read a checkpoint directory; any problem is a one-line :class:`UserError` naming the file."""
    path = Path(path)
    meta_path = path / META
    if not path.is_dir():
        raise UserError(f"checkpoint {path} does not exist (a run writes it when training finishes)")
    if not meta_path.is_file():
        raise UserError(f"checkpoint file {meta_path} is missing")
    meta = read_json_file(meta_path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("parts"), dict):
        raise UserError(f"checkpoint file {meta_path} is not a ppokit checkpoint")
    if isinstance(meta.get("version"), bool) or not isinstance(meta.get("version", 0), int):
        raise UserError(f"checkpoint file {meta_path} is corrupt: version {meta['version']!r} is not a number")
    if meta.get("version", 0) > VERSION:
        raise UserError(
            f"checkpoint file {meta_path} has version {meta['version']}; this ppokit reads "
            f"up to {VERSION}: upgrade ppokit"
        )
    ckpt = Checkpoint(path=path, meta=meta)
    for name, skeleton in meta["parts"].items():
        file = path / f"{name}.safetensors"
        if not file.is_file():
            raise UserError(f"checkpoint file {file} is missing")
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(f"checkpoint file {file} is corrupt or truncated ({reason})") from None
        ckpt.parts[name] = _unflatten(skeleton, tensors, file)
    return ckpt


# ----------------------------------------------------------------------------- sharded tensors
SHARDS_DIR = "learner_shards"
SHARDED = "__sharded__"


def sharded_marker(key: str, tensor: torch.Tensor) -> dict[str, Any]:
    """The JSON that stands for ``tensor`` (a shard of a whole tensor) saved under ``key`` in
    :data:`SHARDS_DIR`: its whole shape and dtype, to read it back whole without a process group."""
    return {SHARDED: key, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}


def is_sharded_marker(obj: Any) -> bool:
    return isinstance(obj, dict) and SHARDED in obj


def save_shards(directory: Path | str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` (key -> ``DTensor`` shard, or a tensor every rank holds) with
    ``torch.distributed.checkpoint``'s Hugging Face storage: a collective, every rank calls it
    with the same keys; each writes its chunks into one safetensors file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    Path(directory).mkdir(parents=True, exist_ok=True)
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True))


def load_shards(directory: Path | str, targets: dict[str, torch.Tensor]) -> None:
    """Fill ``targets`` (key -> tensor or ``DTensor`` of the saved whole shape) in place from the
    files :func:`save_shards` wrote, whatever the number of ranks that wrote them or read them
    (without a process group: whole tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    directory = Path(directory)
    files = f"{directory}/*.safetensors"
    if not directory.is_dir() or not any(directory.glob("*.safetensors")):
        raise UserError(f"checkpoint file {files} is missing (the learners' shards)")
    try:
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(directory)))
    except Exception as exc:  # noqa: BLE001 - DCP wraps every failure (a missing key, a torn file)
        lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
        reason = lines[-1] if lines else type(exc).__name__
        raise UserError(f"checkpoint file {files} is corrupt or does not fit this run ({reason})") from None


def resolve_sharded(state: Any, ckpt_dir: Path | str) -> Any:
    """``state`` with every sharded marker replaced by its whole tensor, read from
    ``ckpt_dir/learner_shards`` (one read for all of them); ``state`` itself when it has none."""
    markers: dict[str, dict[str, Any]] = {}

    def find(obj: Any) -> None:
        if is_sharded_marker(obj):
            markers[obj[SHARDED]] = obj
        elif isinstance(obj, dict):
            for v in obj.values():
                find(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                find(v)

    find(state)
    if not markers:
        return state
    whole = {}
    for key, m in markers.items():
        dtype = getattr(torch, str(m.get("dtype")), None)
        if not isinstance(dtype, torch.dtype) or not isinstance(m.get("shape"), list):
            raise UserError(f"checkpoint {ckpt_dir} is corrupt: the sharded tensor '{key}' has no valid shape or dtype")
        whole[key] = torch.empty(m["shape"], dtype=dtype)
    load_shards(Path(ckpt_dir) / SHARDS_DIR, whole)

    def put(obj: Any) -> Any:
        if is_sharded_marker(obj):
            return whole[obj[SHARDED]]
        if isinstance(obj, dict):
            return {k: put(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(put(v) for v in obj)
        return obj

    return put(state)
