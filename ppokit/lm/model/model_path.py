"""What a model path names, read without torch: a Hugging Face model directory or a GGUF file (its
converted directory, :mod:`ppokit.lm.model.gguf`) for ``model.path`` and the loaders of
:mod:`ppokit.lm.model.hf` (:func:`local_model_directory`); for ``ppokit generate``, ``chat`` and
``eval``, also a run directory or one of its checkpoints (:func:`open_model_path`). A path that is
none of them is one line before any model code is imported."""

from __future__ import annotations

from pathlib import Path

from ppokit.errors import UserError
from ppokit.lm.model.gguf import model_directory
from ppokit.persistence.rundir import RunDir


def local_model_directory(path: str | Path, what: str = "model.path") -> str | Path:
    """The local directory ``path`` names: ``path`` when it is a directory (:mod:`~ppokit.lm.model.gguf`
    is not asked then), else the converted directory of a GGUF file or a packaged model's name. A
    file that is not GGUF, or nothing at all, is a :class:`UserError` (``what`` names the setting)."""
    directory = path if Path(path).is_dir() else model_directory(path, what)
    if Path(directory).is_file():
        raise UserError(f"{what}={path} is a file, not a model: give a Hugging Face model directory or a .gguf file")
    if not Path(directory).is_dir():
        raise UserError(
            f"{what}={path}: no such model directory (give a local Hugging Face model "
            "directory; ppokit does not download models)"
        )
    return directory


def open_model_path(path: str | Path | RunDir) -> RunDir:
    """The :class:`~ppokit.persistence.rundir.RunDir` of ``path`` (a RunDir is returned as it is)."""
    if not isinstance(path, RunDir):
        path = RunDir(model_directory(path, "the model file"))
    if not path.is_dir:
        raise UserError(
            f"{path.path} is not a directory; give a run directory (ppokit train's), a Hugging Face model "
            "directory or a GGUF file"
        )
    return path
