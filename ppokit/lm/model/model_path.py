"""What a model path given to ``ppokit generate``, ``chat`` or ``eval`` names, read without torch:
a run directory, one of its checkpoints, a Hugging Face model directory, or a GGUF file (its
converted directory, :mod:`ppokit.lm.model.gguf`). A path that is none of them is one line before
any model code is imported."""

from __future__ import annotations

from pathlib import Path

from ppokit.errors import UserError
from ppokit.lm.model.gguf import model_directory
from ppokit.rundir import RunDir


def open_model_path(path: str | Path | RunDir) -> RunDir:
    """The :class:`~ppokit.rundir.RunDir` of ``path`` (a RunDir is returned as it is)."""
    if not isinstance(path, RunDir):
        path = RunDir(model_directory(path, "the model file"))
    if not path.is_dir:
        raise UserError(
            f"{path.path} is not a directory; give a run directory (ppokit train's), a Hugging Face model "
            "directory or a GGUF file"
        )
    return path
