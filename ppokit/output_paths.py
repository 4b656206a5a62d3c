"""Where a command writes its output: checked before the work, write failures as UserErrors;
and where ppokit keeps its cache (:func:`cache_root`), one process filling an entry at a time
(:func:`cache_entry_lock`).

A read-only file system, a permission error or a full disk is the user's to fix (choose
another place), not a bug: :func:`writing_to` turns it into a one-line
:class:`~ppokit.errors.UserError` naming the path, and :func:`check_output_dir` finds it
before a long job (SFT, an export) rather than after.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError

from ppokit.errors import UserError

# Failures to write that are the user's to fix (where the output goes), not bugs.
WRITE_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EBUSY}


def cache_root() -> Path:
    """ppokit's own cache (GGUF models converted to directories, the CPU kernels it builds):
    ``$PPOKIT_CACHE``, else ``$XDG_CACHE_HOME/ppokit``, else ``~/.cache/ppokit``."""
    if os.environ.get("PPOKIT_CACHE"):
        return Path(os.environ["PPOKIT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ppokit"


@contextlib.contextmanager
def cache_entry_lock(entry: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<entry>.lock`` beside a cache entry, held while it is made: a
    second process (another run, a Ray worker starting beside it) waits, then finds the entry made.
    The kernel drops the lock when its process dies, so a killed maker never blocks the next.
    The entry's folder must exist."""
    fd = os.open(entry.parent / f"{entry.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def check_output_dir(out: Path, fix: str, *, replace: bool = False) -> None:
    """UserError unless a directory can be written to ``out``: new or empty (any contents with
    ``replace``), not a file, on a writable file system. Call it before the work, so that a bad
    output path fails at once rather than after the work is done; ``fix`` says what to do instead."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file, not a directory; {fix}")
    if not replace and out.is_dir() and any(out.iterdir()):
        raise UserError(f"{out} is not empty; {fix}")
    if out.is_dir() and os.path.ismount(out):  # the finished output replaces `out`: a mount point stays
        raise UserError(f"{out} is a mount point, which the output cannot replace; give a new directory inside it")
    parent = next((p for p in out.absolute().parents if p.exists()), Path("/"))  # where the first new entry goes
    with writing_to(out):
        try:
            os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
        except FileNotFoundError:  # an existing directory that takes no new entries (/proc, /sys)
            raise UserError(f"cannot write {out}: {parent} takes no new directories; {fix}") from None


@contextlib.contextmanager
def writing_to(out: Path) -> Iterator[None]:
    """Turn a read-only file system, a permission error or a full disk inside the block into a
    UserError naming ``out`` (the block is a write of ``out``)."""
    try:
        yield
    except (OSError, SafetensorError) as exc:
        code = exc.errno if isinstance(exc, OSError) else _os_error_code(str(exc))
        if code not in WRITE_ERRNOS:
            raise
        raise UserError(
            f"cannot write {out}: {os.strerror(code)}; choose a writable location with free space"
        ) from None


def _os_error_code(text: str) -> int | None:
    """The errno of an I/O error reported as text, e.g. by safetensors ("... (os error 28)")."""
    match = re.search(r"os error (\d+)", text)
    return int(match.group(1)) if match else None
