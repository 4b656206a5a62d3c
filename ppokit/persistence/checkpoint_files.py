"""A checkpoint directory's files, without torch: its completion marker, atomic directory writes,
and the recovery of a killed writer's leftovers.

A directory is written into a temporary sibling ``.NAME.tmp-PID`` that is renamed into place
(the previous one moved aside to ``.NAME.old-PID`` meanwhile); files and directories are
fsynced. Readers of a run directory (:mod:`ppokit.persistence.rundir`) need only this module, so that
commands answer bad input before importing torch; :mod:`ppokit.persistence.checkpoint` writes tensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ppokit.errors import UserError

META = "meta.json"  # a checkpoint's metadata, written last: its presence marks the checkpoint complete


def read_json_file(path: Path) -> Any:
    """A checkpoint's JSON file, parsed; one that does not parse is a one-line :class:`UserError` naming it."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"checkpoint file {path} is corrupt or truncated ({type(exc).__name__})") from None


@contextlib.contextmanager
def atomic_directory(path: Path | str) -> Iterator[Path]:
    """Write a directory atomically: fill the yielded temporary sibling, which then replaces ``path``.

    Files written into it should already be fsynced; the rename and the parent directory are
    fsynced here. On any error (a kill included) the temporary directory goes and ``path``
    keeps its previous contents; leftovers of a killed process are handled by
    :func:`recover_interrupted`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        fsync_path(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            old.rename(path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def fsync_path(path: Path) -> None:
    """Flush a file or directory to disk (best effort: not every file system allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (``os.kill(pid, 0)``; one we may not signal counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def recover_interrupted(directory: Path | str) -> None:
    """Clean up after a writer killed inside :func:`save_checkpoint` (call before reading).

    ``.NAME.tmp-PID`` (an unfinished new checkpoint) is removed; ``.NAME.old-PID`` (the
    previous checkpoint, moved aside just before the new one was renamed into place) is
    moved back to ``NAME`` when ``NAME`` is missing, and removed otherwise. Only the
    leftovers of dead processes: a live writer's (another process still training, PID
    alive) stay as they are, and readers ignore them (their names start with a dot).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return
    for entry in sorted(directory.iterdir()):
        name = entry.name
        if not name.startswith(".") or not entry.is_dir():
            continue
        base, sep, pid = name[1:].rpartition(".tmp-")
        if sep and pid.isdigit():
            if not pid_alive(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)
            continue
        base, sep, pid = name[1:].rpartition(".old-")
        if sep and pid.isdigit() and not pid_alive(int(pid)):
            target = directory / base
            if target.exists():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.rename(target)
